// The CUDA cross-entropy's arithmetic on the CPU (thdpack/cuda_loss.h's *Host functions: the
// kernels' ce_row.h code, column split and merge order, thread by simulated thread) against
// the plain fp64 reference of thdpack/loss.h (CrossEntropyReference), on fresh random rows:
// every dtype, V below, at and above multiples of every block size, rows aligned for 16-byte
// vectors and not, masked and ignored tokens, N = 0, in place, and the vocab-parallel path with
// the columns split unevenly over TP ranks and merged; each for both kernel versions
// (CudaLossArgs::version), and ScaleGradient against the product rounded once. This is how a
// machine without a GPU checks the kernels; tests/cuda/cuda_loss_gpu_test.cc runs the kernels
// themselves where a GPU is.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/ce_row.h"
#include "thdpack/cuda_loss.h"
#include "thdpack/loss.h"

namespace thdpack {
namespace {

constexpr int64_t kIgnore = -100;

// IEEE half from float, round to nearest even (an independent definition: through double).
uint16_t ToHalf(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) {  // subnormal: multiples of 2^-24
    const double q = std::nearbyint(a * std::ldexp(1.0, 24));  // ties to even (default mode)
    return sign | static_cast<uint16_t>(q);
  }
  int e;
  const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  double man = std::nearbyint((m * 2 - 1) * 1024);
  if (man == 1024) {
    man = 0;
    ++e;
  }
  if (e - 1 + 15 >= 31) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((e - 1 + 15) << 10) | static_cast<int>(man));
}
float FromHalf(uint16_t h) {
  const int exp = (h >> 10) & 31, man = h & 1023;
  double v = exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25);
  if (exp == 31) v = man ? NAN : INFINITY;
  return static_cast<float>((h & 0x8000) ? -v : v);
}

// One test case's inputs: logits [T, ld] in `dtype` (as bytes), their float values, targets.
struct Case {
  CudaDtype dtype;
  int64_t T, V, ld;
  int offset;  // elements before row 0 (misaligns every row when odd)
  std::vector<std::byte> logits;  // (offset + T * ld) elements
  std::vector<float> values;      // [T, V] the logits as floats (exactly representable)
  std::vector<int64_t> labels;
  std::vector<float> mask;
};

int64_t ElemSize(CudaDtype d) { return d == CudaDtype::kFloat32 ? 4 : 2; }

float Quantize(CudaDtype d, float v) {
  if (d == CudaDtype::kBFloat16) return BFloat16::FromFloat(v).ToFloat();
  if (d == CudaDtype::kFloat16) return FromHalf(ToHalf(v));
  return v;
}

void Store(CudaDtype d, std::byte* p, float v) {
  if (d == CudaDtype::kFloat32) {
    std::memcpy(p, &v, 4);
  } else {
    const uint16_t bits = d == CudaDtype::kBFloat16 ? BFloat16::FromFloat(v).bits : ToHalf(v);
    std::memcpy(p, &bits, 2);
  }
}

float Load(CudaDtype d, const std::byte* p) {
  if (d == CudaDtype::kFloat32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return d == CudaDtype::kBFloat16 ? BFloat16{bits}.ToFloat() : FromHalf(bits);
}

Case MakeCase(std::mt19937_64& rng, CudaDtype dtype, int64_t T, int64_t V, int64_t ld, int offset,
              bool neg_inf = false) {
  Case c{dtype, T, V, ld, offset, {}, {}, {}, {}};
  const int64_t es = ElemSize(dtype);
  c.logits.assign(static_cast<size_t>((offset + T * ld) * es), std::byte{0x7f});
  c.values.resize(static_cast<size_t>(T * V));
  std::normal_distribution<float> z(0.0f, 3.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t v = 0; v < V; ++v) {
      float x = Quantize(dtype, z(rng));
      if (neg_inf && rng() % 7 == 0) x = -INFINITY;  // masked vocabulary entries
      c.values[static_cast<size_t>(t * V + v)] = x;
      Store(dtype, c.logits.data() + (offset + t * ld + v) * es, x);
    }
    const uint64_t kind = rng() % 10;
    int64_t y = static_cast<int64_t>(rng() % static_cast<uint64_t>(V));
    if (neg_inf) {  // a counted label must have a finite logit: pick one
      while (std::isinf(c.values[static_cast<size_t>(t * V + y)])) y = (y + 1) % V;
    }
    c.labels.push_back(kind == 0 ? kIgnore : y);
    c.mask.push_back(kind == 1 ? 0.0f : 1.0f);
  }
  return c;
}

// The plain reference on the float values (fp64, thdpack/loss.h), gradient in float32.
CrossEntropyResult Reference(const Case& c, int64_t N, double factor, std::vector<float>* grad) {
  LogitsView view{LogitsDtype::kFloat32,
                  std::as_bytes(std::span<const float>(c.values)), c.T, c.V};
  TokenTargets targets;
  targets.labels_i64 = c.labels;
  targets.mask_f32 = c.mask;
  CrossEntropyOptions o;
  o.with_grad = true;
  o.normalizer = N;
  o.grad_scale = factor;
  grad->assign(static_cast<size_t>(c.T * c.V), 0.0f);
  auto r = CrossEntropyReference(view, targets, o, std::as_writable_bytes(std::span<float>(*grad)));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : CrossEntropyResult{};
}

int64_t Counted(const Case& c) {
  int64_t n = 0;
  for (int64_t t = 0; t < c.T; ++t) n += c.labels[static_cast<size_t>(t)] != kIgnore && c.mask[static_cast<size_t>(t)] != 0;
  return n;
}

// Our gradient (in the dtype) against the reference's: within the dtype's rounding of the value
// plus the fp32 arithmetic's error relative to the scale.
void CompareGrad(const Case& c, const std::vector<std::byte>& grad, const std::vector<float>& ref,
                 float scale, const std::string& where) {
  const int64_t es = ElemSize(c.dtype);
  const double rel = c.dtype == CudaDtype::kFloat32 ? 1e-6
                     : c.dtype == CudaDtype::kBFloat16 ? std::ldexp(1.0, -8)
                                                       : std::ldexp(1.0, -11);
  const double abs = 2e-6 * std::fabs(scale) + (c.dtype == CudaDtype::kFloat16 ? 6e-8 : 0.0);
  int bad = 0;
  for (int64_t t = 0; t < c.T && bad < 5; ++t) {
    for (int64_t v = 0; v < c.V && bad < 5; ++v) {
      const double got = Load(c.dtype, grad.data() + (c.offset + t * c.ld + v) * es);
      const double want = ref[static_cast<size_t>(t * c.V + v)];
      if (std::fabs(got - want) > rel * std::fabs(want) + abs) {
        ADD_FAILURE() << where << ": grad[" << t << "][" << v << "] = " << got << ", reference "
                      << want;
        ++bad;
      }
    }
  }
}

CudaLossArgs ArgsOf(Case& c, std::vector<float>& logprob, std::vector<float>& entropy,
                    int version = 0) {
  CudaLossArgs a;
  a.version = version;
  a.dtype = c.dtype;
  a.logits = c.logits.data() + c.offset * ElemSize(c.dtype);
  a.num_tokens = c.T;
  a.vocab_size = c.V;
  a.ld = c.ld;
  a.labels = c.labels.data();
  a.loss_mask = c.mask.data();
  logprob.assign(static_cast<size_t>(c.T), -1.0f);
  entropy.assign(static_cast<size_t>(c.T), -1.0f);
  a.logprob = logprob.data();
  a.entropy = entropy.data();
  return a;
}

void CompareTokens(const CrossEntropyResult& ref, const std::vector<float>& logprob,
                   const std::vector<float>& entropy, const std::string& where) {
  for (size_t t = 0; t < logprob.size(); ++t) {
    const double lp = ref.logprobs[t], en = ref.entropy[t];
    EXPECT_NEAR(logprob[t], lp, 2e-6 * (1 + std::fabs(lp))) << where << " token " << t;
    EXPECT_NEAR(entropy[t], en, 2e-6 * (1 + std::fabs(en))) << where << " token " << t;
  }
}

const CudaDtype kDtypes[] = {CudaDtype::kFloat32, CudaDtype::kBFloat16, CudaDtype::kFloat16};
const int kVersions[] = {1, 2};

// The tests of the kernels' arithmetic run for each version (CudaLossArgs::version): the first,
// kept beside the latest, and the latest. One gtest parameter each, so ctest runs them side by
// side.
class CudaLossHostVersion : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Versions, CudaLossHostVersion, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "v" + std::to_string(info.param);
                         });
const char* Name(CudaDtype d) {
  return d == CudaDtype::kFloat32 ? "f32" : d == CudaDtype::kBFloat16 ? "bf16" : "f16";
}

TEST_P(CudaLossHostVersion, FusedEqualsTheReferenceOnRandomRows) {
  std::mt19937_64 rng(20261126);
  // V below, at and above multiples of the vector width and of every block size.
  const int64_t vs[] = {1, 3, 8, 31, 33, 255, 256, 257, 1000, 1031, 4099};
  const int version = GetParam();
  for (CudaDtype dtype : kDtypes) {
    for (int64_t V : vs) {
      for (int threads : {32, 256, 1024}) {
        for (int layout = 0; layout < 3; ++layout) {
          // 0: aligned rows (ld a multiple of 8 elements); 1: ld = V; 2: odd offset and ld.
          const int64_t ld = layout == 0 ? (V + 7) / 8 * 8 : layout == 1 ? V : V + 1;
          const int offset = layout == 2 ? 1 : 0;
          Case c = MakeCase(rng, dtype, 9, V, ld, offset, V > 8 && layout == 1);
          const int64_t n = Counted(c);
          const int64_t N = n + static_cast<int64_t>(rng() % 5);  // global N >= local count
          const double factor = 1 + static_cast<double>(rng() % 4);
          std::vector<float> ref_grad;
          const CrossEntropyResult ref = Reference(c, N, factor, &ref_grad);
          std::vector<float> logprob, entropy;
          CudaLossArgs a = ArgsOf(c, logprob, entropy, version);
          std::vector<std::byte> grad(c.logits.size(), std::byte{0x55});
          a.grad = grad.data() + c.offset * ElemSize(dtype);
          a.grad_scale = N > 0 ? static_cast<float>(factor / static_cast<double>(N)) : 0.0f;
          unsigned long long flag = 0;
          a.error = &flag;
          const std::string where = "v" + std::to_string(version) + " " + Name(dtype) + " V " +
                                    std::to_string(V) + " threads " + std::to_string(threads) +
                                    " layout " + std::to_string(layout);
          ASSERT_TRUE(CrossEntropyFusedHost(a, threads).ok()) << where;
          EXPECT_EQ(flag, 0u) << where;
          CompareTokens(ref, logprob, entropy, where);
          CompareGrad(c, grad, ref_grad, a.grad_scale, where);
        }
      }
    }
  }
}

// Logits masked with the dtype's lowest finite value (masked_fill(mask, finfo.min)), in runs
// and scattered, so that a thread's state holds several of them when a real logit arrives or
// when states merge: the rescaled terms underflow to 0 while s * d overflows, and the entropy
// must stay finite (it was NaN, unflagged, before the rescale skipped them).
TEST_P(CudaLossHostVersion, LowestFiniteMaskedLogitsKeepTheEntropyFinite) {
  std::mt19937_64 rng(41);
  const int version = GetParam();
  for (CudaDtype dtype : kDtypes) {
    const float lowest = dtype == CudaDtype::kFloat32    ? -FLT_MAX
                         : dtype == CudaDtype::kBFloat16 ? BFloat16{0xff7f}.ToFloat()
                                                         : -65504.0f;
    for (int64_t V : {4, 100, 1031}) {
      for (int threads : {32, 256}) {
        Case c = MakeCase(rng, dtype, 6, V, V, 0);
        const int64_t es = ElemSize(dtype);
        for (int64_t t = 0; t < c.T; ++t) {
          for (int64_t v = 0; v < V; ++v) {
            // Row 0: the first half masked; others: two columns in three.
            const bool masked = t == 0 ? v < V / 2 : v % 3 != 2;
            if (!masked || v == c.labels[static_cast<size_t>(t)]) continue;
            c.values[static_cast<size_t>(t * V + v)] = lowest;
            Store(dtype, c.logits.data() + (t * V + v) * es, lowest);
          }
        }
        const int64_t N = Counted(c) + 1;
        std::vector<float> ref_grad;
        const CrossEntropyResult ref = Reference(c, N, 1.0, &ref_grad);
        std::vector<float> logprob, entropy;
        CudaLossArgs a = ArgsOf(c, logprob, entropy, version);
        std::vector<std::byte> grad(c.logits.size());
        a.grad = grad.data();
        a.grad_scale = 1.0f / static_cast<float>(N);
        unsigned long long flag = 0;
        a.error = &flag;
        const std::string where = "v" + std::to_string(version) + " " + Name(dtype) + " V " +
                                  std::to_string(V) + " threads " + std::to_string(threads);
        ASSERT_TRUE(CrossEntropyFusedHost(a, threads).ok()) << where;
        EXPECT_EQ(flag, 0u) << where;
        for (float e : entropy) EXPECT_TRUE(std::isfinite(e)) << where;
        CompareTokens(ref, logprob, entropy, where);
        CompareGrad(c, grad, ref_grad, a.grad_scale, where);
      }
    }
  }
}

// The one-read kernel's arithmetic: each block of a cluster folds its share of the row, the
// shares' states merge in rank order, and each block writes its share's gradient. Against the
// reference for every cluster size (shares around the vector width and the block sizes, a last
// share shorter than the others or empty), aligned rows and not, separate and in place.
TEST_P(CudaLossHostVersion, OneReadEqualsTheReferenceForEveryClusterSize) {
  std::mt19937_64 rng(20261127);
  const int64_t vs[] = {1, 5, 9, 31, 64, 257, 1031, 4099};
  const int version = GetParam();
  for (CudaDtype dtype : kDtypes) {
    for (int64_t V : vs) {
      for (int cluster : {1, 2, 4, 8}) {
        for (int threads : {32, 256}) {
          for (int layout = 0; layout < 3; ++layout) {
            const int64_t ld = layout == 0 ? (V + 7) / 8 * 8 : layout == 1 ? V : V + 1;
            const int offset = layout == 2 ? 1 : 0;
            Case c = MakeCase(rng, dtype, 7, V, ld, offset, V > 8 && layout == 1);
            const int64_t N = Counted(c) + 2;
            std::vector<float> ref_grad;
            const CrossEntropyResult ref = Reference(c, N, 1.5, &ref_grad);
            const bool in_place = layout == 0 && cluster == 2;
            std::vector<float> logprob, entropy;
            CudaLossArgs a = ArgsOf(c, logprob, entropy, version);
            std::vector<std::byte> grad(c.logits.size(), std::byte{0x55});
            std::vector<std::byte> logits_copy = c.logits;  // in place: the original stays here
            a.grad = in_place ? const_cast<void*>(a.logits)
                              : static_cast<void*>(grad.data() + c.offset * ElemSize(dtype));
            a.grad_scale = static_cast<float>(1.5 / static_cast<double>(N));
            unsigned long long flag = 0;
            a.error = &flag;
            const std::string where = "v" + std::to_string(version) + " " + Name(dtype) +
                                      " V " + std::to_string(V) +
                                      " cluster " + std::to_string(cluster) + " threads " +
                                      std::to_string(threads) + " layout " +
                                      std::to_string(layout) + (in_place ? " in place" : "");
            ASSERT_TRUE(CrossEntropyOneReadHost(a, cluster, threads).ok()) << where;
            EXPECT_EQ(flag, 0u) << where;
            CompareTokens(ref, logprob, entropy, where);
            CompareGrad(c, in_place ? c.logits : grad, ref_grad, a.grad_scale, where);
            c.logits = logits_copy;
          }
        }
      }
    }
  }
}

TEST(CudaLossHost, OneReadPlanSplitsLargeRowsOverClusters) {
  // One block's share is at most 96 KB.
  CudaOneReadPlan p = CudaLossOneReadPlan(CudaDtype::kBFloat16, 32000);
  EXPECT_EQ(p.cluster, 1);
  EXPECT_EQ(p.slice, 32000);
  EXPECT_EQ(p.threads, 512);
  p = CudaLossOneReadPlan(CudaDtype::kBFloat16, 151936);  // 297 KB: four shares of 74 KB
  EXPECT_EQ(p.cluster, 4);
  EXPECT_EQ(p.slice, 37984);
  EXPECT_EQ(p.slice % 8, 0);
  p = CudaLossOneReadPlan(CudaDtype::kFloat32, 151936);  // 594 KB: eight of 74 KB
  EXPECT_EQ(p.cluster, 8);
  EXPECT_EQ(p.slice, 18992);
  p = CudaLossOneReadPlan(CudaDtype::kFloat16, 49153);  // just over one share
  EXPECT_EQ(p.cluster, 2);
  EXPECT_EQ(p.slice, 24584);
  p = CudaLossOneReadPlan(CudaDtype::kBFloat16, 400000);  // more than 8 shares: not planned
  EXPECT_EQ(p.cluster, 0);
  for (CudaDtype d : kDtypes) {
    for (int64_t V : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{151936}, int64_t{262144}}) {
      const CudaOneReadPlan q = CudaLossOneReadPlan(d, V);
      if (q.cluster == 0) continue;
      EXPECT_GE(q.slice * q.cluster, V);
      EXPECT_LT((q.cluster - 1) * q.slice, V) << "every block holds columns";
      EXPECT_LE(q.slice * ElemSize(d), kCudaOneReadSliceBytes);
    }
  }
  // Argument checks: the cluster size, and the whole vocabulary as the fused call.
  std::mt19937_64 rng(5);
  Case c = MakeCase(rng, CudaDtype::kFloat32, 2, 40, 40, 0);
  std::vector<float> lp, en;
  CudaLossArgs a = ArgsOf(c, lp, en);
  EXPECT_NE(CrossEntropyOneReadHost(a, 3, 256).message().find("1, 2, 4 or 8"), std::string::npos);
  a.vocab_total = 80;
  EXPECT_NE(CrossEntropyOneReadHost(a, 2, 256).message().find("whole vocabulary"),
            std::string::npos);
}

TEST_P(CudaLossHostVersion, InPlaceAndNoGradientAndZeroN) {
  std::mt19937_64 rng(7);
  const int version = GetParam();
  for (CudaDtype dtype : kDtypes) {
    Case c = MakeCase(rng, dtype, 12, 777, 784, 0);
    std::vector<float> ref_grad;
    const int64_t N = Counted(c) + 3;
    const CrossEntropyResult ref = Reference(c, N, 2.0, &ref_grad);
    std::vector<float> logprob, entropy;
    CudaLossArgs a = ArgsOf(c, logprob, entropy, version);
    // Without a gradient: the same per-token values.
    ASSERT_TRUE(CrossEntropyFusedHost(a, 256).ok());
    CompareTokens(ref, logprob, entropy, std::string(Name(dtype)) + " no grad");
    // In place: the logits become their gradient.
    a.grad = const_cast<void*>(a.logits);
    a.grad_scale = static_cast<float>(2.0 / static_cast<double>(N));
    ASSERT_TRUE(CrossEntropyFusedHost(a, 256).ok());
    CompareTokens(ref, logprob, entropy, std::string(Name(dtype)) + " in place");
    CompareGrad(c, c.logits, ref_grad, a.grad_scale, std::string(Name(dtype)) + " in place");
  }
  // N = 0 (nothing counted anywhere): zero gradients, zero values.
  Case c = MakeCase(rng, CudaDtype::kBFloat16, 5, 100, 104, 0);
  for (auto& m : c.mask) m = 0.0f;
  std::vector<float> logprob, entropy;
  CudaLossArgs a = ArgsOf(c, logprob, entropy, version);
  std::vector<std::byte> grad(c.logits.size(), std::byte{0x55});
  a.grad = grad.data();
  a.grad_scale = 0.0f;
  ASSERT_TRUE(CrossEntropyFusedHost(a, 256).ok());
  for (int64_t t = 0; t < c.T; ++t) {
    EXPECT_EQ(logprob[static_cast<size_t>(t)], 0.0f);
    for (int64_t v = 0; v < c.V; ++v) EXPECT_EQ(Load(c.dtype, grad.data() + (t * c.ld + v) * 2), 0.0f);
  }
}

// Vocab-parallel: each TP rank's columns (split unevenly) through Partials, the partials merged
// on the CPU (CombinePartialsHost), then Finish per rank: every rank's per-token values and
// the gradients of its columns equal the reference on the whole row.
TEST_P(CudaLossHostVersion, VocabParallelSplitUnevenlyEqualsTheWholeRow) {
  std::mt19937_64 rng(99);
  const int version = GetParam();
  for (CudaDtype dtype : kDtypes) {
    for (int tp : {2, 3, 5}) {
      const int64_t V = 1000 + static_cast<int64_t>(rng() % 500);
      Case whole = MakeCase(rng, dtype, 11, V, V, 0, true);
      const int64_t N = Counted(whole) + 1;
      std::vector<float> ref_grad;
      const CrossEntropyResult ref = Reference(whole, N, 1.0, &ref_grad);
      // Uneven cut points.
      std::vector<int64_t> cuts = {0};
      for (int k = 1; k < tp; ++k) cuts.push_back(cuts.back() + 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(V / tp)));
      cuts.push_back(V);
      const int64_t T = whole.T, es = ElemSize(dtype);
      std::vector<Case> parts;
      std::vector<RowStats> gathered(static_cast<size_t>(tp * T));
      for (int k = 0; k < tp; ++k) {
        Case p = whole;
        p.V = cuts[static_cast<size_t>(k) + 1] - cuts[static_cast<size_t>(k)];
        p.ld = p.V;
        p.logits.assign(static_cast<size_t>(T * p.V * es), std::byte{0});
        p.values.assign(static_cast<size_t>(T * p.V), 0.0f);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t v = 0; v < p.V; ++v) {
            const float x = whole.values[static_cast<size_t>(t * V + cuts[static_cast<size_t>(k)] + v)];
            p.values[static_cast<size_t>(t * p.V + v)] = x;
            Store(dtype, p.logits.data() + (t * p.V + v) * es, x);
          }
        }
        std::vector<float> lp, en;
        CudaLossArgs a = ArgsOf(p, lp, en, version);
        a.vocab_start = cuts[static_cast<size_t>(k)];
        a.vocab_total = V;
        a.stats = gathered.data() + k * T;
        ASSERT_TRUE(CrossEntropyPartialsHost(a, 256).ok());
        parts.push_back(std::move(p));
      }
      std::vector<RowStats> merged(static_cast<size_t>(T));
      ASSERT_TRUE(CombinePartialsHost(gathered.data(), tp, T, merged.data()).ok());
      for (int k = 0; k < tp; ++k) {
        Case& p = parts[static_cast<size_t>(k)];
        std::vector<float> lp, en;
        CudaLossArgs a = ArgsOf(p, lp, en, version);
        a.vocab_start = cuts[static_cast<size_t>(k)];
        a.vocab_total = V;
        a.stats = merged.data();
        std::vector<std::byte> grad(p.logits.size());
        a.grad = grad.data();
        a.grad_scale = static_cast<float>(1.0 / static_cast<double>(N));
        unsigned long long flag = 0;
        a.error = &flag;
        ASSERT_TRUE(CrossEntropyFinishHost(a, 256).ok());
        EXPECT_EQ(flag, 0u);
        const std::string where = "v" + std::to_string(version) + " " + Name(dtype) + " tp " +
                                  std::to_string(tp) + " rank " + std::to_string(k);
        CompareTokens(ref, lp, en, where);
        std::vector<float> ref_cols(static_cast<size_t>(T * p.V));
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t v = 0; v < p.V; ++v) {
            ref_cols[static_cast<size_t>(t * p.V + v)] =
                ref_grad[static_cast<size_t>(t * V + cuts[static_cast<size_t>(k)] + v)];
          }
        }
        CompareGrad(p, grad, ref_cols, a.grad_scale, where);
      }
    }
  }
}

TEST(CudaLossHost, BadInputsSetTheFlagAndDecodeToTheCpuWords) {
  std::mt19937_64 rng(3);
  Case c = MakeCase(rng, CudaDtype::kFloat32, 4, 50, 50, 0);
  for (auto& y : c.labels) y = 1;
  for (auto& m : c.mask) m = 1;
  std::vector<float> lp, en;
  auto run = [&](auto mutate) {
    Case d = c;
    mutate(d);
    CudaLossArgs a = ArgsOf(d, lp, en);
    unsigned long long flag = 0;
    a.error = &flag;
    EXPECT_TRUE(CrossEntropyFusedHost(a, 256).ok());
    return DecodeCudaLossError(flag, 50);
  };
  Status s = run([](Case& d) { d.labels[2] = 50; });
  EXPECT_NE(s.message().find("labels[2]: a counted label outside [0, V = 50)"), std::string::npos)
      << s.ToString();
  s = run([](Case& d) { d.mask[1] = 0.5f; });
  EXPECT_NE(s.message().find("loss_mask[1]"), std::string::npos) << s.ToString();
  s = run([](Case& d) {
    const float nan = NAN;
    std::memcpy(d.logits.data() + (3 * 50 + 7) * 4, &nan, 4);
  });
  EXPECT_NE(s.message().find("logits row 3"), std::string::npos) << s.ToString();
  // A NaN followed by other logits of the same simulated thread (1,000 columns over 32 threads,
  // the NaN first, in the middle, last, and in a vector's middle): it must stay poisoned, in
  // both versions (the first version's state forgot it at the next logit).
  for (int version : kVersions) {
    for (int64_t col : {int64_t{0}, int64_t{3}, int64_t{500}, int64_t{999}}) {
      Case d = MakeCase(rng, CudaDtype::kFloat32, 3, 1000, 1000, 0);
      for (auto& y : d.labels) y = 1;
      for (auto& m : d.mask) m = 1;
      const float nan = NAN;
      std::memcpy(d.logits.data() + (1 * 1000 + col) * 4, &nan, 4);
      std::vector<float> lp2, en2;
      for (int kernel = 0; kernel < 2; ++kernel) {
        CudaLossArgs a = ArgsOf(d, lp2, en2, version);
        unsigned long long flag = 0;
        a.error = &flag;
        EXPECT_TRUE(kernel == 0 ? CrossEntropyFusedHost(a, 32).ok()
                                : CrossEntropyOneReadHost(a, 2, 32).ok());
        const Status st = DecodeCudaLossError(flag, 1000);
        EXPECT_NE(st.message().find("logits row 1"), std::string::npos)
            << "v" << version << " NaN at column " << col << (kernel ? " one read" : " fused")
            << ": " << st.ToString();
      }
    }
  }
  s = run([](Case& d) {
    const float inf = -INFINITY;
    for (int v = 0; v < 50; ++v) std::memcpy(d.logits.data() + (0 * 50 + v) * 4, &inf, 4);
  });
  EXPECT_NE(s.message().find("logits row 0"), std::string::npos) << s.ToString();
  EXPECT_TRUE(run([](Case& d) { d.labels[0] = -100; }).ok());  // ignored: never looked at
  // Host-side argument checks name the field.
  CudaLossArgs a = ArgsOf(c, lp, en);
  a.ld = 10;
  EXPECT_NE(CrossEntropyFusedHost(a, 256).message().find("ld = 10"), std::string::npos);
  a = ArgsOf(c, lp, en);
  EXPECT_NE(CrossEntropyFusedHost(a, 48).message().find("power of two"), std::string::npos);
  a.vocab_start = 10;
  EXPECT_NE(CrossEntropyPartialsHost(a, 256).message().find("outside the vocabulary"),
            std::string::npos);
  // The fused call takes the whole vocabulary: a shard's label could name a column it lacks.
  a = ArgsOf(c, lp, en);
  a.vocab_start = 50;
  a.vocab_total = 100;
  EXPECT_NE(CrossEntropyFusedHost(a, 256).message().find("takes the whole vocabulary"),
            std::string::npos);
  a.vocab_start = 0;
  EXPECT_NE(CrossEntropyFusedHost(a, 256).message().find("takes the whole vocabulary"),
            std::string::npos);
  a.vocab_total = 50;
  EXPECT_TRUE(CrossEntropyFusedHost(a, 256).ok());
  a.version = 3;
  EXPECT_NE(CrossEntropyFusedHost(a, 256).message().find("version = 3"), std::string::npos);
  a.version = -1;
  EXPECT_NE(CrossEntropyOneReadHost(a, 1, 256).message().find("version = -1"),
            std::string::npos);
}

// The dtype conversions the kernels round with (ce_row.h) against independent definitions:
// every half value in and out, and random floats of every magnitude (normal, subnormal, past
// the largest half, halfway cases) for half and bfloat16.
TEST(CudaLossHost, HalfAndBfloat16RoundingMatchIndependentDefinitions) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    const float f = FromHalf(b);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(kernels::HalfToFloat(b)));
      continue;
    }
    ASSERT_EQ(kernels::HalfToFloat(b), f) << "half " << h;
    ASSERT_EQ(kernels::FloatToHalf(f), b) << "half " << h;
    ASSERT_EQ(ToHalf(f), b) << "half " << h;
  }
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200000; ++trial) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (trial % 3 == 0) u = (u & 0x80000000u) | ((0x33000000u + (u & 0x0fffffffu)) & 0x7fffffffu);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(kernels::FloatToHalf(f), ToHalf(f)) << "float bits " << u;
    ASSERT_EQ(kernels::FloatToBf16(f), BFloat16::FromFloat(f).bits) << "float bits " << u;
    ASSERT_EQ(kernels::Bf16ToFloat(BFloat16::FromFloat(f).bits), BFloat16::FromFloat(f).ToFloat());
  }
}


// Version 2's batched visits (ForEachColumnBatched) are ForEachColumn's, in the same order,
// for every batch size, thread count, vector width and alignment; and TargetLane finds the
// target's lane exactly where the per-column compare of version 1 does.
TEST(CudaLossHost, BatchedVisitsAreTheUnbatchedOnesInTheSameOrder) {
  for (int64_t V : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099}) {
    for (int n : {1, 3, 32, 256}) {
      for (int vec : {4, 8}) {
        for (bool vectors : {false, true}) {
          std::vector<int64_t> covered(static_cast<size_t>(V), 0);
          for (int j = 0; j < n; ++j) {
            std::vector<int64_t> want, got2, got3, got4;
            auto columns = [&](std::vector<int64_t>& out) {
              return [&out, vec](int64_t k) {
                for (int e = 0; e < vec; ++e) out.push_back(k * vec + e);
              };
            };
            kernels::ForEachColumn(j, n, V, vec, vectors, columns(want),
                                   [&](int64_t v) { want.push_back(v); });
            auto batched = [&](auto batch_tag, std::vector<int64_t>& out) {
              constexpr int kB = decltype(batch_tag)::value;
              kernels::ForEachColumnBatched<kB>(
                  j, n, V, vec, vectors,
                  [&](int64_t k, int stride) {
                    for (int u = 0; u < kB; ++u) {
                      columns(out)(k + static_cast<int64_t>(u) * stride);
                    }
                  },
                  columns(out), [&](int64_t v) { out.push_back(v); });
            };
            batched(std::integral_constant<int, 2>{}, got2);
            batched(std::integral_constant<int, 3>{}, got3);
            batched(std::integral_constant<int, 4>{}, got4);
            ASSERT_EQ(got2, want) << "V " << V << " n " << n << " vec " << vec << " j " << j;
            ASSERT_EQ(got3, want) << "V " << V << " n " << n << " vec " << vec << " j " << j;
            ASSERT_EQ(got4, want) << "V " << V << " n " << n << " vec " << vec << " j " << j;
            for (int64_t v : want) ++covered[static_cast<size_t>(v)];
          }
          for (int64_t v = 0; v < V; ++v) ASSERT_EQ(covered[static_cast<size_t>(v)], 1) << v;
        }
      }
    }
  }
  for (int vec : {4, 8}) {
    for (int64_t k = 0; k < 40; ++k) {
      for (int64_t y = -1; y < 45 * vec; ++y) {
        int want = -1;
        for (int e = 0; e < vec; ++e) {
          if (k * vec + e == y) want = e;
        }
        ASSERT_EQ(kernels::TargetLane(k, vec, y), want) << "k " << k << " y " << y;
      }
    }
  }
}

// AddLogits (one rescale per vector, version 2) against AddLogit one logit at a time (version
// 1) on the vectors where they could part: the max first, last or repeated; -inf, the lowest
// finite value, NaN and +inf among finite logits; a vector of nothing but -inf (the state stays
// empty) or NaN. Both must give the same log-sum-exp and entropy to fp32 rounding, and agree on
// which states are empty and which are not finite (a NaN or +inf logit makes the row an
// error either way).
TEST(CudaLossHost, OneRescalePerVectorEqualsOnePerLogit) {
  const float inf = INFINITY, lowest = -FLT_MAX, nan = NAN;
  std::mt19937_64 rng(17);
  std::normal_distribution<float> z(0.0f, 4.0f);
  std::vector<std::vector<float>> vectors = {
      {9, 1, 2, 3, 4, 5, 6, 7},         {1, 2, 3, 4, 5, 6, 7, 9},
      {5, 5, 5, 5, 5, 5, 5, 5},         {-inf, 3, -inf, 1, -inf, -inf, 2, -inf},
      {lowest, 3, lowest, 1, lowest, 0, 2, 7}, {-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf},
      {lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest},
      {1, nan, 3, 4, 5, 6, 7, 8},       {-inf, nan, -inf, -inf, -inf, -inf, -inf, -inf},
      {1, 2, inf, 4, 5, 6, 7, 8},       {-inf, -inf, -inf, -inf, -inf, -inf, -inf, inf},
      {80, -80, 0, 1, 2, 3, 4, 5},      {-100, -120, -90, -101, -95, -99, -93, -97},
  };
  for (int i = 0; i < 40; ++i) {
    std::vector<float> v(8);
    for (float& x : v) x = z(rng);
    vectors.push_back(v);
  }
  auto check = [&](kernels::RowState before, const std::vector<float>& vec,
                   const std::string& where) {
    kernels::RowState one = before, batch = before;
    float zs[8];
    for (int e = 0; e < 8; ++e) {
      kernels::AddLogit(one, vec[static_cast<size_t>(e)]);
      zs[e] = vec[static_cast<size_t>(e)];
    }
    kernels::AddLogits<8>(batch, zs);
    ASSERT_EQ(one.s == 0.0f, batch.s == 0.0f) << where;  // empty alike
    ASSERT_EQ(kernels::RowFinite(one), kernels::RowFinite(batch)) << where;
    if (!kernels::RowFinite(one)) return;
    const float lse = kernels::RowLse(one), entropy = kernels::RowEntropy(one);
    EXPECT_NEAR(kernels::RowLse(batch), lse, 2e-6 * (1 + std::fabs(lse))) << where;
    EXPECT_NEAR(kernels::RowEntropy(batch), entropy, 2e-5 * (1 + std::fabs(entropy))) << where;
    EXPECT_TRUE(std::isfinite(kernels::RowEntropy(batch))) << where;
  };
  for (size_t i = 0; i < vectors.size(); ++i) {
    // From the empty state, and from states that already hold logits below, around and above.
    check(kernels::EmptyState(), vectors[i], "vector " + std::to_string(i) + " empty");
    for (float held : {-50.0f, 0.0f, 3.0f, 60.0f, lowest}) {
      kernels::RowState st = kernels::EmptyState();
      kernels::AddLogit(st, held);
      kernels::AddLogit(st, held - 1.0f);
      check(st, vectors[i], "vector " + std::to_string(i) + " after " + std::to_string(held));
    }
  }
}

// ScaleGradient's arithmetic (the CPU execution with its kernel's column split): every element
// becomes the fp32 product rounded once to the dtype (an independent rounding: BFloat16 of
// thdpack/loss.h, ToHalf above), rows aligned and not, the row padding past V untouched; a
// factor of 1 leaves every byte as it was, and the arguments are checked.
TEST(CudaLossHost, ScaleGradientIsTheProductRoundedOnce) {
  std::mt19937_64 rng(23);
  for (CudaDtype dtype : kDtypes) {
    for (float factor : {1.0f, 0.37f, -2.0f, 0.0f, 1.0f / 3.0f, 1e-30f}) {
      for (int layout = 0; layout < 2; ++layout) {
        const int64_t V = 1031, ld = layout == 0 ? 1032 : 1033;
        const int offset = layout;
        Case c = MakeCase(rng, dtype, 5, V, ld, offset);
        // Gradient-sized values.
        const int64_t es = ElemSize(dtype);
        for (int64_t t = 0; t < c.T; ++t) {
          for (int64_t v = 0; v < V; ++v) {
            const float g = Quantize(dtype, c.values[static_cast<size_t>(t * V + v)] * 1e-4f);
            c.values[static_cast<size_t>(t * V + v)] = g;
            Store(dtype, c.logits.data() + (offset + t * ld + v) * es, g);
          }
        }
        std::vector<std::byte> before = c.logits;
        std::byte* grad = c.logits.data() + offset * es;
        const std::string where = std::string(Name(dtype)) + " factor " +
                                  std::to_string(factor) + " layout " + std::to_string(layout);
        ASSERT_TRUE(ScaleGradientHost(dtype, grad, c.T, V, ld, &factor, 256).ok()) << where;
        if (factor == 1.0f) {
          EXPECT_EQ(c.logits, before) << where;
          continue;
        }
        for (int64_t t = 0; t < c.T; ++t) {
          for (int64_t v = 0; v < V; ++v) {
            const float want = Quantize(dtype, c.values[static_cast<size_t>(t * V + v)] * factor);
            const float got = Load(dtype, c.logits.data() + (offset + t * ld + v) * es);
            ASSERT_EQ(got, want) << where << " [" << t << "][" << v << "]";
          }
          // The padding past V is never written.
          for (int64_t v = V; v < ld; ++v) {
            for (int64_t b = 0; b < es; ++b) {
              const size_t at = static_cast<size_t>((offset + t * ld + v) * es + b);
              ASSERT_EQ(c.logits[at], before[at]) << where;
            }
          }
        }
      }
    }
  }
  float one = 1.0f;
  std::vector<float> g(10, 1.0f);
  const auto f32 = CudaDtype::kFloat32;
  EXPECT_NE(ScaleGradientHost(f32, g.data(), 2, 5, 4, &one, 256).message().find("ld = 4"),
            std::string::npos);
  EXPECT_NE(ScaleGradientHost(f32, g.data(), 2, 5, 5, nullptr, 256).message().find("factor"),
            std::string::npos);
  EXPECT_NE(ScaleGradientHost(static_cast<CudaDtype>(7), g.data(), 2, 5, 5, &one, 256)
                .message()
                .find("dtype 7"),
            std::string::npos);
  EXPECT_TRUE(ScaleGradientHost(CudaDtype::kFloat32, nullptr, 0, 5, 5, nullptr, 256).ok());
}

}  // namespace
}  // namespace thdpack
