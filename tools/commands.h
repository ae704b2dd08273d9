// The subcommands of the thdpack command line. Each Add*Command registers its options on the
// app and a callback that runs it; a command reports errors on stderr and sets *exit_code.
// Uses only the public API of the library.
#ifndef THDPACK_TOOLS_COMMANDS_H_
#define THDPACK_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>

namespace thdpack::tools {

void AddLayoutCommand(CLI::App& app, int* exit_code);
void AddRunCommand(CLI::App& app, int* exit_code);
void AddPlanCommand(CLI::App& app, int* exit_code);
void AddCalibrateCommand(CLI::App& app, int* exit_code);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_COMMANDS_H_
