#include "summary.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "formatting.h"

namespace thdpack::tools {
namespace {

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
  // A dynamic plan's figures hold the domain's ranks in place of replicas.
  std::printf("  buffers per rank   %s held by thdpack (step %lld, %s %d, %d microbatch%s)\n",
              BinaryBytes(b.buffers.total).c_str(), static_cast<long long>(steps[fullest].step),
              steps[fullest].dynamic ? "rank" : "replica", b.busiest_replica, b.num_microbatches,
              b.num_microbatches == 1 ? "" : "es");
}

void PrintSkipped(const std::vector<StepFigures>& steps) {
  for (const StepFigures& f : steps) {
    if (f.truncated.samples > 0) {
      std::printf("  step %lld truncated %lld oversize sample%s: %lld tokens, %lld targets cut\n",
                  static_cast<long long>(f.step), static_cast<long long>(f.truncated.samples),
                  f.truncated.samples == 1 ? "" : "s",
                  static_cast<long long>(f.truncated.tokens),
                  static_cast<long long>(f.truncated.targets));
    }
    if (f.split.samples > 0) {
      std::printf("  step %lld split %lld oversize sample%s into %lld pieces: %lld targets lost "
                  "at the cuts\n",
                  static_cast<long long>(f.step), static_cast<long long>(f.split.samples),
                  f.split.samples == 1 ? "" : "s", static_cast<long long>(f.split.pieces),
                  static_cast<long long>(f.split.lost_targets));
    }
    if (f.skipped.empty()) continue;
    std::printf("  step %lld skipped %zu oversize sample%s, ids:", static_cast<long long>(f.step),
                f.skipped.size(), f.skipped.size() == 1 ? "" : "s");
    for (size_t i = 0; i < f.skipped.size() && i < 20; ++i) {
      std::printf(" %lld", static_cast<long long>(f.skipped[i]));
    }
    std::printf("%s\n", f.skipped.size() > 20 ? " ..." : "");
  }
}

}  // namespace

std::string Seconds(const std::optional<double>& s) {
  if (!s.has_value()) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", *s);
  return buf;
}

std::string Flops(bool has, double flops) {
  if (!has) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3e", flops);
  return buf;
}

std::string CostNote(const CostModel& cost, const std::string& measured_on_device) {
  if (cost.measured()) {
    return "cost measured: " + cost.name +
           (measured_on_device.empty() ? "" : " (" + measured_on_device + ")") + ", seconds";
  }
  if (cost.unit == "FLOPs") return "cost from FLOPs (" + cost.name + "), not measured";
  if (cost.unit == "tokens") return "cost tokens, not measured";
  return "cost " + cost.name + " (given), not measured";
}

namespace {

void PrintMixture(const SummaryFigures& summary, const BlendConfig& blend) {
  std::vector<double> weights;
  for (const BlendEntry& e : blend.sources) weights.push_back(e.weight);
  const std::vector<double> w = NormalizeWeights(weights);
  auto share = [](int64_t part, int64_t whole) {
    return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
  };
  std::printf("  mixture            by %s: the weights, and what the steps took of each source\n",
              std::string(BlendWeightByName(blend.weight_by)).c_str());
  std::printf("    %-4s %-32s %8s %16s %20s %20s\n", "", "source", "weight", "samples",
              "real tokens", "loss tokens");
  for (size_t d = 0; d < blend.sources.size(); ++d) {
    const SourceFigures f = d < summary.sources.size() ? summary.sources[d] : SourceFigures{};
    std::string name = blend.sources[d].data;
    if (name.size() > 32) name = "..." + name.substr(name.size() - 29);
    std::printf("    [%zu]%s %-32s %7.2f%% %8s %6.2f%% %12s %6.2f%% %12s %6.2f%%\n", d,
                d < 10 ? " " : "", name.c_str(), 100 * w[d], Thousands(f.samples).c_str(),
                share(f.samples, summary.n_samples), Thousands(f.real_tokens).c_str(),
                share(f.real_tokens, summary.real_tokens), Thousands(f.loss_tokens).c_str(),
                share(f.loss_tokens, summary.n_loss_tokens));
  }
}

}  // namespace

void PrintSummaryBlock(const std::vector<StepFigures>& steps,
                       const std::vector<StepMemoryFigures>& memory,
                       const std::string& cost_note, const std::optional<BlendConfig>& blend,
                       int64_t global_batch_tokens) {
  const SummaryFigures summary = Summarize(steps);
  std::printf("\nsummary over %lld step%s (epochs %lld-%lld):\n",
              static_cast<long long>(summary.n_steps), summary.n_steps == 1 ? "" : "s",
              static_cast<long long>(summary.first_epoch),
              static_cast<long long>(summary.last_epoch));
  std::printf("  microbatches       %s (at most %s in a step)\n",
              Thousands(summary.num_microbatches).c_str(),
              Thousands(summary.max_num_microbatches).c_str());
  std::printf("  samples            %s scheduled, %s skipped%s\n",
              Thousands(summary.n_samples).c_str(), Thousands(summary.n_skipped).c_str(),
              summary.split.samples > 0
                  ? (", " + Thousands(summary.split.samples) + " split into " +
                     Thousands(summary.split.pieces) + " of them (" +
                     Thousands(summary.split.lost_targets) + " targets lost at the cuts)")
                        .c_str()
                  : "");
  std::printf("  tokens             %s real, %s padded, %s loss tokens\n",
              Thousands(summary.real_tokens).c_str(), Thousands(summary.padded_tokens).c_str(),
              Thousands(summary.n_loss_tokens).c_str());
  if (global_batch_tokens > 0 && !steps.empty()) {
    int64_t least = INT64_MAX;
    int64_t most = 0;
    int64_t over = 0;
    for (const StepFigures& f : steps) {
      least = std::min(least, f.plan.real_tokens);
      most = std::max(most, f.plan.real_tokens);
      over += f.plan.real_tokens > global_batch_tokens ? 1 : 0;
    }
    std::printf("  token batch        %s tokens: %s-%s real a step, %s step%s over it (a sample "
                "alone, or one a microbatch taken past it)\n",
                Thousands(global_batch_tokens).c_str(), Thousands(least).c_str(),
                Thousands(most).c_str(), Thousands(over).c_str(), over == 1 ? "" : "s");
  }
  std::printf("  imbalance          mean %.4f, max %.4f (1 = every replica at the lower bound; "
              "%s)\n",
              summary.mean_imbalance, summary.max_imbalance, cost_note.c_str());
  std::printf("  pad fraction       %.2f%%\n", 100 * summary.pad_fraction);
  std::printf("  fill               %.2f%% of M * DP * CP * max tokens per rank\n",
              100 * summary.fill);
  std::printf("  training FLOPs     %s\n", Flops(summary.has_flops, summary.flops).c_str());
  if (summary.has_sim_step_time) {
    std::printf("  modelled time      %s s over all steps (step-time model, --hw)\n",
                Seconds(summary.sim_step_time).c_str());
  } else {
    std::printf("  modelled time      - (no step-time model: pass a model --cost or "
                "profile:FILE)\n");
  }
  PrintMemorySummary(memory, steps);
  PrintSkipped(steps);
  if (blend) PrintMixture(summary, *blend);
}

void PrintDefaulted(const Job& job) {
  if (job.defaulted.empty()) return;
  const std::vector<JobEntry> entries = StepJobEntries(RunnerOptions(job), job.topology);
  std::vector<std::string> shown;
  int64_t others = 0;
  for (const std::string& name : job.defaulted) {
    const auto it = std::find_if(entries.begin(), entries.end(),
                                 [&](const JobEntry& e) { return e.first == name; });
    if (it == entries.end()) {
      ++others;
    } else {
      shown.push_back(name + " " + (it->second.empty() ? "\"\"" : it->second));
    }
  }
  shown.push_back(std::to_string(others) + " other option" + (others == 1 ? "" : "s"));
  // Wrapped under the label, a line at most 100 columns wide.
  const std::string indent(21, ' ');
  std::string line = "  defaulted          ";
  for (size_t k = 0; k < shown.size(); ++k) {
    const std::string item = shown[k] + (k + 1 < shown.size() ? ", " : "");
    if (line.size() > indent.size() && line.size() + item.size() > 100) {
      line.pop_back();  // the space after the comma
      std::printf("%s\n", line.c_str());
      line = indent;
    }
    line += item;
  }
  std::printf("%s\n", line.c_str());
}

}  // namespace thdpack::tools
