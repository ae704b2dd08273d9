// python/src/bind_cuda_loss.cc: the CUDA cross-entropy of thdpack/cuda_loss.h for
// thdpack.torch (python/thdpack/torch/_loss_cuda.py), called with tensors' data_ptr() values and
// torch's current stream; the module never links libtorch.
//
//   thdpack._thdpack.cuda_loss_built() -> bool: whether this build has the kernels
//   thdpack._thdpack._cuda_cross_entropy(call, dtype, logits, T, V, ld, labels, loss_mask,
//       vocab_start, vocab_total, grad_scale, grad, logprob, entropy, stats, error, stream,
//       version=0)
//       call: "fused" | "one_read" | "partials" | "finish"; pointers as ints (0: none);
//       version: the kernels' version, 1 or 2 (0: the latest)
//   thdpack._thdpack._cuda_scale_grad(dtype, grad, T, V, ld, factor, stream): grad *= *factor
//       on the device (ScaleGradient: nothing written when the factor is 1)
//   thdpack._thdpack._cuda_one_read_plan(dtype, V) -> (cluster, slice, threads): the one-read
//       kernel's split of a row (cluster 0: too large for it)
//   thdpack._thdpack._cuda_combine_partials(gathered, tp, T, out, stream)
//   thdpack._thdpack._cuda_loss_error(flag, vocab_total): ValueError naming the token for a
//       nonzero device error flag, None for 0
//
// The pointers are never dereferenced on the host: a wrong one is a CUDA error of the launch or
// of the stream (RuntimeError), not a crash of the interpreter. The private functions are for
// _loss_cuda.py, which passes the pointers of tensors it checked.
#include <cstdint>
#include <string>

#include "common.h"
#include "thdpack/cuda_loss.h"

namespace thdpack::python {
namespace {

void* Ptr(uint64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }

void CrossEntropyCall(const std::string& call, int dtype, uint64_t logits, int64_t T, int64_t V,
                      int64_t ld, uint64_t labels, uint64_t loss_mask, int64_t vocab_start,
                      int64_t vocab_total, double grad_scale, uint64_t grad, uint64_t logprob,
                      uint64_t entropy, uint64_t stats, uint64_t error, uint64_t stream,
                      int version) {
  if (dtype < 0 || dtype > 2) {
    throw py::value_error("dtype " + std::to_string(dtype) +
                          ": expected 0 (float32), 1 (bfloat16) or 2 (float16)");
  }
  CudaLossArgs a;
  a.dtype = static_cast<CudaDtype>(dtype);
  a.logits = Ptr(logits);
  a.num_tokens = T;
  a.vocab_size = V;
  a.ld = ld;
  a.labels = static_cast<const int64_t*>(Ptr(labels));
  a.loss_mask = static_cast<const float*>(Ptr(loss_mask));
  a.vocab_start = vocab_start;
  a.vocab_total = vocab_total;
  a.grad_scale = static_cast<float>(grad_scale);
  a.grad = Ptr(grad);
  a.logprob = static_cast<float*>(Ptr(logprob));
  a.entropy = static_cast<float*>(Ptr(entropy));
  a.stats = static_cast<RowStats*>(Ptr(stats));
  a.error = static_cast<unsigned long long*>(Ptr(error));
  a.version = version;
  Status s;
  if (call == "fused") {
    s = CrossEntropyFused(a, Ptr(stream));
  } else if (call == "one_read") {
    s = CrossEntropyOneRead(a, Ptr(stream));
  } else if (call == "partials") {
    s = CrossEntropyPartials(a, Ptr(stream));
  } else if (call == "finish") {
    s = CrossEntropyFinish(a, Ptr(stream));
  } else {
    throw py::value_error("call \"" + call + "\": expected fused, one_read, partials or finish");
  }
  ThrowIfError(s);
}

}  // namespace

void BindCudaLoss(py::module_& m) {
  m.def("cuda_loss_built", &CudaLossBuilt,
        "Whether this build of thdpack has the CUDA cross-entropy kernels (thdpack/cuda_loss.h).");
  m.def("_cuda_cross_entropy", &CrossEntropyCall, py::arg("call"), py::arg("dtype"),
        py::arg("logits"), py::arg("num_tokens"), py::arg("vocab_size"), py::arg("ld"),
        py::arg("labels"), py::arg("loss_mask"), py::arg("vocab_start"), py::arg("vocab_total"),
        py::arg("grad_scale"), py::arg("grad"), py::arg("logprob"), py::arg("entropy"),
        py::arg("stats"), py::arg("error"), py::arg("stream"), py::arg("version") = 0);
  m.def(
      "_cuda_scale_grad",
      [](int dtype, uint64_t grad, int64_t T, int64_t V, int64_t ld, uint64_t factor,
         uint64_t stream) {
        if (dtype < 0 || dtype > 2) throw py::value_error("dtype: expected 0, 1 or 2");
        ThrowIfError(ScaleGradient(static_cast<CudaDtype>(dtype), Ptr(grad), T, V, ld,
                                   static_cast<const float*>(Ptr(factor)), Ptr(stream)));
      },
      py::arg("dtype"), py::arg("grad"), py::arg("num_tokens"), py::arg("vocab_size"),
      py::arg("ld"), py::arg("factor"), py::arg("stream"));
  m.def(
      "_cuda_one_read_plan",
      [](int dtype, int64_t V) {
        if (dtype < 0 || dtype > 2) throw py::value_error("dtype: expected 0, 1 or 2");
        const CudaOneReadPlan p = CudaLossOneReadPlan(static_cast<CudaDtype>(dtype), V);
        return py::make_tuple(p.cluster, p.slice, p.threads);
      },
      py::arg("dtype"), py::arg("vocab_size"));
  m.def(
      "_cuda_combine_partials",
      [](uint64_t gathered, int tp, int64_t T, uint64_t out, uint64_t stream) {
        ThrowIfError(CombinePartials(static_cast<const RowStats*>(Ptr(gathered)), tp, T,
                                     static_cast<RowStats*>(Ptr(out)), Ptr(stream)));
      },
      py::arg("gathered"), py::arg("tp"), py::arg("num_tokens"), py::arg("out"),
      py::arg("stream"));
  m.def(
      "_cuda_loss_error",
      [](uint64_t flag, int64_t vocab_total) {
        ThrowIfError(DecodeCudaLossError(flag, vocab_total));
      },
      py::arg("flag"), py::arg("vocab_total"));
}

}  // namespace thdpack::python
