// thdpack/parallel_layout.h: the parallel layout of one packed microbatch - how many CP ranks
// share it, whether SP splits it over TP ranks, any extra per-sequence alignment, the token
// multiple each rank's share must be (rank_multiple, for FP8 GEMMs) - and THE padding rule that
// follows from it (docs/design.md section 5). This is the only place the rule is written: the
// scheduler's budget, the packer's T, the wire format's padded lengths, the shard checks and
// the Python bindings all call it.
//
// The rule, for a microbatch of n sequences of real lengths L_i:
//   zigzag multiple   z = (CP > 1 ? 2*CP : 1)          every padded sequence splits into 2*CP
//                                                      equal chunks (the zigzag of shard.h)
//   alignment         a = z * extra_alignment           every P_i = roundup(L_i, a)
//   split ranks       s = CP, or CP*TP with SP and TP > 1: the ranks T is divided over
//   rank quantum      r = s * rank_multiple             T a multiple of r gives each of the s
//                                                      ranks a multiple of rank_multiple tokens
//   token quantum     q = lcm(a, r)                     (a when r divides a: the rule of a
//                                                      layout without SP and rank multiple)
//   T                 = roundup(sum P_i, q)             the LAST sequence absorbs T - sum P_i,
//                                                      so no sequence but the last grows and
//                                                      none is padded to 2*CP*TP or to
//                                                      2*CP*rank_multiple
//   budget            T <= CP * max_tokens_per_rank    (the scheduler's, schedule.h)
// Worked example, lengths 7 and 3, CP = 2: a = 4, P = 8 and 4, T = 12; with TP = 4 and SP,
// q = lcm(4, 8) = 8 and T = 16 (the last sequence is padded to 8); with rank_multiple 16 and no
// SP, q = lcm(4, 32) = 32 and T = 32 (the last sequence is padded to 24: 16 tokens per CP rank).
//
// A ParallelLayout is a validated value: Create checks every rule once, and every function that
// takes one trusts it. Untrusted bytes (the wire decoder) go through FromWire, which checks the
// same rules. The layout is a property of a MICROBATCH, not of the run: every packed microbatch
// (pack.h's Layout) records the one it was built with, so a scheduler may give each microbatch
// its own CP degree.
//
// Thread-safety: an immutable value; safe to share.
#ifndef THDPACK_PARALLEL_LAYOUT_H_
#define THDPACK_PARALLEL_LAYOUT_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "thdpack/status.h"

namespace thdpack {

class ParallelLayout {
 public:
  // CP = TP = 1, no SP, no extra alignment: a microbatch that is not split at all.
  ParallelLayout() = default;

  // REQUIRES (InvalidArgument naming the argument and rule otherwise): cp_size >= 1,
  // tp_size >= 1, extra_alignment >= 1, rank_multiple >= 1. OutOfRange when the alignment, the
  // rank quantum or the token quantum does not fit int32 (T must fit int32).
  [[nodiscard]] static Result<ParallelLayout> Create(int cp_size, int tp_size = 1,
                                                     bool sp = false,
                                                     int64_t extra_alignment = 1,
                                                     int64_t rank_multiple = 1);
  // The layout as the wire format carries it: the per-sequence alignment (pad_multiple)
  // instead of extra_alignment. Errors as Create, plus pad_multiple not a multiple of the
  // zigzag multiple.
  [[nodiscard]] static Result<ParallelLayout> FromWire(int64_t cp_size, int64_t tp_size, bool sp,
                                                       int64_t pad_multiple,
                                                       int64_t rank_multiple = 1);

  int cp_size() const { return cp_size_; }
  int tp_size() const { return tp_size_; }
  bool sp() const { return sp_; }
  int64_t extra_alignment() const { return extra_alignment_; }
  // R: the tokens each rank holds of a microbatch (T/CP, or T/(CP*TP) under SP) are a multiple
  // of it. 1: no such rule. The presets of ParseRankMultiple are the FP8 GEMMs' needs.
  int64_t rank_multiple() const { return rank_multiple_; }

  // z = (CP > 1 ? 2*CP : 1).
  int64_t zigzag_multiple() const { return ZigzagMultiple(cp_size_); }
  // a = z * extra_alignment: every padded sequence length is a multiple of it.
  int64_t sequence_alignment() const { return zigzag_multiple() * extra_alignment_; }
  // q: every T is a multiple of it: lcm(a, rank_quantum()).
  int64_t token_quantum() const { return token_quantum_; }
  // SP splits the CP-local tokens over the TP ranks (sp and TP > 1).
  bool splits_over_tp() const { return sp_ && tp_size_ > 1; }
  // The ranks a microbatch's T is divided over: CP, or CP*TP when SP splits over TP.
  int64_t split_ranks() const {
    return splits_over_tp() ? int64_t{cp_size_} * tp_size_ : int64_t{cp_size_};
  }
  // r = split_ranks() * rank_multiple: T a multiple of it gives every rank a multiple of R.
  int64_t rank_quantum() const { return split_ranks() * rank_multiple_; }
  // Whether the rule may pad the last sequence past its own P (SP over TP, or a rank
  // multiple): false guarantees T = sum P_i, so the order of a microbatch's sequences does
  // not change its T.
  bool may_pad_tail() const { return splits_over_tp() || rank_multiple_ > 1; }

  // P = roundup(L, a). REQUIRES 0 <= length <= 2^62.
  int64_t PaddedLength(int64_t length) const { return RoundUp(length, sequence_alignment()); }
  // T = roundup(sum_padded, q) for sequences whose padded lengths sum to sum_padded.
  int64_t MicrobatchTokens(int64_t sum_padded) const { return RoundUp(sum_padded, token_quantum_); }
  // The largest sum of padded lengths whose T stays within `budget` tokens:
  // MicrobatchTokens(s) <= budget  <=>  s <= UsableBudget(budget).
  int64_t UsableBudget(int64_t budget) const { return budget / token_quantum_ * token_quantum_; }
  // The tokens of a microbatch that one CP rank may hold, times CP: CP * max_tokens_per_rank.
  int64_t MicrobatchBudget(int64_t max_tokens_per_rank) const {
    return static_cast<int64_t>(cp_size_) * max_tokens_per_rank;
  }

  // "CP=2 TP=4 SP align 1", plus " rank multiple 16" when R > 1 (the fields, for messages).
  std::string ToString() const;

  friend bool operator==(const ParallelLayout&, const ParallelLayout&) = default;

  // The zigzag multiple of a CP size alone, for code that splits over CP without the rest of
  // the layout (shard.h). REQUIRES cp_size >= 1.
  static int64_t ZigzagMultiple(int64_t cp_size) { return cp_size > 1 ? 2 * cp_size : 1; }

 private:
  static int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

  int cp_size_ = 1;
  int tp_size_ = 1;
  bool sp_ = false;
  int64_t extra_alignment_ = 1;
  int64_t rank_multiple_ = 1;
  int64_t token_quantum_ = 1;
};

// The rank multiple of a name or a number, as --rank-multiple and rank_multiple= take it:
//   "fp8" 16        per-tensor FP8 (delayed or current scaling): cuBLASLt's FP8 GEMMs need the
//                   token dimension, the reduction dimension of the weight gradient, a
//                   multiple of 16
//   "mxfp8" 32      MXFP8: one scale per 32 consecutive values along the tokens too
//   "blockwise" 128 FP8 block scaling: 1x128 and 128x128 tiles
//   "none" 1, or a decimal integer >= 1
// (docs/layout.md, "Rank multiple", says where in TransformerEngine each number comes from).
// InvalidArgument naming the text and the accepted forms otherwise.
[[nodiscard]] Result<int64_t> ParseRankMultiple(std::string_view text);

}  // namespace thdpack

#endif  // THDPACK_PARALLEL_LAYOUT_H_
