// Run under mpirun (ctest: `mpirun -np 8 thdpack_mpi_check`): the process-group checks of
// tests/comm_checks.h on the MPI backend. Exits 0 when every check passed on every rank, 1
// otherwise; each rank prints its first failure.
#include <cstdio>
#include <string>

#include "comm_checks.h"
#include "thdpack/comm.h"

namespace {

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
  int failures = 0;
  for (const Check& c : checks) {
    thdpack::Status s = c.fn(world);
    // Every rank learns whether any rank failed this check, so all exit with the same code.
    thdpack::Status agreed = thdpack::AgreeOnStatus(world, s, c.name);
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s: %s\n", world.rank(), c.name, s.ToString().c_str());
    }
    if (!agreed.ok()) ++failures;
    if (world.rank() == 0) {
      std::printf("%s on %d MPI ranks: %s\n", c.name, world.size(), agreed.ok() ? "ok" : "FAILED");
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() { return Run(); }
