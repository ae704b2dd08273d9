// Measured cost profiles: the fit against known coefficients, the active-set solver against the
// plain reference on fresh random problems, the file and CSV formats at the trust boundary, and
// ResolveCost.
#include "thdpack/profile.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace thdpack {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("thdpack_profile_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A designed set like calibrate's: at T = 2048, 4096, 8192, all short (T/256 x 256), one long
// (1 x T), mixed (T/2 + 256s), quarters; every 4th held out.
std::vector<TimedMicrobatch> Design(double a, double b, double c, double m, double noise,
                                    uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> jitter(-noise, noise);
  std::vector<TimedMicrobatch> out;
  for (int64_t t : {2048, 4096, 8192}) {
    std::vector<std::vector<int64_t>> packs;
    packs.push_back(std::vector<int64_t>(static_cast<size_t>(t / 256), 256));
    packs.push_back({t});
    std::vector<int64_t> mixed = {t / 2};
    for (int64_t k = 0; k < t / 2 / 256; ++k) mixed.push_back(256);
    packs.push_back(mixed);
    packs.push_back({t / 4, t / 4, t / 4, t / 4});
    packs.push_back({t / 2, t / 4, t / 8, t / 8});
    for (auto& p : packs) {
      TimedMicrobatch r;
      r.lengths = p;
      ProfileForm f;
      f.a = a;
      f.b = b;
      f.c = c;
      f.m = m;
      r.seconds = f.Predict(p) * (1 + jitter(rng));
      r.held_out = (out.size() + 1) % 4 == 0;
      out.push_back(r);
    }
  }
  return out;
}

TEST(CostProfileTest, FitRecoversKnownCoefficients) {
  // An H200-like layer: 2e-6 s a token, 4e-11 s a squared token, 3e-5 s a sequence.
  const double a = 2e-6, b = 4e-11, c = 3e-5;
  auto exact = FitCostProfile(Design(a, b, c, 0, 0, 1), MeasuredOn{});
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_NEAR(exact->abc.a, a, 1e-9 * a);
  EXPECT_NEAR(exact->abc.b, b, 1e-9 * b);
  EXPECT_NEAR(exact->abc.c, c, 1e-9 * c);
  EXPECT_LT(exact->abc.held_out.max_rel_error, 1e-9);
  EXPECT_GT(exact->abc.held_out.n, 0);
  // 0.1% noise: within 2% (b and c are small parts of the time, so they move most).
  for (uint64_t seed = 2; seed < 12; ++seed) {
    auto noisy = FitCostProfile(Design(a, b, c, 0, 0.001, seed), MeasuredOn{});
    ASSERT_TRUE(noisy.ok());
    EXPECT_NEAR(noisy->abc.a, a, 0.02 * a) << seed;
    EXPECT_NEAR(noisy->abc.b, b, 0.02 * b) << seed;
    EXPECT_NEAR(noisy->abc.c, c, 0.02 * c) << seed;
  }
}

TEST(CostProfileTest, RefinementIsKeptOnlyWhenItPredictsBetter) {
  // A constant of 5 ms per microbatch: the three-coefficient form cannot hold it; the refined
  // one recovers every coefficient and is used.
  auto p = FitCostProfile(Design(2e-6, 4e-11, 3e-5, 5e-3, 0, 3), MeasuredOn{});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE(p->refined.has_value());
  EXPECT_TRUE(p->use_refined);
  EXPECT_NEAR(p->refined->m, 5e-3, 1e-9);
  EXPECT_NEAR(p->refined->a, 2e-6, 1e-12);
  EXPECT_LT(p->refined->held_out.max_rel_error, p->abc.held_out.max_rel_error);
  // Without a constant the refinement gains nothing and is not kept.
  auto q = FitCostProfile(Design(2e-6, 4e-11, 3e-5, 0, 0, 3), MeasuredOn{});
  ASSERT_TRUE(q.ok());
  EXPECT_FALSE(q->use_refined);
  FitOptions off;
  off.refine = false;
  auto r = FitCostProfile(Design(2e-6, 4e-11, 3e-5, 5e-3, 0, 3), MeasuredOn{}, off);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->refined.has_value());
}

TEST(CostProfileTest, TooFewOrDegenerateMicrobatchesAreClearErrors) {
  std::vector<TimedMicrobatch> few = Design(1e-6, 1e-11, 1e-5, 0, 0, 4);
  few.resize(4);  // rows 0..3, one held out: 3 to fit
  auto f = FitCostProfile(few, MeasuredOn{});
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("at least 4"), std::string::npos) << f.status().message();
  // Every microbatch one sequence of the same length: nothing tells a, b and c apart.
  std::vector<TimedMicrobatch> same(8, TimedMicrobatch{0.5, {4096}, false});
  auto d = FitCostProfile(same, MeasuredOn{});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("do not vary enough"), std::string::npos)
      << d.status().message();
  // Bad rows name the row.
  std::vector<TimedMicrobatch> bad = Design(1e-6, 1e-11, 1e-5, 0, 0, 5);
  bad[3].seconds = -1;
  auto b = FitCostProfile(bad, MeasuredOn{});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("microbatch 3"), std::string::npos);
  bad = Design(1e-6, 1e-11, 1e-5, 0, 0, 5);
  bad[2].lengths.push_back(0);
  EXPECT_FALSE(FitCostProfile(bad, MeasuredOn{}).ok());
}

TEST(CostProfileTest, ActiveSetEqualsTheReferenceOnRandomProblems) {
  std::random_device seed_source;
  const uint64_t seed = seed_source();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> z(0, 1);
  for (int trial = 0; trial < 300; ++trial) {
    const int k = 1 + static_cast<int>(rng() % 4);
    const int m = k + 1 + static_cast<int>(rng() % 12);
    std::vector<double> rows(static_cast<size_t>(m * k)), target(static_cast<size_t>(m));
    for (double& v : rows) v = z(rng) * std::pow(10.0, static_cast<double>(rng() % 5));
    for (double& v : target) v = z(rng);
    auto fast = NonNegativeLeastSquares(rows, k, target);
    auto ref = NonNegativeLeastSquaresReference(rows, k, target);
    ASSERT_TRUE(fast.ok() && ref.ok());
    double rf = 0, rr = 0;
    for (int i = 0; i < m; ++i) {
      double pf = 0, pr = 0;
      for (int j = 0; j < k; ++j) {
        pf += rows[static_cast<size_t>(i * k + j)] * (*fast)[static_cast<size_t>(j)];
        pr += rows[static_cast<size_t>(i * k + j)] * (*ref)[static_cast<size_t>(j)];
      }
      rf += (pf - target[static_cast<size_t>(i)]) * (pf - target[static_cast<size_t>(i)]);
      rr += (pr - target[static_cast<size_t>(i)]) * (pr - target[static_cast<size_t>(i)]);
    }
    for (double v : *fast) EXPECT_GE(v, 0.0);
    // The same optimum: equal residuals (the optimum is unique in x when the columns are
    // independent, which random ones are).
    EXPECT_NEAR(rf, rr, 1e-9 * std::max(1.0, rr)) << "trial " << trial;
    for (int j = 0; j < k; ++j) {
      EXPECT_NEAR((*fast)[static_cast<size_t>(j)], (*ref)[static_cast<size_t>(j)],
                  1e-6 * std::max(1.0, std::abs((*ref)[static_cast<size_t>(j)])))
          << "trial " << trial;
    }
  }
}

TEST(CostProfileTest, FileRoundTripsExactly) {
  MeasuredOn on;
  on.model = "llama2-7b";
  on.device = "test device";
  on.dtype = "bf16";
  on.attention = "sdpa";
  on.tp_size = 2;
  auto p = FitCostProfile(Design(2e-6, 4e-11, 3e-5, 5e-3, 0.002, 6), on);
  ASSERT_TRUE(p.ok());
  const std::string path = TempPath("roundtrip.json");
  ASSERT_TRUE(WriteCostProfile(*p, path).ok());
  auto back = ReadCostProfile(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->abc.a, p->abc.a);
  EXPECT_EQ(back->abc.b, p->abc.b);
  EXPECT_EQ(back->abc.c, p->abc.c);
  EXPECT_EQ(back->use_refined, p->use_refined);
  ASSERT_EQ(back->refined.has_value(), p->refined.has_value());
  if (p->refined) EXPECT_EQ(back->refined->m, p->refined->m);
  EXPECT_EQ(back->measured_on.device, "test device");
  EXPECT_EQ(back->measured_on.tp_size, 2);
  EXPECT_EQ(back->abc.held_out.max_rel_error, p->abc.held_out.max_rel_error);
  std::remove(path.c_str());
}

TEST(CostProfileTest, BadFilesNameTheFileAndTheField) {
  const std::string good =
      R"({"format": "thdpack-cost-profile", "version": 1, "a": 1e-6, "b": 1e-11, "c": 1e-5,
          "refined": null, "use": "abc", "measured_on": {"model": "x"}})";
  ASSERT_TRUE(ParseCostProfile(good, "P").ok()) << ParseCostProfile(good, "P").status().ToString();
  struct Case {
    std::string text;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"[1, 2]", "not a JSON object"},
      {"{", "not a JSON object"},
      {R"({"format": "something-else", "version": 1})", "not a thdpack cost profile"},
      {R"({"a": 1})", "\"format\""},
      {R"({"format": "thdpack-cost-profile", "version": 2, "a": 1, "b": 1, "c": 1,
           "measured_on": {}})", "version 2"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "b": 1, "c": 1, "measured_on": {}})",
       "missing field \"a\""},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": -1, "b": 1, "c": 1,
           "measured_on": {}})", "\"a\" = -1"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": "1", "b": 1, "c": 1,
           "measured_on": {}})", "\"a\" is string"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 0, "b": 0, "c": 0,
           "measured_on": {}})", "all 0"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 1, "b": 1, "c": 1})",
       "\"measured_on\""},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 1, "b": 1, "c": 1,
           "use": "refined", "measured_on": {}})", "\"refined\" is null"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 1, "b": 1, "c": 1,
           "refined": {"a": 1, "b": 1, "c": 1}, "measured_on": {}})", "refined: missing field \"m\""},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 1, "b": 1, "c": 1,
           "measured_on": {"cp_size": 0}})", "cp_size"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 1, "b": 1, "c": 1,
           "measured_on": {}, "encoder": {"per_patch": -1, "per_frame_sq": 1}})",
       "encoder: field \"per_patch\" = -1"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 1, "b": 1, "c": 1,
           "measured_on": {}, "encoder": {"per_patch": 0, "per_frame_sq": 0}})",
       "encoder: per_patch and per_frame_sq are both 0"},
      {R"({"format": "thdpack-cost-profile", "version": 1, "a": 1, "b": 1, "c": 1,
           "measured_on": {}, "encoder": [1, 2]})", "encoder must be an object or null"},
  };
  for (const Case& c : cases) {
    auto r = ParseCostProfile(c.text, "cost profile P.json");
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_NE(r.status().message().find("P.json"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(c.says), std::string::npos)
        << c.says << " not in: " << r.status().message();
  }
  auto missing = ReadCostProfile(TempPath("no_such_file.json"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIOError);
}

// Encoder calls of items of several frame sizes and frame counts, every 4th held out.
std::vector<TimedEncoderCall> EncoderDesign(double per_patch, double per_frame_sq, double noise,
                                            uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> jitter(-noise, noise);
  std::vector<TimedEncoderCall> out;
  for (int64_t t : {1, 2, 4}) {
    for (int64_t side : {8, 16, 32, 64}) {
      TimedEncoderCall r;
      r.patches = t * side * side;
      r.frame_sq = t * side * side * side * side;
      r.seconds = (per_patch * static_cast<double>(r.patches) +
                   per_frame_sq * static_cast<double>(r.frame_sq)) * (1 + jitter(rng));
      r.held_out = (out.size() + 1) % 4 == 0;
      out.push_back(r);
    }
  }
  return out;
}

TEST(CostProfileTest, EncoderTermIsFittedWrittenAndCarriedByTheCostModel) {
  auto exact = FitEncoderProfile(EncoderDesign(3e-8, 5e-13, 0, 1), "tower");
  ASSERT_TRUE(exact.ok()) << exact.status().ToString();
  EXPECT_NEAR(exact->cost.per_patch, 3e-8, 3e-8 * 1e-9);
  EXPECT_NEAR(exact->cost.per_frame_sq, 5e-13, 5e-13 * 1e-9);
  EXPECT_EQ(exact->held_out.n, 3);
  auto noisy = FitEncoderProfile(EncoderDesign(3e-8, 5e-13, 0.02, 2), "tower");
  ASSERT_TRUE(noisy.ok());
  EXPECT_NEAR(noisy->cost.per_patch, 3e-8, 3e-8 * 0.05);
  EXPECT_LT(noisy->held_out.max_rel_error, 0.05);
  // Into a language model's profile: written, read back exactly, and the profile's cost model
  // carries it (the step's media default).
  auto p = FitCostProfile(Design(2e-6, 4e-11, 3e-5, 0, 0.0, 7), MeasuredOn{});
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(CostModelOfProfile(*p, "x").encoder.has_value());
  p->encoder = *noisy;
  const std::string path = TempPath("encoder.json");
  ASSERT_TRUE(WriteCostProfile(*p, path).ok());
  auto back = ReadCostProfile(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_TRUE(back->encoder.has_value());
  EXPECT_EQ(back->encoder->cost.per_patch, noisy->cost.per_patch);
  EXPECT_EQ(back->encoder->cost.per_frame_sq, noisy->cost.per_frame_sq);
  EXPECT_EQ(back->encoder->model, "tower");
  EXPECT_EQ(back->encoder->held_out.max_rel_error, noisy->held_out.max_rel_error);
  const CostModel m = CostModelOfProfile(*back, "profile:" + path);
  ASSERT_TRUE(m.encoder.has_value());
  EXPECT_EQ(m.encoder->per_patch, noisy->cost.per_patch);
  std::remove(path.c_str());
}

TEST(CostProfileTest, EncoderTimingsThatCannotBeFittedAreNamed) {
  auto says = [](const std::vector<TimedEncoderCall>& rows, const std::string& part) {
    auto r = FitEncoderProfile(rows, "");
    return !r.ok() && r.status().message().find(part) != std::string::npos;
  };
  std::vector<TimedEncoderCall> rows = EncoderDesign(3e-8, 5e-13, 0, 3);
  EXPECT_TRUE(says({rows.begin(), rows.begin() + 3}, "at least 4 are needed"));
  std::vector<TimedEncoderCall> one_size;
  for (int t = 1; t <= 5; ++t) one_size.push_back({0.1 * t, 256 * t, 256 * 256 * t, false});
  EXPECT_TRUE(says(one_size, "frames of one size"));
  rows[2].seconds = -1;
  EXPECT_TRUE(says(rows, "call 2: seconds = -1"));
  rows[2].seconds = 1;
  rows[5].frame_sq = rows[5].patches - 1;
  EXPECT_TRUE(says(rows, "call 5:"));
}

TEST(CostProfileTest, TimingsCsv) {
  const std::string path = TempPath("timings.csv");
  WriteText(path, "seconds,lengths\r\n0.0405,256 256 1024\n\n0.5,8192\n0.1,1024 1024\n0.2,4096\n");
  auto rows = ReadTimingsCsv(path, 4);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  ASSERT_EQ(rows->size(), 4u);
  EXPECT_EQ((*rows)[0].seconds, 0.0405);
  EXPECT_EQ((*rows)[0].lengths, (std::vector<int64_t>{256, 256, 1024}));
  EXPECT_FALSE((*rows)[2].held_out);
  EXPECT_TRUE((*rows)[3].held_out);  // the 4th
  auto none = ReadTimingsCsv(path, 0);
  ASSERT_TRUE(none.ok());
  for (const auto& r : *none) EXPECT_FALSE(r.held_out);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"secs,lens\n1,2\n", ":1: the header"},
      {"seconds,lengths\n0.1 256\n", ":2: expected"},
      {"seconds,lengths\n-0.1,256\n", ":2: seconds"},
      {"seconds,lengths\nx,256\n", ":2: seconds"},
      {"seconds,lengths\n0.1,256 0\n", ":2: length \"0\""},
      {"seconds,lengths\n0.1,256 2147483648\n", ":2: length"},
      {"seconds,lengths\n0.1,\n", ":2: no lengths"},
      {"", "empty"},
  };
  for (const auto& [text, says] : bad) {
    WriteText(path, text);
    auto r = ReadTimingsCsv(path, 4);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.status().message().find(says), std::string::npos)
        << says << " not in: " << r.status().message();
  }
  std::remove(path.c_str());
}

TEST(CostProfileTest, DescribeLengths) {
  EXPECT_EQ(DescribeLengths(std::vector<int64_t>(32, 256)), "256x32");
  EXPECT_EQ(DescribeLengths(std::vector<int64_t>{8192}), "8192");
  EXPECT_EQ(DescribeLengths(std::vector<int64_t>{4096, 256, 256, 7}), "4096 256x2 7");
}

TEST(CostProfileTest, ResolveCostOfAProfile) {
  MeasuredOn on;
  on.model = "llama2-7b";
  auto p = FitCostProfile(Design(2e-6, 4e-11, 3e-5, 0, 0, 7), on);
  ASSERT_TRUE(p.ok());
  const std::string path = TempPath("resolve.json");
  ASSERT_TRUE(WriteCostProfile(*p, path).ok());
  auto r = ResolveCost("profile:" + path, "h100-nvlink");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->cost.measured());
  EXPECT_EQ(r->cost.a, p->abc.a);
  EXPECT_EQ(r->cost.c, p->abc.c);
  ASSERT_TRUE(r->step_time.has_value());
  EXPECT_EQ(r->step_time->coefficients().seconds_per_sequence, p->abc.c);
  EXPECT_EQ(r->step_time->coefficients().kv_bytes_per_token, KvBytesPerToken(kLlama2_7B));
  EXPECT_EQ(r->step_time->coefficients().link_bytes_per_second, 200e9);
  ASSERT_TRUE(r->dims.has_value() && r->flops.has_value());
  // ParseCostSpec gives the same cost model.
  auto c = ParseCostSpec("profile:" + path);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->SequenceCost(4096), r->cost.SequenceCost(4096));
  // A model that is free text: no dimensions, no exchange term.
  on.model = "a 7B-sized layer";
  auto q = FitCostProfile(Design(2e-6, 4e-11, 3e-5, 0, 0, 7), on);
  ASSERT_TRUE(WriteCostProfile(*q, path).ok());
  auto s = ResolveCost("profile:" + path, "h100-ib");
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->dims.has_value());
  EXPECT_EQ(s->step_time->ExchangeSeconds(4096, 4), 0.0);
  // Errors name the spec at fault.
  auto bad_hw = ResolveCost("tokens", "h100", CostSpecNames{"--cost", "--hw"});
  ASSERT_FALSE(bad_hw.ok());
  EXPECT_EQ(bad_hw.status().message().rfind("--hw: ", 0), 0u) << bad_hw.status().message();
  auto bad_cost = ResolveCost("profile:" + TempPath("none.json"), "h100-ib",
                              CostSpecNames{"--cost", "--hw"});
  ASSERT_FALSE(bad_cost.ok());
  EXPECT_EQ(bad_cost.status().message().rfind("--cost: ", 0), 0u);
  EXPECT_FALSE(ResolveCost("profile:", "h100-ib").ok());
  // The FLOPs presets are unchanged: FLOPs unit, no per-sequence term.
  auto flops = ResolveCost("llama2-7b", "h100-ib");
  ASSERT_TRUE(flops.ok());
  EXPECT_EQ(flops->cost.unit, "FLOPs");
  EXPECT_FALSE(flops->cost.measured());
  EXPECT_EQ(flops->cost.c, 0.0);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace thdpack
