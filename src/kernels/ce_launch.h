// src/kernels/ce_launch.h: the launchers of the CUDA cross-entropy kernels (ce_kernels.cu), in
// plain C++ that nvcc compiles without the library's C++20 headers; cuda_loss.cc wraps them in
// thdpack/cuda_loss.h's Status API. Each returns a cudaError_t value (0: success) and, for a
// nonzero one, its text through CeErrorString. Built without CUDA, cuda_disabled.cc returns
// kCeNotBuilt from every one.
#ifndef THDPACK_KERNELS_CE_LAUNCH_H_
#define THDPACK_KERNELS_CE_LAUNCH_H_

#include <stdint.h>

namespace thdpack::kernels {

inline constexpr int kCeNotBuilt = -1;
inline constexpr int kCeNeedsClusters = -2;  // a cluster of blocks without sm_90 code or device
// The largest share of a row the one-read kernel stages (thdpack::kCudaOneReadSliceBytes).
inline constexpr int kCeOneReadMaxShareBytes = 96 * 1024;

// thdpack::CudaLossArgs, field for field (cuda_loss.cc copies one into the other).
struct CeArgs {
  int dtype;
  const void* logits;
  int64_t num_tokens;
  int64_t vocab_size;
  int64_t ld;
  const int64_t* labels;
  const float* loss_mask;
  int64_t vocab_start;
  int64_t vocab_total;
  float grad_scale;
  void* grad;
  float* logprob;
  float* entropy;
  void* stats;  // RowStats [T]
  unsigned long long* error;
  int version;  // 1 or 2 (0: 2), ce_row.h's kVersion*
};

int CeFused(const CeArgs& a, int block_threads, void* stream);
int CePartials(const CeArgs& a, int block_threads, void* stream);
int CeCombine(const void* gathered, int tp, int64_t num_tokens, void* out, void* stream);
// The one-read kernel: clusters of `cluster` blocks of `block_threads`, each staging `slice`
// columns of a row (CudaLossOneReadPlan).
int CeOneRead(const CeArgs& a, int cluster, int64_t slice, int block_threads, void* stream);
int CeFinish(const CeArgs& a, int block_threads, void* stream);
// grad [T, ld] (V columns of `dtype`) *= *factor (a device float), nothing written when it is 1.
int CeScaleGrad(int dtype, void* grad, int64_t num_tokens, int64_t vocab_size, int64_t ld,
                const float* factor, void* stream);
// thdpack::CudaLogprobGradArgs, field for field.
struct CeLogprobGradArgs {
  int dtype;
  const void* logits;
  int64_t num_tokens;
  int64_t vocab_size;
  int64_t ld;
  const int64_t* target;
  const float* lse;
  const float* entropy;
  const float* g_logprob;
  const float* g_entropy;
  float inv_temp;
  void* grad;
};
// The backward of per-row (log-probability, entropy) (LogprobEntropyGrad, ce_row.h).
int CeLogprobGrad(const CeLogprobGradArgs& a, void* stream);
const char* CeErrorString(int code);
bool CeBuilt();

}  // namespace thdpack::kernels

#endif  // THDPACK_KERNELS_CE_LAUNCH_H_
