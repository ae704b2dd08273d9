// The fast cross-entropy: rows split over threads; each row read once, in chunks of kChunk
// logits. Per chunk, one pass converts to float (bf16 -> float is exact) and takes
// e = exp(z - ref) with a vectorised polynomial exp, summing e and e*(z - ref), where ref is
// the row's running max so far (a chunk whose own max lies more than kSlack above it is redone
// relative to its max); the chunk sums merge into the row's (max, sum, shifted sum) - the
// online softmax, rescaled per chunk rather than per element. With the gradient, e is kept in
// a per-thread row scratch (V floats, cache-resident) and grad = e * exp(ref - lse) * scale
// (minus scale at the label) is written in the logits' dtype vector by vector inside the NEXT
// row's first pass (two scratch rows): the memory-bound stores overlap the compute-bound exps. Every
// logit costs one exp and the logits are read from memory once.
//
// Vectors are GCC vector extensions whose width is a template parameter, one register wide
// on each ISA: 16 floats (one zmm) in the x86-64-v4 (AVX-512) functions, 8 (one ymm) in the
// x86-64-v3 (AVX2) ones, 4 (one xmm) in the baseline ones. A wider vector than the registers
// (16 floats as two ymm on AVX2) makes the loop's live vectors spill to the stack. Each ISA's
// functions are compiled with target("arch=...") and one set is picked once, from
// __builtin_cpu_supports, so the build stays portable. Lane sums are reduced in a fixed order:
// a token's values do not depend on the thread count (they do, in the last bits, on the ISA).
//
// This file holds the float32 and bfloat16 kernels and their per-ISA builds; the float64 rows
// are cross_entropy_f64.cc, the choice of ISA and the public functions cross_entropy.cc.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "loss/cross_entropy_kernels.h"

// The vectors below never cross a function boundary that is not inlined.
#pragma GCC diagnostic ignored "-Wpsabi"

#define THDPACK_INLINE inline __attribute__((always_inline))

namespace thdpack {
namespace {

using loss_internal::Job;
using loss_internal::kChunk;
using loss_internal::KernelSet;
using loss_internal::RowStats;

// The vector types of one width: kL floats (F), their bits (U), kL bf16 (H). Every kernel
// below is a template over one of these.
template <int kLanes>
struct Vec;
#ifdef THDPACK_X86_ISAS
template <>
struct Vec<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef uint32_t U __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
  static constexpr int64_t kL = 16;
};
template <>
struct Vec<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef uint32_t U __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16)));
  static constexpr int64_t kL = 8;
};
#endif
template <>
struct Vec<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef uint32_t U __attribute__((vector_size(16)));
  typedef uint16_t H __attribute__((vector_size(8)));
  static constexpr int64_t kL = 4;
};
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename F>
THDPACK_INLINE F Splat(float x) {
  return F{} + x;
}

// ExpV's domain starts at kExpFloor: its callers clamp the argument first (ClampBelow), and the
// shifted-sum term e * d must use that clamped d too. A logit of -FLT_MAX (masked_fill with
// finfo.min) has d near -3.4e38, and exp(-87) * d would add about -5.5 to w per such logit (the
// entropy wrong by tens) where the true term is 0; with the clamped d it adds -1.4e-36.
constexpr float kExpFloor = -87.0f;

template <typename VecT>
THDPACK_INLINE typename VecT::F ClampBelow(const typename VecT::F& x, const typename VecT::F& lo) {
  return lo > x ? lo : x;  // maxps(lo, x): NaN passes through
}

// exp(x) for x in [kExpFloor, ~0] (and a little above; the caller clamps below): range
// reduction x = n ln2 + r (|r| <= ln2/2, ln2 in two parts), then a degree-6 polynomial fitted
// for relative error (max 1.9e-9 in exact arithmetic, so float rounding dominates: at most
// 1.06 ulp with FMA, checked on every float in [-87, 16) against exp in double), and 2^n built
// in the exponent bits. n is rounded by adding 1.5 * 2^23, whose float bits then hold n in the
// low bits: (bits + 127) << 23 is 2^n, with no float-to-int conversion. exp(-87) ~ 1.6e-38;
// the callers zero the lanes whose logit is -inf; the clamp keeps NaN, so NaN stays NaN.
template <typename VecT>
THDPACK_INLINE typename VecT::F ExpV(const typename VecT::F& x) {
  using F = typename VecT::F;
  using U = typename VecT::U;
  const F magic = Splat<F>(12582912.0f);  // 1.5 * 2^23
  const F nf = x * 1.44269504088896341f + magic;  // round(x / ln2) in the low mantissa bits
  const F n = nf - magic;
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = Splat<F>(1.383684576e-3f);
  p = p * r + 8.374815807e-3f;
  p = p * r + 4.166822508e-2f;
  p = p * r + 1.666641980e-1f;
  p = p * r + 4.999999106e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const U bits = ((U)nf + 127u) << 23;
  return p * (F)bits;
}

template <typename VecT>
THDPACK_INLINE typename VecT::F Load(const float* p) {
  typename VecT::F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename VecT>
THDPACK_INLINE typename VecT::F Load(const uint16_t* p) {
  typename VecT::H h;
  std::memcpy(&h, p, sizeof(h));
  const typename VecT::U u = __builtin_convertvector(h, typename VecT::U) << 16;
  return (typename VecT::F)u;
}
template <typename VecT>
THDPACK_INLINE void Store(float* p, const typename VecT::F& v) {
  std::memcpy(p, &v, sizeof(v));
}
template <typename VecT>
THDPACK_INLINE void Store(uint16_t* p, const typename VecT::F& v) {
  using U = typename VecT::U;
  const U u = (U)v;
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  const typename VecT::H h = __builtin_convertvector(rounded, typename VecT::H);
  std::memcpy(p, &h, sizeof(h));
}
// The gradient store: with kNative (bf16 only, in the AVX-512 function below, run only where
// the CPU has AVX512-BF16) one vcvtneps2bf16 does the round to nearest even that Store does with
// integer operations; the results are the same bits except below 2^-126 (float denormals),
// which the instruction flushes to 0.
template <typename VecT, bool kNative, typename Out>
THDPACK_INLINE void StoreGrad(Out* p, const typename VecT::F& v) {
#ifdef THDPACK_NATIVE_BF16
  if constexpr (kNative && VecT::kL == 16 && std::is_same_v<Out, uint16_t>) {
    typename VecT::H h;
    asm("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(v));
    std::memcpy(p, &h, sizeof(h));
    return;
  }
#endif
  Store<VecT>(p, v);
}
THDPACK_INLINE float ToFloat(float x) { return x; }
THDPACK_INLINE float ToFloat(uint16_t x) { return BFloat16{x}.ToFloat(); }
THDPACK_INLINE void FromFloat(float* p, float v) { *p = v; }
THDPACK_INLINE void FromFloat(uint16_t* p, float v) { *p = BFloat16::FromFloat(v).bits; }

template <typename VecT>
THDPACK_INLINE float HMax(const typename VecT::F& v) {
  float m = v[0];
  for (int i = 1; i < VecT::kL; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
// Pairwise, fixed order: lane i with lane i + half, halving until one is left.
template <typename VecT>
THDPACK_INLINE float HSum(const typename VecT::F& v) {
  float a[VecT::kL];
  for (int i = 0; i < VecT::kL; ++i) a[i] = v[i];
  for (int half = VecT::kL / 2; half > 0; half /= 2) {
    for (int i = 0; i < half; ++i) a[i] += a[i + half];
  }
  return a[0];
}

// One pass over a chunk: e = exp(z - ref) (0 where z = -inf), sums of e and e*(z - ref), the
// chunk max; with kGrad the e are kept in scratch (and ExpPass also writes a pending row's
// gradient, pin * pf to pout, on the full vectors). The last partial vector comes from tail
// (padded with -inf).
template <typename VecT>
struct ChunkSums {
  typename VecT::F s, w, max;
};
// The exact pass: -inf logits (padded vocabulary columns, the tail) are masked to 0.
template <typename VecT, typename In, bool kGrad>
THDPACK_INLINE ChunkSums<VecT> ExpPassMasked(const In* src, int64_t full, int64_t nv,
                                          const float* tail, float ref, float* scratch) {
  using F = typename VecT::F;
  const F vref = Splat<F>(ref);
  const F ninf = Splat<F>(kNegInf);
  const F zero = Splat<F>(0.0f);
  const F lo = Splat<F>(kExpFloor);
  ChunkSums<VecT> c{zero, zero, ninf};
  for (int64_t j = 0; j < nv; j += VecT::kL) {
    const F z = j < full ? Load<VecT>(src + j) : Load<VecT>(tail);
    c.max = z > c.max ? z : c.max;
    const F d = ClampBelow<VecT>(z - vref, lo);
    const F e = z == ninf ? zero : ExpV<VecT>(d);
    c.s += e;
    c.w += z == ninf ? zero : e * d;
    if constexpr (kGrad) Store<VecT>(scratch + j, e);
  }
  return c;
}
// The common case, a chunk of finite logits: no masking in the loop (two selects and a compare
// fewer per vector), only the chunk's min tracked; a chunk that holds -inf is redone by
// ExpPassMasked. The full vectors only; the caller adds the tail with ExpPassMasked.
template <typename VecT, typename In, bool kGrad, bool kNative = false>
THDPACK_INLINE ChunkSums<VecT> ExpPass(const In* src, int64_t full, int64_t nv, const float* tail,
                                    float ref, float* scratch, In* pout = nullptr,
                                    const float* pin = nullptr, float pf = 0) {
  using F = typename VecT::F;
  const F vpf = Splat<F>(pf);
  const F vref = Splat<F>(ref);
  const F ninf = Splat<F>(kNegInf);
  const F zero = Splat<F>(0.0f);
  const F lo = Splat<F>(kExpFloor);
  ChunkSums<VecT> c{zero, zero, ninf};
  F mn = Splat<F>(std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += VecT::kL) {
    const F z = Load<VecT>(src + j);
    c.max = z > c.max ? z : c.max;
    mn = z < mn ? z : mn;
    const F d = ClampBelow<VecT>(z - vref, lo);
    const F e = ExpV<VecT>(d);
    c.s += e;
    c.w += e * d;
    if constexpr (kGrad) {
      Store<VecT>(scratch + j, e);
      if (pout != nullptr) StoreGrad<VecT, kNative>(pout + j, Load<VecT>(pin + j) * vpf);
    }
  }
  bool has_ninf = false;
  for (int i = 0; i < VecT::kL; ++i) has_ninf |= mn[i] == kNegInf;
  if (has_ninf) return ExpPassMasked<VecT, In, kGrad>(src, full, nv, tail, ref, scratch);
  if (full < nv) {
    const ChunkSums<VecT> t = ExpPassMasked<VecT, In, kGrad>(nullptr, 0, VecT::kL, tail, ref,
                                                       kGrad ? scratch + full : nullptr);
    c.s += t.s;
    c.w += t.w;
    c.max = t.max > c.max ? t.max : c.max;
  }
  return c;
}

// A row whose gradient is still to be written: its exps (scratch, relative to chunk_ref per
// chunk) and lse. It is written while the NEXT row is read, vector for vector with the next
// row's exps, so that the stores of one row overlap the exps of the next (the forward is
// compute-bound, the gradient's writes memory-bound) instead of following them. Measured on
// one core (bf16, T = 2048): 14% faster at V = 151936, 4.5% at V = 32000.
template <typename VecT, typename In, bool kNative>
struct PendingGrad {
  In* out = nullptr;  // null: nothing pending
  const float* scratch = nullptr;
  const float* chunk_ref = nullptr;
  float lse = 0;
  float scale = 0;
  int64_t vocab = 0;
  int64_t label = -1;  // the label's local column, or -1 when it is not in this shard

  THDPACK_INLINE float Factor(int64_t ci) const {
    return chunk_ref[ci] == kNegInf ? 0.0f : std::exp(chunk_ref[ci] - lse) * scale;
  }
  // grad = e * exp(ref - lse) * scale on chunk ci.
  THDPACK_INLINE void WriteChunk(int64_t ci) const {
    const int64_t c0 = ci * kChunk;
    const int64_t n = std::min(kChunk, vocab - c0);
    const float f = Factor(ci);
    const typename VecT::F vf = Splat<typename VecT::F>(f);
    int64_t j = 0;
    for (; j + VecT::kL <= n; j += VecT::kL) {
      StoreGrad<VecT, kNative>(out + c0 + j, Load<VecT>(scratch + c0 + j) * vf);
    }
    for (; j < n; ++j) FromFloat(out + c0 + j, scratch[c0 + j] * f);
  }
  // Elements [from, n) of chunk ci, one by one (from: the vectors already written).
  THDPACK_INLINE void WriteRest(int64_t ci, int64_t from) const {
    const int64_t c0 = ci * kChunk;
    const int64_t n = std::min(kChunk, vocab - c0);
    const float f = Factor(ci);
    for (int64_t j = from; j < n; ++j) FromFloat(out + c0 + j, scratch[c0 + j] * f);
  }
  // After every chunk: minus scale at the label; nothing pending afterwards.
  THDPACK_INLINE void Finish() {
    if (label >= 0) FromFloat(out + label, scratch[label] * Factor(label / kChunk) - scale);
    out = nullptr;
  }
  THDPACK_INLINE void WriteAll() {
    for (int64_t ci = 0; ci * kChunk < vocab; ++ci) WriteChunk(ci);
    Finish();
  }
};

// Forward of one row (with kGrad, its exps kept for the gradient, and the pending row's
// gradient written along the way). Each chunk is read once: its exps are
// taken relative to the row's running max so far (for the first chunk, its first vector's
// max), and only when the chunk's own max exceeds that reference by more than kSlack (a
// large logit late in the row) is the chunk redone relative to its max. The row state
// (M, S, W) is always relative to the exact running max. tail: kL floats; scratch: V rounded
// up to kL floats; chunk_ref: one float per chunk (the reference its exps are relative to);
// pending (kGrad): the previous row's gradient, written and finished here (rows have the same
// number of chunks).
constexpr float kSlack = 16.0f;  // e^16 ~ 8.9e6: chunk sums stay far below FLT_MAX
template <typename VecT, typename In, bool kGrad, bool kNative>
THDPACK_INLINE void RowFloat(const Job& job, int64_t t, float* tail, float* scratch,
                             float* chunk_ref, PendingGrad<VecT, In, kNative>* pending) {
  using F = typename VecT::F;
  constexpr int64_t kL = VecT::kL;
  const int64_t V = job.vocab;
  const In* row = reinterpret_cast<const In*>(job.logits) + t * V;
  float M = kNegInf, S = 0.0f, W = 0.0f;
  int64_t ci = 0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk, ++ci) {
    const int64_t n = std::min(kChunk, V - c0);
    const int64_t nv = (n + kL - 1) / kL * kL;
    const int64_t full = n / kL * kL;
    if (full < n) {
      for (int64_t k = 0; k < kL; ++k) tail[k] = full + k < n ? ToFloat(row[c0 + full + k]) : kNegInf;
    }
    float ref = M;
    if (ref == kNegInf) ref = HMax<VecT>(full > 0 ? Load<VecT>(row + c0) : Load<VecT>(tail));
    float* sc_out = kGrad ? scratch + c0 : nullptr;
    // The pending row's gradient on the same columns is written vector by vector alongside
    // this chunk's first pass (on its own when there is none).
    const bool pend = kGrad && pending->out != nullptr;
    ChunkSums<VecT> c;
    if (ref != kNegInf) {
      if (pend) {
        c = ExpPass<VecT, In, kGrad, kNative>(row + c0, full, nv, tail, ref, sc_out,
                                           pending->out + c0, pending->scratch + c0,
                                           pending->Factor(ci));
        pending->WriteRest(ci, full);
      } else {
        c = ExpPass<VecT, In, kGrad>(row + c0, full, nv, tail, ref, sc_out);
      }
    } else if (pend) {
      pending->WriteChunk(ci);
    }
    float m = ref == kNegInf ? kNegInf : HMax<VecT>(c.max);
    if (ref == kNegInf || m > ref + kSlack) {
      // No usable reference yet, or one too far below this chunk's max: redo it exactly.
      if (ref == kNegInf) {
        F mx = Splat<F>(kNegInf);
        for (int64_t j = 0; j < nv; j += kL) {
          const F z = j < full ? Load<VecT>(row + c0 + j) : Load<VecT>(tail);
          mx = z > mx ? z : mx;
        }
        m = HMax<VecT>(mx);
      }
      if (m == kNegInf) {  // every logit of the chunk is -inf: it adds nothing
        if constexpr (kGrad) std::fill(scratch + c0, scratch + c0 + nv, 0.0f);
        chunk_ref[ci] = kNegInf;
        continue;
      }
      ref = m;
      c = ExpPass<VecT, In, kGrad>(row + c0, full, nv, tail, ref, sc_out);
    }
    chunk_ref[ci] = ref;
    const float sc = HSum<VecT>(c.s), wc = HSum<VecT>(c.w);
    if (m > M) {
      if (M == kNegInf) {
        S = 0.0f;
        W = 0.0f;
      } else {
        // A rescale that underflows to 0 drops the old terms whole: (M - m) * S may have
        // overflowed to -inf (an old max of -FLT_MAX), and 0 * -inf would be NaN.
        const float a = std::exp(M - m);
        W = a > 0.0f ? a * (W + (M - m) * S) : 0.0f;
        S = a * S;
      }
      M = m;
    }
    const float b = std::exp(ref - M);  // ref <= M
    if (b > 0.0f) {  // as above: a chunk far below the max adds nothing
      S += b * sc;
      W += b * (wc + (ref - M) * sc);
    }
  }
  job.stats[t] = RowStats{M, S, W};
  if constexpr (kGrad) {
    if (pending->out != nullptr) pending->Finish();
    const int64_t y = job.labels[t] - job.vocab_start;
    *pending = PendingGrad<VecT, In, kNative>{reinterpret_cast<In*>(job.grad) + t * V,
                                           scratch,
                                           chunk_ref,
                                           M + std::log(S),
                                           static_cast<float>(job.scale),
                                           V,
                                           (y >= 0 && y < V) ? y : -1};
  }
}

template <typename VecT, typename In, bool kNative = false>
THDPACK_INLINE void ForwardRowsFloat(const Job& job, int64_t begin, int64_t end) {
  constexpr int64_t kL = VecT::kL;
  const int64_t V = job.vocab;
  const int64_t n_chunks = (V + kChunk - 1) / kChunk;
  std::vector<float> tail(kL);
  // With the gradient, two row buffers: one row's exps are written out as gradient while the
  // next row's are computed into the other.
  const size_t scratch_size = job.grad ? static_cast<size_t>((V + kL - 1) / kL * kL) : 0;
  std::vector<float> scratch[2] = {std::vector<float>(scratch_size),
                                   std::vector<float>(scratch_size)};
  std::vector<float> chunk_ref[2] = {std::vector<float>(static_cast<size_t>(n_chunks)),
                                     std::vector<float>(static_cast<size_t>(n_chunks))};
  PendingGrad<VecT, In, kNative> pending;
  int cur = 0;
  for (int64_t t = begin; t < end; ++t) {
    if (job.labels[t] < 0) {
      if (job.grad) {
        std::memset(job.grad + t * V * int64_t{sizeof(In)}, 0, static_cast<size_t>(V) * sizeof(In));
      }
      continue;
    }
    if (job.grad) {
      RowFloat<VecT, In, true, kNative>(job, t, tail.data(), scratch[cur].data(),
                                     chunk_ref[cur].data(), &pending);
      cur ^= 1;
    } else {
      RowFloat<VecT, In, false, kNative>(job, t, tail.data(), nullptr, chunk_ref[0].data(), nullptr);
    }
  }
  if (pending.out != nullptr) pending.WriteAll();
}

// Gradient only (vocab-parallel phase 3): grad = exp(z - lse) * scale, minus scale at the label.
template <typename VecT, typename In>
THDPACK_INLINE void GradRowsFloat(const Job& job, int64_t begin, int64_t end) {
  using F = typename VecT::F;
  constexpr int64_t kL = VecT::kL;
  const int64_t V = job.vocab;
  const F ninf = Splat<F>(kNegInf);
  const F zero = Splat<F>(0.0f);
  const float scale = static_cast<float>(job.scale);
  const F vscale = Splat<F>(scale);
  const F lo = Splat<F>(kExpFloor);
  for (int64_t t = begin; t < end; ++t) {
    const In* row = reinterpret_cast<const In*>(job.logits) + t * V;
    In* out = reinterpret_cast<In*>(job.grad) + t * V;
    if (job.labels[t] < 0) {
      std::memset(out, 0, static_cast<size_t>(V) * sizeof(In));
      continue;
    }
    const float lse = static_cast<float>(job.lse[t]);
    const F vl = Splat<F>(lse);
    int64_t j = 0;
    for (; j + kL <= V; j += kL) {
      const F z = Load<VecT>(row + j);
      Store<VecT>(out + j,
                  z == ninf ? zero : ExpV<VecT>(ClampBelow<VecT>(z - vl, lo)) * vscale);
    }
    for (; j < V; ++j) {
      const float z = ToFloat(row[j]);
      FromFloat(out + j, z == kNegInf ? 0.0f : std::exp(z - lse) * scale);
    }
    const int64_t y = job.labels[t] - job.vocab_start;
    if (y >= 0 && y < V) {
      FromFloat(out + y, std::exp(ToFloat(row[y]) - lse) * scale - scale);
    }
  }
}

// One set of kernels per ISA, each compiled for its ISA with its width; Kernels() picks one.
void ForwardF32Baseline(const Job& job, int64_t b, int64_t e) {
  ForwardRowsFloat<Vec<4>, float>(job, b, e);
}
void ForwardBF16Baseline(const Job& job, int64_t b, int64_t e) {
  ForwardRowsFloat<Vec<4>, uint16_t>(job, b, e);
}
void GradF32Baseline(const Job& job, int64_t b, int64_t e) {
  GradRowsFloat<Vec<4>, float>(job, b, e);
}
void GradBF16Baseline(const Job& job, int64_t b, int64_t e) {
  GradRowsFloat<Vec<4>, uint16_t>(job, b, e);
}
constexpr KernelSet kBaselineKernels = {ForwardF32Baseline, ForwardBF16Baseline, GradF32Baseline,
                                        GradBF16Baseline};

#ifdef THDPACK_X86_ISAS
#define THDPACK_V3 __attribute__((target("arch=x86-64-v3")))
#define THDPACK_V4 __attribute__((target("arch=x86-64-v4")))
THDPACK_V3 void ForwardF32V3(const Job& job, int64_t b, int64_t e) {
  ForwardRowsFloat<Vec<8>, float>(job, b, e);
}
THDPACK_V3 void ForwardBF16V3(const Job& job, int64_t b, int64_t e) {
  ForwardRowsFloat<Vec<8>, uint16_t>(job, b, e);
}
THDPACK_V3 void GradF32V3(const Job& job, int64_t b, int64_t e) {
  GradRowsFloat<Vec<8>, float>(job, b, e);
}
THDPACK_V3 void GradBF16V3(const Job& job, int64_t b, int64_t e) {
  GradRowsFloat<Vec<8>, uint16_t>(job, b, e);
}
constexpr KernelSet kV3Kernels = {ForwardF32V3, ForwardBF16V3, GradF32V3, GradBF16V3};

THDPACK_V4 void ForwardF32V4(const Job& job, int64_t b, int64_t e) {
  ForwardRowsFloat<Vec<16>, float>(job, b, e);
}
THDPACK_V4 void ForwardBF16V4(const Job& job, int64_t b, int64_t e) {
  ForwardRowsFloat<Vec<16>, uint16_t>(job, b, e);
}
THDPACK_V4 void GradF32V4(const Job& job, int64_t b, int64_t e) {
  GradRowsFloat<Vec<16>, float>(job, b, e);
}
THDPACK_V4 void GradBF16V4(const Job& job, int64_t b, int64_t e) {
  GradRowsFloat<Vec<16>, uint16_t>(job, b, e);
}
constexpr KernelSet kV4Kernels = {ForwardF32V4, ForwardBF16V4, GradF32V4, GradBF16V4};
#endif

}  // namespace

namespace loss_internal {

#ifdef THDPACK_X86_ISAS
// The bf16 forward with the AVX512-BF16 gradient store (see StoreGrad); called only with the
// x86-64-v4 kernels where the CPU also has AVX512-BF16 (NativeBf16Store).
THDPACK_V4 void ForwardBF16V4Native(const Job& job, int64_t b, int64_t e) {
  ForwardRowsFloat<Vec<16>, uint16_t, true>(job, b, e);
}
#endif

const KernelSet& Kernels(loss_internal::Isa isa) {
  switch (isa) {
#ifdef THDPACK_X86_ISAS
    case loss_internal::Isa::kX86_64V4: return kV4Kernels;
    case loss_internal::Isa::kX86_64V3: return kV3Kernels;
#endif
    default: return kBaselineKernels;
  }
}

}  // namespace loss_internal
}  // namespace thdpack
