// A measured profile through the schedulers: written and read back it gives the same plans as
// the fitted coefficients in memory; its per-sequence constant moves plans; the fast paths
// (ScheduleWithFigures' figures and step time) equal their references with it.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "thdpack/profile.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

std::vector<TimedMicrobatch> Timings(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> jitter(-0.005, 0.005);
  std::vector<TimedMicrobatch> out;
  for (int64_t t : {1024, 2048, 4096, 8192}) {
    for (std::vector<int64_t> p : {std::vector<int64_t>(static_cast<size_t>(t / 128), 128),
                                   std::vector<int64_t>{t}, std::vector<int64_t>{t / 2, t / 4, t / 4},
                                   std::vector<int64_t>{t / 8, t / 8, t / 4, t / 2}}) {
      ProfileForm f;
      f.a = 3e-6;
      f.b = 2e-10;
      f.c = 4e-4;
      f.m = 1e-3;
      out.push_back(TimedMicrobatch{f.Predict(p) * (1 + jitter(rng)), p, out.size() % 4 == 3});
    }
  }
  return out;
}

std::vector<SampleLength> Step(uint64_t seed, int n) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> len(6.5, 1.0);
  std::vector<SampleLength> s;
  for (int i = 0; i < n; ++i) {
    const int64_t l = std::clamp<int64_t>(static_cast<int64_t>(len(rng)), 8, 6000);
    s.push_back({i, l, l - 1});
  }
  return s;
}

ScheduleOptions Options(const ResolvedCost& cost, ScheduleOptions::Scheduler scheduler) {
  ScheduleOptions o;
  o.dp_size = 4;
  o.parallel = *ParallelLayout::Create(2);
  o.max_tokens_per_rank = 8192;
  o.scheduler = scheduler;
  o.cost = cost.cost;
  o.step_time = cost.step_time;
  return o;
}

TEST(ProfilePlanTest, WrittenAndReadBackGivesIdenticalPlans) {
  MeasuredOn on;
  on.model = "llama2-7b";
  auto fitted = FitCostProfile(Timings(1), on);
  ASSERT_TRUE(fitted.ok()) << fitted.status().ToString();
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("thdpack_profile_plan_" + std::to_string(::getpid()) + ".json"))
                               .string();
  ASSERT_TRUE(WriteCostProfile(*fitted, path).ok());
  auto read = ResolveCost("profile:" + path, "h100-ib");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  // The coefficients in memory, as a fresh resolution would make them without the file.
  ResolvedCost memory = *read;
  const ProfileForm& used = fitted->used();
  memory.cost = CostModel{used.a, used.b, "in memory", used.c, "seconds"};
  StepTimeCoefficients k = read->step_time->coefficients();
  k.seconds_per_token = used.a;
  k.seconds_per_token_sq = used.b;
  k.seconds_per_sequence = used.c;
  k.seconds_per_microbatch = used.m;
  memory.step_time = *StepTimeModel::Create(k);
  for (auto scheduler : {ScheduleOptions::Scheduler::kBalanced,
                         ScheduleOptions::Scheduler::kSequential}) {
    for (uint64_t seed = 1; seed <= 5; ++seed) {
      const std::vector<SampleLength> step = Step(seed, 200);
      auto a = ScheduleWithFigures(step, Options(*read, scheduler));
      auto b = ScheduleWithFigures(step, Options(memory, scheduler));
      ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString();
      EXPECT_EQ(a->plan.sample_ids, b->plan.sample_ids);
      EXPECT_EQ(a->plan.offsets, b->plan.offsets);
      EXPECT_EQ(a->figures.max_replica_cost, b->figures.max_replica_cost);
      EXPECT_EQ(a->sim_step_time, b->sim_step_time);
      // The fast paths equal their references with a per-sequence constant.
      auto figures = ComputePlanFigures(step, Options(*read, scheduler), a->plan);
      ASSERT_TRUE(figures.ok());
      EXPECT_EQ(figures->max_replica_cost, a->figures.max_replica_cost);
      EXPECT_EQ(figures->lower_bound, a->figures.lower_bound);
      auto t = PlanStepTime(step, Options(*read, scheduler), a->plan);
      ASSERT_TRUE(t.ok());
      EXPECT_EQ(*t, *a->sim_step_time);
    }
  }
  auto dyn = ScheduleDynamic(Step(9, 200), Options(*read, ScheduleOptions::Scheduler::kDynamic));
  ASSERT_TRUE(dyn.ok()) << dyn.status().ToString();
  auto dyn_t = DynamicPlanStepTime(Step(9, 200),
                                   Options(*read, ScheduleOptions::Scheduler::kDynamic), *dyn);
  ASSERT_TRUE(dyn_t.ok());
  EXPECT_EQ(*dyn_t, dyn->step_time);
  std::remove(path.c_str());
}

// The per-sequence constant is part of the cost: a replica of many short sequences costs more
// than one of few long ones with the same tokens, so the balanced plan moves.
TEST(ProfilePlanTest, PerSequenceCostCountsInBalance) {
  std::vector<SampleLength> step;
  for (int i = 0; i < 32; ++i) step.push_back({i, 64, 63});
  for (int i = 32; i < 36; ++i) step.push_back({i, 512, 511});
  ResolvedCost tokens;
  tokens.cost = CostModel{1.0, 0.0, "tokens"};
  ResolvedCost per_seq;
  per_seq.cost = CostModel{1.0, 0.0, "per sequence", 200.0, "seconds"};
  ScheduleOptions o = Options(tokens, ScheduleOptions::Scheduler::kBalanced);
  o.dp_size = 2;
  o.parallel = *ParallelLayout::Create(1);
  o.max_tokens_per_rank = 4096;
  auto a = ScheduleWithFigures(step, o);
  o.cost = per_seq.cost;
  auto b = ScheduleWithFigures(step, o);
  ASSERT_TRUE(a.ok() && b.ok());
  // With c, the lower bound and every replica's cost include 200 per sequence: 36 sequences,
  // 4096 tokens: (4096 + 36 * 200) / 2 = 5648.
  EXPECT_DOUBLE_EQ(b->figures.lower_bound, 5648.0);
  EXPECT_LE(b->figures.imbalance, 1.0 + 1e-9);
  EXPECT_DOUBLE_EQ(a->figures.lower_bound, 2048.0);
}

}  // namespace
}  // namespace thdpack
