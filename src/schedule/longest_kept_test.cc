// LongestKept against the schedulers themselves: on fresh random options (CP, TP, SP, extra
// alignment, rank multiple, budgets, DP, both size sets of the dynamic scheduler), a sample of
// the longest kept length is scheduled and one token more is the oversize one the policy
// leaves out.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "thdpack/schedule.h"

namespace thdpack {
namespace {

// Scheduled with the skip policy beside short samples of one token: whether the sample of
// `length` was kept. The static schedulers refuse a step with fewer samples than microbatches
// (M per replica, M = ceil(padded tokens / (DP * budget)), each non-empty): when a short sample
// pads to the whole budget, DP * M is the number of samples kept rounded up to a multiple of DP,
// so whether 2 DP or 2 DP - 1 shorts give a plan depends on whether the long sample is kept.
// Both are tried; the "too few samples" refusal is the only error allowed, and the counts that
// give a plan must agree.
bool Kept(const ScheduleOptions& base, int64_t length) {
  ScheduleOptions o = base;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  std::optional<bool> kept;
  for (int shorts : {2 * o.dp_size, 2 * o.dp_size - 1}) {
    std::vector<SampleLength> samples;
    for (int d = 0; d < shorts; ++d) samples.push_back({100 + d, 1, 0});
    samples.push_back({7, length, length - 1});
    Result<bool> got = Status::Internal("unset");
    if (o.scheduler == ScheduleOptions::Scheduler::kDynamic) {
      auto plan = ScheduleDynamic(samples, o);
      got = plan.ok() ? Result<bool>(plan->skipped.empty()) : Result<bool>(plan.status());
    } else {
      auto plan = Schedule(samples, o);
      got = plan.ok() ? Result<bool>(plan->skipped.empty()) : Result<bool>(plan.status());
    }
    if (!got.ok()) {
      EXPECT_NE(got.status().message().find("too few samples"), std::string::npos)
          << shorts << " shorts: " << got.status().ToString();
      continue;
    }
    if (kept) EXPECT_EQ(*kept, *got) << shorts << " shorts disagree with " << shorts + 1;
    kept = *got;
  }
  EXPECT_TRUE(kept.has_value()) << "no count of short samples gave a plan";
  return kept.value_or(false);
}

TEST(LongestKeptTest, EqualsTheSchedulersOversizeRule) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    ScheduleOptions o;
    o.dp_size = 1 + static_cast<int>(rng() % 4);
    const int cp = 1 + static_cast<int>(rng() % 4);
    const int tp = 1 + static_cast<int>(rng() % 4);
    const bool sp = tp > 1 && rng() % 2;
    const int64_t align = 1 + static_cast<int64_t>(rng() % 3);
    const int64_t rank_multiple = std::vector<int64_t>{1, 1, 3, 16, 32, 128}[rng() % 6];
    o.parallel = *ParallelLayout::Create(cp, tp, sp, align, rank_multiple);
    // At least one token quantum per microbatch (a smaller budget keeps no sample at all),
    // and for the dynamic scheduler one for a group of one rank.
    const int64_t quantum = std::max(
        o.parallel.token_quantum(),
        ParallelLayout::Create(1, tp, sp, align, rank_multiple)->token_quantum() * cp);
    o.max_tokens_per_rank = (quantum + cp - 1) / cp + static_cast<int64_t>(rng() % 3000);
    if (trial % 2 == 1) {
      o.scheduler = ScheduleOptions::Scheduler::kDynamic;
      o.cost = *CostModelFromDims(ModelDims{2, 8, 2, 1, 16, 10});
      o.step_time = *StepTimeModel::Create(ModelDims{2, 8, 2, 1, 16, 10},
                                           *ParseHardwareSpec("1000,10"));
      o.cp_sizes = rng() % 2 ? ScheduleOptions::CpSizes::kPow2 : ScheduleOptions::CpSizes::kAny;
    } else if (rng() % 2) {
      o.scheduler = ScheduleOptions::Scheduler::kSequential;
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ": DP " + std::to_string(o.dp_size) + " " +
                 o.parallel.ToString() + " max_tokens_per_rank " +
                 std::to_string(o.max_tokens_per_rank) +
                 (trial % 2 ? " dynamic" : " static"));
    auto longest = LongestKept(o);
    ASSERT_TRUE(longest.ok()) << longest.status().ToString();
    ASSERT_GE(*longest, 1);
    EXPECT_TRUE(Kept(o, *longest));
    EXPECT_FALSE(Kept(o, *longest + 1));
  }
}

}  // namespace
}  // namespace thdpack
