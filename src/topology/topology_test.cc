#include "thdpack/topology.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

namespace thdpack {
namespace {

using Groups = std::vector<std::vector<int>>;

TEST(TopologyTest, DefaultOrderIsMegatrons) {
  auto t = Topology::Create(2, 2, 2, 1);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->world_size(), 8);
  EXPECT_EQ(t->order(), "tp-cp-dp-pp");
  // rank = tp + TP*(cp + CP*(dp + DP*pp)), written out by hand.
  EXPECT_EQ(t->AllGroups(GroupKind::kTp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(t->AllGroups(GroupKind::kCp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(t->AllGroups(GroupKind::kDp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(t->AllGroups(GroupKind::kDpCp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(t->AllGroups(GroupKind::kPp), (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
  auto c = t->CoordOf(6);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (Coord{.tp = 0, .cp = 1, .dp = 1, .pp = 0}));
  EXPECT_EQ(*t->RankOf(Coord{.tp = 1, .cp = 0, .dp = 1, .pp = 0}), 5);
}

TEST(TopologyTest, PipelineGroupsFollowStages) {
  auto t = Topology::Create(2, 1, 1, 4);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->AllGroups(GroupKind::kPp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(*t->GroupOf(GroupKind::kTp, 5), (std::vector<int>{4, 5}));
}

TEST(TopologyTest, OtherOrderChangesMembership) {
  // tp-dp-cp-pp: rank = tp + TP*(dp + DP*(cp + CP*pp)).
  auto t = Topology::Create(2, 2, 2, 1, "tp-dp-cp-pp");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t->GroupOf(GroupKind::kCp, 0), (std::vector<int>{0, 4}));
  EXPECT_EQ(*t->GroupOf(GroupKind::kDp, 0), (std::vector<int>{0, 2}));
  // DPxCP is ordered dp-major, cp fastest, whatever the rank order: (dp0,cp0) (dp0,cp1) ...
  EXPECT_EQ(*t->GroupOf(GroupKind::kDpCp, 1), (std::vector<int>{1, 5, 3, 7}));
  EXPECT_EQ(*t->RankOf(Coord{.tp = 1, .cp = 1, .dp = 0, .pp = 0}), 5);
}

// Every order, every size combination: groups partition the world; members share the fixed
// coordinates and sit at the position their varying coordinates give; rank <-> coord inverse.
TEST(TopologyTest, GroupsPartitionTheWorldForEveryOrder) {
  std::vector<std::string> names = {"tp", "cp", "dp", "pp"};
  std::sort(names.begin(), names.end());
  do {
    const std::string order = names[0] + "-" + names[1] + "-" + names[2] + "-" + names[3];
    for (int tp : {1, 2, 3}) for (int cp : {1, 2}) for (int dp : {1, 3}) for (int pp : {1, 2}) {
      auto t = Topology::Create(tp, cp, dp, pp, order);
      ASSERT_TRUE(t.ok()) << order;
      std::set<int> ranks;
      for (int r = 0; r < t->world_size(); ++r) {
        Coord c = *t->CoordOf(r);
        ASSERT_EQ(*t->RankOf(c), r) << order;
        ranks.insert(r);
      }
      ASSERT_EQ(static_cast<int>(ranks.size()), tp * cp * dp * pp);
      for (GroupKind kind : {GroupKind::kTp, GroupKind::kCp, GroupKind::kDp, GroupKind::kDpCp,
                             GroupKind::kPp}) {
        std::vector<int> owner(t->world_size(), 0);
        for (const auto& g : t->AllGroups(kind)) {
          for (size_t i = 0; i < g.size(); ++i) {
            ++owner[g[i]];
            Coord ci = *t->CoordOf(g[i]);
            Coord c0 = *t->CoordOf(g[0]);
            EXPECT_EQ(t->IndexInGroup(kind, ci), static_cast<int>(i)) << order;
            // Fixed coordinates are shared.
            if (kind != GroupKind::kTp) EXPECT_EQ(ci.tp, c0.tp);
            if (kind != GroupKind::kCp && kind != GroupKind::kDpCp) EXPECT_EQ(ci.cp, c0.cp);
            if (kind != GroupKind::kDp && kind != GroupKind::kDpCp) EXPECT_EQ(ci.dp, c0.dp);
            if (kind != GroupKind::kPp) EXPECT_EQ(ci.pp, c0.pp);
          }
        }
        for (int r = 0; r < t->world_size(); ++r) EXPECT_EQ(owner[r], 1) << order;
      }
    }
  } while (std::next_permutation(names.begin(), names.end()));
}

TEST(TopologyTest, BadInputIsNamed) {
  auto a = Topology::Create(2, 0, 1, 1);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("cp size 0"), std::string::npos) << a.status().message();
  auto b = Topology::Create(1, 1, 1, 1, "tp-cp-dp");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("names 3 dimensions"), std::string::npos);
  auto c = Topology::Create(1, 1, 1, 1, "tp-cp-dp-ep");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("\"ep\" is not one of them"), std::string::npos);
  auto d = Topology::Create(1, 1, 1, 1, "tp-tp-dp-pp");
  ASSERT_FALSE(d.ok());
  auto e = Topology::Create(65536, 65536, 1, 1);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kOutOfRange);
  auto t = Topology::Create(2, 1, 1, 1);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->CoordOf(2).ok());
  EXPECT_FALSE(t->CoordOf(-1).ok());
  EXPECT_FALSE(t->RankOf(Coord{.tp = 2}).ok());
  EXPECT_FALSE(t->GroupOf(GroupKind::kTp, 9).ok());
}

}  // namespace
}  // namespace thdpack
