// Packing and fused pack + CP shard (thdpack/pack.h).
//
// Every writer is built from one primitive, WriteRange: it writes padded positions [a, a+n) of
// one sequence as a handful of block operations - a memcpy of the real tokens and a fill of
// pad_id, an iota of position ids, a memcpy of tokens shifted by one for labels and a fill of
// kIgnoreIndex, the same for the loss mask - so no per-token branch is taken. Pack writes each
// sequence as one range; the fused shard writes each of a sequence's two zigzag chunks as one
// range straight into the rank's buffers, never materialising the [T] arrays.
#include "thdpack/pack.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "common/copy_kernels.h"
#include "thdpack/shard.h"

namespace thdpack {
namespace {

using internal::Copy;
using internal::Set;

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

std::string Str(int64_t v) { return std::to_string(v); }

std::string SampleName(size_t i, const SampleView& s) {
  return "samples[" + Str(static_cast<int64_t>(i)) + "] (id " + Str(s.id) + ")";
}

// Sum of n bytes known to be 0/1, or'ing every byte into *bits so a caller can tell whether
// any byte was larger. Eight bytes at a time: with bytes of 0/1, the top byte of w * 0x0101..
// is their sum (at most 8, so no carry crosses a byte).
int64_t SumMaskBytes(const uint8_t* p, int64_t n, uint64_t* bits) {
  int64_t sum = 0;
  uint64_t acc = 0;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t w;
    std::memcpy(&w, p + k, sizeof(w));
    acc |= w;
    sum += static_cast<int64_t>((w * 0x0101010101010101ULL) >> 56);
  }
  for (; k < n; ++k) {
    acc |= p[k];
    sum += p[k];
  }
  *bits |= acc;
  return sum;
}

// Checks every sample (length >= 1, target_mask empty or [L] of 0/1) and returns the
// microbatch's n_valid = sum of n_targets.
Result<int64_t> ValidateSamples(std::span<const SampleView> samples) {
  if (samples.empty()) {
    return Status::InvalidArgument("samples is empty: a microbatch needs at least one sample");
  }
  int64_t n_valid = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const SampleView& s = samples[i];
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    if (len < 1) {
      return Status::InvalidArgument(SampleName(i, s) +
                                     ": has no tokens: a sequence length must be >= 1");
    }
    // Token ids lie in [0, 2^31): a negative one would become a label (-100 is the ignore
    // index) and silently change what the loss counts. One branch-free pass (vectorised).
    TokenId lowest = 0;
    for (const TokenId t : s.tokens) lowest = std::min(lowest, t);
    if (lowest < 0) {
      const auto bad =
          std::find_if(s.tokens.begin(), s.tokens.end(), [](TokenId t) { return t < 0; });
      return Status::InvalidArgument(SampleName(i, s) + ": tokens[" +
                                     Str(bad - s.tokens.begin()) + "] = " + Str(*bad) +
                                     ": token ids must lie in [0, 2^31)");
    }
    if (s.target_mask.empty()) {
      n_valid += len - 1;
      continue;
    }
    if (static_cast<int64_t>(s.target_mask.size()) != len) {
      return Status::InvalidArgument(
          SampleName(i, s) + ": target_mask has " + Str(int64_t(s.target_mask.size())) +
          " values: it must be empty (all ones) or hold one per token, L = " + Str(len));
    }
    uint64_t bits = s.target_mask[0];
    n_valid += SumMaskBytes(s.target_mask.data() + 1, len - 1, &bits);
    if ((bits & 0xFEFEFEFEFEFEFEFEULL) != 0) {
      for (int64_t j = 0; j < len; ++j) {
        if (s.target_mask[j] > 1) {
          return Status::InvalidArgument(SampleName(i, s) + ": target_mask[" + Str(j) +
                                         "] = " + Str(s.target_mask[j]) +
                                         ": values must be 0 or 1");
        }
      }
    }
  }
  return n_valid;
}

// Checks that layout describes these samples under these options (see PackInto's contract).
Status ValidateLayout(std::span<const SampleView> samples, const Layout& layout,
                      const PackOptions& o) {
  const size_t n = samples.size();
  if (layout.cu_seqlens.size() != n + 1 || layout.cu_seqlens_padded.size() != n + 1) {
    return Status::InvalidArgument(
        "layout has " + Str(int64_t(layout.cu_seqlens.size())) + " cu_seqlens and " +
        Str(int64_t(layout.cu_seqlens_padded.size())) +
        " cu_seqlens_padded entries: both must hold n+1 = " + Str(int64_t(n + 1)) +
        " for " + Str(int64_t(n)) + " samples");
  }
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(layout.cu_seqlens_padded, o.parallel.cp_size())
                              .WithContext("layout"));
  const auto& cu = layout.cu_seqlens;
  const auto& cp = layout.cu_seqlens_padded;
  if (cu[0] != 0) {
    return Status::InvalidArgument("layout.cu_seqlens[0] = " + Str(cu[0]) + ": must be 0");
  }
  int64_t max_padded = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = static_cast<int64_t>(samples[i].tokens.size());
    const int64_t real = int64_t{cu[i + 1]} - cu[i];
    const int64_t padded = int64_t{cp[i + 1]} - cp[i];
    if (real != len) {
      return Status::InvalidArgument("layout.cu_seqlens[" + Str(int64_t(i + 1)) +
                                     "] - cu_seqlens[" + Str(int64_t(i)) + "] = " + Str(real) +
                                     ": must equal the length of " + SampleName(i, samples[i]) +
                                     ", " + Str(len));
    }
    if (padded < real) {
      return Status::InvalidArgument(
          "layout.cu_seqlens_padded[" + Str(int64_t(i + 1)) + "] - cu_seqlens_padded[" +
          Str(int64_t(i)) + "] = " + Str(padded) + ": a padded length must be >= the real one, " +
          Str(real));
    }
    max_padded = std::max(max_padded, padded);
  }
  if (layout.total_tokens != cp[n]) {
    return Status::InvalidArgument("layout.total_tokens = " + Str(layout.total_tokens) +
                                   ": must equal cu_seqlens_padded[n] = " + Str(cp[n]));
  }
  if (layout.max_seqlen != max_padded) {
    return Status::InvalidArgument("layout.max_seqlen = " + Str(layout.max_seqlen) +
                                   ": must be the largest padded length, " + Str(max_padded));
  }
  const int64_t cp_tp = int64_t{o.parallel.cp_size()} * o.parallel.tp_size();
  if (o.parallel.splits_over_tp() && layout.total_tokens % cp_tp != 0) {
    return Status::InvalidArgument("layout.total_tokens = " + Str(layout.total_tokens) +
                                   ": with sp, T/CP must be a multiple of tp_size = " +
                                   Str(o.parallel.tp_size()) + " (T a multiple of CP*TP = " +
                                   Str(cp_tp) + ")");
  }
  if (layout.total_tokens % o.parallel.rank_quantum() != 0) {
    return Status::InvalidArgument(
        "layout.total_tokens = " + Str(layout.total_tokens) + ": each of the " +
        Str(o.parallel.split_ranks()) + " ranks T is split over must hold a multiple of " +
        "rank_multiple = " + Str(o.parallel.rank_multiple()) + " tokens (T a multiple of " +
        Str(o.parallel.rank_quantum()) + ")");
  }
  return Status::Ok();
}

template <typename T>
Status CheckBuffer(const char* fn, const std::string& name, std::span<T> span, int64_t want,
                   const char* rule) {
  if (!span.empty() && static_cast<int64_t>(span.size()) != want) {
    return Status::InvalidArgument(std::string(fn) + ": " + name + " has " +
                                   Str(int64_t(span.size())) +
                                   " elements: it must be empty (not produced) or hold " + rule +
                                   " = " + Str(want));
  }
  return Status::Ok();
}

Status CheckBuffers(const char* fn, const std::string& name, const PackBuffers& b, int64_t want,
                    const char* rule) {
  THDPACK_RETURN_IF_ERROR(CheckBuffer(fn, name + ".tokens", b.tokens, want, rule));
  THDPACK_RETURN_IF_ERROR(CheckBuffer(fn, name + ".position_ids", b.position_ids, want, rule));
  THDPACK_RETURN_IF_ERROR(CheckBuffer(fn, name + ".labels", b.labels, want, rule));
  THDPACK_RETURN_IF_ERROR(CheckBuffer(fn, name + ".loss_mask", b.loss_mask, want, rule));
  return Status::Ok();
}

// Raw destination pointers at one output offset; null where the array is not produced.
struct Dst {
  TokenId* tokens;
  int32_t* position_ids;
  TokenId* labels;
  uint8_t* loss_mask;

  Dst At(int64_t offset) const {
    return {tokens ? tokens + offset : nullptr, position_ids ? position_ids + offset : nullptr,
            labels ? labels + offset : nullptr, loss_mask ? loss_mask + offset : nullptr};
  }
};

Dst DstOf(const PackBuffers& b) {
  return {b.tokens.empty() ? nullptr : b.tokens.data(),
          b.position_ids.empty() ? nullptr : b.position_ids.data(),
          b.labels.empty() ? nullptr : b.labels.data(),
          b.loss_mask.empty() ? nullptr : b.loss_mask.data()};
}

// Writes padded positions [a, a+n) of sample s (real length len = s.tokens.size()) to d.
inline void WriteRange(const SampleView& s, int64_t a, int64_t n, TokenId pad_id, const Dst& d) {
  if (n <= 0) return;
  const int64_t len = static_cast<int64_t>(s.tokens.size());
  // Positions [a, a+real) hold real tokens; [a, a+targets) have j+1 < L, so a label.
  const int64_t real = std::clamp<int64_t>(len - a, 0, n);
  const int64_t targets = std::clamp<int64_t>(len - 1 - a, 0, n);
  if (d.tokens != nullptr) {
    if (real > 0) Copy(d.tokens, s.tokens.data() + a, static_cast<size_t>(real) * sizeof(TokenId));
    internal::Fill32(d.tokens + real, n - real, pad_id);
  }
  if (d.position_ids != nullptr) internal::Iota32(d.position_ids, n, static_cast<int32_t>(a));
  if (d.labels != nullptr) {
    if (targets > 0) {
      Copy(d.labels, s.tokens.data() + a + 1, static_cast<size_t>(targets) * sizeof(TokenId));
    }
    internal::Fill32(d.labels + targets, n - targets, kIgnoreIndex);
  }
  if (d.loss_mask != nullptr) {
    if (targets > 0) {
      if (s.target_mask.empty()) {
        Set(d.loss_mask, 1, static_cast<size_t>(targets));
      } else {
        Copy(d.loss_mask, s.target_mask.data() + a + 1, static_cast<size_t>(targets));
      }
    }
    Set(d.loss_mask + targets, 0, static_cast<size_t>(n - targets));
  }
}

// Writes CP rank r's two zigzag chunks of sample s (padded sequence [start, start + len)) to d,
// which points at the sequence's local offset start / CP.
inline void WriteShardOfSequence(const SampleView& s, int64_t padded, int cp, int r,
                                 TokenId pad_id, const Dst& d) {
  if (cp == 1) {
    WriteRange(s, 0, padded, pad_id, d);
    return;
  }
  const int64_t c = padded / (2 * int64_t{cp});
  WriteRange(s, r * c, c, pad_id, d);
  WriteRange(s, (2 * int64_t{cp} - 1 - r) * c, c, pad_id, d.At(c));
}

}  // namespace

Result<Layout> ComputeLayout(std::span<const int64_t> lengths, const PackOptions& options) {
  if (lengths.empty()) {
    return Status::InvalidArgument("lengths is empty: a microbatch needs at least one sequence");
  }
  const ParallelLayout& parallel = options.parallel;
  Layout layout;
  layout.cu_seqlens.resize(lengths.size() + 1);
  layout.cu_seqlens_padded.resize(lengths.size() + 1);
  layout.cu_seqlens[0] = 0;
  layout.cu_seqlens_padded[0] = 0;
  int64_t real_total = 0;
  int64_t total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t len = lengths[i];
    if (len < 1) {
      return Status::InvalidArgument("lengths[" + Str(int64_t(i)) + "] = " + Str(len) +
                                     ": a sequence length must be >= 1");
    }
    if (len > kInt32Max) {
      return Status::OutOfRange("lengths[" + Str(int64_t(i)) + "] = " + Str(len) +
                                ": exceeds int32, and T must fit int32");
    }
    const int64_t padded = parallel.PaddedLength(len);
    real_total += len;
    total += padded;
    if (total > kInt32Max) {
      return Status::OutOfRange("T = " + Str(total) + " padded tokens after lengths[" +
                                Str(int64_t(i)) + "] exceeds int32 (" + Str(kInt32Max) +
                                "): T must fit int32; split the microbatch");
    }
    layout.cu_seqlens[i + 1] = static_cast<int32_t>(real_total);
    layout.cu_seqlens_padded[i + 1] = static_cast<int32_t>(total);
  }
  // The last sequence absorbs the tail that makes T a multiple of the token quantum: T/CP a
  // multiple of TP under SP, every rank's tokens a multiple of the rank multiple; or, for a
  // fixed shape, the whole way to fixed_tokens.
  int64_t rounded = parallel.MicrobatchTokens(total);
  if (options.fixed_tokens > 0) {
    if (options.fixed_tokens % parallel.token_quantum() != 0 || options.fixed_tokens < rounded) {
      return Status::InvalidArgument(
          "fixed_tokens = " + Str(options.fixed_tokens) + ": must be a multiple of the token "
          "quantum " + Str(parallel.token_quantum()) + " and hold the sequences' T = " +
          Str(rounded) + " (" + Str(int64_t(lengths.size())) + " sequences)");
    }
    rounded = options.fixed_tokens;
  }
  if (rounded > kInt32Max) {
    return Status::OutOfRange("T = " + Str(rounded) + " padded tokens after the " +
                              (parallel.rank_multiple() > 1 ? "rank-multiple" : "SP") +
                              " tail exceeds int32 (" + Str(kInt32Max) +
                              "): T must fit int32; split the microbatch");
  }
  total = rounded;
  layout.cu_seqlens_padded.back() = static_cast<int32_t>(total);
  int64_t max_padded = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    max_padded = std::max<int64_t>(
        max_padded, int64_t{layout.cu_seqlens_padded[i + 1]} - layout.cu_seqlens_padded[i]);
  }
  layout.max_seqlen = static_cast<int32_t>(max_padded);
  layout.total_tokens = total;
  return layout;
}

Result<std::vector<int32_t>> PadOffsets(std::span<const int32_t> offsets, int64_t count) {
  if (offsets.empty()) return Status::InvalidArgument("PadOffsets: offsets are empty (n+1 >= 1)");
  if (count < 0 || static_cast<int64_t>(offsets.size()) - 1 > count) {
    return Status::InvalidArgument("PadOffsets: " + Str(int64_t(offsets.size()) - 1) +
                                   " sequences do not fit a fixed count of " + Str(count));
  }
  std::vector<int32_t> out(offsets.begin(), offsets.end());
  out.resize(static_cast<size_t>(count) + 1, offsets.back());
  return out;
}

Result<int64_t> PackInto(std::span<const SampleView> samples, const Layout& layout,
                         const PackOptions& options, const PackBuffers& out) {
  THDPACK_ASSIGN_OR_RETURN(const int64_t n_valid, ValidateSamples(samples));
  THDPACK_RETURN_IF_ERROR(ValidateLayout(samples, layout, options));
  THDPACK_RETURN_IF_ERROR(CheckBuffers("PackInto", "out", out, layout.total_tokens, "T"));
  const Dst d = DstOf(out);
  const auto& cu = layout.cu_seqlens_padded;
  for (size_t i = 0; i < samples.size(); ++i) {
    WriteRange(samples[i], 0, int64_t{cu[i + 1]} - cu[i], options.pad_id, d.At(cu[i]));
  }
  return n_valid;
}

Result<int64_t> PackShardInto(std::span<const SampleView> samples, const Layout& layout,
                              const PackOptions& options, int cp_rank, const PackBuffers& out) {
  THDPACK_ASSIGN_OR_RETURN(const int64_t n_valid, ValidateSamples(samples));
  THDPACK_RETURN_IF_ERROR(ValidateLayout(samples, layout, options));
  const int cp = options.parallel.cp_size();
  if (cp_rank < 0 || cp_rank >= cp) {
    return Status::InvalidArgument("PackShardInto: cp_rank = " + Str(cp_rank) +
                                   ": must be in [0, cp_size = " + Str(cp) + ")");
  }
  THDPACK_RETURN_IF_ERROR(
      CheckBuffers("PackShardInto", "out", out, layout.total_tokens / cp, "T/CP"));
  const Dst d = DstOf(out);
  const auto& cu = layout.cu_seqlens_padded;
  for (size_t i = 0; i < samples.size(); ++i) {
    WriteShardOfSequence(samples[i], int64_t{cu[i + 1]} - cu[i], cp, cp_rank, options.pad_id,
                         d.At(cu[i] / cp));
  }
  return n_valid;
}

Result<int64_t> PackShardAllInto(std::span<const SampleView> samples, const Layout& layout,
                                 const PackOptions& options, std::span<const PackBuffers> out) {
  THDPACK_ASSIGN_OR_RETURN(const int64_t n_valid, ValidateSamples(samples));
  THDPACK_RETURN_IF_ERROR(ValidateLayout(samples, layout, options));
  const int cp = options.parallel.cp_size();
  if (static_cast<int64_t>(out.size()) != cp) {
    return Status::InvalidArgument("PackShardAllInto: out has " + Str(int64_t(out.size())) +
                                   " entries: it needs one per CP rank, cp_size = " + Str(cp));
  }
  // Few ranks (CP <= a few dozen): a small fixed array keeps this path allocation-free.
  constexpr int kStackRanks = 64;
  Dst stack_dst[kStackRanks];
  std::vector<Dst> heap_dst;
  Dst* dst = stack_dst;
  if (cp > kStackRanks) {
    heap_dst.resize(static_cast<size_t>(cp));
    dst = heap_dst.data();
  }
  for (int r = 0; r < cp; ++r) {
    THDPACK_RETURN_IF_ERROR(CheckBuffers("PackShardAllInto", "out[" + Str(r) + "]", out[r],
                                         layout.total_tokens / cp, "T/CP"));
    dst[r] = DstOf(out[r]);
  }
  const auto& cu = layout.cu_seqlens_padded;
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t padded = int64_t{cu[i + 1]} - cu[i];
    const int64_t local = cu[i] / cp;
    for (int r = 0; r < cp; ++r) {
      WriteShardOfSequence(samples[i], padded, cp, r, options.pad_id, dst[r].At(local));
    }
  }
  return n_valid;
}

namespace {

// Lengths of validated samples, for ComputeLayout.
std::vector<int64_t> LengthsOf(std::span<const SampleView> samples) {
  std::vector<int64_t> lengths(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    lengths[i] = static_cast<int64_t>(samples[i].tokens.size());
  }
  return lengths;
}

PackBuffers BuffersOf(PackedShard& s) {
  return {s.tokens, s.position_ids, s.labels, s.loss_mask};
}

void Allocate(PackedShard& s, int64_t size) {
  const size_t n = static_cast<size_t>(size);
  s.tokens.resize(n);
  s.position_ids.resize(n);
  s.labels.resize(n);
  s.loss_mask.resize(n);
}

}  // namespace

Result<PackedMicrobatch> Pack(std::span<const SampleView> samples, const PackOptions& options) {
  // Samples first, so that a bad sample is reported by its id rather than as lengths[i].
  THDPACK_RETURN_IF_ERROR(ValidateSamples(samples).status());
  THDPACK_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(LengthsOf(samples), options));
  PackedMicrobatch mb;
  const size_t t = static_cast<size_t>(layout.total_tokens);
  mb.tokens.resize(t);
  mb.position_ids.resize(t);
  mb.labels.resize(t);
  mb.loss_mask.resize(t);
  THDPACK_ASSIGN_OR_RETURN(
      mb.n_valid, PackInto(samples, layout, options,
                           PackBuffers{mb.tokens, mb.position_ids, mb.labels, mb.loss_mask}));
  mb.cu_seqlens = std::move(layout.cu_seqlens);
  mb.cu_seqlens_padded = std::move(layout.cu_seqlens_padded);
  mb.max_seqlen = layout.max_seqlen;
  return mb;
}

Result<ShardedMicrobatch> PackAndShard(std::span<const SampleView> samples,
                                       const PackOptions& options, int cp_rank) {
  THDPACK_RETURN_IF_ERROR(ValidateSamples(samples).status());
  ShardedMicrobatch sm;
  THDPACK_ASSIGN_OR_RETURN(sm.layout, ComputeLayout(LengthsOf(samples), options));
  if (cp_rank < 0 || cp_rank >= options.parallel.cp_size()) {
    return Status::InvalidArgument("PackAndShard: cp_rank = " + Str(cp_rank) +
                                   ": must be in [0, cp_size = " +
                                   Str(options.parallel.cp_size()) + ")");
  }
  sm.shards.resize(1);
  sm.shards[0].cp_rank = cp_rank;
  Allocate(sm.shards[0], sm.layout.total_tokens / options.parallel.cp_size());
  THDPACK_ASSIGN_OR_RETURN(
      sm.n_valid, PackShardInto(samples, sm.layout, options, cp_rank, BuffersOf(sm.shards[0])));
  return sm;
}

Result<ShardedMicrobatch> PackAndShardAll(std::span<const SampleView> samples,
                                          const PackOptions& options) {
  THDPACK_RETURN_IF_ERROR(ValidateSamples(samples).status());
  ShardedMicrobatch sm;
  THDPACK_ASSIGN_OR_RETURN(sm.layout, ComputeLayout(LengthsOf(samples), options));
  const int cp = options.parallel.cp_size();
  sm.shards.resize(static_cast<size_t>(cp));
  std::vector<PackBuffers> buffers(static_cast<size_t>(cp));
  for (int r = 0; r < cp; ++r) {
    sm.shards[r].cp_rank = r;
    Allocate(sm.shards[r], sm.layout.total_tokens / cp);
    buffers[r] = BuffersOf(sm.shards[r]);
  }
  THDPACK_ASSIGN_OR_RETURN(sm.n_valid, PackShardAllInto(samples, sm.layout, options, buffers));
  return sm;
}

Status ToHfLabels(std::span<const TokenId> labels, std::span<const uint8_t> loss_mask,
                  std::span<const int32_t> cu_seqlens_padded, std::span<TokenId> hf_labels,
                  std::span<uint8_t> hf_loss_mask) {
  THDPACK_RETURN_IF_ERROR(
      ValidateCuSeqlensPadded(cu_seqlens_padded, 1).WithContext("ToHfLabels"));
  const int64_t t = cu_seqlens_padded.back();
  const std::pair<const char*, size_t> sizes[] = {{"labels", labels.size()},
                                                  {"loss_mask", loss_mask.size()},
                                                  {"hf_labels", hf_labels.size()},
                                                  {"hf_loss_mask", hf_loss_mask.size()}};
  for (const auto& [name, size] : sizes) {
    if (static_cast<int64_t>(size) != t) {
      return Status::InvalidArgument("ToHfLabels: " + std::string(name) + " has " +
                                     Str(static_cast<int64_t>(size)) +
                                     " elements: it must hold T = cu_seqlens_padded[n] = " +
                                     Str(t));
    }
  }
  for (size_t j = 0; j < loss_mask.size(); ++j) {
    if (loss_mask[j] > 1) {
      return Status::InvalidArgument("ToHfLabels: loss_mask[" + Str(static_cast<int64_t>(j)) +
                                     "] = " + Str(loss_mask[j]) + ": values must be 0 or 1");
    }
  }
  // Backwards, sequence after sequence, so that position j - 1 is read before it is written
  // (in place).
  for (size_t i = cu_seqlens_padded.size() - 1; i-- > 0;) {
    const int64_t start = cu_seqlens_padded[i];
    for (int64_t j = cu_seqlens_padded[i + 1] - 1; j > start; --j) {
      const uint8_t target = loss_mask[static_cast<size_t>(j - 1)];
      hf_labels[static_cast<size_t>(j)] =
          target != 0 ? labels[static_cast<size_t>(j - 1)] : kIgnoreIndex;
      hf_loss_mask[static_cast<size_t>(j)] = target;
    }
    hf_labels[static_cast<size_t>(start)] = kIgnoreIndex;
    hf_loss_mask[static_cast<size_t>(start)] = 0;
  }
  return Status::Ok();
}

}  // namespace thdpack
