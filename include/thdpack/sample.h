// thdpack/sample.h: the unit of data, a sample (id, tokens[L], target_mask[L]).
//
// target_mask[j] = 1 when token j is a training target: the loss includes predicting token j
// from tokens 0..j-1 (token-aligned, as AReaL's loss_mask). Token 0 is never predicted, so
// n_targets = sum(target_mask[1:L]). An empty target_mask means "all ones" (pretraining).
//
// Thread-safety: plain values.
#ifndef THDPACK_SAMPLE_H_
#define THDPACK_SAMPLE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace thdpack {

// Token ids are held as int32 inside the library (vocabularies are far below 2^31); the
// Python/PyTorch edge widens them to int64.
using TokenId = int32_t;

// One declared modality of a sample's media (thdpack/media.h): its items' grids and payload,
// as a caller feeds them. The payload's rows are bytes of one element type, never converted.
struct MediaPart {
  std::vector<int64_t> grid;       // [3k]: (t, h, w) of each of its k items, in order
  std::vector<double> seconds;     // [k] seconds per temporal grid step (timed), or empty
  uint8_t dtype = 0;               // the payload's element type (FieldDtype of fields.h)
  int64_t width = 0;               // elements a payload row (0 when there is no payload)
  std::vector<std::byte> payload;  // [sum of t*h*w rows, width] elements
};

// An owning sample, as data sources produce it.
struct Sample {
  int64_t id = 0;
  std::vector<TokenId> tokens;       // [L], L >= 1
  std::vector<uint8_t> target_mask;  // [L] of 0/1, or empty for all ones
  // The source it came from, as an index into a blend's list (thdpack/blend.h); 0 elsewhere.
  int32_t source = 0;
  // The run's declared fields (thdpack/fields.h), one buffer each in schema order: L rows of a
  // per-token field, one row of a sample field, each row the field's row_bytes. Empty when the
  // run declares none.
  std::vector<std::vector<std::byte>> fields;
  // The run's declared media, one part per modality in declaration order; empty when the run
  // declares none (only a caller-fed step carries media).
  std::vector<MediaPart> media;
};

// A non-owning view of a sample, as packing consumes it.
struct SampleView {
  int64_t id = 0;
  std::span<const TokenId> tokens;       // [L]
  std::span<const uint8_t> target_mask;  // [L] or empty for all ones

  SampleView() = default;
  SampleView(int64_t sample_id, std::span<const TokenId> t, std::span<const uint8_t> m = {})
      : id(sample_id), tokens(t), target_mask(m) {}
  SampleView(const Sample& s) : id(s.id), tokens(s.tokens), target_mask(s.target_mask) {}  // NOLINT
};

// Loss-token count of a sample: sum(target_mask[1:L]), or L-1 when the mask is empty.
inline int64_t NumTargets(const SampleView& s) {
  if (s.tokens.empty()) return 0;
  if (s.target_mask.empty()) return static_cast<int64_t>(s.tokens.size()) - 1;
  int64_t n = 0;
  for (size_t j = 1; j < s.target_mask.size(); ++j) n += s.target_mask[j] != 0;
  return n;
}

}  // namespace thdpack

#endif  // THDPACK_SAMPLE_H_
