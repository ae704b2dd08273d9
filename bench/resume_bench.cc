// resume_bench: the time to a run's first step at step 0 and at step 1,000,000 of a shuffled
// Megatron dataset of 1,000,000 documents (design.md section 14), by --start-step (the cursor
// computed) and from a saved state (the cursor read), for `plan` (PlanJob) and for the
// distributed step (StepRunner on 8 threads); beside it what a run without a position would pay
// to replay the steps before (measured on a few thousand steps and scaled); and the size of a
// state.
//
// Usage: resume_bench [--documents=N] [--global_batch=N] [--start=K] [--repeats=R]
// The dataset is written to a temporary folder (about 40 MB) and removed. Prints a table; never
// fails on a time.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/job.h"
#include "thdpack/megatron_dataset.h"
#include "thdpack/run_state.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace {

using Clock = std::chrono::steady_clock;
using thdpack::Job;
using thdpack::JobOptions;
using thdpack::RunState;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int64_t Flag(int argc, char** argv, const char* name, int64_t fallback) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind(prefix, 0) == 0) return std::atoll(argv[i] + prefix.size());
  }
  return fallback;
}

void Check(const thdpack::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "resume_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// The best of `repeats` timings of f().
template <typename F>
double Best(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, Seconds(t0));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t documents = Flag(argc, argv, "documents", 1000000);
  const int64_t global_batch = Flag(argc, argv, "global_batch", 256);
  const int64_t start = Flag(argc, argv, "start", 1000000);
  const int repeats = static_cast<int>(Flag(argc, argv, "repeats", 5));

  const auto dir = std::filesystem::temp_directory_path() /
                   ("thdpack_resume_bench_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string prefix = (dir / "docs").string();
  {
    auto w = thdpack::MegatronWriter::Create(prefix, thdpack::MegatronDType::kUint16);
    Check(w.status(), "writer");
    std::mt19937_64 rng(1);
    std::lognormal_distribution<double> length(std::log(12.0), 0.8);
    std::vector<int64_t> tokens;
    for (int64_t d = 0; d < documents; ++d) {
      tokens.assign(static_cast<size_t>(std::clamp<int64_t>(static_cast<int64_t>(length(rng)), 1,
                                                            4000)),
                    static_cast<int64_t>(d % 30000));
      Check((*w)->AddSequence(tokens), "add");
      Check((*w)->EndDocument(), "end");
    }
    Check((*w)->Finish(), "finish");
  }

  JobOptions o;
  o.data = "megatron:" + prefix;
  o.source.shuffle = true;
  o.global_batch = global_batch;
  o.dp = 4;
  o.cp = 2;
  o.max_tokens_per_rank = 16384;
  o.steps = 1;
  auto job_at = [&](int64_t step, const std::string& resume) {
    JobOptions x = o;
    x.start_step = step;
    x.resume = resume;
    auto job = thdpack::ResolveJob(x);
    Check(job.status(), "job");
    return *job;
  };

  // A saved state at `start`: the state a run from 0 holds there (the same as --start-step's).
  const std::string state_path = (dir / "state.json").string();
  // PlanJob of one step from `start - 1` ends with the state before step `start`.
  auto before = thdpack::PlanJob(job_at(start - 1, ""), {}, true);
  Check(before.status(), "plan before the start step");
  const RunState saved = before->state;
  Check(thdpack::WriteRunStateFile(state_path, saved), "write state");
  const std::string state_text = thdpack::RunStateToJson(saved);

  std::printf("resume_bench: megatron dataset of %lld documents (shuffled), global batch %lld, "
              "DP 4 x CP 2; best of %d\n\n",
              static_cast<long long>(documents), static_cast<long long>(global_batch), repeats);
  std::printf("%-44s %12s %10s\n", "time to the first step", "seconds", "vs step 0");
  auto plan_first = [&](const Job& job) {
    auto p = thdpack::PlanJob(job, {}, true);
    Check(p.status(), "plan");
  };
  const Job at0 = job_at(0, "");
  const Job atk = job_at(start, "");
  const double plan0 = Best(repeats, [&] { plan_first(at0); });
  const double plank = Best(repeats, [&] { plan_first(atk); });
  const double planr = Best(repeats, [&] { plan_first(job_at(0, state_path)); });
  auto row = [&](const std::string& what, double t, double base) {
    std::printf("%-44s %12.4f %10.3f\n", what.c_str(), t, t / base);
  };
  row("plan, step 0", plan0, plan0);
  row("plan, --start-step " + std::to_string(start), plank, plan0);
  row("plan, --resume (state at step " + std::to_string(saved.next_step) + ")", planr, plan0);

  // The distributed step on 8 threads: create the runner (open, fingerprint, seek) and run one
  // step.
  auto runner_first = [&](const Job& job, const std::optional<RunState>& state) {
    const auto statuses = thdpack::RunOnThreads(8, [&](thdpack::ProcessGroup& w) {
      auto runner = thdpack::StepRunner::Create(w, job.topology, thdpack::RunnerOptions(job));
      if (!runner.ok()) return runner.status();
      if (state) {
        auto s = (*runner)->Restore(*state);
        if (!s.ok()) return s;
      }
      return (*runner)->Next().status();
    });
    for (const auto& s : statuses) Check(s, "run");
  };
  const double run0 = Best(repeats, [&] { runner_first(at0, std::nullopt); });
  const double runk = Best(repeats, [&] { runner_first(atk, std::nullopt); });
  const double runr = Best(repeats, [&] { runner_first(at0, saved); });
  row("run (8 threads), step 0", run0, run0);
  row("run (8 threads), --start-step " + std::to_string(start), runk, run0);
  row("run (8 threads), restored state", runr, run0);

  // What a run without a position pays: replaying the steps before, read as lengths (the
  // cheapest replay there is), measured over `probe` steps and scaled to `start`.
  const int64_t probe = std::min<int64_t>(start, 2000);
  auto source = thdpack::OpenSource(o.data, o.source);
  Check(source.status(), "open");
  auto reader = thdpack::StepReader::Create(source->get(), global_batch, 1);
  Check(reader.status(), "reader");
  const auto t0 = Clock::now();
  for (int64_t s = 0; s < probe; ++s) Check(reader->Next().status(), "replay");
  const double per_step = Seconds(t0) / static_cast<double>(probe);
  std::printf("%-44s %12.1f %10.0f   (%.1f us a step over %lld steps, scaled)\n",
              ("replay of the " + std::to_string(start) + " steps before").c_str(),
              per_step * static_cast<double>(start), per_step * static_cast<double>(start) / plan0,
              1e6 * per_step, static_cast<long long>(probe));
  std::printf("\nstate: %zu bytes of JSON (next_step %lld, consumed %lld, epoch %lld)\n",
              state_text.size(), static_cast<long long>(saved.next_step),
              static_cast<long long>(saved.consumed),
              static_cast<long long>(saved.cursor ? saved.cursor->epoch : -1));
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return 0;
}
