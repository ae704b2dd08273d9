// Packing straight from a length histogram: best-fit decreasing over counts.
//
// Open packs are grouped by their room: rooms_[f] lists "classes" (a content pattern and how
// many open packs have it), all with room f. A histogram row of padded length P and count c is
// placed by repeating: take the smallest room f >= P that has open packs; each of t of them takes
// q = floor(f / P) sequences at once and moves to room f - qP (t = min(packs in f, c / q)), or,
// when c < q, one pack takes all c. Best fit places the sequences one by one into such a pack,
// which then has the least room that fits and so takes the next one too, until it is full for
// P; packs of equal room are interchangeable, so the bulk move is exactly what it would do. When no room fits, new packs
// are opened in bulk: each takes q = floor(capacity / P) sequences of the row (a fresh pack is
// the only one that fits, until it is full), the last one the remainder.
// Every step either finishes the row or empties a room, so the work is O(rows * distinct rooms)
// map operations whatever the number of sequences.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "schedule/scheduler_internal.h"
#include "thdpack/schedule.h"

namespace thdpack {
namespace {

// Patterns share prefixes: node = (parent node, one more sequence of real length `length`).
struct PatternNode {
  int64_t parent;  // -1 for the empty pack
  int64_t length;
  int64_t padded_sum;
};

struct PackClass {
  int64_t node;
  int64_t count;
};

struct Row {
  int64_t length;
  int64_t padded;
  int64_t count;
};

Status ValidateHistogram(std::span<const HistogramRow> histogram) {
  for (size_t r = 0; r < histogram.size(); ++r) {
    const HistogramRow& h = histogram[r];
    if (h.length < 1 || h.length > (int64_t{1} << 50) || h.count < 0) {
      return Status::InvalidArgument("histogram row " + std::to_string(r) + " (length " +
                                     std::to_string(h.length) + ", count " +
                                     std::to_string(h.count) +
                                     "): length must be in [1, 2^50] and count >= 0");
    }
  }
  return Status::Ok();
}

}  // namespace

std::vector<SampleLength> ExpandHistogram(std::span<const HistogramRow> histogram) {
  std::vector<SampleLength> out;
  int64_t total = 0;
  for (const HistogramRow& h : histogram) total += h.count;
  out.reserve(static_cast<size_t>(total));
  int64_t id = 0;
  for (const HistogramRow& h : histogram) {
    for (int64_t j = 0; j < h.count; ++j) out.push_back({id++, h.length, h.length - 1});
  }
  return out;
}

Result<HistogramPacking> PackHistogram(std::span<const HistogramRow> histogram,
                                       const ScheduleOptions& options) {
  THDPACK_RETURN_IF_ERROR(internal::ValidateOptions(options));
  THDPACK_RETURN_IF_ERROR(ValidateHistogram(histogram));
  const int64_t capacity = internal::UsableCapacity(options);
  const int64_t budget = MicrobatchBudget(options);
  HistogramPacking out;

  std::vector<Row> rows;
  for (size_t r = 0; r < histogram.size(); ++r) {
    const HistogramRow& h = histogram[r];
    if (h.count == 0) continue;
    const int64_t p = options.parallel.PaddedLength(h.length);
    if (p > capacity) {
      if (options.oversize == ScheduleOptions::OversizePolicy::kError) {
        return Status::InvalidArgument(
            "histogram row " + std::to_string(r) + ": length " + std::to_string(h.length) +
            " (padded " + std::to_string(p) + ") is over the microbatch budget " +
            std::to_string(budget) + " (" + std::to_string(h.count) +
            " sequences; oversize policy 'error')");
      }
      out.n_skipped += h.count;
      out.skipped.push_back(h);
      continue;
    }
    rows.push_back({h.length, p, h.count});
  }
  // Longest first; equal padded lengths by real length, longest first (deterministic).
  std::stable_sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) {
    if (x.padded != y.padded) return x.padded > y.padded;
    return x.length > y.length;
  });

  std::vector<PatternNode> nodes;
  std::map<int64_t, std::deque<PackClass>> rooms;  // room -> classes, oldest first
  std::map<int64_t, int64_t> room_packs;           // room -> packs in it
  auto add_node = [&](int64_t parent, int64_t length, int64_t padded) {
    const int64_t sum = (parent >= 0 ? nodes[parent].padded_sum : 0) + padded;
    nodes.push_back({parent, length, sum});
    return static_cast<int64_t>(nodes.size()) - 1;
  };
  auto add_packs = [&](int64_t room, int64_t node, int64_t count) {
    rooms[room].push_back({node, count});
    room_packs[room] += count;
  };

  for (const Row& row : rows) {
    int64_t left = row.count;
    out.n_sequences += row.count;
    out.real_tokens += row.length * row.count;
    while (left > 0) {
      auto it = room_packs.lower_bound(row.padded);
      if (it == room_packs.end()) {
        // New packs: q sequences each, then one with the remainder.
        const int64_t q = capacity / row.padded;
        const int64_t full = left / q;
        const int64_t rest = left % q;
        int64_t node = -1;
        for (int64_t j = 0; j < std::min(q, left); ++j) {
          node = add_node(node, row.length, row.padded);
          if (j + 1 == rest) add_packs(capacity - rest * row.padded, node, 1);
        }
        if (full > 0) add_packs(capacity - q * row.padded, node, full);
        out.num_packs += full + (rest > 0 ? 1 : 0);
        left = 0;
        break;
      }
      // After one sequence a pack's room is the least that still fits (no other room lies
      // in [P, room)), so best fit keeps filling the same pack: each pack takes
      // floor(room / P) sequences, or the last one what is left of the row.
      const int64_t room = it->first;
      int64_t per_pack = room / row.padded;
      int64_t take = std::min(it->second, left / per_pack);
      if (take == 0) {
        per_pack = left;
        take = 1;
      }
      left -= take * per_pack;
      it->second -= take;
      std::deque<PackClass>& classes = rooms[room];
      int64_t need = take;
      std::vector<PackClass> moved;
      while (need > 0) {
        PackClass& front = classes.front();
        const int64_t t = std::min(need, front.count);
        int64_t node = front.node;
        for (int64_t j = 0; j < per_pack; ++j) node = add_node(node, row.length, row.padded);
        moved.push_back({node, t});
        front.count -= t;
        need -= t;
        if (front.count == 0) classes.pop_front();
      }
      if (it->second == 0) {
        room_packs.erase(it);
        rooms.erase(room);
      }
      for (const PackClass& c : moved) add_packs(room - per_pack * row.padded, c.node, c.count);
    }
  }

  // Every open pack is a finished pack; patterns in room order (least room first), then age.
  int64_t sum_padded = 0;
  for (const auto& [room, classes] : rooms) {
    for (const PackClass& c : classes) {
      PackPattern pattern;
      pattern.count = c.count;
      for (int64_t v = c.node; v >= 0; v = nodes[v].parent) pattern.lengths.push_back(nodes[v].length);
      std::reverse(pattern.lengths.begin(), pattern.lengths.end());
      const int64_t sum = nodes[c.node].padded_sum;
      pattern.padded_tokens =
          options.parallel.MicrobatchTokens(sum);
      out.padded_tokens += pattern.padded_tokens * c.count;
      sum_padded += sum * c.count;
      out.patterns.push_back(std::move(pattern));
    }
  }
  out.lower_bound = (sum_padded + capacity - 1) / capacity;
  out.efficiency = out.num_packs > 0 ? static_cast<double>(out.real_tokens) /
                                           (static_cast<double>(out.num_packs) * budget)
                                     : 0.0;
  return out;
}

Result<Plan> HistogramPackingToPlan(std::span<const HistogramRow> histogram,
                                    const HistogramPacking& packing,
                                    const ScheduleOptions& options) {
  THDPACK_RETURN_IF_ERROR(internal::ValidateOptions(options));
  THDPACK_RETURN_IF_ERROR(ValidateHistogram(histogram));
  if (options.dp_size != 1) {
    return Status::InvalidArgument("HistogramPackingToPlan: dp_size = " +
                                   std::to_string(options.dp_size) + "; only DP = 1 is supported");
  }
  if (packing.num_packs < 1 || packing.num_packs % options.microbatch_multiple != 0 ||
      packing.num_packs > std::numeric_limits<int32_t>::max()) {
    return Status::InvalidArgument("HistogramPackingToPlan: " + std::to_string(packing.num_packs) +
                                   " packs is not a positive multiple of microbatch_multiple = " +
                                   std::to_string(options.microbatch_multiple));
  }
  // The ids of each length, as ExpandHistogram numbers them: (first id, count) ranges.
  std::map<int64_t, std::deque<std::pair<int64_t, int64_t>>> ids_of;
  {
    int64_t id = 0;
    for (const HistogramRow& h : histogram) {
      if (h.count > 0) ids_of[h.length].push_back({id, h.count});
      id += h.count;
    }
  }
  auto next_id = [&](int64_t length, int64_t* id) {
    auto it = ids_of.find(length);
    if (it == ids_of.end() || it->second.empty()) return false;
    auto& range = it->second.front();
    *id = range.first++;
    if (--range.second == 0) it->second.pop_front();
    return true;
  };
  Plan plan;
  plan.dp_size = 1;
  plan.num_microbatches = static_cast<int>(packing.num_packs);
  plan.offsets.push_back(0);
  std::vector<int64_t> pack;
  for (const PackPattern& pattern : packing.patterns) {
    for (int64_t c = 0; c < pattern.count; ++c) {
      pack.clear();
      for (int64_t length : pattern.lengths) {
        int64_t id = 0;
        if (!next_id(length, &id)) {
          return Status::InvalidArgument(
              "HistogramPackingToPlan: the packing holds more sequences of length " +
              std::to_string(length) + " than the histogram");
        }
        pack.push_back(id);
      }
      std::sort(pack.begin(), pack.end());  // arrival order
      plan.sample_ids.insert(plan.sample_ids.end(), pack.begin(), pack.end());
      plan.offsets.push_back(static_cast<int64_t>(plan.sample_ids.size()));
    }
  }
  if (static_cast<int64_t>(plan.offsets.size()) != packing.num_packs + 1) {
    return Status::InvalidArgument("HistogramPackingToPlan: patterns hold " +
                                   std::to_string(plan.offsets.size() - 1) + " packs, not " +
                                   std::to_string(packing.num_packs));
  }
  for (const auto& [length, ranges] : ids_of) {
    for (const auto& [first, count] : ranges) {
      // An init-capture: clang before 16 cannot capture a structured binding by name.
      const bool skipped = std::any_of(
          packing.skipped.begin(), packing.skipped.end(),
          [length = length](const HistogramRow& s) { return s.length == length; });
      if (!skipped) {
        return Status::InvalidArgument("HistogramPackingToPlan: " + std::to_string(count) +
                                       " sequences of length " + std::to_string(length) +
                                       " are not in the packing");
      }
      for (int64_t j = 0; j < count; ++j) plan.skipped.push_back(first + j);
    }
  }
  std::sort(plan.skipped.begin(), plan.skipped.end());
  return plan;
}

}  // namespace thdpack
