// The bookkeeping fast paths of scheduling against their plain references, on fresh random
// inputs: SampleIdIndex (direct table) against a std::map, the rank order (table + radix
// sort) against the comparison sort, ScheduleWithFigures (figures from the scheduler's own
// arrays, no validation) against Schedule + ValidatePlan + ComputePlanFigures, and the balanced
// scheduler's microbatch refill by scan against its refill by heaps.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "schedule/scheduler_test_util.h"
#include "thdpack/cost.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

// Random samples whose ids are dense (a shuffled range, maybe with gaps), sparse (random 64-bit
// values) or dense with a few duplicates.
std::vector<SampleLength> RandomSamples(std::mt19937_64& rng, int kind) {
  const size_t n = 1 + rng() % 3000;
  std::vector<SampleLength> v(n);
  int64_t next_id = static_cast<int64_t>(rng() % 1'000'000) - 500'000;
  for (size_t i = 0; i < n; ++i) {
    if (kind == 1) {
      v[i].id = static_cast<int64_t>(rng());
    } else {
      v[i].id = next_id;
      next_id += 1 + static_cast<int64_t>(rng() % 3);  // gaps of 0 to 2 ids
    }
    v[i].length = 1 + static_cast<int64_t>(rng() % (rng() % 2 ? 100 : 70000));
    v[i].n_targets = static_cast<int64_t>(rng() % static_cast<uint64_t>(v[i].length + 1));
  }
  std::shuffle(v.begin(), v.end(), rng);
  if (kind == 2) {
    for (int k = 0; k < 3; ++k) v[rng() % n].id = v[rng() % n].id;
  }
  return v;
}

TEST(SampleIdIndexTest, EqualsAMapOnRandomSamples) {
  std::mt19937_64 rng(31);
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng, trial % 3);
    std::map<int64_t, SampleLength> first;  // the first sample of each id
    for (const SampleLength& s : samples) first.emplace(s.id, s);
    const SampleIdIndex index(samples);
    EXPECT_EQ(index.has_duplicates(), first.size() != samples.size());
    EXPECT_EQ(internal::HasDuplicateIds(samples), first.size() != samples.size());
    std::vector<uint8_t> used(static_cast<size_t>(index.num_slots()), 0);
    for (const auto& [id, s] : first) {
      const int64_t slot = index.Slot(id);
      ASSERT_GE(slot, 0);
      ASSERT_LT(slot, index.num_slots());
      EXPECT_EQ(used[static_cast<size_t>(slot)]++, 0) << "two ids share slot " << slot;
      EXPECT_EQ(index.Length(slot), s.length);
      EXPECT_EQ(index.NTargets(slot), s.n_targets);
    }
    for (int k = 0; k < 50; ++k) {
      const int64_t id = k % 2 ? static_cast<int64_t>(rng()) : samples[0].id + k - 25;
      EXPECT_EQ(index.Slot(id) >= 0, first.count(id) == 1) << "id " << id;
    }
  }
}

TEST(SortByPaddedThenIdTest, EqualsTheComparisonSortOnRandomSteps) {
  std::mt19937_64 rng(32);
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    auto samples = RandomSamples(rng, trial % 2);  // no duplicates: PrepareStep rejects them
    if (trial % 3 == 2) {
      // Ids in increasing order, dense or sparse: the sort starts from the step's own order.
      std::sort(samples.begin(), samples.end(),
                [](const SampleLength& x, const SampleLength& y) { return x.id < y.id; });
    }
    ScheduleOptions o;
    o.parallel = ParallelLayout::Create(std::vector<int>{1, 2, 8}[rng() % 3]).value();
    o.max_tokens_per_rank = 1 << 20;
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    auto step = internal::PrepareStep(samples, o);
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    const std::vector<int32_t> plain = internal::SortByPaddedThenIdPlain(*step);
    EXPECT_EQ(internal::SortByPaddedThenId(*step), plain);
    std::vector<int64_t> padded;
    EXPECT_EQ(internal::SortByPaddedThenId(*step, &padded), plain);
    ASSERT_EQ(padded.size(), plain.size());
    for (size_t k = 0; k < plain.size(); ++k) {
      ASSERT_EQ(padded[k], step->padded[static_cast<size_t>(plain[k])]) << "rank " << k;
    }
  }
}

// Random options that exercise every branch of the figures: DP, CP, TP with and without SP
// tails, k, a fixed M now and then, both schedulers, oversize samples skipped.
ScheduleOptions RandomOptions(std::mt19937_64& rng) {
  ScheduleOptions o;
  o.dp_size = 1 + static_cast<int>(rng() % 8);
  const int cp = std::vector<int>{1, 2, 4}[rng() % 3];
  const int tp = std::vector<int>{1, 2}[rng() % 2];
  o.parallel = ParallelLayout::Create(cp, tp, tp > 1 && rng() % 2 == 0).value();
  o.max_tokens_per_rank = std::vector<int64_t>{2048, 20000, 1 << 20}[rng() % 3];
  o.cost = ParseCostSpec(rng() % 2 ? "llama2-7b" : "tokens").value();
  o.microbatch_multiple = 1 + static_cast<int>(rng() % 2);
  if (rng() % 4 == 0) o.num_microbatches = o.microbatch_multiple * (1 + static_cast<int>(rng() % 3));
  o.scheduler = rng() % 3 == 0 ? ScheduleOptions::Scheduler::kSequential
                               : ScheduleOptions::Scheduler::kBalanced;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  return o;
}

void ExpectSameFigures(const PlanFigures& a, const PlanFigures& b) {
  testing_util::ExpectSameIntegerFigures(a, b);
  // Exactly equal doubles: the same sums in the same order.
  EXPECT_EQ(a.total_cost, b.total_cost);
  EXPECT_EQ(a.max_replica_cost, b.max_replica_cost);
  EXPECT_EQ(a.lower_bound, b.lower_bound);
  EXPECT_EQ(a.imbalance, b.imbalance);
  EXPECT_EQ(a.pad_fraction, b.pad_fraction);
  EXPECT_EQ(a.fill, b.fill);
  EXPECT_EQ(a.max_microbatch_spread, b.max_microbatch_spread);
  ASSERT_EQ(a.replicas.size(), b.replicas.size());
  for (size_t d = 0; d < a.replicas.size(); ++d) {
    EXPECT_EQ(a.replicas[d].cost, b.replicas[d].cost);
    ASSERT_EQ(a.replicas[d].microbatches.size(), b.replicas[d].microbatches.size());
    for (size_t m = 0; m < a.replicas[d].microbatches.size(); ++m) {
      const MicrobatchFigures& x = a.replicas[d].microbatches[m];
      const MicrobatchFigures& y = b.replicas[d].microbatches[m];
      EXPECT_EQ(x.n_samples, y.n_samples);
      EXPECT_EQ(x.real_tokens, y.real_tokens);
      EXPECT_EQ(x.padded_tokens, y.padded_tokens);
      EXPECT_EQ(x.sum_sq, y.sum_sq);
      EXPECT_EQ(x.n_loss_tokens, y.n_loss_tokens);
      EXPECT_EQ(x.cost, y.cost);
    }
  }
}

TEST(ScheduleWithFiguresTest, EqualsScheduleThenComputePlanFiguresOnRandomSteps) {
  std::mt19937_64 rng(33);
  int scheduled = 0;
  int timed = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng, trial % 2);  // dense or sparse ids, no duplicates
    ScheduleOptions o = RandomOptions(rng);
    if (o.cost.name != "tokens" && rng() % 2 == 0) {
      o.step_time = StepTimeModel::Create(ParseModelDims("llama2-7b").value(),
                                          ParseHardwareSpec(rng() % 2 ? "h100-ib" : "h100-nvlink")
                                              .value())
                        .value();
    }
    Result<Plan> plan = Schedule(samples, o);
    Result<ScheduledPlan> fast = ScheduleWithFigures(samples, o);
    ASSERT_EQ(plan.ok(), fast.ok());
    if (!plan.ok()) {
      EXPECT_EQ(plan.status(), fast.status());
      continue;
    }
    ++scheduled;
    ASSERT_TRUE(ValidatePlan(samples, o, fast->plan).ok());
    EXPECT_EQ(fast->plan.num_microbatches, plan->num_microbatches);
    EXPECT_EQ(fast->plan.dp_size, plan->dp_size);
    EXPECT_EQ(fast->plan.sample_ids, plan->sample_ids);
    EXPECT_EQ(fast->plan.offsets, plan->offsets);
    EXPECT_EQ(fast->plan.skipped, plan->skipped);
    EXPECT_EQ(fast->plan.scheduler, plan->scheduler);
    Result<PlanFigures> reference = ComputePlanFigures(samples, o, *plan);
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    ExpectSameFigures(fast->figures, *reference);
    // The step time from the scheduler's arrays against PlanStepTime's validated re-read.
    ASSERT_EQ(fast->sim_step_time.has_value(), o.step_time.has_value());
    if (o.step_time.has_value()) {
      Result<double> t = PlanStepTime(samples, o, fast->plan);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      EXPECT_EQ(*fast->sim_step_time, *t);
      ++timed;
    }
  }
  EXPECT_GT(timed, 40);
  EXPECT_GT(scheduled, 200);  // the comparison ran on most trials, not just the errors
}

// The refill (step D of the balanced scheduler) by a scan over a replica's microbatches, used
// up to 32 microbatches, against the heaps it replaces: the same assignment on random steps
// that need several microbatches (small budgets, many samples per replica).
TEST(BalancedRefillTest, ScanEqualsHeapsOnRandomSteps) {
  std::mt19937_64 rng(35);
  int compared = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng, trial % 2);
    ScheduleOptions o = RandomOptions(rng);
    o.scheduler = ScheduleOptions::Scheduler::kBalanced;
    o.max_tokens_per_rank = std::vector<int64_t>{2048, 8192, 20000}[rng() % 3];
    auto step = internal::PrepareStep(samples, o);
    ASSERT_TRUE(step.ok());
    if (!internal::CheckEnoughSamples(*step, o).ok()) continue;
    ScheduleOptions::Scheduler who_scan{}, who_heaps{};
    Result<internal::Assignment> scan = internal::ScheduleBalanced(*step, o, &who_scan);
    Result<internal::Assignment> heaps = internal::ScheduleBalanced(
        *step, o, &who_heaps, nullptr, internal::BalancedTuning{.plain_refill = true});
    ASSERT_EQ(scan.ok(), heaps.ok());
    if (!scan.ok()) continue;
    EXPECT_EQ(who_scan, who_heaps);
    EXPECT_EQ(scan->num_microbatches, heaps->num_microbatches);
    EXPECT_EQ(scan->offsets, heaps->offsets);
    EXPECT_EQ(scan->items, heaps->items);
    if (who_scan == ScheduleOptions::Scheduler::kBalanced && scan->num_microbatches > 1) {
      ++compared;
    }
  }
  EXPECT_GT(compared, 100);  // most trials refilled several microbatches
}

// The balanced scheduler leaves the sequential candidate out when a lower bound of its cost
// shows it cannot be chosen; the plain form always computes its exact cost. The same plan,
// chooser and figures on random steps; and the bound is below the exact cost of the
// sequential plan of every step (SP tails and CP padding included).
TEST(BalancedSequentialBoundTest, EqualsExactSequentialCostOnRandomSteps) {
  std::mt19937_64 rng(37);
  int compared = 0;
  int bounded = 0;
  int left_out = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng, trial % 2);
    ScheduleOptions o = RandomOptions(rng);
    o.scheduler = ScheduleOptions::Scheduler::kBalanced;
    // Tight budgets at a fixed M now and then: best fit may find no room, next-fit may.
    if (trial % 3 == 0) {
      o.max_tokens_per_rank = 2048;
      o.num_microbatches = o.microbatch_multiple * (1 + static_cast<int>(rng() % 8));
    }
    auto step = internal::PrepareStep(samples, o);
    ASSERT_TRUE(step.ok());
    if (!internal::CheckEnoughSamples(*step, o).ok()) continue;
    if (auto seq = internal::ScheduleSequential(*step, o, o.num_microbatches); seq.ok()) {
      const double exact_cost = internal::ComputeAssignmentCost(*step, o, *seq).max_replica_cost;
      EXPECT_LE(internal::MaxReplicaCostLowerBound(*step, *seq), exact_cost);
      EXPECT_GE(internal::MaxReplicaCostLowerBound(*step, *seq), 0.99 * exact_cost - 1e-9)
          << "the bound is far below the cost: it would seldom leave anything out";
      ++bounded;
    }
    ScheduleOptions::Scheduler who_bound{}, who_exact{};
    PlanFigures f_bound, f_exact;
    Result<internal::Assignment> bound = internal::ScheduleBalanced(
        *step, o, &who_bound, &f_bound, internal::BalancedTuning{.sequential_left_out = &left_out});
    Result<internal::Assignment> exact = internal::ScheduleBalanced(
        *step, o, &who_exact, &f_exact, internal::BalancedTuning{.plain_sequential = true});
    ASSERT_EQ(bound.ok(), exact.ok());
    if (!bound.ok()) {
      EXPECT_EQ(bound.status(), exact.status());
      continue;
    }
    ++compared;
    EXPECT_EQ(who_bound, who_exact);
    EXPECT_EQ(bound->num_microbatches, exact->num_microbatches);
    EXPECT_EQ(bound->offsets, exact->offsets);
    EXPECT_EQ(bound->items, exact->items);
    ExpectSameFigures(f_bound, f_exact);
  }
  EXPECT_GT(compared, 150);
  EXPECT_GT(bounded, 150);
  EXPECT_GT(left_out, 100);  // the bound did leave it out on most steps
}

}  // namespace
}  // namespace thdpack
