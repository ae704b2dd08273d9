// Steps B and C of the balanced scheduler (scheduler_balanced.cc): the count repair (every
// replica at least M samples) and the local search of moves and swaps between the straggler and
// the other replicas, under a fixed work budget.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/check.h"
#include "schedule/scheduler_balanced_internal.h"

namespace thdpack::internal::balanced {
namespace {

// Work budget of the local search, in candidate evaluations (plus 2 per sample): fixed, so
// the result does not depend on the machine.
constexpr int64_t kLocalSearchBaseBudget = 1'000'000;
// The local search stops once the straggler is this close to the lower bound (relative): a
// smaller gain is below what any step time could show.
constexpr double kLocalSearchTolerance = 1e-4;

}  // namespace

// B: every replica needs at least M samples (one per microbatch).
void BalancedAtM::RepairCounts() {
  for (int r = 0; r < dp_; ++r) {
    while (count_[r] < m_) {
      EnsureItemLists();
      int donor = -1;
      for (int q = 0; q < dp_; ++q) {
        if (count_[q] > m_ && (donor < 0 || cost_[q] > cost_[donor])) donor = q;
      }
      THDPACK_DCHECK(donor >= 0);  // n >= DP*M was checked by the caller
      if (donor < 0) return;
      const int32_t x = items_of_[donor].back();
      // Fewer samples than bins: some bin of r is empty and holds any single sample.
      int empty_bin = -1;
      for (int b = 0; b < m_ && empty_bin < 0; ++b) {
        if (bins_.Free(r, b) == step_.capacity) empty_bin = b;
      }
      if (empty_bin < 0) empty_bin = bins_.BestFit(r, padded_[x]);
      THDPACK_DCHECK(empty_bin >= 0);
      if (empty_bin < 0) return;
      MoveItem(x, r, empty_bin);
    }
  }
}

// C: moves and swaps between the straggler and the others.
void BalancedAtM::LocalSearch() {
  const double lower_bound = step_.LowerBound(dp_);
  int64_t budget = kLocalSearchBaseBudget + 2 * static_cast<int64_t>(step_.size());
  const int max_iterations = 64 + 8 * dp_;
  std::vector<std::pair<double, int>> others;
  others.reserve(dp_);
  for (int iteration = 0; iteration < max_iterations && budget > 0; ++iteration) {
    int a = 0;
    for (int r = 1; r < dp_; ++r) {
      if (cost_[r] > cost_[a]) a = r;
    }
    const double cost_a = cost_[a];
    if (cost_a <= lower_bound * (1 + kLocalSearchTolerance)) return;
    EnsureItemLists();
    const double eps = 1e-12 * cost_a;
    others.clear();
    for (int r = 0; r < dp_; ++r) {
      if (r != a) others.push_back({cost_[r], r});
    }
    std::sort(others.begin(), others.end());

    double best_gain = eps;
    int32_t best_x = -1, best_y = -1;
    int best_r = -1, best_bin = -1;
    const auto& items_a = items_of_[a];
    for (const auto& [cost_b, b] : others) {
      const double diff = cost_a - cost_b;
      if (diff / 2 <= best_gain) break;
      const auto& items_b = items_of_[b];
      // Moves of one sample a -> b: gain min(c, diff - c), best near c = diff/2.
      if (count_[a] > m_) {
        // items_a is by decreasing cost: first position with cost <= diff/2.
        auto it = std::partition_point(items_a.begin(), items_a.end(), [&](int32_t i) {
          return cost_of_[i] > diff / 2;
        });
        const ptrdiff_t pos = it - items_a.begin();
        for (ptrdiff_t k = std::max<ptrdiff_t>(0, pos - 2);
             k < std::min<ptrdiff_t>(static_cast<ptrdiff_t>(items_a.size()), pos + 2); ++k) {
          --budget;
          const int32_t x = items_a[k];
          const double c = cost_of_[x];
          const double gain = std::min(c, diff - c);
          if (gain <= best_gain) continue;
          const int bin = bins_.BestFit(b, padded_[x]);
          if (bin < 0) continue;
          best_gain = gain;
          best_x = x;
          best_y = -1;
          best_r = b;
          best_bin = bin;
        }
      }
      // Swaps x (in a) <-> y (in b), c_x > c_y: d = c_x - c_y, gain min(d, diff - d).
      for (const int32_t x : items_a) {
        const double cx = cost_of_[x];
        if (cx <= best_gain) break;  // d < c_x, so no swap with this or a cheaper x helps
        const double want = cx - diff / 2;
        auto it = std::partition_point(items_b.begin(), items_b.end(), [&](int32_t i) {
          return cost_of_[i] > want;
        });
        const ptrdiff_t pos = it - items_b.begin();
        for (ptrdiff_t k = std::max<ptrdiff_t>(0, pos - 2);
             k < std::min<ptrdiff_t>(static_cast<ptrdiff_t>(items_b.size()), pos + 2); ++k) {
          --budget;
          const int32_t y = items_b[k];
          const double d = cx - cost_of_[y];
          if (d <= 0) continue;
          const double gain = std::min(d, diff - d);
          if (gain <= best_gain) continue;
          const int64_t px = padded_[x];
          const int64_t py = padded_[y];
          // y takes x's place in a; x takes y's place in b, or another bin of b with room.
          if (bins_.Free(a, bin_of_[x]) + px < py) continue;
          int bin = bin_of_[y];
          if (bins_.Free(b, bin) + py < px) {
            bin = bins_.BestFit(b, px);
            if (bin < 0) continue;
          }
          best_gain = gain;
          best_x = x;
          best_y = y;
          best_r = b;
          best_bin = bin;
        }
        if (budget <= 0) break;
      }
      if (budget <= 0) break;
    }
    if (best_x < 0) return;
    if (best_y < 0) {
      MoveItem(best_x, best_r, best_bin);
    } else {
      const int bin_x = bin_of_[best_x];
      // Free y's room first, so x fits where y was.
      EraseItem(best_r, best_y);
      Unplace(best_y);
      MoveItem(best_x, best_r, best_bin);
      Place(best_y, a, bin_x);
      InsertItem(a, best_y);
    }
  }
}

}  // namespace thdpack::internal::balanced
