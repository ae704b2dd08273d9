#include "thdpack/shard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace thdpack {
namespace {

using Ints = std::vector<int32_t>;

// The zigzag written the plainest way: per sequence, chunk r then chunk 2*CP-1-r, one index at
// a time. Everything in shard.cc is checked against this.
Ints RefIndices(const Ints& cu, int cp, int r) {
  Ints out;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int len = cu[i + 1] - cu[i];
    if (cp == 1) {
      for (int j = 0; j < len; ++j) out.push_back(cu[i] + j);
      continue;
    }
    const int c = len / (2 * cp);
    for (int j = r * c; j < (r + 1) * c; ++j) out.push_back(cu[i] + j);
    for (int j = (2 * cp - 1 - r) * c; j < (2 * cp - r) * c; ++j) out.push_back(cu[i] + j);
  }
  return out;
}

// Random cu_seqlens_padded whose lengths are multiples of 2*CP (or anything when CP = 1).
Ints RandomCu(std::mt19937_64& rng, int cp) {
  const int q = cp > 1 ? 2 * cp : 1;
  const int n = std::uniform_int_distribution<int>(1, 12)(rng);
  Ints cu{0};
  for (int i = 0; i < n; ++i) {
    const int chunks = std::uniform_int_distribution<int>(1, 40)(rng);
    cu.push_back(cu.back() + chunks * q);
  }
  return cu;
}

struct Row16 {
  int64_t a;
  int32_t b;
  float c;
  friend bool operator==(const Row16& x, const Row16& y) {
    return x.a == y.a && x.b == y.b && std::memcmp(&x.c, &y.c, sizeof(float)) == 0;
  }
};
static_assert(sizeof(Row16) == 16);

template <typename T>
T MakeValue(std::mt19937_64& rng) {
  if constexpr (std::is_same_v<T, Row16>) {
    return Row16{static_cast<int64_t>(rng()), static_cast<int32_t>(rng()),
                 static_cast<float>(rng() % 100000) / 7.0f};
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(static_cast<double>(rng() % 1000000) / 3.0);
  } else {
    return static_cast<T>(rng());
  }
}

TEST(ShardTest, WorkedExampleTwoSequencesCp2) {
  const Ints cu{0, 8, 16};
  auto r0 = CpPartitionIndices(cu, 2, 0);
  auto r1 = CpPartitionIndices(cu, 2, 1);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(*r0, (Ints{0, 1, 6, 7, 8, 9, 14, 15}));
  EXPECT_EQ(*r1, (Ints{2, 3, 4, 5, 10, 11, 12, 13}));
}

TEST(ShardTest, WorkedExampleOneSequenceCp4) {
  const Ints cu{0, 16};
  const std::vector<Ints> want{{0, 1, 14, 15}, {2, 3, 12, 13}, {4, 5, 10, 11}, {6, 7, 8, 9}};
  for (int r = 0; r < 4; ++r) {
    auto got = CpPartitionIndices(cu, 4, r);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, want[r]) << "rank " << r;
  }
}

TEST(ShardTest, CpOneIsIdentityAndAllowsAnyLength) {
  const Ints cu{0, 3, 4, 9};
  auto idx = CpPartitionIndices(cu, 1, 0);
  ASSERT_TRUE(idx.ok());
  EXPECT_EQ(*idx, (Ints{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  auto pos = LocalPositionIds(cu, 1, 0);
  ASSERT_TRUE(pos.ok());
  EXPECT_EQ(*pos, (Ints{0, 1, 2, 0, 0, 1, 2, 3, 4}));
}

TEST(ShardTest, ShardOfTheWorkedExampleByValue) {
  const Ints cu{0, 8, 16};
  std::vector<int64_t> full(16);
  std::iota(full.begin(), full.end(), 100);
  auto s0 = CpShard<int64_t>(full, cu, 2, 0);
  auto s1 = CpShard<int64_t>(full, cu, 2, 1);
  ASSERT_TRUE(s0.ok() && s1.ok());
  EXPECT_EQ(*s0, (std::vector<int64_t>{100, 101, 106, 107, 108, 109, 114, 115}));
  EXPECT_EQ(*s1, (std::vector<int64_t>{102, 103, 104, 105, 110, 111, 112, 113}));
  auto back = CpUnshard(std::vector<std::vector<int64_t>>{*s0, *s1}, cu, 2);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, full);
}

TEST(ShardTest, LocalPositionIdsOfTheWorkedExamples) {
  const Ints cu{0, 8, 16};
  EXPECT_EQ(*LocalPositionIds(cu, 2, 0), (Ints{0, 1, 6, 7, 0, 1, 6, 7}));
  EXPECT_EQ(*LocalPositionIds(cu, 2, 1), (Ints{2, 3, 4, 5, 2, 3, 4, 5}));
  EXPECT_EQ(*LocalPositionIds(Ints{0, 16}, 4, 3), (Ints{6, 7, 8, 9}));
  EXPECT_EQ(*LocalCuSeqlensPadded(cu, 2), (Ints{0, 4, 8}));
  EXPECT_EQ(*LocalCuSeqlensPadded(Ints{0, 16, 24}, 4), (Ints{0, 4, 6}));
}

TEST(ShardTest, IndicesAndPositionIdsMatchReferenceOnRandomLayouts) {
  std::mt19937_64 rng(1234);
  for (int cp : {1, 2, 3, 4, 8}) {
    for (int trial = 0; trial < 60; ++trial) {
      const Ints cu = RandomCu(rng, cp);
      for (int r = 0; r < cp; ++r) {
        const Ints want = RefIndices(cu, cp, r);
        auto got = CpPartitionIndices(cu, cp, r);
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        ASSERT_EQ(*got, want) << "cp " << cp << " rank " << r << " trial " << trial;
        // Position ids: global index minus its sequence start.
        Ints want_pos;
        for (int32_t g : want) {
          const auto it = std::upper_bound(cu.begin(), cu.end(), g) - 1;
          want_pos.push_back(g - *it);
        }
        auto pos = LocalPositionIds(cu, cp, r);
        ASSERT_TRUE(pos.ok());
        ASSERT_EQ(*pos, want_pos) << "cp " << cp << " rank " << r;
      }
      // Every position is kept by exactly one rank.
      std::vector<int> seen(static_cast<size_t>(cu.back()), 0);
      for (int r = 0; r < cp; ++r) {
        for (int32_t g : RefIndices(cu, cp, r)) ++seen[static_cast<size_t>(g)];
      }
      for (int v : seen) ASSERT_EQ(v, 1);
    }
  }
}

template <typename T>
void CheckShardAgainstReference(uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int cp : {1, 2, 3, 4, 8}) {
    for (int trial = 0; trial < 25; ++trial) {
      const Ints cu = RandomCu(rng, cp);
      std::vector<T> full(static_cast<size_t>(cu.back()));
      for (T& v : full) v = MakeValue<T>(rng);
      std::vector<std::vector<T>> shards;
      for (int r = 0; r < cp; ++r) {
        std::vector<T> want;
        for (int32_t g : RefIndices(cu, cp, r)) want.push_back(full[static_cast<size_t>(g)]);
        auto got = CpShard<T>(full, cu, cp, r);
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        ASSERT_TRUE(*got == want) << "cp " << cp << " rank " << r << " trial " << trial;
        shards.push_back(std::move(*got));
      }
      auto back = CpUnshard(shards, cu, cp);
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      ASSERT_EQ(back->size(), full.size());
      ASSERT_EQ(std::memcmp(back->data(), full.data(), full.size() * sizeof(T)), 0)
          << "unshard is not the exact inverse at cp " << cp;
      // The Into form over spans, and a second unshard into a dirty buffer.
      std::vector<std::span<const T>> views(shards.begin(), shards.end());
      std::vector<T> dirty(full.size(), MakeValue<T>(rng));
      ASSERT_TRUE(CpUnshardInto(views, cu, cp, std::span<T>(dirty)).ok());
      ASSERT_TRUE(dirty == full);
    }
  }
}

// The padding flags of a shard against a plain walk over the global layout: the zigzag chunks
// of each sequence by the definition of docs/design.md (chunk r and 2*CP-1-r), a token padding
// when its offset in its sequence is past the real length.
TEST(ShardTest, PaddingMaskMatchesAPlainWalkOnRandomLayouts) {
  std::mt19937 rng(20261126);
  for (int trial = 0; trial < 300; ++trial) {
    const int cp = 1 + static_cast<int>(rng() % 5);
    const int n = 1 + static_cast<int>(rng() % 6);
    Ints cu = {0}, cup = {0};
    std::vector<int32_t> real, padded;
    for (int i = 0; i < n; ++i) {
      const int32_t L = static_cast<int32_t>(rng() % 40);
      const int32_t m = cp == 1 ? 1 : 2 * cp;
      const int32_t P = std::max<int32_t>(m, (L + m - 1) / m * m + m * static_cast<int32_t>(rng() % 2));
      real.push_back(L);
      padded.push_back(P);
      cu.push_back(cu.back() + L);
      cup.push_back(cup.back() + P);
    }
    for (int r = 0; r < cp; ++r) {
      std::vector<uint8_t> want;
      for (int i = 0; i < n; ++i) {
        if (cp == 1) {
          for (int32_t j = 0; j < padded[i]; ++j) want.push_back(j >= real[i]);
          continue;
        }
        const int32_t c = padded[i] / (2 * cp);
        for (int32_t chunk : {r, 2 * cp - 1 - r}) {
          for (int32_t j = chunk * c; j < (chunk + 1) * c; ++j) want.push_back(j >= real[i]);
        }
      }
      auto got = ShardPaddingMask(cu, cup, cp, r);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(*got, want) << "trial " << trial << " cp " << cp << " rank " << r;
    }
  }
}

TEST(ShardTest, PaddingMaskOfAnIdleMicrobatchIsEmptyAndBadInputIsNamed) {
  auto idle = ShardPaddingMask(Ints{0}, Ints{0}, 1, 0);
  ASSERT_TRUE(idle.ok());
  EXPECT_TRUE(idle->empty());
  auto sizes = ShardPaddingMask(Ints{0, 3}, Ints{0, 4, 8}, 1, 0);
  ASSERT_FALSE(sizes.ok());
  EXPECT_NE(sizes.status().message().find("cu_seqlens has 2 entries"), std::string::npos);
  auto longer = ShardPaddingMask(Ints{0, 5}, Ints{0, 4}, 1, 0);
  ASSERT_FALSE(longer.ok());
  EXPECT_NE(longer.status().message().find("sequence 0 has real length 5, padded 4"),
            std::string::npos);
  EXPECT_FALSE(ShardPaddingMask(Ints{0, 3}, Ints{0, 4}, 2, 2).ok());  // cp_rank out of range
  // Into a caller's buffer: its size is T/CP, checked before anything is written.
  std::vector<uint8_t> out(3, 7);
  Status wrong = ShardPaddingMaskInto(Ints{0, 3}, Ints{0, 4}, 1, 0, out);
  EXPECT_NE(wrong.message().find("out has 3 elements: it must hold T/CP = 4"), std::string::npos)
      << wrong.ToString();
  EXPECT_EQ(out, (std::vector<uint8_t>{7, 7, 7}));
  out.assign(2, 7);
  ASSERT_TRUE(ShardPaddingMaskInto(Ints{0, 2}, Ints{0, 4}, 2, 1, out).ok());
  EXPECT_EQ(out, (std::vector<uint8_t>{0, 1}));  // chunks 1 and 2 of [a b pad pad]
}

TEST(ShardTest, MatchesReferenceAndRoundTripsUint8) { CheckShardAgainstReference<uint8_t>(1); }
TEST(ShardTest, MatchesReferenceAndRoundTripsInt32) { CheckShardAgainstReference<int32_t>(2); }
TEST(ShardTest, MatchesReferenceAndRoundTripsInt64) { CheckShardAgainstReference<int64_t>(3); }
TEST(ShardTest, MatchesReferenceAndRoundTripsFloat) { CheckShardAgainstReference<float>(4); }
TEST(ShardTest, MatchesReferenceAndRoundTripsStruct16) { CheckShardAgainstReference<Row16>(5); }

TEST(ShardTest, ByteCoreShardsRowsOfActivations) {
  // [T, H] rows of H = 3 floats move as one element of 12 bytes.
  const Ints cu{0, 4, 8};
  const int h = 3;
  std::vector<float> full(8 * h);
  std::iota(full.begin(), full.end(), 0.0f);
  std::vector<float> out(4 * h);
  ASSERT_TRUE(CpShardBytes(std::as_bytes(std::span<const float>(full)), h * sizeof(float), cu, 2,
                           1, std::as_writable_bytes(std::span<float>(out)))
                  .ok());
  // Rank 1 keeps tokens 1, 2 and 5, 6.
  EXPECT_EQ(out, (std::vector<float>{3, 4, 5, 6, 7, 8, 15, 16, 17, 18, 19, 20}));
}

// Expects an InvalidArgument whose message contains every one of `parts`.
void ExpectInvalid(const Status& s, std::initializer_list<std::string> parts) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  for (const std::string& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
  }
}

TEST(ShardTest, RejectsBadCuSeqlensPadded) {
  ExpectInvalid(ValidateCuSeqlensPadded(Ints{0, 8}, 0), {"cp_size = 0", ">= 1"});
  ExpectInvalid(ValidateCuSeqlensPadded(Ints{0}, 2), {"cu_seqlens_padded", "1 entries", "n+1"});
  ExpectInvalid(ValidateCuSeqlensPadded(Ints{}, 2), {"0 entries"});
  ExpectInvalid(ValidateCuSeqlensPadded(Ints{4, 8}, 2), {"cu_seqlens_padded[0] = 4", "must be 0"});
  ExpectInvalid(ValidateCuSeqlensPadded(Ints{0, 8, 8}, 2),
                {"cu_seqlens_padded[2] = 8", "cu_seqlens_padded[1] = 8", "strictly increasing"});
  ExpectInvalid(ValidateCuSeqlensPadded(Ints{0, 8, 4}, 2), {"cu_seqlens_padded[2] = 4"});
  ExpectInvalid(ValidateCuSeqlensPadded(Ints{0, 8, 14}, 2),
                {"cu_seqlens_padded[2] - cu_seqlens_padded[1] = 6", "divisible by 2*cp_size = 4"});
  EXPECT_TRUE(ValidateCuSeqlensPadded(Ints{0, 8, 14}, 1).ok());
  // Every entry point validates.
  ExpectInvalid(CpPartitionIndices(Ints{0, 6}, 2, 0).status(), {"divisible"});
  ExpectInvalid(LocalPositionIds(Ints{0, 6}, 2, 0).status(), {"divisible"});
  ExpectInvalid(LocalCuSeqlensPadded(Ints{1, 8}, 2).status(), {"cu_seqlens_padded[0] = 1"});
  std::vector<int32_t> x(6), y(3);
  ExpectInvalid(CpShard<int32_t>(x, Ints{0, 6}, 2, 0).status(), {"divisible"});
  ExpectInvalid(CpShard<int32_t>(x, Ints{0, 6}, 0, 0).status(), {"cp_size = 0"});
}

TEST(ShardTest, RejectsBadRanksSizesAndOverlap) {
  const Ints cu{0, 8};
  ExpectInvalid(CpPartitionIndices(cu, 2, 2).status(), {"cp_rank = 2", "[0, cp_size = 2)"});
  ExpectInvalid(CpPartitionIndices(cu, 2, -1).status(), {"cp_rank = -1"});
  ExpectInvalid(LocalPositionIds(cu, 2, 5).status(), {"cp_rank = 5"});
  std::vector<int32_t> wrong(5);
  ExpectInvalid(LocalPositionIdsInto(cu, 2, 0, wrong), {"out has 5", "T/CP = 4"});

  std::vector<int32_t> full(8), out(4), short_full(7), long_out(5);
  ExpectInvalid(CpShardInto<int32_t>(short_full, cu, 2, 0, std::span<int32_t>(out)),
                {"full has 28 bytes", "T = cu_seqlens_padded[n] = 8", "of 4 bytes"});
  ExpectInvalid(CpShardInto<int32_t>(full, cu, 2, 0, std::span<int32_t>(long_out)),
                {"out has 20 bytes", "T/CP = 4"});
  ExpectInvalid(CpShardInto<int32_t>(full, cu, 2, 3, std::span<int32_t>(out)), {"cp_rank = 3"});
  ExpectInvalid(CpShardBytes(std::as_bytes(std::span<const int32_t>(full)), 0, cu, 2, 0,
                             std::as_writable_bytes(std::span<int32_t>(out))),
                {"elem_size = 0"});
  // A shard written over its own input would corrupt the chunks not yet moved.
  std::vector<int32_t> both(12);
  ExpectInvalid(CpShardInto<int32_t>(std::span<const int32_t>(both).first(8), cu, 2, 0,
                                     std::span<int32_t>(both).subspan(6, 4)),
                {"overlaps"});

  std::vector<std::vector<int32_t>> one{std::vector<int32_t>(4)};
  ExpectInvalid(CpUnshard(one, cu, 2).status(), {"1 shards given", "cp_size = 2"});
  std::vector<std::vector<int32_t>> uneven{std::vector<int32_t>(4), std::vector<int32_t>(3)};
  std::vector<int32_t> eight(8);
  ExpectInvalid(CpUnshardInto(uneven, cu, 2, std::span<int32_t>(eight)),
                {"shards[1] has 12 bytes", "T/CP = 4"});
  ExpectInvalid(CpUnshard(uneven, cu, 2).status(), {"full has 28 bytes"});
  std::vector<std::vector<int32_t>> two{std::vector<int32_t>(4), std::vector<int32_t>(4)};
  std::vector<int32_t> small(7);
  ExpectInvalid(CpUnshardInto(two, cu, 2, std::span<int32_t>(small)), {"full has 28 bytes"});
  std::vector<int32_t> mem(12);
  std::vector<std::span<const int32_t>> aliased{std::span<const int32_t>(mem).first(4),
                                                std::span<const int32_t>(mem).subspan(8, 4)};
  ExpectInvalid(CpUnshardInto(aliased, cu, 2, std::span<int32_t>(mem).subspan(4, 8)),
                {"shards[1] overlaps full"});
  ExpectInvalid(CpUnshardBytes({}, 0, cu, 1, {}), {"elem_size = 0"});
}

}  // namespace
}  // namespace thdpack
