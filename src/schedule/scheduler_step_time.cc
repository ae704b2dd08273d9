// The step-time model applied to static plans (schedule.h PlanStepTime; the schedulers'
// sim_step_time, AssignmentStepTime): each replica's microbatch is a group of CP ranks whose
// seconds come from integer sums (StaticGroupTime), so the scheduler's pass over its arrays and
// PlanStepTime's pass over the plan agree exactly; SimulateStepTime gives the step.
#include <cstdint>
#include <span>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

// The modelled seconds of one group of a static plan from integer sums (StepTimeModel::
// GroupSeconds): the same value whatever order the sequences are added in, so the scheduler's
// pass over its arrays in input order (AssignmentStepTime) and PlanStepTime's pass over the
// plan agree exactly. Add every P, set last_p to the P of the group's last sample in plan
// order (it takes the SP tail), then Seconds().
class StaticGroupTime {
 public:
  void Add(const StepTimeModel& model, int c, int64_t p) {
    if (model.ExchangeBound(p, c)) {
      ++exchange_count_;
      exchange_sum_p_ += p;
    } else {
      ++compute_count_;
      compute_sum_p_ += p;
      compute_sum_sq_ += Square(p);
    }
  }
  void set_last_p(int64_t p) { last_p_ = p; }
  // A sample's encoder work: integer sums, so that the seconds (linear in them) do not depend
  // on the order either.
  void AddEncoder(int64_t patches, int64_t frame_sq) {
    enc_patches_ += static_cast<Wide>(static_cast<uint64_t>(patches));
    enc_frame_sq_ += static_cast<Wide>(static_cast<uint64_t>(frame_sq));
  }
  // fixed_tokens > 0 (pad_to_max_tokens): the fixed shape's padding, fixed_tokens - sum P, is
  // linear work only (as CostOfSums charges it): tokens without a P^2 term or a sequence.
  double Seconds(const StepTimeModel& model, const ParallelLayout& layout, int c,
                 int64_t fixed_tokens = 0) {
    const int64_t sum = compute_sum_p_ + exchange_sum_p_;
    const int64_t tail = layout.MicrobatchTokens(sum) - sum;
    if (fixed_tokens > 0) {
      compute_sum_p_ += fixed_tokens - sum;
    } else if (tail > 0) {
      // The last sample's P becomes P + tail: out with the one, in with the other.
      if (model.ExchangeBound(last_p_, c)) {
        --exchange_count_;
        exchange_sum_p_ -= last_p_;
      } else {
        --compute_count_;
        compute_sum_p_ -= last_p_;
        compute_sum_sq_ -= Square(last_p_);
      }
      Add(model, c, last_p_ + tail);
    }
    double t = model.GroupSeconds(c, compute_count_, compute_sum_p_,
                                  static_cast<double>(compute_sum_sq_), exchange_count_,
                                  exchange_sum_p_);
    if (enc_patches_ > 0 || enc_frame_sq_ > 0) {
      t += model.EncoderSeconds(static_cast<double>(enc_patches_),
                                static_cast<double>(enc_frame_sq_)) /
           static_cast<double>(c);
    }
    return t;
  }

 private:
  __extension__ typedef unsigned __int128 Wide;
  static Wide Square(int64_t p) {
    return static_cast<Wide>(static_cast<uint64_t>(p) * static_cast<uint64_t>(p));
  }
  int64_t compute_count_ = 0;
  int64_t compute_sum_p_ = 0;
  Wide compute_sum_sq_ = 0;
  int64_t exchange_count_ = 0;
  int64_t exchange_sum_p_ = 0;
  int64_t last_p_ = 0;
  Wide enc_patches_ = 0;
  Wide enc_frame_sq_ = 0;
};

}  // namespace

namespace internal {

Result<double> AssignmentStepTime(const PreparedStep& step, const ScheduleOptions& options,
                                  const Assignment& a) {
  if (!options.step_time.has_value()) {
    return Status::InvalidArgument("AssignmentStepTime: no step-time model in the options");
  }
  const StepTimeModel& model = *options.step_time;
  const int cp = options.parallel.cp_size();
  const size_t groups = a.offsets.size() - 1;
  // One pass over the step in input order (StaticGroupTime's sums do not depend on it).
  std::vector<StaticGroupTime> times(groups);
  std::vector<int32_t> scratch;
  const std::vector<int32_t>& group_of = GroupOf(a, step.size(), &scratch);
  for (size_t i = 0; i < step.size(); ++i) {
    StaticGroupTime& t = times[static_cast<size_t>(group_of[i])];
    t.Add(model, cp, step.padded[i]);
    if (step.has_encoder()) t.AddEncoder(step.enc_patches[i], step.enc_frame_sq[i]);
  }
  std::vector<GroupTask> tasks;
  tasks.reserve(groups);
  // The groups in PlanStepTime's order (microbatch, then replica).
  for (int m = 0; m < a.num_microbatches; ++m) {
    for (int d = 0; d < a.dp_size; ++d) {
      const size_t g = static_cast<size_t>(d) * static_cast<size_t>(a.num_microbatches) +
                       static_cast<size_t>(m);
      times[g].set_last_p(LastPadded(step, a, g));
      tasks.push_back({d * cp, cp,
                       times[g].Seconds(model, options.parallel, cp,
                                        FixedMicrobatchTokens(options))});
    }
  }
  return SimulateStepTime(a.dp_size * cp, tasks);
}

}  // namespace internal

Result<double> PlanStepTime(std::span<const SampleLength> samples, const ScheduleOptions& options,
                            const Plan& plan, std::span<const EncoderWork> encoder) {
  if (!options.step_time.has_value()) {
    return Status::InvalidArgument("PlanStepTime: no step-time model in the options");
  }
  THDPACK_RETURN_IF_ERROR(ValidatePlan(samples, options, plan));
  const SampleIdIndex index(samples);
  // Each sample's work by the index's slot.
  std::vector<EncoderWork> work;
  THDPACK_RETURN_IF_ERROR(internal::CheckEncoderWork(samples, encoder).status());
  if (!encoder.empty()) {
    work.assign(static_cast<size_t>(index.num_slots()), EncoderWork{});
    for (size_t i = 0; i < samples.size(); ++i) {
      work[static_cast<size_t>(index.Slot(samples[i].id))] = encoder[i];
    }
  }
  const StepTimeModel& model = *options.step_time;
  const int cp = options.parallel.cp_size();
  std::vector<GroupTask> tasks;
  tasks.reserve(static_cast<size_t>(plan.dp_size) * static_cast<size_t>(plan.num_microbatches));
  for (int m = 0; m < plan.num_microbatches; ++m) {
    for (int d = 0; d < plan.dp_size; ++d) {
      StaticGroupTime time;
      for (int64_t id : plan.Microbatch(d, m)) {
        const int64_t slot = index.Slot(id);
        const int64_t p = options.parallel.PaddedLength(index.Length(slot));
        time.Add(model, cp, p);
        time.set_last_p(p);
        if (!work.empty()) {
          time.AddEncoder(work[static_cast<size_t>(slot)].patches,
                          work[static_cast<size_t>(slot)].frame_sq);
        }
      }
      tasks.push_back({d * cp, cp,
                       time.Seconds(model, options.parallel, cp, FixedMicrobatchTokens(options))});
    }
  }
  return SimulateStepTime(plan.dp_size * cp, tasks);
}

}  // namespace thdpack
