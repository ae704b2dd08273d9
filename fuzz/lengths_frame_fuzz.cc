// Fuzz target: DecodeLengthsHeader and DecodeLengths (the lengths exchange), on raw or resealed
// bytes (fuzz/step_wire_checks.h; docs/wire_format.md, "The step's messages").
#include <cstddef>
#include <cstdint>

#include "step_wire_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  thdpack::fuzz::CheckLengthsFrame(thdpack::fuzz::Split(data, size));
  return 0;
}
