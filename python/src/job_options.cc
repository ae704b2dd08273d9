// python/src/job_options.cc: the one table of job keyword arguments (job_options.h).
#include "job_options.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

namespace thdpack::python {
namespace {

// An option: how a keyword argument sets it, and how its effective value reads back.
struct Option {
  std::function<void(JobOptions&, RunOptions&, const py::handle&)> set;
  std::function<py::object(const JobOptions&, const RunOptions&)> get;
};

template <typename T>
Option Field(T JobOptions::*field) {
  return {[field](JobOptions& o, RunOptions&, const py::handle& v) { o.*field = v.cast<T>(); },
          [field](const JobOptions& o, const RunOptions&) { return py::cast(o.*field); }};
}
template <typename T>
Option SourceField(T SourceOptions::*field) {
  return {[field](JobOptions& o, RunOptions&, const py::handle& v) {
            o.source.*field = v.cast<T>();
          },
          [field](const JobOptions& o, const RunOptions&) { return py::cast(o.source.*field); }};
}
template <typename T>
Option RunField(T RunOptions::*field) {
  return {[field](JobOptions&, RunOptions& r, const py::handle& v) { r.*field = v.cast<T>(); },
          [field](const JobOptions&, const RunOptions& r) { return py::cast(r.*field); }};
}
template <typename T>
Option ProbeField(T ProbeConfig::*field) {
  return {[field](JobOptions&, RunOptions& r, const py::handle& v) {
            r.probe.*field = v.cast<T>();
          },
          [field](const JobOptions&, const RunOptions& r) { return py::cast(r.probe.*field); }};
}

// --global-batch: "all" or a positive integer, through the command line's parser.
void SetGlobalBatch(JobOptions& o, RunOptions&, const py::handle& v) {
  const std::string text = py::isinstance<py::str>(v) ? v.cast<std::string>()
                                                      : std::to_string(v.cast<int64_t>());
  o.global_batch = ValueOrThrow(ParseGlobalBatch(text));
}

// --rank-multiple: an int, or a preset name (fp8, mxfp8, blockwise, none), through the command
// line's parser.
void SetRankMultiple(JobOptions& o, RunOptions&, const py::handle& v) {
  o.rank_multiple = RankMultipleOf(v, "rank_multiple");
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

template <typename T>
std::function<py::object(const JobOptions&, const RunOptions&)> Get(T JobOptions::*field) {
  return [field](const JobOptions& o, const RunOptions&) { return py::cast(o.*field); };
}
// 0 is "all" (one epoch a step), as the option takes it.
py::object GetGlobalBatch(const JobOptions& o, const RunOptions&) {
  return o.global_batch == 0 ? py::object(py::str("all")) : py::object(py::int_(o.global_batch));
}
py::object GetSteps(const JobOptions& o, const RunOptions&) {
  return o.steps ? py::object(py::int_(*o.steps)) : py::object(py::none());
}

const std::map<std::string, Option>& Options(bool run) {
  static const std::map<std::string, Option> plan_options = {
      {"data", Field(&JobOptions::data)},
      {"seed", SourceField(&SourceOptions::seed)},
      {"shuffle", SourceField(&SourceOptions::shuffle)},
      {"vocab", SourceField(&SourceOptions::vocab_size)},
      {"mock_samples", SourceField(&SourceOptions::mock_num_samples)},
      {"tp", Field(&JobOptions::tp)},
      {"cp", Field(&JobOptions::cp)},
      {"dp", Field(&JobOptions::dp)},
      {"pp", Field(&JobOptions::pp)},
      {"rank_order", Field(&JobOptions::rank_order)},
      {"sp", Field(&JobOptions::sp)},
      {"align", Field(&JobOptions::align)},
      {"rank_multiple", Option{SetRankMultiple, Get(&JobOptions::rank_multiple)}},
      {"max_tokens_per_rank", Field(&JobOptions::max_tokens_per_rank)},
      {"global_batch", Option{SetGlobalBatch, GetGlobalBatch}},
      {"global_batch_tokens", Field(&JobOptions::global_batch_tokens)},
      {"steps", Option{SetSteps, GetSteps}},
      {"scheduler", Field(&JobOptions::scheduler)},
      {"cp_sizes", Field(&JobOptions::cp_sizes)},
      {"max_cp_groups", Field(&JobOptions::max_cp_groups)},
      {"hw", Field(&JobOptions::hw)},
      {"cost", Field(&JobOptions::cost)},
      {"microbatch_multiple", Field(&JobOptions::microbatch_multiple)},
      {"num_microbatches", Field(&JobOptions::num_microbatches)},
      {"oversize", Field(&JobOptions::oversize)},
      {"pad_to_max_tokens", Field(&JobOptions::pad_to_max_tokens)},
      {"max_seqs", Field(&JobOptions::max_seqs)},
      {"keep_groups", Field(&JobOptions::keep_groups)},
      {"group_field", Field(&JobOptions::group_field)},
      {"pad_id", Field(&JobOptions::pad_id)},
      {"data_on", Field(&JobOptions::data_on)},
      {"vocab_size", Field(&JobOptions::vocab_size)},
      {"logits_dtype", Field(&JobOptions::logits_dtype)},
      {"fused_grad", Field(&JobOptions::fused_grad)},
      {"check_plan_hash", Field(&JobOptions::check_plan_hash)},
      {"memory_limit", Option{SetMemoryLimit, Get(&JobOptions::memory_limit)}},
      {"start_step", Field(&JobOptions::start_step)},
      {"resume", Field(&JobOptions::resume)},
      {"save_state", Field(&JobOptions::save_state)},
  };
  static const std::map<std::string, Option> run_options = [] {
    std::map<std::string, Option> m = plan_options;
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
  return run ? run_options : plan_options;
}

}  // namespace

bool IsJobOption(const std::string& name, OptionsOf of) {
  if (of == OptionsOf::kIterator) {
    // A saved state reaches the iterator through load_state_dict, and leaves it through
    // state_dict: no files.
    static const std::set<std::string> not_iterator = {
        "data",         "steps",        "vocab_size", "logits_dtype",
        "fused_grad",   "memory_limit", "resume",     "save_state"};
    return Options(false).count(name) > 0 && not_iterator.count(name) == 0;
  }
  return Options(of == OptionsOf::kRun).count(name) > 0;
}

void SetJobOption(const std::string& name, const py::handle& value, JobOptions& job,
                  RunOptions& run) {
  const auto& options = Options(/*run=*/true);
  auto it = options.find(name);
  if (it == options.end()) throw py::type_error("unknown job option '" + name + "'");
  if (!job.given) job.given.emplace();
  if (std::find(job.given->begin(), job.given->end(), name) == job.given->end()) {
    job.given->push_back(name);
  }
  try {
    it->second.set(job, run, value);
  } catch (const py::cast_error&) {
    throw py::type_error(name + ": cannot take " +
                         std::string(py::str(py::type::of(value).attr("__name__"))));
  }
}

py::tuple JobOptionsToPy(const Job& job, OptionsOf of) {
  py::dict values;
  const RunOptions run;
  for (const auto& [name, option] : Options(of == OptionsOf::kRun)) {
    if (IsJobOption(name, of)) values[py::str(name)] = option.get(job.options, run);
  }
  py::list defaulted;
  for (const std::string& name : job.defaulted) {
    if (IsJobOption(name, of)) defaulted.append(name);
  }
  return py::make_tuple(values, defaulted);
}

}  // namespace thdpack::python
