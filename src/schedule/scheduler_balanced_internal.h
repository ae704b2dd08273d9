// src/schedule/scheduler_balanced_internal.h: the balanced scheduler's own pieces, shared by
// its files only (not by the other schedulers; not part of the public API): the room of every
// replica's bins, the (cost, index) and (room, index) keys, the samples by rank, and
// BalancedAtM, the plan at one M, whose steps (scheduler_balanced.cc says what each does and
// how the M search uses them) are defined in
//   scheduler_balanced_place.cc         A: LPT with best fit (the winner tree, merged runs)
//   scheduler_balanced_local_search.cc  B: the count repair; C: the local search
//   scheduler_balanced_refill.cc        D: the refill of each replica's microbatches, and the
//                                       assignment it emits
//   scheduler_balanced_order.cc         the samples by rank (SortStep)
// Thread-safety: a BalancedAtM is used by one thread; the rest are values.
#ifndef THDPACK_SCHEDULE_SCHEDULER_BALANCED_INTERNAL_H_
#define THDPACK_SCHEDULE_SCHEDULER_BALANCED_INTERNAL_H_

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <queue>
#include <set>
#include <utility>
#include <vector>

#include "common/check.h"
#include "schedule/scheduler_internal.h"

namespace thdpack::internal::balanced {

// Above this many microbatches per replica, bins are kept in ordered sets; below, a linear
// scan over a replica's bins is faster.
constexpr int kLinearBinsMax = 32;

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
// The step's samples by rank (SortByPaddedThenId), with P and cost by rank
// (scheduler_balanced_order.cc).
SortedStep SortStep(const PreparedStep& step);

class ReplicaTournament;  // step A's replicas (scheduler_balanced_place.cc)

// The plan at one M: steps A-D of scheduler_balanced.cc, each defined in the file named at
// its declarations. REQUIRES: n >= DP*M (the M search checks it).
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

  // A (scheduler_balanced_place.cc).
  bool PlaceLpt();
  bool PlaceByScan(int32_t i);
  bool PlaceByTree(int32_t i, ReplicaTournament& tree, MaxRoomHeap& parked);
  bool PlaceRunMerged(int32_t begin, int32_t end, ReplicaTournament& tree, MaxRoomHeap& parked);

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

  // B and C (scheduler_balanced_local_search.cc).
  void RepairCounts();
  void LocalSearch();

  // D and the assignment out (scheduler_balanced_refill.cc).
  void FillMicrobatches();
  void RefillByScan(std::vector<double>& mb_cost, std::vector<int64_t>& room,
                    std::vector<int>& new_bin, std::vector<uint8_t>& ok) const;
  void RefillByHeaps(std::vector<double>& mb_cost, std::vector<int64_t>& room,
                     std::vector<int>& new_bin, std::vector<uint8_t>& ok) const;
  void ApplyRefill(const std::vector<int>& new_bin, const std::vector<uint8_t>& ok);
  double ExactReplicaCost(int r) const;
  void FillEmptyBins(int r);
  void Emit(Assignment* out);

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

}  // namespace thdpack::internal::balanced

#endif  // THDPACK_SCHEDULE_SCHEDULER_BALANCED_INTERNAL_H_
