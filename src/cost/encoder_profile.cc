// The vision encoder's term of a cost profile (profile.h FitEncoderProfile): per_patch and
// per_frame_sq in seconds, fitted on timed encoder calls by non-negative least squares of the
// relative error, the language model's fit's method (profile.cc).
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cost/profile_internal.h"
#include "thdpack/profile.h"

namespace thdpack {
namespace {

double Predict(const EncoderCost& c, const TimedEncoderCall& r) {
  return EncoderTerm(c, static_cast<double>(r.patches), static_cast<double>(r.frame_sq));
}

FitErrors ErrorsOf(const EncoderCost& c, std::span<const TimedEncoderCall> rows, bool held_out) {
  std::vector<double> predicted, measured;
  for (const TimedEncoderCall& r : rows) {
    if (r.held_out != held_out) continue;
    predicted.push_back(Predict(c, r));
    measured.push_back(r.seconds);
  }
  return internal::RelativeErrors(predicted, measured);
}

}  // namespace

Result<EncoderProfile> FitEncoderProfile(std::span<const TimedEncoderCall> timed,
                                         std::string model) {
  int64_t fitted = 0;
  bool two_sizes = false;
  double first_ratio = 0;
  std::vector<double> rows, target;
  for (size_t i = 0; i < timed.size(); ++i) {
    const TimedEncoderCall& r = timed[i];
    const std::string where = "encoder timings: call " + std::to_string(i);
    THDPACK_RETURN_IF_ERROR(internal::CheckTimedSeconds(r.seconds, where));
    if (r.patches < 1 || r.frame_sq < r.patches) {
      return Status::InvalidArgument(
          where + ": " + std::to_string(r.patches) + " patches and frame^2 " +
          std::to_string(r.frame_sq) + ": patches must be >= 1 and frame^2 >= patches "
          "(sum t*(h*w)^2 >= sum t*h*w)");
    }
    if (r.held_out) continue;
    ++fitted;
    // The mean frame size of the call: frame_sq / patches; the two terms are apart only when
    // it varies.
    const double ratio = static_cast<double>(r.frame_sq) / static_cast<double>(r.patches);
    if (fitted == 1) {
      first_ratio = ratio;
    } else if (std::abs(ratio - first_ratio) > 1e-9 * first_ratio) {
      two_sizes = true;
    }
    rows.push_back(static_cast<double>(r.patches) / r.seconds);
    rows.push_back(static_cast<double>(r.frame_sq) / r.seconds);
    target.push_back(1.0);
  }
  if (fitted < 4) {
    return Status::InvalidArgument("encoder timings: " + std::to_string(fitted) +
                                   " calls to fit on; at least 4 are needed (the fit's error "
                                   "is measured on others)");
  }
  if (!two_sizes) {
    return Status::InvalidArgument(
        "encoder timings: every fitted call has frames of one size: the per-patch and the "
        "per-squared-frame terms cannot be told apart (time items of several frame sizes)");
  }
  THDPACK_ASSIGN_OR_RETURN(std::vector<double> x, NonNegativeLeastSquares(rows, 2, target));
  EncoderProfile p;
  p.cost = EncoderCost{x[0], x[1]};
  p.model = std::move(model);
  if (p.cost.empty()) {
    return Status::InvalidArgument("encoder timings: the fit gives both terms 0: the timings do "
                                   "not grow with the patches");
  }
  p.fit = ErrorsOf(p.cost, timed, false);
  p.held_out = ErrorsOf(p.cost, timed, true);
  return p;
}

}  // namespace thdpack
