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

// The SSE4.2 crc32 instruction, one stream: each 8-byte step waits for the one before (the
// instruction's latency is 3 cycles, its throughput 1 a cycle). REQUIRES: HardwareAvailable().
uint32_t ExtendHardware(uint32_t state, const uint8_t* data, size_t size);

// The same instruction on three streams at once: a buffer of at least 3 * kInterleaveShort
// bytes is cut into three blocks (kInterleaveLong, or kInterleaveShort bytes each) whose
// registers advance together, each block's register then shifted past the blocks after it
// (Shift, a table lookup) and combined; the rest goes through ExtendHardware. About three
// times the throughput of one stream on long buffers (bench/wire_bench.cc). REQUIRES:
// HardwareAvailable().
inline constexpr size_t kInterleaveLong = 8192;
inline constexpr size_t kInterleaveShort = 256;
uint32_t ExtendHardwareInterleaved(uint32_t state, const uint8_t* data, size_t size);

// The register after `state` followed by `zeros` zero bytes, for zeros = kInterleaveLong or
// kInterleaveShort (the combination step of ExtendHardwareInterleaved), and the same by the
// plain definition (ShiftReference: bit by bit, for the tests).
uint32_t Shift(uint32_t state, size_t zeros);
uint32_t ShiftReference(uint32_t state, size_t zeros);

}  // namespace thdpack::crc32c

#endif  // THDPACK_WIRE_CRC32C_H_
