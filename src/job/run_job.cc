// The core of `thdpack run` (thdpack/job.h): one rank's step loop, and the JSON of a step.
#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "job/job_internal.h"
#include "thdpack/job.h"

namespace thdpack {
namespace {

// The figures of a step as `plan` computes them, from what the printing rank (a loader) holds.
Result<RunStepReport> ReportStep(const Job& job, const RankStep& step, PhaseTable phases,
                                 std::optional<LossSummary> loss) {
  RunStepReport r;
  if (step.dynamic) {
    THDPACK_ASSIGN_OR_RETURN(PlannedStep planned,
                             DynamicStepFigures(job, step.step, step.epoch, step.samples,
                                                step.dynamic_plan, /*sample_ids=*/true));
    r.figures = std::move(planned.figures);
    r.memory = std::move(planned.memory);
    r.figures.n_empty = step.n_empty;
    r.phases = std::move(phases);
    r.loss = std::move(loss);
    r.dp_size = job.topology.dp_size();
    r.groups = std::array<int64_t, 4>{step.groups_made, step.groups_reused, step.groups_evicted,
                                      step.groups_cached};
    return r;
  }
  THDPACK_ASSIGN_OR_RETURN(r.figures, ComputeStepFigures(step.step, step.epoch, step.samples,
                                                         job.schedule, step.plan, job.flops));
  if (job.schedule.step_time.has_value()) {
    THDPACK_ASSIGN_OR_RETURN(r.figures.sim_step_time,
                             PlanStepTime(step.samples, job.schedule, step.plan));
  }
  r.figures.n_empty = step.n_empty;
  THDPACK_ASSIGN_OR_RETURN(r.memory,
                           ComputeStepMemory(step.samples, job.schedule, step.plan, job.memory));
  r.phases = std::move(phases);
  r.loss = std::move(loss);
  r.dp_size = job.topology.dp_size();
  return r;
}

}  // namespace

static Status RunJobOnRankUnguarded(ProcessGroup& world, const Job& job, const RunSetup& run,
                                    const RunStepCallback& on_step) {
  world.set_timeout(std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(job.options.timeout * 1000))));
  const StepRunnerOptions options = RunnerOptions(job);
  THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, job.topology, options));
  std::unique_ptr<StepVerifier> verifier;
  if (run.probe) {
    THDPACK_ASSIGN_OR_RETURN(
        verifier, StepVerifier::Create(world, job.topology, *run.probe,
                                       job.schedule.parallel.sp(), options.data, options.source,
                                       options.global_batch, run.options.verify_tolerance));
  }
  for (int64_t s = 0; s < job.steps; ++s) {
    THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
    if (std::binary_search(run.profile_steps.begin(), run.profile_steps.end(), step.step)) {
      THDPACK_RETURN_IF_ERROR(ProfileRankMemory(world, step, job.topology, job.memory,
                                                run.options.memory_profile_dir));
    }
    std::optional<LossSummary> loss;
    if (verifier) {
      THDPACK_ASSIGN_OR_RETURN(loss, verifier->Check(step));
    }
    THDPACK_ASSIGN_OR_RETURN(PhaseTable phases, GatherPhases(world, step));
    if (world.rank() != 0) continue;
    THDPACK_ASSIGN_OR_RETURN(RunStepReport report,
                             ReportStep(job, step, std::move(phases), std::move(loss)));
    if (on_step) THDPACK_RETURN_IF_ERROR(on_step(report));
  }
  return Status::Ok();
}

// As PlanJob: a failed allocation is an error on this rank (the others stop at their next
// collective, as for any failed rank), never an exception out of the library.
Status RunJobOnRank(ProcessGroup& world, const Job& job, const RunSetup& run,
                    const RunStepCallback& on_step) {
  try {
    return RunJobOnRankUnguarded(world, job, run, on_step);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("run: rank " + std::to_string(world.rank()) +
                                     " is out of memory (an allocation failed; lower "
                                     "--global-batch or --memory-limit)");
  }
}

std::string RunStepJson(const RunStepReport& step, bool summary_only) {
  const PhaseTable& phases = step.phases;
  nlohmann::ordered_json bytes;
  std::vector<int64_t> total(phases.bytes.empty() ? 0 : phases.bytes[0].size(), 0);
  for (size_t k = 0; k < phases.bytes.size(); ++k) {
    bytes[std::string(PhaseName(static_cast<Phase>(k)))] = phases.bytes[k];
    for (size_t r = 0; r < total.size(); ++r) total[r] += phases.bytes[k][r];
  }
  bytes["total"] = total;
  JsonFields extra;
  // First, so that a step object up to here is plan's.
  extra.emplace_back("memory", StepMemoryJson(step.memory));
  if (step.loss) {
    const LossSummary& loss = *step.loss;
    extra.emplace_back("loss", nlohmann::json(loss.loss).dump());
    extra.emplace_back("ppl", loss.ppl ? nlohmann::json(*loss.ppl).dump() : "null");
    extra.emplace_back("entropy", nlohmann::json(loss.entropy).dump());
    // The probe's real-token count (n_loss_tokens is already a standard key: the probe checks
    // that the tokens it counted equal it).
    extra.emplace_back("n_tokens", nlohmann::json(loss.n_tokens).dump());
  }
  if (step.groups) {
    // The dynamic scheduler's CP process groups: split this step, and taken from the cache.
    extra.emplace_back("groups_made", nlohmann::json((*step.groups)[0]).dump());
    extra.emplace_back("groups_reused", nlohmann::json((*step.groups)[1]).dump());
    extra.emplace_back("groups_evicted", nlohmann::json((*step.groups)[2]).dump());
    extra.emplace_back("groups_cached", nlohmann::json((*step.groups)[3]).dump());
  }
  extra.emplace_back("bytes_sent", bytes.dump());
  for (size_t k = 0; k < phases.seconds.size(); ++k) {
    extra.emplace_back("time_" + std::string(PhaseName(static_cast<Phase>(k))),
                       nlohmann::json(phases.seconds[k]).dump());
  }
  extra.emplace_back("time_step", nlohmann::json(phases.step_seconds).dump());
  return StepFiguresJson(step.figures, summary_only, extra);
}

}  // namespace thdpack
