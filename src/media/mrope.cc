// The multimodal rotary positions of Qwen2-VL and Qwen2.5-VL (thdpack/media.h): one sample's
// [3, L] positions by transformers 5.x's rule, and a packed microbatch's CP shard of them.
#include <algorithm>
#include <cmath>
#include <string>

#include "thdpack/media.h"
#include "thdpack/shard.h"

namespace thdpack {
namespace {
std::string Str(int64_t v) { return std::to_string(v); }
}  // namespace

Result<std::vector<int64_t>> SampleMropePositions(Mrope mrope, std::span<const MediaItem> items,
                                                  int64_t length, int64_t merge,
                                                  double tokens_per_second) {
  if (mrope == Mrope::kNone) {
    return Status::InvalidArgument("SampleMropePositions: mrope is none");
  }
  if (length < 1 || merge < 1) {
    return Status::InvalidArgument("SampleMropePositions: length " + Str(length) + ", merge " +
                                   Str(merge) + ": both must be >= 1");
  }
  const size_t L = static_cast<size_t>(length);
  std::vector<int64_t> out(3 * L, 0);
  int64_t p = 0;      // the running position
  int64_t at = 0;     // the next sample position to write
  auto text = [&](int64_t end) {
    for (; at < end; ++at, ++p) {
      for (size_t r = 0; r < 3; ++r) out[r * L + static_cast<size_t>(at)] = p;
    }
  };
  for (const MediaItem& x : items) {
    if (x.begin < at || x.begin + x.tokens > length) {
      return Status::InvalidArgument("SampleMropePositions: an item's tokens [" + Str(x.begin) +
                                     ", " + Str(x.begin + x.tokens) + ") overlap another's or " +
                                     "lie past the sample's " + Str(length));
    }
    text(x.begin);
    const int64_t gh = x.grid.h / merge, gw = x.grid.w / merge;
    if (x.grid.t * gh * gw != x.tokens) {
      return Status::InvalidArgument("SampleMropePositions: an item of grid [" + Str(x.grid.t) +
                                     ", " + Str(x.grid.h) + ", " + Str(x.grid.w) + "] holds " +
                                     Str(x.tokens) + " tokens, not t*h*w/merge^2");
    }
    // transformers: (torch.arange(t) * time_interval).long(), a float32 product truncated.
    const bool timed = mrope == Mrope::kQwen25Vl && x.timed;
    const float interval = static_cast<float>(tokens_per_second * x.seconds);
    size_t k = static_cast<size_t>(x.begin);
    for (int64_t t = 0; t < x.grid.t; ++t) {
      const int64_t tt =
          timed ? static_cast<int64_t>(static_cast<float>(t) * interval) : t;
      for (int64_t y = 0; y < gh; ++y) {
        for (int64_t z = 0; z < gw; ++z, ++k) {
          out[k] = p + tt;
          out[L + k] = p + y;
          out[2 * L + k] = p + z;
        }
      }
    }
    at = x.begin + x.tokens;
    p += std::max(x.grid.h, x.grid.w) / merge;
  }
  text(length);
  return out;
}

Result<std::vector<int64_t>> MropeShard(std::span<const std::vector<int64_t>> positions,
                                        const Layout& layout, int cp_size, int cp_rank) {
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(layout.cu_seqlens_padded, cp_size));
  const size_t n = layout.cu_seqlens_padded.size() - 1;
  if (positions.size() != n || layout.cu_seqlens.size() != n + 1) {
    return Status::InvalidArgument("MropeShard: positions of " +
                                   Str(static_cast<int64_t>(positions.size())) +
                                   " sequences, the layout has " + Str(static_cast<int64_t>(n)));
  }
  const size_t T = static_cast<size_t>(layout.cu_seqlens_padded[n]);
  std::vector<int64_t> whole(3 * T, 0);
  for (size_t i = 0; i < n; ++i) {
    const size_t L = static_cast<size_t>(layout.cu_seqlens[i + 1] - layout.cu_seqlens[i]);
    const size_t b = static_cast<size_t>(layout.cu_seqlens_padded[i]);
    const size_t P = static_cast<size_t>(layout.cu_seqlens_padded[i + 1]) - b;
    if (positions[i].size() != 3 * L) {
      return Status::InvalidArgument(
          "MropeShard: sequence " + Str(static_cast<int64_t>(i)) + " has " +
          Str(static_cast<int64_t>(positions[i].size())) + " positions, not 3 x its " +
          Str(static_cast<int64_t>(L)) + " tokens");
    }
    int64_t next = 0;
    for (size_t r = 0; r < 3; ++r) {
      for (size_t o = 0; o < L; ++o) {
        whole[r * T + b + o] = positions[i][r * L + o];
        next = std::max(next, positions[i][r * L + o] + 1);
      }
    }
    for (size_t o = L; o < P; ++o) {
      for (size_t r = 0; r < 3; ++r) whole[r * T + b + o] = next + static_cast<int64_t>(o - L);
    }
  }
  THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> idx,
                           CpPartitionIndices(layout.cu_seqlens_padded, cp_size, cp_rank));
  std::vector<int64_t> out(3 * idx.size());
  for (size_t r = 0; r < 3; ++r) {
    for (size_t k = 0; k < idx.size(); ++k) {
      out[r * idx.size() + k] = whole[r * T + static_cast<size_t>(idx[k])];
    }
  }
  return out;
}

}  // namespace thdpack
