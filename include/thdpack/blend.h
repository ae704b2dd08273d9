// thdpack/blend.h: weighted mixtures of data sources (docs/data_sources.md, "blend:FILE.json").
//
// A blend reads several sources, each with a weight, as one endless stream: which source gives
// the next sample follows Megatron-LM's rule (build_blending_indices, megatron/core/datasets/
// helpers.cpp) exactly - the source with the largest error w_d * max(n, 1) - count_d, ties to
// the lower index, with the weights normalised as Megatron's `normalize` does it (float64,
// numpy.sum's pairwise order) - but without Megatron's index of the whole run: the rule's state
// is its position n and D counts, the next source costs O(sqrt(D)) (bounds kept per block of
// sources), and a saved state resumes in O(D). With weight_by tokens
// the same rule runs on token counts: n is the tokens taken so far and count_d those taken from
// source d, so the weights are the fractions of tokens each source contributes.
//
// Thread-safety: LargestErrorRule is a value used by one thread at a time; the free functions
// are pure.
#ifndef THDPACK_BLEND_H_
#define THDPACK_BLEND_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/data.h"
#include "thdpack/status.h"

namespace thdpack {

// ---------------------------------------------------------------------------------------------
// The blend source: `blend:FILE.json`, or the same JSON inline (`blend:{"sources": ...}`).
//
//   {"sources": [{"data": "<source spec>", "weight": <number > 0>,
//                 "shuffle": <bool, optional>, "seed": <uint, optional>}, ...],
//    "weight_by": "samples" | "tokens"}                 (default "samples")
//
// Any kind but a blend may be mixed (mock, lengths, histogram, jsonl, megatron), each with its
// own shuffle and seed (by default the blend's SourceOptions'), its epochs and its ids; a
// source that runs out starts its next epoch, so a blend never ends (it has no epoch:
// `--global-batch all` is refused). A relative path in a spec read from a file is resolved
// against the file's folder. Sample k of the blend has id k; Sample::source and
// SampleLength::source give the index of its source in the list.

enum class BlendWeightBy { kSamples, kTokens };
std::string_view BlendWeightByName(BlendWeightBy by);

struct BlendEntry {
  std::string data;            // a source spec, not a blend; relative paths already resolved
  double weight = 0;           // finite, > 0 (not normalised)
  std::optional<bool> shuffle;  // else the blend's SourceOptions::shuffle
  std::optional<uint64_t> seed;  // else the blend's SourceOptions::seed
};

struct BlendConfig {
  std::vector<BlendEntry> sources;  // non-empty
  BlendWeightBy weight_by = BlendWeightBy::kSamples;
};

// Parses a blend's JSON. `name` (the file, or "inline blend") starts every message, which names
// the field and the rule: "mix.json: sources[2].weight = -1: a weight is a finite number > 0".
// base_dir resolves relative paths ("" leaves them). Errors (InvalidArgument): not JSON, no or
// an empty "sources", a source that is not an object, a missing or non-string "data", a nested
// blend, a weight that is missing, not a number, <= 0 or not finite, "shuffle" not a bool,
// "seed" not an unsigned integer, unknown keys, "weight_by" not samples or tokens, more than
// 2^20 sources.
[[nodiscard]] Result<BlendConfig> ParseBlendConfig(std::string_view json, std::string_view name,
                                                   std::string_view base_dir);

// The config of a `blend:` spec's text after the prefix: JSON when it starts with '{', else a
// file read and parsed (IOError naming it when it cannot be read).
[[nodiscard]] Result<BlendConfig> ReadBlendSpec(std::string_view text);

// Opens every source of the blend (each with the blend's options and its own shuffle and
// seed); the first that fails is the error, named "sources[i] (<spec>): ...". spec names the
// blend in messages.
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenBlendSource(const BlendConfig& config,
                                                                    const SourceOptions& options,
                                                                    std::string spec);

// ---------------------------------------------------------------------------------------------
// The rule.

// Megatron's normalize(weights): w / numpy.sum(w) in float64, the sum taken in numpy's pairwise
// order (blocks of 8 accumulators up to 128 values, halves above), so that the normalised
// weights are Megatron's to the last bit. REQUIRES weights non-empty.
std::vector<double> NormalizeWeights(std::span<const double> weights);

// The rule as Megatron writes it, one source at a time: the plain reference. With weights
// w (normalised), counts c and position n: argmax_d w_d * max(n, 1) - c_d in float64, the
// first maximum on ties. REQUIRES w and c of the same size >= 1.
int LargestErrorReference(std::span<const double> weights, std::span<const int64_t> counts,
                          int64_t n);

// The rule with its state: the position n and the counts. Next() is what
// LargestErrorReference(weights, counts, n) returns, to the bit (the tests compare the two on
// random weights, ties and weights of very different sizes); Take(d, amount) moves on.
//
// Below kBlockedMinSources sources it scans them, as Megatron does. Above, the sources are cut
// into blocks of about sqrt(D), sorted by weight, and each block keeps the largest error it
// had when last scanned, at position x0: no error of the block can exceed that plus the
// block's largest weight times (x - x0), since errors grow by their weight and only fall when
// a source is chosen. A choice scans the bounds (D / B), then only the blocks whose bound
// reaches the best error found (each B): about 2 sqrt(D) errors instead of D, and the same
// answer, ties included (the bounds carry a rounding slack far above float64's error).
class LargestErrorRule {
 public:
  static constexpr int kBlockedMinSources = 64;

  // weights: normalised (NormalizeWeights), each finite and > 0. counts: [D] >= 0, or empty for
  // zeros; n: the position, >= 0 (with counts from a blend by samples, their sum). Errors
  // (InvalidArgument) name the argument and index.
  [[nodiscard]] static Result<LargestErrorRule> Create(std::vector<double> weights,
                                                       std::vector<int64_t> counts = {},
                                                       int64_t n = 0);

  // The source of the next unit (sample, or the sample that takes the next tokens).
  int Next();
  // Source d took `amount` units (1 a sample; its length by tokens). REQUIRES amount >= 1,
  // 0 <= d < size().
  void Take(int d, int64_t amount);

  int size() const { return static_cast<int>(weights_.size()); }
  int64_t position() const { return n_; }
  const std::vector<int64_t>& counts() const { return counts_; }
  const std::vector<double>& weights() const { return weights_; }

 private:
  LargestErrorRule() = default;
  // Block k's errors at x: its largest, kept as the block's bound from x, and (when it reaches
  // *best) the source that has it, the lowest index on ties.
  void Scan(size_t k, int64_t x, double* best, int* best_source);
  int64_t X() const { return n_ > 1 ? n_ : 1; }

  std::vector<double> weights_;
  std::vector<int64_t> counts_;
  int64_t n_ = 0;
  // Blocks (D >= kBlockedMinSources): the sources by decreasing weight cut into blocks of
  // about sqrt(D), each block in increasing index order; slot j holds source order_[j], its
  // weight and its count as float64 (block k: slots [begin_[k], begin_[k+1])), slot_[d] is
  // source d's slot. Per block its largest weight, its largest error when last scanned and the
  // position of that scan.
  std::vector<int32_t> order_;
  std::vector<int32_t> slot_;
  std::vector<double> slot_weight_;
  std::vector<double> slot_count_;
  std::vector<size_t> begin_;
  std::vector<double> block_weight_;
  std::vector<double> block_error_;
  std::vector<int64_t> block_x_;
  std::vector<double> errors_;  // scratch: one block's errors
};

}  // namespace thdpack

#endif  // THDPACK_BLEND_H_
