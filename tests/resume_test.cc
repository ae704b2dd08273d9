// Resuming the distributed step (StepRunner::Restore, StepRunnerOptions::start_step) on the
// thread backend, for every source kind: the samples of every step after a resume are those of
// an uninterrupted run, on any of several topologies and both scheduler kinds (the elastic
// rule); at the same topology every rank's tensors are byte for byte those of the
// uninterrupted run; the state is the same on every rank and the same whatever the topology;
// a state taken at an epoch's last step, at a step crossing into the next epoch and before the
// first step resumes exactly; a new global batch continues from the saved stream position;
// and a state that does not fit is refused by name on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "step_checks.h"
#include "thdpack/comm.h"
#include "thdpack/job.h"
#include "thdpack/megatron_dataset.h"
#include "thdpack/run_state.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::WriteText;

struct Topo {
  int tp, cp, dp, pp;
  bool sp;
  const char* data_on;
  const char* scheduler;
};

// Six static topologies and three dynamic ones, data on tp0 and on every rank.
const Topo kTopologies[] = {
    {1, 1, 1, 1, false, "tp0", "balanced"},  {1, 2, 2, 1, false, "tp0", "balanced"},
    {2, 1, 2, 1, true, "tp0", "sequential"}, {1, 1, 4, 1, false, "all", "balanced"},
    {2, 2, 1, 2, true, "tp0", "balanced"},   {1, 1, 3, 2, false, "tp0", "sequential"},
    {1, 2, 2, 1, false, "tp0", "dynamic"},   {1, 1, 4, 1, false, "all", "dynamic"},
    {2, 1, 3, 1, false, "tp0", "dynamic"},
};

std::string Name(const Topo& t) {
  return "tp" + std::to_string(t.tp) + " cp" + std::to_string(t.cp) + " dp" +
         std::to_string(t.dp) + " pp" + std::to_string(t.pp) + (t.sp ? " sp " : " ") +
         t.data_on + " " + t.scheduler;
}

Job MakeJob(const std::string& data, const Topo& t, int64_t global_batch, bool shuffle,
            int64_t start_step = 0) {
  JobOptions o;
  o.data = data;
  o.tp = t.tp;
  o.cp = t.cp;
  o.dp = t.dp;
  o.pp = t.pp;
  o.sp = t.sp;
  o.data_on = t.data_on;
  o.scheduler = t.scheduler;
  o.global_batch = global_batch;
  o.max_tokens_per_rank = 16384;  // the built-in mock reaches 16384 tokens
  o.source.shuffle = shuffle;
  o.source.seed = 77;
  o.source.mock_num_samples = 29;  // the mock's epochs end mid-step
  o.start_step = start_step;
  o.timeout = 60;
  auto job = ResolveJob(o);
  EXPECT_TRUE(job.ok()) << job.status().ToString();
  return *job;
}

struct StepRecord {
  int64_t step = 0;
  std::vector<int64_t> ids;  // the step's sample ids, sorted
  RunState after;
};

struct RunResult {
  std::vector<StepRecord> steps;
  std::vector<std::vector<RankStep>> ranks;  // [rank][step]
  RunState start;
};

// `steps` steps of `job` on one thread per rank, restored from `state` when given. Every rank's
// state (at the start and after each step) must equal world rank 0's.
RunResult RunSteps(const Job& job, int64_t steps, const std::optional<RunState>& state) {
  const int world = job.topology.world_size();
  RunResult out;
  out.ranks.assign(static_cast<size_t>(world), {});
  std::vector<RunState> starts(static_cast<size_t>(world));
  const StepRunnerOptions options = RunnerOptions(job);
  const std::vector<Status> statuses = RunOnThreads(world, [&](ProcessGroup& w) -> Status {
    THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, options));
    if (state) THDPACK_RETURN_IF_ERROR(runner->Restore(*state));
    starts[static_cast<size_t>(w.rank())] = runner->state();
    for (int64_t s = 0; s < steps; ++s) {
      THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
      if (!(step.after == runner->state())) return Status::Internal("state() is not the step's");
      out.ranks[static_cast<size_t>(w.rank())].push_back(std::move(step));
    }
    return Status::Ok();
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << statuses[static_cast<size_t>(r)].ToString();
  }
  if (!statuses[0].ok()) return out;
  out.start = starts[0];
  for (int r = 1; r < world; ++r) EXPECT_TRUE(starts[static_cast<size_t>(r)] == out.start);
  for (size_t s = 0; s < out.ranks[0].size(); ++s) {
    const RankStep& zero = out.ranks[0][s];
    StepRecord rec;
    rec.step = zero.step;
    for (const SampleLength& x : zero.samples) rec.ids.push_back(x.id);
    std::sort(rec.ids.begin(), rec.ids.end());
    rec.after = zero.after;
    for (int r = 1; r < world; ++r) {
      EXPECT_TRUE(out.ranks[static_cast<size_t>(r)][s].after == rec.after)
          << "rank " << r << " step " << rec.step << ": another state than rank 0's";
    }
    out.steps.push_back(std::move(rec));
  }
  return out;
}

// The sources of the test, written to `dir`: every kind, shuffled where it can be.
struct SourceCase {
  std::string data;
  bool shuffle;
};

std::vector<SourceCase> Sources(const TempDir& dir) {
  std::vector<SourceCase> out;
  out.push_back({"mock", false});
  out.push_back({"mock", true});
  std::string lengths;
  for (int i = 0; i < 31; ++i) lengths += std::to_string(1 + (i * 37) % 300) + "\n";
  WriteText(dir.File("l.txt"), lengths);
  out.push_back({"lengths:" + dir.File("l.txt"), true});
  WriteText(dir.File("h.csv"), "length,count\n5,7\n40,0\n64,11\n300,9\n");
  out.push_back({"histogram:" + dir.File("h.csv"), false});
  testing::WriteStepTestJsonl(dir.File("a.jsonl"), 27, 200, 5);
  out.push_back({"jsonl:" + dir.File("a.jsonl"), false});
  // Megatron with empty documents at both ends and inside.
  auto w = MegatronWriter::Create(dir.File("g"), MegatronDType::kUint16);
  EXPECT_TRUE(w.ok());
  for (int d = 0; d < 26; ++d) {
    if (d != 0 && d != 25 && d % 7 != 3) {
      std::vector<int64_t> seq(static_cast<size_t>(1 + (d * 53) % 250), d);
      EXPECT_TRUE((*w)->AddSequence(seq).ok());
    }
    EXPECT_TRUE((*w)->EndDocument().ok());
  }
  EXPECT_TRUE((*w)->Finish().ok());
  out.push_back({"megatron:" + dir.File("g"), false});
  out.push_back({"megatron:" + dir.File("g"), true});
  return out;
}

constexpr int64_t kBatch = 10;
constexpr int64_t kSteps = 7;  // about three epochs of every source

// Over every source: an uninterrupted run at one topology, then from the state of every
// step a resume at another topology, each of the nine in turn; the sample ids of every later
// step and the states equal the uninterrupted run's.
TEST(ResumeTest, SamplesOfEveryStepDoNotDependOnTheTopology) {
  TempDir dir;
  for (const SourceCase& src : Sources(dir)) {
    SCOPED_TRACE(src.data + (src.shuffle ? " shuffled" : ""));
    const RunResult whole = RunSteps(MakeJob(src.data, kTopologies[1], kBatch, src.shuffle), kSteps,
                               std::nullopt);
    ASSERT_EQ(whole.steps.size(), static_cast<size_t>(kSteps));
    // Every sample of the stream, in order, exactly once over the steps.
    std::vector<int64_t> all;
    for (const StepRecord& r : whole.steps) {
      EXPECT_EQ(static_cast<int64_t>(r.ids.size()), kBatch) << "step " << r.step;
      all.insert(all.end(), r.ids.begin(), r.ids.end());
    }
    EXPECT_TRUE(std::adjacent_find(all.begin(), all.end()) == all.end());
    EXPECT_EQ(whole.steps.back().after.consumed, kSteps * kBatch);
    int cut = 0;
    for (const Topo& t : kTopologies) {
      SCOPED_TRACE(Name(t));
      // A run of its own at this topology: the same samples and states step by step.
      const RunResult here = RunSteps(MakeJob(src.data, t, kBatch, src.shuffle), kSteps, std::nullopt);
      ASSERT_EQ(here.steps.size(), whole.steps.size());
      for (size_t s = 0; s < here.steps.size(); ++s) {
        EXPECT_EQ(here.steps[s].ids, whole.steps[s].ids) << "step " << s;
        EXPECT_TRUE(here.steps[s].after == whole.steps[s].after) << "step " << s;
      }
      // Resumed here from the state of step `cut` of the other topology's run.
      cut = (cut + 2) % (kSteps - 1);
      const RunState& saved = whole.steps[static_cast<size_t>(cut)].after;
      const std::string text = RunStateToJson(saved);
      auto parsed = ParseRunState(text);
      ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
      const RunResult resumed = RunSteps(MakeJob(src.data, t, kBatch, src.shuffle),
                                   kSteps - cut - 1, *parsed);
      EXPECT_TRUE(resumed.start == saved);
      ASSERT_EQ(resumed.steps.size(), static_cast<size_t>(kSteps - cut - 1));
      for (size_t s = 0; s < resumed.steps.size(); ++s) {
        const StepRecord& want = whole.steps[static_cast<size_t>(cut + 1) + s];
        EXPECT_EQ(resumed.steps[s].step, want.step);
        EXPECT_EQ(resumed.steps[s].ids, want.ids) << "step " << want.step;
        EXPECT_TRUE(resumed.steps[s].after == want.after) << "step " << want.step;
      }
    }
  }
}

// At the same topology a resumed run hands every rank the same bytes as the uninterrupted run,
// whether it resumes from a state or starts at a step; from the first step, an epoch's last
// step and a step that crosses into the next epoch.
TEST(ResumeTest, SameTopologyGivesByteIdenticalSteps) {
  TempDir dir;
  for (const SourceCase& src : Sources(dir)) {
    SCOPED_TRACE(src.data + (src.shuffle ? " shuffled" : ""));
    for (const Topo& t : {kTopologies[4], kTopologies[6]}) {
      SCOPED_TRACE(Name(t));
      const Job job = MakeJob(src.data, t, kBatch, src.shuffle);
      const RunResult whole = RunSteps(job, kSteps, std::nullopt);
      ASSERT_EQ(whole.steps.size(), static_cast<size_t>(kSteps));
      // The cuts: the start, and each step whose state ends or crosses an epoch.
      std::vector<int64_t> cuts = {0};
      for (size_t s = 0; s + 1 < whole.steps.size(); ++s) {
        const RankStep& a = whole.ranks[0][s];
        const RankStep& b = whole.ranks[0][s + 1];
        if (a.epoch != b.epoch || a.after.cursor->epoch != a.epoch) {
          cuts.push_back(static_cast<int64_t>(s) + 1);
        }
      }
      ASSERT_GE(cuts.size(), 2u) << "no step ends or crosses an epoch";
      for (int64_t cut : cuts) {
        SCOPED_TRACE("cut before step " + std::to_string(cut));
        const RunState& saved = cut == 0 ? whole.start : whole.steps[cut - 1].after;
        for (int by_step = 0; by_step < 2; ++by_step) {
          const RunResult resumed =
              by_step ? RunSteps(MakeJob(src.data, t, kBatch, src.shuffle, cut), kSteps - cut,
                                 std::nullopt)
                      : RunSteps(job, kSteps - cut, saved);
          ASSERT_EQ(resumed.ranks[0].size(), static_cast<size_t>(kSteps - cut));
          for (size_t r = 0; r < resumed.ranks.size(); ++r) {
            for (size_t s = 0; s < resumed.ranks[r].size(); ++s) {
              const RankStep& got = resumed.ranks[r][s];
              const RankStep& want = whole.ranks[r][static_cast<size_t>(cut) + s];
              const std::string where = "rank " + std::to_string(r) + " step " +
                                        std::to_string(want.step) +
                                        (by_step ? " (--start-step)" : " (state)");
              EXPECT_EQ(got.step, want.step) << where;
              EXPECT_EQ(got.epoch, want.epoch) << where;
              EXPECT_EQ(got.n_empty, want.n_empty) << where;
              EXPECT_TRUE(got.meta == want.meta) << where;
              EXPECT_TRUE(got.after == want.after) << where;
              ASSERT_EQ(got.microbatches.size(), want.microbatches.size()) << where;
              for (size_t m = 0; m < got.microbatches.size(); ++m) {
                const LocalMicrobatch& x = got.microbatches[m];
                const LocalMicrobatch& y = want.microbatches[m];
                EXPECT_EQ(x.tokens, y.tokens) << where << " mb " << m;
                EXPECT_EQ(x.position_ids, y.position_ids) << where << " mb " << m;
                EXPECT_EQ(x.labels, y.labels) << where << " mb " << m;
                EXPECT_EQ(x.loss_mask, y.loss_mask) << where << " mb " << m;
                EXPECT_EQ(x.cu_seqlens, y.cu_seqlens) << where << " mb " << m;
                EXPECT_EQ(x.cu_seqlens_padded, y.cu_seqlens_padded) << where << " mb " << m;
                EXPECT_EQ(x.cp_size, y.cp_size) << where << " mb " << m;
                EXPECT_EQ(x.cp_rank, y.cp_rank) << where << " mb " << m;
              }
            }
          }
        }
      }
    }
  }
}

// A global batch that changes on resume (a ramp-up): the next step takes its samples from the
// saved stream position, so the samples of the whole run are still the stream in order,
// exactly once.
TEST(ResumeTest, ANewGlobalBatchContinuesFromTheStreamPosition) {
  TempDir dir;
  for (const SourceCase& src : Sources(dir)) {
    SCOPED_TRACE(src.data + (src.shuffle ? " shuffled" : ""));
    const RunResult ramp1 = RunSteps(MakeJob(src.data, kTopologies[1], 6, src.shuffle), 3, std::nullopt);
    ASSERT_EQ(ramp1.steps.size(), 3u);
    const RunResult ramp2 = RunSteps(MakeJob(src.data, kTopologies[3], 11, src.shuffle), 3,
                               ramp1.steps.back().after);
    ASSERT_EQ(ramp2.steps.size(), 3u);
    EXPECT_EQ(ramp2.steps.front().step, 3);
    // The reference: one run of a single step holding the same 51 samples.
    const RunResult one = RunSteps(MakeJob(src.data, kTopologies[0], 51, src.shuffle), 1, std::nullopt);
    ASSERT_EQ(one.steps.size(), 1u);
    std::vector<int64_t> got;
    for (const RunResult* r : {&ramp1, &ramp2}) {
      for (const StepRecord& s : r->steps) got.insert(got.end(), s.ids.begin(), s.ids.end());
    }
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, one.steps[0].ids);
    EXPECT_EQ(ramp2.steps.back().after.consumed, 51);
    EXPECT_TRUE(ramp2.steps.back().after.cursor == one.steps[0].after.cursor);
  }
}

// Steps counted in tokens resume the same way: a run in steps of 20,000 tokens, saved after 3
// steps and resumed at another topology in steps of 50,000 tokens (or of 6 samples),
// continues from the saved position: the samples of both parts are those of one step holding
// them all, each once.
TEST(ResumeTest, TokenStepsContinueFromTheStreamPosition) {
  TempDir dir;
  for (const SourceCase& src : Sources(dir)) {
    SCOPED_TRACE(src.data + (src.shuffle ? " shuffled" : ""));
    Job first = MakeJob(src.data, kTopologies[1], 6, src.shuffle);
    first.options.global_batch_tokens = 20000;
    const RunResult part1 = RunSteps(first, 3, std::nullopt);
    ASSERT_EQ(part1.steps.size(), 3u);
    for (const bool in_tokens : {true, false}) {
      Job second = MakeJob(src.data, kTopologies[3], 6, src.shuffle);
      if (in_tokens) second.options.global_batch_tokens = 50000;
      const RunResult part2 = RunSteps(second, 2, part1.steps.back().after);
      ASSERT_EQ(part2.steps.size(), 2u);
      EXPECT_EQ(part2.steps.front().step, 3);
      const int64_t n = part2.steps.back().after.consumed;
      const RunResult one = RunSteps(MakeJob(src.data, kTopologies[0], n, src.shuffle), 1,
                                     std::nullopt);
      std::vector<int64_t> got;
      for (const RunResult* r : {&part1, &part2}) {
        for (const StepRecord& s : r->steps) got.insert(got.end(), s.ids.begin(), s.ids.end());
      }
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, one.steps[0].ids);
      EXPECT_TRUE(part2.steps.back().after.cursor == one.steps[0].after.cursor);
    }
  }
}

// A state that does not fit is refused on every rank, naming the field; a state restored after
// a step is refused; a state of fed data does not resume a file source.
TEST(ResumeTest, RefusesAStateThatDoesNotFit) {
  TempDir dir;
  const Topo& t = kTopologies[1];
  const Job job = MakeJob("mock", t, kBatch, true);
  const RunResult whole = RunSteps(job, 2, std::nullopt);
  ASSERT_EQ(whole.steps.size(), 2u);
  RunState other_seed = whole.steps[1].after;
  other_seed.data.seed = 78;
  RunState fed = whole.steps[1].after;
  fed.data = DataFingerprint{};
  fed.cursor.reset();
  for (const RunState* bad : {&other_seed, &fed}) {
    const std::vector<Status> statuses =
        RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
          THDPACK_ASSIGN_OR_RETURN(auto runner,
                                   StepRunner::Create(w, job.topology, RunnerOptions(job)));
          return runner->Restore(*bad);
        });
    for (const Status& s : statuses) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
      EXPECT_TRUE(Contains(s.message(), bad == &fed ? "a source of kind \"fed\""
                                                    : "seed 78, this run has seed 77"))
          << s.ToString();
    }
  }
  const std::vector<Status> late =
      RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
        THDPACK_ASSIGN_OR_RETURN(auto runner,
                                 StepRunner::Create(w, job.topology, RunnerOptions(job)));
        THDPACK_RETURN_IF_ERROR(runner->Next().status());
        return runner->Restore(whole.steps[1].after);
      });
  for (const Status& s : late) {
    EXPECT_TRUE(Contains(s.message(), "before the first step")) << s.ToString();
  }
  // A cursor the file refuses (a jsonl offset inside a line, with a fingerprint that fits):
  // the readers fail the next step's read phase, and every rank gets the error.
  testing::WriteStepTestJsonl(dir.File("b.jsonl"), 20, 50, 3);
  const Job jl = MakeJob("jsonl:" + dir.File("b.jsonl"), t, kBatch, false);
  const RunResult jrun = RunSteps(jl, 1, std::nullopt);
  ASSERT_EQ(jrun.steps.size(), 1u);
  RunState moved = jrun.steps[0].after;
  moved.cursor->byte_offset -= 3;
  const std::vector<Status> statuses =
      RunOnThreads(jl.topology.world_size(), [&](ProcessGroup& w) -> Status {
        THDPACK_ASSIGN_OR_RETURN(auto runner,
                                 StepRunner::Create(w, jl.topology, RunnerOptions(jl)));
        THDPACK_RETURN_IF_ERROR(runner->Restore(moved));
        return runner->Next().status();
      });
  for (const Status& s : statuses) {
    EXPECT_FALSE(s.ok());
  }
  EXPECT_TRUE(Contains(statuses[0].message(), "not at the start of a line"))
      << statuses[0].ToString();
}

}  // namespace
}  // namespace thdpack
