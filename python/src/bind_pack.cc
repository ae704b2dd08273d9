// python/src/bind_pack.cc: THD packing (pack.h). Outputs use the dtypes of docs/design.md section 5
// at the Python edge: tokens, labels, position_ids int64; loss_mask float32; cu_seqlens int32.
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/pack.h"

namespace thdpack::python {
namespace {

// The samples of a pack call as SampleViews. Token arrays of any integer dtype and masks of
// any 0/1 dtype (common.h: IntView1D, MaskView1D): int32 tokens and bool/uint8 masks are viewed
// in place, others converted. Token values are checked by Pack itself, the same way for every
// dtype.
struct SampleArgs {
  std::vector<SampleView> views;
  std::vector<HeldSpan<TokenId>> tokens;  // alive for the call
  std::vector<HeldSpan<uint8_t>> masks;
};

SampleArgs ReadSamples(const py::object& samples_obj, const py::object& target_masks,
                       const py::object& ids) {
  SampleArgs out;
  if (!py::isinstance<py::sequence>(samples_obj) || py::isinstance<py::str>(samples_obj)) {
    throw py::value_error("samples: expected a list of token arrays, got " +
                          std::string(py::str(py::type::of(samples_obj).attr("__name__"))));
  }
  const py::sequence samples = samples_obj.cast<py::sequence>();
  const size_t n = py::len(samples);
  if (n == 0) throw py::value_error("samples: empty list; a microbatch holds at least one sample");
  py::sequence masks;
  if (!target_masks.is_none()) {
    if (!py::isinstance<py::sequence>(target_masks) || py::isinstance<py::str>(target_masks)) {
      throw py::value_error("target_masks: expected None or a list with one mask (or None) per "
                            "sample, got " +
                            std::string(py::str(py::type::of(target_masks).attr("__name__"))));
    }
    masks = target_masks.cast<py::sequence>();
    if (py::len(masks) != n) {
      throw py::value_error("target_masks: has " + std::to_string(py::len(masks)) +
                            " entries, samples has " + std::to_string(n) +
                            ": one per sample (None for all ones) expected");
    }
  }
  std::vector<int64_t> id_values(n);
  for (size_t i = 0; i < n; ++i) id_values[i] = static_cast<int64_t>(i);
  if (!ids.is_none()) {
    auto s = IntView1D<int64_t>(ids, "ids");
    if (s.size() != n) {
      throw py::value_error("ids: has " + std::to_string(s.size()) + " entries, samples has " +
                            std::to_string(n));
    }
    for (size_t i = 0; i < n; ++i) id_values[i] = s[i];
  }
  out.views.resize(n);
  out.tokens.reserve(n);
  out.masks.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.tokens.push_back(IntView1D<TokenId>(samples[i], "samples[" + std::to_string(i) + "]"));
    std::span<const uint8_t> mask;
    if (!target_masks.is_none() && !masks[i].is_none()) {
      out.masks.push_back(MaskView1D(masks[i], "target_masks[" + std::to_string(i) + "]"));
      mask = out.masks.back();
    }
    out.views[i] = SampleView(id_values[i], out.tokens.back(), mask);
  }
  return out;
}

PackOptions MakeOptions(int cp_size, int tp_size, bool sp, int64_t pad_id,
                        int64_t extra_alignment) {
  PackOptions o;
  o.parallel = MakeLayout(cp_size, tp_size, sp, extra_alignment);
  if (pad_id < 0 || pad_id > std::numeric_limits<TokenId>::max()) {
    throw py::value_error("pad_id = " + std::to_string(pad_id) + ": must lie in [0, 2^31)");
  }
  o.pad_id = static_cast<TokenId>(pad_id);
  return o;
}

py::array_t<float> MaskToFloat(std::span<const uint8_t> m) { return Widen<float>(m); }

}  // namespace

void BindPack(py::module_& m) {
  m.attr("IGNORE_INDEX") = kIgnoreIndex;

  m.def(
      "pack",
      [](const py::object& samples, const py::object& target_masks, int cp_size, int tp_size,
         bool sp, int64_t pad_id, int64_t extra_alignment, const py::object& ids) {
        SampleArgs args = ReadSamples(samples, target_masks, ids);
        const PackOptions o = MakeOptions(cp_size, tp_size, sp, pad_id, extra_alignment);
        Result<PackedMicrobatch> r = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          r = Pack(args.views, o);
        }
        PackedMicrobatch p = ValueOrThrow(std::move(r));
        py::dict d;
        d["tokens"] = Widen<int64_t>(std::span<const TokenId>(p.tokens));
        d["labels"] = Widen<int64_t>(std::span<const TokenId>(p.labels));
        d["position_ids"] = Widen<int64_t>(std::span<const int32_t>(p.position_ids));
        d["loss_mask"] = MaskToFloat(p.loss_mask);
        d["cu_seqlens"] = ToNumpy(std::move(p.cu_seqlens));
        d["cu_seqlens_padded"] = ToNumpy(std::move(p.cu_seqlens_padded));
        d["max_seqlen"] = p.max_seqlen;
        d["n_valid"] = p.n_valid;
        return d;
      },
      py::arg("samples"), py::arg("target_masks") = py::none(), py::kw_only(),
      py::arg("cp_size") = 1, py::arg("tp_size") = 1, py::arg("sp") = false,
      py::arg("pad_id") = 0, py::arg("extra_alignment") = 1, py::arg("ids") = py::none(),
      R"doc(Packs samples, in order, into one THD microbatch (docs/design.md section 5).

samples: list of 1-D token sequences: NumPy arrays of any integer dtype (int32 viewed in place,
others converted exactly), CPU torch tensors or lists; every token id must lie in [0, 2^31)
whatever the dtype. target_masks: None, or a list with one array of L values of 0/1 per sample
(bool/uint8 viewed in place; any integer or float dtype, tensors and lists accepted) or None
(all ones). ids: sample ids for error messages (default 0..n-1).
Returns a dict: tokens, labels, position_ids (int64 [T]), loss_mask (float32 [T]),
cu_seqlens, cu_seqlens_padded (int32 [n+1], global), max_seqlen (largest padded length),
n_valid (sum of loss_mask). Labels are -100 where nothing is predicted.)doc");

  m.def(
      "pack_shard",
      [](const py::object& samples, const py::object& target_masks, int cp_size, int cp_rank,
         int tp_size, bool sp, int64_t pad_id, int64_t extra_alignment, const py::object& ids) {
        SampleArgs args = ReadSamples(samples, target_masks, ids);
        const PackOptions o = MakeOptions(cp_size, tp_size, sp, pad_id, extra_alignment);
        Result<ShardedMicrobatch> r = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          r = PackAndShard(args.views, o, cp_rank);
        }
        ShardedMicrobatch s = ValueOrThrow(std::move(r));
        PackedShard& sh = s.shards.at(0);
        py::dict d;
        d["tokens"] = Widen<int64_t>(std::span<const TokenId>(sh.tokens));
        d["labels"] = Widen<int64_t>(std::span<const TokenId>(sh.labels));
        d["position_ids"] = Widen<int64_t>(std::span<const int32_t>(sh.position_ids));
        d["loss_mask"] = MaskToFloat(sh.loss_mask);
        d["cu_seqlens"] = ToNumpy(std::move(s.layout.cu_seqlens));
        d["cu_seqlens_padded"] = ToNumpy(std::move(s.layout.cu_seqlens_padded));
        d["max_seqlen"] = s.layout.max_seqlen;
        d["n_valid"] = s.n_valid;
        return d;
      },
      py::arg("samples"), py::arg("target_masks") = py::none(), py::kw_only(),
      py::arg("cp_size"), py::arg("cp_rank"), py::arg("tp_size") = 1, py::arg("sp") = false,
      py::arg("pad_id") = 0, py::arg("extra_alignment") = 1, py::arg("ids") = py::none(),
      R"doc(Fused pack + CP shard: CP rank cp_rank's [T/CP] arrays (equal to shard() of pack()'s
arrays) plus the GLOBAL cu_seqlens, cu_seqlens_padded, max_seqlen and the whole microbatch's
n_valid, without building the [T] arrays.)doc");
}

}  // namespace thdpack::python
