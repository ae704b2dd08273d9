// The step message (thdpack/step_wire.h): THDM version 4, the metadata with the run's position,
// the microbatches' sequences and the shards' checksums under one CRC-32C
// (docs/wire_format.md, "Body, version 4").
#include <limits>
#include <string>
#include <utility>

#include "thdpack/step_wire.h"
#include "wire/coding.h"
#include "wire/position.h"
#include "wire/step_meta_body.h"

namespace thdpack {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr uint8_t kSeqFlagSources = 0x01;

std::string Num(int64_t v) { return std::to_string(v); }

Status Invalid(std::string msg) { return Status::InvalidArgument(std::move(msg)); }

// Microbatch m holds sequences: a static step's always, a dynamic step's unless idle.
bool Busy(const StepMeta& meta, size_t m) {
  return meta.groups.empty() || meta.groups[m].num_ranks > 0;
}

size_t BusyCount(const StepMeta& meta) {
  size_t n = 0;
  for (size_t m = 0; m < meta.microbatches.size(); ++m) n += Busy(meta, m) ? 1 : 0;
  return n;
}

// Real length of sequence i of microbatch `mb`.
int64_t LengthOf(const MicrobatchMeta& mb, size_t i) {
  return int64_t{mb.cu_seqlens[i + 1]} - mb.cu_seqlens[i];
}

}  // namespace

std::span<const uint32_t> StepMessage::ShardChecksums(size_t m, size_t s) const {
  size_t busy_before = 0;
  for (size_t k = 0; k < m; ++k) busy_before += Busy(meta, k) ? 1 : 0;
  const size_t a = static_cast<size_t>(arrays_per_shard);
  const size_t at = (busy_before * static_cast<size_t>(shards_per_microbatch) + s) * a;
  return std::span<const uint32_t>(shard_checksums).subspan(at, a);
}

Status ValidateStepMessage(const StepMessage& msg) {
  THDPACK_RETURN_IF_ERROR(ValidateStepMeta(msg.meta));
  if (msg.after.consumed < 0) {
    return Invalid("StepMessage.after.consumed = " + Num(msg.after.consumed) + ": must be >= 0");
  }
  if (msg.after.cursor) {
    if (Status s = CheckSourceCursor(*msg.after.cursor, "after.cursor"); !s.ok()) {
      return Invalid("StepMessage: " + s.message());
    }
  }
  if (msg.n_loss_sequences < 0) {
    return Invalid("StepMessage.n_loss_sequences = " + Num(msg.n_loss_sequences) +
                   ": must be >= 0");
  }
  for (size_t f = 0; f < msg.sample_field_bytes.size(); ++f) {
    const int64_t b = msg.sample_field_bytes[f];
    if (b < 1 || b > kInt32Max) {
      return Invalid("StepMessage.sample_field_bytes[" + Num(int64_t(f)) + "] = " + Num(b) +
                     ": a row takes [1, 2^31 - 1] bytes");
    }
  }
  const size_t num_mb = msg.meta.microbatches.size();
  if (msg.sequences.size() != num_mb) {
    return Invalid("StepMessage.sequences has " + Num(int64_t(msg.sequences.size())) +
                   " entries for " + Num(int64_t(num_mb)) + " microbatches");
  }
  for (size_t m = 0; m < num_mb; ++m) {
    const MicrobatchMeta& mb = msg.meta.microbatches[m];
    const MicrobatchSequences& q = msg.sequences[m];
    const std::string at = "StepMessage.sequences[" + Num(int64_t(m)) + "].";
    const size_t n = mb.cu_seqlens.size() - 1;  // 0 when idle
    const size_t fields = Busy(msg.meta, m) ? msg.sample_field_bytes.size() : 0;
    if (q.ids.size() != n || q.n_targets.size() != n || q.sources.size() != (msg.blend ? n : 0) ||
        q.sample_fields.size() != fields) {
      return Invalid(at + "ids, n_targets, sources, sample_fields: " +
                     Num(int64_t(q.ids.size())) + ", " + Num(int64_t(q.n_targets.size())) +
                     ", " + Num(int64_t(q.sources.size())) + ", " +
                     Num(int64_t(q.sample_fields.size())) + " entries for " + Num(int64_t(n)) +
                     " sequences (sources with a blend only; one list per sample field of a "
                     "busy microbatch)");
    }
    for (size_t i = 0; i < n; ++i) {
      if (q.n_targets[i] < 0 || q.n_targets[i] > LengthOf(mb, i) - 1) {
        return Invalid(at + "n_targets[" + Num(int64_t(i)) + "] = " + Num(q.n_targets[i]) +
                       ": must be in [0, L - 1 = " + Num(LengthOf(mb, i) - 1) + "]");
      }
      if (msg.blend && q.sources[i] < 0) {
        return Invalid(at + "sources[" + Num(int64_t(i)) + "] = " + Num(q.sources[i]) +
                       ": must be >= 0");
      }
    }
    for (size_t f = 0; f < fields; ++f) {
      const uint64_t want = n * static_cast<uint64_t>(msg.sample_field_bytes[f]);
      if (q.sample_fields[f].size() != want) {
        return Invalid(at + "sample_fields[" + Num(int64_t(f)) + "] has " +
                       Num(int64_t(q.sample_fields[f].size())) + " bytes, not " +
                       Num(int64_t(want)) + " (a row of " + Num(msg.sample_field_bytes[f]) +
                       " bytes per sequence)");
      }
    }
  }
  if (msg.shards_per_microbatch < 0 || msg.arrays_per_shard < 0) {
    return Invalid("StepMessage.shards_per_microbatch = " + Num(msg.shards_per_microbatch) +
                   ", arrays_per_shard = " + Num(msg.arrays_per_shard) + ": must be >= 0");
  }
  const uint64_t want = BusyCount(msg.meta) * static_cast<uint64_t>(msg.shards_per_microbatch) *
                        static_cast<uint64_t>(msg.arrays_per_shard);
  if (msg.shard_checksums.size() != want) {
    return Invalid("StepMessage.shard_checksums has " + Num(int64_t(msg.shard_checksums.size())) +
                   " entries, not busy microbatches x shards_per_microbatch x arrays_per_shard "
                   "= " + Num(int64_t(want)));
  }
  return Status::Ok();
}

Result<std::vector<uint8_t>> EncodeStepMessage(const StepMessage& msg) {
  THDPACK_RETURN_IF_ERROR(ValidateStepMessage(msg));
  std::vector<uint8_t> out;
  size_t payload = 96 + 4 * msg.shard_checksums.size();
  for (const MicrobatchSequences& q : msg.sequences) {
    payload += 12 * q.ids.size();
    for (const auto& rows : q.sample_fields) payload += rows.size();
  }
  out.reserve(payload);
  wire::StartMessage(kStepMessageVersion, &out);
  THDPACK_RETURN_IF_ERROR(wire::AppendStepMetaBody(msg.meta, kStepMessageVersion, &out));
  wire::AppendPosition(msg.after, &out);
  wire::PutVarint64(&out, static_cast<uint64_t>(msg.n_loss_sequences));
  out.push_back(msg.blend ? kSeqFlagSources : 0);
  wire::PutVarint64(&out, msg.sample_field_bytes.size());
  for (int64_t b : msg.sample_field_bytes) wire::PutVarint64(&out, static_cast<uint64_t>(b));
  uint64_t prev = 0;  // the ids as differences, across microbatches, modulo 2^64
  for (size_t m = 0; m < msg.sequences.size(); ++m) {
    const MicrobatchSequences& q = msg.sequences[m];
    const MicrobatchMeta& mb = msg.meta.microbatches[m];
    for (int64_t id : q.ids) {
      wire::PutVarint64(&out, wire::ZigZagEncode(static_cast<int64_t>(
                                  static_cast<uint64_t>(id) - prev)));
      prev = static_cast<uint64_t>(id);
    }
    // n_targets as its deficit from L - 1, so pretraining (every position a target) is 0.
    for (size_t i = 0; i < q.n_targets.size(); ++i) {
      wire::PutVarint64(&out, static_cast<uint64_t>(LengthOf(mb, i) - 1 - q.n_targets[i]));
    }
    for (int32_t s : q.sources) wire::PutVarint64(&out, static_cast<uint64_t>(s));
    for (const auto& rows : q.sample_fields) {
      const auto* p = reinterpret_cast<const uint8_t*>(rows.data());
      out.insert(out.end(), p, p + rows.size());
    }
  }
  wire::PutVarint64(&out, static_cast<uint64_t>(msg.arrays_per_shard));
  wire::PutVarint64(&out, static_cast<uint64_t>(msg.shards_per_microbatch));
  for (uint32_t c : msg.shard_checksums) wire::PutFixed32(&out, c);
  THDPACK_RETURN_IF_ERROR(wire::SealMessage(&out, "EncodeStepMessage"));
  return out;
}

namespace {

// The body after the metadata part. Errors: "step message: byte N (field): rule", N in the
// whole message.
class RestDecoder {
 public:
  RestDecoder(wire::ByteReader& r, StepMessage* msg) : r_(r), msg_(*msg) {}

  Status Decode() {
    THDPACK_RETURN_IF_ERROR(
        wire::ReadPosition(r_, kStepMetaHeaderSize, "step message", &msg_.after));
    uint64_t v = 0;
    THDPACK_RETURN_IF_ERROR(Varint("n_loss_sequences", INT64_MAX, &v));
    msg_.n_loss_sequences = static_cast<int64_t>(v);
    uint8_t flags = 0;
    if (!r_.GetByte(&flags)) return Error(r_.position(), "sequence flags", "truncated");
    if ((flags & ~kSeqFlagSources) != 0) {
      return Error(r_.position() - 1, "sequence flags", "unknown bits set in " + Num(flags));
    }
    msg_.blend = (flags & kSeqFlagSources) != 0;
    uint64_t num_fields = 0;
    THDPACK_RETURN_IF_ERROR(Varint("num_sample_fields", r_.remaining(), &num_fields));
    msg_.sample_field_bytes.resize(num_fields);
    for (size_t f = 0; f < num_fields; ++f) {
      const size_t at = r_.position();
      THDPACK_RETURN_IF_ERROR(Varint("sample_field_bytes", kInt32Max, &v));
      if (v == 0) return Error(at, "sample_field_bytes", "is 0: a row takes at least a byte");
      msg_.sample_field_bytes[f] = static_cast<int64_t>(v);
    }
    const StepMeta& meta = msg_.meta;
    msg_.sequences.resize(meta.microbatches.size());
    uint64_t prev = 0;
    for (size_t m = 0; m < meta.microbatches.size(); ++m) {
      if (!Busy(meta, m)) continue;  // idle: no sequences
      THDPACK_RETURN_IF_ERROR(Sequences(m, &prev));
    }
    uint64_t arrays = 0, shards = 0;
    THDPACK_RETURN_IF_ERROR(Varint("arrays_per_shard", kInt32Max, &arrays));
    THDPACK_RETURN_IF_ERROR(Varint("shards_per_microbatch", kInt32Max, &shards));
    msg_.arrays_per_shard = static_cast<int32_t>(arrays);
    msg_.shards_per_microbatch = static_cast<int32_t>(shards);
    // Exactly the checksums left: the count is checked against the bytes before allocating.
    const uint64_t busy = BusyCount(meta);
    const uint64_t words = r_.remaining() / 4;
    const bool fits = busy == 0 || arrays == 0 || shards == 0 ||
                      (busy <= words && shards <= words && arrays <= words &&
                       busy * shards <= words / arrays);
    if (!fits || busy * shards * arrays * 4 != r_.remaining()) {
      return Error(r_.position(), "shard_checksums",
                   Num(int64_t(busy)) + " busy microbatches x " + Num(int64_t(shards)) +
                       " shards x " + Num(int64_t(arrays)) + " arrays do not make the " +
                       Num(int64_t(r_.remaining())) + " bytes left (4 a checksum)");
    }
    msg_.shard_checksums.resize(static_cast<size_t>(busy * shards * arrays));
    for (uint32_t& c : msg_.shard_checksums) {
      c = wire::DecodeFixed32(r_.rest().data());
      r_.Skip(4);
    }
    return Status::Ok();
  }

 private:
  Status Error(size_t at, const std::string& field, const std::string& rule) const {
    return Status::Corruption("step message: byte " + Num(int64_t(kStepMetaHeaderSize + at)) +
                              " (" + field + "): " + rule);
  }
  Status Varint(const std::string& field, uint64_t max, uint64_t* v) {
    const size_t at = r_.position();
    if (!r_.GetVarint64(v)) return Error(at, field, "truncated or over-long varint");
    if (*v > max) {
      return Error(at, field, "value " + std::to_string(*v) + " exceeds its limit " +
                                  std::to_string(max));
    }
    return Status::Ok();
  }

  // Microbatch m's n sequences: ids, deficits, sources, sample field rows.
  Status Sequences(size_t m, uint64_t* prev) {
    const MicrobatchMeta& mb = msg_.meta.microbatches[m];
    MicrobatchSequences& q = msg_.sequences[m];
    const size_t n = mb.cu_seqlens.size() - 1;
    const std::string at = "sequences[" + Num(int64_t(m)) + "].";
    // Before allocating: a byte at least per id, deficit and source, and the field rows whole.
    uint64_t need = n * (msg_.blend ? 3u : 2u);
    for (int64_t b : msg_.sample_field_bytes) {
      if (need > r_.remaining()) break;
      need += n * static_cast<uint64_t>(b);  // n, b < 2^31: no overflow
    }
    if (need > r_.remaining()) {
      return Error(r_.position(), at + "ids",
                   Num(int64_t(n)) + " sequences need at least " + Num(int64_t(need)) +
                       " bytes but only " + Num(int64_t(r_.remaining())) + " remain");
    }
    q.ids.resize(n);
    q.n_targets.resize(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) {
      THDPACK_RETURN_IF_ERROR(Varint(at + "ids", UINT64_MAX, &v));
      *prev += static_cast<uint64_t>(wire::ZigZagDecode(v));  // wraps, as the encoder's delta
      q.ids[i] = static_cast<int64_t>(*prev);
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t most = LengthOf(mb, i) - 1;
      THDPACK_RETURN_IF_ERROR(Varint(at + "n_targets (deficit from L - 1)",
                                     static_cast<uint64_t>(most), &v));
      q.n_targets[i] = most - static_cast<int64_t>(v);
    }
    if (msg_.blend) {
      q.sources.resize(n);
      for (size_t i = 0; i < n; ++i) {
        THDPACK_RETURN_IF_ERROR(Varint(at + "sources", kInt32Max, &v));
        q.sources[i] = static_cast<int32_t>(v);
      }
    }
    q.sample_fields.resize(msg_.sample_field_bytes.size());
    for (size_t f = 0; f < q.sample_fields.size(); ++f) {
      const size_t bytes = n * static_cast<size_t>(msg_.sample_field_bytes[f]);
      // The bound above counted a byte a varint: longer ones may have taken the rows' bytes.
      if (bytes > r_.remaining()) {
        return Error(r_.position(), at + "sample_fields[" + Num(int64_t(f)) + "]",
                     Num(int64_t(n)) + " rows need " + Num(int64_t(bytes)) + " bytes but only " +
                         Num(int64_t(r_.remaining())) + " remain");
      }
      const auto* p = reinterpret_cast<const std::byte*>(r_.rest().data());
      q.sample_fields[f].assign(p, p + bytes);
      r_.Skip(bytes);
    }
    return Status::Ok();
  }

  wire::ByteReader& r_;
  StepMessage& msg_;
};

}  // namespace

Result<StepMessage> DecodeStepMessage(std::span<const uint8_t> bytes) {
  THDPACK_ASSIGN_OR_RETURN(const uint8_t version, wire::OpenMessage(bytes, "step message"));
  if (version != kStepMessageVersion) {
    return Status::Corruption("step message: byte 4: version " + std::to_string(version) +
                              " is a step's metadata alone (EncodeStepMeta), without the "
                              "sequences and position a step message (version 4) carries");
  }
  wire::ByteReader r(bytes.subspan(kStepMetaHeaderSize, bytes.size() - 4 - kStepMetaHeaderSize));
  StepMessage msg;
  THDPACK_ASSIGN_OR_RETURN(msg.meta, wire::ReadStepMetaBody(r, version, "step message"));
  if (Status s = ValidateStepMeta(msg.meta); !s.ok()) {
    return Status::Corruption("step message: decoded metadata breaks a rule: " + s.message());
  }
  RestDecoder rest(r, &msg);
  THDPACK_RETURN_IF_ERROR(rest.Decode());
  if (Status s = ValidateStepMessage(msg); !s.ok()) {
    return Status::Corruption("step message: decoded values break a rule: " + s.message());
  }
  return msg;
}

}  // namespace thdpack
