// Uses the installed headers and library; exits non-zero if anything is off.
#include <cstdio>

#include "thdpack/thdpack.h"

int main() {
  thdpack::Status bad = thdpack::Status::InvalidArgument("demo");
  if (bad.ok() || bad.ToString() != "InvalidArgument: demo") {
    std::fprintf(stderr, "consumer: Status misbehaves\n");
    return 1;
  }
  std::printf("consumer: thdpack %s found and linked\n", thdpack::kVersion);
  return 0;
}
