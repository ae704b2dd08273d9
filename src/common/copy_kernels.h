// Internal: the few per-chunk writers the packing and sharding fast paths are made of. Each
// runs over a contiguous range without a per-element branch, in blocks of 8 the compiler turns
// into vector stores at -O2 without target flags (builds stay portable, docs/design.md section 11).
//
// Thread-safety: pure functions on caller-owned memory.
#ifndef THDPACK_COMMON_COPY_KERNELS_H_
#define THDPACK_COMMON_COPY_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace thdpack::internal {

// out[k] = start + k for k in [0, n).
inline void Iota32(int32_t* out, int64_t n, int32_t start) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const int32_t base = start + static_cast<int32_t>(k);
    for (int u = 0; u < 8; ++u) out[k + u] = base + u;
  }
  for (; k < n; ++k) out[k] = start + static_cast<int32_t>(k);
}

// out[k] = value for k in [0, n).
inline void Fill32(int32_t* out, int64_t n, int32_t value) {
  if (n <= 0) return;
  if (value == 0) {
    std::memset(out, 0, static_cast<size_t>(n) * sizeof(int32_t));
    return;
  }
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int u = 0; u < 8; ++u) out[k + u] = value;
  }
  for (; k < n; ++k) out[k] = value;
}

// memcpy that accepts n == 0 with any pointers (memcpy itself requires non-null ones).
inline void Copy(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

inline void Set(void* dst, int value, size_t n) {
  if (n != 0) std::memset(dst, value, n);
}

}  // namespace thdpack::internal

#endif  // THDPACK_COMMON_COPY_KERNELS_H_
