// Pieces of the cost profile shared by its two fits (profile.cc: the language model's a, b, c;
// encoder_profile.cc: the vision encoder's term). Not part of the public API.
#ifndef THDPACK_COST_PROFILE_INTERNAL_H_
#define THDPACK_COST_PROFILE_INTERNAL_H_

#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "thdpack/profile.h"

namespace thdpack::internal {

// The errors of predictions against measured seconds (each > 0): relative errors (max, p95,
// mean) and R^2 of the seconds. n = 0 for none.
FitErrors RelativeErrors(std::span<const double> predicted, std::span<const double> measured);

// OK when a timed row's seconds are finite and > 0; else InvalidArgument naming `where`.
Status CheckTimedSeconds(double seconds, const std::string& where);

// The errors as the profile's JSON writes them.
nlohmann::ordered_json ErrorsToJson(const FitErrors& errors);

}  // namespace thdpack::internal

#endif  // THDPACK_COST_PROFILE_INTERNAL_H_
