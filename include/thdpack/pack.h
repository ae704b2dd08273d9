// thdpack/pack.h: packing variable-length samples into one THD microbatch (docs/design.md section 5),
// and the fused pack + CP shard that writes each CP rank's arrays straight from the samples.
//
// Layout of a packed microbatch of n sequences, T tokens after padding (the padding rule of
// thdpack/parallel_layout.h, with PackOptions::parallel):
//   P_i = parallel.PaddedLength(L_i); T = parallel.MicrobatchTokens(sum P_i), the LAST sequence
//   absorbing T - sum P_i (the tail of SP and of a rank multiple: no extra sequence appears, and
//   no sequence is padded to 2*CP*TP). Each microbatch may be packed with its own parallel
//   layout.
//   tokens[T]        sequences concatenated; padding slots hold pad_id.
//   position_ids[T]  0..P_i-1 inside each sequence (restart at 0, continue through padding).
//   labels[T]        position j of sample s: tokens_s[j+1] when j+1 < L_s, else kIgnoreIndex.
//   loss_mask[T]     target_mask_s[j+1] when j+1 < L_s, else 0. Labels never cross a
//                    sequence boundary: the last real token and the padding predict nothing.
//   cu_seqlens[n+1], cu_seqlens_padded[n+1]: int32, from 0, GLOBAL (TransformerEngine divides
//   by CP itself). max_seqlen: the largest PADDED length (TransformerEngine's semantics).
//   n_valid = sum(loss_mask) = sum over samples of n_targets.
// Worked example, lengths 7 and 3, CP = 2: P = 8 and 4, cu_seqlens = [0,7,10],
// cu_seqlens_padded = [0,8,12], max_seqlen = 8. docs/layout.md has the arrays written out.
//
// The CP shard of any of these arrays is the zigzag of thdpack/shard.h; the fused functions
// below produce exactly CpShard(Pack(...).array, cu_seqlens_padded, CP, r) without building the
// [T] arrays, which is the data plane's fast path.
//
// Legend (docs/design.md): T packed tokens after padding, n sequences, CP, TP group sizes.
// Thread-safety: pure functions; concurrent calls are safe when output spans do not overlap.
#ifndef THDPACK_PACK_H_
#define THDPACK_PACK_H_

#include <cstdint>
#include <span>
#include <vector>

#include "thdpack/parallel_layout.h"
#include "thdpack/sample.h"
#include "thdpack/status.h"

namespace thdpack {

// Label of a position that predicts nothing (PyTorch's cross-entropy ignore_index).
inline constexpr TokenId kIgnoreIndex = -100;

struct PackOptions {
  ParallelLayout parallel;      // CP, TP, SP, extra alignment: the padding rule. Default CP=1.
  TokenId pad_id = 0;           // token written into padding slots.
  // > 0: every microbatch's T is exactly this (static shapes: FixedMicrobatchTokens of
  // schedule.h), the last sequence absorbing T - sum P_i like any tail. REQUIRES a multiple
  // of parallel.token_quantum() (ComputeLayout checks it) and at least the sequences' own T.
  int64_t fixed_tokens = 0;
};

struct Layout {
  std::vector<int32_t> cu_seqlens;         // [n+1] real offsets, from 0
  std::vector<int32_t> cu_seqlens_padded;  // [n+1] padded offsets, from 0, GLOBAL
  int32_t max_seqlen = 0;                  // largest PADDED length (TransformerEngine)
  int64_t total_tokens = 0;                // T = cu_seqlens_padded[n]
};

// The layout of a microbatch of sequences of real lengths `lengths` [n], in order.
// REQUIRES (InvalidArgument naming the argument, index and rule otherwise): n >= 1, every
// length >= 1; with fixed_tokens, a multiple of the token quantum holding the sequences.
// OutOfRange when T does not fit int32.
[[nodiscard]] Result<Layout> ComputeLayout(std::span<const int64_t> lengths,
                                           const PackOptions& options);

// Offsets [n+1] (cu_seqlens or cu_seqlens_padded) as a fixed-size array of count + 1: the
// unused tail repeats the last offset, which attention kernels read as empty sequences (static
// shapes: max_seqs_per_microbatch, docs/layout.md "Static shapes"). InvalidArgument when the
// offsets are empty or already hold more than `count` sequences.
[[nodiscard]] Result<std::vector<int32_t>> PadOffsets(std::span<const int32_t> offsets,
                                                      int64_t count);

struct PackedMicrobatch {
  std::vector<TokenId> tokens;        // [T]
  std::vector<int32_t> position_ids;  // [T]
  std::vector<TokenId> labels;        // [T]
  std::vector<uint8_t> loss_mask;     // [T] of 0/1
  std::vector<int32_t> cu_seqlens;         // [n+1]
  std::vector<int32_t> cu_seqlens_padded;  // [n+1]
  int32_t max_seqlen = 0;                  // largest padded length
  int64_t n_valid = 0;                     // sum(loss_mask)
};

// Packs samples, in order, into one microbatch. The value API: it allocates the [T] arrays.
// REQUIRES: ComputeLayout's rules on the samples' lengths; every token id in [0, 2^31) (a
// negative one would be taken for a label such as kIgnoreIndex); every sample's target_mask is
// empty (all ones) or holds L values of 0/1. Every writer below checks these on every call;
// errors (InvalidArgument) name the sample's position and id and the token or mask position.
[[nodiscard]] Result<PackedMicrobatch> Pack(std::span<const SampleView> samples,
                                            const PackOptions& options);

// Destination of the writers below: caller-owned arrays of one microbatch ([T]) or of one CP
// shard ([T/CP]). An EMPTY span means "do not produce this array" (the first pipeline stage
// needs tokens and position_ids, the last labels and loss_mask); a non-empty one must have
// exactly the expected size.
struct PackBuffers {
  std::span<TokenId> tokens;
  std::span<int32_t> position_ids;
  std::span<TokenId> labels;
  std::span<uint8_t> loss_mask;
};

// Hot path of Pack: writes the [T] arrays into out without allocating; returns n_valid.
// layout: normally ComputeLayout of the samples' lengths with the same options. Any layout is
// accepted whose cu_seqlens match the samples' lengths exactly and whose padded lengths are
// >= the real ones, divisible by the zigzag multiple 2*CP (CP > 1), with T a multiple of CP*TP
// when SP splits over TP and of parallel.rank_quantum() (every rank a multiple of the rank
// multiple), and total_tokens == cu_seqlens_padded[n]; anything else is InvalidArgument.
// REQUIRES: the samples as for Pack; out's non-empty spans of size T, not overlapping the
// samples.
[[nodiscard]] Result<int64_t> PackInto(std::span<const SampleView> samples, const Layout& layout,
                                       const PackOptions& options, const PackBuffers& out);

// Fused pack + CP shard (the fast path): writes CP rank cp_rank's [T/CP] arrays, equal to
// CpShard of Pack's arrays, reading only the parts of the samples that rank keeps (plus one
// pass over the target masks to validate them and count n_valid). Returns the WHOLE
// microbatch's n_valid (the same on every CP rank: a share of the loss denominator N).
// REQUIRES: as PackInto with spans of size T/CP, and 0 <= cp_rank < CP.
[[nodiscard]] Result<int64_t> PackShardInto(std::span<const SampleView> samples,
                                            const Layout& layout, const PackOptions& options,
                                            int cp_rank, const PackBuffers& out);

// Fused pack + CP shard for every CP rank in one pass over the samples: out[r] receives rank
// r's [T/CP] arrays (a loader that sends every rank its shard). Returns the microbatch n_valid.
// REQUIRES: as PackShardInto; out.size() == CP.
[[nodiscard]] Result<int64_t> PackShardAllInto(std::span<const SampleView> samples,
                                               const Layout& layout, const PackOptions& options,
                                               std::span<const PackBuffers> out);

// One CP rank's share of a packed microbatch, each array [T/CP] in zigzag order.
struct PackedShard {
  int cp_rank = 0;
  std::vector<TokenId> tokens;
  std::vector<int32_t> position_ids;
  std::vector<TokenId> labels;
  std::vector<uint8_t> loss_mask;
  // Per field of the run's schema (thdpack/fields.h): [T/CP, w] as bytes, an input field's where
  // the shard holds tokens, a target field's where it holds labels; empty otherwise.
  std::vector<std::vector<std::byte>> fields;
};

// A packed microbatch as CP ranks hold it: the global metadata plus the requested shards.
struct ShardedMicrobatch {
  Layout layout;                    // GLOBAL cu_seqlens, cu_seqlens_padded, max_seqlen, T
  int64_t n_valid = 0;              // of the whole microbatch
  std::vector<PackedShard> shards;  // PackAndShard: one; PackAndShardAll: CP, in rank order
};

// Value API of the fused path: ComputeLayout + PackShardInto for one rank.
[[nodiscard]] Result<ShardedMicrobatch> PackAndShard(std::span<const SampleView> samples,
                                                     const PackOptions& options, int cp_rank);
// Value API of the fused path for every CP rank.
[[nodiscard]] Result<ShardedMicrobatch> PackAndShardAll(std::span<const SampleView> samples,
                                                        const PackOptions& options);

// ---- Hugging Face's label convention (docs/python.md, "With a Hugging Face model"). ----
// A transformers causal LM shifts its `labels` itself (the logits at j are scored against
// labels[j+1]) and ignores only kIgnoreIndex; its padding-free collators (transformers'
// DataCollatorWithFlattening, TRL's padding-free DataCollatorForLanguageModeling) hand it
// UNSHIFTED labels: token j where j's own target mask is 1, kIgnoreIndex at every sequence's
// first token, where the mask is 0, and at padding. From a whole microbatch in thdpack's
// convention (Pack's arrays, [T]), writes that convention:
//   hf_labels[j]    = labels[j-1]  when j is not the first position of its padded sequence
//                     and loss_mask[j-1] = 1 (then labels[j-1] = tokens[j]), else kIgnoreIndex
//   hf_loss_mask[j] = 1 exactly where hf_labels[j] is not kIgnoreIndex (the same n_valid)
// Only a whole microbatch can be shifted: in a CP shard, neighbouring positions belong to
// different zigzag chunks. The outputs may be the inputs themselves (in place); they must not
// otherwise overlap them.
// REQUIRES (InvalidArgument naming the argument, index and rule otherwise): cu_seqlens_padded
// [n+1], n >= 1, starts at 0, strictly increasing, ends at T; labels, loss_mask, hf_labels and
// hf_loss_mask all of size T; loss_mask values 0 or 1.
[[nodiscard]] Status ToHfLabels(std::span<const TokenId> labels,
                                std::span<const uint8_t> loss_mask,
                                std::span<const int32_t> cu_seqlens_padded,
                                std::span<TokenId> hf_labels, std::span<uint8_t> hf_loss_mask);

}  // namespace thdpack

#endif  // THDPACK_PACK_H_
