// thdpack/media.h: images and video in a packed step (docs/media.md). The rules a multimodal
// microbatch follows, as pure functions every rank computes alike from the step's metadata:
//   - the modalities a run declares (MediaSpec) and the check that ties a sample's media items
//     to its placeholder tokens (SampleMediaItems);
//   - the encoder's cost of an item (EncoderCost) and where each item is encoded: whole items
//     spread over a replica's CP ranks, balancing that cost (PlaceMediaItems);
//   - where each encoder output row goes: the CP (and SP) rank whose shard holds its token, and
//     that rank's local position for it (MediaRoutes, the tables of route_media's all-to-all);
//   - the multimodal rotary positions of Qwen2-VL and Qwen2.5-VL (SampleMropePositions).
//
// Vocabulary. A modality has a name ("image"), a placeholder token id, a payload of rows
// [sum_j t_j*h_j*w_j, D] (one row a patch, its own dtype) and one grid row (t, h, w) per item.
// With spatial merge m, item j of a modality takes t*h*w/m^2 placeholder tokens (one per merged
// m x m block of patches), consecutive in the sample, the items in order - Qwen2-VL's processor
// and Megatron's alignment rule (align_embeddings_by_token_positions): the k-th placeholder of
// a modality in a sample takes the k-th output row of that modality's encoder on the sample.
//
// Legend (docs/design.md): L a sample's length, T packed tokens after padding, CP, SP (= TP when
// sequence parallelism is on).
// Thread-safety: plain values and pure functions.
#ifndef THDPACK_MEDIA_H_
#define THDPACK_MEDIA_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/cost.h"
#include "thdpack/data.h"
#include "thdpack/pack.h"
#include "thdpack/sample.h"
#include "thdpack/status.h"

namespace thdpack {

// One declared modality.
struct MediaSpec {
  std::string name;        // "image", "video": unique, not empty
  TokenId token_id = -1;   // its placeholder token (Qwen2-VL: 151655 image, 151656 video)
  bool timed = false;      // its items carry seconds per temporal grid step (video, mRoPE 2.5)
};

// OK when the specs are usable: at least one, names unique and not empty, token ids unique and
// >= 0, and merge >= 1. InvalidArgument naming media[i] and the rule otherwise.
[[nodiscard]] Status ValidateMediaSpecs(std::span<const MediaSpec> specs, int64_t merge);

// An item's grid of patches: t frames (temporal patches) of h x w patches.
struct MediaGrid {
  int64_t t = 1, h = 1, w = 1;
  int64_t patches() const { return t * h * w; }  // its payload rows
  int64_t tokens(int64_t merge) const { return t * (h / merge) * (w / merge); }
};

// One media item as it sits in its sample.
struct MediaItem {
  int32_t modality = 0;    // index into the specs
  int32_t index = 0;       // item j of its modality in the sample
  MediaGrid grid;
  int64_t begin = 0;       // the sample position of its first placeholder token
  int64_t tokens = 0;      // grid.tokens(merge), consecutive from begin
  int64_t row_begin = 0;   // its first row in the sample's payload of its modality
  bool timed = false;      // of a timed modality (MediaSpec::timed)
  double seconds = 0;      // seconds per temporal grid step (timed items; 0 otherwise)
};

// The media items of one sample, ordered by their first token. grids[m]: the sample's grid rows
// of modality m, in order (one vector per spec); seconds[m]: per item of a timed modality (empty
// for the others, or to take 1.0 for each, as transformers does when none are given).
// InvalidArgument naming `where` (e.g. "samples[3] (id 17)"), the modality and the item when:
// a grid dimension is < 1, h or w is not divisible by merge, the placeholders run out before an
// item (its count and those left), placeholders remain after the last item (both counts), an
// item's tokens are not consecutive (the position that breaks the run), grids.size() differs
// from specs.size(), or seconds do not match the items.
// REQUIRES: ValidateMediaSpecs(specs, merge) OK.
[[nodiscard]] Result<std::vector<MediaItem>> SampleMediaItems(
    std::span<const MediaSpec> specs, int64_t merge, std::span<const TokenId> tokens,
    std::span<const std::vector<MediaGrid>> grids, std::span<const std::vector<double>> seconds,
    std::string_view where);

// The items of one sample's media (one part per spec: its grid rows [3k] and seconds; the
// payload is not looked at), as SampleMediaItems gives them. InvalidArgument naming `where`
// when the parts are not one per spec, a grid is not [k, 3], or SampleMediaItems' rules.
[[nodiscard]] Result<std::vector<MediaItem>> MediaItemsOf(std::span<const MediaSpec> specs,
                                                          int64_t merge,
                                                          std::span<const TokenId> tokens,
                                                          std::span<const MediaPart> media,
                                                          std::string_view where);

// One sample's media as a caller feeds it (Sample::media, thdpack/sample.h): one part per
// spec, its grid rows [3k] and seconds tied to the tokens by SampleMediaItems, and a payload of
// exactly sum(t*h*w) rows of `width` >= 1 elements of its dtype (none: width 0, no bytes, no
// items). Returns the items; InvalidArgument naming `where` and the rule otherwise (a payload
// of the wrong size names both row counts).
[[nodiscard]] Result<std::vector<MediaItem>> CheckSampleMedia(std::span<const MediaSpec> specs,
                                                              int64_t merge,
                                                              std::span<const TokenId> tokens,
                                                              std::span<const MediaPart> media,
                                                              std::string_view where);

// ---- The encoder's work, and where it runs. ----

// The encoder's cost of an item is EncoderCost (thdpack/cost.h): per_patch * t*h*w +
// per_frame_sq * t * (h*w)^2, its layers linear in its patches and its attention full within
// each frame (Qwen2-VL's vision tower attends frame by frame).
// The default term: Qwen2-VL's vision tower (32 layers, hidden 1280, MLP 5120, not gated):
// per_patch = 3 * 2 * l * (4 h^2 + 2 h f) = 3,774,873,600; per_frame_sq = 3 * 4 * l * h =
// 491,520 (QK^T and AV over the whole frame, forward and backward).
// In training FLOPs, the unit of the built-in language-model costs (cost.h).
EncoderCost DefaultEncoderCost();
double ItemEncoderCost(const EncoderCost& cost, const MediaGrid& grid);
// The encoder work of a sample's media (one part per modality; its grid rows [3k], checked by
// CheckSampleMedia): the sums over its items of t*h*w and t*(h*w)^2. InvalidArgument naming
// `where` when a sum exceeds 2^62 (no payload that fits in memory comes near).
[[nodiscard]] Result<EncoderWork> SampleEncoderWork(std::span<const MediaPart> media,
                                                    std::string_view where);

// Whole items over `ranks` encoder ranks, balancing their cost: longest processing time first
// (items by cost, descending, ties by index), each to the rank with the least cost so far (ties:
// the lowest rank). Returns the rank of each item. Deterministic, so every rank computes the
// same placement. REQUIRES: ranks >= 1, costs finite and >= 0.
std::vector<int32_t> PlaceMediaItems(std::span<const double> costs, int ranks);

// ---- Routing: each encoder output row to the rank whose shard holds its token. ----

// A packed microbatch's media: items[i] the items of its sequence i (SampleMediaItems, in
// packed order), and the encoder rank (0..CP-1) of every item, in the order of items flattened
// (sequence by sequence, each sequence's items in order).
struct MicrobatchMedia {
  std::vector<std::vector<MediaItem>> items;
  std::vector<int32_t> encoder_rank;
};

// The encoder rank of every item of a microbatch (flattened as MicrobatchMedia counts them):
// all its items, of every modality (one encoder), placed by PlaceMediaItems on their
// ItemEncoderCost. REQUIRES: ranks >= 1.
std::vector<int32_t> PlaceMicrobatchMedia(std::span<const std::vector<MediaItem>> items,
                                          int ranks, const EncoderCost& cost);

// What one rank (cp_rank, sp_rank) does with one modality of a microbatch.
struct MediaRoute {
  // The items it encodes, as (sequence, item index in that sequence's list), in order: its
  // payload is their rows, concatenated, and the encoder's output their tokens' rows.
  std::vector<std::pair<int32_t, int32_t>> encodes;
  std::vector<MediaGrid> grids;           // their grids: mb["media"][name]["grid_thw"]
  int64_t payload_rows = 0;               // sum of their patches
  int64_t output_rows = 0;                // sum of their tokens
  // The local token positions of its shard (the SP part of it with SP) that take this
  // modality's rows, ascending: mb["media"][name]["token_index"].
  std::vector<int64_t> token_index;
  // The all-to-all over the CP group: the encoder's output rows in send order (by destination
  // CP rank, then destination position), the rows sent to and received from each CP rank, and
  // for each entry of token_index the row of the received buffer that holds it.
  std::vector<int64_t> send_index;
  std::vector<int64_t> send_counts;       // [CP]
  std::vector<int64_t> recv_counts;       // [CP]
  std::vector<int64_t> recv_index;        // [token_index.size()]
};

// The route of modality `modality` for CP rank cp_rank and SP rank sp_rank of a microbatch of
// layout `layout` (ComputeLayout of its sequences' lengths, zigzag-shardable over cp_size) with
// CP-local shards split over sp_size contiguous SP parts (1: no SP). With SP, the encoder runs
// on every SP (TP) rank of its CP rank, and each sends only the rows whose tokens lie in its own
// SP part, to the same SP part of their CP rank. InvalidArgument naming the rule when the items
// do not fit the layout (an item past its sequence's real length, a rank out of range, an
// encoder rank per item missing), or T/CP is not divisible by sp_size.
[[nodiscard]] Result<MediaRoute> RouteMedia(const Layout& layout, int cp_size, int cp_rank,
                                            int sp_size, int sp_rank, int32_t modality,
                                            const MicrobatchMedia& media);

// The plain reference of RouteMedia's destination rule, for tests: the whole [T] array of
// "which (item, token k) sits at packed position g" (-1 for text and padding), each CP rank's
// shard gathered from it by CpPartitionIndices and cut into SP parts. Returns, for each CP rank
// and SP rank (index cp * sp_size + sp), the slots of its part that take modality `modality`,
// in local order.
struct MediaSlot {
  int64_t position = 0;  // local position in the SP part of the CP shard
  int64_t item = 0;      // the item, flattened as MicrobatchMedia::encoder_rank counts them
  int64_t token = 0;     // its k-th token
};
[[nodiscard]] Result<std::vector<std::vector<MediaSlot>>> RouteMediaReference(
    const Layout& layout, int cp_size, int sp_size, int32_t modality, const MicrobatchMedia& media);

// ---- mRoPE: the multimodal rotary positions. ----

enum class Mrope : uint8_t { kNone, kQwen2Vl, kQwen25Vl };
// "none", "qwen2-vl", "qwen2.5-vl", and the inverse (InvalidArgument listing the names).
std::string_view MropeName(Mrope mrope);
[[nodiscard]] Result<Mrope> ParseMrope(std::string_view text);

// One sample's [3, L] positions (row-major: the temporal row, the height row, the width row),
// as transformers 5.x's Qwen2VLModel.get_rope_index (kQwen2Vl) and Qwen2_5_VLModel's (kQwen25Vl)
// give them for the sample alone: text counts on from the running position p on all three rows;
// an item starting at p takes (p + t_index, p + y, p + x) over its t x h/m x w/m tokens (t, y, x
// in row-major order), with t_index = k (qwen2-vl, and images under qwen2.5-vl) or
// trunc(float(k) * float(tokens_per_second * seconds)) (a timed item under qwen2.5-vl); after an
// item, p += max(h, w) / m. (Qwen2-VL's original code and verl's copy resume at p + max(t, h/m,
// w/m) instead: they differ after a video of more frames than its side; docs/media.md.)
// `items` as SampleMediaItems returns them. Equal to transformers wherever two items are apart
// by at least one text token, as the processors write them (vision start and end tokens):
// transformers takes a run of adjacent placeholders of one modality for one item.
// REQUIRES: mrope != kNone; items within [0, L), ordered, not overlapping.
[[nodiscard]] Result<std::vector<int64_t>> SampleMropePositions(Mrope mrope,
                                                                std::span<const MediaItem> items,
                                                                int64_t length, int64_t merge,
                                                                double tokens_per_second);

// CP rank cp_rank's [3, T/CP] mRoPE positions of a packed microbatch (row-major, the three rows
// of its shard): positions[i] is sequence i's [3, L_i] (SampleMropePositions), and the padding
// of a sequence counts on from its largest position + 1 on all three rows (as position_ids
// count on through padding, thdpack/pack.h). Sharded like the tokens (CpPartitionIndices).
// InvalidArgument when a sequence's positions are not [3, L_i] of the layout's real length.
[[nodiscard]] Result<std::vector<int64_t>> MropeShard(
    std::span<const std::vector<int64_t>> positions, const Layout& layout, int cp_size,
    int cp_rank);

}  // namespace thdpack

#endif  // THDPACK_MEDIA_H_
