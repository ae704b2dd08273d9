// SampleSource::NextLengths (the batched length read) against NextLength one at a time, the
// plain reference, for every source kind, on fresh random sizes, contents and batch sizes:
// the same ids, lengths, n_targets, epochs and skipped-empty counts, across epoch ends.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "thdpack/data.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::TempDir;
using testing_util::WriteText;

// What a reader sees after one batch: the lengths it got and the source's state.
struct Batch {
  std::vector<SampleLength> lengths;
  int64_t epoch = 0;
  int64_t skipped_empty = 0;
};

bool Same(const SampleLength& a, const SampleLength& b) {
  return a.id == b.id && a.length == b.length && a.n_targets == b.n_targets;
}

// Reads `epochs` epochs from each of two sources opened alike: `one` with up to `want`
// NextLength calls per batch (stopping at the end of the epoch), `batched` with one
// NextLengths of `want`, for random `want`; then Reset and again. Returns the number of
// samples compared.
int64_t CompareReads(SampleSource& one, SampleSource& batched, int epochs, std::mt19937_64& rng,
                     int64_t max_batch) {
  int64_t compared = 0;
  std::vector<SampleLength> buffer;
  for (int e = 0; e < epochs; ++e) {
    while (true) {
      const int64_t want = static_cast<int64_t>(rng() % static_cast<uint64_t>(max_batch + 1));
      Batch a;
      for (int64_t k = 0; k < want; ++k) {
        auto next = one.NextLength();
        EXPECT_TRUE(next.ok()) << next.status().ToString();
        if (!next.ok() || !next->has_value()) break;
        a.lengths.push_back(**next);
      }
      a.epoch = one.epoch();
      a.skipped_empty = one.skipped_empty();
      // Poisoned slots: what NextLengths does not write must not be taken for a sample.
      buffer.assign(static_cast<size_t>(want), SampleLength{-1, -1, -1});
      auto got = batched.NextLengths(buffer);
      EXPECT_TRUE(got.ok()) << got.status().ToString();
      if (!got.ok()) return compared;
      EXPECT_GE(*got, 0);
      EXPECT_LE(*got, want);
      EXPECT_EQ(*got, static_cast<int64_t>(a.lengths.size())) << "epoch " << e;
      EXPECT_EQ(batched.epoch(), a.epoch);
      EXPECT_EQ(batched.skipped_empty(), a.skipped_empty);
      const size_t n = std::min(a.lengths.size(), static_cast<size_t>(std::max<int64_t>(*got, 0)));
      for (size_t k = 0; k < n; ++k) {
        EXPECT_TRUE(Same(buffer[k], a.lengths[k]))
            << "epoch " << e << " sample " << k << ": batched id " << buffer[k].id << " length "
            << buffer[k].length << ", one by one id " << a.lengths[k].id << " length "
            << a.lengths[k].length;
      }
      compared += static_cast<int64_t>(n);
      if (*got < want) break;  // the end of the epoch (want 0 reads nothing and goes on)
    }
    // At the end of the epoch both stay there.
    SampleLength slot;
    auto again = batched.NextLengths(std::span(&slot, 1));
    EXPECT_TRUE(again.ok() && *again == 0);
    EXPECT_TRUE(one.Reset().ok());
    EXPECT_TRUE(batched.Reset().ok());
  }
  return compared;
}

// Opens the same source twice and compares their reads.
void CheckSpec(const std::string& spec, const SourceOptions& options, std::mt19937_64& rng,
               int64_t max_batch) {
  SCOPED_TRACE(spec + (options.shuffle ? " shuffled" : ""));
  auto one = OpenSource(spec, options);
  auto batched = OpenSource(spec, options);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  ASSERT_TRUE(batched.ok()) << batched.status().ToString();
  const int64_t compared = CompareReads(**one, **batched, 3, rng, max_batch);
  EXPECT_GT(compared, 0);
}

std::string RandomLengths(std::mt19937_64& rng, int64_t n) {
  std::string text;
  for (int64_t i = 0; i < n; ++i) text += std::to_string(1 + rng() % 100000) + "\n";
  return text;
}

TEST(NextLengthsTest, EqualsNextLengthForEverySourceKind) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));  // a failure can be replayed with it
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (int trial = 0; trial < 12; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    // Sizes from one sample to a few thousand; batches up to beyond a whole epoch.
    const int64_t size = 1 + static_cast<int64_t>(rng() % (trial < 6 ? 40 : 3000));
    const int64_t max_batch = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(size + 10));
    const std::string t = std::to_string(trial);
    for (bool shuffle : {false, true}) {
      SourceOptions options;
      options.shuffle = shuffle;
      options.seed = rng();
      options.mock_num_samples = size;

      CheckSpec("mock", options, rng, max_batch);

      const std::string lengths = dir.File("l" + t + ".txt");
      WriteText(lengths, RandomLengths(rng, size));
      CheckSpec("lengths:" + lengths, options, rng, max_batch);

      const std::string config = dir.File("m" + t + ".json");
      WriteText(config, "{\"mode\":\"file\",\"path\":\"l" + t + ".txt\"}");
      CheckSpec("mock:" + config, options, rng, max_batch);

      // Rows with zero counts among them; totals near `size`.
      std::string hist = "length,count\n";
      int64_t length = 0;
      for (int64_t left = size; left > 0;) {
        length += 1 + static_cast<int64_t>(rng() % 50);
        const int64_t count = rng() % 4 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 30);
        hist += std::to_string(length) + "," + std::to_string(count) + "\n";
        left -= count;
      }
      const std::string histogram = dir.File("h" + t + ".csv");
      WriteText(histogram, hist);
      CheckSpec("histogram:" + histogram, options, rng, max_batch);

      // Megatron with and without empty documents (which NextLengths must pass over and
      // count exactly as NextLength does).
      for (bool empties : {false, true}) {
        const std::string prefix = dir.File("g" + t + (empties ? "e" : "f"));
        auto w = MegatronWriter::Create(prefix, MegatronDType::kUint16);
        ASSERT_TRUE(w.ok());
        bool any = false;
        for (int64_t d = 0; d < size || !any; ++d) {
          const bool empty = empties && rng() % 3 == 0;
          if (!empty) {
            std::vector<int64_t> seq(1 + rng() % 20, 7);
            ASSERT_TRUE((*w)->AddSequence(seq).ok());
            any = true;
          }
          ASSERT_TRUE((*w)->EndDocument().ok());
        }
        ASSERT_TRUE((*w)->Finish().ok());
        CheckSpec("megatron:" + prefix, options, rng, max_batch);
      }

      if (!shuffle) {  // jsonl streams: no shuffle; NextLengths is the default loop
        std::string jsonl;
        for (int64_t i = 0; i < std::min<int64_t>(size, 200); ++i) {
          const uint64_t tokens = 1 + rng() % 6;
          std::string ids = "1";
          std::string mask = "1";
          for (uint64_t k = 1; k < tokens; ++k) {
            ids += "," + std::to_string(2 + rng() % 100);
            mask += rng() % 2 ? ",1" : ",0";
          }
          jsonl += "{\"input_ids\":[" + ids + "]";
          if (rng() % 2) jsonl += ",\"loss_mask\":[" + mask + "]";  // n_targets varies
          jsonl += "}\n";
          if (rng() % 5 == 0) jsonl += "\n";  // blank lines are skipped
        }
        const std::string path = dir.File("j" + t + ".jsonl");
        WriteText(path, jsonl);
        CheckSpec("jsonl:" + path, options, rng, max_batch);
      }
    }
  }
}

// An error is returned by NextLengths as by NextLength, and the source stays broken.
TEST(NextLengthsTest, AnErrorIsReturnedAndSticks) {
  TempDir dir;
  const std::string path = dir.File("bad.jsonl");
  WriteText(path, "{\"input_ids\":[1,2]}\n{\"input_ids\":[1,2]}\nnot json\n");
  auto source = OpenSource("jsonl:" + path);
  ASSERT_TRUE(source.ok());
  std::vector<SampleLength> buffer(8);
  auto got = (*source)->NextLengths(buffer);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find(path + ":3"), std::string::npos)
      << got.status().ToString();
  auto again = (*source)->NextLengths(buffer);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status(), got.status());
}

}  // namespace
}  // namespace thdpack
