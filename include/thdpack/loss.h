// thdpack/loss.h: cross-entropy on context-parallel (CP) logit shards, its gradient, the
// vocab-parallel (TP) variant, and the loss statistics of docs/design.md section 8.
//
// Legend (docs/design.md): T tokens of this rank's shard (T/CP of the packed microbatch), V the
// vocabulary (V/TP columns per rank when vocab-parallel), N the GLOBAL loss-token count of the
// step (from the metadata, known before any forward pass), CP, TP, DP group sizes.
//
// Math, per token t with logits z[t, 0..V-1], label y and counted(t):
//   lse       = log sum_v exp(z_v)                 (stable: max + log sum exp(z - max))
//   logprob   = z_y - lse                          (log p(y))
//   loss      = -logprob = lse - z_y
//   entropy   = -sum_v p_v log p_v = lse - sum_v p_v z_v
//   grad[t,v] = grad_scale * (p_v - [v == y]) / N  if counted(t), else 0 (the whole row).
// counted(t) = label[t] != -100 AND loss_mask[t] != 0. An uncounted token contributes nothing:
// no loss, no entropy, a zero gradient row; its label is not looked at.
// Accumulation: fp32 for float32 and bfloat16 logits, fp64 for float64 logits. The gradient is
// written in the logits' dtype (bfloat16: round to nearest even).
//
// Gradient factor. The step loss is L = (sum over every (dp, cp) rank and microbatch of its
// masked token-loss sum) / N. The loss of one rank's shard, local_sum / N, is that rank's SHARE:
// the gradients of the shares SUMMED over DP x CP are exactly the gradient of L. A framework
// that AVERAGES gradients over DP x CP (Megatron DDP does, over its data-parallel group with
// CP folded in) must multiply each share by DP*CP: pass grad_scale = GradientFactor(...) below.
// TP ranks hold identical copies of the CP-local labels and count once (not multiplied by TP).
//
// Vocab-parallel (logits [T/CP, V/TP], Megatron's output layer): three phases, with the
// communication left to the caller's own process group:
//   1. VocabParallelPartials: per token, this rank's {max m, sum exp(z - m),
//      sum exp(z - m)*(z - m), target logit or -inf when the label is not in this rank's
//      columns}: 4 doubles per token.
//   2. the caller all-gathers the partials over the TP group (4*8 bytes per token per rank), then
//      CombineVocabPartials (a pure function; every TP rank computes the same result).
//   3. VocabParallelGrad: the gradient of the local columns given the combined lse.
// The result equals CrossEntropy on the unsplit logits (to fp32 rounding).
//
// Threads: CrossEntropy splits token rows over num_threads std::threads; each token is computed
// by one thread with the same code, and sums are taken in token order afterwards, so every
// output is bit-identical whatever the thread count. CrossEntropyReference is the plain fp64,
// single-thread definition every fast path is tested against.
//
// Thread-safety: pure functions (no global state); concurrent calls are safe when output spans
// do not overlap.
#ifndef THDPACK_LOSS_H_
#define THDPACK_LOSS_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "thdpack/status.h"

namespace thdpack {

// ---------------------------------------------------------------------------------------------
// Dtypes.

enum class LogitsDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat64 = 2 };

// "float32", "bfloat16", "float64"; "invalid" for a value outside the enum.
std::string_view LogitsDtypeName(LogitsDtype dtype);
// Bytes per element: 4, 2, 8. InvalidArgument for a value outside the enum.
[[nodiscard]] Result<int64_t> LogitsDtypeSize(LogitsDtype dtype);
// Parses "float32"/"fp32", "bfloat16"/"bf16", "float64"/"fp64" (NumPy/PyTorch names);
// InvalidArgument naming the dtype for anything else (e.g. "float16": unsupported).
[[nodiscard]] Result<LogitsDtype> ParseLogitsDtype(std::string_view name);

// bfloat16 held as its uint16_t bit pattern (the upper half of a float32).
struct BFloat16 {
  uint16_t bits = 0;
  // Round to nearest even; NaN stays NaN (quiet).
  static BFloat16 FromFloat(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return BFloat16{static_cast<uint16_t>(rounded >> 16)};
  }
  // Exact.
  float ToFloat() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
};
static_assert(sizeof(BFloat16) == 2);

// ---------------------------------------------------------------------------------------------
// Inputs.

// Row-major logits [T, V] of one rank (V = this rank's columns when vocab-parallel), as bytes.
// REQUIRES: data.size() == num_tokens * vocab_size * LogitsDtypeSize(dtype); vocab_size >= 1.
struct LogitsView {
  LogitsDtype dtype = LogitsDtype::kFloat32;
  std::span<const std::byte> data;
  int64_t num_tokens = 0;  // T
  int64_t vocab_size = 0;  // V (local columns)
};

// Labels and loss mask of the same T tokens. Labels: exactly one of labels_i32 / labels_i64
// holds T entries (the other is empty; both empty only when T == 0). Mask: at most one of
// mask_u8 / mask_f32 holds T entries, each value 0 or 1; both empty means all ones (then only
// label -100 excludes a token). A counted token's label must lie in [0, V) (vocab_total when
// vocab-parallel); -100 is the ignore index; any other label is an error.
struct TokenTargets {
  std::span<const int32_t> labels_i32;
  std::span<const int64_t> labels_i64;
  std::span<const uint8_t> mask_u8;
  std::span<const float> mask_f32;
};

struct CrossEntropyOptions {
  // Also write the gradient w.r.t. the logits into the grad span (fused with the forward).
  bool with_grad = false;
  // N: the GLOBAL loss-token count of the step (docs/design.md section 6). Needed only with_grad:
  // REQUIRES N >= 0 and N >= this call's n_valid (N = 0 only when nothing is counted here; the
  // gradient is then all zeros and nothing is divided by zero).
  int64_t normalizer = 0;
  // Multiplies the gradient: 1 for frameworks that SUM gradients over DP x CP, DP*CP for those
  // that average (see GradientFactor). Must be finite.
  double grad_scale = 1.0;
  // Worker threads: 0 = std::thread::hardware_concurrency(); never more than T.
  int num_threads = 0;
  // Vocab-parallel only (VocabParallelPartials / VocabParallelGrad): this rank's first
  // column's vocabulary id, and the full V (0 = vocab_size, i.e. not split). CrossEntropy and
  // CrossEntropyReference require vocab_start == 0 and vocab_total in {0, vocab_size}.
  int64_t vocab_start = 0;
  int64_t vocab_total = 0;
};

// Factor to pass as grad_scale: 1 when the framework sums gradients over DP x CP, dp_size *
// cp_size when it averages them (Megatron DDP). REQUIRES dp_size >= 1, cp_size >= 1.
[[nodiscard]] Result<double> GradientFactor(bool framework_averages, int dp_size, int cp_size);

struct CrossEntropyResult {
  double loss_sum = 0;     // sum over counted tokens of -log p(label), in token order
  double entropy_sum = 0;  // sum over counted tokens of the entropy, in token order
  int64_t n_valid = 0;     // counted tokens
  std::vector<double> logprobs;  // [T] log p(label); 0 for uncounted tokens
  std::vector<double> entropy;   // [T] entropy; 0 for uncounted tokens
  std::vector<uint8_t> counted;  // [T] 1 when counted
};

// Cross-entropy of the local logits (fast path: multi-threaded, vectorised, one read of the
// logits, plus one write of the gradient when with_grad). grad: [T, V] in the logits' dtype,
// as bytes, when options.with_grad (every row written, zeros for uncounted tokens); ignored
// and may be empty otherwise.
// Errors (InvalidArgument, naming the argument, the token index and the rule): sizes that do
// not match T and V, a counted label outside [0, V), a mask value other than 0/1, N < 0 or
// N < n_valid with_grad, an unsupported dtype, non-finite logits in a counted row (log-sum-exp
// is not finite), grad overlapping the logits.
[[nodiscard]] Result<CrossEntropyResult> CrossEntropy(const LogitsView& logits,
                                                      const TokenTargets& targets,
                                                      const CrossEntropyOptions& options,
                                                      std::span<std::byte> grad = {});

// The plain reference: fp64 arithmetic, std::exp per element, one thread. Same contract.
[[nodiscard]] Result<CrossEntropyResult> CrossEntropyReference(const LogitsView& logits,
                                                               const TokenTargets& targets,
                                                               const CrossEntropyOptions& options,
                                                               std::span<std::byte> grad = {});

// ---------------------------------------------------------------------------------------------
// Vocab-parallel.

// One TP rank's partial of one token, relative to its local max m over its columns:
//   max = m, sum_exp = sum exp(z - m), sum_exp_shifted = sum exp(z - m) * (z - m),
//   target_logit = z[label - vocab_start] when the label is among this rank's columns, else
//   -inf. An uncounted token (and a counted one whose local columns are all -inf) has
//   max = -inf, sum_exp = sum_exp_shifted = 0; an uncounted token also target_logit = -inf.
struct VocabPartial {
  double max = 0;
  double sum_exp = 0;
  double sum_exp_shifted = 0;
  double target_logit = 0;
};
static_assert(sizeof(VocabPartial) == 32);

// Phase 1. logits: this rank's [T, V/TP] columns [vocab_start, vocab_start + vocab_size) of
// the full vocab_total. REQUIRES: 0 <= vocab_start, vocab_start + vocab_size <= vocab_total.
[[nodiscard]] Result<std::vector<VocabPartial>> VocabParallelPartials(
    const LogitsView& logits, const TokenTargets& targets, const CrossEntropyOptions& options);

// Phase 2 result: the CrossEntropyResult of the whole vocabulary plus lse per token.
struct VocabParallelCombined {
  CrossEntropyResult result;
  std::vector<double> lse;  // [T]; 0 for uncounted tokens
};

// Phase 2, pure: partials[r] is TP rank r's phase-1 output (any rank order gives the same
// value up to rounding; pass them in rank order for bit-identical results on every rank).
// REQUIRES: every partials[r] has T entries; targets as given to phase 1; each counted
// token's target found on exactly one rank.
[[nodiscard]] Result<VocabParallelCombined> CombineVocabPartials(
    std::span<const std::span<const VocabPartial>> partials, const TokenTargets& targets);

// Phase 3: the gradient of this rank's columns, [T, V/TP] in the logits' dtype, from the
// combined lse. Uses options.normalizer, grad_scale, num_threads, vocab_start, vocab_total.
[[nodiscard]] Status VocabParallelGrad(const LogitsView& logits, const TokenTargets& targets,
                                       std::span<const double> lse,
                                       const CrossEntropyOptions& options,
                                       std::span<std::byte> grad);

// ---------------------------------------------------------------------------------------------
// Statistics (docs/design.md section 8), the same whatever CP, DP or the microbatching.

// One sequence's share: the sum of its tokens' log p(label) and its loss-token count.
struct SequenceLoss {
  double logprob_sum = 0;
  int64_t n_loss_tokens = 0;
};

// Additive loss statistics. Build one per CP shard with AccumulateShardLoss, then Merge the
// shards of every CP rank, every microbatch and every DP replica (in any order: only the last
// bits of the sums depend on it). Only one TP rank (tp = 0) should contribute.
struct LossStats {
  int64_t n_tokens = 0;       // real (non-padding) tokens
  int64_t n_loss_tokens = 0;  // counted tokens: N over the whole step
  double loss_sum = 0;        // sum of -log p(label) over counted tokens
  double entropy_sum = 0;     // sum of entropies over counted tokens
  // Per sequence, keyed by a key unique to the sequence within the step (its sample id). The
  // CP shards of one sequence add up here: no rank holds a whole sequence.
  std::map<int64_t, SequenceLoss> sequences;

  // Adds other into this (sequences with the same key are summed).
  void Merge(const LossStats& other);
};

// The reported figures.
struct LossSummary {
  int64_t n_tokens = 0;
  int64_t n_loss_tokens = 0;
  double loss = 0;             // loss_sum / N; 0 when N == 0
  std::optional<double> ppl;   // mean over sequences with >= 1 loss token of
                               // exp(-logprob_sum / n_loss_tokens); nullopt (JSON null) if none
  double entropy = 0;          // entropy_sum / N (token mean); 0 when N == 0
};
LossSummary Finalize(const LossStats& stats);

// Attributes the per-token results of CP rank cp_rank's shard of one packed microbatch to its
// sequences and adds them to *stats. cu_seqlens / cu_seqlens_padded: the microbatch's GLOBAL
// real and padded offsets [n+1] (pack.h); result: CrossEntropy (or CombineVocabPartials) on the
// shard, T/CP tokens in zigzag order (shard.h); sequence_keys: [n] keys of the sequences (e.g.
// sample ids), or empty for 0..n-1. A local token is real when its position inside its padded
// sequence is < L_i; n_tokens counts the shard's real tokens, so the sum over CP ranks is the
// microbatch's real token count.
// REQUIRES: ValidateCuSeqlensPadded(cu_seqlens_padded, cp_size); cu_seqlens of the same n
// with 0 <= L_i <= P_i; result arrays of T/CP entries; 0 <= cp_rank < cp_size;
// sequence_keys empty or [n]; stats not null. Errors name the argument and index.
[[nodiscard]] Status AccumulateShardLoss(const CrossEntropyResult& result,
                                         std::span<const int32_t> cu_seqlens,
                                         std::span<const int32_t> cu_seqlens_padded, int cp_size,
                                         int cp_rank, std::span<const int64_t> sequence_keys,
                                         LossStats* stats);

// The sequences of CP rank cp_rank's shard of one packed microbatch, for a caller that sums
// the per-token values where they are (thdpack.torch sums them on the GPU, without moving them
// to the host): sequence i is local tokens [local_cu[i], local_cu[i+1]) (cu_seqlens_padded /
// CP), real_tokens[i] of them real (AccumulateShardLoss's rule: the global position inside the
// padded sequence is below L_i). Its per-sequence sums and totals are AccumulateShardLoss's.
// REQUIRES and errors: AccumulateShardLoss's, on the offsets and cp_rank.
struct ShardSequences {
  std::vector<int64_t> local_cu;     // [n+1]
  std::vector<int64_t> real_tokens;  // [n]
};
[[nodiscard]] Result<ShardSequences> ShardSequenceLayout(
    std::span<const int32_t> cu_seqlens, std::span<const int32_t> cu_seqlens_padded,
    int cp_size, int cp_rank);

// ---------------------------------------------------------------------------------------------
// Statistics across ranks, through the caller's transport (this area has no communicator: a
// framework passes its own all-reduce, e.g. torch.distributed's over its CP or DP x CP group).

// Sums `values` elementwise over the ranks of a group, in place; every rank of the group calls
// it with the same size. Returns an error (or the caller's exception passes through) on failure.
using AllReduceSum = std::function<Status(std::span<double> values)>;

// Whether the rank at cp_rank of a CP group counts the whole sequences of a microbatch (their
// per-sequence terms: perplexity, per-sequence means, the count of sequences): each sequence is
// counted once over the group, on its rank 0. The one statement of that rule:
// ReduceSequencesOverCp, AddShardBySource and thdpack.torch (its device statistics,
// RLStatistics) ask it.
inline bool CountsWholeSequences(int cp_rank) { return cp_rank == 0; }

// The CP reduction of one microbatch's shard statistics (AccumulateShardLoss with the same
// sequence keys on every CP rank, e.g. empty): per-sequence log-prob sums and loss-token counts
// are summed over the CP group with all_reduce_sum (2n doubles, keys in order; counts are exact
// below 2^53), so every CP rank then holds whole sequences; ranks other than cp_rank 0 drop
// them, so that totals summed over DP x CP count each sequence once. Token sums stay per rank.
// REQUIRES stats not null, cp_rank >= 0.
[[nodiscard]] Status ReduceSequencesOverCp(const AllReduceSum& all_reduce_sum, int cp_rank,
                                           LossStats* stats);

// The additive figures of whole sequences: what ranks sum to report a step. Finalize(stats)
// is Finalize of the totals of stats.
struct LossTotals {
  int64_t n_tokens = 0;
  int64_t n_loss_tokens = 0;
  double loss_sum = 0;
  double entropy_sum = 0;
  double ppl_sum = 0;  // sum over sequences with >= 1 loss token of exp(-logprob_sum / count)
  int64_t n_ppl = 0;   // those sequences

  // Adds stats, whose sequences must be whole (CP-reduced, or CP = 1); keys are not kept, so
  // totals of different microbatches and replicas add without key collisions.
  void Add(const LossStats& whole);
  void Add(const LossTotals& other);
  // Totals from their six sums in this order: n_tokens, n_loss_tokens, loss_sum, entropy_sum,
  // ppl_sum, n_ppl (a caller's own accumulation, e.g. on a GPU). InvalidArgument unless there
  // are 6 and each count is a non-negative integer below 2^53.
  [[nodiscard]] static Result<LossTotals> FromSums(std::span<const double> sums);
  // Sums the totals over the ranks of a group (6 doubles; counts exact below 2^53). An error
  // when a reduced count is negative or not an integer (ranks disagreeing on the layout).
  [[nodiscard]] Status AllReduce(const AllReduceSum& all_reduce_sum);
};
LossSummary Finalize(const LossTotals& totals);

// The statistics of one microbatch shard split by the source of each sequence (a blend,
// thdpack/blend.h): (*by_source)[s] gains what LossTotals::Add would gain from the sequences
// whose sources[i] == s - their real, loss and entropy sums over this rank's tokens, and on CP
// rank 0 the perplexity terms of those whole sequences - so that the per-source totals summed
// over DP x CP are, like the totals, those of one rank (design.md section 8). One all-reduce of
// 2n doubles over the CP group for every source together (all_reduce_sum; null when
// cp_size == 1). by_source grows to the largest source + 1. REQUIRES and errors:
// AccumulateShardLoss's, sources of n entries >= 0 (InvalidArgument naming the index).
[[nodiscard]] Status AddShardBySource(const CrossEntropyResult& result,
                                      std::span<const int32_t> cu_seqlens,
                                      std::span<const int32_t> cu_seqlens_padded, int cp_size,
                                      int cp_rank, std::span<const int32_t> sources,
                                      const AllReduceSum* all_reduce_sum,
                                      std::vector<LossTotals>* by_source);

}  // namespace thdpack

#endif  // THDPACK_LOSS_H_
