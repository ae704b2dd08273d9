// python/src/common.h: shared glue of the thdpack Python module: Status -> Python exceptions,
// views of array arguments with checked dtype, and NumPy arrays that own C++ vectors (no copy
// on return).
//
// An array argument may be any NumPy array (strided, sliced, transposed, byte-swapped,
// misaligned, read-only, empty), a CPU torch tensor or a list. It is viewed in place when C++
// can read it through a plain pointer (C-contiguous, aligned, native byte order) and converted
// by NumPy into a new array otherwise: C++ never reads an array's memory through its own idea
// of the layout. Every check raises ValueError naming the argument, what it got (dtype, shape)
// and what is expected. A view holds the array it reads (HeldSpan), so it stays valid for the
// whole call and the GIL can be released around the C++ work.
#ifndef THDPACK_PYTHON_COMMON_H_
#define THDPACK_PYTHON_COMMON_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <type_traits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/parallel_layout.h"
#include "thdpack/status.h"

namespace thdpack::python {

namespace py = pybind11;

// Raises the Python exception of a non-OK status: OSError for IOError, ValueError for bad input
// (InvalidArgument, Corruption, OutOfRange, NotFound, Unimplemented), MemoryError for
// ResourceExhausted, RuntimeError otherwise.
void ThrowIfError(const Status& status);

// A Python exception as one line, "TypeName: message", without the traceback pybind11's what()
// appends: for errors that travel on as a Status (a message names the input and the rule, and
// a traceback of thdpack's own frames inside it says nothing to the user).
std::string PyErrorText(const py::error_already_set& e);

template <typename T>
T ValueOrThrow(Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

// The ParallelLayout of the bindings' cp_size, tp_size, sp, extra_alignment and rank_multiple
// arguments; ValueError naming the rule otherwise (bind_layout.cc).
ParallelLayout MakeLayout(int cp_size, int tp_size, bool sp, int64_t extra_alignment,
                          int64_t rank_multiple = 1);

// A binding's layout: `layout` (a thdpack.ParallelLayout) or the scalar shortcut that builds
// one (cp_size, tp_size, sp, extra_alignment, rank_multiple; None: the default), never both.
// A new field of the layout is then a field of ParallelLayout, not of every signature.
struct LayoutArgs {
  py::object layout = py::none();
  py::object cp_size = py::none();
  py::object tp_size = py::none();
  py::object sp = py::none();
  py::object extra_alignment = py::none();
  py::object rank_multiple = py::none();
};
// TypeError naming the scalars given beside a layout (or a layout that is not one),
// ValueError from the layout's rules (bind_layout.cc). `where` names the function.
ParallelLayout LayoutOf(const LayoutArgs& args, const std::string& where);
// The keyword arguments of LayoutArgs, defaults None, for a binding's signature; in order:
// layout, cp_size, tp_size, sp, extra_alignment, rank_multiple.
#define THDPACK_LAYOUT_ARGS                                                            \
  py::arg("layout") = py::none(), py::arg("cp_size") = py::none(),                     \
      py::arg("tp_size") = py::none(), py::arg("sp") = py::none(),                     \
      py::arg("extra_alignment") = py::none(), py::arg("rank_multiple") = py::none()

// A rank multiple as Python gives it: an int, or a preset name of ParseRankMultiple ("fp8",
// "mxfp8", "blockwise", "none"). ValueError naming `name` otherwise (bind_layout.cc).
int64_t RankMultipleOf(const py::handle& value, const std::string& name);

// "int32 array of shape (3, 4)" for messages.
std::string DescribeArray(const py::array& a);

// A py::array from what a user holds, or ValueError naming `name`: a NumPy array as is; a
// torch tensor on the CPU as its NumPy view (no copy; detached, its conjugate and negative bits
// resolved; bfloat16 as its int16 bit pattern when `bfloat16_bits`, else a ValueError); a list
// or tuple as np.asarray of it (a new array; a ragged or non-numeric list is a ValueError), unless
// `allow_list` is false (an output, which a new array could not carry back). A tensor on another
// device, or of a dtype NumPy has no name for, is a ValueError saying what to do. Defined in
// module.cc.
py::array AsArray(const py::handle& obj, const std::string& name, bool bfloat16_bits = false,
                  bool allow_list = true);

// `a` in a form C++ may read through a plain pointer: C-contiguous, aligned and in native byte
// order. Returned as is when it is one already (no copy), else as a new array of the same values
// (np.require): a strided, sliced, transposed, byte-swapped or misaligned array is read only
// through NumPy's own conversion, never past its view. ValueError for an array of Python objects
// (its bytes are references, not values). Defined in module.cc.
py::array Readable(const py::array& a, const std::string& name);

// `value` as an int64 (a Python int, a NumPy integer, a 0-d integer array: operator.index, so
// a float is never truncated), or ValueError naming `name`. Defined in module.cc.
int64_t Int64Of(const py::handle& value, const std::string& name);

// Whether `a` is C-contiguous, aligned and in native byte order (Readable returns it as is).
bool IsReadableInPlace(const py::array& a);

// Whether `a` holds T's values in any byte order and layout: '<i4', '>i4', '=i4' and 'int32' all
// hold int32 (unpickled and foreign arrays carry an explicit byte order); int32 and uint32 differ.
template <typename T>
bool HoldsType(const py::array& a) {
  const py::dtype want = py::dtype::of<T>();
  return a.dtype().kind() == want.kind() && a.itemsize() == want.itemsize();
}

// A span that keeps alive the array it views (AsArray or Readable may make a new one, from a
// list, a tensor, or a strided or byte-swapped array). It is a std::span<const T>, so it goes
// wherever one is expected; keep it while the span is used.
template <typename T>
struct HeldSpan : std::span<const T> {
  HeldSpan(std::span<const T> view, py::object held)
      : std::span<const T>(view), owner(std::move(held)) {}
  py::object owner;
};

// A read-only 1-D view of `a` as T: ValueError naming `name` unless it holds T's values
// (HoldsType) and is 1-D. Any strides and byte order are accepted (converted by Readable).
template <typename T>
HeldSpan<T> View1D(const py::array& a, const std::string& name) {
  if (!HoldsType<T>(a)) {
    throw py::value_error(name + ": got a " + DescribeArray(a) + ", expected dtype " +
                          std::string(py::str(py::dtype::of<T>())) +
                          " (convert with .astype(); no silent conversion is made)");
  }
  if (a.ndim() != 1) {
    throw py::value_error(name + ": got a " + DescribeArray(a) + ", expected a 1-D array");
  }
  py::array r = Readable(a, name);
  std::span<const T> view(static_cast<const T*>(r.data()), static_cast<size_t>(r.size()));
  return HeldSpan<T>(view, std::move(r));
}

template <typename T>
HeldSpan<T> View1D(const py::handle& obj, const std::string& name) {
  return View1D<T>(AsArray(obj, name), name);
}

// A 1-D array of any integer dtype as T values: viewed in place when it holds T's values in
// readable form, else converted exactly into a new array, every value checked to be
// representable in T (ValueError naming `name[index]`, the value and T's range otherwise). Floats
// and bools are not integers (ValueError). The rules of the values themselves are the library's
// to check.
template <typename T>
HeldSpan<T> IntView1D(const py::handle& obj, const std::string& name) {
  static_assert(std::is_integral_v<T> && std::is_signed_v<T>);
  py::array a = AsArray(obj, name);
  if (HoldsType<T>(a)) return View1D<T>(a, name);
  const char kind = a.dtype().kind();
  if (a.size() == 0 && a.ndim() == 1 && kind != 'O') {  // np.asarray([]) is float64
    return HeldSpan<T>(std::span<const T>(), std::move(a));
  }
  if ((kind != 'i' && kind != 'u') || a.ndim() != 1) {
    throw py::value_error(name + ": got a " + DescribeArray(a) +
                          ", expected a 1-D array of integers (any integer dtype; " +
                          std::string(py::str(py::dtype::of<T>())) +
                          " is viewed in place, others are converted exactly)");
  }
  const int64_t lo = std::numeric_limits<T>::min();
  const int64_t hi = std::numeric_limits<T>::max();
  auto out_of_range = [&](py::ssize_t j, const std::string& value) {
    return py::value_error(name + "[" + std::to_string(j) + "] = " + value + ": does not fit " +
                           std::string(py::str(py::dtype::of<T>())) + " [" + std::to_string(lo) +
                           ", " + std::to_string(hi) + "]");
  };
  py::array_t<T> out(a.size());
  T* dst = out.mutable_data();
  // array_t<..., forcecast> converts through NumPy (strides and byte order included); every
  // integer dtype widens exactly to int64, and uint64 is read as itself. It asks NumPy for a
  // C-contiguous array only, and returns one of the same dtype as is, misaligned or not: so the
  // input is made readable (aligned, native) first.
  const py::array r = Readable(a, name);
  if (kind == 'u' && a.itemsize() == 8) {
    py::array_t<uint64_t, py::array::c_style | py::array::forcecast> wide(r);
    const uint64_t* v = wide.data();
    for (py::ssize_t j = 0; j < wide.size(); ++j) {
      if (v[j] > static_cast<uint64_t>(hi)) throw out_of_range(j, std::to_string(v[j]));
      dst[j] = static_cast<T>(v[j]);
    }
  } else {
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> wide(r);
    const int64_t* v = wide.data();
    for (py::ssize_t j = 0; j < wide.size(); ++j) {
      if (v[j] < lo || v[j] > hi) throw out_of_range(j, std::to_string(v[j]));
      dst[j] = static_cast<T>(v[j]);
    }
  }
  std::span<const T> view(out.data(), static_cast<size_t>(out.size()));
  return HeldSpan<T>(view, std::move(out));
}

// A 1-D array of floats as double values: float64 viewed in place when readable; float16 and
// float32 widened exactly into a new array. Any other dtype (integers, long double, complex)
// is a ValueError naming `name`.
inline HeldSpan<double> DoubleView1D(const py::handle& obj, const std::string& name) {
  py::array a = AsArray(obj, name);
  if (HoldsType<double>(a)) return View1D<double>(a, name);
  if (a.dtype().kind() != 'f' || a.itemsize() > 8 || a.ndim() != 1) {
    throw py::value_error(name + ": got a " + DescribeArray(a) +
                          ", expected a 1-D array of float64 (float16 and float32 are widened)");
  }
  const py::array r = Readable(a, name);  // aligned first: see IntView1D
  py::array_t<double, py::array::c_style | py::array::forcecast> wide(r);
  std::span<const double> view(wide.data(), static_cast<size_t>(wide.size()));
  return HeldSpan<double>(view, std::move(wide));
}

// A 1-D 0/1 mask as bytes: bool and uint8 arrays are viewed in place when readable (the library
// checks that uint8 values are 0 or 1); any other integer or floating dtype is converted into a
// new uint8 array after checking that every value is exactly 0 or 1 (ValueError naming
// `name[index]` and the value otherwise).
inline HeldSpan<uint8_t> MaskView1D(const py::handle& obj, const std::string& name) {
  py::array a = AsArray(obj, name);
  if (HoldsType<bool>(a)) {
    HeldSpan<bool> b = View1D<bool>(a, name);
    return HeldSpan<uint8_t>(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(b.data()), b.size()),
        std::move(b.owner));
  }
  if (HoldsType<uint8_t>(a)) return View1D<uint8_t>(a, name);
  const char kind = a.dtype().kind();
  if ((kind != 'i' && kind != 'u' && kind != 'f') || a.ndim() != 1) {
    throw py::value_error(name + ": got a " + DescribeArray(a) + ", expected a 1-D array of " +
                          "0/1 values (bool, any integer or float dtype)");
  }
  auto not_01 = [&](py::ssize_t j) {
    return py::value_error(name + "[" + std::to_string(j) + "] = " +
                           std::string(py::str(a.attr("__getitem__")(j))) +
                           ": a target mask holds 0 or 1");
  };
  py::array_t<uint8_t> out(a.size());
  uint8_t* dst = out.mutable_data();
  const py::array r = Readable(a, name);  // aligned first: see IntView1D
  if (kind == 'f') {
    py::array_t<double, py::array::c_style | py::array::forcecast> v(r);
    for (py::ssize_t j = 0; j < v.size(); ++j) {
      if (v.data()[j] != 0.0 && v.data()[j] != 1.0) throw not_01(j);  // NaN too
      dst[j] = static_cast<uint8_t>(v.data()[j]);
    }
  } else {
    // A uint64 above 2^63 wraps to a negative int64: still neither 0 nor 1.
    py::array_t<int64_t, py::array::c_style | py::array::forcecast> v(r);
    for (py::ssize_t j = 0; j < v.size(); ++j) {
      if (v.data()[j] != 0 && v.data()[j] != 1) throw not_01(j);
      dst[j] = static_cast<uint8_t>(v.data()[j]);
    }
  }
  std::span<const uint8_t> view(out.data(), static_cast<size_t>(out.size()));
  return HeldSpan<uint8_t>(view, std::move(out));
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

// A 1-D uint8 NumPy array that takes ownership of the bytes `v` (no copy).
inline py::array_t<uint8_t> BytesToNumpy(std::vector<std::byte>&& v) {
  auto* owner = new std::vector<std::byte>(std::move(v));
  py::capsule free_when_done(owner,
                             [](void* p) { delete static_cast<std::vector<std::byte>*>(p); });
  return py::array_t<uint8_t>({static_cast<py::ssize_t>(owner->size())}, {sizeof(uint8_t)},
                              reinterpret_cast<const uint8_t*>(owner->data()), free_when_done);
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
void BindCudaLoss(py::module_& m);
void BindCost(py::module_& m);
void BindData(py::module_& m);
void BindJob(py::module_& m);
void BindTopology(py::module_& m);

}  // namespace thdpack::python

#endif  // THDPACK_PYTHON_COMMON_H_
