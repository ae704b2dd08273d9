// The job configuration (thdpack/job.h): one validation whose errors name the option, the
// step default of --global-batch all, the cost parsed once, and the run core against the plan
// core: at several world sizes (threads), every step `run` reports has plan's figures.
#include "thdpack/job.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>

#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::TempDir;
using testing_util::WriteText;

void ExpectError(const JobOptions& o, const std::string& option) {
  Result<Job> job = ResolveJob(o);
  ASSERT_FALSE(job.ok()) << option;
  EXPECT_EQ(job.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(job.status().message().rfind(option + ":", 0), 0u) << job.status().ToString();
}

TEST(Job, ErrorsNameTheOption) {
  JobOptions o;
  o.dp = 0;
  ExpectError(o, "--dp");
  Result<Job> job = ResolveJob(o);
  EXPECT_EQ(job.status().message(), "--dp: must be >= 1, got 0");
  o = JobOptions{};
  o.max_tokens_per_rank = 0;
  ExpectError(o, "--max-tokens-per-rank");
  o = JobOptions{};
  o.steps = 0;
  ExpectError(o, "--steps");
  o = JobOptions{};
  o.cost = "bogus";
  ExpectError(o, "--cost");
  o = JobOptions{};
  o.scheduler = "fastest";
  ExpectError(o, "--scheduler");
  o = JobOptions{};
  o.oversize = "drop";
  ExpectError(o, "--oversize");
  o = JobOptions{};
  o.microbatch_multiple = 2;
  o.num_microbatches = 3;
  ExpectError(o, "--num-microbatches");
  o = JobOptions{};
  o.logits_dtype = "fp16";
  ExpectError(o, "--logits-dtype");
  o = JobOptions{};
  o.vocab_size = -1;
  ExpectError(o, "--vocab-size");
  o = JobOptions{};
  o.data_on = "tp1";
  ExpectError(o, "--data-on");
  o = JobOptions{};
  o.max_cp_groups = 0;
  ExpectError(o, "--max-cp-groups");
  o = JobOptions{};
  o.rank_multiple = 0;
  ExpectError(o, "--rank-multiple");
  EXPECT_EQ(ResolveJob(o).status().message(), "--rank-multiple: must be >= 1, got 0");
  o.rank_multiple = int64_t{1} << 31;  // times CP = 1 does not fit int32
  ExpectError(o, "--cp/--tp/--sp/--align/--rank-multiple");
  // A rank multiple no microbatch can meet within the budget: CP 2 x 16 = 32 < lcm(4, 2 * 32).
  o = JobOptions{};
  o.cp = 2;
  o.max_tokens_per_rank = 16;
  o.rank_multiple = 32;
  ExpectError(o, "--max-tokens-per-rank");
  EXPECT_NE(ResolveJob(o).status().message().find("below the token quantum 64"),
            std::string::npos)
      << ResolveJob(o).status().message();
  o.rank_multiple = 8;
  EXPECT_TRUE(ResolveJob(o).ok());
  // Options that make no sense together.
  o = JobOptions{};
  o.sp = true;
  ExpectError(o, "--sp");
  EXPECT_NE(ResolveJob(o).status().message().find("needs --tp > 1, got --tp 1"),
            std::string::npos);
  o.tp = 2;
  EXPECT_TRUE(ResolveJob(o).ok());
  for (double t : {0.0, -1.0, std::nan(""), 1e12}) {
    o = JobOptions{};
    o.timeout = t;
    ExpectError(o, "--timeout");
  }
}

// --timeout reaches the world of RunJobOnRank (and so every group the step splits from it).
// What the user did not give is defaulted: listed by the job, said by an error that names it
// (as a keyword argument or as the command line's flag), never said of an option given.
TEST(Job, DefaultedOptionsAreListedAndSaidInErrors) {
  JobOptions o;
  o.given = std::vector<std::string>{"cp", "dp"};
  o.cp = 1 << 20;  // CP x the default max_tokens_per_rank overflows int32
  const Result<Job> job = ResolveJob(o);
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("--max-tokens-per-rank: CP * max tokens per rank"),
            std::string::npos)
      << job.status().ToString();
  EXPECT_NE(job.status().message().find("(max_tokens_per_rank defaulted)"), std::string::npos)
      << job.status().ToString();
  o.given->push_back("max_tokens_per_rank");  // given: nothing said
  EXPECT_EQ(ResolveJob(o).status().message().find("defaulted"), std::string::npos);
  o.given.reset();  // unknown: nothing said either
  EXPECT_EQ(ResolveJob(o).status().message().find("defaulted"), std::string::npos);

  JobOptions fine;
  fine.given = std::vector<std::string>{"dp", "cost"};
  const Job ok = ResolveJob(fine).value();
  EXPECT_EQ(ok.defaulted.size(), std::size(kJobOptionNames) - 2);
  EXPECT_EQ(std::count(ok.defaulted.begin(), ok.defaulted.end(), "cost"), 0);
  EXPECT_EQ(std::count(ok.defaulted.begin(), ok.defaulted.end(), "max_tokens_per_rank"), 1);
  EXPECT_EQ(RunnerOptions(ok).defaulted, ok.defaulted);
  EXPECT_EQ(JobOptionFlag("max_seqs"), "--max-seqs-per-microbatch");
  EXPECT_EQ(JobOptionFlag("max_tokens_per_rank"), "--max-tokens-per-rank");
  // A word, not a part of one: "cp" is not said of "cp_sizes".
  const std::vector<std::string> cp = {"cp"};
  EXPECT_EQ(SayDefaulted(Status::InvalidArgument("cp_sizes: bad"), cp).message(),
            "cp_sizes: bad");
  EXPECT_EQ(SayDefaulted(Status::InvalidArgument("--cp: bad"), cp).message(),
            "--cp: bad (cp defaulted)");
}

TEST(Job, RunSetsTheTimeoutOnItsWorld) {
  JobOptions o;
  o.global_batch = 8;
  o.steps = 1;
  o.dp = 2;
  o.timeout = 12.5;
  Result<Job> job = ResolveJob(o);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  Result<RunSetup> run = ResolveRun(*job, RunOptions{});
  ASSERT_TRUE(run.ok());
  auto statuses = RunOnThreads(2, [&](ProcessGroup& world) -> Status {
    THDPACK_RETURN_IF_ERROR(RunJobOnRank(world, *job, *run, {}));
    if (world.timeout() != std::chrono::milliseconds(12500)) {
      return Status::Internal("timeout " + std::to_string(world.timeout().count()) + " ms");
    }
    return Status::Ok();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(Job, GlobalBatchTextIsStrict) {
  EXPECT_EQ(*ParseGlobalBatch("all"), 0);
  EXPECT_EQ(*ParseGlobalBatch("12"), 12);
  for (const char* bad : {"", "0", "-1", "ten", "12x", " 12", "1e3", "1234567890123456789"}) {
    Result<int64_t> v = ParseGlobalBatch(bad);
    ASSERT_FALSE(v.ok()) << bad;
    EXPECT_EQ(v.status().message().rfind("--global-batch: \"" + std::string(bad) + "\"", 0), 0u)
        << v.status().ToString();
  }
}

// A step whose samples alone need more than the memory limit is a named error before anything
// is allocated for it (it was an uncaught std::bad_alloc); the histogram bulk plan, which
// holds no sample, still plans 3 billion sequences in one step.
TEST(Job, StepsBeyondTheMemoryLimitAreNamedErrors) {
  JobOptions o;
  o.global_batch = 4000000000;
  Result<Job> job = ResolveJob(o);
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(job.status().message().rfind("--global-batch 4000000000: a step of 4000000000 "
                                         "samples needs at least 244140 MiB (64 bytes a sample)",
                                         0),
            0u)
      << job.status().message();
  // The limit is settable, and 0 means the physical memory.
  o.global_batch = 1000;
  o.memory_limit = 64 * 1000 - 1;
  job = ResolveJob(o);
  ASSERT_FALSE(job.ok());
  EXPECT_TRUE(testing_util::Contains(job.status().message(), "(--memory-limit)"))
      << job.status().message();
  o.memory_limit = 64 * 1000;
  ASSERT_TRUE(ResolveJob(o).ok());
  o.memory_limit = 0;
  job = ResolveJob(o);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->memory_limit, PhysicalMemoryBytes());
  EXPECT_GT(PhysicalMemoryBytes(), int64_t{1} << 26);
  o.memory_limit = -1;
  ExpectError(o, "--memory-limit");
  EXPECT_EQ(StepMemoryNeed(int64_t{1} << 62), INT64_MAX);

  // --global-batch all: the source's size is checked before the step is read.
  TempDir dir;
  WriteText(dir.File("h.csv"), "length,count\n5,3000000000\n");
  o = JobOptions{};
  o.data = "histogram:" + dir.File("h.csv");
  o.global_batch = 0;
  o.cost = "tokens";
  job = ResolveJob(o);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  Result<JobPlan> with_ids = PlanJob(*job, nullptr, /*sample_ids=*/true);
  ASSERT_FALSE(with_ids.ok());
  EXPECT_EQ(with_ids.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(with_ids.status().message().rfind("--global-batch all (histogram:" + dir.File("h.csv") +
                                              "): a step of 3000000000 samples needs at least",
                                              0),
            0u)
      << with_ids.status().message();
  // One row: the bulk plan does not apply (sequential and best-fit tie), so it is sample by
  // sample, and the same error.
  Result<JobPlan> one_row = PlanJob(*job, nullptr, /*sample_ids=*/false);
  ASSERT_FALSE(one_row.ok());
  EXPECT_EQ(one_row.status().code(), StatusCode::kResourceExhausted);
  // Where the bulk plan applies, 2 billion sequences plan in one step, without per-sample ids.
  WriteText(dir.File("h2.csv"), "length,count\n3000,1000000000\n9000,1000000000\n");
  o.data = "histogram:" + dir.File("h2.csv");
  job = ResolveJob(o);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  Result<JobPlan> bulk = PlanJob(*job, nullptr, /*sample_ids=*/false);
  ASSERT_TRUE(bulk.ok()) << bulk.status().ToString();
  EXPECT_EQ(bulk->steps.at(0).plan.n_samples, 2000000000);
  EXPECT_EQ(bulk->steps.at(0).plan.real_tokens, 12000000000000);
  EXPECT_EQ(PlanJob(*job, nullptr, /*sample_ids=*/true).status().code(),
            StatusCode::kResourceExhausted);

  EXPECT_EQ(ParseMemoryLimit("64G").value(), int64_t{64} << 30);
  EXPECT_EQ(ParseMemoryLimit("512M").value(), int64_t{512} << 20);
  EXPECT_EQ(ParseMemoryLimit("1000").value(), 1000);
  EXPECT_EQ(ParseMemoryLimit("0").value(), 0);
  for (const char* bad : {"", "G", "-1", "1.5G", "64GB", "99999999999T"}) {
    Result<int64_t> r = ParseMemoryLimit(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().message().rfind("--memory-limit: ", 0), 0u) << r.status().message();
  }
}

TEST(Job, StepsDefaultToOneWithAllAndThreeOtherwise) {
  JobOptions o;
  EXPECT_EQ(ResolveJob(o)->steps, 3);
  o.global_batch = 0;
  EXPECT_EQ(ResolveJob(o)->steps, 1);
  o.steps = 4;
  EXPECT_EQ(ResolveJob(o)->steps, 4);
}

TEST(Job, ScheduleAndCostAreResolvedOnce) {
  JobOptions o;
  o.tp = 2;
  o.cp = 4;
  o.dp = 3;
  o.sp = true;
  o.align = 2;
  o.rank_multiple = 32;
  o.cost = "llama3-8b";
  Result<Job> job = ResolveJob(o);
  ASSERT_TRUE(job.ok()) << job.status().ToString();
  EXPECT_EQ(job->schedule.dp_size, 3);
  EXPECT_EQ(job->schedule.parallel, ParallelLayout::Create(4, 2, true, 2, 32).value());
  EXPECT_EQ(job->schedule.cost.name, "llama3-8b");
  ASSERT_TRUE(job->model.has_value());
  EXPECT_EQ(job->memory.vocab_size, 128256);  // from the model
  ASSERT_TRUE(job->flops.has_value());
  EXPECT_EQ(job->flops->per_token_sq, 3 * 2 * 32 * 4096);
  o.vocab_size = 1000;  // given: wins over the model's
  EXPECT_EQ(ResolveJob(o)->memory.vocab_size, 1000);
  o.cost = "1,0.5";
  o.vocab_size = 0;
  job = ResolveJob(o);
  ASSERT_TRUE(job.ok());
  EXPECT_FALSE(job->flops.has_value());
  EXPECT_EQ(job->memory.vocab_size, 0);
  const StepRunnerOptions r = RunnerOptions(*job);
  EXPECT_EQ(r.schedule.parallel.cp_size(), 4);
  EXPECT_EQ(r.global_batch, 256);
}

TEST(Job, RunProfileStepsAreChecked) {
  Result<Job> job = ResolveJob(JobOptions{});
  ASSERT_TRUE(job.ok());
  RunOptions r;
  r.memory_profile_steps = {2, 0, 2};
  Result<RunSetup> run = ResolveRun(*job, r);
  ASSERT_TRUE(run.ok());
  EXPECT_EQ(run->profile_steps, (std::vector<int64_t>{0, 2}));
  r.memory_profile_steps = {3};
  run = ResolveRun(*job, r);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.status().message().find("--memory-profile-steps: step 3 is not run"),
            std::string::npos);
  EXPECT_FALSE(ParseProfileSteps("0,x").ok());
  EXPECT_EQ(*ParseProfileSteps("1,0"), (std::vector<int64_t>{1, 0}));
  r = RunOptions{};
  r.verify = true;
  r.verify_tolerance = -1;
  EXPECT_NE(ResolveRun(*job, r).status().message().find("--verify-tolerance"), std::string::npos);
}

// The run core and the plan core on fresh random jobs: rank 0's report of every step has the
// figures plan computes for the same options, byte for byte in JSON; with verify, the loss.
// Eight trials in four shards of two, so that ctest runs the shards side by side: in one piece
// this was the longest test under ASan (about 28 s).
class JobRunShard : public testing::TestWithParam<int> {};

TEST_P(JobRunShard, RunReportsPlansFiguresAtSeveralWorldSizes) {
  std::mt19937_64 rng(std::random_device{}());
  TempDir dir;
  for (int trial = 2 * GetParam(); trial < 2 * GetParam() + 2; ++trial) {
    std::string text;
    const int n = 20 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) text += std::to_string(1 + rng() % 300) + "\n";
    const std::string path = dir.File("lengths" + std::to_string(trial) + ".txt");
    WriteText(path, text);
    JobOptions o;
    o.data = "lengths:" + path;
    if (trial >= 6) {
      // A Megatron dataset with empty documents: ids with gaps, n_empty in both commands.
      const std::string prefix = dir.File("megatron" + std::to_string(trial));
      auto w = MegatronWriter::Create(prefix, MegatronDType::kUint16);
      ASSERT_TRUE(w.ok());
      for (int i = 0; i < n; ++i) {
        if (i % 4 != 1) ASSERT_TRUE((*w)->AddSequence(std::vector<int64_t>(1 + rng() % 300, 5)).ok());
        ASSERT_TRUE((*w)->EndDocument().ok());
      }
      ASSERT_TRUE((*w)->Finish().ok());
      o.data = "megatron:" + prefix;
    }
    o.tp = 1 + static_cast<int>(rng() % 2);
    o.cp = 1 + static_cast<int>(rng() % 2);
    o.dp = 1 + static_cast<int>(rng() % 3);
    o.pp = 1 + static_cast<int>(rng() % 2);
    o.sp = o.tp > 1 && rng() % 2 == 0;  // SP needs TP > 1
    o.rank_multiple = std::vector<int64_t>{1, 1, 16, 32}[rng() % 4];
    o.max_tokens_per_rank = 512;
    o.global_batch = rng() % 3 == 0 ? 0 : 8 + static_cast<int64_t>(rng() % 16);
    o.steps = 2;
    o.data_on = rng() % 2 == 0 ? "tp0" : "all";
    o.check_plan_hash = true;
    Result<Job> job = ResolveJob(o);
    ASSERT_TRUE(job.ok()) << job.status().ToString();
    Result<JobPlan> plan = PlanJob(*job);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    RunOptions r;
    r.verify = trial % 2 == 0;
    r.probe.layers = 2;
    Result<RunSetup> run = ResolveRun(*job, r);
    ASSERT_TRUE(run.ok());
    std::vector<RunStepReport> reports;
    std::mutex mu;
    auto statuses = RunOnThreads(job->topology.world_size(), [&](ProcessGroup& world) {
      return RunJobOnRank(world, *job, *run, [&](const RunStepReport& step) {
        std::lock_guard<std::mutex> lock(mu);
        reports.push_back(step);
        return Status::Ok();
      });
    });
    for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_EQ(reports.size(), 2u) << job->topology.ToString();
    if (trial >= 6) EXPECT_GT(plan->summary.n_empty, 0);
    for (size_t k = 0; k < reports.size(); ++k) {
      EXPECT_EQ(StepFiguresJson(reports[k].figures, false), StepFiguresJson(plan->steps[k], false))
          << job->topology.ToString();
      EXPECT_EQ(StepMemoryJson(reports[k].memory), StepMemoryJson(plan->memory[k]));
      EXPECT_EQ(reports[k].loss.has_value(), r.verify);
      ASSERT_EQ(reports[k].phases.bytes.size(), static_cast<size_t>(kNumPhases));
      EXPECT_EQ(reports[k].phases.bytes[0].size(), static_cast<size_t>(job->topology.world_size()));
      const std::string json = RunStepJson(reports[k], false);
      EXPECT_NE(json.find("\"time_agree\":"), std::string::npos);
      EXPECT_NE(json.find(",\"memory\":"), std::string::npos);
      // The step's time is the slowest rank's own time, never more than the sum of the phase
      // maxima, and it is what time_step says.
      const PhaseTable& t = reports[k].phases;
      ASSERT_EQ(t.rank_seconds.size(), static_cast<size_t>(job->topology.world_size()));
      EXPECT_EQ(t.step_seconds, *std::max_element(t.rank_seconds.begin(), t.rank_seconds.end()));
      double sum_of_maxima = 0;
      for (double v : t.seconds) sum_of_maxima += v;
      EXPECT_LE(t.step_seconds, sum_of_maxima * (1 + 1e-12));
      EXPECT_NE(json.find("\"time_step\":" + nlohmann::json(t.step_seconds).dump()),
                std::string::npos);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Job, JobRunShard, testing::Range(0, 4));

TEST(Job, PhaseNames) {
  const char* names[] = {"read", "lengths", "plan", "exchange", "pack", "deliver", "agree"};
  for (int k = 0; k < kNumPhases; ++k) EXPECT_EQ(PhaseName(static_cast<Phase>(k)), names[k]);
}

}  // namespace
}  // namespace thdpack
