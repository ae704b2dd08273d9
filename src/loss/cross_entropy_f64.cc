// The float64 rows of the fast cross-entropy (a verification dtype): the kernels' chunked
// online softmax in double, scalar, one exp per logit; the gradient-only pass of the
// vocab-parallel backward. cross_entropy.cc runs them for float64 logits.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loss/cross_entropy_kernels.h"

namespace thdpack::loss_internal {

// float64: the same chunked online shape in double, scalar (a verification dtype).
void ForwardRowsF64(const Job& job, int64_t begin, int64_t end) {
  const int64_t V = job.vocab;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<double> chunk_max(static_cast<size_t>((V + kChunk - 1) / kChunk));
  for (int64_t t = begin; t < end; ++t) {
    const double* row = reinterpret_cast<const double*>(job.logits) + t * V;
    double* out = job.grad ? reinterpret_cast<double*>(job.grad) + t * V : nullptr;
    if (job.labels[t] < 0) {
      if (out) std::fill(out, out + V, 0.0);
      continue;
    }
    double M = -kInf, S = 0, W = 0;
    int64_t ci = 0;
    for (int64_t c0 = 0; c0 < V; c0 += kChunk, ++ci) {
      const int64_t n = std::min(kChunk, V - c0);
      double m = -kInf;
      for (int64_t j = 0; j < n; ++j) m = row[c0 + j] > m ? row[c0 + j] : m;
      chunk_max[ci] = m;
      if (m == -kInf) continue;
      double sc = 0, wc = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double z = row[c0 + j];
        if (z == -kInf) continue;
        const double e = std::exp(z - m);
        sc += e;
        if (e > 0) wc += e * (z - m);
      }
      // Rescales that underflow to 0 drop their terms whole (0 * -inf would be NaN): see the
      // float rows.
      if (m > M) {
        if (M == -kInf) {
          S = W = 0;
        } else {
          const double a = std::exp(M - m);
          W = a > 0 ? a * (W + (M - m) * S) : 0.0;
          S = a * S;
        }
        M = m;
      }
      const double b = std::exp(m - M);
      if (b > 0) {
        S += b * sc;
        W += b * (wc + (m - M) * sc);
      }
    }
    job.stats[t] = RowStats{M, S, W};
    if (out) {
      const double lse = M + std::log(S);
      const int64_t y = job.labels[t] - job.vocab_start;
      for (int64_t j = 0; j < V; ++j) {
        const double p = row[j] == -kInf ? 0.0 : std::exp(row[j] - lse);
        out[j] = (j == y ? p - 1.0 : p) * job.scale;
      }
    }
  }
}

void GradRowsF64(const Job& job, int64_t begin, int64_t end) {
  const int64_t V = job.vocab;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (int64_t t = begin; t < end; ++t) {
    const double* row = reinterpret_cast<const double*>(job.logits) + t * V;
    double* out = reinterpret_cast<double*>(job.grad) + t * V;
    if (job.labels[t] < 0) {
      std::fill(out, out + V, 0.0);
      continue;
    }
    const int64_t y = job.labels[t] - job.vocab_start;
    for (int64_t j = 0; j < V; ++j) {
      const double p = row[j] == -kInf ? 0.0 : std::exp(row[j] - job.lse[t]);
      out[j] = (j == y ? p - 1.0 : p) * job.scale;
    }
  }
}

}  // namespace thdpack::loss_internal
