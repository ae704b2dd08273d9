// src/runtime/step_runner_impl.h: private to the runtime area - the step runner's state and the
// helpers its two halves share: step_runner.cc (what both kinds of step do, and the static
// step) and dynamic_step.cc (the dynamic scheduler's step). thdpack/step_runner.h documents the
// step; nothing here is part of the library's interface.
#ifndef THDPACK_RUNTIME_STEP_RUNNER_IMPL_H_
#define THDPACK_RUNTIME_STEP_RUNNER_IMPL_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/run_state.h"
#include "thdpack/shard.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace runner_internal {

using Clock = std::chrono::steady_clock;

// Message tags of the shard delivery (one message per array per microbatch).
constexpr int kTagTokens = 1;
constexpr int kTagPositions = 2;
constexpr int kTagLabels = 3;
constexpr int kTagMask = 4;
// Field f of the schema travels under kTagFields + f.
constexpr int kTagFields = 16;

// The run's position after a step, as readers send it to the other ranks with the lengths
// and the metadata, as int64 words: the samples consumed, whether there is a cursor (file
// sources), and the cursor - its seven fields, then its parts and counts (a blend), each part
// the same way; a splitting source's cursor has -1 - (its split words) in place of the parts'
// count, then those words and its one part.
using PositionWords = std::vector<int64_t>;
inline void AppendCursor(const SourceCursor& c, PositionWords* w) {
  const bool split = !c.split.empty();
  w->insert(w->end(), {c.epoch, c.position, c.next_id, c.skipped_empty, c.byte_offset, c.line,
                       c.epoch_size,
                       split ? -1 - static_cast<int64_t>(c.split.size())
                             : static_cast<int64_t>(c.parts.size())});
  if (split) {
    w->insert(w->end(), c.split.begin(), c.split.end());
  } else {
    w->insert(w->end(), c.taken.begin(), c.taken.end());
  }
  for (const SourceCursor& p : c.parts) AppendCursor(p, w);
}
inline PositionWords PackPosition(int64_t consumed, const std::optional<SourceCursor>& c) {
  PositionWords w = {consumed, c.has_value() ? 1 : 0};
  if (c) AppendCursor(*c, &w);
  return w;
}
// False when the words are not a cursor (a bug or corrupt transport).
inline bool ReadCursor(const PositionWords& w, size_t* at, int depth, SourceCursor* c) {
  if (*at + 8 > w.size()) return false;
  const int64_t* v = w.data() + *at;
  *c = SourceCursor{};
  c->epoch = v[0];
  c->position = v[1];
  c->next_id = v[2];
  c->skipped_empty = v[3];
  c->byte_offset = v[4];
  c->line = v[5];
  c->epoch_size = v[6];
  const int64_t parts = v[7];
  *at += 8;
  if (parts < 0) {  // a splitting source: its words, then the one cursor it wraps
    const int64_t n = -1 - parts;
    if (n < 1 || n > 16 || static_cast<uint64_t>(n) > (w.size() - *at)) return false;
    c->split.assign(w.begin() + static_cast<std::ptrdiff_t>(*at),
                    w.begin() + static_cast<std::ptrdiff_t>(*at + static_cast<size_t>(n)));
    *at += static_cast<size_t>(n);
    c->parts.resize(1);
    return ReadCursor(w, at, depth, &c->parts[0]) && c->parts[0].split.empty();
  }
  if ((parts > 0 && depth > 0) ||
      static_cast<uint64_t>(parts) > (w.size() - *at)) {
    return false;
  }
  c->taken.assign(w.begin() + static_cast<std::ptrdiff_t>(*at),
                  w.begin() + static_cast<std::ptrdiff_t>(*at + static_cast<size_t>(parts)));
  *at += static_cast<size_t>(parts);
  c->parts.resize(static_cast<size_t>(parts));
  for (SourceCursor& p : c->parts) {
    if (!ReadCursor(w, at, depth + 1, &p)) return false;
  }
  return true;
}
inline Status UnpackPosition(const PositionWords& w, RunState* state) {
  size_t at = 2;
  SourceCursor c;
  if (w.size() < 2 || (w[1] != 0 && (!ReadCursor(w, &at, 0, &c) || at != w.size())) ||
      (w[1] == 0 && w.size() != 2)) {
    return Status::Internal("step runner: a run position of " + std::to_string(w.size()) +
                            " words does not decode");
  }
  state->consumed = w[0];
  state->cursor.reset();
  if (w[1] != 0) state->cursor = std::move(c);
  return Status::Ok();
}

// A sample's payload in the exchange: int32 tokens, then one mask byte a token when the mask
// is not all ones (n_targets != L - 1; target_mask[0] is never used, so such a mask is
// equivalent to the empty one).
// Then the sample's field buffers (thdpack/fields.h) back to back, in schema order.
inline bool SendsMask(const SampleLength& s) { return s.n_targets != s.length - 1; }
inline int64_t PayloadBytes(const SampleLength& s, std::span<const FieldSpec> fields) {
  return s.length * static_cast<int64_t>(sizeof(TokenId)) + (SendsMask(s) ? s.length : 0) +
         FieldBytes(fields, s.length);
}

// FNV-1a over the bytes of int64 values (least significant first): the plan hash loaders (or
// heads) compare.
class PlanHasher {
 public:
  void Mix(int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (static_cast<uint64_t>(v) >> (8 * i)) & 0xff;
      h_ *= 1099511628211ull;
    }
  }
  void Mix(std::span<const int64_t> values) {
    for (int64_t v : values) Mix(v);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

inline uint64_t HashPlan(const Plan& plan) {
  PlanHasher h;
  h.Mix(plan.num_microbatches);
  h.Mix(plan.dp_size);
  h.Mix(plan.offsets);
  h.Mix(plan.sample_ids);
  h.Mix(plan.skipped);
  return h.value();
}

inline uint64_t HashPlan(const DynamicPlan& plan) {
  PlanHasher h;
  h.Mix(plan.num_microbatches);
  h.Mix(plan.domain_size);
  for (const auto& groups : plan.microbatches) {
    h.Mix(static_cast<int64_t>(groups.size()));
    for (const CpGroup& g : groups) {
      h.Mix(g.first_rank);
      h.Mix(g.num_ranks);
      h.Mix(g.sample_ids);
    }
  }
  h.Mix(plan.skipped);
  return h.value();
}

// Every planner of `group` holds the same hash `h` (one all-reduce of 4 int64), else Internal
// naming `what` and the step.
inline Status AgreeOnPlanHash(ProcessGroup& group, uint64_t h, const std::string& what, int64_t step) {
  const int64_t lo = static_cast<int64_t>(h & 0xffffffffu), hi = static_cast<int64_t>(h >> 32);
  std::vector<int64_t> v = {lo, hi, -lo, -hi};
  THDPACK_RETURN_IF_ERROR(group.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kMin));
  if (v[0] != lo || v[1] != hi || v[2] != -lo || v[3] != -hi) {
    return Status::Internal(what + " of step " + std::to_string(step) +
                            " differs between planners (hash check)");
  }
  return Status::Ok();
}

// The step's metadata header, common to both kinds of step.
inline StepMeta MetaHeader(int64_t step, int64_t epoch, int dp_size, int replica,
                    const ParallelLayout& parallel, std::vector<int64_t> skipped) {
  StepMeta meta;
  meta.step = static_cast<uint64_t>(step);
  meta.epoch = static_cast<uint64_t>(epoch);
  meta.dp_size = dp_size;
  meta.replica = replica;
  meta.parallel = parallel;
  meta.skipped_ids = std::move(skipped);
  return meta;
}

// One packed microbatch into the metadata, with the step's token sums.
inline void AddMicrobatch(StepMeta& meta, Layout layout, int64_t n_valid) {
  MicrobatchMeta mm;
  mm.cu_seqlens = std::move(layout.cu_seqlens);
  mm.cu_seqlens_padded = std::move(layout.cu_seqlens_padded);
  mm.max_seqlen = layout.max_seqlen;
  mm.n_valid = n_valid;
  meta.real_tokens += mm.cu_seqlens.back();
  meta.padded_tokens += mm.cu_seqlens_padded.back();
  for (size_t i = 0; i + 1 < mm.cu_seqlens_padded.size(); ++i) {
    const int64_t p = mm.cu_seqlens_padded[i + 1] - mm.cu_seqlens_padded[i];
    meta.sum_sq += p * p;
  }
  meta.microbatches.push_back(std::move(mm));
}

// A received sample: views into the exchange buffer (or into the loader's own sample).
struct SampleRef {
  const TokenId* tokens = nullptr;
  const uint8_t* mask = nullptr;  // null: all ones
  int64_t length = 0;
  // Its field buffers: back to back in schema order in the exchange buffer (received), or the
  // loader's own sample's.
  const std::byte* fields = nullptr;
  const std::vector<std::vector<std::byte>>* own_fields = nullptr;
};

// What every rank of a microbatch learns of its sequences, in packed order (made by the packer,
// sent with the metadata): the samples' ids and loss-token counts, a blend's sources, and the
// rows of the sample fields (one buffer per sample field of the schema, n rows each).
struct SequenceInfo {
  std::vector<int64_t> ids;
  std::vector<int64_t> n_targets;
  std::vector<int32_t> sources;  // a blend only
  std::vector<std::vector<std::byte>> sample_fields;
};

}  // namespace runner_internal

class StepRunner::Impl {
 public:
  using Clock = runner_internal::Clock;
  using SampleRef = runner_internal::SampleRef;
  Impl(ProcessGroup& world, const Topology& topology, const StepRunnerOptions& options)
      : world_(world), topo_(topology), opts_(options), groups_(topology, options.max_cp_groups) {}

  Status Init();
  Result<RankStep> Next();
  const RunState& state() const { return state_; }
  Status Restore(const RunState& state);
  bool reads() const { return reader_; }

 private:
  friend struct runner_internal::TestHooks;
  // Phase bookkeeping: time and the bytes of the data groups; agreements counted apart.
  void BeginPhase(RankStep& out, Phase phase) {
    out.phases.push_back(PhaseStats{phase, 0, 0});
    phase_start_ = Clock::now();
    phase_bytes_ = DataBytes();
  }
  void EndPhase(RankStep& out) {
    out.phases.back().seconds = std::chrono::duration<double>(Clock::now() - phase_start_).count();
    out.phases.back().bytes_sent = DataBytes() - phase_bytes_;
  }
  int64_t DataBytes() const {
    int64_t n = 0;
    if (loaders_) n += loaders_->bytes_sent();
    if (replica_) n += replica_->bytes_sent();
    if (heads_) n += heads_->bytes_sent();
    if (column_) n += column_->bytes_sent();
    n += groups_bytes_;
    return n;
  }
  Status Agree(const Status& local, const char* context) {
    const auto t0 = Clock::now();
    const int64_t b0 = world_.bytes_sent();
    Status s = AgreeOnStatus(world_, local, context);
    agree_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    agree_bytes_ += world_.bytes_sent() - b0;
    return s;
  }
  // One phase of a step: timed, `work` run on the ranks that take part (`here`; the others
  // contribute Ok), then the outcome agreed by every rank under `context`.
  template <typename Work>
  Status RunPhase(RankStep& out, Phase phase, bool here, const char* context, Work&& work) {
    BeginPhase(out, phase);
    const Status local = here ? work() : Status::Ok();
    EndPhase(out);
    return Agree(local, context);
  }
  // The metadata a rank received (meta_bytes_) from `sender`, decoded and checked against this
  // rank's topology and step (a dynamic step's also against its domain rank, with groups);
  // kept in out.meta and out.epoch when good.
  Status AcceptMeta(RankStep& out, const std::string& sender, bool dynamic);

  Status InitDynamic();
  Result<RankStep> NextDynamic();
  Status MakeDynamicPlan(RankStep& out);
  Status ExchangeTokensDynamic(RankStep& out);
  Status PackDynamic(RankStep& out);
  Status ReceiveShardsDynamic(RankStep& out);
  Status MakeGroups(RankStep& out);
  void FinishLocalDynamic(RankStep& out);
  int DomainIndex() const { return coord_.dp * topo_.cp_size() + coord_.cp; }

  // Readers: the run's fingerprint, checked against a resumed state's, and the reader moved to
  // the start; state_ then holds where the run starts.
  Status StartReading();
  // Every rank: the state where the run starts, from world rank 0 (a reader in every mode).
  Status ShareStart();
  // After a step: state_ moved past it (after_), copied into the step.
  Status CommitPosition(RankStep& out);
  // The step's count of sequences with a loss token and what each microbatch's sequences are
  // (mb_info_) as words after the position in the metadata broadcast, and back.
  void AppendSequences(runner_internal::PositionWords* w) const;
  Status ReadSequences(const runner_internal::PositionWords& w, size_t at);
  // The packer's side of SequenceInfo and the per-token fields: for microbatch m, the sequences
  // at scheduling positions `ps` (packed order) with `layout` over a group of cp_size ranks, into
  // the shards given (each for its cp_rank; a shard holding tokens gets the input fields, one
  // holding labels the target fields).
  Status PackSequences(RankStep& out, size_t m, std::span<const int64_t> ps,
                       const Layout& layout, int cp_size, std::vector<PackedShard>& shards);
  Status ReadShare(RankStep& out);
  // The read phase: ReadShare on the readers, agreed; with a fed source, its end agreed first
  // (every loader's at the same step boundary: kEndOfData on every rank; some only: an error).
  Status ReadPhase(RankStep& out);
  Status MakePlan(RankStep& out);
  Status ExchangeTokens(RankStep& out);
  Status PackReplica(RankStep& out);
  Status ReceiveShards(RankStep& out);
  void FinishLocal(RankStep& out);

  // Shared by the static and the dynamic step.
  RankStep StartStep(bool is_loader);
  // The lengths phase over `group`, whose member d * loader_stride is loader d (the others
  // read nothing).
  Status ExchangeLengths(ProcessGroup& group, int loader_stride, RankStep& out);
  // The deliver phase: with a `group`, its member 0 broadcasts the metadata (AcceptMeta on the
  // others, agreed) and then receive() runs; with none (data on every rank), nothing moves.
  // Then, agreed, `then` (the dynamic step's groups) when given.
  Status Deliver(RankStep& out, ProcessGroup* group, const std::string& sender,
                 const std::function<Status()>& receive, const std::function<Status()>& then);
  Status MoveSamples(ProcessGroup& group, const std::vector<SampleLength>& samples,
                     const std::vector<std::vector<int64_t>>& send_ps,
                     const std::vector<std::vector<int64_t>>& recv_ps, int64_t my_begin,
                     const std::function<bool(int64_t)>& keeps);
  Status DeliverMeta(ProcessGroup& group);
  // A packed step's metadata: encoded for delivery (tp0: meta_bytes_), else validated.
  Status SealMeta(const StepMeta& meta);
  Status SendShard(ProcessGroup& group, int member, int member_pp, const PackedShard& sh);
  Status RecvShard(ProcessGroup& group, size_t local_tokens, PackedShard& sh);
  LocalMicrobatch MakeLocal(RankStep& out, size_t m, int cp_size, int cp_rank);

  ProcessGroup& world_;
  Topology topo_;
  StepRunnerOptions opts_;
  // Tests of the failure path (runner_internal::TestHooks): the loader of this replica flips
  // one bit of the encoded metadata before sending it; -1 never.
  int corrupt_metadata_of_replica_ = -1;
  Coord coord_;
  bool reader_ = false;  // reads and plans (a loader)
  bool fed_ended_ = false;  // this step's read_share said kEndOfData (ReadPhase)
  std::unique_ptr<SampleSource> source_;
  std::optional<StepReader> steps_;  // reads source_ (reading ranks)
  std::unique_ptr<ProcessGroup> loaders_;  // the loaders exchanging lengths and tokens
  std::unique_ptr<ProcessGroup> replica_;  // tp0: every rank of this replica, loader first
  int64_t step_ = 0;
  // The dynamic scheduler. heads_: the D ranks of this rank's domain in domain order (dp*CP +
  // cp; loader d at position d*CP) - with tp0 the ranks tp = 0, pp = 0, with all those of this
  // rank's (tp, pp) - which plan, receive their groups' samples and pack; column_ (tp0): the
  // ranks of one domain index (every tp and pp), its head first; groups_: the CP groups kept,
  // by (first rank, size), the group null where this rank is not a member, with the last step
  // that used it.

  bool dynamic_ = false;
  bool head_ = false;
  std::unique_ptr<ProcessGroup> heads_;
  std::unique_ptr<ProcessGroup> column_;
  CpGroupCache groups_;
  int64_t groups_bytes_ = 0;
  std::vector<std::pair<int, int>> group_of_;  // [n]: (first rank, size) per position, (-1, 0)

  // Per-step state.
  Clock::time_point phase_start_;
  int64_t phase_bytes_ = 0;
  double agree_seconds_ = 0;
  int64_t agree_bytes_ = 0;
  std::vector<Sample> own_;             // this loader's share, in source order
  int64_t first_id_ = 0;
  std::vector<int64_t> loader_offset_;  // [DP+1]: loader d's samples at positions [o_d, o_{d+1})
  std::vector<int> replica_of_;         // [n]: the replica the plan chose per position (-1 skip)
  int64_t id_span_ = 0;  // the step's ids lie in [first_id_, first_id_ + id_span_)
  // [id_span_]: id - first_id -> scheduling position (-1: the id of an empty document)
  std::vector<int64_t> position_of_offset_;
  std::vector<std::byte> recv_buffer_;
  std::vector<SampleRef> refs_;         // [n]: where each of this replica's samples lives
  // Loader's packed shards: [M][CP].
  std::vector<std::vector<PackedShard>> shards_;
  std::vector<uint8_t> meta_bytes_;
  // The run's state after the last step returned (or its start), and the position after the
  // step in flight: set by readers in the read phase, received by the others with the lengths
  // (ExchangeLengths) or the metadata (DeliverMeta).
  RunState state_;
  runner_internal::PositionWords after_;
  // A blend: samples carry their source (sent with the lengths). Each microbatch's sequences
  // (mb_info_[m]: ids, loss-token counts, sources, sample fields) and the step's count of
  // sequences with a loss token, made by the packer and sent with the metadata.
  bool blend_ = false;
  std::vector<runner_internal::SequenceInfo> mb_info_;
  int64_t n_loss_sequences_ = 0;
  // The run's fields (StepRunnerOptions::fields): bytes a sample of length L holds in them, and
  // the sample fields' positions in the schema.
  std::vector<size_t> sample_fields_;
  // keep_groups: the group field's index in the schema (-1: none), and this step's group id of
  // each sample of RankStep::samples (from the lengths exchange).
  int group_field_ = -1;
  Truncation own_cut_;  // oversize 'truncate': what this loader cut of its share this step
  std::vector<int64_t> step_groups_;
  // Checks StepRunnerOptions::group_field against keep_groups and the schema; sets
  // group_field_.
  Status FindGroupField();
  // The group id a sample carries (its group field, int32 or int64).
  int64_t GroupOf(const Sample& x) const;
  bool started_ = false;  // a step was run (Restore is refused then)
  Status restore_error_;  // a reader's failed seek, reported by the next read phase
};

namespace runner_internal {
// What the failure-path tests reach that no caller may: kept out of StepRunnerOptions.
struct TestHooks {
  static void CorruptMetadataOfReplica(StepRunner& runner, int replica) {
    runner.impl_->corrupt_metadata_of_replica_ = replica;
  }
};
}  // namespace runner_internal

}  // namespace thdpack

#endif  // THDPACK_RUNTIME_STEP_RUNNER_IMPL_H_
