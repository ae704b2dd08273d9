// python/src/bind_loss.cc: the CP-local cross-entropy (loss.h) on NumPy logits.
// bfloat16 has no NumPy dtype: it is passed as its bit pattern in a uint16 or int16 array
// (e.g. t.view(torch.int16).numpy()), and the gradient comes back the same way.
// LossTotals: the step statistics (AccumulateShardLoss, the CP reduction of per-sequence sums,
// Finalize) with the all-reduce passed in as a Python callable (torch.distributed's).
#include <algorithm>
#include <exception>
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/loss.h"

namespace thdpack::python {

namespace {

// A C++ all-reduce over a Python callable fn(array): fn receives a float64 NumPy array and must
// sum it over the group in place (e.g. through a torch tensor and dist.all_reduce). The values
// go through a fresh array (a handful of doubles), copied back after the call. No exception
// crosses the library: a Python exception becomes an error Status, is kept in *raised, and is
// raised again by RethrowIfRaised once the library call has returned.
AllReduceSum PythonAllReduce(const py::object& fn, std::exception_ptr* raised) {
  return [fn, raised](std::span<double> values) -> Status {
    py::array_t<double> a(static_cast<py::ssize_t>(values.size()));
    std::copy(values.begin(), values.end(), a.mutable_data());
    try {
      fn(a);
    } catch (...) {
      *raised = std::current_exception();
      return Status::Internal("all_reduce: the Python callable raised");
    }
    if (a.size() != static_cast<py::ssize_t>(values.size())) {
      return Status::InvalidArgument("all_reduce: the callable changed the array's size");
    }
    std::copy(a.data(), a.data() + values.size(), values.begin());
    return Status::Ok();
  };
}

void RethrowIfRaised(const std::exception_ptr& raised) {
  if (raised) std::rethrow_exception(raised);
}

std::vector<uint8_t> CountedFlags(const py::handle& obj) {
  py::array a = AsArray(obj, "counted");
  if (HasDtype<uint8_t>(a)) {
    auto v = View1D<uint8_t>(a, "counted");
    return std::vector<uint8_t>(v.begin(), v.end());
  }
  auto v = View1D<bool>(a, "counted");
  std::vector<uint8_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[i] ? 1 : 0;
  return out;
}

py::dict SummaryDict(const LossSummary& s) {
  py::dict d;
  d["n_tokens"] = s.n_tokens;
  d["n_loss_tokens"] = s.n_loss_tokens;
  d["loss"] = s.loss;
  d["ppl"] = s.ppl ? py::cast(*s.ppl) : py::none();
  d["entropy"] = s.entropy;
  return d;
}

}  // namespace

void BindLossTotals(py::module_& m) {
  py::class_<LossTotals>(m, "LossTotals",
                         "Additive step statistics of whole sequences (thdpack/loss.h): add "
                         "shards, all-reduce over DP x CP, summary().")
      .def(py::init<>())
      .def_readonly("n_tokens", &LossTotals::n_tokens)
      .def_readonly("n_loss_tokens", &LossTotals::n_loss_tokens)
      .def_readonly("loss_sum", &LossTotals::loss_sum)
      .def_readonly("entropy_sum", &LossTotals::entropy_sum)
      .def_readonly("ppl_sum", &LossTotals::ppl_sum)
      .def_readonly("n_ppl", &LossTotals::n_ppl)
      .def("copy", [](const LossTotals& t) { return LossTotals(t); })
      .def(
          "add_shard",
          [](LossTotals& self, const py::handle& logprobs, const py::handle& entropy,
             const py::handle& counted, const py::handle& cu_seqlens,
             const py::handle& cu_seqlens_padded, int cp_size, int cp_rank,
             const py::object& cp_all_reduce) {
            CrossEntropyResult r;
            auto lp = View1D<double>(logprobs, "logprobs");
            auto en = View1D<double>(entropy, "entropy");
            r.logprobs.assign(lp.begin(), lp.end());
            r.entropy.assign(en.begin(), en.end());
            r.counted = CountedFlags(counted);
            for (size_t t = 0; t < r.counted.size() && t < r.logprobs.size(); ++t) {
              if (!r.counted[t]) continue;
              ++r.n_valid;
              r.loss_sum -= r.logprobs[t];
              r.entropy_sum += r.entropy[t];
            }
            auto cu = View1D<int32_t>(cu_seqlens, "cu_seqlens");
            auto cup = View1D<int32_t>(cu_seqlens_padded, "cu_seqlens_padded");
            if (cp_size > 1 && cp_all_reduce.is_none()) {
              throw py::value_error(
                  "add_shard: cp_size = " + std::to_string(cp_size) +
                  " needs cp_all_reduce: per-sequence sums are all-reduced over the CP group");
            }
            LossStats shard;
            ThrowIfError(AccumulateShardLoss(r, cu, cup, cp_size, cp_rank, {}, &shard));
            if (cp_size > 1) {
              std::exception_ptr raised;
              const Status st =
                  ReduceSequencesOverCp(PythonAllReduce(cp_all_reduce, &raised), cp_rank, &shard);
              RethrowIfRaised(raised);
              ThrowIfError(st);
            }
            self.Add(shard);
          },
          py::arg("logprobs"), py::arg("entropy"), py::arg("counted"), py::arg("cu_seqlens"),
          py::arg("cu_seqlens_padded"), py::arg("cp_size") = 1, py::arg("cp_rank") = 0,
          py::arg("cp_all_reduce") = py::none(),
          R"doc(Adds CP rank cp_rank's shard of one packed microbatch.

logprobs, entropy: float64 [T/CP] (0 where not counted); counted: uint8 or bool [T/CP], in the
shard's zigzag order; cu_seqlens, cu_seqlens_padded: int32 [n+1], the microbatch's GLOBAL
offsets. With cp_size > 1, cp_all_reduce(array) must sum a float64 array over the CP group in
place (every CP rank calls add_shard for the same microbatch): the per-sequence sums are
reduced, and each sequence's perplexity term is kept on CP rank 0 only.)doc")
      .def(
          "all_reduce",
          [](LossTotals& self, const py::object& fn) {
            std::exception_ptr raised;
            const Status st = self.AllReduce(PythonAllReduce(fn, &raised));
            RethrowIfRaised(raised);
            ThrowIfError(st);
          },
          py::arg("all_reduce"),
          "Sums the totals over a group: all_reduce(array) sums a float64 array in place.")
      .def("add", [](LossTotals& self, const LossTotals& other) { self.Add(other); },
           py::arg("other"))
      .def("summary", [](const LossTotals& self) { return SummaryDict(Finalize(self)); },
           "{'n_tokens', 'n_loss_tokens', 'loss', 'ppl' (None without a loss token), "
           "'entropy'}: Finalize of thdpack/loss.h.");
}

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
         int64_t normalizer, bool with_grad, double grad_scale, int num_threads,
         const py::handle& grad_out) {
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
        if (with_grad && !grad_out.is_none()) {
          grad = AsArray(grad_out, "grad_out");
          if (!grad.dtype().is(logits.dtype()) || grad.ndim() != 2 ||
              grad.shape(0) != logits.shape(0) || grad.shape(1) != logits.shape(1)) {
            throw py::value_error("grad_out: got a " + DescribeArray(grad) +
                                  ", expected the logits' dtype and shape (" +
                                  DescribeArray(logits) + ")");
          }
          RequireContiguous(grad, "grad_out");
          if (!grad.writeable()) throw py::value_error("grad_out: the array is read-only");
          grad_bytes = std::span<std::byte>(static_cast<std::byte*>(grad.mutable_data()),
                                            static_cast<size_t>(grad.nbytes()));
        } else if (with_grad) {
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
      py::arg("num_threads") = 0, py::arg("grad_out") = py::none(),
      R"doc(Cross-entropy of one rank's local logits (docs/design.md section 8).

logits: [T, V] float32, float64, or bfloat16 bits as uint16/int16, C-contiguous (not copied).
labels: int64 or int32 [T] (-100 ignored). loss_mask: float32/uint8/bool [T] of 0/1, or None.
normalizer: N, the GLOBAL loss-token count of the step (used by the gradient).
Returns a dict: loss_sum (sum of masked token losses, not divided), entropy_sum, n_valid,
logprobs and entropy (float64 [T], 0 where not counted), counted (uint8 [T]) and, with
with_grad, grad = grad_scale * (softmax - onehot) * counted / N in the logits' dtype,
written into grad_out when given (a C-contiguous writable array of the logits' dtype and shape,
e.g. a torch tensor's .numpy() view: no allocation here), else into a new array.)doc");

  BindLossTotals(m);
}

}  // namespace thdpack::python
