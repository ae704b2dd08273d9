// Fuzz target: ImportArrowStream and the columnar source (thdpack/arrow.h) on record batches
// whose every buffer comes from the input - offsets that may decrease or overrun, values of any
// width, null bitmaps, sliced arrays, a loss_mask or labels column of any length - handed over
// by a producer that follows the C stream interface's ownership rules (arrow_test_util.h).
// Layout of an input:
//   byte 0   controls: bits 0-2 the input_ids value type (c s i l C S I L), bit 3 large_list,
//            bits 4-5 targets (none, a bool loss_mask, an int8 loss_mask, int64 labels), bit 6
//            shuffle, bit 7 a vocabulary of 300 (else none)
//   byte 1   bits 0-1 batches (1 + them), bit 2 a declared per-token int32 field 'adv' read
//            from a list column of its own (its offsets from the input too)
//   then, per batch: rows (byte % 16), the struct's offset (byte % 3), a byte of null flags
//            (bit 0 a null row, bit 1 a null value), then per column (ids, and the targets'
//            column when there is one) a length byte per row and rows + offset's values, each
//            one byte (signed for labels: -100 where the byte is 0x9c)
// Imported rows must give a source whose samples have 1 .. 2^31 - 1 tokens, the same length and
// targets from NextLength and Next, tokens inside the vocabulary, the field's row per token;
// errors must name the data.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/arrow_test_util.h"
#include "fuzz_util.h"
#include "thdpack/arrow.h"

namespace {

using thdpack::fuzz::Describe;
using thdpack::testing_util::TestBatch;
using thdpack::testing_util::TestListColumn;

struct Reader {
  const uint8_t* p;
  size_t n, at = 0;
  uint8_t Next() { return at < n ? p[at++] : 0; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  const uint8_t controls = in.Next();
  static const char* kFormats[] = {"c", "s", "i", "l", "C", "S", "I", "L"};
  const std::string format = kFormats[controls & 7];
  const bool large = controls & 8;
  const int targets = (controls >> 4) & 3;
  const uint8_t shape = in.Next();
  const int batches = 1 + (shape & 3);
  const bool field = shape & 4;
  std::vector<TestBatch> all;
  for (int b = 0; b < batches; ++b) {
    TestBatch batch;
    batch.rows = in.Next() % 16;
    batch.offset = in.Next() % 3;
    const uint8_t nulls = in.Next();
    const int64_t entries = batch.rows + batch.offset;
    auto column = [&](const std::string& name, const std::string& f, bool lg) {
      TestListColumn c{name, f, lg, {0}, {}, {}, {}, 0};
      for (int64_t r = 0; r < entries; ++r) {
        // A signed length byte: the offsets may go back, as a broken producer's would.
        const int64_t step = static_cast<int8_t>(in.Next()) % 12;
        c.offsets.push_back(c.offsets.back() + step);
      }
      const int64_t values = c.offsets.back() > 0 ? c.offsets.back() : 0;
      for (int64_t k = 0; k < values && k < 256; ++k) {
        const uint8_t v = in.Next();
        c.values.push_back(name == "labels" && v == 0x9c ? -100 : int64_t{v});
      }
      while (static_cast<int64_t>(c.values.size()) < values) c.values.push_back(1);
      if (nulls & 1) {
        c.null_rows.assign(static_cast<size_t>(entries), false);
        c.null_rows.back() = true;
      }
      if ((nulls & 2) && !c.values.empty()) {
        c.null_values.assign(c.values.size(), false);
        c.null_values[c.values.size() / 2] = true;
      }
      return c;
    };
    if (entries > 0) {
      batch.columns.push_back(column("input_ids", format, large));
      if (targets == 1) batch.columns.push_back(column("loss_mask", "b", false));
      if (targets == 2) batch.columns.push_back(column("loss_mask", "c", true));
      if (targets == 3) batch.columns.push_back(column("labels", "l", false));
      if (field) batch.columns.push_back(column("adv", "i", false));
    } else {
      batch.columns.push_back(TestListColumn{"input_ids", format, large, {0}, {}, {}, {}, 0});
      batch.rows = 0;
      batch.offset = 0;
    }
    all.push_back(batch);
  }
  // Every batch's columns alike (the schema is the first batch's).
  for (TestBatch& b : all) {
    if (b.columns.size() != all[0].columns.size()) return 0;
  }
  ArrowArrayStream stream = thdpack::testing_util::MakeTestStream(all);
  auto rows = thdpack::ImportArrowStream(&stream, "fuzz");
  FUZZ_CHECK(stream.release == nullptr, "the stream was not released");
  if (!rows.ok()) {
    FUZZ_CHECK(Describe(rows.status()).find("fuzz") != std::string::npos, Describe(rows.status()));
    return 0;
  }
  if (thdpack::InfoOf(**rows).rows == 0) return 0;
  thdpack::RegisterArrowRows("arrow:@fuzz", *rows);
  thdpack::SourceOptions options;
  options.shuffle = controls & 64;
  options.vocab_size = (controls & 128) ? 300 : 0;
  if (field) options.fields.push_back({"adv", true, "i", 1, 4});
  auto a = thdpack::OpenSource("arrow:@fuzz", options);
  auto b = thdpack::OpenSource("arrow:@fuzz", options);
  if (field && !a.ok()) {  // a field column that does not fit its rows: named
    FUZZ_CHECK(Describe(a.status()).find("field 'adv'") != std::string::npos,
               Describe(a.status()));
    return 0;
  }
  FUZZ_CHECK(a.ok() && b.ok(), Describe(a.ok() ? b.status() : a.status()));
  for (int k = 0; k < 64; ++k) {
    auto length = (*a)->NextLength();
    auto sample = (*b)->Next();
    if (!sample.ok()) {
      FUZZ_CHECK(Describe(sample.status()).find("arrow:@fuzz") != std::string::npos,
                 Describe(sample.status()));
      return 0;
    }
    FUZZ_CHECK(length.ok(), Describe(length.status()));
    FUZZ_CHECK(length->has_value() == sample->has_value(), "NextLength and Next disagree");
    if (!sample->has_value()) break;
    const thdpack::Sample& s = **sample;
    FUZZ_CHECK(!s.tokens.empty(), "an empty sample");
    FUZZ_CHECK((*length)->length == static_cast<int64_t>(s.tokens.size()), "lengths differ");
    FUZZ_CHECK((*length)->n_targets == thdpack::NumTargets(s), "targets differ");
    FUZZ_CHECK(s.fields.size() == (field ? 1u : 0u) &&
                   (!field || s.fields[0].size() == s.tokens.size() * 4),
               "a field's row per token");
    for (thdpack::TokenId t : s.tokens) {
      FUZZ_CHECK(t >= 0 && (options.vocab_size == 0 || t < options.vocab_size), "a bad token");
    }
  }
  return 0;
}
