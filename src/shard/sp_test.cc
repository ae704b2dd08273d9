#include <gtest/gtest.h>

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

TEST(SpTest, RangeCutsContiguousEqualParts) {
  // T/CP = 8 local tokens over TP = 4: rank t keeps [2t, 2t+2).
  for (int t = 0; t < 4; ++t) {
    auto r = SpRange(8, 4, t);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->first, 2 * t);
    EXPECT_EQ(r->second, 2);
  }
  EXPECT_EQ(*SpRange(12, 1, 0), (std::pair<int64_t, int64_t>{0, 12}));
  EXPECT_EQ(*SpRange(0, 2, 1), (std::pair<int64_t, int64_t>{0, 0}));
}

TEST(SpTest, SplitAndGatherAreInverse) {
  std::vector<int32_t> local(8);
  std::iota(local.begin(), local.end(), 10);
  std::vector<std::vector<int32_t>> parts;
  for (int t = 0; t < 4; ++t) {
    auto part = SpSplit(std::span<const int32_t>(local), 4, t);
    ASSERT_TRUE(part.ok()) << part.status().ToString();
    EXPECT_EQ(part->data(), local.data() + 2 * t) << "a split is a view, not a copy";
    parts.emplace_back(part->begin(), part->end());
  }
  EXPECT_EQ(parts[2], (std::vector<int32_t>{14, 15}));
  auto back = SpGather(parts);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, local);
}

TEST(SpTest, SplitsActivationRowsAndRoundTripsRandomSizes) {
  std::mt19937_64 rng(77);
  for (int tp : {1, 2, 4, 8}) {
    for (int trial = 0; trial < 20; ++trial) {
      const int64_t h = std::uniform_int_distribution<int64_t>(1, 9)(rng);
      const int64_t tokens = tp * std::uniform_int_distribution<int64_t>(0, 30)(rng);
      std::vector<float> act(static_cast<size_t>(tokens * h));
      for (float& v : act) v = static_cast<float>(rng() % 1000);
      std::vector<std::span<float>> parts;
      for (int t = 0; t < tp; ++t) {
        auto part = SpSplit(std::span<float>(act), tp, t, h);
        ASSERT_TRUE(part.ok()) << part.status().ToString();
        ASSERT_EQ(static_cast<int64_t>(part->size()), tokens / tp * h);
        ASSERT_EQ(part->data(), act.data() + t * (tokens / tp) * h);
        parts.push_back(*part);
      }
      std::vector<float> back(act.size(), -1.0f);
      ASSERT_TRUE(SpGatherInto(parts, std::span<float>(back)).ok());
      ASSERT_EQ(back, act);
    }
  }
}

TEST(SpTest, RejectsBadArguments) {
  ExpectInvalid(SpRange(10, 4, 0).status(),
                {"local_tokens = 10", "not divisible by tp_size = 4", "T/CP"});
  ExpectInvalid(SpRange(8, 0, 0).status(), {"tp_size = 0", ">= 1"});
  ExpectInvalid(SpRange(8, 2, 2).status(), {"tp_rank = 2", "[0, tp_size = 2)"});
  ExpectInvalid(SpRange(8, 2, -1).status(), {"tp_rank = -1"});
  ExpectInvalid(SpRange(-2, 2, 0).status(), {"local_tokens = -2", ">= 0"});
  std::vector<int32_t> v(9);
  ExpectInvalid(SpSplit(std::span<int32_t>(v), 2, 0).status(), {"local_tokens = 9"});
  ExpectInvalid(SpSplit(std::span<int32_t>(v), 3, 0, 2).status(),
                {"elems_per_token = 2", "divide the local array size 9"});
  ExpectInvalid(SpSplit(std::span<int32_t>(v), 3, 0, 0).status(), {"elems_per_token = 0"});
  std::vector<std::vector<int32_t>> uneven{{1, 2}, {3}};
  ExpectInvalid(SpGather(uneven).status(), {"parts[1] has 1 elements", "parts[0] has 2"});
  std::vector<std::vector<int32_t>> none;
  ExpectInvalid(SpGather(none).status(), {"parts is empty"});
  std::vector<std::vector<int32_t>> two{{1, 2}, {3, 4}};
  std::vector<int32_t> out(3);
  ExpectInvalid(SpGatherInto(two, std::span<int32_t>(out)), {"out has 3", "sum of the parts, 4"});
}

}  // namespace
}  // namespace thdpack
