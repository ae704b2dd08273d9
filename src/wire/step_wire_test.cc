// The step's messages (thdpack/step_wire.h; docs/wire_format.md, "The step's messages"): golden
// bytes worked out by hand from the grammar for each new message, round trips on fresh random
// values, every single-bit flip and every truncation refused as Corruption, and each rule of
// the decoders with a good checksum (so that the rule, not the checksum, must catch it).
#include "thdpack/step_wire.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "wire/coding.h"

namespace thdpack {
namespace {

bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// ---------------------------------------------------------------------------------------------
// Golden bytes. Each constant is written from the grammar of docs/wire_format.md by hand; the
// CRC-32C trailers were computed separately with the bitwise definition (not with this
// library), and are checked against the library's Crc32c only as a cross-check below.

// The step message of the doc's worked example (version 4): the metadata of the version 1
// golden step (DP 1, CP 2, one microbatch of real lengths 3 and 5 padded to 4 and 8, skipped
// id 7) with the rank multiple 1 written, then the position (3 samples consumed, no cursor),
// 2 sequences with a loss token, no blend, no sample fields, the ids 10 and 12, every position
// but the first a target, and the checksums of one shard's 4 arrays (values chosen here).
const std::vector<uint8_t> kGoldenMessage = {
    0x54, 0x48, 0x44, 0x4D,  // magic "THDM"
    0x04,                    // version 4
    0x3B, 0x00, 0x00, 0x00,  // total_length 59
    0x01, 0x00, 0x01, 0x00,  // step 1, epoch 0, dp_size 1, replica 0
    0x02, 0x01, 0x00,        // cp_size 2, tp_size 1, flags 0
    0x04, 0x01,              // pad_multiple 4, rank_multiple 1
    0x08, 0x0C, 0x50, 0x06,  // real 8, padded 12, sum_sq 80, N 6
    0x01,                    // num_microbatches 1
    0x02, 0x01, 0x22,        //   n 2, coding (k_len 1, mode 0), codes of 2, 4
    0x01, 0x0E,              // one skipped id: zigzag(7) = 14
    0x03, 0x00,              // position: consumed 3, no cursor
    0x02,                    // n_loss_sequences 2
    0x00,                    // sequence flags: no sources
    0x00,                    // no sample fields
    0x14, 0x04,              // ids: zigzag(10 - 0) = 20, zigzag(12 - 10) = 4
    0x00, 0x00,              // deficits: n_targets = L - 1 = 2 and 4
    0x04, 0x01,              // arrays_per_shard 4, shards_per_microbatch 1
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08,  // checksums 0x04030201, 0x08070605,
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F, 0x10,  //   0x0C0B0A09, 0x100F0E0D
    0x95, 0x4F, 0x13, 0xBE,  // CRC-32C of bytes 0..54 = 0xBE134F95
};

StepMessage GoldenMessage() {
  StepMessage msg;
  StepMeta& meta = msg.meta;
  meta.step = 1;
  meta.dp_size = 1;
  meta.parallel = ParallelLayout::Create(2, 1).value();
  MicrobatchMeta mb;
  mb.cu_seqlens = {0, 3, 8};
  mb.cu_seqlens_padded = {0, 4, 12};
  mb.max_seqlen = 8;
  mb.n_valid = 6;
  meta.microbatches = {mb};
  meta.real_tokens = 8;
  meta.padded_tokens = 12;
  meta.sum_sq = 80;
  meta.n_loss_tokens = 6;
  meta.skipped_ids = {7};
  msg.after.consumed = 3;
  msg.n_loss_sequences = 2;
  MicrobatchSequences q;
  q.ids = {10, 12};
  q.n_targets = {2, 4};
  msg.sequences = {q};
  msg.arrays_per_shard = 4;
  msg.shards_per_microbatch = 1;
  msg.shard_checksums = {0x04030201u, 0x08070605u, 0x0C0B0A09u, 0x100F0E0Du};
  return msg;
}

// A size frame: 59 as fixed64, then the trailer (kind 5, version 4, 00 00, CRC-32C).
const std::vector<uint8_t> kGoldenSize = {0x3B, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                          0x05, 0x04, 0x00, 0x00, 0x18, 0x49, 0x53, 0xE5};

// A lengths header: count 2, first_id 100, id_span 3, epoch 1, no position, nothing truncated.
std::vector<uint8_t> GoldenLengthsHeader() {
  std::vector<uint8_t> b(64, 0);
  b[0] = 0x02;   // count
  b[8] = 0x64;   // first_id 100
  b[16] = 0x03;  // id_span
  b[24] = 0x01;  // epoch
  for (uint8_t t : {0x01, 0x04, 0x00, 0x00, 0x32, 0xC1, 0xC6, 0x70}) b.push_back(t);
  return b;
}

// Lengths: two records (offset 0, L 5, n_targets 4) and (offset 2, L 3, n_targets 1).
const std::vector<uint8_t> kGoldenLengths = {
    0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00,  // record 0
    0x02, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // record 1
    0x02, 0x04, 0x00, 0x00, 0x28, 0xD7, 0x8D, 0xA8};                          // trailer

// A position: 7 consumed, a plain cursor (epoch 0, position 7, next_id 7, skipped_empty 0,
// byte_offset 0, line 0, epoch_size 20, written as 20 - (-1) = 21).
const std::vector<uint8_t> kGoldenPosition = {
    0x07, 0x01,                                // consumed 7, a cursor
    0x00,                                      // shape: plain
    0x00, 0x07, 0x07, 0x00, 0x00, 0x00, 0x15,  // its 7 integers
    0x03, 0x04, 0x00, 0x00, 0xD8, 0x0F, 0xD0, 0xF8};

// A splitting source's position: 9 consumed; its cursor (epoch 0, position 5, next_id 11,
// skipped_empty 2, byte_offset 0, line 0, epoch_size -1 written as 0), split = {piece 1, extra
// ids 3, samples 1, pieces 2, lost targets 0}, and the inner plain cursor (position 5, next_id
// 8, skipped_empty 2, epoch_size 20).
const std::vector<uint8_t> kGoldenSplitPosition = {
    0x09, 0x01, 0x02,                          // consumed 9, a cursor, shape 2 (split)
    0x00, 0x05, 0x0B, 0x02, 0x00, 0x00, 0x00,  // its 7 integers
    0x05, 0x01, 0x03, 0x01, 0x02, 0x00,        // split: 5 values
    0x00, 0x00, 0x05, 0x08, 0x02, 0x00, 0x00, 0x15,  // inner: shape 0, its 7 integers
    0x03, 0x04, 0x00, 0x00, 0x60, 0xAA, 0xF9, 0x54};

// Groups (0, +2) and (2, +2) of a domain of 4.
const std::vector<uint8_t> kGoldenGroups = {0x02, 0x00, 0x02, 0x02, 0x02, 0x06, 0x04,
                                            0x00, 0x00, 0xA1, 0x22, 0x47, 0x77};

// The job of one entry, ("cp", "2").
const std::vector<uint8_t> kGoldenJob = {0x01, 0x02, 0x63, 0x70, 0x01, 0x32, 0x07,
                                         0x04, 0x00, 0x00, 0x19, 0x7A, 0xAF, 0x5E};

// A samples block: one sample's tokens 5 and 6 (no mask, no fields, already 4-aligned).
const std::vector<uint8_t> kGoldenSamples = {0x05, 0x00, 0x00, 0x00, 0x06, 0x00, 0x00, 0x00,
                                             0x04, 0x04, 0x00, 0x00, 0x67, 0xDC, 0x4F, 0x89};

StepPosition GoldenPosition() {
  SourceCursor c;
  c.position = 7;
  c.next_id = 7;
  c.epoch_size = 20;
  return StepPosition{7, c};
}

StepPosition GoldenSplitPosition() {
  SourceCursor inner;
  inner.position = 5;
  inner.next_id = 8;
  inner.skipped_empty = 2;
  inner.epoch_size = 20;
  SourceCursor c;
  c.position = 5;
  c.next_id = 11;
  c.skipped_empty = 2;
  c.epoch_size = -1;
  c.split = {1, 3, 1, 2, 0};
  c.parts = {inner};
  return StepPosition{9, c};
}

TEST(StepWireGoldenTest, StepMessageEncodesToTheBytesWorkedOutByHand) {
  auto bytes = EncodeStepMessage(GoldenMessage());
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ(*bytes, kGoldenMessage);
  auto back = DecodeStepMessage(kGoldenMessage);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(*back == GoldenMessage());
  // The metadata reader reads a step message's metadata too.
  auto meta = DecodeStepMeta(kGoldenMessage);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  EXPECT_TRUE(*meta == GoldenMessage().meta);
  const StepMessage golden = GoldenMessage();
  EXPECT_EQ(golden.ShardChecksums(0, 0)[3], 0x100F0E0Du);
}

TEST(StepWireGoldenTest, FramesEncodeToTheBytesWorkedOutByHand) {
  const auto size = EncodeSizeFrame(59);
  EXPECT_EQ(std::vector<uint8_t>(size.begin(), size.end()), kGoldenSize);
  LengthsHeader h;
  h.count = 2;
  h.first_id = 100;
  h.id_span = 3;
  h.epoch = 1;
  const auto header = EncodeLengthsHeader(h);
  EXPECT_EQ(std::vector<uint8_t>(header.begin(), header.end()), GoldenLengthsHeader());
  const std::vector<SampleRecord> records = {{0, 5, 4, 0, 0}, {2, 3, 1, 0, 0}};
  std::vector<uint8_t> lengths;
  EncodeLengths(records, RecordColumns{}, &lengths);
  EXPECT_EQ(lengths, kGoldenLengths);
  EXPECT_EQ(EncodePositionFrame(GoldenPosition()), kGoldenPosition);
  EXPECT_EQ(EncodePositionFrame(GoldenSplitPosition()), kGoldenSplitPosition);
  const std::vector<std::pair<int, int>> groups = {{0, 2}, {2, 2}};
  EXPECT_EQ(EncodeGroupsFrame(groups), kGoldenGroups);
  const std::vector<JobEntry> job = {{"cp", "2"}};
  EXPECT_EQ(EncodeJobFrame(job), kGoldenJob);
  EXPECT_TRUE(DecodeJobFrame(kGoldenJob).value() == job);
  std::vector<uint8_t> samples = {0x05, 0, 0, 0, 0x06, 0, 0, 0};
  AppendFrameTrailer(FrameKind::kSamples, &samples);
  EXPECT_EQ(samples, kGoldenSamples);

  EXPECT_EQ(DecodeSizeFrame(kGoldenSize, 0, 100).value(), 59);
  EXPECT_TRUE(DecodeLengthsHeader(GoldenLengthsHeader()).value() == h);
  std::vector<SampleRecord> back;
  ASSERT_TRUE(DecodeLengths(kGoldenLengths, RecordColumns{}, 3, &back).ok());
  EXPECT_TRUE(back == records);
  EXPECT_TRUE(DecodePositionFrame(kGoldenPosition).value() == GoldenPosition());
  EXPECT_TRUE(DecodePositionFrame(kGoldenSplitPosition).value() == GoldenSplitPosition());
  EXPECT_TRUE(DecodeGroupsFrame(kGoldenGroups, 4).value() == groups);
  auto body = OpenFrame(kGoldenSamples, FrameKind::kSamples);
  ASSERT_TRUE(body.ok()) << body.status().ToString();
  EXPECT_EQ(body->size(), 8u);
}

// The trailers worked out separately agree with the library's CRC-32C.
TEST(StepWireGoldenTest, TrailersAreTheCrcOfWhatPrecedesThem) {
  for (const auto& frame : {kGoldenSize, GoldenLengthsHeader(), kGoldenLengths, kGoldenPosition,
                            kGoldenSplitPosition, kGoldenGroups, kGoldenJob, kGoldenSamples}) {
    const size_t n = frame.size();
    EXPECT_EQ(wire::DecodeFixed32(frame.data() + n - 4),
              Crc32c(std::span<const uint8_t>(frame.data(), n - 4)));
  }
}

// ---------------------------------------------------------------------------------------------
// Random values.

MicrobatchMeta Microbatch(const std::vector<int64_t>& len, const std::vector<int64_t>& pad,
                          int64_t n_valid) {
  MicrobatchMeta mb;
  mb.cu_seqlens = {0};
  mb.cu_seqlens_padded = {0};
  for (size_t i = 0; i < len.size(); ++i) {
    mb.cu_seqlens.push_back(static_cast<int32_t>(mb.cu_seqlens.back() + len[i]));
    mb.cu_seqlens_padded.push_back(static_cast<int32_t>(mb.cu_seqlens_padded.back() + pad[i]));
    mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(pad[i]));
  }
  mb.n_valid = n_valid;
  return mb;
}

SourceCursor PlainCursor(std::mt19937_64& rng) {
  SourceCursor c;
  c.epoch = static_cast<int64_t>(rng() % 100);
  c.position = static_cast<int64_t>(rng() >> 2);
  c.next_id = static_cast<int64_t>(rng() >> (1 + rng() % 63));
  c.skipped_empty = static_cast<int64_t>(rng() % 1000);
  c.byte_offset = rng() % 2 ? static_cast<int64_t>(rng() >> 1) : 0;
  c.line = static_cast<int64_t>(rng() % 100000);
  c.epoch_size = rng() % 4 == 0 ? -1 : static_cast<int64_t>(rng() >> 3);
  return c;
}

// A cursor of any shape: plain, a blend of plain (or splitting) parts, a splitting source
// around either.
SourceCursor RandomCursor(std::mt19937_64& rng) {
  SourceCursor c = PlainCursor(rng);
  if (rng() % 3 == 0) {  // a blend
    const int parts = static_cast<int>(rng() % 4) + 1;
    for (int d = 0; d < parts; ++d) {
      SourceCursor p = PlainCursor(rng);
      if (rng() % 4 == 0) {
        SourceCursor wrapper = PlainCursor(rng);
        wrapper.split = {1, 2, 3, 4, static_cast<int64_t>(rng() >> 1)};
        wrapper.parts = {p};
        p = wrapper;
      }
      c.parts.push_back(p);
      c.taken.push_back(static_cast<int64_t>(rng() >> 2));
    }
  }
  if (rng() % 3 == 0) {  // a splitting source around it
    SourceCursor wrapper = PlainCursor(rng);
    wrapper.split = {static_cast<int64_t>(rng() % 5), static_cast<int64_t>(rng() % 100), 7, 9, 0};
    wrapper.parts = {c};
    c = wrapper;
  }
  return c;
}

// A random valid message: a static step (CP in 1, 2, 4) or a dynamic one (a group of one or
// an idle microbatch, each), sequences of the microbatches' sizes, maybe a blend, 0-2 sample
// fields, a position with or without a cursor, and shard checksums or none.
StepMessage RandomMessage(std::mt19937_64& rng) {
  StepMessage msg;
  StepMeta& meta = msg.meta;
  meta.step = rng();
  meta.epoch = rng() % 7;
  const int cps[] = {1, 2, 4};
  const int cp = cps[rng() % 3];
  meta.dp_size = static_cast<int32_t>(rng() % 4) + 1;
  meta.replica = static_cast<int32_t>(rng() % static_cast<uint64_t>(meta.dp_size));
  meta.parallel = ParallelLayout::Create(cp, 1).value();
  const bool dynamic = rng() % 3 == 0;
  if (dynamic) meta.domain_rank = meta.replica * cp + static_cast<int32_t>(rng() % cp);
  const int num_mb = static_cast<int>(rng() % 4) + 1;
  msg.blend = rng() % 2 == 0;
  const int num_fields = static_cast<int>(rng() % 3);
  for (int f = 0; f < num_fields; ++f) {
    msg.sample_field_bytes.push_back(static_cast<int64_t>(1 + rng() % 16));
  }
  int64_t n_valid_sum = 0;
  int64_t id = static_cast<int64_t>(rng() % 1000);
  for (int m = 0; m < num_mb; ++m) {
    MicrobatchSequences q;
    if (dynamic && rng() % 3 == 0) {  // idle
      meta.groups.push_back(MicrobatchGroup{0, 0});
      meta.microbatches.push_back(MicrobatchMeta{{0}, {0}, 0, 0});
      msg.sequences.push_back(q);
      continue;
    }
    // A group of one (its layout pads to 1), or the step's layout.
    const int64_t pm = dynamic ? 1 : meta.parallel.sequence_alignment();
    if (dynamic) meta.groups.push_back(MicrobatchGroup{meta.domain_rank, 1});
    const int n = static_cast<int>(rng() % 12) + 1;
    std::vector<int64_t> len(static_cast<size_t>(n)), pad(static_cast<size_t>(n));
    int64_t real = 0;
    for (int i = 0; i < n; ++i) {
      len[static_cast<size_t>(i)] = static_cast<int64_t>(1 + rng() % (rng() % 2 ? 9 : 5000));
      pad[static_cast<size_t>(i)] = (len[static_cast<size_t>(i)] + pm - 1) / pm * pm;
      real += len[static_cast<size_t>(i)];
      const int64_t most = len[static_cast<size_t>(i)] - 1;
      q.ids.push_back(id);
      id += rng() % 3 == 0 ? -static_cast<int64_t>(rng() % 50) : static_cast<int64_t>(rng() % 50);
      q.n_targets.push_back(rng() % 2 ? most : static_cast<int64_t>(rng() % (most + 1)));
      if (msg.blend) q.sources.push_back(static_cast<int32_t>(rng() % 5));
    }
    if (rng() % 5 == 0) q.ids[0] = std::numeric_limits<int64_t>::min();  // any int64 id
    const int64_t n_valid = static_cast<int64_t>(rng() % static_cast<uint64_t>(real - n + 1));
    meta.microbatches.push_back(Microbatch(len, pad, n_valid));
    n_valid_sum += n_valid;
    for (int64_t b : msg.sample_field_bytes) {
      std::vector<std::byte> rows(static_cast<size_t>(n * b));
      for (auto& x : rows) x = static_cast<std::byte>(rng());
      q.sample_fields.push_back(std::move(rows));
    }
    msg.sequences.push_back(std::move(q));
  }
  for (const MicrobatchMeta& mb : meta.microbatches) {
    meta.real_tokens += mb.cu_seqlens.back();
    meta.padded_tokens += mb.cu_seqlens_padded.back();
    for (size_t i = 0; i + 1 < mb.cu_seqlens_padded.size(); ++i) {
      const int64_t p = int64_t{mb.cu_seqlens_padded[i + 1]} - mb.cu_seqlens_padded[i];
      meta.sum_sq += p * p;
    }
  }
  meta.n_loss_tokens = n_valid_sum + static_cast<int64_t>(rng() % 100);
  if (rng() % 2) meta.skipped_ids = {static_cast<int64_t>(rng()), -5};
  msg.after.consumed = static_cast<int64_t>(rng() >> 1);
  if (rng() % 4 != 0) msg.after.cursor = RandomCursor(rng);
  msg.n_loss_sequences = static_cast<int64_t>(rng() % 10000);
  if (rng() % 4 != 0) {
    msg.arrays_per_shard = static_cast<int32_t>(4 + rng() % 3);
    msg.shards_per_microbatch = dynamic ? 1 : cp;
    size_t busy = 0;
    for (size_t m = 0; m < meta.microbatches.size(); ++m) {
      busy += dynamic && meta.groups[m].num_ranks == 0 ? 0 : 1;
    }
    msg.shard_checksums.resize(busy * static_cast<size_t>(msg.shards_per_microbatch) *
                               static_cast<size_t>(msg.arrays_per_shard));
    for (uint32_t& c : msg.shard_checksums) c = static_cast<uint32_t>(rng());
  }
  return msg;
}

TEST(StepWireRoundTripTest, RandomMessagesAndFrames) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 300; ++trial) {
    const StepMessage msg = RandomMessage(rng);
    ASSERT_TRUE(ValidateStepMessage(msg).ok()) << ValidateStepMessage(msg).ToString();
    auto bytes = EncodeStepMessage(msg);
    ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    auto back = DecodeStepMessage(*bytes);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    ASSERT_TRUE(*back == msg) << "trial " << trial;
    EXPECT_EQ(EncodeStepMessage(*back).value(), *bytes);

    auto position = DecodePositionFrame(EncodePositionFrame(msg.after));
    ASSERT_TRUE(position.ok()) << position.status().ToString();
    EXPECT_TRUE(*position == msg.after);

    LengthsHeader h{static_cast<int64_t>(rng() % 1000), static_cast<int64_t>(rng()),
                    static_cast<int64_t>(rng() >> 1), static_cast<int64_t>(rng() >> 1),
                    static_cast<int64_t>(rng() % 4096), static_cast<int64_t>(rng() >> 1),
                    static_cast<int64_t>(rng() >> 1), static_cast<int64_t>(rng() >> 1)};
    EXPECT_TRUE(DecodeLengthsHeader(EncodeLengthsHeader(h)).value() == h);

    const RecordColumns columns{rng() % 2 == 0, rng() % 2 == 0, rng() % 2 == 0};
    std::vector<SampleRecord> records(rng() % 20);
    for (SampleRecord& x : records) {
      x.offset = static_cast<int64_t>(rng() % 500);
      x.length = static_cast<int64_t>(1 + rng() % 100000);
      x.n_targets = static_cast<int64_t>(rng() % static_cast<uint64_t>(x.length));
      x.source = columns.source ? static_cast<int32_t>(rng() % 9) : 0;
      x.group = columns.group ? static_cast<int64_t>(rng()) : 0;
      if (columns.media) x.encoder = {static_cast<int64_t>(rng() >> 2), static_cast<int64_t>(rng() >> 2)};
    }
    std::vector<uint8_t> frame;
    EncodeLengths(records, columns, &frame);
    EXPECT_EQ(frame.size(), LengthsFrameSize(static_cast<int64_t>(records.size()), columns));
    std::vector<SampleRecord> decoded;
    ASSERT_TRUE(DecodeLengths(frame, columns, 500, &decoded).ok());
    EXPECT_TRUE(decoded == records);

    std::vector<std::pair<int, int>> groups;
    for (int first = 0; first < 16; first += 1 + static_cast<int>(rng() % 3)) {
      groups.emplace_back(first, 1 + static_cast<int>(rng() % 4));
    }
    EXPECT_TRUE(DecodeGroupsFrame(EncodeGroupsFrame(groups), 20).value() == groups);

    std::vector<JobEntry> job(rng() % 40);
    for (auto& [name, value] : job) {
      name.resize(rng() % 30);
      value.resize(rng() % 300);  // lengths past one varint byte
      for (char& ch : name) ch = static_cast<char>(rng());
      for (char& ch : value) ch = static_cast<char>(rng());
    }
    EXPECT_TRUE(DecodeJobFrame(EncodeJobFrame(job)).value() == job);
  }
}

// ---------------------------------------------------------------------------------------------
// Corruption.

using Decoder = std::function<Status(std::span<const uint8_t>)>;

// Every single-bit flip and every truncation of `bytes` fails, as Corruption.
void ExpectEveryFlipAndCutFails(const std::vector<uint8_t>& bytes, const Decoder& decode,
                                const std::string& what) {
  ASSERT_TRUE(decode(bytes).ok()) << what << ": " << decode(bytes).ToString();
  std::vector<uint8_t> msg = bytes;
  for (size_t bit = 0; bit < 8 * msg.size(); ++bit) {
    msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    const Status s = decode(msg);
    msg[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ASSERT_FALSE(s.ok()) << what << ": bit " << bit << " flipped was accepted";
    ASSERT_EQ(s.code(), StatusCode::kCorruption) << what << ", bit " << bit << ": "
                                                 << s.ToString();
  }
  for (size_t n = 0; n < bytes.size(); ++n) {
    const Status s = decode(std::span<const uint8_t>(bytes.data(), n));
    ASSERT_FALSE(s.ok()) << what << ": cut at " << n << " was accepted";
    ASSERT_EQ(s.code(), StatusCode::kCorruption) << what << ", cut at " << n;
  }
}

TEST(StepWireCorruptionTest, EveryBitFlipAndTruncationIsCorruption) {
  ExpectEveryFlipAndCutFails(kGoldenMessage, [](auto b) { return DecodeStepMessage(b).status(); },
                             "step message");
  ExpectEveryFlipAndCutFails(
      kGoldenSize, [](auto b) { return DecodeSizeFrame(b, 0, 100).status(); }, "size");
  ExpectEveryFlipAndCutFails(GoldenLengthsHeader(),
                             [](auto b) { return DecodeLengthsHeader(b).status(); },
                             "lengths header");
  ExpectEveryFlipAndCutFails(kGoldenLengths, [](auto b) {
    std::vector<SampleRecord> out;
    return DecodeLengths(b, RecordColumns{}, 3, &out);
  }, "lengths");
  ExpectEveryFlipAndCutFails(kGoldenPosition,
                             [](auto b) { return DecodePositionFrame(b).status(); }, "position");
  ExpectEveryFlipAndCutFails(kGoldenSplitPosition,
                             [](auto b) { return DecodePositionFrame(b).status(); },
                             "split position");
  ExpectEveryFlipAndCutFails(kGoldenGroups, [](auto b) { return DecodeGroupsFrame(b, 4).status(); },
                             "groups");
  ExpectEveryFlipAndCutFails(kGoldenJob, [](auto b) { return DecodeJobFrame(b).status(); }, "job");
  ExpectEveryFlipAndCutFails(kGoldenSamples,
                             [](auto b) { return OpenFrame(b, FrameKind::kSamples).status(); },
                             "samples");
  // A large random message: its flips are sampled.
  std::mt19937_64 rng(49);
  StepMessage big;
  do {
    big = RandomMessage(rng);
  } while (big.sample_field_bytes.empty() || !big.blend || !big.after.cursor);
  std::vector<uint8_t> bytes = EncodeStepMessage(big).value();
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t bit = rng() % (8 * bytes.size());
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    auto r = DecodeStepMessage(bytes);
    bytes[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    ASSERT_FALSE(r.ok()) << "bit " << bit;
    ASSERT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  }
}

// Rewrites a THDM message's total_length and checksum (so a rule, not the checksum, must catch
// an edit), or a frame's trailer.
void ResealMessage(std::vector<uint8_t>* msg) {
  wire::EncodeFixed32(msg->data() + 5, static_cast<uint32_t>(msg->size()));
  wire::EncodeFixed32(msg->data() + msg->size() - 4,
                      Crc32c(std::span<const uint8_t>(msg->data(), msg->size() - 4)));
}
void ResealFrame(std::vector<uint8_t>* frame) {
  wire::EncodeFixed32(frame->data() + frame->size() - 4,
                      Crc32c(std::span<const uint8_t>(frame->data(), frame->size() - 4)));
}

TEST(StepWireCorruptionTest, FrameChecksNameWhatFailed) {
  // Another kind in its place, with a good checksum.
  auto r = OpenFrame(kGoldenSize, FrameKind::kGroups);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(r.status(), "groups: byte 8: a size frame in its place"))
      << r.status().ToString();
  // A damaged checksum names the kind and both values.
  std::vector<uint8_t> f = kGoldenSize;
  f[0] ^= 1;
  r = OpenFrame(f, FrameKind::kSize);
  EXPECT_TRUE(Contains(r.status(), "size: checksum mismatch")) << r.status().ToString();
  // A newer version: Unimplemented, naming it; reserved bytes: Corruption.
  f = kGoldenSize;
  f[9] = kStepWireVersion + 1;
  ResealFrame(&f);
  r = OpenFrame(f, FrameKind::kSize);
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented) << r.status().ToString();
  f = kGoldenSize;
  f[9] = 3;
  ResealFrame(&f);
  EXPECT_TRUE(Contains(OpenFrame(f, FrameKind::kSize).status(), "version 3"));
  f = kGoldenSize;
  f[11] = 1;
  ResealFrame(&f);
  EXPECT_TRUE(Contains(OpenFrame(f, FrameKind::kSize).status(), "reserved"));
  EXPECT_TRUE(Contains(OpenFrame(std::span<const uint8_t>(kGoldenSize.data(), 7),
                                 FrameKind::kSize).status(), "truncated"));
}

TEST(StepWireCorruptionTest, RangesAreCheckedWithGoodChecksums) {
  // The size against its bounds.
  EXPECT_TRUE(Contains(DecodeSizeFrame(kGoldenSize, 60, 100).status(), "outside [60, 100]"));
  // A header's count over 2^40, a negative id span.
  std::vector<uint8_t> h = GoldenLengthsHeader();
  h[5] = 0x02;  // count 2 + 2^41
  ResealFrame(&h);
  EXPECT_TRUE(Contains(DecodeLengthsHeader(h).status(), "(count)"))
      << DecodeLengthsHeader(h).status().ToString();
  h = GoldenLengthsHeader();
  h[23] = 0x80;
  ResealFrame(&h);
  EXPECT_TRUE(Contains(DecodeLengthsHeader(h).status(), "(id_span)"));
  // A record's offset outside the id span, n_targets above L - 1, a partial record.
  std::vector<SampleRecord> out;
  EXPECT_TRUE(Contains(DecodeLengths(kGoldenLengths, RecordColumns{}, 2, &out), "id offset 2"));
  std::vector<uint8_t> l = kGoldenLengths;
  l[8] = 0x05;  // n_targets 5 of L 5
  ResealFrame(&l);
  EXPECT_TRUE(Contains(DecodeLengths(l, RecordColumns{}, 3, &out), "n_targets 5"));
  EXPECT_TRUE(Contains(DecodeLengths(kGoldenLengths, RecordColumns{true, false}, 3, &out),
                       "not whole records"));
  // Encoder work outside [0, 2^62): negative, or past SampleEncoderWork's bound.
  for (const EncoderWork bad : {EncoderWork{-1, 0}, EncoderWork{0, int64_t{1} << 62}}) {
    SampleRecord r{0, 5, 4, 0, 0, bad};
    std::vector<uint8_t> m;
    EncodeLengths(std::span<const SampleRecord>(&r, 1), RecordColumns{false, false, true}, &m);
    EXPECT_TRUE(Contains(DecodeLengths(m, RecordColumns{false, false, true}, 3, &out),
                         "encoder work"));
  }
  // Groups out of order, or outside the domain.
  std::vector<uint8_t> g = kGoldenGroups;
  g[3] = 0x00;  // (0, 2), (0, 2)
  ResealFrame(&g);
  EXPECT_TRUE(Contains(DecodeGroupsFrame(g, 4).status(), "not after the group before it"));
  EXPECT_TRUE(Contains(DecodeGroupsFrame(kGoldenGroups, 3).status(), "outside the domain"));
  // A position's cursor of shape "blend" with no parts; an unknown shape; a split cursor whose
  // list has 4 values.
  std::vector<uint8_t> p = kGoldenPosition;
  p[2] = 0x01;
  p.insert(p.begin() + 10, {0x00, 0x00});  // parts: 0, taken: 0
  ResealFrame(&p);
  EXPECT_TRUE(Contains(DecodePositionFrame(p).status(), "shape 1 with nothing of that shape"))
      << DecodePositionFrame(p).status().ToString();
  p = kGoldenPosition;
  p[2] = 0x07;
  ResealFrame(&p);
  EXPECT_TRUE(Contains(DecodePositionFrame(p).status(), "(position.cursor): shape 7"));
  p = kGoldenSplitPosition;
  p[10] = 0x04;
  ResealFrame(&p);
  EXPECT_TRUE(Contains(DecodePositionFrame(p).status(), "position.cursor.split): 4 values"))
      << DecodePositionFrame(p).status().ToString();
  // The step message: a deficit above L - 1, a checksum count that does not fill the message,
  // unknown sequence flags, and a version 3 message (a StepMeta alone).
  std::vector<uint8_t> m = kGoldenMessage;
  m[35] = 0x03;  // deficit 3 of L - 1 = 2
  ResealMessage(&m);
  EXPECT_TRUE(Contains(DecodeStepMessage(m).status(), "byte 35 (sequences[0].n_targets"))
      << DecodeStepMessage(m).status().ToString();
  m = kGoldenMessage;
  m[38] = 0x02;  // two shards: 32 bytes of checksums wanted, 16 there
  ResealMessage(&m);
  EXPECT_TRUE(Contains(DecodeStepMessage(m).status(), "(shard_checksums)"));
  m = kGoldenMessage;
  m[31] = 0x02;
  ResealMessage(&m);
  EXPECT_TRUE(Contains(DecodeStepMessage(m).status(), "unknown bits set in 2"));
  StepMeta meta = GoldenMessage().meta;
  auto v1 = DecodeStepMessage(EncodeStepMeta(meta).value());
  EXPECT_EQ(v1.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(v1.status(), "version 1 is a step's metadata alone"))
      << v1.status().ToString();
}

TEST(StepWireValidateTest, EachRuleIsNamed) {
  StepMessage msg = GoldenMessage();
  msg.sequences[0].ids.pop_back();
  EXPECT_EQ(EncodeStepMessage(msg).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(ValidateStepMessage(msg), "StepMessage.sequences[0]"));
  msg = GoldenMessage();
  msg.sequences[0].n_targets[1] = 5;
  EXPECT_TRUE(Contains(ValidateStepMessage(msg), "n_targets[1] = 5"));
  msg = GoldenMessage();
  msg.blend = true;
  EXPECT_TRUE(Contains(ValidateStepMessage(msg), "sources with a blend only"));
  msg = GoldenMessage();
  msg.shard_checksums.pop_back();
  EXPECT_TRUE(Contains(ValidateStepMessage(msg), "shard_checksums has 3 entries"));
  msg = GoldenMessage();
  msg.sample_field_bytes = {0};
  EXPECT_TRUE(Contains(ValidateStepMessage(msg), "sample_field_bytes[0] = 0"));
  msg = GoldenMessage();
  msg.after.cursor = SourceCursor{};
  msg.after.cursor->epoch = -1;
  EXPECT_TRUE(Contains(ValidateStepMessage(msg), "after.cursor.epoch\" = -1"))
      << ValidateStepMessage(msg).ToString();
}

}  // namespace
}  // namespace thdpack
