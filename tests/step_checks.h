// Checks of the distributed step that every backend must pass, written once and run on the
// thread backend (src/runtime/step_runner_test.cc) and under mpirun (tests/mpi_check.cc).
//
// The reference is plain and independent of the step's code paths: it reads the whole step
// with SampleSource::Next() in source order, puts loader 0's samples first, schedules them,
// and packs every (replica, microbatch) with the value API Pack; every rank's tensors must equal
// CpShard of that. The cross-rank checks use the group's collectives (themselves checked by
// tests/comm_checks.h): TP ranks of a stage hold identical tensors (hash all-gather); the CP
// shards of the first stage, gathered and unsharded, give back every sample's tokens byte for
// byte; and the samples so recovered, over all replicas, are the step's samples exactly once.
#ifndef THDPACK_TESTS_STEP_CHECKS_H_
#define THDPACK_TESTS_STEP_CHECKS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "thdpack/comm.h"
#include "thdpack/pack.h"
#include "thdpack/shard.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace thdpack::testing {

// The parallel layout a StepRunner on `topo` needs (its CP and TP), with SP and the extra
// alignment of the case.
inline Result<ParallelLayout> TopologyLayout(const Topology& topo, bool sp,
                                             int64_t extra_alignment = 1) {
  return ParallelLayout::Create(topo.cp_size(), topo.tp_size(), sp, extra_alignment);
}

// A file path under the temporary folder, unique to this process and object, removed (if
// created) on destruction.
class ScratchFile {
 public:
  explicit ScratchFile(const std::string& name)
      : path_((std::filesystem::temp_directory_path() /
               (name + "_" + std::to_string(::getpid()) + "_" +
                std::to_string(reinterpret_cast<uintptr_t>(this))))
                  .string()) {}
  ~ScratchFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A JSON-lines file of n samples with lengths in [1, max_len], random tokens in [0, 1000),
// and a loss_mask (zeros on a prompt prefix) on every third sample.
inline void WriteStepTestJsonl(const std::string& path, int n, int max_len, uint32_t seed) {
  std::mt19937 rng(seed);
  std::ofstream out(path, std::ios::trunc);
  for (int i = 0; i < n; ++i) {
    const int len = 1 + static_cast<int>(rng() % static_cast<uint32_t>(max_len));
    out << "{\"input_ids\":[";
    for (int j = 0; j < len; ++j) out << (j ? "," : "") << rng() % 1000;
    out << "]";
    if (i % 3 == 1) {
      const int prompt = static_cast<int>(rng() % static_cast<uint32_t>(len));
      out << ",\"loss_mask\":[";
      for (int j = 0; j < len; ++j) out << (j ? "," : "") << (j >= prompt ? 1 : 0);
      out << "]";
    }
    out << "}\n";
  }
}

struct ReferenceStep {
  int64_t epoch = 0;
  std::map<int64_t, Sample> by_id;
  std::vector<SampleLength> samples;  // scheduling order
  Plan plan;
};

// Step `step` of `options` read the plain way: every sample with Next(), wrapping at the end.
inline Result<ReferenceStep> ReadReferenceStep(const StepRunnerOptions& options,
                                               const Topology& topo, int64_t step) {
  THDPACK_ASSIGN_OR_RETURN(auto src,
                           OpenStepSource(options.data, options.source, options.schedule));
  ReferenceStep ref;
  std::vector<Sample> in_order;
  for (int64_t s = 0; s <= step; ++s) {
    in_order.clear();
    if (options.global_batch == 0) {
      if (s > 0) THDPACK_RETURN_IF_ERROR(src->Reset());
      ref.epoch = src->epoch();
      for (;;) {
        THDPACK_ASSIGN_OR_RETURN(auto x, src->Next());
        if (!x) break;
        in_order.push_back(std::move(*x));
      }
    } else {
      while (static_cast<int64_t>(in_order.size()) < options.global_batch) {
        THDPACK_ASSIGN_OR_RETURN(auto x, src->Next());
        if (!x) {
          THDPACK_RETURN_IF_ERROR(src->Reset());
          continue;
        }
        if (in_order.empty()) ref.epoch = src->epoch();
        in_order.push_back(std::move(*x));
      }
    }
  }
  const int dp = topo.dp_size();
  for (int d = 0; d < dp; ++d) {
    for (size_t i = static_cast<size_t>(d); i < in_order.size(); i += static_cast<size_t>(dp)) {
      const Sample& x = in_order[i];
      ref.samples.push_back(SampleLength{x.id, static_cast<int64_t>(x.tokens.size()), NumTargets(x)});
    }
  }
  for (Sample& x : in_order) ref.by_id.emplace(x.id, std::move(x));
  ScheduleOptions so = options.schedule;
  so.dp_size = dp;
  // From the topology, not from the runner's options: the reference does not trust them.
  THDPACK_ASSIGN_OR_RETURN(so.parallel,
                           TopologyLayout(topo, options.schedule.parallel.sp(),
                                          options.schedule.parallel.extra_alignment()));
  THDPACK_ASSIGN_OR_RETURN(ref.plan, Schedule(ref.samples, so));
  return ref;
}

inline uint64_t Fnv(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

template <typename T>
Status ExpectEq(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  if (got == want) return Status::Ok();
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return Status::Internal(what + ": differs at index " + std::to_string(i) + " (sizes " +
                          std::to_string(got.size()) + " and " + std::to_string(want.size()) + ")");
}

// Checks one rank's RankStep of step `step`. Collective over `world` (every rank calls it).
inline Status VerifyRankStep(ProcessGroup& world, const Topology& topo,
                             const StepRunnerOptions& options, int64_t step, const RankStep& got) {
  const std::string who = "rank " + std::to_string(world.rank()) + " step " + std::to_string(step);
  Status local = [&]() -> Status {
    THDPACK_ASSIGN_OR_RETURN(ReferenceStep ref, ReadReferenceStep(options, topo, step));
    THDPACK_ASSIGN_OR_RETURN(Coord c, topo.CoordOf(world.rank()));
    if (!(got.coord == c) || got.step != step || got.epoch != ref.epoch) {
      return Status::Internal(who + ": coordinates, step or epoch (" + std::to_string(got.epoch) +
                              " vs " + std::to_string(ref.epoch) + ")");
    }
    const bool loader = options.data_on == DataOn::kAll || (c.tp == 0 && c.cp == 0 && c.pp == 0);
    if (got.is_loader != loader || got.first_stage != (c.pp == 0) ||
        got.last_stage != (c.pp == topo.pp_size() - 1)) {
      return Status::Internal(who + ": role flags");
    }
    if (loader) {
      // The step as `thdpack plan` reads it (StepReader) has the same samples, order and epoch.
      THDPACK_ASSIGN_OR_RETURN(auto src,
                           OpenStepSource(options.data, options.source, options.schedule));
      THDPACK_ASSIGN_OR_RETURN(auto reader,
                               StepReader::Create(src.get(), options.global_batch, topo.dp_size()));
      StepSamples planned;
      for (int64_t s = 0; s <= step; ++s) {
        THDPACK_ASSIGN_OR_RETURN(planned, reader.Next());
      }
      if (planned.epoch != got.epoch || planned.samples.size() != got.samples.size()) {
        return Status::Internal(who + ": epoch or sample count differs from StepReader's");
      }
      for (size_t i = 0; i < planned.samples.size(); ++i) {
        if (planned.samples[i].id != got.samples[i].id ||
            planned.samples[i].length != got.samples[i].length ||
            planned.samples[i].n_targets != got.samples[i].n_targets) {
          return Status::Internal(who + ": sample " + std::to_string(i) + " differs from StepReader's");
        }
      }
      if (got.samples.size() != ref.samples.size()) return Status::Internal(who + ": sample count");
      for (size_t i = 0; i < ref.samples.size(); ++i) {
        const auto& a = got.samples[i];
        const auto& b = ref.samples[i];
        if (a.id != b.id || a.length != b.length || a.n_targets != b.n_targets) {
          return Status::Internal(who + ": scheduling-order sample " + std::to_string(i));
        }
      }
      if (got.plan.num_microbatches != ref.plan.num_microbatches ||
          got.plan.sample_ids != ref.plan.sample_ids || got.plan.offsets != ref.plan.offsets ||
          got.plan.skipped != ref.plan.skipped) {
        return Status::Internal(who + ": plan differs from the reference plan");
      }
    }
    const StepMeta& meta = got.meta;
    const int M = ref.plan.num_microbatches;
    if (static_cast<int>(meta.microbatches.size()) != M ||
        static_cast<int>(got.microbatches.size()) != M) {
      return Status::Internal(who + ": microbatch count");
    }
    int64_t n_loss = 0;
    for (int d = 0; d < topo.dp_size(); ++d) {
      for (int m = 0; m < M; ++m) {
        for (int64_t id : ref.plan.Microbatch(d, m)) n_loss += NumTargets(ref.by_id.at(id));
      }
    }
    if (meta.n_loss_tokens != n_loss || meta.replica != c.dp || meta.dp_size != topo.dp_size() ||
        meta.step != static_cast<uint64_t>(step) || meta.epoch != static_cast<uint64_t>(ref.epoch) ||
        meta.skipped_ids != ref.plan.skipped) {
      return Status::Internal(who + ": step metadata totals");
    }
    PackOptions po;
    THDPACK_ASSIGN_OR_RETURN(po.parallel,
                             TopologyLayout(topo, options.schedule.parallel.sp(),
                                            options.schedule.parallel.extra_alignment()));
    po.pad_id = options.pad_id;
    po.fixed_tokens = FixedMicrobatchTokens(options.schedule);
    if (meta.parallel != po.parallel) {
      return Status::Internal(who + ": step metadata layout " + meta.parallel.ToString() +
                              ", expected " + po.parallel.ToString());
    }
    int64_t real = 0, padded = 0;
    for (int m = 0; m < M; ++m) {
      const std::string mb = who + " microbatch " + std::to_string(m);
      std::vector<SampleView> views;
      for (int64_t id : ref.plan.Microbatch(c.dp, m)) views.emplace_back(ref.by_id.at(id));
      THDPACK_ASSIGN_OR_RETURN(PackedMicrobatch pm, Pack(views, po));
      const MicrobatchMeta& mm = meta.microbatches[static_cast<size_t>(m)];
      const LocalMicrobatch& lm = got.microbatches[static_cast<size_t>(m)];
      THDPACK_RETURN_IF_ERROR(ExpectEq(mm.cu_seqlens, pm.cu_seqlens, mb + " meta cu_seqlens"));
      THDPACK_RETURN_IF_ERROR(ExpectEq(mm.cu_seqlens_padded, pm.cu_seqlens_padded, mb + " meta cu_seqlens_padded"));
      THDPACK_RETURN_IF_ERROR(ExpectEq(lm.cu_seqlens, pm.cu_seqlens, mb + " cu_seqlens"));
      THDPACK_RETURN_IF_ERROR(ExpectEq(lm.cu_seqlens_padded, pm.cu_seqlens_padded, mb + " cu_seqlens_padded"));
      const int64_t T = static_cast<int64_t>(pm.tokens.size());
      // Static shapes, checked from the options alone: T is CP * max_tokens_per_rank, and at
      // most S sequences.
      const int64_t max_seqs = options.schedule.max_seqs_per_microbatch;
      if ((options.schedule.pad_to_max_tokens &&
           T != topo.cp_size() * options.schedule.max_tokens_per_rank) ||
          (max_seqs > 0 && static_cast<int64_t>(lm.cu_seqlens.size()) > max_seqs + 1)) {
        return Status::Internal(mb + ": T " + std::to_string(T) + " or " +
                                std::to_string(lm.cu_seqlens.size() - 1) +
                                " sequences break the static shape");
      }
      if (mm.max_seqlen != pm.max_seqlen || lm.max_seqlen != pm.max_seqlen ||
          mm.n_valid != pm.n_valid || lm.n_valid != pm.n_valid || lm.total_tokens != T ||
          lm.local_tokens != T / topo.cp_size()) {
        return Status::Internal(mb + ": max_seqlen, n_valid or sizes");
      }
      real += pm.cu_seqlens.back();
      padded += T;
      const auto& cup = pm.cu_seqlens_padded;
      const int cp = topo.cp_size();
      if (c.pp == 0) {
        THDPACK_ASSIGN_OR_RETURN(auto t, CpShard<TokenId>(pm.tokens, cup, cp, c.cp));
        THDPACK_ASSIGN_OR_RETURN(auto p, CpShard<int32_t>(pm.position_ids, cup, cp, c.cp));
        THDPACK_ASSIGN_OR_RETURN(auto derived, LocalPositionIds(lm.cu_seqlens_padded, cp, c.cp));
        THDPACK_RETURN_IF_ERROR(ExpectEq(lm.tokens, t, mb + " tokens"));
        THDPACK_RETURN_IF_ERROR(ExpectEq(lm.position_ids, p, mb + " position_ids"));
        THDPACK_RETURN_IF_ERROR(ExpectEq(derived, p, mb + " position ids derived from metadata"));
      } else if (!lm.tokens.empty() || !lm.position_ids.empty()) {
        return Status::Internal(mb + ": a later stage holds tokens");
      }
      if (c.pp == topo.pp_size() - 1) {
        THDPACK_ASSIGN_OR_RETURN(auto l, CpShard<TokenId>(pm.labels, cup, cp, c.cp));
        THDPACK_ASSIGN_OR_RETURN(auto k, CpShard<uint8_t>(pm.loss_mask, cup, cp, c.cp));
        THDPACK_RETURN_IF_ERROR(ExpectEq(lm.labels, l, mb + " labels"));
        THDPACK_RETURN_IF_ERROR(ExpectEq(lm.loss_mask, k, mb + " loss_mask"));
      } else if (!lm.labels.empty() || !lm.loss_mask.empty()) {
        return Status::Internal(mb + ": an earlier stage holds labels");
      }
      std::pair<int64_t, int64_t> sp{0, T / cp};
      if (options.schedule.parallel.sp()) {
        THDPACK_ASSIGN_OR_RETURN(sp, SpRange(T / cp, topo.tp_size(), c.tp));
      }
      if (lm.sp_range != sp) return Status::Internal(mb + ": sp_range");
    }
    if (meta.real_tokens != real || meta.padded_tokens != padded) {
      return Status::Internal(who + ": replica token sums");
    }
    return Status::Ok();
  }();
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "reference comparison"));

  // TP ranks of a stage hold identical tensors and metadata.
  auto c = *topo.CoordOf(world.rank());
  uint64_t h = 1469598103934665603ull;
  for (const LocalMicrobatch& lm : got.microbatches) {
    h = Fnv(h, lm.cu_seqlens.data(), lm.cu_seqlens.size() * 4);
    h = Fnv(h, lm.cu_seqlens_padded.data(), lm.cu_seqlens_padded.size() * 4);
    h = Fnv(h, lm.tokens.data(), lm.tokens.size() * sizeof(TokenId));
    h = Fnv(h, lm.position_ids.data(), lm.position_ids.size() * 4);
    h = Fnv(h, lm.labels.data(), lm.labels.size() * sizeof(TokenId));
    h = Fnv(h, lm.loss_mask.data(), lm.loss_mask.size());
    h = Fnv(h, &lm.n_valid, 8);
  }
  THDPACK_ASSIGN_OR_RETURN(auto tp_group, world.Split(topo.AllGroups(GroupKind::kTp)));
  std::vector<int64_t> hashes(static_cast<size_t>(tp_group->size()));
  const int64_t mine = static_cast<int64_t>(h);
  THDPACK_RETURN_IF_ERROR(tp_group->AllGatherValues(std::span<const int64_t>(&mine, 1),
                                                    std::span<int64_t>(hashes)));
  local = Status::Ok();
  for (int64_t x : hashes) {
    if (x != mine) local = Status::Internal(who + ": TP ranks of this stage hold different tensors");
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "TP identity"));

  // First stage: gather the CP shards, unshard, and recover every sample byte for byte.
  THDPACK_ASSIGN_OR_RETURN(auto cp_group, world.Split(topo.AllGroups(GroupKind::kCp)));
  std::vector<int64_t> recovered;  // ids, at (tp=0, cp=0, pp=0) only
  local = Status::Ok();
  if (c.pp == 0) {
    auto ref = ReadReferenceStep(options, topo, step);
    if (!ref.ok()) local = ref.status();
    const bool ref_ok = local.ok();
    for (size_t m = 0; ref_ok && m < got.microbatches.size(); ++m) {
      const LocalMicrobatch& lm = got.microbatches[m];
      std::vector<TokenId> all(static_cast<size_t>(lm.total_tokens));
      // Collective: every CP member takes part even if its own data looked wrong.
      Status s = cp_group->AllGatherValues(std::span<const TokenId>(lm.tokens), std::span<TokenId>(all));
      if (!s.ok()) return s;
      if (!local.ok()) continue;  // keep taking part in the gathers of later microbatches
      std::vector<std::vector<TokenId>> shards;
      const size_t L = static_cast<size_t>(lm.local_tokens);
      for (int r = 0; r < topo.cp_size(); ++r) {
        shards.emplace_back(all.begin() + static_cast<ptrdiff_t>(r * L), all.begin() + static_cast<ptrdiff_t>((r + 1) * L));
      }
      auto full = CpUnshard(shards, lm.cu_seqlens_padded, topo.cp_size());
      if (!full.ok()) {
        local = full.status();
        continue;
      }
      auto ids = ref->plan.Microbatch(c.dp, static_cast<int>(m));
      for (size_t i = 0; i + 1 < lm.cu_seqlens.size(); ++i) {
        const Sample& x = ref->by_id.at(ids[i]);
        const int32_t start = lm.cu_seqlens_padded[i];
        const int32_t L_i = lm.cu_seqlens[i + 1] - lm.cu_seqlens[i];
        if (L_i != static_cast<int32_t>(x.tokens.size()) ||
            std::memcmp(full->data() + start, x.tokens.data(), x.tokens.size() * sizeof(TokenId)) != 0) {
          local = Status::Internal(who + ": sample " + std::to_string(x.id) +
                                   " does not come back byte for byte after unsharding");
          break;
        }
        for (int32_t k = start + L_i; k < lm.cu_seqlens_padded[i + 1]; ++k) {
          if ((*full)[static_cast<size_t>(k)] != options.pad_id) local = Status::Internal(who + ": padding");
        }
        if (c.tp == 0 && c.cp == 0) recovered.push_back(x.id);
      }
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "unshard"));

  // Over all replicas the recovered samples are the step's samples, each exactly once.
  std::vector<int64_t> counts(static_cast<size_t>(world.size()));
  const int64_t n_mine = static_cast<int64_t>(recovered.size());
  THDPACK_RETURN_IF_ERROR(world.AllGatherValues(std::span<const int64_t>(&n_mine, 1), std::span<int64_t>(counts)));
  std::vector<int64_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  std::vector<int64_t> all_ids(static_cast<size_t>(displs.back() + counts.back()));
  THDPACK_RETURN_IF_ERROR(world.AllGatherVValues(std::span<const int64_t>(recovered),
                                                 std::span<int64_t>(all_ids), counts, displs));
  auto ref = ReadReferenceStep(options, topo, step);
  local = ref.status();
  if (local.ok()) {
    std::vector<int64_t> expect;
    for (const auto& [id, x] : ref->by_id) {
      if (std::find(ref->plan.skipped.begin(), ref->plan.skipped.end(), id) == ref->plan.skipped.end()) {
        expect.push_back(id);
      }
    }
    std::sort(all_ids.begin(), all_ids.end());
    if (all_ids != expect) {
      local = Status::Internal(who + ": the samples recovered over all replicas are not the step's "
                               "samples exactly once (" + std::to_string(all_ids.size()) + " vs " +
                               std::to_string(expect.size()) + ")");
    }
  }
  return AgreeOnStatus(world, local, "exactly once");
}

struct StepCase {
  int tp, cp, dp, pp;
  bool sp;
  DataOn data_on;
};

// The topologies of the issue, each with and without SP and in both data-on modes.
inline std::vector<StepCase> AllStepCases() {
  const int topos[8][4] = {{1, 1, 8, 1}, {2, 1, 4, 1}, {1, 2, 4, 1}, {2, 2, 2, 1},
                           {1, 1, 2, 4}, {2, 1, 1, 4}, {2, 2, 1, 2}, {1, 2, 2, 2}};
  std::vector<StepCase> out;
  for (const auto& t : topos) {
    for (bool sp : {false, true}) {
      for (DataOn d : {DataOn::kTp0, DataOn::kAll}) out.push_back({t[0], t[1], t[2], t[3], sp, d});
    }
  }
  return out;
}

inline std::string CaseName(const StepCase& k) {
  return "tp" + std::to_string(k.tp) + "_cp" + std::to_string(k.cp) + "_dp" +
         std::to_string(k.dp) + "_pp" + std::to_string(k.pp) + (k.sp ? "_sp" : "") + "_" +
         std::string(DataOnName(k.data_on));
}

// Runs `steps` steps of one case on `world` and verifies each. Collective.
// `data` is a jsonl file path, or any source spec containing ':'.
// `adjust`, when given, changes the options before the runner is made (static shapes).
inline Status RunAndVerifyCase(ProcessGroup& world, const StepCase& k, const std::string& data,
                               int64_t global_batch, int steps,
                               ScheduleOptions::OversizePolicy oversize =
                                   ScheduleOptions::OversizePolicy::kError,
                               const std::function<void(StepRunnerOptions&)>& adjust = {}) {
  THDPACK_ASSIGN_OR_RETURN(Topology topo, Topology::Create(k.tp, k.cp, k.dp, k.pp));
  StepRunnerOptions o;
  o.data = data.find(':') == std::string::npos ? "jsonl:" + data : data;
  o.schedule.oversize = oversize;
  o.global_batch = global_batch;
  o.schedule.max_tokens_per_rank = 256;
  THDPACK_ASSIGN_OR_RETURN(o.schedule.parallel, TopologyLayout(topo, k.sp));
  o.schedule.dp_size = k.dp;  // the topology's
  o.data_on = k.data_on;
  o.check_plan_hash = true;
  o.pad_id = 7;
  if (adjust) adjust(o);
  THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, topo, o));
  for (int s = 0; s < steps; ++s) {
    THDPACK_ASSIGN_OR_RETURN(RankStep got, runner->Next());
    THDPACK_RETURN_IF_ERROR(VerifyRankStep(world, topo, o, s, got).WithContext(CaseName(k)));
  }
  return Status::Ok();
}

}  // namespace thdpack::testing

#endif  // THDPACK_TESTS_STEP_CHECKS_H_
