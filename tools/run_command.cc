// thdpack run: the distributed step loop (docs/design.md section 7) on the thread or MPI backend,
// printing per-step figures (a table line, or one JSON object per step with --json). The loop
// is the library's RunJobOnRank (thdpack/job.h); this file parses options and prints.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "job_args.h"
#include "run_figures.h"
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

// Rank 0 prints each step as it comes.
Status RankLoop(ProcessGroup& world, const RunArgs& args, const Job& job, const RunSetup& run) {
  ProgressBar bar(job.steps);
  return RunJobOnRank(world, job, run, [&](const RunStepReport& step) {
    const std::string line = args.json ? RunStepJson(step, args.summary_only) + "\n"
                                       : StepLine(step);
    bar.Clear();
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
    bar.Update(step.figures.step + 1);
    return Status::Ok();
  });
}

int RunOnBackend(const RunArgs& args, const Job& job, const RunSetup& run) {
  if (args.backend == "threads") {
    auto statuses = RunOnThreads(job.topology.world_size(), [&](ProcessGroup& world) {
      return RankLoop(world, args, job, run);
    });
    // Rank 0's error names the rank that failed first; report another rank's only if rank 0
    // has none.
    for (size_t r = 0; r < statuses.size(); ++r) {
      if (!statuses[r].ok()) {
        std::fprintf(stderr, "thdpack run: rank %zu: %s\n", r, statuses[r].ToString().c_str());
        return 1;
      }
    }
    return 0;
  }
  auto world = MpiWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "thdpack run: %s\n", world.status().ToString().c_str());
    return 2;
  }
  Status s = RankLoop(**world, args, job, run);
  if (!s.ok()) {
    if ((*world)->rank() == 0) std::fprintf(stderr, "thdpack run: rank 0: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

int RunRun(const RunArgs& args) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "thdpack run: %s\n", s.ToString().c_str());
    return 2;
  };
  Result<Job> job = ResolveJobArgs(args.job);
  if (!job.ok()) return fail(job.status());
  Result<RunSetup> run = ResolveRunArgs(args, *job);
  if (!run.ok()) return fail(run.status());
  if (args.backend != "threads" && args.backend != "mpi") {
    std::fprintf(stderr,
                 "thdpack run: --backend: \"%s\" is not a backend: expected threads or mpi\n",
                 args.backend.c_str());
    return 2;
  }
  return RunOnBackend(args, *job, *run);
}

void AddRunOnlyOptions(CLI::App* cmd, RunArgs* a) {
  cmd->add_option("--backend", a->backend, "threads (one thread per rank) or mpi (under mpirun)")
      ->capture_default_str();
  cmd->add_option("--data-on", a->job.options.data_on,
                  "tp0 (one loader per replica) or all (every rank reads)")
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "One JSON object per step (docs/design.md section 10 figures, "
                                   "bytes_sent per rank and phase, time_* per phase)");
  cmd->add_flag("--summary-only", a->summary_only, "With --json: totals only, no replicas");
  cmd->add_flag("--verify", a->run.verify,
                "Run the probe model (thdpack/probe.h) on every microbatch and check loss, ppl, "
                "entropy and token counts against one rank computing each sample alone; meant "
                "for small data (attention is computed exactly, in fp64)");
  ProbeConfig& probe = a->run.probe;
  cmd->add_option("--probe-layers", probe.layers, "Probe model layers (split over PP stages)")
      ->capture_default_str();
  cmd->add_option("--probe-hidden", probe.hidden, "Probe model hidden size")->capture_default_str();
  cmd->add_option("--probe-heads", probe.heads, "Probe model attention heads")
      ->capture_default_str();
  cmd->add_option("--probe-vocab", probe.vocab_size,
                  "Probe model vocabulary (token ids and labels are taken mod it)")
      ->capture_default_str();
  cmd->add_option("--verify-tolerance", a->run.verify_tolerance,
                  "Largest relative difference from the reference for loss, ppl and entropy")
      ->capture_default_str();
  cmd->add_option("--memory-profile-steps", a->profile_steps,
                  "At these steps (comma-separated, e.g. 0,1) every rank writes its memory "
                  "figures to DIR/step_<N>/rank<R>_pp<p>_dp<d>_cp<c>_tp<t>.json");
  cmd->add_option("--memory-profile-dir", a->run.memory_profile_dir,
                  "DIR of --memory-profile-steps")
      ->capture_default_str();
}

}  // namespace

void AddRunCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run", "Run the distributed step loop (read, plan, exchange, pack, shard, deliver) on "
             "thread or MPI ranks and print per-step figures");
  AddJobOptions(cmd, &a->job);
  AddRunOnlyOptions(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = RunRun(*a); });
}

}  // namespace thdpack::tools
