// Columnar sources' files (thdpack/arrow.h): which files a spec's PATH names and in which order,
// and the cache of decoded Parquet - decoded once, again when the file changes, nothing left
// by a failed decode, the folder named when it cannot be made - with readers that write bytes
// in place of Arrow's (the Python suite runs them with pyarrow's, test_columnar.py).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <utime.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/arrow_internal.h"
#include "data/arrow_test_util.h"
#include "data/data_test_util.h"
#include "thdpack/arrow.h"

namespace thdpack {
namespace {

using testing_util::TempDir;

void Touch(const std::string& path, const std::string& text = "x") {
  std::ofstream(path) << text;
}

std::string Read(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(ColumnarFilesTest, AFileAFoldersFilesOfItsKindAndAGlobInLexicographicOrder) {
  TempDir d;
  std::filesystem::create_directory(d.File("sub.parquet"));  // a folder: not a file
  for (const char* f : {"b.parquet", "a.pq", "c.txt", "d.arrow", "e.feather", "A.ipc"}) {
    Touch(d.File(f));
  }
  using V = std::vector<std::string>;
  EXPECT_EQ(*ColumnarFiles("parquet", d.path()), (V{d.File("a.pq"), d.File("b.parquet")}));
  EXPECT_EQ(*ColumnarFiles("arrow", d.path()),
            (V{d.File("A.ipc"), d.File("d.arrow"), d.File("e.feather")}));
  EXPECT_EQ(*ColumnarFiles("parquet", d.File("c.txt")), (V{d.File("c.txt")}));
  EXPECT_EQ(*ColumnarFiles("parquet", d.path() + "/*.p*"), (V{d.File("a.pq"),
                                                              d.File("b.parquet")}));
  Result<std::vector<std::string>> none = ColumnarFiles("parquet", d.File("missing"));
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find("missing: no such file or folder"), std::string::npos);
  none = ColumnarFiles("parquet", d.path() + "/*.zip");
  EXPECT_NE(none.status().message().find("no .parquet or .pq files in it"), std::string::npos);
  EXPECT_EQ(ColumnarFiles("orc", d.path()).status().code(), StatusCode::kInvalidArgument);
}

// Readers whose "decode" writes the file's bytes and the columns, counting its calls.
struct FakeReaders {
  int decodes = 0;
  bool fail = false;
  ArrowReaders Make() {
    ArrowReaders r;
    r.parquet_columns = [](const std::string&) -> Result<std::vector<std::string>> {
      return std::vector<std::string>{"input_ids"};
    };
    r.parquet_to_ipc = [this](const std::string& path, std::span<const std::string> columns,
                              const std::string& out) -> Status {
      ++decodes;
      std::string text = Read(path);
      for (const std::string& c : columns) text += " " + c;
      Touch(out, text);
      if (fail) return Status::InvalidArgument(path + ": not a Parquet file");
      return Status::Ok();
    };
    r.read_ipc = [](const std::string&) -> Result<ArrowArrayStream> {
      return Status::Unimplemented("not read here");
    };
    return r;
  }
};

class CachedParquetTest : public testing::Test {
 protected:
  void SetUp() override {
    const char* old = std::getenv("THDPACK_CACHE");
    if (old != nullptr) old_ = old;
    setenv("THDPACK_CACHE", cache_.path().c_str(), 1);
  }
  void TearDown() override {
    if (old_.empty()) {
      unsetenv("THDPACK_CACHE");
    } else {
      setenv("THDPACK_CACHE", old_.c_str(), 1);
    }
  }
  TempDir cache_, data_;
  std::string old_;
};

TEST_F(CachedParquetTest, DecodedOnceAndAgainWhenTheFileOrTheColumnsChange) {
  FakeReaders fake;
  ArrowReaders readers = fake.Make();
  const std::string f = data_.File("part.parquet");
  Touch(f, "one");
  const std::vector<std::string> cols{"loss_mask", "input_ids"};
  Result<std::string> a = CachedParquet(f, cols, readers);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->rfind(cache_.path() + "/parquet/part-", 0), 0u) << *a;
  EXPECT_EQ(Read(*a), "one input_ids loss_mask");  // the columns in one order, whatever given
  EXPECT_EQ(*CachedParquet(f, {{"input_ids", "loss_mask"}}, readers), *a);
  EXPECT_EQ(fake.decodes, 1);
  Result<std::string> b = CachedParquet(f, {{"input_ids"}}, readers);  // other columns
  EXPECT_NE(*b, *a);
  EXPECT_EQ(fake.decodes, 2);
  Touch(f, "two!");  // another size
  Result<std::string> c = CachedParquet(f, cols, readers);
  EXPECT_NE(*c, *a);
  EXPECT_EQ(Read(*c), "two! input_ids loss_mask");
  Touch(f, "six!");  // the same size, another modification time
  utimbuf t{1000000000, 1000000000};
  ASSERT_EQ(utime(f.c_str(), &t), 0);
  Result<std::string> e = CachedParquet(f, cols, readers);
  EXPECT_NE(*e, *c);
  EXPECT_EQ(fake.decodes, 4);
  EXPECT_FALSE(std::filesystem::exists(*a + ".tmp"));
}

TEST_F(CachedParquetTest, AFailedDecodeLeavesNothingAndTheNextOneStartsOver) {
  FakeReaders fake;
  ArrowReaders readers = fake.Make();
  const std::string f = data_.File("bad.parquet");
  Touch(f, "bytes");
  fake.fail = true;
  Result<std::string> r = CachedParquet(f, {{"input_ids"}}, readers);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("bad.parquet: not a Parquet file"), std::string::npos);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(cache_.File("parquet"))) {
    files += e.path().extension() != ".lock";
  }
  EXPECT_EQ(files, 0);
  // A killed decode's temporary file is the lock holder's to remove.
  fake.fail = false;
  r = CachedParquet(f, {{"input_ids"}}, readers);
  ASSERT_TRUE(r.ok());
  Touch(*r + ".tmp", "half");
  std::filesystem::remove(*r);
  r = CachedParquet(f, {{"input_ids"}}, readers);
  EXPECT_EQ(Read(*r), "bytes input_ids");
  EXPECT_FALSE(std::filesystem::exists(*r + ".tmp"));
}

TEST_F(CachedParquetTest, AFolderThatCannotBeMadeIsNamed) {
  FakeReaders fake;
  const std::string f = data_.File("x.parquet");
  Touch(f);
  Touch(cache_.File("plain"));
  setenv("THDPACK_CACHE", cache_.File("plain/sub").c_str(), 1);
  Result<std::string> r = CachedParquet(f, {{"input_ids"}}, fake.Make());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_NE(r.status().message().find("plain/sub/parquet: cannot create it"), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("set THDPACK_CACHE"), std::string::npos);
  EXPECT_EQ(fake.decodes, 0);
  EXPECT_EQ(CachedParquet(data_.File("none.parquet"), {}, fake.Make()).status().code(),
            StatusCode::kNotFound);
}

// A batch of one input_ids column (int32 lists), `null_row` null when >= 0.
testing_util::TestBatch Ids(const std::vector<std::vector<int64_t>>& rows, int null_row = -1) {
  testing_util::TestListColumn c{"input_ids", "i", false, {0}, {}, {}, {}, 0};
  for (size_t r = 0; r < rows.size(); ++r) {
    c.values.insert(c.values.end(), rows[r].begin(), rows[r].end());
    c.offsets.push_back(static_cast<int64_t>(c.values.size()));
    c.null_rows.push_back(static_cast<int>(r) == null_row);
  }
  return {static_cast<int64_t>(rows.size()), 0, {c}, {}};
}

TEST_F(CachedParquetTest, AFileSpecIsItsFilesInOrderEachParquetFileDecodedThenMapped) {
  // Fake readers: a file's "decode" writes its stem; reading a cache file gives the batches of
  // that stem (a: two row groups, b: one), reading anything else the batches of an IPC file.
  std::vector<std::vector<std::string>> decoded;
  ArrowReaders r;
  r.parquet_columns = [](const std::string&) -> Result<std::vector<std::string>> {
    return std::vector<std::string>{"text", "input_ids", "attention_mask"};
  };
  r.parquet_to_ipc = [&](const std::string& path, std::span<const std::string> columns,
                         const std::string& out) -> Status {
    decoded.emplace_back(columns.begin(), columns.end());
    Touch(out, std::filesystem::path(path).stem().string());
    return Status::Ok();
  };
  bool bad = false;
  r.read_ipc = [&](const std::string& path) -> Result<ArrowArrayStream> {
    const std::string stem = std::filesystem::path(path).extension() == ".arrow" &&
                                     path.rfind(cache_.path(), 0) == 0
                                 ? Read(path)
                                 : "ipc";
    if (stem == "a") return testing_util::MakeTestStream({Ids({{1}, {2, 2}}), Ids({{3}})});
    if (stem == "b") return testing_util::MakeTestStream({Ids({{4, 4}, {5}}, bad ? 1 : -1)});
    return testing_util::MakeTestStream({Ids({{6}}), Ids({{7, 7, 7}})});
  };
  Touch(data_.File("b.parquet"), "bb");
  Touch(data_.File("a.parquet"), "a");
  const std::vector<std::string> columns{"input_ids", "loss_mask", "labels"};
  Result<std::shared_ptr<const ArrowRows>> rows =
      arrow_internal::OpenArrowFiles("parquet:" + data_.path(), columns, r);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ArrowRowsInfo info = InfoOf(**rows);
  EXPECT_EQ(info.rows, 5);
  EXPECT_EQ(info.tokens, 1 + 2 + 1 + 2 + 1);
  EXPECT_EQ(info.batches, 3);
  const std::string where = "data source parquet:" + data_.path() + ": ";
  EXPECT_EQ((*rows)->batches[0].name, where + data_.File("a.parquet") + ", row group 0");
  EXPECT_EQ((*rows)->batches[1].name, where + data_.File("a.parquet") + ", row group 1");
  EXPECT_EQ((*rows)->batches[2].name, where + data_.File("b.parquet") + ", row group 0");
  // Only the columns asked for that the files have (not text, not attention_mask), sorted.
  EXPECT_EQ(decoded, (std::vector<std::vector<std::string>>{{"input_ids"}, {"input_ids"}}));
  // Mapped again from the cache: no second decode.
  ASSERT_TRUE(arrow_internal::OpenArrowFiles("parquet:" + data_.path(), columns, r).ok());
  EXPECT_EQ(decoded.size(), 2u);
  // A bad row is named by the spec, the file and its row group.
  bad = true;
  rows = arrow_internal::OpenArrowFiles("parquet:" + data_.path() + "/*.parquet", columns, r);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find("data source parquet:" + data_.path() +
                                         "/*.parquet: " + data_.File("b.parquet") +
                                         ", row group 0, row 1: column 'input_ids' is null"),
            std::string::npos)
      << rows.status().ToString();
  // Arrow files are read as they are, named by record batch; a spec of one file by the spec.
  Touch(data_.File("c.arrow"));
  rows = arrow_internal::OpenArrowFiles("arrow:" + data_.File("c.arrow"), columns, r);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(InfoOf(**rows).tokens, 4);
  EXPECT_EQ((*rows)->batches[1].name, "data source arrow:" + data_.File("c.arrow") +
                                          ", record batch 1");
}

}  // namespace
}  // namespace thdpack
