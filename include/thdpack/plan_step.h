// thdpack/plan_step.h: planning one step straight from a length histogram, without one object
// per sample - what `thdpack plan --data histogram:FILE --global-batch all` does.
//
// Thread-safety: pure functions.
#ifndef THDPACK_PLAN_STEP_H_
#define THDPACK_PLAN_STEP_H_

#include <cstdint>
#include <optional>
#include <span>

#include "thdpack/data.h"
#include "thdpack/figures.h"
#include "thdpack/memory_report.h"
#include "thdpack/schedule.h"
#include "thdpack/status.h"

namespace thdpack {

// The figures `plan` prints for a step.
struct PlannedStep {
  StepFigures figures;      // plan.replicas and sample_ids empty (no per-sample detail)
  StepMemoryFigures memory;
};

// One whole epoch of a histogram source as one step: the samples ids first_id, first_id + 1,
// ... in row order (an unshuffled HistogramSource, global batch "all": step k has first_id
// k * num_sequences), planned by PlanHistogram. Equal to Schedule + ComputeStepFigures +
// ComputeStepMemory on the expanded samples (integers exactly, doubles up to the order of
// summation), but with no sample ids. nullopt when PlanHistogram does not apply (see
// schedule.h): the caller then reads and schedules the samples one by one.
// Errors: those of PlanHistogram and ComputeHistogramStepMemory.
[[nodiscard]] Result<std::optional<PlannedStep>> PlanHistogramStep(
    std::span<const HistogramRow> histogram, int64_t step, int64_t epoch, int64_t first_id,
    const ScheduleOptions& options, const std::optional<FlopsCoefficients>& flops,
    const MemoryReportOptions& memory);

}  // namespace thdpack

#endif  // THDPACK_PLAN_STEP_H_
