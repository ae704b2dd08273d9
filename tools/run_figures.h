// The table line `thdpack run` prints per step (without --json; the JSON line is the library's
// RunStepJson, thdpack/job.h).
#ifndef THDPACK_TOOLS_RUN_FIGURES_H_
#define THDPACK_TOOLS_RUN_FIGURES_H_

#include <string>

#include "thdpack/job.h"

namespace thdpack::tools {

// "step 0 (epoch 0): 32 samples -> 2 microbatches x 2 replicas | tokens ... | sent 5.62 MiB
// max/rank | 215.9 ms" (the step's wall time: its slowest rank, start to end), then
// " | logits/rank ..." when the vocabulary is known and " | probe loss ..." with --verify; a
// line ending in '\n'.
std::string StepLine(const RunStepReport& step);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_RUN_FIGURES_H_
