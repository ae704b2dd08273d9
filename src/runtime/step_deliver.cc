// Phase 6, deliver (design.md section 7, step 5): with tp0, each replica's loader (a dynamic
// step: each column's head) sends its members the step's metadata - one broadcast of the
// encoded StepMeta (wire/, CRC-checked), then the position and sequences as step_words.h's
// int64 words, which no checksum covers (DeliverMeta) - each member decodes and checks it
// (AcceptMeta), the outcome is agreed, and only then the shards move, point to point, each
// microbatch's arrays to the stage that uses them (SendShard, RecvShard; ReceiveShards, and
// ReceiveShardsDynamic in dynamic_step.cc) under the tags below. With --data-on all nothing
// moves. Deliver runs the phase for both kinds of step; SealMeta, at the end of the pack phase,
// encodes the metadata (tp0) or validates it.
// Depends on: step_pack.cc (shards_, out.meta, mb_info_), step_read.cc (after_), step_words.h.
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/wire.h"

namespace thdpack {

namespace {

// Message tags of the shard delivery (one message per array per microbatch).
constexpr int kTagTokens = 1;
constexpr int kTagPositions = 2;
constexpr int kTagLabels = 3;
constexpr int kTagMask = 4;
// Field f of the schema travels under kTagFields + f.
constexpr int kTagFields = 16;

}  // namespace

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::SealMeta(const StepMeta& meta) {
  if (opts_.data_on == DataOn::kTp0) {
    THDPACK_ASSIGN_OR_RETURN(meta_bytes_, EncodeStepMeta(meta));
    return Status::Ok();
  }
  return ValidateStepMeta(meta);
}

// The step's metadata from position 0 of `group` (the loader of a replica, the head of a
// column) to every other member.
Status StepRunner::Impl::DeliverMeta(ProcessGroup& group) {
  // One message: the encoded metadata, then as int64 words the run's position after the step
  // and what the microbatches' sequences are (AppendSequences). The sizes go first.
  PositionWords words;
  if (group.rank() == 0) {
    words = after_;
    AppendSequences(n_loss_sequences_, mb_info_, blend_, &words);
  }
  std::array<int64_t, 2> head = {static_cast<int64_t>(meta_bytes_.size()),
                                 static_cast<int64_t>(words.size())};
  THDPACK_RETURN_IF_ERROR(group.BroadcastValues(std::span<int64_t>(head), 0));
  const int64_t size = head[0];
  if (size < 0 || size > (int64_t{1} << 32) || head[1] < 2 || head[1] > (int64_t{1} << 28)) {
    return Status::Corruption("step metadata size " + std::to_string(size) + " (" +
                              std::to_string(head[1]) + " words) out of range");
  }
  std::vector<uint8_t> wire(static_cast<size_t>(size) + 8 * static_cast<size_t>(head[1]));
  if (group.rank() == 0) {
    std::memcpy(wire.data(), meta_bytes_.data(), meta_bytes_.size());
    std::memcpy(wire.data() + size, words.data(), 8 * words.size());
    if (corrupt_metadata_of_replica_ == coord_.dp && size > 0) {
      wire[static_cast<size_t>(size) / 2] ^= 0x10;  // a test of the failure path flips one bit
    }
    return group.BroadcastValues(std::span<uint8_t>(wire), 0);
  }
  THDPACK_RETURN_IF_ERROR(group.BroadcastValues(std::span<uint8_t>(wire), 0));
  meta_bytes_.assign(wire.begin(), wire.begin() + size);
  words.resize(static_cast<size_t>(head[1]));
  std::memcpy(words.data(), wire.data() + size, 8 * words.size());
  // The position first (its length follows from its words), then the sources.
  size_t at = 2;
  SourceCursor cursor;
  if (words[1] != 0 && !ReadCursor(words, &at, 0, &cursor)) {
    return Status::Internal("step runner: the run position received does not decode");
  }
  after_.assign(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(at));
  return ReadSequences(words, at, blend_, opts_.fields, sample_fields_, &n_loss_sequences_,
                       &mb_info_);
}

// One microbatch's shard from position 0 of `group` to member `member`, whose stage is
// member_pp: tokens and positions to the first stage, labels and the loss mask to the last.
Status StepRunner::Impl::SendShard(ProcessGroup& group, int member, int member_pp,
                                   const PackedShard& sh) {
  if (member_pp == 0) {
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const TokenId>(sh.tokens), member, kTagTokens));
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const int32_t>(sh.position_ids), member, kTagPositions));
  }
  if (member_pp == topo_.pp_size() - 1) {
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const TokenId>(sh.labels), member, kTagLabels));
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const uint8_t>(sh.loss_mask), member, kTagMask));
  }
  // The per-token fields the member's stage holds: input fields with the tokens, target fields
  // with the labels.
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    const FieldSpec& spec = opts_.fields[f];
    if (!spec.per_token() || !spec.HeldWith(member_pp == 0, member_pp == topo_.pp_size() - 1)) {
      continue;
    }
    THDPACK_RETURN_IF_ERROR(group.Send(sh.fields[f], member, kTagFields + static_cast<int>(f)));
  }
  return Status::Ok();
}

// This rank's side of SendShard: the arrays of its stage, local_tokens each.
Status StepRunner::Impl::RecvShard(ProcessGroup& group, size_t local_tokens, PackedShard& sh) {
  if (coord_.pp == 0) {
    sh.tokens.resize(local_tokens);
    sh.position_ids.resize(local_tokens);
    THDPACK_RETURN_IF_ERROR(group.RecvValues(std::span<TokenId>(sh.tokens), 0, kTagTokens));
    THDPACK_RETURN_IF_ERROR(
        group.RecvValues(std::span<int32_t>(sh.position_ids), 0, kTagPositions));
  }
  if (coord_.pp == topo_.pp_size() - 1) {
    sh.labels.resize(local_tokens);
    sh.loss_mask.resize(local_tokens);
    THDPACK_RETURN_IF_ERROR(group.RecvValues(std::span<TokenId>(sh.labels), 0, kTagLabels));
    THDPACK_RETURN_IF_ERROR(group.RecvValues(std::span<uint8_t>(sh.loss_mask), 0, kTagMask));
  }
  sh.fields.assign(opts_.fields.size(), {});
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    const FieldSpec& spec = opts_.fields[f];
    if (!spec.per_token() || !spec.HeldWith(coord_.pp == 0, coord_.pp == topo_.pp_size() - 1)) {
      continue;
    }
    sh.fields[f].resize(local_tokens * spec.row_bytes());
    THDPACK_RETURN_IF_ERROR(group.Recv(sh.fields[f], 0, kTagFields + static_cast<int>(f)));
  }
  return Status::Ok();
}

Status StepRunner::Impl::ReceiveShards(RankStep& out) {
  if (replica_->rank() == 0) {
    // The loader sends, microbatch by microbatch, each member what its stage needs.
    for (size_t m = 0; m < shards_.size(); ++m) {
      for (int j = 1; j < replica_->size(); ++j) {
        THDPACK_ASSIGN_OR_RETURN(Coord c, topo_.CoordOf(replica_->ranks()[static_cast<size_t>(j)]));
        THDPACK_RETURN_IF_ERROR(
            SendShard(*replica_, j, c.pp, shards_[m][static_cast<size_t>(c.cp)]));
      }
    }
    // The loader keeps CP rank 0's shard.
    for (auto& per_m : shards_) {
      PackedShard keep = std::move(per_m[0]);
      per_m.clear();
      per_m.push_back(std::move(keep));
    }
    return Status::Ok();
  }
  shards_.assign(out.meta.microbatches.size(), {});
  for (size_t m = 0; m < shards_.size(); ++m) {
    const size_t local = static_cast<size_t>(out.meta.microbatches[m].cu_seqlens_padded.back() /
                                             topo_.cp_size());
    PackedShard sh;
    sh.cp_rank = coord_.cp;
    THDPACK_RETURN_IF_ERROR(RecvShard(*replica_, local, sh));
    shards_[m].push_back(std::move(sh));
  }
  return Status::Ok();
}

Status StepRunner::Impl::AcceptMeta(RankStep& out, const std::string& sender, bool dynamic) {
  auto meta = DecodeStepMeta(meta_bytes_);
  if (!meta.ok()) {
    return meta.status().WithContext("step " + std::to_string(step_) +
                                     " metadata received from " + sender);
  }
  const bool dynamic_ok = !dynamic || (!meta->groups.empty() && meta->domain_rank == DomainIndex());
  if (meta->dp_size != topo_.dp_size() || meta->replica != coord_.dp ||
      meta->parallel != opts_.schedule.parallel || meta->step != static_cast<uint64_t>(step_) ||
      !dynamic_ok) {
    const std::string where = dynamic ? "domain rank " + std::to_string(meta->domain_rank)
                                      : "replica " + std::to_string(meta->replica);
    return Status::InvalidArgument(
        "step metadata received by rank " + std::to_string(world_.rank()) +
        " does not match its topology " + topo_.ToString() + " (" + where + ", DP " +
        std::to_string(meta->dp_size) + ", " + meta->parallel.ToString() + ", step " +
        std::to_string(meta->step) + (dynamic && meta->groups.empty() ? ", no groups" : "") +
        ")");
  }
  out.meta = std::move(*meta);
  out.epoch = static_cast<int64_t>(out.meta.epoch);
  return Status::Ok();
}

Status StepRunner::Impl::Deliver(RankStep& out, ProcessGroup* group, const std::string& sender,
                                 const std::function<Status()>& receive,
                                 const std::function<Status()>& then) {
  BeginPhase(out, Phase::kDeliver);
  Status local;
  if (group != nullptr) {
    local = DeliverMeta(*group);
    if (local.ok() && group->rank() != 0) local = AcceptMeta(out, sender, dynamic_);
    // Nobody waits for shards until every rank holds good metadata.
    Status agreed = Agree(local, "deliver metadata");
    if (!agreed.ok()) {
      EndPhase(out);
      return agreed;
    }
    local = receive();
  }
  if (then) {
    // Every rank is here with its data: `then` runs on all of them together.
    Status agreed = Agree(local, "deliver");
    if (!agreed.ok()) {
      EndPhase(out);
      return agreed;
    }
    local = then();
    EndPhase(out);
    return Agree(local, "groups");
  }
  EndPhase(out);
  return Agree(local, "deliver");
}

}  // namespace thdpack
