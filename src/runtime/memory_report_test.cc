// The memory report on hand-worked cases: step figures from a plan, a rank's figures from what it
// holds, the profile file's name, JSON and writing. Every expected value is worked out here.
#include "thdpack/memory_report.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "hand_plan.h"

namespace thdpack {
namespace {

// Samples (id: L) 10: 3, 11: 5, 12: 2, 13: 6; DP = 2, CP = 2 (P = multiples of 4: 4, 8, 4, 8).
// Replica 0 = [10, 12]: T = 4 + 4 = 8, 4 local tokens; replica 1 = [11, 13]: T = 16, 8 local.
using testing::HandOptions;
using testing::HandPlan;
using testing::HandSamples;

// Replica 1 (8 local tokens, 2 sequences): tokens, position_ids, labels 8 x 4 = 32 bytes each,
// loss_mask 8, metadata 2 arrays x 3 offsets x 4 = 24, loss outputs 8 x 17 = 136; total
// 96 + 8 + 24 + 136 = 264. Replica 0 (4 local): 48 + 4 + 24 + 68 = 144. The busiest is 1.
// Logits, V = 10, fp32, largest T = 16: gathered 16 x 10 x 4 = 640, CP-local 8 x 10 x 4 = 320.
TEST(MemoryReportTest, StepFiguresOfAHandPlan) {
  MemoryReportOptions m;
  m.vocab_size = 10;
  m.logits_dtype = LogitsDtype::kFloat32;
  auto f = ComputeStepMemory(HandSamples(), HandOptions(), HandPlan(), m);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->busiest_replica, 1);
  EXPECT_EQ(f->num_microbatches, 1);
  EXPECT_EQ(f->buffers.tokens, 32);
  EXPECT_EQ(f->buffers.loss_mask, 8);
  EXPECT_EQ(f->buffers.metadata, 24);
  EXPECT_EQ(f->buffers.loss_outputs, 136);
  EXPECT_EQ(f->buffers.total, 264);
  ASSERT_TRUE(f->logits.has_value());
  EXPECT_EQ(f->logits->total_tokens, 16);
  EXPECT_EQ(f->logits->bytes.gathered_logits_bytes, 640);
  EXPECT_EQ(f->logits->bytes.local_logits_bytes, 320);
  EXPECT_EQ(f->logits->bytes.local_total_bytes, 320);
  EXPECT_EQ(StepMemoryJson(*f),
            "{\"logits\":{\"largest_microbatch_tokens\":16,\"vocab_size\":10,\"dtype\":"
            "\"float32\",\"cp_size\":2,\"tp_size\":1,\"with_grad\":false,\"local_bytes\":320,"
            "\"gathered_bytes\":640,\"local_grad_bytes\":0,\"gathered_grad_bytes\":0,"
            "\"local_total_bytes\":320,\"gathered_total_bytes\":640},\"buffers_per_rank\":{"
            "\"replica\":1,\"num_microbatches\":1,\"tokens\":32,\"position_ids\":32,"
            "\"labels\":32,\"loss_mask\":8,\"metadata\":24,\"loss_outputs\":136,\"total\":264}}");

  // TP = 3 (vocab-parallel): ceil(10 / 3) = 4 columns: 16 x 4 x 4 = 256 and 128; the fused
  // gradient doubles the totals.
  ScheduleOptions tp3 = HandOptions();
  tp3.parallel = ParallelLayout::Create(tp3.parallel.cp_size(), 3).value();
  m.with_grad = true;
  auto g = ComputeStepMemory(HandSamples(), tp3, HandPlan(), m);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ(g->logits->tp_size, 3);
  EXPECT_EQ(g->logits->bytes.gathered_logits_bytes, 256);
  EXPECT_EQ(g->logits->bytes.local_grad_bytes, 128);
  EXPECT_EQ(g->logits->bytes.local_total_bytes, 256);
  EXPECT_EQ(g->logits->bytes.gathered_total_bytes, 512);

  // No vocabulary: buffers only.
  auto none = ComputeStepMemory(HandSamples(), HandOptions(), HandPlan(), {});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->logits.has_value());
  EXPECT_EQ(StepMemoryJson(*none).rfind("{\"logits\":null,\"buffers_per_rank\":", 0), 0u);
}

// One sequence of 131,072 tokens at CP = 2 (P = 131072, a multiple of 4), V = 151,936, bf16:
// 131072 x 151936 x 2 = 39,829,110,784 bytes gathered (37.09375 GiB), half of it CP-local:
// 19,914,555,392 (18.546875 GiB). Buffers of the 65,536 local tokens: 3 x 262,144 + 65,536
// + metadata 2 x 2 x 4 = 16 + loss outputs 65,536 x 17 = 1,114,112: 1,966,096 bytes.
TEST(MemoryReportTest, LongSequenceAtCp2) {
  ScheduleOptions o;
  o.parallel = ParallelLayout::Create(2).value();
  o.max_tokens_per_rank = 65536;
  Plan p;
  p.num_microbatches = 1;
  p.dp_size = 1;
  p.sample_ids = {0};
  p.offsets = {0, 1};
  MemoryReportOptions m;
  m.vocab_size = 151936;
  auto f = ComputeStepMemory(std::vector<SampleLength>{{0, 131072, 131071}}, o, p, m);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->logits->total_tokens, 131072);
  EXPECT_EQ(f->logits->bytes.gathered_logits_bytes, 39829110784);
  EXPECT_EQ(f->logits->bytes.local_logits_bytes, 19914555392);
  EXPECT_EQ(f->buffers.total, 1966096);
}

TEST(MemoryReportTest, StepFiguresErrors) {
  MemoryReportOptions bad_vocab;
  bad_vocab.vocab_size = -1;
  auto v = ComputeStepMemory(HandSamples(), HandOptions(), HandPlan(), bad_vocab);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("vocab_size = -1"), std::string::npos);

  MemoryReportOptions bad_dtype;
  bad_dtype.vocab_size = 10;
  bad_dtype.logits_dtype = static_cast<LogitsDtype>(7);
  EXPECT_FALSE(ComputeStepMemory(HandSamples(), HandOptions(), HandPlan(), bad_dtype).ok());

  Plan unknown = HandPlan();
  unknown.sample_ids[3] = 99;
  auto u = ComputeStepMemory(HandSamples(), HandOptions(), unknown, {});
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.status().message().find("sample id 99"), std::string::npos);

  Plan short_offsets = HandPlan();
  short_offsets.offsets = {0, 4};
  EXPECT_FALSE(ComputeStepMemory(HandSamples(), HandOptions(), short_offsets, {}).ok());
}

TEST(MemoryReportTest, StepFiguresFromPlanFiguresErrors) {
  auto empty = ComputeStepMemoryFromFigures(PlanFigures{}, HandOptions(), {});
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("no replica"), std::string::npos);
  PlanFigures odd = ComputePlanFigures(HandSamples(), HandOptions(), HandPlan()).value();
  odd.replicas[1].microbatches[0].padded_tokens = 7;  // not a multiple of CP = 2
  auto o = ComputeStepMemoryFromFigures(odd, HandOptions(), {});
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("replica 1, microbatch 0"), std::string::npos);
}

// The fast path (from the plan's figures: T and n per microbatch) against the reference (a
// layout per microbatch from the samples' lengths) on fresh random steps and options.
TEST(MemoryReportTest, StepFiguresFromPlanFiguresEqualTheReferenceOnRandomPlans) {
  std::mt19937_64 rng(41);
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const size_t n = 1 + rng() % 2000;
    std::vector<SampleLength> samples(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t length = 1 + static_cast<int64_t>(rng() % (rng() % 2 ? 300 : 30000));
      samples[i] = {static_cast<int64_t>(i) * 3 + 5, length, length - 1};
    }
    ScheduleOptions o;
    o.dp_size = 1 + static_cast<int>(rng() % 6);
    const int tp = 1 + static_cast<int>(rng() % 2);
    o.parallel = ParallelLayout::Create(1 << (rng() % 3), tp, tp > 1 && rng() % 2 == 0).value();
    o.max_tokens_per_rank = 1 << (14 + rng() % 4);
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    o.scheduler = rng() % 2 ? ScheduleOptions::Scheduler::kBalanced
                            : ScheduleOptions::Scheduler::kSequential;
    Result<Plan> plan = Schedule(samples, o);
    if (!plan.ok()) continue;  // too few samples for DP
    MemoryReportOptions memory;
    memory.vocab_size = rng() % 2 ? 0 : 32000;
    memory.with_grad = rng() % 2 == 0;
    Result<StepMemoryFigures> reference = ComputeStepMemory(samples, o, *plan, memory);
    ASSERT_TRUE(reference.ok()) << reference.status().ToString();
    Result<StepMemoryFigures> fast = ComputeStepMemoryFromFigures(
        ComputePlanFigures(samples, o, *plan).value(), o, memory);
    ASSERT_TRUE(fast.ok()) << fast.status().ToString();
    EXPECT_EQ(fast->busiest_replica, reference->busiest_replica);
    EXPECT_EQ(fast->buffers.total, reference->buffers.total);
    EXPECT_EQ(fast->logits.has_value(), reference->logits.has_value());
    EXPECT_EQ(StepMemoryJson(*fast), StepMemoryJson(*reference));  // every field
  }
}

// Two microbatches on a rank of TP = 2, CP = 2, DP = 2, PP = 2:
//   mb 0: cu_seqlens [0,3,5], cu_seqlens_padded [0,4,8], T = 8, 4 local tokens;
//   mb 1: cu_seqlens [0,13], cu_seqlens_padded [0,16], T = 16, 8 local tokens.
// First stage (tokens, position_ids): 12 x 4 = 48 bytes each; metadata (3 + 3 + 2 + 2) x 4 =
// 40; total 136. Last stage (labels 48, loss_mask 12, metadata 40): 100. Rank of
// (tp 1, cp 0, dp 1, pp 0) = 1 + 2 x (0 + 2 x (1 + 2 x 0)) = 5; of pp 1: 1 + 2 x 6 = 13.
// Logits on the last stage, V = 10, fp32, TP = 2 (5 columns), T = 16: 16 x 5 x 4 = 320
// gathered, 160 CP-local.
RankStep HandRankStep(bool first_stage) {
  RankStep s;
  s.step = 3;
  s.coord = Coord{1, 0, 1, first_stage ? 0 : 1};
  s.first_stage = first_stage;
  s.last_stage = !first_stage;
  LocalMicrobatch a;
  a.cu_seqlens = {0, 3, 5};
  a.cu_seqlens_padded = {0, 4, 8};
  a.total_tokens = 8;
  a.local_tokens = 4;
  LocalMicrobatch b;
  b.cu_seqlens = {0, 13};
  b.cu_seqlens_padded = {0, 16};
  b.total_tokens = 16;
  b.local_tokens = 8;
  for (LocalMicrobatch* mb : {&a, &b}) {
    const size_t n = static_cast<size_t>(mb->local_tokens);
    if (first_stage) {
      mb->tokens.assign(n, 1);
      mb->position_ids.assign(n, 0);
    } else {
      mb->labels.assign(n, 1);
      mb->loss_mask.assign(n, 1);
    }
  }
  s.microbatches = {a, b};
  return s;
}

TEST(MemoryReportTest, RankFiguresFromWhatItHolds) {
  auto topo = Topology::Create(2, 2, 2, 2);
  ASSERT_TRUE(topo.ok());
  MemoryReportOptions m;
  m.vocab_size = 10;
  m.logits_dtype = LogitsDtype::kFloat32;

  auto first = ComputeRankMemory(HandRankStep(true), *topo, m);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->rank, 5);
  EXPECT_EQ(first->step, 3);
  EXPECT_EQ(first->num_microbatches, 2);
  EXPECT_EQ(first->held.tokens, 48);
  EXPECT_EQ(first->held.position_ids, 48);
  EXPECT_EQ(first->held.labels, 0);
  EXPECT_EQ(first->held.metadata, 40);
  EXPECT_EQ(first->held.fields, 0);
  EXPECT_EQ(first->held.total, 136);
  // Sample ids, loss-token counts and field buffers count too.
  RankStep with_fields = HandRankStep(true);
  with_fields.microbatches[0].sample_ids = {4, 9};
  with_fields.microbatches[0].seq_n_targets = {3, 0};
  with_fields.microbatches[0].fields = {std::vector<std::byte>(24), {}, std::vector<std::byte>(8)};
  auto counted = ComputeRankMemory(with_fields, *topo, m);
  ASSERT_TRUE(counted.ok()) << counted.status().ToString();
  EXPECT_EQ(counted->held.metadata, 40 + 32);
  EXPECT_EQ(counted->held.fields, 32);
  EXPECT_EQ(counted->held.total, 136 + 32 + 32);
  EXPECT_FALSE(first->logits.has_value());  // no logits before the last stage

  auto last = ComputeRankMemory(HandRankStep(false), *topo, m);
  ASSERT_TRUE(last.ok()) << last.status().ToString();
  EXPECT_EQ(last->rank, 13);
  EXPECT_EQ(last->held.labels, 48);
  EXPECT_EQ(last->held.loss_mask, 12);
  EXPECT_EQ(last->held.total, 100);
  ASSERT_TRUE(last->logits.has_value());
  EXPECT_EQ(last->logits->total_tokens, 16);
  EXPECT_EQ(last->logits->bytes.gathered_logits_bytes, 320);
  EXPECT_EQ(last->logits->bytes.local_logits_bytes, 160);

  RankStep outside = HandRankStep(true);
  outside.coord.dp = 2;
  EXPECT_FALSE(ComputeRankMemory(outside, *topo, m).ok());
}

// A dynamic step: a microbatch on a group of 1 (T = 12, all 12 tokens here) and one on a group
// of 4 (T = 16, 4 here). The logits are those of the largest shard, 12 rows of a CP = 1
// microbatch: 12 x 5 x 4 = 240 bytes, local and gathered alike (not T = 16 over the topology's
// CP = 2).
TEST(MemoryReportTest, DynamicStepLogitsFollowTheLargestShard) {
  auto topo = Topology::Create(2, 2, 2, 2);
  ASSERT_TRUE(topo.ok());
  MemoryReportOptions m;
  m.vocab_size = 10;
  m.logits_dtype = LogitsDtype::kFloat32;
  RankStep s = HandRankStep(false);
  s.dynamic = true;
  s.microbatches[0].cu_seqlens = {0, 3, 11};
  s.microbatches[0].cu_seqlens_padded = {0, 3, 12};
  s.microbatches[0].total_tokens = 12;
  s.microbatches[0].local_tokens = 12;
  s.microbatches[0].labels.assign(12, 1);
  s.microbatches[0].loss_mask.assign(12, 1);
  s.microbatches[1].cp_size = 4;
  s.microbatches[1].local_tokens = 4;
  s.microbatches[1].labels.assign(4, 1);
  s.microbatches[1].loss_mask.assign(4, 1);
  auto f = ComputeRankMemory(s, *topo, m);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE(f->logits.has_value());
  EXPECT_EQ(f->logits->bytes.local_logits_bytes, 240);
  EXPECT_EQ(f->logits->bytes.gathered_logits_bytes, 240);
  EXPECT_EQ(f->held.labels, 64);  // (12 + 4) x 4 bytes
}

TEST(MemoryReportTest, ProfileFileNameAndJson) {
  EXPECT_EQ(MemoryProfileFileName(0, 5, Coord{1, 0, 1, 0}), "step_0/rank5_pp0_dp1_cp0_tp1.json");
  EXPECT_EQ(MemoryProfileFileName(12, 13, Coord{1, 0, 1, 1}),
            "step_12/rank13_pp1_dp1_cp0_tp1.json");

  auto topo = Topology::Create(2, 2, 2, 2);
  ASSERT_TRUE(topo.ok());
  MemoryReportOptions m;
  m.vocab_size = 10;
  m.logits_dtype = LogitsDtype::kFloat32;
  auto f = ComputeRankMemory(HandRankStep(false), *topo, m);
  ASSERT_TRUE(f.ok());
  ProcessMemory pm{4096, 2048};
  const auto j = nlohmann::json::parse(RankMemoryJson(*f, pm, 8));
  EXPECT_EQ(j["step"], 3);
  EXPECT_EQ(j["rank"], 13);
  EXPECT_EQ(j["pp"], 1);
  EXPECT_EQ(j["dp"], 1);
  EXPECT_EQ(j["cp"], 0);
  EXPECT_EQ(j["tp"], 1);
  EXPECT_EQ(j["last_stage"], true);
  EXPECT_EQ(j["held_bytes"]["total"], 100);
  EXPECT_EQ(j["logits"]["gathered_bytes"], 320);
  EXPECT_EQ(j["logits"]["local_bytes"], 160);
  EXPECT_EQ(j["process"]["peak_rss_bytes"], 4096);
  EXPECT_EQ(j["process"]["rss_bytes"], 2048);
  EXPECT_EQ(j["process"]["ranks_in_process"], 8);
  EXPECT_TRUE(j["process"].contains("note"));

  const auto alone = nlohmann::json::parse(RankMemoryJson(*f, pm, 1));
  EXPECT_FALSE(alone["process"].contains("note"));
  const auto unknown = nlohmann::json::parse(RankMemoryJson(*f, std::nullopt, 1));
  EXPECT_TRUE(unknown["process"].is_null());
}

TEST(MemoryReportTest, WritesTheProfileFileAndNamesThePathOnFailure) {
  namespace fs = std::filesystem;
  const fs::path root =
      fs::path(::testing::TempDir()) / ("thdpack_memory_report_" + std::to_string(getpid()));
  fs::remove_all(root);
  auto topo = Topology::Create(2, 2, 2, 2);
  ASSERT_TRUE(topo.ok());
  auto f = ComputeRankMemory(HandRankStep(true), *topo, {});
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(WriteMemoryProfile((root / "profile").string(), *f, 1).ok());
  const fs::path file = root / "profile" / "step_3" / "rank5_pp0_dp1_cp0_tp1.json";
  auto read = [&] {
    std::ifstream in(file);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const std::string first = read();
  ASSERT_FALSE(first.empty()) << "missing " << file;
  const auto j = nlohmann::json::parse(first);
  EXPECT_EQ(j["held_bytes"]["total"], 136);
  EXPECT_TRUE(j["logits"].is_null());
  EXPECT_GT(j["process"]["peak_rss_bytes"].get<int64_t>(), 0);
  EXPECT_GE(j["process"]["peak_rss_bytes"].get<int64_t>(),
            j["process"]["rss_bytes"].get<int64_t>());
  // Written again: replaced, not appended to (one JSON object that parses).
  ASSERT_TRUE(WriteMemoryProfile((root / "profile").string(), *f, 1).ok());
  EXPECT_EQ(nlohmann::json::parse(read())["held_bytes"]["total"], 136);

  // A folder that cannot be made (a file stands in its way): IOError naming the path.
  std::ofstream(root / "blocker") << "x";
  Status st = WriteMemoryProfile((root / "blocker").string(), *f, 1);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kIOError);
  EXPECT_NE(st.message().find("blocker"), std::string::npos) << st.message();
  fs::remove_all(root);
}

}  // namespace
}  // namespace thdpack
