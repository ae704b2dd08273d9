// The process-group interface on the thread backend at world sizes 1..8 (the same checks run
// under mpirun in tests/mpi_check.cc), and the thread backend's guards against hangs.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "thdpack/comm_checks.h"
#include "thdpack/comm.h"

namespace thdpack {
namespace {

void ExpectAllOk(const std::vector<Status>& statuses) {
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
  }
}

class CommWorldSize : public ::testing::TestWithParam<int> {};

TEST_P(CommWorldSize, CollectivesAndSplits) {
  ExpectAllOk(RunOnThreads(GetParam(), testing::CheckProcessGroup));
}

TEST_P(CommWorldSize, AgreeOnStatus) {
  ExpectAllOk(RunOnThreads(GetParam(), testing::CheckAgreement));
}

INSTANTIATE_TEST_SUITE_P(Threads, CommWorldSize, ::testing::Range(1, 9));

// A rank that returns without taking part in a collective: its peers get kAborted naming it
// instead of waiting forever.
TEST(ThreadBackend, PeerThatLeftAbortsWaiters) {
  auto statuses = RunOnThreads(4, [](ProcessGroup& world) -> Status {
    if (world.rank() == 2) return Status::InvalidArgument("bad sample 7");
    std::vector<int64_t> v = {1};
    return world.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kSum);
  });
  ASSERT_EQ(statuses.size(), 4u);
  EXPECT_EQ(statuses[2].code(), StatusCode::kInvalidArgument);
  for (int r : {0, 1, 3}) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].ToString();
    EXPECT_NE(statuses[r].message().find("rank 2 has left"), std::string::npos)
        << statuses[r].ToString();
    EXPECT_NE(statuses[r].message().find("bad sample 7"), std::string::npos);
  }
}

TEST(ThreadBackend, RecvFromPeerThatLeft) {
  auto statuses = RunOnThreads(2, [](ProcessGroup& world) -> Status {
    if (world.rank() == 1) return Status::Ok();
    std::vector<int32_t> v(3);
    return world.RecvValues(std::span<int32_t>(v), 1, 0);
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kAborted);
  EXPECT_NE(statuses[0].message().find("Recv from member 1"), std::string::npos);
  EXPECT_TRUE(statuses[1].ok());
}

// A rank that is alive but never arrives (here: stuck in a barrier of another group) is caught
// by the timeout.
TEST(ThreadBackend, TimeoutInsteadOfHang) {
  ThreadBackendOptions options;
  options.timeout = std::chrono::milliseconds(200);
  const auto start = std::chrono::steady_clock::now();
  auto statuses = RunOnThreads(
      2,
      [](ProcessGroup& world) -> Status {
        std::vector<int64_t> v = {1};
        if (world.rank() == 0) return world.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kSum);
        return world.Recv(std::span<std::byte>(), 0, 3);  // rank 0 never sends
      },
      options);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  for (const Status& s : statuses) EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_LT(elapsed, std::chrono::seconds(20));
}

// A rank that is alive and never calls the collective: after the timeout its peers get
// kAborted naming it (and only it) as the member that did not arrive, in the world and in a
// group split from it (which inherits the world's timeout).
TEST(ThreadBackend, TimeoutNamesTheMembersThatDidNotArrive) {
  ThreadBackendOptions options;
  // Long enough that ranks 0 and 1, which leave the Split together, both reach the AllReduce
  // before it times out even on a loaded machine (at 100 ms one was once late, and named).
  options.timeout = std::chrono::milliseconds(500);
  std::atomic<int> done{0};
  auto statuses = RunOnThreads(
      4,
      [&](ProcessGroup& world) -> Status {
        EXPECT_EQ(world.timeout(), std::chrono::milliseconds(500));
        // The split itself under a generous timeout, so that a thread the scheduler delays
        // past 500 ms on a loaded machine cannot fail it; its groups inherit the world's.
        world.set_timeout(std::chrono::seconds(60));
        std::vector<std::vector<int>> halves = {{0, 1}, {2, 3}};
        auto half = world.Split(halves);
        if (!half.ok()) return half.status();
        EXPECT_EQ((*half)->timeout(), std::chrono::seconds(60));
        world.set_timeout(std::chrono::milliseconds(500));
        (*half)->set_timeout(std::chrono::milliseconds(500));
        Status s;
        if (world.rank() == 3) {
          // Busy elsewhere until every peer has given up: never calls the collectives below.
          while (done.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return Status::Ok();
        }
        if (world.rank() == 2) {
          s = (*half)->Barrier();  // waits for rank 3 in the group [2,3]
        } else {
          std::vector<int64_t> v = {1};
          s = world.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kSum);
        }
        ++done;
        return s;
      },
      options);
  for (int r : {0, 1}) {
    EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].ToString();
    EXPECT_NE(statuses[r].message().find("AllReduce on threads group [0,1,2,3]: not complete "
                                         "after 500 ms"),
              std::string::npos)
        << statuses[r].ToString();
    // Rank 2 is in its own Barrier, rank 3 nowhere: neither arrived.
    EXPECT_NE(statuses[r].message().find("members 2, 3 (global ranks 2, 3) did not arrive"),
              std::string::npos)
        << statuses[r].ToString();
  }
  EXPECT_EQ(statuses[2].code(), StatusCode::kAborted);
  EXPECT_NE(statuses[2].message().find("Barrier on threads group [2,3]: not complete after 500 ms"
                                       " (the timeout): member 1 (global rank 3) did not arrive"),
            std::string::npos)
      << statuses[2].ToString();
  EXPECT_TRUE(statuses[3].ok());
}

TEST(ThreadBackend, TimeoutDefaultsTo300Seconds) {
  EXPECT_EQ(ThreadBackendOptions{}.timeout, std::chrono::seconds(300));
  auto statuses = RunOnThreads(1, [](ProcessGroup& world) -> Status {
    if (world.timeout() != kDefaultCollectiveTimeout) return Status::Internal("not the default");
    return Status::Ok();
  });
  ExpectAllOk(statuses);
}

TEST(ThreadBackend, MismatchedArgumentsAreErrorsOnEveryRank) {
  auto statuses = RunOnThreads(3, [](ProcessGroup& world) -> Status {
    std::vector<int64_t> v(world.rank() == 1 ? 2 : 3);
    return world.BroadcastValues(std::span<int64_t>(v), 0);
  });
  // Rank 1 expects 2 values, the root sends 3: rank 1 errs; the others did nothing wrong.
  EXPECT_EQ(statuses[1].code(), StatusCode::kInvalidArgument) << statuses[1].ToString();
  EXPECT_TRUE(statuses[0].ok());
  // A bad root is rejected before any communication.
  statuses = RunOnThreads(2, [](ProcessGroup& world) -> Status {
    std::vector<int64_t> v(1);
    return world.BroadcastValues(std::span<int64_t>(v), 5);
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("root 5"), std::string::npos) << s.ToString();
  }
}

TEST(ThreadBackend, SplitRejectsOverlappingGroups) {
  auto statuses = RunOnThreads(4, [](ProcessGroup& world) -> Status {
    std::vector<std::vector<int>> groups = {{0, 1}, {1, 2, 3}};
    return world.Split(groups).status();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("disjoint"), std::string::npos) << s.ToString();
  }
}

TEST(ThreadBackend, ExceptionBecomesInternal) {
  auto statuses = RunOnThreads(2, [](ProcessGroup& world) -> Status {
    if (world.rank() == 0) throw std::runtime_error("boom");
    return world.Barrier();
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kInternal);
  EXPECT_NE(statuses[0].message().find("boom"), std::string::npos);
  EXPECT_EQ(statuses[1].code(), StatusCode::kAborted);
}

TEST(MpiBackend, BuildWithoutMpiSaysSo) {
  if (MpiAvailable()) GTEST_SKIP() << "MPI backend built: tested under mpirun (tests/mpi_check.cc)";
  auto w = MpiWorld();
  EXPECT_EQ(w.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(w.status().message().find("THDPACK_WITH_MPI"), std::string::npos);
}

}  // namespace
}  // namespace thdpack
