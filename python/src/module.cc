// python/src/module.cc: the thdpack._thdpack extension module; each area's functions are bound
// in its own bind_<area>.cc. Shared glue (errors, zero-copy array views) lives here.
#include <sstream>

#include "common.h"
#include "thdpack/version.h"

namespace thdpack::python {

// The iterator over torch.distributed (bind_torch_iter.cc); declared here rather than in
// common.h, as only the module registers it.
void BindTorchIter(py::module_& m);
void BindTorchComm(py::module_& m);
void BindFields(py::module_& m);
// Columnar sources: Arrow streams imported, the opener of parquet: and arrow: (bind_arrow.cc).
void BindArrow(py::module_& m);
// Media: items, mRoPE, routes (bind_media.cc).
void BindMedia(py::module_& m);
// The gradient buffers of thdpack.torch.local_loss (bind_grad_cache.cc).
void BindGradCache(py::module_& m);

std::string PyErrorText(const py::error_already_set& e) {
  py::gil_scoped_acquire gil;
  try {
    const std::string type = py::str(e.type().attr("__name__"));
    const std::string text = py::str(e.value());
    return type + ": " + text;
  } catch (const std::exception&) {
    return e.what();
  }
}

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
    case StatusCode::kEndOfData:
      throw py::stop_iteration(text);
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

py::array AsArray(const py::handle& obj, const std::string& name, bool bfloat16_bits,
                  bool allow_list) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  const std::string type_name = py::str(py::type::of(obj).attr("__name__"));
  const std::string module_name = py::str(py::type::of(obj).attr("__module__"));
  if (module_name.rfind("torch", 0) == 0 && py::hasattr(obj, "numpy")) {
    // A tensor: its NumPy view shares the tensor's memory (no copy). Tokens and masks carry no
    // gradient, so a tensor that requires one is detached first; a lazily conjugated or negated
    // view is materialised (NumPy cannot express those bits).
    const std::string device = py::str(obj.attr("device").attr("type"));
    if (device != "cpu") {
      throw py::value_error(name + ": got a torch tensor on device " + device +
                            ", expected one on the CPU (move it with .cpu())");
    }
    const std::string layout = py::str(obj.attr("layout"));
    if (layout != "torch.strided") {
      throw py::value_error(name + ": got a torch tensor of layout " + layout +
                            ", expected a dense (strided) tensor (use .to_dense())");
    }
    try {
      py::object t = obj.attr("detach")();
      if (py::hasattr(t, "resolve_conj")) t = t.attr("resolve_conj")().attr("resolve_neg")();
      const std::string dtype = py::str(t.attr("dtype"));
      if (bfloat16_bits && dtype == "torch.bfloat16") {
        t = t.attr("view")(py::module_::import("torch").attr("int16"));
      }
      return t.attr("numpy")().cast<py::array>();
    } catch (const py::error_already_set& e) {
      throw py::value_error(name + ": got a torch tensor of dtype " +
                            std::string(py::str(obj.attr("dtype"))) +
                            " that NumPy cannot view (" + PyErrorText(e) + ")");
    }
  }
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    if (!allow_list) {
      throw py::value_error(name + ": got a " + type_name + ", expected a writable NumPy array " +
                            "or CPU torch tensor (the result is written into it)");
    }
    py::array a;
    try {
      a = py::module_::import("numpy").attr("asarray")(obj).cast<py::array>();
    } catch (const py::error_already_set& e) {
      throw py::value_error(name + ": got a " + type_name + " that is not a rectangular list of " +
                            "numbers (" + PyErrorText(e) + ")");
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

int64_t Int64Of(const py::handle& value, const std::string& name) {
  try {
    return py::module_::import("operator").attr("index")(value).cast<int64_t>();
  } catch (const std::exception& e) {
    throw py::value_error(name + ": expected an integer, got " +
                          std::string(py::str(py::type::of(value).attr("__name__"))) + " (" +
                          e.what() + ")");
  }
}

bool IsReadableInPlace(const py::array& a) {
  constexpr int kNeeded =
      py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  return (a.flags() & kNeeded) == kNeeded && a.dtype().attr("isnative").cast<bool>();
}

py::array Readable(const py::array& a, const std::string& name) {
  if (a.dtype().attr("hasobject").cast<bool>()) {
    throw py::value_error(name + ": got a " + DescribeArray(a) +
                          ", which holds Python objects; expected an array of numbers");
  }
  if (IsReadableInPlace(a)) return a;
  py::object np = py::module_::import("numpy");
  py::object native = a.dtype().attr("newbyteorder")("=");
  py::array r = np.attr("require")(a, native, "CA").cast<py::array>();
  if (!IsReadableInPlace(r)) {  // NumPy's contract; checked, as the reads below rely on it
    throw std::runtime_error(name + ": numpy.require returned a " + DescribeArray(r) +
                             " that is not C-contiguous, aligned and native");
  }
  return r;
}

}  // namespace thdpack::python

PYBIND11_MODULE(_thdpack, m) {
  namespace tp = thdpack::python;
  namespace py = pybind11;
#if PYBIND11_VERSION_MAJOR < 2 || (PYBIND11_VERSION_MAJOR == 2 && PYBIND11_VERSION_MINOR < 12)
  // A pybind11 older than 2.12 reads arrays with NumPy 1's struct layout: against NumPy 2 it
  // takes wrong item sizes and strides (garbage results, reads past buffers). CMake refuses that
  // pairing when it sees it (cmake/python.cmake); this catches a NumPy upgraded afterwards.
  {
    const std::string numpy_version =
        py::str(py::module_::import("numpy").attr("__version__")).cast<std::string>();
    // The major version is the leading digits ("1.24.2", "2.4.6").
    int major = 0;
    for (char c : numpy_version) {
      if (c < '0' || c > '9') break;
      major = major * 10 + (c - '0');
    }
    if (major >= 2) {
      throw py::import_error(
          "thdpack was built with pybind11 " + std::to_string(PYBIND11_VERSION_MAJOR) + "." +
          std::to_string(PYBIND11_VERSION_MINOR) + ", which cannot read NumPy " + numpy_version +
          "'s arrays (NumPy 2 needs pybind11 >= 2.12): rebuild it against this interpreter "
          "(pip install .)");
    }
  }
#endif
  m.doc() = "thdpack: scheduling, THD packing, CP/SP sharding, step metadata and CP-local loss";
  m.attr("__version__") = thdpack::kVersion;
  tp::BindLayout(m);
  tp::BindSchedule(m);
  tp::BindPack(m);
  tp::BindShard(m);
  tp::BindWire(m);
  tp::BindLoss(m);
  tp::BindCudaLoss(m);
  tp::BindGradCache(m);
  tp::BindCost(m);
  tp::BindData(m);
  tp::BindJob(m);
  tp::BindTopology(m);
  tp::BindTorchIter(m);
  tp::BindTorchComm(m);
  tp::BindFields(m);
  tp::BindArrow(m);
  tp::BindMedia(m);
}
