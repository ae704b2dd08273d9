// Fields through the distributed step, as checks any backend runs (tests/fields_step_test.cc
// on threads, tests/mpi_check.cc under mpirun): samples fed with fields of every kind and dtype,
// each rank's microbatches compared with a plain reference built from the samples they name
// (sample_ids), every sample of a step counted once over the world, and UnpackStep giving every
// loader its samples' target fields back.
#ifndef THDPACK_TESTS_FIELDS_CHECKS_H_
#define THDPACK_TESTS_FIELDS_CHECKS_H_

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/fields.h"
#include "thdpack/job.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace testing {

struct FieldsCase {
  int tp, cp, dp, pp;
  bool sp;
  const char* data_on;
  const char* scheduler;
};

inline const FieldsCase kFieldCases[] = {
    {1, 1, 2, 1, false, "tp0", "balanced"}, {1, 2, 2, 1, false, "tp0", "balanced"},
    {2, 2, 1, 2, true, "tp0", "sequential"}, {1, 2, 1, 2, false, "all", "balanced"},
    {1, 2, 2, 1, false, "tp0", "dynamic"},  {2, 2, 1, 1, false, "all", "dynamic"},
    {1, 4, 1, 1, false, "tp0", "dynamic"},  {1, 1, 3, 2, false, "tp0", "balanced"},
};

inline std::string Name(const FieldsCase& c) {
  return "tp" + std::to_string(c.tp) + " cp" + std::to_string(c.cp) + " dp" +
         std::to_string(c.dp) + " pp" + std::to_string(c.pp) + (c.sp ? " sp " : " ") +
         c.data_on + " " + c.scheduler;
}

inline const std::vector<FieldSpec> kSchema = {
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
inline Sample SampleAt(int64_t p) {
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

// The sample at p as the step holds it under --oversize truncate to `longest` tokens (0: whole):
// the plain prefix of its tokens, mask and per-token field rows.
inline Sample ReferenceAt(int64_t p, int64_t longest) {
  Sample x = SampleAt(p);
  if (longest <= 0 || static_cast<int64_t>(x.tokens.size()) <= longest) return x;
  x.tokens.resize(static_cast<size_t>(longest));
  if (!x.target_mask.empty()) x.target_mask.resize(static_cast<size_t>(longest));
  for (size_t f = 0; f < kSchema.size(); ++f) {
    if (kSchema[f].per_token()) {
      x.fields[f].resize(static_cast<size_t>(longest) * kSchema[f].row_bytes());
    }
  }
  return x;
}

inline Job MakeJob(const FieldsCase& c, int64_t global_batch) {
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
  return *ResolveJob(o);
}

inline StepRunnerOptions FedWithFields(const Job& job,
                                       std::function<void(Sample&)> edit = nullptr) {
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
    THDPACK_ASSIGN_OR_RETURN(const FedShares fed, FedShares::Create(n, dp));
    return fed.Share(step, first_position, loader, std::move(mine));
  };
  return o;
}

// One microbatch of one rank against the reference built from the samples it names.
inline Status CheckMicrobatch(const RankStep& step, const LocalMicrobatch& m, size_t index,
                              int64_t longest = 0) {
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
    samples.push_back(ReferenceAt(m.sample_ids[i], longest));
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


// Every rank: `steps` steps of the case's fed source with fields at `depth`, each microbatch
// against the reference, n_loss_sequences against the samples, and every sample of every step
// held by exactly one microbatch (counted over the world).
inline Status RunFieldsCase(ProcessGroup& w, const Job& job, int64_t steps, int depth,
                            int64_t longest = 0) {
  const StepRunnerOptions options = FedWithFields(job);
  const int64_t batch = job.options.global_batch;
  StepSourceOptions so;
  so.depth = depth;
  THDPACK_ASSIGN_OR_RETURN(auto source, StepSource::Create(w, job.topology, options, so));
  std::vector<int64_t> seen(static_cast<size_t>(batch * steps), 0);
  Status local;
  for (int64_t s = 0; s < steps && local.ok(); ++s) {
    THDPACK_ASSIGN_OR_RETURN(RankStep step, source->Next());
    int64_t want_sequences = 0;
    Truncation cut;  // --oversize truncate: what the step must report it cut
    for (int64_t p = s * batch; p < (s + 1) * batch; ++p) {
      const Sample whole = SampleAt(p), kept = ReferenceAt(p, longest);
      want_sequences += NumTargets(kept) > 0 ? 1 : 0;
      if (kept.tokens.size() < whole.tokens.size()) {
        ++cut.samples;
        cut.tokens += static_cast<int64_t>(whole.tokens.size() - kept.tokens.size());
        cut.targets += NumTargets(whole) - NumTargets(kept);
      }
    }
    const bool reads = ReadsShare(step.coord, FedWithFields(job));
    if (reads && (step.truncated.samples != cut.samples || step.truncated.tokens != cut.tokens ||
                  step.truncated.targets != cut.targets)) {
      local = Status::Internal("step " + std::to_string(s) + ": truncated " +
                               std::to_string(step.truncated.samples) + " samples, " +
                               std::to_string(step.truncated.tokens) + " tokens, " +
                               std::to_string(step.truncated.targets) + " targets; want " +
                               std::to_string(cut.samples) + ", " + std::to_string(cut.tokens) +
                               ", " + std::to_string(cut.targets));
    }
    if (step.n_loss_sequences != want_sequences) {
      local = Status::Internal("step " + std::to_string(s) + ": n_loss_sequences " +
                               std::to_string(step.n_loss_sequences) + ", want " +
                               std::to_string(want_sequences));
    }
    for (size_t k = 0; k < step.microbatches.size() && local.ok(); ++k) {
      const LocalMicrobatch& m = step.microbatches[k];
      if (local.ok()) local = CheckMicrobatch(step, m, k, longest);
      if (!m.idle && m.cp_rank == 0 && step.coord.tp == 0 && step.coord.pp == 0) {
        for (int64_t id : m.sample_ids) {
          if (id >= 0 && id < static_cast<int64_t>(seen.size())) ++seen[static_cast<size_t>(id)];
        }
      }
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(w, local, "fields"));
  THDPACK_RETURN_IF_ERROR(w.AllReduceInt64(std::span<int64_t>(seen), ReduceOp::kSum));
  for (size_t id = 0; id < seen.size(); ++id) {
    if (seen[id] != 1) {
      return Status::Internal("sample " + std::to_string(id) + " is in " +
                              std::to_string(seen[id]) + " microbatches");
    }
  }
  return Status::Ok();
}

// A microbatch's values for UnpackStep: a field's packed buffer as [T/CP, *shape] of its dtype,
// or none (shape empty) where the rank holds no buffer of it.
struct UnpackInput {
  std::vector<UnpackMicrobatch> mbs;
  std::vector<std::vector<int64_t>> shapes;  // what mbs' shape spans point into
};
inline UnpackInput UnpackValuesOf(const RankStep& step, size_t f, bool pass) {
  const FieldSpec& spec = kSchema[f];
  UnpackInput in;
  in.shapes.reserve(step.microbatches.size());
  for (const LocalMicrobatch& m : step.microbatches) {
    UnpackMicrobatch u{m.cu_seqlens, m.cu_seqlens_padded, m.cp_size, m.cp_rank, m.idle,
                       m.sample_ids, m.fields[f], spec.dtype, {}};
    std::vector<int64_t> shape;
    if (pass && step.last_stage) {
      shape.push_back(static_cast<int64_t>(m.fields[f].size() / spec.row_bytes()));
      shape.insert(shape.end(), spec.shape.begin(), spec.shape.end());
    } else {
      u.values = {};
    }
    in.shapes.push_back(std::move(shape));
    u.shape = in.shapes.back();
    in.mbs.push_back(u);
  }
  return in;
}

// Every rank: one step, then UnpackStep of the packed values of a scalar float32 and a [L, 3]
// float64 target field; every loader must get its samples' fields back (row 0 the fill) with
// the field's dtype and row shape. With `silent` >= 0 that rank passes no values: where it held
// a microbatch, every rank must get an error (the loaders' naming the missing values). *held:
// set when the silent rank held one.
inline Status RunUnpackCase(ProcessGroup& w, const Job& job, int silent,
                            std::atomic<bool>* held) {
  const StepRunnerOptions options = FedWithFields(job);
  const int64_t batch = job.options.global_batch;
  const int dp = job.topology.dp_size();
  THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, options));
  THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
  THDPACK_ASSIGN_OR_RETURN(Coord me, job.topology.CoordOf(w.rank()));
  std::vector<int64_t> own;
  if (ReadsShare(me, options)) {
    for (int64_t k = 0; k < LoaderCount(batch, dp, me.dp); ++k) {
      own.push_back(static_cast<int64_t>(SampleAt(k * dp + me.dp).tokens.size()));
    }
  }
  // Whether the silent rank holds a microbatch to send, told to every rank.
  std::vector<int64_t> holds = {0};
  if (w.rank() == silent) {
    for (const LocalMicrobatch& m : step.microbatches) holds[0] |= m.idle ? 0 : 1;
  }
  THDPACK_RETURN_IF_ERROR(w.AllReduceInt64(std::span<int64_t>(holds), ReduceOp::kMax));
  if (held != nullptr && holds[0] != 0) *held = true;
  for (size_t f : {size_t{0}, size_t{2}}) {
    const FieldSpec& spec = kSchema[f];
    const UnpackInput in = UnpackValuesOf(step, f, w.rank() != silent);
    UnpackArgs args{0, batch, own, spec.fill};
    Result<UnpackedValues> got = UnpackStep(w, job.topology, options, in.mbs, args);
    if (holds[0] != 0) {
      if (got.ok()) return Status::Internal("unpack without one rank's values succeeded");
      if (got.status().message().find("must pass its values") == std::string::npos &&
          got.status().code() != StatusCode::kAborted) {
        return Status::Internal("unpack without values: " + got.status().ToString());
      }
      return Status::Ok();
    }
    if (!got.ok()) return got.status();
    if (got->dtype != spec.dtype || got->row_shape != spec.shape) {
      return Status::Internal("unpack: the agreed dtype or row shape is not field " + spec.name +
                              "'s");
    }
    if (got->num_samples() != own.size()) return Status::Internal("unpack: sample count");
    const std::vector<std::byte> fill = FillRow(spec);
    for (size_t k = 0; k < own.size(); ++k) {
      std::vector<std::byte> want = SampleAt(static_cast<int64_t>(k) * dp + me.dp).fields[f];
      std::memcpy(want.data(), fill.data(), fill.size());
      const std::span<const std::byte> have = got->Sample(k);
      if (!std::equal(have.begin(), have.end(), want.begin(), want.end())) {
        return Status::Internal("unpack: field " + spec.name + " of loader sample " +
                                std::to_string(k) + " differs");
      }
    }
  }
  return Status::Ok();
}

// How `odd` passes its values in RunUnpackMismatchCase.
enum class OddValues { kDtype, kShape, kWithin };

// Every rank: one step, then UnpackStep of field 2 (float64 [L, 3]) where rank `odd` (of the
// last stage) passes its values as another dtype (the same bytes as int64), another row shape
// ([3 T/CP] float64), or one microbatch of its own of another dtype than its others (kWithin;
// *skipped where it holds fewer than two). Each rank's error message goes to messages[rank].
inline Status RunUnpackMismatchCase(ProcessGroup& w, const Job& job, int odd, OddValues how,
                                    std::vector<std::string>* messages,
                                    std::atomic<bool>* skipped) {
  const StepRunnerOptions options = FedWithFields(job);
  THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, options));
  THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
  THDPACK_ASSIGN_OR_RETURN(Coord me, job.topology.CoordOf(w.rank()));
  std::vector<int64_t> own;
  if (ReadsShare(me, options)) {
    for (int64_t k = 0; k < LoaderCount(job.options.global_batch, job.topology.dp_size(), me.dp);
         ++k) {
      own.push_back(static_cast<int64_t>(SampleAt(k * job.topology.dp_size() + me.dp)
                                             .tokens.size()));
    }
  }
  std::vector<int64_t> two = {w.rank() == odd && step.microbatches.size() >= 2 ? 1 : 0};
  THDPACK_RETURN_IF_ERROR(w.AllReduceInt64(std::span<int64_t>(two), ReduceOp::kMax));
  if (how == OddValues::kWithin && two[0] == 0) {
    *skipped = true;
    return Status::Ok();
  }
  UnpackInput in = UnpackValuesOf(step, 2, true);
  if (w.rank() == odd) {
    for (size_t m = 0; m < in.mbs.size(); ++m) {
      if (how == OddValues::kDtype) in.mbs[m].dtype = FieldDtype::kInt64;
      if (how == OddValues::kWithin && m == 1) in.mbs[m].dtype = FieldDtype::kInt64;
      if (how == OddValues::kShape) {
        std::vector<int64_t>& shape = in.shapes[m];
        shape = {shape[0] * shape[1]};
        in.mbs[m].shape = shape;
      }
    }
  }
  UnpackArgs args{0, job.options.global_batch, own, 0.5};
  Result<UnpackedValues> got = UnpackStep(w, job.topology, options, in.mbs, args);
  if (got.ok()) return Status::Internal("unpack of mismatched values succeeded");
  (*messages)[static_cast<size_t>(w.rank())] = got.status().ToString();
  return Status::Ok();
}

// ---- Groups kept together (StepRunnerOptions::group_field, ScheduleOptions::keep_groups). ----

// The group of the sample at stream position p: pairs (p / 2) or groups of four (p / 4).
// Consecutive positions go to different loaders, so a group spans loaders.
inline int64_t GroupAt(int64_t p, int size) { return 1000 + p / size; }

// Every rank: `steps` steps of the case with the sample field "uid" holding GroupAt and
// keep_groups `keep`; over the world, every sample once and every group where its mode says:
// under "microbatch" (and always under dynamic CP) in one microbatch of one replica or CP group,
// adjacent, in the scheduler's input order (loader 0's samples first, each loader's in its
// order); under "replica" on one replica.
inline Status RunGroupsCase(ProcessGroup& w, const FieldsCase& c, const std::string& keep,
                            int64_t steps, int depth) {
  JobOptions jo = MakeJob(c, 20).options;
  jo.max_tokens_per_rank = 160;  // a pair of two 70-token samples fits a microbatch at CP 1
  jo.keep_groups = keep;
  jo.group_field = "uid";
  Result<Job> job = ResolveJob(jo);
  THDPACK_RETURN_IF_ERROR(job.status());
  const int size = keep == "microbatch" ? 2 : 4;
  const int dp = c.dp;
  StepRunnerOptions options = FedWithFields(*job, [size](Sample& x) {
    const int64_t g = GroupAt(x.id, size);
    std::memcpy(x.fields[5].data(), &g, sizeof g);  // uid: int64, sample kind
  });
  StepSourceOptions so;
  so.depth = depth;
  THDPACK_ASSIGN_OR_RETURN(auto source, StepSource::Create(w, job->topology, options, so));
  THDPACK_ASSIGN_OR_RETURN(Coord me, job->topology.CoordOf(w.rank()));
  const int64_t batch = jo.global_batch;
  // Per id: 1 + the rank holding it (cp 0 of its microbatch), its microbatch, its position.
  std::vector<int64_t> holder(static_cast<size_t>(batch * steps), 0);
  std::vector<int64_t> mb = holder, pos = holder, count = holder;
  for (int64_t s = 0; s < steps; ++s) {
    THDPACK_ASSIGN_OR_RETURN(RankStep step, source->Next());
    if (me.tp != 0 || me.pp != 0) continue;
    for (size_t k = 0; k < step.microbatches.size(); ++k) {
      const LocalMicrobatch& m = step.microbatches[k];
      if (m.idle || m.cp_rank != 0) continue;
      for (size_t i = 0; i < m.sample_ids.size(); ++i) {
        const int64_t id = m.sample_ids[i];
        if (id < 0 || id >= static_cast<int64_t>(holder.size())) {
          return Status::Internal("sample id " + std::to_string(id) + " out of range");
        }
        holder[static_cast<size_t>(id)] = 1 + w.rank();
        mb[static_cast<size_t>(id)] = static_cast<int64_t>(k);
        pos[static_cast<size_t>(id)] = static_cast<int64_t>(i);
        ++count[static_cast<size_t>(id)];
      }
    }
  }
  for (auto* v : {&holder, &mb, &pos, &count}) {
    THDPACK_RETURN_IF_ERROR(w.AllReduceInt64(std::span<int64_t>(*v), ReduceOp::kSum));
  }
  const bool by_microbatch = keep == "microbatch" || std::string(c.scheduler) == "dynamic";
  for (int64_t s = 0; s < steps; ++s) {
    // The step's ids in the scheduler's input order: by loader, then the loader's order.
    std::vector<int64_t> order;
    for (int l = 0; l < dp; ++l) {
      for (int64_t p = s * batch; p < (s + 1) * batch; ++p) {
        if ((p - s * batch) % dp == l) order.push_back(p);
      }
    }
    std::map<int64_t, int64_t> last;  // group -> previous id in input order
    for (int64_t id : order) {
      const size_t i = static_cast<size_t>(id);
      if (count[i] != 1) {
        return Status::Internal("sample " + std::to_string(id) + " is in " +
                                std::to_string(count[i]) + " microbatches");
      }
      const int64_t g = GroupAt(id, size);
      auto it = last.find(g);
      if (it != last.end()) {
        const size_t j = static_cast<size_t>(it->second);
        const std::string ids = "group " + std::to_string(g) + ": ids " +
                                std::to_string(it->second) + " and " + std::to_string(id);
        if (holder[i] != holder[j]) return Status::Internal(ids + " on different ranks");
        if (by_microbatch && (mb[i] != mb[j] || pos[i] != pos[j] + 1)) {
          return Status::Internal(ids + " not adjacent in one microbatch");
        }
      }
      last[g] = id;
    }
  }
  return Status::Ok();
}

}  // namespace testing
}  // namespace thdpack

#endif  // THDPACK_TESTS_FIELDS_CHECKS_H_
