// Internal helpers of the probe model shared by the reference and the distributed forward.
#ifndef THDPACK_PROBE_PROBE_INTERNAL_H_
#define THDPACK_PROBE_PROBE_INTERNAL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace thdpack::probe_internal {

// Causal attention of one query row over n_keys consecutive key/value rows (the keys the query
// may see, in position order), every head: out[h*d + j] = sum_i softmax_i(q_h . k_h[i] /
// sqrt(d)) v_h[i][j]. q, out: [heads * d]; keys, values: [n_keys, heads * d] row-major.
// scores: scratch of at least n_keys doubles. REQUIRES n_keys >= 1.
inline void AttendRow(const double* q, const double* keys, const double* values, int64_t n_keys,
                      int heads, int d, double* out, std::vector<double>& scores) {
  const int hidden = heads * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (scores.size() < static_cast<size_t>(n_keys)) scores.resize(static_cast<size_t>(n_keys));
  for (int h = 0; h < heads; ++h) {
    const double* qh = q + h * d;
    double max_score = -INFINITY;
    for (int64_t i = 0; i < n_keys; ++i) {
      const double* kh = keys + i * hidden + h * d;
      double s = 0;
      for (int j = 0; j < d; ++j) s += qh[j] * kh[j];
      s *= scale;
      scores[static_cast<size_t>(i)] = s;
      max_score = std::max(max_score, s);
    }
    double denom = 0;
    for (int64_t i = 0; i < n_keys; ++i) {
      const double e = std::exp(scores[static_cast<size_t>(i)] - max_score);
      scores[static_cast<size_t>(i)] = e;
      denom += e;
    }
    double* oh = out + h * d;
    std::fill(oh, oh + d, 0.0);
    for (int64_t i = 0; i < n_keys; ++i) {
      const double w = scores[static_cast<size_t>(i)] / denom;
      const double* vh = values + i * hidden + h * d;
      for (int j = 0; j < d; ++j) oh[j] += w * vh[j];
    }
  }
}

// A label as the probe sees it: ids taken mod V, the ignore index kept.
inline int32_t ProbeLabel(int64_t label, int64_t vocab) {
  return label < 0 ? static_cast<int32_t>(label) : static_cast<int32_t>(label % vocab);
}

}  // namespace thdpack::probe_internal

#endif  // THDPACK_PROBE_PROBE_INTERNAL_H_
