#include "run_figures.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

namespace thdpack::tools {
namespace {

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) {
    b /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

}  // namespace

Result<std::string> FormatStep(const RankStep& step, ScheduleOptions schedule,
                               const Topology& topo,
                               const std::optional<FlopsCoefficients>& flops,
                               const PhaseTable& phases, bool json, bool summary_only) {
  schedule.dp_size = topo.dp_size();
  schedule.cp_size = topo.cp_size();
  schedule.tp_size = topo.tp_size();
  THDPACK_ASSIGN_OR_RETURN(PlanFigures f, ComputePlanFigures(step.samples, schedule, step.plan));
  std::optional<double> step_flops;
  if (flops) step_flops = TrainingFlops(*flops, f.padded_tokens, static_cast<double>(f.sum_sq));
  double total_seconds = 0;
  for (double s : phases.seconds) total_seconds += s;
  if (json) {
    nlohmann::ordered_json j;
    j["step"] = step.step;
    j["epoch"] = step.epoch;
    j["num_microbatches"] = f.num_microbatches;
    j["n_samples"] = f.n_samples;
    j["n_skipped"] = f.n_skipped;
    j["real_tokens"] = f.real_tokens;
    j["padded_tokens"] = f.padded_tokens;
    j["sum_sq"] = f.sum_sq;
    j["n_loss_tokens"] = f.n_loss_tokens;
    j["imbalance"] = f.imbalance;
    j["pad_fraction"] = f.pad_fraction;
    j["fill"] = f.fill;
    j["flops"] = step_flops ? nlohmann::ordered_json(*step_flops) : nlohmann::ordered_json(nullptr);
    j["skipped"] = step.plan.skipped;
    if (!summary_only) {
      nlohmann::ordered_json reps = nlohmann::ordered_json::array();
      for (int d = 0; d < static_cast<int>(f.replicas.size()); ++d) {
        const ReplicaFigures& r = f.replicas[static_cast<size_t>(d)];
        nlohmann::ordered_json mbs = nlohmann::ordered_json::array();
        for (int m = 0; m < static_cast<int>(r.microbatches.size()); ++m) {
          const MicrobatchFigures& mf = r.microbatches[static_cast<size_t>(m)];
          auto ids = step.plan.Microbatch(d, m);
          mbs.push_back({{"samples", std::vector<int64_t>(ids.begin(), ids.end())},
                         {"real_tokens", mf.real_tokens},
                         {"padded_tokens", mf.padded_tokens},
                         {"cost", mf.cost}});
        }
        reps.push_back({{"cost", r.cost}, {"microbatches", std::move(mbs)}});
      }
      j["replicas"] = std::move(reps);
    }
    nlohmann::ordered_json bytes;
    std::vector<int64_t> total(phases.bytes.empty() ? 0 : phases.bytes[0].size(), 0);
    for (size_t k = 0; k < phases.names.size(); ++k) {
      bytes[phases.names[k]] = phases.bytes[k];
      for (size_t r = 0; r < total.size(); ++r) total[r] += phases.bytes[k][r];
    }
    bytes["total"] = total;
    j["bytes_sent"] = std::move(bytes);
    for (size_t k = 0; k < phases.names.size(); ++k) {
      j["time_" + phases.names[k]] = phases.seconds[k];
    }
    j["time_step"] = total_seconds;
    return j.dump() + "\n";
  }
  int64_t max_sent = 0;
  if (!phases.bytes.empty()) {
    for (size_t r = 0; r < phases.bytes[0].size(); ++r) {
      int64_t t = 0;
      for (const auto& b : phases.bytes) t += b[r];
      max_sent = std::max(max_sent, t);
    }
  }
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "step %lld (epoch %lld): %lld samples%s -> %d microbatches x %d replicas | "
                "tokens %lld real, %lld padded (pad %.1f%%, fill %.1f%%) | imbalance %.4f | "
                "sent %s max/rank | %.1f ms\n",
                static_cast<long long>(step.step), static_cast<long long>(step.epoch),
                static_cast<long long>(f.n_samples),
                f.n_skipped ? (", " + std::to_string(f.n_skipped) + " skipped").c_str() : "",
                f.num_microbatches, topo.dp_size(), static_cast<long long>(f.real_tokens),
                static_cast<long long>(f.padded_tokens), 100 * f.pad_fraction, 100 * f.fill,
                f.imbalance, HumanBytes(static_cast<double>(max_sent)).c_str(),
                1000 * total_seconds);
  return std::string(buf);
}

}  // namespace thdpack::tools
