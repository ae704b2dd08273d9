// thdpack/cuda_loss.h: the cross-entropy of a rank's logits on the GPU (docs/loss.md, "On the
// GPU"), framework-free: device pointers, sizes and a cudaStream_t (as void*), no allocation,
// no host synchronisation. The Python module calls it with torch's tensors' data_ptr() and
// torch's current stream, and never links libtorch.
//
// Legend: T rows (tokens of this rank's shard), V this rank's columns (the whole vocabulary, or
// V/TP when vocab-parallel), logits [T, V] row-major with a row stride of ld elements.
// Per row, in fp32 (the arithmetic of src/kernels/ce_row.h, shared with the CPU execution
// below): a counted row (label != -100 and loss_mask != 0) gets
//   logprob = z_y - lse, entropy = -sum p log p, grad[v] = (p_v - [v == y]) * grad_scale
// with the target term and the scale applied in fp32 before the one rounding to the output
// dtype; an uncounted row gets 0, 0 and a zero gradient row. grad_scale is the caller's
// grad_factor / N (0 when N = 0).
//
// Calls:
//   CrossEntropyFused     one kernel: each row read for its statistics, then again for its
//                         gradient: the logits are read twice and the gradient written once.
//                         It takes the whole vocabulary (vocab_start 0, vocab_total 0 or V).
//   CrossEntropyOneRead   the same results with each row read ONCE: staged in shared memory
//                         while its statistics are taken, the gradient written from there. A
//                         row larger than one block's share (kCudaOneReadSliceBytes) is split
//                         over a thread-block cluster of 2, 4 or 8 blocks that merge their
//                         states through distributed shared memory (sm_90; Unimplemented on an
//                         older device or in a build without sm_90 code, and for rows of more
//                         than 8 shares). The whole
//                         vocabulary, as the fused call. Its states merge in another order than
//                         the fused call's, so the two agree to fp32 rounding, not bit for bit.
//   vocab-parallel (TP): CrossEntropyPartials writes each row's partial state (RowStats, 16
//   bytes); the caller all-gathers the partials of the TP ranks over its TP group (one
//   collective), CombinePartials merges them (every rank the same), and CrossEntropyFinish
//   writes logprob, entropy and the gradient of this rank's columns.
//
// In place: grad == logits (the same pointer and stride) overwrites the logits with their
// gradient (each element read before it is written, by the thread that writes it).
//
// Versions (`version`): each kernel exists as version 1, the first, and version 2 (the
// default), the same formulas in fewer instructions per element with more loads in flight
// (src/kernels/ce_kernels.cu says what changed). Both stay, so that the tests check each against
// the CPU execution and the benchmark times them side by side; their results agree to fp32
// rounding, not bit for bit (version 2 rescales once per 16-byte vector).
//
// ScaleGradient multiplies a gradient by a device scalar (autograd's grad_output) that it reads
// on the device, and writes nothing when that scalar is 1: the backward of a loss then costs no
// pass over the [T, V] gradient and no host synchronisation.
//
// Errors. The launches' own errors (no device, a bad configuration) return as a Status naming
// the call. Input errors cannot stop a kernel: with `error` set, the first bad row writes
// ErrorCode(kind, row) there (a device uint64 the caller zeroes), and DecodeCudaLossError turns
// the value the caller copied back into the Status the CPU kernel gives (the token, the rule).
// With `error` null nothing is checked and nothing syncs: the calls can be captured in a CUDA
// graph.
//
// Without CUDA (THDPACK_WITH_CUDA off or no nvcc at build time) every device call returns
// Unimplemented; CudaLossBuilt() says which. The *Host functions run the kernels' arithmetic on
// the CPU, thread by thread of a block as the GPU would, on host pointers: the tests' way to
// check it without a GPU.
//
// Thread-safety: no state; calls on different streams are independent.
#ifndef THDPACK_CUDA_LOSS_H_
#define THDPACK_CUDA_LOSS_H_

#include <cstdint>

#include "thdpack/status.h"

namespace thdpack {

enum class CudaDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// A row's partial state over some columns: max m, sum exp(z - m), sum exp(z - m) * (z - m), and
// the target's logit (-inf where the target is not among the columns, or the row is not
// counted). 16 bytes.
struct RowStats {
  float max;
  float sum_exp;
  float sum_exp_shifted;
  float target;
};
static_assert(sizeof(RowStats) == 16);

struct CudaLossArgs {
  CudaDtype dtype = CudaDtype::kBFloat16;
  const void* logits = nullptr;  // [T, ld] device
  int64_t num_tokens = 0;        // T
  int64_t vocab_size = 0;        // V: this rank's columns
  int64_t ld = 0;                // row stride in elements, >= V (0: V)
  const int64_t* labels = nullptr;   // [T] device; -100 ignores the row
  const float* loss_mask = nullptr;  // [T] device, 0 or 1; null: all ones
  // Vocab-parallel: this rank's first column's vocabulary id and the whole vocabulary (0: V).
  int64_t vocab_start = 0;
  int64_t vocab_total = 0;
  float grad_scale = 0;        // grad_factor / N
  void* grad = nullptr;        // [T, ld] in dtype, device; == logits: in place; null: none
  float* logprob = nullptr;    // [T] device, or null
  float* entropy = nullptr;    // [T] device, or null
  RowStats* stats = nullptr;   // [T] device: written by Partials, read by Finish
  unsigned long long* error = nullptr;  // device flag, zeroed by the caller; null: no checks
  int version = 0;  // the kernels' version: 1 or 2 (0: the latest, 2)
};

inline constexpr int kCudaLossLatestVersion = 2;

// Whether this build has the CUDA kernels.
bool CudaLossBuilt();

[[nodiscard]] Status CrossEntropyFused(const CudaLossArgs& args, void* stream);
[[nodiscard]] Status CrossEntropyOneRead(const CudaLossArgs& args, void* stream);
[[nodiscard]] Status CrossEntropyPartials(const CudaLossArgs& args, void* stream);
// gathered: [tp][T] partials of the TP ranks (rank order), out: [T]. Device pointers.
[[nodiscard]] Status CombinePartials(const RowStats* gathered, int tp, int64_t num_tokens,
                                     RowStats* out, void* stream);
[[nodiscard]] Status CrossEntropyFinish(const CudaLossArgs& args, void* stream);

// grad [T, ld] (V columns of `dtype`, device) *= *factor, in fp32 with one rounding to the
// dtype, unless *factor is exactly 1, when nothing is read or written. factor: a device float32
// scalar, read by the kernel (nothing synchronises; a CUDA graph can hold the call).
[[nodiscard]] Status ScaleGradient(CudaDtype dtype, void* grad, int64_t num_tokens,
                                   int64_t vocab_size, int64_t ld, const float* factor,
                                   void* stream);

// The backward of per-row log-probabilities and entropies (thdpack.torch.token_logprobs on
// CUDA logits, docs/loss.md "Log-probs and entropy"): for each row r of logits x and every
// column v, with z = x * inv_temp, lse[r] and entropy[r] the row's (the forward's, over the
// whole vocabulary: with TP, of every rank's columns) and p_v = exp(z_v - lse[r]),
//   grad[r][v] = inv_temp (g_logprob[r] ([v == target[r]] - p_v)
//                          - g_entropy[r] p_v (z_v - lse[r] + entropy[r]))
// in fp32, rounded once to the dtype (ce_row.h, LogprobEntropyGrad). target[r]: the column of
// this rank's logits the row's target is, or -1 (no target, or on another TP rank's columns).
// A row whose g_logprob and g_entropy are both 0 gets zeros, its logits unread. In place:
// grad == logits. No error flag: the inputs are the forward's own.
struct CudaLogprobGradArgs {
  CudaDtype dtype = CudaDtype::kBFloat16;
  const void* logits = nullptr;  // [T, ld] device
  int64_t num_tokens = 0;        // T
  int64_t vocab_size = 0;        // V: this rank's columns
  int64_t ld = 0;                // row stride in elements, >= V (0: V)
  const int64_t* target = nullptr;     // [T] device: a column in [0, V), or -1
  const float* lse = nullptr;          // [T] device
  const float* entropy = nullptr;      // [T] device
  const float* g_logprob = nullptr;    // [T] device
  const float* g_entropy = nullptr;    // [T] device
  float inv_temp = 1;                  // 1 / temperature, finite and > 0
  void* grad = nullptr;                // [T, ld] in dtype, device (== logits: in place)
};
[[nodiscard]] Status LogprobEntropyBackward(const CudaLogprobGradArgs& args, void* stream);

// The Status of a nonzero error flag (0: OK), as the CPU kernel words it.
[[nodiscard]] Status DecodeCudaLossError(unsigned long long flag, int64_t vocab_total);

// The same computations on the CPU, host pointers, simulating `block_threads` threads per row
// (a power of two, 32 to 1024) with the kernels' column split and merge order. For tests.
[[nodiscard]] Status CrossEntropyFusedHost(const CudaLossArgs& args, int block_threads);
[[nodiscard]] Status CrossEntropyPartialsHost(const CudaLossArgs& args, int block_threads);
[[nodiscard]] Status CombinePartialsHost(const RowStats* gathered, int tp, int64_t num_tokens,
                                         RowStats* out);
[[nodiscard]] Status CrossEntropyFinishHost(const CudaLossArgs& args, int block_threads);
// CrossEntropyOneRead on the CPU with a cluster of `cluster` blocks (1, 2, 4 or 8; the GPU call
// takes CudaLossOneReadPlan's) of block_threads simulated threads each.
[[nodiscard]] Status CrossEntropyOneReadHost(const CudaLossArgs& args, int cluster,
                                             int block_threads);
// LogprobEntropyBackward on the CPU (host pointers), with its kernel's column split over
// `block_threads` simulated threads.
[[nodiscard]] Status LogprobEntropyBackwardHost(const CudaLogprobGradArgs& args,
                                                int block_threads);
// ScaleGradient on the CPU (host pointers), with its kernel's column split over
// `block_threads` simulated threads.
[[nodiscard]] Status ScaleGradientHost(CudaDtype dtype, void* grad, int64_t num_tokens,
                                       int64_t vocab_size, int64_t ld, const float* factor,
                                       int block_threads);

// The threads per row block the kernels use for V columns (the Host functions take it to
// simulate the same split): 256 below 16,384 columns, else 512, else 1024 from 65,536.
int CudaLossBlockThreads(int64_t vocab_size);

// The one-read kernel's split of a row: `cluster` blocks (0: the row is larger than 8 shares,
// or V < 1),
// each staging `slice` columns (a multiple of a 16-byte vector; the last block the rest) with
// `threads` threads. A share is at most kCudaOneReadSliceBytes, so that two blocks fit one
// multiprocessor's shared memory and one block's reads overlap another's writes.
inline constexpr int64_t kCudaOneReadSliceBytes = 96 * 1024;
struct CudaOneReadPlan {
  int cluster = 0;
  int64_t slice = 0;
  int threads = 0;
};
CudaOneReadPlan CudaLossOneReadPlan(CudaDtype dtype, int64_t vocab_size);
// The columns a block of a cluster of `cluster` blocks stages: ceil(V / cluster), rounded up
// to a whole 16-byte vector.
int64_t CudaLossOneReadSlice(CudaDtype dtype, int64_t vocab_size, int cluster);

}  // namespace thdpack

#endif  // THDPACK_CUDA_LOSS_H_
