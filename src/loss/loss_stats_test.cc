// The CP-local loss on real packed microbatches: the sum over CP ranks of the local loss sums
// equals the loss of the gathered logits (CP in {1,2,3,4,8}); the statistics are the same for
// every CP size and microbatching and match a per-sample computation without packing; the
// statistics' hand-worked cases; the memory figures.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "thdpack/loss.h"
#include "thdpack/memory.h"
#include "thdpack/pack.h"
#include "thdpack/shard.h"

namespace thdpack {
namespace {

constexpr int64_t kVocab = 97;

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The "model": logits of position j of sample id, a function of (id, j, v) only, so every
// packing and sharding of the same samples sees the same rows.
float ModelLogit(int64_t id, int64_t j, int64_t v) {
  const uint64_t h = SplitMix(SplitMix(SplitMix(static_cast<uint64_t>(id)) + j) + v);
  return static_cast<float>(static_cast<double>(h >> 11) * 0x1.0p-53 * 8.0 - 4.0);
}

std::vector<Sample> RandomSamples(std::mt19937_64& rng, int n) {
  std::vector<Sample> out;
  std::uniform_int_distribution<int> len(1, 40), tok(0, kVocab - 1), coin(0, 3);
  for (int i = 0; i < n; ++i) {
    Sample s;
    s.id = 1000 + 7 * i;
    const int L = len(rng);
    for (int j = 0; j < L; ++j) s.tokens.push_back(tok(rng));
    if (coin(rng) != 0) {  // a prompt/answer mask; otherwise all ones
      for (int j = 0; j < L; ++j) s.target_mask.push_back(j >= L / 3 ? 1 : 0);
    }
    out.push_back(std::move(s));
  }
  return out;
}

// Logits of a packed microbatch [T, V]: real positions from the model, padding from noise.
std::vector<float> MicrobatchLogits(const std::vector<Sample>& samples,
                                    const PackedMicrobatch& mb) {
  const int64_t T = mb.cu_seqlens_padded.back();
  std::vector<float> logits(static_cast<size_t>(T * kVocab));
  for (size_t i = 0; i < samples.size(); ++i) {
    for (int64_t g = mb.cu_seqlens_padded[i]; g < mb.cu_seqlens_padded[i + 1]; ++g) {
      const int64_t j = g - mb.cu_seqlens_padded[i];
      for (int64_t v = 0; v < kVocab; ++v) {
        const bool padding = j >= mb.cu_seqlens[i + 1] - mb.cu_seqlens[i];
        logits[g * kVocab + v] = ModelLogit(samples[i].id, j, v) + (padding ? 3.0f : 0.0f);
      }
    }
  }
  return logits;
}

struct Expected {
  int64_t n_tokens = 0, n_loss_tokens = 0;
  double loss = 0, entropy = 0, ppl = 0;
  bool has_ppl = false;
};

// Per sample, without packing: row j predicts tokens[j+1] when target_mask[j+1] is set; the
// fp64 reference on a one-row logits array.
Expected ExpectedStats(const std::vector<Sample>& samples) {
  Expected e;
  double loss = 0, ent = 0, ppl_sum = 0;
  int64_t n_seq = 0;
  for (const Sample& s : samples) {
    const int64_t L = static_cast<int64_t>(s.tokens.size());
    e.n_tokens += L;
    double lp_sum = 0;
    int64_t n = 0;
    for (int64_t j = 0; j + 1 < L; ++j) {
      if (!s.target_mask.empty() && !s.target_mask[j + 1]) continue;
      std::vector<float> row(kVocab);
      for (int64_t v = 0; v < kVocab; ++v) row[v] = ModelLogit(s.id, j, v);
      const std::vector<int32_t> label = {s.tokens[j + 1]};
      auto r = CrossEntropyReference(
          LogitsView{LogitsDtype::kFloat32, std::as_bytes(std::span<const float>(row)), 1, kVocab},
          TokenTargets{label, {}, {}, {}}, CrossEntropyOptions{});
      lp_sum += r->logprobs[0];
      ent += r->entropy[0];
      ++n;
    }
    loss -= lp_sum;
    e.n_loss_tokens += n;
    if (n > 0) {
      ppl_sum += std::exp(-lp_sum / static_cast<double>(n));
      ++n_seq;
    }
  }
  if (e.n_loss_tokens > 0) {
    e.loss = loss / static_cast<double>(e.n_loss_tokens);
    e.entropy = ent / static_cast<double>(e.n_loss_tokens);
  }
  e.has_ppl = n_seq > 0;
  if (e.has_ppl) e.ppl = ppl_sum / static_cast<double>(n_seq);
  return e;
}

// Runs the CP-local loss over every CP rank of every microbatch; checks each microbatch's
// shard sums and per-token values against the loss on its gathered logits; returns the stats.
// The CP reduction as a framework runs it (ReduceSequencesOverCp on every CP rank, keys
// 0..n-1), with the all-reduce done in two passes here: each rank's contribution is recorded,
// then every rank receives the elementwise sum. The totals of every rank are added to *totals.
void ReduceOverCpInProcess(std::vector<LossStats>& per_rank, LossTotals* totals) {
  std::vector<double> sum;
  for (LossStats copy : per_rank) {
    ASSERT_TRUE(ReduceSequencesOverCp(
                    [&](std::span<double> v) {
                      if (sum.empty()) sum.assign(v.size(), 0.0);
                      EXPECT_EQ(sum.size(), v.size());
                      for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
                      return Status::Ok();
                    },
                    0, &copy)
                    .ok());
  }
  for (size_t r = 0; r < per_rank.size(); ++r) {
    ASSERT_TRUE(ReduceSequencesOverCp(
                    [&](std::span<double> v) {
                      std::copy(sum.begin(), sum.end(), v.begin());
                      return Status::Ok();
                    },
                    static_cast<int>(r), &per_rank[r])
                    .ok());
    if (r != 0) EXPECT_TRUE(per_rank[r].sequences.empty());
    totals->Add(per_rank[r]);
  }
}

LossStats RunSharded(const std::vector<std::vector<Sample>>& microbatches, int cp, int64_t N,
                     LogitsDtype dtype, LossTotals* totals = nullptr) {
  LossStats stats;
  for (const auto& samples : microbatches) {
    std::vector<SampleView> views(samples.begin(), samples.end());
    PackOptions po;
    po.parallel = ParallelLayout::Create(cp).value();
    auto mb = Pack(views, po);
    EXPECT_TRUE(mb.ok()) << mb.status().ToString();
    const int64_t T = mb->cu_seqlens_padded.back();
    const std::vector<float> logits32 = MicrobatchLogits(samples, *mb);
    // The dtype under test: fp32 as is, bf16 rounded.
    const int64_t esize = *LogitsDtypeSize(dtype);
    std::vector<std::byte> full(static_cast<size_t>(T * kVocab * esize));
    for (int64_t i = 0; i < T * kVocab; ++i) {
      if (dtype == LogitsDtype::kBFloat16) {
        const uint16_t b = BFloat16::FromFloat(logits32[i]).bits;
        std::memcpy(full.data() + i * 2, &b, 2);
      } else {
        std::memcpy(full.data() + i * 4, &logits32[i], 4);
      }
    }
    CrossEntropyOptions o;
    o.with_grad = true;
    o.normalizer = N;
    o.num_threads = 2;
    std::vector<std::byte> full_grad(full.size());
    auto whole = CrossEntropy(LogitsView{dtype, full, T, kVocab},
                              TokenTargets{mb->labels, {}, mb->loss_mask, {}}, o, full_grad);
    EXPECT_TRUE(whole.ok()) << whole.status().ToString();
    std::vector<int64_t> ids;  // sequences are keyed by sample id across microbatches
    for (const auto& s : samples) ids.push_back(s.id);
    double shard_loss_sum = 0;
    int64_t shard_valid = 0;
    std::vector<std::vector<std::byte>> grads;
    std::vector<LossStats> per_rank(static_cast<size_t>(cp));  // keys 0..n-1, as frameworks do
    for (int r = 0; r < cp; ++r) {
      const int64_t local = T / cp;
      std::vector<std::byte> logits_r(static_cast<size_t>(local * kVocab * esize));
      EXPECT_TRUE(CpShardBytes(full, static_cast<size_t>(kVocab * esize), mb->cu_seqlens_padded,
                               cp, r, logits_r)
                      .ok());
      auto labels_r = CpShard<TokenId>(mb->labels, mb->cu_seqlens_padded, cp, r);
      auto mask_r = CpShard<uint8_t>(mb->loss_mask, mb->cu_seqlens_padded, cp, r);
      auto idx = CpPartitionIndices(mb->cu_seqlens_padded, cp, r);
      std::vector<std::byte> grad_r(logits_r.size());
      auto res = CrossEntropy(LogitsView{dtype, logits_r, local, kVocab},
                              TokenTargets{*labels_r, {}, *mask_r, {}}, o, grad_r);
      EXPECT_TRUE(res.ok()) << res.status().ToString();
      for (int64_t k = 0; k < local; ++k) {  // the same rows give the same values, bit for bit
        EXPECT_EQ(res->logprobs[k], whole->logprobs[(*idx)[k]]);
        EXPECT_EQ(res->entropy[k], whole->entropy[(*idx)[k]]);
      }
      shard_loss_sum += res->loss_sum;
      shard_valid += res->n_valid;
      EXPECT_TRUE(AccumulateShardLoss(*res, mb->cu_seqlens, mb->cu_seqlens_padded, cp, r, ids,
                                      &stats)
                      .ok());
      EXPECT_TRUE(AccumulateShardLoss(*res, mb->cu_seqlens, mb->cu_seqlens_padded, cp, r, {},
                                      &per_rank[r])
                      .ok());
      grads.push_back(std::move(grad_r));
    }
    if (totals != nullptr) ReduceOverCpInProcess(per_rank, totals);
    EXPECT_EQ(shard_valid, whole->n_valid);
    EXPECT_EQ(shard_valid, mb->n_valid);
    EXPECT_NEAR(shard_loss_sum, whole->loss_sum, 1e-12 * (1 + whole->loss_sum));
    // The local gradients, unsharded, are the gathered gradient.
    std::vector<std::span<const std::byte>> grad_views(grads.begin(), grads.end());
    std::vector<std::byte> unsharded(full.size());
    EXPECT_TRUE(CpUnshardBytes(grad_views, static_cast<size_t>(kVocab * esize),
                               mb->cu_seqlens_padded, cp, unsharded)
                    .ok());
    EXPECT_EQ(unsharded, full_grad);
  }
  return stats;
}

std::vector<std::vector<Sample>> SplitInto(const std::vector<Sample>& samples, int parts) {
  std::vector<std::vector<Sample>> out(static_cast<size_t>(parts));
  for (size_t i = 0; i < samples.size(); ++i) {
    out[i * parts / samples.size()].push_back(samples[i]);
  }
  return out;
}

TEST(LossStatsTest, SameForEveryCpSizeAndMicrobatchingAndMatchesUnpackedSamples) {
  std::mt19937_64 rng(42);
  const std::vector<Sample> samples = RandomSamples(rng, 23);
  const Expected want = ExpectedStats(samples);
  ASSERT_GT(want.n_loss_tokens, 100);
  for (LogitsDtype dtype : {LogitsDtype::kFloat32, LogitsDtype::kBFloat16}) {
    std::optional<LossSummary> first;
    for (int cp : {1, 2, 3, 4, 8}) {
      for (int parts : {1, 2, 5}) {
        SCOPED_TRACE(std::string(LogitsDtypeName(dtype)) + " CP=" + std::to_string(cp) +
                     " microbatches=" + std::to_string(parts));
        LossTotals totals;
        const LossStats stats =
            RunSharded(SplitInto(samples, parts), cp, want.n_loss_tokens, dtype, &totals);
        const LossSummary s = Finalize(stats);
        // The CP-reduced totals (what a framework all-reduces) give the same figures.
        const LossSummary t = Finalize(totals);
        EXPECT_EQ(t.n_tokens, s.n_tokens);
        EXPECT_EQ(t.n_loss_tokens, s.n_loss_tokens);
        EXPECT_EQ(totals.n_ppl, static_cast<int64_t>(samples.size()));
        EXPECT_NEAR(t.loss, s.loss, 1e-13 * s.loss);
        EXPECT_NEAR(t.entropy, s.entropy, 1e-13 * s.entropy);
        ASSERT_TRUE(t.ppl.has_value());
        EXPECT_NEAR(*t.ppl, *s.ppl, 1e-13 * *s.ppl);
        EXPECT_EQ(s.n_tokens, want.n_tokens);
        EXPECT_EQ(s.n_loss_tokens, want.n_loss_tokens);
        ASSERT_TRUE(s.ppl.has_value());
        EXPECT_EQ(stats.sequences.size(), samples.size());
        if (dtype == LogitsDtype::kFloat32) {  // the unpacked fp64 computation on the same rows
          EXPECT_NEAR(s.loss, want.loss, 1e-6 * want.loss);
          EXPECT_NEAR(s.entropy, want.entropy, 1e-6 * want.entropy);
          EXPECT_NEAR(*s.ppl, want.ppl, 1e-6 * want.ppl);
        }
        if (!first) {
          first = s;
          continue;
        }
        // Only the order of the additions differs between layouts.
        EXPECT_NEAR(s.loss, first->loss, 1e-13 * first->loss);
        EXPECT_NEAR(s.entropy, first->entropy, 1e-13 * first->entropy);
        EXPECT_NEAR(*s.ppl, *first->ppl, 1e-13 * *first->ppl);
      }
    }
  }
}

// Per-source statistics (a blend): AddShardBySource over every CP rank of every microbatch,
// the CP all-reduce run in two passes in process, give for each source what the unpacked fp64
// reference gives for that source's samples alone, and the same whatever CP and the
// microbatching; their sums are the totals.
TEST(LossStatsTest, BySourceEqualsEachSourceAloneForEveryLayout) {
  std::mt19937_64 rng(7);
  std::vector<Sample> samples = RandomSamples(rng, 31);
  const int kSources = 4;
  for (Sample& s : samples) s.source = static_cast<int32_t>(rng() % kSources);
  samples[0].source = kSources - 1;  // the largest index appears
  std::vector<Expected> want(kSources);
  for (int d = 0; d < kSources; ++d) {
    std::vector<Sample> mine;
    for (const Sample& s : samples) {
      if (s.source == d) mine.push_back(s);
    }
    want[static_cast<size_t>(d)] = ExpectedStats(mine);
  }
  const Expected all = ExpectedStats(samples);
  std::optional<std::vector<LossSummary>> first;
  for (int cp : {1, 2, 3, 4}) {
    for (int parts : {1, 3}) {
      SCOPED_TRACE("CP=" + std::to_string(cp) + " microbatches=" + std::to_string(parts));
      std::vector<LossTotals> by_source;
      for (const auto& mb_samples : SplitInto(samples, parts)) {
        std::vector<SampleView> views(mb_samples.begin(), mb_samples.end());
        std::vector<int32_t> sources;
        for (const Sample& s : mb_samples) sources.push_back(s.source);
        PackOptions po;
        po.parallel = ParallelLayout::Create(cp).value();
        auto mb = Pack(views, po);
        ASSERT_TRUE(mb.ok());
        const int64_t T = mb->cu_seqlens_padded.back();
        const std::vector<float> logits = MicrobatchLogits(mb_samples, *mb);
        std::vector<CrossEntropyResult> shards;
        for (int r = 0; r < cp; ++r) {
          const int64_t local = T / cp;
          std::vector<std::byte> logits_r(static_cast<size_t>(local * kVocab * 4));
          ASSERT_TRUE(CpShardBytes(std::as_bytes(std::span<const float>(logits)),
                                   static_cast<size_t>(kVocab * 4), mb->cu_seqlens_padded, cp, r,
                                   logits_r)
                          .ok());
          auto labels_r = CpShard<TokenId>(mb->labels, mb->cu_seqlens_padded, cp, r);
          auto mask_r = CpShard<uint8_t>(mb->loss_mask, mb->cu_seqlens_padded, cp, r);
          auto res = CrossEntropy(LogitsView{LogitsDtype::kFloat32, logits_r, local, kVocab},
                                  TokenTargets{*labels_r, {}, *mask_r, {}}, CrossEntropyOptions{});
          ASSERT_TRUE(res.ok());
          shards.push_back(std::move(*res));
        }
        // Pass 1 records the CP sum; pass 2 hands it to every rank.
        std::vector<double> sum;
        const AllReduceSum record = [&](std::span<double> v) {
          if (sum.empty()) sum.assign(v.size(), 0.0);
          for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
          return Status::Ok();
        };
        const AllReduceSum hand = [&](std::span<double> v) {
          std::copy(sum.begin(), sum.end(), v.begin());
          return Status::Ok();
        };
        for (int r = 0; r < cp; ++r) {
          std::vector<LossTotals> scratch;
          ASSERT_TRUE(AddShardBySource(shards[static_cast<size_t>(r)], mb->cu_seqlens,
                                       mb->cu_seqlens_padded, cp, r, sources,
                                       cp > 1 ? &record : nullptr, &scratch)
                          .ok());
        }
        for (int r = 0; r < cp; ++r) {
          ASSERT_TRUE(AddShardBySource(shards[static_cast<size_t>(r)], mb->cu_seqlens,
                                       mb->cu_seqlens_padded, cp, r, sources,
                                       cp > 1 ? &hand : nullptr, &by_source)
                          .ok());
        }
      }
      ASSERT_EQ(by_source.size(), static_cast<size_t>(kSources));
      LossTotals total;
      std::vector<LossSummary> got;
      for (int d = 0; d < kSources; ++d) {
        const LossTotals& t = by_source[static_cast<size_t>(d)];
        total.Add(t);
        const LossSummary s = Finalize(t);
        const Expected& e = want[static_cast<size_t>(d)];
        EXPECT_EQ(s.n_tokens, e.n_tokens) << "source " << d;
        EXPECT_EQ(s.n_loss_tokens, e.n_loss_tokens) << "source " << d;
        EXPECT_NEAR(s.loss, e.loss, 1e-6 * e.loss) << "source " << d;
        EXPECT_NEAR(s.entropy, e.entropy, 1e-6 * e.entropy) << "source " << d;
        ASSERT_EQ(s.ppl.has_value(), e.has_ppl);
        if (e.has_ppl) EXPECT_NEAR(*s.ppl, e.ppl, 1e-6 * e.ppl) << "source " << d;
        got.push_back(s);
      }
      const LossSummary whole = Finalize(total);
      EXPECT_EQ(whole.n_tokens, all.n_tokens);
      EXPECT_EQ(whole.n_loss_tokens, all.n_loss_tokens);
      EXPECT_NEAR(whole.loss, all.loss, 1e-6 * all.loss);
      if (!first) {
        first = got;
        continue;
      }
      for (int d = 0; d < kSources; ++d) {  // only the order of the additions differs
        EXPECT_NEAR(got[d].loss, (*first)[d].loss, 1e-13 * (*first)[d].loss);
        EXPECT_NEAR(got[d].entropy, (*first)[d].entropy, 1e-13 * (*first)[d].entropy);
      }
    }
  }
  std::vector<LossTotals> out;
  CrossEntropyResult empty;
  const std::vector<int32_t> cu = {0, 3}, cup = {0, 4};
  EXPECT_FALSE(AddShardBySource(empty, cu, cup, 2, 0, std::vector<int32_t>{0}, nullptr, &out).ok());
  Status neg = AddShardBySource(empty, cu, cup, 1, 0, std::vector<int32_t>{-1}, nullptr, &out);
  EXPECT_NE(neg.message().find("sources[0] = -1"), std::string::npos) << neg.ToString();
}

TEST(LossStatsTest, TotalsAllReduceChecksCountsAndPassesErrorsThrough) {
  LossTotals t;
  t.n_tokens = 5;
  t.n_loss_tokens = 3;
  t.loss_sum = 1.5;
  t.n_ppl = 1;
  t.ppl_sum = 2.0;
  // Two ranks holding the same totals: everything doubles.
  ASSERT_TRUE(t.AllReduce([](std::span<double> v) {
                 for (double& x : v) x *= 2;
                 return Status::Ok();
               }).ok());
  EXPECT_EQ(t.n_tokens, 10);
  EXPECT_EQ(t.n_loss_tokens, 6);
  EXPECT_EQ(t.n_ppl, 2);
  EXPECT_EQ(Finalize(t).loss, 0.5);
  EXPECT_EQ(*Finalize(t).ppl, 2.0);
  const Status bad = t.AllReduce([](std::span<double> v) {
    v[1] = 2.5;
    return Status::Ok();
  });
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.ToString().find("n_loss_tokens"), std::string::npos) << bad.ToString();
  const Status failed = t.AllReduce([](std::span<double>) {
    return Status::Internal("the group failed");
  });
  EXPECT_NE(failed.ToString().find("the group failed"), std::string::npos);
  LossStats none;
  EXPECT_FALSE(ReduceSequencesOverCp([](std::span<double>) { return Status::Ok(); }, -1,
                                     &none)
                   .ok());
  EXPECT_FALSE(ReduceSequencesOverCp([](std::span<double>) { return Status::Ok(); }, 0, nullptr)
                   .ok());
}

TEST(LossStatsTest, NoLossTokensGivesZeroLossAndNoPpl) {
  std::mt19937_64 rng(9);
  std::vector<Sample> samples = RandomSamples(rng, 5);
  for (Sample& s : samples) s.target_mask.assign(s.tokens.size(), 0);
  const LossStats stats = RunSharded({samples}, 2, 0, LogitsDtype::kFloat32);
  const LossSummary s = Finalize(stats);
  EXPECT_EQ(s.n_loss_tokens, 0);
  EXPECT_GT(s.n_tokens, 0);
  EXPECT_EQ(s.loss, 0.0);
  EXPECT_EQ(s.entropy, 0.0);
  EXPECT_FALSE(s.ppl.has_value());
  const LossSummary empty = Finalize(LossStats{});
  EXPECT_EQ(empty.loss, 0.0);
  EXPECT_FALSE(empty.ppl.has_value());
}

// Sequence A: log-prob sum -2 ln 2 over 2 tokens -> exp(ln 2) = 2. Sequence B: -3 ln 3 over 3
// -> 3. Sequence C: no loss tokens, left out. ppl = (2 + 3) / 2 = 2.5; loss = (2 ln 2 +
// 3 ln 3) / 5. A arrives in two halves (two CP ranks) and must be summed first.
TEST(LossStatsTest, HandWorkedPplIsMeanOverSequencesOfPerSequencePerplexity) {
  LossStats a, b;
  a.n_tokens = 4;
  a.n_loss_tokens = 3;
  a.loss_sum = std::log(2.0) + 2 * std::log(3.0);
  a.entropy_sum = 1.5;
  a.sequences[10] = {-std::log(2.0), 1};
  a.sequences[20] = {-2 * std::log(3.0), 2};
  b.n_tokens = 5;
  b.n_loss_tokens = 2;
  b.loss_sum = std::log(2.0) + std::log(3.0);
  b.entropy_sum = 1.0;
  b.sequences[10] = {-std::log(2.0), 1};
  b.sequences[20] = {-std::log(3.0), 1};
  b.sequences[30] = {0.0, 0};
  a.Merge(b);
  const LossSummary s = Finalize(a);
  EXPECT_EQ(s.n_tokens, 9);
  EXPECT_EQ(s.n_loss_tokens, 5);
  EXPECT_NEAR(s.loss, (2 * std::log(2.0) + 3 * std::log(3.0)) / 5, 1e-15);
  EXPECT_NEAR(s.entropy, 0.5, 1e-15);
  ASSERT_TRUE(s.ppl.has_value());
  EXPECT_NEAR(*s.ppl, 2.5, 1e-14);
}

// cu_seqlens = [0,7,10], cu_seqlens_padded = [0,8,16], CP = 2: rank 0 keeps positions 0,1,6,7
// of both sequences, rank 1 positions 2..5. Real tokens: sequence 0 (L=7) positions 0..6,
// sequence 1 (L=3) positions 0..2. Rank 0: 0,1,6 + 0,1 = 5 real; rank 1: 2,3,4,5 + 2 = 5.
TEST(LossStatsTest, AccumulateAttributesZigzagTokensToSequences) {
  const std::vector<int32_t> cu = {0, 7, 10}, cup = {0, 8, 16};
  CrossEntropyResult r;
  r.logprobs = {-1, -2, -3, 0, -4, -5, 0, 0};  // rank 0's local order
  r.entropy = {1, 1, 1, 0, 1, 1, 0, 0};
  r.counted = {1, 1, 1, 0, 1, 1, 0, 0};
  LossStats s;
  ASSERT_TRUE(AccumulateShardLoss(r, cu, cup, 2, 0, std::vector<int64_t>{5, 9}, &s).ok());
  EXPECT_EQ(s.n_tokens, 5);
  EXPECT_EQ(s.n_loss_tokens, 5);
  EXPECT_EQ(s.loss_sum, 15.0);
  EXPECT_EQ(s.sequences.at(5).logprob_sum, -6.0);
  EXPECT_EQ(s.sequences.at(5).n_loss_tokens, 3);
  EXPECT_EQ(s.sequences.at(9).logprob_sum, -9.0);
  CrossEntropyResult r1;
  r1.logprobs = {-1, -1, -1, -1, -1, 0, 0, 0};
  r1.entropy = std::vector<double>(8, 0.0);
  r1.counted = {1, 1, 1, 1, 1, 0, 0, 0};
  ASSERT_TRUE(AccumulateShardLoss(r1, cu, cup, 2, 1, std::vector<int64_t>{5, 9}, &s).ok());
  EXPECT_EQ(s.n_tokens, 10);
  EXPECT_EQ(s.sequences.at(5).logprob_sum, -10.0);
  EXPECT_EQ(s.sequences.at(5).n_loss_tokens, 7);
  EXPECT_EQ(s.sequences.at(9).n_loss_tokens, 3);
  // Errors name the argument.
  auto bad = AccumulateShardLoss(r, cu, cup, 2, 2, {}, &s);
  EXPECT_NE(bad.message().find("cp_rank = 2"), std::string::npos) << bad.ToString();
  bad = AccumulateShardLoss(r, std::vector<int32_t>{0, 9, 10}, cup, 2, 0, {}, &s);
  EXPECT_NE(bad.message().find("sequence 0"), std::string::npos) << bad.ToString();
  bad = AccumulateShardLoss(r, cu, cup, 2, 0, std::vector<int64_t>{1}, &s);
  EXPECT_NE(bad.message().find("sequence_keys"), std::string::npos) << bad.ToString();
  bad = AccumulateShardLoss(r, cu, cup, 2, 0, std::vector<int64_t>{4, 4}, &s);
  EXPECT_NE(bad.message().find("unique"), std::string::npos) << bad.ToString();
  r.counted.pop_back();
  bad = AccumulateShardLoss(r, cu, cup, 2, 0, {}, &s);
  EXPECT_NE(bad.message().find("T/CP = 8"), std::string::npos) << bad.ToString();
}

TEST(LossStatsTest, ShardSequenceLayoutHandWorkedAndAgreesWithThePaddingMask) {
  // cu = {0, 7, 10}, cup = {0, 8, 16}, CP = 2: rank 0 keeps positions 0, 1, 6, 7 of each
  // sequence, rank 1 positions 2..5.
  const std::vector<int32_t> cu = {0, 7, 10}, cup = {0, 8, 16};
  Result<ShardSequences> r0 = ShardSequenceLayout(cu, cup, 2, 0);
  Result<ShardSequences> r1 = ShardSequenceLayout(cu, cup, 2, 1);
  ASSERT_TRUE(r0.ok() && r1.ok()) << r0.status().ToString() << r1.status().ToString();
  EXPECT_EQ(r0->local_cu, (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(r0->real_tokens, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(r1->real_tokens, (std::vector<int64_t>{4, 1}));
  // Random offsets: real tokens per sequence are the non-padding tokens of ShardPaddingMask
  // (shard.h, an independent definition) inside the sequence's local range.
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int cp = std::vector<int>{1, 2, 3, 4, 8}[trial % 5];
    std::uniform_int_distribution<int> nseq(1, 6), chunks(1, 5), coin(0, 4);
    std::vector<int32_t> c = {0}, cp_off = {0};
    for (int i = nseq(rng); i > 0; --i) {
      const int padded = (cp == 1 ? 1 : 2 * cp) * chunks(rng);
      const int real = coin(rng) == 0 ? 0 : std::uniform_int_distribution<int>(0, padded)(rng);
      cp_off.push_back(cp_off.back() + padded);
      c.push_back(c.back() + real);
    }
    for (int rank = 0; rank < cp; ++rank) {
      Result<ShardSequences> got = ShardSequenceLayout(c, cp_off, cp, rank);
      Result<std::vector<uint8_t>> pad = ShardPaddingMask(c, cp_off, cp, rank);
      ASSERT_TRUE(got.ok() && pad.ok()) << got.status().ToString();
      ASSERT_EQ(got->local_cu.size(), cp_off.size());
      for (size_t i = 0; i + 1 < cp_off.size(); ++i) {
        EXPECT_EQ(got->local_cu[i], cp_off[i] / cp);
        int64_t real = 0;
        for (int64_t k = got->local_cu[i]; k < got->local_cu[i + 1]; ++k) {
          real += (*pad)[static_cast<size_t>(k)] == 0;
        }
        EXPECT_EQ(got->real_tokens[i], real) << "trial " << trial << " rank " << rank;
      }
    }
  }
  // Its errors are AccumulateShardLoss's, named for it.
  Result<ShardSequences> bad = ShardSequenceLayout(std::vector<int32_t>{0, 9, 10}, cup, 2, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("ShardSequenceLayout: sequence 0"), std::string::npos)
      << bad.status().ToString();
  bad = ShardSequenceLayout(cu, cup, 2, -1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cp_rank = -1"), std::string::npos);
}

TEST(LossStatsTest, TotalsFromSumsChecksTheCounts) {
  const std::vector<double> sums = {10, 6, 3.0, 1.5, 4.0, 2};
  Result<LossTotals> t = LossTotals::FromSums(sums);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->n_tokens, 10);
  EXPECT_EQ(t->n_loss_tokens, 6);
  EXPECT_EQ(t->n_ppl, 2);
  EXPECT_EQ(Finalize(*t).loss, 0.5);
  EXPECT_EQ(*Finalize(*t).ppl, 2.0);
  Result<LossTotals> bad = LossTotals::FromSums(std::vector<double>{10, 6, 3.0});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("takes 6"), std::string::npos);
  bad = LossTotals::FromSums(std::vector<double>{10, -1, 3.0, 1.5, 4.0, 2});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("n_loss_tokens"), std::string::npos);
  bad = LossTotals::FromSums(std::vector<double>{10, 6, 3.0, 1.5, 4.0, 0.5});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sequence count"), std::string::npos);
}

// The required check. 131,072 tokens x 151,936 columns x 2 bytes (bf16):
//   131072 * 151936 = 2^17 * 151936 = 150000 * 131072 + 1936 * 131072
//                   = 19,660,800,000 + 253,755,392 = 19,914,555,392 logits;
//   x 2 bytes = 39,829,110,784 bytes = 151936 * 2^18 bytes = 151936 / 4096 GiB = 37.09375 GiB
//   without the CP-local loss (every CP rank holds all T rows); with it each of the CP = 2
//   ranks holds T/2 rows: 19,914,555,392 bytes = 18.546875 GiB. The fused gradient doubles
//   both.
TEST(MemoryTest, LogitsBytesOfA131kSequenceAtCp2) {
  auto m = LogitsMemoryBytes(131072, 2, 151936, LogitsDtype::kBFloat16);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->gathered_logits_bytes, 39829110784);
  EXPECT_EQ(m->local_logits_bytes, 19914555392);
  EXPECT_DOUBLE_EQ(m->gathered_logits_bytes / 1073741824.0, 37.09375);
  EXPECT_DOUBLE_EQ(m->local_logits_bytes / 1073741824.0, 18.546875);
  EXPECT_EQ(m->local_grad_bytes, 0);
  EXPECT_EQ(m->local_total_bytes, 19914555392);
  auto g = LogitsMemoryBytes(131072, 2, 151936, LogitsDtype::kBFloat16, 1, true);
  EXPECT_EQ(g->local_grad_bytes, 19914555392);
  EXPECT_EQ(g->gathered_total_bytes, 2 * 39829110784);
  // Vocab-parallel TP = 3: ceil(151936 / 3) = 50646 columns; fp32: 65536 * 50646 * 4.
  auto tp = LogitsMemoryBytes(131072, 2, 151936, LogitsDtype::kFloat32, 3);
  EXPECT_EQ(tp->local_logits_bytes, int64_t{65536} * 50646 * 4);
  EXPECT_EQ(tp->gathered_logits_bytes, int64_t{131072} * 50646 * 4);
  // Errors.
  auto bad = LogitsMemoryBytes(131071, 2, 151936, LogitsDtype::kBFloat16);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("total_tokens = 131071"), std::string::npos);
  EXPECT_FALSE(LogitsMemoryBytes(8, 0, 10, LogitsDtype::kFloat32).ok());
  EXPECT_FALSE(LogitsMemoryBytes(8, 1, 10, static_cast<LogitsDtype>(5)).ok());
  EXPECT_FALSE(LogitsMemoryBytes(int64_t{1} << 40, 1, int64_t{1} << 30, LogitsDtype::kFloat64).ok());
}

// cu_seqlens_padded = [0,8,16], CP = 2: 8 local tokens. tokens, position_ids, labels 8 x 4 = 32
// bytes each; loss_mask 8; metadata 2 arrays x 3 x 4 = 24; loss outputs 8 x (8 + 8 + 1) = 136.
// Total 32*3 + 8 + 24 + 136 = 264.
TEST(MemoryTest, BufferBytesOfAMicrobatch) {
  auto b = BufferBytes(std::vector<int32_t>{0, 8, 16}, 2);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->tokens, 32);
  EXPECT_EQ(b->loss_mask, 8);
  EXPECT_EQ(b->metadata, 24);
  EXPECT_EQ(b->loss_outputs, 136);
  EXPECT_EQ(b->total, 264);
  EXPECT_FALSE(BufferBytes(std::vector<int32_t>{0, 6}, 2).ok());  // 6 is not a multiple of 4
  // From the shape alone (T = 16, two sequences): the same bytes.
  auto shape = BufferBytesOfShape(16, 2, 2);
  ASSERT_TRUE(shape.ok());
  EXPECT_EQ(shape->total, 264);
  EXPECT_EQ(shape->metadata, 24);
  EXPECT_FALSE(BufferBytesOfShape(15, 2, 2).ok());  // T not divisible by CP
  EXPECT_FALSE(BufferBytesOfShape(16, 0, 2).ok());  // no sequence
  EXPECT_FALSE(BufferBytesOfShape(16, 2, 0).ok());  // CP < 1
}

TEST(MemoryTest, PeakResidentMemoryCoversWhatIsHeld) {
  auto before = ReadProcessMemory();
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  std::vector<char> block(64 << 20);
  for (size_t i = 0; i < block.size(); i += 4096) block[i] = static_cast<char>(i);
  auto after = ReadProcessMemory();
  ASSERT_TRUE(after.ok());
  EXPECT_GE(after->rss_bytes, int64_t{64} << 20);
  EXPECT_GE(after->peak_rss_bytes, after->rss_bytes);
  EXPECT_GE(after->peak_rss_bytes, before->peak_rss_bytes);
  EXPECT_EQ(block[4096], static_cast<char>(4096));
}

}  // namespace
}  // namespace thdpack
