// Randomized comparisons of Pack, the fused pack + shard and the sharding itself against a
// plain per-token reference written here, at CP in {1,2,3,4,8}, TP in {1,2,4}, with and
// without sp, with random extra alignments and rank multiples.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "thdpack/pack.h"
#include "thdpack/shard.h"

namespace thdpack {
namespace {

using Ints = std::vector<int32_t>;
using Bytes = std::vector<uint8_t>;

struct RefPacked {
  Ints cu_seqlens, cu_seqlens_padded;
  int32_t max_seqlen = 0;
  Ints tokens, position_ids, labels;
  Bytes loss_mask;
  int64_t n_valid = 0;
};

// docs/design.md section 5 word for word, one token at a time.
// Reads only the layout's five fields, never its padding methods.
RefPacked RefPack(const std::vector<Sample>& samples, const PackOptions& o) {
  const int cp = o.parallel.cp_size();
  const int tp = o.parallel.tp_size();
  const int64_t rank_multiple = o.parallel.rank_multiple();
  const int64_t q = (cp > 1 ? 2 * cp : 1) * o.parallel.extra_alignment();
  std::vector<int64_t> padded;
  for (const Sample& s : samples) {
    int64_t p = static_cast<int64_t>(s.tokens.size());
    while (p % q != 0) ++p;
    padded.push_back(p);
  }
  int64_t total = 0;
  for (int64_t p : padded) total += p;
  // Grow the last sequence by whole quanta until T splits evenly over the ranks it is divided
  // over (CP; CP*TP with sp) and each rank's share is a multiple of the rank multiple.
  const int64_t ranks = o.parallel.sp() ? int64_t{cp} * tp : cp;
  while (total % ranks != 0 || (total / ranks) % rank_multiple != 0) {
    padded.back() += q;
    total += q;
  }
  RefPacked r;
  r.cu_seqlens = {0};
  r.cu_seqlens_padded = {0};
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    r.cu_seqlens.push_back(r.cu_seqlens.back() + static_cast<int32_t>(len));
    r.cu_seqlens_padded.push_back(r.cu_seqlens_padded.back() + static_cast<int32_t>(padded[i]));
    r.max_seqlen = std::max(r.max_seqlen, static_cast<int32_t>(padded[i]));
    for (int64_t j = 0; j < padded[i]; ++j) {
      r.tokens.push_back(j < len ? s.tokens[j] : o.pad_id);
      r.position_ids.push_back(static_cast<int32_t>(j));
      if (j + 1 < len) {
        r.labels.push_back(s.tokens[j + 1]);
        r.loss_mask.push_back(s.target_mask.empty() ? 1 : s.target_mask[j + 1]);
      } else {
        r.labels.push_back(kIgnoreIndex);
        r.loss_mask.push_back(0);
      }
      r.n_valid += r.loss_mask.back();
    }
  }
  return r;
}

Ints RefIndices(const Ints& cu, int cp, int r) {
  Ints out;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    const int len = cu[i + 1] - cu[i];
    if (cp == 1) {
      for (int j = 0; j < len; ++j) out.push_back(cu[i] + j);
      continue;
    }
    const int c = len / (2 * cp);
    for (int j = r * c; j < (r + 1) * c; ++j) out.push_back(cu[i] + j);
    for (int j = (2 * cp - 1 - r) * c; j < (2 * cp - r) * c; ++j) out.push_back(cu[i] + j);
  }
  return out;
}

template <typename T>
std::vector<T> Gather(const std::vector<T>& full, const Ints& idx) {
  std::vector<T> out;
  for (int32_t g : idx) out.push_back(full[static_cast<size_t>(g)]);
  return out;
}

std::vector<Sample> RandomSamples(std::mt19937_64& rng) {
  const int n = std::uniform_int_distribution<int>(1, 10)(rng);
  std::vector<Sample> samples;
  for (int i = 0; i < n; ++i) {
    Sample s;
    s.id = 1000 + i;
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    const int len = kind == 0   ? 1
                    : kind < 6 ? std::uniform_int_distribution<int>(1, 40)(rng)
                               : std::uniform_int_distribution<int>(1, 400)(rng);
    for (int j = 0; j < len; ++j) {
      s.tokens.push_back(std::uniform_int_distribution<int32_t>(0, 50000)(rng));
    }
    switch (std::uniform_int_distribution<int>(0, 2)(rng)) {
      case 0:
        break;  // empty: all ones
      case 1:
        for (int j = 0; j < len; ++j) s.target_mask.push_back(static_cast<uint8_t>(rng() & 1));
        break;
      default: {  // SFT: a prompt of zeros, then the answer
        const int prompt = std::uniform_int_distribution<int>(0, len)(rng);
        for (int j = 0; j < len; ++j) s.target_mask.push_back(j < prompt ? 0 : 1);
      }
    }
    samples.push_back(std::move(s));
  }
  return samples;
}

PackOptions RandomOptions(std::mt19937_64& rng, int cp, int tp, bool sp) {
  static constexpr int64_t kAlign[] = {1, 1, 1, 2, 3, 8};
  static constexpr int64_t kRankMultiple[] = {1, 1, 2, 3, 16, 32, 128};
  static constexpr TokenId kPad[] = {0, 7, -1};
  const int64_t align = kAlign[rng() % 6];
  const int64_t rank_multiple = kRankMultiple[rng() % 7];
  return PackOptions{
      .parallel = ParallelLayout::Create(cp, tp, sp, align, rank_multiple).value(),
      .pad_id = kPad[rng() % 3]};
}

std::string Describe(const PackOptions& o, int trial) {
  return o.parallel.ToString() + " pad " + std::to_string(o.pad_id) + " trial " +
         std::to_string(trial);
}

class PackShardRandomTest : public testing::TestWithParam<std::tuple<int, int, bool>> {};

TEST_P(PackShardRandomTest, FusedAndPlainMatchTheReference) {
  const auto [cp, tp, sp] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(cp * 100 + tp * 10 + sp));
  for (int trial = 0; trial < 150; ++trial) {
    const std::vector<Sample> samples = RandomSamples(rng);
    const std::vector<SampleView> views(samples.begin(), samples.end());
    const PackOptions o = RandomOptions(rng, cp, tp, sp);
    const std::string what = Describe(o, trial);
    const RefPacked ref = RefPack(samples, o);

    // The plain Pack.
    auto mb = Pack(views, o);
    ASSERT_TRUE(mb.ok()) << what << ": " << mb.status().ToString();
    ASSERT_EQ(mb->cu_seqlens, ref.cu_seqlens) << what;
    ASSERT_EQ(mb->cu_seqlens_padded, ref.cu_seqlens_padded) << what;
    ASSERT_EQ(mb->max_seqlen, ref.max_seqlen) << what;
    ASSERT_EQ(mb->tokens, ref.tokens) << what;
    ASSERT_EQ(mb->position_ids, ref.position_ids) << what;
    ASSERT_EQ(mb->labels, ref.labels) << what;
    ASSERT_EQ(mb->loss_mask, ref.loss_mask) << what;
    ASSERT_EQ(mb->n_valid, ref.n_valid) << what;
    int64_t targets = 0;
    for (const SampleView& s : views) targets += NumTargets(s);
    ASSERT_EQ(mb->n_valid, targets) << what;
    const int64_t t = static_cast<int64_t>(ref.tokens.size());
    ASSERT_EQ(t % (cp > 1 ? 2 * cp : 1), 0) << what;
    if (sp) ASSERT_EQ((t / cp) % tp, 0) << what;
    // Every rank's share (its CP shard; its SP part) is a multiple of the rank multiple.
    ASSERT_EQ((t / cp / (sp ? tp : 1)) % o.parallel.rank_multiple(), 0) << what;

    // The fused path, three ways, against the reference gathered by the reference indices.
    auto all = PackAndShardAll(views, o);
    ASSERT_TRUE(all.ok()) << what << ": " << all.status().ToString();
    ASSERT_EQ(all->n_valid, ref.n_valid);
    ASSERT_EQ(all->layout.cu_seqlens_padded, ref.cu_seqlens_padded);
    ASSERT_EQ(all->layout.total_tokens, t);
    const int64_t local = t / cp;
    std::vector<Ints> tok_shards, pos_shards, lab_shards;
    std::vector<Bytes> mask_shards;
    // Dirty buffers: every slot must be written.
    std::vector<Ints> into_tok(cp, Ints(local, 0x5A5A5A5A)), into_pos(cp, Ints(local, -3)),
        into_lab(cp, Ints(local, 0x7777));
    std::vector<Bytes> into_mask(cp, Bytes(local, 0xEE));
    std::vector<PackBuffers> bufs;
    for (int r = 0; r < cp; ++r) {
      bufs.push_back({into_tok[r], into_pos[r], into_lab[r], into_mask[r]});
    }
    auto n_all = PackShardAllInto(views, all->layout, o, bufs);
    ASSERT_TRUE(n_all.ok()) << n_all.status().ToString();
    ASSERT_EQ(*n_all, ref.n_valid);
    for (int r = 0; r < cp; ++r) {
      const Ints idx = RefIndices(ref.cu_seqlens_padded, cp, r);
      const Ints want_tok = Gather(ref.tokens, idx);
      const Ints want_pos = Gather(ref.position_ids, idx);
      const Ints want_lab = Gather(ref.labels, idx);
      const Bytes want_mask = Gather(ref.loss_mask, idx);
      const PackedShard& s = all->shards[r];
      ASSERT_EQ(s.cp_rank, r);
      ASSERT_EQ(s.tokens, want_tok) << what << " rank " << r;
      ASSERT_EQ(s.position_ids, want_pos) << what << " rank " << r;
      ASSERT_EQ(s.labels, want_lab) << what << " rank " << r;
      ASSERT_EQ(s.loss_mask, want_mask) << what << " rank " << r;
      ASSERT_EQ(into_tok[r], want_tok) << what << " rank " << r;
      ASSERT_EQ(into_pos[r], want_pos) << what << " rank " << r;
      ASSERT_EQ(into_lab[r], want_lab) << what << " rank " << r;
      ASSERT_EQ(into_mask[r], want_mask) << what << " rank " << r;

      auto one = PackAndShard(views, o, r);
      ASSERT_TRUE(one.ok()) << one.status().ToString();
      ASSERT_EQ(one->shards[0].tokens, want_tok) << what << " rank " << r;
      ASSERT_EQ(one->shards[0].position_ids, want_pos);
      ASSERT_EQ(one->shards[0].labels, want_lab);
      ASSERT_EQ(one->shards[0].loss_mask, want_mask);

      // The plain path: Pack followed by sharding, and position ids from metadata alone.
      ASSERT_EQ(*CpPartitionIndices(mb->cu_seqlens_padded, cp, r), idx);
      ASSERT_EQ(*CpShard<TokenId>(mb->tokens, mb->cu_seqlens_padded, cp, r), want_tok);
      ASSERT_EQ(*CpShard<uint8_t>(mb->loss_mask, mb->cu_seqlens_padded, cp, r), want_mask);
      ASSERT_EQ(*LocalPositionIds(mb->cu_seqlens_padded, cp, r), want_pos) << what;

      // SP: the TP parts of the CP-local tokens put back together are the CP-local tokens.
      if (sp) {
        std::vector<std::span<const TokenId>> parts;
        for (int tr = 0; tr < tp; ++tr) {
          auto part = SpSplit(std::span<const TokenId>(s.tokens), tp, tr);
          ASSERT_TRUE(part.ok()) << what << ": " << part.status().ToString();
          ASSERT_EQ(static_cast<int64_t>(part->size()) % o.parallel.rank_multiple(), 0) << what;
          parts.push_back(*part);
        }
        ASSERT_EQ(*SpGather(parts), s.tokens);
      }
      tok_shards.push_back(s.tokens);
      pos_shards.push_back(s.position_ids);
      lab_shards.push_back(s.labels);
      mask_shards.push_back(s.loss_mask);
    }

    // pack -> shard -> unshard gives back every array, and every sample byte for byte.
    const auto& cu = all->layout.cu_seqlens_padded;
    auto tokens = CpUnshard(tok_shards, cu, cp);
    ASSERT_TRUE(tokens.ok()) << tokens.status().ToString();
    ASSERT_EQ(*tokens, ref.tokens) << what;
    ASSERT_EQ(*CpUnshard(pos_shards, cu, cp), ref.position_ids) << what;
    ASSERT_EQ(*CpUnshard(lab_shards, cu, cp), ref.labels) << what;
    ASSERT_EQ(*CpUnshard(mask_shards, cu, cp), ref.loss_mask) << what;
    for (size_t i = 0; i < samples.size(); ++i) {
      const auto& s = samples[i];
      ASSERT_EQ(std::memcmp(tokens->data() + cu[i], s.tokens.data(),
                            s.tokens.size() * sizeof(TokenId)),
                0)
          << what << " sample " << s.id;
      for (int32_t j = cu[i] + static_cast<int32_t>(s.tokens.size()); j < cu[i + 1]; ++j) {
        ASSERT_EQ((*tokens)[j], o.pad_id);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    PackShard, PackShardRandomTest,
    testing::Combine(testing::Values(1, 2, 3, 4, 8), testing::Values(1, 2, 4), testing::Bool()),
    [](const testing::TestParamInfo<std::tuple<int, int, bool>>& info) {
      return "cp" + std::to_string(std::get<0>(info.param)) + "_tp" +
             std::to_string(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_sp" : "");
    });

TEST(PackShardTest, ManyRanksUseTheHeapPathToo) {
  // CP beyond the fixed per-rank array of PackShardAllInto.
  std::mt19937_64 rng(5);
  const std::vector<Sample> samples = RandomSamples(rng);
  const std::vector<SampleView> views(samples.begin(), samples.end());
  const PackOptions o{.parallel = ParallelLayout::Create(80).value()};
  const RefPacked ref = RefPack(samples, o);
  auto all = PackAndShardAll(views, o);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->shards.size(), 80u);
  for (int r = 0; r < 80; r += 13) {
    const Ints idx = RefIndices(ref.cu_seqlens_padded, 80, r);
    ASSERT_EQ(all->shards[r].labels, Gather(ref.labels, idx)) << "rank " << r;
    ASSERT_EQ(all->shards[r].tokens, Gather(ref.tokens, idx)) << "rank " << r;
  }
}

}  // namespace
}  // namespace thdpack
