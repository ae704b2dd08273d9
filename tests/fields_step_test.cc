// Fields through the distributed step (thdpack/step_runner.h, thdpack/fields.h) on the thread
// backend: samples fed with fields of every kind and dtype, at topologies with TP, SP, CP, DP and
// PP, static and dynamic schedulers, data on the loaders or on every rank, at depths 0 and 1.
// Every rank's microbatches must hold exactly what a plain reference builds from the samples
// the microbatch names (sample_ids): the input fields on the first stage, the target fields on
// the last, the sample fields everywhere, the loss-token counts per sequence, the step's count
// of sequences with a loss token; every sample of a step is in exactly one microbatch. A sample
// whose field does not fit is an error on every rank naming it.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/fields.h"
#include "thdpack/job.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

struct Case {
  int tp, cp, dp, pp;
  bool sp;
  const char* data_on;
  const char* scheduler;
};

const Case kCases[] = {
    {1, 1, 2, 1, false, "tp0", "balanced"}, {1, 2, 2, 1, false, "tp0", "balanced"},
    {2, 2, 1, 2, true, "tp0", "sequential"}, {1, 2, 1, 2, false, "all", "balanced"},
    {1, 2, 2, 1, false, "tp0", "dynamic"},  {2, 2, 1, 1, false, "all", "dynamic"},
    {1, 4, 1, 1, false, "tp0", "dynamic"},  {1, 1, 3, 2, false, "tp0", "balanced"},
};

std::string Name(const Case& c) {
  return "tp" + std::to_string(c.tp) + " cp" + std::to_string(c.cp) + " dp" +
         std::to_string(c.dp) + " pp" + std::to_string(c.pp) + (c.sp ? " sp " : " ") +
         c.data_on + " " + c.scheduler;
}

const std::vector<FieldSpec> kSchema = {
    {"adv", FieldKind::kTarget, FieldDtype::kFloat32, {}, 0},
    {"old_logp", FieldKind::kTarget, FieldDtype::kBFloat16, {}, -1},
    {"topk", FieldKind::kTarget, FieldDtype::kFloat64, {3}, 0.5},
    {"mrope", FieldKind::kInput, FieldDtype::kInt32, {3}, -7},
    {"token_type", FieldKind::kInput, FieldDtype::kUInt8, {}, 9},
    {"uid", FieldKind::kSample, FieldDtype::kInt64, {}, 0},
    {"reward", FieldKind::kSample, FieldDtype::kFloat32, {}, 0},
    {"flags", FieldKind::kSample, FieldDtype::kBool, {2}, 0},
};

// The sample at stream position p: its length, mask and every field's bytes are a function of
// p, so any rank can rebuild the sample a microbatch names.
Sample SampleAt(int64_t p) {
  Sample x;
  x.id = p;
  const int64_t length = 1 + (p * 37 + 11) % 70;
  for (int64_t t = 0; t < length; ++t) x.tokens.push_back(static_cast<TokenId>((p + t * 7) % 500));
  if (p % 3 != 0) {  // every third all ones; some with no target at all
    x.target_mask.resize(static_cast<size_t>(length));
    for (int64_t t = 0; t < length; ++t) {
      x.target_mask[static_cast<size_t>(t)] = p % 5 == 1 ? 0 : ((t + p) % 4 != 0);
    }
  }
  uint64_t h = static_cast<uint64_t>(p) * 0x9E3779B97F4A7C15ull + 1;
  for (const FieldSpec& f : kSchema) {
    std::vector<std::byte> b(static_cast<size_t>(f.per_token() ? length : 1) * f.row_bytes());
    for (std::byte& v : b) {
      h ^= h << 13;
      h ^= h >> 7;
      h ^= h << 17;
      v = static_cast<std::byte>(f.dtype == FieldDtype::kBool ? h % 2 : h % 256);
    }
    x.fields.push_back(std::move(b));
  }
  return x;
}

Job MakeJob(const Case& c, int64_t global_batch) {
  JobOptions o;
  o.data = "mock";
  o.tp = c.tp;
  o.cp = c.cp;
  o.dp = c.dp;
  o.pp = c.pp;
  o.sp = c.sp;
  o.data_on = c.data_on;
  o.scheduler = c.scheduler;
  o.global_batch = global_batch;
  o.max_tokens_per_rank = 96;  // several microbatches a step
  o.timeout = 60;
  auto job = ResolveJob(o);
  EXPECT_TRUE(job.ok()) << job.status().ToString();
  return *job;
}

StepRunnerOptions FedWithFields(const Job& job, std::function<void(Sample&)> edit = nullptr) {
  StepRunnerOptions o = RunnerOptions(job);
  o.fields = kSchema;
  const int64_t n = job.options.global_batch;
  const int dp = job.topology.dp_size();
  o.read_share = [n, dp, edit](int64_t step, int64_t first_position,
                               int loader) -> Result<StepShare> {
    std::vector<Sample> mine;
    for (int64_t k = 0; k < LoaderCount(n, dp, loader); ++k) {
      mine.push_back(SampleAt(first_position + k * dp + loader));
      if (edit) edit(mine.back());
    }
    return FedStepShare(n, dp, step, first_position, loader, std::move(mine));
  };
  return o;
}

// One microbatch of one rank against the reference built from the samples it names.
Status CheckMicrobatch(const RankStep& step, const LocalMicrobatch& m, size_t index) {
  const std::string where = "step " + std::to_string(step.step) + " microbatch " +
                            std::to_string(index) + ": ";
  const size_t n = m.cu_seqlens.size() - 1;
  if (m.idle) {
    for (const auto& f : m.fields) {
      if (!f.empty()) return Status::Internal(where + "an idle microbatch holds a field");
    }
    return m.sample_ids.empty() ? Status::Ok() : Status::Internal(where + "idle with ids");
  }
  if (m.sample_ids.size() != n || m.seq_n_targets.size() != n ||
      m.fields.size() != kSchema.size()) {
    return Status::Internal(where + "sizes of sample_ids / seq_n_targets / fields");
  }
  std::vector<Sample> samples;
  for (size_t i = 0; i < n; ++i) {
    samples.push_back(SampleAt(m.sample_ids[i]));
    const Sample& x = samples.back();
    if (static_cast<int64_t>(x.tokens.size()) != m.cu_seqlens[i + 1] - m.cu_seqlens[i]) {
      return Status::Internal(where + "sample id " + std::to_string(x.id) +
                              " does not have its sequence's length");
    }
    if (m.seq_n_targets[i] != NumTargets(x)) {
      return Status::Internal(where + "seq_n_targets of sequence " + std::to_string(i));
    }
  }
  Layout layout;
  layout.cu_seqlens = m.cu_seqlens;
  layout.cu_seqlens_padded = m.cu_seqlens_padded;
  layout.total_tokens = m.total_tokens;
  // The tokens as an input field of int32 (fill: the pad id 0) name the same samples.
  if (step.first_stage) {
    const FieldSpec tokens{"t", FieldKind::kInput, FieldDtype::kInt32, {}, 0};
    std::vector<std::span<const std::byte>> v;
    for (const Sample& x : samples) v.push_back(std::as_bytes(std::span<const TokenId>(x.tokens)));
    THDPACK_ASSIGN_OR_RETURN(auto want,
                             PackFieldReference(tokens, v, layout, m.cp_size, m.cp_rank));
    if (std::memcmp(want.data(), m.tokens.data(), want.size()) != 0 ||
        want.size() != m.tokens.size() * 4) {
      return Status::Internal(where + "tokens are not those of the samples named");
    }
  }
  for (size_t f = 0; f < kSchema.size(); ++f) {
    const FieldSpec& spec = kSchema[f];
    std::vector<std::span<const std::byte>> v;
    for (const Sample& x : samples) v.push_back(x.fields[f]);
    std::vector<std::byte> want;
    if (!spec.per_token()) {
      for (const auto& b : v) want.insert(want.end(), b.begin(), b.end());
    } else if (spec.kind == FieldKind::kInput ? step.first_stage : step.last_stage) {
      THDPACK_ASSIGN_OR_RETURN(want, PackFieldReference(spec, v, layout, m.cp_size, m.cp_rank));
    }
    if (m.fields[f] != want) {
      return Status::Internal(where + "field " + spec.ToString() + " differs from the reference (" +
                              std::to_string(m.fields[f].size()) + " bytes, want " +
                              std::to_string(want.size()) + ")");
    }
  }
  return Status::Ok();
}

TEST(FieldsStep, EveryRankHoldsTheReferenceFields) {
  constexpr int64_t kBatch = 20, kSteps = 3;
  for (const Case& c : kCases) {
    const Job job = MakeJob(c, kBatch);
    const StepRunnerOptions options = FedWithFields(job);
    for (int depth : {0, 1}) {
      SCOPED_TRACE(Name(c) + " depth " + std::to_string(depth));
      std::mutex mu;
      std::map<int64_t, int> seen;  // sample id -> microbatches holding it (CP rank 0, tp0 pp0)
      const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
        StepSourceOptions so;
        so.depth = depth;
        THDPACK_ASSIGN_OR_RETURN(auto source, StepSource::Create(w, job.topology, options, so));
        for (int64_t s = 0; s < kSteps; ++s) {
          THDPACK_ASSIGN_OR_RETURN(RankStep step, source->Next());
          int64_t want_sequences = 0;
          for (int64_t p = s * kBatch; p < (s + 1) * kBatch; ++p) {
            want_sequences += NumTargets(SampleAt(p)) > 0 ? 1 : 0;
          }
          if (step.n_loss_sequences != want_sequences) {
            return Status::Internal("step " + std::to_string(s) + ": n_loss_sequences " +
                                    std::to_string(step.n_loss_sequences) + ", want " +
                                    std::to_string(want_sequences));
          }
          for (size_t k = 0; k < step.microbatches.size(); ++k) {
            const LocalMicrobatch& m = step.microbatches[k];
            THDPACK_RETURN_IF_ERROR(CheckMicrobatch(step, m, k));
            if (!m.idle && m.cp_rank == 0 && step.coord.tp == 0 && step.coord.pp == 0) {
              std::lock_guard<std::mutex> lock(mu);
              for (int64_t id : m.sample_ids) ++seen[id];
            }
          }
        }
        return Status::Ok();
      });
      for (size_t r = 0; r < statuses.size(); ++r) {
        EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
      }
      ASSERT_EQ(seen.size(), static_cast<size_t>(kBatch * kSteps));
      for (const auto& [id, count] : seen) EXPECT_EQ(count, 1) << "sample " << id;
    }
  }
}

// Unpacking the packed values of a target field gives every loader its samples' field back, in
// its order, row 0 the fill: at every topology, for a scalar float32 field and a [L, 3] float64
// one. A last-stage rank that passes no values is an error on every rank.
TEST(FieldsStep, UnpackGivesEveryLoaderItsSamplesBack) {
  constexpr int64_t kBatch = 20;
  for (const Case& c : kCases) {
    SCOPED_TRACE(Name(c));
    const Job job = MakeJob(c, kBatch);
    const StepRunnerOptions options = FedWithFields(job);
    // The rank that passes nothing when `missing`: tp 0 of the last stage, the last CP and DP.
    const int silent = *job.topology.RankOf(
        Coord{0, c.cp - 1, c.dp - 1, c.pp - 1});
    for (bool missing : {false, true}) {
      std::atomic<bool> held_values{false};  // the silent rank held a microbatch to send
      const auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& w) -> Status {
        THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, options));
        THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
        THDPACK_ASSIGN_OR_RETURN(Coord me, job.topology.CoordOf(w.rank()));
        std::vector<int64_t> own;
        if (ReadsShare(me, options)) {
          for (int64_t k = 0; k < LoaderCount(kBatch, job.topology.dp_size(), me.dp); ++k) {
            own.push_back(static_cast<int64_t>(
                SampleAt(k * job.topology.dp_size() + me.dp).tokens.size()));
          }
        }
        for (size_t f : {size_t{0}, size_t{2}}) {
          const FieldSpec& spec = kSchema[f];
          std::vector<UnpackMicrobatch> mbs;
          for (const LocalMicrobatch& m : step.microbatches) {
            UnpackMicrobatch u{m.cu_seqlens, m.cu_seqlens_padded, m.cp_size, m.cp_rank, m.idle,
                               m.sample_ids, m.fields[f]};
            if (missing && w.rank() == silent) {
              if (!m.idle) held_values = true;
              u.values = {};
            }
            mbs.push_back(u);
          }
          const std::vector<std::byte> fill = FillRow(spec);
          UnpackArgs args{0, kBatch, own, spec.row_bytes(), fill};
          Result<std::vector<std::vector<std::byte>>> got =
              UnpackStep(w, job.topology, options, mbs, args);
          if (missing && held_values) {
            if (got.ok()) return Status::Internal("unpack without one rank's values succeeded");
            if (got.status().message().find("must pass its values") == std::string::npos &&
                got.status().code() != StatusCode::kAborted) {
              return Status::Internal("unpack without values: " + got.status().ToString());
            }
            return Status::Ok();
          }
          if (!got.ok()) return got.status();
          if (got->size() != own.size()) return Status::Internal("unpack: sample count");
          for (size_t k = 0; k < own.size(); ++k) {
            std::vector<std::byte> want =
                SampleAt(static_cast<int64_t>(k) * job.topology.dp_size() + me.dp).fields[f];
            std::memcpy(want.data(), fill.data(), fill.size());
            if ((*got)[k] != want) {
              return Status::Internal("unpack: field " + spec.name + " of loader sample " +
                                      std::to_string(k) + " differs");
            }
          }
        }
        return Status::Ok();
      });
      for (size_t r = 0; r < statuses.size(); ++r) {
        EXPECT_TRUE(statuses[r].ok()) << (missing ? "missing, " : "") << "rank " << r << ": "
                                      << statuses[r].ToString();
      }
    }
  }
}

// A sample whose field has the wrong size fails the step on every rank, the loader's error
// naming the sample, the field and the sizes; fields without a fed source are refused.
TEST(FieldsStep, AFieldThatDoesNotFitIsAnErrorOnEveryRank) {
  const Case& c = kCases[1];
  const Job job = MakeJob(c, 8);
  const StepRunnerOptions options = FedWithFields(job, [](Sample& x) {
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
    EXPECT_NE(s.message().find("only a source fed by the caller carries fields"),
              std::string::npos)
        << s.ToString();
  }
}

}  // namespace
}  // namespace thdpack
