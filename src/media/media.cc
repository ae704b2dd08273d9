// Media in samples (thdpack/media.h): the modalities' rules, the check that ties a sample's
// items to its placeholder tokens, the encoder's cost of an item and the placement of whole
// items over encoder ranks.
#include "thdpack/media.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>

#include "thdpack/fields.h"

namespace thdpack {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

std::string GridText(const MediaGrid& g) {
  return "[" + Str(g.t) + ", " + Str(g.h) + ", " + Str(g.w) + "]";
}

}  // namespace

Status ValidateMediaSpecs(std::span<const MediaSpec> specs, int64_t merge) {
  if (merge < 1) {
    return Status::InvalidArgument("spatial_merge_size = " + Str(merge) + ": must be >= 1");
  }
  if (specs.empty()) return Status::InvalidArgument("media: no modality declared");
  std::set<std::string> names;
  std::set<TokenId> ids;
  for (size_t i = 0; i < specs.size(); ++i) {
    const MediaSpec& s = specs[i];
    const std::string at = "media[" + Str(static_cast<int64_t>(i)) + "] '" + s.name + "'";
    if (s.name.empty()) return Status::InvalidArgument(at + ": the name is empty");
    if (!names.insert(s.name).second) {
      return Status::InvalidArgument(at + ": the name is declared twice");
    }
    if (s.token_id < 0) {
      return Status::InvalidArgument(at + ": token_id = " + Str(s.token_id) + ": must be >= 0");
    }
    if (!ids.insert(s.token_id).second) {
      return Status::InvalidArgument(at + ": token_id " + Str(s.token_id) +
                                     " is another modality's placeholder too");
    }
  }
  return Status::Ok();
}

Result<std::vector<MediaItem>> SampleMediaItems(std::span<const MediaSpec> specs, int64_t merge,
                                                std::span<const TokenId> tokens,
                                                std::span<const std::vector<MediaGrid>> grids,
                                                std::span<const std::vector<double>> seconds,
                                                std::string_view where) {
  const std::string w(where);
  if (grids.size() != specs.size()) {
    return Status::InvalidArgument(w + ": grids for " + Str(static_cast<int64_t>(grids.size())) +
                                   " modalities, the run declares " +
                                   Str(static_cast<int64_t>(specs.size())));
  }
  if (!seconds.empty() && seconds.size() != specs.size()) {
    return Status::InvalidArgument(w + ": seconds for " +
                                   Str(static_cast<int64_t>(seconds.size())) +
                                   " modalities, the run declares " +
                                   Str(static_cast<int64_t>(specs.size())));
  }
  std::vector<MediaItem> items;
  for (size_t m = 0; m < specs.size(); ++m) {
    const MediaSpec& spec = specs[m];
    const std::string name = "'" + spec.name + "'";
    const std::string id = " (id " + Str(spec.token_id) + ")";
    std::vector<int64_t> at;  // the placeholders' positions
    for (size_t p = 0; p < tokens.size(); ++p) {
      if (tokens[p] == spec.token_id) at.push_back(static_cast<int64_t>(p));
    }
    const std::vector<double>* secs = seconds.empty() ? nullptr : &seconds[m];
    if (secs != nullptr && !secs->empty()) {
      if (!spec.timed) {
        return Status::InvalidArgument(w + ": " + name + " has seconds, but the modality "
                                       "declares none");
      }
      if (secs->size() != grids[m].size()) {
        return Status::InvalidArgument(
            w + ": " + name + " has " + Str(static_cast<int64_t>(secs->size())) +
            " seconds for " + Str(static_cast<int64_t>(grids[m].size())) + " items");
      }
    }
    size_t next = 0;
    int64_t row = 0;
    for (size_t j = 0; j < grids[m].size(); ++j) {
      const MediaGrid& g = grids[m][j];
      const std::string item = name + " item " + Str(static_cast<int64_t>(j)) + " (grid " +
                               GridText(g) + ")";
      if (g.t < 1 || g.h < 1 || g.w < 1) {
        return Status::InvalidArgument(w + ": " + item + ": every grid dimension must be >= 1");
      }
      if (g.h % merge != 0 || g.w % merge != 0) {
        return Status::InvalidArgument(w + ": " + item + ": h and w must be divisible by "
                                       "spatial_merge_size " + Str(merge));
      }
      const int64_t n = g.tokens(merge);
      const int64_t left = static_cast<int64_t>(at.size() - next);
      if (n > left) {
        return Status::InvalidArgument(
            w + ": " + item + " takes " + Str(n) + " " + name + " tokens" + id + ", only " +
            Str(left) + " are left of the sample's " + Str(static_cast<int64_t>(at.size())));
      }
      for (int64_t k = 1; k < n; ++k) {
        if (at[next + static_cast<size_t>(k)] != at[next] + k) {
          return Status::InvalidArgument(
              w + ": " + item + ": its " + Str(n) + " tokens must be consecutive, but its token " +
              Str(k) + " is at position " + Str(at[next + static_cast<size_t>(k)]) +
              ", not " + Str(at[next] + k));
        }
      }
      MediaItem x;
      x.modality = static_cast<int32_t>(m);
      x.index = static_cast<int32_t>(j);
      x.grid = g;
      x.begin = at[next];
      x.tokens = n;
      x.row_begin = row;
      if (spec.timed) {
        x.timed = true;
        x.seconds = (secs != nullptr && !secs->empty()) ? (*secs)[j] : 1.0;
        if (!std::isfinite(x.seconds) || x.seconds < 0) {
          return Status::InvalidArgument(w + ": " + item + ": seconds = " +
                                         std::to_string(x.seconds) + ": must be finite, >= 0");
        }
      }
      items.push_back(x);
      next += static_cast<size_t>(n);
      row += g.patches();
    }
    if (next < at.size()) {
      return Status::InvalidArgument(
          w + ": " + Str(static_cast<int64_t>(at.size() - next)) + " " + name + " tokens" + id +
          " remain after its " + Str(static_cast<int64_t>(grids[m].size())) + " items' " +
          Str(static_cast<int64_t>(next)) + " (the sample has " +
          Str(static_cast<int64_t>(at.size())) + ")");
    }
  }
  std::sort(items.begin(), items.end(),
            [](const MediaItem& a, const MediaItem& b) { return a.begin < b.begin; });
  return items;
}

Result<std::vector<MediaItem>> MediaItemsOf(std::span<const MediaSpec> specs, int64_t merge,
                                            std::span<const TokenId> tokens,
                                            std::span<const MediaPart> media,
                                            std::string_view where) {
  const std::string w(where);
  if (media.size() != specs.size()) {
    return Status::InvalidArgument(w + ": media for " + Str(static_cast<int64_t>(media.size())) +
                                   " modalities, the run declares " +
                                   Str(static_cast<int64_t>(specs.size())));
  }
  std::vector<std::vector<MediaGrid>> grids(specs.size());
  std::vector<std::vector<double>> seconds(specs.size());
  for (size_t m = 0; m < specs.size(); ++m) {
    const MediaPart& p = media[m];
    if (p.grid.size() % 3 != 0) {
      return Status::InvalidArgument(w + ": '" + specs[m].name + "' grid of " +
                                     Str(static_cast<int64_t>(p.grid.size())) +
                                     " values, not [k, 3]");
    }
    for (size_t k = 0; k < p.grid.size(); k += 3) {
      grids[m].push_back(MediaGrid{p.grid[k], p.grid[k + 1], p.grid[k + 2]});
    }
    seconds[m] = p.seconds;
  }
  return SampleMediaItems(specs, merge, tokens, grids, seconds, where);
}

Result<std::vector<MediaItem>> CheckSampleMedia(std::span<const MediaSpec> specs,
                                                int64_t merge, std::span<const TokenId> tokens,
                                                std::span<const MediaPart> media,
                                                std::string_view where) {
  const std::string w(where);
  THDPACK_ASSIGN_OR_RETURN(std::vector<MediaItem> items,
                           MediaItemsOf(specs, merge, tokens, media, where));
  for (size_t m = 0; m < specs.size(); ++m) {
    const MediaPart& p = media[m];
    int64_t rows = 0;
    for (size_t k = 0; k + 2 < p.grid.size(); k += 3) {
      rows += MediaGrid{p.grid[k], p.grid[k + 1], p.grid[k + 2]}.patches();
    }
    const std::string name = "'" + specs[m].name + "'";
    if (p.dtype >= AllFieldDtypes().size()) {
      return Status::InvalidArgument(w + ": " + name + " payload dtype code " + Str(p.dtype) +
                                     " is not one of fields.h's");
    }
    const int64_t row_bytes = p.width * static_cast<int64_t>(
                                            FieldDtypeSize(static_cast<FieldDtype>(p.dtype)));
    if (rows > 0 && p.width < 1) {
      return Status::InvalidArgument(w + ": " + name + " has " + Str(rows) +
                                     " patches of items but no payload rows");
    }
    const int64_t got = row_bytes > 0 ? static_cast<int64_t>(p.payload.size()) / row_bytes : 0;
    if (static_cast<int64_t>(p.payload.size()) != rows * row_bytes) {
      return Status::InvalidArgument(
          w + ": " + name + " payload has " + Str(got) + " rows" +
          (row_bytes > 0 && static_cast<int64_t>(p.payload.size()) % row_bytes != 0
               ? " and a part" : "") +
          ", its items' grids (t*h*w) take " + Str(rows));
    }
  }
  return items;
}

EncoderCost DefaultEncoderCost() {
  const double l = 32, h = 1280, f = 5120;
  return EncoderCost{3 * 2 * l * (4 * h * h + 2 * h * f), 3 * 4 * l * h};
}

double ItemEncoderCost(const EncoderCost& cost, const MediaGrid& grid) {
  const double frame = static_cast<double>(grid.h) * static_cast<double>(grid.w);
  return cost.per_patch * static_cast<double>(grid.patches()) +
         cost.per_frame_sq * static_cast<double>(grid.t) * frame * frame;
}

Result<EncoderWork> SampleEncoderWork(std::span<const MediaPart> media,
                                      std::string_view where) {
  __extension__ typedef unsigned __int128 Wide;
  constexpr Wide kLimit = Wide{1} << 62;
  Wide patches = 0, frame_sq = 0;
  for (const MediaPart& p : media) {
    for (size_t k = 0; k + 2 < p.grid.size(); k += 3) {
      // Grid values are >= 1 (checked); each product below stays under 2^124.
      const Wide t = static_cast<uint64_t>(p.grid[k]);
      const Wide frame = static_cast<Wide>(static_cast<uint64_t>(p.grid[k + 1])) *
                         static_cast<uint64_t>(p.grid[k + 2]);
      const bool fits = t < kLimit && frame < (Wide{1} << 31);
      if (fits) {
        patches += t * frame;
        frame_sq += t * frame * frame;
      }
      if (!fits || patches >= kLimit || frame_sq >= kLimit) {
        return Status::InvalidArgument(
            std::string(where) + ": its items' encoder work (sum of t*h*w, sum of t*(h*w)^2) "
            "exceeds 2^62");
      }
    }
  }
  return EncoderWork{static_cast<int64_t>(patches), static_cast<int64_t>(frame_sq)};
}

std::vector<int32_t> PlaceMediaItems(std::span<const double> costs, int ranks) {
  std::vector<size_t> order(costs.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return costs[a] > costs[b]; });
  std::vector<double> load(static_cast<size_t>(std::max(ranks, 1)), 0.0);
  std::vector<int32_t> rank(costs.size(), 0);
  for (size_t i : order) {
    const size_t r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    rank[i] = static_cast<int32_t>(r);
    load[r] += costs[i];
  }
  return rank;
}

std::vector<int32_t> PlaceMicrobatchMedia(std::span<const std::vector<MediaItem>> items,
                                          int ranks, const EncoderCost& cost) {
  std::vector<double> costs;
  for (const std::vector<MediaItem>& seq : items) {
    for (const MediaItem& x : seq) costs.push_back(ItemEncoderCost(cost, x.grid));
  }
  return PlaceMediaItems(costs, ranks);
}

std::string_view MropeName(Mrope mrope) {
  switch (mrope) {
    case Mrope::kNone: return "none";
    case Mrope::kQwen2Vl: return "qwen2-vl";
    case Mrope::kQwen25Vl: return "qwen2.5-vl";
  }
  return "none";
}

Result<Mrope> ParseMrope(std::string_view text) {
  for (Mrope m : {Mrope::kNone, Mrope::kQwen2Vl, Mrope::kQwen25Vl}) {
    if (text == MropeName(m)) return m;
  }
  return Status::InvalidArgument("mrope \"" + std::string(text) +
                                 "\" is not one of: none, qwen2-vl, qwen2.5-vl");
}

}  // namespace thdpack
