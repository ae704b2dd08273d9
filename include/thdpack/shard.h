// thdpack/shard.h: context-parallel (CP) zigzag sharding of packed (THD) and dense batches, and
// the sequence-parallel (SP) split of a CP-local shard across TP ranks. docs/design.md section 5.
//
// CP zigzag (identical to TransformerEngine's thd_get_partitioned_indices): each padded
// sequence of a packed microbatch is cut into 2*CP equal chunks; CP rank r keeps chunk r and
// then chunk 2*CP-1-r, sequence after sequence. Every rank thus holds T/CP tokens and an equal
// share of the causal-attention work. Worked example, cu_seqlens_padded = [0,8,16], CP=2:
//   rank 0 keeps global positions [0,1,6,7, 8,9,14,15], rank 1 keeps [2,3,4,5, 10,11,12,13].
// The local boundaries are cu_seqlens_padded / CP (sequence i of rank r occupies local
// positions [cu[i]/CP, cu[i+1]/CP)).
//
// Any token-aligned array can be sharded: tokens, labels, loss masks, position ids, or rows of
// activations (use the byte core with elem_size = bytes per token). Sharding never allocates
// per sequence: it is a sequence of chunk memcpys. Unsharding is its exact inverse.
//
// SP: the CP-local tokens are cut into TP contiguous equal parts; TP rank t keeps part t.
//
// Shapes use docs/design.md's legend: T packed tokens (after padding), n sequences, CP, TP.
// Thread-safety: pure functions of their arguments; concurrent calls are safe when the output
// spans do not overlap.
#ifndef THDPACK_SHARD_H_
#define THDPACK_SHARD_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "thdpack/status.h"

namespace thdpack {

// ---------------------------------------------------------------------------------------------
// Metadata.

// OK when cu_seqlens_padded [n+1] can be zigzag-sharded over cp_size ranks.
// REQUIRES (each violation is an InvalidArgument naming the index and the rule):
//   cp_size >= 1; n >= 1; cu_seqlens_padded[0] == 0; strictly increasing (every sequence
//   holds at least one token); every padded length cu[i+1]-cu[i] divisible by 2*CP when
//   CP > 1.
[[nodiscard]] Status ValidateCuSeqlensPadded(std::span<const int32_t> cu_seqlens_padded,
                                             int cp_size);

// The global positions CP rank cp_rank keeps, in local order: [T/CP] int32. This is the
// reference definition of the zigzag; CpShard is the fast equivalent of gathering by it.
// REQUIRES: ValidateCuSeqlensPadded(cu_seqlens_padded, cp_size) and 0 <= cp_rank < cp_size.
[[nodiscard]] Result<std::vector<int32_t>> CpPartitionIndices(
    std::span<const int32_t> cu_seqlens_padded, int cp_size, int cp_rank);

// Position ids of CP rank cp_rank's shard, [T/CP], from the metadata alone: the global
// position of each kept token inside its padded sequence (0..P_i-1 restarting per sequence),
// so any pipeline stage can rebuild them without receiving them.
// REQUIRES: as CpPartitionIndices.
[[nodiscard]] Result<std::vector<int32_t>> LocalPositionIds(
    std::span<const int32_t> cu_seqlens_padded, int cp_size, int cp_rank);
// Same, written into out. REQUIRES: out.size() == T/CP.
[[nodiscard]] Status LocalPositionIdsInto(std::span<const int32_t> cu_seqlens_padded,
                                          int cp_size, int cp_rank, std::span<int32_t> out);

// Which tokens of CP rank cp_rank's shard are padding, [T/CP] (1: padding), from the metadata
// alone (every stage can compute it): token k is padding when its global position lies past
// its sequence's real length cu_seqlens[i+1] - cu_seqlens[i]. InvalidArgument when cu_seqlens
// and cu_seqlens_padded differ in size or a real length exceeds its padded one. An idle
// microbatch of a dynamic step (both {0}) has none.
// REQUIRES otherwise: as CpPartitionIndices.
[[nodiscard]] Result<std::vector<uint8_t>> ShardPaddingMask(
    std::span<const int32_t> cu_seqlens, std::span<const int32_t> cu_seqlens_padded, int cp_size,
    int cp_rank);
// Same, written into out (out.size() must be T/CP, 0 for an idle microbatch).
[[nodiscard]] Status ShardPaddingMaskInto(std::span<const int32_t> cu_seqlens,
                                          std::span<const int32_t> cu_seqlens_padded,
                                          int cp_size, int cp_rank, std::span<uint8_t> out);

// CP rank cp_rank's shard as runs, what ShardPaddingMask and ShardSequenceIndex write: for
// each sequence i in order, each of its chunks on this rank (one when CP = 1, two otherwise)
// as run(i, at, real, pad) - `real` real tokens then `pad` padding tokens at local offset `at`.
// Returns T/CP (0 for an idle microbatch, with no run). The same checks and errors as
// ShardPaddingMask.
[[nodiscard]] Result<int64_t> ForEachShardRun(
    std::span<const int32_t> cu_seqlens, std::span<const int32_t> cu_seqlens_padded, int cp_size,
    int cp_rank, const std::function<void(size_t i, int64_t at, int64_t real, int64_t pad)>& run);
// T/CP of rank cp_rank's shard (0 for an idle microbatch) after ForEachShardRun's checks.
[[nodiscard]] Result<int64_t> ShardRunsSize(std::span<const int32_t> cu_seqlens,
                                            std::span<const int32_t> cu_seqlens_padded,
                                            int cp_size, int cp_rank);
// Rank cp_rank's shard [T/CP] written into out run by run: value(i) on the real tokens of
// sequence i, `pad` on padding (ShardPaddingMaskInto, ShardSequenceIndexInto). Checked whole
// and sized before anything is written; `what` names the caller in the size's error.
template <typename T, typename Value>
[[nodiscard]] Status FillShardRuns(std::span<const int32_t> cu_seqlens,
                                   std::span<const int32_t> cu_seqlens_padded, int cp_size,
                                   int cp_rank, std::span<T> out, Value value, T pad,
                                   std::string_view what) {
  Result<int64_t> n = ShardRunsSize(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank);
  if (!n.ok()) return n.status();
  if (static_cast<int64_t>(out.size()) != *n) {
    return Status::InvalidArgument(std::string(what) + ": out has " +
                                   std::to_string(out.size()) +
                                   " elements: it must hold T/CP = " + std::to_string(*n));
  }
  return ForEachShardRun(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank,
                         [&](size_t i, int64_t at, int64_t real, int64_t padding) {
                           T* dst = out.data() + at;
                           std::fill(dst, dst + real, static_cast<T>(value(i)));
                           std::fill(dst + real, dst + real + padding, pad);
                         })
      .status();
}

// Local sequence boundaries of every CP rank's shard: cu_seqlens_padded / CP, [n+1]. For the
// loss and unsharding; attention (TransformerEngine) takes the GLOBAL cu_seqlens_padded.
// REQUIRES: ValidateCuSeqlensPadded(cu_seqlens_padded, cp_size).
[[nodiscard]] Result<std::vector<int32_t>> LocalCuSeqlensPadded(
    std::span<const int32_t> cu_seqlens_padded, int cp_size);

// ---------------------------------------------------------------------------------------------
// Packed (THD) arrays. The byte core handles any element of elem_size bytes (a token id, a
// mask byte, a row of H activations); the templates below are typed wrappers over it.

// out = full gathered at CpPartitionIndices(cu_seqlens_padded, cp_size, cp_rank).
// full: [T] elements, out: [T/CP] elements, both as bytes (T * elem_size, T/CP * elem_size).
// REQUIRES: as CpPartitionIndices; elem_size >= 1; sizes as stated; out does not overlap full.
[[nodiscard]] Status CpShardBytes(std::span<const std::byte> full, size_t elem_size,
                                  std::span<const int32_t> cu_seqlens_padded, int cp_size,
                                  int cp_rank, std::span<std::byte> out);

// The inverse: full[CpPartitionIndices(.., r)[k]] = shards[r][k] for every rank r.
// shards: cp_size spans of [T/CP] elements in rank order; full: [T] elements.
// REQUIRES: as CpShardBytes, shards.size() == cp_size.
[[nodiscard]] Status CpUnshardBytes(std::span<const std::span<const std::byte>> shards,
                                    size_t elem_size, std::span<const int32_t> cu_seqlens_padded,
                                    int cp_size, std::span<std::byte> full);

template <typename T>
[[nodiscard]] Status CpShardInto(std::span<const T> full,
                                 std::span<const int32_t> cu_seqlens_padded, int cp_size,
                                 int cp_rank, std::span<T> out) {
  static_assert(std::is_trivially_copyable_v<T>, "CP sharding copies bytes");
  return CpShardBytes(std::as_bytes(full), sizeof(T), cu_seqlens_padded, cp_size, cp_rank,
                      std::as_writable_bytes(out));
}

// Returns CP rank cp_rank's shard of full, [T/CP].
template <typename T>
[[nodiscard]] Result<std::vector<T>> CpShard(std::span<const T> full,
                                             std::span<const int32_t> cu_seqlens_padded,
                                             int cp_size, int cp_rank) {
  if (cp_size < 1) return CpShardBytes({}, sizeof(T), cu_seqlens_padded, cp_size, cp_rank, {});
  std::vector<T> out(full.size() / static_cast<size_t>(cp_size));
  THDPACK_RETURN_IF_ERROR(
      CpShardInto<T>(full, cu_seqlens_padded, cp_size, cp_rank, std::span<T>(out)));
  return out;
}

// shards: any range of cp_size contiguous ranges of T in rank order (e.g. a
// std::vector<std::vector<T>> or an array of std::span<const T>); full: [T].
template <typename Shards, typename T>
[[nodiscard]] Status CpUnshardInto(const Shards& shards,
                                   std::span<const int32_t> cu_seqlens_padded, int cp_size,
                                   std::span<T> full) {
  static_assert(std::is_trivially_copyable_v<T>, "CP unsharding copies bytes");
  std::vector<std::span<const std::byte>> views;  // one entry per rank, not per sequence
  for (const auto& s : shards) views.push_back(std::as_bytes(std::span<const T>(s)));
  return CpUnshardBytes(views, sizeof(T), cu_seqlens_padded, cp_size,
                        std::as_writable_bytes(full));
}

// Returns the full [T] array from the shards of all CP ranks.
template <typename Shards,
          typename T = std::ranges::range_value_t<std::ranges::range_value_t<Shards>>>
[[nodiscard]] Result<std::vector<T>> CpUnshard(const Shards& shards,
                                               std::span<const int32_t> cu_seqlens_padded,
                                               int cp_size) {
  size_t total = 0;
  for (const auto& s : shards) total += std::ranges::size(s);
  std::vector<T> full(total);
  THDPACK_RETURN_IF_ERROR(
      (CpUnshardInto<Shards, T>(shards, cu_seqlens_padded, cp_size, std::span<T>(full))));
  return full;
}

// ---------------------------------------------------------------------------------------------
// Dense (non-packed) batches [B, S]: the same zigzag over every row, as if each row were one
// sequence of padded length S. Megatron PR #5150: a dense attention mask cannot follow the
// zigzag (its [S, S] blocks would have to be permuted on both axes), so CP > 1 with an
// attention mask is rejected rather than silently producing a wrong mask.
struct DenseShardOptions {
  int cp_size = 1;                  // CP, >= 1
  int cp_rank = 0;                  // 0 <= cp_rank < cp_size (ignored by unshard)
  bool has_attention_mask = false;  // the batch carries a dense attention mask
};

// full: [batch, seq_len] elements row-major; out: [batch, seq_len/CP].
// REQUIRES: batch >= 1, seq_len >= 1, seq_len % (2*CP) == 0 when CP > 1, options valid,
// !(has_attention_mask && CP > 1), elem_size >= 1, sizes as stated.
[[nodiscard]] Status DenseCpShardBytes(std::span<const std::byte> full, size_t elem_size,
                                       int64_t batch, int64_t seq_len,
                                       const DenseShardOptions& options,
                                       std::span<std::byte> out);
// The inverse; shards: options.cp_size spans of [batch, seq_len/CP] in rank order.
[[nodiscard]] Status DenseCpUnshardBytes(std::span<const std::span<const std::byte>> shards,
                                         size_t elem_size, int64_t batch, int64_t seq_len,
                                         const DenseShardOptions& options,
                                         std::span<std::byte> full);

template <typename T>
[[nodiscard]] Result<std::vector<T>> DenseCpShard(std::span<const T> full, int64_t batch,
                                                  int64_t seq_len,
                                                  const DenseShardOptions& options) {
  static_assert(std::is_trivially_copyable_v<T>, "CP sharding copies bytes");
  const int cp = options.cp_size >= 1 ? options.cp_size : 1;
  std::vector<T> out(full.size() / static_cast<size_t>(cp));
  THDPACK_RETURN_IF_ERROR(DenseCpShardBytes(std::as_bytes(full), sizeof(T), batch, seq_len,
                                            options, std::as_writable_bytes(std::span<T>(out))));
  return out;
}

template <typename Shards,
          typename T = std::ranges::range_value_t<std::ranges::range_value_t<Shards>>>
[[nodiscard]] Result<std::vector<T>> DenseCpUnshard(const Shards& shards, int64_t batch,
                                                    int64_t seq_len,
                                                    const DenseShardOptions& options) {
  static_assert(std::is_trivially_copyable_v<T>, "CP unsharding copies bytes");
  std::vector<std::span<const std::byte>> views;
  size_t total = 0;
  for (const auto& s : shards) {
    views.push_back(std::as_bytes(std::span<const T>(s)));
    total += std::ranges::size(s);
  }
  std::vector<T> full(total);
  THDPACK_RETURN_IF_ERROR(DenseCpUnshardBytes(views, sizeof(T), batch, seq_len, options,
                                              std::as_writable_bytes(std::span<T>(full))));
  return full;
}

// ---------------------------------------------------------------------------------------------
// SP split of the CP-local tokens over the TP group (activations [T/CP, 1, H] -> TP parts of
// [T/(CP*TP), 1, H]). Labels and loss_mask are not SP-split.

// (offset, count) of TP rank tp_rank's contiguous part of local_tokens tokens.
// REQUIRES: tp_size >= 1, 0 <= tp_rank < tp_size, local_tokens >= 0,
// local_tokens % tp_size == 0 (ComputeLayout with sp guarantees it for packed microbatches).
[[nodiscard]] Result<std::pair<int64_t, int64_t>> SpRange(int64_t local_tokens, int tp_size,
                                                          int tp_rank);

// TP rank tp_rank's part of the CP-local array local, a sub-span (no copy). Each token is
// elems_per_token consecutive elements (H for activations, 1 for per-token arrays).
// REQUIRES: as SpRange with local_tokens = local.size() / elems_per_token; elems_per_token >= 1
// and divides local.size().
template <typename T>
[[nodiscard]] Result<std::span<T>> SpSplit(std::span<T> local, int tp_size, int tp_rank,
                                           int64_t elems_per_token = 1) {
  if (elems_per_token < 1 || local.size() % static_cast<size_t>(elems_per_token) != 0) {
    return Status::InvalidArgument(
        "SpSplit: elems_per_token = " + std::to_string(elems_per_token) +
        " must be >= 1 and divide the local array size " + std::to_string(local.size()));
  }
  const int64_t tokens = static_cast<int64_t>(local.size()) / elems_per_token;
  THDPACK_ASSIGN_OR_RETURN(auto range, SpRange(tokens, tp_size, tp_rank));
  return local.subspan(static_cast<size_t>(range.first * elems_per_token),
                       static_cast<size_t>(range.second * elems_per_token));
}

// The inverse of SpSplit over all TP ranks: concatenates the parts in TP rank order into out.
// parts: any range of tp_size contiguous ranges of T, all of the same size; out: their total.
template <typename Parts, typename T>
[[nodiscard]] Status SpGatherInto(const Parts& parts, std::span<T> out) {
  static_assert(std::is_trivially_copyable_v<T>, "SP gather copies bytes");
  const size_t n_parts = static_cast<size_t>(std::ranges::distance(parts));
  if (n_parts == 0) {
    return Status::InvalidArgument("SpGather: parts is empty: need one part per TP rank");
  }
  const size_t part_size = std::ranges::size(*std::ranges::begin(parts));
  size_t index = 0;
  for (const auto& p : parts) {
    if (std::ranges::size(p) != part_size) {
      return Status::InvalidArgument("SpGather: parts[" + std::to_string(index) + "] has " +
                                     std::to_string(std::ranges::size(p)) +
                                     " elements, parts[0] has " + std::to_string(part_size) +
                                     ": every TP part must have the same size");
    }
    ++index;
  }
  if (n_parts * part_size != out.size()) {
    return Status::InvalidArgument("SpGather: out has " + std::to_string(out.size()) +
                                   " elements: it must equal the sum of the parts, " +
                                   std::to_string(n_parts * part_size));
  }
  T* dst = out.data();
  for (const auto& p : parts) {
    const std::span<const T> part(p);
    std::copy(part.begin(), part.end(), dst);
    dst += part.size();
  }
  return Status::Ok();
}

template <typename Parts,
          typename T = std::ranges::range_value_t<std::ranges::range_value_t<Parts>>>
[[nodiscard]] Result<std::vector<T>> SpGather(const Parts& parts) {
  size_t total = 0;
  for (const auto& p : parts) total += std::ranges::size(p);
  std::vector<T> out(total);
  THDPACK_RETURN_IF_ERROR((SpGatherInto<Parts, T>(parts, std::span<T>(out))));
  return out;
}

}  // namespace thdpack

#endif  // THDPACK_SHARD_H_
