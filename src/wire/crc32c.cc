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

// The register map "append n zero bytes" is linear over GF(2): a 32x32 bit matrix, column j
// the image of bit j. Squaring it doubles n; applying it to a register is a table lookup once
// tabulated per byte of the register (ZerosTable), as in zlib's crc32_combine.
using Matrix = std::array<uint32_t, 32>;

constexpr uint32_t Times(const Matrix& m, uint32_t v) {
  uint32_t sum = 0;
  for (int j = 0; v != 0; ++j, v >>= 1) {
    if (v & 1u) sum ^= m[static_cast<size_t>(j)];
  }
  return sum;
}

constexpr Matrix Square(const Matrix& m) {
  Matrix s{};
  for (size_t j = 0; j < 32; ++j) s[j] = Times(m, m[j]);
  return s;
}

// The matrix of n zero BYTES (n >= 1).
constexpr Matrix ZerosMatrix(size_t n) {
  Matrix one_bit{};  // one zero bit: shift right, the polynomial folded in for bit 0
  one_bit[0] = kPolynomial;
  for (size_t j = 1; j < 32; ++j) one_bit[j] = uint32_t{1} << (j - 1);
  Matrix power = Square(Square(Square(one_bit)));  // 8 bits: one byte
  Matrix result{};
  bool have = false;
  while (n != 0) {
    if (n & 1u) {
      if (!have) {
        result = power;
        have = true;
      } else {
        Matrix r{};
        for (size_t j = 0; j < 32; ++j) r[j] = Times(power, result[j]);
        result = r;
      }
    }
    n >>= 1;
    if (n != 0) power = Square(power);
  }
  return result;
}

using ZerosTable = std::array<std::array<uint32_t, 256>, 4>;

constexpr ZerosTable MakeZerosTable(size_t n) {
  const Matrix m = ZerosMatrix(n);
  ZerosTable t{};
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 0; k < 4; ++k) t[static_cast<size_t>(k)][b] = Times(m, b << (8 * k));
  }
  return t;
}

const ZerosTable& ZerosOf(size_t n) {
  static const ZerosTable kLong = MakeZerosTable(kInterleaveLong);
  static const ZerosTable kShort = MakeZerosTable(kInterleaveShort);
  return n == kInterleaveLong ? kLong : kShort;
}

inline uint32_t ShiftBy(const ZerosTable& t, uint32_t s) {
  return t[0][s & 0xFFu] ^ t[1][(s >> 8) & 0xFFu] ^ t[2][(s >> 16) & 0xFFu] ^ t[3][s >> 24];
}

}  // namespace

uint32_t Shift(uint32_t state, size_t zeros) { return ShiftBy(ZerosOf(zeros), state); }

uint32_t ShiftReference(uint32_t state, size_t zeros) {
  for (size_t i = 0; i < 8 * zeros; ++i) state = (state >> 1) ^ ((state & 1u) ? kPolynomial : 0u);
  return state;
}

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
namespace {

// Three blocks of `block` bytes at p, p + block, p + 2 * block, advanced together; returns the
// register after all three from `s0`.
__attribute__((target("sse4.2"))) inline uint64_t ThreeBlocks(uint64_t s0, const uint8_t* p,
                                                                size_t block,
                                                                const ZerosTable& zeros) {
  uint64_t s1 = 0, s2 = 0;
  const uint8_t* end = p + block;
  while (p < end) {
    uint64_t a, b, c;
    std::memcpy(&a, p, 8);
    std::memcpy(&b, p + block, 8);
    std::memcpy(&c, p + 2 * block, 8);
    s0 = _mm_crc32_u64(s0, a);
    s1 = _mm_crc32_u64(s1, b);
    s2 = _mm_crc32_u64(s2, c);
    p += 8;
  }
  // The register is linear: the state after blocks A B equals A's state shifted past |B| zero
  // bytes, xor B's state from zero.
  s0 = ShiftBy(zeros, static_cast<uint32_t>(s0)) ^ s1;
  return ShiftBy(zeros, static_cast<uint32_t>(s0)) ^ s2;
}

}  // namespace

__attribute__((target("sse4.2"))) uint32_t ExtendHardwareInterleaved(uint32_t state,
                                                                     const uint8_t* data,
                                                                     size_t size) {
  const uint8_t* p = data;
  uint64_t s = state;
  if (size >= 3 * kInterleaveLong) {
    const ZerosTable& zeros = ZerosOf(kInterleaveLong);
    while (size >= 3 * kInterleaveLong) {
      s = ThreeBlocks(s, p, kInterleaveLong, zeros);
      p += 3 * kInterleaveLong;
      size -= 3 * kInterleaveLong;
    }
  }
  if (size >= 3 * kInterleaveShort) {
    const ZerosTable& zeros = ZerosOf(kInterleaveShort);
    while (size >= 3 * kInterleaveShort) {
      s = ThreeBlocks(s, p, kInterleaveShort, zeros);
      p += 3 * kInterleaveShort;
      size -= 3 * kInterleaveShort;
    }
  }
  return ExtendHardware(static_cast<uint32_t>(s), p, size);
}
#else
bool HardwareAvailable() { return false; }
uint32_t ExtendHardwareInterleaved(uint32_t state, const uint8_t* data, size_t size) {
  return ExtendPortable(state, data, size);
}
uint32_t ExtendHardware(uint32_t state, const uint8_t* data, size_t size) {
  return ExtendPortable(state, data, size);
}
#endif

}  // namespace thdpack::crc32c

namespace thdpack {

uint32_t Crc32cExtend(uint32_t crc, std::span<const uint8_t> data) {
  // Chosen once; a function-local static is initialised thread-safely.
  static const auto extend = crc32c::HardwareAvailable() ? &crc32c::ExtendHardwareInterleaved
                                                         : &crc32c::ExtendPortable;
  return ~extend(~crc, data.data(), data.size());
}

uint32_t Crc32c(std::span<const uint8_t> data) { return Crc32cExtend(0, data); }

}  // namespace thdpack
