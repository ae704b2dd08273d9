// The plain cross-entropy: fp64 arithmetic, std::exp per element, one thread, two passes per
// row (max, then sums) and a third for the gradient. The definition the fast paths are tested
// against; written for reading, not speed.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "loss/loss_internal.h"

namespace thdpack {
namespace {

double LoadAsDouble(const std::byte* base, LogitsDtype dtype, int64_t i) {
  switch (dtype) {
    case LogitsDtype::kFloat32: {
      float f;
      std::memcpy(&f, base + i * 4, 4);
      return f;
    }
    case LogitsDtype::kBFloat16: {
      BFloat16 b;
      std::memcpy(&b.bits, base + i * 2, 2);
      return b.ToFloat();
    }
    case LogitsDtype::kFloat64: {
      double d;
      std::memcpy(&d, base + i * 8, 8);
      return d;
    }
  }
  return 0;
}

void StoreFromDouble(std::byte* base, LogitsDtype dtype, int64_t i, double v) {
  switch (dtype) {
    case LogitsDtype::kFloat32: {
      const float f = static_cast<float>(v);
      std::memcpy(base + i * 4, &f, 4);
      return;
    }
    case LogitsDtype::kBFloat16: {
      const BFloat16 b = BFloat16::FromFloat(static_cast<float>(v));
      std::memcpy(base + i * 2, &b.bits, 2);
      return;
    }
    case LogitsDtype::kFloat64:
      std::memcpy(base + i * 8, &v, 8);
      return;
  }
}

}  // namespace

Result<CrossEntropyResult> CrossEntropyReference(const LogitsView& logits,
                                                 const TokenTargets& targets,
                                                 const CrossEntropyOptions& options,
                                                 std::span<std::byte> grad) {
  THDPACK_ASSIGN_OR_RETURN(
      loss_internal::Prepared p,
      loss_internal::Prepare("CrossEntropyReference", logits, targets, options,
                             loss_internal::Mode::kFull, options.with_grad, grad));
  const int64_t T = p.num_tokens;
  const int64_t V = p.vocab_size;
  CrossEntropyResult r;
  r.logprobs.assign(static_cast<size_t>(T), 0.0);
  r.entropy.assign(static_cast<size_t>(T), 0.0);
  const std::byte* base = logits.data.data();
  const double scale =
      options.normalizer > 0 ? options.grad_scale / static_cast<double>(options.normalizer) : 0.0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = t * V;
    if (p.labels[t] < 0) {
      if (options.with_grad) {
        for (int64_t v = 0; v < V; ++v) StoreFromDouble(grad.data(), logits.dtype, row + v, 0.0);
      }
      continue;
    }
    double m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, LoadAsDouble(base, logits.dtype, row + v));
    double s = 0, w = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double z = LoadAsDouble(base, logits.dtype, row + v);
      if (z == -INFINITY) continue;
      const double e = std::exp(z - m);
      s += e;
      w += e * (z - m);
    }
    const double lse = m + std::log(s);
    if (!std::isfinite(lse)) {
      return Status::InvalidArgument("CrossEntropyReference: logits row " + std::to_string(t) +
                                     " has a non-finite log-sum-exp: a counted token's logits "
                                     "must be finite (and not all -inf)");
    }
    const double zy = LoadAsDouble(base, logits.dtype, row + p.labels[t]);
    r.logprobs[t] = zy - lse;
    r.entropy[t] = std::log(s) - w / s;
    if (options.with_grad) {
      for (int64_t v = 0; v < V; ++v) {
        const double z = LoadAsDouble(base, logits.dtype, row + v);
        const double prob = std::exp(z - lse);
        const double g = (prob - (v == p.labels[t] ? 1.0 : 0.0)) * scale;
        StoreFromDouble(grad.data(), logits.dtype, row + v, g);
      }
    }
  }
  loss_internal::Summarise(p, &r);
  return r;
}

}  // namespace thdpack
