// python/src/bind_loss.cc: the CP-local cross-entropy (loss.h) on NumPy logits.
// bfloat16 has no NumPy dtype: it is passed as its bit pattern in a uint16 or int16 array
// (e.g. t.view(torch.int16).numpy()), and the gradient comes back the same way.
// LossTotals: the step statistics (AccumulateShardLoss, the CP reduction of per-sequence sums,
// Finalize) with the all-reduce passed in as a Python callable (torch.distributed's).
#include <algorithm>
#include <exception>
#include <optional>
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

// counted: any 0/1 array (MaskView1D), as the bytes AccumulateShardLoss reads.
std::vector<uint8_t> CountedFlags(const py::handle& obj) {
  auto v = MaskView1D(obj, "counted");
  return std::vector<uint8_t>(v.begin(), v.end());
}

// A shard's per-token values (float64, counted as flags), checked to be one per token each;
// `where` names the caller in the error.
CrossEntropyResult ShardValues(const py::handle& logprobs, const py::handle& entropy,
                               const py::handle& counted, const std::string& where) {
  CrossEntropyResult r;
  auto lp = DoubleView1D(logprobs, "logprobs");
  auto en = DoubleView1D(entropy, "entropy");
  r.logprobs.assign(lp.begin(), lp.end());
  r.entropy.assign(en.begin(), en.end());
  r.counted = CountedFlags(counted);
  if (r.entropy.size() != r.logprobs.size() || r.counted.size() != r.logprobs.size()) {
    throw py::value_error(where + ": logprobs, entropy and counted have " +
                          std::to_string(r.logprobs.size()) + ", " +
                          std::to_string(r.entropy.size()) + " and " +
                          std::to_string(r.counted.size()) +
                          " entries: one per token of the shard each");
  }
  return r;
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
            CrossEntropyResult r = ShardValues(logprobs, entropy, counted, "add_shard");
            for (size_t t = 0; t < r.counted.size(); ++t) {
              if (!r.counted[t]) continue;
              ++r.n_valid;
              r.loss_sum -= r.logprobs[t];
              r.entropy_sum += r.entropy[t];
            }
            auto cu = IntView1D<int32_t>(cu_seqlens, "cu_seqlens");
            auto cup = IntView1D<int32_t>(cu_seqlens_padded, "cu_seqlens_padded");
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

logprobs, entropy: float64 [T/CP] (0 where not counted; float16/float32 widened); counted:
[T/CP] of 0/1 (bool, any integer or float dtype), in the shard's zigzag order; cu_seqlens,
cu_seqlens_padded: [n+1] of any integer dtype (int32 values), the microbatch's GLOBAL
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
      .def(
          "add_sums",
          [](LossTotals& self, const py::handle& sums) {
            auto v = DoubleView1D(sums, "sums");
            self.Add(ValueOrThrow(LossTotals::FromSums(std::vector<double>(v.begin(), v.end()))));
          },
          py::arg("sums"),
          "Adds totals given as their six sums (float64 [6]: n_tokens, n_loss_tokens, loss_sum, "
          "entropy_sum, ppl_sum, n_ppl), e.g. accumulated on a GPU; ValueError unless each "
          "count is a non-negative integer.")
      .def("summary", [](const LossTotals& self) { return SummaryDict(Finalize(self)); },
           "{'n_tokens', 'n_loss_tokens', 'loss', 'ppl' (None without a loss token), "
           "'entropy'}: Finalize of thdpack/loss.h.");
  m.def(
      "shard_sums_by_source",
      [](const py::handle& logprobs, const py::handle& entropy, const py::handle& counted,
         const py::handle& cu_seqlens, const py::handle& cu_seqlens_padded, int cp_size,
         int cp_rank, const py::handle& sources, const py::object& cp_all_reduce) {
        const CrossEntropyResult r =
            ShardValues(logprobs, entropy, counted, "shard_sums_by_source");
        auto cu = IntView1D<int32_t>(cu_seqlens, "cu_seqlens");
        auto cup = IntView1D<int32_t>(cu_seqlens_padded, "cu_seqlens_padded");
        auto src = IntView1D<int32_t>(sources, "sources");
        if (cp_size > 1 && cp_all_reduce.is_none()) {
          throw py::value_error("shard_sums_by_source: cp_size > 1 needs cp_all_reduce");
        }
        std::vector<LossTotals> by_source;
        std::exception_ptr raised;
        AllReduceSum reduce;
        if (cp_size > 1) reduce = PythonAllReduce(cp_all_reduce, &raised);
        const Status st = AddShardBySource(r, cu, cup, cp_size, cp_rank, src,
                                           cp_size > 1 ? &reduce : nullptr, &by_source);
        RethrowIfRaised(raised);
        ThrowIfError(st);
        py::array_t<double> out({static_cast<py::ssize_t>(by_source.size()), py::ssize_t{6}});
        double* o = out.mutable_data();
        for (const LossTotals& t : by_source) {
          *o++ = static_cast<double>(t.n_tokens);
          *o++ = static_cast<double>(t.n_loss_tokens);
          *o++ = t.loss_sum;
          *o++ = t.entropy_sum;
          *o++ = t.ppl_sum;
          *o++ = static_cast<double>(t.n_ppl);
        }
        return out;
      },
      py::arg("logprobs"), py::arg("entropy"), py::arg("counted"), py::arg("cu_seqlens"),
      py::arg("cu_seqlens_padded"), py::arg("cp_size"), py::arg("cp_rank"), py::arg("sources"),
      py::arg("cp_all_reduce") = py::none(),
      "A shard's statistics by source (AddShardBySource of thdpack/loss.h): float64 [D, 6], "
      "per source the six sums of LossTotals (n_tokens, n_loss_tokens, loss_sum, entropy_sum, "
      "ppl_sum, n_ppl); sources: [n] int, the source of each sequence; one all-reduce over CP.");
}

void BindLoss(py::module_& m) {
  m.def("counts_whole_sequences", &CountsWholeSequences, py::arg("cp_rank"),
        "Whether CP rank cp_rank counts a microbatch's whole sequences (per-sequence terms and "
        "the sequence count): each is counted once over its CP group, on rank 0 "
        "(CountsWholeSequences of thdpack/loss.h).");
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
        const py::array given = AsArray(logits_obj, "logits", /*bfloat16_bits=*/true);
        if (given.ndim() != 2) {
          throw py::value_error("logits: got a " + DescribeArray(given) +
                                ", expected a 2-D [T, V] array");
        }
        LogitsView view;
        if (HoldsType<float>(given)) {
          view.dtype = LogitsDtype::kFloat32;
        } else if (HoldsType<double>(given)) {
          view.dtype = LogitsDtype::kFloat64;
        } else if (HoldsType<uint16_t>(given) || HoldsType<int16_t>(given)) {
          view.dtype = LogitsDtype::kBFloat16;
        } else {
          throw py::value_error("logits: got a " + DescribeArray(given) +
                                ", expected float32, float64, or bfloat16 (a torch tensor, or "
                                "its bits as uint16/int16)");
        }
        const py::array logits = Readable(given, "logits");
        view.num_tokens = logits.shape(0);
        view.vocab_size = logits.shape(1);
        view.data = std::span<const std::byte>(static_cast<const std::byte*>(logits.data()),
                                               static_cast<size_t>(logits.nbytes()));
        TokenTargets targets;
        py::array labels = AsArray(labels_obj, "labels");
        std::optional<HeldSpan<int64_t>> labels64;
        std::optional<HeldSpan<int32_t>> labels32;
        if (HoldsType<int32_t>(labels)) {
          labels32.emplace(View1D<int32_t>(labels, "labels"));
          targets.labels_i32 = *labels32;
        } else {
          // int64 in place; any other integer dtype converted exactly (IntView1D).
          labels64.emplace(IntView1D<int64_t>(labels, "labels"));
          targets.labels_i64 = *labels64;
        }
        std::optional<HeldSpan<float>> mask_f32;
        std::optional<HeldSpan<uint8_t>> mask_u8;
        if (!mask_obj.is_none()) {
          py::array mask = AsArray(mask_obj, "loss_mask");
          if (HoldsType<float>(mask)) {
            mask_f32.emplace(View1D<float>(mask, "loss_mask"));
            targets.mask_f32 = *mask_f32;
          } else {
            // bool and uint8 in place; any other integer or float dtype checked 0/1 and
            // converted (MaskView1D).
            mask_u8.emplace(MaskView1D(mask, "loss_mask"));
            targets.mask_u8 = *mask_u8;
          }
        }
        CrossEntropyOptions o;
        o.with_grad = with_grad;
        o.normalizer = normalizer;
        o.grad_scale = grad_scale;
        o.num_threads = num_threads;
        // The gradient goes into grad_out itself when C++ can write it through a plain pointer,
        // else into a new array copied into grad_out afterwards (np.copyto honours its strides
        // and byte order).
        py::array grad;
        py::object grad_target = py::none();  // grad_out as given
        std::span<std::byte> grad_bytes;
        if (with_grad && !grad_out.is_none()) {
          py::array target =
              AsArray(grad_out, "grad_out", /*bfloat16_bits=*/true, /*allow_list=*/false);
          if (target.dtype().kind() != logits.dtype().kind() ||
              target.itemsize() != logits.itemsize() || target.ndim() != 2 ||
              target.shape(0) != logits.shape(0) || target.shape(1) != logits.shape(1)) {
            throw py::value_error("grad_out: got a " + DescribeArray(target) +
                                  ", expected the logits' dtype and shape (" +
                                  DescribeArray(given) + ")");
          }
          if (!target.writeable()) throw py::value_error("grad_out: the array is read-only");
          py::object np = py::module_::import("numpy");
          if (np.attr("may_share_memory")(target, given).cast<bool>()) {
            throw py::value_error("grad_out: shares memory with logits: give it its own buffer");
          }
          grad = IsReadableInPlace(target)
                     ? target
                     : py::array(logits.dtype(), {logits.shape(0), logits.shape(1)});
          grad_target = target;
        } else if (with_grad) {
          grad = py::array(logits.dtype(), {logits.shape(0), logits.shape(1)});
        }
        if (with_grad) {
          grad_bytes = std::span<std::byte>(static_cast<std::byte*>(grad.mutable_data()),
                                            static_cast<size_t>(grad.nbytes()));
        }
        Result<CrossEntropyResult> r = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          r = CrossEntropy(view, targets, o, grad_bytes);
        }
        CrossEntropyResult res = ValueOrThrow(std::move(r));
        if (!grad_target.is_none() && !grad.is(grad_target)) {
          py::module_::import("numpy").attr("copyto")(grad_target, grad);
          grad = grad_target;
        }
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

logits: [T, V] float32, float64, or bfloat16 (a CPU torch tensor, or its bits as a uint16/int16
array), read in place when C-contiguous, aligned and native, else converted first (a copy).
labels: [T] of any integer dtype (-100 ignored). loss_mask: [T] of 0/1 values (bool or any
integer or float dtype), or None.
normalizer: N, the GLOBAL loss-token count of the step (used by the gradient).
Returns a dict: loss_sum (sum of masked token losses, not divided), entropy_sum, n_valid,
logprobs and entropy (float64 [T], 0 where not counted), counted (uint8 [T]) and, with
with_grad, grad = grad_scale * (softmax - onehot) * counted / N in the logits' dtype,
written into grad_out when given (a writable array of the logits' dtype and shape, e.g. a torch
tensor or its .numpy() view, not sharing memory with the logits: no allocation when it is
C-contiguous, aligned and native), else into a new array.)doc");

  BindLossTotals(m);
  m.def(
      "shard_sequence_layout",
      [](const py::handle& cu_seqlens, const py::handle& cu_seqlens_padded, int cp_size,
         int cp_rank) {
        auto cu = IntView1D<int32_t>(cu_seqlens, "cu_seqlens");
        auto cup = IntView1D<int32_t>(cu_seqlens_padded, "cu_seqlens_padded");
        ShardSequences layout = ValueOrThrow(ShardSequenceLayout(cu, cup, cp_size, cp_rank));
        return py::make_tuple(ToNumpy(std::move(layout.local_cu)),
                              ToNumpy(std::move(layout.real_tokens)));
      },
      py::arg("cu_seqlens"), py::arg("cu_seqlens_padded"), py::arg("cp_size") = 1,
      py::arg("cp_rank") = 0,
      R"doc((local_cu int64 [n+1], real_tokens int64 [n]) of CP rank cp_rank's shard: sequence
i is local tokens [local_cu[i], local_cu[i+1]), real_tokens[i] of them real (loss.h:
ShardSequenceLayout). ValueError naming the offset that breaks a rule.)doc");
}

}  // namespace thdpack::python
