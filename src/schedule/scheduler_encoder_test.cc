// The encoder's term in the static schedulers (ScheduleOptions::encoder_cost, EncoderWork per
// sample): the figures from the scheduler's arrays against ComputePlanFigures' reference and a
// plain sum, the replicas balanced on the language model plus the encoder, the term's absence
// leaving every plan as it was, and the inputs it refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_test_util.h"
#include "thdpack/cost.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

// A few samples carry media: 0-3 items of 4-40 x 4-40 patches (some videos of 2-8 frames).
std::vector<EncoderWork> RandomWork(std::mt19937_64& rng, size_t n) {
  std::vector<EncoderWork> w(n);
  for (EncoderWork& x : w) {
    if (rng() % 3 != 0) continue;
    for (int k = static_cast<int>(rng() % 4); k > 0; --k) {
      const int64_t t = rng() % 4 == 0 ? 2 + static_cast<int64_t>(rng() % 7) : 1;
      const int64_t hw = (4 + static_cast<int64_t>(rng() % 37)) * (4 + static_cast<int64_t>(rng() % 37));
      x.patches += t * hw;
      x.frame_sq += t * hw * hw;
    }
  }
  return w;
}

ScheduleOptions RandomOptions(std::mt19937_64& rng) {
  ScheduleOptions o;
  o.dp_size = 1 + static_cast<int>(rng() % 4);
  const int tp = 1 + static_cast<int>(rng() % 2);
  o.parallel = ParallelLayout::Create(1 << (rng() % 3), tp, tp > 1 && rng() % 2 == 0).value();
  o.max_tokens_per_rank = 4096;
  o.cost = ParseCostSpec(rng() % 2 ? "llama2-7b" : "llama3-8b").value();
  // The Qwen2-VL tower's order of magnitude in FLOPs, or 100x it: encoder work from a share of
  // the step's cost to most of it.
  const double scale = rng() % 2 ? 1.0 : 100.0;
  o.encoder_cost = EncoderCost{3.77e9 * scale, 4.9e5 * scale};
  o.scheduler = rng() % 4 == 0 ? ScheduleOptions::Scheduler::kSequential
                               : ScheduleOptions::Scheduler::kBalanced;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  if (rng() % 4 == 0) o.max_seqs_per_microbatch = 4 + static_cast<int>(rng() % 8);
  return o;
}

std::vector<SampleLength> RandomSamples(std::mt19937_64& rng) {
  const size_t n = 16 + rng() % 200;
  auto lengths = testing_util::RandomLengths(rng, n, 9000);
  return testing_util::WithIds(lengths, rng());
}

TEST(ScheduleEncoder, FiguresEqualTheReferenceAndAPlainSum) {
  std::mt19937_64 rng(501);
  int scheduled = 0;
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng);
    const auto work = RandomWork(rng, samples.size());
    const ScheduleOptions o = RandomOptions(rng);
    Result<ScheduledPlan> fast = ScheduleWithFigures(samples, o, {}, work);
    Result<Plan> plan = Schedule(samples, o, {}, work);
    ASSERT_EQ(plan.ok(), fast.ok());
    if (!plan.ok()) continue;
    ++scheduled;
    ASSERT_TRUE(ValidatePlan(samples, o, *plan).ok());
    EXPECT_EQ(fast->plan.sample_ids, plan->sample_ids);
    EXPECT_EQ(fast->plan.offsets, plan->offsets);
    Result<PlanFigures> reference = ComputePlanFigures(samples, o, *plan, work);
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    testing_util::ExpectSameFigures(fast->figures, *reference);
    // The encoder's part, summed plainly over the scheduled samples.
    double expected = 0;
    for (size_t i = 0; i < samples.size(); ++i) {
      if (std::find(plan->skipped.begin(), plan->skipped.end(), samples[i].id) !=
          plan->skipped.end()) {
        continue;
      }
      expected += (o.encoder_cost.per_patch * static_cast<double>(work[i].patches) +
                   o.encoder_cost.per_frame_sq * static_cast<double>(work[i].frame_sq)) /
                  o.parallel.cp_size();
    }
    EXPECT_NEAR(fast->figures.encoder_cost, expected, 1e-9 * std::max(1.0, expected));
    // The costs hold it: the total is the language model's (the same plan without the term)
    // plus the encoder's.
    ScheduleOptions lm = o;
    lm.encoder_cost = {};
    Result<PlanFigures> lm_only = ComputePlanFigures(samples, lm, *plan, work);
    ASSERT_TRUE(lm_only.ok());
    EXPECT_EQ(lm_only->encoder_cost, 0.0);
    EXPECT_NEAR(fast->figures.total_cost, lm_only->total_cost + expected,
                1e-9 * fast->figures.total_cost);
    EXPECT_GE(fast->figures.imbalance, 1.0 - 1e-9);  // the bound holds the encoder's term
  }
  EXPECT_GT(scheduled, 150);
}

// Eight samples of one length; two carry large images. Balanced on the language model alone,
// the ties go by id and both images land on one replica; with the term they are split.
TEST(ScheduleEncoder, BalancesTheReplicasOnTheLanguageModelPlusTheEncoder) {
  std::vector<SampleLength> samples;
  std::vector<EncoderWork> work(8);
  for (int64_t i = 0; i < 8; ++i) samples.push_back({i, 2048, 2047});
  const int64_t hw = 128 * 128;  // a 1,792-pixel square image of 14-pixel patches
  work[0] = {hw, hw * hw};
  work[2] = {hw, hw * hw};
  ScheduleOptions o;
  o.dp_size = 2;
  o.max_tokens_per_rank = 8192;
  o.cost = ParseCostSpec("llama2-7b").value();
  o.encoder_cost = EncoderCost{3774873600.0, 491520.0};
  ScheduleOptions lm = o;
  lm.encoder_cost = {};
  const Plan blind = Schedule(samples, lm, {}, work).value();
  const Plan aware = Schedule(samples, o, {}, work).value();
  const PlanFigures f_blind = ComputePlanFigures(samples, o, blind, work).value();
  const PlanFigures f_aware = ComputePlanFigures(samples, o, aware, work).value();
  auto replica_of = [](const Plan& p, int64_t id) {
    for (int d = 0; d < p.dp_size; ++d) {
      for (int m = 0; m < p.num_microbatches; ++m) {
        const auto ids = p.Microbatch(d, m);
        if (std::find(ids.begin(), ids.end(), id) != ids.end()) return d;
      }
    }
    return -1;
  };
  EXPECT_EQ(replica_of(blind, 0), replica_of(blind, 2));  // what the term is for
  EXPECT_NE(replica_of(aware, 0), replica_of(aware, 2));
  EXPECT_GT(f_blind.imbalance, 1.3);
  EXPECT_LT(f_aware.imbalance, 1.01);
  EXPECT_GT(f_aware.encoder_cost, 0.3 * f_aware.total_cost);  // a third of the work
}

// Over random steps, the plans that see the encoder have a smaller straggler (measured with it)
// than the plans blind to it, taken together.
TEST(ScheduleEncoder, SeeingTheEncoderLowersTheStragglerOnRandomSteps) {
  std::mt19937_64 rng(502);
  double blind_sum = 0, aware_sum = 0;
  int compared = 0, worse = 0;
  for (int trial = 0; trial < 100; ++trial) {
    const auto samples = RandomSamples(rng);
    const auto work = RandomWork(rng, samples.size());
    ScheduleOptions o = RandomOptions(rng);
    o.scheduler = ScheduleOptions::Scheduler::kBalanced;
    ScheduleOptions lm = o;
    lm.encoder_cost = {};
    Result<Plan> blind = Schedule(samples, lm, {}, work);
    Result<Plan> aware = Schedule(samples, o, {}, work);
    if (!blind.ok() || !aware.ok()) continue;
    const double b = ComputePlanFigures(samples, o, *blind, work).value().imbalance;
    const double a = ComputePlanFigures(samples, o, *aware, work).value().imbalance;
    blind_sum += b;
    aware_sum += a;
    worse += a > b * 1.02;
    ++compared;
  }
  ASSERT_GT(compared, 60);
  EXPECT_LT(aware_sum, blind_sum);
  EXPECT_LT(worse, compared / 10);
}

// No term (an empty cost, no work, or work of zeros): the plan of the step without media.
TEST(ScheduleEncoder, WithoutATermThePlanIsUnchanged) {
  std::mt19937_64 rng(503);
  for (int trial = 0; trial < 60; ++trial) {
    const auto samples = RandomSamples(rng);
    const auto work = RandomWork(rng, samples.size());
    ScheduleOptions o = RandomOptions(rng);
    Result<Plan> plain = Schedule(samples, o);
    const std::vector<EncoderWork> zeros(samples.size());
    Result<Plan> zero_work = Schedule(samples, o, {}, zeros);
    ScheduleOptions none = o;
    none.encoder_cost = {};
    Result<Plan> no_cost = Schedule(samples, none, {}, work);
    ASSERT_EQ(plain.ok(), zero_work.ok());
    ASSERT_EQ(plain.ok(), no_cost.ok());
    if (!plain.ok()) continue;
    EXPECT_EQ(plain->sample_ids, zero_work->sample_ids);
    EXPECT_EQ(plain->offsets, zero_work->offsets);
    EXPECT_EQ(plain->sample_ids, no_cost->sample_ids);
    EXPECT_EQ(plain->offsets, no_cost->offsets);
  }
}

// Groups kept on a replica or in a microbatch carry their members' encoder work.
TEST(ScheduleEncoder, GroupsCarryTheirMembersWork) {
  std::mt19937_64 rng(504);
  int scheduled = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const auto samples = RandomSamples(rng);
    const auto work = RandomWork(rng, samples.size());
    ScheduleOptions o = RandomOptions(rng);
    o.scheduler = ScheduleOptions::Scheduler::kBalanced;
    o.keep_groups = trial % 2 ? ScheduleOptions::KeepGroups::kReplica
                              : ScheduleOptions::KeepGroups::kMicrobatch;
    std::vector<int64_t> groups(samples.size());
    for (size_t i = 0; i < groups.size(); ++i) groups[i] = static_cast<int64_t>(i / 2);
    Result<ScheduledPlan> fast = ScheduleWithFigures(samples, o, groups, work);
    if (!fast.ok()) continue;
    ++scheduled;
    ASSERT_TRUE(ValidatePlan(samples, o, fast->plan, groups).ok());
    testing_util::ExpectSameFigures(fast->figures,
                                    ComputePlanFigures(samples, o, fast->plan, work).value());
  }
  EXPECT_GT(scheduled, 40);
}

TEST(ScheduleEncoder, RefusesWhatCannotBeCharged) {
  std::vector<SampleLength> samples;
  for (int64_t i = 0; i < 4; ++i) samples.push_back({i, 100, 99});
  ScheduleOptions o;
  o.max_tokens_per_rank = 1024;
  o.encoder_cost = EncoderCost{1.0, 0.0};
  auto has = [](const Status& s, const std::string& part) {
    return s.ToString().find(part) != std::string::npos;
  };
  const std::vector<EncoderWork> three(3);
  EXPECT_TRUE(has(Schedule(samples, o, {}, three).status(), "3 encoder works for 4 samples"));
  std::vector<EncoderWork> negative(4);
  negative[2] = {-5, 0};
  const Status n = Schedule(samples, o, {}, negative).status();
  EXPECT_TRUE(has(n, "sample id 2")) << n.ToString();
  EXPECT_TRUE(has(n, "must be >= 0")) << n.ToString();
  ScheduleOptions bad = o;
  bad.encoder_cost.per_frame_sq = std::nan("");
  EXPECT_TRUE(has(Schedule(samples, bad).status(), "encoder_cost"));
  ScheduleOptions dynamic = o;
  dynamic.scheduler = ScheduleOptions::Scheduler::kDynamic;
  dynamic.step_time = StepTimeModel::Create(kLlama2_7B, Hardware{}).value();
  EXPECT_TRUE(has(ScheduleDynamic(samples, dynamic).status(), "encoder_cost with the dynamic"));
}

}  // namespace
}  // namespace thdpack
