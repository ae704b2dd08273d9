// python/src/bind_cost.cc: the cost model and training FLOPs (cost.h).
#include "common.h"
#include "thdpack/cost.h"

namespace thdpack::python {

void BindCost(py::module_& m) {
  m.def(
      "cost_model",
      [](const std::string& spec) {
        CostModel c = ValueOrThrow(ParseCostSpec(spec));
        py::dict d;
        d["a"] = c.a;
        d["b"] = c.b;
        d["name"] = c.name;
        return d;
      },
      py::arg("spec"), "The cost model of a spec: {'a', 'b', 'name'}, cost(P) = a*P + b*P^2.");
  m.def(
      "flops_coefficients",
      [](const std::string& model) {
        FlopsCoefficients c =
            ValueOrThrow(ComputeFlopsCoefficients(ValueOrThrow(ParseModelDims(model))));
        return py::make_tuple(c.per_token, c.per_token_sq);
      },
      py::arg("model"),
      "(per_token, per_token_sq) training FLOPs of a model spec ('llama3-8b', 'l=..,h=..').");
  m.def(
      "flops",
      [](const std::string& model, const py::handle& cu_obj, py::object padded_tokens,
         py::object sum_sq) {
        FlopsCoefficients c =
            ValueOrThrow(ComputeFlopsCoefficients(ValueOrThrow(ParseModelDims(model))));
        if (!cu_obj.is_none()) {
          if (!padded_tokens.is_none() || !sum_sq.is_none()) {
            throw py::value_error(
                "flops: give either cu_seqlens_padded or (padded_tokens, sum_sq), not both");
          }
          auto cu = IntView1D<int32_t>(cu_obj, "cu_seqlens_padded");
          LengthSums s = ValueOrThrow(SumsFromCuSeqlens(cu));
          return TrainingFlops(c, s.sum, static_cast<double>(s.sum_sq));
        }
        if (padded_tokens.is_none() || sum_sq.is_none()) {
          throw py::value_error("flops: give cu_seqlens_padded, or both padded_tokens and sum_sq");
        }
        double sq = 0;
        try {
          sq = py::float_(sum_sq).cast<double>();
        } catch (const std::exception& e) {
          throw py::value_error(std::string("sum_sq: expected a number (") + e.what() + ")");
        }
        return TrainingFlops(c, Int64Of(padded_tokens, "padded_tokens"), sq);
      },
      py::arg("model"), py::arg("cu_seqlens_padded") = py::none(), py::kw_only(),
      py::arg("padded_tokens") = py::none(), py::arg("sum_sq") = py::none(),
      R"doc(Training FLOPs (forward + backward) of a model on padded sequences, given either a
cu_seqlens_padded int32 array or the sums padded_tokens = sum P and sum_sq = sum P^2.)doc");
}

}  // namespace thdpack::python
