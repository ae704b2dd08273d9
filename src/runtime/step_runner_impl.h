// src/runtime/step_runner_impl.h: private to the runtime area - the step runner's state and the
// helpers its files share. thdpack/step_runner.h documents the step; step_runner.cc drives it,
// phase by phase, each phase in a file of its own (step_runner.cc's header lists them, in step
// order); dynamic_step.cc holds the dynamic scheduler's step. Every message a phase sends is
// wire/'s (thdpack/step_wire.h). Nothing here is part of the library's interface.
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

#include "common/default_init.h"
#include "thdpack/run_state.h"
#include "thdpack/shard.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"
#include "thdpack/step_wire.h"

namespace thdpack {
namespace runner_internal {

using Clock = std::chrono::steady_clock;

// The plan hash loaders (or heads) compare under check_plan_hash (step_plan.cc): FNV-1a over
// the plan's int64 values.
uint64_t HashPlan(const Plan& plan);
uint64_t HashPlan(const DynamicPlan& plan);

// Every planner of `group` holds the same hash `h` (one all-reduce of 4 int64), else Internal
// naming `what` and the step.
Status AgreeOnPlanHash(ProcessGroup& group, uint64_t h, const std::string& what, int64_t step);

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

// The step's loss sums, for both kinds of step: the loss-token counts of the samples the plan
// keeps (kept(p) for scheduling position p; a skipped sample counts nothing) added to
// meta.n_loss_tokens, and the count of those sequences with a loss token returned.
template <typename Kept>
int64_t AddLossSums(std::span<const SampleLength> samples, Kept&& kept, StepMeta& meta) {
  int64_t n_loss_sequences = 0;
  for (size_t p = 0; p < samples.size(); ++p) {
    if (!kept(p)) continue;
    meta.n_loss_tokens += samples[p].n_targets;
    n_loss_sequences += samples[p].n_targets > 0 ? 1 : 0;
  }
  return n_loss_sequences;
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

}  // namespace runner_internal

class StepRunner::Impl {
 public:
  using Clock = runner_internal::Clock;
  using SampleRef = runner_internal::SampleRef;
  Impl(ProcessGroup& world, const Topology& topology, const StepRunnerOptions& options)
      : world_(world), topo_(topology), opts_(options), groups_(topology, options.max_cp_groups) {}

  Status Init();  // step_open.cc
  Result<RankStep> Next();  // step_runner.cc (a dynamic step: NextDynamic, dynamic_step.cc)
  const RunState& state() const { return state_; }
  Status Restore(const RunState& state);  // step_read.cc
  bool reads() const { return reader_; }
  const std::vector<std::string>& defaulted() const { return opts_.defaulted; }

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
    return n - group_agree_bytes_;
  }
  Status Agree(const Status& local, const char* context) { return AgreeIn(world_, local, context); }
  // The agreement over `group` (a phase's own group, before a collective whose sizes came in a
  // message: a rank that found that message damaged cannot take part), counted as agreement.
  Status AgreeIn(ProcessGroup& group, const Status& local, const char* context) {
    const auto t0 = Clock::now();
    const int64_t b0 = group.bytes_sent();
    Status s = AgreeOnStatus(group, local, context);
    agree_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    agree_bytes_ += group.bytes_sent() - b0;
    if (&group != &world_) group_agree_bytes_ += group.bytes_sent() - b0;
    return s;
  }
  // "the loader of replica 1 (world rank 4)": who sent this rank a message, for its errors.
  std::string Sender(const ProcessGroup& group, int member, const char* role) const;
  // One phase of a step: timed, `work` run on the ranks that take part (`here`; the others
  // contribute Ok), then the outcome agreed by every rank under `context`.
  template <typename Work>
  Status RunPhase(RankStep& out, Phase phase, bool here, const char* context, Work&& work) {
    BeginPhase(out, phase);
    const Status local = here ? work() : Status::Ok();
    EndPhase(out);
    return Agree(local, context);
  }
  // Each phase's work, by the file that holds it (step order; step_runner.cc drives them).
  // step_runner.cc: a new step of this rank, and the per-step state reset.
  RankStep StartStep(bool is_loader);

  // step_read.cc - reading and resume.
  // Readers: the run's fingerprint, checked against a resumed state's, and the reader moved to
  // the start; state_ then holds where the run starts.
  Status StartReading();
  // Every rank: the state where the run starts, from world rank 0 (a reader in every mode).
  Status ShareStart();
  Status ReadShare(RankStep& out);
  // The read phase: ReadShare on the readers, agreed; with a fed source, its end agreed first
  // (every loader's at the same step boundary: kEndOfData on every rank; some only: an error).
  Status ReadPhase(RankStep& out);
  // After a step: state_ moved past it (after_), copied into the step.
  Status CommitPosition(RankStep& out);

  // step_keep_groups.cc - keep_groups' group ids.
  // Checks StepRunnerOptions::group_field against keep_groups and the schema; sets
  // group_field_.
  Status FindGroupField();
  // The group id a sample carries (its group field, int32 or int64).
  int64_t GroupOf(const Sample& x) const;

  // step_lengths.cc - the lengths phase over `group`, whose member d * loader_stride is loader
  // d (the others read nothing).
  Status ExchangeLengths(ProcessGroup& group, int loader_stride, RankStep& out);

  // step_plan.cc - the static plan.
  Status MakePlan(RankStep& out);

  // step_exchange.cc - the token exchange.
  Status MoveSamples(ProcessGroup& group, const std::vector<SampleLength>& samples,
                     const std::vector<std::vector<int64_t>>& send_ps,
                     const std::vector<std::vector<int64_t>>& recv_ps, int64_t my_begin,
                     const std::function<bool(int64_t)>& keeps);
  Status ExchangeTokens(RankStep& out);
  // The scheduling positions loader s read that the plan sends to loader e's replica, in order:
  // the block s -> e of the token exchange and of the media exchange (step_media.cc).
  std::vector<int64_t> LoaderBlock(int s, int e) const;

  // step_pack.cc - packing.
  Status PackReplica(RankStep& out);
  // The packer's side of MicrobatchSequences and the per-token fields: for microbatch m, the
  // sequences at scheduling positions `ps` (packed order) with `layout` over a group of cp_size
  // ranks, into the shards given (each for its cp_rank; a shard holding tokens gets the input
  // fields, one holding labels the target fields).
  Status PackSequences(RankStep& out, size_t m, std::span<const int64_t> ps,
                       const Layout& layout, int cp_size, std::vector<PackedShard>& shards);

  // step_media.cc - media (docs/media.md).
  // The media options against the source, the data placement, the scheduler and oversize.
  Status CheckMediaOptions() const;
  // After the token exchange: each sample's media to the loader that packs it (media_of_).
  Status ExchangeMedia(RankStep& out);
  // The dynamic step's (dynamic_media.cc): each sample's media to every head of its group, as
  // its tokens go - its grids to each, each payload row only to the head that encodes its item
  // (PlaceDynamicMedia), expanded there to the whole payload's size (ExpandPlacedPayload).
  Status ExchangeMediaDynamic(RankStep& out);
  // Every head's placement of every group's items before the exchange: the loaders' samples'
  // item costs all-gathered over the heads (a kMedia frame each), then each microbatch group's
  // items placed over its ranks by PlaceMediaItems - as PackMedia will place them - into
  // item_head_ (the domain index of the head that encodes each item of each position).
  Status PlaceDynamicMedia(RankStep& out);
  // A received sample's parts (position p, payload rows of the items placed on this head
  // alone) made whole-sized, those rows at their items' places; Corruption naming `from` when
  // the rows are not those of the items placed here.
  Status ExpandPlacedPayload(int64_t p, std::vector<MediaPart>& parts, const std::string& from);
  // The dynamic step's blocks among the heads (dynamic_step.cc): head e receives from loader
  // head s the positions s read whose group holds e; and whether sample p's group holds e.
  void HeadBlocks(std::vector<std::vector<int64_t>>* send_ps,
                  std::vector<std::vector<int64_t>>* recv_ps) const;
  bool HeadHolds(int64_t p, int e) const;
  // The exchange of both: over `g` (members named `role` in errors), member e receiving the
  // media of the positions send_ps[e] (this member's samples, own_ from my_begin: the parts
  // parts_of(p, e) gives, all of its own by default) and sending recv_ps[e]'s to this one;
  // `keeps(p)`: this member packs its own sample p.
  using PartsOf = std::function<std::span<const MediaPart>(int64_t p, size_t e)>;
  Status MoveMedia(ProcessGroup& g, const char* role,
                   const std::vector<std::vector<int64_t>>& send_ps,
                   const std::vector<std::vector<int64_t>>& recv_ps, int64_t my_begin,
                   const std::function<bool(int64_t)>& keeps, RankStep& out,
                   const PartsOf& parts_of = nullptr);
  // Microbatch m's media over a CP group of `cp` ranks: its items checked and placed, each
  // first-stage rank's MediaShard (media_shards_[m][cp * TP + tp]); with only_c >= 0 (a dynamic
  // step's head) that CP rank's alone (media_shards_[m][tp]).
  Status PackMedia(RankStep& out, size_t m, std::span<const int64_t> ps, const Layout& layout,
                   int cp, int only_c = -1);
  // After the shards: each first-stage member's MediaShards (media_local_ on every rank), over
  // the replica (a static step) or the head's column (column: a dynamic step).
  Status DeliverMedia(RankStep& out, ProcessGroup& g, bool column);

  // step_deliver.cc - delivery.
  // A packed step's message: with a group to deliver to (tp0), the metadata, the position, the
  // sequences and the checksums of the shards the group's members get, encoded (meta_bytes_);
  // else the metadata validated.
  Status SealMeta(const StepMeta& meta);
  // The CRC-32C of shard s's arrays that some member of `group` (> 1 member) receives (0 for
  // the others), in the step message's order; shard s of a static step is CP rank s's.
  std::vector<uint32_t> ChecksumShards(ProcessGroup& group, size_t m) const;
  // The deliver phase: with a `group`, its member 0 broadcasts the metadata (AcceptMeta on the
  // others, agreed) and then receive() runs; with none (data on every rank), nothing moves.
  // Then, agreed, `then` (the dynamic step's groups) when given.
  Status Deliver(RankStep& out, ProcessGroup* group, const std::string& sender,
                 const std::function<Status()>& receive, const std::function<Status()>& then);
  Status DeliverMeta(ProcessGroup& group);
  // The step message a rank received (meta_bytes_) from `sender`, decoded and checked against
  // this rank's topology, step and schema (a dynamic step's also against its domain rank, with
  // groups); kept in out.meta, out.epoch, after_, mb_info_, n_loss_sequences_ and
  // shard_checksums_ when good.
  Status AcceptMeta(RankStep& out, const std::string& sender, bool dynamic);
  Status SendShard(ProcessGroup& group, int member, int member_pp, const PackedShard& sh);
  Status RecvShard(ProcessGroup& group, size_t local_tokens, PackedShard& sh);
  // A received shard (shard s of microbatch m) against the checksums of the step message:
  // Corruption naming the microbatch, the array and `sender` on the first that differs.
  Status CheckShard(const PackedShard& sh, size_t m, size_t s, const std::string& sender) const;
  Status ReceiveShards(RankStep& out);

  // step_local.cc - the local microbatches.
  LocalMicrobatch MakeLocal(RankStep& out, size_t m, int cp_size, int cp_rank);
  void FinishLocal(RankStep& out);

  // dynamic_step.cc - the dynamic scheduler's step.
  Status InitDynamic();
  Result<RankStep> NextDynamic();
  Status MakeDynamicPlan(RankStep& out);
  Status ExchangeTokensDynamic(RankStep& out);
  Status PackDynamic(RankStep& out);
  Status ReceiveShardsDynamic(RankStep& out);
  Status MakeGroups(RankStep& out);
  void FinishLocalDynamic(RankStep& out);
  int DomainIndex() const { return coord_.dp * topo_.cp_size() + coord_.cp; }

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
  int64_t group_agree_bytes_ = 0;  // agreements over a phase's group (AgreeIn), not data
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
  RawBytes recv_buffer_;  // filled whole by the exchange: not zeroed when sized
  std::vector<SampleRef> refs_;         // [n]: where each of this replica's samples lives
  // Loader's packed shards: [M][CP].
  std::vector<std::vector<PackedShard>> shards_;
  // Media (step_media.cc): where each sample this loader packs has its media (its own, or
  // media_recv_ from the exchange), each microbatch's MediaShard per (cp, tp) of the replica
  // (the loader), and this rank's, per microbatch.
  std::vector<std::vector<MediaPart>> media_recv_;
  std::vector<const std::vector<MediaPart>*> media_of_;
  // A dynamic step's placement (PlaceDynamicMedia): [n][items] the encoding head's domain index,
  // and this loader's samples' items (own_ order).
  std::vector<std::vector<int32_t>> item_head_;
  std::vector<std::vector<MediaItem>> own_items_;
  std::vector<std::vector<MediaShard>> media_shards_;
  std::vector<MediaShard> media_local_;
  std::vector<uint8_t> meta_bytes_;  // the encoded step message
  // Receivers: the checksums the step message announced for the shards that follow it: [m]
  // the checksums of microbatch m's shards (shards_per_mb_ x arrays_per_shard_; empty when
  // idle or when no shard travels).
  std::vector<std::vector<uint32_t>> shard_checksums_;
  int32_t arrays_per_shard_ = 0;
  // The run's state after the last step returned (or its start), and the position after the
  // step in flight: set by readers in the read phase, received by the others with the lengths
  // (ExchangeLengths) or the step message (AcceptMeta).
  RunState state_;
  StepPosition after_;
  // A blend: samples carry their source (sent with the lengths). Each microbatch's sequences
  // (mb_info_[m]: ids, loss-token counts, sources, sample fields) and the step's count of
  // sequences with a loss token, made by the packer and sent with the metadata.
  bool blend_ = false;
  std::vector<MicrobatchSequences> mb_info_;
  int64_t n_loss_sequences_ = 0;
  // The run's fields (StepRunnerOptions::fields): bytes a sample of length L holds in them, and
  // the sample fields' positions in the schema.
  std::vector<size_t> sample_fields_;
  // keep_groups: the group field's index in the schema (-1: none), and this step's group id of
  // each sample of RankStep::samples (from the lengths exchange).
  int group_field_ = -1;
  Truncation own_cut_;  // oversize 'truncate': what this loader cut of its share this step
  std::vector<int64_t> step_groups_;
  // With media: the encoder work of each sample this loader read, in own_ order (the lengths'
  // media column; every sample's arrives in RankStep::encoder_work).
  std::vector<EncoderWork> own_work_;
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
