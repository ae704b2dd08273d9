// Cross-area: the scheduler's padding rule (thdpack/schedule.h) equals the packer's layout
// (thdpack/pack.h). schedule does not use pack, so this test lives here, not beside either.
#include <gtest/gtest.h>

#include <random>

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
    po.cp_size = 1 + static_cast<int>(rng() % 4);
    po.tp_size = 1 + static_cast<int>(rng() % 6);
    po.sp = rng() % 2;
    po.extra_alignment = 1 + static_cast<int64_t>(rng() % 3);
    const auto lengths = RandomLengths(rng, 1 + rng() % 6, 300);
    auto layout = ComputeLayout(lengths, po);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    int64_t sum = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      const int64_t p = PaddedSequenceLength(lengths[i], po.cp_size, po.extra_alignment);
      if (i + 1 < lengths.size()) {
        EXPECT_EQ(layout->cu_seqlens_padded[i + 1] - layout->cu_seqlens_padded[i], p);
      }
      sum += p;
    }
    EXPECT_EQ(layout->total_tokens,
              MicrobatchPaddedTokens(sum, po.cp_size, po.tp_size, po.sp, po.extra_alignment))
        << "cp " << po.cp_size << " tp " << po.tp_size << " sp " << po.sp;
  }
}

}  // namespace
}  // namespace thdpack
