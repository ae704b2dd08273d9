// The CUDA cross-entropy kernels run on the CPU (thdpack/cuda_loss.h's *Host functions): the
// same ce_row.h functions, the same column split per simulated thread (ForEachColumn, vectors
// where the rows are 16-byte aligned; ForEachColumnBatched for version 2) and the same merge
// tree (a butterfly within each warp of 32 threads, lane 0 of each warp into a butterfly over
// the warps, lane 0's result for every thread) as ce_kernels.cu, for each kernel version. Only
// exp and log differ (the CPU's libm instead of __expf/__logf), and the dtype conversions are
// ce_row.h's software ones where version 2 on the GPU uses the hardware's (the same values:
// conversions to float are exact, and both round to nearest even). This is what `make test`
// checks the kernels' arithmetic with on a machine without a GPU.
#include <cstdint>
#include <vector>

#include "kernels/ce_row.h"
#include "kernels/cuda_loss_internal.h"
#include "thdpack/cuda_loss.h"

namespace thdpack {
namespace {

using kernels::Elem;
using kernels::RowState;

// The butterfly of one warp over lanes[0..31], in place (every lane ends with its result).
void WarpMerge(RowState* lanes) {
  RowState next[32];
  for (int off = 16; off > 0; off >>= 1) {
    for (int l = 0; l < 32; ++l) next[l] = kernels::MergeStates(lanes[l], lanes[l ^ off]);
    for (int l = 0; l < 32; ++l) lanes[l] = next[l];
  }
}

// The block's state as every simulated thread gets it (BlockMerge of ce_kernels.cu).
RowState BlockMerge(std::vector<RowState>& threads) {
  const int n = static_cast<int>(threads.size());
  for (int w = 0; w < n / 32; ++w) WarpMerge(threads.data() + 32 * w);
  if (n == 32) return threads[0];
  RowState lanes[32];
  for (int l = 0; l < 32; ++l) lanes[l] = l < n / 32 ? threads[32 * l] : kernels::EmptyState();
  WarpMerge(lanes);
  return lanes[0];
}

void Flag(const CudaLossArgs& a, int kind, int64_t row) {
  if (a.error != nullptr && *a.error == 0) *a.error = kernels::ErrorCode(kind, row);
}

int Version(const CudaLossArgs& a) {
  return a.version == 0 ? kernels::kVersionLatest : a.version;
}
int64_t VocabTotal(const CudaLossArgs& a) { return a.vocab_total > 0 ? a.vocab_total : a.vocab_size; }
int64_t Ld(const CudaLossArgs& a) { return a.ld > 0 ? a.ld : a.vocab_size; }

// Whether row r counts (RowRule), its flag set when its label or mask is bad.
bool RowCounted(const CudaLossArgs& a, int64_t r) {
  const int rule =
      kernels::RowRule(a.labels[r], a.loss_mask == nullptr ? 1.0f : a.loss_mask[r], VocabTotal(a));
  if (rule > 0) Flag(a, rule, r);
  return rule == kernels::kCounted;
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Every column of a row once, each by one(v), in the order a block of `n` threads visits them
// (ForEachColumn, thread by thread: its vectors of kN, element by element, then its tail).
template <typename Visit>
void ForEachColumnOfBlock(int n, int64_t V, int kN, bool vectors, Visit&& one) {
  for (int j = 0; j < n; ++j) {
    kernels::ForEachColumn(
        j, n, V, kN, vectors,
        [&](int64_t k) {
          for (int e = 0; e < kN; ++e) one(k * kN + e);
        },
        one);
  }
}

// f(Elem<kDtype>{}) for the dtype's element type and conversions.
template <typename F>
void WithElem(CudaDtype dtype, F&& f) {
  switch (dtype) {
    case CudaDtype::kFloat32: f(Elem<kernels::kF32>{}); break;
    case CudaDtype::kBFloat16: f(Elem<kernels::kBF16>{}); break;
    case CudaDtype::kFloat16: f(Elem<kernels::kF16>{}); break;
  }
}

// The 16-byte loads a version-2 thread keeps in flight (ce_kernels.cu's kBatch): the order of
// the visits does not depend on it, and ForEachColumnBatched covers every column whatever it is.
constexpr int kBatch = 2;

template <int kDtype>
RowState RowPass(const typename Elem<kDtype>::Bits* x, int64_t V, bool vectors, int n,
                 int version) {
  using E = Elem<kDtype>;
  constexpr int kN = 16 / sizeof(typename E::Bits);
  std::vector<RowState> threads(static_cast<size_t>(n), kernels::EmptyState());
  for (int j = 0; j < n; ++j) {
    RowState& st = threads[static_cast<size_t>(j)];
    if (version == kernels::kVersionFirst) {
      kernels::ForEachColumn(
          j, n, V, kN, vectors,
          [&](int64_t k) {
            for (int e = 0; e < kN; ++e) kernels::AddLogit(st, E::ToFloat(x[k * kN + e]));
          },
          [&](int64_t v) { kernels::AddLogit(st, E::ToFloat(x[v])); });
      continue;
    }
    auto fold = [&](int64_t k) {  // vector k: one rescale (AddLogits)
      float z[kN];
      for (int e = 0; e < kN; ++e) z[e] = E::ToFloat(x[k * kN + e]);
      kernels::AddLogits<kN>(st, z);
    };
    kernels::ForEachColumnBatched<kBatch>(
        j, n, V, kN, vectors,
        [&](int64_t k, int stride) {
          for (int u = 0; u < kBatch; ++u) fold(k + static_cast<int64_t>(u) * stride);
        },
        fold, [&](int64_t v) { kernels::AddLogit(st, E::ToFloat(x[v])); });
  }
  return BlockMerge(threads);
}

// Both versions write the same values: version 2 finds the target's lane once per vector
// (TargetLane) where version 1 compares every column, and visits the vectors in batches.
template <int kDtype>
void GradPass(const typename Elem<kDtype>::Bits* x, typename Elem<kDtype>::Bits* g, int64_t V,
              bool vectors, bool counted, float lse, int64_t y, float scale, int n, int version) {
  using E = Elem<kDtype>;
  constexpr int kN = 16 / sizeof(typename E::Bits);
  auto one = [&](int64_t v) {
    g[v] = E::FromFloat(counted ? kernels::LogitGrad(E::ToFloat(x[v]), lse, v == y, scale) : 0.0f);
  };
  auto vector_v2 = [&](int64_t k) {
    const int lane = kernels::TargetLane(k, kN, y);
    for (int e = 0; e < kN; ++e) {
      const int64_t v = k * kN + e;
      g[v] = E::FromFloat(counted ? kernels::LogitGrad(E::ToFloat(x[v]), lse, e == lane, scale)
                                  : 0.0f);
    }
  };
  if (version == kernels::kVersionFirst) {
    ForEachColumnOfBlock(n, V, kN, vectors, one);
    return;
  }
  for (int j = 0; j < n; ++j) {
    kernels::ForEachColumnBatched<kBatch>(
        j, n, V, kN, vectors,
        [&](int64_t k, int stride) {
          for (int u = 0; u < kBatch; ++u) vector_v2(k + static_cast<int64_t>(u) * stride);
        },
        vector_v2, one);
  }
}

Status CheckThreads(int block_threads) {
  if (block_threads < 32 || block_threads > 1024 || (block_threads & (block_threads - 1)) != 0) {
    return Status::InvalidArgument("block_threads = " + std::to_string(block_threads) +
                                   ": must be a power of two in [32, 1024]");
  }
  return Status::Ok();
}

template <int kDtype>
void FusedRows(const CudaLossArgs& a, int n) {
  using Bits = typename Elem<kDtype>::Bits;
  for (int64_t r = 0; r < a.num_tokens; ++r) {
    const Bits* x = static_cast<const Bits*>(a.logits) + r * Ld(a);
    Bits* g = a.grad == nullptr ? nullptr : static_cast<Bits*>(a.grad) + r * Ld(a);
    bool counted = RowCounted(a, r);
    const int64_t y = counted ? a.labels[r] - a.vocab_start : -1;
    const bool vectors = Aligned16(x) && (g == nullptr || Aligned16(g));
    float lse = 0, logprob = 0, entropy = 0;
    if (counted) {
      const RowState st = RowPass<kDtype>(x, a.vocab_size, vectors, n, Version(a));
      counted = kernels::RowOutputs(st, Elem<kDtype>::ToFloat(x[y]), lse, logprob, entropy);
      if (!counted) Flag(a, kernels::kNonFiniteRow, r);
    }
    if (a.logprob != nullptr) a.logprob[r] = counted ? logprob : 0.0f;
    if (a.entropy != nullptr) a.entropy[r] = counted ? entropy : 0.0f;
    if (g != nullptr) {
      GradPass<kDtype>(x, g, a.vocab_size, vectors, counted, lse, y, a.grad_scale, n,
                       Version(a));
    }
  }
}

template <int kDtype>
void PartialRows(const CudaLossArgs& a, int n) {
  using Bits = typename Elem<kDtype>::Bits;
  for (int64_t r = 0; r < a.num_tokens; ++r) {
    const Bits* x = static_cast<const Bits*>(a.logits) + r * Ld(a);
    if (!RowCounted(a, r)) {
      a.stats[r] = RowStats{kernels::NegInf(), 0.0f, 0.0f, kernels::NegInf()};
      continue;
    }
    const RowState st = RowPass<kDtype>(x, a.vocab_size, Aligned16(x), n, Version(a));
    const int64_t y = a.labels[r] - a.vocab_start;
    const float target =
        y >= 0 && y < a.vocab_size ? Elem<kDtype>::ToFloat(x[y]) : kernels::NegInf();
    a.stats[r] = RowStats{st.m, st.s, st.t, target};
  }
}

template <int kDtype>
void FinishRows(const CudaLossArgs& a, int n) {
  using Bits = typename Elem<kDtype>::Bits;
  for (int64_t r = 0; r < a.num_tokens; ++r) {
    const Bits* x = static_cast<const Bits*>(a.logits) + r * Ld(a);
    Bits* g = a.grad == nullptr ? nullptr : static_cast<Bits*>(a.grad) + r * Ld(a);
    const RowStats p = a.stats[r];
    const RowState st{p.max, p.sum_exp, p.sum_exp_shifted};
    bool counted = RowCounted(a, r);
    const int64_t y = counted ? a.labels[r] - a.vocab_start : -1;
    float lse = 0, logprob = 0, entropy = 0;
    if (counted) {
      // Merged partials: the target must have been found (finite) on one rank.
      counted = kernels::IsFinite(p.target) &&
                kernels::RowOutputs(st, p.target, lse, logprob, entropy);
      if (!counted) Flag(a, kernels::kNonFiniteRow, r);
    }
    if (a.logprob != nullptr) a.logprob[r] = counted ? logprob : 0.0f;
    if (a.entropy != nullptr) a.entropy[r] = counted ? entropy : 0.0f;
    const bool vectors = Aligned16(x) && (g == nullptr || Aligned16(g));
    if (g != nullptr) {
      GradPass<kDtype>(x, g, a.vocab_size, vectors, counted, lse, y, a.grad_scale, n,
                       Version(a));
    }
  }
}

template <int kDtype>
void OneReadRows(const CudaLossArgs& a, int cs, int64_t slice, int n) {
  using Bits = typename Elem<kDtype>::Bits;
  for (int64_t r = 0; r < a.num_tokens; ++r) {
    const Bits* x = static_cast<const Bits*>(a.logits) + r * Ld(a);
    Bits* g = a.grad == nullptr ? nullptr : static_cast<Bits*>(a.grad) + r * Ld(a);
    bool counted = RowCounted(a, r);
    const int64_t y = counted ? a.labels[r] : -1;
    // Block c of the cluster: columns [c * slice, min(V, c * slice + slice)).
    auto columns = [&](int c, int64_t* begin, int64_t* count) {
      *begin = c * slice;
      const int64_t end = *begin + slice < a.vocab_size ? *begin + slice : a.vocab_size;
      *count = end > *begin ? end - *begin : 0;
    };
    auto vectors_of = [&](int64_t begin) {
      return Aligned16(x + begin) && (g == nullptr || Aligned16(g + begin));
    };
    float lse = 0, logprob = 0, entropy = 0;
    if (counted) {
      RowState row = kernels::EmptyState();  // the blocks' states merged in rank order
      for (int c = 0; c < cs; ++c) {
        int64_t begin = 0, count = 0;
        columns(c, &begin, &count);
        const RowState st = RowPass<kDtype>(x + begin, count, vectors_of(begin), n, Version(a));
        row = kernels::MergeStates(row, st);  // from the empty state: the first is kept as is
      }
      counted = kernels::RowOutputs(row, Elem<kDtype>::ToFloat(x[y]), lse, logprob, entropy);
      if (!counted) Flag(a, kernels::kNonFiniteRow, r);
    }
    if (a.logprob != nullptr) a.logprob[r] = counted ? logprob : 0.0f;
    if (a.entropy != nullptr) a.entropy[r] = counted ? entropy : 0.0f;
    if (g == nullptr) continue;
    for (int c = 0; c < cs; ++c) {
      int64_t begin = 0, count = 0;
      columns(c, &begin, &count);
      GradPass<kDtype>(x + begin, g + begin, count, vectors_of(begin), counted, lse, y - begin,
                       a.grad_scale, n, Version(a));
    }
  }
}

template <template <int> class Rows>
Status ByDtype(const CudaLossArgs& a, int n) {
  switch (a.dtype) {
    case CudaDtype::kFloat32: Rows<kernels::kF32>::Run(a, n); return Status::Ok();
    case CudaDtype::kBFloat16: Rows<kernels::kBF16>::Run(a, n); return Status::Ok();
    case CudaDtype::kFloat16: Rows<kernels::kF16>::Run(a, n); return Status::Ok();
  }
  return Status::InvalidArgument("dtype " + std::to_string(static_cast<int>(a.dtype)) +
                                 " is not float32, bfloat16 or float16");
}
template <int kDtype>
struct Fused {
  static void Run(const CudaLossArgs& a, int n) { FusedRows<kDtype>(a, n); }
};
template <int kDtype>
struct Partials {
  static void Run(const CudaLossArgs& a, int n) { PartialRows<kDtype>(a, n); }
};
template <int kDtype>
struct Finish {
  static void Run(const CudaLossArgs& a, int n) { FinishRows<kDtype>(a, n); }
};

}  // namespace

Status CrossEntropyFusedHost(const CudaLossArgs& args, int block_threads) {
  THDPACK_RETURN_IF_ERROR(CheckThreads(block_threads));
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyFusedHost", false));
  return ByDtype<Fused>(args, block_threads);
}

Status CrossEntropyPartialsHost(const CudaLossArgs& args, int block_threads) {
  THDPACK_RETURN_IF_ERROR(CheckThreads(block_threads));
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyPartialsHost", true));
  return ByDtype<Partials>(args, block_threads);
}

Status CrossEntropyFinishHost(const CudaLossArgs& args, int block_threads) {
  THDPACK_RETURN_IF_ERROR(CheckThreads(block_threads));
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyFinishHost", true));
  return ByDtype<Finish>(args, block_threads);
}

Status CrossEntropyOneReadHost(const CudaLossArgs& args, int cluster, int block_threads) {
  THDPACK_RETURN_IF_ERROR(CheckThreads(block_threads));
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyOneReadHost", false));
  if (cluster != 1 && cluster != 2 && cluster != 4 && cluster != 8) {
    return Status::InvalidArgument("CrossEntropyOneReadHost: cluster = " +
                                   std::to_string(cluster) + ": must be 1, 2, 4 or 8");
  }
  const int64_t slice = CudaLossOneReadSlice(args.dtype, args.vocab_size, cluster);
  switch (args.dtype) {
    case CudaDtype::kFloat32: OneReadRows<kernels::kF32>(args, cluster, slice, block_threads); break;
    case CudaDtype::kBFloat16: OneReadRows<kernels::kBF16>(args, cluster, slice, block_threads); break;
    case CudaDtype::kFloat16: OneReadRows<kernels::kF16>(args, cluster, slice, block_threads); break;
  }
  return Status::Ok();
}

Status ScaleGradientHost(CudaDtype dtype, void* grad, int64_t num_tokens, int64_t vocab_size,
                         int64_t ld, const float* factor, int block_threads) {
  THDPACK_RETURN_IF_ERROR(CheckThreads(block_threads));
  THDPACK_RETURN_IF_ERROR(CheckScaleGradientArgs(dtype, grad, num_tokens, vocab_size, ld, factor,
                                                 "ScaleGradientHost"));
  if (num_tokens == 0 || *factor == 1.0f) return Status::Ok();
  const float f = *factor;
  WithElem(dtype, [&](auto elem) {
    using E = decltype(elem);
    constexpr int kN = 16 / sizeof(typename E::Bits);
    const int64_t stride = ld > 0 ? ld : vocab_size;
    for (int64_t r = 0; r < num_tokens; ++r) {
      auto* g = static_cast<typename E::Bits*>(grad) + r * stride;
      ForEachColumnOfBlock(block_threads, vocab_size, kN, Aligned16(g), [&](int64_t v) {
        g[v] = E::FromFloat(kernels::ScaledGrad(E::ToFloat(g[v]), f));
      });
    }
  });
  return Status::Ok();
}

Status LogprobEntropyBackwardHost(const CudaLogprobGradArgs& a, int block_threads) {
  THDPACK_RETURN_IF_ERROR(CheckThreads(block_threads));
  THDPACK_RETURN_IF_ERROR(CheckLogprobGradArgs(a, "LogprobEntropyBackwardHost"));
  WithElem(a.dtype, [&](auto elem) {
    using E = decltype(elem);
    using Bits = typename E::Bits;
    constexpr int kN = 16 / sizeof(Bits);
    const int64_t stride = a.ld > 0 ? a.ld : a.vocab_size;
    for (int64_t r = 0; r < a.num_tokens; ++r) {
      const Bits* x = static_cast<const Bits*>(a.logits) + r * stride;
      Bits* g = static_cast<Bits*>(a.grad) + r * stride;
      const float glp = a.g_logprob[r], gen = a.g_entropy[r];
      const bool zero = glp == 0.0f && gen == 0.0f;
      ForEachColumnOfBlock(block_threads, a.vocab_size, kN, Aligned16(x) && Aligned16(g),
                           [&](int64_t v) {
                             g[v] = E::FromFloat(
                                 zero ? 0.0f
                                      : kernels::LogprobEntropyGrad(
                                            E::ToFloat(x[v]), a.inv_temp, a.lse[r],
                                            a.entropy[r], v == a.target[r], glp, gen));
                           });
    }
  });
  return Status::Ok();
}

Status CombinePartialsHost(const RowStats* gathered, int tp, int64_t num_tokens, RowStats* out) {
  for (int64_t r = 0; r < num_tokens; ++r) {
    RowState st = kernels::EmptyState();
    float target = kernels::NegInf();
    for (int k = 0; k < tp; ++k) {
      const RowStats p = gathered[static_cast<int64_t>(k) * num_tokens + r];
      st = kernels::MergeStates(st, RowState{p.max, p.sum_exp, p.sum_exp_shifted});
      target = p.target > target ? p.target : target;
    }
    out[r] = RowStats{st.m, st.s, st.t, target};
  }
  return Status::Ok();
}

int64_t CudaLossOneReadSlice(CudaDtype dtype, int64_t vocab_size, int cluster) {
  const int64_t vec = dtype == CudaDtype::kFloat32 ? 4 : 8;  // elements of a 16-byte vector
  const int64_t share = (vocab_size + cluster - 1) / cluster;
  return (share + vec - 1) / vec * vec;
}

CudaOneReadPlan CudaLossOneReadPlan(CudaDtype dtype, int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 40)) return CudaOneReadPlan{};
  const int64_t elem = dtype == CudaDtype::kFloat32 ? 4 : 2;
  for (int cluster = 1; cluster <= 8; cluster *= 2) {
    const int64_t slice = CudaLossOneReadSlice(dtype, vocab_size, cluster);
    if (slice * elem <= kCudaOneReadSliceBytes) {
      return CudaOneReadPlan{cluster, slice, CudaLossBlockThreads(slice)};
    }
  }
  return CudaOneReadPlan{};
}

int CudaLossBlockThreads(int64_t vocab_size) {
  if (vocab_size >= 65536) return 1024;
  if (vocab_size >= 16384) return 512;
  return 256;
}

}  // namespace thdpack
