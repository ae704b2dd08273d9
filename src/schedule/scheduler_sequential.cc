// The sequential scheduler: Megatron-LM's `dp_balanced` (DpBalancedScheduler.
// get_groups_and_subsamples in megatron/core/datasets/data_schedule.py), without its assert.
//
//   1. Next-fit in arrival order: a group takes samples while its padded total stays within
//      the budget (and, with max_seqs_per_microbatch S, while it holds fewer than S); the
//      sample that does not fit starts the next group.
//   2. The group count G is padded up to a multiple of DP*k (or to M*DP for a fixed M) by
//      walking the groups from the rearmost ORIGINAL group towards group 0: a group with more
//      than one sample gives up its last sample, which becomes a new single-sample group at the
//      end; a single-sample group is passed over. Megatron asserts when the walk would reach
//      group 0 ("Not enough samples to move" - older versions even when group 0 itself could
//      still donate); here group 0 donates like any other, and the only failure is having
//      fewer samples than groups to fill, reported as "too few samples".
//   3. Group g = m*DP + d goes to replica d as microbatch m.
//
// O(n). Splitting only removes samples from groups, so every group stays within the budget
// and the sequence cap.
#include <cstdint>
#include <string>
#include <vector>

#include "schedule/scheduler_internal.h"

namespace thdpack::internal {

Result<Assignment> ScheduleSequential(const PreparedStep& step, const ScheduleOptions& o,
                                      int fixed_m) {
  const int32_t n = static_cast<int32_t>(step.size());
  // Next-fit in arrival order: each group is a range [first, end) of the step.
  struct Range {
    int32_t first;
    int32_t end;
  };
  std::vector<Range> groups;
  int64_t sum = 0;
  const int64_t max_seqs = SequenceCap(o);
  for (int32_t i = 0; i < n; ++i) {
    if (groups.empty() || sum + step.padded[i] > step.capacity ||
        groups.back().end - groups.back().first >= max_seqs) {
      groups.push_back({i, i});
      sum = 0;
    }
    groups.back().end = i + 1;
    sum += step.padded[i];
  }
  const int64_t dp = o.dp_size;
  const int64_t g = static_cast<int64_t>(groups.size());
  int64_t target = 0;
  if (fixed_m > 0) {
    target = dp * fixed_m;
    if (g > target) {
      return Status::InvalidArgument(
          "sequential: next-fit in arrival order needs " + std::to_string(g) +
          " microbatches of " + std::to_string(MicrobatchBudget(o)) + " tokens, more than M " +
          std::to_string(fixed_m) + " x DP " + std::to_string(dp) + " = " +
          std::to_string(target));
    }
  } else {
    const int64_t multiple = dp * o.microbatch_multiple;
    target = (g + multiple - 1) / multiple * multiple;
  }
  if (target > n) {
    return Status::InvalidArgument(
        "sequential: too few samples: " + std::to_string(n) + " samples cannot fill " +
        std::to_string(target) + " non-empty microbatches (next-fit made " + std::to_string(g) +
        ", padded to a multiple of DP x k = " + std::to_string(dp * o.microbatch_multiple) +
        (fixed_m > 0 ? ", fixed M = " + std::to_string(fixed_m) : std::string()) + ")");
  }
  int64_t to_move = target - g;
  for (int64_t i = g - 1; to_move > 0; ) {
    // target <= n guarantees enough multi-sample groups among the original ones. The last
    // sample of group i becomes a group of its own.
    if (groups[i].end - groups[i].first > 1) {
      const int32_t moved = --groups[i].end;
      groups.push_back({moved, moved + 1});
      --to_move;
    } else {
      --i;
    }
  }
  Assignment a;
  a.dp_size = o.dp_size;
  a.num_microbatches = static_cast<int>(target / dp);
  a.items.reserve(n);
  a.offsets.reserve(target + 1);
  a.offsets.push_back(0);
  for (int64_t d = 0; d < dp; ++d) {
    for (int64_t m = 0; m < a.num_microbatches; ++m) {
      const Range& group = groups[m * dp + d];
      for (int32_t i = group.first; i < group.end; ++i) a.items.push_back(i);
      a.offsets.push_back(static_cast<int64_t>(a.items.size()));
    }
  }
  return a;
}

}  // namespace thdpack::internal
