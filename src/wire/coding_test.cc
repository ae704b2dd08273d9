#include "wire/coding.h"

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <vector>

namespace thdpack::wire {
namespace {

TEST(WireCodingTest, VarintBytesByHand) {
  std::vector<uint8_t> out;
  PutVarint64(&out, 0);
  PutVarint64(&out, 127);
  PutVarint64(&out, 128);    // 0x80 0x01
  PutVarint64(&out, 16384);  // 0x80 0x80 0x01
  EXPECT_EQ(out, (std::vector<uint8_t>{0x00, 0x7F, 0x80, 0x01, 0x80, 0x80, 0x01}));
  EXPECT_EQ(VarintLength(0), 1);
  EXPECT_EQ(VarintLength(127), 1);
  EXPECT_EQ(VarintLength(128), 2);
  EXPECT_EQ(VarintLength(std::numeric_limits<uint64_t>::max()), 10);
}

TEST(WireCodingTest, VarintRoundTripAndLimits) {
  std::mt19937_64 rng(1);
  std::vector<uint64_t> values = {0, 1, 127, 128, 16383, 16384, (uint64_t{1} << 32) - 1,
                                  uint64_t{1} << 63, std::numeric_limits<uint64_t>::max()};
  for (int i = 0; i < 1000; ++i) values.push_back(rng() >> (rng() % 64));
  std::vector<uint8_t> out;
  for (uint64_t v : values) PutVarint64(&out, v);
  ByteReader r(out);
  for (uint64_t v : values) {
    uint64_t got = 0;
    ASSERT_TRUE(r.GetVarint64(&got));
    EXPECT_EQ(got, v);
  }
  EXPECT_EQ(r.remaining(), 0u);
  uint64_t dummy = 0;
  EXPECT_FALSE(r.GetVarint64(&dummy));  // nothing left

  // 2^64 needs an 11th bit group: the 10th byte may only be 0 or 1.
  const std::vector<uint8_t> too_big = {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x02};
  ByteReader r2(too_big);
  EXPECT_FALSE(r2.GetVarint64(&dummy));
  const std::vector<uint8_t> endless(12, 0x80);
  ByteReader r3(endless);
  EXPECT_FALSE(r3.GetVarint64(&dummy));
  const std::vector<uint8_t> truncated = {0x80, 0x80};
  ByteReader r4(truncated);
  EXPECT_FALSE(r4.GetVarint64(&dummy));
}

TEST(WireCodingTest, ZigZag) {
  EXPECT_EQ(ZigZagEncode(0), 0u);
  EXPECT_EQ(ZigZagEncode(-1), 1u);
  EXPECT_EQ(ZigZagEncode(1), 2u);
  EXPECT_EQ(ZigZagEncode(7), 14u);
  EXPECT_EQ(ZigZagEncode(std::numeric_limits<int64_t>::min()), std::numeric_limits<uint64_t>::max());
  for (int64_t v : {int64_t{0}, int64_t{-5}, int64_t{5}, std::numeric_limits<int64_t>::min(),
                    std::numeric_limits<int64_t>::max()}) {
    EXPECT_EQ(ZigZagDecode(ZigZagEncode(v)), v);
  }
}

TEST(WireCodingTest, RiceBitsByHand) {
  // v=2,k=1: q=1 -> bits 0,1 then low bit 0.  v=4,k=1: q=2 -> 0,0,1 then 0.
  // LSB first: bit0=0 bit1=1 bit2=0 bit3=0 bit4=0 bit5=1 bit6=0 (+pad) = 0b00100010.
  std::vector<uint8_t> out;
  BitWriter w(&out);
  w.PutRice(2, 1);
  w.PutRice(4, 1);
  w.Finish();
  EXPECT_EQ(out, (std::vector<uint8_t>{0x22}));
  BitReader r(out);
  uint32_t v = 0;
  ASSERT_TRUE(r.GetRice(1, 100, &v));
  EXPECT_EQ(v, 2u);
  ASSERT_TRUE(r.GetRice(1, 100, &v));
  EXPECT_EQ(v, 4u);
  EXPECT_TRUE(r.AtCleanEnd());
}

TEST(WireCodingTest, RiceRoundTripRandom) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int k = static_cast<int>(rng() % 32);
    const int n = static_cast<int>(rng() % 300) + 1;
    std::vector<uint32_t> values(n);
    uint64_t bits = 0;
    for (auto& v : values) {
      // Keep quotients moderate (as ChooseRiceParameter would) but cross 32-zero runs sometimes.
      v = static_cast<uint32_t>(rng() % ((uint64_t{1} << k) * 80));
      if (v > 0x7FFFFFFEu) v = 0x7FFFFFFEu;
      bits += RiceBits(v, k);
    }
    std::vector<uint8_t> out;
    BitWriter w(&out);
    for (uint32_t v : values) w.PutRice(v, k);
    w.Finish();
    ASSERT_EQ(out.size(), (bits + 7) / 8);
    BitReader r(out);
    for (uint32_t want : values) {
      uint32_t got = 0;
      ASSERT_TRUE(r.GetRice(k, 0x7FFFFFFE, &got));
      ASSERT_EQ(got, want);
    }
    EXPECT_TRUE(r.AtCleanEnd());
  }
}

TEST(WireCodingTest, BitReaderRejectsRunsAndOverflow) {
  uint32_t v = 0;
  const std::vector<uint8_t> zeros(20, 0);
  BitReader r1(zeros);
  EXPECT_FALSE(r1.GetRice(0, 1000000, &v));  // never terminates within the stream
  BitReader r2(zeros);
  EXPECT_FALSE(r2.GetRice(0, 10, &v));  // quotient above the limit
  const std::vector<uint8_t> empty;
  BitReader r3(empty);
  EXPECT_FALSE(r3.GetRice(3, 1000, &v));
  // 1 then k=8 low bits missing.
  const std::vector<uint8_t> one = {0x01};
  BitReader r4(one);
  EXPECT_FALSE(r4.GetRice(8, 1000, &v));
  // A value over max_value through its low bits: q=0, low bits 0xFF with k=8, max 200.
  const std::vector<uint8_t> high = {0xFF, 0x01};
  BitReader r5(high);
  EXPECT_FALSE(r5.GetRice(8, 200, &v));
  // Non-zero padding bits are not a clean end.
  const std::vector<uint8_t> dirty = {0x03};  // code "1" (v=0, k=0), then a stray 1 bit
  BitReader r6(dirty);
  ASSERT_TRUE(r6.GetRice(0, 10, &v));
  EXPECT_EQ(v, 0u);
  EXPECT_FALSE(r6.AtCleanEnd());
}

// The chosen k is the argmin of the exact bit count over every k.
TEST(WireCodingTest, ChooseRiceParameterIsExhaustiveArgmin) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = static_cast<int>(rng() % 64) + 1;
    std::vector<uint32_t> values(n);
    const int scale = static_cast<int>(rng() % 31);
    for (auto& v : values) v = static_cast<uint32_t>(rng() % ((uint64_t{1} << scale) + 1));
    int best_k = 0;
    uint64_t best = UINT64_MAX;
    for (int k = 0; k <= kMaxRiceParameter; ++k) {
      uint64_t bits = 0;
      for (uint32_t v : values) bits += RiceBits(v, k);
      if (bits < best) best = bits, best_k = k;
    }
    const RiceChoice c = ChooseRiceParameter(values);
    EXPECT_EQ(c.k, best_k);
    EXPECT_EQ(c.bits, best);
  }
  const std::vector<uint32_t> golden = {2, 4};  // k=1 and k=2 both take 7 bits: smallest wins
  EXPECT_EQ(ChooseRiceParameter(golden).k, 1);
  EXPECT_EQ(ChooseRiceParameter(golden).bits, 7u);
}

}  // namespace
}  // namespace thdpack::wire
