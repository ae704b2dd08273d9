// The histogram fast path against the per-sample path: same pack count as best-fit decreasing
// on the expanded samples and as Schedule on DP=1, and a valid Plan.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "schedule/scheduler_test_util.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

ScheduleOptions Budget(int64_t budget) {
  ScheduleOptions o;
  o.max_tokens_per_rank = budget;
  return o;
}

// Capacity 10; lengths 6,6,4,2,2,2. Best-fit decreasing: 6 -> A (room 4), 6 -> B (4),
// 4 -> A (0), 2 -> B (2), 2 -> B (0), 2 -> new C (8): packs {6,4} {6,2,2} {2}.
TEST(HistogramTest, SmallCaseByHand) {
  const std::vector<HistogramRow> h = {{2, 3}, {4, 1}, {6, 2}};
  auto p = PackHistogram(h, Budget(10));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_packs, 3);
  EXPECT_EQ(p->n_sequences, 6);
  EXPECT_EQ(p->real_tokens, 22);
  EXPECT_EQ(p->padded_tokens, 22);
  EXPECT_EQ(p->lower_bound, 3);
  EXPECT_DOUBLE_EQ(p->efficiency, 22.0 / 30.0);
  ASSERT_EQ(p->patterns.size(), 3u);
  // Least room first: {6,4} and {6,2,2} (room 0, in the order they reached it), then {2}.
  EXPECT_EQ(p->patterns[0].lengths, (std::vector<int64_t>{6, 4}));
  EXPECT_EQ(p->patterns[1].lengths, (std::vector<int64_t>{6, 2, 2}));
  EXPECT_EQ(p->patterns[2].lengths, (std::vector<int64_t>{2}));
  for (const auto& pat : p->patterns) EXPECT_EQ(pat.count, 1);
}

// Bulk moves: 1000 sequences of 3 and 1000 of 5 into 16: best fit per sequence gives 5,5,5 ->
// room 1 (333 packs + one with a single 5), then the 3s: 5 of them per new pack.
TEST(HistogramTest, BulkMatchesPerSample) {
  const std::vector<HistogramRow> h = {{3, 1000}, {5, 1000}};
  auto p = PackHistogram(h, Budget(16));
  ASSERT_TRUE(p.ok());
  const auto samples = ExpandHistogram(h);
  ScheduleOptions o = Budget(16);
  auto step = internal::PrepareStep(samples, o);
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(p->num_packs, internal::BestFitDecreasingBins(*step));
  // 334 packs of 5s (the last holds one 5, room 11: three 3s fit), then 997 3s in packs of 5.
  EXPECT_EQ(p->num_packs, 334 + (997 + 4) / 5);
}

// A pack that takes one sequence of a row still has the least room that fits, so best fit gives
// it the next one too: one pack of room 53 takes all four 1s here (an earlier bulk rule spread
// them one per pack and needed 9 packs where per-sample best fit needs 8).
TEST(HistogramTest, APackKeepsTakingTheRowWhileItHasTheLeastRoom) {
  const std::vector<HistogramRow> h = {{1, 4}, {8, 9}, {11, 10}, {28, 8}};
  auto p = PackHistogram(h, Budget(53));
  ASSERT_TRUE(p.ok());
  ScheduleOptions o = Budget(53);
  auto step = internal::PrepareStep(ExpandHistogram(h), o);
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(internal::BestFitDecreasingBins(*step), 8);
  EXPECT_EQ(p->num_packs, 8);
}

// Random small histograms, with CP padding, SP and rank-multiple tails: the fast path equals
// per-sample
// best-fit decreasing in pack count (and Schedule on DP=1 with the tokens cost), and its Plan
// holds every invariant.
TEST(HistogramTest, EqualsThePerSamplePathOnRandomHistograms) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 60; ++trial) {
    ScheduleOptions o;
    const int cp = std::vector<int>{1, 1, 2}[rng() % 3];
    const int tp = std::vector<int>{1, 2, 4}[rng() % 3];
    const bool sp = rng() % 2;
    const int64_t rank_multiple = std::vector<int64_t>{1, 1, 4, 16}[rng() % 4];
    o.parallel = ParallelLayout::Create(cp, tp, sp, 1, rank_multiple).value();
    o.max_tokens_per_rank = 32 + static_cast<int64_t>(rng() % 200);
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    o.max_microbatch_search = 1000;
    const int64_t budget = MicrobatchBudget(o);
    std::vector<HistogramRow> h;
    const int rows = 1 + static_cast<int>(rng() % 12);
    for (int r = 0; r < rows; ++r) {
      h.push_back({1 + static_cast<int64_t>(rng() % (budget + budget / 4)),
                   static_cast<int64_t>(rng() % 40)});
    }
    auto packing = PackHistogram(h, o);
    ASSERT_TRUE(packing.ok()) << packing.status().ToString();
    const auto samples = ExpandHistogram(h);
    auto step = internal::PrepareStep(samples, o);
    ASSERT_TRUE(step.ok());
    if (step->size() == 0) continue;
    EXPECT_EQ(packing->num_packs, internal::BestFitDecreasingBins(*step)) << "trial " << trial;
    EXPECT_EQ(packing->n_sequences + packing->n_skipped, static_cast<int64_t>(samples.size()));
    EXPECT_GE(packing->num_packs, packing->lower_bound);

    auto plan = HistogramPackingToPlan(h, *packing, o);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    const Status v = ValidatePlan(samples, o, *plan);
    ASSERT_TRUE(v.ok()) << v.ToString() << " trial " << trial;
    auto f = ComputePlanFigures(samples, o, *plan);
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->padded_tokens, packing->padded_tokens);
    EXPECT_EQ(f->real_tokens, packing->real_tokens);
    EXPECT_EQ(f->n_skipped, packing->n_skipped);

    // Schedule on DP=1 with the tokens cost is best-fit decreasing too (its sequential
    // candidate could only ever do better in arrival order).
    SCOPED_TRACE(o.parallel.ToString());
    auto per_sample = Schedule(samples, o);
    ASSERT_TRUE(per_sample.ok()) << per_sample.status().ToString();
    ASSERT_TRUE(ValidatePlan(samples, o, *per_sample).ok()) << "trial " << trial;
    // (With SP, tails differ between plans: another plan with as many microbatches may win.
    // With a rank multiple the tails are as large as the budget's quantum, and a plan of more
    // microbatches whose tails cost fewer tokens may win: the counts are not comparable.)
    if (o.parallel.rank_multiple() == 1) {
      EXPECT_LE(per_sample->num_microbatches, packing->num_packs) << "trial " << trial;
    }
    if (per_sample->scheduler == ScheduleOptions::Scheduler::kBalanced &&
        !o.parallel.may_pad_tail()) {
      EXPECT_EQ(per_sample->num_microbatches, packing->num_packs) << "trial " << trial;
    }
  }
}

TEST(HistogramTest, OversizeRows) {
  const std::vector<HistogramRow> h = {{5, 2}, {50, 3}, {7, 1}};
  auto e = PackHistogram(h, Budget(20));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("row 1: length 50"), std::string::npos)
      << e.status().ToString();
  ScheduleOptions o = Budget(20);
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  auto p = PackHistogram(h, o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->n_skipped, 3);
  EXPECT_EQ(p->num_packs, 1);
  auto plan = HistogramPackingToPlan(h, *p, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->skipped, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_TRUE(ValidatePlan(ExpandHistogram(h), o, *plan).ok());

  auto bad = PackHistogram(std::vector<HistogramRow>{{0, 3}}, Budget(20));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("row 0"), std::string::npos);
}

// Wikipedia-512 (Krell et al.): all 16,279,552 sequences in one step into packs of 512.
// Published: LPFHP 8,149,619 packs (99.8129%); lower bound 8,134,368.
TEST(HistogramTest, Wikipedia512BeatsLpfhp) {
  const std::string path = testing_util::DataPath("wikipedia_512_histogram.csv");
  const auto h = testing_util::ReadHistogramCsv(path);
  ASSERT_EQ(h.size(), 508u) << "rows read from " << path;
  auto p = PackHistogram(h, Budget(512));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->n_sequences, 16279552);
  EXPECT_EQ(p->real_tokens, 4164796173);
  EXPECT_EQ(p->lower_bound, 8134368);
  EXPECT_LT(p->num_packs, 8149619);
  EXPECT_GT(p->efficiency, 0.998129);
  int64_t packs = 0, sequences = 0;
  for (const auto& pat : p->patterns) {
    packs += pat.count;
    sequences += pat.count * static_cast<int64_t>(pat.lengths.size());
    int64_t sum = 0;
    for (int64_t l : pat.lengths) sum += l;
    EXPECT_LE(sum, 512);
  }
  EXPECT_EQ(packs, p->num_packs);
  EXPECT_EQ(sequences, 16279552);
}

}  // namespace
}  // namespace thdpack
