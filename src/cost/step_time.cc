// The step-time model of thdpack/cost.h: hardware presets, t(P, c) and the dependency-graph
// simulation of a step's groups.
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/cost.h"

namespace thdpack {
namespace {

bool ParsePositive(std::string_view text, double* out) {
  const std::string s(text);
  if (s.empty()) return false;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v) || !(v > 0)) return false;
  *out = v;
  return true;
}

}  // namespace

Result<Hardware> ParseHardwareSpec(std::string_view spec) {
  if (spec == "h100-ib") return Hardware{400e12, 25e9, "h100-ib"};
  if (spec == "h100-nvlink") return Hardware{400e12, 200e9, "h100-nvlink"};
  const size_t comma = spec.find(',');
  Hardware hw;
  if (comma != std::string_view::npos && ParsePositive(spec.substr(0, comma), &hw.flops_per_second) &&
      ParsePositive(spec.substr(comma + 1), &hw.link_bytes_per_second)) {
    hw.name = std::string(spec);
    return hw;
  }
  return Status::InvalidArgument("hardware spec \"" + std::string(spec) +
                                 "\" is not one of: h100-ib, h100-nvlink, R,B (two positive "
                                 "numbers: achieved FLOP/s and CP link bytes/s per rank)");
}

Result<StepTimeModel> StepTimeModel::Create(const StepTimeCoefficients& k) {
  const std::pair<const char*, double> fields[] = {
      {"seconds per token", k.seconds_per_token},
      {"seconds per squared token", k.seconds_per_token_sq},
      {"seconds per sequence", k.seconds_per_sequence},
      {"seconds per microbatch", k.seconds_per_microbatch},
      {"K/V bytes per token", k.kv_bytes_per_token},
      {"link bytes per second", k.link_bytes_per_second},
      {"encoder seconds per patch", k.encoder.per_patch},
      {"encoder seconds per frame^2", k.encoder.per_frame_sq},
      {"FLOP/s", k.flops_per_second}};
  for (const auto& [what, v] : fields) {
    if (!std::isfinite(v) || v < 0) {
      return Status::InvalidArgument("step-time model \"" + k.name + "\": " + what + " = " +
                                     std::to_string(v) + " must be finite and >= 0");
    }
  }
  if (k.seconds_per_token == 0 && k.seconds_per_token_sq == 0 && k.seconds_per_sequence == 0) {
    return Status::InvalidArgument("step-time model \"" + k.name +
                                   "\": the compute coefficients are all 0");
  }
  if (k.kv_bytes_per_token > 0 && !(k.link_bytes_per_second > 0)) {
    return Status::InvalidArgument("step-time model \"" + k.name +
                                   "\": an exchange of K/V needs a link bandwidth > 0");
  }
  StepTimeModel m;
  m.k_ = k;
  return m;
}

Result<StepTimeModel> StepTimeModel::Create(const ModelDims& dims, const Hardware& hardware) {
  THDPACK_RETURN_IF_ERROR(ValidateModelDims(dims));
  if (!std::isfinite(hardware.flops_per_second) || !(hardware.flops_per_second > 0) ||
      !std::isfinite(hardware.link_bytes_per_second) || !(hardware.link_bytes_per_second > 0)) {
    return Status::InvalidArgument("hardware \"" + hardware.name +
                                   "\": R and B must be positive and finite");
  }
  THDPACK_ASSIGN_OR_RETURN(FlopsCoefficients coef, ComputeFlopsCoefficients(dims));
  StepTimeCoefficients k;
  k.seconds_per_token = static_cast<double>(coef.per_token) / hardware.flops_per_second;
  k.seconds_per_token_sq = static_cast<double>(coef.per_token_sq) / hardware.flops_per_second;
  k.kv_bytes_per_token = KvBytesPerToken(dims);
  k.link_bytes_per_second = hardware.link_bytes_per_second;
  k.name = "FLOPs at " + hardware.name;
  k.flops_per_second = hardware.flops_per_second;
  return Create(k);
}

std::optional<EncoderCost> EncoderTermSeconds(const CostModel& cost, const StepTimeModel& model,
                                              const EncoderCost& term) {
  if (cost.unit == "seconds") return term;
  const double r = model.coefficients().flops_per_second;
  if (cost.unit == "FLOPs" && r > 0) {
    return EncoderCost{term.per_patch / r, term.per_frame_sq / r};
  }
  return std::nullopt;
}

double KvBytesPerToken(const ModelDims& dims) {
  // 4*h*n_kv/n_h bytes a token a layer: K and V (2), bf16 (2 bytes), h*n_kv/n_h values each.
  return static_cast<double>(dims.layers) * 4.0 * static_cast<double>(dims.hidden) *
         static_cast<double>(dims.kv_heads) / static_cast<double>(dims.heads);
}

Result<double> SimulateStepTime(int domain_size, std::span<const GroupTask> tasks) {
  if (domain_size < 1) {
    return Status::InvalidArgument("SimulateStepTime: domain_size = " +
                                   std::to_string(domain_size) + " must be >= 1");
  }
  std::vector<double> free_at(static_cast<size_t>(domain_size), 0.0);
  for (size_t i = 0; i < tasks.size(); ++i) {
    const GroupTask& t = tasks[i];
    if (t.num_ranks < 1 || t.first_rank < 0 ||
        static_cast<int64_t>(t.first_rank) + t.num_ranks > domain_size ||
        !std::isfinite(t.seconds) || t.seconds < 0) {
      return Status::InvalidArgument(
          "SimulateStepTime: task " + std::to_string(i) + " (ranks " +
          std::to_string(t.first_rank) + " + " + std::to_string(t.num_ranks) + ", " +
          std::to_string(t.seconds) + " s) must lie in the domain of " +
          std::to_string(domain_size) + " ranks and take a finite time >= 0");
    }
    const auto first = free_at.begin() + t.first_rank;
    const auto last = first + t.num_ranks;
    const double end = *std::max_element(first, last) + t.seconds;
    std::fill(first, last, end);
  }
  return *std::max_element(free_at.begin(), free_at.end());
}

}  // namespace thdpack
