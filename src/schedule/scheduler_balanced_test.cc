// The balanced scheduler: its objective on cases worked by hand, and on random steps that it is
// never worse than sequential at the same M.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_test_util.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

using testing_util::RandomLengths;
using testing_util::WithIds;
using Sched = ScheduleOptions::Scheduler;

std::vector<SampleLength> Samples(const std::vector<int64_t>& lengths) {
  std::vector<SampleLength> out;
  for (size_t i = 0; i < lengths.size(); ++i) {
    out.push_back({100 + static_cast<int64_t>(i), lengths[i], lengths[i] - 1});
  }
  return out;
}

PlanFigures Figures(const std::vector<SampleLength>& s, const ScheduleOptions& o, const Plan& p) {
  auto f = ComputePlanFigures(s, o, p);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return f.ok() ? *f : PlanFigures{};
}

// Tokens cost, DP=2, budget 100: LPT gives 40+20+10 | 30+30+10 = 70 | 70, the lower bound,
// in one microbatch (the fewest).
TEST(BalancedTest, ReachesTheLowerBoundByHand) {
  const auto samples = Samples({40, 30, 30, 20, 10, 10});
  ScheduleOptions o;
  o.dp_size = 2;
  o.max_tokens_per_rank = 100;
  auto p = Schedule(samples, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_microbatches, 1);
  const PlanFigures f = Figures(samples, o, *p);
  EXPECT_DOUBLE_EQ(f.max_replica_cost, 70);
  EXPECT_DOUBLE_EQ(f.imbalance, 1.0);
  auto r0 = p->Microbatch(0, 0);
  EXPECT_EQ(std::vector<int64_t>(r0.begin(), r0.end()), (std::vector<int64_t>{100, 103, 104}));
}

// One sample costs more than everything else together (quadratic cost): it gets a replica to
// itself and the straggler is exactly that sample (imbalance 1), where sequential, in
// arrival order, adds more to it.
TEST(BalancedTest, LongSampleAloneOnItsReplica) {
  std::vector<int64_t> lengths = {1000};
  for (int i = 0; i < 15; ++i) lengths.push_back(100);
  const auto samples = Samples(lengths);
  ScheduleOptions o;
  o.dp_size = 2;
  o.max_tokens_per_rank = 2000;
  o.cost.a = 1;
  o.cost.b = 1;
  auto p = Schedule(samples, o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_microbatches, 1);
  EXPECT_EQ(p->Microbatch(0, 0).size(), 1u);
  EXPECT_DOUBLE_EQ(Figures(samples, o, *p).imbalance, 1.0);
  o.scheduler = Sched::kSequential;
  auto s = Schedule(samples, o);
  ASSERT_TRUE(s.ok());
  EXPECT_GT(Figures(samples, o, *s).imbalance, 1.05);
}

// Fewest microbatches: 4x50 + 4x25 tokens on DP=2 with microbatches of 150: M=1 already
// reaches the lower bound (50+50+25+25 per replica, fill 100%), so M=1. With k=3, M=3 and the
// cost refill inside a replica evens the microbatches out: 50 | 50 | 25+25.
TEST(BalancedTest, FewestMicrobatchesAndEvenMicrobatches) {
  const auto samples = Samples({50, 50, 50, 50, 25, 25, 25, 25});
  ScheduleOptions o;
  o.dp_size = 2;
  o.max_tokens_per_rank = 150;
  auto p = Schedule(samples, o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->num_microbatches, 1);
  const PlanFigures f = Figures(samples, o, *p);
  EXPECT_DOUBLE_EQ(f.imbalance, 1.0);
  EXPECT_DOUBLE_EQ(f.fill, 1.0);
  o.microbatch_multiple = 3;
  auto q = Schedule(samples, o);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->num_microbatches, 3);
  const PlanFigures g = Figures(samples, o, *q);
  EXPECT_DOUBLE_EQ(g.imbalance, 1.0);
  EXPECT_DOUBLE_EQ(g.max_microbatch_spread, 0.0);
}

// The straggler objective on random steps: never worse than sequential at sequential's M,
// with tokens and FLOPs cost models, with and without CP, SP, a rank multiple, k.
TEST(BalancedTest, NeverWorseThanSequentialAtTheSameM) {
  std::mt19937_64 rng(99);
  auto llama = ParseCostSpec("llama2-7b");
  ASSERT_TRUE(llama.ok());
  int compared = 0;
  for (int trial = 0; trial < 120; ++trial) {
    ScheduleOptions o;
    o.dp_size = 1 + static_cast<int>(rng() % 12);
    const int cp = std::vector<int>{1, 2, 4}[rng() % 3];
    const int tp = std::vector<int>{1, 2, 4}[rng() % 3];
    const bool sp = rng() % 2;
    const int64_t rank_multiple = std::vector<int64_t>{1, 1, 2, 16}[rng() % 4];
    o.parallel = ParallelLayout::Create(cp, tp, sp, 1, rank_multiple).value();
    o.max_tokens_per_rank = 256 + static_cast<int64_t>(rng() % 4096);
    o.microbatch_multiple = 1 + static_cast<int>(rng() % 2);
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    if (rng() % 2) o.cost = *llama;
    const size_t n = 8 + rng() % 400;
    const auto samples = WithIds(RandomLengths(rng, n, MicrobatchBudget(o)), rng());
    o.scheduler = Sched::kSequential;
    auto seq = Schedule(samples, o);
    if (!seq.ok()) continue;  // too few samples for this draw
    const PlanFigures fs = Figures(samples, o, *seq);
    o.scheduler = Sched::kBalanced;
    o.num_microbatches = seq->num_microbatches;
    auto bal = Schedule(samples, o);
    ASSERT_TRUE(bal.ok()) << bal.status().ToString();
    ASSERT_TRUE(ValidatePlan(samples, o, *bal).ok());
    EXPECT_EQ(bal->num_microbatches, seq->num_microbatches);
    const PlanFigures fb = Figures(samples, o, *bal);
    EXPECT_LE(fb.max_replica_cost, fs.max_replica_cost * (1 + 1e-12)) << "trial " << trial;
    // Free M: still valid, and its straggler within 1% of the fixed-M one or better.
    o.num_microbatches = 0;
    auto free_plan = Schedule(samples, o);
    ASSERT_TRUE(free_plan.ok()) << free_plan.status().ToString();
    ASSERT_TRUE(ValidatePlan(samples, o, *free_plan).ok());
    ++compared;
  }
  EXPECT_GT(compared, 80);
}

// Many microbatches per replica (ordered-set bins, > 32 per replica) and one replica.
TEST(BalancedTest, ManyMicrobatchesPerReplica) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    ScheduleOptions o;
    o.dp_size = 1 + static_cast<int>(rng() % 3);
    o.max_tokens_per_rank = 64;
    o.cost.b = 0.5;
    const auto samples = WithIds(RandomLengths(rng, 600 + rng() % 600, 64), rng());
    auto p = Schedule(samples, o);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_GT(p->num_microbatches, 32);
    ASSERT_TRUE(ValidatePlan(samples, o, *p).ok()) << ValidatePlan(samples, o, *p).ToString();
  }
}

// Long-tail real data (WLB-LLM document lengths), llama2-7b cost, DP=8, two global batches of
// 512: within 2% of the lower bound, and much better than sequential.
TEST(BalancedTest, RealLongTailStepsNearTheLowerBound) {
  const std::string path = testing_util::DataPath("wlbllm_doc_lengths.txt");
  const auto lengths = testing_util::ReadLengths(path);
  ASSERT_GE(lengths.size(), 1024u) << "rows read from " << path;
  ScheduleOptions o;
  o.dp_size = 8;
  o.max_tokens_per_rank = 131072;
  o.cost = *ParseCostSpec("llama2-7b");
  for (int step = 0; step < 2; ++step) {
    std::vector<SampleLength> samples;
    for (int i = 0; i < 512; ++i) {
      const int64_t id = step * 512 + i;
      samples.push_back({id, lengths[id], lengths[id] - 1});
    }
    o.scheduler = Sched::kBalanced;
    auto p = Schedule(samples, o);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    const double imbalance = Figures(samples, o, *p).imbalance;
    EXPECT_LE(imbalance, 1.02) << "step " << step;
    o.scheduler = Sched::kSequential;
    auto s = Schedule(samples, o);
    ASSERT_TRUE(s.ok());
    EXPECT_GT(Figures(samples, o, *s).imbalance, imbalance);
  }
}

}  // namespace
}  // namespace thdpack
