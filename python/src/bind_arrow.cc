// python/src/bind_arrow.cc: columnar sources (thdpack/arrow.h) at the Python edge - an Arrow
// producer's stream (the PyCapsule of `__arrow_c_stream__`) imported into the C++, the rows
// registered as a source, and the opener of `parquet:` and `arrow:` specs that pyarrow serves
// (thdpack/arrow.py). Conversions only: every rule of the columns is the C++'s.
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/arrow.h"

namespace thdpack::python {
namespace {

// Imported rows, as Python holds them (opaque).
struct PyArrowRows {
  std::shared_ptr<const ArrowRows> rows;
};

// The stream of `obj`: a PyCapsule "arrow_array_stream", or an object with
// __arrow_c_stream__ (the Arrow PyCapsule interface). The capsule's stream is moved out (its
// release cleared, so that the capsule frees nothing) and imported with the GIL released.
PyArrowRows Import(const py::object& obj, const std::string& where) {
  py::object capsule = obj;
  if (!PyCapsule_CheckExact(obj.ptr())) {
    if (!py::hasattr(obj, "__arrow_c_stream__")) {
      throw py::type_error(where + ": expected an Arrow producer (an object with " +
                           "__arrow_c_stream__: a pyarrow Table or RecordBatchReader, a " +
                           "polars or DuckDB result), got " +
                           std::string(py::str(py::type::of(obj).attr("__name__"))));
    }
    capsule = obj.attr("__arrow_c_stream__")();
  }
  auto* stream = static_cast<ArrowArrayStream*>(
      PyCapsule_GetPointer(capsule.ptr(), "arrow_array_stream"));
  if (stream == nullptr) throw py::error_already_set();
  ArrowArrayStream mine = *stream;
  stream->release = nullptr;
  std::optional<Result<std::shared_ptr<const ArrowRows>>> rows;
  {
    py::gil_scoped_release release;
    rows.emplace(ImportArrowStream(&mine, where));
  }
  return PyArrowRows{ValueOrThrow(std::move(*rows))};
}

}  // namespace

void BindArrow(py::module_& m) {
  py::class_<PyArrowRows>(m, "_ArrowRows")
      .def_property_readonly("rows", [](const PyArrowRows& r) { return InfoOf(*r.rows).rows; })
      .def_property_readonly("tokens",
                             [](const PyArrowRows& r) { return InfoOf(*r.rows).tokens; })
      .def_property_readonly("batches",
                             [](const PyArrowRows& r) { return InfoOf(*r.rows).batches; });
  m.def("_arrow_columns", [] {
    py::list out;
    for (std::string_view c : ArrowSourceColumns()) out.append(std::string(c));
    return out;
  }, "The columns a columnar source reads (thdpack/arrow.h), by name.");
  m.def("_import_arrow", &Import, py::arg("stream"), py::arg("where"),
        "An Arrow producer (or its stream capsule) imported as rows (ImportArrowStream).");
  m.def(
      "_concat_arrow",
      [](const std::vector<PyArrowRows>& parts, const std::string& where) {
        std::vector<std::shared_ptr<const ArrowRows>> all;
        for (const PyArrowRows& p : parts) all.push_back(p.rows);
        return PyArrowRows{ValueOrThrow(ConcatArrowRows(all, where))};
      },
      py::arg("parts"), py::arg("where"), "Rows one after another (ConcatArrowRows).");
  m.def(
      "_register_arrow",
      [](const std::string& spec, const PyArrowRows& rows) { RegisterArrowRows(spec, rows.rows); },
      py::arg("spec"), py::arg("rows"), "Rows as the source `spec` in this process.");
  m.def(
      "_set_arrow_opener",
      [](py::object opener) {
        // Kept for the life of the process (the interpreter's end may come first).
        auto* held = new py::object(std::move(opener));
        SetArrowOpener([held](std::string_view spec, std::span<const std::string> columns)
                           -> Result<std::shared_ptr<const ArrowRows>> {
          py::gil_scoped_acquire gil;
          try {
            py::list names;
            for (const std::string& c : columns) names.append(c);
            py::object got = (*held)(std::string(spec), names);
            return got.cast<PyArrowRows&>().rows;
          } catch (py::error_already_set& e) {
            // thdpack's own errors (a ValueError of a Status) keep their text, not its type.
            std::string text = PyErrorText(e);
            for (const char* own : {"ValueError: InvalidArgument: ", "ValueError: "}) {
              if (text.rfind(own, 0) == 0) {
                text = text.substr(std::strlen(own));
                break;
              }
            }
            return Status::InvalidArgument("data source " + std::string(spec) + ": " + text);
          } catch (const std::exception& e) {
            return Status::InvalidArgument("data source " + std::string(spec) + ": " + e.what());
          }
        });
      },
      py::arg("opener"),
      "Sets what opens parquet: and arrow: specs: opener(spec, columns) -> _ArrowRows, reading "
      "at least those columns (thdpack.arrow).");
}

}  // namespace thdpack::python
