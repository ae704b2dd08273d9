// python/src/fields_py.h: a run's fields (thdpack/fields.h) at the Python edge - the schema from
// `fields=`, a fed sample's field values into Sample::fields, and a microbatch's field buffers
// out as NumPy arrays. Conversions only: every rule (sizes, dtypes never cast, names declared)
// is the C++'s.
#ifndef THDPACK_PYTHON_FIELDS_PY_H_
#define THDPACK_PYTHON_FIELDS_PY_H_

#include <cstddef>
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/fields.h"

namespace thdpack::python {

// The schema from thdpack.torch's normalised list of (name, kind, dtype, shape, fill) tuples
// (None: no fields). ValueError naming the field and the rule (ParseFieldKind, ParseFieldDtype,
// ValidateFieldSpecs).
std::vector<FieldSpec> FieldSpecsFromPy(const py::handle& fields);

// One fed sample's fields: `values` a dict name -> (dtype name, shape tuple, uint8 bytes), or
// None for none. Status (InvalidArgument, naming `where` and the field) where a declared field
// is missing, a given one is not declared, or its dtype or shape is not the declared one (never
// cast); the sizes are then CheckSampleFields'. Needs the GIL.
Status FieldsFromPy(const std::vector<FieldSpec>& specs, const py::handle& values,
                    int64_t length, const std::string& where, Sample& out);

// A loader's samples given as columns (thdpack.SampleRows' `_columns()`): the tuple
// ("columns", tokens, offsets, mask or None, {name: column}), each column (dtype name, inner
// shape, uint8 bytes, per_token) and offsets int64 [B + 1] shared by every per-token column.
// The samples as SamplesFromColumns (thdpack/columns.h) makes them, its errors naming `where`.
// Needs the GIL.
Result<std::vector<Sample>> SamplesFromPyColumns(const std::vector<FieldSpec>& specs,
                                                 const py::tuple& columns,
                                                 const std::string& where);
// Whether `obj` is such a tuple.
bool IsPyColumns(const py::handle& obj);

// A microbatch's field buffers (LocalMicrobatch::fields) as a dict name -> uint8 array (the
// bytes of [rows, *shape] in the field's dtype) or None where this rank's stage holds none.
py::dict FieldsToPy(const std::vector<FieldSpec>& specs,
                    std::vector<std::vector<std::byte>>& buffers);

}  // namespace thdpack::python

#endif  // THDPACK_PYTHON_FIELDS_PY_H_
