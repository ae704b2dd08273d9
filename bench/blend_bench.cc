// blend_bench: blends at scale (docs/data_sources.md, "blend:FILE.json").
//
//   1. The rule: choices a second for D = 3, 30, 300, 1000 sources (thdpack's kinetic
//      tournament), beside Megatron's loop transcribed (O(D) a sample), which is what building
//      its index costs, and the bytes that index takes for N samples (N * (2 + 8)).
//   2. A blend of 1,000 mock sources: the time and memory to open it and read its first
//      sample; to resume from a saved state at sample 10^9; to replay it to sample 10^8 (a
//      --start-step without a state), against Megatron's index to 10^8 (its loop, scaled).
//   3. Weighting by tokens on the real length data (data/): three sources of very different
//      lengths, weights 0.5 / 0.3 / 0.2 of the tokens; the token shares a run actually gets and
//      their worst deviation from the weights over windows of 1, 10 and 100 steps of 256 samples,
//      beside weighting by samples.
//
// Usage: blend_bench [--quick]   (--quick: smaller counts, for a smoke run). Prints tables;
// never fails on a time.
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_data.h"
#include "thdpack/blend.h"
#include "thdpack/data.h"

namespace {

using Clock = std::chrono::steady_clock;
using thdpack::LargestErrorReference;
using thdpack::LargestErrorRule;
using thdpack::NormalizeWeights;

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The peak resident memory of the process so far, in MiB.
double PeakMiB() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

void Check(const thdpack::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "blend_bench: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

std::vector<double> Weights(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> w(static_cast<size_t>(d));
  for (double& x : w) x = std::pow(10.0, -3.0 * u(rng));  // 0.001 .. 1
  return NormalizeWeights(w);
}

std::string BlendOfMocks(int d) {
  std::string json = "blend:{\"sources\": [";
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int k = 0; k < d; ++k) {
    json += (k ? "," : "") + std::string("{\"data\":\"mock\",\"weight\":") +
            std::to_string(std::pow(10.0, -3.0 * u(rng))) + ",\"seed\":" + std::to_string(k) + "}";
  }
  return json + "]}";
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::printf("blend_bench%s\n\n", quick ? " (--quick)" : "");

  // 1. The rule.
  std::printf("%-10s %18s %18s %10s   %s\n", "sources", "thdpack choices/s", "Megatron loop/s",
              "ratio", "Megatron's index for 1e8 / 1e9 samples");
  for (int d : {3, 30, 300, 1000}) {
    const std::vector<double> w = Weights(d, static_cast<uint64_t>(d));
    auto rule = LargestErrorRule::Create(w);
    Check(rule.status(), "rule");
    const int64_t n = quick ? 200000 : 5000000;
    auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) rule->Take(rule->Next(), 1);
    const double ours = static_cast<double>(n) / Seconds(t0);
    std::vector<int64_t> counts(w.size(), 0);
    const int64_t m = std::max<int64_t>(1000, (quick ? 20000000 : 200000000) / d);
    t0 = Clock::now();
    int64_t check = 0;
    for (int64_t i = 0; i < m; ++i) {
      const int k = LargestErrorReference(w, counts, i);
      ++counts[static_cast<size_t>(k)];
      check += k;
    }
    const double theirs = static_cast<double>(m) / Seconds(t0);
    std::printf("%-10d %18.3g %18.3g %9.1fx   %.0f s and 0.93 GiB / %.0f s and 9.3 GiB%s\n", d,
                ours, theirs, ours / theirs, 1e8 / theirs, 1e9 / theirs, check < 0 ? " " : "");
  }

  // 2. A blend of 1,000 mock sources.
  const int d = 1000;
  const std::string spec = BlendOfMocks(d);
  const double mem0 = PeakMiB();
  auto t0 = Clock::now();
  auto blend = thdpack::OpenSource(spec);
  Check(blend.status(), "open");
  auto first = (*blend)->NextLength();
  Check(first.status(), "first");
  const double open_s = Seconds(t0);
  const double open_mib = PeakMiB() - mem0;
  // A state at sample 10^9: the counts at the weights' shares (what the rule keeps within one
  // of), each source's cursor after its count.
  std::vector<double> raw;
  {
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int k = 0; k < d; ++k) raw.push_back(std::pow(10.0, -3.0 * u(rng)));
  }
  const std::vector<double> w = NormalizeWeights(raw);
  const int64_t far = 1000000000;
  thdpack::SourceCursor state;
  int64_t total = 0;
  for (int k = 0; k < d; ++k) {
    const int64_t c = k + 1 < d ? static_cast<int64_t>(std::floor(w[static_cast<size_t>(k)] * far))
                                : far - total;
    total += c;
    state.taken.push_back(c);
  }
  {
    auto probe = thdpack::OpenSource(spec);
    Check(probe.status(), "open");
    auto zero = (*probe)->CursorAfter(0);
    Check(zero.status(), "cursor");
    // Each mock source: epoch 65536 samples; its cursor after `taken` samples by arithmetic.
    for (int k = 0; k < d; ++k) {
      const int64_t c = state.taken[static_cast<size_t>(k)];
      thdpack::SourceCursor part = zero->parts[static_cast<size_t>(k)];
      const int64_t size = part.epoch_size;
      if (c > 0) {
        part.epoch = (c - 1) / size;
        part.position = (c - 1) % size + 1;
        part.next_id = part.epoch * size + part.position;
      }
      state.parts.push_back(part);
    }
    state.position = state.next_id = far;
  }
  t0 = Clock::now();
  auto resumed = thdpack::OpenSource(spec);
  Check(resumed.status(), "open");
  Check((*resumed)->Seek(state), "seek");
  auto after = (*resumed)->NextLength();
  Check(after.status(), "next after the seek");
  const double resume_s = Seconds(t0);
  // Replay to 10^8 (by samples: the rule alone, then each source's own cursor).
  const int64_t replay_n = quick ? 1000000 : 100000000;
  t0 = Clock::now();
  auto replayed = (*resumed)->CursorAfter(replay_n);
  Check(replayed.status(), "replay");
  const double replay_s = Seconds(t0);
  std::printf("\nA blend of %d mock sources (weights 0.001 .. 1):\n", d);
  std::printf("  open and read the first sample   %.3f s, %.1f MiB\n", open_s, open_mib);
  std::printf("  resume a state at sample 1e9     %.3f s (O(D): the rule from the counts, each "
              "source's seek)\n", resume_s);
  std::printf("  replay to sample %.0e           %.2f s, %.3g samples/s (a --start-step without "
              "a state)\n", static_cast<double>(replay_n), replay_s,
              static_cast<double>(replay_n) / replay_s);

  // 3. Weighting by tokens on real lengths.
  const std::string dir = thdpack_bench::DataDir();
  const std::string files[3] = {"wikipedia_doc_lengths.txt", "prolong_doc_lengths.txt",
                                "wlbllm_doc_lengths.txt"};
  const double weights[3] = {0.5, 0.3, 0.2};
  const int64_t batch = 256;
  const int64_t steps = quick ? 400 : 4000;
  std::printf("\nWeights 0.5 / 0.3 / 0.2 over %s, %s, %s (data/), %lld steps of %lld samples:\n",
              files[0].c_str(), files[1].c_str(), files[2].c_str(),
              static_cast<long long>(steps), static_cast<long long>(batch));
  std::printf("  %-8s %28s   %s\n", "by", "token shares of the run",
              "worst |share - weight| over windows of 1 / 10 / 100 steps");
  for (const char* by : {"tokens", "samples"}) {
    std::string json = "blend:{\"weight_by\":\"" + std::string(by) + "\",\"sources\":[";
    for (int k = 0; k < 3; ++k) {
      json += (k ? "," : "") + std::string("{\"data\":\"lengths:") + dir + "/" + files[k] +
              "\",\"weight\":" + std::to_string(weights[k]) + ",\"shuffle\":true}";
    }
    json += "]}";
    auto src = thdpack::OpenSource(json);
    Check(src.status(), "open the real-data blend");
    std::vector<std::array<double, 3>> per_step;  // tokens per source per step
    std::array<double, 3> all{};
    for (int64_t s = 0; s < steps; ++s) {
      std::array<double, 3> t{};
      for (int64_t i = 0; i < batch; ++i) {
        auto x = (*src)->NextLength();
        Check(x.status(), "read");
        t[static_cast<size_t>((**x).source)] += static_cast<double>((**x).length);
      }
      per_step.push_back(t);
      for (int k = 0; k < 3; ++k) all[static_cast<size_t>(k)] += t[static_cast<size_t>(k)];
    }
    // Per window (every start), the largest |share - weight| over the sources; then its
    // worst and its 95th percentile over the windows.
    double worst[3] = {0, 0, 0}, p95[3] = {0, 0, 0};
    const int windows[3] = {1, 10, 100};
    for (int wi = 0; wi < 3; ++wi) {
      std::vector<double> dev;
      for (int64_t s = 0; s + windows[wi] <= steps; ++s) {
        std::array<double, 3> t{};
        for (int64_t j = s; j < s + windows[wi]; ++j) {
          for (int k = 0; k < 3; ++k) t[static_cast<size_t>(k)] += per_step[static_cast<size_t>(j)][static_cast<size_t>(k)];
        }
        const double sum = t[0] + t[1] + t[2];
        double d = 0;
        for (int k = 0; k < 3; ++k) d = std::max(d, std::fabs(t[static_cast<size_t>(k)] / sum - weights[k]));
        dev.push_back(d);
      }
      std::sort(dev.begin(), dev.end());
      worst[wi] = dev.back();
      p95[wi] = dev[static_cast<size_t>(0.95 * static_cast<double>(dev.size() - 1))];
    }
    const double sum = all[0] + all[1] + all[2];
    std::printf("  %-8s %8.4f / %.4f / %.4f   worst %.4f / %.4f / %.4f, p95 %.4f / %.4f / %.4f\n",
                by, all[0] / sum, all[1] / sum, all[2] / sum, worst[0], worst[1], worst[2], p95[0],
                p95[1], p95[2]);
  }
  return 0;
}
