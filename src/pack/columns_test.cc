// Samples from columns (thdpack/columns.h): the one-pass copy against the element-wise
// reference on random columns (token and mask dtypes, offsets that do not start at 0, per-token
// and sample fields of several dtypes and shapes), and each error
// named with its column and row.
#include "thdpack/columns.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace thdpack {
namespace {

template <typename T>
std::span<const std::byte> Bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

const std::vector<FieldSpec> kSpecs = {
    {"adv", FieldKind::kTarget, FieldDtype::kFloat32, {}, 0},
    {"emb", FieldKind::kInput, FieldDtype::kFloat64, {3}, 0},
    {"score", FieldKind::kSample, FieldDtype::kInt64, {2}, 0},
};

// Random columns of B rows: every buffer owned here, the views pointing into them.
struct Batch {
  std::vector<int64_t> tok64;
  std::vector<int32_t> tok32;
  std::vector<uint8_t> mask8;
  std::vector<int64_t> mask64;
  std::vector<int64_t> off64, fieldoff64;
  std::vector<float> adv;
  std::vector<double> emb;
  std::vector<int64_t> score;
  SampleColumns columns;
};

void MakeBatch(std::mt19937_64& rng, Batch& x) {
  const int b = static_cast<int>(rng() % 9);
  const int64_t skip = static_cast<int64_t>(rng() % 3);  // offsets that do not start at 0
  x.off64 = {skip};
  for (int i = 0; i < b; ++i) {
    x.off64.push_back(x.off64.back() + 1 + static_cast<int64_t>(rng() % 12));
  }
  const int64_t n = x.off64.back() + static_cast<int64_t>(rng() % 2);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = static_cast<int64_t>(rng() % 100000);
    x.tok64.push_back(t);
    x.tok32.push_back(static_cast<int32_t>(t));
    x.mask8.push_back(static_cast<uint8_t>(rng() % 2));
    x.mask64.push_back(x.mask8.back());
    x.adv.push_back(static_cast<float>(rng() % 1000) / 7.0f);
    for (int k = 0; k < 3; ++k) x.emb.push_back(static_cast<double>(rng() % 1000) / 3.0);
  }
  for (int i = 0; i < 2 * b; ++i) x.score.push_back(static_cast<int64_t>(rng()));
  SampleColumns& c = x.columns;
  const bool wide = rng() % 2;
  c.tokens.name = "input_ids";
  c.tokens.dtype = wide ? FieldDtype::kInt64 : FieldDtype::kInt32;
  c.tokens.values = wide ? Bytes(x.tok64) : Bytes(x.tok32);
  c.tokens.offsets = x.off64;
  c.has_mask = rng() % 3 != 0;
  c.mask.name = "loss_mask";
  c.mask.dtype = rng() % 2 ? FieldDtype::kUInt8 : FieldDtype::kInt64;
  c.mask.values = c.mask.dtype == FieldDtype::kUInt8 ? Bytes(x.mask8) : Bytes(x.mask64);
  c.fields = {{"score", FieldDtype::kInt64, {2}, Bytes(x.score), {}},
              {"adv", FieldDtype::kFloat32, {}, Bytes(x.adv), {}},
              {"emb", FieldDtype::kFloat64, {3}, Bytes(x.emb), {}}};
  c.fields[1].offsets = x.off64;
  c.fields[2].offsets = x.off64;
}

TEST(SamplesFromColumns, EqualsTheReferenceOnRandomColumns) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    Batch x;
    MakeBatch(rng, x);
    Result<std::vector<Sample>> got = SamplesFromColumns(x.columns, kSpecs, "batch");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(static_cast<int64_t>(got->size()), x.columns.rows());
    for (int64_t r = 0; r < x.columns.rows(); ++r) {
      const Sample want = SampleFromColumnsReference(x.columns, kSpecs, r);
      const Sample& s = (*got)[static_cast<size_t>(r)];
      EXPECT_EQ(s.tokens, want.tokens) << "trial " << trial << " row " << r;
      EXPECT_EQ(s.target_mask, want.target_mask);
      EXPECT_EQ(s.fields, want.fields);
      EXPECT_TRUE(CheckSampleFields(kSpecs, s.fields, static_cast<int64_t>(s.tokens.size()), "s")
                      .ok());
    }
  }
}

TEST(SamplesFromColumns, AWorkedExample) {
  // Two rows, [5, 6, 7] and [8]: offsets from 1 (row 0 of the values is not part of the batch).
  const std::vector<int64_t> tokens = {99, 5, 6, 7, 8}, off = {1, 4, 5};
  const std::vector<uint8_t> mask = {1, 0, 1, 1, 0};
  const std::vector<float> adv = {9, 1.5f, 2.5f, 3.5f, 4.5f};
  const std::vector<int64_t> score = {10, 11, 20, 21};
  SampleColumns c;
  c.tokens = {"input_ids", FieldDtype::kInt64, {}, Bytes(tokens), off};
  c.has_mask = true;
  c.mask = {"loss_mask", FieldDtype::kUInt8, {}, Bytes(mask), {}};
  c.fields = {{"adv", FieldDtype::kFloat32, {}, Bytes(adv), off},
              {"score", FieldDtype::kInt64, {2}, Bytes(score), {}}};
  const std::vector<FieldSpec> specs = {kSpecs[0], kSpecs[2]};
  Result<std::vector<Sample>> got = SamplesFromColumns(c, specs, "b");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_EQ((*got)[0].tokens, (std::vector<TokenId>{5, 6, 7}));
  EXPECT_EQ((*got)[0].target_mask, (std::vector<uint8_t>{0, 1, 1}));
  EXPECT_EQ((*got)[1].tokens, (std::vector<TokenId>{8}));
  float f[3];
  std::memcpy(f, (*got)[0].fields[0].data(), 12);
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[2], 3.5f);
  int64_t s[2];
  std::memcpy(s, (*got)[1].fields[1].data(), 16);
  EXPECT_EQ(s[0], 20);
  EXPECT_EQ(s[1], 21);
}

// The error of `columns` as text ("" when OK).
std::string ErrorOf(const SampleColumns& c, const std::vector<FieldSpec>& specs) {
  Result<std::vector<Sample>> got = SamplesFromColumns(c, specs, "batch");
  return got.ok() ? "" : got.status().ToString();
}

TEST(SamplesFromColumns, NamesEachBrokenRule) {
  const std::vector<int64_t> tokens = {1, 2, 3, -4}, off = {0, 2, 4}, bad_off = {0, 3, 2};
  const std::vector<int32_t> small = {1, 2, 3, 4};
  const std::vector<int64_t> mask = {1, 2, 0, 1};
  const std::vector<float> adv = {1, 2, 3};
  const std::vector<double> adv64 = {1, 2, 3, 4};
  const std::vector<FieldSpec> specs = {kSpecs[0]};
  const std::vector<int64_t> off3 = {0, 2, 3};
  SampleColumns c;
  c.tokens = {"input_ids", FieldDtype::kInt64, {}, Bytes(tokens), off};
  c.fields = {{"adv", FieldDtype::kFloat32, {}, Bytes(adv), off3}};
  EXPECT_NE(ErrorOf(c, specs).find("row 1, token 1: id -4 is outside [0, 2^31)"),
            std::string::npos) << ErrorOf(c, specs);
  c.tokens.values = Bytes(small);
  c.tokens.dtype = FieldDtype::kInt32;
  EXPECT_NE(ErrorOf(c, specs).find("row 1: field 'adv' has 1 rows, the row's 2 tokens"),
            std::string::npos) << ErrorOf(c, specs);
  c.fields[0] = {"adv", FieldDtype::kFloat64, {}, Bytes(adv64), off};
  EXPECT_NE(ErrorOf(c, specs).find("column 'adv' holds float64 rows of shape [], field 'adv' "
                                    "is declared float32"),
            std::string::npos) << ErrorOf(c, specs);
  c.fields[0].name = "other";
  EXPECT_NE(ErrorOf(c, specs).find("column 'other' is not a declared field (declared: 'adv')"),
            std::string::npos) << ErrorOf(c, specs);
  c.fields.clear();
  EXPECT_NE(ErrorOf(c, specs).find("declared field 'adv' has no column"), std::string::npos);
  c.has_mask = true;
  c.mask = {"loss_mask", FieldDtype::kInt64, {}, Bytes(mask), {}};
  EXPECT_NE(ErrorOf(c, {}).find("row 0, token 1: loss_mask value 2 is not 0 or 1"),
            std::string::npos) << ErrorOf(c, {});
  c.has_mask = false;
  c.tokens.offsets = bad_off;
  EXPECT_NE(ErrorOf(c, {}).find("offsets[2] = 2 < offsets[1] = 3"), std::string::npos);
  const std::vector<int64_t> past = {0, 2, 5};
  c.tokens.offsets = past;
  EXPECT_NE(ErrorOf(c, {}).find("offsets reach row 5, its values hold 4"), std::string::npos);
  const std::vector<int64_t> empty_row = {0, 0, 4};
  c.tokens.offsets = empty_row;
  EXPECT_NE(ErrorOf(c, {}).find("row 0: input_ids is empty"), std::string::npos);
  c.tokens.offsets = off;
  c.tokens.dtype = FieldDtype::kFloat32;
  EXPECT_NE(ErrorOf(c, {}).find("column 'input_ids' holds float32"), std::string::npos);
  c.tokens.dtype = FieldDtype::kInt32;
  const std::vector<int64_t> score = {1, 2, 3};
  const std::vector<FieldSpec> sample = {{"score", FieldKind::kSample, FieldDtype::kInt64, {}, 0}};
  c.fields = {{"score", FieldDtype::kInt64, {}, Bytes(score), {}}};
  EXPECT_NE(ErrorOf(c, sample).find("column 'score' holds 3 rows, one per sample needs 2"),
            std::string::npos) << ErrorOf(c, sample);
}

// Gather and scatter by runs against a plain loop over every mask entry: random [B, S] masks
// of every run shape (left and right padding, holes), a column window, rows of 1 to 8 bytes.
TEST(MaskRuns, GatherScatterAndClipEqualAnElementLoop) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t b = static_cast<int64_t>(rng() % 6), s = 1 + static_cast<int64_t>(rng() % 60);
    const int64_t col0 = static_cast<int64_t>(rng() % s), width = s - col0;
    const size_t rb = 1 + rng() % 8;
    std::vector<int64_t> mask(static_cast<size_t>(b * s));
    const int density = static_cast<int>(rng() % 5);
    for (auto& m : mask) m = density == 0 ? 1 : static_cast<int64_t>(rng() % (density + 1) != 0);
    if (density == 4) {  // verl's rows: left padding, the tokens, right padding
      for (int64_t r = 0; r < b; ++r) {
        const int64_t lo = static_cast<int64_t>(rng() % s);
        const int64_t hi = lo + static_cast<int64_t>(rng() % (s - lo + 1));
        for (int64_t c = 0; c < s; ++c) mask[static_cast<size_t>(r * s + c)] = c >= lo && c < hi;
      }
    }
    std::vector<std::byte> src(static_cast<size_t>(b * s) * rb);
    for (auto& x : src) x = static_cast<std::byte>(rng());
    const MaskRuns runs = RunsOfMask(mask.data(), b, s, col0, width);
    const MaskRuns clipped = ClipRuns(RunsOfMask(mask.data(), b, s, 0, s), col0, width);
    ASSERT_EQ(clipped.counts, runs.counts);
    ASSERT_EQ(clipped.row_runs, runs.row_runs);
    ASSERT_EQ(clipped.run_col, runs.run_col);
    ASSERT_EQ(clipped.run_len, runs.run_len);
    // The reference: every kept element in row-major order, rows starting at dst_start.
    std::vector<int64_t> start(static_cast<size_t>(b));
    int64_t total = 0;
    for (int64_t r = 0; r < b; ++r) {
      start[static_cast<size_t>(r)] = total + 1;  // a gap of one element between rows
      int64_t kept = 0;
      for (int64_t c = col0; c < s; ++c) kept += mask[static_cast<size_t>(r * s + c)] != 0;
      ASSERT_EQ(runs.counts[static_cast<size_t>(r)], kept);
      total += kept + 1;
    }
    std::vector<std::byte> want(static_cast<size_t>(total) * rb), got(want.size());
    for (int64_t r = 0; r < b; ++r) {
      int64_t at = start[static_cast<size_t>(r)];
      for (int64_t c = col0; c < s; ++c) {
        if (mask[static_cast<size_t>(r * s + c)] == 0) continue;
        for (size_t k = 0; k < rb; ++k) {
          want[static_cast<size_t>(at) * rb + k] =
              src[static_cast<size_t>(r * s + c) * rb + k];
        }
        ++at;
      }
    }
    if (b == 0) continue;  // no rows: nothing to move (and no buffer to point into)
    // src viewed from col0: the runs' columns are relative to it.
    GatherRuns(runs, src.data() + static_cast<size_t>(col0) * rb, s, rb, got.data(), start);
    ASSERT_EQ(got, want) << "trial " << trial;
    std::vector<std::byte> back(src.size(), std::byte{0}), back_want(src.size(), std::byte{0});
    ScatterRuns(runs, want.data(), start, rb, back.data() + static_cast<size_t>(col0) * rb, s);
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t c = col0; c < s; ++c) {
        if (mask[static_cast<size_t>(r * s + c)] == 0) continue;
        for (size_t k = 0; k < rb; ++k) {
          back_want[static_cast<size_t>(r * s + c) * rb + k] =
              src[static_cast<size_t>(r * s + c) * rb + k];
        }
      }
    }
    ASSERT_EQ(back, back_want) << "trial " << trial;
  }
}

}  // namespace
}  // namespace thdpack
