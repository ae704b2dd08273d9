// Media on the wire (thdpack/step_wire.h): a sample's media and a rank's media frame round-trip
// on random contents; every bit flipped in a media frame is a Corruption naming it; truncated
// bytes, another number of modalities and a bad dtype are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "thdpack/step_wire.h"

namespace thdpack {
namespace {

std::vector<int64_t> Words(std::mt19937_64& rng, size_t n) {
  std::vector<int64_t> v(n);
  for (auto& x : v) x = static_cast<int64_t>(rng() % 1000) - 10;
  return v;
}
std::vector<std::byte> Bytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> v(n);
  for (auto& x : v) x = static_cast<std::byte>(rng());
  return v;
}

std::vector<MediaPart> RandomParts(std::mt19937_64& rng, size_t modalities) {
  std::vector<MediaPart> parts(modalities);
  for (MediaPart& p : parts) {
    const size_t k = rng() % 3;
    p.grid = Words(rng, 3 * k);
    if (rng() % 2) p.seconds.assign(k, 0.25 * static_cast<double>(rng() % 9));
    p.dtype = static_cast<uint8_t>(rng() % 8);
    p.width = static_cast<int64_t>(rng() % 5);
    p.payload = Bytes(rng, rng() % 23);
  }
  return parts;
}

std::vector<MediaShard> RandomShards(std::mt19937_64& rng, size_t modalities) {
  std::vector<MediaShard> out(1 + rng() % 3);
  for (MediaShard& s : out) {
    if (rng() % 2) s.mrope = Words(rng, 3 * (rng() % 5));
    s.parts.resize(modalities);
    for (MediaShardPart& p : s.parts) {
      p.grid = Words(rng, 3 * (rng() % 3));
      p.dtype = static_cast<uint8_t>(rng() % 8);
      p.width = static_cast<int64_t>(rng() % 4);
      p.payload = Bytes(rng, rng() % 17);
      p.output_rows = static_cast<int64_t>(rng() % 9);
      const size_t m = rng() % 4;
      p.token_index = Words(rng, m);
      p.recv_index = Words(rng, m);
      p.send_index = Words(rng, rng() % 4);
      const size_t cp = 1 + rng() % 3;
      p.send_counts = Words(rng, cp);
      p.recv_counts = Words(rng, cp);
    }
  }
  return out;
}

bool SameParts(const std::vector<MediaPart>& a, const std::vector<MediaPart>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].grid != b[i].grid || a[i].seconds != b[i].seconds || a[i].dtype != b[i].dtype ||
        a[i].width != b[i].width || a[i].payload != b[i].payload) {
      return false;
    }
  }
  return true;
}

TEST(MediaWire, SampleMediaRoundTripsBackToBack) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t modalities = rng() % 4;
    const auto a = RandomParts(rng, modalities), b = RandomParts(rng, modalities);
    std::vector<uint8_t> bytes(SampleMediaBytes(a) + SampleMediaBytes(b));
    uint8_t* end = EncodeSampleMedia(b, EncodeSampleMedia(a, bytes.data()));
    ASSERT_EQ(end, bytes.data() + bytes.size());
    size_t off = 0;
    auto da = DecodeSampleMedia(bytes, modalities, &off);
    ASSERT_TRUE(da.ok()) << da.status().ToString();
    auto db = DecodeSampleMedia(bytes, modalities, &off);
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    EXPECT_EQ(off, bytes.size());
    EXPECT_TRUE(SameParts(*da, a));
    EXPECT_TRUE(SameParts(*db, b));
    // Truncated anywhere inside: a Corruption, never a read past the bytes.
    if (!bytes.empty()) {
      const size_t cut = rng() % bytes.size();
      std::vector<uint8_t> shorter(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(cut));
      size_t o = 0;
      auto x = DecodeSampleMedia(shorter, modalities, &o);
      if (x.ok()) {  // the first sample may end before the cut
        auto y = DecodeSampleMedia(shorter, modalities, &o);
        EXPECT_FALSE(y.ok() && o == bytes.size());
      } else {
        EXPECT_EQ(x.status().code(), StatusCode::kCorruption);
      }
    }
  }
}

TEST(MediaWire, MediaFrameRoundTripsAndEveryBitFlipIsNamed) {
  std::mt19937_64 rng(8);
  for (int trial = 0; trial < 40; ++trial) {
    const size_t modalities = rng() % 3;
    const auto shards = RandomShards(rng, modalities);
    const std::vector<uint8_t> frame = EncodeMediaFrame(shards);
    auto back = DecodeMediaFrame(frame, modalities);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(EncodeMediaFrame(*back), frame);
    // Into a buffer of garbage (as the step's uninitialised one): every byte written, the
    // payloads' padding included.
    ASSERT_EQ(MediaFrameBytes(shards), frame.size());
    std::vector<uint8_t> dirty(frame.size(), 0xAB);
    EncodeMediaFrameInto(shards, dirty);
    EXPECT_EQ(dirty, frame);
    for (size_t bit = 0; bit < frame.size() * 8; bit += 1 + rng() % 7) {
      std::vector<uint8_t> flipped = frame;
      flipped[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      auto bad = DecodeMediaFrame(flipped, modalities);
      ASSERT_FALSE(bad.ok()) << "bit " << bit;
      EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
      EXPECT_EQ(bad.status().message().rfind("media: ", 0), 0u) << bad.status().message();
    }
  }
}

TEST(MediaWire, RefusalsNameTheRule) {
  std::mt19937_64 rng(1);
  const auto shards = RandomShards(rng, 2);
  auto other = DecodeMediaFrame(EncodeMediaFrame(shards), 3);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("2 modalities, the run declares 3"), std::string::npos);
  MediaPart p;
  p.dtype = 9;
  std::vector<uint8_t> bytes(SampleMediaBytes(std::vector<MediaPart>{p}));
  EncodeSampleMedia(std::vector<MediaPart>{p}, bytes.data());
  size_t off = 0;
  auto bad = DecodeSampleMedia(bytes, 1, &off);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("dtype 9 is not one of fields.h's"), std::string::npos);
}

TEST(MediaWire, CostsFrameIsItsBytesAndRefusesWhatCannotBePlaced) {
  // Two samples: one item of cost 1.5, none. Worked out by hand from wire_format.md.
  const std::vector<std::vector<double>> costs = {{1.5}, {}};
  const std::vector<uint8_t> frame = EncodeMediaCostsFrame(costs);
  const std::vector<uint8_t> body = {2, 0, 0, 0, 0, 0, 0, 0,           // samples
                                     1, 0, 0, 0, 0, 0, 0, 0,           // k
                                     0, 0, 0, 0, 0, 0, 0xF8, 0x3F,     // 1.5
                                     0, 0, 0, 0, 0, 0, 0, 0};          // k
  ASSERT_EQ(frame.size(), body.size() + kFrameTrailerSize);
  EXPECT_TRUE(std::equal(body.begin(), body.end(), frame.begin()));
  auto back = DecodeMediaCostsFrame(frame, 2);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, costs);
  auto count = DecodeMediaCostsFrame(frame, 3);
  ASSERT_FALSE(count.ok());
  EXPECT_NE(count.status().message().find("2 samples, the sender reads 3"), std::string::npos);
  for (double bad : {-1.0, std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    const std::vector<std::vector<double>> one = {{bad}};
    auto b = DecodeMediaCostsFrame(EncodeMediaCostsFrame(one), 1);
    ASSERT_FALSE(b.ok());
    EXPECT_NE(b.status().message().find("a cost is finite and >= 0"), std::string::npos);
  }
  for (size_t bit = 0; bit < frame.size() * 8; ++bit) {
    std::vector<uint8_t> flipped = frame;
    flipped[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    auto b = DecodeMediaCostsFrame(flipped, 2);
    ASSERT_FALSE(b.ok()) << "bit " << bit;
    EXPECT_EQ(b.status().code(), StatusCode::kCorruption);
  }
}

}  // namespace
}  // namespace thdpack
