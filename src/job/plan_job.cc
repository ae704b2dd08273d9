// The core of `thdpack plan` (thdpack/job.h): steps read with StepReader, scheduled, and
// turned into figures, one at a time.
#include <algorithm>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "job/job_internal.h"
#include "thdpack/job.h"
#include "thdpack/step.h"

namespace thdpack {
namespace {

// A scheduler error of a step, with the options that would avoid it.
Status ScheduleError(int64_t step, const Status& status) {
  const std::string& m = status.message();
  std::string hint;
  if (m.find("budget") != std::string::npos) {
    hint = " (raise --max-tokens-per-rank or --cp, or pass --oversize skip)";
  } else if (m.find("too few") != std::string::npos) {
    hint = " (raise --global-batch, or lower --dp, --microbatch-multiple or --num-microbatches)";
  }
  return Status::InvalidArgument("step " + std::to_string(step) + ": " + m + hint);
}

// A dynamic step: ScheduleDynamic, its figures (the domain's ranks as replicas), the groups,
// and the memory of each rank's shard: rank r's microbatch holds T/c tokens of its group's
// T, which is what a CP = 1 microbatch of T/c tokens holds.
Result<PlannedStep> PlanDynamicStep(const Job& job, const StepSamples& step, bool sample_ids) {
  Result<DynamicPlan> plan = ScheduleDynamic(step.samples, job.schedule);
  if (!plan.ok()) return ScheduleError(step.step, plan.status());
  THDPACK_ASSIGN_OR_RETURN(PlannedStep out,
                           DynamicStepFigures(job, step.step, step.epoch, step.samples,
                                              std::move(*plan), sample_ids));
  out.figures.n_empty = step.n_empty;  // as for the static schedulers: never silent
  out.figures.split = step.split;
  return out;
}

}  // namespace

Result<PlannedStep> DynamicStepFigures(const Job& job, int64_t step, int64_t epoch,
                                       std::span<const SampleLength> samples,
                                       DynamicPlan plan_value, bool sample_ids) {
  DynamicPlan* plan = &plan_value;
  THDPACK_ASSIGN_OR_RETURN(PlanFigures figures,
                           ComputeDynamicPlanFigures(samples, job.schedule, *plan));
  PlannedStep out;
  StepFigures& f = out.figures;
  if (job.blend) {
    THDPACK_ASSIGN_OR_RETURN(f.sources, CountBySource(samples, plan->skipped, job.num_sources()));
  }
  f.step = step;
  f.epoch = epoch;
  f.plan = std::move(figures);
  if (job.flops.has_value()) {
    f.has_flops = true;
    f.flops = TrainingFlops(*job.flops, f.plan.padded_tokens, static_cast<double>(f.plan.sum_sq));
  }
  f.capacity_tokens = static_cast<int64_t>(plan->num_microbatches) * plan->domain_size *
                      job.schedule.max_tokens_per_rank;
  f.skipped = plan->skipped;
  f.sim_step_time = plan->step_time;
  f.dynamic = true;
  std::vector<int64_t> by_degree(static_cast<size_t>(plan->domain_size) + 1, 0);
  PlanFigures shards = f.plan;  // per-rank shards for the memory figures
  for (size_t m = 0; m < plan->microbatches.size(); ++m) {
    for (const CpGroup& g : plan->microbatches[m]) {
      by_degree[static_cast<size_t>(g.num_ranks)] += static_cast<int64_t>(g.sample_ids.size());
      for (int r = g.first_rank; r < g.first_rank + g.num_ranks; ++r) {
        shards.replicas[static_cast<size_t>(r)].microbatches[m].padded_tokens /= g.num_ranks;
      }
    }
  }
  for (size_t c = 1; c < by_degree.size(); ++c) {
    if (by_degree[c] > 0) f.cp_degrees.emplace_back(static_cast<int>(c), by_degree[c]);
  }
  // A rank holds no buffer in a microbatch where it is in no group.
  for (ReplicaFigures& r : shards.replicas) {
    std::erase_if(r.microbatches, [](const MicrobatchFigures& mb) { return mb.n_samples == 0; });
  }
  if (sample_ids) f.groups = std::move(plan->microbatches);
  ScheduleOptions shard_options = job.schedule;
  THDPACK_ASSIGN_OR_RETURN(shard_options.parallel, GroupLayout(job.schedule, 1));
  THDPACK_ASSIGN_OR_RETURN(out.memory,
                           ComputeStepMemoryFromFigures(shards, shard_options, job.memory));
  return out;
}

namespace {

// One step: read, schedule with figures (the library's own plan is not validated again), and
// memory from the figures. sample_ids false: the figures keep no per-sample ids.
Result<PlannedStep> PlanStep(const Job& job, StepReader& reader, bool sample_ids) {
  Result<StepSamples> step = reader.Next();
  if (!step.ok()) return Status::InvalidArgument("--data: " + step.status().message());
  // --oversize truncate, on lengths (the step cuts the samples themselves on the loaders).
  Truncation cut;
  if (job.schedule.oversize == ScheduleOptions::OversizePolicy::kTruncate) {
    THDPACK_ASSIGN_OR_RETURN(const int64_t longest, LongestKept(job.schedule));
    cut = TruncateLengths(step->samples, longest);
  }
  if (job.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic) {
    THDPACK_ASSIGN_OR_RETURN(PlannedStep dyn, PlanDynamicStep(job, *step, sample_ids));
    dyn.figures.truncated = cut;
    return dyn;
  }
  // A blend's figures count by source: a copy of the samples (32 bytes a sample) outlives the
  // hand-over.
  std::vector<SampleLength> kept;
  if (job.blend) kept = step->samples;
  // The step's samples are handed over: freed once the scheduler has its own arrays.
  Result<ScheduledPlan> scheduled = ScheduleWithFigures(std::move(step->samples), job.schedule);
  if (!scheduled.ok()) return ScheduleError(step->step, scheduled.status());
  PlannedStep out;
  // From the scheduler's arrays (ScheduleWithFigures), not PlanStepTime's validated re-read.
  const std::optional<double> sim_step_time = scheduled->sim_step_time;
  out.figures = MakeStepFigures(step->step, step->epoch, job.schedule, scheduled->plan,
                                std::move(scheduled->figures), job.flops, sample_ids);
  out.figures.sim_step_time = sim_step_time;
  out.figures.n_empty = step->n_empty;
  out.figures.split = step->split;
  out.figures.truncated = cut;
  if (job.blend) {
    THDPACK_ASSIGN_OR_RETURN(out.figures.sources,
                             CountBySource(kept, out.figures.skipped, job.num_sources()));
  }
  THDPACK_ASSIGN_OR_RETURN(out.memory, ComputeStepMemoryFromFigures(out.figures.plan,
                                                                    job.schedule, job.memory));
  return out;
}

// Step k of an unshuffled histogram source read one whole epoch per step, planned in bulk;
// nullopt when the source is not one or PlanHistogramStep does not apply.
Result<std::optional<PlannedStep>> PlanHistogramEpoch(const Job& job, SampleSource& source,
                                                      int64_t k) {
  const auto* hist = dynamic_cast<const HistogramSource*>(&source);
  if (hist == nullptr || job.options.global_batch != 0 || job.options.source.shuffle ||
      job.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic) {
    return std::optional<PlannedStep>();
  }
  const int64_t n = hist->histogram().num_sequences;
  return PlanHistogramStep(hist->histogram().rows, k, k, k * n, job.schedule, job.flops,
                           job.memory);
}

Result<JobPlan> PlanJobUnguarded(const Job& job, const PlanStepCallback& on_step,
                                 bool sample_ids);

}  // namespace

// The checks before each step keep known inputs below the memory limit; an allocation that
// fails anyway (a limit above what the system grants) is an error, never an exception out of
// the library.
Result<JobPlan> PlanJob(const Job& job, const PlanStepCallback& on_step, bool sample_ids) {
  try {
    return PlanJobUnguarded(job, on_step, sample_ids);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted(
        "plan: out of memory (an allocation failed; lower --global-batch or --memory-limit)");
  }
}

namespace {

Result<JobPlan> PlanJobUnguarded(const Job& job, const PlanStepCallback& on_step,
                                 bool sample_ids) {
  Result<std::unique_ptr<SampleSource>> source =
      OpenStepSource(job.options.data, job.options.source, job.schedule);
  if (!source.ok()) return Status::InvalidArgument("--data: " + source.status().message());
  THDPACK_ASSIGN_OR_RETURN(const TokenSteps tokens,
                           TokenStepsFor(job.options.global_batch_tokens, job.schedule));
  THDPACK_ASSIGN_OR_RETURN(
      StepReader reader,
      StepReader::Create(source->get(), job.options.global_batch, job.topology.dp_size(),
                         tokens));
  JobPlan out;
  THDPACK_ASSIGN_OR_RETURN(out.state.data, MakeFingerprint(source->get(), job.options.data,
                                                           job.options.source, job.schedule));
  Status started;
  if (job.resume.has_value()) {
    started = CheckResume(job.resume->data, out.state.data);
    if (started.ok()) {
      started = reader.Start(job.resume->next_step, job.resume->consumed, job.resume->cursor);
    }
  } else {
    started = reader.Start(job.options.start_step, -1, std::nullopt);
  }
  if (!started.ok()) {
    return started.WithContext(job.resume ? "--resume " + job.options.resume : "--start-step");
  }
  // The bulk path plans whole epochs from the step number: only where steps start at epochs.
  const bool epoch_aligned = !job.resume.has_value();
  bool bulk_used = false;
  out.steps.reserve(static_cast<size_t>(std::min<int64_t>(job.steps, 1 << 20)));
  out.memory.reserve(out.steps.capacity());
  const int64_t first = job.first_step();
  for (int64_t k = first; k < first + job.steps; ++k) {
    std::optional<PlannedStep> bulk;
    if (!sample_ids && epoch_aligned) {
      THDPACK_ASSIGN_OR_RETURN(bulk, PlanHistogramEpoch(job, **source, k));
      bulk_used = bulk_used || bulk.has_value();
    }
    PlannedStep step;
    if (bulk.has_value()) {
      step = std::move(*bulk);
    } else {
      if (job.options.global_batch == 0) {  // a numeric one was checked by ResolveJob
        const std::optional<int64_t> size = (*source)->size_hint();
        if (size.has_value()) {
          THDPACK_RETURN_IF_ERROR(CheckStepMemory(
              job, *size, "--global-batch all (" + (*source)->spec() + ")"));
        }
      }
      THDPACK_ASSIGN_OR_RETURN(step, PlanStep(job, reader, sample_ids));
    }
    if (on_step) THDPACK_RETURN_IF_ERROR(on_step(step));
    out.steps.push_back(std::move(step.figures));
    out.memory.push_back(std::move(step.memory));
  }
  out.summary = Summarize(out.steps);
  // Steps planned in bulk left the reader where it was: one epoch a step, it is moved there.
  if (bulk_used) THDPACK_RETURN_IF_ERROR(reader.Start(first + job.steps, -1, std::nullopt));
  out.state.next_step = reader.next_step();
  out.state.consumed = reader.consumed();
  out.state.cursor = (*source)->cursor();
  return out;
}

}  // namespace

std::string PlanJobJson(const JobPlan& plan, bool summary_only) {
  std::vector<JsonFields> step_fields(plan.memory.size());
  for (size_t k = 0; k < plan.memory.size(); ++k) {
    step_fields[k].emplace_back("memory", StepMemoryJson(plan.memory[k]));
  }
  return PlanReportJson(plan.steps, plan.summary, summary_only, step_fields);
}

}  // namespace thdpack
