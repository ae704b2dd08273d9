// The job configuration of thdpack/job.h: ResolveJob, the one validation of what `plan`, `run`
// and the Python module share, and the parsers of the options whose text is theirs.
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "thdpack/job.h"
#include "thdpack/profile.h"

namespace thdpack {
namespace {

Status Fail(const std::string& option, const std::string& message) {
  return Status::InvalidArgument(option + ": " + message);
}

Status AtLeast(const std::string& option, int64_t value, int64_t least) {
  if (value >= least) return Status::Ok();
  return Fail(option, "must be >= " + std::to_string(least) + ", got " + std::to_string(value));
}

// The sizes and numbers, each error naming its option.
Status CheckNumbers(const JobOptions& o) {
  THDPACK_RETURN_IF_ERROR(AtLeast("--dp", o.dp, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--cp", o.cp, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--tp", o.tp, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--pp", o.pp, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--align", o.align, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--rank-multiple", o.rank_multiple, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--max-tokens-per-rank", o.max_tokens_per_rank, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--pad-id", o.pad_id, 0));  // a token id, written as one
  if (static_cast<int64_t>(o.cp) * o.max_tokens_per_rank > kMaxSampleLength) {
    return Fail("--max-tokens-per-rank", "CP * max tokens per rank must fit int32");
  }
  if (o.global_batch < 0) {
    return Fail("--global-batch", "must be >= 1, or 0 for \"all\", got " +
                                      std::to_string(o.global_batch));
  }
  if (o.global_batch_tokens < 0) {
    return Fail("--global-batch-tokens", "must be >= 1 tokens (0: count samples), got " +
                                             std::to_string(o.global_batch_tokens));
  }
  if (o.global_batch_tokens > 0 && o.global_batch == 0) {
    return Fail("--global-batch-tokens", "and --global-batch all both say how large a step is: "
                                         "give one");
  }
  if (o.steps.has_value()) THDPACK_RETURN_IF_ERROR(AtLeast("--steps", *o.steps, 1));
  THDPACK_RETURN_IF_ERROR(AtLeast("--start-step", o.start_step, 0));
  if (o.start_step > 0 && !o.resume.empty()) {
    return Fail("--start-step", "and --resume both say where the run starts: give one (a saved "
                                "state knows its step)");
  }
  if (o.global_batch > 0 && o.start_step > INT64_MAX / o.global_batch) {
    return Fail("--start-step", std::to_string(o.start_step) + " x --global-batch " +
                                    std::to_string(o.global_batch) + " overflows int64");
  }
  if (o.memory_limit < 0) {
    return Fail("--memory-limit", "must be >= 0 bytes (0: the physical memory), got " +
                                      std::to_string(o.memory_limit));
  }
  THDPACK_RETURN_IF_ERROR(AtLeast("--microbatch-multiple", o.microbatch_multiple, 1));
  if (o.sp && o.tp == 1) {
    return Fail("--sp", "sequence parallelism splits each CP shard over the TP ranks, so it needs "
                        "--tp > 1, got --tp 1");
  }
  // Written so that NaN fails too; at most a year.
  if (!(o.timeout > 0 && o.timeout <= 365.0 * 24 * 3600)) {
    return Fail("--timeout", "must be > 0 seconds (and at most a year), got " +
                                 std::to_string(o.timeout));
  }
  if (o.num_microbatches < 0 || o.num_microbatches % o.microbatch_multiple != 0) {
    return Fail("--num-microbatches",
                "must be 0 (scheduler chooses) or a positive multiple of --microbatch-multiple (" +
                    std::to_string(o.microbatch_multiple) + "), got " +
                    std::to_string(o.num_microbatches));
  }
  return Status::Ok();
}

// The cost spec and --hw, resolved once by the cost area's ResolveCost (profile.h): the cost
// model, and for presets, dimensions and profiles naming a model the model's dimensions and
// FLOPs coefficients, and the step-time model.
Status ResolveJobCost(const JobOptions& o, Job& job) {
  Result<ResolvedCost> r = ResolveCost(o.cost, o.hw, CostSpecNames{"--cost", "--hw"});
  if (!r.ok()) return r.status();
  job.schedule.cost = std::move(r->cost);
  job.schedule.step_time = std::move(r->step_time);
  job.model = r->dims;
  job.flops = r->flops;
  job.profile = std::move(r->profile);
  return Status::Ok();
}

// The one place where the schedule's parallel layout (sizes, SP, alignment, rank multiple)
// comes from the job.
Status FillSchedule(const JobOptions& o, Job& job) {
  ScheduleOptions& s = job.schedule;
  s.dp_size = job.topology.dp_size();
  Result<ParallelLayout> parallel = ParallelLayout::Create(
      job.topology.cp_size(), job.topology.tp_size(), o.sp, o.align, o.rank_multiple);
  if (!parallel.ok()) {
    return Fail("--cp/--tp/--sp/--align/--rank-multiple", parallel.status().message());
  }
  s.parallel = *parallel;
  s.max_tokens_per_rank = o.max_tokens_per_rank;
  s.microbatch_multiple = o.microbatch_multiple;
  s.num_microbatches = o.num_microbatches;
  Result<ScheduleOptions::Scheduler> scheduler = ParseSchedulerName(o.scheduler);
  if (!scheduler.ok()) return Fail("--scheduler", scheduler.status().message());
  s.scheduler = *scheduler;
  Result<ScheduleOptions::OversizePolicy> oversize = ParseOversizePolicy(o.oversize);
  if (!oversize.ok()) return Fail("--oversize", oversize.status().message());
  s.oversize = *oversize;
  // The static schedulers put every microbatch on all CP ranks: a budget below the token
  // quantum would leave every sample out (the dynamic scheduler's groups have their own).
  if (s.scheduler != ScheduleOptions::Scheduler::kDynamic &&
      MicrobatchBudget(s) < s.parallel.token_quantum()) {
    return Fail("--max-tokens-per-rank",
                "CP * max tokens per rank = " + std::to_string(MicrobatchBudget(s)) +
                    " is below the token quantum " + std::to_string(s.parallel.token_quantum()) +
                    " of the layout (" + s.parallel.ToString() +
                    "): no microbatch fits; raise it, or lower --rank-multiple or --align");
  }
  Result<ScheduleOptions::CpSizes> cp_sizes = ParseCpSizes(o.cp_sizes);
  if (!cp_sizes.ok()) return Fail("--cp-sizes", cp_sizes.status().message());
  s.cp_sizes = *cp_sizes;
  Result<ScheduleOptions::KeepGroups> keep = ParseKeepGroups(o.keep_groups);
  if (!keep.ok()) return Fail("keep_groups", keep.status().message());
  s.keep_groups = *keep;
  s.pad_to_max_tokens = o.pad_to_max_tokens;
  s.max_seqs_per_microbatch = o.max_seqs;
  if (o.max_seqs < 0) {
    return Fail("--max-seqs-per-microbatch", "must be >= 1, or 0 for no cap; got " +
                                                 std::to_string(o.max_seqs));
  }
  if (o.max_cp_groups < 1) {
    return Fail("--max-cp-groups", "must be >= 1, got " + std::to_string(o.max_cp_groups));
  }
  // --hw is checked even without a model, so that a typo is not silent (ResolveCost).
  THDPACK_RETURN_IF_ERROR(ResolveJobCost(o, job));
  if (s.scheduler == ScheduleOptions::Scheduler::kDynamic && !s.step_time.has_value()) {
    return Fail("--scheduler", "dynamic minimises the modelled step time, which needs model "
                               "dimensions or a measured profile: pass a model --cost "
                               "(llama2-7b, llama3-8b or l=..,h=..,nh=..,nkv=..,f=..,v=..) or "
                               "profile:FILE, not \"" + o.cost + "\"");
  }
  if (s.scheduler == ScheduleOptions::Scheduler::kDynamic && job.profile.has_value() &&
      !job.model.has_value() && job.topology.dp_size() * job.topology.cp_size() > 1) {
    return Fail("--scheduler",
                "dynamic weighs each CP degree's K/V exchange, which needs the model's "
                "dimensions: the profile " + o.cost + " names no model with dimensions "
                "(measured_on.model: a preset such as llama2-7b or l=..,h=..,nh=..,nkv=..,f=..,"
                "v=..); calibrate with one");
  }
  return Status::Ok();
}

Status ResolveMemory(const JobOptions& o, Job& job) {
  if (o.vocab_size < 0) {
    return Status::InvalidArgument("--vocab-size: " + std::to_string(o.vocab_size) +
                                   " must be >= 1, or 0 for the --cost model's vocabulary");
  }
  job.memory.vocab_size = o.vocab_size > 0 ? o.vocab_size : job.model ? job.model->vocab : 0;
  Result<LogitsDtype> dtype = ParseLogitsDtype(o.logits_dtype);
  if (!dtype.ok()) return dtype.status().WithContext("--logits-dtype");
  job.memory.logits_dtype = *dtype;
  job.memory.with_grad = o.fused_grad;
  return Status::Ok();
}

Result<Job> ResolveGiven(const JobOptions& options) {
  THDPACK_RETURN_IF_ERROR(CheckNumbers(options));
  // The order alone first, so that its error names --rank-order.
  if (Result<Topology> order = Topology::Create(1, 1, 1, 1, options.rank_order); !order.ok()) {
    return Fail("--rank-order", order.status().message());
  }
  Result<Topology> topology = Topology::Create(options.tp, options.cp, options.dp, options.pp,
                                               options.rank_order);
  if (!topology.ok()) return Fail("--dp/--cp/--tp/--pp", topology.status().message());
  Job job(std::move(*topology));
  job.options = options;
  job.steps = options.steps.value_or(options.global_batch == 0 ? 1 : 3);
  THDPACK_RETURN_IF_ERROR(FillSchedule(options, job));
  THDPACK_RETURN_IF_ERROR(ResolveMemory(options, job));
  THDPACK_ASSIGN_OR_RETURN(job.data_on, ParseDataOn(options.data_on));
  job.memory_limit = options.memory_limit > 0 ? options.memory_limit : PhysicalMemoryBytes();
  if (const Result<SourceKind> kind = SourceKindOf(options.data);
      kind.ok() && *kind == SourceKind::kBlend) {
    Result<BlendConfig> blend = ReadBlendSpec(SourcePathOf(options.data));
    if (!blend.ok()) return blend.status().WithContext("--data");
    if (options.global_batch == 0) {
      return Fail("--global-batch", "\"all\" reads one epoch a step, and a blend has no end "
                                    "(its sources start their next epochs): give a number");
    }
    job.blend = std::move(*blend);
  }
  if (!options.resume.empty()) {
    Result<RunState> state = ReadRunStateFile(options.resume);
    if (!state.ok()) return state.status().WithContext("--resume");
    job.resume = std::move(*state);
  }
  if (options.global_batch > 0 && options.global_batch_tokens == 0) {
    THDPACK_RETURN_IF_ERROR(CheckStepMemory(
        job, options.global_batch, "--global-batch " + std::to_string(options.global_batch)));
  }
  return job;
}

}  // namespace

std::vector<std::string> DefaultedOptions(const JobOptions& options) {
  std::vector<std::string> out;
  if (!options.given) return out;
  for (std::string_view name : kJobOptionNames) {
    if (std::find(options.given->begin(), options.given->end(), name) == options.given->end()) {
      out.emplace_back(name);
    }
  }
  return out;
}

Result<Job> ResolveJob(const JobOptions& options) {
  const std::vector<std::string> defaulted = DefaultedOptions(options);
  Result<Job> job = ResolveGiven(options);
  if (!job.ok()) return SayDefaulted(job.status(), defaulted);
  job->defaulted = defaulted;
  return job;
}

int64_t StepMemoryNeed(int64_t samples) {
  int64_t bytes = 0;
  if (samples < 0 || __builtin_mul_overflow(samples, kStepBytesPerSample, &bytes)) {
    return std::numeric_limits<int64_t>::max();
  }
  return bytes;
}

Status CheckStepMemory(const Job& job, int64_t samples, std::string_view what) {
  const int64_t need = StepMemoryNeed(samples);
  if (need <= job.memory_limit) return Status::Ok();
  const auto mib = [](int64_t bytes) { return std::to_string(bytes >> 20) + " MiB"; };
  return Status::ResourceExhausted(
      std::string(what) + ": a step of " + std::to_string(samples) + " samples needs at least " +
      mib(need) + " (" + std::to_string(kStepBytesPerSample) + " bytes a sample), more than the " +
      "memory limit of " + mib(job.memory_limit) +
      (job.options.memory_limit > 0 ? " (--memory-limit)"
                                    : " (the physical memory; set --memory-limit)") +
      " (lower --global-batch, or plan a histogram with --global-batch all and no per-sample "
      "output)");
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  int64_t bytes = 0;
  if (pages <= 0 || page_size <= 0 ||
      __builtin_mul_overflow(static_cast<int64_t>(pages), static_cast<int64_t>(page_size),
                             &bytes)) {
    return std::numeric_limits<int64_t>::max();
  }
  return bytes;
}

Result<int64_t> ParseMemoryLimit(std::string_view text) {
  const std::string bad = "\"" + std::string(text) +
                          "\" is not a number of bytes (e.g. 68719476736, 64G, 512M; 0: the "
                          "physical memory)";
  std::string_view digits = text;
  int shift = 0;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K': shift = 10; break;
      case 'M': shift = 20; break;
      case 'G': shift = 30; break;
      case 'T': shift = 40; break;
      default: break;
    }
    if (shift != 0) digits.remove_suffix(1);
  }
  if (digits.empty() || digits.size() > 18 ||
      digits.find_first_not_of("0123456789") != std::string_view::npos) {
    return Fail("--memory-limit", bad);
  }
  const int64_t v = std::stoll(std::string(digits));
  if (v > (std::numeric_limits<int64_t>::max() >> shift)) {
    return Fail("--memory-limit", bad + ": more than 2^63 - 1 bytes");
  }
  return v << shift;
}

StepRunnerOptions RunnerOptions(const Job& job) {
  StepRunnerOptions o;
  o.data = job.options.data;
  o.source = job.options.source;
  o.global_batch = job.options.global_batch;
  o.global_batch_tokens = job.options.global_batch_tokens;
  o.schedule = job.schedule;
  o.pad_id = job.options.pad_id;
  o.data_on = job.data_on;
  o.check_plan_hash = job.options.check_plan_hash;
  o.max_cp_groups = job.options.max_cp_groups;
  o.start_step = job.options.start_step;
  o.group_field = job.options.group_field;
  o.defaulted = job.defaulted;
  return o;
}

Result<int64_t> ParseGlobalBatch(std::string_view text) {
  if (text == "all") return int64_t{0};
  if (!text.empty() && text.size() <= 18 &&
      text.find_first_not_of("0123456789") == std::string_view::npos) {
    const int64_t v = std::stoll(std::string(text));
    if (v >= 1) return v;
  }
  return Fail("--global-batch",
              "\"" + std::string(text) + "\" is not a positive integer or \"all\"");
}

Result<std::vector<int64_t>> ParseProfileSteps(std::string_view text) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  const std::string bad = "\"" + std::string(text) +
                          "\" is not a comma-separated list of step numbers (e.g. 0,1)";
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string_view item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (item.empty() || item.size() > 18 ||
        item.find_first_not_of("0123456789") != std::string_view::npos) {
      return Fail("--memory-profile-steps", bad);
    }
    out.push_back(std::stoll(std::string(item)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

Result<RunSetup> ResolveRun(const Job& job, const RunOptions& options) {
  RunSetup run;
  run.options = options;
  if (options.prefetch < 0 || options.prefetch > StepSourceOptions::kMaxDepth) {
    return Fail("--prefetch", "must be in [0, " + std::to_string(StepSourceOptions::kMaxDepth) +
                                  "] steps, got " + std::to_string(options.prefetch));
  }
  if (!(options.compute_seconds >= 0 && options.compute_seconds <= 3600)) {
    return Fail("--compute-seconds", "must be in [0, 3600], got " +
                                         std::to_string(options.compute_seconds));
  }
  if (options.verify) {
    Result<ProbeModel> model = ProbeModel::Create(options.probe);
    if (!model.ok()) return model.status().WithContext("--probe-*");
    run.probe.emplace(std::move(*model));
    if (!(options.verify_tolerance >= 0)) {
      return Fail("--verify-tolerance",
                  std::to_string(options.verify_tolerance) + " must be >= 0");
    }
  }
  run.profile_steps = options.memory_profile_steps;
  std::sort(run.profile_steps.begin(), run.profile_steps.end());
  run.profile_steps.erase(std::unique(run.profile_steps.begin(), run.profile_steps.end()),
                          run.profile_steps.end());
  const int64_t first = job.first_step();
  for (int64_t step : run.profile_steps) {
    if (step >= first && step < first + job.steps) continue;
    return Fail("--memory-profile-steps",
                "step " + std::to_string(step) + " is not run (--steps " +
                    std::to_string(job.steps) + " runs steps " + std::to_string(first) + " to " +
                    std::to_string(first + job.steps - 1) + ")");
  }
  return run;
}

}  // namespace thdpack
