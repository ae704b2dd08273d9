// Tests of the scheduling contract shared by both schedulers: the padding rule, option and
// input errors, the oversize policy, the invariants on random steps, determinism, figures.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "schedule/scheduler_test_util.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

using testing_util::RandomLengths;
using testing_util::WithIds;
using Sched = ScheduleOptions::Scheduler;
using Oversize = ScheduleOptions::OversizePolicy;

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::vector<SampleLength> Simple(const std::vector<int64_t>& lengths, int64_t first_id = 100) {
  std::vector<SampleLength> out;
  for (size_t i = 0; i < lengths.size(); ++i) {
    out.push_back({first_id + static_cast<int64_t>(i), lengths[i], lengths[i] - 1});
  }
  return out;
}

// The layout of these tests, known to be valid.
ParallelLayout Parallel(int cp, int tp = 1, bool sp = false, int64_t extra_alignment = 1) {
  return ParallelLayout::Create(cp, tp, sp, extra_alignment).value();
}

TEST(SchedulePaddingTest, SequenceAlignmentAndMicrobatchTokens) {
  EXPECT_EQ(Parallel(1).sequence_alignment(), 1);
  EXPECT_EQ(Parallel(4).sequence_alignment(), 8);
  EXPECT_EQ(Parallel(4, 1, false, 3).sequence_alignment(), 24);
  EXPECT_EQ(Parallel(2).PaddedLength(7), 8);
  EXPECT_EQ(Parallel(2).PaddedLength(8), 8);
  EXPECT_EQ(Parallel(1).PaddedLength(5), 5);
  // No SP: the sum stands.
  EXPECT_EQ(Parallel(2, 4, false).MicrobatchTokens(20), 20);
  // SP, CP=2, TP=4: T multiple of lcm(4, 8) = 8.
  EXPECT_EQ(Parallel(2, 4, true).MicrobatchTokens(20), 24);
  // SP, CP=1, TP=3: multiple of 3.
  EXPECT_EQ(Parallel(1, 3, true).MicrobatchTokens(10), 12);
  // SP, CP=4 (alignment 8), TP=6: lcm(8, 24) = 24.
  EXPECT_EQ(Parallel(4, 6, true).MicrobatchTokens(40), 48);
  // SP with extra alignment 16, CP=2 (alignment 64), TP=2: lcm(64, 4) = 64.
  EXPECT_EQ(Parallel(2, 2, true, 16).MicrobatchTokens(128), 128);
}

TEST(ScheduleOptionsTest, BadOptionsAreNamed) {
  const auto samples = Simple({10, 20, 30, 40});
  ScheduleOptions o;
  o.max_tokens_per_rank = 0;
  auto r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "max_tokens_per_rank")) << r.status().ToString();

  o.max_tokens_per_rank = 100;
  o.dp_size = 0;
  r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "dp_size"));

  o.dp_size = 1;
  o.microbatch_multiple = 2;
  o.num_microbatches = 3;
  r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "num_microbatches = 3"));

  o.num_microbatches = 0;
  o.cost.a = 0;
  o.cost.b = 0;
  r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "cost model"));

  o = ScheduleOptions();
  o.parallel = Parallel(8);
  o.max_tokens_per_rank = int64_t{1} << 30;
  r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "int32"));
}

TEST(ScheduleInputTest, BadSamplesAreNamed) {
  ScheduleOptions o;
  o.max_tokens_per_rank = 100;
  auto samples = Simple({10, 20, 30});
  samples[2].id = samples[0].id;
  auto r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "sample id 100 appears twice")) << r.status().ToString();

  samples = Simple({10, 0, 30});
  r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "sample id 101")) << r.status().ToString();
  EXPECT_TRUE(Contains(r.status().message(), "length 0"));

  samples = Simple({10, 20, 30});
  samples[1].n_targets = 21;
  r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "n_targets = 21"));
}

TEST(ScheduleOversizeTest, ErrorNamesTheSampleItsLengthAndTheBudget) {
  for (Sched s : {Sched::kSequential, Sched::kBalanced}) {
    ScheduleOptions o;
    o.scheduler = s;
    o.parallel = Parallel(2);
    o.max_tokens_per_rank = 50;  // budget 100
    auto samples = Simple({10, 20, 101, 30});
    auto r = Schedule(samples, o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string& m = r.status().message();
    EXPECT_TRUE(Contains(m, "sample id 102")) << m;
    EXPECT_TRUE(Contains(m, "length 101")) << m;
    EXPECT_TRUE(Contains(m, "padded 104")) << m;
    EXPECT_TRUE(Contains(m, "budget 100")) << m;
  }
}

TEST(ScheduleOversizeTest, SpTailMakesASampleOversize) {
  // Budget 100, SP with CP=1, TP=8: a microbatch's T is a multiple of 8, so at most 96; a
  // sample of 98 fits the budget alone but not after the SP tail.
  ScheduleOptions o;
  o.parallel = Parallel(1, 8, true);
  o.max_tokens_per_rank = 100;
  auto r = Schedule(Simple({98, 10}), o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "sample id 100")) << r.status().ToString();
  EXPECT_TRUE(Contains(r.status().message(), "104 with the SP tail")) << r.status().ToString();
}

TEST(ScheduleOversizeTest, SkipLeavesOutAndReportsIds) {
  for (Sched s : {Sched::kSequential, Sched::kBalanced}) {
    ScheduleOptions o;
    o.scheduler = s;
    o.dp_size = 2;
    o.max_tokens_per_rank = 100;
    o.oversize = Oversize::kSkip;
    const auto samples = Simple({10, 200, 20, 30, 101, 40});
    auto r = Schedule(samples, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->skipped, (std::vector<int64_t>{101, 104}));
    ASSERT_TRUE(ValidatePlan(samples, o, *r).ok()) << ValidatePlan(samples, o, *r).ToString();
    auto f = ComputePlanFigures(samples, o, *r);
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->n_skipped, 2);
    EXPECT_EQ(f->n_samples, 4);
    EXPECT_EQ(f->real_tokens, 100);
  }
}

TEST(ScheduleTooFewTest, FewerSamplesThanDpTimesKIsAnError) {
  for (Sched s : {Sched::kSequential, Sched::kBalanced}) {
    ScheduleOptions o;
    o.scheduler = s;
    o.dp_size = 4;
    o.microbatch_multiple = 2;
    o.max_tokens_per_rank = 1000;
    auto r = Schedule(Simple({10, 20, 30, 40, 50, 60, 70}), o);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status().message(), "too few samples: 7")) << r.status().ToString();
    EXPECT_TRUE(Contains(r.status().message(), "= 8")) << r.status().ToString();
    // Skipped samples do not count.
    o.oversize = Oversize::kSkip;
    r = Schedule(Simple({10, 20, 30, 40, 50, 60, 70, 5000}), o);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status().message(), "after skipping 1 oversize")) << r.status().ToString();
    o.microbatch_multiple = 1;
    o.num_microbatches = 3;
    r = Schedule(Simple({10, 20, 30, 40, 50, 60, 70, 80}), o);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status().message(), "too few samples")) << r.status().ToString();
  }
}

// Random steps and topologies: every invariant holds for both schedulers, free and fixed M.
TEST(PlanInvariantsTest, RandomStepsBothSchedulers) {
  std::mt19937_64 rng(2024);
  int checked = 0;
  for (int trial = 0; trial < 150; ++trial) {
    ScheduleOptions o;
    o.dp_size = 1 + static_cast<int>(rng() % 8);
    const int cp = std::vector<int>{1, 1, 2, 4}[rng() % 4];
    const int tp = std::vector<int>{1, 2, 3, 8}[rng() % 4];
    const bool sp = rng() % 2;
    o.parallel = Parallel(cp, tp, sp, std::vector<int64_t>{1, 1, 8}[rng() % 3]);
    o.max_tokens_per_rank = 64 + static_cast<int64_t>(rng() % 2000);
    o.microbatch_multiple = 1 + static_cast<int>(rng() % 3);
    o.oversize = Oversize::kSkip;
    o.cost.b = (rng() % 2) ? 0.01 : 0.0;
    const size_t n = 1 + rng() % 300;
    const auto samples = WithIds(RandomLengths(rng, n, 3 * MicrobatchBudget(o) / 2), rng());
    for (Sched s : {Sched::kSequential, Sched::kBalanced}) {
      for (int fixed : {0, 1}) {
        ScheduleOptions so = o;
        so.scheduler = s;
        if (fixed) so.num_microbatches = so.microbatch_multiple * (1 + static_cast<int>(rng() % 4));
        auto plan = Schedule(samples, so);
        if (!plan.ok()) {
          // Only the documented failures: too few samples, or a fixed M that does not fit.
          const std::string& m = plan.status().message();
          EXPECT_TRUE(Contains(m, "too few samples") || (fixed && Contains(m, "do not fit")) ||
                      (fixed && Contains(m, "needs")))
              << m;
          continue;
        }
        const Status v = ValidatePlan(samples, so, *plan);
        ASSERT_TRUE(v.ok()) << v.ToString() << " trial " << trial;
        auto f = ComputePlanFigures(samples, so, *plan);
        ASSERT_TRUE(f.ok()) << f.status().ToString();
        EXPECT_GE(f->imbalance, 1.0 - 1e-9);
        EXPECT_LE(f->fill, 1.0 + 1e-12);
        for (const auto& r : f->replicas) {
          for (const auto& mb : r.microbatches) EXPECT_LE(mb.padded_tokens, MicrobatchBudget(so));
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 300);
}

// Budget with SP tails and CP padding on a case that would overflow if the tail were ignored:
// CP=1, TP=8, SP, budget 100 (so T <= 96): 50 + 47 = 97 fits 100 but T would be 104.
TEST(PlanInvariantsTest, SpTailKeepsTheBudget) {
  for (Sched s : {Sched::kSequential, Sched::kBalanced}) {
    ScheduleOptions o;
    o.scheduler = s;
    o.parallel = Parallel(1, 8, true);
    o.max_tokens_per_rank = 100;
    const auto samples = Simple({50, 47});
    auto plan = Schedule(samples, o);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(plan->num_microbatches, 2);
    auto f = ComputePlanFigures(samples, o, *plan);
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->replicas[0].microbatches[0].padded_tokens, 56);
    EXPECT_EQ(f->replicas[0].microbatches[1].padded_tokens, 48);
  }
  // CP=2, TP=4 (quantum 8), budget 2*51 = 102 -> T <= 96; padded lengths are multiples of 4.
  ScheduleOptions o;
  o.parallel = Parallel(2, 4, true);
  o.max_tokens_per_rank = 51;
  o.dp_size = 2;
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const auto samples = WithIds(RandomLengths(rng, 40, 96), rng());
    for (Sched s : {Sched::kSequential, Sched::kBalanced}) {
      o.scheduler = s;
      auto plan = Schedule(samples, o);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      auto f = ComputePlanFigures(samples, o, *plan);
      ASSERT_TRUE(f.ok());
      for (const auto& r : f->replicas) {
        for (const auto& mb : r.microbatches) {
          EXPECT_LE(mb.padded_tokens, 96);
          EXPECT_EQ(mb.padded_tokens % 8, 0);
        }
      }
    }
  }
}

TEST(PlanDeterminismTest, SameBytesEveryTimeAndFromConcurrentCallers) {
  std::mt19937_64 rng(77);
  const auto samples = WithIds(RandomLengths(rng, 3000, 20000), 9);
  ScheduleOptions o;
  o.dp_size = 16;
  o.parallel = Parallel(2);
  o.max_tokens_per_rank = 16384;
  o.cost.b = 0.001;
  o.oversize = Oversize::kSkip;
  for (Sched s : {Sched::kSequential, Sched::kBalanced}) {
    o.scheduler = s;
    auto first = Schedule(samples, o);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    std::vector<Result<Plan>> results(4, Status::Internal("not run"));
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] { results[t] = Schedule(samples, o); });
    }
    for (auto& t : threads) t.join();
    for (const auto& r : results) {
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(r->num_microbatches, first->num_microbatches);
      EXPECT_EQ(r->sample_ids, first->sample_ids);
      EXPECT_EQ(r->offsets, first->offsets);
      EXPECT_EQ(r->skipped, first->skipped);
    }
  }
}

// Figures of a plan worked by hand. DP=2, CP=2 (alignment 4), budget 2*8 = 16, cost a=1, b=1.
//   lengths 5,3,6,2 -> P 8,4,8,4; per-sequence cost/CP: (8+64)/2=36, (4+16)/2=10, 36, 10.
TEST(PlanFiguresTest, SmallPlanByHand) {
  const auto samples = Simple({5, 3, 6, 2});
  ScheduleOptions o;
  o.dp_size = 2;
  o.parallel = Parallel(2);
  o.max_tokens_per_rank = 8;
  o.cost.a = 1;
  o.cost.b = 1;
  Plan plan;
  plan.dp_size = 2;
  plan.num_microbatches = 1;
  plan.sample_ids = {100, 101, 102, 103};  // replica 0: P 8+4, replica 1: P 8+4
  plan.offsets = {0, 2, 4};
  ASSERT_TRUE(ValidatePlan(samples, o, plan).ok());
  auto f = ComputePlanFigures(samples, o, plan);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->real_tokens, 16);
  EXPECT_EQ(f->padded_tokens, 24);
  EXPECT_EQ(f->sum_sq, 64 + 16 + 64 + 16);
  EXPECT_EQ(f->n_loss_tokens, 4 + 2 + 5 + 1);
  EXPECT_DOUBLE_EQ(f->replicas[0].cost, 46);
  EXPECT_DOUBLE_EQ(f->max_replica_cost, 46);
  EXPECT_DOUBLE_EQ(f->lower_bound, 46);
  EXPECT_DOUBLE_EQ(f->imbalance, 1.0);
  EXPECT_DOUBLE_EQ(f->pad_fraction, 1.0 - 16.0 / 24.0);
  EXPECT_DOUBLE_EQ(f->fill, 24.0 / (1 * 2 * 16));

  // The uneven split: replica 0 gets both long ones (P 8 + 8), replica 1 both short ones.
  plan.sample_ids = {100, 102, 101, 103};
  f = ComputePlanFigures(samples, o, plan);
  ASSERT_TRUE(f.ok());
  EXPECT_DOUBLE_EQ(f->max_replica_cost, 72);
  EXPECT_DOUBLE_EQ(f->imbalance, 72.0 / 46.0);
}

TEST(PlanValidateTest, RejectsBrokenPlans) {
  const auto samples = Simple({5, 3, 6, 2});
  ScheduleOptions o;
  o.dp_size = 2;
  o.max_tokens_per_rank = 10;
  Plan plan;
  plan.dp_size = 2;
  plan.num_microbatches = 1;
  plan.sample_ids = {100, 101, 102, 103};
  plan.offsets = {0, 2, 4};
  ASSERT_TRUE(ValidatePlan(samples, o, plan).ok());
  Plan p = plan;
  p.sample_ids = {100, 101, 102, 102};
  EXPECT_TRUE(Contains(ValidatePlan(samples, o, p).message(), "appears twice"));
  p = plan;
  p.sample_ids = {100, 101, 102};
  p.offsets = {0, 2, 3};
  EXPECT_TRUE(Contains(ValidatePlan(samples, o, p).message(), "103 is neither"));
  p = plan;
  p.offsets = {0, 0, 4};
  EXPECT_TRUE(Contains(ValidatePlan(samples, o, p).message(), "empty"));
  p = plan;
  p.sample_ids = {100, 102, 101, 103};  // 5 + 6 = 11 > 10
  EXPECT_TRUE(Contains(ValidatePlan(samples, o, p).message(), "over the budget"));
  p = plan;
  o.microbatch_multiple = 2;
  EXPECT_TRUE(Contains(ValidatePlan(samples, o, p).message(), "multiple of k"));
}

}  // namespace
}  // namespace thdpack
