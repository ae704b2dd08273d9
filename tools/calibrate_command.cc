// thdpack calibrate: a measured cost profile (thdpack/profile.h) from timings measured
// elsewhere (any framework), printed as a fit report and written as JSON for --cost
// profile:FILE.
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "exit_code.h"
#include "thdpack/profile.h"

namespace thdpack::tools {
namespace {

struct CalibrateArgs {
  std::string timings;
  std::string out;
  MeasuredOn on;
  int hold_out_every = 4;
  bool refine = true;
};

std::string Percent(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f%%", 100 * v);
  return buf;
}

void PrintForm(const char* what, const ProfileForm& f, bool with_m, bool used) {
  char m[32] = "-";
  if (with_m) std::snprintf(m, sizeof(m), "%.4e", f.m);
  std::printf("  %-22s %11.4e %13.4e %11.4e %11s   %8s   %8.5f %8s %8s%s\n", what, f.a, f.b, f.c, m,
              Percent(f.fit.max_rel_error).c_str(), f.held_out.r2,
              f.held_out.n ? Percent(f.held_out.max_rel_error).c_str() : "-",
              f.held_out.n ? Percent(f.held_out.p95_rel_error).c_str() : "-",
              used ? "  (used)" : "");
}

int RunCalibrate(const CalibrateArgs& args) {
  Result<std::vector<TimedMicrobatch>> timed = ReadTimingsCsv(args.timings, args.hold_out_every);
  if (!timed.ok()) {
    std::fprintf(stderr, "thdpack calibrate: --timings: %s\n", timed.status().ToString().c_str());
    return ExitCodeOf(timed.status());
  }
  FitOptions options;
  options.refine = args.refine;
  Result<CostProfile> profile = FitCostProfile(*timed, args.on, options);
  if (!profile.ok()) {
    std::fprintf(stderr, "thdpack calibrate: %s (%s)\n", profile.status().ToString().c_str(),
                 args.timings.c_str());
    return ExitCodeOf(profile.status());
  }
  const CostProfile& p = *profile;
  std::printf("thdpack calibrate: %zu microbatches from %s (%lld fitted, %lld held out: every "
              "%d%s row)\n\n",
              timed->size(), args.timings.c_str(), static_cast<long long>(p.abc.fit.n),
              static_cast<long long>(p.abc.held_out.n), args.hold_out_every,
              args.hold_out_every == 1 ? "st" : args.hold_out_every == 2 ? "nd"
                                            : args.hold_out_every == 3 ? "rd" : "th");
  std::printf("  %-22s %11s %13s %11s %11s   %8s   %8s %8s %8s\n", "form", "a s/token",
              "b s/token^2", "c s/seq", "m s/mb", "fit max", "held R^2", "max err", "p95 err");
  PrintForm("a P + b P^2 + c", p.abc, false, !p.use_refined);
  if (p.refined) PrintForm("... + m per microbatch", *p.refined, true, p.use_refined);
  if (!p.held_out.empty()) {
    std::printf("\nheld-out microbatches (measured, predicted by the form used):\n");
    for (const TimedMicrobatch& r : p.held_out) {
      const double predicted = p.used().Predict(r.lengths);
      std::string lengths = DescribeLengths(r.lengths);
      if (lengths.size() > 40) lengths = lengths.substr(0, 37) + "...";
      std::printf("  %-40s %12.6g s %12.6g s  %+7.2f%%\n", lengths.c_str(), r.seconds, predicted,
                  100 * (predicted - r.seconds) / r.seconds);
    }
  }
  Status written = WriteCostProfile(p, args.out);
  if (!written.ok()) {
    std::fprintf(stderr, "thdpack calibrate: --out: %s\n", written.ToString().c_str());
    return ExitCodeOf(written);
  }
  std::printf("\nwrote %s: use it with --cost profile:%s\n", args.out.c_str(), args.out.c_str());
  return kExitOk;
}

}  // namespace

void AddCalibrateCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<CalibrateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "Fit a measured cost profile (a P + b P^2 + c seconds a sequence of padded length P) to\n"
      "timed microbatches and write it for --cost profile:FILE (docs/scheduling.md,\n"
      "\"Measured cost\"). thdpack.torch.calibrate times them itself; this verb takes timings\n"
      "from any framework.");
  cmd->add_option("--timings", args->timings,
                  "CSV of timed microbatches: the header `seconds,lengths`, then one row per "
                  "microbatch, its padded lengths separated by spaces (0.0405,256 256 1024)")
      ->required();
  cmd->add_option("--out", args->out, "the profile to write (JSON)")->required();
  cmd->add_option("--hold-out-every", args->hold_out_every,
                  "hold out every Nth row (4th, 8th, ...): the fit's error is reported on them; "
                  "0 holds out none")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("!--no-refine", args->refine,
                "fit a P + b P^2 + c alone (no constant per microbatch)");
  cmd->add_option("--model", args->on.model,
                  "what was measured: a cost spec with dimensions (llama2-7b, l=..,h=..,...) also "
                  "gives the step-time model its K/V exchange, else free text");
  cmd->add_option("--device", args->on.device, "the device (e.g. \"NVIDIA H200\")");
  cmd->add_option("--dtype", args->on.dtype, "the compute dtype (e.g. bf16)");
  cmd->add_option("--attention", args->on.attention, "the attention implementation");
  cmd->add_option("--tp", args->on.tp_size, "the TP size it was measured at")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--cp", args->on.cp_size, "the CP size it was measured at")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->callback([args, exit_code] { *exit_code = RunCalibrate(*args); });
}

}  // namespace thdpack::tools
