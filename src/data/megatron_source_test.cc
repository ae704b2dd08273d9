#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "data/data_test_util.h"
#include "thdpack/data.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::ReadBytes;
using testing_util::TempDir;
using testing_util::WriteBytes;

// A document given as its sequences.
using Doc = std::vector<std::vector<int64_t>>;

Status WriteDataset(const std::string& prefix, MegatronDType dtype, const std::vector<Doc>& docs) {
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<MegatronWriter> w, MegatronWriter::Create(prefix, dtype));
  for (const Doc& doc : docs) {
    for (const auto& seq : doc) THDPACK_RETURN_IF_ERROR(w->AddSequence(seq));
    THDPACK_RETURN_IF_ERROR(w->EndDocument());
  }
  return w->Finish();
}

const std::vector<Doc> kDocs = {
    {{1, 2, 3}},
    {{4}, {5, 6}, {7, 8, 9, 10}},
    {{11, 12}},
    {{}, {13}},  // an empty sequence inside a non-empty document is fine
};

std::vector<TokenId> Flatten(const Doc& doc) {
  std::vector<TokenId> out;
  for (const auto& seq : doc) {
    for (int64_t t : seq) out.push_back(static_cast<TokenId>(t));
  }
  return out;
}

// Reads the whole source; the first error, or OK.
Status Drain(SampleSource& source, int64_t* count = nullptr) {
  int64_t n = 0;
  while (true) {
    auto s = source.Next();
    if (!s.ok()) return s.status();
    if (!s->has_value()) break;
    ++n;
  }
  if (count != nullptr) *count = n;
  return Status::Ok();
}

uint64_t Load64(const std::vector<uint8_t>& b, size_t at) {
  uint64_t v;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

TEST(MegatronWriterTest, WritesThePublishedLayout) {
  TempDir dir;
  const std::string prefix = dir.File("ds");
  ASSERT_TRUE(WriteDataset(prefix, MegatronDType::kUint16, kDocs).ok());
  const auto idx = ReadBytes(prefix + ".idx");
  const auto bin = ReadBytes(prefix + ".bin");
  const size_t seqs = 7, docs = 5;
  ASSERT_EQ(idx.size(), 34 + seqs * 12 + docs * 8);
  EXPECT_EQ(std::memcmp(idx.data(), "MMIDIDX\0\0", 9), 0);
  EXPECT_EQ(Load64(idx, 9), 1u);
  EXPECT_EQ(idx[17], 8);  // uint16
  EXPECT_EQ(Load64(idx, 18), seqs);
  EXPECT_EQ(Load64(idx, 26), docs);
  int32_t len3;
  std::memcpy(&len3, idx.data() + 34 + 3 * 4, 4);
  EXPECT_EQ(len3, 4);  // sequence 3 is {7, 8, 9, 10}
  EXPECT_EQ(Load64(idx, 34 + seqs * 4 + 3 * 8), 12u);  // pointer: 6 tokens before it, 2 bytes each
  EXPECT_EQ(Load64(idx, 34 + seqs * 12 + 2 * 8), 4u);  // document 2 starts at sequence 4
  EXPECT_EQ(Load64(idx, 34 + seqs * 12 + 4 * 8), seqs);
  ASSERT_EQ(bin.size(), 13u * 2);
  EXPECT_EQ(bin[0], 1);
  EXPECT_EQ(bin[1], 0);
  EXPECT_EQ(bin[24], 13);

  auto w = MegatronWriter::Create(dir.File("w"), MegatronDType::kUint8);
  ASSERT_TRUE(w.ok());
  const std::vector<int64_t> too_big = {1, 256};
  auto s = (*w)->AddSequence(too_big);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), "position 1: value 256 is not representable in uint8"));
  ASSERT_TRUE((*w)->AddSequence(std::vector<int64_t>{1}).ok());
  EXPECT_FALSE((*w)->Finish().ok());  // a sequence outside any document
  EXPECT_EQ(MegatronBestDType(32000), MegatronDType::kUint16);
  EXPECT_EQ(MegatronBestDType(128256), MegatronDType::kInt32);
}

TEST(MegatronSourceTest, RoundTripsEveryDtype) {
  TempDir dir;
  for (uint8_t code = 1; code <= 8; ++code) {
    const std::string prefix = dir.File("ds" + std::to_string(code));
    ASSERT_TRUE(WriteDataset(prefix, static_cast<MegatronDType>(code), kDocs).ok());
    auto s = OpenSource("megatron:" + prefix);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ((*s)->size_hint(), 4);
    for (size_t d = 0; d < kDocs.size(); ++d) {
      auto sample = (*s)->Next();
      ASSERT_TRUE(sample.ok()) << sample.status().ToString();
      ASSERT_TRUE(sample->has_value());
      EXPECT_EQ((*sample)->id, static_cast<int64_t>(d));
      EXPECT_EQ((*sample)->tokens, Flatten(kDocs[d])) << "dtype " << MegatronDTypeName(code);
      EXPECT_TRUE((*sample)->target_mask.empty());
    }
    auto end = (*s)->Next();
    ASSERT_TRUE(end.ok());
    EXPECT_FALSE(end->has_value());
    ASSERT_TRUE((*s)->Reset().ok());
    auto l = (*s)->NextLength();
    ASSERT_TRUE(l.ok());
    EXPECT_EQ((*l)->id, 4);
    EXPECT_EQ((*l)->length, 3);
    l = (*s)->NextLength();
    EXPECT_EQ((*l)->length, 7);
    EXPECT_EQ((*l)->n_targets, 6);
  }
}

TEST(MegatronSourceTest, TokenValuesAreChecked) {
  TempDir dir;
  struct Case {
    MegatronDType dtype;
    std::vector<int64_t> tokens;
    int64_t vocab;
    const char* what;
  };
  const Case cases[] = {
      {MegatronDType::kInt16, {1, 2, -7}, 0, "position 3 (sequence 2, byte offset 8, dtype int16): token value -7 is negative"},
      {MegatronDType::kInt64, {int64_t{1} << 31}, 0, "token value 2147483648 is outside [0, 2147483648)"},
      {MegatronDType::kUint16, {5, 60000}, 1000, "position 2 (sequence 2, byte offset 6, dtype uint16): token value 60000 is outside [0, 1000) (vocabulary size 1000)"},
      {MegatronDType::kFloat32, {3, -1}, 0, "token value -1 is negative"},
  };
  for (const Case& c : cases) {
    const std::string prefix = dir.File("t");
    ASSERT_TRUE(WriteDataset(prefix, c.dtype, {{{9}}, {{1}, c.tokens}}).ok());
    SourceOptions options;
    options.vocab_size = c.vocab;
    auto s = OpenSource("megatron:" + prefix, options);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto first = (*s)->Next();
    ASSERT_TRUE(first.ok());
    auto bad = (*s)->Next();
    ASSERT_FALSE(bad.ok());
    EXPECT_TRUE(Contains(bad.status().message(), prefix + ".bin: document 1, ")) << bad.status().message();
    EXPECT_TRUE(Contains(bad.status().message(), c.what)) << bad.status().message();
  }
  // A non-integral float, written by patching the .bin of a float64 dataset.
  const std::string prefix = dir.File("f");
  ASSERT_TRUE(WriteDataset(prefix, MegatronDType::kFloat64, {{{1, 2}}}).ok());
  auto bin = ReadBytes(prefix + ".bin");
  const double half = 2.5;
  std::memcpy(bin.data() + 8, &half, 8);
  WriteBytes(prefix + ".bin", bin);
  auto s = OpenSource("megatron:" + prefix);
  ASSERT_TRUE(s.ok());
  auto bad = (*s)->Next();
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(bad.status().message(), "document 0, position 1")) << bad.status().message();
  EXPECT_TRUE(Contains(bad.status().message(), "token value 2.5 is not an integer"));
  // NextLength does not read tokens, so it does not see the bad value.
  auto t = OpenSource("megatron:" + prefix);
  ASSERT_TRUE(t.ok());
  auto l = (*t)->NextLength();
  ASSERT_TRUE(l.ok());
  EXPECT_EQ((*l)->length, 2);
}

TEST(MegatronSourceTest, StructuralErrors) {
  TempDir dir;
  const std::string prefix = dir.File("s");
  // Only empty documents: nothing to read (a document with no tokens alone is read: below).
  ASSERT_TRUE(WriteDataset(prefix, MegatronDType::kInt32, {{{}}, {}}).ok());
  auto all_empty = OpenSource("megatron:" + prefix);
  ASSERT_FALSE(all_empty.ok());
  EXPECT_TRUE(Contains(all_empty.status().message(), "every one of its 2 documents is empty"))
      << all_empty.status().message();
  // No documents at all.
  ASSERT_TRUE(WriteDataset(prefix, MegatronDType::kInt32, {}).ok());
  auto none = OpenSource("megatron:" + prefix);
  ASSERT_FALSE(none.ok());
  EXPECT_TRUE(Contains(none.status().message(), "holds no documents"));
  // Missing files.
  auto missing = OpenSource("megatron:" + dir.File("nothing"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
  EXPECT_TRUE(Contains(missing.status().message(), "nothing.idx"));
  // Sequence modes (multimodal datasets) after the arrays are accepted; other extra bytes not.
  ASSERT_TRUE(WriteDataset(prefix, MegatronDType::kInt32, kDocs).ok());
  auto idx = ReadBytes(prefix + ".idx");
  auto with_modes = idx;
  with_modes.resize(idx.size() + 7, 0);  // one int8 mode per sequence
  WriteBytes(prefix + ".idx", with_modes);
  auto ok = OpenSource("megatron:" + prefix);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(Drain(**ok).ok());
  with_modes.push_back(0);
  WriteBytes(prefix + ".idx", with_modes);
  auto extra = OpenSource("megatron:" + prefix);
  ASSERT_FALSE(extra.ok());
  EXPECT_TRUE(Contains(extra.status().message(), "trailing or missing bytes"));
  // A .bin longer than the index says (a mismatched pair).
  WriteBytes(prefix + ".idx", idx);
  auto bin = ReadBytes(prefix + ".bin");
  bin.push_back(0);
  WriteBytes(prefix + ".bin", bin);
  auto longer = OpenSource("megatron:" + prefix);
  ASSERT_FALSE(longer.ok());
  EXPECT_TRUE(Contains(longer.status().message(), "mismatched or truncated"));
}

// Every truncation of either file is a clean error at open.
TEST(MegatronSourceTest, TruncatedFilesAreRejectedAtEveryOffset) {
  TempDir dir;
  const std::string good = dir.File("good");
  ASSERT_TRUE(WriteDataset(good, MegatronDType::kInt32, kDocs).ok());
  const auto idx = ReadBytes(good + ".idx");
  const auto bin = ReadBytes(good + ".bin");
  const std::string cut = dir.File("cut");
  WriteBytes(cut + ".bin", bin);
  for (size_t n = 0; n < idx.size(); ++n) {
    WriteBytes(cut + ".idx", idx, n);
    auto s = OpenSource("megatron:" + cut);
    ASSERT_FALSE(s.ok()) << "idx cut at " << n;
    EXPECT_EQ(s.status().code(), StatusCode::kCorruption) << s.status().ToString();
    EXPECT_TRUE(Contains(s.status().message(), cut + ".idx")) << s.status().message();
  }
  WriteBytes(cut + ".idx", idx);
  for (size_t n = 0; n < bin.size(); ++n) {
    WriteBytes(cut + ".bin", bin, n);
    auto s = OpenSource("megatron:" + cut);
    ASSERT_FALSE(s.ok()) << "bin cut at " << n;
    EXPECT_EQ(s.status().code(), StatusCode::kCorruption) << s.status().ToString();
  }
}

// Every single-byte flip of the index (header, counts, lengths, pointers, document indices) is
// detected at open, with the byte offset of the broken field - except the flips of
// document_indices that leave it non-decreasing: those describe empty documents, which the
// format allows (Megatron writes them), so the index is valid and reads as such.
TEST(MegatronSourceTest, EveryFlippedIndexByteIsDetected) {
  TempDir dir;
  const std::string good = dir.File("good");
  ASSERT_TRUE(WriteDataset(good, MegatronDType::kUint16, kDocs).ok());
  const auto idx = ReadBytes(good + ".idx");
  const std::string bad = dir.File("bad");
  WriteBytes(bad + ".bin", ReadBytes(good + ".bin"));
  for (size_t at = 0; at < idx.size(); ++at) {
    for (uint8_t mask : {uint8_t{0xFF}, uint8_t{0x01}, uint8_t{0x80}}) {
      auto flipped = idx;
      flipped[at] ^= mask;
      WriteBytes(bad + ".idx", flipped);
      auto s = OpenSource("megatron:" + bad);
      const size_t documents_at = 34 + 7 * 12;
      if (s.ok() && at >= documents_at + 8 && at < documents_at + 4 * 8) {
        int64_t n = 0;
        ASSERT_TRUE(Drain(**s, &n).ok());
        EXPECT_GT((*s)->skipped_empty(), 0) << "byte " << at << " ^ " << int(mask);
        EXPECT_EQ(n + (*s)->skipped_empty(), 4);
        continue;
      }
      ASSERT_FALSE(s.ok()) << "byte " << at << " ^ " << int(mask);
      EXPECT_TRUE(s.status().code() == StatusCode::kCorruption ||
                  s.status().code() == StatusCode::kInvalidArgument ||
                  s.status().code() == StatusCode::kOutOfRange)
          << s.status().ToString();
    }
  }
  // The header fields name their offsets.
  auto flipped = idx;
  flipped[9] = 2;
  WriteBytes(bad + ".idx", flipped);
  auto v = OpenSource("megatron:" + bad);
  ASSERT_FALSE(v.ok());
  EXPECT_TRUE(Contains(v.status().message(), "byte offset 9: unsupported version 2"));
  flipped = idx;
  flipped[17] = 0;
  WriteBytes(bad + ".idx", flipped);
  auto d = OpenSource("megatron:" + bad);
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(Contains(d.status().message(), "byte offset 17: unknown dtype code 0"));
  flipped = idx;
  flipped[25] = 0x10;  // sequence_count's top byte: an absurd count
  WriteBytes(bad + ".idx", flipped);
  auto c = OpenSource("megatron:" + bad);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(Contains(c.status().message(), "byte offset 18: header counts"));
  flipped = idx;
  flipped[34 + 7 * 4 + 8] ^= 0x02;  // sequence_pointers[1]: 6 -> 4
  WriteBytes(bad + ".idx", flipped);
  auto p = OpenSource("megatron:" + bad);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(Contains(p.status().message(), "byte offset 70: sequence_pointers[1] = 4, expected 6"))
      << p.status().message();
}

// Random multi-byte damage to both files, for integer and float dtypes: every outcome is a
// clean error or valid samples.
TEST(MegatronSourceTest, RandomCorruptionNeverCrashes) {
  TempDir dir;
  std::mt19937_64 rng(11);
  for (MegatronDType dtype : {MegatronDType::kInt16, MegatronDType::kInt64,
                              MegatronDType::kFloat32, MegatronDType::kFloat64}) {
    const std::string good = dir.File("good");
    ASSERT_TRUE(WriteDataset(good, dtype, kDocs).ok());
    const auto idx = ReadBytes(good + ".idx");
    const auto bin = ReadBytes(good + ".bin");
    const std::string bad = dir.File("bad");
    int opened = 0;
    for (int iter = 0; iter < 150; ++iter) {
      auto i2 = idx;
      auto b2 = bin;
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < flips; ++f) {
        if (rng() % 2) {
          i2[rng() % i2.size()] = static_cast<uint8_t>(rng());
        } else {
          b2[rng() % b2.size()] = static_cast<uint8_t>(rng());
        }
      }
      WriteBytes(bad + ".idx", i2);
      WriteBytes(bad + ".bin", b2);
      SourceOptions options;
      options.vocab_size = 1000;
      auto s = OpenSource("megatron:" + bad, options);
      if (!s.ok()) continue;
      ++opened;
      int64_t n = 0;
      const Status st = Drain(**s, &n);
      if (st.ok()) {
        // A damaged document index can describe empty documents (which are valid): every
        // document is then a sample or counted as empty.
        EXPECT_EQ(n + (*s)->skipped_empty(), 4);
      } else {
        EXPECT_TRUE(Contains(st.message(), bad + ".bin: document ")) << st.message();
      }
    }
    EXPECT_GT(opened, 0) << MegatronDTypeName(static_cast<uint8_t>(dtype));
  }
}

// Megatron's preprocess_data.py writes an empty document (add_document([], []): document_indices
// repeats a value) for a text that tokenizes to nothing, and Megatron reads such a dataset. So
// does this reader: an empty document (no sequence, or only empty sequences) is passed over,
// keeps its document index as the id it uses up, and is counted; every epoch alike.
TEST(MegatronSourceTest, EmptyDocumentsArePassedOverAndCounted) {
  TempDir dir;
  const std::string prefix = dir.File("e");
  // Documents 0 and 3 have no sequence, 2 only empty ones, 5 is last and empty.
  const std::vector<Doc> docs = {{}, {{1, 2}}, {{}, {}}, {}, {{3}, {}, {4, 5}}, {}};
  ASSERT_TRUE(WriteDataset(prefix, MegatronDType::kUint16, docs).ok());
  const auto idx = ReadBytes(prefix + ".idx");
  EXPECT_EQ(Load64(idx, 26), 7u);  // document_indices: 0, 0, 1, 3, 3, 6, 6
  EXPECT_EQ(Load64(idx, 34 + 6 * 12 + 8), 0u);
  EXPECT_EQ(Load64(idx, 34 + 6 * 12 + 6 * 8), 6u);
  auto s = OpenSource("megatron:" + prefix);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->size_hint(), 2);  // samples per epoch
  for (int epoch = 0; epoch < 2; ++epoch) {
    auto a = (*s)->Next();
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ((*a)->id, 6 * epoch + 1);
    EXPECT_EQ((*a)->tokens, (std::vector<TokenId>{1, 2}));
    EXPECT_EQ((*s)->skipped_empty(), 4 * epoch + 1);
    auto b = (*s)->NextLength();
    ASSERT_TRUE(b.ok());
    EXPECT_EQ((*b)->id, 6 * epoch + 4);
    EXPECT_EQ((*b)->length, 3);
    EXPECT_EQ((*s)->skipped_empty(), 4 * epoch + 3);
    auto end = (*s)->Next();
    ASSERT_TRUE(end.ok());
    EXPECT_FALSE(end->has_value());
    EXPECT_EQ((*s)->skipped_empty(), 4 * epoch + 4);
    ASSERT_TRUE((*s)->Reset().ok());
  }
  // Shuffled: the same two samples per epoch, each with the id of its place in the order.
  SourceOptions options;
  options.shuffle = true;
  auto shuffled = OpenSource("megatron:" + prefix, options);
  ASSERT_TRUE(shuffled.ok());
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::vector<std::vector<TokenId>> got;
    while (true) {
      auto x = (*shuffled)->Next();
      ASSERT_TRUE(x.ok());
      if (!x->has_value()) break;
      EXPECT_GE((*x)->id, 6 * epoch);
      EXPECT_LT((*x)->id, 6 * epoch + 6);
      got.push_back((*x)->tokens);
    }
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, (std::vector<std::vector<TokenId>>{{1, 2}, {3, 4, 5}}));
    EXPECT_EQ((*shuffled)->skipped_empty(), 4 * (epoch + 1));
    ASSERT_TRUE((*shuffled)->Reset().ok());
  }
}

TEST(MegatronSourceTest, ShuffleVisitsEveryDocumentOnce) {
  TempDir dir;
  const std::string prefix = dir.File("sh");
  std::vector<Doc> docs;
  for (int64_t d = 0; d < 100; ++d) docs.push_back({{d}});
  ASSERT_TRUE(WriteDataset(prefix, MegatronDType::kUint16, docs).ok());
  SourceOptions options;
  options.shuffle = true;
  auto s = OpenSource("megatron:" + prefix, options);
  ASSERT_TRUE(s.ok());
  std::vector<int> seen(100, 0);
  bool in_order = true;
  for (int i = 0; i < 100; ++i) {
    auto sample = (*s)->Next();
    ASSERT_TRUE(sample.ok());
    ASSERT_TRUE(sample->has_value());
    EXPECT_EQ((*sample)->id, i);
    const TokenId doc = (*sample)->tokens.at(0);
    ++seen.at(static_cast<size_t>(doc));
    in_order = in_order && doc == i;
  }
  EXPECT_FALSE(in_order);
  for (int c : seen) EXPECT_EQ(c, 1);
}

}  // namespace
}  // namespace thdpack
