// The CUDA cross-entropy kernels (thdpack/cuda_loss.h): one block per row of logits.
//
// Each thread folds its columns (ForEachColumn of ce_row.h: 16-byte vectors while the rows are
// aligned, then the tail) into an online state (max, sum exp, sum exp * shift); the block
// merges the states by a butterfly within each warp, then a butterfly over the warps' results,
// so every thread ends with the row's state (no broadcast). The fused kernel then reads the row
// again - from L2 when it is still there - and writes the gradient in the same vectors. Every
// formula is ce_row.h's, which ce_host.cc runs on the CPU in the same order.
//
// Block size: 256 threads below 16,384 columns, 512 below 65,536, else 1024
// (CudaLossBlockThreads): enough 16-byte loads in flight per row to cover the latency of HBM
// with one block per row, and at V = 151,936 bf16 about 19 vectors per thread. To be tuned on
// the GPU by bench/loss_cuda.py.
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

// read_only: nothing writes the logits during this kernel, so they may go through the
// read-only data cache (__ldg); false in place, where the same kernel overwrites them.
template <int kDtype, int kThreads>
__device__ __forceinline__ RowState RowPass(const typename Elem<kDtype>::Bits* x, int64_t V,
                                            bool vectors, bool read_only) {
  using E = Elem<kDtype>;
  using VT = Vec<kDtype>;
  RowState st = EmptyState();
  ForEachColumn(
      threadIdx.x, kThreads, V, VT::kN, vectors,
      [&](int64_t k) {
        typename VT::U u;
        const uint4* p = reinterpret_cast<const uint4*>(x) + k;
        u.raw = read_only ? __ldg(p) : *p;
#pragma unroll
        for (int e = 0; e < VT::kN; ++e) AddLogit(st, E::ToFloat(u.e[e]));
      },
      [&](int64_t v) { AddLogit(st, E::ToFloat(x[v])); });
  return BlockMerge<kThreads>(st);
}

// The gradient row: (exp(z - lse) - [v == y]) * scale, or zeros when !counted.
template <int kDtype, int kThreads>
__device__ __forceinline__ void GradPass(const typename Elem<kDtype>::Bits* x,
                                         typename Elem<kDtype>::Bits* g, int64_t V, bool vectors,
                                         bool counted, float lse, int64_t y, float scale) {
  using E = Elem<kDtype>;
  using VT = Vec<kDtype>;
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

template <int kDtype, int kThreads>
__global__ void __launch_bounds__(kThreads) FusedKernel(CeArgs a) {
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
    const RowState st =
        RowPass<kDtype, kThreads>(x, a.vocab_size, vectors, g != static_cast<const void*>(x));
    counted = RowOutputs(st, Elem<kDtype>::ToFloat(x[y]), lse, logprob, entropy);
    if (!counted) FlagRow(a, kNonFiniteRow, r);
  }
  if (threadIdx.x == 0) {
    if (a.logprob != nullptr) a.logprob[r] = counted ? logprob : 0.0f;
    if (a.entropy != nullptr) a.entropy[r] = counted ? entropy : 0.0f;
  }
  // In place, thread 0 read x[y] above before any thread writes the row: order it.
  if (g == static_cast<const void*>(x)) __syncthreads();
  if (g != nullptr) GradPass<kDtype, kThreads>(x, g, a.vocab_size, vectors, counted, lse, y,
                                               a.grad_scale);
}

template <int kDtype, int kThreads>
__global__ void __launch_bounds__(kThreads) PartialsKernel(CeArgs a) {
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
  const RowState st = RowPass<kDtype, kThreads>(x, a.vocab_size, Aligned16(x), true);
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

template <int kDtype, int kThreads>
__global__ void __launch_bounds__(kThreads) FinishKernel(CeArgs a) {
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
  if (g != nullptr) GradPass<kDtype, kThreads>(x, g, a.vocab_size, vectors, counted, lse, y,
                                               a.grad_scale);
}

#define THDPACK_CE_KERNEL_TABLE(Kernel)                                                    \
  template <int kDtype>                                                                   \
  int Launch##Kernel(const CeArgs& a, int threads, cudaStream_t s) {                      \
    const dim3 grid(static_cast<unsigned>(a.num_tokens));                                 \
    switch (threads) {                                                                    \
      case 256: Kernel<kDtype, 256><<<grid, 256, 0, s>>>(a); break;                       \
      case 512: Kernel<kDtype, 512><<<grid, 512, 0, s>>>(a); break;                       \
      case 1024: Kernel<kDtype, 1024><<<grid, 1024, 0, s>>>(a); break;                    \
      default: return static_cast<int>(cudaErrorInvalidConfiguration);                    \
    }                                                                                     \
    return static_cast<int>(cudaGetLastError());                                          \
  }                                                                                       \
  int Launch##Kernel##Any(const CeArgs& a, int threads, cudaStream_t s) {                 \
    if (a.num_tokens == 0) return 0;                                                      \
    switch (a.dtype) {                                                                    \
      case kF32: return Launch##Kernel<kF32>(a, threads, s);                              \
      case kBF16: return Launch##Kernel<kBF16>(a, threads, s);                            \
      case kF16: return Launch##Kernel<kF16>(a, threads, s);                              \
    }                                                                                     \
    return static_cast<int>(cudaErrorInvalidValue);                                       \
  }

THDPACK_CE_KERNEL_TABLE(FusedKernel)
THDPACK_CE_KERNEL_TABLE(PartialsKernel)
THDPACK_CE_KERNEL_TABLE(FinishKernel)
#undef THDPACK_CE_KERNEL_TABLE

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

int CeCombine(const void* gathered, int tp, int64_t num_tokens, void* out, void* stream) {
  if (num_tokens == 0) return 0;
  const int threads = 256;
  const dim3 grid(static_cast<unsigned>((num_tokens + threads - 1) / threads));
  CombineKernel<<<grid, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const Stats4*>(gathered), tp, num_tokens, static_cast<Stats4*>(out));
  return static_cast<int>(cudaGetLastError());
}

bool CeBuilt() { return true; }

const char* CeErrorString(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace thdpack::kernels
