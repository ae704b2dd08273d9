// The CUDA cross-entropy kernels on a GPU (ctest label `cuda`; skipped where no device is):
// each kernel's outputs against the CPU execution of the same arithmetic (the *Host functions,
// which tests/cuda_loss_host_test.cc checks against the fp64 reference) on the same random
// rows: every dtype, V around the block sizes and at the vocabularies, rows aligned and
// not, in place, the vocab-parallel path, and a bad label reported through the flag. The two
// differ only by exp/log (__expf/__logf against libm) and the order the compiler fuses
// multiply-adds in, so the tolerance is a few fp32 ulps (values) and one ulp of the dtype
// (gradients). Every kernel runs in both versions (CudaLossArgs::version); ScaleGradient must
// equal its CPU execution bit for bit; and a failed launch must not leave an error behind for
// the next call.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/ce_launch.h"
#include "thdpack/cuda_loss.h"
#include "thdpack/loss.h"

namespace thdpack {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device"

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)), cudaSuccess); }
  Dev(const Dev&) = delete;
  ~Dev() { cudaFree(p); }
  void Put(const std::vector<T>& h) { ASSERT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess); }
  std::vector<T> Get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

float ElemToFloat(CudaDtype d, uint16_t bits, float f32) {
  if (d == CudaDtype::kFloat32) return f32;
  if (d == CudaDtype::kBFloat16) return BFloat16{bits}.ToFloat();
  // half
  const int e = (bits >> 10) & 31, m = bits & 1023;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24) : std::ldexp(static_cast<float>(1024 + m), e - 25);
  return (bits & 0x8000) ? -v : v;
}

struct Rows {
  CudaDtype dtype;
  int64_t T, V, ld;
  std::vector<uint8_t> bytes;  // T * ld elements
  std::vector<int64_t> labels;
  std::vector<float> mask;
  int64_t es() const { return dtype == CudaDtype::kFloat32 ? 4 : 2; }
  float At(const std::vector<uint8_t>& b, int64_t t, int64_t v) const {
    const uint8_t* p = b.data() + (t * ld + v) * es();
    float f = 0;
    uint16_t h = 0;
    if (es() == 4) std::memcpy(&f, p, 4); else std::memcpy(&h, p, 2);
    return ElemToFloat(dtype, h, f);
  }
};

Rows Make(std::mt19937_64& rng, CudaDtype dtype, int64_t T, int64_t V, int64_t ld) {
  Rows r{dtype, T, V, ld, {}, {}, {}};
  r.bytes.resize(static_cast<size_t>(T * ld * r.es()));
  std::normal_distribution<float> z(0, 3);
  for (int64_t i = 0; i < T * ld; ++i) {
    const float x = z(rng);
    if (dtype == CudaDtype::kFloat32) {
      std::memcpy(r.bytes.data() + i * 4, &x, 4);
    } else {
      // bf16 bits (also valid, if odd, as half bits: keep magnitudes sane by halving the exponent)
      uint16_t b = BFloat16::FromFloat(x).bits;
      if (dtype == CudaDtype::kFloat16) b = static_cast<uint16_t>((b & 0x8000) | (0x3c00 + (static_cast<int>(rng() % 2048) - 1024)));
      std::memcpy(r.bytes.data() + i * 2, &b, 2);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    r.labels.push_back(t % 7 == 3 ? -100 : static_cast<int64_t>(rng() % static_cast<uint64_t>(V)));
    r.mask.push_back(t % 5 == 4 ? 0.0f : 1.0f);
  }
  return r;
}

struct Outputs {
  std::vector<float> logprob, entropy;
  std::vector<uint8_t> grad;
  unsigned long long flag = 0;
};

// Runs the fused kernel (the one-read kernel with one_read; partials/combine/finish over
// `cuts` when given) on the GPU.
Outputs OnGpu(const Rows& r, float scale, bool in_place, const std::vector<int64_t>& cuts = {},
              bool one_read = false, int version = 0) {
  Outputs o;
  Dev<uint8_t> x(r.bytes.size()), g(r.bytes.size());
  Dev<int64_t> y(r.labels.size());
  Dev<float> m(r.mask.size()), lp(static_cast<size_t>(r.T)), en(static_cast<size_t>(r.T));
  Dev<unsigned long long> flag(1);
  x.Put(r.bytes);
  y.Put(r.labels);
  m.Put(r.mask);
  flag.Put({0});
  CudaLossArgs a;
  a.dtype = r.dtype;
  a.logits = x.p;
  a.num_tokens = r.T;
  a.vocab_size = r.V;
  a.ld = r.ld;
  a.labels = y.p;
  a.loss_mask = m.p;
  a.grad_scale = scale;
  a.grad = in_place ? static_cast<void*>(x.p) : static_cast<void*>(g.p);
  a.logprob = lp.p;
  a.entropy = en.p;
  a.error = flag.p;
  a.version = version;
  if (one_read) {
    const Status st = CrossEntropyOneRead(a, nullptr);
    EXPECT_TRUE(st.ok()) << st.ToString();
  } else if (cuts.empty()) {
    EXPECT_TRUE(CrossEntropyFused(a, nullptr).ok());
  } else {
    // Each rank's columns as its own [T, V_k] array at ld = V_k... here simply views of the
    // same rows (ld stays the full row), which is what a column slice of a tensor is.
    const int tp = static_cast<int>(cuts.size()) - 1;
    Dev<RowStats> gathered(static_cast<size_t>(tp * r.T)), merged(static_cast<size_t>(r.T));
    for (int k = 0; k < tp; ++k) {
      CudaLossArgs p = a;
      p.logits = x.p + cuts[static_cast<size_t>(k)] * r.es();
      p.vocab_size = cuts[static_cast<size_t>(k) + 1] - cuts[static_cast<size_t>(k)];
      p.vocab_start = cuts[static_cast<size_t>(k)];
      p.vocab_total = r.V;
      p.stats = gathered.p + k * r.T;
      EXPECT_TRUE(CrossEntropyPartials(p, nullptr).ok());
    }
    EXPECT_TRUE(CombinePartials(gathered.p, tp, r.T, merged.p, nullptr).ok());
    for (int k = 0; k < tp; ++k) {
      CudaLossArgs p = a;
      p.logits = x.p + cuts[static_cast<size_t>(k)] * r.es();
      p.grad = g.p + cuts[static_cast<size_t>(k)] * r.es();
      p.vocab_size = cuts[static_cast<size_t>(k) + 1] - cuts[static_cast<size_t>(k)];
      p.vocab_start = cuts[static_cast<size_t>(k)];
      p.vocab_total = r.V;
      p.stats = merged.p;
      EXPECT_TRUE(CrossEntropyFinish(p, nullptr).ok());
    }
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o.logprob = lp.Get();
  o.entropy = en.Get();
  o.grad = in_place ? x.Get() : g.Get();
  o.flag = flag.Get()[0];
  return o;
}

// The CPU execution of the fused kernel, or of the one-read kernel with its GPU plan.
Outputs OnHost(const Rows& r, float scale, bool one_read = false, int version = 0) {
  Outputs o;
  std::vector<uint8_t> x = r.bytes;
  o.grad.assign(r.bytes.size(), 0);
  o.logprob.assign(static_cast<size_t>(r.T), 0);
  o.entropy.assign(static_cast<size_t>(r.T), 0);
  CudaLossArgs a;
  a.dtype = r.dtype;
  a.logits = x.data();
  a.num_tokens = r.T;
  a.vocab_size = r.V;
  a.ld = r.ld;
  a.labels = r.labels.data();
  a.loss_mask = r.mask.data();
  a.grad_scale = scale;
  a.grad = o.grad.data();
  a.logprob = o.logprob.data();
  a.entropy = o.entropy.data();
  a.error = &o.flag;
  a.version = version;
  if (one_read) {
    const CudaOneReadPlan plan = CudaLossOneReadPlan(r.dtype, r.V);
    EXPECT_TRUE(CrossEntropyOneReadHost(a, plan.cluster, plan.threads).ok());
  } else {
    EXPECT_TRUE(CrossEntropyFusedHost(a, CudaLossBlockThreads(r.V)).ok());
  }
  return o;
}

void Compare(const Rows& r, const Outputs& gpu, const Outputs& host, float scale,
             const std::string& where) {
  EXPECT_EQ(gpu.flag, host.flag) << where;
  for (int64_t t = 0; t < r.T; ++t) {
    EXPECT_NEAR(gpu.logprob[static_cast<size_t>(t)], host.logprob[static_cast<size_t>(t)],
                1e-5f * (1 + std::fabs(host.logprob[static_cast<size_t>(t)]))) << where << " row " << t;
    EXPECT_NEAR(gpu.entropy[static_cast<size_t>(t)], host.entropy[static_cast<size_t>(t)],
                1e-5f * (1 + std::fabs(host.entropy[static_cast<size_t>(t)]))) << where << " row " << t;
  }
  const double rel = r.dtype == CudaDtype::kFloat32 ? 1e-5 : r.dtype == CudaDtype::kBFloat16 ? 1.0 / 64 : 1.0 / 512;
  // float16 gradients of a large V are subnormal (p / N below 2^-14): one step there is 2^-24,
  // which a last-bit difference of exp or log between the GPU and the CPU may move by.
  const double floor = r.dtype == CudaDtype::kFloat16 ? 0x1p-24 : 0.0;
  int bad = 0;
  for (int64_t t = 0; t < r.T && bad < 5; ++t) {
    for (int64_t v = 0; v < r.V && bad < 5; ++v) {
      const double a = r.At(gpu.grad, t, v), b = r.At(host.grad, t, v);
      if (std::fabs(a - b) > rel * std::fabs(b) + 1e-6 * std::fabs(scale) + floor) {
        ADD_FAILURE() << where << ": grad[" << t << "][" << v << "] GPU " << a << " CPU " << b;
        ++bad;
      }
    }
  }
}

// The kernels' versions, one gtest parameter each.
class CudaLossGpuVersion : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Versions, CudaLossGpuVersion, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "v" + std::to_string(info.param);
                         });

TEST_P(CudaLossGpuVersion, FusedEqualsTheCpuExecution) {
  SKIP_WITHOUT_GPU();
  const int version = GetParam();
  std::mt19937_64 rng(1);
  for (CudaDtype d : {CudaDtype::kFloat32, CudaDtype::kBFloat16, CudaDtype::kFloat16}) {
    for (int64_t V : {7, 255, 1000, 4099, 32000, 32005, 151936}) {
      for (int64_t ld : {V, V + 1, (V + 7) / 8 * 8}) {
        const Rows r = Make(rng, d, 19, V, ld);
        const float scale = 1.0f / 17;
        const std::string where = "v" + std::to_string(version) + " dtype " +
                                  std::to_string(static_cast<int>(d)) + " V " +
                                  std::to_string(V) + " ld " + std::to_string(ld);
        const Outputs host = OnHost(r, scale, false, version);
        Compare(r, OnGpu(r, scale, false, {}, false, version), host, scale, where);
        Compare(r, OnGpu(r, scale, true, {}, false, version), host, scale, where + " in place");
      }
    }
  }
}

// Clusters of 1 (V up to 48K bf16 columns), 2, 4 (151,936 bf16) and 8 (151,936 float32, and
// 300,000 bf16) blocks; sm_90 for clusters of more than one.
TEST_P(CudaLossGpuVersion, OneReadEqualsTheCpuExecution) {
  SKIP_WITHOUT_GPU();
  const int version = GetParam();
  int device = 0, major = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  std::mt19937_64 rng(4);
  for (CudaDtype d : {CudaDtype::kFloat32, CudaDtype::kBFloat16, CudaDtype::kFloat16}) {
    // 12288 float32 and 24576 bf16 columns: a share just under 48 KB, where the static shared
    // memory pushes the block past the default limit.
    for (int64_t V : {7, 1000, 4099, 12288, 24576, 32000, 49153, 151936, 300000}) {
      const CudaOneReadPlan plan = CudaLossOneReadPlan(d, V);
      if (plan.cluster == 0 || (plan.cluster > 1 && major < 9)) continue;
      for (int64_t ld : {V, V + 1, (V + 7) / 8 * 8}) {
        const Rows r = Make(rng, d, 13, V, ld);
        const float scale = 1.0f / 11;
        const std::string where = "one read v" + std::to_string(version) + " dtype " +
                                  std::to_string(static_cast<int>(d)) + " V " +
                                  std::to_string(V) + " ld " + std::to_string(ld) +
                                  " cluster " + std::to_string(plan.cluster);
        const Outputs host = OnHost(r, scale, true, version);
        Compare(r, OnGpu(r, scale, false, {}, true, version), host, scale, where);
        Compare(r, OnGpu(r, scale, true, {}, true, version), host, scale, where + " in place");
      }
    }
  }
}

TEST_P(CudaLossGpuVersion, VocabParallelEqualsTheCpuExecution) {
  SKIP_WITHOUT_GPU();
  const int version = GetParam();
  std::mt19937_64 rng(2);
  for (CudaDtype d : {CudaDtype::kFloat32, CudaDtype::kBFloat16}) {
    const Rows r = Make(rng, d, 23, 50000, 50000);
    const float scale = 0.01f;
    Compare(r, OnGpu(r, scale, false, {0, 12345, 12346, 40000, 50000}, false, version),
            OnHost(r, scale, false, version), scale,
            "tp v" + std::to_string(version) + " dtype " + std::to_string(static_cast<int>(d)));
  }
}

TEST(CudaLossGpu, BadLabelSetsTheFlag) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3);
  Rows r = Make(rng, CudaDtype::kFloat32, 8, 100, 100);
  r.labels[5] = 100;
  r.mask[5] = 1;
  const Outputs gpu = OnGpu(r, 0.1f, false);
  const Status s = DecodeCudaLossError(gpu.flag, 100);
  EXPECT_NE(s.message().find("labels[5]"), std::string::npos) << s.ToString();
}


// ScaleGradient on the GPU equals its CPU execution bit for bit (one fp32 product, rounded to
// nearest even by the hardware there and by ce_row.h here), rows with a stride and odd
// offsets; a factor of 1 read on the device leaves the gradient untouched.
TEST(CudaLossGpu, ScaleGradientEqualsTheCpuExecution) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(6);
  for (CudaDtype d : {CudaDtype::kFloat32, CudaDtype::kBFloat16, CudaDtype::kFloat16}) {
    for (int64_t V : {7, 1000, 151936}) {
      for (int64_t ld : {V, V + 1}) {
        for (float factor : {1.0f, 0.37f, -3.0f}) {
          Rows r = Make(rng, d, 9, V, ld);
          Dev<uint8_t> g(r.bytes.size());
          Dev<float> f(1);
          g.Put(r.bytes);
          f.Put({factor});
          ASSERT_TRUE(ScaleGradient(d, g.p, r.T, V, ld, f.p, nullptr).ok());
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          std::vector<uint8_t> host = r.bytes;
          ASSERT_TRUE(ScaleGradientHost(d, host.data(), r.T, V, ld, &factor, 256).ok());
          EXPECT_EQ(g.Get(), host) << "dtype " << static_cast<int>(d) << " V " << V << " ld "
                                   << ld << " factor " << factor;
          if (factor == 1.0f) EXPECT_EQ(host, r.bytes);
        }
      }
    }
  }
}

// A launch that fails (here a one-read share larger than the kernel's shared-memory limit)
// must leave no error behind: the next call of another kernel reads the runtime's last error
// after its own launch, and would report the stale one as its own.
TEST(CudaLossGpu, AFailedLaunchLeavesNoErrorForTheNextCall) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(8);
  const Rows r = Make(rng, CudaDtype::kBFloat16, 4, 120000, 120000);
  Dev<uint8_t> x(r.bytes.size()), g(r.bytes.size());
  Dev<int64_t> y(r.labels.size());
  x.Put(r.bytes);
  y.Put(r.labels);
  kernels::CeArgs a{};
  a.dtype = static_cast<int>(CudaDtype::kBFloat16);
  a.logits = x.p;
  a.num_tokens = r.T;
  a.vocab_size = r.V;
  a.ld = r.ld;
  a.labels = y.p;
  a.grad_scale = 0.25f;
  a.grad = g.p;
  a.version = 2;
  // 120,000 bf16 columns in one block: 240 KB of shared memory, past the 96 KB limit.
  const int failed = kernels::CeOneRead(a, 1, 120000, 512, nullptr);
  ASSERT_NE(failed, 0) << "the oversized launch was expected to fail";
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << cudaGetErrorString(cudaPeekAtLastError());
  const Outputs gpu = OnGpu(r, 0.25f, false);  // the fused kernel, after the failure
  Compare(r, gpu, OnHost(r, 0.25f), 0.25f, "fused after a failed one-read launch");
}

}  // namespace
}  // namespace thdpack
