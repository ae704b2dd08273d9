// Cross-entropy: hand-worked values, the fast path against the fp64 reference and finite
// differences in every dtype, every ISA variant this CPU runs against the reference,
// thread-count independence, masking, vocab-parallel at TP in {1,2,3,4}, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "loss/loss_internal.h"
#include "thdpack/loss.h"

namespace thdpack {
namespace {

constexpr LogitsDtype kAllDtypes[] = {LogitsDtype::kFloat32, LogitsDtype::kBFloat16,
                                      LogitsDtype::kFloat64};

// Logits of a dtype as bytes, from doubles (rounded to the dtype).
struct Logits {
  LogitsDtype dtype;
  int64_t T = 0, V = 0;
  std::vector<std::byte> bytes;

  Logits(LogitsDtype d, int64_t t, int64_t v) : dtype(d), T(t), V(v) {
    bytes.resize(static_cast<size_t>(t * v * *LogitsDtypeSize(d)));
  }
  void Set(int64_t i, double x) {
    switch (dtype) {
      case LogitsDtype::kFloat32: {
        const float f = static_cast<float>(x);
        std::memcpy(bytes.data() + i * 4, &f, 4);
        break;
      }
      case LogitsDtype::kBFloat16: {
        const uint16_t b = BFloat16::FromFloat(static_cast<float>(x)).bits;
        std::memcpy(bytes.data() + i * 2, &b, 2);
        break;
      }
      case LogitsDtype::kFloat64:
        std::memcpy(bytes.data() + i * 8, &x, 8);
        break;
    }
  }
  LogitsView View() const { return LogitsView{dtype, bytes, T, V}; }
};

// Reads element i of a dtype buffer as double.
double Get(LogitsDtype dtype, const std::vector<std::byte>& b, int64_t i) {
  switch (dtype) {
    case LogitsDtype::kFloat32: {
      float f;
      std::memcpy(&f, b.data() + i * 4, 4);
      return f;
    }
    case LogitsDtype::kBFloat16: {
      uint16_t u;
      std::memcpy(&u, b.data() + i * 2, 2);
      return BFloat16{u}.ToFloat();
    }
    case LogitsDtype::kFloat64: {
      double d;
      std::memcpy(&d, b.data() + i * 8, 8);
      return d;
    }
  }
  return 0;
}

struct Case {
  Logits logits;
  std::vector<int64_t> labels;
  std::vector<uint8_t> mask;
  TokenTargets Targets() const { return TokenTargets{{}, labels, mask, {}}; }
};

// Random logits (spread `spread`, with a few large outliers), labels in [0, V), about 1 in 5
// tokens masked and 1 in 7 labelled -100.
Case RandomCase(std::mt19937_64& rng, LogitsDtype dtype, int64_t T, int64_t V,
                double spread = 4.0) {
  Case c{Logits(dtype, T, V), {}, {}};
  std::normal_distribution<double> z(0.0, spread);
  std::uniform_int_distribution<int64_t> label(0, V - 1);
  std::uniform_int_distribution<int> die(0, 34);
  for (int64_t i = 0; i < T * V; ++i) {
    double x = z(rng);
    if (die(rng) == 0) x += 20.0;  // peaked distributions too
    c.logits.Set(i, x);
  }
  for (int64_t t = 0; t < T; ++t) {
    const int d = die(rng);
    c.labels.push_back(d % 7 == 0 ? -100 : label(rng));
    c.mask.push_back(d % 5 == 0 ? 0 : 1);
  }
  return c;
}

std::vector<std::byte> GradBuffer(const Logits& l) {
  return std::vector<std::byte>(l.bytes.size(), std::byte{0x7f});  // garbage: must be overwritten
}

// Runs the fast kernel with one ISA variant for its lifetime, then with the widest again.
class ForcedIsa {
 public:
  explicit ForcedIsa(loss_internal::Isa isa) : ok_(loss_internal::ForceIsa(isa).ok()) {}
  ~ForcedIsa() { EXPECT_TRUE(loss_internal::ForceIsa(std::nullopt).ok()); }
  bool ok() const { return ok_; }

 private:
  bool ok_;
};

// Tolerances per dtype: fp32 accumulation with a ~2 ulp exp; bf16 gradient values are rounded
// to 8 significant bits (one rounding may differ between paths: 2^-8 relative).
struct Tol {
  double value;  // per-token logprob / entropy, absolute
  double grad_rel;
  double grad_abs;  // relative to the scale grad_scale / N
};
Tol TolFor(LogitsDtype d) {
  switch (d) {
    case LogitsDtype::kFloat32: return {2e-5, 2e-5, 1e-6};
    case LogitsDtype::kBFloat16: return {2e-5, 1.0 / 128, 1e-6};
    case LogitsDtype::kFloat64: return {1e-11, 1e-11, 1e-15};
  }
  return {};
}

TEST(BFloat16Test, RoundsToNearestEvenAndConvertsBackExactly) {
  EXPECT_EQ(BFloat16::FromFloat(1.0f).bits, 0x3f80);
  EXPECT_EQ(BFloat16::FromFloat(-2.0f).bits, 0xc000);
  // 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81): to even.
  EXPECT_EQ(BFloat16::FromFloat(1.0f + 0.00390625f).bits, 0x3f80);
  // 1 + 3*2^-8 lies halfway between 0x3f81 and 0x3f82 (even): up.
  EXPECT_EQ(BFloat16::FromFloat(1.0f + 3 * 0.00390625f).bits, 0x3f82);
  // Just above halfway rounds up.
  EXPECT_EQ(BFloat16::FromFloat(std::nextafter(1.0f + 0.00390625f, 2.0f)).bits, 0x3f81);
  EXPECT_EQ(BFloat16{0x3f81}.ToFloat(), 1.0f + 0.0078125f);
  EXPECT_TRUE(std::isnan(BFloat16::FromFloat(std::numeric_limits<float>::quiet_NaN()).ToFloat()));
  EXPECT_EQ(BFloat16::FromFloat(std::numeric_limits<float>::infinity()).bits, 0x7f80);
}

// z = [0, 0, ln 2], label 2: sum exp = 1 + 1 + 2 = 4, lse = ln 4, loss = ln 4 - ln 2 = ln 2;
// p = [1/4, 1/4, 1/2], entropy = 2 * (1/4) ln 4 + (1/2) ln 2 = 1.5 ln 2. Second token masked.
// N = 2, grad_scale 3: grad row 0 = 3/2 * [1/4, 1/4, 1/2 - 1] = [0.375, 0.375, -0.75].
TEST(CrossEntropyTest, HandWorkedThreeWordVocabulary) {
  for (LogitsDtype d : {LogitsDtype::kFloat32, LogitsDtype::kFloat64}) {
    Logits l(d, 2, 3);
    l.Set(0, 0.0);
    l.Set(1, 0.0);
    l.Set(2, std::log(2.0));
    for (int i = 3; i < 6; ++i) l.Set(i, 5.0);
    const std::vector<int32_t> labels = {2, 1};
    const std::vector<float> mask = {1.0f, 0.0f};
    TokenTargets targets{labels, {}, {}, mask};
    CrossEntropyOptions o;
    o.with_grad = true;
    o.normalizer = 2;
    o.grad_scale = 3.0;
    const double tol = d == LogitsDtype::kFloat64 ? 1e-14 : 1e-6;
    for (bool reference : {false, true}) {
      SCOPED_TRACE(std::string(LogitsDtypeName(d)) + (reference ? " reference" : " fast"));
      auto grad = GradBuffer(l);
      auto r = reference ? CrossEntropyReference(l.View(), targets, o, grad)
                         : CrossEntropy(l.View(), targets, o, grad);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_EQ(r->n_valid, 1);
      EXPECT_NEAR(r->loss_sum, std::log(2.0), tol);
      EXPECT_NEAR(r->logprobs[0], -std::log(2.0), tol);
      EXPECT_NEAR(r->entropy[0], 1.5 * std::log(2.0), tol);
      EXPECT_NEAR(r->entropy_sum, 1.5 * std::log(2.0), tol);
      EXPECT_EQ(r->logprobs[1], 0.0);
      EXPECT_EQ(r->counted, (std::vector<uint8_t>{1, 0}));
      const double want[6] = {0.375, 0.375, -0.75, 0, 0, 0};
      for (int i = 0; i < 6; ++i) EXPECT_NEAR(Get(d, grad, i), want[i], tol) << i;
    }
  }
}

void ExpectMatchesReference(LogitsDtype d, int64_t T, int64_t V, uint64_t seed, double spread) {
  SCOPED_TRACE(std::string(LogitsDtypeName(d)) + " T=" + std::to_string(T) +
               " V=" + std::to_string(V) + " seed=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Case c = RandomCase(rng, d, T, V, spread);
  CrossEntropyOptions o;
  o.with_grad = true;
  o.normalizer = T + 3;
  o.grad_scale = 2.0;
  o.num_threads = 3;
  auto g_fast = GradBuffer(c.logits);
  auto g_ref = GradBuffer(c.logits);
  auto fast = CrossEntropy(c.logits.View(), c.Targets(), o, g_fast);
  auto ref = CrossEntropyReference(c.logits.View(), c.Targets(), o, g_ref);
  ASSERT_TRUE(fast.ok()) << fast.status().ToString();
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  const Tol tol = TolFor(d);
  EXPECT_EQ(fast->n_valid, ref->n_valid);
  EXPECT_EQ(fast->counted, ref->counted);
  for (int64_t t = 0; t < T; ++t) {
    ASSERT_NEAR(fast->logprobs[t], ref->logprobs[t], tol.value * (1 + std::abs(ref->logprobs[t])))
        << "token " << t;
    ASSERT_NEAR(fast->entropy[t], ref->entropy[t], tol.value * (1 + std::abs(ref->entropy[t])))
        << "token " << t;
  }
  EXPECT_NEAR(fast->loss_sum, ref->loss_sum, tol.value * (T + std::abs(ref->loss_sum)));
  EXPECT_NEAR(fast->entropy_sum, ref->entropy_sum, tol.value * (T + std::abs(ref->entropy_sum)));
  const double scale = o.grad_scale / static_cast<double>(o.normalizer);
  for (int64_t i = 0; i < T * V; ++i) {
    const double a = Get(d, g_fast, i), b = Get(d, g_ref, i);
    ASSERT_NEAR(a, b, tol.grad_rel * std::abs(b) + tol.grad_abs * scale)
        << "grad element " << i << " (token " << i / V << ", column " << i % V << ")";
  }
}

TEST(CrossEntropyTest, FastMatchesReferenceEveryDtype) {
  uint64_t seed = 11;
  for (LogitsDtype d : kAllDtypes) {
    for (int64_t V : {1, 2, 15, 16, 17, 100, 2047, 2048, 2049, 5003}) {
      ExpectMatchesReference(d, 37, V, seed++, 4.0);
    }
    ExpectMatchesReference(d, 9, 40000, seed++, 1.0);   // flat: entropy near log V
    ExpectMatchesReference(d, 9, 3000, seed++, 30.0);   // very peaked
  }
}

// Loss of the fp64 logits as a function, for finite differences: loss_sum * scale.
double LossOf(const Case& c, double scale) {
  CrossEntropyOptions o;
  auto r = CrossEntropyReference(c.logits.View(), c.Targets(), o);
  return r->loss_sum * scale;
}

TEST(CrossEntropyTest, GradientMatchesFiniteDifferences) {
  std::mt19937_64 rng(5);
  const int64_t T = 6, V = 40;
  // fp64 logits: central differences of the reference loss, compared with the fast gradient
  // of every dtype computed on the same values (fp32/bf16: their rounding of those values).
  Case c64 = RandomCase(rng, LogitsDtype::kFloat64, T, V, 2.0);
  c64.mask.assign(T, 1);
  c64.labels[2] = -100;
  const int64_t N = 9;
  const double scale = 1.0 / N;
  for (LogitsDtype d : kAllDtypes) {
    SCOPED_TRACE(LogitsDtypeName(d));
    // The same logits, rounded to d, and back to fp64 for the differences.
    Case cd{Logits(d, T, V), c64.labels, c64.mask};
    Case cdd{Logits(LogitsDtype::kFloat64, T, V), c64.labels, c64.mask};
    for (int64_t i = 0; i < T * V; ++i) cd.logits.Set(i, Get(LogitsDtype::kFloat64, c64.logits.bytes, i));
    for (int64_t i = 0; i < T * V; ++i) cdd.logits.Set(i, Get(d, cd.logits.bytes, i));
    CrossEntropyOptions o;
    o.with_grad = true;
    o.normalizer = N;
    auto grad = GradBuffer(cd.logits);
    ASSERT_TRUE(CrossEntropy(cd.logits.View(), cd.Targets(), o, grad).ok());
    const Tol tol = TolFor(d);
    for (int64_t i = 0; i < T * V; i += 7) {
      const double h = 1e-5;
      const double x = Get(LogitsDtype::kFloat64, cdd.logits.bytes, i);
      cdd.logits.Set(i, x + h);
      const double up = LossOf(cdd, scale);
      cdd.logits.Set(i, x - h);
      const double down = LossOf(cdd, scale);
      cdd.logits.Set(i, x);
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(Get(d, grad, i), fd, 1e-8 + std::max(tol.grad_rel, 1e-7) * std::abs(fd))
          << "element " << i;
    }
  }
}

TEST(CrossEntropyTest, BitIdenticalWhateverTheThreadCount) {
  for (loss_internal::Isa isa : loss_internal::SupportedIsas()) {
    ForcedIsa forced(isa);
    ASSERT_TRUE(forced.ok());
    SCOPED_TRACE(loss_internal::IsaName(isa));
    for (LogitsDtype d : kAllDtypes) {
      std::mt19937_64 rng(77);
      Case c = RandomCase(rng, d, 53, 3001);
      CrossEntropyOptions o;
      o.with_grad = true;
      o.normalizer = 100;
      o.num_threads = 1;
      auto g1 = GradBuffer(c.logits);
      auto r1 = CrossEntropy(c.logits.View(), c.Targets(), o, g1);
      ASSERT_TRUE(r1.ok());
      for (int threads : {2, 3, 8, 64}) {
        o.num_threads = threads;
        auto g = GradBuffer(c.logits);
        auto r = CrossEntropy(c.logits.View(), c.Targets(), o, g);
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->loss_sum, r1->loss_sum) << threads;
        EXPECT_EQ(r->entropy_sum, r1->entropy_sum) << threads;
        EXPECT_EQ(r->logprobs, r1->logprobs) << threads;
        EXPECT_EQ(g, g1) << threads;
      }
    }
  }
}

// Masked tokens (mask 0 or label -100) contribute nothing: their rows may even hold NaN, and the
// result equals that of the counted rows alone.
TEST(CrossEntropyTest, MaskedTokensContributeNothing) {
  for (LogitsDtype d : kAllDtypes) {
    SCOPED_TRACE(LogitsDtypeName(d));
    std::mt19937_64 rng(3);
    const int64_t T = 20, V = 300;
    Case c = RandomCase(rng, d, T, V);
    Case kept{Logits(d, 0, V), {}, {}};
    std::vector<int64_t> kept_rows;
    for (int64_t t = 0; t < T; ++t) {
      if (c.mask[t] && c.labels[t] != -100) {
        kept_rows.push_back(t);
        continue;
      }
      for (int64_t v = 0; v < V; ++v) c.logits.Set(t * V + v, std::nan(""));
      if (t % 2 == 0 && c.mask[t] == 0) c.labels[t] = 123456789;  // not looked at: the token does not count
    }
    kept.logits = Logits(d, static_cast<int64_t>(kept_rows.size()), V);
    for (size_t k = 0; k < kept_rows.size(); ++k) {
      for (int64_t v = 0; v < V; ++v) {
        kept.logits.Set(static_cast<int64_t>(k) * V + v, Get(d, c.logits.bytes, kept_rows[k] * V + v));
      }
      kept.labels.push_back(c.labels[kept_rows[k]]);
      kept.mask.push_back(1);
    }
    ASSERT_GT(kept_rows.size(), 5u);
    ASSERT_LT(kept_rows.size(), static_cast<size_t>(T));
    CrossEntropyOptions o;
    o.with_grad = true;
    o.normalizer = 50;
    auto g = GradBuffer(c.logits);
    auto gk = GradBuffer(kept.logits);
    auto r = CrossEntropy(c.logits.View(), c.Targets(), o, g);
    auto rk = CrossEntropy(kept.logits.View(), kept.Targets(), o, gk);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_TRUE(rk.ok()) << rk.status().ToString();
    EXPECT_EQ(r->n_valid, static_cast<int64_t>(kept_rows.size()));
    EXPECT_EQ(r->loss_sum, rk->loss_sum);
    EXPECT_EQ(r->entropy_sum, rk->entropy_sum);
    for (int64_t t = 0; t < T; ++t) {
      const bool counted = c.mask[t] && c.labels[t] != -100;
      EXPECT_EQ(r->counted[t], counted ? 1 : 0) << t;
      if (counted) continue;
      EXPECT_EQ(r->logprobs[t], 0.0);
      EXPECT_EQ(r->entropy[t], 0.0);
      for (int64_t v = 0; v < V; ++v) ASSERT_EQ(Get(d, g, t * V + v), 0.0) << t << "," << v;
    }
    // The reference agrees on the same input.
    auto gr = GradBuffer(c.logits);
    auto rr = CrossEntropyReference(c.logits.View(), c.Targets(), o, gr);
    ASSERT_TRUE(rr.ok()) << rr.status().ToString();
    EXPECT_EQ(rr->n_valid, r->n_valid);
  }
}

TEST(CrossEntropyTest, MinusInfinityLogitsHaveZeroProbability) {
  // A padded vocabulary column set to -inf: probability 0, gradient 0, no NaN.
  Logits l(LogitsDtype::kFloat32, 1, 4);
  l.Set(0, 1.0);
  l.Set(1, -INFINITY);
  l.Set(2, 1.0);
  l.Set(3, -INFINITY);
  const std::vector<int64_t> labels = {0};
  CrossEntropyOptions o;
  o.with_grad = true;
  o.normalizer = 1;
  for (bool reference : {false, true}) {
    auto g = GradBuffer(l);
    auto r = reference ? CrossEntropyReference(l.View(), {{}, labels, {}, {}}, o, g)
                       : CrossEntropy(l.View(), {{}, labels, {}, {}}, o, g);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_NEAR(r->loss_sum, std::log(2.0), 1e-6);
    EXPECT_NEAR(r->entropy[0], std::log(2.0), 1e-6);
    EXPECT_NEAR(Get(l.dtype, g, 0), -0.5, 1e-7);
    EXPECT_EQ(Get(l.dtype, g, 1), 0.0);
    EXPECT_NEAR(Get(l.dtype, g, 2), 0.5, 1e-7);
    EXPECT_EQ(Get(l.dtype, g, 3), 0.0);
  }
}

// Rows shaped to reach every branch of the chunked pass: a first chunk far below a later
// one (the chunk is redone relative to its own max), a chunk of only -inf, a row starting
// with -inf, and a last partial vector; and rows masked with the dtype's lowest finite value
// (masked_fill with finfo.min: exp underflows while the shifted term z - max does not).
void ExpectLateLargeAndMinusInfinityChunksMatch(LogitsDtype d) {
  SCOPED_TRACE(LogitsDtypeName(d));
  const double lowest = d == LogitsDtype::kFloat64    ? -std::numeric_limits<double>::max()
                        : d == LogitsDtype::kBFloat16 ? BFloat16{0xff7f}.ToFloat()
                                                      : -std::numeric_limits<float>::max();
  const int64_t T = 6, V = 3 * 2048 + 37;
  Logits l(d, T, V);
  std::mt19937_64 rng(8);
  std::normal_distribution<double> z(0.0, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t v = 0; v < V; ++v) {
      double x = z(rng);
      if (t == 0) x += v < 2048 ? -30.0 : (v == 5000 ? 40.0 : 0.0);
      if (t == 1 && v >= 2048 && v < 4096) x = -INFINITY;
      if (t == 2 && v < 40) x = -INFINITY;
      if (t == 3 && v == V - 1) x = 25.0;
      if (t == 4 && v % 2 == 0) x = lowest;                // scattered
      if (t == 5 && v >= 1000 && v < 5000) x = lowest;     // a masked run across chunks
      l.Set(t * V + v, x);
    }
  }
  const std::vector<int64_t> labels = {5000, 17, 6000, V - 1, 7, 6100};
  CrossEntropyOptions o;
  o.with_grad = true;
  o.normalizer = T;
  auto g = GradBuffer(l);
  auto gr = GradBuffer(l);
  auto r = CrossEntropy(l.View(), {{}, labels, {}, {}}, o, g);
  auto rr = CrossEntropyReference(l.View(), {{}, labels, {}, {}}, o, gr);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(rr.ok());
  const Tol tol = TolFor(d);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_NEAR(r->logprobs[t], rr->logprobs[t], tol.value * (1 + std::abs(rr->logprobs[t])));
    EXPECT_NEAR(r->entropy[t], rr->entropy[t], tol.value * (1 + std::abs(rr->entropy[t])));
  }
  for (int64_t i = 0; i < T * V; ++i) {
    const double a = Get(d, g, i), b = Get(d, gr, i);
    ASSERT_NEAR(a, b, tol.grad_rel * std::abs(b) + tol.grad_abs * 0.25) << i;
  }
}

TEST(CrossEntropyTest, LateLargeLogitsAndMinusInfinityChunks) {
  for (LogitsDtype d : kAllDtypes) ExpectLateLargeAndMinusInfinityChunksMatch(d);
}

// Phase 1, combine and phase 3 at TP = 1 against the reference: the gradient-only kernel.
void ExpectVocabParallelMatchesReference(LogitsDtype d, int64_t T, int64_t V, uint64_t seed) {
  SCOPED_TRACE(std::string(LogitsDtypeName(d)) + " vocab-parallel V=" + std::to_string(V));
  std::mt19937_64 rng(seed);
  Case c = RandomCase(rng, d, T, V);
  CrossEntropyOptions o;
  o.with_grad = true;
  o.normalizer = T;
  o.vocab_total = V;
  auto g_ref = GradBuffer(c.logits);
  auto ref = CrossEntropyReference(c.logits.View(), c.Targets(), o, g_ref);
  ASSERT_TRUE(ref.ok());
  auto part = VocabParallelPartials(c.logits.View(), c.Targets(), o);
  ASSERT_TRUE(part.ok()) << part.status().ToString();
  const std::vector<std::span<const VocabPartial>> views = {*part};
  auto comb = CombineVocabPartials(views, c.Targets());
  ASSERT_TRUE(comb.ok()) << comb.status().ToString();
  auto g = GradBuffer(c.logits);
  ASSERT_TRUE(VocabParallelGrad(c.logits.View(), c.Targets(), comb->lse, o, g).ok());
  const Tol tol = TolFor(d);
  for (int64_t t = 0; t < T; ++t) {
    ASSERT_NEAR(comb->result.logprobs[t], ref->logprobs[t],
                tol.value * (1 + std::abs(ref->logprobs[t])));
  }
  for (int64_t i = 0; i < T * V; ++i) {
    const double a = Get(d, g, i), b = Get(d, g_ref, i);
    ASSERT_NEAR(a, b, tol.grad_rel * std::abs(b) + tol.grad_abs / T) << "grad element " << i;
  }
}

// Every ISA variant of the fast kernel this CPU runs (the baseline's 4-float vectors, AVX2's
// 8, AVX-512's 16), not only the one dispatched, against the fp64 reference: vocabularies
// around every width and the chunk size, the chunked pass's branches, and the gradient-only
// kernel of vocab-parallel phase 3.
TEST(CrossEntropyTest, EveryIsaVariantMatchesReference) {
  const std::vector<loss_internal::Isa> isas = loss_internal::SupportedIsas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), loss_internal::Isa::kBaseline);
  EXPECT_EQ(loss_internal::ActiveIsa(), isas.back()) << "the widest supported ISA runs";
  for (loss_internal::Isa isa : isas) {
    SCOPED_TRACE(std::string(loss_internal::IsaName(isa)) + ", " +
                 std::to_string(loss_internal::IsaLanes(isa)) + " lanes");
    ForcedIsa forced(isa);
    ASSERT_TRUE(forced.ok());
    ASSERT_EQ(loss_internal::ActiveIsa(), isa);
    uint64_t seed = 300;
    for (LogitsDtype d : {LogitsDtype::kFloat32, LogitsDtype::kBFloat16}) {
      for (int64_t V : {1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 2047, 2048, 2049, 4103}) {
        ExpectMatchesReference(d, 13, V, seed++, 4.0);
      }
      ExpectMatchesReference(d, 5, 40000, seed++, 1.0);
      ExpectMatchesReference(d, 5, 3000, seed++, 30.0);
      ExpectLateLargeAndMinusInfinityChunksMatch(d);
      for (int64_t V : {5, 8, 17, 2049}) ExpectVocabParallelMatchesReference(d, 11, V, seed++);
    }
  }
  EXPECT_EQ(loss_internal::ActiveIsa(), isas.back()) << "back to the widest";
}

// The ISA variants differ only in how the lanes are summed: on the same input their results
// agree to a few float ulps of each value.
TEST(CrossEntropyTest, IsaVariantsAgreeWithEachOther) {
  const std::vector<loss_internal::Isa> isas = loss_internal::SupportedIsas();
  if (isas.size() < 2) GTEST_SKIP() << "this CPU runs only the baseline variant";
  for (LogitsDtype d : {LogitsDtype::kFloat32, LogitsDtype::kBFloat16}) {
    std::mt19937_64 rng(91);
    Case c = RandomCase(rng, d, 17, 5003);
    CrossEntropyOptions o;
    o.normalizer = 17;
    std::vector<CrossEntropyResult> results;
    for (loss_internal::Isa isa : isas) {
      ForcedIsa forced(isa);
      ASSERT_TRUE(forced.ok());
      auto r = CrossEntropy(c.logits.View(), c.Targets(), o);
      ASSERT_TRUE(r.ok());
      results.push_back(*r);
    }
    for (size_t k = 1; k < results.size(); ++k) {
      SCOPED_TRACE(std::string(LogitsDtypeName(d)) + " " +
                   loss_internal::IsaName(isas[k]) + " vs " + loss_internal::IsaName(isas[0]));
      for (int64_t t = 0; t < 17; ++t) {
        EXPECT_NEAR(results[k].logprobs[t], results[0].logprobs[t],
                    1e-5 * (1 + std::abs(results[0].logprobs[t])));
        EXPECT_NEAR(results[k].entropy[t], results[0].entropy[t],
                    1e-5 * (1 + std::abs(results[0].entropy[t])));
      }
    }
  }
}

TEST(CrossEntropyTest, ForcingAnIsaThisCpuCannotRunIsAnError) {
  const std::vector<loss_internal::Isa> isas = loss_internal::SupportedIsas();
  const loss_internal::Isa widest = loss_internal::ActiveIsa();
  for (loss_internal::Isa isa : {loss_internal::Isa::kBaseline, loss_internal::Isa::kX86_64V3,
                                 loss_internal::Isa::kX86_64V4}) {
    const bool supported = std::find(isas.begin(), isas.end(), isa) != isas.end();
    const Status s = loss_internal::ForceIsa(isa);
    EXPECT_EQ(s.ok(), supported) << loss_internal::IsaName(isa);
    if (!supported) {
      EXPECT_NE(s.ToString().find(loss_internal::IsaName(isa)), std::string::npos) << s.ToString();
      EXPECT_EQ(loss_internal::ActiveIsa(), widest) << "a refused ISA changes nothing";
    }
    ASSERT_TRUE(loss_internal::ForceIsa(std::nullopt).ok());
  }
}

// Vocab-parallel: split the columns over TP ranks (uneven splits too), run the three phases,
// and compare with the unsplit CrossEntropy.
TEST(VocabParallelTest, EqualsNonParallelForTpOneToFour) {
  uint64_t seed = 100;
  for (LogitsDtype d : kAllDtypes) {
    for (int64_t V : {7, 1000, 5003}) {
      for (int tp = 1; tp <= 4; ++tp) {
        if (tp > V) continue;
        SCOPED_TRACE(std::string(LogitsDtypeName(d)) + " V=" + std::to_string(V) +
                     " TP=" + std::to_string(tp));
        std::mt19937_64 rng(seed++);
        const int64_t T = 29;
        Case c = RandomCase(rng, d, T, V);
        CrossEntropyOptions o;
        o.with_grad = true;
        o.normalizer = 40;
        o.grad_scale = 1.5;
        auto g_full = GradBuffer(c.logits);
        auto full = CrossEntropy(c.logits.View(), c.Targets(), o, g_full);
        ASSERT_TRUE(full.ok());
        // Column ranges: the first V % tp ranks get one more column.
        std::vector<int64_t> starts = {0};
        for (int r = 0; r < tp; ++r) starts.push_back(starts.back() + V / tp + (r < V % tp));
        std::vector<Logits> parts;
        std::vector<std::vector<VocabPartial>> partials;
        for (int r = 0; r < tp; ++r) {
          const int64_t w = starts[r + 1] - starts[r];
          Logits part(d, T, w);
          for (int64_t t = 0; t < T; ++t) {
            for (int64_t v = 0; v < w; ++v) {
              part.Set(t * w + v, Get(d, c.logits.bytes, t * V + starts[r] + v));
            }
          }
          CrossEntropyOptions po = o;
          po.vocab_start = starts[r];
          po.vocab_total = V;
          auto p = VocabParallelPartials(part.View(), c.Targets(), po);
          ASSERT_TRUE(p.ok()) << p.status().ToString();
          partials.push_back(*p);
          parts.push_back(std::move(part));
        }
        std::vector<std::span<const VocabPartial>> views(partials.begin(), partials.end());
        auto comb = CombineVocabPartials(views, c.Targets());
        ASSERT_TRUE(comb.ok()) << comb.status().ToString();
        const Tol tol = TolFor(d);
        EXPECT_EQ(comb->result.n_valid, full->n_valid);
        EXPECT_EQ(comb->result.counted, full->counted);
        for (int64_t t = 0; t < T; ++t) {
          ASSERT_NEAR(comb->result.logprobs[t], full->logprobs[t],
                      tol.value * (1 + std::abs(full->logprobs[t])));
          ASSERT_NEAR(comb->result.entropy[t], full->entropy[t],
                      tol.value * (1 + std::abs(full->entropy[t])));
        }
        const double scale = o.grad_scale / o.normalizer;
        for (int r = 0; r < tp; ++r) {
          CrossEntropyOptions po = o;
          po.vocab_start = starts[r];
          po.vocab_total = V;
          auto g = GradBuffer(parts[r]);
          ASSERT_TRUE(VocabParallelGrad(parts[r].View(), c.Targets(), comb->lse, po, g).ok());
          const int64_t w = parts[r].V;
          for (int64_t t = 0; t < T; ++t) {
            for (int64_t v = 0; v < w; ++v) {
              const double a = Get(d, g, t * w + v);
              const double b = Get(d, g_full, t * V + starts[r] + v);
              ASSERT_NEAR(a, b, tol.grad_rel * std::abs(b) + tol.grad_abs * scale)
                  << "rank " << r << " token " << t << " column " << v;
            }
          }
        }
      }
    }
  }
}

TEST(VocabParallelTest, TargetOnNoRankOrTwoRanksIsAnError) {
  const std::vector<int64_t> labels = {1};
  TokenTargets targets{{}, labels, {}, {}};
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<VocabPartial> a = {{0.0, 1.0, 0.0, -inf}}, b = {{0.0, 1.0, 0.0, -inf}};
  std::vector<std::span<const VocabPartial>> views = {a, b};
  auto r = CombineVocabPartials(views, targets);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("token 0"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("exactly one"), std::string::npos);
  a[0].target_logit = 0.5;
  b[0].target_logit = 0.5;
  EXPECT_FALSE(CombineVocabPartials(views, targets).ok());
  b[0].target_logit = -inf;
  auto ok = CombineVocabPartials(views, targets);
  ASSERT_TRUE(ok.ok());
  // Two ranks, each sum exp 1 at max 0: lse = ln 2, loss = ln 2 - 0.5.
  EXPECT_NEAR(ok->result.loss_sum, std::log(2.0) - 0.5, 1e-15);
}

TEST(VocabParallelTest, GradRejectsMismatchedLseAndPartialSizes) {
  Logits l(LogitsDtype::kFloat32, 2, 5);
  const std::vector<int64_t> labels = {1, 7};
  CrossEntropyOptions o;
  o.with_grad = true;
  o.normalizer = 2;
  o.vocab_start = 5;
  o.vocab_total = 10;
  auto g = GradBuffer(l);
  const std::vector<double> lse1 = {0.0};
  Status s = VocabParallelGrad(l.View(), {{}, labels, {}, {}}, lse1, o, g);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lse has 1"), std::string::npos) << s.ToString();
  const std::vector<double> lse_nan = {0.0, std::nan("")};
  s = VocabParallelGrad(l.View(), {{}, labels, {}, {}}, lse_nan, o, g);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lse[1]"), std::string::npos) << s.ToString();
  std::vector<VocabPartial> a(2), b(3);
  std::vector<std::span<const VocabPartial>> views = {a, b};
  auto c = CombineVocabPartials(views, {{}, labels, {}, {}});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("partials[1] has 3"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Bad input.

void ExpectError(const Status& s, const std::vector<std::string>& parts) {
  ASSERT_FALSE(s.ok()) << "expected an error mentioning: " << parts[0];
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  for (const auto& p : parts) {
    EXPECT_NE(s.message().find(p), std::string::npos) << "'" << p << "' not in: " << s.ToString();
  }
}

TEST(CrossEntropyErrorsTest, NamesArgumentTokenAndRule) {
  Logits l(LogitsDtype::kFloat32, 4, 10);
  std::vector<int64_t> labels = {1, 2, 10, 3};
  std::vector<uint8_t> mask = {1, 1, 1, 1};
  CrossEntropyOptions o;
  for (bool reference : {false, true}) {
    mask = {1, 1, 1, 1};
    auto run = [&](const LogitsView& v, const TokenTargets& t, const CrossEntropyOptions& opt,
                   std::span<std::byte> g = {}) {
      return reference ? CrossEntropyReference(v, t, opt, g).status()
                       : CrossEntropy(v, t, opt, g).status();
    };
    // Label out of [0, V) where mask = 1.
    ExpectError(run(l.View(), {{}, labels, mask, {}}, o), {"labels[2] = 10", "[0, V = 10)"});
    // The same label under mask 0 is ignored.
    mask[2] = 0;
    EXPECT_TRUE(run(l.View(), {{}, labels, mask, {}}, o).ok());
    labels[1] = -5;
    ExpectError(run(l.View(), {{}, labels, mask, {}}, o), {"labels[1] = -5", "-100"});
    labels[1] = 2;
    // Shapes.
    LogitsView short_view = l.View();
    short_view.data = short_view.data.subspan(4);
    ExpectError(run(short_view, {{}, labels, mask, {}}, o), {"logits.data", "T x V = 4 x 10"});
    std::vector<int64_t> three = {1, 2, 3};
    ExpectError(run(l.View(), {{}, three, mask, {}}, o), {"labels has 3", "T = 4"});
    std::vector<uint8_t> mask5 = {1, 1, 1, 1, 1};
    ExpectError(run(l.View(), {{}, labels, mask5, {}}, o), {"loss_mask has 5", "T = 4"});
    std::vector<uint8_t> mask_bad = {1, 2, 1, 1};
    ExpectError(run(l.View(), {{}, labels, mask_bad, {}}, o), {"loss_mask[1] = 2", "0 or 1"});
    std::vector<float> maskf_bad = {1, 0.5f, 1, 1};
    ExpectError(run(l.View(), {{}, labels, {}, maskf_bad}, o), {"loss_mask[1]", "0 or 1"});
    // Normalizer.
    CrossEntropyOptions g = o;
    g.with_grad = true;
    auto grad = GradBuffer(l);
    g.normalizer = -1;
    ExpectError(run(l.View(), {{}, labels, mask, {}}, g, grad), {"normalizer N = -1", ">= 0"});
    g.normalizer = 2;  // three tokens count here
    ExpectError(run(l.View(), {{}, labels, mask, {}}, g, grad), {"normalizer N = 2", "GLOBAL"});
    g.normalizer = 3;
    EXPECT_TRUE(run(l.View(), {{}, labels, mask, {}}, g, grad).ok());
    ExpectError(run(l.View(), {{}, labels, mask, {}}, g, std::span(grad).subspan(1)),
                {"grad has", "bytes"});
    // Unsupported dtype.
    LogitsView bad = l.View();
    bad.dtype = static_cast<LogitsDtype>(7);
    ExpectError(run(bad, {{}, labels, mask, {}}, o), {"logits.dtype", "dtype 7", "unsupported"});
    // Non-finite logits in a counted row.
    Logits nan_logits(LogitsDtype::kFloat32, 4, 10);
    nan_logits.Set(13, std::nan(""));
    ExpectError(run(nan_logits.View(), {{}, labels, mask, {}}, o), {"row 1", "non-finite"});
  }
  auto parsed = ParseLogitsDtype("float16");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("float16"), std::string::npos);
  EXPECT_EQ(*ParseLogitsDtype("bf16"), LogitsDtype::kBFloat16);
  EXPECT_EQ(*ParseLogitsDtype("float32"), LogitsDtype::kFloat32);
  EXPECT_EQ(*ParseLogitsDtype("float64"), LogitsDtype::kFloat64);
  // Vocab-parallel shard outside the vocabulary.
  CrossEntropyOptions vp;
  vp.vocab_start = 95;
  vp.vocab_total = 100;
  ExpectError(VocabParallelPartials(l.View(), {{}, labels, mask, {}}, vp).status(),
              {"vocab_start", "vocab_total = 100"});
  // CrossEntropy refuses a shard's offset.
  vp.vocab_start = 10;
  vp.vocab_total = 20;
  ExpectError(CrossEntropy(l.View(), {{}, labels, mask, {}}, vp).status(),
              {"vocab_start = 10", "VocabParallelPartials"});
}

TEST(CrossEntropyTest, NormalizerZeroWithNothingCountedGivesZeroGradient) {
  Logits l(LogitsDtype::kBFloat16, 3, 5);
  for (int i = 0; i < 15; ++i) l.Set(i, i * 0.1);
  const std::vector<int32_t> labels = {-100, -100, 4};
  const std::vector<uint8_t> mask = {1, 0, 0};
  CrossEntropyOptions o;
  o.with_grad = true;
  o.normalizer = 0;
  auto g = GradBuffer(l);
  auto r = CrossEntropy(l.View(), {labels, {}, mask, {}}, o, g);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->n_valid, 0);
  EXPECT_EQ(r->loss_sum, 0.0);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(Get(l.dtype, g, i), 0.0);
}

TEST(CrossEntropyTest, GradientFactor) {
  EXPECT_EQ(*GradientFactor(false, 8, 4), 1.0);
  EXPECT_EQ(*GradientFactor(true, 8, 4), 32.0);
  EXPECT_FALSE(GradientFactor(true, 0, 4).ok());
  EXPECT_FALSE(GradientFactor(true, 2, 0).ok());
}

}  // namespace
}  // namespace thdpack

namespace thdpack {
namespace {

// Where the CPU has AVX512-BF16 the bf16 gradient is rounded by vcvtneps2bf16; it must give the
// same bits as the portable integer rounding (no value here is below 2^-126), and the same
// forward figures.
TEST(CrossEntropyTest, NativeBf16StoreMatchesPortable) {
  if (!loss_internal::NativeBf16Store()) {
    GTEST_SKIP() << "this CPU has no AVX512-BF16: only the portable bf16 store runs here";
  }
  std::mt19937_64 rng(77);
  for (const int64_t V : {int64_t{5000}, int64_t{2048 * 3 + 7}, int64_t{31}}) {
    Case c = RandomCase(rng, LogitsDtype::kBFloat16, 23, V);
    CrossEntropyOptions o;
    o.with_grad = true;
    o.normalizer = 23;
    o.num_threads = 2;
    std::vector<std::byte> native = GradBuffer(c.logits), portable = GradBuffer(c.logits);
    auto a = CrossEntropy(c.logits.View(), c.Targets(), o, native);
    loss_internal::ForcePortableBf16Store(true);
    auto b = CrossEntropy(c.logits.View(), c.Targets(), o, portable);
    loss_internal::ForcePortableBf16Store(false);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->loss_sum, b->loss_sum);
    EXPECT_EQ(a->entropy_sum, b->entropy_sum);
    EXPECT_EQ(native, portable) << "V = " << V;
  }
}

}  // namespace
}  // namespace thdpack
