// The `jsonl` source: one JSON object per line with "input_ids" and optional "loss_mask".
//
// Two parsers: ParseJsonlLineReference (nlohmann_json, the rules and every error message) and a
// hand-written fast path for the common shape. The fast path accepts a line only when it is
// sure the reference would accept it with the same result; on anything unusual (an escape it
// does not handle, a number it does not check, a bad value) it gives up and the reference
// decides. So errors always come from the reference, and the test suite compares the two on
// random lines.
#include <cstring>
#include <nlohmann/json.hpp>

#include "data/data_internal.h"
#include "thdpack/data.h"

namespace thdpack {

using data_internal::Excerpt;
using data_internal::LineReader;
using data_internal::Trim;

namespace {

// ---------------------------------------------------------------------------------------------
// Fast path. Returns true with *out filled, or false ("ask the reference").
class FastParser {
 public:
  FastParser(std::string_view text, int64_t vocab) : p_(text.data()), end_(p_ + text.size()),
                                                     vocab_(vocab) {}

  bool Parse(Sample* out) {
    bool have_ids = false;
    bool have_mask = false;
    SkipWs();
    if (!Eat('{')) return false;
    SkipWs();
    if (Peek() == '}') return false;  // empty object: the reference reports the missing key
    while (true) {
      SkipWs();
      std::string_view key;
      if (!Key(&key)) return false;
      SkipWs();
      if (!Eat(':')) return false;
      SkipWs();
      if (key == "input_ids") {
        if (have_ids || !IdArray(&out->tokens)) return false;
        have_ids = true;
      } else if (key == "loss_mask") {
        if (have_mask || !MaskArray(&out->target_mask)) return false;
        have_mask = true;
      } else if (!SkipValue()) {
        return false;
      }
      SkipWs();
      if (Eat(',')) continue;
      if (Eat('}')) break;
      return false;
    }
    SkipWs();
    if (p_ != end_) return false;
    if (!have_ids || out->tokens.empty()) return false;
    if (!have_mask) {
      out->target_mask.clear();
    } else if (out->target_mask.size() != out->tokens.size()) {
      return false;
    }
    return true;
  }

 private:
  char Peek() const { return p_ < end_ ? *p_ : '\0'; }
  bool Eat(char c) {
    if (p_ < end_ && *p_ == c) {
      ++p_;
      return true;
    }
    return false;
  }
  void SkipWs() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\r' || *p_ == '\n')) ++p_;
  }

  // A key without escapes; plain ASCII only.
  bool Key(std::string_view* key) {
    if (!Eat('"')) return false;
    const char* start = p_;
    while (p_ < end_ && *p_ != '"') {
      const unsigned char c = static_cast<unsigned char>(*p_);
      if (c == '\\' || c < 0x20 || c >= 0x80) return false;
      ++p_;
    }
    if (p_ == end_) return false;
    *key = std::string_view(start, static_cast<size_t>(p_ - start));
    ++p_;
    return true;
  }

  // A string value: ASCII, simple escapes (no \u, which needs UTF-16 checks).
  bool SkipString() {
    if (!Eat('"')) return false;
    while (p_ < end_) {
      const unsigned char c = static_cast<unsigned char>(*p_++);
      if (c == '"') return true;
      if (c < 0x20 || c >= 0x80) return false;
      if (c == '\\') {
        if (p_ == end_) return false;
        const char e = *p_++;
        if (std::strchr("\"\\/bfnrt", e) == nullptr || e == '\0') return false;
      }
    }
    return false;
  }

  bool Digits() {
    const char* start = p_;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    return p_ != start;
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)? ; exponents go to the reference (it reports overflow).
  bool SkipNumber() {
    Eat('-');
    if (Eat('0')) {
      if (Peek() >= '0' && Peek() <= '9') return false;
    } else if (!Digits()) {
      return false;
    }
    if (Eat('.') && !Digits()) return false;
    return Peek() != 'e' && Peek() != 'E';
  }

  bool SkipLiteral(std::string_view word) {
    if (static_cast<size_t>(end_ - p_) < word.size() ||
        std::string_view(p_, word.size()) != word) {
      return false;
    }
    p_ += word.size();
    return true;
  }

  bool SkipValue(int depth = 0) {
    if (depth > 32) return false;
    switch (Peek()) {
      case '"':
        return SkipString();
      case 't':
        return SkipLiteral("true");
      case 'f':
        return SkipLiteral("false");
      case 'n':
        return SkipLiteral("null");
      case '[': {
        ++p_;
        SkipWs();
        if (Eat(']')) return true;
        while (true) {
          SkipWs();
          if (!SkipValue(depth + 1)) return false;
          SkipWs();
          if (Eat(',')) continue;
          return Eat(']');
        }
      }
      case '{': {
        ++p_;
        SkipWs();
        if (Eat('}')) return true;
        while (true) {
          SkipWs();
          if (!SkipString()) return false;
          SkipWs();
          if (!Eat(':')) return false;
          SkipWs();
          if (!SkipValue(depth + 1)) return false;
          SkipWs();
          if (Eat(',')) continue;
          return Eat('}');
        }
      }
      default:
        return SkipNumber();
    }
  }

  // [int, ...] with every value in [0, vocab) (or [0, 2^31)), at most 10 digits, no sign.
  bool IdArray(std::vector<TokenId>* ids) {
    ids->clear();
    if (!Eat('[')) return false;
    SkipWs();
    if (Eat(']')) return true;
    const int64_t limit = vocab_ > 0 ? vocab_ : (int64_t{1} << 31);
    while (true) {
      SkipWs();
      const char* start = p_;
      int64_t v = 0;
      while (p_ < end_ && *p_ >= '0' && *p_ <= '9') {
        v = v * 10 + (*p_ - '0');
        ++p_;
        if (p_ - start > 10) return false;
      }
      const ptrdiff_t n = p_ - start;
      if (n == 0 || (n > 1 && *start == '0') || v >= limit) return false;
      if (p_ < end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E')) return false;
      ids->push_back(static_cast<TokenId>(v));
      SkipWs();
      if (Eat(',')) continue;
      return Eat(']');
    }
  }

  // [0|1, ...]
  bool MaskArray(std::vector<uint8_t>* mask) {
    mask->clear();
    if (!Eat('[')) return false;
    SkipWs();
    if (Eat(']')) return true;
    while (true) {
      SkipWs();
      const char c = Peek();
      if (c != '0' && c != '1') return false;
      ++p_;
      const char after = Peek();
      if ((after >= '0' && after <= '9') || after == '.' || after == 'e' || after == 'E') {
        return false;
      }
      mask->push_back(static_cast<uint8_t>(c - '0'));
      SkipWs();
      if (Eat(',')) continue;
      return Eat(']');
    }
  }

  const char* p_;
  const char* end_;
  int64_t vocab_;
};

std::string Prefix(std::string_view where) {
  std::string out(where);
  out += ": ";
  return out;
}

// A JSON value for an error message: scalars as their text (cut), arrays and objects by type
// and size only, so a message never walks a value read from the input.
std::string Describe(const nlohmann::json& v) {
  if (v.is_structured()) {
    return std::string(v.is_array() ? "an array" : "an object") + " of " +
           std::to_string(v.size()) + (v.size() == 1 ? " entry" : " entries");
  }
  return Excerpt(v.dump());
}

// The signed value of a JSON integer, or nullopt when it does not fit int64 (a huge unsigned).
std::optional<int64_t> IntegerValue(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  return v.get<int64_t>();
}

class JsonlSource final : public SampleSource {
 public:
  JsonlSource(std::string spec, std::unique_ptr<LineReader> reader, const SourceOptions& options)
      : spec_(std::move(spec)), reader_(std::move(reader)), options_(options) {}

  Result<std::optional<Sample>> Next() override {
    Sample sample;
    THDPACK_ASSIGN_OR_RETURN(bool got, ReadOne(&sample));
    if (!got) return std::optional<Sample>();
    return std::optional<Sample>(std::move(sample));
  }

  Result<std::optional<SampleLength>> NextLength() override {
    THDPACK_ASSIGN_OR_RETURN(bool got, ReadOne(&scratch_));
    if (!got) return std::optional<SampleLength>();
    return std::optional<SampleLength>(SampleLength{
        scratch_.id, static_cast<int64_t>(scratch_.tokens.size()), NumTargets(scratch_)});
  }

  Status Reset() override {
    if (!error_.ok()) return error_;
    Status s = reader_->Rewind();
    if (!s.ok()) return error_ = s;
    ++epoch_;
    position_ = 0;
    at_end_ = false;
    return Status::Ok();
  }

  std::optional<int64_t> size_hint() const override { return size_; }
  int64_t epoch() const override { return epoch_; }
  const std::string& spec() const override { return spec_; }

  // The epoch size is part of the cursor from epoch 1 on: a reader learns it at the end of
  // its first pass, which is followed at once by the Reset into epoch 1.
  SourceCursor cursor() const override {
    SourceCursor c;
    c.epoch = epoch_;
    c.position = position_;
    c.next_id = next_id_;
    c.byte_offset = reader_->next_offset();
    c.line = reader_->line_number();
    c.epoch_size = epoch_ > 0 && size_ ? *size_ : -1;
    return c;
  }

  Status Seek(const SourceCursor& c) override {
    if (!error_.ok()) return error_;
    auto bad = [&](const std::string& field, const std::string& rule) {
      return Status::Corruption(spec_ + ": cursor field \"" + field + "\" " + rule);
    };
    auto str = [](int64_t v) { return std::to_string(v); };
    if (c.epoch < 0) return bad("epoch", "= " + str(c.epoch) + " is negative");
    if (c.epoch > 0 && c.epoch_size < 1) {
      return bad("epoch_size", "= " + str(c.epoch_size) + " in epoch " + str(c.epoch) +
                                   " (after a full pass the samples of an epoch are known, >= 1)");
    }
    if (c.epoch == 0 && c.epoch_size != -1 && c.epoch_size < 1) {
      return bad("epoch_size", "= " + str(c.epoch_size) + " (must be -1, unknown, or >= 1)");
    }
    if (size_ && c.epoch_size != -1 && c.epoch_size != *size_) {
      return bad("epoch_size", "= " + str(c.epoch_size) + ", but this file holds " + str(*size_) +
                                   " samples");
    }
    if (c.position < 0 || (c.epoch_size >= 1 && c.position > c.epoch_size)) {
      return bad("position", "= " + str(c.position) + " is outside [0, " +
                                 (c.epoch_size >= 1 ? str(c.epoch_size) : std::string("...")) +
                                 "]");
    }
    const int64_t id = (c.epoch > 0 ? c.epoch * c.epoch_size : 0) + c.position;
    if (c.next_id != id) {
      return bad("next_id", "= " + str(c.next_id) + ", but epoch " + str(c.epoch) + " position " +
                                str(c.position) + " gives " + str(id));
    }
    if (c.skipped_empty != 0) {
      return bad("skipped_empty", "= " + str(c.skipped_empty) + " (a jsonl file has no empty "
                                                                 "documents)");
    }
    if ((c.byte_offset == 0) != (c.line == 0) || c.line < 0) {
      return bad("line", "= " + str(c.line) + " at byte " + str(c.byte_offset) +
                             " (line 0 is byte 0, and only it)");
    }
    if (c.byte_offset > 0 || c.position > 0) {
      THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<data_internal::MappedFile> file,
                               data_internal::MappedFile::Open(reader_->path()));
      const auto bytes = file->bytes();
      if (c.byte_offset < 0 || static_cast<uint64_t>(c.byte_offset) > bytes.size()) {
        return bad("byte_offset", "= " + str(c.byte_offset) + " is outside the file's " +
                                      str(static_cast<int64_t>(bytes.size())) + " bytes");
      }
      if (c.byte_offset == 0 || bytes[static_cast<size_t>(c.byte_offset) - 1] != '\n') {
        return bad("byte_offset", "= " + str(c.byte_offset) + " is not at the start of a line");
      }
    }
    Status s = reader_->Seek(c.byte_offset, c.line);
    if (!s.ok()) return error_ = s;
    epoch_ = c.epoch;
    position_ = c.position;
    next_id_ = c.next_id;
    if (c.epoch_size >= 1) size_ = c.epoch_size;
    at_end_ = false;
    return Status::Ok();
  }

  // A separate reader over the same file counts non-blank lines (the rule of ReadOne).
  Result<SourceCursor> CursorAfter(int64_t samples) override {
    if (!error_.ok()) return error_;
    if (samples < 0) {
      return Status::OutOfRange(spec_ + ": a cursor after " + std::to_string(samples) +
                                " samples (must be >= 0)");
    }
    SourceCursor c;
    if (samples == 0) return c;
    int64_t target = samples;  // the samples to pass in the epoch scanned
    for (int pass = 0; pass < 2; ++pass) {
      THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<LineReader> reader,
                               LineReader::Open(reader_->path()));
      int64_t count = 0;
      std::string_view line;
      while (true) {
        THDPACK_ASSIGN_OR_RETURN(bool more, reader->ReadLine(&line));
        if (!more) break;
        if (Trim(line).empty()) continue;
        if (++count == target) {
          c.position = target;
          c.next_id = samples;
          c.byte_offset = reader->next_offset();
          c.line = reader->line_number();
          if (c.epoch > 0) c.epoch_size = *size_;
          return c;
        }
      }
      if (count == 0) {
        return Status::InvalidArgument(reader_->path() + ": holds no samples (no non-blank line)");
      }
      if (size_ && *size_ != count) {
        return Status::Internal(spec_ + ": " + std::to_string(count) +
                                " samples on this pass, " + std::to_string(*size_) + " before");
      }
      size_ = count;  // the first pass ended: the epoch size is known
      c.epoch = (samples - 1) / count;
      target = (samples - 1) % count + 1;
    }
    return Status::Internal(spec_ + ": sample " + std::to_string(samples) + " not found");
  }

  Result<SourceCursor> CursorAtEpoch(int64_t epoch) override {
    if (!error_.ok()) return error_;
    SourceCursor c;
    if (epoch < 0) return Status::OutOfRange(spec_ + ": no epoch " + std::to_string(epoch));
    if (epoch == 0) return c;
    if (!size_) {  // one pass over the file learns the epoch size
      THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<LineReader> reader,
                               LineReader::Open(reader_->path()));
      int64_t count = 0;
      std::string_view line;
      while (true) {
        THDPACK_ASSIGN_OR_RETURN(bool more, reader->ReadLine(&line));
        if (!more) break;
        count += Trim(line).empty() ? 0 : 1;
      }
      if (count == 0) {
        return Status::InvalidArgument(reader_->path() + ": holds no samples (no non-blank line)");
      }
      size_ = count;
    }
    c.epoch = epoch;
    c.epoch_size = *size_;
    if (__builtin_mul_overflow(epoch, *size_, &c.next_id)) {
      return Status::OutOfRange(spec_ + ": epoch " + std::to_string(epoch) +
                                " takes ids past 2^63 - 1");
    }
    return c;
  }

  Result<std::string> Identity() override {
    if (identity_.empty()) {
      THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<data_internal::MappedFile> file,
                               data_internal::MappedFile::Open(reader_->path()));
      identity_ = "jsonl " + data_internal::HeadTailIdentity(file->bytes());
    }
    return identity_;
  }

 private:
  // Reads the next non-blank line into *out; false at the end of the epoch.
  Result<bool> ReadOne(Sample* out) {
    if (!error_.ok()) return error_;
    if (at_end_) return false;
    std::string_view line;
    while (true) {
      Result<bool> more = reader_->ReadLine(&line);
      if (!more.ok()) return error_ = more.status();
      if (!*more) {
        at_end_ = true;
        if (!size_) {
          if (position_ == 0) {
            return error_ = Status::InvalidArgument(reader_->path() +
                                                    ": holds no samples (no non-blank line)");
          }
          size_ = position_;
        }
        return false;
      }
      if (!Trim(line).empty()) break;  // whitespace-only lines are skipped
    }
    if (!FastParser(line, options_.vocab_size).Parse(out)) {
      const std::string where = reader_->path() + ":" + std::to_string(reader_->line_number());
      Status s = ParseJsonlLineReference(line, options_.vocab_size, where, out);
      if (!s.ok()) return error_ = s;
    }
    out->id = next_id_++;
    ++position_;
    return true;
  }

  std::string spec_;
  std::unique_ptr<LineReader> reader_;
  SourceOptions options_;
  std::optional<int64_t> size_;
  int64_t epoch_ = 0;
  int64_t position_ = 0;  // samples read in this epoch
  int64_t next_id_ = 0;
  bool at_end_ = false;
  Sample scratch_;
  Status error_;
  std::string identity_;
};

}  // namespace

Status ParseJsonlLineReference(std::string_view line, int64_t vocab_size, std::string_view where,
                               Sample* out) {
  // Before nlohmann sees the line: it stops at a NUL byte (silently dropping the rest), and a
  // deep value would make any walk over it deep.
  THDPACK_RETURN_IF_ERROR(data_internal::CheckJsonText(line, where, "line"));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line.begin(), line.end());
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(Prefix(where) + "not valid JSON (" + e.what() + "): \"" +
                                   Excerpt(line) + "\"");
  }
  if (!j.is_object()) {
    return Status::InvalidArgument(Prefix(where) + "expected a JSON object, got " + j.type_name());
  }
  const auto ids = j.find("input_ids");
  if (ids == j.end()) return Status::InvalidArgument(Prefix(where) + "missing \"input_ids\"");
  if (!ids->is_array()) {
    return Status::InvalidArgument(Prefix(where) + "\"input_ids\" must be an array of integers, got " +
                                   ids->type_name());
  }
  if (ids->empty()) {
    return Status::InvalidArgument(Prefix(where) +
                                   "\"input_ids\" is empty (a sample needs at least one token)");
  }
  if (ids->size() > static_cast<size_t>(kMaxSampleLength)) {
    return Status::OutOfRange(Prefix(where) + "\"input_ids\" has more than 2^31 - 1 tokens");
  }
  const int64_t limit = vocab_size > 0 ? vocab_size : kMaxSampleLength + 1;
  out->tokens.resize(ids->size());
  for (size_t k = 0; k < ids->size(); ++k) {
    const nlohmann::json& v = (*ids)[k];
    const std::string at = "input_ids[" + std::to_string(k) + "]";
    if (!v.is_number_integer()) {
      return Status::InvalidArgument(Prefix(where) + at + " is not an integer: " +
                                     Describe(v));
    }
    const std::optional<int64_t> value = IntegerValue(v);
    if (value && *value < 0) {
      return Status::InvalidArgument(Prefix(where) + at + " = " + std::to_string(*value) +
                                     " is negative");
    }
    if (!value || *value >= limit) {
      return Status::OutOfRange(
          Prefix(where) + at + " = " + Describe(v) +
          (vocab_size > 0 ? " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")"
                          : std::string(" exceeds 2^31 - 1 (token ids are int32)")));
    }
    out->tokens[k] = static_cast<TokenId>(*value);
  }
  out->target_mask.clear();
  const auto mask = j.find("loss_mask");
  if (mask != j.end()) {
    if (!mask->is_array()) {
      return Status::InvalidArgument(Prefix(where) + "\"loss_mask\" must be an array of 0/1, got " +
                                     mask->type_name());
    }
    if (mask->size() != ids->size()) {
      return Status::InvalidArgument(Prefix(where) + "\"loss_mask\" has " +
                                     std::to_string(mask->size()) + " entries but \"input_ids\" has " +
                                     std::to_string(ids->size()) + " (they are token-aligned)");
    }
    out->target_mask.resize(mask->size());
    for (size_t k = 0; k < mask->size(); ++k) {
      const nlohmann::json& v = (*mask)[k];
      if (!v.is_number_integer() || (v.get<int64_t>() != 0 && v.get<int64_t>() != 1) ||
          (v.is_number_unsigned() && v.get<uint64_t>() > 1)) {
        return Status::InvalidArgument(Prefix(where) + "loss_mask[" + std::to_string(k) + "] = " +
                                       Describe(v) + " is not 0 or 1");
      }
      out->target_mask[k] = static_cast<uint8_t>(v.get<int64_t>());
    }
  }
  return Status::Ok();
}

Status ParseJsonlLine(std::string_view line, int64_t vocab_size, std::string_view where,
                      Sample* out) {
  if (FastParser(line, vocab_size).Parse(out)) return Status::Ok();
  return ParseJsonlLineReference(line, vocab_size, where, out);
}

Result<std::unique_ptr<SampleSource>> OpenJsonlSource(const std::string& path,
                                                      const SourceOptions& options) {
  std::string spec = "jsonl:" + path;
  THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec, options));
  if (options.shuffle) {
    return Status::Unimplemented(spec + ": shuffle is not available for jsonl (a streaming file "
                                 "has no random access); shuffle the file beforehand");
  }
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<LineReader> reader, LineReader::Open(path));
  return std::unique_ptr<SampleSource>(new JsonlSource(std::move(spec), std::move(reader), options));
}

}  // namespace thdpack
