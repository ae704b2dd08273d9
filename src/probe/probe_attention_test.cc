// The probe's vectorised attention against the plain row loop, and its exponential against
// std::exp, on fresh random inputs.
#include "probe/probe_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "probe/probe_internal.h"

namespace thdpack::probe_internal {
namespace {

TEST(ProbeAttentionTest, ExpNonPositiveIsExpToAFewUlps) {
  std::random_device seed_source;
  const uint64_t seed = seed_source();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> wide(-700, 0), narrow(-2, 0);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const double x = i % 2 ? wide(rng) : narrow(rng);
    const double want = std::exp(x);
    const double got = ExpNonPositive(x);
    worst = std::max(worst, std::abs(got - want) / want);
  }
  EXPECT_LT(worst, 1e-15);  // a few ulps
  EXPECT_EQ(ExpNonPositive(0.0), 1.0);
  EXPECT_EQ(ExpNonPositive(-0.0), 1.0);
  EXPECT_NEAR(ExpNonPositive(-1e-300), 1.0, 1e-16);
  EXPECT_NEAR(ExpNonPositive(-700.0) / std::exp(-700.0), 1.0, 1e-15);
  // Below -700 (and -inf): exp(-700), a term 300 orders below the largest of a softmax.
  EXPECT_EQ(ExpNonPositive(-1000.0), ExpNonPositive(-700.0));
  EXPECT_EQ(ExpNonPositive(-std::numeric_limits<double>::infinity()), ExpNonPositive(-700.0));
}

TEST(ProbeAttentionTest, FastRowEqualsThePlainRowOnRandomInputs) {
  std::random_device seed_source;
  const uint64_t seed = seed_source();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> z(0, 1);
  std::vector<double> scores_plain, scores_fast;
  for (int trial = 0; trial < 200; ++trial) {
    const int heads = 1 + static_cast<int>(rng() % 4);
    const int d = std::vector<int>{1, 2, 3, 8, 16}[rng() % 5];
    const int hidden = heads * d;
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 300);
    // Scores of very different sizes: some rows make the softmax almost one-hot.
    const double spread = std::vector<double>{0.1, 1, 10, 50}[rng() % 4];
    std::vector<double> k(static_cast<size_t>(rows * hidden)), v(k.size()),
        q(static_cast<size_t>(hidden));
    for (double& x : k) x = z(rng) * spread;
    for (double& x : v) x = z(rng);
    for (double& x : q) x = z(rng);
    HeadMajorKv kv;
    kv.Assign(k.data(), v.data(), rows, heads, d);
    const int64_t start = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows));
    const int64_t n = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(rows - start));
    std::vector<double> plain(static_cast<size_t>(hidden)), fast(plain.size());
    AttendRow(q.data(), &k[static_cast<size_t>(start * hidden)],
              &v[static_cast<size_t>(start * hidden)], n, heads, d, plain.data(), scores_plain);
    AttendRowFast(q.data(), kv, start, n, fast.data(), scores_fast);
    // The pair: this row, and a second query over at least as many keys.
    std::vector<double> q2(static_cast<size_t>(hidden));
    for (double& x : q2) x = z(rng);
    const int64_t n2 = n + static_cast<int64_t>(rng() % static_cast<uint64_t>(rows - start - n + 1));
    std::vector<double> plain2(plain.size()), pair_a(plain.size()), pair_b(plain.size());
    AttendRow(q2.data(), &k[static_cast<size_t>(start * hidden)],
              &v[static_cast<size_t>(start * hidden)], n2, heads, d, plain2.data(), scores_plain);
    AttendTwoRowsFast(q.data(), q2.data(), kv, start, n, n2, pair_a.data(), pair_b.data(),
                      scores_fast);
    // One head range only leaves the other heads untouched.
    const int h0 = static_cast<int>(rng() % static_cast<uint64_t>(heads));
    std::vector<double> part(plain.size(), 7.0);
    AttendRowFast(q.data(), kv, start, n, part.data(), scores_fast, h0, h0 + 1);
    for (int c = 0; c < hidden; ++c) {
      EXPECT_NEAR(pair_a[static_cast<size_t>(c)], plain[static_cast<size_t>(c)], 1e-12);
      EXPECT_NEAR(pair_b[static_cast<size_t>(c)], plain2[static_cast<size_t>(c)], 1e-12);
      if (c / d == h0) {
        EXPECT_NEAR(part[static_cast<size_t>(c)], plain[static_cast<size_t>(c)], 1e-12);
      } else {
        EXPECT_EQ(part[static_cast<size_t>(c)], 7.0);
      }
    }
    for (int c = 0; c < hidden; ++c) {
      // The output is a convex combination of values of size ~1: an absolute tolerance.
      EXPECT_NEAR(fast[static_cast<size_t>(c)], plain[static_cast<size_t>(c)], 1e-12)
          << "trial " << trial << " heads " << heads << " d " << d << " start " << start
          << " n " << n << " column " << c;
    }
  }
}

TEST(ProbeAttentionTest, RowTimesMatrixEqualsThePlainSumOnRandomInputs) {
  std::random_device seed_source;
  const uint64_t seed = seed_source();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> z(0, 1);
  for (int trial = 0; trial < 300; ++trial) {
    const int in = 1 + static_cast<int>(rng() % 70);
    const int64_t cols = 1 + static_cast<int64_t>(rng() % 90);  // tails of every kind
    const int64_t stride = cols + static_cast<int64_t>(rng() % 5);
    std::vector<double> x(static_cast<size_t>(in)), w(static_cast<size_t>(in * stride));
    for (double& v : x) v = z(rng);
    for (double& v : w) v = z(rng);
    std::vector<double> got(static_cast<size_t>(cols), -1.0);
    RowTimesMatrix(x.data(), w.data(), in, stride, cols, got.data());
    for (int64_t c = 0; c < cols; ++c) {
      double want = 0, scale = 0;
      for (int k = 0; k < in; ++k) {
        want += x[static_cast<size_t>(k)] * w[static_cast<size_t>(k * stride + c)];
        scale += std::abs(x[static_cast<size_t>(k)] * w[static_cast<size_t>(k * stride + c)]);
      }
      EXPECT_NEAR(got[static_cast<size_t>(c)], want, 1e-14 * std::max(1.0, scale))
          << "trial " << trial << " in " << in << " cols " << cols << " column " << c;
    }
  }
}

}  // namespace
}  // namespace thdpack::probe_internal
