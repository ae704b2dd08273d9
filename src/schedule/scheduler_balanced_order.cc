// The samples by rank, the order the balanced scheduler places them in: decreasing padded
// length, ties by increasing id. SortByPaddedThenId (a direct table over dense ids and an LSD
// radix sort on P) beside its plain reference, the comparison sort SortByPaddedThenIdPlain
// (compared on random steps in scheduler_fast_paths_test.cc); SortStep, the rank arrays the
// balanced scheduler reads.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "schedule/scheduler_balanced_internal.h"

namespace thdpack::internal {

std::vector<int32_t> SortByPaddedThenIdPlain(const PreparedStep& step) {
  const size_t n = step.size();
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    if (step.padded[x] != step.padded[y]) return step.padded[x] > step.padded[y];
    return step.ids[x] < step.ids[y];
  });
  return order;
}

namespace {

std::vector<int32_t> PlainWithPadded(const PreparedStep& step, std::vector<int64_t>* padded) {
  std::vector<int32_t> order = SortByPaddedThenIdPlain(step);
  if (padded != nullptr) {
    padded->resize(order.size());
    for (size_t k = 0; k < order.size(); ++k) {
      (*padded)[k] = step.padded[static_cast<size_t>(order[k])];
    }
  }
  return order;
}

}  // namespace

std::vector<int32_t> SortByPaddedThenId(const PreparedStep& step, std::vector<int64_t>* padded) {
  const size_t n = step.size();
  if (n < 2) return PlainWithPadded(step, padded);
  int64_t lo = step.ids[0], hi = step.ids[0];
  int64_t max_padded = 0;
  uint64_t any_bits = 0;  // every P is a multiple of 2^countr_zero(any_bits)
  size_t descents = 0;    // 0: the ids increase (as a data source numbers them)
  for (size_t i = 0; i < n; ++i) {
    lo = std::min(lo, step.ids[i]);
    hi = std::max(hi, step.ids[i]);
    max_padded = std::max(max_padded, step.padded[i]);
    any_bits |= static_cast<uint64_t>(step.padded[i]);
  }
  // The key drops the low zero bits every P shares (P is a multiple of the alignment, 2*CP):
  // fewer bits, fewer or smaller passes.
  const int zeros = std::countr_zero(any_bits | (uint64_t{1} << 62));
  for (size_t i = 1; i < n; ++i) descents += step.ids[i] <= step.ids[i - 1] ? 1 : 0;
  const bool increasing = descents == 0;
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
  if (max_padded > std::numeric_limits<int32_t>::max() ||
      (!increasing && (range == 0 || range > 4 * static_cast<uint64_t>(n) + 1024))) {
    return PlainWithPadded(step, padded);
  }
  // Each item is one word, the key (max_padded - P) / 2^zeros (so decreasing P) above the
  // PreparedStep index, so a pass of the sort moves one array. Written, never read before, so
  // not zeroed.
  auto items = std::make_unique_for_overwrite<uint64_t[]>(n);
  auto moved = std::make_unique_for_overwrite<uint64_t[]>(n);
  auto item_of = [&](size_t i) {
    return (static_cast<uint64_t>(max_padded - step.padded[i]) >> zeros << 32) |
           static_cast<uint32_t>(i);
  };
  // 1. The items in increasing id order: the step's own order when its ids increase, else a
  // direct table over the (dense, unique) ids, read in order.
  if (increasing) {
    for (size_t i = 0; i < n; ++i) items[i] = item_of(i);
  } else {
    std::vector<int32_t> table(static_cast<size_t>(range), -1);
    for (size_t i = 0; i < n; ++i) {
      table[static_cast<size_t>(static_cast<uint64_t>(step.ids[i]) - static_cast<uint64_t>(lo))] =
          static_cast<int32_t>(i);
    }
    size_t k = 0;
    for (int32_t i : table) {
      if (i >= 0) items[k++] = item_of(static_cast<size_t>(i));
    }
  }
  // 2. Stable LSD radix sort on the key: equal P keep the increasing-id order of step 1. The
  // digits split the key's bits evenly over as few passes as keep a pass's counts and write
  // positions within L1 (at most 2^11 buckets; on 16K WLB-LLM lengths, 2 passes of 9 bits
  // took half the time of 3 of 6). Real lengths crowd a few buckets of the high digit, and
  // one bucket's write position is a chain through memory (load, add, store, load ...): the
  // items are cut into kStreams consecutive streams with counts of their own, a stream's part
  // of a bucket placed after the earlier streams' parts (so the sort stays stable), and the
  // streams are moved side by side, kStreams independent chains.
  constexpr int kMaxDigitBits = 11;
  constexpr size_t kStreams = 4;  // written out four times below
  const int bits =
      std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(max_padded) >> zeros)));
  const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit = (bits + passes - 1) / passes;
  const size_t buckets = size_t{1} << digit;
  const uint64_t mask = buckets - 1;
  // Stream st < 3: items [st*q, st*q + q); the last one [3q, n), the longest.
  const size_t q = n / kStreams;
  const size_t last = n - (kStreams - 1) * q;
  // count[stream * buckets + digit value], for the pass at hand (a stream holds other items
  // at each pass).
  std::vector<uint32_t> count(kStreams * buckets);
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 32 + pass * digit;
    std::fill(count.begin(), count.end(), 0);
    uint32_t* c0 = &count[0];
    uint32_t* c1 = &count[buckets];
    uint32_t* c2 = &count[2 * buckets];
    uint32_t* c3 = &count[3 * buckets];
    const uint64_t* i0 = &items[0];
    const uint64_t* i1 = &items[q];
    const uint64_t* i2 = &items[2 * q];
    const uint64_t* i3 = &items[3 * q];
    size_t j = 0;
    for (; j < q; ++j) {
      ++c0[(i0[j] >> shift) & mask];
      ++c1[(i1[j] >> shift) & mask];
      ++c2[(i2[j] >> shift) & mask];
      ++c3[(i3[j] >> shift) & mask];
    }
    for (; j < last; ++j) ++c3[(i3[j] >> shift) & mask];
    uint32_t sum = 0;
    for (size_t d = 0; d < buckets; ++d) {
      for (size_t st = 0; st < kStreams; ++st) {
        const uint32_t c = count[st * buckets + d];
        count[st * buckets + d] = sum;
        sum += c;
      }
    }
    uint64_t* out = moved.get();
    j = 0;
    for (; j < q; ++j) {
      const uint64_t a0 = i0[j], a1 = i1[j], a2 = i2[j], a3 = i3[j];
      out[c0[(a0 >> shift) & mask]++] = a0;
      out[c1[(a1 >> shift) & mask]++] = a1;
      out[c2[(a2 >> shift) & mask]++] = a2;
      out[c3[(a3 >> shift) & mask]++] = a3;
    }
    for (; j < last; ++j) {
      const uint64_t a3 = i3[j];
      out[c3[(a3 >> shift) & mask]++] = a3;
    }
    items.swap(moved);
  }
  std::vector<int32_t> order(n);
  for (size_t k = 0; k < n; ++k) order[k] = static_cast<int32_t>(static_cast<uint32_t>(items[k]));
  if (padded != nullptr) {
    // The keys travelled with the indices: P by rank without a scattered load.
    padded->resize(n);
    for (size_t k = 0; k < n; ++k) {
      (*padded)[k] = max_padded - (static_cast<int64_t>(items[k] >> 32) << zeros);
    }
  }
  return order;
}

namespace balanced {

SortedStep SortStep(const PreparedStep& step) {
  SortedStep s;
  s.order = SortByPaddedThenId(step, &s.padded);
  const size_t n = s.order.size();
  s.cost.resize(n);
  // A sample's cost is a function of its P, and equal P are adjacent in rank order: only the
  // first of each run of equal P is looked up (a scattered load), the others copy it.
  for (size_t k = 0; k < n; ++k) {
    s.cost[k] = k > 0 && s.padded[k] == s.padded[k - 1]
                    ? s.cost[k - 1]
                    : step.cost[static_cast<size_t>(s.order[k])];
  }
  return s;
}

}  // namespace balanced
}  // namespace thdpack::internal
