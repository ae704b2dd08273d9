#include "run_figures.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "memory_args.h"
#include "thdpack/figures.h"

namespace thdpack::tools {

Result<std::string> FormatStep(const RankStep& step, ScheduleOptions schedule,
                               const Topology& topo,
                               const std::optional<FlopsCoefficients>& flops,
                               const PhaseTable& phases, bool json, bool summary_only,
                               const std::optional<LossSummary>& loss,
                               const std::optional<MemoryReportOptions>& memory) {
  schedule.dp_size = topo.dp_size();
  // The figures `thdpack plan` prints for the same inputs (thdpack/figures.h).
  THDPACK_ASSIGN_OR_RETURN(StepFigures sf, ComputeStepFigures(step.step, step.epoch, step.samples,
                                                              schedule, step.plan, flops));
  const PlanFigures& f = sf.plan;
  std::optional<StepMemoryFigures> step_memory;
  if (memory) {
    THDPACK_ASSIGN_OR_RETURN(step_memory,
                             ComputeStepMemory(step.samples, schedule, step.plan, *memory));
  }
  double total_seconds = 0;
  for (double s : phases.seconds) total_seconds += s;
  if (json) {
    nlohmann::ordered_json bytes;
    std::vector<int64_t> total(phases.bytes.empty() ? 0 : phases.bytes[0].size(), 0);
    for (size_t k = 0; k < phases.names.size(); ++k) {
      bytes[phases.names[k]] = phases.bytes[k];
      for (size_t r = 0; r < total.size(); ++r) total[r] += phases.bytes[k][r];
    }
    bytes["total"] = total;
    JsonFields extra;
    // First, so that a step object up to here is plan's.
    if (step_memory) extra.emplace_back("memory", StepMemoryJson(*step_memory));
    if (loss) {
      extra.emplace_back("loss", nlohmann::json(loss->loss).dump());
      extra.emplace_back("ppl", loss->ppl ? nlohmann::json(*loss->ppl).dump() : "null");
      extra.emplace_back("entropy", nlohmann::json(loss->entropy).dump());
      // The probe's real-token count (n_loss_tokens is already a standard key: the probe checks
      // that the tokens it counted equal it).
      extra.emplace_back("n_tokens", nlohmann::json(loss->n_tokens).dump());
    }
    extra.emplace_back("bytes_sent", bytes.dump());
    for (size_t k = 0; k < phases.names.size(); ++k) {
      extra.emplace_back("time_" + phases.names[k], nlohmann::json(phases.seconds[k]).dump());
    }
    extra.emplace_back("time_step", nlohmann::json(total_seconds).dump());
    return StepFiguresJson(sf, summary_only, extra) + "\n";
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
                f.imbalance, FormatBytes(static_cast<double>(max_sent), false).c_str(),
                1000 * total_seconds);
  std::string line(buf);
  if (step_memory && step_memory->logits) {
    // "... | 215.9 ms\n" -> "... | 215.9 ms | logits/rank 18.55 GiB CP-local, 37.09 GiB gathered\n"
    line.pop_back();
    line += " | logits/rank " + BinaryBytes(step_memory->logits->bytes.local_total_bytes) +
            " CP-local, " + BinaryBytes(step_memory->logits->bytes.gathered_total_bytes) +
            " gathered\n";
  }
  if (loss) {
    // "... | 215.9 ms\n" -> "... | 215.9 ms | probe loss 4.6 ppl 101.2 entropy 4.5 (verified)\n"
    line.pop_back();
    char lb[160];
    std::snprintf(lb, sizeof lb, " | probe loss %.6f ppl %s entropy %.6f (verified)\n",
                  loss->loss, loss->ppl ? std::to_string(*loss->ppl).c_str() : "null",
                  loss->entropy);
    line += lb;
  }
  return line;
}

}  // namespace thdpack::tools
