// Samples from columns (thdpack/columns.h): each column checked once, each row copied whole.
#include "thdpack/columns.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace thdpack {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

std::string ShapeText(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + Str(shape[i]);
  return s + "]";
}

int64_t Width(std::span<const int64_t> shape) {
  int64_t w = 1;
  for (int64_t d : shape) w *= d;
  return w;
}

// Rows the column's values hold (elements / inner width).
int64_t ValueRows(const ColumnView& c) {
  const size_t row = static_cast<size_t>(Width(c.shape)) * FieldDtypeSize(c.dtype);
  return row == 0 ? 0 : static_cast<int64_t>(c.values.size() / row);
}

// The column's offsets against B rows and its values: [B + 1], non-decreasing, from >= 0 to at
// most the values' rows.
Status CheckOffsets(const ColumnView& c, std::span<const int64_t> off, int64_t b,
                    std::string_view where) {
  const std::string at = std::string(where) + ": column '" + c.name + "'";
  if (static_cast<int64_t>(off.size()) != b + 1) {
    return Status::InvalidArgument(at + " has " + Str(static_cast<int64_t>(off.size())) +
                                   " offsets, the " + Str(b) + " rows need " + Str(b + 1));
  }
  if (off[0] < 0) {
    return Status::InvalidArgument(at + ": offsets[0] = " + Str(off[0]) + " is negative");
  }
  for (size_t i = 1; i < off.size(); ++i) {
    if (off[i] < off[i - 1]) {
      return Status::InvalidArgument(at + ": offsets[" + Str(static_cast<int64_t>(i)) + "] = " +
                                     Str(off[i]) + " < offsets[" +
                                     Str(static_cast<int64_t>(i) - 1) + "] = " +
                                     Str(off[i - 1]) + " (offsets never decrease)");
    }
  }
  if (off[off.size() - 1] > ValueRows(c)) {
    return Status::InvalidArgument(at + ": offsets reach row " + Str(off[off.size() - 1]) +
                                   ", its values hold " + Str(ValueRows(c)));
  }
  return Status::Ok();
}

bool IsIntegral(FieldDtype d) {
  return d == FieldDtype::kInt32 || d == FieldDtype::kInt64 || d == FieldDtype::kUInt8 ||
         d == FieldDtype::kBool;
}

// Element i of an integer column, widened.
int64_t IntAt(const ColumnView& c, int64_t i) {
  const std::byte* p = c.values.data();
  switch (c.dtype) {
    case FieldDtype::kInt32: {
      int32_t v;
      std::memcpy(&v, p + i * 4, 4);
      return v;
    }
    case FieldDtype::kInt64: {
      int64_t v;
      std::memcpy(&v, p + i * 8, 8);
      return v;
    }
    default:
      return static_cast<int64_t>(static_cast<uint8_t>(p[i]));
  }
}

// Row b's tokens into `out`; InvalidArgument naming the first id outside [0, 2^31).
Status CopyTokens(const ColumnView& c, int64_t begin, int64_t n, std::vector<TokenId>& out,
                  const std::string& at) {
  out.resize(static_cast<size_t>(n));
  if (c.dtype == FieldDtype::kInt32) {
    std::memcpy(out.data(), c.values.data() + begin * 4, static_cast<size_t>(n) * 4);
    for (int64_t j = 0; j < n; ++j) {
      if (out[static_cast<size_t>(j)] < 0) {
        return Status::InvalidArgument(at + ", token " + Str(j) + ": id " +
                                       Str(out[static_cast<size_t>(j)]) +
                                       " is outside [0, 2^31)");
      }
    }
    return Status::Ok();
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t v = IntAt(c, begin + j);
    if (v < 0 || v > std::numeric_limits<int32_t>::max()) {
      return Status::InvalidArgument(at + ", token " + Str(j) + ": id " + Str(v) +
                                     " is outside [0, 2^31)");
    }
    out[static_cast<size_t>(j)] = static_cast<TokenId>(v);
  }
  return Status::Ok();
}

Status CopyMask(const ColumnView& c, int64_t begin, int64_t n, std::vector<uint8_t>& out,
                const std::string& at) {
  out.resize(static_cast<size_t>(n));
  const bool bytes = c.dtype == FieldDtype::kUInt8 || c.dtype == FieldDtype::kBool;
  if (bytes) std::memcpy(out.data(), c.values.data() + begin, static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const int64_t v = bytes ? out[static_cast<size_t>(j)] : IntAt(c, begin + j);
    if (v != 0 && v != 1) {
      return Status::InvalidArgument(at + ", token " + Str(j) + ": loss_mask value " + Str(v) +
                                     " is not 0 or 1");
    }
    out[static_cast<size_t>(j)] = static_cast<uint8_t>(v);
  }
  return Status::Ok();
}

// The column of each spec, in schema order; the columns' own checks.
Result<std::vector<const ColumnView*>> MatchFields(const SampleColumns& columns,
                                                   std::span<const FieldSpec> specs, int64_t b,
                                                   std::string_view where) {
  std::vector<const ColumnView*> out(specs.size(), nullptr);
  const std::string w(where);
  for (const ColumnView& c : columns.fields) {
    size_t f = 0;
    while (f < specs.size() && specs[f].name != c.name) ++f;
    if (f == specs.size()) {
      std::string names;
      for (const FieldSpec& s : specs) names += (names.empty() ? "'" : ", '") + s.name + "'";
      return Status::InvalidArgument(w + ": column '" + c.name + "' is not a declared field (" +
                                     (specs.empty() ? "none declared" : "declared: " + names) +
                                     ")");
    }
    if (out[f] != nullptr) {
      return Status::InvalidArgument(w + ": column '" + c.name + "' is given twice");
    }
    const FieldSpec& s = specs[f];
    if (c.dtype != s.dtype || c.shape != s.shape) {
      return Status::InvalidArgument(
          w + ": column '" + c.name + "' holds " + std::string(FieldDtypeName(c.dtype)) +
          " rows of shape " + ShapeText(c.shape) + ", field '" + s.name + "' is declared " +
          std::string(FieldDtypeName(s.dtype)) + " of shape " + ShapeText(s.shape) +
          " (values are never cast)");
    }
    if (s.per_token()) {
      if (c.offsets.empty()) {
        return Status::InvalidArgument(w + ": column '" + c.name + "' is a " +
                                       std::string(FieldKindName(s.kind)) +
                                       " field: it needs a row of values per token (offsets)");
      }
      THDPACK_RETURN_IF_ERROR(CheckOffsets(c, c.offsets, b, where));
    } else {
      if (!c.offsets.empty()) {
        return Status::InvalidArgument(w + ": column '" + c.name + "' is a sample field: one " +
                                       "row per sample, without offsets");
      }
      if (ValueRows(c) != b) {
        return Status::InvalidArgument(w + ": column '" + c.name + "' holds " +
                                       Str(ValueRows(c)) + " rows, one per sample needs " +
                                       Str(b));
      }
    }
    out[f] = &c;
  }
  for (size_t f = 0; f < specs.size(); ++f) {
    if (out[f] == nullptr) {
      return Status::InvalidArgument(w + ": declared field '" + specs[f].name +
                                     "' has no column");
    }
  }
  return out;
}

}  // namespace

Result<std::vector<Sample>> SamplesFromColumns(const SampleColumns& columns,
                                               std::span<const FieldSpec> specs,
                                               std::string_view where) {
  const std::string w(where);
  const ColumnView& tokens = columns.tokens;
  if (tokens.dtype != FieldDtype::kInt32 && tokens.dtype != FieldDtype::kInt64 &&
      tokens.dtype != FieldDtype::kUInt8) {
    return Status::InvalidArgument(w + ": column 'input_ids' holds " +
                                   std::string(FieldDtypeName(tokens.dtype)) +
                                   ", expected integers (int32, int64 or uint8)");
  }
  if (!tokens.shape.empty() || tokens.offsets.empty()) {
    return Status::InvalidArgument(w + ": column 'input_ids' must be a list of token ids per " +
                                   "row (values and offsets)");
  }
  const int64_t b = columns.rows();
  THDPACK_RETURN_IF_ERROR(CheckOffsets(tokens, tokens.offsets, b, where));
  const ColumnView& mask = columns.mask;
  const std::span<const int64_t> mask_off = mask.offsets.empty() ? tokens.offsets : mask.offsets;
  if (columns.has_mask) {
    if (!IsIntegral(mask.dtype) || !mask.shape.empty()) {
      return Status::InvalidArgument(w + ": column 'loss_mask' holds " +
                                     std::string(FieldDtypeName(mask.dtype)) + " of shape " +
                                     ShapeText(mask.shape) + ", expected 0/1 values of bool " +
                                     "or an integer dtype");
    }
    THDPACK_RETURN_IF_ERROR(CheckOffsets(mask, mask_off, b, where));
  }
  THDPACK_ASSIGN_OR_RETURN(const std::vector<const ColumnView*> cols,
                           MatchFields(columns, specs, b, where));
  std::vector<Sample> out(static_cast<size_t>(b));
  for (int64_t r = 0; r < b; ++r) {
    Sample& s = out[static_cast<size_t>(r)];
    const std::string at = w + ", row " + Str(r);
    const int64_t begin = tokens.offsets[static_cast<size_t>(r)];
    const int64_t n = tokens.offsets[static_cast<size_t>(r) + 1] - begin;
    if (n == 0) return Status::InvalidArgument(at + ": input_ids is empty");
    THDPACK_RETURN_IF_ERROR(CopyTokens(tokens, begin, n, s.tokens, at));
    if (columns.has_mask) {
      const int64_t m0 = mask_off[static_cast<size_t>(r)];
      const int64_t mn = mask_off[static_cast<size_t>(r) + 1] - m0;
      if (mn != n) {
        return Status::InvalidArgument(at + ": loss_mask has " + Str(mn) + " values, input_ids " +
                                       Str(n) + " (the mask is token-aligned)");
      }
      THDPACK_RETURN_IF_ERROR(CopyMask(mask, m0, n, s.target_mask, at));
    }
    s.fields.resize(specs.size());
    for (size_t f = 0; f < specs.size(); ++f) {
      const ColumnView& c = *cols[f];
      const size_t rb = specs[f].row_bytes();
      int64_t first = r, rows = 1;
      if (specs[f].per_token()) {
        first = c.offsets[static_cast<size_t>(r)];
        rows = c.offsets[static_cast<size_t>(r) + 1] - first;
        if (rows != n) {
          return Status::InvalidArgument(at + ": field '" + specs[f].name + "' has " +
                                         Str(rows) + " rows, the row's " + Str(n) +
                                         " tokens need one each");
        }
      }
      const auto bytes = c.values.subspan(static_cast<size_t>(first) * rb,
                                          static_cast<size_t>(rows) * rb);
      s.fields[f].assign(bytes.begin(), bytes.end());
    }
  }
  return out;
}

Sample SampleFromColumnsReference(const SampleColumns& columns, std::span<const FieldSpec> specs,
                                  int64_t row) {
  Sample s;
  const ColumnView& t = columns.tokens;
  const size_t r = static_cast<size_t>(row);
  for (int64_t i = t.offsets[r]; i < t.offsets[r + 1]; ++i) {
    s.tokens.push_back(static_cast<TokenId>(IntAt(t, i)));
  }
  if (columns.has_mask) {
    std::span<const int64_t> off = columns.mask.offsets.empty() ? t.offsets : columns.mask.offsets;
    for (int64_t i = off[r]; i < off[r + 1]; ++i) {
      s.target_mask.push_back(static_cast<uint8_t>(IntAt(columns.mask, i)));
    }
  }
  for (const FieldSpec& spec : specs) {
    const ColumnView* c = nullptr;
    for (const ColumnView& x : columns.fields) {
      if (x.name == spec.name) c = &x;
    }
    const size_t rb = spec.row_bytes();
    std::vector<std::byte> v;
    const int64_t first = spec.per_token() ? c->offsets[r] : row;
    const int64_t last = spec.per_token() ? c->offsets[r + 1] : row + 1;
    for (int64_t i = first; i < last; ++i) {
      for (size_t k = 0; k < rb; ++k) v.push_back(c->values[static_cast<size_t>(i) * rb + k]);
    }
    s.fields.push_back(std::move(v));
  }
  return s;
}

template <typename T>
MaskRuns RunsOfMask(const T* mask, int64_t rows, int64_t stride, int64_t col0, int64_t width) {
  MaskRuns out;
  out.rows = rows;
  out.width = width;
  out.counts.assign(static_cast<size_t>(rows), 0);
  out.row_runs.assign(static_cast<size_t>(rows) + 1, 0);
  for (int64_t b = 0; b < rows; ++b) {
    const T* row = mask + b * stride + col0;
    int64_t kept = 0;
    constexpr int64_t kBlock = 16;  // whole blocks of zeros or of kept columns skipped at once
    for (int64_t c = 0; c < width;) {
      if (row[c] == T{0}) {
        while (c + kBlock <= width) {
          T any{0};
          for (int64_t k = 0; k < kBlock; ++k) any |= row[c + k];
          if (any != T{0}) break;
          c += kBlock;
        }
        while (c < width && row[c] == T{0}) ++c;
        continue;
      }
      const int64_t first = c;
      while (c + kBlock <= width) {
        bool all = true;
        for (int64_t k = 0; k < kBlock; ++k) all &= row[c + k] != T{0};
        if (!all) break;
        c += kBlock;
      }
      while (c < width && row[c] != T{0}) ++c;
      out.run_col.push_back(first);
      out.run_len.push_back(c - first);
      kept += c - first;
    }
    out.counts[static_cast<size_t>(b)] = kept;
    out.row_runs[static_cast<size_t>(b) + 1] = static_cast<int64_t>(out.run_col.size());
  }
  return out;
}
template MaskRuns RunsOfMask<uint8_t>(const uint8_t*, int64_t, int64_t, int64_t, int64_t);
template MaskRuns RunsOfMask<int32_t>(const int32_t*, int64_t, int64_t, int64_t, int64_t);
template MaskRuns RunsOfMask<int64_t>(const int64_t*, int64_t, int64_t, int64_t, int64_t);

MaskRuns ClipRuns(const MaskRuns& runs, int64_t col0, int64_t width) {
  MaskRuns out;
  out.rows = runs.rows;
  out.width = width;
  out.counts.assign(static_cast<size_t>(runs.rows), 0);
  out.row_runs.assign(static_cast<size_t>(runs.rows) + 1, 0);
  for (int64_t b = 0; b < runs.rows; ++b) {
    int64_t kept = 0;
    for (int64_t k = runs.row_runs[static_cast<size_t>(b)];
         k < runs.row_runs[static_cast<size_t>(b) + 1]; ++k) {
      const int64_t first = std::max(runs.run_col[static_cast<size_t>(k)], col0);
      const int64_t end = std::min(runs.run_col[static_cast<size_t>(k)] +
                                       runs.run_len[static_cast<size_t>(k)],
                                   col0 + width);
      if (end <= first) continue;
      out.run_col.push_back(first - col0);
      out.run_len.push_back(end - first);
      kept += end - first;
    }
    out.counts[static_cast<size_t>(b)] = kept;
    out.row_runs[static_cast<size_t>(b) + 1] = static_cast<int64_t>(out.run_col.size());
  }
  return out;
}

void GatherRuns(const MaskRuns& runs, const std::byte* src, int64_t src_stride, size_t rb,
                std::byte* dst, std::span<const int64_t> dst_start) {
  for (int64_t b = 0; b < runs.rows; ++b) {
    std::byte* to = dst + static_cast<size_t>(dst_start[static_cast<size_t>(b)]) * rb;
    const std::byte* row = src + static_cast<size_t>(b * src_stride) * rb;
    for (int64_t k = runs.row_runs[static_cast<size_t>(b)];
         k < runs.row_runs[static_cast<size_t>(b) + 1]; ++k) {
      const size_t n = static_cast<size_t>(runs.run_len[static_cast<size_t>(k)]) * rb;
      std::memcpy(to, row + static_cast<size_t>(runs.run_col[static_cast<size_t>(k)]) * rb, n);
      to += n;
    }
  }
}

void ScatterRuns(const MaskRuns& runs, const std::byte* src, std::span<const int64_t> src_start,
                 size_t rb, std::byte* dst, int64_t dst_stride) {
  for (int64_t b = 0; b < runs.rows; ++b) {
    const std::byte* from = src + static_cast<size_t>(src_start[static_cast<size_t>(b)]) * rb;
    std::byte* row = dst + static_cast<size_t>(b * dst_stride) * rb;
    for (int64_t k = runs.row_runs[static_cast<size_t>(b)];
         k < runs.row_runs[static_cast<size_t>(b) + 1]; ++k) {
      const size_t n = static_cast<size_t>(runs.run_len[static_cast<size_t>(k)]) * rb;
      std::memcpy(row + static_cast<size_t>(runs.run_col[static_cast<size_t>(k)]) * rb, from, n);
      from += n;
    }
  }
}

}  // namespace thdpack
