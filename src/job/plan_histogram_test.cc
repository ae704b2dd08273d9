// PlanHistogramStep (the bulk histogram path of `thdpack plan`) against the plain path:
// ExpandHistogram, Schedule, ComputeStepFigures and ComputeStepMemory.
#include "thdpack/job.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_test_util.h"

namespace thdpack {
namespace {

// Doubles summed over microbatches in another order: equal to a few ulps per term.
void ExpectNear(double a, double b, const std::string& what) {
  EXPECT_LE(std::abs(a - b), 1e-12 * std::max({1.0, std::abs(a), std::abs(b)})) << what;
}

// The plain path's figures for the same step, ids from first_id.
struct Plain {
  StepFigures figures;
  StepMemoryFigures memory;
  ScheduleOptions::Scheduler scheduler;
};
Plain PlainStep(const std::vector<HistogramRow>& h, int64_t first_id, const ScheduleOptions& o,
                const std::optional<FlopsCoefficients>& flops, const MemoryReportOptions& m) {
  std::vector<SampleLength> samples = ExpandHistogram(h);
  for (SampleLength& s : samples) s.id += first_id;
  Plain out;
  auto plan = Schedule(samples, o);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  if (!plan.ok()) return out;
  out.scheduler = plan->scheduler;
  auto f = ComputeStepFigures(3, 3, samples, o, *plan, flops);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  auto mem = ComputeStepMemory(samples, o, *plan, m);
  EXPECT_TRUE(mem.ok()) << mem.status().ToString();
  if (f.ok()) out.figures = std::move(f).value();
  if (mem.ok()) out.memory = std::move(mem).value();
  return out;
}

void ExpectSameStep(const PlannedStep& fast, const Plain& plain) {
  const PlanFigures& a = fast.figures.plan;
  const PlanFigures& b = plain.figures.plan;
  EXPECT_EQ(plain.scheduler, ScheduleOptions::Scheduler::kBalanced);
  testing_util::ExpectSameIntegerFigures(a, b);
  EXPECT_EQ(a.max_microbatch_spread, b.max_microbatch_spread);  // exact: same microbatches
  ExpectNear(a.total_cost, b.total_cost, "total_cost");
  ExpectNear(a.max_replica_cost, b.max_replica_cost, "max_replica_cost");
  ExpectNear(a.lower_bound, b.lower_bound, "lower_bound");
  ExpectNear(a.imbalance, b.imbalance, "imbalance");
  ExpectNear(a.pad_fraction, b.pad_fraction, "pad_fraction");
  ExpectNear(a.fill, b.fill, "fill");
  EXPECT_EQ(fast.figures.step, plain.figures.step);
  EXPECT_EQ(fast.figures.epoch, plain.figures.epoch);
  EXPECT_EQ(fast.figures.has_flops, plain.figures.has_flops);
  ExpectNear(fast.figures.flops, plain.figures.flops, "flops");
  EXPECT_EQ(fast.figures.capacity_tokens, plain.figures.capacity_tokens);
  EXPECT_EQ(fast.figures.skipped, plain.figures.skipped);
  // Memory: the same JSON, byte for byte.
  EXPECT_EQ(StepMemoryJson(fast.memory), StepMemoryJson(plain.memory));
}

// Random small histograms (strictly increasing lengths), CP padding, both oversize policies,
// the tokens and a quadratic cost: whenever the bulk path applies, every figure `plan` prints
// equals the plain path's; it must apply in most trials.
TEST(PlanStepTest, HistogramEqualsThePlainPathOnRandomHistograms) {
  std::mt19937_64 rng(2024);
  const auto flops = FlopsFromCostSpec("llama2-7b");
  ASSERT_TRUE(flops.ok());
  MemoryReportOptions m;
  m.vocab_size = 32000;
  int applied = 0;
  const int trials = 300;
  for (int trial = 0; trial < trials; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    ScheduleOptions o;
    const int cp = std::vector<int>{1, 1, 2, 4}[rng() % 4];
    const int tp = std::vector<int>{1, 2}[rng() % 2];
    const bool sp = tp == 1 && rng() % 2;  // SP with TP = 1: no tail
    o.parallel = ParallelLayout::Create(cp, tp, sp).value();
    o.max_tokens_per_rank = 16 + static_cast<int64_t>(rng() % 300);
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    o.cost = rng() % 2 ? CostModel{1.0, 0.0, "tokens"} : CostModel{3.0, 0.25, "quad"};
    const int64_t budget = MicrobatchBudget(o);
    std::vector<HistogramRow> h;
    int64_t length = 0;
    const int rows = 1 + static_cast<int>(rng() % 14);
    for (int r = 0; r < rows; ++r) {
      length += 1 + static_cast<int64_t>(rng() % (budget / 3 + 2));
      h.push_back({length, static_cast<int64_t>(rng() % 60)});
    }
    const int64_t first_id = static_cast<int64_t>(rng() % 3) * 1000;
    auto fast = PlanHistogramStep(h, 3, 3, first_id, o, *flops, m);
    ASSERT_TRUE(fast.ok()) << fast.status().ToString();
    if (!fast->has_value()) continue;
    ++applied;
    ExpectSameStep(**fast, PlainStep(h, first_id, o, *flops, m));
  }
  EXPECT_GE(applied, trials / 2) << "the bulk path applied in " << applied << " trials";
}

// Where the bulk path cannot prove itself equal it declines (the caller expands).
TEST(PlanStepTest, DeclinesOutsideItsPreconditions) {
  const std::vector<HistogramRow> h = {{3, 40}, {5, 40}, {9, 40}};
  const MemoryReportOptions m;
  ScheduleOptions o;
  o.max_tokens_per_rank = 16;
  auto base = PlanHistogramStep(h, 0, 0, 0, o, std::nullopt, m);
  ASSERT_TRUE(base.ok());
  EXPECT_TRUE(base->has_value());
  auto declines = [&](ScheduleOptions changed, std::vector<HistogramRow> rows) {
    auto r = PlanHistogramStep(rows, 0, 0, 0, changed, std::nullopt, m);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_FALSE(r->has_value());
  };
  ScheduleOptions x = o;
  x.dp_size = 2;
  declines(x, h);
  x = o;
  x.microbatch_multiple = 2;
  declines(x, h);
  x = o;
  x.scheduler = ScheduleOptions::Scheduler::kSequential;
  declines(x, h);
  x = o;
  x.parallel = ParallelLayout::Create(o.parallel.cp_size(), 2, true).value();
  declines(x, h);
  declines(o, {{5, 40}, {3, 40}});                   // lengths not increasing
  declines(o, {{3, 40}, {50, 1}});                   // oversize under policy 'error'
  declines(o, {{16, 3}});                            // next-fit as good as best fit
  auto bad = PlanHistogramStep(h, 0, 0, 0, ScheduleOptions{}, std::nullopt, m);
  EXPECT_FALSE(bad.ok());                            // max_tokens_per_rank is required
}

// Wikipedia-512 (16,279,552 sequences): the plan `thdpack plan` prints, without expanding.
TEST(PlanStepTest, Wikipedia512) {
  const auto h = testing_util::ReadHistogramCsv(
      testing_util::DataPath("wikipedia_512_histogram.csv"));
  ASSERT_FALSE(h.empty()) << "data/wikipedia_512_histogram.csv";
  ScheduleOptions o;
  o.max_tokens_per_rank = 512;
  o.cost = CostModel{1.0, 0.0, "tokens"};
  auto r = PlanHistogramStep(h, 0, 0, 0, o, std::nullopt, MemoryReportOptions{});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->has_value());
  const PlanFigures& f = (*r)->figures.plan;
  EXPECT_EQ(f.num_microbatches, 8138483);
  EXPECT_EQ(f.n_samples, 16279552);
  EXPECT_EQ(f.real_tokens, 4164796173);
}

}  // namespace
}  // namespace thdpack
