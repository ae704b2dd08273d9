// The parallel layout of a microbatch and its padding rule (thdpack/parallel_layout.h).
#include "thdpack/parallel_layout.h"

#include <charconv>
#include <limits>
#include <numeric>
#include <string>
#include <string_view>
#include <system_error>

namespace thdpack {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

Result<ParallelLayout> ParallelLayout::Create(int cp_size, int tp_size, bool sp,
                                              int64_t extra_alignment, int64_t rank_multiple) {
  if (cp_size < 1) {
    return Status::InvalidArgument("cp_size = " + Str(cp_size) + ": must be >= 1");
  }
  if (tp_size < 1) {
    return Status::InvalidArgument("tp_size = " + Str(tp_size) + ": must be >= 1");
  }
  if (extra_alignment < 1) {
    return Status::InvalidArgument("extra_alignment = " + Str(extra_alignment) +
                                   ": must be >= 1");
  }
  if (rank_multiple < 1) {
    return Status::InvalidArgument("rank_multiple = " + Str(rank_multiple) +
                                   ": must be >= 1 (1: no rank multiple)");
  }
  const int64_t z = ZigzagMultiple(cp_size);
  if (extra_alignment > kInt32Max / z) {
    return Status::OutOfRange("extra_alignment = " + Str(extra_alignment) +
                              " times the zigzag multiple " + Str(z) +
                              " exceeds int32: T must fit int32");
  }
  ParallelLayout l;
  l.cp_size_ = cp_size;
  l.tp_size_ = tp_size;
  l.sp_ = sp;
  l.extra_alignment_ = extra_alignment;
  l.rank_multiple_ = rank_multiple;
  const int64_t a = z * extra_alignment;
  // Checked in steps so that no product overflows: split_ranks <= 2^62, then times R.
  const int64_t split = l.split_ranks();
  if (split > kInt32Max) {
    return Status::OutOfRange("cp_size * tp_size = " + Str(cp_size) + " * " + Str(tp_size) +
                              " exceeds int32: T must fit int32");
  }
  if (rank_multiple > kInt32Max / split) {
    return Status::OutOfRange("rank_multiple = " + Str(rank_multiple) + " times the " +
                              Str(split) + " ranks T is split over exceeds int32: T must fit "
                              "int32");
  }
  const int64_t r = split * rank_multiple;
  const int64_t q = std::lcm(a, r);
  if (q > kInt32Max) {
    const std::string what = l.splits_over_tp() ? "cp_size * tp_size = " + Str(split)
                                                : "cp_size = " + Str(split);
    return Status::OutOfRange("token quantum lcm(" + Str(a) + ", " + what +
                              (rank_multiple > 1 ? " times rank_multiple " + Str(rank_multiple)
                                                 : std::string()) +
                              ") = " + Str(q) + " exceeds int32: T must fit int32");
  }
  l.token_quantum_ = q;
  return l;
}

Result<ParallelLayout> ParallelLayout::FromWire(int64_t cp_size, int64_t tp_size, bool sp,
                                                int64_t pad_multiple, int64_t rank_multiple) {
  if (cp_size < 1 || cp_size > kInt32Max) {
    return Status::InvalidArgument("cp_size = " + Str(cp_size) + ": must be in [1, 2^31)");
  }
  if (tp_size < 1 || tp_size > kInt32Max) {
    return Status::InvalidArgument("tp_size = " + Str(tp_size) + ": must be in [1, 2^31)");
  }
  const int64_t z = ZigzagMultiple(cp_size);
  if (pad_multiple < 1 || pad_multiple > kInt32Max || pad_multiple % z != 0) {
    return Status::InvalidArgument("pad_multiple = " + Str(pad_multiple) +
                                   ": must be in [1, 2^31) and a multiple of " + Str(z) +
                                   " (2*cp_size when cp_size > 1)");
  }
  if (rank_multiple < 1 || rank_multiple > kInt32Max) {
    return Status::InvalidArgument("rank_multiple = " + Str(rank_multiple) +
                                   ": must be in [1, 2^31)");
  }
  return Create(static_cast<int>(cp_size), static_cast<int>(tp_size), sp, pad_multiple / z,
                rank_multiple);
}

std::string ParallelLayout::ToString() const {
  return "CP=" + Str(cp_size_) + " TP=" + Str(tp_size_) + (sp_ ? " SP" : "") + " align " +
         Str(extra_alignment_) +
         (rank_multiple_ > 1 ? " rank multiple " + Str(rank_multiple_) : std::string());
}

Result<int64_t> ParseRankMultiple(std::string_view text) {
  struct Preset {
    std::string_view name;
    int64_t value;
  };
  static constexpr Preset kPresets[] = {
      {"none", 1}, {"fp8", 16}, {"mxfp8", 32}, {"blockwise", 128}};
  for (const Preset& p : kPresets) {
    if (text == p.name) return p.value;
  }
  if (!text.empty()) {
    int64_t v = 0;
    const char* end = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(text.data(), end, v);
    if (ec == std::errc() && ptr == end && v >= 1 && v <= kInt32Max) return v;
  }
  return Status::InvalidArgument(
      "rank multiple \"" + std::string(text) +
      "\": expected fp8 (16), mxfp8 (32), blockwise (128), none (1) or an integer in [1, 2^31)");
}

}  // namespace thdpack
