// Fuzz target: DecodeGroupsFrame (a dynamic step's CP groups), on raw or resealed bytes
// (fuzz/step_wire_checks.h; docs/wire_format.md, "The step's messages").
#include <cstddef>
#include <cstdint>

#include "step_wire_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  thdpack::fuzz::CheckGroupsFrame(thdpack::fuzz::Split(data, size));
  return 0;
}
