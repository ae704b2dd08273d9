// Media on the wire (thdpack/step_wire.h, docs/wire_format.md "Media"): a sample's media in the
// token exchange's media blocks, and a rank's media of a step in one kMedia frame. Every count
// is checked against the bytes left before anything is allocated or read.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/check.h"
#include "thdpack/step_wire.h"
#include "wire/coding.h"

namespace thdpack {
namespace {

constexpr uint8_t kDtypes = 8;  // FieldDtype's values (fields.h)

std::string Num(int64_t v) { return std::to_string(v); }

void Put(uint8_t*& dst, int64_t v) {
  wire::EncodeFixed64(dst, v);
  dst += 8;
}
void PutWords(uint8_t*& dst, const std::vector<int64_t>& v) {
  for (int64_t x : v) Put(dst, x);
}
size_t Padded(size_t n) { return (n + 7) / 8 * 8; }
void PutBytes(uint8_t*& dst, std::span<const std::byte> b) {
  if (!b.empty()) std::memcpy(dst, b.data(), b.size());
  std::memset(dst + b.size(), 0, Padded(b.size()) - b.size());
  dst += Padded(b.size());
}

// wire::ByteReader's words, counts and bytes, each failure a Corruption naming what ran past the
// bytes.
class Reader {
 public:
  Reader(std::span<const uint8_t> b, size_t at, const char* what) : r_(b), what_(what) {
    r_.Skip(std::min(at, b.size()));  // an offset past the bytes reads as their end
  }
  size_t at() const { return r_.position(); }
  size_t left() const { return r_.remaining(); }
  Status Word(int64_t* v, const std::string& name) {
    const size_t at = r_.position();
    if (!r_.GetFixed64(v)) return Bad(name + " at byte " + Num(int64_t(at)) + ": past the end");
    return Status::Ok();
  }
  // A count: >= 0, and `each` bytes of it fit in what is left.
  Status Count(int64_t* v, const std::string& name, size_t each) {
    THDPACK_RETURN_IF_ERROR(Word(v, name));
    if (*v < 0 || static_cast<uint64_t>(*v) > left() / each) {
      return Bad(name + " = " + Num(*v) + ": negative or past the " + Num(int64_t(left())) +
                 " bytes left");
    }
    return Status::Ok();
  }
  Status Words(std::vector<int64_t>* v, int64_t n, const std::string& name) {
    if (n < 0 || static_cast<uint64_t>(n) > left() / 8) {
      return Bad(name + ": " + Num(n) + " words past the " + Num(int64_t(left())) + " bytes left");
    }
    v->resize(static_cast<size_t>(n));
    for (auto& x : *v) THDPACK_RETURN_IF_ERROR(Word(&x, name));
    return Status::Ok();
  }
  Status Bytes(std::vector<std::byte>* v, int64_t n, const std::string& name) {
    if (n < 0 || Padded(static_cast<size_t>(n)) > left()) {
      return Bad(name + ": " + Num(n) + " bytes past the " + Num(int64_t(left())) + " left");
    }
    // One pass (a resize would zero the bytes first, touching every page twice).
    const auto* b = reinterpret_cast<const std::byte*>(r_.rest().data());
    v->assign(b, b + n);
    r_.Skip(Padded(static_cast<size_t>(n)));
    return Status::Ok();
  }
  Status Bad(const std::string& msg) const { return Status::Corruption(std::string(what_) + msg); }

 private:
  wire::ByteReader r_;
  const char* what_;
};

Status Dtype(Reader& r, int64_t v, const std::string& name) {
  if (v < 0 || v >= kDtypes) return r.Bad(name + " dtype " + Num(v) + " is not one of fields.h's");
  return Status::Ok();
}

}  // namespace

size_t SampleMediaBytes(std::span<const MediaPart> media) {
  size_t n = 0;
  for (const MediaPart& p : media) {
    n += 5 * 8 + p.grid.size() * 8 + p.seconds.size() * 8 + Padded(p.payload.size());
  }
  return n;
}

uint8_t* EncodeSampleMedia(std::span<const MediaPart> media, uint8_t* dst) {
  for (const MediaPart& p : media) {
    Put(dst, static_cast<int64_t>(p.grid.size() / 3));
    Put(dst, p.dtype);
    Put(dst, p.width);
    Put(dst, static_cast<int64_t>(p.payload.size()));
    Put(dst, static_cast<int64_t>(p.seconds.size()));
    PutWords(dst, p.grid);
    for (double s : p.seconds) {
      int64_t bits;
      std::memcpy(&bits, &s, 8);
      Put(dst, bits);
    }
    PutBytes(dst, p.payload);
  }
  return dst;
}

Result<std::vector<MediaPart>> DecodeSampleMedia(std::span<const uint8_t> bytes,
                                                 size_t modalities, size_t* offset) {
  Reader r(bytes, *offset, "media: ");
  std::vector<MediaPart> out(modalities);
  for (size_t m = 0; m < modalities; ++m) {
    const std::string at = "part " + Num(int64_t(m));
    MediaPart& p = out[m];
    int64_t k, dtype, payload, seconds;
    THDPACK_RETURN_IF_ERROR(r.Count(&k, at + " items", 24));
    THDPACK_RETURN_IF_ERROR(r.Word(&dtype, at + " dtype"));
    THDPACK_RETURN_IF_ERROR(Dtype(r, dtype, at));
    THDPACK_RETURN_IF_ERROR(r.Word(&p.width, at + " width"));
    if (p.width < 0) return r.Bad(at + " width " + Num(p.width) + " is negative");
    THDPACK_RETURN_IF_ERROR(r.Count(&payload, at + " payload bytes", 1));
    THDPACK_RETURN_IF_ERROR(r.Count(&seconds, at + " seconds", 8));
    p.dtype = static_cast<uint8_t>(dtype);
    THDPACK_RETURN_IF_ERROR(r.Words(&p.grid, 3 * k, at + " grid"));
    std::vector<int64_t> bits;
    THDPACK_RETURN_IF_ERROR(r.Words(&bits, seconds, at + " seconds"));
    p.seconds.resize(bits.size());
    for (size_t j = 0; j < bits.size(); ++j) std::memcpy(&p.seconds[j], &bits[j], 8);
    THDPACK_RETURN_IF_ERROR(r.Bytes(&p.payload, payload, at + " payload"));
  }
  *offset = r.at();
  return out;
}

size_t MediaFrameBytes(std::span<const MediaShard> microbatches) {
  size_t n = 8;
  for (const MediaShard& s : microbatches) {
    n += 16 + s.mrope.size() * 8;
    for (const MediaShardPart& p : s.parts) {
      n += 8 * 8 + 8 * (p.grid.size() + p.token_index.size() + p.recv_index.size() +
                        p.send_index.size() + p.send_counts.size() + p.recv_counts.size()) +
           Padded(p.payload.size());
    }
  }
  return n + kFrameTrailerSize;
}

void EncodeMediaFrameInto(std::span<const MediaShard> microbatches, std::span<uint8_t> out) {
  THDPACK_DCHECK(out.size() == MediaFrameBytes(microbatches));
  uint8_t* dst = out.data();
  Put(dst, static_cast<int64_t>(microbatches.size()));
  for (const MediaShard& s : microbatches) {
    Put(dst, static_cast<int64_t>(s.parts.size()));
    Put(dst, static_cast<int64_t>(s.mrope.size()));
    PutWords(dst, s.mrope);
    for (const MediaShardPart& p : s.parts) {
      Put(dst, static_cast<int64_t>(p.grid.size() / 3));
      Put(dst, p.dtype);
      Put(dst, p.width);
      Put(dst, static_cast<int64_t>(p.payload.size()));
      Put(dst, p.output_rows);
      Put(dst, static_cast<int64_t>(p.token_index.size()));
      Put(dst, static_cast<int64_t>(p.send_index.size()));
      Put(dst, static_cast<int64_t>(p.send_counts.size()));
      PutWords(dst, p.grid);
      PutWords(dst, p.token_index);
      PutWords(dst, p.recv_index);
      PutWords(dst, p.send_index);
      PutWords(dst, p.send_counts);
      PutWords(dst, p.recv_counts);
      PutBytes(dst, p.payload);
    }
  }
  SealFrame(FrameKind::kMedia, out);
}

std::vector<uint8_t> EncodeMediaFrame(std::span<const MediaShard> microbatches) {
  std::vector<uint8_t> out(MediaFrameBytes(microbatches));
  EncodeMediaFrameInto(microbatches, out);
  return out;
}

Result<std::vector<MediaShard>> DecodeMediaFrame(std::span<const uint8_t> frame,
                                                 size_t modalities) {
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, FrameKind::kMedia));
  Reader r(body, 0, "media: ");
  int64_t count;
  THDPACK_RETURN_IF_ERROR(r.Count(&count, "microbatches", 16));
  std::vector<MediaShard> out(static_cast<size_t>(count));
  for (int64_t mb = 0; mb < count; ++mb) {
    const std::string at = "microbatch " + Num(mb);
    MediaShard& s = out[static_cast<size_t>(mb)];
    int64_t parts, mrope;
    THDPACK_RETURN_IF_ERROR(r.Word(&parts, at + " modalities"));
    if (parts != static_cast<int64_t>(modalities)) {
      return r.Bad(at + ": " + Num(parts) + " modalities, the run declares " +
                   Num(int64_t(modalities)));
    }
    THDPACK_RETURN_IF_ERROR(r.Count(&mrope, at + " mrope", 8));
    THDPACK_RETURN_IF_ERROR(r.Words(&s.mrope, mrope, at + " mrope"));
    s.parts.resize(modalities);
    for (size_t m = 0; m < modalities; ++m) {
      const std::string pat = at + " part " + Num(int64_t(m));
      MediaShardPart& p = s.parts[m];
      int64_t k, dtype, payload, tokens, sent, cp;
      THDPACK_RETURN_IF_ERROR(r.Count(&k, pat + " items", 24));
      THDPACK_RETURN_IF_ERROR(r.Word(&dtype, pat + " dtype"));
      THDPACK_RETURN_IF_ERROR(Dtype(r, dtype, pat));
      p.dtype = static_cast<uint8_t>(dtype);
      THDPACK_RETURN_IF_ERROR(r.Word(&p.width, pat + " width"));
      if (p.width < 0) return r.Bad(pat + " width " + Num(p.width) + " is negative");
      THDPACK_RETURN_IF_ERROR(r.Count(&payload, pat + " payload bytes", 1));
      THDPACK_RETURN_IF_ERROR(r.Word(&p.output_rows, pat + " output rows"));
      if (p.output_rows < 0) return r.Bad(pat + " output rows " + Num(p.output_rows));
      THDPACK_RETURN_IF_ERROR(r.Count(&tokens, pat + " tokens", 16));
      THDPACK_RETURN_IF_ERROR(r.Count(&sent, pat + " rows sent", 8));
      THDPACK_RETURN_IF_ERROR(r.Count(&cp, pat + " CP ranks", 16));
      THDPACK_RETURN_IF_ERROR(r.Words(&p.grid, 3 * k, pat + " grid"));
      THDPACK_RETURN_IF_ERROR(r.Words(&p.token_index, tokens, pat + " token index"));
      THDPACK_RETURN_IF_ERROR(r.Words(&p.recv_index, tokens, pat + " receive index"));
      THDPACK_RETURN_IF_ERROR(r.Words(&p.send_index, sent, pat + " send index"));
      THDPACK_RETURN_IF_ERROR(r.Words(&p.send_counts, cp, pat + " send counts"));
      THDPACK_RETURN_IF_ERROR(r.Words(&p.recv_counts, cp, pat + " receive counts"));
      THDPACK_RETURN_IF_ERROR(r.Bytes(&p.payload, payload, pat + " payload"));
    }
  }
  if (r.left() != 0) return r.Bad(Num(int64_t(r.left())) + " bytes left over");
  return out;
}

std::vector<uint8_t> EncodeMediaCostsFrame(std::span<const std::vector<double>> costs) {
  size_t n = 8;
  for (const std::vector<double>& c : costs) n += 8 * (1 + c.size());
  std::vector<uint8_t> out(n + kFrameTrailerSize);
  uint8_t* dst = out.data();
  Put(dst, static_cast<int64_t>(costs.size()));
  for (const std::vector<double>& c : costs) {
    Put(dst, static_cast<int64_t>(c.size()));
    for (double x : c) {
      int64_t bits;
      std::memcpy(&bits, &x, 8);
      Put(dst, bits);
    }
  }
  SealFrame(FrameKind::kMedia, out);
  return out;
}

Result<std::vector<std::vector<double>>> DecodeMediaCostsFrame(std::span<const uint8_t> frame,
                                                               int64_t samples) {
  THDPACK_ASSIGN_OR_RETURN(std::span<const uint8_t> body, OpenFrame(frame, FrameKind::kMedia));
  Reader r(body, 0, "media costs: ");
  int64_t count;
  THDPACK_RETURN_IF_ERROR(r.Count(&count, "samples", 8));
  if (count != samples) {
    return r.Bad(Num(count) + " samples, the sender reads " + Num(samples));
  }
  std::vector<std::vector<double>> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    int64_t k;
    THDPACK_RETURN_IF_ERROR(r.Count(&k, "sample " + Num(i) + " items", 8));
    std::vector<double>& c = out[static_cast<size_t>(i)];
    c.resize(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
      int64_t bits;
      THDPACK_RETURN_IF_ERROR(r.Word(&bits, "sample " + Num(i) + " item " + Num(j) + " cost"));
      double x;
      std::memcpy(&x, &bits, 8);
      if (!std::isfinite(x) || x < 0) {
        return r.Bad("sample " + Num(i) + " item " + Num(j) + ": cost " + std::to_string(x) +
                     " (a cost is finite and >= 0)");
      }
      c[static_cast<size_t>(j)] = x;
    }
  }
  if (r.left() != 0) return r.Bad(Num(int64_t(r.left())) + " bytes left over");
  return out;
}

}  // namespace thdpack
