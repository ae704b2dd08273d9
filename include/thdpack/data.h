// thdpack/data.h: streaming data sources (docs/design.md section 2).
//
// A SampleSource yields the samples of a data set one at a time, in a fixed order, epoch after
// epoch. Next() gives whole samples (tokens and target mask); NextLength() gives only
// (id, L, n_targets), which is all that planning needs, and for every source except `jsonl` it
// touches no token (lengths and histogram files never expand tokens; Megatron datasets read
// only their index). Both advance the same cursor.
//
// Sources, by spec string (see OpenSource and docs/data_sources.md):
//   mock                the built-in lognormal mock (kDefaultMockConfig)
//   mock:FILE.json      Megatron's mock SFT config: a lognormal draw or a lengths file
//   lengths:FILE        one positive length per line (tokens are mock)
//   histogram:FILE      `length,count` rows after a header (tokens are mock)
//   jsonl:FILE          one JSON object per line: "input_ids", optional "loss_mask"
//   megatron:PREFIX     Megatron-LM indexed dataset PREFIX.idx + PREFIX.bin (MMIDIDX v1)
//   blend:FILE.json     a weighted mixture of sources (thdpack/blend.h); blend:{...} inline
//   parquet:PATH        Parquet files (a file, a folder, a glob), through pyarrow (thdpack/arrow.h)
//   arrow:PATH          Arrow IPC files or streams (a datasets.save_to_disk folder); arrow:@NAME
//                       an in-memory Arrow producer (thdpack.arrow_source)
//
// Sample ids. The k-th sample a source returns since it was opened (k = 0, 1, ...) has id k:
// ids keep counting across Reset(), so after full epochs the id of the sample at position i of
// epoch e is e * size + i. Ids are therefore unique for the life of a source. (The one
// exception: an empty document of a `megatron` dataset uses up its id without being returned,
// so there size counts every document; see OpenMegatronSource.)
//
// Order. Samples come in file order (mock: index order), the same every epoch, unless
// SourceOptions::shuffle asks for a seeded permutation (a different one each epoch).
//
// Errors. Every malformed input is reported as a Status naming the file, the line (text files)
// or byte offset / document (binary files) and the rule broken. Opening a source validates what
// can be validated without reading every token: whole lengths and histogram files, the whole
// Megatron index. A source that returned an error is broken: every later call returns the same
// error.
//
// Thread-safety: a SampleSource is not thread-safe (it holds a cursor); use one per thread.
// The free functions are pure and thread-safe.
#ifndef THDPACK_DATA_H_
#define THDPACK_DATA_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/megatron_dataset.h"  // the writer and format of `megatron` sources
#include "thdpack/sample.h"
#include "thdpack/status.h"

namespace thdpack {

// Vocabulary that mock tokens are drawn from when SourceOptions::vocab_size is 0.
inline constexpr int64_t kDefaultMockVocab = 32000;
// Samples per epoch of a lognormal mock when SourceOptions::mock_num_samples is 0.
inline constexpr int64_t kDefaultMockNumSamples = 65536;
// Lengths are int32 everywhere in thdpack (cu_seqlens are int32).
inline constexpr int64_t kMaxSampleLength = 2147483647;

// A declared field (thdpack/fields.h) as a columnar source reads it from the column of its name:
// one row of `width` elements per token (per_token) or per sample, each element `elem_bytes`
// bytes from values of Arrow format `arrow_format` ("f" float32, "g" float64, "e" float16, "i"
// int32, "l" int64, "C" uint8, "b" bool, one byte each in the row). The step fills it from the
// run's fields (the data area knows no field schema).
struct SourceField {
  std::string name;
  bool per_token = true;
  std::string arrow_format;
  int64_t width = 1;
  size_t elem_bytes = 0;
};

struct SourceOptions {
  // Vocabulary size V. 0 (default) = unknown: token ids read from files are only checked to be
  // in [0, 2^31), and mock tokens are drawn from [0, kDefaultMockVocab). When > 0, every token
  // id read must be in [0, V) and mock tokens are drawn from [0, V).
  int64_t vocab_size = 0;
  // Seed of mock lengths, mock tokens and shuffling. Default 1234.
  uint64_t seed = 1234;
  // Samples per epoch of a lognormal mock (`mock`, or `mock:FILE` in "distribution" mode).
  // 0 (default) = kDefaultMockNumSamples. Ignored by every other source.
  int64_t mock_num_samples = 0;
  // Visit the samples of each epoch in a seeded pseudo-random order (a different permutation
  // for every epoch, from (seed, epoch)); no data is loaded to do it. Default false: file order.
  // Not available for `jsonl` (a streaming file has no random access): opening one with
  // shuffle = true is an error.
  bool shuffle = false;
  // The run's declared fields, read into Sample::fields in this order by the columnar sources
  // (parquet, arrow, and a blend of them); every other source refuses a non-empty list by name
  // (its samples carry no fields). Not part of the source's identity.
  std::vector<SourceField> fields;
};

// What planning needs of a sample.
struct SampleLength {
  int64_t id = 0;
  int64_t length = 0;     // L >= 1
  int64_t n_targets = 0;  // sum(target_mask[1:L]); L - 1 without a mask
  int32_t source = 0;     // the blend's source index (thdpack/blend.h); 0 for other sources
};

// A sample's encoder work (images and video, thdpack/media.h): its items' sums, the integers
// the encoder's cost (cost.h EncoderCost) is linear in, so a group's work is order-independent,
// like sum P and sum P^2.
struct EncoderWork {
  int64_t patches = 0;   // sum of t*h*w
  int64_t frame_sq = 0;  // sum of t*(h*w)^2
  friend bool operator==(const EncoderWork&, const EncoderWork&) = default;
};

// Where a source's cursor stands: enough to continue reading exactly there (SampleSource::Seek)
// in O(1), whatever came before. A plain value, the same on every rank that read the same source
// through the same steps; a run's state (thdpack/run_state.h) keeps it.
struct SourceCursor {
  int64_t epoch = 0;     // epoch(): Reset() calls so far
  int64_t position = 0;  // entries of this epoch's order passed (samples and empty documents)
  int64_t next_id = 0;   // the id the next entry takes (ids count every entry since opening)
  int64_t skipped_empty = 0;  // skipped_empty() at the cursor
  // jsonl only (0 for the other sources): the byte offset in the file of the next line to read,
  // and the lines read so far in this epoch (blank ones included), for messages.
  int64_t byte_offset = 0;
  int64_t line = 0;
  // Samples per epoch; -1 while unknown (jsonl before its first full pass) and for a blend.
  int64_t epoch_size = -1;
  // A blend (thdpack/blend.h) only: the cursor of each of its sources, and the units the rule
  // counted for each (samples, or tokens with weight_by tokens). A blend's own cursor counts
  // its samples: position = next_id = samples taken, epoch 0, skipped_empty 0 (its sources'
  // empty documents are in their cursors).
  std::vector<SourceCursor> parts;
  std::vector<int64_t> taken;
  // A splitting source (OpenSplitSource) only: {piece, extra ids, split samples, pieces, lost
  // targets} - the next piece of the sample being split (0: none pending), the ids its pieces
  // added before that sample, and its SplitCounts there; `parts` then holds the one cursor of
  // the source it wraps (before that sample when a piece is pending), and `taken` is empty.
  std::vector<int64_t> split;

  // Samples returned since the source was opened: every id is a sample or an empty document.
  int64_t samples() const { return next_id - skipped_empty; }
  friend bool operator==(const SourceCursor&, const SourceCursor&) = default;
};

// ---- A cursor's fields, described once. ----
// Every field of SourceCursor as the run state (thdpack/run_state.h, JSON) and the step's
// messages (thdpack/step_wire.h, binary) write it: both encoders and both decoders walk this
// table, and both decoders end with CheckSourceCursor, so a new field of SourceCursor is one
// row here (and a new version of each format), never a second codec.
//
// A cursor has one shape: plain (the integers only), a blend's (`parts` and `taken`) or a
// splitting source's (`split`, and the cursor it wraps, `inner`, held as parts[0]). A row is
// in every cursor (shape kPlain) or only in the cursors of its shape.
enum class CursorShape : uint8_t { kPlain = 0, kBlend = 1, kSplit = 2 };
enum class CursorFieldKind : uint8_t {
  kInt,      // one int64 (`value`)
  kInts,     // a list of int64 (`values`)
  kCursor,   // one cursor: parts[0]
  kCursors,  // a list of cursors: parts
};
struct CursorField {
  std::string_view name;  // the key in the run state, the name in errors
  CursorFieldKind kind;
  CursorShape shape;
  int64_t min;    // each integer's range (kInt, kInts), inclusive
  int64_t max;
  size_t count;   // kInts: the exact number of values, 0 for any
  int64_t SourceCursor::*value;                // kInt, else null
  std::vector<int64_t> SourceCursor::*values;  // kInts, else null
};

// The rows, in the order both formats write them: the integers, then the rows of each shape.
std::span<const CursorField> SourceCursorFields();

// The shape `c` has: kSplit when `split` is set, kBlend when `parts` or `taken` is, kPlain
// otherwise.
CursorShape ShapeOf(const SourceCursor& c);

// Every rule of the table on `c` and its nested cursors: each integer in its row's range, each
// fixed list of its count, the rows of other shapes empty, `taken` as long as `parts`, a blend
// only at the top (a blend holds no blend; `inner` keeps its wrapper's level), a splitting
// source's `inner` not a splitting source's cursor. Corruption naming the field by its path
// (`path` is the cursor's own, e.g. "cursor"; "cursor.inner.parts[1].epoch") and the rule.
[[nodiscard]] Status CheckSourceCursor(const SourceCursor& c, std::string_view path);

// The deepest nesting a cursor may have (split, its blend, a part, the part's own inner); the
// decoders refuse deeper input before they recurse.
inline constexpr int kMaxCursorNesting = 4;

// What a splitting source (OpenSplitSource) cut since it was opened: the samples split, the
// pieces they became, and the targets lost at the cuts (each cut's first token was a target
// of the token before it, now in another piece).
struct SplitCounts {
  int64_t samples = 0;
  int64_t pieces = 0;
  int64_t lost_targets = 0;
  friend bool operator==(const SplitCounts&, const SplitCounts&) = default;
};

// The streaming interface every source implements.
class SampleSource {
 public:
  virtual ~SampleSource() = default;

  // The next sample of this epoch, or nullopt at the end of the epoch (call Reset() to start
  // the next one). Samples have L >= 1; target_mask is empty (all ones) unless the source has
  // one.
  [[nodiscard]] virtual Result<std::optional<Sample>> Next() = 0;

  // Like Next() (same cursor, same ids), but only (id, L, n_targets). Token values are not
  // read, and so not checked, except by `jsonl`, which parses its whole line.
  [[nodiscard]] virtual Result<std::optional<SampleLength>> NextLength() = 0;

  // Up to out.size() lengths at once: exactly what as many NextLength() calls would give (same
  // cursor, ids, skipped empty documents and errors), written to out[0, n) in order. Returns
  // n, which is below out.size() only at the end of the epoch (0 when already there; Reset()
  // starts the next). On an error the source is broken as after NextLength's, and out holds
  // nothing to use. The default calls NextLength() n times (the plain reference); sources
  // with random access (all but `jsonl`) override it with one tight loop per batch.
  [[nodiscard]] virtual Result<int64_t> NextLengths(std::span<SampleLength> out);

  // Rewinds to the start of the next epoch (also allowed before the end of this one). Ids keep
  // counting from where they were.
  [[nodiscard]] virtual Status Reset() = 0;

  // Samples per epoch when known: always, except for `jsonl` before its first full pass.
  virtual std::optional<int64_t> size_hint() const = 0;

  // 0 for the first pass, +1 at every Reset().
  virtual int64_t epoch() const = 0;

  // The spec the source was opened with, e.g. "jsonl:/data/train.jsonl", for messages.
  virtual const std::string& spec() const = 0;

  // Empty documents passed over since the source was opened (every epoch counts again). Only a
  // `megatron` dataset holds any (see OpenMegatronSource); 0 for every other source.
  virtual int64_t skipped_empty() const { return 0; }

  // A source without an end: Next() never returns nullopt (a blend, which starts the next epoch
  // of a source that runs out). Such a source has no epoch to read whole ("--global-batch all").
  virtual bool endless() const { return false; }

  // ---- Resuming (docs/data_sources.md, "Positions and resuming") ----
  // Every source of this file implements these; the defaults are for sources that cannot seek
  // (a test's fake): cursor() then holds epoch() and skipped_empty() only, and the others are
  // Unimplemented errors naming the spec.

  // The cursor now: after the samples read so far (and the empty documents passed over).
  virtual SourceCursor cursor() const;

  // Moves the cursor to `c`, as if the source had been read from its opening up to there (Next
  // and NextLength continue exactly as they would have; a broken source stays broken). `c` must
  // be a cursor this source could hold: Corruption naming the field and the rule otherwise (an
  // epoch size that is not this data's, a position past the end of the epoch, ids that do not
  // add up, a jsonl offset past the end of the file or not at the start of a line). O(1), plus
  // O(E log E) for a shuffled `megatron` dataset with E empty documents.
  [[nodiscard]] virtual Status Seek(const SourceCursor& c);

  // The cursor after the first `samples` samples of the stream (read from the opening, epoch
  // after epoch, a Reset() at each end): just after the last of them, the empty documents that
  // follow it not yet passed over. Does not move this source. OutOfRange when `samples` < 0 or
  // the ids would overflow int64. O(1) for the sources with random access (O(E log E) with
  // empty documents); `jsonl` reads the line boundaries of the file up to there (at most two
  // passes over it), since it has no index.
  [[nodiscard]] virtual Result<SourceCursor> CursorAfter(int64_t samples);

  // The cursor at the start of epoch `epoch` (after that many Reset() calls at the ends of
  // full epochs): what a step reader holds after `epoch` steps of `--global-batch all`. jsonl
  // needs its epoch size for an epoch > 0 and reads the file once when it is not yet known.
  [[nodiscard]] virtual Result<SourceCursor> CursorAtEpoch(int64_t epoch);

  // What identifies the samples this source yields, for a run state's fingerprint: one line of
  // text that changes when they could change (the kind, the data's size and a 64-bit hash of
  // what decides the samples; the path is not part of it, so moved files keep their identity).
  // Per kind: the mock's parameters; the lengths or histogram rows; a Megatron index whole and
  // the size of its .bin; a jsonl file's size and its first and last 64 KiB. Computed on the
  // first call (a pass over the index or rows) and kept.
  [[nodiscard]] virtual Result<std::string> Identity();

  // The samples of an epoch when the options decide them (the lognormal mock draws
  // SourceOptions::mock_num_samples, its default resolved); nullopt for a source whose samples
  // are data. Part of a run's fingerprint where set.
  virtual std::optional<int64_t> drawn_samples() const { return std::nullopt; }

  // What a splitting source cut since it was opened (kept in its cursor, so Seek restores it);
  // zeros for every other source.
  virtual SplitCounts split_counts() const { return {}; }
};

// What a source is, as a value: the kind of its spec (its prefix, parsed once), or kFed for
// samples the caller hands over (thdpack.torch's iterables: no spec, no identity).
enum class SourceKind {
  kMock, kLengths, kHistogram, kJsonl, kMegatron, kBlend, kFed, kParquet, kArrow
};
// "mock", "lengths", "histogram", "jsonl", "megatron", "blend", "fed", "parquet", "arrow": the
// kind's name in a run state and in messages.
std::string_view SourceKindName(SourceKind kind);
// A kind by its name (the inverse); InvalidArgument naming the text otherwise.
[[nodiscard]] Result<SourceKind> SourceKindFromName(std::string_view name);
// The kind of a spec string ("mock" alone, or KIND:PATH); InvalidArgument naming the spec for
// an unknown kind or a missing path. Never kFed.
[[nodiscard]] Result<SourceKind> SourceKindOf(std::string_view spec);
// The path of a KIND:PATH spec ("" for "mock" alone).
std::string_view SourcePathOf(std::string_view spec);

// Opens a source from its spec string (table at the top of this file). An unknown kind or an
// empty path is an InvalidArgument error that names the spec.
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenSource(std::string_view spec,
                                                               const SourceOptions& options = {});

// Long samples cut into pieces (`--oversize split`, docs/scheduling.md "Long samples"): every
// sample of `inner` longer than `longest` (>= 1) becomes ceil(L / longest) samples in its place,
// piece k holding tokens [k*longest, min(L, (k+1)*longest)) and the same part of its target
// mask, in order; shorter samples pass unchanged. A piece is a sample like any other - a
// sequence of its own, its positions from 0, its first token no target - so the stream has
// more samples than `inner`: ids count the pieces (a sample's id is its id in `inner` plus the
// pieces before it beyond each split sample's first; an empty document keeps its gap), and
// every count of samples (a step's, a run's position) counts pieces. The target of each cut's
// first token is lost (SplitCounts::lost_targets). The cursor holds the wrapped source's cursor
// and the split's state; Seek to a cursor inside a split sample reads that sample again.
// CursorAfter and CursorAtEpoch read lengths from the opening (O(samples)); size_hint is
// unknown; spec, Identity, epoch, skipped_empty, endless and drawn_samples are inner's. Fed
// samples carry no spec: a caller splits its own. REQUIRES inner non-null (InvalidArgument).
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenSplitSource(
    std::unique_ptr<SampleSource> inner, int64_t longest);

// ---------------------------------------------------------------------------------------------
// mock

// Megatron's mock SFT config. Two modes:
//   {"mode":"distribution","type":"lognormal","min_seq_len":a,"max_seq_len":b,
//    "mean_seq_len":m,"lognormal_sigma":s}
//     L = int(clip(exp(mu + s*z), a, b)), z ~ N(0,1), mu = ln(m) - s^2/2 (so E[exp] = m).
//   {"mode":"file","path":"lengths.csv"}
//     lengths one per line; a relative path is resolved against the JSON file's folder; a
//     first line that does not start with a digit or sign is a header.
struct MockConfig {
  enum class Mode { kDistribution, kFile };
  Mode mode = Mode::kDistribution;
  // Distribution mode (REQUIRES 1 <= min_seq_len <= max_seq_len <= kMaxSampleLength,
  // mean_seq_len > 0, lognormal_sigma >= 0, all finite).
  int64_t min_seq_len = 0;
  int64_t max_seq_len = 0;
  double mean_seq_len = 0;
  double lognormal_sigma = 0;
  // File mode: the lengths file, already resolved against the JSON file's folder.
  std::string path;
};

// The built-in default mock (`mock` without a file): lognormal, min 16, max 16384, mean 2048,
// sigma 1.0 - a long-tailed SFT-like mix where about 0.5% of the draws hit the 16K cap.
inline const MockConfig kDefaultMockConfig{MockConfig::Mode::kDistribution, 16, 16384, 2048.0,
                                           1.0, ""};

// Parses and validates a mock config JSON file; errors name the file and the field.
[[nodiscard]] Result<MockConfig> ReadMockConfigFile(const std::string& path);
// Same for JSON text; `name` stands for the file in messages, `base_dir` resolves "path".
[[nodiscard]] Result<MockConfig> ParseMockConfig(std::string_view json_text,
                                                 std::string_view name,
                                                 std::string_view base_dir);
// REQUIRES config valid (as ParseMockConfig checks). Distribution mode only: the length of
// sample `index` of a lognormal mock. A pure function of (config, seed, index), identical on
// every platform whose libm is correctly rounded for exp/log/cos (glibc).
int64_t MockLength(const MockConfig& config, uint64_t seed, int64_t index);

// Mock tokens of sample `id`: L pseudo-random ids in [0, vocab), a pure function of
// (seed, id, L, vocab) with integer arithmetic only (identical on every platform), so any rank
// can regenerate any sample. REQUIRES length >= 0, vocab >= 1.
std::vector<TokenId> MockTokens(uint64_t seed, int64_t id, int64_t length, int64_t vocab);
// Same, into a caller-provided span of L tokens.
void FillMockTokens(uint64_t seed, int64_t id, int64_t vocab, std::span<TokenId> out);

// Opens a mock source for a parsed config (the factory's `mock` and `mock:FILE`).
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenMockSource(const MockConfig& config,
                                                                   const SourceOptions& options,
                                                                   std::string spec = "mock");

// ---------------------------------------------------------------------------------------------
// lengths and histograms (planning data; tokens are MockTokens(seed, id, L, vocab))

// Reads a lengths file: one integer in [1, kMaxSampleLength] per line, surrounding spaces and
// a trailing '\r' ignored, a blank last line allowed (blank lines elsewhere are errors). When
// allow_header, a first line that does not start with a digit or sign is a header and skipped.
// Errors name file:line and the text.
[[nodiscard]] Result<std::vector<int32_t>> ReadLengthsFile(const std::string& path,
                                                          bool allow_header = true);

struct HistogramRow {
  int64_t length = 0;  // in [1, kMaxSampleLength]
  int64_t count = 0;   // >= 0
};
struct Histogram {
  std::vector<HistogramRow> rows;  // lengths strictly increasing
  int64_t num_sequences = 0;       // sum of counts
  int64_t num_tokens = 0;          // sum of length * count
};

// Reads a `length,count` histogram: a header line (required, not numeric), then one row per
// line, lengths strictly increasing, counts >= 0 (zero rows allowed); totals must fit int64.
// Errors name file:line and the text.
[[nodiscard]] Result<Histogram> ReadHistogramFile(const std::string& path);

// A source over a histogram: row after row, `count` samples of `length` each (or a seeded
// permutation of them with shuffle). Holds the rows only, never one entry per sequence.
class HistogramSource : public SampleSource {
 public:
  virtual const Histogram& histogram() const = 0;
};

// REQUIRES: the file holds at least one sample (an error otherwise, as for every source).
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenLengthsSource(
    const std::string& path, const SourceOptions& options = {});
[[nodiscard]] Result<std::unique_ptr<HistogramSource>> OpenHistogramSource(
    const std::string& path, const SourceOptions& options = {});

// ---------------------------------------------------------------------------------------------
// jsonl

// Opens a JSON-lines file. Each non-blank line is an object with "input_ids" (non-empty array
// of integers in [0, vocab) or [0, 2^31)) and optional "loss_mask" (array of 0/1, same length,
// token-aligned like target_mask); other keys are ignored. Whitespace-only lines are skipped
// (they still count in line numbers). Read line by line; nothing but the current line is held.
// A file without any sample is an error at the end of the first pass.
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenJsonlSource(
    const std::string& path, const SourceOptions& options = {});

// Parses one JSONL line into *out (tokens and target_mask; id untouched). `where` names the
// line in messages ("FILE:LINE"). vocab_size as in SourceOptions. Exposed for tests and tools.
[[nodiscard]] Status ParseJsonlLine(std::string_view line, int64_t vocab_size,
                                    std::string_view where, Sample* out);
// The plain nlohmann_json parser that ParseJsonlLine's fast path is checked against.
[[nodiscard]] Status ParseJsonlLineReference(std::string_view line, int64_t vocab_size,
                                             std::string_view where, Sample* out);

// ---------------------------------------------------------------------------------------------
// megatron

// Opens PREFIX.idx and PREFIX.bin (both memory-mapped, read-only) and validates the whole
// index against both file sizes; each document (its sequences, concatenated) is a sample.
// See thdpack/megatron_dataset.h for the format and the writer.
//
// Empty documents (no sequence, or only sequences of length 0: Megatron's preprocess_data.py
// writes one for a text that tokenizes to nothing) are read as Megatron reads them, and hold
// nothing to train on: Next() and NextLength() pass over them, each still using up its id (so
// a sample's id stays e * documents + its document index after e full epochs), and
// skipped_empty() counts them. size_hint() is the number of non-empty documents (the samples
// of an epoch). A dataset whose every document is empty is an error (no samples).
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenMegatronSource(
    const std::string& prefix, const SourceOptions& options = {});

}  // namespace thdpack

#endif  // THDPACK_DATA_H_
