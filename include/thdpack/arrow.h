// thdpack/arrow.h: columnar data (Parquet, Arrow IPC files and streams, Hugging Face datasets,
// any Arrow producer) as a source (docs/data_sources.md, "Columnar sources").
//
// thdpack links no Arrow library. It reads Arrow's memory through the Arrow C data and stream
// interfaces (ArrowSchema, ArrowArray, ArrowArrayStream: an ABI-stable specification, defined
// below under Arrow's own guards so that arrow/c/abi.h and this header agree), zero-copy: the
// record batches stay where their producer put them (pyarrow's memory map of an Arrow IPC file,
// a pyarrow Table, a polars frame) and a sample is copied out of them only when it is read.
// Opening the files is Arrow's own readers' work (ArrowReaders): in Python, pyarrow
// (thdpack.arrow); in the command line, Arrow C++ when its build found it (pyarrow's wheel
// ships it), and otherwise a refusal that names how to read them.
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
// thread at once; the registry and the readers are guarded by a mutex.
#ifndef THDPACK_ARROW_H_
#define THDPACK_ARROW_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
// record batch ("<where>, <unit> k", also each batch's name in later messages; `unit` "row
// group" when each batch is one of a Parquet file's), the row -
// also as a row of the whole data - the column and the rule): the
// schema a struct of columns with input_ids among them; each read column a list or large_list
// of the types above (a dictionary, a list view or any other type refused by name); not both
// loss_mask and labels; no null row, list or value; offsets that never decrease and stay within
// their values; every row at least one token, its loss_mask or labels as long as its
// input_ids. The stream is released before returning, whatever the outcome; the batches are
// kept, never copied. An error of the stream itself (get_next's) is an IOError with its text.
[[nodiscard]] Result<std::shared_ptr<const ArrowRows>> ImportArrowStream(
    ArrowArrayStream* stream, std::string_view where, std::string_view unit = "record batch");

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

// Apache Arrow's own readers, as a process has them: the Python module's are pyarrow's
// (thdpack.arrow), the command line's Arrow C++'s when its build found it (tools/arrow_readers.cc);
// none by default. Only what a file spec needs of them: every rule of the specs - which files,
// in which order, which columns are decoded, where Parquet's decoded rows are kept and who
// writes them - is OpenArrowSource's (ColumnarFiles, CachedParquet).
struct ArrowReaders {
  // The names of the top-level columns of the Parquet file at `path`.
  std::function<Result<std::vector<std::string>>(const std::string& path)> parquet_columns;
  // Decodes `columns` of the Parquet file at `path` into a new Arrow IPC file at `out`, one
  // record batch per row group (batch g holds row group g, an empty one too).
  std::function<Status(const std::string& path, std::span<const std::string> columns,
                       const std::string& out)>
      parquet_to_ipc;
  // The record batches of the Arrow IPC file (or stream) at `path`, memory-mapped: zero-copy,
  // the map kept alive by the stream and the arrays it gives.
  std::function<Result<ArrowArrayStream>(const std::string& path)> read_ipc;
  bool ok() const { return parquet_columns && parquet_to_ipc && read_ipc; }
};
void SetArrowReaders(ArrowReaders readers);

// The files of a spec's PATH, `kind` "parquet" or "arrow": the file itself; a folder's files
// with the kind's extensions (.parquet .pq; .arrow .feather .ipc: a saved dataset's
// data-*.arrow); a glob's (* ? [) matching files; in lexicographic order of their paths.
// NotFound naming PATH when it names no file.
[[nodiscard]] Result<std::vector<std::string>> ColumnarFiles(std::string_view kind,
                                                            std::string_view path);

// Where decoded Parquet is kept: $THDPACK_CACHE, else $XDG_CACHE_HOME/thdpack, else
// ~/.cache/thdpack (its parquet/ folder).
std::string ThdpackCacheDir();

// Parquet's rows cannot be read in place (pages compressed and encoded), and a sample-level
// shuffle reads a row group per sample: `file`'s `columns` are decoded once, row group by row
// group, into an Arrow IPC file of the cache, which every later open (every rank, job and
// resume on this machine) memory-maps - zero-copy, no anonymous memory that grows with the
// data. Returns its path. Its name holds a hash of the file's real path, size and modification
// time and of the columns, so that a changed file is decoded again. One process decodes while
// the others on the machine wait for it (an flock on "<cache file>.lock"); it writes
// "<cache file>.tmp" and renames it into place, so that a killed decode leaves no cache file
// and the next open starts over. IOError naming the folder when it cannot be written
// (THDPACK_CACHE elsewhere), the reader's error naming the file.
[[nodiscard]] Result<std::string> CachedParquet(const std::string& file,
                                                std::span<const std::string> columns,
                                                const ArrowReaders& readers);

// Rows made available under `spec` in this process: an in-memory producer
// (thdpack.arrow_source: "arrow:@NAME"), or a file spec already opened. The same spec again
// replaces them.
void RegisterArrowRows(std::string spec, std::shared_ptr<const ArrowRows> rows);

// The source of a `parquet:` or `arrow:` spec: the rows registered under it, else its files'
// (ColumnarFiles; Parquet through CachedParquet, the columns the rules and the declared fields
// read - all of them when the file has no input_ids, so that the error names them; Arrow files
// mapped whole), read by the process's ArrowReaders and registered, so that every later open
// of the spec in this process reads the same rows; opened again, with the columns of both,
// when a later open declares a field whose column the kept rows lack. InvalidArgument naming
// the spec when neither (an `@NAME` not registered; a file spec in a process without readers,
// saying how to get them). A source with random access, as a Megatron dataset: shuffling, epochs,
// O(1) Seek and CursorAfter. Its identity: the rows, tokens and batches, and a hash of every
// batch's offsets and the first and last 64 KiB of its tokens.
[[nodiscard]] Result<std::unique_ptr<SampleSource>> OpenArrowSource(std::string_view spec,
                                                                   const SourceOptions& options);

}  // namespace thdpack

#endif  // THDPACK_ARROW_H_
