// The probe's vectorisable causal attention (probe_attention.h).
#include "probe/probe_attention.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace thdpack::probe_internal {
namespace {

// Eight doubles: the compiler maps it onto one zmm, two ymm or four xmm registers, per clone.
constexpr int kW = 8;
typedef double Vec __attribute__((vector_size(64)));
typedef int64_t VecI __attribute__((vector_size(64)));
typedef uint64_t VecU __attribute__((vector_size(64)));
// Every helper is inlined into each clone of the kernel (so it takes the clone's width).
#define THDPACK_INLINE __attribute__((always_inline)) inline

THDPACK_INLINE Vec Load(const double* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
THDPACK_INLINE void Store(double* p, Vec v) { std::memcpy(p, &v, sizeof v); }
THDPACK_INLINE Vec Splat(double x) { return Vec{} + x; }
THDPACK_INLINE Vec Max(Vec a, Vec b) {
  const VecI a_larger = a > b;
  return (Vec)(((VecI)a & a_larger) | ((VecI)b & ~a_larger));
}
THDPACK_INLINE double HorizontalMax(Vec v) {
  double m = v[0];
  for (int k = 1; k < kW; ++k) m = v[k] > m ? v[k] : m;
  return m;
}
THDPACK_INLINE double HorizontalSum(Vec v) {
  double s = 0;
  for (int k = 0; k < kW; ++k) s += v[k];
  return s;
}

// ExpNonPositive on eight lanes: the same arithmetic (ExpReduced), so the same bits.
THDPACK_INLINE Vec ExpNonPositiveVec(Vec x) {
  const ExpParts<Vec> e = ExpReduced(Max(x, Splat(kExpFloor)));
  const VecU k = (VecU)e.shifted - std::bit_cast<uint64_t>(kExpShift);
  return (Vec)((VecU)e.p + (k << 52));
}

// s[i] = sum_j qs[j] kt[j * stride + i] for i in [0, n), and the largest: a row of d values times
// the first n columns of a row-major matrix [d, stride] (the scores of a query over its keys, and
// the probe's projections). Four blocks of eight columns a pass: each column's d products summed
// in a register (one store per column).
THDPACK_INLINE double ProductAndMax(const double* qs, const double* kt, int64_t stride, int64_t n,
                                    int d, double* s) {
  Vec mv = Splat(-std::numeric_limits<double>::infinity());
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    Vec a0{}, a1{}, a2{}, a3{};
    for (int j = 0; j < d; ++j) {
      const Vec qj = Splat(qs[j]);
      const double* r = kt + j * stride + i;
      a0 += qj * Load(r);
      a1 += qj * Load(r + kW);
      a2 += qj * Load(r + 2 * kW);
      a3 += qj * Load(r + 3 * kW);
    }
    Store(s + i, a0);
    Store(s + i + kW, a1);
    Store(s + i + 2 * kW, a2);
    Store(s + i + 3 * kW, a3);
    mv = Max(mv, Max(Max(a0, a1), Max(a2, a3)));
  }
  for (; i + kW <= n; i += kW) {
    Vec a{};
    for (int j = 0; j < d; ++j) a += Splat(qs[j]) * Load(kt + j * stride + i);
    Store(s + i, a);
    mv = Max(mv, a);
  }
  double m = HorizontalMax(mv);
  for (; i < n; ++i) {
    double acc = 0;
    for (int j = 0; j < d; ++j) acc += qs[j] * kt[j * stride + i];
    s[i] = acc;
    m = acc > m ? acc : m;
  }
  return m;
}

// s[i] = exp(s[i] - m) and their sum.
THDPACK_INLINE double Exponentials(double m, int64_t n, double* s) {
  Vec sum{};
  const Vec mv = Splat(m);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const Vec e = ExpNonPositiveVec(Load(s + i) - mv);
    Store(s + i, e);
    sum += e;
  }
  double total = HorizontalSum(sum);
  for (; i < n; ++i) {
    s[i] = ExpNonPositive(s[i] - m);
    total += s[i];
  }
  return total;
}

// out[j] = sum_i s[i] vt[j][i] * inv, four rows of values a pass.
THDPACK_INLINE void WeightedValues(const double* s, const double* vt, int64_t stride, int64_t n, int d,
                    double inv, double* out) {
  int j = 0;
  for (; j < d; j += 4) {
    const int rows = d - j < 4 ? d - j : 4;
    const double* r[4];
    for (int k = 0; k < 4; ++k) r[k] = vt + static_cast<int64_t>(j + (k < rows ? k : 0)) * stride;
    Vec a0{}, a1{}, a2{}, a3{};
    int64_t i = 0;
    for (; i + kW <= n; i += kW) {
      const Vec w = Load(s + i);
      a0 += w * Load(r[0] + i);
      a1 += w * Load(r[1] + i);
      a2 += w * Load(r[2] + i);
      a3 += w * Load(r[3] + i);
    }
    double t[4] = {HorizontalSum(a0), HorizontalSum(a1), HorizontalSum(a2), HorizontalSum(a3)};
    for (; i < n; ++i) {
      for (int k = 0; k < 4; ++k) t[k] += s[i] * r[k][i];
    }
    for (int k = 0; k < rows; ++k) out[j + k] = t[k] * inv;
  }
}

// The scores of two queries over the same keys [0, n0) (and the second's over [n0, n1)), with
// each one's maximum: one load of each key for both.
THDPACK_INLINE void PairScores(const double* qa, const double* qb, const double* kt,
                               int64_t stride, int64_t n0, int64_t n1, int d, double* sa,
                               double* sb, double* ma, double* mb) {
  Vec va = Splat(-std::numeric_limits<double>::infinity()), vb = va;
  int64_t i = 0;
  for (; i + 2 * kW <= n0; i += 2 * kW) {
    Vec a0{}, a1{}, b0{}, b1{};
    for (int j = 0; j < d; ++j) {
      const double* r = kt + j * stride + i;
      const Vec k0 = Load(r), k1 = Load(r + kW);
      const Vec qaj = Splat(qa[j]), qbj = Splat(qb[j]);
      a0 += qaj * k0;
      a1 += qaj * k1;
      b0 += qbj * k0;
      b1 += qbj * k1;
    }
    Store(sa + i, a0);
    Store(sa + i + kW, a1);
    Store(sb + i, b0);
    Store(sb + i + kW, b1);
    va = Max(va, Max(a0, a1));
    vb = Max(vb, Max(b0, b1));
  }
  double m_a = HorizontalMax(va), m_b = HorizontalMax(vb);
  for (; i < n0; ++i) {
    double a = 0, b = 0;
    for (int j = 0; j < d; ++j) {
      a += qa[j] * kt[j * stride + i];
      b += qb[j] * kt[j * stride + i];
    }
    sa[i] = a;
    sb[i] = b;
    m_a = a > m_a ? a : m_a;
    m_b = b > m_b ? b : m_b;
  }
  for (; i < n1; ++i) {
    double b = 0;
    for (int j = 0; j < d; ++j) b += qb[j] * kt[j * stride + i];
    sb[i] = b;
    m_b = b > m_b ? b : m_b;
  }
  *ma = m_a;
  *mb = m_b;
}

// The weighted values of two queries (weights sa over [0, n0), sb over [0, n1), n0 <= n1), four
// rows of values a pass: one load of each value for both.
THDPACK_INLINE void PairWeightedValues(const double* sa, const double* sb, const double* vt,
                                       int64_t stride, int64_t n0, int64_t n1, int d,
                                       double inv_a, double inv_b, double* out_a,
                                       double* out_b) {
  for (int j = 0; j < d; j += 4) {
    const int rows = d - j < 4 ? d - j : 4;
    const double* r[4];
    for (int k = 0; k < 4; ++k) r[k] = vt + static_cast<int64_t>(j + (k < rows ? k : 0)) * stride;
    // Named accumulators (not an array) stay in registers.
    Vec a0{}, a1{}, a2{}, a3{}, b0{}, b1{}, b2{}, b3{};
    int64_t i = 0;
    for (; i + kW <= n0; i += kW) {
      const Vec wa = Load(sa + i), wb = Load(sb + i);
      const Vec v0 = Load(r[0] + i), v1 = Load(r[1] + i), v2 = Load(r[2] + i),
                v3 = Load(r[3] + i);
      a0 += wa * v0;
      a1 += wa * v1;
      a2 += wa * v2;
      a3 += wa * v3;
      b0 += wb * v0;
      b1 += wb * v1;
      b2 += wb * v2;
      b3 += wb * v3;
    }
    double ta[4] = {HorizontalSum(a0), HorizontalSum(a1), HorizontalSum(a2), HorizontalSum(a3)};
    double tb[4] = {HorizontalSum(b0), HorizontalSum(b1), HorizontalSum(b2), HorizontalSum(b3)};
    for (; i < n0; ++i) {
      for (int k = 0; k < 4; ++k) {
        ta[k] += sa[i] * r[k][i];
        tb[k] += sb[i] * r[k][i];
      }
    }
    for (; i < n1; ++i) {
      for (int k = 0; k < 4; ++k) tb[k] += sb[i] * r[k][i];
    }
    for (int k = 0; k < rows; ++k) {
      out_a[j + k] = ta[k] * inv_a;
      out_b[j + k] = tb[k] * inv_b;
    }
  }
}

THDPACK_PROBE_CLONES
void AttendPairKernel(const double* qa, const double* qb, const double* kt, const double* vt,
                      int64_t stride, int64_t n0, int64_t n1, int head_begin, int head_end, int d,
                      double scale, double* out_a, double* out_b, double* sa, double* sb) {
  double qsa[kMaxHeadDim], qsb[kMaxHeadDim];
  for (int h = head_begin; h < head_end; ++h) {
    const double* k_head = kt + static_cast<int64_t>(h) * d * stride;
    const double* v_head = vt + static_cast<int64_t>(h) * d * stride;
    for (int j = 0; j < d; ++j) {
      qsa[j] = qa[h * d + j] * scale;
      qsb[j] = qb[h * d + j] * scale;
    }
    double ma, mb;
    PairScores(qsa, qsb, k_head, stride, n0, n1, d, sa, sb, &ma, &mb);
    const double da = Exponentials(ma, n0, sa);
    const double db = Exponentials(mb, n1, sb);
    PairWeightedValues(sa, sb, v_head, stride, n0, n1, d, 1.0 / da, 1.0 / db, out_a + h * d,
                       out_b + h * d);
  }
}

THDPACK_PROBE_CLONES
void AttendKernel(const double* q, const double* kt, const double* vt, int64_t stride, int64_t n,
                  int head_begin, int head_end, int d, double scale, double* out, double* s) {
  double qs[kMaxHeadDim];
  for (int h = head_begin; h < head_end; ++h) {
    const double* k_head = kt + static_cast<int64_t>(h) * d * stride;
    const double* v_head = vt + static_cast<int64_t>(h) * d * stride;
    for (int j = 0; j < d; ++j) qs[j] = q[h * d + j] * scale;
    const double m = ProductAndMax(qs, k_head, stride, n, d, s);
    const double denom = Exponentials(m, n, s);
    WeightedValues(s, v_head, stride, n, d, 1.0 / denom, out + h * d);
  }
}

THDPACK_PROBE_CLONES
void RowTimesMatrixKernel(const double* x, const double* w, int in, int64_t stride, int64_t cols,
                          double* out) {
  ProductAndMax(x, w, stride, cols, in, out);  // the largest is not needed here
}

}  // namespace

void RowTimesMatrix(const double* x, const double* w, int in, int64_t stride, int64_t cols,
                    double* out) {
  RowTimesMatrixKernel(x, w, in, stride, cols, out);
}

void AttendTwoRowsFast(const double* qa, const double* qb, const HeadMajorKv& kv, int64_t start,
                       int64_t n0, int64_t n1, double* out_a, double* out_b,
                       std::vector<double>& scores, int head_begin, int head_end) {
  if (scores.size() < static_cast<size_t>(n0 + n1)) scores.resize(static_cast<size_t>(n0 + n1));
  AttendPairKernel(qa, qb, kv.kt.data() + start, kv.vt.data() + start, kv.n, n0, n1, head_begin,
                   head_end < 0 ? kv.heads : head_end, kv.d,
                   1.0 / std::sqrt(static_cast<double>(kv.d)), out_a, out_b, scores.data(),
                   scores.data() + n0);
}

void HeadMajorKv::Assign(const double* k, const double* v, int64_t rows, int heads_, int d_) {
  n = rows;
  heads = heads_;
  d = d_;
  const int64_t hidden = static_cast<int64_t>(heads) * d;
  kt.resize(static_cast<size_t>(hidden * rows));
  vt.resize(kt.size());
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t c = 0; c < hidden; ++c) {
      kt[static_cast<size_t>(c * rows + t)] = k[t * hidden + c];
      vt[static_cast<size_t>(c * rows + t)] = v[t * hidden + c];
    }
  }
}

void AttendRowFast(const double* q, const HeadMajorKv& kv, int64_t start, int64_t n_keys,
                   double* out, std::vector<double>& scores, int head_begin, int head_end) {
  if (scores.size() < static_cast<size_t>(n_keys)) scores.resize(static_cast<size_t>(n_keys));
  AttendKernel(q, kv.kt.data() + start, kv.vt.data() + start, kv.n, n_keys, head_begin,
               head_end < 0 ? kv.heads : head_end, kv.d,
               1.0 / std::sqrt(static_cast<double>(kv.d)), out, scores.data());
}

}  // namespace thdpack::probe_internal
