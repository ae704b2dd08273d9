// The padding rule (thdpack/parallel_layout.h) against its plain definition, found by search:
// P is the smallest padded length >= L that splits into 2*CP zigzag chunks and is a multiple of
// the extra alignment; T the smallest total >= sum P that keeps the last sequence's alignment,
// (SP) splits into CP*TP equal parts, and gives each rank a multiple of the rank multiple.
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

// Smallest T >= sum that is a multiple of the sequence alignment, divides into equal shares of
// the ranks it is split over (CP, or CP*TP with SP and TP > 1) and gives each share a multiple
// of the rank multiple.
int64_t TokensBySearch(int64_t sum, int cp, int tp, bool sp, int64_t extra,
                       int64_t rank_multiple = 1) {
  const int64_t unit = (cp > 1 ? 2 * cp : 1) * extra;
  const int64_t ranks = sp && tp > 1 ? int64_t{cp} * tp : cp;
  int64_t t = sum;
  while (t % unit != 0 || t % ranks != 0 || (t / ranks) % rank_multiple != 0) ++t;
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

TEST(ParallelLayout, RankMultipleWorkedExample) {
  // docs/layout.md: lengths 7 and 3 at CP = 2 with rank multiple 16: q = lcm(4, 32) = 32, the
  // last sequence absorbs T - sum P = 20 (P = 8, 24), each CP rank holds 16 tokens. With SP
  // over TP = 2 each TP rank holds 16: q = lcm(4, 64) = 64.
  const ParallelLayout r16 = ParallelLayout::Create(2, 1, false, 1, 16).value();
  EXPECT_EQ(r16.rank_multiple(), 16);
  EXPECT_EQ(r16.split_ranks(), 2);
  EXPECT_EQ(r16.rank_quantum(), 32);
  EXPECT_EQ(r16.token_quantum(), 32);
  EXPECT_EQ(r16.PaddedLength(7), 8);  // the per-sequence rule is unchanged
  EXPECT_EQ(r16.MicrobatchTokens(12), 32);
  EXPECT_TRUE(r16.may_pad_tail());
  EXPECT_EQ(r16.ToString(), "CP=2 TP=1 align 1 rank multiple 16");
  const ParallelLayout sp16 = ParallelLayout::Create(2, 2, true, 1, 16).value();
  EXPECT_EQ(sp16.rank_quantum(), 64);
  EXPECT_EQ(sp16.MicrobatchTokens(12), 64);
  // Without SP, TP does not divide T; CP = 1 makes T itself a multiple of R.
  EXPECT_EQ(ParallelLayout::Create(2, 4, false, 1, 16).value().token_quantum(), 32);
  EXPECT_EQ(ParallelLayout::Create(1, 1, false, 1, 128).value().MicrobatchTokens(130), 256);
  // R that divides the alignment already: no tail (q = a).
  const ParallelLayout r2 = ParallelLayout::Create(4, 1, false, 1, 2).value();
  EXPECT_EQ(r2.token_quantum(), 8);
  EXPECT_FALSE(ParallelLayout::Create(4).value().may_pad_tail());
  EXPECT_NE(r16, ParallelLayout::Create(2).value());
}

// Every (CP, TP, SP, R) of a grid, each on fresh random lengths: P by the search, T by the
// search, and each rank's share of T (CP shard, then SP part) a multiple of R.
TEST(ParallelLayout, EveryCpTpSpAndRankMultipleEqualsTheSearch) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int cp : {1, 2, 3, 4, 8}) {
    for (int tp : {1, 2, 3, 4, 8}) {
      for (bool sp : {false, true}) {
        for (int64_t r : {1, 2, 3, 16, 32, 128}) {
          for (int64_t extra : {1, 2, 3}) {
            const ParallelLayout l = ParallelLayout::Create(cp, tp, sp, extra, r).value();
            const std::string what = l.ToString();
            for (int trial = 0; trial < 20; ++trial) {
              int64_t sum = 0;
              for (int k = 1 + static_cast<int>(rng() % 6); k > 0; --k) {
                const int64_t len = 1 + static_cast<int64_t>(rng() % 5000);
                const int64_t p = l.PaddedLength(len);
                ASSERT_EQ(p, PaddedBySearch(len, cp, extra)) << what << " L " << len;
                sum += p;
              }
              const int64_t t = l.MicrobatchTokens(sum);
              ASSERT_EQ(t, TokensBySearch(sum, cp, tp, sp, extra, r)) << what << " sum " << sum;
              ASSERT_EQ((t / cp) % (sp && tp > 1 ? tp : 1), 0) << what;
              ASSERT_EQ((t / cp / (sp && tp > 1 ? tp : 1)) % r, 0) << what;
              // The tail keeps the last sequence zigzag-able: T - sum is a multiple of a.
              ASSERT_EQ((t - sum) % l.sequence_alignment(), 0) << what;
              const int64_t budget = sum + static_cast<int64_t>(rng() % 600) - 300;
              if (budget > 0) {
                ASSERT_EQ(t <= budget, sum <= l.UsableBudget(budget)) << what << " budget "
                                                                      << budget;
              }
            }
          }
        }
      }
    }
  }
}

TEST(ParallelLayout, ParseRankMultipleTakesPresetsAndNumbers) {
  EXPECT_EQ(ParseRankMultiple("fp8").value(), 16);
  EXPECT_EQ(ParseRankMultiple("mxfp8").value(), 32);
  EXPECT_EQ(ParseRankMultiple("blockwise").value(), 128);
  EXPECT_EQ(ParseRankMultiple("none").value(), 1);
  EXPECT_EQ(ParseRankMultiple("1").value(), 1);
  EXPECT_EQ(ParseRankMultiple("48").value(), 48);
  EXPECT_EQ(ParseRankMultiple("2147483647").value(), 2147483647);
  for (const char* bad : {"", "0", "-16", "+16", "16x", "FP8", "2147483648", " 16", "1e3"}) {
    auto r = ParseRankMultiple(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("\"" + std::string(bad) + "\": expected fp8 (16)"),
              std::string::npos)
        << r.status().message();
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
  expect(ParallelLayout::Create(2, 1, false, 1, 0), StatusCode::kInvalidArgument,
         "rank_multiple = 0: must be >= 1");
  expect(ParallelLayout::Create(2, 1, false, 1, -16), StatusCode::kInvalidArgument,
         "rank_multiple = -16");
  expect(ParallelLayout::Create(65536, 1, false, 1, 65536), StatusCode::kOutOfRange,
         "rank_multiple = 65536 times the 65536 ranks");
  expect(ParallelLayout::Create(1024, 4, true, 1, 1 << 20), StatusCode::kOutOfRange,
         "rank_multiple = 1048576 times the 4096 ranks");
  // Each factor fits, their lcm does not.
  expect(ParallelLayout::Create(1, 1, false, 1 << 30, 3), StatusCode::kOutOfRange,
         "token quantum lcm(1073741824, cp_size = 1 times rank_multiple 3) = 3221225472");
}

TEST(ParallelLayout, FromWireInvertsSequenceAlignment) {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    const ParallelLayout l =
        ParallelLayout::Create(1 + static_cast<int>(rng() % 16), 1 + static_cast<int>(rng() % 8),
                               rng() % 2, 1 + static_cast<int64_t>(rng() % 16),
                               rng() % 2 ? 1 : 1 + static_cast<int64_t>(rng() % 128))
            .value();
    auto back = ParallelLayout::FromWire(l.cp_size(), l.tp_size(), l.sp(), l.sequence_alignment(),
                                         l.rank_multiple());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, l);
  }
  auto bad = ParallelLayout::FromWire(2, 1, false, 6);  // not a multiple of 2*CP = 4
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("pad_multiple = 6"), std::string::npos);
  EXPECT_FALSE(ParallelLayout::FromWire(0, 1, false, 1).ok());
  EXPECT_FALSE(ParallelLayout::FromWire(1, 1, false, 0).ok());
  EXPECT_FALSE(ParallelLayout::FromWire(1, 1, false, 1, 0).ok());
  EXPECT_FALSE(ParallelLayout::FromWire(1, 1, false, 1, int64_t{1} << 31).ok());
}

}  // namespace
}  // namespace thdpack
