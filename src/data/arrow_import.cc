// Columnar sources (thdpack/arrow.h), their rows: Arrow record batches imported through the C
// stream interface and each checked once (ImportArrowStream), and several imports one after
// another (ConcatArrowRows). Reading them is arrow_source.cc's.
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/arrow_internal.h"

namespace thdpack {

using arrow_internal::ColumnInfo;
using arrow_internal::FirstNull;
using arrow_internal::kColumns;
using arrow_internal::ListColumn;
using arrow_internal::SchemaInfo;
using arrow_internal::Str;

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
                                                          std::string_view where_view,
                                                          std::string_view unit_view) {
  const std::string unit(unit_view);
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
      return last_error("reading " + unit + " " + Str(b));
    }
    if (array.release == nullptr) break;  // the end of the stream
    ArrowRows::Batch& batch = rows->batches.emplace_back();
    batch.array = array;  // owned from here: released with the rows
    const std::string at = where + ", " + unit + " " + Str(b);
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


}  // namespace thdpack
