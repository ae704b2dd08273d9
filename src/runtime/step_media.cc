// Media through the step (docs/media.md; thdpack/media.h): the samples' images and videos move
// with their samples and reach the rank that encodes them. Three parts, each inside a phase of
// step_runner.cc:
//   exchange (ExchangeMedia, after ExchangeTokens): each sample's media to the loader of the
//     replica the plan chose, over the same pairs as its tokens - a size frame to each loader,
//     then one all-to-all-v of kMedia frames (thdpack/step_wire.h), each checked on arrival;
//   pack (PackMedia, per microbatch): its items checked against their tokens (CheckSampleMedia),
//     placed whole on its CP ranks by the encoder's cost (PlaceMicrobatchMedia), and each
//     first-stage rank's MediaShard made: the payload rows it encodes, their route
//     (RouteMedia) and its shard's mRoPE positions;
//   deliver (DeliverMedia, once every rank holds its shards): each first-stage member of the
//     replica gets a size frame (agreed over the replica), then its MediaShards of the step in
//     one kMedia frame, checked on arrival.
// Depends on: step_exchange.cc (the exchange's pairs, refs_), step_plan.cc (replica_of_),
// step_read.cc (own_).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/step_wire.h"

namespace thdpack {

namespace {

// Message tags of the media delivery (the shards' are 1-4 and 16 + field).
constexpr int kTagMediaSize = 5;
constexpr int kTagMedia = 6;

std::string Num(int64_t v) { return std::to_string(v); }

}  // namespace

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::CheckMediaOptions() const {
  if (opts_.media.empty()) {
    if (opts_.mrope != Mrope::kNone) {
      return Status::InvalidArgument("StepRunner: mrope '" + std::string(MropeName(opts_.mrope)) +
                                     "' needs media (declare the modalities)");
    }
    return Status::Ok();
  }
  THDPACK_RETURN_IF_ERROR(
      ValidateMediaSpecs(opts_.media, opts_.spatial_merge_size).WithContext("StepRunner"));
  const std::string first = "StepRunner: media ('" + opts_.media[0].name + "', ...) ";
  if (!opts_.read_share) {
    return Status::InvalidArgument(first + "with samples from '" + opts_.data +
                                   "': only a source fed by the caller carries media");
  }
  if (opts_.data_on != DataOn::kTp0) {
    return Status::InvalidArgument(first + "with data on every rank: media moves from the "
                                   "loaders, data_on must be tp0");
  }
  if (opts_.schedule.oversize == ScheduleOptions::OversizePolicy::kTruncate) {
    return Status::InvalidArgument(first + "with oversize 'truncate': cutting a sample would "
                                   "cut an item's placeholder tokens (use 'error' or 'skip')");
  }
  if (!(opts_.mrope_tokens_per_second > 0)) {
    return Status::InvalidArgument("StepRunner: mrope_tokens_per_second = " +
                                   std::to_string(opts_.mrope_tokens_per_second) +
                                   ": must be > 0");
  }
  if (opts_.media_cost.has_value()) {
    const EncoderCost& c = *opts_.media_cost;
    if (!std::isfinite(c.per_patch) || !std::isfinite(c.per_frame_sq) || c.per_patch < 0 ||
        c.per_frame_sq < 0 || c.empty()) {
      return Status::InvalidArgument(
          "StepRunner: media_cost (" + std::to_string(c.per_patch) + ", " +
          std::to_string(c.per_frame_sq) + "): the encoder's terms (per patch, per frame^2) "
          "must be finite, >= 0 and not both 0 (they place each microbatch's items)");
    }
  } else if (opts_.schedule.cost.unit != "FLOPs" && !opts_.schedule.cost.encoder.has_value()) {
    return Status::InvalidArgument(
        first + "with cost '" + opts_.schedule.cost.name + "' (unit: " +
        (opts_.schedule.cost.unit.empty() ? std::string("its own") : opts_.schedule.cost.unit) +
        "): the encoder's default term (Qwen2-VL's vision tower) is in training FLOPs; give "
        "media_cost (per patch, per frame^2) in the cost's unit, a measured profile with an "
        "encoder term (thdpack.torch.calibrate_encoder), or a model cost (llama2-7b, "
        "dimensions)");
  }
  return Status::Ok();
}

Status StepRunner::Impl::ExchangeMedia(RankStep& out) {
  const int dp = topo_.dp_size();
  const int me = coord_.dp;
  std::vector<std::vector<int64_t>> send_ps(static_cast<size_t>(dp)), recv_ps(send_ps);
  for (int e = 0; e < dp; ++e) {
    if (e == me) continue;
    send_ps[static_cast<size_t>(e)] = LoaderBlock(me, e);
    recv_ps[static_cast<size_t>(e)] = LoaderBlock(e, me);
  }
  return MoveMedia(*loaders_, "loader", send_ps, recv_ps,
                   loader_offset_[static_cast<size_t>(me)],
                   [&](int64_t p) { return replica_of_[static_cast<size_t>(p)] == me; }, out);
}

Status StepRunner::Impl::MoveMedia(ProcessGroup& g, const char* role,
                                   const std::vector<std::vector<int64_t>>& send_ps,
                                   const std::vector<std::vector<int64_t>>& recv_ps,
                                   int64_t my_begin, const std::function<bool(int64_t)>& keeps,
                                   RankStep& out, const PartsOf& parts_of) {
  const size_t n = static_cast<size_t>(g.size());
  const auto& samples = out.samples;
  auto parts = [&](int64_t p, size_t e) -> std::span<const MediaPart> {
    return parts_of ? parts_of(p, e) : std::span<const MediaPart>(
                                           own_[static_cast<size_t>(p - my_begin)].media);
  };
  // The blocks: each sample's media (EncodeSampleMedia) back to back, one kMedia frame a
  // receiver, encoded in place in the send buffer.
  std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  for (size_t e = 0; e < n; ++e) {
    if (send_ps[e].empty()) continue;
    size_t bytes = kFrameTrailerSize;
    for (int64_t p : send_ps[e]) bytes += SampleMediaBytes(parts(p, e));
    sc[e] = static_cast<int64_t>(bytes);
  }
  for (size_t j = 1; j < n; ++j) sd[j] = sd[j - 1] + sc[j - 1];
  std::vector<std::byte> send(static_cast<size_t>(sd[n - 1] + sc[n - 1]));
  for (size_t e = 0; e < n; ++e) {
    if (sc[e] == 0) continue;
    auto* block = reinterpret_cast<uint8_t*>(send.data() + sd[e]);
    uint8_t* dst = block;
    for (int64_t p : send_ps[e]) dst = EncodeSampleMedia(parts(p, e), dst);
    SealFrame(FrameKind::kMedia, std::span<uint8_t>(block, static_cast<size_t>(sc[e])));
  }
  // Their sizes first, each in a size frame, so that every receiver knows what comes.
  std::vector<std::byte> sizes_out(n * kSizeFrameSize), sizes_in(n * kSizeFrameSize);
  std::vector<int64_t> fixed(n, static_cast<int64_t>(kSizeFrameSize)), at(n, 0);
  for (size_t e = 0; e < n; ++e) {
    at[e] = static_cast<int64_t>(e * kSizeFrameSize);
    const auto frame = EncodeSizeFrame(sc[e]);
    std::memcpy(sizes_out.data() + at[e], frame.data(), kSizeFrameSize);
  }
  THDPACK_RETURN_IF_ERROR(g.AllToAllV(sizes_out, fixed, at, sizes_in, fixed, at));
  Status sizes;
  for (size_t e = 0; e < n && sizes.ok(); ++e) {
    auto size = DecodeSizeFrame(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(sizes_in.data() + at[e]),
                                 kSizeFrameSize),
        0, int64_t{1} << 40);
    if (!size.ok()) {
      sizes = size.status().WithContext("step " + Num(step_) + ": media sizes received from " +
                                        Sender(g, static_cast<int>(e), role));
    } else {
      rc[e] = static_cast<int>(e) == g.rank() ? 0 : *size;
    }
  }
  // Nobody sizes the data by a damaged size: agreed over the group first.
  THDPACK_RETURN_IF_ERROR(AgreeIn(g, sizes, "the media sizes"));
  for (size_t j = 1; j < n; ++j) rd[j] = rd[j - 1] + rc[j - 1];
  std::vector<std::byte> recv(static_cast<size_t>(rd[n - 1] + rc[n - 1]));
  THDPACK_RETURN_IF_ERROR(g.AllToAllV(send, sc, sd, recv, rc, rd));
  // Where each sample this member packs has its media: its own, or decoded from a block.
  media_recv_.assign(samples.size(), {});
  media_of_.assign(samples.size(), nullptr);
  for (size_t k = 0; k < own_.size(); ++k) {
    const int64_t p = my_begin + static_cast<int64_t>(k);
    if (keeps(p)) media_of_[static_cast<size_t>(p)] = &own_[k].media;
  }
  for (size_t e = 0; e < n; ++e) {
    if (static_cast<int>(e) == g.rank()) continue;
    const std::vector<int64_t>& ps = recv_ps[e];
    const std::string from = "step " + Num(step_) + ": media received from " +
                             Sender(g, static_cast<int>(e), role);
    if (ps.empty()) {
      if (rc[e] != 0) return Status::Corruption(from + ": " + Num(rc[e]) + " bytes unasked");
      continue;
    }
    auto body = OpenFrame(std::span<const uint8_t>(
                              reinterpret_cast<const uint8_t*>(recv.data() + rd[e]),
                              static_cast<size_t>(rc[e])),
                          FrameKind::kMedia);
    if (!body.ok()) return body.status().WithContext(from);
    size_t off = 0;
    for (int64_t p : ps) {
      auto parts = DecodeSampleMedia(*body, opts_.media.size(), &off);
      if (!parts.ok()) return parts.status().WithContext(from);
      media_recv_[static_cast<size_t>(p)] = std::move(*parts);
      media_of_[static_cast<size_t>(p)] = &media_recv_[static_cast<size_t>(p)];
    }
    if (off != body->size()) {
      return Status::Corruption(from + ": " + Num(static_cast<int64_t>(body->size() - off)) +
                                " bytes left over");
    }
  }
  return Status::Ok();
}

Status StepRunner::Impl::PackMedia(RankStep& out, size_t m, std::span<const int64_t> ps,
                                   const Layout& layout, int cp, int only_c) {
  const int tp = topo_.tp_size();
  // The figures' per-rank detail: a static step's loader makes every CP rank's part.
  const bool figures = only_c < 0 && m < out.media_rank_cost.size();
  const bool sp = opts_.schedule.parallel.splits_over_tp();
  const size_t nm = opts_.media.size();
  MicrobatchMedia mm;
  std::vector<std::vector<int64_t>> mrope;
  for (size_t i = 0; i < ps.size(); ++i) {
    const size_t p = static_cast<size_t>(ps[i]);
    const SampleRef& r = refs_[p];
    const std::string where = "sample id " + Num(out.samples[p].id) + " (step " + Num(step_) + ")";
    if (media_of_[p] == nullptr) return Status::Internal(where + ": its media did not arrive");
    THDPACK_ASSIGN_OR_RETURN(
        std::vector<MediaItem> items,
        CheckSampleMedia(opts_.media, opts_.spatial_merge_size,
                         std::span<const TokenId>(r.tokens, static_cast<size_t>(r.length)),
                         *media_of_[p], where));
    if (opts_.mrope != Mrope::kNone) {
      THDPACK_ASSIGN_OR_RETURN(std::vector<int64_t> pos,
                               SampleMropePositions(opts_.mrope, items, r.length,
                                                    opts_.spatial_merge_size,
                                                    opts_.mrope_tokens_per_second));
      mrope.push_back(std::move(pos));
    }
    mm.items.push_back(std::move(items));
  }
  // The encoder's term that places (Create resolved it; under the dynamic scheduler it places
  // only, the schedulers' term being refused there).
  const EncoderCost& term = *opts_.media_cost;
  mm.encoder_rank = PlaceMicrobatchMedia(mm.items, cp, term);
  if (figures) {  // each CP rank's encoder cost, for the step's figures
    std::vector<double>& cost = out.media_rank_cost[m];
    cost.assign(static_cast<size_t>(cp), 0.0);
    size_t k = 0;
    for (const auto& seq : mm.items) {
      for (const MediaItem& x : seq) {
        cost[static_cast<size_t>(mm.encoder_rank[k++])] += ItemEncoderCost(term, x.grid);
      }
    }
  }
  // Each modality's payload dtype and width: that of the microbatch's first sample that gives a
  // payload of it; every other must match (a payload of another dtype or width is named).
  std::vector<const MediaPart*> like(nm, nullptr);
  std::vector<int64_t> like_id(nm, 0);
  for (size_t i = 0; i < ps.size(); ++i) {
    const size_t p = static_cast<size_t>(ps[i]);
    for (size_t k = 0; k < nm; ++k) {
      const MediaPart& part = (*media_of_[p])[k];
      if (part.width == 0) continue;  // no payload given (an empty one still says its form)
      if (like[k] == nullptr) {
        like[k] = &part;
        like_id[k] = out.samples[p].id;
      } else if (part.dtype != like[k]->dtype || part.width != like[k]->width) {
        auto text = [](const MediaPart& x) {
          return std::string(FieldDtypeName(static_cast<FieldDtype>(x.dtype))) + " rows of " +
                 Num(x.width);
        };
        return Status::InvalidArgument(
            "sample id " + Num(out.samples[p].id) + ": '" + opts_.media[k].name + "' payload of " +
            text(part) + ", sample id " + Num(like_id[k]) + " of the same microbatch has " +
            text(*like[k]) + " (every payload of a modality: one dtype and width)");
      }
    }
  }
  // Every CP rank's parts at [c * TP + t], or (only_c, a dynamic step's head) its own at [t].
  auto& dest = media_shards_[m];
  dest.assign(static_cast<size_t>((only_c < 0 ? cp : 1) * tp), MediaShard{});
  for (int c = only_c < 0 ? 0 : only_c; c < (only_c < 0 ? cp : only_c + 1); ++c) {
    const int row = only_c < 0 ? c : 0;
    for (int t = 0; t < (sp ? tp : 1); ++t) {
      MediaShard sh;
      for (size_t k = 0; k < nm; ++k) {
        THDPACK_ASSIGN_OR_RETURN(MediaRoute route,
                                 RouteMedia(layout, cp, c, sp ? tp : 1, sp ? t : 0,
                                            static_cast<int32_t>(k), mm));
        MediaShardPart part;
        if (like[k] != nullptr) {
          part.dtype = like[k]->dtype;
          part.width = like[k]->width;
        }
        const size_t row_bytes =
            static_cast<size_t>(part.width) * FieldDtypeSize(static_cast<FieldDtype>(part.dtype));
        // Sized once: growing by insert would copy (and fault in) the rows again at each doubling.
        part.payload.reserve(static_cast<size_t>(route.payload_rows) * row_bytes);
        part.grid.reserve(3 * route.encodes.size());
        for (const auto& [i, j] : route.encodes) {
          const MediaItem& x = mm.items[static_cast<size_t>(i)][static_cast<size_t>(j)];
          part.grid.insert(part.grid.end(), {x.grid.t, x.grid.h, x.grid.w});
          const MediaPart& src = (*media_of_[static_cast<size_t>(ps[static_cast<size_t>(i)])])[k];
          const size_t a = static_cast<size_t>(x.row_begin) * row_bytes;
          const size_t b = a + static_cast<size_t>(x.grid.patches()) * row_bytes;
          part.payload.insert(part.payload.end(), src.payload.begin() + static_cast<ptrdiff_t>(a),
                              src.payload.begin() + static_cast<ptrdiff_t>(b));
        }
        part.output_rows = route.output_rows;
        part.token_index = std::move(route.token_index);
        part.recv_index = std::move(route.recv_index);
        part.send_index = std::move(route.send_index);
        part.send_counts = std::move(route.send_counts);
        part.recv_counts = std::move(route.recv_counts);
        sh.parts.push_back(std::move(part));
      }
      if (opts_.mrope != Mrope::kNone) {
        THDPACK_ASSIGN_OR_RETURN(sh.mrope, MropeShard(mrope, layout, cp, c));
      }
      dest[static_cast<size_t>(row * tp + t)] = std::move(sh);
    }
    for (int t = 1; !sp && t < tp; ++t) {  // without SP every TP rank gets TP rank 0's
      dest[static_cast<size_t>(row * tp + t)] = dest[static_cast<size_t>(row * tp)];
    }
    if (!figures) continue;
    int64_t bytes = 0;  // every TP rank of c encodes the same items: TP rank 0's payload
    for (const MediaShardPart& part : dest[static_cast<size_t>(c * tp)].parts) {
      bytes += static_cast<int64_t>(part.payload.size());
    }
    out.media_rank_bytes[m].push_back(bytes);
  }
  return Status::Ok();
}

Status StepRunner::Impl::DeliverMedia(RankStep& out, ProcessGroup& g, bool column) {
  // Every rank of the world is here (Deliver's `then`), its shards good. The loader (a dynamic
  // step's head) sends each first-stage member of its replica (column) a size frame, agreed over
  // the group, then the frame.
  const size_t mbs = out.meta.microbatches.size();
  const int tp = topo_.tp_size();
  media_local_.assign(mbs, MediaShard{});
  const bool loader = g.rank() == 0;
  // (member, frame, its bytes), the loader's; each frame written whole into an uninitialised
  // buffer (EncodeMediaFrameInto), not a zeroed vector.
  std::vector<std::tuple<int, std::unique_ptr<uint8_t[]>, size_t>> frames;
  Status sizes;
  std::vector<uint8_t> size(kSizeFrameSize);
  // The frame's buffer, left uninitialised (the receive writes every byte; a zeroed vector
  // would touch its pages twice).
  std::unique_ptr<uint8_t[]> frame;
  size_t frame_bytes = 0;
  const std::string from = "step " + Num(step_) + ": media received from " +
                           Sender(g, 0, column ? "the head" : "the loader");
  if (loader) {
    for (int j = 1; j < g.size(); ++j) {
      THDPACK_ASSIGN_OR_RETURN(Coord c, topo_.CoordOf(g.ranks()[static_cast<size_t>(j)]));
      if (c.pp != 0) continue;
      std::vector<MediaShard> mine(mbs);  // each member's part is sent once: moved, not copied
      // A static step's loader holds every CP rank's parts, a head its own CP rank's (none in
      // a microbatch where it is idle).
      const size_t at = static_cast<size_t>(column ? c.tp : c.cp * tp + c.tp);
      for (size_t m = 0; m < mbs; ++m) {
        if (at < media_shards_[m].size()) mine[m] = std::move(media_shards_[m][at]);
      }
      const size_t n = MediaFrameBytes(mine);
      std::unique_ptr<uint8_t[]> buffer(new uint8_t[n]);
      EncodeMediaFrameInto(mine, std::span<uint8_t>(buffer.get(), n));
      frames.emplace_back(j, std::move(buffer), n);
      const auto s = EncodeSizeFrame(static_cast<int64_t>(n));
      THDPACK_RETURN_IF_ERROR(
          g.SendValues(std::span<const uint8_t>(s.data(), s.size()), j, kTagMediaSize));
    }
  } else if (coord_.pp == 0) {
    THDPACK_RETURN_IF_ERROR(g.RecvValues(std::span<uint8_t>(size), 0, kTagMediaSize));
    auto bytes = DecodeSizeFrame(size, static_cast<int64_t>(8 + kFrameTrailerSize),
                                 int64_t{1} << 40);
    if (!bytes.ok()) {
      sizes = bytes.status().WithContext(from);
    } else {
      frame_bytes = static_cast<size_t>(*bytes);
      frame.reset(new uint8_t[frame_bytes]);
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeIn(g, sizes, "the media sizes"));
  if (loader) {
    for (const auto& [j, buffer, n] : frames) {
      THDPACK_RETURN_IF_ERROR(
          g.SendValues(std::span<const uint8_t>(buffer.get(), n), j, kTagMedia));
    }
    for (size_t m = 0; m < mbs; ++m) {
      if (!media_shards_[m].empty()) media_local_[m] = std::move(media_shards_[m][0]);
    }
    media_shards_.clear();
    return Status::Ok();
  }
  if (coord_.pp != 0) return Status::Ok();
  THDPACK_RETURN_IF_ERROR(
      g.RecvValues(std::span<uint8_t>(frame.get(), frame_bytes), 0, kTagMedia));
  auto shards = DecodeMediaFrame(std::span<const uint8_t>(frame.get(), frame_bytes),
                                 opts_.media.size());
  if (!shards.ok()) return shards.status().WithContext(from);
  if (shards->size() != mbs) {
    return Status::Corruption(from + ": media of " + Num(static_cast<int64_t>(shards->size())) +
                              " microbatches, the step has " + Num(static_cast<int64_t>(mbs)));
  }
  media_local_ = std::move(*shards);
  return Status::Ok();
}

}  // namespace thdpack
