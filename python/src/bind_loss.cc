// python/src/bind_loss.cc: the CP-local cross-entropy (loss.h) on NumPy logits.
// bfloat16 has no NumPy dtype: it is passed as its bit pattern in a uint16 or int16 array
// (e.g. t.view(torch.int16).numpy()), and the gradient comes back the same way.
#include <string>

#include "common.h"
#include "thdpack/loss.h"

namespace thdpack::python {

void BindLoss(py::module_& m) {
  m.def(
      "gradient_factor",
      [](bool framework_averages, int dp_size, int cp_size) {
        return ValueOrThrow(GradientFactor(framework_averages, dp_size, cp_size));
      },
      py::arg("framework_averages"), py::arg("dp_size"), py::arg("cp_size"),
      "1 when gradients are SUMMED over DP x CP, dp_size * cp_size when they are averaged.");

  m.def(
      "cross_entropy",
      [](const py::handle& logits_obj, const py::handle& labels_obj, const py::handle& mask_obj,
         int64_t normalizer, bool with_grad, double grad_scale, int num_threads) {
        py::array logits = AsArray(logits_obj, "logits");
        if (logits.ndim() != 2) {
          throw py::value_error("logits: got a " + DescribeArray(logits) +
                                ", expected a 2-D [T, V] array");
        }
        RequireContiguous(logits, "logits");
        LogitsView view;
        if (HasDtype<float>(logits)) {
          view.dtype = LogitsDtype::kFloat32;
        } else if (HasDtype<double>(logits)) {
          view.dtype = LogitsDtype::kFloat64;
        } else if (HasDtype<uint16_t>(logits) || HasDtype<int16_t>(logits)) {
          view.dtype = LogitsDtype::kBFloat16;
        } else {
          throw py::value_error("logits: got a " + DescribeArray(logits) +
                                ", expected float32, float64, or bfloat16 bits as uint16/int16");
        }
        view.num_tokens = logits.shape(0);
        view.vocab_size = logits.shape(1);
        view.data = std::span<const std::byte>(static_cast<const std::byte*>(logits.data()),
                                               static_cast<size_t>(logits.nbytes()));
        TokenTargets targets;
        py::array labels = AsArray(labels_obj, "labels");
        if (HasDtype<int64_t>(labels)) {
          targets.labels_i64 = View1D<int64_t>(labels, "labels");
        } else if (HasDtype<int32_t>(labels)) {
          targets.labels_i32 = View1D<int32_t>(labels, "labels");
        } else {
          throw py::value_error("labels: got a " + DescribeArray(labels) +
                                ", expected int64 or int32");
        }
        py::array mask;
        if (!mask_obj.is_none()) {
          mask = AsArray(mask_obj, "loss_mask");
          if (HasDtype<float>(mask)) {
            targets.mask_f32 = View1D<float>(mask, "loss_mask");
          } else if (HasDtype<uint8_t>(mask)) {
            targets.mask_u8 = View1D<uint8_t>(mask, "loss_mask");
          } else if (HasDtype<bool>(mask)) {
            auto b = View1D<bool>(mask, "loss_mask");
            targets.mask_u8 =
                std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(b.data()), b.size());
          } else {
            throw py::value_error("loss_mask: got a " + DescribeArray(mask) +
                                  ", expected float32, uint8 or bool");
          }
        }
        CrossEntropyOptions o;
        o.with_grad = with_grad;
        o.normalizer = normalizer;
        o.grad_scale = grad_scale;
        o.num_threads = num_threads;
        py::array grad;
        std::span<std::byte> grad_bytes;
        if (with_grad) {
          grad = py::array(logits.dtype(), {logits.shape(0), logits.shape(1)});
          grad_bytes = std::span<std::byte>(static_cast<std::byte*>(grad.mutable_data()),
                                            static_cast<size_t>(grad.nbytes()));
        }
        Result<CrossEntropyResult> r = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          r = CrossEntropy(view, targets, o, grad_bytes);
        }
        CrossEntropyResult res = ValueOrThrow(std::move(r));
        py::dict d;
        d["loss_sum"] = res.loss_sum;
        d["entropy_sum"] = res.entropy_sum;
        d["n_valid"] = res.n_valid;
        d["logprobs"] = ToNumpy(std::move(res.logprobs));
        d["entropy"] = ToNumpy(std::move(res.entropy));
        d["counted"] = ToNumpy(std::move(res.counted));
        if (with_grad) d["grad"] = grad;
        return d;
      },
      py::arg("logits"), py::arg("labels"), py::arg("loss_mask"), py::arg("normalizer"),
      py::kw_only(), py::arg("with_grad") = false, py::arg("grad_scale") = 1.0,
      py::arg("num_threads") = 0,
      R"doc(Cross-entropy of one rank's local logits (docs/design.md section 8).

logits: [T, V] float32, float64, or bfloat16 bits as uint16/int16, C-contiguous (not copied).
labels: int64 or int32 [T] (-100 ignored). loss_mask: float32/uint8/bool [T] of 0/1, or None.
normalizer: N, the GLOBAL loss-token count of the step (used by the gradient).
Returns a dict: loss_sum (sum of masked token losses, not divided), entropy_sum, n_valid,
logprobs and entropy (float64 [T], 0 where not counted), counted (uint8 [T]) and, with
with_grad, grad = grad_scale * (softmax - onehot) * counted / N in the logits' dtype.)doc");
}

}  // namespace thdpack::python
