// The `megatron` source (Megatron-LM indexed dataset, MMIDIDX version 1) and its writer.
// Format: thdpack/megatron_dataset.h. Every number read from the index is checked against the
// file sizes, in overflow-safe arithmetic, before it is used; the .bin is touched only to read
// tokens of a document that Next() returns.
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "common/hash64.h"
#include "data/data_internal.h"
#include "thdpack/data.h"
#include "thdpack/megatron_dataset.h"

namespace thdpack {

using data_internal::IndexedSource;
using data_internal::MappedFile;

namespace {

template <typename T>
T LoadLE(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) {
    uint8_t b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    for (size_t i = 0; i < sizeof(T) / 2; ++i) std::swap(b[i], b[sizeof(T) - 1 - i]);
    std::memcpy(&v, b, sizeof(T));
  }
  return v;
}

template <typename T>
void StoreLE(T v, std::vector<uint8_t>* out) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) {
    for (size_t i = 0; i < sizeof(T) / 2; ++i) std::swap(b[i], b[sizeof(T) - 1 - i]);
  }
  out->insert(out->end(), b, b + sizeof(T));
}

std::string U(uint64_t v) { return std::to_string(v); }

// Converts one stored token to an int32 id; false with *why on a value that is not one.
template <typename T>
bool ToTokenId(T raw, int64_t limit, TokenId* out, std::string* why) {
  if constexpr (std::is_floating_point_v<T>) {
    const double v = static_cast<double>(raw);
    if (!std::isfinite(v) || v != std::floor(v)) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.17g", v);
      *why = std::string("token value ") + buf + " is not an integer";
      return false;
    }
    if (v < 0 || v >= static_cast<double>(limit)) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.17g", v);
      *why = std::string("token value ") + buf +
             (v < 0 ? std::string(" is negative")
                    : " is outside [0, " + std::to_string(limit) + ")");
      return false;
    }
    *out = static_cast<TokenId>(v);
    return true;
  } else {
    if constexpr (std::is_signed_v<T>) {
      if (raw < 0) {
        *why = "token value " + std::to_string(static_cast<int64_t>(raw)) + " is negative";
        return false;
      }
    }
    if (static_cast<uint64_t>(raw) >= static_cast<uint64_t>(limit)) {
      *why = "token value " + std::to_string(static_cast<uint64_t>(raw)) + " is outside [0, " +
             std::to_string(limit) + ")";
      return false;
    }
    *out = static_cast<TokenId>(raw);
    return true;
  }
}

// Converts n tokens at p; returns the index of the first bad one (n when all are good).
template <typename T>
int64_t ConvertTokens(const uint8_t* p, int64_t n, int64_t limit, TokenId* out, std::string* why) {
  for (int64_t i = 0; i < n; ++i) {
    if (!ToTokenId<T>(LoadLE<T>(p + i * static_cast<int64_t>(sizeof(T))), limit, out + i, why)) {
      return i;
    }
  }
  return n;
}

class MegatronSource final : public IndexedSource<SampleSource> {
 public:
  MegatronSource(std::string spec, int64_t num_documents, int64_t empty_documents,
                 std::unique_ptr<MappedFile> idx, std::unique_ptr<MappedFile> bin, uint8_t dtype,
                 uint64_t sequence_count, const SourceOptions& options)
      : IndexedSource(std::move(spec), num_documents, options, empty_documents),
        idx_(std::move(idx)),
        bin_(std::move(bin)),
        dtype_(dtype),
        dtype_size_(MegatronDTypeSize(dtype)),
        lengths_(idx_->bytes().data() + kMegatronIndexHeaderSize),
        pointers_(lengths_ + 4 * sequence_count),
        documents_(pointers_ + 8 * sequence_count) {}

 protected:
  Result<SampleLength> LengthAt(int64_t index) const override {
    const int64_t length = DocumentLength(index);
    return SampleLength{0, length, length - 1};
  }
  Status LengthsAt(int64_t first, std::span<SampleLength> out) const override {
    for (size_t k = 0; k < out.size(); ++k) {
      const int64_t length = DocumentLength(first + static_cast<int64_t>(k));
      out[k] = SampleLength{0, length, length - 1};
    }
    return Status::Ok();
  }

  Status FillAt(int64_t index, int64_t /*id*/, Sample* out) const override {
    out->tokens.resize(static_cast<size_t>(DocumentLength(index)));
    out->target_mask.clear();
    const int64_t limit = options().vocab_size > 0 ? options().vocab_size : kMaxSampleLength + 1;
    const uint64_t first = Document(index);
    const uint64_t last = Document(index + 1);
    int64_t position = 0;
    for (uint64_t s = first; s < last; ++s) {
      const int64_t n = SequenceLength(s);
      const uint8_t* p = bin_->bytes().data() + Pointer(s);  // checked at open
      TokenId* dst = out->tokens.data() + position;
      std::string why;
      int64_t good = n;
      switch (static_cast<MegatronDType>(dtype_)) {
        case MegatronDType::kUint8: good = ConvertTokens<uint8_t>(p, n, limit, dst, &why); break;
        case MegatronDType::kInt8: good = ConvertTokens<int8_t>(p, n, limit, dst, &why); break;
        case MegatronDType::kInt16: good = ConvertTokens<int16_t>(p, n, limit, dst, &why); break;
        case MegatronDType::kInt32: good = ConvertTokens<int32_t>(p, n, limit, dst, &why); break;
        case MegatronDType::kInt64: good = ConvertTokens<int64_t>(p, n, limit, dst, &why); break;
        case MegatronDType::kFloat64: good = ConvertTokens<double>(p, n, limit, dst, &why); break;
        case MegatronDType::kFloat32: good = ConvertTokens<float>(p, n, limit, dst, &why); break;
        case MegatronDType::kUint16: good = ConvertTokens<uint16_t>(p, n, limit, dst, &why); break;
      }
      if (good != n) {
        const uint64_t byte = static_cast<uint64_t>(Pointer(s)) +
                              static_cast<uint64_t>(good) * static_cast<uint64_t>(dtype_size_);
        return Status::InvalidArgument(
            bin_->path() + ": document " + std::to_string(index) + ", position " +
            std::to_string(position + good) + " (sequence " + U(s) + ", byte offset " + U(byte) +
            ", dtype " + std::string(MegatronDTypeName(dtype_)) + "): " + why +
            (options().vocab_size > 0 ? " (vocabulary size " + std::to_string(options().vocab_size) + ")"
                                      : std::string()));
      }
      position += n;
    }
    return Status::Ok();
  }

  // The index whole (it holds every document's length; opening read it all already) and the
  // .bin's size with its head and tail.
  Result<std::string> ComputeIdentity() const override {
    return "megatron index " + std::to_string(idx_->size()) + " bytes hash " +
           internal::Hex64(internal::Hash64(idx_->bytes())) + ", bin " +
           data_internal::HeadTailIdentity(bin_->bytes());
  }

 private:
  int64_t SequenceLength(uint64_t s) const { return LoadLE<int32_t>(lengths_ + 4 * s); }
  int64_t Pointer(uint64_t s) const { return LoadLE<int64_t>(pointers_ + 8 * s); }
  uint64_t Document(int64_t k) const {
    return static_cast<uint64_t>(LoadLE<int64_t>(documents_ + 8 * static_cast<uint64_t>(k)));
  }
  int64_t DocumentLength(int64_t k) const {
    int64_t total = 0;  // validated at open: in [0, 2^31 - 1] (0: an empty document)
    for (uint64_t s = Document(k); s < Document(k + 1); ++s) total += SequenceLength(s);
    return total;
  }

  std::unique_ptr<MappedFile> idx_;
  std::unique_ptr<MappedFile> bin_;
  uint8_t dtype_;
  int64_t dtype_size_;
  const uint8_t* lengths_;    // int32[S], little-endian, unaligned
  const uint8_t* pointers_;   // int64[S]
  const uint8_t* documents_;  // int64[D]
};

Status IndexError(const std::string& path, uint64_t byte, const std::string& what) {
  return Status::Corruption(path + ": byte offset " + U(byte) + ": " + what);
}

}  // namespace

int64_t MegatronDTypeSize(uint8_t code) {
  switch (code) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: return 4;
    case 5: case 6: return 8;
    default: return 0;
  }
}

std::string_view MegatronDTypeName(uint8_t code) {
  switch (code) {
    case 1: return "uint8";
    case 2: return "int8";
    case 3: return "int16";
    case 4: return "int32";
    case 5: return "int64";
    case 6: return "float64";
    case 7: return "float32";
    case 8: return "uint16";
    default: return "unknown";
  }
}

MegatronDType MegatronBestDType(int64_t vocab_size) {
  return vocab_size < 65500 ? MegatronDType::kUint16 : MegatronDType::kInt32;
}

Result<std::unique_ptr<SampleSource>> OpenMegatronSource(const std::string& prefix,
                                                         const SourceOptions& options) {
  std::string spec = "megatron:" + prefix;
  THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec, options));
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> idx, MappedFile::Open(idx_path));
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> bin, MappedFile::Open(bin_path));
  const uint8_t* base = idx->bytes().data();
  const uint64_t idx_size = idx->size();
  const uint64_t bin_size = bin->size();

  // Header.
  if (idx_size < static_cast<uint64_t>(kMegatronIndexHeaderSize)) {
    return Status::Corruption(idx_path + ": file is " + U(idx_size) + " bytes, shorter than the " +
                              std::to_string(kMegatronIndexHeaderSize) + "-byte header");
  }
  if (std::memcmp(base, kMegatronIndexMagic, sizeof(kMegatronIndexMagic)) != 0) {
    return IndexError(idx_path, 0, "bad magic (expected \"MMIDIDX\\0\\0\": not a Megatron index)");
  }
  const uint64_t version = LoadLE<uint64_t>(base + 9);
  if (version != kMegatronIndexVersion) {
    return IndexError(idx_path, 9, "unsupported version " + U(version) + " (only 1 is known)");
  }
  const uint8_t dtype = base[17];
  const int64_t dtype_size = MegatronDTypeSize(dtype);
  if (dtype_size == 0) {
    return IndexError(idx_path, 17, "unknown dtype code " + std::to_string(dtype) +
                                        " (1..8: uint8 int8 int16 int32 int64 float64 float32 "
                                        "uint16)");
  }
  const uint64_t seq_count = LoadLE<uint64_t>(base + 18);
  const uint64_t doc_count = LoadLE<uint64_t>(base + 26);

  // The arrays must fit the file exactly (optionally followed by int8 sequence_modes[S]).
  uint64_t need = static_cast<uint64_t>(kMegatronIndexHeaderSize);
  uint64_t seq_bytes = 0, doc_bytes = 0;
  if (__builtin_mul_overflow(seq_count, uint64_t{12}, &seq_bytes) ||
      __builtin_mul_overflow(doc_count, uint64_t{8}, &doc_bytes) ||
      __builtin_add_overflow(need, seq_bytes, &need) ||
      __builtin_add_overflow(need, doc_bytes, &need) || need > idx_size) {
    return IndexError(idx_path, 18, "header counts (sequence_count " + U(seq_count) +
                                        ", document_count " + U(doc_count) +
                                        ") need more bytes than the file's " + U(idx_size));
  }
  if (idx_size != need && idx_size - need != seq_count) {
    return IndexError(idx_path, need, "file is " + U(idx_size) + " bytes; the header's counts "
                      "give " + U(need) + " (or " + U(need + seq_count) +
                      " with sequence modes): trailing or missing bytes");
  }
  if (doc_count == 0) {
    return IndexError(idx_path, 26, "document_count is 0 (document_indices must hold at least "
                                    "the leading 0)");
  }

  // Sequences: lengths >= 0; pointers contiguous from 0 (as Megatron's writer makes them) and
  // inside .bin.
  const uint8_t* lengths = base + kMegatronIndexHeaderSize;
  const uint8_t* pointers = lengths + 4 * seq_count;
  const uint8_t* documents = pointers + 8 * seq_count;
  const uint64_t lengths_at = static_cast<uint64_t>(kMegatronIndexHeaderSize);
  const uint64_t pointers_at = lengths_at + 4 * seq_count;
  const uint64_t documents_at = pointers_at + 8 * seq_count;
  uint64_t expected = 0;  // <= bin_size throughout, so no overflow below
  for (uint64_t s = 0; s < seq_count; ++s) {
    const int32_t length = LoadLE<int32_t>(lengths + 4 * s);
    if (length < 0) {
      return IndexError(idx_path, lengths_at + 4 * s,
                        "sequence_lengths[" + U(s) + "] = " + std::to_string(length) + " is negative");
    }
    const int64_t pointer = LoadLE<int64_t>(pointers + 8 * s);
    if (pointer < 0 || static_cast<uint64_t>(pointer) != expected) {
      return IndexError(idx_path, pointers_at + 8 * s,
                        "sequence_pointers[" + U(s) + "] = " + std::to_string(pointer) +
                            ", expected " + U(expected) + " (previous pointer + length * " +
                            std::to_string(dtype_size) + ")");
    }
    const uint64_t bytes = static_cast<uint64_t>(length) * static_cast<uint64_t>(dtype_size);
    if (bytes > bin_size - expected) {
      return IndexError(idx_path, lengths_at + 4 * s,
                        "sequence " + U(s) + " (pointer " + U(expected) + ", length " +
                            std::to_string(length) + ") ends past the end of " + bin_path + " (" +
                            U(bin_size) + " bytes)");
    }
    expected += bytes;
  }
  if (expected != bin_size) {
    return Status::Corruption(bin_path + ": file is " + U(bin_size) + " bytes but " + idx_path +
                              " describes " + U(expected) + " (mismatched or truncated pair)");
  }

  // Documents: 0 = d[0] <= d[1] <= ... <= d[D-1] = S, each document 0 .. 2^31-1 tokens. An
  // empty one (no sequence, or sequences of length 0) is what Megatron's preprocess_data.py
  // writes for a text that tokenizes to nothing: it is valid, and holds no sample.
  auto doc = [&](uint64_t k) { return LoadLE<int64_t>(documents + 8 * k); };
  if (doc(0) != 0) {
    return IndexError(idx_path, documents_at,
                      "document_indices[0] = " + std::to_string(doc(0)) + ", expected 0");
  }
  if (static_cast<uint64_t>(doc(doc_count - 1)) != seq_count) {
    return IndexError(idx_path, documents_at + 8 * (doc_count - 1),
                      "document_indices[" + U(doc_count - 1) + "] = " +
                          std::to_string(doc(doc_count - 1)) + ", expected sequence_count " +
                          U(seq_count));
  }
  uint64_t empty = 0;  // documents without tokens
  for (uint64_t k = 0; k + 1 < doc_count; ++k) {
    const int64_t a = doc(k);
    const int64_t b = doc(k + 1);
    if (b < a || static_cast<uint64_t>(b) > seq_count) {
      return IndexError(idx_path, documents_at + 8 * (k + 1),
                        "document_indices[" + U(k + 1) + "] = " + std::to_string(b) +
                            " is not in [" + std::to_string(a) + ", " + U(seq_count) +
                            "] (indices must be non-decreasing)");
    }
    int64_t tokens = 0;
    for (int64_t s = a; s < b; ++s) {
      tokens += LoadLE<int32_t>(lengths + 4 * static_cast<uint64_t>(s));
      if (tokens > kMaxSampleLength) {
        return Status::OutOfRange(idx_path + ": document " + U(k) +
                                  " has more than 2^31 - 1 tokens (lengths are int32)");
      }
    }
    if (tokens == 0) ++empty;
  }
  const uint64_t num_documents = doc_count - 1;
  if (num_documents == 0) {
    return Status::InvalidArgument(idx_path + ": holds no documents (a source needs at least one "
                                   "sample)");
  }
  if (empty == num_documents) {
    return Status::InvalidArgument(idx_path + ": every one of its " + U(num_documents) +
                                   " documents is empty (a source needs at least one sample)");
  }
  return std::unique_ptr<SampleSource>(new MegatronSource(
      std::move(spec), static_cast<int64_t>(num_documents), static_cast<int64_t>(empty),
      std::move(idx), std::move(bin), dtype, seq_count, options));
}

// ---------------------------------------------------------------------------------------------
// Writer

struct MegatronWriter::Impl {
  std::string prefix;
  MegatronDType dtype = MegatronDType::kUint16;
  FILE* bin = nullptr;
  std::vector<int32_t> lengths;
  std::vector<int64_t> documents{0};
  uint64_t bin_bytes = 0;
  bool finished = false;
  std::vector<uint8_t> buffer;

  ~Impl() {
    if (bin != nullptr) std::fclose(bin);
  }
};

MegatronWriter::~MegatronWriter() = default;

Result<std::unique_ptr<MegatronWriter>> MegatronWriter::Create(std::string prefix,
                                                               MegatronDType dtype) {
  if (MegatronDTypeSize(static_cast<uint8_t>(dtype)) == 0) {
    return Status::InvalidArgument("MegatronWriter " + prefix + ": unknown dtype code " +
                                   std::to_string(static_cast<int>(dtype)));
  }
  std::unique_ptr<MegatronWriter> w(new MegatronWriter());
  w->impl_ = std::make_unique<Impl>();
  w->impl_->prefix = std::move(prefix);
  w->impl_->dtype = dtype;
  const std::string bin_path = w->impl_->prefix + ".bin";
  w->impl_->bin = std::fopen(bin_path.c_str(), "wb");
  if (w->impl_->bin == nullptr) {
    return Status::IOError(data_internal::ErrnoText("cannot create", bin_path));
  }
  return w;
}

namespace {

// Appends v in the dtype; false when v is not representable exactly.
bool Encode(MegatronDType dtype, int64_t v, std::vector<uint8_t>* out) {
  auto fits = [v](int64_t lo, int64_t hi) { return v >= lo && v <= hi; };
  switch (dtype) {
    case MegatronDType::kUint8:
      if (!fits(0, 255)) return false;
      StoreLE<uint8_t>(static_cast<uint8_t>(v), out);
      return true;
    case MegatronDType::kInt8:
      if (!fits(-128, 127)) return false;
      StoreLE<int8_t>(static_cast<int8_t>(v), out);
      return true;
    case MegatronDType::kInt16:
      if (!fits(-32768, 32767)) return false;
      StoreLE<int16_t>(static_cast<int16_t>(v), out);
      return true;
    case MegatronDType::kUint16:
      if (!fits(0, 65535)) return false;
      StoreLE<uint16_t>(static_cast<uint16_t>(v), out);
      return true;
    case MegatronDType::kInt32:
      if (!fits(INT32_MIN, INT32_MAX)) return false;
      StoreLE<int32_t>(static_cast<int32_t>(v), out);
      return true;
    case MegatronDType::kInt64:
      StoreLE<int64_t>(v, out);
      return true;
    case MegatronDType::kFloat64:
      if (!fits(-(int64_t{1} << 53), int64_t{1} << 53)) return false;
      StoreLE<double>(static_cast<double>(v), out);
      return true;
    case MegatronDType::kFloat32:
      if (!fits(-(int64_t{1} << 24), int64_t{1} << 24)) return false;
      StoreLE<float>(static_cast<float>(v), out);
      return true;
  }
  return false;
}

}  // namespace

Status MegatronWriter::AddSequence(std::span<const int64_t> tokens) {
  Impl& m = *impl_;
  const std::string name = "MegatronWriter " + m.prefix;
  if (m.finished) return Status::InvalidArgument(name + ": AddSequence after Finish");
  if (tokens.size() > static_cast<size_t>(kMaxSampleLength)) {
    return Status::OutOfRange(name + ": sequence " + std::to_string(m.lengths.size()) +
                              " has more than 2^31 - 1 tokens");
  }
  m.buffer.clear();
  m.buffer.reserve(tokens.size() * static_cast<size_t>(MegatronDTypeSize(static_cast<uint8_t>(m.dtype))));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!Encode(m.dtype, tokens[i], &m.buffer)) {
      return Status::OutOfRange(name + ": sequence " + std::to_string(m.lengths.size()) +
                                ", position " + std::to_string(i) + ": value " +
                                std::to_string(tokens[i]) + " is not representable in " +
                                std::string(MegatronDTypeName(static_cast<uint8_t>(m.dtype))));
    }
  }
  if (!m.buffer.empty() && std::fwrite(m.buffer.data(), 1, m.buffer.size(), m.bin) != m.buffer.size()) {
    return Status::IOError(data_internal::ErrnoText("cannot write", m.prefix + ".bin"));
  }
  m.bin_bytes += m.buffer.size();
  m.lengths.push_back(static_cast<int32_t>(tokens.size()));
  return Status::Ok();
}

Status MegatronWriter::EndDocument() {
  Impl& m = *impl_;
  if (m.finished) return Status::InvalidArgument("MegatronWriter " + m.prefix + ": EndDocument after Finish");
  m.documents.push_back(static_cast<int64_t>(m.lengths.size()));
  return Status::Ok();
}

Status MegatronWriter::AddDocument(std::span<const int64_t> tokens) {
  THDPACK_RETURN_IF_ERROR(AddSequence(tokens));
  return EndDocument();
}

Status MegatronWriter::Finish() {
  Impl& m = *impl_;
  const std::string name = "MegatronWriter " + m.prefix;
  if (m.finished) return Status::InvalidArgument(name + ": Finish called twice");
  if (static_cast<size_t>(m.documents.back()) != m.lengths.size()) {
    return Status::InvalidArgument(name + ": sequences added after the last EndDocument");
  }
  m.finished = true;
  const int rc = std::fclose(m.bin);
  m.bin = nullptr;
  if (rc != 0) return Status::IOError(data_internal::ErrnoText("cannot close", m.prefix + ".bin"));

  std::vector<uint8_t> idx;
  idx.insert(idx.end(), kMegatronIndexMagic, kMegatronIndexMagic + sizeof(kMegatronIndexMagic));
  StoreLE<uint64_t>(kMegatronIndexVersion, &idx);
  StoreLE<uint8_t>(static_cast<uint8_t>(m.dtype), &idx);
  StoreLE<uint64_t>(m.lengths.size(), &idx);
  StoreLE<uint64_t>(m.documents.size(), &idx);
  for (int32_t l : m.lengths) StoreLE<int32_t>(l, &idx);
  const int64_t size = MegatronDTypeSize(static_cast<uint8_t>(m.dtype));
  int64_t pointer = 0;
  for (int32_t l : m.lengths) {
    StoreLE<int64_t>(pointer, &idx);
    pointer += static_cast<int64_t>(l) * size;
  }
  for (int64_t d : m.documents) StoreLE<int64_t>(d, &idx);

  const std::string idx_path = m.prefix + ".idx";
  FILE* f = std::fopen(idx_path.c_str(), "wb");
  if (f == nullptr) return Status::IOError(data_internal::ErrnoText("cannot create", idx_path));
  const bool ok = std::fwrite(idx.data(), 1, idx.size(), f) == idx.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) return Status::IOError(data_internal::ErrnoText("cannot write", idx_path));
  return Status::Ok();
}

}  // namespace thdpack
