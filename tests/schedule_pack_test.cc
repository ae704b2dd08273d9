// Cross-area: the padding rule the scheduler budgets with (thdpack/parallel_layout.h) is the
// one the packer's layout applies (thdpack/pack.h). schedule does not use pack, so this test lives here, not beside either.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "schedule/scheduler_test_util.h"
#include "thdpack/pack.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

using testing_util::RandomLengths;

// The rule must equal the packing code's ComputeLayout (pack.h).
TEST(SchedulePaddingTest, EqualsPackComputeLayout) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    PackOptions po;
    const int cp = 1 + static_cast<int>(rng() % 4);
    const int tp = 1 + static_cast<int>(rng() % 6);
    const bool sp = rng() % 2;
    po.parallel = ParallelLayout::Create(cp, tp, sp, 1 + static_cast<int64_t>(rng() % 3),
                                         std::vector<int64_t>{1, 2, 16, 128}[rng() % 4])
                      .value();
    const auto lengths = RandomLengths(rng, 1 + rng() % 6, 300);
    auto layout = ComputeLayout(lengths, po);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    int64_t sum = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const int64_t p = po.parallel.PaddedLength(lengths[i]);
      if (i + 1 < lengths.size()) {
        EXPECT_EQ(layout->cu_seqlens_padded[i + 1] - layout->cu_seqlens_padded[i], p);
      }
      sum += p;
    }
    EXPECT_EQ(layout->total_tokens, po.parallel.MicrobatchTokens(sum)) << po.parallel.ToString();
  }
}

}  // namespace
}  // namespace thdpack
