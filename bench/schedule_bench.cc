// Scheduling benchmarks on the real sequence-length data in data/ (see data/README.md for
// sources). Prints tables; never fails on a time.
//
//   1. Wikipedia-512 histogram (Krell et al.), all 16,279,552 sequences into packs of 512:
//      packs, efficiency and time of the histogram fast path next to the published LPFHP and
//      SPFHP figures and the lower bound.
//   2. WLB-LLM document lengths, llama2-7b cost, global batch 512 and 2048 read as `thdpack plan`
//      reads steps (StepReader, first epoch), DP in {8, 64}, (CP=1, 131072 per rank) and
//      (CP=4, 32768 per rank): imbalance (straggler / lower bound) of balanced and sequential
//      per step; the goal is balanced within 2% on every step (column steps>1.02).
//   3. Scheduling time of 16K, 64K and 1M Wikipedia documents, DP=512, CP=8, 32768 per rank.
//
// Usage: schedule_bench [DATA_DIR]   (default: data/ of the source tree)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_data.h"
#include "thdpack/cost.h"
#include "thdpack/data.h"
#include "thdpack/schedule.h"
#include "thdpack/step.h"

namespace {

using thdpack::HistogramRow;
using thdpack::ParallelLayout;
using thdpack::Plan;
using thdpack::PlanFigures;
using thdpack::SampleLength;
using thdpack::ScheduleOptions;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU time of this thread: on a shared machine the wall time also counts other programs.
double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// `length,count` after a header line (a small local reader; the library's readers are
// elsewhere).
bool ReadHistogram(const std::string& path, std::vector<HistogramRow>* rows) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return false;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream ss(line);
    HistogramRow r;
    char comma = 0;
    if (!(ss >> r.length >> comma >> r.count) || comma != ',') return false;
    rows->push_back(r);
  }
  return !rows->empty();
}

bool ReadLengths(const std::string& path, std::vector<int64_t>* out) {
  std::ifstream in(path);
  int64_t v = 0;
  while (in >> v) out->push_back(v);
  return !out->empty();
}

std::string WithCommas(int64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}

void WikipediaHistogram(const std::string& dir) {
  std::vector<HistogramRow> h;
  if (!ReadHistogram(dir + "/wikipedia_512_histogram.csv", &h)) {
    std::printf("cannot read %s/wikipedia_512_histogram.csv\n", dir.c_str());
    return;
  }
  ScheduleOptions o;
  o.max_tokens_per_rank = 512;
  thdpack::HistogramPacking best;
  double best_time = 1e30;
  for (int run = 0; run < 5; ++run) {
    const auto t0 = Clock::now();
    auto p = thdpack::PackHistogram(h, o);
    const auto t1 = Clock::now();
    if (!p.ok()) {
      std::printf("PackHistogram failed: %s\n", p.status().ToString().c_str());
      return;
    }
    best_time = std::min(best_time, Seconds(t0, t1));
    best = std::move(p).value();
  }
  std::printf("== Wikipedia-512 histogram: %s sequences, %s tokens, packs of 512 (DP=CP=1) ==\n",
              WithCommas(best.n_sequences).c_str(), WithCommas(best.real_tokens).c_str());
  std::printf("%-34s %12s %12s %14s %12s\n", "algorithm", "packs", "efficiency", "vs lower bound",
              "time");
  auto row = [&](const char* name, int64_t packs, double eff, const char* time) {
    std::printf("%-34s %12s %11.4f%% %+13.4f%% %12s\n", name, WithCommas(packs).c_str(), eff * 100,
                (static_cast<double>(packs) / best.lower_bound - 1) * 100, time);
  };
  row("lower bound ceil(tokens/512)", best.lower_bound,
      static_cast<double>(best.real_tokens) / (static_cast<double>(best.lower_bound) * 512), "-");
  row("SPFHP (published, Python)", 8166708, 0.996040, "0.032 s");
  row("LPFHP (published, Python)", 8149619, 0.998129, "0.048 s");
  char t[32];
  std::snprintf(t, sizeof t, "%.4f s", best_time);
  row("thdpack PackHistogram (BFD bulk)", best.num_packs, best.efficiency, t);
  std::printf("patterns: %zu; packs saved vs LPFHP: %s\n\n", best.patterns.size(),
              WithCommas(8149619 - best.num_packs).c_str());
}

struct StepStats {
  std::vector<double> imbalance;
  std::vector<int> microbatches;
};

void PrintStats(const char* name, const StepStats& s, int show) {
  double lo = 1e30, hi = 0, sum = 0;
  int over = 0;
  for (double v : s.imbalance) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    sum += v;
    over += v > 1.02;
  }
  double m_sum = 0;
  for (int m : s.microbatches) m_sum += m;
  std::printf("    %-10s min %.4f mean %.4f max %.4f  steps>1.02: %3d/%zu  mean M %.2f  first:",
              name, lo, sum / s.imbalance.size(), hi, over, s.imbalance.size(),
              m_sum / s.microbatches.size());
  for (int i = 0; i < show && i < static_cast<int>(s.imbalance.size()); ++i) {
    std::printf(" %.4f", s.imbalance[i]);
  }
  std::printf("\n");
}

void WlbllmImbalance(const std::string& dir) {
  std::vector<int64_t> lengths;
  if (!ReadLengths(dir + "/wlbllm_doc_lengths.txt", &lengths)) {
    std::printf("cannot read %s/wlbllm_doc_lengths.txt\n", dir.c_str());
    return;
  }
  auto cost = thdpack::ParseCostSpec("llama2-7b");
  if (!cost.ok()) return;
  std::printf("== WLB-LLM doc lengths (%zu docs), llama2-7b cost, imbalance = straggler / lower "
              "bound per step ==\n", lengths.size());
  for (int gbs : {512, 2048}) {
    const int steps = static_cast<int>(lengths.size() / gbs);
    for (int dp : {8, 64}) {
      for (auto [cp, budget] : {std::pair<int, int64_t>{1, 131072}, {4, 32768}}) {
        ScheduleOptions o;
        o.dp_size = dp;
        o.parallel = ParallelLayout::Create(cp).value();
        o.max_tokens_per_rank = budget;
        o.cost = *cost;
        StepStats bal, seq;
        double time_bal = 0;
        bool failed = false;
        // Steps as `thdpack plan` reads them: StepReader over the lengths source (sample i of
        // a step goes to loader i mod DP; loader 0's samples first).
        auto source = thdpack::OpenSource("lengths:" + dir + "/wlbllm_doc_lengths.txt");
        if (!source.ok()) {
          std::printf("%s\n", source.status().ToString().c_str());
          return;
        }
        auto reader = thdpack::StepReader::Create(source->get(), gbs, dp);
        if (!reader.ok()) return;
        for (int step = 0; step < steps && !failed; ++step) {
          auto read = reader->Next();
          if (!read.ok()) {
            std::printf("  step %d: %s\n", step, read.status().ToString().c_str());
            failed = true;
            break;
          }
          const std::vector<SampleLength>& samples = read->samples;
          for (auto kind : {ScheduleOptions::Scheduler::kBalanced,
                            ScheduleOptions::Scheduler::kSequential}) {
            o.scheduler = kind;
            const auto t0 = Clock::now();
            auto plan = thdpack::Schedule(samples, o);
            const auto t1 = Clock::now();
            if (!plan.ok()) {
              std::printf("  step %d: %s\n", step, plan.status().ToString().c_str());
              failed = true;
              break;
            }
            auto f = thdpack::ComputePlanFigures(samples, o, *plan);
            if (!f.ok()) {
              failed = true;
              break;
            }
            StepStats& s = kind == ScheduleOptions::Scheduler::kBalanced ? bal : seq;
            s.imbalance.push_back(f->imbalance);
            s.microbatches.push_back(plan->num_microbatches);
            if (kind == ScheduleOptions::Scheduler::kBalanced) time_bal += Seconds(t0, t1);
          }
        }
        if (failed) continue;
        std::printf("  global batch %4d, %3d steps, DP=%2d CP=%d budget %6lld/rank "
                    "(balanced %.2f ms/step):\n",
                    gbs, steps, dp, cp, static_cast<long long>(budget), time_bal / steps * 1e3);
        PrintStats("balanced", bal, 4);
        PrintStats("sequential", seq, 4);
      }
    }
  }
  std::printf("\n");
}

void SchedulingTime(const std::string& dir) {
  std::vector<int64_t> lengths;
  if (!ReadLengths(dir + "/wikipedia_doc_lengths.txt", &lengths)) {
    std::printf("cannot read %s/wikipedia_doc_lengths.txt\n", dir.c_str());
    return;
  }
  std::printf("== Scheduling time, Wikipedia doc lengths, DP=512 CP=8 32768 tokens/rank, tokens "
              "cost, oversize skip, one thread, best of 3 ==\n");
  std::printf("%-10s %9s %-11s %9s %9s %4s %10s %8s %8s\n", "samples", "skipped", "scheduler",
              "wall ms", "cpu ms", "M", "imbalance", "fill", "pad");
  for (size_t n : {size_t{16384}, size_t{65536}, size_t{1000000}}) {
    n = std::min(n, lengths.size());
    std::vector<SampleLength> samples(n);
    for (size_t i = 0; i < n; ++i) {
      samples[i] = {static_cast<int64_t>(i), lengths[i], lengths[i] - 1};
    }
    ScheduleOptions o;
    o.dp_size = 512;
    o.parallel = ParallelLayout::Create(8).value();
    o.max_tokens_per_rank = 32768;
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    for (auto kind : {ScheduleOptions::Scheduler::kBalanced, ScheduleOptions::Scheduler::kSequential}) {
      o.scheduler = kind;
      double best = 1e30;
      double best_cpu = 1e30;
      thdpack::Result<Plan> plan = thdpack::Status::Internal("not run");
      for (int run = 0; run < 3; ++run) {
        const double c0 = ThreadCpuSeconds();
        const auto t0 = Clock::now();
        plan = thdpack::Schedule(samples, o);
        const auto t1 = Clock::now();
        const double c1 = ThreadCpuSeconds();
        best = std::min(best, Seconds(t0, t1));
        best_cpu = std::min(best_cpu, c1 - c0);
      }
      if (!plan.ok()) {
        std::printf("%-10zu %s\n", n, plan.status().ToString().c_str());
        continue;
      }
      auto f = thdpack::ComputePlanFigures(samples, o, *plan);
      if (!f.ok()) continue;
      std::printf("%-10zu %9lld %-11s %9.1f %9.1f %4d %10.4f %8.4f %8.4f\n", n,
                  static_cast<long long>(f->n_skipped),
                  std::string(thdpack::SchedulerName(kind)).c_str(), best * 1e3, best_cpu * 1e3,
                  plan->num_microbatches, f->imbalance, f->fill, f->pad_fraction);
    }
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : thdpack_bench::DataDir();
  WikipediaHistogram(dir);
  WlbllmImbalance(dir);
  SchedulingTime(dir);
  return 0;
}
