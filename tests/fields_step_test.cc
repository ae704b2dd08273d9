// Fields through the distributed step (thdpack/step_runner.h, thdpack/fields.h) on the thread
// backend, by the checks of tests/fields_checks.h: samples fed with fields of every kind and
// dtype, at topologies with TP, SP, CP, DP and PP, static and dynamic schedulers, data on the
// loaders or on every rank, at depths 0 and 1; unpack back to every loader; and a sample whose
// field does not fit is an error on every rank naming it.
#include <gtest/gtest.h>

#include <atomic>
#include <string>

#include "fields_checks.h"

namespace thdpack {
namespace {

using testing::FieldsCase;
using testing::kFieldCases;
using testing::kSchema;

void ExpectAllOk(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
}

TEST(FieldsStep, EveryRankHoldsTheReferenceFields) {
  for (const FieldsCase& c : kFieldCases) {
    const Job job = testing::MakeJob(c, 20);
    for (int depth : {0, 1}) {
      SCOPED_TRACE(testing::Name(c) + " depth " + std::to_string(depth));
      ExpectAllOk(RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) {
        return testing::RunFieldsCase(w, job, 3, depth);
      }));
    }
  }
}

// Unpacking the packed values of a target field gives every loader its samples' field back, in
// its order, row 0 the fill; a last-stage rank that passes no values is an error on every rank.
TEST(FieldsStep, UnpackGivesEveryLoaderItsSamplesBack) {
  for (const FieldsCase& c : kFieldCases) {
    SCOPED_TRACE(testing::Name(c));
    const Job job = testing::MakeJob(c, 20);
    // The rank that passes nothing: tp 0 of the last stage, the last CP and DP.
    const int silent = *job.topology.RankOf(Coord{0, c.cp - 1, c.dp - 1, c.pp - 1});
    for (int quiet : {-1, silent}) {
      std::atomic<bool> held{false};
      ExpectAllOk(RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) {
        return testing::RunUnpackCase(w, job, quiet, &held);
      }));
    }
  }
}

// Values of another dtype or row shape on one rank are one error, the same on every rank (1 to
// 8 ranks, every topology of the cases), naming both ranks' dtypes and row shapes; a rank whose
// own microbatches differ is an error on every rank naming its microbatches.
TEST(FieldsStep, UnpackValuesOfAnotherDtypeOrShapeAreOneErrorOnEveryRank) {
  using testing::OddValues;
  for (const FieldsCase& c : kFieldCases) {
    SCOPED_TRACE(testing::Name(c));
    const Job job = testing::MakeJob(c, 20);
    const int world = job.topology.world_size();
    const int odd = *job.topology.RankOf(Coord{0, c.cp - 1, c.dp - 1, c.pp - 1});
    const bool other_sender = c.tp * c.cp * c.dp > 1;  // another rank of the last stage
    for (OddValues how : {OddValues::kDtype, OddValues::kShape, OddValues::kWithin}) {
      if (how != OddValues::kWithin && !other_sender) continue;
      std::vector<std::string> messages(static_cast<size_t>(world));
      std::atomic<bool> skipped{false};
      ExpectAllOk(RunOnThreads(world, [&](ProcessGroup& w) {
        return testing::RunUnpackMismatchCase(w, job, odd, how, &messages, &skipped);
      }));
      if (skipped) continue;
      for (int r = 0; r < world; ++r) {
        const std::string& m = messages[static_cast<size_t>(r)];
        SCOPED_TRACE("rank " + std::to_string(r) + ": " + m);
        if (how == OddValues::kWithin) {
          EXPECT_NE(m.find("values of microbatch 1 are int64 [T/CP, 3], microbatch 0's float64 "
                           "[T/CP, 3]"),
                    std::string::npos);
          continue;
        }
        EXPECT_EQ(m, messages[0]);
        EXPECT_NE(m.find("rank " + std::to_string(odd) + " passed values of " +
                         (how == OddValues::kDtype ? "int64 [T/CP, 3]" : "float64 [T/CP]")),
                  std::string::npos);
        EXPECT_NE(m.find("of float64 [T/CP, 3] (every rank's values are of one dtype and row "
                         "shape)"),
                  std::string::npos);
      }
    }
  }
}

// A sample whose field has the wrong size fails the step on every rank, the loader's error
// naming the sample, the field and the sizes; fields without a fed source are refused.
TEST(FieldsStep, AFieldThatDoesNotFitIsAnErrorOnEveryRank) {
  const FieldsCase& c = kFieldCases[1];
  const Job job = testing::MakeJob(c, 8);
  const StepRunnerOptions options = testing::FedWithFields(job, [](Sample& x) {
    if (x.id == 5) x.fields[2].resize(x.fields[2].size() - 8);  // topk one element short
  });
  const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
    THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, options));
    return runner->Next().status();
  });
  bool named = false;
  for (const Status& s : statuses) {
    EXPECT_FALSE(s.ok());
    if (s.message().find("sample id 5") != std::string::npos &&
        s.message().find("topk (target float64 [L, 3])") != std::string::npos) {
      named = true;
    }
  }
  EXPECT_TRUE(named) << statuses[0].ToString();

  StepRunnerOptions files = RunnerOptions(job);
  files.fields = kSchema;
  const auto refused = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
    return StepRunner::Create(w, job.topology, files).status();
  });
  for (const Status& s : refused) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("only a source fed by the caller or a columnar source "
                               "(parquet:, arrow:) carries fields"),
              std::string::npos)
        << s.ToString();
  }
}

// --oversize truncate through the step: samples over the budget keep their first tokens,
// mask entries and per-token field rows (the reference cuts them plainly), at static and
// dynamic topologies, depths 0 and 1; the step reports what it cut, every sample once.
TEST(FieldsStep, TruncatedSamplesKeepTheirFirstTokens) {
  for (const FieldsCase& c : {kFieldCases[0], kFieldCases[1], kFieldCases[2], kFieldCases[4],
                              kFieldCases[7]}) {
    JobOptions o = testing::MakeJob(c, 20).options;
    o.oversize = "truncate";
    // Samples of up to 70 tokens: many are cut (dynamic CP's widest group spans 4 ranks).
    o.max_tokens_per_rank = std::string(c.scheduler) == "dynamic" ? 12 : 24;
    const Result<Job> job = ResolveJob(o);
    ASSERT_TRUE(job.ok()) << job.status().ToString();
    const Result<int64_t> longest = LongestKept(job->schedule);
    ASSERT_TRUE(longest.ok());
    ASSERT_LT(*longest, 70);
    for (int depth : {0, 1}) {
      SCOPED_TRACE(testing::Name(c) + " depth " + std::to_string(depth) + " longest " +
                   std::to_string(*longest));
      ExpectAllOk(RunOnThreads(job->topology.world_size(), [&](ProcessGroup& w) {
        return testing::RunFieldsCase(w, *job, 3, depth, *longest);
      }));
    }
  }
}

// Groups kept together through the step: pairs in one microbatch and groups of four on one
// replica (one CP group under dynamic CP), every topology of the balanced and dynamic cases,
// depths 0 and 1; the sequential scheduler and a bad group field are refused by name.
TEST(GroupsStep, EveryGroupWhereItsModeSays) {
  for (const FieldsCase& c : kFieldCases) {
    if (std::string(c.scheduler) == "sequential") continue;
    for (const char* keep : {"microbatch", "replica"}) {
      for (int depth : {0, 1}) {
        SCOPED_TRACE(testing::Name(c) + " " + keep + " depth " + std::to_string(depth));
        ExpectAllOk(RunOnThreads(c.tp * c.cp * c.dp * c.pp, [&](ProcessGroup& w) {
          return testing::RunGroupsCase(w, c, keep, 3, depth);
        }));
      }
    }
  }
}

TEST(GroupsStep, RefusedByName) {
  const FieldsCase& c = kFieldCases[1];
  JobOptions jo = testing::MakeJob(c, 8).options;
  auto create = [&](JobOptions o) {
    const Job job = *ResolveJob(o);
    StepRunnerOptions options = testing::FedWithFields(job);
    return RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
      return StepRunner::Create(w, job.topology, options).status();
    })[0];
  };
  JobOptions o = jo;
  o.keep_groups = "microbatch";
  Status s = create(o);
  EXPECT_NE(s.message().find("needs group_field"), std::string::npos) << s.ToString();
  o.group_field = "reward";  // float32
  s = create(o);
  EXPECT_NE(s.message().find("group_field 'reward' is reward (sample float32"),
            std::string::npos) << s.ToString();
  o.group_field = "nope";
  s = create(o);
  EXPECT_NE(s.message().find("not one of the 8 declared fields"), std::string::npos)
      << s.ToString();
  o.group_field = "uid";
  o.scheduler = "sequential";
  s = create(o);
  EXPECT_NE(s.message().find("not 'sequential'"), std::string::npos) << s.ToString();
  o = jo;
  o.group_field = "uid";
  s = create(o);
  EXPECT_NE(s.message().find("keep_groups is 'none'"), std::string::npos) << s.ToString();
  o.keep_groups = "pairs";
  EXPECT_FALSE(ResolveJob(o).ok());
}

}  // namespace
}  // namespace thdpack
