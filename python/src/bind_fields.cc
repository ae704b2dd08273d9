// python/src/bind_fields.cc: fields at the Python edge (fields_py.h), and
//   thdpack._thdpack.field_dtypes() the dtype table (names, element bytes)
//   thdpack._thdpack.hf_field(values, cu_seqlens_padded, dtype, shape, fill)
// the Hugging Face label convention of a target field (ToHfField).
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "fields_py.h"

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

py::dict FieldsToPy(const std::vector<FieldSpec>& specs,
                    std::vector<std::vector<std::byte>>& buffers) {
  py::dict d;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (i >= buffers.size() || buffers[i].empty()) {
      d[py::str(specs[i].name)] = py::none();
      continue;
    }
    std::vector<uint8_t> b(buffers[i].size());
    std::memcpy(b.data(), buffers[i].data(), b.size());
    std::vector<std::byte>().swap(buffers[i]);
    d[py::str(specs[i].name)] = ToNumpy(std::move(b));
  }
  return d;
}

void BindFields(py::module_& m) {
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
