#include "thdpack/cost.h"
#include "thdpack/profile.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>

namespace thdpack {
namespace {

bool MulOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }
bool AddOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_add_overflow(a, b, out); }

// Parses a whole string as a finite double; false on any trailing text.
bool ParseDouble(std::string_view text, double* out) {
  std::string s(text);
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

bool ParseInt(std::string_view text, int64_t* out) {
  std::string s(text);
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

}  // namespace

Status ValidateModelDims(const ModelDims& d) {
  const std::pair<const char*, int64_t> fields[] = {{"layers", d.layers}, {"hidden", d.hidden},
                                                    {"heads", d.heads},   {"kv_heads", d.kv_heads},
                                                    {"ffn_hidden", d.ffn_hidden}, {"vocab", d.vocab}};
  for (const auto& [name, v] : fields) {
    if (v < 1) {
      return Status::InvalidArgument(std::string("model dims: ") + name + " = " +
                                     std::to_string(v) + " must be >= 1");
    }
    // Keeps every intermediate product below 2^63 before the checked arithmetic below.
    if (v > (int64_t{1} << 40)) {
      return Status::OutOfRange(std::string("model dims: ") + name + " = " + std::to_string(v) +
                                " exceeds 2^40");
    }
  }
  if (d.hidden % d.heads != 0) {
    return Status::InvalidArgument("model dims: hidden " + std::to_string(d.hidden) +
                                   " must be divisible by heads " + std::to_string(d.heads));
  }
  if (d.heads % d.kv_heads != 0) {
    return Status::InvalidArgument("model dims: heads " + std::to_string(d.heads) +
                                   " must be divisible by kv_heads " + std::to_string(d.kv_heads));
  }
  return Status::Ok();
}

Result<FlopsCoefficients> ComputeFlopsCoefficients(const ModelDims& d) {
  THDPACK_RETURN_IF_ERROR(ValidateModelDims(d));
  const Status overflow = Status::OutOfRange("model dims: FLOPs coefficients overflow int64");
  // 2*h*h*n_kv/n_h computed as 2*h*(h/n_h)*n_kv: exact, since h % n_h == 0.
  int64_t hh, kv, ffn, per_layer, layers_term, vocab_term, a, b;
  if (MulOverflows(d.hidden, d.hidden, &hh)) return overflow;
  if (MulOverflows(2 * d.hidden, (d.hidden / d.heads) * d.kv_heads, &kv)) return overflow;
  if (MulOverflows(3 * d.hidden, d.ffn_hidden, &ffn)) return overflow;
  per_layer = hh;
  if (AddOverflows(per_layer, kv, &per_layer) || AddOverflows(per_layer, hh, &per_layer) ||
      AddOverflows(per_layer, ffn, &per_layer)) {
    return overflow;
  }
  if (MulOverflows(2 * d.layers, per_layer, &layers_term)) return overflow;
  if (MulOverflows(2 * d.hidden, d.vocab, &vocab_term)) return overflow;
  if (AddOverflows(layers_term, vocab_term, &a) || MulOverflows(3, a, &a)) return overflow;
  if (MulOverflows(6 * d.layers, d.hidden, &b)) return overflow;
  return FlopsCoefficients{a, b};
}

Result<CostModel> CostModelFromDims(const ModelDims& dims, std::string name) {
  THDPACK_ASSIGN_OR_RETURN(FlopsCoefficients c, ComputeFlopsCoefficients(dims));
  CostModel m;
  m.a = static_cast<double>(c.per_token);
  m.b = static_cast<double>(c.per_token_sq);
  m.name = name.empty() ? "dims" : std::move(name);
  m.unit = "FLOPs";
  return m;
}

Result<ModelDims> ParseModelDims(std::string_view spec) {
  if (spec == "llama2-7b") return kLlama2_7B;
  if (spec == "llama3-8b") return kLlama3_8B;
  if (spec.find('=') == std::string_view::npos) {
    return Status::NotFound("cost spec \"" + std::string(spec) + "\" names no model dimensions");
  }
  std::map<std::string, int64_t> kv;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string_view::npos) end = spec.size();
    std::string_view item = spec.substr(pos, end - pos);
    const size_t eq = item.find('=');
    int64_t v = 0;
    if (eq == std::string_view::npos || !ParseInt(item.substr(eq + 1), &v)) {
      return Status::InvalidArgument("cost spec \"" + std::string(spec) + "\": item \"" +
                                     std::string(item) + "\" is not key=integer");
    }
    std::string key(item.substr(0, eq));
    if (key != "l" && key != "h" && key != "nh" && key != "nkv" && key != "f" && key != "v") {
      return Status::InvalidArgument("cost spec \"" + std::string(spec) + "\": unknown key \"" +
                                     key + "\" (keys: l, h, nh, nkv, f, v)");
    }
    if (!kv.emplace(key, v).second) {
      return Status::InvalidArgument("cost spec \"" + std::string(spec) + "\": key \"" + key +
                                     "\" given twice");
    }
    pos = end + 1;
  }
  for (const char* key : {"l", "h", "nh", "nkv", "f", "v"}) {
    if (!kv.count(key)) {
      return Status::InvalidArgument("cost spec \"" + std::string(spec) + "\": missing key \"" +
                                     key + "\" (needs l, h, nh, nkv, f, v)");
    }
  }
  ModelDims d{kv["l"], kv["h"], kv["nh"], kv["nkv"], kv["f"], kv["v"]};
  THDPACK_RETURN_IF_ERROR(ValidateModelDims(d).WithContext("cost spec \"" + std::string(spec) + "\""));
  return d;
}

Result<CostModel> ParseCostSpec(std::string_view spec) {
  if (spec == "tokens") return CostModel{};
  constexpr std::string_view kProfile = "profile:";
  if (spec.substr(0, kProfile.size()) == kProfile) {
    if (spec.size() == kProfile.size()) {
      return Status::InvalidArgument("cost spec \"profile:\" needs a file: profile:FILE");
    }
    THDPACK_ASSIGN_OR_RETURN(CostProfile profile,
                             ReadCostProfile(std::string(spec.substr(kProfile.size()))));
    return CostModelOfProfile(profile, std::string(spec));
  }
  auto dims = ParseModelDims(spec);
  if (dims.ok()) {
    const bool preset = spec.find('=') == std::string_view::npos;
    return CostModelFromDims(*dims, preset ? std::string(spec) : std::string("dims"));
  }
  if (dims.status().code() != StatusCode::kNotFound) return dims.status();
  const size_t comma = spec.find(',');
  double a = 0, b = 0;
  if (comma != std::string_view::npos && ParseDouble(spec.substr(0, comma), &a) &&
      ParseDouble(spec.substr(comma + 1), &b)) {
    if (a < 0 || b < 0 || (a == 0 && b == 0)) {
      return Status::InvalidArgument("cost spec \"" + std::string(spec) +
                                     "\": a and b must be >= 0 and not both 0");
    }
    return CostModel{a, b, std::string(spec), 0.0, "", std::nullopt};
  }
  return Status::InvalidArgument(
      "cost spec \"" + std::string(spec) +
      "\" is not one of: tokens, llama2-7b, llama3-8b, A,B (two numbers), "
      "l=..,h=..,nh=..,nkv=..,f=..,v=.. (model dimensions), profile:FILE (a measured profile)");
}

Result<LengthSums> SumsFromCuSeqlens(std::span<const int32_t> cu) {
  if (cu.empty()) return Status::InvalidArgument("cu_seqlens is empty: it needs at least [0]");
  if (cu[0] != 0) {
    return Status::InvalidArgument("cu_seqlens[0] = " + std::to_string(cu[0]) + ": must be 0");
  }
  LengthSums s;
  s.count = static_cast<int64_t>(cu.size()) - 1;
  for (size_t i = 1; i < cu.size(); ++i) {
    const int64_t p = int64_t{cu[i]} - cu[i - 1];
    if (p < 0) {
      return Status::InvalidArgument("cu_seqlens[" + std::to_string(i) + "] = " +
                                     std::to_string(cu[i]) + " is below cu_seqlens[" +
                                     std::to_string(i - 1) + "] = " + std::to_string(cu[i - 1]) +
                                     ": offsets must not decrease");
    }
    s.sum += p;
    if (AddOverflows(s.sum_sq, p * p, &s.sum_sq)) {
      return Status::OutOfRange("cu_seqlens: sum of squared lengths overflows int64");
    }
  }
  return s;
}

double TrainingFlops(const FlopsCoefficients& coef, int64_t sum_p, double sum_p_sq) {
  return static_cast<double>(coef.per_token) * static_cast<double>(sum_p) +
         static_cast<double>(coef.per_token_sq) * sum_p_sq;
}

}  // namespace thdpack
