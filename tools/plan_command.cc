// thdpack plan: what a data set does to balance, padding, microbatch count and FLOPs at a given
// topology, step by step, without any GPU. Reads steps with StepReader, schedules them with
// Schedule, and prints StepFigures (the same figures and JSON that `thdpack run` prints), with
// each step's memory figures (thdpack/memory_report.h) as the JSON field `memory`.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "memory_args.h"
#include "thdpack/data.h"
#include "thdpack/figures.h"
#include "thdpack/memory_report.h"
#include "thdpack/plan_step.h"
#include "thdpack/schedule.h"
#include "thdpack/step.h"
#include "thdpack/topology.h"

namespace thdpack::tools {
namespace {

struct PlanArgs {
  std::string data = "mock";
  int dp = 4;
  int cp = 2;
  int tp = 1;
  int pp = 1;
  bool sp = false;
  int64_t align = 1;
  int64_t max_tokens_per_rank = 16384;
  std::string global_batch = "256";
  int64_t steps = 3;
  std::string scheduler = "balanced";
  std::string cost = "llama2-7b";
  int microbatch_multiple = 1;
  int num_microbatches = 0;
  std::string oversize = "error";
  uint64_t seed = 1234;
  bool shuffle = false;
  bool json = false;
  bool summary_only = false;
  std::string svg;
  MemoryArgs memory;
};

// The figures of the steps drawn in the SVG (the first kMaxSvgSteps).
constexpr size_t kMaxSvgSteps = 8;

Status Fail(const std::string& option, const std::string& message) {
  return Status::InvalidArgument(option + ": " + message);
}

// "all" -> 0, "N" -> N >= 1.
Result<int64_t> ParseGlobalBatch(const std::string& text) {
  if (text == "all") return int64_t{0};
  if (!text.empty() && text.size() <= 18 &&
      text.find_first_not_of("0123456789") == std::string::npos) {
    const int64_t v = std::stoll(text);
    if (v >= 1) return v;
  }
  return Fail("--global-batch", "\"" + text + "\" is not a positive integer or \"all\"");
}

// 1234567 -> "1,234,567".
std::string Thousands(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string Flops(bool has, double flops) {
  if (!has) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", flops);
  return buf;
}

std::string XmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// A stacked-bar chart per step: one bar per replica, one <rect class="mb"> per (replica,
// microbatch) stacked bottom-up in microbatch order, height = the microbatch's per-rank cost;
// a dashed line at the lower bound; a y axis with ticks; a legend of microbatch colours.
std::string DrawSvg(const std::vector<StepFigures>& steps, const PlanArgs& args,
                    const std::string& cost_name) {
  static const char* kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                                   "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
  constexpr int kPaletteSize = 10;
  const size_t n_panels = std::min(steps.size(), kMaxSvgSteps);
  const double left = 100, right = 200, top = 50, panel_h = 260, gap = 70;
  const double plot_w = std::max(400.0, std::min(1600.0, 14.0 * args.dp));
  const double width = left + plot_w + right;
  const double height = top + n_panels * (panel_h + gap) + 20;
  std::string s;
  s += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Num(width) + "\" height=\"" +
       Num(height) + "\" viewBox=\"0 0 " + Num(width) + " " + Num(height) +
       "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s += "<rect x=\"0\" y=\"0\" width=\"" + Num(width) + "\" height=\"" + Num(height) +
       "\" fill=\"white\"/>\n";
  s += "<text x=\"" + Num(left) + "\" y=\"24\" font-size=\"15\" font-weight=\"bold\">" +
       XmlEscape("thdpack plan: per-replica load (cost per rank, " + cost_name + "), DP=" +
                 std::to_string(args.dp) + " CP=" + std::to_string(args.cp) + ", " +
                 args.scheduler + " scheduler") +
       "</text>\n";
  int max_m = 1;
  for (size_t k = 0; k < n_panels; ++k) max_m = std::max(max_m, steps[k].plan.num_microbatches);
  for (size_t k = 0; k < n_panels; ++k) {
    const StepFigures& f = steps[k];
    const PlanFigures& p = f.plan;
    const double y0 = top + k * (panel_h + gap) + 20;  // top of the plot area
    const double ymax = std::max(p.max_replica_cost, p.lower_bound) * 1.08;
    auto ypix = [&](double v) { return y0 + panel_h - (ymax > 0 ? v / ymax * panel_h : 0); };
    char title[200];
    std::snprintf(title, sizeof title,
                  "step %lld (epoch %lld): %d microbatches, imbalance %.4f, pad %.2f%%, fill "
                  "%.2f%%",
                  static_cast<long long>(f.step), static_cast<long long>(f.epoch),
                  p.num_microbatches, p.imbalance, 100 * p.pad_fraction, 100 * p.fill);
    s += "<g class=\"step\" data-step=\"" + std::to_string(f.step) + "\">\n";
    s += "<text x=\"" + Num(left) + "\" y=\"" + Num(y0 - 8) + "\" font-weight=\"bold\">" +
         XmlEscape(title) + "</text>\n";
    // Axes and ticks.
    s += "<line x1=\"" + Num(left) + "\" y1=\"" + Num(y0) + "\" x2=\"" + Num(left) + "\" y2=\"" +
         Num(y0 + panel_h) + "\" stroke=\"black\"/>\n";
    s += "<line x1=\"" + Num(left) + "\" y1=\"" + Num(y0 + panel_h) + "\" x2=\"" +
         Num(left + plot_w) + "\" y2=\"" + Num(y0 + panel_h) + "\" stroke=\"black\"/>\n";
    for (int t = 0; t <= 4; ++t) {
      const double v = ymax * t / 4.0;
      const double y = ypix(v);
      s += "<line x1=\"" + Num(left - 4) + "\" y1=\"" + Num(y) + "\" x2=\"" + Num(left) +
           "\" y2=\"" + Num(y) + "\" stroke=\"black\"/>\n";
      s += "<text x=\"" + Num(left - 6) + "\" y=\"" + Num(y + 4) + "\" text-anchor=\"end\">" +
           Num(v) + "</text>\n";
    }
    s += "<text x=\"" + Num(left - 85) + "\" y=\"" + Num(y0 + panel_h / 2) +
         "\" transform=\"rotate(-90 " + Num(left - 85) + " " + Num(y0 + panel_h / 2) +
         ")\" text-anchor=\"middle\">cost per rank</text>\n";
    s += "<text x=\"" + Num(left + plot_w / 2) + "\" y=\"" + Num(y0 + panel_h + 32) +
         "\" text-anchor=\"middle\">DP replica</text>\n";
    const int dp = static_cast<int>(p.replicas.size());
    const double slot = plot_w / std::max(1, dp);
    const double bar_w = std::max(1.0, slot * 0.8);
    const int label_every = std::max(1, dp / 16);
    for (int d = 0; d < dp; ++d) {
      const ReplicaFigures& r = p.replicas[static_cast<size_t>(d)];
      const double x = left + d * slot + (slot - bar_w) / 2;
      double acc = 0;
      for (size_t m = 0; m < r.microbatches.size(); ++m) {
        const MicrobatchFigures& mb = r.microbatches[m];
        const double ytop = ypix(acc + mb.cost);
        const double h = ypix(acc) - ytop;
        acc += mb.cost;
        std::string ids;
        if (d < static_cast<int>(f.sample_ids.size()) && m < f.sample_ids[d].size()) {
          for (size_t i = 0; i < f.sample_ids[d][m].size() && i < 32; ++i) {
            ids += (i ? "," : "") + std::to_string(f.sample_ids[d][m][i]);
          }
          if (f.sample_ids[d][m].size() > 32) ids += ",...";
        }
        s += "<rect class=\"mb\" x=\"" + Num(x) + "\" y=\"" + Num(ytop) + "\" width=\"" +
             Num(bar_w) + "\" height=\"" + Num(std::max(0.0, h)) + "\" fill=\"" +
             kPalette[m % kPaletteSize] + "\" stroke=\"white\" stroke-width=\"0.5\"><title>" +
             XmlEscape("replica " + std::to_string(d) + ", microbatch " + std::to_string(m) +
                       ": " + std::to_string(mb.n_samples) + " samples, " +
                       std::to_string(mb.real_tokens) + " real / " +
                       std::to_string(mb.padded_tokens) + " padded tokens, cost " +
                       Num(mb.cost) + "; ids " + ids) +
             "</title></rect>\n";
      }
      if (d % label_every == 0) {
        s += "<text x=\"" + Num(x + bar_w / 2) + "\" y=\"" + Num(y0 + panel_h + 15) +
             "\" text-anchor=\"middle\" font-size=\"10\">" + std::to_string(d) + "</text>\n";
      }
    }
    const double lb = ypix(p.lower_bound);
    s += "<line class=\"lower-bound\" x1=\"" + Num(left) + "\" y1=\"" + Num(lb) + "\" x2=\"" +
         Num(left + plot_w) + "\" y2=\"" + Num(lb) +
         "\" stroke=\"black\" stroke-dasharray=\"6,4\"/>\n";
    s += "<text x=\"" + Num(left + plot_w + 6) + "\" y=\"" + Num(lb + 4) +
         "\" font-size=\"11\">lower bound</text>\n";
    s += "</g>\n";
  }
  // Legend: microbatch colours.
  const double lx = left + plot_w + 100;
  s += "<g class=\"legend\">\n<text x=\"" + Num(lx) + "\" y=\"" + Num(top + 40) +
       "\" font-weight=\"bold\">microbatch</text>\n";
  const int shown = std::min(max_m, kPaletteSize);
  for (int m = 0; m < shown; ++m) {
    const double y = top + 50 + m * 18;
    s += "<rect x=\"" + Num(lx) + "\" y=\"" + Num(y) + "\" width=\"12\" height=\"12\" fill=\"" +
         kPalette[m] + "\"/>\n";
    std::string label = std::to_string(m);
    if (max_m > kPaletteSize) label += " (+" + std::to_string(kPaletteSize) + "k)";
    s += "<text x=\"" + Num(lx + 18) + "\" y=\"" + Num(y + 10) + "\">" + label + "</text>\n";
  }
  s += "</g>\n</svg>\n";
  return s;
}

// The summary's memory lines: the logits of the step with the largest microbatch, the buffers of
// the step whose busiest replica holds the most (the first such step on ties).
void PrintMemorySummary(const std::vector<StepMemoryFigures>& memory,
                        const std::vector<StepFigures>& steps) {
  size_t largest = 0, fullest = 0;
  for (size_t k = 1; k < memory.size(); ++k) {
    if (memory[k].logits && memory[k].logits->total_tokens > memory[largest].logits->total_tokens) {
      largest = k;
    }
    if (memory[k].buffers.total > memory[fullest].buffers.total) fullest = k;
  }
  if (memory.empty()) return;
  if (memory[largest].logits) {
    std::printf("  logits per rank    %s\n", LogitsLine(*memory[largest].logits).c_str());
  } else {
    std::printf("  logits per rank    - (no vocabulary: pass --vocab-size or a model --cost)\n");
  }
  const StepMemoryFigures& b = memory[fullest];
  std::printf("  buffers per rank   %s held by thdpack (step %lld, replica %d, %d microbatch%s)\n",
              BinaryBytes(b.buffers.total).c_str(), static_cast<long long>(steps[fullest].step),
              b.busiest_replica, b.num_microbatches, b.num_microbatches == 1 ? "" : "es");
}

int RunPlan(const PlanArgs& args) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "thdpack plan: %s\n", s.message().c_str());
    return 2;
  };
  // Options, each error naming its option.
  if (args.dp < 1) return fail(Fail("--dp", "must be >= 1, got " + std::to_string(args.dp)));
  if (args.cp < 1) return fail(Fail("--cp", "must be >= 1, got " + std::to_string(args.cp)));
  if (args.tp < 1) return fail(Fail("--tp", "must be >= 1, got " + std::to_string(args.tp)));
  if (args.pp < 1) return fail(Fail("--pp", "must be >= 1, got " + std::to_string(args.pp)));
  if (args.align < 1) {
    return fail(Fail("--align", "must be >= 1, got " + std::to_string(args.align)));
  }
  if (args.max_tokens_per_rank < 1) {
    return fail(Fail("--max-tokens-per-rank",
                     "must be >= 1, got " + std::to_string(args.max_tokens_per_rank)));
  }
  if (static_cast<int64_t>(args.cp) * args.max_tokens_per_rank > kMaxSampleLength) {
    return fail(Fail("--max-tokens-per-rank", "CP * max tokens per rank must fit int32"));
  }
  if (args.steps < 1) {
    return fail(Fail("--steps", "must be >= 1, got " + std::to_string(args.steps)));
  }
  if (args.microbatch_multiple < 1) {
    return fail(Fail("--microbatch-multiple",
                     "must be >= 1, got " + std::to_string(args.microbatch_multiple)));
  }
  if (args.num_microbatches < 0 || args.num_microbatches % args.microbatch_multiple != 0) {
    return fail(Fail("--num-microbatches",
                     "must be 0 (scheduler chooses) or a positive multiple of "
                     "--microbatch-multiple (" + std::to_string(args.microbatch_multiple) +
                         "), got " + std::to_string(args.num_microbatches)));
  }
  auto topo = Topology::Create(args.tp, args.cp, args.dp, args.pp);
  if (!topo.ok()) return fail(Fail("--dp/--cp/--tp/--pp", topo.status().message()));
  auto global_batch = ParseGlobalBatch(args.global_batch);
  if (!global_batch.ok()) return fail(global_batch.status());
  auto scheduler = ParseSchedulerName(args.scheduler);
  if (!scheduler.ok()) return fail(Fail("--scheduler", scheduler.status().message()));
  auto oversize = ParseOversizePolicy(args.oversize);
  if (!oversize.ok()) return fail(Fail("--oversize", oversize.status().message()));
  auto cost = ParseCostSpec(args.cost);
  if (!cost.ok()) return fail(Fail("--cost", cost.status().message()));
  auto flops = FlopsFromCostSpec(args.cost);
  if (!flops.ok()) return fail(Fail("--cost", flops.status().message()));
  auto memory_options = ResolveMemoryOptions(args.memory, args.cost);
  if (!memory_options.ok()) return fail(memory_options.status());

  SourceOptions source_options;
  source_options.seed = args.seed;
  source_options.shuffle = args.shuffle;
  auto source = OpenSource(args.data, source_options);
  if (!source.ok()) return fail(Fail("--data", source.status().message()));
  auto reader = StepReader::Create(source->get(), *global_batch, args.dp);
  if (!reader.ok()) return fail(reader.status());

  ScheduleOptions options;
  options.dp_size = args.dp;
  options.cp_size = args.cp;
  options.tp_size = args.tp;
  options.sp = args.sp;
  options.extra_alignment = args.align;
  options.max_tokens_per_rank = args.max_tokens_per_rank;
  options.cost = *cost;
  options.microbatch_multiple = args.microbatch_multiple;
  options.num_microbatches = args.num_microbatches;
  options.oversize = *oversize;
  options.scheduler = *scheduler;

  const bool progress = isatty(STDERR_FILENO) != 0 && args.steps > 1;
  std::vector<StepFigures> steps;
  steps.reserve(static_cast<size_t>(std::min<int64_t>(args.steps, 1 << 20)));
  std::vector<StepMemoryFigures> memory;  // [step]
  memory.reserve(steps.capacity());
  for (int64_t k = 0; k < args.steps; ++k) {
    if (progress) {
      const int width = 30;
      const int done = static_cast<int>(width * k / args.steps);
      std::fprintf(stderr, "\rplanning [%s%s] step %lld/%lld", std::string(done, '#').c_str(),
                   std::string(width - done, '.').c_str(), static_cast<long long>(k + 1),
                   static_cast<long long>(args.steps));
      std::fflush(stderr);
    }
    // A whole unshuffled histogram per step, no per-sample output: planned in bulk when
    // PlanHistogramStep applies (thdpack/plan_step.h), else read sample by sample below.
    auto* hist = dynamic_cast<HistogramSource*>(source->get());
    if (hist && *global_batch == 0 && !args.shuffle && args.svg.empty() &&
        (!args.json || args.summary_only)) {
      auto planned = PlanHistogramStep(hist->histogram().rows, k, k,
                                       k * hist->histogram().num_sequences, options, *flops,
                                       *memory_options);
      if (!planned.ok()) return fail(planned.status());
      if (planned->has_value()) {
        memory.push_back(std::move((*planned)->memory));
        steps.push_back(std::move((*planned)->figures));
        continue;
      }
    }
    auto step = reader->Next();
    if (!step.ok()) return fail(Fail("--data", step.status().message()));
    auto plan = Schedule(step->samples, options);
    if (!plan.ok()) {
      std::string hint;
      const std::string& m = plan.status().message();
      if (m.find("budget") != std::string::npos) {
        hint = " (raise --max-tokens-per-rank or --cp, or pass --oversize skip)";
      } else if (m.find("too few") != std::string::npos) {
        hint = " (raise --global-batch, or lower --dp, --microbatch-multiple or "
               "--num-microbatches)";
      }
      if (progress) std::fputc('\n', stderr);
      return fail(Status::InvalidArgument("step " + std::to_string(step->step) + ": " + m + hint));
    }
    auto figures = ComputeStepFigures(step->step, step->epoch, step->samples, options, *plan,
                                      *flops);
    if (!figures.ok()) return fail(figures.status());
    auto step_memory = ComputeStepMemory(step->samples, options, *plan, *memory_options);
    if (!step_memory.ok()) return fail(step_memory.status());
    memory.push_back(std::move(step_memory).value());
    // Per-sample detail is printed only by --json without --summary-only, and drawn for the
    // first kMaxSvgSteps steps: drop it otherwise, so long runs keep only totals in memory.
    if ((!args.json || args.summary_only) && steps.size() >= kMaxSvgSteps) {
      figures->sample_ids.clear();
      figures->plan.replicas.clear();
    }
    steps.push_back(std::move(figures).value());
  }
  if (progress) std::fprintf(stderr, "\r%60s\r", "");
  const SummaryFigures summary = Summarize(steps);

  if (!args.svg.empty()) {
    std::ofstream out(args.svg, std::ios::binary | std::ios::trunc);
    out << DrawSvg(steps, args, cost->name);
    out.close();
    if (!out) return fail(Fail("--svg", "cannot write \"" + args.svg + "\""));
  }

  if (args.json) {
    std::vector<JsonFields> step_fields(memory.size());
    for (size_t k = 0; k < memory.size(); ++k) {
      step_fields[k].emplace_back("memory", StepMemoryJson(memory[k]));
    }
    std::cout << PlanReportJson(steps, summary, args.summary_only, step_fields);
    return 0;
  }

  std::printf("thdpack plan: data %s, DP=%d CP=%d TP=%d PP=%d%s, %lld max tokens per rank, "
              "global batch %s, %s scheduler, cost %s\n",
              args.data.c_str(), args.dp, args.cp, args.tp, args.pp, args.sp ? " SP" : "",
              static_cast<long long>(args.max_tokens_per_rank), args.global_batch.c_str(),
              args.scheduler.c_str(), cost->name.c_str());
  if (!args.summary_only) {
    std::printf("\n%6s %5s %5s %8s %7s %10s %8s %7s %14s %14s %11s\n", "step", "epoch", "M",
                "samples", "skipped", "imbalance", "pad%", "fill%", "real tokens",
                "padded tokens", "FLOPs");
    for (const StepFigures& f : steps) {
      const PlanFigures& p = f.plan;
      std::printf("%6lld %5lld %5d %8lld %7lld %10.4f %8.2f %7.2f %14s %14s %11s\n",
                  static_cast<long long>(f.step), static_cast<long long>(f.epoch),
                  p.num_microbatches, static_cast<long long>(p.n_samples),
                  static_cast<long long>(p.n_skipped), p.imbalance, 100 * p.pad_fraction,
                  100 * p.fill, Thousands(p.real_tokens).c_str(),
                  Thousands(p.padded_tokens).c_str(), Flops(f.has_flops, f.flops).c_str());
    }
  }
  std::printf("\nsummary over %lld step%s (epochs %lld-%lld):\n",
              static_cast<long long>(summary.n_steps), summary.n_steps == 1 ? "" : "s",
              static_cast<long long>(summary.first_epoch),
              static_cast<long long>(summary.last_epoch));
  std::printf("  microbatches       %s (at most %s in a step)\n",
              Thousands(summary.num_microbatches).c_str(),
              Thousands(summary.max_num_microbatches).c_str());
  std::printf("  samples            %s scheduled, %s skipped\n",
              Thousands(summary.n_samples).c_str(), Thousands(summary.n_skipped).c_str());
  std::printf("  tokens             %s real, %s padded, %s loss tokens\n",
              Thousands(summary.real_tokens).c_str(), Thousands(summary.padded_tokens).c_str(),
              Thousands(summary.n_loss_tokens).c_str());
  std::printf("  imbalance          mean %.4f, max %.4f (1 = every replica at the lower bound)\n",
              summary.mean_imbalance, summary.max_imbalance);
  std::printf("  pad fraction       %.2f%%\n", 100 * summary.pad_fraction);
  std::printf("  fill               %.2f%% of M * DP * CP * max tokens per rank\n",
              100 * summary.fill);
  std::printf("  training FLOPs     %s\n", Flops(summary.has_flops, summary.flops).c_str());
  PrintMemorySummary(memory, steps);
  for (const StepFigures& f : steps) {
    if (f.skipped.empty()) continue;
    std::printf("  step %lld skipped %zu oversize sample(s), ids:", static_cast<long long>(f.step),
                f.skipped.size());
    for (size_t i = 0; i < f.skipped.size() && i < 20; ++i) {
      std::printf(" %lld", static_cast<long long>(f.skipped[i]));
    }
    std::printf("%s\n", f.skipped.size() > 20 ? " ..." : "");
  }
  if (!args.svg.empty()) std::printf("  chart              %s\n", args.svg.c_str());
  return 0;
}

}  // namespace

void AddPlanCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Schedule steps of a data set over DP replicas and microbatches and print balance, "
      "padding, fill, tokens and FLOPs per step.\n"
      "With no options: 3 steps of 256 samples of the built-in lognormal mock (lengths 16 to "
      "16384, mean 2048) on DP=4, CP=2, 16384 tokens per rank, llama2-7b cost.");
  cmd->add_option("--data", args->data,
                  "Data source: mock | mock:FILE.json | lengths:FILE | histogram:FILE | "
                  "jsonl:FILE | megatron:PREFIX")
      ->capture_default_str();
  cmd->add_option("--dp", args->dp, "Data-parallel size (replicas)")->capture_default_str();
  cmd->add_option("--cp", args->cp, "Context-parallel size")->capture_default_str();
  cmd->add_option("--tp", args->tp, "Tensor-parallel size (matters with --sp)")
      ->capture_default_str();
  cmd->add_option("--pp", args->pp, "Pipeline-parallel size (checked; use "
                                    "--microbatch-multiple for pipeline groups)")
      ->capture_default_str();
  cmd->add_flag("--sp", args->sp, "Sequence parallelism: T/CP must be a multiple of TP");
  cmd->add_option("--align", args->align,
                  "Extra per-sequence alignment, multiplying the 2*CP padding multiple")
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", args->max_tokens_per_rank,
                  "Padded tokens one CP rank may hold in one microbatch")
      ->capture_default_str();
  cmd->add_option("--global-batch", args->global_batch,
                  "Samples per step over all replicas, or \"all\" (one whole epoch per step: "
                  "--steps N then plans N epochs)")
      ->capture_default_str();
  cmd->add_option("--steps", args->steps, "Steps to plan (the source wraps into the next epoch)")
      ->capture_default_str();
  cmd->add_option("--scheduler", args->scheduler, "balanced | sequential")->capture_default_str();
  cmd->add_option("--cost", args->cost,
                  "Cost model: tokens | llama2-7b | llama3-8b | A,B | "
                  "l=..,h=..,nh=..,nkv=..,f=..,v=.. (FLOPs are shown for models)")
      ->capture_default_str();
  cmd->add_option("--microbatch-multiple", args->microbatch_multiple,
                  "The number of microbatches is a multiple of this (pipeline/VPP groups)")
      ->capture_default_str();
  cmd->add_option("--num-microbatches", args->num_microbatches,
                  "Fix the number of microbatches (0: the scheduler chooses)")
      ->capture_default_str();
  cmd->add_option("--oversize", args->oversize,
                  "A sample longer than CP * max tokens per rank: error | skip (reported)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Seed of mock lengths and of --shuffle")
      ->capture_default_str();
  cmd->add_flag("--shuffle", args->shuffle, "Visit each epoch in a seeded random order");
  cmd->add_flag("--json", args->json,
                "Print {\"steps\":[...],\"summary\":{...}} (the schema `thdpack run` prints)");
  cmd->add_flag("--summary-only", args->summary_only,
                "Only totals: no per-step table; with --json, steps without replicas");
  cmd->add_option("--svg", args->svg,
                  "Write a stacked-bar chart of per-replica, per-microbatch cost (first 8 "
                  "steps) to this file");
  AddMemoryOptions(cmd, &args->memory, /*profile=*/false);
  cmd->callback([args, exit_code] { *exit_code = RunPlan(*args); });
}

}  // namespace thdpack::tools
