#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "thdpack/shard.h"

namespace thdpack {
namespace {

void ExpectInvalid(const Status& s, std::initializer_list<std::string> parts) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  for (const std::string& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
  }
}

TEST(DenseShardTest, ZigzagPerRowByHand) {
  // [B=2, S=8], CP = 2: every row is one sequence of 8, cut into 4 chunks of 2.
  std::vector<int32_t> full(16);
  std::iota(full.begin(), full.end(), 0);
  auto r0 = DenseCpShard<int32_t>(full, 2, 8, {.cp_size = 2, .cp_rank = 0});
  auto r1 = DenseCpShard<int32_t>(full, 2, 8, {.cp_size = 2, .cp_rank = 1});
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(*r0, (std::vector<int32_t>{0, 1, 6, 7, 8, 9, 14, 15}));
  EXPECT_EQ(*r1, (std::vector<int32_t>{2, 3, 4, 5, 10, 11, 12, 13}));
  auto back = DenseCpUnshard(std::vector<std::vector<int32_t>>{*r0, *r1}, 2, 8, {.cp_size = 2});
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, full);
}

TEST(DenseShardTest, MatchesPackedZigzagAndRoundTrips) {
  // A dense batch is the packed layout with cu_seqlens_padded = [0, S, 2S, ...].
  std::mt19937_64 rng(99);
  for (int cp : {1, 2, 3, 4, 8}) {
    for (int trial = 0; trial < 10; ++trial) {
      const int64_t batch = std::uniform_int_distribution<int64_t>(1, 5)(rng);
      const int64_t seq = (cp > 1 ? 2 * cp : 1) * std::uniform_int_distribution<int64_t>(1, 20)(rng);
      std::vector<int64_t> full(static_cast<size_t>(batch * seq));
      for (auto& v : full) v = static_cast<int64_t>(rng());
      std::vector<int32_t> cu;
      for (int64_t b = 0; b <= batch; ++b) cu.push_back(static_cast<int32_t>(b * seq));
      std::vector<std::vector<int64_t>> shards;
      for (int r = 0; r < cp; ++r) {
        auto dense = DenseCpShard<int64_t>(full, batch, seq, {.cp_size = cp, .cp_rank = r});
        auto packed = CpShard<int64_t>(full, cu, cp, r);
        ASSERT_TRUE(dense.ok()) << dense.status().ToString();
        ASSERT_TRUE(packed.ok());
        ASSERT_EQ(*dense, *packed) << "cp " << cp << " rank " << r;
        shards.push_back(*dense);
      }
      auto back = DenseCpUnshard(shards, batch, seq, {.cp_size = cp});
      ASSERT_TRUE(back.ok()) << back.status().ToString();
      ASSERT_EQ(*back, full);
    }
  }
}

TEST(DenseShardTest, RejectsAttentionMaskWithCp) {
  std::vector<uint8_t> full(16);
  ExpectInvalid(DenseCpShard<uint8_t>(full, 2, 8,
                                      {.cp_size = 2, .cp_rank = 0, .has_attention_mask = true})
                    .status(),
                {"has_attention_mask = true", "cp_size = 2", "cannot be zigzag-sharded"});
  std::vector<std::vector<uint8_t>> two(2, std::vector<uint8_t>(8));
  ExpectInvalid(DenseCpUnshard(two, 2, 8, {.cp_size = 2, .has_attention_mask = true}).status(),
                {"has_attention_mask = true"});
  // Without CP a mask is harmless: the shard is the batch itself.
  auto same = DenseCpShard<uint8_t>(full, 2, 8, {.cp_size = 1, .has_attention_mask = true});
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(*same, full);
}

TEST(DenseShardTest, RejectsBadShapes) {
  std::vector<int32_t> full(24);
  ExpectInvalid(DenseCpShard<int32_t>(full, 2, 12, {.cp_size = 4, .cp_rank = 0}).status(),
                {"seq_len = 12", "divisible by 2*cp_size = 8"});
  ExpectInvalid(DenseCpShard<int32_t>(full, 0, 12, {.cp_size = 1}).status(), {"batch = 0"});
  ExpectInvalid(DenseCpShard<int32_t>(full, 2, 0, {.cp_size = 1}).status(), {"seq_len = 0"});
  ExpectInvalid(DenseCpShard<int32_t>(full, 2, 12, {.cp_size = 0}).status(), {"cp_size = 0"});
  ExpectInvalid(DenseCpShard<int32_t>(full, 2, 12, {.cp_size = 2, .cp_rank = 2}).status(),
                {"cp_rank = 2"});
  ExpectInvalid(DenseCpShard<int32_t>(full, 3, 12, {.cp_size = 2, .cp_rank = 0}).status(),
                {"full has 96 bytes", "batch * seq_len = 36"});
  EXPECT_EQ(DenseCpShard<int32_t>(full, int64_t{1} << 40, int64_t{1} << 40, {.cp_size = 1})
                .status()
                .code(),
            StatusCode::kOutOfRange);
  std::vector<int32_t> out(5);
  ExpectInvalid(DenseCpShardBytes(std::as_bytes(std::span<const int32_t>(full)), 4, 2, 12,
                                  {.cp_size = 2}, std::as_writable_bytes(std::span<int32_t>(out))),
                {"out has 20 bytes", "batch * seq_len/CP = 12"});
  ExpectInvalid(DenseCpShardBytes(std::as_bytes(std::span<const int32_t>(full)), 0, 2, 12,
                                  {.cp_size = 2}, std::as_writable_bytes(std::span<int32_t>(out))),
                {"elem_size = 0"});
  ExpectInvalid(DenseCpShardBytes(std::as_bytes(std::span<const int32_t>(full)), 4, 2, 12,
                                  {.cp_size = 2},
                                  std::as_writable_bytes(std::span<int32_t>(full).first(12))),
                {"overlaps"});
  std::vector<std::vector<int32_t>> three(3, std::vector<int32_t>(12));
  ExpectInvalid(DenseCpUnshard(three, 2, 12, {.cp_size = 2}).status(),
                {"3 shards given", "cp_size = 2"});
  std::vector<std::vector<int32_t>> uneven{std::vector<int32_t>(12), std::vector<int32_t>(11)};
  ExpectInvalid(DenseCpUnshard(uneven, 2, 12, {.cp_size = 2}).status(),
                {"full has 92 bytes", "batch * seq_len = 24"});
  std::vector<std::span<const std::byte>> views{std::as_bytes(std::span<const int32_t>(uneven[0])),
                                                std::as_bytes(std::span<const int32_t>(uneven[1]))};
  std::vector<int32_t> dst(24);
  ExpectInvalid(DenseCpUnshardBytes(views, 4, 2, 12, {.cp_size = 2},
                                    std::as_writable_bytes(std::span<int32_t>(dst))),
                {"shards[1] has 44 bytes", "batch * seq_len/CP = 12"});
  ExpectInvalid(DenseCpUnshardBytes(views, 0, 2, 12, {.cp_size = 2},
                                    std::as_writable_bytes(std::span<int32_t>(dst))),
                {"elem_size = 0"});
  std::vector<std::span<const std::byte>> aliased{
      std::as_bytes(std::span<const int32_t>(dst).first(12)),
      std::as_bytes(std::span<const int32_t>(uneven[0]))};
  ExpectInvalid(DenseCpUnshardBytes(aliased, 4, 2, 12, {.cp_size = 2},
                                    std::as_writable_bytes(std::span<int32_t>(dst))),
                {"shards[0] overlaps full"});
}

}  // namespace
}  // namespace thdpack
