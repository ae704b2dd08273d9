// fuzz/wire_checks.h: the properties both wire targets check on every input.
//
// DecodeStepMeta must return a Status for any bytes (never crash, never read outside them), and
// what it accepts must be a valid StepMeta that survives a round trip: EncodeStepMeta accepts it,
// and decoding the encoding gives it back. The encoding of the result is a fixed point (a second
// round trip gives the same bytes). StepMetaMessageSize must agree with the decoder on the
// prefix of any message the decoder accepts.
//
// Thread-safety: pure functions.
#ifndef THDPACK_FUZZ_WIRE_CHECKS_H_
#define THDPACK_FUZZ_WIRE_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "thdpack/wire.h"

namespace thdpack::fuzz {

inline void CheckStepMetaDecoder(std::span<const uint8_t> bytes) {
  if (bytes.size() >= kStepMetaHeaderSize) {
    // Framing from the prefix alone: never a crash; a frame the decoder accepts has its size.
    (void)StepMetaMessageSize(bytes.first(kStepMetaHeaderSize));
  }
  Result<StepMeta> decoded = DecodeStepMeta(bytes);
  if (!decoded.ok()) {
    const StatusCode code = decoded.status().code();
    FUZZ_CHECK(code == StatusCode::kCorruption || code == StatusCode::kUnimplemented,
               "DecodeStepMeta failed with an unexpected code: " + Describe(decoded.status()));
    FUZZ_CHECK(!decoded.status().message().empty(), "an error without a message");
    return;
  }
  const StepMeta& meta = *decoded;
  Result<uint32_t> framed = StepMetaMessageSize(bytes.first(kStepMetaHeaderSize));
  FUZZ_CHECK(framed.ok() && *framed == bytes.size(),
             "StepMetaMessageSize disagrees with an accepted message: " + Describe(framed.status()));
  const Status valid = ValidateStepMeta(meta);
  FUZZ_CHECK(valid.ok(), "DecodeStepMeta accepted an invalid StepMeta: " + Describe(valid));

  Result<std::vector<uint8_t>> encoded = EncodeStepMeta(meta);
  FUZZ_CHECK(encoded.ok(), "EncodeStepMeta refused a decoded StepMeta: " + Describe(encoded.status()));
  Result<StepMeta> again = DecodeStepMeta(*encoded);
  FUZZ_CHECK(again.ok(), "DecodeStepMeta refused EncodeStepMeta's bytes: " + Describe(again.status()));
  FUZZ_CHECK(*again == meta, "decode(encode(decode(x))) != decode(x)");
  Result<std::vector<uint8_t>> reencoded = EncodeStepMeta(*again);
  FUZZ_CHECK(reencoded.ok() && *reencoded == *encoded, "the encoding is not a fixed point");
}

}  // namespace thdpack::fuzz

#endif  // THDPACK_FUZZ_WIRE_CHECKS_H_
