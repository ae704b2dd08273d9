// thdpack/figures.h: the figures of a step and their JSON (docs/design.md section 10), one schema
// for `thdpack plan` and `thdpack run`.
//
// Per step (JSON keys in this order): step, epoch, num_microbatches, n_samples, n_skipped,
// skipped (ids left out by the oversize policy: never silent), n_empty (empty documents of a
// `megatron` source passed over while the step was read: not samples, never silent),
// n_truncated, truncated_tokens, truncated_targets (--oversize truncate: samples cut to the
// longest kept length, their tokens and loss tokens cut), n_split, split_pieces,
// split_lost_targets (--oversize split: samples cut into pieces as read, the pieces, the
// targets lost at the cuts), real_tokens, padded_tokens,
// sum_sq, n_loss_tokens, imbalance, pad_fraction, fill, flops (null when the cost model has no
// model dimensions), lower_bound, max_replica_cost, max_microbatch_spread, sim_step_time (the
// modelled step time in seconds, null without model dimensions), for dynamic plans cp_degrees
// ({"c": sequences on groups of c ranks}), for a blend sources ([{samples, real_tokens,
// loss_tokens}] per source of its list), then - unless summary_only - replicas: [{cost,
// microbatches: [{samples, real_tokens, padded_tokens, cost}]}] (for dynamic plans one per rank
// of the domain, samples empty: they are in groups), for dynamic plans groups: [per microbatch
// [{ranks: [domain indices], samples: [ids]}]], then the caller's extra fields (`run` adds bytes_sent, loss, time_*, ...). Costs are per rank
// (schedule.h); flops are the whole step's (all replicas, docs/design.md section 3).
//
// Determinism: numbers are printed by one formatter (integers exactly; doubles as the shortest
// text that reads back to the same double), so the same figures always give the same bytes and
// `plan` and `run` JSON compare byte for byte apart from the fields `run` adds.
//
// Thread-safety: pure functions.
#ifndef THDPACK_FIGURES_H_
#define THDPACK_FIGURES_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/cost.h"
#include "thdpack/data.h"
#include "thdpack/schedule.h"
#include "thdpack/status.h"

namespace thdpack {

// What a step (or a run) took of one source of a blend (thdpack/blend.h): its scheduled samples
// (those the oversize policy left out are not counted, as in n_samples), their real tokens and
// their loss tokens. Over the sources they sum to n_samples, real_tokens and n_loss_tokens.
struct SourceFigures {
  int64_t samples = 0;
  int64_t real_tokens = 0;
  int64_t loss_tokens = 0;
  friend bool operator==(const SourceFigures&, const SourceFigures&) = default;
};

// The scheduled samples of a step by source: every sample not in `skipped`, counted at its
// SampleLength::source in [0, num_sources). InvalidArgument for a source outside that range.
[[nodiscard]] Result<std::vector<SourceFigures>> CountBySource(
    std::span<const SampleLength> samples, std::span<const int64_t> skipped, int num_sources);

struct StepFigures {
  int64_t step = 0;
  int64_t epoch = 0;
  PlanFigures plan;
  // Training FLOPs of the step (all replicas): TrainingFlops(coef, padded_tokens, sum_sq);
  // 0 when no FLOPs model was given (printed as null).
  double flops = 0;
  bool has_flops = false;
  // M * DP * CP * max_tokens_per_rank: the padded tokens the step could have held (for fill).
  int64_t capacity_tokens = 0;
  std::vector<int64_t> skipped;                          // ids, in input order
  // Empty documents the source passed over while reading the step (StepSamples::n_empty).
  int64_t n_empty = 0;
  // --oversize truncate: the samples cut to the longest kept length, their tokens and loss
  // tokens cut (JSON n_truncated, truncated_tokens, truncated_targets; never silent).
  Truncation truncated;
  // --oversize split: the samples cut into pieces as the step was read, the pieces (samples of
  // the step, in n_samples), and the targets lost at the cuts (JSON n_split, split_pieces,
  // split_lost_targets; never silent).
  SplitCounts split;
  std::vector<std::vector<std::vector<int64_t>>> sample_ids;  // [replica][microbatch] ids
  // The modelled step time in seconds (schedule.h's PlanStepTime / DynamicPlanStepTime);
  // nullopt without model dimensions (printed as null).
  std::optional<double> sim_step_time;
  // Dynamic plans only (dynamic true): sequences per CP degree ({c, count}, c increasing) and,
  // with sample ids, the groups of every microbatch ([M][groups]).
  bool dynamic = false;
  std::vector<std::pair<int, int64_t>> cp_degrees;
  std::vector<std::vector<CpGroup>> groups;
  // With media: the plan's costs hold the encoder's term (JSON encoder_cost of the step, each
  // replica and each microbatch; absent without media).
  bool media = false;
  // With media, on a loader: its replica (media_replica >= 0) and, for each of its microbatches,
  // each CP rank's encoder cost and payload bytes (RankStep::media_rank_cost/bytes); JSON
  // media_ranks (replica, encoder_cost, payload_bytes, encoder_max_over_mean per microbatch).
  int media_replica = -1;
  std::vector<std::vector<double>> media_rank_cost;
  std::vector<std::vector<int64_t>> media_rank_bytes;
  // A blend: [D] what the step took of each source (CountBySource); empty for other data.
  std::vector<SourceFigures> sources;
};

// The FLOPs coefficients behind a cost spec (cost.h): a value for presets and dimensions
// ("llama2-7b", "llama3-8b", "l=..,h=..,..."), nullopt for "tokens" and "A,B". Errors: a bad
// spec (naming it).
[[nodiscard]] Result<std::optional<FlopsCoefficients>> FlopsFromCostSpec(std::string_view spec);

// Figures of one scheduled step. `samples` and `options` are what `plan` was made from.
// Errors: those of ComputePlanFigures (an invalid plan).
// With `encoder` (one EncoderWork per sample, media), the costs hold options.encoder_cost's term.
[[nodiscard]] Result<StepFigures> ComputeStepFigures(
    int64_t step, int64_t epoch, std::span<const SampleLength> samples,
    const ScheduleOptions& options, const Plan& plan,
    const std::optional<FlopsCoefficients>& flops, std::span<const EncoderWork> encoder = {});

// The same from figures already computed for `plan` (ScheduleWithFigures, schedule.h):
// no second pass over the plan. with_sample_ids false leaves sample_ids empty (for callers that
// print no per-sample detail). REQUIRES: plan_figures are ComputePlanFigures' for `plan`.
StepFigures MakeStepFigures(int64_t step, int64_t epoch, const ScheduleOptions& options,
                            const Plan& plan, PlanFigures plan_figures,
                            const std::optional<FlopsCoefficients>& flops,
                            bool with_sample_ids = true);

// Totals and extremes over steps.
struct SummaryFigures {
  int64_t n_steps = 0;
  int64_t first_epoch = 0;   // epoch of the first step
  int64_t last_epoch = 0;    // epoch of the last step
  int64_t num_microbatches = 0;      // total over steps
  int64_t max_num_microbatches = 0;
  int64_t n_samples = 0;
  int64_t n_skipped = 0;
  int64_t n_empty = 0;  // total over steps
  Truncation truncated;  // totals over steps
  SplitCounts split;     // totals over steps
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;
  double sum_sq = 0;          // double: whole-run totals may exceed int64
  int64_t n_loss_tokens = 0;
  int64_t capacity_tokens = 0;
  double mean_imbalance = 0;  // mean over steps
  double max_imbalance = 0;
  double pad_fraction = 0;    // 1 - real_tokens / padded_tokens over all steps
  double fill = 0;            // padded_tokens / capacity_tokens over all steps
  double flops = 0;           // total; has_flops when every step has FLOPs
  bool has_flops = false;
  double max_microbatch_spread = 0;
  double sim_step_time = 0;        // total over steps; has_sim_step_time when every step has one
  bool has_sim_step_time = false;
  std::vector<SourceFigures> sources;  // a blend: [D] totals over steps
};

SummaryFigures Summarize(std::span<const StepFigures> steps);

// Raw JSON values appended to an object: {"key", "<JSON text>"}. The text is inserted as is
// (the caller makes it valid JSON); keys must not repeat the standard ones.
using JsonFields = std::vector<std::pair<std::string, std::string>>;

// One step's JSON object on one line, no trailing newline.
std::string StepFiguresJson(const StepFigures& f, bool summary_only,
                            std::span<const std::pair<std::string, std::string>> extra_fields = {});

// Summary keys, in order: n_steps, first_epoch, last_epoch, num_microbatches,
// max_num_microbatches, n_samples, n_skipped, n_empty, n_truncated, truncated_tokens,
// truncated_targets, n_split, split_pieces, split_lost_targets, real_tokens, padded_tokens,
// sum_sq, n_loss_tokens, mean_imbalance, max_imbalance, pad_fraction, fill, flops (or null),
// max_microbatch_spread, sim_step_time (total, or null), sources (a blend), then extra_fields.
std::string SummaryFiguresJson(const SummaryFigures& s,
                               std::span<const std::pair<std::string, std::string>> extra_fields = {});

// The whole report: {"steps":[<step>,\n<step>...],\n"summary":{...}} plus a final newline,
// one step object per line. step_extra_fields is empty or holds one JsonFields per step.
std::string PlanReportJson(std::span<const StepFigures> steps, const SummaryFigures& summary,
                           bool summary_only, std::span<const JsonFields> step_extra_fields = {},
                           std::span<const std::pair<std::string, std::string>> summary_extra_fields = {});

}  // namespace thdpack

#endif  // THDPACK_FIGURES_H_
