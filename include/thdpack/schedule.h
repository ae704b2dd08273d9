// thdpack/schedule.h: which sample goes to which data-parallel replica and microbatch
// (docs/design.md sections 4, 5 and 10).
//
// Input: the (id, L, n_targets) of every sample of one step, in a fixed order (loader 0's
// samples first), and ScheduleOptions. Output: a Plan - M microbatches on every replica (the
// same M everywhere, as pipeline schedules require) and, for every (replica d, microbatch m), an
// ordered, non-empty list of sample ids - plus the ids left out by the oversize policy.
//
// Padding rule: thdpack/parallel_layout.h, with the options' `parallel` layout. Sequence i of
// real length L_i occupies P_i = parallel.PaddedLength(L_i) tokens; a microbatch holds
// T = parallel.MicrobatchTokens(sum P_i) tokens (the last sequence absorbs the SP tail). Budget:
// T <= MicrobatchBudget(options) = CP * max_tokens_per_rank for every microbatch of every replica.
//
// Costs use padded lengths: cost(P) = a*P + b*P^2 from the cost model. Every cost in a Plan's
// figures is PER RANK: a replica's microbatch is sharded over its CP ranks, so each rank computes
// cost(P)/CP of every sequence (docs/design.md section 3). imbalance is a ratio and is the same either
// way.
//
// Invariants of every Plan that Schedule returns (ValidatePlan checks them):
//   - every sample appears exactly once, or is listed in `skipped` (oversize policy kSkip);
//   - no microbatch exceeds the budget; M >= 1 and M is a multiple of microbatch_multiple (k);
//     M equals num_microbatches when the caller fixed it;
//   - every (replica, microbatch) list is non-empty;
//   - the Plan is a pure function of (samples, options): the same bytes on every rank and every
//     run, so ranks may each compute it instead of broadcasting it. Ties are broken by sample id;
//     no unordered container's order reaches the output; no threads are used.
//
// Thread-safety: pure functions of their arguments; safe to call concurrently.
#ifndef THDPACK_SCHEDULE_H_
#define THDPACK_SCHEDULE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/cost.h"
#include "thdpack/data.h"
#include "thdpack/parallel_layout.h"
#include "thdpack/status.h"

namespace thdpack {

// Samples come in as SampleLength (id, L, n_targets) and histograms as HistogramRow
// (length, count), both from thdpack/data.h, what the data sources produce. REQUIRES for
// scheduling: ids unique within a step, L >= 1, 0 <= n_targets <= L.

struct ScheduleOptions {
  // A sample whose padded length alone exceeds the microbatch budget.
  enum class OversizePolicy {
    kError,  // InvalidArgument naming the sample id, its length and the budget
    kSkip,   // left out of the plan and listed in Plan::skipped (never silently)
    // Cut to its first LongestKept(options) tokens BEFORE scheduling (the step does it on the
    // loader, TruncateSample; `plan` on lengths, TruncateLengths), the cut tokens and targets
    // counted. A sample still oversize when it reaches the scheduler is an error, as kError.
    kTruncate,
    // Cut into pieces of at most LongestKept(options) tokens BEFORE the step is read: the
    // source itself yields the pieces (OpenStepSource, OpenSplitSource in data.h), each a
    // sample and a sequence of its own. A sample still oversize here is an error, as kError.
    kSplit,
  };
  enum class Scheduler {
    kSequential,  // Megatron-LM's dp_balanced: next-fit in arrival order (without its assert)
    kBalanced,    // cost-aware: smallest straggler cost, then fewest microbatches
    kDynamic,     // a CP group per microbatch and sequence: ScheduleDynamic (not Schedule)
  };
  // Samples kept together (post-training: a DPO pair, a GRPO group), named by a group id per
  // sample (the `groups` argument of Schedule / ScheduleDynamic).
  enum class KeepGroups {
    kNone,        // every sample placed on its own (`groups` must be empty)
    kMicrobatch,  // a group in one microbatch of one replica, its samples adjacent, input order
    kReplica,     // a group on one replica, its samples in any of that replica's microbatches
  };
  // The CP group sizes the dynamic scheduler may use.
  enum class CpSizes {
    kAny,   // any size 1..D
    kPow2,  // powers of two only (1, 2, 4, ... <= D)
  };

  int dp_size = 1;                 // DP >= 1
  // CP, TP, SP and extra alignment of every microbatch, and so the padding rule
  // (thdpack/parallel_layout.h); validated where it was made. Default: CP = TP = 1.
  ParallelLayout parallel;
  // REQUIRED (> 0): padded tokens one CP rank may hold in one microbatch. A replica's
  // microbatch holds at most CP * max_tokens_per_rank padded tokens, which must fit int32.
  int64_t max_tokens_per_rank = 0;
  CostModel cost;                  // default "tokens" (a=1, b=0); a, b >= 0, not both 0
  int microbatch_multiple = 1;     // k >= 1: M is a multiple of k (pipeline / VPP groups)
  int num_microbatches = 0;        // 0: the scheduler chooses M; else M fixed (multiple of k)
  OversizePolicy oversize = OversizePolicy::kError;
  Scheduler scheduler = Scheduler::kBalanced;
  // Balanced only, free M: how many values of M (M_min, M_min + k, ...) are tried at most.
  // The search also stops as soon as a plan within 1% of the lower bound is found, since no
  // larger M could then improve the straggler by more than 1%.
  int max_microbatch_search = 8;
  // Dynamic only: the group sizes it may use (default any).
  CpSizes cp_sizes = CpSizes::kAny;
  // Groups kept together (balanced and dynamic schedulers; docs/scheduling.md "Groups"). A
  // group is balanced as a unit: its samples keep their own padded lengths and costs, summed.
  // Under the dynamic scheduler both modes put a group in one CP group of one microbatch (a
  // dynamic plan has no replicas: the ranks change with the microbatch).
  KeepGroups keep_groups = KeepGroups::kNone;
  // Static shapes for CUDA graphs and torch.compile (docs/scheduling.md "Static shapes"; the
  // static schedulers only - the dynamic one refuses both). max_seqs_per_microbatch S > 0: at
  // most S sequences in a microbatch, budgeted by the scheduler with the tokens (the balanced
  // scheduler places samples as units, scheduler_groups.cc; the sequential one starts a new
  // microbatch at S); the step hands attention cu_seqlens of exactly S+1 offsets (PadOffsets,
  // pack.h). 0: no cap.
  int max_seqs_per_microbatch = 0;
  // Every microbatch holds exactly T = CP * max_tokens_per_rank tokens (FixedMicrobatchTokens),
  // the last sequence absorbing T - sum P, as it absorbs the SP and rank-multiple tails. The
  // cost charges that padding linearly only (a*T; no P^2 term): the layers run on every token
  // of the fixed shape, attention reads the real lengths and skips it. REQUIRES
  // CP * max_tokens_per_rank to be a multiple of the layout's token quantum.
  bool pad_to_max_tokens = false;
  // The step-time model (cost.h). Required by the dynamic scheduler, which minimises the step
  // time it gives; PlanStepTime / DynamicPlanStepTime report it for any plan. Unset (nullopt)
  // with the `tokens` and `A,B` costs, which have no model dimensions.
  std::optional<StepTimeModel> step_time;
  // The encoder's term (images and video, thdpack/media.h), in the cost's unit: with it, a
  // sample of EncoderWork w costs cost(P)/CP + EncoderTerm(w)/CP per rank (its items are
  // placed whole over the replica's CP ranks), and the static schedulers balance the sum - the
  // balanced one through its unit scheduler (scheduler_groups.cc), each sample a unit with its
  // own cost. Default empty (0, 0): no encoder term, whatever work is given. The step-time
  // model takes the term in seconds instead (StepTimeCoefficients::encoder: the dynamic
  // scheduler's cost and every plan's modelled time); the dynamic scheduler refuses this one.
  EncoderCost encoder_cost;
};

// "sequential" / "balanced" / "dynamic", "error" / "skip" / "truncate" / "split", "any" /
// "pow2".
std::string_view SchedulerName(ScheduleOptions::Scheduler scheduler);
std::string_view OversizePolicyName(ScheduleOptions::OversizePolicy policy);
// Inverse of the names above; InvalidArgument naming the text otherwise.
[[nodiscard]] Result<ScheduleOptions::Scheduler> ParseSchedulerName(std::string_view name);
[[nodiscard]] Result<ScheduleOptions::OversizePolicy> ParseOversizePolicy(std::string_view name);
std::string_view CpSizesName(ScheduleOptions::CpSizes sizes);
[[nodiscard]] Result<ScheduleOptions::CpSizes> ParseCpSizes(std::string_view name);
// "none" / "microbatch" / "replica".
std::string_view KeepGroupsName(ScheduleOptions::KeepGroups keep);
[[nodiscard]] Result<ScheduleOptions::KeepGroups> ParseKeepGroups(std::string_view name);

// The one rule of keep_groups beside the scheduler and the group ids, asked by the schedulers,
// the plan's validator and the step runner: InvalidArgument when keep_groups is set under the
// sequential scheduler (Megatron-LM's order knows no groups), or when group ids are given
// (`ids`, e.g. "24 group ids" or "group_field 'uid'"; empty: none) while keep_groups is 'none'.
[[nodiscard]] Status CheckKeepGroups(const ScheduleOptions& options, std::string_view ids);

// The padded tokens one replica's microbatch may hold: CP * max_tokens_per_rank.
inline int64_t MicrobatchBudget(const ScheduleOptions& o) {
  return o.parallel.MicrobatchBudget(o.max_tokens_per_rank);
}

// ---- The plan. ----

// Assignment of samples to (replica, microbatch), stored flat: the list of (d, m) is
// sample_ids[offsets[d*M + m] .. offsets[d*M + m + 1]).
struct Plan {
  int num_microbatches = 0;                // M
  int dp_size = 0;                         // DP
  std::vector<int64_t> sample_ids;         // every scheduled id once
  std::vector<int64_t> offsets;            // [DP*M + 1], offsets[0] = 0
  std::vector<int64_t> skipped;            // oversize ids left out, in input order
  ScheduleOptions::Scheduler scheduler = ScheduleOptions::Scheduler::kBalanced;  // who made it

  // The ordered ids of microbatch m on replica d. REQUIRES: 0 <= d < DP, 0 <= m < M.
  std::span<const int64_t> Microbatch(int d, int m) const {
    const size_t k = static_cast<size_t>(d) * static_cast<size_t>(num_microbatches) +
                     static_cast<size_t>(m);
    return std::span<const int64_t>(sample_ids).subspan(
        static_cast<size_t>(offsets[k]), static_cast<size_t>(offsets[k + 1] - offsets[k]));
  }
};

// Schedules one step with the sequential or the balanced scheduler (the dynamic one gives a
// DynamicPlan: ScheduleDynamic; here it is an InvalidArgument error saying so).
// Errors (InvalidArgument unless noted), each naming what is wrong:
//   - an option out of range; duplicate ids; L < 1; n_targets outside [0, L];
//   - oversize policy kError and a sample whose padded length exceeds the budget (names the id,
//     its length, its padded length and the budget);
//   - fewer (non-skipped) samples than DP * k, or than DP * M for a fixed M ("too few samples");
//   - a fixed M into which the samples cannot be packed.
// Time: O(n log n) for validation and (balanced) the sort by length, plus O(n) (sequential)
// or O(n log DP) per value of M tried and a bounded local search (balanced); docs/scheduling.md
// has the algorithms and measured times (1M samples, DP=512: about 0.35 s on one core).
//
// Groups (options.keep_groups not kNone): `groups` holds one group id per sample (same
// length as `samples`; any int64 values, a group being the samples that share one), and
// every group of the plan obeys the mode. The balanced scheduler then places groups as units
// (scheduler_groups.cc: O(G log G + G * DP * M * g) per M tried, G groups of at most g
// samples); the sequential one is refused. Oversize: a group with an oversize sample, or
// (kMicrobatch) whose padded tokens together exceed the microbatch budget, is an error naming
// the group (policy kError) or is skipped whole, every sample of it in Plan::skipped (kSkip):
// a pair is never half trained. More errors: `groups` of the wrong length, or given with
// kNone; fewer groups than microbatches (kMicrobatch) or than replicas (kReplica).
//
// Encoder work (`encoder`: one EncoderWork per sample, or empty for none): charged with
// options.encoder_cost (above). Errors: a size other than the samples', a negative value.
[[nodiscard]] Result<Plan> Schedule(std::span<const SampleLength> samples,
                                    const ScheduleOptions& options,
                                    std::span<const int64_t> groups = {},
                                    std::span<const EncoderWork> encoder = {});

// Checks every invariant listed at the top of this file for `plan` against the inputs it was
// made from (except determinism, which needs two runs). OK or the first violation found.
// With options.keep_groups and `groups`, also the group rule; without `groups` it is not
// checked, and a skipped sample that fits is accepted (its group may have left with another).
[[nodiscard]] Status ValidatePlan(std::span<const SampleLength> samples,
                                  const ScheduleOptions& options, const Plan& plan,
                                  std::span<const int64_t> groups = {});

// The samples of a step by id, for checking and measuring plans in O(n) without a sort: a
// direct table indexed by id - min id when the ids are dense (a step's ids are a range of the
// source's ids, in any order) and the values fit int32, else a sorted copy searched by
// bisection. Lookups in the table are independent loads (no position -> sample chain), which
// is what makes a pass over a plan of 1M ids fast. Holds no pointer to `samples`.
class SampleIdIndex {
 public:
  explicit SampleIdIndex(std::span<const SampleLength> samples);
  // A slot in [0, num_slots()), one per distinct id of `samples`, or -1 for any other id.
  int64_t Slot(int64_t id) const {
    if (dense_) {
      const uint64_t k = static_cast<uint64_t>(id) - static_cast<uint64_t>(min_id_);
      return k < table_.size() && table_[k].length > 0 ? static_cast<int64_t>(k) : -1;
    }
    return SortedSlot(id);
  }
  // Hints the cache that `id` is looked up soon (a pass over a plan calls it a few ids ahead:
  // the lookups are then bandwidth-bound instead of latency-bound).
  void Prefetch(int64_t id) const {
    const uint64_t k = static_cast<uint64_t>(id) - static_cast<uint64_t>(min_id_);
    if (dense_ && k < table_.size()) __builtin_prefetch(&table_[k]);
  }
  int64_t num_slots() const {
    return static_cast<int64_t>(dense_ ? table_.size() : sorted_.size());
  }
  // L and n_targets of the sample in `slot` (the first one with duplicate ids).
  // REQUIRES: slot = Slot(id) >= 0.
  int64_t Length(int64_t slot) const {
    return dense_ ? table_[static_cast<size_t>(slot)].length : sorted_[static_cast<size_t>(slot)].length;
  }
  int64_t NTargets(int64_t slot) const {
    return dense_ ? table_[static_cast<size_t>(slot)].n_targets
                  : sorted_[static_cast<size_t>(slot)].n_targets;
  }
  bool has_duplicates() const { return has_duplicates_; }

 private:
  struct DenseEntry {
    int32_t length;  // 0: no sample has this id
    int32_t n_targets;
  };
  int64_t SortedSlot(int64_t id) const;

  bool dense_ = false;
  bool has_duplicates_ = false;
  int64_t min_id_ = 0;
  std::vector<DenseEntry> table_;    // dense: [max id - min id + 1]
  std::vector<SampleLength> sorted_;  // sparse: by id, then input position
};

// ---- Figures of a plan (docs/design.md section 10). All costs per rank (see top of file). ----

struct MicrobatchFigures {
  int64_t n_samples = 0;
  double encoder_cost = 0;    // the encoder's part of `cost` (ScheduleOptions::encoder_cost)
  int64_t real_tokens = 0;    // sum L
  int64_t padded_tokens = 0;  // T, SP tail included
  int64_t sum_sq = 0;         // sum P^2, the last sequence's P including the SP tail
  int64_t n_loss_tokens = 0;  // sum n_targets
  double cost = 0;            // sum cost(P)/CP, P as in sum_sq
};

struct ReplicaFigures {
  double cost = 0;                            // sum of its microbatch costs: its step time
  double encoder_cost = 0;                    // the encoder's part of it
  std::vector<MicrobatchFigures> microbatches;  // [M]
};

struct PlanFigures {
  int num_microbatches = 0;
  int64_t n_samples = 0;   // scheduled
  int64_t n_skipped = 0;
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;
  int64_t sum_sq = 0;
  int64_t n_loss_tokens = 0;
  double total_cost = 0;        // sum over replicas
  double encoder_cost = 0;      // the encoder's part of total_cost
  double max_replica_cost = 0;  // the straggler
  // max(sum_i cost(P_i)/CP / DP, max_i cost(P_i)/CP) over the scheduled samples, with the
  // per-sequence padded lengths P_i (no SP tail: that depends on the plan). Under
  // pad_to_max_tokens, M * a * T / CP (the fixed shapes' linear work, on every replica) plus
  // the same bound over the rest of the cost (the P^2 and per-sequence terms).
  // With encoder work, each sample's cost is cost(P_i)/CP + EncoderTerm(w_i)/CP.
  double lower_bound = 0;
  double imbalance = 0;         // max_replica_cost / lower_bound
  double pad_fraction = 0;      // 1 - real_tokens / padded_tokens
  double fill = 0;              // padded_tokens / (M * DP * CP * max_tokens_per_rank)
  // Largest (max - min microbatch cost) inside one replica: the pipeline-bubble figure.
  double max_microbatch_spread = 0;
  std::vector<ReplicaFigures> replicas;  // [DP]
};

// Figures of `plan`. REQUIRES: ValidatePlan(samples, options, plan) is OK (checked: its error
// is returned otherwise). OutOfRange if sum_sq overflows int64.
// `encoder`: the samples' encoder work, as Schedule takes it.
[[nodiscard]] Result<PlanFigures> ComputePlanFigures(std::span<const SampleLength> samples,
                                                     const ScheduleOptions& options,
                                                     const Plan& plan,
                                                     std::span<const EncoderWork> encoder = {});

// A plan and its figures.
struct ScheduledPlan {
  Plan plan;
  PlanFigures figures;
  // With options.step_time: PlanStepTime's value for `plan`, from the scheduler's own arrays.
  std::optional<double> sim_step_time;
};

// Schedule, and the figures ComputePlanFigures gives for its plan (equal field for field: the
// same integer sums), computed from the scheduler's own arrays: no id lookup, and no
// second validation of the plan it has just made (ValidatePlan and ComputePlanFigures stay the
// reference, compared with this on random steps in the tests). Errors: those of Schedule, and
// OutOfRange if sum_sq overflows int64 (as ComputePlanFigures).
[[nodiscard]] Result<ScheduledPlan> ScheduleWithFigures(std::span<const SampleLength> samples,
                                                        const ScheduleOptions& options,
                                                        std::span<const int64_t> groups = {},
                                                        std::span<const EncoderWork> encoder = {});
// The same, consuming `samples`: their memory is released as soon as the step is prepared (the
// scheduler keeps its own arrays), so a large step does not hold both while it is scheduled.
[[nodiscard]] Result<ScheduledPlan> ScheduleWithFigures(std::vector<SampleLength>&& samples,
                                                        const ScheduleOptions& options);

// ---- The step-time model applied to plans (cost.h; docs/scheduling.md). ----

// The modelled step time (seconds) of a static plan: replica d is the group of the CP
// contiguous domain ranks d*CP .. d*CP + CP - 1 in every microbatch, each sequence costs
// t(P, CP) with P its padded length (the SP tail on a microbatch's last sequence, as packed),
// and SimulateStepTime gives the step. With encoder work (`encoder`, one EncoderWork per
// sample, or empty) and the model's encoder term (StepTimeCoefficients::encoder), each
// microbatch also takes its samples' encoder seconds over CP. REQUIRES: ValidatePlan OK
// (checked) and options.step_time set (InvalidArgument otherwise).
[[nodiscard]] Result<double> PlanStepTime(std::span<const SampleLength> samples,
                                          const ScheduleOptions& options, const Plan& plan,
                                          std::span<const EncoderWork> encoder = {});

// ---- The dynamic scheduler (scheduler_dynamic.cc; docs/scheduling.md "Dynamic CP"). ----
//
// The DP x CP ranks form one domain of D = DP * CP ranks, numbered dp*CP + cp. In each
// microbatch the plan splits (part of) the domain into CP groups of contiguous ranks, of any
// size 1..D (or powers of two with CpSizes::kPow2), and gives each group its sequences, packed
// and zigzag-sharded over the group with the group's own layout: ParallelLayout(c, TP, SP,
// extra alignment) of options.parallel with CP = c. A rank in no group holds nothing in that
// microbatch.

// One CP group of one microbatch.
struct CpGroup {
  int first_rank = 0;  // domain index of its first rank; it holds first_rank .. + num_ranks - 1
  int num_ranks = 1;   // c
  std::vector<int64_t> sample_ids;  // its sequences, in arrival order, non-empty
};

struct DynamicPlan {
  int domain_size = 0;       // D = DP * CP
  int num_microbatches = 0;  // M: the same on every rank
  // [M]: the groups of each microbatch, by first rank, disjoint. A microbatch may be empty
  // only where M was raised to a multiple of k or to a fixed M.
  std::vector<std::vector<CpGroup>> microbatches;
  std::vector<int64_t> skipped;  // oversize ids left out (policy kSkip), input order
  double step_time = 0;          // the model's step time of this plan (seconds)
  // How it was made: "groups" (list scheduling) or "static CP=c" (a balanced plan at one CP
  // size, kept because it was fastest).
  std::string method;
};

// kTruncate on lengths: every sample longer than `longest` keeps its first `longest` tokens,
// n_targets becoming min(n_targets, longest - 1) - exact for a sample whose targets are all its
// tokens but the first (every sample of a lengths or mock source), an upper bound of the kept
// loss tokens for one with a target mask (its mask is not read). Returns what was cut.
struct Truncation {
  int64_t samples = 0;  // samples cut
  int64_t tokens = 0;   // their tokens cut
  int64_t targets = 0;  // their loss tokens (targets) cut
};
Truncation TruncateLengths(std::span<SampleLength> samples, int64_t longest);

// The longest sample a step keeps under options (any oversize policy): the largest L whose
// padded length fits a microbatch - for the static schedulers PaddedLength(L) <= the usable
// budget of CP * max_tokens_per_rank, for the dynamic one the same in the widest allowed group
// of the DP x CP domain. Longer samples are the oversize ones (an error, or left out under
// kSkip). A resumed run keeps the samples of every later step only if this is unchanged under
// kSkip (thdpack/run_state.h). Errors: the options' own (InvalidArgument).
[[nodiscard]] Result<int64_t> LongestKept(const ScheduleOptions& options);

// T of every microbatch under pad_to_max_tokens (CP * max_tokens_per_rank); 0 without it (T
// then follows the sequences: ParallelLayout::MicrobatchTokens). PackOptions::fixed_tokens.
inline int64_t FixedMicrobatchTokens(const ScheduleOptions& o) {
  return o.pad_to_max_tokens ? MicrobatchBudget(o) : 0;
}

// The fewest samples (after the oversize policy) a step needs for options to schedule it:
// DP x M with M fixed, else DP x k, for the static schedulers (every microbatch of every replica
// holds one); 1 for the dynamic one. Fewer is Schedule's "too few samples" error.
int64_t MinStepSamples(const ScheduleOptions& options);

// The layout of a group of c ranks: options.parallel with CP = c.
// REQUIRES c >= 1 (InvalidArgument otherwise).
[[nodiscard]] Result<ParallelLayout> GroupLayout(const ScheduleOptions& options, int c);

// Plans one step with the dynamic scheduler, minimising the modelled step time. Invariants
// (ValidateDynamicPlan checks them): every sample exactly once or in `skipped` (only under
// kSkip, only if its padded length exceeds the largest group's budget D * max_tokens_per_rank:
// the oversize policy), groups of allowed sizes inside the domain, disjoint in a microbatch,
// each within its budget T <= c * max_tokens_per_rank; M >= 1, a multiple of k, equal to a
// fixed M; deterministic (ties by sample id, no threads). Errors (InvalidArgument): options
// out of range, no step_time model ("the dynamic scheduler needs model dimensions"), bad
// samples, an oversize sample under kError (naming its id, length and the budget), no sample
// to schedule, a fixed M too small for the plan.
// Groups (options.keep_groups): as Schedule's, each group in one CP group of one microbatch
// whatever the mode, its samples adjacent in input order; list scheduling then moves groups
// as moldable units (sum of the members' t(P, c)).
// Encoder work (`encoder`: one EncoderWork per sample, or empty): with the step-time model's
// encoder term (StepTimeCoefficients::encoder, seconds), a sequence costs each rank of its
// group t(P, c) + E(w) / c - the items are spread whole over the group's ranks - so the
// groups balance the language model plus the encoder. Without a term, or without work, every
// plan is what it was. ScheduleOptions::encoder_cost (the static schedulers' term, in the
// cost's unit) stays refused here. Errors: a size other than the samples', negative work.
[[nodiscard]] Result<DynamicPlan> ScheduleDynamic(std::span<const SampleLength> samples,
                                                  const ScheduleOptions& options,
                                                  std::span<const int64_t> groups = {},
                                                  std::span<const EncoderWork> encoder = {});

// Checks the invariants above for `plan` against its inputs (except determinism and
// step_time). OK or the first violation found.
[[nodiscard]] Status ValidateDynamicPlan(std::span<const SampleLength> samples,
                                         const ScheduleOptions& options, const DynamicPlan& plan,
                                         std::span<const int64_t> groups = {});

// The modelled step time of a dynamic plan: each group's microbatch takes the sum of t(P, c)
// over its sequences (P in the group's layout, the SP tail on the last) and of their encoder
// seconds over c (`encoder`, as ScheduleDynamic takes it), SimulateStepTime the step.
// REQUIRES: ValidateDynamicPlan OK (checked) and options.step_time set.
[[nodiscard]] Result<double> DynamicPlanStepTime(std::span<const SampleLength> samples,
                                                 const ScheduleOptions& options,
                                                 const DynamicPlan& plan,
                                                 std::span<const EncoderWork> encoder = {});

// The figures of a dynamic plan, with the domain's ranks in place of replicas: `replicas`
// has D entries; rank r's microbatch m holds the figures of its group in m (zeros when idle),
// its cost being cost(P)/c per sequence. Totals count each sequence once; lower_bound is the
// total cost over D; fill is padded_tokens / (M * D * max_tokens_per_rank).
// REQUIRES: ValidateDynamicPlan OK (checked).
[[nodiscard]] Result<PlanFigures> ComputeDynamicPlanFigures(std::span<const SampleLength> samples,
                                                            const ScheduleOptions& options,
                                                            const DynamicPlan& plan);

// ---- Fast path from a length histogram (no per-sample expansion). ----

// One kind of pack (microbatch) and how many packs of that kind there are.
struct PackPattern {
  std::vector<int64_t> lengths;  // real lengths of its sequences, in decreasing order
  int64_t count = 0;             // packs with exactly this content
  int64_t padded_tokens = 0;     // T of one such pack
};

struct HistogramPacking {
  std::vector<PackPattern> patterns;  // deterministic order (the order they were closed)
  int64_t num_packs = 0;
  int64_t n_sequences = 0;       // packed
  int64_t n_skipped = 0;         // oversize sequences left out (policy kSkip)
  std::vector<HistogramRow> skipped;  // their lengths and counts
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;
  // ceil(sum P / usable budget): no packing needs fewer packs. The usable budget is the
  // largest sum of P a pack may hold (the budget, rounded down to CP*TP with SP).
  int64_t lower_bound = 0;
  // real_tokens / (num_packs * budget): the figure Krell et al. call efficiency.
  double efficiency = 0;
};

// Packs a histogram into the fewest microbatches of MicrobatchBudget(options) tokens it finds,
// by best-fit decreasing over counts: sequences longest first; each goes to the open pack with
// the least room that still holds it (a new pack when none does), moved in bulk - all packs
// with the same room take the same decision at once. Uses the parallel layout,
// max_tokens_per_rank and oversize; ignores dp_size, the cost model, k and
// the scheduler. O(R * B) with R histogram rows and B = budget / alignment distinct rooms, and
// independent of the number of sequences. Equal in pack count to best-fit decreasing on the
// expanded samples (and so to Schedule with DP = 1, k = 1, tokens cost).
// Errors: L < 1 or count < 0 (naming the row); oversize rows under kError.
[[nodiscard]] Result<HistogramPacking> PackHistogram(std::span<const HistogramRow> histogram,
                                                     const ScheduleOptions& options);

// The samples a histogram stands for: ids 0, 1, ... in row order (count ids per row, as an
// unshuffled histogram source numbers them),
// n_targets = L - 1. REQUIRES: the histogram is valid (as PackHistogram checks).
std::vector<SampleLength> ExpandHistogram(std::span<const HistogramRow> histogram);

// The Plan of a histogram packing on DP = 1 (one microbatch per pack, patterns in order), with
// the ids of ExpandHistogram(histogram): each length's ids are handed out in increasing order.
// REQUIRES (checked): `packing` came from PackHistogram(histogram, options), options.dp_size
// == 1 and num_packs is a multiple of microbatch_multiple.
[[nodiscard]] Result<Plan> HistogramPackingToPlan(std::span<const HistogramRow> histogram,
                                                  const HistogramPacking& packing,
                                                  const ScheduleOptions& options);

// ---- A whole histogram step planned in bulk (what `thdpack plan` does with histograms). ----

// One kind of microbatch of a HistogramPlan: every microbatch of the class holds exactly these
// sequences.
struct MicrobatchClass {
  std::vector<int64_t> lengths;  // real lengths, in arrival order (ids increasing)
  int64_t count = 0;             // microbatches with this content
  MicrobatchFigures figures;     // of ONE such microbatch
};

struct HistogramPlan {
  // The figures ComputePlanFigures gives for Schedule's plan of ExpandHistogram(histogram)
  // (ids from first_id): integers equal, doubles equal up to the order of summation
  // (max_microbatch_spread exactly). `replicas` is left empty: per-microbatch detail is in
  // `classes`, and per-sample ids are not produced.
  PlanFigures figures;
  std::vector<MicrobatchClass> classes;  // microbatches by content, in bin order of their first
  std::vector<int64_t> skipped;          // oversize ids left out (policy kSkip), increasing
};

// Plans the samples a histogram stands for - ids first_id, first_id + 1, ... in row order,
// n_targets = L - 1, as an unshuffled histogram source numbers one epoch - without one object
// per sample: the balanced scheduler replayed on classes of equal microbatches
// (scheduler_histogram_plan.cc). Time O(rows x classes x log classes), independent of the
// number of samples (Wikipedia-512, 16.3M samples: milliseconds).
// Returns nullopt - the caller then expands the histogram and calls Schedule - unless the
// replay provably equals Schedule: DP = 1, k = 1, M free, the balanced scheduler, no SP tail
// (sp off or TP = 1), row lengths strictly increasing, at least one sample scheduled, no
// oversize sample under policy kError (Schedule's error names it), and Schedule's sequential
// candidate needing more microbatches than best-fit decreasing (otherwise it may be chosen).
// Errors: options out of range (as Schedule).
[[nodiscard]] Result<std::optional<HistogramPlan>> PlanHistogram(
    std::span<const HistogramRow> histogram, int64_t first_id, const ScheduleOptions& options);

}  // namespace thdpack

#endif  // THDPACK_SCHEDULE_H_
