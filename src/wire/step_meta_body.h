// src/wire/step_meta_body.h: private to the wire area - the pieces of the THDM message that the
// metadata (step_meta.cc, versions 1-3) and the step message (step_message.cc, version 4)
// share: the frame (magic, version, total_length, CRC-32C trailer) and the metadata body.
// docs/wire_format.md is the grammar. Pure functions; thread-safe.
#ifndef THDPACK_WIRE_STEP_META_BODY_H_
#define THDPACK_WIRE_STEP_META_BODY_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/status.h"
#include "thdpack/wire.h"
#include "wire/coding.h"

namespace thdpack::wire {

// "0x0000ABCD", for messages.
std::string Hex32(uint32_t v);

// Appends the magic, `version` and a total_length to fill in (SealMessage).
void StartMessage(uint8_t version, std::vector<uint8_t>* out);
// Writes total_length and appends the CRC-32C of everything before it; OutOfRange (naming
// `who`) when the message would pass 2^32 - 1 bytes.
Status SealMessage(std::vector<uint8_t>* out, std::string_view who);

// Appends the metadata body of `meta` in the grammar of `version`: 1-3 as EncodeStepMeta picks
// them, 4 the metadata part of the step message (version 3's grammar, the rank multiple always
// written). REQUIRES: ValidateStepMeta(meta) is OK.
Status AppendStepMetaBody(const StepMeta& meta, uint8_t version, std::vector<uint8_t>* out);

// Checks a whole message's frame in order - its size, the magic, total_length == bytes.size(),
// the checksum, then the version (0 is Corruption; above kStepMessageVersion Unimplemented) -
// and returns the version. Errors start with `what` ("step metadata", "step message").
Result<uint8_t> OpenMessage(std::span<const uint8_t> bytes, std::string_view what);

// Reads the metadata part of a body from `r` (the bytes between the prefix and the checksum):
// versions 1-3 to the end of the body, version 4 up to the end of the skipped ids, the rest left
// in `r`. Corruption naming `what`, the byte offset in the whole message and the field; the
// result is not validated yet (ValidateStepMeta).
Result<StepMeta> ReadStepMetaBody(ByteReader& r, uint8_t version, std::string_view what);

}  // namespace thdpack::wire

#endif  // THDPACK_WIRE_STEP_META_BODY_H_
