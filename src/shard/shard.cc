// CP zigzag sharding and the SP split (thdpack/shard.h). The fast paths walk the sequences and
// move each of a sequence's two chunks with one memcpy; CpPartitionIndices is the element-wise
// definition they are tested against.
#include "thdpack/shard.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "common/copy_kernels.h"
#include "thdpack/parallel_layout.h"

namespace thdpack {
namespace {

using internal::Copy;

std::string Str(int64_t v) { return std::to_string(v); }

Status CheckCpRank(const char* fn, int cp_size, int cp_rank) {
  if (cp_rank < 0 || cp_rank >= cp_size) {
    return Status::InvalidArgument(std::string(fn) + ": cp_rank = " + Str(cp_rank) +
                                   ": must be in [0, cp_size = " + Str(cp_size) + ")");
  }
  return Status::Ok();
}

Status CheckElemSize(const char* fn, size_t elem_size) {
  if (elem_size == 0) {
    return Status::InvalidArgument(std::string(fn) + ": elem_size = 0: must be >= 1");
  }
  return Status::Ok();
}

// "<fn>: <what> has B bytes: expected <count> elements of elem_size bytes (B')".
Status CheckBytes(const char* fn, const std::string& what, size_t bytes, int64_t count,
                  size_t elem_size, const std::string& count_rule) {
  const size_t want = static_cast<size_t>(count) * elem_size;
  if (bytes != want) {
    return Status::InvalidArgument(std::string(fn) + ": " + what + " has " + Str(int64_t(bytes)) +
                                   " bytes: it must hold " + count_rule + " = " + Str(count) +
                                   " elements of " + Str(int64_t(elem_size)) + " bytes (" +
                                   Str(int64_t(want)) + ")");
  }
  return Status::Ok();
}

bool Overlap(std::span<const std::byte> a, std::span<const std::byte> b) {
  if (a.empty() || b.empty()) return false;
  const std::less<const std::byte*> lt;
  return lt(a.data(), b.data() + b.size()) && lt(b.data(), a.data() + a.size());
}

// The two chunks CP rank r keeps of a padded sequence [start, start + len): (offset into the
// sequence, length) of each. With CP = 1 the rank keeps the whole sequence as one piece.
struct Chunks {
  int64_t first_offset;
  int64_t second_offset;
  int64_t chunk;  // tokens per chunk (the whole sequence when CP = 1, second chunk empty)
  int64_t second_len;
};

inline Chunks ChunksOf(int64_t len, int cp, int r) {
  if (cp == 1) return {0, len, len, 0};
  const int64_t c = len / (2 * static_cast<int64_t>(cp));
  return {r * c, (2 * static_cast<int64_t>(cp) - 1 - r) * c, c, c};
}

// Copies rank r's two chunks of one padded sequence (src points at its first token) to dst.
inline void ShardSequence(const std::byte* src, int64_t len, std::byte* dst, size_t es, int cp,
                          int r) {
  const Chunks k = ChunksOf(len, cp, r);
  Copy(dst, src + k.first_offset * es, static_cast<size_t>(k.chunk) * es);
  Copy(dst + k.chunk * es, src + k.second_offset * es, static_cast<size_t>(k.second_len) * es);
}

// The inverse for one rank: puts rank r's two chunks (src) back into the sequence (dst).
inline void UnshardSequence(const std::byte* src, int64_t len, std::byte* dst, size_t es, int cp,
                            int r) {
  const Chunks k = ChunksOf(len, cp, r);
  Copy(dst + k.first_offset * es, src, static_cast<size_t>(k.chunk) * es);
  Copy(dst + k.second_offset * es, src + k.chunk * es, static_cast<size_t>(k.second_len) * es);
}

Status CheckDenseOptions(const char* fn, int64_t batch, int64_t seq_len,
                         const DenseShardOptions& o, bool check_rank) {
  if (o.cp_size < 1) {
    return Status::InvalidArgument(std::string(fn) + ": cp_size = " + Str(o.cp_size) +
                                   ": must be >= 1");
  }
  if (check_rank) THDPACK_RETURN_IF_ERROR(CheckCpRank(fn, o.cp_size, o.cp_rank));
  if (o.has_attention_mask && o.cp_size > 1) {
    return Status::InvalidArgument(
        std::string(fn) + ": has_attention_mask = true with cp_size = " + Str(o.cp_size) +
        ": a dense attention mask cannot be zigzag-sharded over CP ranks (Megatron PR #5150); "
        "pack the batch as THD with cu_seqlens, or use cp_size = 1");
  }
  if (batch < 1) {
    return Status::InvalidArgument(std::string(fn) + ": batch = " + Str(batch) +
                                   ": must be >= 1");
  }
  if (seq_len < 1) {
    return Status::InvalidArgument(std::string(fn) + ": seq_len = " + Str(seq_len) +
                                   ": must be >= 1");
  }
  const int64_t zigzag = ParallelLayout::ZigzagMultiple(o.cp_size);
  if (seq_len % zigzag != 0) {
    return Status::InvalidArgument(std::string(fn) + ": seq_len = " + Str(seq_len) +
                                   ": must be divisible by 2*cp_size = " + Str(zigzag) +
                                   " for the zigzag");
  }
  int64_t total = 0;
  if (__builtin_mul_overflow(batch, seq_len, &total)) {
    return Status::OutOfRange(std::string(fn) + ": batch * seq_len = " + Str(batch) + " * " +
                              Str(seq_len) + " overflows int64");
  }
  return Status::Ok();
}

}  // namespace

Status ValidateCuSeqlensPadded(std::span<const int32_t> cu, int cp_size) {
  if (cp_size < 1) {
    return Status::InvalidArgument("cp_size = " + Str(cp_size) + ": must be >= 1");
  }
  if (cu.size() < 2) {
    return Status::InvalidArgument("cu_seqlens_padded has " + Str(int64_t(cu.size())) +
                                   " entries: it needs n+1 >= 2 (at least one sequence)");
  }
  if (cu[0] != 0) {
    return Status::InvalidArgument("cu_seqlens_padded[0] = " + Str(cu[0]) + ": must be 0");
  }
  const int64_t quantum = ParallelLayout::ZigzagMultiple(cp_size);
  for (size_t i = 1; i < cu.size(); ++i) {
    const int64_t len = int64_t{cu[i]} - cu[i - 1];
    if (len <= 0) {
      return Status::InvalidArgument(
          "cu_seqlens_padded[" + Str(int64_t(i)) + "] = " + Str(cu[i]) +
          " <= cu_seqlens_padded[" + Str(int64_t(i - 1)) + "] = " + Str(cu[i - 1]) +
          ": offsets must be strictly increasing (every sequence holds at least one token)");
    }
    if (len % quantum != 0) {
      return Status::InvalidArgument(
          "cu_seqlens_padded[" + Str(int64_t(i)) + "] - cu_seqlens_padded[" +
          Str(int64_t(i - 1)) + "] = " + Str(len) +
          ": a padded length must be divisible by 2*cp_size = " + Str(quantum) +
          " for the zigzag");
    }
  }
  return Status::Ok();
}

Result<std::vector<int32_t>> CpPartitionIndices(std::span<const int32_t> cu, int cp_size,
                                                int cp_rank) {
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(cu, cp_size));
  THDPACK_RETURN_IF_ERROR(CheckCpRank("CpPartitionIndices", cp_size, cp_rank));
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(cu.back() / cp_size));
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t len = int64_t{cu[i + 1]} - cu[i];
    if (cp_size == 1) {
      for (int64_t j = 0; j < len; ++j) out.push_back(static_cast<int32_t>(cu[i] + j));
      continue;
    }
    const int64_t c = len / (2 * int64_t{cp_size});
    for (const int64_t chunk : {int64_t{cp_rank}, 2 * int64_t{cp_size} - 1 - cp_rank}) {
      for (int64_t j = 0; j < c; ++j) out.push_back(static_cast<int32_t>(cu[i] + chunk * c + j));
    }
  }
  return out;
}

Result<int64_t> ForEachShardRun(
    std::span<const int32_t> cu, std::span<const int32_t> cup, int cp_size, int cp_rank,
    const std::function<void(size_t i, int64_t at, int64_t real, int64_t pad)>& run) {
  if (cu.size() != cup.size()) {
    return Status::InvalidArgument("ShardPaddingMask: cu_seqlens has " +
                                   std::to_string(cu.size()) + " entries, cu_seqlens_padded " +
                                   std::to_string(cup.size()));
  }
  if (cup.size() == 1 && cup[0] == 0 && cu[0] == 0) return int64_t{0};  // idle
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(cup, cp_size));
  THDPACK_RETURN_IF_ERROR(CheckCpRank("CpPartitionIndices", cp_size, cp_rank));
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    if (cu[i + 1] - cu[i] < 0 || cu[i + 1] - cu[i] > cup[i + 1] - cup[i]) {
      return Status::InvalidArgument("ShardPaddingMask: sequence " + std::to_string(i) +
                                     " has real length " + std::to_string(cu[i + 1] - cu[i]) +
                                     ", padded " + std::to_string(cup[i + 1] - cup[i]));
    }
  }
  // A chunk [start, start + n) of a sequence with `real` real tokens: those before `real` are.
  auto chunk = [&](size_t i, int64_t at, int64_t start, int64_t n, int64_t real) {
    if (n == 0) return;
    const int64_t r = std::clamp<int64_t>(real - start, 0, n);
    run(i, at, r, n - r);
  };
  for (size_t i = 0; i + 1 < cup.size(); ++i) {
    const Chunks k = ChunksOf(int64_t{cup[i + 1]} - cup[i], cp_size, cp_rank);
    const int64_t at = cup[i] / cp_size, real = int64_t{cu[i + 1]} - cu[i];
    chunk(i, at, k.first_offset, k.chunk, real);
    chunk(i, at + k.chunk, k.second_offset, k.second_len, real);
  }
  return int64_t{cup.back() / cp_size};
}

Result<int64_t> ShardRunsSize(std::span<const int32_t> cu, std::span<const int32_t> cup,
                              int cp_size, int cp_rank) {
  return ForEachShardRun(cu, cup, cp_size, cp_rank, [](size_t, int64_t, int64_t, int64_t) {});
}

Status ShardPaddingMaskInto(std::span<const int32_t> cu, std::span<const int32_t> cup,
                            int cp_size, int cp_rank, std::span<uint8_t> out) {
  return FillShardRuns(cu, cup, cp_size, cp_rank, out, [](size_t) { return uint8_t{0}; },
                       uint8_t{1}, "ShardPaddingMask");
}

Result<std::vector<uint8_t>> ShardPaddingMask(std::span<const int32_t> cu,
                                              std::span<const int32_t> cup, int cp_size,
                                              int cp_rank) {
  THDPACK_ASSIGN_OR_RETURN(const int64_t n, ShardRunsSize(cu, cup, cp_size, cp_rank));
  std::vector<uint8_t> pad(static_cast<size_t>(n));
  THDPACK_RETURN_IF_ERROR(ShardPaddingMaskInto(cu, cup, cp_size, cp_rank, pad));
  return pad;
}

Status LocalPositionIdsInto(std::span<const int32_t> cu, int cp_size, int cp_rank,
                            std::span<int32_t> out) {
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(cu, cp_size));
  THDPACK_RETURN_IF_ERROR(CheckCpRank("LocalPositionIds", cp_size, cp_rank));
  const int64_t local = cu.back() / cp_size;
  if (static_cast<int64_t>(out.size()) != local) {
    return Status::InvalidArgument("LocalPositionIds: out has " + Str(int64_t(out.size())) +
                                   " elements: it must hold T/CP = " + Str(local));
  }
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t len = int64_t{cu[i + 1]} - cu[i];
    const Chunks k = ChunksOf(len, cp_size, cp_rank);
    int32_t* dst = out.data() + cu[i] / cp_size;
    internal::Iota32(dst, k.chunk, static_cast<int32_t>(k.first_offset));
    internal::Iota32(dst + k.chunk, k.second_len, static_cast<int32_t>(k.second_offset));
  }
  return Status::Ok();
}

Result<std::vector<int32_t>> LocalPositionIds(std::span<const int32_t> cu, int cp_size,
                                              int cp_rank) {
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(cu, cp_size));
  std::vector<int32_t> out(static_cast<size_t>(cu.back() / cp_size));
  THDPACK_RETURN_IF_ERROR(LocalPositionIdsInto(cu, cp_size, cp_rank, out));
  return out;
}

Result<std::vector<int32_t>> LocalCuSeqlensPadded(std::span<const int32_t> cu, int cp_size) {
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(cu, cp_size));
  std::vector<int32_t> out(cu.size());
  for (size_t i = 0; i < cu.size(); ++i) out[i] = cu[i] / cp_size;
  return out;
}

Status CpShardBytes(std::span<const std::byte> full, size_t elem_size,
                    std::span<const int32_t> cu, int cp_size, int cp_rank,
                    std::span<std::byte> out) {
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(cu, cp_size));
  THDPACK_RETURN_IF_ERROR(CheckCpRank("CpShard", cp_size, cp_rank));
  THDPACK_RETURN_IF_ERROR(CheckElemSize("CpShard", elem_size));
  const int64_t total = cu.back();
  THDPACK_RETURN_IF_ERROR(CheckBytes("CpShard", "full", full.size(), total, elem_size,
                                     "T = cu_seqlens_padded[n]"));
  THDPACK_RETURN_IF_ERROR(
      CheckBytes("CpShard", "out", out.size(), total / cp_size, elem_size, "T/CP"));
  if (Overlap(full, out)) {
    return Status::InvalidArgument("CpShard: out overlaps full: the shard needs its own buffer");
  }
  if (cp_size == 1) {
    Copy(out.data(), full.data(), full.size());
    return Status::Ok();
  }
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    ShardSequence(full.data() + int64_t{cu[i]} * elem_size, int64_t{cu[i + 1]} - cu[i],
                  out.data() + int64_t{cu[i] / cp_size} * elem_size, elem_size, cp_size,
                  cp_rank);
  }
  return Status::Ok();
}

Status CpUnshardBytes(std::span<const std::span<const std::byte>> shards, size_t elem_size,
                      std::span<const int32_t> cu, int cp_size, std::span<std::byte> full) {
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(cu, cp_size));
  THDPACK_RETURN_IF_ERROR(CheckElemSize("CpUnshard", elem_size));
  if (static_cast<int64_t>(shards.size()) != cp_size) {
    return Status::InvalidArgument("CpUnshard: " + Str(int64_t(shards.size())) +
                                   " shards given: need one per CP rank, cp_size = " +
                                   Str(cp_size));
  }
  const int64_t total = cu.back();
  THDPACK_RETURN_IF_ERROR(CheckBytes("CpUnshard", "full", full.size(), total, elem_size,
                                     "T = cu_seqlens_padded[n]"));
  for (int r = 0; r < cp_size; ++r) {
    THDPACK_RETURN_IF_ERROR(CheckBytes("CpUnshard", "shards[" + Str(r) + "]", shards[r].size(),
                                       total / cp_size, elem_size, "T/CP"));
    if (Overlap(shards[r], full)) {
      return Status::InvalidArgument("CpUnshard: shards[" + Str(r) +
                                     "] overlaps full: the output needs its own buffer");
    }
  }
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int64_t len = int64_t{cu[i + 1]} - cu[i];
    std::byte* dst = full.data() + int64_t{cu[i]} * elem_size;
    const int64_t local = int64_t{cu[i] / cp_size} * static_cast<int64_t>(elem_size);
    for (int r = 0; r < cp_size; ++r) {
      UnshardSequence(shards[r].data() + local, len, dst, elem_size, cp_size, r);
    }
  }
  return Status::Ok();
}

Status DenseCpShardBytes(std::span<const std::byte> full, size_t elem_size, int64_t batch,
                         int64_t seq_len, const DenseShardOptions& options,
                         std::span<std::byte> out) {
  THDPACK_RETURN_IF_ERROR(CheckDenseOptions("DenseCpShard", batch, seq_len, options, true));
  THDPACK_RETURN_IF_ERROR(CheckElemSize("DenseCpShard", elem_size));
  const int cp = options.cp_size;
  THDPACK_RETURN_IF_ERROR(CheckBytes("DenseCpShard", "full", full.size(), batch * seq_len,
                                     elem_size, "batch * seq_len"));
  THDPACK_RETURN_IF_ERROR(CheckBytes("DenseCpShard", "out", out.size(), batch * (seq_len / cp),
                                     elem_size, "batch * seq_len/CP"));
  if (Overlap(full, out)) {
    return Status::InvalidArgument(
        "DenseCpShard: out overlaps full: the shard needs its own buffer");
  }
  for (int64_t b = 0; b < batch; ++b) {
    ShardSequence(full.data() + b * seq_len * elem_size, seq_len,
                  out.data() + b * (seq_len / cp) * elem_size, elem_size, cp, options.cp_rank);
  }
  return Status::Ok();
}

Status DenseCpUnshardBytes(std::span<const std::span<const std::byte>> shards, size_t elem_size,
                           int64_t batch, int64_t seq_len, const DenseShardOptions& options,
                           std::span<std::byte> full) {
  THDPACK_RETURN_IF_ERROR(CheckDenseOptions("DenseCpUnshard", batch, seq_len, options, false));
  THDPACK_RETURN_IF_ERROR(CheckElemSize("DenseCpUnshard", elem_size));
  const int cp = options.cp_size;
  if (static_cast<int64_t>(shards.size()) != cp) {
    return Status::InvalidArgument("DenseCpUnshard: " + Str(int64_t(shards.size())) +
                                   " shards given: need one per CP rank, cp_size = " + Str(cp));
  }
  THDPACK_RETURN_IF_ERROR(CheckBytes("DenseCpUnshard", "full", full.size(), batch * seq_len,
                                     elem_size, "batch * seq_len"));
  for (int r = 0; r < cp; ++r) {
    THDPACK_RETURN_IF_ERROR(CheckBytes("DenseCpUnshard", "shards[" + Str(r) + "]",
                                       shards[r].size(), batch * (seq_len / cp), elem_size,
                                       "batch * seq_len/CP"));
    if (Overlap(shards[r], full)) {
      return Status::InvalidArgument("DenseCpUnshard: shards[" + Str(r) +
                                     "] overlaps full: the output needs its own buffer");
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int r = 0; r < cp; ++r) {
      UnshardSequence(shards[r].data() + b * (seq_len / cp) * elem_size, seq_len,
                      full.data() + b * seq_len * elem_size, elem_size, cp, r);
    }
  }
  return Status::Ok();
}

Result<std::pair<int64_t, int64_t>> SpRange(int64_t local_tokens, int tp_size, int tp_rank) {
  if (tp_size < 1) {
    return Status::InvalidArgument("SpRange: tp_size = " + Str(tp_size) + ": must be >= 1");
  }
  if (tp_rank < 0 || tp_rank >= tp_size) {
    return Status::InvalidArgument("SpRange: tp_rank = " + Str(tp_rank) +
                                   ": must be in [0, tp_size = " + Str(tp_size) + ")");
  }
  if (local_tokens < 0) {
    return Status::InvalidArgument("SpRange: local_tokens = " + Str(local_tokens) +
                                   ": must be >= 0");
  }
  if (local_tokens % tp_size != 0) {
    return Status::InvalidArgument(
        "SpRange: local_tokens = " + Str(local_tokens) + " is not divisible by tp_size = " +
        Str(tp_size) +
        ": with SP the CP-local token count T/CP must be a multiple of TP (ComputeLayout with "
        "sp = true pads the last sequence so that it is)");
  }
  const int64_t count = local_tokens / tp_size;
  return std::pair<int64_t, int64_t>{count * tp_rank, count};
}

}  // namespace thdpack
