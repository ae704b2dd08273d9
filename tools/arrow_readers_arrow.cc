// The command line's readers of `parquet:` and `arrow:` files: Apache Arrow's own C++ readers
// (Parquet's FileReader, the IPC file and stream readers over a memory map), handing the
// record batches to the library through the Arrow C stream interface (arrow/c/bridge.h). What
// files, in what order, which columns and the cache of decoded Parquet are the library's
// (thdpack/arrow.h); this file only reads and writes what it is told to, as pyarrow does for
// the Python module (python/thdpack/arrow.py).
#include <arrow/c/bridge.h>
#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <arrow/ipc/writer.h>
#include <arrow/memory_pool.h>
#include <arrow/record_batch.h>
#include <arrow/table.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/schema.h>

#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "arrow_readers.h"
#include "thdpack/arrow.h"

namespace thdpack::tools {
namespace {

Status Named(const std::string& path, const arrow::Status& s) {
  return Status::IOError(path + ": " + s.ToString());
}

// Returns the thdpack Status of an arrow::Status or the value of an arrow::Result, naming path.
#define THDPACK_ARROW_ASSIGN(lhs, expr, path) \
  auto lhs##_r = (expr);                      \
  if (!lhs##_r.ok()) return Named(path, lhs##_r.status()); \
  lhs = std::move(lhs##_r).ValueUnsafe()

Result<std::unique_ptr<parquet::arrow::FileReader>> OpenParquet(const std::string& path) {
  std::shared_ptr<arrow::io::MemoryMappedFile> file;
  THDPACK_ARROW_ASSIGN(file, arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ),
                       path);
  std::unique_ptr<parquet::arrow::FileReader> reader;
  THDPACK_ARROW_ASSIGN(reader, parquet::arrow::OpenFile(file, arrow::default_memory_pool()),
                       path);
  return reader;
}

Result<std::vector<std::string>> ParquetColumns(const std::string& path) {
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<parquet::arrow::FileReader> reader,
                           OpenParquet(path));
  std::shared_ptr<arrow::Schema> schema;
  if (arrow::Status s = reader->GetSchema(&schema); !s.ok()) return Named(path, s);
  return schema->field_names();
}

// The leaf columns under a top-level field (Parquet reads by leaf).
void Leaves(const parquet::arrow::SchemaField& f, std::vector<int>& out) {
  if (f.column_index >= 0) out.push_back(f.column_index);
  for (const parquet::arrow::SchemaField& c : f.children) Leaves(c, out);
}

Status ParquetToIpc(const std::string& path, std::span<const std::string> columns,
                    const std::string& out) {
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<parquet::arrow::FileReader> reader,
                           OpenParquet(path));
  std::shared_ptr<arrow::Schema> schema;
  if (arrow::Status s = reader->GetSchema(&schema); !s.ok()) return Named(path, s);
  // The columns in the file's order, as a row group's table holds them.
  std::vector<int> fields, leaves;
  for (int i = 0; i < schema->num_fields(); ++i) {
    if (std::find(columns.begin(), columns.end(), schema->field(i)->name()) != columns.end()) {
      fields.push_back(i);
      Leaves(reader->manifest().schema_fields[i], leaves);
    }
  }
  arrow::FieldVector picked;
  for (int i : fields) picked.push_back(schema->field(i));
  const std::shared_ptr<arrow::Schema> selected = arrow::schema(std::move(picked));
  std::shared_ptr<arrow::io::FileOutputStream> sink;
  THDPACK_ARROW_ASSIGN(sink, arrow::io::FileOutputStream::Open(out), out);
  std::shared_ptr<arrow::ipc::RecordBatchWriter> writer;
  THDPACK_ARROW_ASSIGN(writer, arrow::ipc::MakeFileWriter(sink, selected), out);
  for (int g = 0; g < reader->num_row_groups(); ++g) {
    std::shared_ptr<arrow::Table> table;
    THDPACK_ARROW_ASSIGN(table, reader->ReadRowGroup(g, leaves),
                         path + ", row group " + std::to_string(g));
    std::shared_ptr<arrow::RecordBatch> batch;
    THDPACK_ARROW_ASSIGN(batch, table->CombineChunksToBatch(),
                         path + ", row group " + std::to_string(g));
    if (arrow::Status s = writer->WriteRecordBatch(*batch); !s.ok()) return Named(out, s);
  }
  if (arrow::Status s = writer->Close(); !s.ok()) return Named(out, s);
  if (arrow::Status s = sink->Close(); !s.ok()) return Named(out, s);
  return Status::Ok();
}

Result<ArrowArrayStream> ReadIpc(const std::string& path) {
  std::shared_ptr<arrow::io::MemoryMappedFile> file;
  THDPACK_ARROW_ASSIGN(file, arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ),
                       path);
  std::shared_ptr<arrow::RecordBatchReader> batches;
  if (auto f = arrow::ipc::RecordBatchFileReader::Open(file); f.ok()) {
    // Every batch as written, an empty one too; zero-copy from the map.
    std::vector<std::shared_ptr<arrow::RecordBatch>> all;
    for (int i = 0; i < (*f)->num_record_batches(); ++i) {
      std::shared_ptr<arrow::RecordBatch> b;
      THDPACK_ARROW_ASSIGN(b, (*f)->ReadRecordBatch(i), path);
      all.push_back(std::move(b));
    }
    THDPACK_ARROW_ASSIGN(batches, arrow::RecordBatchReader::Make(all, (*f)->schema()), path);
  } else {  // not a file: a stream (datasets' save_to_disk)
    if (arrow::Status s = file->Seek(0); !s.ok()) return Named(path, s);
    THDPACK_ARROW_ASSIGN(batches, arrow::ipc::RecordBatchStreamReader::Open(file), path);
  }
  ArrowArrayStream stream{};
  if (arrow::Status s = arrow::ExportRecordBatchReader(batches, &stream); !s.ok()) {
    return Named(path, s);
  }
  return stream;
}

}  // namespace

void InstallArrowReaders() {
  ArrowReaders readers;
  readers.parquet_columns = ParquetColumns;
  readers.parquet_to_ipc = ParquetToIpc;
  readers.read_ipc = ReadIpc;
  SetArrowReaders(std::move(readers));
}

}  // namespace thdpack::tools
