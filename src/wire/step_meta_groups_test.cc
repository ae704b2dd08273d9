// Version 2 of the step metadata (per-microbatch CP groups of the dynamic scheduler), and
// version 3 with groups (a rank multiple applied per group): round trips, the rules
// ValidateStepMeta adds, and corruption. Version 1 keeps its own tests (step_meta_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "thdpack/wire.h"
#include "wire/step_meta_test_util.h"

namespace thdpack {
namespace {

using wire_test::Contains;
using wire_test::FillTotals;
using wire_test::Reseal;
using wire_test::RoundUp;

// A group microbatch under `layout` (the group's): lengths padded by the rule, the SP tail on
// the last sequence, n_valid of every target.
MicrobatchMeta GroupMicrobatch(const ParallelLayout& layout, const std::vector<int64_t>& lengths,
                               int64_t deficit = 0) {
  MicrobatchMeta mb;
  mb.cu_seqlens = {0};
  mb.cu_seqlens_padded = {0};
  int64_t sum_p = 0;
  std::vector<int64_t> padded;
  for (int64_t l : lengths) {
    padded.push_back(layout.PaddedLength(l));
    sum_p += padded.back();
  }
  padded.back() += layout.MicrobatchTokens(sum_p) - sum_p;
  int64_t real = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    mb.cu_seqlens.push_back(static_cast<int32_t>(mb.cu_seqlens.back() + lengths[i]));
    mb.cu_seqlens_padded.push_back(static_cast<int32_t>(mb.cu_seqlens_padded.back() + padded[i]));
    mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(padded[i]));
    real += lengths[i];
  }
  mb.n_valid = real - static_cast<int64_t>(lengths.size()) - deficit;
  return mb;
}

ParallelLayout Group(const ParallelLayout& p, int c) {
  return ParallelLayout::Create(c, p.tp_size(), p.sp(), p.extra_alignment(), p.rank_multiple())
      .value();
}

// DP = 2, CP = 2 (a domain of 4), domain rank 1: a group of 3 (padding to 6), an idle
// microbatch, a group of 1 (no padding), a group of 2 with a valid deficit.
StepMeta DynamicStep() {
  StepMeta meta;
  meta.step = 5;
  meta.epoch = 1;
  meta.dp_size = 2;
  meta.replica = 0;
  meta.domain_rank = 1;
  meta.parallel = ParallelLayout::Create(2).value();
  meta.groups = {{0, 3}, {0, 0}, {1, 1}, {0, 2}};
  meta.microbatches.push_back(GroupMicrobatch(Group(meta.parallel, 3), {7, 1, 20}));
  meta.microbatches.push_back(MicrobatchMeta{{0}, {0}, 0, 0});
  meta.microbatches.push_back(GroupMicrobatch(Group(meta.parallel, 1), {3, 5}));
  meta.microbatches.push_back(GroupMicrobatch(Group(meta.parallel, 2), {9}, 2));
  FillTotals(&meta, 17);
  meta.skipped_ids = {4, 2};
  return meta;
}

// A random dynamic step: any domain, any group sizes containing the rank, idle microbatches,
// SP and extra alignment.
StepMeta RandomDynamicStep(std::mt19937_64& rng) {
  StepMeta meta;
  meta.step = rng();
  meta.epoch = rng() % 1000;
  meta.dp_size = static_cast<int32_t>(rng() % 5) + 1;
  const int cp = static_cast<int>(rng() % 4) + 1;
  const int tp = static_cast<int>(rng() % 3) + 1;
  const int64_t extras[] = {1, 1, 2, 8};
  const int64_t rank_multiples[] = {1, 1, 2, 16};
  const bool sp = rng() % 2 == 0;
  const int64_t extra = extras[rng() % 4];
  meta.parallel =
      ParallelLayout::Create(cp, tp, sp, extra, rank_multiples[rng() % 4]).value();
  const int domain = meta.dp_size * cp;
  meta.domain_rank = static_cast<int32_t>(rng() % domain);
  meta.replica = meta.domain_rank / cp;
  const int num_mb = static_cast<int>(rng() % 6) + 1;
  for (int m = 0; m < num_mb; ++m) {
    if (rng() % 4 == 0) {
      meta.groups.push_back({0, 0});
      meta.microbatches.push_back(MicrobatchMeta{{0}, {0}, 0, 0});
      continue;
    }
    const int first = static_cast<int>(rng() % (meta.domain_rank + 1));
    const int c = meta.domain_rank - first + 1 +
                  static_cast<int>(rng() % (domain - meta.domain_rank));
    meta.groups.push_back({first, c});
    std::vector<int64_t> lengths(rng() % 12 + 1);
    for (auto& l : lengths) l = static_cast<int64_t>(rng() % (1u << (rng() % 14))) + 2;
    meta.microbatches.push_back(
        GroupMicrobatch(Group(meta.parallel, c), lengths, static_cast<int64_t>(rng() % 2)));
  }
  FillTotals(&meta, static_cast<int64_t>(rng() % 1000));
  if (rng() % 2) meta.skipped_ids = {static_cast<int64_t>(rng() % 100)};
  return meta;
}

TEST(WireGroupsTest, DynamicStepIsValidAndRoundTripsAsVersion2) {
  const StepMeta meta = DynamicStep();
  ASSERT_TRUE(ValidateStepMeta(meta).ok()) << ValidateStepMeta(meta).ToString();
  auto bytes = EncodeStepMeta(meta);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ((*bytes)[4], kStepMetaVersionGroups);
  auto back = DecodeStepMeta(*bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, meta);
  // The group of 3 pads to 2*3 = 6: 7 -> 12, 1 -> 6, 20 -> 24.
  EXPECT_EQ(back->microbatches[0].cu_seqlens_padded, (std::vector<int32_t>{0, 12, 18, 42}));
}

// The same step with rank multiple 16: version 3, flag bit 1 (groups) set, and each group's T a
// multiple of its size times 16 (the group of 3: 12 + 6 + 24 = 42 becomes 48).
TEST(WireGroupsTest, RankMultipleAppliesPerGroupAndIsVersion3) {
  StepMeta meta = DynamicStep();
  meta.parallel = ParallelLayout::Create(2, 1, false, 1, 16).value();
  meta.microbatches[0] = GroupMicrobatch(Group(meta.parallel, 3), {7, 1, 20});
  meta.microbatches[2] = GroupMicrobatch(Group(meta.parallel, 1), {3, 5});
  meta.microbatches[3] = GroupMicrobatch(Group(meta.parallel, 2), {9}, 2);
  FillTotals(&meta, 17);
  ASSERT_TRUE(ValidateStepMeta(meta).ok()) << ValidateStepMeta(meta).ToString();
  EXPECT_EQ(meta.microbatches[0].cu_seqlens_padded, (std::vector<int32_t>{0, 12, 18, 48}));
  EXPECT_EQ(meta.microbatches[2].cu_seqlens_padded, (std::vector<int32_t>{0, 3, 16}));
  EXPECT_EQ(meta.microbatches[3].cu_seqlens_padded, (std::vector<int32_t>{0, 32}));
  auto bytes = EncodeStepMeta(meta);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ((*bytes)[4], kStepMetaVersionRankMultiple);
  EXPECT_EQ((*bytes)[kStepMetaHeaderSize + 6], 0x02);  // flags: groups, no SP
  auto back = DecodeStepMeta(*bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, meta);
  // A group's T under the layout without the rank multiple breaks the per-group rule.
  meta.microbatches[0] = GroupMicrobatch(Group(DynamicStep().parallel, 3), {7, 1, 20});
  FillTotals(&meta, 17);
  const Status s = ValidateStepMeta(meta);
  EXPECT_TRUE(Contains(s, "microbatches[0].cu_seqlens_padded: total 42 is not a multiple of 48"))
      << s.ToString();
  // The groups flag is read as such: without it, the body's domain_rank is taken for
  // num_microbatches and the message does not decode.
  std::vector<uint8_t> msg = *bytes;
  msg[kStepMetaHeaderSize + 6] = 0x00;
  Reseal(&msg);
  EXPECT_FALSE(DecodeStepMeta(msg).ok());
}

TEST(WireGroupsTest, StaticStepStaysVersion1) {
  StepMeta meta = DynamicStep();
  meta.groups.clear();
  meta.domain_rank = 0;
  meta.microbatches = {GroupMicrobatch(meta.parallel, {3, 5})};
  FillTotals(&meta, 0);
  auto bytes = EncodeStepMeta(meta);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ((*bytes)[4], kStepMetaVersionStatic);
}

TEST(WireGroupsTest, RandomDynamicStepsRoundTrip) {
  std::mt19937_64 rng(2024);
  for (int trial = 0; trial < 500; ++trial) {
    const StepMeta meta = RandomDynamicStep(rng);
    auto bytes = EncodeStepMeta(meta);
    ASSERT_TRUE(bytes.ok()) << "trial " << trial << ": " << bytes.status().ToString();
    auto back = DecodeStepMeta(*bytes);
    ASSERT_TRUE(back.ok()) << "trial " << trial << ": " << back.status().ToString();
    EXPECT_EQ(*back, meta) << "trial " << trial;
  }
}

TEST(WireGroupsTest, EachGroupRuleIsNamed) {
  struct Case {
    std::string name;
    void (*edit)(StepMeta*);
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"groups count", [](StepMeta* m) { m->groups.pop_back(); }, "one group per microbatch"},
      {"rank outside group", [](StepMeta* m) { m->groups[2] = {2, 1}; },
       "do not contain this rank's domain_rank 1"},
      {"group outside domain", [](StepMeta* m) { m->groups[0] = {0, 5}; },
       "must lie inside the domain [0, 4)"},
      {"domain rank of another replica", [](StepMeta* m) { m->domain_rank = 2; },
       "StepMeta.domain_rank = 2"},
      {"idle with sequences", [](StepMeta* m) { m->groups[2] = {0, 0}; },
       "an idle microbatch"},
      {"idle first_rank", [](StepMeta* m) { m->groups[1] = {1, 0}; }, "must be 0 when idle"},
      {"padding of the group", [](StepMeta* m) { m->groups[0] = {0, 4}; },
       "is not a multiple of pad_multiple 8"},
      {"domain_rank without groups",
       [](StepMeta* m) {
         m->groups.clear();
         m->microbatches = {m->microbatches[2]};
         m->parallel = ParallelLayout();
         FillTotals(m, 0);
       },
       "must be 0 without groups"},
  };
  for (const Case& c : cases) {
    StepMeta meta = DynamicStep();
    c.edit(&meta);
    const Status s = ValidateStepMeta(meta);
    ASSERT_FALSE(s.ok()) << c.name;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_TRUE(Contains(s, c.expect)) << c.name << ": " << s.ToString();
    EXPECT_FALSE(EncodeStepMeta(meta).ok()) << c.name;
  }
}

TEST(WireGroupsTest, EveryBitFlipAndTruncationFails) {
  const std::vector<uint8_t> original = EncodeStepMeta(DynamicStep()).value();
  std::vector<uint8_t> msg = original;
  for (size_t bit = 0; bit < msg.size() * 8; ++bit) {
    msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    auto r = DecodeStepMeta(msg);
    ASSERT_FALSE(r.ok()) << "bit " << bit;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << "bit " << bit;
    msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
  }
  for (size_t cut = 0; cut < original.size(); ++cut) {
    EXPECT_FALSE(DecodeStepMeta(std::span<const uint8_t>(original.data(), cut)).ok()) << cut;
  }
}

// Resealed damage: the structural checks alone must fail cleanly or give a valid StepMeta that
// round-trips (the decoder is a trust boundary).
TEST(WireGroupsTest, ResealedDamageFailsOrStillValidates) {
  std::mt19937_64 rng(7);
  int accepted = 0, total = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const std::vector<uint8_t> original =
        EncodeStepMeta(trial == 0 ? DynamicStep() : RandomDynamicStep(rng)).value();
    for (size_t at = kStepMetaHeaderSize; at + 4 < original.size(); ++at) {
      for (uint8_t value : {uint8_t{0x00}, uint8_t{0x01}, uint8_t{0x7F}, uint8_t{0xFF},
                            static_cast<uint8_t>(original[at] ^ (1u << (rng() % 8)))}) {
        std::vector<uint8_t> msg = original;
        msg[at] = value;
        Reseal(&msg);
        ++total;
        auto r = DecodeStepMeta(msg);
        if (!r.ok()) {
          EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
          continue;
        }
        ++accepted;
        ASSERT_TRUE(ValidateStepMeta(*r).ok());
        auto again = EncodeStepMeta(*r);
        ASSERT_TRUE(again.ok());
        auto back = DecodeStepMeta(*again);
        ASSERT_TRUE(back.ok());
        EXPECT_EQ(*back, *r);
      }
    }
  }
  EXPECT_LT(accepted, total);
}

TEST(WireGroupsTest, GroupFieldsAreCheckedByTheDecoder) {
  const StepMeta meta = DynamicStep();
  const std::vector<uint8_t> original = EncodeStepMeta(meta).value();
  // The body: 14 header bytes (step .. n_loss_tokens), then domain_rank, num_microbatches, then
  // microbatch 0's group (first_rank, num_ranks).
  const size_t domain_rank_at = kStepMetaHeaderSize + 13;
  ASSERT_EQ(original[domain_rank_at], 1);
  ASSERT_EQ(original[domain_rank_at + 1], 4);  // num_microbatches
  ASSERT_EQ(original[domain_rank_at + 3], 3);  // group 0: num_ranks 3
  {
    std::vector<uint8_t> msg = original;
    msg[domain_rank_at] = 4;  // outside the domain of 4
    Reseal(&msg);
    auto r = DecodeStepMeta(msg);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status(), "domain_rank")) << r.status().ToString();
  }
  {
    std::vector<uint8_t> msg = original;
    msg[domain_rank_at + 3] = 5;  // a group of 5 in a domain of 4
    Reseal(&msg);
    auto r = DecodeStepMeta(msg);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_TRUE(Contains(r.status(), "group.num_ranks")) << r.status().ToString();
  }
  {
    // A version 2 body read as version 1 is corrupt, not misread.
    std::vector<uint8_t> msg = original;
    msg[4] = kStepMetaVersionStatic;
    Reseal(&msg);
    EXPECT_FALSE(DecodeStepMeta(msg).ok());
  }
}

}  // namespace
}  // namespace thdpack
