// The core of `thdpack run` (thdpack/job.h): one rank's step loop, and the JSON of a step.
#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "job/job_internal.h"
#include "thdpack/job.h"

namespace thdpack {
namespace {

// Groups figures of a dynamic step, the same on every rank.
std::array<int64_t, 4> GroupCounts(const RankStep& step) {
  return {step.groups_made, step.groups_reused, step.groups_evicted, step.groups_cached};
}

JsonFields GroupFields(const std::array<int64_t, 4>& g) {
  return {{"groups_made", nlohmann::json(g[0]).dump()},
          {"groups_reused", nlohmann::json(g[1]).dump()},
          {"groups_evicted", nlohmann::json(g[2]).dump()},
          {"groups_cached", nlohmann::json(g[3]).dump()}};
}

}  // namespace

Result<PlannedStep> ReportRankStep(const Job& job, const RankStep& step, bool with_memory) {
  if (!step.is_loader) {
    const Coord& c = step.coord;
    return Status::InvalidArgument(
        "ReportRankStep: the rank at (tp, cp, dp, pp) = (" + std::to_string(c.tp) + ", " +
        std::to_string(c.cp) + ", " + std::to_string(c.dp) + ", " + std::to_string(c.pp) +
        ") did not plan step " + std::to_string(step.step));
  }
  PlannedStep out;
  if (step.dynamic) {
    THDPACK_ASSIGN_OR_RETURN(out, DynamicStepFigures(job, step.step, step.epoch, step.samples,
                                                     step.dynamic_plan, /*sample_ids=*/true));
  } else {
    // The step's own encoder term (media options live outside the job): what it was planned with.
    ScheduleOptions schedule = job.schedule;
    schedule.encoder_cost = step.encoder_cost;
    THDPACK_ASSIGN_OR_RETURN(out.figures,
                             ComputeStepFigures(step.step, step.epoch, step.samples, schedule,
                                                step.plan, job.flops, step.encoder_work));
    if (!step.media_rank_cost.empty()) {
      out.figures.media_replica = step.coord.dp;
      out.figures.media_rank_cost = step.media_rank_cost;
      out.figures.media_rank_bytes = step.media_rank_bytes;
    }
    if (job.schedule.step_time.has_value()) {
      THDPACK_ASSIGN_OR_RETURN(out.figures.sim_step_time,
                               PlanStepTime(step.samples, job.schedule, step.plan));
    }
    if (with_memory) {
      THDPACK_ASSIGN_OR_RETURN(out.memory, ComputeStepMemory(step.samples, job.schedule,
                                                             step.plan, job.memory));
    }
    if (job.blend) {
      THDPACK_ASSIGN_OR_RETURN(out.figures.sources,
                               CountBySource(step.samples, out.figures.skipped,
                                             job.num_sources()));
    }
  }
  out.figures.n_empty = step.n_empty;
  out.figures.split = step.split;
  out.figures.truncated = step.truncated;
  return out;
}

Result<std::string> StepFiguresJsonOnEveryRank(ProcessGroup& world, const Job& job,
                                               const RankStep& step) {
  const JsonFields extra = step.dynamic ? GroupFields(GroupCounts(step)) : JsonFields{};
  std::string mine, summary;
  Status local;
  if (step.is_loader) {
    // The JSON carries no memory report: none is computed for it.
    Result<PlannedStep> planned = ReportRankStep(job, step, /*with_memory=*/false);
    if (planned.ok()) {
      mine = StepFiguresJson(planned->figures, /*summary_only=*/false, extra);
      summary = StepFiguresJson(planned->figures, /*summary_only=*/true, extra);
    } else {
      local = planned.status();
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "step figures"));
  // World rank 0 plans in every mode (a loader, a head).
  int64_t size = static_cast<int64_t>(summary.size());
  THDPACK_RETURN_IF_ERROR(world.BroadcastValues(std::span<int64_t>(&size, 1), 0));
  if (size < 0 || size > (int64_t{1} << 31)) {
    return Status::Corruption("step figures: " + std::to_string(size) + " bytes");
  }
  summary.resize(static_cast<size_t>(size));
  THDPACK_RETURN_IF_ERROR(world.Broadcast(
      std::as_writable_bytes(std::span<char>(summary.data(), summary.size())), 0));
  return step.is_loader ? mine : summary;
}

static Status RunJobOnRankUnguarded(ProcessGroup& world, const Job& job, const RunSetup& run,
                                    const RunStepCallback& on_step) {
  world.set_timeout(std::chrono::milliseconds(
      std::max<int64_t>(1, static_cast<int64_t>(job.options.timeout * 1000))));
  const StepRunnerOptions options = RunnerOptions(job);
  // With --prefetch the data plane runs ahead on a thread with a communicator of its own: the
  // loop's collectives (verify, phases, state) and the thread's never share one.
  StepSourceOptions so;
  so.depth = run.options.prefetch;
  so.steps = job.steps;
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<StepSource> source,
                           StepSource::Create(world, job.topology, options, std::move(so)));
  if (job.resume.has_value()) {
    // Every rank holds the same state and the same fingerprint: the same answer everywhere.
    THDPACK_RETURN_IF_ERROR(source->Restore(*job.resume).WithContext("--resume " +
                                                                     job.options.resume));
  }
  const int64_t consumed = source->state().consumed;
  std::unique_ptr<StepVerifier> verifier;
  if (run.probe) {
    THDPACK_ASSIGN_OR_RETURN(verifier,
                             StepVerifier::Create(world, job.topology, options, *run.probe,
                                                  run.options.verify_tolerance, consumed));
  }
  for (int64_t s = 0; s < job.steps; ++s) {
    // The seconds the loop waited for its step: the whole step without --prefetch.
    double waited = 0;
    Result<RankStep> next = source->Next(&waited);
    THDPACK_ASSIGN_OR_RETURN(RankStep step, std::move(next));
    if (run.options.compute_seconds > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(run.options.compute_seconds));
    }
    if (std::binary_search(run.profile_steps.begin(), run.profile_steps.end(), step.step)) {
      THDPACK_RETURN_IF_ERROR(ProfileRankMemory(world, step, job.topology, job.memory,
                                                run.options.memory_profile_dir));
    }
    std::optional<LossSummary> loss;
    if (verifier) {
      THDPACK_ASSIGN_OR_RETURN(loss, verifier->Check(step));
    }
    THDPACK_ASSIGN_OR_RETURN(PhaseTable phases, GatherPhases(world, step));
    Status reported;
    if (world.rank() == 0) {
      reported = [&]() -> Status {
        THDPACK_ASSIGN_OR_RETURN(PlannedStep planned, ReportRankStep(job, step));
        RunStepReport report;
        report.figures = std::move(planned.figures);
        report.memory = std::move(planned.memory);
        report.phases = std::move(phases);
        report.loss = std::move(loss);
        report.dp_size = job.topology.dp_size();
        report.wait_seconds = waited;
        if (step.dynamic) report.groups = GroupCounts(step);
        return on_step ? on_step(report) : Status::Ok();
      }();
      // As a checkpoint after a trained step: one writer, atomically. A kill before it leaves
      // the previous state, and a resume redoes this step, as a training job redoes the work
      // since its last checkpoint.
      if (reported.ok() && !job.options.save_state.empty()) {
        reported = WriteRunStateFile(job.options.save_state, step.after)
                       .WithContext("--save-state");
      }
    }
    if (!job.options.save_state.empty()) {
      THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, reported, "--save-state"));
    } else {
      THDPACK_RETURN_IF_ERROR(reported);  // the others stop at their next collective
    }
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
    // The dynamic scheduler's CP process groups: split, reused, dropped and held.
    for (auto& field : GroupFields(*step.groups)) extra.push_back(std::move(field));
  }
  extra.emplace_back("bytes_sent", bytes.dump());
  for (size_t k = 0; k < phases.seconds.size(); ++k) {
    extra.emplace_back("time_" + std::string(PhaseName(static_cast<Phase>(k))),
                       nlohmann::json(phases.seconds[k]).dump());
  }
  extra.emplace_back("time_step", nlohmann::json(phases.step_seconds).dump());
  extra.emplace_back("time_wait", nlohmann::json(step.wait_seconds).dump());
  return StepFiguresJson(step.figures, summary_only, extra);
}

}  // namespace thdpack
