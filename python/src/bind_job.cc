// python/src/bind_job.cc: the job configuration and the cores of `thdpack plan` and `thdpack
// run` (thdpack/job.h): thdpack.resolve_job, thdpack.plan_job, thdpack.run_job. Keyword
// arguments are the command-line options with '_' for '-'; the results are the JSON the
// command line prints, read with Python's json module.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common.h"
#include "job_options.h"
#include "thdpack/comm.h"
#include "thdpack/job.h"

namespace thdpack::python {
namespace {

// Reads the keyword arguments into the options; summary_only is returned apart.
bool ReadOptions(const py::kwargs& kwargs, bool run, JobOptions& job, RunOptions& run_options) {
  bool summary_only = false;
  job.given.emplace();  // what is not set below is defaulted
  for (const auto& [key, value] : kwargs) {
    const std::string name = key.cast<std::string>();
    if (name == "summary_only") {
      summary_only = value.cast<bool>();
      continue;
    }
    if (!IsJobOption(name, run ? OptionsOf::kRun : OptionsOf::kPlan)) {
      throw py::type_error(std::string(run ? "run_job" : "plan_job") +
                           "() got an unexpected keyword argument '" + name + "'");
    }
    SetJobOption(name, value, job, run_options);
  }
  return summary_only;
}

py::object JsonLoads(const std::string& text) {
  return py::module_::import("json").attr("loads")(text);
}

}  // namespace

py::object RunStateToPy(const RunState& state) { return JsonLoads(RunStateToJson(state)); }

RunState RunStateFromPy(const py::handle& state, const std::string& what) {
  std::string text;
  if (py::isinstance<py::str>(state)) {
    text = state.cast<std::string>();
  } else if (py::isinstance<py::dict>(state)) {
    text = py::module_::import("json").attr("dumps")(state).cast<std::string>();
  } else {
    throw py::type_error(what + ": expected a run state (a dict from state_dict(), or its JSON "
                         "text), got " +
                         std::string(py::str(py::type::of(state).attr("__name__"))));
  }
  return ValueOrThrow(ParseRunState(text, what));
}

namespace {

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
  RunState state;
  Status status = Status::Ok();
  {
    py::gil_scoped_release release;
    Result<JobPlan> plan = PlanJob(job, {}, /*sample_ids=*/!summary_only);
    if (plan.ok()) {
      json = PlanJobJson(*plan, summary_only);
      state = plan->state;
      if (!options.save_state.empty()) status = WriteRunStateFile(options.save_state, state);
    } else {
      status = plan.status();
    }
  }
  ThrowIfError(status);
  py::object report = JsonLoads(json);
  report["state"] = RunStateToPy(state);
  return report;
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
  m.def(
      "check_run_state",
      [](const py::handle& state) { return RunStateToPy(RunStateFromPy(state, "state")); },
      py::arg("state"),
      "Checks a run state (a dict from PackedDataIterator.state_dict() or plan_job()['state'], "
      "or its JSON text) and returns it as a dict: ValueError naming the field when it was cut, "
      "edited (its checksum), or written by a newer thdpack (thdpack/run_state.h).");
  m.def(
      "run_state_at",
      [](const py::handle& state, int64_t next_step, int64_t consumed) {
        return RunStateToPy(
            ValueOrThrow(RunStateAt(RunStateFromPy(state, "state"), next_step, consumed)));
      },
      py::arg("state"), py::arg("next_step"), py::arg("consumed"),
      "The same run's state at another position given by a count alone: step next_step after "
      "`consumed` samples (e.g. Megatron's iteration and consumed_train_samples), without a "
      "source cursor (each reading rank computes it on resume).");
  m.def(
      "read_run_state", [](const std::string& path) {
        RunState s;
        Status status;
        {
          py::gil_scoped_release release;
          Result<RunState> r = ReadRunStateFile(path);
          if (r.ok()) {
            s = std::move(*r);
          } else {
            status = r.status();
          }
        }
        ThrowIfError(status);
        return RunStateToPy(s);
      },
      py::arg("path"), "Reads a run state file (`thdpack run --save-state`).");
  m.def(
      "write_run_state",
      [](const std::string& path, const py::handle& state) {
        const RunState s = RunStateFromPy(state, "state");
        Status status;
        {
          py::gil_scoped_release release;
          status = WriteRunStateFile(path, s);
        }
        ThrowIfError(status);
      },
      py::arg("path"), py::arg("state"),
      "Writes a run state to a file atomically (a new file, synced, renamed over the old one), "
      "as `thdpack run --save-state` does.");
  m.def("run_job", &RunJobPy,
        "Runs a job's step loop on one thread per rank as `thdpack run --json` does (options "
        "of resolve_job plus data_on, timeout, summary_only, verify, verify_tolerance, probe_layers, "
        "probe_hidden, probe_heads, probe_vocab, memory_profile_steps, memory_profile_dir) "
        "and returns one dict per step (with verify: loss, ppl, entropy, n_tokens, checked "
        "against one rank).");
}

}  // namespace thdpack::python
