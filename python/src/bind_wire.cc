// python/src/bind_wire.cc: the step metadata and its wire format (wire.h).
//
// Python form of StepMeta: keyword arguments / a dict with the field names of wire.h;
// microbatches is a list of dicts with cu_seqlens and cu_seqlens_padded (arrays of any integer
// dtype, tensors or lists, converted exactly to int32), n_valid
// and optionally max_seqlen (so a pack() result can be passed as is). Totals left out are
// computed from the microbatches.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "common.h"
#include "thdpack/wire.h"

namespace thdpack::python {
namespace {

std::vector<int32_t> CopyInt32(const py::handle& obj, const std::string& name) {
  auto v = IntView1D<int32_t>(obj, name);
  return std::vector<int32_t>(v.begin(), v.end());
}

// The bytes of an encoded message as the caller holds them: bytes or bytearray (viewed), a
// memoryview, a 1-D NumPy array of 1-byte integers (uint8, int8) or a CPU torch tensor of them
// (viewed when contiguous, else copied by NumPy). ValueError naming `data` otherwise.
HeldSpan<uint8_t> MessageBytes(const py::handle& obj) {
  if (py::isinstance<py::bytes>(obj) || py::isinstance<py::bytearray>(obj)) {
    py::object held = py::reinterpret_borrow<py::object>(obj);
    py::buffer_info info = held.cast<py::buffer>().request();
    std::span<const uint8_t> view(static_cast<const uint8_t*>(info.ptr),
                                  static_cast<size_t>(info.size));
    return HeldSpan<uint8_t>(view, std::move(held));
  }
  py::array a;
  if (py::isinstance<py::memoryview>(obj)) {
    a = py::module_::import("numpy").attr("asarray")(obj).cast<py::array>();
  } else {
    a = AsArray(obj, "data");  // NumPy arrays, tensors and lists
  }
  const char kind = a.dtype().kind();
  if ((kind != 'u' && kind != 'i') || a.itemsize() != 1 || a.ndim() != 1) {
    throw py::value_error("data: got a " + DescribeArray(a) +
                          ", expected bytes, bytearray or a 1-D array of bytes (uint8)");
  }
  py::array r = Readable(a, "data");
  std::span<const uint8_t> view(static_cast<const uint8_t*>(r.data()),
                                static_cast<size_t>(r.size()));
  return HeldSpan<uint8_t>(view, std::move(r));
}

py::dict ToDict(StepMeta meta) {
  py::dict d;
  d["step"] = meta.step;
  d["epoch"] = meta.epoch;
  d["dp_size"] = meta.dp_size;
  d["replica"] = meta.replica;
  d["cp_size"] = meta.parallel.cp_size();
  d["tp_size"] = meta.parallel.tp_size();
  d["sp"] = meta.parallel.sp();
  d["pad_multiple"] = meta.parallel.sequence_alignment();
  d["rank_multiple"] = meta.parallel.rank_multiple();
  py::list mbs;
  for (MicrobatchMeta& mb : meta.microbatches) {
    py::dict md;
    md["cu_seqlens"] = ToNumpy(std::move(mb.cu_seqlens));
    md["cu_seqlens_padded"] = ToNumpy(std::move(mb.cu_seqlens_padded));
    md["max_seqlen"] = mb.max_seqlen;
    md["n_valid"] = mb.n_valid;
    mbs.append(md);
  }
  d["microbatches"] = mbs;
  d["real_tokens"] = meta.real_tokens;
  d["padded_tokens"] = meta.padded_tokens;
  d["sum_sq"] = meta.sum_sq;
  d["n_loss_tokens"] = meta.n_loss_tokens;
  d["skipped_ids"] = ToNumpy(std::move(meta.skipped_ids));
  if (!meta.groups.empty()) {  // version 2 (the dynamic scheduler)
    py::list groups;
    for (const MicrobatchGroup& g : meta.groups) {
      groups.append(py::make_tuple(g.first_rank, g.num_ranks));
    }
    d["groups"] = groups;
    d["domain_rank"] = meta.domain_rank;
  }
  return d;
}

}  // namespace

void BindWire(py::module_& m) {
  m.def(
      "encode_metadata",
      [](const py::sequence& microbatches, uint64_t step, uint64_t epoch, int32_t dp_size,
         int32_t replica, py::object layout, py::object cp_size, py::object tp_size,
         py::object sp, py::object pad_multiple, py::object rank_multiple_obj,
         py::object n_loss_tokens, py::object real_tokens, py::object padded_tokens,
         py::object sum_sq, const py::object& skipped_ids, const py::object& groups,
         int32_t domain_rank) {
        // The layout: given, or the scalars (pad_multiple: the wire's sequence alignment, the
        // layout's own when None).
        std::optional<ParallelLayout> given;
        if (!layout.is_none() || pad_multiple.is_none()) {
          given = LayoutOf(LayoutArgs{std::move(layout), cp_size, tp_size, sp, py::none(),
                                      rank_multiple_obj},
                           "encode_metadata");
        }
        if (given && !pad_multiple.is_none()) {
          throw py::type_error("encode_metadata: give layout= or pad_multiple, not both");
        }
        StepMeta meta;
        meta.domain_rank = domain_rank;
        if (!groups.is_none()) {
          if (!py::isinstance<py::sequence>(groups)) {
            throw py::value_error("groups: expected a list of (first_rank, num_ranks) pairs");
          }
          size_t g = 0;
          for (auto h : groups.cast<py::sequence>()) {
            const std::string name = "groups[" + std::to_string(g++) + "]";
            if (!py::isinstance<py::sequence>(h) || py::len(h) != 2) {
              throw py::value_error(name + ": expected a (first_rank, num_ranks) pair");
            }
            auto pair = h.cast<py::sequence>();
            const int64_t first = Int64Of(pair[0], name + "[0]");
            const int64_t count = Int64Of(pair[1], name + "[1]");
            if (first < 0 || first > INT32_MAX || count < 0 || count > INT32_MAX) {
              throw py::value_error(name + " = (" + std::to_string(first) + ", " +
                                    std::to_string(count) + "): outside [0, 2^31)");
            }
            meta.groups.push_back(
                MicrobatchGroup{static_cast<int32_t>(first), static_cast<int32_t>(count)});
          }
        }
        meta.step = step;
        meta.epoch = epoch;
        meta.dp_size = dp_size;
        meta.replica = replica;
        if (given) {
          meta.parallel = *given;
        } else {
          // The wire's own fields: its sequence alignment instead of an extra alignment.
          const ParallelLayout base = LayoutOf(
              LayoutArgs{py::none(), cp_size, tp_size, sp, py::none(), rank_multiple_obj},
              "encode_metadata");
          meta.parallel = ValueOrThrow(ParallelLayout::FromWire(
              base.cp_size(), base.tp_size(), base.sp(), Int64Of(pad_multiple, "pad_multiple"),
              base.rank_multiple()));
        }
        int64_t real = 0, padded = 0, valid = 0, sq = 0;
        bool overflow = false;  // of the default sums: an error, never a wrapped total
        for (size_t i = 0; i < py::len(microbatches); ++i) {
          const std::string name = "microbatches[" + std::to_string(i) + "]";
          if (!py::isinstance<py::dict>(microbatches[i])) {
            throw py::value_error(name + ": expected a dict, got " +
                                  std::string(py::str(
                                      py::type::of(microbatches[i]).attr("__name__"))));
          }
          py::dict d = microbatches[i].cast<py::dict>();
          for (const char* key : {"cu_seqlens", "cu_seqlens_padded", "n_valid"}) {
            if (!d.contains(key)) throw py::value_error(name + ": missing key '" + key + "'");
          }
          MicrobatchMeta mb;
          mb.cu_seqlens = CopyInt32(d["cu_seqlens"], name + "['cu_seqlens']");
          mb.cu_seqlens_padded = CopyInt32(d["cu_seqlens_padded"], name + "['cu_seqlens_padded']");
          mb.n_valid = Int64Of(d["n_valid"], name + "['n_valid']");
          // Defaults of max_seqlen and the totals; lengths outside [0, 2^31) are left for
          // EncodeStepMeta to reject with its own message.
          int32_t largest = 0;
          for (size_t k = 0; k + 1 < mb.cu_seqlens_padded.size(); ++k) {
            const int64_t p = int64_t{mb.cu_seqlens_padded[k + 1]} - mb.cu_seqlens_padded[k];
            if (p < 0 || p > INT32_MAX) continue;
            largest = std::max<int32_t>(largest, static_cast<int32_t>(p));
            overflow |= __builtin_add_overflow(sq, p * p, &sq);  // p * p < 2^62
          }
          if (d.contains("max_seqlen")) {
            const int64_t m = Int64Of(d["max_seqlen"], name + "['max_seqlen']");
            if (m < 0 || m > INT32_MAX) {
              throw py::value_error(name + "['max_seqlen'] = " + std::to_string(m) +
                                    ": outside [0, 2^31)");
            }
            mb.max_seqlen = static_cast<int32_t>(m);
          } else {
            mb.max_seqlen = largest;
          }
          if (!mb.cu_seqlens.empty()) real += mb.cu_seqlens.back();
          if (!mb.cu_seqlens_padded.empty()) padded += mb.cu_seqlens_padded.back();
          overflow |= __builtin_add_overflow(valid, mb.n_valid, &valid);
          meta.microbatches.push_back(std::move(mb));
        }
        meta.real_tokens = real_tokens.is_none() ? real : Int64Of(real_tokens, "real_tokens");
        meta.padded_tokens =
            padded_tokens.is_none() ? padded : Int64Of(padded_tokens, "padded_tokens");
        if (overflow) {
          throw py::value_error("microbatches: the sum of squared padded lengths or of n_valid "
                                "exceeds int64");
        }
        meta.sum_sq = sum_sq.is_none() ? sq : Int64Of(sum_sq, "sum_sq");
        meta.n_loss_tokens =
            n_loss_tokens.is_none() ? valid : Int64Of(n_loss_tokens, "n_loss_tokens");
        if (!skipped_ids.is_none()) {
          auto ids = IntView1D<int64_t>(skipped_ids, "skipped_ids");
          meta.skipped_ids.assign(ids.begin(), ids.end());
        }
        std::vector<uint8_t> bytes = ValueOrThrow(EncodeStepMeta(meta));
        return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      },
      py::arg("microbatches"), py::kw_only(), py::arg("step") = 0, py::arg("epoch") = 0,
      py::arg("dp_size") = 1, py::arg("replica") = 0, py::arg("layout") = py::none(),
      py::arg("cp_size") = py::none(), py::arg("tp_size") = py::none(),
      py::arg("sp") = py::none(), py::arg("pad_multiple") = py::none(),
      py::arg("rank_multiple") = py::none(), py::arg("n_loss_tokens") = py::none(),
      py::arg("real_tokens") = py::none(), py::arg("padded_tokens") = py::none(),
      py::arg("sum_sq") = py::none(), py::arg("skipped_ids") = py::none(),
      py::arg("groups") = py::none(), py::arg("domain_rank") = 0,
      R"doc(Encodes one replica's step metadata (docs/design.md section 6) into bytes.

microbatches: list of dicts with cu_seqlens, cu_seqlens_padded (int32 [n+1], global),
n_valid and optionally max_seqlen (a pack() result works as is). n_loss_tokens: the GLOBAL
loss-token count N of the step (default: this replica's sum of n_valid). pad_multiple defaults
to 2*cp_size (1 without CP); real_tokens, padded_tokens and sum_sq default to their sums.
groups (the dynamic scheduler, wire version 2): one (first_rank, num_ranks) per microbatch,
(0, 0) for an idle one (cu_seqlens [0]), with domain_rank the receiving rank's dp*CP + cp;
each microbatch is then padded by its group's layout. decode_metadata returns groups and
domain_rank for such a message. rank_multiple (an int or a preset name, see pack): every T a
multiple of it times the ranks T is split over; a message with one > 1 is wire version 3.
layout: a thdpack.ParallelLayout instead of the scalars (cp_size, tp_size, sp, rank_multiple,
pad_multiple), not both.
ValueError naming the field and the rule when the metadata is inconsistent.)doc");

  m.def(
      "decode_metadata",
      [](const py::object& data) {
        HeldSpan<uint8_t> bytes = MessageBytes(data);
        Result<StepMeta> r = Status::Internal("not run");
        {
          py::gil_scoped_release release;
          r = DecodeStepMeta(bytes);
        }
        return ToDict(ValueOrThrow(std::move(r)));
      },
      py::arg("data"),
      R"doc(Decodes a message from encode_metadata (bytes, bytearray, memoryview, or a 1-D uint8
NumPy array or CPU torch tensor, as a collective hands it back) into a dict with the fields of
encode_metadata
(microbatches as dicts of int32 arrays). Any corrupt, truncated or foreign input raises
ValueError with the byte offset and the rule broken; a newer version raises ValueError
('Unimplemented').)doc");
}

}  // namespace thdpack::python
