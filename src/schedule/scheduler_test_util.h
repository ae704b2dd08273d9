// Helpers shared by the scheduling tests: random steps, the real data files, and a small
// CSV/lengths reader for them (test-only; the library's data readers live in src/data).
#ifndef THDPACK_SCHEDULE_SCHEDULER_TEST_UTIL_H_
#define THDPACK_SCHEDULE_SCHEDULER_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "thdpack/schedule.h"

namespace thdpack::testing_util {

// The real data file `name` (data/README.md lists them): from $THDPACK_DATA_DIR when set, else
// the repository's data/. It is part of the repository, so a missing file fails the test.
inline std::string DataPath(const std::string& name) {
  const char* env = std::getenv("THDPACK_DATA_DIR");
  const std::string dir = (env != nullptr && *env != '\0') ? env : THDPACK_TEST_DATA_DIR;
  return dir + "/" + name;
}

// `length,count` rows after a header line; empty on any problem (the test then fails).
inline std::vector<HistogramRow> ReadHistogramCsv(const std::string& path) {
  std::ifstream in(path);
  std::vector<HistogramRow> rows;
  std::string line;
  if (!std::getline(in, line)) return {};
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream ss(line);
    HistogramRow row;
    char comma = 0;
    if (!(ss >> row.length >> comma >> row.count) || comma != ',') return {};
    rows.push_back(row);
  }
  return rows;
}

// One length per line.
inline std::vector<int64_t> ReadLengths(const std::string& path) {
  std::ifstream in(path);
  std::vector<int64_t> out;
  int64_t v = 0;
  while (in >> v) out.push_back(v);
  return out;
}

// Samples with ids that are NOT their positions (a shuffled, spread-out set), so tests catch
// index/id mix-ups.
inline std::vector<SampleLength> WithIds(const std::vector<int64_t>& lengths, uint64_t seed) {
  std::vector<int64_t> ids(lengths.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<SampleLength> out(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    out[i] = {ids[i] * 7 + 3, lengths[i], std::max<int64_t>(0, lengths[i] - 1 - (ids[i] % 3))};
  }
  return out;
}

// Long-tailed random lengths in [1, max_length].
inline std::vector<int64_t> RandomLengths(std::mt19937_64& rng, size_t n, int64_t max_length) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> out(n);
  for (auto& l : out) {
    // Log-uniform: many short samples, a few close to max_length.
    const double x = std::exp(u(rng) * std::log(static_cast<double>(max_length)));
    l = std::clamp<int64_t>(static_cast<int64_t>(x), 1, max_length);
  }
  return out;
}

// The integer figures of two plans of the same samples, which every path must give exactly
// (the doubles may differ by the order of summation; each test says how they compare).
inline void ExpectSameIntegerFigures(const PlanFigures& a, const PlanFigures& b) {
  EXPECT_EQ(a.num_microbatches, b.num_microbatches);
  EXPECT_EQ(a.n_samples, b.n_samples);
  EXPECT_EQ(a.n_skipped, b.n_skipped);
  EXPECT_EQ(a.real_tokens, b.real_tokens);
  EXPECT_EQ(a.padded_tokens, b.padded_tokens);
  EXPECT_EQ(a.sum_sq, b.sum_sq);
  EXPECT_EQ(a.n_loss_tokens, b.n_loss_tokens);
}

// Every figure of two plans, the doubles exactly: what the scheduler's own arrays give
// (ScheduleWithFigures) against ComputePlanFigures, the same sums in the same order.
inline void ExpectSameFigures(const PlanFigures& a, const PlanFigures& b) {
  ExpectSameIntegerFigures(a, b);
  // Exactly equal doubles: the same sums in the same order.
  EXPECT_EQ(a.total_cost, b.total_cost);
  EXPECT_EQ(a.encoder_cost, b.encoder_cost);
  EXPECT_EQ(a.max_replica_cost, b.max_replica_cost);
  EXPECT_EQ(a.lower_bound, b.lower_bound);
  EXPECT_EQ(a.imbalance, b.imbalance);
  EXPECT_EQ(a.pad_fraction, b.pad_fraction);
  EXPECT_EQ(a.fill, b.fill);
  EXPECT_EQ(a.max_microbatch_spread, b.max_microbatch_spread);
  ASSERT_EQ(a.replicas.size(), b.replicas.size());
  for (size_t d = 0; d < a.replicas.size(); ++d) {
    EXPECT_EQ(a.replicas[d].cost, b.replicas[d].cost);
    EXPECT_EQ(a.replicas[d].encoder_cost, b.replicas[d].encoder_cost);
    ASSERT_EQ(a.replicas[d].microbatches.size(), b.replicas[d].microbatches.size());
    for (size_t m = 0; m < a.replicas[d].microbatches.size(); ++m) {
      const MicrobatchFigures& x = a.replicas[d].microbatches[m];
      const MicrobatchFigures& y = b.replicas[d].microbatches[m];
      EXPECT_EQ(x.n_samples, y.n_samples);
      EXPECT_EQ(x.real_tokens, y.real_tokens);
      EXPECT_EQ(x.padded_tokens, y.padded_tokens);
      EXPECT_EQ(x.sum_sq, y.sum_sq);
      EXPECT_EQ(x.n_loss_tokens, y.n_loss_tokens);
      EXPECT_EQ(x.cost, y.cost);
      EXPECT_EQ(x.encoder_cost, y.encoder_cost);
    }
  }
}

}  // namespace thdpack::testing_util

#endif  // THDPACK_SCHEDULE_SCHEDULER_TEST_UTIL_H_
