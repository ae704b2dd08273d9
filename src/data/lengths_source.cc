// The planning sources: `lengths:FILE` (one length per line) and `histogram:FILE`
// (`length,count` rows). Tokens are mock; a histogram is never expanded to one entry per
// sequence.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#include "common/hash64.h"
#include "data/data_internal.h"
#include "thdpack/data.h"

namespace thdpack {

using data_internal::Excerpt;
using data_internal::IndexedSource;
using data_internal::LineReader;
using data_internal::MappedFile;
using data_internal::ParseInt64;
using data_internal::Trim;

namespace {

std::string Where(const std::string& path, int64_t line) {
  return path + ":" + std::to_string(line);
}

bool StartsLikeNumber(std::string_view text) {
  return !text.empty() && ((text[0] >= '0' && text[0] <= '9') || text[0] == '+' || text[0] == '-');
}

// Parses a length field: an integer in [1, kMaxSampleLength].
Status ParseLength(std::string_view field, const std::string& where, std::string_view what,
                   int64_t* out) {
  const std::optional<int64_t> v = ParseInt64(field);
  if (!v) {
    return Status::InvalidArgument(where + ": " + std::string(what) + " is not an integer: \"" +
                                   Excerpt(field) + "\"");
  }
  if (*v < 1) {
    return Status::InvalidArgument(where + ": " + std::string(what) + " must be >= 1, got " +
                                   std::to_string(*v));
  }
  if (*v > kMaxSampleLength) {
    return Status::OutOfRange(where + ": " + std::string(what) + " " + std::to_string(*v) +
                              " exceeds 2147483647 (lengths are int32)");
  }
  *out = *v;
  return Status::Ok();
}

class HistogramSourceImpl final : public IndexedSource<HistogramSource> {
 public:
  HistogramSourceImpl(std::string spec, Histogram histogram, const SourceOptions& options)
      : IndexedSource(std::move(spec), histogram.num_sequences, options),
        histogram_(std::move(histogram)) {
    ends_.reserve(histogram_.rows.size());
    int64_t end = 0;
    for (const HistogramRow& row : histogram_.rows) {
      end += row.count;  // cannot overflow: ReadHistogramFile checked the total
      ends_.push_back(end);
    }
  }

  const Histogram& histogram() const override { return histogram_; }

 protected:
  Result<SampleLength> LengthAt(int64_t index) const override {
    const int64_t length = LengthOf(index);
    return SampleLength{0, length, length - 1};
  }
  // One binary search for the first row, then row after row.
  Status LengthsAt(int64_t first, std::span<SampleLength> out) const override {
    size_t row = static_cast<size_t>(
        std::upper_bound(ends_.begin(), ends_.end(), first) - ends_.begin());
    int64_t index = first;
    for (SampleLength& x : out) {
      while (ends_[row] <= index) ++row;  // passes rows with a zero count
      const int64_t length = histogram_.rows[row].length;
      x = SampleLength{0, length, length - 1};
      ++index;
    }
    return Status::Ok();
  }
  Status FillAt(int64_t index, int64_t id, Sample* out) const override {
    FillMock(id, LengthOf(index), out);
    return Status::Ok();
  }
  // The rows as (length, count) int64 pairs.
  Result<std::string> ComputeIdentity() const override {
    std::vector<int64_t> pairs;
    pairs.reserve(2 * histogram_.rows.size());
    for (const HistogramRow& row : histogram_.rows) {
      pairs.push_back(row.length);
      pairs.push_back(row.count);
    }
    const auto bytes = std::as_bytes(std::span<const int64_t>(pairs));
    return "histogram " + std::to_string(histogram_.rows.size()) + " rows " +
           std::to_string(histogram_.num_sequences) + " sequences hash " +
           internal::Hex64(internal::Hash64(std::span<const uint8_t>(
               reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size())));
  }

 private:
  // The row holding sample `index`: the first whose cumulative end exceeds it (rows with a
  // zero count have the same end as the row before and are never chosen).
  int64_t LengthOf(int64_t index) const {
    const auto it = std::upper_bound(ends_.begin(), ends_.end(), index);
    return histogram_.rows[static_cast<size_t>(it - ends_.begin())].length;
  }

  Histogram histogram_;
  std::vector<int64_t> ends_;  // cumulative counts, one per row
};

}  // namespace

namespace {

// The rules of a lengths file, one line at a time; both readers below feed it.
class LengthsParser {
 public:
  LengthsParser(const std::string& path, bool allow_header, std::vector<int32_t>* out)
      : path_(path), allow_header_(allow_header), out_(out) {}

  // True while no blank line was seen: a line of 1 to 9 digits with a value >= 1 is then a
  // length, which ReadLengthsFile's loop takes without calling Line.
  bool plain_lines() const { return first_blank_ == 0; }

  // Line n (1-based), without its '\n'.
  Status Line(std::string_view line, int64_t n) {
    // The common line: 1 to 9 digits, no blank line before it (so in [0, 10^9), inside int32).
    if (first_blank_ == 0 && !line.empty() && line.size() <= 9) {
      int32_t v = 0;
      size_t i = 0;
      for (; i < line.size(); ++i) {
        const unsigned d = static_cast<unsigned>(line[i]) - '0';
        if (d > 9) break;
        v = v * 10 + static_cast<int32_t>(d);
      }
      if (i == line.size() && v >= 1) {
        out_->push_back(v);
        return Status::Ok();
      }
    }
    const std::string_view text = Trim(line);
    if (text.empty()) {
      if (first_blank_ == 0) first_blank_ = n;
      return Status::Ok();
    }
    if (first_blank_ != 0) {
      return Status::InvalidArgument(Where(path_, first_blank_) +
                                     ": blank line inside the file (only trailing blank lines "
                                     "are allowed)");
    }
    if (n == 1 && allow_header_ && !StartsLikeNumber(text)) return Status::Ok();  // header
    int64_t length = 0;
    THDPACK_RETURN_IF_ERROR(ParseLength(text, Where(path_, n), "length", &length));
    out_->push_back(static_cast<int32_t>(length));
    return Status::Ok();
  }

 private:
  const std::string& path_;
  const bool allow_header_;
  std::vector<int32_t>* out_;
  int64_t first_blank_ = 0;  // line number of the first blank line (0: none yet)
};

}  // namespace

namespace data_internal {

Result<std::vector<int32_t>> ReadLengthsFileByLine(const std::string& path, bool allow_header) {
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<LineReader> reader, LineReader::Open(path));
  std::vector<int32_t> lengths;
  LengthsParser parser(path, allow_header, &lengths);
  std::string_view line;
  while (true) {
    THDPACK_ASSIGN_OR_RETURN(bool more, reader->ReadLine(&line));
    if (!more) break;
    THDPACK_RETURN_IF_ERROR(parser.Line(line, reader->line_number()));
  }
  return lengths;
}

}  // namespace data_internal

namespace {

// '\n' bytes in [begin, end), eight at a time: a byte of x = word ^ "\n\n..." is zero exactly
// where the word holds '\n', and ((x & 0x7f..) + 0x7f..) | x has its top bit clear there only;
// the multiply adds the eight 0/1 bytes into the top one (no popcount: without -mpopcnt it is
// a library call).
size_t CountNewlines(const char* begin, const char* end) {
  constexpr uint64_t kNewlines = 0x0a0a0a0a0a0a0a0aULL;
  constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7fULL;
  constexpr uint64_t kOnes = 0x0101010101010101ULL;
  size_t count = 0;
  const char* p = begin;
  for (; end - p >= 8; p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    const uint64_t x = word ^ kNewlines;
    const uint64_t hits = (~(((x & kLow7) + kLow7) | x) & ~kLow7) >> 7;  // 1 per '\n' byte
    count += static_cast<size_t>((hits * kOnes) >> 56);
  }
  for (; p < end; ++p) count += *p == '\n' ? 1 : 0;
  return count;
}

}  // namespace

// The file mapped and split at '\n' as getline splits it (a last line without '\n' counts; a
// final '\n' opens no line), with room for every line reserved first. A line of 1 to 9 digits
// and value >= 1 (while no blank line was seen) is taken by the loop here; every other line
// goes to LengthsParser::Line, the rules ReadLengthsFileByLine (the plain reference) applies
// to every line. Files that cannot be mapped (pipes, ...) are read line by line.
Result<std::vector<int32_t>> ReadLengthsFile(const std::string& path, bool allow_header) {
  Result<std::unique_ptr<MappedFile>> mapped = MappedFile::Open(path);
  if (!mapped.ok()) return data_internal::ReadLengthsFileByLine(path, allow_header);
  const std::span<const uint8_t> bytes = (*mapped)->bytes();
  std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  data_internal::StripBom(&text);  // as LineReader does
  const char* const begin = text.data();
  const char* const end = begin + text.size();
  std::vector<int32_t> lengths;
  lengths.reserve(CountNewlines(begin, end) + 1);
  LengthsParser parser(path, allow_header, &lengths);
  int64_t n = 0;  // lines so far
  const char* p = begin;
  while (p < end) {
    ++n;
    if (parser.plain_lines()) {
      const char* const digits_end = end - p > 9 ? p + 9 : end;
      const char* q = p;
      int32_t v = 0;
      for (; q < digits_end; ++q) {
        const unsigned d = static_cast<unsigned>(static_cast<unsigned char>(*q)) - '0';
        if (d > 9) break;
        v = v * 10 + static_cast<int32_t>(d);
      }
      if (q != p && v >= 1 && (q == end || *q == '\n')) {
        lengths.push_back(v);
        p = q == end ? end : q + 1;
        continue;
      }
    }
    const void* nl = std::memchr(p, '\n', static_cast<size_t>(end - p));
    const char* line_end = nl == nullptr ? end : static_cast<const char*>(nl);
    THDPACK_RETURN_IF_ERROR(
        parser.Line(std::string_view(p, static_cast<size_t>(line_end - p)), n));
    p = line_end == end ? end : line_end + 1;
  }
  return lengths;
}

Result<Histogram> ReadHistogramFile(const std::string& path) {
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<LineReader> reader, LineReader::Open(path));
  Histogram h;
  int64_t first_blank = 0;
  bool header_seen = false;
  std::string_view line;
  while (true) {
    THDPACK_ASSIGN_OR_RETURN(bool more, reader->ReadLine(&line));
    if (!more) break;
    const int64_t n = reader->line_number();
    const std::string where = Where(path, n);
    const std::string_view text = Trim(line);
    if (text.empty()) {
      if (first_blank == 0) first_blank = n;
      continue;
    }
    if (first_blank != 0) {
      return Status::InvalidArgument(Where(path, first_blank) +
                                     ": blank line inside the file (only trailing blank lines "
                                     "are allowed)");
    }
    if (!header_seen) {
      if (StartsLikeNumber(text)) {
        return Status::InvalidArgument(where + ": missing header line (expected \"length,count\"), "
                                       "got \"" + Excerpt(text) + "\"");
      }
      header_seen = true;
      continue;
    }
    const size_t comma = text.find(',');
    if (comma == std::string_view::npos || text.find(',', comma + 1) != std::string_view::npos) {
      return Status::InvalidArgument(where + ": expected two fields \"length,count\", got \"" +
                                     Excerpt(text) + "\"");
    }
    HistogramRow row;
    THDPACK_RETURN_IF_ERROR(ParseLength(Trim(text.substr(0, comma)), where, "length", &row.length));
    const std::string_view count_text = Trim(text.substr(comma + 1));
    const std::optional<int64_t> count = ParseInt64(count_text);
    if (!count) {
      return Status::InvalidArgument(where + ": count is not an integer: \"" +
                                     Excerpt(count_text) + "\"");
    }
    if (*count < 0) {
      return Status::InvalidArgument(where + ": count must be >= 0, got " + std::to_string(*count));
    }
    row.count = *count;
    if (!h.rows.empty() && row.length <= h.rows.back().length) {
      return Status::InvalidArgument(where + ": lengths must be strictly increasing (" +
                                     std::to_string(row.length) + " after " +
                                     std::to_string(h.rows.back().length) + ")");
    }
    int64_t tokens = 0;
    if (__builtin_add_overflow(h.num_sequences, row.count, &h.num_sequences) ||
        __builtin_mul_overflow(row.length, row.count, &tokens) ||
        __builtin_add_overflow(h.num_tokens, tokens, &h.num_tokens)) {
      return Status::OutOfRange(where + ": total count or tokens overflow int64");
    }
    h.rows.push_back(row);
  }
  if (!header_seen) {
    return Status::InvalidArgument(path + ": empty file (expected a \"length,count\" header)");
  }
  return h;
}

Result<std::unique_ptr<SampleSource>> OpenLengthsSource(const std::string& path,
                                                        const SourceOptions& options) {
  const std::string spec = "lengths:" + path;
  THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec, options));
  THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> lengths, ReadLengthsFile(path, true));
  return data_internal::MakeLengthsVectorSource(spec, std::move(lengths), options);
}

Result<std::unique_ptr<HistogramSource>> OpenHistogramSource(const std::string& path,
                                                             const SourceOptions& options) {
  const std::string spec = "histogram:" + path;
  THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec, options));
  THDPACK_ASSIGN_OR_RETURN(Histogram h, ReadHistogramFile(path));
  if (h.num_sequences == 0) {
    return Status::InvalidArgument(path + ": histogram holds no sequences (every count is 0)");
  }
  return std::unique_ptr<HistogramSource>(new HistogramSourceImpl(spec, std::move(h), options));
}

}  // namespace thdpack
