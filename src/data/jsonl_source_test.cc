#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "data/data_test_util.h"
#include "thdpack/data.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::TempDir;
using testing_util::WriteText;

TEST(JsonlSourceTest, ReadsSamplesMasksAndSkipsBlankLines) {
  TempDir dir;
  const std::string path = dir.File("a.jsonl");
  WriteText(path,
            "{\"input_ids\": [5, 6, 7], \"loss_mask\": [0, 1, 1], \"text\": \"a \\\"b\\\"\\n\"}\n"
            "\n"
            "   \t\n"
            "{\"meta\": {\"x\": [1, {\"y\": null}], \"z\": -1.5e3}, \"input_ids\":[9]}\r\n"
            "{\"input_ids\":[0,31999],\"loss_mask\":[1,0]}");  // no final newline
  SourceOptions options;
  options.vocab_size = 32000;
  auto s = OpenSource("jsonl:" + path, options);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE((*s)->size_hint().has_value());  // unknown before the first full pass
  auto a = (*s)->Next();
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(a->has_value());
  EXPECT_EQ((*a)->id, 0);
  EXPECT_EQ((*a)->tokens, (std::vector<TokenId>{5, 6, 7}));
  EXPECT_EQ((*a)->target_mask, (std::vector<uint8_t>{0, 1, 1}));
  EXPECT_EQ(NumTargets(**a), 2);
  auto b = (*s)->NextLength();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*b)->id, 1);
  EXPECT_EQ((*b)->length, 1);
  EXPECT_EQ((*b)->n_targets, 0);
  auto c = (*s)->Next();
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->tokens, (std::vector<TokenId>{0, 31999}));
  EXPECT_EQ((*c)->target_mask, (std::vector<uint8_t>{1, 0}));
  auto end = (*s)->Next();
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(end->has_value());
  EXPECT_EQ((*s)->size_hint(), 3);
  ASSERT_TRUE((*s)->Reset().ok());
  EXPECT_EQ((*s)->epoch(), 1);
  auto again = (*s)->Next();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->id, 3);
  EXPECT_EQ((*again)->tokens, (std::vector<TokenId>{5, 6, 7}));
}

TEST(JsonlSourceTest, EveryErrorNamesItsLine) {
  struct Case {
    const char* line;
    const char* what;
  };
  const Case cases[] = {
      {"[1,2]", "expected a JSON object, got array"},
      {"{\"input_ids\": [1, 2}", "not valid JSON"},
      {"{\"ids\": [1]}", "missing \"input_ids\""},
      {"{\"input_ids\": \"1 2\"}", "\"input_ids\" must be an array of integers, got string"},
      {"{\"input_ids\": []}", "\"input_ids\" is empty"},
      {"{\"input_ids\": [1, 2.5]}", "input_ids[1] is not an integer: 2.5"},
      {"{\"input_ids\": [1, \"2\"]}", "input_ids[1] is not an integer"},
      {"{\"input_ids\": [1, true]}", "input_ids[1] is not an integer"},
      {"{\"input_ids\": [1, -3]}", "input_ids[1] = -3 is negative"},
      {"{\"input_ids\": [100]}", "input_ids[0] = 100 is outside the vocabulary [0, 100)"},
      {"{\"input_ids\": [99999999999999999999]}", "input_ids[0] is not an integer"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": [1]}",
       "\"loss_mask\" has 1 entries but \"input_ids\" has 2"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": [1, 2]}", "loss_mask[1] = 2 is not 0 or 1"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": [1, -1]}", "loss_mask[1] = -1 is not 0 or 1"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": [1, true]}", "loss_mask[1] = true is not 0 or 1"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": \"11\"}", "\"loss_mask\" must be an array"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": null}", "\"loss_mask\" must be an array"},
      {"{\"input_ids\": [1]} x", "not valid JSON"},
      {"{\"input_ids\": [1], \"x\": 1e999}", "not valid JSON"},
  };
  TempDir dir;
  const std::string path = dir.File("bad.jsonl");
  SourceOptions options;
  options.vocab_size = 100;
  for (const Case& c : cases) {
    // Two good lines and a blank one first: the bad line is line 4.
    WriteText(path, std::string("{\"input_ids\":[1]}\n\n{\"input_ids\":[2,3]}\n") + c.line + "\n");
    auto s = OpenSource("jsonl:" + path, options);
    ASSERT_TRUE(s.ok());
    for (int i = 0; i < 2; ++i) ASSERT_TRUE((*s)->Next().ok()) << c.line;
    auto bad = (*s)->Next();
    ASSERT_FALSE(bad.ok()) << c.line;
    EXPECT_TRUE(Contains(bad.status().message(), path + ":4: ")) << bad.status().message();
    EXPECT_TRUE(Contains(bad.status().message(), c.what)) << bad.status().message();
    // The source stays broken.
    EXPECT_EQ((*s)->Next().status(), bad.status());
    EXPECT_EQ((*s)->Reset(), bad.status());
  }
  // Without a vocabulary, ids must fit int32.
  WriteText(path, "{\"input_ids\": [2147483648]}\n");
  auto s = OpenSource("jsonl:" + path);
  ASSERT_TRUE(s.ok());
  auto big = (*s)->Next();
  ASSERT_FALSE(big.ok());
  EXPECT_TRUE(Contains(big.status().message(), ":1: input_ids[0] = 2147483648 exceeds 2^31 - 1"))
      << big.status().message();
}

TEST(JsonlSourceTest, EmptyFileMissingFileAndShuffleAreErrors) {
  TempDir dir;
  WriteText(dir.File("empty.jsonl"), "\n \n");
  auto s = OpenSource("jsonl:" + dir.File("empty.jsonl"));
  ASSERT_TRUE(s.ok());
  auto r = (*s)->Next();
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Contains(r.status().message(), "holds no samples"));
  auto missing = OpenSource("jsonl:" + dir.File("none.jsonl"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
  SourceOptions options;
  options.shuffle = true;
  auto shuffled = OpenSource("jsonl:" + dir.File("empty.jsonl"), options);
  ASSERT_FALSE(shuffled.ok());
  EXPECT_EQ(shuffled.status().code(), StatusCode::kUnimplemented);
}

// A value nested 100,000 deep (in "input_ids" or beside it) is an error naming the line and
// the byte where the limit was passed, from both parsers and the source: no walk over the
// value (parsing, formatting the error, freeing it) recurses on the input's depth.
TEST(JsonlSourceTest, DeepNestingIsAnErrorNotACrash) {
  const int deep = 100000;
  const std::string ids_deep =
      "{\"input_ids\":" + std::string(deep, '[') + std::string(deep, ']') + "}";
  const std::string meta_deep = "{\"input_ids\":[1],\"meta\":" + std::string(deep, '{') +
                                std::string(deep, '}') + "}";
  for (const std::string& line : {ids_deep, meta_deep}) {
    Sample a, b;
    const Status fast = ParseJsonlLine(line, 0, "f:1", &a);
    const Status ref = ParseJsonlLineReference(line, 0, "f:1", &b);
    EXPECT_EQ(fast, ref);
    EXPECT_EQ(ref.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(ref.message(), "f:1: JSON nested deeper than 64 levels at byte "))
        << ref.message();
  }
  TempDir dir;
  const std::string path = dir.File("deep.jsonl");
  WriteText(path, "{\"input_ids\":[3]}\n" + ids_deep + "\n");
  auto s = OpenSource("jsonl:" + path);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE((*s)->Next().ok());
  auto bad = (*s)->Next();
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(bad.status().message(),
                       path + ":2: JSON nested deeper than 64 levels at byte 76 of the line"))
      << bad.status().message();
  // The limit itself: 64 levels are read (the object and 63 arrays in "meta"), 65 are not.
  auto nested = [](int arrays) {
    return "{\"input_ids\":[1],\"meta\":" + std::string(static_cast<size_t>(arrays), '[') +
           std::string(static_cast<size_t>(arrays), ']') + "}";
  };
  Sample ok;
  EXPECT_TRUE(ParseJsonlLine(nested(63), 0, "f:1", &ok).ok());
  EXPECT_EQ(ok.tokens, (std::vector<TokenId>{1}));
  EXPECT_TRUE(Contains(ParseJsonlLine(nested(64), 0, "f:1", &ok).message(), "deeper than 64"));
  // A structured value where a token belongs is described by type, not dumped.
  const Status nested_id = ParseJsonlLine("{\"input_ids\":[1,[[2,3]]]}", 0, "f:1", &ok);
  EXPECT_TRUE(Contains(nested_id.message(), "input_ids[1] is not an integer: an array of 1 entry"))
      << nested_id.message();
}

// A NUL byte does not end a line: the line is an error naming it and the byte, never read as
// the text before the NUL (which silently dropped the rest of the line).
TEST(JsonlSourceTest, NulByteIsAnErrorNamingLineAndByte) {
  TempDir dir;
  const std::string path = dir.File("nul.jsonl");
  const std::string nul_line = std::string("{\"input_ids\":[1]}") + '\0' +
                               "{\"input_ids\":[2,3,4,5,6]} x";
  WriteText(path, "{\"input_ids\":[7,8]}\n" + nul_line + "\n");
  auto s = OpenSource("jsonl:" + path);
  ASSERT_TRUE(s.ok());
  auto first = (*s)->Next();
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*first)->tokens, (std::vector<TokenId>{7, 8}));
  auto bad = (*s)->NextLength();
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), path + ":2: NUL byte at byte 17 of the line"))
      << bad.status().message();
  Sample a, b;
  EXPECT_EQ(ParseJsonlLine(nul_line, 0, "f:2", &a), ParseJsonlLineReference(nul_line, 0, "f:2", &b));
  // Inside a string too.
  const std::string in_string = std::string("{\"input_ids\":[1],\"t\":\"a") + '\0' + "\"}";
  EXPECT_TRUE(Contains(ParseJsonlLine(in_string, 0, "f:3", &a).message(), "NUL byte at byte 23"));
}

// A UTF-8 byte-order mark before the first line is not part of it.
TEST(JsonlSourceTest, ByteOrderMarkBeforeTheFirstLineIsSkipped) {
  TempDir dir;
  const std::string path = dir.File("bom.jsonl");
  WriteText(path, "\xEF\xBB\xBF{\"input_ids\":[4,5]}\n{\"input_ids\":[6]}\n");
  auto s = OpenSource("jsonl:" + path);
  ASSERT_TRUE(s.ok());
  for (int epoch = 0; epoch < 2; ++epoch) {
    auto a = (*s)->Next();
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ((*a)->tokens, (std::vector<TokenId>{4, 5}));
    auto b = (*s)->Next();
    ASSERT_TRUE(b.ok());
    EXPECT_EQ((*b)->tokens, (std::vector<TokenId>{6}));
    ASSERT_TRUE((*s)->Next().ok());
    ASSERT_TRUE((*s)->Reset().ok());
  }
  // Inside a line a BOM is not skipped (it is not JSON). (At the start of a later line the JSON
  // parser itself skips one, as it would at the start of a file: concatenated files read.)
  WriteText(path, "{\"input_ids\":[4,5]}\n{\"input_ids\":[6]}\xEF\xBB\xBF\n");
  auto t = OpenSource("jsonl:" + path);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Next().ok());
  auto bad = (*t)->Next();
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(bad.status().message(), path + ":2: ")) << bad.status().message();
}

// Random lines, mostly well-formed, some broken: the fast path and the reference agree on
// every one (same tokens and mask, or the same error).
TEST(JsonlSourceTest, FastPathMatchesReferenceOnRandomLines) {
  std::mt19937_64 rng(7);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  const char* fillers[] = {"\"t\":\"x\\ty\"", "\"n\":null", "\"b\":[true,false]", "\"f\":-0.25",
                           "\"o\":{\"k\":[1,[2]]}", "\"u\":\"\\u00e9\"", "\"e\":1E5", "\"z\":01",
                           "\"s\":\"caf\xc3\xa9\"", "\"bad\":\"\xff\""};
  const char* numbers[] = {"0", "7", "31999", "32000", "-1", "1.0", "007", "2147483648", "1e2",
                           " 5 ", "99999999999"};
  int fast_ok = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int n = 1 + pick(6);
    std::string ids = "[";
    std::string mask = "[";
    const bool weird = pick(4) == 0;
    for (int k = 0; k < n; ++k) {
      if (k > 0) {
        ids += ",";
        mask += pick(2) ? ", " : ",";
      }
      ids += weird ? numbers[pick(11)] : std::to_string(pick(32000));
      mask += weird && pick(5) == 0 ? "2" : (pick(2) ? "1" : "0");
    }
    if (weird && pick(3) == 0) mask += ",1";
    ids += "]";
    mask += "]";
    std::string line = "{";
    if (pick(3) == 0) line += std::string(fillers[pick(10)]) + ",";
    line += "\"input_ids\":" + ids;
    if (pick(2)) line += ",\"loss_mask\":" + mask;
    if (pick(3) == 0) line += std::string(", ") + fillers[pick(10)];
    line += pick(8) == 0 ? "} " : "}";
    if (weird && pick(6) == 0) line.pop_back();
    Sample fast, ref;
    const Status a = ParseJsonlLine(line, 32000, "f:1", &fast);
    const Status b = ParseJsonlLineReference(line, 32000, "f:1", &ref);
    ASSERT_EQ(a, b) << line;
    if (a.ok()) {
      ++fast_ok;
      EXPECT_EQ(fast.tokens, ref.tokens) << line;
      EXPECT_EQ(fast.target_mask, ref.target_mask) << line;
    }
  }
  EXPECT_GT(fast_ok, 1500);
}

// Not a timed test: prints lines per second of the reader (run with
// --gtest_also_run_disabled_tests).
TEST(JsonlSourceTest, DISABLED_Throughput) {
  TempDir dir;
  const std::string path = dir.File("big.jsonl");
  std::string text;
  std::mt19937_64 rng(1);
  const int lines = 50000;
  for (int i = 0; i < lines; ++i) {
    text += "{\"input_ids\":[";
    for (int k = 0; k < 256; ++k) text += (k ? "," : "") + std::to_string(rng() % 32000);
    text += "],\"loss_mask\":[";
    for (int k = 0; k < 256; ++k) text += k ? ",1" : "0";
    text += "]}\n";
  }
  WriteText(path, text);
  for (bool reference : {false, true}) {
    const auto t0 = std::chrono::steady_clock::now();
    int64_t tokens = 0;
    if (reference) {
      Sample s;
      size_t pos = 0;
      while (pos < text.size()) {
        const size_t nl = text.find('\n', pos);
        ASSERT_TRUE(ParseJsonlLineReference(std::string_view(text).substr(pos, nl - pos), 32000,
                                            "x", &s).ok());
        tokens += static_cast<int64_t>(s.tokens.size());
        pos = nl + 1;
      }
    } else {
      auto src = OpenSource("jsonl:" + path);
      ASSERT_TRUE(src.ok());
      while (true) {
        auto l = (*src)->Next();
        ASSERT_TRUE(l.ok());
        if (!l->has_value()) break;
        tokens += static_cast<int64_t>((*l)->tokens.size());
      }
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s: %d lines of 256 tokens in %.3f s: %.0f lines/s, %.1f M tokens/s\n",
                reference ? "nlohmann reference" : "jsonl source (fast path)", lines, sec,
                lines / sec, static_cast<double>(tokens) / sec / 1e6);
  }
}

}  // namespace
}  // namespace thdpack
