// The CUDA cross-entropy kernels (thdpack/cuda_loss.h): one block per row of logits.
//
// Each thread folds its columns (ForEachColumn of ce_row.h: 16-byte vectors while the rows are
// aligned, then the tail) into an online state (max, sum exp, sum exp * shift); the block
// merges the states by a butterfly within each warp, then a butterfly over the warps' results,
// so every thread ends with the row's state (no broadcast). The fused kernel then reads the row
// again - from L2 when it is still there - and writes the gradient in the same vectors. Every
// formula is ce_row.h's, which ce_host.cc runs on the CPU in the same order.
//
// The one-read kernel (OneReadKernel, below) stages each row in shared memory instead, split
// over a thread-block cluster when it is larger than one block's share, so that the logits
// are read once.
//
// Block size: 256 threads below 16,384 columns, 512 below 65,536, else 1024
// (CudaLossBlockThreads): enough 16-byte loads in flight per row to cover the latency of HBM
// with one block per row, and at V = 151,936 bf16 about 19 vectors per thread. To be tuned on
// the GPU by bench/loss_cuda.py.
//
// Versions (CudaLossArgs::version, ce_row.h's kVersion*): every kernel is compiled twice, and
// the first version stays beside the second so that the tests check both against the CPU
// execution and the benchmark times them side by side (llm.c's dev/cuda habit). Version 2
// changes no formula, only how many instructions an element costs and how many loads are in
// flight: AddLogits (one rescale per 16-byte vector, no branch per element) instead of
// AddLogit; kBatch 16-byte loads issued before the first is used (ForEachColumnBatched);
// TargetLane's one 64-bit compare per vector instead of one per element; the hardware
// conversions (cvt.rn.bf16x2.f32 and cvt.rn.f16.f32 round to nearest even as ce_row.h's
// FloatToBf16 and FloatToHalf do, except that a NaN comes out as the canonical NaN); and a
// register cap of 32 (__launch_bounds__ with two blocks of 1024 threads per multiprocessor),
// so that one block's merge and barriers overlap the other's loads.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/ce_launch.h"
#include "kernels/ce_row.h"

namespace thdpack::kernels {
namespace {

struct Stats4 {
  float max, sum_exp, sum_exp_shifted, target;
};

__device__ __forceinline__ RowState WarpMerge(RowState st) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const RowState other{__shfl_xor_sync(0xffffffffu, st.m, off),
                         __shfl_xor_sync(0xffffffffu, st.s, off),
                         __shfl_xor_sync(0xffffffffu, st.t, off)};
    st = MergeStates(st, other);
  }
  return st;
}

// Lane 0's state in every lane (the butterfly's lanes may differ in the last bit where the
// compiler fused a multiply-add).
__device__ __forceinline__ RowState FromLane0(const RowState& st) {
  return RowState{__shfl_sync(0xffffffffu, st.m, 0), __shfl_sync(0xffffffffu, st.s, 0),
                  __shfl_sync(0xffffffffu, st.t, 0)};
}

// Every thread returns the same merged state of the block: lane 0's of the butterfly over the
// warps' lane-0 states (every warp computes it from the same inputs).
template <int kThreads>
__device__ __forceinline__ RowState BlockMerge(RowState st) {
  __shared__ RowState warps[32];
  st = WarpMerge(st);
  if constexpr (kThreads > 32) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warps[warp] = st;
    __syncthreads();
    st = lane < kThreads / 32 ? warps[lane] : EmptyState();
    st = WarpMerge(st);
    __syncthreads();  // `warps` may be written again by the next row's merge
  }
  return FromLane0(st);
}

template <int kDtype>
struct Vec {
  using Bits = typename Elem<kDtype>::Bits;
  static constexpr int kN = 16 / sizeof(Bits);
  union U {
    uint4 raw;
    Bits e[kN];
  };
};

// Whether a row (and the gradient row) can be read and written in 16-byte vectors.
__device__ __forceinline__ bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ---- version 2's pieces ----

// 16-byte loads in flight per thread in version 2: 2 x 16 bytes x 2048 threads = 64 KB per
// multiprocessor, about three times what HBM's latency times its bandwidth asks of each
// (3.35 TB/s x ~700 ns / 132 multiprocessors on an H100: about 18 KB). A batch of 4 spilled
// registers under the cap of 32 (ptxas -v: up to 28 bytes stored, 128 loaded per thread).
constexpr int kBatch = 2;

// The kN logits of a 16-byte vector as floats (exact for every dtype), by the hardware's
// conversions.
template <int kDtype>
__device__ __forceinline__ void Unpack(const uint4& raw, float (&z)[Vec<kDtype>::kN]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kDtype == kF32) {
      z[i] = __uint_as_float(w[i]);
    } else if constexpr (kDtype == kBF16) {
      z[2 * i] = __uint_as_float(w[i] << 16);
      z[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      z[2 * i] = f.x;
      z[2 * i + 1] = f.y;
    }
  }
}

// kN floats into a 16-byte vector of the dtype, each rounded to nearest even by the hardware
// (two per instruction for bf16 and half).
template <int kDtype>
__device__ __forceinline__ uint4 Pack(const float (&o)[Vec<kDtype>::kN]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kDtype == kF32) {
      w[i] = __float_as_uint(o[i]);
    } else if constexpr (kDtype == kBF16) {
      const __nv_bfloat162 h = __float22bfloat162_rn(make_float2(o[2 * i], o[2 * i + 1]));
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      const __half2 h = __float22half2_rn(make_float2(o[2 * i], o[2 * i + 1]));
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One element, by the hardware's conversions (the tails of version 2).
template <int kDtype>
__device__ __forceinline__ float LoadOne(const typename Elem<kDtype>::Bits* p) {
  if constexpr (kDtype == kF16) {
    return __half2float(*reinterpret_cast<const __half*>(p));
  } else {
    return Elem<kDtype>::ToFloat(*p);
  }
}
template <int kDtype>
__device__ __forceinline__ void StoreOne(typename Elem<kDtype>::Bits* p, float v) {
  if constexpr (kDtype == kF32) {
    *p = v;
  } else if constexpr (kDtype == kBF16) {
    *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v);
  } else {
    *reinterpret_cast<__half*>(p) = __float2half_rn(v);
  }
}

__device__ __forceinline__ uint4 Load16(const uint4* p, bool read_only) {
  return read_only ? __ldg(p) : *p;
}

// One thread's state over its columns of x[0..V) (ForEachColumn's split of the block's threads;
// version 2: AddLogits per 16-byte vector, kBatch loads in flight), before the block merges it.
// read_only: nothing writes the logits during this kernel, so they may go through the
// read-only data cache (__ldg); false in place, where the same kernel overwrites them. With
// kStage, every vector and element read is also written to stage at its offset (the one-read
// kernel's shared-memory copy of the row), in the order it is folded.
template <int kDtype, int kThreads, int kVersion, bool kStage>
__device__ __forceinline__ RowState ThreadPass(const typename Elem<kDtype>::Bits* x, int64_t V,
                                               bool vectors, bool read_only, uint4* stage) {
  using E = Elem<kDtype>;
  using Bits = typename E::Bits;
  using VT = Vec<kDtype>;
  Bits* staged = reinterpret_cast<Bits*>(stage);
  RowState st = EmptyState();
  if constexpr (kVersion >= 2) {
    const uint4* p = reinterpret_cast<const uint4*>(x);
    auto fold = [&](const uint4& raw) {
      float z[VT::kN];
      Unpack<kDtype>(raw, z);
      AddLogits<VT::kN>(st, z);
    };
    ForEachColumnBatched<kBatch>(
        threadIdx.x, kThreads, V, VT::kN, vectors,
        [&](int64_t k, int n) {
          uint4 r[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            r[u] = Load16(p + k + static_cast<int64_t>(u) * n, read_only);
          }
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            if constexpr (kStage) stage[k + static_cast<int64_t>(u) * n] = r[u];
            fold(r[u]);
          }
        },
        [&](int64_t k) {
          const uint4 r = Load16(p + k, read_only);
          if constexpr (kStage) stage[k] = r;
          fold(r);
        },
        [&](int64_t v) {
          const Bits b = x[v];
          if constexpr (kStage) staged[v] = b;
          AddLogit(st, LoadOne<kDtype>(&b));
        });
    return st;
  }
  ForEachColumn(
      threadIdx.x, kThreads, V, VT::kN, vectors,
      [&](int64_t k) {
        typename VT::U u;
        const uint4* p = reinterpret_cast<const uint4*>(x) + k;
        u.raw = read_only ? __ldg(p) : *p;
        if constexpr (kStage) stage[k] = u.raw;
#pragma unroll
        for (int e = 0; e < VT::kN; ++e) AddLogit(st, E::ToFloat(u.e[e]));
      },
      [&](int64_t v) {
        const Bits b = x[v];
        if constexpr (kStage) staged[v] = b;
        AddLogit(st, E::ToFloat(b));
      });
  return st;
}

// The row's state in every thread of the block (ThreadPass, then the block's merge).
template <int kDtype, int kThreads, int kVersion>
__device__ __forceinline__ RowState RowPass(const typename Elem<kDtype>::Bits* x, int64_t V,
                                            bool vectors, bool read_only) {
  return BlockMerge<kThreads>(
      ThreadPass<kDtype, kThreads, kVersion, false>(x, V, vectors, read_only, nullptr));
}

// The gradient row: (exp(z - lse) - [v == y]) * scale, or zeros when !counted.
template <int kDtype, int kThreads, int kVersion>
__device__ __forceinline__ void GradPass(const typename Elem<kDtype>::Bits* x,
                                         typename Elem<kDtype>::Bits* g, int64_t V, bool vectors,
                                         bool counted, float lse, int64_t y, float scale) {
  using E = Elem<kDtype>;
  using VT = Vec<kDtype>;
  if constexpr (kVersion >= 2) {
    const uint4* xp = reinterpret_cast<const uint4*>(x);
    uint4* gp = reinterpret_cast<uint4*>(g);
    if (!counted) {  // the whole block alike: zeros, nothing read
      ForEachColumn(
          threadIdx.x, kThreads, V, VT::kN, vectors,
          [&](int64_t k) { gp[k] = make_uint4(0, 0, 0, 0); },
          [&](int64_t v) { StoreOne<kDtype>(g + v, 0.0f); });
      return;
    }
    auto grad = [&](const uint4& raw, int64_t k) {
      float z[VT::kN];
      Unpack<kDtype>(raw, z);
      const int lane = TargetLane(k, VT::kN, y);
#pragma unroll
      for (int e = 0; e < VT::kN; ++e) z[e] = LogitGrad(z[e], lse, e == lane, scale);
      return Pack<kDtype>(z);
    };
    // In place (g == x) each batch's loads come before its stores, of the same vectors.
    ForEachColumnBatched<kBatch>(
        threadIdx.x, kThreads, V, VT::kN, vectors,
        [&](int64_t k, int n) {
          uint4 r[kBatch];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) r[u] = xp[k + static_cast<int64_t>(u) * n];
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            const int64_t kk = k + static_cast<int64_t>(u) * n;
            gp[kk] = grad(r[u], kk);
          }
        },
        [&](int64_t k) { gp[k] = grad(xp[k], k); },
        [&](int64_t v) {
          StoreOne<kDtype>(g + v, LogitGrad(LoadOne<kDtype>(x + v), lse, v == y, scale));
        });
    return;
  }
  ForEachColumn(
      threadIdx.x, kThreads, V, VT::kN, vectors,
      [&](int64_t k) {
        typename VT::U in, out;
        if (counted) in.raw = reinterpret_cast<const uint4*>(x)[k];
#pragma unroll
        for (int e = 0; e < VT::kN; ++e) {
          const int64_t v = k * VT::kN + e;
          out.e[e] = E::FromFloat(counted ? LogitGrad(E::ToFloat(in.e[e]), lse, v == y, scale)
                                          : 0.0f);
        }
        reinterpret_cast<uint4*>(g)[k] = out.raw;
      },
      [&](int64_t v) {
        g[v] = E::FromFloat(counted ? LogitGrad(E::ToFloat(x[v]), lse, v == y, scale) : 0.0f);
      });
}

// Row r's error of `kind` into the call's flag (thread 0 of the block; the first writer wins).
__device__ __forceinline__ void FlagRow(const CeArgs& a, int kind, int64_t r) {
  if (a.error != nullptr && threadIdx.x == 0) atomicCAS(a.error, 0ull, ErrorCode(kind, r));
}

// Whether row r counts (RowRule), its flag set when its label or mask is bad.
__device__ __forceinline__ bool RowCounted(const CeArgs& a, int64_t r, int64_t vocab_total) {
  const int rule =
      RowRule(a.labels[r], a.loss_mask == nullptr ? 1.0f : a.loss_mask[r], vocab_total);
  if (rule > 0) FlagRow(a, rule, r);
  return rule == kCounted;
}

// The fewest blocks of kThreads a multiprocessor must hold at once (__launch_bounds__'s second
// argument): version 2 asks for 2048 threads, which caps its registers at 32; version 1 gives 0,
// no minimum, as it was first compiled (29 to 39 registers at sm_90: one block of 1024 threads
// per multiprocessor above 32).
template <int kThreads, int kVersion>
constexpr int MinBlocks() {
  return kVersion >= 2 ? 2048 / kThreads : 0;
}

template <int kDtype, int kThreads, int kVersion>
__global__ void __launch_bounds__(kThreads, (MinBlocks<kThreads, kVersion>()))
    FusedKernel(CeArgs a) {
  using Bits = typename Elem<kDtype>::Bits;
  const int64_t r = blockIdx.x;
  const int64_t ld = a.ld > 0 ? a.ld : a.vocab_size;
  const int64_t vocab_total = a.vocab_total > 0 ? a.vocab_total : a.vocab_size;
  const Bits* x = static_cast<const Bits*>(a.logits) + r * ld;
  Bits* g = a.grad == nullptr ? nullptr : static_cast<Bits*>(a.grad) + r * ld;
  bool counted = RowCounted(a, r, vocab_total);
  const int64_t y = counted ? a.labels[r] - a.vocab_start : -1;
  const bool vectors = Aligned16(x) && (g == nullptr || Aligned16(g));
  float lse = 0.0f, logprob = 0.0f, entropy = 0.0f;
  if (counted) {
    const RowState st = RowPass<kDtype, kThreads, kVersion>(x, a.vocab_size, vectors,
                                                            g != static_cast<const void*>(x));
    counted = RowOutputs(st, Elem<kDtype>::ToFloat(x[y]), lse, logprob, entropy);
    if (!counted) FlagRow(a, kNonFiniteRow, r);
  }
  if (threadIdx.x == 0) {
    if (a.logprob != nullptr) a.logprob[r] = counted ? logprob : 0.0f;
    if (a.entropy != nullptr) a.entropy[r] = counted ? entropy : 0.0f;
  }
  // In place, thread 0 read x[y] above before any thread writes the row: order it.
  if (g == static_cast<const void*>(x)) __syncthreads();
  if (g != nullptr) {
    GradPass<kDtype, kThreads, kVersion>(x, g, a.vocab_size, vectors, counted, lse, y,
                                         a.grad_scale);
  }
}

template <int kDtype, int kThreads, int kVersion>
__global__ void __launch_bounds__(kThreads, (MinBlocks<kThreads, kVersion>()))
    PartialsKernel(CeArgs a) {
  using Bits = typename Elem<kDtype>::Bits;
  const int64_t r = blockIdx.x;
  const int64_t ld = a.ld > 0 ? a.ld : a.vocab_size;
  const int64_t vocab_total = a.vocab_total > 0 ? a.vocab_total : a.vocab_size;
  const Bits* x = static_cast<const Bits*>(a.logits) + r * ld;
  Stats4* stats = static_cast<Stats4*>(a.stats);
  if (!RowCounted(a, r, vocab_total)) {
    if (threadIdx.x == 0) stats[r] = Stats4{NegInf(), 0.0f, 0.0f, NegInf()};
    return;
  }
  const RowState st = RowPass<kDtype, kThreads, kVersion>(x, a.vocab_size, Aligned16(x), true);
  if (threadIdx.x == 0) {
    const int64_t y = a.labels[r] - a.vocab_start;
    const float target = y >= 0 && y < a.vocab_size ? Elem<kDtype>::ToFloat(x[y]) : NegInf();
    stats[r] = Stats4{st.m, st.s, st.t, target};
  }
}

// One thread per row: the TP ranks' states merged in rank order, the target from its rank.
__global__ void CombineKernel(const Stats4* gathered, int tp, int64_t T, Stats4* out) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= T) return;
  RowState st = EmptyState();
  float target = NegInf();
  for (int k = 0; k < tp; ++k) {
    const Stats4 p = gathered[static_cast<int64_t>(k) * T + r];
    st = MergeStates(st, RowState{p.max, p.sum_exp, p.sum_exp_shifted});
    target = p.target > target ? p.target : target;
  }
  out[r] = Stats4{st.m, st.s, st.t, target};
}

template <int kDtype, int kThreads, int kVersion>
__global__ void __launch_bounds__(kThreads, (MinBlocks<kThreads, kVersion>()))
    FinishKernel(CeArgs a) {
  using Bits = typename Elem<kDtype>::Bits;
  const int64_t r = blockIdx.x;
  const int64_t ld = a.ld > 0 ? a.ld : a.vocab_size;
  const Bits* x = static_cast<const Bits*>(a.logits) + r * ld;
  Bits* g = a.grad == nullptr ? nullptr : static_cast<Bits*>(a.grad) + r * ld;
  const int64_t vocab_total = a.vocab_total > 0 ? a.vocab_total : a.vocab_size;
  const Stats4 p = static_cast<const Stats4*>(a.stats)[r];
  const RowState st{p.max, p.sum_exp, p.sum_exp_shifted};
  // The same rule as the partials pass (which flagged the same bad labels and masks).
  bool counted = RowCounted(a, r, vocab_total);
  const int64_t y = counted ? a.labels[r] - a.vocab_start : -1;
  float lse = 0.0f, logprob = 0.0f, entropy = 0.0f;
  if (counted) {
    // Merged partials: the target must have been found (finite) on one rank.
    counted = IsFinite(p.target) && RowOutputs(st, p.target, lse, logprob, entropy);
    if (!counted) FlagRow(a, kNonFiniteRow, r);
  }
  if (threadIdx.x == 0) {
    if (a.logprob != nullptr) a.logprob[r] = counted ? logprob : 0.0f;
    if (a.entropy != nullptr) a.entropy[r] = counted ? entropy : 0.0f;
  }
  const bool vectors = Aligned16(x) && (g == nullptr || Aligned16(g));
  if (g != nullptr) {
    GradPass<kDtype, kThreads, kVersion>(x, g, a.vocab_size, vectors, counted, lse, y,
                                         a.grad_scale);
  }
}

// ---- the one-read kernel: each row staged in shared memory, over a cluster when large ----
//
// Block c of a cluster of `cs` blocks (1-D clusters: c = blockIdx.x % cs) takes row
// blockIdx.x / cs's columns [c * slice, c * slice + slice), reads them from global memory once
// into its shared memory while folding them into its state (RowPass's ThreadPass, staging what
// it reads, and block merge), and publishes that state. After a cluster barrier every block
// merges the cluster's states in rank order through distributed shared memory (every block the
// same row state), block 0 reads the target logit from the block that holds it, and a second
// barrier lets no block leave while another still reads its shared memory. Then each block
// writes the gradient of its columns from its shared copy: the logits are read once and the
// gradient written once (in place too: a block overwrites only the columns it has staged).
// Clusters of more than one block need sm_90; CeOneRead refuses them elsewhere. A share is at
// most 96 KB, so two blocks fit a multiprocessor whatever the version's register cap.
template <int kDtype, int kThreads, int kVersion>
__global__ void __launch_bounds__(kThreads) OneReadKernel(CeArgs a, int cs, int64_t slice) {
  using E = Elem<kDtype>;
  using Bits = typename E::Bits;
  extern __shared__ uint4 staged_raw[];
  Bits* staged = reinterpret_cast<Bits*>(staged_raw);
  const int64_t r = blockIdx.x / cs;
  const int c = static_cast<int>(blockIdx.x % cs);
  const int64_t ld = a.ld > 0 ? a.ld : a.vocab_size;
  const int64_t vocab_total = a.vocab_total > 0 ? a.vocab_total : a.vocab_size;
  const int64_t begin = c * slice;
  const int64_t end = begin + slice < a.vocab_size ? begin + slice : a.vocab_size;
  const int64_t n = end > begin ? end - begin : 0;
  const Bits* x = static_cast<const Bits*>(a.logits) + r * ld + begin;
  Bits* g = a.grad == nullptr ? nullptr : static_cast<Bits*>(a.grad) + r * ld + begin;
  // Every block of the cluster finds the same rule (and flags a bad row with the same code).
  bool counted = RowCounted(a, r, vocab_total);
  const int64_t y = counted ? a.labels[r] : -1;
  const bool vectors = Aligned16(x) && (g == nullptr || Aligned16(g));
  float lse = 0.0f;
  if (counted) {  // the same for every block of the cluster: all of them reach the barriers
    const bool read_only = g != static_cast<const void*>(x);
    RowState st =
        ThreadPass<kDtype, kThreads, kVersion, true>(x, n, vectors, read_only, staged_raw);
    st = BlockMerge<kThreads>(st);  // its barriers also make `staged` whole for the block
    RowState row = st;
    float target = 0.0f;
    if (cs > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      namespace cg = cooperative_groups;
      __shared__ RowState published;  // this block's state, read by the cluster's blocks
      __shared__ RowState merged;     // the row's, for this block's threads
      cg::cluster_group cluster = cg::this_cluster();
      if (threadIdx.x == 0) published = st;
      cluster.sync();
      if (threadIdx.x == 0) {  // one thread a block reads the cluster's states, in rank order
        RowState m = EmptyState();
        for (int k = 0; k < cs; ++k) m = MergeStates(m, *cluster.map_shared_rank(&published, k));
        merged = m;
        if (c == 0) {
          const int owner = static_cast<int>(y / slice);
          target = E::ToFloat(*cluster.map_shared_rank(staged + (y - owner * slice), owner));
        }
      }
      // No block leaves while another reads its memory; `merged` is whole for the block.
      cluster.sync();
      row = merged;
#else
      __trap();  // CeOneRead launches clusters on sm_90 only
#endif
    } else if (threadIdx.x == 0) {
      target = E::ToFloat(staged[y]);
    }
    float logprob = 0.0f, entropy = 0.0f;
    if (c == 0 && threadIdx.x == 0) {
      counted = RowOutputs(row, target, lse, logprob, entropy);
      if (!counted) FlagRow(a, kNonFiniteRow, r);
      if (a.logprob != nullptr) a.logprob[r] = counted ? logprob : 0.0f;
      if (a.entropy != nullptr) a.entropy[r] = counted ? entropy : 0.0f;
    }
    // Every thread of every block: the same finiteness and log-sum-exp as block 0's thread 0.
    counted = RowFinite(row);
    lse = counted ? RowLse(row) : 0.0f;
  } else if (c == 0 && threadIdx.x == 0) {
    if (a.logprob != nullptr) a.logprob[r] = 0.0f;
    if (a.entropy != nullptr) a.entropy[r] = 0.0f;
  }
  if (g != nullptr) {
    GradPass<kDtype, kThreads, kVersion>(staged, g, n, vectors, counted, lse, y - begin,
                                         a.grad_scale);
  }
}

// grad [T, ld] *= *factor (fp32 product, one rounding), and nothing written when *factor is
// exactly 1: every block reads the factor and returns at once, so the common backward of a
// loss (grad_output = 1) costs one launch and no pass over the gradient. Rows by a
// grid-stride loop; within a row ForEachColumn's split, 16-byte vectors where aligned.
constexpr int kScaleThreads = 256;
constexpr int kScaleMaxBlocks = 1024;
template <int kDtype>
__global__ void __launch_bounds__(kScaleThreads)
    ScaleKernel(typename Elem<kDtype>::Bits* grad, int64_t T, int64_t V, int64_t ld,
                const float* factor) {
  using VT = Vec<kDtype>;
  const float f = *factor;
  if (f == 1.0f) return;
  for (int64_t r = blockIdx.x; r < T; r += gridDim.x) {
    typename Elem<kDtype>::Bits* g = grad + r * ld;
    uint4* gp = reinterpret_cast<uint4*>(g);
    ForEachColumn(
        threadIdx.x, kScaleThreads, V, VT::kN, Aligned16(g),
        [&](int64_t k) {
          float z[VT::kN];
          Unpack<kDtype>(gp[k], z);
#pragma unroll
          for (int e = 0; e < VT::kN; ++e) z[e] = ScaledGrad(z[e], f);
          gp[k] = Pack<kDtype>(z);
        },
        [&](int64_t v) { StoreOne<kDtype>(g + v, ScaledGrad(LoadOne<kDtype>(g + v), f)); });
  }
}

// The backward of per-row (log-probability, entropy): a block per row (grid-strided), every
// column's LogprobEntropyGrad, a row whose incoming gradients are both 0 written as zeros
// without reading its logits. In place (grad == logits): each element read, then written, by
// the thread that owns it.
template <int kDtype>
__global__ void __launch_bounds__(kScaleThreads)
    LogprobGradKernel(CeLogprobGradArgs a) {
  using Bits = typename Elem<kDtype>::Bits;
  using VT = Vec<kDtype>;
  const int64_t stride = a.ld > 0 ? a.ld : a.vocab_size;
  for (int64_t r = blockIdx.x; r < a.num_tokens; r += gridDim.x) {
    const Bits* x = static_cast<const Bits*>(a.logits) + r * stride;
    Bits* g = static_cast<Bits*>(a.grad) + r * stride;
    const bool vectors = Aligned16(x) && Aligned16(g);
    const float glp = a.g_logprob[r], gen = a.g_entropy[r];
    uint4* gp = reinterpret_cast<uint4*>(g);
    if (glp == 0.0f && gen == 0.0f) {
      ForEachColumn(
          threadIdx.x, kScaleThreads, a.vocab_size, VT::kN, vectors,
          [&](int64_t k) { gp[k] = make_uint4(0, 0, 0, 0); },
          [&](int64_t v) { StoreOne<kDtype>(g + v, 0.0f); });
      continue;
    }
    const float lse = a.lse[r], ent = a.entropy[r], t = a.inv_temp;
    const int64_t y = a.target[r];
    const uint4* xp = reinterpret_cast<const uint4*>(x);
    ForEachColumn(
        threadIdx.x, kScaleThreads, a.vocab_size, VT::kN, vectors,
        [&](int64_t k) {
          float z[VT::kN];
          Unpack<kDtype>(xp[k], z);
          const int lane = TargetLane(k, VT::kN, y);
#pragma unroll
          for (int e = 0; e < VT::kN; ++e) {
            z[e] = LogprobEntropyGrad(z[e], t, lse, ent, e == lane, glp, gen);
          }
          gp[k] = Pack<kDtype>(z);
        },
        [&](int64_t v) {
          StoreOne<kDtype>(g + v, LogprobEntropyGrad(LoadOne<kDtype>(x + v), t, lse, ent,
                                                     v == y, glp, gen));
        });
  }
}

// A failed call leaves the runtime's last error set (cudaGetLastError returns it later), and
// the next launcher, which reads it after its launch, would report it as its own: clear it on
// every failure path. A sticky error (the context is lost) stays whatever is done here.
int Failed(cudaError_t e) {
  (void)cudaGetLastError();
  return static_cast<int>(e);
}

// The launch's own error (cudaGetLastError both reads and clears it).
int LaunchStatus() { return static_cast<int>(cudaGetLastError()); }

template <int kDtype, int kThreads, int kVersion>
int LaunchOneReadAt(const CeArgs& a, int cs, int64_t slice, cudaStream_t s) {
  const int64_t bytes = (slice * static_cast<int64_t>(sizeof(typename Elem<kDtype>::Bits)) + 15) /
                        16 * 16;
  auto kernel = OneReadKernel<kDtype, kThreads, kVersion>;
  // The 48 KB default covers static and dynamic shared memory together (the kernel has about
  // 400 bytes of its own), so the limit is raised short of 48 KB already, and always to the
  // largest share: a call never lowers it under another thread's launch.
  if (bytes + 1024 > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kCeOneReadMaxShareBytes);
    if (e != cudaSuccess) return Failed(e);
  }
  if (cs > 1) {
    // The cluster code exists only in sm_90 images: a build without one (a PTX of an older
    // architecture JIT-compiled for this device) would reach the kernel's __trap().
    cudaFuncAttributes fa{};
    const cudaError_t e = cudaFuncGetAttributes(&fa, kernel);
    if (e != cudaSuccess) return Failed(e);
    if (fa.ptxVersion < 90) return kCeNeedsClusters;  // the virtual architecture compiled from
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(a.num_tokens * cs));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(bytes);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cs);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = cs > 1 ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, a, cs, slice);
  if (e != cudaSuccess) return Failed(e);
  return LaunchStatus();
}

template <int kDtype, int kVersion>
int LaunchOneReadVersion(const CeArgs& a, int cs, int64_t slice, int threads, cudaStream_t s) {
  switch (threads) {  // a share is at most 96 KB: 48K bf16 columns, 512 threads (the plan)
    case 256: return LaunchOneReadAt<kDtype, 256, kVersion>(a, cs, slice, s);
    case 512: return LaunchOneReadAt<kDtype, 512, kVersion>(a, cs, slice, s);
  }
  return static_cast<int>(cudaErrorInvalidConfiguration);
}

template <int kDtype>
int LaunchOneRead(const CeArgs& a, int cs, int64_t slice, int threads, cudaStream_t s) {
  if (a.version == kVersionFirst) {
    return LaunchOneReadVersion<kDtype, kVersionFirst>(a, cs, slice, threads, s);
  }
  return LaunchOneReadVersion<kDtype, kVersionLatest>(a, cs, slice, threads, s);
}

#define THDPACK_CE_KERNEL_TABLE(Kernel)                                                    \
  template <int kDtype, int kVersion>                                                     \
  int Launch##Kernel(const CeArgs& a, int threads, cudaStream_t s) {                      \
    const dim3 grid(static_cast<unsigned>(a.num_tokens));                                 \
    switch (threads) {                                                                    \
      case 256: Kernel<kDtype, 256, kVersion><<<grid, 256, 0, s>>>(a); break;             \
      case 512: Kernel<kDtype, 512, kVersion><<<grid, 512, 0, s>>>(a); break;             \
      case 1024: Kernel<kDtype, 1024, kVersion><<<grid, 1024, 0, s>>>(a); break;          \
      default: return static_cast<int>(cudaErrorInvalidConfiguration);                   \
    }                                                                                     \
    return LaunchStatus();                                                                \
  }                                                                                       \
  template <int kDtype>                                                                   \
  int Launch##Kernel##Versions(const CeArgs& a, int threads, cudaStream_t s) {            \
    if (a.version == kVersionFirst) return Launch##Kernel<kDtype, kVersionFirst>(a, threads, s); \
    return Launch##Kernel<kDtype, kVersionLatest>(a, threads, s);                         \
  }                                                                                       \
  int Launch##Kernel##Any(const CeArgs& a, int threads, cudaStream_t s) {                 \
    if (a.num_tokens == 0) return 0;                                                      \
    switch (a.dtype) {                                                                    \
      case kF32: return Launch##Kernel##Versions<kF32>(a, threads, s);                    \
      case kBF16: return Launch##Kernel##Versions<kBF16>(a, threads, s);                  \
      case kF16: return Launch##Kernel##Versions<kF16>(a, threads, s);                    \
    }                                                                                     \
    return static_cast<int>(cudaErrorInvalidValue);                                       \
  }

THDPACK_CE_KERNEL_TABLE(FusedKernel)
THDPACK_CE_KERNEL_TABLE(PartialsKernel)
THDPACK_CE_KERNEL_TABLE(FinishKernel)
#undef THDPACK_CE_KERNEL_TABLE

template <int kDtype>
int LaunchScale(void* grad, int64_t T, int64_t V, int64_t ld, const float* factor,
                cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(T < kScaleMaxBlocks ? T : kScaleMaxBlocks));
  ScaleKernel<kDtype><<<grid, kScaleThreads, 0, s>>>(
      static_cast<typename Elem<kDtype>::Bits*>(grad), T, V, ld, factor);
  return LaunchStatus();
}

}  // namespace

int CeFused(const CeArgs& a, int block_threads, void* stream) {
  return LaunchFusedKernelAny(a, block_threads, static_cast<cudaStream_t>(stream));
}

int CePartials(const CeArgs& a, int block_threads, void* stream) {
  return LaunchPartialsKernelAny(a, block_threads, static_cast<cudaStream_t>(stream));
}

int CeFinish(const CeArgs& a, int block_threads, void* stream) {
  return LaunchFinishKernelAny(a, block_threads, static_cast<cudaStream_t>(stream));
}

int CeOneRead(const CeArgs& a, int cluster, int64_t slice, int block_threads, void* stream) {
  if (a.num_tokens == 0) return 0;
  if (cluster > 1) {  // thread-block clusters: sm_90 and later
    int device = 0, major = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (e != cudaSuccess) return Failed(e);
    if (major < 9) return kCeNeedsClusters;
  }
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case kF32: return LaunchOneRead<kF32>(a, cluster, slice, block_threads, s);
    case kBF16: return LaunchOneRead<kBF16>(a, cluster, slice, block_threads, s);
    case kF16: return LaunchOneRead<kF16>(a, cluster, slice, block_threads, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int CeCombine(const void* gathered, int tp, int64_t num_tokens, void* out, void* stream) {
  if (num_tokens == 0) return 0;
  const int threads = 256;
  const dim3 grid(static_cast<unsigned>((num_tokens + threads - 1) / threads));
  CombineKernel<<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const Stats4*>(gathered), tp, num_tokens, static_cast<Stats4*>(out));
  return LaunchStatus();
}

int CeScaleGrad(int dtype, void* grad, int64_t num_tokens, int64_t vocab_size, int64_t ld,
                const float* factor, void* stream) {
  if (num_tokens == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kF32: return LaunchScale<kF32>(grad, num_tokens, vocab_size, ld, factor, s);
    case kBF16: return LaunchScale<kBF16>(grad, num_tokens, vocab_size, ld, factor, s);
    case kF16: return LaunchScale<kF16>(grad, num_tokens, vocab_size, ld, factor, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int CeLogprobGrad(const CeLogprobGradArgs& a, void* stream) {
  if (a.num_tokens == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(a.num_tokens < kScaleMaxBlocks ? a.num_tokens
                                                                        : kScaleMaxBlocks));
  switch (a.dtype) {
    case kF32: LogprobGradKernel<kF32><<<grid, kScaleThreads, 0, s>>>(a); break;
    case kBF16: LogprobGradKernel<kBF16><<<grid, kScaleThreads, 0, s>>>(a); break;
    case kF16: LogprobGradKernel<kF16><<<grid, kScaleThreads, 0, s>>>(a); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return LaunchStatus();
}

bool CeBuilt() { return true; }

const char* CeErrorString(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace thdpack::kernels
