// The blending rule (thdpack/blend.h): Megatron's largest-error choice, the plain scan and the
// blocked scan that gives the same answers in O(sqrt(D)).
//
// Compiled with -ffp-contract=off (CMakeLists.txt): w * x - c must round twice, as Megatron's
// x86-64 build does, never as one fused multiply-add.
#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
  const size_t d = rule.weights_.size();
  if (d >= static_cast<size_t>(kBlockedMinSources)) {
    rule.order_.resize(d);
    for (size_t i = 0; i < d; ++i) rule.order_[i] = static_cast<int32_t>(i);
    std::stable_sort(rule.order_.begin(), rule.order_.end(), [&](int32_t a, int32_t b) {
      return rule.weights_[static_cast<size_t>(a)] > rule.weights_[static_cast<size_t>(b)];
    });
    const size_t b = static_cast<size_t>(std::ceil(std::sqrt(static_cast<double>(d))));
    for (size_t at = 0; at < d; at += b) rule.begin_.push_back(at);
    rule.begin_.push_back(d);
    const size_t blocks = rule.begin_.size() - 1;
    rule.block_weight_.assign(blocks, 0.0);
    rule.block_error_.resize(blocks);
    rule.block_x_.resize(blocks);
    rule.errors_.resize(b);
    rule.slot_.resize(d);
    rule.slot_weight_.resize(d);
    rule.slot_count_.resize(d);
    for (size_t k = 0; k < blocks; ++k) {
      // Within a block, index order: the first largest error is the lowest index's.
      std::sort(rule.order_.begin() + static_cast<std::ptrdiff_t>(rule.begin_[k]),
                rule.order_.begin() + static_cast<std::ptrdiff_t>(rule.begin_[k + 1]));
      for (size_t j = rule.begin_[k]; j < rule.begin_[k + 1]; ++j) {
        const size_t src = static_cast<size_t>(rule.order_[j]);
        rule.slot_[src] = static_cast<int32_t>(j);
        rule.slot_weight_[j] = rule.weights_[src];
        rule.slot_count_[j] = static_cast<double>(rule.counts_[src]);
        rule.block_weight_[k] = std::max(rule.block_weight_[k], rule.weights_[src]);
      }
      double unused = std::numeric_limits<double>::infinity();
      int unused_source = 0;
      rule.Scan(k, rule.X(), &unused, &unused_source);
    }
  }
  return rule;
}

// The errors as Megatron computes them: a product, then a difference, each rounded (this file
// is compiled without contraction into fused multiply-adds; SSE2's mulpd and subpd round each
// lane as the scalar operations do).
void LargestErrorRule::Scan(size_t k, int64_t x, double* best, int* best_source) {
  const double xd = static_cast<double>(x);
  const size_t b0 = begin_[k];
  const size_t n = begin_[k + 1] - b0;
  const double* w = slot_weight_.data() + b0;
  const double* c = slot_count_.data() + b0;
  double* e = errors_.data();
  double top = -std::numeric_limits<double>::infinity();
  size_t j = 0;
#if defined(__SSE2__)
  const __m128d vx = _mm_set1_pd(xd);
  __m128d vtop = _mm_set1_pd(top);
  for (; j + 2 <= n; j += 2) {
    const __m128d ej = _mm_sub_pd(_mm_mul_pd(_mm_loadu_pd(w + j), vx), _mm_loadu_pd(c + j));
    _mm_storeu_pd(e + j, ej);
    vtop = _mm_max_pd(vtop, ej);  // no NaN reaches here: weights and counts are finite
  }
  double lanes[2];
  _mm_storeu_pd(lanes, vtop);
  top = std::max(lanes[0], lanes[1]);
#endif
  for (; j < n; ++j) {
    e[j] = w[j] * xd - c[j];
    top = std::max(top, e[j]);
  }
  block_error_[k] = top;
  block_x_[k] = x;
  if (top < *best) return;
  size_t f = 0;
  while (e[f] != top) ++f;
  const int d = order_[b0 + f];
  if (top > *best || d < *best_source) {
    *best = top;
    *best_source = d;
  }
}

int LargestErrorRule::Next() {
  if (order_.empty()) return LargestErrorReference(weights_, counts_, n_);
  const int64_t x = X();
  // Every float64 error is within 2^-51 (x + max count) <= 2^-50 x of its exact value (the
  // counts never exceed n): the bounds carry 2^-40 (1 + x), a thousand times that, so a block
  // whose bound is below the best error found cannot hold it, nor tie it.
  const double slack = std::ldexp(1.0 + static_cast<double>(x), -40);
  const size_t blocks = block_error_.size();
  // The block with the largest bound first: its largest error is a good best to prune with.
  size_t first = 0;
  double first_bound = -std::numeric_limits<double>::infinity();
  for (size_t k = 0; k < blocks; ++k) {
    const double bound =
        block_error_[k] + block_weight_[k] * static_cast<double>(x - block_x_[k]);
    if (bound > first_bound) {
      first_bound = bound;
      first = k;
    }
  }
  double best = -std::numeric_limits<double>::infinity();
  int best_source = std::numeric_limits<int>::max();
  Scan(first, x, &best, &best_source);
  for (size_t k = 0; k < blocks; ++k) {
    if (k == first) continue;
    const double bound =
        block_error_[k] + block_weight_[k] * static_cast<double>(x - block_x_[k]) + slack;
    if (bound >= best) Scan(k, x, &best, &best_source);
  }
  return best_source;
}

void LargestErrorRule::Take(int d, int64_t amount) {
  // A count that grows only lowers its error: every block's bound still holds.
  counts_[static_cast<size_t>(d)] += amount;
  n_ += amount;
  if (!slot_.empty()) {
    slot_count_[static_cast<size_t>(slot_[static_cast<size_t>(d)])] =
        static_cast<double>(counts_[static_cast<size_t>(d)]);
  }
}

}  // namespace thdpack
