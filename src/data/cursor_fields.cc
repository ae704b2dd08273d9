// The one description of a SourceCursor's fields (thdpack/data.h): the table the run state's
// JSON and the step messages' binary codec walk, and the rules between fields both check.
#include <array>
#include <limits>
#include <string>

#include "thdpack/data.h"

namespace thdpack {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

constexpr CursorField Int(std::string_view name, int64_t SourceCursor::*value, int64_t min) {
  return CursorField{name, CursorFieldKind::kInt, CursorShape::kPlain, min, kMax, 0, value,
                     nullptr};
}

// The rows. A new field of SourceCursor is a row here; its readers and writers follow.
constexpr std::array<CursorField, 11> kFields = {{
    Int("epoch", &SourceCursor::epoch, 0),
    Int("position", &SourceCursor::position, 0),
    Int("next_id", &SourceCursor::next_id, 0),
    Int("skipped_empty", &SourceCursor::skipped_empty, 0),
    Int("byte_offset", &SourceCursor::byte_offset, 0),
    Int("line", &SourceCursor::line, 0),
    Int("epoch_size", &SourceCursor::epoch_size, -1),  // -1: not known yet
    // A splitting source: {piece, extra ids, split samples, pieces, lost targets}, and the
    // cursor of the source it wraps.
    {"split", CursorFieldKind::kInts, CursorShape::kSplit, 0, kMax, 5, nullptr,
     &SourceCursor::split},
    {"inner", CursorFieldKind::kCursor, CursorShape::kSplit, 0, 0, 0, nullptr, nullptr},
    // A blend: its sources' cursors, and the units its rule counted for each.
    {"parts", CursorFieldKind::kCursors, CursorShape::kBlend, 0, 0, 0, nullptr, nullptr},
    {"taken", CursorFieldKind::kInts, CursorShape::kBlend, 0, kMax, 0, nullptr,
     &SourceCursor::taken},
}};

std::string Range(const CursorField& f) {
  return "[" + std::to_string(f.min) + ", " + (f.max == kMax ? "2^63-1" : std::to_string(f.max)) +
         "]";
}

Status Bad(const std::string& path, const std::string& rule) {
  return Status::Corruption("field \"" + path + "\" " + rule);
}

// `blend_part`: this cursor is a blend's part (a blend holds no blend); `nesting`: its depth.
Status Check(const SourceCursor& c, const std::string& path, bool blend_part, int nesting) {
  if (nesting > kMaxCursorNesting) return Bad(path, "nests deeper than any source's cursor");
  const CursorShape shape = ShapeOf(c);
  for (const CursorField& f : kFields) {
    const std::string at = path + "." + std::string(f.name);
    const bool own = f.shape == CursorShape::kPlain || f.shape == shape;
    switch (f.kind) {
      case CursorFieldKind::kInt: {
        const int64_t v = c.*f.value;
        if (v < f.min || v > f.max) {
          return Bad(at, "= " + std::to_string(v) + " is outside " + Range(f));
        }
        break;
      }
      case CursorFieldKind::kInts: {
        const std::vector<int64_t>& v = c.*f.values;
        if (!own) break;  // ShapeOf: another shape's lists are empty
        if (f.count > 0 && v.size() != f.count) {
          return Bad(at, "has " + std::to_string(v.size()) + " values, not " +
                             std::to_string(f.count));
        }
        for (size_t k = 0; k < v.size(); ++k) {
          if (v[k] < f.min || v[k] > f.max) {
            return Bad(at + "[" + std::to_string(k) + "]",
                       "= " + std::to_string(v[k]) + " is outside " + Range(f));
          }
        }
        break;
      }
      case CursorFieldKind::kCursor:
      case CursorFieldKind::kCursors:
        break;  // the shapes' rules below
    }
  }
  if (shape == CursorShape::kSplit) {
    if (c.parts.size() != 1 || !c.taken.empty()) {
      return Bad(path + ".split", "with " + std::to_string(c.parts.size()) +
                                      " wrapped cursors (a splitting source wraps one cursor, "
                                      "\"inner\", and has no \"parts\" or \"taken\")");
    }
    if (!c.parts[0].split.empty()) {
      return Bad(path + ".inner", "is a splitting source's cursor too");
    }
    return Check(c.parts[0], path + ".inner", blend_part, nesting + 1);
  }
  if (shape == CursorShape::kBlend) {
    if (blend_part) return Bad(path + ".parts", "inside a part (a blend holds no blend)");
    if (c.parts.size() != c.taken.size()) {
      return Bad(path + ".parts", "and \"taken\" must be lists of the same length (" +
                                      std::to_string(c.parts.size()) + " and " +
                                      std::to_string(c.taken.size()) + ")");
    }
    for (size_t d = 0; d < c.parts.size(); ++d) {
      THDPACK_RETURN_IF_ERROR(
          Check(c.parts[d], path + ".parts[" + std::to_string(d) + "]", true, nesting + 1));
    }
  }
  return Status::Ok();
}

}  // namespace

std::span<const CursorField> SourceCursorFields() { return kFields; }

CursorShape ShapeOf(const SourceCursor& c) {
  if (!c.split.empty()) return CursorShape::kSplit;
  if (!c.parts.empty() || !c.taken.empty()) return CursorShape::kBlend;
  return CursorShape::kPlain;
}

Status CheckSourceCursor(const SourceCursor& c, std::string_view path) {
  return Check(c, std::string(path), false, 1);
}

}  // namespace thdpack
