// Cross-area: the process groups of a topology (thdpack/topology.h) made on the thread
// backend (thdpack/comm.h). comm does not use topology, so this test lives here, not beside
// either area.
#include <gtest/gtest.h>

#include <vector>

#include "thdpack/comm_checks.h"
#include "thdpack/comm.h"
#include "thdpack/topology.h"

namespace thdpack {
namespace {

void ExpectAllOk(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
}

// Groups of a topology, made by Split from Topology::AllGroups: membership and order match the
// topology's lists, and a sum over each group is right.
TEST(ThreadBackend, TopologyGroups) {
  auto topo = Topology::Create(2, 2, 2, 1);
  ASSERT_TRUE(topo.ok());
  for (GroupKind kind : {GroupKind::kTp, GroupKind::kCp, GroupKind::kDp, GroupKind::kDpCp,
                         GroupKind::kPp}) {
    const auto groups = topo->AllGroups(kind);
    auto statuses = RunOnThreads(topo->world_size(), [&](ProcessGroup& world) -> Status {
      THDPACK_ASSIGN_OR_RETURN(auto g, world.Split(groups));
      THDPACK_ASSIGN_OR_RETURN(auto expect, topo->GroupOf(kind, world.rank()));
      if (!g || std::vector<int>(g->ranks().begin(), g->ranks().end()) != expect) {
        return Status::Internal("membership");
      }
      auto coord = topo->CoordOf(world.rank());
      if (g->rank() != topo->IndexInGroup(kind, *coord)) return Status::Internal("position");
      std::vector<int64_t> v = {world.rank()};
      THDPACK_RETURN_IF_ERROR(g->AllReduceInt64(std::span<int64_t>(v), ReduceOp::kSum));
      int64_t sum = 0;
      for (int x : expect) sum += x;
      return v[0] == sum ? Status::Ok() : Status::Internal("sum");
    });
    ExpectAllOk(statuses);
  }
}

}  // namespace
}  // namespace thdpack
