// Run under mpirun (ctest: `mpirun -np 8 thdpack_mpi_check`): the process-group checks of
// tests/comm_checks.h and the distributed-step checks of tests/step_checks.h (the eight
// topologies, with and without SP, both data-on modes) on the MPI backend, plus the failure
// path (a sample over the budget on one loader), `run --scheduler dynamic --verify` at the
// topologies of tests/dynamic_checks.h, and fields through the step and back
// (tests/fields_checks.h). Exits 0 when every check passed on every rank,
// 1 otherwise; each rank prints its first failure.
//
// `thdpack_mpi_check --timeout-check`: the collective timeout (tests/cli_timeout_test.cmake).
// The last rank sleeps instead of calling an all-reduce that every other rank calls with a
// timeout of 1 s: a waiting rank must print the error naming the last rank and end the job with
// MPI_Abort, so mpirun exits non-zero well before the sleeper would have woken.
#include <cstdio>
#include <string>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "thdpack/comm_checks.h"
#include "dynamic_checks.h"
#include "fields_checks.h"
#include "step_checks.h"
#include "thdpack/comm.h"

namespace {

using thdpack::Status;

// A sample over the budget read by the loader of replica 1 only: it must fail there and come
// back as kAborted naming that loader on every other rank.
Status CheckOversizeFailure(thdpack::ProcessGroup& world, const std::string& lengths_file) {
  auto topo = *thdpack::Topology::Create(2, 1, 2, 2);
  thdpack::StepRunnerOptions o;
  o.data = "lengths:" + lengths_file;
  o.global_batch = 16;
  o.schedule.max_tokens_per_rank = 1000;
  THDPACK_ASSIGN_OR_RETURN(o.schedule.parallel, thdpack::testing::TopologyLayout(topo, false));
  o.schedule.dp_size = 2;  // the topology's
  THDPACK_ASSIGN_OR_RETURN(auto runner, thdpack::StepRunner::Create(world, topo, o));
  Status s = runner->Next().status();
  const thdpack::Coord c = *topo.CoordOf(world.rank());
  const bool reads_it = c.dp == 1 && c.tp == 0 && c.pp == 0;
  if (reads_it && (s.code() != thdpack::StatusCode::kInvalidArgument ||
                   s.message().find("sample id 5") == std::string::npos)) {
    return Status::Internal("the loader holding the bad sample got " + s.ToString());
  }
  if (!reads_it && (s.code() != thdpack::StatusCode::kAborted ||
                    s.origin() != thdpack::StatusCode::kInvalidArgument ||
                    s.message().find("sample id 5") == std::string::npos)) {
    return Status::Internal("a peer of the failed loader got " + s.ToString());
  }
  return Status::Ok();
}

int Run() {
  auto world_or = thdpack::MpiWorld();
  if (!world_or.ok()) {
    std::fprintf(stderr, "thdpack_mpi_check: %s\n", world_or.status().ToString().c_str());
    return 1;
  }
  thdpack::ProcessGroup& world = **world_or;
  struct Check {
    const char* name;
    thdpack::Status (*fn)(thdpack::ProcessGroup&);
  };
  const Check checks[] = {
      {"process group", thdpack::testing::CheckProcessGroup},
      {"status agreement", thdpack::testing::CheckAgreement},
  };
  // Test data, written by rank 0 into a scratch folder whose name all ranks learn.
  int64_t pid = static_cast<int64_t>(getpid());
  if (!world.BroadcastValues(std::span<int64_t>(&pid, 1), 0).ok()) return 1;
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("thdpack_mpi_check_" + std::to_string(pid))).string();
  const std::string jsonl = dir + "/steps.jsonl", lengths = dir + "/oversize.lengths";
  if (world.rank() == 0) {
    std::filesystem::create_directories(dir);
    thdpack::testing::WriteStepTestJsonl(jsonl, 50, 200, 11);
    std::ofstream out(lengths);
    for (int i = 0; i < 16; ++i) out << (i == 5 ? 5000 : 50) << "\n";
  }
  if (!world.Barrier().ok()) return 1;

  int failures = 0;
  auto report = [&](const std::string& name, const Status& s) {
    // Every rank learns whether any rank failed this check, so all exit with the same code.
    Status agreed = thdpack::AgreeOnStatus(world, s, name);
    if (!s.ok()) std::fprintf(stderr, "rank %d: %s: %s\n", world.rank(), name.c_str(), s.ToString().c_str());
    if (!agreed.ok()) ++failures;
    if (world.rank() == 0) {
      std::printf("%s on %d MPI ranks: %s\n", name.c_str(), world.size(), agreed.ok() ? "ok" : "FAILED");
    }
  };
  for (const Check& c : checks) report(c.name, c.fn(world));
  for (const auto& k : thdpack::testing::AllStepCases()) {
    report("step " + thdpack::testing::CaseName(k),
           thdpack::testing::RunAndVerifyCase(world, k, jsonl, 24, 3));
  }
  report("step global batch = whole source",
         thdpack::testing::RunAndVerifyCase(world, {2, 2, 2, 1, true, thdpack::DataOn::kTp0}, jsonl, 0, 2));
  report("oversize sample on one loader", CheckOversizeFailure(world, lengths));
  // run --scheduler dynamic --verify at the topologies, in this one job (a topology of
  // fewer ranks runs on the first ones).
  for (const auto& t : thdpack::testing::DynamicVerifyTopologies()) {
    std::vector<thdpack::LossSummary> losses;
    report("dynamic verify " + thdpack::testing::DynName(t),
           thdpack::testing::RunDynamicVerify(world, t, "jsonl:" + jsonl, 1, &losses));
  }
  // Fields through the step and back (tests/fields_checks.h), at topologies of the 8 ranks.
  const thdpack::testing::FieldsCase field_cases[] = {
      {1, 2, 2, 2, false, "tp0", "balanced"}, {2, 2, 2, 1, true, "tp0", "sequential"},
      {1, 2, 4, 1, false, "tp0", "dynamic"},  {2, 1, 2, 2, false, "all", "balanced"}};
  for (const auto& c : field_cases) {
    const thdpack::Job job = thdpack::testing::MakeJob(c, 24);
    if (job.topology.world_size() != world.size()) continue;
    report("fields " + thdpack::testing::Name(c),
           thdpack::testing::RunFieldsCase(world, job, 2, 0));
    report("unpack " + thdpack::testing::Name(c),
           thdpack::testing::RunUnpackCase(world, job, -1, nullptr));
    if (std::string(c.scheduler) == "sequential") continue;
    for (const char* keep : {"microbatch", "replica"}) {
      report(std::string("groups ") + keep + " " + thdpack::testing::Name(c),
             thdpack::testing::RunGroupsCase(world, c, keep, 2, 0));
    }
  }
  (void)world.Barrier();
  if (world.rank() == 0) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return failures == 0 ? 0 : 1;
}

// Never returns 0: the job is to end by MPI_Abort from a waiting rank.
int RunTimeoutCheck() {
  auto world_or = thdpack::MpiWorld();
  if (!world_or.ok()) {
    std::fprintf(stderr, "thdpack_mpi_check: %s\n", world_or.status().ToString().c_str());
    return 1;
  }
  thdpack::ProcessGroup& world = **world_or;
  world.set_timeout(std::chrono::milliseconds(1000));
  std::vector<int64_t> v = {1};
  if (!world.AllReduceInt64(std::span<int64_t>(v), thdpack::ReduceOp::kSum).ok()) return 1;
  if (world.rank() == world.size() - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    std::fprintf(stderr, "thdpack_mpi_check: the sleeper woke up: the job was not ended\n");
    return 3;
  }
  Status s = world.AllReduceInt64(std::span<int64_t>(v), thdpack::ReduceOp::kSum);
  std::fprintf(stderr, "thdpack_mpi_check: rank %d: the all-reduce returned %s\n", world.rank(),
               s.ToString().c_str());
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--timeout-check") return RunTimeoutCheck();
  return Run();
}
