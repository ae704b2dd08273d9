// python/src/module.cc: the thdpack._thdpack extension module; each area's functions are bound
// in its own bind_<area>.cc. Shared glue (errors, zero-copy array views) lives here.
#include <sstream>

#include "common.h"
#include "thdpack/version.h"

namespace thdpack::python {

// The iterator over torch.distributed (bind_torch_iter.cc); declared here rather than in
// common.h, as only the module registers it.
void BindTorchIter(py::module_& m);

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  const std::string text = status.ToString();
  switch (status.code()) {
    case StatusCode::kIOError:
      PyErr_SetString(PyExc_OSError, text.c_str());
      throw py::error_already_set();
    case StatusCode::kInvalidArgument:
    case StatusCode::kCorruption:
    case StatusCode::kOutOfRange:
    case StatusCode::kNotFound:
    case StatusCode::kUnimplemented:
      throw py::value_error(text);
    default:
      throw std::runtime_error(text);
  }
}

std::string DescribeArray(const py::array& a) {
  std::ostringstream s;
  s << std::string(py::str(a.dtype())) << " array of shape (";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  if (a.ndim() == 1) s << ",";
  s << ")";
  return s.str();
}

py::array AsArray(const py::handle& obj, const std::string& name) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::value_error(name + ": expected a NumPy array, got " +
                          std::string(py::str(py::type::of(obj).attr("__name__"))) +
                          " (torch tensors: pass t.numpy() on CPU)");
  }
  return py::reinterpret_borrow<py::array>(obj);
}

void RequireContiguous(const py::array& a, const std::string& name) {
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(name + ": got a non-contiguous " + DescribeArray(a) +
                          ", expected a C-contiguous array (use np.ascontiguousarray)");
  }
}

}  // namespace thdpack::python

PYBIND11_MODULE(_thdpack, m) {
  namespace tp = thdpack::python;
  m.doc() = "thdpack: scheduling, THD packing, CP/SP sharding, step metadata and CP-local loss";
  m.attr("__version__") = thdpack::kVersion;
  tp::BindLayout(m);
  tp::BindSchedule(m);
  tp::BindPack(m);
  tp::BindShard(m);
  tp::BindWire(m);
  tp::BindLoss(m);
  tp::BindCost(m);
  tp::BindData(m);
  tp::BindJob(m);
  tp::BindTorchIter(m);
}
