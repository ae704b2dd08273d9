#include "exit_code.h"

namespace thdpack::tools {

int ExitCodeOf(const Status& status) {
  switch (status.origin()) {
    case StatusCode::kOk:
    case StatusCode::kEndOfData: return kExitOk;  // a stream that ended: not a failure
    case StatusCode::kInvalidArgument:
    case StatusCode::kCorruption:
    case StatusCode::kIOError:
    case StatusCode::kOutOfRange:
    case StatusCode::kNotFound:
    case StatusCode::kUnimplemented:
    case StatusCode::kResourceExhausted: return kExitBadInput;
    case StatusCode::kInternal:
    case StatusCode::kAborted: return kExitFailure;
  }
  return kExitFailure;
}

}  // namespace thdpack::tools
