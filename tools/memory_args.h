// The memory-report options of `thdpack plan` and `thdpack run` (thdpack/memory_report.h) and
// the readable lines both print.
#ifndef THDPACK_TOOLS_MEMORY_ARGS_H_
#define THDPACK_TOOLS_MEMORY_ARGS_H_

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/memory_report.h"
#include "thdpack/status.h"

namespace thdpack::tools {

struct MemoryArgs {
  int64_t vocab_size = 0;             // --vocab-size; 0: the --cost model's V, if it has one
  std::string logits_dtype = "bf16";  // --logits-dtype
  bool fused_grad = false;            // --fused-grad
  // `run` only.
  std::string profile_steps;                // --memory-profile-steps, e.g. "0,1"; empty: none
  std::string profile_dir = "memory_profile";  // --memory-profile-dir
};

// Adds --vocab-size, --logits-dtype and --fused-grad to `cmd`, and with `profile` also
// --memory-profile-steps and --memory-profile-dir.
void AddMemoryOptions(CLI::App* cmd, MemoryArgs* args, bool profile);

// The report's options. vocab_size 0 takes V from `cost_spec` (llama2-7b: 32000, llama3-8b:
// 128256, dimensions: their v=) and leaves it 0 (no logits figures) for tokens and A,B.
// Errors name the option (--vocab-size, --logits-dtype, --cost).
[[nodiscard]] Result<MemoryReportOptions> ResolveMemoryOptions(const MemoryArgs& args,
                                                               std::string_view cost_spec);

// --memory-profile-steps: comma-separated step numbers, each below `steps` (the steps that run);
// sorted, without repeats. Empty text: none. Errors name the option.
[[nodiscard]] Result<std::vector<int64_t>> ParseProfileSteps(std::string_view text,
                                                             int64_t steps);

// "12 B", "1.50 KiB" (binary: powers of 1024) or "1.50 KB" (decimal: powers of 1000).
std::string FormatBytes(double bytes, bool binary);
// Bytes in binary units: "512 B", "1.50 KiB", "1.88 MiB", "37.09 GiB".
std::string BinaryBytes(int64_t bytes);

// "bf16", "fp32", "fp64".
std::string_view ShortDtypeName(LogitsDtype dtype);

// "37.09 GiB gathered over CP, 18.55 GiB CP-local (largest microbatch T=131072, V=151936,
// bf16)", with ", fused gradient included" inside the brackets when it is counted.
std::string LogitsLine(const LogitsFigures& logits);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_MEMORY_ARGS_H_
