// The cross-entropy's public functions (thdpack/loss.h): CrossEntropy, and the vocab-parallel
// phases VocabParallelPartials, CombineVocabPartials and VocabParallelGrad. Each checks its
// arguments (loss_internal::Prepare), runs the row kernels over the rows on threads - the
// kernel set of the ISA chosen once here (ActiveIsa: the widest this CPU runs, or the one a
// test forces) - and turns the rows' online softmax states into log-probabilities, entropies
// and log-sum-exps. The kernels: cross_entropy_kernels.cc (float32, bfloat16) and
// cross_entropy_f64.cc; the plain definition they are tested against:
// cross_entropy_reference.cc.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "loss/cross_entropy_kernels.h"
#include "loss/loss_internal.h"

namespace thdpack {
namespace {

#ifdef THDPACK_X86_ISAS
using loss_internal::ForwardBF16V4Native;
#endif
using loss_internal::ForwardRowsF64;
using loss_internal::GradRowsF64;
using loss_internal::Job;
using loss_internal::KernelSet;
using loss_internal::Kernels;
using loss_internal::Prepared;
using loss_internal::RowStats;

// -1: the widest supported ISA; otherwise the forced one (ForceIsa).
std::atomic<int> forced_isa{-1};

loss_internal::Isa WidestIsa() {
  using loss_internal::Isa;
  static const Isa widest = [] {
#ifdef THDPACK_X86_ISAS
    if (__builtin_cpu_supports("x86-64-v4")) return Isa::kX86_64V4;
    if (__builtin_cpu_supports("x86-64-v3")) return Isa::kX86_64V3;
#endif
    return Isa::kBaseline;
  }();
  return widest;
}

void RunForward(LogitsDtype dtype, const Job& job, int64_t rows, int threads) {
  const loss_internal::Isa isa = loss_internal::ActiveIsa();
  const KernelSet& k = Kernels(isa);
  loss_internal::ParallelRows(rows, threads, [&](int64_t b, int64_t e) {
    switch (dtype) {
      case LogitsDtype::kFloat32: k.forward_f32(job, b, e); break;
      case LogitsDtype::kBFloat16:
#ifdef THDPACK_X86_ISAS
        if (job.grad != nullptr && isa == loss_internal::Isa::kX86_64V4 &&
            loss_internal::NativeBf16Store()) {
          ForwardBF16V4Native(job, b, e);
          break;
        }
#endif
        k.forward_bf16(job, b, e);
        break;
      case LogitsDtype::kFloat64: ForwardRowsF64(job, b, e); break;
    }
  });
}

double Scale(const CrossEntropyOptions& options) {
  return options.normalizer > 0 ? options.grad_scale / static_cast<double>(options.normalizer)
                                : 0.0;
}

// The logit of token t's label (in this shard's columns), as the kernel saw it.
double TargetLogit(const LogitsView& logits, const Prepared& p, int64_t t) {
  const int64_t i = t * p.vocab_size + (p.labels[t] - p.vocab_start);
  switch (logits.dtype) {
    case LogitsDtype::kFloat32: return reinterpret_cast<const float*>(logits.data.data())[i];
    case LogitsDtype::kBFloat16:
      return BFloat16{reinterpret_cast<const uint16_t*>(logits.data.data())[i]}.ToFloat();
    case LogitsDtype::kFloat64: return reinterpret_cast<const double*>(logits.data.data())[i];
  }
  return 0;
}

Status NonFinite(const char* fn, int64_t t) {
  return Status::InvalidArgument(std::string(fn) + ": logits row " + std::to_string(t) +
                                 " has a non-finite log-sum-exp: a counted token's logits must "
                                 "be finite (and not all -inf)");
}

std::atomic<bool> force_portable_bf16{false};

}  // namespace

namespace loss_internal {
bool NativeBf16Store() {
#ifdef THDPACK_NATIVE_BF16
  static const bool cpu =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bf16");
  return cpu && !force_portable_bf16.load(std::memory_order_relaxed);
#else
  return false;
#endif
}
void ForcePortableBf16Store(bool portable) { force_portable_bf16.store(portable); }

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kBaseline: return "baseline";
    case Isa::kX86_64V3: return "x86-64-v3";
    case Isa::kX86_64V4: return "x86-64-v4";
  }
  return "?";
}
int IsaLanes(Isa isa) {
  switch (isa) {
    case Isa::kBaseline: return 4;
    case Isa::kX86_64V3: return 8;
    case Isa::kX86_64V4: return 16;
  }
  return 0;
}
std::vector<Isa> SupportedIsas() {
  std::vector<Isa> out = {Isa::kBaseline};
  if (WidestIsa() == Isa::kBaseline) return out;
  out.push_back(Isa::kX86_64V3);
  if (WidestIsa() == Isa::kX86_64V4) out.push_back(Isa::kX86_64V4);
  return out;
}
Isa ActiveIsa() {
  const int forced = forced_isa.load(std::memory_order_relaxed);
  return forced < 0 ? WidestIsa() : static_cast<Isa>(forced);
}
Status ForceIsa(std::optional<Isa> isa) {
  if (!isa) {
    forced_isa.store(-1);
    return Status::Ok();
  }
  const std::vector<Isa> ok = SupportedIsas();
  if (std::find(ok.begin(), ok.end(), *isa) == ok.end()) {
    return Status::InvalidArgument(std::string("ForceIsa: isa ") + IsaName(*isa) +
                                   " is not supported here: this CPU and build run up to " +
                                   IsaName(WidestIsa()));
  }
  forced_isa.store(static_cast<int>(*isa));
  return Status::Ok();
}
}  // namespace loss_internal

Result<CrossEntropyResult> CrossEntropy(const LogitsView& logits, const TokenTargets& targets,
                                        const CrossEntropyOptions& options,
                                        std::span<std::byte> grad) {
  THDPACK_ASSIGN_OR_RETURN(
      Prepared p, loss_internal::Prepare("CrossEntropy", logits, targets, options,
                                         loss_internal::Mode::kFull, options.with_grad, grad));
  const int64_t T = p.num_tokens;
  std::vector<RowStats> stats(static_cast<size_t>(T));
  Job job;
  job.logits = logits.data.data();
  job.vocab = p.vocab_size;
  job.labels = p.labels.data();
  job.grad = options.with_grad ? grad.data() : nullptr;
  job.scale = Scale(options);
  job.stats = stats.data();
  RunForward(logits.dtype, job, T, loss_internal::ResolveThreads(options.num_threads, T));
  CrossEntropyResult r;
  r.logprobs.assign(static_cast<size_t>(T), 0.0);
  r.entropy.assign(static_cast<size_t>(T), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (p.labels[t] < 0) continue;
    const RowStats& s = stats[t];
    const double log_s = std::log(s.s);
    const double lse = s.m + log_s;
    if (!std::isfinite(lse) || !std::isfinite(s.w)) return NonFinite("CrossEntropy", t);
    r.logprobs[t] = TargetLogit(logits, p, t) - lse;
    r.entropy[t] = log_s - s.w / s.s;
  }
  loss_internal::Summarise(p, &r);
  return r;
}

Result<std::vector<VocabPartial>> VocabParallelPartials(const LogitsView& logits,
                                                        const TokenTargets& targets,
                                                        const CrossEntropyOptions& options) {
  THDPACK_ASSIGN_OR_RETURN(
      Prepared p, loss_internal::Prepare("VocabParallelPartials", logits, targets, options,
                                         loss_internal::Mode::kVocabParallel, false, {}));
  const int64_t T = p.num_tokens;
  std::vector<RowStats> stats(static_cast<size_t>(T));
  Job job;
  job.logits = logits.data.data();
  job.vocab = p.vocab_size;
  job.labels = p.labels.data();
  job.vocab_start = p.vocab_start;
  job.stats = stats.data();
  RunForward(logits.dtype, job, T, loss_internal::ResolveThreads(options.num_threads, T));
  std::vector<VocabPartial> out(static_cast<size_t>(T));
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    if (p.labels[t] < 0) {
      out[t] = VocabPartial{-kInf, 0, 0, -kInf};
      continue;
    }
    const RowStats& s = stats[t];
    if (std::isnan(s.m) || std::isnan(s.s) || std::isnan(s.w) || s.m == kInf ||
        std::isinf(s.w)) {
      return NonFinite("VocabParallelPartials", t);
    }
    const int64_t col = p.labels[t] - p.vocab_start;
    const double target = (col >= 0 && col < p.vocab_size) ? TargetLogit(logits, p, t) : -kInf;
    out[t] = VocabPartial{s.m, s.s, s.w, target};
  }
  return out;
}

Result<VocabParallelCombined> CombineVocabPartials(
    std::span<const std::span<const VocabPartial>> partials, const TokenTargets& targets) {
  if (partials.empty()) {
    return Status::InvalidArgument(
        "CombineVocabPartials: partials is empty: pass one span per TP rank");
  }
  const int64_t T = static_cast<int64_t>(partials[0].size());
  for (size_t r = 0; r < partials.size(); ++r) {
    if (static_cast<int64_t>(partials[r].size()) != T) {
      return Status::InvalidArgument(
          "CombineVocabPartials: partials[" + std::to_string(r) + "] has " +
          std::to_string(partials[r].size()) + " tokens, partials[0] has " + std::to_string(T) +
          ": every TP rank holds the same tokens");
    }
  }
  // The labels and mask decide which tokens count; the vocabulary range was checked in phase
  // 1 (here any label >= 0 is accepted; exactly one rank must hold it).
  LogitsView shape;
  shape.dtype = LogitsDtype::kFloat64;
  shape.num_tokens = T;
  shape.vocab_size = 1;
  std::vector<double> dummy;  // Prepare checks logits bytes; give it a view of the right size
  dummy.resize(static_cast<size_t>(T));
  shape.data = std::as_bytes(std::span<const double>(dummy));
  CrossEntropyOptions opts;
  opts.vocab_total = std::numeric_limits<int64_t>::max();
  THDPACK_ASSIGN_OR_RETURN(
      Prepared p, loss_internal::Prepare("CombineVocabPartials", shape, targets, opts,
                                         loss_internal::Mode::kVocabParallel, false, {}));
  constexpr double kInf = std::numeric_limits<double>::infinity();
  VocabParallelCombined c;
  c.lse.assign(static_cast<size_t>(T), 0.0);
  c.result.logprobs.assign(static_cast<size_t>(T), 0.0);
  c.result.entropy.assign(static_cast<size_t>(T), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (p.labels[t] < 0) continue;
    double M = -kInf;
    int found = 0;
    double target = 0;
    for (const auto& part : partials) {
      M = std::max(M, part[t].max);
      if (part[t].target_logit != -kInf) {
        ++found;
        target = part[t].target_logit;
      }
    }
    if (found != 1) {
      return Status::InvalidArgument(
          "CombineVocabPartials: token " + std::to_string(t) + " (label " +
          std::to_string(p.labels[t]) + ") has its target logit on " + std::to_string(found) +
          " TP ranks: exactly one rank's columns must hold each counted label");
    }
    double S = 0, W = 0;
    for (const auto& part : partials) {
      const VocabPartial& q = part[t];
      if (q.max == -kInf) continue;
      const double b = std::exp(q.max - M);
      if (b == 0) continue;  // a partial far below the max adds nothing (0 * -inf is NaN)
      S += b * q.sum_exp;
      W += b * (q.sum_exp_shifted + (q.max - M) * q.sum_exp);
    }
    const double log_s = std::log(S);
    const double lse = M + log_s;
    if (!std::isfinite(lse) || !std::isfinite(W)) return NonFinite("CombineVocabPartials", t);
    c.lse[t] = lse;
    c.result.logprobs[t] = target - lse;
    c.result.entropy[t] = log_s - W / S;
  }
  loss_internal::Summarise(p, &c.result);
  return c;
}

Status VocabParallelGrad(const LogitsView& logits, const TokenTargets& targets,
                         std::span<const double> lse, const CrossEntropyOptions& options,
                         std::span<std::byte> grad) {
  THDPACK_ASSIGN_OR_RETURN(
      Prepared p, loss_internal::Prepare("VocabParallelGrad", logits, targets, options,
                                         loss_internal::Mode::kVocabParallel, true, grad));
  const int64_t T = p.num_tokens;
  if (static_cast<int64_t>(lse.size()) != T) {
    return Status::InvalidArgument("VocabParallelGrad: lse has " + std::to_string(lse.size()) +
                                   " entries: it must have one per token, T = " +
                                   std::to_string(T));
  }
  for (int64_t t = 0; t < T; ++t) {
    if (p.labels[t] >= 0 && !std::isfinite(lse[t])) {
      return Status::InvalidArgument("VocabParallelGrad: lse[" + std::to_string(t) +
                                     "] is not finite: pass CombineVocabPartials' lse");
    }
  }
  Job job;
  job.logits = logits.data.data();
  job.vocab = p.vocab_size;
  job.labels = p.labels.data();
  job.vocab_start = p.vocab_start;
  job.grad = grad.data();
  job.scale = Scale(options);
  job.lse = lse.data();
  const LogitsDtype dtype = logits.dtype;
  const KernelSet& k = Kernels(loss_internal::ActiveIsa());
  loss_internal::ParallelRows(T, loss_internal::ResolveThreads(options.num_threads, T),
                              [&](int64_t b, int64_t e) {
                                switch (dtype) {
                                  case LogitsDtype::kFloat32: k.grad_f32(job, b, e); break;
                                  case LogitsDtype::kBFloat16: k.grad_bf16(job, b, e); break;
                                  case LogitsDtype::kFloat64: GradRowsF64(job, b, e); break;
                                }
                              });
  return Status::Ok();
}

}  // namespace thdpack
