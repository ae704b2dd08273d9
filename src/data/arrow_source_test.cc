// Columnar sources (thdpack/arrow.h): record batches from a producer that follows the Arrow C
// stream interface's ownership rules (arrow_test_util.h), read back sample by sample against
// the rows they were made from - every integer width, list and large_list, sliced arrays, a
// bool-bit or integer loss_mask, Hugging Face labels - and each bad input named.
#include "thdpack/arrow.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "data/arrow_test_util.h"

namespace thdpack {
namespace {

using testing_util::MakeTestStream;
using testing_util::TestBatch;
using testing_util::TestListColumn;

struct Row {
  std::vector<int64_t> tokens;
  std::vector<int64_t> targets;  // 0/1 per token
};

// A column of `rows` (each its values), `before` rows of filler in front (a slice).
TestListColumn Column(const std::string& name, const std::string& format, bool large,
                      const std::vector<std::vector<int64_t>>& rows, int64_t before,
                      int64_t list_offset) {
  TestListColumn c{name, format, large, {0}, {}, {}, {}, list_offset};
  for (int64_t k = 0; k < before + list_offset; ++k) {  // filler rows: one value each
    c.values.push_back(1);
    c.offsets.push_back(static_cast<int64_t>(c.values.size()));
  }
  for (const auto& r : rows) {
    c.values.insert(c.values.end(), r.begin(), r.end());
    c.offsets.push_back(static_cast<int64_t>(c.values.size()));
  }
  return c;
}

TEST(ArrowSource, ReadsEveryRowAsItWasWritten) {
  std::mt19937_64 rng(5);
  const std::vector<std::string> id_formats = {"i", "l", "S", "C", "I", "s"};
  for (int trial = 0; trial < 60; ++trial) {
    const std::string ids_format = id_formats[rng() % id_formats.size()];
    const int64_t vocab = ids_format == "C" ? 256 : 30000;
    const int targets = static_cast<int>(rng() % 4);  // none, bool mask, int8 mask, labels
    // The schema is the stream's: one list type a column for every batch.
    const bool ids_large = rng() % 2 == 0, mask_large = rng() % 2 == 0;
    std::vector<Row> all;
    std::vector<TestBatch> batches;
    const int nb = 1 + static_cast<int>(rng() % 3);
    for (int b = 0; b < nb; ++b) {
      const int64_t rows = static_cast<int64_t>(rng() % 6);
      const int64_t before = static_cast<int64_t>(rng() % 3);
      std::vector<std::vector<int64_t>> ids, mask, labels;
      for (int64_t r = 0; r < rows; ++r) {
        Row row;
        const int64_t n = 1 + static_cast<int64_t>(rng() % 12);
        std::vector<int64_t> m, l;
        for (int64_t j = 0; j < n; ++j) {
          row.tokens.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab)));
          const int64_t t = static_cast<int64_t>(rng() % 2);
          row.targets.push_back(t);
          m.push_back(t);
          l.push_back(t ? row.tokens.back() : -100);
        }
        ids.push_back(row.tokens);
        mask.push_back(m);
        labels.push_back(l);
        all.push_back(row);
      }
      TestBatch batch{rows, before, {}, {}};
      batch.columns.push_back(Column("other", "l", false, ids, before, 0));  // ignored
      batch.columns.push_back(Column("input_ids", ids_format, ids_large, ids, before,
                                     static_cast<int64_t>(rng() % 3)));
      if (targets == 1 || targets == 2) {
        batch.columns.push_back(Column("loss_mask", targets == 1 ? "b" : "c", mask_large, mask,
                                       before, static_cast<int64_t>(rng() % 2)));
      } else if (targets == 3) {
        batch.columns.push_back(Column("labels", "l", mask_large, labels, before, 0));
      }
      batches.push_back(batch);
    }
    ArrowArrayStream stream = MakeTestStream(batches);
    auto rows = ImportArrowStream(&stream, "test");
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    EXPECT_EQ(stream.release, nullptr);  // released by the import
    const ArrowRowsInfo info = InfoOf(**rows);
    ASSERT_EQ(info.rows, static_cast<int64_t>(all.size()));
    EXPECT_EQ(info.batches, nb);
    if (all.empty()) continue;
    const std::string spec = "arrow:@trial" + std::to_string(trial);
    RegisterArrowRows(spec, *rows);
    auto source = OpenSource(spec);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    for (size_t k = 0; k < all.size(); ++k) {
      auto s = (*source)->Next();
      ASSERT_TRUE(s.ok() && s->has_value()) << s.status().ToString();
      const Sample& x = **s;
      std::vector<int64_t> tokens(x.tokens.begin(), x.tokens.end());
      EXPECT_EQ(tokens, all[k].tokens) << "trial " << trial << " row " << k;
      if (targets == 0) {
        EXPECT_TRUE(x.target_mask.empty());
      } else {
        std::vector<int64_t> mask(x.target_mask.begin(), x.target_mask.end());
        EXPECT_EQ(mask, all[k].targets) << "trial " << trial << " row " << k;
      }
    }
    auto end = (*source)->Next();
    ASSERT_TRUE(end.ok() && !end->has_value());
    // NextLengths gives each row's length and targets as Next's samples count them.
    auto again = OpenSource(spec);
    std::vector<SampleLength> lengths(all.size() + 3);
    auto n = (*again)->NextLengths(lengths);
    ASSERT_TRUE(n.ok() && *n == static_cast<int64_t>(all.size()));
    for (size_t k = 0; k < all.size(); ++k) {
      Sample s;
      s.tokens.assign(all[k].tokens.begin(), all[k].tokens.end());
      if (targets) s.target_mask.assign(all[k].targets.begin(), all[k].targets.end());
      EXPECT_EQ(lengths[k].length, static_cast<int64_t>(all[k].tokens.size()));
      EXPECT_EQ(lengths[k].n_targets, NumTargets(s)) << "trial " << trial << " row " << k;
    }
  }
}

// The import's error for `batches`, "" when it succeeds.
std::string ImportError(std::vector<TestBatch> batches, int64_t fail_at = -1) {
  ArrowArrayStream stream = MakeTestStream(std::move(batches), fail_at);
  auto rows = ImportArrowStream(&stream, "data.parquet");
  EXPECT_EQ(stream.release, nullptr);
  return rows.ok() ? "" : rows.status().ToString();
}

// A reading error: the first sample that fails, "" when every one reads.
std::string ReadError(std::vector<TestBatch> batches, const std::string& spec) {
  ArrowArrayStream stream = MakeTestStream(std::move(batches));
  auto rows = ImportArrowStream(&stream, spec);
  if (!rows.ok()) return rows.status().ToString();
  RegisterArrowRows(spec, *rows);
  auto source = OpenSource(spec);
  if (!source.ok()) return source.status().ToString();
  while (true) {
    auto s = (*source)->Next();
    if (!s.ok()) return s.status().ToString();
    if (!s->has_value()) return "";
  }
}

TEST(ArrowSource, NamesEveryBadInput) {
  const std::vector<std::vector<int64_t>> ids = {{1, 2, 3}, {4, 5}};
  auto batch = [&](std::vector<TestListColumn> cols) { return TestBatch{2, 0, cols, {}}; };
  const TestListColumn good = Column("input_ids", "i", false, ids, 0, 0);
  auto has = [](const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  };
  std::string e = ImportError({batch({Column("tokens", "i", false, ids, 0, 0)})});
  EXPECT_TRUE(has(e, "data.parquet: no column 'input_ids' (the columns: 'tokens')")) << e;
  e = ImportError({batch({Column("input_ids", "f", false, ids, 0, 0)})});
  EXPECT_TRUE(has(e, "column 'input_ids' holds values of Arrow type 'f' (float32); expected an "
                     "integer type"))
      << e;
  e = ImportError({batch({good, Column("loss_mask", "b", false, ids, 0, 0),
                          Column("labels", "l", false, ids, 0, 0)})});
  EXPECT_TRUE(has(e, "columns 'loss_mask' and 'labels' both given")) << e;
  TestListColumn nulls = good;
  nulls.null_rows = {false, true};
  e = ImportError({batch({nulls})});
  EXPECT_TRUE(has(e, "record batch 0, row 1: column 'input_ids' is null")) << e;
  TestListColumn null_value = good;
  null_value.null_values = {false, false, false, false, true};
  e = ImportError({batch({null_value})});
  EXPECT_TRUE(has(e, "record batch 0, row 1: column 'input_ids' holds a null at position 1"))
      << e;
  TestListColumn bad_offsets = good;
  bad_offsets.offsets = {0, 4, 3};
  e = ImportError({batch({bad_offsets})});
  EXPECT_TRUE(has(e, "row 1: column 'input_ids' has offsets 4..3")) << e;
  e = ImportError({batch({Column("input_ids", "i", false, {{1}, {}}, 0, 0)})});
  EXPECT_TRUE(has(e, "record batch 0, row 1 (row 1 of the data): input_ids is empty")) << e;
  e = ImportError({batch({good, Column("loss_mask", "C", false, {{1, 1, 1}, {1}}, 0, 0)})});
  EXPECT_TRUE(has(e, "row 1: column 'loss_mask' has 1 values, input_ids 2")) << e;
  e = ImportError({batch({good}), batch({good})}, 1);
  EXPECT_TRUE(has(e, "reading record batch 1: the producer's disk went away")) << e;
  TestBatch null_struct = batch({good});
  null_struct.null_rows = {false, true};
  e = ImportError({null_struct});
  EXPECT_TRUE(has(e, "record batch 0, row 1: the row is null")) << e;
  // Reading: a token out of range, a mask value, a label that is not its token.
  e = ReadError({batch({Column("input_ids", "l", false, {{1, 2}, {3, -4}}, 0, 0)})},
                "arrow:@bad_token");
  EXPECT_TRUE(has(e, "arrow:@bad_token, record batch 0, row 1 (row 1 of the data), column "
                     "'input_ids', token 1: id -4 is outside [0, 2147483648)")) << e;
  e = ReadError({batch({good, Column("loss_mask", "c", false, {{0, 1, 2}, {0, 1}}, 0, 0)})},
                "arrow:@bad_mask");
  EXPECT_TRUE(has(e, "row 0 (row 0 of the data), column 'loss_mask', token 2: value 2 is not "
                     "0 or 1")) << e;
  e = ReadError({batch({good, Column("labels", "l", false, {{-100, 2, 3}, {-100, 7}}, 0, 0)})},
                "arrow:@bad_labels");
  EXPECT_TRUE(has(e, "column 'labels', token 1: label 7 is neither -100 nor the token (5)")) << e;
  // Opening: a name never registered, a file spec in a process without readers.
  auto missing = OpenSource("arrow:@never");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(has(missing.status().ToString(), "no Arrow data of that name in this process"));
  auto file = OpenSource("parquet:/data/train.parquet");
  ASSERT_FALSE(file.ok());
  EXPECT_TRUE(has(file.status().ToString(), "read them from Python (thdpack with pyarrow"))
      << file.status().ToString();
}

}  // namespace
}  // namespace thdpack
