// Internal byte and bit coding for the wire format (docs/wire_format.md): little-endian fixed32,
// LEB128 varints, zigzag, and an LSB-first bit stream with Rice codes.
//
// Writers append to a std::vector<uint8_t>. Readers never read outside the span they are given:
// every Get/Read returns false (and leaves the output unspecified) when the bytes run out or a
// value is out of range, and the caller turns that into a Status naming the field.
//
// Rice code of a value v >= 0 with parameter k (0 <= k <= 31): q = v >> k zero bits, a one bit,
// then the k low bits of v, least significant first. Bits fill each byte from bit 0 upwards;
// the last byte of a stream is padded with zero bits.
//
// Thread-safety: the writer and reader are single-threaded objects; the free functions are pure.
#ifndef THDPACK_WIRE_CODING_H_
#define THDPACK_WIRE_CODING_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace thdpack::wire {

inline constexpr int kMaxRiceParameter = 31;

// --- bytes ----------------------------------------------------------------------------------

inline void PutFixed32(std::vector<uint8_t>* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void EncodeFixed32(uint8_t* dst, uint32_t v) {
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<uint8_t>(v >> (8 * i));
}
inline uint32_t DecodeFixed32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
// An int64 as 8 bytes, little-endian two's complement (the fixed-width frames' words).
inline void EncodeFixed64(uint8_t* dst, int64_t v) {
  const uint64_t u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) dst[i] = static_cast<uint8_t>(u >> (8 * i));
}
inline int64_t DecodeFixed64(const uint8_t* p) {
  uint64_t u = 0;
  for (int i = 0; i < 8; ++i) u |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<int64_t>(u);
}

// LEB128: 7 bits per byte, least significant group first, high bit set on all but the last.
inline void PutVarint64(std::vector<uint8_t>* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<uint8_t>(v));
}

// Bytes PutVarint64 writes for v (1..10).
inline int VarintLength(uint64_t v) { return v == 0 ? 1 : (std::bit_width(v) + 6) / 7; }

inline uint64_t ZigZagEncode(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
inline int64_t ZigZagDecode(uint64_t v) {
  return static_cast<int64_t>((v >> 1) ^ (~(v & 1) + 1));
}

// A cursor over a byte span. Every read is bounds-checked.
class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}

  size_t position() const { return pos_; }
  size_t remaining() const { return bytes_.size() - pos_; }

  bool GetByte(uint8_t* v) {
    if (pos_ >= bytes_.size()) return false;
    *v = bytes_[pos_++];
    return true;
  }
  // At most 10 bytes; the 10th may only carry bit 63. False on truncation or overflow.
  bool GetVarint64(uint64_t* v) {
    uint64_t result = 0;
    for (int shift = 0; shift <= 63; shift += 7) {
      if (pos_ >= bytes_.size()) return false;
      const uint64_t byte = bytes_[pos_++];
      if (shift == 63 && byte > 1) return false;
      result |= (byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return false;
  }
  // False when fewer than 8 bytes remain.
  bool GetFixed64(int64_t* v) {
    if (remaining() < 8) return false;
    *v = DecodeFixed64(bytes_.data() + pos_);
    pos_ += 8;
    return true;
  }
  // The bytes not read yet.
  std::span<const uint8_t> rest() const { return bytes_.subspan(pos_); }
  // Moves past `n` bytes; false (and no move) when fewer remain.
  bool Skip(size_t n) {
    if (n > remaining()) return false;
    pos_ += n;
    return true;
  }

 private:
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
};

// --- bits -----------------------------------------------------------------------------------

// Bits of the Rice code of v with parameter k.
inline uint64_t RiceBits(uint64_t v, int k) { return (v >> k) + 1 + static_cast<uint64_t>(k); }

// Appends an LSB-first bit stream to `out`. Finish() must be called once at the end.
class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>* out) : out_(out) {}

  // Appends the low `count` bits of `bits` (count <= 32).
  void PutBits(uint64_t bits, int count) {
    if (count == 0) return;
    buf_ |= (bits & ((uint64_t{1} << count) - 1)) << used_;
    used_ += count;
    while (used_ >= 8) {
      out_->push_back(static_cast<uint8_t>(buf_));
      buf_ >>= 8;
      used_ -= 8;
    }
  }
  void PutRice(uint64_t v, int k) {
    uint64_t q = v >> k;
    while (q >= 32) {
      PutBits(0, 32);
      q -= 32;
    }
    PutBits(uint64_t{1} << q, static_cast<int>(q) + 1);  // q zeros, then a one
    PutBits(v, k);
  }
  // Pads the last byte with zero bits.
  void Finish() {
    if (used_ > 0) out_->push_back(static_cast<uint8_t>(buf_));
    buf_ = 0;
    used_ = 0;
  }

 private:
  std::vector<uint8_t>* out_;
  uint64_t buf_ = 0;
  int used_ = 0;  // < 8 between calls
};

// Reads an LSB-first bit stream from exactly the bytes given.
class BitReader {
 public:
  explicit BitReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}

  // Reads `count` bits (count <= 32).
  bool GetBits(int count, uint32_t* v) {
    if (count == 0) {
      *v = 0;
      return true;
    }
    Refill();
    if (avail_ < count) return false;
    *v = static_cast<uint32_t>(buf_ & ((uint64_t{1} << count) - 1));
    Consume(count);
    return true;
  }
  // Reads a Rice code; false if the stream ends first or the value exceeds `max_value`
  // (checked on the quotient before any shift, so a corrupt run of zeros cannot overflow).
  bool GetRice(int k, uint32_t max_value, uint32_t* v) {
    const uint64_t max_q = static_cast<uint64_t>(max_value) >> k;
    uint64_t q = 0;
    for (;;) {
      Refill();
      if (buf_ == 0) {  // all `avail_` buffered bits are zero
        q += static_cast<uint64_t>(avail_);
        if (q > max_q || pos_ >= bytes_.size()) return false;
        Consume(avail_);
        continue;
      }
      const int zeros = std::countr_zero(buf_);  // < avail_: bits above avail_ are zero
      q += static_cast<uint64_t>(zeros);
      if (q > max_q) return false;
      Consume(zeros + 1);
      break;
    }
    uint32_t low = 0;
    if (!GetBits(k, &low)) return false;
    const uint64_t value = (q << k) | low;
    if (value > max_value) return false;
    *v = static_cast<uint32_t>(value);
    return true;
  }
  // True when every byte has been read except for fewer than 8 padding bits, all zero.
  bool AtCleanEnd() const { return pos_ == bytes_.size() && avail_ < 8 && buf_ == 0; }
  // Whole bytes the codes read so far occupy (the last one possibly partly).
  size_t BytesUsed() const { return (8 * pos_ - static_cast<size_t>(avail_) + 7) / 8; }
  // True when the rest of the last byte in use, after the last code read, is zero bits.
  bool PaddingBitsZero() const {
    const int pad = avail_ % 8;  // bits read into the buffer beyond the codes, in that byte
    return (buf_ & ((uint64_t{1} << pad) - 1)) == 0;
  }

 private:
  void Refill() {
    while (avail_ <= 56 && pos_ < bytes_.size()) {
      buf_ |= static_cast<uint64_t>(bytes_[pos_++]) << avail_;
      avail_ += 8;
    }
  }
  void Consume(int count) {
    buf_ = count >= 64 ? 0 : buf_ >> count;
    avail_ -= count;
  }

  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
  uint64_t buf_ = 0;  // bits [0, avail_) are unread stream bits; the rest are zero
  int avail_ = 0;
};

// The Rice parameter in [0, kMaxRiceParameter] that codes `values` in the fewest bits (the
// smallest such k on ties), and that number of bits.
struct RiceChoice {
  int k = 0;
  uint64_t bits = 0;
};
RiceChoice ChooseRiceParameter(std::span<const uint32_t> values);

}  // namespace thdpack::wire

#endif  // THDPACK_WIRE_CODING_H_
