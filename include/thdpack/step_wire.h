// thdpack/step_wire.h: the messages of the distributed step (thdpack/step_runner.h) and their
// byte format, docs/wire_format.md. Every byte a rank receives in a step is one of these
// messages, or a bulk array of a shard whose checksum one of them carries:
//
//   message            collective                  sender           decoder
//   lengths header     all-gather (fixed size)     every planner    DecodeLengthsHeader
//   lengths            all-gather-v                every planner    DecodeLengths
//   position           broadcast                   head 0 (dynamic) DecodePositionFrame
//   samples            all-to-all-v (one a pair)   a loader         OpenFrame(kSamples)
//   size               broadcast                   the root         DecodeSizeFrame
//   step message       broadcast                   a loader/head    DecodeStepMessage
//   shard arrays       send / recv                 a loader/head    (their CRC-32C in the step
//                                                                    message)
//   groups             broadcast                   head 0 (dynamic) DecodeGroupsFrame
//
// The step message is THDM version 4 (thdpack/wire.h's frame: magic, version, total_length,
// CRC-32C): the StepMeta with the run's position after the step, each microbatch's sequences
// (ids, loss-token counts, blend sources, sample fields) and the CRC-32C of every shard array
// the sender delivers. The other messages are frames: a body and an 8-byte trailer (kind,
// version, two zero bytes, the CRC-32C of all before it), so a receiver checks what it got -
// checksum, kind, version - before it reads a byte of the body. Every decoder returns either
// the exact value that was encoded or Corruption naming the message, the byte or field and the
// rule broken; none reads outside its bytes or allocates more than they justify.
//
// The messages are never stored: every rank of a job runs the same build, so a version other
// than kStepWireVersion is a mixed deployment, refused by name (Unimplemented).
//
// Thread-safety: plain values and pure functions.
#ifndef THDPACK_STEP_WIRE_H_
#define THDPACK_STEP_WIRE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/data.h"
#include "thdpack/status.h"
#include "thdpack/wire.h"

namespace thdpack {

// The version of every message of the step: the step message's THDM version, every frame's
// version byte.
inline constexpr uint8_t kStepWireVersion = kStepMessageVersion;

// ---------------------------------------------------------------------------------------------
// The step message.

// Where the run stands after a step (thdpack/run_state.h): the samples consumed, and the
// source's cursor there (none for a source fed by the caller). The cursor is written by the
// table of its fields (SourceCursorFields, thdpack/data.h), as the run state writes it.
struct StepPosition {
  int64_t consumed = 0;  // >= 0
  std::optional<SourceCursor> cursor;

  friend bool operator==(const StepPosition&, const StepPosition&) = default;
};

// What every rank of a microbatch learns of its n sequences, in packed order. An idle
// microbatch (a dynamic step's rank outside the microbatch's group) has none: every list empty.
struct MicrobatchSequences {
  std::vector<int64_t> ids;        // [n] sample ids
  std::vector<int64_t> n_targets;  // [n] loss tokens of each, 0 <= n_targets <= L - 1
  std::vector<int32_t> sources;    // [n] a blend's source of each, >= 0; empty without a blend
  // [F] the rows of each sample field (one row per sequence, row_bytes each): F lists of
  // n * StepMessage::sample_field_bytes[f] bytes.
  std::vector<std::vector<std::byte>> sample_fields;

  friend bool operator==(const MicrobatchSequences&, const MicrobatchSequences&) = default;
};

// Everything a rank of a replica (a static step) or of a column (a dynamic step) receives with
// its metadata. Invariants (ValidateStepMessage): meta valid; one MicrobatchSequences per
// microbatch, with as many sequences as the microbatch (its cu_seqlens), sources exactly when
// blend, F sample fields of the declared row sizes; the cursor by CheckSourceCursor; the shard
// checksums as many as shards_per_microbatch * arrays_per_shard per busy microbatch.
struct StepMessage {
  StepMeta meta;
  StepPosition after;
  // The step's count of sequences with a loss token (every replica's), >= 0.
  int64_t n_loss_sequences = 0;
  bool blend = false;  // the sequences carry their sources
  // [F] bytes of one row of each sample field (a sample's non-per-token field), in schema order;
  // each >= 1.
  std::vector<int64_t> sample_field_bytes;
  std::vector<MicrobatchSequences> sequences;  // [M]
  // The CRC-32C (thdpack::Crc32c) of each bulk array the sender delivers after this message:
  // per busy microbatch (groups: num_ranks > 0), per shard (the CP ranks of a static step, the
  // sender's own shard of a dynamic one), per array in the order tokens, position ids, labels,
  // loss mask, then the per-token fields in schema order. shards_per_microbatch 0: no shard
  // travels (a group of one).
  int32_t shards_per_microbatch = 0;
  int32_t arrays_per_shard = 0;
  std::vector<uint32_t> shard_checksums;

  // The checksums of shard s of microbatch m (REQUIRES: m busy, s < shards_per_microbatch).
  std::span<const uint32_t> ShardChecksums(size_t m, size_t s) const;

  friend bool operator==(const StepMessage&, const StepMessage&) = default;
};

// The invariants above: InvalidArgument naming the field and the rule.
[[nodiscard]] Status ValidateStepMessage(const StepMessage& message);

// Validates (ValidateStepMessage) and encodes: THDM version 4. OutOfRange past 2^32 - 1 bytes.
[[nodiscard]] Result<std::vector<uint8_t>> EncodeStepMessage(const StepMessage& message);

// Decodes one whole version 4 message: the frame as DecodeStepMeta checks it, then the body,
// every count against the bytes left before allocating, every value against its range, and
// ValidateStepMessage on the result. Corruption ("step message: byte N (field): rule") on any
// failure; a message of versions 1-3 (a StepMeta alone) is Corruption too: it lacks the
// step's sequences.
[[nodiscard]] Result<StepMessage> DecodeStepMessage(std::span<const uint8_t> bytes);

// ---------------------------------------------------------------------------------------------
// Frames: body | kind u8 | version u8 | 00 00 | CRC-32C of all before it (u32 LE).

enum class FrameKind : uint8_t {
  kLengthsHeader = 1,  // a planner's header of the lengths exchange
  kLengths = 2,        // a planner's samples (id offset, L, n_targets, source, group)
  kPosition = 3,       // the run's position after the step (a dynamic step's heads)
  kSamples = 4,        // the token exchange: one block of sample payloads, sender to receiver
  kSize = 5,           // the size of the message that follows in a broadcast
  kGroups = 6,         // a dynamic step's CP groups
  kJob = 7,            // the job as the world agrees on it when the step runner opens
  kMedia = 8,          // media: samples' media in the exchange, a rank's media of a step
};
// "lengths header", "lengths", "position", "samples", "size", "groups", "job", "media".
std::string_view FrameKindName(FrameKind kind);

inline constexpr size_t kFrameTrailerSize = 8;

// Writes the trailer over the last kFrameTrailerSize bytes of `frame`, the body being the bytes
// before them. REQUIRES: frame.size() >= kFrameTrailerSize.
void SealFrame(FrameKind kind, std::span<uint8_t> frame);
// Appends a trailer to `body`, which becomes the frame.
void AppendFrameTrailer(FrameKind kind, std::vector<uint8_t>* body);
// The body of `frame` after its checks, in order: at least a trailer, the checksum, the kind
// (another kind: a message out of place), the version, the zero bytes. Corruption
// "<kind name>: <what failed>" otherwise; a version above kStepWireVersion is Unimplemented.
[[nodiscard]] Result<std::span<const uint8_t>> OpenFrame(std::span<const uint8_t> frame,
                                                         FrameKind kind);

// The lengths header: what a planner tells every other before its samples. Fixed size (an
// all-gather): eight int64 LE and the trailer.
struct LengthsHeader {
  int64_t count = 0;           // samples this member read, [0, 2^40]
  int64_t first_id = 0;        // the step's first id (any int64)
  int64_t id_span = 0;         // the step's ids lie in [first_id, first_id + id_span), >= 0
  int64_t epoch = 0;           // >= 0
  int64_t position_bytes = 0;  // the size of the position frame, [0, 2^26]
  int64_t truncated_samples = 0;  // oversize 'truncate': what this member cut, each >= 0
  int64_t truncated_tokens = 0;
  int64_t truncated_targets = 0;

  friend bool operator==(const LengthsHeader&, const LengthsHeader&) = default;
};
inline constexpr size_t kLengthsHeaderFrameSize = 8 * 8 + kFrameTrailerSize;
std::array<uint8_t, kLengthsHeaderFrameSize> EncodeLengthsHeader(const LengthsHeader& header);
[[nodiscard]] Result<LengthsHeader> DecodeLengthsHeader(std::span<const uint8_t> frame);

// The lengths: one fixed-size record a sample (int32 LE words: id offset, L, n_targets; then
// the blend's source; then keep_groups' group id as two words, low first), and the trailer.
struct SampleRecord {
  int64_t offset = 0;     // id - the step's first id, [0, id_span)
  int64_t length = 0;     // L, [1, 2^31 - 1]
  int64_t n_targets = 0;  // [0, L - 1]
  int32_t source = 0;     // a blend's source, >= 0 (with RecordColumns::source)
  int64_t group = 0;      // keep_groups' group id, any int64 (with RecordColumns::group)
  EncoderWork encoder;    // its media's encoder work, [0, 2^62) (with RecordColumns::media)

  friend bool operator==(const SampleRecord&, const SampleRecord&) = default;
};
struct RecordColumns {
  bool source = false;
  bool group = false;
  bool media = false;
};
// Bytes of one record (12, +4 with sources, +8 with groups, +16 with media), and of a frame of
// `count`.
size_t RecordBytes(RecordColumns columns);
size_t LengthsFrameSize(int64_t count, RecordColumns columns);
// Appends the frame of `records` to `out`.
void EncodeLengths(std::span<const SampleRecord> records, RecordColumns columns,
                   std::vector<uint8_t>* out);
// Appends the records of `frame` to `out` (their count follows from its size). Corruption on
// a frame whose body is not whole records or a record out of its ranges (offset against
// id_span).
[[nodiscard]] Status DecodeLengths(std::span<const uint8_t> frame, RecordColumns columns,
                                   int64_t id_span, std::vector<SampleRecord>* out);

// The position alone (a dynamic step's heads that read nothing take it from head 0).
// REQUIRES: consumed >= 0 and the cursor valid (CheckSourceCursor), as a source's own are.
std::vector<uint8_t> EncodePositionFrame(const StepPosition& position);
[[nodiscard]] Result<StepPosition> DecodePositionFrame(std::span<const uint8_t> frame);

// A size (the bytes of the message a broadcast sends next): fixed64 LE and the trailer.
inline constexpr size_t kSizeFrameSize = 8 + kFrameTrailerSize;
std::array<uint8_t, kSizeFrameSize> EncodeSizeFrame(int64_t size);
// Corruption on a damaged frame or a size outside [min, max].
[[nodiscard]] Result<int64_t> DecodeSizeFrame(std::span<const uint8_t> frame, int64_t min,
                                              int64_t max);

// A dynamic step's CP groups: (first domain rank, size) pairs, increasing, as varints.
std::vector<uint8_t> EncodeGroupsFrame(std::span<const std::pair<int, int>> groups);
// Corruption on a damaged frame, a pair out of order or repeated, or a group outside the
// domain of `domain` ranks (first >= 0, size >= 1, first + size <= domain).
[[nodiscard]] Result<std::vector<std::pair<int, int>>> DecodeGroupsFrame(
    std::span<const uint8_t> frame, int64_t domain);

// The job (StepJobEntries, thdpack/step_runner.h): (name, value) pairs, each string as a
// varint length and its bytes, after a varint count. At most kMaxJobEntries entries of at most
// kMaxJobText bytes each.
inline constexpr int64_t kMaxJobEntries = 4096;
inline constexpr int64_t kMaxJobText = 1 << 20;
using JobEntry = std::pair<std::string, std::string>;
std::vector<uint8_t> EncodeJobFrame(std::span<const JobEntry> entries);
// Corruption on a damaged frame, a count or length past the bytes or the bounds, or bytes left
// over.
[[nodiscard]] Result<std::vector<JobEntry>> DecodeJobFrame(std::span<const uint8_t> frame);

// ---------------------------------------------------------------------------------------------
// Media (thdpack/media.h, docs/media.md): each sample's media in the exchange, and each rank's
// media of a step. Little-endian int64 words; payload bytes padded to 8.

// A sample's media (one MediaPart per declared modality), as the token exchange's media block
// carries it: per part, k (items), dtype, width, payload bytes, seconds count; then 3k grid
// words, the seconds (IEEE-754 bits), the payload padded to 8 bytes.
size_t SampleMediaBytes(std::span<const MediaPart> media);
// Writes SampleMediaBytes(media) bytes at dst; returns the end.
uint8_t* EncodeSampleMedia(std::span<const MediaPart> media, uint8_t* dst);
// One sample's `modalities` parts from bytes[*offset...]; *offset moves past them. Corruption
// naming the part and the count when a count is negative or runs past the bytes, or a dtype is
// not one of fields.h's.
[[nodiscard]] Result<std::vector<MediaPart>> DecodeSampleMedia(std::span<const uint8_t> bytes,
                                                               size_t modalities, size_t* offset);

// What one rank of a microbatch gets of its media (RouteMedia of thdpack/media.h): per
// declared modality the items it encodes, their payload rows and the route of their output
// rows; and the mRoPE positions of its shard.
struct MediaShardPart {
  std::vector<int64_t> grid;         // [3k]: the items it encodes
  uint8_t dtype = 0;                 // their payload's element type (FieldDtype)
  int64_t width = 0;                 // elements a payload row
  std::vector<std::byte> payload;    // their rows, concatenated
  int64_t output_rows = 0;           // their tokens
  std::vector<int64_t> token_index;  // [m] local positions taking this modality's rows
  std::vector<int64_t> recv_index;   // [m]
  std::vector<int64_t> send_index;   // [output rows sent]
  std::vector<int64_t> send_counts;  // [CP]
  std::vector<int64_t> recv_counts;  // [CP]
};
struct MediaShard {
  std::vector<MediaShardPart> parts;  // one per declared modality
  std::vector<int64_t> mrope;         // [3, T/CP] row-major, or empty (no mRoPE)
};
// One rank's media of a step, every microbatch's, as one kMedia frame.
std::vector<uint8_t> EncodeMediaFrame(std::span<const MediaShard> microbatches);
// The same into `out` of exactly MediaFrameBytes(microbatches) bytes, every one written (a
// buffer need not be zeroed first: a payload's pages are then touched once).
size_t MediaFrameBytes(std::span<const MediaShard> microbatches);
void EncodeMediaFrameInto(std::span<const MediaShard> microbatches, std::span<uint8_t> out);
// Corruption on a damaged frame, a count past the bytes, another number of modalities than
// `modalities`, or bytes left over.
[[nodiscard]] Result<std::vector<MediaShard>> DecodeMediaFrame(std::span<const uint8_t> frame,
                                                               size_t modalities);

// A dynamic step's media placement: a loader's samples' items' encoder costs, all-gathered over
// the heads so that each head places every group's items before the exchange (docs/media.md,
// "Under the dynamic scheduler"). One kMedia frame: the sample count, then per sample k (its
// items, in MediaItemsOf's order) and k float64 costs (IEEE-754 bits).
std::vector<uint8_t> EncodeMediaCostsFrame(std::span<const std::vector<double>> costs);
// Corruption on a damaged frame, another sample count than `samples`, a count past the bytes,
// a cost that is not finite or is negative, or bytes left over.
[[nodiscard]] Result<std::vector<std::vector<double>>> DecodeMediaCostsFrame(
    std::span<const uint8_t> frame, int64_t samples);

}  // namespace thdpack

#endif  // THDPACK_STEP_WIRE_H_
