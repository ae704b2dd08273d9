// thdpack: the command line. Uses only the public API. Exit codes (docs/errors.md): 0 success,
// 2 bad usage or bad input (option parse errors included), 1 a failure while running.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "arrow_readers.h"
#include "commands.h"
#include "exit_code.h"
#include "thdpack/thdpack.h"

namespace {

// " (--verify is an option of `thdpack run`)" when an option the chosen verb does not know
// belongs to another verb.
std::string OtherVerbHint(const CLI::App& app, const std::vector<std::string>& extras) {
  std::string hint;
  for (const std::string& extra : extras) {
    if (extra.rfind("--", 0) != 0) continue;
    const std::string name = extra.substr(0, extra.find('='));
    for (const CLI::App* verb : app.get_subcommands({})) {
      if (verb->get_option_no_throw(name) != nullptr && !verb->parsed()) {
        hint += "; " + name + " is an option of `thdpack " + verb->get_name() + "`";
        break;
      }
    }
  }
  return hint;
}

}  // namespace

// Planning a large step allocates and frees arrays of tens of MB, step after step. glibc maps
// each such block anew (and zeroes its pages on first touch, about a fault per 4 KiB) and
// unmaps it on free; kept in the heap instead, a freed block's pages are reused by the next.
// Only the command line does this: the library leaves the allocator of its host alone.
void KeepLargeBlocksInTheHeap() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
#endif
}

int main(int argc, char** argv) {
  KeepLargeBlocksInTheHeap();
  thdpack::tools::InstallArrowReaders();
  CLI::App app{
      "thdpack: the data plane of packed-sequence (THD) distributed training.\n"
      "Shows what your data does at a given topology, and runs it:\n"
      "  plan    balance, padding, microbatches, FLOPs and memory of each step (no ranks)\n"
      "  run     the distributed step loop on thread or MPI ranks: the same figures, the bytes\n"
      "          each rank sent and the time of each phase (--verify checks the data end to end)\n"
      "  layout  context-parallel zigzag shards and sequence-parallel splits of given lengths\n"
      "  calibrate  a measured cost profile (--cost profile:FILE) from timed microbatches\n"
      "`thdpack VERB --help` lists a verb's options. Exit codes: 0 success, 2 bad usage or bad\n"
      "input, 1 a failure while running (docs/errors.md)."};
  app.set_version_flag("--version", std::string("thdpack ") + thdpack::kVersion);
  app.require_subcommand(0, 1);
  int exit_code = 0;
  thdpack::tools::AddLayoutCommand(app, &exit_code);
  thdpack::tools::AddRunCommand(app, &exit_code);
  thdpack::tools::AddPlanCommand(app, &exit_code);
  thdpack::tools::AddCalibrateCommand(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ExtrasError& e) {
    std::string verb;
    for (const CLI::App* sub : app.get_subcommands()) verb = " " + sub->get_name();
    std::vector<std::string> extras;
    for (const CLI::App* sub : app.get_subcommands()) {
      for (const std::string& x : sub->remaining()) extras.push_back(x);
    }
    for (const std::string& x : app.remaining()) extras.push_back(x);
    std::fprintf(stderr, "thdpack%s: %s%s (see thdpack%s --help)\n", verb.c_str(), e.what(),
                 OtherVerbHint(app, extras).c_str(), verb.c_str());
    return thdpack::tools::kExitBadInput;
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0: CLI11 prints them.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::string verb;
    for (const CLI::App* sub : app.get_subcommands()) verb = " " + sub->get_name();
    std::fprintf(stderr, "thdpack%s: %s (see thdpack%s --help)\n", verb.c_str(), e.what(),
                 verb.c_str());
    return thdpack::tools::kExitBadInput;
  } catch (const std::exception& e) {
    // The library returns statuses; an exception here is a bug.
    std::fprintf(stderr, "thdpack: internal error: %s\n", e.what());
    return thdpack::tools::kExitFailure;
  }
  if (app.get_subcommands().empty()) {
    std::fputs(app.help().c_str(), stdout);
  }
  return exit_code;
}
