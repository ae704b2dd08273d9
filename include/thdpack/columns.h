// thdpack/columns.h: a batch of samples held as columns - Apache Arrow's list layout, every
// row's values one after another and an offset per row - made into samples (Sample) in one pass.
//
// A padded batch turned into samples (thdpack.torch.adapters), a Python caller's SampleRows and
// an Arrow record batch all hold their rows this way: one buffer a column, not one object a
// sample. SamplesFromColumns checks every column once (its dtype and inner shape against the
// declared field, never cast; its offsets) and every row (its length against the tokens', token
// ids in [0, 2^31), mask values 0/1), naming the column, the row and the rule, and copies each
// row into its sample: the cost of one memcpy a row and column, where a sample per Python
// object costs a conversion each.
//
// Legend: B rows, N values of a column (rows x inner width), L a row's length in tokens.
// Thread-safety: plain values and pure functions.
#ifndef THDPACK_COLUMNS_H_
#define THDPACK_COLUMNS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/fields.h"
#include "thdpack/sample.h"
#include "thdpack/status.h"

namespace thdpack {

// One column: `values` the bytes of [rows, *shape] elements of `dtype`; per-token columns give
// `offsets` ([B + 1] int64, in rows of the column: row b is [offsets[b], offsets[b + 1]); they
// need not start at 0, as a slice of a longer column keeps its offsets), a per-sample column
// none (row b is row b of the values).
struct ColumnView {
  std::string name;
  FieldDtype dtype = FieldDtype::kInt32;
  std::vector<int64_t> shape;  // inner shape; {} for a scalar per row (tokens, mask)
  std::span<const std::byte> values;
  std::span<const int64_t> offsets;
};

// The columns of B samples: the tokens (int32, int64 or uint8), an optional target mask of 0/1
// (bool or any integer dtype of FieldDtype; no offsets: the tokens'), and the declared fields
// by name (per-token fields with offsets, sample fields without).
struct SampleColumns {
  ColumnView tokens;
  bool has_mask = false;
  ColumnView mask;
  std::vector<ColumnView> fields;
  // B: the tokens' rows (offsets - 1), 0 without offsets.
  int64_t rows() const {
    return tokens.offsets.empty() ? 0 : static_cast<int64_t>(tokens.offsets.size()) - 1;
  }
};

// Every row of `columns` as a sample (id 0: the step numbers them), its fields in the order of
// `specs`. InvalidArgument, naming `where`, the column and (for a row's rule) the row:
//   - a column: tokens of another dtype than int32/int64/uint8, a mask of a float dtype, a
//     declared field missing or given twice, a column not declared, a field's dtype or inner
//     shape not the declared one (never cast), a per-token field without offsets or a sample
//     field with them, offsets that are not [B + 1], decrease, or reach past the values;
//   - a row: no tokens, a token id outside [0, 2^31), a mask value other than 0 and 1, a
//     per-token field whose row is not the tokens' length.
[[nodiscard]] Result<std::vector<Sample>> SamplesFromColumns(const SampleColumns& columns,
                                                             std::span<const FieldSpec> specs,
                                                             std::string_view where);

// The plain reference: row b of `columns` built element by element (no column check, no
// memcpy), for tests comparing it with SamplesFromColumns on random columns.
// REQUIRES: SamplesFromColumns(columns, specs, ...) is OK.
Sample SampleFromColumnsReference(const SampleColumns& columns, std::span<const FieldSpec> specs,
                                  int64_t row);

// ---- Padded batches: an RL trainer's [B, S] rows with a mask of the kept columns. ----
//
// verl's batch holds each rollout as a row of a [B, S] tensor, its real tokens marked by
// attention_mask (the prompt left-padded, the response right-padded) and its per-token values
// as [B, R] over the response columns. The adapters (thdpack.torch.adapters) move these to
// columns and back; a row's kept columns are a few runs, so each is one memcpy.

// Row b's kept columns (mask != 0) among columns [col0, col0 + width) of a [B, stride] mask, as
// runs of consecutive columns: row b's runs are [row_runs[b], row_runs[b + 1]), run k starting
// at column col0 + run_col[k] (run_col relative to col0) for run_len[k] columns; counts[b] the
// row's kept columns.
struct MaskRuns {
  int64_t rows = 0, width = 0;
  std::vector<int64_t> counts;    // [B]
  std::vector<int64_t> row_runs;  // [B + 1]
  std::vector<int64_t> run_col, run_len;
};
// For T in {uint8_t (and bool's bytes), int32_t, int64_t}. REQUIRES: col0 + width <= stride.
template <typename T>
MaskRuns RunsOfMask(const T* mask, int64_t rows, int64_t stride, int64_t col0, int64_t width);

// The runs of `runs` (taken from column 0) within columns [col0, col0 + width), relative to
// col0: RunsOfMask(mask, rows, stride, col0, width) without a second pass over the mask.
// REQUIRES: runs.width >= col0 + width.
MaskRuns ClipRuns(const MaskRuns& runs, int64_t col0, int64_t width);

// Each row's kept elements (rb bytes each) of src [B, width] (a row every src_stride elements,
// columns relative to the runs' col0), one after another to dst from element dst_start[b].
void GatherRuns(const MaskRuns& runs, const std::byte* src, int64_t src_stride, size_t rb,
                std::byte* dst, std::span<const int64_t> dst_start);
// The inverse: row b's kept columns of dst [B, width] (a row every dst_stride elements) from
// src's elements src_start[b], src_start[b] + 1, ...; other columns untouched.
void ScatterRuns(const MaskRuns& runs, const std::byte* src, std::span<const int64_t> src_start,
                 size_t rb, std::byte* dst, int64_t dst_stride);

}  // namespace thdpack

#endif  // THDPACK_COLUMNS_H_
