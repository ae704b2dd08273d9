#include "wire/coding.h"

#include <algorithm>

namespace thdpack::wire {

RiceChoice ChooseRiceParameter(std::span<const uint32_t> values) {
  uint32_t largest = 0;
  for (uint32_t v : values) largest = v > largest ? v : largest;
  // Beyond k = bit_width(largest) every quotient is already 0 and each extra bit of k costs n.
  const int k_max = std::min(kMaxRiceParameter, static_cast<int>(std::bit_width(largest)));
  RiceChoice best{0, UINT64_MAX};
  for (int k = 0; k <= k_max; ++k) {
    uint64_t bits = static_cast<uint64_t>(values.size()) * static_cast<uint64_t>(k + 1);
    for (uint32_t v : values) bits += v >> k;
    if (bits < best.bits) best = {k, bits};
  }
  return best;
}

}  // namespace thdpack::wire
