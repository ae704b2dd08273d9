// The parallel layout of a microbatch and its padding rule (thdpack/parallel_layout.h).
#include "thdpack/parallel_layout.h"

#include <limits>
#include <numeric>
#include <string>

namespace thdpack {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

Result<ParallelLayout> ParallelLayout::Create(int cp_size, int tp_size, bool sp,
                                              int64_t extra_alignment) {
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
  const int64_t a = z * extra_alignment;
  if (l.splits_over_tp()) {
    const int64_t cp_tp = int64_t{cp_size} * tp_size;
    if (cp_tp > kInt32Max) {
      return Status::OutOfRange("cp_size * tp_size = " + Str(cp_size) + " * " + Str(tp_size) +
                                " exceeds int32: T must fit int32");
    }
    const int64_t q = std::lcm(a, cp_tp);
    if (q > kInt32Max) {
      return Status::OutOfRange("token quantum lcm(" + Str(a) + ", cp_size * tp_size = " +
                                Str(cp_tp) + ") = " + Str(q) + " exceeds int32: T must fit int32");
    }
    l.token_quantum_ = q;
  } else {
    l.token_quantum_ = a;
  }
  return l;
}

Result<ParallelLayout> ParallelLayout::FromWire(int64_t cp_size, int64_t tp_size, bool sp,
                                                int64_t pad_multiple) {
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
  return Create(static_cast<int>(cp_size), static_cast<int>(tp_size), sp, pad_multiple / z);
}

std::string ParallelLayout::ToString() const {
  return "CP=" + Str(cp_size_) + " TP=" + Str(tp_size_) + (sp_ ? " SP" : "") + " align " +
         Str(extra_alignment_);
}

}  // namespace thdpack
