#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "thdpack/wire.h"
#include "wire/coding.h"
#include "wire/step_meta_test_util.h"

namespace thdpack {
namespace {

using wire_test::Contains;
using wire_test::FillTotals;
using wire_test::Reseal;
using wire_test::RoundUp;

// A microbatch of the given real and padded lengths, with its offsets and max_seqlen.
MicrobatchMeta MakeMicrobatch(const std::vector<int64_t>& lengths,
                              const std::vector<int64_t>& padded, int64_t n_valid) {
  MicrobatchMeta mb;
  mb.cu_seqlens.push_back(0);
  mb.cu_seqlens_padded.push_back(0);
  for (size_t i = 0; i < lengths.size(); ++i) {
    mb.cu_seqlens.push_back(static_cast<int32_t>(mb.cu_seqlens.back() + lengths[i]));
    mb.cu_seqlens_padded.push_back(static_cast<int32_t>(mb.cu_seqlens_padded.back() + padded[i]));
    mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(padded[i]));
  }
  mb.n_valid = n_valid;
  return mb;
}

// The golden step of docs/wire_format.md: CP=2, m=4, one microbatch of lengths 3 and 5.
StepMeta GoldenStep() {
  StepMeta meta;
  meta.step = 1;
  meta.epoch = 0;
  meta.dp_size = 1;
  meta.replica = 0;
  meta.parallel = ParallelLayout::Create(2).value();  // pad_multiple 4
  meta.microbatches.push_back(MakeMicrobatch({3, 5}, {4, 8}, 6));
  FillTotals(&meta);
  meta.skipped_ids = {7};
  return meta;
}

// The golden step of version 3 (docs/wire_format.md): the version 1 golden step with rank
// multiple 16, so T/CP = 16: T = 32, the last sequence padded to 28 (4 + 28 = 32).
StepMeta GoldenStepV3() {
  StepMeta meta = GoldenStep();
  meta.parallel = ParallelLayout::Create(2, 1, false, 1, 16).value();
  meta.microbatches = {MakeMicrobatch({3, 5}, {4, 28}, 6)};
  FillTotals(&meta);
  return meta;
}

// A small step that takes the other paths: SP with a tail, explicit padding, two microbatches,
// negative and huge ids, 64-bit step and epoch.
StepMeta SmallExplicitStep() {
  StepMeta meta;
  meta.step = 0xFFFFFFFFFFFFFFF0ull;
  meta.epoch = 1ull << 40;
  meta.dp_size = 4;
  meta.replica = 3;
  meta.parallel = ParallelLayout::Create(2, 3, true).value();  // pad_multiple 4
  // T = 4 + 12 + 8 = 24, a multiple of CP*TP = 6; the last carries 4 tail slots.
  meta.microbatches.push_back(MakeMicrobatch({1, 9, 2}, {4, 12, 8}, 8));
  // Sequence 0 padded by two extra multiples: explicit mode. T = 12 + 12 = 24.
  meta.microbatches.push_back(MakeMicrobatch({5, 10}, {12, 12}, 0));
  FillTotals(&meta, 1000);
  meta.skipped_ids = {-3, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  return meta;
}

// A random valid step. Lengths are log-uniform in [1, 2^max_log2] so that every Rice parameter
// is exercised; padding follows the rule, with SP tails, random extra tails, and (sometimes)
// sequences padded beyond the rule so the explicit mode runs too.
StepMeta RandomStep(std::mt19937_64& rng, int max_log2 = 20, int max_n = 40) {
  StepMeta meta;
  meta.step = rng();
  meta.epoch = rng() >> (rng() % 64);
  meta.dp_size = static_cast<int32_t>(rng() % 64) + 1;
  meta.replica = static_cast<int32_t>(rng() % meta.dp_size);
  const int32_t cps[] = {1, 2, 4, 8, 16};
  const int32_t tps[] = {1, 2, 4, 8};
  const int64_t extras[] = {1, 1, 2, 8, 64, 128};
  const int64_t rank_multiples[] = {1, 1, 1, 2, 16, 128};
  const int32_t cp = cps[rng() % 5];
  const int32_t tp = tps[rng() % 4];
  const bool sp = rng() % 2 == 0;
  const int64_t extra = extras[rng() % 6];
  const int64_t rank_multiple = rank_multiples[rng() % 6];
  meta.parallel = ParallelLayout::Create(cp, tp, sp, extra, rank_multiple).value();
  const int64_t c = cp > 1 ? 2 * cp : 1;
  const int64_t pad_multiple = c * extra;
  EXPECT_EQ(meta.parallel.sequence_alignment(), pad_multiple) << meta.parallel.ToString();
  const bool off_rule = rng() % 4 == 0;
  const int num_mb = static_cast<int>(rng() % 8) + 1;
  for (int m = 0; m < num_mb; ++m) {
    const int n = static_cast<int>(rng() % max_n) + 1;
    std::vector<int64_t> len(n), pad(n);
    int64_t real = 0, total = 0;
    for (int i = 0; i < n; ++i) {
      const int bits = static_cast<int>(rng() % (max_log2 + 1));
      len[i] = static_cast<int64_t>(rng() % (uint64_t{1} << bits)) + 1;
      pad[i] = RoundUp(len[i], pad_multiple);
      if (off_rule && i + 1 < n && rng() % 3 == 0) {
        pad[i] += pad_multiple * static_cast<int64_t>(rng() % 3);
      }
      real += len[i];
      total += pad[i];
    }
    // Tail of the last sequence: stays a multiple of c; makes T a multiple of CP*TP under
    // SP, and of the ranks T is split over times the rank multiple.
    if (rng() % 3 == 0) {
      const int64_t extra = c * static_cast<int64_t>(rng() % 5);
      pad[n - 1] += extra;
      total += extra;
    }
    const int64_t unit = (sp ? int64_t{cp} * tp : cp) * rank_multiple;
    while (total % unit != 0) {
      pad[n - 1] += c;
      total += c;
    }
    const int64_t max_valid = real - n;
    const int64_t n_valid = max_valid == 0 ? 0 : static_cast<int64_t>(rng() % (max_valid + 1));
    meta.microbatches.push_back(MakeMicrobatch(len, pad, n_valid));
  }
  FillTotals(&meta, static_cast<int64_t>(rng() % 100000));
  const int skipped = static_cast<int>(rng() % 6);
  std::set<int64_t> seen;
  while (static_cast<int>(meta.skipped_ids.size()) < skipped) {
    const int64_t id = rng() % 2 ? static_cast<int64_t>(rng()) : static_cast<int64_t>(rng() % 1000);
    if (seen.insert(id).second) meta.skipped_ids.push_back(id);
  }
  return meta;
}

std::vector<uint8_t> Encode(const StepMeta& meta) {
  auto bytes = EncodeStepMeta(meta);
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  return bytes.ok() ? *bytes : std::vector<uint8_t>{};
}

// ---------------------------------------------------------------------------------------------
// Golden bytes.
//
// GoldenStep() encoded by hand from the grammar in docs/wire_format.md:
//   54 48 44 4D   magic "THDM"
//   01            version 1
//   1F 00 00 00   total_length 31, fixed32 little-endian
//   01            step 1                      varint
//   00            epoch 0
//   01            dp_size 1
//   00            replica 0
//   02            cp_size 2
//   01            tp_size 1
//   00            flags: no SP
//   04            pad_multiple 4
//   08            real_tokens 3+5 = 8
//   0C            padded_tokens 4+8 = 12
//   50            sum_sq 4^2+8^2 = 80
//   06            n_loss_tokens 6
//   01            num_microbatches 1
//     02          num_sequences 2
//     01          coding: bit 7 = 0, valid_deficit (8 real - 2 sequences) - n_valid 6 = 0;
//                 bits 5-6 = 0, padding mode "derived": P_i = roundup(L_i, 4) gives 4, 8 as in
//                 the struct, no tail; bits 0-4 = k_len 1: codes of L-1 = 2, 4 take 8 bits at
//                 k=0, 7 at k=1, 7 at k=2, 8 at k=3; the smallest best k is 1
//     22          codes, 7 bits: v=2: q=1 -> "0","1", low bit "0"; v=4: q=2 -> "0","0","1",
//                 low bit "0"; bits 0..6 = 0,1,0,0,0,1,0 (LSB first), bit 7 padding 0:
//                 0b00100010
//   01            num_skipped 1
//   0E            zigzag(7 - 0) = 14
//   63 75 13 66   CRC-32C of the 27 bytes above, 0x66137563 (bitwise reference, computed
//                 separately), fixed32 little-endian
const std::vector<uint8_t> kGoldenBytes = {
    0x54, 0x48, 0x44, 0x4D, 0x01, 0x1F, 0x00, 0x00, 0x00,                    // prefix
    0x01, 0x00, 0x01, 0x00, 0x02, 0x01, 0x00, 0x04, 0x08, 0x0C, 0x50, 0x06,  // step header
    0x01, 0x02, 0x01, 0x22,                                                  // microbatch
    0x01, 0x0E,                                                              // skipped
    0x63, 0x75, 0x13, 0x66};                                                 // crc32c

TEST(WireGoldenTest, EncodesToTheBytesWorkedOutByHand) {
  EXPECT_EQ(Encode(GoldenStep()), kGoldenBytes);
}

TEST(WireGoldenTest, TrailerIsTheCrcOfTheBody) {
  const std::span<const uint8_t> body(kGoldenBytes.data(), kGoldenBytes.size() - 4);
  EXPECT_EQ(Crc32c(body), 0x66137563u);
}

// GoldenStepV3() encoded by hand (docs/wire_format.md, "Worked example, version 3"): the
// version 1 bytes with version 3, rank_multiple 16 after pad_multiple, and the tail mode.
//   54 48 44 4D   magic
//   03            version 3
//   22 00 00 00   total_length 34
//   01 00 01 00   step 1, epoch 0, dp_size 1, replica 0
//   02 01 00 04   cp_size 2, tp_size 1, flags 0 (no SP, no groups), pad_multiple 4
//   10            rank_multiple 16
//   08            real_tokens 8
//   20            padded_tokens 4+28 = 32
//   A0 06         sum_sq 4^2+28^2 = 800 = 0x320: low 7 bits 0x20 | 0x80, then 800 >> 7 = 6
//   06            n_loss_tokens 6
//   01            num_microbatches 1
//     02          num_sequences 2
//     21          coding: mode 1 (derived + tail) << 5 | k_len 1
//     14          tail 20 = 28 - roundup(5, 4)
//     22          codes, as in version 1
//   01 0E         one skipped id, 7
//   87 25 24 05   CRC-32C 0x05242587 of the 30 bytes above (bitwise reference, computed
//                 separately)
const std::vector<uint8_t> kGoldenBytesV3 = {
    0x54, 0x48, 0x44, 0x4D, 0x03, 0x22, 0x00, 0x00, 0x00,                    // prefix
    0x01, 0x00, 0x01, 0x00, 0x02, 0x01, 0x00, 0x04, 0x10,                    // step, layout
    0x08, 0x20, 0xA0, 0x06, 0x06,                                            // totals
    0x01, 0x02, 0x21, 0x14, 0x22,                                            // microbatch
    0x01, 0x0E,                                                              // skipped
    0x87, 0x25, 0x24, 0x05};                                                 // crc32c

TEST(WireGoldenTest, Version3EncodesToTheBytesWorkedOutByHand) {
  EXPECT_EQ(Encode(GoldenStepV3()), kGoldenBytesV3);
  EXPECT_EQ(Crc32c(std::span<const uint8_t>(kGoldenBytesV3.data(), kGoldenBytesV3.size() - 4)),
            0x05242587u);
  auto meta = DecodeStepMeta(kGoldenBytesV3);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  EXPECT_EQ(*meta, GoldenStepV3());
  EXPECT_EQ(meta->parallel.rank_multiple(), 16);
  EXPECT_EQ(meta->microbatches[0].cu_seqlens_padded, (std::vector<int32_t>{0, 4, 32}));
  EXPECT_EQ(meta->microbatches[0].max_seqlen, 28);
}

// Version 3 is written only with a rank multiple: every step without one keeps the bytes of
// version 1 (the golden test above) or 2, so readers of those versions still read it.
TEST(WireGoldenTest, VersionIsTheOldestThatCarriesTheStep) {
  EXPECT_EQ(Encode(GoldenStep())[4], kStepMetaVersionStatic);
  EXPECT_EQ(Encode(GoldenStepV3())[4], kStepMetaVersionRankMultiple);
  EXPECT_EQ(kStepMetaVersion, kStepMetaVersionRankMultiple);
}

// A reader of versions 1 and 2 (every earlier release) refuses version 3 as a newer version,
// never misreads it: its check is `version > 2`, which is what this one applies to 4.
TEST(WireGoldenTest, Version3RefusesRankMultipleOneAndUnknownFlags) {
  // rank_multiple 1 in a version 3 message: not this version's encoding of that step.
  std::vector<uint8_t> msg = kGoldenBytesV3;
  msg[17] = 0x01;
  Reseal(&msg);
  auto one = DecodeStepMeta(msg);
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(one.status(), "byte 17 (rank_multiple)")) << one.status().ToString();
  EXPECT_TRUE(Contains(one.status(), "version 3 carries a rank multiple >= 2"));
  // Flag bit 2 is unknown in version 3; bit 1 (groups) is unknown in version 1.
  msg = kGoldenBytesV3;
  msg[15] = 0x04;
  Reseal(&msg);
  EXPECT_TRUE(Contains(DecodeStepMeta(msg).status(), "unknown bits set in 4"));
  msg = kGoldenBytes;
  msg[15] = 0x02;
  Reseal(&msg);
  EXPECT_TRUE(Contains(DecodeStepMeta(msg).status(), "unknown bits set in 2"));
  // The rank multiple's own rule: T of the microbatch not a multiple of CP * 16 = 32. The tail
  // 20 becomes 12 (T = 24); padded_tokens and sum_sq are made to agree, so the rank rule alone
  // is broken.
  msg = kGoldenBytesV3;
  msg[26] = 12;                       // tail
  msg[19] = 24;                       // padded_tokens
  msg[20] = 0xA0;                     // sum_sq 16 + 400 = 416 = 0x1A0: 0x20 | 0x80, then 3
  msg[21] = 0x03;
  Reseal(&msg);
  auto rank = DecodeStepMeta(msg);
  ASSERT_FALSE(rank.ok());
  EXPECT_TRUE(Contains(rank.status(), "total 24 is not a multiple of 32")) << rank.status().ToString();
  EXPECT_TRUE(Contains(rank.status(), "rank_multiple 16"));
}

TEST(WireGoldenTest, DecodesToTheStruct) {
  auto meta = DecodeStepMeta(kGoldenBytes);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  EXPECT_EQ(*meta, GoldenStep());
  EXPECT_EQ(meta->microbatches[0].cu_seqlens, (std::vector<int32_t>{0, 3, 8}));
  EXPECT_EQ(meta->microbatches[0].cu_seqlens_padded, (std::vector<int32_t>{0, 4, 12}));
  EXPECT_EQ(meta->microbatches[0].max_seqlen, 8);
}

// ---------------------------------------------------------------------------------------------
// Round trips.

TEST(WireRoundTripTest, SmallExplicitStep) {
  const StepMeta meta = SmallExplicitStep();
  ASSERT_TRUE(ValidateStepMeta(meta).ok()) << ValidateStepMeta(meta).ToString();
  const auto bytes = Encode(meta);
  auto back = DecodeStepMeta(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, meta);
  // Microbatch 0 follows the rule (derived), microbatch 1 does not (explicit).
  // Walk the wire: step..num_microbatches, then microbatch 0's mode byte.
  wire::ByteReader r(std::span<const uint8_t>(bytes).subspan(kStepMetaHeaderSize));
  uint64_t v = 0;
  for (int field = 0; field < 6; ++field) ASSERT_TRUE(r.GetVarint64(&v));
  uint8_t b = 0;
  ASSERT_TRUE(r.GetByte(&b));
  EXPECT_EQ(b, 1);  // flags: SP
  for (int field = 0; field < 6; ++field) ASSERT_TRUE(r.GetVarint64(&v));
  EXPECT_EQ(v, 2u);  // num_microbatches
  ASSERT_TRUE(r.GetVarint64(&v));
  EXPECT_EQ(v, 3u);  // num_sequences
  ASSERT_TRUE(r.GetByte(&b));
  EXPECT_EQ(b & 0xE0, 0x80 | 0x20);  // coding: deficit present, mode 1 (derived + tail)
  ASSERT_TRUE(r.GetVarint64(&v));
  EXPECT_EQ(v, 12u - 3u - 8u);  // valid_deficit
  ASSERT_TRUE(r.GetVarint64(&v));
  EXPECT_EQ(v, 4u);  // tail: 8 - roundup(2, 4)
}

TEST(WireRoundTripTest, RandomSteps) {
  std::mt19937_64 rng(42);
  int64_t sequences = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const StepMeta meta = RandomStep(rng);
    ASSERT_TRUE(ValidateStepMeta(meta).ok()) << "trial " << trial << ": "
                                             << ValidateStepMeta(meta).ToString();
    const auto bytes = Encode(meta);
    auto back = DecodeStepMeta(bytes);
    ASSERT_TRUE(back.ok()) << "trial " << trial << ": " << back.status().ToString();
    ASSERT_EQ(*back, meta) << "trial " << trial;
    auto size = StepMetaMessageSize(bytes);
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(*size, bytes.size());
    for (const auto& mb : meta.microbatches) sequences += static_cast<int64_t>(mb.cu_seqlens.size()) - 1;
  }
  EXPECT_GT(sequences, 1000);
}

TEST(WireRoundTripTest, ShortLengthsAndManySequences) {
  std::mt19937_64 rng(9);
  for (int trial = 0; trial < 50; ++trial) {
    const StepMeta meta = RandomStep(rng, /*max_log2=*/3, /*max_n=*/2000);
    auto back = DecodeStepMeta(Encode(meta));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    ASSERT_EQ(*back, meta);
  }
}

TEST(WireRoundTripTest, ExtremeValues) {
  StepMeta meta;
  meta.step = std::numeric_limits<uint64_t>::max();
  meta.epoch = std::numeric_limits<uint64_t>::max();
  meta.dp_size = std::numeric_limits<int32_t>::max();
  meta.replica = std::numeric_limits<int32_t>::max() - 1;
  meta.parallel = ParallelLayout::Create(1, std::numeric_limits<int32_t>::max()).value();
  const int64_t max32 = std::numeric_limits<int32_t>::max();
  // One sequence of 2^31-1 tokens; lengths of 1 (Rice k = 0); one of each near the top.
  meta.microbatches.push_back(MakeMicrobatch({max32}, {max32}, max32 - 1));
  meta.microbatches.push_back(MakeMicrobatch({1, 1, 1, 1}, {1, 1, 1, 1}, 0));
  meta.microbatches.push_back(MakeMicrobatch({max32 / 2, max32 / 2}, {max32 / 2, max32 / 2 + 1}, 0));
  FillTotals(&meta, std::numeric_limits<int64_t>::max() - 2 * max32);
  meta.skipped_ids = {std::numeric_limits<int64_t>::min(), -1, 0, std::numeric_limits<int64_t>::max(), 1};
  auto back = DecodeStepMeta(Encode(meta));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, meta);
}

// The size goal: at most 2 bytes per sequence for typical lengths (lognormal, mean 4096) under
// 64K, all fixed costs of the message included; about 4 times below two int32 arrays.
TEST(WireRoundTripTest, TypicalLengthsTakeAtMostTwoBytesPerSequence) {
  std::mt19937_64 rng(11);
  const double sigma = 1.0;
  std::lognormal_distribution<double> dist(std::log(4096.0) - sigma * sigma / 2, sigma);
  for (int cp : {1, 2, 4, 8}) {
    StepMeta meta;
    meta.parallel = ParallelLayout::Create(cp).value();
    const int64_t pad_multiple = cp > 1 ? 2 * cp : 1;
    int64_t sequences = 0;
    for (int m = 0; m < 8; ++m) {
      std::vector<int64_t> len, pad;
      int64_t total = 0;
      while (total < 128 * 1024) {
        const int64_t l = std::clamp<int64_t>(static_cast<int64_t>(dist(rng)), 1, 65535);
        len.push_back(l);
        pad.push_back(RoundUp(l, pad_multiple));
        total += pad.back();
      }
      sequences += static_cast<int64_t>(len.size());
      // Pretraining: every position but the first of each sequence is a target.
      int64_t real = 0;
      for (int64_t l : len) real += l;
      meta.microbatches.push_back(MakeMicrobatch(len, pad, real - static_cast<int64_t>(len.size())));
    }
    FillTotals(&meta);
    const auto bytes = Encode(meta);
    const double per_seq = static_cast<double>(bytes.size()) / static_cast<double>(sequences);
    EXPECT_LE(per_seq, 2.0) << "cp " << cp << ": " << bytes.size() << " bytes, " << sequences
                            << " sequences";
    EXPECT_LT(bytes.size() * 4, static_cast<size_t>(8 * sequences)) << "cp " << cp;
  }
}

// ---------------------------------------------------------------------------------------------
// Corruption: exhaustive on small messages.

std::vector<std::vector<uint8_t>> SmallMessages() {
  std::mt19937_64 rng(77);
  std::vector<std::vector<uint8_t>> msgs = {kGoldenBytes, kGoldenBytesV3,
                                            Encode(SmallExplicitStep())};
  msgs.push_back(Encode(RandomStep(rng, 12, 4)));
  return msgs;
}

TEST(WireCorruptionTest, EveryTruncationFails) {
  for (const auto& msg : SmallMessages()) {
    for (size_t len = 0; len < msg.size(); ++len) {
      auto r = DecodeStepMeta(std::span<const uint8_t>(msg.data(), len));
      ASSERT_FALSE(r.ok()) << "length " << len << " of " << msg.size();
      EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
    }
  }
}

TEST(WireCorruptionTest, TrailingBytesFail) {
  std::vector<uint8_t> msg = kGoldenBytes;
  msg.push_back(0);
  auto r = DecodeStepMeta(msg);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(r.status(), "trailing bytes")) << r.status().ToString();
}

TEST(WireCorruptionTest, EverySingleBitFlipFails) {
  for (const auto& original : SmallMessages()) {
    std::vector<uint8_t> msg = original;
    for (size_t bit = 0; bit < msg.size() * 8; ++bit) {
      msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      auto r = DecodeStepMeta(msg);
      ASSERT_FALSE(r.ok()) << "bit " << bit;
      EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << "bit " << bit << ": "
                                                            << r.status().ToString();
      msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    }
  }
}

// With the checksum recomputed after the damage, the structure checks stand alone: the decoder
// must fail cleanly, or return a StepMeta that satisfies every rule and round-trips.
void ExpectCleanOrValid(const std::vector<uint8_t>& msg, const std::string& what, int* accepted) {
  auto r = DecodeStepMeta(msg);
  if (!r.ok()) {
    const StatusCode code = r.status().code();
    EXPECT_TRUE(code == StatusCode::kCorruption || code == StatusCode::kUnimplemented)
        << what << ": " << r.status().ToString();
    return;
  }
  ++*accepted;
  EXPECT_TRUE(ValidateStepMeta(*r).ok()) << what;
  auto again = EncodeStepMeta(*r);
  ASSERT_TRUE(again.ok()) << what << ": " << again.status().ToString();
  auto back = DecodeStepMeta(*again);
  ASSERT_TRUE(back.ok()) << what;
  EXPECT_EQ(*back, *r) << what;
}

TEST(WireCorruptionTest, ResealedBitFlipsFailOrStillValidate) {
  int accepted = 0, total = 0;
  for (const auto& original : SmallMessages()) {
    for (size_t bit = kStepMetaHeaderSize * 8; bit < (original.size() - 4) * 8; ++bit) {
      std::vector<uint8_t> msg = original;
      msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      Reseal(&msg);
      ExpectCleanOrValid(msg, "bit " + std::to_string(bit), &accepted);
      ++total;
    }
  }
  // Most flips break a rule (totals are sent and cross-checked); a few change only step, epoch,
  // a skipped id or n_loss_tokens, which any value satisfies.
  EXPECT_LT(accepted, total / 2);
}

TEST(WireCorruptionTest, ResealedByteSubstitutionsFailOrStillValidate) {
  int accepted = 0;
  for (const auto& original : SmallMessages()) {
    for (size_t pos = kStepMetaHeaderSize; pos + 4 < original.size(); ++pos) {
      for (int value = 0; value < 256; ++value) {
        if (value == original[pos]) continue;
        std::vector<uint8_t> msg = original;
        msg[pos] = static_cast<uint8_t>(value);
        Reseal(&msg);
        ExpectCleanOrValid(msg, "byte " + std::to_string(pos) + " = " + std::to_string(value),
                           &accepted);
      }
    }
  }
  EXPECT_GT(accepted, 0);  // e.g. another step number is still a valid message
}

TEST(WireCorruptionTest, ResealedTruncationsAndInsertionsFail) {
  for (const auto& original : SmallMessages()) {
    const std::span<const uint8_t> body(original.data() + kStepMetaHeaderSize,
                                        original.size() - kStepMetaHeaderSize - 4);
    for (size_t cut = 0; cut < body.size(); ++cut) {
      // Body cut short at every point, framed and sealed as if complete.
      std::vector<uint8_t> msg(original.begin(), original.begin() + kStepMetaHeaderSize);
      msg.insert(msg.end(), body.begin(), body.begin() + cut);
      msg.resize(msg.size() + 4);
      Reseal(&msg);
      auto r = DecodeStepMeta(msg);
      EXPECT_FALSE(r.ok()) << "cut " << cut;
      // One zero byte inserted at every point.
      std::vector<uint8_t> longer(original.begin(), original.end() - 4);
      longer.insert(longer.begin() + kStepMetaHeaderSize + cut, 0x00);
      longer.resize(longer.size() + 4);
      Reseal(&longer);
      int accepted = 0;
      ExpectCleanOrValid(longer, "insert at " + std::to_string(cut), &accepted);
    }
  }
}

TEST(WireCorruptionTest, RandomGarbageFailsCleanly) {
  std::mt19937_64 rng(123);
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<uint8_t> msg(rng() % 160);
    for (auto& b : msg) b = static_cast<uint8_t>(rng());
    if (trial % 2 == 1 && msg.size() >= kStepMetaMinSize) {
      // Well framed and sealed: only the body is garbage.
      std::copy(std::begin(kStepMetaMagic), std::end(kStepMetaMagic), msg.begin());
      msg[4] = kStepMetaVersion;
      Reseal(&msg);
      int accepted = 0;
      ExpectCleanOrValid(msg, "trial " + std::to_string(trial), &accepted);
    } else {
      EXPECT_FALSE(DecodeStepMeta(msg).ok()) << "trial " << trial;
    }
  }
}

// Builds a sealed v1 message from body bytes.
std::vector<uint8_t> Sealed(const std::vector<uint8_t>& body, uint8_t version = 1) {
  std::vector<uint8_t> msg(kStepMetaHeaderSize + body.size() + 4, 0);
  std::copy(std::begin(kStepMetaMagic), std::end(kStepMetaMagic), msg.begin());
  msg[4] = version;
  std::copy(body.begin(), body.end(), msg.begin() + kStepMetaHeaderSize);
  Reseal(&msg);
  return msg;
}

// The golden body up to and including num_microbatches (step header), for hand-made bodies.
std::vector<uint8_t> GoldenHeader() {
  return std::vector<uint8_t>(kGoldenBytes.begin() + kStepMetaHeaderSize,
                              kGoldenBytes.begin() + kStepMetaHeaderSize + 12);
}

TEST(WireCorruptionTest, HugeCountsAreRejectedBeforeAllocating) {
  {
    std::vector<uint8_t> body = GoldenHeader();
    wire::PutVarint64(&body, uint64_t{1} << 40);  // num_microbatches
    auto r = DecodeStepMeta(Sealed(body));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_TRUE(Contains(r.status(), "num_microbatches")) << r.status().ToString();
  }
  {
    std::vector<uint8_t> body = GoldenHeader();
    body.push_back(0x01);                        // one microbatch
    wire::PutVarint64(&body, 0x7FFFFFFF);        // 2^31-1 sequences
    body.push_back(0x00);                        // coding: k_len 0, derived, no deficit
    body.insert(body.end(), {0xFF, 0xFF, 0xFF, 0xFF, 0x00});  // 4 code bytes; no skipped ids
    auto r = DecodeStepMeta(Sealed(body));
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status(), "2147483647 sequences need at least 2147483647 bits"))
        << r.status().ToString();
  }
  {
    std::vector<uint8_t> body = GoldenHeader();
    body.insert(body.end(), {0x01, 0x02, 0x01, 0x22});  // the golden microbatch
    wire::PutVarint64(&body, uint64_t{1} << 62);  // num_skipped
    auto r = DecodeStepMeta(Sealed(body));
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status(), "num_skipped")) << r.status().ToString();
  }
  {
    std::vector<uint8_t> body = GoldenHeader();
    body.insert(body.end(), {0x01, 0x02, 0x1F});  // k_len 31: 64 bits at least
    body.push_back(0x22);
    auto r = DecodeStepMeta(Sealed(body));
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status(), "2 sequences need at least 64 bits")) << r.status().ToString();
  }
}

TEST(WireCorruptionTest, OffsetsThatOverflowInt32AreRejected) {
  // Two sequences of 2^31-1 tokens each, k_len = 31: codes "1" + 31 low bits each.
  std::vector<uint8_t> stream;
  wire::BitWriter w(&stream);
  w.PutRice(0x7FFFFFFE, 31);
  w.PutRice(0x7FFFFFFE, 31);
  w.Finish();
  std::vector<uint8_t> body = GoldenHeader();
  body.insert(body.end(), {0x01, 0x02, 31});  // M, n, coding: k_len 31, derived
  body.insert(body.end(), stream.begin(), stream.end());
  body.push_back(0x00);  // no skipped ids
  auto r = DecodeStepMeta(Sealed(body));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(r.status(), "overflows int32")) << r.status().ToString();
}

TEST(WireCorruptionTest, TotalsAreCrossChecked) {
  std::vector<uint8_t> msg = kGoldenBytes;
  msg[kStepMetaHeaderSize + 8] = 0x09;  // real_tokens 9 instead of 8
  Reseal(&msg);
  auto r = DecodeStepMeta(msg);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(r.status(), "StepMeta.real_tokens")) << r.status().ToString();
}

// The layout fields on the wire (cp_size, tp_size, the flags' SP bit, pad_multiple) become a
// ParallelLayout through ParallelLayout::FromWire before any microbatch is read: a value it
// rejects is Corruption naming the field and the rule broken. (A StepMeta's layout is valid by
// construction, so these rules, once ValidateStepMeta's, are checked here.)
TEST(WireCorruptionTest, ParallelLayoutFields) {
  // Golden body: step, epoch, dp_size, replica, cp_size, tp_size, flags, pad_multiple, ...
  constexpr size_t kCp = kStepMetaHeaderSize + 4;
  constexpr size_t kTp = kCp + 1;
  constexpr size_t kPad = kCp + 3;
  struct Case {
    const char* name;
    size_t pos;
    uint8_t value;
    const char* expect;
  };
  const Case cases[] = {
      {"cp_size zero", kCp, 0, "(cp_size): is 0: must be >= 1"},
      {"tp_size zero", kTp, 0, "(tp_size): is 0: must be >= 1"},
      {"pad_multiple zero", kPad, 0, "pad_multiple = 0: must be in [1, 2^31) and a multiple of 4"},
      {"pad_multiple not 2cp", kPad, 6,
       "pad_multiple = 6: must be in [1, 2^31) and a multiple of 4 (2*cp_size when cp_size > 1)"},
      {"cp_size 3 needs 6", kCp, 3, "pad_multiple = 4: must be in [1, 2^31) and a multiple of 6"},
  };
  for (const Case& c : cases) {
    std::vector<uint8_t> msg = kGoldenBytes;
    msg[c.pos] = c.value;
    Reseal(&msg);
    auto r = DecodeStepMeta(msg);
    ASSERT_FALSE(r.ok()) << c.name;
    const std::string what = std::string(c.name) + ": " + r.status().ToString();
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << what;
    EXPECT_TRUE(Contains(r.status(), "step metadata: byte ")) << what;
    EXPECT_TRUE(Contains(r.status(), c.expect)) << what;
  }

  // Multi-byte values: a body with the golden step's fields around the given layout.
  auto body_with = [](uint64_t cp, uint64_t tp, uint8_t flags, uint64_t pad_multiple) {
    const std::vector<uint8_t> golden = GoldenHeader();
    std::vector<uint8_t> body(golden.begin(), golden.begin() + 4);  // step .. replica
    wire::PutVarint64(&body, cp);
    wire::PutVarint64(&body, tp);
    body.push_back(flags);
    wire::PutVarint64(&body, pad_multiple);
    body.insert(body.end(), golden.begin() + 8, golden.end());  // real_tokens .. n_loss_tokens
    body.insert(body.end(), {0x01, 0x02, 0x01, 0x22});  // the golden microbatch
    body.insert(body.end(), {0x01, 0x0E});              // its skipped id
    return Sealed(body);
  };
  // The golden layout written this way decodes: the cases below differ only in the layout.
  auto golden = DecodeStepMeta(body_with(2, 1, 0, 4));
  ASSERT_TRUE(golden.ok()) << golden.status().ToString();
  EXPECT_EQ(*golden, GoldenStep());

  auto huge = DecodeStepMeta(body_with(2, 1, 0, uint64_t{1} << 32));
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(huge.status(), "(pad_multiple): value 4294967296 exceeds its limit"))
      << huge.status().ToString();
  // Each field fits int32, but with SP the token quantum CP*TP does not: Create's OutOfRange
  // arrives as Corruption.
  auto quantum = DecodeStepMeta(body_with(65536, 65536, 0x01, 131072));
  ASSERT_FALSE(quantum.ok());
  EXPECT_EQ(quantum.status().code(), StatusCode::kCorruption) << quantum.status().ToString();
  EXPECT_TRUE(Contains(quantum.status(), "cp_size * tp_size = 65536 * 65536 exceeds int32"))
      << quantum.status().ToString();
  // Without SP the same sizes are a valid layout; the step then fails on its padding instead.
  auto no_sp = DecodeStepMeta(body_with(65536, 65536, 0x00, 131072));
  ASSERT_FALSE(no_sp.ok());
  EXPECT_FALSE(Contains(no_sp.status(), "cp_size * tp_size")) << no_sp.status().ToString();
}

TEST(WireCorruptionTest, NonZeroPaddingBitsAreRejected) {
  std::vector<uint8_t> msg = kGoldenBytes;
  msg[24] = 0xA2;  // the code byte 0x22 with padding bit 7 set
  Reseal(&msg);
  auto r = DecodeStepMeta(msg);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status(), "padding bits")) << r.status().ToString();
}

TEST(WireCorruptionTest, MagicAndVersion) {
  std::vector<uint8_t> msg = kGoldenBytes;
  msg[0] = 'X';
  auto bad_magic = DecodeStepMeta(msg);
  ASSERT_FALSE(bad_magic.ok());
  EXPECT_EQ(bad_magic.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(bad_magic.status(), "magic")) << bad_magic.status().ToString();

  msg = kGoldenBytes;
  msg[4] = kStepMessageVersion + 1;  // a well-formed message from a newer writer
  Reseal(&msg);
  auto newer = DecodeStepMeta(msg);
  ASSERT_FALSE(newer.ok());
  EXPECT_EQ(newer.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(newer.status(),
                       "version " + std::to_string(kStepMessageVersion + 1) + " is newer"))
      << newer.status().ToString();
  // A version 1 body under version 4 (the step message): read as one, and corrupt.
  msg[4] = kStepMessageVersion;
  Reseal(&msg);
  auto misread = DecodeStepMeta(msg);
  ASSERT_FALSE(misread.ok());
  EXPECT_EQ(misread.status().code(), StatusCode::kCorruption) << misread.status().ToString();

  msg[4] = 0;
  Reseal(&msg);
  auto zero = DecodeStepMeta(msg);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(zero.status(), "version 0")) << zero.status().ToString();

  msg = kGoldenBytes;
  msg[29] ^= 0x10;  // the checksum itself
  auto crc = DecodeStepMeta(msg);
  ASSERT_FALSE(crc.ok());
  EXPECT_TRUE(Contains(crc.status(), "checksum mismatch")) << crc.status().ToString();
}

TEST(WireCorruptionTest, MessageSizeFromPrefix) {
  auto size = StepMetaMessageSize(std::span<const uint8_t>(kGoldenBytes.data(), kStepMetaHeaderSize));
  ASSERT_TRUE(size.ok()) << size.status().ToString();
  EXPECT_EQ(*size, 31u);
  auto short_prefix = StepMetaMessageSize(std::span<const uint8_t>(kGoldenBytes.data(), 8));
  ASSERT_FALSE(short_prefix.ok());
  EXPECT_EQ(short_prefix.status().code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> tiny = kGoldenBytes;
  tiny[5] = 12;  // below the minimum of 13
  tiny[6] = 0;
  auto too_small = StepMetaMessageSize(tiny);
  ASSERT_FALSE(too_small.ok());
  EXPECT_EQ(too_small.status().code(), StatusCode::kCorruption);
}

// ---------------------------------------------------------------------------------------------
// Validation: one case per rule, each named in the message; the encoder refuses the same.

struct RuleCase {
  const char* name;
  void (*mutate)(StepMeta*);
  const char* expect;  // text the message must contain
  StatusCode code = StatusCode::kInvalidArgument;
};

MicrobatchMeta& Mb0(StepMeta* m) { return m->microbatches[0]; }

const RuleCase kRuleCases[] = {
    {"dp_size", [](StepMeta* m) { m->dp_size = 0; }, "StepMeta.dp_size = 0"},
    {"replica high", [](StepMeta* m) { m->replica = m->dp_size; }, "StepMeta.replica = 1"},
    {"replica negative", [](StepMeta* m) { m->replica = -1; }, "StepMeta.replica = -1"},
    // cp_size, tp_size and pad_multiple are a ParallelLayout, valid by construction: their
    // rules are checked where bytes become a layout (WireCorruptionTest.ParallelLayoutFields).
    {"no microbatches", [](StepMeta* m) { m->microbatches.clear(); },
     "StepMeta.microbatches is empty"},
    {"no sequences", [](StepMeta* m) { Mb0(m).cu_seqlens = {0}; Mb0(m).cu_seqlens_padded = {0}; },
     "StepMeta.microbatches[0].cu_seqlens has 1 entries"},
    {"padded count", [](StepMeta* m) { Mb0(m).cu_seqlens_padded.push_back(16); },
     "StepMeta.microbatches[0].cu_seqlens_padded has 4 entries but cu_seqlens has 3"},
    {"cu start", [](StepMeta* m) { Mb0(m).cu_seqlens[0] = 1; },
     "StepMeta.microbatches[0].cu_seqlens[0] = 1: must start at 0"},
    {"cu padded start", [](StepMeta* m) { Mb0(m).cu_seqlens_padded[0] = -4; },
     "StepMeta.microbatches[0].cu_seqlens_padded[0] = -4"},
    {"not increasing", [](StepMeta* m) { Mb0(m).cu_seqlens[2] = 3; },
     "StepMeta.microbatches[0].cu_seqlens (sequence 1): cu_seqlens[2] = 3 is not greater than "
     "cu_seqlens[1] = 3"},
    {"padded below real", [](StepMeta* m) { Mb0(m).cu_seqlens[1] = 5; },
     "StepMeta.microbatches[0].cu_seqlens_padded (sequence 0): padded length 4 is smaller than "
     "the real length 5"},
    {"padded not multiple", [](StepMeta* m) { Mb0(m).cu_seqlens_padded = {0, 6, 14}; },
     "StepMeta.microbatches[0].cu_seqlens_padded (sequence 0): padded length 6 is not a multiple "
     "of pad_multiple 4"},
    {"last below roundup", [](StepMeta* m) { Mb0(m).cu_seqlens_padded[2] = 10; },
     "(sequence 1): padded length 6 of the last sequence is below roundup(5, pad_multiple 4) = 8"},
    {"last not zigzag multiple", [](StepMeta* m) { Mb0(m).cu_seqlens_padded[2] = 14; },
     "(sequence 1): padded length 10 of the last sequence is not a multiple of 2*cp_size = 4"},
    {"max_seqlen", [](StepMeta* m) { Mb0(m).max_seqlen = 4; },
     "StepMeta.microbatches[0].max_seqlen = 4: must equal the largest padded length 8"},
    {"sp total", [](StepMeta* m) { m->parallel = ParallelLayout::Create(2, 8, true).value(); },
     "StepMeta.microbatches[0].cu_seqlens_padded: total 12 is not a multiple of "
     "cp_size*tp_size = 16"},
    {"n_valid high", [](StepMeta* m) { Mb0(m).n_valid = 7; },
     "StepMeta.microbatches[0].n_valid = 7: must be in [0, 6]"},
    {"n_valid negative", [](StepMeta* m) { Mb0(m).n_valid = -1; },
     "StepMeta.microbatches[0].n_valid = -1"},
    {"real_tokens", [](StepMeta* m) { m->real_tokens = 9; },
     "StepMeta.real_tokens = 9: must equal the sum of the microbatches' cu_seqlens[n] = 8"},
    {"padded_tokens", [](StepMeta* m) { m->padded_tokens = 16; },
     "StepMeta.padded_tokens = 16: must equal"},
    {"sum_sq", [](StepMeta* m) { m->sum_sq = 144; }, "StepMeta.sum_sq = 144: must equal"},
    {"n_loss_tokens", [](StepMeta* m) { m->n_loss_tokens = 5; },
     "StepMeta.n_loss_tokens = 5: the global loss-token count cannot be below"},
    {"skipped duplicate", [](StepMeta* m) { m->skipped_ids = {7, -2, 7}; },
     "StepMeta.skipped_ids: id 7 appears more than once"},
    {"sums overflow",
     [](StepMeta* m) {
       const int64_t big = std::numeric_limits<int32_t>::max();
       for (int i = 0; i < 3; ++i) m->microbatches.push_back(MakeMicrobatch({big - 3}, {big - 3}, 0));
     },
     "the step's token sums overflow int64", StatusCode::kOutOfRange},
};

TEST(WireValidateTest, GoldenAndSmallStepsAreValid) {
  EXPECT_TRUE(ValidateStepMeta(GoldenStep()).ok());
  EXPECT_TRUE(ValidateStepMeta(SmallExplicitStep()).ok());
}

TEST(WireValidateTest, EachRuleIsNamed) {
  for (const RuleCase& c : kRuleCases) {
    StepMeta meta = GoldenStep();
    c.mutate(&meta);
    const Status s = ValidateStepMeta(meta);
    ASSERT_FALSE(s.ok()) << c.name;
    EXPECT_EQ(s.code(), c.code) << c.name << ": " << s.ToString();
    EXPECT_TRUE(Contains(s, c.expect)) << c.name << ": got \"" << s.message() << "\"";
    auto encoded = EncodeStepMeta(meta);
    ASSERT_FALSE(encoded.ok()) << c.name;
    EXPECT_EQ(encoded.status(), s) << c.name;
  }
}

TEST(WireValidateTest, LaterMicrobatchAndSequenceAreNamed) {
  std::mt19937_64 rng(5);
  StepMeta meta;
  while (meta.microbatches.size() < 3 || meta.microbatches[2].cu_seqlens.size() < 6) {
    meta = RandomStep(rng);
  }
  meta.microbatches[2].cu_seqlens[5] = meta.microbatches[2].cu_seqlens[4];
  const Status s = ValidateStepMeta(meta);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, "StepMeta.microbatches[2].cu_seqlens (sequence 4)")) << s.ToString();
}

}  // namespace
}  // namespace thdpack
