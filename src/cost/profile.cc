// Measured cost profiles (thdpack/profile.h): the fit, its report, the file, the timings CSV,
// and the one resolution of a cost spec.
#include "thdpack/profile.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <utility>

#include "cost/profile_internal.h"
#include "thdpack/version.h"

namespace thdpack {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kFormat = "thdpack-cost-profile";
constexpr int kFormatVersion = 1;
constexpr int64_t kMaxLength = std::numeric_limits<int32_t>::max();  // a sample's length

std::string Num(double v) {
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

// ---- Dense least squares on a few columns (Householder QR). ----

// Solves min |A x - y| for the columns `cols` of the row-major m x k matrix A (the others are
// 0 in x). Returns false when those columns are rank deficient (a pivot below 1e-10 of the
// largest column norm after scaling each column to unit norm).
bool SolveLeastSquares(std::span<const double> a, int k, std::span<const double> y,
                       const std::vector<int>& cols, std::vector<double>* x,
                       int* deficient_column = nullptr) {
  const size_t m = y.size();
  const size_t n = cols.size();
  x->assign(static_cast<size_t>(k), 0.0);
  if (n == 0) return true;
  if (m < n) {
    if (deficient_column) *deficient_column = cols[m];
    return false;
  }
  // Column-major copy of the chosen columns, each scaled to unit norm.
  std::vector<double> q(m * n);
  std::vector<double> scale(n, 1.0);
  for (size_t j = 0; j < n; ++j) {
    double norm = 0;
    for (size_t i = 0; i < m; ++i) {
      const double v = a[i * static_cast<size_t>(k) + static_cast<size_t>(cols[j])];
      q[j * m + i] = v;
      norm += v * v;
    }
    norm = std::sqrt(norm);
    if (!(norm > 0)) {
      if (deficient_column) *deficient_column = cols[j];
      return false;
    }
    scale[j] = norm;
    for (size_t i = 0; i < m; ++i) q[j * m + i] /= norm;
  }
  std::vector<double> b(y.begin(), y.end());
  std::vector<double> diag(n);
  for (size_t j = 0; j < n; ++j) {
    // Householder reflection of column j below the diagonal.
    double norm = 0;
    for (size_t i = j; i < m; ++i) norm += q[j * m + i] * q[j * m + i];
    norm = std::sqrt(norm);
    if (norm < 1e-10) {
      if (deficient_column) *deficient_column = cols[j];
      return false;
    }
    const double alpha = q[j * m + j] > 0 ? -norm : norm;
    std::vector<double> v(m - j);
    for (size_t i = j; i < m; ++i) v[i - j] = q[j * m + i];
    v[0] -= alpha;
    double vv = 0;
    for (double e : v) vv += e * e;
    diag[j] = alpha;
    if (vv > 0) {
      for (size_t c = j; c < n; ++c) {
        double d = 0;
        for (size_t i = j; i < m; ++i) d += v[i - j] * q[c * m + i];
        d = 2 * d / vv;
        for (size_t i = j; i < m; ++i) q[c * m + i] -= d * v[i - j];
      }
      double d = 0;
      for (size_t i = j; i < m; ++i) d += v[i - j] * b[i];
      d = 2 * d / vv;
      for (size_t i = j; i < m; ++i) b[i] -= d * v[i - j];
    }
  }
  // Back substitution on R (diagonal in `diag`, above it in q).
  std::vector<double> z(n);
  for (size_t jj = n; jj-- > 0;) {
    double s = b[jj];
    for (size_t c = jj + 1; c < n; ++c) s -= q[c * m + jj] * z[c];
    z[jj] = s / diag[jj];
  }
  for (size_t j = 0; j < n; ++j) (*x)[static_cast<size_t>(cols[j])] = z[j] / scale[j];
  return true;
}

double Residual(std::span<const double> a, int k, std::span<const double> y,
                const std::vector<double>& x) {
  double r = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    double p = 0;
    for (int j = 0; j < k; ++j) p += a[i * static_cast<size_t>(k) + static_cast<size_t>(j)] * x[j];
    r += (p - y[i]) * (p - y[i]);
  }
  return r;
}

Status CheckProblem(std::span<const double> rows, int columns, std::span<const double> target) {
  if (columns < 1 || columns > 16 ||
      rows.size() != target.size() * static_cast<size_t>(columns)) {
    return Status::InvalidArgument("least squares: " + std::to_string(rows.size()) +
                                   " values for " + std::to_string(target.size()) + " rows of " +
                                   std::to_string(columns) + " columns (1 to 16)");
  }
  for (double v : rows) {
    if (!std::isfinite(v)) return Status::InvalidArgument("least squares: a value is not finite");
  }
  for (double v : target) {
    if (!std::isfinite(v)) return Status::InvalidArgument("least squares: a target is not finite");
  }
  return Status::Ok();
}

// ---- The fit. ----

// The columns of a microbatch: sum P, sum P^2, its sequence count, 1.
constexpr int kColumns = 4;
void Features(std::span<const int64_t> lengths, double out[kColumns]) {
  double sum = 0, sq = 0;
  for (int64_t p : lengths) {
    const double d = static_cast<double>(p);
    sum += d;
    sq += d * d;
  }
  out[0] = sum;
  out[1] = sq;
  out[2] = static_cast<double>(lengths.size());
  out[3] = 1.0;
}

FitErrors ErrorsOf(const ProfileForm& form, std::span<const TimedMicrobatch> rows, bool held_out) {
  std::vector<double> predicted, measured;
  for (const TimedMicrobatch& r : rows) {
    if (r.held_out != held_out) continue;
    predicted.push_back(form.Predict(r.lengths));
    measured.push_back(r.seconds);
  }
  return internal::RelativeErrors(predicted, measured);
}

const char* kColumnWhat[kColumns] = {"the tokens (a)", "the squared tokens (b)",
                                     "the sequence count (c)", "the microbatch constant (m)"};

// Fits `columns` (3: a, b, c; 4: with m) on the rows not held out, relative errors.
Result<ProfileForm> FitForm(std::span<const TimedMicrobatch> timed, int columns) {
  std::vector<double> a, y;
  for (const TimedMicrobatch& r : timed) {
    if (r.held_out) continue;
    double f[kColumns];
    Features(r.lengths, f);
    for (int j = 0; j < columns; ++j) a.push_back(f[j] / r.seconds);
    y.push_back(1.0);
  }
  // The unconstrained problem must be full rank: otherwise the data cannot tell a column apart.
  std::vector<int> all(static_cast<size_t>(columns));
  std::iota(all.begin(), all.end(), 0);
  std::vector<double> x;
  int deficient = -1;
  if (!SolveLeastSquares(a, columns, y, all, &x, &deficient)) {
    return Status::InvalidArgument(
        "timings: the fitted microbatches do not vary enough to tell " +
        std::string(kColumnWhat[std::max(deficient, 0)]) +
        " from the others: time packs of different total tokens and sequence counts (all "
        "short, one long, mixed, at two or more totals)");
  }
  THDPACK_ASSIGN_OR_RETURN(std::vector<double> coef, NonNegativeLeastSquares(a, columns, y));
  ProfileForm form;
  form.a = coef[0];
  form.b = coef[1];
  form.c = coef[2];
  form.m = columns > 3 ? coef[3] : 0.0;
  if (form.a == 0 && form.b == 0 && form.c == 0) {
    return Status::InvalidArgument("timings: the fit gives a, b and c all 0: the timings do not "
                                   "grow with the tokens or the sequences");
  }
  form.fit = ErrorsOf(form, timed, false);
  form.held_out = ErrorsOf(form, timed, true);
  return form;
}

// ---- JSON. ----

Json ErrorsJson(const FitErrors& e) { return internal::ErrorsToJson(e); }

Json FormJson(const ProfileForm& f, bool with_m) {
  Json j{{"a", f.a}, {"b", f.b}, {"c", f.c}};
  if (with_m) j["m"] = f.m;
  return j;
}

// Reads field `key` of `obj` as a finite number >= 0.
Result<double> Coefficient(const Json& obj, const char* key, const std::string& where) {
  if (!obj.contains(key)) return Status::InvalidArgument(where + ": missing field \"" + key + "\"");
  const Json& v = obj.at(key);
  if (!v.is_number()) {
    return Status::InvalidArgument(where + ": field \"" + key + "\" is " + v.type_name() +
                                   ", expected a number");
  }
  const double d = v.get<double>();
  if (!std::isfinite(d) || d < 0) {
    return Status::InvalidArgument(where + ": field \"" + key + "\" = " + Num(d) +
                                   " must be finite and >= 0");
  }
  return d;
}

Status ReadErrors(const Json& obj, FitErrors* e) {
  if (!obj.is_object()) return Status::Ok();
  auto num = [&](const char* k, double* out) {
    if (obj.contains(k) && obj.at(k).is_number()) *out = obj.at(k).get<double>();
  };
  if (obj.contains("n") && obj.at("n").is_number_integer()) e->n = obj.at("n").get<int64_t>();
  num("r2", &e->r2);
  num("max_rel_error", &e->max_rel_error);
  num("p95_rel_error", &e->p95_rel_error);
  num("mean_rel_error", &e->mean_rel_error);
  return Status::Ok();
}

bool ParseInt64(std::string_view text, int64_t* out) {
  if (text.empty() || text.size() > 19) return false;
  int64_t v = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return false;
    v = v * 10 + (ch - '0');
  }
  *out = v;
  return true;
}

// DescribeLengths' text back: "4096 256x2 7" -> 4096, 256, 256, 7.
Result<std::vector<int64_t>> ParseDescribedLengths(const std::string& text,
                                                   const std::string& where) {
  std::vector<int64_t> out;
  std::istringstream in(text);
  std::string item;
  while (in >> item) {
    const size_t x = item.find('x');
    int64_t length = 0, count = 1;
    if (!ParseInt64(item.substr(0, x), &length) ||
        (x != std::string::npos && !ParseInt64(item.substr(x + 1), &count)) || length < 1 ||
        length > kMaxLength || count < 1 || count > (1 << 24)) {
      return Status::InvalidArgument(where + ": lengths \"" + text + "\": \"" + item +
                                     "\" is not L or LxN");
    }
    out.insert(out.end(), static_cast<size_t>(count), length);
  }
  if (out.empty()) return Status::InvalidArgument(where + ": lengths is empty");
  return out;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

}  // namespace

namespace internal {

FitErrors RelativeErrors(std::span<const double> predicted, std::span<const double> measured) {
  FitErrors e;
  std::vector<double> rel;
  double sse = 0, sum = 0;
  for (size_t i = 0; i < measured.size(); ++i) {
    const double p = predicted[i], s = measured[i];
    rel.push_back(std::abs(p - s) / s);
    sse += (p - s) * (p - s);
    sum += s;
  }
  e.n = static_cast<int64_t>(rel.size());
  if (rel.empty()) return e;
  const double mean = sum / static_cast<double>(measured.size());
  double sst = 0;
  for (double s : measured) sst += (s - mean) * (s - mean);
  e.r2 = sst > 0 ? 1.0 - sse / sst : (sse == 0 ? 1.0 : 0.0);
  std::sort(rel.begin(), rel.end());
  e.max_rel_error = rel.back();
  const size_t rank = static_cast<size_t>(std::ceil(0.95 * static_cast<double>(rel.size())));
  e.p95_rel_error = rel[std::max<size_t>(rank, 1) - 1];
  e.mean_rel_error = std::accumulate(rel.begin(), rel.end(), 0.0) / static_cast<double>(rel.size());
  return e;
}

Status CheckTimedSeconds(double seconds, const std::string& where) {
  if (std::isfinite(seconds) && seconds > 0) return Status::Ok();
  return Status::InvalidArgument(where + ": seconds = " + Num(seconds) +
                                 " must be finite and > 0");
}

Json ErrorsToJson(const FitErrors& e) {
  return Json{{"n", e.n},
              {"r2", e.r2},
              {"max_rel_error", e.max_rel_error},
              {"p95_rel_error", e.p95_rel_error},
              {"mean_rel_error", e.mean_rel_error}};
}

}  // namespace internal

double ProfileForm::Predict(std::span<const int64_t> lengths) const {
  double f[kColumns];
  Features(lengths, f);
  return a * f[0] + b * f[1] + c * f[2] + m;
}

Result<std::vector<double>> NonNegativeLeastSquaresReference(std::span<const double> rows,
                                                             int columns,
                                                             std::span<const double> target) {
  THDPACK_RETURN_IF_ERROR(CheckProblem(rows, columns, target));
  std::vector<double> best(static_cast<size_t>(columns), 0.0);
  double best_r = Residual(rows, columns, target, best);
  for (uint32_t subset = 1; subset < (1u << columns); ++subset) {
    std::vector<int> cols;
    for (int j = 0; j < columns; ++j) {
      if (subset & (1u << j)) cols.push_back(j);
    }
    std::vector<double> x;
    if (!SolveLeastSquares(rows, columns, target, cols, &x)) continue;
    if (std::any_of(x.begin(), x.end(), [](double v) { return v < 0; })) continue;
    const double r = Residual(rows, columns, target, x);
    if (r < best_r) {
      best_r = r;
      best = x;
    }
  }
  return best;
}

Result<std::vector<double>> NonNegativeLeastSquares(std::span<const double> rows, int columns,
                                                    std::span<const double> target) {
  THDPACK_RETURN_IF_ERROR(CheckProblem(rows, columns, target));
  // Lawson and Hanson's active set: columns move into the passive set P by the largest
  // gradient, and back out when the unconstrained solution on P would go negative.
  const size_t k = static_cast<size_t>(columns);
  std::vector<double> x(k, 0.0);
  std::vector<bool> passive(k, false);
  double scale = 0;
  for (double v : target) scale = std::max(scale, std::abs(v));
  for (int iteration = 0; iteration < 10 * columns + 10; ++iteration) {
    // w = A^T (y - A x), the negative gradient.
    std::vector<double> w(k, 0.0);
    for (size_t i = 0; i < target.size(); ++i) {
      double r = target[i];
      for (size_t j = 0; j < k; ++j) r -= rows[i * k + j] * x[j];
      for (size_t j = 0; j < k; ++j) w[j] += rows[i * k + j] * r;
    }
    int t = -1;
    double most = 0;
    for (size_t j = 0; j < k; ++j) {
      double norm = 0;
      for (size_t i = 0; i < target.size(); ++i) norm += rows[i * k + j] * rows[i * k + j];
      // Relative to the column's size, so that a tiny gradient of rounding does not enter.
      const double tol = 1e-12 * std::sqrt(norm) * (scale > 0 ? scale : 1) *
                         std::sqrt(static_cast<double>(target.size()));
      if (!passive[j] && w[j] > tol && w[j] > most) {
        most = w[j];
        t = static_cast<int>(j);
      }
    }
    if (t < 0) return x;
    passive[static_cast<size_t>(t)] = true;
    for (int inner = 0; inner < 10 * columns + 10; ++inner) {
      std::vector<int> cols;
      for (size_t j = 0; j < k; ++j) {
        if (passive[j]) cols.push_back(static_cast<int>(j));
      }
      std::vector<double> z;
      if (!SolveLeastSquares(rows, columns, target, cols, &z)) {
        // A dependent column: drop the one just added and stop (x is optimal on the rest).
        passive[static_cast<size_t>(t)] = false;
        return x;
      }
      bool feasible = true;
      for (int j : cols) feasible = feasible && z[static_cast<size_t>(j)] > 0;
      if (feasible) {
        x = z;
        break;
      }
      double alpha = 1.0;
      for (int j : cols) {
        const size_t u = static_cast<size_t>(j);
        if (z[u] <= 0) alpha = std::min(alpha, x[u] / (x[u] - z[u]));
      }
      for (size_t j = 0; j < k; ++j) {
        x[j] += alpha * (z[j] - x[j]);
        if (passive[j] && x[j] <= 1e-15 * std::max(1.0, std::abs(z[j]))) {
          passive[j] = false;
          x[j] = 0;
        }
      }
    }
  }
  return x;
}

Result<CostProfile> FitCostProfile(std::span<const TimedMicrobatch> timed,
                                   const MeasuredOn& measured_on, const FitOptions& options) {
  int64_t fitted = 0;
  for (size_t i = 0; i < timed.size(); ++i) {
    const TimedMicrobatch& r = timed[i];
    const std::string where = "timings: microbatch " + std::to_string(i);
    THDPACK_RETURN_IF_ERROR(internal::CheckTimedSeconds(r.seconds, where));
    if (r.lengths.empty()) return Status::InvalidArgument(where + ": has no sequence");
    for (int64_t p : r.lengths) {
      if (p < 1 || p > kMaxLength) {
        return Status::InvalidArgument(where + ": a length of " + std::to_string(p) +
                                       ": lengths must lie in [1, 2^31)");
      }
    }
    if (!r.held_out) ++fitted;
  }
  if (fitted < 4) {
    return Status::InvalidArgument("timings: " + std::to_string(fitted) +
                                   " microbatches to fit on; at least 4 are needed (and more: "
                                   "the fit has 3 coefficients, and its error is measured on "
                                   "others)");
  }
  CostProfile p;
  THDPACK_ASSIGN_OR_RETURN(p.abc, FitForm(timed, 3));
  p.measured_on = measured_on;
  if (p.measured_on.thdpack_version.empty()) p.measured_on.thdpack_version = kVersion;
  const bool judged = p.abc.held_out.n > 0;
  if (options.refine && judged && fitted >= 5) {
    Result<ProfileForm> refined = FitForm(timed, 4);
    if (refined.ok() && refined->m > 0 &&
        refined->held_out.max_rel_error < p.abc.held_out.max_rel_error &&
        refined->held_out.p95_rel_error <= p.abc.held_out.p95_rel_error) {
      p.refined = std::move(*refined);
      p.use_refined = true;
    }
  }
  for (const TimedMicrobatch& r : timed) {
    if (r.held_out) p.held_out.push_back(r);
  }
  return p;
}

CostModel CostModelOfProfile(const CostProfile& profile, std::string name) {
  const ProfileForm& used = profile.used();
  CostModel m{used.a, used.b, std::move(name), used.c, "seconds", std::nullopt};
  if (profile.encoder) m.encoder = profile.encoder->cost;
  return m;
}

std::string CostProfileJson(const CostProfile& p) {
  const ProfileForm& used = p.used();
  Json held = Json::array();
  for (const TimedMicrobatch& r : p.held_out) {
    const double predicted = used.Predict(r.lengths);
    int64_t tokens = 0;
    for (int64_t l : r.lengths) tokens += l;
    held.push_back(Json{{"lengths", DescribeLengths(r.lengths)},
                        {"tokens", tokens},
                        {"sequences", r.lengths.size()},
                        {"seconds", r.seconds},
                        {"predicted", predicted},
                        {"rel_error", (predicted - r.seconds) / r.seconds}});
  }
  Json fit{{"method", "non-negative least squares of the relative error"},
           {"abc", Json{{"fit", ErrorsJson(p.abc.fit)}, {"held_out", ErrorsJson(p.abc.held_out)}}},
           {"held_out", held}};
  if (p.refined) {
    fit["refined"] =
        Json{{"fit", ErrorsJson(p.refined->fit)}, {"held_out", ErrorsJson(p.refined->held_out)}};
  }
  const MeasuredOn& m = p.measured_on;
  Json j{{"format", kFormat},
         {"version", kFormatVersion},
         {"a", p.abc.a},
         {"b", p.abc.b},
         {"c", p.abc.c},
         {"units", Json{{"a", "seconds per token"},
                        {"b", "seconds per squared token"},
                        {"c", "seconds per sequence"},
                        {"m", "seconds per microbatch"}}},
         {"refined", p.refined ? FormJson(*p.refined, true) : Json(nullptr)},
         {"use", p.use_refined ? "refined" : "abc"},
         {"measured_on", Json{{"model", m.model},
                              {"device", m.device},
                              {"dtype", m.dtype},
                              {"attention", m.attention},
                              {"tp_size", m.tp_size},
                              {"cp_size", m.cp_size},
                              {"thdpack_version", m.thdpack_version}}},
         {"fit", fit}};
  if (p.encoder) {
    const EncoderProfile& e = *p.encoder;
    j["encoder"] = Json{{"per_patch", e.cost.per_patch},
                        {"per_frame_sq", e.cost.per_frame_sq},
                        {"units", Json{{"per_patch", "seconds per patch (t*h*w)"},
                                       {"per_frame_sq", "seconds per squared frame (t*(h*w)^2)"}}},
                        {"model", e.model},
                        {"fit", Json{{"fit", ErrorsJson(e.fit)},
                                     {"held_out", ErrorsJson(e.held_out)}}}};
  }
  return j.dump(2) + "\n";
}

Result<CostProfile> ParseCostProfile(std::string_view text, std::string_view source) {
  const std::string where(source);
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument(where + ": not a JSON object (a cost profile is written by "
                                           "thdpack calibrate or thdpack.torch.calibrate)");
  }
  if (!j.contains("format") || !j.at("format").is_string() ||
      j.at("format").get<std::string>() != kFormat) {
    return Status::InvalidArgument(where + ": field \"format\" is not \"" + kFormat +
                                   "\": not a thdpack cost profile");
  }
  if (!j.contains("version") || !j.at("version").is_number_integer()) {
    return Status::InvalidArgument(where + ": missing field \"version\" (an integer)");
  }
  if (j.at("version").get<int64_t>() != kFormatVersion) {
    return Status::Unimplemented(where + ": version " +
                                 std::to_string(j.at("version").get<int64_t>()) +
                                 ", this thdpack reads version " + std::to_string(kFormatVersion));
  }
  CostProfile p;
  p.source = where;
  THDPACK_ASSIGN_OR_RETURN(p.abc.a, Coefficient(j, "a", where));
  THDPACK_ASSIGN_OR_RETURN(p.abc.b, Coefficient(j, "b", where));
  THDPACK_ASSIGN_OR_RETURN(p.abc.c, Coefficient(j, "c", where));
  if (p.abc.a == 0 && p.abc.b == 0 && p.abc.c == 0) {
    return Status::InvalidArgument(where + ": a, b and c are all 0");
  }
  std::string use = "abc";
  if (j.contains("use")) {
    if (!j.at("use").is_string()) {
      return Status::InvalidArgument(where + ": field \"use\" must be \"abc\" or \"refined\"");
    }
    use = j.at("use").get<std::string>();
    if (use != "abc" && use != "refined") {
      return Status::InvalidArgument(where + ": field \"use\" is \"" + use +
                                     "\", expected \"abc\" or \"refined\"");
    }
  }
  if (j.contains("refined") && !j.at("refined").is_null()) {
    const Json& r = j.at("refined");
    if (!r.is_object()) return Status::InvalidArgument(where + ": field \"refined\" must be an object or null");
    ProfileForm f;
    const std::string rw = where + ": refined";
    THDPACK_ASSIGN_OR_RETURN(f.a, Coefficient(r, "a", rw));
    THDPACK_ASSIGN_OR_RETURN(f.b, Coefficient(r, "b", rw));
    THDPACK_ASSIGN_OR_RETURN(f.c, Coefficient(r, "c", rw));
    THDPACK_ASSIGN_OR_RETURN(f.m, Coefficient(r, "m", rw));
    if (f.a == 0 && f.b == 0 && f.c == 0) {
      return Status::InvalidArgument(rw + ": a, b and c are all 0");
    }
    p.refined = f;
  }
  if (use == "refined" && !p.refined) {
    return Status::InvalidArgument(where + ": field \"use\" is \"refined\" but \"refined\" is null");
  }
  p.use_refined = use == "refined";
  if (!j.contains("measured_on") || !j.at("measured_on").is_object()) {
    return Status::InvalidArgument(where + ": missing field \"measured_on\" (an object: model, "
                                           "device, dtype, attention, tp_size, cp_size, "
                                           "thdpack_version)");
  }
  const Json& m = j.at("measured_on");
  for (const auto& [key, out] :
       {std::pair<const char*, std::string*>{"model", &p.measured_on.model},
        {"device", &p.measured_on.device},
        {"dtype", &p.measured_on.dtype},
        {"attention", &p.measured_on.attention},
        {"thdpack_version", &p.measured_on.thdpack_version}}) {
    if (!m.contains(key)) continue;
    if (!m.at(key).is_string()) {
      return Status::InvalidArgument(where + ": measured_on.\"" + key + "\" must be a string");
    }
    *out = m.at(key).get<std::string>();
  }
  for (const auto& [key, out] : {std::pair<const char*, int*>{"tp_size", &p.measured_on.tp_size},
                                 {"cp_size", &p.measured_on.cp_size}}) {
    if (!m.contains(key)) continue;
    if (!m.at(key).is_number_integer() || m.at(key).get<int64_t>() < 1 ||
        m.at(key).get<int64_t>() > 1 << 20) {
      return Status::InvalidArgument(where + ": measured_on.\"" + key +
                                     "\" must be an integer >= 1");
    }
    *out = static_cast<int>(m.at(key).get<int64_t>());
  }
  if (j.contains("encoder") && !j.at("encoder").is_null()) {
    const Json& e = j.at("encoder");
    const std::string ew = where + ": encoder";
    if (!e.is_object()) return Status::InvalidArgument(ew + " must be an object or null");
    EncoderProfile enc;
    THDPACK_ASSIGN_OR_RETURN(enc.cost.per_patch, Coefficient(e, "per_patch", ew));
    THDPACK_ASSIGN_OR_RETURN(enc.cost.per_frame_sq, Coefficient(e, "per_frame_sq", ew));
    if (enc.cost.empty()) return Status::InvalidArgument(ew + ": per_patch and per_frame_sq are both 0");
    if (e.contains("model")) {
      if (!e.at("model").is_string()) return Status::InvalidArgument(ew + ": \"model\" must be a string");
      enc.model = e.at("model").get<std::string>();
    }
    if (e.contains("fit") && e.at("fit").is_object()) {
      const Json& f = e.at("fit");
      if (f.contains("fit")) THDPACK_RETURN_IF_ERROR(ReadErrors(f.at("fit"), &enc.fit));
      if (f.contains("held_out")) THDPACK_RETURN_IF_ERROR(ReadErrors(f.at("held_out"), &enc.held_out));
    }
    p.encoder = std::move(enc);
  }
  if (j.contains("fit") && j.at("fit").is_object()) {
    const Json& fit = j.at("fit");
    if (fit.contains("abc") && fit.at("abc").is_object()) {
      const Json& abc = fit.at("abc");
      if (abc.contains("fit")) THDPACK_RETURN_IF_ERROR(ReadErrors(abc.at("fit"), &p.abc.fit));
      if (abc.contains("held_out")) {
        THDPACK_RETURN_IF_ERROR(ReadErrors(abc.at("held_out"), &p.abc.held_out));
      }
    }
    if (fit.contains("held_out") && fit.at("held_out").is_array()) {
      size_t k = 0;
      for (const Json& row : fit.at("held_out")) {
        const std::string rw = where + ": fit.held_out[" + std::to_string(k++) + "]";
        if (!row.is_object() || !row.contains("lengths") || !row.at("lengths").is_string()) {
          return Status::InvalidArgument(rw + ": expected an object with \"lengths\" and "
                                              "\"seconds\"");
        }
        TimedMicrobatch r;
        r.held_out = true;
        THDPACK_ASSIGN_OR_RETURN(r.seconds, Coefficient(row, "seconds", rw));
        THDPACK_ASSIGN_OR_RETURN(r.lengths, ParseDescribedLengths(row.at("lengths").get<std::string>(), rw));
        p.held_out.push_back(std::move(r));
      }
    }
    if (p.refined && fit.contains("refined") && fit.at("refined").is_object()) {
      const Json& r = fit.at("refined");
      if (r.contains("fit")) THDPACK_RETURN_IF_ERROR(ReadErrors(r.at("fit"), &p.refined->fit));
      if (r.contains("held_out")) {
        THDPACK_RETURN_IF_ERROR(ReadErrors(r.at("held_out"), &p.refined->held_out));
      }
    }
  }
  return p;
}

Result<CostProfile> ReadCostProfile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::IOError("cost profile " + path + ": cannot open (" +
                           std::string(std::strerror(errno)) + ")");
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::IOError("cost profile " + path + ": read failed");
  return ParseCostProfile(text.str(), "cost profile " + path);
}

Status WriteCostProfile(const CostProfile& profile, const std::string& path) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return Status::IOError("cost profile " + path + ": cannot create (" +
                           std::string(std::strerror(errno)) + ")");
  }
  out << CostProfileJson(profile);
  out.close();
  if (!out) return Status::IOError("cost profile " + path + ": write failed");
  return Status::Ok();
}

Result<std::vector<TimedMicrobatch>> ReadTimingsCsv(const std::string& path, int hold_out_every) {
  if (hold_out_every < 0) {
    return Status::InvalidArgument("timings: hold_out_every = " + std::to_string(hold_out_every) +
                                   " must be >= 0 (0: none held out)");
  }
  std::ifstream in(path);
  if (!in) {
    return Status::IOError("timings " + path + ": cannot open (" +
                           std::string(std::strerror(errno)) + ")");
  }
  std::vector<TimedMicrobatch> out;
  std::string line;
  int64_t number = 0;
  bool header = false;
  while (std::getline(in, line)) {
    ++number;
    const std::string at = path + ":" + std::to_string(number);
    const std::string_view text = Trim(line);
    if (!header) {
      if (text != "seconds,lengths") {
        return Status::InvalidArgument(at + ": the header must be \"seconds,lengths\", got \"" +
                                       std::string(text.substr(0, 60)) + "\"");
      }
      header = true;
      continue;
    }
    if (text.empty()) continue;
    const size_t comma = text.find(',');
    if (comma == std::string_view::npos) {
      return Status::InvalidArgument(at + ": expected \"seconds,lengths\" (e.g. 0.0405,256 256 "
                                          "1024), got no comma");
    }
    TimedMicrobatch r;
    const std::string seconds(Trim(text.substr(0, comma)));
    char* end = nullptr;
    errno = 0;
    r.seconds = std::strtod(seconds.c_str(), &end);
    if (seconds.empty() || end != seconds.c_str() + seconds.size() || !std::isfinite(r.seconds) ||
        !(r.seconds > 0)) {
      return Status::InvalidArgument(at + ": seconds \"" + seconds +
                                     "\" is not a finite number > 0");
    }
    std::string_view rest = text.substr(comma + 1);
    while (!rest.empty()) {
      const size_t s = rest.find_first_not_of(" \t");
      if (s == std::string_view::npos) break;
      rest.remove_prefix(s);
      const size_t e = std::min(rest.find_first_of(" \t"), rest.size());
      const std::string_view tok = rest.substr(0, e);
      int64_t v = 0;
      if (!ParseInt64(tok, &v) || v < 1 || v > kMaxLength) {
        return Status::InvalidArgument(at + ": length \"" + std::string(tok) +
                                       "\" is not an integer in [1, 2^31)");
      }
      r.lengths.push_back(v);
      rest.remove_prefix(e);
    }
    if (r.lengths.empty()) {
      return Status::InvalidArgument(at + ": no lengths after the seconds");
    }
    r.held_out = hold_out_every > 0 && (out.size() + 1) % static_cast<size_t>(hold_out_every) == 0;
    out.push_back(std::move(r));
  }
  if (!header) return Status::InvalidArgument("timings " + path + ": empty (no header)");
  return out;
}

std::string DescribeLengths(std::span<const int64_t> lengths) {
  std::string s;
  for (size_t i = 0; i < lengths.size();) {
    size_t j = i;
    while (j < lengths.size() && lengths[j] == lengths[i]) ++j;
    if (!s.empty()) s += ' ';
    s += std::to_string(lengths[i]);
    if (j - i > 1) s += "x" + std::to_string(j - i);
    i = j;
  }
  return s;
}

Result<ResolvedCost> ResolveCost(std::string_view cost_spec, std::string_view hw_spec,
                                 const CostSpecNames& names) {
  auto fail = [](const std::string& name, const Status& s) {
    return Status(s.code(), name + ": " + s.message());
  };
  ResolvedCost r;
  Result<Hardware> hw = ParseHardwareSpec(hw_spec);
  if (!hw.ok()) return fail(names.hw, hw.status());
  r.hardware = *hw;
  constexpr std::string_view kProfile = "profile:";
  if (cost_spec.substr(0, kProfile.size()) == kProfile) {
    const std::string path(cost_spec.substr(kProfile.size()));
    if (path.empty()) {
      return fail(names.cost, Status::InvalidArgument("\"profile:\" needs a file: profile:FILE"));
    }
    Result<CostProfile> profile = ReadCostProfile(path);
    if (!profile.ok()) return fail(names.cost, profile.status());
    const ProfileForm& used = profile->used();
    r.cost = CostModelOfProfile(*profile, std::string(cost_spec));
    StepTimeCoefficients k;
    k.seconds_per_token = used.a;
    k.seconds_per_token_sq = used.b;
    k.seconds_per_sequence = used.c;
    k.seconds_per_microbatch = used.m;
    k.name = std::string(cost_spec);
    Result<ModelDims> dims = ParseModelDims(profile->measured_on.model);
    if (dims.ok()) {
      r.dims = *dims;
      Result<FlopsCoefficients> flops = ComputeFlopsCoefficients(*dims);
      if (!flops.ok()) return fail(names.cost, flops.status());
      r.flops = *flops;
      k.kv_bytes_per_token = KvBytesPerToken(*dims);
      k.link_bytes_per_second = r.hardware.link_bytes_per_second;
    }
    Result<StepTimeModel> model = StepTimeModel::Create(k);
    if (!model.ok()) return fail(names.cost, model.status());
    r.step_time = std::move(*model);
    r.profile = std::move(*profile);
    return r;
  }
  Result<CostModel> cost = ParseCostSpec(cost_spec);
  if (!cost.ok()) return fail(names.cost, cost.status());
  r.cost = std::move(*cost);
  Result<ModelDims> dims = ParseModelDims(cost_spec);
  if (!dims.ok()) {
    if (dims.status().code() == StatusCode::kNotFound) return r;
    return fail(names.cost, dims.status());
  }
  r.dims = *dims;
  Result<FlopsCoefficients> flops = ComputeFlopsCoefficients(*dims);
  if (!flops.ok()) return fail(names.cost, flops.status());
  r.flops = *flops;
  Result<StepTimeModel> model = StepTimeModel::Create(*dims, r.hardware);
  if (!model.ok()) return fail(names.cost + "/" + names.hw, model.status());
  r.step_time = std::move(*model);
  return r;
}

}  // namespace thdpack
