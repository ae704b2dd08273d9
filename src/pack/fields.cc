// Fields of a sample (thdpack/fields.h): the schema's rules, and the packing of a per-token
// field as byte rows. PackFieldShardInto writes each zigzag chunk of each sequence as one copy
// and one fill, the shape of WriteRange in pack.cc; PackFieldReference is the element-wise rule.
#include "thdpack/fields.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <iterator>
#include <limits>
#include <sstream>
#include <set>
#include <string>

#include "thdpack/shard.h"

namespace thdpack {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

std::string FieldName(size_t i, const FieldSpec& f) {
  return "fields[" + Str(static_cast<int64_t>(i)) + "] '" + f.name + "'";
}

// float -> bfloat16, round to nearest even (finite inputs).
uint16_t ToBf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// A finite value as float16 bits when it is exactly one (else false): sign, 5 exponent bits
// (bias 15), 10 mantissa bits; below 2^-14 the subnormals k * 2^-24, k < 1024.
bool ToF16Exact(double v, uint16_t* out) {
  if (!std::isfinite(v)) return false;
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (a == 0) {
    *out = sign;
    return true;
  }
  int e = 0;
  const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int exponent = e - 1;          // a = 2m * 2^exponent, 2m in [1, 2)
  if (exponent > 15) return false;
  if (exponent >= -14) {
    const double mantissa = (2 * m - 1) * 1024;  // exact: a power-of-two scaling
    if (mantissa != std::floor(mantissa)) return false;
    *out = static_cast<uint16_t>(sign | ((exponent + 15) << 10) | static_cast<int>(mantissa));
    return true;
  }
  const double k = a * 16777216.0;  // 2^24, exact
  if (k != std::floor(k)) return false;
  *out = static_cast<uint16_t>(sign | static_cast<int>(k));
  return true;
}

// The fill as one element of the dtype; false when not exactly representable.
bool FillElement(FieldDtype dtype, double fill, std::byte* out) {
  auto integral = [&](double lo, double hi) {
    return std::isfinite(fill) && std::floor(fill) == fill && fill >= lo && fill <= hi;
  };
  switch (dtype) {
    case FieldDtype::kFloat32: {
      const float v = static_cast<float>(fill);
      if (!std::isfinite(fill) || static_cast<double>(v) != fill) return false;
      std::memcpy(out, &v, 4);
      return true;
    }
    case FieldDtype::kFloat64:
      if (!std::isfinite(fill)) return false;
      std::memcpy(out, &fill, 8);
      return true;
    case FieldDtype::kBFloat16: {
      const float f = static_cast<float>(fill);
      if (!std::isfinite(fill) || static_cast<double>(f) != fill) return false;
      const uint16_t b = ToBf16(f);
      if (static_cast<double>(FromBf16(b)) != fill) return false;
      std::memcpy(out, &b, 2);
      return true;
    }
    case FieldDtype::kInt32: {
      if (!integral(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max())) {
        return false;
      }
      const int32_t v = static_cast<int32_t>(fill);
      std::memcpy(out, &v, 4);
      return true;
    }
    case FieldDtype::kInt64: {
      // Doubles hold every integer up to 2^53 exactly; beyond it the fill is not what was meant.
      if (!integral(-9007199254740992.0, 9007199254740992.0)) return false;
      const int64_t v = static_cast<int64_t>(fill);
      std::memcpy(out, &v, 8);
      return true;
    }
    case FieldDtype::kUInt8:
    case FieldDtype::kBool: {
      if (!integral(0, dtype == FieldDtype::kBool ? 1 : 255)) return false;
      const uint8_t v = static_cast<uint8_t>(fill);
      std::memcpy(out, &v, 1);
      return true;
    }
    case FieldDtype::kFloat16: {
      uint16_t h = 0;
      if (!ToF16Exact(fill, &h)) return false;
      std::memcpy(out, &h, 2);
      return true;
    }
  }
  return false;
}


// Checks shared by the writers: a per-token spec, one buffer per sequence of L_i rows, and an
// output of T/CP rows.
Status CheckPackArgs(const char* fn, const FieldSpec& spec,
                     std::span<const std::span<const std::byte>> values, const Layout& layout,
                     int cp_size, int cp_rank, size_t out_bytes, bool check_out) {
  const std::string where = std::string(fn) + " (field '" + spec.name + "')";
  if (!spec.per_token()) {
    return Status::InvalidArgument(where + ": a sample field is not packed per token");
  }
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(layout.cu_seqlens_padded, cp_size)
                              .WithContext(where));
  if (cp_rank < 0 || cp_rank >= cp_size) {
    return Status::InvalidArgument(where + ": cp_rank " + Str(cp_rank) + " outside [0, " +
                                   Str(cp_size) + ")");
  }
  const size_t n = layout.cu_seqlens_padded.size() - 1;
  if (layout.cu_seqlens.size() != n + 1 || values.size() != n) {
    return Status::InvalidArgument(where + ": " + Str(static_cast<int64_t>(values.size())) +
                                   " value buffers for a layout of " +
                                   Str(static_cast<int64_t>(n)) + " sequences");
  }
  const size_t rb = spec.row_bytes();
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = int64_t{layout.cu_seqlens[i + 1]} - layout.cu_seqlens[i];
    const int64_t padded = int64_t{layout.cu_seqlens_padded[i + 1]} - layout.cu_seqlens_padded[i];
    if (len < 1 || len > padded) {
      return Status::InvalidArgument(where + ": sequence " + Str(static_cast<int64_t>(i)) +
                                     " has real length " + Str(len) + ", padded " + Str(padded));
    }
    if (values[i].size() != static_cast<size_t>(len) * rb) {
      return Status::InvalidArgument(where + ": values[" + Str(static_cast<int64_t>(i)) +
                                     "] holds " + Str(static_cast<int64_t>(values[i].size())) +
                                     " bytes, its sequence of length " + Str(len) + " needs " +
                                     Str(len * static_cast<int64_t>(rb)));
    }
  }
  const size_t want = static_cast<size_t>(layout.cu_seqlens_padded.back() / cp_size) * rb;
  if (check_out && out_bytes != want) {
    return Status::InvalidArgument(where + ": out holds " + Str(static_cast<int64_t>(out_bytes)) +
                                   " bytes, T/CP rows need " + Str(static_cast<int64_t>(want)));
  }
  return Status::Ok();
}

}  // namespace

std::string_view FieldKindName(FieldKind kind) {
  switch (kind) {
    case FieldKind::kInput: return "input";
    case FieldKind::kTarget: return "target";
    case FieldKind::kSample: return "sample";
  }
  return "?";
}

Result<FieldKind> ParseFieldKind(std::string_view text) {
  for (FieldKind k : {FieldKind::kInput, FieldKind::kTarget, FieldKind::kSample}) {
    if (text == FieldKindName(k)) return k;
  }
  return Status::InvalidArgument("field kind '" + std::string(text) +
                                 "': expected 'input' (token-aligned, with the tokens), "
                                 "'target' (aligned like the target mask, with the labels) or "
                                 "'sample' (one row per sample)");
}

namespace {

// The dtypes: the enum's order, NumPy's and torch's names, bytes of an element.
struct DtypeEntry {
  FieldDtype dtype;
  std::string_view name;
  size_t size;
};
constexpr DtypeEntry kDtypes[] = {
    {FieldDtype::kFloat32, "float32", 4}, {FieldDtype::kFloat64, "float64", 8},
    {FieldDtype::kBFloat16, "bfloat16", 2}, {FieldDtype::kInt32, "int32", 4},
    {FieldDtype::kInt64, "int64", 8},     {FieldDtype::kUInt8, "uint8", 1},
    {FieldDtype::kBool, "bool", 1},       {FieldDtype::kFloat16, "float16", 2}};

constexpr bool InEnumOrder() {
  for (size_t i = 0; i < std::size(kDtypes); ++i) {
    if (static_cast<size_t>(kDtypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(InEnumOrder(), "kDtypes lists FieldDtype in the enum's order");

const DtypeEntry& EntryOf(FieldDtype dtype) {
  const size_t i = static_cast<size_t>(dtype);
  return kDtypes[i < std::size(kDtypes) ? i : 0];
}

}  // namespace

std::span<const FieldDtype> AllFieldDtypes() {
  static const auto* all = [] {
    auto* v = new std::vector<FieldDtype>();
    for (const DtypeEntry& e : kDtypes) v->push_back(e.dtype);
    return v;
  }();
  return *all;
}

std::string_view FieldDtypeName(FieldDtype dtype) { return EntryOf(dtype).name; }

Result<FieldDtype> ParseFieldDtype(std::string_view text) {
  std::string names;
  for (const DtypeEntry& e : kDtypes) {
    if (text == e.name) return e.dtype;
    names += (names.empty() ? "" : ", ") + std::string(e.name);
  }
  return Status::InvalidArgument("dtype '" + std::string(text) + "': expected one of " + names +
                                 " (values are kept as given, never cast)");
}

size_t FieldDtypeSize(FieldDtype dtype) { return EntryOf(dtype).size; }

Result<std::vector<std::byte>> ValueRow(FieldDtype dtype, int64_t width, double value) {
  if (width < 1) {
    return Status::InvalidArgument("a row of " + Str(width) + " elements (at least 1)");
  }
  const size_t es = FieldDtypeSize(dtype);
  std::byte e[8] = {};
  if (!FillElement(dtype, value, e)) {
    std::string text;
    for (int digits = 6; digits <= 17; ++digits) {  // the shortest that reads back as value
      std::ostringstream v;
      v << std::setprecision(digits) << value;
      text = v.str();
      if (std::strtod(text.c_str(), nullptr) == value) break;
    }
    return Status::InvalidArgument("the value " + text + " is not exactly representable as " +
                                   std::string(FieldDtypeName(dtype)));
  }
  std::vector<std::byte> row(static_cast<size_t>(width) * es);
  for (size_t k = 0; k < row.size(); k += es) std::memcpy(row.data() + k, e, es);
  return row;
}

int64_t FieldSpec::width() const {
  int64_t w = 1;
  for (int64_t d : shape) w *= d;
  return w;
}

size_t FieldSpec::row_bytes() const {
  return static_cast<size_t>(width()) * FieldDtypeSize(dtype);
}

std::string FieldSpec::ToString() const {
  std::string s = name + " (" + std::string(FieldKindName(kind)) + " " +
                  std::string(FieldDtypeName(dtype));
  if (per_token() || !shape.empty()) {
    s += " [";
    bool first = true;
    if (per_token()) {
      s += "L";
      first = false;
    }
    for (int64_t d : shape) {
      s += (first ? "" : ", ") + Str(d);
      first = false;
    }
    s += "]";
  }
  return s + ")";
}

std::span<const std::string_view> MicrobatchKeys() {
  static constexpr std::string_view kKeys[] = {
      "tokens", "input_ids", "position_ids", "labels", "loss_mask", "padding_mask",
      "cu_seqlens", "cu_seqlens_padded", "cu_seqlens_cpu", "cu_seqlens_padded_cpu", "num_seqs",
      "max_seqlen", "n_valid", "sources", "sp_range", "cp_group", "cp_size", "cp_rank",
      "cp_ranks", "idle", "dynamic", "label_format", "packed_seq_params", "seq_index",
      "sample_ids", "seq_n_targets", "media", "mrope_position_ids", "cu_seq_lens_q",
      "cu_seq_lens_k", "max_length_q", "max_length_k", "position"};
  return kKeys;
}

Status ValidateFieldSpecs(std::span<const FieldSpec> fields) {
  // The keys a microbatch already holds (thdpack.torch's dict): a field may not shadow one.
  static const std::set<std::string_view> kReserved(MicrobatchKeys().begin(),
                                                    MicrobatchKeys().end());
  std::set<std::string> seen;
  for (size_t i = 0; i < fields.size(); ++i) {
    const FieldSpec& f = fields[i];
    if (f.name.empty()) {
      return Status::InvalidArgument("fields[" + Str(static_cast<int64_t>(i)) +
                                     "]: the name is empty");
    }
    if (kReserved.count(f.name) != 0) {
      return Status::InvalidArgument(FieldName(i, f) +
                                     ": the name is one of a microbatch's own keys");
    }
    if (!seen.insert(f.name).second) {
      return Status::InvalidArgument(FieldName(i, f) + ": declared twice");
    }
    int64_t w = 1;
    for (int64_t d : f.shape) {
      if (d < 1 || d > (int64_t{1} << 20)) {
        return Status::InvalidArgument(FieldName(i, f) + ": shape dimension " + Str(d) +
                                       " outside [1, 2^20]");
      }
      w *= d;
      if (w > (int64_t{1} << 20)) {
        return Status::InvalidArgument(FieldName(i, f) +
                                       ": a row of more than 2^20 elements");
      }
    }
    if (f.row_bytes() > (size_t{1} << 20)) {
      return Status::InvalidArgument(FieldName(i, f) + ": a row of " +
                                     Str(static_cast<int64_t>(f.row_bytes())) +
                                     " bytes, over 2^20");
    }
    std::byte e[8];
    if (!FillElement(f.dtype, f.fill, e)) {
      return Status::InvalidArgument(FieldName(i, f) + ": fill " + std::to_string(f.fill) +
                                     " is not exactly representable as " +
                                     std::string(FieldDtypeName(f.dtype)));
    }
  }
  return Status::Ok();
}

std::vector<std::byte> FillRow(const FieldSpec& spec) {
  Result<std::vector<std::byte>> row = ValueRow(spec.dtype, spec.width(), spec.fill);
  // Validated by ValidateFieldSpecs; else zeros.
  return row.ok() ? std::move(*row) : std::vector<std::byte>(spec.row_bytes());
}

void FillRows(std::span<const std::byte> row, std::byte* dst, int64_t rows) {
  const size_t rb = row.size();
  if (rows <= 0 || rb == 0) return;
  const size_t total = static_cast<size_t>(rows) * rb;
  bool zero = true;
  for (std::byte b : row) zero = zero && b == std::byte{0};
  if (zero) {
    std::memset(dst, 0, total);
    return;
  }
  std::memcpy(dst, row.data(), rb);
  for (size_t done = rb; done < total;) {  // the rows written so far, copied after themselves
    const size_t n = std::min(done, total - done);
    std::memcpy(dst + done, dst, n);
    done += n;
  }
}

int64_t TruncateSample(Sample& x, std::span<const FieldSpec> fields, int64_t longest) {
  const int64_t length = static_cast<int64_t>(x.tokens.size());
  if (length <= longest) return 0;
  const int64_t before = NumTargets(x);
  x.tokens.resize(static_cast<size_t>(longest));
  if (!x.target_mask.empty()) x.target_mask.resize(static_cast<size_t>(longest));
  for (size_t f = 0; f < fields.size() && f < x.fields.size(); ++f) {
    if (fields[f].per_token()) x.fields[f].resize(fields[f].bytes_for(longest));
  }
  return before - NumTargets(x);
}

Status CheckSampleFields(std::span<const FieldSpec> fields,
                         std::span<const std::vector<std::byte>> values, int64_t length,
                         std::string_view where) {
  if (values.size() != fields.size()) {
    return Status::InvalidArgument(std::string(where) + ": holds " +
                                   Str(static_cast<int64_t>(values.size())) +
                                   " field buffers, the run declares " +
                                   Str(static_cast<int64_t>(fields.size())));
  }
  for (size_t i = 0; i < fields.size(); ++i) {
    const FieldSpec& f = fields[i];
    const size_t want = f.bytes_for(length);
    if (values[i].size() != want) {
      return Status::InvalidArgument(
          std::string(where) + ", field " + f.ToString() + ": " +
          Str(static_cast<int64_t>(values[i].size())) + " bytes, expected " +
          Str(static_cast<int64_t>(want)) +
          (f.per_token() ? " (one row per token of its " + Str(length) + ")" : " (one row)"));
    }
  }
  return Status::Ok();
}

int64_t FieldBytes(std::span<const FieldSpec> fields, int64_t length) {
  int64_t b = 0;
  for (const FieldSpec& f : fields) b += static_cast<int64_t>(f.bytes_for(length));
  return b;
}

Status PackFieldShardInto(const FieldSpec& spec,
                          std::span<const std::span<const std::byte>> values,
                          const Layout& layout, int cp_size, int cp_rank,
                          std::span<std::byte> out) {
  THDPACK_RETURN_IF_ERROR(CheckPackArgs("PackFieldShardInto", spec, values, layout, cp_size,
                                        cp_rank, out.size(), true));
  const std::vector<std::byte> fill = FillRow(spec);
  const size_t rb = spec.row_bytes();
  // Value o + shift of the sample sits at packed position o (input 0, target 1).
  const int64_t shift = spec.kind == FieldKind::kTarget ? 1 : 0;
  const auto& cu = layout.cu_seqlens;
  const auto& cup = layout.cu_seqlens_padded;
  const int64_t chunks = 2 * int64_t{cp_size};
  auto write = [&](const std::span<const std::byte>& v, int64_t len, int64_t from, int64_t count,
                   std::byte* dst) {
    // Positions [from, from + count) of the padded sequence: values from + shift.. while they
    // exist, the fill after.
    const int64_t real = std::clamp<int64_t>(len - shift - from, 0, count);
    if (real > 0) {
      std::memcpy(dst, v.data() + static_cast<size_t>(from + shift) * rb,
                  static_cast<size_t>(real) * rb);
    }
    FillRows(fill, dst + static_cast<size_t>(real) * rb, count - real);
  };
  for (size_t i = 0; i + 1 < cup.size(); ++i) {
    const int64_t len = int64_t{cu[i + 1]} - cu[i];
    const int64_t padded = int64_t{cup[i + 1]} - cup[i];
    std::byte* dst = out.data() + static_cast<size_t>(cup[i] / cp_size) * rb;
    if (cp_size == 1) {
      write(values[i], len, 0, padded, dst);
      continue;
    }
    const int64_t chunk = padded / chunks;
    write(values[i], len, cp_rank * chunk, chunk, dst);
    write(values[i], len, (chunks - 1 - cp_rank) * chunk, chunk,
          dst + static_cast<size_t>(chunk) * rb);
  }
  return Status::Ok();
}

Result<std::vector<std::byte>> PackFieldReference(
    const FieldSpec& spec, std::span<const std::span<const std::byte>> values,
    const Layout& layout, int cp_size, int cp_rank) {
  THDPACK_RETURN_IF_ERROR(CheckPackArgs("PackFieldReference", spec, values, layout, cp_size,
                                        cp_rank, 0, false));
  const size_t rb = spec.row_bytes();
  const std::vector<std::byte> fill = FillRow(spec);
  const auto& cu = layout.cu_seqlens;
  const auto& cup = layout.cu_seqlens_padded;
  const int64_t T = cup.back();
  std::vector<std::byte> full(static_cast<size_t>(T) * rb);
  for (size_t i = 0; i + 1 < cup.size(); ++i) {
    const int64_t len = int64_t{cu[i + 1]} - cu[i];
    for (int64_t o = 0; o < cup[i + 1] - cup[i]; ++o) {
      const int64_t j = spec.kind == FieldKind::kTarget ? o + 1 : o;  // the value it holds
      std::byte* dst = full.data() + static_cast<size_t>(cup[i] + o) * rb;
      if (j < len) {
        std::memcpy(dst, values[i].data() + static_cast<size_t>(j) * rb, rb);
      } else {
        std::memcpy(dst, fill.data(), rb);
      }
    }
  }
  std::vector<std::byte> out(static_cast<size_t>(T / cp_size) * rb);
  THDPACK_RETURN_IF_ERROR(CpShardBytes(full, rb, cup, cp_size, cp_rank, out));
  return out;
}

Status ToHfField(const FieldSpec& spec, std::span<const std::byte> in,
                 std::span<const int32_t> cu_seqlens_padded, std::span<std::byte> out) {
  THDPACK_RETURN_IF_ERROR(
      ValidateCuSeqlensPadded(cu_seqlens_padded, 1).WithContext("ToHfField '" + spec.name + "'"));
  const size_t rb = spec.row_bytes();
  const size_t want = static_cast<size_t>(cu_seqlens_padded.back()) * rb;
  if (in.size() != want || out.size() != want) {
    return Status::InvalidArgument("ToHfField '" + spec.name + "': in holds " +
                                   Str(static_cast<int64_t>(in.size())) + " bytes, out " +
                                   Str(static_cast<int64_t>(out.size())) + ", T rows need " +
                                   Str(static_cast<int64_t>(want)));
  }
  const std::vector<std::byte> fill = FillRow(spec);
  // Back to front, so that `out` may be `in`: each sequence moves one row to the right.
  for (size_t i = cu_seqlens_padded.size() - 1; i-- > 0;) {
    const size_t a = static_cast<size_t>(cu_seqlens_padded[i]) * rb;
    const size_t b = static_cast<size_t>(cu_seqlens_padded[i + 1]) * rb;
    std::memmove(out.data() + a + rb, in.data() + a, b - a - rb);
    std::memcpy(out.data() + a, fill.data(), rb);
  }
  return Status::Ok();
}

Status ShardSequenceIndexInto(std::span<const int32_t> cu, std::span<const int32_t> cup,
                              int cp_size, int cp_rank, std::span<int32_t> out) {
  return FillShardRuns(cu, cup, cp_size, cp_rank, out,
                       [](size_t i) { return static_cast<int32_t>(i); }, int32_t{-1},
                       "ShardSequenceIndex");
}

Result<std::vector<int32_t>> ShardSequenceIndex(std::span<const int32_t> cu,
                                                std::span<const int32_t> cup, int cp_size,
                                                int cp_rank) {
  THDPACK_ASSIGN_OR_RETURN(const int64_t n, ShardRunsSize(cu, cup, cp_size, cp_rank));
  std::vector<int32_t> out(static_cast<size_t>(n));
  THDPACK_RETURN_IF_ERROR(ShardSequenceIndexInto(cu, cup, cp_size, cp_rank, out));
  return out;
}

}  // namespace thdpack
