// python/src/bind_arrow.cc: columnar sources (thdpack/arrow.h) at the Python edge - an Arrow
// producer's stream (the PyCapsule of `__arrow_c_stream__`) imported into the C++, the rows
// registered as a source, and the readers of `parquet:` and `arrow:` files that pyarrow serves
// (thdpack/arrow.py). Conversions only: every rule of the columns is the C++'s.
#include <array>
#include <cstring>
#include <span>
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
// __arrow_c_stream__ (the Arrow PyCapsule interface), moved out of the capsule (its release
// cleared, so that the capsule frees nothing).
ArrowArrayStream TakeStream(const py::object& obj, const std::string& where) {
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
  return mine;
}

// `obj`'s stream imported, with the GIL released.
PyArrowRows Import(const py::object& obj, const std::string& where) {
  ArrowArrayStream mine = TakeStream(obj, where);
  std::optional<Result<std::shared_ptr<const ArrowRows>>> rows;
  {
    py::gil_scoped_release release;
    rows.emplace(ImportArrowStream(&mine, where));
  }
  return PyArrowRows{ValueOrThrow(std::move(*rows))};
}

// f() with the GIL taken, a Python error as a Status naming `path` (thdpack's own errors - a
// ValueError of a Status - keep their text, not their type).
template <typename F>
auto Call(const std::string& path, F&& f) -> Result<decltype(f())> {
  py::gil_scoped_acquire gil;
  try {
    return f();
  } catch (py::error_already_set& e) {
    std::string text = PyErrorText(e);
    for (const char* own : {"ValueError: InvalidArgument: ", "ValueError: "}) {
      if (text.rfind(own, 0) == 0) {
        text = text.substr(std::strlen(own));
        break;
      }
    }
    return Status::InvalidArgument(path + ": " + text);
  } catch (const std::exception& e) {
    return Status::InvalidArgument(path + ": " + e.what());
  }
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
      "_set_arrow_readers",
      [](py::object parquet_columns, py::object parquet_to_ipc, py::object read_ipc) {
        // Kept for the life of the process (the interpreter's end may come first).
        auto* held = new std::array<py::object, 3>{std::move(parquet_columns),
                                                   std::move(parquet_to_ipc), std::move(read_ipc)};
        ArrowReaders readers;
        readers.parquet_columns = [held](const std::string& path)
            -> Result<std::vector<std::string>> {
          return Call(path, [&] { return (*held)[0](path).cast<std::vector<std::string>>(); });
        };
        readers.parquet_to_ipc = [held](const std::string& path,
                                        std::span<const std::string> columns,
                                        const std::string& out) -> Status {
          Result<bool> done = Call(path, [&] {
            (*held)[1](path, std::vector<std::string>(columns.begin(), columns.end()), out);
            return true;
          });
          return done.status();
        };
        readers.read_ipc = [held](const std::string& path) -> Result<ArrowArrayStream> {
          return Call(path, [&] { return TakeStream((*held)[2](path), path); });
        };
        SetArrowReaders(std::move(readers));
      },
      py::arg("parquet_columns"), py::arg("parquet_to_ipc"), py::arg("read_ipc"),
      "Sets the readers of parquet: and arrow: files (ArrowReaders): parquet_columns(path) -> "
      "names, parquet_to_ipc(path, columns, out), read_ipc(path) -> an Arrow producer "
      "(thdpack.arrow).");
}

}  // namespace thdpack::python
