// The blending rule (thdpack/blend.h): Megatron's largest-error choice, the plain scan and the
// kinetic tournament that gives the same answers in O(log D) amortised.
//
// Compiled with -ffp-contract=off (CMakeLists.txt): w * x - c must round twice, as Megatron's
// x86-64 build does, never as one fused multiply-add.
#include <cmath>
#include <limits>

#include "thdpack/blend.h"

namespace thdpack {
namespace {

// numpy's pairwise summation of float64 (numpy/_core/src/umath/loops_utils.h.src): below 8
// values one accumulator from 0; up to 128, eight accumulators over blocks of 8 combined as
// ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the tail; above, the two halves
// (the first a multiple of 8 long) summed apart.
double PairwiseSum(const double* a, size_t n) {
  if (n < 8) {
    double res = 0.0;
    for (size_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += a[i + static_cast<size_t>(j)];
    }
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  size_t n2 = n / 2;
  n2 -= n2 % 8;
  return PairwiseSum(a, n2) + PairwiseSum(a + n2, n - n2);
}

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

}  // namespace

std::vector<double> NormalizeWeights(std::span<const double> weights) {
  const double sum = PairwiseSum(weights.data(), weights.size());
  std::vector<double> out(weights.size());
  for (size_t d = 0; d < weights.size(); ++d) out[d] = weights[d] / sum;
  return out;
}

int LargestErrorReference(std::span<const double> weights, std::span<const int64_t> counts,
                          int64_t n) {
  const double x = std::max(static_cast<double>(n), 1.0);
  int best = 0;
  double best_error = weights[0] * x - static_cast<double>(counts[0]);
  for (size_t d = 1; d < weights.size(); ++d) {
    const double error = weights[d] * x - static_cast<double>(counts[d]);
    if (error > best_error) {
      best_error = error;
      best = static_cast<int>(d);
    }
  }
  return best;
}

Result<LargestErrorRule> LargestErrorRule::Create(std::vector<double> weights,
                                                  std::vector<int64_t> counts, int64_t n) {
  if (weights.empty()) return Status::InvalidArgument("blend rule: no weights");
  if (weights.size() > (size_t{1} << 30)) {
    return Status::InvalidArgument("blend rule: " + std::to_string(weights.size()) +
                                   " sources (at most 2^30)");
  }
  for (size_t d = 0; d < weights.size(); ++d) {
    if (!(weights[d] > 0) || !std::isfinite(weights[d])) {
      return Status::InvalidArgument("blend rule: weights[" + std::to_string(d) + "] = " +
                                     std::to_string(weights[d]) +
                                     " (a weight is finite and > 0)");
    }
  }
  if (counts.empty()) counts.assign(weights.size(), 0);
  if (counts.size() != weights.size()) {
    return Status::InvalidArgument("blend rule: " + std::to_string(counts.size()) +
                                   " counts for " + std::to_string(weights.size()) + " sources");
  }
  for (size_t d = 0; d < counts.size(); ++d) {
    if (counts[d] < 0) {
      return Status::InvalidArgument("blend rule: counts[" + std::to_string(d) + "] = " +
                                     std::to_string(counts[d]) + " is negative");
    }
  }
  if (n < 0) return Status::InvalidArgument("blend rule: position " + std::to_string(n) + " < 0");
  LargestErrorRule rule;
  rule.weights_ = std::move(weights);
  rule.counts_ = std::move(counts);
  rule.n_ = n;
  if (rule.size() >= kKineticMinSources) rule.Build(rule.X());
  return rule;
}

bool LargestErrorRule::Beats(int a, int b, int64_t x) const {
  const double ea = Error(a, x);
  const double eb = Error(b, x);
  return ea > eb || (ea == eb && a < b);
}

// Node k holds the better of its children's winners at x. Until when? The error lines of the
// winner a and the loser b are e(s) = w s - c. In exact arithmetic their gap is
// g(s) = (w_a - w_b) s - (c_a - c_b); each error as float64 computes it (a product, then a
// difference, each rounded) is within 2^-52 (w s + c) of its line. So while
// g(s) > 2^-49 ((w_a + w_b) s + c_a + c_b + 1) - eight times that bound for both - the
// float64 comparison agrees with the exact one, and a keeps winning. That is alpha s > beta with
// alpha = (w_a - w_b) - 2^-49 (w_a + w_b) and beta = (c_a - c_b) + 2^-49 (c_a + c_b + 1), linear
// in s: the first s where it may fail is the node's next check (long double, two steps early;
// the rounding of alpha and beta is far inside the slack). Near a crossing the node is checked
// at every position until the lines are apart again.
void LargestErrorRule::Recompute(size_t k, int64_t x) {
  const int32_t l = winner_[2 * k];
  const int32_t r = winner_[2 * k + 1];
  int64_t next = kNever;
  if (l < 0 || r < 0) {
    winner_[k] = l < 0 ? r : l;
  } else {
    const bool left = Beats(l, r, x);
    const int a = left ? l : r;
    const int b = left ? r : l;
    winner_[k] = a;
    const long double wa = weights_[static_cast<size_t>(a)];
    const long double wb = weights_[static_cast<size_t>(b)];
    const long double ca = static_cast<long double>(counts_[static_cast<size_t>(a)]);
    const long double cb = static_cast<long double>(counts_[static_cast<size_t>(b)]);
    const long double slack = std::ldexp(1.0L, -49);
    const long double alpha = (wa - wb) - slack * (wa + wb);
    const long double beta = (ca - cb) + slack * (ca + cb + 1);
    const int64_t soon = x + 1;
    if (alpha > 0) {
      if (!(alpha * static_cast<long double>(soon) > beta)) next = soon;
    } else if (alpha == 0) {
      if (beta >= 0) next = soon;
    } else {
      const long double t = beta / alpha;  // alpha s <= beta for every s >= t
      if (t <= static_cast<long double>(soon) + 2) {
        next = soon;
      } else if (t < 0x1p62L) {
        next = std::max<int64_t>(soon, static_cast<int64_t>(std::floor(t)) - 2);
      }
    }
  }
  ++stamp_[k];
  check_[k] = next;
  if (next != kNever) checks_.push(Check{next, static_cast<uint32_t>(k), stamp_[k]});
}

void LargestErrorRule::Build(int64_t x) {
  leaves_ = 1;
  while (leaves_ < weights_.size()) leaves_ *= 2;
  winner_.assign(2 * leaves_, -1);
  check_.assign(2 * leaves_, kNever);
  stamp_.assign(2 * leaves_, 0);
  checks_ = {};
  for (size_t d = 0; d < weights_.size(); ++d) winner_[leaves_ + d] = static_cast<int32_t>(d);
  for (size_t k = leaves_ - 1; k >= 1; --k) Recompute(k, x);
}

int LargestErrorRule::Next() {
  if (leaves_ == 0) return LargestErrorReference(weights_, counts_, n_);
  const int64_t x = X();
  // Every node whose check is due is computed again at x, and its ancestors while its winner
  // changes.
  while (!checks_.empty() && checks_.top().x <= x) {
    const Check c = checks_.top();
    checks_.pop();
    if (c.stamp != stamp_[c.node]) continue;  // computed again since: stale
    size_t k = c.node;
    int32_t before = winner_[k];
    Recompute(k, x);
    while (k > 1 && winner_[k] != before) {
      k /= 2;
      before = winner_[k];
      Recompute(k, x);
    }
  }
  return winner_[1];
}

void LargestErrorRule::Take(int d, int64_t amount) {
  counts_[static_cast<size_t>(d)] += amount;
  n_ += amount;
  if (leaves_ == 0) return;
  const int64_t x = X();
  for (size_t k = (leaves_ + static_cast<size_t>(d)) / 2; k >= 1; k /= 2) Recompute(k, x);
}

}  // namespace thdpack
