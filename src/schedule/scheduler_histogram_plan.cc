// Planning a whole histogram step in bulk: the balanced scheduler on DP = 1, replayed over
// classes of microbatches instead of single samples (see PlanHistogram in schedule.h).
//
// What Schedule does on DP = 1, k = 1, free M, balanced, no SP tail, for the samples that a
// histogram stands for (ids in row order, lengths strictly increasing with the row):
//   - BalancedAtM succeeds at M exactly when best-fit decreasing (BFD) needs <= M bins (one
//     replica: LPT over replicas is a no-op and best fit into M pre-opened bins opens the
//     lowest empty bin exactly when BFD opens a new one), so the M search lands on M = B, the
//     BFD bin count, and stops there (its straggler is the lower bound up to rounding).
//   - Step D refills the M microbatches by cost (LPT with room); if that runs out of room the
//     BFD bins of step A are kept.
//   - The sequential candidate (next-fit in arrival order, G groups) wins only with G <= B.
// Both passes are replayed here on classes: a class is a contiguous range of bin indices
// [lo, hi) whose bins hold the same content (so the same room and, in step D, the same cost,
// bit for bit: the same additions in the same order). The per-sample decisions take the
// lowest index among equal keys, and a class is a contiguous range, so a whole class moves at
// once; a move splits it into at most two ranges.
//   Step A (best fit, ties by lowest index): the row's items go to the class with the least
//   room f >= P, lowest lo; each of its bins takes floor(f/P) of them in index order (after
//   one item a bin's room f-P is the least room that fits, so the next item follows it);
//   new bins open in index order, floor(capacity/P) items each.
//   Step D (least cost, ties by lowest index, rooms parked): the class of least (cost, lo)
//   with room >= P gives its first t = min(left, size) bins one item each.
// The work is O(rows * classes touched * log classes), independent of the number of samples.
// When a precondition does not hold, PlanHistogram returns nullopt and the caller expands.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

// One kept histogram row, in rank order (padded length decreasing, then row = id increasing).
struct RankRow {
  int64_t row;      // index into the caller's histogram
  int64_t length;   // L
  int64_t padded;   // P
  int64_t count;
  double cost;      // cost(P) / CP, as PrepareStep computes it
};

// Contents share prefixes: node = parent + `copies` sequences of histogram row `row`.
struct ContentNode {
  int64_t parent;  // -1: the empty microbatch
  int64_t row;
  int64_t copies;
};

class ContentTree {
 public:
  int64_t Add(int64_t parent, int64_t row, int64_t copies) {
    nodes_.push_back({parent, row, copies});
    return static_cast<int64_t>(nodes_.size()) - 1;
  }
  // (row, copies) of a content, in arrival order (rows increasing; a row appears at most
  // once per pass, but twice across passes is impossible as each pass builds its own tree).
  std::vector<std::pair<int64_t, int64_t>> Rows(int64_t node) const {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t v = node; v >= 0; v = nodes_[static_cast<size_t>(v)].parent) {
      out.push_back({nodes_[static_cast<size_t>(v)].row, nodes_[static_cast<size_t>(v)].copies});
    }
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::vector<ContentNode> nodes_;
};

struct BinClass {
  int64_t lo = 0;
  int64_t hi = 0;  // bins [lo, hi)
  int64_t node = -1;
  int64_t room = 0;
  double cost = 0;  // step D only
};

// Step A: best-fit decreasing with ties by the lowest bin index. Returns the classes.
std::vector<BinClass> BestFitClasses(const std::vector<RankRow>& rows, int64_t capacity,
                                     ContentTree* tree, int64_t* num_bins) {
  std::map<std::pair<int64_t, int64_t>, BinClass> open;  // (room, lo) -> class
  int64_t next_empty = 0;
  auto add = [&](const BinClass& c) { open.emplace(std::make_pair(c.room, c.lo), c); };
  for (const RankRow& r : rows) {
    int64_t left = r.count;
    const int64_t p = r.padded;
    while (left > 0) {
      auto it = open.lower_bound({p, std::numeric_limits<int64_t>::min()});
      if (it == open.end()) {
        const int64_t q = capacity / p;
        const int64_t full = left / q;
        const int64_t rest = left % q;
        if (full > 0) {
          add({next_empty, next_empty + full, tree->Add(-1, r.row, q), capacity - q * p, 0});
          next_empty += full;
        }
        if (rest > 0) {
          add({next_empty, next_empty + 1, tree->Add(-1, r.row, rest), capacity - rest * p, 0});
          ++next_empty;
        }
        break;
      }
      BinClass c = it->second;
      open.erase(it);
      const int64_t q = c.room / p;
      const int64_t t = std::min(c.hi - c.lo, left / q);
      if (t > 0) {
        add({c.lo, c.lo + t, tree->Add(c.node, r.row, q), c.room - q * p, 0});
        left -= t * q;
        c.lo += t;
      } else {
        add({c.lo, c.lo + 1, tree->Add(c.node, r.row, left), c.room - left * p, 0});
        left = 0;
        c.lo += 1;
      }
      if (c.lo < c.hi) add(c);
    }
  }
  *num_bins = next_empty;
  std::vector<BinClass> out;
  out.reserve(open.size());
  for (auto& [key, c] : open) out.push_back(c);
  return out;
}

// Step D: the refill by cost into `m` bins; nullopt when some item finds no room.
std::optional<std::vector<BinClass>> RefillClasses(const std::vector<RankRow>& rows,
                                                   int64_t capacity, int64_t m,
                                                   ContentTree* tree) {
  struct ByCost {  // min-heap on (cost, lo)
    bool operator()(const BinClass& x, const BinClass& y) const {
      return x.cost != y.cost ? x.cost > y.cost : x.lo > y.lo;
    }
  };
  struct ByRoom {  // max-heap on room, then lowest lo
    bool operator()(const BinClass& x, const BinClass& y) const {
      return x.room != y.room ? x.room < y.room : x.lo > y.lo;
    }
  };
  std::priority_queue<BinClass, std::vector<BinClass>, ByCost> heap;
  std::priority_queue<BinClass, std::vector<BinClass>, ByRoom> parked;
  heap.push({0, m, -1, capacity, 0.0});
  for (const RankRow& r : rows) {
    int64_t left = r.count;
    while (left > 0) {
      while (!parked.empty() && parked.top().room >= r.padded) {
        heap.push(parked.top());
        parked.pop();
      }
      if (heap.empty()) return std::nullopt;
      BinClass c = heap.top();
      heap.pop();
      if (c.room < r.padded) {
        parked.push(c);
        continue;
      }
      const int64_t t = std::min(left, c.hi - c.lo);
      heap.push({c.lo, c.lo + t, tree->Add(c.node, r.row, 1), c.room - r.padded, c.cost + r.cost});
      left -= t;
      c.lo += t;
      if (c.lo < c.hi) heap.push(c);
    }
  }
  std::vector<BinClass> out;
  while (!heap.empty()) {
    out.push_back(heap.top());
    heap.pop();
  }
  while (!parked.empty()) {
    out.push_back(parked.top());
    parked.pop();
  }
  std::sort(out.begin(), out.end(), [](const BinClass& x, const BinClass& y) { return x.lo < y.lo; });
  return out;
}

// Next-fit groups in arrival order (rows in input order): the sequential scheduler's count.
int64_t NextFitGroups(std::span<const HistogramRow> histogram, const ScheduleOptions& o,
                      int64_t capacity) {
  int64_t groups = 0;
  int64_t sum = 0;
  for (const HistogramRow& h : histogram) {
    const int64_t p = o.parallel.PaddedLength(h.length);
    if (h.count == 0 || p > capacity) continue;
    int64_t left = h.count;
    if (groups > 0) {
      const int64_t k = std::min(left, (capacity - sum) / p);
      sum += k * p;
      left -= k;
    }
    if (left == 0) continue;
    const int64_t q = capacity / p;
    groups += (left + q - 1) / q;
    sum = (left % q == 0 ? q : left % q) * p;
  }
  return groups;
}

}  // namespace

Result<std::optional<HistogramPlan>> PlanHistogram(std::span<const HistogramRow> histogram,
                                                   int64_t first_id,
                                                   const ScheduleOptions& options) {
  using Out = std::optional<HistogramPlan>;
  THDPACK_RETURN_IF_ERROR(internal::ValidateOptions(options));
  const ScheduleOptions& o = options;
  if (o.dp_size != 1 || o.microbatch_multiple != 1 || o.num_microbatches != 0 ||
      o.scheduler != ScheduleOptions::Scheduler::kBalanced || o.parallel.may_pad_tail() ||
      o.pad_to_max_tokens || o.max_seqs_per_microbatch > 0) {
    return Out();
  }
  for (size_t r = 0; r < histogram.size(); ++r) {
    const HistogramRow& h = histogram[r];
    if (h.length < 1 || h.length > kMaxSampleLength || h.count < 0 ||
        (r > 0 && h.length <= histogram[r - 1].length)) {
      return Out();  // the general path names the bad input
    }
  }
  const int64_t capacity = internal::UsableCapacity(o);
  const double cp = static_cast<double>(o.parallel.cp_size());
  HistogramPlan out;
  PlanFigures& f = out.figures;
  std::vector<RankRow> rows;
  int64_t total_padded = 0;
  double total_seq_cost = 0;
  double max_seq_cost = 0;
  int64_t id = first_id;
  for (size_t r = 0; r < histogram.size(); ++r) {
    const HistogramRow& h = histogram[r];
    const int64_t p = o.parallel.PaddedLength(h.length);
    if (h.count > 0 && p > capacity) {
      if (o.oversize == ScheduleOptions::OversizePolicy::kError) return Out();
      for (int64_t j = 0; j < h.count; ++j) out.skipped.push_back(id + j);
    } else if (h.count > 0) {
      const double c = o.cost.SequenceCost(p) / cp;
      rows.push_back({static_cast<int64_t>(r), h.length, p, h.count, c});
      total_padded += p * h.count;
      total_seq_cost += c * static_cast<double>(h.count);
      max_seq_cost = std::max(max_seq_cost, c);
      f.n_samples += h.count;
    }
    id += h.count;
  }
  if (f.n_samples < 1 || f.n_samples > std::numeric_limits<int32_t>::max()) return Out();
  std::stable_sort(rows.begin(), rows.end(),
                   [](const RankRow& x, const RankRow& y) { return x.padded > y.padded; });

  ContentTree tree;
  int64_t bins = 0;
  std::vector<BinClass> classes = BestFitClasses(rows, capacity, &tree, &bins);
  const int64_t m_lo = std::max<int64_t>(1, (total_padded + capacity - 1) / capacity);
  if (bins != m_lo && o.max_microbatch_search < 2) return Out();
  if (bins > std::numeric_limits<int32_t>::max()) return Out();
  if (NextFitGroups(histogram, o, capacity) <= bins) return Out();
  if (auto refill = RefillClasses(rows, capacity, bins, &tree)) classes = std::move(*refill);

  // The figures, class by class (the arrival order inside a microbatch: ids increasing).
  f.num_microbatches = static_cast<int>(bins);
  f.n_skipped = static_cast<int64_t>(out.skipped.size());
  double lo = std::numeric_limits<double>::infinity();
  double hi = 0;
  std::vector<int64_t> padded;
  for (const BinClass& c : classes) {
    MicrobatchClass mc;
    mc.count = c.hi - c.lo;
    padded.clear();
    for (const auto& [row, copies] : tree.Rows(c.node)) {
      const int64_t length = histogram[static_cast<size_t>(row)].length;
      const int64_t p = o.parallel.PaddedLength(length);
      for (int64_t j = 0; j < copies; ++j) {
        mc.lengths.push_back(length);
        padded.push_back(p);
      }
      mc.figures.real_tokens += length * copies;
      mc.figures.n_loss_tokens += (length - 1) * copies;
    }
    mc.figures.n_samples = static_cast<int64_t>(mc.lengths.size());
    const internal::MicrobatchCost cost = internal::ComputeMicrobatchCost(padded, o);
    int64_t sq = 0;
    if (cost.overflow || __builtin_mul_overflow(cost.sum_sq, mc.count, &sq) ||
        __builtin_add_overflow(f.sum_sq, sq, &f.sum_sq)) {
      return Out();  // the general path reports the overflow
    }
    mc.figures.padded_tokens = cost.padded_tokens;
    mc.figures.sum_sq = cost.sum_sq;
    mc.figures.cost = cost.cost;
    const double n = static_cast<double>(mc.count);
    f.real_tokens += mc.figures.real_tokens * mc.count;
    f.padded_tokens += mc.figures.padded_tokens * mc.count;
    f.n_loss_tokens += mc.figures.n_loss_tokens * mc.count;
    f.total_cost += mc.figures.cost * n;
    lo = std::min(lo, mc.figures.cost);
    hi = std::max(hi, mc.figures.cost);
    out.classes.push_back(std::move(mc));
  }
  f.max_replica_cost = f.total_cost;
  f.max_microbatch_spread = hi - lo;
  f.lower_bound = std::max(total_seq_cost, max_seq_cost);
  f.imbalance = f.lower_bound > 0 ? f.max_replica_cost / f.lower_bound : 1.0;
  f.pad_fraction = f.padded_tokens > 0 ? 1.0 - static_cast<double>(f.real_tokens) /
                                                   static_cast<double>(f.padded_tokens)
                                       : 0.0;
  f.fill = static_cast<double>(f.padded_tokens) /
           (static_cast<double>(bins) * static_cast<double>(MicrobatchBudget(o)));
  return Out(std::move(out));
}

}  // namespace thdpack
