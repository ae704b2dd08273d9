// The padding rule (thdpack/parallel_layout.h) against its plain definition, found by search:
// P is the smallest padded length >= L that splits into 2*CP zigzag chunks and is a multiple of
// the extra alignment; T the smallest total >= sum P that keeps the last sequence's alignment
// and (SP) splits into CP*TP equal parts.
#include "thdpack/parallel_layout.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace thdpack {
namespace {

// Smallest P >= length with P % (zigzag) == 0 and P % extra_alignment == 0 ... where the rule
// asks for the product zigzag * extra_alignment (not the lcm): searched, not computed.
int64_t PaddedBySearch(int64_t length, int cp, int64_t extra) {
  const int64_t unit = (cp > 1 ? 2 * cp : 1) * extra;
  int64_t p = length;
  while (p % unit != 0) ++p;
  return p;
}

// Smallest T >= sum that is a multiple of the sequence alignment and, with SP and TP > 1, of
// CP*TP.
int64_t TokensBySearch(int64_t sum, int cp, int tp, bool sp, int64_t extra) {
  const int64_t unit = (cp > 1 ? 2 * cp : 1) * extra;
  int64_t t = sum;
  while (t % unit != 0 || (sp && tp > 1 && t % (int64_t{cp} * tp) != 0)) ++t;
  return t;
}

TEST(ParallelLayout, DefaultIsUnsplit) {
  const ParallelLayout l;
  EXPECT_EQ(l.cp_size(), 1);
  EXPECT_EQ(l.tp_size(), 1);
  EXPECT_FALSE(l.sp());
  EXPECT_EQ(l.extra_alignment(), 1);
  EXPECT_EQ(l.token_quantum(), 1);
  EXPECT_EQ(l.PaddedLength(7), 7);
  EXPECT_EQ(l, ParallelLayout::Create(1).value());
}

TEST(ParallelLayout, WorkedExample) {
  // Lengths 7 and 3 at CP = 2: P = 8 and 4, T = 12; with TP = 4 and SP, T = 16.
  const ParallelLayout cp2 = ParallelLayout::Create(2).value();
  EXPECT_EQ(cp2.sequence_alignment(), 4);
  EXPECT_EQ(cp2.PaddedLength(7), 8);
  EXPECT_EQ(cp2.PaddedLength(3), 4);
  EXPECT_EQ(cp2.MicrobatchTokens(12), 12);
  const ParallelLayout sp = ParallelLayout::Create(2, 4, true).value();
  EXPECT_EQ(sp.token_quantum(), 8);
  EXPECT_EQ(sp.MicrobatchTokens(12), 16);
  EXPECT_TRUE(sp.splits_over_tp());
  // SP without TP > 1 does not change the rule.
  EXPECT_EQ(ParallelLayout::Create(2, 1, true).value().token_quantum(), 4);
}

TEST(ParallelLayout, RuleEqualsSearchOnRandomInputs) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 4000; ++trial) {
    const int cp = 1 + static_cast<int>(rng() % 9);
    const int tp = 1 + static_cast<int>(rng() % 9);
    const bool sp = rng() % 2;
    const int64_t extra = 1 + static_cast<int64_t>(rng() % 5);
    const ParallelLayout l = ParallelLayout::Create(cp, tp, sp, extra).value();
    const int64_t len = 1 + static_cast<int64_t>(rng() % 3000);
    const int64_t p = l.PaddedLength(len);
    ASSERT_EQ(p, PaddedBySearch(len, cp, extra)) << l.ToString() << " L " << len;
    int64_t sum = p;
    for (int k = static_cast<int>(rng() % 4); k > 0; --k) {
      sum += l.PaddedLength(1 + static_cast<int64_t>(rng() % 500));
    }
    const int64_t t = l.MicrobatchTokens(sum);
    ASSERT_EQ(t, TokensBySearch(sum, cp, tp, sp, extra)) << l.ToString() << " sum " << sum;
    // The budget test the scheduler uses agrees with computing T.
    const int64_t budget = sum + static_cast<int64_t>(rng() % 40) - 20;
    if (budget > 0) {
      ASSERT_EQ(t <= budget, sum <= l.UsableBudget(budget)) << l.ToString() << " budget " << budget;
    }
  }
}

TEST(ParallelLayout, CreateRejectsBadArguments) {
  auto expect = [](const Result<ParallelLayout>& r, StatusCode code, const std::string& text) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code);
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
  };
  expect(ParallelLayout::Create(0), StatusCode::kInvalidArgument, "cp_size = 0: must be >= 1");
  expect(ParallelLayout::Create(1, -1), StatusCode::kInvalidArgument, "tp_size = -1");
  expect(ParallelLayout::Create(2, 0, true), StatusCode::kInvalidArgument,
         "tp_size = 0: must be >= 1");
  expect(ParallelLayout::Create(1, 1, false, 0), StatusCode::kInvalidArgument,
         "extra_alignment = 0: must be >= 1");
  expect(ParallelLayout::Create(2, 1, false, 0), StatusCode::kInvalidArgument,
         "extra_alignment = 0");
  expect(ParallelLayout::Create(4, 1, false, int64_t{1} << 30), StatusCode::kOutOfRange,
         "extra_alignment = 1073741824");
  expect(ParallelLayout::Create(65536, 65536, true), StatusCode::kOutOfRange,
         "cp_size * tp_size = 65536 * 65536");
  // Without SP the product does not matter.
  EXPECT_TRUE(ParallelLayout::Create(65536, 65536, false).ok());
}

TEST(ParallelLayout, FromWireInvertsSequenceAlignment) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    const ParallelLayout l =
        ParallelLayout::Create(1 + static_cast<int>(rng() % 16), 1 + static_cast<int>(rng() % 8),
                               rng() % 2, 1 + static_cast<int64_t>(rng() % 16))
            .value();
    auto back = ParallelLayout::FromWire(l.cp_size(), l.tp_size(), l.sp(), l.sequence_alignment());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, l);
  }
  auto bad = ParallelLayout::FromWire(2, 1, false, 6);  // not a multiple of 2*CP = 4
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("pad_multiple = 6"), std::string::npos);
  EXPECT_FALSE(ParallelLayout::FromWire(0, 1, false, 1).ok());
  EXPECT_FALSE(ParallelLayout::FromWire(1, 1, false, 0).ok());
}

}  // namespace
}  // namespace thdpack
