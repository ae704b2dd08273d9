// The distributed probe forward of thdpack/probe.h: pipeline stages, CP attention over
// all-gathered K/V masked by global position, the SP split, the vocab-parallel loss and the
// topology-invariant statistics.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "probe/probe_attention.h"
#include "probe/probe_internal.h"
#include "thdpack/probe.h"
#include "thdpack/schedule.h"
#include "thdpack/shard.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

constexpr int kTagActivations = 11;

// What this rank adds to the step's statistics (summed over the world at the end).
struct Accum {
  int64_t n_tokens = 0;    // real tokens of the shards (tp = 0, last stage)
  int64_t n_counted = 0;   // counted loss tokens (tp = 0, last stage)
  int64_t n_ppl = 0;       // sequences with >= 1 loss token (tp = 0, cp = 0, last stage)
  double loss_sum = 0;
  double entropy_sum = 0;
  double ppl_sum = 0;      // sum of exp(-logprob_sum / n) over those sequences
};

std::string MbName(size_t m) { return "microbatch " + std::to_string(m); }

}  // namespace

class ProbeRunner::Impl {
 public:
  Impl(ProcessGroup& world, const Topology& topology, const ProbeModel& model, bool sp)
      : world_(world), topo_(topology), model_(model), sp_(sp && topology.tp_size() > 1) {}

  Status Init() {
    Status local = Status::Ok();
    if (world_.size() != topo_.world_size()) {
      local = Status::InvalidArgument("ProbeRunner: the world has " +
                                      std::to_string(world_.size()) + " ranks, the topology " +
                                      topo_.ToString() + " needs " +
                                      std::to_string(topo_.world_size()));
    } else if (model_.config().vocab_size < topo_.tp_size()) {
      local = Status::InvalidArgument("ProbeRunner: vocab_size = " +
                                      std::to_string(model_.config().vocab_size) +
                                      " must be >= TP = " + std::to_string(topo_.tp_size()) +
                                      " (every TP rank holds vocabulary columns)");
    }
    THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "probe setup"));
    THDPACK_ASSIGN_OR_RETURN(coord_, topo_.CoordOf(world_.rank()));
    THDPACK_ASSIGN_OR_RETURN(tp_, world_.Split(topo_.AllGroups(GroupKind::kTp)));
    THDPACK_ASSIGN_OR_RETURN(cp_, world_.Split(topo_.AllGroups(GroupKind::kCp)));
    THDPACK_ASSIGN_OR_RETURN(pp_, world_.Split(topo_.AllGroups(GroupKind::kPp)));
    return Status::Ok();
  }

  Result<LossSummary> Forward(const RankStep& step) {
    THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, Check(step), "probe input"));
    const int pp_size = topo_.pp_size();
    Accum acc;
    std::vector<double> x;
    for (size_t m = 0; m < step.microbatches.size(); ++m) {
      for (int s = 0; s < pp_size; ++s) {
        // An idle microbatch (dynamic scheduler: this domain index is in no group) is idle on
        // every stage of the domain index: nothing computed, nothing sent.
        const bool idle = step.microbatches[m].idle;
        Status local = Status::Ok();
        if (coord_.pp == s && !idle) local = StageForward(step.microbatches[m], m, x, &acc);
        THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "probe forward"));
        if (coord_.pp == s && s + 1 < pp_size && !idle) {
          THDPACK_RETURN_IF_ERROR(
              pp_->SendValues(std::span<const double>(x), s + 1, kTagActivations));
        }
      }
    }
    return Reduce(step, acc);
  }

 private:
  // Every size the forward relies on, before any collective (so a bad input fails on its own
  // rank and is agreed, instead of leaving peers waiting inside a stage).
  Status Check(const RankStep& step) const {
    const std::string f = "probe: rank " + std::to_string(world_.rank()) + ": ";
    if (step.microbatches.size() != step.meta.microbatches.size() || step.microbatches.empty()) {
      return Status::InvalidArgument(f + "the step holds " +
                                     std::to_string(step.microbatches.size()) +
                                     " microbatches, its metadata " +
                                     std::to_string(step.meta.microbatches.size()));
    }
    const bool first = coord_.pp == 0, last = coord_.pp == topo_.pp_size() - 1;
    for (size_t m = 0; m < step.microbatches.size(); ++m) {
      const LocalMicrobatch& mb = step.microbatches[m];
      const std::string where = f + MbName(m) + ": ";
      if (mb.idle) {
        if (mb.cu_seqlens_padded.size() != 1 || !mb.tokens.empty() || !mb.labels.empty()) {
          return Status::InvalidArgument(where + "an idle microbatch holds sequences or tokens");
        }
        continue;
      }
      // The microbatch's CP group: the topology's, or (dynamic) its own.
      const int cp = mb.cp_size;
      const bool own_group = mb.cp_group != nullptr;
      if (cp < 1 || mb.cp_rank < 0 || mb.cp_rank >= cp ||
          (own_group ? mb.cp_group->size() != cp || mb.cp_group->rank() != mb.cp_rank
                     : cp != topo_.cp_size() || mb.cp_rank != coord_.cp)) {
        return Status::InvalidArgument(where + "CP group of " + std::to_string(cp) +
                                       " ranks, position " + std::to_string(mb.cp_rank) +
                                       ", does not match its process group");
      }
      if (Status st = ValidateCuSeqlensPadded(mb.cu_seqlens_padded, cp); !st.ok()) {
        return st.WithContext(where + "cu_seqlens_padded");
      }
      const int64_t local = mb.cu_seqlens_padded.back() / cp;
      if (mb.local_tokens != local || mb.cu_seqlens.size() != mb.cu_seqlens_padded.size()) {
        return Status::InvalidArgument(where + "local_tokens = " +
                                       std::to_string(mb.local_tokens) + " and " +
                                       std::to_string(mb.cu_seqlens.size()) +
                                       " cu_seqlens entries do not match cu_seqlens_padded (T/CP = " +
                                       std::to_string(local) + ")");
      }
      const auto [off, rows] = mb.sp_range;
      const int64_t want_rows = sp_ ? local / topo_.tp_size() : local;
      const int64_t want_off = sp_ ? want_rows * coord_.tp : 0;
      if (off != want_off || rows != want_rows) {
        return Status::InvalidArgument(where + "sp_range (" + std::to_string(off) + ", " +
                                       std::to_string(rows) + ") should be (" +
                                       std::to_string(want_off) + ", " +
                                       std::to_string(want_rows) + ")");
      }
      if (first) {
        if (static_cast<int64_t>(mb.tokens.size()) != local ||
            static_cast<int64_t>(mb.position_ids.size()) != local) {
          return Status::InvalidArgument(where + "the first stage needs T/CP = " +
                                         std::to_string(local) + " tokens and position ids, has " +
                                         std::to_string(mb.tokens.size()) + " and " +
                                         std::to_string(mb.position_ids.size()));
        }
        THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> pos,
                                 LocalPositionIds(mb.cu_seqlens_padded, cp, mb.cp_rank));
        if (pos != mb.position_ids) {
          return Status::Internal(where +
                                  "the delivered position ids differ from those derived from "
                                  "the metadata (LocalPositionIds)");
        }
      }
      if (last && (static_cast<int64_t>(mb.labels.size()) != local ||
                   static_cast<int64_t>(mb.loss_mask.size()) != local)) {
        return Status::InvalidArgument(where + "the last stage needs T/CP = " +
                                       std::to_string(local) + " labels and mask values, has " +
                                       std::to_string(mb.labels.size()) + " and " +
                                       std::to_string(mb.loss_mask.size()));
      }
    }
    return Status::Ok();
  }

  // This stage's part of microbatch m: receive (or embed), run its layers, and on the last
  // stage the loss. x holds this rank's activation rows [rows, H] on return.
  Status StageForward(const LocalMicrobatch& mb, size_t m, std::vector<double>& x, Accum* acc) {
    const ProbeConfig& c = model_.config();
    const int cp = mb.cp_size;
    ProcessGroup& cp_group = mb.cp_group ? *mb.cp_group : *cp_;
    const size_t h = static_cast<size_t>(c.hidden);
    const int64_t total = mb.cu_seqlens_padded.back();
    const int64_t local = total / cp;
    const auto [off, rows] = mb.sp_range;
    THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> positions,
                             LocalPositionIds(mb.cu_seqlens_padded, cp, mb.cp_rank));
    x.assign(static_cast<size_t>(rows) * h, 0.0);
    if (coord_.pp == 0) {
      model_.Embed(std::span<const TokenId>(mb.tokens).subspan(static_cast<size_t>(off),
                                                               static_cast<size_t>(rows)),
                   x);
    } else {
      THDPACK_RETURN_IF_ERROR(
          pp_->RecvValues(std::span<double>(x), coord_.pp - 1, kTagActivations));
    }
    const auto [first_layer, end_layer] = model_.StageLayers(coord_.pp, topo_.pp_size());
    if (first_layer < end_layer) {
      // Global index of every CP rank's local tokens (the zigzag), from the metadata.
      std::vector<std::vector<int32_t>> indices(static_cast<size_t>(cp));
      for (int r = 0; r < cp; ++r) {
        THDPACK_ASSIGN_OR_RETURN(indices[static_cast<size_t>(r)],
                                 CpPartitionIndices(mb.cu_seqlens_padded, cp, r));
      }
      const std::vector<int32_t>& mine = indices[static_cast<size_t>(mb.cp_rank)];
      const size_t n_rows = static_cast<size_t>(rows);
      std::vector<double> q(n_rows * h), k(n_rows * h), v(n_rows * h), attn(n_rows * h);
      std::vector<double> k_local, v_local;              // [T/CP, H]
      std::vector<double> k_cp, v_cp;                    // [CP * T/CP, H], rank order
      std::vector<double> k_glob(static_cast<size_t>(total) * h), v_glob(k_glob.size());
      std::vector<double> scores;
      probe_internal::HeadMajorKv kv;
      // Without SP every TP rank holds the same rows: the ranks split the heads, as tensor
      // parallelism does, and gather the attention output over TP.
      const int tp = topo_.tp_size();
      const bool split_heads = !sp_ && tp > 1 && c.heads % tp == 0;
      const int head_begin = split_heads ? c.heads / tp * coord_.tp : 0;
      const int head_end = split_heads ? c.heads / tp * (coord_.tp + 1) : c.heads;
      const std::span<const int32_t> my_pos =
          std::span<const int32_t>(positions).subspan(static_cast<size_t>(off), n_rows);
      for (int layer = first_layer; layer < end_layer; ++layer) {
        model_.Qkv(layer, x, my_pos, q, k, v);
        // SP: the TP parts of the CP-local K and V, in TP order = local order.
        if (sp_) {
          k_local.resize(static_cast<size_t>(local) * h);
          v_local.resize(k_local.size());
          THDPACK_RETURN_IF_ERROR(tp_->AllGatherValues(std::span<const double>(k),
                                                       std::span<double>(k_local)));
          THDPACK_RETURN_IF_ERROR(tp_->AllGatherValues(std::span<const double>(v),
                                                       std::span<double>(v_local)));
        } else {
          k_local = k;
          v_local = v;
        }
        // CP: every rank's shard, then each row to its global index.
        k_cp.resize(static_cast<size_t>(total) * h);
        v_cp.resize(k_cp.size());
        THDPACK_RETURN_IF_ERROR(cp_group.AllGatherValues(std::span<const double>(k_local),
                                                         std::span<double>(k_cp)));
        THDPACK_RETURN_IF_ERROR(cp_group.AllGatherValues(std::span<const double>(v_local),
                                                         std::span<double>(v_cp)));
        for (int r = 0; r < cp; ++r) {
          const std::vector<int32_t>& idx = indices[static_cast<size_t>(r)];
          for (size_t j = 0; j < idx.size(); ++j) {
            const size_t src = (static_cast<size_t>(r) * idx.size() + j) * h;
            const size_t dst = static_cast<size_t>(idx[j]) * h;
            std::copy_n(k_cp.begin() + static_cast<ptrdiff_t>(src), h,
                        k_glob.begin() + static_cast<ptrdiff_t>(dst));
            std::copy_n(v_cp.begin() + static_cast<ptrdiff_t>(src), h,
                        v_glob.begin() + static_cast<ptrdiff_t>(dst));
          }
        }
        // A query at global index g and position p of its sequence sees global indices
        // [g - p, g]: positions 0..p of the same sequence.
        kv.Assign(k_glob.data(), v_glob.data(), total, c.heads, model_.head_dim());
        // Two consecutive local rows of one sequence (the next position: a zigzag chunk's
        // rows are consecutive) share their keys' loads.
        for (size_t i = 0; i < n_rows;) {
          const size_t kidx = static_cast<size_t>(off) + i;
          const int64_t g = mine[kidx];
          const int64_t p = positions[kidx];
          if (i + 1 < n_rows && mine[kidx + 1] == g + 1 && positions[kidx + 1] == p + 1) {
            probe_internal::AttendTwoRowsFast(&q[i * h], &q[(i + 1) * h], kv, g - p, p + 1,
                                              p + 2, &attn[i * h], &attn[(i + 1) * h], scores,
                                              head_begin, head_end);
            i += 2;
          } else {
            probe_internal::AttendRowFast(&q[i * h], kv, g - p, p + 1, &attn[i * h], scores,
                                          head_begin, head_end);
            ++i;
          }
        }
        if (split_heads) {
          THDPACK_RETURN_IF_ERROR(GatherHeads(attn, n_rows, head_begin, head_end));
        }
        model_.AttnOutAndMlp(layer, attn, x);
      }
    }
    if (coord_.pp == topo_.pp_size() - 1) return Loss(mb, m, x, acc);
    return Status::Ok();
  }

  // The attention output of every head on every TP rank, from each rank's heads
  // [head_begin, head_end) (the same count on each): one all-gather over TP of the rows' columns.
  Status GatherHeads(std::vector<double>& attn, size_t rows, int head_begin, int head_end) {
    const size_t h = static_cast<size_t>(model_.config().hidden);
    const size_t d = static_cast<size_t>(model_.head_dim());
    const size_t cols = static_cast<size_t>(head_end - head_begin) * d;
    const size_t tp = static_cast<size_t>(topo_.tp_size());
    std::vector<double> mine(rows * cols), all(rows * cols * tp);
    for (size_t r = 0; r < rows; ++r) {
      std::copy_n(&attn[r * h + static_cast<size_t>(head_begin) * d], cols, &mine[r * cols]);
    }
    THDPACK_RETURN_IF_ERROR(
        tp_->AllGatherValues(std::span<const double>(mine), std::span<double>(all)));
    for (size_t t = 0; t < tp; ++t) {
      for (size_t r = 0; r < rows; ++r) {
        std::copy_n(&all[(t * rows + r) * cols], cols, &attn[r * h + t * cols]);
      }
    }
    return Status::Ok();
  }

  Status Loss(const LocalMicrobatch& mb, size_t m, const std::vector<double>& x, Accum* acc) {
    const ProbeConfig& c = model_.config();
    const int cp = mb.cp_size, tp = topo_.tp_size();
    ProcessGroup& cp_group = mb.cp_group ? *mb.cp_group : *cp_;
    const int64_t local = mb.cu_seqlens_padded.back() / cp;
    std::vector<double> full;
    if (sp_) {
      full.resize(static_cast<size_t>(local) * static_cast<size_t>(c.hidden));
      THDPACK_RETURN_IF_ERROR(
          tp_->AllGatherValues(std::span<const double>(x), std::span<double>(full)));
    }
    const std::vector<double>& rows = sp_ ? full : x;
    // Vocab-parallel output layer: TP rank t holds columns [t*V/TP, (t+1)*V/TP).
    const int64_t col_begin = c.vocab_size * coord_.tp / tp;
    const int64_t col_end = c.vocab_size * (coord_.tp + 1) / tp;
    std::vector<double> logits(static_cast<size_t>(local * (col_end - col_begin)));
    model_.Logits(rows, col_begin, col_end, logits);
    std::vector<int32_t> labels(mb.labels.size());
    for (size_t j = 0; j < labels.size(); ++j) {
      labels[j] = probe_internal::ProbeLabel(mb.labels[j], c.vocab_size);
    }
    LogitsView view{LogitsDtype::kFloat64, std::as_bytes(std::span<const double>(logits)), local,
                    col_end - col_begin};
    TokenTargets targets;
    targets.labels_i32 = labels;
    targets.mask_u8 = mb.loss_mask;
    CrossEntropyOptions options;
    options.num_threads = 1;  // ranks already run on their own threads
    CrossEntropyResult result;
    if (tp == 1) {
      THDPACK_ASSIGN_OR_RETURN(result, CrossEntropy(view, targets, options));
    } else {
      options.vocab_start = col_begin;
      options.vocab_total = c.vocab_size;
      THDPACK_ASSIGN_OR_RETURN(std::vector<VocabPartial> partial,
                               VocabParallelPartials(view, targets, options));
      std::vector<VocabPartial> all(partial.size() * static_cast<size_t>(tp));
      THDPACK_RETURN_IF_ERROR(tp_->AllGatherValues(std::span<const VocabPartial>(partial),
                                                   std::span<VocabPartial>(all)));
      std::vector<std::span<const VocabPartial>> by_rank;
      for (int r = 0; r < tp; ++r) {
        by_rank.push_back(std::span<const VocabPartial>(all).subspan(
            static_cast<size_t>(r) * partial.size(), partial.size()));
      }
      THDPACK_ASSIGN_OR_RETURN(VocabParallelCombined combined,
                               CombineVocabPartials(by_rank, targets));
      result = std::move(combined.result);
    }
    LossStats stats;
    THDPACK_RETURN_IF_ERROR(AccumulateShardLoss(result, mb.cu_seqlens, mb.cu_seqlens_padded, cp,
                                                mb.cp_rank, {}, &stats)
                                .WithContext("probe: " + MbName(m)));
    // Per-sequence sums over the CP group: no rank holds a whole sequence.
    const size_t n = mb.cu_seqlens.size() - 1;
    std::vector<double> logprob(n, 0.0);
    std::vector<int64_t> count(n, 0);
    for (const auto& [key, seq] : stats.sequences) {
      logprob[static_cast<size_t>(key)] = seq.logprob_sum;
      count[static_cast<size_t>(key)] = seq.n_loss_tokens;
    }
    THDPACK_RETURN_IF_ERROR(cp_group.AllReduceFloat64(logprob, ReduceOp::kSum));
    THDPACK_RETURN_IF_ERROR(cp_group.AllReduceInt64(count, ReduceOp::kSum));
    if (coord_.tp != 0) return Status::Ok();  // TP ranks hold identical copies: count once
    acc->n_tokens += stats.n_tokens;
    acc->n_counted += stats.n_loss_tokens;
    acc->loss_sum += stats.loss_sum;
    acc->entropy_sum += stats.entropy_sum;
    if (mb.cp_rank == 0) {
      for (size_t i = 0; i < n; ++i) {
        if (count[i] == 0) continue;
        acc->ppl_sum += std::exp(-logprob[i] / static_cast<double>(count[i]));
        ++acc->n_ppl;
      }
    }
    return Status::Ok();
  }

  // The step's figures from every rank's share; the same on every rank.
  Result<LossSummary> Reduce(const RankStep& step, const Accum& acc) {
    // One loader-side copy of each replica's real-token count: (tp, cp, pp) = 0.
    // Dynamic: one copy of each group's real tokens, at its first rank's (tp, pp) = 0.
    const bool replica_root = coord_.tp == 0 && coord_.cp == 0 && coord_.pp == 0;
    int64_t real = replica_root ? step.meta.real_tokens : 0;
    if (step.dynamic) {
      real = 0;
      if (coord_.tp == 0 && coord_.pp == 0) {
        for (const LocalMicrobatch& mb : step.microbatches) {
          if (!mb.idle && mb.cp_rank == 0) real += mb.cu_seqlens.back();
        }
      }
    }
    int64_t ints[4] = {acc.n_tokens, acc.n_counted, acc.n_ppl, real};
    double sums[3] = {acc.loss_sum, acc.entropy_sum, acc.ppl_sum};
    THDPACK_RETURN_IF_ERROR(world_.AllReduceInt64(ints, ReduceOp::kSum));
    THDPACK_RETURN_IF_ERROR(world_.AllReduceFloat64(sums, ReduceOp::kSum));
    const int64_t n = step.meta.n_loss_tokens;
    if (ints[1] != n) {
      return Status::Internal("probe: the last stages counted " + std::to_string(ints[1]) +
                              " loss tokens, the metadata's N is " + std::to_string(n));
    }
    if (ints[0] != ints[3]) {
      return Status::Internal("probe: the last stages saw " + std::to_string(ints[0]) +
                              " real tokens, the replicas' metadata " + std::to_string(ints[3]));
    }
    LossSummary s;
    s.n_tokens = ints[0];
    s.n_loss_tokens = n;
    if (n > 0) {
      s.loss = sums[0] / static_cast<double>(n);
      s.entropy = sums[1] / static_cast<double>(n);
    }
    if (ints[2] > 0) s.ppl = sums[2] / static_cast<double>(ints[2]);
    return s;
  }

  ProcessGroup& world_;
  Topology topo_;
  const ProbeModel& model_;
  bool sp_;
  Coord coord_;
  std::unique_ptr<ProcessGroup> tp_, cp_, pp_;
};

ProbeRunner::ProbeRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ProbeRunner::~ProbeRunner() = default;

Result<std::unique_ptr<ProbeRunner>> ProbeRunner::Create(ProcessGroup& world,
                                                         const Topology& topology,
                                                         const ProbeModel& model, bool sp) {
  auto impl = std::make_unique<Impl>(world, topology, model, sp);
  THDPACK_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<ProbeRunner>(new ProbeRunner(std::move(impl)));
}

Result<LossSummary> ProbeRunner::Forward(const RankStep& step) { return impl_->Forward(step); }

StepVerifier::StepVerifier(ProcessGroup& world, const ProbeModel& model, int64_t global_batch,
                           double tolerance)
    : world_(world), model_(model), global_batch_(global_batch), tolerance_(tolerance) {}
StepVerifier::~StepVerifier() = default;

Result<std::unique_ptr<StepVerifier>> StepVerifier::Create(
    ProcessGroup& world, const Topology& topology, const StepRunnerOptions& options,
    const ProbeModel& model, double tolerance, int64_t start_consumed) {
  if (!(tolerance >= 0)) {
    return Status::InvalidArgument("StepVerifier: tolerance " + std::to_string(tolerance) +
                                   " must be >= 0");
  }
  if (options.read_share) {
    return Status::InvalidArgument(
        "StepVerifier: a caller-fed source has no data to read again for the reference");
  }
  const std::string& data = options.data;
  auto v = std::unique_ptr<StepVerifier>(
      new StepVerifier(world, model, options.global_batch, tolerance));
  THDPACK_ASSIGN_OR_RETURN(v->tokens_,
                           TokenStepsFor(options.global_batch_tokens, options.schedule));
  using Oversize = ScheduleOptions::OversizePolicy;
  if (options.schedule.oversize == Oversize::kTruncate) {
    THDPACK_ASSIGN_OR_RETURN(v->truncate_to_, LongestKept(options.schedule));
  } else if (options.schedule.oversize == Oversize::kSplit) {
    THDPACK_ASSIGN_OR_RETURN(v->split_longest_, LongestKept(options.schedule));
  }
  THDPACK_ASSIGN_OR_RETURN(v->probe_, ProbeRunner::Create(world, topology, model,
                                                          options.schedule.parallel.sp()));
  const SourceOptions& source = options.source;
  Status local = Status::Ok();
  auto plain = OpenSource(data, source);
  if (plain.ok()) {
    v->plain_ = std::move(*plain);
    // Past the samples consumed before the run's first step, one at a time (Reset at each
    // end): no seek, no cursor.
    bool empty_epoch = false;
    for (int64_t k = 0; k < start_consumed && local.ok();) {
      // With split samples, the plain stream of pieces (each a sample); else lengths only.
      Result<bool> got = false;
      if (v->split_longest_ > 0) {
        auto next = NextSamplePlain(*v->plain_, v->plain_state_, v->split_longest_);
        got = next.ok() ? Result<bool>(next->has_value()) : Result<bool>(next.status());
      } else {
        auto next = v->plain_->NextLength();
        got = next.ok() ? Result<bool>(next->has_value()) : Result<bool>(next.status());
      }
      if (!got.ok()) {
        local = got.status();
      } else if (*got) {
        ++k;
        empty_epoch = false;
      } else if (empty_epoch) {
        local = Status::InvalidArgument("StepVerifier: " + data + " holds no sample");
      } else {
        local = v->plain_->Reset();
        empty_epoch = true;
      }
    }
  } else {
    local = plain.status();
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "verify setup"));
  return v;
}

Result<LossSummary> StepVerifier::Check(const RankStep& step) {
  THDPACK_ASSIGN_OR_RETURN(LossSummary got, probe_->Forward(step));
  THDPACK_RETURN_IF_ERROR(CompareWithReference(step, got));
  return got;
}

// Every rank reads the step's samples the plain way and computes the reference of its share
// (samples k with k mod W = rank; with cores to spare, over threads too); the totals are summed
// over the world, and every rank compares. No rank waits idle while another computes it.
Status StepVerifier::CompareWithReference(const RankStep& step, const LossSummary& got) {
  Status local = Status::Ok();
  LossTotals mine;
  {
    Result<std::vector<Sample>> samples =
        ReadStepSamplesPlain(*plain_, global_batch_, step.meta.skipped_ids,
                             tokens_, &plain_state_, split_longest_);
    if (samples.ok() && truncate_to_ > 0) {
      // --oversize truncate, the plain way: a longer sample keeps its first tokens.
      for (Sample& s : *samples) {
        if (static_cast<int64_t>(s.tokens.size()) <= truncate_to_) continue;
        s.tokens.resize(static_cast<size_t>(truncate_to_));
        if (!s.target_mask.empty()) s.target_mask.resize(static_cast<size_t>(truncate_to_));
      }
    }
    if (samples.ok()) {
      std::vector<SampleView> share;
      for (size_t k = static_cast<size_t>(world_.rank()); k < samples->size();
           k += static_cast<size_t>(world_.size())) {
        share.emplace_back((*samples)[k]);
      }
      const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
      const int threads = static_cast<int>(std::max<unsigned>(1, cores / static_cast<unsigned>(world_.size())));
      Result<LossStats> ref = ProbeReferenceLoss(model_, share, threads);
      if (ref.ok()) {
        mine.Add(*ref);
      } else {
        local = ref.status();
      }
    } else {
      local = samples.status();
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "verify reference"));
  THDPACK_RETURN_IF_ERROR(mine.AllReduce(
      [this](std::span<double> values) { return world_.AllReduceFloat64(values, ReduceOp::kSum); }));
  local = CompareLossSummaries(got, Finalize(mine), tolerance_)
              .WithContext("--verify, step " + std::to_string(step.step));
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "verify"));
  return Status::Ok();
}

}  // namespace thdpack
