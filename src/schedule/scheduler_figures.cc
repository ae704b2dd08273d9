// The figures of a plan (schedule.h ComputePlanFigures) and of an assignment (AssignmentFigures),
// from one function of its groups' sums (FiguresOfSums), the language model's cost and the
// encoder's term alike; and those of a dynamic plan (ComputeDynamicPlanFigures).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack {

namespace internal {
namespace {

// The figures of a plan from the sums of its groups, (d, m) at sums[d*M + m]. One code for
// ComputePlanFigures (sums taken over the plan, ids looked up) and AssignmentFigures (sums
// taken over the scheduler's arrays in input order): the same integer sums, so the same
// figures.
Result<PlanFigures> FiguresOfSums(const ScheduleOptions& options, int m_count,
                                  std::span<const GroupSums> sums, int64_t n_skipped) {
  PlanFigures f;
  f.num_microbatches = m_count;
  f.n_skipped = n_skipped;
  f.replicas.resize(options.dp_size);
  int64_t total_p = 0;
  GroupSums::Wide total_sq = 0;
  int64_t max_p = 0;
  GroupSums::Wide enc_patches = 0, enc_frame_sq = 0;
  double max_sample_cost = 0;
  for (int d = 0; d < options.dp_size; ++d) {
    ReplicaFigures& r = f.replicas[d];
    r.microbatches.resize(m_count);
    double lo = std::numeric_limits<double>::infinity();
    double hi = 0;
    for (int m = 0; m < m_count; ++m) {
      MicrobatchFigures& mb = r.microbatches[m];
      const GroupSums& g = sums[static_cast<size_t>(d) * m_count + m];
      mb.n_samples = g.n_samples;
      mb.real_tokens = g.real_tokens;
      mb.n_loss_tokens = g.n_loss_tokens;
      total_p += g.sum_p;
      total_sq += g.sum_sq;
      max_p = std::max(max_p, g.max_p);
      enc_patches += g.enc_patches;
      enc_frame_sq += g.enc_frame_sq;
      max_sample_cost = std::max(max_sample_cost, g.max_sample_cost);
      const MicrobatchCost mc = CostOfSums(g, options);
      if (mc.overflow || __builtin_add_overflow(f.sum_sq, mc.sum_sq, &f.sum_sq)) {
        return Status::OutOfRange("plan figures: sum of P^2 overflows int64");
      }
      mb.padded_tokens = mc.padded_tokens;
      mb.sum_sq = mc.sum_sq;
      mb.cost = mc.cost;
      mb.encoder_cost = mc.encoder_cost;
      r.cost += mb.cost;
      r.encoder_cost += mb.encoder_cost;
      lo = std::min(lo, mb.cost);
      hi = std::max(hi, mb.cost);
      f.n_samples += mb.n_samples;
      f.real_tokens += mb.real_tokens;
      f.padded_tokens += mb.padded_tokens;
      f.n_loss_tokens += mb.n_loss_tokens;
    }
    f.total_cost += r.cost;
    f.encoder_cost += r.encoder_cost;
    f.max_replica_cost = std::max(f.max_replica_cost, r.cost);
    f.max_microbatch_spread = std::max(f.max_microbatch_spread, hi - lo);
  }
  // Every sequence once, without tails: sum of cost(P) / CP, and the costliest one.
  const double cp = static_cast<double>(options.parallel.cp_size());
  const double encoder_total = EncoderTerm(options.encoder_cost, static_cast<double>(enc_patches),
                                           static_cast<double>(enc_frame_sq)) / cp;
  const double total_seq_cost =
      options.cost.Cost(f.n_samples, total_p, static_cast<double>(total_sq)) / cp + encoder_total;
  const double max_seq_cost = std::max(options.cost.SequenceCost(max_p) / cp, max_sample_cost);
  f.lower_bound = std::max(total_seq_cost / static_cast<double>(options.dp_size), max_seq_cost);
  if (options.pad_to_max_tokens) {
    // Every replica runs the plan's M microbatches of T tokens: their linear work is on every
    // replica whatever the assignment; the rest (P^2 and per-sequence terms) is what balances.
    const double fixed = options.cost.a * static_cast<double>(m_count) *
                         static_cast<double>(FixedMicrobatchTokens(options)) / cp;
    const double rest =
        options.cost.Cost(f.n_samples, 0, static_cast<double>(total_sq)) / cp + encoder_total;
    const double rest_max = options.cost.Cost(
        1, 0, static_cast<double>(max_p) * static_cast<double>(max_p)) / cp;
    f.lower_bound = fixed + std::max(rest / static_cast<double>(options.dp_size), rest_max);
  }
  f.imbalance = f.lower_bound > 0 ? f.max_replica_cost / f.lower_bound : 1.0;
  f.pad_fraction = f.padded_tokens > 0
                       ? 1.0 - static_cast<double>(f.real_tokens) / static_cast<double>(f.padded_tokens)
                       : 0.0;
  f.fill = static_cast<double>(f.padded_tokens) /
           (static_cast<double>(m_count) * options.dp_size * static_cast<double>(MicrobatchBudget(options)));
  return f;
}

}  // namespace

Result<PlanFigures> AssignmentFigures(const PreparedStep& step, const ScheduleOptions& options,
                                      const Assignment& a) {
  const std::vector<GroupSums> sums = AssignmentSums(step, a);
  return FiguresOfSums(options, a.num_microbatches, sums,
                       static_cast<int64_t>(step.skipped.size()));
}

}  // namespace internal

Result<PlanFigures> ComputePlanFigures(std::span<const SampleLength> samples,
                                       const ScheduleOptions& options, const Plan& plan,
                                       std::span<const EncoderWork> encoder) {
  const SampleIdIndex index(samples);
  THDPACK_RETURN_IF_ERROR(internal::ValidatePlanWithIndex(samples, index, options, plan));
  // The encoder work by id (a plain map: the reference, not the fast path).
  std::unordered_map<int64_t, EncoderWork> work;
  if (!options.encoder_cost.empty() && !encoder.empty()) {
    if (encoder.size() != samples.size()) {
      return Status::InvalidArgument("plan figures: " + std::to_string(encoder.size()) +
                                     " encoder works for " + std::to_string(samples.size()) + " samples");
    }
    bool any = false;
    for (const EncoderWork& w : encoder) any = any || w.patches != 0 || w.frame_sq != 0;
    for (size_t i = 0; any && i < samples.size(); ++i) work.emplace(samples[i].id, encoder[i]);
  }
  const int64_t total = static_cast<int64_t>(plan.sample_ids.size());
  const size_t groups = plan.offsets.size() - 1;
  std::vector<internal::GroupSums> sums(groups);
  for (size_t g = 0; g < groups; ++g) {
    for (int64_t k = plan.offsets[g]; k < plan.offsets[g + 1]; ++k) {
      if (k + internal::kPrefetchAhead < total) {
        index.Prefetch(plan.sample_ids[static_cast<size_t>(k + internal::kPrefetchAhead)]);
      }
      const int64_t slot = index.Slot(plan.sample_ids[static_cast<size_t>(k)]);
      const int64_t length = index.Length(slot);
      const int64_t p = options.parallel.PaddedLength(length);
      sums[g].Add(length, index.NTargets(slot), p);
      sums[g].last_p = p;
      if (!work.empty()) {
        const EncoderWork& w = work.at(plan.sample_ids[static_cast<size_t>(k)]);
        sums[g].AddEncoder(w.patches, w.frame_sq, internal::SampleCostWithEncoder(options, p, w));
      }
    }
  }
  return internal::FiguresOfSums(options, plan.num_microbatches, sums,
                                 static_cast<int64_t>(plan.skipped.size()));
}

// The figures of a dynamic plan: each group's microbatch figures on every rank of it (its
// layout's padding and cost), the domain's ranks in place of replicas.
Result<PlanFigures> ComputeDynamicPlanFigures(std::span<const SampleLength> samples,
                                              const ScheduleOptions& o, const DynamicPlan& plan) {
  THDPACK_RETURN_IF_ERROR(ValidateDynamicPlan(samples, o, plan));
  const SampleIdIndex index(samples);
  PlanFigures f;
  const int m_count = plan.num_microbatches;
  f.num_microbatches = m_count;
  f.n_skipped = static_cast<int64_t>(plan.skipped.size());
  f.replicas.resize(static_cast<size_t>(plan.domain_size));
  for (ReplicaFigures& r : f.replicas) r.microbatches.resize(static_cast<size_t>(m_count));
  std::vector<int64_t> padded;
  for (int m = 0; m < m_count; ++m) {
    for (const CpGroup& g : plan.microbatches[static_cast<size_t>(m)]) {
      THDPACK_ASSIGN_OR_RETURN(ParallelLayout layout, GroupLayout(o, g.num_ranks));
      MicrobatchFigures mb;
      padded.clear();
      for (int64_t id : g.sample_ids) {
        const int64_t i = index.Slot(id);
        padded.push_back(layout.PaddedLength(index.Length(i)));
        mb.real_tokens += index.Length(i);
        mb.n_loss_tokens += index.NTargets(i);
      }
      ScheduleOptions group_options = o;
      group_options.parallel = layout;
      const internal::MicrobatchCost mc = internal::ComputeMicrobatchCost(padded, group_options);
      if (mc.overflow || __builtin_add_overflow(f.sum_sq, mc.sum_sq, &f.sum_sq)) {
        return Status::OutOfRange("plan figures: sum of P^2 overflows int64");
      }
      mb.n_samples = static_cast<int64_t>(padded.size());
      mb.padded_tokens = mc.padded_tokens;
      mb.sum_sq = mc.sum_sq;
      mb.cost = mc.cost;
      f.n_samples += mb.n_samples;
      f.real_tokens += mb.real_tokens;
      f.padded_tokens += mb.padded_tokens;
      f.n_loss_tokens += mb.n_loss_tokens;
      f.total_cost += mb.cost * g.num_ranks;
      for (int r = g.first_rank; r < g.first_rank + g.num_ranks; ++r) {
        f.replicas[static_cast<size_t>(r)].microbatches[static_cast<size_t>(m)] = mb;
      }
    }
  }
  for (ReplicaFigures& r : f.replicas) {
    double lo = std::numeric_limits<double>::infinity(), hi = 0;
    for (const MicrobatchFigures& mb : r.microbatches) {
      r.cost += mb.cost;
      lo = std::min(lo, mb.cost);
      hi = std::max(hi, mb.cost);
    }
    f.max_replica_cost = std::max(f.max_replica_cost, r.cost);
    f.max_microbatch_spread = std::max(f.max_microbatch_spread, hi - lo);
  }
  f.lower_bound = f.total_cost / static_cast<double>(plan.domain_size);
  f.imbalance = f.lower_bound > 0 ? f.max_replica_cost / f.lower_bound : 1.0;
  f.pad_fraction = f.padded_tokens > 0 ? 1.0 - static_cast<double>(f.real_tokens) /
                                                   static_cast<double>(f.padded_tokens)
                                       : 0.0;
  f.fill = static_cast<double>(f.padded_tokens) /
           (static_cast<double>(m_count) * plan.domain_size *
            static_cast<double>(o.max_tokens_per_rank));
  return f;
}

}  // namespace thdpack
