// src/data/data_internal.h: helpers shared by the data sources (not public API).
//
// - LineReader: a text file read line by line (getline), RAII.
// - MappedFile: a whole file memory-mapped read-only, RAII.
// - Permutation: the shuffling bijection (SplitMix64 and Mix64 come from common/splitmix64.h).
// - IndexedSource: the SampleSource of every source with random access (all but jsonl).
//
// Thread-safety: as SampleSource (one object per thread); the generators are pure.
#ifndef THDPACK_SRC_DATA_DATA_INTERNAL_H_
#define THDPACK_SRC_DATA_DATA_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/splitmix64.h"
#include "thdpack/data.h"
#include "thdpack/status.h"

namespace thdpack::data_internal {

// "open FILE: No such file or directory" style text for the current errno.
std::string ErrnoText(std::string_view what, std::string_view path);

// Checks the options every source shares: vocab_size in [0, 2^31 - 1], mock_num_samples >= 0.
[[nodiscard]] Status ValidateOptions(std::string_view spec, const SourceOptions& options);

// Parses a whole string_view as a decimal int64 (optional leading '+' or '-'); nullopt on any
// other character, an empty text or overflow.
std::optional<int64_t> ParseInt64(std::string_view text);
// Strips spaces, tabs and '\r' at both ends.
std::string_view Trim(std::string_view text);
// At most `max` characters of text, with "..." when cut, for error messages.
std::string Excerpt(std::string_view text, size_t max = 60);

// The UTF-8 byte-order mark some editors write at the start of a text file. Every text reader
// (lengths, histogram, jsonl, mock config) skips it before the first line, so it never turns
// the first line into a header or a parse error.
inline constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";
// Removes a leading BOM from *text; true when there was one.
bool StripBom(std::string_view* text);

// The deepest nesting of arrays and objects accepted in JSON text (a JSONL line, a mock
// config): a sample needs 2 (the object and its "input_ids"), a mock config 1; 64 leaves room
// for any metadata a line carries beside them, and keeps every later walk over the value
// (formatting an error, freeing it) shallow. docs/data_sources.md, "Limits".
inline constexpr int kMaxJsonDepth = 64;

// Checks JSON text before a parser sees it, with one iterative pass (no recursion over the
// input): no NUL byte (a parser stops at one and would take the text before it for the whole)
// and no nesting deeper than kMaxJsonDepth. Errors (InvalidArgument) start with `where` and
// name the byte offset in `text` (0-based, "byte 7 of the <unit>") and the rule broken.
[[nodiscard]] Status CheckJsonText(std::string_view text, std::string_view where,
                                   std::string_view unit);

class LineReader {
 public:
  [[nodiscard]] static Result<std::unique_ptr<LineReader>> Open(const std::string& path);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // Reads the next line, without its '\n'; false at the end of the file. The view is valid
  // until the next call. A UTF-8 BOM at the start of the file is not part of line 1.
  [[nodiscard]] Result<bool> ReadLine(std::string_view* line);
  // 1-based number of the last line read (0 before the first).
  int64_t line_number() const { return line_number_; }
  // Byte offset in the file of the start of the last line read (after a skipped BOM: the
  // offset still counts the BOM's 3 bytes).
  int64_t line_offset() const { return line_offset_; }
  [[nodiscard]] Status Rewind();
  // Continues at byte `offset` of the file as if `lines` lines had been read to get there
  // (line numbers count on from it). REQUIRES offset at the start of a line (0 with lines 0).
  [[nodiscard]] Status Seek(int64_t offset, int64_t lines);
  // Byte offset of the next line to read.
  int64_t next_offset() const { return next_offset_; }
  const std::string& path() const { return path_; }

 private:
  LineReader() = default;
  std::string path_;
  FILE* file_ = nullptr;
  char* buffer_ = nullptr;  // owned by getline (malloc), freed in the destructor
  size_t capacity_ = 0;
  int64_t line_number_ = 0;
  int64_t line_offset_ = 0;
  int64_t next_offset_ = 0;  // of the line after the last one read
};

class MappedFile {
 public:
  [[nodiscard]] static Result<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;  // null for an empty file (mmap cannot map 0 bytes)
  size_t size_ = 0;
};

// "<size> bytes, head and tail hash <16 hex digits>": a file's size and a hash of its first and
// last kHeadTailBytes (all of it when smaller): its identity where hashing it whole would cost
// a pass over gigabytes (a jsonl file, a Megatron .bin).
inline constexpr size_t kHeadTailBytes = 64 << 10;
std::string HeadTailIdentity(std::span<const uint8_t> bytes);

// The generators live in src/common/ (the probe seeds its weights with them too).
using internal::Mix64;
using internal::SplitMix64;

// A pseudo-random bijection of [0, n) keyed by `key`: a 4-round Feistel network on the
// smallest even number of bits covering n, walked until the value falls inside [0, n).
class Permutation {
 public:
  Permutation(uint64_t n, uint64_t key);
  uint64_t operator()(uint64_t i) const;
  // The inverse: Inverse((*this)(i)) == i for every i in [0, n). The rounds run backwards and
  // the walk goes back through the values outside [0, n) that the forward walk passed.
  uint64_t Inverse(uint64_t y) const;

 private:
  uint64_t n_;
  uint64_t key_;
  int half_bits_;
  uint64_t half_mask_;
};

// A source with random access by index in [0, size). Derived classes give LengthAt and FillAt;
// this template holds the cursor, epoch, ids, shuffling and the sticky error. Interface is
// SampleSource or an interface derived from it (HistogramSource).
template <typename Interface>
class IndexedSource : public Interface {
 public:
  Result<std::optional<Sample>> Next() final {
    if (!error_.ok()) return error_;
    if (Status s = SkipEmpty(); !s.ok()) return s;
    if (position_ >= size_) return std::optional<Sample>();
    Sample sample;
    sample.id = next_id_;
    Status s = FillAt(IndexOf(position_), next_id_, &sample);
    if (!s.ok()) {
      error_ = s;
      return s;
    }
    ++position_;
    ++next_id_;
    return std::optional<Sample>(std::move(sample));
  }

  Result<std::optional<SampleLength>> NextLength() final {
    if (!error_.ok()) return error_;
    if (Status s = SkipEmpty(); !s.ok()) return s;
    if (position_ >= size_) return std::optional<SampleLength>();
    Result<SampleLength> r = LengthAt(IndexOf(position_));
    if (!r.ok()) {
      error_ = r.status();
      return error_;
    }
    SampleLength out = *r;
    out.id = next_id_;
    ++position_;
    ++next_id_;
    return std::optional<SampleLength>(out);
  }

  // One LengthsAt call per batch when no index is empty; otherwise the NextLength loop (each
  // sample may first pass over empty indices).
  Result<int64_t> NextLengths(std::span<SampleLength> out) final {
    if (!error_.ok()) return error_;
    if (empty_ > 0) return SampleSource::NextLengths(out);
    const int64_t n = std::min(static_cast<int64_t>(out.size()), size_ - position_);
    if (n <= 0) return int64_t{0};
    const std::span<SampleLength> batch = out.first(static_cast<size_t>(n));
    Status s;
    if (permutation_) {
      for (int64_t k = 0; k < n && s.ok(); ++k) {
        Result<SampleLength> r = LengthAt(IndexOf(position_ + k));
        if (r.ok()) {
          batch[static_cast<size_t>(k)] = *r;
        } else {
          s = r.status();
        }
      }
    } else {
      s = LengthsAt(position_, batch);
    }
    if (!s.ok()) return error_ = s;
    for (SampleLength& x : batch) x.id = next_id_++;
    position_ += n;
    return n;
  }

  Status Reset() final {
    if (!error_.ok()) return error_;
    position_ = 0;
    ++epoch_;
    if (options_.shuffle) MakePermutation();
    return Status::Ok();
  }

  std::optional<int64_t> size_hint() const final { return size_ - empty_; }
  int64_t epoch() const final { return epoch_; }
  const std::string& spec() const final { return spec_; }
  int64_t skipped_empty() const final { return skipped_empty_; }

  // An indexed source's cursor is its (epoch, position): the ids and empty documents before it
  // follow (next_id = epoch * size + position; skipped_empty = epoch * E + the empty indices
  // among the first `position` entries of the epoch's order).
  SourceCursor cursor() const final {
    SourceCursor c;
    c.epoch = epoch_;
    c.position = position_;
    c.next_id = next_id_;
    c.skipped_empty = skipped_empty_;
    c.epoch_size = size_ - empty_;
    return c;
  }

  Status Seek(const SourceCursor& c) final {
    if (!error_.ok()) return error_;
    auto bad = [&](const std::string& field, const std::string& rule) {
      return Status::Corruption(spec_ + ": cursor field \"" + field + "\" " + rule);
    };
    if (c.epoch_size != size_ - empty_) {
      return bad("epoch_size", "= " + std::to_string(c.epoch_size) + ", but this data holds " +
                                   std::to_string(size_ - empty_) + " samples per epoch");
    }
    if (c.epoch < 0) return bad("epoch", "= " + std::to_string(c.epoch) + " is negative");
    if (c.position < 0 || c.position > size_) {
      return bad("position", "= " + std::to_string(c.position) + " is outside [0, " +
                                 std::to_string(size_) + "] (the entries of an epoch)");
    }
    if (c.byte_offset != 0 || c.line != 0) {
      return bad("byte_offset", "= " + std::to_string(c.byte_offset) + " (line " +
                                    std::to_string(c.line) + "): only a jsonl cursor has one");
    }
    int64_t id = 0;
    if (__builtin_mul_overflow(c.epoch, size_, &id) || __builtin_add_overflow(id, c.position, &id) ||
        c.next_id != id) {
      return bad("next_id", "= " + std::to_string(c.next_id) + ", but epoch " +
                                std::to_string(c.epoch) + " position " + std::to_string(c.position) +
                                " of " + std::to_string(size_) + " entries an epoch gives " +
                                std::to_string(id));
    }
    THDPACK_ASSIGN_OR_RETURN(const int64_t before, EmptiesBefore(c.epoch, c.position));
    if (c.skipped_empty != c.epoch * empty_ + before) {
      return bad("skipped_empty", "= " + std::to_string(c.skipped_empty) + ", but epoch " +
                                      std::to_string(c.epoch) + " position " +
                                      std::to_string(c.position) + " passes " +
                                      std::to_string(c.epoch * empty_ + before) +
                                      " empty documents");
    }
    epoch_ = c.epoch;
    position_ = c.position;
    next_id_ = c.next_id;
    skipped_empty_ = c.skipped_empty;
    if (options_.shuffle) MakePermutation();
    return Status::Ok();
  }

  // Sample k of the stream (0-based) is the (k mod S)-th non-empty entry of epoch k / S, with
  // S the samples of an epoch.
  Result<SourceCursor> CursorAfter(int64_t samples) final {
    if (!error_.ok()) return error_;
    const int64_t per_epoch = size_ - empty_;
    if (samples < 0) {
      return Status::OutOfRange(spec_ + ": a cursor after " + std::to_string(samples) +
                                " samples (must be >= 0)");
    }
    SourceCursor c;
    c.epoch_size = per_epoch;
    if (samples == 0) return c;
    const int64_t last = samples - 1;
    const int64_t e = last / per_epoch;
    const int64_t j = last % per_epoch;
    THDPACK_ASSIGN_OR_RETURN(const int64_t p, NthNonEmpty(e, j));
    c.epoch = e;
    c.position = p + 1;
    if (__builtin_mul_overflow(e, size_, &c.next_id) ||
        __builtin_add_overflow(c.next_id, c.position, &c.next_id)) {
      return Status::OutOfRange(spec_ + ": " + std::to_string(samples) +
                                " samples take ids past 2^63 - 1");
    }
    c.skipped_empty = e * empty_ + (p - j);
    return c;
  }

  Result<SourceCursor> CursorAtEpoch(int64_t epoch) final {
    if (!error_.ok()) return error_;
    SourceCursor c;
    c.epoch_size = size_ - empty_;
    if (epoch < 0 || __builtin_mul_overflow(epoch, size_, &c.next_id)) {
      return Status::OutOfRange(spec_ + ": no epoch " + std::to_string(epoch) +
                                " (ids would pass 2^63 - 1, or it is negative)");
    }
    c.epoch = epoch;
    c.skipped_empty = epoch * empty_;
    return c;
  }

  Result<std::string> Identity() final {
    if (identity_.empty()) {
      THDPACK_ASSIGN_OR_RETURN(identity_, ComputeIdentity());
    }
    return identity_;
  }

 protected:
  // REQUIRES 0 <= empty < size (the factories check). `empty` of the `size` indices hold no
  // tokens (LengthAt gives length 0): Next and NextLength pass over them, each using up its id.
  IndexedSource(std::string spec, int64_t size, const SourceOptions& options, int64_t empty = 0)
      : spec_(std::move(spec)), size_(size), empty_(empty), options_(options) {
    if (options_.shuffle) MakePermutation();
  }

  // Length and n_targets of the sample at `index` (the id is set by the caller); length 0 for
  // an empty index (only when the constructor was told of some).
  virtual Result<SampleLength> LengthAt(int64_t index) const = 0;
  // LengthAt of the indices first, first + 1, ..., first + out.size() - 1 into out (ids left
  // to the caller). REQUIRES the range inside [0, size). The default calls LengthAt for each
  // (the plain reference); a source overrides it where one loop over its table is cheaper.
  virtual Status LengthsAt(int64_t first, std::span<SampleLength> out) const {
    for (size_t k = 0; k < out.size(); ++k) {
      Result<SampleLength> r = LengthAt(first + static_cast<int64_t>(k));
      if (!r.ok()) return r.status();
      out[k] = *r;
    }
    return Status::Ok();
  }
  // Tokens and mask of the sample at `index`, whose id is `id`.
  virtual Status FillAt(int64_t index, int64_t id, Sample* out) const = 0;
  // The source's identity line (SampleSource::Identity), computed once.
  virtual Result<std::string> ComputeIdentity() const = 0;

  const SourceOptions& options() const { return options_; }
  int64_t mock_vocab() const {
    return options_.vocab_size > 0 ? options_.vocab_size : kDefaultMockVocab;
  }
  // Mock tokens of length L for sample `id`, target_mask empty (all ones).
  void FillMock(int64_t id, int64_t length, Sample* out) const {
    out->tokens.resize(static_cast<size_t>(length));
    FillMockTokens(options_.seed, id, mock_vocab(), out->tokens);
    out->target_mask.clear();
  }

 private:
  uint64_t PermutationKey(int64_t epoch) const {
    return Mix64(options_.seed ^ Mix64(0x5348554646ULL + static_cast<uint64_t>(epoch)));
  }
  void MakePermutation() {
    permutation_.emplace(static_cast<uint64_t>(size_), PermutationKey(epoch_));
  }
  int64_t IndexOf(int64_t position) const {
    if (!permutation_) return position;
    return static_cast<int64_t>((*permutation_)(static_cast<uint64_t>(position)));
  }
  // The positions of the empty indices in epoch `epoch`'s order, increasing: the indices
  // themselves in file order, their inverse images under the epoch's permutation when shuffled.
  // The empty indices are found once, by one pass over LengthAt (only when there are some).
  Result<std::vector<int64_t>> EmptyPositions(int64_t epoch) {
    if (empty_ == 0) return std::vector<int64_t>();
    if (empty_indices_.empty()) {
      for (int64_t i = 0; i < size_; ++i) {
        THDPACK_ASSIGN_OR_RETURN(const SampleLength s, LengthAt(i));
        if (s.length == 0) empty_indices_.push_back(i);
      }
      if (static_cast<int64_t>(empty_indices_.size()) != empty_) {
        return Status::Internal(spec_ + ": " + std::to_string(empty_indices_.size()) +
                                " empty entries found, " + std::to_string(empty_) + " expected");
      }
    }
    if (!options_.shuffle) return empty_indices_;
    const Permutation perm(static_cast<uint64_t>(size_), PermutationKey(epoch));
    std::vector<int64_t> out;
    out.reserve(empty_indices_.size());
    for (int64_t i : empty_indices_) {
      out.push_back(static_cast<int64_t>(perm.Inverse(static_cast<uint64_t>(i))));
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  // The position in epoch `epoch`'s order of its j-th non-empty entry (j < size - E).
  Result<int64_t> NthNonEmpty(int64_t epoch, int64_t j) {
    THDPACK_ASSIGN_OR_RETURN(const std::vector<int64_t> empty, EmptyPositions(epoch));
    int64_t p = j;
    for (int64_t q : empty) {
      if (q > p) break;
      ++p;
    }
    return p;
  }
  // The empty entries among the first `position` of epoch `epoch`'s order.
  Result<int64_t> EmptiesBefore(int64_t epoch, int64_t position) {
    THDPACK_ASSIGN_OR_RETURN(const std::vector<int64_t> empty, EmptyPositions(epoch));
    return static_cast<int64_t>(std::lower_bound(empty.begin(), empty.end(), position) -
                                empty.begin());
  }

  // Moves the cursor past empty indices (a source without any pays one comparison).
  Status SkipEmpty() {
    while (empty_ > 0 && position_ < size_) {
      Result<SampleLength> r = LengthAt(IndexOf(position_));
      if (!r.ok()) return error_ = r.status();
      if (r->length > 0) break;
      ++position_;
      ++next_id_;
      ++skipped_empty_;
    }
    return Status::Ok();
  }

  std::string spec_;
  int64_t size_;
  int64_t empty_ = 0;          // indices without tokens
  int64_t skipped_empty_ = 0;  // passed over since opening
  SourceOptions options_;
  int64_t position_ = 0;  // in the current epoch
  int64_t epoch_ = 0;
  int64_t next_id_ = 0;
  std::optional<Permutation> permutation_;
  Status error_;
  std::vector<int64_t> empty_indices_;  // found on the first seek that needs them
  std::string identity_;                // Identity(), once computed
};

// Lengths from a file or memory, tokens from MockTokens (lengths:, and mock in file mode).
// ReadLengthsFile (data.h) read with getline, one line at a time: the plain reference of the
// mapped reader (and what reads files that cannot be mapped).
[[nodiscard]] Result<std::vector<int32_t>> ReadLengthsFileByLine(const std::string& path,
                                                                 bool allow_header);

[[nodiscard]] Result<std::unique_ptr<SampleSource>> MakeLengthsVectorSource(
    std::string spec, std::vector<int32_t> lengths, const SourceOptions& options);

}  // namespace thdpack::data_internal

#endif  // THDPACK_SRC_DATA_DATA_INTERNAL_H_
