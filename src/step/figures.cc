// Step figures and their JSON (one schema for `plan` and `run`).
#include "thdpack/figures.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

namespace thdpack {
namespace {

using Json = nlohmann::ordered_json;

// Appends `"key":raw` fields to the JSON text of an object ("{...}").
std::string AppendRawFields(std::string object_text,
                            std::span<const std::pair<std::string, std::string>> fields) {
  if (fields.empty()) return object_text;
  object_text.pop_back();  // the closing brace
  bool first = object_text.size() == 1;  // "{" alone: an empty object
  for (const auto& [key, raw] : fields) {
    if (!first) object_text += ',';
    first = false;
    object_text += Json(key).dump();
    object_text += ':';
    object_text += raw;
  }
  object_text += '}';
  return object_text;
}

// The keys a step's and a summary's JSON share, written once for both (figures.h lists them
// in order): a step's come from its StepFigures `f` and their PlanFigures `p`, a summary's all
// from its SummaryFigures (passed as both). Each call writes a run of keys that stands in both
// objects in the same order; the keys of one kind alone stand between the runs.

// What the oversize policy cut, then the token totals (sum_sq an integer in a step, a double in
// a summary).
template <typename Figures, typename Totals>
void PutCutsAndTotals(Json& j, const Figures& f, const Totals& p) {
  j["n_truncated"] = f.truncated.samples;
  j["truncated_tokens"] = f.truncated.tokens;
  j["truncated_targets"] = f.truncated.targets;
  j["n_split"] = f.split.samples;
  j["split_pieces"] = f.split.pieces;
  j["split_lost_targets"] = f.split.lost_targets;
  j["real_tokens"] = p.real_tokens;
  j["padded_tokens"] = p.padded_tokens;
  j["sum_sq"] = p.sum_sq;
  j["n_loss_tokens"] = p.n_loss_tokens;
}

// Padding and fill, then the FLOPs (null without a FLOPs model).
template <typename Figures, typename Totals>
void PutFillAndFlops(Json& j, const Figures& f, const Totals& p) {
  j["pad_fraction"] = p.pad_fraction;
  j["fill"] = p.fill;
  j["flops"] = f.has_flops ? Json(f.flops) : Json(nullptr);
}

}  // namespace

Result<std::optional<FlopsCoefficients>> FlopsFromCostSpec(std::string_view spec) {
  THDPACK_RETURN_IF_ERROR(ParseCostSpec(spec).status());
  Result<ModelDims> dims = ParseModelDims(spec);
  if (!dims.ok()) {
    if (dims.status().code() == StatusCode::kNotFound) return std::optional<FlopsCoefficients>();
    return dims.status();
  }
  THDPACK_ASSIGN_OR_RETURN(FlopsCoefficients coef, ComputeFlopsCoefficients(*dims));
  return std::optional<FlopsCoefficients>(coef);
}

Result<StepFigures> ComputeStepFigures(int64_t step, int64_t epoch,
                                       std::span<const SampleLength> samples,
                                       const ScheduleOptions& options, const Plan& plan,
                                       const std::optional<FlopsCoefficients>& flops,
                                       std::span<const EncoderWork> encoder) {
  THDPACK_ASSIGN_OR_RETURN(PlanFigures figures,
                           ComputePlanFigures(samples, options, plan, encoder));
  StepFigures f = MakeStepFigures(step, epoch, options, plan, std::move(figures), flops);
  f.media = !encoder.empty();
  return f;
}

StepFigures MakeStepFigures(int64_t step, int64_t epoch, const ScheduleOptions& options,
                            const Plan& plan, PlanFigures plan_figures,
                            const std::optional<FlopsCoefficients>& flops, bool with_sample_ids) {
  StepFigures f;
  f.step = step;
  f.epoch = epoch;
  f.plan = std::move(plan_figures);
  if (flops.has_value()) {
    f.has_flops = true;
    f.flops = TrainingFlops(*flops, f.plan.padded_tokens, static_cast<double>(f.plan.sum_sq));
  }
  f.capacity_tokens = static_cast<int64_t>(plan.num_microbatches) * plan.dp_size *
                      MicrobatchBudget(options);
  f.skipped = plan.skipped;
  if (!with_sample_ids) return f;
  f.sample_ids.resize(static_cast<size_t>(plan.dp_size));
  for (int d = 0; d < plan.dp_size; ++d) {
    auto& replica = f.sample_ids[static_cast<size_t>(d)];
    replica.reserve(static_cast<size_t>(plan.num_microbatches));
    for (int m = 0; m < plan.num_microbatches; ++m) {
      std::span<const int64_t> ids = plan.Microbatch(d, m);
      replica.emplace_back(ids.begin(), ids.end());
    }
  }
  return f;
}

Result<std::vector<SourceFigures>> CountBySource(std::span<const SampleLength> samples,
                                                 std::span<const int64_t> skipped,
                                                 int num_sources) {
  std::vector<SourceFigures> out(static_cast<size_t>(std::max(num_sources, 0)));
  std::vector<int64_t> left(skipped.begin(), skipped.end());
  std::sort(left.begin(), left.end());
  for (const SampleLength& x : samples) {
    if (x.source < 0 || x.source >= num_sources) {
      return Status::InvalidArgument("CountBySource: sample id " + std::to_string(x.id) +
                                     " has source " + std::to_string(x.source) + ", outside [0, " +
                                     std::to_string(num_sources) + ")");
    }
    if (std::binary_search(left.begin(), left.end(), x.id)) continue;
    SourceFigures& f = out[static_cast<size_t>(x.source)];
    ++f.samples;
    f.real_tokens += x.length;
    f.loss_tokens += x.n_targets;
  }
  return out;
}

namespace {

Json SourcesJson(const std::vector<SourceFigures>& sources) {
  Json out = Json::array();
  for (const SourceFigures& f : sources) {
    Json s;
    s["samples"] = f.samples;
    s["real_tokens"] = f.real_tokens;
    s["loss_tokens"] = f.loss_tokens;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

SummaryFigures Summarize(std::span<const StepFigures> steps) {
  SummaryFigures s;
  s.n_steps = static_cast<int64_t>(steps.size());
  if (steps.empty()) return s;
  s.first_epoch = steps.front().epoch;
  s.last_epoch = steps.back().epoch;
  s.has_flops = true;
  s.has_sim_step_time = true;
  double imbalance_sum = 0;
  for (const StepFigures& f : steps) {
    const PlanFigures& p = f.plan;
    s.num_microbatches += p.num_microbatches;
    s.max_num_microbatches = std::max<int64_t>(s.max_num_microbatches, p.num_microbatches);
    s.n_samples += p.n_samples;
    s.n_skipped += p.n_skipped;
    s.n_empty += f.n_empty;
    s.truncated.samples += f.truncated.samples;
    s.truncated.tokens += f.truncated.tokens;
    s.truncated.targets += f.truncated.targets;
    s.split.samples += f.split.samples;
    s.split.pieces += f.split.pieces;
    s.split.lost_targets += f.split.lost_targets;
    s.real_tokens += p.real_tokens;
    s.padded_tokens += p.padded_tokens;
    s.sum_sq += static_cast<double>(p.sum_sq);
    s.n_loss_tokens += p.n_loss_tokens;
    s.capacity_tokens += f.capacity_tokens;
    imbalance_sum += p.imbalance;
    s.max_imbalance = std::max(s.max_imbalance, p.imbalance);
    s.max_microbatch_spread = std::max(s.max_microbatch_spread, p.max_microbatch_spread);
    s.has_flops = s.has_flops && f.has_flops;
    s.flops += f.flops;
    s.has_sim_step_time = s.has_sim_step_time && f.sim_step_time.has_value();
    s.sim_step_time += f.sim_step_time.value_or(0.0);
    if (s.sources.size() < f.sources.size()) s.sources.resize(f.sources.size());
    for (size_t d = 0; d < f.sources.size(); ++d) {
      s.sources[d].samples += f.sources[d].samples;
      s.sources[d].real_tokens += f.sources[d].real_tokens;
      s.sources[d].loss_tokens += f.sources[d].loss_tokens;
    }
  }
  if (!s.has_flops) s.flops = 0;
  if (!s.has_sim_step_time) s.sim_step_time = 0;
  s.mean_imbalance = imbalance_sum / static_cast<double>(steps.size());
  s.pad_fraction = s.padded_tokens > 0 ? 1.0 - static_cast<double>(s.real_tokens) /
                                                   static_cast<double>(s.padded_tokens)
                                       : 0.0;
  s.fill = s.capacity_tokens > 0
               ? static_cast<double>(s.padded_tokens) / static_cast<double>(s.capacity_tokens)
               : 0.0;
  return s;
}

std::string StepFiguresJson(const StepFigures& f, bool summary_only,
                            std::span<const std::pair<std::string, std::string>> extra_fields) {
  const PlanFigures& p = f.plan;
  Json j;
  j["step"] = f.step;
  j["epoch"] = f.epoch;
  j["num_microbatches"] = p.num_microbatches;
  j["n_samples"] = p.n_samples;
  j["n_skipped"] = p.n_skipped;
  j["skipped"] = f.skipped;
  j["n_empty"] = f.n_empty;
  PutCutsAndTotals(j, f, p);
  j["imbalance"] = p.imbalance;
  PutFillAndFlops(j, f, p);
  j["lower_bound"] = p.lower_bound;
  j["max_replica_cost"] = p.max_replica_cost;
  j["max_microbatch_spread"] = p.max_microbatch_spread;
  j["sim_step_time"] = f.sim_step_time.has_value() ? Json(*f.sim_step_time) : Json(nullptr);
  if (f.media) j["encoder_cost"] = p.encoder_cost;
  if (f.dynamic) {
    Json degrees = Json::object();
    for (const auto& [c, count] : f.cp_degrees) degrees[std::to_string(c)] = count;
    j["cp_degrees"] = std::move(degrees);
  }
  if (!f.sources.empty()) j["sources"] = SourcesJson(f.sources);
  if (!summary_only) {
    Json replicas = Json::array();
    for (size_t d = 0; d < p.replicas.size(); ++d) {
      const ReplicaFigures& r = p.replicas[d];
      Json rj;
      rj["cost"] = r.cost;
      if (f.media) rj["encoder_cost"] = r.encoder_cost;
      Json mbs = Json::array();
      for (size_t m = 0; m < r.microbatches.size(); ++m) {
        const MicrobatchFigures& mb = r.microbatches[m];
        Json mj;
        mj["samples"] = d < f.sample_ids.size() && m < f.sample_ids[d].size()
                            ? Json(f.sample_ids[d][m])
                            : Json::array();
        mj["real_tokens"] = mb.real_tokens;
        mj["padded_tokens"] = mb.padded_tokens;
        mj["cost"] = mb.cost;
        if (f.media) mj["encoder_cost"] = mb.encoder_cost;
        mbs.push_back(std::move(mj));
      }
      rj["microbatches"] = std::move(mbs);
      replicas.push_back(std::move(rj));
    }
    j["replicas"] = std::move(replicas);
    if (f.media_replica >= 0) {
      Json mr;
      mr["replica"] = f.media_replica;
      mr["encoder_cost"] = f.media_rank_cost;
      mr["payload_bytes"] = f.media_rank_bytes;
      Json balance = Json::array();  // the busiest CP rank's encoder cost over the mean
      for (const std::vector<double>& c : f.media_rank_cost) {
        double sum = 0, most = 0;
        for (double x : c) {
          sum += x;
          most = std::max(most, x);
        }
        balance.push_back(sum > 0 ? most * static_cast<double>(c.size()) / sum : 1.0);
      }
      mr["encoder_max_over_mean"] = std::move(balance);
      j["media_ranks"] = std::move(mr);
    }
    if (f.dynamic) {
      Json microbatches = Json::array();
      for (const auto& groups : f.groups) {
        Json gs = Json::array();
        for (const CpGroup& g : groups) {
          Json ranks = Json::array();
          for (int r = g.first_rank; r < g.first_rank + g.num_ranks; ++r) ranks.push_back(r);
          Json gj;
          gj["ranks"] = std::move(ranks);
          gj["samples"] = g.sample_ids;
          gs.push_back(std::move(gj));
        }
        microbatches.push_back(std::move(gs));
      }
      j["groups"] = std::move(microbatches);
    }
  }
  return AppendRawFields(j.dump(), extra_fields);
}

std::string SummaryFiguresJson(const SummaryFigures& s,
                               std::span<const std::pair<std::string, std::string>> extra_fields) {
  Json j;
  j["n_steps"] = s.n_steps;
  j["first_epoch"] = s.first_epoch;
  j["last_epoch"] = s.last_epoch;
  j["num_microbatches"] = s.num_microbatches;
  j["max_num_microbatches"] = s.max_num_microbatches;
  j["n_samples"] = s.n_samples;
  j["n_skipped"] = s.n_skipped;
  j["n_empty"] = s.n_empty;
  PutCutsAndTotals(j, s, s);
  j["mean_imbalance"] = s.mean_imbalance;
  j["max_imbalance"] = s.max_imbalance;
  PutFillAndFlops(j, s, s);
  j["max_microbatch_spread"] = s.max_microbatch_spread;
  j["sim_step_time"] = s.has_sim_step_time ? Json(s.sim_step_time) : Json(nullptr);
  if (!s.sources.empty()) j["sources"] = SourcesJson(s.sources);
  return AppendRawFields(j.dump(), extra_fields);
}

std::string PlanReportJson(std::span<const StepFigures> steps, const SummaryFigures& summary,
                           bool summary_only, std::span<const JsonFields> step_extra_fields,
                           std::span<const std::pair<std::string, std::string>> summary_extra_fields) {
  std::string out = "{\"steps\":[";
  for (size_t i = 0; i < steps.size(); ++i) {
    out += i == 0 ? "\n" : ",\n";
    if (i < step_extra_fields.size()) {
      out += StepFiguresJson(steps[i], summary_only, step_extra_fields[i]);
    } else {
      out += StepFiguresJson(steps[i], summary_only);
    }
  }
  out += "],\n\"summary\":";
  out += SummaryFiguresJson(summary, summary_extra_fields);
  out += "}\n";
  return out;
}

}  // namespace thdpack
