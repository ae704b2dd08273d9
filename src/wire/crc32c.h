// Internal CRC-32C implementations behind thdpack::Crc32c (thdpack/wire.h).
//
// All three compute the same function on the raw register (no initial or final inversion: the
// public functions add those). ExtendReference is the plain bitwise definition, one bit at a
// time; the others are checked against it on random buffers in crc32c_test.cc.
//
// Thread-safety: pure functions over constant tables.
#ifndef THDPACK_WIRE_CRC32C_H_
#define THDPACK_WIRE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace thdpack::crc32c {

// The reflected Castagnoli polynomial.
inline constexpr uint32_t kPolynomial = 0x82F63B78u;

// Bit by bit: for each byte, state ^= byte, then 8 times state = (state >> 1) ^ (lsb ? poly : 0).
uint32_t ExtendReference(uint32_t state, const uint8_t* data, size_t size);

// Slicing-by-8 tables: 8 bytes per step, portable (byte loads, any alignment, any endianness).
uint32_t ExtendPortable(uint32_t state, const uint8_t* data, size_t size);

// True when this CPU has the SSE4.2 crc32 instruction (x86-64 only; false elsewhere).
bool HardwareAvailable();

// The SSE4.2 crc32 instruction. REQUIRES: HardwareAvailable().
uint32_t ExtendHardware(uint32_t state, const uint8_t* data, size_t size);

}  // namespace thdpack::crc32c

#endif  // THDPACK_WIRE_CRC32C_H_
