// The probe's causal attention in vectorisable loops (probe_attention.cc), beside the plain row
// loop it is checked against (probe_internal.h, AttendRow).
//
// The keys and values of a run of rows are stored head-major and transposed (HeadMajorKv:
// kt[(h*d + j) * n + t] = K[t][h*d + j]), so the scores of one query over consecutive keys, the
// exponentials and the weighted sum of values are unit-stride loops over the keys: the compiler
// vectorises them (one clone per instruction set, chosen when the program starts). The
// exponential is ExpNonPositive, an fp64 polynomial accurate to a few units in the last place,
// written without calls or branches so that it vectorises too. The result equals the plain loop
// up to the rounding of a different summation order (tested on random inputs).
//
// Thread-safety: pure functions; a HeadMajorKv is a plain value.
#ifndef THDPACK_PROBE_PROBE_ATTENTION_H_
#define THDPACK_PROBE_PROBE_ATTENTION_H_

#include <bit>
#include <cstdint>
#include <vector>

// One clone of a hot loop per instruction set, chosen by the loader on the machine it runs on
// (builds stay portable: no -march); unit-stride loops vectorise at each clone's width.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define THDPACK_PROBE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define THDPACK_PROBE_CLONES
#endif

namespace thdpack::probe_internal {

// The arithmetic of ExpNonPositive on a double or on a vector of doubles (T): for x >= -700,
// Cody-Waite reduction x = k ln 2 + r, |r| <= ln2/2, and a Taylor polynomial of degree 12 for
// exp(r) (truncation below 2e-16 relative). `p` is exp(r); `shifted` holds k in its low bits
// (two's complement around the bits of kExpShift), for the caller to add to the exponent.
inline constexpr double kExpFloor = -700.0;
inline constexpr double kExpShift = 0x1.8p52;  // adding it rounds to an integer in the low bits
template <typename T>
struct ExpParts {
  T p;
  T shifted;
};
// Always inlined: on a vector it must take the width of the clone it is called from (a call
// between clones of different widths would pass the vector by another ABI).
template <typename T>
__attribute__((always_inline)) inline ExpParts<T> ExpReduced(T x) {
  constexpr double kLog2e = 1.4426950408889634074;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // ln 2, high bits (exact products)
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  const T shifted = x * kLog2e + kExpShift;
  const T kd = shifted - kExpShift;  // round(x / ln 2)
  const T r = (x - kd * kLn2Hi) - kd * kLn2Lo;
  T p = r * (1.0 / 479001600.0) + 1.0 / 39916800.0;  // 1/12!, 1/11!
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  return {p * r + 1.0, shifted};
}

// exp(x) for x <= 0 (and x >= -inf): ExpReduced, then 2^k added to the exponent's bits. Inputs
// below -700 are taken as -700 (exp(-700) = 1e-304: a softmax term below the largest one's 1 by
// 300 orders, not representable in the sum anyway).
inline double ExpNonPositive(double x) {
  const ExpParts<double> e = ExpReduced(x < kExpFloor ? kExpFloor : x);
  const uint64_t k = std::bit_cast<uint64_t>(e.shifted) - std::bit_cast<uint64_t>(kExpShift);
  return std::bit_cast<double>(std::bit_cast<uint64_t>(e.p) + (k << 52));
}

// The largest head dimension (hidden / heads) the kernel takes; ProbeConfig keeps hidden <= 4096.
inline constexpr int kMaxHeadDim = 4096;

// Keys and values of `n` consecutive rows, head-major and transposed: kt[(h*d + j) * n + t].
struct HeadMajorKv {
  int64_t n = 0;
  int heads = 0;
  int d = 0;
  std::vector<double> kt, vt;
  // From row-major K and V [rows, heads*d].
  void Assign(const double* k, const double* v, int64_t rows, int heads, int d);
};

// out[c] = sum_k x[k] w[k * stride + c] for c in [0, cols): a row of activations times the
// first `cols` columns of a row-major matrix [in, stride] (the probe's projections and output
// layer), in registers a block of columns at a time. Equal to the plain sum up to rounding.
void RowTimesMatrix(const double* x, const double* w, int in, int64_t stride, int64_t cols,
                    double* out);

// Causal attention of one query row over keys [start, start + n_keys) of kv, every head (the
// same result as AttendRow over those rows, up to rounding). q, out: [heads * d]. scores:
// scratch, resized as needed. REQUIRES n_keys >= 1, start + n_keys <= kv.n.
// Heads [head_begin, head_end) only (default: every head); out's other heads are untouched.
void AttendRowFast(const double* q, const HeadMajorKv& kv, int64_t start, int64_t n_keys,
                   double* out, std::vector<double>& scores, int head_begin = 0,
                   int head_end = -1);

// Two query rows at once over keys [start, start + n0) and [start, start + n1), n0 <= n1 (two
// positions of one sequence, the second later): each key and value is loaded once for both.
// The same results as two AttendRowFast calls, up to rounding. REQUIRES 1 <= n0 <= n1,
// start + n1 <= kv.n.
void AttendTwoRowsFast(const double* qa, const double* qb, const HeadMajorKv& kv, int64_t start,
                       int64_t n0, int64_t n1, double* out_a, double* out_b,
                       std::vector<double>& scores, int head_begin = 0, int head_end = -1);

}  // namespace thdpack::probe_internal

#endif  // THDPACK_PROBE_PROBE_ATTENTION_H_
