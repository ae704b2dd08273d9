// src/data/arrow_internal.h: what the columnar source's files share (not public API) - the
// imported rows (ArrowRows: the record batches held, each read column's buffers as a
// ListColumn) and the bit and null helpers. arrow_import.cc makes the rows (ImportArrowStream,
// ConcatArrowRows); arrow_source.cc reads them (the source, the fields, the registry);
// arrow_files.cc opens the file specs (their files, the Parquet cache).
//
// Thread-safety: an ArrowRows is immutable once made (its identity is computed once, guarded).
#ifndef THDPACK_SRC_DATA_ARROW_INTERNAL_H_
#define THDPACK_SRC_DATA_ARROW_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/arrow.h"

namespace thdpack {
namespace arrow_internal {

inline std::string Str(int64_t v) { return std::to_string(v); }

inline constexpr std::string_view kColumns[] = {"input_ids", "loss_mask", "labels"};
inline constexpr int64_t kNoTarget = -100;  // Hugging Face's ignore index in `labels`

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

inline bool BitSet(const uint8_t* bits, int64_t i) { return (bits[i >> 3] >> (i & 7)) & 1; }

// A record batch's columns as its schema gives them: name, Arrow format and, for a list or a
// fixed-size list, its values' format. Fields (SourceField) are bound through it.
struct ColumnInfo {
  std::string name, format, values;
  std::string inner;  // a list of fixed-size lists: the inner lists' values' format
  bool dictionary = false;
};
using SchemaInfo = std::vector<ColumnInfo>;

// The first null of `n` entries from `first` of a validity bitmap, or -1.
inline int64_t FirstNull(const uint8_t* validity, int64_t first, int64_t n) {
  if (validity == nullptr) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!BitSet(validity, first + i)) return i;
  }
  return -1;
}

// The rows of the `parquet:` or `arrow:` file spec `spec` (OpenArrowSource), reading at least
// `columns`, by `readers` (arrow_files.cc).
[[nodiscard]] Result<std::shared_ptr<const ArrowRows>> OpenArrowFiles(
    const std::string& spec, std::span<const std::string> columns, const ArrowReaders& readers);

}  // namespace arrow_internal

class ArrowRows {
 public:
  struct Batch {
    ArrowArray array{};  // released with the rows (not set in a concatenation's copies)
    int64_t rows = 0;
    arrow_internal::ListColumn ids, mask, labels;
    std::string name;  // for messages: "<where>, record batch k"
    // Its stream's columns, in array.children's order.
    std::shared_ptr<const arrow_internal::SchemaInfo> schema;
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
    return (named ? "" : std::string(spec) + ": ") + b->name + ", row " +
           arrow_internal::Str(r) + " (row " + arrow_internal::Str(row) + " of the data)";
  }
};

}  // namespace thdpack

#endif  // THDPACK_SRC_DATA_ARROW_INTERNAL_H_
