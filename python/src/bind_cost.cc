// python/src/bind_cost.cc: the cost model and training FLOPs (cost.h).
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/cost.h"
#include "thdpack/profile.h"

namespace thdpack::python {

namespace {

// held_out (0/1 per row, or None) onto the rows' held_out flags; `rows_name` names the rows'
// argument in the error for a count that differs.
template <typename Row>
void MarkHeldOut(const py::object& held_out, std::vector<Row>& rows, const char* rows_name) {
  if (held_out.is_none()) return;
  auto flags = MaskView1D(held_out, "held_out");
  if (flags.size() != rows.size()) {
    throw py::value_error("held_out: has " + std::to_string(flags.size()) + " entries, " +
                          rows_name + " has " + std::to_string(rows.size()));
  }
  for (size_t i = 0; i < rows.size(); ++i) rows[i].held_out = flags[i] != 0;
}

// The profile as Python objects (json.loads of its file text).
py::object ProfileObject(const CostProfile& p) {
  return py::module_::import("json").attr("loads")(CostProfileJson(p));
}

}  // namespace

void BindCost(py::module_& m) {
  m.def(
      "fit_encoder_profile",
      [](const py::handle& seconds_obj, const py::handle& patches_obj,
         const py::handle& frame_sq_obj, const py::object& held_out, const std::string& model,
         const std::string& profile, const py::object& out) {
        std::vector<double> seconds;
        try {
          seconds = seconds_obj.cast<std::vector<double>>();
        } catch (const py::cast_error&) {
          throw py::value_error("seconds: expected a sequence of numbers, one per timed call");
        }
        const auto patches = IntView1D<int64_t>(patches_obj, "patches");
        const auto frame_sq = IntView1D<int64_t>(frame_sq_obj, "frame_sq");
        if (patches.size() != seconds.size() || frame_sq.size() != seconds.size()) {
          throw py::value_error("seconds, patches, frame_sq: " + std::to_string(seconds.size()) +
                                ", " + std::to_string(patches.size()) + " and " +
                                std::to_string(frame_sq.size()) + " entries: one per call");
        }
        std::vector<TimedEncoderCall> rows(seconds.size());
        for (size_t i = 0; i < rows.size(); ++i) {
          rows[i] = TimedEncoderCall{seconds[i], patches[i], frame_sq[i], false};
        }
        MarkHeldOut(held_out, rows, "seconds");
        // The term joins the language model's profile: one file, one unit (seconds).
        CostProfile p = ValueOrThrow(ReadCostProfile(profile));
        p.encoder = ValueOrThrow(FitEncoderProfile(rows, model));
        ThrowIfError(WriteCostProfile(p, out.is_none() ? profile
                                                       : py::str(out).cast<std::string>()));
        return ProfileObject(p);
      },
      py::arg("seconds"), py::arg("patches"), py::arg("frame_sq"),
      py::arg("held_out") = py::none(), py::kw_only(), py::arg("model") = "",
      py::arg("profile"), py::arg("out") = py::none(),
      R"doc(Fits a vision encoder's term (thdpack/profile.h FitEncoderProfile): per_patch *
sum t*h*w + per_frame_sq * sum t*(h*w)^2 seconds a call, by non-negative least squares of the
relative error, and writes it into the cost profile `profile` (to `out` when given, else in
place). seconds, patches, frame_sq: one entry per timed call; held_out: 0/1 per call, those not
fitted on. Returns the profile as the file's JSON objects. ValueError naming the rule broken.)doc");

  m.def(
      "fit_cost_profile",
      [](const py::sequence& timings, const py::object& held_out, const std::string& model,
         const std::string& device, const std::string& dtype, const std::string& attention,
         int tp_size, int cp_size, bool refine, const py::object& out) {
        std::vector<TimedMicrobatch> rows;
        rows.reserve(py::len(timings));
        for (size_t i = 0; i < py::len(timings); ++i) {
          const std::string name = "timings[" + std::to_string(i) + "]";
          py::object item = timings[i];
          if (!py::isinstance<py::sequence>(item) || py::len(item) != 2) {
            throw py::value_error(name + ": expected a (seconds, lengths) pair");
          }
          TimedMicrobatch r;
          try {
            r.seconds = py::float_(item[py::int_(0)]).cast<double>();
          } catch (const std::exception& e) {
            throw py::value_error(name + "[0]: expected the seconds, a number (" + e.what() + ")");
          }
          auto lengths = IntView1D<int64_t>(item[py::int_(1)], name + "[1]");
          r.lengths.assign(lengths.begin(), lengths.end());
          rows.push_back(std::move(r));
        }
        MarkHeldOut(held_out, rows, "timings");
        MeasuredOn on;
        on.model = model;
        on.device = device;
        on.dtype = dtype;
        on.attention = attention;
        on.tp_size = tp_size;
        on.cp_size = cp_size;
        if (tp_size < 1 || cp_size < 1) {
          throw py::value_error("tp_size and cp_size must be >= 1");
        }
        FitOptions options;
        options.refine = refine;
        CostProfile p = ValueOrThrow(FitCostProfile(rows, on, options));
        if (!out.is_none()) {
          ThrowIfError(WriteCostProfile(p, py::str(out).cast<std::string>()));
        }
        return ProfileObject(p);
      },
      py::arg("timings"), py::arg("held_out") = py::none(), py::kw_only(),
      py::arg("model") = "", py::arg("device") = "", py::arg("dtype") = "",
      py::arg("attention") = "", py::arg("tp_size") = 1, py::arg("cp_size") = 1,
      py::arg("refine") = true, py::arg("out") = py::none(),
      R"doc(Fits a measured cost profile (thdpack/profile.h): cost(P) = a P + b P^2 + c seconds a
sequence of padded length P, by non-negative least squares of the relative error.

timings: a list of (seconds, lengths) pairs, one per timed microbatch (lengths: its padded
sequence lengths, any integer array or list). held_out: 0/1 per microbatch, the ones not fitted
on (their errors are reported). model, device, dtype, attention, tp_size, cp_size: what was
measured (model a cost spec with dimensions - "llama2-7b", "l=..,h=..,..." - gives the
step-time model its K/V exchange). refine: also try a constant per microbatch. out: a path to
write the profile to (for --cost profile:FILE). Returns the profile as the file's JSON objects.
ValueError when there are too few microbatches or they do not vary enough.)doc");

  m.def(
      "read_cost_profile",
      [](const std::string& path) { return ProfileObject(ValueOrThrow(ReadCostProfile(path))); },
      py::arg("path"),
      "A profile file, validated (ValueError naming the file and field; OSError if unreadable).");

  m.def(
      "read_timings_csv",
      [](const std::string& path, int hold_out_every) {
        py::list out;
        for (TimedMicrobatch& r : ValueOrThrow(ReadTimingsCsv(path, hold_out_every))) {
          out.append(py::make_tuple(r.seconds, ToNumpy(std::move(r.lengths)), r.held_out));
        }
        return out;
      },
      py::arg("path"), py::arg("hold_out_every") = 4,
      "Timings CSV (header `seconds,lengths`) as (seconds, lengths, held_out) triples.");

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
