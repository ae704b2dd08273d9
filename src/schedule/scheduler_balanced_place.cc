// Step A of the balanced scheduler (scheduler_balanced.cc): LPT over the replicas with best fit
// inside each - the winner tree of replicas (ReplicaTournament), the parking heap of those
// without room, the merge of a long run of equal P (PlaceRunMerged), and the plain scan they are
// compared with (PlaceByScan, BalancedTuning::plain_lpt).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/check.h"
#include "schedule/scheduler_balanced_internal.h"

namespace thdpack::internal::balanced {
namespace {

// Step A places a run of equal P at least this long (and at least DP/16) by merging sorted
// sequences instead of through the tree (on the Wikipedia step of docs/scheduling.md, DP = 512,
// any threshold from 16 to 512 gave about the same time).
constexpr int32_t kMergedRunMin = 16;

}  // namespace

// Step A's replicas by (cost, index): a winner tree over one leaf per replica (padded to a
// power of two with absent leaves), each node holding the least cost below it and its
// replica. The left subtree's replicas all have lower indices, so the left child winning a
// tie of costs gives (cost, index) order without comparing indices. The top is the root;
// changing a replica's cost replays the matches on its leaf's path only, log2(leaves) of
// them, each against the sibling's winner, which does not depend on the path (its loads are
// not on the chain), by conditional moves rather than a branch (SelectIfLess): no early exit
// for the predictor to miss, as a heap's sift-down has. A replica without room is removed
// (its leaf made absent) and set back later. Costs are >= +0 (sums of non-negative costs from
// 0), whose bits order like the values; an absent leaf holds kAbsent, above every such cost's
// bits.
class ReplicaTournament {
 public:
  explicit ReplicaTournament(int n)
      : leaves_(std::bit_ceil(static_cast<size_t>(std::max(n, 1)))),
        cost_(2 * leaves_, kAbsent),
        index_(2 * leaves_, 0) {
    for (size_t j = 0; j < leaves_; ++j) index_[leaves_ + j] = static_cast<uint32_t>(j);
  }
  bool empty() const { return cost_[1] == kAbsent; }
  int top() const { return static_cast<int>(index_[1]); }
  bool present(int r) const { return cost_[leaves_ + static_cast<size_t>(r)] != kAbsent; }
  double cost(int r) const {
    return std::bit_cast<double>(cost_[leaves_ + static_cast<size_t>(r)]);
  }
  void Set(int r, double cost) {
    THDPACK_DCHECK(!std::signbit(cost) && !std::isnan(cost));
    Replay(r, std::bit_cast<uint64_t>(cost));
  }
  void Remove(int r) { Replay(r, kAbsent); }
  // Bulk changes: SetQuiet or RemoveQuiet any number of leaves, then Rebuild once (O(leaves)).
  void SetQuiet(int r, double cost) {
    cost_[leaves_ + static_cast<size_t>(r)] = std::bit_cast<uint64_t>(cost);
  }
  void RemoveQuiet(int r) { cost_[leaves_ + static_cast<size_t>(r)] = kAbsent; }
  void Rebuild() {
    for (size_t node = leaves_ - 1; node >= 1; --node) {
      const size_t l = 2 * node, r = l + 1;
      const bool right = cost_[r] < cost_[l];  // a tie goes left
      cost_[node] = right ? cost_[r] : cost_[l];
      index_[node] = right ? index_[r] : index_[l];
    }
  }

 private:
  // The bits of -inf: above those of every cost >= +0 (which are below +inf's), and below
  // 2^64 - 1, so Replay's c + 1 does not wrap.
  static constexpr uint64_t kAbsent = 0xFFF0'0000'0000'0000;

  void Replay(int r, uint64_t c) {
    size_t node = leaves_ + static_cast<size_t>(r);
    uint64_t idx = static_cast<uint64_t>(r);
    cost_[node] = c;
    for (; node > 1; node >>= 1) {
      const size_t sibling = node ^ 1;
      const uint64_t oc = cost_[sibling];
      const uint64_t oi = index_[sibling];
      // The sibling wins when its cost is less, or equal and it is the left one (this node a
      // right child): oc < c + 1 is oc <= c, and c + 1 never wraps (kAbsent is below 2^64-1).
      SelectIfLess(oc, c + (node & 1), oc, oi, c, idx);
      cost_[node >> 1] = c;
      index_[node >> 1] = static_cast<uint32_t>(idx);
    }
  }

  // (c, idx) = (oc, oi) when a < b. On x86-64 two conditional moves: the compilers turn the
  // plain form's selects into a branch, which mispredicts about half the time here, or into
  // masks, two more operations on the chain of matches.
  static void SelectIfLess(uint64_t a, uint64_t b, uint64_t oc, uint64_t oi, uint64_t& c,
                           uint64_t& idx) {
#if defined(__x86_64__) && defined(__GNUC__)
    asm("cmpq %[b], %[a]\n\t"
        "cmovbq %[oc], %[c]\n\t"
        "cmovbq %[oi], %[idx]"
        : [c] "+r"(c), [idx] "+r"(idx)
        : [a] "r"(a), [b] "r"(b), [oc] "r"(oc), [oi] "r"(oi)
        : "cc");
#else
    const uint64_t take = -static_cast<uint64_t>(a < b);
    c = (oc & take) | (c & ~take);
    idx = (oi & take) | (idx & ~take);
#endif
  }

  size_t leaves_;
  std::vector<uint64_t> cost_;   // [2 * leaves]: node 1 the root, replica r's leaf at leaves + r
  std::vector<uint32_t> index_;  // [2 * leaves]: the replica of each node's cost
};

// A: LPT over replicas, best fit inside the chosen replica: each sample, by rank, goes to the
// replica of least (cost, index) among those with room for it. PlaceByScan is the plain form
// (BalancedTuning::plain_lpt). The fast form keeps the replicas in a winner tree: a replica
// found without room for the current P is removed and parked in a heap keyed by its largest
// room; its room does not change while parked, and P only decreases, so it is set back once P
// fits again (once per run of equal P at most). Samples come in runs of equal P (equal cost):
// a long run goes to PlaceRunMerged, a short one to the tree sample by sample.
bool BalancedAtM::PlaceLpt() {
  const int32_t n = static_cast<int32_t>(step_.size());
  if (tuning_.plain_lpt) {
    for (int32_t i = 0; i < n; ++i) {
      if (!PlaceByScan(i)) return false;
    }
    return true;
  }
  ReplicaTournament tree(dp_);
  for (int r = 0; r < dp_; ++r) tree.SetQuiet(r, 0.0);
  tree.Rebuild();
  MaxRoomHeap parked;
  // Below this run length, sorting the replicas' keys costs about what the tree would.
  const int32_t merge_min = std::max(kMergedRunMin, dp_ / 16);
  for (int32_t i = 0; i < n;) {
    const int64_t p = padded_[i];
    // A replica parked inside the current run of equal P has room below P: only the first
    // sample of a run can bring replicas back.
    while (!parked.empty() && parked.top().room >= p) {
      const int r = parked.top().index;
      parked.pop();
      tree.Set(r, cost_[r]);
      sorted_keys_current_ = false;
    }
    // A run at least merge_min long (P sorted: its last sample tells) goes to the merge;
    // the rest sample by sample, without looking for where their run ends.
    if (i + merge_min <= n && padded_[i + merge_min - 1] == p) {
      int32_t end = i + merge_min;
      while (end < n && padded_[end] == p) ++end;
      if (!PlaceRunMerged(i, end, tree, parked)) return false;
      i = end;
    } else {
      if (!PlaceByTree(i, tree, parked)) return false;
      ++i;
    }
  }
  return true;
}

// The plain form of step A: a scan of every replica for the least (cost, index) one with a
// bin that holds sample i; false when none has.
bool BalancedAtM::PlaceByScan(int32_t i) {
  const int64_t p = padded_[i];
  int best = -1;
  for (int r = 0; r < dp_; ++r) {
    if (bins_.BestFit(r, p) < 0) continue;
    if (best < 0 || CostKey(cost_[r], r).Less(CostKey(cost_[best], best))) best = r;
  }
  if (best < 0) return false;
  Place(i, best, bins_.BestFit(best, p));
  return true;
}

// Sample i to the tree's least (cost, index) replica with room; false when no replica has
// room.
bool BalancedAtM::PlaceByTree(int32_t i, ReplicaTournament& tree, MaxRoomHeap& parked) {
  sorted_keys_current_ = false;
  const int64_t p = padded_[i];
  while (true) {
    if (tree.empty()) return false;
    const int r = tree.top();
    const int b = bins_.BestFit(r, p);
    if (b < 0) {
      tree.Remove(r);
      parked.push({bins_.MaxFree(r), r});
      continue;
    }
    Place(i, r, b);
    tree.Set(r, cost_[r]);
    return true;
  }
}

// Ranks [begin, end), all of one P, placed as PlaceByTree places them one by one, in
// O(D log D + run) instead of O(run log D). The tree's replicas sorted by (cost, index) are
// one ascending sequence; a replica that takes a sample leaves it and joins a FIFO with its
// new cost. The choices of LPT go in ascending key order, and a replica's new cost is
// fl(old + c) with the same c for the whole run, monotone in old, so the FIFO ascends too and
// the least key is the lesser of the two heads. Rounding can break that: fl(a + c) ==
// fl(b + c) for a < b puts the two in FIFO order, which disagrees with (cost, index) order
// when the first has the larger index. Every join is checked against the FIFO's last key; on
// the first that would not ascend, the remaining keys go back into the tree and the rest of
// the run is placed by PlaceByTree. A replica without room for P is parked as PlaceByTree
// parks it (the parking heap's keys are unique, so the order of pushes does not matter).
bool BalancedAtM::PlaceRunMerged(int32_t begin, int32_t end, ReplicaTournament& tree,
                                 MaxRoomHeap& parked) {
  if (tuning_.lpt_runs_merged != nullptr) ++*tuning_.lpt_runs_merged;
  const int64_t p = padded_[begin];
  // The replicas in the tree, sorted (still so from the last run when the tree has not
  // changed since); their leaves are absent until the run ends.
  std::vector<CostKey>& s = sorted_keys_;
  if (sorted_keys_current_) {
    for (const CostKey& k : s) tree.RemoveQuiet(k.index());
  } else {
    s.clear();
    for (int r = 0; r < dp_; ++r) {
      if (!tree.present(r)) continue;
      s.push_back(CostKey(tree.cost(r), r));
      tree.RemoveQuiet(r);
    }
    std::sort(s.begin(), s.end(), CostKey::Ordered);
  }
  sorted_keys_current_ = false;
  // The FIFO: a ring of at most DP live keys (each replica is in s or in it, once).
  fifo_.resize(static_cast<size_t>(dp_), CostKey(0.0, 0));
  const size_t cap = fifo_.size();
  size_t head = 0, live = 0;
  size_t sh = 0;  // s[0..sh) have left s
  auto tail_key = [&]() -> const CostKey& {
    return fifo_[(head + live - 1) % cap];
  };
  // Every key still in s or the FIFO goes back into the tree (by the rounding fallback).
  auto restore = [&]() {
    for (size_t j = sh; j < s.size(); ++j) tree.SetQuiet(s[j].index(), cost_[s[j].index()]);
    for (size_t j = 0; j < live; ++j) {
      const int r = fifo_[(head + j) % cap].index();
      tree.SetQuiet(r, cost_[r]);
    }
    tree.Rebuild();
  };
  for (int32_t i = begin; i < end; ++i) {
    while (true) {
      const bool s_left = sh < s.size();
      if (!s_left && live == 0) {
        tree.Rebuild();
        return false;  // no replica has room
      }
      const bool from_s = live == 0 || (s_left && s[sh].Less(fifo_[head]));
      const int r = (from_s ? s[sh] : fifo_[head]).index();
      if (from_s) {
        ++sh;
      } else {
        head = head + 1 == cap ? 0 : head + 1;
        --live;
      }
      const int b = bins_.BestFit(r, p);
      if (b < 0) {
        parked.push({bins_.MaxFree(r), r});
        continue;
      }
      Place(i, r, b);
      const CostKey joined(cost_[r], r);
      if (live > 0 && joined.Less(tail_key())) {
        // Out of order by rounding: back to the tree for the rest of the run.
        if (tuning_.lpt_runs_fallback != nullptr) ++*tuning_.lpt_runs_fallback;
        tree.SetQuiet(r, cost_[r]);
        restore();
        for (int32_t k = i + 1; k < end; ++k) {
          if (!PlaceByTree(k, tree, parked)) return false;
        }
        return true;
      }
      fifo_[(head + live) % cap] = joined;
      ++live;
      break;
    }
  }
  // The rest of s and the FIFO, both ascending, merged: the tree's replicas sorted, for the
  // next run if nothing changes the tree before it.
  merged_.clear();
  size_t q = 0;
  while (sh < s.size() && q < live) {
    const CostKey& f = fifo_[(head + q) % cap];
    if (s[sh].Less(f)) {
      merged_.push_back(s[sh++]);
    } else {
      merged_.push_back(f);
      ++q;
    }
  }
  merged_.insert(merged_.end(), s.begin() + static_cast<std::ptrdiff_t>(sh), s.end());
  for (; q < live; ++q) merged_.push_back(fifo_[(head + q) % cap]);
  for (const CostKey& k : merged_) tree.SetQuiet(k.index(), cost_[k.index()]);
  tree.Rebuild();
  s.swap(merged_);
  sorted_keys_current_ = true;
  return true;
}

}  // namespace thdpack::internal::balanced
