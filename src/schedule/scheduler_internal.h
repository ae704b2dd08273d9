// Internal pieces shared by the schedulers (not part of the public API).
//
// Every scheduler works on a PreparedStep: the samples that survived validation and the
// oversize policy, in input (arrival) order, indexed 0..n-1, with their padded lengths and
// per-rank costs. It produces an Assignment: groups of those indices per (replica, microbatch),
// turned into a Plan of ids at the end.
#ifndef THDPACK_SCHEDULE_SCHEDULER_INTERNAL_H_
#define THDPACK_SCHEDULE_SCHEDULER_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "thdpack/schedule.h"

namespace thdpack::internal {

// An allocator that leaves a new element of a trivial type uninitialised (value-initialises
// nothing): a vector sized once and then written in full skips the zero fill.
template <typename T>
class OverwriteAllocator : public std::allocator<T> {
 public:
  template <typename U>
  struct rebind {
    using other = OverwriteAllocator<U>;
  };
  OverwriteAllocator() = default;
  template <typename U>
  OverwriteAllocator(const OverwriteAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using StepArray = std::vector<T, OverwriteAllocator<T>>;

struct PreparedStep {
  StepArray<int64_t> ids;      // [n] kept samples, input order
  // L and n_targets fit int32: a kept sample's P fits the budget, which fits int32.
  StepArray<int32_t> length;     // [n] L
  StepArray<int32_t> n_targets;  // [n]
  StepArray<int64_t> padded;   // [n] P
  StepArray<double> cost;      // [n] cost(P) / CP (+ EncoderTerm / CP with encoder work)
  // With encoder work charged (ScheduleOptions::encoder_cost, some sample's work > 0): each
  // kept sample's EncoderWork; empty otherwise.
  StepArray<int64_t> enc_patches;   // [n]
  StepArray<int64_t> enc_frame_sq;  // [n]
  bool has_encoder() const { return !enc_patches.empty(); }
  std::vector<int64_t> skipped;  // oversize ids left out, input order
  // The largest sum of P one microbatch may hold: the budget, rounded down to a multiple of
  // CP*TP with SP (MicrobatchTokens(sum) <= budget  <=>  sum <= capacity).
  int64_t capacity = 0;
  int64_t total_padded = 0;      // sum P
  double total_cost = 0;         // sum cost
  double max_cost = 0;           // max cost
  size_t size() const { return ids.size(); }
  // max(total_cost / DP, max_cost): no plan has a smaller straggler.
  double LowerBound(int dp_size) const;
};

// Checks the options (ranges, overflow) and names the first bad one.
[[nodiscard]] Status ValidateOptions(const ScheduleOptions& options);

// The usable sum-of-P capacity of a microbatch (see PreparedStep::capacity).
int64_t UsableCapacity(const ScheduleOptions& options);

// The sequences a microbatch may hold: max_seqs_per_microbatch, or INT64_MAX without a cap.
inline int64_t SequenceCap(const ScheduleOptions& o) {
  return o.max_seqs_per_microbatch > 0 ? o.max_seqs_per_microbatch : INT64_MAX;
}

// Validates the samples (ids unique, L >= 1, n_targets in [0, L]) and applies the oversize
// policy. REQUIRES: ValidateOptions(options) is OK.
// `encoder`: one EncoderWork per sample, or empty (checked: its size, values >= 0).
[[nodiscard]] Result<PreparedStep> PrepareStep(std::span<const SampleLength> samples,
                                               const ScheduleOptions& options,
                                               std::span<const EncoderWork> encoder = {});

// A sample's cost per rank with encoder work: (cost(P) + EncoderTerm(w)) / CP. One formula for
// the scheduler's arrays and the figures' reference.
inline double SampleCostWithEncoder(const ScheduleOptions& o, int64_t p, const EncoderWork& w) {
  return (o.cost.SequenceCost(p) + EncoderTerm(o.encoder_cost, static_cast<double>(w.patches),
                                               static_cast<double>(w.frame_sq))) /
         static_cast<double>(o.parallel.cp_size());
}

// Whether two samples share an id (PrepareStep's check): a bitmap over dense ids, else
// SampleIdIndex; compared with a std::map on random samples in the tests.
bool HasDuplicateIds(std::span<const SampleLength> samples);

// "too few samples" check shared by the schedulers: n >= DP * k.
[[nodiscard]] Status CheckEnoughSamples(const PreparedStep& step, const ScheduleOptions& options);

// Groups of PreparedStep indices: group (d, m) is items[offsets[d*M+m] .. offsets[d*M+m+1]),
// in the order they will appear in the Plan.
struct Assignment {
  int num_microbatches = 0;
  int dp_size = 0;
  std::vector<int32_t> items;
  std::vector<int64_t> offsets;
  // Optional, from the scheduler that made it: group_of[i], the group of PreparedStep index i
  // (as GroupOfItems gives it); empty when not kept.
  std::vector<int32_t> group_of;
};

// Exact per-rank costs of an assignment (the SP tail charged to each microbatch's last
// sequence, as packing lays it out).
struct AssignmentCost {
  double max_replica_cost = 0;
  double max_spread = 0;  // largest max-min microbatch cost inside one replica
};
AssignmentCost ComputeAssignmentCost(const PreparedStep& step, const ScheduleOptions& options,
                                     const Assignment& a);

// Relative tolerance of the "within 1%" rule of the balanced schedulers' objective.
inline constexpr double kNearBest = 1.01;

// The choice among the candidates of an M search (ScheduleBalanced, ScheduleGroups): among
// those within 1% of the least straggler, the fewest microbatches; then the least straggler;
// then the least microbatch spread; ties to the earlier. `m` and `cost` are parallel; returns
// the chosen index. REQUIRES: non-empty.
size_t ChooseCandidate(std::span<const int> m, std::span<const AssignmentCost> cost);

// Cost of one microbatch of padded lengths `padded` (in order), per rank, the SP tail on the
// last sequence. Also returns T and sum P^2 (false on int64 overflow of sum P^2).
struct MicrobatchCost {
  int64_t padded_tokens = 0;
  int64_t sum_sq = 0;
  double cost = 0;
  double encoder_cost = 0;  // the encoder's part of cost
  bool overflow = false;
};
MicrobatchCost ComputeMicrobatchCost(std::span<const int64_t> padded,
                                     const ScheduleOptions& options);

// The integer sums of one group (microbatch m of replica d) of an assignment or a plan: all
// that its figures and cost need. Sums of integers do not depend on the order they are taken
// in, so a pass over the step in input order (AssignmentFigures) gives exactly the figures of
// a pass over the plan (ComputePlanFigures). The last sample of the group in plan order takes
// the SP tail; its P is set by the caller.
struct GroupSums {
  __extension__ typedef unsigned __int128 Wide;
  int64_t n_samples = 0;
  int64_t real_tokens = 0;
  int64_t n_loss_tokens = 0;
  int64_t sum_p = 0;
  Wide sum_sq = 0;     // sum P^2 (P < 2^32: no overflow below 2^64 samples)
  int64_t max_p = 0;
  int64_t last_p = 0;  // P of the last sample in plan order
  // With encoder work: its sums, and the costliest sample (SampleCostWithEncoder).
  Wide enc_patches = 0;
  Wide enc_frame_sq = 0;
  double max_sample_cost = 0;
  void AddEncoder(int64_t patches, int64_t frame_sq, double sample_cost) {
    enc_patches += static_cast<Wide>(patches);
    enc_frame_sq += static_cast<Wide>(frame_sq);
    max_sample_cost = std::max(max_sample_cost, sample_cost);
  }
  void Add(int64_t length, int64_t n_targets, int64_t p) {
    ++n_samples;
    real_tokens += length;
    n_loss_tokens += n_targets;
    sum_p += p;
    sum_sq += static_cast<Wide>(static_cast<uint64_t>(p) * static_cast<uint64_t>(p));
    max_p = std::max(max_p, p);
  }
};

// T, sum P^2 and cost of a microbatch from its sums: the tail (T - sum P, with SP) added to the
// last P, cost = (a T + b sum P^2) / CP (CostModel::Cost). overflow: sum P^2 exceeds int64.
MicrobatchCost CostOfSums(const GroupSums& sums, const ScheduleOptions& options);

// The sums of every group of `a`, in one pass over the step in input order (sequential reads;
// the writes go to the DP*M sums), plus each group's last P in plan order.
std::vector<GroupSums> AssignmentSums(const PreparedStep& step, const Assignment& a);

// Passes over a plan look ids up this far ahead (SampleIdIndex::Prefetch).
inline constexpr int64_t kPrefetchAhead = 16;

// ValidatePlan with the index of `samples` already built (ComputePlanFigures reuses it).
[[nodiscard]] Status ValidatePlanWithIndex(std::span<const SampleLength> samples,
                                           const SampleIdIndex& index,
                                           const ScheduleOptions& options, const Plan& plan,
                                           std::span<const int64_t> groups = {});

// group_of[i]: the group (d*M + m) of PreparedStep index i in `a` (n = the step's size).
std::vector<int32_t> GroupOfItems(const Assignment& a, size_t n);
// a.group_of when the assignment keeps it, else GroupOfItems in *scratch.
const std::vector<int32_t>& GroupOf(const Assignment& a, size_t n,
                                    std::vector<int32_t>* scratch);
// P of the last sample of group g of `a` in plan order (the one that takes the SP tail); 0 for
// an empty group.
inline int64_t LastPadded(const PreparedStep& step, const Assignment& a, size_t g) {
  if (a.offsets[g + 1] == a.offsets[g]) return 0;
  return step.padded[static_cast<size_t>(a.items[static_cast<size_t>(a.offsets[g + 1] - 1)])];
}

Plan ToPlan(const PreparedStep& step, const Assignment& a, ScheduleOptions::Scheduler who);

// The figures of the plan ToPlan(step, a, ...) makes, from the step's own arrays (no id lookup):
// the same sums in the same order as ComputePlanFigures, so equal field for field.
// REQUIRES: `a` came from a scheduler on `step` and `options`. OutOfRange if sum_sq overflows.
[[nodiscard]] Result<PlanFigures> AssignmentFigures(const PreparedStep& step,
                                                    const ScheduleOptions& options,
                                                    const Assignment& a);

// Megatron-LM dp_balanced semantics (see scheduler_sequential.cc). fixed_m = 0: free M.
[[nodiscard]] Result<Assignment> ScheduleSequential(const PreparedStep& step,
                                                    const ScheduleOptions& options, int fixed_m);

// Switches of the balanced scheduler for the tests, which compare its fast paths with their
// plain forms on random steps. The defaults are what Schedule uses.
struct BalancedTuning {
  bool plain_refill = false;  // refill microbatches with heaps whatever M (no scan)
  // the sequential candidate's exact cost always computed (never left out by its bound)
  bool plain_sequential = false;
  int* sequential_left_out = nullptr;  // when set, counts the times the bound left it out
  // step A by the heap sample by sample, never a run of equal P by the merge of two sorted
  // sequences (PlaceRunMerged)
  bool plain_lpt = false;
  int* lpt_runs_merged = nullptr;    // when set, counts the runs placed by the merge
  int* lpt_runs_fallback = nullptr;  // ... and those of them that rounding sent back to the heap
};

// A lower bound of ComputeAssignmentCost(step, options, a).max_replica_cost: the largest
// per-replica sum of step.cost, less 1e-5 relative for rounding (how the balanced scheduler
// leaves out a sequential candidate that cannot be chosen; compared with the exact cost on
// random steps in the tests).
double MaxReplicaCostLowerBound(const PreparedStep& step, const Assignment& a);

// The cost-aware scheduler with its M search (see scheduler_balanced.cc). With `figures`, also
// the chosen plan's figures (AssignmentFigures; its error when they overflow), computed once
// for every candidate instead of a separate cost pass.
[[nodiscard]] Result<Assignment> ScheduleBalanced(const PreparedStep& step,
                                                  const ScheduleOptions& options,
                                                  ScheduleOptions::Scheduler* chosen,
                                                  PlanFigures* figures = nullptr,
                                                  const BalancedTuning& tuning = {});

// The step's indices in rank order: decreasing padded length, ties by increasing id (the order
// the balanced scheduler places samples in). The fast version uses a direct table over dense
// ids and a radix sort on P, O(n + range of ids); it falls back to the plain comparison sort
// (the reference, compared with it on random steps in the tests) for sparse ids.
// With `padded`, also P by rank (step.padded[order[k]]).
std::vector<int32_t> SortByPaddedThenId(const PreparedStep& step,
                                        std::vector<int64_t>* padded = nullptr);
std::vector<int32_t> SortByPaddedThenIdPlain(const PreparedStep& step);

// Best-fit decreasing bin count of the step's padded lengths into `capacity`: the plain
// per-sample reference of the histogram fast path, also the balanced search's hint for M.
int64_t BestFitDecreasingBins(const PreparedStep& step);

// ScheduleDynamic (scheduler_dynamic.cc); plain = true is its reference: every window's
// maximum computed in full and no window search skipped, which must give the same plan.
[[nodiscard]] Result<DynamicPlan> ScheduleDynamicImpl(std::span<const SampleLength> samples,
                                                      const ScheduleOptions& options, bool plain,
                                                      std::span<const int64_t> groups = {},
                                                      std::span<const EncoderWork> encoder = {});

// Encoder work as the schedulers take it: one EncoderWork a sample, or none (InvalidArgument
// naming both counts otherwise); with `values`, each sum >= 0 (InvalidArgument naming the
// sample). Returns whether some sample has work (false without `values`).
[[nodiscard]] Result<bool> CheckEncoderWork(std::span<const SampleLength> samples,
                                            std::span<const EncoderWork> encoder,
                                            bool values = true);

// E(w) of each sample (StepTimeModel::EncoderSeconds), seconds on one rank, by the slot of
// `index` over `samples`; empty when no sample has work or the model has no encoder term.
// Errors: CheckEncoderWork's.
[[nodiscard]] Result<std::vector<double>> EncoderSecondsBySlot(
    std::span<const SampleLength> samples, const SampleIdIndex& index,
    const StepTimeModel& model, std::span<const EncoderWork> encoder);

// ---- Groups kept together (scheduler_groups.cc; ScheduleOptions::keep_groups). ----

// The groups of a step's samples as units, numbered by their first sample in input order.
// With kNone (and no `groups`), every sample is a unit of its own.
struct StepUnits {
  std::vector<int32_t> unit_of;  // [n]: the unit of input sample i
  std::vector<int64_t> value;    // [U]: the group id of each unit
  int32_t size() const { return static_cast<int32_t>(value.size()); }
};
// Errors: `groups` not of the samples' length with a mode, or non-empty with kNone.
[[nodiscard]] Result<StepUnits> UnitsOfGroups(std::span<const SampleLength> samples,
                                              const ScheduleOptions& options,
                                              std::span<const int64_t> groups);

// The oversize rule of groups, one place for the scheduler and the validator: for each unit,
// the sum of its samples' padded lengths, whether one of them is oversize (over the usable
// capacity), and whether the unit can be scheduled - no oversize sample and, under
// kMicrobatch, a sum within the capacity and at most max_seqs_per_microbatch samples.
struct UnitFit {
  std::vector<int64_t> sum_p;
  std::vector<uint8_t> has_oversize;
  std::vector<uint8_t> fits;
  std::vector<int64_t> n_samples;
};
UnitFit FitOfUnits(std::span<const SampleLength> samples, const ScheduleOptions& options,
                   const StepUnits& units);

// The oversize rule of groups on a prepared step: a unit with a skipped (oversize) sample, or
// (kMicrobatch) whose sum of P exceeds step->capacity, leaves `step` whole - an error naming
// the group under kError, its ids in step->skipped (input order) under kSkip. Returns the unit
// of each PreparedStep index that stays.
[[nodiscard]] Result<std::vector<int32_t>> ApplyGroups(std::span<const SampleLength> samples,
                                                       const ScheduleOptions& options,
                                                       const StepUnits& units,
                                                       PreparedStep* step);

// The balanced scheduler over units (unit_of: ApplyGroups's), with its own M search and the
// same choice rule as ScheduleBalanced. kMicrobatch: a unit in one bin, its samples adjacent
// in input order; kReplica: a unit on one replica.
[[nodiscard]] Result<Assignment> ScheduleGroups(const PreparedStep& step,
                                                const ScheduleOptions& options,
                                                const std::vector<int32_t>& unit_of);

// Checks a plan's groups. where[i]: the container of input sample i in the plan (a microbatch
// of a replica, a CP group of a microbatch) and its position in the plan's flat order; -1 for
// a skipped sample. `fits(u)` says whether unit u could have been scheduled (no oversize
// sample, and under kMicrobatch its sum within a microbatch): a skipped unit must not. Under
// kMicrobatch container must be the microbatch, kReplica the replica.
struct PlacedSample {
  int64_t container = -1;
  int64_t position = -1;
};
[[nodiscard]] Status CheckGroupPlacement(std::span<const SampleLength> samples,
                                         const ScheduleOptions& o, const StepUnits& units,
                                         std::span<const PlacedSample> where,
                                         const std::function<bool(int32_t)>& fits);

// PlanStepTime of the plan ToPlan(step, a) makes, from the scheduler's arrays: no validation,
// no id index (the same lengths in the same order, so the same seconds; PlanStepTime is the
// reference, compared on random steps). InvalidArgument without options.step_time.
[[nodiscard]] Result<double> AssignmentStepTime(const PreparedStep& step,
                                                const ScheduleOptions& options,
                                                const Assignment& a);

}  // namespace thdpack::internal

#endif  // THDPACK_SCHEDULE_SCHEDULER_INTERNAL_H_
