// Private to the job area: what `plan` and `run` share beyond thdpack/job.h.
#ifndef THDPACK_JOB_JOB_INTERNAL_H_
#define THDPACK_JOB_JOB_INTERNAL_H_

#include <cstdint>
#include <span>

#include "thdpack/job.h"
#include "thdpack/schedule.h"

namespace thdpack {

// The figures and memory of a dynamic step from its plan (the domain's ranks as replicas, the
// CP degrees, the groups when sample_ids), as `plan --scheduler dynamic` prints them; `run`
// reports its steps with the same function, so both print the same bytes.
[[nodiscard]] Result<PlannedStep> DynamicStepFigures(const Job& job, int64_t step, int64_t epoch,
                                                     std::span<const SampleLength> samples,
                                                     DynamicPlan plan, bool sample_ids);

}  // namespace thdpack

#endif  // THDPACK_JOB_JOB_INTERNAL_H_
