// python/src/bind_job.cc: the job configuration and the cores of `thdpack plan` and `thdpack
// run` (thdpack/job.h): thdpack.resolve_job, thdpack.plan_job, thdpack.run_job. Keyword
// arguments are the command-line options with '_' for '-'; the results are the JSON the
// command line prints, read with Python's json module.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/comm.h"
#include "thdpack/job.h"

namespace thdpack::python {
namespace {

using Setter = std::function<void(JobOptions&, RunOptions&, const py::handle&)>;

template <typename T>
Setter Field(T JobOptions::*field) {
  return [field](JobOptions& o, RunOptions&, const py::handle& v) { o.*field = v.cast<T>(); };
}
template <typename T>
Setter SourceField(T SourceOptions::*field) {
  return [field](JobOptions& o, RunOptions&, const py::handle& v) {
    o.source.*field = v.cast<T>();
  };
}
template <typename T>
Setter RunField(T RunOptions::*field) {
  return [field](JobOptions&, RunOptions& r, const py::handle& v) { r.*field = v.cast<T>(); };
}
template <typename T>
Setter ProbeField(T ProbeConfig::*field) {
  return [field](JobOptions&, RunOptions& r, const py::handle& v) {
    r.probe.*field = v.cast<T>();
  };
}

// --global-batch: "all" or a positive integer, through the command line's parser.
void SetGlobalBatch(JobOptions& o, RunOptions&, const py::handle& v) {
  const std::string text = py::isinstance<py::str>(v) ? v.cast<std::string>()
                                                      : std::to_string(v.cast<int64_t>());
  o.global_batch = ValueOrThrow(ParseGlobalBatch(text));
}

// --memory-limit: bytes as an int, or text with a K/M/G/T suffix, through the command line's
// parser.
void SetMemoryLimit(JobOptions& o, RunOptions&, const py::handle& v) {
  const std::string text = py::isinstance<py::str>(v) ? v.cast<std::string>()
                                                      : std::to_string(v.cast<int64_t>());
  o.memory_limit = ValueOrThrow(ParseMemoryLimit(text));
}

void SetSteps(JobOptions& o, RunOptions&, const py::handle& v) {
  if (v.is_none()) {
    o.steps.reset();
  } else {
    o.steps = v.cast<int64_t>();
  }
}

const std::map<std::string, Setter>& Setters(bool run) {
  static const std::map<std::string, Setter> plan_setters = {
      {"data", Field(&JobOptions::data)},
      {"seed", SourceField(&SourceOptions::seed)},
      {"shuffle", SourceField(&SourceOptions::shuffle)},
      {"vocab", SourceField(&SourceOptions::vocab_size)},
      {"mock_samples", SourceField(&SourceOptions::mock_num_samples)},
      {"tp", Field(&JobOptions::tp)},
      {"cp", Field(&JobOptions::cp)},
      {"dp", Field(&JobOptions::dp)},
      {"pp", Field(&JobOptions::pp)},
      {"sp", Field(&JobOptions::sp)},
      {"align", Field(&JobOptions::align)},
      {"max_tokens_per_rank", Field(&JobOptions::max_tokens_per_rank)},
      {"global_batch", SetGlobalBatch},
      {"steps", SetSteps},
      {"scheduler", Field(&JobOptions::scheduler)},
      {"cost", Field(&JobOptions::cost)},
      {"microbatch_multiple", Field(&JobOptions::microbatch_multiple)},
      {"num_microbatches", Field(&JobOptions::num_microbatches)},
      {"oversize", Field(&JobOptions::oversize)},
      {"pad_id", Field(&JobOptions::pad_id)},
      {"data_on", Field(&JobOptions::data_on)},
      {"vocab_size", Field(&JobOptions::vocab_size)},
      {"logits_dtype", Field(&JobOptions::logits_dtype)},
      {"fused_grad", Field(&JobOptions::fused_grad)},
      {"check_plan_hash", Field(&JobOptions::check_plan_hash)},
      {"memory_limit", SetMemoryLimit},
  };
  static const std::map<std::string, Setter> run_setters = [] {
    std::map<std::string, Setter> m = plan_setters;
    m["timeout"] = Field(&JobOptions::timeout);
    m["verify"] = RunField(&RunOptions::verify);
    m["verify_tolerance"] = RunField(&RunOptions::verify_tolerance);
    m["memory_profile_steps"] = RunField(&RunOptions::memory_profile_steps);
    m["memory_profile_dir"] = RunField(&RunOptions::memory_profile_dir);
    m["probe_layers"] = ProbeField(&ProbeConfig::layers);
    m["probe_hidden"] = ProbeField(&ProbeConfig::hidden);
    m["probe_heads"] = ProbeField(&ProbeConfig::heads);
    m["probe_vocab"] = ProbeField(&ProbeConfig::vocab_size);
    return m;
  }();
  return run ? run_setters : plan_setters;
}

// Reads the keyword arguments into the options; summary_only is returned apart.
bool ReadOptions(const py::kwargs& kwargs, bool run, JobOptions& job, RunOptions& run_options) {
  bool summary_only = false;
  const auto& setters = Setters(run);
  for (const auto& [key, value] : kwargs) {
    const std::string name = key.cast<std::string>();
    if (name == "summary_only") {
      summary_only = value.cast<bool>();
      continue;
    }
    auto it = setters.find(name);
    if (it == setters.end()) {
      throw py::type_error(std::string(run ? "run_job" : "plan_job") +
                           "() got an unexpected keyword argument '" + name + "'");
    }
    try {
      it->second(job, run_options, value);
    } catch (const py::cast_error&) {
      throw py::type_error(name + ": cannot take " +
                           std::string(py::str(py::type::of(value).attr("__name__"))));
    }
  }
  return summary_only;
}

py::object JsonLoads(const std::string& text) {
  return py::module_::import("json").attr("loads")(text);
}

py::dict ResolveJobPy(const py::kwargs& kwargs) {
  JobOptions options;
  RunOptions unused;
  ReadOptions(kwargs, /*run=*/false, options, unused);
  const Job job = ValueOrThrow(ResolveJob(options));
  py::dict d;
  d["tp"] = job.topology.tp_size();
  d["cp"] = job.topology.cp_size();
  d["dp"] = job.topology.dp_size();
  d["pp"] = job.topology.pp_size();
  d["world_size"] = job.topology.world_size();
  d["global_batch"] = job.options.global_batch;
  d["steps"] = job.steps;
  d["cost"] = job.schedule.cost.name;
  d["cost_a"] = job.schedule.cost.a;
  d["cost_b"] = job.schedule.cost.b;
  d["flops_per_token"] = job.flops ? py::cast(job.flops->per_token) : py::none();
  d["flops_per_token_sq"] = job.flops ? py::cast(job.flops->per_token_sq) : py::none();
  d["vocab_size"] = job.memory.vocab_size;
  d["scheduler"] = std::string(SchedulerName(job.schedule.scheduler));
  d["oversize"] = std::string(OversizePolicyName(job.schedule.oversize));
  d["data_on"] = std::string(DataOnName(job.data_on));
  return d;
}

py::object PlanJobPy(const py::kwargs& kwargs) {
  JobOptions options;
  RunOptions unused;
  const bool summary_only = ReadOptions(kwargs, /*run=*/false, options, unused);
  const Job job = ValueOrThrow(ResolveJob(options));
  std::string json;
  Status status = Status::Ok();
  {
    py::gil_scoped_release release;
    Result<JobPlan> plan = PlanJob(job, {}, /*sample_ids=*/!summary_only);
    if (plan.ok()) {
      json = PlanJobJson(*plan, summary_only);
    } else {
      status = plan.status();
    }
  }
  ThrowIfError(status);
  return JsonLoads(json);
}

py::list RunJobPy(const py::kwargs& kwargs) {
  JobOptions options;
  RunOptions run_options;
  const bool summary_only = ReadOptions(kwargs, /*run=*/true, options, run_options);
  const Job job = ValueOrThrow(ResolveJob(options));
  const RunSetup run = ValueOrThrow(ResolveRun(job, run_options));
  std::vector<std::string> lines;
  Status failed = Status::Ok();
  {
    py::gil_scoped_release release;
    std::vector<Status> statuses =
        RunOnThreads(job.topology.world_size(), [&](ProcessGroup& world) {
          return RunJobOnRank(world, job, run, [&](const RunStepReport& step) {
            lines.push_back(RunStepJson(step, summary_only));
            return Status::Ok();
          });
        });
    // Rank 0's error names the rank that failed first.
    for (size_t r = 0; r < statuses.size() && failed.ok(); ++r) {
      failed = statuses[r].WithContext("rank " + std::to_string(r));
    }
  }
  ThrowIfError(failed);
  py::list out;
  for (const std::string& line : lines) out.append(JsonLoads(line));
  return out;
}

}  // namespace

void BindJob(py::module_& m) {
  m.def("resolve_job", &ResolveJobPy,
        "Checks a job's options (the options of `thdpack plan`, with '_' for '-'; defaults as "
        "in thdpack/job.h: dp=cp=tp=pp=1, global_batch=256, steps None = 3, or 1 with "
        "global_batch='all') and returns what they resolve to: topology sizes, steps, the cost "
        "model and its FLOPs coefficients, the memory report's vocabulary. ValueError naming "
        "the option otherwise.");
  m.def("plan_job", &PlanJobPy,
        "Plans a job as `thdpack plan --json` does (same keyword options as resolve_job, plus "
        "summary_only) and returns its report: {'steps': [...], 'summary': {...}}.");
  m.def("run_job", &RunJobPy,
        "Runs a job's step loop on one thread per rank as `thdpack run --json` does (options "
        "of resolve_job plus data_on, timeout, summary_only, verify, verify_tolerance, probe_layers, "
        "probe_hidden, probe_heads, probe_vocab, memory_profile_steps, memory_profile_dir) "
        "and returns one dict per step (with verify: loss, ppl, entropy, n_tokens, checked "
        "against one rank).");
}

}  // namespace thdpack::python
