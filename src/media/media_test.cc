// Media (thdpack/media.h): the placeholder check by example and by its errors, the placement
// against the best placement found by trying them all, the routing tables driven through a
// simulated all-to-all and compared with the plain zigzag reference on random microbatches, and
// mRoPE positions worked out by hand (python/tests/test_media.py compares them with
// transformers' own get_rope_index).
#include "thdpack/media.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace thdpack {
namespace {

constexpr TokenId kImg = 900, kVid = 901;
std::vector<MediaSpec> Specs() { return {{"image", kImg, false}, {"video", kVid, true}}; }

template <typename T>
std::string ErrorOf(const Result<T>& r) {
  return r.ok() ? std::string("OK") : r.status().message();
}

TEST(MediaSpecs, RulesAreNamed) {
  EXPECT_TRUE(ValidateMediaSpecs(Specs(), 2).ok());
  EXPECT_NE(ValidateMediaSpecs({}, 2).message().find("no modality"), std::string::npos);
  std::vector<MediaSpec> twice{{"image", 1}, {"image", 2}};
  EXPECT_NE(ValidateMediaSpecs(twice, 2).message().find("media[1] 'image': the name is declared "
                                                        "twice"), std::string::npos);
  std::vector<MediaSpec> same_id{{"image", 1}, {"video", 1}};
  EXPECT_NE(ValidateMediaSpecs(same_id, 2).message().find("another modality's placeholder"),
            std::string::npos);
  EXPECT_NE(ValidateMediaSpecs(Specs(), 0).message().find("spatial_merge_size = 0"),
            std::string::npos);
}

// text 2, image [1,4,4] (4 tokens), text 2, video [2,4,2] (4 tokens), text 1.
std::vector<TokenId> Example() {
  return {1, 2, kImg, kImg, kImg, kImg, 3, 4, kVid, kVid, kVid, kVid, 5};
}

TEST(MediaItems, TiesItemsToTheirTokensInOrder) {
  const std::vector<std::vector<MediaGrid>> grids{{{1, 4, 4}}, {{2, 4, 2}}};
  auto items = SampleMediaItems(Specs(), 2, Example(), grids, {}, "samples[0] (id 7)");
  ASSERT_TRUE(items.ok()) << items.status().ToString();
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[0].modality, 0);
  EXPECT_EQ((*items)[0].begin, 2);
  EXPECT_EQ((*items)[0].tokens, 4);
  EXPECT_FALSE((*items)[0].timed);
  EXPECT_EQ((*items)[1].modality, 1);
  EXPECT_EQ((*items)[1].begin, 8);
  EXPECT_EQ((*items)[1].tokens, 4);
  EXPECT_TRUE((*items)[1].timed);
  EXPECT_EQ((*items)[1].seconds, 1.0);  // transformers' default when none are given
  // Two images back to back: the counts split them; row_begin counts patches.
  std::vector<TokenId> two(10, kImg);
  two[0] = 1;
  two[9] = 2;
  auto both = SampleMediaItems(Specs(), 2, two, std::vector<std::vector<MediaGrid>>{
                                   {{1, 4, 4}, {1, 2, 8}}, {}}, {}, "s");
  ASSERT_TRUE(both.ok()) << both.status().ToString();
  EXPECT_EQ((*both)[1].begin, 5);
  EXPECT_EQ((*both)[1].row_begin, 16);
}

TEST(MediaItems, EveryMismatchIsNamed) {
  const auto tokens = Example();
  using G = std::vector<std::vector<MediaGrid>>;
  // Too few placeholders for the item: sample, modality, item, both counts.
  EXPECT_EQ(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{{1, 4, 8}}, {{2, 4, 2}}}, {},
                                     "samples[3] (id 17)")),
            "samples[3] (id 17): 'image' item 0 (grid [1, 4, 8]) takes 8 'image' tokens "
            "(id 900), only 4 are left of the sample's 4");
  // Placeholders left over.
  EXPECT_EQ(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{{1, 2, 4}}, {{2, 4, 2}}}, {}, "s")),
            "s: 2 'image' tokens (id 900) remain after its 1 items' 2 (the sample has 4)");
  // No grid for a modality that has tokens.
  EXPECT_NE(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{}, {{2, 4, 2}}}, {}, "s"))
                .find("4 'image' tokens (id 900) remain after its 0 items"), std::string::npos);
  // A grid the merge does not divide, a zero dimension.
  EXPECT_NE(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{{1, 3, 4}}, {{2, 4, 2}}}, {}, "s"))
                .find("item 0 (grid [1, 3, 4]): h and w must be divisible by spatial_merge_size"),
            std::string::npos);
  EXPECT_NE(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{{0, 4, 4}}, {{2, 4, 2}}}, {}, "s"))
                .find("every grid dimension must be >= 1"), std::string::npos);
  // Not consecutive.
  std::vector<TokenId> gap{kImg, kImg, 7, kImg, kImg};
  EXPECT_NE(ErrorOf(SampleMediaItems(Specs(), 2, gap, G{{{1, 4, 4}}, {}}, {}, "s"))
                .find("its 4 tokens must be consecutive, but its token 2 is at position 3, not 2"),
            std::string::npos);
  // Seconds: on an untimed modality, or of the wrong count.
  using S = std::vector<std::vector<double>>;
  EXPECT_NE(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{{1, 4, 4}}, {{2, 4, 2}}},
                                     S{{1.0}, {}}, "s")).find("'image' has seconds"),
            std::string::npos);
  EXPECT_NE(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{{1, 4, 4}}, {{2, 4, 2}}},
                                     S{{}, {1.0, 2.0}}, "s")).find("2 seconds for 1 items"),
            std::string::npos);
  EXPECT_NE(ErrorOf(SampleMediaItems(Specs(), 2, tokens, G{{{1, 4, 4}}}, {}, "s"))
                .find("grids for 1 modalities, the run declares 2"), std::string::npos);
}

TEST(MediaCost, DefaultIsTheVisionTowersFlops) {
  const EncoderCost c = DefaultEncoderCost();
  EXPECT_EQ(c.per_patch, 3.0 * 2 * 32 * (4.0 * 1280 * 1280 + 2.0 * 1280 * 5120));
  EXPECT_EQ(c.per_frame_sq, 3.0 * 4 * 32 * 1280);
  // Two frames of 4 x 2 patches: 16 patches, 2 frames of 8^2.
  EXPECT_EQ(ItemEncoderCost({1.0, 0.5}, MediaGrid{2, 4, 2}), 16.0 + 0.5 * 2 * 64);
}

// A sample's encoder work is the sum over its items, of every modality; the cost of that sum
// is the sum of its items' costs (the schedulers charge it per sample).
TEST(MediaCost, SampleWorkSumsItsItemsOfEveryModality) {
  std::vector<MediaPart> media(2);
  media[0].grid = {1, 4, 6, 1, 2, 2};  // two images: 24 and 4 patches
  media[1].grid = {3, 4, 4};           // a video of 3 frames of 16 patches
  const EncoderWork w = SampleEncoderWork(media, "s").value();
  EXPECT_EQ(w.patches, 24 + 4 + 48);
  EXPECT_EQ(w.frame_sq, 24 * 24 + 4 * 4 + 3 * 16 * 16);
  const EncoderCost c = DefaultEncoderCost();
  const double items = ItemEncoderCost(c, {1, 4, 6}) + ItemEncoderCost(c, {1, 2, 2}) +
                       ItemEncoderCost(c, {3, 4, 4});
  EXPECT_DOUBLE_EQ(EncoderTerm(c, static_cast<double>(w.patches),
                               static_cast<double>(w.frame_sq)), items);
  EXPECT_EQ(SampleEncoderWork({}, "s").value(), EncoderWork{});
  // Past 2^62 (a frame of 2^31 patches, or sums that add up to it): named, not wrapped.
  std::vector<MediaPart> huge(1);
  huge[0].grid = {1, int64_t{1} << 16, int64_t{1} << 15};
  EXPECT_NE(ErrorOf(SampleEncoderWork(huge, "samples[4]"))
                .find("samples[4]: its items' encoder work"),
            std::string::npos);
  huge[0].grid = {int64_t{1} << 40, 1 << 12, 1 << 12};
  EXPECT_NE(ErrorOf(SampleEncoderWork(huge, "s")).find("exceeds 2^62"), std::string::npos);
}

// The largest rank load of the best placement, by trying every one.
double BestMakespan(const std::vector<double>& costs, int ranks) {
  const size_t n = costs.size();
  double best = 1e300;
  std::vector<int> a(n, 0);
  while (true) {
    std::vector<double> load(static_cast<size_t>(ranks), 0.0);
    for (size_t i = 0; i < n; ++i) load[static_cast<size_t>(a[i])] += costs[i];
    best = std::min(best, *std::max_element(load.begin(), load.end()));
    size_t k = 0;
    while (k < n && ++a[k] == ranks) a[k++] = 0;
    if (k == n) break;
  }
  return best;
}

TEST(MediaPlacement, LongestFirstIsWithinItsBoundOfTheBest) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 4);
    const size_t n = rng() % 8;
    std::vector<double> costs(n);
    for (double& c : costs) c = static_cast<double>(1 + rng() % 100);
    const std::vector<int32_t> placed = PlaceMediaItems(costs, ranks);
    ASSERT_EQ(placed.size(), n);
    std::vector<double> load(static_cast<size_t>(ranks), 0.0);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_GE(placed[i], 0);
      ASSERT_LT(placed[i], ranks);
      load[static_cast<size_t>(placed[i])] += costs[i];
    }
    const double mine = n == 0 ? 0 : *std::max_element(load.begin(), load.end());
    const double best = n == 0 ? 0 : BestMakespan(costs, ranks);
    // Graham's bound for LPT: (4/3 - 1/(3m)) of the optimum.
    EXPECT_LE(mine, (4.0 / 3 - 1.0 / (3 * ranks)) * best + 1e-9) << "trial " << trial;
    EXPECT_EQ(placed, PlaceMediaItems(costs, ranks));  // deterministic
  }
  // Ties: by index, each to the lowest of the least-loaded ranks.
  EXPECT_EQ(PlaceMediaItems(std::vector<double>{5, 5, 5, 5}, 2),
            (std::vector<int32_t>{0, 1, 0, 1}));
}

// A random microbatch: sequences of random lengths with 0-3 items of either modality at random
// places, each item's encoder rank drawn at random (the tables must route any placement).
struct Case {
  Layout layout;
  MicrobatchMedia media;
};

Case RandomCase(std::mt19937_64& rng, int cp, int sp) {
  const int64_t merge = 2;
  const size_t n = 1 + rng() % 4;
  std::vector<int64_t> lengths;
  Case c;
  for (size_t i = 0; i < n; ++i) {
    std::vector<MediaItem> items;
    int64_t at = static_cast<int64_t>(rng() % 5);
    const size_t k = rng() % 4;
    for (size_t j = 0; j < k; ++j) {
      MediaItem x;
      x.modality = static_cast<int32_t>(rng() % 2);
      auto draw = [&](uint64_t k) { return static_cast<int64_t>(rng() % k); };
      x.grid = MediaGrid{1 + draw(2), 2 * (1 + draw(3)), 2 * (1 + draw(3))};
      x.tokens = x.grid.tokens(merge);
      x.begin = at;
      at += x.tokens + static_cast<int64_t>(rng() % 4);
      items.push_back(x);
    }
    lengths.push_back(std::max<int64_t>(at, 1) + static_cast<int64_t>(rng() % 6));
    c.media.items.push_back(items);
  }
  for (const auto& items : c.media.items) {
    for (size_t j = 0; j < items.size(); ++j) {
      c.media.encoder_rank.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(cp)));
    }
  }
  PackOptions opts;
  auto parallel = ParallelLayout::Create(cp, sp, sp > 1);
  EXPECT_TRUE(parallel.ok());
  opts.parallel = *parallel;
  auto layout = ComputeLayout(lengths, opts);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  c.layout = *layout;
  return c;
}

TEST(MediaRoute, TheAllToAllDeliversEveryRowToItsTokenAsTheReferenceSays) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int cp = std::vector<int>{1, 2, 4}[rng() % 3];
    const int sp = std::vector<int>{1, 2}[rng() % 2];
    const Case c = RandomCase(rng, cp, sp);
    for (int32_t modality = 0; modality < 2; ++modality) {
      auto ref = RouteMediaReference(c.layout, cp, sp, modality, c.media);
      ASSERT_TRUE(ref.ok()) << ref.status().ToString();
      // Every encoder's output rows named by (item, token), in its encode order.
      std::vector<std::vector<std::pair<int64_t, int64_t>>> out(static_cast<size_t>(cp));
      {
        int64_t flat = 0;
        for (const auto& items : c.media.items) {
          for (const MediaItem& x : items) {
            if (x.modality == modality) {
              for (int64_t k = 0; k < x.tokens; ++k) {
                out[static_cast<size_t>(c.media.encoder_rank[static_cast<size_t>(flat)])]
                    .emplace_back(flat, k);
              }
            }
            ++flat;
          }
        }
      }
      for (int s = 0; s < sp; ++s) {
        std::vector<MediaRoute> routes;
        for (int r = 0; r < cp; ++r) {
          auto route = RouteMedia(c.layout, cp, r, sp, s, modality, c.media);
          ASSERT_TRUE(route.ok()) << route.status().ToString();
          ASSERT_EQ(static_cast<int64_t>(out[static_cast<size_t>(r)].size()), route->output_rows);
          routes.push_back(*route);
        }
        for (int d = 0; d < cp; ++d) {  // the all-to-all, as route_media runs it
          std::vector<std::pair<int64_t, int64_t>> received;
          for (int r = 0; r < cp; ++r) {
            const MediaRoute& from = routes[static_cast<size_t>(r)];
            ASSERT_EQ(from.send_counts[static_cast<size_t>(d)],
                      routes[static_cast<size_t>(d)].recv_counts[static_cast<size_t>(r)]);
            int64_t off = 0;
            for (int e = 0; e < d; ++e) off += from.send_counts[static_cast<size_t>(e)];
            for (int64_t k = 0; k < from.send_counts[static_cast<size_t>(d)]; ++k) {
              received.push_back(out[static_cast<size_t>(r)][static_cast<size_t>(
                  from.send_index[static_cast<size_t>(off + k)])]);
            }
          }
          const MediaRoute& me = routes[static_cast<size_t>(d)];
          const auto& want = (*ref)[static_cast<size_t>(d * sp + s)];
          ASSERT_EQ(me.token_index.size(), want.size()) << "trial " << trial;
          for (size_t k = 0; k < want.size(); ++k) {
            EXPECT_EQ(me.token_index[k], want[k].position) << "trial " << trial;
            const auto got = received[static_cast<size_t>(me.recv_index[k])];
            EXPECT_EQ(got.first, want[k].item) << "trial " << trial;
            EXPECT_EQ(got.second, want[k].token) << "trial " << trial;
          }
        }
      }
    }
  }
}

TEST(MediaRoute, EncodesItsItemsWithTheirGridsAndRows) {
  // Two sequences of 16 tokens at CP 2: an image [1,4,4] (4 tokens) in each, placed on ranks 1, 0.
  MicrobatchMedia m;
  MediaItem a;
  a.grid = {1, 4, 4};
  a.tokens = 4;
  a.begin = 1;
  m.items = {{a}, {a}};
  m.encoder_rank = {1, 0};
  Layout layout;
  layout.cu_seqlens = {0, 16, 32};
  layout.cu_seqlens_padded = {0, 16, 32};
  layout.total_tokens = 32;
  auto r1 = RouteMedia(layout, 2, 1, 1, 0, 0, m);
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  ASSERT_EQ(r1->encodes.size(), 1u);
  EXPECT_EQ(r1->encodes[0], (std::pair<int32_t, int32_t>{0, 0}));
  EXPECT_EQ(r1->payload_rows, 16);
  EXPECT_EQ(r1->output_rows, 4);
  // Sequence 0's tokens 1..4: chunks of 4 - positions 1,2,3 on rank 0 (local 1,2,3), 4 on rank
  // 1 (local 0). Rank 1 holds its token 4 (local 0) and nothing of sequence 1's (local 8+...:
  // sequence 1's tokens 1..4 are on rank 0 at local 9,10,11 and rank 1 at local 8).
  EXPECT_EQ(r1->token_index, (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(r1->send_counts, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(r1->recv_counts, (std::vector<int64_t>{1, 1}));
  // An item past its sequence's real tokens is refused by name.
  m.items[0][0].begin = 14;
  EXPECT_NE(RouteMedia(layout, 2, 0, 1, 0, 0, m).status().message().find(
                "sequence 0: an item's tokens [14, 18) lie outside its 16 real tokens"),
            std::string::npos);
}

TEST(Mrope, WorkedExampleByHand) {
  const std::vector<std::vector<MediaGrid>> grids{{{1, 4, 4}}, {{2, 4, 2}}};
  auto items = SampleMediaItems(Specs(), 2, Example(), grids, {}, "s");
  ASSERT_TRUE(items.ok());
  auto pos = SampleMropePositions(Mrope::kQwen2Vl, *items, 13, 2, 2.0);
  ASSERT_TRUE(pos.ok()) << pos.status().ToString();
  // text 0,1 | image at p=2: (2,2,2) (2,2,3) (2,3,2) (2,3,3) | p=4: text 4,5 | video at p=6:
  // t=0: (6,6,6) (6,7,6), t=1: (7,6,6) (7,7,6) | p=8: text 8.
  const std::vector<int64_t> t{0, 1, 2, 2, 2, 2, 4, 5, 6, 6, 7, 7, 8};
  const std::vector<int64_t> h{0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 6, 7, 8};
  const std::vector<int64_t> w{0, 1, 2, 3, 2, 3, 4, 5, 6, 6, 6, 6, 8};
  std::vector<int64_t> want = t;
  want.insert(want.end(), h.begin(), h.end());
  want.insert(want.end(), w.begin(), w.end());
  EXPECT_EQ(*pos, want);
  // qwen2.5-vl: the video's frames step by tokens_per_second * seconds = 2 * 1.0.
  auto timed = SampleMropePositions(Mrope::kQwen25Vl, *items, 13, 2, 2.0);
  ASSERT_TRUE(timed.ok());
  EXPECT_EQ((*timed)[10], 8);
  EXPECT_EQ((*timed)[11], 8);
  EXPECT_EQ((*timed)[2], 2);  // the image is not timed
}

TEST(Mrope, ShardCountsOnThroughPaddingAndZigzags) {
  // One sequence of 3 text tokens padded to 8 at CP 2: positions 0,1,2 then 3..7.
  Layout layout;
  layout.cu_seqlens = {0, 3};
  layout.cu_seqlens_padded = {0, 8};
  layout.total_tokens = 8;
  const std::vector<std::vector<int64_t>> pos{{0, 1, 2, 0, 1, 2, 0, 1, 2}};
  auto r0 = MropeShard(pos, layout, 2, 0);
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  // Rank 0 keeps global positions 0,1,6,7.
  EXPECT_EQ(*r0, (std::vector<int64_t>{0, 1, 6, 7, 0, 1, 6, 7, 0, 1, 6, 7}));
  EXPECT_FALSE(MropeShard(std::vector<std::vector<int64_t>>{{0, 1}}, layout, 2, 0).ok());
}

}  // namespace
}  // namespace thdpack
