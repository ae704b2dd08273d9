// Every message of a step damaged on the wire, one bit at a time (docs/wire_format.md, "What
// the checksums cover"): a FaultGroup (tests/fault_group.h) around the thread backend flips one
// bit of the n-th message one rank receives - every message of a clean step's trace, at two
// random bits and at the first and last bit of each kind's first message - at several
// topologies (static with CP, with TP x PP, data on every rank, dynamic with and without a
// column), with a file source (a cursor in the position) and with fed samples carrying fields
// of every kind (every array of a shard, sample fields), and with media (the exchange's and the
// delivery's media frames and their size frames). Each time, the rank that received the
// damaged message fails with Corruption naming the message and its sender, every other rank
// fails with that error's origin, and no rank hangs (a timeout would be kAborted).
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fault_group.h"
#include "fields_checks.h"
#include "step_checks.h"
#include "thdpack/cost.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

using testing::FaultGroup;
using testing::FaultPlan;

struct FaultCase {
  const char* name;
  int tp, cp, dp, pp;
  DataOn data_on;
  bool dynamic;
  bool fed;  // samples with fields, fed by the caller; else a jsonl file (a cursor)
  bool media = false;  // fed samples with an image each (docs/media.md): media frames too
};

const FaultCase kCases[] = {
    {"static_cp2_dp2_fed_fields", 1, 2, 2, 1, DataOn::kTp0, false, true},
    {"static_tp2_dp2_pp2_jsonl", 2, 1, 2, 2, DataOn::kTp0, false, false},
    {"all_cp2_dp2_jsonl", 1, 2, 2, 1, DataOn::kAll, false, false},
    {"dynamic_cp2_dp2_jsonl", 1, 2, 2, 1, DataOn::kTp0, true, false},
    {"dynamic_tp2_cp2_fed_fields", 2, 2, 1, 1, DataOn::kTp0, true, true},
    {"static_cp2_dp2_fed_media", 1, 2, 2, 1, DataOn::kTp0, false, true, true},
    {"dynamic_cp2_dp2_fed_media", 1, 2, 2, 1, DataOn::kTp0, true, true, true},
    {"dynamic_tp2_cp2_fed_media", 2, 2, 1, 1, DataOn::kTp0, true, true, true},
};

constexpr TokenId kImage = 100000;

// SampleAt(p) with an image of grid (1, 2, 2p % 6 + 2) at merge 2 on its tokens 1.. where it
// has room (its payload: float32 rows of 3), and mRoPE positions.
Sample MediaSampleAt(int64_t p) {
  Sample x = testing::SampleAt(p);
  MediaPart part;
  const int64_t w = 2 * (p % 3) + 2, tokens = w / 2;
  if (static_cast<int64_t>(x.tokens.size()) > tokens + 1) {
    for (int64_t t = 1; t <= tokens; ++t) x.tokens[static_cast<size_t>(t)] = kImage;
    part.grid = {1, 2, w};
    part.dtype = static_cast<uint8_t>(FieldDtype::kFloat32);
    part.width = 3;
    part.payload.resize(static_cast<size_t>(2 * w * 3 * 4));
    for (size_t b = 0; b < part.payload.size(); ++b) {
      part.payload[b] = static_cast<std::byte>((p * 31 + static_cast<int64_t>(b)) % 251);
    }
  }
  x.media.push_back(std::move(part));
  return x;
}

StepRunnerOptions Options(const FaultCase& k, const Topology& topo, const std::string& jsonl) {
  StepRunnerOptions o;
  o.global_batch = 12;
  o.schedule.max_tokens_per_rank = 96;  // several microbatches a step
  o.schedule.parallel = testing::TopologyLayout(topo, false).value();
  o.schedule.dp_size = k.dp;
  o.data_on = k.data_on;
  if (k.dynamic) {  // a small model's step time, as the dynamic scheduler's tests use
    o.schedule.scheduler = ScheduleOptions::Scheduler::kDynamic;
    o.schedule.cost = CostModelFromDims(ModelDims{2, 8, 2, 1, 16, 10}).value();
    o.schedule.step_time = StepTimeModel::Create(ModelDims{2, 8, 2, 1, 16, 10},
                                                 ParseHardwareSpec("1000,10").value())
                               .value();
  }
  if (!k.fed) {
    o.data = "jsonl:" + jsonl;
    return o;
  }
  o.fields = testing::kSchema;
  if (k.media) {
    o.media = {MediaSpec{"image", kImage, false}};
    o.mrope = Mrope::kQwen2Vl;
    // The 'tokens' cost: the encoder's term in tokens, a patch a token plus its frame's
    // attention (the default is in FLOPs, refused with it).
    o.media_cost = EncoderCost{1.0, 1e-3};
  }
  const int64_t n = o.global_batch;
  const int dp = k.dp;
  const bool media = k.media;
  o.read_share = [n, dp, media](int64_t step, int64_t first, int loader) -> Result<StepShare> {
    std::vector<Sample> mine;
    for (int64_t j = 0; j < LoaderCount(n, dp, loader); ++j) {
      const int64_t p = first + j * dp + loader;
      mine.push_back(media ? MediaSampleAt(p) : testing::SampleAt(p));
    }
    THDPACK_ASSIGN_OR_RETURN(const FedShares fed, FedShares::Create(n, dp));
    return fed.Share(step, first, loader, std::move(mine));
  };
  return o;
}

struct Outcome {
  std::vector<Status> statuses;
  std::vector<FaultPlan> plans;  // each rank's, after the step
};

// One step of `k` on every rank, the runner made before the plan is armed; rank target_rank
// (-1: none) damages bit `bit` of its target-th message.
Outcome RunStep(const FaultCase& k, const std::string& jsonl, int target_rank, int target,
                uint64_t bit) {
  const Topology topo = Topology::Create(k.tp, k.cp, k.dp, k.pp).value();
  const StepRunnerOptions o = Options(k, topo, jsonl);
  Outcome out;
  out.plans.resize(static_cast<size_t>(topo.world_size()));
  std::mutex mu;
  ThreadBackendOptions backend;
  backend.timeout = std::chrono::milliseconds(30000);
  out.statuses = RunOnThreads(topo.world_size(), [&](ProcessGroup& world) -> Status {
    auto plan = std::make_shared<FaultPlan>();
    if (world.rank() == target_rank) {
      plan->target = target;
      plan->bit = bit;
    }
    auto wrapped = FaultGroup::Wrap(world, plan);
    Status s;
    {
      auto runner = StepRunner::Create(*wrapped, topo, o);
      if (!runner.ok()) return runner.status();
      plan->armed = true;
      s = (*runner)->Next().status();
    }
    std::lock_guard<std::mutex> lock(mu);
    out.plans[static_cast<size_t>(world.rank())] = *plan;
    return s;
  }, backend);
  return out;
}

// The messages a damaged rank's error may name (thdpack/step_wire.h's and the shards').
bool NamesAMessage(const std::string& m) {
  for (const char* name : {"lengths header:", "lengths:", "position", "samples:", "size:",
                           "step message", "step metadata:", "shard of microbatch", "groups:",
                           "media:"}) {
    if (m.find(name) != std::string::npos) return true;
  }
  return false;
}

class WireFaultTest : public ::testing::TestWithParam<FaultCase> {};

TEST_P(WireFaultTest, EveryDamagedMessageFailsEveryRankByName) {
  const FaultCase k = GetParam();
  testing::ScratchFile file("thdpack_wire_fault.jsonl");
  testing::WriteStepTestJsonl(file.path(), 40, 90, 17);
  const Outcome clean = RunStep(k, file.path(), -1, -1, 0);
  for (size_t r = 0; r < clean.statuses.size(); ++r) {
    ASSERT_TRUE(clean.statuses[r].ok()) << "rank " << r << ": " << clean.statuses[r].ToString();
  }
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(std::string(k.name) + ", seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::set<std::string> kinds;
  int runs = 0;
  for (size_t r = 0; r < clean.plans.size(); ++r) {
    const std::vector<testing::FaultCall>& trace = clean.plans[r].trace;
    std::set<std::string> first_of_kind;
    for (size_t i = 0; i < trace.size(); ++i) {
      const std::string kind = testing::FaultOpName(trace[i].op, trace[i].tag);
      kinds.insert(kind);
      std::vector<uint64_t> bits = {rng(), rng()};
      if (first_of_kind.insert(kind).second) {
        bits.push_back(0);
        bits.push_back(8 * static_cast<uint64_t>(trace[i].bytes) - 1);
      }
      for (uint64_t bit : bits) {
        const std::string what = "rank " + std::to_string(r) + ", message " + std::to_string(i) +
                                 " (" + kind + ", " + std::to_string(trace[i].bytes) +
                                 " bytes), bit " + std::to_string(bit % (8 * trace[i].bytes));
        const Outcome o = RunStep(k, file.path(), static_cast<int>(r), static_cast<int>(i), bit);
        ++runs;
        ASSERT_TRUE(o.plans[r].flipped) << what << ": the step took another path";
        const Status& mine = o.statuses[r];
        ASSERT_EQ(mine.code(), StatusCode::kCorruption) << what << ": " << mine.ToString();
        EXPECT_NE(mine.message().find("received from"), std::string::npos)
            << what << ": " << mine.ToString();
        EXPECT_TRUE(NamesAMessage(mine.message())) << what << ": " << mine.ToString();
        for (size_t q = 0; q < o.statuses.size(); ++q) {
          ASSERT_FALSE(o.statuses[q].ok()) << what << ": rank " << q << " went on";
          EXPECT_EQ(o.statuses[q].origin(), StatusCode::kCorruption)
              << what << ": rank " << q << ": " << o.statuses[q].ToString();
        }
      }
    }
  }
  // Every kind of message a step of this case receives was damaged, at least three times.
  EXPECT_GE(runs, 3 * static_cast<int>(kinds.size()));
  std::string list;
  for (const std::string& kind : kinds) list += " [" + kind + "]";
  std::printf("%s: %d runs over the kinds%s\n", k.name, runs, list.c_str());
}

INSTANTIATE_TEST_SUITE_P(Topologies, WireFaultTest, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace thdpack
