// thdpack/wire.h: the step metadata a loader sends to every other rank, and its wire format
// (docs/design.md section 6; the byte grammar is docs/wire_format.md).
//
// Per step and replica, every rank of every pipeline stage and every TP rank needs the layout of
// each packed microbatch (the global cu_seqlens / cu_seqlens_padded that THD attention takes,
// max_seqlen, the loss-token count) and the step figures (token sums, sum of P^2, the global
// loss denominator N, the skipped samples, the epoch). StepMeta holds them; EncodeStepMeta turns
// it into a compact, checksummed message (1.5-2.5 bytes per sequence on real length
// distributions, fixed costs included, against 8 for two int32 offset arrays: real lengths are
// Rice-coded and padded lengths derived from the padding rule) and DecodeStepMeta turns any byte
// string back into either the exact same StepMeta or a Status::Corruption - never a crash, never
// a read out of bounds, never an allocation larger than the message justifies.
//
// All integers are exact (no float32 payloads: Megatron's were exact only up to 2^24).
//
// Thread-safety: plain values and pure functions; safe to call from any number of threads.
#ifndef THDPACK_WIRE_H_
#define THDPACK_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "thdpack/parallel_layout.h"
#include "thdpack/status.h"

namespace thdpack {

// ---------------------------------------------------------------------------------------------
// The metadata.
//
// Notation: n sequences in a microbatch, real lengths L_i = cu_seqlens[i+1] - cu_seqlens[i],
// padded lengths P_i = cu_seqlens_padded[i+1] - cu_seqlens_padded[i], T = cu_seqlens_padded[n],
// m = parallel.sequence_alignment() (the wire's pad_multiple), c = parallel.zigzag_multiple()
// (2*CP when CP > 1, else 1): the padding rule of thdpack/parallel_layout.h.

// The layout of one packed microbatch of one replica (docs/design.md section 5).
struct MicrobatchMeta {
  // [n+1] GLOBAL (not divided by CP) offsets of the real tokens, as TransformerEngine's THD
  // attention takes them: starts at 0, strictly increasing (every L_i >= 1).
  std::vector<int32_t> cu_seqlens;
  // [n+1] offsets of the padded sequences: starts at 0, P_i >= L_i, P_i a multiple of m for
  // every sequence but the last, which is at least roundup(L_i, m) and may carry extra tail
  // padding (so that T/CP is a multiple of TP under SP) but stays a multiple of c.
  std::vector<int32_t> cu_seqlens_padded;
  // The largest P_i (what attention kernels size their tiles by).
  int32_t max_seqlen = 0;
  // Loss tokens of this microbatch, sum of loss_mask: 0 <= n_valid <= sum(L_i - 1).
  int64_t n_valid = 0;

  friend bool operator==(const MicrobatchMeta&, const MicrobatchMeta&) = default;
};

// Version 2 (the dynamic scheduler, schedule.h): the CP group of the domain that holds one
// microbatch for the receiving rank. The domain is the D = dp_size * parallel.cp_size() ranks
// numbered dp*CP + cp; the group is the contiguous domain ranks first_rank .. first_rank +
// num_ranks - 1, and the microbatch's layout is `parallel` with CP = num_ranks (padding rule
// of thdpack/parallel_layout.h). num_ranks == 0: the rank is idle in this microbatch (no
// sequences: cu_seqlens = cu_seqlens_padded = {0}, max_seqlen = n_valid = 0).
struct MicrobatchGroup {
  int32_t first_rank = 0;
  int32_t num_ranks = 0;

  friend bool operator==(const MicrobatchGroup&, const MicrobatchGroup&) = default;
};

// Everything a receiving rank of one replica needs for one step. A static step's metadata
// (groups empty, encoded as version 1) is the same on every rank of a replica; a dynamic step's
// (groups set, version 2) is the same on every rank of one domain index (every TP rank and
// pipeline stage of it). Either, with a rank multiple, is encoded as version 3.
struct StepMeta {
  uint64_t step = 0;          // training step, any 64-bit value
  uint64_t epoch = 0;         // passes over the source so far, any 64-bit value
  int32_t dp_size = 1;        // DP: number of replicas, >= 1
  int32_t replica = 0;        // dp: the replica these microbatches belong to, in [0, DP)
  // CP, TP, SP, the per-sequence alignment m and the rank multiple R of every microbatch of
  // this replica (valid by construction; version 1 carries it as cp_size, tp_size, an sp flag
  // and pad_multiple = m, version 3 adds rank_multiple = R). With sp every T is a multiple of
  // CP * TP; every T is a multiple of parallel.rank_quantum() (R tokens a rank).
  ParallelLayout parallel;
  // The M microbatches of this replica, M >= 1 (the same M on every replica), each n >= 1.
  std::vector<MicrobatchMeta> microbatches;
  int64_t real_tokens = 0;    // sum over microbatches of cu_seqlens[n]
  int64_t padded_tokens = 0;  // sum over microbatches of cu_seqlens_padded[n]
  int64_t sum_sq = 0;         // sum over all sequences of P_i^2 (fits int64: checked)
  // N, the GLOBAL loss-token count of the step over all replicas (the loss denominator, known
  // before any forward pass): >= this replica's sum of n_valid.
  int64_t n_loss_tokens = 0;
  // Samples left out of the step by the oversize policy `skip`, in the order reported; unique.
  std::vector<int64_t> skipped_ids;
  // Version 2 only (empty in a static step): [M], microbatch m's group, and this rank's
  // domain index dp*CP + cp, with dp == replica. With groups set, each microbatch's padding rule
  // is that of its group's layout (parallel with CP = num_ranks), the group contains
  // domain_rank, lies inside the domain, and an idle microbatch holds no sequence. Without
  // groups domain_rank is 0.
  std::vector<MicrobatchGroup> groups;
  int32_t domain_rank = 0;

  friend bool operator==(const StepMeta&, const StepMeta&) = default;
};

// Checks every rule written beside the fields above, and that the totals agree with the
// microbatches: real_tokens, padded_tokens and sum_sq equal their sums, max_seqlen equals the
// largest P_i, n_loss_tokens >= sum of n_valid, under SP every T is a multiple of
// cp_size * tp_size, and every T is a multiple of the layout's rank_quantum(). Returns InvalidArgument naming the field, the microbatch and sequence
// index and the rule broken, e.g.
//   "StepMeta.microbatches[2].cu_seqlens_padded (sequence 5): padded length 100 is not a
//    multiple of pad_multiple 8".
// Runs in O(total sequences + skipped * log skipped).
[[nodiscard]] Status ValidateStepMeta(const StepMeta& meta);

// ---------------------------------------------------------------------------------------------
// The wire format (docs/wire_format.md). A message is
//   "THDM" | version u8 | total_length u32 LE | body | crc32c u32 LE of everything before it
// The first 9 bytes and the trailer keep this shape in every version, so a reader can frame,
// checksum and then dispatch on the version.

inline constexpr uint8_t kStepMetaMagic[4] = {'T', 'H', 'D', 'M'};
// The newest version EncodeStepMeta writes. It writes the oldest version that carries a step, so
// that a step of an older kind keeps the bytes of the releases before: version 1 for a static
// step (groups empty, rank multiple 1), version 2 for a dynamic one (groups set), version 3 for
// either with a rank multiple R > 1 (a reader of versions 1-2 refuses it as newer: it could not
// know that every T carries R tokens a rank). DecodeStepMeta reads every version from 1 to
// this one, and version 4, the step message (thdpack/step_wire.h), whose metadata it returns.
inline constexpr uint8_t kStepMetaVersion = 3;
// The newest version of the THDM frame: the step message (thdpack/step_wire.h), a StepMeta
// with the parts of the step that travel beside it, under the same checksum.
inline constexpr uint8_t kStepMessageVersion = 4;
inline constexpr uint8_t kStepMetaVersionStatic = 1;
inline constexpr uint8_t kStepMetaVersionGroups = 2;
inline constexpr uint8_t kStepMetaVersionRankMultiple = 3;
// Bytes of the fixed prefix: magic, version, total_length.
inline constexpr size_t kStepMetaHeaderSize = 9;
// The smallest well-formed message: prefix plus trailer (a real body is never empty).
inline constexpr size_t kStepMetaMinSize = kStepMetaHeaderSize + 4;

// Validates `meta` (InvalidArgument as ValidateStepMeta) and encodes it: version 1 without
// groups, version 2 with, version 3 with a rank multiple (groups or not). OutOfRange if the message would exceed 2^32 - 1 bytes.
[[nodiscard]] Result<std::vector<uint8_t>> EncodeStepMeta(const StepMeta& meta);

// Decodes one whole message (exactly `bytes`, no trailing bytes). Checks, in this order, the
// size of the prefix, the magic, total_length == bytes.size(), the CRC-32C trailer, then the
// version: a version newer than kStepMessageVersion returns Unimplemented naming it (a
// checksummed message from a newer writer is not corruption); version 4 is decoded whole by
// DecodeStepMessage (thdpack/step_wire.h) and its metadata returned. Then the body: every declared count against
// the bytes left BEFORE allocating, varint ranges, int32 overflow of the offsets, unused bits
// zero, and finally ValidateStepMeta on the result. Every failure of these is Corruption with
// the byte offset and field. On success the result equals the StepMeta that was encoded.
[[nodiscard]] Result<StepMeta> DecodeStepMeta(std::span<const uint8_t> bytes);

// For stream transports: given at least the first kStepMetaHeaderSize bytes of a message,
// returns its total_length after checking the magic and that it is >= kStepMetaMinSize.
// InvalidArgument when fewer bytes are given, Corruption otherwise.
[[nodiscard]] Result<uint32_t> StepMetaMessageSize(std::span<const uint8_t> prefix);

// ---------------------------------------------------------------------------------------------
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF:
// the iSCSI / ext4 / LevelDB checksum). Crc32c("123456789") == 0xE3069283.
// Uses the SSE4.2 crc32 instruction when the CPU has it (detected at run time; builds stay
// portable), slicing-by-8 tables otherwise.

// The CRC-32C of `data`.
uint32_t Crc32c(std::span<const uint8_t> data);
// The CRC-32C of A followed by `data`, given crc = Crc32c(A): Crc32c(AB) ==
// Crc32cExtend(Crc32c(A), B). Crc32cExtend(0, data) == Crc32c(data).
uint32_t Crc32cExtend(uint32_t crc, std::span<const uint8_t> data);

}  // namespace thdpack

#endif  // THDPACK_WIRE_H_
