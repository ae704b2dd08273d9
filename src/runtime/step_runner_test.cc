// The distributed step on the thread backend: the eight topologies, with and without
// SP, in both data-on modes, checked against a plain reference (tests/step_checks.h; the same
// checks run under mpirun in tests/mpi_check.cc); and the failure path: an error on one rank
// reaches every rank, and nothing hangs.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "step_checks.h"
#include "runtime/step_runner_impl.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

using testing::ScratchFile;

void ExpectAllOk(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
}

class StepCaseTest : public ::testing::TestWithParam<testing::StepCase> {};

// Three steps of 24 samples from a 50-sample file: the third wraps into epoch 1.
TEST_P(StepCaseTest, MatchesReference) {
  ScratchFile file("thdpack_step_test.jsonl");
  testing::WriteStepTestJsonl(file.path(), 50, 200, 11);
  const testing::StepCase k = GetParam();
  ExpectAllOk(RunOnThreads(8, [&](ProcessGroup& world) {
    return testing::RunAndVerifyCase(world, k, file.path(), 24, 3);
  }));
}

INSTANTIATE_TEST_SUITE_P(Threads, StepCaseTest, ::testing::ValuesIn(testing::AllStepCases()),
                         [](const auto& info) { return testing::CaseName(info.param); });

// --global-batch all: the whole file is one step, the next step the next epoch.
TEST(StepRunner, WholeSourcePerStep) {
  ScratchFile file("thdpack_step_all.jsonl");
  testing::WriteStepTestJsonl(file.path(), 30, 150, 5);
  for (const testing::StepCase k : {testing::StepCase{2, 2, 2, 1, true, DataOn::kTp0},
                                    testing::StepCase{1, 2, 2, 2, false, DataOn::kAll}}) {
    ExpectAllOk(RunOnThreads(8, [&](ProcessGroup& world) {
      return testing::RunAndVerifyCase(world, k, file.path(), 0, 2);
    }));
  }
}

// Other world sizes: 1 rank, and 4 ranks as (1,2,2,1).
TEST(StepRunner, SmallWorlds) {
  ScratchFile file("thdpack_step_small.jsonl");
  testing::WriteStepTestJsonl(file.path(), 20, 100, 3);
  ExpectAllOk(RunOnThreads(1, [&](ProcessGroup& world) {
    return testing::RunAndVerifyCase(world, {1, 1, 1, 1, false, DataOn::kTp0}, file.path(), 8, 3);
  }));
  ExpectAllOk(RunOnThreads(4, [&](ProcessGroup& world) {
    return testing::RunAndVerifyCase(world, {1, 2, 2, 1, true, DataOn::kTp0}, file.path(), 8, 3);
  }));
}

// Oversize policy skip: the samples over the budget are left out, reported, and every other
// sample still arrives exactly once.
TEST(StepRunner, OversizeSkipLeavesSamplesOutAndSaysSo) {
  ScratchFile file("thdpack_step_skip.lengths");
  {
    std::ofstream out(file.path());
    for (int i = 0; i < 30; ++i) out << (i % 7 == 3 ? 900 : 20 + 5 * i) << "\n";
  }
  ExpectAllOk(RunOnThreads(8, [&](ProcessGroup& world) {
    return testing::RunAndVerifyCase(world, {1, 2, 2, 2, false, DataOn::kTp0},
                                     "lengths:" + file.path(), 20, 2,
                                     ScheduleOptions::OversizePolicy::kSkip);
  }));
}

// Static shapes (pad_to_max_tokens, max_seqs_per_microbatch 3): at DP, CP with SP, TP x CP x
// PP, PP and data on every rank, every microbatch holds exactly CP * 256 tokens and at most 3
// sequences (VerifyRankStep checks both from the options), and every rank's tensors equal the
// reference's, the fixed tail included; every sample arrives exactly once.
TEST(StepRunner, StaticShapesHoldOnEveryRank) {
  ScratchFile file("thdpack_step_static.jsonl");
  testing::WriteStepTestJsonl(file.path(), 40, 90, 11);
  const testing::StepCase cases[] = {{1, 1, 4, 1, false, DataOn::kTp0},
                                     {2, 2, 2, 1, true, DataOn::kTp0},
                                     {2, 2, 1, 2, false, DataOn::kAll},
                                     {1, 1, 2, 4, false, DataOn::kTp0}};
  for (const testing::StepCase& k : cases) {
    for (int pad = 0; pad < 2; ++pad) {
      ExpectAllOk(RunOnThreads(k.tp * k.cp * k.dp * k.pp, [&](ProcessGroup& world) {
        return testing::RunAndVerifyCase(world, k, file.path(), 16, 3,
                                         ScheduleOptions::OversizePolicy::kError,
                                         [&](StepRunnerOptions& o) {
                                           o.schedule.max_seqs_per_microbatch = 3;
                                           o.schedule.pad_to_max_tokens = pad == 1;
                                         });
      }));
    }
  }
}

// Oversize split: samples over the longest kept length (CP x 64 = 128 tokens) arrive as their
// pieces, each a sample of the step, at every rank as the reference (read through the same
// split stream) packs them, every piece exactly once; at DP with CP, TP x PP, and data on all.
TEST(StepRunner, SplitSamplesArriveAsPieces) {
  ScratchFile file("thdpack_step_split.lengths");
  {
    std::ofstream out(file.path());
    for (int i = 0; i < 30; ++i) out << (i % 4 == 1 ? 300 + 37 * i : 10 + 3 * i) << "\n";
  }
  const testing::StepCase cases[] = {{1, 2, 2, 1, false, DataOn::kTp0},
                                     {2, 2, 1, 2, true, DataOn::kAll}};
  for (const testing::StepCase& k : cases) {
    ExpectAllOk(RunOnThreads(k.tp * k.cp * k.dp * k.pp, [&](ProcessGroup& world) {
      return testing::RunAndVerifyCase(world, k, "lengths:" + file.path(), 12, 4,
                                       ScheduleOptions::OversizePolicy::kSplit,
                                       [](StepRunnerOptions& o) {
                                         o.schedule.max_tokens_per_rank = 64;
                                       });
    }));
  }
}

// Runs one step of `o` on 8 threads and returns each rank's status.
std::vector<Status> RunOneStep(const Topology& topo, const StepRunnerOptions& o,
                               int corrupt_metadata_of_replica = -1) {
  return RunOnThreads(8, [&](ProcessGroup& world) -> Status {
    THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, topo, o));
    runner_internal::TestHooks::CorruptMetadataOfReplica(*runner, corrupt_metadata_of_replica);
    return runner->Next().status();
  });
}

// A sample over the budget, read by one loader only: that loader reports it, every other rank
// gets kAborted naming it, and nothing hangs.
TEST(StepRunner, OversizeSampleOnOneLoaderFailsEveryRank) {
  ScratchFile file("thdpack_step_oversize.lengths");
  {
    std::ofstream out(file.path());
    for (int i = 0; i < 16; ++i) out << (i == 5 ? 5000 : 50) << "\n";
  }
  for (DataOn mode : {DataOn::kTp0, DataOn::kAll}) {
    auto topo = *Topology::Create(2, 1, 2, 2);  // loaders are ranks 0 (dp 0) and 2 (dp 1)
    StepRunnerOptions o;
    o.data = "lengths:" + file.path();
    o.global_batch = 16;
    o.schedule.max_tokens_per_rank = 1000;
    o.schedule.parallel = testing::TopologyLayout(topo, false).value();
    o.schedule.dp_size = 2;
    o.data_on = mode;
    auto statuses = RunOneStep(topo, o);
    // Sample 5 is read by loader 5 % 2 = 1, i.e. the ranks with dp = 1.
    for (int r = 0; r < 8; ++r) {
      const Coord c = *topo.CoordOf(r);
      const bool reads_it = c.dp == 1 && (mode == DataOn::kAll || (c.tp == 0 && c.pp == 0));
      const Status& s = statuses[static_cast<size_t>(r)];
      if (reads_it) {
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << r << ": " << s.ToString();
        EXPECT_NE(s.message().find("sample id 5"), std::string::npos) << s.ToString();
        EXPECT_NE(s.message().find("over the microbatch budget"), std::string::npos);
      } else {
        EXPECT_EQ(s.code(), StatusCode::kAborted) << r << ": " << s.ToString();
        EXPECT_NE(s.message().find("(read) failed"), std::string::npos) << s.ToString();
        EXPECT_NE(s.message().find("sample id 5"), std::string::npos) << s.ToString();
        // The loader's code reaches every rank, so every rank exits with the same code.
        EXPECT_EQ(s.origin(), StatusCode::kInvalidArgument) << r << ": " << s.ToString();
      }
    }
  }
}

// Corrupt metadata on the wire: the receivers of replica 1 detect it, everyone gets an error.
TEST(StepRunner, CorruptMetadataFailsEveryRank) {
  ScratchFile file("thdpack_step_corrupt.jsonl");
  testing::WriteStepTestJsonl(file.path(), 20, 100, 9);
  auto topo = *Topology::Create(2, 2, 2, 1);
  StepRunnerOptions o;
  o.data = "jsonl:" + file.path();
  o.global_batch = 16;
  o.schedule.max_tokens_per_rank = 256;
  o.schedule.parallel = testing::TopologyLayout(topo, false).value();
  o.schedule.dp_size = 2;
  auto statuses = RunOneStep(topo, o, /*corrupt_metadata_of_replica=*/1);
  int corruption = 0;
  for (int r = 0; r < 8; ++r) {
    const Status& s = statuses[static_cast<size_t>(r)];
    EXPECT_FALSE(s.ok()) << "rank " << r;
    const Coord c = *topo.CoordOf(r);
    if (c.dp == 1 && !(c.tp == 0 && c.cp == 0)) {
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
      EXPECT_NE(s.message().find("metadata received from the loader of replica 1"),
                std::string::npos) << s.ToString();
      ++corruption;
    } else {
      EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    }
  }
  EXPECT_EQ(corruption, 3);
}

// A schedule error that every loader sees (too few samples for DP = 8) reaches non-loaders.
TEST(StepRunner, ScheduleErrorReachesNonLoaders) {
  ScratchFile file("thdpack_step_few.jsonl");
  testing::WriteStepTestJsonl(file.path(), 20, 100, 9);
  auto topo = *Topology::Create(1, 1, 4, 2);
  StepRunnerOptions o;
  o.data = "jsonl:" + file.path();
  o.global_batch = 3;  // fewer than DP = 4
  o.schedule.max_tokens_per_rank = 256;
  o.schedule.parallel = testing::TopologyLayout(topo, false).value();
  o.schedule.dp_size = 4;
  auto statuses = RunOneStep(topo, o);
  for (int r = 0; r < 8; ++r) {
    const Status& s = statuses[static_cast<size_t>(r)];
    const Coord c = *topo.CoordOf(r);
    if (c.pp == 0) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    } else {
      EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
      EXPECT_NE(s.message().find("rank 0 (plan) failed"), std::string::npos) << s.ToString();
    }
  }
}

// A source fed by the caller (StepRunnerOptions::read_share), each loader handed its own share
// of a file by the id rule, gives every rank the same step as the file itself, in both data-on
// modes; an error from one loader's share fails every rank.
TEST(StepRunner, CallerFedShareEqualsFileSource) {
  ScratchFile file("thdpack_step_fed.jsonl");
  testing::WriteStepTestJsonl(file.path(), 40, 120, 9);
  std::vector<Sample> all;
  {
    auto src = OpenJsonlSource(file.path());
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    while (true) {
      auto x = (*src)->Next();
      ASSERT_TRUE(x.ok()) << x.status().ToString();
      if (!x->has_value()) break;
      all.push_back(std::move(**x));
    }
  }
  const int64_t n = 12;
  for (DataOn mode : {DataOn::kTp0, DataOn::kAll}) {
    auto topo = *Topology::Create(2, 2, 2, 1);
    StepRunnerOptions o;
    o.data = "jsonl:" + file.path();
    o.global_batch = n;
    o.data_on = mode;
    o.schedule.max_tokens_per_rank = 128;
    o.schedule.dp_size = topo.dp_size();
    o.schedule.parallel = testing::TopologyLayout(topo, true).value();
    // Loader d's samples of step s: positions d, d + DP, ... of the step, ids as the file's.
    auto share_of = [&](int64_t step, int64_t first_position, int loader) -> Result<StepShare> {
      StepShare share;
      share.step = step;
      share.n = n;
      share.first_id = first_position;
      if (first_position != step * n) return Status::Internal("the stream position is not step * n");
      for (int64_t i = loader; i < n; i += topo.dp_size()) {
        share.samples.push_back(all[static_cast<size_t>(step * n + i)]);
      }
      return share;
    };
    std::vector<std::vector<RankStep>> got(2, std::vector<RankStep>(8));
    for (int fed = 0; fed < 2; ++fed) {
      StepRunnerOptions fo = o;
      if (fed) {
        fo.data = "unused";
        fo.read_share = share_of;
      }
      ExpectAllOk(RunOnThreads(8, [&](ProcessGroup& world) -> Status {
        THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, topo, fo));
        THDPACK_ASSIGN_OR_RETURN(RankStep first, runner->Next());
        THDPACK_ASSIGN_OR_RETURN(got[fed][world.rank()], runner->Next());  // step 1
        return first.step == 0 ? Status::Ok() : Status::Internal("step numbering");
      }));
    }
    for (int r = 0; r < 8; ++r) {
      const RankStep& a = got[0][r];
      const RankStep& b = got[1][r];
      EXPECT_EQ(a.meta, b.meta) << "rank " << r;
      ASSERT_EQ(a.microbatches.size(), b.microbatches.size()) << "rank " << r;
      ASSERT_FALSE(a.microbatches.empty());
      for (size_t m = 0; m < a.microbatches.size(); ++m) {
        const LocalMicrobatch& x = a.microbatches[m];
        const LocalMicrobatch& y = b.microbatches[m];
        EXPECT_EQ(x.tokens, y.tokens) << "rank " << r << " mb " << m;
        EXPECT_EQ(x.position_ids, y.position_ids) << "rank " << r << " mb " << m;
        EXPECT_EQ(x.labels, y.labels) << "rank " << r << " mb " << m;
        EXPECT_EQ(x.loss_mask, y.loss_mask) << "rank " << r << " mb " << m;
        EXPECT_EQ(x.cu_seqlens_padded, y.cu_seqlens_padded) << "rank " << r << " mb " << m;
      }
    }
    // Loader dp=1's source fails: every rank returns an error, and none hangs.
    StepRunnerOptions bad = o;
    bad.read_share = [&](int64_t step, int64_t first_position, int loader) -> Result<StepShare> {
      if (loader == 1) return Status::IOError("share of loader 1 unreadable (test)");
      return share_of(step, first_position, loader);
    };
    auto statuses = RunOnThreads(8, [&](ProcessGroup& world) -> Status {
      THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, topo, bad));
      return runner->Next().status();
    });
    for (const Status& s : statuses) {
      EXPECT_FALSE(s.ok());
      EXPECT_NE(s.message().find("share of loader 1 unreadable"), std::string::npos)
          << s.ToString();
    }
  }
}

// Ranks given different options (a careless launch): a named error on every rank at Create,
// naming the option and both values, never an abort or a step made by two plans. Each case
// changes one option on one rank (the last, or one in the middle), at 2 and 4 ranks.
TEST(StepRunner, JobThatDiffersOverTheWorldIsNamedOnEveryRank) {
  struct Case {
    const char* option;
    const char* here;   // the value the odd rank shows
    const char* there;  // rank 0's
    std::function<void(StepRunnerOptions&)> change;
  };
  FieldSpec adv;
  adv.name = "adv";
  adv.kind = FieldKind::kSample;
  const std::vector<Case> cases = {
      {"scheduler", "\"sequential\"", "\"balanced\"",
       [](StepRunnerOptions& o) { o.schedule.scheduler = ScheduleOptions::Scheduler::kSequential; }},
      {"max_tokens_per_rank", "\"4096\"", "\"8192\"",
       [](StepRunnerOptions& o) { o.schedule.max_tokens_per_rank = 4096; }},
      {"cost", "\"7,1 (a 7", "\"tokens (a 1",
       [](StepRunnerOptions& o) { o.schedule.cost = CostModel{7, 1, "7,1"}; }},
      {"keep_groups", "\"replica\"", "\"none\"",
       [](StepRunnerOptions& o) {
         o.schedule.keep_groups = ScheduleOptions::KeepGroups::kReplica;
       }},
      {"fields[0]", "float64", "float32",
       [](StepRunnerOptions& o) { o.fields[0].dtype = FieldDtype::kFloat64; }},
      {"fields[0]", "\"advantage (", "\"adv (",
       [](StepRunnerOptions& o) { o.fields[0].name = "advantage"; }},
      {"fields", "\"2\"", "\"1\"",
       [](StepRunnerOptions& o) { o.fields.push_back(o.fields[0]), o.fields[1].name = "b"; }},
  };
  for (const int world_size : {2, 4}) {
    const Topology topo = *Topology::Create(1, 1, world_size, 1);
    for (const Case& k : cases) {
      const int odd = world_size == 2 ? 1 : 2;
      const std::vector<Status> statuses = RunOnThreads(world_size, [&](ProcessGroup& world) {
        StepRunnerOptions o;
        o.global_batch = 8;
        o.schedule.max_tokens_per_rank = 8192;
        o.schedule.cost = CostModel{};
        o.schedule.dp_size = world_size;
        o.schedule.parallel = testing::TopologyLayout(topo, false).value();
        o.fields = {adv};
        o.read_share = [](int64_t, int64_t, int) -> Result<StepShare> {
          return Status::Internal("no step is read");
        };
        if (world.rank() == odd) k.change(o);
        return StepRunner::Create(world, topo, o).status();
      });
      for (int r = 0; r < world_size; ++r) {
        const Status& s = statuses[static_cast<size_t>(r)];
        SCOPED_TRACE(std::string(k.option) + " at " + std::to_string(world_size) + " ranks, rank " +
                     std::to_string(r) + ": " + s.ToString());
        EXPECT_EQ(r == odd ? s.code() : s.origin(), StatusCode::kInvalidArgument);
        EXPECT_NE(s.message().find(std::string("the job differs over the world: ") + k.option),
                  std::string::npos);
        EXPECT_NE(s.message().find(std::string(k.here)), std::string::npos);
        EXPECT_NE(s.message().find(std::string(k.there)), std::string::npos);
        EXPECT_NE(s.message().find("on world rank " + std::to_string(odd)), std::string::npos);
      }
    }
    // The same job on every rank: no error, and nothing but the 16-byte agreement sent.
    const std::vector<Status> same = RunOnThreads(world_size, [&](ProcessGroup& world) {
      StepRunnerOptions o;
      o.schedule.max_tokens_per_rank = 100;
      const int64_t before = world.bytes_sent();
      THDPACK_RETURN_IF_ERROR(AgreeOnJob(world, StepJobEntries(o, topo)));
      const int64_t agreed = world.bytes_sent() - before;
      int64_t two[2] = {0, 0};  // what one all-reduce of 16 bytes sends, for comparison
      THDPACK_RETURN_IF_ERROR(world.AllReduceInt64(two, ReduceOp::kMax));
      if (agreed != world.bytes_sent() - before - agreed) {
        return Status::Internal("the agreement sent " + std::to_string(agreed) +
                                " bytes, more than one all-reduce of 16");
      }
      return Status::Ok();
    });
    ExpectAllOk(same);
  }
}

TEST(StepRunner, BadOptionsAreErrors) {
  auto topo = *Topology::Create(2, 2, 2, 1);
  StepRunnerOptions o;  // max_tokens_per_rank missing
  auto statuses = RunOnThreads(8, [&](ProcessGroup& world) {
    return StepRunner::Create(world, topo, o).status();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("max_tokens_per_rank"), std::string::npos) << s.ToString();
  }
  o.schedule.max_tokens_per_rank = 100;
  o.schedule.parallel = testing::TopologyLayout(topo, false).value();
  statuses = RunOnThreads(4, [&](ProcessGroup& world) {
    return StepRunner::Create(world, topo, o).status();
  });
  for (const Status& s : statuses) {
    EXPECT_NE(s.message().find("needs 8"), std::string::npos) << s.ToString();
  }
  // The schedule's layout must have the topology's CP and TP (TP = 2, CP = 2 here): a layout
  // of another CP, or of another TP, is an error on every rank that names both.
  o.schedule.dp_size = topo.dp_size();
  for (const ParallelLayout& wrong :
       {ParallelLayout::Create(1, 2).value(), ParallelLayout::Create(2, 1, true).value()}) {
    o.schedule.parallel = wrong;
    statuses = RunOnThreads(8, [&](ProcessGroup& world) {
      return StepRunner::Create(world, topo, o).status();
    });
    for (const Status& s : statuses) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
      EXPECT_NE(s.message().find("schedule.parallel " + wrong.ToString()), std::string::npos)
          << s.ToString();
      EXPECT_NE(s.message().find(topo.ToString()), std::string::npos) << s.ToString();
    }
  }
  // The same for DP: a schedule of another DP size is an error, not silently replaced.
  o.schedule.parallel = testing::TopologyLayout(topo, false).value();
  o.schedule.dp_size = 1;
  statuses = RunOnThreads(8, [&](ProcessGroup& world) {
    return StepRunner::Create(world, topo, o).status();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("must be the topology's"), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(ParseDataOn("tp1").status().code(), StatusCode::kInvalidArgument);
}

// The step's time is the slowest rank's own start-to-end time, not the sum of each phase's
// slowest rank: here rank 0 is slow in read and rank 1 in pack, so each rank took 3 s while the
// sum of the per-phase maxima is 5 s.
TEST(GatherPhases, StepTimeIsTheSlowestRanksWallTime) {
  auto statuses = RunOnThreads(3, [](ProcessGroup& world) -> Status {
    RankStep step;
    const double read[] = {2.0, 0.5, 0.25};
    const double pack[] = {0.5, 2.0, 0.25};
    const double agree[] = {0.5, 0.5, 0.25};
    const size_t r = static_cast<size_t>(world.rank());
    step.phases = {PhaseStats{Phase::kRead, read[r], 10 * (world.rank() + 1)},
                   PhaseStats{Phase::kPack, pack[r], 0},
                   PhaseStats{Phase::kAgree, agree[r], 8}};
    THDPACK_ASSIGN_OR_RETURN(PhaseTable t, GatherPhases(world, step));
    EXPECT_EQ(t.seconds[static_cast<size_t>(Phase::kRead)], 2.0);
    EXPECT_EQ(t.seconds[static_cast<size_t>(Phase::kPack)], 2.0);
    EXPECT_EQ(t.seconds[static_cast<size_t>(Phase::kAgree)], 0.5);
    EXPECT_EQ(t.rank_seconds, (std::vector<double>{3.0, 3.0, 0.75}));
    EXPECT_EQ(t.step_seconds, 3.0);
    EXPECT_EQ(t.bytes[static_cast<size_t>(Phase::kRead)], (std::vector<int64_t>{10, 20, 30}));
    EXPECT_EQ(t.max_rank_bytes(), 38);
    return Status::Ok();
  });
  ExpectAllOk(statuses);
}

}  // namespace
}  // namespace thdpack
