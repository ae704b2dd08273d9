// The run's position as bytes (src/wire/position.h): the samples consumed and the cursor, row
// by row of the cursor's table (thdpack/data.h).
#include "wire/position.h"

#include <string>
#include <utility>

namespace thdpack::wire {
namespace {

// A varint of v - min: the row's range [min, max] becomes [0, max - min], exact in uint64.
uint64_t Offset(int64_t v, int64_t min) {
  return static_cast<uint64_t>(v) - static_cast<uint64_t>(min);
}

void AppendCursor(const SourceCursor& c, std::vector<uint8_t>* out) {
  const CursorShape shape = ShapeOf(c);
  out->push_back(static_cast<uint8_t>(shape));
  for (const CursorField& f : SourceCursorFields()) {
    if (f.shape != CursorShape::kPlain && f.shape != shape) continue;
    switch (f.kind) {
      case CursorFieldKind::kInt:
        PutVarint64(out, Offset(c.*f.value, f.min));
        break;
      case CursorFieldKind::kInts:
        PutVarint64(out, (c.*f.values).size());
        for (int64_t v : c.*f.values) PutVarint64(out, Offset(v, f.min));
        break;
      case CursorFieldKind::kCursor:
        AppendCursor(c.parts.at(0), out);
        break;
      case CursorFieldKind::kCursors:
        PutVarint64(out, c.parts.size());
        for (const SourceCursor& p : c.parts) AppendCursor(p, out);
        break;
    }
  }
}

// The smallest encoding of a cursor: its shape byte and one byte per integer of the plain rows.
size_t MinCursorBytes() {
  size_t n = 1;
  for (const CursorField& f : SourceCursorFields()) {
    n += f.shape == CursorShape::kPlain && f.kind == CursorFieldKind::kInt ? 1 : 0;
  }
  return n;
}

class Reader {
 public:
  Reader(ByteReader& r, size_t base, std::string_view what) : r_(r), base_(base), what_(what) {}

  Status Error(size_t at, const std::string& field, const std::string& rule) const {
    return Status::Corruption(what_ + ": byte " + std::to_string(base_ + at) + " (position." +
                              field + "): " + rule);
  }
  Status Varint(const std::string& field, uint64_t max, uint64_t* v) {
    const size_t at = r_.position();
    if (!r_.GetVarint64(v)) return Error(at, field, "truncated or over-long varint");
    if (*v > max) {
      return Error(at, field, "value " + std::to_string(*v) + " exceeds its limit " +
                                  std::to_string(max));
    }
    return Status::Ok();
  }

  Status Cursor(const std::string& path, int nesting, SourceCursor* c) {
    const size_t at = r_.position();
    if (nesting > kMaxCursorNesting) {
      return Error(at, path, "nests deeper than any source's cursor");
    }
    uint8_t shape_byte = 0;
    if (!r_.GetByte(&shape_byte)) return Error(at, path, "truncated");
    if (shape_byte > static_cast<uint8_t>(CursorShape::kSplit)) {
      return Error(at, path, "shape " + std::to_string(shape_byte) +
                                 " is not 0 (plain), 1 (a blend's) or 2 (a splitting source's)");
    }
    const auto shape = static_cast<CursorShape>(shape_byte);
    for (const CursorField& f : SourceCursorFields()) {
      if (f.shape != CursorShape::kPlain && f.shape != shape) continue;
      const std::string name = path + "." + std::string(f.name);
      const uint64_t span = Offset(f.max, f.min);
      uint64_t v = 0;
      switch (f.kind) {
        case CursorFieldKind::kInt:
          THDPACK_RETURN_IF_ERROR(Varint(name, span, &v));
          c->*f.value = static_cast<int64_t>(v + static_cast<uint64_t>(f.min));
          break;
        case CursorFieldKind::kInts: {
          uint64_t count = 0;
          const size_t count_at = r_.position();
          THDPACK_RETURN_IF_ERROR(Varint(name, r_.remaining(), &count));  // >= 1 byte each
          if (f.count > 0 && count != f.count) {
            return Error(count_at, name, std::to_string(count) + " values, not " +
                                             std::to_string(f.count));
          }
          std::vector<int64_t>& out = c->*f.values;
          out.resize(count);
          for (size_t k = 0; k < count; ++k) {
            THDPACK_RETURN_IF_ERROR(Varint(name + "[" + std::to_string(k) + "]", span, &v));
            out[k] = static_cast<int64_t>(v + static_cast<uint64_t>(f.min));
          }
          break;
        }
        case CursorFieldKind::kCursor: {
          SourceCursor inner;
          THDPACK_RETURN_IF_ERROR(Cursor(name, nesting + 1, &inner));
          c->parts.insert(c->parts.begin(), std::move(inner));
          break;
        }
        case CursorFieldKind::kCursors: {
          uint64_t count = 0;
          THDPACK_RETURN_IF_ERROR(Varint(name, r_.remaining() / MinCursorBytes(), &count));
          for (size_t d = 0; d < count; ++d) {
            SourceCursor part;
            THDPACK_RETURN_IF_ERROR(
                Cursor(name + "[" + std::to_string(d) + "]", nesting + 1, &part));
            c->parts.push_back(std::move(part));
          }
          break;
        }
      }
    }
    // One encoding per cursor: the shape written is the shape of what follows.
    if (ShapeOf(*c) != shape) {
      return Error(at, path, "shape " + std::to_string(shape_byte) +
                                 " with nothing of that shape (an empty blend is written as 0)");
    }
    return Status::Ok();
  }

 private:
  ByteReader& r_;
  size_t base_;
  std::string what_;
};

}  // namespace

void AppendPosition(const StepPosition& position, std::vector<uint8_t>* out) {
  PutVarint64(out, static_cast<uint64_t>(position.consumed));
  out->push_back(position.cursor ? 1 : 0);
  if (position.cursor) AppendCursor(*position.cursor, out);
}

Status ReadPosition(ByteReader& r, size_t base, std::string_view what, StepPosition* out) {
  Reader reader(r, base, what);
  uint64_t consumed = 0;
  THDPACK_RETURN_IF_ERROR(reader.Varint("consumed", INT64_MAX, &consumed));
  out->consumed = static_cast<int64_t>(consumed);
  const size_t at = r.position();
  uint8_t has = 0;
  if (!r.GetByte(&has)) return reader.Error(at, "has_cursor", "truncated");
  if (has > 1) return reader.Error(at, "has_cursor", std::to_string(has) + " is not 0 or 1");
  out->cursor.reset();
  if (has == 0) return Status::Ok();
  SourceCursor c;
  THDPACK_RETURN_IF_ERROR(reader.Cursor("cursor", 1, &c));
  if (Status s = CheckSourceCursor(c, "position.cursor"); !s.ok()) {
    return Status::Corruption(std::string(what) + ": " + s.message());
  }
  out->cursor = std::move(c);
  return Status::Ok();
}

}  // namespace thdpack::wire
