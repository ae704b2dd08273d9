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
  // The defaults shown are those set here before AddJobOptions. `plan` and `run` share them
  // (DP=4, CP=2 on the built-in mock, 3 steps of 256), so a `run` after a `plan` with the same
  // options shows the same steps.
  JobArgs() {
    options.dp = 4;
    options.cp = 2;
  }
  JobOptions options;
  std::string global_batch = "256";  // --global-batch text (ParseGlobalBatch)
  std::string memory_limit = "0";    // --memory-limit text (ParseMemoryLimit)
  std::string rank_multiple = "1";   // --rank-multiple text (ParseRankMultiple)
  int64_t steps = 3;                  // --steps, when given
  CLI::Option* steps_option = nullptr;
  CLI::Option* global_batch_option = nullptr;
  CLI::Option* mock_samples_option = nullptr;
  CLI::Option* logits_dtype_option = nullptr;
  CLI::Option* fused_grad_option = nullptr;
  // The subcommand the options were registered on: which were given (JobOptions::given).
  CLI::App* app = nullptr;
};

// Registers --data, --dp, --cp, --tp, --pp, --sp, --align, --rank-multiple, --max-tokens-per-rank,
// --global-batch, --global-batch-tokens, --steps, --scheduler, --cost, --microbatch-multiple,
// --num-microbatches, --oversize, --seed, --shuffle, --vocab, --mock-samples, --vocab-size, --logits-dtype,
// --fused-grad and --memory-limit on `cmd`, writing into `args` (which must outlive the parse).
void AddJobOptions(CLI::App* cmd, JobArgs* args);

// The parsed options as a checked job (errors name the option). Beyond ResolveJob: options
// given where they do nothing are errors (--mock-samples without a mock source; --logits-dtype
// or --fused-grad without a vocabulary), and `megatron:PREFIX.idx` or `.bin` is taken as
// `megatron:PREFIX` with a note on stderr (`verb` names the command in it).
[[nodiscard]] Result<Job> ResolveJobArgs(const JobArgs& args, const char* verb);

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
