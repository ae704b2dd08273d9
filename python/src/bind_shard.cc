// python/src/bind_shard.cc: CP zigzag sharding and the SP split (shard.h) on NumPy arrays of
// any dtype but Python objects: a token is one row (all elements after the first axis). Arrays
// may also be CPU torch tensors or lists (AsArray), in any layout (Readable converts what C++
// cannot read in place); cu_seqlens_padded may have any integer dtype (IntView1D).
#include <string>

#include "common.h"
#include "thdpack/shard.h"

namespace thdpack::python {
namespace {

// Bytes of one token (row) of `a`: itemsize times the product of the trailing dimensions.
size_t RowBytes(const py::array& a) {
  size_t bytes = static_cast<size_t>(a.itemsize());
  for (py::ssize_t i = 1; i < a.ndim(); ++i) bytes *= static_cast<size_t>(a.shape(i));
  return bytes;
}

std::vector<py::ssize_t> Shape(const py::array& a) {
  return std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim());
}

// `a` as rows C++ may copy bytewise (Readable: converted when strided, byte-swapped or
// misaligned); ValueError for a 0-d array or one of Python objects.
py::array Rows(const py::array& a, const std::string& name) {
  if (a.ndim() < 1) {
    throw py::value_error(name + ": got a " + DescribeArray(a) +
                          ", expected at least one dimension (tokens first)");
  }
  return Readable(a, name);
}

}  // namespace

void BindShard(py::module_& m) {
  m.def(
      "cp_partition_indices",
      [](const py::handle& cu_obj, int cp_size, int cp_rank) {
        auto cu = IntView1D<int32_t>(cu_obj, "cu_seqlens_padded");
        Result<std::vector<int32_t>> r = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          r = CpPartitionIndices(cu, cp_size, cp_rank);
        }
        return ToNumpy(ValueOrThrow(std::move(r)));
      },
      py::arg("cu_seqlens_padded"), py::arg("cp_size"), py::arg("cp_rank"),
      R"doc(The global positions CP rank cp_rank keeps, in local order: int32 [T/CP]
(TransformerEngine's thd_get_partitioned_indices). cu_seqlens_padded: int32 [n+1], global.)doc");

  m.def(
      "local_position_ids",
      [](const py::handle& cu_obj, int cp_size, int cp_rank) {
        auto cu = IntView1D<int32_t>(cu_obj, "cu_seqlens_padded");
        return ToNumpy(ValueOrThrow(LocalPositionIds(cu, cp_size, cp_rank)));
      },
      py::arg("cu_seqlens_padded"), py::arg("cp_size"), py::arg("cp_rank"),
      "Position ids of CP rank cp_rank's shard (int32 [T/CP]) from the metadata alone.");

  m.def(
      "local_cu_seqlens_padded",
      [](const py::handle& cu_obj, int cp_size) {
        auto cu = IntView1D<int32_t>(cu_obj, "cu_seqlens_padded");
        return ToNumpy(ValueOrThrow(LocalCuSeqlensPadded(cu, cp_size)));
      },
      py::arg("cu_seqlens_padded"), py::arg("cp_size"),
      "Local sequence boundaries of every CP shard: cu_seqlens_padded / CP (int32 [n+1]).");

  m.def(
      "shard",
      [](const py::handle& array_obj, const py::handle& cu_obj, int cp_size, int cp_rank) {
        py::array full = Rows(AsArray(array_obj, "array"), "array");
        auto cu = IntView1D<int32_t>(cu_obj, "cu_seqlens_padded");
        if (cp_size < 1) {
          throw py::value_error("cp_size = " + std::to_string(cp_size) + ": must be >= 1");
        }
        if (full.shape(0) % cp_size != 0) {
          throw py::value_error("array: got a " + DescribeArray(full) + ": its first dimension " +
                                "(tokens) must be divisible by cp_size " + std::to_string(cp_size));
        }
        std::vector<py::ssize_t> shape = Shape(full);
        shape[0] /= cp_size;
        py::array out(full.dtype(), shape);
        const size_t row = RowBytes(full);
        std::span<const std::byte> in(static_cast<const std::byte*>(full.data()),
                                      static_cast<size_t>(full.nbytes()));
        std::span<std::byte> dst(static_cast<std::byte*>(out.mutable_data()),
                                 static_cast<size_t>(out.nbytes()));
        Status s;
        if (row == 0) {
          // Rows of zero bytes: only the metadata needs checking.
          s = ValidateCuSeqlensPadded(cu, cp_size);
        } else {
          py::gil_scoped_release release;
          s = CpShardBytes(in, row, cu, cp_size, cp_rank, dst);
        }
        ThrowIfError(s.WithContext("shard(array " + DescribeArray(full) + ")"));
        return out;
      },
      py::arg("array"), py::arg("cu_seqlens_padded"), py::arg("cp_size"), py::arg("cp_rank"),
      R"doc(CP rank cp_rank's zigzag shard of a packed array: array [T, ...] (any dtype but
object, any layout, tokens first) -> [T/CP, ...] of the same dtype, equal to
array[cp_partition_indices(cu_seqlens_padded, cp_size, cp_rank)].)doc");

  m.def(
      "unshard",
      [](const py::sequence& shards, const py::handle& cu_obj) {
        const size_t cp = py::len(shards);
        if (cp == 0) throw py::value_error("shards: empty list; one shard per CP rank expected");
        auto cu = IntView1D<int32_t>(cu_obj, "cu_seqlens_padded");
        std::vector<py::array> arrays;
        std::vector<std::span<const std::byte>> views;
        for (size_t r = 0; r < cp; ++r) {
          const std::string name = "shards[" + std::to_string(r) + "]";
          py::array a = Rows(AsArray(shards[r], name), name);
          if (r > 0 && (!a.dtype().equal(arrays[0].dtype()) || Shape(a) != Shape(arrays[0]))) {
            throw py::value_error(name + ": got a " + DescribeArray(a) + ", shards[0] is a " +
                                  DescribeArray(arrays[0]) +
                                  ": every shard must have the same dtype and shape");
          }
          views.emplace_back(static_cast<const std::byte*>(a.data()),
                             static_cast<size_t>(a.nbytes()));
          arrays.push_back(a);
        }
        std::vector<py::ssize_t> shape = Shape(arrays[0]);
        shape[0] *= static_cast<py::ssize_t>(cp);
        py::array out(arrays[0].dtype(), shape);
        const size_t row = RowBytes(arrays[0]);
        std::span<std::byte> dst(static_cast<std::byte*>(out.mutable_data()),
                                 static_cast<size_t>(out.nbytes()));
        Status s;
        if (row == 0) {
          s = ValidateCuSeqlensPadded(cu, static_cast<int>(cp));
        } else {
          py::gil_scoped_release release;
          s = CpUnshardBytes(views, row, cu, static_cast<int>(cp), dst);
        }
        ThrowIfError(s.WithContext("unshard"));
        return out;
      },
      py::arg("shards"), py::arg("cu_seqlens_padded"),
      R"doc(The inverse of shard: shards is the list of every CP rank's [T/CP, ...] array in rank
order (cp_size = len(shards)); returns the full [T, ...] array.)doc");

  m.def(
      "sp_split",
      [](const py::handle& array_obj, int tp_size, int tp_rank) {
        py::array local = AsArray(array_obj, "array");
        if (local.ndim() < 1) {
          throw py::value_error("array: got a " + DescribeArray(local) +
                                ", expected at least one dimension (tokens first)");
        }
        auto range = ValueOrThrow(SpRange(local.shape(0), tp_size, tp_rank));
        py::slice rows(static_cast<py::ssize_t>(range.first),
                       static_cast<py::ssize_t>(range.first + range.second), 1);
        py::object part = local.attr("__getitem__")(rows);
        return part;
      },
      py::arg("array"), py::arg("tp_size"), py::arg("tp_rank"),
      R"doc(TP rank tp_rank's contiguous part of the CP-local array [T/CP, ...]: a view (no copy)
of [T/(CP*TP), ...]. The first dimension must be divisible by tp_size.)doc");

  m.def(
      "sp_range",
      [](int64_t local_tokens, int tp_size, int tp_rank) {
        auto range = ValueOrThrow(SpRange(local_tokens, tp_size, tp_rank));
        return py::make_tuple(range.first, range.second);
      },
      py::arg("local_tokens"), py::arg("tp_size"), py::arg("tp_rank"),
      "(offset, count) of TP rank tp_rank's part of local_tokens CP-local tokens.");
}

}  // namespace thdpack::python
