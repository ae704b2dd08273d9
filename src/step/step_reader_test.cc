// StepReader: steps of N samples in scheduling order, wrap-around into the next epoch, "all".
// Expected ids and orders are worked out by hand from the rule "sample i of the step is read
// by loader i mod DP; loader 0's samples first".
#include "thdpack/step.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "data/data_test_util.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::TempDir;
using testing_util::WriteText;

std::vector<int64_t> Ids(const StepSamples& s) {
  std::vector<int64_t> out;
  for (const SampleLength& x : s.samples) out.push_back(x.id);
  return out;
}
std::vector<int64_t> Lengths(const StepSamples& s) {
  std::vector<int64_t> out;
  for (const SampleLength& x : s.samples) out.push_back(x.length);
  return out;
}

class StepReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.File("five.txt");
    WriteText(path_, "10\n20\n30\n40\n50\n");
    auto source = OpenLengthsSource(path_);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    source_ = std::move(source).value();
  }
  TempDir dir_;
  std::string path_;
  std::unique_ptr<SampleSource> source_;
};

TEST_F(StepReaderTest, StepsInSchedulingOrderWrapIntoTheNextEpoch) {
  auto reader = StepReader::Create(source_.get(), 4, 2);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  // Step 0: ids 0..3 (lengths 10..40); loader 0 reads positions 0, 2, loader 1 reads 1, 3.
  auto s0 = reader->Next();
  ASSERT_TRUE(s0.ok()) << s0.status().ToString();
  EXPECT_EQ(s0->step, 0);
  EXPECT_EQ(s0->epoch, 0);
  EXPECT_EQ(Ids(*s0), (std::vector<int64_t>{0, 2, 1, 3}));
  EXPECT_EQ(Lengths(*s0), (std::vector<int64_t>{10, 30, 20, 40}));
  EXPECT_EQ(s0->samples[0].n_targets, 9);
  // Step 1: id 4 (length 50, epoch 0), then the source wraps: ids 5, 6, 7 (10, 20, 30).
  auto s1 = reader->Next();
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->step, 1);
  EXPECT_EQ(s1->epoch, 0);
  EXPECT_EQ(Ids(*s1), (std::vector<int64_t>{4, 6, 5, 7}));
  EXPECT_EQ(Lengths(*s1), (std::vector<int64_t>{50, 20, 10, 30}));
  // Step 2: ids 8, 9 (40, 50), wrap, 10, 11 (10, 20); starts in epoch 1.
  auto s2 = reader->Next();
  ASSERT_TRUE(s2.ok());
  EXPECT_EQ(s2->epoch, 1);
  EXPECT_EQ(Ids(*s2), (std::vector<int64_t>{8, 10, 9, 11}));
  EXPECT_EQ(Lengths(*s2), (std::vector<int64_t>{40, 10, 50, 20}));
}

TEST_F(StepReaderTest, StepEndingAtTheEpochEndStartsTheNextInTheNextEpoch) {
  auto reader = StepReader::Create(source_.get(), 5, 3);
  ASSERT_TRUE(reader.ok());
  auto s0 = reader->Next();
  ASSERT_TRUE(s0.ok());
  EXPECT_EQ(s0->epoch, 0);
  // DP=3: loader 0 reads 0, 3; loader 1 reads 1, 4; loader 2 reads 2.
  EXPECT_EQ(Ids(*s0), (std::vector<int64_t>{0, 3, 1, 4, 2}));
  auto s1 = reader->Next();
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->epoch, 1);
  EXPECT_EQ(Ids(*s1), (std::vector<int64_t>{5, 8, 6, 9, 7}));
  EXPECT_EQ(reader->LoaderOf(4), 1);
  EXPECT_EQ(reader->LoaderOf(2), 2);
}

TEST_F(StepReaderTest, AllIsOneEpochPerStep) {
  auto reader = StepReader::Create(source_.get(), 0, 2);
  ASSERT_TRUE(reader.ok());
  auto s0 = reader->Next();
  ASSERT_TRUE(s0.ok());
  EXPECT_EQ(s0->epoch, 0);
  EXPECT_EQ(Ids(*s0), (std::vector<int64_t>{0, 2, 4, 1, 3}));
  auto s1 = reader->Next();
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->step, 1);
  EXPECT_EQ(s1->epoch, 1);
  EXPECT_EQ(Ids(*s1), (std::vector<int64_t>{5, 7, 9, 6, 8}));
}

TEST_F(StepReaderTest, GlobalBatchLargerThanTheSourceSpansEpochs) {
  auto reader = StepReader::Create(source_.get(), 12, 1);
  ASSERT_TRUE(reader.ok());
  auto s0 = reader->Next();
  ASSERT_TRUE(s0.ok());
  EXPECT_EQ(s0->epoch, 0);
  EXPECT_EQ(Lengths(*s0),
            (std::vector<int64_t>{10, 20, 30, 40, 50, 10, 20, 30, 40, 50, 10, 20}));
  EXPECT_EQ(s0->samples.back().id, 11);
  auto s1 = reader->Next();
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->epoch, 2);
  EXPECT_EQ(s1->samples.front().id, 12);
  EXPECT_EQ(s1->samples.front().length, 30);
}

// A source that never yields a sample.
class EmptySource : public SampleSource {
 public:
  Result<std::optional<Sample>> Next() override { return std::optional<Sample>(); }
  Result<std::optional<SampleLength>> NextLength() override {
    return std::optional<SampleLength>();
  }
  Status Reset() override {
    ++epoch_;
    return Status::Ok();
  }
  std::optional<int64_t> size_hint() const override { return 0; }
  int64_t epoch() const override { return epoch_; }
  const std::string& spec() const override { return spec_; }

 private:
  int64_t epoch_ = 0;
  std::string spec_ = "empty:nothing";
};

TEST(StepReader, EmptySourceIsAnErrorNamingTheSpec) {
  EmptySource source;
  for (int64_t n : {int64_t{0}, int64_t{4}}) {
    auto reader = StepReader::Create(&source, n, 2);
    ASSERT_TRUE(reader.ok());
    auto s = reader->Next();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("empty:nothing"), std::string::npos)
        << s.status().ToString();
    EXPECT_NE(s.status().message().find("no samples"), std::string::npos);
  }
}

TEST(StepReader, BadArguments) {
  EmptySource source;
  EXPECT_FALSE(StepReader::Create(nullptr, 4, 1).ok());
  EXPECT_FALSE(StepReader::Create(&source, -1, 1).ok());
  EXPECT_FALSE(StepReader::Create(&source, 4, 0).ok());
}

TEST(LoaderIndices, HandWorked) {
  EXPECT_EQ(LoaderIndices(7, 3, 0), (std::vector<int64_t>{0, 3, 6}));
  EXPECT_EQ(LoaderIndices(7, 3, 1), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(LoaderIndices(7, 3, 2), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(LoaderIndices(2, 4, 3), (std::vector<int64_t>{}));
  EXPECT_EQ(LoaderCount(7, 3, 0), 3);
  EXPECT_EQ(LoaderCount(7, 3, 2), 2);
  EXPECT_EQ(LoaderCount(2, 4, 2), 0);
  EXPECT_EQ(LoaderOffset(7, 3, 0), 0);
  EXPECT_EQ(LoaderOffset(7, 3, 1), 3);
  EXPECT_EQ(LoaderOffset(7, 3, 2), 5);
  std::vector<SampleLength> v;
  for (int64_t i = 0; i < 7; ++i) v.push_back({100 + i, 1 + i, i});
  const std::vector<SampleLength> s = ToSchedulingOrder(v, 3);
  std::vector<int64_t> ids;
  for (const SampleLength& x : s) ids.push_back(x.id);
  EXPECT_EQ(ids, (std::vector<int64_t>{100, 103, 106, 101, 104, 102, 105}));
}

}  // namespace
}  // namespace thdpack

namespace thdpack {
namespace {

// A lengths file of 1..23 random lengths in [1, max_length] at `path`; returns them.
std::vector<int64_t> RandomLengthsFile(std::mt19937_64& rng, const std::string& path,
                                       int64_t max_length) {
  std::vector<int64_t> file(1 + rng() % 23);
  std::string text;
  for (int64_t& v : file) {
    v = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_length));
    text += std::to_string(v) + "\n";
  }
  testing_util::WriteText(path, text);
  return file;
}

// Random files, batch sizes and DP against a plain reference: step s holds the samples at
// global positions s*N .. s*N + N - 1 of the endless sequence of epochs (id = position, length
// = file[position mod size], epoch = the first one's position / size), and loader d gets
// positions with (position - s*N) mod DP = d, in order.
TEST(StepReaderRandom, MatchesThePlainRule) {
  std::mt19937_64 rng(20260);
  testing_util::TempDir dir;
  for (int trial = 0; trial < 60; ++trial) {
    const std::string path = dir.File("t" + std::to_string(trial) + ".txt");
    const std::vector<int64_t> file = RandomLengthsFile(rng, path, 1000);
    const int size = static_cast<int>(file.size());
    auto source = OpenLengthsSource(path);
    ASSERT_TRUE(source.ok());
    const int dp = 1 + static_cast<int>(rng() % 6);
    const bool all = rng() % 5 == 0;
    const int64_t n = all ? size : 1 + static_cast<int64_t>(rng() % 40);
    auto reader = StepReader::Create(source->get(), all ? 0 : n, dp);
    ASSERT_TRUE(reader.ok());
    for (int64_t s = 0; s < 4; ++s) {
      auto step = reader->Next();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      ASSERT_EQ(static_cast<int64_t>(step->samples.size()), n);
      EXPECT_EQ(step->step, s);
      EXPECT_EQ(step->epoch, s * n / size);
      size_t k = 0;
      for (int d = 0; d < dp; ++d) {
        for (int64_t i = 0; i < n; ++i) {
          if (i % dp != d) continue;
          const int64_t pos = s * n + i;
          const SampleLength& got = step->samples[k++];
          EXPECT_EQ(got.id, pos);
          EXPECT_EQ(got.length, file[static_cast<size_t>(pos % size)]);
          EXPECT_EQ(got.n_targets, got.length - 1);
        }
      }
    }
  }
}

// Token steps (TokenSteps): on random files, budgets, minimum counts and DP, every step equals
// the plain rule worked out here from the file (samples in stream order while their tokens stay
// within B, the first always, and while fewer than min_samples of them are no longer than
// longest_counted; the stream wraps into the next epoch), every loader's share is its part of
// that step, and Start at step k continues exactly where k steps end.
TEST(StepReaderRandom, TokenStepsMatchThePlainRule) {
  std::mt19937_64 rng(4242);
  testing_util::TempDir dir;
  for (int trial = 0; trial < 90; ++trial) {
    const std::string path = dir.File("k" + std::to_string(trial) + ".txt");
    const std::vector<int64_t> file = RandomLengthsFile(rng, path, 500);
    const int size = static_cast<int>(file.size());
    const int dp = 1 + static_cast<int>(rng() % 5);
    TokenSteps rule;
    // Budgets from below one sample (every step one sample) to several epochs.
    rule.tokens = 1 + static_cast<int64_t>(rng() % (trial % 3 == 0 ? 300 : 4000));
    // A third of the trials without a minimum; the others up to 3 x DP samples a step, with a
    // longest counted length at or above the file's shortest (some sample always counts).
    if (trial % 3 != 1) {
      rule.min_samples = 1 + static_cast<int64_t>(rng() % (3 * dp));
      if (rng() % 2 == 0) {
        rule.longest_counted = *std::min_element(file.begin(), file.end()) +
                               static_cast<int64_t>(rng() % 400);
      }
    }
    const int64_t budget = rule.tokens;
    constexpr int kSteps = 5;
    // The plain rule.
    std::vector<std::vector<int64_t>> want;  // positions of each step
    int64_t pos = 0;
    auto length = [&](int64_t p) { return file[static_cast<size_t>(p % size)]; };
    for (int s = 0; s < kSteps; ++s) {
      std::vector<int64_t> step;
      int64_t tokens = 0;
      int64_t counted = 0;
      while (step.empty() || counted < rule.min_samples || tokens + length(pos) <= budget) {
        tokens += length(pos);
        if (length(pos) <= rule.longest_counted) ++counted;
        step.push_back(pos++);
      }
      want.push_back(step);
    }
    auto source = OpenLengthsSource(path);
    ASSERT_TRUE(source.ok());
    auto reader = StepReader::Create(source->get(), 7, dp, rule);
    ASSERT_TRUE(reader.ok());
    for (int s = 0; s < kSteps; ++s) {
      auto step = reader->Next();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      const auto& w = want[static_cast<size_t>(s)];
      ASSERT_EQ(step->samples.size(), w.size()) << "trial " << trial << " step " << s;
      size_t k = 0;
      for (int d = 0; d < dp; ++d) {  // scheduling order: loader 0's first
        for (size_t i = static_cast<size_t>(d); i < w.size(); i += static_cast<size_t>(dp)) {
          EXPECT_EQ(step->samples[k].id, w[i]);
          EXPECT_EQ(step->samples[k++].length, file[static_cast<size_t>(w[i] % size)]);
        }
      }
      EXPECT_EQ(step->epoch, w.front() / size);
    }
    EXPECT_EQ(reader->consumed(), want.back().back() + 1);
    // Every loader's share, each on its own source.
    for (int d = 0; d < dp; ++d) {
      auto own = OpenLengthsSource(path);
      auto r = StepReader::Create(own->get(), 7, dp, rule);
      ASSERT_TRUE(r.ok());
      for (int s = 0; s < kSteps; ++s) {
        auto share = r->NextShare(d);
        ASSERT_TRUE(share.ok()) << share.status().ToString();
        const auto& w = want[static_cast<size_t>(s)];
        EXPECT_EQ(share->n, static_cast<int64_t>(w.size()));
        EXPECT_EQ(share->first_id, w.front());
        size_t k = 0;
        for (size_t i = static_cast<size_t>(d); i < w.size(); i += static_cast<size_t>(dp)) {
          ASSERT_LT(k, share->samples.size());
          EXPECT_EQ(share->samples[k++].id, w[i]);
        }
        EXPECT_EQ(k, share->samples.size());
      }
    }
    // Start at step 3 with no saved position: the steps of a run from 0.
    auto again = OpenLengthsSource(path);
    auto r = StepReader::Create(again->get(), 7, dp, rule);
    ASSERT_TRUE(r->Start(3, -1, std::nullopt).ok());
    EXPECT_EQ(r->consumed(), want[3].front());
    auto step = r->Next();
    ASSERT_TRUE(step.ok());
    EXPECT_EQ(step->step, 3);
    EXPECT_EQ(step->samples.size(), want[3].size());
  }
  EXPECT_FALSE(StepReader::Create(nullptr, 1, 1, TokenSteps{5}).ok());
  testing_util::TempDir d;
  testing_util::WriteText(d.File("one.txt"), "3\n9\n");
  auto one = OpenLengthsSource(d.File("one.txt"));
  EXPECT_FALSE(StepReader::Create(one->get(), 1, 1, TokenSteps{-1}).ok());
  EXPECT_FALSE(StepReader::Create(one->get(), 1, 1, TokenSteps{5, 0}).ok());
  // No sample counts (every one longer than longest_counted): an error naming the source,
  // never an endless read.
  auto none = StepReader::Create(one->get(), 1, 1, TokenSteps{5, 2, 2});
  ASSERT_TRUE(none.ok());
  auto step = none->Next();
  ASSERT_FALSE(step.ok());
  EXPECT_NE(step.status().message().find("holds no sample of at most 2 tokens"),
            std::string::npos) << step.status().ToString();
  // TokenStepsFor: the schedule's minimum (DP x k static, DP x M fixed, 1 dynamic) and, under
  // oversize skip only, its longest kept length.
  ScheduleOptions o;
  o.dp_size = 3;
  o.max_tokens_per_rank = 100;
  o.microbatch_multiple = 2;
  auto t = TokenStepsFor(1000, o);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->tokens, 1000);
  EXPECT_EQ(t->min_samples, 6);
  EXPECT_EQ(t->longest_counted, INT64_MAX);
  o.num_microbatches = 4;
  o.oversize = ScheduleOptions::OversizePolicy::kSkip;
  t = TokenStepsFor(1000, o);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->min_samples, 12);
  EXPECT_EQ(t->longest_counted, 100);
  EXPECT_EQ(TokenStepsFor(0, o)->tokens, 0);
  EXPECT_FALSE(TokenStepsFor(-5, o).ok());
}

// A lengths source whose size hint is wrong (or absent): Next then cannot place samples by the
// hint and falls back to the plain reorder; the steps must be the same as with a true hint.
class WrongHintSource final : public SampleSource {
 public:
  WrongHintSource(std::unique_ptr<SampleSource> inner, std::optional<int64_t> hint)
      : inner_(std::move(inner)), hint_(hint) {}
  Result<std::optional<Sample>> Next() override { return inner_->Next(); }
  Result<std::optional<SampleLength>> NextLength() override { return inner_->NextLength(); }
  Status Reset() override { return inner_->Reset(); }
  std::optional<int64_t> size_hint() const override { return hint_; }
  int64_t epoch() const override { return inner_->epoch(); }
  const std::string& spec() const override { return inner_->spec(); }

 private:
  std::unique_ptr<SampleSource> inner_;
  std::optional<int64_t> hint_;
};

TEST(StepReaderRandom, AWrongSizeHintGivesTheSameSteps) {
  std::mt19937_64 rng(20261);
  testing_util::TempDir dir;
  for (int trial = 0; trial < 60; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int size = 1 + static_cast<int>(rng() % 23);
    std::string text;
    for (int i = 0; i < size; ++i) text += std::to_string(1 + rng() % 1000) + "\n";
    const std::string path = dir.File("h" + std::to_string(trial) + ".txt");
    testing_util::WriteText(path, text);
    const int dp = 1 + static_cast<int>(rng() % 6);
    const int64_t global_batch = rng() % 2 ? 0 : 1 + static_cast<int64_t>(rng() % 40);
    std::optional<int64_t> hint;
    if (rng() % 3) hint = std::max<int64_t>(1, size + static_cast<int64_t>(rng() % 7) - 3);
    auto truth = OpenLengthsSource(path);
    auto inner = OpenLengthsSource(path);
    ASSERT_TRUE(truth.ok() && inner.ok());
    WrongHintSource lying(std::move(inner).value(), hint);
    auto a = StepReader::Create(truth->get(), global_batch, dp);
    auto b = StepReader::Create(&lying, global_batch, dp);
    ASSERT_TRUE(a.ok() && b.ok());
    for (int s = 0; s < 3; ++s) {
      auto x = a->Next();
      auto y = b->Next();
      ASSERT_TRUE(x.ok() && y.ok());
      EXPECT_EQ(x->step, y->step);
      EXPECT_EQ(x->epoch, y->epoch);
      EXPECT_EQ(Ids(*x), Ids(*y));
      EXPECT_EQ(Lengths(*x), Lengths(*y));
    }
  }
}

// NextShare (the step runner's read) against Next (plan's) on fresh random inputs: every
// loader's share is its run of Next's step (same ids, lengths, order), the shares together
// are the step, and steps, epochs and wrap-around agree, "all" included.
TEST(StepReaderShare, SharesOfEveryLoaderMakeNextsStep) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));  // a failure can be replayed with it
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (int trial = 0; trial < 30; ++trial) {
    const int64_t size = 1 + static_cast<int64_t>(rng() % 30);
    std::string text;
    for (int64_t i = 0; i < size; ++i) text += std::to_string(1 + rng() % 100) + "\n";
    const std::string path = dir.File("share" + std::to_string(trial) + ".txt");
    WriteText(path, text);
    const int dp = 1 + static_cast<int>(rng() % 5);
    const int64_t global_batch = rng() % 4 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 40);
    auto plan_source = OpenLengthsSource(path);
    ASSERT_TRUE(plan_source.ok());
    auto plan_reader = StepReader::Create(plan_source->get(), global_batch, dp);
    ASSERT_TRUE(plan_reader.ok());
    std::vector<std::unique_ptr<SampleSource>> sources;
    std::vector<StepReader> loaders;
    for (int d = 0; d < dp; ++d) {
      auto src = OpenLengthsSource(path);
      ASSERT_TRUE(src.ok());
      sources.push_back(std::move(*src));
      auto r = StepReader::Create(sources.back().get(), global_batch, dp);
      ASSERT_TRUE(r.ok());
      loaders.push_back(std::move(*r));
    }
    for (int64_t s = 0; s < 4; ++s) {
      auto want = plan_reader->Next();
      ASSERT_TRUE(want.ok()) << want.status().ToString();
      const int64_t n = static_cast<int64_t>(want->samples.size());
      for (int d = 0; d < dp; ++d) {
        auto share = loaders[static_cast<size_t>(d)].NextShare(d);
        ASSERT_TRUE(share.ok()) << share.status().ToString();
        EXPECT_EQ(share->step, want->step);
        EXPECT_EQ(share->epoch, want->epoch);
        EXPECT_EQ(share->n, n);
        ASSERT_EQ(static_cast<int64_t>(share->samples.size()), LoaderCount(n, dp, d));
        const int64_t offset = LoaderOffset(n, dp, d);
        for (size_t k = 0; k < share->samples.size(); ++k) {
          const SampleLength& w = want->samples[static_cast<size_t>(offset) + k];
          const Sample& got = share->samples[k];
          EXPECT_EQ(got.id, w.id);
          EXPECT_EQ(static_cast<int64_t>(got.tokens.size()), w.length);
          EXPECT_EQ(got.id - share->first_id, d + static_cast<int64_t>(k) * dp);
        }
      }
    }
  }
}

// A Megatron dataset with empty documents: their ids are used up but belong to no sample, so a
// step's ids have gaps. Every loader's share still makes Next()'s step, the ids increase inside
// [first_id, first_id + id_span), and each step counts the empty documents it passed over.
TEST(StepReaderShare, EmptyMegatronDocumentsLeaveGapsInTheIds) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));  // a failure can be replayed with it
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (int trial = 0; trial < 20; ++trial) {
    const std::string prefix = dir.File("m" + std::to_string(trial));
    auto w = MegatronWriter::Create(prefix, MegatronDType::kUint16);
    ASSERT_TRUE(w.ok());
    const int docs = 1 + static_cast<int>(rng() % 25);
    int64_t empty = 0;
    for (int k = 0; k < docs; ++k) {
      if (k > 0 && rng() % 3 == 0) {
        ++empty;  // no sequence (Megatron's add_document([], []))
      } else {
        ASSERT_TRUE((*w)->AddSequence(std::vector<int64_t>(1 + rng() % 9, 7)).ok());
      }
      ASSERT_TRUE((*w)->EndDocument().ok());
    }
    ASSERT_TRUE((*w)->Finish().ok());
    const int dp = 1 + static_cast<int>(rng() % 4);
    const int64_t global_batch = rng() % 4 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 30);
    auto plan_source = OpenSource("megatron:" + prefix);
    ASSERT_TRUE(plan_source.ok()) << plan_source.status().ToString();
    auto plan_reader = StepReader::Create(plan_source->get(), global_batch, dp);
    ASSERT_TRUE(plan_reader.ok());
    std::vector<std::unique_ptr<SampleSource>> sources;
    std::vector<StepReader> loaders;
    for (int d = 0; d < dp; ++d) {
      auto src = OpenSource("megatron:" + prefix);
      ASSERT_TRUE(src.ok());
      sources.push_back(std::move(*src));
      auto r = StepReader::Create(sources.back().get(), global_batch, dp);
      ASSERT_TRUE(r.ok());
      loaders.push_back(std::move(*r));
    }
    int64_t total_empty = 0;
    int64_t last_id = -1;
    for (int64_t s = 0; s < 4; ++s) {
      auto want = plan_reader->Next();
      ASSERT_TRUE(want.ok()) << want.status().ToString();
      const int64_t n = static_cast<int64_t>(want->samples.size());
      if (global_batch > 0) EXPECT_EQ(n, global_batch);  // empty documents do not count
      if (global_batch == 0) EXPECT_EQ(n, docs - empty);
      total_empty += want->n_empty;
      std::vector<int64_t> ids;
      for (const SampleLength& x : want->samples) ids.push_back(x.id);
      std::sort(ids.begin(), ids.end());
      EXPECT_GT(ids.front(), last_id);
      last_id = ids.back();
      for (int d = 0; d < dp; ++d) {
        auto share = loaders[static_cast<size_t>(d)].NextShare(d);
        ASSERT_TRUE(share.ok()) << share.status().ToString();
        EXPECT_EQ(share->n, n);
        EXPECT_EQ(share->n_empty, want->n_empty);
        EXPECT_EQ(share->first_id, ids.front());
        EXPECT_EQ(share->id_span, ids.back() - ids.front() + 1);
        EXPECT_LE(share->id_span, n + want->n_empty);
        const int64_t offset = LoaderOffset(n, dp, d);
        ASSERT_EQ(static_cast<int64_t>(share->samples.size()), LoaderCount(n, dp, d));
        for (size_t k = 0; k < share->samples.size(); ++k) {
          const SampleLength& x = want->samples[static_cast<size_t>(offset) + k];
          EXPECT_EQ(share->samples[k].id, x.id);
          EXPECT_EQ(static_cast<int64_t>(share->samples[k].tokens.size()), x.length);
        }
      }
    }
    // Every empty document read past is counted once: the source's count is the steps' sum.
    EXPECT_EQ(total_empty, (*plan_source)->skipped_empty());
    if (empty > 0 && global_batch == 0) EXPECT_EQ(total_empty, 4 * empty);
  }
}

// A source that reads its lengths one at a time only: NextLengths is SampleSource's default
// loop over NextLength, the plain reference of the sources' batched reads.
class OneByOneSource final : public SampleSource {
 public:
  explicit OneByOneSource(std::unique_ptr<SampleSource> inner) : inner_(std::move(inner)) {}
  Result<std::optional<Sample>> Next() override { return inner_->Next(); }
  Result<std::optional<SampleLength>> NextLength() override { return inner_->NextLength(); }
  Status Reset() override { return inner_->Reset(); }
  std::optional<int64_t> size_hint() const override { return inner_->size_hint(); }
  int64_t epoch() const override { return inner_->epoch(); }
  const std::string& spec() const override { return inner_->spec(); }
  int64_t skipped_empty() const override { return inner_->skipped_empty(); }

 private:
  std::unique_ptr<SampleSource> inner_;
};

// The reader's batched length reads (NextLengths, many samples per call) give the same steps
// and shares as one NextLength per sample, on sources of up to a few thousand samples (so
// steps span several batches and wrap around), lengths and Megatron with empty documents,
// shuffled or not, at several DP sizes and global batches, "all" included.
TEST(StepReaderRandom, BatchedReadsEqualOneByOneReads) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));  // a failure can be replayed with it
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (int trial = 0; trial < 16; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int64_t size = 1 + static_cast<int64_t>(rng() % 5000);
    std::string spec;
    if (trial % 2 == 0) {
      std::string text;
      for (int64_t i = 0; i < size; ++i) text += std::to_string(1 + rng() % 9000) + "\n";
      const std::string path = dir.File("b" + std::to_string(trial) + ".txt");
      WriteText(path, text);
      spec = "lengths:" + path;
    } else {
      const std::string prefix = dir.File("b" + std::to_string(trial));
      auto w = MegatronWriter::Create(prefix, MegatronDType::kUint16);
      ASSERT_TRUE(w.ok());
      for (int64_t k = 0; k < size; ++k) {
        if (k == 0 || rng() % 4 != 0) {  // else an empty document
          ASSERT_TRUE((*w)->AddSequence(std::vector<int64_t>(1 + rng() % 9, 7)).ok());
        }
        ASSERT_TRUE((*w)->EndDocument().ok());
      }
      ASSERT_TRUE((*w)->Finish().ok());
      spec = "megatron:" + prefix;
    }
    SourceOptions options;
    options.shuffle = rng() % 2 == 0;
    const int dp = std::vector<int>{1, 2, 3, 8, 64, 512, 1500}[rng() % 7];
    const int64_t global_batch =
        rng() % 3 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * size));
    SCOPED_TRACE(spec + " dp " + std::to_string(dp) + " global batch " +
                 std::to_string(global_batch));
    auto fast = OpenSource(spec, options);
    auto plain_inner = OpenSource(spec, options);
    ASSERT_TRUE(fast.ok() && plain_inner.ok());
    OneByOneSource plain(std::move(plain_inner).value());
    auto a = StepReader::Create(fast->get(), global_batch, dp);
    auto b = StepReader::Create(&plain, global_batch, dp);
    ASSERT_TRUE(a.ok() && b.ok());
    for (int s = 0; s < 3; ++s) {
      auto x = a->Next();
      auto y = b->Next();
      ASSERT_TRUE(x.ok()) << x.status().ToString();
      ASSERT_TRUE(y.ok()) << y.status().ToString();
      EXPECT_EQ(x->step, y->step);
      EXPECT_EQ(x->epoch, y->epoch);
      EXPECT_EQ(x->n_empty, y->n_empty);
      EXPECT_EQ(Ids(*x), Ids(*y));
      EXPECT_EQ(Lengths(*x), Lengths(*y));
      ASSERT_EQ(x->samples.size(), y->samples.size());
      for (size_t k = 0; k < x->samples.size(); ++k) {
        EXPECT_EQ(x->samples[k].n_targets, y->samples[k].n_targets);
      }
    }
    // One loader's shares (its samples in full, the others' lengths in runs of DP - 1).
    const int loader = static_cast<int>(rng() % static_cast<uint64_t>(dp));
    auto fast2 = OpenSource(spec, options);
    auto plain2_inner = OpenSource(spec, options);
    ASSERT_TRUE(fast2.ok() && plain2_inner.ok());
    OneByOneSource plain2(std::move(plain2_inner).value());
    auto c = StepReader::Create(fast2->get(), global_batch, dp);
    auto d = StepReader::Create(&plain2, global_batch, dp);
    ASSERT_TRUE(c.ok() && d.ok());
    for (int s = 0; s < 2; ++s) {
      auto x = c->NextShare(loader);
      auto y = d->NextShare(loader);
      ASSERT_TRUE(x.ok()) << x.status().ToString();
      ASSERT_TRUE(y.ok()) << y.status().ToString();
      EXPECT_EQ(x->epoch, y->epoch);
      EXPECT_EQ(x->n, y->n);
      EXPECT_EQ(x->first_id, y->first_id);
      EXPECT_EQ(x->id_span, y->id_span);
      EXPECT_EQ(x->n_empty, y->n_empty);
      ASSERT_EQ(x->samples.size(), y->samples.size());
      for (size_t k = 0; k < x->samples.size(); ++k) {
        EXPECT_EQ(x->samples[k].id, y->samples[k].id);
        EXPECT_EQ(x->samples[k].tokens, y->samples[k].tokens);
      }
    }
  }
}

TEST(StepReaderShare, LoaderOutsideDpIsAnError) {
  TempDir dir;
  WriteText(dir.File("one.txt"), "5\n");
  auto src = OpenLengthsSource(dir.File("one.txt"));
  ASSERT_TRUE(src.ok());
  auto reader = StepReader::Create(src->get(), 1, 2);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->NextShare(2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->NextShare(-1).status().code(), StatusCode::kInvalidArgument);
}

// A fed share takes the ids a file source gives, their stream positions: the k-th sample of
// loader d in a step starting at position p has id p + k * DP + d (the file rule, written out
// here); a share of the wrong size, or a position the caller gave that is not the sample's,
// names the loader, the step and the sample.
TEST(FedSharesTest, IdsFollowTheFileRuleAndTheCountIsChecked) {
  for (const auto& [n, dp] : std::vector<std::pair<int64_t, int>>{{14, 2}, {10, 3}, {5, 8}}) {
    auto fed = FedShares::Create(n, dp);
    ASSERT_TRUE(fed.ok()) << fed.status().ToString();
    const int64_t first = 3 * n + 5;
    std::vector<int> seen(static_cast<size_t>(n), 0);
    for (int d = 0; d < dp; ++d) {
      std::vector<int64_t> want;  // the file rule, by hand
      for (int64_t k = 0; d + k * dp < n; ++k) want.push_back(first + k * dp + d);
      EXPECT_EQ(fed->Count(d), static_cast<int64_t>(want.size()));
      EXPECT_EQ(fed->Positions(first, d), want);
      std::vector<Sample> samples(want.size());
      for (auto& x : samples) x.tokens = {1, 2};
      auto share = fed->Share(3, first, d, samples, want);  // positions given: checked, equal
      ASSERT_TRUE(share.ok()) << share.status().ToString();
      EXPECT_EQ(share->first_id, first);
      EXPECT_EQ(share->n, n);
      ASSERT_EQ(share->samples.size(), want.size());
      for (size_t k = 0; k < want.size(); ++k) {
        EXPECT_EQ(share->samples[k].id, want[k]) << "n " << n << " dp " << dp;
        const auto slot = fed->SlotOf(first, want[k]);
        ASSERT_TRUE(slot.has_value());
        EXPECT_EQ(slot->loader, d);
        EXPECT_EQ(slot->index, static_cast<int64_t>(k));
        ++seen[static_cast<size_t>(want[k] - first)];
      }
    }
    // Every position of the step belongs to exactly one loader; none outside it.
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], 1) << i;
    EXPECT_FALSE(fed->SlotOf(first, first - 1).has_value());
    EXPECT_FALSE(fed->SlotOf(first, first + n).has_value());
    EXPECT_EQ(fed->NextFirst(first), first + n);
    EXPECT_EQ(fed->FirstBefore(fed->NextFirst(first)), first);
  }
  auto fed = FedShares::Create(10, 3);
  ASSERT_TRUE(fed.ok());
  auto fewer = fed->Share(2, 20, 1, std::vector<Sample>(2));
  ASSERT_FALSE(fewer.ok());
  EXPECT_NE(fewer.status().message().find(
                "loader dp=1, step 2: ended after 2 of the 3 samples of its share of the batch "
                "of 10"),
            std::string::npos)
      << fewer.status().ToString();
  auto more = fed->Share(2, 20, 2, std::vector<Sample>(4));
  ASSERT_FALSE(more.ok());
  EXPECT_NE(more.status().message().find("loader dp=2, step 2: holds 4 samples; its share of the "
                                         "batch of 10 over DP 3 is 3"),
            std::string::npos)
      << more.status().ToString();
  // Loader 1 of the step at 20 yields 21, 24, 27: a caller that says 25 for its second sample
  // is refused, naming both; a position not given is not checked.
  const int64_t said[] = {21, 25, FedShares::kNotGiven};
  auto wrong = fed->Share(2, 20, 1, std::vector<Sample>(3), said);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("step 2, sample 1: position 25, expected 24"),
            std::string::npos)
      << wrong.status().ToString();
  const int64_t right[] = {21, FedShares::kNotGiven, 27};
  EXPECT_TRUE(fed->Share(2, 20, 1, std::vector<Sample>(3), right).ok());
  EXPECT_FALSE(FedShares::Create(0, 2).ok());
  EXPECT_FALSE(FedShares::Create(4, 0).ok());
}

}  // namespace
}  // namespace thdpack
