#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "data/data_internal.h"
#include "data/data_test_util.h"
#include "thdpack/data.h"

namespace thdpack {
namespace {

using testing_util::Contains;
using testing_util::DataFile;
using testing_util::TempDir;
using testing_util::WriteText;

std::vector<SampleLength> AllLengths(SampleSource& source) {
  std::vector<SampleLength> out;
  while (true) {
    auto l = source.NextLength();
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    if (!l.ok() || !l->has_value()) break;
    out.push_back(**l);
  }
  return out;
}

TEST(LengthsSourceTest, ReadsLengthsWithHeaderCrlfAndTrailingBlankLines) {
  TempDir dir;
  WriteText(dir.File("a.txt"), "length\r\n12\r\n 7 \r\n1\n\n\n");
  auto v = ReadLengthsFile(dir.File("a.txt"));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, (std::vector<int32_t>{12, 7, 1}));
  auto s = OpenSource("lengths:" + dir.File("a.txt"));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->size_hint(), 3);
  auto first = (*s)->Next();
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(first->has_value());
  EXPECT_EQ((*first)->id, 0);
  EXPECT_EQ((*first)->tokens, MockTokens(SourceOptions().seed, 0, 12, kDefaultMockVocab));
  const auto rest = AllLengths(**s);
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0].id, 1);
  EXPECT_EQ(rest[0].length, 7);
  EXPECT_EQ(rest[0].n_targets, 6);
  EXPECT_EQ(rest[1].length, 1);
  EXPECT_EQ(rest[1].n_targets, 0);
  ASSERT_TRUE((*s)->Reset().ok());
  const auto again = AllLengths(**s);
  ASSERT_EQ(again.size(), 3u);
  EXPECT_EQ(again[0].id, 3);  // ids continue: epoch 1 starts at 1 * size
  EXPECT_EQ(again[0].length, 12);
}

// A UTF-8 byte-order mark before the first line is skipped by every reader of lengths and
// histograms (it made the first length a "header" and dropped it).
TEST(LengthsSourceTest, ByteOrderMarkBeforeTheFirstLineIsSkipped) {
  TempDir dir;
  const std::string bom = "\xEF\xBB\xBF";
  WriteText(dir.File("plain.txt"), bom + "12\n7\n");
  WriteText(dir.File("header.txt"), bom + "length\n12\n7\n");
  for (const char* name : {"plain.txt", "header.txt"}) {
    auto mapped = ReadLengthsFile(dir.File(name));
    ASSERT_TRUE(mapped.ok()) << mapped.status().ToString();
    EXPECT_EQ(*mapped, (std::vector<int32_t>{12, 7})) << name;
    auto by_line = data_internal::ReadLengthsFileByLine(dir.File(name), true);
    ASSERT_TRUE(by_line.ok()) << by_line.status().ToString();
    EXPECT_EQ(*by_line, (std::vector<int32_t>{12, 7})) << name;
  }
  auto source = OpenSource("lengths:" + dir.File("plain.txt"));
  ASSERT_TRUE(source.ok());
  EXPECT_EQ((*source)->size_hint(), 2);
  // Elsewhere a BOM is text, and an error.
  WriteText(dir.File("middle.txt"), "12\n" + bom + "7\n");
  auto middle = ReadLengthsFile(dir.File("middle.txt"));
  ASSERT_FALSE(middle.ok());
  EXPECT_TRUE(Contains(middle.status().message(), "middle.txt:2: length is not an integer"))
      << middle.status().message();
  // Histograms.
  WriteText(dir.File("h.csv"), bom + "length,count\n5,2\n9,1\n");
  auto h = ReadHistogramFile(dir.File("h.csv"));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->rows.size(), 2u);
  EXPECT_EQ(h->rows[0].length, 5);
  EXPECT_EQ(h->num_sequences, 3);
  WriteText(dir.File("h2.csv"), bom + "5,2\n");
  auto no_header = ReadHistogramFile(dir.File("h2.csv"));
  ASSERT_FALSE(no_header.ok());
  EXPECT_TRUE(Contains(no_header.status().message(), "h2.csv:1: missing header line"))
      << no_header.status().message();
}

TEST(LengthsSourceTest, ErrorsNameFileLineAndText) {
  struct Case {
    const char* text;
    const char* where;
    const char* what;
  };
  const Case cases[] = {
      {"5\nabc\n", ":2", "not an integer: \"abc\""},
      {"5\n7x\n", ":2", "not an integer: \"7x\""},
      {"5\n0\n", ":2", "must be >= 1, got 0"},
      {"-4\n", ":1", "must be >= 1, got -4"},
      {"3\n2147483648\n", ":2", "exceeds 2147483647"},
      {"3\n99999999999999999999\n", ":2", "not an integer"},
      {"3\n\n4\n", ":2", "blank line inside the file"},
      {"3\n4.5\n", ":2", "not an integer: \"4.5\""},
  };
  TempDir dir;
  const std::string path = dir.File("bad.txt");
  for (const Case& c : cases) {
    WriteText(path, c.text);
    auto s = OpenSource("lengths:" + path);
    ASSERT_FALSE(s.ok()) << c.text;
    EXPECT_TRUE(Contains(s.status().message(), path + c.where)) << s.status().message();
    EXPECT_TRUE(Contains(s.status().message(), c.what)) << s.status().message();
  }
  WriteText(path, "length\n");
  auto empty = OpenSource("lengths:" + path);
  ASSERT_FALSE(empty.ok());
  EXPECT_TRUE(Contains(empty.status().message(), "no lengths"));
  auto missing = OpenSource("lengths:" + dir.File("missing.txt"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
  EXPECT_FALSE(ReadLengthsFile(dir.File("bad.txt"), /*allow_header=*/false).ok());
}

// The mapped reader and the line-by-line reference on one file: the same lengths, or the same
// error. True when the file parsed.
bool ExpectReadersAgree(const std::string& path, bool header) {
  auto fast = ReadLengthsFile(path, header);
  auto plain = data_internal::ReadLengthsFileByLine(path, header);
  EXPECT_EQ(fast.ok(), plain.ok()) << (fast.ok() ? plain.status() : fast.status()).ToString();
  if (fast.ok() && plain.ok()) {
    EXPECT_EQ(*fast, *plain);
  } else if (!fast.ok() && !plain.ok()) {
    EXPECT_EQ(fast.status(), plain.status());
  }
  return fast.ok() && plain.ok();
}

// The mapped reader against the line-by-line reference on fresh random files: the same
// lengths, or the same error.
TEST(LengthsSourceTest, MappedReaderEqualsTheLineReaderOnRandomFiles) {
  TempDir dir;
  const std::vector<std::string> pieces = {"12", "7", "1", "123456789", "1234567890", " 9 ",
                                           "8\r", "007", "0", "-3", "+4", "x", "length", "",
                                           "\t", "99999999999", "2147483647", "2147483648"};
  std::mt19937_64 rng(51);
  for (int trial = 0; trial < 400; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::string text;
    const int lines = static_cast<int>(rng() % 12);
    for (int i = 0; i < lines; ++i) {
      // Mostly plain numbers, so that many files parse and the errors come at varied lines.
      text += rng() % 3 ? std::to_string(1 + rng() % 100000) : pieces[rng() % pieces.size()];
      if (i + 1 < lines || rng() % 2) text += '\n';
    }
    const std::string path = dir.File("r" + std::to_string(trial) + ".txt");
    WriteText(path, text);
    ExpectReadersAgree(path, rng() % 2 == 0);
  }
}

// The same on longer files (up to a few thousand lines, so the newline count runs over whole
// words and a tail), mostly lines the mapped reader's own loop takes (1 to 9 digits) among
// ones it hands to the line rules: 10 digits, zeros, signs, spaces, CR, headers, blank lines,
// a byte-order mark; the same lengths, or the same error (file, line, text).
TEST(LengthsSourceTest, MappedReaderEqualsTheLineReaderOnLongRandomFiles) {
  TempDir dir;
  const std::vector<std::string> odd = {"1234567890", "999999999", "000000001", "0", "00",
                                        "+7",         "-1",        " 12",       "12 ",
                                        "12\r",       "\t5",       "",          "len",
                                        "2147483647", "2147483648", "1e3",      "12x"};
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));  // a failure can be replayed with it
  std::mt19937_64 rng(seed);
  int parsed = 0;
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::string text;
    if (rng() % 8 == 0) text += "\xEF\xBB\xBF";
    if (rng() % 4 == 0) text += "length\n";
    const int lines = static_cast<int>(rng() % 3000);
    const uint64_t odd_every = 1 + rng() % 4000;  // many files hold no odd line at all
    for (int i = 0; i < lines; ++i) {
      if (rng() % odd_every == 0) {
        text += odd[rng() % odd.size()];
      } else {
        text += std::to_string(1 + rng() % (rng() % 2 ? 999999999 : 100000));
      }
      if (i + 1 < lines || rng() % 2) text += '\n';
    }
    for (uint64_t k = rng() % 3; k > 0; --k) text += '\n';  // trailing blank lines
    const std::string path = dir.File("long" + std::to_string(trial) + ".txt");
    WriteText(path, text);
    if (ExpectReadersAgree(path, rng() % 2 == 0)) ++parsed;
  }
  EXPECT_GT(parsed, 20);  // most files parse, so the lengths are compared, not only errors
}

TEST(LengthsSourceTest, RealWlbllmDocLengths) {
  const std::string path = DataFile("wlbllm_doc_lengths.txt");
  auto v = ReadLengthsFile(path);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->size(), 99519u);
  EXPECT_EQ(*std::max_element(v->begin(), v->end()), 124913);
  int64_t sum = 0;
  for (int32_t l : *v) sum += l;
  EXPECT_EQ(sum, 394273078);
  auto s = OpenSource("lengths:" + path);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->size_hint(), 99519);
  auto first = (*s)->NextLength();
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*first)->length, 2792);
}

TEST(HistogramSourceTest, ReadsRowsAndEnumeratesLengths) {
  TempDir dir;
  WriteText(dir.File("h.csv"), "length,count\n3,2\n5,0\n8, 1\r\n");
  auto h = ReadHistogramFile(dir.File("h.csv"));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->rows.size(), 3u);
  EXPECT_EQ(h->rows[1].length, 5);
  EXPECT_EQ(h->rows[1].count, 0);
  EXPECT_EQ(h->num_sequences, 3);
  EXPECT_EQ(h->num_tokens, 14);
  auto s = OpenHistogramSource(dir.File("h.csv"));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)->histogram().rows.size(), 3u);
  EXPECT_EQ((*s)->spec(), "histogram:" + dir.File("h.csv"));
  const auto all = AllLengths(**s);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].length, 3);
  EXPECT_EQ(all[1].length, 3);
  EXPECT_EQ(all[2].length, 8);  // the zero row yields nothing
  EXPECT_EQ(all[2].id, 2);
  ASSERT_TRUE((*s)->Reset().ok());
  auto sample = (*s)->Next();
  ASSERT_TRUE(sample.ok());
  EXPECT_EQ((*sample)->id, 3);
  EXPECT_EQ((*sample)->tokens, MockTokens(SourceOptions().seed, 3, 3, kDefaultMockVocab));
}

TEST(HistogramSourceTest, ErrorsNameFileLineAndRule) {
  struct Case {
    const char* text;
    const char* where;
    const char* what;
  };
  const Case cases[] = {
      {"3,4\n", ":1", "missing header"},
      {"length,count\n3\n", ":2", "expected two fields"},
      {"length,count\n3,4,5\n", ":2", "expected two fields"},
      {"length,count\n3,4\n3,1\n", ":3", "strictly increasing (3 after 3)"},
      {"length,count\n5,4\n3,1\n", ":3", "strictly increasing (3 after 5)"},
      {"length,count\n3,-1\n", ":2", "count must be >= 0, got -1"},
      {"length,count\n0,1\n", ":2", "length must be >= 1"},
      {"length,count\nx,1\n", ":2", "length is not an integer"},
      {"length,count\n3,y\n", ":2", "count is not an integer: \"y\""},
      {"length,count\n3,1\n\n4,1\n", ":3", "blank line inside"},
      {"length,count\n2,4611686018427387904\n", ":2", "overflow"},
      {"length,count\n1,9223372036854775807\n2,1\n", ":3", "overflow"},
  };
  TempDir dir;
  const std::string path = dir.File("bad.csv");
  for (const Case& c : cases) {
    WriteText(path, c.text);
    auto s = OpenSource("histogram:" + path);
    ASSERT_FALSE(s.ok()) << c.text;
    EXPECT_TRUE(Contains(s.status().message(), path + c.where)) << s.status().message();
    EXPECT_TRUE(Contains(s.status().message(), c.what)) << s.status().message();
  }
  WriteText(path, "");
  EXPECT_FALSE(ReadHistogramFile(path).ok());
  WriteText(path, "length,count\n");  // a valid, empty histogram, but not a usable source
  ASSERT_TRUE(ReadHistogramFile(path).ok());
  auto empty = OpenSource("histogram:" + path);
  ASSERT_FALSE(empty.ok());
  EXPECT_TRUE(Contains(empty.status().message(), "no sequences"));
  WriteText(path, "length,count\n4,0\n");
  EXPECT_FALSE(OpenSource("histogram:" + path).ok());
}

TEST(HistogramSourceTest, RealWikipediaHistogramAsRows) {
  const std::string path = DataFile("wikipedia_512_histogram.csv");
  auto s = OpenHistogramSource(path);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const Histogram& h = (*s)->histogram();
  EXPECT_EQ(h.rows.size(), 508u);
  EXPECT_EQ(h.num_sequences, 16279552);
  EXPECT_EQ(h.num_tokens, 4164796173);
  EXPECT_EQ(h.rows.front().length, 5);
  EXPECT_EQ(h.rows.front().count, 1821);
  EXPECT_EQ(h.rows.back().length, 512);
  EXPECT_EQ((*s)->size_hint(), 16279552);
  // Enumeration is lazy: the first samples come from the first row.
  auto l = (*s)->NextLength();
  ASSERT_TRUE(l.ok());
  EXPECT_EQ((*l)->length, 5);
}

TEST(HistogramSourceTest, RealSquadHistogramEnumerated) {
  const std::string path = DataFile("squad_384_histogram.csv");
  auto h = ReadHistogramFile(path);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->rows.size(), 348u);
  EXPECT_EQ(h->num_sequences, 88641);
  EXPECT_EQ(h->num_tokens, 15249479);
  for (bool shuffle : {false, true}) {
    SourceOptions options;
    options.shuffle = shuffle;
    auto s = OpenSource("histogram:" + path, options);
    ASSERT_TRUE(s.ok());
    int64_t n = 0, tokens = 0, previous = 0, descents = 0;
    while (true) {
      auto l = (*s)->NextLength();
      ASSERT_TRUE(l.ok());
      if (!l->has_value()) break;
      EXPECT_EQ((*l)->id, n);
      ++n;
      tokens += (*l)->length;
      descents += (*l)->length < previous;
      previous = (*l)->length;
    }
    EXPECT_EQ(n, 88641);
    EXPECT_EQ(tokens, 15249479);
    if (shuffle) {
      EXPECT_GT(descents, 10000);  // not in row order
    } else {
      EXPECT_EQ(descents, 0);
    }
  }
}

}  // namespace
}  // namespace thdpack
