// The blend source: its stream against a plain reference (each source opened alone, the rule
// transcribed, a Reset where a source runs out) for mixes of every kind, by samples and by
// tokens; its cursors against reading (CursorAfter, Seek); its identity; and every config
// error named.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "thdpack/blend.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::WriteText;

// Five sources of five kinds, small so that they wrap around.
std::vector<std::string> WriteSources(const TempDir& dir, std::mt19937_64& rng) {
  WriteText(dir.File("m.json"),
            R"({"mode":"distribution","type":"lognormal","min_seq_len":2,"max_seq_len":90,)"
            R"("mean_seq_len":20,"lognormal_sigma":0.7})");
  std::string lengths;
  for (int i = 0; i < 7; ++i) lengths += std::to_string(1 + rng() % 300) + "\n";
  WriteText(dir.File("l.txt"), lengths);
  WriteText(dir.File("h.csv"), "length,count\n3,2\n50,0\n70,3\n");
  std::string jsonl;
  for (int i = 0; i < 5; ++i) {
    jsonl += "{\"input_ids\":[" + std::to_string(rng() % 99) + "," + std::to_string(rng() % 99) +
             "," + std::to_string(rng() % 99) + "],\"loss_mask\":[0,1," +
             std::to_string(rng() % 2) + "]}\n";
  }
  WriteText(dir.File("a.jsonl"), jsonl);
  auto w = MegatronWriter::Create(dir.File("g"), MegatronDType::kUint16);
  EXPECT_TRUE(w.ok());
  for (int d = 0; d < 6; ++d) {
    if (d % 3 != 1) {  // empty documents inside
      std::vector<int64_t> seq(static_cast<size_t>(1 + d * 7), d);
      EXPECT_TRUE((*w)->AddSequence(seq).ok());
    }
    EXPECT_TRUE((*w)->EndDocument().ok());
  }
  EXPECT_TRUE((*w)->Finish().ok());
  return {"mock:m.json", "lengths:l.txt", "histogram:h.csv", "jsonl:a.jsonl", "megatron:g"};
}

std::string BlendJson(const std::vector<std::string>& specs, const std::vector<double>& weights,
                      bool tokens, bool shuffle_some) {
  std::string json = "{\"sources\": [";
  for (size_t d = 0; d < specs.size(); ++d) {
    json += (d ? ", " : "") + std::string("{\"data\": \"") + specs[d] + "\", \"weight\": " +
            std::to_string(weights[d]);
    if (shuffle_some && specs[d].rfind("jsonl", 0) != 0 && d % 2 == 0) {
      json += ", \"shuffle\": true, \"seed\": " + std::to_string(100 + d);
    }
    json += "}";
  }
  return json + "], \"weight_by\": \"" + (tokens ? "tokens" : "samples") + "\"}";
}

// The reference: each source alone, the rule as Megatron writes it.
std::vector<Sample> Reference(const BlendConfig& config, const SourceOptions& options,
                              int64_t n) {
  std::vector<std::unique_ptr<SampleSource>> sources;
  std::vector<double> weights;
  for (const BlendEntry& e : config.sources) {
    SourceOptions o = options;
    if (e.shuffle) o.shuffle = *e.shuffle;
    if (e.seed) o.seed = *e.seed;
    auto s = OpenSource(e.data, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    sources.push_back(std::move(*s));
    weights.push_back(e.weight);
  }
  const std::vector<double> w = NormalizeWeights(weights);
  std::vector<int64_t> counts(w.size(), 0);
  int64_t units = 0;
  std::vector<Sample> out;
  for (int64_t i = 0; i < n; ++i) {
    const int d = LargestErrorReference(w, counts, units);
    auto next = sources[static_cast<size_t>(d)]->Next();
    EXPECT_TRUE(next.ok());
    if (!next->has_value()) {
      EXPECT_TRUE(sources[static_cast<size_t>(d)]->Reset().ok());
      next = sources[static_cast<size_t>(d)]->Next();
    }
    Sample s = std::move(**next);
    const int64_t amount =
        config.weight_by == BlendWeightBy::kTokens ? static_cast<int64_t>(s.tokens.size()) : 1;
    counts[static_cast<size_t>(d)] += amount;
    units += amount;
    s.id = i;
    s.source = d;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<Sample> Take(SampleSource& s, int64_t n) {
  std::vector<Sample> out;
  for (int64_t i = 0; i < n; ++i) {
    auto next = s.Next();
    EXPECT_TRUE(next.ok() && next->has_value()) << next.status().ToString();
    if (!next.ok() || !next->has_value()) break;
    out.push_back(std::move(**next));
  }
  return out;
}

void ExpectSame(const std::vector<Sample>& a, const std::vector<Sample>& b,
                const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t k = 0; k < a.size(); ++k) {
    ASSERT_EQ(a[k].id, b[k].id) << what << " sample " << k;
    ASSERT_EQ(a[k].source, b[k].source) << what << " sample " << k;
    ASSERT_EQ(a[k].tokens, b[k].tokens) << what << " sample " << k;
    ASSERT_EQ(a[k].target_mask, b[k].target_mask) << what << " sample " << k;
  }
}

TEST(BlendSourceTest, StreamEqualsThePlainRuleAndCursorsEqualReading) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::vector<std::string> specs = WriteSources(dir, rng);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<double> weights;
    for (size_t d = 0; d < specs.size(); ++d) {
      weights.push_back(trial == 0 ? 1.0 : 0.01 + static_cast<double>(rng() % 1000) / 10.0);
    }
    const bool tokens = trial % 2 == 1;
    const std::string path = dir.File("mix" + std::to_string(trial) + ".json");
    WriteText(path, BlendJson(specs, weights, tokens, trial >= 3));
    const std::string what = "trial " + std::to_string(trial) + (tokens ? " by tokens" : "");
    SourceOptions options;
    options.seed = 9;
    auto config = ReadBlendSpec(path);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    EXPECT_EQ((*config).sources[0].data, dir.File("m.json").insert(0, "mock:"));  // resolved
    auto blend = OpenSource("blend:" + path, options);
    ASSERT_TRUE(blend.ok()) << blend.status().ToString();
    EXPECT_TRUE((*blend)->endless());
    const int64_t n = 400;
    const std::vector<Sample> want = Reference(*config, options, n);
    ExpectSame(Take(**blend, n), want, what);
    // Lengths alone give the same ids, lengths and sources.
    auto lengths = OpenSource("blend:" + path, options);
    ASSERT_TRUE(lengths.ok());
    for (int64_t i = 0; i < n; ++i) {
      auto x = (*lengths)->NextLength();
      ASSERT_TRUE(x.ok() && x->has_value());
      ASSERT_EQ((**x).id, i);
      ASSERT_EQ((**x).source, want[static_cast<size_t>(i)].source) << what << " " << i;
      ASSERT_EQ((**x).length, static_cast<int64_t>(want[static_cast<size_t>(i)].tokens.size()));
    }
    // Cursors: computed after p samples equals reading p, and a blend moved there goes on
    // alike.
    for (int64_t p : {int64_t{0}, int64_t{1}, static_cast<int64_t>(rng() % 300), int64_t{299}}) {
      auto reader = OpenSource("blend:" + path, options);
      auto computer = OpenSource("blend:" + path, options);
      auto moved = OpenSource("blend:" + path, options);
      ASSERT_TRUE(reader.ok() && computer.ok() && moved.ok());
      Take(**reader, p);
      auto c = (*computer)->CursorAfter(p);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      EXPECT_TRUE(*c == (*reader)->cursor()) << what << " after " << p;
      EXPECT_EQ(c->samples(), p);
      ASSERT_TRUE((*moved)->Seek(*c).ok());
      ExpectSame(Take(**moved, 50), Take(**reader, 50), what + " after a seek");
    }
  }
}

TEST(BlendSourceTest, IdentityAndErrors) {
  std::mt19937_64 rng(1);
  TempDir dir;
  const std::vector<std::string> specs = WriteSources(dir, rng);
  auto identity = [&](const std::string& json) {
    WriteText(dir.File("x.json"), json);
    auto s = OpenSource("blend:" + dir.File("x.json"));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    auto id = (*s)->Identity();
    EXPECT_TRUE(id.ok());
    return *id;
  };
  const std::string a = identity(BlendJson(specs, {1, 2, 3, 4, 5}, false, false));
  EXPECT_NE(a, identity(BlendJson(specs, {1, 2, 3, 4, 6}, false, false)));
  EXPECT_NE(a, identity(BlendJson(specs, {1, 2, 3, 4, 5}, true, false)));
  EXPECT_NE(a, identity(BlendJson(specs, {1, 2, 3, 4, 5}, false, true)));
  EXPECT_EQ(a, identity(BlendJson(specs, {1, 2, 3, 4, 5}, false, false)));
  EXPECT_TRUE(Contains(a, "blend by samples of 5 sources: [0] weight 1.0")) << a;

  struct Case {
    std::string json;
    std::string words;
  };
  const std::vector<Case> cases = {
      {"[1]", "expected a JSON object"},
      {"{\"sources\": []}", "field \"sources\" must be a non-empty list"},
      {"{\"sources\": [{\"data\": \"mock\"}]}", "sources[0].weight must be a number"},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": 0}]}", "sources[0].weight = 0"},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": -2.5}]}", "a finite number > 0"},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": \"1\"}]}", "must be a number"},
      {"{\"sources\": [{\"weight\": 1}]}", "sources[0].data must be a source spec"},
      {"{\"sources\": [{\"data\": \"blend:x.json\", \"weight\": 1}]}", "a blend inside a blend"},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": 1, \"colour\": 1}]}",
       "sources[0].colour: unknown field"},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": 1}], \"weight_by\": \"bytes\"}",
       "\"weight_by\" = \"bytes\""},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": 1, \"shuffle\": 1}]}",
       "sources[0].shuffle must be true or false"},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": 1}, {\"data\": \"lengths:none.txt\", "
       "\"weight\": 1}]}",
       "sources[1] (lengths:"},
      {"{\"sources\": [{\"data\": \"mock\", \"weight\": 1}", "not valid JSON"},
  };
  for (const Case& c : cases) {
    WriteText(dir.File("bad.json"), c.json);
    auto s = OpenSource("blend:" + dir.File("bad.json"));
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_TRUE(Contains(s.status().message(), c.words)) << s.status().ToString();
    EXPECT_TRUE(Contains(s.status().message(), dir.File("bad.json"))) << s.status().ToString();
  }
  auto missing = OpenSource("blend:" + dir.File("none.json"));
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
  // Inline JSON.
  auto inline_blend = OpenSource(R"(blend:{"sources":[{"data":"mock","weight":2},{"data":"mock","weight":1,"seed":5}]})");
  ASSERT_TRUE(inline_blend.ok()) << inline_blend.status().ToString();
  // A jsonl source cannot shuffle: the blend says which one.
  WriteText(dir.File("sh.json"), "{\"sources\": [{\"data\": \"mock\", \"weight\": 1}, {\"data\": "
                                 "\"jsonl:a.jsonl\", \"weight\": 1, \"shuffle\": true}]}");
  auto shuffled = OpenSource("blend:" + dir.File("sh.json"));
  ASSERT_FALSE(shuffled.ok());
  EXPECT_TRUE(Contains(shuffled.status().message(), "sources[1]")) << shuffled.status().ToString();
}

}  // namespace
}  // namespace thdpack
