// The probe model: the distributed forward over real steps (thread backend) gives the single-rank
// reference's loss, perplexity, entropy and token counts at many topologies, with and without SP,
// in both data-on modes; a wrong data path is caught; the reference itself is causal, per
// sequence and uses its context.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "step_checks.h"
#include "thdpack/probe.h"

namespace thdpack {
namespace {

using testing::StepCase;

using testing::ScratchFile;

ProbeModel SmallModel(int layers = 4) {
  ProbeConfig c;
  c.vocab_size = 97;  // prime, so TP splits give uneven column counts
  c.hidden = 16;
  c.heads = 2;
  c.layers = layers;
  c.ffn = 24;
  c.seed = 5;
  auto m = ProbeModel::Create(c);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return std::move(*m);
}

StepRunnerOptions CaseOptions(const StepCase& k, const std::string& jsonl) {
  StepRunnerOptions o;
  o.data = "jsonl:" + jsonl;
  o.global_batch = 24;
  o.schedule.max_tokens_per_rank = 256;
  o.schedule.parallel = ParallelLayout::Create(k.cp, k.tp, k.sp).value();
  o.schedule.dp_size = k.dp;  // the topology's
  o.data_on = k.data_on;
  o.check_plan_hash = true;
  o.pad_id = 7;  // padding must not matter
  return o;
}

// Runs `steps` steps of a case; rank 0 compares every step with the single-rank reference.
// tamper, when set, may change a rank's step before the probe sees it.
Status RunProbeCase(ProcessGroup& world, const StepCase& k, const std::string& jsonl,
                    const ProbeModel& model, int steps,
                    const std::function<void(const Coord&, RankStep&)>& tamper = nullptr) {
  THDPACK_ASSIGN_OR_RETURN(Topology topo, Topology::Create(k.tp, k.cp, k.dp, k.pp));
  const StepRunnerOptions o = CaseOptions(k, jsonl);
  THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, topo, o));
  THDPACK_ASSIGN_OR_RETURN(auto probe, ProbeRunner::Create(world, topo, model, k.sp));
  std::unique_ptr<SampleSource> plain;
  if (world.rank() == 0) {
    THDPACK_ASSIGN_OR_RETURN(plain, OpenSource(o.data, o.source));
  }
  for (int s = 0; s < steps; ++s) {
    THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
    if (tamper) tamper(step.coord, step);
    THDPACK_ASSIGN_OR_RETURN(LossSummary got, probe->Forward(step));
    if (world.rank() != 0) continue;
    THDPACK_ASSIGN_OR_RETURN(std::vector<Sample> samples,
                             ReadStepSamplesPlain(*plain, o.global_batch, step.meta.skipped_ids));
    std::vector<SampleView> views(samples.begin(), samples.end());
    THDPACK_ASSIGN_OR_RETURN(LossStats ref, ProbeReferenceLoss(model, views));
    THDPACK_RETURN_IF_ERROR(CompareLossSummaries(got, Finalize(ref), 1e-9)
                                .WithContext(testing::CaseName(k) + " step " + std::to_string(s)));
    if (got.n_loss_tokens == 0 || !got.ppl) {
      return Status::Internal("the test data should give loss tokens and a perplexity");
    }
  }
  return Status::Ok();
}

std::vector<Status> RunCase(const StepCase& k, const std::string& jsonl, const ProbeModel& model,
                            int steps,
                            const std::function<void(const Coord&, RankStep&)>& tamper = nullptr) {
  const int world = k.tp * k.cp * k.dp * k.pp;
  return RunOnThreads(world, [&](ProcessGroup& w) {
    return RunProbeCase(w, k, jsonl, model, steps, tamper);
  });
}

std::vector<StepCase> ProbeCases() {
  // The four verification topologies first, then the step tests' eight, then odd CP
  // and TP sizes and a pipeline deeper than the model.
  const int topos[][5] = {
      {1, 2, 2, 1, 0}, {2, 2, 2, 1, 1}, {1, 1, 2, 4, 0}, {2, 2, 1, 2, 0}, {1, 1, 1, 1, 0},
      {1, 1, 8, 1, 0}, {2, 1, 4, 1, 0}, {2, 1, 4, 1, 1}, {1, 2, 4, 1, 0}, {2, 2, 2, 1, 0},
      {2, 1, 1, 4, 1}, {2, 2, 1, 2, 1}, {1, 2, 2, 2, 0}, {1, 3, 1, 1, 0}, {4, 1, 1, 1, 1},
      {1, 4, 1, 2, 0}, {3, 1, 2, 1, 1}, {1, 1, 1, 6, 0}};
  std::vector<StepCase> out;
  for (const auto& t : topos) {
    for (DataOn d : {DataOn::kTp0, DataOn::kAll}) {
      out.push_back({t[0], t[1], t[2], t[3], t[4] != 0, d});
    }
  }
  return out;
}

class ProbeCaseTest : public ::testing::TestWithParam<StepCase> {};

// Three steps of 24 samples from a 50-sample file (the third wraps into epoch 1), every third
// sample with a prompt mask.
TEST_P(ProbeCaseTest, MatchesSingleRankReference) {
  ScratchFile file("thdpack_probe.jsonl");
  testing::WriteStepTestJsonl(file.path(), 50, 60, 17);
  const ProbeModel model = SmallModel();
  for (const Status& s : RunCase(GetParam(), file.path(), model, 3)) {
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, ProbeCaseTest, ::testing::ValuesIn(ProbeCases()),
                         [](const auto& info) { return testing::CaseName(info.param); });

// A data path that delivers one wrong token is caught by the comparison.
TEST(ProbeRunner, CatchesAWrongToken) {
  ScratchFile file("thdpack_probe_bad.jsonl");
  testing::WriteStepTestJsonl(file.path(), 30, 60, 3);
  const ProbeModel model = SmallModel();
  const StepCase k{1, 2, 2, 1, false, DataOn::kTp0};
  auto statuses = RunCase(k, file.path(), model, 1, [](const Coord& c, RankStep& step) {
    if (c.cp == 0 && c.dp == 1) {
      for (TokenId& t : step.microbatches[0].tokens) t += 1;
    }
  });
  ASSERT_FALSE(statuses[0].ok());
  EXPECT_EQ(statuses[0].code(), StatusCode::kInternal) << statuses[0].ToString();
  EXPECT_NE(statuses[0].ToString().find("differ from the single-rank reference"),
            std::string::npos)
      << statuses[0].ToString();
}

// Position ids that do not follow the metadata fail on their rank and abort the others.
TEST(ProbeRunner, PositionIdsMustMatchMetadata) {
  ScratchFile file("thdpack_probe_pos.jsonl");
  testing::WriteStepTestJsonl(file.path(), 30, 60, 4);
  const ProbeModel model = SmallModel();
  const StepCase k{2, 2, 1, 2, false, DataOn::kTp0};
  auto statuses = RunCase(k, file.path(), model, 1, [](const Coord& c, RankStep& step) {
    if (c.tp == 1 && c.cp == 1 && c.pp == 0) step.microbatches[0].position_ids[0] = 99;
  });
  int internal = 0, aborted = 0;
  for (const Status& s : statuses) {
    internal += s.code() == StatusCode::kInternal;
    aborted += s.code() == StatusCode::kAborted;
  }
  EXPECT_EQ(internal, 1);
  EXPECT_EQ(aborted, 7);
  EXPECT_NE(statuses[3].ToString().find("position ids"), std::string::npos)
      << statuses[3].ToString();
}

// A last stage whose labels were dropped is an input error, agreed on every rank.
TEST(ProbeRunner, MissingLabelsAreAnError) {
  ScratchFile file("thdpack_probe_labels.jsonl");
  testing::WriteStepTestJsonl(file.path(), 30, 60, 5);
  const ProbeModel model = SmallModel();
  const StepCase k{1, 1, 2, 2, false, DataOn::kTp0};
  auto statuses = RunCase(k, file.path(), model, 1, [](const Coord& c, RankStep& step) {
    if (c.dp == 0 && c.pp == 1) step.microbatches[0].labels.clear();
  });
  for (const Status& s : statuses) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.ToString().find("labels"), std::string::npos) << s.ToString();
  }
}

// ---- The reference model itself. ----

LossStats RefStats(const ProbeModel& model, const std::vector<Sample>& samples) {
  std::vector<SampleView> views(samples.begin(), samples.end());
  auto r = ProbeReferenceLoss(model, views);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : LossStats{};
}

// Causal: the log-probs of a prefix's targets do not depend on the tokens after it (bitwise),
// and each sample is computed alone (the others in the list change nothing).
TEST(ProbeReference, CausalAndPerSequence) {
  const ProbeModel model = SmallModel(2);
  std::vector<TokenId> tokens = {5, 17, 3, 88, 41, 9, 60, 2, 33, 71};
  Sample prefix{1, std::vector<TokenId>(tokens.begin(), tokens.begin() + 6), {}};
  Sample longer{2, tokens, std::vector<uint8_t>(tokens.size(), 0)};
  for (int j = 0; j < 6; ++j) longer.target_mask[static_cast<size_t>(j)] = 1;
  const LossStats a = RefStats(model, {prefix});
  const LossStats b = RefStats(model, {longer});
  ASSERT_EQ(a.n_loss_tokens, 5);
  ASSERT_EQ(b.n_loss_tokens, 5);
  EXPECT_EQ(a.sequences.at(1).logprob_sum, b.sequences.at(2).logprob_sum);
  EXPECT_EQ(a.n_tokens, 6);
  EXPECT_EQ(b.n_tokens, 10);
  Sample other{3, {9, 9, 9, 1}, {}};
  const LossStats both = RefStats(model, {other, prefix});
  EXPECT_EQ(both.sequences.at(1).logprob_sum, a.sequences.at(1).logprob_sum);
  EXPECT_EQ(both.n_loss_tokens, 5 + 3);
}

// The context matters: changing the first token changes the loss of every later target, and
// the loss is a proper cross-entropy (positive, entropy below log V).
TEST(ProbeReference, UsesContext) {
  const ProbeModel model = SmallModel(2);
  Sample s1{1, {5, 17, 3, 88, 41, 9}, {}};
  Sample s2{1, {6, 17, 3, 88, 41, 9}, {}};
  const LossSummary f1 = Finalize(RefStats(model, {s1}));
  const LossSummary f2 = Finalize(RefStats(model, {s2}));
  EXPECT_GT(RelativeDifference(f1.loss, f2.loss), 1e-6);
  EXPECT_GT(f1.loss, 0);
  EXPECT_GT(f1.entropy, 0);
  EXPECT_LT(f1.entropy, std::log(97.0));
  ASSERT_TRUE(f1.ppl.has_value());
  EXPECT_GT(*f1.ppl, 1.0);
}

TEST(ProbeModel, DeterministicWeightsAndConfigErrors) {
  const ProbeModel a = SmallModel(), b = SmallModel();
  std::vector<TokenId> t = {1, 2, 3};
  std::vector<double> xa(3 * 16), xb(3 * 16);
  a.Embed(t, xa);
  b.Embed(t, xb);
  EXPECT_EQ(xa, xb);
  EXPECT_EQ(a.StageLayers(0, 3), std::make_pair(0, 1));
  EXPECT_EQ(a.StageLayers(2, 3), std::make_pair(2, 4));
  EXPECT_EQ(a.StageLayers(5, 6), std::make_pair(3, 4));
  EXPECT_EQ(a.StageLayers(0, 6), std::make_pair(0, 0));  // an empty stage passes through
  ProbeConfig c;
  c.hidden = 30;
  c.heads = 4;
  auto bad = ProbeModel::Create(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("hidden = 30"), std::string::npos);
  c = ProbeConfig{};
  c.vocab_size = 0;
  EXPECT_FALSE(ProbeModel::Create(c).ok());
}

TEST(ProbeCompare, ReportsEveryDifference) {
  LossSummary a;
  a.n_tokens = 10;
  a.n_loss_tokens = 8;
  a.loss = 2.0;
  a.entropy = 1.5;
  a.ppl = 7.0;
  LossSummary b = a;
  EXPECT_TRUE(CompareLossSummaries(a, b, 1e-9).ok());
  b.loss = 2.0 * (1 + 1e-10);
  EXPECT_TRUE(CompareLossSummaries(a, b, 1e-9).ok());
  b.loss = 2.0 * (1 + 1e-8);
  b.n_loss_tokens = 9;
  b.ppl.reset();
  Status s = CompareLossSummaries(a, b, 1e-9);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.ToString().find("loss 2"), std::string::npos) << s.ToString();
  EXPECT_NE(s.ToString().find("n_loss_tokens 8 vs 9"), std::string::npos) << s.ToString();
  EXPECT_NE(s.ToString().find("ppl defined vs null"), std::string::npos) << s.ToString();
  EXPECT_EQ(RelativeDifference(0, 0), 0);
  EXPECT_DOUBLE_EQ(RelativeDifference(1, 2), 0.5);
}

// The plain reader: wraps at the end of the source, leaves skipped ids out, "all" reads the
// rest of the epoch.
TEST(ReadStepSamplesPlain, WrapsAndSkips) {
  ScratchFile file("thdpack_probe_read.jsonl");
  testing::WriteStepTestJsonl(file.path(), 5, 10, 1);
  auto src = OpenSource("jsonl:" + file.path());
  ASSERT_TRUE(src.ok());
  const int64_t skip[] = {1};
  auto s0 = ReadStepSamplesPlain(**src, 4, skip);
  ASSERT_TRUE(s0.ok()) << s0.status().ToString();
  ASSERT_EQ(s0->size(), 3u);
  EXPECT_EQ((*s0)[0].id, 0);
  EXPECT_EQ((*s0)[1].id, 2);
  EXPECT_EQ((*s0)[2].id, 3);
  auto s1 = ReadStepSamplesPlain(**src, 3, {});
  ASSERT_TRUE(s1.ok());
  ASSERT_EQ(s1->size(), 3u);
  EXPECT_EQ((*s1)[0].id, 4);
  EXPECT_EQ((*s1)[1].id, 5);  // the next epoch keeps counting ids
  auto all = ReadStepSamplesPlain(**src, 0, {});
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 3u);  // the rest of epoch 1
}

}  // namespace
}  // namespace thdpack
