// thdpack/cuda_loss.h: the Status API over the launchers of ce_kernels.cu (ce_launch.h), the
// checks every call makes on the host (sizes, strides, dtypes: nothing that needs the device),
// and the words of the device error flag.
#include "thdpack/cuda_loss.h"

#include <limits>
#include <string>

#include "kernels/ce_launch.h"
#include "kernels/ce_row.h"
#include "kernels/cuda_loss_internal.h"

namespace thdpack {

static_assert(kernels::kCeOneReadMaxShareBytes == kCudaOneReadSliceBytes,
              "the one-read kernel's shared-memory limit is the plan's largest share");
static_assert(kernels::kVersionLatest == kCudaLossLatestVersion,
              "the kernels' latest version is the API's");

namespace {

kernels::CeArgs ToLaunch(const CudaLossArgs& a) {
  return kernels::CeArgs{static_cast<int>(a.dtype), a.logits,      a.num_tokens, a.vocab_size,
                         a.ld,                      a.labels,      a.loss_mask,  a.vocab_start,
                         a.vocab_total,             a.grad_scale,  a.grad,       a.logprob,
                         a.entropy,                 a.stats,       a.error,
                         a.version};
}

}  // namespace

Status CheckCudaLossArgs(const CudaLossArgs& a, const char* call, bool vocab_parallel) {
  const std::string where = std::string(call) + ": ";
  if (a.dtype != CudaDtype::kFloat32 && a.dtype != CudaDtype::kBFloat16 &&
      a.dtype != CudaDtype::kFloat16) {
    return Status::InvalidArgument(where + "dtype " + std::to_string(static_cast<int>(a.dtype)) +
                                   " is not float32, bfloat16 or float16");
  }
  if (a.num_tokens < 0 || a.num_tokens > 0x7fffffff) {
    return Status::InvalidArgument(where + "num_tokens = " + std::to_string(a.num_tokens) +
                                   " must lie in [0, 2^31)");
  }
  if (a.vocab_size < 1) {
    return Status::InvalidArgument(where + "vocab_size = " + std::to_string(a.vocab_size) +
                                   " must be >= 1");
  }
  if (a.ld != 0 && a.ld < a.vocab_size) {
    return Status::InvalidArgument(where + "ld = " + std::to_string(a.ld) +
                                   " is below vocab_size " + std::to_string(a.vocab_size));
  }
  const int64_t total = a.vocab_total > 0 ? a.vocab_total : a.vocab_size;
  if (a.vocab_start < 0 || a.vocab_start + a.vocab_size > total) {
    return Status::InvalidArgument(where + "columns [" + std::to_string(a.vocab_start) + ", " +
                                   std::to_string(a.vocab_start + a.vocab_size) +
                                   ") lie outside the vocabulary of " + std::to_string(total));
  }
  // The fused call reads the target among its own columns: it takes the whole vocabulary
  // (a shard's label could name a column another rank holds).
  if (!vocab_parallel && (a.vocab_start != 0 || total != a.vocab_size)) {
    return Status::InvalidArgument(where + "vocab_start = " + std::to_string(a.vocab_start) +
                                   ", vocab_total = " + std::to_string(a.vocab_total) +
                                   ": the fused call takes the whole vocabulary (vocab_start 0, "
                                   "vocab_total 0 or V); a shard of it goes through the "
                                   "vocab-parallel calls");
  }
  if (a.num_tokens > 0 && (a.logits == nullptr || a.labels == nullptr)) {
    return Status::InvalidArgument(where + "logits and labels are required");
  }
  if (vocab_parallel && a.num_tokens > 0 && a.stats == nullptr) {
    return Status::InvalidArgument(where + "stats ([T] RowStats) is required");
  }
  if (!kernels::IsFinite(a.grad_scale)) {
    return Status::InvalidArgument(where + "grad_scale must be finite");
  }
  if (a.version < 0 || a.version > kCudaLossLatestVersion) {
    return Status::InvalidArgument(where + "version = " + std::to_string(a.version) +
                                   ": the kernels have versions 1 and 2 (0: the latest)");
  }
  return Status::Ok();
}

Status CheckScaleGradientArgs(CudaDtype dtype, const void* grad, int64_t num_tokens,
                              int64_t vocab_size, int64_t ld, const float* factor,
                              const char* call) {
  const std::string where = std::string(call) + ": ";
  if (dtype != CudaDtype::kFloat32 && dtype != CudaDtype::kBFloat16 &&
      dtype != CudaDtype::kFloat16) {
    return Status::InvalidArgument(where + "dtype " + std::to_string(static_cast<int>(dtype)) +
                                   " is not float32, bfloat16 or float16");
  }
  if (num_tokens < 0 || num_tokens > 0x7fffffff || vocab_size < 1 ||
      (ld != 0 && ld < vocab_size)) {
    return Status::InvalidArgument(where + "num_tokens = " + std::to_string(num_tokens) +
                                   ", vocab_size = " + std::to_string(vocab_size) + ", ld = " +
                                   std::to_string(ld) +
                                   " (T in [0, 2^31), V >= 1, ld 0 or >= V)");
  }
  if (num_tokens > 0 && (grad == nullptr || factor == nullptr)) {
    return Status::InvalidArgument(where + "grad and factor are required");
  }
  return Status::Ok();
}

Status CheckLogprobGradArgs(const CudaLogprobGradArgs& a, const char* call) {
  THDPACK_RETURN_IF_ERROR(
      CheckScaleGradientArgs(a.dtype, a.grad, a.num_tokens, a.vocab_size, a.ld, &a.inv_temp, call));
  const std::string where = std::string(call) + ": ";
  if (!(a.inv_temp > 0.0f) || a.inv_temp == std::numeric_limits<float>::infinity()) {
    return Status::InvalidArgument(where + "inv_temp = " + std::to_string(a.inv_temp) +
                                   " must be finite and > 0");
  }
  if (a.num_tokens > 0 && (a.logits == nullptr || a.target == nullptr || a.lse == nullptr ||
                           a.entropy == nullptr || a.g_logprob == nullptr ||
                           a.g_entropy == nullptr)) {
    return Status::InvalidArgument(where + "logits, target, lse, entropy, g_logprob and "
                                   "g_entropy are required");
  }
  return Status::Ok();
}

namespace {

Status FromLaunch(int code, const char* call) {
  if (code == 0) return Status::Ok();
  if (code == kernels::kCeNotBuilt) {
    return Status::Unimplemented(std::string(call) +
                                 ": thdpack was built without CUDA (THDPACK_WITH_CUDA, nvcc)");
  }
  if (code == kernels::kCeNeedsClusters) {
    return Status::Unimplemented(std::string(call) +
                                 ": this row needs a thread-block cluster, which this device "
                                 "(before sm_90) or this build (no sm_90 code) does not have: "
                                 "use CrossEntropyFused");
  }
  return Status::Internal(std::string(call) + ": CUDA error " + std::to_string(code) + " (" +
                          kernels::CeErrorString(code) + ")");
}

}  // namespace

bool CudaLossBuilt() { return kernels::CeBuilt(); }

Status CrossEntropyFused(const CudaLossArgs& args, void* stream) {
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyFused", false));
  return FromLaunch(
      kernels::CeFused(ToLaunch(args), CudaLossBlockThreads(args.vocab_size), stream),
      "CrossEntropyFused");
}

Status CrossEntropyOneRead(const CudaLossArgs& args, void* stream) {
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyOneRead", false));
  const CudaOneReadPlan plan = CudaLossOneReadPlan(args.dtype, args.vocab_size);
  if (plan.cluster == 0) {
    return Status::Unimplemented("CrossEntropyOneRead: a row of " +
                                 std::to_string(args.vocab_size) +
                                 " columns is larger than 8 blocks' shared memory: use "
                                 "CrossEntropyFused");
  }
  if (args.num_tokens * plan.cluster > 0x7fffffff) {
    return Status::InvalidArgument("CrossEntropyOneRead: num_tokens = " +
                                   std::to_string(args.num_tokens) + " rows of " +
                                   std::to_string(plan.cluster) +
                                   " blocks each exceed the grid's 2^31 - 1 blocks");
  }
  return FromLaunch(kernels::CeOneRead(ToLaunch(args), plan.cluster, plan.slice, plan.threads,
                                       stream),
                    "CrossEntropyOneRead");
}

Status CrossEntropyPartials(const CudaLossArgs& args, void* stream) {
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyPartials", true));
  return FromLaunch(
      kernels::CePartials(ToLaunch(args), CudaLossBlockThreads(args.vocab_size), stream),
      "CrossEntropyPartials");
}

Status CombinePartials(const RowStats* gathered, int tp, int64_t num_tokens, RowStats* out,
                       void* stream) {
  if (tp < 1 || num_tokens < 0 || num_tokens > 0x7fffffff ||
      (num_tokens > 0 && (gathered == nullptr || out == nullptr))) {
    return Status::InvalidArgument("CombinePartials: tp = " + std::to_string(tp) +
                                   ", num_tokens = " + std::to_string(num_tokens) +
                                   " (tp >= 1, T in [0, 2^31), both arrays given)");
  }
  return FromLaunch(kernels::CeCombine(gathered, tp, num_tokens, out, stream), "CombinePartials");
}

Status CrossEntropyFinish(const CudaLossArgs& args, void* stream) {
  THDPACK_RETURN_IF_ERROR(CheckCudaLossArgs(args, "CrossEntropyFinish", true));
  return FromLaunch(
      kernels::CeFinish(ToLaunch(args), CudaLossBlockThreads(args.vocab_size), stream),
      "CrossEntropyFinish");
}

Status LogprobEntropyBackward(const CudaLogprobGradArgs& a, void* stream) {
  THDPACK_RETURN_IF_ERROR(CheckLogprobGradArgs(a, "LogprobEntropyBackward"));
  const kernels::CeLogprobGradArgs k{static_cast<int>(a.dtype), a.logits, a.num_tokens,
                                     a.vocab_size, a.ld > 0 ? a.ld : a.vocab_size, a.target,
                                     a.lse, a.entropy, a.g_logprob, a.g_entropy, a.inv_temp,
                                     a.grad};
  return FromLaunch(kernels::CeLogprobGrad(k, stream), "LogprobEntropyBackward");
}

Status ScaleGradient(CudaDtype dtype, void* grad, int64_t num_tokens, int64_t vocab_size,
                     int64_t ld, const float* factor, void* stream) {
  THDPACK_RETURN_IF_ERROR(CheckScaleGradientArgs(dtype, grad, num_tokens, vocab_size, ld,
                                                 factor, "ScaleGradient"));
  return FromLaunch(kernels::CeScaleGrad(static_cast<int>(dtype), grad, num_tokens, vocab_size,
                                         ld > 0 ? ld : vocab_size, factor, stream),
                    "ScaleGradient");
}

Status DecodeCudaLossError(unsigned long long flag, int64_t vocab_total) {
  if (flag == 0) return Status::Ok();
  const int kind = static_cast<int>(flag >> 48);
  const int64_t token = static_cast<int64_t>(flag & 0xffffffffffffull);
  switch (kind) {
    case kernels::kLabelOutOfRange:
      return Status::InvalidArgument("labels[" + std::to_string(token) +
                                     "]: a counted label outside [0, V = " +
                                     std::to_string(vocab_total) + ") (-100 ignores a token)");
    case kernels::kNonFiniteRow:
      return Status::InvalidArgument("logits row " + std::to_string(token) +
                                     ": its log-sum-exp is not finite (inf or NaN logits in a "
                                     "counted row)");
    case kernels::kBadMask:
      return Status::InvalidArgument("loss_mask[" + std::to_string(token) +
                                     "]: a value other than 0 and 1");
  }
  return Status::Internal("CUDA loss error flag " + std::to_string(flag) + " is not a known code");
}

}  // namespace thdpack
