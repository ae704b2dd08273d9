// Internal: SplitMix64 (Steele, Lea, Flood 2014), the portable integer generator behind the
// mock data, shuffling and the probe's seeded weights. The same seed gives the same numbers on
// every machine and compiler, which golden figures rely on.
//
// Thread-safety: Mix64 is pure; a SplitMix64 object is used by one thread at a time.
#ifndef THDPACK_COMMON_SPLITMIX64_H_
#define THDPACK_COMMON_SPLITMIX64_H_

#include <cstdint>

namespace thdpack::internal {

// One 64-bit mix step: the output of a SplitMix64 generator whose state is x.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t Next() {
    const uint64_t out = Mix64(state_);
    state_ += 0x9E3779B97F4A7C15ULL;
    return out;
  }
  // Uniform in (0, 1]: 53 random bits, never 0 (safe for log).
  double NextUnitOpenZero() { return static_cast<double>((Next() >> 11) + 1) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

}  // namespace thdpack::internal

#endif  // THDPACK_COMMON_SPLITMIX64_H_
