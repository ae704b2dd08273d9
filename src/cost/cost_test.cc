#include "thdpack/cost.h"

#include <gtest/gtest.h>

#include <vector>

namespace thdpack {
namespace {

TEST(CostTest, SumsFromCuSeqlensMatchTheIssueExample) {
  const std::vector<int32_t> cu = {0, 100, 250, 400};
  auto s = SumsFromCuSeqlens(cu);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->count, 3);
  EXPECT_EQ(s->sum, 400);
  EXPECT_EQ(s->sum_sq, 55000);  // 100^2 + 150^2 + 150^2
}

TEST(CostTest, SumsRejectBadOffsets) {
  EXPECT_FALSE(SumsFromCuSeqlens(std::vector<int32_t>{}).ok());
  auto a = SumsFromCuSeqlens(std::vector<int32_t>{1, 4});
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("cu_seqlens[0] = 1"), std::string::npos);
  auto b = SumsFromCuSeqlens(std::vector<int32_t>{0, 4, 3});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("cu_seqlens[2] = 3"), std::string::npos);
}

// A small model worked out by hand: l=2, h=8, n_h=2, n_kv=1, f=16, V=10.
//   per layer: h*h + 2*h*h*n_kv/n_h + h*h + 3*h*f = 64 + 64 + 64 + 384 = 576
//   a = 3 * (2*l*576 + 2*h*V) = 3 * (2304 + 160) = 7392
//   b = 3 * 2*l*h = 96
//   cu_seqlens [0,100,250,400]: 7392*400 + 96*55000 = 2,956,800 + 5,280,000 = 8,236,800
TEST(CostTest, FlopsOfASmallModelByHand) {
  const ModelDims dims{2, 8, 2, 1, 16, 10};
  auto c = ComputeFlopsCoefficients(dims);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->per_token, 7392);
  EXPECT_EQ(c->per_token_sq, 96);
  EXPECT_EQ(TrainingFlops(*c, 400, 55000.0), 8236800.0);
}

// Llama-2 7B by hand: h*h = 16,777,216; 2*h*h*32/32 = 33,554,432; 3*h*f = 135,266,304;
// per layer 202,375,168; 2*l*that = 12,952,010,752; 2*h*V = 262,144,000;
// a = 3 * 13,214,154,752 = 39,642,464,256; b = 6*32*4096 = 786,432.
TEST(CostTest, Llama2Coefficients) {
  auto c = ComputeFlopsCoefficients(kLlama2_7B);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->per_token, 39642464256);
  EXPECT_EQ(c->per_token_sq, 786432);
}

// Llama-3 8B (GQA, n_kv = 8): 2*h*h*8/32 = 8,388,608; 3*h*f = 176,160,768;
// per layer 16,777,216*2 + 8,388,608 + 176,160,768 = 218,103,808; 2*32*that = 13,958,643,712;
// 2*h*V = 1,050,673,152; a = 3 * 15,009,316,864 = 45,027,950,592.
TEST(CostTest, Llama3Coefficients) {
  auto c = ComputeFlopsCoefficients(kLlama3_8B);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->per_token, 45027950592);
  EXPECT_EQ(c->per_token_sq, 786432);
}

TEST(CostTest, ParseCostSpec) {
  auto tokens = ParseCostSpec("tokens");
  ASSERT_TRUE(tokens.ok());
  EXPECT_EQ(tokens->a, 1.0);
  EXPECT_EQ(tokens->b, 0.0);
  EXPECT_EQ(tokens->SequenceCost(100), 100.0);

  auto ab = ParseCostSpec("2,0.5");
  ASSERT_TRUE(ab.ok());
  EXPECT_EQ(ab->SequenceCost(10), 2.0 * 10 + 0.5 * 100);

  auto llama = ParseCostSpec("llama2-7b");
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ(llama->a, 39642464256.0);
  EXPECT_EQ(llama->b, 786432.0);
  EXPECT_EQ(llama->name, "llama2-7b");

  auto dims = ParseCostSpec("l=2,h=8,nh=2,nkv=1,f=16,v=10");
  ASSERT_TRUE(dims.ok()) << dims.status().ToString();
  EXPECT_EQ(dims->a, 7392.0);
  EXPECT_EQ(dims->b, 96.0);
  auto d = ParseModelDims("l=2,h=8,nh=2,nkv=1,f=16,v=10");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ffn_hidden, 16);
  EXPECT_EQ(ParseModelDims("tokens").status().code(), StatusCode::kNotFound);
}

TEST(CostTest, ParseCostSpecErrorsNameTheProblem) {
  struct Case {
    const char* spec;
    const char* expect;
  };
  const Case cases[] = {
      {"llama9", "is not one of"},
      {"1,x", "is not one of"},
      {"-1,2", "must be >= 0"},
      {"0,0", "not both 0"},
      {"l=2,h=8,nh=2,nkv=1,f=16", "missing key \"v\""},
      {"l=2,h=8,nh=3,nkv=1,f=16,v=10", "hidden 8 must be divisible by heads 3"},
      {"l=2,h=8,nh=2,nkv=1,f=16,v=10,q=1", "unknown key \"q\""},
      {"l=2,l=2", "given twice"},
      {"l=x", "is not key=integer"},
      {"l=0,h=8,nh=2,nkv=1,f=16,v=10", "layers = 0 must be >= 1"},
  };
  for (const Case& c : cases) {
    auto r = ParseCostSpec(c.spec);
    ASSERT_FALSE(r.ok()) << c.spec;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
        << c.spec << " -> " << r.status().message();
    EXPECT_NE(r.status().message().find(c.spec), std::string::npos) << r.status().message();
  }
}

TEST(CostTest, OverflowIsReported) {
  const ModelDims huge{1 << 30, 1 << 30, 1, 1, 1 << 30, 1 << 30};
  auto c = ComputeFlopsCoefficients(huge);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace thdpack
