// The run state record: round trips on fresh random states, every truncation and every byte
// flip refused (never read back as another state), newer versions refused by name, the resume
// check field by field, and atomic files.
#include "thdpack/run_state.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <random>
#include <string>

#include "data/data_test_util.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::WriteText;

RunState RandomState(std::mt19937_64& rng) {
  RunState s;
  s.next_step = static_cast<int64_t>(rng() % 1000000);
  const bool fed = rng() % 4 == 0;
  DataFingerprint& d = s.data;
  if (fed) {
    d.source = SourceKind::kFed;
    s.consumed = static_cast<int64_t>(rng() >> 2);
  } else {
    d.source = rng() % 2 ? SourceKind::kMegatron : SourceKind::kJsonl;
    d.spec = std::string(SourceKindName(d.source)) + ":/data/set " + std::to_string(rng() % 100) + " \"quoted\" \xc3\xa9";
    d.identity = "index " + std::to_string(rng()) + " bytes";
    d.seed = rng();
    d.shuffle = rng() % 2;
    d.vocab_size = static_cast<int64_t>(rng() % 200000);
    SourceCursor c;
    c.epoch = static_cast<int64_t>(rng() % 50);
    c.epoch_size = 1 + static_cast<int64_t>(rng() % 100000);
    c.position = static_cast<int64_t>(rng() % static_cast<uint64_t>(c.epoch_size + 1));
    c.skipped_empty = static_cast<int64_t>(rng() % 10);
    c.next_id = c.epoch * c.epoch_size + c.position + c.skipped_empty;
    c.byte_offset = static_cast<int64_t>(rng() % 100000000);
    c.line = static_cast<int64_t>(rng() % 1000000);
    s.consumed = c.samples();
    s.cursor = c;
    if (rng() % 3 == 0) {  // a splitting source's cursor around it (design of data.h)
      SourceCursor split;
      split.epoch = c.epoch;
      split.position = c.position;
      split.skipped_empty = c.skipped_empty;
      split.split = {static_cast<int64_t>(rng() % 4), static_cast<int64_t>(rng() % 1000),
                     static_cast<int64_t>(rng() % 100), static_cast<int64_t>(rng() % 500),
                     static_cast<int64_t>(rng() % 400)};
      split.next_id = c.next_id + split.split[1] + split.split[0];
      split.parts = {c};
      s.consumed = split.samples();
      s.cursor = split;
    }
  }
  if (rng() % 2) {
    const char* policies[] = {"skip", "truncate", "split"};
    d.oversize = policies[rng() % 3];
    d.longest_kept = 1 + static_cast<int64_t>(rng() % 100000);
  }
  return s;
}

TEST(RunStateTest, RoundTripsOnRandomStates) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int k = 0; k < 200; ++k) {
    const RunState s = RandomState(rng);
    const std::string text = RunStateToJson(s);
    EXPECT_EQ(text.find('\n'), std::string::npos);
    auto back = ParseRunState(text);
    ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << text;
    EXPECT_TRUE(*back == s) << text;
    EXPECT_EQ(RunStateToJson(*back), text);
  }
}

// The record writes a cursor by the table of its fields (thdpack/data.h), the table the step's
// messages walk too: a cursor's keys are exactly the rows of its shape, at every level.
TEST(RunStateTest, CursorKeysAreTheRowsOfTheTable) {
  SourceCursor plain;
  plain.position = 2;
  plain.next_id = 2;
  SourceCursor blend;
  blend.position = blend.next_id = 4;
  blend.parts = {plain, plain};
  blend.taken = {2, 2};
  SourceCursor split = blend;
  split.split = {0, 1, 1, 2, 0};
  split.parts = {blend};
  split.taken.clear();
  auto rows = [](CursorShape shape) {
    std::set<std::string> names;
    for (const CursorField& f : SourceCursorFields()) {
      if (f.shape == CursorShape::kPlain || f.shape == shape) names.insert(std::string(f.name));
    }
    return names;
  };
  auto keys = [](const nlohmann::json& j) {
    std::set<std::string> names;
    for (const auto& [key, value] : j.items()) names.insert(key);
    return names;
  };
  RunState s;
  s.data.source = SourceKind::kMock;
  s.cursor = split;
  s.consumed = split.samples();
  const nlohmann::json j = nlohmann::json::parse(RunStateToJson(s))["cursor"];
  EXPECT_EQ(keys(j), rows(CursorShape::kSplit));
  EXPECT_EQ(keys(j["inner"]), rows(CursorShape::kBlend));
  EXPECT_EQ(keys(j["inner"]["parts"][1]), rows(CursorShape::kPlain));
  auto back = ParseRunState(RunStateToJson(s));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(*back == s);
}

TEST(RunStateTest, EveryTruncationAndByteFlipIsRefused) {
  std::mt19937_64 rng(20261127);
  const RunState s = RandomState(rng);
  const std::string text = RunStateToJson(s);
  for (size_t n = 0; n < text.size(); ++n) {
    auto r = ParseRunState(text.substr(0, n));
    ASSERT_FALSE(r.ok()) << "a record cut at " << n << " bytes was read";
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  }
  for (size_t i = 0; i < text.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = text;
      flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
      auto r = ParseRunState(flipped);
      if (r.ok()) {
        // JSON may read the same value from another spelling (an escape); never another state.
        EXPECT_TRUE(*r == s) << "byte " << i << " bit " << bit << " gave another state";
      } else {
        EXPECT_NE(r.status().code(), StatusCode::kOk);
      }
    }
  }
}

TEST(RunStateTest, NamesTheField) {
  RunState s;
  s.data.source = SourceKind::kMock;
  s.data.identity = "mock lognormal";
  s.cursor = SourceCursor{};
  s.cursor->epoch_size = 10;
  std::string text = RunStateToJson(s);
  // An edit with its checksum left as it was: refused as an edit.
  std::string edited = text;
  edited.replace(edited.find("\"next_step\":0"), 13, "\"next_step\":5");
  auto r = ParseRunState(edited, "ckpt/state.json");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "ckpt/state.json: field \"checksum\""))
      << r.status().ToString();
  EXPECT_TRUE(Contains(r.status().message(), "edited or damaged"));
  // A newer version: Unimplemented naming both.
  std::string newer = text;
  newer.replace(newer.find("\"version\":1"), 11, "\"version\":7");
  r = ParseRunState(newer);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(Contains(r.status().message(), "version 7")) << r.status().ToString();
  // Contradictions between fields, written with a good checksum (what a buggy writer could
  // produce): named.
  RunState bad = s;
  bad.consumed = 3;  // the cursor has 0 samples behind it
  r = ParseRunState(RunStateToJson(bad));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "field \"consumed\"")) << r.status().ToString();
  bad = s;
  bad.data.source = SourceKind::kFed;
  r = ParseRunState(RunStateToJson(bad));
  EXPECT_TRUE(Contains(r.status().message(), "field \"cursor\"")) << r.status().ToString();
  bad = s;
  bad.data.oversize = "skip";  // without its longest kept sample
  r = ParseRunState(RunStateToJson(bad));
  EXPECT_TRUE(Contains(r.status().message(), "data.longest_kept")) << r.status().ToString();
}

TEST(RunStateTest, CheckResumeNamesTheFieldAndBothValues) {
  DataFingerprint a;
  a.source = SourceKind::kMock;
  a.spec = "mock";
  a.identity = "mock lognormal min_seq_len 16";
  a.seed = 1234;
  a.mock_samples = 65536;
  EXPECT_TRUE(CheckResume(a, a).ok());
  struct Case {
    const char* words;
    void (*edit)(DataFingerprint&);
  };
  const Case cases[] = {
      {"a source of kind \"mock\"", [](DataFingerprint& f) { f.source = SourceKind::kLengths; }},
      {"data \"mock lognormal", [](DataFingerprint& f) { f.identity = "other"; }},
      {"seed 1234, this run has seed 99", [](DataFingerprint& f) { f.seed = 99; }},
      {"shuffle off, this run has shuffle on", [](DataFingerprint& f) { f.shuffle = true; }},
      {"vocab_size 0, this run has vocab_size 50", [](DataFingerprint& f) { f.vocab_size = 50; }},
      {"mock_samples 65536, this run has mock_samples 10",
       [](DataFingerprint& f) { f.mock_samples = 10; }},
      {"oversize policy \"error\", this run has oversize policy \"skip\"",
       [](DataFingerprint& f) { f.oversize = "skip"; }},
      {"oversize policy \"error\", this run has oversize policy \"truncate\"",
       [](DataFingerprint& f) { f.oversize = "truncate"; }},
  };
  for (const Case& c : cases) {
    DataFingerprint b = a;
    c.edit(b);
    Status s = CheckResume(a, b);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), c.words)) << s.ToString();
  }
  // What may change: the spec (a moved file), and for data read from files without a shuffle
  // the seed and the vocabulary (neither decides their samples).
  DataFingerprint moved = a;
  moved.spec = "mock:/elsewhere";
  EXPECT_TRUE(CheckResume(a, moved).ok());
  DataFingerprint file = a;
  file.source = SourceKind::kMegatron;
  file.mock_samples = 0;
  DataFingerprint reseeded = file;
  reseeded.seed = 7;
  reseeded.vocab_size = 128256;
  EXPECT_TRUE(CheckResume(file, reseeded).ok());
  reseeded.shuffle = file.shuffle = true;
  EXPECT_FALSE(CheckResume(file, reseeded).ok());  // shuffled: the seed decides the order
  DataFingerprint skip = a;
  skip.oversize = "skip";
  skip.longest_kept = 16384;
  DataFingerprint narrower = skip;
  narrower.longest_kept = 8192;
  Status s = CheckResume(skip, narrower);
  EXPECT_TRUE(Contains(s.message(), "16384, this run has a longest kept sample (--oversize skip) of 8192"))
      << s.ToString();
  // truncate keeps every sample but cuts at the longest kept length: it must not change either.
  skip.oversize = narrower.oversize = "truncate";
  s = CheckResume(skip, narrower);
  EXPECT_TRUE(Contains(s.message(), "(--oversize truncate) of 8192")) << s.ToString();
  narrower.oversize = "skip";
  EXPECT_FALSE(CheckResume(skip, narrower).ok());
  // split: the pieces are the stream's samples, so the longest piece must not change either.
  skip.oversize = narrower.oversize = "split";
  s = CheckResume(skip, narrower);
  EXPECT_TRUE(Contains(s.message(), "(--oversize split) of 8192")) << s.ToString();
  narrower.longest_kept = skip.longest_kept;
  EXPECT_TRUE(CheckResume(skip, narrower).ok());
}

TEST(RunStateTest, FilesAreWrittenAtomically) {
  TempDir dir;
  const std::string path = dir.File("state.json");
  std::mt19937_64 rng(3);
  const RunState a = RandomState(rng);
  const RunState b = RandomState(rng);
  ASSERT_TRUE(WriteRunStateFile(path, a).ok());
  ASSERT_TRUE(WriteRunStateFile(path, b).ok());  // over the old one
  auto back = ReadRunStateFile(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(*back == b);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);  // no temporary file left
  auto missing = ReadRunStateFile(dir.File("none.json"));
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
  EXPECT_TRUE(Contains(missing.status().message(), "none.json"));
  Status s = WriteRunStateFile(dir.File("no/such/folder/state.json"), a);
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  WriteText(path, RunStateToJson(a).substr(0, 40));
  auto cut = ReadRunStateFile(path);
  EXPECT_EQ(cut.status().code(), StatusCode::kCorruption);
  EXPECT_TRUE(Contains(cut.status().message(), path)) << cut.status().ToString();
}

}  // namespace
}  // namespace thdpack
