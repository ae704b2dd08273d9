// Step D of the balanced scheduler (scheduler_balanced.cc): inside each replica, the samples
// refilled into the M microbatches by cost - by a scan of the microbatches (RefillByScan) or by
// heaps (RefillByHeaps, the plain form, with its 4-ary MinCostHeap) - kept only where they fit
// and, with tails, cost no more; the fallback that fills empty bins; and the assignment the
// plan at one M emits (Emit).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/check.h"
#include "schedule/scheduler_balanced_internal.h"

namespace thdpack::internal::balanced {
namespace {

// A 4-ary min-heap of CostKey with ReplaceTop (the refill's plain form, RefillByHeaps): the
// microbatch that took a sample goes back with one sift-down instead of a pop and a push. Four
// children per node halve the depth of the sift-down, a chain of dependent loads (DP = 512: 5
// levels instead of 9), and the four sit in one or two cache lines. Keys are unique (the
// index), so the top is the same whatever the heap's arity or inner layout.
class MinCostHeap {
 public:
  bool empty() const { return v_.empty(); }
  const CostKey& top() const { return v_.front(); }
  void push(const CostKey& k) {
    size_t hole = v_.size();
    v_.push_back(k);
    while (hole > 0) {
      const size_t parent = (hole - 1) / kArity;
      if (!k.Less(v_[parent])) break;
      v_[hole] = v_[parent];
      hole = parent;
    }
    v_[hole] = k;
  }
  void pop() {
    const CostKey last = v_.back();
    v_.pop_back();
    if (!v_.empty()) ReplaceTop(last);
  }
  // Replaces the top by `k` and restores the heap.
  void ReplaceTop(const CostKey& k) {
    const size_t n = v_.size();
    size_t hole = 0;
    while (true) {
      const size_t first = kArity * hole + 1;
      if (first >= n) break;
      size_t best;
      if (first + kArity <= n) {
        // A tournament of the four: two independent comparisons, then one.
        const size_t a = first + static_cast<size_t>(v_[first + 1].Less(v_[first]));
        const size_t b = first + 2 + static_cast<size_t>(v_[first + 3].Less(v_[first + 2]));
        best = v_[b].Less(v_[a]) ? b : a;
      } else {
        best = first;
        for (size_t c = first + 1; c < n; ++c) best = v_[c].Less(v_[best]) ? c : best;
      }
      if (!v_[best].Less(k)) break;
      v_[hole] = v_[best];
      hole = best;
    }
    v_[hole] = k;
  }

 private:
  static constexpr size_t kArity = 4;
  std::vector<CostKey> v_;
};

}  // namespace

// D: inside each replica, refill the microbatches by cost. The replicas are independent, so
// they are refilled side by side in one pass over the samples by rank (each replica sees its
// own samples in the same order as alone, and the pass reads the rank arrays in order).
void BalancedAtM::FillMicrobatches() {
  // One microbatch: the refill would put every sample back into bin 0, where A-C left it.
  if (m_ == 1) return;
  const size_t groups = static_cast<size_t>(dp_) * m_;
  std::vector<double> mb_cost(groups, 0.0);
  std::vector<int64_t> room(groups, step_.capacity);
  std::vector<int> new_bin(step_.size(), -1);  // by rank
  std::vector<uint8_t> ok(dp_, 1);
  if (m_ <= kLinearBinsMax && !plain_refill_) {
    RefillByScan(mb_cost, room, new_bin, ok);
  } else {
    RefillByHeaps(mb_cost, room, new_bin, ok);
  }
  ApplyRefill(new_bin, ok);
}

// The refill's rule, per replica: each sample, by rank, into the microbatch of least
// (cost, index) among those with room for it; a replica where some sample finds no room is
// marked not ok. RefillByHeaps is the plain form (a heap of microbatches, those without room
// parked until the samples get small enough); RefillByScan scans the M microbatches of the
// replica instead, which for small M costs less than keeping heaps. The two choose the same
// microbatch for every sample (the heap's top is that minimum, its keys being unique); the
// tests compare them on random steps.
void BalancedAtM::RefillByScan(std::vector<double>& mb_cost, std::vector<int64_t>& room,
                               std::vector<int>& new_bin, std::vector<uint8_t>& ok) const {
  const int32_t n = static_cast<int32_t>(step_.size());
  for (int32_t i = 0; i < n; ++i) {
    const int r = replica_of_[i];
    if (!ok[r]) continue;
    const int64_t p = padded_[i];
    double* cost = &mb_cost[static_cast<size_t>(r) * m_];
    int64_t* left = &room[static_cast<size_t>(r) * m_];
    int best = -1;
    double best_cost = std::numeric_limits<double>::infinity();
    for (int b = 0; b < m_; ++b) {
      // Strictly less: the lowest index wins a tie, as in the heap's (cost, index) keys.
      const bool better = (left[b] >= p) & (cost[b] < best_cost);
      best = better ? b : best;
      best_cost = better ? cost[b] : best_cost;
    }
    if (best < 0) {
      ok[r] = 0;
      continue;
    }
    new_bin[i] = best;
    left[best] -= p;
    cost[best] += cost_of_[i];
  }
}

void BalancedAtM::RefillByHeaps(std::vector<double>& mb_cost, std::vector<int64_t>& room,
                                std::vector<int>& new_bin, std::vector<uint8_t>& ok) const {
  std::vector<MinCostHeap> heaps(dp_);
  std::vector<MaxRoomHeap> parked(dp_);
  for (int r = 0; r < dp_; ++r) {
    for (int b = 0; b < m_; ++b) heaps[r].push({0.0, b});
  }
  const int32_t n = static_cast<int32_t>(step_.size());
  for (int32_t i = 0; i < n; ++i) {
    const int r = replica_of_[i];
    if (!ok[r]) continue;
    const int64_t p = padded_[i];
    MinCostHeap& heap = heaps[r];
    MaxRoomHeap& park = parked[r];
    double* cost = &mb_cost[static_cast<size_t>(r) * m_];
    int64_t* left = &room[static_cast<size_t>(r) * m_];
    while (!park.empty() && park.top().room >= p) {
      const int b = park.top().index;
      park.pop();
      heap.push({cost[b], b});
    }
    while (true) {
      if (heap.empty()) {
        ok[r] = 0;
        break;
      }
      const int b = heap.top().index();
      if (left[b] < p) {
        heap.pop();
        park.push({left[b], b});
        continue;
      }
      new_bin[i] = b;
      left[b] -= p;
      cost[b] += cost_of_[i];
      heap.ReplaceTop({cost[b], b});
      break;
    }
  }
}

void BalancedAtM::ApplyRefill(const std::vector<int>& new_bin, const std::vector<uint8_t>& ok) {
  const int32_t n = static_cast<int32_t>(step_.size());
  // The first M samples of a replica each opened an empty microbatch (cost 0 comes first),
  // so none is empty when the replica has >= M samples.
  if (!tails_matter_) {
    for (int32_t i = 0; i < n; ++i) {
      if (ok[replica_of_[i]]) bin_of_[i] = new_bin[i];
    }
  }
  for (int r = 0; r < dp_; ++r) {
    if (!ok[r]) {
      EnsureItemLists();
      FillEmptyBins(r);
      continue;
    }
    if (!tails_matter_) continue;
    EnsureItemLists();
    // With tails (SP, rank multiple) the arrangement changes the replica's cost: keep the refill
    // only when it is not dearer than the best-fit bins (the straggler comes before the spread).
    const auto& items = items_of_[r];
    FillEmptyBins(r);
    std::vector<int> kept(items.size());
    for (size_t k = 0; k < items.size(); ++k) kept[k] = bin_of_[items[k]];
    const double kept_cost = ExactReplicaCost(r);
    for (size_t k = 0; k < items.size(); ++k) bin_of_[items[k]] = new_bin[items[k]];
    if (kept_cost < ExactReplicaCost(r)) {
      for (size_t k = 0; k < items.size(); ++k) bin_of_[items[k]] = kept[k];
    }
  }
}

// The cost of replica r with its current bins, SP tails included, each microbatch in
// arrival order (as Emit lays it out).
double BalancedAtM::ExactReplicaCost(int r) const {
  std::vector<std::vector<int32_t>> per_bin(m_);
  for (int32_t i : items_of_[r]) per_bin[bin_of_[i]].push_back(i);
  double total = 0;
  std::vector<int64_t> padded;
  for (auto& bin : per_bin) {
    for (int32_t& i : bin) i = order_[i];  // rank -> arrival index
    std::sort(bin.begin(), bin.end());
    padded.clear();
    for (int32_t i : bin) padded.push_back(step_.padded[i]);
    total += ComputeMicrobatchCost(padded, o_).cost;
  }
  return total;
}

// Fallback of D: keep the best-fit bins; an empty bin takes the smallest sample of the bin
// with the most samples (a single sample always fits an empty bin).
void BalancedAtM::FillEmptyBins(int r) {
  std::vector<std::vector<int32_t>> per_bin(m_);
  for (int32_t i : items_of_[r]) per_bin[bin_of_[i]].push_back(i);  // by rank
  for (int b = 0; b < m_; ++b) {
    if (!per_bin[b].empty()) continue;
    int donor = 0;
    for (int q = 1; q < m_; ++q) {
      if (per_bin[q].size() > per_bin[donor].size()) donor = q;
    }
    THDPACK_DCHECK(per_bin[donor].size() >= 2);
    const int32_t x = per_bin[donor].back();
    per_bin[donor].pop_back();
    per_bin[b].push_back(x);
    bin_of_[x] = b;
  }
}

// Groups in (replica, microbatch) order; inside a microbatch, arrival order (ranks mapped
// back to PreparedStep indices).
void BalancedAtM::Emit(Assignment* out) {
  const size_t groups = static_cast<size_t>(dp_) * m_;
  out->dp_size = dp_;
  out->num_microbatches = m_;
  out->offsets.assign(groups + 1, 0);
  const int32_t n = static_cast<int32_t>(step_.size());
  // Walking the samples in arrival order fills every group already sorted (no sort per
  // group): group_of maps a PreparedStep index to its group (one scatter in rank order).
  // It is kept in the assignment for the figures' and step time's passes.
  std::vector<int32_t>& group_of = out->group_of;
  group_of.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    const int32_t g = replica_of_[i] * m_ + bin_of_[i];
    group_of[static_cast<size_t>(order_[i])] = g;
    ++out->offsets[static_cast<size_t>(g) + 1];
  }
  for (size_t g = 0; g < groups; ++g) out->offsets[g + 1] += out->offsets[g];
  std::vector<int64_t> cursor(out->offsets.begin(), out->offsets.end() - 1);
  out->items.resize(static_cast<size_t>(n));
  for (int32_t j = 0; j < n; ++j) out->items[cursor[group_of[static_cast<size_t>(j)]]++] = j;
}

}  // namespace thdpack::internal::balanced
