// Columnar sources (thdpack/arrow.h): Arrow record batches imported through the C stream
// interface, checked once, read a row at a time by an IndexedSource.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/hash64.h"
#include "data/data_internal.h"
#include "thdpack/arrow.h"

namespace thdpack {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

constexpr std::string_view kColumns[] = {"input_ids", "loss_mask", "labels"};
constexpr int64_t kNoTarget = -100;  // Hugging Face's ignore index in `labels`

// One list column of one record batch, as its buffers hold it.
struct ListColumn {
  bool present = false;
  std::string name;
  bool large = false;                        // int64 offsets (large_list)
  const uint8_t* validity = nullptr;         // the list array's
  const void* offsets = nullptr;
  int64_t first = 0;                         // the struct's offset + the list array's
  char kind = 'i';                           // values: 'i' signed, 'u' unsigned, 'b' bool bits
  int bytes = 0;                             // of a value (0 for bool bits)
  const uint8_t* value_validity = nullptr;
  const void* values = nullptr;
  int64_t value_first = 0;                   // the values array's offset
  int64_t value_length = 0;

  int64_t Off(int64_t row) const {
    const int64_t i = first + row;
    return large ? static_cast<const int64_t*>(offsets)[i]
                 : int64_t{static_cast<const int32_t*>(offsets)[i]};
  }
  // Value j of the values array (j: as the offsets count).
  int64_t Value(int64_t j) const {
    const int64_t k = value_first + j;
    const auto* p = static_cast<const uint8_t*>(values);
    switch (kind) {
      case 'b':
        return (p[k >> 3] >> (k & 7)) & 1;
      case 'i':
        switch (bytes) {
          case 1: return static_cast<const int8_t*>(values)[k];
          case 2: return static_cast<const int16_t*>(values)[k];
          case 4: return static_cast<const int32_t*>(values)[k];
          default: return static_cast<const int64_t*>(values)[k];
        }
      default:
        switch (bytes) {
          case 1: return p[k];
          case 2: return static_cast<const uint16_t*>(values)[k];
          case 4: return static_cast<const uint32_t*>(values)[k];
          default: {
            const uint64_t v = static_cast<const uint64_t*>(values)[k];
            return v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                       ? std::numeric_limits<int64_t>::min()  // named as out of range
                       : static_cast<int64_t>(v);
          }
        }
    }
  }
};

bool BitSet(const uint8_t* bits, int64_t i) { return (bits[i >> 3] >> (i & 7)) & 1; }

// A record batch's columns as its schema gives them: name, Arrow format and, for a list or a
// fixed-size list, its values' format. Fields (SourceField) are bound through it.
struct ColumnInfo {
  std::string name, format, values;
  std::string inner;  // a list of fixed-size lists: the inner lists' values' format
  bool dictionary = false;
};
using SchemaInfo = std::vector<ColumnInfo>;

}  // namespace

class ArrowRows {
 public:
  struct Batch {
    ArrowArray array{};  // released with the rows (not set in a concatenation's copies)
    int64_t rows = 0;
    ListColumn ids, mask, labels;
    std::string name;  // for messages: "<where>, record batch k"
    std::shared_ptr<const SchemaInfo> schema;  // its stream's columns (array.children order)
    const ArrowArray* struct_array = nullptr;  // its columns' arrays (the owner's `array`)
  };
  ArrowRows() = default;
  ArrowRows(const ArrowRows&) = delete;
  ArrowRows& operator=(const ArrowRows&) = delete;
  ~ArrowRows() {
    for (Batch& b : batches) {
      if (b.array.release != nullptr) b.array.release(&b.array);
    }
  }
  std::vector<Batch> batches;
  std::vector<int64_t> starts;  // [batches + 1]: the first row of each batch
  std::vector<std::shared_ptr<const ArrowRows>> parts;  // a concatenation's, kept alive
  // The identity line, computed by the first source that asks (a pass over every batch's
  // offsets) and kept: every later open of the rows (each job, each resume) reuses it.
  mutable std::once_flag identity_once;
  mutable std::string identity;
  int64_t tokens = 0;
  bool has_mask = false, has_labels = false;

  int64_t rows() const { return starts.empty() ? 0 : starts.back(); }
  // The batch holding row `row` and the row within it.
  std::pair<const Batch*, int64_t> Locate(int64_t row) const {
    const size_t b = static_cast<size_t>(
        std::upper_bound(starts.begin(), starts.end(), row) - starts.begin() - 1);
    return {&batches[b], row - starts[b]};
  }
  std::string Where(std::string_view spec, int64_t row) const {
    const auto [b, r] = Locate(row);
    const bool named = b->name.rfind(std::string(spec), 0) == 0;  // it names the spec already
    return (named ? "" : std::string(spec) + ": ") + b->name + ", row " + Str(r) + " (row " +
           Str(row) + " of the data)";
  }
};

namespace {

struct SchemaGuard {
  ArrowSchema s{};
  ~SchemaGuard() {
    if (s.release != nullptr) s.release(&s);
  }
};
struct StreamGuard {
  ArrowArrayStream* s;
  ~StreamGuard() {
    if (s != nullptr && s->release != nullptr) s->release(s);
  }
};

// The column's type from its schema: InvalidArgument naming it otherwise.
Status ColumnType(const ArrowSchema& schema, const std::string& where, ListColumn& out) {
  const std::string name = schema.name != nullptr ? schema.name : "";
  const std::string format = schema.format != nullptr ? schema.format : "";
  const std::string at = where + ": column '" + name + "'";
  if (schema.dictionary != nullptr) {
    return Status::InvalidArgument(at + " is dictionary-encoded; expected a list of integers");
  }
  if (format != "+l" && format != "+L") {
    return Status::InvalidArgument(at + " has Arrow type '" + format + "'; expected a list or " +
                                   "large_list (+l, +L) of " +
                                   (name == "loss_mask" ? "bool or integers" : "integers"));
  }
  out.large = format == "+L";
  if (schema.n_children != 1 || schema.children[0] == nullptr) {
    return Status::InvalidArgument(at + ": a list without its values' type");
  }
  const ArrowSchema& v = *schema.children[0];
  const std::string vf = v.format != nullptr ? v.format : "";
  static const std::map<std::string, std::pair<char, int>> kTypes = {
      {"c", {'i', 1}}, {"s", {'i', 2}}, {"i", {'i', 4}}, {"l", {'i', 8}}, {"C", {'u', 1}},
      {"S", {'u', 2}}, {"I", {'u', 4}}, {"L", {'u', 8}}, {"b", {'b', 0}}};
  const auto t = kTypes.find(vf);
  if (v.dictionary != nullptr || t == kTypes.end() ||
      (t->second.first == 'b' && name != "loss_mask")) {
    static const std::map<std::string, std::string> kNames = {
        {"e", "float16"}, {"f", "float32"}, {"g", "float64"}, {"u", "string"},
        {"U", "large_string"}, {"z", "binary"}, {"b", "bool"}, {"n", "null"}};
    const auto known = kNames.find(vf);
    return Status::InvalidArgument(
        at + " holds values of Arrow type '" + vf + "'" +
        (known != kNames.end() ? " (" + known->second + ")" : "") + "; expected " +
        (name == "loss_mask" ? "bool or an integer type" : "an integer type"));
  }
  out.present = true;
  out.name = name;
  out.kind = t->second.first;
  out.bytes = t->second.second;
  return Status::Ok();
}

// The first null of `n` entries from `first` of a validity bitmap, or -1.
int64_t FirstNull(const uint8_t* validity, int64_t first, int64_t n) {
  if (validity == nullptr) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!BitSet(validity, first + i)) return i;
  }
  return -1;
}

// The column `c` (typed from the schema) bound to batch `array`'s child `index`, and checked.
Status BindColumn(const ArrowArray& parent, int64_t index, const std::string& where,
                  ListColumn& c) {
  const ArrowArray* list = parent.children[index];
  if (list == nullptr || list->n_buffers != 2 || list->n_children != 1 ||
      list->children[0] == nullptr) {
    return Status::InvalidArgument(where + ": column '" + c.name +
                                   "' is not a list array (buffers or values missing)");
  }
  const ArrowArray* values = list->children[0];
  const int64_t rows = parent.length;
  if (list->length < rows) {
    return Status::InvalidArgument(where + ": column '" + c.name + "' holds " +
                                   Str(list->length) + " rows, its record batch " + Str(rows));
  }
  c.validity = list->null_count == 0 ? nullptr : static_cast<const uint8_t*>(list->buffers[0]);
  c.offsets = list->buffers[1];
  c.first = parent.offset + list->offset;
  c.value_validity =
      values->null_count == 0 ? nullptr : static_cast<const uint8_t*>(values->buffers[0]);
  c.values = values->n_buffers >= 2 ? values->buffers[1] : nullptr;
  c.value_first = values->offset;
  c.value_length = values->length;
  if (rows > 0 && (c.offsets == nullptr || (c.values == nullptr && values->length > 0))) {
    return Status::InvalidArgument(where + ": column '" + c.name + "': a buffer is missing");
  }
  if (const int64_t r = FirstNull(c.validity, c.first, rows); r >= 0) {
    return Status::InvalidArgument(where + ", row " + Str(r) + ": column '" + c.name +
                                   "' is null (a sample's lists may not be null)");
  }
  if (rows > 0 && c.Off(0) < 0) {
    return Status::InvalidArgument(where + ": column '" + c.name + "' has a negative offset");
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (c.Off(r + 1) < c.Off(r) || c.Off(r + 1) > c.value_length) {
      return Status::InvalidArgument(where + ", row " + Str(r) + ": column '" + c.name +
                                     "' has offsets " + Str(c.Off(r)) + ".." + Str(c.Off(r + 1)) +
                                     " (they never decrease and stay within its " +
                                     Str(c.value_length) + " values)");
    }
  }
  if (c.value_validity != nullptr && rows > 0) {
    const int64_t lo = c.Off(0), hi = c.Off(rows);
    if (const int64_t k = FirstNull(c.value_validity, c.value_first + lo, hi - lo); k >= 0) {
      const int64_t at = lo + k;
      int64_t r = 0;
      while (c.Off(r + 1) <= at) ++r;
      return Status::InvalidArgument(where + ", row " + Str(r) + ": column '" + c.name +
                                     "' holds a null at position " + Str(at - c.Off(r)));
    }
  }
  return Status::Ok();
}

}  // namespace

std::span<const std::string_view> ArrowSourceColumns() { return kColumns; }

ArrowRowsInfo InfoOf(const ArrowRows& rows) {
  return {rows.rows(), rows.tokens, static_cast<int64_t>(rows.batches.size()), rows.has_mask,
          rows.has_labels};
}

Result<std::shared_ptr<const ArrowRows>> ImportArrowStream(ArrowArrayStream* stream,
                                                          std::string_view where_view) {
  const std::string where(where_view);
  StreamGuard guard{stream};
  if (stream == nullptr || stream->release == nullptr) {
    return Status::InvalidArgument(where + ": the Arrow stream is null or already released");
  }
  auto last_error = [&](const std::string& what) {
    const char* text = stream->get_last_error != nullptr ? stream->get_last_error(stream) : nullptr;
    return Status::IOError(where + ": " + what + ": " + (text != nullptr ? text : "(no message)"));
  };
  SchemaGuard schema;
  if (stream->get_schema(stream, &schema.s) != 0) return last_error("reading its schema");
  const std::string format = schema.s.format != nullptr ? schema.s.format : "";
  if (format != "+s") {
    return Status::InvalidArgument(where + ": the stream's schema has Arrow type '" + format +
                                   "'; expected a record batch (a struct of columns)");
  }
  // The child of each read column, by name; its type.
  std::vector<int64_t> child(3, -1);
  ListColumn types[3];
  for (int64_t k = 0; k < schema.s.n_children; ++k) {
    const ArrowSchema& c = *schema.s.children[k];
    const std::string name = c.name != nullptr ? c.name : "";
    for (size_t i = 0; i < 3; ++i) {
      if (name != kColumns[i]) continue;
      if (child[i] >= 0) {
        return Status::InvalidArgument(where + ": column '" + name + "' appears twice");
      }
      child[i] = k;
      THDPACK_RETURN_IF_ERROR(ColumnType(c, where, types[i]));
    }
  }
  if (child[0] < 0) {
    std::string names;
    for (int64_t k = 0; k < schema.s.n_children; ++k) {
      const char* n = schema.s.children[k]->name;
      names += (k ? ", '" : "'") + std::string(n != nullptr ? n : "") + "'";
    }
    return Status::InvalidArgument(where + ": no column 'input_ids' (the columns: " +
                                   (names.empty() ? "none" : names) + ")");
  }
  if (child[1] >= 0 && child[2] >= 0) {
    return Status::InvalidArgument(where + ": columns 'loss_mask' and 'labels' both given; " +
                                   "a sample's targets come from one of them");
  }
  if (types[2].present && types[2].kind != 'i') {
    return Status::InvalidArgument(where + ": column 'labels' must hold signed integers (-100 " +
                                   "where a token is no target)");
  }
  auto info = std::make_shared<SchemaInfo>();
  for (int64_t k = 0; k < schema.s.n_children; ++k) {
    const ArrowSchema& c = *schema.s.children[k];
    ColumnInfo col{c.name != nullptr ? c.name : "", c.format != nullptr ? c.format : "", "",
                   "", c.dictionary != nullptr};
    if (c.n_children == 1 && c.children[0] != nullptr && c.children[0]->format != nullptr) {
      const ArrowSchema& v = *c.children[0];
      col.values = v.format;
      col.dictionary = col.dictionary || v.dictionary != nullptr;
      if (v.n_children == 1 && v.children[0] != nullptr && v.children[0]->format != nullptr) {
        col.inner = v.children[0]->format;
        col.dictionary = col.dictionary || v.children[0]->dictionary != nullptr;
      }
    }
    info->push_back(std::move(col));
  }
  auto rows = std::make_shared<ArrowRows>();
  rows->has_mask = child[1] >= 0;
  rows->has_labels = child[2] >= 0;
  rows->starts.push_back(0);
  for (int64_t b = 0;; ++b) {
    ArrowArray array{};
    if (stream->get_next(stream, &array) != 0) {
      return last_error("reading record batch " + Str(b));
    }
    if (array.release == nullptr) break;  // the end of the stream
    ArrowRows::Batch& batch = rows->batches.emplace_back();
    batch.array = array;  // owned from here: released with the rows
    const std::string at = where + ", record batch " + Str(b);
    batch.name = at;
    batch.schema = info;
    if (array.n_children != schema.s.n_children) {
      return Status::InvalidArgument(at + ": " + Str(array.n_children) + " columns, the schema " +
                                     Str(schema.s.n_children));
    }
    if (array.null_count != 0 && array.n_buffers > 0 && array.buffers[0] != nullptr) {
      if (const int64_t r = FirstNull(static_cast<const uint8_t*>(array.buffers[0]),
                                      array.offset, array.length);
          r >= 0) {
        return Status::InvalidArgument(at + ", row " + Str(r) + ": the row is null");
      }
    }
    batch.rows = array.length;
    ListColumn* cols[3] = {&batch.ids, &batch.mask, &batch.labels};
    for (size_t i = 0; i < 3; ++i) {
      if (child[i] < 0) continue;
      *cols[i] = types[i];
      THDPACK_RETURN_IF_ERROR(BindColumn(batch.array, child[i], at, *cols[i]));
    }
    for (int64_t r = 0; r < batch.rows; ++r) {
      const int64_t n = batch.ids.Off(r + 1) - batch.ids.Off(r);
      if (n == 0) {
        return Status::InvalidArgument(at + ", row " + Str(r) + " (row " +
                                       Str(rows->starts.back() + r) +
                                       " of the data): input_ids is empty");
      }
      for (const ListColumn* c : {&batch.mask, &batch.labels}) {
        if (c->present && c->Off(r + 1) - c->Off(r) != n) {
          return Status::InvalidArgument(at + ", row " + Str(r) + ": column '" + c->name +
                                         "' has " + Str(c->Off(r + 1) - c->Off(r)) +
                                         " values, input_ids " + Str(n) +
                                         " (it is token-aligned)");
        }
      }
      rows->tokens += n;
    }
    rows->starts.push_back(rows->starts.back() + batch.rows);
  }
  for (ArrowRows::Batch& b : rows->batches) b.struct_array = &b.array;  // the vector is final
  return std::shared_ptr<const ArrowRows>(std::move(rows));
}

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
ArrowOpener& Opener() {
  static auto* o = new ArrowOpener();
  return *o;
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

Result<std::shared_ptr<const ArrowRows>> ConcatArrowRows(
    std::span<const std::shared_ptr<const ArrowRows>> parts, std::string_view where) {
  auto rows = std::make_shared<ArrowRows>();
  rows->starts.push_back(0);
  for (size_t p = 0; p < parts.size(); ++p) {
    const ArrowRows& part = *parts[p];
    if (p > 0 && part.rows() > 0 && rows->rows() > 0 &&
        (part.has_mask != rows->has_mask || part.has_labels != rows->has_labels)) {
      auto targets = [](const ArrowRows& r) {
        return std::string(r.has_mask ? "a 'loss_mask' column"
                           : r.has_labels ? "a 'labels' column" : "neither loss_mask nor labels");
      };
      return Status::InvalidArgument(std::string(where) + ": " + part.batches[0].name + " has " +
                                     targets(part) + ", " + rows->batches[0].name + " " +
                                     targets(*rows) + " (every part gives its targets alike)");
    }
    if (part.rows() > 0 && rows->rows() == 0) {
      rows->has_mask = part.has_mask;
      rows->has_labels = part.has_labels;
    }
    for (const ArrowRows::Batch& b : part.batches) {
      ArrowRows::Batch& copy = rows->batches.emplace_back();
      copy.rows = b.rows;
      copy.ids = b.ids;
      copy.mask = b.mask;
      copy.labels = b.labels;
      copy.name = b.name;  // copy.array stays released: the part owns its batch
      copy.schema = b.schema;
      copy.struct_array = b.struct_array;
      rows->starts.push_back(rows->starts.back() + b.rows);
    }
    rows->tokens += part.tokens;
    rows->parts.push_back(parts[p]);
  }
  return std::shared_ptr<const ArrowRows>(std::move(rows));
}

void SetArrowOpener(ArrowOpener opener) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Opener() = std::move(opener);
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
  ArrowOpener opener;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    if (auto it = Registry().find(spec); it != Registry().end()) rows = it->second;
    opener = Opener();
  }
  // The columns this open reads: the rules' and the fields'; kept rows that lack a field's
  // column are read again from the files with it (an in-memory producer keeps all of its own).
  std::vector<std::string> columns(kColumns, kColumns + 3);
  for (const SourceField& f : options.fields) columns.push_back(f.name);
  const std::string_view path = SourcePathOf(spec);
  if (rows != nullptr && opener && !path.empty() && path[0] != '@' && !rows->batches.empty()) {
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
    if (!opener) {
      return Status::InvalidArgument(
          "data source " + spec + ": Parquet and Arrow files are read by Apache Arrow's own " +
          "readers, which this program does not link; read them from Python (thdpack with " +
          "pyarrow: pip install pyarrow), or convert them to a Megatron dataset");
    }
    THDPACK_ASSIGN_OR_RETURN(rows, opener(spec, columns));
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
