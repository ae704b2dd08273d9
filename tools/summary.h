// The summary block `thdpack plan` and `thdpack run` both end with: totals over the steps,
// the memory lines and the skipped samples.
#ifndef THDPACK_TOOLS_SUMMARY_H_
#define THDPACK_TOOLS_SUMMARY_H_

#include <optional>
#include <string>
#include <vector>

#include "thdpack/figures.h"
#include "thdpack/memory_report.h"

namespace thdpack::tools {

// "6.796e+16", or "-" without FLOPs.
std::string Flops(bool has, double flops);
// The modelled step time in seconds ("76.8"), or "-" without model dimensions.
std::string Seconds(const std::optional<double>& s);

// Prints "\nsummary over N steps (epochs a-b):" and its lines on stdout. memory[k] belongs to
// steps[k] (same length).
void PrintSummaryBlock(const std::vector<StepFigures>& steps,
                       const std::vector<StepMemoryFigures>& memory);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_SUMMARY_H_
