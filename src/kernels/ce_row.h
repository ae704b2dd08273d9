// src/kernels/ce_row.h: the per-row arithmetic of the CUDA cross-entropy (thdpack/cuda_loss.h),
// in __host__ __device__ functions: the kernels (ce_kernels.cu) and their CPU execution
// (ce_host.cc) run exactly this code, so a machine without a GPU tests it.
//
// Per row of logits z[0..V-1] (fp32 arithmetic whatever the logits' dtype):
//   the state (m, s, t): m the running max, s = sum exp(z - m), t = sum exp(z - m) * (z - m);
//   lse = m + log s; the target's log-probability z_y - lse; the entropy
//   -sum p log p = lse - sum p z = log s - t / s; the gradient (exp(z - lse) - [v == y]) * scale
//   in fp32, rounded once to the output dtype.
// States of disjoint column sets (threads of a block, TP ranks) merge exactly:
//   M = max(m_a, m_b), s = s_a e^(m_a - M) + s_b e^(m_b - M),
//   t = e^(m_a - M) (t_a + s_a (m_a - M)) + (the same for b).
// This header is C++17 with <cmath> and <cstring> only, so that nvcc and the host compiler
// both take it. Thread-safety: pure functions.
#ifndef THDPACK_KERNELS_CE_ROW_H_
#define THDPACK_KERNELS_CE_ROW_H_

#include <stdint.h>

#include <cmath>
#include <cstring>

#ifdef __CUDACC__
#define THDPACK_HD __host__ __device__ __forceinline__
#include <cuda_runtime.h>
#else
#define THDPACK_HD inline
#endif

namespace thdpack::kernels {

// -inf without <limits> (nvcc and host alike).
THDPACK_HD float NegInf() { return -__builtin_huge_valf(); }

THDPACK_HD float Exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);  // ex2.approx with a scale: 2 ulp, enough for fp32 accumulation
#else
  return std::exp(x);
#endif
}
THDPACK_HD float Log(float x) {
#ifdef __CUDA_ARCH__
  return __logf(x);
#else
  return std::log(x);
#endif
}
THDPACK_HD bool IsFinite(float x) { return x - x == 0.0f; }

// ---- dtypes: bit patterns in, float out; float in, bits out (round to nearest even) ----

THDPACK_HD uint32_t FloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
THDPACK_HD float BitsFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

THDPACK_HD float Bf16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }
THDPACK_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half, exact in, round to nearest even out (subnormals, overflow to inf, NaN kept).
THDPACK_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return BitsFloat(sign | 0x7f800000u | (man << 13));  // inf, NaN
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
}
THDPACK_HD uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
    const float a = BitsFloat(abs);
    // a / 2^-24, rounded to nearest even by the float conversion of a value < 2^10
    const float scaled = a * 16777216.0f;
    uint32_t q = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(q);
    if (rest > 0.5f || (rest == 0.5f && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

template <int kDtype>
struct Elem;
template <>
struct Elem<kF32> {
  using Bits = float;
  THDPACK_HD static float ToFloat(float v) { return v; }
  THDPACK_HD static float FromFloat(float v) { return v; }
};
template <>
struct Elem<kBF16> {
  using Bits = uint16_t;
  THDPACK_HD static float ToFloat(uint16_t v) { return Bf16ToFloat(v); }
  THDPACK_HD static uint16_t FromFloat(float v) { return FloatToBf16(v); }
};
template <>
struct Elem<kF16> {
  using Bits = uint16_t;
  THDPACK_HD static float ToFloat(uint16_t v) { return HalfToFloat(v); }
  THDPACK_HD static uint16_t FromFloat(float v) { return FloatToHalf(v); }
};

// ---- the online state of a row ----

struct RowState {
  float m;  // running max (-inf: nothing finite yet)
  float s;  // sum exp(z - m)
  float t;  // sum exp(z - m) * (z - m)
};

THDPACK_HD RowState EmptyState() { return RowState{NegInf(), 0.0f, 0.0f}; }

// Adds one logit. -inf adds nothing; +inf and NaN make the row non-finite (caught at the end).
THDPACK_HD void AddLogit(RowState& st, float z) {
  if (z == NegInf()) return;  // exp(-inf) = 0 (and -inf - -inf would be NaN)
  if (z <= st.m) {
    const float d = z - st.m;
    const float e = Exp(d);
    st.s += e;
    st.t += e * d;
    return;
  }
  if (!(z > st.m)) {  // NaN: poison the state
    // m = +inf keeps s NaN whatever follows: every later logit takes the first branch and adds
    // exp(z - inf) = 0 (or NaN) to it. With m = NaN, as first written, the next logit came back
    // here and overwrote s with itself, so a NaN followed by other logits of the same thread
    // left a finite, unflagged row.
    st.m = -NegInf();
    st.s = z;
    return;
  }
  // A new max: rescale what was summed relative to the old one. Where that rescale is 0 (the
  // old terms underflow: an old max of -FLT_MAX, a masked_fill with finfo.min), so is their
  // part of t, whose s * d may have overflowed to -inf (0 * -inf would be NaN).
  const float d = st.m - z;  // < 0, or -inf on the first finite logit
  const float e = st.s > 0.0f ? Exp(d) : 0.0f;
  st.t = e > 0.0f ? e * (st.t + st.s * d) : 0.0f;
  st.s = st.s * e + 1.0f;
  st.m = z;
}

// Version 2 of the fold: kN logits (one 16-byte vector) with ONE rescale - the vector's max
// first, then every term relative to the running max, without a branch per element (version 1,
// AddLogit per element, compares and may rescale at every logit). Where the vector holds
// nothing above -inf (every logit -inf, or NaN) it goes through AddLogit one by one, so a NaN
// still poisons the state and an empty state stays empty. A NaN among finite logits poisons s
// through exp(NaN); t's factor z - m is clamped at -FLT_MAX so that a logit of -inf (whose
// term is 0) adds 0 * -FLT_MAX = 0 rather than 0 * -inf = NaN.
template <int kN>
THDPACK_HD void AddLogits(RowState& st, const float (&z)[kN]) {
  float vmax = z[0];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int e = 1; e < kN; ++e) vmax = fmaxf(vmax, z[e]);  // a NaN never wins: caught by exp
  if (!(vmax > NegInf())) {
    for (int e = 0; e < kN; ++e) AddLogit(st, z[e]);
    return;
  }
  if (vmax > st.m) {  // one rescale, as AddLogit's for a new max (the same guards)
    const float d = st.m - vmax;
    const float e = st.s > 0.0f ? Exp(d) : 0.0f;
    st.t = e > 0.0f ? e * (st.t + st.s * d) : 0.0f;
    st.s = st.s * e;
    st.m = vmax;
  }
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int e = 0; e < kN; ++e) {
    const float d = z[e] - st.m;  // <= 0 (NaN for a NaN logit)
    const float p = Exp(d);       // 1 exactly at the max: s >= 1 for a state holding a logit
    st.s += p;
    st.t += p * fmaxf(d, -3.402823466e38f);
  }
}

// s is 0 exactly for a state that holds nothing finite (every logit -inf), NaN for a poisoned
// one, >= 1 otherwise (the max contributes 1).
THDPACK_HD RowState MergeStates(const RowState& a, const RowState& b) {
  if (a.s != a.s) return a;  // NaN stays NaN
  if (b.s != b.s) return b;
  if (a.s == 0.0f) return b;
  if (b.s == 0.0f) return a;
  const float m = a.m > b.m ? a.m : b.m;
  const float da = a.m - m, db = b.m - m;
  const float ea = Exp(da), eb = Exp(db);
  // A side whose rescale underflows to 0 adds nothing to t (its s * d may be -inf: see
  // AddLogit).
  const float ta = ea > 0.0f ? ea * (a.t + a.s * da) : 0.0f;
  const float tb = eb > 0.0f ? eb * (b.t + b.s * db) : 0.0f;
  return RowState{m, a.s * ea + b.s * eb, ta + tb};
}

THDPACK_HD float RowLse(const RowState& st) { return st.m + Log(st.s); }
THDPACK_HD float RowEntropy(const RowState& st) { return Log(st.s) - st.t / st.s; }
// Whether the row's log-sum-exp is finite (every counted row must have one).
THDPACK_HD bool RowFinite(const RowState& st) { return st.s > 0.0f && IsFinite(RowLse(st)); }

// The gradient of one logit: (exp(z - lse) - [target]) * scale, in fp32.
THDPACK_HD float LogitGrad(float z, float lse, bool is_target, float scale) {
  return (Exp(z - lse) - (is_target ? 1.0f : 0.0f)) * scale;
}

// The gradient of one logit x of a row's (log-probability, entropy) outputs, each with its
// incoming gradient (g_lp, g_en; token_logprobs' backward): with z = x * inv_temp, lp = z - lse
// and p = exp(lp), d logprob / dz = [target] - p and d entropy / dz = -p (lp + entropy), so
//   dx = inv_temp ([target] g_lp - p (g_lp + g_en (lp + entropy))), in fp32.
THDPACK_HD float LogprobEntropyGrad(float x, float inv_temp, float lse, float entropy,
                                    bool is_target, float g_lp, float g_en) {
  const float lp = x * inv_temp - lse;
  const float p = Exp(lp);
  return ((is_target ? g_lp : 0.0f) - p * (g_lp + g_en * (lp + entropy))) * inv_temp;
}

// ---- the columns one thread of a block visits ----
//
// Thread j of n visits the vectors of kVec consecutive columns k*kVec .. k*kVec + kVec - 1 for
// k = j, j + n, ... below V / kVec when `vectors` (both rows 16-byte aligned: one 16-byte load
// or store each), then the tail columns past the last whole vector one by one (j, j + n, ... from
// there); without `vectors`, the columns j, j + n, ... one by one. Every column is visited
// exactly once by exactly one thread (ce_host.cc runs this very function, and its tests cover
// V below, at and above multiples of every block size, aligned and not).
template <typename VisitVector, typename Visit>
THDPACK_HD void ForEachColumn(int j, int n, int64_t V, int kVec, bool vectors,
                              VisitVector&& visit_vector, Visit&& visit) {
  int64_t tail_start = 0;
  if (vectors) {
    const int64_t whole = V / kVec;
    for (int64_t k = j; k < whole; k += n) visit_vector(k);
    tail_start = whole * kVec;
  }
  for (int64_t v = tail_start + j; v < V; v += n) visit(v);
}

// ForEachColumn's visits in the same order, with the vectors handed kBatch at a time: a batch
// is the vectors k, k + n, ..., k + (kBatch - 1) n, so that a kernel issues their kBatch
// 16-byte loads before it uses the first (version 2; version 1 has one load in flight per
// thread). The vectors left when fewer than kBatch remain go one by one, then the tail.
template <int kBatch, typename VisitBatch, typename VisitVector, typename Visit>
THDPACK_HD void ForEachColumnBatched(int j, int n, int64_t V, int kVec, bool vectors,
                                     VisitBatch&& visit_batch, VisitVector&& visit_vector,
                                     Visit&& visit) {
  int64_t tail_start = 0;
  if (vectors) {
    const int64_t whole = V / kVec;
    const int64_t step = static_cast<int64_t>(n) * kBatch;
    int64_t k = j;
    for (; k + static_cast<int64_t>(n) * (kBatch - 1) < whole; k += step) visit_batch(k, n);
    for (; k < whole; k += n) visit_vector(k);
    tail_start = whole * kVec;
  }
  for (int64_t v = tail_start + j; v < V; v += n) visit(v);
}

// The column of vector k (kN columns from k * kN) that holds the target y, or -1: one 64-bit
// compare per vector, and a 32-bit one against the unrolled lane index per element (version
// 1 compares the 64-bit column with y at every element).
THDPACK_HD int TargetLane(int64_t k, int kN, int64_t y) {
  const int64_t off = y - k * kN;
  return off >= 0 && off < kN ? static_cast<int>(off) : -1;
}

// The gradient scaled by the incoming gradient (ScaleGradient): one fp32 product, rounded once.
THDPACK_HD float ScaledGrad(float g, float factor) { return g * factor; }

// The kernels' versions (CudaLossArgs::version): 1 the first, kept beside the second to time
// and check them side by side; 2 (the default) the first's arithmetic with AddLogits, batched
// loads, TargetLane, the hardware conversions of the dtypes and a register cap for two
// blocks per multiprocessor.
inline constexpr int kVersionFirst = 1;
inline constexpr int kVersionLatest = 2;

// The error flag of a call: kind << 48 | token. First writer wins (atomicCAS from 0).
enum ErrorKind : int { kLabelOutOfRange = 1, kNonFiniteRow = 2, kBadMask = 3 };
THDPACK_HD unsigned long long ErrorCode(int kind, int64_t token) {
  return (static_cast<unsigned long long>(kind) << 48) |
         (static_cast<unsigned long long>(token) & 0xffffffffffffull);
}

// ---- which rows count, and a counted row's outputs ----

inline constexpr int64_t kIgnoreIndex = -100;
inline constexpr int kCounted = 0;
inline constexpr int kNotCounted = -1;

// The rule of thdpack/loss.h for a row with `label` and `mask`: kCounted; kNotCounted (label
// -100 or mask 0); or the ErrorKind of a bad row (a mask other than 0 and 1, a counted label
// outside [0, vocab_total)), which is not counted either.
THDPACK_HD int RowRule(int64_t label, float mask, int64_t vocab_total) {
  if (mask != 0.0f && mask != 1.0f) return kBadMask;
  if (label == kIgnoreIndex || mask == 0.0f) return kNotCounted;
  if (label < 0 || label >= vocab_total) return kLabelOutOfRange;
  return kCounted;
}

// A counted row's log-sum-exp, log p(target) = target - lse and entropy from its state; false
// (outputs untouched) when the log-sum-exp is not finite.
THDPACK_HD bool RowOutputs(const RowState& st, float target, float& lse, float& logprob,
                           float& entropy) {
  if (!RowFinite(st)) return false;
  lse = RowLse(st);
  logprob = target - lse;
  entropy = RowEntropy(st);
  return true;
}

}  // namespace thdpack::kernels

#endif  // THDPACK_KERNELS_CE_ROW_H_
