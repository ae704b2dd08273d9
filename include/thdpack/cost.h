// thdpack/cost.h: the cost model and training FLOPs (docs/design.md section 3).
//
// cost(P) = a*P + b*P^2 for a sequence of padded length P (compute runs on padded tokens):
// b*P^2 is causal attention (half of the full square), a*P everything linear in tokens.
// A sequence sharded over CP ranks costs cost(P)/CP per rank.
//
// Training FLOPs of one step (forward + backward = 3x forward) of a dense decoder with l layers,
// hidden h, n_h query heads, n_kv key/value heads (head size h/n_h), gated feed-forward f (three
// matrices) and vocabulary V:
//   flops = 3 * ( 2*l*(h*h + 2*h*h*n_kv/n_h + h*h + 3*h*f) * sum P
//               + 2*h*V * sum P
//               + 2*l*h * sum P^2 )
// which is Megatron's num_floating_point_operations for this family (its attention term is
// 6*l*h*sum s^2). The cost model of a model is its FLOPs: a and b are the two coefficients.
//
// Thread-safety: plain values and pure functions.
#ifndef THDPACK_COST_H_
#define THDPACK_COST_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "thdpack/status.h"

namespace thdpack {

// Dimensions of a dense decoder.
struct ModelDims {
  int64_t layers = 0;       // l
  int64_t hidden = 0;       // h
  int64_t heads = 0;        // n_h
  int64_t kv_heads = 0;     // n_kv
  int64_t ffn_hidden = 0;   // f (gated: three matrices)
  int64_t vocab = 0;        // V
};

// Llama-2 7B: l=32, h=4096, n_h=n_kv=32, f=11008, V=32000.
inline constexpr ModelDims kLlama2_7B{32, 4096, 32, 32, 11008, 32000};
// Llama-3 8B: l=32, h=4096, n_h=32, n_kv=8, f=14336, V=128256.
inline constexpr ModelDims kLlama3_8B{32, 4096, 32, 8, 14336, 128256};

// REQUIRES (checked): all dims >= 1, h divisible by n_h, n_h divisible by n_kv.
[[nodiscard]] Status ValidateModelDims(const ModelDims& dims);

// Per-token (a) and per-squared-token (b) training FLOPs of a model; exact integers for every
// realistic model (checked against int64 overflow).
struct FlopsCoefficients {
  int64_t per_token = 0;      // 3 * (2*l*(h*h + 2*h*h*n_kv/n_h + h*h + 3*h*f) + 2*h*V)
  int64_t per_token_sq = 0;   // 3 * 2*l*h
};
[[nodiscard]] Result<FlopsCoefficients> ComputeFlopsCoefficients(const ModelDims& dims);

// ---- The encoder's term (images and video: thdpack/media.h, docs/media.md). ----
//
// A vision encoder's cost of an item of t frames of h x w patches:
//   per_patch * t*h*w + per_frame_sq * t * (h*w)^2
// its layers, linear in patches, and its attention, full within each frame. In the unit of the
// language model's cost (CostModel::unit): the schedulers add it to the sample's cost(P).
struct EncoderCost {
  double per_patch = 0;
  double per_frame_sq = 0;
  bool empty() const { return per_patch == 0 && per_frame_sq == 0; }
};

// The encoder term of `work` (of one sample or a group's sums).
inline double EncoderTerm(const EncoderCost& cost, double patches, double frame_sq) {
  return cost.per_patch * patches + cost.per_frame_sq * frame_sq;
}

// The cost model. Defaults to `tokens` (a=1, b=0): balance padded tokens. A measured profile
// (profile.h) adds c, a constant per sequence, and its unit is seconds.
struct CostModel {
  double a = 1.0;
  double b = 0.0;
  std::string name = "tokens";  // for reports: "tokens", "llama2-7b", "a,b", "profile:FILE", ...
  double c = 0.0;               // per sequence (0 but for measured profiles)
  // What a unit of cost is: "tokens" (the default), "FLOPs" (a model's training FLOPs), "seconds"
  // (a measured profile), "" (a hand-given "A,B").
  std::string unit = "tokens";
  // A measured profile's vision-encoder term, in its unit (profile.h EncoderProfile): the
  // encoder cost of images and video when none is given. Unset otherwise.
  std::optional<EncoderCost> encoder;

  // Whether the cost was measured on the hardware (a profile) rather than derived.
  bool measured() const { return unit == "seconds"; }

  // cost(P) for one padded sequence on one replica (not divided by CP).
  double SequenceCost(int64_t padded_length) const {
    const double p = static_cast<double>(padded_length);
    return a * p + b * p * p + c;
  }
  // Cost of `count` sequences given sum P and sum P^2.
  double Cost(int64_t count, int64_t sum_p, double sum_p_sq) const {
    return a * static_cast<double>(sum_p) + b * sum_p_sq + c * static_cast<double>(count);
  }
};

// The FLOPs model of `dims` as a cost model (a, b = its FLOPs coefficients).
[[nodiscard]] Result<CostModel> CostModelFromDims(const ModelDims& dims, std::string name = "");

// Parses a cost spec:
//   "tokens"                    a=1, b=0
//   "llama2-7b", "llama3-8b"    the presets above
//   "A,B"                       two non-negative numbers, a and b (not both zero)
//   "l=32,h=4096,nh=32,nkv=8,f=14336,v=128256"   any dimensions (all six keys)
//   "profile:FILE"              a measured cost profile (profile.h): a, b, c in seconds; the
//                               file is read and validated (errors name it and the field)
// Errors name the spec and what is wrong. ResolveCost (below) is what the jobs and the Python
// module call: it also gives the dimensions, FLOPs and the step-time model of a spec.
[[nodiscard]] Result<CostModel> ParseCostSpec(std::string_view spec);
// The dimensions behind a FLOPs-capable spec (a preset or dimensions), for FLOPs reporting;
// NotFound for "tokens" and "A,B".
[[nodiscard]] Result<ModelDims> ParseModelDims(std::string_view spec);

// Sums over the sequences described by a cu_seqlens array (n+1 offsets).
struct LengthSums {
  int64_t count = 0;   // n
  int64_t sum = 0;     // sum P
  int64_t sum_sq = 0;  // sum P^2
};
// REQUIRES (checked): starts at 0, non-decreasing; sum_sq must fit int64.
[[nodiscard]] Result<LengthSums> SumsFromCuSeqlens(std::span<const int32_t> cu_seqlens);

// Training FLOPs of a step (double: totals of whole epochs exceed 2^63).
double TrainingFlops(const FlopsCoefficients& coef, int64_t sum_p, double sum_p_sq);

// ---- The step-time model (docs/scheduling.md "The step-time model"). ----
//
// One yardstick for every scheduler. A sequence of padded length P on a CP group of c ranks
// costs each of those ranks
//   t(P, c) = max(C(P) / c, X(P, c)) seconds,
//   C(P)    = a*P + b*P^2 + s                           (compute of that sequence, seconds)
//   X(P, c) = 3 * (c-1)/c * P * kv_bytes / B            (ring exchange of K and V, forward plus
//                                                         backward; 0 for c = 1)
// and every group's microbatch costs m more (a constant per microbatch a rank takes part in).
// From model dimensions and hardware (the preset): a = F_token / R, b = F_token_sq / R, s = m
// = 0, with F the training FLOPs (FlopsCoefficients), R the achieved FLOP/s, kv_bytes =
// l * 4*h*n_kv/n_h (bf16 K and V over all layers) and B the CP link bandwidth (bytes/s) of one
// rank of the DP x CP domain (with TP > 1, a TP group counts as one rank). From a measured
// profile: a, b, s, m are the profile's (profile.h), kv_bytes its model's when it names one
// (else X = 0: the exchange is not modelled). A group's microbatch takes the sum over its
// sequences; SimulateStepTime turns the groups of a step into its time.

// The hardware of the model.
struct Hardware {
  double flops_per_second = 400e12;  // R, achieved, per rank of the domain
  double link_bytes_per_second = 25e9;  // B, CP link bandwidth per rank
  std::string name = "h100-ib";
};

// "h100-ib" (R = 400e12, B = 25e9, the default), "h100-nvlink" (R = 400e12, B = 200e9), or
// "R,B" (two positive finite numbers). Errors name the spec and the rule.
[[nodiscard]] Result<Hardware> ParseHardwareSpec(std::string_view spec);

// The coefficients of t(P, c), all in seconds (or bytes, bytes/s).
struct StepTimeCoefficients {
  double seconds_per_token = 0;        // a
  double seconds_per_token_sq = 0;     // b
  double seconds_per_sequence = 0;     // s
  double seconds_per_microbatch = 0;   // m
  double kv_bytes_per_token = 0;       // 0: the exchange is not modelled
  double link_bytes_per_second = 0;    // B (> 0 when kv_bytes_per_token > 0)
  std::string name;                    // for reports: "llama2-7b on h100-ib", "profile:FILE"
  // The vision encoder's term in seconds (per patch, per frame^2; docs/media.md): a sequence's
  // encoder work E(w) costs each rank of its group E(w) / c, beside t(P, c). Empty: none.
  EncoderCost encoder;
  // R of a model's preset (FLOP/s): what makes a term in training FLOPs seconds
  // (EncoderTermSeconds); 0 for a measured profile.
  double flops_per_second = 0;
};

// K and V bytes of one token over all layers in bf16: l * 4*h*n_kv/n_h (the exchange of CP).
double KvBytesPerToken(const ModelDims& dims);

class StepTimeModel {
 public:
  // REQUIRES (checked): every coefficient finite and >= 0, a, b and s not all 0, B > 0 when
  // kv_bytes_per_token > 0.
  [[nodiscard]] static Result<StepTimeModel> Create(const StepTimeCoefficients& coefficients);
  // The preset of a model on hardware: compute from training FLOPs at R, the exchange of its
  // K/V at B. REQUIRES (checked): valid dims (ValidateModelDims), R and B positive and finite.
  [[nodiscard]] static Result<StepTimeModel> Create(const ModelDims& dims,
                                                    const Hardware& hardware);

  const StepTimeCoefficients& coefficients() const { return k_; }

  // C(P): compute seconds of one sequence of padded length P on one rank.
  double SequenceCompute(int64_t padded_length) const {
    const double p = static_cast<double>(padded_length);
    return k_.seconds_per_token * p + k_.seconds_per_token_sq * p * p + k_.seconds_per_sequence;
  }
  // X(P, c) in seconds; 0 for c = 1 or without an exchange term. REQUIRES c >= 1.
  double ExchangeSeconds(int64_t padded_length, int64_t c) const {
    if (c <= 1 || k_.kv_bytes_per_token == 0) return 0.0;
    const double cd = static_cast<double>(c);
    return 3.0 * (cd - 1.0) / cd * static_cast<double>(padded_length) * k_.kv_bytes_per_token /
           k_.link_bytes_per_second;
  }
  // t(P, c) in seconds, per rank of the group (without the microbatch constant m).
  // REQUIRES c >= 1.
  double SequenceSeconds(int64_t padded_length, int64_t c) const {
    const double compute = SequenceCompute(padded_length) / static_cast<double>(c);
    return std::max(compute, ExchangeSeconds(padded_length, c));
  }
  // E(w): the encoder seconds of a sequence's media (sums of t*h*w and t*(h*w)^2 over its
  // items), on one rank; its group's ranks take E(w) / c each. 0 without an encoder term.
  double EncoderSeconds(double patches, double frame_sq) const {
    return EncoderTerm(k_.encoder, patches, frame_sq);
  }
  // The same model with the encoder term `seconds` (REQUIRES finite, >= 0).
  StepTimeModel WithEncoder(const EncoderCost& seconds) const {
    StepTimeModel m = *this;
    m.k_.encoder = seconds;
    return m;
  }
  // Whether t(P, c) is the exchange X(P, c) rather than the compute (never for c = 1).
  bool ExchangeBound(int64_t padded_length, int64_t c) const {
    if (c <= 1) return false;
    return SequenceCompute(padded_length) / static_cast<double>(c) <
           ExchangeSeconds(padded_length, c);
  }
  // A group's microbatch from integer sums: the count, sum P and sum P^2 of its compute-bound
  // sequences, sum P of its exchange-bound ones (ExchangeBound), plus m when it holds any. The
  // same value in whatever order the sums were taken, as C and X are linear in them.
  double GroupSeconds(int64_t c, int64_t compute_count, int64_t compute_sum_p,
                      double compute_sum_sq, int64_t exchange_count,
                      int64_t exchange_sum_p) const {
    const double cd = static_cast<double>(c);
    double t = (k_.seconds_per_token * static_cast<double>(compute_sum_p) +
                k_.seconds_per_token_sq * compute_sum_sq +
                k_.seconds_per_sequence * static_cast<double>(compute_count)) /
               cd;
    if (exchange_sum_p > 0) {
      t += 3.0 * (cd - 1.0) / cd * static_cast<double>(exchange_sum_p) * k_.kv_bytes_per_token /
           k_.link_bytes_per_second;
    }
    if (compute_count + exchange_count > 0) t += k_.seconds_per_microbatch;
    return t;
  }

 private:
  StepTimeCoefficients k_;
};

// The encoder's term `term`, given in the unit of `cost`, in seconds for `model`: a measured
// profile's (unit seconds) as it is, a model cost's training FLOPs at the model's R
// (StepTimeCoefficients::flops_per_second); nullopt where no conversion is known (a cost in
// tokens or "A,B", or a FLOPs cost beside a model without R).
std::optional<EncoderCost> EncoderTermSeconds(const CostModel& cost, const StepTimeModel& model,
                                              const EncoderCost& term);

// One group's microbatch in a step: ranks [first_rank, first_rank + num_ranks) of the domain
// together, for `seconds` (its slowest member's time).
struct GroupTask {
  int32_t first_rank = 0;
  int32_t num_ranks = 1;
  double seconds = 0;
};

// The step time of a dependency graph: tasks in microbatch order (the groups of microbatch 0,
// then of 1, ...; the groups of one microbatch are disjoint). A task starts when every one of
// its ranks has finished its previous task and ends `seconds` later; the step ends when every
// rank has. For a static plan (every replica one group in every microbatch) this is the
// largest replica's sum. Errors: domain_size < 1, a task outside [0, domain_size) or with
// num_ranks < 1, seconds negative or not finite (naming the task).
[[nodiscard]] Result<double> SimulateStepTime(int domain_size, std::span<const GroupTask> tasks);

}  // namespace thdpack

#endif  // THDPACK_COST_H_
