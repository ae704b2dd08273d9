// The summary block `thdpack plan` and `thdpack run` both end with: totals over the steps,
// the memory lines and the skipped samples.
#ifndef THDPACK_TOOLS_SUMMARY_H_
#define THDPACK_TOOLS_SUMMARY_H_

#include <optional>
#include <string>
#include <vector>

#include "thdpack/blend.h"
#include "thdpack/cost.h"
#include "thdpack/figures.h"
#include "thdpack/job.h"
#include "thdpack/memory_report.h"

namespace thdpack::tools {

// "6.796e+16", or "-" without FLOPs.
std::string Flops(bool has, double flops);
// The modelled step time in seconds ("76.8"), or "-" without model dimensions.
std::string Seconds(const std::optional<double>& s);

// What the cost is, said once where balance is reported: "cost from FLOPs (llama2-7b), not
// measured", "cost measured: profile:F.json (NVIDIA H200), seconds", "cost tokens, not
// measured", "cost 1,0.02 (given), not measured".
std::string CostNote(const CostModel& cost, const std::string& measured_on_device);

// Prints "\nsummary over N steps (epochs a-b):" and its lines on stdout. memory[k] belongs to
// steps[k] (same length); `cost_note` (CostNote) says what the imbalance is measured in.
// With a blend, a "mixture" block follows: per source its weight's share and what the steps
// took of it (samples, real tokens, loss tokens, and their shares of the totals).
// global_batch_tokens B > 0 (steps counted in tokens): a line with the range of the steps' real
// tokens and the number of steps over B (a sample alone over B, or the samples every
// microbatch needs taken past B: thdpack/step.h's TokenSteps).
void PrintSummaryBlock(const std::vector<StepFigures>& steps,
                       const std::vector<StepMemoryFigures>& memory, const std::string& cost_note,
                       const std::optional<BlendConfig>& blend = std::nullopt,
                       int64_t global_batch_tokens = 0);

// Prints "  defaulted          ..." on stdout: the options the job defaulted (Job::defaulted)
// that shape a step, each with its value (StepJobEntries), then the count of the others. Nothing
// when none was defaulted or not known.
void PrintDefaulted(const Job& job);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_SUMMARY_H_
