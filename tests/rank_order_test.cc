// The step under every rank order (JobOptions::rank_order, thdpack run --rank-order), on the
// thread backend: the world rank that holds coordinates (tp, cp, dp, pp) under an order gets
// exactly the step the rank with those coordinates gets under Megatron's default order - its
// tensors, metadata and CP group (whose members are compared by their coordinates) - for the
// balanced and the dynamic scheduler, with TP, CP, DP and PP mixed. An order that is not a
// permutation of tp, cp, dp, pp is an error naming --rank-order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/job.h"
#include "thdpack/step_runner.h"
#include "thdpack/topology.h"

namespace thdpack {
namespace {

std::vector<std::string> AllOrders() {
  std::vector<std::string> dims = {"cp", "dp", "pp", "tp"};  // sorted: next_permutation's start
  std::vector<std::string> out;
  do {
    out.push_back(dims[0] + "-" + dims[1] + "-" + dims[2] + "-" + dims[3]);
  } while (std::next_permutation(dims.begin(), dims.end()));
  return out;
}

std::string CoordText(const Topology& t, int rank) {
  const Coord c = *t.CoordOf(rank);
  std::ostringstream s;
  s << "(" << c.tp << "," << c.cp << "," << c.dp << "," << c.pp << ")";
  return s.str();
}

template <typename T>
void Put(std::ostream& s, const char* name, const std::vector<T>& v) {
  s << " " << name;
  for (const T& x : v) s << " " << static_cast<int64_t>(x);
}

// What one rank's step holds, its CP group's members named by their coordinates.
std::string Digest(const RankStep& s, const Topology& t) {
  std::ostringstream out;
  out << "step " << s.step << " loader " << s.is_loader << " n " << s.meta.n_loss_tokens << "\n";
  for (const LocalMicrobatch& mb : s.microbatches) {
    Put(out, "cu", mb.cu_seqlens);
    Put(out, "cup", mb.cu_seqlens_padded);
    Put(out, "tokens", mb.tokens);
    Put(out, "pos", mb.position_ids);
    Put(out, "labels", mb.labels);
    Put(out, "mask", mb.loss_mask);
    out << " sp " << mb.sp_range.first << "+" << mb.sp_range.second << " cp " << mb.cp_size
        << "/" << mb.cp_rank << " first " << mb.first_rank << " idle " << mb.idle << " group";
    if (mb.cp_group) {
      for (int r : mb.cp_group->ranks()) out << " " << CoordText(t, r);
    }
    out << "\n";
  }
  return out.str();
}

// Every rank's steps, by the rank's coordinates.
std::map<std::string, std::string> RunByCoordinates(const Job& job, int steps) {
  std::vector<std::string> digest(static_cast<size_t>(job.topology.world_size()));
  auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& world) -> Status {
    THDPACK_ASSIGN_OR_RETURN(auto runner,
                             StepRunner::Create(world, job.topology, RunnerOptions(job)));
    for (int s = 0; s < steps; ++s) {
      THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
      digest[static_cast<size_t>(world.rank())] += Digest(step, job.topology);
    }
    return Status::Ok();
  });
  std::map<std::string, std::string> out;
  for (int r = 0; r < job.topology.world_size(); ++r) {
    EXPECT_TRUE(statuses[static_cast<size_t>(r)].ok()) << statuses[static_cast<size_t>(r)].ToString();
    out[CoordText(job.topology, r)] = digest[static_cast<size_t>(r)];
  }
  return out;
}

Job MakeJob(int tp, int cp, int dp, int pp, bool sp, const std::string& scheduler,
            const std::string& order) {
  JobOptions o;
  o.tp = tp;
  o.cp = cp;
  o.dp = dp;
  o.pp = pp;
  o.sp = sp;
  o.rank_order = order;
  o.scheduler = scheduler;
  o.global_batch = 12;
  o.max_tokens_per_rank = 16384;
  o.source.shuffle = true;
  o.source.mock_num_samples = 60;
  o.timeout = 60;
  auto job = ResolveJob(o);
  EXPECT_TRUE(job.ok()) << job.status().ToString();
  return *job;
}

TEST(RankOrder, EveryOrderGivesEachCoordinateTheDefaultOrdersStep) {
  struct Sizes {
    int tp, cp, dp, pp;
    bool sp;
  };
  const Sizes cases[] = {{2, 2, 2, 1, true}, {1, 2, 2, 2, false}, {2, 1, 2, 2, false}};
  const std::vector<std::string> orders = AllOrders();
  ASSERT_EQ(orders.size(), 24u);
  for (const Sizes& c : cases) {
    for (const std::string scheduler : {"balanced", "dynamic"}) {
      const auto want = RunByCoordinates(
          MakeJob(c.tp, c.cp, c.dp, c.pp, c.sp, scheduler, std::string(kDefaultRankOrder)), 2);
      // Orders that place ranks alike at these sizes (they differ in a dimension of size 1)
      // run once.
      std::map<std::string, std::string> placement_seen;
      for (const std::string& order : orders) {
        const Job job = MakeJob(c.tp, c.cp, c.dp, c.pp, c.sp, scheduler, order);
        ASSERT_EQ(job.topology.order(), order);
        std::string placement;
        for (int r = 0; r < job.topology.world_size(); ++r) placement += CoordText(job.topology, r);
        if (!placement_seen.emplace(placement, order).second) continue;
        const auto got = RunByCoordinates(job, 2);
        ASSERT_EQ(got.size(), want.size());
        for (const auto& [coord, digest] : want) {
          EXPECT_EQ(got.at(coord), digest)
              << "order " << order << ", " << scheduler << ", rank at " << coord << " of "
              << job.topology.ToString();
        }
      }
      EXPECT_EQ(placement_seen.size(), 6u) << "three dimensions of size 2: 3! placements";
    }
  }
}

TEST(RankOrder, ABadOrderNamesTheOption) {
  JobOptions o;
  for (const std::string bad : {"tp-cp-dp", "tp-cp-dp-dp", "tp-cp-dp-ep", "", "tp-cp-dp-pp-"}) {
    o.rank_order = bad;
    auto job = ResolveJob(o);
    ASSERT_FALSE(job.ok()) << bad;
    EXPECT_EQ(job.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(job.status().message().find("--rank-order"), std::string::npos)
        << job.status().ToString();
  }
}

}  // namespace
}  // namespace thdpack
