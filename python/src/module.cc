// python/src/module.cc: the thdpack._thdpack extension module; each area's functions are bound
// in its own bind_<area>.cc. Shared glue (errors, zero-copy array views) lives here.
#include <sstream>

#include "common.h"
#include "thdpack/version.h"

namespace thdpack::python {

// The iterator over torch.distributed (bind_torch_iter.cc); declared here rather than in
// common.h, as only the module registers it.
void BindTorchIter(py::module_& m);
// The gradient buffers of thdpack.torch.local_loss (bind_grad_cache.cc).
void BindGradCache(py::module_& m);

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
    case StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, text.c_str());
      throw py::error_already_set();
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
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  const std::string type_name = py::str(py::type::of(obj).attr("__name__"));
  const std::string module_name = py::str(py::type::of(obj).attr("__module__"));
  if (module_name.rfind("torch", 0) == 0 && py::hasattr(obj, "numpy")) {
    // A tensor: its NumPy view shares the tensor's memory (no copy); tokens and masks carry no
    // gradient, so a tensor that requires one is detached first.
    const std::string device = py::str(obj.attr("device").attr("type"));
    if (device != "cpu") {
      throw py::value_error(name + ": got a torch tensor on device " + device +
                            ", expected one on the CPU (move it with .cpu())");
    }
    try {
      return obj.attr("detach")().attr("numpy")().cast<py::array>();
    } catch (const py::error_already_set& e) {
      throw py::value_error(name + ": got a torch tensor of dtype " +
                            std::string(py::str(obj.attr("dtype"))) +
                            " that NumPy cannot view (" + e.what() + ")");
    }
  }
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    py::array a;
    try {
      a = py::module_::import("numpy").attr("asarray")(obj).cast<py::array>();
    } catch (const py::error_already_set& e) {
      throw py::value_error(name + ": got a " + type_name + " that is not a rectangular list of " +
                            "numbers (" + e.what() + ")");
    }
    const char kind = a.dtype().kind();
    if (kind != 'b' && kind != 'i' && kind != 'u' && kind != 'f') {
      throw py::value_error(name + ": got a " + type_name + " that NumPy reads as a " +
                            DescribeArray(a) + ", expected a list of numbers");
    }
    return a;
  }
  throw py::value_error(name + ": expected a NumPy array, a CPU torch tensor or a list, got " +
                        type_name);
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
  tp::BindGradCache(m);
  tp::BindCost(m);
  tp::BindData(m);
  tp::BindJob(m);
  tp::BindTorchIter(m);
}
