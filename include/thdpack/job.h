// thdpack/job.h: one job configuration for `thdpack plan`, `thdpack run` and the Python module
// (thdpack.plan_job, thdpack.run_job), its one validation, and the cores of both commands.
//
// A job is a data source read in steps (thdpack/step.h), a topology, the scheduling options
// and the cost model. JobOptions holds what a user gives, with documented defaults; ResolveJob
// checks it once and turns it into a Job: the Topology, complete ScheduleOptions, the cost
// model parsed once (cost, model dimensions, FLOPs coefficients) and the memory report's
// options. Errors name the command-line option and the rule broken, e.g.
// "--dp: must be >= 1, got 0", so that the command line prints them as they are.
//
// PlanJob plans every step of a job on one thread (no ranks: read, schedule, figures, memory
// figures); RunJobOnRank is one rank's step loop on a ProcessGroup (StepRunner, the optional
// verifier of thdpack/probe.h, memory profiles, phase timing). Both hand each step to a
// callback as it is done, so a caller prints as it goes.
//
// Thread-safety: JobOptions and Job are plain values; PlanJob and the parsers are pure
// functions (apart from reading the source); RunJobOnRank is collective over its world.
#ifndef THDPACK_JOB_H_
#define THDPACK_JOB_H_

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/blend.h"
#include "thdpack/comm.h"
#include "thdpack/cost.h"
#include "thdpack/data.h"
#include "thdpack/figures.h"
#include "thdpack/loss.h"
#include "thdpack/memory_report.h"
#include "thdpack/probe.h"
#include "thdpack/profile.h"
#include "thdpack/run_state.h"
#include "thdpack/schedule.h"
#include "thdpack/status.h"
#include "thdpack/step_runner.h"
#include "thdpack/topology.h"

namespace thdpack {

// What a user gives. Each field is named after its command-line option.
struct JobOptions {
  std::string data = "mock";  // --data: a source spec (thdpack/data.h)
  // --seed (default 1234), --shuffle (off), --vocab (0: unknown), --mock-samples (0: default).
  SourceOptions source;
  int tp = 1;  // --tp, >= 1
  int cp = 1;  // --cp, >= 1
  int dp = 1;  // --dp, >= 1
  int pp = 1;  // --pp, >= 1
  // --rank-order: how world ranks map to (tp, cp, dp, pp), a '-'-separated permutation of the
  // four, fastest first (thdpack/topology.h); Megatron's "tp-cp-dp-pp" by default. It decides
  // which world rank holds which coordinate - the step, the dynamic CP groups, the loaders and
  // the reader roles all take it from the Topology - never which samples a step trains on.
  std::string rank_order = std::string(kDefaultRankOrder);
  bool sp = false;                      // --sp: sequence parallelism
  int64_t align = 1;                    // --align: extra per-sequence alignment, >= 1
  // --rank-multiple: every rank's tokens of a microbatch (T/CP, T/(CP*TP) with SP) a multiple
  // of it, the tail on the last sequence (ParallelLayout); >= 1. The command line and Python
  // also take the presets of ParseRankMultiple (fp8 16, mxfp8 32, blockwise 128).
  int64_t rank_multiple = 1;
  int64_t max_tokens_per_rank = 16384;  // --max-tokens-per-rank, >= 1; CP times it fits int32
  // --global-batch: samples per step over all replicas, >= 1, or 0 for "all" (one whole epoch
  // per step). ParseGlobalBatch reads the option's text.
  int64_t global_batch = 256;
  // --global-batch-tokens B (> 0; 0 = off): each step takes samples in stream order while their
  // real tokens stay within B (thdpack/step.h), replacing --global-batch's sample count. Not
  // with "all", nor (Python) with a caller-fed source, whose loaders see only their own share.
  int64_t global_batch_tokens = 0;
  // --steps, >= 1; nullopt (the default): 1 with global_batch 0 ("all"), else 3.
  std::optional<int64_t> steps;
  std::string scheduler = "balanced";  // --scheduler: balanced | sequential | dynamic
  std::string cp_sizes = "any";        // --cp-sizes: any | pow2 (group sizes of dynamic)
  // --max-cp-groups (run and the torch iterator): the CP process groups a dynamic run keeps
  // across steps, >= 1 (StepRunnerOptions::max_cp_groups).
  int max_cp_groups = kDefaultMaxCpGroups;
  // --hw: h100-ib | h100-nvlink | R,B: the hardware of the step-time model (cost.h), used with
  // a model --cost (sim_step_time; the dynamic scheduler needs it).
  std::string hw = "h100-ib";
  // --cost: tokens | llama2-7b | llama3-8b | A,B | l=..,h=..,nh=..,nkv=..,f=..,v=.. (cost.h)
  std::string cost = "llama2-7b";
  int microbatch_multiple = 1;  // --microbatch-multiple, >= 1
  int num_microbatches = 0;     // --num-microbatches: 0 (the scheduler chooses) or a multiple
  std::string oversize = "error";  // --oversize: error | skip | truncate | split
  // Static shapes (ScheduleOptions::pad_to_max_tokens, max_seqs_per_microbatch):
  // --pad-to-max-tokens / pad_to_max_tokens, --max-seqs-per-microbatch S / max_seqs (0: none).
  bool pad_to_max_tokens = false;
  int max_seqs = 0;
  // Python only (the file sources carry no fields): keep_groups none | microbatch | replica
  // (ScheduleOptions::keep_groups) and group_field, the sample field holding each sample's
  // group id (StepRunnerOptions::group_field).
  std::string keep_groups = "none";
  std::string group_field;
  TokenId pad_id = 0;              // the token id of padding
  std::string data_on = "tp0";     // --data-on: tp0 | all (run only)
  // --timeout (run only): seconds one collective may wait for its peers before the step fails
  // naming those that did not arrive (ProcessGroup::timeout, thdpack/comm.h); > 0. RunJobOnRank
  // sets it on its world (and so on every group split from it). Default 300.
  double timeout = 300;
  // The memory report (thdpack/memory_report.h): --vocab-size (0: the --cost model's V, none
  // for tokens and A,B), --logits-dtype (bf16 | fp32 | fp64), --fused-grad.
  int64_t vocab_size = 0;
  std::string logits_dtype = "bf16";
  bool fused_grad = false;
  // --memory-limit: the bytes one step may need (ParseMemoryLimit reads the option's text).
  // 0 (default): the machine's physical memory. A step whose samples alone need more
  // (StepMemoryNeed) is a ResourceExhausted error before anything is allocated for it.
  int64_t memory_limit = 0;
  // Compare a hash of the plan across loaders (StepRunnerOptions). Default: on in debug builds.
  bool check_plan_hash = kCheckPlanHashByDefault;
  // --start-step (plan, run): the first step, >= 0, of a run that read --global-batch samples a
  // step from step 0 (StepRunnerOptions::start_step); its steps are those steps of a run from
  // 0, field for field. Default 0.
  int64_t start_step = 0;
  // --resume FILE (plan, run): continue from a saved run state (thdpack/run_state.h), read by
  // ResolveJob; its fingerprint must fit this job (CheckResume). Not with --start-step.
  std::string resume;
  // --save-state FILE (run: after every step, written by world rank 0; plan: after its last
  // step): the run state, written atomically (WriteRunStateFile). Empty: none.
  std::string save_state;
  // The options the user gave, by name (kJobOptionNames): the command line's flags given, the
  // keyword arguments passed. Every other option is defaulted, which Job::defaulted lists and
  // errors naming one say (SayDefaulted, thdpack/step_runner.h). nullopt: not known (a caller
  // that fills JobOptions itself), nothing is said to be defaulted.
  std::optional<std::vector<std::string>> given;
};

// Every option of JobOptions by name: the command line's flag without "--" and with '_' for
// '-', which is also the keyword argument of thdpack's Python functions.
inline constexpr std::string_view kJobOptionNames[] = {
    "data", "seed", "shuffle", "vocab", "mock_samples", "tp", "cp", "dp", "pp", "rank_order",
    "sp", "align", "rank_multiple", "max_tokens_per_rank", "global_batch",
    "global_batch_tokens", "steps", "scheduler", "cp_sizes", "max_cp_groups", "hw", "cost",
    "microbatch_multiple", "num_microbatches", "oversize", "pad_to_max_tokens", "max_seqs",
    "keep_groups", "group_field", "pad_id", "data_on", "timeout", "vocab_size", "logits_dtype",
    "fused_grad", "memory_limit", "check_plan_hash", "start_step", "resume", "save_state"};

// The options of kJobOptionNames not in options.given (empty when given is nullopt).
std::vector<std::string> DefaultedOptions(const JobOptions& options);

// A checked job: everything `plan` and `run` need, derived once from JobOptions.
struct Job {
  explicit Job(Topology t) : topology(std::move(t)) {}

  JobOptions options;  // as given
  Topology topology;
  std::vector<std::string> defaulted;  // DefaultedOptions(options)
  int64_t steps = 1;        // options.steps, or its default
  ScheduleOptions schedule;  // complete: the topology's sizes, the cost model, the policies
  // The cost spec, parsed once: the cost model is schedule.cost; the model's dimensions and
  // FLOPs coefficients for presets and dimensions, nullopt for tokens and A,B.
  std::optional<ModelDims> model;
  std::optional<FlopsCoefficients> flops;
  // With --cost profile:FILE: the measured profile (its form in use is schedule.cost, in
  // seconds; model and flops are its model's when measured_on.model names dimensions).
  std::optional<CostProfile> profile;
  // The step-time model (model dimensions and --hw) is schedule.step_time: set with a model.
  MemoryReportOptions memory;  // vocab_size from the model when not given
  DataOn data_on = DataOn::kTp0;
  int64_t memory_limit = 0;  // options.memory_limit, or the physical memory for 0
  // --resume: the state read from its file.
  std::optional<RunState> resume;
  // --data blend:...: its config (thdpack/blend.h), read by ResolveJob; step figures then
  // count what each source gave (StepFigures::sources).
  std::optional<BlendConfig> blend;
  int num_sources() const { return blend ? static_cast<int>(blend->sources.size()) : 0; }
  // The first step the job plans or runs: the state's next step, else --start-step. Its steps
  // are first_step .. first_step + steps - 1.
  int64_t first_step() const { return resume ? resume->next_step : options.start_step; }
};

// The one validation. Errors (InvalidArgument) name the option, e.g. "--dp: must be >= 1, got 0",
// "--cost: ...", "--dp/--cp/--tp/--pp: ..." for a topology too large, "--sp: ..." for SP with
// TP = 1 (nothing to split); ResourceExhausted when a numeric --global-batch needs more memory
// than the limit (CheckStepMemory). Opens no source. An error naming a defaulted option says so
// (SayDefaulted).
[[nodiscard]] Result<Job> ResolveJob(const JobOptions& options);

// The options of a StepRunner for this job (thdpack/step_runner.h).
StepRunnerOptions RunnerOptions(const Job& job);

// The least memory a step of `samples` samples needs in `plan` or `run`: what the step's reader,
// scheduler and figures hold per sample (kStepBytesPerSample, measured with --global-batch
// 10^7: docs/data_sources.md, "Limits") times the samples. Saturates at INT64_MAX.
inline constexpr int64_t kStepBytesPerSample = 64;
int64_t StepMemoryNeed(int64_t samples);

// ResourceExhausted unless a step of `samples` samples fits job.memory_limit; the message names
// `what` (e.g. "--global-batch 4000000000"), the bytes needed and the limit, and the options
// that change them.
[[nodiscard]] Status CheckStepMemory(const Job& job, int64_t samples, std::string_view what);

// The physical memory of this machine in bytes (sysconf), or INT64_MAX when unknown.
int64_t PhysicalMemoryBytes();

// --memory-limit: bytes as a decimal integer with an optional binary suffix K, M, G, T
// (KiB ... TiB; "64G" = 64 * 2^30), or 0 for the physical memory. Anything else, or a value
// over 2^63 - 1: InvalidArgument naming the option.
[[nodiscard]] Result<int64_t> ParseMemoryLimit(std::string_view text);

// --global-batch: "all" -> 0, a positive decimal integer (at most 18 digits) -> itself.
// Anything else: InvalidArgument `--global-batch: "<text>" is not a positive integer or "all"`.
[[nodiscard]] Result<int64_t> ParseGlobalBatch(std::string_view text);

// ---- plan ----

// One planned step: its figures (figures.h) and memory figures (memory_report.h).
struct PlannedStep {
  StepFigures figures;
  StepMemoryFigures memory;
};

// Called after each step is planned, before it is kept: it may print, or drop the step's
// per-sample detail (figures.sample_ids, figures.plan.replicas) to keep long plans small; an
// error stops the plan and is returned.
using PlanStepCallback = std::function<Status(PlannedStep& step)>;

struct JobPlan {
  std::vector<StepFigures> steps;        // [job.steps]
  std::vector<StepMemoryFigures> memory;  // [job.steps]
  SummaryFigures summary;                 // Summarize(steps)
  RunState state;                         // after the last step (thdpack/run_state.h)
};

// Plans job.steps steps from job.first_step() (a saved state's position, checked against the
// job's fingerprint, or --start-step's): StepReader over job.options.data, ScheduleWithFigures (Schedule with
// the figures of ComputePlanFigures, the plan not validated again), MakeStepFigures and
// ComputeStepMemoryFromFigures (equal to ComputeStepFigures and ComputeStepMemory, tested).
// With sample_ids false (the caller prints no per-sample detail), figures.sample_ids stays
// empty, and a step that is one whole epoch of an unshuffled `histogram:` source is planned in bulk by
// PlanHistogramStep wherever that is proven equal (no sample objects, no ids); else sample by
// sample. Errors: the source's ("--data: ..."), the scheduler's naming the step and the options
// to change ("step 0: ... (raise --max-tokens-per-rank or --cp, or pass --oversize skip)").
[[nodiscard]] Result<JobPlan> PlanJob(const Job& job, const PlanStepCallback& on_step = {},
                                      bool sample_ids = true);

// One whole epoch of a histogram as one step: sample ids first_id, first_id + 1, ... in row
// order (an unshuffled histogram source with global batch "all": step k has first_id
// k * number of sequences), planned by PlanHistogram (schedule.h). Equal to Schedule +
// ComputeStepFigures + ComputeStepMemory on the expanded samples (integers exactly, doubles up
// to the order of summation), but with no sample ids (figures.sample_ids and plan.replicas
// empty). nullopt when PlanHistogram does not apply: the caller then schedules sample by
// sample. Errors: those of PlanHistogram and ComputeHistogramStepMemory.
[[nodiscard]] Result<std::optional<PlannedStep>> PlanHistogramStep(
    std::span<const HistogramRow> histogram, int64_t step, int64_t epoch, int64_t first_id,
    const ScheduleOptions& options, const std::optional<FlopsCoefficients>& flops,
    const MemoryReportOptions& memory);

// `thdpack plan --json`: PlanReportJson (figures.h) with each step's `memory` field.
std::string PlanJobJson(const JobPlan& plan, bool summary_only);

// ---- run ----

// What `run` adds to a job.
struct RunOptions {
  // --verify: the probe model over every microbatch, checked against one rank (probe.h).
  bool verify = false;
  ProbeConfig probe;              // --probe-layers, --probe-hidden, --probe-heads, --probe-vocab
  double verify_tolerance = 1e-9;  // --verify-tolerance, >= 0
  // --memory-profile-steps: at these steps every rank writes its memory profile under
  // memory_profile_dir (memory_report.h); each in [0, job.steps).
  std::vector<int64_t> memory_profile_steps;
  std::string memory_profile_dir = "memory_profile";  // --memory-profile-dir
  // --prefetch K in [0, 64]: the loop takes its steps from a StepSource of depth K
  // (thdpack/step_runner.h: the data plane up to K steps ahead, in a thread of each rank with a
  // communicator of its own; under MPI that needs MPI_THREAD_MULTIPLE). The steps, figures and
  // errors are those of K = 0, each error at its step. Default 0: the loop runs each step.
  int prefetch = 0;
  // --compute-seconds S (>= 0): the loop sleeps S after taking each step, a stand-in for the
  // training step, so that the overlap shows (time_wait). Default 0.
  double compute_seconds = 0;
};

// Checked RunOptions.
struct RunSetup {
  RunOptions options;
  std::optional<ProbeModel> probe;      // with verify
  std::vector<int64_t> profile_steps;  // sorted, without repeats
};

// Errors name the option: "--probe-*: ...", "--verify-tolerance: ...", "--memory-profile-steps:
// step 3 is not run (--steps 3 runs steps 0 to 2)".
[[nodiscard]] Result<RunSetup> ResolveRun(const Job& job, const RunOptions& options);

// --memory-profile-steps: comma-separated step numbers (e.g. "0,1"); empty text: none. Errors:
// InvalidArgument `--memory-profile-steps: "<text>" is not a comma-separated list ...`.
[[nodiscard]] Result<std::vector<int64_t>> ParseProfileSteps(std::string_view text);

// One step of `run` as the printing rank (world rank 0) reports it.
struct RunStepReport {
  StepFigures figures;       // the figures `plan` prints for the same step
  StepMemoryFigures memory;  // as in `plan`
  PhaseTable phases;         // every rank's bytes and the slowest rank's seconds per phase
  std::optional<LossSummary> loss;  // with verify: the probe's figures, checked
  int dp_size = 1;
  // The seconds the printing rank's loop waited for this step (all of it without --prefetch;
  // with it, what the data plane's thread had not prepared in time).
  double wait_seconds = 0;
  // --scheduler dynamic: the CP process groups split this step, reused from earlier steps,
  // dropped from the cache after it, and held in it (RankStep::groups_made, groups_reused,
  // groups_evicted, groups_cached); unset for static schedulers.
  std::optional<std::array<int64_t, 4>> groups;
};

// Called on world rank 0 after each step (the other ranks go on to the next step's
// collectives, so keep it short); an error stops rank 0, and the others with kAborted.
using RunStepCallback = std::function<Status(const RunStepReport& step)>;

// One rank's loop of job.steps steps: StepRunner::Next, the memory profile at the chosen
// steps, the verifier, GatherPhases, and on rank 0 the step's figures and on_step. Collective:
// every rank of `world` (world.size() == job.topology.world_size()) calls it with the same job.
[[nodiscard]] Status RunJobOnRank(ProcessGroup& world, const Job& job, const RunSetup& run,
                                  const RunStepCallback& on_step);

// ---- a step's report: both kinds of step, every caller (run, the torch iterator) ----

// The figures and memory `plan` gives for the step a planning rank holds (RankStep::is_loader:
// a loader, or a head of a dynamic step), from its samples and plan: the figures with
// sim_step_time and n_empty, and (with_memory) the memory figures of a static step; a dynamic
// step's come with its figures. InvalidArgument on a rank that did not plan; the figures' own
// errors otherwise.
[[nodiscard]] Result<PlannedStep> ReportRankStep(const Job& job, const RankStep& step,
                                                 bool with_memory = true);

// The step's figures as one JSON object on every rank. Collective over `world` (the runner's):
// a planning rank gets its own (StepFiguresJson with per-replica detail), every other rank
// world rank 0's summary (StepFiguresJson summary_only); a dynamic step appends groups_made,
// groups_reused, groups_evicted and groups_cached (RankStep). An error on one planning rank is
// agreed: every rank returns it.
[[nodiscard]] Result<std::string> StepFiguresJsonOnEveryRank(ProcessGroup& world, const Job& job,
                                                             const RankStep& step);

// `thdpack run --json`'s line for a step (no newline): StepFiguresJson with, in order, memory,
// loss, ppl, entropy, n_tokens (with verify), groups_made, groups_reused, groups_evicted and
// groups_cached (dynamic only),
// bytes_sent {<phase>: [per rank], total},
// time_<phase> per phase and time_step.
std::string RunStepJson(const RunStepReport& step, bool summary_only);

}  // namespace thdpack

#endif  // THDPACK_JOB_H_
