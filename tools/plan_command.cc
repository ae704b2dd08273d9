// thdpack plan: what a data set does to balance, padding, microbatch count and FLOPs at a given
// topology, step by step, without any GPU. The planning is the library's PlanJob
// (thdpack/job.h: StepReader, Schedule, StepFigures - the same figures and JSON that `thdpack
// run` prints - and each step's memory figures as the JSON field `memory`); this file parses
// options and prints the table, the summary, the JSON and the SVG chart.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "exit_code.h"
#include "formatting.h"
#include "job_args.h"
#include "summary.h"
#include "thdpack/figures.h"
#include "thdpack/job.h"
#include "thdpack/memory_report.h"

namespace thdpack::tools {
namespace {

struct PlanArgs {
  JobArgs job;
  bool json = false;
  bool summary_only = false;
  std::string svg;
};

// The figures of the steps drawn in the SVG (the first kMaxSvgSteps).
constexpr size_t kMaxSvgSteps = 8;

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

// "1:812 2:40 4:3": sequences per CP degree of a dynamic step.
std::string CpDegrees(const StepFigures& f) {
  std::string out;
  for (const auto& [c, count] : f.cp_degrees) {
    out += (out.empty() ? "" : " ") + std::to_string(c) + ":" + std::to_string(count);
  }
  return out;
}

constexpr const char* kPalette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                                    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
constexpr int kPaletteSize = 10;
// The chart's layout in pixels: margins, the height of a step's panel and the gap between.
constexpr double kLeft = 100, kRight = 200, kTop = 50, kPanelHeight = 260, kGap = 70;

// The y axis of a load panel: costs divided by `scale` are in `unit`, and `label` says what the
// cost is (measured or not).
struct AxisUnit {
  double scale = 1;
  std::string label;
};
AxisUnit AxisFor(const CostModel& cost, double ymax) {
  AxisUnit u;
  if (cost.measured()) {
    const bool ms = ymax < 1;
    u.scale = ms ? 1e-3 : 1;
    u.label = std::string("cost per rank, ") + (ms ? "ms" : "s") + " (measured)";
  } else if (cost.unit == "FLOPs") {
    static constexpr std::pair<double, const char*> kPrefixes[] = {
        {1e18, "EFLOP"}, {1e15, "PFLOP"}, {1e12, "TFLOP"}, {1e9, "GFLOP"}, {1, "FLOP"}};
    for (const auto& [scale, name] : kPrefixes) {
      if (ymax >= scale || scale == 1) {
        u.scale = scale;
        u.label = std::string("cost per rank, ") + name + " (from FLOPs, not measured)";
        break;
      }
    }
  } else if (cost.unit == "tokens") {
    u.label = "cost per rank, padded tokens";
  } else {
    u.label = "cost per rank (" + cost.name + ", not measured)";
  }
  return u;
}

// Panel k: one bar per replica, one <rect class="mb"> per (replica, microbatch) stacked
// bottom-up in microbatch order, height = the microbatch's per-rank cost; a dashed line at the
// lower bound; a y axis with ticks.
std::string DrawPanel(const StepFigures& f, size_t k, double plot_w, const CostModel& cost) {
  const double left = kLeft, top = kTop, panel_h = kPanelHeight, gap = kGap;
  std::string s;
  const PlanFigures& p = f.plan;
  const double y0 = top + k * (panel_h + gap) + 20;  // top of the plot area
  const double ymax = std::max(p.max_replica_cost, p.lower_bound) * 1.08;
  const AxisUnit unit = AxisFor(cost, ymax);
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
         Num(v / unit.scale) + "</text>\n";
  }
  s += "<text x=\"" + Num(left - 85) + "\" y=\"" + Num(y0 + panel_h / 2) +
       "\" transform=\"rotate(-90 " + Num(left - 85) + " " + Num(y0 + panel_h / 2) +
       ")\" text-anchor=\"middle\" font-size=\"11\">" + XmlEscape(unit.label) + "</text>\n";
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
                     Num(mb.cost / unit.scale) + " (" + unit.label + "); ids " + ids) +
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
  return s;
}

// Panel k of a dynamic plan: one row per microbatch (top to bottom), one column per rank of
// the domain, one <rect class="group"> per CP group spanning its ranks, coloured by its size,
// its tooltip listing its ranks and samples.
std::string DrawGroupsPanel(const StepFigures& f, size_t k, double plot_w) {
  const double left = kLeft, top = kTop, panel_h = kPanelHeight, gap = kGap;
  std::string s;
  const double y0 = top + k * (panel_h + gap) + 20;
  const int domain = static_cast<int>(f.plan.replicas.size());
  const int m_count = std::max(1, f.plan.num_microbatches);
  const double col = plot_w / std::max(1, domain);
  const double row = panel_h / m_count;
  char title[200];
  std::snprintf(title, sizeof title,
                "step %lld (epoch %lld): %d microbatches, modelled time %s s, CP degrees %s",
                static_cast<long long>(f.step), static_cast<long long>(f.epoch),
                f.plan.num_microbatches, Seconds(f.sim_step_time).c_str(), CpDegrees(f).c_str());
  s += "<g class=\"step\" data-step=\"" + std::to_string(f.step) + "\">\n";
  s += "<text x=\"" + Num(left) + "\" y=\"" + Num(y0 - 8) + "\" font-weight=\"bold\">" +
       XmlEscape(title) + "</text>\n";
  s += "<rect x=\"" + Num(left) + "\" y=\"" + Num(y0) + "\" width=\"" + Num(plot_w) +
       "\" height=\"" + Num(panel_h) + "\" fill=\"none\" stroke=\"black\"/>\n";
  s += "<text x=\"" + Num(left + plot_w / 2) + "\" y=\"" + Num(y0 + panel_h + 20) +
       "\" text-anchor=\"middle\">rank of the DP x CP domain</text>\n";
  s += "<text x=\"" + Num(left - 10) + "\" y=\"" + Num(y0 + 12) +
       "\" text-anchor=\"end\">microbatch 0</text>\n";
  for (size_t m = 0; m < f.groups.size(); ++m) {
    for (const CpGroup& g : f.groups[m]) {
      std::string ids;
      for (size_t i = 0; i < g.sample_ids.size() && i < 32; ++i) {
        ids += (i ? "," : "") + std::to_string(g.sample_ids[i]);
      }
      if (g.sample_ids.size() > 32) ids += ",...";
      s += "<rect class=\"group\" x=\"" + Num(left + g.first_rank * col) + "\" y=\"" +
           Num(y0 + m * row) + "\" width=\"" + Num(g.num_ranks * col) + "\" height=\"" +
           Num(row) + "\" fill=\"" + kPalette[(g.num_ranks - 1) % kPaletteSize] +
           "\" stroke=\"white\" stroke-width=\"0.5\"><title>" +
           XmlEscape("microbatch " + std::to_string(m) + ": ranks " +
                     std::to_string(g.first_rank) + "-" +
                     std::to_string(g.first_rank + g.num_ranks - 1) + " (CP " +
                     std::to_string(g.num_ranks) + "), " + std::to_string(g.sample_ids.size()) +
                     " samples; ids " + ids) +
           "</title></rect>\n";
    }
  }
  s += "</g>\n";
  return s;
}

// The legend of microbatch colours, right of the panels.
std::string DrawLegend(int max_m, double plot_w) {
  const double left = kLeft, top = kTop;
  std::string s;
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
  s += "</g>\n";
  return s;
}

// A stacked-bar chart per step (DrawPanel) and a legend of microbatch colours.
std::string DrawSvg(const std::vector<StepFigures>& steps, const JobOptions& args,
                    const CostModel& cost, const std::string& cost_note) {
  const size_t n_panels = std::min(steps.size(), kMaxSvgSteps);
  const double left = kLeft, right = kRight, top = kTop, panel_h = kPanelHeight, gap = kGap;
  const double plot_w = std::max(400.0, std::min(1600.0, 14.0 * args.dp));
  const std::string title =
      std::string(args.scheduler == "dynamic"
                      ? "thdpack plan: CP groups per microbatch (colour: group size), "
                      : "thdpack plan: per-replica load, ") +
      "DP=" + std::to_string(args.dp) + " CP=" + std::to_string(args.cp) + ", " + args.scheduler +
      " scheduler, " + cost_note;
  // Wide enough for the title (about 0.6 em a character at 15 px) and the panels' titles.
  const double text_w = std::max(0.6 * 15 * static_cast<double>(title.size()), 0.6 * 12 * 110.0);
  const double width = std::max(left + plot_w + right, left + text_w + 20);
  const double height = top + n_panels * (panel_h + gap) + 20;
  std::string s;
  s += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Num(width) + "\" height=\"" +
       Num(height) + "\" viewBox=\"0 0 " + Num(width) + " " + Num(height) +
       "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s += "<rect x=\"0\" y=\"0\" width=\"" + Num(width) + "\" height=\"" + Num(height) +
       "\" fill=\"white\"/>\n";
  s += "<text x=\"" + Num(left) + "\" y=\"24\" font-size=\"15\" font-weight=\"bold\">" +
       XmlEscape(title) + "</text>\n";
  int max_m = 1;
  for (size_t k = 0; k < n_panels; ++k) max_m = std::max(max_m, steps[k].plan.num_microbatches);
  const bool dynamic = n_panels > 0 && steps.front().dynamic;
  for (size_t k = 0; k < n_panels; ++k) {
    s += dynamic ? DrawGroupsPanel(steps[k], k, plot_w) : DrawPanel(steps[k], k, plot_w, cost);
  }
  if (!dynamic) s += DrawLegend(max_m, plot_w);
  s += "</svg>\n";
  return s;
}

void PrintTable(const std::vector<StepFigures>& steps) {
  const bool dynamic = !steps.empty() && steps.front().dynamic;
  std::printf("\n%6s %5s %5s %8s %7s %10s %8s %7s %14s %14s %11s %10s%s\n", "step", "epoch", "M",
              "samples", "skipped", "imbalance", "pad%", "fill%", "real tokens", "padded tokens",
              "FLOPs", "sim time s", dynamic ? "  CP degree:sequences" : "");
  for (const StepFigures& f : steps) {
    const PlanFigures& p = f.plan;
    std::printf("%6lld %5lld %5d %8lld %7lld %10.4f %8.2f %7.2f %14s %14s %11s %10s%s%s\n",
                static_cast<long long>(f.step), static_cast<long long>(f.epoch),
                p.num_microbatches, static_cast<long long>(p.n_samples),
                static_cast<long long>(p.n_skipped), p.imbalance, 100 * p.pad_fraction,
                100 * p.fill, Thousands(p.real_tokens).c_str(),
                Thousands(p.padded_tokens).c_str(), Flops(f.has_flops, f.flops).c_str(),
                Seconds(f.sim_step_time).c_str(), dynamic ? "  " : "", CpDegrees(f).c_str());
  }
}

// The device a profile was measured on ("" without one).
std::string Device(const Job& job) {
  return job.profile ? job.profile->measured_on.device : std::string();
}

void PrintReadable(const PlanArgs& args, const Job& job, const JobPlan& plan) {
  const JobOptions& o = job.options;
  const std::string rank_multiple =
      o.rank_multiple > 1 ? " rank multiple " + std::to_string(o.rank_multiple) : std::string();
  const std::string batch = o.global_batch_tokens > 0
                                ? std::to_string(o.global_batch_tokens) + " tokens"
                                : args.job.global_batch;
  std::printf("thdpack plan: data %s, DP=%d CP=%d TP=%d PP=%d%s%s, %lld max tokens per rank, "
              "global batch %s, %s scheduler, %s, hw %s\n",
              o.data.c_str(), o.dp, o.cp, o.tp, o.pp, o.sp ? " SP" : "", rank_multiple.c_str(),
              static_cast<long long>(o.max_tokens_per_rank), batch.c_str(),
              o.scheduler.c_str(), CostNote(job.schedule.cost, Device(job)).c_str(),
              o.hw.c_str());
  if (!args.summary_only) PrintTable(plan.steps);
  PrintSummaryBlock(plan.steps, plan.memory, CostNote(job.schedule.cost, Device(job)), job.blend,
                    o.global_batch_tokens);
  PrintDefaulted(job);
  if (!args.svg.empty()) std::printf("  chart              %s\n", args.svg.c_str());
}

// Plans the job, drawing the progress bar and keeping per-sample detail only where it is
// printed (--json without --summary-only) or drawn (the first kMaxSvgSteps steps).
Result<JobPlan> PlanWithProgress(const PlanArgs& args, const Job& job) {
  ProgressBar bar(job.steps);
  const bool keep_detail = args.json && !args.summary_only;
  int64_t done = 0;
  // Without --json detail or --svg, no sample id is printed: plan may use the bulk path.
  const bool sample_ids = keep_detail || !args.svg.empty();
  Result<JobPlan> plan = PlanJob(
      job,
      [&](PlannedStep& step) {
        if (!keep_detail && static_cast<size_t>(done) >= kMaxSvgSteps) {
          step.figures.sample_ids.clear();
          step.figures.plan.replicas.clear();
          step.figures.groups.clear();
        }
        bar.Update(++done);
        return Status::Ok();
      },
      sample_ids);
  if (!plan.ok()) bar.Clear();
  return plan;
}

int RunPlan(const PlanArgs& args) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "thdpack plan: %s\n", s.message().c_str());
    return ExitCodeOf(s);
  };
  Result<Job> job = ResolveJobArgs(args.job, "plan");
  if (!job.ok()) return fail(job.status());
  Result<JobPlan> plan = PlanWithProgress(args, *job);
  if (!plan.ok()) return fail(plan.status());
  if (!job->options.save_state.empty()) {
    const Status saved = WriteRunStateFile(job->options.save_state, plan->state);
    if (!saved.ok()) return fail(saved.WithContext("--save-state"));
  }
  if (!args.svg.empty()) {
    std::ofstream out(args.svg, std::ios::binary | std::ios::trunc);
    out << DrawSvg(plan->steps, job->options, job->schedule.cost,
                   CostNote(job->schedule.cost, Device(*job)));
    out.close();
    if (!out) return fail(Status::InvalidArgument("--svg: cannot write \"" + args.svg + "\""));
  }
  if (args.json) {
    std::cout << PlanJobJson(*plan, args.summary_only);
  } else {
    PrintReadable(args, *job, *plan);
  }
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
  AddJobOptions(cmd, &args->job);
  cmd->add_flag("--json", args->json,
                "Print {\"steps\":[...],\"summary\":{...}} (the schema `thdpack run` prints)");
  cmd->add_flag("--summary-only", args->summary_only,
                "Only totals: no per-step table; with --json, steps without replicas");
  cmd->add_option("--svg", args->svg,
                  "Write a stacked-bar chart of per-replica, per-microbatch cost (first 8 "
                  "steps) to this file");
  cmd->callback([args, exit_code] { *exit_code = RunPlan(*args); });
}

}  // namespace thdpack::tools
