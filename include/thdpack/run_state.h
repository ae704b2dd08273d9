// thdpack/run_state.h: the state of a training run - where its next step starts - as one small
// record that outlives the process (docs/design.md section 14, docs/distributed.md "Resuming a
// run").
//
// A run reads one stream of samples: the source's samples in order, epoch after epoch, step s
// taking the next global batch from it. Where that stream stands after a step is a RunState:
// the next step's index, the samples consumed so far and the source's cursor there (O(1) to
// seek), plus a fingerprint of everything that decides which samples come next - the data's
// identity, the seed, the shuffle, the vocabulary, the mock's epoch size and, under the `skip`
// oversize policy, the longest sample a step keeps. Nothing of the topology is in it: the
// samples of a step do not depend on DP, CP, TP, PP, SP or the scheduler, only how they are
// packed and placed does, so a state resumes on any topology (the elastic rule). The global
// batch is not in it either: a run may change it on resume (a batch-size ramp-up), the next
// step then takes its samples from the saved stream position.
//
// The record is one line of JSON with a format name, a version and a checksum (a 64-bit hash
// of the rest, in canonical form): a reader refuses a truncated or edited record, a newer
// version, and a state that does not fit the run (another file, seed, shuffle, ...), naming
// the field and both values; it never silently repeats or skips samples. Files are written
// atomically (a new file, synced, then renamed over the old one), so a process killed at any
// moment leaves the previous state or the new one.
//
// Thread-safety: plain values and pure functions; the file functions touch only their paths.
#ifndef THDPACK_RUN_STATE_H_
#define THDPACK_RUN_STATE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "thdpack/data.h"
#include "thdpack/schedule.h"
#include "thdpack/status.h"

namespace thdpack {

// The version written; readers accept it and refuse newer ones (Unimplemented, naming both).
inline constexpr int64_t kRunStateVersion = 1;

// What must not change under a saved state: the data and the options that decide which
// samples the stream yields and which of them a step keeps.
struct DataFingerprint {
  // The source's kind (thdpack/data.h; its name in the record), kFed for samples the caller
  // feeds (thdpack.torch's iterables: thdpack cannot see their data).
  SourceKind source = SourceKind::kFed;
  // The spec as given: for messages only, not compared (a file moved to another node or path
  // keeps its identity).
  std::string spec;
  std::string identity;  // SampleSource::Identity(); empty for "fed"
  uint64_t seed = 0;     // SourceOptions::seed (mock lengths and tokens, the shuffle)
  bool shuffle = false;
  int64_t vocab_size = 0;     // SourceOptions::vocab_size (checks token ids; draws mock tokens)
  // The epoch size of a source that draws its samples from the options
  // (SampleSource::drawn_samples: the lognormal mock); 0 for every other source.
  int64_t mock_samples = 0;
  std::string oversize = "error";  // the oversize policy, "error" or "skip"
  // Under "skip": the longest sample a step keeps (LongestKept of the schedule options), -1
  // under "error" (no sample is ever left out: a longer one is an error, on any budget).
  int64_t longest_kept = -1;

  friend bool operator==(const DataFingerprint&, const DataFingerprint&) = default;
};

struct RunState {
  int64_t next_step = 0;  // the step the run continues with
  int64_t consumed = 0;   // samples of the stream the steps before it took: positions [0, consumed)
  // The source's cursor after them (its samples() == consumed): every state a run saves has
  // one, and seeks in O(1). None for a fed source, whose next samples are positions consumed,
  // consumed + 1, ... of the caller's stream; none either in a state made from a count alone
  // (RunStateAt: a Megatron checkpoint's consumed_train_samples), whose cursor each reader
  // computes (SampleSource::CursorAfter).
  std::optional<SourceCursor> cursor;
  DataFingerprint data;

  friend bool operator==(const RunState&, const RunState&) = default;
};

// The state of the same run at another position, given by a count alone: step `next_step`
// after `consumed` samples, without a cursor (each reading rank computes it on resume). For a
// checkpoint that kept only a sample count (Megatron's consumed_train_samples and iteration).
// InvalidArgument for negative values.
[[nodiscard]] Result<RunState> RunStateAt(const RunState& run, int64_t next_step,
                                          int64_t consumed);

// The fingerprint of a run reading `source` (null: fed by the caller) with these options.
// Errors: the source's Identity(), LongestKept's.
[[nodiscard]] Result<DataFingerprint> MakeFingerprint(SampleSource* source, std::string_view spec,
                                                      const SourceOptions& source_options,
                                                      const ScheduleOptions& schedule);

// Whether a run whose fingerprint is `now` may continue from a state saved with `saved`: OK,
// or InvalidArgument naming the first field that differs, both values, and why it matters,
// e.g. `resume: the state was saved with seed 1234, this run has seed 99 (the seed decides
// the mock lengths and tokens and the shuffled order: resume with --seed 1234)`.
[[nodiscard]] Status CheckResume(const DataFingerprint& saved, const DataFingerprint& now);

// The record as one line of JSON (no newline): {"checksum":"<16 hex>","consumed":...,
// "cursor":{...} or null,"data":{...},"format":"thdpack run state","next_step":...,
// "version":1}, keys sorted (the canonical form the checksum covers).
std::string RunStateToJson(const RunState& state);

// Parses a record. Errors: Corruption naming the field and the rule (not JSON - a truncated
// record -, a field missing or of the wrong type, a checksum that does not match the contents
// - an edited or damaged record -, values that contradict each other); Unimplemented for a
// version newer than kRunStateVersion. `where` (a file name) starts every message.
[[nodiscard]] Result<RunState> ParseRunState(std::string_view text,
                                             std::string_view where = "run state");

// Writes the record to `path` atomically: `path`.tmp.<pid> written and fsync'd, renamed over
// `path`, and the folder fsync'd. IOError naming the path on any failure (the old file, if
// any, is then untouched).
[[nodiscard]] Status WriteRunStateFile(const std::string& path, const RunState& state);

// Reads a record written by WriteRunStateFile. IOError when it cannot be read; ParseRunState's
// errors, naming the path.
[[nodiscard]] Result<RunState> ReadRunStateFile(const std::string& path);

}  // namespace thdpack

#endif  // THDPACK_RUN_STATE_H_
