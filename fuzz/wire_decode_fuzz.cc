// Fuzz target: DecodeStepMeta on raw bytes (docs/wire_format.md). Most mutations are caught by
// the length and checksum checks; wire_decode_sealed_fuzz.cc reseals them to reach the body.
#include <cstddef>
#include <cstdint>
#include <span>

#include "wire_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  thdpack::fuzz::CheckStepMetaDecoder(std::span<const uint8_t>(data, size));
  return 0;
}
