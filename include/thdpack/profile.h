// thdpack/profile.h: measured cost profiles, and the one place a cost spec becomes a cost
// (docs/scheduling.md "Measured cost").
//
// A profile is the measured time of a packed microbatch on the user's hardware, as a cost of its
// sequences: a sequence of padded length P costs
//   cost(P) = a*P + b*P^2 + c   seconds
// (a per token, b per squared token: attention; c per sequence: its launch, tile padding and
// bookkeeping), fitted by non-negative least squares of the relative error on timed
// microbatches, with the fit's error reported on microbatches it was not fitted on. The fields
// a, b, c are always the best fit of that form. A refinement is kept beside them when it predicts
// the held-out microbatches better: `refined` adds m, a constant per microbatch (launches and
// the optimizer-free fixed cost of a forward and backward), fitted jointly with its own a, b, c;
// `use` says which one plans take. A constant per microbatch is the same on every replica of a
// static plan (each has M microbatches), so balance is the sequences' cost; m enters the
// modelled step time.
//
// File format (JSON; docs/scheduling.md has an example):
//   {"format": "thdpack-cost-profile", "version": 1, "a": .., "b": .., "c": ..,
//    "refined": {"a": .., "b": .., "c": .., "m": ..} or null, "use": "abc" | "refined",
//    "measured_on": {"model", "device", "dtype", "attention", "tp_size", "cp_size",
//                    "thdpack_version"},
//    "fit": {...report...}}
// ReadCostProfile validates it at the trust boundary: a foreign file, a missing field, a
// negative or non-finite coefficient is an error naming the file and the field.
//
// Thread-safety: plain values and pure functions (the file functions touch only their file).
#ifndef THDPACK_PROFILE_H_
#define THDPACK_PROFILE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/cost.h"
#include "thdpack/status.h"

namespace thdpack {

// One timed microbatch: its wall time and the padded lengths of its sequences.
struct TimedMicrobatch {
  double seconds = 0;
  std::vector<int64_t> lengths;
  bool held_out = false;  // not fitted on: the fit's error is reported on it
};

// What a profile was measured on (free text but the sizes; model, when it is a cost spec with
// dimensions - "llama2-7b" or "l=..,h=..,nh=..,nkv=..,f=..,v=.." - also gives the K/V bytes of
// the step-time model's CP exchange and the FLOPs of reports).
struct MeasuredOn {
  std::string model;
  std::string device;
  std::string dtype;
  std::string attention;
  int tp_size = 1;
  int cp_size = 1;
  std::string thdpack_version;
};

// Relative errors |predicted - measured| / measured over a set of microbatches.
struct FitErrors {
  int64_t n = 0;
  double r2 = 0;             // 1 - SSE / SST of the seconds (1 when SST is 0)
  double max_rel_error = 0;
  double p95_rel_error = 0;  // nearest-rank 95th percentile
  double mean_rel_error = 0;
};

// One form's coefficients and errors.
struct ProfileForm {
  double a = 0, b = 0, c = 0, m = 0;  // m: 0 in the three-coefficient form
  FitErrors fit;                       // on the microbatches it was fitted on
  FitErrors held_out;                  // on the others (n = 0 when there are none)
  // Seconds of a microbatch of these padded lengths.
  double Predict(std::span<const int64_t> lengths) const;
};

// ---- The vision encoder's term (images and video, docs/media.md). ----
//
// One timed call of a vision encoder, forward and backward, on items whose sums are `patches`
// (sum t*h*w) and `frame_sq` (sum t*(h*w)^2): cost.h's EncoderCost in seconds is fitted on them,
// per_patch * patches + per_frame_sq * frame_sq, by non-negative least squares of the relative
// error, as the language model's a, b, c.
struct TimedEncoderCall {
  double seconds = 0;
  int64_t patches = 0;
  int64_t frame_sq = 0;
  bool held_out = false;  // not fitted on: the fit's error is reported on it
};
// A profile's encoder term (JSON "encoder": {"per_patch", "per_frame_sq", "model", "fit":
// {"fit": errors, "held_out": errors}}; absent or null without one).
struct EncoderProfile {
  EncoderCost cost;   // seconds per patch, per squared frame
  std::string model;  // free text: the encoder measured ("qwen2-vl vision tower", ...)
  FitErrors fit;
  FitErrors held_out;
};
// Fits the encoder's term on `timed`: each call with seconds > 0 and finite, patches >= 1,
// frame_sq >= patches (t*(h*w)^2 >= t*h*w); at least 4 not held out, of more than one frame
// size (otherwise the two terms cannot be told apart: named). InvalidArgument naming the call
// and the rule.
[[nodiscard]] Result<EncoderProfile> FitEncoderProfile(std::span<const TimedEncoderCall> timed,
                                                       std::string model);

struct CostProfile {
  ProfileForm abc;                     // a, b, c: the fields every reader can use
  std::optional<ProfileForm> refined;  // with m, when it predicts the held-out ones better
  bool use_refined = false;
  MeasuredOn measured_on;
  // The microbatches of the report: every held-out one (measured and predicted by the form in
  // use), in the order given.
  std::vector<TimedMicrobatch> held_out;
  std::string source;  // the file read, for messages ("" when fitted here)
  // The vision encoder's term, measured beside the language model (FitEncoderProfile); the
  // cost model of the profile carries it (CostModel::encoder).
  std::optional<EncoderProfile> encoder;

  const ProfileForm& used() const { return use_refined ? *refined : abc; }
};

// Options of the fit.
struct FitOptions {
  // Try the refinement (a constant per microbatch) and keep it when its held-out errors are
  // lower (max and p95); off: the three-coefficient form only.
  bool refine = true;
};

// Fits a profile on `timed` (each with seconds > 0 and at least one length >= 1). The rows not
// held out are fitted on (at least 4, and they must vary enough to tell a, b and c apart: a
// degenerate set is an error naming what does not vary); the held-out rows are predicted and
// reported. REQUIRES nothing else (everything is checked, naming the row).
[[nodiscard]] Result<CostProfile> FitCostProfile(std::span<const TimedMicrobatch> timed,
                                                 const MeasuredOn& measured_on,
                                                 const FitOptions& options = {});

// The plain reference of the non-negative least squares under FitCostProfile: every subset of
// the columns solved by unconstrained least squares, the best feasible one kept. `rows` holds
// `columns` values a row; returns the coefficients minimising |rows * x - target| with x >= 0.
// Exposed for the test that compares it with the active-set solver FitCostProfile uses.
[[nodiscard]] Result<std::vector<double>> NonNegativeLeastSquaresReference(
    std::span<const double> rows, int columns, std::span<const double> target);
[[nodiscard]] Result<std::vector<double>> NonNegativeLeastSquares(std::span<const double> rows,
                                                                  int columns,
                                                                  std::span<const double> target);

// The cost model a profile gives plans: its form in use (a, b, c), in seconds, named `name`,
// with the profile's encoder term when it has one.
CostModel CostModelOfProfile(const CostProfile& profile, std::string name);

// The profile as its JSON text (the file format above; numbers round-trip exactly).
std::string CostProfileJson(const CostProfile& profile);
// Parses and validates a profile's JSON text; `source` names it in errors.
[[nodiscard]] Result<CostProfile> ParseCostProfile(std::string_view json, std::string_view source);
// Reads and validates a profile file (IOError naming it when it cannot be read).
[[nodiscard]] Result<CostProfile> ReadCostProfile(const std::string& path);
[[nodiscard]] Status WriteCostProfile(const CostProfile& profile, const std::string& path);

// Timings measured elsewhere, as CSV: the header `seconds,lengths`, then one row per microbatch,
// its lengths separated by spaces (`0.0405,256 256 1024`). Every `hold_out_every`-th row (4th,
// 8th, ...) is held out (0: none). Errors name the file, the line and the rule.
[[nodiscard]] Result<std::vector<TimedMicrobatch>> ReadTimingsCsv(const std::string& path,
                                                                  int hold_out_every = 4);

// A short text of a microbatch's lengths for reports: runs of equal lengths as LxN, in order
// ("256x64", "8192", "4096 256x16").
std::string DescribeLengths(std::span<const int64_t> lengths);

// ---- The one place a cost spec becomes a cost. ----

// What a cost spec and a hardware spec resolve to.
struct ResolvedCost {
  CostModel cost;                          // what the schedulers balance
  std::optional<ModelDims> dims;           // a model's (FLOPs, memory, the CP exchange)
  std::optional<FlopsCoefficients> flops;  // with dims
  std::optional<StepTimeModel> step_time;  // a model cost on `hardware`, or a profile
  std::optional<CostProfile> profile;      // with "profile:FILE"
  Hardware hardware;
};

// The names errors give the two specs ("--cost" and "--hw" on the command line, "cost" and
// "hw" from Python).
struct CostSpecNames {
  std::string cost = "cost";
  std::string hw = "hw";
};

// Resolves a cost spec (ParseCostSpec's forms) and a hardware spec (ParseHardwareSpec's; checked
// even when unused, so that a typo is not silent). A model cost gives its dimensions, FLOPs and
// the FLOPs step-time model on the hardware; "profile:FILE" gives the profile's form in use as
// the cost (unit seconds), its step-time model (compute from the profile; the exchange from the
// model it names, if any, at the hardware's link bandwidth) and, when its model names
// dimensions, those and their FLOPs. Errors begin with the name of the spec at fault.
[[nodiscard]] Result<ResolvedCost> ResolveCost(std::string_view cost_spec,
                                               std::string_view hw_spec,
                                               const CostSpecNames& names = {});

}  // namespace thdpack

#endif  // THDPACK_PROFILE_H_
