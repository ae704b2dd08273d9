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
//   thdpack._thdpack._cuda_logprob_grad(dtype, logits, T, V, ld, target, lse, entropy,
//       g_logprob, g_entropy, inv_temp, grad, stream): LogprobEntropyBackward (device pointers)
//   thdpack._thdpack._cuda_logprob_grad_host(logits, target, lse, entropy, g_logprob,
//       g_entropy, inv_temp, block_threads, dtype) -> grad: its arithmetic on the CPU
//       (LogprobEntropyBackwardHost) on NumPy arrays - logits [T, V] float32, or the uint16
//       bits of bfloat16 (dtype 1) or float16 (dtype 2) - checked here, for the tests
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

// LogprobEntropyBackwardHost on NumPy arrays, each checked (dtype, shape, contiguity) before
// a pointer is taken: nothing the caller passes is read out of bounds.
py::array LogprobGradHost(const py::array& logits, const py::array& target, const py::array& lse,
                          const py::array& entropy, const py::array& g_logprob,
                          const py::array& g_entropy, double inv_temp, int block_threads,
                          int dtype) {
  if (dtype < 0 || dtype > 2) throw py::value_error("dtype: expected 0, 1 or 2");
  const bool f32 = dtype == 0;
  if (logits.ndim() != 2 || !(logits.flags() & py::array::c_style) ||
      (f32 ? !py::isinstance<py::array_t<float>>(logits)
           : !py::isinstance<py::array_t<uint16_t>>(logits))) {
    throw py::value_error(std::string("logits: expected a C-contiguous 2-d array of ") +
                          (f32 ? "float32" : "uint16 (the bits of bfloat16 or float16)"));
  }
  const int64_t T = logits.shape(0), V = logits.shape(1);
  auto check = [&](const py::array& a, const char* name, bool int64) {
    const bool ok = int64 ? py::isinstance<py::array_t<int64_t>>(a)
                          : py::isinstance<py::array_t<float>>(a);
    if (!ok || a.ndim() != 1 || a.shape(0) != T || !(a.flags() & py::array::c_style)) {
      throw py::value_error(std::string(name) + ": expected a contiguous [T] array of " +
                            (int64 ? "int64" : "float32") + " (T = " + std::to_string(T) + ")");
    }
  };
  check(target, "target", true);
  check(lse, "lse", false);
  check(entropy, "entropy", false);
  check(g_logprob, "g_logprob", false);
  check(g_entropy, "g_entropy", false);
  const auto* tg = static_cast<const int64_t*>(target.data());
  for (int64_t r = 0; r < T; ++r) {
    if (tg[r] < -1 || tg[r] >= V) {
      throw py::value_error("target[" + std::to_string(r) + "] = " + std::to_string(tg[r]) +
                            ": expected -1 or a column in [0, " + std::to_string(V) + ")");
    }
  }
  py::array grad(logits.dtype(), {T, V});
  CudaLogprobGradArgs a;
  a.dtype = static_cast<CudaDtype>(dtype);
  a.logits = logits.data();
  a.num_tokens = T;
  a.vocab_size = V;
  a.target = tg;
  a.lse = static_cast<const float*>(lse.data());
  a.entropy = static_cast<const float*>(entropy.data());
  a.g_logprob = static_cast<const float*>(g_logprob.data());
  a.g_entropy = static_cast<const float*>(g_entropy.data());
  a.inv_temp = static_cast<float>(inv_temp);
  a.grad = grad.mutable_data();
  ThrowIfError(LogprobEntropyBackwardHost(a, block_threads));
  return grad;
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
      "_cuda_logprob_grad",
      [](int dtype, uint64_t logits, int64_t T, int64_t V, int64_t ld, uint64_t target,
         uint64_t lse, uint64_t entropy, uint64_t g_logprob, uint64_t g_entropy,
         double inv_temp, uint64_t grad, uint64_t stream) {
        if (dtype < 0 || dtype > 2) throw py::value_error("dtype: expected 0, 1 or 2");
        CudaLogprobGradArgs a;
        a.dtype = static_cast<CudaDtype>(dtype);
        a.logits = Ptr(logits);
        a.num_tokens = T;
        a.vocab_size = V;
        a.ld = ld;
        a.target = static_cast<const int64_t*>(Ptr(target));
        a.lse = static_cast<const float*>(Ptr(lse));
        a.entropy = static_cast<const float*>(Ptr(entropy));
        a.g_logprob = static_cast<const float*>(Ptr(g_logprob));
        a.g_entropy = static_cast<const float*>(Ptr(g_entropy));
        a.inv_temp = static_cast<float>(inv_temp);
        a.grad = Ptr(grad);
        ThrowIfError(LogprobEntropyBackward(a, Ptr(stream)));
      },
      py::arg("dtype"), py::arg("logits"), py::arg("num_tokens"), py::arg("vocab_size"),
      py::arg("ld"), py::arg("target"), py::arg("lse"), py::arg("entropy"),
      py::arg("g_logprob"), py::arg("g_entropy"), py::arg("inv_temp"), py::arg("grad"),
      py::arg("stream"));
  m.def("_cuda_logprob_grad_host", &LogprobGradHost, py::arg("logits"), py::arg("target"),
        py::arg("lse"), py::arg("entropy"), py::arg("g_logprob"), py::arg("g_entropy"),
        py::arg("inv_temp"), py::arg("block_threads"), py::arg("dtype"));
  m.def(
      "_cuda_loss_error",
      [](uint64_t flag, int64_t vocab_total) {
        ThrowIfError(DecodeCudaLossError(flag, vocab_total));
      },
      py::arg("flag"), py::arg("vocab_total"));
}

}  // namespace thdpack::python
