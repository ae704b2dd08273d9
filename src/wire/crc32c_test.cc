#include "wire/crc32c.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "thdpack/wire.h"

namespace thdpack {
namespace {

// The public CRC (pre- and post-inversion) computed with one internal implementation.
uint32_t Finish(uint32_t (*extend)(uint32_t, const uint8_t*, size_t), const uint8_t* p, size_t n) {
  return ~extend(~0u, p, n);
}

struct CheckValue {
  const char* name;
  std::vector<uint8_t> data;
  uint32_t crc;
};

// Published check values: the CRC catalogue ("123456789") and RFC 3720 appendix B.4 (iSCSI).
std::vector<CheckValue> CheckValues() {
  std::vector<uint8_t> ascending(32), descending(32);
  for (int i = 0; i < 32; ++i) {
    ascending[i] = static_cast<uint8_t>(i);
    descending[i] = static_cast<uint8_t>(31 - i);
  }
  const char* digits = "123456789";
  return {
      {"digits", std::vector<uint8_t>(digits, digits + 9), 0xE3069283u},
      {"zeros32", std::vector<uint8_t>(32, 0x00), 0x8A9136AAu},
      {"ones32", std::vector<uint8_t>(32, 0xFF), 0x62A8AB43u},
      {"ascending32", ascending, 0x46DD794Eu},
      {"descending32", descending, 0x113FDB5Cu},
      {"empty", {}, 0x00000000u},
  };
}

TEST(Crc32cTest, ReferenceMatchesPublishedCheckValues) {
  for (const auto& c : CheckValues()) {
    EXPECT_EQ(Finish(crc32c::ExtendReference, c.data.data(), c.data.size()), c.crc) << c.name;
  }
}

TEST(Crc32cTest, PortableMatchesPublishedCheckValues) {
  for (const auto& c : CheckValues()) {
    EXPECT_EQ(Finish(crc32c::ExtendPortable, c.data.data(), c.data.size()), c.crc) << c.name;
  }
}

TEST(Crc32cTest, HardwareMatchesPublishedCheckValuesWhenPresent) {
  if (!crc32c::HardwareAvailable()) GTEST_SKIP() << "no SSE4.2 on this CPU";
  for (const auto& c : CheckValues()) {
    EXPECT_EQ(Finish(crc32c::ExtendHardware, c.data.data(), c.data.size()), c.crc) << c.name;
  }
}

TEST(Crc32cTest, PublicFunctionMatchesPublishedCheckValues) {
  for (const auto& c : CheckValues()) EXPECT_EQ(Crc32c(c.data), c.crc) << c.name;
}

// Every fast path equals the bitwise reference on fresh random buffers of random lengths and
// start offsets (so the 8-byte loop meets every alignment and every remainder).
TEST(Crc32cTest, FastPathsEqualReferenceOnRandomBuffers) {
  std::mt19937_64 rng(20240611);
  std::vector<uint8_t> pool(4096 + 64);
  for (auto& b : pool) b = static_cast<uint8_t>(rng());
  const bool hw = crc32c::HardwareAvailable();
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t offset = rng() % 16;
    const size_t len = trial < 100 ? static_cast<size_t>(trial) : rng() % 4096;
    const uint8_t* p = pool.data() + offset;
    const uint32_t seed = static_cast<uint32_t>(rng());
    const uint32_t want = crc32c::ExtendReference(seed, p, len);
    ASSERT_EQ(crc32c::ExtendPortable(seed, p, len), want) << "len " << len << " offset " << offset;
    if (hw) {
      ASSERT_EQ(crc32c::ExtendHardware(seed, p, len), want) << "len " << len;
    }
    ASSERT_EQ(Crc32c(std::span<const uint8_t>(p, len)), ~crc32c::ExtendReference(~0u, p, len));
  }
}

// The three-stream form equals the bitwise reference on fresh random buffers whose lengths
// fall on, around and between its block sizes (3 x 256 and 3 x 8192 bytes), at every start
// alignment; and its combination step (Shift) equals appending zero bytes one bit at a time.
TEST(Crc32cTest, InterleavedEqualsReferenceOnRandomBuffers) {
  if (!crc32c::HardwareAvailable()) GTEST_SKIP() << "no SSE4.2 on this CPU";
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const size_t kLong3 = 3 * crc32c::kInterleaveLong, kShort3 = 3 * crc32c::kInterleaveShort;
  std::vector<uint8_t> pool(3 * kLong3 + 64);
  for (auto& b : pool) b = static_cast<uint8_t>(rng());
  std::vector<size_t> lengths = {0, 1, 7, 8, kShort3 - 1, kShort3, kShort3 + 1, 2 * kShort3 + 9,
                                 kLong3 - 1, kLong3, kLong3 + 1, kLong3 + kShort3 + 3,
                                 2 * kLong3, 2 * kLong3 + 5 * kShort3 + 17};
  for (int trial = 0; trial < 200; ++trial) lengths.push_back(rng() % (3 * kLong3));
  for (size_t len : lengths) {
    const size_t offset = rng() % 16;
    const uint8_t* p = pool.data() + offset;
    const uint32_t state = static_cast<uint32_t>(rng());
    ASSERT_EQ(crc32c::ExtendHardwareInterleaved(state, p, len),
              crc32c::ExtendReference(state, p, len))
        << "len " << len << " offset " << offset;
  }
  for (size_t zeros : {crc32c::kInterleaveShort, crc32c::kInterleaveLong}) {
    for (int trial = 0; trial < 50; ++trial) {
      const uint32_t state = static_cast<uint32_t>(rng());
      ASSERT_EQ(crc32c::Shift(state, zeros), crc32c::ShiftReference(state, zeros))
          << zeros << " zero bytes";
    }
    const std::vector<uint8_t> zero_bytes(zeros, 0);
    EXPECT_EQ(crc32c::ShiftReference(0x12345678u, zeros),
              crc32c::ExtendReference(0x12345678u, zero_bytes.data(), zeros));
  }
}

TEST(Crc32cTest, ExtendIsConcatenation) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> data(1000);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  const std::span<const uint8_t> all(data);
  const uint32_t whole = Crc32c(all);
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{500}, size_t{999},
                     size_t{1000}}) {
    EXPECT_EQ(Crc32cExtend(Crc32c(all.first(cut)), all.subspan(cut)), whole) << "cut " << cut;
  }
  EXPECT_EQ(Crc32cExtend(0, all), whole);
}

TEST(Crc32cTest, DetectsEverySingleBitFlipOfAShortBuffer) {
  std::vector<uint8_t> data(64);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 37 + 11);
  const uint32_t good = Crc32c(data);
  for (size_t bit = 0; bit < data.size() * 8; ++bit) {
    data[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(Crc32c(data), good) << "bit " << bit;
    data[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
}

}  // namespace
}  // namespace thdpack
