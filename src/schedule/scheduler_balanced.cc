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
//
// Files: this one holds the M search and the choice among its candidates; the plan at one M
// (BalancedAtM, scheduler_balanced_internal.h) has step A in scheduler_balanced_place.cc, B and
// C in scheduler_balanced_local_search.cc, D in scheduler_balanced_refill.cc, and the samples
// by rank it reads in scheduler_balanced_order.cc.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "schedule/scheduler_balanced_internal.h"

namespace thdpack::internal {
namespace {

using balanced::BalancedAtM;
using balanced::SortedStep;
using balanced::SortStep;

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
