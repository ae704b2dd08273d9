#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "data/data_test_util.h"
#include "thdpack/data.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::WriteText;

MockConfig Lognormal(int64_t lo, int64_t hi, double mean, double sigma) {
  MockConfig c;
  c.mode = MockConfig::Mode::kDistribution;
  c.min_seq_len = lo;
  c.max_seq_len = hi;
  c.mean_seq_len = mean;
  c.lognormal_sigma = sigma;
  return c;
}

std::vector<Sample> ReadAll(SampleSource& source) {
  std::vector<Sample> out;
  while (true) {
    auto s = source.Next();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok() || !s->has_value()) break;
    out.push_back(std::move(**s));
  }
  return out;
}

TEST(MockTokensTest, DeterministicInRangeAndPinned) {
  const auto a = MockTokens(1234, 7, 1000, 32000);
  const auto b = MockTokens(1234, 7, 1000, 32000);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 1000u);
  for (TokenId t : a) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, 32000);
  }
  EXPECT_NE(a, MockTokens(1234, 8, 1000, 32000));  // another id
  EXPECT_NE(a, MockTokens(1235, 7, 1000, 32000));  // another seed
  // A prefix of a longer draw: the tokens of a sample do not depend on its length.
  const auto c = MockTokens(1234, 7, 10, 32000);
  EXPECT_TRUE(std::equal(c.begin(), c.end(), a.begin()));
  // Integer-only arithmetic: these values are the same on every platform.
  EXPECT_EQ(MockTokens(1234, 0, 4, 32000), (std::vector<TokenId>{20458, 5831, 15683, 19617}));
  // The default mock's first lengths for seed 1234 (libm exp/log/cos; glibc is correctly
  // rounded for these, so a change here means the generator changed).
  EXPECT_EQ(MockLength(kDefaultMockConfig, 1234, 0), 1193);
  EXPECT_EQ(MockLength(kDefaultMockConfig, 1234, 4), 1325);
  for (TokenId t : MockTokens(9, 9, 100, 1)) EXPECT_EQ(t, 0);
}

TEST(MockSourceTest, SameSeedSameLengthsAndTokensAnyReadOrder) {
  SourceOptions options;
  options.mock_num_samples = 50;
  options.seed = 42;
  auto a = OpenSource("mock", options);
  auto b = OpenSource("mock", options);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok());
  const auto sa = ReadAll(**a);
  // b is read as lengths first: the cursor and ids are shared by Next and NextLength.
  std::vector<SampleLength> lb;
  while (true) {
    auto l = (*b)->NextLength();
    ASSERT_TRUE(l.ok());
    if (!l->has_value()) break;
    lb.push_back(**l);
  }
  ASSERT_EQ(sa.size(), 50u);
  ASSERT_EQ(lb.size(), 50u);
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].id, static_cast<int64_t>(i));
    EXPECT_EQ(lb[i].id, static_cast<int64_t>(i));
    EXPECT_EQ(static_cast<int64_t>(sa[i].tokens.size()), lb[i].length);
    EXPECT_EQ(lb[i].n_targets, lb[i].length - 1);
    EXPECT_EQ(static_cast<int64_t>(sa[i].tokens.size()), MockLength(kDefaultMockConfig, 42, i));
    EXPECT_TRUE(sa[i].target_mask.empty());
    // Any rank can regenerate a sample from (seed, id, L).
    EXPECT_EQ(sa[i].tokens, MockTokens(42, sa[i].id, lb[i].length, kDefaultMockVocab));
    EXPECT_GE(lb[i].length, 16);
    EXPECT_LE(lb[i].length, 16384);
  }
  options.seed = 43;
  auto c = OpenSource("mock", options);
  ASSERT_TRUE(c.ok());
  const auto sc = ReadAll(**c);
  int same = 0;
  for (size_t i = 0; i < sc.size(); ++i) same += sc[i].tokens.size() == sa[i].tokens.size();
  EXPECT_LT(same, 10);
}

TEST(MockSourceTest, DefaultsAndVocab) {
  auto s = OpenSource("mock");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->size_hint(), kDefaultMockNumSamples);
  EXPECT_EQ((*s)->spec(), "mock");
  SourceOptions options;
  options.vocab_size = 7;
  options.mock_num_samples = 5;
  auto v = OpenSource("mock", options);
  ASSERT_TRUE(v.ok());
  for (const Sample& sample : ReadAll(**v)) {
    for (TokenId t : sample.tokens) EXPECT_LT(t, 7);
  }
  options.vocab_size = -1;
  EXPECT_FALSE(OpenSource("mock", options).ok());
  options.vocab_size = 0;
  options.mock_num_samples = -3;
  auto bad = OpenSource("mock", options);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(bad.status().message(), "mock_num_samples"));
}

TEST(MockSourceTest, LognormalMeanMatchesForABigDraw) {
  // Wide bounds so clipping does not move the mean; sigma 0.5 gives a relative standard error of
  // the mean of 0.53 / sqrt(200000) = 0.12%, so 2% is > 15 standard errors (and the seed is
  // fixed: the result is the same on every run).
  const MockConfig c = Lognormal(1, 1000000000, 1000.0, 0.5);
  const int n = 200000;
  double sum = 0, sum_log = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t l = MockLength(c, 2024, i);
    sum += static_cast<double>(l) + 0.5;  // int() truncates: +0.5 undoes it on average
    sum_log += std::log(static_cast<double>(l) + 0.5);
  }
  EXPECT_NEAR(sum / n, 1000.0, 20.0);
  EXPECT_NEAR(sum_log / n, std::log(1000.0) - 0.125, 0.01);  // mu = ln(m) - s^2/2
}

TEST(MockSourceTest, ClipsToMinAndMax) {
  const MockConfig c = Lognormal(100, 200, 150.0, 2.0);
  int at_min = 0, at_max = 0;
  for (int i = 0; i < 10000; ++i) {
    const int64_t l = MockLength(c, 1, i);
    ASSERT_GE(l, 100);
    ASSERT_LE(l, 200);
    at_min += l == 100;
    at_max += l == 200;
  }
  EXPECT_GT(at_min, 1000);
  EXPECT_GT(at_max, 1000);
  // sigma 0: every draw is the mean (int() of exp(ln m), which may round down by one).
  const MockConfig fixed = Lognormal(1, 5000, 1000.0, 0.0);
  for (int i = 0; i < 100; ++i) EXPECT_NEAR(MockLength(fixed, 3, i), 1000, 1);
}

TEST(MockSourceTest, ResetStartsTheNextEpochWithTheSameLengthsAndNewIds) {
  SourceOptions options;
  options.mock_num_samples = 20;
  auto s = OpenSource("mock", options);
  ASSERT_TRUE(s.ok());
  const auto first = ReadAll(**s);
  EXPECT_EQ((*s)->epoch(), 0);
  auto end = (*s)->Next();
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(end->has_value());  // stays at the end until Reset
  ASSERT_TRUE((*s)->Reset().ok());
  EXPECT_EQ((*s)->epoch(), 1);
  const auto second = ReadAll(**s);
  ASSERT_EQ(second.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(second[i].id, 20 + static_cast<int64_t>(i));  // epoch * size + index
    EXPECT_EQ(second[i].tokens.size(), first[i].tokens.size());
    EXPECT_EQ(second[i].tokens, MockTokens(options.seed, second[i].id,
                                           static_cast<int64_t>(second[i].tokens.size()),
                                           kDefaultMockVocab));
  }
}

TEST(MockSourceTest, ConfigFileDistribution) {
  TempDir dir;
  const std::string path = dir.File("mock.json");
  WriteText(path, R"({"mode":"distribution","type":"lognormal","min_seq_len":8,)"
                  R"("max_seq_len":64,"mean_seq_len":32,"lognormal_sigma":0.7,"extra":1})");
  auto c = ReadMockConfigFile(path);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->mode, MockConfig::Mode::kDistribution);
  EXPECT_EQ(c->min_seq_len, 8);
  EXPECT_EQ(c->max_seq_len, 64);
  EXPECT_EQ(c->mean_seq_len, 32.0);
  EXPECT_EQ(c->lognormal_sigma, 0.7);
  SourceOptions options;
  options.mock_num_samples = 100;
  auto s = OpenSource("mock:" + path, options);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->spec(), "mock:" + path);
  int64_t i = 0;
  for (const Sample& sample : ReadAll(**s)) {
    EXPECT_EQ(static_cast<int64_t>(sample.tokens.size()), MockLength(*c, options.seed, i++));
  }
  EXPECT_EQ(i, 100);
}

TEST(MockSourceTest, ConfigFileModeReadsLengthsRelativeToTheJson) {
  TempDir dir;
  std::filesystem::create_directory(dir.File("sub"));
  WriteText(dir.File("sub/lengths.csv"), "seq_len\n5\n3\n9\n");
  WriteText(dir.File("sub/mock.json"), R"({"mode":"file","path":"lengths.csv"})");
  auto s = OpenSource("mock:" + dir.File("sub/mock.json"));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->size_hint(), 3);
  const auto all = ReadAll(**s);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].tokens.size(), 5u);
  EXPECT_EQ(all[1].tokens.size(), 3u);
  EXPECT_EQ(all[2].tokens.size(), 9u);
  // Unlike Megatron's pandas reader, a numeric first line is data, not a header.
  WriteText(dir.File("sub/lengths.csv"), "5\n3\n");
  auto t = OpenSource("mock:" + dir.File("sub/mock.json"));
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->size_hint(), 2);
  // Errors in the lengths file name that file and line.
  WriteText(dir.File("sub/lengths.csv"), "len\n5\nx7\n");
  auto u = OpenSource("mock:" + dir.File("sub/mock.json"));
  ASSERT_FALSE(u.ok());
  EXPECT_TRUE(Contains(u.status().message(), "lengths.csv:3")) << u.status().message();
}

TEST(MockSourceTest, ConfigErrorsNameTheFileAndField) {
  struct Case {
    const char* json;
    const char* expect;
  };
  const Case cases[] = {
      {R"({"type":"lognormal"})", "\"mode\" is missing"},
      {R"({"mode":3})", "\"mode\" must be a string"},
      {R"({"mode":"uniform"})", "\"mode\" must be \"distribution\" or \"file\""},
      {R"({"mode":"file"})", "\"path\" is missing"},
      {R"({"mode":"file","path":""})", "\"path\" is empty"},
      {R"({"mode":"distribution","type":"normal","min_seq_len":1,"max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":1})",
       "\"type\" must be \"lognormal\""},
      {R"({"mode":"distribution","type":"lognormal","max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":1})",
       "\"min_seq_len\" is missing"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":"1","max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":1})",
       "\"min_seq_len\" must be an integer"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":1.5,"max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":1})",
       "\"min_seq_len\" must be an integer"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":9,"max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":1})",
       "\"min_seq_len\" must be <= max_seq_len (9 > 2)"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":0,"max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":1})",
       "\"min_seq_len\" must be >= 1"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":4294967296,"mean_seq_len":1,"lognormal_sigma":1})",
       "\"max_seq_len\" must be <= 2147483647"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":2,"lognormal_sigma":1})",
       "\"mean_seq_len\" is missing"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":2,"mean_seq_len":0,"lognormal_sigma":1})",
       "\"mean_seq_len\" must be > 0"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":-0.1})",
       "\"lognormal_sigma\" must be >= 0"},
      {R"({"mode":"distribution","type":"lognormal","min_seq_len":1,"max_seq_len":2,"mean_seq_len":1,"lognormal_sigma":null})",
       "\"lognormal_sigma\" must be a number"},
      {R"([1,2])", "must be a JSON object"},
      {R"({"mode":)", "not valid JSON"},
  };
  TempDir dir;
  const std::string path = dir.File("bad.json");
  for (const Case& c : cases) {
    WriteText(path, c.json);
    auto r = ReadMockConfigFile(path);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(r.status().message(), path)) << r.status().message();
    EXPECT_TRUE(Contains(r.status().message(), c.expect)) << r.status().message();
    auto s = OpenSource("mock:" + path);
    EXPECT_FALSE(s.ok());
  }
  auto missing = ReadMockConfigFile(dir.File("none.json"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
  EXPECT_TRUE(Contains(missing.status().message(), "none.json"));
}

// The config is JSON read as text: a BOM is skipped, a NUL byte or nesting past the limit is
// an error naming the file and byte (nlohmann stops at a NUL; formatting a deep value
// recursed), whichever field the value sits in.
TEST(MockSourceTest, ConfigTextBomNulAndDepth) {
  TempDir dir;
  const std::string path = dir.File("c.json");
  const std::string good =
      R"({"mode":"distribution","type":"lognormal","min_seq_len":4,"max_seq_len":9,)"
      R"("mean_seq_len":6,"lognormal_sigma":0.5)";
  WriteText(path, "\xEF\xBB\xBF" + good + "}");
  auto bom = ReadMockConfigFile(path);
  ASSERT_TRUE(bom.ok()) << bom.status().ToString();
  EXPECT_EQ(bom->min_seq_len, 4);
  EXPECT_EQ(bom->max_seq_len, 9);
  WriteText(path, good + "}" + std::string(1, '\0') + "garbage");
  auto nul = ReadMockConfigFile(path);
  ASSERT_FALSE(nul.ok());
  EXPECT_TRUE(Contains(nul.status().message(), path + ": NUL byte at byte " +
                                                   std::to_string(good.size() + 1) + " of the file"))
      << nul.status().message();
  const int deep = 100000;
  for (const std::string& field : {"min_seq_len", "extra"}) {
    WriteText(path, R"({"mode":"distribution","type":"lognormal",")" + field + "\":" +
                        std::string(deep, '[') + std::string(deep, ']') + "}");
    auto r = ReadMockConfigFile(path);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(Contains(r.status().message(), path + ": JSON nested deeper than 64 levels"))
        << r.status().message();
  }
}

TEST(MockSourceTest, ShuffleIsAPermutationOfTheSameLengths) {
  TempDir dir;
  std::string text;
  for (int i = 1; i <= 300; ++i) text += std::to_string(i) + "\n";
  WriteText(dir.File("l.txt"), text);
  SourceOptions options;
  options.shuffle = true;
  auto s = OpenSource("lengths:" + dir.File("l.txt"), options);
  ASSERT_TRUE(s.ok());
  std::vector<int64_t> e0, e1;
  for (auto* v : {&e0, &e1}) {
    while (true) {
      auto l = (*s)->NextLength();
      ASSERT_TRUE(l.ok());
      if (!l->has_value()) break;
      v->push_back((*l)->length);
    }
    ASSERT_TRUE((*s)->Reset().ok());
  }
  EXPECT_NE(e0, e1);  // a new permutation every epoch
  std::vector<int64_t> in_order(300);
  for (int i = 0; i < 300; ++i) in_order[i] = i + 1;
  EXPECT_NE(e0, in_order);
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e0, in_order);
  EXPECT_EQ(e1, in_order);
  // Deterministic: the same seed gives the same order.
  auto t = OpenSource("lengths:" + dir.File("l.txt"), options);
  ASSERT_TRUE(t.ok());
  auto a = (*t)->NextLength();
  auto s2 = OpenSource("lengths:" + dir.File("l.txt"), options);
  auto b = (*s2)->NextLength();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)->length, (*b)->length);
}

}  // namespace
}  // namespace thdpack
