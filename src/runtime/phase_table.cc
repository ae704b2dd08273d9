// The phases of a step by name and figure (thdpack/rank_step.h, thdpack/step_runner.h):
// PhaseName (the names `run --json` reports), the bytes a rank sent in a step, and the phase
// table gathered from every rank (GatherPhases: two all-gathers over the world, collective).
// The step's phases only record their figures (RankStep::phases); nothing here runs in a step.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "thdpack/rank_step.h"
#include "thdpack/step_runner.h"

namespace thdpack {

std::string_view PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kRead: return "read";
    case Phase::kLengths: return "lengths";
    case Phase::kPlan: return "plan";
    case Phase::kExchange: return "exchange";
    case Phase::kPack: return "pack";
    case Phase::kDeliver: return "deliver";
    case Phase::kAgree: return "agree";
  }
  return "invalid";
}

int64_t RankStep::bytes_sent() const {
  int64_t n = 0;
  for (const PhaseStats& p : phases) n += p.bytes_sent;
  return n;
}

int64_t PhaseTable::max_rank_bytes() const {
  int64_t most = 0;
  const size_t ranks = bytes.empty() ? 0 : bytes[0].size();
  for (size_t r = 0; r < ranks; ++r) {
    int64_t t = 0;
    for (const auto& b : bytes) t += b[r];
    most = std::max(most, t);
  }
  return most;
}

Result<PhaseTable> GatherPhases(ProcessGroup& world, const RankStep& step) {
  constexpr size_t kPhases = kNumPhases;
  std::vector<int64_t> my_bytes(kPhases, 0);
  std::vector<double> my_times(kPhases, 0);
  for (const PhaseStats& p : step.phases) {
    my_bytes[static_cast<size_t>(p.phase)] = p.bytes_sent;
    my_times[static_cast<size_t>(p.phase)] = p.seconds;
  }
  const size_t n = static_cast<size_t>(world.size());
  std::vector<int64_t> bytes(n * kPhases);
  std::vector<double> times(n * kPhases);
  THDPACK_RETURN_IF_ERROR(world.AllGatherValues(std::span<const int64_t>(my_bytes),
                                                std::span<int64_t>(bytes)));
  THDPACK_RETURN_IF_ERROR(world.AllGatherValues(std::span<const double>(my_times),
                                                std::span<double>(times)));
  PhaseTable table;
  table.bytes.assign(kPhases, std::vector<int64_t>(n, 0));
  table.seconds.assign(kPhases, 0);
  table.rank_seconds.assign(n, 0);
  for (size_t k = 0; k < kPhases; ++k) {
    for (size_t r = 0; r < n; ++r) {
      table.bytes[k][r] = bytes[r * kPhases + k];
      table.seconds[k] = std::max(table.seconds[k], times[r * kPhases + k]);
      table.rank_seconds[r] += times[r * kPhases + k];
    }
  }
  for (double t : table.rank_seconds) table.step_seconds = std::max(table.step_seconds, t);
  return table;
}

}  // namespace thdpack
