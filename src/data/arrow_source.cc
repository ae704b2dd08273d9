// Columnar sources (thdpack/arrow.h), read: the imported rows (arrow_import.cc) as a source with
// random access (an IndexedSource), the declared fields bound to their columns, and the
// registry of the parquet: and arrow: specs and the readers that open their files.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/hash64.h"
#include "data/arrow_internal.h"
#include "data/data_internal.h"

namespace thdpack {

using arrow_internal::BitSet;
using arrow_internal::ColumnInfo;
using arrow_internal::FirstNull;
using arrow_internal::kColumns;
using arrow_internal::kNoTarget;
using arrow_internal::ListColumn;
using arrow_internal::SchemaInfo;
using arrow_internal::Str;

namespace {

// A declared field's column in one record batch: per token a list of primitives (its offsets
// per row), per sample a primitive or a fixed-size list of `width` primitives.
struct FieldColumn {
  bool list = false, large = false, bits = false;
  const void* offsets = nullptr;
  int64_t first = 0;  // the struct's offset + the column array's
  const uint8_t* values = nullptr;
  int64_t value_first = 0;  // the values array's offset
  int64_t Off(int64_t row) const {
    const int64_t i = first + row;
    return large ? static_cast<const int64_t*>(offsets)[i]
                 : int64_t{static_cast<const int32_t*>(offsets)[i]};
  }
};

// Field `f` bound to batch `b`: its column found by name and checked against the declared type
// (InvalidArgument naming the batch, the column and both types; nulls and row lengths named by
// row).
Result<FieldColumn> BindField(const ArrowRows::Batch& b, const SourceField& f) {
  const SchemaInfo& schema = *b.schema;
  size_t k = 0;
  while (k < schema.size() && schema[k].name != f.name) ++k;
  const std::string at = b.name + ": field '" + f.name + "'";
  if (k == schema.size()) {
    std::string names;
    for (const ColumnInfo& c : schema) names += (names.empty() ? "'" : ", '") + c.name + "'";
    return Status::InvalidArgument(at + " has no column of that name (the columns: " + names +
                                   ")");
  }
  const ColumnInfo& c = schema[k];
  const std::string fixed = "+w:" + Str(f.width);
  const bool is_list = c.format == "+l" || c.format == "+L";
  // Per token: a list of values, or (a row shape of `width`) a list of fixed-size lists.
  const bool rows_of_lists = f.per_token && f.width > 1 && is_list && c.values == fixed;
  const bool list_ok = f.per_token && is_list && (f.width == 1 || rows_of_lists);
  const bool sample_ok = !f.per_token && ((f.width == 1 && c.format == f.arrow_format) ||
                                          c.format == fixed);
  const std::string want =
      f.per_token ? (f.width == 1 ? "a list or large_list of '" + f.arrow_format + "'"
                                  : "a list or large_list of fixed_size_list '" + fixed +
                                        "' of '" + f.arrow_format + "'")
                  : (f.width == 1 ? "'" + f.arrow_format + "'"
                                  : "a fixed_size_list '" + fixed + "' of '" + f.arrow_format +
                                        "'");
  const std::string values =
      rows_of_lists ? c.inner : (list_ok || c.format == fixed) ? c.values : c.format;
  if (c.dictionary || !(list_ok || sample_ok) || values != f.arrow_format) {
    return Status::InvalidArgument(at + ": the column has Arrow type '" + c.format +
                                   (c.values.empty() ? "" : "<" + c.values + ">") +
                                   "', the field needs " + want +
                                   " (values are never cast)");
  }
  const ArrowArray& parent = *b.struct_array;
  const ArrowArray* col = parent.children[k];
  const bool nested = list_ok || c.format == fixed;
  const ArrowArray* vals = nested ? (col->n_children == 1 ? col->children[0] : nullptr) : col;
  const ArrowArray* inner = nullptr;  // rows_of_lists: the fixed-size lists (vals: their values)
  if (rows_of_lists && vals != nullptr) {
    inner = vals;
    vals = inner->n_children == 1 ? inner->children[0] : nullptr;
  }
  if (vals == nullptr || vals->n_buffers < 2 || (nested && col->n_buffers < 1)) {
    return Status::InvalidArgument(at + ": the column's arrays are incomplete");
  }
  FieldColumn out;
  out.list = list_ok;
  out.large = c.format == "+L";
  out.bits = f.arrow_format == "b";
  // Element j of row r: values[value_first + Off(r) + j] for a list, else
  // values[value_first + (first + r) * width + j] (a primitive column is its own values).
  out.first = parent.offset + (nested ? col->offset : 0);
  out.values = static_cast<const uint8_t*>(vals->buffers[1]);
  // A list of fixed-size lists: token t of a row is inner list (inner offset + t), its values
  // `width` from (that) * width of the values.
  out.value_first = vals->offset + (inner != nullptr ? inner->offset * f.width : 0);
  if (list_ok) out.offsets = col->buffers[1];
  const int64_t rows = b.rows;
  if (nested) {
    const auto* row_valid =
        col->null_count != 0 ? static_cast<const uint8_t*>(col->buffers[0]) : nullptr;
    if (const int64_t r = FirstNull(row_valid, parent.offset + col->offset, rows); r >= 0) {
      return Status::InvalidArgument(b.name + ", row " + Str(r) + ": field '" + f.name +
                                     "' is null");
    }
  }
  int64_t lo = out.first * f.width, hi = (out.first + rows) * f.width;
  if (list_ok) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = b.ids.Off(r + 1) - b.ids.Off(r);
      if (out.Off(r + 1) - out.Off(r) != n || out.Off(r) < 0) {
        return Status::InvalidArgument(b.name + ", row " + Str(r) + ": field '" + f.name +
                                       "' has " + Str(out.Off(r + 1) - out.Off(r)) +
                                       " values, input_ids " + Str(n) +
                                       " (a per-token field has one a token)");
      }
    }
    lo = rows > 0 ? out.Off(0) * f.width : 0;
    hi = rows > 0 ? out.Off(rows) * f.width : 0;
    if (inner != nullptr) {
      const auto* valid =
          inner->null_count != 0 ? static_cast<const uint8_t*>(inner->buffers[0]) : nullptr;
      if (const int64_t t = FirstNull(valid, inner->offset + lo / f.width, (hi - lo) / f.width);
          t >= 0) {
        return Status::InvalidArgument(at + " holds a null row of values (token " +
                                       Str(lo / f.width + t) + " of the column)");
      }
      if (hi / f.width > inner->length) {
        return Status::InvalidArgument(at + ": the column's rows end at " +
                                       Str(inner->length) + ", its tokens need " +
                                       Str(hi / f.width));
      }
    }
  }
  if (hi > vals->length) {
    return Status::InvalidArgument(at + ": the column's values end at " + Str(vals->length) +
                                   ", its rows need " + Str(hi));
  }
  const auto* value_valid =
      vals->null_count != 0 ? static_cast<const uint8_t*>(vals->buffers[0]) : nullptr;
  if (const int64_t j = FirstNull(value_valid, out.value_first + lo, hi - lo); j >= 0) {
    return Status::InvalidArgument(at + " holds a null value (value " + Str(lo + j) + ")");
  }
  return out;
}

std::mutex& RegistryMutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, std::shared_ptr<const ArrowRows>>& Registry() {
  static auto* r = new std::map<std::string, std::shared_ptr<const ArrowRows>>();
  return *r;
}
ArrowReaders& Readers() {
  static auto* r = new ArrowReaders();
  return *r;
}

class ArrowSource final : public data_internal::IndexedSource<SampleSource> {
 public:
  // fields: [batch][field], options.fields bound to each batch (BindField).
  ArrowSource(std::string spec, std::shared_ptr<const ArrowRows> rows,
              const SourceOptions& options, std::vector<std::vector<FieldColumn>> fields)
      : IndexedSource(std::move(spec), rows->rows(), options),
        rows_(std::move(rows)),
        fields_(std::move(fields)) {}

 protected:
  Result<SampleLength> LengthAt(int64_t index) const override {
    const auto [b, r] = rows_->Locate(index);
    const int64_t lo = b->ids.Off(r), n = b->ids.Off(r + 1) - lo;
    int64_t targets = n - 1;
    const ListColumn& m = b->mask.present ? b->mask : b->labels;
    if (m.present) {
      targets = 0;
      const int64_t first = m.Off(r);
      for (int64_t j = 1; j < n; ++j) {
        const int64_t v = m.Value(first + j);
        targets += b->mask.present ? (v != 0) : (v != kNoTarget);
      }
    }
    return SampleLength{0, n, targets};
  }

  Status FillAt(int64_t index, int64_t /*id*/, Sample* out) const override {
    const auto [b, r] = rows_->Locate(index);
    const int64_t lo = b->ids.Off(r), n = b->ids.Off(r + 1) - lo;
    const int64_t limit = options().vocab_size > 0 ? options().vocab_size : kMaxSampleLength + 1;
    out->tokens.resize(static_cast<size_t>(n));
    out->target_mask.clear();
    const ListColumn& ids = b->ids;
    FillFields(static_cast<size_t>(b - rows_->batches.data()), r, n, *out);
    auto bad_token = [&](int64_t j, int64_t v) {
      return Status::InvalidArgument(rows_->Where(spec(), index) + ", column 'input_ids', token " +
                                     Str(j) + ": id " + Str(v) + " is outside [0, " +
                                     Str(limit) + ")");
    };
    if (ids.kind == 'i' && ids.bytes == 4) {  // int32: one copy, then the range
      std::memcpy(out->tokens.data(),
                  static_cast<const int32_t*>(ids.values) + ids.value_first + lo,
                  static_cast<size_t>(n) * 4);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t v = out->tokens[static_cast<size_t>(j)];
        if (v < 0 || v >= limit) return bad_token(j, v);
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t v = ids.Value(lo + j);
        if (v < 0 || v >= limit) return bad_token(j, v);
        out->tokens[static_cast<size_t>(j)] = static_cast<TokenId>(v);
      }
    }
    const ListColumn& m = b->mask.present ? b->mask : b->labels;
    if (!m.present) return Status::Ok();
    out->target_mask.resize(static_cast<size_t>(n));
    const int64_t first = m.Off(r);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t v = m.Value(first + j);
      if (b->mask.present) {
        if (v != 0 && v != 1) {
          return Status::InvalidArgument(rows_->Where(spec(), index) +
                                         ", column 'loss_mask', token " + Str(j) + ": value " +
                                         Str(v) + " is not 0 or 1");
        }
        out->target_mask[static_cast<size_t>(j)] = static_cast<uint8_t>(v);
      } else {
        if (v != kNoTarget && v != out->tokens[static_cast<size_t>(j)]) {
          return Status::InvalidArgument(
              rows_->Where(spec(), index) + ", column 'labels', token " + Str(j) + ": label " +
              Str(v) + " is neither -100 nor the token (" +
              Str(out->tokens[static_cast<size_t>(j)]) +
              "): labels say which tokens are targets, each predicted from the one before it");
        }
        out->target_mask[static_cast<size_t>(j)] = v != kNoTarget ? 1 : 0;
      }
    }
    return Status::Ok();
  }

  Result<std::string> ComputeIdentity() const override {
    std::call_once(rows_->identity_once, [this] { rows_->identity = IdentityOf(*rows_); });
    return rows_->identity;
  }

 private:
  static std::string IdentityOf(const ArrowRows& rows) {
    auto bytes = [](const std::vector<int64_t>& v) {
      return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 8);
    };
    uint64_t h = 0;
    constexpr int64_t kEdge = 64 * 1024 / 8;  // tokens at each end of a batch
    for (const ArrowRows::Batch& b : rows.batches) {
      const ListColumn& c = b.ids;
      if (b.rows == 0) continue;
      std::vector<int64_t> lengths(static_cast<size_t>(b.rows));
      for (int64_t r = 0; r < b.rows; ++r) {
        lengths[static_cast<size_t>(r)] = c.Off(r + 1) - c.Off(r);
      }
      h = internal::Hash64(bytes(lengths), h);
      // The first and last tokens, as values whatever their width.
      const int64_t lo = c.Off(0), hi = c.Off(b.rows);
      std::vector<int64_t> edge;
      for (int64_t j = lo; j < std::min(hi, lo + kEdge); ++j) edge.push_back(c.Value(j));
      for (int64_t j = std::max(lo, hi - kEdge); j < hi; ++j) edge.push_back(c.Value(j));
      h = internal::Hash64(bytes(edge), h);
    }
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    const ArrowRowsInfo info = InfoOf(rows);
    return std::string("arrow ") + Str(info.rows) + " rows, " + Str(info.tokens) + " tokens, " +
           Str(info.batches) + " batches" +
           (info.has_mask ? ", loss_mask" : info.has_labels ? ", labels" : "") + ", hash " + hex;
  }

  // Row r's rows of each field (n tokens), as bytes of the declared dtype: a copy, or bool bits
  // made one byte each.
  void FillFields(size_t batch, int64_t r, int64_t n, Sample& out) const {
    const std::vector<SourceField>& specs = options().fields;
    out.fields.resize(specs.size());
    for (size_t f = 0; f < specs.size(); ++f) {
      const SourceField& spec = specs[f];
      const FieldColumn& c = fields_[batch][f];
      const int64_t count = spec.per_token ? n * spec.width : spec.width;
      const int64_t first = (c.list ? c.Off(r) : c.first + r) * spec.width;
      std::vector<std::byte>& dst = out.fields[f];
      dst.resize(static_cast<size_t>(count) * spec.elem_bytes);
      if (c.bits) {
        for (int64_t j = 0; j < count; ++j) {
          dst[static_cast<size_t>(j)] =
              static_cast<std::byte>(BitSet(c.values, c.value_first + first + j) ? 1 : 0);
        }
      } else if (count > 0) {
        std::memcpy(dst.data(),
                    c.values + static_cast<size_t>(c.value_first + first) * spec.elem_bytes,
                    dst.size());
      }
    }
  }

  std::shared_ptr<const ArrowRows> rows_;
  std::vector<std::vector<FieldColumn>> fields_;
};

}  // namespace

void SetArrowReaders(ArrowReaders readers) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Readers() = std::move(readers);
}

void RegisterArrowRows(std::string spec, std::shared_ptr<const ArrowRows> rows) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[std::move(spec)] = std::move(rows);
}

Result<std::unique_ptr<SampleSource>> OpenArrowSource(std::string_view spec_view,
                                                     const SourceOptions& options) {
  const std::string spec(spec_view);
  THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec, options));
  std::shared_ptr<const ArrowRows> rows;
  ArrowReaders readers;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    if (auto it = Registry().find(spec); it != Registry().end()) rows = it->second;
    readers = Readers();
  }
  // The columns this open reads: the rules' and the fields'; kept rows that lack a field's
  // column are read again from the files with it (an in-memory producer keeps all of its own).
  std::vector<std::string> columns(kColumns, kColumns + 3);
  for (const SourceField& f : options.fields) columns.push_back(f.name);
  const std::string_view path = SourcePathOf(spec);
  if (rows != nullptr && readers.ok() && !path.empty() && path[0] != '@' && !rows->batches.empty()) {
    for (const SourceField& f : options.fields) {
      const SchemaInfo& schema = *rows->batches[0].schema;
      bool have = false;
      for (const ColumnInfo& c : schema) have = have || c.name == f.name;
      if (!have) {
        for (const ColumnInfo& c : schema) {
          if (std::find(columns.begin(), columns.end(), c.name) == columns.end()) {
            columns.push_back(c.name);
          }
        }
        rows = nullptr;
        break;
      }
    }
  }
  if (rows == nullptr) {
    if (!path.empty() && path[0] == '@') {
      return Status::InvalidArgument("data source " + spec + ": no Arrow data of that name in " +
                                     "this process (thdpack.arrow_source(obj, name=...) makes " +
                                     "one, on every rank that reads)");
    }
    if (!readers.ok()) {
      return Status::InvalidArgument(
          "data source " + spec + ": Parquet and Arrow files are read by Apache Arrow's own " +
          "readers, which this program was built without; read them from Python (thdpack " +
          "with pyarrow: pip install pyarrow), build the command line with Arrow C++ " +
          "(docs/data_sources.md, \"Columnar sources\"), or convert them to a Megatron dataset");
    }
    THDPACK_ASSIGN_OR_RETURN(rows, arrow_internal::OpenArrowFiles(spec, columns, readers));
    RegisterArrowRows(spec, rows);
  }
  if (rows->rows() == 0) {
    return Status::InvalidArgument("data source " + spec + ": no rows");
  }
  std::vector<std::vector<FieldColumn>> fields(rows->batches.size());
  for (size_t b = 0; b < rows->batches.size(); ++b) {
    for (const SourceField& f : options.fields) {
      Result<FieldColumn> c = BindField(rows->batches[b], f);
      if (!c.ok()) return c.status().WithContext("data source " + spec);
      fields[b].push_back(*c);
    }
  }
  return std::unique_ptr<SampleSource>(
      new ArrowSource(spec, std::move(rows), options, std::move(fields)));
}

}  // namespace thdpack
