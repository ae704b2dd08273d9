// `run --scheduler dynamic --verify` at the topologies, shared by the thread-backend
// test (tests/dynamic_step_test.cc) and the MPI check (tests/mpi_check.cc, one mpirun for all
// of them): the probe's figures must equal the single-rank reference (StepVerifier fails the
// run otherwise).
#ifndef THDPACK_TESTS_DYNAMIC_CHECKS_H_
#define THDPACK_TESTS_DYNAMIC_CHECKS_H_

#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/job.h"
#include "thdpack/probe.h"

namespace thdpack::testing {

struct DynTopo {
  int tp, cp, dp, pp;
  bool sp;
};

inline std::string DynName(const DynTopo& t) {
  return "tp" + std::to_string(t.tp) + "cp" + std::to_string(t.cp) + "dp" + std::to_string(t.dp) +
         "pp" + std::to_string(t.pp) + (t.sp ? "sp" : "");
}

// (tp,cp,dp,pp) in {(1,2,2,1), (1,4,2,1), (2,2,2,1) with SP, (1,2,2,2), (1,3,2,1)}.
inline std::vector<DynTopo> DynamicVerifyTopologies() {
  return {{1, 2, 2, 1, false}, {1, 4, 2, 1, false}, {2, 2, 2, 1, true}, {1, 2, 2, 2, false},
          {1, 3, 2, 1, false}};
}

inline Result<Job> DynamicJob(const DynTopo& t, const std::string& data, int64_t global_batch,
                              int64_t max_tokens, int steps) {
  JobOptions o;
  o.data = data;
  o.tp = t.tp;
  o.cp = t.cp;
  o.dp = t.dp;
  o.pp = t.pp;
  o.sp = t.sp;
  o.max_tokens_per_rank = max_tokens;
  o.global_batch = global_batch;
  o.steps = steps;
  o.scheduler = "dynamic";
  o.cost = "llama2-7b";
  o.hw = "h100-ib";
  o.check_plan_hash = true;
  return ResolveJob(o);
}

// `run --verify` of `t` on the first tp*cp*dp*pp ranks of `world` (the others return OK at
// once): `steps` steps of 16 samples, 64 tokens per rank. On the group's rank 0, *losses gets
// each step's probe figures.
inline Status RunDynamicVerify(ProcessGroup& world, const DynTopo& t, const std::string& data,
                               int steps, std::vector<LossSummary>* losses) {
  THDPACK_ASSIGN_OR_RETURN(Job job, DynamicJob(t, data, 16, 64, steps));
  RunOptions ro;
  ro.verify = true;
  THDPACK_ASSIGN_OR_RETURN(RunSetup run, ResolveRun(job, ro));
  const int n = job.topology.world_size();
  if (n > world.size()) return Status::InvalidArgument(DynName(t) + " needs more ranks");
  std::vector<std::vector<int>> lists(1, std::vector<int>(static_cast<size_t>(n)));
  std::iota(lists[0].begin(), lists[0].end(), 0);
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> sub, world.Split(lists));
  if (!sub) return Status::Ok();
  return RunJobOnRank(*sub, job, run, [&](const RunStepReport& r) {
    if (!r.loss) return Status::Internal("no probe figures");
    losses->push_back(*r.loss);
    return Status::Ok();
  }).WithContext(DynName(t));
}

}  // namespace thdpack::testing

#endif  // THDPACK_TESTS_DYNAMIC_CHECKS_H_
