// Fields (thdpack/fields.h): a worked example by hand, the fused writer against the element-wise
// reference on random layouts, dtypes and shapes, the alignment rule against Pack's own tokens
// and labels, and the schema's errors.
#include "thdpack/fields.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "thdpack/shard.h"

namespace thdpack {
namespace {

std::vector<std::byte> Floats(const std::vector<float>& v) {
  std::vector<std::byte> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
std::vector<float> AsFloats(const std::vector<std::byte>& b) {
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}
template <typename T>
std::vector<std::byte> Bytes(std::span<const T> v) {
  std::vector<std::byte> b(v.size_bytes());
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
std::vector<std::span<const std::byte>> Views(const std::vector<std::vector<std::byte>>& v) {
  return {v.begin(), v.end()};
}

void ExpectInvalid(const Status& s, std::initializer_list<std::string> parts) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  for (const std::string& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.message();
  }
}

// docs/layout.md's example: lengths 7 and 3, CP = 2, padded 8 and 4 (chunks of 2 and 1).
// Rank 0 keeps positions [0,1,6,7 | 8,11], rank 1 [2,3,4,5 | 9,10]. Sample 0's values are j,
// sample 1's 100 + j; the fill -1.
TEST(FieldsTest, WorkedExampleByHand) {
  const float F = -1;
  PackOptions po;
  po.parallel = *ParallelLayout::Create(2);
  const std::vector<int64_t> lengths = {7, 3};
  Result<Layout> layout = ComputeLayout(lengths, po);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->cu_seqlens_padded, (std::vector<int32_t>{0, 8, 12}));
  const std::vector<std::vector<std::byte>> values = {Floats({0, 1, 2, 3, 4, 5, 6}),
                                                      Floats({100, 101, 102})};
  FieldSpec in{"x", FieldKind::kInput, FieldDtype::kFloat32, {}, F};
  FieldSpec tg{"y", FieldKind::kTarget, FieldDtype::kFloat32, {}, F};
  const std::vector<std::vector<float>> want_in = {{0, 1, 6, F, 100, F}, {2, 3, 4, 5, 101, 102}};
  // Position o holds value o + 1: the last real token and the padding hold the fill.
  const std::vector<std::vector<float>> want_tg = {{1, 2, F, F, 101, F}, {3, 4, 5, 6, 102, F}};
  for (int r = 0; r < 2; ++r) {
    std::vector<std::byte> out(6 * 4);
    ASSERT_TRUE(PackFieldShardInto(in, Views(values), *layout, 2, r, out).ok());
    EXPECT_EQ(AsFloats(out), want_in[static_cast<size_t>(r)]) << "input, rank " << r;
    ASSERT_TRUE(PackFieldShardInto(tg, Views(values), *layout, 2, r, out).ok());
    EXPECT_EQ(AsFloats(out), want_tg[static_cast<size_t>(r)]) << "target, rank " << r;
  }
  Result<std::vector<int32_t>> seq =
      ShardSequenceIndex(layout->cu_seqlens, layout->cu_seqlens_padded, 2, 0);
  ASSERT_TRUE(seq.ok());
  EXPECT_EQ(*seq, (std::vector<int32_t>{0, 0, 0, -1, 1, -1}));
  seq = ShardSequenceIndex(layout->cu_seqlens, layout->cu_seqlens_padded, 2, 1);
  ASSERT_TRUE(seq.ok());
  EXPECT_EQ(*seq, (std::vector<int32_t>{0, 0, 0, 0, 1, 1}));
}

FieldSpec RandomSpec(std::mt19937_64& rng, FieldKind kind) {
  const std::span<const FieldDtype> dtypes = AllFieldDtypes();
  FieldSpec f;
  f.name = "f";
  f.kind = kind;
  f.dtype = dtypes[rng() % dtypes.size()];
  if (rng() % 2) f.shape = {static_cast<int64_t>(1 + rng() % 4)};
  f.fill = f.dtype == FieldDtype::kBool ? static_cast<double>(rng() % 2)
                                        : static_cast<double>(rng() % 7);
  return f;
}

TEST(FieldsTest, FusedWriterMatchesTheReferenceOnRandomLayouts) {
  std::mt19937_64 rng(41);
  for (int trial = 0; trial < 300; ++trial) {
    const int cp = 1 << (rng() % 3), tp = 1 + static_cast<int>(rng() % 2);
    const bool sp = tp > 1 && rng() % 2;
    PackOptions po;
    po.parallel = *ParallelLayout::Create(cp, tp, sp, 1 + static_cast<int>(rng() % 3) * 4);
    const size_t n = 1 + rng() % 6;
    std::vector<int64_t> lengths;
    for (size_t i = 0; i < n; ++i) lengths.push_back(1 + static_cast<int64_t>(rng() % 40));
    Result<Layout> layout = ComputeLayout(lengths, po);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    const FieldSpec spec =
        RandomSpec(rng, rng() % 2 ? FieldKind::kInput : FieldKind::kTarget);
    ASSERT_TRUE(ValidateFieldSpecs(std::vector<FieldSpec>{spec}).ok());
    std::vector<std::vector<std::byte>> values;
    for (int64_t L : lengths) {
      std::vector<std::byte> v(static_cast<size_t>(L) * spec.row_bytes());
      for (std::byte& b : v) b = static_cast<std::byte>(rng() % 256);
      values.push_back(std::move(v));
    }
    const size_t local = static_cast<size_t>(layout->total_tokens / cp) * spec.row_bytes();
    for (int r = 0; r < cp; ++r) {
      std::vector<std::byte> fused(local, std::byte{0xAB});
      ASSERT_TRUE(PackFieldShardInto(spec, Views(values), *layout, cp, r, fused).ok());
      Result<std::vector<std::byte>> ref = PackFieldReference(spec, Views(values), *layout, cp, r);
      ASSERT_TRUE(ref.ok()) << ref.status().ToString();
      ASSERT_EQ(fused, *ref) << "trial " << trial << " " << spec.ToString() << " CP " << cp
                             << " rank " << r;
    }
  }
}

// The alignment rule is Pack's: an input field holding the tokens (fill pad_id) packs to the
// tokens, a target field holding them (fill kIgnoreIndex) to the labels, shard by shard.
TEST(FieldsTest, TokensAsFieldsPackToTokensAndLabels) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 100; ++trial) {
    const int cp = 1 << (rng() % 3);
    PackOptions po;
    po.parallel = *ParallelLayout::Create(cp);
    po.pad_id = 3;
    std::vector<Sample> samples(1 + rng() % 5);
    std::vector<std::vector<std::byte>> values;
    std::vector<SampleView> views;
    std::vector<int64_t> lengths;
    for (Sample& s : samples) {
      s.tokens.resize(1 + rng() % 30);
      for (TokenId& t : s.tokens) t = static_cast<TokenId>(rng() % 1000);
      values.push_back(Bytes(std::span<const TokenId>(s.tokens)));
      views.emplace_back(s);
      lengths.push_back(static_cast<int64_t>(s.tokens.size()));
    }
    Result<Layout> layout = ComputeLayout(lengths, po);
    ASSERT_TRUE(layout.ok());
    const FieldSpec in{"t", FieldKind::kInput, FieldDtype::kInt32, {}, 3};
    const FieldSpec tg{"l", FieldKind::kTarget, FieldDtype::kInt32, {}, kIgnoreIndex};
    const size_t local = static_cast<size_t>(layout->total_tokens / cp);
    for (int r = 0; r < cp; ++r) {
      std::vector<TokenId> tokens(local), labels(local);
      std::vector<int32_t> pos(local);
      std::vector<uint8_t> mask(local);
      ASSERT_TRUE(
          PackShardInto(views, *layout, po, r, PackBuffers{tokens, pos, labels, mask}).ok());
      std::vector<std::byte> a(local * 4), b(local * 4);
      ASSERT_TRUE(PackFieldShardInto(in, Views(values), *layout, cp, r, a).ok());
      ASSERT_TRUE(PackFieldShardInto(tg, Views(values), *layout, cp, r, b).ok());
      EXPECT_EQ(a, Bytes(std::span<const TokenId>(tokens)));
      EXPECT_EQ(b, Bytes(std::span<const TokenId>(labels)));
    }
    // Hugging Face's convention: the same shift as ToHfLabels (all-ones masks).
    const size_t T = static_cast<size_t>(layout->total_tokens);
    std::vector<TokenId> tokens(T), labels(T);
    std::vector<int32_t> pos(T);
    std::vector<uint8_t> mask(T);
    ASSERT_TRUE(PackInto(views, *layout, po, PackBuffers{tokens, pos, labels, mask}).ok());
    ASSERT_TRUE(ToHfLabels(labels, mask, layout->cu_seqlens_padded, labels, mask).ok());
    std::vector<std::byte> field(T * 4);
    ASSERT_TRUE(PackFieldShardInto(tg, Views(values), *layout, 1, 0, field).ok());
    ASSERT_TRUE(ToHfField(tg, field, layout->cu_seqlens_padded, field).ok());
    EXPECT_EQ(field, Bytes(std::span<const TokenId>(labels)));
  }
}

TEST(FieldsTest, SequenceIndexMatchesThePartitionIndices) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 100; ++trial) {
    const int cp = 1 << (rng() % 3);
    PackOptions po;
    po.parallel = *ParallelLayout::Create(cp);
    std::vector<int64_t> lengths(1 + rng() % 6);
    for (int64_t& L : lengths) L = 1 + static_cast<int64_t>(rng() % 50);
    Result<Layout> layout = ComputeLayout(lengths, po);
    ASSERT_TRUE(layout.ok());
    const auto& cu = layout->cu_seqlens;
    const auto& cup = layout->cu_seqlens_padded;
    for (int r = 0; r < cp; ++r) {
      Result<std::vector<int32_t>> idx = CpPartitionIndices(cup, cp, r);
      Result<std::vector<int32_t>> seq = ShardSequenceIndex(cu, cup, cp, r);
      ASSERT_TRUE(idx.ok() && seq.ok());
      ASSERT_EQ(idx->size(), seq->size());
      for (size_t k = 0; k < idx->size(); ++k) {
        const int32_t g = (*idx)[k];
        int32_t want = -1;
        for (size_t i = 0; i + 1 < cup.size(); ++i) {
          if (g >= cup[i] && g < cup[i + 1] && g - cup[i] < cu[i + 1] - cu[i]) {
            want = static_cast<int32_t>(i);
          }
        }
        ASSERT_EQ((*seq)[k], want) << "position " << k;
      }
    }
  }
  // Into a caller's buffer: its size is T/CP, checked before anything is written.
  std::vector<int32_t> out(5, 9);
  const std::vector<int32_t> cu = {0, 3, 5}, cup = {0, 4, 8};
  Status wrong = ShardSequenceIndexInto(cu, cup, 2, 0, out);
  EXPECT_NE(wrong.message().find("out has 5 elements: it must hold T/CP = 4"), std::string::npos)
      << wrong.ToString();
  EXPECT_EQ(out, std::vector<int32_t>(5, 9));
  out.assign(4, 9);
  ASSERT_TRUE(ShardSequenceIndexInto(cu, cup, 2, 1, out).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{0, 0, 1, -1}));  // chunks 1 and 2 of each sequence
}

TEST(FieldsTest, SchemaErrorsNameTheFieldAndTheRule) {
  auto spec = [](std::string name, FieldDtype d, double fill) {
    return FieldSpec{std::move(name), FieldKind::kTarget, d, {}, fill};
  };
  ExpectInvalid(ValidateFieldSpecs(std::vector<FieldSpec>{spec("", FieldDtype::kFloat32, 0)}),
                {"fields[0]", "empty"});
  ExpectInvalid(ValidateFieldSpecs(std::vector<FieldSpec>{spec("a", FieldDtype::kFloat32, 0),
                                                          spec("a", FieldDtype::kInt32, 0)}),
                {"fields[1] 'a'", "twice"});
  ExpectInvalid(ValidateFieldSpecs(std::vector<FieldSpec>{spec("labels", FieldDtype::kInt32, 0)}),
                {"'labels'", "own keys"});
  ExpectInvalid(ValidateFieldSpecs(std::vector<FieldSpec>{spec("m", FieldDtype::kBool, 2)}),
                {"'m'", "fill 2", "bool"});
  ExpectInvalid(ValidateFieldSpecs(std::vector<FieldSpec>{spec("i", FieldDtype::kInt32, 0.5)}),
                {"'i'", "int32"});
  ExpectInvalid(ValidateFieldSpecs(std::vector<FieldSpec>{spec("b", FieldDtype::kBFloat16, 0.1)}),
                {"'b'", "bfloat16"});
  EXPECT_TRUE(ValidateFieldSpecs(std::vector<FieldSpec>{spec("b", FieldDtype::kBFloat16, -2.5),
                                                        spec("u", FieldDtype::kUInt8, 255)})
                  .ok());
  FieldSpec wide{"w", FieldKind::kInput, FieldDtype::kFloat32, {4, 0}, 0};
  ExpectInvalid(ValidateFieldSpecs(std::vector<FieldSpec>{wide}), {"'w'", "dimension 0"});
  EXPECT_EQ(FieldSpec({"topk", FieldKind::kTarget, FieldDtype::kFloat32, {8}, 0}).ToString(),
            "topk (target float32 [L, 8])");
  EXPECT_EQ(FieldSpec({"uid", FieldKind::kSample, FieldDtype::kInt64, {}, 0}).ToString(),
            "uid (sample int64)");

  const std::vector<FieldSpec> schema = {{"adv", FieldKind::kTarget, FieldDtype::kFloat32, {}, 0},
                                         {"uid", FieldKind::kSample, FieldDtype::kInt64, {}, 0}};
  std::vector<std::vector<std::byte>> v = {std::vector<std::byte>(4 * 5),
                                           std::vector<std::byte>(8)};
  EXPECT_TRUE(CheckSampleFields(schema, v, 5, "sample 3").ok());
  ExpectInvalid(CheckSampleFields(schema, v, 6, "sample 3"),
                {"sample 3", "adv (target float32 [L])", "20 bytes, expected 24", "of its 6"});
  v.pop_back();
  ExpectInvalid(CheckSampleFields(schema, v, 5, "sample 3"), {"1 field buffers", "declares 2"});
  EXPECT_EQ(FieldBytes(schema, 5), 28);
  ExpectInvalid(ParseFieldKind("token").status(), {"'token'", "'input'"});
  ExpectInvalid(ParseFieldDtype("int16").status(), {"'int16'", "float16", "never cast"});
}

// The dtype table: names and widths as NumPy and torch spell them, each name parsed back.
TEST(FieldsTest, DtypeTableNamesAndWidths) {
  const std::vector<std::pair<std::string, size_t>> want = {
      {"float32", 4}, {"float64", 8}, {"bfloat16", 2}, {"int32", 4},
      {"int64", 8},   {"uint8", 1},   {"bool", 1},     {"float16", 2}};
  ASSERT_EQ(AllFieldDtypes().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const FieldDtype d = AllFieldDtypes()[i];
    EXPECT_EQ(FieldDtypeName(d), want[i].first);
    EXPECT_EQ(FieldDtypeSize(d), want[i].second) << want[i].first;
    auto back = ParseFieldDtype(want[i].first);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, d);
  }
}

// IEEE half, decoded by its definition (independent of the encoder under test).
double HalfValue(uint16_t h) {
  const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -24)
                                         : std::ldexp(1024 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}

// Every finite float16 value as a fill row gives its own bits back; values between two of them,
// past the largest (65504) or not finite are refused, naming the value and the dtype.
TEST(FieldsTest, Float16FillIsExactOrRefused) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if (((h >> 10) & 31) == 31) continue;  // inf, nan
    const double v = HalfValue(static_cast<uint16_t>(h));
    auto row = ValueRow(FieldDtype::kFloat16, 1, v);
    ASSERT_TRUE(row.ok()) << h << " " << v << " " << row.status().ToString();
    uint16_t got = 0;
    std::memcpy(&got, row->data(), 2);
    if (v == 0) {
      EXPECT_EQ(got & 0x7fff, 0) << h;
    } else {
      EXPECT_EQ(got, h) << v;
    }
    // Halfway to the next value up (of the same sign) is no float16 value (a sample of them:
    // each refusal writes its message).
    if ((h & 0x7fff) < 0x7bff && v != 0 && (h % 61 == 0 || (h & 0x7fff) < 0x0400)) {
      const double next = HalfValue(static_cast<uint16_t>(h + 1));
      EXPECT_FALSE(ValueRow(FieldDtype::kFloat16, 1, (v + next) / 2).ok()) << h;
    }
  }
  auto row = ValueRow(FieldDtype::kFloat16, 3, -2.5);
  ASSERT_TRUE(row.ok());
  ASSERT_EQ(row->size(), 6u);
  for (size_t k = 0; k < 6; k += 2) {
    uint16_t got = 0;
    std::memcpy(&got, row->data() + k, 2);
    EXPECT_EQ(got, 0xc100);
  }
  ExpectInvalid(ValueRow(FieldDtype::kFloat16, 1, 65536.0).status(), {"65536", "float16"});
  ExpectInvalid(ValueRow(FieldDtype::kFloat16, 1, 0.1).status(), {"0.1", "float16"});
  EXPECT_FALSE(ValueRow(FieldDtype::kFloat16, 1, INFINITY).ok());
  ExpectInvalid(ValueRow(FieldDtype::kInt64, 1, 0.5).status(), {"0.5", "int64"});
  EXPECT_FALSE(ValueRow(FieldDtype::kFloat32, 0, 0).ok());
}

// TruncateSample against the plain prefix of every buffer, on random samples and schemas.
TEST(FieldsTest, TruncateSampleKeepsThePlainPrefix) {
  std::mt19937_64 rng(99);
  const std::vector<FieldSpec> schema = {
      {"a", FieldKind::kTarget, FieldDtype::kFloat32, {}, 0},
      {"b", FieldKind::kInput, FieldDtype::kInt32, {3}, 0},
      {"c", FieldKind::kSample, FieldDtype::kInt64, {}, 0}};
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t length = 1 + static_cast<int64_t>(rng() % 40);
    Sample x;
    x.tokens.resize(static_cast<size_t>(length));
    for (auto& t : x.tokens) t = static_cast<TokenId>(rng() % 100);
    if (rng() % 2) {
      x.target_mask.resize(static_cast<size_t>(length));
      for (auto& m : x.target_mask) m = static_cast<uint8_t>(rng() % 2);
    }
    for (const FieldSpec& f : schema) {
      std::vector<std::byte> b(f.bytes_for(length));
      for (auto& v : b) v = static_cast<std::byte>(rng() % 256);
      x.fields.push_back(b);
    }
    const int64_t longest = 1 + static_cast<int64_t>(rng() % 45);
    Sample y = x;
    const int64_t lost = TruncateSample(y, schema, longest);
    const int64_t keep = std::min(length, longest);
    ASSERT_EQ(static_cast<int64_t>(y.tokens.size()), keep);
    EXPECT_TRUE(std::equal(y.tokens.begin(), y.tokens.end(), x.tokens.begin()));
    // Targets: position j >= 1 of the sample is a target when its mask is 1 (or no mask).
    auto targets = [](const Sample& s, int64_t upto) {
      int64_t n = 0;
      for (int64_t j = 1; j < upto; ++j) {
        n += s.target_mask.empty() ? 1 : s.target_mask[static_cast<size_t>(j)];
      }
      return n;
    };
    EXPECT_EQ(lost, targets(x, length) - targets(x, keep));
    EXPECT_EQ(y.target_mask.size(), x.target_mask.empty() ? 0u : static_cast<size_t>(keep));
    EXPECT_EQ(y.fields[0], std::vector<std::byte>(x.fields[0].begin(),
                                                  x.fields[0].begin() + 4 * keep));
    EXPECT_EQ(y.fields[1], std::vector<std::byte>(x.fields[1].begin(),
                                                  x.fields[1].begin() + 12 * keep));
    EXPECT_EQ(y.fields[2], x.fields[2]);  // a sample field is whole
  }
}

}  // namespace
}  // namespace thdpack
