// python/src/job_options.h: keyword arguments to the job configuration (thdpack/job.h), shared by
// thdpack.resolve_job / plan_job / run_job (bind_job.cc) and the torch iterator
// (bind_torch_iter.cc). Names are the command line's options with '_' for '-'; text values go
// through the command line's own parsers (global_batch, memory_limit).
#ifndef THDPACK_PYTHON_JOB_OPTIONS_H_
#define THDPACK_PYTHON_JOB_OPTIONS_H_

#include <string>

#include "common.h"
#include "thdpack/job.h"

namespace thdpack::python {

// Whose options: `plan`'s; `run`'s (plan's and timeout, verify, verify_tolerance,
// memory_profile_*, probe_*); the torch iterator's (plan's but data, which is its source,
// steps, which its Python side counts, the memory report's: vocab_size, logits_dtype,
// fused_grad, memory_limit, and the state files resume and save_state: its state goes through
// state_dict and load_state_dict).
enum class OptionsOf { kPlan, kRun, kIterator };

bool IsJobOption(const std::string& name, OptionsOf of);

// Sets option `name` (IsJobOption(name, OptionsOf::kRun)) from `value`: TypeError naming the option when
// the value has the wrong type, ValueError from the command line's parsers.
void SetJobOption(const std::string& name, const py::handle& value, JobOptions& job,
                  RunOptions& run);

// Every option of `of` by name with its effective value (as the keyword argument takes it:
// global_batch 0 is "all"), and the names of those the job defaulted (Job::defaulted): the
// (dict, list) that thdpack.torch's step.options shows. SetJobOption records each option it
// sets as given (JobOptions::given). REQUIRES the GIL.
py::tuple JobOptionsToPy(const Job& job, OptionsOf of);

// A run state (thdpack/run_state.h) as Python holds it: the dict of its JSON record
// (bind_job.cc). From a dict or its JSON text; ValueError naming the field (ParseRunState),
// TypeError for anything else; `what` names the argument.
py::object RunStateToPy(const RunState& state);
RunState RunStateFromPy(const py::handle& state, const std::string& what);

}  // namespace thdpack::python

#endif  // THDPACK_PYTHON_JOB_OPTIONS_H_
