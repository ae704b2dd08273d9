// Groups kept together (ScheduleOptions::keep_groups): on random steps of pairs and groups, every
// plan of the balanced and the dynamic scheduler is checked by a plain check written here (a
// map from each group to where its samples are) as well as by the validators; the validators
// reject plans that break a group; errors and the oversize rule.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>
#include <vector>

#include "schedule/scheduler_test_util.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

using testing_util::RandomLengths;
using testing_util::WithIds;

using Keep = ScheduleOptions::KeepGroups;

ScheduleOptions Options(int dp, int cp, int64_t max_tokens, Keep keep) {
  ScheduleOptions o;
  o.dp_size = dp;
  o.parallel = *ParallelLayout::Create(cp, 1, false, 1, 1);
  o.max_tokens_per_rank = max_tokens;
  o.cost = *CostModelFromDims(ModelDims{2, 8, 2, 1, 16, 10});
  o.keep_groups = keep;
  return o;
}

// Random groups of 1..max_size samples (pairs when max_size = 2 and exact), given in a
// shuffled order: a group's samples are not adjacent in the input.
std::vector<int64_t> RandomGroups(std::mt19937_64& rng, size_t n, int max_size, bool exact) {
  std::vector<int64_t> groups(n);
  std::uniform_int_distribution<int> size(exact ? max_size : 1, max_size);
  size_t i = 0;
  int64_t g = 1000;
  while (i < n) {
    const int s = size(rng);
    for (int k = 0; k < s && i < n; ++k) groups[i++] = g;
    g += 17;
  }
  std::shuffle(groups.begin(), groups.end(), rng);
  return groups;
}

// Where each id is in a static plan: (replica, microbatch, position in the flat order).
struct Where {
  int d = -1, m = -1;
  int64_t k = -1;
};

// The plain check of a static plan: every sample once (scheduled or skipped), every group
// whole, in one microbatch with its samples adjacent in input order (kMicrobatch) or on one
// replica (kReplica). Returns "" or what is wrong.
std::string CheckStatic(const std::vector<SampleLength>& samples,
                        const std::vector<int64_t>& groups, Keep keep, const Plan& plan) {
  std::map<int64_t, Where> where;
  for (int d = 0; d < plan.dp_size; ++d) {
    for (int m = 0; m < plan.num_microbatches; ++m) {
      const int64_t base = plan.offsets[static_cast<size_t>(d * plan.num_microbatches + m)];
      const auto ids = plan.Microbatch(d, m);
      for (size_t j = 0; j < ids.size(); ++j) {
        if (where.count(ids[j])) return "id twice";
        where[ids[j]] = {d, m, base + static_cast<int64_t>(j)};
      }
    }
  }
  std::map<int64_t, bool> skipped;
  for (int64_t id : plan.skipped) skipped[id] = true;
  std::map<int64_t, std::vector<size_t>> members;  // group -> input positions
  for (size_t i = 0; i < samples.size(); ++i) {
    const bool placed = where.count(samples[i].id) > 0;
    if (placed == skipped.count(samples[i].id) > 0) return "neither or both";
    members[groups[i]].push_back(i);
  }
  for (const auto& [g, pos] : members) {
    for (size_t j = 1; j < pos.size(); ++j) {
      const int64_t a = samples[pos[j - 1]].id, b = samples[pos[j]].id;
      if (skipped.count(a) != skipped.count(b)) {
        return "group " + std::to_string(g) + " half skipped";
      }
      if (skipped.count(a)) continue;
      const Where& x = where[a];
      const Where& y = where[b];
      if (x.d != y.d) return "group " + std::to_string(g) + " on two replicas";
      if (keep == Keep::kMicrobatch && (x.m != y.m || y.k != x.k + 1)) {
        return "group " + std::to_string(g) + " not adjacent in one microbatch";
      }
    }
  }
  return "";
}

// The same for a dynamic plan: every group in one CP group of one microbatch, adjacent.
std::string CheckDynamic(const std::vector<SampleLength>& samples,
                         const std::vector<int64_t>& groups, const DynamicPlan& plan) {
  std::map<int64_t, std::pair<int64_t, int64_t>> where;  // id -> (group number, position)
  int64_t container = 0, position = 0;
  for (const auto& mb : plan.microbatches) {
    for (const CpGroup& g : mb) {
      ++container;
      for (int64_t id : g.sample_ids) {
        if (where.count(id)) return "id twice";
        where[id] = {container, position++};
      }
    }
  }
  std::map<int64_t, bool> skipped;
  for (int64_t id : plan.skipped) skipped[id] = true;
  std::map<int64_t, std::vector<size_t>> members;
  for (size_t i = 0; i < samples.size(); ++i) {
    if ((where.count(samples[i].id) > 0) == (skipped.count(samples[i].id) > 0)) {
      return "neither or both";
    }
    members[groups[i]].push_back(i);
  }
  for (const auto& [g, pos] : members) {
    for (size_t j = 1; j < pos.size(); ++j) {
      const int64_t a = samples[pos[j - 1]].id, b = samples[pos[j]].id;
      if (skipped.count(a) != skipped.count(b)) return "group half skipped";
      if (skipped.count(a)) continue;
      if (where[a].first != where[b].first || where[b].second != where[a].second + 1) {
        return "group " + std::to_string(g) + " not adjacent in one CP group";
      }
    }
  }
  return "";
}

TEST(ScheduleGroups, RandomStepsKeepEveryGroup) {
  std::mt19937_64 rng(20261128);
  int plans = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const int dp = 1 + static_cast<int>(rng() % 4);
    const int cp = 1 + static_cast<int>(rng() % 2);
    const Keep keep = trial % 2 == 0 ? Keep::kMicrobatch : Keep::kReplica;
    const int64_t max_tokens = 256 + static_cast<int64_t>(rng() % 1024);
    const size_t n = 8 * static_cast<size_t>(dp) + rng() % 120;
    const auto samples = WithIds(RandomLengths(rng, n, max_tokens), rng());
    const auto groups = RandomGroups(rng, n, 1 + static_cast<int>(rng() % 4), trial % 3 == 0);
    ScheduleOptions o = Options(dp, cp, max_tokens, keep);
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    o.microbatch_multiple = 1 + static_cast<int>(rng() % 2);
    Result<Plan> plan = Schedule(samples, o, groups);
    if (!plan.ok()) {
      // Only a step with too few groups may fail.
      EXPECT_NE(plan.status().message().find("too few"), std::string::npos)
          << plan.status().message();
      continue;
    }
    ++plans;
    ASSERT_EQ(CheckStatic(samples, groups, keep, *plan), "") << "trial " << trial;
    ASSERT_TRUE(ValidatePlan(samples, o, *plan, groups).ok())
        << ValidatePlan(samples, o, *plan, groups).message();
    // Deterministic, and the figures of the plan agree with ComputePlanFigures.
    Result<ScheduledPlan> again = ScheduleWithFigures(samples, o, groups);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->plan.sample_ids, plan->sample_ids);
    EXPECT_EQ(again->plan.offsets, plan->offsets);
    Result<PlanFigures> f = ComputePlanFigures(samples, o, *plan);
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(f->max_replica_cost, again->figures.max_replica_cost);
    EXPECT_EQ(f->padded_tokens, again->figures.padded_tokens);
  }
  EXPECT_GT(plans, 80);
}

TEST(ScheduleGroups, DynamicKeepsEveryGroupInOneCpGroup) {
  std::mt19937_64 rng(7);
  int plans = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const int dp = 1 + static_cast<int>(rng() % 4);
    const int cp = 1 + static_cast<int>(rng() % 2);
    const int64_t max_tokens = 128 + static_cast<int64_t>(rng() % 512);
    const size_t n = 4 + rng() % 60;
    const auto samples = WithIds(RandomLengths(rng, n, max_tokens), rng());
    const auto groups = RandomGroups(rng, n, 1 + static_cast<int>(rng() % 3), trial % 2 == 0);
    ScheduleOptions o =
        Options(dp, cp, max_tokens, trial % 3 == 0 ? Keep::kReplica : Keep::kMicrobatch);
    o.scheduler = ScheduleOptions::Scheduler::kDynamic;
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    o.step_time = *StepTimeModel::Create(ModelDims{2, 8, 2, 1, 16, 10},
                                         *ParseHardwareSpec("1000,10"));
    Result<DynamicPlan> plan = ScheduleDynamic(samples, o, groups);
    if (!plan.ok()) {
      EXPECT_NE(plan.status().message().find("too few"), std::string::npos)
          << plan.status().message();
      continue;
    }
    ++plans;
    ASSERT_EQ(CheckDynamic(samples, groups, *plan), "") << "trial " << trial;
    const Status v = ValidateDynamicPlan(samples, o, *plan, groups);
    ASSERT_TRUE(v.ok()) << v.message();
  }
  EXPECT_GT(plans, 30);
}

// Singleton groups are no constraint: the plan is valid and its straggler within the
// balanced scheduler's 1% choice rule of the plain balanced plan's on these steps.
TEST(ScheduleGroups, SingletonGroupsAreValid) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    const size_t n = 64 + rng() % 64;
    const auto samples = WithIds(RandomLengths(rng, n, 1024), rng());
    std::vector<int64_t> groups(n);
    for (size_t i = 0; i < n; ++i) groups[i] = static_cast<int64_t>(i);
    const ScheduleOptions o = Options(4, 2, 1024, Keep::kMicrobatch);
    Result<Plan> plan = Schedule(samples, o, groups);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    EXPECT_EQ(CheckStatic(samples, groups, Keep::kMicrobatch, *plan), "");
    EXPECT_TRUE(ValidatePlan(samples, o, *plan, groups).ok());
  }
}

// The validators reject a plan where a pair is split, or not adjacent, or half skipped.
TEST(ScheduleGroups, ValidatorsRejectBrokenGroups) {
  std::vector<SampleLength> samples;
  std::vector<int64_t> groups;
  for (int i = 0; i < 8; ++i) {
    samples.push_back({100 + i, 10 + i, 9 + i});
    groups.push_back(i / 2);  // pairs (0,1), (2,3), ...
  }
  ScheduleOptions o = Options(2, 1, 64, Keep::kMicrobatch);
  Plan plan;
  plan.dp_size = 2;
  plan.num_microbatches = 1;
  plan.sample_ids = {100, 101, 102, 103, 104, 105, 106, 107};
  plan.offsets = {0, 4, 8};
  ASSERT_TRUE(ValidatePlan(samples, o, plan, groups).ok())
      << ValidatePlan(samples, o, plan, groups).message();
  Plan split = plan;
  split.sample_ids = {100, 102, 103, 101, 104, 105, 106, 107};  // 101 not beside 100
  Status s = ValidatePlan(samples, o, split, groups);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("group 0"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("not adjacent"), std::string::npos) << s.message();
  // The same plan is fine when groups only need a replica.
  o.keep_groups = Keep::kReplica;
  EXPECT_TRUE(ValidatePlan(samples, o, split, groups).ok());
  Plan across = plan;
  across.sample_ids = {100, 102, 103, 104, 101, 105, 106, 107};  // 101 on replica 1
  s = ValidatePlan(samples, o, across, groups);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("different replicas"), std::string::npos) << s.message();
  // Reversed order inside a microbatch breaks "input order".
  o.keep_groups = Keep::kMicrobatch;
  Plan reversed = plan;
  reversed.sample_ids = {101, 100, 102, 103, 104, 105, 106, 107};
  EXPECT_FALSE(ValidatePlan(samples, o, reversed, groups).ok());
  // Half a group skipped.
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  Plan half = plan;
  half.sample_ids = {100, 102, 103, 104, 105, 106, 107};
  half.offsets = {0, 3, 7};
  half.skipped = {101};
  EXPECT_FALSE(ValidatePlan(samples, o, half, groups).ok());
}

TEST(ScheduleGroups, OversizeGroupsAreErrorsOrSkippedWhole) {
  // Group 7 is a pair of 40 + 40 tokens: each fits a microbatch of 64, together they do not.
  std::vector<SampleLength> samples = {{1, 40, 39}, {2, 10, 9}, {3, 40, 39}, {4, 12, 11},
                                       {5, 9, 8},   {6, 11, 10}, {7, 100, 99}, {8, 5, 4}};
  std::vector<int64_t> groups = {7, 1, 7, 2, 3, 4, 5, 5};
  ScheduleOptions o = Options(2, 1, 64, Keep::kMicrobatch);
  Result<Plan> plan = Schedule(samples, o, groups);
  ASSERT_FALSE(plan.ok());
  // The first error is the oversize sample 7 (100 tokens), before any group.
  EXPECT_NE(plan.status().message().find("sample id 7"), std::string::npos)
      << plan.status().message();
  samples[6].length = 20;
  samples[6].n_targets = 19;
  plan = Schedule(samples, o, groups);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("group 7 (samples 1, 3)"), std::string::npos)
      << plan.status().message();
  EXPECT_NE(plan.status().message().find("pads to 80"), std::string::npos);
  // Replica mode: the pair may span two microbatches of one replica.
  o.keep_groups = Keep::kReplica;
  plan = Schedule(samples, o, groups);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(CheckStatic(samples, groups, Keep::kReplica, *plan), "");
  // Skip: the whole group leaves, both ids listed, in input order.
  o.keep_groups = Keep::kMicrobatch;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  plan = Schedule(samples, o, groups);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->skipped, (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(ValidatePlan(samples, o, *plan, groups).ok());
  // A pair with one oversize member is skipped whole under kSkip.
  samples[0].length = 100;
  plan = Schedule(samples, o, groups);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->skipped, (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(ValidatePlan(samples, o, *plan, groups).ok());
}

TEST(ScheduleGroups, Errors) {
  std::vector<SampleLength> samples = {{1, 10, 9}, {2, 10, 9}, {3, 10, 9}, {4, 10, 9}};
  std::vector<int64_t> groups = {0, 0, 1, 1};
  ScheduleOptions o = Options(2, 1, 64, Keep::kNone);
  Result<Plan> plan = Schedule(samples, o, groups);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("keep_groups is 'none'"), std::string::npos);
  o.keep_groups = Keep::kMicrobatch;
  plan = Schedule(samples, o, std::vector<int64_t>{0, 0, 1});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("3 group ids for 4 samples"), std::string::npos)
      << plan.status().message();
  o.scheduler = ScheduleOptions::Scheduler::kSequential;
  plan = Schedule(samples, o, groups);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("sequential"), std::string::npos);
  o.scheduler = ScheduleOptions::Scheduler::kBalanced;
  o.dp_size = 4;  // two pairs cannot fill four replicas' microbatches
  plan = Schedule(samples, o, groups);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("too few groups: 2 groups"), std::string::npos)
      << plan.status().message();
  EXPECT_FALSE(ParseKeepGroups("pairs").ok());
  EXPECT_EQ(*ParseKeepGroups("replica"), Keep::kReplica);
  EXPECT_EQ(KeepGroupsName(Keep::kMicrobatch), "microbatch");
}

}  // namespace
}  // namespace thdpack
