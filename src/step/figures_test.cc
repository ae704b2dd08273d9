// Step figures and JSON on a hand-worked plan.
//
// Samples (id: L) 10: 3, 11: 5, 12: 2, 13: 6 with n_targets = L - 1; DP = 2, CP = 2 (sequences
// padded to multiples of 2*CP = 4: P = 4, 8, 4, 8), max_tokens_per_rank = 8 (a replica's
// microbatch holds 16), one microbatch per replica: replica 0 = [10, 12] (P = 4 + 4 = 8),
// replica 1 = [11, 13] (P = 8 + 8 = 16). By hand, with the `tokens` cost, per rank (/CP):
//   real 16, padded 24, sum_sq 16 + 64 + 16 + 64 = 160, loss tokens 2 + 4 + 1 + 5 = 12;
//   replica costs 4 and 8; lower bound max(24 / 2 / 2, 8 / 2) = 6; imbalance 8 / 6;
//   pad_fraction 1 - 16/24 = 1/3; fill 24 / (1 * 2 * 2 * 8) = 0.75.
#include "thdpack/figures.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "hand_plan.h"

namespace thdpack {
namespace {

using testing::HandOptions;
using testing::HandPlan;
using testing::HandSamples;

// Llama-2 7B FLOPs coefficients worked out from docs/design.md section 3 (h = 4096, l = 32,
// f = 11008, V = 32000, n_kv = n_h): per token 3 * (64 * (4*4096^2 + 3*4096*11008) +
// 2*4096*32000) = 3 * (64 * 202375168 + 262144000) = 39642464256; per squared token
// 3 * 2 * 32 * 4096 = 786432.
constexpr int64_t kLlama2PerToken = 39642464256;
constexpr int64_t kLlama2PerTokenSq = 786432;

TEST(StepFigures, HandWorkedPlan) {
  const auto samples = HandSamples();
  const auto coef = FlopsFromCostSpec("llama2-7b");
  ASSERT_TRUE(coef.ok()) << coef.status().ToString();
  ASSERT_TRUE(coef->has_value());
  EXPECT_EQ((*coef)->per_token, kLlama2PerToken);
  EXPECT_EQ((*coef)->per_token_sq, kLlama2PerTokenSq);
  auto f = ComputeStepFigures(3, 1, samples, HandOptions(), HandPlan(), *coef);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->step, 3);
  EXPECT_EQ(f->epoch, 1);
  EXPECT_EQ(f->plan.real_tokens, 16);
  EXPECT_EQ(f->plan.padded_tokens, 24);
  EXPECT_EQ(f->plan.sum_sq, 160);
  EXPECT_EQ(f->plan.n_loss_tokens, 12);
  EXPECT_DOUBLE_EQ(f->plan.imbalance, 8.0 / 6.0);
  EXPECT_DOUBLE_EQ(f->plan.pad_fraction, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(f->plan.fill, 0.75);
  EXPECT_EQ(f->capacity_tokens, 32);
  EXPECT_TRUE(f->has_flops);
  EXPECT_DOUBLE_EQ(f->flops, 951544971264.0);  // 39642464256 * 24 + 786432 * 160
  ASSERT_EQ(f->sample_ids.size(), 2u);
  EXPECT_EQ(f->sample_ids[0][0], (std::vector<int64_t>{10, 12}));
  EXPECT_EQ(f->sample_ids[1][0], (std::vector<int64_t>{11, 13}));

  const auto j = nlohmann::json::parse(StepFiguresJson(*f, false));
  EXPECT_EQ(j["step"], 3);
  EXPECT_EQ(j["num_microbatches"], 1);
  EXPECT_EQ(j["n_samples"], 4);
  EXPECT_EQ(j["n_skipped"], 0);
  EXPECT_EQ(j["real_tokens"], 16);
  EXPECT_EQ(j["padded_tokens"], 24);
  EXPECT_EQ(j["sum_sq"], 160);
  EXPECT_EQ(j["n_loss_tokens"], 12);
  EXPECT_DOUBLE_EQ(j["imbalance"].get<double>(), 8.0 / 6.0);
  EXPECT_DOUBLE_EQ(j["fill"].get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(j["flops"].get<double>(), 951544971264.0);
  ASSERT_EQ(j["replicas"].size(), 2u);
  EXPECT_DOUBLE_EQ(j["replicas"][0]["cost"].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(j["replicas"][1]["cost"].get<double>(), 8.0);
  EXPECT_EQ(j["replicas"][1]["microbatches"][0]["samples"], nlohmann::json({11, 13}));
  EXPECT_EQ(j["replicas"][1]["microbatches"][0]["real_tokens"], 11);
  EXPECT_EQ(j["replicas"][1]["microbatches"][0]["padded_tokens"], 16);
  // Keys in the documented order.
  const std::string text = StepFiguresJson(*f, true);
  EXPECT_EQ(text.rfind("{\"step\":3,\"epoch\":1,\"num_microbatches\":1,\"n_samples\":4,"
                       "\"n_skipped\":0,\"skipped\":[],\"n_empty\":0,\"n_truncated\":0,"
                       "\"truncated_tokens\":0,\"truncated_targets\":0,\"n_split\":0,"
                       "\"split_pieces\":0,\"split_lost_targets\":0,\"real_tokens\":16,"
                       "\"padded_tokens\":24,"
                       "\"sum_sq\":160,\"n_loss_tokens\":12,",
                       0),
            0u)
      << text;
  EXPECT_EQ(text.find("replicas"), std::string::npos);
}

TEST(StepFigures, TokensCostHasNullFlopsAndExtraFieldsAreAppended) {
  const auto coef = FlopsFromCostSpec("tokens");
  ASSERT_TRUE(coef.ok());
  EXPECT_FALSE(coef->has_value());
  EXPECT_FALSE(FlopsFromCostSpec("1,2")->has_value());
  EXPECT_FALSE(FlopsFromCostSpec("bogus").ok());
  const auto samples = HandSamples();
  auto f = ComputeStepFigures(0, 0, samples, HandOptions(), HandPlan(), std::nullopt);
  ASSERT_TRUE(f.ok());
  const std::vector<std::pair<std::string, std::string>> extra = {{"loss", "2.5"},
                                                                  {"bytes_sent", "[1,2]"}};
  const std::string text = StepFiguresJson(*f, true, extra);
  const auto j = nlohmann::json::parse(text);
  EXPECT_TRUE(j["flops"].is_null());
  EXPECT_DOUBLE_EQ(j["loss"].get<double>(), 2.5);
  EXPECT_EQ(j["bytes_sent"], nlohmann::json({1, 2}));
  // Same figures, same bytes.
  EXPECT_EQ(text, StepFiguresJson(*f, true, extra));
}

TEST(StepFigures, SummaryAndReport) {
  const auto samples = HandSamples();
  const auto coef = FlopsFromCostSpec("llama2-7b");
  ASSERT_TRUE(coef.ok());
  auto a = ComputeStepFigures(0, 0, samples, HandOptions(), HandPlan(), *coef);
  // The second step: the balanced split [10, 13] (P 12) / [11, 12] (P 12): imbalance 1.
  Plan balanced = HandPlan();
  balanced.sample_ids = {10, 13, 11, 12};
  auto b = ComputeStepFigures(1, 0, samples, HandOptions(), balanced, *coef);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_DOUBLE_EQ(b->plan.imbalance, 1.0);
  const std::vector<StepFigures> steps = {*a, *b};
  const SummaryFigures s = Summarize(steps);
  EXPECT_EQ(s.n_steps, 2);
  EXPECT_EQ(s.num_microbatches, 2);
  EXPECT_EQ(s.n_samples, 8);
  EXPECT_EQ(s.real_tokens, 32);
  EXPECT_EQ(s.padded_tokens, 48);
  EXPECT_DOUBLE_EQ(s.sum_sq, 320.0);
  EXPECT_EQ(s.capacity_tokens, 64);
  EXPECT_DOUBLE_EQ(s.mean_imbalance, (8.0 / 6.0 + 1.0) / 2.0);
  EXPECT_DOUBLE_EQ(s.max_imbalance, 8.0 / 6.0);
  EXPECT_DOUBLE_EQ(s.fill, 0.75);
  EXPECT_DOUBLE_EQ(s.flops, 2 * 951544971264.0);
  const auto j = nlohmann::json::parse(PlanReportJson(steps, s, true));
  ASSERT_EQ(j["steps"].size(), 2u);
  EXPECT_EQ(j["steps"][1]["step"], 1);
  EXPECT_FALSE(j["steps"][0].contains("replicas"));
  EXPECT_EQ(j["summary"]["n_samples"], 8);
  EXPECT_DOUBLE_EQ(j["summary"]["pad_fraction"].get<double>(), 1.0 / 3.0);
}

TEST(StepFigures, InvalidPlanIsAnError) {
  const auto samples = HandSamples();
  Plan bad = HandPlan();
  bad.sample_ids = {10, 12, 11, 11};  // 13 missing, 11 twice
  EXPECT_FALSE(ComputeStepFigures(0, 0, samples, HandOptions(), bad, std::nullopt).ok());
}

}  // namespace
}  // namespace thdpack

namespace thdpack {
namespace {

// Random steps through Schedule: sample_ids are the plan's lists, capacity and FLOPs equal a
// plain loop over the samples (P = L rounded up to 2*CP; no SP, so no tail).
TEST(StepFiguresRandom, IdsCapacityAndFlopsMatchAPlainLoop) {
  std::mt19937_64 rng(777);
  const auto coef = FlopsFromCostSpec("llama3-8b");
  ASSERT_TRUE(coef.ok() && coef->has_value());
  for (int trial = 0; trial < 40; ++trial) {
    ScheduleOptions o;
    o.dp_size = 1 + static_cast<int>(rng() % 5);
    const int cp = 1 + static_cast<int>(rng() % 4);
    o.parallel = ParallelLayout::Create(cp).value();
    o.max_tokens_per_rank = 256 + static_cast<int64_t>(rng() % 2048);
    o.scheduler = rng() % 2 ? ScheduleOptions::Scheduler::kBalanced
                            : ScheduleOptions::Scheduler::kSequential;
    const int n = o.dp_size * (1 + static_cast<int>(rng() % 12));
    std::vector<SampleLength> samples;
    for (int i = 0; i < n; ++i) {
      const int64_t len = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(
                                                      o.max_tokens_per_rank * cp - 8));
      samples.push_back({1000 + 3 * i, len, len - 1});
    }
    auto plan = Schedule(samples, o);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    auto f = ComputeStepFigures(trial, 0, samples, o, *plan, *coef);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    const int64_t align = cp > 1 ? 2 * cp : 1;
    double flops = 0;
    for (const SampleLength& s : samples) {
      const double p = static_cast<double>((s.length + align - 1) / align * align);
      flops += static_cast<double>((*coef)->per_token) * p +
               static_cast<double>((*coef)->per_token_sq) * p * p;
    }
    EXPECT_NEAR(f->flops, flops, 1e-9 * flops);
    EXPECT_EQ(f->capacity_tokens, static_cast<int64_t>(plan->num_microbatches) * o.dp_size *
                                      cp * o.max_tokens_per_rank);
    ASSERT_EQ(f->sample_ids.size(), static_cast<size_t>(o.dp_size));
    for (int d = 0; d < o.dp_size; ++d) {
      ASSERT_EQ(f->sample_ids[d].size(), static_cast<size_t>(plan->num_microbatches));
      for (int m = 0; m < plan->num_microbatches; ++m) {
        const auto ids = plan->Microbatch(d, m);
        EXPECT_EQ(f->sample_ids[d][m], std::vector<int64_t>(ids.begin(), ids.end()));
      }
    }
    const auto j = nlohmann::json::parse(StepFiguresJson(*f, false));
    EXPECT_EQ(j["replicas"].size(), static_cast<size_t>(o.dp_size));
    EXPECT_EQ(j["n_samples"], n);
  }
}

}  // namespace
}  // namespace thdpack
