// The encoder's term in the step-time model (seconds): under the dynamic scheduler
// (ScheduleDynamic's encoder work) the modelled time against a plain sum over the plan's
// groups, the plain reference of the list schedule, plans unchanged without a term or work,
// the plan that sees the encoder against the one blind to it; a static plan's sim_step_time
// against PlanStepTime and the same plain sum; the conversion of a term into seconds
// (EncoderTermSeconds), and the inputs refused.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "schedule/scheduler_test_util.h"
#include "thdpack/cost.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

using testing_util::RandomLengths;
using testing_util::WithIds;

constexpr ModelDims kSmall{2, 8, 2, 1, 16, 10};

ScheduleOptions Options(int dp, int cp, int64_t max_tokens, EncoderCost seconds) {
  ScheduleOptions o;
  o.dp_size = dp;
  o.parallel = *ParallelLayout::Create(cp, 1, false);
  o.max_tokens_per_rank = max_tokens;
  o.cost = *CostModelFromDims(kSmall);
  o.scheduler = ScheduleOptions::Scheduler::kDynamic;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  o.step_time = StepTimeModel::Create(kSmall, *ParseHardwareSpec("1000,10"))->WithEncoder(seconds);
  return o;
}

std::vector<EncoderWork> RandomWork(std::mt19937_64& rng, size_t n) {
  std::vector<EncoderWork> w(n);
  for (EncoderWork& x : w) {
    if (rng() % 3 != 0) continue;
    for (int k = 1 + static_cast<int>(rng() % 3); k > 0; --k) {
      const int64_t t = rng() % 4 == 0 ? 2 + static_cast<int64_t>(rng() % 5) : 1;
      const int64_t hw = (2 + static_cast<int64_t>(rng() % 20)) * (2 + static_cast<int64_t>(rng() % 20));
      x.patches += t * hw;
      x.frame_sq += t * hw * hw;
    }
  }
  return w;
}

// The plain rule: each group's microbatch is the sum over its sequences of t(P, c) (P in the
// group's layout, the SP tail on the last) and E(w) / c, plus m; the step SimulateStepTime's.
double PlainStepTime(const std::vector<SampleLength>& samples, const std::vector<EncoderWork>& w,
                     const ScheduleOptions& o, const DynamicPlan& plan) {
  const StepTimeModel& model = *o.step_time;
  std::vector<GroupTask> tasks;
  for (const auto& groups : plan.microbatches) {
    for (const CpGroup& g : groups) {
      const ParallelLayout layout = *GroupLayout(o, g.num_ranks);
      std::vector<int64_t> padded;
      double encoder = 0;
      for (int64_t id : g.sample_ids) {
        for (size_t i = 0; i < samples.size(); ++i) {
          if (samples[i].id != id) continue;
          padded.push_back(layout.PaddedLength(samples[i].length));
          encoder += model.EncoderSeconds(static_cast<double>(w[i].patches),
                                          static_cast<double>(w[i].frame_sq));
        }
      }
      int64_t sum = 0;
      for (int64_t p : padded) sum += p;
      padded.back() += layout.MicrobatchTokens(sum) - sum;
      double t = 0;
      for (int64_t p : padded) t += model.SequenceSeconds(p, g.num_ranks);
      t += encoder / g.num_ranks + model.coefficients().seconds_per_microbatch;
      tasks.push_back({g.first_rank, g.num_ranks, t});
    }
  }
  return *SimulateStepTime(plan.domain_size, tasks);
}

TEST(DynamicEncoder, StepTimeIsThePlainSumAndThePlainListScheduleAgrees) {
  std::mt19937_64 rng(20261207);
  const int topologies[][2] = {{1, 2}, {2, 2}, {1, 4}, {3, 1}, {2, 3}};
  int improved = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const auto& topo = topologies[trial % 5];
    // Encoder seconds from a share of the step to most of it.
    const double scale = trial % 2 ? 1e-3 : 1e-1;
    const ScheduleOptions o = Options(topo[0], topo[1], 256, EncoderCost{scale, scale * 1e-3});
    const std::vector<SampleLength> samples =
        WithIds(RandomLengths(rng, 8 + rng() % 40, 256 * topo[0] * topo[1]), rng());
    const std::vector<EncoderWork> w = RandomWork(rng, samples.size());
    SCOPED_TRACE("trial " + std::to_string(trial));
    Result<DynamicPlan> plan = ScheduleDynamic(samples, o, {}, w);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ASSERT_TRUE(ValidateDynamicPlan(samples, o, *plan).ok());
    const double plain = PlainStepTime(samples, w, o, *plan);
    EXPECT_NEAR(plan->step_time, plain, 1e-9 * plain);
    Result<double> t = DynamicPlanStepTime(samples, o, *plan, w);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(*t, plan->step_time);
    Result<DynamicPlan> reference = internal::ScheduleDynamicImpl(samples, o, true, {}, w);
    ASSERT_TRUE(reference.ok());
    EXPECT_EQ(reference->step_time, plan->step_time);
    EXPECT_EQ(reference->method, plan->method);
    // Blind to the encoder, the plan is never faster in the model that charges it (the blind
    // list schedules are among the candidates).
    Result<DynamicPlan> blind = ScheduleDynamic(samples, o);
    ASSERT_TRUE(blind.ok());
    Result<double> blind_time = DynamicPlanStepTime(samples, o, *blind, w);
    ASSERT_TRUE(blind_time.ok());
    EXPECT_LE(plan->step_time, *blind_time);
    improved += plan->step_time < *blind_time * (1 - 1e-9);
  }
  // Seeing the encoder pays on some of these steps (it must, or the term changes nothing).
  EXPECT_GT(improved, 5);
}

TEST(DynamicEncoder, WithoutATermOrWorkEveryPlanIsWhatItWas) {
  std::mt19937_64 rng(77);
  for (int trial = 0; trial < 30; ++trial) {
    const ScheduleOptions none = Options(2, 2, 256, EncoderCost{});
    const ScheduleOptions term = Options(2, 2, 256, EncoderCost{1e-2, 1e-5});
    const std::vector<SampleLength> samples =
        WithIds(RandomLengths(rng, 8 + rng() % 40, 1024), rng());
    const std::vector<EncoderWork> w = RandomWork(rng, samples.size());
    const std::vector<EncoderWork> zero(samples.size());
    Result<DynamicPlan> base = ScheduleDynamic(samples, none);
    ASSERT_TRUE(base.ok());
    for (const auto& [o, work] : {std::pair{&none, &w}, std::pair{&term, &zero}}) {
      Result<DynamicPlan> p = ScheduleDynamic(samples, *o, {}, *work);
      ASSERT_TRUE(p.ok());
      EXPECT_EQ(p->step_time, base->step_time);
      EXPECT_EQ(p->method, base->method);
      EXPECT_EQ(p->microbatches.size(), base->microbatches.size());
    }
  }
}

// A long text sequence and two short ones with a large image each, on two ranks: the images
// end on different ranks (or each over both), never stacked on one (>= 2 E(w)).
TEST(DynamicEncoder, TheImagesAreSpread) {
  const std::vector<SampleLength> samples = {{0, 240, 239}, {1, 100, 99}, {2, 100, 99}};
  std::vector<EncoderWork> w(3);
  w[1] = w[2] = EncoderWork{1024, 1024 * 1024};
  const ScheduleOptions o = Options(2, 1, 256, EncoderCost{10.0, 1e-2});
  Result<DynamicPlan> aware = ScheduleDynamic(samples, o, {}, w);
  Result<DynamicPlan> blind = ScheduleDynamic(samples, o);
  ASSERT_TRUE(aware.ok() && blind.ok());
  const double blind_time = *DynamicPlanStepTime(samples, o, *blind, w);
  const double e = o.step_time->EncoderSeconds(1024, 1024.0 * 1024);
  const double text = *DynamicPlanStepTime(samples, o, *blind);  // the blind plan, text only
  EXPECT_LE(aware->step_time, blind_time);
  EXPECT_LE(aware->step_time, e + text);
  EXPECT_LT(aware->step_time, 1.5 * e);
}

// A static plan's sim_step_time charges the term too: each replica's microbatch takes its
// samples' encoder seconds over CP. The scheduler's value from its arrays equals PlanStepTime's
// over the plan exactly, and the plain sum over the plan's groups.
TEST(DynamicEncoder, StaticPlansChargeItInTheirStepTime) {
  std::mt19937_64 rng(4242);
  for (int trial = 0; trial < 40; ++trial) {
    const int dp = 1 + static_cast<int>(rng() % 3), cp = 1 + static_cast<int>(rng() % 2);
    ScheduleOptions o = Options(dp, cp, 256, EncoderCost{});
    o.scheduler = trial % 3 == 0 ? ScheduleOptions::Scheduler::kSequential
                                 : ScheduleOptions::Scheduler::kBalanced;
    o.encoder_cost = EncoderCost{4e3, 4.0};  // training FLOPs, R = 1000: 4 s a patch
    o.step_time = o.step_time->WithEncoder(*EncoderTermSeconds(o.cost, *o.step_time,
                                                               o.encoder_cost));
    const std::vector<SampleLength> samples =
        WithIds(RandomLengths(rng, 8 + rng() % 40, 256 * cp), rng());
    const std::vector<EncoderWork> w = RandomWork(rng, samples.size());
    SCOPED_TRACE("trial " + std::to_string(trial));
    Result<ScheduledPlan> got = ScheduleWithFigures(samples, o, {}, w);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_TRUE(got->sim_step_time.has_value());
    Result<double> t = PlanStepTime(samples, o, got->plan, w);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(*got->sim_step_time, *t);
    DynamicPlan as_groups;  // the static plan as groups, for the plain sum
    as_groups.domain_size = dp * cp;
    as_groups.microbatches.resize(static_cast<size_t>(got->plan.num_microbatches));
    for (int m = 0; m < got->plan.num_microbatches; ++m) {
      for (int d = 0; d < dp; ++d) {
        std::span<const int64_t> ids = got->plan.Microbatch(d, m);
        if (ids.empty()) continue;
        as_groups.microbatches[static_cast<size_t>(m)].push_back(
            CpGroup{d * cp, cp, std::vector<int64_t>(ids.begin(), ids.end())});
      }
    }
    const double plain = PlainStepTime(samples, w, o, as_groups);
    EXPECT_NEAR(*t, plain, 1e-9 * plain);
    Result<double> text = PlanStepTime(samples, o, got->plan);  // without the work
    ASSERT_TRUE(text.ok());
    EXPECT_LE(*text, *t);
  }
}

TEST(DynamicEncoder, ATermInTheCostsUnitBecomesSeconds) {
  const StepTimeModel preset = *StepTimeModel::Create(kLlama2_7B, Hardware{});
  const CostModel flops = *CostModelFromDims(kLlama2_7B);
  const auto s = EncoderTermSeconds(flops, preset, EncoderCost{4e14, 8e11});
  ASSERT_TRUE(s.has_value());
  EXPECT_DOUBLE_EQ(s->per_patch, 1.0);  // 4e14 FLOPs at 400 TFLOP/s
  EXPECT_DOUBLE_EQ(s->per_frame_sq, 2e-3);
  CostModel profile;
  profile.unit = "seconds";
  const auto same = EncoderTermSeconds(profile, preset, EncoderCost{0.5, 0.25});
  ASSERT_TRUE(same.has_value());
  EXPECT_EQ(same->per_patch, 0.5);
  EXPECT_FALSE(EncoderTermSeconds(CostModel{}, preset, EncoderCost{1, 1}).has_value());  // tokens
  StepTimeCoefficients k;
  k.seconds_per_token = 1;
  k.encoder.per_patch = -1;
  EXPECT_NE(StepTimeModel::Create(k).status().message().find("encoder seconds per patch"),
            std::string::npos);
}

TEST(DynamicEncoder, Refusals) {
  std::vector<SampleLength> samples;
  for (int64_t i = 0; i < 4; ++i) samples.push_back({i, 100, 99});
  const ScheduleOptions o = Options(2, 1, 256, EncoderCost{1, 0});
  auto has = [](const Status& s, const std::string& part) {
    return s.ToString().find(part) != std::string::npos;
  };
  const std::vector<EncoderWork> three(3);
  EXPECT_TRUE(has(ScheduleDynamic(samples, o, {}, three).status(), "3 encoder works for 4"));
  std::vector<EncoderWork> negative(4);
  negative[1] = {0, -3};
  const Status n = ScheduleDynamic(samples, o, {}, negative).status();
  EXPECT_TRUE(has(n, "sample id 1")) << n.ToString();
  EXPECT_TRUE(has(n, "must be >= 0")) << n.ToString();
}

}  // namespace
}  // namespace thdpack
