// thdpack run: the distributed step loop (DESIGN.md section 7) on the thread or MPI backend,
// printing per-step figures (a table line, or one JSON object per step with --json).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "memory_args.h"
#include "run_figures.h"
#include "thdpack/comm.h"
#include "thdpack/cost.h"
#include "thdpack/figures.h"
#include "thdpack/memory_report.h"
#include "thdpack/probe.h"
#include "thdpack/step_runner.h"
#include "thdpack/topology.h"

namespace thdpack::tools {
namespace {

struct RunArgs {
  std::string backend = "threads";
  int tp = 1, cp = 1, dp = 1, pp = 1;
  bool sp = false;
  std::string data = "mock";
  std::string global_batch = "256";
  int64_t steps = 3;
  int64_t max_tokens_per_rank = 16384;
  std::string data_on = "tp0";
  bool json = false;
  bool summary_only = false;
  std::string scheduler = "balanced";
  std::string oversize = "error";
  std::string cost = "llama2-7b";
  int64_t align = 1;
  int microbatch_multiple = 1;
  int num_microbatches = 0;
  uint64_t seed = 1234;
  bool shuffle = false;
  int64_t vocab = 0;
  int64_t mock_samples = 0;
  // --verify: the probe model on every microbatch, checked against one rank (thdpack/probe.h).
  bool verify = false;
  ProbeConfig probe;
  double verify_tolerance = 1e-9;
  // The memory report: figures per step, and per-rank files at --memory-profile-steps.
  MemoryArgs memory;
};

// The phases of RankStep::phases, in order (the step runner's names).
const char* const kPhases[] = {"read", "lengths", "plan", "exchange", "pack", "deliver", "agree"};
constexpr int kNumPhases = 7;

struct Setup {
  Topology topo;
  StepRunnerOptions options;
  std::optional<FlopsCoefficients> flops;
  std::optional<ProbeModel> probe;  // with --verify
  MemoryReportOptions memory{};
  std::vector<int64_t> profile_steps{};  // sorted
};

// The memory report's options and the steps at which every rank writes its profile.
Status SetUpMemory(const RunArgs& a, Setup& setup) {
  THDPACK_ASSIGN_OR_RETURN(setup.memory, ResolveMemoryOptions(a.memory, a.cost));
  THDPACK_ASSIGN_OR_RETURN(setup.profile_steps,
                           ParseProfileSteps(a.memory.profile_steps, a.steps));
  return Status::Ok();
}

Result<Setup> MakeSetup(const RunArgs& a) {
  THDPACK_ASSIGN_OR_RETURN(Topology topo, Topology::Create(a.tp, a.cp, a.dp, a.pp));
  StepRunnerOptions o;
  o.data = a.data;
  o.source.seed = a.seed;
  o.source.shuffle = a.shuffle;
  o.source.vocab_size = a.vocab;
  o.source.mock_num_samples = a.mock_samples;
  if (a.global_batch == "all") {
    o.global_batch = 0;
  } else {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(a.global_batch, &used);
    } catch (...) {
      used = 0;
    }
    if (used != a.global_batch.size() || v < 1) {
      return Status::InvalidArgument("--global-batch: \"" + a.global_batch +
                                     "\" is neither a positive integer nor \"all\"");
    }
    o.global_batch = v;
  }
  if (a.steps < 1) {
    return Status::InvalidArgument("--steps: " + std::to_string(a.steps) + " must be >= 1");
  }
  auto parallel = ParallelLayout::Create(a.cp, a.tp, a.sp, a.align);
  if (!parallel.ok()) return parallel.status().WithContext("--cp/--tp/--sp/--align");
  o.schedule.parallel = *parallel;
  o.schedule.max_tokens_per_rank = a.max_tokens_per_rank;
  o.schedule.microbatch_multiple = a.microbatch_multiple;
  o.schedule.num_microbatches = a.num_microbatches;
  THDPACK_ASSIGN_OR_RETURN(o.schedule.scheduler, ParseSchedulerName(a.scheduler));
  THDPACK_ASSIGN_OR_RETURN(o.schedule.oversize, ParseOversizePolicy(a.oversize));
  THDPACK_ASSIGN_OR_RETURN(o.schedule.cost, ParseCostSpec(a.cost));
  THDPACK_ASSIGN_OR_RETURN(o.data_on, ParseDataOn(a.data_on));
  THDPACK_ASSIGN_OR_RETURN(std::optional<FlopsCoefficients> flops, FlopsFromCostSpec(a.cost));
  std::optional<ProbeModel> probe;
  if (a.verify) {
    auto model = ProbeModel::Create(a.probe);
    if (!model.ok()) return model.status().WithContext("--probe-*");
    probe.emplace(std::move(*model));
    if (!(a.verify_tolerance >= 0)) {
      return Status::InvalidArgument("--verify-tolerance: " + std::to_string(a.verify_tolerance) +
                                     " must be >= 0");
    }
  }
  Setup setup{std::move(topo), std::move(o), flops, std::move(probe)};
  THDPACK_RETURN_IF_ERROR(SetUpMemory(a, setup));
  return setup;
}

// Draws "[#####.....] step 3/10" on stderr, only when stderr is a terminal.
class ProgressBar {
 public:
  explicit ProgressBar(int64_t total) : total_(total), on_(isatty(STDERR_FILENO) != 0) {}
  // Erases the bar so that a line printed on stdout does not land after it.
  void Clear() {
    if (on_) std::fputs("\r\033[K", stderr);
  }
  void Update(int64_t done) {
    if (!on_) return;
    const int width = 30;
    const int filled = static_cast<int>(width * done / total_);
    std::fprintf(stderr, "\r[%s%s] step %lld/%lld", std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_));
    if (done == total_) std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
  }

 private:
  int64_t total_;
  bool on_;
};

// --verify on one rank: the probe over the step's microbatches, and on rank 0 the single-rank
// reference of the same global batch (read the plain way from a source of its own), agreed over
// the world so that a mismatch stops every rank.
class Verifier {
 public:
  static Result<std::unique_ptr<Verifier>> Create(ProcessGroup& world, const Setup& setup,
                                                  double tolerance) {
    auto v = std::unique_ptr<Verifier>(new Verifier(world, setup, tolerance));
    THDPACK_ASSIGN_OR_RETURN(v->probe_, ProbeRunner::Create(world, setup.topo, *setup.probe,
                                                            setup.options.schedule.parallel.sp()));
    Status local = Status::Ok();
    if (world.rank() == 0) {
      auto src = OpenSource(setup.options.data, setup.options.source);
      if (src.ok()) {
        v->plain_ = std::move(*src);
      } else {
        local = src.status();
      }
    }
    THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "verify setup"));
    return v;
  }

  // The step's probe figures (the same on every rank), checked against the reference.
  Result<LossSummary> Check(const RankStep& step) {
    THDPACK_ASSIGN_OR_RETURN(LossSummary got, probe_->Forward(step));
    Status local = Status::Ok();
    if (world_.rank() == 0) local = CompareWithReference(step, got);
    THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "verify"));
    return got;
  }

 private:
  Verifier(ProcessGroup& world, const Setup& setup, double tolerance)
      : world_(world), setup_(setup), tolerance_(tolerance) {}

  Status CompareWithReference(const RankStep& step, const LossSummary& got) {
    THDPACK_ASSIGN_OR_RETURN(std::vector<Sample> samples,
                             ReadStepSamplesPlain(*plain_, setup_.options.global_batch,
                                                  step.meta.skipped_ids));
    std::vector<SampleView> views(samples.begin(), samples.end());
    THDPACK_ASSIGN_OR_RETURN(LossStats ref, ProbeReferenceLoss(*setup_.probe, views));
    return CompareLossSummaries(got, Finalize(ref), tolerance_)
        .WithContext("--verify, step " + std::to_string(step.step));
  }

  ProcessGroup& world_;
  const Setup& setup_;
  double tolerance_;
  std::unique_ptr<ProbeRunner> probe_;
  std::unique_ptr<SampleSource> plain_;
};

// At a --memory-profile-steps step, this rank's memory profile file; a failure on any rank is
// every rank's (collective at those steps only, which every rank knows alike).
Status ProfileMemory(ProcessGroup& world, const RunArgs& args, const Setup& setup,
                     const RankStep& step) {
  if (!std::binary_search(setup.profile_steps.begin(), setup.profile_steps.end(), step.step)) {
    return Status::Ok();
  }
  // Thread ranks share one process, and so its resident memory.
  const int ranks_in_process = world.backend() == "threads" ? world.size() : 1;
  Status local = Status::Ok();
  auto figures = ComputeRankMemory(step, setup.topo, setup.memory);
  if (figures.ok()) {
    local = WriteMemoryProfile(args.memory.profile_dir, *figures, ranks_in_process)
                .WithContext("--memory-profile-dir");
  } else {
    local = figures.status();
  }
  return AgreeOnStatus(world, local, "memory profile");
}

// One rank's loop. Rank 0 prints; the others send it their per-phase bytes and times.
Status RankLoop(ProcessGroup& world, const RunArgs& args, const Setup& setup) {
  THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, setup.topo, setup.options));
  std::unique_ptr<Verifier> verifier;
  if (setup.probe) {
    THDPACK_ASSIGN_OR_RETURN(verifier, Verifier::Create(world, setup, args.verify_tolerance));
  }
  const bool printer = world.rank() == 0;
  ProgressBar bar(args.steps);
  const size_t n = static_cast<size_t>(world.size());
  for (int64_t s = 0; s < args.steps; ++s) {
    THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
    THDPACK_RETURN_IF_ERROR(ProfileMemory(world, args, setup, step));
    std::optional<LossSummary> loss;
    if (verifier) {
      THDPACK_ASSIGN_OR_RETURN(loss, verifier->Check(step));
    }
    // Per-rank phase figures to everyone (rank 0 prints them).
    std::vector<int64_t> my_bytes(kNumPhases, 0);
    std::vector<double> my_times(kNumPhases, 0);
    for (const PhaseStats& p : step.phases) {
      for (int k = 0; k < kNumPhases; ++k) {
        if (p.name == kPhases[k]) {
          my_bytes[static_cast<size_t>(k)] = p.bytes_sent;
          my_times[static_cast<size_t>(k)] = p.seconds;
        }
      }
    }
    std::vector<int64_t> bytes(n * kNumPhases);
    std::vector<double> times(n * kNumPhases);
    THDPACK_RETURN_IF_ERROR(world.AllGatherValues(std::span<const int64_t>(my_bytes), std::span<int64_t>(bytes)));
    THDPACK_RETURN_IF_ERROR(world.AllGatherValues(std::span<const double>(my_times), std::span<double>(times)));
    if (!printer) continue;
    PhaseTable table;
    for (int k = 0; k < kNumPhases; ++k) {
      table.names.push_back(kPhases[k]);
      std::vector<int64_t> b(n);
      double t = 0;
      for (size_t r = 0; r < n; ++r) {
        b[r] = bytes[r * kNumPhases + static_cast<size_t>(k)];
        t = std::max(t, times[r * kNumPhases + static_cast<size_t>(k)]);
      }
      table.bytes.push_back(std::move(b));
      table.seconds.push_back(t);
    }
    THDPACK_ASSIGN_OR_RETURN(std::string line,
                             FormatStep(step, setup.options.schedule, setup.topo, setup.flops,
                                        table, args.json, args.summary_only, loss,
                                        setup.memory));
    bar.Clear();
    std::fputs(line.c_str(), stdout);
    std::fflush(stdout);
    bar.Update(s + 1);
  }
  return Status::Ok();
}

int RunRun(const RunArgs& args) {
  auto setup = MakeSetup(args);
  if (!setup.ok()) {
    std::fprintf(stderr, "thdpack run: %s\n", setup.status().ToString().c_str());
    return 2;
  }
  if (args.backend == "threads") {
    auto statuses = RunOnThreads(setup->topo.world_size(), [&](ProcessGroup& world) {
      return RankLoop(world, args, *setup);
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
  if (args.backend == "mpi") {
    auto world = MpiWorld();
    if (!world.ok()) {
      std::fprintf(stderr, "thdpack run: %s\n", world.status().ToString().c_str());
      return 2;
    }
    Status s = RankLoop(**world, args, *setup);
    if (!s.ok()) {
      if ((*world)->rank() == 0) {
        std::fprintf(stderr, "thdpack run: rank 0: %s\n", s.ToString().c_str());
      }
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "thdpack run: --backend: \"%s\" is not a backend: expected threads or mpi\n",
               args.backend.c_str());
  return 2;
}

}  // namespace

void AddRunCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run", "Run the distributed step loop (read, plan, exchange, pack, shard, deliver) on "
             "thread or MPI ranks and print per-step figures");
  cmd->add_option("--backend", a->backend, "threads (one thread per rank) or mpi (under mpirun)")
      ->capture_default_str();
  cmd->add_option("--tp", a->tp, "Tensor-parallel size")->capture_default_str();
  cmd->add_option("--cp", a->cp, "Context-parallel size")->capture_default_str();
  cmd->add_option("--dp", a->dp, "Data-parallel size")->capture_default_str();
  cmd->add_option("--pp", a->pp, "Pipeline-parallel size")->capture_default_str();
  cmd->add_flag("--sp", a->sp, "Sequence parallelism (T/CP a multiple of TP)");
  cmd->add_option("--data", a->data, "Source spec: mock, mock:FILE.json, lengths:FILE, "
                                     "histogram:FILE, jsonl:FILE, megatron:PREFIX")
      ->capture_default_str();
  cmd->add_option("--global-batch", a->global_batch, "Samples per step over all replicas, or all")
      ->capture_default_str();
  cmd->add_option("--steps", a->steps, "Steps to run")->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", a->max_tokens_per_rank,
                  "Padded tokens one CP rank may hold in one microbatch")
      ->capture_default_str();
  cmd->add_option("--data-on", a->data_on, "tp0 (one loader per replica) or all (every rank reads)")
      ->capture_default_str();
  cmd->add_flag("--json", a->json, "One JSON object per step (DESIGN.md section 10 figures, "
                                   "bytes_sent per rank and phase, time_* per phase)");
  cmd->add_flag("--summary-only", a->summary_only, "With --json: totals only, no replicas");
  cmd->add_option("--scheduler", a->scheduler, "balanced or sequential")->capture_default_str();
  cmd->add_option("--oversize", a->oversize, "error or skip")->capture_default_str();
  cmd->add_option("--cost", a->cost, "Cost model: tokens, llama2-7b, llama3-8b, A,B or dimensions")
      ->capture_default_str();
  cmd->add_option("--align", a->align, "Extra per-sequence alignment")->capture_default_str();
  cmd->add_option("--microbatch-multiple", a->microbatch_multiple,
                  "The number of microbatches is a multiple of this")
      ->capture_default_str();
  cmd->add_option("--num-microbatches", a->num_microbatches, "Fix the number of microbatches (0: free)")
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "Seed of mock data and shuffling")->capture_default_str();
  cmd->add_flag("--shuffle", a->shuffle, "Visit each epoch in a seeded random order");
  cmd->add_option("--vocab", a->vocab, "Vocabulary size (0: unknown)")->capture_default_str();
  cmd->add_option("--mock-samples", a->mock_samples, "Samples per epoch of a lognormal mock (0: default)")
      ->capture_default_str();
  cmd->add_flag("--verify", a->verify,
                "Run the probe model (thdpack/probe.h) on every microbatch and check loss, ppl, "
                "entropy and token counts against one rank computing each sample alone; meant "
                "for small data (attention is computed exactly, in fp64)");
  cmd->add_option("--probe-layers", a->probe.layers, "Probe model layers (split over PP stages)")
      ->capture_default_str();
  cmd->add_option("--probe-hidden", a->probe.hidden, "Probe model hidden size")
      ->capture_default_str();
  cmd->add_option("--probe-heads", a->probe.heads, "Probe model attention heads")
      ->capture_default_str();
  cmd->add_option("--probe-vocab", a->probe.vocab_size,
                  "Probe model vocabulary (token ids and labels are taken mod it)")
      ->capture_default_str();
  cmd->add_option("--verify-tolerance", a->verify_tolerance,
                  "Largest relative difference from the reference for loss, ppl and entropy")
      ->capture_default_str();
  AddMemoryOptions(cmd, &a->memory, /*profile=*/true);
  cmd->callback([a, exit_code] { *exit_code = RunRun(*a); });
}

}  // namespace thdpack::tools
