// Phase 6, deliver (design.md section 7, step 5): with tp0, each replica's loader (a dynamic
// step: each column's head) sends its members the step message (thdpack/step_wire.h: the
// StepMeta, the run's position after the step, each microbatch's sequences and the CRC-32C of
// every shard array it will send, under one checksum), after a size frame (DeliverMeta); each
// member decodes and checks it (AcceptMeta), the outcome is agreed, and only then the shards
// move, point to point, each microbatch's arrays to the stage that uses them (SendShard,
// RecvShard; ReceiveShards, and ReceiveShardsDynamic in dynamic_step.cc) under the tags below,
// each received array checked against its checksum (CheckShard) once all have arrived. With
// --data-on all nothing moves. Deliver runs the phase for both kinds of step; SealMeta, at the
// end of the pack phase, encodes the step message (tp0) or validates the metadata.
// Depends on: step_pack.cc (shards_, out.meta, mb_info_), step_read.cc (after_).
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/step_wire.h"
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

template <typename T>
uint32_t CrcOf(const std::vector<T>& v) {
  return Crc32c(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()),
                                         v.size() * sizeof(T)));
}

// The arrays of a shard in the step message's order (tokens, position ids, labels, loss mask,
// the per-token fields in schema order), each with whether a rank of stage (first, last) holds
// it, and its CRC-32C.
template <typename Fn>
void ForEachArray(const PackedShard& sh, std::span<const FieldSpec> fields, Fn&& fn) {
  fn(/*first=*/true, /*last=*/false, "tokens", [&] { return CrcOf(sh.tokens); });
  fn(true, false, "position ids", [&] { return CrcOf(sh.position_ids); });
  fn(false, true, "labels", [&] { return CrcOf(sh.labels); });
  fn(false, true, "loss mask", [&] { return CrcOf(sh.loss_mask); });
  for (size_t f = 0; f < fields.size(); ++f) {
    if (!fields[f].per_token()) continue;
    const std::vector<std::byte> none;
    const std::vector<std::byte>& bytes = f < sh.fields.size() ? sh.fields[f] : none;
    // A field held with the tokens counts as first-stage, with the labels as last-stage.
    fn(fields[f].HeldWith(true, false), fields[f].HeldWith(false, true), fields[f].name.c_str(),
       [&] { return CrcOf(bytes); });
  }
}

int32_t ArraysPerShard(std::span<const FieldSpec> fields) {
  int32_t a = 4;
  for (const FieldSpec& f : fields) a += f.per_token() ? 1 : 0;
  return a;
}

}  // namespace

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

std::string StepRunner::Impl::Sender(const ProcessGroup& group, int member,
                                     const char* role) const {
  const int global = group.ranks()[static_cast<size_t>(member)];
  std::string who = role;
  if (auto c = topo_.CoordOf(global); c.ok()) {
    who += " dp=" + std::to_string(c->dp);
    if (topo_.cp_size() > 1) who += " cp=" + std::to_string(c->cp);
  }
  return who + " (world rank " + std::to_string(global) + ")";
}

std::vector<uint32_t> StepRunner::Impl::ChecksumShards(ProcessGroup& group, size_t m) const {
  const std::vector<PackedShard>& shards = shards_[m];
  const bool dynamic = dynamic_;
  const int last = topo_.pp_size() - 1;
  const size_t a = static_cast<size_t>(ArraysPerShard(opts_.fields));
  std::vector<uint32_t> crcs(shards.size() * a, 0);
  // Which stages of which shard some member receives: only those arrays are summed.
  std::vector<std::array<bool, 2>> wanted(shards.size(), {false, false});
  for (int j = 1; j < group.size(); ++j) {
    auto c = topo_.CoordOf(group.ranks()[static_cast<size_t>(j)]);
    if (!c.ok()) continue;
    const size_t s = dynamic ? 0 : static_cast<size_t>(c->cp);
    if (s >= wanted.size()) continue;
    wanted[s][0] = wanted[s][0] || c->pp == 0;
    wanted[s][1] = wanted[s][1] || c->pp == last;
  }
  for (size_t s = 0; s < shards.size(); ++s) {
    size_t k = 0;
    ForEachArray(shards[s], opts_.fields, [&](bool first, bool last_stage, const char*, auto crc) {
      if ((first && wanted[s][0]) || (last_stage && wanted[s][1])) crcs[s * a + k] = crc();
      ++k;
    });
  }
  return crcs;
}

Status StepRunner::Impl::SealMeta(const StepMeta& meta) {
  ProcessGroup* group = dynamic_ ? column_.get() : replica_.get();
  if (opts_.data_on != DataOn::kTp0 || group == nullptr) return ValidateStepMeta(meta);
  StepMessage msg;
  msg.meta = meta;
  msg.after = after_;
  msg.n_loss_sequences = n_loss_sequences_;
  msg.blend = blend_;
  for (size_t f : sample_fields_) {
    msg.sample_field_bytes.push_back(static_cast<int64_t>(opts_.fields[f].row_bytes()));
  }
  msg.sequences = mb_info_;
  if (group->size() > 1) {
    msg.arrays_per_shard = ArraysPerShard(opts_.fields);
    msg.shards_per_microbatch = dynamic_ ? 1 : topo_.cp_size();
    for (size_t m = 0; m < shards_.size(); ++m) {
      if (!meta.groups.empty() && meta.groups[m].num_ranks == 0) continue;  // idle
      const std::vector<uint32_t> crcs = ChecksumShards(*group, m);
      msg.shard_checksums.insert(msg.shard_checksums.end(), crcs.begin(), crcs.end());
    }
  }
  THDPACK_ASSIGN_OR_RETURN(meta_bytes_, EncodeStepMessage(msg));
  return Status::Ok();
}

// The step message from position 0 of `group` (the loader of a replica, the head of a column)
// to every other member: its size in a size frame, agreed over the group (a member that cannot
// read the size cannot take part in the broadcast), then the message.
Status StepRunner::Impl::DeliverMeta(ProcessGroup& group) {
  std::array<uint8_t, kSizeFrameSize> size_frame{};
  if (group.rank() == 0) size_frame = EncodeSizeFrame(static_cast<int64_t>(meta_bytes_.size()));
  THDPACK_RETURN_IF_ERROR(group.BroadcastValues(std::span<uint8_t>(size_frame), 0));
  Result<int64_t> size = DecodeSizeFrame(size_frame, kStepMetaMinSize, int64_t{1} << 32);
  const std::string sender =
      "step " + std::to_string(step_) + ": received from " +
      Sender(group, 0, dynamic_ ? "head" : "loader");
  THDPACK_RETURN_IF_ERROR(AgreeIn(group, size.status().WithContext(sender), "deliver size"));
  std::vector<uint8_t> wire(static_cast<size_t>(*size));
  if (group.rank() == 0) {
    std::memcpy(wire.data(), meta_bytes_.data(), meta_bytes_.size());
    if (corrupt_metadata_of_replica_ == coord_.dp) {
      wire[wire.size() / 2] ^= 0x10;  // a test of the failure path flips one bit
    }
    return group.BroadcastValues(std::span<uint8_t>(wire), 0);
  }
  THDPACK_RETURN_IF_ERROR(group.BroadcastValues(std::span<uint8_t>(wire), 0));
  meta_bytes_ = std::move(wire);
  return Status::Ok();
}

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
  // Every array has arrived (a sender never waits on a receiver that stopped early): checked.
  const std::string sender = Sender(*replica_, 0, "loader");
  for (size_t m = 0; m < shards_.size(); ++m) {
    THDPACK_RETURN_IF_ERROR(CheckShard(shards_[m][0], m, static_cast<size_t>(coord_.cp), sender));
  }
  return Status::Ok();
}

Status StepRunner::Impl::CheckShard(const PackedShard& sh, size_t m, size_t s,
                                    const std::string& sender) const {
  const std::vector<uint32_t>& crcs = shard_checksums_[m];
  const size_t a = static_cast<size_t>(arrays_per_shard_);
  const bool first = coord_.pp == 0, last = coord_.pp == topo_.pp_size() - 1;
  Status bad;
  size_t k = 0;
  ForEachArray(sh, opts_.fields, [&](bool first_array, bool last_array, const char* name,
                                     auto crc) {
    const size_t at = s * a + k++;
    if (!bad.ok() || !((first_array && first) || (last_array && last))) return;
    const uint32_t got = crc();
    if (at >= crcs.size() || got != crcs[at]) {
      char text[64];
      std::snprintf(text, sizeof(text), "checksum 0x%08X, the step message says 0x%08X", got,
                    at < crcs.size() ? crcs[at] : 0u);
      bad = Status::Corruption("step " + std::to_string(step_) + ": shard of microbatch " +
                               std::to_string(m) + " (" + name + ", " +
                               std::to_string(sh.cp_rank) + "'s CP shard) received from " +
                               sender + ": " + text);
    }
  });
  return bad;
}

Status StepRunner::Impl::AcceptMeta(RankStep& out, const std::string& sender, bool dynamic) {
  auto msg = DecodeStepMessage(meta_bytes_);
  if (!msg.ok()) {
    return msg.status().WithContext("step " + std::to_string(step_) +
                                    " metadata received from " + sender);
  }
  const StepMeta& meta = msg->meta;
  const bool dynamic_ok = !dynamic || (!meta.groups.empty() && meta.domain_rank == DomainIndex());
  if (meta.dp_size != topo_.dp_size() || meta.replica != coord_.dp ||
      meta.parallel != opts_.schedule.parallel || meta.step != static_cast<uint64_t>(step_) ||
      !dynamic_ok) {
    const std::string where = dynamic ? "domain rank " + std::to_string(meta.domain_rank)
                                      : "replica " + std::to_string(meta.replica);
    return Status::InvalidArgument(
        "step metadata received by rank " + std::to_string(world_.rank()) +
        " does not match its topology " + topo_.ToString() + " (" + where + ", DP " +
        std::to_string(meta.dp_size) + ", " + meta.parallel.ToString() + ", step " +
        std::to_string(meta.step) + (dynamic && meta.groups.empty() ? ", no groups" : "") +
        ")");
  }
  // The sequences and shards as this rank's schema has them.
  const size_t expected_shards = dynamic ? 1 : static_cast<size_t>(topo_.cp_size());
  bool schema_ok = msg->blend == blend_ &&
                   msg->sample_field_bytes.size() == sample_fields_.size() &&
                   static_cast<size_t>(msg->shards_per_microbatch) == expected_shards &&
                   msg->arrays_per_shard == ArraysPerShard(opts_.fields);
  for (size_t k = 0; schema_ok && k < sample_fields_.size(); ++k) {
    schema_ok = msg->sample_field_bytes[k] ==
                static_cast<int64_t>(opts_.fields[sample_fields_[k]].row_bytes());
  }
  if (!schema_ok) {
    return Status::InvalidArgument(
        "step " + std::to_string(step_) + " message received by rank " +
        std::to_string(world_.rank()) + " from " + sender +
        " does not match this rank's run (blend, the sample fields' row sizes, or the shards "
        "and arrays of each microbatch): the ranks of a job must run the same options");
  }
  shard_checksums_.assign(meta.microbatches.size(), {});
  arrays_per_shard_ = msg->arrays_per_shard;
  const size_t per_mb = expected_shards * static_cast<size_t>(msg->arrays_per_shard);
  for (size_t m = 0, at = 0; m < meta.microbatches.size(); ++m) {
    if (!meta.groups.empty() && meta.groups[m].num_ranks == 0) continue;
    shard_checksums_[m].assign(msg->shard_checksums.begin() + static_cast<std::ptrdiff_t>(at),
                               msg->shard_checksums.begin() +
                                   static_cast<std::ptrdiff_t>(at + per_mb));
    at += per_mb;
  }
  after_ = std::move(msg->after);
  n_loss_sequences_ = msg->n_loss_sequences;
  mb_info_ = std::move(msg->sequences);
  out.meta = std::move(msg->meta);
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
    return Agree(local, dynamic_ ? "groups" : "media");
  }
  EndPhase(out);
  return Agree(local, "deliver");
}

}  // namespace thdpack
