// thdpack/step.h: reading one training step's samples from a source (docs/design.md section 2,
// "Reading a step").
//
// `--global-batch N` means N samples per step for all DP replicas together. Sample i of the
// step (i = 0..N-1, in source order) is read by loader i mod DP. Sources are read in order and
// wrap around at their end (Reset(): the next epoch). `--global-batch all` (global_batch = 0)
// puts one whole epoch of the source in each step. `--global-batch-tokens B` counts the step in
// tokens instead: a step takes samples in source order while their real tokens stay within B
// (the first sample of a step always: one over B forms a step of its own, and the oversize
// policy decides whether it is trained), so the number of samples per step varies and depends
// only on the stream position and B (docs/design.md section 2). A token step also holds at
// least the samples its schedule needs (TokenSteps::min_samples: one for every microbatch of
// every replica), taken past B where B alone would give fewer.
//
// The samples of a step are handed to the scheduler in SCHEDULING order: loader 0's samples
// first (source positions 0, DP, 2*DP, ...), then loader 1's (1, DP+1, ...), and so on - the
// fixed order docs/design.md section 4 asks for. Every rank that reads the same source with the same
// arguments gets the same StepSamples, so ranks may each schedule instead of broadcasting.
//
// Sample ids are the source's ids: they keep counting across epochs, so they are unique within
// a step (and for the life of the source) even when a step wraps around. They increase within a
// step, consecutively except where the source passed over an empty document (a `megatron`
// dataset may hold some), whose id no sample takes; the step counts those in n_empty.
//
// Thread-safety: a StepReader holds the source's cursor; use one per thread.
#ifndef THDPACK_STEP_H_
#define THDPACK_STEP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "thdpack/data.h"
#include "thdpack/sample.h"
#include "thdpack/schedule.h"
#include "thdpack/status.h"

namespace thdpack {

// How a step counted in tokens ends (`--global-batch-tokens B`). The sample at the step's
// source position i is taken when i = 0, or when the step's samples so far that COUNT hold
// fewer than min_samples, or when the real tokens taken so far plus its own stay within B;
// the first sample refused ends the step (it is the next step's first). A sample counts unless
// it is longer than longest_counted (the oversize policy `skip` leaves those out of the plan,
// so they give no microbatch a sample). tokens 0: steps counted in samples (the rest unused).
struct TokenSteps {
  int64_t tokens = 0;         // B
  int64_t min_samples = 1;    // >= 1
  int64_t longest_counted = INT64_MAX;
};

// The source a step reads for a schedule: OpenSource(spec, options), cut into pieces of at
// most LongestKept(schedule) tokens (OpenSplitSource) under the oversize policy `split`. One
// place for the runner, `plan` and the run state's fingerprint. Errors: OpenSource's,
// LongestKept's.
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenStepSource(
    std::string_view spec, const SourceOptions& options, const ScheduleOptions& schedule);

// The token rule for a schedule: B, min_samples = MinStepSamples(options), longest_counted =
// LongestKept(options) under oversize skip. tokens 0 gives TokenSteps{} (steps in samples).
// Errors: B < 0 (InvalidArgument naming it), LongestKept's.
[[nodiscard]] Result<TokenSteps> TokenStepsFor(int64_t tokens, const ScheduleOptions& options);

struct StepSamples {
  int64_t step = 0;   // 0, 1, ... in the order Next() returned them
  int64_t epoch = 0;  // the source's epoch (0 = first pass) when the step's first sample was read
  // The step's samples in scheduling order (see top of file).
  std::vector<SampleLength> samples;
  // Empty documents the source passed over while the step was read (SampleSource::
  // skipped_empty): they are no samples and do not count toward N, but each used up its id.
  int64_t n_empty = 0;
  // What a splitting source (`--oversize split`) cut while the step was read: the samples cut,
  // their pieces (samples of the step like any other) and the targets lost at the cuts.
  SplitCounts split;
};

// One loader's share of a step (StepReader::NextShare).
struct StepShare {
  int64_t step = 0;
  int64_t epoch = 0;
  int64_t n = 0;         // samples in the step, every loader's together
  int64_t first_id = 0;  // the id of the step's first sample (source order)
  // The step's ids lie in [first_id, first_id + id_span), increasing in source order: every id
  // of that range is a sample of the step or an empty document the source passed over (the
  // step's n_empty counts those, with any before its first or after its last sample).
  // id_span < 2^31.
  int64_t id_span = 0;
  int64_t n_empty = 0;   // as StepSamples::n_empty
  SplitCounts split;     // as StepSamples::split
  std::vector<Sample> samples;  // the loader's own, in source order
};

class StepReader {
 public:
  // `source` is not owned and must outlive the reader; the reader must be its only user.
  // global_batch: N >= 1 samples per step, or 0 for "all" (one whole epoch per step: read with
  // NextLength() until the end of the epoch, then Reset()). dp_size >= 1.
  // tokens.tokens: B > 0 counts the step in tokens (TokenSteps; global_batch is then
  // ignored), 0 in samples.
  // Errors (InvalidArgument): null source, global_batch < 0, dp_size < 1, B < 0,
  // min_samples < 1, longest_counted < 1.
  [[nodiscard]] static Result<StepReader> Create(SampleSource* source, int64_t global_batch,
                                                 int dp_size, TokenSteps tokens = {});

  // The next step: N lengths read with NextLength(), wrapping around (Reset) at the end of the
  // source. Errors: the source's own errors (file, line, rule), and InvalidArgument naming the
  // spec when the source holds no sample at all.
  [[nodiscard]] Result<StepSamples> Next();

  // Loader `loader`'s share of the next step, as the step runner reads it (one reader for
  // `thdpack plan` and `thdpack run`): the same steps, epochs and wrap-around as Next(), but
  // the loader's own samples (source positions loader, loader + DP, ... of the step) are read
  // in full with SampleSource::Next and the others only with NextLength, which keeps every
  // loader's cursor in step. REQUIRES 0 <= loader < dp_size. Errors: as Next(); Internal when
  // the ids of a step do not increase (the runner addresses a sample by id - first_id);
  // OutOfRange over 2^31 - 1 samples or ids in a step.
  [[nodiscard]] Result<StepShare> NextShare(int loader);

  // Starts the reader at a run's position (thdpack/run_state.h), before its first step: it
  // reads step `next_step` next, after `consumed` samples of the stream. With the source's
  // cursor there (a saved state) the source seeks to it in O(1); without one the cursor is
  // computed from `consumed` (SampleSource::CursorAfter). consumed = -1: the position of step
  // `next_step` of a run from 0 at this global batch - next_step * N samples, or with "all"
  // (one epoch a step) the start of epoch next_step (CursorAtEpoch), or with tokens the end of
  // the first next_step token steps, found by reading their lengths (O(samples)). Errors: the
  // source's (Seek's Corruption naming the field, CursorAfter's OutOfRange), InvalidArgument for a
  // negative step or a count below -1, or a cursor whose samples() is not `consumed`.
  [[nodiscard]] Status Start(int64_t next_step, int64_t consumed,
                             const std::optional<SourceCursor>& cursor);

  // Where the reader stands after the steps read so far: the step it reads next and the
  // samples of the stream consumed (every sample of every step, the oversize ones a plan
  // leaves out included: they were read, and are reported, never read again).
  int64_t next_step() const { return next_step_; }
  int64_t consumed() const { return consumed_; }

  // The loader that reads sample `index_in_step` (its position in SOURCE order within the
  // step): index_in_step mod DP.
  int64_t LoaderOf(int64_t index_in_step) const { return index_in_step % dp_size_; }

  int64_t global_batch() const { return global_batch_; }
  int64_t global_batch_tokens() const { return tokens_.tokens; }
  int dp_size() const { return dp_size_; }

 private:
  StepReader(SampleSource* source, int64_t global_batch, int dp_size, TokenSteps tokens)
      : source_(source), global_batch_(global_batch), dp_size_(dp_size), tokens_(tokens) {}

  // The one read loop of a step (Next and NextShare): the sample at source position i is read
  // in full when full(i), else as its length, and handed to take(i, length, sample or null);
  // wraps around at the end of the source. Returns the step's epoch. Defined in the .cc.
  template <typename Full, typename Take>
  Result<int64_t> ReadStep(const Full& full, const Take& take);

  SampleSource* source_ = nullptr;
  int64_t last_n_empty_ = 0;  // of the step ReadStep read last
  SplitCounts last_split_;    // of the step ReadStep read last
  int64_t global_batch_ = 0;
  int dp_size_ = 1;
  TokenSteps tokens_;  // tokens > 0: steps counted in tokens
  int64_t next_step_ = 0;
  int64_t consumed_ = 0;
};

// Positions (in source order, 0..n-1) of the samples that `loader` reads in a step of n
// samples: loader, loader + DP, loader + 2*DP, ... < n, increasing. REQUIRES: n >= 0,
// dp_size >= 1, 0 <= loader < dp_size.
std::vector<int64_t> LoaderIndices(int64_t n, int dp_size, int loader);

// How many samples `loader` reads in a step of n samples: the size of LoaderIndices(...).
// Loader d's samples are the contiguous run [LoaderOffset(n, dp, d), + LoaderCount(n, dp, d))
// of StepSamples::samples. REQUIRES as LoaderIndices.
int64_t LoaderCount(int64_t n, int dp_size, int loader);
int64_t LoaderOffset(int64_t n, int dp_size, int loader);

// The caller-fed share (thdpack.torch's iterables and pack_batch, the tests' shares): a step of
// global_batch samples that starts at stream position p (the samples consumed before it) gives
// loader d the samples at positions p + d, p + d + DP, p + d + 2 DP, ... < p + global_batch
// (LoaderIndices), in that order, with their positions as ids (the file rule: first_id = p,
// n = global_batch, id_span 0); the next step starts at p + global_batch. The one place of the
// loader positions, their check, the per-loader counts and the loader a sample belongs to: the
// step runner's fed reads, step.unpack (UnpackStep) and thdpack.torch's loader_positions ask it.
// Thread-safety: a plain value.
class FedShares {
 public:
  // InvalidArgument naming the argument: global_batch < 1, dp_size < 1.
  [[nodiscard]] static Result<FedShares> Create(int64_t global_batch, int dp_size);

  int64_t global_batch() const { return global_batch_; }
  int dp_size() const { return dp_size_; }

  // How many samples loader `loader` gives each step: LoaderCount(global_batch, DP, loader).
  // REQUIRES: 0 <= loader < DP.
  int64_t Count(int loader) const;
  // The stream positions of loader `loader`'s samples in the step that starts at
  // first_position, in the order it gives them. REQUIRES: as Count, first_position >= 0.
  std::vector<int64_t> Positions(int64_t first_position, int loader) const;
  // Where the step after the one at first_position starts; and the inverse.
  int64_t NextFirst(int64_t first_position) const { return first_position + global_batch_; }
  int64_t FirstBefore(int64_t next_first) const { return next_first - global_batch_; }

  // The loader whose sample has id (= stream position) `id` in the step at first_position, and
  // the sample's index in that loader's share; nullopt when the id is not of the step.
  static constexpr int64_t kNotGiven = INT64_MIN;

  struct Slot {
    int loader = 0;
    int64_t index = 0;
  };
  std::optional<Slot> SlotOf(int64_t first_position, int64_t id) const;

  // Loader `loader`'s share of step `step` (at first_position) from the samples it gave, in its
  // order, their ids set. given_positions (empty, or one per sample): the stream position the
  // caller says sample k has, kNotGiven where it says none; checked. InvalidArgument naming the loader,
  // the step (and the sample) when it gave fewer or more than Count(loader) samples or a
  // position that is not its k-th. REQUIRES: 0 <= loader < DP, first_position >= 0.
  [[nodiscard]] Result<StepShare> Share(int64_t step, int64_t first_position, int loader,
                                        std::vector<Sample> samples,
                                        std::span<const int64_t> given_positions = {}) const;

 private:
  FedShares(int64_t global_batch, int dp_size) : global_batch_(global_batch), dp_size_(dp_size) {}
  int64_t global_batch_ = 1;
  int dp_size_ = 1;
};

// Reorders the n samples of a step from source order into scheduling order (loader 0's first,
// each loader's in source order). REQUIRES: dp_size >= 1.
std::vector<SampleLength> ToSchedulingOrder(const std::vector<SampleLength>& source_order,
                                            int dp_size);

}  // namespace thdpack

#endif  // THDPACK_STEP_H_
