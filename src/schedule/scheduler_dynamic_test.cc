// The dynamic scheduler: invariants on random steps (domains that are not powers of two, and a
// domain of one rank), the step time against the static plans it must not lose to, hand-made
// cases and the errors.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "schedule/scheduler_test_util.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

using testing_util::RandomLengths;
using testing_util::WithIds;

// The small model of cost_test.cc (l=2, h=8, n_h=2, n_kv=1, f=16, V=10) on R = 1000 FLOP/s,
// B = 10 bytes/s: exchange-bound from c = 3 on short sequences, so the group size matters.
StepTimeModel SmallModel(const char* hw = "1000,10") {
  return *StepTimeModel::Create(ModelDims{2, 8, 2, 1, 16, 10}, *ParseHardwareSpec(hw));
}

ScheduleOptions Options(int dp, int cp, int64_t max_tokens, int tp = 1, bool sp = false,
                        int64_t rank_multiple = 1) {
  ScheduleOptions o;
  o.dp_size = dp;
  o.parallel = *ParallelLayout::Create(cp, tp, sp, 1, rank_multiple);
  o.max_tokens_per_rank = max_tokens;
  o.cost = *CostModelFromDims(ModelDims{2, 8, 2, 1, 16, 10});
  o.scheduler = ScheduleOptions::Scheduler::kDynamic;
  o.step_time = SmallModel();
  return o;
}

bool SamePlan(const DynamicPlan& a, const DynamicPlan& b) {
  if (a.num_microbatches != b.num_microbatches || a.skipped != b.skipped ||
      a.step_time != b.step_time || a.method != b.method) {
    return false;
  }
  for (size_t m = 0; m < a.microbatches.size(); ++m) {
    if (a.microbatches[m].size() != b.microbatches[m].size()) return false;
    for (size_t g = 0; g < a.microbatches[m].size(); ++g) {
      const CpGroup& x = a.microbatches[m][g];
      const CpGroup& y = b.microbatches[m][g];
      if (x.first_rank != y.first_rank || x.num_ranks != y.num_ranks ||
          x.sample_ids != y.sample_ids) {
        return false;
      }
    }
  }
  return true;
}

// Random steps over many (DP, CP) domains, budgets, SP and rank-multiple tails, k and fixed M,
// both size sets:
// every invariant, the recorded step time equal to DynamicPlanStepTime, determinism, and a
// step time no larger than the balanced plan at the step's own static layout.
TEST(DynamicSchedulerTest, InvariantsOnRandomSteps) {
  std::mt19937_64 rng(20261123);
  const int topologies[][2] = {{1, 1}, {1, 2}, {3, 1}, {1, 3}, {5, 1}, {2, 3}, {4, 2}, {3, 4}, {8, 1}};
  int checked = 0;
  for (int trial = 0; trial < 180; ++trial) {
    const auto& topo = topologies[trial % 9];
    const int dp = topo[0], cp = topo[1];
    const int domain = dp * cp;
    const int64_t max_tokens = std::uniform_int_distribution<int64_t>(64, 1024)(rng);
    const bool sp = trial % 4 == 3;
    const int tp = sp ? 2 : 1;
    const int64_t rank_multiple = trial % 5 == 4 ? 16 : 1;
    ScheduleOptions o = Options(dp, cp, max_tokens, tp, sp, rank_multiple);
    o.cp_sizes = trial % 3 == 1 ? ScheduleOptions::CpSizes::kPow2 : ScheduleOptions::CpSizes::kAny;
    o.microbatch_multiple = trial % 5 == 2 ? 2 : 1;
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    if (trial % 7 == 6) o.step_time = SmallModel("1000,1e6");  // compute-bound
    const size_t n = std::uniform_int_distribution<size_t>(1, 60)(rng);
    const std::vector<SampleLength> samples =
        WithIds(RandomLengths(rng, n, max_tokens * domain + max_tokens), rng());
    SCOPED_TRACE("trial " + std::to_string(trial) + " DP=" + std::to_string(dp) +
                 " CP=" + std::to_string(cp) + " max_tokens=" + std::to_string(max_tokens));
    Result<DynamicPlan> plan = ScheduleDynamic(samples, o);
    if (!plan.ok()) {
      // Only when every sample is oversize.
      EXPECT_NE(plan.status().message().find("all oversize"), std::string::npos)
          << plan.status().ToString();
      continue;
    }
    ASSERT_TRUE(ValidateDynamicPlan(samples, o, *plan).ok())
        << ValidateDynamicPlan(samples, o, *plan).ToString();
    EXPECT_EQ(plan->domain_size, domain);
    Result<double> t = DynamicPlanStepTime(samples, o, *plan);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(*t, plan->step_time);
    Result<DynamicPlan> again = ScheduleDynamic(samples, o);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(SamePlan(*plan, *again));
    // The static plan at the step's own layout, where it plans the same samples.
    ScheduleOptions s = o;
    s.scheduler = ScheduleOptions::Scheduler::kBalanced;
    s.oversize = ScheduleOptions::OversizePolicy::kError;
    std::vector<SampleLength> kept;
    for (const SampleLength& x : samples) {
      if (std::find(plan->skipped.begin(), plan->skipped.end(), x.id) == plan->skipped.end()) {
        kept.push_back(x);
      }
    }
    const bool pow2_ok = o.cp_sizes == ScheduleOptions::CpSizes::kAny || (cp & (cp - 1)) == 0;
    Result<Plan> fixed = Schedule(kept, s);
    if (fixed.ok() && pow2_ok) {
      Result<double> static_time = PlanStepTime(kept, s, *fixed);
      ASSERT_TRUE(static_time.ok()) << static_time.status().ToString();
      EXPECT_LE(plan->step_time, *static_time * (1 + 1e-12));
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
}

// The fast list scheduling (sliding-window maxima, window searches skipped when they cannot
// win) against its plain reference (every window in full, nothing skipped): the same plans
// on fresh random steps.
TEST(DynamicSchedulerTest, FastPassEqualsPlainReference) {
  std::mt19937_64 rng(99);
  const int topologies[][2] = {{1, 1}, {3, 1}, {2, 3}, {4, 4}, {7, 1}, {16, 1}};
  for (int trial = 0; trial < 60; ++trial) {
    const auto& topo = topologies[trial % 6];
    const int64_t max_tokens = std::uniform_int_distribution<int64_t>(64, 512)(rng);
    ScheduleOptions o = Options(topo[0], topo[1], max_tokens);
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    if (trial % 3 == 0) o.step_time = SmallModel("1000,1e5");
    const auto samples = WithIds(
        RandomLengths(rng, std::uniform_int_distribution<size_t>(1, 120)(rng),
                      max_tokens * topo[0] * topo[1]),
        rng());
    Result<DynamicPlan> fast = internal::ScheduleDynamicImpl(samples, o, false);
    Result<DynamicPlan> plain = internal::ScheduleDynamicImpl(samples, o, true);
    ASSERT_EQ(fast.ok(), plain.ok());
    if (!fast.ok()) continue;
    EXPECT_TRUE(SamePlan(*fast, *plain)) << "trial " << trial;
  }
}

// D = 4, budget 100 tokens a rank, no padding beyond 2c: one sequence of 390 tokens needs all
// four ranks (padded 392 <= 400); the short ones may go anywhere. Every plan holds it in one
// group of 4.
TEST(DynamicSchedulerTest, LongSequenceTakesAGroupLargeEnough) {
  ScheduleOptions o = Options(2, 2, 100);
  std::vector<SampleLength> samples = {{10, 390, 389}, {11, 50, 49}, {12, 60, 59},
                                       {13, 30, 29},   {14, 90, 89}};
  Result<DynamicPlan> plan = ScheduleDynamic(samples, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_TRUE(ValidateDynamicPlan(samples, o, *plan).ok());
  int found = 0;
  for (const auto& groups : plan->microbatches) {
    for (const CpGroup& g : groups) {
      for (int64_t id : g.sample_ids) {
        if (id == 10) {
          EXPECT_EQ(g.num_ranks, 4);
          EXPECT_EQ(g.first_rank, 0);
          ++found;
        }
      }
    }
  }
  EXPECT_EQ(found, 1);
}

// One rank: every group is that rank; the plan is the samples in microbatches of the budget,
// and its time is the sum of t(P, 1) (no exchange): 7392*P + 96*P^2 FLOPs at 1000 FLOP/s.
TEST(DynamicSchedulerTest, DomainOfOneRank) {
  ScheduleOptions o = Options(1, 1, 100);
  std::vector<SampleLength> samples = {{0, 60, 59}, {1, 50, 49}, {2, 40, 39}};
  Result<DynamicPlan> plan = ScheduleDynamic(samples, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_TRUE(ValidateDynamicPlan(samples, o, *plan).ok());
  EXPECT_EQ(plan->num_microbatches, 2);  // 60 + 40 and 50 (or 60 and 50 + 40)
  double expected = 0;
  for (int64_t p : {60, 50, 40}) expected += (7392.0 * p + 96.0 * p * p) / 1000.0;
  EXPECT_NEAR(plan->step_time, expected, 1e-9 * expected);
  for (const auto& groups : plan->microbatches) {
    ASSERT_EQ(groups.size(), 1u);
    EXPECT_EQ(groups[0].num_ranks, 1);
  }
}

// pow2 sizes only: a domain of 6 uses groups of 1, 2 and 4.
TEST(DynamicSchedulerTest, Pow2SizesOnly) {
  std::mt19937_64 rng(7);
  ScheduleOptions o = Options(3, 2, 128);
  o.cp_sizes = ScheduleOptions::CpSizes::kPow2;
  const auto samples = WithIds(RandomLengths(rng, 40, 500), 3);
  Result<DynamicPlan> plan = ScheduleDynamic(samples, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  for (const auto& groups : plan->microbatches) {
    for (const CpGroup& g : groups) EXPECT_EQ(g.num_ranks & (g.num_ranks - 1), 0);
  }
  ASSERT_TRUE(ValidateDynamicPlan(samples, o, *plan).ok());
}

// A static plan's step time by hand: DP = 2, CP = 1, compute-bound, replica sums.
TEST(DynamicSchedulerTest, PlanStepTimeOfAStaticPlan) {
  ScheduleOptions o = Options(2, 1, 100);
  o.scheduler = ScheduleOptions::Scheduler::kBalanced;
  std::vector<SampleLength> samples = {{0, 60, 59}, {1, 50, 49}, {2, 40, 39}, {3, 10, 9}};
  Plan plan;
  plan.num_microbatches = 1;
  plan.dp_size = 2;
  plan.sample_ids = {0, 3, 1, 2};
  plan.offsets = {0, 2, 4};
  auto f = [](double p) { return (7392.0 * p + 96.0 * p * p) / 1000.0; };
  Result<double> t = PlanStepTime(samples, o, plan);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_DOUBLE_EQ(*t, std::max(f(60) + f(10), f(50) + f(40)));
  // CP = 2 as one replica: P = roundup(L, 4), t = max(F/(2R), X) with X = 3/2 * P * 32 / 10.
  ScheduleOptions o2 = Options(1, 2, 100);
  plan.dp_size = 1;
  plan.offsets = {0, 4};
  double expected = 0;
  for (double p : {60.0, 12.0, 52.0, 40.0}) expected += std::max(f(p) / 2, 1.5 * p * 32 / 10);
  t = PlanStepTime(samples, o2, plan);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_NEAR(*t, expected, 1e-12 * expected);
}

TEST(DynamicSchedulerTest, Errors) {
  ScheduleOptions o = Options(2, 1, 100);
  const std::vector<SampleLength> samples = {{5, 150, 149}, {6, 250, 249}};
  // Oversize: 250 > 2 ranks x 100.
  Result<DynamicPlan> plan = ScheduleDynamic(samples, o);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("sample id 6"), std::string::npos);
  EXPECT_NE(plan.status().message().find("200"), std::string::npos);
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  plan = ScheduleDynamic(samples, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->skipped, std::vector<int64_t>{6});
  // No model.
  ScheduleOptions no_model = o;
  no_model.step_time.reset();
  plan = ScheduleDynamic(samples, no_model);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("model dimensions"), std::string::npos);
  // Schedule points to ScheduleDynamic.
  Result<Plan> p = Schedule(samples, o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("ScheduleDynamic"), std::string::npos);
  // Fixed M too small: 150 tokens need both ranks, 100 and 90 one each -> at least 2.
  ScheduleOptions fixed = Options(2, 1, 100);
  fixed.num_microbatches = 1;
  const std::vector<SampleLength> three = {{1, 150, 1}, {2, 100, 1}, {3, 90, 1}};
  plan = ScheduleDynamic(three, fixed);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("fixed M = 1"), std::string::npos);
}

TEST(DynamicSchedulerTest, ValidateRejectsBrokenPlans) {
  ScheduleOptions o = Options(2, 2, 100);
  const std::vector<SampleLength> samples = {{1, 300, 1}, {2, 80, 1}, {3, 70, 1}};
  Result<DynamicPlan> plan = ScheduleDynamic(samples, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  auto expect_bad = [&](DynamicPlan p, const std::string& what) {
    Status s = ValidateDynamicPlan(samples, o, p);
    ASSERT_FALSE(s.ok()) << what;
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  };
  DynamicPlan p;
  p.domain_size = 4;
  p.num_microbatches = 1;
  p.microbatches = {{CpGroup{0, 4, {1}}, CpGroup{3, 1, {2, 3}}}};
  expect_bad(p, "without overlap");
  p.microbatches = {{CpGroup{0, 3, {1}}, CpGroup{3, 1, {2, 3}}}};
  expect_bad(p, "over its budget");  // 80 + 70 = 150 on one rank of 100
  p.microbatches = {{CpGroup{0, 4, {1, 2}}}};
  expect_bad(p, "neither scheduled nor skipped");
  p.microbatches = {{CpGroup{0, 4, {1, 2}}, CpGroup{4, 1, {3}}}};
  expect_bad(p, "without overlap");
  p.microbatches = {{CpGroup{0, 4, {1}}}, {CpGroup{0, 2, {2, 2}}}};
  p.num_microbatches = 2;
  expect_bad(p, "appears twice");
  p.microbatches = {{CpGroup{0, 4, {1}}}, {CpGroup{0, 2, {2}}, CpGroup{2, 1, {}}}};
  expect_bad(p, "is empty");
}

}  // namespace
}  // namespace thdpack
