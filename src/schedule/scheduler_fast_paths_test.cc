// The bookkeeping fast paths of scheduling against their plain references, on fresh random
// inputs: SampleIdIndex (direct table) against a std::map, the rank order (table + radix
// sort) against the comparison sort, ScheduleWithFigures (figures from the scheduler's own
// arrays, no validation) against Schedule + ValidatePlan + ComputePlanFigures, and the balanced
// scheduler's microbatch refill by scan against its refill by heaps, and its step A by runs of
// equal P merged from sorted sequences against the heap sample by sample.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
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
  switch (rng() % 3) {
    case 0: o.cost = ParseCostSpec("llama2-7b").value(); break;
    case 1: o.cost = ParseCostSpec("tokens").value(); break;
    default:
      // A measured profile's cost: seconds, with a constant per sequence.
      o.cost = CostModel{1e-6 * static_cast<double>(1 + rng() % 5),
                         1e-11 * static_cast<double>(rng() % 5), "measured",
                         1e-4 * static_cast<double>(1 + rng() % 5), "seconds"};
  }
  o.microbatch_multiple = 1 + static_cast<int>(rng() % 2);
  if (rng() % 4 == 0) o.num_microbatches = o.microbatch_multiple * (1 + static_cast<int>(rng() % 3));
  o.scheduler = rng() % 3 == 0 ? ScheduleOptions::Scheduler::kSequential
                               : ScheduleOptions::Scheduler::kBalanced;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  return o;
}

TEST(ScheduleWithFiguresTest, EqualsScheduleThenComputePlanFiguresOnRandomSteps) {
  std::mt19937_64 rng(33);
  int scheduled = 0;
  int timed = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng, trial % 2);  // dense or sparse ids, no duplicates
    ScheduleOptions o = RandomOptions(rng);
    if (o.cost.measured()) {
      // The profile's step-time model: its coefficients, a constant per microbatch, and the
      // exchange of llama2-7b's K/V or none.
      StepTimeCoefficients k;
      k.seconds_per_token = o.cost.a;
      k.seconds_per_token_sq = o.cost.b;
      k.seconds_per_sequence = o.cost.c;
      k.seconds_per_microbatch = 1e-3 * static_cast<double>(rng() % 3);
      if (rng() % 2) {
        k.kv_bytes_per_token = KvBytesPerToken(kLlama2_7B);
        k.link_bytes_per_second = 25e9;
      }
      o.step_time = StepTimeModel::Create(k).value();
    } else if (o.cost.name != "tokens" && rng() % 2 == 0) {
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
    testing_util::ExpectSameFigures(fast->figures, *reference);
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

// The consuming form gives what the span form gives, and leaves the samples' vector empty.
TEST(ScheduleWithFiguresTest, ConsumingFormEqualsSpanForm) {
  std::mt19937_64 rng(34);
  int compared = 0;
  for (int trial = 0; trial < 60; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng, trial % 2);
    const ScheduleOptions o = RandomOptions(rng);
    Result<ScheduledPlan> by_span = ScheduleWithFigures(samples, o);
    std::vector<SampleLength> owned = samples;
    Result<ScheduledPlan> consumed = ScheduleWithFigures(std::move(owned), o);
    ASSERT_EQ(by_span.ok(), consumed.ok());
    if (!by_span.ok()) {
      EXPECT_EQ(by_span.status(), consumed.status());
      continue;
    }
    ++compared;
    EXPECT_TRUE(owned.empty());
    EXPECT_EQ(consumed->plan.sample_ids, by_span->plan.sample_ids);
    EXPECT_EQ(consumed->plan.offsets, by_span->plan.offsets);
    EXPECT_EQ(consumed->plan.skipped, by_span->plan.skipped);
    testing_util::ExpectSameFigures(consumed->figures, by_span->figures);
  }
  EXPECT_GT(compared, 30);
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
    testing_util::ExpectSameFigures(f_bound, f_exact);
  }
  EXPECT_GT(compared, 150);
  EXPECT_GT(bounded, 150);
  EXPECT_GT(left_out, 100);  // the bound did leave it out on most steps
}

// Step A of the balanced scheduler places a long run of equal P by merging the heap's replicas,
// sorted, with a FIFO of those that took a sample (PlaceRunMerged); the plain form is the heap,
// sample by sample. The same plan on random steps built for it: a few distinct lengths in runs
// up to several times DP (many ties of equal loads, broken by index), budgets and fixed M that
// park replicas mid-run (M above 32 too, where bins are kept in sets), and, on most trials,
// costs set by hand so that rounding makes fl(a + c) == fl(b + c) for loads a < b (loads near
// 2^52 * s, whose last bit is s, and run costs c that are odd multiples of s/2).
TEST(BalancedLptRunsTest, MergedRunsEqualHeapOnRandomSteps) {
  std::mt19937_64 rng(41);
  int compared = 0;
  int merged = 0;
  int fallback = 0;
  for (int trial = 0; trial < 400; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    ScheduleOptions o;
    o.dp_size = std::vector<int>{1, 2, 3, 5, 8, 13, 64, 130}[rng() % 8];
    const int cp = 1 + static_cast<int>(rng() % 2);
    o.parallel = ParallelLayout::Create(cp, 1, false).value();
    o.cost = ParseCostSpec(rng() % 2 ? "llama2-7b" : "tokens").value();
    o.scheduler = ScheduleOptions::Scheduler::kBalanced;
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    // A few distinct lengths, each in a run of up to 4 DP + 60 samples, and a few singles.
    std::vector<SampleLength> samples;
    const int max_length = std::vector<int>{64, 1000, 8000}[rng() % 3];
    const int distinct = 1 + static_cast<int>(rng() % 5);
    for (int v = 0; v < distinct; ++v) {
      const int64_t length = 1 + static_cast<int64_t>(rng() % max_length);
      const int run = 1 + static_cast<int>(rng() % (4 * o.dp_size + 60));
      for (int j = 0; j < run; ++j) samples.push_back({0, length, 0});
    }
    for (int j = static_cast<int>(rng() % 6); j > 0; --j) {
      samples.push_back({0, 1 + static_cast<int64_t>(rng() % max_length), 0});
    }
    std::shuffle(samples.begin(), samples.end(), rng);
    for (size_t j = 0; j < samples.size(); ++j) samples[j].id = static_cast<int64_t>(j) * 3 + 1;
    // Budgets from the longest sample to a few times it, now and then at a fixed M (parked
    // replicas, runs that find no room, M > 32).
    const int64_t longest = std::max_element(samples.begin(), samples.end(),
                                             [](const SampleLength& a, const SampleLength& b) {
                                               return a.length < b.length;
                                             })->length;
    o.max_tokens_per_rank = (longest + 2 * cp) * (1 + static_cast<int64_t>(rng() % 4)) / cp + 1;
    if (rng() % 3 == 0) {
      o.num_microbatches = std::vector<int>{1, 2, 3, 40}[rng() % 4];
    }
    auto step = internal::PrepareStep(samples, o);
    ASSERT_TRUE(step.ok());
    if (!internal::CheckEnoughSamples(*step, o).ok()) continue;
    if (rng() % 4 != 0) {
      // Costs by hand, a function of P: the longest P near 2^52 * s, the others
      // mostly odd multiples of s/2 (a tie to even in the sum), some multiples of s/4.
      std::vector<int64_t> ps(step->padded.begin(), step->padded.end());
      std::sort(ps.begin(), ps.end(), std::greater<>());
      ps.erase(std::unique(ps.begin(), ps.end()), ps.end());
      const double scale = std::ldexp(1.0, static_cast<int>(rng() % 3));
      // Enough big samples for every replica to take one (else LPT never brings the replicas
      // with a big load back into a run of small costs), now and then a class more.
      size_t big = 0;
      for (int64_t count = 0; big < ps.size() && count < o.dp_size; ++big) {
        count += std::count(step->padded.begin(), step->padded.end(), ps[big]);
      }
      big = std::min<size_t>(ps.size() - 1, big + rng() % 2);
      std::map<int64_t, double> cost_of;
      for (size_t v = 0; v < ps.size(); ++v) {
        cost_of[ps[v]] = v < big ? scale * (std::ldexp(1.0, 52) + static_cast<double>(rng() % 6))
                  : rng() % 4 != 0 ? scale * (0.5 + static_cast<double>(rng() % 4))
                                   : scale * 0.25 * static_cast<double>(1 + rng() % 12);
      }
      step->total_cost = 0;
      step->max_cost = 0;
      for (size_t i = 0; i < step->size(); ++i) {
        step->cost[i] = cost_of[step->padded[i]];
        step->total_cost += step->cost[i];
        step->max_cost = std::max(step->max_cost, step->cost[i]);
      }
    }
    ScheduleOptions::Scheduler who_merged{}, who_heap{};
    Result<internal::Assignment> by_runs = internal::ScheduleBalanced(
        *step, o, &who_merged, nullptr,
        internal::BalancedTuning{.lpt_runs_merged = &merged, .lpt_runs_fallback = &fallback});
    Result<internal::Assignment> by_heap = internal::ScheduleBalanced(
        *step, o, &who_heap, nullptr, internal::BalancedTuning{.plain_lpt = true});
    ASSERT_EQ(by_runs.ok(), by_heap.ok());
    if (!by_runs.ok()) {
      EXPECT_EQ(by_runs.status(), by_heap.status());
      continue;
    }
    ++compared;
    EXPECT_EQ(who_merged, who_heap);
    EXPECT_EQ(by_runs->num_microbatches, by_heap->num_microbatches);
    EXPECT_EQ(by_runs->offsets, by_heap->offsets);
    EXPECT_EQ(by_runs->items, by_heap->items);
  }
  EXPECT_GT(compared, 250);
  EXPECT_GT(merged, 500);   // most runs long enough went through the merge
  EXPECT_GT(fallback, 20);  // and rounding sent some of them back to the heap
}

}  // namespace
}  // namespace thdpack
