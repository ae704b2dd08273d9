// Opening the step runner (StepRunner::Create, thdpack/step_runner.h), before its first step:
// the options checked against the world and each other (the topology, the budget, the batch, a
// caller-fed source's limits, the fields, keep_groups' group field), who reads (ReadsShare),
// each reader's source and step reader opened and moved to the run's start, that start shared
// from world rank 0, and the process groups of the static step - the loaders (the DP group at
// tp = cp = pp = 0; with --data-on all every DP group) and, with tp0, each replica (its loader
// first, then the others by world rank). The dynamic step's groups: InitDynamic
// (dynamic_step.cc). Also the names of DataOn (--data-on).
// Sends: the job's agreement (AgreeOnJob, step_job.cc), one agreement of the checks over the
// world, the start state (ShareStart), the splits of the groups. Depends on: step_job.cc,
// step_read.cc (StartReading, ShareStart), step_keep_groups.cc (FindGroupField).
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

// The run's fields as a columnar source reads them (SourceField, thdpack/data.h): each dtype's
// Arrow format. bfloat16 has none in Arrow: refused by name.
Result<std::vector<SourceField>> SourceFieldsOf(std::span<const FieldSpec> fields) {
  std::vector<SourceField> out;
  for (const FieldSpec& f : fields) {
    std::string format;
    switch (f.dtype) {
      case FieldDtype::kFloat32: format = "f"; break;
      case FieldDtype::kFloat64: format = "g"; break;
      case FieldDtype::kFloat16: format = "e"; break;
      case FieldDtype::kInt32: format = "i"; break;
      case FieldDtype::kInt64: format = "l"; break;
      case FieldDtype::kUInt8: format = "C"; break;
      case FieldDtype::kBool: format = "b"; break;
      case FieldDtype::kBFloat16:
        return Status::InvalidArgument(
            "field " + f.ToString() + ": Arrow has no bfloat16, so no column can hold it " +
            "(store float32 and declare float32; or feed the samples)");
    }
    out.push_back({f.name, f.per_token(), format, f.width(), FieldDtypeSize(f.dtype)});
  }
  return out;
}

}  // namespace

std::string_view DataOnName(DataOn mode) { return mode == DataOn::kAll ? "all" : "tp0"; }

Result<DataOn> ParseDataOn(std::string_view text) {
  if (text == "tp0") return DataOn::kTp0;
  if (text == "all") return DataOn::kAll;
  return Status::InvalidArgument("--data-on: \"" + std::string(text) +
                                 "\" is not a mode: expected tp0 or all");
}

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

bool ReadsShare(const Coord& c, const StepRunnerOptions& options) {
  const bool all = options.data_on == DataOn::kAll;
  if (options.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic) {
    return c.cp == 0 && (all || (c.tp == 0 && c.pp == 0));
  }
  return all || (c.tp == 0 && c.cp == 0 && c.pp == 0);
}

Status StepRunner::Impl::Init() {
  // First the job itself: ranks given different options would fail the checks below for
  // different reasons, or pass them and exchange messages of different shapes.
  THDPACK_RETURN_IF_ERROR(AgreeOnJob(world_, StepJobEntries(opts_, topo_)));
  Status local;
  if (world_.size() != topo_.world_size()) {
    local = Status::InvalidArgument("StepRunner: the world has " + std::to_string(world_.size()) +
                                    " ranks, the topology " + topo_.ToString() + " needs " +
                                    std::to_string(topo_.world_size()));
  } else if (opts_.schedule.max_tokens_per_rank <= 0) {
    local = Status::InvalidArgument("StepRunner: max_tokens_per_rank = " +
                                    std::to_string(opts_.schedule.max_tokens_per_rank) +
                                    " must be > 0");
  } else if (opts_.schedule.dp_size != topo_.dp_size()) {
    local = Status::InvalidArgument("StepRunner: schedule dp_size = " +
                                    std::to_string(opts_.schedule.dp_size) +
                                    " must be the topology's " + topo_.ToString());
  } else if (const ParallelLayout& p = opts_.schedule.parallel;
             p.cp_size() != topo_.cp_size() || p.tp_size() != topo_.tp_size()) {
    local = Status::InvalidArgument("StepRunner: schedule.parallel " + p.ToString() +
                                    " does not match the topology " + topo_.ToString() +
                                    " (CP and TP must be the topology's)");
  } else if (opts_.global_batch < 0) {
    local = Status::InvalidArgument("StepRunner: global_batch = " +
                                    std::to_string(opts_.global_batch) +
                                    " must be >= 0 (0 = the whole source)");
  }
  if (local.ok() && opts_.global_batch_tokens > 0 && opts_.read_share) {
    local = Status::InvalidArgument(
        "StepRunner: global_batch_tokens = " + std::to_string(opts_.global_batch_tokens) +
        " with a caller-fed source: a token step's size needs every sample's length in stream "
        "order, and each loader sees only its own share (count the batch in samples, or pack "
        "each batch you choose with pack_batch)");
  }
  if (local.ok() && opts_.read_share &&
      opts_.schedule.oversize == ScheduleOptions::OversizePolicy::kSplit) {
    local = Status::InvalidArgument(
        "StepRunner: oversize 'split' with a caller-fed source: the pieces of a sample are "
        "samples of the stream, and a caller's batch is its own (split long samples before "
        "handing them over, or use 'truncate' or 'skip')");
  }
  if (local.ok()) local = ValidateFieldSpecs(opts_.fields).WithContext("StepRunner");
  // Fields come from the caller's samples, or from a columnar source's columns (a blend's parts
  // name their own kind); every rank refuses another source, and a field no column can hold.
  if (local.ok() && !opts_.fields.empty() && !opts_.read_share) {
    const Result<SourceKind> kind = SourceKindOf(opts_.data);
    if (kind.ok() && *kind != SourceKind::kParquet && *kind != SourceKind::kArrow &&
        *kind != SourceKind::kBlend) {
      local = Status::InvalidArgument(
          "StepRunner: " + std::to_string(opts_.fields.size()) + " field(s) declared (first " +
          opts_.fields[0].ToString() + ") but the samples come from '" + opts_.data +
          "': only a source fed by the caller or a columnar source (parquet:, arrow:) carries "
          "fields");
    } else {
      local = SourceFieldsOf(opts_.fields).status().WithContext("StepRunner");
    }
  }
  if (local.ok() && !opts_.fields.empty() && !opts_.read_share &&
      opts_.schedule.oversize == ScheduleOptions::OversizePolicy::kSplit) {
    local = Status::InvalidArgument(
        "StepRunner: oversize 'split' with fields (first " + opts_.fields[0].ToString() +
        "): a piece would need its share of each field's rows, which the split does not cut "
        "(use 'truncate' or 'skip')");
  }
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    if (!opts_.fields[f].per_token()) sample_fields_.push_back(f);
  }
  if (local.ok()) local = FindGroupField();
  if (local.ok()) local = CheckMediaOptions();
  if (local.ok() && !opts_.media.empty()) {
    // One encoder term: where items are encoded, and what the schedulers balance. Not given: a
    // measured profile's, else Qwen2-VL's tower in FLOPs (CheckMediaOptions refused the rest).
    if (!opts_.media_cost.has_value()) {
      opts_.media_cost = opts_.schedule.cost.encoder.value_or(DefaultEncoderCost());
    }
    // The static schedulers add the term in the cost's unit; the dynamic scheduler's
    // step-time model takes it in seconds (a profile's as it is, a model cost's FLOPs at its
    // R), and where no conversion is known (a cost in tokens or "A,B") only places.
    if (opts_.schedule.scheduler != ScheduleOptions::Scheduler::kDynamic) {
      opts_.schedule.encoder_cost = *opts_.media_cost;
    }
    // The step-time model (the dynamic scheduler's yardstick, every plan's sim_step_time)
    // charges it too, where the term converts to seconds.
    if (opts_.schedule.step_time.has_value()) {
      const std::optional<EncoderCost> seconds =
          EncoderTermSeconds(opts_.schedule.cost, *opts_.schedule.step_time, *opts_.media_cost);
      if (seconds.has_value()) {
        opts_.schedule.step_time = opts_.schedule.step_time->WithEncoder(*seconds);
      }
    }
  }
  dynamic_ = opts_.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic;
  if (!opts_.read_share) {
    const Result<SourceKind> kind = SourceKindOf(opts_.data);
    blend_ = kind.ok() && *kind == SourceKind::kBlend;
  }
  if (local.ok() && dynamic_ && opts_.max_cp_groups < 1) {
    local = Status::InvalidArgument("StepRunner: max_cp_groups = " +
                                    std::to_string(opts_.max_cp_groups) + " must be >= 1");
  }
  const bool all = opts_.data_on == DataOn::kAll;
  if (local.ok()) {
    auto c = topo_.CoordOf(world_.rank());
    if (!c.ok()) {
      local = c.status();
    } else {
      coord_ = *c;
      // Static: the loaders (every rank with all). Dynamic: with all, the ranks cp = 0 of every
      // (tp, pp) slice, which is a domain of its own.
      reader_ = ReadsShare(coord_, opts_);
      head_ = dynamic_ && (all || (coord_.tp == 0 && coord_.pp == 0));
      if (reader_ && !opts_.read_share) {
        SourceOptions source_options = opts_.source;
        Result<std::vector<SourceField>> columns = SourceFieldsOf(opts_.fields);
        if (columns.ok()) source_options.fields = std::move(*columns);
        auto src = columns.ok() ? OpenStepSource(opts_.data, source_options, opts_.schedule)
                                : Result<std::unique_ptr<SampleSource>>(columns.status());
        if (src.ok()) {
          source_ = std::move(*src);
          auto tokens = TokenStepsFor(opts_.global_batch_tokens, opts_.schedule);
          auto steps = tokens.ok() ? StepReader::Create(source_.get(), opts_.global_batch,
                                                        topo_.dp_size(), *tokens)
                                   : Result<StepReader>(tokens.status());
          if (steps.ok()) {
            steps_.emplace(std::move(*steps));
          } else {
            local = steps.status();
          }
        } else {
          local = src.status();
        }
      }
      if (local.ok() && reader_) local = StartReading();
    }
  }
  if (local.ok() && opts_.start_step < 0) {
    local = Status::InvalidArgument("StepRunner: start_step = " +
                                    std::to_string(opts_.start_step) + " must be >= 0");
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "opening the step runner"));
  THDPACK_RETURN_IF_ERROR(ShareStart());

  if (dynamic_) return InitDynamic();
  // Loaders: with tp0 the DP group at tp = cp = pp = 0; with all, every DP group.
  std::vector<std::vector<int>> loader_groups;
  if (all) {
    loader_groups = topo_.AllGroups(GroupKind::kDp);
  } else {
    THDPACK_ASSIGN_OR_RETURN(auto g, topo_.GroupOf(GroupKind::kDp, 0));
    loader_groups.push_back(std::move(g));
  }
  THDPACK_ASSIGN_OR_RETURN(loaders_, world_.Split(loader_groups));
  if (reader_ && (!loaders_ || loaders_->rank() != coord_.dp)) {
    return Status::Internal("StepRunner: loader group position differs from the dp index");
  }
  if (opts_.data_on == DataOn::kTp0) {
    // Replica d: every rank with that dp, its loader first, then the others by global rank.
    std::vector<std::vector<int>> replicas(static_cast<size_t>(topo_.dp_size()));
    for (int d = 0; d < topo_.dp_size(); ++d) {
      THDPACK_ASSIGN_OR_RETURN(int loader, topo_.RankOf(Coord{0, 0, d, 0}));
      replicas[static_cast<size_t>(d)].push_back(loader);
    }
    for (int r = 0; r < topo_.world_size(); ++r) {
      THDPACK_ASSIGN_OR_RETURN(Coord c, topo_.CoordOf(r));
      if (c.tp == 0 && c.cp == 0 && c.pp == 0) continue;
      replicas[static_cast<size_t>(c.dp)].push_back(r);
    }
    THDPACK_ASSIGN_OR_RETURN(replica_, world_.Split(replicas));
  }
  return Status::Ok();
}

}  // namespace thdpack
