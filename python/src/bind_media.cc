// python/src/bind_media.cc: media (thdpack/media.h) at the Python edge; conversions only.
//   thdpack._thdpack.media_items(specs, merge, tokens, grids, seconds, where)
//   thdpack._thdpack.mrope_positions(mrope, specs, merge, tokens, grids, seconds,
//                                    tokens_per_second, where)           -> int64 [3, L]
//   thdpack._thdpack.mrope_shard(positions, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank)
//   thdpack._thdpack.media_route(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, sp_size,
//                                sp_rank, modality, items, encoder_rank) -> dict of arrays
//                                (encoder_rank None: placed by the default encoder cost)
//   thdpack._thdpack.place_media_items(costs, ranks)                       -> int32 [n]
//   thdpack._thdpack.media_item_cost(grid, per_patch=None, per_frame_sq=None)
// specs: [(name, token_id, timed)]; grids: per modality, [k, 3] integers; seconds: None or per
// modality a list of floats; items: per sequence, the tuples media_items returns.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "media_py.h"
#include "thdpack/fields.h"
#include "thdpack/media.h"

namespace thdpack::python {
namespace {

std::vector<MediaSpec> SpecsFromPy(const py::handle& specs, int64_t merge) {
  std::vector<MediaSpec> out;
  for (const py::handle& s : specs) {
    const auto t = s.cast<py::tuple>();
    if (t.size() != 3) throw py::value_error("media specs: expected (name, token_id, timed)");
    out.push_back(MediaSpec{t[0].cast<std::string>(), t[1].cast<TokenId>(), t[2].cast<bool>()});
  }
  ThrowIfError(ValidateMediaSpecs(out, merge));
  return out;
}

std::vector<std::vector<MediaGrid>> GridsFromPy(const py::handle& grids,
                                                const std::vector<MediaSpec>& specs,
                                                const std::string& where) {
  std::vector<std::vector<MediaGrid>> out;
  size_t m = 0;
  for (const py::handle& g : grids) {
    const std::string name = where + ": " + (m < specs.size() ? specs[m].name : "media") + " grid";
    std::vector<MediaGrid> items;
    if (!g.is_none()) {
      const HeldSpan<int64_t> flat =
          IntView1D<int64_t>(py::module_::import("numpy").attr("ravel")(g), name);
      if (flat.size() % 3 != 0) {
        throw py::value_error(name + ": " + std::to_string(flat.size()) +
                              " values, expected [k, 3] rows of (t, h, w)");
      }
      for (size_t k = 0; k < flat.size(); k += 3) {
        items.push_back(MediaGrid{flat[k], flat[k + 1], flat[k + 2]});
      }
    }
    out.push_back(std::move(items));
    ++m;
  }
  return out;
}

std::vector<std::vector<double>> SecondsFromPy(const py::handle& seconds) {
  std::vector<std::vector<double>> out;
  if (seconds.is_none()) return out;
  for (const py::handle& s : seconds) {
    out.push_back(s.is_none() ? std::vector<double>() : s.cast<std::vector<double>>());
  }
  return out;
}

std::vector<MediaItem> Items(const py::handle& specs_py, int64_t merge, const py::handle& tokens,
                             const py::handle& grids, const py::handle& seconds,
                             const std::string& where) {
  const std::vector<MediaSpec> specs = SpecsFromPy(specs_py, merge);
  const HeldSpan<TokenId> t = IntView1D<TokenId>(tokens, where + ": input_ids");
  const auto g = GridsFromPy(grids, specs, where);
  const auto s = SecondsFromPy(seconds);
  return ValueOrThrow(SampleMediaItems(specs, merge, t, g, s, where));
}

py::tuple ItemToPy(const MediaItem& x) {
  return py::make_tuple(x.modality, x.index, x.grid.t, x.grid.h, x.grid.w, x.begin, x.tokens,
                        x.row_begin, x.timed, x.seconds);
}

MediaItem ItemFromPy(const py::handle& h) {
  const auto t = h.cast<py::tuple>();
  if (t.size() != 10) throw py::value_error("media item: expected media_items' 10-tuple");
  MediaItem x;
  x.modality = t[0].cast<int32_t>();
  x.index = t[1].cast<int32_t>();
  x.grid = MediaGrid{t[2].cast<int64_t>(), t[3].cast<int64_t>(), t[4].cast<int64_t>()};
  x.begin = t[5].cast<int64_t>();
  x.tokens = t[6].cast<int64_t>();
  x.row_begin = t[7].cast<int64_t>();
  x.timed = t[8].cast<bool>();
  x.seconds = t[9].cast<double>();
  return x;
}

Layout LayoutFromPy(const py::handle& cu, const py::handle& cu_padded) {
  Layout l;
  const HeldSpan<int32_t> a = IntView1D<int32_t>(cu, "cu_seqlens");
  const HeldSpan<int32_t> b = IntView1D<int32_t>(cu_padded, "cu_seqlens_padded");
  l.cu_seqlens.assign(a.begin(), a.end());
  l.cu_seqlens_padded.assign(b.begin(), b.end());
  l.total_tokens = l.cu_seqlens_padded.empty() ? 0 : l.cu_seqlens_padded.back();
  return l;
}

template <typename T>
py::array_t<T> ToArray(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

}  // namespace

Status MediaFromPy(const py::handle& parts, const std::string& where, Sample& s) {
  try {
    for (const py::handle& part : parts) {
      const auto t = part.cast<py::tuple>();
      if (t.size() != 5) throw py::value_error("expected (grid, seconds, dtype, width, payload)");
      MediaPart mp;
      const HeldSpan<int64_t> grid = View1D<int64_t>(py::handle(t[0]), where + " media grid");
      mp.grid.assign(grid.begin(), grid.end());
      if (!t[1].is_none()) mp.seconds = t[1].cast<std::vector<double>>();
      auto dtype = ParseFieldDtype(t[2].cast<std::string>());
      if (!dtype.ok()) return dtype.status().WithContext(where + " media payload");
      mp.dtype = static_cast<uint8_t>(*dtype);
      mp.width = t[3].cast<int64_t>();
      const HeldSpan<uint8_t> bytes = View1D<uint8_t>(py::handle(t[4]), where + " media payload");
      // One pass (a resize would zero the bytes first, touching every page twice).
      const auto* b = reinterpret_cast<const std::byte*>(bytes.data());
      mp.payload.assign(b, b + bytes.size());
      s.media.push_back(std::move(mp));
    }
  } catch (const std::exception& e) {
    return Status::InvalidArgument(where + ": media: " + e.what());
  }
  return Status::Ok();
}

void SetMediaOptions(const py::handle& media, StepRunnerOptions& ro) {
  const auto t = media.cast<py::tuple>();
  if (t.size() != 5) throw py::value_error("media: expected (specs, merge, mrope, tps, cost)");
  for (const py::handle& spec : t[0]) {
    const auto x = spec.cast<py::tuple>();
    ro.media.push_back(
        MediaSpec{x[0].cast<std::string>(), x[1].cast<TokenId>(), x[2].cast<bool>()});
  }
  ro.spatial_merge_size = t[1].cast<int64_t>();
  ro.mrope = ValueOrThrow(ParseMrope(t[2].is_none() ? "none" : t[2].cast<std::string>()));
  ro.mrope_tokens_per_second = t[3].cast<double>();
  if (!t[4].is_none()) {
    const auto c = t[4].cast<std::pair<double, double>>();
    ro.media_cost = EncoderCost{c.first, c.second};
  }
}

py::object MediaToPy(MediaShard& media) {
  if (media.parts.empty()) return py::none();
  py::list parts;
  for (MediaShardPart& p : media.parts) {
    py::dict d;
    // The payload's bytes handed to NumPy without a copy (a fresh copy's page faults are most of
    // what moving a payload costs, docs/media.md "Figures"): the array keeps the vector alive.
    auto* owner = new std::vector<std::byte>(std::move(p.payload));
    py::capsule done(owner, [](void* q) { delete static_cast<std::vector<std::byte>*>(q); });
    d["payload"] = py::array_t<uint8_t>({static_cast<py::ssize_t>(owner->size())}, {1},
                                        reinterpret_cast<const uint8_t*>(owner->data()), done);
    d["dtype"] = std::string(FieldDtypeName(static_cast<FieldDtype>(p.dtype)));
    d["width"] = p.width;
    const int64_t k = static_cast<int64_t>(p.grid.size() / 3);
    d["grid_thw"] = ToNumpy(std::move(p.grid)).reshape({k, int64_t{3}});
    d["output_rows"] = p.output_rows;
    d["token_index"] = ToNumpy(std::move(p.token_index));
    d["recv_index"] = ToNumpy(std::move(p.recv_index));
    d["send_index"] = ToNumpy(std::move(p.send_index));
    d["send_counts"] = ToNumpy(std::move(p.send_counts));
    d["recv_counts"] = ToNumpy(std::move(p.recv_counts));
    parts.append(d);
  }
  return parts;
}

py::object MropeToPy(MediaShard& media) {
  if (media.mrope.empty()) return py::none();
  const int64_t local = static_cast<int64_t>(media.mrope.size() / 3);
  return ToNumpy(std::move(media.mrope)).reshape({int64_t{3}, local});
}

void BindMedia(py::module_& m) {
  m.def("media_items", [](const py::handle& specs, int64_t merge, const py::handle& tokens,
                          const py::handle& grids, const py::handle& seconds,
                          const std::string& where) {
    py::list out;
    for (const MediaItem& x : Items(specs, merge, tokens, grids, seconds, where)) {
      out.append(ItemToPy(x));
    }
    return out;
  });
  m.def("mrope_positions", [](const std::string& mrope, const py::handle& specs, int64_t merge,
                              const py::handle& tokens, const py::handle& grids,
                              const py::handle& seconds, double tokens_per_second,
                              const std::string& where) {
    const Mrope kind = ValueOrThrow(ParseMrope(mrope));
    const std::vector<MediaItem> items = Items(specs, merge, tokens, grids, seconds, where);
    const int64_t L = static_cast<int64_t>(py::len(tokens));
    std::vector<int64_t> pos =
        ValueOrThrow(SampleMropePositions(kind, items, L, merge, tokens_per_second));
    return ToArray(pos).reshape({int64_t{3}, L});
  });
  m.def("mrope_shard", [](const py::list& positions, const py::handle& cu,
                          const py::handle& cu_padded, int cp_size, int cp_rank) {
    std::vector<std::vector<int64_t>> per;
    for (const py::handle& p : positions) {
      const HeldSpan<int64_t> v =
          IntView1D<int64_t>(py::module_::import("numpy").attr("ravel")(p), "positions");
      per.emplace_back(v.begin(), v.end());
    }
    std::vector<int64_t> out =
        ValueOrThrow(MropeShard(per, LayoutFromPy(cu, cu_padded), cp_size, cp_rank));
    const int64_t local = static_cast<int64_t>(out.size() / 3);
    return ToArray(out).reshape({int64_t{3}, local});
  });
  m.def("media_route", [](const py::handle& cu, const py::handle& cu_padded, int cp_size,
                          int cp_rank, int sp_size, int sp_rank, int32_t modality,
                          const py::list& items, const py::handle& encoder_rank) {
    MicrobatchMedia media;
    for (const py::handle& seq : items) {
      std::vector<MediaItem> xs;
      for (const py::handle& x : seq) xs.push_back(ItemFromPy(x));
      media.items.push_back(std::move(xs));
    }
    if (encoder_rank.is_none()) {  // placed by the library, by the default encoder cost
      media.encoder_rank = PlaceMicrobatchMedia(media.items, cp_size, DefaultEncoderCost());
    } else {
      const HeldSpan<int32_t> enc = IntView1D<int32_t>(encoder_rank, "encoder_rank");
      media.encoder_rank.assign(enc.begin(), enc.end());
    }
    const MediaRoute r = ValueOrThrow(RouteMedia(LayoutFromPy(cu, cu_padded), cp_size, cp_rank,
                                                 sp_size, sp_rank, modality, media));
    std::vector<int64_t> grid, encodes;
    for (const MediaGrid& g : r.grids) grid.insert(grid.end(), {g.t, g.h, g.w});
    for (const auto& [i, j] : r.encodes) encodes.insert(encodes.end(), {int64_t{i}, int64_t{j}});
    py::dict d;
    d["encodes"] = ToArray(encodes).reshape({static_cast<int64_t>(r.encodes.size()), int64_t{2}});
    d["grid_thw"] = ToArray(grid).reshape({static_cast<int64_t>(r.grids.size()), int64_t{3}});
    d["encoder_rank"] = ToArray(media.encoder_rank);
    d["payload_rows"] = r.payload_rows;
    d["output_rows"] = r.output_rows;
    d["token_index"] = ToArray(r.token_index);
    d["send_index"] = ToArray(r.send_index);
    d["send_counts"] = ToArray(r.send_counts);
    d["recv_counts"] = ToArray(r.recv_counts);
    d["recv_index"] = ToArray(r.recv_index);
    return d;
  });
  m.def("place_media_items", [](const py::handle& costs, int ranks) {
    if (ranks < 1) throw py::value_error("ranks = " + std::to_string(ranks) + ": must be >= 1");
    const HeldSpan<double> c = DoubleView1D(costs, "costs");
    for (size_t i = 0; i < c.size(); ++i) {
      if (!(c[i] >= 0) || c[i] > 1e300) {
        throw py::value_error("costs[" + std::to_string(i) + "] = " + std::to_string(c[i]) +
                              ": must be finite and >= 0");
      }
    }
    return ToArray(PlaceMediaItems(c, ranks));
  });
  m.def("media_item_cost", [](const std::vector<int64_t>& grid, py::object per_patch,
                              py::object per_frame_sq) {
    if (grid.size() != 3) throw py::value_error("grid: expected (t, h, w)");
    EncoderCost c = DefaultEncoderCost();
    if (!per_patch.is_none()) c.per_patch = per_patch.cast<double>();
    if (!per_frame_sq.is_none()) c.per_frame_sq = per_frame_sq.cast<double>();
    return ItemEncoderCost(c, MediaGrid{grid[0], grid[1], grid[2]});
  }, py::arg("grid"), py::arg("per_patch") = py::none(), py::arg("per_frame_sq") = py::none());
}

}  // namespace thdpack::python
