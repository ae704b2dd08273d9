// The exit codes of the thdpack command line (docs/errors.md): 0 success, 2 bad usage or bad
// input, 1 a failure while running. One function maps a status to its code, so `plan`, `run`
// and `layout` give the same code for the same cause, and every rank of a `run` the same code
// (the failed rank's code reaches every rank as Status::origin, through AgreeOnStatus).
#ifndef THDPACK_TOOLS_EXIT_CODE_H_
#define THDPACK_TOOLS_EXIT_CODE_H_

#include "thdpack/status.h"

namespace thdpack::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;   // while running: a bug, a rank that left, a timeout
inline constexpr int kExitBadInput = 2;  // the command line, or the data or files it names

// From status.origin(): InvalidArgument, Corruption, IOError, OutOfRange, NotFound and
// Unimplemented are bad input (2); Internal and Aborted (a peer left, a timeout, an MPI error)
// are failures while running (1); OK is 0.
int ExitCodeOf(const Status& status);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_EXIT_CODE_H_
