// thdpack/arrow.h: columnar data (Parquet, Arrow IPC files and streams, Hugging Face datasets,
// any Arrow producer) as a source (docs/data_sources.md, "Columnar sources").
//
// thdpack links no Arrow library. It reads Arrow's memory through the Arrow C data and stream
// interfaces (ArrowSchema, ArrowArray, ArrowArrayStream: an ABI-stable specification, defined
// below under Arrow's own guards so that arrow/c/abi.h and this header agree), zero-copy: the
// record batches stay where their producer put them (pyarrow's memory map of an Arrow IPC file,
// a pyarrow Table, a polars frame) and a sample is copied out of them only when it is read.
// Opening the files is Arrow's own readers' work: in Python, pyarrow (thdpack.arrow), which the
// module sets as the opener of `parquet:` and `arrow:` specs; the command line, built without
// Arrow C++, names that and refuses them.
//
// Columns, by name (others are ignored): `input_ids` (list or large_list of any integer type:
// the tokens), optional `loss_mask` (list or large_list of bool or integers, 0/1, token-aligned)
// or `labels` (list or large_list of integers: -100 where the token is no target, the token
// itself where it is - Hugging Face's unshifted labels), and the run's declared fields
// (SourceOptions::fields: a list of the field's type per token, a value or a fixed-size list
// per sample). Each row one sample; no row, list or
// value may be null; every row has at least one token.
//
// Rows keep their producer's order: the record batches in the stream's order (files in
// lexicographic order, each file's row groups or batches in order); shuffling is the sources'
// sample-level rule (SourceOptions::shuffle), with O(1) seek to any position.
//
// Thread-safety: an ArrowRows is immutable once imported and may be read by every source and
// thread at once; the registry and the opener are guarded by a mutex.
#ifndef THDPACK_ARROW_H_
#define THDPACK_ARROW_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "thdpack/data.h"
#include "thdpack/status.h"

extern "C" {
#ifndef ARROW_C_DATA_INTERFACE
#define ARROW_C_DATA_INTERFACE

#define ARROW_FLAG_DICTIONARY_ORDERED 1
#define ARROW_FLAG_NULLABLE 2
#define ARROW_FLAG_MAP_KEYS_SORTED 4

struct ArrowSchema {
  const char* format;
  const char* name;
  const char* metadata;
  int64_t flags;
  int64_t n_children;
  struct ArrowSchema** children;
  struct ArrowSchema* dictionary;
  void (*release)(struct ArrowSchema*);
  void* private_data;
};

struct ArrowArray {
  int64_t length;
  int64_t null_count;
  int64_t offset;
  int64_t n_buffers;
  int64_t n_children;
  const void** buffers;
  struct ArrowArray** children;
  struct ArrowArray* dictionary;
  void (*release)(struct ArrowArray*);
  void* private_data;
};

#endif  // ARROW_C_DATA_INTERFACE

#ifndef ARROW_C_STREAM_INTERFACE
#define ARROW_C_STREAM_INTERFACE

struct ArrowArrayStream {
  int (*get_schema)(struct ArrowArrayStream*, struct ArrowSchema* out);
  int (*get_next)(struct ArrowArrayStream*, struct ArrowArray* out);
  const char* (*get_last_error)(struct ArrowArrayStream*);
  void (*release)(struct ArrowArrayStream*);
  void* private_data;
};

#endif  // ARROW_C_STREAM_INTERFACE
}  // extern "C"

namespace thdpack {

// The rows of an Arrow stream, imported: its record batches held (released with the last
// reference), each checked once.
class ArrowRows;

// The columns a source reads, by name: input_ids, loss_mask, labels.
std::span<const std::string_view> ArrowSourceColumns();

// Reads every record batch of `stream` and checks it (InvalidArgument naming `where`, the
// record batch ("<where>, record batch k", also each batch's name in later messages), the row -
// also as a row of the whole data - the column and the rule): the
// schema a struct of columns with input_ids among them; each read column a list or large_list
// of the types above (a dictionary, a list view or any other type refused by name); not both
// loss_mask and labels; no null row, list or value; offsets that never decrease and stay within
// their values; every row at least one token, its loss_mask or labels as long as its
// input_ids. The stream is released before returning, whatever the outcome; the batches are
// kept, never copied. An error of the stream itself (get_next's) is an IOError with its text.
[[nodiscard]] Result<std::shared_ptr<const ArrowRows>> ImportArrowStream(ArrowArrayStream* stream,
                                                                        std::string_view where);

// The rows of `parts` one after another (each file of a spec, each row group of a file), their
// batches shared, never copied; each batch keeps the name its import gave it (messages name
// the file and the row group or batch). InvalidArgument naming `where` and two parts when one
// gives its targets by loss_mask and another by labels (or none).
[[nodiscard]] Result<std::shared_ptr<const ArrowRows>> ConcatArrowRows(
    std::span<const std::shared_ptr<const ArrowRows>> parts, std::string_view where);

// What imported rows hold: rows, tokens (the sum of the rows' lengths) and record batches.
struct ArrowRowsInfo {
  int64_t rows = 0;
  int64_t tokens = 0;
  int64_t batches = 0;
  bool has_mask = false;
  bool has_labels = false;
};
ArrowRowsInfo InfoOf(const ArrowRows& rows);

// Opens the `parquet:PATH` and `arrow:PATH` specs (PATH a file, a folder or a glob), reading
// at least `columns` (ArrowSourceColumns and the declared fields' names; a reader may keep more,
// but need not read others): set once by a process that has Arrow's readers (the Python module,
// with pyarrow); none by default.
using ArrowOpener = std::function<Result<std::shared_ptr<const ArrowRows>>(
    std::string_view spec, std::span<const std::string> columns)>;
void SetArrowOpener(ArrowOpener opener);

// Rows made available under `spec` in this process: an in-memory producer
// (thdpack.arrow_source: "arrow:@NAME"), or a file spec already opened. The same spec again
// replaces them.
void RegisterArrowRows(std::string spec, std::shared_ptr<const ArrowRows> rows);

// The source of a `parquet:` or `arrow:` spec: the rows registered under it, else what the
// opener makes of it (then registered, so that every later open of the spec in this process
// reads the same rows; opened again, with the columns of both, when a later open declares a
// field whose column the kept rows lack); InvalidArgument naming the spec when neither (an
// `@NAME` not registered; a file spec in a process without an opener - the command line - saying that
// pyarrow opens them). A source with random access, as a Megatron dataset: shuffling, epochs,
// O(1) Seek and CursorAfter. Its identity: the rows, tokens and batches, and a hash of every
// batch's offsets and the first and last 64 KiB of its tokens.
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenArrowSource(std::string_view spec,
                                                                   const SourceOptions& options);

}  // namespace thdpack

#endif  // THDPACK_ARROW_H_
