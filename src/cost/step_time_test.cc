// The step-time model against values worked out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "thdpack/cost.h"

namespace thdpack {
namespace {

// The small model of cost_test.cc: l=2, h=8, n_h=2, n_kv=1, f=16, V=10: a = 7392, b = 96, and
// K+V bytes a token over all layers l * 4*h*n_kv/n_h = 2 * 4*8*1/2 = 32. Hardware R = 1000
// FLOP/s, B = 10 bytes/s.
//   P = 100: F = 7392*100 + 96*100^2 = 739,200 + 960,000 = 1,699,200 -> 1699.2 s on one rank
//   c = 2: compute 849.6, X = 3 * 1/2 * 100 * 32 / 10 = 480  -> 849.6 (compute-bound)
//   c = 4: compute 424.8, X = 3 * 3/4 * 100 * 32 / 10 = 720  -> 720   (exchange-bound)
TEST(StepTimeTest, SequenceSecondsByHand) {
  auto hw = ParseHardwareSpec("1000,10");
  ASSERT_TRUE(hw.ok()) << hw.status().ToString();
  auto m = StepTimeModel::Create(ModelDims{2, 8, 2, 1, 16, 10}, *hw);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_DOUBLE_EQ(m->SequenceCompute(100), 1699.2);
  EXPECT_DOUBLE_EQ(m->SequenceSeconds(100, 1), 1699.2);
  EXPECT_DOUBLE_EQ(m->ExchangeSeconds(100, 1), 0.0);
  EXPECT_DOUBLE_EQ(m->ExchangeSeconds(100, 2), 480.0);
  EXPECT_DOUBLE_EQ(m->SequenceSeconds(100, 2), 849.6);
  EXPECT_DOUBLE_EQ(m->ExchangeSeconds(100, 4), 720.0);
  EXPECT_DOUBLE_EQ(m->SequenceSeconds(100, 4), 720.0);
}

// Llama-2 7B on h100-ib, P = 32768 on c = 4: F = 39,642,464,256 * 32768 + 786,432 * 32768^2
// = 1.2990e15 + 8.4442e14 = 2.14343e15; compute 2.14343e15 / (4 * 400e12) = 1.33964 s;
// X = 3 * 3/4 * 32768 * 32 * 4*4096 / 25e9 = 1.54619 s.
TEST(StepTimeTest, Llama2OnInfiniBand) {
  auto hw = ParseHardwareSpec("h100-ib");
  ASSERT_TRUE(hw.ok());
  EXPECT_EQ(hw->flops_per_second, 400e12);
  EXPECT_EQ(hw->link_bytes_per_second, 25e9);
  auto m = StepTimeModel::Create(kLlama2_7B, *hw);
  ASSERT_TRUE(m.ok());
  const double f = 39642464256.0 * 32768 + 786432.0 * 32768.0 * 32768.0;
  EXPECT_NEAR(m->SequenceCompute(32768), f / 400e12, 1e-12 * f / 400e12);
  const double x = 3.0 * 0.75 * 32768 * 32 * 4 * 4096 / 25e9;
  EXPECT_NEAR(x, 1.54619, 1e-5);
  EXPECT_DOUBLE_EQ(m->SequenceSeconds(32768, 4), x);
  EXPECT_NEAR(f / 1600e12, 1.33964, 1e-5);
  auto nv = ParseHardwareSpec("h100-nvlink");
  ASSERT_TRUE(nv.ok());
  EXPECT_EQ(nv->link_bytes_per_second, 200e9);
  auto mn = StepTimeModel::Create(kLlama2_7B, *nv);
  ASSERT_TRUE(mn.ok());
  // Compute-bound on NVLink.
  EXPECT_NEAR(mn->SequenceSeconds(32768, 4), f / 1600e12, 1e-12 * f / 1600e12);
}

// The model from coefficients (a measured profile's): a = 1e-6 s a token, b = 1e-9 s a squared
// token, s = 2e-3 s a sequence, m = 5e-3 s a microbatch, no exchange.
//   P = 1000: C = 1e-3 + 1e-3 + 2e-3 = 4e-3 s; on c = 2: 2e-3 s (no exchange term).
//   A group of P = 1000, 1000, 500 on c = 2: (1e-6 * 2500 + 1e-9 * 2.25e6 + 2e-3 * 3) / 2 + 5e-3
//   = (2.5e-3 + 2.25e-3 + 6e-3) / 2 + 5e-3 = 0.010375 s.
TEST(StepTimeTest, FromCoefficientsByHand) {
  StepTimeCoefficients k;
  k.seconds_per_token = 1e-6;
  k.seconds_per_token_sq = 1e-9;
  k.seconds_per_sequence = 2e-3;
  k.seconds_per_microbatch = 5e-3;
  k.name = "by hand";
  auto m = StepTimeModel::Create(k);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_DOUBLE_EQ(m->SequenceCompute(1000), 4e-3);
  EXPECT_DOUBLE_EQ(m->SequenceSeconds(1000, 2), 2e-3);
  EXPECT_EQ(m->ExchangeSeconds(1000, 2), 0.0);
  EXPECT_FALSE(m->ExchangeBound(1000, 8));
  EXPECT_DOUBLE_EQ(m->GroupSeconds(2, 3, 2500, 2.25e6, 0, 0), 0.010375);
  EXPECT_DOUBLE_EQ(m->GroupSeconds(2, 0, 0, 0, 0, 0), 0.0);  // an idle group costs nothing
  // With an exchange (32 bytes a token at 10 bytes/s), P = 1000 on c = 4 is exchange-bound:
  // X = 3 * 3/4 * 1000 * 32 / 10 = 7200 s; the group of it alone: 7200 + m.
  k.kv_bytes_per_token = 32;
  k.link_bytes_per_second = 10;
  auto x = StepTimeModel::Create(k);
  ASSERT_TRUE(x.ok());
  EXPECT_TRUE(x->ExchangeBound(1000, 4));
  EXPECT_DOUBLE_EQ(x->SequenceSeconds(1000, 4), 7200.0);
  EXPECT_DOUBLE_EQ(x->GroupSeconds(4, 0, 0, 0, 1, 1000), 7200.0 + 5e-3);
}

TEST(StepTimeTest, BadCoefficientsNameTheField) {
  StepTimeCoefficients ok;
  ok.seconds_per_token = 1e-6;
  ok.name = "m";
  ASSERT_TRUE(StepTimeModel::Create(ok).ok());
  struct Case {
    double StepTimeCoefficients::*field;
    double value;
    const char* says;
  };
  const Case cases[] = {
      {&StepTimeCoefficients::seconds_per_token, -1, "seconds per token"},
      {&StepTimeCoefficients::seconds_per_token_sq, std::nan(""), "seconds per squared token"},
      {&StepTimeCoefficients::seconds_per_sequence, -1e-3, "seconds per sequence"},
      {&StepTimeCoefficients::seconds_per_microbatch, 1.0 / 0.0, "seconds per microbatch"},
      {&StepTimeCoefficients::kv_bytes_per_token, 32, "link bandwidth"},
  };
  for (const Case& c : cases) {
    StepTimeCoefficients k = ok;
    k.*c.field = c.value;
    auto m = StepTimeModel::Create(k);
    ASSERT_FALSE(m.ok()) << c.says;
    EXPECT_NE(m.status().message().find(c.says), std::string::npos) << m.status().message();
  }
  StepTimeCoefficients zero;
  zero.seconds_per_microbatch = 1;
  EXPECT_FALSE(StepTimeModel::Create(zero).ok());  // no compute coefficient
}

TEST(StepTimeTest, BadHardwareSpecsNameTheSpec) {
  for (const char* bad : {"", "h100", "1,0", "0,1", "-1,2", "1,", "a,b", "1,2,3", "nan,1"}) {
    auto hw = ParseHardwareSpec(bad);
    ASSERT_FALSE(hw.ok()) << bad;
    EXPECT_NE(hw.status().message().find("\"" + std::string(bad) + "\""), std::string::npos);
  }
}

// Domain of 4 ranks. Microbatch 0: {0,1} 3 s, {2} 1 s, {3} 2 s. Microbatch 1: {1,2} 1 s starts
// at max(3, 1) = 3, ends 4; {0} 5 s starts at 3, ends 8; rank 3 idle (ends 2). Step: 8 s.
TEST(StepTimeTest, SimulateByHand) {
  const std::vector<GroupTask> tasks = {{0, 2, 3.0}, {2, 1, 1.0}, {3, 1, 2.0},
                                        {1, 2, 1.0}, {0, 1, 5.0}};
  auto t = SimulateStepTime(4, tasks);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_DOUBLE_EQ(*t, 8.0);
  // Microbatch 2: {0,1,2,3} 1 s waits for rank 0 (8): ends 9.
  std::vector<GroupTask> more = tasks;
  more.push_back({0, 4, 1.0});
  EXPECT_DOUBLE_EQ(*SimulateStepTime(4, more), 9.0);
  EXPECT_DOUBLE_EQ(*SimulateStepTime(4, {}), 0.0);
}

// A static plan (every replica one group in every microbatch) takes its largest replica's sum.
TEST(StepTimeTest, StaticPlanIsTheLargestReplicaSum) {
  // DP = 3 replicas of CP = 2 over a domain of 6; replica sums 1+2+3 = 6, 4+0.5+0.5 = 5, 7.
  const double c[3][3] = {{1, 2, 3}, {4, 0.5, 0.5}, {2, 2, 3}};
  std::vector<GroupTask> tasks;
  for (int m = 0; m < 3; ++m) {
    for (int d = 0; d < 3; ++d) tasks.push_back({2 * d, 2, c[d][m]});
  }
  EXPECT_DOUBLE_EQ(*SimulateStepTime(6, tasks), 7.0);
}

TEST(StepTimeTest, SimulateRejectsBadTasks) {
  EXPECT_FALSE(SimulateStepTime(0, {}).ok());
  for (const GroupTask& t : {GroupTask{3, 2, 1.0}, GroupTask{-1, 1, 1.0}, GroupTask{0, 0, 1.0},
                             GroupTask{0, 1, -1.0}}) {
    const std::vector<GroupTask> v = {{0, 1, 1.0}, t};
    auto r = SimulateStepTime(4, v);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("task 1"), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace thdpack
