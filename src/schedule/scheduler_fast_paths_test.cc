// The bookkeeping fast paths of scheduling against their plain references, on fresh random
// inputs: SampleIdIndex (direct table) against a std::map, and the rank order (table + radix
// sort) against the comparison sort.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

// Random samples whose ids are dense (a shuffled range, maybe with gaps), sparse (random 64-bit
// values) or dense with a few duplicates.
std::vector<SampleLength> RandomSamples(std::mt19937_64& rng, int kind) {
  const size_t n = 1 + rng() % 3000;
  std::vector<SampleLength> v(n);
  int64_t next_id = static_cast<int64_t>(rng() % 1'000'000) - 500'000;
  for (size_t i = 0; i < n; ++i) {
    if (kind == 1) {
      v[i].id = static_cast<int64_t>(rng());
    } else {
      v[i].id = next_id;
      next_id += 1 + static_cast<int64_t>(rng() % 3);  // gaps of 0 to 2 ids
    }
    v[i].length = 1 + static_cast<int64_t>(rng() % (rng() % 2 ? 100 : 70000));
    v[i].n_targets = static_cast<int64_t>(rng() % static_cast<uint64_t>(v[i].length + 1));
  }
  std::shuffle(v.begin(), v.end(), rng);
  if (kind == 2) {
    for (int k = 0; k < 3; ++k) v[rng() % n].id = v[rng() % n].id;
  }
  return v;
}

TEST(SampleIdIndexTest, EqualsAMapOnRandomSamples) {
  std::mt19937_64 rng(31);
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto samples = RandomSamples(rng, trial % 3);
    std::map<int64_t, SampleLength> first;  // the first sample of each id
    for (const SampleLength& s : samples) first.emplace(s.id, s);
    const SampleIdIndex index(samples);
    EXPECT_EQ(index.has_duplicates(), first.size() != samples.size());
    EXPECT_EQ(internal::HasDuplicateIds(samples), first.size() != samples.size());
    std::vector<uint8_t> used(static_cast<size_t>(index.num_slots()), 0);
    for (const auto& [id, s] : first) {
      const int64_t slot = index.Slot(id);
      ASSERT_GE(slot, 0);
      ASSERT_LT(slot, index.num_slots());
      EXPECT_EQ(used[static_cast<size_t>(slot)]++, 0) << "two ids share slot " << slot;
      EXPECT_EQ(index.Length(slot), s.length);
      EXPECT_EQ(index.NTargets(slot), s.n_targets);
    }
    for (int k = 0; k < 50; ++k) {
      const int64_t id = k % 2 ? static_cast<int64_t>(rng()) : samples[0].id + k - 25;
      EXPECT_EQ(index.Slot(id) >= 0, first.count(id) == 1) << "id " << id;
    }
  }
}

TEST(SortByPaddedThenIdTest, EqualsTheComparisonSortOnRandomSteps) {
  std::mt19937_64 rng(32);
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    auto samples = RandomSamples(rng, trial % 2);  // no duplicates: PrepareStep rejects them
    ScheduleOptions o;
    o.parallel = ParallelLayout::Create(std::vector<int>{1, 2, 8}[rng() % 3]).value();
    o.max_tokens_per_rank = 1 << 20;
    o.oversize = ScheduleOptions::OversizePolicy::kSkip;
    auto step = internal::PrepareStep(samples, o);
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    EXPECT_EQ(internal::SortByPaddedThenId(*step), internal::SortByPaddedThenIdPlain(*step));
  }
}

}  // namespace
}  // namespace thdpack
