// Per-step output of `thdpack run`: the step figures of DESIGN.md section 10 with the bytes each
// rank sent and the time of each phase, as a table line or one JSON object.
#ifndef THDPACK_TOOLS_RUN_FIGURES_H_
#define THDPACK_TOOLS_RUN_FIGURES_H_

#include <optional>
#include <string>
#include <vector>

#include "thdpack/cost.h"
#include "thdpack/loss.h"
#include "thdpack/memory_report.h"
#include "thdpack/schedule.h"
#include "thdpack/step_runner.h"
#include "thdpack/topology.h"

namespace thdpack::tools {

// Per phase (names[k]): bytes sent by each rank (world order) and the slowest rank's seconds.
struct PhaseTable {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> bytes;  // [phase][rank]
  std::vector<double> seconds;              // [phase]
};

// REQUIRES: step.is_loader (its samples and plan are filled). A line ending in '\n'. loss, with
// --verify: the probe's figures, added as loss, ppl (null when undefined), entropy, n_tokens,
// n_loss_tokens. memory: the step's memory figures (thdpack/memory_report.h), added first
// as `memory` (the object `thdpack plan --json` prints) and, when the vocabulary is known, as
// the logits bytes at the end of the table line.
[[nodiscard]] Result<std::string> FormatStep(const RankStep& step, ScheduleOptions schedule,
                                             const Topology& topo,
                                             const std::optional<FlopsCoefficients>& flops,
                                             const PhaseTable& phases, bool json,
                                             bool summary_only,
                                             const std::optional<LossSummary>& loss = {},
                                             const std::optional<MemoryReportOptions>& memory =
                                                 std::nullopt);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_RUN_FIGURES_H_
