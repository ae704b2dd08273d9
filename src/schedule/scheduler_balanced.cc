// The balanced (cost-aware) scheduler.
//
// A replica's step cost is the sum of its samples' costs whatever microbatch they are in, so
// the problem splits in two: which replica gets which samples (that sets the straggler), and,
// inside a replica, which microbatch gets which sample (that must respect the token budget,
// leave no microbatch empty, and should even out microbatch costs for the pipeline).
//
// For one M (BalancedAtM):
//   A. LPT with best fit. Samples in decreasing padded length (= decreasing cost; ties by id)
//      go to the replica of least cost (a winner tree) whose M bins can still hold them, into
//      the bin of that replica with the least room that fits (best fit, the choice that keeps
//      packing feasible near a full budget). A replica with no room for the current sample
//      is parked in a heap keyed by its largest room, and comes back once the samples get
//      small enough: every sample costs O(log DP + bin lookup), never a scan over all replicas.
//   B. Count repair: a replica with fewer than M samples takes the cheapest sample of the
//      costliest replica that has more than M (into an empty bin: always fits).
//   C. Local search between the straggler and the other replicas: the single move or swap of
//      samples that most lowers max(cost of the straggler, cost of the other), keeping the
//      token budget and at least M samples per replica; repeated until no move helps, the
//      straggler is within 0.01% of the lower bound, or a fixed work budget (counted in
//      candidate evaluations, never in time) runs out.
//   D. Inside each replica, the samples are refilled into the M microbatches by cost (LPT:
//      next sample into the cheapest microbatch that has room), which evens out microbatch
//      costs and fills every microbatch; if that does not fit, the best-fit bins of A-C are
//      kept and an empty microbatch takes the smallest sample of the fullest one.
//
// The M search (ScheduleBalanced): M from the fewest the tokens need (rounded up to k), then
// M + k, ... at most max_microbatch_search values, stopping at the first plan within 1% of the
// lower bound (no larger M can be more than 1% better). The sequential plan (at the same fixed
// M, or at its own M) is a candidate too, so a fixed-M balanced plan is never worse than the
// sequential one. Choice: the least straggler cost C*; among plans within 1% of C*, the fewest
// microbatches; then the least straggler cost; then the least microbatch spread.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <queue>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "schedule/scheduler_internal.h"

namespace thdpack::internal {
namespace {

// Above this many microbatches per replica, bins are kept in ordered sets; below, a linear
// scan over a replica's bins is faster.
constexpr int kLinearBinsMax = 32;
// Step A places a run of equal P at least this long (and at least DP/16) by merging sorted
// sequences instead of through the tree (on the Wikipedia step of docs/scheduling.md, DP = 512,
// any threshold from 16 to 512 gave about the same time).
constexpr int32_t kMergedRunMin = 16;
// Work budget of the local search, in candidate evaluations (plus 2 per sample): fixed, so
// the result does not depend on the machine.
constexpr int64_t kLocalSearchBaseBudget = 1'000'000;
// The local search stops once the straggler is this close to the lower bound (relative): a
// smaller gain is below what any step time could show.
constexpr double kLocalSearchTolerance = 1e-4;

// Free room of the M bins of every replica, with best-fit queries.
class ReplicaBins {
 public:
  ReplicaBins(int dp, int m, int64_t capacity)
      : m_(m), use_sets_(m > kLinearBinsMax), free_(static_cast<size_t>(dp) * m, capacity) {
    if (use_sets_) {
      sets_.resize(dp);
      for (int r = 0; r < dp; ++r) {
        for (int b = 0; b < m; ++b) sets_[r].insert({capacity, b});
      }
    }
  }

  int64_t Free(int r, int b) const { return free_[Index(r, b)]; }

  // The bin of replica r with the least room >= p (ties: lowest index), or -1.
  int BestFit(int r, int64_t p) const {
    if (m_ == 1) return free_[static_cast<size_t>(r)] >= p ? 0 : -1;
    if (use_sets_) {
      auto it = sets_[r].lower_bound({p, -1});
      return it == sets_[r].end() ? -1 : it->second;
    }
    int best = -1;
    int64_t best_free = std::numeric_limits<int64_t>::max();
    const int64_t* f = &free_[Index(r, 0)];
    for (int b = 0; b < m_; ++b) {
      // Branch-free: which bin wins is data, not a pattern the predictor could learn.
      const bool better = (f[b] >= p) & (f[b] < best_free);
      best = better ? b : best;
      best_free = better ? f[b] : best_free;
    }
    return best;
  }

  int64_t MaxFree(int r) const {
    if (use_sets_) return sets_[r].empty() ? 0 : sets_[r].rbegin()->first;
    const int64_t* f = &free_[Index(r, 0)];
    return *std::max_element(f, f + m_);
  }

  // Room of bin (r, b) changes by -delta.
  void Take(int r, int b, int64_t delta) {
    const size_t k = Index(r, b);
    if (use_sets_) TakeInSet(r, b, delta);
    free_[k] -= delta;
    THDPACK_DCHECK(free_[k] >= 0);
  }

 private:
  // Take's change in replica r's ordered set (kept out of line: the common case has no sets).
  [[gnu::noinline]] void TakeInSet(int r, int b, int64_t delta) {
    const size_t k = Index(r, b);
    auto node = sets_[r].extract({free_[k], b});
    THDPACK_DCHECK(!node.empty());
    node.value().first = free_[k] - delta;
    sets_[r].insert(std::move(node));
  }

  size_t Index(int r, int b) const { return static_cast<size_t>(r) * m_ + b; }

  int m_;
  bool use_sets_;
  std::vector<int64_t> free_;                             // [DP*M]
  std::vector<std::set<std::pair<int64_t, int>>> sets_;   // per replica: (room, bin)
};

// (cost, index) keys of step A's merged runs and of the refill's heaps; the index breaks ties,
// so both are deterministic. Stored as one integer, the cost's bits above the index: for costs
// >= +0 (sums of non-negative costs from 0, as everywhere here) the bits order like the
// values, so (cost, index) compares as one integer comparison, without the branches and NaN
// checks of comparing doubles.
class CostKey {
 public:
  CostKey(double cost, int index)
      : key_((static_cast<Key>(std::bit_cast<uint64_t>(cost)) << 32) |
             static_cast<uint32_t>(index)) {
    THDPACK_DCHECK(!std::signbit(cost) && index >= 0);
  }
  int index() const { return static_cast<int>(static_cast<uint32_t>(key_)); }
  bool Less(const CostKey& o) const { return key_ < o.key_; }
  static bool Ordered(const CostKey& a, const CostKey& b) { return a.Less(b); }
 private:
  __extension__ typedef unsigned __int128 Key;
  Key key_;
};

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

// A 4-ary min-heap of CostKey with ReplaceTop (the refill's plain form, RefillByHeaps): the
// microbatch that took a sample goes back with one sift-down instead of a pop and a push. Four children per node halve the
// depth of the sift-down, a chain of dependent loads (DP = 512: 5 levels instead of 9), and
// the four sit in one or two cache lines. Keys are unique (the index), so the top is the same
// whatever the heap's arity or inner layout.
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

// (room, index) entries of the parking heap: largest room first, ties by lowest index.
struct RoomKey {
  int64_t room;
  int index;
  bool operator<(const RoomKey& o) const {
    return room != o.room ? room < o.room : index > o.index;
  }
};
using MaxRoomHeap = std::priority_queue<RoomKey>;

// The samples by rank: decreasing padded length (= decreasing cost), ties by id. The
// scheduler works on ranks so that its passes read these arrays in order.
struct SortedStep {
  std::vector<int32_t> order;   // rank -> PreparedStep index
  std::vector<int64_t> padded;  // by rank
  std::vector<double> cost;     // by rank
};

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

class BalancedAtM {
 public:
  BalancedAtM(const PreparedStep& step, const ScheduleOptions& o, const SortedStep& sorted, int m,
              const BalancedTuning& tuning)
      : step_(step),
        o_(o),
        tuning_(tuning),
        plain_refill_(tuning.plain_refill),
        tails_matter_(o.parallel.may_pad_tail()),
        order_(sorted.order),
        padded_(sorted.padded),
        cost_of_(sorted.cost),
        dp_(o.dp_size),
        m_(m),
        bins_(o.dp_size, m, step.capacity),
        replica_of_(step.size(), -1),
        bin_of_(step.size(), -1),
        cost_(o.dp_size, 0.0),
        count_(o.dp_size, 0),
        items_of_(o.dp_size) {}

  // Runs A-D; false when some sample finds no room at this M.
  bool Run(Assignment* out) {
    if (!PlaceLpt()) return false;
    RepairCounts();
    if (dp_ > 1) LocalSearch();
    FillMicrobatches();
    Emit(out);
    return true;
  }

 private:
  void Place(int32_t i, int r, int b) {
    replica_of_[i] = r;
    bin_of_[i] = b;
    bins_.Take(r, b, padded_[i]);
    cost_[r] += cost_of_[i];
    ++count_[r];
  }
  void Unplace(int32_t i) {
    const int r = replica_of_[i];
    bins_.Take(r, bin_of_[i], -padded_[i]);
    cost_[r] -= cost_of_[i];
    --count_[r];
    replica_of_[i] = -1;
    bin_of_[i] = -1;
  }

  // A: LPT over replicas, best fit inside the chosen replica: each sample, by rank, goes to the
  // replica of least (cost, index) among those with room for it. PlaceByScan is the plain form
  // (BalancedTuning::plain_lpt). The fast form keeps the replicas in a winner tree: a replica
  // found without room for the current P is removed and parked in a heap keyed by its largest
  // room; its room does not change while parked, and P only decreases, so it is set back once P
  // fits again (once per run of equal P at most). Samples come in runs of equal P (equal cost):
  // a long run goes to PlaceRunMerged, a short one to the tree sample by sample.
  bool PlaceLpt() {
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
  bool PlaceByScan(int32_t i) {
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
  bool PlaceByTree(int32_t i, ReplicaTournament& tree, MaxRoomHeap& parked) {
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
  bool PlaceRunMerged(int32_t begin, int32_t end, ReplicaTournament& tree, MaxRoomHeap& parked) {
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

  // items_of_[r]: the samples of replica r by rank (= decreasing cost, ties by id), for steps
  // B-D, built when one of them first needs it (a plan that needs none, one microbatch with
  // every replica holding a sample and a straggler already near the bound, skips it).
  void EnsureItemLists() {
    if (items_built_) return;
    items_built_ = true;
    for (int r = 0; r < dp_; ++r) {
      items_of_[r].clear();
      items_of_[r].reserve(static_cast<size_t>(count_[r]) + 1);
    }
    const int32_t n = static_cast<int32_t>(step_.size());
    for (int32_t i = 0; i < n; ++i) items_of_[replica_of_[i]].push_back(i);
  }

  void InsertItem(int r, int32_t i) {
    auto& v = items_of_[r];
    v.insert(std::lower_bound(v.begin(), v.end(), i), i);
  }
  void EraseItem(int r, int32_t i) {
    auto& v = items_of_[r];
    auto it = std::lower_bound(v.begin(), v.end(), i);
    THDPACK_DCHECK(it != v.end() && *it == i);
    v.erase(it);
  }

  void MoveItem(int32_t i, int to_r, int to_b) {
    const int from = replica_of_[i];
    EraseItem(from, i);
    Unplace(i);
    Place(i, to_r, to_b);
    InsertItem(to_r, i);
  }

  // B: every replica needs at least M samples (one per microbatch).
  void RepairCounts() {
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
  void LocalSearch() {
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

  // D: inside each replica, refill the microbatches by cost. The replicas are independent, so
  // they are refilled side by side in one pass over the samples by rank (each replica sees its
  // own samples in the same order as alone, and the pass reads the rank arrays in order).
  void FillMicrobatches() {
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
  void RefillByScan(std::vector<double>& mb_cost, std::vector<int64_t>& room,
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

  void RefillByHeaps(std::vector<double>& mb_cost, std::vector<int64_t>& room,
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

  void ApplyRefill(const std::vector<int>& new_bin, const std::vector<uint8_t>& ok) {
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
      // With tails (SP, rank multiple) the arrangement changes the replica's cost: keep the refill only when
      // it is not dearer than the best-fit bins (the straggler comes before the spread).
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
  double ExactReplicaCost(int r) const {
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
  void FillEmptyBins(int r) {
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
  void Emit(Assignment* out) {
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

  const PreparedStep& step_;
  const ScheduleOptions& o_;
  const BalancedTuning& tuning_;
  const bool plain_refill_;  // RefillByHeaps whatever M (the reference of RefillByScan)
  const bool tails_matter_;
  const std::vector<int32_t>& order_;   // rank -> PreparedStep index
  const std::vector<int64_t>& padded_;  // by rank
  const std::vector<double>& cost_of_;  // by rank
  const int dp_;
  const int m_;
  ReplicaBins bins_;
  std::vector<int> replica_of_;   // [n]
  std::vector<int> bin_of_;       // [n]
  std::vector<double> cost_;      // [DP]
  std::vector<int64_t> count_;    // [DP]
  std::vector<std::vector<int32_t>> items_of_;  // [DP], by rank (EnsureItemLists)
  bool items_built_ = false;
  std::vector<CostKey> fifo_;         // PlaceRunMerged's ring, [DP]
  std::vector<CostKey> sorted_keys_;  // PlaceRunMerged's sorted replicas, [DP]
  std::vector<CostKey> merged_;       // PlaceRunMerged's scratch, [DP]
  // sorted_keys_ holds the tree's replicas with their current costs (no change since the
  // last merged run).
  bool sorted_keys_current_ = false;
};

struct Candidate {
  Assignment assignment;
  AssignmentCost cost;
  ScheduleOptions::Scheduler who;
  std::optional<PlanFigures> figures;  // when asked for, and they did not overflow
};

// A candidate's cost; with `with_figures`, from its figures (the same sums in the same order as
// ComputeAssignmentCost), kept so that the chosen plan's figures are not computed twice.
Candidate MakeCandidate(const PreparedStep& step, const ScheduleOptions& o, Assignment a,
                        ScheduleOptions::Scheduler who, bool with_figures) {
  Candidate c{std::move(a), {}, who, std::nullopt};
  if (with_figures) {
    Result<PlanFigures> f = AssignmentFigures(step, o, c.assignment);
    if (f.ok()) {
      c.cost.max_replica_cost = f->max_replica_cost;
      c.cost.max_spread = f->max_microbatch_spread;
      c.figures = std::move(f).value();
      return c;
    }
  }
  c.cost = ComputeAssignmentCost(step, o, c.assignment);
  return c;
}

// Whether the sequential plan `seq` can be left out of the choice without computing its exact
// cost: when the least-cost balanced candidate X has no more microbatches and costs less than
// a lower bound of the sequential straggler, X comes before it in the order of the choice and
// keeps the least cost (so the 1% limit) unchanged. The bound is the largest per-replica sum
// of the samples' own costs (a microbatch's cost sums cost(P) over its samples, an SP tail
// only adds), less 1e-5 relative for rounding: a sum of k terms is within k * 2^-53 relative
// of exact, under 3e-7 for k < 2^31. Balanced scheduling keeps the exact cost
// (BalancedTuning::plain_sequential), the reference of the tests.
bool SequentialCannotWin(const PreparedStep& step, const Assignment& seq,
                         const std::vector<Candidate>& balanced) {
  if (balanced.empty()) return false;
  const Candidate* x = &balanced[0];
  for (const Candidate& c : balanced) {
    if (c.cost.max_replica_cost < x->cost.max_replica_cost) x = &c;
  }
  if (x->assignment.num_microbatches > seq.num_microbatches) return false;
  return x->cost.max_replica_cost < MaxReplicaCostLowerBound(step, seq);
}

}  // namespace

double MaxReplicaCostLowerBound(const PreparedStep& step, const Assignment& a) {
  // A replica's groups d*M .. d*M+M-1 are contiguous in `items`.
  const size_t m = static_cast<size_t>(a.num_microbatches);
  double max_sum = 0;
  for (size_t d = 0; d < static_cast<size_t>(a.dp_size); ++d) {
    double sum = 0;
    for (int64_t k = a.offsets[d * m]; k < a.offsets[(d + 1) * m]; ++k) {
      sum += step.cost[static_cast<size_t>(a.items[static_cast<size_t>(k)])];
    }
    max_sum = std::max(max_sum, sum);
  }
  return max_sum * (1 - 1e-5);
}

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

int64_t BestFitDecreasingBins(const PreparedStep& step) {
  std::vector<int64_t> sizes(step.padded.begin(), step.padded.end());
  std::sort(sizes.begin(), sizes.end(), std::greater<int64_t>());
  std::multiset<int64_t> rooms;
  int64_t bins = 0;
  for (int64_t p : sizes) {
    auto it = rooms.lower_bound(p);
    if (it == rooms.end()) {
      ++bins;
      rooms.insert(step.capacity - p);
    } else {
      auto node = rooms.extract(it);
      node.value() -= p;
      rooms.insert(std::move(node));
    }
  }
  return bins;
}

Result<Assignment> ScheduleBalanced(const PreparedStep& step, const ScheduleOptions& o,
                                    ScheduleOptions::Scheduler* chosen, PlanFigures* figures,
                                    const BalancedTuning& tuning) {
  const int32_t n = static_cast<int32_t>(step.size());
  const int64_t dp = o.dp_size;
  const int64_t k = o.microbatch_multiple;
  const SortedStep sorted = SortStep(step);

  const double lower_bound = step.LowerBound(o.dp_size);
  const int64_t max_m = n / dp;  // every microbatch needs a sample
  int64_t m_lo = 0;
  if (o.num_microbatches > 0) {
    m_lo = o.num_microbatches;
  } else {
    m_lo = std::max<int64_t>(1, (step.total_padded + dp * step.capacity - 1) / (dp * step.capacity));
    m_lo = (m_lo + k - 1) / k * k;
  }

  std::vector<Candidate> candidates;
  std::vector<int64_t> tried;
  bool hinted = false;
  for (int64_t m = m_lo; static_cast<int>(tried.size()) < o.max_microbatch_search && m <= max_m;) {
    tried.push_back(m);
    Assignment a;
    BalancedAtM run(step, o, sorted, static_cast<int>(m), tuning);
    if (run.Run(&a)) {
      candidates.push_back(MakeCandidate(step, o, std::move(a),
                                         ScheduleOptions::Scheduler::kBalanced, figures));
      if (candidates.back().cost.max_replica_cost <= kNearBest * lower_bound) break;
    } else if (!hinted && o.num_microbatches == 0) {
      // Best-fit decreasing over all samples tells roughly how many microbatches the tokens
      // really need; skip the values below it.
      hinted = true;
      const int64_t bins = BestFitDecreasingBins(step);
      const int64_t hint = ((bins + dp - 1) / dp + k - 1) / k * k;
      if (hint > m + k) {
        m = hint;
        continue;
      }
    }
    if (o.num_microbatches > 0) break;
    m += k;
  }
  {
    auto seq = ScheduleSequential(step, o, o.num_microbatches);
    // Left out when it could not be chosen (SequentialCannotWin).
    const bool left_out =
        seq.ok() && !tuning.plain_sequential && SequentialCannotWin(step, *seq, candidates);
    if (left_out && tuning.sequential_left_out != nullptr) ++*tuning.sequential_left_out;
    if (seq.ok() && !left_out) {
      // Its figures only if it is chosen (rarely): its cost pass reads the step in order.
      candidates.push_back(MakeCandidate(step, o, std::move(seq).value(),
                                         ScheduleOptions::Scheduler::kSequential, false));
    }
  }
  if (candidates.empty()) {
    const std::string budget = std::to_string(MicrobatchBudget(o));
    if (o.num_microbatches > 0) {
      return Status::InvalidArgument(
          "balanced: the " + std::to_string(n) + " samples do not fit M = " +
          std::to_string(o.num_microbatches) + " microbatches of " + budget +
          " padded tokens on each of DP = " + std::to_string(dp) +
          " replicas (neither cost-aware best fit nor next-fit found room)");
    }
    if (m_lo > max_m) {
      return Status::InvalidArgument(
          "balanced: too few samples: their padded tokens need at least M = " +
          std::to_string(m_lo) + " microbatches of " + budget + " tokens per replica, i.e. " +
          std::to_string(m_lo * dp) + " non-empty microbatches on DP = " + std::to_string(dp) +
          ", but there are only " + std::to_string(n) + " samples");
    }
    std::string list;
    for (int64_t m : tried) list += (list.empty() ? "" : ", ") + std::to_string(m);
    return Status::InvalidArgument(
        "balanced: no plan found for M in {" + list + "} (microbatches of " + budget +
        " padded tokens, DP = " + std::to_string(dp) +
        "): raise max_microbatch_search or max_tokens_per_rank");
  }
  std::vector<int> ms;
  std::vector<AssignmentCost> costs;
  for (const Candidate& c : candidates) {
    ms.push_back(c.assignment.num_microbatches);
    costs.push_back(c.cost);
  }
  const size_t pick = ChooseCandidate(ms, costs);
  *chosen = candidates[pick].who;
  if (figures != nullptr) {
    if (candidates[pick].figures.has_value()) {
      *figures = std::move(*candidates[pick].figures);
    } else {
      THDPACK_ASSIGN_OR_RETURN(*figures, AssignmentFigures(step, o, candidates[pick].assignment));
    }
  }
  return std::move(candidates[pick].assignment);
}

}  // namespace thdpack::internal
