// The blending rule: LargestErrorRule against the plain transcription of Megatron's loop
// (LargestErrorReference) on fresh random weights - up to thousands of sources, ties (equal
// weights, weights in simple ratios), weights of very different sizes, by samples and by
// tokens - and a rule rebuilt from its counts continuing exactly; NormalizeWeights against a
// long-double sum.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "thdpack/blend.h"

namespace thdpack {
namespace {

std::vector<double> RandomWeights(std::mt19937_64& rng, int d, int kind) {
  std::vector<double> w(static_cast<size_t>(d));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& x : w) {
    switch (kind) {
      case 0: x = u(rng) + 1e-3; break;                                     // spread
      case 1: x = 1.0; break;                                               // all tied
      case 2: x = static_cast<double>(1 + rng() % 4); break;                // simple ratios
      case 3: x = std::pow(10.0, -9.0 * u(rng)); break;                     // 1e-9 .. 1
      default: x = rng() % 10 == 0 ? 1000.0 : 1e-6 * (1 + rng() % 3); break;  // a few heavy
    }
  }
  return w;
}

// Runs `steps` choices of the rule and of the reference side by side.
void Compare(const std::vector<double>& raw, int64_t steps, bool tokens, std::mt19937_64& rng,
             const std::string& what) {
  const std::vector<double> w = NormalizeWeights(raw);
  auto rule = LargestErrorRule::Create(w);
  ASSERT_TRUE(rule.ok()) << rule.status().ToString();
  std::vector<int64_t> counts(w.size(), 0);
  int64_t n = 0;
  for (int64_t i = 0; i < steps; ++i) {
    const int want = LargestErrorReference(w, counts, n);
    const int got = rule->Next();
    ASSERT_EQ(got, want) << what << ": step " << i << " (position " << n << ")";
    const int64_t amount = tokens ? 1 + static_cast<int64_t>(rng() % 3000) : 1;
    counts[static_cast<size_t>(want)] += amount;
    n += amount;
    rule->Take(got, amount);
    // Now and then, a rule rebuilt from the counts (a resumed state) continues alike.
    if (rng() % 997 == 0) {
      auto rebuilt = LargestErrorRule::Create(w, counts, n);
      ASSERT_TRUE(rebuilt.ok());
      *rule = std::move(*rebuilt);
    }
  }
  EXPECT_EQ(rule->counts(), counts);
  EXPECT_EQ(rule->position(), n);
}

TEST(BlendRuleTest, EqualsTheReferenceOnRandomWeights) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int sizes[] = {1, 2, 3, 5, 17, 63, 64, 65, 100, 257, 1000};
  for (int d : sizes) {
    for (int kind = 0; kind < 5; ++kind) {
      for (bool tokens : {false, true}) {
        const std::string what = "D " + std::to_string(d) + " kind " + std::to_string(kind) +
                                 (tokens ? " by tokens" : " by samples");
        const int64_t steps = d >= 257 ? 5000 : 6000;
        Compare(RandomWeights(rng, d, kind), steps, tokens, rng, what);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Long runs of a few sources: the positions where float64 rounding decides ties are far out.
TEST(BlendRuleTest, EqualsTheReferenceFarOut) {
  std::mt19937_64 rng(20261127);
  for (int d : {16, 70, 300}) {
    const std::vector<double> w = NormalizeWeights(RandomWeights(rng, d, 2));
    // Start at a large position, the counts those of the exact shares, rounded.
    std::vector<int64_t> counts(w.size());
    int64_t n = 0;
    for (size_t k = 0; k < w.size(); ++k) {
      counts[k] = static_cast<int64_t>(w[k] * 1e12);
      n += counts[k];
    }
    auto rule = LargestErrorRule::Create(w, counts, n);
    ASSERT_TRUE(rule.ok());
    for (int i = 0; i < 30000; ++i) {
      const int want = LargestErrorReference(w, counts, n);
      ASSERT_EQ(rule->Next(), want) << "D " << d << " step " << i;
      counts[static_cast<size_t>(want)] += 1;
      ++n;
      rule->Take(want, 1);
    }
  }
}

TEST(BlendRuleTest, NormalizeWeightsSumsInNumpysOrder) {
  // Below 8 values, one accumulator from 0.
  EXPECT_EQ(NormalizeWeights(std::vector<double>{1, 1, 2}), (std::vector<double>{0.25, 0.25, 0.5}));
  // The sum is within rounding of the exact one for any size, and exact for integers.
  std::mt19937_64 rng(3);
  for (int n : {1, 7, 8, 9, 127, 128, 129, 300, 1000}) {
    std::vector<double> w(static_cast<size_t>(n));
    long double exact = 0;
    for (auto& x : w) {
      x = static_cast<double>(1 + rng() % 1000);
      exact += x;
    }
    const std::vector<double> out = NormalizeWeights(w);
    for (size_t k = 0; k < w.size(); ++k) {
      EXPECT_EQ(out[k], w[k] / static_cast<double>(exact)) << "n " << n;
    }
  }
}

TEST(BlendRuleTest, RefusesBadWeights) {
  for (double bad : {0.0, -1.0, std::nan(""), static_cast<double>(INFINITY)}) {
    auto r = LargestErrorRule::Create({0.5, bad});
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("weights[1]"), std::string::npos) << r.status().ToString();
  }
  EXPECT_FALSE(LargestErrorRule::Create({}).ok());
  EXPECT_FALSE(LargestErrorRule::Create({1.0}, {1, 2}).ok());
  EXPECT_FALSE(LargestErrorRule::Create({1.0}, {-1}).ok());
}

}  // namespace
}  // namespace thdpack
