// Phase 3, plan (design.md section 7, step 2): every loader computes the same Plan from the
// lengths (Schedule, thdpack/schedule.h) and where each sample goes (replica_of_); under
// check_plan_hash the loaders compare a hash of it. Sends: that hash only (one all-reduce of 4
// int64 over the loaders). The plan hash serves the dynamic plan as well (MakeDynamicPlan,
// dynamic_step.cc). Depends on: step_lengths.cc (out.samples, position_of_offset_,
// step_groups_).
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/schedule.h"

namespace thdpack {

namespace runner_internal {

namespace {

// FNV-1a over the bytes of int64 values (least significant first): the plan hash loaders (or
// heads) compare.
class PlanHasher {
 public:
  void Mix(int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (static_cast<uint64_t>(v) >> (8 * i)) & 0xff;
      h_ *= 1099511628211ull;
    }
  }
  void Mix(std::span<const int64_t> values) {
    for (int64_t v : values) Mix(v);
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace

uint64_t HashPlan(const Plan& plan) {
  PlanHasher h;
  h.Mix(plan.num_microbatches);
  h.Mix(plan.dp_size);
  h.Mix(plan.offsets);
  h.Mix(plan.sample_ids);
  h.Mix(plan.skipped);
  return h.value();
}

uint64_t HashPlan(const DynamicPlan& plan) {
  PlanHasher h;
  h.Mix(plan.num_microbatches);
  h.Mix(plan.domain_size);
  for (const auto& groups : plan.microbatches) {
    h.Mix(static_cast<int64_t>(groups.size()));
    for (const CpGroup& g : groups) {
      h.Mix(g.first_rank);
      h.Mix(g.num_ranks);
      h.Mix(g.sample_ids);
    }
  }
  h.Mix(plan.skipped);
  return h.value();
}

Status AgreeOnPlanHash(ProcessGroup& group, uint64_t h, const std::string& what, int64_t step) {
  const int64_t lo = static_cast<int64_t>(h & 0xffffffffu), hi = static_cast<int64_t>(h >> 32);
  std::vector<int64_t> v = {lo, hi, -lo, -hi};
  THDPACK_RETURN_IF_ERROR(group.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kMin));
  if (v[0] != lo || v[1] != hi || v[2] != -lo || v[3] != -hi) {
    return Status::Internal(what + " of step " + std::to_string(step) +
                            " differs between planners (hash check)");
  }
  return Status::Ok();
}

}  // namespace runner_internal

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::MakePlan(RankStep& out) {
  THDPACK_ASSIGN_OR_RETURN(out.plan,
                           Schedule(out.samples, opts_.schedule, step_groups_, out.encoder_work));
  if (opts_.check_plan_hash) {
    THDPACK_RETURN_IF_ERROR(AgreeOnPlanHash(*loaders_, HashPlan(out.plan), "plan", step_));
  }
  replica_of_.assign(out.samples.size(), -1);
  for (int d = 0; d < out.plan.dp_size; ++d) {
    for (int m = 0; m < out.plan.num_microbatches; ++m) {
      for (int64_t id : out.plan.Microbatch(d, m)) {
        replica_of_[static_cast<size_t>(position_of_offset_[static_cast<size_t>(id - first_id_)])] = d;
      }
    }
  }
  return Status::Ok();
}

}  // namespace thdpack
