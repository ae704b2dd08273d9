// The probe model of thdpack/probe.h: seeded weights, the per-token building blocks, the
// single-rank reference, the plain step reader and the comparison of summaries.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/splitmix64.h"
#include "probe/probe_attention.h"
#include "probe/probe_internal.h"
#include "thdpack/probe.h"

namespace thdpack {
namespace {

using internal::Mix64;

// Weight tensors of one layer, in storage order.
enum LayerTensor : int { kNorm1 = 0, kWq, kWk, kWv, kWo, kNorm2, kW1, kW2, kNumLayerTensors };

// Uniform in [-1, 1) from (seed, tensor, index): integer arithmetic, then one exact scaling.
double Uniform(uint64_t seed, uint64_t tensor, uint64_t index) {
  const uint64_t h = Mix64(Mix64(seed ^ (tensor * 0xd6e8feb86659fd93ull)) + index);
  return static_cast<double>(h >> 11) * 0x1.0p-52 - 1.0;
}

void Fill(std::span<double> w, uint64_t seed, uint64_t tensor, double scale, double offset) {
  for (size_t i = 0; i < w.size(); ++i) w[i] = offset + scale * Uniform(seed, tensor, i);
}

void RmsNorm(const double* x, const double* w, int h, double* out) {
  double ss = 0;
  for (int j = 0; j < h; ++j) ss += x[j] * x[j];
  const double inv = 1.0 / std::sqrt(ss / h + 1e-6);
  for (int j = 0; j < h; ++j) out[j] = x[j] * inv * w[j];
}

// out[c] = sum_k x[k] W[k, c], W row-major [in, out].
void MatVec(const double* x, const double* w, int in, int out_dim, double* out) {
  probe_internal::RowTimesMatrix(x, w, in, out_dim, out_dim, out);
}

}  // namespace

Result<ProbeModel> ProbeModel::Create(const ProbeConfig& c) {
  auto bad = [](const std::string& field, int64_t v, const std::string& rule) {
    return Status::InvalidArgument("ProbeConfig: " + field + " = " + std::to_string(v) + ": " +
                                   rule);
  };
  if (c.vocab_size < 1) return bad("vocab_size", c.vocab_size, "must be >= 1");
  if (c.hidden < 1) return bad("hidden", c.hidden, "must be >= 1");
  if (c.heads < 1) return bad("heads", c.heads, "must be >= 1");
  if (c.layers < 1) return bad("layers", c.layers, "must be >= 1");
  if (c.ffn < 1) return bad("ffn", c.ffn, "must be >= 1");
  if (c.hidden % (2 * c.heads) != 0) {
    return bad("hidden", c.hidden,
               "must be a multiple of 2 * heads = " + std::to_string(2 * c.heads) +
                   " (RoPE rotates pairs of each head's dimensions)");
  }
  if (!(c.rope_base > 1)) {
    return Status::InvalidArgument("ProbeConfig: rope_base = " + std::to_string(c.rope_base) +
                                   ": must be > 1");
  }
  if (c.vocab_size > (int64_t{1} << 28) / c.hidden || c.hidden > 4096 || c.ffn > 16384 ||
      c.layers > 1024) {
    return Status::InvalidArgument(
        "ProbeConfig: vocab_size x hidden must stay under 2^28 weights, hidden <= 4096, "
        "ffn <= 16384, layers <= 1024 (a probe model is small)");
  }
  ProbeModel m(c);
  const int64_t h = c.hidden, f = c.ffn, v = c.vocab_size;
  m.layer_stride_ = 2 * h + 4 * h * h + 2 * h * f;
  m.embedding_.resize(static_cast<size_t>(v * h));
  m.layers_.resize(static_cast<size_t>(m.layer_stride_ * c.layers));
  m.final_norm_.resize(static_cast<size_t>(h));
  m.output_.resize(static_cast<size_t>(h * v));
  // Scales keep activations O(1): projections of variance 1/fan_in (uniform: sqrt(3/fan_in)).
  const double sh = std::sqrt(3.0 / static_cast<double>(h));
  const double sf = std::sqrt(3.0 / static_cast<double>(f));
  Fill(m.embedding_, c.seed, 1, 1.0, 0.0);
  Fill(m.final_norm_, c.seed, 2, 0.1, 1.0);
  Fill(m.output_, c.seed, 3, sh, 0.0);
  for (int l = 0; l < c.layers; ++l) {
    for (int t = 0; t < kNumLayerTensors; ++t) {
      std::span<const double> w = m.Layer(l, t);
      std::span<double> mw(const_cast<double*>(w.data()), w.size());
      const uint64_t id = 100 + static_cast<uint64_t>(l) * kNumLayerTensors + t;
      if (t == kNorm1 || t == kNorm2) {
        Fill(mw, c.seed, id, 0.1, 1.0);
      } else {
        Fill(mw, c.seed, id, t == kW2 ? sf : sh, 0.0);
      }
    }
  }
  return m;
}

std::span<const double> ProbeModel::Layer(int layer, int tensor) const {
  const int64_t h = config_.hidden, f = config_.ffn;
  const int64_t sizes[kNumLayerTensors] = {h, h * h, h * h, h * h, h * h, h, h * f, f * h};
  int64_t offset = layer_stride_ * layer;
  for (int t = 0; t < tensor; ++t) offset += sizes[t];
  return std::span<const double>(layers_).subspan(static_cast<size_t>(offset),
                                                  static_cast<size_t>(sizes[tensor]));
}

std::pair<int, int> ProbeModel::StageLayers(int pp, int pp_size) const {
  const int64_t l = config_.layers;
  return {static_cast<int>(l * pp / pp_size), static_cast<int>(l * (pp + 1) / pp_size)};
}

void ProbeModel::Embed(std::span<const TokenId> tokens, std::span<double> x) const {
  const int64_t h = config_.hidden;
  for (size_t r = 0; r < tokens.size(); ++r) {
    const int64_t row = static_cast<int64_t>(static_cast<uint32_t>(tokens[r])) % config_.vocab_size;
    std::copy_n(embedding_.begin() + row * h, h, x.begin() + static_cast<int64_t>(r) * h);
  }
}

void ProbeModel::Qkv(int layer, std::span<const double> x, std::span<const int32_t> positions,
                     std::span<double> q, std::span<double> k, std::span<double> v) const {
  const int h = config_.hidden;
  const int d = head_dim();
  std::vector<double> xn(static_cast<size_t>(h));
  std::vector<double> inv_freq(static_cast<size_t>(d / 2));
  for (int i = 0; i < d / 2; ++i) {
    inv_freq[static_cast<size_t>(i)] = std::pow(config_.rope_base, -2.0 * i / d);
  }
  for (size_t r = 0; r < positions.size(); ++r) {
    const size_t o = r * static_cast<size_t>(h);
    RmsNorm(&x[o], Layer(layer, kNorm1).data(), h, xn.data());
    MatVec(xn.data(), Layer(layer, kWq).data(), h, h, &q[o]);
    MatVec(xn.data(), Layer(layer, kWk).data(), h, h, &k[o]);
    MatVec(xn.data(), Layer(layer, kWv).data(), h, h, &v[o]);
    const double pos = positions[r];
    for (int head = 0; head < config_.heads; ++head) {
      for (int i = 0; i < d / 2; ++i) {
        const double angle = pos * inv_freq[static_cast<size_t>(i)];
        const double cs = std::cos(angle), sn = std::sin(angle);
        for (double* t : {&q[o], &k[o]}) {
          double* pair = t + head * d + 2 * i;
          const double a = pair[0], b = pair[1];
          pair[0] = a * cs - b * sn;
          pair[1] = a * sn + b * cs;
        }
      }
    }
  }
}

void ProbeModel::AttnOutAndMlp(int layer, std::span<const double> attn, std::span<double> x) const {
  const int h = config_.hidden, f = config_.ffn;
  std::vector<double> tmp(static_cast<size_t>(h)), xn(static_cast<size_t>(h)),
      hid(static_cast<size_t>(f));
  const size_t rows = x.size() / static_cast<size_t>(h);
  for (size_t r = 0; r < rows; ++r) {
    double* xr = &x[r * static_cast<size_t>(h)];
    MatVec(&attn[r * static_cast<size_t>(h)], Layer(layer, kWo).data(), h, h, tmp.data());
    for (int j = 0; j < h; ++j) xr[j] += tmp[static_cast<size_t>(j)];
    RmsNorm(xr, Layer(layer, kNorm2).data(), h, xn.data());
    MatVec(xn.data(), Layer(layer, kW1).data(), h, f, hid.data());
    for (double& a : hid) a = std::tanh(a);
    MatVec(hid.data(), Layer(layer, kW2).data(), f, h, tmp.data());
    for (int j = 0; j < h; ++j) xr[j] += tmp[static_cast<size_t>(j)];
  }
}

void ProbeModel::Logits(std::span<const double> x, int64_t col_begin, int64_t col_end,
                        std::span<double> logits) const {
  const int h = config_.hidden;
  const int64_t v = config_.vocab_size, cols = col_end - col_begin;
  std::vector<double> xn(static_cast<size_t>(h));
  const size_t rows = x.size() / static_cast<size_t>(h);
  for (size_t r = 0; r < rows; ++r) {
    RmsNorm(&x[r * static_cast<size_t>(h)], final_norm_.data(), h, xn.data());
    double* out = &logits[r * static_cast<size_t>(cols)];
    probe_internal::RowTimesMatrix(xn.data(), output_.data() + col_begin, h, v, cols, out);
  }
}

namespace {

// The reference of samples[s] for s in [begin, end), every `step`-th.
Status ReferenceOfSamples(const ProbeModel& model, std::span<const SampleView> samples,
                          size_t begin, size_t step, LossStats* out) {
  const ProbeConfig& c = model.config();
  const int h = c.hidden;
  LossStats& stats = *out;
  std::vector<double> scores;
  for (size_t s = begin; s < samples.size(); s += step) {
    const SampleView& sample = samples[s];
    const int64_t len = static_cast<int64_t>(sample.tokens.size());
    if (len < 1 || len > kMaxSampleLength) {
      return Status::InvalidArgument("ProbeReferenceLoss: samples[" + std::to_string(s) + "] (id " +
                                     std::to_string(sample.id) + ") has length " +
                                     std::to_string(len) + ": must be in [1, 2^31)");
    }
    if (!sample.target_mask.empty() && static_cast<int64_t>(sample.target_mask.size()) != len) {
      return Status::InvalidArgument("ProbeReferenceLoss: samples[" + std::to_string(s) +
                                     "] (id " + std::to_string(sample.id) +
                                     "): target_mask must be empty or as long as tokens");
    }
    const size_t rows = static_cast<size_t>(len), hs = static_cast<size_t>(h);
    std::vector<double> x(rows * hs), q(rows * hs), k(rows * hs), v(rows * hs), attn(rows * hs);
    std::vector<int32_t> positions(rows);
    for (size_t j = 0; j < rows; ++j) positions[j] = static_cast<int32_t>(j);
    model.Embed(sample.tokens, x);
    probe_internal::HeadMajorKv kv;
    for (int layer = 0; layer < c.layers; ++layer) {
      model.Qkv(layer, x, positions, q, k, v);
      kv.Assign(k.data(), v.data(), len, c.heads, model.head_dim());
      // Position p sees positions 0..p of its own sample: the first p + 1 rows. Two
      // positions at a time share their keys' loads.
      size_t p = 0;
      for (; p + 1 < rows; p += 2) {
        probe_internal::AttendTwoRowsFast(&q[p * hs], &q[(p + 1) * hs], kv, 0,
                                          static_cast<int64_t>(p + 1),
                                          static_cast<int64_t>(p + 2), &attn[p * hs],
                                          &attn[(p + 1) * hs], scores);
      }
      if (p < rows) {
        probe_internal::AttendRowFast(&q[p * hs], kv, 0, static_cast<int64_t>(p + 1),
                                      &attn[p * hs], scores);
      }
      model.AttnOutAndMlp(layer, attn, x);
    }
    std::vector<double> logits(rows * static_cast<size_t>(c.vocab_size));
    model.Logits(x, 0, c.vocab_size, logits);
    std::vector<int32_t> labels(rows, -100);
    std::vector<uint8_t> mask(rows, 0);
    for (size_t j = 0; j + 1 < rows; ++j) {
      labels[j] = probe_internal::ProbeLabel(sample.tokens[j + 1], c.vocab_size);
      mask[j] = sample.target_mask.empty() ? 1 : (sample.target_mask[j + 1] != 0);
    }
    LogitsView view{LogitsDtype::kFloat64, std::as_bytes(std::span<const double>(logits)), len,
                    c.vocab_size};
    TokenTargets targets;
    targets.labels_i32 = labels;
    targets.mask_u8 = mask;
    THDPACK_ASSIGN_OR_RETURN(CrossEntropyResult ce, CrossEntropyReference(view, targets, {}));
    const int32_t cu[2] = {0, static_cast<int32_t>(len)};
    const int64_t key = sample.id;
    THDPACK_RETURN_IF_ERROR(AccumulateShardLoss(ce, cu, cu, 1, 0, std::span<const int64_t>(&key, 1),
                                                &stats));
  }
  return Status::Ok();
}

}  // namespace

Result<LossStats> ProbeReferenceLoss(const ProbeModel& model, std::span<const SampleView> samples,
                                     int num_threads) {
  std::set<int64_t> seen;
  for (size_t s = 0; s < samples.size(); ++s) {
    if (!seen.insert(samples[s].id).second) {
      return Status::InvalidArgument("ProbeReferenceLoss: samples[" + std::to_string(s) + "]: id " +
                                     std::to_string(samples[s].id) +
                                     " repeats: ids must be unique");
    }
  }
  // Samples dealt round-robin over the threads (long ones spread), each its own statistics,
  // merged in thread order: the same sums whatever the thread count, up to rounding.
  const size_t threads = std::clamp<size_t>(static_cast<size_t>(std::max(num_threads, 1)), 1,
                                            std::max<size_t>(samples.size(), 1));
  std::vector<LossStats> part(threads);
  std::vector<Status> status(threads);
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] { status[t] = ReferenceOfSamples(model, samples, t, threads, &part[t]); });
  }
  status[0] = ReferenceOfSamples(model, samples, 0, threads, &part[0]);
  for (std::thread& th : pool) th.join();
  for (size_t t = 0; t < threads; ++t) THDPACK_RETURN_IF_ERROR(status[t]);
  for (size_t t = 1; t < threads; ++t) part[0].Merge(part[t]);
  return std::move(part[0]);
}

Result<std::optional<Sample>> NextSamplePlain(SampleSource& source, PlainReadState& state,
                                              int64_t split_longest) {
  if (!state.pending.empty()) {
    std::optional<Sample> s = std::move(state.pending.front());
    state.pending.pop_front();
    return s;
  }
  THDPACK_ASSIGN_OR_RETURN(std::optional<Sample> s, source.Next());
  if (!s) return s;
  const int64_t length = static_cast<int64_t>(s->tokens.size());
  const int64_t base = s->id + state.split_extra;
  if (split_longest <= 0 || length <= split_longest) {
    s->id = base;
    return s;
  }
  // Pieces of split_longest tokens, in order, ids base, base + 1, ...
  int64_t k = 0;
  for (int64_t a = 0; a < length; a += split_longest, ++k) {
    const int64_t b = std::min(length, a + split_longest);
    Sample piece;
    piece.id = base + k;
    piece.source = s->source;
    piece.tokens.assign(s->tokens.begin() + a, s->tokens.begin() + b);
    if (!s->target_mask.empty()) {
      piece.target_mask.assign(s->target_mask.begin() + a, s->target_mask.begin() + b);
    }
    state.pending.push_back(std::move(piece));
  }
  state.split_extra += k - 1;
  std::optional<Sample> first = std::move(state.pending.front());
  state.pending.pop_front();
  return first;
}

Result<std::vector<Sample>> ReadStepSamplesPlain(SampleSource& source, int64_t global_batch,
                                                 std::span<const int64_t> skipped_ids,
                                                 TokenSteps tokens_rule, PlainReadState* state,
                                                 int64_t split_longest) {
  const bool by_tokens = tokens_rule.tokens > 0;
  if ((by_tokens || split_longest > 0) && state == nullptr) {
    return Status::InvalidArgument("ReadStepSamplesPlain: token steps and split samples need "
                                   "`state`");
  }
  if (!by_tokens && global_batch < 0) {
    return Status::InvalidArgument("ReadStepSamplesPlain: global_batch = " +
                                   std::to_string(global_batch) + " must be >= 0 (0 = all)");
  }
  PlainReadState none;
  PlainReadState& st = state != nullptr ? *state : none;
  const std::set<int64_t> skipped(skipped_ids.begin(), skipped_ids.end());
  std::vector<Sample> out;
  int64_t read = 0;
  int64_t tokens = 0;        // token steps: real tokens read
  int64_t counted = 0;       // token steps: samples read no longer than longest_counted
  int64_t counted_at_reset = -1;
  bool empty_epoch = false;  // the last Next() after a Reset() found nothing either
  while (by_tokens || global_batch == 0 || read < global_batch) {
    THDPACK_ASSIGN_OR_RETURN(std::optional<Sample> s, NextSamplePlain(source, st, split_longest));
    if (!s) {
      THDPACK_RETURN_IF_ERROR(source.Reset());
      // "all" reads to the end of the epoch; from the end of one (a resumed run), the next.
      if (!by_tokens && global_batch == 0 && (read > 0 || empty_epoch)) break;
      if (empty_epoch) {
        return Status::InvalidArgument("ReadStepSamplesPlain: " + source.spec() +
                                       " holds no sample");
      }
      if (by_tokens && counted == counted_at_reset) {
        return Status::InvalidArgument("ReadStepSamplesPlain: " + source.spec() +
                                       " holds no sample that counts toward min_samples");
      }
      counted_at_reset = counted;
      empty_epoch = true;
      continue;
    }
    empty_epoch = false;
    if (by_tokens) {  // the sample refused is the next step's first
      const int64_t length = static_cast<int64_t>(s->tokens.size());
      const bool fits = tokens + length <= tokens_rule.tokens;
      if (read > 0 && !fits && counted >= tokens_rule.min_samples) {
        st.pending.push_front(std::move(*s));
        break;
      }
      tokens += length;
      if (length <= tokens_rule.longest_counted) ++counted;
    }
    ++read;
    if (skipped.count(s->id) == 0) out.push_back(std::move(*s));
  }
  return out;
}

double RelativeDifference(double a, double b) {
  const double scale = std::max(std::fabs(a), std::fabs(b));
  return scale == 0 ? 0.0 : std::fabs(a - b) / scale;
}

Status CompareLossSummaries(const LossSummary& got, const LossSummary& want, double tolerance) {
  std::string diffs;
  auto add = [&diffs](const std::string& text) {
    diffs += (diffs.empty() ? "" : "; ") + text;
  };
  auto exact = [&](const char* name, int64_t a, int64_t b) {
    if (a != b) add(std::string(name) + " " + std::to_string(a) + " vs " + std::to_string(b));
  };
  auto close = [&](const char* name, double a, double b) {
    const double r = RelativeDifference(a, b);
    if (!(r <= tolerance)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s %.17g vs %.17g (relative difference %.2e > %.0e)", name,
                    a, b, r, tolerance);
      add(buf);
    }
  };
  exact("n_tokens", got.n_tokens, want.n_tokens);
  exact("n_loss_tokens", got.n_loss_tokens, want.n_loss_tokens);
  close("loss", got.loss, want.loss);
  close("entropy", got.entropy, want.entropy);
  if (got.ppl.has_value() != want.ppl.has_value()) {
    add(std::string("ppl ") + (got.ppl ? "defined" : "null") + " vs " +
        (want.ppl ? "defined" : "null"));
  } else if (got.ppl) {
    close("ppl", *got.ppl, *want.ppl);
  }
  if (diffs.empty()) return Status::Ok();
  return Status::Internal("probe figures differ from the single-rank reference: " + diffs);
}

}  // namespace thdpack
