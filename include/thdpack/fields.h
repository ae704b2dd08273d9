// thdpack/fields.h: the named, typed data a sample carries beside its tokens (docs/design.md
// section 5, "Fields"), and how it is packed and CP-sharded like the tokens or labels it
// belongs to.
//
// A run declares its fields once, as a schema (a list of FieldSpec: name, kind, dtype, shape,
// fill); every sample then holds one contiguous buffer per field, in schema order
// (Sample::fields), and every microbatch one buffer per field. One kernel moves any field by its
// byte width: packing, the CP zigzag, the exchange and the delivery never look at a field's
// name or type.
//
// Kinds and alignment (L: the sample's length; width w = product of the inner shape):
//   input   [L, w]: value j belongs to token j. Packed like the tokens: packed position o of a
//           sequence holds value o (o < L), the fill on padding. Delivered to the first stage.
//   target  [L, w]: value j belongs to the prediction of token j (aligned like the target
//           mask). Packed like the labels (thdpack/pack.h): packed position o holds value o+1
//           (o + 1 < L), the fill at the last real token and on padding; with Hugging Face's
//           label convention (ToHfField) position o holds value o (1 <= o < L), as its labels.
//           Delivered to the last stage.
//   sample  [w]: one value (or fixed-shape array) per sample, delivered with the microbatch's
//           metadata to every rank, one row per packed sequence in packed order.
// Values are bytes of the declared dtype, never converted; the fill is written in the dtype.
//
// Legend (docs/design.md): T packed tokens after padding, n sequences, CP group size.
// Thread-safety: plain values and pure functions.
#ifndef THDPACK_FIELDS_H_
#define THDPACK_FIELDS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/pack.h"
#include "thdpack/sample.h"
#include "thdpack/status.h"

namespace thdpack {

enum class FieldKind : uint8_t { kInput, kTarget, kSample };
// The element types a field holds, and step.unpack's values (UnpackStep): the one list of them.
// thdpack.torch takes its torch and NumPy dtypes from it (_thdpack.field_dtypes()).
enum class FieldDtype : uint8_t {
  kFloat32, kFloat64, kBFloat16, kInt32, kInt64, kUInt8, kBool, kFloat16
};

// "input" / "target" / "sample", and the inverse (InvalidArgument naming the text).
std::string_view FieldKindName(FieldKind kind);
[[nodiscard]] Result<FieldKind> ParseFieldKind(std::string_view text);
// Every dtype, in the enum's order.
std::span<const FieldDtype> AllFieldDtypes();
// "float32", "float64", "bfloat16", "int32", "int64", "uint8", "bool", "float16" (NumPy's and
// torch's names), and the inverse (InvalidArgument naming the text and listing the names).
std::string_view FieldDtypeName(FieldDtype dtype);
[[nodiscard]] Result<FieldDtype> ParseFieldDtype(std::string_view text);
// Bytes of one element: 4, 8, 2, 4, 8, 1, 1, 2.
size_t FieldDtypeSize(FieldDtype dtype);
// One row of `width` >= 1 elements, each `value` in `dtype`: a field's fill row (FillRow), the
// fill of step.unpack's values. InvalidArgument naming the value and the dtype when it is not
// exactly representable there (an integer in range for the integer types, 0 or 1 for bool,
// finite for floats, and a bfloat16 or float16 value must round-trip).
[[nodiscard]] Result<std::vector<std::byte>> ValueRow(FieldDtype dtype, int64_t width,
                                                       double value);

struct FieldSpec {
  std::string name;                         // unique in the schema, not empty
  FieldKind kind = FieldKind::kTarget;
  FieldDtype dtype = FieldDtype::kFloat32;
  std::vector<int64_t> shape;               // inner shape, each dimension >= 1; {} = scalar
  double fill = 0;                          // padding value, exactly representable in dtype
  int64_t width() const;                    // product of shape (1 for a scalar)
  // Bytes per token (input, target) or per sample: width() * FieldDtypeSize(dtype).
  size_t row_bytes() const;
  bool per_token() const { return kind != FieldKind::kSample; }
  // Bytes of this field in a sample of `length` tokens: a row per token, or one row.
  size_t bytes_for(int64_t length) const {
    return static_cast<size_t>(per_token() ? length : 1) * row_bytes();
  }
  // Whether a rank holds this field of a microbatch, by the arrays its stage holds: an input
  // field goes with the tokens (first stage), a target field with the labels (last stage), a
  // sample field to every rank.
  bool HeldWith(bool tokens, bool labels) const {
    return kind == FieldKind::kInput ? tokens : kind == FieldKind::kTarget ? labels : true;
  }
  // "old_logprobs (target float32 [L])", "topk (target float32 [L, 8])", "uid (sample int64)"
  std::string ToString() const;
};

// The keys a microbatch dict of thdpack.torch holds besides the fields (tokens, position_ids,
// labels, loss_mask, cu_seqlens, cp_group, idle, media, ...), and "position" (a fed sample's
// own key): no field may take one. The one list of them (python/tests/test_fields.py checks
// every key of a real microbatch against it).
std::span<const std::string_view> MicrobatchKeys();

// OK when the schema is usable: names non-empty and unique (and none of MicrobatchKeys()),
// shapes of dimensions >= 1 with a row under 2^20 bytes, and each fill exactly representable in
// its dtype (an integer in range for the integer types, 0 or 1 for bool, finite for floats -
// bfloat16's fill must round-trip).
// InvalidArgument naming the field (fields[i] 'name') and the rule otherwise.
[[nodiscard]] Status ValidateFieldSpecs(std::span<const FieldSpec> fields);

// The fill of `spec` as one row of bytes (row_bytes()).
std::vector<std::byte> FillRow(const FieldSpec& spec);
// `rows` copies of `row` one after another from `dst` (a zero row by one memset, any other by
// doubling copies of the rows already written); nothing for rows <= 0 or an empty row.
void FillRows(std::span<const std::byte> row, std::byte* dst, int64_t rows);

// One sample's field buffers (Sample::fields) against the schema: one buffer per field, in
// order, of L * row_bytes (per token) or row_bytes (sample) bytes. InvalidArgument naming
// `where`, the field and both sizes otherwise.
[[nodiscard]] Status CheckSampleFields(std::span<const FieldSpec> fields,
                                       std::span<const std::vector<std::byte>> values,
                                       int64_t length, std::string_view where);

// The oversize policy 'truncate' on a whole sample: keeps its first `longest` tokens, target
// mask entries and per-token field rows (sample fields whole). Returns the loss tokens cut
// (NumTargets before - after); 0 and nothing changed when the sample is no longer than that.
// REQUIRES: longest >= 1, CheckSampleFields OK.
int64_t TruncateSample(Sample& x, std::span<const FieldSpec> fields, int64_t longest);

// Bytes a sample of length L holds in its fields: sum over the schema of L * row_bytes (per
// token) or row_bytes (sample).
int64_t FieldBytes(std::span<const FieldSpec> fields, int64_t length);

// ---- Packing a per-token field (input or target): the layout of PackShardInto. ----

// CP rank cp_rank's [T/CP, w] of one per-token field of a microbatch (cp_size 1: the whole
// [T, w]), written into `out` (T/CP * row_bytes bytes) without building [T]: each zigzag
// chunk of each sequence is one copy of the values it keeps and one fill.
// values[i]: sample i's buffer of the field (L_i * row_bytes bytes); layout: ComputeLayout of
// the samples' lengths for a group of cp_size ranks (any layout PackShardInto accepts).
// REQUIRES (InvalidArgument naming the argument otherwise): spec per token; values.size() ==
// n; every values[i] of cu_seqlens' length times row_bytes; cu_seqlens_padded zigzag-shardable
// over cp_size (ValidateCuSeqlensPadded); 0 <= cp_rank < cp_size; out of the size stated.
[[nodiscard]] Status PackFieldShardInto(const FieldSpec& spec,
                                        std::span<const std::span<const std::byte>> values,
                                        const Layout& layout, int cp_size, int cp_rank,
                                        std::span<std::byte> out);

// The plain reference of PackFieldShardInto: the whole [T, w] array written position by
// position from the alignment rule at the top, then CpShardBytes. For tests.
[[nodiscard]] Result<std::vector<std::byte>> PackFieldReference(
    const FieldSpec& spec, std::span<const std::span<const std::byte>> values,
    const Layout& layout, int cp_size, int cp_rank);

// A target field of a whole microbatch ([T, w], thdpack's shifted alignment) in Hugging Face's
// label convention (ToHfLabels of thdpack/pack.h): out row j = in row j-1 where j is not the
// first position of its padded sequence, the fill where it is. `out` may be `in` (in place).
// REQUIRES: cu_seqlens_padded as ToHfLabels takes it; both of T * row_bytes bytes.
[[nodiscard]] Status ToHfField(const FieldSpec& spec, std::span<const std::byte> in,
                               std::span<const int32_t> cu_seqlens_padded,
                               std::span<std::byte> out);

// ---- Where each local token comes from (every stage computes it from the metadata). ----

// [T/CP] int32: the packed sequence (0..n-1) that each token of CP rank cp_rank's shard
// belongs to, -1 where the token is padding (its position lies at or past the sequence's real
// length). An idle microbatch (both offsets {0}) has none. REQUIRES: as ShardPaddingMask
// (thdpack/shard.h).
[[nodiscard]] Result<std::vector<int32_t>> ShardSequenceIndex(
    std::span<const int32_t> cu_seqlens, std::span<const int32_t> cu_seqlens_padded,
    int cp_size, int cp_rank);
// Same, written into out (out.size() must be T/CP, 0 for an idle microbatch).
[[nodiscard]] Status ShardSequenceIndexInto(std::span<const int32_t> cu_seqlens,
                                            std::span<const int32_t> cu_seqlens_padded,
                                            int cp_size, int cp_rank, std::span<int32_t> out);

}  // namespace thdpack

#endif  // THDPACK_FIELDS_H_
