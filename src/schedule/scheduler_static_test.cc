// Static shapes (ScheduleOptions::max_seqs_per_microbatch, pad_to_max_tokens): on random steps,
// every plan of the balanced and the sequential scheduler is checked by a plain check written
// here (every sample once, at most S sequences and the token budget in every microbatch, the
// padded tokens of a fixed shape in the figures) as well as by ValidatePlan; the validator
// rejects a plan over the cap; errors. (The layout of a fixed shape and the offsets padded to
// S+1: src/pack/pack_test.cc.)
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

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

ScheduleOptions Options(int dp, int cp, bool sp, int tp, int64_t max_tokens, int max_seqs,
                        bool pad) {
  ScheduleOptions o;
  o.dp_size = dp;
  o.parallel = *ParallelLayout::Create(cp, tp, sp, 1, 1);
  o.max_tokens_per_rank = max_tokens;
  o.cost = *CostModelFromDims(ModelDims{2, 8, 2, 1, 16, 10});
  o.max_seqs_per_microbatch = max_seqs;
  o.pad_to_max_tokens = pad;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  return o;
}

// The plain check: every input id once (scheduled or skipped), no microbatch empty or over S
// sequences or over the budget, and the figures' padded tokens: T = CP * max_tokens_per_rank
// for every microbatch of a fixed shape. Returns "" or what is wrong.
std::string CheckPlan(const std::vector<SampleLength>& samples, const ScheduleOptions& o,
                      const Plan& plan, const PlanFigures& f) {
  std::map<int64_t, int64_t> length;
  for (const SampleLength& s : samples) length[s.id] = s.length;
  std::map<int64_t, int> seen;
  const int64_t budget = static_cast<int64_t>(o.parallel.cp_size()) * o.max_tokens_per_rank;
  for (int d = 0; d < plan.dp_size; ++d) {
    for (int m = 0; m < plan.num_microbatches; ++m) {
      const auto ids = plan.Microbatch(d, m);
      const std::string where = "replica " + std::to_string(d) + " mb " + std::to_string(m);
      if (ids.empty()) return where + " empty";
      if (o.max_seqs_per_microbatch > 0 &&
          static_cast<int64_t>(ids.size()) > o.max_seqs_per_microbatch) {
        return where + " holds " + std::to_string(ids.size()) + " sequences";
      }
      int64_t sum = 0;
      for (int64_t id : ids) {
        ++seen[id];
        const int64_t a = o.parallel.sequence_alignment();
        sum += (length.at(id) + a - 1) / a * a;
      }
      if (sum > budget) return where + " over the budget";
      const int64_t t = f.replicas[static_cast<size_t>(d)]
                            .microbatches[static_cast<size_t>(m)].padded_tokens;
      if (o.pad_to_max_tokens && t != budget) {
        return where + ": padded tokens " + std::to_string(t) + ", fixed T " +
               std::to_string(budget);
      }
      if (!o.pad_to_max_tokens && t >= sum + o.parallel.token_quantum()) {
        return where + ": padded tokens " + std::to_string(t) + " for a sum of " +
               std::to_string(sum);
      }
    }
  }
  for (int64_t id : plan.skipped) ++seen[id];
  for (const SampleLength& s : samples) {
    if (seen[s.id] != 1) {
      return "id " + std::to_string(s.id) + " placed " + std::to_string(seen[s.id]) + " times";
    }
  }
  if (seen.size() != samples.size()) return "an id that is not an input";
  return "";
}

TEST(ScheduleStaticShapes, RandomStepsKeepTheCapAndTheFixedShape) {
  std::mt19937_64 rng(20261129);
  int planned = 0, capped_more = 0, failed = 0;
  for (int trial = 0; trial < 160; ++trial) {
    const int dp = 1 + static_cast<int>(rng() % 4);
    const int cp = 1 + static_cast<int>(rng() % 2);
    const bool sp = trial % 5 == 0;
    const int tp = sp ? 2 : 1;
    const int max_seqs = 1 + static_cast<int>(rng() % 8);
    const bool pad = rng() % 2 == 0;
    const int64_t max_tokens = 64 * (1 + static_cast<int64_t>(rng() % 8));
    ScheduleOptions o = Options(dp, cp, sp, tp, max_tokens, max_seqs, pad);
    o.microbatch_multiple = 1 + static_cast<int>(rng() % 2);
    if (trial % 4 == 3) o.scheduler = ScheduleOptions::Scheduler::kSequential;
    const size_t n = static_cast<size_t>(dp * o.microbatch_multiple) + rng() % 60;
    const auto samples = WithIds(RandomLengths(rng, n, 2 * max_tokens * cp), rng());
    auto r = ScheduleWithFigures(samples, o);
    if (!r.ok()) {
      // Only the documented failures: too few samples once the oversize ones left (or for the
      // cap: every replica has M microbatches, each with a sample), or no M of the search
      // that fits the samples under both budgets.
      EXPECT_TRUE(Contains(r.status().message(), "too few samples") ||
                  Contains(r.status().message(), "no plan found for M"))
          << r.status().ToString() << " trial " << trial;
      ++failed;
      continue;
    }
    ++planned;
    EXPECT_EQ(CheckPlan(samples, o, r->plan, r->figures), "") << "trial " << trial;
    EXPECT_TRUE(ValidatePlan(samples, o, r->plan).ok());
    // The cap never costs more microbatches than the sequences need at the least.
    ScheduleOptions free = o;
    free.max_seqs_per_microbatch = 0;
    auto f = ScheduleWithFigures(samples, free);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    const int64_t kept = r->figures.n_samples;
    const int64_t need = (kept + static_cast<int64_t>(dp) * max_seqs - 1) /
                         (static_cast<int64_t>(dp) * max_seqs);
    if (r->plan.num_microbatches > f->plan.num_microbatches) {
      ++capped_more;
      EXPECT_GE(r->plan.num_microbatches, need) << "trial " << trial;
    }
  }
  EXPECT_GE(planned, 130);
  EXPECT_LE(failed, 30);
  EXPECT_GE(capped_more, 20);  // the cap did bind in many steps
}

// A plan over the cap is refused by the validator, naming the microbatch.
TEST(ScheduleStaticShapes, ValidatorRefusesAMicrobatchOverTheCap) {
  ScheduleOptions o = Options(1, 1, false, 1, 1000, 0, false);
  const std::vector<SampleLength> samples = {{1, 10, 9}, {2, 10, 9}, {3, 10, 9}};
  auto plan = Schedule(samples, o);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->num_microbatches, 1);
  o.max_seqs_per_microbatch = 2;
  const Status s = ValidatePlan(samples, o, *plan);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), "holds 3 sequences, over max_seqs_per_microbatch 2"))
      << s.ToString();
  auto capped = Schedule(samples, o);
  ASSERT_TRUE(capped.ok()) << capped.status().ToString();
  EXPECT_EQ(capped->num_microbatches, 2);
}

// Groups under a cap: a pair in one microbatch still counts two sequences; a group over the
// cap is an error naming it, or leaves whole under skip.
TEST(ScheduleStaticShapes, GroupsCountTheirSequences) {
  ScheduleOptions o = Options(2, 1, false, 1, 1000, 3, false);
  o.keep_groups = ScheduleOptions::KeepGroups::kMicrobatch;
  o.oversize = ScheduleOptions::OversizePolicy::kError;
  std::vector<SampleLength> samples;
  std::vector<int64_t> groups;
  for (int i = 0; i < 12; ++i) {
    samples.push_back({i, 20 + i, 10});
    groups.push_back(i / 2);
  }
  auto r = ScheduleWithFigures(samples, o, groups);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (int d = 0; d < 2; ++d) {
    for (int m = 0; m < r->plan.num_microbatches; ++m) {
      EXPECT_LE(r->plan.Microbatch(d, m).size(), 2u);  // pairs: 3 would split one
    }
  }
  EXPECT_TRUE(ValidatePlan(samples, o, r->plan, groups).ok());
  groups[2] = groups[3] = groups[4] = groups[5] = 1;  // a group of 4 samples
  auto bad = Schedule(samples, o, groups);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(bad.status().message(), "holds 4 samples, over max_seqs_per_microbatch 3"))
      << bad.status().ToString();
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  auto skipped = Schedule(samples, o, groups);
  ASSERT_TRUE(skipped.ok()) << skipped.status().ToString();
  EXPECT_EQ(skipped->skipped, (std::vector<int64_t>{2, 3, 4, 5}));
}

TEST(ScheduleStaticShapes, OptionErrorsNameTheRule) {
  const std::vector<SampleLength> samples = {{1, 10, 9}, {2, 10, 9}};
  ScheduleOptions o = Options(1, 2, false, 1, 100, 0, false);
  o.parallel = *ParallelLayout::Create(2, 1, false, 1, 16);  // token quantum 32
  o.pad_to_max_tokens = true;  // T = 200, not a multiple of 32
  auto r = Schedule(samples, o);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "is not a multiple of the layout's token quantum 32"))
      << r.status().ToString();
  o = Options(1, 1, false, 1, 100, -1, false);
  EXPECT_TRUE(Contains(Schedule(samples, o).status().message(), "max_seqs_per_microbatch = -1"));
  o = Options(1, 1, false, 1, 100, 4, false);
  o.scheduler = ScheduleOptions::Scheduler::kDynamic;
  EXPECT_TRUE(Contains(ScheduleDynamic(samples, o).status().message(), "dynamic scheduler"));
}

}  // namespace
}  // namespace thdpack
