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

PackOptions MakeOptions(const ParallelLayout& layout, int64_t pad_id) {
  PackOptions o;
  o.parallel = layout;
  if (pad_id < 0 || pad_id > std::numeric_limits<TokenId>::max()) {
    throw py::value_error("pad_id = " + std::to_string(pad_id) + ": must lie in [0, 2^31)");
  }
  o.pad_id = static_cast<TokenId>(pad_id);
  return o;
}

py::array_t<float> MaskToFloat(std::span<const uint8_t> m) { return Widen<float>(m); }

// label_format: "megatron" (thdpack's: shifted) or "hf" (Hugging Face's: unshifted); true for
// "hf". ValueError naming the argument otherwise, and for "hf" with CP > 1 (why: pack.h,
// ToHfLabels).
bool IsHfFormat(const std::string& label_format, int cp_size) {
  if (label_format == "megatron") return false;
  if (label_format != "hf") {
    throw py::value_error("label_format = '" + label_format +
                          "': expected 'megatron' (labels already shifted, thdpack's and "
                          "Megatron's) or 'hf' (unshifted, as Hugging Face models take them)");
  }
  if (cp_size > 1) {
    throw py::value_error(
        "label_format = 'hf' needs cp_size = 1, got " + std::to_string(cp_size) +
        ": a Hugging Face model shifts its labels inside the tokens it is given, and a zigzag "
        "CP shard puts tokens of different chunks side by side, so the shift would pair a "
        "token with one from another chunk. Use label_format='megatron' (labels already "
        "shifted) with a CP-aware model");
  }
  return true;
}

}  // namespace

void BindPack(py::module_& m) {
  m.attr("IGNORE_INDEX") = kIgnoreIndex;

  m.def(
      "pack",
      [](const py::object& samples, const py::object& target_masks, py::object layout,
         py::object cp_size, py::object tp_size, py::object sp, py::object extra_alignment,
         py::object rank_multiple, int64_t pad_id, const py::object& ids,
         const std::string& label_format) {
        const ParallelLayout parallel =
            LayoutOf(LayoutArgs{std::move(layout), std::move(cp_size), std::move(tp_size),
                                std::move(sp), std::move(extra_alignment),
                                std::move(rank_multiple)},
                     "pack");
        const bool hf = IsHfFormat(label_format, parallel.cp_size());
        SampleArgs args = ReadSamples(samples, target_masks, ids);
        const PackOptions o = MakeOptions(parallel, pad_id);
        Result<PackedMicrobatch> r = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          r = Pack(args.views, o);
          if (r.ok() && hf) {
            PackedMicrobatch& p = *r;
            Status s = ToHfLabels(p.labels, p.loss_mask, p.cu_seqlens_padded, p.labels,
                                  p.loss_mask);  // in place
            if (!s.ok()) r = s;
          }
        }
        PackedMicrobatch p = ValueOrThrow(std::move(r));
        py::dict d;
        d["tokens"] = Widen<int64_t>(std::span<const TokenId>(p.tokens));
        d["labels"] = Widen<int64_t>(std::span<const TokenId>(p.labels));
        d["position_ids"] = Widen<int64_t>(std::span<const int32_t>(p.position_ids));
        d["loss_mask"] = MaskToFloat(p.loss_mask);
        std::vector<int32_t> cu_padded_copy;
        if (hf) cu_padded_copy = p.cu_seqlens_padded;
        d["cu_seqlens"] = ToNumpy(std::move(p.cu_seqlens));
        d["cu_seqlens_padded"] = ToNumpy(std::move(p.cu_seqlens_padded));
        d["max_seqlen"] = p.max_seqlen;
        d["n_valid"] = p.n_valid;
        if (hf) {
          // The names transformers' DataCollatorWithFlattening gives the same arrays (its
          // flash-attention keyword arguments, over the padded sequences: they cover all T).
          d["input_ids"] = d["tokens"];
          d["cu_seq_lens_q"] = ToNumpy(std::move(cu_padded_copy));
          d["cu_seq_lens_k"] = d["cu_seq_lens_q"];
          d["max_length_q"] = p.max_seqlen;
          d["max_length_k"] = p.max_seqlen;
        }
        return d;
      },
      py::arg("samples"), py::arg("target_masks") = py::none(), py::kw_only(),
      THDPACK_LAYOUT_ARGS, py::arg("pad_id") = 0, py::arg("ids") = py::none(),
      py::arg("label_format") = "megatron",
      R"doc(Packs samples, in order, into one THD microbatch (docs/design.md section 5).

samples: list of 1-D token sequences: NumPy arrays of any integer dtype (int32 viewed in place,
others converted exactly), CPU torch tensors or lists; every token id must lie in [0, 2^31)
whatever the dtype. target_masks: None, or a list with one array of L values of 0/1 per sample
(bool/uint8 viewed in place; any integer or float dtype, tensors and lists accepted) or None
(all ones). ids: sample ids for error messages (default 0..n-1).
layout: a thdpack.ParallelLayout, or its scalars as a shortcut (cp_size, tp_size, sp,
extra_alignment, rank_multiple; default 1, 1, False, 1, 1), not both.
rank_multiple: every rank's tokens (T/cp_size; T/(cp_size*tp_size) with sp) a multiple of it,
the tail on the last sequence: an int or 'fp8' (16), 'mxfp8' (32), 'blockwise' (128).
Returns a dict: tokens, labels, position_ids (int64 [T]), loss_mask (float32 [T]),
cu_seqlens, cu_seqlens_padded (int32 [n+1], global), max_seqlen (largest padded length),
n_valid (sum of loss_mask). Labels are -100 where nothing is predicted.
label_format: 'megatron' (default): labels[j] is the NEXT token (already shifted), loss_mask
its target mask. 'hf' (Hugging Face's, cp_size 1 only): labels[j] is token j itself where its
target mask is 1, -100 at each sequence's first token, where the mask is 0 and at padding (the
model shifts them), loss_mask[j] = labels[j] != -100; plus input_ids (= tokens), cu_seq_lens_q,
cu_seq_lens_k (int32, = cu_seqlens_padded) and max_length_q, max_length_k (= max_seqlen), the
names transformers' DataCollatorWithFlattening uses.)doc");

  m.def(
      "hf_labels",
      [](const py::object& labels_obj, const py::object& loss_mask_obj,
         const py::object& cu_seqlens_padded_obj) {
        auto labels = IntView1D<TokenId>(labels_obj, "labels");
        auto mask = MaskView1D(loss_mask_obj, "loss_mask");
        auto cu = IntView1D<int32_t>(cu_seqlens_padded_obj, "cu_seqlens_padded");
        std::vector<TokenId> out_labels(labels.size());
        std::vector<uint8_t> out_mask(mask.size());
        Status s = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          s = ToHfLabels(labels, mask, cu, out_labels, out_mask);
        }
        ThrowIfError(s);
        return py::make_tuple(Widen<int64_t>(std::span<const TokenId>(out_labels)),
                              MaskToFloat(out_mask));
      },
      py::arg("labels"), py::arg("loss_mask"), py::arg("cu_seqlens_padded"),
      R"doc(Hugging Face's labels of a WHOLE packed microbatch (pack()'s arrays, or a CP-size-1
microbatch of the iterator) from thdpack's: returns (labels int64 [T], loss_mask float32 [T]),
labels[j] = token j where its target mask is 1, -100 at each sequence's first position, where
the mask is 0 and at padding. What pack(label_format='hf') returns.)doc");

  m.def(
      "pack_shard",
      [](const py::object& samples, const py::object& target_masks, int cp_rank,
         py::object layout, py::object cp_size, py::object tp_size, py::object sp,
         py::object extra_alignment, py::object rank_multiple, int64_t pad_id,
         const py::object& ids) {
        if (layout.is_none() && cp_size.is_none()) {
          throw py::type_error("pack_shard: give cp_size (or a layout)");
        }
        const ParallelLayout parallel =
            LayoutOf(LayoutArgs{std::move(layout), std::move(cp_size), std::move(tp_size),
                                std::move(sp), std::move(extra_alignment),
                                std::move(rank_multiple)},
                     "pack_shard");
        SampleArgs args = ReadSamples(samples, target_masks, ids);
        const PackOptions o = MakeOptions(parallel, pad_id);
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
      py::arg("cp_rank"), THDPACK_LAYOUT_ARGS, py::arg("pad_id") = 0, py::arg("ids") = py::none(),
      R"doc(Fused pack + CP shard: CP rank cp_rank's [T/CP] arrays (equal to shard() of pack()'s
arrays) plus the GLOBAL cu_seqlens, cu_seqlens_padded, max_seqlen and the whole microbatch's
n_valid, without building the [T] arrays. The layout as pack()'s (cp_size required without
one).)doc");
}

}  // namespace thdpack::python
