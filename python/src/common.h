// python/src/common.h: shared glue of the thdpack Python module: Status -> Python exceptions,
// zero-copy views of NumPy arguments with checked dtype and layout, and NumPy arrays that own
// C++ vectors (no copy on return).
//
// Every argument check raises ValueError naming the argument, what it got (dtype, shape,
// layout) and what is expected. Views are valid while the caller holds the array, which it does
// for the whole call, so the GIL can be released around the C++ work.
#ifndef THDPACK_PYTHON_COMMON_H_
#define THDPACK_PYTHON_COMMON_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/parallel_layout.h"
#include "thdpack/status.h"

namespace thdpack::python {

namespace py = pybind11;

// Raises the Python exception of a non-OK status: OSError for IOError, ValueError for bad input
// (InvalidArgument, Corruption, OutOfRange, NotFound, Unimplemented), RuntimeError otherwise.
void ThrowIfError(const Status& status);

template <typename T>
T ValueOrThrow(Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

// The ParallelLayout of the bindings' cp_size, tp_size, sp and extra_alignment arguments;
// ValueError naming the rule otherwise (bind_layout.cc).
ParallelLayout MakeLayout(int cp_size, int tp_size, bool sp, int64_t extra_alignment);

// "int32 array of shape (3, 4)" for messages.
std::string DescribeArray(const py::array& a);

// A py::array from a Python object, or ValueError naming `name` when it is not one. No copy:
// only objects that already are NumPy arrays are accepted.
py::array AsArray(const py::handle& obj, const std::string& name);

// Raises ValueError unless `a` is C-contiguous.
void RequireContiguous(const py::array& a, const std::string& name);

// A read-only 1-D view of `a` as T: ValueError unless its dtype is exactly T's, it is 1-D and
// C-contiguous.
template <typename T>
std::span<const T> View1D(const py::array& a, const std::string& name) {
  if (!a.dtype().is(py::dtype::of<T>())) {
    throw py::value_error(name + ": got a " + DescribeArray(a) + ", expected dtype " +
                          std::string(py::str(py::dtype::of<T>())) +
                          " (convert with .astype(); no silent conversion is made)");
  }
  if (a.ndim() != 1) {
    throw py::value_error(name + ": got a " + DescribeArray(a) + ", expected a 1-D array");
  }
  RequireContiguous(a, name);
  return std::span<const T>(static_cast<const T*>(a.data()), static_cast<size_t>(a.size()));
}

template <typename T>
std::span<const T> View1D(const py::handle& obj, const std::string& name) {
  return View1D<T>(AsArray(obj, name), name);
}

// Whether `a` has exactly T's dtype.
template <typename T>
bool HasDtype(const py::array& a) {
  return a.dtype().is(py::dtype::of<T>());
}

// A 1-D NumPy array that takes ownership of `v` (no copy): the vector moves into a capsule
// that the array keeps alive.
template <typename T>
py::array_t<T> ToNumpy(std::vector<T>&& v) {
  auto* owner = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owner, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({static_cast<py::ssize_t>(owner->size())}, {sizeof(T)}, owner->data(),
                        free_when_done);
}

// A new 1-D array of `n` elements of To converted from `v` (the widening the Python edge does,
// e.g. int32 token ids to int64).
template <typename To, typename From>
py::array_t<To> Widen(std::span<const From> v) {
  py::array_t<To> out(static_cast<py::ssize_t>(v.size()));
  To* dst = out.mutable_data();
  for (size_t i = 0; i < v.size(); ++i) dst[i] = static_cast<To>(v[i]);
  return out;
}

// Area binders, one per binding file.
void BindLayout(py::module_& m);
void BindSchedule(py::module_& m);
void BindPack(py::module_& m);
void BindShard(py::module_& m);
void BindWire(py::module_& m);
void BindLoss(py::module_& m);
void BindCost(py::module_& m);
void BindData(py::module_& m);
void BindJob(py::module_& m);

}  // namespace thdpack::python

#endif  // THDPACK_PYTHON_COMMON_H_
