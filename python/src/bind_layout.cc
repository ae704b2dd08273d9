// Python bindings of the parallel layout of a microbatch and its padding rule
// (thdpack/parallel_layout.h). The other bindings take the same five keyword arguments
// (cp_size, tp_size, sp, extra_alignment, rank_multiple) and build their ParallelLayout with
// MakeLayout.
#include <string>

#include "common.h"
#include "thdpack/parallel_layout.h"

namespace thdpack::python {

ParallelLayout MakeLayout(int cp_size, int tp_size, bool sp, int64_t extra_alignment,
                          int64_t rank_multiple) {
  return ValueOrThrow(
      ParallelLayout::Create(cp_size, tp_size, sp, extra_alignment, rank_multiple));
}

int64_t RankMultipleOf(const py::handle& value, const std::string& name) {
  if (py::isinstance<py::str>(value)) {
    Result<int64_t> r = ParseRankMultiple(value.cast<std::string>());
    if (!r.ok()) throw py::value_error(name + ": " + r.status().message());
    return *r;
  }
  if (py::isinstance<py::bool_>(value)) {
    throw py::value_error(name + ": expected an integer or a preset name (fp8, mxfp8, "
                                 "blockwise, none), got bool");
  }
  return Int64Of(value, name);
}

ParallelLayout LayoutOf(const LayoutArgs& a, const std::string& where) {
  const std::pair<const char*, const py::object*> scalars[] = {
      {"cp_size", &a.cp_size},
      {"tp_size", &a.tp_size},
      {"sp", &a.sp},
      {"extra_alignment", &a.extra_alignment},
      {"rank_multiple", &a.rank_multiple}};
  if (!a.layout.is_none()) {
    if (!py::isinstance<ParallelLayout>(a.layout)) {
      throw py::type_error(where + ": layout must be a thdpack.ParallelLayout, got " +
                           std::string(py::str(py::type::of(a.layout).attr("__name__"))));
    }
    std::string given;
    for (const auto& [name, value] : scalars) {
      if (!value->is_none()) given += std::string(given.empty() ? "" : ", ") + name;
    }
    if (!given.empty()) {
      throw py::type_error(where + ": give layout= or its scalars, not both (got layout and " +
                           given + "; the layout already holds them)");
    }
    return a.layout.cast<ParallelLayout>();
  }
  auto int_or = [&](const py::object& v, const char* name, int64_t fallback) {
    if (v.is_none()) return fallback;
    if (py::isinstance<py::bool_>(v)) {
      throw py::type_error(where + ": " + name + " must be an integer, got bool");
    }
    return Int64Of(v, name);
  };
  const int64_t cp = int_or(a.cp_size, "cp_size", 1), tp = int_or(a.tp_size, "tp_size", 1);
  if (cp < 1 || cp > INT32_MAX || tp < 1 || tp > INT32_MAX) {
    throw py::value_error(where + ": cp_size = " + std::to_string(cp) + ", tp_size = " +
                          std::to_string(tp) + ": each must lie in [1, 2^31)");
  }
  bool sp = false;
  if (!a.sp.is_none()) {
    if (!py::isinstance<py::bool_>(a.sp)) {
      throw py::type_error(where + ": sp must be a bool, got " +
                           std::string(py::str(py::type::of(a.sp).attr("__name__"))));
    }
    sp = a.sp.cast<bool>();
  }
  return MakeLayout(static_cast<int>(cp), static_cast<int>(tp), sp,
                    int_or(a.extra_alignment, "extra_alignment", 1),
                    a.rank_multiple.is_none() ? 1
                                              : RankMultipleOf(a.rank_multiple, "rank_multiple"));
}

void BindLayout(py::module_& m) {
  py::class_<ParallelLayout>(m, "ParallelLayout",
                             "The parallel layout of a microbatch (CP, TP, SP, extra alignment) "
                             "and the padding rule: P = padded_length(L), T = "
                             "microbatch_tokens(sum P).")
      .def(py::init([](int cp_size, int tp_size, bool sp, int64_t extra_alignment,
                       const py::object& rank_multiple) {
             return MakeLayout(cp_size, tp_size, sp, extra_alignment,
                               RankMultipleOf(rank_multiple, "rank_multiple"));
           }),
           py::arg("cp_size") = 1, py::arg("tp_size") = 1, py::arg("sp") = false,
           py::arg("extra_alignment") = 1, py::arg("rank_multiple") = 1,
           "Validates the layout; ValueError naming the argument and rule otherwise. "
           "rank_multiple: an int, or 'fp8' (16), 'mxfp8' (32), 'blockwise' (128), 'none' (1).")
      .def_property_readonly("cp_size", &ParallelLayout::cp_size)
      .def_property_readonly("tp_size", &ParallelLayout::tp_size)
      .def_property_readonly("sp", &ParallelLayout::sp)
      .def_property_readonly("extra_alignment", &ParallelLayout::extra_alignment)
      .def_property_readonly("rank_multiple", &ParallelLayout::rank_multiple,
                             "Every rank's tokens of a microbatch are a multiple of it")
      .def_property_readonly("split_ranks", &ParallelLayout::split_ranks,
                             "The ranks T is divided over: CP, or CP*TP with SP over TP > 1")
      .def_property_readonly("rank_quantum", &ParallelLayout::rank_quantum,
                             "split_ranks * rank_multiple: T is a multiple of it")
      .def_property_readonly("zigzag_multiple", &ParallelLayout::zigzag_multiple,
                             "2*CP when CP > 1, else 1")
      .def_property_readonly("sequence_alignment", &ParallelLayout::sequence_alignment,
                             "Every padded sequence length is a multiple of it")
      .def_property_readonly("token_quantum", &ParallelLayout::token_quantum,
                             "Every microbatch's T is a multiple of it")
      .def(
          "padded_length",
          [](const ParallelLayout& l, int64_t length) {
            if (length < 0 || length > (int64_t{1} << 62)) {
              throw py::value_error("length = " + std::to_string(length) +
                                    ": must lie in [0, 2^62]");
            }
            return l.PaddedLength(length);
          },
          py::arg("length"), "P = roundup(length, sequence_alignment)")
      .def(
          "microbatch_tokens",
          [](const ParallelLayout& l, int64_t sum_padded) {
            if (sum_padded < 0 || sum_padded > (int64_t{1} << 62)) {
              throw py::value_error("sum_padded = " + std::to_string(sum_padded) +
                                    ": must lie in [0, 2^62]");
            }
            return l.MicrobatchTokens(sum_padded);
          },
          py::arg("sum_padded"), "T = roundup(sum of padded lengths, token_quantum)")
      .def("__eq__", [](const ParallelLayout& a, const ParallelLayout& b) { return a == b; })
      .def("__repr__",
           [](const ParallelLayout& l) { return "ParallelLayout(" + l.ToString() + ")"; });
}

}  // namespace thdpack::python
