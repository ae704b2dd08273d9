#include "data/data_internal.h"

#include "common/hash64.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>

namespace thdpack::data_internal {

std::string ErrnoText(std::string_view what, std::string_view path) {
  const int err = errno;
  std::string out(what);
  out += " ";
  out += path;
  out += ": ";
  out += std::strerror(err);
  return out;
}

Status ValidateOptions(std::string_view spec, const SourceOptions& options) {
  if (options.vocab_size < 0 || options.vocab_size > kMaxSampleLength) {
    return Status::InvalidArgument(std::string(spec) + ": vocab_size must be in [0, 2^31 - 1] " +
                                   "(0 = unknown), got " + std::to_string(options.vocab_size));
  }
  if (options.mock_num_samples < 0) {
    return Status::InvalidArgument(std::string(spec) + ": mock_num_samples must be >= 0 " +
                                   "(0 = default), got " + std::to_string(options.mock_num_samples));
  }
  return Status::Ok();
}

std::optional<int64_t> ParseInt64(std::string_view text) {
  if (text.empty()) return std::nullopt;
  if (text.front() == '+') {
    text.remove_prefix(1);
    if (text.empty() || text.front() == '-' || text.front() == '+') return std::nullopt;
  }
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size()) return std::nullopt;
  return value;
}

std::string_view Trim(std::string_view text) {
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

std::string Excerpt(std::string_view text, size_t max) {
  std::string out;
  const size_t n = std::min(text.size(), max);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    out += (c < 0x20 || c == 0x7f) ? '?' : static_cast<char>(c);
  }
  if (text.size() > max) out += "...";
  return out;
}

bool StripBom(std::string_view* text) {
  if (!text->starts_with(kUtf8Bom)) return false;
  text->remove_prefix(kUtf8Bom.size());
  return true;
}

Status CheckJsonText(std::string_view text, std::string_view where, std::string_view unit) {
  auto at = [unit](size_t i) {
    return " at byte " + std::to_string(i) + " of the " + std::string(unit);
  };
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0') {
      return Status::InvalidArgument(std::string(where) + ": NUL byte" + at(i) +
                                     " (JSON text holds no NUL; the text after it would be lost)");
    }
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        const std::string limit = std::to_string(kMaxJsonDepth);
        return Status::InvalidArgument(std::string(where) + ": JSON nested deeper than " + limit +
                                       " levels" + at(i) + " (arrays and objects nest at most " +
                                       limit + " deep)");
      }
    } else if (c == ']' || c == '}') {
      if (depth > 0) --depth;  // unbalanced text is the parser's to report
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<LineReader>> LineReader::Open(const std::string& path) {
  std::unique_ptr<LineReader> r(new LineReader());
  r->path_ = path;
  r->file_ = std::fopen(path.c_str(), "rb");
  if (r->file_ == nullptr) return Status::IOError(ErrnoText("cannot open", path));
  return r;
}

LineReader::~LineReader() {
  if (file_ != nullptr) std::fclose(file_);
  std::free(buffer_);
}

Result<bool> LineReader::ReadLine(std::string_view* line) {
  errno = 0;
  const ssize_t n = getline(&buffer_, &capacity_, file_);
  if (n < 0) {
    if (std::ferror(file_)) return Status::IOError(ErrnoText("cannot read", path_));
    return false;
  }
  size_t len = static_cast<size_t>(n);
  if (len > 0 && buffer_[len - 1] == '\n') --len;
  ++line_number_;
  line_offset_ = next_offset_;
  next_offset_ += n;
  *line = std::string_view(buffer_, len);
  if (line_number_ == 1 && StripBom(line)) line_offset_ += static_cast<int64_t>(kUtf8Bom.size());
  return true;
}

Status LineReader::Seek(int64_t offset, int64_t lines) {
  if (fseeko(file_, static_cast<off_t>(offset), SEEK_SET) != 0) {
    return Status::IOError(ErrnoText("cannot seek", path_));
  }
  std::clearerr(file_);
  line_number_ = lines;
  line_offset_ = offset;
  next_offset_ = offset;
  return Status::Ok();
}

Status LineReader::Rewind() {
  if (std::fseek(file_, 0, SEEK_SET) != 0) return Status::IOError(ErrnoText("cannot seek", path_));
  std::clearerr(file_);
  line_number_ = 0;
  line_offset_ = 0;
  next_offset_ = 0;
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  std::unique_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(ErrnoText("cannot open", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    Status s = Status::IOError(ErrnoText("cannot stat", path));
    ::close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::IOError("cannot map " + path + ": not a regular file");
  }
  m->size_ = static_cast<size_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      Status s = Status::IOError(ErrnoText("cannot mmap", path));
      ::close(fd);
      return s;
    }
    m->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return m;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ---------------------------------------------------------------------------------------------

Permutation::Permutation(uint64_t n, uint64_t key) : n_(n), key_(key) {
  int bits = 0;
  while (bits < 64 && (uint64_t{1} << bits) < n) ++bits;
  if (bits % 2 != 0) ++bits;
  if (bits < 2) bits = 2;
  half_bits_ = bits / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
}

uint64_t Permutation::operator()(uint64_t i) const {
  // Cycle walking: the Feistel network permutes [0, 2^(2*half)) which contains [0, n); applying
  // it until the value lands inside [0, n) restricts it to a bijection of [0, n). The domain is
  // less than 4n, so the expected number of rounds is below 4.
  uint64_t x = i;
  do {
    uint64_t left = x >> half_bits_;
    uint64_t right = x & half_mask_;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = Mix64(key_ ^ Mix64(right + (round << 56))) & half_mask_;
      const uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

std::string HeadTailIdentity(std::span<const uint8_t> bytes) {
  const size_t n = std::min(bytes.size(), kHeadTailBytes);
  const uint64_t tail = internal::Hash64(bytes.last(n));
  return std::to_string(bytes.size()) + " bytes, head and tail hash " +
         internal::Hex64(internal::Hash64(bytes.first(n), tail));
}

uint64_t Permutation::Inverse(uint64_t y) const {
  uint64_t x = y;
  do {
    uint64_t left = x >> half_bits_;
    uint64_t right = x & half_mask_;
    for (uint64_t round = 4; round-- > 0;) {
      // Forward: (left, right) -> (right, left ^ f(right)); backward from (l', r'):
      // right = l', left = r' ^ f(l').
      const uint64_t f = Mix64(key_ ^ Mix64(left + (round << 56))) & half_mask_;
      const uint64_t prev_left = right ^ f;
      right = left;
      left = prev_left;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

}  // namespace thdpack::data_internal
