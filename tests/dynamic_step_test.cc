// `run --scheduler dynamic` on the thread backend: what every rank receives, checked on random
// steps at several world sizes (D = DP*CP a power of two or not, and 1) against samples read
// the plain way (tests/step_checks.h); and the probe's figures equal one rank's at the issue's
// topologies (the same topologies run under mpirun in tests/cli_verify_test.cmake).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "dynamic_checks.h"
#include "step_checks.h"
#include "thdpack/job.h"
#include "thdpack/probe.h"
#include "thdpack/shard.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

using testing::ScratchFile;

using Topo = testing::DynTopo;

std::string Name(const Topo& t) { return testing::DynName(t); }

// Every rank's RankStep of every step, kept by the test's main thread.
struct Collected {
  std::mutex mu;
  std::map<std::pair<int64_t, int>, RankStep> steps;  // (step, world rank)
};

// Checks what the ranks received at step `s` against the samples read the plain way.
void CheckStep(const Topo& t, const Topology& topo, const StepRunnerOptions& o, int64_t s,
               const std::map<int, RankStep>& by_rank) {
  const std::string where = Name(t) + " step " + std::to_string(s);
  // The samples read the plain way (ReadReferenceStep also makes a static plan, unused here:
  // a budget that holds every sample keeps it from failing).
  StepRunnerOptions plain = o;
  plain.schedule.scheduler = ScheduleOptions::Scheduler::kBalanced;
  plain.schedule.max_tokens_per_rank = 1 << 20;
  auto ref = testing::ReadReferenceStep(plain, topo, s);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  const int cp = t.cp, domain = t.dp * t.cp;
  auto rank_of = [&](int tp, int d, int pp) {
    return topo.RankOf(Coord{tp, d % cp, d / cp, pp}).value();
  };
  // Rank 0 (a head) holds the plan; every head holds the same.
  const RankStep& r0 = by_rank.at(0);
  ASSERT_TRUE(r0.dynamic && r0.is_loader) << where;
  const DynamicPlan& plan = r0.dynamic_plan;
  ASSERT_EQ(plan.domain_size, domain) << where;
  const size_t M = static_cast<size_t>(plan.num_microbatches);
  for (const auto& [rank, st] : by_rank) {
    ASSERT_EQ(st.microbatches.size(), M) << where << " rank " << rank << ": M differs";
    ASSERT_TRUE(st.dynamic) << where;
    if (st.is_loader) {
      EXPECT_EQ(st.meta.domain_rank, st.coord.dp * cp + st.coord.cp) << where;
    }
  }
  // Every sample exactly once over the plan's groups (or skipped), none invented.
  std::multiset<int64_t> placed(plan.skipped.begin(), plan.skipped.end());
  for (const auto& groups : plan.microbatches) {
    for (const CpGroup& g : groups) placed.insert(g.sample_ids.begin(), g.sample_ids.end());
  }
  std::multiset<int64_t> want;
  for (const auto& [id, x] : ref->by_id) want.insert(id);
  EXPECT_EQ(placed, want) << where << ": samples not placed exactly once";

  for (int d = 0; d < domain; ++d) {
    // Metadata equal on every TP rank and stage of the domain index.
    const RankStep& head = by_rank.at(rank_of(0, d, 0));
    for (int pp = 0; pp < t.pp; ++pp) {
      for (int tp = 0; tp < t.tp; ++tp) {
        const RankStep& x = by_rank.at(rank_of(tp, d, pp));
        EXPECT_EQ(x.meta, head.meta)
            << where << " domain rank " << d << " tp " << tp << " pp " << pp;
        for (size_t m = 0; m < M; ++m) {
          EXPECT_EQ(x.microbatches[m].idle, head.microbatches[m].idle) << where;
          EXPECT_EQ(x.microbatches[m].cp_rank, head.microbatches[m].cp_rank) << where;
          EXPECT_EQ(x.microbatches[m].cu_seqlens_padded, head.microbatches[m].cu_seqlens_padded);
        }
      }
    }
    // Idle exactly where the plan has no group holding d.
    for (size_t m = 0; m < M; ++m) {
      bool in_group = false;
      for (const CpGroup& g : plan.microbatches[m]) {
        in_group = in_group || (d >= g.first_rank && d < g.first_rank + g.num_ranks);
      }
      EXPECT_EQ(head.microbatches[m].idle, !in_group)
          << where << " domain rank " << d << " mb " << m;
      if (!in_group) {
        EXPECT_TRUE(head.microbatches[m].tokens.empty());
        EXPECT_EQ(head.microbatches[m].cu_seqlens, std::vector<int32_t>{0});
      }
    }
  }
  // Each group: its shards, gathered by global index, give its samples' tokens exactly once,
  // with position ids (first stage) and labels / loss mask (last stage) of the reference.
  for (size_t m = 0; m < M; ++m) {
    for (const CpGroup& g : plan.microbatches[m]) {
      const int c = g.num_ranks;
      for (int tp = 0; tp < t.tp; ++tp) {
        const LocalMicrobatch& lead = by_rank.at(rank_of(tp, g.first_rank, 0)).microbatches[m];
        ASSERT_EQ(lead.cp_size, c) << where;
        ASSERT_EQ(lead.cu_seqlens.size(), g.sample_ids.size() + 1) << where;
        const int64_t total = lead.cu_seqlens_padded.back();
        std::vector<int64_t> tokens(static_cast<size_t>(total), -1), labels(tokens.size(), -1);
        std::vector<int> seen(tokens.size(), 0);
        std::vector<int32_t> pos(tokens.size(), -1);
        std::vector<int> mask(tokens.size(), -1);
        for (int r = 0; r < c; ++r) {
          const LocalMicrobatch& first =
              by_rank.at(rank_of(tp, g.first_rank + r, 0)).microbatches[m];
          const LocalMicrobatch& last =
              by_rank.at(rank_of(tp, g.first_rank + r, t.pp - 1)).microbatches[m];
          ASSERT_FALSE(first.idle);
          EXPECT_EQ(first.cp_rank, r);
          ASSERT_TRUE(first.cp_group != nullptr);
          EXPECT_EQ(first.cp_group->size(), c);
          EXPECT_EQ(first.cp_group->rank(), r);
          EXPECT_EQ(first.cu_seqlens, lead.cu_seqlens) << where;
          auto idx = CpPartitionIndices(lead.cu_seqlens_padded, c, r);
          ASSERT_TRUE(idx.ok());
          ASSERT_EQ(first.tokens.size(), idx->size()) << where;
          ASSERT_EQ(last.labels.size(), idx->size()) << where;
          for (size_t k = 0; k < idx->size(); ++k) {
            const size_t gi = static_cast<size_t>((*idx)[k]);
            ++seen[gi];
            tokens[gi] = first.tokens[k];
            pos[gi] = first.position_ids[k];
            labels[gi] = last.labels[k];
            mask[gi] = last.loss_mask[k];
          }
        }
        for (size_t gi = 0; gi < seen.size(); ++gi) {
          ASSERT_EQ(seen[gi], 1)
              << where << ": global index " << gi << " held " << seen[gi] << " times";
        }
        int64_t n_valid = 0;
        for (size_t i = 0; i < g.sample_ids.size(); ++i) {
          const Sample& x = ref->by_id.at(g.sample_ids[i]);
          const int64_t begin = lead.cu_seqlens_padded[i];
          ASSERT_EQ(lead.cu_seqlens[i + 1] - lead.cu_seqlens[i],
                    static_cast<int32_t>(x.tokens.size()));
          for (size_t j = 0; j < x.tokens.size(); ++j) {
            const size_t gi = static_cast<size_t>(begin) + j;
            ASSERT_EQ(tokens[gi], x.tokens[j]) << where << " sample " << x.id << " token " << j;
            EXPECT_EQ(pos[gi], static_cast<int32_t>(j));
            const bool target = j + 1 < x.tokens.size() &&
                                (x.target_mask.empty() || x.target_mask[j + 1] != 0);
            EXPECT_EQ(mask[gi], target ? 1 : 0) << where << " sample " << x.id << " pos " << j;
            if (target) EXPECT_EQ(labels[gi], x.tokens[j + 1]);
            n_valid += target ? 1 : 0;
          }
        }
        EXPECT_EQ(lead.n_valid, n_valid) << where;
      }
    }
  }
}

// Runs `steps` dynamic steps at `t` and checks every one; with `out`, every rank's steps are
// also handed back. data_on "all": every (tp, pp) slice plans and packs for itself;
// max_cp_groups > 0 bounds the cache of CP groups.
void RunAndCheck(const Topo& t, const std::string& data, int64_t global_batch,
                 int64_t max_tokens, int steps, bool skip = false,
                 const std::string& data_on = "tp0", int max_cp_groups = 0,
                 std::map<std::pair<int64_t, int>, RankStep>* out = nullptr) {
  auto job = testing::DynamicJob(t, data, global_batch, max_tokens, steps);
  ASSERT_TRUE(job.ok()) << Name(t) << ": " << job.status().ToString();
  if (skip) job->schedule.oversize = ScheduleOptions::OversizePolicy::kSkip;
  StepRunnerOptions o = RunnerOptions(*job);
  o.data_on = ParseDataOn(data_on).value();
  if (max_cp_groups > 0) o.max_cp_groups = max_cp_groups;
  Collected got;
  const std::vector<Status> statuses =
      RunOnThreads(job->topology.world_size(), [&](ProcessGroup& world) -> Status {
        THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, job->topology, o));
        for (int s = 0; s < steps; ++s) {
          THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
          std::lock_guard<std::mutex> lock(got.mu);
          got.steps[{s, world.rank()}] = std::move(step);
        }
        return Status::Ok();
      });
  for (size_t r = 0; r < statuses.size(); ++r) {
    ASSERT_TRUE(statuses[r].ok()) << Name(t) << " rank " << r << ": " << statuses[r].ToString();
  }
  int64_t made = 0, reused = 0, skipped = 0, evicted = 0;
  for (int s = 0; s < steps; ++s) {
    std::map<int, RankStep> by_rank;
    for (int r = 0; r < job->topology.world_size(); ++r) by_rank[r] = got.steps.at({s, r});
    CheckStep(t, job->topology, o, s, by_rank);
    // Group counts: the same on every rank; the cache within its bound unless this step's own
    // groups are more.
    const RankStep& r0 = by_rank.at(0);
    for (const auto& [r, st] : by_rank) {
      EXPECT_EQ(st.groups_made, r0.groups_made);
      EXPECT_EQ(st.groups_reused, r0.groups_reused);
      EXPECT_EQ(st.groups_evicted, r0.groups_evicted);
      EXPECT_EQ(st.groups_cached, r0.groups_cached);
    }
    EXPECT_LE(r0.groups_cached, std::max<int64_t>(o.max_cp_groups,
                                                  r0.groups_made + r0.groups_reused))
        << Name(t) << " step " << s;
    evicted += r0.groups_evicted;
    made += by_rank.at(0).groups_made;
    reused += by_rank.at(0).groups_reused;
    // Skipped samples are reported to every rank.
    for (const auto& [r, st] : by_rank) {
      EXPECT_EQ(st.meta.skipped_ids, by_rank.at(0).dynamic_plan.skipped)
          << Name(t) << " rank " << r;
    }
    skipped += static_cast<int64_t>(by_rank.at(0).dynamic_plan.skipped.size());
  }
  if (skip) EXPECT_GT(skipped, 0) << Name(t) << ": no sample was over the budget";
  EXPECT_GT(made, 0) << Name(t);
  if (steps > 1 && max_cp_groups == 0) {
    EXPECT_GT(reused, 0) << Name(t) << ": no group was reused across steps";
  }
  if (max_cp_groups == 1 && steps > 1) EXPECT_GT(evicted, 0) << Name(t) << ": nothing evicted";
  if (out != nullptr) *out = std::move(got.steps);
}

// Random lengths up to a few times the per-rank budget, so that groups of many sizes are used.
TEST(DynamicStep, RanksReceiveTheirGroupsShardsExactlyOnce) {
  ScratchFile file("thdpack_dynamic_step.jsonl");
  testing::WriteStepTestJsonl(file.path(), 60, 300, 17);
  const std::string data = "jsonl:" + file.path();
  for (const Topo& t : {Topo{1, 1, 1, 1, false}, Topo{1, 3, 1, 1, false}, Topo{1, 3, 2, 1, false},
                        Topo{2, 2, 2, 1, true}, Topo{1, 2, 2, 2, false}, Topo{1, 5, 1, 1, false},
                        Topo{2, 1, 3, 1, true}}) {
    // 128 tokens a rank, so that samples of up to 300 tokens need groups of 3 ranks; a domain
    // of 1 takes them whole.
    RunAndCheck(t, data, 24, t.cp * t.dp >= 3 ? 128 : 320, 3);
  }
}

// Oversize policy skip: samples over the largest group's budget (D * 40 tokens) are left out,
// reported in `skipped`, and every other sample still arrives exactly once.
TEST(DynamicStep, OversizeSkipLeavesSamplesOutAndSaysSo) {
  ScratchFile file("thdpack_dynamic_skip.jsonl");
  testing::WriteStepTestJsonl(file.path(), 30, 200, 23);
  RunAndCheck(Topo{1, 2, 1, 1, false}, "jsonl:" + file.path(), 12, 40, 2, /*skip=*/true);
}

// --data-on all: every (tp, pp) slice reads, plans and packs for itself; every rank ends the
// step with what the tp0 step delivers it, array for array.
TEST(DynamicStep, DataOnAllEqualsTp0) {
  ScratchFile file("thdpack_dynamic_all.jsonl");
  testing::WriteStepTestJsonl(file.path(), 40, 300, 29);
  const std::string data = "jsonl:" + file.path();
  for (const Topo& t : {Topo{1, 2, 2, 1, false}, Topo{2, 2, 2, 1, true}, Topo{1, 2, 2, 2, false},
                        Topo{2, 3, 1, 2, false}}) {
    std::map<std::pair<int64_t, int>, RankStep> tp0, all;
    RunAndCheck(t, data, 16, 128, 2, false, "tp0", 0, &tp0);
    RunAndCheck(t, data, 16, 128, 2, false, "all", 0, &all);
    ASSERT_EQ(tp0.size(), all.size()) << Name(t);
    for (const auto& [key, a] : all) {
      const RankStep& b = tp0.at(key);
      const std::string where = Name(t) + " step " + std::to_string(key.first) + " rank " +
                                std::to_string(key.second);
      EXPECT_EQ(a.meta, b.meta) << where;
      ASSERT_EQ(a.microbatches.size(), b.microbatches.size()) << where;
      for (size_t m = 0; m < a.microbatches.size(); ++m) {
        const LocalMicrobatch &x = a.microbatches[m], &y = b.microbatches[m];
        EXPECT_EQ(x.tokens, y.tokens) << where << " mb " << m;
        EXPECT_EQ(x.position_ids, y.position_ids) << where << " mb " << m;
        EXPECT_EQ(x.labels, y.labels) << where << " mb " << m;
        EXPECT_EQ(x.loss_mask, y.loss_mask) << where << " mb " << m;
        EXPECT_EQ(x.sp_range, y.sp_range) << where << " mb " << m;
        EXPECT_EQ(std::make_tuple(x.cp_size, x.cp_rank, x.first_rank, x.idle),
                  std::make_tuple(y.cp_size, y.cp_rank, y.first_rank, y.idle))
            << where << " mb " << m;
      }
    }
  }
}

// A cache of one group: groups are dropped and made again, and every step still delivers
// exactly what the plan says.
TEST(DynamicStep, BoundedGroupCacheEvictsAndStaysCorrect) {
  ScratchFile file("thdpack_dynamic_lru.jsonl");
  testing::WriteStepTestJsonl(file.path(), 60, 300, 31);
  RunAndCheck(Topo{1, 2, 2, 1, false}, "jsonl:" + file.path(), 16, 96, 3, false, "tp0", 1);
  RunAndCheck(Topo{1, 4, 1, 2, false}, "jsonl:" + file.path(), 16, 96, 3, false, "all", 1);
}

// run --verify with dynamic at the topologies, in one process: the probe's loss, ppl,
// entropy and token counts equal the single-rank reference (StepVerifier fails the run
// otherwise) and equal each other across topologies.
TEST(DynamicStep, VerifyMatchesOneRank) {
  ScratchFile file("thdpack_dynamic_verify.jsonl");
  testing::WriteStepTestJsonl(file.path(), 40, 90, 5);
  const std::string data = "jsonl:" + file.path();
  std::vector<std::vector<LossSummary>> all;
  for (const Topo& t : testing::DynamicVerifyTopologies()) {
    std::vector<LossSummary> losses;
    const int n = t.tp * t.cp * t.dp * t.pp;
    const std::vector<Status> statuses = RunOnThreads(n, [&](ProcessGroup& world) {
      return testing::RunDynamicVerify(world, t, data, 2, &losses);
    });
    for (size_t r = 0; r < statuses.size(); ++r) {
      ASSERT_TRUE(statuses[r].ok()) << Name(t) << " rank " << r << ": " << statuses[r].ToString();
    }
    ASSERT_EQ(losses.size(), 2u) << Name(t);
    all.push_back(losses);
  }
  for (size_t k = 1; k < all.size(); ++k) {
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_TRUE(CompareLossSummaries(all[k][s], all[0][s], 1e-9).ok());
    }
  }
}

}  // namespace
}  // namespace thdpack
