#include "thdpack/pack.h"

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <vector>

#include "thdpack/shard.h"

namespace thdpack {
namespace {

using Ints = std::vector<int32_t>;
using Bytes = std::vector<uint8_t>;
using Lengths = std::vector<int64_t>;
constexpr TokenId kX = kIgnoreIndex;

void ExpectCode(const Status& s, StatusCode code, std::initializer_list<std::string> parts) {
  EXPECT_EQ(s.code(), code) << s.ToString();
  for (const std::string& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
  }
}
void ExpectInvalid(const Status& s, std::initializer_list<std::string> parts) {
  ExpectCode(s, StatusCode::kInvalidArgument, parts);
}

// The running example of the tests and docs/layout.md: an SFT sample of 7 tokens whose first
// two are prompt, and a pretraining sample of 3 tokens.
std::vector<Sample> TwoSamples() {
  return {Sample{.id = 10, .tokens = {11, 12, 13, 14, 15, 16, 17}, .target_mask = {0, 0, 1, 1, 1, 1, 1}},
          Sample{.id = 20, .tokens = {21, 22, 23}, .target_mask = {}}};
}

// PackOptions with the parallel layout ParallelLayout::Create(cp, tp, sp, extra_alignment,
// rank_multiple), which these tests know to be valid (bad layouts: parallel_layout_test.cc).
PackOptions Opts(int cp, int tp = 1, bool sp = false, int64_t extra_alignment = 1,
                 TokenId pad_id = 0, int64_t rank_multiple = 1) {
  return {.parallel = ParallelLayout::Create(cp, tp, sp, extra_alignment, rank_multiple).value(),
          .pad_id = pad_id};
}

std::vector<SampleView> Views(const std::vector<Sample>& samples) {
  return std::vector<SampleView>(samples.begin(), samples.end());
}

TEST(PackLayoutTest, PadsEachSequenceToTwiceCp) {
  auto l = ComputeLayout(Lengths{7, 3}, Opts(2));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->cu_seqlens, (Ints{0, 7, 10}));
  EXPECT_EQ(l->cu_seqlens_padded, (Ints{0, 8, 12}));
  EXPECT_EQ(l->max_seqlen, 8);
  EXPECT_EQ(l->total_tokens, 12);
}

TEST(PackLayoutTest, NoCpNoPadding) {
  auto l = ComputeLayout(Lengths{5, 1, 9}, {});
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->cu_seqlens, (Ints{0, 5, 6, 15}));
  EXPECT_EQ(l->cu_seqlens_padded, (Ints{0, 5, 6, 15}));
  EXPECT_EQ(l->max_seqlen, 9);
  EXPECT_EQ(l->total_tokens, 15);
}

TEST(PackLayoutTest, ExtraAlignmentMultipliesTheCpQuantum) {
  // m = 2*CP = 4, times 3: every padded length is a multiple of 12.
  auto l = ComputeLayout(Lengths{5, 13}, Opts(2, 1, false, 3));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->cu_seqlens_padded, (Ints{0, 12, 36}));
  EXPECT_EQ(l->max_seqlen, 24);
  auto a = ComputeLayout(Lengths{5, 13}, Opts(1, 1, false, 8));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->cu_seqlens_padded, (Ints{0, 8, 24}));
}

TEST(PackLayoutTest, SpTailIsAbsorbedByTheLastSequence) {
  // CP=2, TP=4: 7 -> 8 and 3 -> 4 make T = 12, T/CP = 6 is not a multiple of TP = 4. The
  // last sequence grows to 8: T = 16, T/CP = 8 = 4 * 2. (Megatron pads both to 2*CP*TP = 16,
  // T = 32.)
  auto l = ComputeLayout(Lengths{7, 3}, Opts(2, 4, true));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->cu_seqlens, (Ints{0, 7, 10}));
  EXPECT_EQ(l->cu_seqlens_padded, (Ints{0, 8, 16}));
  EXPECT_EQ(l->max_seqlen, 8);
  EXPECT_EQ(l->total_tokens, 16);
  // Without sp the TP size does not matter.
  auto no_sp = ComputeLayout(Lengths{7, 3}, Opts(2, 4));
  ASSERT_TRUE(no_sp.ok());
  EXPECT_EQ(no_sp->cu_seqlens_padded, (Ints{0, 8, 12}));
}

TEST(PackLayoutTest, SpTailKeepsTheZigzagQuantumWithOddTp) {
  // CP=2, TP=3: T must be a multiple of CP*TP = 6 AND the last length of 2*CP = 4, so of 12.
  auto l = ComputeLayout(Lengths{4, 4}, Opts(2, 3, true));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->cu_seqlens_padded, (Ints{0, 4, 12}));
  EXPECT_EQ(l->max_seqlen, 8);
  // CP=1, TP=4: the last sequence takes 1 more token; max_seqlen is the largest PADDED one.
  auto t = ComputeLayout(Lengths{5, 2}, Opts(1, 4, true));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->cu_seqlens_padded, (Ints{0, 5, 8}));
  EXPECT_EQ(t->max_seqlen, 5);
  auto u = ComputeLayout(Lengths{2, 3}, Opts(1, 8, true));
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->cu_seqlens_padded, (Ints{0, 2, 8}));
  EXPECT_EQ(u->max_seqlen, 6);
  // Already a multiple: nothing added.
  auto v = ComputeLayout(Lengths{8, 8}, Opts(2, 2, true));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->cu_seqlens_padded, (Ints{0, 8, 16}));
}

TEST(PackLayoutTest, RankMultipleTailIsAbsorbedByTheLastSequence) {
  // docs/layout.md: CP=2, rank multiple 16: T = 12 becomes 32 (16 tokens per CP rank); the
  // first sequence keeps P = 8, the last grows from 4 to 24 (still 4 zigzag chunks of 6).
  // --align 8 would instead pad each sequence to a multiple of 32: T = 64.
  auto l = ComputeLayout(Lengths{7, 3}, Opts(2, 1, false, 1, 0, 16));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->cu_seqlens, (Ints{0, 7, 10}));
  EXPECT_EQ(l->cu_seqlens_padded, (Ints{0, 8, 32}));
  EXPECT_EQ(l->max_seqlen, 24);
  EXPECT_EQ(l->total_tokens, 32);
  auto align = ComputeLayout(Lengths{7, 3}, Opts(2, 1, false, 8));
  ASSERT_TRUE(align.ok());
  EXPECT_EQ(align->cu_seqlens_padded, (Ints{0, 32, 64}));
  // With SP over TP = 2 the multiple is per TP rank: T/(CP*TP) = 16, T = 64.
  auto sp = ComputeLayout(Lengths{7, 3}, Opts(2, 2, true, 1, 0, 16));
  ASSERT_TRUE(sp.ok());
  EXPECT_EQ(sp->cu_seqlens_padded, (Ints{0, 8, 64}));
  // CP = 1: T itself a multiple of R; a total that is one already gets no tail.
  auto cp1 = ComputeLayout(Lengths{20, 12}, Opts(1, 1, false, 1, 0, 32));
  ASSERT_TRUE(cp1.ok());
  EXPECT_EQ(cp1->cu_seqlens_padded, (Ints{0, 20, 32}));
  // The shards: every CP rank holds 16 tokens.
  const auto samples = TwoSamples();
  auto sm = PackAndShardAll(Views(samples), Opts(2, 1, false, 1, 0, 16));
  ASSERT_TRUE(sm.ok()) << sm.status().ToString();
  EXPECT_EQ(sm->shards[0].tokens,
            (Ints{11, 12, 17, 0, 21, 22, 23, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(sm->shards[1].tokens.size(), 16u);
  EXPECT_EQ(sm->n_valid, 7);
  // PackInto refuses a layout whose T breaks the rank multiple (here the layout without it).
  const Layout plain = *ComputeLayout(Lengths{7, 3}, Opts(2));
  Ints t(12);
  ExpectInvalid(PackInto(Views(samples), plain, Opts(2, 1, false, 1, 0, 16), {.tokens = t})
                    .status(),
                {"layout.total_tokens = 12", "2 ranks", "rank_multiple = 16",
                 "T a multiple of 32"});
}

TEST(PackLayoutTest, RejectsBadLengths) {
  ExpectInvalid(ComputeLayout(Lengths{}, {}).status(), {"lengths is empty"});
  ExpectInvalid(ComputeLayout(Lengths{4, 2, 9, 0}, {}).status(),
                {"lengths[3] = 0", "a sequence length must be >= 1"});
  ExpectInvalid(ComputeLayout(Lengths{4, -5}, {}).status(), {"lengths[1] = -5"});
  // cp_size 0, tp_size -1 and extra_alignment 0 cannot reach ComputeLayout any more:
  // ParallelLayout::Create rejects them (parallel_layout_test.cc, CreateRejectsBadArguments).
}

TEST(PackLayoutTest, TotalMustFitInt32) {
  const int64_t big = int64_t{1} << 30;
  ExpectCode(ComputeLayout(Lengths{big, big}, {}).status(), StatusCode::kOutOfRange,
             {"T = 2147483648", "lengths[1]", "must fit int32"});
  ExpectCode(ComputeLayout(Lengths{3000000000}, {}).status(), StatusCode::kOutOfRange,
             {"lengths[0] = 3000000000", "int32"});
  ExpectCode(ComputeLayout(Lengths{std::numeric_limits<int32_t>::max() - 1}, Opts(1, 4, true))
                 .status(),
             StatusCode::kOutOfRange, {"T = 2147483648", "SP tail"});
  ExpectCode(ComputeLayout(Lengths{std::numeric_limits<int32_t>::max() - 1},
                           Opts(1, 1, false, 1, 0, 16))
                 .status(),
             StatusCode::kOutOfRange, {"T = 2147483648", "rank-multiple tail"});
  // An alignment or an SP quantum that does not fit int32 is ParallelLayout::Create's OutOfRange
  // (parallel_layout_test.cc, CreateRejectsBadArguments).
  // The largest T that fits is accepted.
  auto max = ComputeLayout(Lengths{std::numeric_limits<int32_t>::max()}, {});
  ASSERT_TRUE(max.ok()) << max.status().ToString();
  EXPECT_EQ(max->total_tokens, std::numeric_limits<int32_t>::max());
}

TEST(PackTest, HandWrittenMicrobatchCp2) {
  const auto samples = TwoSamples();
  auto mb = Pack(Views(samples), Opts(2));
  ASSERT_TRUE(mb.ok()) << mb.status().ToString();
  EXPECT_EQ(mb->tokens, (Ints{11, 12, 13, 14, 15, 16, 17, 0, 21, 22, 23, 0}));
  EXPECT_EQ(mb->position_ids, (Ints{0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
  EXPECT_EQ(mb->labels, (Ints{12, 13, 14, 15, 16, 17, kX, kX, 22, 23, kX, kX}));
  EXPECT_EQ(mb->loss_mask, (Bytes{0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0}));
  EXPECT_EQ(mb->cu_seqlens, (Ints{0, 7, 10}));
  EXPECT_EQ(mb->cu_seqlens_padded, (Ints{0, 8, 12}));
  EXPECT_EQ(mb->max_seqlen, 8);
  EXPECT_EQ(mb->n_valid, 7);
  EXPECT_EQ(mb->n_valid, NumTargets(samples[0]) + NumTargets(samples[1]));
}

TEST(PackTest, HandWrittenShardsCp2) {
  // Chunks are P/4: 2 tokens for the first sequence, 1 for the second. Rank 0 keeps global
  // [0,1,6,7, 8,11], rank 1 keeps [2,3,4,5, 9,10].
  const auto samples = TwoSamples();
  auto sm = PackAndShardAll(Views(samples), Opts(2));
  ASSERT_TRUE(sm.ok()) << sm.status().ToString();
  ASSERT_EQ(sm->shards.size(), 2u);
  EXPECT_EQ(sm->n_valid, 7);
  EXPECT_EQ(sm->layout.cu_seqlens_padded, (Ints{0, 8, 12}));
  const PackedShard& r0 = sm->shards[0];
  const PackedShard& r1 = sm->shards[1];
  EXPECT_EQ(r0.cp_rank, 0);
  EXPECT_EQ(r0.tokens, (Ints{11, 12, 17, 0, 21, 0}));
  EXPECT_EQ(r0.position_ids, (Ints{0, 1, 6, 7, 0, 3}));
  EXPECT_EQ(r0.labels, (Ints{12, 13, kX, kX, 22, kX}));
  EXPECT_EQ(r0.loss_mask, (Bytes{0, 1, 0, 0, 1, 0}));
  EXPECT_EQ(r1.cp_rank, 1);
  EXPECT_EQ(r1.tokens, (Ints{13, 14, 15, 16, 22, 23}));
  EXPECT_EQ(r1.position_ids, (Ints{2, 3, 4, 5, 1, 2}));
  EXPECT_EQ(r1.labels, (Ints{14, 15, 16, 17, 23, kX}));
  EXPECT_EQ(r1.loss_mask, (Bytes{1, 1, 1, 1, 1, 0}));
  auto one = PackAndShard(Views(samples), Opts(2), 1);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->shards.size(), 1u);
  EXPECT_EQ(one->shards[0].tokens, r1.tokens);
  EXPECT_EQ(one->shards[0].labels, r1.labels);
  EXPECT_EQ(one->n_valid, 7);
}

TEST(PackTest, HandWrittenSpTailWithPadId) {
  // CP=2, TP=4, sp: the second sequence absorbs 4 more padding tokens (P = 8, not 4);
  // position ids continue through the padding, labels and loss mask stay off there.
  const auto samples = TwoSamples();
  auto mb = Pack(Views(samples), Opts(2, 4, true, 1, 99));
  ASSERT_TRUE(mb.ok()) << mb.status().ToString();
  EXPECT_EQ(mb->cu_seqlens_padded, (Ints{0, 8, 16}));
  EXPECT_EQ(mb->max_seqlen, 8);
  EXPECT_EQ(mb->tokens, (Ints{11, 12, 13, 14, 15, 16, 17, 99, 21, 22, 23, 99, 99, 99, 99, 99}));
  EXPECT_EQ(mb->position_ids, (Ints{0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(mb->labels, (Ints{12, 13, 14, 15, 16, 17, kX, kX, 22, 23, kX, kX, kX, kX, kX, kX}));
  EXPECT_EQ(mb->loss_mask, (Bytes{0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(mb->n_valid, 7);
  // The CP shards are the worked example's zigzag [0,1,6,7,8,9,14,15] / [2,3,4,5,10,11,12,13];
  // each holds T/CP = 8 tokens, 2 per TP rank.
  auto sm = PackAndShardAll(Views(samples), Opts(2, 4, true, 1, 99));
  ASSERT_TRUE(sm.ok());
  EXPECT_EQ(sm->shards[0].tokens, (Ints{11, 12, 17, 99, 21, 22, 99, 99}));
  EXPECT_EQ(sm->shards[1].tokens, (Ints{13, 14, 15, 16, 23, 99, 99, 99}));
  EXPECT_EQ(sm->shards[1].position_ids, (Ints{2, 3, 4, 5, 2, 3, 4, 5}));
  auto part = SpSplit(std::span<const TokenId>(sm->shards[1].tokens), 4, 2);
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(std::vector<TokenId>(part->begin(), part->end()), (Ints{23, 99}));
}

TEST(PackTest, LengthOneAndShortSequencesPredictNothing) {
  const std::vector<Sample> samples{Sample{.id = 1, .tokens = {5}},
                                    Sample{.id = 2, .tokens = {6, 7}, .target_mask = {1, 0}}};
  auto mb = Pack(Views(samples), Opts(4));
  ASSERT_TRUE(mb.ok());
  EXPECT_EQ(mb->cu_seqlens_padded, (Ints{0, 8, 16}));
  EXPECT_EQ(mb->labels, (Ints{kX, kX, kX, kX, kX, kX, kX, kX, 7, kX, kX, kX, kX, kX, kX, kX}));
  EXPECT_EQ(mb->loss_mask, (Bytes(16, 0)));
  EXPECT_EQ(mb->n_valid, 0);
}

TEST(PackTest, IntoSkipsArraysGivenEmptySpans) {
  const auto samples = TwoSamples();
  const auto views = Views(samples);
  auto layout = ComputeLayout(Lengths{7, 3}, Opts(2));
  ASSERT_TRUE(layout.ok());
  Ints labels(12, 1234);
  Bytes mask(12, 9);
  auto n = PackInto(views, *layout, Opts(2), {.labels = labels, .loss_mask = mask});
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 7);
  EXPECT_EQ(labels, (Ints{12, 13, 14, 15, 16, 17, kX, kX, 22, 23, kX, kX}));
  EXPECT_EQ(mask, (Bytes{0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0}));
  Ints tokens(6, -7);
  auto m = PackShardInto(views, *layout, Opts(2), 0, {.tokens = tokens});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(*m, 7);
  EXPECT_EQ(tokens, (Ints{11, 12, 17, 0, 21, 0}));
}

TEST(PackTest, RejectsBadSamples) {
  ExpectInvalid(Pack({}, {}).status(), {"samples is empty"});
  std::vector<Sample> s{Sample{.id = 5, .tokens = {1, 2}}, Sample{.id = 42, .tokens = {}}};
  ExpectInvalid(Pack(Views(s), {}).status(),
                {"samples[1] (id 42)", "no tokens", "must be >= 1"});
  s = {Sample{.id = 7, .tokens = {1, 2, 3, 4}, .target_mask = {1, 1, 1}}};
  ExpectInvalid(Pack(Views(s), {}).status(),
                {"samples[0] (id 7)", "target_mask has 3 values", "L = 4"});
  s = {Sample{.id = 8, .tokens = {1, 2}}, Sample{.id = 9, .tokens = {1, 2, 3}, .target_mask = {0, 1, 2}}};
  ExpectInvalid(Pack(Views(s), {}).status(),
                {"samples[1] (id 9)", "target_mask[2] = 2", "0 or 1"});
  s = {Sample{.id = 3, .tokens = {1, 2}, .target_mask = {255, 1}}};
  ExpectInvalid(Pack(Views(s), {}).status(), {"(id 3)", "target_mask[0] = 255"});
  // A bad value inside the eight-bytes-at-a-time part of the mask scan.
  Sample long_sample{.id = 4, .tokens = std::vector<TokenId>(40, 1),
                     .target_mask = std::vector<uint8_t>(40, 1)};
  long_sample.target_mask[29] = 3;
  ExpectInvalid(Pack(std::vector<SampleView>{long_sample}, {}).status(),
                {"(id 4)", "target_mask[29] = 3"});
  // Every entry point checks the samples.
  const std::vector<SampleView> bad{long_sample};
  ExpectInvalid(PackAndShard(bad, {}, 0).status(), {"target_mask[29] = 3"});
  ExpectInvalid(PackAndShardAll(bad, {}).status(), {"target_mask[29] = 3"});
  Layout layout = *ComputeLayout(Lengths{40}, {});
  Ints out(40);
  ExpectInvalid(PackInto(bad, layout, {}, {.tokens = out}).status(), {"target_mask[29] = 3"});
  ExpectInvalid(PackShardInto(bad, layout, {}, 0, {.tokens = out}).status(),
                {"target_mask[29] = 3"});
  ExpectInvalid(PackShardAllInto(bad, layout, {}, std::vector<PackBuffers>{{.tokens = out}}).status(),
                {"target_mask[29] = 3"});
}

// A negative token id would be taken for a label (-100 is kIgnoreIndex) and silently change
// what the loss counts: every entry point rejects it, naming the sample and position.
TEST(PackTest, RejectsNegativeTokenIds) {
  std::vector<Sample> s{Sample{.id = 5, .tokens = {1, 2}},
                        Sample{.id = 6, .tokens = {3, kIgnoreIndex, 4}}};
  ExpectInvalid(Pack(Views(s), {}).status(),
                {"samples[1] (id 6)", "tokens[1] = -100", "token ids must lie in [0, 2^31)"});
  Sample long_sample{.id = 4, .tokens = std::vector<TokenId>(40, 1)};
  long_sample.tokens[33] = std::numeric_limits<TokenId>::min();
  const std::vector<SampleView> bad{long_sample};
  const std::string what = "tokens[33] = -2147483648";
  ExpectInvalid(Pack(bad, {}).status(), {"(id 4)", what});
  ExpectInvalid(PackAndShard(bad, {}, 0).status(), {what});
  ExpectInvalid(PackAndShardAll(bad, {}).status(), {what});
  Layout layout = *ComputeLayout(Lengths{40}, {});
  Ints out(40);
  ExpectInvalid(PackInto(bad, layout, {}, {.tokens = out}).status(), {what});
  ExpectInvalid(PackShardInto(bad, layout, {}, 0, {.tokens = out}).status(), {what});
  ExpectInvalid(PackShardAllInto(bad, layout, {}, std::vector<PackBuffers>{{.tokens = out}}).status(),
                {what});
  // The largest id is a token like any other.
  long_sample.tokens[33] = std::numeric_limits<TokenId>::max();
  auto ok = Pack(std::vector<SampleView>{long_sample}, {});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->tokens[33], std::numeric_limits<TokenId>::max());
  EXPECT_EQ(ok->n_valid, 39);
}

TEST(PackTest, IntoRejectsLayoutsThatDoNotDescribeTheSamples) {
  const auto samples = TwoSamples();
  const auto views = Views(samples);
  const PackOptions cp2 = Opts(2);
  const Layout good = *ComputeLayout(Lengths{7, 3}, cp2);
  Ints t(12);
  const PackBuffers out{.tokens = t};
  ASSERT_TRUE(PackInto(views, good, cp2, out).ok());

  Layout l = good;
  l.cu_seqlens.pop_back();
  ExpectInvalid(PackInto(views, l, cp2, out).status(),
                {"2 cu_seqlens and 3 cu_seqlens_padded", "n+1 = 3"});
  l = good;
  l.cu_seqlens = {0, 6, 10};
  ExpectInvalid(PackInto(views, l, cp2, out).status(),
                {"cu_seqlens[1] - cu_seqlens[0] = 6", "samples[0] (id 10)", "7"});
  l = good;
  l.cu_seqlens = {1, 8, 11};
  ExpectInvalid(PackInto(views, l, cp2, out).status(), {"layout.cu_seqlens[0] = 1"});
  l = good;
  l.cu_seqlens_padded = {0, 8, 10};
  ExpectInvalid(PackInto(views, l, cp2, out).status(),
                {"layout: cu_seqlens_padded[2] - cu_seqlens_padded[1] = 2", "divisible by 2*cp_size"});
  l = *ComputeLayout(Lengths{7, 3}, {});
  ExpectInvalid(PackInto(views, l, {}, out).status(), {"out.tokens has 12", "T = 10"});
  l.cu_seqlens_padded = {0, 4, 10};
  ExpectInvalid(PackInto(views, l, {}, out).status(),
                {"cu_seqlens_padded[1] - cu_seqlens_padded[0] = 4", ">= the real one, 7"});
  l = good;
  l.total_tokens = 13;
  ExpectInvalid(PackInto(views, l, cp2, out).status(),
                {"layout.total_tokens = 13", "cu_seqlens_padded[n] = 12"});
  l = good;
  l.max_seqlen = 7;
  ExpectInvalid(PackInto(views, l, cp2, out).status(),
                {"layout.max_seqlen = 7", "largest padded length, 8"});
  ExpectInvalid(PackInto(views, good, Opts(2, 4, true), out).status(),
                {"layout.total_tokens = 12", "multiple of tp_size = 4"});
  Ints l11(11);
  ExpectInvalid(PackInto(views, good, cp2, {.labels = l11}).status(),
                {"out.labels has 11 elements", "T = 12"});
  Ints p5(5);
  ExpectInvalid(PackShardInto(views, good, cp2, 0, {.position_ids = p5}).status(),
                {"out.position_ids has 5 elements", "T/CP = 6"});
  Bytes m5(5);
  ExpectInvalid(PackShardInto(views, good, cp2, 0, {.loss_mask = m5}).status(),
                {"out.loss_mask has 5"});
  Ints t6(6);
  ExpectInvalid(PackShardInto(views, good, cp2, 2, {.tokens = t6}).status(),
                {"cp_rank = 2", "[0, cp_size = 2)"});
  ExpectInvalid(PackShardAllInto(views, good, cp2, std::vector<PackBuffers>(1)).status(),
                {"out has 1 entries", "cp_size = 2"});
  ExpectInvalid(PackShardAllInto(views, good, cp2,
                                 std::vector<PackBuffers>{{.tokens = t6}, {.tokens = t}})
                    .status(),
                {"out[1].tokens has 12", "T/CP = 6"});
  ExpectInvalid(PackAndShard(views, cp2, -1).status(), {"cp_rank = -1"});
}

// Hugging Face's labels written out by hand for the running example at CP = 1 (no padding):
// A's targets are tokens 2..6 (its mask), B's tokens 1..2; each sequence's first token and
// the prompt are -100. With rank multiple 16, T = 16 and the tail of B is -100 too.
TEST(HfLabelsTest, HandWrittenExample) {
  const auto samples = TwoSamples();
  auto mb = Pack(Views(samples), Opts(1));
  ASSERT_TRUE(mb.ok());
  Ints labels(10);
  Bytes mask(10);
  ASSERT_TRUE(ToHfLabels(mb->labels, mb->loss_mask, mb->cu_seqlens_padded, labels, mask).ok());
  EXPECT_EQ(labels, (Ints{kX, kX, 13, 14, 15, 16, 17, kX, 22, 23}));
  EXPECT_EQ(mask, (Bytes{0, 0, 1, 1, 1, 1, 1, 0, 1, 1}));
  auto r16 = Pack(Views(samples), Opts(1, 1, false, 1, 0, 16));
  ASSERT_TRUE(r16.ok());
  ASSERT_EQ(r16->cu_seqlens_padded, (Ints{0, 7, 16}));
  // In place.
  ASSERT_TRUE(ToHfLabels(r16->labels, r16->loss_mask, r16->cu_seqlens_padded, r16->labels,
                         r16->loss_mask)
                  .ok());
  EXPECT_EQ(r16->labels, (Ints{kX, kX, 13, 14, 15, 16, 17, kX, 22, 23, kX, kX, kX, kX, kX, kX}));
  EXPECT_EQ(r16->loss_mask, (Bytes{0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0}));
}

// Against the convention's plain definition, from the samples themselves: label j of sample s
// is tokens_s[j] when 1 <= j < L_s and target_mask_s[j] = 1, else -100; on random samples,
// alignments and rank multiples (so padding sits inside and after the sequences).
TEST(HfLabelsTest, MatchesThePlainDefinitionOnRandomSamples) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<Sample> samples;
    for (int i = 1 + static_cast<int>(rng() % 6); i > 0; --i) {
      Sample s;
      s.id = static_cast<int64_t>(samples.size());
      const int len = 1 + static_cast<int>(rng() % 50);
      for (int j = 0; j < len; ++j) s.tokens.push_back(static_cast<TokenId>(rng() % 1000));
      if (rng() % 3 != 0) {  // completion-only: a prompt of zeros, then ones (or random)
        const int prompt = static_cast<int>(rng() % (len + 1));
        for (int j = 0; j < len; ++j) {
          s.target_mask.push_back(rng() % 4 == 0 ? static_cast<uint8_t>(rng() % 2)
                                                 : static_cast<uint8_t>(j >= prompt));
        }
      }
      samples.push_back(std::move(s));
    }
    const int64_t align = 1 + static_cast<int64_t>(rng() % 4);
    const int64_t rank_multiple = std::vector<int64_t>{1, 2, 16, 32}[rng() % 4];
    const PackOptions o = Opts(1, 1, false, align, 7, rank_multiple);
    auto mb = Pack(Views(samples), o);
    ASSERT_TRUE(mb.ok()) << mb.status().ToString();
    Ints want;
    Bytes want_mask;
    for (size_t i = 0; i < samples.size(); ++i) {
      const Sample& s = samples[i];
      const int64_t len = static_cast<int64_t>(s.tokens.size());
      const int64_t p = int64_t{mb->cu_seqlens_padded[i + 1]} - mb->cu_seqlens_padded[i];
      for (int64_t j = 0; j < p; ++j) {
        const bool target =
            j >= 1 && j < len && (s.target_mask.empty() || s.target_mask[static_cast<size_t>(j)]);
        want.push_back(target ? s.tokens[static_cast<size_t>(j)] : kX);
        want_mask.push_back(target ? 1 : 0);
      }
    }
    Ints labels(want.size(), 12345);
    Bytes mask(want.size(), 9);
    ASSERT_TRUE(ToHfLabels(mb->labels, mb->loss_mask, mb->cu_seqlens_padded, labels, mask).ok());
    ASSERT_EQ(labels, want) << "trial " << trial;
    ASSERT_EQ(mask, want_mask) << "trial " << trial;
    int64_t n = 0;
    for (uint8_t m : mask) n += m;
    ASSERT_EQ(n, mb->n_valid);
  }
}

TEST(HfLabelsTest, RejectsBadArgumentsNamingThem) {
  Ints labels(10, 1), out(10);
  Bytes mask(10, 1), out_mask(10);
  const Ints cu{0, 7, 10};
  ExpectInvalid(ToHfLabels(labels, mask, Ints{0, 7, 11}, out, out_mask),
                {"labels has 10 elements", "T = cu_seqlens_padded[n] = 11"});
  ExpectInvalid(ToHfLabels(labels, Bytes(9, 1), cu, out, out_mask), {"loss_mask has 9"});
  Ints short_out(3);
  Bytes long_mask(11);
  ExpectInvalid(ToHfLabels(labels, mask, cu, short_out, out_mask), {"hf_labels has 3"});
  ExpectInvalid(ToHfLabels(labels, mask, cu, out, long_mask), {"hf_loss_mask has 11"});
  ExpectInvalid(ToHfLabels(labels, mask, Ints{0, 7, 7, 10}, out, out_mask),
                {"ToHfLabels", "cu_seqlens_padded"});
  ExpectInvalid(ToHfLabels(labels, mask, Ints{1, 10}, out, out_mask), {"cu_seqlens_padded[0]"});
  ExpectInvalid(ToHfLabels(labels, mask, Ints{}, out, out_mask), {"ToHfLabels"});
  mask[4] = 2;
  ExpectInvalid(ToHfLabels(labels, mask, cu, out, out_mask), {"loss_mask[4] = 2", "0 or 1"});
}

// The layout of a fixed shape: T is fixed_tokens, the last sequence absorbs the rest; a T
// that is no multiple of the quantum, or below the sequences' own, is refused.
TEST(PackStaticShapes, FixedLayoutAndPaddedOffsets) {
  PackOptions po;
  po.parallel = *ParallelLayout::Create(2, 1, false, 1, 1);  // a = 4
  po.fixed_tokens = 64;
  const std::vector<int64_t> lengths = {7, 3};
  auto l = ComputeLayout(lengths, po);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->cu_seqlens, (std::vector<int32_t>{0, 7, 10}));
  EXPECT_EQ(l->cu_seqlens_padded, (std::vector<int32_t>{0, 8, 64}));
  EXPECT_EQ(l->total_tokens, 64);
  EXPECT_EQ(l->max_seqlen, 56);
  po.fixed_tokens = 66;
  EXPECT_FALSE(ComputeLayout(lengths, po).ok());
  po.fixed_tokens = 8;
  EXPECT_FALSE(ComputeLayout(lengths, po).ok());
  auto padded = PadOffsets(l->cu_seqlens, 4);
  ASSERT_TRUE(padded.ok());
  EXPECT_EQ(*padded, (std::vector<int32_t>{0, 7, 10, 10, 10}));
  EXPECT_EQ(*PadOffsets(l->cu_seqlens, 2), l->cu_seqlens);
  EXPECT_FALSE(PadOffsets(l->cu_seqlens, 1).ok());
  EXPECT_FALSE(PadOffsets({}, 3).ok());
}

}  // namespace
}  // namespace thdpack
