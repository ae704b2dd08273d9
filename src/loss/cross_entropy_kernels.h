// src/loss/cross_entropy_kernels.h: the row kernels of the fast cross-entropy, shared by its
// files (not part of the public API): what a pass over rows needs (Job, RowStats), the kernel
// set of each ISA (cross_entropy_kernels.cc: float32 and bfloat16 logits, vectorised) and the
// float64 rows (cross_entropy_f64.cc). cross_entropy.cc checks the arguments, picks the ISA and
// runs these over the rows; cross_entropy_reference.cc is the plain definition they are tested
// against. Thread-safety: a kernel writes only its rows [begin, end) of the job's outputs.
#ifndef THDPACK_LOSS_CROSS_ENTROPY_KERNELS_H_
#define THDPACK_LOSS_CROSS_ENTROPY_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "loss/loss_internal.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(THDPACK_NO_TARGET_CLONES)
#define THDPACK_X86_ISAS 1  // the x86-64-v3 and -v4 functions are built
#define THDPACK_NATIVE_BF16 1
#endif

namespace thdpack::loss_internal {

// The kernels read each row in chunks of kChunk logits.
constexpr int64_t kChunk = 2048;  // a multiple of every width; 8 KiB of floats stays in L1

// Per-row online softmax state relative to m: s = sum exp(z - m), w = sum exp(z - m)*(z - m).
struct RowStats {
  double m = 0, s = 0, w = 0;
};

// What one pass over rows needs.
struct Job {
  const std::byte* logits = nullptr;
  int64_t vocab = 0;            // V (local columns)
  const int64_t* labels = nullptr;  // [T] global label, -1 uncounted
  int64_t vocab_start = 0;
  std::byte* grad = nullptr;    // null: no gradient
  double scale = 0;             // grad_scale / N
  const double* lse = nullptr;  // gradient-only pass: per-token lse
  RowStats* stats = nullptr;    // forward: per-token output
};

// One set of kernels per ISA, each compiled for its ISA with its width; Kernels() picks one.
using RowsFn = void (*)(const Job& job, int64_t begin, int64_t end);
struct KernelSet {
  RowsFn forward_f32, forward_bf16, grad_f32, grad_bf16;
};

// The kernel set of `isa` (the baseline's where this build has no other).
const KernelSet& Kernels(Isa isa);

#ifdef THDPACK_X86_ISAS
// The bf16 forward with the AVX512-BF16 gradient store (see StoreGrad); called only with the
// x86-64-v4 kernels where the CPU also has AVX512-BF16 (NativeBf16Store).
__attribute__((target("arch=x86-64-v4")))
void ForwardBF16V4Native(const Job& job, int64_t b, int64_t e);
#endif

// float64 logits (cross_entropy_f64.cc): the forward pass over rows [begin, end) (with the
// gradient when job.grad is set), and the gradient-only pass from job.lse.
void ForwardRowsF64(const Job& job, int64_t begin, int64_t end);
void GradRowsF64(const Job& job, int64_t begin, int64_t end);

}  // namespace thdpack::loss_internal

#endif  // THDPACK_LOSS_CROSS_ENTROPY_KERNELS_H_
