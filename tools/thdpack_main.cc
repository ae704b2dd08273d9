// thdpack: the command line. Uses only the public API.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "commands.h"
#include "thdpack/thdpack.h"

int main(int argc, char** argv) {
  CLI::App app{
      "thdpack: the data plane of packed-sequence (THD) distributed training.\n"
      "Shows what your data does at a given topology: balance, padding, microbatches, FLOPs\n"
      "(plan), context-parallel zigzag shards and sequence-parallel splits (layout)."};
  app.set_version_flag("--version", std::string("thdpack ") + thdpack::kVersion);
  app.require_subcommand(0, 1);
  int exit_code = 0;
  thdpack::tools::AddLayoutCommand(app, &exit_code);
  thdpack::tools::AddPlanCommand(app, &exit_code);
  CLI11_PARSE(app, argc, argv);
  if (app.get_subcommands().empty()) {
    std::fputs(app.help().c_str(), stdout);
  }
  return exit_code;
}
