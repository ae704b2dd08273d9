// thdpack/thdpack.h: includes the whole public API.
#ifndef THDPACK_THDPACK_H_
#define THDPACK_THDPACK_H_

#include "thdpack/arrow.h"
#include "thdpack/columns.h"
#include "thdpack/comm.h"
#include "thdpack/cost.h"
#include "thdpack/cuda_loss.h"
#include "thdpack/data.h"
#include "thdpack/figures.h"
#include "thdpack/job.h"
#include "thdpack/loss.h"
#include "thdpack/memory.h"
#include "thdpack/memory_report.h"
#include "thdpack/pack.h"
#include "thdpack/probe.h"
#include "thdpack/profile.h"
#include "thdpack/rank_step.h"
#include "thdpack/run_state.h"
#include "thdpack/sample.h"
#include "thdpack/schedule.h"
#include "thdpack/media.h"
#include "thdpack/shard.h"
#include "thdpack/status.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"
#include "thdpack/step_wire.h"
#include "thdpack/topology.h"
#include "thdpack/version.h"
#include "thdpack/wire.h"

#endif  // THDPACK_THDPACK_H_
