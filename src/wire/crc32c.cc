// CRC-32C: the bitwise reference, slicing-by-8 tables, and the SSE4.2 instruction behind a run
// time CPU check (the library is never compiled with -msse4.2 as a whole, so it runs anywhere).
#include "wire/crc32c.h"

#include <array>
#include <cstring>
#include <span>

#include "thdpack/wire.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define THDPACK_CRC32C_X86 1
#include <nmmintrin.h>
#endif

namespace thdpack::crc32c {
namespace {

// kTables[0] is the classic byte table; kTables[j][b] is the register after byte b followed by
// j zero bytes, so eight table lookups advance the register by eight bytes at once.
constexpr std::array<std::array<uint32_t, 256>, 8> MakeTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t crc = b;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPolynomial : 0u);
    t[0][b] = crc;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (int j = 1; j < 8; ++j) t[j][b] = (t[j - 1][b] >> 8) ^ t[0][t[j - 1][b] & 0xFFu];
  }
  return t;
}

constexpr auto kTables = MakeTables();

inline uint32_t LoadLe32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

}  // namespace

uint32_t ExtendReference(uint32_t state, const uint8_t* data, size_t size) {
  for (size_t i = 0; i < size; ++i) {
    state ^= data[i];
    for (int bit = 0; bit < 8; ++bit) state = (state >> 1) ^ ((state & 1u) ? kPolynomial : 0u);
  }
  return state;
}

uint32_t ExtendPortable(uint32_t state, const uint8_t* data, size_t size) {
  const uint8_t* p = data;
  const uint8_t* end = data + size;
  while (end - p >= 8) {
    const uint32_t lo = LoadLe32(p) ^ state;
    const uint32_t hi = LoadLe32(p + 4);
    state = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^
            kTables[5][(lo >> 16) & 0xFFu] ^ kTables[4][lo >> 24] ^ kTables[3][hi & 0xFFu] ^
            kTables[2][(hi >> 8) & 0xFFu] ^ kTables[1][(hi >> 16) & 0xFFu] ^ kTables[0][hi >> 24];
    p += 8;
  }
  while (p < end) state = (state >> 8) ^ kTables[0][(state ^ *p++) & 0xFFu];
  return state;
}

#ifdef THDPACK_CRC32C_X86
bool HardwareAvailable() {
  static const bool available = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return available;
}

__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t state, const uint8_t* data,
                                                          size_t size) {
  const uint8_t* p = data;
  const uint8_t* end = data + size;
  uint64_t s = state;
  while (end - p >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // x86 is little-endian, as the instruction expects
    s = _mm_crc32_u64(s, word);
    p += 8;
  }
  uint32_t s32 = static_cast<uint32_t>(s);
  while (p < end) s32 = _mm_crc32_u8(s32, *p++);
  return s32;
}
#else
bool HardwareAvailable() { return false; }
uint32_t ExtendHardware(uint32_t state, const uint8_t* data, size_t size) {
  return ExtendPortable(state, data, size);
}
#endif

}  // namespace thdpack::crc32c

namespace thdpack {

uint32_t Crc32cExtend(uint32_t crc, std::span<const uint8_t> data) {
  // Chosen once; a function-local static is initialised thread-safely.
  static const auto extend = crc32c::HardwareAvailable() ? &crc32c::ExtendHardware
                                                         : &crc32c::ExtendPortable;
  return ~extend(~crc, data.data(), data.size());
}

uint32_t Crc32c(std::span<const uint8_t> data) { return Crc32cExtend(0, data); }

}  // namespace thdpack
