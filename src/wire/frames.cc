// The step's framed messages (thdpack/step_wire.h, docs/wire_format.md "Frames"): the trailer,
// and the lengths header, the lengths, the position, the size and the groups.
#include <cstring>
#include <limits>
#include <string>

#include "thdpack/step_wire.h"
#include "wire/coding.h"
#include "wire/position.h"
#include "wire/step_meta_body.h"

namespace thdpack {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string Num(int64_t v) { return std::to_string(v); }

int32_t GetInt32(const uint8_t* p) { return static_cast<int32_t>(wire::DecodeFixed32(p)); }

std::string Name(FrameKind kind) { return std::string(FrameKindName(kind)); }

Status Bad(FrameKind kind, const std::string& what) {
  return Status::Corruption(Name(kind) + ": " + what);
}

}  // namespace

std::string_view FrameKindName(FrameKind kind) {
  switch (kind) {
    case FrameKind::kLengthsHeader: return "lengths header";
    case FrameKind::kLengths: return "lengths";
    case FrameKind::kPosition: return "position";
    case FrameKind::kSamples: return "samples";
    case FrameKind::kSize: return "size";
    case FrameKind::kGroups: return "groups";
    case FrameKind::kJob: return "job";
    case FrameKind::kMedia: return "media";
  }
  return "unknown frame";
}

void SealFrame(FrameKind kind, std::span<uint8_t> frame) {
  uint8_t* t = frame.data() + frame.size() - kFrameTrailerSize;
  t[0] = static_cast<uint8_t>(kind);
  t[1] = kStepWireVersion;
  t[2] = 0;
  t[3] = 0;
  wire::EncodeFixed32(t + 4, Crc32c(frame.first(frame.size() - 4)));
}

void AppendFrameTrailer(FrameKind kind, std::vector<uint8_t>* body) {
  body->resize(body->size() + kFrameTrailerSize);
  SealFrame(kind, *body);
}

Result<std::span<const uint8_t>> OpenFrame(std::span<const uint8_t> frame, FrameKind kind) {
  if (frame.size() < kFrameTrailerSize) {
    return Bad(kind, Num(int64_t(frame.size())) + " bytes, shorter than a frame's trailer (" +
                         Num(int64_t(kFrameTrailerSize)) + "): truncated");
  }
  const size_t body = frame.size() - kFrameTrailerSize;
  const uint32_t stored = wire::DecodeFixed32(frame.data() + frame.size() - 4);
  const uint32_t actual = Crc32c(frame.first(frame.size() - 4));
  if (stored != actual) {
    return Bad(kind, "checksum mismatch over " + Num(int64_t(frame.size())) +
                         " bytes: trailer says " + wire::Hex32(stored) + ", bytes give " +
                         wire::Hex32(actual));
  }
  // The checksum holds: the trailer is what the sender wrote.
  const uint8_t* t = frame.data() + body;
  if (t[0] != static_cast<uint8_t>(kind)) {
    const std::string got = t[0] >= 1 && t[0] <= 8
                                ? "a " + Name(static_cast<FrameKind>(t[0])) + " frame"
                                : "kind " + Num(t[0]);
    return Bad(kind, "byte " + Num(int64_t(body)) + ": " + got + " in its place");
  }
  if (t[1] == 0 || t[1] < kStepWireVersion) {
    return Bad(kind, "byte " + Num(int64_t(body + 1)) + ": version " + Num(t[1]) +
                         " (frames start at version " + Num(kStepWireVersion) + ")");
  }
  if (t[1] > kStepWireVersion) {
    return Status::Unimplemented(Name(kind) + ": version " + Num(t[1]) +
                                 " is newer than this reader's " + Num(kStepWireVersion) +
                                 "; every rank of a job must run the same thdpack");
  }
  if (t[2] != 0 || t[3] != 0) {
    return Bad(kind, "byte " + Num(int64_t(body + 2)) + ": reserved bytes not zero");
  }
  return frame.first(body);
}

// ---- lengths header ----

std::array<uint8_t, kLengthsHeaderFrameSize> EncodeLengthsHeader(const LengthsHeader& h) {
  std::array<uint8_t, kLengthsHeaderFrameSize> out{};
  const int64_t v[8] = {h.count,          h.first_id,          h.id_span,
                        h.epoch,          h.position_bytes,    h.truncated_samples,
                        h.truncated_tokens, h.truncated_targets};
  for (int i = 0; i < 8; ++i) wire::EncodeFixed64(out.data() + 8 * i, v[i]);
  SealFrame(FrameKind::kLengthsHeader, out);
  return out;
}

Result<LengthsHeader> DecodeLengthsHeader(std::span<const uint8_t> frame) {
  constexpr FrameKind kKind = FrameKind::kLengthsHeader;
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, kKind));
  if (body.size() != 64) {
    return Bad(kKind, "a body of " + Num(int64_t(body.size())) + " bytes, not 64");
  }
  LengthsHeader h;
  int64_t* fields[8] = {&h.count,          &h.first_id,          &h.id_span,
                        &h.epoch,          &h.position_bytes,    &h.truncated_samples,
                        &h.truncated_tokens, &h.truncated_targets};
  const char* names[8] = {"count", "first_id", "id_span", "epoch", "position_bytes",
                          "truncated_samples", "truncated_tokens", "truncated_targets"};
  // [min, max] of each; first_id is any int64.
  const int64_t lo[8] = {0, INT64_MIN, 0, 0, 0, 0, 0, 0};
  const int64_t hi[8] = {int64_t{1} << 40, INT64_MAX, INT64_MAX, INT64_MAX, int64_t{1} << 26,
                         INT64_MAX, INT64_MAX, INT64_MAX};
  for (int i = 0; i < 8; ++i) {
    *fields[i] = wire::DecodeFixed64(body.data() + 8 * i);
    if (*fields[i] < lo[i] || *fields[i] > hi[i]) {
      return Bad(kKind, "byte " + Num(8 * i) + " (" + names[i] + "): " + Num(*fields[i]) +
                            " is outside [" + Num(lo[i]) + ", " + Num(hi[i]) + "]");
    }
  }
  return h;
}

// ---- lengths ----

size_t RecordBytes(RecordColumns columns) {
  return 12 + (columns.source ? 4 : 0) + (columns.group ? 8 : 0) + (columns.media ? 16 : 0);
}

size_t LengthsFrameSize(int64_t count, RecordColumns columns) {
  return static_cast<size_t>(count) * RecordBytes(columns) + kFrameTrailerSize;
}

void EncodeLengths(std::span<const SampleRecord> records, RecordColumns columns,
                   std::vector<uint8_t>* out) {
  const size_t start = out->size();
  out->resize(start + LengthsFrameSize(static_cast<int64_t>(records.size()), columns));
  uint8_t* p = out->data() + start;
  for (const SampleRecord& x : records) {
    wire::EncodeFixed32(p, static_cast<uint32_t>(x.offset));
    wire::EncodeFixed32(p + 4, static_cast<uint32_t>(x.length));
    wire::EncodeFixed32(p + 8, static_cast<uint32_t>(x.n_targets));
    p += 12;
    if (columns.source) {
      wire::EncodeFixed32(p, static_cast<uint32_t>(x.source));
      p += 4;
    }
    if (columns.group) {
      const uint64_t g = static_cast<uint64_t>(x.group);
      wire::EncodeFixed32(p, static_cast<uint32_t>(g));
      wire::EncodeFixed32(p + 4, static_cast<uint32_t>(g >> 32));
      p += 8;
    }
    if (columns.media) {
      for (const int64_t v : {x.encoder.patches, x.encoder.frame_sq}) {
        const uint64_t u = static_cast<uint64_t>(v);
        wire::EncodeFixed32(p, static_cast<uint32_t>(u));
        wire::EncodeFixed32(p + 4, static_cast<uint32_t>(u >> 32));
        p += 8;
      }
    }
  }
  SealFrame(FrameKind::kLengths, std::span<uint8_t>(out->data() + start, out->size() - start));
}

Status DecodeLengths(std::span<const uint8_t> frame, RecordColumns columns, int64_t id_span,
                     std::vector<SampleRecord>* out) {
  constexpr FrameKind kKind = FrameKind::kLengths;
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, kKind));
  const size_t per = RecordBytes(columns);
  if (body.size() % per != 0) {
    return Bad(kKind, "a body of " + Num(int64_t(body.size())) + " bytes is not whole records of " +
                          Num(int64_t(per)) + " bytes");
  }
  const size_t n = body.size() / per;
  out->reserve(out->size() + n);
  const uint8_t* p = body.data();
  for (size_t k = 0; k < n; ++k, p += per) {
    SampleRecord x;
    x.offset = GetInt32(p);
    x.length = GetInt32(p + 4);
    x.n_targets = GetInt32(p + 8);
    const std::string at = "record " + Num(int64_t(k)) + " (byte " + Num(int64_t(k * per)) + ")";
    if (x.offset < 0 || x.offset >= id_span) {
      return Bad(kKind, at + ": id offset " + Num(x.offset) + " is outside the step's ids [0, " +
                            Num(id_span) + ")");
    }
    if (x.length < 1) return Bad(kKind, at + ": length " + Num(x.length) + " is below 1");
    if (x.n_targets < 0 || x.n_targets > x.length - 1) {
      return Bad(kKind, at + ": n_targets " + Num(x.n_targets) + " is outside [0, L - 1 = " +
                            Num(x.length - 1) + "]");
    }
    if (columns.source) {
      x.source = GetInt32(p + 12);
      if (x.source < 0) return Bad(kKind, at + ": source " + Num(x.source) + " is negative");
    }
    if (columns.group) {
      const size_t g = columns.source ? 16 : 12;
      x.group = static_cast<int64_t>(
          static_cast<uint64_t>(wire::DecodeFixed32(p + g)) |
          (static_cast<uint64_t>(wire::DecodeFixed32(p + g + 4)) << 32));
    }
    if (columns.media) {
      const uint8_t* q = p + 12 + (columns.source ? 4 : 0) + (columns.group ? 8 : 0);
      auto get64 = [](const uint8_t* at) {
        return static_cast<int64_t>(static_cast<uint64_t>(wire::DecodeFixed32(at)) |
                                    (static_cast<uint64_t>(wire::DecodeFixed32(at + 4)) << 32));
      };
      x.encoder.patches = get64(q);
      x.encoder.frame_sq = get64(q + 8);
      constexpr int64_t kLimit = int64_t{1} << 62;  // SampleEncoderWork's bound
      if (x.encoder.patches < 0 || x.encoder.patches >= kLimit || x.encoder.frame_sq < 0 ||
          x.encoder.frame_sq >= kLimit) {
        return Bad(kKind, at + ": encoder work (" + Num(x.encoder.patches) + " patches, " +
                              Num(x.encoder.frame_sq) + " frame^2) is outside [0, 2^62)");
      }
    }
    out->push_back(x);
  }
  return Status::Ok();
}

// ---- position ----

std::vector<uint8_t> EncodePositionFrame(const StepPosition& position) {
  std::vector<uint8_t> out;
  wire::AppendPosition(position, &out);
  AppendFrameTrailer(FrameKind::kPosition, &out);
  return out;
}

Result<StepPosition> DecodePositionFrame(std::span<const uint8_t> frame) {
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, FrameKind::kPosition));
  wire::ByteReader r(body);
  StepPosition p;
  THDPACK_RETURN_IF_ERROR(wire::ReadPosition(r, 0, "position", &p));
  if (r.remaining() != 0) {
    return Bad(FrameKind::kPosition,
               Num(int64_t(r.remaining())) + " bytes left over after the position");
  }
  return p;
}

// ---- size ----

std::array<uint8_t, kSizeFrameSize> EncodeSizeFrame(int64_t size) {
  std::array<uint8_t, kSizeFrameSize> out{};
  wire::EncodeFixed64(out.data(), size);
  SealFrame(FrameKind::kSize, out);
  return out;
}

Result<int64_t> DecodeSizeFrame(std::span<const uint8_t> frame, int64_t min, int64_t max) {
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, FrameKind::kSize));
  if (body.size() != 8) {
    return Bad(FrameKind::kSize, "a body of " + Num(int64_t(body.size())) + " bytes, not 8");
  }
  const int64_t v = wire::DecodeFixed64(body.data());
  if (v < min || v > max) {
    return Bad(FrameKind::kSize, Num(v) + " bytes is outside [" + Num(min) + ", " + Num(max) + "]");
  }
  return v;
}

// ---- groups ----

std::vector<uint8_t> EncodeGroupsFrame(std::span<const std::pair<int, int>> groups) {
  std::vector<uint8_t> out;
  wire::PutVarint64(&out, groups.size());
  for (const auto& [first, size] : groups) {
    wire::PutVarint64(&out, static_cast<uint64_t>(first));
    wire::PutVarint64(&out, static_cast<uint64_t>(size));
  }
  AppendFrameTrailer(FrameKind::kGroups, &out);
  return out;
}

Result<std::vector<std::pair<int, int>>> DecodeGroupsFrame(std::span<const uint8_t> frame,
                                                           int64_t domain) {
  constexpr FrameKind kKind = FrameKind::kGroups;
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, kKind));
  wire::ByteReader r(body);
  uint64_t count = 0;
  if (!r.GetVarint64(&count) || count > r.remaining() / 2) {
    return Bad(kKind, "byte 0 (count): a bad varint or more groups than the bytes hold");
  }
  std::vector<std::pair<int, int>> groups(count);
  for (size_t k = 0; k < count; ++k) {
    const size_t at = r.position();
    uint64_t first = 0, size = 0;
    if (!r.GetVarint64(&first) || !r.GetVarint64(&size) || first > kInt32Max ||
        size > kInt32Max) {
      return Bad(kKind, "byte " + Num(int64_t(at)) + " (group " + Num(int64_t(k)) +
                            "): a truncated or out-of-range varint");
    }
    const std::pair<int, int> g{static_cast<int>(first), static_cast<int>(size)};
    if (size < 1 || static_cast<int64_t>(first + size) > domain) {
      return Bad(kKind, "byte " + Num(int64_t(at)) + " (group " + Num(int64_t(k)) + "): ranks [" +
                            Num(g.first) + ", +" + Num(g.second) + ") outside the domain of " +
                            Num(domain) + " ranks");
    }
    if (k > 0 && !(groups[k - 1] < g)) {
      return Bad(kKind, "byte " + Num(int64_t(at)) + " (group " + Num(int64_t(k)) +
                            "): not after the group before it (increasing, no repeats)");
    }
    groups[k] = g;
  }
  if (r.remaining() != 0) {
    return Bad(kKind, Num(int64_t(r.remaining())) + " bytes left over after the groups");
  }
  return groups;
}

// ---- job ----

std::vector<uint8_t> EncodeJobFrame(std::span<const JobEntry> entries) {
  std::vector<uint8_t> out;
  auto put = [&out](const std::string& text) {
    wire::PutVarint64(&out, text.size());
    out.insert(out.end(), text.begin(), text.end());
  };
  wire::PutVarint64(&out, entries.size());
  for (const auto& [name, value] : entries) {
    put(name);
    put(value);
  }
  AppendFrameTrailer(FrameKind::kJob, &out);
  return out;
}

Result<std::vector<JobEntry>> DecodeJobFrame(std::span<const uint8_t> frame) {
  constexpr FrameKind kKind = FrameKind::kJob;
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, kKind));
  wire::ByteReader r(body);
  uint64_t count = 0;
  if (!r.GetVarint64(&count) || count > static_cast<uint64_t>(kMaxJobEntries) ||
      count > r.remaining() / 2) {
    return Bad(kKind, "byte 0 (count): a bad varint, more than " + Num(kMaxJobEntries) +
                          " entries, or more than the bytes hold");
  }
  std::vector<JobEntry> entries(count);
  for (size_t k = 0; k < count; ++k) {
    for (std::string* text : {&entries[k].first, &entries[k].second}) {
      const size_t at = r.position();
      uint64_t n = 0;
      if (!r.GetVarint64(&n) || n > static_cast<uint64_t>(kMaxJobText) || n > r.remaining()) {
        return Bad(kKind, "byte " + Num(int64_t(at)) + " (entry " + Num(int64_t(k)) +
                              "): a bad length or one past the bytes");
      }
      const std::span<const uint8_t> bytes = r.rest().first(n);
      text->assign(bytes.begin(), bytes.end());
      r.Skip(n);
    }
  }
  if (r.remaining() != 0) {
    return Bad(kKind, Num(int64_t(r.remaining())) + " bytes left over after the entries");
  }
  return entries;
}

}  // namespace thdpack
