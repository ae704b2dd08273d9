// Python bindings of the parallel layout of a microbatch and its padding rule
// (thdpack/parallel_layout.h). The other bindings take the same four keyword arguments
// (cp_size, tp_size, sp, extra_alignment) and build their ParallelLayout with MakeLayout.
#include <string>

#include "common.h"
#include "thdpack/parallel_layout.h"

namespace thdpack::python {

ParallelLayout MakeLayout(int cp_size, int tp_size, bool sp, int64_t extra_alignment) {
  return ValueOrThrow(ParallelLayout::Create(cp_size, tp_size, sp, extra_alignment));
}

void BindLayout(py::module_& m) {
  py::class_<ParallelLayout>(m, "ParallelLayout",
                             "The parallel layout of a microbatch (CP, TP, SP, extra alignment) "
                             "and the padding rule: P = padded_length(L), T = "
                             "microbatch_tokens(sum P).")
      .def(py::init(&MakeLayout), py::arg("cp_size") = 1, py::arg("tp_size") = 1,
           py::arg("sp") = false, py::arg("extra_alignment") = 1,
           "Validates the layout; ValueError naming the argument and rule otherwise.")
      .def_property_readonly("cp_size", &ParallelLayout::cp_size)
      .def_property_readonly("tp_size", &ParallelLayout::tp_size)
      .def_property_readonly("sp", &ParallelLayout::sp)
      .def_property_readonly("extra_alignment", &ParallelLayout::extra_alignment)
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
