// Resuming a source (SampleSource::cursor, Seek, CursorAfter, CursorAtEpoch, Identity) against
// the plain reference - a fresh source read sample by sample from its opening, Reset at every
// end - for every source kind, shuffled and not, with and without empty documents, on fresh
// random data and positions: the cursor computed equals the cursor reached by reading, and a
// source moved there continues with the same samples (ids, tokens, masks) as the one that read.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "data/data_internal.h"
#include "data/data_test_util.h"
#include "thdpack/data.h"
#include "data/arrow_test_util.h"
#include "thdpack/arrow.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::ReadSamples;
using testing_util::Take;
using testing_util::WriteText;

std::string Show(const SourceCursor& c) {
  return "{epoch " + std::to_string(c.epoch) + " position " + std::to_string(c.position) +
         " next_id " + std::to_string(c.next_id) + " skipped_empty " +
         std::to_string(c.skipped_empty) + " byte " + std::to_string(c.byte_offset) + " line " +
         std::to_string(c.line) + " epoch_size " + std::to_string(c.epoch_size) + "}";
}

void ExpectSameSamples(const std::vector<Sample>& a, const std::vector<Sample>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_EQ(a[k].id, b[k].id) << "sample " << k;
    EXPECT_EQ(a[k].tokens, b[k].tokens) << "sample " << k << " id " << a[k].id;
    EXPECT_EQ(a[k].target_mask, b[k].target_mask) << "sample " << k << " id " << a[k].id;
  }
}

// Every check on one source spec, at random positions over several epochs.
void CheckSpec(const std::string& spec, const SourceOptions& options, std::mt19937_64& rng) {
  SCOPED_TRACE(spec + (options.shuffle ? " shuffled" : ""));
  auto probe = OpenSource(spec, options);
  ASSERT_TRUE(probe.ok()) << probe.status().ToString();
  // The epoch size from a full pass (jsonl learns it so).
  int64_t size = 0;
  while (true) {
    auto next = (*probe)->NextLength();
    ASSERT_TRUE(next.ok());
    if (!next->has_value()) break;
    ++size;
  }
  ASSERT_GT(size, 0);
  std::vector<int64_t> positions = {0, 1, size - 1, size, size + 1, 2 * size, 3 * size - 1};
  for (int k = 0; k < 6; ++k) positions.push_back(static_cast<int64_t>(rng() % (3 * size + 1)));
  for (int64_t p : positions) {
    if (p < 0) continue;
    SCOPED_TRACE("after " + std::to_string(p) + " samples (epoch size " + std::to_string(size) +
                 ")");
    auto reference = OpenSource(spec, options);
    auto computer = OpenSource(spec, options);
    auto moved = OpenSource(spec, options);
    ASSERT_TRUE(reference.ok() && computer.ok() && moved.ok());
    ReadSamples(**reference, p);
    const SourceCursor want = (*reference)->cursor();
    EXPECT_EQ(want.samples(), p) << Show(want);
    auto got = (*computer)->CursorAfter(p);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, want) << "computed " << Show(*got) << " read " << Show(want);
    // The computer has not moved: it still starts at the first sample.
    auto fresh = OpenSource(spec, options);
    ASSERT_TRUE(fresh.ok());
    auto first = (*computer)->NextLength();
    auto want_first = (*fresh)->NextLength();
    ASSERT_TRUE(first.ok() && first->has_value() && want_first.ok() && want_first->has_value());
    EXPECT_EQ((**first).id, (**want_first).id);
    // Seek, then both continue alike, with the same cursors after.
    ASSERT_TRUE((*moved)->Seek(*got).ok());
    EXPECT_EQ((*moved)->cursor(), want);
    EXPECT_EQ((*moved)->epoch(), (*reference)->epoch());
    EXPECT_EQ((*moved)->skipped_empty(), (*reference)->skipped_empty());
    const int64_t n = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * size));
    ExpectSameSamples(Take(**moved, n), Take(**reference, n));
    EXPECT_EQ((*moved)->cursor(), (*reference)->cursor());
  }
  // CursorAtEpoch: what e full epochs read and Reset leave.
  for (int64_t e : {0, 1, 2}) {
    SCOPED_TRACE("epoch " + std::to_string(e));
    auto reference = OpenSource(spec, options);
    auto moved = OpenSource(spec, options);
    ASSERT_TRUE(reference.ok() && moved.ok());
    for (int64_t k = 0; k < e; ++k) {
      while (true) {
        auto next = (*reference)->NextLength();
        ASSERT_TRUE(next.ok());
        if (!next->has_value()) break;
      }
      ASSERT_TRUE((*reference)->Reset().ok());
    }
    auto at = (*moved)->CursorAtEpoch(e);
    ASSERT_TRUE(at.ok()) << at.status().ToString();
    // A jsonl reader in epoch 0 has not learnt its size; the computed cursor may know it.
    SourceCursor want = (*reference)->cursor();
    EXPECT_EQ(*at, want) << "computed " << Show(*at) << " read " << Show(want);
    ASSERT_TRUE((*moved)->Seek(*at).ok());
    ExpectSameSamples(Take(**moved, size + 1), Take(**reference, size + 1));
  }
  // The identity is stable and does not depend on the options' shuffle or seed.
  auto a = OpenSource(spec, options);
  SourceOptions other = options;
  other.seed ^= 0x5a5a;
  auto b = OpenSource(spec, other);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ia = (*a)->Identity();
  auto ib = (*b)->Identity();
  ASSERT_TRUE(ia.ok() && ib.ok()) << ia.status().ToString();
  EXPECT_EQ(*ia, *ib);
  EXPECT_FALSE(ia->empty());
}

std::string RandomLengths(std::mt19937_64& rng, int64_t n) {
  std::string text;
  // Lengths up to 2,000: the cursor does not depend on them, and every sample read makes its
  // tokens (up to 100,000 a sample took a minute under the sanitizers).
  for (int64_t i = 0; i < n; ++i) text += std::to_string(1 + rng() % 2000) + "\n";
  return text;
}

void WriteMegatron(const std::string& prefix, int64_t documents, bool empties,
                   std::mt19937_64& rng) {
  auto w = MegatronWriter::Create(prefix, MegatronDType::kUint16);
  ASSERT_TRUE(w.ok());
  bool any = false;
  for (int64_t d = 0; d < documents || !any; ++d) {
    // Empty documents at the start, the end and in runs, where the cursor rules bite.
    const bool empty = empties && (d == 0 || d + 1 == documents || rng() % 3 == 0);
    if (!empty) {
      std::vector<int64_t> seq(1 + rng() % 20);
      for (auto& t : seq) t = static_cast<int64_t>(rng() % 1000);
      ASSERT_TRUE((*w)->AddSequence(seq).ok());
      any = true;
    }
    ASSERT_TRUE((*w)->EndDocument().ok());
  }
  ASSERT_TRUE((*w)->Finish().ok());
}

TEST(SourceCursorTest, ComputedCursorsEqualReadOnesForEverySourceKind) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (int trial = 0; trial < 4; ++trial) {
    const int64_t size = 1 + static_cast<int64_t>(rng() % (trial < 2 ? 12 : 300));
    const std::string t = std::to_string(trial);
    for (bool shuffle : {false, true}) {
      SourceOptions options;
      options.shuffle = shuffle;
      options.seed = rng();
      options.mock_num_samples = size;
      CheckSpec("mock", options, rng);
      const std::string lengths = dir.File("l" + t + ".txt");
      WriteText(lengths, RandomLengths(rng, size));
      CheckSpec("lengths:" + lengths, options, rng);
      std::string hist = "length,count\n";
      int64_t length = 0;
      for (int64_t left = size; left > 0;) {
        length += 1 + static_cast<int64_t>(rng() % 50);
        const int64_t count = rng() % 4 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 9);
        hist += std::to_string(length) + "," + std::to_string(count) + "\n";
        left -= count;
      }
      const std::string histogram = dir.File("h" + t + ".csv");
      WriteText(histogram, hist);
      CheckSpec("histogram:" + histogram, options, rng);
      for (bool empties : {false, true}) {
        const std::string prefix = dir.File("g" + t + (empties ? "e" : "f"));
        WriteMegatron(prefix, size, empties, rng);
        CheckSpec("megatron:" + prefix, options, rng);
      }
      if (!shuffle) {
        std::string jsonl = rng() % 2 ? "\xEF\xBB\xBF" : "";  // a BOM before line 1
        for (int64_t i = 0; i < size; ++i) {
          if (rng() % 4 == 0) jsonl += "  \n";  // blank lines count in line numbers only
          jsonl += "{\"input_ids\":[" + std::to_string(rng() % 50) + "," +
                   std::to_string(rng() % 50) + "],\"loss_mask\":[0," +
                   std::to_string(rng() % 2) + "]}\n";
        }
        if (rng() % 2) jsonl += "\n";
        const std::string path = dir.File("j" + t + ".jsonl");
        WriteText(path, jsonl);
        CheckSpec("jsonl:" + path, options, rng);
      }
      // Arrow record batches (thdpack/arrow.h), in a few batches of any size.
      std::vector<testing_util::TestBatch> batches;
      for (int64_t left = size; left > 0;) {
        const int64_t rows = std::min<int64_t>(left, 1 + static_cast<int64_t>(rng() % 40));
        std::vector<int64_t> offsets = {0}, values;
        for (int64_t r = 0; r < rows; ++r) {
          for (uint64_t j = 1 + rng() % 9; j > 0; --j) values.push_back(rng() % 500);
          offsets.push_back(static_cast<int64_t>(values.size()));
        }
        batches.push_back({rows, 0, {{"input_ids", "l", false, offsets, values, {}, {}, 0}}, {}});
        left -= rows;
      }
      ArrowArrayStream stream = testing_util::MakeTestStream(batches);
      auto rows = ImportArrowStream(&stream, "cursor test");
      ASSERT_TRUE(rows.ok()) << rows.status().ToString();
      RegisterArrowRows("arrow:@cursor" + t, *rows);
      CheckSpec("arrow:@cursor" + t, options, rng);
    }
  }
}

TEST(SourceCursorTest, PermutationInverse) {
  std::mt19937_64 rng(std::random_device{}());
  for (uint64_t n : {1ULL, 2ULL, 3ULL, 5ULL, 64ULL, 1000ULL, 4097ULL}) {
    data_internal::Permutation perm(n, rng());
    std::vector<bool> seen(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t y = perm(i);
      ASSERT_LT(y, n);
      EXPECT_FALSE(seen[y]);
      seen[y] = true;
      EXPECT_EQ(perm.Inverse(y), i) << "n " << n;
    }
  }
}

// A cursor that this source could not hold is refused, naming the field.
TEST(SourceCursorTest, RefusesCursorsThatDoNotFit) {
  TempDir dir;
  const std::string prefix = dir.File("g");
  std::mt19937_64 rng(7);
  WriteMegatron(prefix, 20, true, rng);
  auto source = OpenSource("megatron:" + prefix);
  ASSERT_TRUE(source.ok());
  auto good = (*source)->CursorAfter(25);
  ASSERT_TRUE(good.ok());
  struct Edit {
    const char* field;
    void (*apply)(SourceCursor&);
  };
  const Edit edits[] = {
      {"epoch_size", [](SourceCursor& c) { c.epoch_size += 1; }},
      {"epoch", [](SourceCursor& c) { c.epoch = -1; }},
      {"position", [](SourceCursor& c) { c.position = 1000; }},
      {"next_id", [](SourceCursor& c) { c.next_id += 1; }},
      {"skipped_empty", [](SourceCursor& c) { c.skipped_empty += 1; }},
      {"byte_offset", [](SourceCursor& c) { c.byte_offset = 10; }},
  };
  for (const Edit& e : edits) {
    SourceCursor c = *good;
    e.apply(c);
    Status s = (*source)->Seek(c);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << e.field << ": " << s.ToString();
    EXPECT_TRUE(Contains(s.message(), std::string("\"") + e.field + "\"")) << s.ToString();
  }
  EXPECT_TRUE((*source)->Seek(*good).ok());

  const std::string path = dir.File("a.jsonl");
  WriteText(path, "{\"input_ids\":[1,2,3]}\n{\"input_ids\":[4,5]}\n");
  auto jsonl = OpenSource("jsonl:" + path);
  ASSERT_TRUE(jsonl.ok());
  auto after_one = (*jsonl)->CursorAfter(1);
  ASSERT_TRUE(after_one.ok());
  EXPECT_EQ(after_one->byte_offset, 22);
  SourceCursor mid = *after_one;
  mid.byte_offset = 5;  // inside line 1
  Status s = (*jsonl)->Seek(mid);
  EXPECT_EQ(s.code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(s.message(), "not at the start of a line")) << s.ToString();
  SourceCursor past = *after_one;
  past.byte_offset = 1000;
  s = (*jsonl)->Seek(past);
  EXPECT_TRUE(Contains(s.message(), "outside the file")) << s.ToString();
  SourceCursor epoch_one = *after_one;
  epoch_one.epoch = 1;  // a second epoch needs the epoch size
  s = (*jsonl)->Seek(epoch_one);
  EXPECT_TRUE(Contains(s.message(), "\"epoch_size\"")) << s.ToString();
}

// Identities tell apart data that would give other samples, and only those.
TEST(SourceCursorTest, IdentityChangesWithTheData) {
  TempDir dir;
  auto identity = [](const std::string& spec, SourceOptions o = {}) {
    auto s = OpenSource(spec, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    auto id = (*s)->Identity();
    EXPECT_TRUE(id.ok());
    return *id;
  };
  const std::string a = dir.File("a.txt"), b = dir.File("b.txt"), c = dir.File("c.txt");
  WriteText(a, "5\n7\n9\n");
  WriteText(b, "5\n7\n9\n");
  WriteText(c, "5\n8\n9\n");
  EXPECT_EQ(identity("lengths:" + a), identity("lengths:" + b));  // a moved copy
  EXPECT_NE(identity("lengths:" + a), identity("lengths:" + c));
  const std::string j1 = dir.File("1.jsonl"), j2 = dir.File("2.jsonl");
  WriteText(j1, "{\"input_ids\":[1,2]}\n");
  WriteText(j2, "{\"input_ids\":[1,3]}\n");
  EXPECT_NE(identity("jsonl:" + j1), identity("jsonl:" + j2));
  EXPECT_TRUE(Contains(identity("mock"), "mean_seq_len 2048"));
  const std::string m1 = dir.File("m1.json"), m2 = dir.File("m2.json");
  WriteText(m1, R"({"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":9,"mean_seq_len":4,"lognormal_sigma":0.5})");
  WriteText(m2, R"({"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":9,"mean_seq_len":4,"lognormal_sigma":0.25})");
  EXPECT_NE(identity("mock:" + m1), identity("mock:" + m2));
}

}  // namespace
}  // namespace thdpack

namespace thdpack {
namespace {

// The rules between a cursor's fields (CheckSourceCursor, the one check the run state's and the
// step messages' decoders both end with), each named by the field's path.
TEST(SourceCursorFieldsTest, EachRuleIsNamedByItsPath) {
  SourceCursor plain;
  plain.position = 3;
  plain.next_id = 3;
  plain.epoch_size = 10;
  EXPECT_TRUE(CheckSourceCursor(plain, "cursor").ok());
  SourceCursor c = plain;
  c.epoch = -1;
  EXPECT_TRUE(Contains(CheckSourceCursor(c, "cursor").message(), "\"cursor.epoch\" = -1"));
  c = plain;
  c.epoch_size = -2;
  EXPECT_TRUE(Contains(CheckSourceCursor(c, "cursor").message(), "cursor.epoch_size"));
  c.epoch_size = -1;  // unknown: allowed
  EXPECT_TRUE(CheckSourceCursor(c, "cursor").ok());

  SourceCursor blend;
  blend.parts = {plain, plain};
  blend.taken = {1};
  EXPECT_EQ(ShapeOf(blend), CursorShape::kBlend);
  EXPECT_TRUE(Contains(CheckSourceCursor(blend, "cursor").message(), "same length (2 and 1)"));
  blend.taken = {1, -4};
  EXPECT_TRUE(Contains(CheckSourceCursor(blend, "cursor").message(), "\"cursor.taken[1]\""));
  blend.taken = {1, 4};
  EXPECT_TRUE(CheckSourceCursor(blend, "cursor").ok());
  blend.parts[1].parts = {plain};  // a blend inside a part
  blend.parts[1].taken = {0};
  EXPECT_TRUE(Contains(CheckSourceCursor(blend, "cursor").message(),
                       "\"cursor.parts[1].parts\" inside a part"));

  SourceCursor split = plain;
  split.split = {1, 2, 3, 4, 5};
  split.parts = {plain};
  EXPECT_EQ(ShapeOf(split), CursorShape::kSplit);
  EXPECT_TRUE(CheckSourceCursor(split, "cursor").ok());
  split.split.pop_back();
  EXPECT_TRUE(Contains(CheckSourceCursor(split, "cursor").message(), "has 4 values, not 5"));
  split.split = {1, 2, 3, 4, 5};
  split.parts = {split};  // a splitting source's cursor inside one
  EXPECT_TRUE(Contains(CheckSourceCursor(split, "cursor").message(),
                       "\"cursor.inner\" is a splitting source's cursor too"));
  split.parts = {plain, plain};
  EXPECT_TRUE(Contains(CheckSourceCursor(split, "cursor").message(), "with 2 wrapped cursors"));
  // A splitting source around a blend (its inner keeps the top level), and a blend's part that
  // is a splitting source's: both valid.
  blend.parts[1] = plain;
  split.parts = {blend};
  EXPECT_TRUE(CheckSourceCursor(split, "cursor").ok()) << CheckSourceCursor(split, "c").ToString();
  SourceCursor wrapped = plain;
  wrapped.split = {0, 0, 0, 0, 0};
  wrapped.parts = {plain};
  blend.parts[0] = wrapped;
  EXPECT_TRUE(CheckSourceCursor(blend, "cursor").ok());
}

}  // namespace
}  // namespace thdpack
