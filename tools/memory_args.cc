#include "memory_args.h"

#include <algorithm>
#include <cstdio>

#include "thdpack/cost.h"
#include "thdpack/loss.h"

namespace thdpack::tools {

void AddMemoryOptions(CLI::App* cmd, MemoryArgs* args, bool profile) {
  cmd->add_option("--vocab-size", args->vocab_size,
                  "The model's vocabulary V for the logits memory figures (0: the --cost "
                  "model's V; none for tokens and A,B)")
      ->capture_default_str();
  cmd->add_option("--logits-dtype", args->logits_dtype,
                  "dtype of the logits in the memory figures: bf16, fp32 or fp64")
      ->capture_default_str();
  cmd->add_flag("--fused-grad", args->fused_grad,
                "Count the logits gradient fused with the loss (a second buffer of the logits' "
                "shape) in the memory figures");
  if (!profile) return;
  cmd->add_option("--memory-profile-steps", args->profile_steps,
                  "At these steps (comma-separated, e.g. 0,1) every rank writes its memory "
                  "figures to DIR/step_<N>/rank<R>_pp<p>_dp<d>_cp<c>_tp<t>.json");
  cmd->add_option("--memory-profile-dir", args->profile_dir,
                  "DIR of --memory-profile-steps")
      ->capture_default_str();
}

Result<MemoryReportOptions> ResolveMemoryOptions(const MemoryArgs& args,
                                                 std::string_view cost_spec) {
  MemoryReportOptions m;
  if (args.vocab_size < 0) {
    return Status::InvalidArgument("--vocab-size: " + std::to_string(args.vocab_size) +
                                   " must be >= 1, or 0 for the --cost model's vocabulary");
  }
  m.vocab_size = args.vocab_size;
  if (m.vocab_size == 0) {
    Result<ModelDims> dims = ParseModelDims(cost_spec);
    if (dims.ok()) {
      m.vocab_size = dims->vocab;
    } else if (dims.status().code() != StatusCode::kNotFound) {
      return dims.status().WithContext("--cost");
    }
  }
  Result<LogitsDtype> dtype = ParseLogitsDtype(args.logits_dtype);
  if (!dtype.ok()) return dtype.status().WithContext("--logits-dtype");
  m.logits_dtype = *dtype;
  m.with_grad = args.fused_grad;
  return m;
}

Result<std::vector<int64_t>> ParseProfileSteps(std::string_view text, int64_t steps) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  const std::string bad = "--memory-profile-steps: \"" + std::string(text) +
                          "\" is not a comma-separated list of step numbers (e.g. 0,1)";
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string_view item =
        text.substr(start, comma == std::string_view::npos ? std::string_view::npos
                                                           : comma - start);
    if (item.empty() || item.size() > 18 ||
        item.find_first_not_of("0123456789") != std::string_view::npos) {
      return Status::InvalidArgument(bad);
    }
    const int64_t step = std::stoll(std::string(item));
    if (step >= steps) {
      return Status::InvalidArgument("--memory-profile-steps: step " + std::to_string(step) +
                                     " is not run (--steps " + std::to_string(steps) +
                                     " runs steps 0 to " + std::to_string(steps - 1) + ")");
    }
    out.push_back(step);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string FormatBytes(double bytes, bool binary) {
  static const char* const kBinary[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  static const char* const kDecimal[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  const double base = binary ? 1024 : 1000;
  double v = bytes;
  int u = 0;
  while (v >= base && u < 5) {
    v /= base;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v,
                binary ? kBinary[u] : kDecimal[u]);
  return buf;
}

std::string BinaryBytes(int64_t bytes) { return FormatBytes(static_cast<double>(bytes), true); }

std::string_view ShortDtypeName(LogitsDtype dtype) {
  switch (dtype) {
    case LogitsDtype::kFloat32: return "fp32";
    case LogitsDtype::kBFloat16: return "bf16";
    case LogitsDtype::kFloat64: return "fp64";
  }
  return "invalid";
}

std::string LogitsLine(const LogitsFigures& logits) {
  std::string detail = "largest microbatch T=" + std::to_string(logits.total_tokens) +
                       ", V=" + std::to_string(logits.vocab_size);
  if (logits.tp_size > 1) {
    const int64_t columns = (logits.vocab_size + logits.tp_size - 1) / logits.tp_size;
    detail += " (" + std::to_string(columns) + " columns per TP rank)";
  }
  detail += ", " + std::string(ShortDtypeName(logits.dtype));
  if (logits.with_grad) detail += ", fused gradient included";
  return BinaryBytes(logits.bytes.gathered_total_bytes) + " gathered over CP, " +
         BinaryBytes(logits.bytes.local_total_bytes) + " CP-local (" + detail + ")";
}

}  // namespace thdpack::tools
