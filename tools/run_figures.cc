#include "run_figures.h"

#include <cstdio>

#include "formatting.h"

namespace thdpack::tools {

std::string StepLine(const RunStepReport& step) {
  const PlanFigures& f = step.figures.plan;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "step %lld (epoch %lld): %lld sample%s%s%s%s -> %d microbatch%s x %d replica%s | "
                "tokens %s real, %s padded (pad %.1f%%, fill %.1f%%) | imbalance %.4f | "
                "sent %s max/rank | %.1f ms\n",
                static_cast<long long>(step.figures.step),
                static_cast<long long>(step.figures.epoch), static_cast<long long>(f.n_samples),
                f.n_samples == 1 ? "" : "s",
                f.n_skipped ? (", " + std::to_string(f.n_skipped) + " skipped").c_str() : "",
                step.figures.truncated.samples
                    ? (", " + std::to_string(step.figures.truncated.samples) + " truncated (" +
                       std::to_string(step.figures.truncated.tokens) + " tokens, " +
                       std::to_string(step.figures.truncated.targets) + " targets cut)")
                          .c_str()
                    : "",
                step.figures.split.samples
                    ? (", " + std::to_string(step.figures.split.samples) + " split into " +
                       std::to_string(step.figures.split.pieces) + " pieces (" +
                       std::to_string(step.figures.split.lost_targets) + " targets lost)")
                          .c_str()
                    : "",
                f.num_microbatches, f.num_microbatches == 1 ? "" : "es", step.dp_size,
                step.dp_size == 1 ? "" : "s", Thousands(f.real_tokens).c_str(),
                Thousands(f.padded_tokens).c_str(), 100 * f.pad_fraction, 100 * f.fill,
                f.imbalance, BinaryBytes(step.phases.max_rank_bytes()).c_str(),
                1000 * step.phases.step_seconds);
  std::string line(buf);
  if (step.memory.logits) {
    // "... | 215.9 ms\n" -> "... | 215.9 ms | logits/rank 18.55 GiB CP-local, 37.09 GiB gathered\n"
    line.pop_back();
    line += " | logits/rank " + BinaryBytes(step.memory.logits->bytes.local_total_bytes) +
            " CP-local, " + BinaryBytes(step.memory.logits->bytes.gathered_total_bytes) +
            " gathered\n";
  }
  if (step.loss) {
    // "... | 215.9 ms\n" -> "... | 215.9 ms | probe loss 4.6 ppl 101.2 entropy 4.5 (verified)\n"
    line.pop_back();
    char lb[160];
    std::snprintf(lb, sizeof lb, " | probe loss %.6f ppl %s entropy %.6f (verified)\n",
                  step.loss->loss, step.loss->ppl ? std::to_string(*step.loss->ppl).c_str() : "null",
                  step.loss->entropy);
    line += lb;
  }
  return line;
}

}  // namespace thdpack::tools
