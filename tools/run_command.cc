// thdpack run: the distributed step loop (docs/design.md section 7) on the thread or MPI backend,
// printing per-step figures (a table line, or one JSON object per step with --json). The loop
// is the library's RunJobOnRank (thdpack/job.h); this file parses options and prints.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "exit_code.h"
#include "job_args.h"
#include "run_figures.h"
#include "summary.h"
#include "thdpack/comm.h"
#include "thdpack/job.h"

namespace thdpack::tools {
namespace {

struct RunArgs {
  JobArgs job;
  std::string backend = "threads";
  bool json = false;
  bool summary_only = false;
  RunOptions run;
  std::string profile_steps;  // --memory-profile-steps text
};

Result<RunSetup> ResolveRunArgs(const RunArgs& a, const Job& job) {
  RunOptions options = a.run;
  THDPACK_ASSIGN_OR_RETURN(options.memory_profile_steps, ParseProfileSteps(a.profile_steps));
  return ResolveRun(job, options);
}

// What rank 0 keeps of each step for the summary block (no per-sample detail).
struct RunTotals {
  std::vector<StepFigures> steps;
  std::vector<StepMemoryFigures> memory;
  double seconds = 0;  // the steps' wall times, each its slowest rank's
};

// Rank 0 prints each step as it comes.
Status RankLoop(ProcessGroup& world, const RunArgs& args, const Job& job, const RunSetup& run,
                RunTotals* totals) {
  ProgressBar bar(job.steps);
  int64_t done = 0;
  return RunJobOnRank(world, job, run, [&](const RunStepReport& step) {
    const std::string line = args.json ? RunStepJson(step, args.summary_only) + "\n"
                                       : StepLine(step);
    bar.Clear();
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
    bar.Update(++done);
    totals->steps.push_back(step.figures);
    totals->steps.back().sample_ids.clear();
    totals->steps.back().plan.replicas.clear();
    totals->memory.push_back(step.memory);
    totals->seconds += step.phases.step_seconds;
    return Status::Ok();
  });
}

// Without --json: plan's summary block, and the time of the steps.
void PrintRunSummary(const RunTotals& totals, const Job& job) {
  if (totals.steps.empty()) return;
  PrintSummaryBlock(totals.steps, totals.memory,
                    CostNote(job.schedule.cost,
                             job.profile ? job.profile->measured_on.device : std::string()),
                    job.blend, job.options.global_batch_tokens);
  PrintDefaulted(job);
  std::printf("  step time          %.1f ms in all, %.1f ms a step (each step: its slowest rank, "
              "start to end)\n",
              1000 * totals.seconds, 1000 * totals.seconds / static_cast<double>(totals.steps.size()));
}

// The status that says why a thread run failed: the first rank (in rank order) whose failure is
// its own (origin not kAborted), else the first that failed.
size_t CauseRank(const std::vector<Status>& statuses) {
  size_t first = statuses.size();
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (statuses[r].ok()) continue;
    if (statuses[r].origin() != StatusCode::kAborted) return r;
    if (first == statuses.size()) first = r;
  }
  return first;
}

int RunOnBackend(const RunArgs& args, const Job& job, const RunSetup& run) {
  RunTotals totals;
  if (args.backend == "threads") {
    auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& world) {
      return RankLoop(world, args, job, run, &totals);
    });
    const size_t cause = CauseRank(statuses);
    if (cause == statuses.size()) {
      if (!args.json) PrintRunSummary(totals, job);
      return kExitOk;
    }
    // Rank 0's error names the rank that failed first; report another rank's only if rank 0
    // has none. The exit code is the cause's, whichever rank reports.
    for (size_t r = 0; r < statuses.size(); ++r) {
      if (!statuses[r].ok()) {
        std::fprintf(stderr, "thdpack run: rank %zu: %s\n", r, statuses[r].ToString().c_str());
        break;
      }
    }
    return ExitCodeOf(statuses[cause]);
  }
  auto world = MpiWorld(/*thread_multiple=*/run.options.prefetch > 0);
  if (!world.ok()) {
    std::fprintf(stderr, "thdpack run: %s\n", world.status().ToString().c_str());
    return ExitCodeOf(world.status());
  }
  Status s = RankLoop(**world, args, job, run, &totals);
  if (!s.ok()) {
    if ((*world)->rank() == 0) std::fprintf(stderr, "thdpack run: rank 0: %s\n", s.ToString().c_str());
    // The same on every rank: an agreed failure carries the failed rank's code as origin.
    return ExitCodeOf(s);
  }
  if (!args.json && (*world)->rank() == 0) PrintRunSummary(totals, job);
  return kExitOk;
}

int RunRun(const RunArgs& args) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "thdpack run: %s\n", s.ToString().c_str());
    return ExitCodeOf(s);
  };
  if (args.backend != "threads" && args.backend != "mpi") {
    return fail(Status::InvalidArgument("--backend: \"" + args.backend +
                                        "\" is not a backend: expected threads or mpi"));
  }
  Result<Job> job = ResolveJobArgs(args.job, "run");
  if (!job.ok()) return fail(job.status());
  Result<RunSetup> run = ResolveRunArgs(args, *job);
  if (!run.ok()) return fail(run.status());
  return RunOnBackend(args, *job, *run);
}

void AddRunOnlyOptions(CLI::App* cmd, RunArgs* a) {
  cmd->add_option("--backend", a->backend, "threads (one thread per rank) or mpi (under mpirun)")
      ->capture_default_str();
  cmd->add_option("--data-on", a->job.options.data_on,
                  "tp0 (one loader per replica) or all (every rank reads)")
      ->capture_default_str();
  cmd->add_option("--timeout", a->job.options.timeout,
                  "Seconds one collective may wait for its peers: then the step fails naming "
                  "the ranks that did not arrive (with mpi, the job ends with MPI_Abort)")
      ->capture_default_str();
  CLI::Option* json =
      cmd->add_flag("--json", a->json, "One JSON object per step (docs/design.md section 10 "
                                       "figures, bytes_sent per rank and phase, time_* per "
                                       "phase, time_step: the slowest rank's wall time)");
  cmd->add_flag("--summary-only", a->summary_only, "With --json: totals only, no replicas")
      ->needs(json);
  CLI::Option* verify = cmd->add_flag("--verify", a->run.verify,
                "Run the probe model (thdpack/probe.h) on every microbatch and check loss, ppl, "
                "entropy and token counts against one rank computing each sample alone; meant "
                "for small data (attention is computed exactly, in fp64)");
  ProbeConfig& probe = a->run.probe;
  cmd->add_option("--probe-layers", probe.layers, "Probe model layers (split over PP stages)")
      ->capture_default_str()
      ->needs(verify);
  cmd->add_option("--probe-hidden", probe.hidden, "Probe model hidden size")->capture_default_str()
      ->needs(verify);
  cmd->add_option("--probe-heads", probe.heads, "Probe model attention heads")
      ->capture_default_str()
      ->needs(verify);
  cmd->add_option("--probe-vocab", probe.vocab_size,
                  "Probe model vocabulary (token ids and labels are taken mod it)")
      ->capture_default_str()
      ->needs(verify);
  cmd->add_option("--verify-tolerance", a->run.verify_tolerance,
                  "Largest relative difference from the reference for loss, ppl and entropy")
      ->capture_default_str()
      ->needs(verify);
  CLI::Option* profile_steps = cmd->add_option("--memory-profile-steps", a->profile_steps,
                  "At these steps (comma-separated, e.g. 0,1) every rank writes its memory "
                  "figures to DIR/step_<N>/rank<R>_pp<p>_dp<d>_cp<c>_tp<t>.json");
  cmd->add_option("--prefetch", a->run.prefetch,
                  "Steps the data plane prepares ahead of the loop, in a thread of each rank "
                  "with a communicator of its own (0: none); the steps and errors are the same")
      ->capture_default_str();
  cmd->add_option("--compute-seconds", a->run.compute_seconds,
                  "Seconds the loop sleeps after taking each step, a stand-in for training "
                  "(shows the overlap in time_wait)")
      ->capture_default_str();
  cmd->add_option("--memory-profile-dir", a->run.memory_profile_dir,
                  "DIR of --memory-profile-steps")
      ->capture_default_str()
      ->needs(profile_steps);
}

}  // namespace

void AddRunCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run",
      "Run the distributed step loop (read, plan, exchange, pack, shard, deliver) on thread or "
      "MPI ranks and print per-step figures, then plan's summary block.\n"
      "Takes plan's options with plan's defaults (3 steps of 256 samples of the built-in mock on "
      "DP=4, CP=2: 8 ranks), so it runs the steps `thdpack plan` shows.");
  AddJobOptions(cmd, &a->job);
  AddRunOnlyOptions(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = RunRun(*a); });
}

}  // namespace thdpack::tools
