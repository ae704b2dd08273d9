// Groups kept together (schedule.h, ScheduleOptions::keep_groups; docs/scheduling.md "Groups").
//
// A group is a unit: its samples keep their own padded lengths P and costs cost(P)/CP, and the
// unit's tokens and cost are their sums - never the cost of one merged sequence, since
// attention's quadratic term is per sequence. The balanced scheduler over units, for one M:
//   A. LPT over units: by decreasing cost (ties by first sample), each to the replica of least
//      (cost, index) that can hold it in its M bins by best fit: the whole unit in one bin
//      (kMicrobatch), or each of its samples, longest first, in some bin (kReplica).
//   B. Count repair: a replica with fewer items than M (items: units under kMicrobatch,
//      samples under kReplica) takes the cheapest unit of the costliest replica that can
//      spare it.
//   C. Local search between the straggler and the others: the move or swap of units that most
//      lowers the larger of the two replicas' costs, kept only if both still fill their M bins
//      (Fill); repeated until none helps, the straggler is within 0.01% of the lower bound, or
//      a fixed budget of evaluations (never time: the plan must not depend on the machine)
//      runs out.
//   D. Fill: inside each replica, items by decreasing cost into the bin of least (cost, index)
//      with room (evens microbatch costs); if some item finds none, best-fit decreasing by
//      tokens; a bin left empty then takes the smallest item of the bin with the most items.
// The M search and the choice are ScheduleBalanced's (fewest microbatches within 1% of the
// least straggler), M starting at the larger of the tokens' and the sequences' lower bounds.
// A sequence cap (max_seqs_per_microbatch S, static shapes) is a second room of every bin:
// A, D and the checks of B and C place an item only where both its tokens and its samples fit;
// A picks the bin that leaves the least of both (each as a share of a bin), and when a unit
// then finds no bin, A runs again with each unit in the bin with the most sequences left. The
// balanced scheduler sends a capped step here with each sample its own unit.
// A microbatch lists its units by their first sample, each unit's samples in input order: a
// pair stays side by side, chosen before rejected as the caller gave them.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack::internal {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

constexpr double kSearchStop = 1e-4;   // local search stops this close to the lower bound
constexpr int64_t kSearchBudget = 200000;  // candidate evaluations of the local search
constexpr int kFillTries = 16;         // feasibility checks per local-search round

std::string ModeName(const ScheduleOptions& o) {
  if (o.keep_groups == ScheduleOptions::KeepGroups::kNone) {  // here for a sequence cap only
    return "max_seqs_per_microbatch " + Str(o.max_seqs_per_microbatch);
  }
  return "keep_groups '" + std::string(KeepGroupsName(o.keep_groups)) + "'";
}

// The ids of a unit's samples, at most four, for messages.
std::string IdList(std::span<const SampleLength> samples, const StepUnits& units, int32_t u) {
  std::string s;
  int shown = 0, total = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (units.unit_of[i] != u) continue;
    if (shown < 4) s += (shown++ > 0 ? ", " : "") + Str(samples[i].id);
    ++total;
  }
  if (total > shown) s += ", ... (" + Str(total) + " in all)";
  return s;
}

// One unit of the step: its samples (PreparedStep indices, increasing), tokens and cost.
struct Unit {
  std::vector<int32_t> members;
  int64_t padded = 0;
  double cost = 0;
};

// A thing Fill places in a bin: a unit (kMicrobatch) or one sample (kReplica).
struct Item {
  int64_t padded = 0;
  double cost = 0;
  int32_t key = 0;  // first PreparedStep index: ties, and the order inside a microbatch
  int32_t ref = 0;  // unit index (kMicrobatch) or PreparedStep index (kReplica)
  int64_t seqs = 1;  // its samples (sequences)
};

// What a bin leaves of its two rooms, each as a share of the bin's (tokens, and sequences
// under a cap): the best fit of both takes the least. Without a cap, tokens alone.
double RoomLeft(int64_t tokens, int64_t seqs, int64_t capacity, int64_t max_seqs) {
  const double t = static_cast<double>(tokens) / static_cast<double>(capacity);
  if (max_seqs == INT64_MAX) return t;
  return t + static_cast<double>(seqs) / static_cast<double>(max_seqs);
}

// Items into m bins of `capacity` tokens and `max_seqs` sequences (see D at the top); nullopt
// when they do not fit or are fewer than m. Returns each bin's item positions (into `items`).
std::optional<std::vector<std::vector<int32_t>>> Fill(const std::vector<Item>& items, int m,
                                                      int64_t capacity, int64_t max_seqs) {
  if (static_cast<int64_t>(items.size()) < m) return std::nullopt;
  std::vector<int32_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<std::vector<int32_t>> bins(static_cast<size_t>(m));
  std::vector<int64_t> room(static_cast<size_t>(m), capacity);
  std::vector<int64_t> seq_room(static_cast<size_t>(m), max_seqs);
  // LPT: decreasing cost, ties by key.
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const Item& x = items[static_cast<size_t>(a)];
    const Item& y = items[static_cast<size_t>(b)];
    if (x.cost != y.cost) return x.cost > y.cost;
    return x.key < y.key;
  });
  std::vector<double> cost(static_cast<size_t>(m), 0.0);
  bool ok = true;
  for (int32_t it : order) {
    const Item& x = items[static_cast<size_t>(it)];
    int best = -1;
    for (int b = 0; b < m; ++b) {
      if (room[static_cast<size_t>(b)] < x.padded || seq_room[static_cast<size_t>(b)] < x.seqs) {
        continue;
      }
      if (best < 0 || cost[static_cast<size_t>(b)] < cost[static_cast<size_t>(best)]) best = b;
    }
    if (best < 0) {
      ok = false;
      break;
    }
    bins[static_cast<size_t>(best)].push_back(it);
    room[static_cast<size_t>(best)] -= x.padded;
    seq_room[static_cast<size_t>(best)] -= x.seqs;
    cost[static_cast<size_t>(best)] += x.cost;
  }
  if (!ok) {
    // Best-fit decreasing by tokens; under a sequence cap, the best fit of both rooms (the
    // least tokens and sequences left, each as a share of its bin's).
    auto left = [&](int b) {
      return RoomLeft(room[static_cast<size_t>(b)], seq_room[static_cast<size_t>(b)], capacity,
                      max_seqs);
    };
    for (auto& b : bins) b.clear();
    std::fill(room.begin(), room.end(), capacity);
    std::fill(seq_room.begin(), seq_room.end(), max_seqs);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      const Item& x = items[static_cast<size_t>(a)];
      const Item& y = items[static_cast<size_t>(b)];
      if (x.padded != y.padded) return x.padded > y.padded;
      return x.key < y.key;
    });
    for (int32_t it : order) {
      const Item& x = items[static_cast<size_t>(it)];
      int best = -1;
      for (int b = 0; b < m; ++b) {
        if (room[static_cast<size_t>(b)] < x.padded ||
            seq_room[static_cast<size_t>(b)] < x.seqs) {
          continue;
        }
        if (best < 0 || left(b) < left(best)) best = b;
      }
      if (best < 0) return std::nullopt;
      bins[static_cast<size_t>(best)].push_back(it);
      room[static_cast<size_t>(best)] -= x.padded;
      seq_room[static_cast<size_t>(best)] -= x.seqs;
    }
  }
  // Empty bins take the smallest item of the bin with the most items (one item always fits
  // an empty bin: a unit holds at most max_seqs samples, FitOfUnits).
  for (int b = 0; b < m; ++b) {
    if (!bins[static_cast<size_t>(b)].empty()) continue;
    int donor = -1;
    for (int c = 0; c < m; ++c) {
      if (bins[static_cast<size_t>(c)].size() < 2) continue;
      const size_t size = bins[static_cast<size_t>(c)].size();
      if (donor < 0 || size > bins[static_cast<size_t>(donor)].size()) donor = c;
    }
    if (donor < 0) return std::nullopt;
    auto& from = bins[static_cast<size_t>(donor)];
    auto smallest = std::min_element(from.begin(), from.end(), [&](int32_t a, int32_t c) {
      const Item& x = items[static_cast<size_t>(a)];
      const Item& y = items[static_cast<size_t>(c)];
      if (x.padded != y.padded) return x.padded < y.padded;
      return x.key > y.key;
    });
    bins[static_cast<size_t>(b)].push_back(*smallest);
    from.erase(smallest);
  }
  return bins;
}

// What a bin has left: padded tokens and sequences.
struct Room {
  int64_t tokens = 0;
  int64_t seqs = 0;
};

class GroupsAtM {
 public:
  GroupsAtM(const PreparedStep& step, const ScheduleOptions& o, const std::vector<Unit>& units,
            int m, double lower_bound)
      : step_(step), o_(o), units_(units), m_(m), lower_bound_(lower_bound),
        max_seqs_(SequenceCap(o)),
        by_replica_(static_cast<size_t>(o.dp_size)), cost_(static_cast<size_t>(o.dp_size), 0.0),
        count_(static_cast<size_t>(o.dp_size), 0) {}

  std::optional<Assignment> Run() {
    if (!PlaceByLpt()) {
      if (max_seqs_ == INT64_MAX) return std::nullopt;
      // Under a sequence cap, once more with each unit in the bin with the most sequences left
      // among those that hold its tokens: many short samples then spread over the bins
      // instead of using up the sequences of bins whose tokens they could share.
      std::fill(cost_.begin(), cost_.end(), 0.0);
      std::fill(count_.begin(), count_.end(), 0);
      for (auto& us : by_replica_) us.clear();
      spread_ = true;
      if (!PlaceByLpt()) return std::nullopt;
    }
    if (!RepairCounts()) return std::nullopt;
    LocalSearch();
    return Emit();
  }

 private:
  bool per_sample() const { return o_.keep_groups == ScheduleOptions::KeepGroups::kReplica; }
  int64_t ItemsOf(int32_t u) const {
    return per_sample() ? static_cast<int64_t>(units_[static_cast<size_t>(u)].members.size()) : 1;
  }
  std::vector<Item> ItemsOfReplica(const std::vector<int32_t>& us) const {
    std::vector<Item> items;
    for (int32_t u : us) {
      const Unit& x = units_[static_cast<size_t>(u)];
      if (!per_sample()) {
        items.push_back({x.padded, x.cost, x.members.front(), u,
                         static_cast<int64_t>(x.members.size())});
        continue;
      }
      for (int32_t i : x.members) {
        const size_t k = static_cast<size_t>(i);
        items.push_back({step_.padded[k], step_.cost[k], i, i});
      }
    }
    return items;
  }
  bool Fits(const std::vector<int32_t>& us) const {
    return Fill(ItemsOfReplica(us), m_, step_.capacity, max_seqs_).has_value();
  }

  // A: units by decreasing cost to the least-cost replica whose bins hold them (best fit).
  bool PlaceByLpt() {
    const int dp = o_.dp_size;
    std::vector<std::vector<Room>> room(
        static_cast<size_t>(dp),
        std::vector<Room>(static_cast<size_t>(m_), Room{step_.capacity, max_seqs_}));
    std::set<std::pair<double, int>> replicas;
    for (int r = 0; r < dp; ++r) replicas.insert({0.0, r});
    std::vector<int32_t> order(units_.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      const Unit& x = units_[static_cast<size_t>(a)];
      const Unit& y = units_[static_cast<size_t>(b)];
      if (x.cost != y.cost) return x.cost > y.cost;
      return x.members.front() < y.members.front();
    });
    std::vector<Room> trial;
    for (int32_t u : order) {
      const Unit& x = units_[static_cast<size_t>(u)];
      bool placed = false;
      for (auto it = replicas.begin(); it != replicas.end() && !placed; ++it) {
        const int r = it->second;
        trial = room[static_cast<size_t>(r)];
        if (!PlaceInBins(x, &trial)) continue;
        room[static_cast<size_t>(r)] = trial;
        const double c = it->first + x.cost;
        replicas.erase(it);
        replicas.insert({c, r});
        cost_[static_cast<size_t>(r)] = c;
        count_[static_cast<size_t>(r)] += ItemsOf(u);
        by_replica_[static_cast<size_t>(r)].push_back(u);
        placed = true;
      }
      if (!placed) return false;
    }
    return true;
  }

  // Best fit (by tokens) of a unit into `room` (the whole unit, or each sample longest first).
  bool PlaceInBins(const Unit& x, std::vector<Room>* room) const {
    // Under a sequence cap, the best fit of both rooms (as in Fill).
    auto left = [&](const Room& r) {
      return RoomLeft(r.tokens, r.seqs, step_.capacity, max_seqs_);
    };
    auto better = [&](const Room& r, const Room& than) {
      if (spread_ && r.seqs != than.seqs) return r.seqs > than.seqs;
      return left(r) < left(than);
    };
    auto best_fit = [&](int64_t p, int64_t seqs) {
      int best = -1;
      for (int b = 0; b < m_; ++b) {
        const Room& r = (*room)[static_cast<size_t>(b)];
        if (r.tokens >= p && r.seqs >= seqs &&
            (best < 0 || better(r, (*room)[static_cast<size_t>(best)]))) {
          best = b;
        }
      }
      if (best < 0) return false;
      (*room)[static_cast<size_t>(best)].tokens -= p;
      (*room)[static_cast<size_t>(best)].seqs -= seqs;
      return true;
    };
    if (!per_sample()) return best_fit(x.padded, static_cast<int64_t>(x.members.size()));
    std::vector<int64_t> ps;
    for (int32_t i : x.members) ps.push_back(step_.padded[static_cast<size_t>(i)]);
    std::sort(ps.rbegin(), ps.rend());
    for (int64_t p : ps) {
      if (!best_fit(p, 1)) return false;
    }
    return true;
  }

  void MoveUnit(int32_t u, int from, int to) {
    auto& f = by_replica_[static_cast<size_t>(from)];
    f.erase(std::find(f.begin(), f.end(), u));
    by_replica_[static_cast<size_t>(to)].push_back(u);
    const double c = units_[static_cast<size_t>(u)].cost;
    cost_[static_cast<size_t>(from)] -= c;
    cost_[static_cast<size_t>(to)] += c;
    count_[static_cast<size_t>(from)] -= ItemsOf(u);
    count_[static_cast<size_t>(to)] += ItemsOf(u);
  }

  // B: every replica needs at least M items (one per microbatch).
  bool RepairCounts() {
    const int dp = o_.dp_size;
    for (int r = 0; r < dp; ++r) {
      while (count_[static_cast<size_t>(r)] < m_) {
        // Donors by decreasing cost (ties by index); the cheapest unit they can spare that
        // leaves both replicas able to fill their bins.
        std::vector<int> donors;
        for (int d = 0; d < dp; ++d) {
          if (d != r && count_[static_cast<size_t>(d)] > m_) donors.push_back(d);
        }
        std::sort(donors.begin(), donors.end(), [&](int a, int b) {
          if (cost_[static_cast<size_t>(a)] != cost_[static_cast<size_t>(b)]) {
            return cost_[static_cast<size_t>(a)] > cost_[static_cast<size_t>(b)];
          }
          return a < b;
        });
        bool moved = false;
        for (int d : donors) {
          std::vector<int32_t> us = by_replica_[static_cast<size_t>(d)];
          std::sort(us.begin(), us.end(), [&](int32_t a, int32_t b) {
            if (units_[static_cast<size_t>(a)].cost != units_[static_cast<size_t>(b)].cost) {
              return units_[static_cast<size_t>(a)].cost < units_[static_cast<size_t>(b)].cost;
            }
            return a < b;
          });
          for (int32_t u : us) {
            if (count_[static_cast<size_t>(d)] - ItemsOf(u) < m_) continue;
            std::vector<int32_t> to = by_replica_[static_cast<size_t>(r)];
            to.push_back(u);
            if (!Fits(to)) continue;
            MoveUnit(u, d, r);
            moved = true;
            break;
          }
          if (moved) break;
        }
        if (!moved) return false;
      }
    }
    return true;
  }

  // C: moves and swaps between the straggler and the others.
  void LocalSearch() {
    const int dp = o_.dp_size;
    if (dp < 2) return;
    int64_t budget = kSearchBudget + 2 * static_cast<int64_t>(units_.size());
    struct Change {
      double after;  // max of the two replicas' costs after it
      int32_t u, v;  // v = -1: a move
      int r;
    };
    while (budget > 0) {
      int s = 0;
      for (int r = 1; r < dp; ++r) {
        if (cost_[static_cast<size_t>(r)] > cost_[static_cast<size_t>(s)]) s = r;
      }
      const double cs = cost_[static_cast<size_t>(s)];
      if (cs <= lower_bound_ * (1 + kSearchStop)) return;
      std::vector<Change> changes;
      for (int32_t u : by_replica_[static_cast<size_t>(s)]) {
        const double cu = units_[static_cast<size_t>(u)].cost;
        for (int r = 0; r < dp && budget > 0; ++r) {
          if (r == s) continue;
          const double cr = cost_[static_cast<size_t>(r)];
          --budget;
          if (count_[static_cast<size_t>(s)] - ItemsOf(u) >= m_) {
            const double after = std::max(cs - cu, cr + cu);
            if (after < cs * (1 - 1e-12)) changes.push_back({after, u, -1, r});
          }
          for (int32_t v : by_replica_[static_cast<size_t>(r)]) {
            --budget;
            const double cv = units_[static_cast<size_t>(v)].cost;
            if (cv >= cu) continue;
            if (count_[static_cast<size_t>(s)] - ItemsOf(u) + ItemsOf(v) < m_ ||
                count_[static_cast<size_t>(r)] - ItemsOf(v) + ItemsOf(u) < m_) {
              continue;
            }
            const double after = std::max(cs - cu + cv, cr + cu - cv);
            if (after < cs * (1 - 1e-12)) changes.push_back({after, u, v, r});
          }
        }
      }
      if (changes.empty()) return;
      std::sort(changes.begin(), changes.end(), [](const Change& a, const Change& b) {
        if (a.after != b.after) return a.after < b.after;
        if (a.u != b.u) return a.u < b.u;
        if (a.v != b.v) return a.v < b.v;
        return a.r < b.r;
      });
      bool applied = false;
      for (size_t k = 0; k < changes.size() && k < static_cast<size_t>(kFillTries); ++k) {
        const Change& c = changes[k];
        budget -= 2;
        std::vector<int32_t> from = by_replica_[static_cast<size_t>(s)];
        std::vector<int32_t> to = by_replica_[static_cast<size_t>(c.r)];
        from.erase(std::find(from.begin(), from.end(), c.u));
        to.push_back(c.u);
        if (c.v >= 0) {
          to.erase(std::find(to.begin(), to.end(), c.v));
          from.push_back(c.v);
        }
        if (!Fits(from) || !Fits(to)) continue;
        MoveUnit(c.u, s, c.r);
        if (c.v >= 0) MoveUnit(c.v, c.r, s);
        applied = true;
        break;
      }
      if (!applied) return;
    }
  }

  // D and the assignment: each replica's items filled into its bins; a microbatch lists its
  // items by first sample, a unit's samples in input order.
  std::optional<Assignment> Emit() const {
    Assignment a;
    a.num_microbatches = m_;
    a.dp_size = o_.dp_size;
    a.offsets.push_back(0);
    for (int r = 0; r < o_.dp_size; ++r) {
      const std::vector<Item> items = ItemsOfReplica(by_replica_[static_cast<size_t>(r)]);
      auto bins = Fill(items, m_, step_.capacity, max_seqs_);
      if (!bins.has_value()) return std::nullopt;
      for (auto& bin : *bins) {
        std::sort(bin.begin(), bin.end(), [&](int32_t x, int32_t y) {
          return items[static_cast<size_t>(x)].key < items[static_cast<size_t>(y)].key;
        });
        for (int32_t it : bin) {
          const Item& x = items[static_cast<size_t>(it)];
          if (per_sample()) {
            a.items.push_back(x.ref);
          } else {
            const auto& members = units_[static_cast<size_t>(x.ref)].members;
            a.items.insert(a.items.end(), members.begin(), members.end());
          }
        }
        a.offsets.push_back(static_cast<int64_t>(a.items.size()));
      }
    }
    return a;
  }

  const PreparedStep& step_;
  const ScheduleOptions& o_;
  const std::vector<Unit>& units_;
  const int m_;
  const double lower_bound_;
  const int64_t max_seqs_;  // sequences a bin may hold (INT64_MAX: no cap)
  bool spread_ = false;     // PlaceInBins: the bin with the most sequences left (Run)
  std::vector<std::vector<int32_t>> by_replica_;  // units of each replica
  std::vector<double> cost_;                      // sum of their costs
  std::vector<int64_t> count_;                    // their items
};

}  // namespace

Result<StepUnits> UnitsOfGroups(std::span<const SampleLength> samples, const ScheduleOptions& o,
                                std::span<const int64_t> groups) {
  StepUnits units;
  const size_t n = samples.size();
  if (o.keep_groups == ScheduleOptions::KeepGroups::kNone) {
    THDPACK_RETURN_IF_ERROR(
        CheckKeepGroups(o, groups.empty() ? "" : Str(static_cast<int64_t>(groups.size())) +
                                                     " group ids")
            .WithContext("schedule"));
    units.unit_of.resize(n);
    std::iota(units.unit_of.begin(), units.unit_of.end(), 0);
    units.value.resize(n);
    for (size_t i = 0; i < n; ++i) units.value[i] = samples[i].id;
    return units;
  }
  if (groups.size() != n) {
    return Status::InvalidArgument("schedule: " + ModeName(o) + " needs one group id per sample: " +
                                   Str(static_cast<int64_t>(groups.size())) + " group ids for " +
                                   Str(static_cast<int64_t>(n)) + " samples");
  }
  std::unordered_map<int64_t, int32_t> unit_of_value;
  unit_of_value.reserve(n);
  units.unit_of.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto [it, inserted] = unit_of_value.try_emplace(groups[i], units.size());
    if (inserted) units.value.push_back(groups[i]);
    units.unit_of[i] = it->second;
  }
  return units;
}

UnitFit FitOfUnits(std::span<const SampleLength> samples, const ScheduleOptions& o,
                   const StepUnits& units) {
  const size_t u_count = units.value.size();
  const int64_t capacity = UsableCapacity(o);
  UnitFit fit{std::vector<int64_t>(u_count, 0), std::vector<uint8_t>(u_count, 0),
              std::vector<uint8_t>(u_count, 0), std::vector<int64_t>(u_count, 0)};
  for (size_t i = 0; i < samples.size(); ++i) {
    const size_t u = static_cast<size_t>(units.unit_of[i]);
    const int64_t p = o.parallel.PaddedLength(samples[i].length);
    fit.sum_p[u] += p;
    ++fit.n_samples[u];
    if (p > capacity) fit.has_oversize[u] = 1;
  }
  const bool whole = o.keep_groups == ScheduleOptions::KeepGroups::kMicrobatch;
  const int64_t max_seqs = SequenceCap(o);
  for (size_t u = 0; u < u_count; ++u) {
    fit.fits[u] = !fit.has_oversize[u] &&
                  !(whole && (fit.sum_p[u] > capacity || fit.n_samples[u] > max_seqs));
  }
  return fit;
}

Result<std::vector<int32_t>> ApplyGroups(std::span<const SampleLength> samples,
                                         const ScheduleOptions& o, const StepUnits& units,
                                         PreparedStep* step) {
  const size_t n = samples.size();
  const size_t u_count = units.value.size();
  std::vector<int32_t> kept_index(n, -1);
  for (size_t i = 0, j = 0; i < n; ++i) {
    if (j < step->size() && step->ids[j] == samples[i].id) {
      kept_index[i] = static_cast<int32_t>(j++);
    }
  }
  // An oversize sample left the prepared step already (kSkip; any other policy made it an
  // error there); a unit over the capacity together (kMicrobatch) is named here.
  const UnitFit fit = FitOfUnits(samples, o, units);
  bool any = false;
  for (size_t u = 0; u < u_count; ++u) {
    if (!fit.fits[u]) {
      const bool too_many = o.max_seqs_per_microbatch > 0 &&
                            fit.n_samples[u] > o.max_seqs_per_microbatch;
      if (!fit.has_oversize[u] && too_many &&
          o.oversize != ScheduleOptions::OversizePolicy::kSkip) {
        return Status::InvalidArgument(
            "schedule: group " + Str(units.value[u]) + " (samples " +
            IdList(samples, units, static_cast<int32_t>(u)) + ") holds " +
            Str(fit.n_samples[u]) + " samples, over max_seqs_per_microbatch " +
            Str(o.max_seqs_per_microbatch) + " (" + ModeName(o) +
            " puts a group in one microbatch; raise the cap, keep groups on a replica, or set "
            "the oversize policy 'skip' to leave such groups out)");
      }
      if (!fit.has_oversize[u] && o.oversize != ScheduleOptions::OversizePolicy::kSkip) {
        return Status::InvalidArgument(
            "schedule: group " + Str(units.value[u]) + " (samples " +
            IdList(samples, units, static_cast<int32_t>(u)) + ") pads to " + Str(fit.sum_p[u]) +
            " tokens together, over the microbatch budget " + Str(MicrobatchBudget(o)) +
            " = CP " + Str(o.parallel.cp_size()) + " x max_tokens_per_rank " +
            Str(o.max_tokens_per_rank) + " (" + ModeName(o) +
            " puts a group in one microbatch; raise max_tokens_per_rank, keep groups on a "
            "replica, or set the oversize policy 'skip' to leave such groups out)");
      }
      any = true;
    }
  }
  std::vector<int32_t> unit_of_kept;
  unit_of_kept.reserve(step->size());
  if (!any) {
    for (size_t i = 0; i < n; ++i) {
      if (kept_index[i] >= 0) unit_of_kept.push_back(units.unit_of[i]);
    }
    return unit_of_kept;
  }
  // Drop every sample of a unit that does not fit; skipped in input order.
  PreparedStep out;
  out.capacity = step->capacity;
  for (size_t i = 0; i < n; ++i) {
    const int32_t u = units.unit_of[i];
    if (!fit.fits[static_cast<size_t>(u)]) {
      out.skipped.push_back(samples[i].id);
      continue;
    }
    const size_t j = static_cast<size_t>(kept_index[i]);
    out.ids.push_back(step->ids[j]);
    out.length.push_back(step->length[j]);
    out.n_targets.push_back(step->n_targets[j]);
    out.padded.push_back(step->padded[j]);
    out.cost.push_back(step->cost[j]);
    if (step->has_encoder()) {
      out.enc_patches.push_back(step->enc_patches[j]);
      out.enc_frame_sq.push_back(step->enc_frame_sq[j]);
    }
    out.total_padded += step->padded[j];
    out.total_cost += step->cost[j];
    out.max_cost = std::max(out.max_cost, step->cost[j]);
    unit_of_kept.push_back(u);
  }
  *step = std::move(out);
  return unit_of_kept;
}

Result<Assignment> ScheduleGroups(const PreparedStep& step, const ScheduleOptions& o,
                                  const std::vector<int32_t>& unit_of) {
  // Dense units in order of their first sample.
  std::vector<Unit> units;
  {
    std::unordered_map<int32_t, int32_t> dense;
    for (size_t i = 0; i < unit_of.size(); ++i) {
      auto [it, inserted] = dense.try_emplace(unit_of[i], static_cast<int32_t>(units.size()));
      if (inserted) units.emplace_back();
      Unit& x = units[static_cast<size_t>(it->second)];
      x.members.push_back(static_cast<int32_t>(i));
      x.padded += step.padded[i];
      x.cost += step.cost[i];
    }
  }
  const int64_t dp = o.dp_size;
  const int64_t k = o.microbatch_multiple;
  const bool per_sample = o.keep_groups == ScheduleOptions::KeepGroups::kReplica;
  const int64_t n_units = static_cast<int64_t>(units.size());
  const int64_t n_items = per_sample ? static_cast<int64_t>(step.size()) : n_units;
  if (n_units < dp || n_items < dp * (o.num_microbatches > 0 ? o.num_microbatches : k)) {
    return Status::InvalidArgument(
        "schedule: too few groups: " + Str(n_units) + " groups of " +
        Str(static_cast<int64_t>(step.size())) + " samples for DP " + Str(dp) + " x " +
        (o.num_microbatches > 0 ? "M " + Str(o.num_microbatches) : "k " + Str(k)) +
        " microbatches (" + ModeName(o) + ": " +
        (per_sample ? "every replica needs a group and every microbatch a sample"
                    : "every microbatch needs a whole group") + ")");
  }
  double max_unit = 0;
  for (const Unit& x : units) max_unit = std::max(max_unit, x.cost);
  const double lower_bound = std::max(step.total_cost / static_cast<double>(dp), max_unit);
  const int64_t max_m = n_items / dp;
  int64_t m_lo = o.num_microbatches;
  if (m_lo == 0) {
    const int64_t per_m = dp * step.capacity;
    m_lo = std::max<int64_t>(1, (step.total_padded + per_m - 1) / per_m);
    if (o.max_seqs_per_microbatch > 0) {  // every bin holds at most S sequences
      const int64_t seqs_per_m = dp * o.max_seqs_per_microbatch;
      m_lo = std::max<int64_t>(m_lo, (static_cast<int64_t>(step.size()) + seqs_per_m - 1) /
                                         seqs_per_m);
    }
    m_lo = (m_lo + k - 1) / k * k;
  }
  if (o.max_seqs_per_microbatch > 0 && m_lo > max_m) {
    return Status::InvalidArgument(
        "schedule: too few samples for max_seqs_per_microbatch " +
        Str(o.max_seqs_per_microbatch) + ": " + Str(static_cast<int64_t>(step.size())) +
        " samples need M >= " + Str(m_lo) + " microbatches a replica (DP " + Str(dp) + " x " +
        Str(o.max_seqs_per_microbatch) + " sequences each" +
        (k > 1 ? ", M a multiple of k " + Str(k) : std::string()) + "), and " + Str(dp) +
        " x " + Str(m_lo) + " microbatches would leave some without a sample: raise the cap, "
        "or give a batch of at least DP x M samples");
  }
  struct Candidate {
    Assignment a;
    AssignmentCost cost;
  };
  std::vector<Candidate> candidates;
  std::vector<int64_t> tried;
  for (int64_t m = m_lo; static_cast<int>(tried.size()) < o.max_microbatch_search && m <= max_m;
       m += k) {
    tried.push_back(m);
    std::optional<Assignment> a = GroupsAtM(step, o, units, static_cast<int>(m), lower_bound).Run();
    if (a.has_value()) {
      AssignmentCost c = ComputeAssignmentCost(step, o, *a);
      candidates.push_back({std::move(*a), c});
      if (c.max_replica_cost <= kNearBest * lower_bound) break;
    }
    if (o.num_microbatches > 0) break;
  }
  if (candidates.empty()) {
    std::string list;
    for (int64_t m : tried) list += (list.empty() ? "" : ", ") + Str(m);
    return Status::InvalidArgument(
        "schedule: " + ModeName(o) + ": no plan found for M in {" + list + "} (" +
        Str(n_units) + " groups, microbatches of " + Str(MicrobatchBudget(o)) +
        " padded tokens" +
        (o.max_seqs_per_microbatch > 0
             ? " and " + Str(o.max_seqs_per_microbatch) + " sequences"
             : std::string()) +
        ", DP = " + Str(dp) + "): raise max_tokens_per_rank" +
        (o.max_seqs_per_microbatch > 0 ? ", max_seqs_per_microbatch" : "") +
        (o.num_microbatches > 0 ? " or M" : " or max_microbatch_search"));
  }
  std::vector<int> ms;
  std::vector<AssignmentCost> costs;
  for (const Candidate& c : candidates) {
    ms.push_back(c.a.num_microbatches);
    costs.push_back(c.cost);
  }
  const size_t pick = ChooseCandidate(ms, costs);
  return std::move(candidates[pick].a);
}

Status CheckGroupPlacement(std::span<const SampleLength> samples, const ScheduleOptions& o,
                           const StepUnits& units, std::span<const PlacedSample> where,
                           const std::function<bool(int32_t)>& fits) {
  if (o.keep_groups == ScheduleOptions::KeepGroups::kNone) return Status::Ok();
  auto bad = [&](int32_t u, const std::string& what) {
    return Status::InvalidArgument("invalid plan: group " +
                                   Str(units.value[static_cast<size_t>(u)]) + " (" +
                                   ModeName(o) + "): " + what);
  };
  const size_t u_count = units.value.size();
  std::vector<int64_t> last(u_count, -2);  // input index of the unit's previous sample; -2: none
  std::vector<uint8_t> skipped(u_count, 0);
  for (size_t i = 0; i < samples.size(); ++i) {
    const int32_t u = units.unit_of[i];
    const int64_t prev = last[static_cast<size_t>(u)];
    const bool is_skipped = where[i].container < 0;
    if (prev == -2) {
      skipped[static_cast<size_t>(u)] = is_skipped;
      if (is_skipped && fits(u)) return bad(u, "skipped, but it fits");
    } else {
      const PlacedSample& p = where[static_cast<size_t>(prev)];
      const std::string ids = "ids " + Str(samples[static_cast<size_t>(prev)].id) + " and " +
                              Str(samples[i].id);
      if (is_skipped != static_cast<bool>(skipped[static_cast<size_t>(u)])) {
        return bad(u, ids + ": one scheduled, one skipped (a group is skipped whole)");
      }
      if (!is_skipped && p.container != where[i].container) {
        return bad(u, ids + " are in different " +
                          (o.keep_groups == ScheduleOptions::KeepGroups::kMicrobatch
                               ? std::string("microbatches")
                               : std::string("replicas")));
      }
      if (!is_skipped && o.keep_groups == ScheduleOptions::KeepGroups::kMicrobatch &&
          where[i].position != p.position + 1) {
        return bad(u, ids + " are not adjacent in input order (positions " +
                          Str(p.position) + " and " + Str(where[i].position) + ")");
      }
    }
    last[static_cast<size_t>(u)] = static_cast<int64_t>(i);
  }
  return Status::Ok();
}

}  // namespace thdpack::internal
