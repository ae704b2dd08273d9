// Fuzz target: DecodeMediaFrame (a rank's media of a step) and DecodeSampleMedia (a sample's
// media in the exchange), on raw or resealed bytes (fuzz/step_wire_checks.h; docs/wire_format.md,
// "Media").
#include <cstddef>
#include <cstdint>

#include "step_wire_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  thdpack::fuzz::CheckMediaFrame(thdpack::fuzz::Split(data, size));
  return 0;
}
