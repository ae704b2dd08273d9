// StepPrefetcher (thdpack/step_runner.h) on the thread backend: at depths 1 and 3 every rank's
// steps - tensors, metadata, CP groups, state - are those of the runner's own Next(), for the
// static schedulers and the dynamic one, at worlds of 2, 4 and 6 ranks; a source that fails in
// step 2 fails there with the same error (steps 0 and 1 delivered first), whatever the depth; a
// prefetcher destroyed mid-run with its thread ahead leaves no rank waiting (the world still
// answers); a restored prefetcher continues where the state says; bad depths are refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "thdpack/comm.h"
#include "thdpack/job.h"
#include "thdpack/run_state.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

using testing_util::TempDir;

struct Case {
  int tp, cp, dp, pp;
  bool sp;
  const char* data_on;
  const char* scheduler;
};

const Case kCases[] = {
    {1, 1, 2, 1, false, "tp0", "balanced"},  {1, 2, 1, 1, false, "tp0", "dynamic"},
    {2, 1, 2, 1, true, "tp0", "balanced"},   {2, 1, 1, 2, false, "tp0", "sequential"},
    {1, 2, 2, 1, false, "tp0", "dynamic"},   {1, 1, 4, 1, false, "all", "dynamic"},
    {1, 1, 3, 2, false, "all", "balanced"},  {2, 1, 3, 1, false, "tp0", "dynamic"},
};

std::string Name(const Case& c) {
  return "tp" + std::to_string(c.tp) + " cp" + std::to_string(c.cp) + " dp" +
         std::to_string(c.dp) + " pp" + std::to_string(c.pp) + (c.sp ? " sp " : " ") +
         c.data_on + " " + c.scheduler;
}

Job MakeJob(const std::string& data, const Case& c, int64_t global_batch, bool shuffle = true) {
  JobOptions o;
  o.data = data;
  o.tp = c.tp;
  o.cp = c.cp;
  o.dp = c.dp;
  o.pp = c.pp;
  o.sp = c.sp;
  o.data_on = c.data_on;
  o.scheduler = c.scheduler;
  o.global_batch = global_batch;
  o.max_tokens_per_rank = 16384;
  o.source.shuffle = shuffle;
  o.source.seed = 5;
  o.source.mock_num_samples = 45;  // epochs end mid-step
  o.max_cp_groups = 2;  // the dynamic cache evicts: its counts are compared too
  o.timeout = 60;
  auto job = ResolveJob(o);
  EXPECT_TRUE(job.ok()) << job.status().ToString();
  return *job;
}

// Everything a step hands this rank, as text: equal texts, equal steps.
std::string Digest(const RankStep& s, bool with_group_counts = true) {
  std::string out = "step " + std::to_string(s.step) + " epoch " + std::to_string(s.epoch) +
                    " loader " + std::to_string(s.is_loader) + " n " +
                    std::to_string(s.meta.n_loss_tokens) + " sum " +
                    std::to_string(s.meta.real_tokens) + " sq " + std::to_string(s.meta.sum_sq) +
                    (with_group_counts
                         ? " groups " + std::to_string(s.groups_made) + "/" +
                               std::to_string(s.groups_reused) + "/" +
                               std::to_string(s.groups_evicted) + "/" +
                               std::to_string(s.groups_cached)
                         : std::string()) +
                    " after " +
                    RunStateToJson(s.after) + "\n";
  auto list = [&](const char* name, const auto& v) {
    out += name;
    for (const auto x : v) out += " " + std::to_string(static_cast<int64_t>(x));
    out += "\n";
  };
  for (const SampleLength& x : s.samples) out += std::to_string(x.id) + ",";
  out += "\n";
  for (const LocalMicrobatch& m : s.microbatches) {
    list("cu", m.cu_seqlens);
    list("cup", m.cu_seqlens_padded);
    list("tokens", m.tokens);
    list("pos", m.position_ids);
    list("labels", m.labels);
    list("mask", m.loss_mask);
    out += "max " + std::to_string(m.max_seqlen) + " valid " + std::to_string(m.n_valid) +
           " T " + std::to_string(m.total_tokens) + " local " + std::to_string(m.local_tokens) +
           " sp " + std::to_string(m.sp_range.first) + ":" + std::to_string(m.sp_range.second) +
           " cp " + std::to_string(m.cp_size) + "/" + std::to_string(m.cp_rank) + "/" +
           std::to_string(m.first_rank) + " idle " + std::to_string(m.idle) + "\n";
    if (m.cp_group) {
      const auto ranks = m.cp_group->ranks();
      list("group", std::vector<int>(ranks.begin(), ranks.end()));
      out += "in group as " + std::to_string(m.cp_group->rank()) + "\n";
    } else {
      out += "no group\n";
    }
  }
  return out;
}

// [rank][step] digests of `steps` steps: the runner's own Next() (depth 0) or a prefetcher's.
// Without group_counts the digests leave out the counts of CP groups made and reused, which
// differ in a restarted process (it makes its groups anew).
std::vector<std::vector<std::string>> RunSteps(const Job& job, int depth, int64_t steps,
                                               const std::optional<RunState>& state = std::nullopt,
                                               bool group_counts = true) {
  const int world = job.topology.world_size();
  std::vector<std::vector<std::string>> out(static_cast<size_t>(world));
  const StepRunnerOptions options = RunnerOptions(job);
  const auto statuses = RunOnThreads(world, [&](ProcessGroup& w) -> Status {
    auto& mine = out[static_cast<size_t>(w.rank())];
    if (depth == 0) {
      THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, options));
      if (state) THDPACK_RETURN_IF_ERROR(runner->Restore(*state));
      for (int64_t s = 0; s < steps; ++s) {
        THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
        mine.push_back(Digest(step, group_counts));
      }
      return Status::Ok();
    }
    THDPACK_ASSIGN_OR_RETURN(auto ahead,
                             StepPrefetcher::Create(w, job.topology, options, depth, steps));
    if (state) THDPACK_RETURN_IF_ERROR(ahead->Restore(*state));
    for (int64_t s = 0; s < steps; ++s) {
      double waited = -1;
      THDPACK_ASSIGN_OR_RETURN(RankStep step, ahead->Next(&waited));
      if (waited < 0) return Status::Internal("Next did not say how long it waited");
      if (!(ahead->state() == step.after)) return Status::Internal("state() is not the step's");
      mine.push_back(Digest(step, group_counts));
    }
    // Past the steps it was made for: a clear error, not a wait.
    Result<RankStep> more = ahead->Next();
    if (more.ok() || more.status().code() != StatusCode::kOutOfRange) {
      return Status::Internal("a step past `steps`: " + more.status().ToString());
    }
    return Status::Ok();
  });
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
  return out;
}

TEST(StepPrefetcher, StepsEqualTheRunnersOwn) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob("mock", c, 24);
    const auto plain = RunSteps(job, 0, 5);
    for (int depth : {1, 3}) {
      const auto ahead = RunSteps(job, depth, 5);
      ASSERT_EQ(ahead.size(), plain.size());
      for (size_t r = 0; r < plain.size(); ++r) {
        ASSERT_EQ(plain[r].size(), 5u) << "rank " << r;
        ASSERT_EQ(ahead[r].size(), 5u) << "rank " << r;
        for (size_t s = 0; s < plain[r].size(); ++s) {
          EXPECT_EQ(ahead[r][s], plain[r][s]) << "depth " << depth << " rank " << r << " step " << s;
        }
      }
    }
  }
}

TEST(StepPrefetcher, RestoredContinuesAtTheState) {
  for (const Case& c : {kCases[2], kCases[4]}) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob("mock", c, 24);
    const auto plain = RunSteps(job, 0, 5, std::nullopt, /*group_counts=*/false);
    // The state after step 1, from a run of two steps.
    std::optional<RunState> after1;
    const StepRunnerOptions options = RunnerOptions(job);
    const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
      THDPACK_ASSIGN_OR_RETURN(auto ahead, StepPrefetcher::Create(w, job.topology, options, 2));
      for (int s = 0; s < 2; ++s) THDPACK_RETURN_IF_ERROR(ahead->Next().status());
      // The state of the last step handed out, not of those the thread made beyond it.
      if (w.rank() == 0) after1 = ahead->state();
      return Status::Ok();
    });
    for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(after1.has_value());
    EXPECT_EQ(after1->next_step, 2);
    const auto resumed = RunSteps(job, 2, 3, after1, /*group_counts=*/false);
    for (size_t r = 0; r < plain.size(); ++r) {
      ASSERT_EQ(resumed[r].size(), 3u);
      for (size_t s = 0; s < 3; ++s) EXPECT_EQ(resumed[r][s], plain[r][s + 2]) << r << " " << s;
    }
  }
}

// A JSONL file whose line 21 is not JSON: with 8 samples a step, step 2 fails on its reader.
std::string BrokenJsonl(const TempDir& dir) {
  const std::string path = dir.path() + "/broken.jsonl";
  std::ofstream f(path);
  for (int i = 0; i < 40; ++i) {
    if (i == 20) {
      f << "{not json\n";
      continue;
    }
    f << "{\"input_ids\": [";
    for (int k = 0; k < 4 + i % 30; ++k) f << (k ? "," : "") << (i * 7 + k) % 500;
    f << "]}\n";
  }
  return "jsonl:" + path;
}

// [rank] (steps delivered, the error's code and message) of `depth` over the broken file.
std::vector<std::pair<int, Status>> FailAt(const Job& job, int depth) {
  const int world = job.topology.world_size();
  std::vector<std::pair<int, Status>> out(static_cast<size_t>(world));
  const StepRunnerOptions options = RunnerOptions(job);
  const auto statuses = RunOnThreads(world, [&](ProcessGroup& w) -> Status {
    auto& mine = out[static_cast<size_t>(w.rank())];
    std::unique_ptr<StepRunner> runner;
    std::unique_ptr<StepPrefetcher> ahead;
    if (depth == 0) {
      THDPACK_ASSIGN_OR_RETURN(runner, StepRunner::Create(w, job.topology, options));
    } else {
      THDPACK_ASSIGN_OR_RETURN(ahead, StepPrefetcher::Create(w, job.topology, options, depth));
    }
    for (int s = 0; s < 4; ++s) {
      Result<RankStep> step = ahead ? ahead->Next() : runner->Next();
      if (!step.ok()) {
        mine.second = step.status();
        break;
      }
      ++mine.first;
    }
    return Status::Ok();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

TEST(StepPrefetcher, ErrorsArriveAtTheirStep) {
  TempDir dir;
  const std::string data = BrokenJsonl(dir);
  for (const Case& c : {kCases[2], kCases[4], kCases[6]}) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob(data, c, 8, /*shuffle=*/false);
    const auto plain = FailAt(job, 0);
    for (int depth : {1, 3}) {
      const auto ahead = FailAt(job, depth);
      for (size_t r = 0; r < plain.size(); ++r) {
        EXPECT_EQ(plain[r].first, 2) << "rank " << r << ": " << plain[r].second.ToString();
        EXPECT_FALSE(plain[r].second.ok()) << r;
        EXPECT_EQ(ahead[r].first, plain[r].first) << "depth " << depth << " rank " << r;
        EXPECT_EQ(ahead[r].second.ToString(), plain[r].second.ToString())
            << "depth " << depth << " rank " << r;
      }
    }
  }
}

// Destroyed after one step with its thread up to 3 ahead, on every rank: nothing hangs, and the
// world's own collectives still work.
TEST(StepPrefetcher, DestroyedMidRunLeavesNoRankWaiting) {
  for (const Case& c : {kCases[3], kCases[5], kCases[7]}) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob("mock", c, 24);
    const StepRunnerOptions options = RunnerOptions(job);
    const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
      for (int taken : {0, 1, 2}) {
        THDPACK_ASSIGN_OR_RETURN(auto ahead, StepPrefetcher::Create(w, job.topology, options, 3));
        for (int s = 0; s < taken; ++s) THDPACK_RETURN_IF_ERROR(ahead->Next().status());
      }
      int64_t one = 1;
      THDPACK_RETURN_IF_ERROR(w.AllReduceInt64(std::span<int64_t>(&one, 1), ReduceOp::kSum));
      if (one != w.size()) return Status::Internal("the world's all-reduce is wrong after");
      return Status::Ok();
    });
    for (size_t r = 0; r < statuses.size(); ++r) {
      EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
    }
  }
}

TEST(StepPrefetcher, BadDepthAndStepsAreRefused) {
  const Job job = MakeJob("mock", kCases[0], 8);
  const StepRunnerOptions options = RunnerOptions(job);
  const auto statuses = RunOnThreads(2, [&](ProcessGroup& w) -> Status {
    for (int depth : {0, -1, 65}) {
      auto p = StepPrefetcher::Create(w, job.topology, options, depth);
      if (p.ok() || p.status().message().find("depth = " + std::to_string(depth)) ==
                        std::string::npos) {
        return Status::Internal("depth " + std::to_string(depth) + ": " + p.status().ToString());
      }
    }
    auto p = StepPrefetcher::Create(w, job.topology, options, 1, -2);
    if (p.ok() || p.status().message().find("steps = -2") == std::string::npos) {
      return Status::Internal("steps -2: " + p.status().ToString());
    }
    return Status::Ok();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.ok()) << s.ToString();
}

}  // namespace
}  // namespace thdpack
