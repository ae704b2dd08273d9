// src/wire/position.h: private to the wire area - the run's position after a step as bytes
// (docs/wire_format.md, "position"), shared by the step message and the position frame. The
// cursor is written by the table of its fields (SourceCursorFields, thdpack/data.h), the one
// description the run state's JSON walks too. Pure functions; thread-safe.
#ifndef THDPACK_WIRE_POSITION_H_
#define THDPACK_WIRE_POSITION_H_

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "thdpack/status.h"
#include "thdpack/step_wire.h"
#include "wire/coding.h"

namespace thdpack::wire {

// Appends `position`. REQUIRES: consumed >= 0 and the cursor valid (CheckSourceCursor).
void AppendPosition(const StepPosition& position, std::vector<uint8_t>* out);

// Reads a position from `r`: every count against the bytes left before allocating, the nesting
// against kMaxCursorNesting before recursing, each integer against its row's range, the shape
// byte against the rows that follow, and CheckSourceCursor at the end. Corruption "<what>:
// byte N (position.cursor.<path>): rule", N the offset in the whole message (`base` + the
// reader's position).
Status ReadPosition(ByteReader& r, size_t base, std::string_view what, StepPosition* out);

}  // namespace thdpack::wire

#endif  // THDPACK_WIRE_POSITION_H_
