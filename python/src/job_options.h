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

// Whether `name` is an option of `plan` (run = false) or of `run` (run = true: plan's and
// timeout, verify, verify_tolerance, memory_profile_*, probe_*).
bool IsJobOption(const std::string& name, bool run);

// Sets option `name` (IsJobOption(name, true)) from `value`: TypeError naming the option when
// the value has the wrong type, ValueError from the command line's parsers.
void SetJobOption(const std::string& name, const py::handle& value, JobOptions& job,
                  RunOptions& run);

}  // namespace thdpack::python

#endif  // THDPACK_PYTHON_JOB_OPTIONS_H_
