// Fuzz target: the planning text readers (thdpack/data.h) on the input written as a file.
// - ReadLengthsFile (memory-mapped, split with memchr) against ReadLengthsFileByLine (getline,
//   its plain reference), with and without a header allowed: the same lengths or the same
//   status (code and message); every accepted length in [1, kMaxSampleLength].
// - ReadHistogramFile: accepted rows strictly increasing with counts >= 0 and totals that equal
//   their sums; a histogram source over them yields only lengths of its rows, in file order
//   (and a permutation of them with shuffle).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/data_internal.h"
#include "fuzz_util.h"
#include "thdpack/data.h"

namespace {

using thdpack::fuzz::Describe;

void CheckLengths(const std::string& path, bool allow_header) {
  auto mapped = thdpack::ReadLengthsFile(path, allow_header);
  auto by_line = thdpack::data_internal::ReadLengthsFileByLine(path, allow_header);
  const std::string at = allow_header ? " (header allowed)" : " (no header)";
  FUZZ_CHECK(mapped.status() == by_line.status(),
             "mapped " + Describe(mapped.status()) + " but by line " + Describe(by_line.status()) + at);
  if (!mapped.ok()) return;
  FUZZ_CHECK(*mapped == *by_line, "the two readers give different lengths" + at);
  for (const int32_t length : *mapped) {
    FUZZ_CHECK(length >= 1, "accepted length " + std::to_string(length) + at);
  }
}

// Opens a source over the histogram read from `path` and checks its first samples (at most 64).
void CheckHistogramSource(const std::string& path, const thdpack::Histogram& h, bool shuffle) {
  thdpack::SourceOptions options;
  options.shuffle = shuffle;
  auto source = thdpack::OpenHistogramSource(path, options);
  if (h.num_sequences == 0) {
    FUZZ_CHECK(!source.ok(), "a histogram source over no sequences opened");
    return;
  }
  FUZZ_CHECK(source.ok(), "OpenHistogramSource refused what ReadHistogramFile read: " +
                              Describe(source.status()));
  FUZZ_CHECK((*source)->size_hint() == h.num_sequences, "size_hint is not the sum of counts");
  std::map<int64_t, int64_t> count_of;
  for (const thdpack::HistogramRow& row : h.rows) count_of[row.length] = row.count;
  const int64_t take = h.num_sequences < 64 ? h.num_sequences : 64;
  std::map<int64_t, int64_t> seen;
  int64_t previous = 0;
  for (int64_t i = 0; i < take; ++i) {
    auto next = (*source)->NextLength();
    FUZZ_CHECK(next.ok() && next->has_value(), "the source ended before its size");
    const int64_t length = (*next)->length;
    FUZZ_CHECK((*next)->id == i, "ids do not count from 0");
    FUZZ_CHECK(count_of.count(length) == 1 && ++seen[length] <= count_of[length],
               "length " + std::to_string(length) + " beyond its row's count");
    FUZZ_CHECK((*next)->n_targets == length - 1, "n_targets is not L - 1");
    if (!shuffle) FUZZ_CHECK(length >= previous, "rows out of file order");
    previous = length;
  }
  if (take == h.num_sequences) {
    auto end = (*source)->NextLength();
    FUZZ_CHECK(end.ok() && !end->has_value(), "the source did not end at its size");
  }
}

void CheckHistogram(const std::string& path) {
  auto h = thdpack::ReadHistogramFile(path);
  if (!h.ok()) return;
  __int128 sequences = 0, tokens = 0;
  for (size_t i = 0; i < h->rows.size(); ++i) {
    const thdpack::HistogramRow& row = h->rows[i];
    FUZZ_CHECK(row.length >= 1 && row.length <= thdpack::kMaxSampleLength && row.count >= 0,
               "accepted row " + std::to_string(row.length) + "," + std::to_string(row.count));
    FUZZ_CHECK(i == 0 || row.length > h->rows[i - 1].length, "rows not strictly increasing");
    sequences += row.count;
    tokens += static_cast<__int128>(row.length) * row.count;
  }
  FUZZ_CHECK(sequences == h->num_sequences && tokens == h->num_tokens,
             "totals differ from the rows' sums");
  CheckHistogramSource(path, *h, false);
  CheckHistogramSource(path, *h, true);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = thdpack::fuzz::WriteScratchFile("input.txt", data, size);
  CheckLengths(path, true);
  CheckLengths(path, false);
  CheckHistogram(path);
  return 0;
}
