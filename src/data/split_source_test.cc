// OpenSplitSource against the plain reference written here: the wrapped source read whole with
// Next(), each sample over `longest` cut into pieces of `longest` tokens (ids moved up by the
// pieces before), on every source kind (mock, lengths, jsonl with target masks, megatron with
// empty documents, shuffled or not) and fresh random data. Also its cursor: computed equals
// read, Seek continues with the same pieces (inside a cut sample too), split counts included.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "thdpack/data.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::ReadSamples;
using testing_util::Take;
using testing_util::WriteText;

using Opener = std::function<std::unique_ptr<SampleSource>()>;

// The plain reference: `epochs` epochs of the wrapped source, read whole and cut here.
struct Plain {
  std::vector<Sample> samples;
  SplitCounts counts;
  std::vector<int64_t> epoch_ends;  // samples read at the end of each epoch
};
Plain PlainSplit(SampleSource& inner, int64_t longest, int epochs) {
  Plain out;
  int64_t extra = 0;
  for (int e = 0; e < epochs; ++e) {
    for (;;) {
      auto next = inner.Next();
      EXPECT_TRUE(next.ok()) << next.status().ToString();
      if (!next.ok() || !next->has_value()) break;
      Sample s = std::move(**next);
      const int64_t L = static_cast<int64_t>(s.tokens.size());
      if (L <= longest) {
        s.id += extra;
        out.samples.push_back(std::move(s));
        continue;
      }
      const int64_t n = (L + longest - 1) / longest;
      ++out.counts.samples;
      out.counts.pieces += n;
      for (int64_t k = 0; k < n; ++k) {
        Sample p;
        p.id = s.id + extra + k;
        const int64_t a = k * longest, b = std::min(L, a + longest);
        p.tokens.assign(s.tokens.begin() + a, s.tokens.begin() + b);
        if (!s.target_mask.empty()) {
          p.target_mask.assign(s.target_mask.begin() + a, s.target_mask.begin() + b);
        }
        if (k > 0) out.counts.lost_targets += s.target_mask.empty() ? 1 : s.target_mask[a];
        out.samples.push_back(std::move(p));
      }
      extra += n - 1;
    }
    out.epoch_ends.push_back(static_cast<int64_t>(out.samples.size()));
    EXPECT_TRUE(inner.Reset().ok());
  }
  return out;
}

void ExpectSame(const std::vector<Sample>& got, const std::vector<Sample>& want, size_t from) {
  for (size_t k = 0; k < got.size() && from + k < want.size(); ++k) {
    EXPECT_EQ(got[k].id, want[from + k].id) << "sample " << from + k;
    EXPECT_EQ(got[k].tokens, want[from + k].tokens) << "sample " << from + k;
    EXPECT_EQ(got[k].target_mask, want[from + k].target_mask) << "sample " << from + k;
  }
}

void CheckSplit(const std::string& name, const std::function<std::unique_ptr<SampleSource>()>& open,
                int64_t longest, std::mt19937_64& rng) {
  SCOPED_TRACE(name + " split at " + std::to_string(longest));
  auto inner = open();
  const Plain want = PlainSplit(*inner, longest, 3);
  const int64_t total = static_cast<int64_t>(want.samples.size());
  ASSERT_GT(total, 0);
  auto split = [&]() {
    auto s = OpenSplitSource(open(), longest);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return std::move(*s);
  };
  // Next over three epochs: the plain pieces, and the counts.
  {
    auto s = split();
    std::vector<Sample> got;
    for (int e = 0; e < 3; ++e) {
      for (;;) {
        auto next = s->Next();
        ASSERT_TRUE(next.ok()) << next.status().ToString();
        if (!next->has_value()) break;
        EXPECT_LE(static_cast<int64_t>((**next).tokens.size()), longest);
        got.push_back(std::move(**next));
      }
      EXPECT_EQ(static_cast<int64_t>(got.size()), want.epoch_ends[static_cast<size_t>(e)]);
      ASSERT_TRUE(s->Reset().ok());
    }
    ASSERT_EQ(got.size(), want.samples.size());
    ExpectSame(got, want.samples, 0);
    EXPECT_EQ(s->split_counts(), want.counts);
  }
  // NextLength and NextLengths: the same ids, lengths and targets.
  {
    auto s = split();
    std::vector<SampleLength> got(static_cast<size_t>(want.epoch_ends[0]) + 1);
    auto n = s->NextLengths(got);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_EQ(*n, want.epoch_ends[0]);
    for (int64_t k = 0; k < *n; ++k) {
      const Sample& w = want.samples[static_cast<size_t>(k)];
      EXPECT_EQ(got[static_cast<size_t>(k)].id, w.id);
      EXPECT_EQ(got[static_cast<size_t>(k)].length, static_cast<int64_t>(w.tokens.size()));
      EXPECT_EQ(got[static_cast<size_t>(k)].n_targets, NumTargets(w));
    }
  }
  // Cursors at random positions (inside cut samples too): computed equals read, and a source
  // moved there continues with the plain pieces and counts.
  std::vector<int64_t> positions = {0, 1, total - 1, total};
  for (int k = 0; k < 8; ++k) positions.push_back(static_cast<int64_t>(rng() % (total + 1)));
  for (int64_t p : positions) {
    if (p < 0 || p > total) continue;
    SCOPED_TRACE("after " + std::to_string(p) + " samples");
    auto reference = split();
    auto computer = split();
    auto moved = split();
    ReadSamples(*reference, p);
    const SourceCursor at = reference->cursor();
    EXPECT_EQ(at.samples(), p);
    auto got = computer->CursorAfter(p);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == at);
    ASSERT_TRUE(moved->Seek(*got).ok());
    EXPECT_TRUE(moved->cursor() == at);
    EXPECT_EQ(moved->split_counts(), reference->split_counts());
    const int64_t n = std::min<int64_t>(total - p, 1 + static_cast<int64_t>(rng() % 40));
    const std::vector<Sample> a = Take(*moved, n);
    ExpectSame(a, want.samples, static_cast<size_t>(p));
    ExpectSame(Take(*reference, n), want.samples, static_cast<size_t>(p));
    EXPECT_TRUE(moved->cursor() == reference->cursor());
  }
  // CursorAtEpoch(1): after one whole epoch and a Reset.
  {
    auto reference = split();
    ReadSamples(*reference, want.epoch_ends[0]);
    auto end = reference->NextLength();  // the end of the epoch, read as a whole epoch's reader
    ASSERT_TRUE(end.ok() && !end->has_value());
    ASSERT_TRUE(reference->Reset().ok());
    auto moved = split();
    auto at = moved->CursorAtEpoch(1);
    ASSERT_TRUE(at.ok()) << at.status().ToString();
    EXPECT_TRUE(*at == reference->cursor());
    ASSERT_TRUE(moved->Seek(*at).ok());
    ExpectSame(Take(*moved, 5), want.samples, static_cast<size_t>(want.epoch_ends[0]));
  }
}

void WriteMegatron(const std::string& prefix, int64_t documents, std::mt19937_64& rng) {
  auto w = MegatronWriter::Create(prefix, MegatronDType::kUint16);
  ASSERT_TRUE(w.ok());
  for (int64_t d = 0; d < documents; ++d) {
    if (d == 0 || rng() % 4 != 0) {  // empty documents between, the first never
      std::vector<int64_t> seq(1 + rng() % 60);
      for (auto& t : seq) t = static_cast<int64_t>(rng() % 1000);
      ASSERT_TRUE((*w)->AddSequence(seq).ok());
    }
    ASSERT_TRUE((*w)->EndDocument().ok());
  }
  ASSERT_TRUE((*w)->Finish().ok());
}

TEST(SplitSourceTest, PiecesAndCursorsEqualThePlainSplit) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (int trial = 0; trial < 3; ++trial) {
    const std::string t = std::to_string(trial);
    const int64_t size = 3 + static_cast<int64_t>(rng() % 40);
    const int64_t longest = 1 + static_cast<int64_t>(rng() % 40);
    std::string lengths;
    for (int64_t i = 0; i < size; ++i) lengths += std::to_string(1 + rng() % 120) + "\n";
    const std::string lpath = dir.File("l" + t + ".txt");
    WriteText(lpath, lengths);
    std::string jsonl;
    for (int64_t i = 0; i < size; ++i) {
      const int64_t L = 1 + static_cast<int64_t>(rng() % 90);
      std::string ids, mask;
      for (int64_t j = 0; j < L; ++j) {
        ids += (j ? "," : "") + std::to_string(rng() % 500);
        mask += (j ? "," : "") + std::to_string(rng() % 3 != 0);
      }
      jsonl += "{\"input_ids\":[" + ids + "]" + (i % 2 ? ",\"loss_mask\":[" + mask + "]" : "") +
               "}\n";
    }
    const std::string jpath = dir.File("j" + t + ".jsonl");
    WriteText(jpath, jsonl);
    const std::string gpath = dir.File("g" + t);
    WriteMegatron(gpath, size, rng);
    for (bool shuffle : {false, true}) {
      SourceOptions o;
      o.shuffle = shuffle;
      o.seed = rng();
      o.mock_num_samples = size;
      auto opener = [o](const std::string& spec) {
        return [o, spec]() {
          auto s = OpenSource(spec, o);
          EXPECT_TRUE(s.ok()) << s.status().ToString();
          return std::move(*s);
        };
      };
      CheckSplit("lengths", opener("lengths:" + lpath), longest, rng);
      CheckSplit("megatron", opener("megatron:" + gpath), longest, rng);
      CheckSplit("mock", opener("mock"), 1000 + longest * 50, rng);
      if (!shuffle) CheckSplit("jsonl", opener("jsonl:" + jpath), longest, rng);
    }
  }
}

TEST(SplitSourceTest, RefusesBadInputsAndCursors) {
  EXPECT_FALSE(OpenSplitSource(nullptr, 4).ok());
  auto mock = OpenSource("mock");
  ASSERT_TRUE(mock.ok());
  auto zero = OpenSplitSource(std::move(*mock), 0);
  ASSERT_FALSE(zero.ok());
  EXPECT_TRUE(Contains(zero.status().message(), "longest = 0")) << zero.status().ToString();
  auto inner = OpenSource("mock");
  ASSERT_TRUE(inner.ok());
  auto s = OpenSplitSource(std::move(*inner), 100);
  ASSERT_TRUE(s.ok());
  auto good = (*s)->CursorAfter(7);
  ASSERT_TRUE(good.ok());
  SourceCursor plain = good->parts.at(0);  // the wrapped cursor alone
  Status st = (*s)->Seek(plain);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(st.message(), "is not one of a splitting source")) << st.ToString();
  SourceCursor off = *good;
  off.next_id += 1;
  st = (*s)->Seek(off);
  EXPECT_TRUE(Contains(st.message(), "does not add up")) << st.ToString();
  SourceCursor piece = *good;
  piece.split[0] = 1000;  // no sample has that many pieces
  st = (*s)->Seek(piece);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_TRUE((*s)->Seek(*good).ok());
}

}  // namespace
}  // namespace thdpack
