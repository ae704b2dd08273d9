// python/src/bind_fields.cc: fields at the Python edge (fields_py.h), and
//   thdpack._thdpack.field_dtypes() the dtype table (names, element bytes)
//   thdpack._thdpack.hf_field(values, cu_seqlens_padded, dtype, shape, fill)
// the Hugging Face label convention of a target field (ToHfField).
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fields_py.h"
#include "thdpack/columns.h"

namespace thdpack::python {

std::vector<FieldSpec> FieldSpecsFromPy(const py::handle& fields) {
  std::vector<FieldSpec> out;
  if (fields.is_none()) return out;
  for (const py::handle& item : fields) {
    const auto t = item.cast<py::tuple>();
    if (t.size() != 5) throw py::value_error("fields: expected (name, kind, dtype, shape, fill)");
    FieldSpec f;
    f.name = t[0].cast<std::string>();
    const std::string where = "fields['" + f.name + "']";
    auto kind = ParseFieldKind(t[1].cast<std::string>());
    ThrowIfError(kind.status().WithContext(where));
    auto dtype = ParseFieldDtype(t[2].cast<std::string>());
    ThrowIfError(dtype.status().WithContext(where));
    f.kind = *kind;
    f.dtype = *dtype;
    f.shape = t[3].cast<std::vector<int64_t>>();
    f.fill = t[4].cast<double>();
    out.push_back(std::move(f));
  }
  ThrowIfError(ValidateFieldSpecs(out));
  return out;
}

Status FieldsFromPy(const std::vector<FieldSpec>& specs, const py::handle& values,
                    int64_t length, const std::string& where, Sample& out) {
  out.fields.assign(specs.size(), {});
  py::dict given = values.is_none() ? py::dict() : values.cast<py::dict>();
  for (const auto& [key, value] : given) {
    const std::string name = key.cast<std::string>();
    bool declared = false;
    for (const FieldSpec& f : specs) declared = declared || f.name == name;
    if (!declared) {
      return Status::InvalidArgument(
          where + ": '" + name + "' is not a declared field (declare it in fields= with its " +
          "kind, dtype and shape, or leave it out: nothing a sample holds is dropped silently)");
    }
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const FieldSpec& f = specs[i];
    if (!given.contains(f.name)) {
      return Status::InvalidArgument(where + ": declared field " + f.ToString() + " is missing");
    }
    const auto t = given[py::str(f.name)].cast<py::tuple>();
    const std::string dtype = t[0].cast<std::string>();
    const auto shape = t[1].cast<std::vector<int64_t>>();
    if (dtype != FieldDtypeName(f.dtype)) {
      return Status::InvalidArgument(where + ", field " + f.ToString() + ": holds " + dtype +
                                     " values, declared " +
                                     std::string(FieldDtypeName(f.dtype)) +
                                     " (values are never cast)");
    }
    std::vector<int64_t> want = f.shape;
    if (f.per_token()) want.insert(want.begin(), length);
    if (shape != want) {
      auto text = [](const std::vector<int64_t>& s) {
        std::string r = "[";
        for (size_t k = 0; k < s.size(); ++k) r += (k ? ", " : "") + std::to_string(s[k]);
        return r + "]";
      };
      return Status::InvalidArgument(
          where + ", field " + f.ToString() + ": shape " + text(shape) + ", expected " +
          text(want) + (f.per_token() ? " (one row per token of its " + std::to_string(length) +
                                            ")"
                                      : ""));
    }
    py::array bytes = py::array::ensure(t[2]);
    if (!bytes || bytes.itemsize() != 1 || !(bytes.flags() & py::array::c_style)) {
      return Status::Internal(where + ", field '" + f.name + "': the bytes are not contiguous");
    }
    out.fields[i].resize(static_cast<size_t>(bytes.nbytes()));
    if (bytes.nbytes() > 0) std::memcpy(out.fields[i].data(), bytes.data(), out.fields[i].size());
  }
  return CheckSampleFields(specs, out.fields, length, where);
}

bool IsPyColumns(const py::handle& obj) {
  if (!py::isinstance<py::tuple>(obj)) return false;
  const auto t = py::reinterpret_borrow<py::tuple>(obj);
  return t.size() == 5 && py::isinstance<py::str>(t[0]) && t[0].cast<std::string>() == "columns";
}

Result<std::vector<Sample>> SamplesFromPyColumns(const std::vector<FieldSpec>& specs,
                                                 const py::tuple& columns,
                                                 const std::string& where) {
  std::vector<py::object> held;  // keeps every viewed array alive through the call
  SampleColumns c;
  auto column = [&](const py::handle& t, const std::string& name, ColumnView& out,
                    bool* per_token) -> Status {
    const auto tuple = t.cast<py::tuple>();
    Result<FieldDtype> dtype = ParseFieldDtype(tuple[0].cast<std::string>());
    if (!dtype.ok()) return dtype.status().WithContext(where + ": column '" + name + "'");
    py::array bytes = py::array::ensure(tuple[2]);
    if (!bytes || bytes.itemsize() != 1 || !(bytes.flags() & py::array::c_style)) {
      return Status::Internal(where + ": column '" + name + "': the bytes are not contiguous");
    }
    held.push_back(bytes);
    out.name = name;
    out.dtype = *dtype;
    out.shape = tuple[1].cast<std::vector<int64_t>>();
    out.values = std::span<const std::byte>(static_cast<const std::byte*>(bytes.data()),
                                            static_cast<size_t>(bytes.nbytes()));
    if (per_token != nullptr) *per_token = tuple[3].cast<bool>();
    return Status::Ok();
  };
  auto offsets = IntView1D<int64_t>(py::handle(columns[2]), where + ": offsets");
  held.push_back(offsets.owner);
  const std::span<const int64_t> off = offsets;
  THDPACK_RETURN_IF_ERROR(column(columns[1], "input_ids", c.tokens, nullptr));
  c.tokens.offsets = off;
  if (!columns[3].is_none()) {
    c.has_mask = true;
    THDPACK_RETURN_IF_ERROR(column(columns[3], "loss_mask", c.mask, nullptr));
  }
  for (const auto& [key, value] : columns[4].cast<py::dict>()) {
    ColumnView& f = c.fields.emplace_back();
    bool per_token = false;
    THDPACK_RETURN_IF_ERROR(column(value, key.cast<std::string>(), f, &per_token));
    if (per_token) f.offsets = off;
  }
  return SamplesFromColumns(c, specs, where);
}

py::dict FieldsToPy(const std::vector<FieldSpec>& specs,
                    std::vector<std::vector<std::byte>>& buffers) {
  py::dict d;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (i >= buffers.size() || buffers[i].empty()) {
      d[py::str(specs[i].name)] = py::none();
      continue;
    }
    // The buffer itself, moved into the array (no copy: a step's fields are most of its bytes).
    d[py::str(specs[i].name)] = BytesToNumpy(std::exchange(buffers[i], {}));
  }
  return d;
}

namespace {

// A [B, S] mask (bool, uint8, int32 or int64, C-contiguous) as its runs among columns
// [col0, col0 + width); ValueError naming `name` for another dtype or shape.
MaskRuns RunsOfPyMask(const py::array& mask, int64_t col0, int64_t width,
                      const std::string& name) {
  if (mask.ndim() != 2 || !(mask.flags() & py::array::c_style)) {
    throw py::value_error(name + ": expected a C-contiguous [B, S] array, got " +
                          DescribeArray(mask));
  }
  const int64_t b = mask.shape(0), s = mask.shape(1);
  if (col0 < 0 || width < 0 || col0 + width > s) {
    throw py::value_error(name + ": columns [" + std::to_string(col0) + ", " +
                          std::to_string(col0 + width) + ") are not within its " +
                          std::to_string(s));
  }
  const char kind = mask.dtype().kind();
  const auto size = mask.itemsize();
  py::gil_scoped_release release;
  if ((kind == 'b' || kind == 'u') && size == 1) {
    return RunsOfMask(static_cast<const uint8_t*>(mask.data()), b, s, col0, width);
  }
  if (kind == 'i' && size == 4) {
    return RunsOfMask(static_cast<const int32_t*>(mask.data()), b, s, col0, width);
  }
  if (kind == 'i' && size == 8) {
    return RunsOfMask(static_cast<const int64_t*>(mask.data()), b, s, col0, width);
  }
  py::gil_scoped_acquire gil;
  throw py::value_error(name + ": holds " + DescribeArray(mask) + "; a mask is bool, uint8, " +
                        "int32 or int64");
}

// A C-contiguous array of at least 2 dimensions [B, C, *row] and its row bytes.
size_t RowBytesOf(const py::array& a, int64_t b, int64_t c, const std::string& name) {
  if (a.ndim() < 2 || a.shape(0) != b || a.shape(1) != c || !(a.flags() & py::array::c_style)) {
    throw py::value_error(name + ": expected a C-contiguous [" + std::to_string(b) + ", " +
                          std::to_string(c) + ", ...] array, got " + DescribeArray(a));
  }
  size_t rb = static_cast<size_t>(a.itemsize());
  for (py::ssize_t d = 2; d < a.ndim(); ++d) rb *= static_cast<size_t>(a.shape(d));
  return rb;
}

std::vector<py::ssize_t> FlatShape(const py::array& a, int64_t n) {
  std::vector<py::ssize_t> shape = {static_cast<py::ssize_t>(n)};
  for (py::ssize_t d = 2; d < a.ndim(); ++d) shape.push_back(a.shape(d));
  return shape;
}

}  // namespace

void BindFields(py::module_& m) {
  m.def(
      "_flatten_padded",
      [](const py::array& mask, int64_t response_length, const py::list& whole,
         const py::list& response) {
        const int64_t b = mask.ndim() == 2 ? mask.shape(0) : 0;
        const int64_t s = mask.ndim() == 2 ? mask.shape(1) : 0;
        const int64_t p = s - response_length;
        if (p < 0 || response_length < 0) {
          throw py::value_error("response_length " + std::to_string(response_length) +
                                ": not within the mask's " + std::to_string(s) + " columns");
        }
        const MaskRuns all = RunsOfPyMask(mask, 0, s, "attention_mask");
        const MaskRuns resp = ClipRuns(all, p, response_length);
        std::vector<int64_t> offsets(static_cast<size_t>(b) + 1, 0), resp_start(b);
        for (int64_t r = 0; r < b; ++r) {
          offsets[static_cast<size_t>(r) + 1] = offsets[static_cast<size_t>(r)] +
                                                all.counts[static_cast<size_t>(r)];
          resp_start[static_cast<size_t>(r)] = offsets[static_cast<size_t>(r) + 1] -
                                               resp.counts[static_cast<size_t>(r)];
        }
        const int64_t total = offsets.back();
        py::list out_whole, out_resp;
        for (size_t k = 0; k < whole.size(); ++k) {
          const py::array a = whole[k].cast<py::array>();
          const size_t rb = RowBytesOf(a, b, s, "whole[" + std::to_string(k) + "]");
          py::array out(a.dtype(), FlatShape(a, total));
          GatherRuns(all, static_cast<const std::byte*>(a.data()), s, rb,
                     static_cast<std::byte*>(out.mutable_data()), offsets);
          out_whole.append(out);
        }
        for (size_t k = 0; k < response.size(); ++k) {
          const py::array a = response[k].cast<py::array>();
          const size_t rb =
              RowBytesOf(a, b, response_length, "response[" + std::to_string(k) + "]");
          py::array out(a.dtype(), FlatShape(a, total));
          auto* o = static_cast<std::byte*>(out.mutable_data());
          for (int64_t r = 0; r < b; ++r) {  // each row's prompt part: 0
            const size_t at = static_cast<size_t>(offsets[static_cast<size_t>(r)]) * rb;
            std::memset(o + at, 0, static_cast<size_t>(resp_start[static_cast<size_t>(r)]) * rb -
                                       at);
          }
          GatherRuns(resp, static_cast<const std::byte*>(a.data()), response_length, rb,
                     static_cast<std::byte*>(out.mutable_data()), resp_start);
          out_resp.append(out);
        }
        return py::make_tuple(ToNumpy(std::move(offsets)), out_whole, out_resp);
      },
      py::arg("mask"), py::arg("response_length"), py::arg("whole"), py::arg("response"),
      R"doc(A padded batch as columns (thdpack.torch.adapters): mask [B, S] (nonzero: kept),
whole: arrays [B, S, ...] whose kept entries become each row's values, response: arrays
[B, R, ...] over the last R columns whose kept entries become the response part of each row (0
on its prompt). Returns (offsets int64 [B + 1], [whole flat], [response flat]), flat arrays
[N, ...] of each array's dtype.)doc");
  m.def(
      "_pad_flat",
      [](const py::array& mask, int64_t response_length, const py::array& flat,
         const py::array& offsets_obj, const py::array& fill) {
        const int64_t s = mask.ndim() == 2 ? mask.shape(1) : 0;
        if (response_length < 0 || response_length > s) {
          throw py::value_error("response_length " + std::to_string(response_length) +
                                ": not within the mask's " + std::to_string(s) + " columns");
        }
        const MaskRuns all = RunsOfPyMask(mask, 0, s, "attention_mask");
        const MaskRuns resp = ClipRuns(all, s - response_length, response_length);
        const int64_t b = resp.rows;
        auto offsets = IntView1D<int64_t>(py::handle(offsets_obj), "offsets");
        if (static_cast<int64_t>(offsets.size()) != b + 1) {
          throw py::value_error("values: " + std::to_string(offsets.size()) +
                                " offsets, the batch's " + std::to_string(b) + " rows need " +
                                std::to_string(b + 1));
        }
        std::vector<int64_t> start(static_cast<size_t>(b));
        for (int64_t r = 0; r < b; ++r) {
          const int64_t n = offsets[static_cast<size_t>(r) + 1] - offsets[static_cast<size_t>(r)];
          if (n != all.counts[static_cast<size_t>(r)]) {
            throw py::value_error("values: sample " + std::to_string(r) + " has " +
                                  std::to_string(n) + " entries, row " + std::to_string(r) +
                                  " of the batch " + std::to_string(all.counts[r]) + " tokens");
          }
          start[static_cast<size_t>(r)] =
              offsets[static_cast<size_t>(r) + 1] - resp.counts[static_cast<size_t>(r)];
        }
        if (flat.ndim() < 1 || !(flat.flags() & py::array::c_style) ||
            (b > 0 && flat.shape(0) < offsets.back())) {
          throw py::value_error("values: expected a C-contiguous [N, ...] array of at least " +
                                std::to_string(b > 0 ? offsets.back() : 0) + " rows, got " +
                                DescribeArray(flat));
        }
        size_t rb = static_cast<size_t>(flat.itemsize());
        std::vector<py::ssize_t> shape = {static_cast<py::ssize_t>(b),
                                          static_cast<py::ssize_t>(response_length)};
        for (py::ssize_t d = 1; d < flat.ndim(); ++d) {
          rb *= static_cast<size_t>(flat.shape(d));
          shape.push_back(flat.shape(d));
        }
        if (fill.nbytes() != static_cast<py::ssize_t>(rb) || !fill.dtype().is(flat.dtype())) {
          throw py::value_error("fill: expected one row of the values' dtype");
        }
        py::array out(flat.dtype(), shape);
        auto* o = static_cast<std::byte*>(out.mutable_data());
        FillRows(std::span<const std::byte>(static_cast<const std::byte*>(fill.data()), rb), o,
                 b * response_length);  // the fill everywhere
        ScatterRuns(resp, static_cast<const std::byte*>(flat.data()), start, rb, o,
                    response_length);
        return out;
      },
      py::arg("mask"), py::arg("response_length"), py::arg("flat"), py::arg("offsets"),
      py::arg("fill"),
      R"doc(The inverse for per-token values (thdpack.torch.adapters.padded_from_unpacked): flat
[N, ...] with offsets [B + 1] (row b's tokens in order) to [B, R, ...] over the last R columns of
mask [B, S], each kept response entry its token's value, the others `fill` (one row of the
values' dtype).)doc");
  m.def("microbatch_keys", [] {
    py::list out;
    for (std::string_view k : MicrobatchKeys()) out.append(std::string(k));
    return out;
  }, "The keys a microbatch dict holds besides its fields (no field may take one).");
  m.def(
      "field_dtypes",
      [] {
        py::list out;
        for (FieldDtype d : AllFieldDtypes()) {
          out.append(py::make_tuple(std::string(FieldDtypeName(d)), FieldDtypeSize(d)));
        }
        return out;
      },
      "The element types of fields and of step.unpack's values (thdpack/fields.h), as [(name, "
      "bytes of an element)]: NumPy's and torch's names.");
  m.def(
      "hf_field",
      [](const py::object& values, const py::object& cu_seqlens_padded_obj,
         const std::string& dtype, std::vector<int64_t> shape, double fill) {
        FieldSpec f{"field", FieldKind::kTarget, ValueOrThrow(ParseFieldDtype(dtype)),
                    std::move(shape), fill};
        auto bytes = View1D<uint8_t>(values, "values");
        auto cu = IntView1D<int32_t>(cu_seqlens_padded_obj, "cu_seqlens_padded");
        std::vector<uint8_t> out(bytes.size());
        ThrowIfError(ToHfField(f, std::as_bytes(std::span<const uint8_t>(bytes)), cu,
                               std::as_writable_bytes(std::span<uint8_t>(out))));
        return ToNumpy(std::move(out));
      },
      py::arg("values"), py::arg("cu_seqlens_padded"), py::arg("dtype"), py::arg("shape"),
      py::arg("fill"),
      R"doc(A target field of a WHOLE microbatch (uint8 bytes of [T, *shape] in `dtype`, thdpack's
shifted alignment) in Hugging Face's: row j = row j-1 where j is not the first position of its
padded sequence, the fill where it is (as hf_labels shifts the labels).)doc");
}

}  // namespace thdpack::python
