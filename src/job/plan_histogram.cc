// Planning a histogram step in bulk (thdpack/job.h).
#include "thdpack/job.h"

#include <utility>

namespace thdpack {

Result<std::optional<PlannedStep>> PlanHistogramStep(
    std::span<const HistogramRow> histogram, int64_t step, int64_t epoch, int64_t first_id,
    const ScheduleOptions& options, const std::optional<FlopsCoefficients>& flops,
    const MemoryReportOptions& memory) {
  THDPACK_ASSIGN_OR_RETURN(std::optional<HistogramPlan> plan,
                           PlanHistogram(histogram, first_id, options));
  if (!plan.has_value()) return std::optional<PlannedStep>();
  PlannedStep out;
  if (options.step_time.has_value()) {
    // PlanHistogram applies on DP = 1 without an SP tail: the step is the sum of its
    // microbatches, each the sum of t(P, CP) over its sequences plus the microbatch constant.
    double seconds = 0;
    const int cp = options.parallel.cp_size();
    for (const MicrobatchClass& c : plan->classes) {
      double one = c.lengths.empty()
                       ? 0.0
                       : options.step_time->coefficients().seconds_per_microbatch;
      for (int64_t l : c.lengths) {
        one += options.step_time->SequenceSeconds(options.parallel.PaddedLength(l), cp);
      }
      seconds += one * static_cast<double>(c.count);
    }
    out.figures.sim_step_time = seconds;
  }
  THDPACK_ASSIGN_OR_RETURN(out.memory, ComputeHistogramStepMemory(*plan, options, memory));
  StepFigures& f = out.figures;
  f.step = step;
  f.epoch = epoch;
  f.plan = std::move(plan->figures);
  if (flops.has_value()) {
    f.has_flops = true;
    f.flops = TrainingFlops(*flops, f.plan.padded_tokens, static_cast<double>(f.plan.sum_sq));
  }
  f.capacity_tokens = static_cast<int64_t>(f.plan.num_microbatches) * options.dp_size *
                      MicrobatchBudget(options);
  f.skipped = std::move(plan->skipped);
  return std::optional<PlannedStep>(std::move(out));
}

}  // namespace thdpack
