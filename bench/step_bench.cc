// The distributed step on the thread backend: per phase, the time and the bytes each rank sends,
// next to the minimum bytes of docs/design.md section 7. Topology TP=1 CP=2 DP=4 PP=1 (8 ranks),
// 32K padded tokens per CP rank per microbatch, the built-in mock data (lognormal, mean 2048).
//
// Minimum bytes (per step, summed over ranks), as docs/design.md section 7 counts them:
//   lengths   12 bytes per sample to each loader that did not read it: 12 * n * (DP - 1)
//   exchange  the payload of every sample that changes replica (4 bytes a token, +1 for a mask)
//   deliver   every CP shard once to each rank of the stage that uses it, except the loader's
//             own (8 bytes a token of tokens + position ids to the first stage, 5 of labels +
//             mask to the last), plus the encoded metadata once to every non-loader rank
// The measured bytes follow ProcessGroup's bytes_sent rule (thdpack/comm.h); "agree" is the
// status agreement between phases, which the minimum does not count.
//
// Usage: step_bench [steps=5] [global_batch=256]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/step_runner.h"
#include "thdpack/wire.h"

using namespace thdpack;

namespace {


struct Minimum {
  int64_t lengths = 0, exchange = 0;
};

// The length-exchange and token-exchange minimum of one step, from a loader's view of it
// (samples in scheduling order, plan). Sums over ranks.
Minimum StepMinimum(const RankStep& loader, const Topology& topo) {
  Minimum m;
  const int dp = topo.dp_size();
  const int64_t n = static_cast<int64_t>(loader.samples.size());
  m.lengths = 12 * n * (dp - 1);
  // Sample at scheduling position p was read by loader d when p falls in d's block; the blocks
  // are the samples i % DP == d in source order, so loader d holds ceil((n - d) / DP) of them.
  std::vector<int64_t> begin(static_cast<size_t>(dp) + 1, 0);
  for (int d = 0; d < dp; ++d) begin[static_cast<size_t>(d) + 1] = begin[static_cast<size_t>(d)] + (n - d + dp - 1) / dp;
  std::map<int64_t, int> replica_of;
  for (int d = 0; d < dp; ++d) {
    for (int mb = 0; mb < loader.plan.num_microbatches; ++mb) {
      for (int64_t id : loader.plan.Microbatch(d, mb)) replica_of[id] = d;
    }
  }
  for (int d = 0; d < dp; ++d) {
    for (int64_t p = begin[static_cast<size_t>(d)]; p < begin[static_cast<size_t>(d) + 1]; ++p) {
      const SampleLength& s = loader.samples[static_cast<size_t>(p)];
      auto it = replica_of.find(s.id);
      if (it != replica_of.end() && it->second != d) {
        m.exchange += 4 * s.length + (s.n_targets != s.length - 1 ? s.length : 0);
      }
    }
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  const int64_t global_batch = argc > 2 ? std::atoll(argv[2]) : 256;
  auto topo = *Topology::Create(1, 2, 4, 1);
  StepRunnerOptions o;
  o.data = "mock";
  o.global_batch = global_batch;
  o.schedule.max_tokens_per_rank = 32768;
  o.schedule.parallel = *ParallelLayout::Create(topo.cp_size(), topo.tp_size());
  o.schedule.dp_size = 4;  // the topology's
  o.check_plan_hash = false;

  const int W = topo.world_size();
  // [step][rank][phase]
  std::vector<std::vector<std::vector<PhaseStats>>> stats(
      static_cast<size_t>(steps), std::vector<std::vector<PhaseStats>>(static_cast<size_t>(W)));
  // Per step: the padded tokens of each replica (from each loader's metadata), the encoded
  // metadata size of each replica, and loader 0's view of the samples and plan.
  std::vector<std::vector<int64_t>> padded(static_cast<size_t>(steps), std::vector<int64_t>(4, 0));
  std::vector<std::vector<int64_t>> meta_size(static_cast<size_t>(steps), std::vector<int64_t>(4, 0));
  std::vector<RankStep> loader0(static_cast<size_t>(steps));
  std::mutex mu;
  auto statuses = RunOnThreads(W, [&](ProcessGroup& world) -> Status {
    THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(world, topo, o));
    for (int s = 0; s < steps; ++s) {
      THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
      std::lock_guard<std::mutex> lk(mu);
      stats[static_cast<size_t>(s)][static_cast<size_t>(world.rank())] = step.phases;
      if (step.is_loader) {
        THDPACK_ASSIGN_OR_RETURN(auto bytes, EncodeStepMeta(step.meta));
        padded[static_cast<size_t>(s)][static_cast<size_t>(step.coord.dp)] = step.meta.padded_tokens;
        meta_size[static_cast<size_t>(s)][static_cast<size_t>(step.coord.dp)] = static_cast<int64_t>(bytes.size());
        if (step.coord.dp == 0) loader0[static_cast<size_t>(s)] = std::move(step);
      }
    }
    return Status::Ok();
  });
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) {
      std::fprintf(stderr, "rank %zu: %s\n", r, statuses[r].ToString().c_str());
      return 1;
    }
  }

  // Minimum per step (sums over ranks); then averaged over the steps.
  double min_lengths = 0, min_exchange = 0, min_deliver = 0;
  const int cp = topo.cp_size();
  const int others = topo.tp_size() * topo.cp_size() * topo.pp_size() - 1;  // non-loader ranks
  const int first_others = topo.tp_size() * cp - 1;  // first-stage ranks but the loader (PP = 1)
  for (int s = 0; s < steps; ++s) {
    Minimum m = StepMinimum(loader0[static_cast<size_t>(s)], topo);
    min_lengths += static_cast<double>(m.lengths);
    min_exchange += static_cast<double>(m.exchange);
    for (int d = 0; d < topo.dp_size(); ++d) {
      // PP = 1: every rank of the replica but the loader is first and last stage at once and
      // needs its CP shard (padded/CP tokens) of tokens, position ids, labels and mask: 13 bytes
      // a token; the metadata once to each of them.
      const double shard_tokens = static_cast<double>(padded[static_cast<size_t>(s)][static_cast<size_t>(d)]) / cp;
      min_deliver += shard_tokens * first_others * 13.0 +
                     static_cast<double>(meta_size[static_cast<size_t>(s)][static_cast<size_t>(d)]) * others;
    }
  }
  min_lengths /= steps;
  min_exchange /= steps;
  min_deliver /= steps;

  std::printf("thdpack step on the thread backend: %s, %lld samples/step (mock, mean length 2048), "
              "32768 tokens per rank, %d steps, %d ranks\n",
              topo.ToString().c_str(), static_cast<long long>(global_batch), steps, W);
  std::printf("%-9s %12s %16s %16s %16s %10s\n", "phase", "time (ms)", "bytes/step", "max bytes/rank",
              "minimum bytes", "ratio");
  double total_time = 0, total_bytes = 0;
  for (int k = 0; k < kNumPhases; ++k) {
    double t = 0, bytes = 0, max_rank = 0;
    for (int s = 0; s < steps; ++s) {
      double slowest = 0;
      for (int r = 0; r < W; ++r) {
        for (const PhaseStats& p : stats[static_cast<size_t>(s)][static_cast<size_t>(r)]) {
          if (static_cast<int>(p.phase) != k) continue;
          slowest = std::max(slowest, p.seconds);
          bytes += static_cast<double>(p.bytes_sent);
          max_rank = std::max(max_rank, static_cast<double>(p.bytes_sent));
        }
      }
      t += slowest;
    }
    t /= steps;
    bytes /= steps;
    total_time += t;
    total_bytes += bytes;
    const double minimum = k == 1 ? min_lengths : k == 3 ? min_exchange : k == 5 ? min_deliver : 0;
    char ratio[32] = "-";
    if (minimum > 0) std::snprintf(ratio, sizeof ratio, "%.4f", bytes / minimum);
    std::printf("%-9s %12.3f %16.0f %16.0f %16.0f %10s\n", std::string(PhaseName(static_cast<Phase>(k))).c_str(), 1000 * t, bytes, max_rank,
                minimum, ratio);
  }
  const double min_total = min_lengths + min_exchange + min_deliver;
  std::printf("%-9s %12.3f %16.0f %16s %16.0f %10.4f\n", "total", 1000 * total_time, total_bytes, "",
              min_total, total_bytes / min_total);
  std::printf("(time: the slowest rank per phase, mean over steps; bytes: summed over ranks, mean "
              "over steps; agree waits for the slowest loader, so its time includes idle ranks)\n");
  return 0;
}
