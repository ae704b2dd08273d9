// Argument checks, dtypes and threading shared by every cross-entropy path.
#include <algorithm>
#include <cmath>
#include <string>
#include <thread>

#include "loss/loss_internal.h"
#include "thdpack/pack.h"

namespace thdpack {

std::string_view LogitsDtypeName(LogitsDtype dtype) {
  switch (dtype) {
    case LogitsDtype::kFloat32: return "float32";
    case LogitsDtype::kBFloat16: return "bfloat16";
    case LogitsDtype::kFloat64: return "float64";
  }
  return "invalid";
}

Result<int64_t> LogitsDtypeSize(LogitsDtype dtype) {
  switch (dtype) {
    case LogitsDtype::kFloat32: return int64_t{4};
    case LogitsDtype::kBFloat16: return int64_t{2};
    case LogitsDtype::kFloat64: return int64_t{8};
  }
  return Status::InvalidArgument("logits dtype " + std::to_string(static_cast<int>(dtype)) +
                                 " is unsupported: use float32, bfloat16 or float64");
}

Result<LogitsDtype> ParseLogitsDtype(std::string_view name) {
  if (name == "float32" || name == "fp32" || name == "float") return LogitsDtype::kFloat32;
  if (name == "bfloat16" || name == "bf16") return LogitsDtype::kBFloat16;
  if (name == "float64" || name == "fp64" || name == "double") return LogitsDtype::kFloat64;
  return Status::InvalidArgument("logits dtype \"" + std::string(name) +
                                 "\" is unsupported: use float32, bfloat16 or float64");
}

Result<double> GradientFactor(bool framework_averages, int dp_size, int cp_size) {
  if (dp_size < 1) {
    return Status::InvalidArgument("GradientFactor: dp_size = " + std::to_string(dp_size) +
                                   " must be >= 1");
  }
  if (cp_size < 1) {
    return Status::InvalidArgument("GradientFactor: cp_size = " + std::to_string(cp_size) +
                                   " must be >= 1");
  }
  return framework_averages ? static_cast<double>(dp_size) * cp_size : 1.0;
}

namespace loss_internal {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

bool Overlap(std::span<const std::byte> a, std::span<const std::byte> b) {
  if (a.empty() || b.empty()) return false;
  const auto* a0 = a.data();
  const auto* b0 = b.data();
  return std::less<>()(a0, b0 + b.size()) && std::less<>()(b0, a0 + a.size());
}

}  // namespace

Result<Prepared> Prepare(const char* fn, const LogitsView& logits, const TokenTargets& targets,
                         const CrossEntropyOptions& options, Mode mode, bool need_grad,
                         std::span<const std::byte> grad) {
  const std::string f = fn;
  auto dtype_size = LogitsDtypeSize(logits.dtype);
  if (!dtype_size.ok()) return dtype_size.status().WithContext(f + ": logits.dtype");
  Prepared p;
  p.elem_size = *dtype_size;
  p.num_tokens = logits.num_tokens;
  p.vocab_size = logits.vocab_size;
  if (logits.num_tokens < 0) {
    return Status::InvalidArgument(f + ": logits.num_tokens = " + Str(logits.num_tokens) +
                                   " must be >= 0");
  }
  if (logits.vocab_size < 1) {
    return Status::InvalidArgument(f + ": logits.vocab_size = " + Str(logits.vocab_size) +
                                   " must be >= 1");
  }
  const int64_t T = logits.num_tokens;
  const int64_t V = logits.vocab_size;
  if (T > 0 && V > (int64_t{1} << 62) / T / p.elem_size) {
    return Status::OutOfRange(f + ": logits of " + Str(T) + " x " + Str(V) + " do not fit");
  }
  const int64_t bytes = T * V * p.elem_size;
  if (static_cast<int64_t>(logits.data.size()) != bytes) {
    return Status::InvalidArgument(
        f + ": logits.data has " + Str(static_cast<int64_t>(logits.data.size())) +
        " bytes: it must hold T x V = " + Str(T) + " x " + Str(V) + " " +
        std::string(LogitsDtypeName(logits.dtype)) + " values (" + Str(bytes) + " bytes)");
  }
  // Vocabulary range.
  if (mode == Mode::kFull) {
    if (options.vocab_start != 0) {
      return Status::InvalidArgument(
          f + ": options.vocab_start = " + Str(options.vocab_start) +
          " must be 0: a vocab-parallel shard goes through VocabParallelPartials");
    }
    if (options.vocab_total != 0 && options.vocab_total != V) {
      return Status::InvalidArgument(
          f + ": options.vocab_total = " + Str(options.vocab_total) +
          " must be 0 or logits.vocab_size = " + Str(V) +
          ": a vocab-parallel shard goes through VocabParallelPartials");
    }
  }
  p.vocab_start = options.vocab_start;
  p.vocab_total = options.vocab_total == 0 ? V : options.vocab_total;
  if (p.vocab_start < 0 || p.vocab_total < 1 || p.vocab_start > p.vocab_total - V) {
    return Status::InvalidArgument(
        f + ": columns [vocab_start, vocab_start + vocab_size) = [" + Str(p.vocab_start) +
        ", " + Str(p.vocab_start + V) + ") must lie inside [0, vocab_total = " +
        Str(p.vocab_total) + ")");
  }
  if (options.num_threads < 0) {
    return Status::InvalidArgument(f + ": options.num_threads = " + Str(options.num_threads) +
                                   " must be >= 0 (0 = hardware)");
  }
  // Labels.
  const bool has32 = !targets.labels_i32.empty();
  const bool has64 = !targets.labels_i64.empty();
  if (has32 && has64) {
    return Status::InvalidArgument(f + ": labels_i32 and labels_i64 are both given: pass one");
  }
  const int64_t n_labels = has32 ? static_cast<int64_t>(targets.labels_i32.size())
                                 : static_cast<int64_t>(targets.labels_i64.size());
  if (n_labels != T) {
    return Status::InvalidArgument(f + ": labels has " + Str(n_labels) +
                                   " entries: it must have one per token, T = " + Str(T));
  }
  const bool mask8 = !targets.mask_u8.empty();
  const bool maskf = !targets.mask_f32.empty();
  if (mask8 && maskf) {
    return Status::InvalidArgument(f + ": mask_u8 and mask_f32 are both given: pass one");
  }
  if (mask8 && static_cast<int64_t>(targets.mask_u8.size()) != T) {
    return Status::InvalidArgument(f + ": loss_mask has " + Str(int64_t(targets.mask_u8.size())) +
                                   " entries: it must have one per token, T = " + Str(T));
  }
  if (maskf && static_cast<int64_t>(targets.mask_f32.size()) != T) {
    return Status::InvalidArgument(f + ": loss_mask has " +
                                   Str(int64_t(targets.mask_f32.size())) +
                                   " entries: it must have one per token, T = " + Str(T));
  }
  p.labels.resize(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    bool on = true;
    if (mask8) {
      const uint8_t m = targets.mask_u8[t];
      if (m > 1) {
        return Status::InvalidArgument(f + ": loss_mask[" + Str(t) + "] = " + Str(m) +
                                       " must be 0 or 1");
      }
      on = m != 0;
    } else if (maskf) {
      const float m = targets.mask_f32[t];
      if (m != 0.0f && m != 1.0f) {
        return Status::InvalidArgument(f + ": loss_mask[" + Str(t) + "] = " +
                                       std::to_string(m) + " must be 0 or 1");
      }
      on = m != 0.0f;
    }
    const int64_t y = has32 ? int64_t{targets.labels_i32[t]} : targets.labels_i64[t];
    if (!on || y == kIgnoreIndex) {
      p.labels[t] = -1;
      continue;
    }
    if (y < 0 || y >= p.vocab_total) {
      return Status::InvalidArgument(
          f + ": labels[" + Str(t) + "] = " + Str(y) +
          " (loss_mask 1) must lie in [0, V = " + Str(p.vocab_total) + ") or be -100 (ignored)");
    }
    p.labels[t] = y;
    ++p.n_valid;
  }
  if (need_grad) {
    if (options.normalizer < 0) {
      return Status::InvalidArgument(f + ": options.normalizer N = " + Str(options.normalizer) +
                                     " must be >= 0 (the global loss-token count)");
    }
    if (options.normalizer < p.n_valid) {
      return Status::InvalidArgument(
          f + ": options.normalizer N = " + Str(options.normalizer) +
          " is smaller than this shard's counted tokens (" + Str(p.n_valid) +
          "): N must be the GLOBAL loss-token count of the step");
    }
    if (!std::isfinite(options.grad_scale)) {
      return Status::InvalidArgument(f + ": options.grad_scale must be finite");
    }
    if (static_cast<int64_t>(grad.size()) != bytes) {
      return Status::InvalidArgument(
          f + ": grad has " + Str(static_cast<int64_t>(grad.size())) +
          " bytes: with_grad needs T x V = " + Str(T) + " x " + Str(V) + " " +
          std::string(LogitsDtypeName(logits.dtype)) + " values (" + Str(bytes) + " bytes)");
    }
    if (Overlap(grad, logits.data)) {
      return Status::InvalidArgument(f + ": grad overlaps logits.data: give it its own buffer");
    }
  }
  return p;
}

int ResolveThreads(int requested, int64_t rows) {
  int64_t n = requested > 0 ? requested
                            : static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  n = std::min(n, std::max<int64_t>(rows, 1));
  return static_cast<int>(n);
}

void ParallelRows(int64_t rows, int threads, const std::function<void(int64_t, int64_t)>& body) {
  if (threads <= 1 || rows <= 1) {
    body(0, rows);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  const int64_t per = rows / threads;
  const int64_t extra = rows % threads;
  auto begin_of = [&](int64_t i) { return i * per + std::min(i, extra); };
  for (int i = 1; i < threads; ++i) {
    pool.emplace_back([&, i] { body(begin_of(i), begin_of(i + 1)); });
  }
  body(0, begin_of(1));
  for (auto& th : pool) th.join();
}

void Summarise(const Prepared& p, CrossEntropyResult* r) {
  r->n_valid = p.n_valid;
  r->counted.resize(static_cast<size_t>(p.num_tokens));
  double loss = 0, ent = 0;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const bool c = p.labels[t] >= 0;
    r->counted[t] = c ? 1 : 0;
    if (!c) continue;
    loss -= r->logprobs[t];
    ent += r->entropy[t];
  }
  r->loss_sum = loss;
  r->entropy_sum = ent;
}

}  // namespace loss_internal
}  // namespace thdpack
