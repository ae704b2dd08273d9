// The dynamic scheduler (schedule.h, docs/scheduling.md "Dynamic CP"): a CP group of any size
// per microbatch and sequence over the D = DP * CP ranks of the domain, chosen to minimise the
// modelled step time (cost.h's StepTimeModel).
//
// Candidates, the fastest kept (ties to the earlier one):
//   1. List scheduling of moldable tasks, one pass per slack eps in kSlacks. Sequences in
//      decreasing order of their least rank-seconds w_min = min_c c * t(P_c, c) (ties by id);
//      each takes, among the sizes c that fit (P_c <= the group budget) and cost at most
//      (1 + eps) * w_min rank-seconds, the window of c contiguous ranks and the c that finish
//      first (window: earliest start = the latest free time of its ranks, ties to the lowest
//      rank; c: ties to the smaller). A sequence whose window is exactly the last group of
//      all of its ranks joins that group while the group's budget holds (same time, fewer
//      microbatches); otherwise it opens a new group. Microbatch indices follow from the
//      groups in creation order: a group's index is one past the latest of its ranks', so the
//      dependency simulation of the plan replays the list schedule exactly.
//   2. The balanced scheduler at every static CP size c that divides D (DP' = D / c), its
//      replicas as groups: so the dynamic plan is never slower in the model than the best
//      static one.
// With encoder work (the step-time model's encoder term), a sequence costs t(P, c) + E(w) / c
// on each rank of its group; candidates 1 are then made with it and without it (all timed
// with it), so the plan never loses to the one blind to the encoder.
// Time: O(passes x n x |sizes| x D) for the list passes plus the balanced candidates.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

// The slack of each list-scheduling pass (see the top of the file); the last is unbounded.
constexpr double kSlacks[] = {1e-9, 0.05, 0.25, 1.0};

// A group size the plan may use, with its layout and usable capacity (sum of P).
struct Size {
  int c = 1;
  ParallelLayout layout;
  int64_t capacity = 0;
};

// The kept sequences of a step, and the units list scheduling moves: a group kept together
// (ScheduleOptions::keep_groups), or one sequence. Units are numbered by their first sequence,
// their members (indices into kept) increasing.
struct DynStep {
  std::vector<SampleLength> kept;  // input order
  std::vector<int64_t> skipped;
  std::vector<int64_t> kept_groups;  // group id of each kept sequence; empty without groups
  std::vector<int32_t> unit_first;   // [U + 1]: unit u's members are
  std::vector<int32_t> unit_members; //   unit_members[unit_first[u] .. unit_first[u + 1])
  // E(w) of each kept sequence, seconds on one rank (StepTimeModel::EncoderSeconds); empty
  // without encoder work.
  std::vector<double> kept_encoder;
  int32_t num_units() const { return static_cast<int32_t>(unit_first.size()) - 1; }
  double Encoder(int32_t k) const {
    return kept_encoder.empty() ? 0.0 : kept_encoder[static_cast<size_t>(k)];
  }
};

Status ValidateDynamicOptions(const ScheduleOptions& o) {
  THDPACK_RETURN_IF_ERROR(internal::ValidateOptions(o));
  if (!o.step_time.has_value()) {
    return Status::InvalidArgument(
        "schedule options: the dynamic scheduler needs the step-time model (model dimensions: "
        "a cost of llama2-7b, llama3-8b or l=..,h=..; not tokens or A,B)");
  }
  const int64_t d = static_cast<int64_t>(o.dp_size) * o.parallel.cp_size();
  if (d > (int64_t{1} << 16)) {
    return Status::InvalidArgument("schedule options: the domain DP * CP = " + Str(d) +
                                   " ranks is over the dynamic scheduler's limit of 65536");
  }
  if (o.max_tokens_per_rank > std::numeric_limits<int32_t>::max() / d) {
    return Status::InvalidArgument("schedule options: D * max_tokens_per_rank = " + Str(d) +
                                   " * " + Str(o.max_tokens_per_rank) +
                                   " must fit int32 (the largest group's T is int32)");
  }
  return Status::Ok();
}

Result<std::vector<Size>> AllowedSizes(const ScheduleOptions& o, int domain) {
  std::vector<Size> sizes;
  for (int c = 1; c <= domain; ++c) {
    if (o.cp_sizes == ScheduleOptions::CpSizes::kPow2 && (c & (c - 1)) != 0) continue;
    THDPACK_ASSIGN_OR_RETURN(ParallelLayout layout, GroupLayout(o, c));
    sizes.push_back({c, layout, layout.UsableBudget(layout.MicrobatchBudget(o.max_tokens_per_rank))});
  }
  return sizes;
}

// The group oversize rule under dynamic CP, one place for the scheduler and the validator:
// a unit fits when none of its samples is oversize (fits no allowed size) and its padded
// lengths together fit one group's capacity at some allowed size. sum[u * sizes + z]: its
// padded tokens at size z.
struct DynUnitFit {
  std::vector<int64_t> sum;
  std::vector<uint8_t> has_oversize;
  std::vector<uint8_t> fits;
};
DynUnitFit FitOfDynamicUnits(std::span<const SampleLength> samples,
                             const internal::StepUnits& units, const std::vector<Size>& sizes) {
  const size_t u_count = static_cast<size_t>(units.size()), nz = sizes.size();
  DynUnitFit fit{std::vector<int64_t>(u_count * nz, 0), std::vector<uint8_t>(u_count, 0),
                 std::vector<uint8_t>(u_count, 0)};
  for (size_t i = 0; i < samples.size(); ++i) {
    const size_t u = static_cast<size_t>(units.unit_of[i]);
    bool sample_fits = false;
    for (size_t z = 0; z < nz; ++z) {
      const int64_t p = sizes[z].layout.PaddedLength(samples[i].length);
      fit.sum[u * nz + z] += p;
      sample_fits = sample_fits || p <= sizes[z].capacity;
    }
    if (!sample_fits) fit.has_oversize[u] = 1;
  }
  for (size_t u = 0; u < u_count; ++u) {
    for (size_t z = 0; z < nz && !fit.has_oversize[u] && !fit.fits[u]; ++z) {
      fit.fits[u] = fit.sum[u * nz + z] <= sizes[z].capacity;
    }
  }
  return fit;
}

// Validates the samples and applies the oversize policy: a sample is oversize when it fits
// no allowed group size.
Result<DynStep> PrepareDynamic(std::span<const SampleLength> samples, const ScheduleOptions& o,
                               const std::vector<Size>& sizes, std::span<const int64_t> groups) {
  // The per-sample checks and duplicate ids are PrepareStep's, on a CP = 1 copy that holds
  // any length (so that oversize is decided here).
  ScheduleOptions plain = o;
  plain.parallel = ParallelLayout();
  plain.max_tokens_per_rank = std::numeric_limits<int32_t>::max();
  plain.oversize = ScheduleOptions::OversizePolicy::kSkip;
  THDPACK_RETURN_IF_ERROR(internal::PrepareStep(samples, plain).status());
  THDPACK_ASSIGN_OR_RETURN(internal::StepUnits units,
                           internal::UnitsOfGroups(samples, o, groups));
  const bool grouped = o.keep_groups != ScheduleOptions::KeepGroups::kNone;
  DynStep step;
  step.kept.reserve(samples.size());
  const Size& widest = sizes.back();
  // A unit is kept when every sequence of it fits some group and (with groups) their padded
  // lengths together fit one group's budget at some size.
  std::vector<uint8_t> unit_ok(static_cast<size_t>(units.size()), 1);
  for (size_t i = 0; i < samples.size(); ++i) {
    const SampleLength& s = samples[i];
    bool fits = false;
    for (auto it = sizes.rbegin(); it != sizes.rend() && !fits; ++it) {
      fits = it->layout.PaddedLength(s.length) <= it->capacity;
    }
    if (fits) continue;
    unit_ok[static_cast<size_t>(units.unit_of[i])] = 0;
    if (o.oversize != ScheduleOptions::OversizePolicy::kSkip) {
      return Status::InvalidArgument(
          "schedule: sample id " + Str(s.id) + " has length " + Str(s.length) + " (padded " +
          Str(widest.layout.PaddedLength(s.length)) + " on the largest group of " +
          Str(widest.c) + " ranks), over every group's budget; the largest is " +
          Str(widest.layout.MicrobatchBudget(o.max_tokens_per_rank)) + " = " + Str(widest.c) +
          " ranks x max_tokens_per_rank " + Str(o.max_tokens_per_rank) +
          " (oversize policy 'error'; 'skip' leaves such samples out)");
    }
  }
  if (grouped) {
    const DynUnitFit fit = FitOfDynamicUnits(samples, units, sizes);
    const std::vector<int64_t>& sum = fit.sum;
    for (int32_t u = 0; u < units.size(); ++u) {
      if (!unit_ok[static_cast<size_t>(u)] || fit.fits[static_cast<size_t>(u)]) continue;
      unit_ok[static_cast<size_t>(u)] = 0;
      if (o.oversize != ScheduleOptions::OversizePolicy::kSkip) {
        std::string ids;
        int shown = 0, total = 0;
        for (size_t i = 0; i < samples.size(); ++i) {
          if (units.unit_of[i] != u) continue;
          if (shown < 4) ids += (shown++ > 0 ? ", " : "") + Str(samples[i].id);
          ++total;
        }
        return Status::InvalidArgument(
            "schedule: group " + Str(units.value[static_cast<size_t>(u)]) + " (samples " + ids +
            (total > shown ? ", ... (" + Str(total) + " in all)" : "") + ") pads to " +
            Str(sum[static_cast<size_t>(u) * sizes.size() + sizes.size() - 1]) +
            " tokens together on the largest group of " + Str(widest.c) +
            " ranks, over its budget " +
            Str(widest.layout.MicrobatchBudget(o.max_tokens_per_rank)) + " (keep_groups '" +
            std::string(KeepGroupsName(o.keep_groups)) +
            "' puts a group in one CP group of one microbatch under dynamic CP; raise "
            "max_tokens_per_rank, or set the oversize policy 'skip' to leave such groups out)");
      }
    }
  }
  // Kept sequences and their units, in input order; the others skipped, in input order.
  std::vector<int32_t> dense(static_cast<size_t>(units.size()), -1);
  std::vector<std::vector<int32_t>> members;
  for (size_t i = 0; i < samples.size(); ++i) {
    const int32_t u = units.unit_of[i];
    if (!unit_ok[static_cast<size_t>(u)]) {
      step.skipped.push_back(samples[i].id);
      continue;
    }
    if (dense[static_cast<size_t>(u)] < 0) {
      dense[static_cast<size_t>(u)] = static_cast<int32_t>(members.size());
      members.emplace_back();
    }
    members[static_cast<size_t>(dense[static_cast<size_t>(u)])].push_back(
        static_cast<int32_t>(step.kept.size()));
    step.kept.push_back(samples[i]);
    if (grouped) step.kept_groups.push_back(groups[i]);
  }
  step.unit_first.push_back(0);
  for (const auto& m : members) {
    step.unit_members.insert(step.unit_members.end(), m.begin(), m.end());
    step.unit_first.push_back(static_cast<int32_t>(step.unit_members.size()));
  }
  if (step.kept.empty()) {
    return Status::InvalidArgument("schedule: too few samples: 0 to schedule" +
                                   std::string(step.skipped.empty() ? "" : " (all oversize)") +
                                   "; the dynamic scheduler needs at least 1");
  }
  return step;
}

// Seconds of one group's microbatch: t(P, c) summed over its sequences (lengths in order), the
// SP tail on the last, their encoder seconds (sum of E(w), `encoder`) over c, plus the
// microbatch constant. Also its T.
struct GroupCost {
  double seconds = 0;
  int64_t padded_tokens = 0;
};
GroupCost CostOfGroup(const StepTimeModel& model, const ParallelLayout& layout, int c,
                      std::span<const int64_t> lengths, double encoder = 0) {
  GroupCost g;
  int64_t sum = 0;
  for (int64_t l : lengths) sum += layout.PaddedLength(l);
  g.padded_tokens = layout.MicrobatchTokens(sum);
  const int64_t tail = g.padded_tokens - sum;
  for (size_t j = 0; j < lengths.size(); ++j) {
    const int64_t p = layout.PaddedLength(lengths[j]) + (j + 1 == lengths.size() ? tail : 0);
    g.seconds += model.SequenceSeconds(p, c);
  }
  g.seconds += encoder / static_cast<double>(c);
  if (!lengths.empty()) g.seconds += model.coefficients().seconds_per_microbatch;
  return g;
}


// The modelled time of a plan whose ids are all in `index` (checked by the caller);
// `encoder`: E(w) of each slot of the index, or empty.
Result<double> TimeOfPlan(const SampleIdIndex& index, const ScheduleOptions& o,
                          const DynamicPlan& plan, std::span<const double> encoder = {}) {
  std::vector<GroupTask> tasks;
  std::vector<int64_t> lengths;
  for (const auto& groups : plan.microbatches) {
    for (const CpGroup& g : groups) {
      THDPACK_ASSIGN_OR_RETURN(ParallelLayout layout, GroupLayout(o, g.num_ranks));
      lengths.clear();
      double e = 0;
      for (int64_t id : g.sample_ids) {
        const int64_t slot = index.Slot(id);
        lengths.push_back(index.Length(slot));
        if (!encoder.empty()) e += encoder[static_cast<size_t>(slot)];
      }
      tasks.push_back({g.first_rank, g.num_ranks,
                       CostOfGroup(*o.step_time, layout, g.num_ranks, lengths, e).seconds});
    }
  }
  return SimulateStepTime(plan.domain_size, tasks);
}

// M raised to a multiple of k, or to the fixed M; false when a fixed M is below `natural`.
bool FinalMicrobatchCount(const ScheduleOptions& o, int natural, int* m) {
  if (o.num_microbatches > 0) {
    *m = o.num_microbatches;
    return natural <= o.num_microbatches;
  }
  const int k = o.microbatch_multiple;
  *m = std::max(1, (natural + k - 1) / k * k);
  return true;
}

// The sizes each sequence may take, computed once for all list-scheduling passes.
struct Moldable {
  struct Option {
    int32_t size;  // index into sizes
    int64_t padded;
    double seconds;       // t(P, c) + E(w) / c
    double rank_seconds;  // c * t(P, c)
  };
  std::vector<int64_t> first;   // [n + 1]: sequence i's options are [first[i], first[i+1])
  std::vector<Option> options;  // by increasing c
  std::vector<double> w_min;    // [n] least rank-seconds
  std::vector<int32_t> order;   // w_min decreasing, ties by id
};

// `encoder`: each sequence's E(w) / c in its times (false: blind to it).
Moldable MakeMoldable(const DynStep& step, const ScheduleOptions& o,
                      const std::vector<Size>& sizes, bool encoder = true) {
  const StepTimeModel& model = *o.step_time;
  const int32_t n = step.num_units();
  Moldable m;
  m.first.assign(static_cast<size_t>(n) + 1, 0);
  m.w_min.assign(static_cast<size_t>(n), std::numeric_limits<double>::infinity());
  for (int32_t i = 0; i < n; ++i) {
    for (int32_t s = 0; s < static_cast<int32_t>(sizes.size()); ++s) {
      const Size& z = sizes[static_cast<size_t>(s)];
      // A unit's tokens and seconds: its sequences' own, summed.
      int64_t p = 0;
      double t = 0;
      for (int32_t k = step.unit_first[static_cast<size_t>(i)];
           k < step.unit_first[static_cast<size_t>(i) + 1]; ++k) {
        const int32_t member = step.unit_members[static_cast<size_t>(k)];
        const int64_t pk = z.layout.PaddedLength(step.kept[static_cast<size_t>(member)].length);
        p += pk;
        t += model.SequenceSeconds(pk, z.c);
        if (encoder) t += step.Encoder(member) / static_cast<double>(z.c);
      }
      if (p > z.capacity) continue;
      m.options.push_back({s, p, t, t * z.c});
      m.w_min[static_cast<size_t>(i)] = std::min(m.w_min[static_cast<size_t>(i)], t * z.c);
    }
    m.first[static_cast<size_t>(i) + 1] = static_cast<int64_t>(m.options.size());
  }
  m.order.resize(static_cast<size_t>(n));
  std::iota(m.order.begin(), m.order.end(), 0);
  std::sort(m.order.begin(), m.order.end(), [&](int32_t a, int32_t b) {
    if (m.w_min[static_cast<size_t>(a)] != m.w_min[static_cast<size_t>(b)]) {
      return m.w_min[static_cast<size_t>(a)] > m.w_min[static_cast<size_t>(b)];
    }
    return step.kept[static_cast<size_t>(step.unit_members[static_cast<size_t>(
                         step.unit_first[static_cast<size_t>(a)])])].id <
           step.kept[static_cast<size_t>(step.unit_members[static_cast<size_t>(
                         step.unit_first[static_cast<size_t>(b)])])].id;
  });
  return m;
}

// The earliest window of c ranks: the least maximum of free_at over c contiguous ranks, ties
// to the lowest first rank (a sliding maximum over a deque of indices of decreasing free_at).
// Returns the start time; *rank its first rank. `deque` has room for free_at.size() indices.
double EarliestWindow(const std::vector<double>& free_at, int c, std::vector<int>& deque,
                      int* rank) {
  const int domain = static_cast<int>(free_at.size());
  int head = 0, tail = 0;
  double start = std::numeric_limits<double>::infinity();
  for (int r = 0; r < domain; ++r) {
    while (tail > head && free_at[static_cast<size_t>(deque[static_cast<size_t>(tail - 1)])] <=
                              free_at[static_cast<size_t>(r)]) {
      --tail;
    }
    deque[static_cast<size_t>(tail++)] = r;
    if (deque[static_cast<size_t>(head)] <= r - c) ++head;
    if (r >= c - 1) {
      const double s = free_at[static_cast<size_t>(deque[static_cast<size_t>(head)])];
      if (s < start) {
        start = s;
        *rank = r - c + 1;
      }
    }
  }
  return start;
}

// The plain reference of EarliestWindow: every window's maximum, computed in full.
double EarliestWindowPlain(const std::vector<double>& free_at, int c, int* rank) {
  double start = std::numeric_limits<double>::infinity();
  for (int r = 0; r + c <= static_cast<int>(free_at.size()); ++r) {
    const double s = *std::max_element(free_at.begin() + r, free_at.begin() + r + c);
    if (s < start) {
      start = s;
      *rank = r;
    }
  }
  return start;
}

// One list-scheduling pass (candidate 1) with slack eps. nullopt when a fixed M is too small.
// plain: windows by EarliestWindowPlain and no pruning (the reference of the fast pass).
std::optional<DynamicPlan> ListSchedule(const DynStep& step, const ScheduleOptions& o,
                                        const std::vector<Size>& sizes, const Moldable& mold,
                                        int domain, double eps, bool plain) {
  std::vector<double> free_at(static_cast<size_t>(domain), 0.0);
  std::vector<int32_t> last_pack(static_cast<size_t>(domain), -1);
  std::vector<int> deque(static_cast<size_t>(domain));
  struct Pack {
    int first_rank;
    int32_t size;  // index into sizes
    int64_t sum_padded;
    std::vector<int32_t> seqs;
  };
  std::vector<Pack> packs;
  for (int32_t i : mold.order) {
    double best_finish = std::numeric_limits<double>::infinity();
    int best_rank = 0;
    const Moldable::Option* best = nullptr;
    const double limit = (1.0 + eps) * mold.w_min[static_cast<size_t>(i)];
    // No window of c ranks starts before the earliest window of fewer ranks (a window of c
    // contains one of c - 1, whose maximum is no larger), nor before the earliest free rank:
    // sizes, visited by increasing c, whose time from that bound cannot beat the best (finish,
    // then smaller c) are not searched, and none is once the bound reaches the best finish.
    double start_bound = *std::min_element(free_at.begin(), free_at.end());
    for (int64_t k = mold.first[static_cast<size_t>(i)]; k < mold.first[static_cast<size_t>(i) + 1];
         ++k) {
      const Moldable::Option& op = mold.options[static_cast<size_t>(k)];
      if (op.rank_seconds > limit) continue;
      const int c = sizes[static_cast<size_t>(op.size)].c;
      if (!plain && start_bound + op.seconds >= best_finish) {
        if (start_bound >= best_finish) break;
        continue;
      }
      int rank = 0;
      const double start = plain ? EarliestWindowPlain(free_at, c, &rank)
                                 : EarliestWindow(free_at, c, deque, &rank);
      start_bound = std::max(start_bound, start);
      const double finish = start + op.seconds;
      if (finish < best_finish) {
        best_finish = finish;
        best_rank = rank;
        best = &op;
      }
    }
    const Size& z = sizes[static_cast<size_t>(best->size)];
    const int32_t p = last_pack[static_cast<size_t>(best_rank)];
    bool join = p >= 0 && packs[static_cast<size_t>(p)].first_rank == best_rank &&
                packs[static_cast<size_t>(p)].size == best->size &&
                packs[static_cast<size_t>(p)].sum_padded + best->padded <= z.capacity;
    for (int r = best_rank; join && r < best_rank + z.c; ++r) {
      join = last_pack[static_cast<size_t>(r)] == p;
    }
    if (join) {
      packs[static_cast<size_t>(p)].sum_padded += best->padded;
      packs[static_cast<size_t>(p)].seqs.push_back(i);
    } else {
      packs.push_back({best_rank, best->size, best->padded, {i}});
      for (int r = best_rank; r < best_rank + z.c; ++r) {
        last_pack[static_cast<size_t>(r)] = static_cast<int32_t>(packs.size() - 1);
      }
    }
    for (int r = best_rank; r < best_rank + z.c; ++r) free_at[static_cast<size_t>(r)] = best_finish;
  }
  // Microbatch indices: one past the latest of the group's ranks, in creation order.
  std::vector<int> next_mb(static_cast<size_t>(domain), 0);
  std::vector<int> mb_of(packs.size());
  int natural = 0;
  for (size_t q = 0; q < packs.size(); ++q) {
    const int c = sizes[static_cast<size_t>(packs[q].size)].c;
    int mb = 0;
    for (int r = packs[q].first_rank; r < packs[q].first_rank + c; ++r) {
      mb = std::max(mb, next_mb[static_cast<size_t>(r)]);
    }
    for (int r = packs[q].first_rank; r < packs[q].first_rank + c; ++r) {
      next_mb[static_cast<size_t>(r)] = mb + 1;
    }
    mb_of[q] = mb;
    natural = std::max(natural, mb + 1);
  }
  DynamicPlan plan;
  if (!FinalMicrobatchCount(o, natural, &plan.num_microbatches)) return std::nullopt;
  plan.domain_size = domain;
  plan.microbatches.resize(static_cast<size_t>(plan.num_microbatches));
  for (size_t q = 0; q < packs.size(); ++q) {
    std::vector<int32_t> seqs = packs[q].seqs;  // units
    std::sort(seqs.begin(), seqs.end());  // arrival order of their first sequences
    CpGroup g;
    g.first_rank = packs[q].first_rank;
    g.num_ranks = sizes[static_cast<size_t>(packs[q].size)].c;
    for (int32_t u : seqs) {
      for (int32_t k = step.unit_first[static_cast<size_t>(u)];
           k < step.unit_first[static_cast<size_t>(u) + 1]; ++k) {
        g.sample_ids.push_back(
            step.kept[static_cast<size_t>(step.unit_members[static_cast<size_t>(k)])].id);
      }
    }
    plan.microbatches[static_cast<size_t>(mb_of[q])].push_back(std::move(g));
  }
  for (auto& groups : plan.microbatches) {
    std::sort(groups.begin(), groups.end(),
              [](const CpGroup& a, const CpGroup& b) { return a.first_rank < b.first_rank; });
  }
  plan.method = "groups";
  return plan;
}

// Candidate 2 at size c: the balanced plan on DP' = D / c replicas of c ranks, as groups.
std::optional<DynamicPlan> StaticCandidate(const DynStep& step, const ScheduleOptions& o,
                                           const Size& size, int domain) {
  ScheduleOptions s = o;
  s.scheduler = ScheduleOptions::Scheduler::kBalanced;
  s.dp_size = domain / size.c;
  s.parallel = size.layout;
  s.oversize = ScheduleOptions::OversizePolicy::kError;
  // Replicas are the groups here: a unit in one microbatch of one replica is in one CP group.
  if (s.keep_groups != ScheduleOptions::KeepGroups::kNone) {
    s.keep_groups = ScheduleOptions::KeepGroups::kMicrobatch;
  }
  Result<Plan> plan = Schedule(step.kept, s, step.kept_groups);
  if (!plan.ok()) return std::nullopt;  // a sample over this size's budget, too few samples
  DynamicPlan out;
  out.domain_size = domain;
  out.num_microbatches = plan->num_microbatches;
  out.microbatches.resize(static_cast<size_t>(plan->num_microbatches));
  for (int m = 0; m < plan->num_microbatches; ++m) {
    for (int d = 0; d < plan->dp_size; ++d) {
      std::span<const int64_t> ids = plan->Microbatch(d, m);
      out.microbatches[static_cast<size_t>(m)].push_back(
          CpGroup{d * size.c, size.c, std::vector<int64_t>(ids.begin(), ids.end())});
    }
  }
  out.method = "static CP=" + Str(size.c);
  return out;
}

}  // namespace

Result<ParallelLayout> GroupLayout(const ScheduleOptions& o, int c) {
  if (c < 1) return Status::InvalidArgument("GroupLayout: c = " + Str(c) + " must be >= 1");
  return ParallelLayout::Create(c, o.parallel.tp_size(), o.parallel.sp(),
                                o.parallel.extra_alignment(), o.parallel.rank_multiple());
}

Result<int64_t> LongestKept(const ScheduleOptions& o) {
  // A length L fits a capacity C at alignment a iff roundup(L, a) <= C iff L <= C / a * a.
  auto longest = [](const ParallelLayout& layout, int64_t capacity) {
    const int64_t a = layout.sequence_alignment();
    return capacity / a * a;
  };
  if (o.scheduler != ScheduleOptions::Scheduler::kDynamic) {
    if (o.max_tokens_per_rank < 1) {
      return Status::InvalidArgument("schedule options: max_tokens_per_rank = " +
                                     Str(o.max_tokens_per_rank) + " must be >= 1");
    }
    return longest(o.parallel,
                   o.parallel.UsableBudget(o.parallel.MicrobatchBudget(o.max_tokens_per_rank)));
  }
  THDPACK_RETURN_IF_ERROR(ValidateDynamicOptions(o));
  THDPACK_ASSIGN_OR_RETURN(std::vector<Size> sizes,
                           AllowedSizes(o, o.dp_size * o.parallel.cp_size()));
  int64_t best = 0;
  for (const Size& s : sizes) best = std::max(best, longest(s.layout, s.capacity));
  return best;
}

Result<DynamicPlan> ScheduleDynamic(std::span<const SampleLength> samples,
                                    const ScheduleOptions& options,
                                    std::span<const int64_t> groups,
                                    std::span<const EncoderWork> encoder) {
  return internal::ScheduleDynamicImpl(samples, options, /*plain=*/false, groups, encoder);
}

namespace internal {

// E(w) of each sample, seconds on one rank, by the slot of `index` (empty when no sample has
// work or the model has no encoder term); InvalidArgument for a size other than the samples'
// or negative work, naming the sample.
Result<std::vector<double>> EncoderSecondsBySlot(std::span<const SampleLength> samples,
                                                 const SampleIdIndex& index,
                                                 const StepTimeModel& model,
                                                 std::span<const EncoderWork> encoder) {
  std::vector<double> out;
  THDPACK_ASSIGN_OR_RETURN(const bool any, CheckEncoderWork(samples, encoder));
  if (!any || model.coefficients().encoder.empty()) return out;
  out.assign(static_cast<size_t>(index.num_slots()), 0.0);
  for (size_t i = 0; i < samples.size(); ++i) {
    const int64_t slot = index.Slot(samples[i].id);
    if (slot >= 0) {
      out[static_cast<size_t>(slot)] =
          model.EncoderSeconds(static_cast<double>(encoder[i].patches),
                               static_cast<double>(encoder[i].frame_sq));
    }
  }
  return out;
}

}  // namespace internal

namespace internal {

Result<DynamicPlan> ScheduleDynamicImpl(std::span<const SampleLength> samples,
                                        const ScheduleOptions& options, bool plain,
                                        std::span<const int64_t> groups,
                                        std::span<const EncoderWork> encoder) {
  THDPACK_RETURN_IF_ERROR(ValidateDynamicOptions(options));
  const int domain = options.dp_size * options.parallel.cp_size();
  THDPACK_ASSIGN_OR_RETURN(std::vector<Size> sizes, AllowedSizes(options, domain));
  // Each sample's encoder seconds (the step-time model's term), before PrepareDynamic drops
  // the oversize ones: by the input's id index, then by the kept samples'.
  std::vector<double> input_encoder;
  std::optional<SampleIdIndex> input_index;
  if (!encoder.empty()) {
    input_index.emplace(samples);
    THDPACK_ASSIGN_OR_RETURN(
        input_encoder, internal::EncoderSecondsBySlot(samples, *input_index, *options.step_time, encoder));
  }
  THDPACK_ASSIGN_OR_RETURN(DynStep step, PrepareDynamic(samples, options, sizes, groups));
  const SampleIdIndex index(step.kept);
  std::vector<double> kept_encoder;  // by the kept index's slot
  if (!input_encoder.empty()) {
    kept_encoder.assign(static_cast<size_t>(index.num_slots()), 0.0);
    step.kept_encoder.resize(step.kept.size());
    for (size_t k = 0; k < step.kept.size(); ++k) {
      const double e = input_encoder[static_cast<size_t>(input_index->Slot(step.kept[k].id))];
      step.kept_encoder[k] = e;
      kept_encoder[static_cast<size_t>(index.Slot(step.kept[k].id))] = e;
    }
  }
  std::optional<DynamicPlan> best;
  auto consider = [&](std::optional<DynamicPlan> candidate) -> Status {
    if (!candidate.has_value()) return Status::Ok();
    THDPACK_ASSIGN_OR_RETURN(candidate->step_time,
                             TimeOfPlan(index, options, *candidate, kept_encoder));
    if (!best.has_value() || candidate->step_time < best->step_time) best = std::move(candidate);
    return Status::Ok();
  };
  const Moldable mold = MakeMoldable(step, options, sizes);
  for (double eps : kSlacks) {
    THDPACK_RETURN_IF_ERROR(
        consider(ListSchedule(step, options, sizes, mold, domain, eps, plain)));
  }
  if (!step.kept_encoder.empty()) {
    // The list schedules blind to the encoder too, timed with it: list scheduling is a
    // heuristic, and so the plan is never slower in the model than the one that ignores it.
    const Moldable blind = MakeMoldable(step, options, sizes, /*encoder=*/false);
    for (double eps : kSlacks) {
      THDPACK_RETURN_IF_ERROR(
          consider(ListSchedule(step, options, sizes, blind, domain, eps, plain)));
    }
  }
  for (const Size& size : sizes) {
    if (domain % size.c != 0) continue;
    THDPACK_RETURN_IF_ERROR(consider(StaticCandidate(step, options, size, domain)));
  }
  if (!best.has_value()) {
    return Status::InvalidArgument("schedule: the dynamic scheduler found no plan within the "
                                   "fixed M = " + Str(options.num_microbatches) +
                                   " microbatches (raise it, or let the scheduler choose M)");
  }
  best->skipped = std::move(step.skipped);
  return std::move(*best);
}

}  // namespace internal

Status ValidateDynamicPlan(std::span<const SampleLength> samples, const ScheduleOptions& o,
                           const DynamicPlan& plan, std::span<const int64_t> groups) {
  THDPACK_RETURN_IF_ERROR(internal::ValidateOptions(o));
  auto bad = [](const std::string& what) {
    return Status::InvalidArgument("invalid dynamic plan: " + what);
  };
  const int64_t domain = static_cast<int64_t>(o.dp_size) * o.parallel.cp_size();
  if (plan.domain_size != domain) {
    return bad("domain_size " + Str(plan.domain_size) + " != DP * CP = " + Str(domain));
  }
  const int64_t m_count = plan.num_microbatches;
  if (m_count < 1 || static_cast<int64_t>(plan.microbatches.size()) != m_count) {
    return bad("num_microbatches = " + Str(m_count) + " must be >= 1 and the number of lists " +
               Str(static_cast<int64_t>(plan.microbatches.size())));
  }
  if (m_count % o.microbatch_multiple != 0) {
    return bad("M = " + Str(m_count) + " is not a multiple of k = " + Str(o.microbatch_multiple));
  }
  if (o.num_microbatches > 0 && m_count != o.num_microbatches) {
    return bad("M = " + Str(m_count) + " but the caller fixed M = " + Str(o.num_microbatches));
  }
  const SampleIdIndex index(samples);
  if (index.has_duplicates()) return bad("the input samples have duplicate ids");
  std::vector<uint8_t> seen(static_cast<size_t>(index.num_slots()), 0);
  // Where each sample is (by slot): its CP group of its microbatch, and its position.
  std::vector<internal::PlacedSample> placed(static_cast<size_t>(index.num_slots()));
  int64_t container = 0, position = 0;
  for (int64_t m = 0; m < m_count; ++m) {
    int64_t next_free = 0;  // groups by first rank, disjoint
    for (const CpGroup& g : plan.microbatches[static_cast<size_t>(m)]) {
      ++container;
      const std::string where = "microbatch " + Str(m) + ", group at rank " + Str(g.first_rank);
      if (g.num_ranks < 1 || g.first_rank < next_free ||
          static_cast<int64_t>(g.first_rank) + g.num_ranks > domain) {
        return bad(where + " of " + Str(g.num_ranks) +
                   " ranks: groups must lie in the domain, by first rank, without overlap");
      }
      next_free = static_cast<int64_t>(g.first_rank) + g.num_ranks;
      if (o.cp_sizes == ScheduleOptions::CpSizes::kPow2 && (g.num_ranks & (g.num_ranks - 1)) != 0) {
        return bad(where + ": size " + Str(g.num_ranks) + " is not a power of two (cp_sizes pow2)");
      }
      if (g.sample_ids.empty()) return bad(where + " is empty");
      THDPACK_ASSIGN_OR_RETURN(ParallelLayout layout, GroupLayout(o, g.num_ranks));
      int64_t sum = 0;
      for (int64_t id : g.sample_ids) {
        const int64_t i = index.Slot(id);
        if (i < 0) return bad("id " + Str(id) + " (" + where + ") is not an input sample");
        if (seen[static_cast<size_t>(i)]) return bad("id " + Str(id) + " appears twice");
        seen[static_cast<size_t>(i)] = 1;
        placed[static_cast<size_t>(i)] = {container, position++};
        sum += layout.PaddedLength(index.Length(i));
      }
      const int64_t t = layout.MicrobatchTokens(sum);
      const int64_t budget = layout.MicrobatchBudget(o.max_tokens_per_rank);
      if (t > budget) {
        return bad(where + " holds T = " + Str(t) + " padded tokens, over its budget " +
                   Str(budget) + " = " + Str(g.num_ranks) + " x max_tokens_per_rank");
      }
    }
  }
  THDPACK_ASSIGN_OR_RETURN(std::vector<Size> sizes, AllowedSizes(o, static_cast<int>(domain)));
  for (int64_t id : plan.skipped) {
    const int64_t i = index.Slot(id);
    if (i < 0) return bad("skipped id " + Str(id) + " is not an input sample");
    if (seen[static_cast<size_t>(i)]) return bad("id " + Str(id) + " is both scheduled and skipped");
    seen[static_cast<size_t>(i)] = 2;
    if (o.oversize != ScheduleOptions::OversizePolicy::kSkip) {
      return bad("id " + Str(id) + " was skipped but the oversize policy is 'error'");
    }
    // With groups, a sample that fits may leave with its group (CheckGroupPlacement).
    for (const Size& z : sizes) {
      if (o.keep_groups != ScheduleOptions::KeepGroups::kNone) break;
      if (z.layout.PaddedLength(index.Length(i)) <= z.capacity) {
        return bad("id " + Str(id) + " was skipped but fits a group of " + Str(z.c) + " ranks");
      }
    }
  }
  for (const SampleLength& s : samples) {
    if (!seen[static_cast<size_t>(index.Slot(s.id))]) {
      return bad("sample id " + Str(s.id) + " is neither scheduled nor skipped");
    }
  }
  if (groups.empty()) return Status::Ok();  // the group rule unchecked, as ValidatePlan's
  THDPACK_ASSIGN_OR_RETURN(internal::StepUnits units, internal::UnitsOfGroups(samples, o, groups));
  // Under dynamic CP both modes mean one CP group of one microbatch, adjacent.
  ScheduleOptions as_microbatch = o;
  as_microbatch.keep_groups = ScheduleOptions::KeepGroups::kMicrobatch;
  std::vector<internal::PlacedSample> by_input(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    by_input[i] = placed[static_cast<size_t>(index.Slot(samples[i].id))];
  }
  const DynUnitFit fit = FitOfDynamicUnits(samples, units, sizes);
  return internal::CheckGroupPlacement(
      samples, as_microbatch, units, by_input,
      [&](int32_t u) { return fit.fits[static_cast<size_t>(u)] != 0; });
}

Result<double> DynamicPlanStepTime(std::span<const SampleLength> samples,
                                   const ScheduleOptions& options, const DynamicPlan& plan,
                                   std::span<const EncoderWork> encoder) {
  if (!options.step_time.has_value()) {
    return Status::InvalidArgument("DynamicPlanStepTime: no step-time model in the options");
  }
  THDPACK_RETURN_IF_ERROR(ValidateDynamicPlan(samples, options, plan));
  const SampleIdIndex index(samples);
  THDPACK_ASSIGN_OR_RETURN(std::vector<double> seconds,
                           internal::EncoderSecondsBySlot(samples, index, *options.step_time,
                                                          encoder));
  return TimeOfPlan(index, options, plan, seconds);
}

}  // namespace thdpack
