// loss_bench: cross-entropy forward + backward (fused gradient) throughput, in logits per
// second per core, for T tokens and V in {32000, 151936}, bf16 and fp32 logits. Rows:
//   fast, 1 thread     CrossEntropy(with_grad), num_threads = 1
//   fast, N threads    the same with N = hardware threads (per-core figure = total / N)
//   1 thread, <isa>    the 1-thread row with each narrower ISA variant this CPU runs (the
//                      fast rows use the widest: x86-64-v4 16 floats per vector, x86-64-v3 8,
//                      baseline 4), forced through loss_internal::ForceIsa
//   plain fp32 loop    a chunk-free fp32 loop written here: max pass, std::exp sum pass, and a
//                      std::exp gradient pass (measured on the first --ref-tokens rows)
//   memcpy floor       memcpy of the logits bytes into the gradient buffer: the logits read
//                      once and the gradient written once, the least any implementation moves
// "x floor" is time / memcpy time for the same bytes, measured in the same run (goal: the
// 1-thread fast row within 3x). Before timing, the fast path's loss is checked against the
// plain loop on the reference rows (exit 1 on a mismatch). Buffers are touched before timing;
// each row reports the median of --reps runs.
//
// Usage: loss_bench [--tokens T] [--reps R] [--ref-tokens R] [--threads N] [--vocab V]...
// T defaults to 8192: at V = 151936 fp32 that is 5 GB of logits plus 5 GB of gradient; pass a
// smaller T for quick runs. Prints a table; never fails on a time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loss/loss_internal.h"
#include "thdpack/loss.h"

namespace {

using thdpack::BFloat16;
using thdpack::LogitsDtype;

double MedianSeconds(int reps, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double>(b - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

float LoadF(const std::byte* p, LogitsDtype d, int64_t i) {
  if (d == LogitsDtype::kBFloat16) {
    uint16_t u;
    std::memcpy(&u, p + i * 2, 2);
    return BFloat16{u}.ToFloat();
  }
  float f;
  std::memcpy(&f, p + i * 4, 4);
  return f;
}
void StoreF(std::byte* p, LogitsDtype d, int64_t i, float v) {
  if (d == LogitsDtype::kBFloat16) {
    const uint16_t u = BFloat16::FromFloat(v).bits;
    std::memcpy(p + i * 2, &u, 2);
    return;
  }
  std::memcpy(p + i * 4, &v, 4);
}

// The plain fp32 loop: three passes per row, std::exp per element. Returns the loss sum.
double PlainLoop(const std::byte* logits, LogitsDtype d, int64_t rows, int64_t V,
                 const std::vector<int32_t>& labels, float scale, std::byte* grad) {
  double loss = 0;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t row = t * V;
    float m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, LoadF(logits, d, row + v));
    float s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(LoadF(logits, d, row + v) - m);
    const float lse = m + std::log(s);
    loss += lse - LoadF(logits, d, row + labels[t]);
    for (int64_t v = 0; v < V; ++v) {
      const float p = std::exp(LoadF(logits, d, row + v) - lse);
      StoreF(grad, d, row + v, (p - (v == labels[t] ? 1.0f : 0.0f)) * scale);
    }
  }
  return loss;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 8192;
  int reps = 3;
  int64_t ref_tokens = 256;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int64_t> vocabs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> long long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (a == "--tokens") {
      tokens = next();
    } else if (a == "--reps") {
      reps = static_cast<int>(next());
    } else if (a == "--ref-tokens") {
      ref_tokens = next();
    } else if (a == "--threads") {
      threads = static_cast<int>(next());
    } else if (a == "--vocab") {
      vocabs.push_back(next());
    } else {
      std::fprintf(stderr,
                   "usage: loss_bench [--tokens T] [--reps R] [--ref-tokens R] [--threads N] "
                   "[--vocab V]...\n");
      return 2;
    }
  }
  if (vocabs.empty()) vocabs = {32000, 151936};
  if (tokens < 1 || reps < 1 || ref_tokens < 1 || threads < 1) {
    std::fprintf(stderr, "tokens, reps, ref-tokens and threads must be >= 1\n");
    return 2;
  }
  ref_tokens = std::min(ref_tokens, tokens);
  std::printf("cross-entropy forward + backward, T = %lld tokens, %d hardware threads used for "
              "the N-thread rows, median of %d runs\n",
              static_cast<long long>(tokens), threads, reps);
  const thdpack::loss_internal::Isa widest = thdpack::loss_internal::ActiveIsa();
  std::printf("fast rows: the %s kernel (%d floats per vector)\n",
              thdpack::loss_internal::IsaName(widest), thdpack::loss_internal::IsaLanes(widest));
  std::printf("%-7s %-9s %-18s %10s %14s %14s %9s\n", "V", "dtype", "path", "time_s",
              "Glogits/s", "Glogits/s/core", "x floor");
  bool all_ok = true;
  for (int64_t V : vocabs) {
    for (LogitsDtype d : {LogitsDtype::kBFloat16, LogitsDtype::kFloat32}) {
      const int64_t esize = *thdpack::LogitsDtypeSize(d);
      const int64_t n = tokens * V;
      std::vector<std::byte> logits(static_cast<size_t>(n * esize));
      std::vector<std::byte> grad(logits.size());
      {
        std::mt19937_64 rng(1);
        std::normal_distribution<float> z(0.0f, 3.0f);
        // A few thousand distinct values repeated: realistic spread, fast to fill.
        std::vector<float> pool(4099);
        for (float& x : pool) x = z(rng);
        for (int64_t i = 0; i < n; ++i) StoreF(logits.data(), d, i, pool[i % 4099]);
        std::memset(grad.data(), 0, grad.size());
      }
      std::vector<int32_t> labels(static_cast<size_t>(tokens));
      for (int64_t t = 0; t < tokens; ++t) labels[t] = static_cast<int32_t>((t * 7919) % V);
      const thdpack::LogitsView view{d, logits, tokens, V};
      const thdpack::TokenTargets targets{labels, {}, {}, {}};
      thdpack::CrossEntropyOptions o;
      o.with_grad = true;
      o.normalizer = tokens;

      // Correctness first, on the reference rows.
      const thdpack::LogitsView ref_view{
          d, std::span<const std::byte>(logits).first(static_cast<size_t>(ref_tokens * V * esize)),
          ref_tokens, V};
      const std::vector<int32_t> ref_labels(labels.begin(), labels.begin() + ref_tokens);
      std::vector<std::byte> ref_grad(static_cast<size_t>(ref_tokens * V * esize));
      thdpack::CrossEntropyOptions ro = o;
      ro.normalizer = ref_tokens;
      auto check = thdpack::CrossEntropy(
          ref_view, {ref_labels, {}, {}, {}}, ro,
          std::span<std::byte>(grad).first(static_cast<size_t>(ref_tokens * V * esize)));
      const double plain_loss = PlainLoop(logits.data(), d, ref_tokens, V, labels,
                                          1.0f / static_cast<float>(ref_tokens), ref_grad.data());
      if (!check.ok() ||
          std::abs(check->loss_sum - plain_loss) > 1e-4 * std::abs(plain_loss) + 1e-3) {
        std::printf("MISMATCH V=%lld %s: fast %s, plain %.6f\n", static_cast<long long>(V),
                    std::string(thdpack::LogitsDtypeName(d)).c_str(),
                    check.ok() ? std::to_string(check->loss_sum).c_str()
                               : check.status().ToString().c_str(),
                    plain_loss);
        all_ok = false;
        continue;
      }

      const double t_copy = MedianSeconds(reps, [&] {
        std::memcpy(grad.data(), logits.data(), logits.size());
      });
      auto fast = [&](int th) {
        thdpack::CrossEntropyOptions fo = o;
        fo.num_threads = th;
        return MedianSeconds(reps, [&] {
          auto r = thdpack::CrossEntropy(view, targets, fo, grad);
          if (!r.ok()) std::abort();
        });
      };
      const double t1 = fast(1);
      const double tn = threads > 1 ? fast(threads) : t1;
      const double t_plain_rows = MedianSeconds(1, [&] {
        PlainLoop(logits.data(), d, ref_tokens, V, labels, 1.0f, ref_grad.data());
      });
      const double t_plain = t_plain_rows * static_cast<double>(tokens) / ref_tokens;
      const double g = static_cast<double>(n) / 1e9;
      auto row = [&](const char* path, double secs, int cores) {
        std::printf("%-7lld %-9s %-18s %10.4f %14.3f %14.3f %9.2f\n", static_cast<long long>(V),
                    std::string(thdpack::LogitsDtypeName(d)).c_str(), path, secs, g / secs,
                    g / secs / cores, secs / t_copy);
      };
      row("fast, 1 thread", t1, 1);
      if (threads > 1) {
        const std::string label = "fast, " + std::to_string(threads) + " threads";
        row(label.c_str(), tn, threads);
      }
      for (thdpack::loss_internal::Isa isa : thdpack::loss_internal::SupportedIsas()) {
        if (isa == widest) continue;
        if (!thdpack::loss_internal::ForceIsa(isa).ok()) std::abort();
        const double t_isa = fast(1);
        if (!thdpack::loss_internal::ForceIsa(std::nullopt).ok()) std::abort();
        const std::string label = std::string("1 thread, ") + thdpack::loss_internal::IsaName(isa);
        row(label.c_str(), t_isa, 1);
      }
      row("plain fp32 loop", t_plain, 1);
      row("memcpy floor", t_copy, 1);
      std::fflush(stdout);
    }
  }
  std::printf("plain fp32 loop: timed on the first %lld rows, scaled to T\n",
              static_cast<long long>(ref_tokens));
  return all_ok ? 0 : 1;
}
