// fuzz/step_wire_checks.h: the properties the fuzz targets of the step's messages
// (thdpack/step_wire.h) check on every input.
//
// An input is a control byte and the message. Control bit 0 reseals the message first - a step
// message's magic, version 4, total_length and CRC-32C, a frame's trailer (its kind, version 4,
// zero bytes and CRC-32C) - so that mutations reach the body decoders; without it the bytes are
// decoded as they came. Every decoder must return a Status for any bytes (never crash, never
// read outside them), fail only with Corruption or Unimplemented and a message, and what it
// accepts must be valid, survive a round trip through its encoder, and (for the fixed-width
// frames) re-encode to the very bytes it read.
//
// Thread-safety: pure functions.
#ifndef THDPACK_FUZZ_STEP_WIRE_CHECKS_H_
#define THDPACK_FUZZ_STEP_WIRE_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "thdpack/step_wire.h"
#include "wire/coding.h"

namespace thdpack::fuzz {

struct Input {
  uint8_t control = 0;
  std::vector<uint8_t> bytes;
};

inline Input Split(const uint8_t* data, size_t size) {
  Input in;
  if (size == 0) return in;
  in.control = data[0];
  in.bytes.assign(data + 1, data + size);
  return in;
}

// A frame's trailer rewritten for `kind` (when the bytes hold one).
inline void ResealFrame(FrameKind kind, std::vector<uint8_t>* frame) {
  if (frame->size() >= kFrameTrailerSize) SealFrame(kind, *frame);
}

inline void CheckError(const Status& s, const char* who) {
  FUZZ_CHECK(s.code() == StatusCode::kCorruption || s.code() == StatusCode::kUnimplemented,
             std::string(who) + " failed with an unexpected code: " + Describe(s));
  FUZZ_CHECK(!s.message().empty(), std::string(who) + ": an error without a message");
}

inline void CheckStepMessage(Input in) {
  std::vector<uint8_t>& msg = in.bytes;
  if ((in.control & 1) && msg.size() >= kStepMetaMinSize && msg.size() <= UINT32_MAX) {
    for (int i = 0; i < 4; ++i) msg[static_cast<size_t>(i)] = kStepMetaMagic[i];
    msg[4] = kStepMessageVersion;
    wire::EncodeFixed32(msg.data() + 5, static_cast<uint32_t>(msg.size()));
    wire::EncodeFixed32(msg.data() + msg.size() - 4,
                        Crc32c(std::span<const uint8_t>(msg.data(), msg.size() - 4)));
  }
  Result<StepMessage> decoded = DecodeStepMessage(msg);
  if (!decoded.ok()) return CheckError(decoded.status(), "DecodeStepMessage");
  const Status valid = ValidateStepMessage(*decoded);
  FUZZ_CHECK(valid.ok(), "DecodeStepMessage accepted an invalid message: " + Describe(valid));
  Result<std::vector<uint8_t>> encoded = EncodeStepMessage(*decoded);
  FUZZ_CHECK(encoded.ok(), "EncodeStepMessage refused a decoded message: " +
                               Describe(encoded.status()));
  Result<StepMessage> again = DecodeStepMessage(*encoded);
  FUZZ_CHECK(again.ok() && *again == *decoded, "decode(encode(decode(x))) != decode(x)");
  FUZZ_CHECK(EncodeStepMessage(*again).value() == *encoded, "the encoding is not a fixed point");
  // The metadata reader reads the same metadata from it.
  Result<StepMeta> meta = DecodeStepMeta(msg);
  FUZZ_CHECK(meta.ok() && *meta == decoded->meta, "DecodeStepMeta disagrees on a step message");
}

inline void CheckPositionFrame(Input in) {
  if (in.control & 1) ResealFrame(FrameKind::kPosition, &in.bytes);
  Result<StepPosition> decoded = DecodePositionFrame(in.bytes);
  if (!decoded.ok()) return CheckError(decoded.status(), "DecodePositionFrame");
  if (decoded->cursor) {
    const Status valid = CheckSourceCursor(*decoded->cursor, "cursor");
    FUZZ_CHECK(valid.ok(), "an accepted cursor breaks a rule: " + Describe(valid));
  }
  const std::vector<uint8_t> encoded = EncodePositionFrame(*decoded);
  Result<StepPosition> again = DecodePositionFrame(encoded);
  FUZZ_CHECK(again.ok() && *again == *decoded, "decode(encode(decode(x))) != decode(x)");
  FUZZ_CHECK(EncodePositionFrame(*again) == encoded, "the encoding is not a fixed point");
}

// Control bit 1: a lengths header (else lengths records); bits 2 and 3: the records' source and
// group columns; the records' id span is 1000.
inline void CheckLengthsFrame(Input in) {
  const bool header = (in.control & 2) != 0;
  if (in.control & 1) {
    ResealFrame(header ? FrameKind::kLengthsHeader : FrameKind::kLengths, &in.bytes);
  }
  if (header) {
    Result<LengthsHeader> h = DecodeLengthsHeader(in.bytes);
    if (!h.ok()) return CheckError(h.status(), "DecodeLengthsHeader");
    const auto encoded = EncodeLengthsHeader(*h);
    FUZZ_CHECK(std::vector<uint8_t>(encoded.begin(), encoded.end()) == in.bytes,
               "an accepted lengths header re-encodes to other bytes");
    return;
  }
  const RecordColumns columns{(in.control & 4) != 0, (in.control & 8) != 0,
                              (in.control & 16) != 0};
  std::vector<SampleRecord> records;
  const Status s = DecodeLengths(in.bytes, columns, 1000, &records);
  if (!s.ok()) return CheckError(s, "DecodeLengths");
  for (const SampleRecord& x : records) {
    FUZZ_CHECK(x.offset >= 0 && x.offset < 1000 && x.length >= 1 && x.n_targets >= 0 &&
                   x.n_targets <= x.length - 1 && x.source >= 0 && x.encoder.patches >= 0 &&
                   x.encoder.frame_sq >= 0,
               "an accepted record is out of its ranges");
  }
  std::vector<uint8_t> encoded;
  EncodeLengths(records, columns, &encoded);
  FUZZ_CHECK(encoded == in.bytes, "accepted lengths re-encode to other bytes");
}

// Control bit 7: the job frame (DecodeJobFrame) instead; else the domain is 1 + the control
// byte's bits 1-6 ranks.
inline void CheckGroupsFrame(Input in) {
  if (in.control & 128) {
    if (in.control & 1) ResealFrame(FrameKind::kJob, &in.bytes);
    auto job = DecodeJobFrame(in.bytes);
    if (!job.ok()) return CheckError(job.status(), "DecodeJobFrame");
    FUZZ_CHECK(static_cast<int64_t>(job->size()) <= kMaxJobEntries,
               "an accepted job has more entries than the bound");
    // Compared by entries, not bytes (a varint may be written long): decode(encode(x)) == x.
    auto again = DecodeJobFrame(EncodeJobFrame(*job));
    FUZZ_CHECK(again.ok() && *again == *job, "decode(encode(decode(x))) != decode(x)");
    return;
  }
  if (in.control & 1) ResealFrame(FrameKind::kGroups, &in.bytes);
  const int64_t domain = 1 + ((in.control >> 1) & 63);
  auto groups = DecodeGroupsFrame(in.bytes, domain);
  if (!groups.ok()) return CheckError(groups.status(), "DecodeGroupsFrame");
  for (size_t k = 0; k < groups->size(); ++k) {
    const auto& [first, size] = (*groups)[k];
    FUZZ_CHECK(first >= 0 && size >= 1 && first + size <= domain &&
                   (k == 0 || (*groups)[k - 1] < (*groups)[k]),
               "an accepted group list breaks a rule");
  }
  auto again = DecodeGroupsFrame(EncodeGroupsFrame(*groups), domain);
  FUZZ_CHECK(again.ok() && *again == *groups, "decode(encode(decode(x))) != decode(x)");
}

// Control bits 1-3: the kind the frame is opened as (1-7); a size frame is decoded whole.
inline void CheckSizeFrame(Input in) {
  const auto kind = static_cast<FrameKind>(1 + ((in.control >> 1) & 7) % 7);
  if (in.control & 1) ResealFrame(kind, &in.bytes);
  auto body = OpenFrame(in.bytes, kind);
  if (!body.ok()) CheckError(body.status(), "OpenFrame");
  FUZZ_CHECK(!body.ok() || body->size() + kFrameTrailerSize == in.bytes.size(),
             "OpenFrame returned a body of the wrong size");
  Result<int64_t> size = DecodeSizeFrame(in.bytes, 0, int64_t{1} << 40);
  if (!size.ok()) return CheckError(size.status(), "DecodeSizeFrame");
  const auto encoded = EncodeSizeFrame(*size);
  FUZZ_CHECK(std::vector<uint8_t>(encoded.begin(), encoded.end()) == in.bytes,
             "an accepted size frame re-encodes to other bytes");
}

// Media (docs/wire_format.md "Media"). Control bits 2-3: the number of declared modalities
// (0-3); bit 1: one sample's media (DecodeSampleMedia on the bytes as they came), else a rank's
// media frame (DecodeMediaFrame; bit 0 reseals it). What either accepts re-encodes to bytes
// that decode to the same re-encoding (encode(decode(encode(decode(x)))) == encode(decode(x)):
// padding bytes and NaN payloads of the seconds are not compared by value).
inline void CheckMediaFrame(Input in) {
  const size_t modalities = (in.control >> 2) & 3;
  if (in.control & 2) {
    size_t off = 0;
    auto parts = DecodeSampleMedia(in.bytes, modalities, &off);
    if (!parts.ok()) return CheckError(parts.status(), "DecodeSampleMedia");
    FUZZ_CHECK(off <= in.bytes.size() && off % 8 == 0, "DecodeSampleMedia moved past the bytes");
    std::vector<uint8_t> once(SampleMediaBytes(*parts));
    FUZZ_CHECK(EncodeSampleMedia(*parts, once.data()) == once.data() + once.size(),
               "EncodeSampleMedia wrote another size than SampleMediaBytes");
    size_t off2 = 0;
    auto back = DecodeSampleMedia(once, modalities, &off2);
    FUZZ_CHECK(back.ok() && off2 == once.size(), "decode(encode(decode(x))) failed");
    std::vector<uint8_t> twice(SampleMediaBytes(*back));
    EncodeSampleMedia(*back, twice.data());
    FUZZ_CHECK(once == twice, "encode(decode(.)) is not stable");
    return;
  }
  if (in.control & 1) ResealFrame(FrameKind::kMedia, &in.bytes);
  auto shards = DecodeMediaFrame(in.bytes, modalities);
  if (!shards.ok()) return CheckError(shards.status(), "DecodeMediaFrame");
  const std::vector<uint8_t> once = EncodeMediaFrame(*shards);
  auto back = DecodeMediaFrame(once, modalities);
  FUZZ_CHECK(back.ok(), "decode(encode(decode(x))) failed");
  FUZZ_CHECK(EncodeMediaFrame(*back) == once, "encode(decode(.)) is not stable");
}

}  // namespace thdpack::fuzz

#endif  // THDPACK_FUZZ_STEP_WIRE_CHECKS_H_
