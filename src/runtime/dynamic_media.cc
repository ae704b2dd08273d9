// Media under the dynamic scheduler (docs/media.md, "Under the dynamic scheduler"): each
// sample's media goes to every head of its group, as its tokens go, but each payload row only to
// the head that encodes its item. Every head places every group's items before the exchange -
// the loaders' samples' item costs all-gathered over the heads (PlaceDynamicMedia), placed as
// PackMedia will place them (PlaceMediaItems over the group's items in plan order) - so each
// loader sends each head its samples' grids and the rows of the items placed there, and each
// head makes the parts whole-sized again with those rows in place (ExpandPlacedPayload); the
// rows it does not encode are never read (PackMedia copies those of the items it encodes).
// Depends on: dynamic_step.cc (HeadBlocks, HeadHolds, group_of_), step_media.cc (MoveMedia),
// step_read.cc (own_).
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/fields.h"
#include "thdpack/media.h"
#include "thdpack/step_wire.h"

namespace thdpack {

namespace {

std::string Num(int64_t v) { return std::to_string(v); }

int64_t RowBytes(const MediaPart& part) {
  return part.width * static_cast<int64_t>(FieldDtypeSize(static_cast<FieldDtype>(part.dtype)));
}

}  // namespace

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::PlaceDynamicMedia(RankStep& out) {
  ProcessGroup& g = *heads_;
  const int cp = topo_.cp_size();
  const size_t gs = static_cast<size_t>(g.size());
  const std::string where = "step " + Num(step_) + ": ";
  // This loader's samples' items and their costs (their media passed CheckSampleMedia as they
  // were read; a failure here still takes part in the sizes' all-gather, and is agreed there).
  std::vector<std::vector<double>> mine;
  Status local;
  own_items_.clear();
  if (reader_) {
    for (const Sample& x : own_) {
      auto items = MediaItemsOf(opts_.media, opts_.spatial_merge_size, x.tokens, x.media,
                                "sample id " + Num(x.id));
      if (!items.ok()) {
        local = items.status();
        mine.clear();
        break;
      }
      std::vector<double>& c = mine.emplace_back();
      for (const MediaItem& it : *items) c.push_back(ItemEncoderCost(*opts_.media_cost, it.grid));
      own_items_.push_back(std::move(*items));
    }
  }
  // Every head's frame: its size first (a size frame each), then the frames.
  const std::vector<uint8_t> frame = EncodeMediaCostsFrame(mine);
  const auto size = EncodeSizeFrame(static_cast<int64_t>(frame.size()));
  std::vector<uint8_t> sizes(gs * kSizeFrameSize);
  THDPACK_RETURN_IF_ERROR(
      g.AllGatherValues(std::span<const uint8_t>(size), std::span<uint8_t>(sizes)));
  std::vector<int64_t> c(gs, 0), dsp(gs, 0);
  for (size_t j = 0; j < gs && local.ok(); ++j) {
    auto got = DecodeSizeFrame(std::span<const uint8_t>(sizes).subspan(j * kSizeFrameSize,
                                                                       kSizeFrameSize),
                               0, int64_t{1} << 40);
    if (!got.ok()) {
      local = got.status().WithContext(where + "media costs' size received from " +
                                       Sender(g, static_cast<int>(j), "head"));
    } else {
      c[j] = *got;
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeIn(g, local, "the media costs' sizes"));
  for (size_t j = 1; j < gs; ++j) dsp[j] = dsp[j - 1] + c[j - 1];
  std::vector<uint8_t> all(static_cast<size_t>(dsp[gs - 1] + c[gs - 1]));
  THDPACK_RETURN_IF_ERROR(g.AllGatherV(std::as_bytes(std::span<const uint8_t>(frame)),
                                       std::as_writable_bytes(std::span<uint8_t>(all)), c, dsp));
  // Each loader's samples are positions loader_offset_[d] .. in its order; other heads send none.
  std::vector<std::vector<double>> costs(out.samples.size());
  for (size_t j = 0; j < gs && local.ok(); ++j) {
    const bool loader = j % static_cast<size_t>(cp) == 0;
    const size_t d = j / static_cast<size_t>(cp);
    const int64_t first = loader ? loader_offset_[d] : 0;
    const int64_t count = loader ? loader_offset_[d + 1] - first : 0;
    auto got = DecodeMediaCostsFrame(
        std::span<const uint8_t>(all).subspan(static_cast<size_t>(dsp[j]),
                                              static_cast<size_t>(c[j])),
        count);
    if (!got.ok()) {
      local = got.status().WithContext(where + "received from " +
                                       Sender(g, static_cast<int>(j), loader ? "loader" : "head"));
      break;
    }
    for (int64_t k = 0; k < count; ++k) {
      costs[static_cast<size_t>(first + k)] = std::move((*got)[static_cast<size_t>(k)]);
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeIn(g, local, "the media costs"));
  // Each group's items over its ranks, in the order PackMedia takes them (the group's samples in
  // plan order, each's items in order).
  item_head_.assign(out.samples.size(), {});
  for (const auto& groups : out.dynamic_plan.microbatches) {
    for (const CpGroup& grp : groups) {
      std::vector<double> flat;
      std::vector<size_t> ps;
      for (int64_t id : grp.sample_ids) {
        const size_t p = static_cast<size_t>(
            position_of_offset_[static_cast<size_t>(id - first_id_)]);
        ps.push_back(p);
        flat.insert(flat.end(), costs[p].begin(), costs[p].end());
      }
      const std::vector<int32_t> rank = PlaceMediaItems(flat, grp.num_ranks);
      size_t k = 0;
      for (size_t p : ps) {
        for (size_t j = 0; j < costs[p].size(); ++j) {
          item_head_[p].push_back(grp.first_rank + rank[k++]);
        }
      }
    }
  }
  return Status::Ok();
}

Status StepRunner::Impl::ExchangeMediaDynamic(RankStep& out) {
  const int me = DomainIndex();
  THDPACK_RETURN_IF_ERROR(PlaceDynamicMedia(out));
  std::vector<std::vector<int64_t>> send_ps, recv_ps;
  HeadBlocks(&send_ps, &recv_ps);
  const bool loader = reader_;
  const int64_t my_begin = loader ? loader_offset_[static_cast<size_t>(coord_.dp)] : 0;
  // What each head gets of each of this loader's samples: its parts with the payload rows of
  // the items placed on that head (whole items, each modality's in its order).
  std::deque<std::vector<MediaPart>> sent;
  std::map<std::pair<size_t, int64_t>, const std::vector<MediaPart>*> sent_of;
  for (size_t e = 0; e < send_ps.size(); ++e) {
    for (int64_t p : send_ps[e]) {
      const Sample& x = own_[static_cast<size_t>(p - my_begin)];
      const std::vector<MediaItem>& items = own_items_[static_cast<size_t>(p - my_begin)];
      std::vector<MediaPart>& parts = sent.emplace_back();
      for (const MediaPart& part : x.media) {
        parts.push_back(MediaPart{part.grid, part.seconds, part.dtype, part.width, {}});
      }
      const std::vector<int32_t>& head = item_head_[static_cast<size_t>(p)];
      for (size_t j = 0; j < items.size(); ++j) {
        if (head[j] != static_cast<int32_t>(e)) continue;
        const MediaItem& it = items[j];
        const MediaPart& from = x.media[static_cast<size_t>(it.modality)];
        const int64_t rb = RowBytes(from);
        const auto* a = from.payload.data() + it.row_begin * rb;
        parts[static_cast<size_t>(it.modality)].payload.insert(
            parts[static_cast<size_t>(it.modality)].payload.end(), a,
            a + it.grid.patches() * rb);
      }
      sent_of[{e, p}] = &parts;
    }
  }
  THDPACK_RETURN_IF_ERROR(MoveMedia(
      *heads_, "head", send_ps, recv_ps, my_begin,
      [&](int64_t p) { return loader && HeadHolds(p, me); }, out,
      [&](int64_t p, size_t e) { return std::span<const MediaPart>(*sent_of.at({e, p})); }));
  for (size_t e = 0; e < recv_ps.size(); ++e) {
    if (static_cast<int>(e) == heads_->rank()) continue;
    for (int64_t p : recv_ps[e]) {
      THDPACK_RETURN_IF_ERROR(ExpandPlacedPayload(
          p, media_recv_[static_cast<size_t>(p)],
          "step " + Num(step_) + ": media received from " +
              Sender(*heads_, static_cast<int>(e), "loader")));
    }
  }
  return Status::Ok();
}

Status StepRunner::Impl::ExpandPlacedPayload(int64_t p, std::vector<MediaPart>& parts,
                                             const std::string& from) {
  const SampleRef& r = refs_[static_cast<size_t>(p)];
  auto items = MediaItemsOf(opts_.media, opts_.spatial_merge_size,
                            std::span<const TokenId>(r.tokens, static_cast<size_t>(r.length)),
                            parts, "sample at position " + Num(p));
  if (!items.ok()) return Status::Corruption(items.status().message()).WithContext(from);
  const std::vector<int32_t>& head = item_head_[static_cast<size_t>(p)];
  if (items->size() != head.size()) {
    return Status::Corruption(from + ": a sample of " + Num(int64_t(items->size())) +
                              " items, its loader placed " + Num(int64_t(head.size())));
  }
  const int32_t me = DomainIndex();
  for (size_t m = 0; m < parts.size(); ++m) {
    MediaPart& part = parts[m];
    const int64_t rb = RowBytes(part);
    int64_t rows = 0, here = 0;
    for (size_t j = 0; j < items->size(); ++j) {
      const MediaItem& it = (*items)[j];
      if (it.modality != static_cast<int32_t>(m)) continue;
      rows += it.grid.patches();
      if (head[j] == me) here += it.grid.patches();
    }
    if (static_cast<int64_t>(part.payload.size()) != here * rb) {
      return Status::Corruption(from + ": '" + opts_.media[m].name + "' payload of " +
                                Num(static_cast<int64_t>(part.payload.size())) +
                                " bytes, the items placed on this head take " + Num(here * rb));
    }
    if (rb == 0 || here == rows) continue;  // nothing to place, or every row is here
    std::vector<std::byte> whole(static_cast<size_t>(rows * rb));
    const std::byte* src = part.payload.data();
    for (size_t j = 0; j < items->size(); ++j) {
      const MediaItem& it = (*items)[j];
      if (it.modality != static_cast<int32_t>(m) || head[j] != me) continue;
      const size_t n = static_cast<size_t>(it.grid.patches() * rb);
      if (n) std::memcpy(whole.data() + it.row_begin * rb, src, n);
      src += n;
    }
    part.payload = std::move(whole);
  }
  return Status::Ok();
}

}  // namespace thdpack
