// The options `thdpack plan` and `thdpack run` share (thdpack/job.h's JobOptions), registered
// on a subcommand by one function with the same names and help for both, and the one progress
// bar both draw.
#ifndef THDPACK_TOOLS_JOB_ARGS_H_
#define THDPACK_TOOLS_JOB_ARGS_H_

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "thdpack/job.h"
#include "thdpack/status.h"

namespace thdpack::tools {

struct JobArgs {
  JobOptions options;                 // the defaults shown are those set here before AddJobOptions
  std::string global_batch = "256";  // --global-batch text (ParseGlobalBatch)
  std::string memory_limit = "0";    // --memory-limit text (ParseMemoryLimit)
  int64_t steps = 3;                  // --steps, when given
  CLI::Option* steps_option = nullptr;
};

// Registers --data, --dp, --cp, --tp, --pp, --sp, --align, --max-tokens-per-rank,
// --global-batch, --steps, --scheduler, --cost, --microbatch-multiple, --num-microbatches,
// --oversize, --seed, --shuffle, --vocab, --mock-samples, --vocab-size, --logits-dtype,
// --fused-grad and --memory-limit on `cmd`, writing into `args` (which must outlive the parse).
void AddJobOptions(CLI::App* cmd, JobArgs* args);

// The parsed options as a checked job (errors name the option).
[[nodiscard]] Result<Job> ResolveJobArgs(const JobArgs& args);

// Draws "[#####.....] step 3/10" on stderr, only when stderr is a terminal and there is more
// than one step.
class ProgressBar {
 public:
  explicit ProgressBar(int64_t total);
  // Erases the bar so that a line printed after it starts at the left.
  void Clear();
  // `done` of `total` steps are done; the bar disappears at the last.
  void Update(int64_t done);

 private:
  int64_t total_;
  bool on_;
};

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_JOB_ARGS_H_
