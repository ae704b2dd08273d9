// StepMeta: validation, and versions 1, 2 and 3 of its wire format (docs/wire_format.md); the
// message's frame and the metadata part of version 4, the step message (step_message.cc).
#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>

#include "common/check.h"
#include "thdpack/wire.h"
#include "thdpack/step_wire.h"
#include "wire/coding.h"
#include "wire/step_meta_body.h"

namespace thdpack {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// The coding byte of a microbatch: bits 0-4 k_len, bits 5-6 the padding mode, bit 7 set when a
// valid_deficit varint follows (clear: the deficit is 0, the pretraining case).
constexpr uint8_t kKLenMask = 0x1F;
constexpr int kModeShift = 5;
constexpr uint8_t kModeMask = 0x03;
constexpr uint8_t kDeficitFlag = 0x80;
// Padding modes.
constexpr uint8_t kPaddingDerived = 0;      // P_i = roundup(L_i, m) for every sequence
constexpr uint8_t kPaddingDerivedTail = 1;  // the same, and the last gets + tail (a varint)
constexpr uint8_t kPaddingExplicit = 2;     // P_i - L_i Rice-coded for every sequence
constexpr uint8_t kFlagSp = 0x01;
// Version 3 only: the version 2 additions (domain_rank, a group per microbatch) follow.
constexpr uint8_t kFlagGroups = 0x02;
// Smallest encoding of a microbatch: n, coding, and codes of at least one byte (n >= 1 code of
// >= 1 bit).
constexpr size_t kMinMicrobatchBytes = 3;

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

std::string Mb(size_t m) { return "StepMeta.microbatches[" + std::to_string(m) + "]."; }
std::string Seq(size_t i) { return " (sequence " + std::to_string(i) + ")"; }
std::string Num(int64_t v) { return std::to_string(v); }

Status Invalid(std::string msg) { return Status::InvalidArgument(std::move(msg)); }

// Microbatch m under `layout` (meta.parallel, or its group's layout in version 2).
Status ValidateMicrobatch(const StepMeta& meta, const ParallelLayout& layout, size_t m,
                          int64_t* sum_sq) {
  const MicrobatchMeta& mb = meta.microbatches[m];
  const auto& cu = mb.cu_seqlens;
  const auto& cup = mb.cu_seqlens_padded;
  if (cu.size() < 2) {
    return Invalid(Mb(m) + "cu_seqlens has " + Num(static_cast<int64_t>(cu.size())) +
                   " entries: a microbatch holds at least one sequence (n+1 >= 2 entries)");
  }
  if (cup.size() != cu.size()) {
    return Invalid(Mb(m) + "cu_seqlens_padded has " + Num(static_cast<int64_t>(cup.size())) +
                   " entries but cu_seqlens has " + Num(static_cast<int64_t>(cu.size())) +
                   ": both hold n+1 offsets");
  }
  if (cu[0] != 0) return Invalid(Mb(m) + "cu_seqlens[0] = " + Num(cu[0]) + ": must start at 0");
  if (cup[0] != 0) {
    return Invalid(Mb(m) + "cu_seqlens_padded[0] = " + Num(cup[0]) + ": must start at 0");
  }
  const size_t n = cu.size() - 1;
  const int64_t pm = layout.sequence_alignment();
  const int64_t c = layout.zigzag_multiple();
  int64_t max_p = 0;
  int64_t sq = 0;  // <= T^2 < 2^62: no overflow inside one microbatch
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = int64_t{cu[i + 1]} - cu[i];
    const int64_t p = int64_t{cup[i + 1]} - cup[i];
    if (len < 1) {
      return Invalid(Mb(m) + "cu_seqlens" + Seq(i) + ": cu_seqlens[" + Num(int64_t(i) + 1) +
                     "] = " + Num(cu[i + 1]) + " is not greater than cu_seqlens[" +
                     Num(int64_t(i)) + "] = " + Num(cu[i]) +
                     ": offsets must be strictly increasing (every length >= 1)");
    }
    if (p < len) {
      return Invalid(Mb(m) + "cu_seqlens_padded" + Seq(i) + ": padded length " + Num(p) +
                     " is smaller than the real length " + Num(len));
    }
    if (i + 1 < n) {
      if (p % pm != 0) {
        return Invalid(Mb(m) + "cu_seqlens_padded" + Seq(i) + ": padded length " + Num(p) +
                       " is not a multiple of pad_multiple " + Num(pm) +
                       " (only the last sequence may carry tail padding)");
      }
    } else {
      if (p < RoundUp(len, pm)) {
        return Invalid(Mb(m) + "cu_seqlens_padded" + Seq(i) + ": padded length " + Num(p) +
                       " of the last sequence is below roundup(" + Num(len) + ", pad_multiple " +
                       Num(pm) + ") = " + Num(RoundUp(len, pm)));
      }
      if (p % c != 0) {
        return Invalid(Mb(m) + "cu_seqlens_padded" + Seq(i) + ": padded length " + Num(p) +
                       " of the last sequence is not a multiple of 2*cp_size = " + Num(c) +
                       " (zigzag chunks)");
      }
    }
    max_p = std::max(max_p, p);
    sq += p * p;
  }
  if (mb.max_seqlen != max_p) {
    return Invalid(Mb(m) + "max_seqlen = " + Num(mb.max_seqlen) +
                   ": must equal the largest padded length " + Num(max_p));
  }
  const int64_t t = cup[n];
  const int64_t cp_tp = int64_t{layout.cp_size()} * layout.tp_size();
  if (layout.sp() && t % cp_tp != 0) {
    return Invalid(Mb(m) + "cu_seqlens_padded: total " + Num(t) +
                   " is not a multiple of cp_size*tp_size = " + Num(cp_tp) +
                   ", required with sp (T/CP a multiple of TP)");
  }
  if (t % layout.rank_quantum() != 0) {
    return Invalid(Mb(m) + "cu_seqlens_padded: total " + Num(t) + " is not a multiple of " +
                   Num(layout.rank_quantum()) + ": each of the " + Num(layout.split_ranks()) +
                   " ranks T is split over must hold a multiple of rank_multiple " +
                   Num(layout.rank_multiple()) + " tokens");
  }
  const int64_t max_valid = int64_t{cu[n]} - static_cast<int64_t>(n);
  if (mb.n_valid < 0 || mb.n_valid > max_valid) {
    return Invalid(Mb(m) + "n_valid = " + Num(mb.n_valid) + ": must be in [0, " +
                   Num(max_valid) + "] (real tokens minus sequences: token 0 is never a target)");
  }
  *sum_sq = sq;
  return Status::Ok();
}

// The layout of group size c: `parallel` with CP = c.
Result<ParallelLayout> GroupLayoutOf(const ParallelLayout& parallel, int64_t c) {
  if (c < 1 || c > kInt32Max) return Invalid("group size " + Num(c) + " out of range");
  return ParallelLayout::Create(static_cast<int>(c), parallel.tp_size(), parallel.sp(),
                                parallel.extra_alignment(), parallel.rank_multiple());
}

// Version 2's rules on groups and domain_rank; `layouts` gets each microbatch's layout.
Status ValidateGroups(const StepMeta& meta, std::vector<ParallelLayout>* layouts) {
  const size_t num_mb = meta.microbatches.size();
  layouts->assign(num_mb, meta.parallel);
  if (meta.groups.empty()) {
    if (meta.domain_rank != 0) {
      return Invalid("StepMeta.domain_rank = " + Num(meta.domain_rank) +
                     ": must be 0 without groups (a static step)");
    }
    return Status::Ok();
  }
  if (meta.groups.size() != num_mb) {
    return Invalid("StepMeta.groups has " + Num(static_cast<int64_t>(meta.groups.size())) +
                   " entries for " + Num(static_cast<int64_t>(num_mb)) +
                   " microbatches: one group per microbatch");
  }
  const int64_t cp = meta.parallel.cp_size();
  const int64_t domain = int64_t{meta.dp_size} * cp;
  if (meta.domain_rank < 0 || meta.domain_rank >= domain ||
      meta.domain_rank / cp != meta.replica) {
    return Invalid("StepMeta.domain_rank = " + Num(meta.domain_rank) + ": must be in [" +
                   Num(meta.replica * cp) + ", " + Num((meta.replica + 1) * cp) +
                   ") (replica " + Num(meta.replica) + " of a domain of DP*CP = " + Num(domain) +
                   " ranks)");
  }
  for (size_t m = 0; m < num_mb; ++m) {
    const MicrobatchGroup& g = meta.groups[m];
    const std::string at = "StepMeta.groups[" + std::to_string(m) + "]";
    if (g.num_ranks == 0) {
      const MicrobatchMeta& mb = meta.microbatches[m];
      if (mb.cu_seqlens != std::vector<int32_t>{0} ||
          mb.cu_seqlens_padded != std::vector<int32_t>{0} || mb.max_seqlen != 0 ||
          mb.n_valid != 0) {
        return Invalid(Mb(m) + "cu_seqlens: an idle microbatch (" + at +
                       ".num_ranks = 0) holds no sequence: cu_seqlens = cu_seqlens_padded = {0}, "
                       "max_seqlen = n_valid = 0");
      }
      if (g.first_rank != 0) {
        return Invalid(at + ".first_rank = " + Num(g.first_rank) + ": must be 0 when idle");
      }
      continue;
    }
    if (g.num_ranks < 0 || g.first_rank < 0 ||
        int64_t{g.first_rank} + g.num_ranks > domain) {
      return Invalid(at + ": ranks [" + Num(g.first_rank) + ", " +
                     Num(int64_t{g.first_rank} + g.num_ranks) +
                     ") must lie inside the domain [0, " + Num(domain) + ")");
    }
    if (meta.domain_rank < g.first_rank || meta.domain_rank >= g.first_rank + g.num_ranks) {
      return Invalid(at + ": ranks [" + Num(g.first_rank) + ", " +
                     Num(int64_t{g.first_rank} + g.num_ranks) +
                     ") do not contain this rank's domain_rank " + Num(meta.domain_rank));
    }
    auto layout = GroupLayoutOf(meta.parallel, g.num_ranks);
    if (!layout.ok()) return Invalid(at + ": " + layout.status().message());
    (*layouts)[m] = *layout;
  }
  return Status::Ok();
}

}  // namespace

Status ValidateStepMeta(const StepMeta& meta) {
  if (meta.dp_size < 1) return Invalid("StepMeta.dp_size = " + Num(meta.dp_size) + ": must be >= 1");
  if (meta.replica < 0 || meta.replica >= meta.dp_size) {
    return Invalid("StepMeta.replica = " + Num(meta.replica) + ": must be in [0, dp_size = " +
                   Num(meta.dp_size) + ")");
  }
  if (meta.microbatches.empty()) {
    return Invalid("StepMeta.microbatches is empty: a step has at least one microbatch");
  }
  std::vector<ParallelLayout> layouts;
  THDPACK_RETURN_IF_ERROR(ValidateGroups(meta, &layouts));
  int64_t real = 0, padded = 0, sum_sq = 0, n_valid = 0;
  for (size_t m = 0; m < meta.microbatches.size(); ++m) {
    int64_t sq = 0;
    if (!meta.groups.empty() && meta.groups[m].num_ranks == 0) continue;  // idle: checked
    THDPACK_RETURN_IF_ERROR(ValidateMicrobatch(meta, layouts[m], m, &sq));
    const MicrobatchMeta& mb = meta.microbatches[m];
    // Each term is < 2^62; only the step sums can overflow.
    if (__builtin_add_overflow(real, mb.cu_seqlens.back(), &real) ||
        __builtin_add_overflow(padded, mb.cu_seqlens_padded.back(), &padded) ||
        __builtin_add_overflow(sum_sq, sq, &sum_sq) ||
        __builtin_add_overflow(n_valid, mb.n_valid, &n_valid)) {
      return Status::OutOfRange("StepMeta.microbatches[" + Num(int64_t(m)) +
                                "]: the step's token sums overflow int64");
    }
  }
  if (meta.real_tokens != real) {
    return Invalid("StepMeta.real_tokens = " + Num(meta.real_tokens) +
                   ": must equal the sum of the microbatches' cu_seqlens[n] = " + Num(real));
  }
  if (meta.padded_tokens != padded) {
    return Invalid("StepMeta.padded_tokens = " + Num(meta.padded_tokens) +
                   ": must equal the sum of the microbatches' cu_seqlens_padded[n] = " +
                   Num(padded));
  }
  if (meta.sum_sq != sum_sq) {
    return Invalid("StepMeta.sum_sq = " + Num(meta.sum_sq) +
                   ": must equal the sum of squared padded lengths = " + Num(sum_sq));
  }
  if (meta.n_loss_tokens < n_valid) {
    return Invalid("StepMeta.n_loss_tokens = " + Num(meta.n_loss_tokens) +
                   ": the global loss-token count cannot be below this replica's sum of n_valid "
                   "= " + Num(n_valid));
  }
  if (meta.skipped_ids.size() > 1) {
    std::vector<int64_t> ids = meta.skipped_ids;
    std::sort(ids.begin(), ids.end());
    auto dup = std::adjacent_find(ids.begin(), ids.end());
    if (dup != ids.end()) {
      return Invalid("StepMeta.skipped_ids: id " + Num(*dup) + " appears more than once");
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Encoding.

namespace {

void EncodeMicrobatch(const MicrobatchMeta& mb, int64_t pm, std::vector<uint32_t>* lens,
                      std::vector<uint32_t>* excess, std::vector<uint8_t>* out) {
  const auto& cu = mb.cu_seqlens;
  const auto& cup = mb.cu_seqlens_padded;
  const size_t n = cu.size() - 1;
  lens->resize(n);
  bool derived = true;
  int64_t tail = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = int64_t{cu[i + 1]} - cu[i];
    const int64_t p = int64_t{cup[i + 1]} - cup[i];
    (*lens)[i] = static_cast<uint32_t>(len - 1);
    const int64_t rounded = RoundUp(len, pm);
    if (i + 1 < n) {
      derived = derived && p == rounded;
    } else {
      derived = derived && p >= rounded;
      tail = p - rounded;
    }
  }
  // n_valid is sent as its shortfall from "every position but the first of each sequence is a
  // target", so pretraining (no shortfall) costs nothing.
  const uint64_t deficit =
      static_cast<uint64_t>(int64_t{cu[n]} - static_cast<int64_t>(n) - mb.n_valid);
  const wire::RiceChoice len_code = wire::ChooseRiceParameter(*lens);
  wire::RiceChoice pad_code;
  if (!derived) {
    excess->resize(n);
    for (size_t i = 0; i < n; ++i) {
      (*excess)[i] = static_cast<uint32_t>((int64_t{cup[i + 1]} - cup[i]) -
                                           (int64_t{cu[i + 1]} - cu[i]));
    }
    pad_code = wire::ChooseRiceParameter(*excess);
  }
  const uint8_t mode = !derived ? kPaddingExplicit : tail > 0 ? kPaddingDerivedTail
                                                               : kPaddingDerived;
  wire::PutVarint64(out, n);
  out->push_back(static_cast<uint8_t>((deficit > 0 ? kDeficitFlag : 0) | (mode << kModeShift) |
                                      len_code.k));
  if (deficit > 0) wire::PutVarint64(out, deficit);
  if (mode == kPaddingDerivedTail) wire::PutVarint64(out, static_cast<uint64_t>(tail));
  if (mode == kPaddingExplicit) out->push_back(static_cast<uint8_t>(pad_code.k));
  [[maybe_unused]] const uint64_t bits = len_code.bits + (derived ? 0 : pad_code.bits);
  [[maybe_unused]] const size_t stream_start = out->size();
  wire::BitWriter writer(out);
  for (uint32_t v : *lens) writer.PutRice(v, len_code.k);
  if (!derived) {
    for (uint32_t v : *excess) writer.PutRice(v, pad_code.k);
  }
  writer.Finish();
  THDPACK_DCHECK(out->size() - stream_start == (bits + 7) / 8);
}

}  // namespace

namespace wire {

Status AppendStepMetaBody(const StepMeta& meta, uint8_t version, std::vector<uint8_t>* out) {
  const bool groups = !meta.groups.empty();
  // Versions 3 and 4 carry the rank multiple, and the groups under a flag.
  const bool with_rank_multiple = version >= kStepMetaVersionRankMultiple;
  wire::PutVarint64(out, meta.step);
  wire::PutVarint64(out, meta.epoch);
  wire::PutVarint64(out, static_cast<uint64_t>(meta.dp_size));
  wire::PutVarint64(out, static_cast<uint64_t>(meta.replica));
  // The parallel layout, with the per-sequence alignment as pad_multiple (version 1 bytes).
  const ParallelLayout& parallel = meta.parallel;
  wire::PutVarint64(out, static_cast<uint64_t>(parallel.cp_size()));
  wire::PutVarint64(out, static_cast<uint64_t>(parallel.tp_size()));
  out->push_back(static_cast<uint8_t>((parallel.sp() ? kFlagSp : 0) |
                                      (with_rank_multiple && groups ? kFlagGroups : 0)));
  wire::PutVarint64(out, static_cast<uint64_t>(parallel.sequence_alignment()));
  if (with_rank_multiple) {
    wire::PutVarint64(out, static_cast<uint64_t>(parallel.rank_multiple()));
  }
  wire::PutVarint64(out, static_cast<uint64_t>(meta.real_tokens));
  wire::PutVarint64(out, static_cast<uint64_t>(meta.padded_tokens));
  wire::PutVarint64(out, static_cast<uint64_t>(meta.sum_sq));
  wire::PutVarint64(out, static_cast<uint64_t>(meta.n_loss_tokens));
  if (groups) wire::PutVarint64(out, static_cast<uint64_t>(meta.domain_rank));
  wire::PutVarint64(out, meta.microbatches.size());
  std::vector<uint32_t> lens, excess;
  for (size_t m = 0; m < meta.microbatches.size(); ++m) {
    int64_t pm = parallel.sequence_alignment();
    if (groups) {
      // Version 2 (and 3, 4 with groups): the group first; an idle microbatch is nothing more.
      const MicrobatchGroup& g = meta.groups[m];
      wire::PutVarint64(out, static_cast<uint64_t>(g.first_rank));
      wire::PutVarint64(out, static_cast<uint64_t>(g.num_ranks));
      if (g.num_ranks == 0) continue;
      THDPACK_ASSIGN_OR_RETURN(ParallelLayout layout, GroupLayoutOf(parallel, g.num_ranks));
      pm = layout.sequence_alignment();
    }
    EncodeMicrobatch(meta.microbatches[m], pm, &lens, &excess, out);
  }
  wire::PutVarint64(out, meta.skipped_ids.size());
  uint64_t prev = 0;
  for (int64_t id : meta.skipped_ids) {
    const uint64_t cur = static_cast<uint64_t>(id);
    wire::PutVarint64(out, wire::ZigZagEncode(static_cast<int64_t>(cur - prev)));  // wraps
    prev = cur;
  }
  return Status::Ok();
}

void StartMessage(uint8_t version, std::vector<uint8_t>* out) {
  for (uint8_t b : kStepMetaMagic) out->push_back(b);
  out->push_back(version);
  wire::PutFixed32(out, 0);  // total_length, filled in by SealMessage
}

Status SealMessage(std::vector<uint8_t>* out, std::string_view who) {
  if (out->size() + 4 > std::numeric_limits<uint32_t>::max()) {
    return Status::OutOfRange(std::string(who) + ": the message would take " +
                              std::to_string(out->size() + 4) + " bytes, over 2^32-1");
  }
  wire::EncodeFixed32(out->data() + 5, static_cast<uint32_t>(out->size() + 4));
  wire::PutFixed32(out, Crc32c(*out));
  return Status::Ok();
}

}  // namespace wire

Result<std::vector<uint8_t>> EncodeStepMeta(const StepMeta& meta) {
  THDPACK_RETURN_IF_ERROR(ValidateStepMeta(meta));
  size_t sequences = 0;
  for (const auto& mb : meta.microbatches) sequences += mb.cu_seqlens.size() - 1;
  std::vector<uint8_t> out;
  out.reserve(96 + 24 * meta.microbatches.size() + 3 * sequences + 10 * meta.skipped_ids.size());
  // The oldest version that carries the step, so that a step of an older kind keeps its bytes
  // (and older readers read it): version 3 only with a rank multiple. (Version 4 is the step
  // message, thdpack/step_wire.h: the metadata with what travels beside it.)
  const bool groups = !meta.groups.empty();
  const bool rank_multiple = meta.parallel.rank_multiple() > 1;
  wire::StartMessage(rank_multiple ? kStepMetaVersionRankMultiple
                     : groups      ? kStepMetaVersionGroups
                                   : kStepMetaVersionStatic,
                     &out);
  THDPACK_RETURN_IF_ERROR(wire::AppendStepMetaBody(meta, out[4], &out));
  THDPACK_RETURN_IF_ERROR(wire::SealMessage(&out, "EncodeStepMeta"));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decoding.

namespace wire {

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08X", v);
  return buf;
}

// Reads the body of a version 1, 2 or 3 message (version 2 adds domain_rank and a group before
// each microbatch; version 3 adds rank_multiple, and the groups when its flags say so), or the
// metadata part of a version 4 message (version 3's grammar with any rank multiple >= 1; the
// rest of the body stays in the reader). Errors say `what` and the byte offset in the whole
// message.
class BodyDecoder {
 public:
  BodyDecoder(ByteReader& r, uint8_t version, std::string_view what)
      : r_(r), version_(version), groups_(version == kStepMetaVersionGroups), what_(what) {}

  Result<StepMeta> Decode() {
    StepMeta meta;
    uint64_t v = 0;
    THDPACK_RETURN_IF_ERROR(Varint("step", kNoMb, UINT64_MAX, &meta.step));
    THDPACK_RETURN_IF_ERROR(Varint("epoch", kNoMb, UINT64_MAX, &meta.epoch));
    THDPACK_RETURN_IF_ERROR(Varint("dp_size", kNoMb, kInt32Max, &v));
    meta.dp_size = static_cast<int32_t>(v);
    THDPACK_RETURN_IF_ERROR(Varint("replica", kNoMb, kInt32Max, &v));
    meta.replica = static_cast<int32_t>(v);
    uint64_t cp_size = 0, tp_size = 0, pad_multiple = 0;
    THDPACK_RETURN_IF_ERROR(Varint("cp_size", kNoMb, kInt32Max, &cp_size));
    if (cp_size < 1) return Error("cp_size", kNoMb, "is 0: must be >= 1");
    THDPACK_RETURN_IF_ERROR(Varint("tp_size", kNoMb, kInt32Max, &tp_size));
    if (tp_size < 1) return Error("tp_size", kNoMb, "is 0: must be >= 1");
    uint8_t flags = 0;
    THDPACK_RETURN_IF_ERROR(Byte("flags", kNoMb, &flags));
    const bool v3 = version_ >= kStepMetaVersionRankMultiple;  // versions 3 and 4
    const uint8_t known = v3 ? (kFlagSp | kFlagGroups) : kFlagSp;
    if ((flags & ~known) != 0) return Error("flags", kNoMb, "unknown bits set in " + Num(flags));
    if (v3) groups_ = (flags & kFlagGroups) != 0;
    THDPACK_RETURN_IF_ERROR(Varint("pad_multiple", kNoMb, kInt32Max, &pad_multiple));
    uint64_t rank_multiple = 1;
    if (v3) {
      const size_t at = r_.position();
      THDPACK_RETURN_IF_ERROR(Varint("rank_multiple", kNoMb, kInt32Max, &rank_multiple));
      // One encoding per step: without a rank multiple the writer writes version 1 or 2 (the
      // step message, version 4, carries every step, 1 included).
      if (rank_multiple < (version_ == kStepMetaVersionRankMultiple ? 2u : 1u)) {
        if (rank_multiple == 0) return Error("rank_multiple", kNoMb, "is 0: must be >= 1");
        return Status::Corruption(what_ + ": " + Where(at, "rank_multiple", kNoMb) +
                                  ": is " + Num(static_cast<int64_t>(rank_multiple)) +
                                  ": version 3 carries a rank multiple >= 2 (a step without "
                                  "one is written as version 1 or 2)");
      }
    }
    // Untrusted bytes: the layout's remaining rules (pad_multiple a multiple of 2*CP, the
    // quanta within int32) are checked here, before the microbatches, whose padded lengths
    // derive from it.
    auto parallel = ParallelLayout::FromWire(
        static_cast<int64_t>(cp_size), static_cast<int64_t>(tp_size), (flags & kFlagSp) != 0,
        static_cast<int64_t>(pad_multiple), static_cast<int64_t>(rank_multiple));
    if (!parallel.ok()) {
      return Error(v3 ? "rank_multiple" : "pad_multiple", kNoMb, parallel.status().message());
    }
    meta.parallel = *parallel;
    THDPACK_RETURN_IF_ERROR(Varint("real_tokens", kNoMb, kInt64Max, &v));
    meta.real_tokens = static_cast<int64_t>(v);
    THDPACK_RETURN_IF_ERROR(Varint("padded_tokens", kNoMb, kInt64Max, &v));
    meta.padded_tokens = static_cast<int64_t>(v);
    THDPACK_RETURN_IF_ERROR(Varint("sum_sq", kNoMb, kInt64Max, &v));
    meta.sum_sq = static_cast<int64_t>(v);
    THDPACK_RETURN_IF_ERROR(Varint("n_loss_tokens", kNoMb, kInt64Max, &v));
    meta.n_loss_tokens = static_cast<int64_t>(v);

    if (groups_) {
      const int64_t domain = int64_t{meta.dp_size} * meta.parallel.cp_size();
      THDPACK_RETURN_IF_ERROR(Varint("domain_rank", kNoMb, kInt32Max, &v));
      if (static_cast<int64_t>(v) >= domain) {
        return Error("domain_rank", kNoMb, Num(static_cast<int64_t>(v)) +
                                               " is outside the domain of DP*CP = " + Num(domain) +
                                               " ranks");
      }
      meta.domain_rank = static_cast<int32_t>(v);
    }
    uint64_t num_mb = 0;
    // Bounded by the bytes left before anything is allocated for it (an idle microbatch of
    // version 2 takes 2 bytes, any other at least kMinMicrobatchBytes).
    THDPACK_RETURN_IF_ERROR(
        Varint("num_microbatches", kNoMb,
               r_.remaining() / (groups_ ? 2 : kMinMicrobatchBytes), &num_mb));
    meta.microbatches.resize(num_mb);
    if (groups_) meta.groups.resize(num_mb);
    for (size_t m = 0; m < num_mb; ++m) {
      int64_t pm = meta.parallel.sequence_alignment();
      if (groups_) {
        const int64_t domain = int64_t{meta.dp_size} * meta.parallel.cp_size();
        uint64_t first = 0, size = 0;
        THDPACK_RETURN_IF_ERROR(Varint("group.first_rank", m, kInt32Max, &first));
        THDPACK_RETURN_IF_ERROR(Varint("group.num_ranks", m, kInt32Max, &size));
        if (static_cast<int64_t>(first + size) > domain) {
          return Error("group.num_ranks", m, "ranks [" + Num(static_cast<int64_t>(first)) +
                                                  ", " + Num(static_cast<int64_t>(first + size)) +
                                                  ") leave the domain of " + Num(domain) +
                                                  " ranks");
        }
        meta.groups[m] = MicrobatchGroup{static_cast<int32_t>(first), static_cast<int32_t>(size)};
        if (size == 0) {
          meta.microbatches[m].cu_seqlens = {0};
          meta.microbatches[m].cu_seqlens_padded = {0};
          continue;  // idle; ValidateStepMeta checks first_rank
        }
        auto layout = GroupLayoutOf(meta.parallel, static_cast<int64_t>(size));
        if (!layout.ok()) return Error("group.num_ranks", m, layout.status().message());
        pm = layout->sequence_alignment();
      }
      THDPACK_RETURN_IF_ERROR(DecodeMicrobatch(m, pm, &meta.microbatches[m]));
    }

    uint64_t num_skipped = 0;
    THDPACK_RETURN_IF_ERROR(Varint("num_skipped", kNoMb, r_.remaining(), &num_skipped));
    meta.skipped_ids.resize(num_skipped);
    uint64_t prev = 0;
    for (auto& id : meta.skipped_ids) {
      THDPACK_RETURN_IF_ERROR(Varint("skipped_ids", kNoMb, UINT64_MAX, &v));
      prev += static_cast<uint64_t>(wire::ZigZagDecode(v));  // wraps, as the encoder's delta
      id = static_cast<int64_t>(prev);
    }
    if (version_ <= kStepMetaVersionRankMultiple && r_.remaining() != 0) {
      return Error("end of body", kNoMb, Num(static_cast<int64_t>(r_.remaining())) +
                                             " bytes left over before the checksum");
    }
    return meta;
  }

 private:
  static constexpr size_t kNoMb = SIZE_MAX;

  std::string Where(size_t at, const char* field, size_t mb) const {
    std::string s = "byte " + std::to_string(kStepMetaHeaderSize + at) + " (";
    if (mb != kNoMb) s += "microbatches[" + std::to_string(mb) + "].";
    return s + field + ")";
  }
  Status Error(const char* field, size_t mb, const std::string& what) const {
    return Status::Corruption(what_ + ": " + Where(r_.position(), field, mb) + ": " + what);
  }
  Status Varint(const char* field, size_t mb, uint64_t max, uint64_t* v) {
    const size_t at = r_.position();
    if (!r_.GetVarint64(v)) {
      return Status::Corruption(what_ + ": " + Where(at, field, mb) +
                                ": truncated or over-long varint");
    }
    if (*v > max) {
      return Status::Corruption(what_ + ": " + Where(at, field, mb) + ": value " +
                                std::to_string(*v) + " exceeds its limit " + std::to_string(max));
    }
    return Status::Ok();
  }
  Status Byte(const char* field, size_t mb, uint8_t* v) {
    if (!r_.GetByte(v)) return Error(field, mb, "truncated");
    return Status::Ok();
  }

  Status DecodeMicrobatch(size_t m, int64_t pm, MicrobatchMeta* mb) {
    uint64_t n = 0, deficit = 0, v = 0;
    THDPACK_RETURN_IF_ERROR(Varint("num_sequences", m, kInt32Max, &n));
    if (n < 1) return Error("num_sequences", m, "is 0: a microbatch holds at least one sequence");
    uint8_t coding = 0, k_pad = 0;
    int64_t tail = 0;
    THDPACK_RETURN_IF_ERROR(Byte("coding", m, &coding));
    const uint8_t mode = (coding >> kModeShift) & kModeMask;
    const int k_len = coding & kKLenMask;
    if (mode > kPaddingExplicit) {
      return Error("coding", m, "unknown padding mode " + Num(mode) + " in coding byte " +
                                    Num(coding) + " (0 derived, 1 derived + tail, 2 explicit)");
    }
    if ((coding & kDeficitFlag) != 0) {
      THDPACK_RETURN_IF_ERROR(Varint("valid_deficit", m, kInt32Max, &deficit));
      if (deficit == 0) return Error("valid_deficit", m, "is 0 but flagged as present");
    }
    if (mode == kPaddingDerivedTail) {
      THDPACK_RETURN_IF_ERROR(Varint("tail", m, kInt32Max, &v));
      if (v == 0) return Error("tail", m, "is 0 but flagged as present");
      tail = static_cast<int64_t>(v);
    } else if (mode == kPaddingExplicit) {
      THDPACK_RETURN_IF_ERROR(Byte("k_pad", m, &k_pad));
      if (k_pad > wire::kMaxRiceParameter) {
        return Error("k_pad", m, "Rice parameter " + Num(k_pad) + " > 31");
      }
    }
    // Every code takes at least k+1 bits: bound n by the bytes left before allocating.
    const uint64_t min_bits =
        n * (k_len + 1u) + (mode == kPaddingExplicit ? n * (k_pad + 1u) : 0u);
    if (min_bits > 8 * static_cast<uint64_t>(r_.remaining())) {
      return Error("codes", m, Num(static_cast<int64_t>(n)) + " sequences need at least " +
                                   Num(static_cast<int64_t>(min_bits)) + " bits but only " +
                                   Num(static_cast<int64_t>(r_.remaining())) + " bytes remain");
    }
    wire::BitReader bits(r_.rest());

    auto& cu = mb->cu_seqlens;
    auto& cup = mb->cu_seqlens_padded;
    cu.assign(n + 1, 0);
    cup.assign(n + 1, 0);
    int64_t offset = 0;
    for (size_t i = 0; i < n; ++i) {
      uint32_t code = 0;
      if (!bits.GetRice(k_len, kInt32Max - 1, &code)) {
        return Error("codes", m, "sequence " + Num(int64_t(i)) + ": bad or truncated length code");
      }
      offset += int64_t{code} + 1;
      if (offset > kInt32Max) {
        return Error("codes", m, "sequence " + Num(int64_t(i)) + ": cu_seqlens overflows int32");
      }
      cu[i + 1] = static_cast<int32_t>(offset);
    }
    int64_t padded = 0;
    int32_t max_p = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t len = int64_t{cu[i + 1]} - cu[i];
      int64_t p = 0;
      if (mode != kPaddingExplicit) {
        p = RoundUp(len, pm) + (i + 1 == n ? tail : 0);
      } else {
        uint32_t code = 0;
        if (!bits.GetRice(k_pad, kInt32Max - 1, &code)) {
          return Error("codes", m,
                       "sequence " + Num(int64_t(i)) + ": bad or truncated padding code");
        }
        p = len + code;
      }
      padded += p;
      if (padded > kInt32Max) {
        return Error("codes", m,
                     "sequence " + Num(int64_t(i)) + ": cu_seqlens_padded overflows int32");
      }
      cup[i + 1] = static_cast<int32_t>(padded);
      max_p = std::max(max_p, static_cast<int32_t>(p));
    }
    if (!bits.PaddingBitsZero()) {
      return Error("codes", m, "non-zero padding bits after the last code");
    }
    r_.Skip(bits.BytesUsed());  // cannot fail: the reader saw only these bytes
    const int64_t max_valid = offset - static_cast<int64_t>(n);
    if (static_cast<int64_t>(deficit) > max_valid) {
      return Error("valid_deficit", m, Num(static_cast<int64_t>(deficit)) +
                                           " exceeds the real tokens minus sequences, " +
                                           Num(max_valid));
    }
    mb->n_valid = max_valid - static_cast<int64_t>(deficit);
    mb->max_seqlen = max_p;
    return Status::Ok();
  }

  wire::ByteReader& r_;
  uint8_t version_;
  bool groups_;  // the version 2 additions follow (version 2, or 3 and 4 with kFlagGroups)
  std::string what_;
};

Result<StepMeta> ReadStepMetaBody(ByteReader& r, uint8_t version, std::string_view what) {
  BodyDecoder decoder(r, version, what);
  return decoder.Decode();
}

Result<uint8_t> OpenMessage(std::span<const uint8_t> bytes, std::string_view what_view) {
  const std::string what(what_view);
  if (bytes.size() < kStepMetaMinSize) {
    return Status::Corruption(what + ": " + std::to_string(bytes.size()) +
                              " bytes is shorter than the smallest message (" +
                              std::to_string(kStepMetaMinSize) + "): truncated");
  }
  THDPACK_ASSIGN_OR_RETURN(const uint32_t total, StepMetaMessageSize(bytes));
  if (total != bytes.size()) {
    return Status::Corruption(what + ": total_length says " + std::to_string(total) +
                              " bytes but " + std::to_string(bytes.size()) + " were given (" +
                              (total > bytes.size() ? "truncated" : "trailing bytes") + ")");
  }
  const size_t body_end = bytes.size() - 4;
  const uint32_t stored = DecodeFixed32(bytes.data() + body_end);
  const uint32_t actual = Crc32c(bytes.first(body_end));
  if (stored != actual) {
    return Status::Corruption(what + ": checksum mismatch: trailer says " + Hex32(stored) +
                              ", bytes give " + Hex32(actual));
  }
  // The checksum holds, so the version byte is what the writer wrote.
  const uint8_t version = bytes[4];
  if (version == 0) {
    return Status::Corruption(what + ": byte 4: version 0 does not exist (first is 1)");
  }
  if (version > kStepMessageVersion) {
    return Status::Unimplemented(what + ": version " + std::to_string(version) +
                                 " is newer than this reader, which reads versions 1 to " +
                                 std::to_string(kStepMessageVersion) +
                                 "; upgrade thdpack on the receiving ranks");
  }
  return version;
}

}  // namespace wire

Result<uint32_t> StepMetaMessageSize(std::span<const uint8_t> prefix) {
  if (prefix.size() < kStepMetaHeaderSize) {
    return Status::InvalidArgument("StepMetaMessageSize: needs the first " +
                                   std::to_string(kStepMetaHeaderSize) + " bytes, got " +
                                   std::to_string(prefix.size()));
  }
  if (!std::equal(std::begin(kStepMetaMagic), std::end(kStepMetaMagic), prefix.begin())) {
    return Status::Corruption("step metadata: bytes 0-3: bad magic " +
                              wire::Hex32(wire::DecodeFixed32(prefix.data())) +
                              " (expected \"THDM\", 0x4D444854 read little-endian)");
  }
  const uint32_t total = wire::DecodeFixed32(prefix.data() + 5);
  if (total < kStepMetaMinSize) {
    return Status::Corruption("step metadata: bytes 5-8: total_length " + std::to_string(total) +
                              " is below the minimum " + std::to_string(kStepMetaMinSize));
  }
  return total;
}

Result<StepMeta> DecodeStepMeta(std::span<const uint8_t> bytes) {
  THDPACK_ASSIGN_OR_RETURN(const uint8_t version, wire::OpenMessage(bytes, "step metadata"));
  // A step message (version 4) carries a StepMeta with the step's other parts: all of it is
  // decoded and checked, the metadata returned.
  if (version == kStepMessageVersion) {
    THDPACK_ASSIGN_OR_RETURN(StepMessage message, DecodeStepMessage(bytes));
    return std::move(message.meta);
  }
  // One case per version ever written; old cases are kept so old messages stay readable.
  wire::ByteReader r(bytes.subspan(kStepMetaHeaderSize, bytes.size() - 4 - kStepMetaHeaderSize));
  THDPACK_ASSIGN_OR_RETURN(StepMeta meta, wire::ReadStepMetaBody(r, version, "step metadata"));
  if (Status s = ValidateStepMeta(meta); !s.ok()) {
    return Status::Corruption("step metadata: decoded values break a rule: " + s.message());
  }
  return meta;
}

}  // namespace thdpack
