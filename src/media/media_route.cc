// Routing encoder output rows to the tokens that take them (thdpack/media.h): RouteMedia works
// out, from the microbatch's layout and its items' placement, where each placeholder token of a
// modality sits after the CP zigzag and the SP split (OwnerOf, arithmetic on the offsets), and
// the tables of the all-to-all that brings each encoder output row there. RouteMediaReference is
// the plain rule: the whole [T] array of placeholders, gathered by CpPartitionIndices.
#include <algorithm>
#include <string>

#include "thdpack/media.h"
#include "thdpack/shard.h"

namespace thdpack {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

struct Where {
  int32_t cp = 0, sp = 0;
  int64_t local = 0;  // position in the SP part of the CP shard
};

// The checks RouteMedia and its reference share: the layout against CP and SP, and every item
// inside its sequence's real tokens, with an encoder rank.
Status CheckMicrobatch(const Layout& layout, int cp_size, int sp_size,
                       const MicrobatchMedia& media) {
  if (cp_size < 1 || sp_size < 1) {
    return Status::InvalidArgument("RouteMedia: cp_size = " + Str(cp_size) + ", sp_size = " +
                                   Str(sp_size) + ": both must be >= 1");
  }
  THDPACK_RETURN_IF_ERROR(ValidateCuSeqlensPadded(layout.cu_seqlens_padded, cp_size));
  const size_t n = layout.cu_seqlens_padded.size() - 1;
  if (layout.cu_seqlens.size() != n + 1 || media.items.size() != n) {
    return Status::InvalidArgument(
        "RouteMedia: the media of " + Str(static_cast<int64_t>(media.items.size())) +
        " sequences, the layout has " + Str(static_cast<int64_t>(n)));
  }
  const int64_t T = layout.cu_seqlens_padded[n];
  if ((T / cp_size) % sp_size != 0) {
    return Status::InvalidArgument("RouteMedia: T/CP = " + Str(T / cp_size) +
                                   " is not divisible by SP " + Str(sp_size));
  }
  size_t flat = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t real = layout.cu_seqlens[i + 1] - layout.cu_seqlens[i];
    for (const MediaItem& x : media.items[i]) {
      if (x.begin < 0 || x.tokens < 0 || x.begin + x.tokens > real) {
        return Status::InvalidArgument(
            "RouteMedia: sequence " + Str(static_cast<int64_t>(i)) + ": an item's tokens [" +
            Str(x.begin) + ", " + Str(x.begin + x.tokens) + ") lie outside its " + Str(real) +
            " real tokens");
      }
      ++flat;
    }
  }
  if (media.encoder_rank.size() != flat) {
    return Status::InvalidArgument("RouteMedia: encoder ranks for " +
                                   Str(static_cast<int64_t>(media.encoder_rank.size())) +
                                   " items, the microbatch has " + Str(static_cast<int64_t>(flat)));
  }
  for (size_t k = 0; k < flat; ++k) {
    if (media.encoder_rank[k] < 0 || media.encoder_rank[k] >= cp_size) {
      return Status::InvalidArgument("RouteMedia: item " + Str(static_cast<int64_t>(k)) +
                                     " has encoder rank " + Str(media.encoder_rank[k]) +
                                     ", not in [0, " + Str(cp_size) + ")");
    }
  }
  return Status::Ok();
}

// Where packed position `offset` of sequence i sits: the zigzag of shard.h (chunk c < CP on
// rank c, its mirror 2CP-1-c on rank 2CP-1-c, after the rank's first chunk), then the SP part.
Where OwnerOf(const Layout& layout, int cp_size, int sp_size, size_t i, int64_t offset) {
  const int64_t begin = layout.cu_seqlens_padded[i];
  const int64_t P = layout.cu_seqlens_padded[i + 1] - begin;
  int64_t cp = 0, local = 0;
  if (cp_size == 1) {
    local = begin + offset;
  } else {
    const int64_t chunk = P / (2 * cp_size);
    const int64_t c = offset / chunk;
    const int64_t base = begin / cp_size;
    if (c < cp_size) {
      cp = c;
      local = base + (offset - c * chunk);
    } else {
      cp = 2 * cp_size - 1 - c;
      local = base + chunk + (offset - c * chunk);
    }
  }
  const int64_t part = layout.cu_seqlens_padded.back() / cp_size / sp_size;
  return Where{static_cast<int32_t>(cp), static_cast<int32_t>(local / part), local % part};
}

}  // namespace

Result<MediaRoute> RouteMedia(const Layout& layout, int cp_size, int cp_rank, int sp_size,
                              int sp_rank, int32_t modality, const MicrobatchMedia& media) {
  THDPACK_RETURN_IF_ERROR(CheckMicrobatch(layout, cp_size, sp_size, media));
  if (cp_rank < 0 || cp_rank >= cp_size || sp_rank < 0 || sp_rank >= sp_size) {
    return Status::InvalidArgument("RouteMedia: rank (cp " + Str(cp_rank) + ", sp " +
                                   Str(sp_rank) + ") outside CP " + Str(cp_size) + " x SP " +
                                   Str(sp_size));
  }
  MediaRoute route;
  route.send_counts.assign(static_cast<size_t>(cp_size), 0);
  route.recv_counts.assign(static_cast<size_t>(cp_size), 0);
  struct Row {
    Where to;
    int32_t from = 0;       // encoder CP rank
    int64_t out_row = -1;   // its row of the encoder's output on `from`
  };
  std::vector<Row> mine;    // the rows this rank sends
  std::vector<Row> taken;   // the rows this rank receives
  std::vector<int64_t> out_rows(static_cast<size_t>(cp_size), 0);
  size_t flat = 0;
  for (size_t i = 0; i < media.items.size(); ++i) {
    for (size_t j = 0; j < media.items[i].size(); ++j, ++flat) {
      const MediaItem& x = media.items[i][j];
      const int32_t enc = media.encoder_rank[flat];
      if (x.modality != modality) continue;
      const int64_t first = out_rows[static_cast<size_t>(enc)];
      out_rows[static_cast<size_t>(enc)] += x.tokens;
      if (enc == cp_rank) {
        route.encodes.emplace_back(static_cast<int32_t>(i), static_cast<int32_t>(j));
        route.grids.push_back(x.grid);
        route.payload_rows += x.grid.patches();
        route.output_rows += x.tokens;
      }
      for (int64_t k = 0; k < x.tokens; ++k) {
        const Where to = OwnerOf(layout, cp_size, sp_size, i, x.begin + k);
        const Row r{to, enc, first + k};
        if (enc == cp_rank && to.sp == sp_rank) mine.push_back(r);
        if (to.cp == cp_rank && to.sp == sp_rank) taken.push_back(r);
      }
    }
  }
  // Sent by destination rank, then destination position: each block arrives in position order.
  std::stable_sort(mine.begin(), mine.end(), [](const Row& a, const Row& b) {
    return a.to.cp != b.to.cp ? a.to.cp < b.to.cp : a.to.local < b.to.local;
  });
  for (const Row& r : mine) {
    route.send_index.push_back(r.out_row);
    ++route.send_counts[static_cast<size_t>(r.to.cp)];
  }
  // Received: blocks in source order, each in position order; token_index ascending.
  std::vector<int64_t> block(static_cast<size_t>(cp_size) + 1, 0);
  for (const Row& r : taken) ++route.recv_counts[static_cast<size_t>(r.from)];
  for (int c = 0; c < cp_size; ++c) {
    block[static_cast<size_t>(c) + 1] = block[static_cast<size_t>(c)] +
                                        route.recv_counts[static_cast<size_t>(c)];
  }
  std::stable_sort(taken.begin(), taken.end(),
                   [](const Row& a, const Row& b) { return a.to.local < b.to.local; });
  std::vector<int64_t> seen(static_cast<size_t>(cp_size), 0);
  for (const Row& r : taken) {  // ascending: within a block, the k-th seen is the k-th sent
    route.token_index.push_back(r.to.local);
    route.recv_index.push_back(block[static_cast<size_t>(r.from)] +
                               seen[static_cast<size_t>(r.from)]++);
  }
  return route;
}

Result<std::vector<std::vector<MediaSlot>>> RouteMediaReference(
    const Layout& layout, int cp_size, int sp_size, int32_t modality,
    const MicrobatchMedia& media) {
  THDPACK_RETURN_IF_ERROR(CheckMicrobatch(layout, cp_size, sp_size, media));
  const size_t n = layout.cu_seqlens_padded.size() - 1;
  const int64_t T = layout.cu_seqlens_padded[n];
  std::vector<std::pair<int64_t, int64_t>> whole(static_cast<size_t>(T), {-1, -1});
  int64_t flat = 0;
  for (size_t i = 0; i < n; ++i) {
    for (const MediaItem& x : media.items[i]) {
      if (x.modality == modality) {
        for (int64_t k = 0; k < x.tokens; ++k) {
          whole[static_cast<size_t>(layout.cu_seqlens_padded[i] + x.begin + k)] = {flat, k};
        }
      }
      ++flat;
    }
  }
  std::vector<std::vector<MediaSlot>> out(static_cast<size_t>(cp_size * sp_size));
  const int64_t part = T / cp_size / sp_size;
  for (int c = 0; c < cp_size; ++c) {
    THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> idx,
                             CpPartitionIndices(layout.cu_seqlens_padded, cp_size, c));
    for (size_t k = 0; k < idx.size(); ++k) {
      const auto& e = whole[static_cast<size_t>(idx[k])];
      if (e.first < 0) continue;
      const int64_t local = static_cast<int64_t>(k);
      out[static_cast<size_t>(c * sp_size + local / part)].push_back(
          MediaSlot{local % part, e.first, e.second});
    }
  }
  return out;
}

}  // namespace thdpack
