// src/kernels/cuda_loss_internal.h: private to the kernels area - the host-side checks every
// call of thdpack/cuda_loss.h makes (on the GPU and in the CPU execution alike).
#ifndef THDPACK_KERNELS_CUDA_LOSS_INTERNAL_H_
#define THDPACK_KERNELS_CUDA_LOSS_INTERNAL_H_

#include "thdpack/cuda_loss.h"

namespace thdpack {

// InvalidArgument naming `call` and the field: an unknown dtype, T outside [0, 2^31), V < 1,
// ld < V, columns outside the vocabulary, missing logits or labels, a non-finite grad_scale;
// for a vocab-parallel call (Partials, Finish) missing stats, for the fused one a shard of the
// vocabulary (vocab_start != 0 or vocab_total not in {0, V}).
[[nodiscard]] Status CheckCudaLossArgs(const CudaLossArgs& args, const char* call,
                                       bool vocab_parallel);

// InvalidArgument naming `call` for ScaleGradient's arguments: an unknown dtype, T outside
// [0, 2^31), V < 1, ld < V, a missing gradient or factor.
[[nodiscard]] Status CheckScaleGradientArgs(CudaDtype dtype, const void* grad,
                                            int64_t num_tokens, int64_t vocab_size, int64_t ld,
                                            const float* factor, const char* call);

// InvalidArgument naming `call` for LogprobEntropyBackward's arguments: an unknown dtype, T
// outside [0, 2^31), V < 1, ld < V, an inv_temp not finite and > 0, a missing array.
[[nodiscard]] Status CheckLogprobGradArgs(const CudaLogprobGradArgs& args, const char* call);

}  // namespace thdpack

#endif  // THDPACK_KERNELS_CUDA_LOSS_INTERNAL_H_
