// The sequential scheduler against Megatron-LM's dp_balanced, on cases worked by hand from its
// algorithm (DpBalancedScheduler.get_groups_and_subsamples): next-fit in arrival order, then
// the rearmost multi-sample group gives its last sample to a new group at the end until the
// group count is a multiple of DP*k, then group m*DP + d -> replica d, microbatch m.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "thdpack/schedule.h"

namespace thdpack {
namespace {

using Ids = std::vector<int64_t>;

// Sample i has id 100 + i.
std::vector<SampleLength> Samples(const std::vector<int64_t>& lengths) {
  std::vector<SampleLength> out;
  for (size_t i = 0; i < lengths.size(); ++i) {
    out.push_back({100 + static_cast<int64_t>(i), lengths[i], lengths[i] - 1});
  }
  return out;
}

ScheduleOptions Sequential(int dp, int64_t budget, int k = 1) {
  ScheduleOptions o;
  o.scheduler = ScheduleOptions::Scheduler::kSequential;
  o.dp_size = dp;
  o.max_tokens_per_rank = budget;
  o.microbatch_multiple = k;
  return o;
}

Ids Mb(const Plan& p, int d, int m) {
  auto s = p.Microbatch(d, m);
  return Ids(s.begin(), s.end());
}

// No padding needed: next-fit makes exactly DP groups.
TEST(SequentialTest, NextFitGroupsInArrivalOrder) {
  const auto samples = Samples({5, 5, 5, 5});
  auto p = Schedule(samples, Sequential(2, 10));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_microbatches, 1);
  EXPECT_EQ(Mb(*p, 0, 0), (Ids{100, 101}));
  EXPECT_EQ(Mb(*p, 1, 0), (Ids{102, 103}));
}

// lengths 3,3,3,3,3, budget 8, DP=2: next-fit [0,1] [2,3] [4] (G=3); pad to 4: group 2 is a
// single sample, group 1 gives its last sample: [0,1] [2] [4] [3]. Group m*2+d -> (d, m).
TEST(SequentialTest, RearmostMultiSampleGroupDonates) {
  auto p = Schedule(Samples({3, 3, 3, 3, 3}), Sequential(2, 8));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_microbatches, 2);
  EXPECT_EQ(Mb(*p, 0, 0), (Ids{100, 101}));
  EXPECT_EQ(Mb(*p, 1, 0), (Ids{102}));
  EXPECT_EQ(Mb(*p, 0, 1), (Ids{104}));
  EXPECT_EQ(Mb(*p, 1, 1), (Ids{103}));
}

// The case where Megatron's older code asserts "Not enough samples to move" (`assert i > 0`):
// only group 0 can donate. lengths 4,4,4, budget 12, DP=3: next-fit [0,1,2]; group 0 gives 2,
// then 1: [0] [2] [1].
TEST(SequentialTest, GroupZeroDonatesInsteadOfAsserting) {
  auto p = Schedule(Samples({4, 4, 4}), Sequential(3, 12));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_microbatches, 1);
  EXPECT_EQ(Mb(*p, 0, 0), (Ids{100}));
  EXPECT_EQ(Mb(*p, 1, 0), (Ids{102}));
  EXPECT_EQ(Mb(*p, 2, 0), (Ids{101}));
}

// With k: DP=2, k=2, lengths 2,2,2,2, budget 8: one group [0,1,2,3] padded to 4 groups:
// [0] [3] [2] [1] -> replica 0: m0 [0], m1 [2]; replica 1: m0 [3], m1 [1].
TEST(SequentialTest, PadsToAMultipleOfDpTimesK) {
  auto p = Schedule(Samples({2, 2, 2, 2}), Sequential(2, 8, 2));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_microbatches, 2);
  EXPECT_EQ(Mb(*p, 0, 0), (Ids{100}));
  EXPECT_EQ(Mb(*p, 0, 1), (Ids{102}));
  EXPECT_EQ(Mb(*p, 1, 0), (Ids{103}));
  EXPECT_EQ(Mb(*p, 1, 1), (Ids{101}));
}

// A donor may give several samples: lengths 1,1,1,1,6,6 budget 6, DP=4: next-fit
// [0,1,2,3] [4] [5] (G=3 -> 4): groups 2 and 1 are single, group 0 gives 3: [0,1,2] [4] [5] [3].
// Five samples of 6 with DP=4: next-fit makes 5 single-sample groups, padded to 8 needs 8
// samples: "too few samples" (Megatron: the assert), although 5 >= DP*k.
TEST(SequentialTest, WalksBackOverSingleSampleGroups) {
  auto p = Schedule(Samples({1, 1, 1, 1, 6, 6}), Sequential(4, 6));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(Mb(*p, 0, 0), (Ids{100, 101, 102}));
  EXPECT_EQ(Mb(*p, 1, 0), (Ids{104}));
  EXPECT_EQ(Mb(*p, 2, 0), (Ids{105}));
  EXPECT_EQ(Mb(*p, 3, 0), (Ids{103}));

  auto q = Schedule(Samples({6, 6, 6, 6, 6}), Sequential(4, 6));
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("too few samples: 5 samples cannot fill 8"),
            std::string::npos)
      << q.status().ToString();
}

// Fixed M: the group count is padded to M*DP. DP=2, M=2, lengths 3,3,3,3, budget 12: one
// group, padded to 4: [0] [3] [2] [1].
TEST(SequentialTest, FixedNumberOfMicrobatches) {
  ScheduleOptions o = Sequential(2, 12);
  o.num_microbatches = 2;
  auto p = Schedule(Samples({3, 3, 3, 3}), o);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->num_microbatches, 2);
  EXPECT_EQ(Mb(*p, 0, 0), (Ids{100}));
  EXPECT_EQ(Mb(*p, 0, 1), (Ids{102}));
  EXPECT_EQ(Mb(*p, 1, 0), (Ids{103}));
  EXPECT_EQ(Mb(*p, 1, 1), (Ids{101}));

  // A fixed M smaller than next-fit needs is an error that says so.
  o.num_microbatches = 1;
  auto q = Schedule(Samples({9, 9, 9, 9}), o);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("needs 4 microbatches"), std::string::npos)
      << q.status().ToString();
}

// Megatron balances microbatch COUNTS, not cost: arrival order decides. DP=2, budget 10,
// lengths 10,5,5 repeated: next-fit makes [10] [5,5] [10] [5,5] ..., so every even group - all
// the long samples - lands on replica 0.
TEST(SequentialTest, IgnoresCostAsMegatronDoes) {
  ScheduleOptions o = Sequential(2, 10);
  o.cost.b = 1.0;
  const auto samples = Samples({10, 5, 5, 10, 5, 5, 10, 5, 5, 10, 5, 5});
  // next-fit: [10] [5,5] [10] [5,5] ... -> groups 0,2,4,6 (the 10s) all on replica 0.
  auto p = Schedule(samples, o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->num_microbatches, 4);
  for (int m = 0; m < 4; ++m) EXPECT_EQ(Mb(*p, 0, m).size(), 1u);
  auto f = ComputePlanFigures(samples, o, *p);
  ASSERT_TRUE(f.ok());
  EXPECT_DOUBLE_EQ(f->replicas[0].cost, 4 * (10 + 100));
  EXPECT_DOUBLE_EQ(f->replicas[1].cost, 8 * (5 + 25));
}

}  // namespace
}  // namespace thdpack
