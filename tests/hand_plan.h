// A step small enough to work out by hand, shared by the tests of the step figures
// (src/step/figures_test.cc) and of the memory report (src/runtime/memory_report_test.cc).
// Samples (id: L, n_targets) 10: 3, 2; 11: 5, 4; 12: 2, 1; 13: 6, 5; DP = 2, CP = 2 (padded
// lengths are multiples of 4: 4, 8, 4, 8), one microbatch: replica 0 holds [10, 12], replica 1
// holds [11, 13].
#ifndef THDPACK_TESTS_HAND_PLAN_H_
#define THDPACK_TESTS_HAND_PLAN_H_

#include <vector>

#include "thdpack/data.h"
#include "thdpack/schedule.h"

namespace thdpack::testing {

inline std::vector<SampleLength> HandSamples() {
  return {{10, 3, 2}, {11, 5, 4}, {12, 2, 1}, {13, 6, 5}};
}
inline ScheduleOptions HandOptions() {
  ScheduleOptions o;
  o.dp_size = 2;
  o.parallel = ParallelLayout::Create(2).value();
  o.max_tokens_per_rank = 8;
  return o;
}
inline Plan HandPlan() {
  Plan p;
  p.num_microbatches = 1;
  p.dp_size = 2;
  p.sample_ids = {10, 12, 11, 13};
  p.offsets = {0, 2, 4};
  return p;
}

}  // namespace thdpack::testing

#endif  // THDPACK_TESTS_HAND_PLAN_H_
