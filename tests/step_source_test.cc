// StepSource (thdpack/step_runner.h) on the thread backend: at depths 0, 1, 2 and 3 every rank's
// steps - tensors, metadata, CP groups, state - are those of the runner's own Next(), for the
// static schedulers and the dynamic one, at worlds of 2, 4 and 6 ranks; a source that fails in
// step 2 fails there with the same error (steps 0 and 1 delivered first), whatever the depth; a
// caller-fed source that ends on every loader ends the stream (kEndOfData) on every rank at
// every depth, one that ends on some loaders only is an error on every rank; the on_step hook
// runs once per step on the thread that made it, and its failure on one rank is the step's
// error on every rank; a source closed or destroyed mid-run with its thread ahead leaves no rank
// waiting (the world still answers); a restored source continues where the state says; bad
// depths are refused.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "thdpack/comm.h"
#include "thdpack/job.h"
#include "thdpack/run_state.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

using testing_util::TempDir;

StepSourceOptions Ahead(int depth, int64_t steps = -1) {
  StepSourceOptions o;
  o.depth = depth;
  o.steps = steps;
  return o;
}

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

// [rank][step] digests of `steps` steps: the runner's own Next() (depth -1) or a source's.
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
    if (depth < 0) {
      THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, options));
      if (state) THDPACK_RETURN_IF_ERROR(runner->Restore(*state));
      for (int64_t s = 0; s < steps; ++s) {
        THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
        mine.push_back(Digest(step, group_counts));
      }
      return Status::Ok();
    }
    THDPACK_ASSIGN_OR_RETURN(auto ahead, StepSource::Create(w, job.topology, options,
                                                            Ahead(depth, steps)));
    if (state) THDPACK_RETURN_IF_ERROR(ahead->Restore(*state));
    for (int64_t s = 0; s < steps; ++s) {
      double waited = -1;
      THDPACK_ASSIGN_OR_RETURN(RankStep step, ahead->Next(&waited));
      if (waited < 0) return Status::Internal("Next did not say how long it waited");
      if (!(ahead->state() == step.after)) return Status::Internal("state() is not the step's");
      mine.push_back(Digest(step, group_counts));
    }
    // Past the steps it was made for: the end, not a wait, and again at the next call.
    for (int again = 0; again < 2; ++again) {
      Result<RankStep> more = ahead->Next();
      if (more.ok() || more.status().code() != StatusCode::kEndOfData) {
        return Status::Internal("a step past `steps`: " + more.status().ToString());
      }
    }
    return Status::Ok();
  });
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
  return out;
}

TEST(StepSource, StepsEqualTheRunnersOwnAtEveryDepth) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob("mock", c, 24);
    const auto plain = RunSteps(job, -1, 5);
    for (int depth : {0, 1, 2, 3}) {
      const auto ahead = RunSteps(job, depth, 5);
      ASSERT_EQ(ahead.size(), plain.size());
      for (size_t r = 0; r < plain.size(); ++r) {
        ASSERT_EQ(plain[r].size(), 5u) << "rank " << r;
        ASSERT_EQ(ahead[r].size(), 5u) << "rank " << r;
        for (size_t s = 0; s < plain[r].size(); ++s) {
          EXPECT_EQ(ahead[r][s], plain[r][s])
              << "depth " << depth << " rank " << r << " step " << s;
        }
      }
    }
  }
}

TEST(StepSource, RestoredContinuesAtTheState) {
  for (const Case& c : {kCases[2], kCases[4]}) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob("mock", c, 24);
    const auto plain = RunSteps(job, -1, 5, std::nullopt, /*group_counts=*/false);
    // The state after step 1, from a run of two steps.
    std::optional<RunState> after1;
    const StepRunnerOptions options = RunnerOptions(job);
    const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
      THDPACK_ASSIGN_OR_RETURN(auto ahead, StepSource::Create(w, job.topology, options, Ahead(2)));
      for (int s = 0; s < 2; ++s) THDPACK_RETURN_IF_ERROR(ahead->Next().status());
      // The state of the last step handed out, not of those the thread made beyond it.
      if (w.rank() == 0) after1 = ahead->state();
      return Status::Ok();
    });
    for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(after1.has_value());
    EXPECT_EQ(after1->next_step, 2);
    for (int depth : {0, 2}) {
      const auto resumed = RunSteps(job, depth, 3, after1, /*group_counts=*/false);
      for (size_t r = 0; r < plain.size(); ++r) {
        ASSERT_EQ(resumed[r].size(), 3u);
        for (size_t s = 0; s < 3; ++s) {
          EXPECT_EQ(resumed[r][s], plain[r][s + 2]) << depth << " " << r << " " << s;
        }
      }
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
    std::unique_ptr<StepSource> ahead;
    if (depth < 0) {
      THDPACK_ASSIGN_OR_RETURN(runner, StepRunner::Create(w, job.topology, options));
    } else {
      THDPACK_ASSIGN_OR_RETURN(ahead, StepSource::Create(w, job.topology, options, Ahead(depth)));
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

TEST(StepSource, ErrorsArriveAtTheirStep) {
  TempDir dir;
  const std::string data = BrokenJsonl(dir);
  for (const Case& c : {kCases[2], kCases[4], kCases[6]}) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob(data, c, 8, /*shuffle=*/false);
    const auto plain = FailAt(job, -1);
    for (int depth : {0, 1, 3}) {
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

// Closed or destroyed after 0, 1 or 2 steps with its thread up to 3 ahead, on every rank:
// nothing hangs, and the world's own collectives still work.
TEST(StepSource, ClosedMidRunLeavesNoRankWaiting) {
  for (const Case& c : {kCases[3], kCases[5], kCases[7]}) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob("mock", c, 24);
    const StepRunnerOptions options = RunnerOptions(job);
    const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
      for (int taken : {0, 1, 2}) {
        for (bool close : {false, true}) {
          THDPACK_ASSIGN_OR_RETURN(auto ahead,
                                   StepSource::Create(w, job.topology, options, Ahead(3)));
          for (int s = 0; s < taken; ++s) THDPACK_RETURN_IF_ERROR(ahead->Next().status());
          if (close) {
            THDPACK_RETURN_IF_ERROR(ahead->Close(60));
            THDPACK_RETURN_IF_ERROR(ahead->Close(60));  // idempotent
            Result<RankStep> after = ahead->Next();
            if (after.ok() || after.status().code() != StatusCode::kInvalidArgument) {
              return Status::Internal("Next after Close: " + after.status().ToString());
            }
          }
        }
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

// A caller-fed source of mock-like samples: loader d has `steps_of(d)` steps of its share, then
// says kEndOfData. Ids by the fed rule (FedShares).
StepRunnerOptions FedOptions(const Job& job, std::function<int64_t(int)> steps_of) {
  StepRunnerOptions o = RunnerOptions(job);
  const int64_t n = job.options.global_batch;
  const int dp = job.topology.dp_size();
  o.read_share = [n, dp, steps_of](int64_t step, int64_t first_position,
                                   int loader) -> Result<StepShare> {
    if (step >= steps_of(loader)) return Status::EndOfData("loader's iterable ended (test)");
    std::vector<Sample> mine;
    for (int64_t k = 0; k < LoaderCount(n, dp, loader); ++k) {
      Sample x;
      const int64_t length = 5 + (first_position + k * dp + loader) * 37 % 90;
      for (int64_t t = 0; t < length; ++t) x.tokens.push_back(static_cast<TokenId>(t * 7 % 500));
      mine.push_back(std::move(x));
    }
    THDPACK_ASSIGN_OR_RETURN(const FedShares fed, FedShares::Create(n, dp));
    return fed.Share(step, first_position, loader, std::move(mine));
  };
  return o;
}

// Every loader's source ends after step 2: the stream ends there on every rank at every depth
// (kEndOfData, again at the next call), after the same three steps; where loader 0's ends a
// step early, every rank gets the error naming the count, at step 2.
TEST(StepSource, FedSourceEndsOnEveryRank) {
  for (const Case& c : {kCases[0], kCases[4], kCases[6], kCases[7]}) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob("mock", c, 12);
    for (bool uneven : {false, true}) {
      const StepRunnerOptions options =
          FedOptions(job, [uneven](int loader) -> int64_t {
            return uneven && loader == 0 ? 2 : 3;
          });
      for (int depth : {0, 1, 2}) {
        SCOPED_TRACE("depth " + std::to_string(depth) + (uneven ? " uneven" : " even"));
        const int world = job.topology.world_size();
        const auto statuses = RunOnThreads(world, [&](ProcessGroup& w) -> Status {
          THDPACK_ASSIGN_OR_RETURN(auto source,
                                   StepSource::Create(w, job.topology, options, Ahead(depth)));
          int steps = 0;
          Result<RankStep> next = source->Next();
          for (; next.ok(); next = source->Next()) ++steps;
          if (steps != (uneven ? 2 : 3)) {
            return Status::Internal(std::to_string(steps) + " steps before the end");
          }
          if (uneven) {
            if (next.status().code() != StatusCode::kInvalidArgument ||
                next.status().message().find("ran out of samples at step 2 while") ==
                    std::string::npos) {
              return Status::Internal("uneven end: " + next.status().ToString());
            }
            return Status::Ok();
          }
          if (next.status().code() != StatusCode::kEndOfData) {
            return Status::Internal("end: " + next.status().ToString());
          }
          if (source->state().next_step != 3) return Status::Internal("state after the end");
          Result<RankStep> again = source->Next();
          return again.status().code() == StatusCode::kEndOfData
                     ? Status::Ok()
                     : Status::Internal("again: " + again.status().ToString());
        });
        for (size_t r = 0; r < statuses.size(); ++r) {
          EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
        }
      }
    }
  }
}

// The hook runs once per step, on the thread that made it (the caller's at depth 0, another at
// depth >= 1) over the communicator it was made on, and what it puts in `prepared` arrives
// with the step; its failure on one rank at step 1 is step 1's error on every rank.
TEST(StepSource, OnStepRunsWhereTheStepIsMade) {
  const Case& c = kCases[4];
  const Job job = MakeJob("mock", c, 24);
  const StepRunnerOptions options = RunnerOptions(job);
  for (int depth : {0, 1, 2}) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    for (bool fail : {false, true}) {
      const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
        const std::thread::id caller = std::this_thread::get_id();
        StepSourceOptions so = Ahead(depth);
        so.on_step = [&, caller](ProcessGroup& comm, RankStep& step) -> Status {
          if ((std::this_thread::get_id() == caller) != (depth == 0)) {
            return Status::Internal("on_step on the wrong thread");
          }
          // A collective over the step's communicator: every rank is here for every step.
          int64_t one = 1;
          THDPACK_RETURN_IF_ERROR(comm.AllReduceInt64(std::span<int64_t>(&one, 1), ReduceOp::kSum));
          if (fail && step.step == 1 && w.rank() == 1) {
            return Status::IOError("hook of rank 1 failed (test)");
          }
          step.prepared = std::make_shared<int64_t>(step.step * 100 + one);
          return Status::Ok();
        };
        THDPACK_ASSIGN_OR_RETURN(auto source,
                                 StepSource::Create(w, job.topology, options, std::move(so)));
        for (int s = 0; s < 3; ++s) {
          Result<RankStep> step = source->Next();
          if (fail && s == 1) {
            const bool named = step.status().message().find("hook of rank 1 failed") !=
                               std::string::npos;
            return !step.ok() && named ? Status::Ok()
                                       : Status::Internal("step 1: " + step.status().ToString());
          }
          THDPACK_RETURN_IF_ERROR(step.status());
          const auto* got = static_cast<const int64_t*>(step->prepared.get());
          if (got == nullptr || *got != s * 100 + w.size()) {
            return Status::Internal("prepared of step " + std::to_string(s));
          }
        }
        return fail ? Status::Internal("no failure") : Status::Ok();
      });
      for (size_t r = 0; r < statuses.size(); ++r) {
        EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
      }
    }
  }
}

// Closed from its own thread (what a hook's garbage collector does to a dropped source): the
// call returns at once, the thread finishes its steps and frees the source itself; the other
// ranks, closing from their callers, see nothing hang.
TEST(StepSource, ClosedFromItsOwnThread) {
  const Job job = MakeJob("mock", kCases[0], 24);
  const StepRunnerOptions options = RunnerOptions(job);
  const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
    std::unique_ptr<StepSource> source;
    std::mutex mu;
    // Held by the hook, so by the source: expired once the source is freed, wherever.
    auto alive = std::make_shared<int>(0);
    const std::weak_ptr<int> freed = alive;
    StepSourceOptions so = Ahead(2);
    so.on_step = [&, alive](ProcessGroup&, RankStep& step) -> Status {
      if (step.step == 2 && w.rank() == 0) {
        std::lock_guard<std::mutex> lk(mu);
        source.reset();  // destroyed here, on the source's thread
      }
      return Status::Ok();
    };
    {
      std::lock_guard<std::mutex> lk(mu);
      THDPACK_ASSIGN_OR_RETURN(source, StepSource::Create(w, job.topology, options, std::move(so)));
      THDPACK_RETURN_IF_ERROR(source->Next().status());  // step 0; the thread makes 1 and 2
    }
    if (w.rank() != 0) source.reset();  // the caller's Close: fills to depth, joins
    alive.reset();
    // Until the source is freed (by the thread on rank 0): its communicator is the world's.
    while (!freed.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    int64_t one = 1;
    THDPACK_RETURN_IF_ERROR(w.AllReduceInt64(std::span<int64_t>(&one, 1), ReduceOp::kSum));
    return one == w.size() ? Status::Ok() : Status::Internal("world after");
  });
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
}

TEST(StepSource, BadDepthAndStepsAreRefused) {
  const Job job = MakeJob("mock", kCases[0], 8);
  const StepRunnerOptions options = RunnerOptions(job);
  const auto statuses = RunOnThreads(2, [&](ProcessGroup& w) -> Status {
    for (int depth : {-1, 65}) {
      auto p = StepSource::Create(w, job.topology, options, Ahead(depth));
      if (p.ok() || p.status().message().find("depth = " + std::to_string(depth)) ==
                        std::string::npos) {
        return Status::Internal("depth " + std::to_string(depth) + ": " + p.status().ToString());
      }
    }
    auto p = StepSource::Create(w, job.topology, options, Ahead(1, -2));
    if (p.ok() || p.status().message().find("steps = -2") == std::string::npos) {
      return Status::Internal("steps -2: " + p.status().ToString());
    }
    return Status::Ok();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.ok()) << s.ToString();
}

}  // namespace
}  // namespace thdpack
