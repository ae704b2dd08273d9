// Built instead of mpi_backend.cc when THDPACK_WITH_MPI is off.
#include "thdpack/comm.h"

namespace thdpack {

bool MpiAvailable() { return false; }

Result<std::unique_ptr<ProcessGroup>> MpiWorld(bool) {
  return Status::Unimplemented(
      "MpiWorld: this build of thdpack has no MPI backend (configure with -DTHDPACK_WITH_MPI=ON)");
}

}  // namespace thdpack
