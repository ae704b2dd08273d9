// Scheduling entry points shared by both schedulers: option and input validation, the oversize
// policy, ValidatePlan and the figures of a plan.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace internal {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

// What pads a microbatch's last sequence past its own P, for messages.
std::string TailName(const ParallelLayout& l) {
  if (l.splits_over_tp()) return l.rank_multiple() > 1 ? "SP and rank-multiple tail" : "SP tail";
  return "rank-multiple tail";
}

// Sorted (id, index) pairs for id lookups without an unordered container.
std::vector<std::pair<int64_t, int64_t>> SortedIds(std::span<const SampleLength> samples) {
  std::vector<std::pair<int64_t, int64_t>> v(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) v[i] = {samples[i].id, static_cast<int64_t>(i)};
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

// Whether two samples share an id: a bitmap over the ids when they are dense (1 bit per id, so
// it stays in cache), else SampleIdIndex's sorted copy.
bool HasDuplicateIds(std::span<const SampleLength> samples) {
  if (samples.empty()) return false;
  int64_t lo = samples[0].id, hi = samples[0].id;
  for (const SampleLength& s : samples) {
    lo = std::min(lo, s.id);
    hi = std::max(hi, s.id);
  }
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
  if (range == 0 || range > 64 * static_cast<uint64_t>(samples.size()) + 65536) {
    return SampleIdIndex(samples).has_duplicates();
  }
  std::vector<uint64_t> bits(static_cast<size_t>((range + 63) / 64), 0);
  for (const SampleLength& s : samples) {
    const uint64_t k = static_cast<uint64_t>(s.id) - static_cast<uint64_t>(lo);
    const uint64_t bit = uint64_t{1} << (k % 64);
    uint64_t& word = bits[static_cast<size_t>(k / 64)];
    if (word & bit) return true;
    word |= bit;
  }
  return false;
}

}  // namespace internal

SampleIdIndex::SampleIdIndex(std::span<const SampleLength> samples) {
  const size_t n = samples.size();
  if (n == 0) return;
  int64_t lo = samples[0].id, hi = samples[0].id;
  bool fits = true;
  for (const SampleLength& s : samples) {
    lo = std::min(lo, s.id);
    hi = std::max(hi, s.id);
    fits = fits && s.length >= 1 && s.length <= std::numeric_limits<int32_t>::max() &&
           s.n_targets >= 0 && s.n_targets <= std::numeric_limits<int32_t>::max();
  }
  // Dense when the table holds at most about 4 entries per sample.
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
  if (fits && range != 0 && range <= 4 * static_cast<uint64_t>(n) + 1024) {
    dense_ = true;
    min_id_ = lo;
    table_.assign(static_cast<size_t>(range), DenseEntry{0, 0});
    constexpr size_t kAhead = 16;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        __builtin_prefetch(&table_[static_cast<size_t>(static_cast<uint64_t>(samples[i + kAhead].id) -
                                                       static_cast<uint64_t>(lo))], 1);
      }
      const SampleLength& s = samples[i];
      DenseEntry& e = table_[static_cast<size_t>(static_cast<uint64_t>(s.id) -
                                                 static_cast<uint64_t>(lo))];
      if (e.length > 0) {
        has_duplicates_ = true;
      } else {
        e = {static_cast<int32_t>(s.length), static_cast<int32_t>(s.n_targets)};
      }
    }
    return;
  }
  sorted_.assign(samples.begin(), samples.end());
  std::stable_sort(sorted_.begin(), sorted_.end(),
                   [](const SampleLength& x, const SampleLength& y) { return x.id < y.id; });
  size_t out = 0;
  for (size_t i = 0; i < sorted_.size(); ++i) {
    if (out > 0 && sorted_[out - 1].id == sorted_[i].id) {
      has_duplicates_ = true;
      continue;
    }
    sorted_[out++] = sorted_[i];
  }
  sorted_.resize(out);
}

int64_t SampleIdIndex::SortedSlot(int64_t id) const {
  auto it = std::lower_bound(sorted_.begin(), sorted_.end(), id,
                             [](const SampleLength& s, int64_t v) { return s.id < v; });
  if (it == sorted_.end() || it->id != id) return -1;
  return it - sorted_.begin();
}

namespace internal {

double PreparedStep::LowerBound(int dp_size) const {
  return std::max(total_cost / static_cast<double>(dp_size), max_cost);
}

Status ValidateOptions(const ScheduleOptions& o) {
  auto bad = [](const std::string& what) {
    return Status::InvalidArgument("schedule options: " + what);
  };
  if (o.dp_size < 1) return bad("dp_size = " + Str(o.dp_size) + " must be >= 1");
  if (o.max_tokens_per_rank < 1) {
    return bad("max_tokens_per_rank = " + Str(o.max_tokens_per_rank) +
               " must be >= 1 (it is required)");
  }
  if (o.max_tokens_per_rank > std::numeric_limits<int32_t>::max() / o.parallel.cp_size()) {
    return bad("CP * max_tokens_per_rank = " + Str(o.parallel.cp_size()) + " * " +
               Str(o.max_tokens_per_rank) + " must fit int32 (a microbatch's T is int32)");
  }
  if (o.microbatch_multiple < 1) {
    return bad("microbatch_multiple = " + Str(o.microbatch_multiple) + " must be >= 1");
  }
  if (o.num_microbatches < 0 || o.num_microbatches % o.microbatch_multiple != 0) {
    return bad("num_microbatches = " + Str(o.num_microbatches) +
               " must be 0 (free) or a positive multiple of microbatch_multiple = " +
               Str(o.microbatch_multiple));
  }
  if (o.max_microbatch_search < 1) {
    return bad("max_microbatch_search = " + Str(o.max_microbatch_search) + " must be >= 1");
  }
  if (!std::isfinite(o.cost.a) || !std::isfinite(o.cost.b) || !std::isfinite(o.cost.c) ||
      o.cost.a < 0 || o.cost.b < 0 || o.cost.c < 0 ||
      (o.cost.a == 0 && o.cost.b == 0 && o.cost.c == 0)) {
    return bad("cost model '" + o.cost.name + "': a = " + std::to_string(o.cost.a) +
               ", b = " + std::to_string(o.cost.b) + ", c = " + std::to_string(o.cost.c) +
               " must be finite, >= 0 and not all 0");
  }
  if (!std::isfinite(o.encoder_cost.per_patch) || !std::isfinite(o.encoder_cost.per_frame_sq) ||
      o.encoder_cost.per_patch < 0 || o.encoder_cost.per_frame_sq < 0) {
    return bad("encoder_cost: per_patch = " + std::to_string(o.encoder_cost.per_patch) +
               ", per_frame_sq = " + std::to_string(o.encoder_cost.per_frame_sq) +
               " must be finite and >= 0");
  }
  if (o.scheduler == ScheduleOptions::Scheduler::kDynamic && !o.encoder_cost.empty()) {
    return bad("encoder_cost with the dynamic scheduler: it charges the encoder in seconds, "
               "the step-time model's term (StepTimeCoefficients::encoder), not in the cost's "
               "unit");
  }
  if (static_cast<int64_t>(o.dp_size) * o.microbatch_multiple > std::numeric_limits<int32_t>::max()) {
    return bad("dp_size * microbatch_multiple must fit int32");
  }
  if (o.max_seqs_per_microbatch < 0) {
    return bad("max_seqs_per_microbatch = " + Str(o.max_seqs_per_microbatch) +
               " must be >= 1, or 0 for no cap");
  }
  if (o.pad_to_max_tokens && MicrobatchBudget(o) % o.parallel.token_quantum() != 0) {
    return bad("pad_to_max_tokens: T = CP " + Str(o.parallel.cp_size()) +
               " x max_tokens_per_rank " + Str(o.max_tokens_per_rank) + " = " +
               Str(MicrobatchBudget(o)) + " is not a multiple of the layout's token quantum " +
               Str(o.parallel.token_quantum()) + " (" + o.parallel.ToString() +
               "): choose max_tokens_per_rank a multiple of " +
               Str(o.parallel.token_quantum() /
                   std::gcd(o.parallel.token_quantum(), int64_t{o.parallel.cp_size()})));
  }
  if (o.scheduler == ScheduleOptions::Scheduler::kDynamic &&
      (o.pad_to_max_tokens || o.max_seqs_per_microbatch > 0)) {
    return bad(std::string(o.pad_to_max_tokens ? "pad_to_max_tokens" : "max_seqs_per_microbatch") +
               " with the dynamic scheduler: static shapes are built for the static schedulers "
               "(balanced, sequential), whose microbatches all share one CP group");
  }
  return Status::Ok();
}

int64_t UsableCapacity(const ScheduleOptions& o) {
  return o.parallel.UsableBudget(MicrobatchBudget(o));
}

Result<bool> CheckEncoderWork(std::span<const SampleLength> samples,
                              std::span<const EncoderWork> encoder, bool values) {
  if (!encoder.empty() && encoder.size() != samples.size()) {
    return Status::InvalidArgument("schedule: " + std::to_string(encoder.size()) +
                                   " encoder works for " + std::to_string(samples.size()) +
                                   " samples (one a sample, or none)");
  }
  bool any = false;
  for (size_t i = 0; values && i < encoder.size(); ++i) {
    const EncoderWork& w = encoder[i];
    if (w.patches < 0 || w.frame_sq < 0) {
      return Status::InvalidArgument(
          "schedule: sample id " + Str(samples[i].id) + " (position " + std::to_string(i) +
          ") has encoder work (" + Str(w.patches) + " patches, " + Str(w.frame_sq) +
          " frame^2); both must be >= 0");
    }
    any = any || w.patches > 0 || w.frame_sq > 0;
  }
  return any;
}

Result<PreparedStep> PrepareStep(std::span<const SampleLength> samples,
                                 const ScheduleOptions& o, std::span<const EncoderWork> encoder) {
  PreparedStep step;
  // The encoder term is charged when it has a cost and some sample has work.
  THDPACK_ASSIGN_OR_RETURN(const bool charged,
                           CheckEncoderWork(samples, encoder, !o.encoder_cost.empty()));
  step.capacity = UsableCapacity(o);
  const int64_t budget = MicrobatchBudget(o);
  const int64_t align = o.parallel.sequence_alignment();
  const size_t n = samples.size();
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return Status::InvalidArgument("schedule: " + std::to_string(n) +
                                   " samples in one step; at most 2^31 - 1 are supported");
  }
  // Sized once and written by index (no push_back's capacity check per sample), shrunk to the
  // kept count at the end.
  step.ids.resize(n);
  step.length.resize(n);
  step.n_targets.resize(n);
  step.padded.resize(n);
  step.cost.resize(n);
  if (charged) {
    step.enc_patches.resize(n);
    step.enc_frame_sq.resize(n);
  }
  const int cp_size = o.parallel.cp_size();
  const double cp = static_cast<double>(cp_size);
  // cost(P) / CP as a product when CP is a power of two: x * 2^-k is x / 2^k exactly.
  const bool cp_pow2 = std::has_single_bit(static_cast<unsigned>(cp_size));
  const double inv_cp = 1.0 / cp;
  // P = roundup(L, align): a mask when align is a power of two (2*CP, the usual case), the
  // same value as PaddedLength's division.
  const bool pow2 = std::has_single_bit(static_cast<uint64_t>(align));
  // One pass checks, pads and costs every sample. Its errors keep their precedence: a bad
  // length or n_targets (the first by position) before duplicate ids before an oversize
  // sample (the first by position, policy 'error').
  size_t kept = 0;
  size_t first_oversize = n;
  // The totals in locals: the arrays' stores could alias the step's own fields.
  int64_t total_padded = 0;
  double total_cost = 0;
  double max_cost = 0;
  bool increasing = true;  // increasing ids are unique: no duplicate check then
  for (size_t i = 0; i < n; ++i) {
    const SampleLength& s = samples[i];
    if (s.length < 1 || s.length > (int64_t{1} << 50)) {
      return Status::InvalidArgument("schedule: sample id " + Str(s.id) + " (position " +
                                     std::to_string(i) + ") has length " + Str(s.length) +
                                     "; lengths must be in [1, 2^50]");
    }
    if (s.n_targets < 0 || s.n_targets > s.length) {
      return Status::InvalidArgument("schedule: sample id " + Str(s.id) + " has n_targets = " +
                                     Str(s.n_targets) + " outside [0, L = " + Str(s.length) +
                                     "]");
    }
    increasing = increasing && (i == 0 || s.id > samples[i - 1].id);
    const int64_t p = pow2 ? (s.length + align - 1) & -align : o.parallel.PaddedLength(s.length);
    THDPACK_DCHECK(p == o.parallel.PaddedLength(s.length));
    if (p > step.capacity) {
      if (o.oversize != ScheduleOptions::OversizePolicy::kSkip) {
        first_oversize = std::min(first_oversize, i);
      } else {
        step.skipped.push_back(s.id);
      }
      continue;
    }
    step.ids[kept] = s.id;
    step.length[kept] = static_cast<int32_t>(s.length);
    step.n_targets[kept] = static_cast<int32_t>(s.n_targets);
    step.padded[kept] = p;
    double c = cp_pow2 ? o.cost.SequenceCost(p) * inv_cp : o.cost.SequenceCost(p) / cp;
    if (charged) {
      step.enc_patches[kept] = encoder[i].patches;
      step.enc_frame_sq[kept] = encoder[i].frame_sq;
      c = SampleCostWithEncoder(o, p, encoder[i]);
    }
    step.cost[kept] = c;
    ++kept;
    total_padded += p;
    total_cost += c;
    max_cost = std::max(max_cost, c);
  }
  step.total_padded = total_padded;
  step.total_cost = total_cost;
  step.max_cost = max_cost;
  if (!increasing && HasDuplicateIds(samples)) {
    // The first duplicate in id order names the error (the table only says there is one).
    const auto sorted = SortedIds(samples);
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (sorted[i].first == sorted[i - 1].first) {
        return Status::InvalidArgument(
            "schedule: sample id " + Str(sorted[i].first) + " appears twice (positions " +
            Str(sorted[i - 1].second) + " and " + Str(sorted[i].second) +
            "); ids must be unique within a step");
      }
    }
  }
  if (first_oversize < n) {
    const SampleLength& s = samples[first_oversize];
    const int64_t p = o.parallel.PaddedLength(s.length);
    std::string padded = "padded " + Str(p) + " with alignment " + Str(align);
    if (p <= budget) {
      padded += ", " + Str(o.parallel.MicrobatchTokens(p)) + " with the " + TailName(o.parallel) +
                " to a multiple of " + Str(o.parallel.token_quantum());
    }
    return Status::InvalidArgument(
        "schedule: sample id " + Str(s.id) + " has length " + Str(s.length) + " (" + padded +
        "), over the microbatch budget " + Str(budget) + " = CP " + Str(o.parallel.cp_size()) +
        " x max_tokens_per_rank " + Str(o.max_tokens_per_rank) +
        (o.oversize == ScheduleOptions::OversizePolicy::kTruncate
             ? " (oversize policy 'truncate' cuts samples before they are scheduled: "
               "TruncateLengths)"
         : o.oversize == ScheduleOptions::OversizePolicy::kSplit
             ? " (oversize policy 'split' cuts samples as they are read: OpenSplitSource)"
             : " (oversize policy 'error'; 'skip' leaves such samples out)"));
  }
  if (kept < n) {
    step.ids.resize(kept);
    step.length.resize(kept);
    step.n_targets.resize(kept);
    step.padded.resize(kept);
    step.cost.resize(kept);
    if (charged) {
      step.enc_patches.resize(kept);
      step.enc_frame_sq.resize(kept);
    }
  }
  return step;
}

Status CheckEnoughSamples(const PreparedStep& step, const ScheduleOptions& o) {
  const int64_t need = MinStepSamples(o);
  if (static_cast<int64_t>(step.size()) >= need) return Status::Ok();
  std::string why = o.num_microbatches > 0
                        ? "DP " + Str(o.dp_size) + " x M " + Str(o.num_microbatches)
                        : "DP " + Str(o.dp_size) + " x k " + Str(o.microbatch_multiple);
  std::string skipped;
  if (!step.skipped.empty()) skipped = " (after skipping " + Str(step.skipped.size()) + " oversize)";
  return Status::InvalidArgument("schedule: too few samples: " + Str(step.size()) + skipped +
                                 " for " + why + " = " + Str(need) +
                                 " microbatches, each of which needs at least one sample");
}

}  // namespace internal

int64_t MinStepSamples(const ScheduleOptions& o) {
  if (o.scheduler == ScheduleOptions::Scheduler::kDynamic) return 1;
  return static_cast<int64_t>(std::max(o.dp_size, 1)) *
         std::max(o.num_microbatches > 0 ? o.num_microbatches : o.microbatch_multiple, 1);
}

namespace internal {

MicrobatchCost CostOfSums(const GroupSums& g, const ScheduleOptions& o) {
  MicrobatchCost r;
  r.padded_tokens = o.parallel.MicrobatchTokens(g.sum_p);
  const int64_t tail = r.padded_tokens - g.sum_p;
  GroupSums::Wide sq = g.sum_sq;
  if (o.pad_to_max_tokens) {
    r.padded_tokens = FixedMicrobatchTokens(o);  // the fixed shape's padding: linear only
  } else if (tail > 0) {
    // (last + tail)^2 = last^2 + 2 last tail + tail^2
    sq += 2 * static_cast<GroupSums::Wide>(g.last_p) * static_cast<GroupSums::Wide>(tail) +
          static_cast<GroupSums::Wide>(tail) * static_cast<GroupSums::Wide>(tail);
  }
  constexpr auto kMax = static_cast<GroupSums::Wide>(std::numeric_limits<int64_t>::max());
  r.overflow = sq > kMax;
  r.sum_sq = static_cast<int64_t>(std::min(sq, kMax));
  const double cp = static_cast<double>(o.parallel.cp_size());
  r.cost = o.cost.Cost(g.n_samples, r.padded_tokens, static_cast<double>(sq)) / cp;
  if (g.enc_patches != 0 || g.enc_frame_sq != 0) {
    r.encoder_cost = EncoderTerm(o.encoder_cost, static_cast<double>(g.enc_patches),
                                 static_cast<double>(g.enc_frame_sq)) / cp;
    r.cost += r.encoder_cost;
  }
  return r;
}

MicrobatchCost ComputeMicrobatchCost(std::span<const int64_t> padded, const ScheduleOptions& o) {
  GroupSums g;
  for (int64_t p : padded) g.Add(0, 0, p);
  if (!padded.empty()) g.last_p = padded.back();
  return CostOfSums(g, o);
}

std::vector<int32_t> GroupOfItems(const Assignment& a, size_t n) {
  std::vector<int32_t> group_of(n);
  const size_t groups = a.offsets.size() - 1;
  for (size_t g = 0; g < groups; ++g) {
    for (int64_t k = a.offsets[g]; k < a.offsets[g + 1]; ++k) {
      group_of[static_cast<size_t>(a.items[static_cast<size_t>(k)])] = static_cast<int32_t>(g);
    }
  }
  return group_of;
}

const std::vector<int32_t>& GroupOf(const Assignment& a, size_t n,
                                    std::vector<int32_t>* scratch) {
  if (a.group_of.size() == n) return a.group_of;
  *scratch = GroupOfItems(a, n);
  return *scratch;
}

std::vector<GroupSums> AssignmentSums(const PreparedStep& step, const Assignment& a) {
  const size_t groups = a.offsets.size() - 1;
  std::vector<GroupSums> sums(groups);
  std::vector<int32_t> scratch;
  const std::vector<int32_t>& group_of = GroupOf(a, step.size(), &scratch);
  for (size_t i = 0; i < step.size(); ++i) {
    sums[static_cast<size_t>(group_of[i])].Add(step.length[i], step.n_targets[i], step.padded[i]);
  }
  if (step.has_encoder()) {
    for (size_t i = 0; i < step.size(); ++i) {
      sums[static_cast<size_t>(group_of[i])].AddEncoder(step.enc_patches[i], step.enc_frame_sq[i],
                                                        step.cost[i]);
    }
  }
  for (size_t g = 0; g < groups; ++g) sums[g].last_p = LastPadded(step, a, g);
  return sums;
}


AssignmentCost ComputeAssignmentCost(const PreparedStep& step, const ScheduleOptions& o,
                                     const Assignment& a) {
  AssignmentCost r;
  const std::vector<GroupSums> sums = AssignmentSums(step, a);
  const int m_count = a.num_microbatches;
  for (int d = 0; d < a.dp_size; ++d) {
    double replica = 0;
    double lo = std::numeric_limits<double>::infinity();
    double hi = 0;
    for (int m = 0; m < m_count; ++m) {
      const double c = CostOfSums(sums[static_cast<size_t>(d) * m_count + m], o).cost;
      replica += c;
      lo = std::min(lo, c);
      hi = std::max(hi, c);
    }
    r.max_replica_cost = std::max(r.max_replica_cost, replica);
    if (m_count > 0) r.max_spread = std::max(r.max_spread, hi - lo);
  }
  return r;
}

size_t ChooseCandidate(std::span<const int> m, std::span<const AssignmentCost> cost) {
  double best = std::numeric_limits<double>::infinity();
  for (const AssignmentCost& c : cost) best = std::min(best, c.max_replica_cost);
  const double limit = best * kNearBest + 1e-12 * std::abs(best);
  size_t pick = cost.size();
  for (size_t i = 0; i < cost.size(); ++i) {
    if (cost[i].max_replica_cost > limit) continue;
    if (pick == cost.size()) {
      pick = i;
    } else if (m[i] != m[pick]) {
      if (m[i] < m[pick]) pick = i;
    } else if (cost[i].max_replica_cost != cost[pick].max_replica_cost) {
      if (cost[i].max_replica_cost < cost[pick].max_replica_cost) pick = i;
    } else if (cost[i].max_spread < cost[pick].max_spread) {
      pick = i;
    }
  }
  return pick;
}

Plan ToPlan(const PreparedStep& step, const Assignment& a, ScheduleOptions::Scheduler who) {
  Plan plan;
  plan.num_microbatches = a.num_microbatches;
  plan.dp_size = a.dp_size;
  plan.offsets = a.offsets;
  plan.sample_ids.resize(a.items.size());
  const size_t n = a.items.size();
  for (size_t k = 0; k < n; ++k) {
    if (k + kPrefetchAhead < n) {
      __builtin_prefetch(&step.ids[static_cast<size_t>(a.items[k + kPrefetchAhead])]);
    }
    plan.sample_ids[k] = step.ids[static_cast<size_t>(a.items[k])];
  }
  plan.skipped = step.skipped;
  plan.scheduler = who;
  return plan;
}

}  // namespace internal

std::string_view SchedulerName(ScheduleOptions::Scheduler s) {
  switch (s) {
    case ScheduleOptions::Scheduler::kSequential: return "sequential";
    case ScheduleOptions::Scheduler::kBalanced: return "balanced";
    case ScheduleOptions::Scheduler::kDynamic: return "dynamic";
  }
  return "balanced";
}

std::string_view OversizePolicyName(ScheduleOptions::OversizePolicy p) {
  switch (p) {
    case ScheduleOptions::OversizePolicy::kError: return "error";
    case ScheduleOptions::OversizePolicy::kSkip: return "skip";
    case ScheduleOptions::OversizePolicy::kTruncate: return "truncate";
    case ScheduleOptions::OversizePolicy::kSplit: return "split";
  }
  return "error";
}

Result<ScheduleOptions::Scheduler> ParseSchedulerName(std::string_view name) {
  if (name == "sequential") return ScheduleOptions::Scheduler::kSequential;
  if (name == "balanced") return ScheduleOptions::Scheduler::kBalanced;
  if (name == "dynamic") return ScheduleOptions::Scheduler::kDynamic;
  return Status::InvalidArgument("scheduler '" + std::string(name) +
                                 "': expected 'sequential', 'balanced' or 'dynamic'");
}

std::string_view CpSizesName(ScheduleOptions::CpSizes sizes) {
  return sizes == ScheduleOptions::CpSizes::kPow2 ? "pow2" : "any";
}

Result<ScheduleOptions::CpSizes> ParseCpSizes(std::string_view name) {
  if (name == "any") return ScheduleOptions::CpSizes::kAny;
  if (name == "pow2") return ScheduleOptions::CpSizes::kPow2;
  return Status::InvalidArgument("CP sizes '" + std::string(name) +
                                 "': expected 'any' or 'pow2'");
}

Status CheckKeepGroups(const ScheduleOptions& options, std::string_view ids) {
  const bool keep = options.keep_groups != ScheduleOptions::KeepGroups::kNone;
  if (keep && options.scheduler == ScheduleOptions::Scheduler::kSequential) {
    return Status::InvalidArgument(
        "keep_groups '" + std::string(KeepGroupsName(options.keep_groups)) +
        "' needs the balanced or the dynamic scheduler, not 'sequential' (the sequential one "
        "follows Megatron-LM's order, which knows no groups)");
  }
  if (!keep && !ids.empty()) {
    return Status::InvalidArgument(std::string(ids) +
                                   " given but keep_groups is 'none' (set 'microbatch' or "
                                   "'replica' to keep groups together)");
  }
  return Status::Ok();
}

std::string_view KeepGroupsName(ScheduleOptions::KeepGroups keep) {
  switch (keep) {
    case ScheduleOptions::KeepGroups::kNone: return "none";
    case ScheduleOptions::KeepGroups::kMicrobatch: return "microbatch";
    case ScheduleOptions::KeepGroups::kReplica: return "replica";
  }
  return "none";
}

Result<ScheduleOptions::KeepGroups> ParseKeepGroups(std::string_view name) {
  if (name == "none") return ScheduleOptions::KeepGroups::kNone;
  if (name == "microbatch") return ScheduleOptions::KeepGroups::kMicrobatch;
  if (name == "replica") return ScheduleOptions::KeepGroups::kReplica;
  return Status::InvalidArgument("keep_groups '" + std::string(name) +
                                 "': expected none, microbatch or replica");
}

Result<ScheduleOptions::OversizePolicy> ParseOversizePolicy(std::string_view name) {
  if (name == "error") return ScheduleOptions::OversizePolicy::kError;
  if (name == "skip") return ScheduleOptions::OversizePolicy::kSkip;
  if (name == "truncate") return ScheduleOptions::OversizePolicy::kTruncate;
  if (name == "split") return ScheduleOptions::OversizePolicy::kSplit;
  return Status::InvalidArgument("oversize policy '" + std::string(name) +
                                 "': expected 'error', 'skip', 'truncate' or 'split'");
}

Truncation TruncateLengths(std::span<SampleLength> samples, int64_t longest) {
  Truncation cut;
  for (SampleLength& s : samples) {
    if (s.length <= longest) continue;
    const int64_t targets = std::min(s.n_targets, longest - 1);
    ++cut.samples;
    cut.tokens += s.length - longest;
    cut.targets += s.n_targets - targets;
    s.length = longest;
    s.n_targets = targets;
  }
  return cut;
}

namespace {

// Schedule up to the assignment: the prepared step it indexes and who made it.
// With `figures`, also the figures of the assignment (AssignmentFigures).
// With `release`, the vector behind `samples` is emptied (its memory freed) once the step is
// prepared.
Result<internal::Assignment> ScheduleAssignment(std::span<const SampleLength> samples,
                                                const ScheduleOptions& options,
                                                internal::PreparedStep* step,
                                                ScheduleOptions::Scheduler* who,
                                                std::span<const int64_t> groups,
                                                std::span<const EncoderWork> encoder,
                                                PlanFigures* figures = nullptr,
                                                std::vector<SampleLength>* release = nullptr) {
  THDPACK_RETURN_IF_ERROR(internal::ValidateOptions(options));
  if (options.scheduler == ScheduleOptions::Scheduler::kDynamic) {
    return Status::InvalidArgument(
        "schedule: the dynamic scheduler gives per-microbatch CP groups, not replicas: call "
        "ScheduleDynamic");
  }
  THDPACK_ASSIGN_OR_RETURN(*step, internal::PrepareStep(samples, options, encoder));
  // Groups, a sequence cap or encoder work under the balanced scheduler: the unit scheduler
  // (each sample its own unit without groups), which budgets sequences with tokens and places
  // units by their own cost (the plain balanced scheduler's fast paths take a sample's cost
  // from its P alone).
  const bool capped = (options.max_seqs_per_microbatch > 0 || step->has_encoder()) &&
                      options.scheduler == ScheduleOptions::Scheduler::kBalanced;
  if (options.keep_groups != ScheduleOptions::KeepGroups::kNone || !groups.empty() || capped) {
    THDPACK_RETURN_IF_ERROR(
        CheckKeepGroups(options,
                        groups.empty() ? "" : std::to_string(groups.size()) + " group ids")
            .WithContext("schedule"));
    THDPACK_ASSIGN_OR_RETURN(internal::StepUnits units,
                             internal::UnitsOfGroups(samples, options, groups));
    THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> unit_of,
                             internal::ApplyGroups(samples, options, units, step));
    if (release != nullptr) std::vector<SampleLength>().swap(*release);
    THDPACK_RETURN_IF_ERROR(internal::CheckEnoughSamples(*step, options));
    *who = ScheduleOptions::Scheduler::kBalanced;
    THDPACK_ASSIGN_OR_RETURN(internal::Assignment a,
                             internal::ScheduleGroups(*step, options, unit_of));
    if (figures != nullptr) {
      THDPACK_ASSIGN_OR_RETURN(*figures, internal::AssignmentFigures(*step, options, a));
    }
    return a;
  }
  if (release != nullptr) std::vector<SampleLength>().swap(*release);
  THDPACK_RETURN_IF_ERROR(internal::CheckEnoughSamples(*step, options));
  if (options.scheduler == ScheduleOptions::Scheduler::kSequential) {
    *who = ScheduleOptions::Scheduler::kSequential;
    THDPACK_ASSIGN_OR_RETURN(internal::Assignment a,
                             internal::ScheduleSequential(*step, options, options.num_microbatches));
    if (figures != nullptr) {
      THDPACK_ASSIGN_OR_RETURN(*figures, internal::AssignmentFigures(*step, options, a));
    }
    return a;
  }
  *who = ScheduleOptions::Scheduler::kBalanced;
  return internal::ScheduleBalanced(*step, options, who, figures);
}

}  // namespace

Result<Plan> Schedule(std::span<const SampleLength> samples, const ScheduleOptions& options,
                      std::span<const int64_t> groups, std::span<const EncoderWork> encoder) {
  internal::PreparedStep step;
  ScheduleOptions::Scheduler who = ScheduleOptions::Scheduler::kBalanced;
  THDPACK_ASSIGN_OR_RETURN(internal::Assignment a,
                           ScheduleAssignment(samples, options, &step, &who, groups, encoder));
  return internal::ToPlan(step, a, who);
}

namespace {

Result<ScheduledPlan> ScheduleWithFiguresImpl(std::span<const SampleLength> samples,
                                              const ScheduleOptions& options,
                                              std::span<const int64_t> groups,
                                              std::span<const EncoderWork> encoder,
                                              std::vector<SampleLength>* release) {
  internal::PreparedStep step;
  ScheduleOptions::Scheduler who = ScheduleOptions::Scheduler::kBalanced;
  ScheduledPlan out;
  THDPACK_ASSIGN_OR_RETURN(
      internal::Assignment a,
      ScheduleAssignment(samples, options, &step, &who, groups, encoder, &out.figures, release));
  if (options.step_time.has_value()) {
    THDPACK_ASSIGN_OR_RETURN(out.sim_step_time, internal::AssignmentStepTime(step, options, a));
  }
  out.plan = internal::ToPlan(step, a, who);
  return out;
}

}  // namespace

Result<ScheduledPlan> ScheduleWithFigures(std::span<const SampleLength> samples,
                                          const ScheduleOptions& options,
                                          std::span<const int64_t> groups,
                                          std::span<const EncoderWork> encoder) {
  return ScheduleWithFiguresImpl(samples, options, groups, encoder, nullptr);
}

Result<ScheduledPlan> ScheduleWithFigures(std::vector<SampleLength>&& samples,
                                          const ScheduleOptions& options) {
  return ScheduleWithFiguresImpl(samples, options, {}, {}, &samples);
}

namespace internal {

Status ValidatePlanWithIndex(std::span<const SampleLength> samples, const SampleIdIndex& index,
                             const ScheduleOptions& options, const Plan& plan,
                             std::span<const int64_t> groups) {
  THDPACK_RETURN_IF_ERROR(internal::ValidateOptions(options));
  auto bad = [](const std::string& what) { return Status::InvalidArgument("invalid plan: " + what); };
  const int64_t dp = options.dp_size;
  const int64_t m_count = plan.num_microbatches;
  if (plan.dp_size != options.dp_size) {
    return bad("dp_size " + Str(plan.dp_size) + " != options.dp_size " + Str(dp));
  }
  if (m_count < 1) return bad("num_microbatches = " + Str(m_count) + " < 1");
  if (m_count % options.microbatch_multiple != 0) {
    return bad("M = " + Str(m_count) + " is not a multiple of k = " +
               Str(options.microbatch_multiple));
  }
  if (options.num_microbatches > 0 && m_count != options.num_microbatches) {
    return bad("M = " + Str(m_count) + " but the caller fixed M = " +
               Str(options.num_microbatches));
  }
  if (plan.offsets.size() != static_cast<size_t>(dp * m_count + 1) || plan.offsets[0] != 0 ||
      plan.offsets.back() != static_cast<int64_t>(plan.sample_ids.size())) {
    return bad("offsets must have DP*M+1 entries from 0 to the number of ids");
  }
  if (index.has_duplicates()) {
    const auto sorted = internal::SortedIds(samples);
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (sorted[i].first == sorted[i - 1].first) return bad("duplicate input id " + Str(sorted[i].first));
    }
  }
  const int64_t capacity = internal::UsableCapacity(options);
  const int64_t budget = MicrobatchBudget(options);
  std::vector<uint8_t> seen(static_cast<size_t>(index.num_slots()), 0);
  const int64_t total = static_cast<int64_t>(plan.sample_ids.size());
  for (int64_t d = 0; d < dp; ++d) {
    for (int64_t m = 0; m < m_count; ++m) {
      const int64_t g = d * m_count + m;
      if (plan.offsets[g + 1] <= plan.offsets[g]) {
        return bad("microbatch " + Str(m) + " of replica " + Str(d) + " is empty");
      }
      int64_t sum = 0;
      for (int64_t k = plan.offsets[g]; k < plan.offsets[g + 1]; ++k) {
        if (k + kPrefetchAhead < total) index.Prefetch(plan.sample_ids[k + kPrefetchAhead]);
        const int64_t id = plan.sample_ids[k];
        const int64_t i = index.Slot(id);
        if (i < 0) return bad("id " + Str(id) + " is not an input sample");
        if (seen[i]) return bad("id " + Str(id) + " appears twice");
        seen[i] = 1;
        sum += options.parallel.PaddedLength(index.Length(i));
      }
      const int64_t t = options.parallel.MicrobatchTokens(sum);
      if (sum > capacity || t > budget) {
        return bad("microbatch " + Str(m) + " of replica " + Str(d) + " holds T = " + Str(t) +
                   " padded tokens, over the budget " + Str(budget));
      }
      const int64_t seqs = plan.offsets[g + 1] - plan.offsets[g];
      if (options.max_seqs_per_microbatch > 0 && seqs > options.max_seqs_per_microbatch) {
        return bad("microbatch " + Str(m) + " of replica " + Str(d) + " holds " + Str(seqs) +
                   " sequences, over max_seqs_per_microbatch " +
                   Str(options.max_seqs_per_microbatch));
      }
    }
  }
  for (int64_t id : plan.skipped) {
    const int64_t i = index.Slot(id);
    if (i < 0) return bad("skipped id " + Str(id) + " is not an input sample");
    if (seen[i]) return bad("id " + Str(id) + " is both scheduled and skipped (or skipped twice)");
    seen[i] = 2;
    const int64_t p = options.parallel.PaddedLength(index.Length(i));
    if (options.oversize != ScheduleOptions::OversizePolicy::kSkip) {
      return bad("id " + Str(id) + " was skipped but the oversize policy is 'error'");
    }
    // With groups, a sample that fits may leave with its group (CheckGroupPlacement).
    if (p <= capacity && options.keep_groups == ScheduleOptions::KeepGroups::kNone) {
      return bad("id " + Str(id) + " was skipped but fits the budget");
    }
  }
  for (const SampleLength& s : samples) {
    if (!seen[static_cast<size_t>(index.Slot(s.id))]) {
      return bad("sample id " + Str(s.id) + " is neither scheduled nor skipped");
    }
  }
  // Without `groups` the group rule is not checked (ComputePlanFigures' use): a skipped
  // sample that fits is then accepted under a keep_groups mode, as its group may have left.
  if (groups.empty()) return Status::Ok();
  if (Status rule = CheckKeepGroups(options, std::to_string(groups.size()) + " group ids");
      !rule.ok()) {
    return bad(rule.message());
  }
  THDPACK_ASSIGN_OR_RETURN(StepUnits units, UnitsOfGroups(samples, options, groups));
  // Where each sample is: its microbatch (kMicrobatch) or replica (kReplica), and position.
  std::vector<PlacedSample> where(static_cast<size_t>(index.num_slots()));
  const bool by_replica = options.keep_groups == ScheduleOptions::KeepGroups::kReplica;
  for (int64_t g = 0; g < dp * m_count; ++g) {
    for (int64_t k = plan.offsets[g]; k < plan.offsets[g + 1]; ++k) {
      const int64_t slot = index.Slot(plan.sample_ids[k]);
      where[static_cast<size_t>(slot)] = {by_replica ? g / m_count : g, k};
    }
  }
  // The slots of a dense index are not input positions: map them.
  std::vector<PlacedSample> by_input(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    by_input[i] = where[static_cast<size_t>(index.Slot(samples[i].id))];
  }
  const UnitFit fit = FitOfUnits(samples, options, units);
  return CheckGroupPlacement(samples, options, units, by_input,
                             [&](int32_t u) { return fit.fits[static_cast<size_t>(u)] != 0; });
}

}  // namespace internal

Status ValidatePlan(std::span<const SampleLength> samples, const ScheduleOptions& options,
                    const Plan& plan, std::span<const int64_t> groups) {
  return internal::ValidatePlanWithIndex(samples, SampleIdIndex(samples), options, plan, groups);
}

}  // namespace thdpack
