// UnpackStep (thdpack/step_runner.h): a step's per-token outputs back to the loaders that read
// the samples, in their order. The values' dtype and row shape are agreed first (RowOfWorld);
// which loader a sample belongs to is FedShares' rule; which local token belongs to which sample
// and token comes from the shard's own rules (ShardSequenceIndex, LocalPositionIds): a run is a
// stretch of local positions of one sequence whose padded positions follow each other (a zigzag
// chunk).
#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "thdpack/fields.h"
#include "thdpack/shard.h"
#include "thdpack/step_runner.h"

namespace thdpack {
namespace {

constexpr size_t kRunHeader = 3 * sizeof(int64_t);  // sample id, first token, rows

std::string Str(int64_t v) { return std::to_string(v); }

// A rank's values as it tells them to the world: state (0 none, 1 values, 2 a local error),
// dtype, row dimensions, the row shape (zero-padded).
using RowWords = std::array<int64_t, 3 + kUnpackMaxRowDims>;

// "float32 [T/CP]", "float64 [T/CP, 3]": values of dtype and row shape.
std::string RowText(FieldDtype dtype, std::span<const int64_t> row) {
  std::string s = std::string(FieldDtypeName(dtype)) + " [T/CP";
  for (int64_t d : row) s += ", " + Str(d);
  return s + "]";
}

// This rank's values: every microbatch that has some, of one dtype and row shape (the first's),
// each of at most kUnpackMaxRowDims row dimensions of at least 1 and its bytes those of its
// shape. *words: state 1 and the row, 0 when there are none; a Status naming the microbatch
// otherwise.
Status LocalRow(std::span<const UnpackMicrobatch> microbatches, RowWords* words) {
  words->fill(0);
  int first = -1;
  for (size_t m = 0; m < microbatches.size(); ++m) {
    const UnpackMicrobatch& mb = microbatches[m];
    if (mb.shape.empty()) continue;
    const std::string where = "unpack: values of microbatch " + Str(static_cast<int64_t>(m));
    const auto row = mb.shape.subspan(1);
    if (static_cast<int>(row.size()) > kUnpackMaxRowDims) {
      return Status::InvalidArgument(where + " have " + Str(static_cast<int64_t>(mb.shape.size())) +
                                     " dimensions ([T/CP] or [T/CP, *row], at most " +
                                     Str(kUnpackMaxRowDims) + " row dimensions)");
    }
    int64_t elements = mb.shape[0];
    for (int64_t d : row) {
      if (d < 1) return Status::InvalidArgument(where + ": row dimension " + Str(d) + " (>= 1)");
      elements *= d;
    }
    if (mb.shape[0] < 0 || mb.values.size() != static_cast<size_t>(elements) *
                                                   FieldDtypeSize(mb.dtype)) {
      return Status::InvalidArgument(where + ": " + Str(static_cast<int64_t>(mb.values.size())) +
                                     " bytes for " + RowText(mb.dtype, row) + " with T/CP = " +
                                     Str(mb.shape[0]));
    }
    if (first < 0) {
      first = static_cast<int>(m);
      (*words)[0] = 1;
      (*words)[1] = static_cast<int64_t>(mb.dtype);
      (*words)[2] = static_cast<int64_t>(row.size());
      std::copy(row.begin(), row.end(), words->begin() + 3);
      continue;
    }
    const UnpackMicrobatch& f = microbatches[static_cast<size_t>(first)];
    if (mb.dtype != f.dtype || !std::ranges::equal(row, f.shape.subspan(1))) {
      return Status::InvalidArgument(where + " are " + RowText(mb.dtype, row) + ", microbatch " +
                                     Str(first) + "'s " + RowText(f.dtype, f.shape.subspan(1)) +
                                     " (every microbatch's values of one dtype and row shape)");
    }
  }
  return Status::Ok();
}

// The values' dtype and row shape over the world: one all-gather of every rank's RowWords. A
// local error (`local`, state 2 on its rank) is agreed as any (AgreeOnStatus); senders that
// differ, or no sender, are the same InvalidArgument on every rank.
Status RowOfWorld(ProcessGroup& world, const Status& local, const RowWords& mine,
                  FieldDtype* dtype, std::vector<int64_t>* row) {
  RowWords sent = mine;
  if (!local.ok()) sent[0] = 2;
  const int size = world.size();
  std::vector<int64_t> all(static_cast<size_t>(size) * sent.size());
  THDPACK_RETURN_IF_ERROR(
      world.AllGatherValues(std::span<const int64_t>(sent), std::span<int64_t>(all)));
  auto words = [&](int r) {
    return std::span<const int64_t>(all).subspan(static_cast<size_t>(r) * sent.size(),
                                                 sent.size());
  };
  for (int r = 0; r < size; ++r) {
    if (words(r)[0] == 2) return AgreeOnStatus(world, local, "unpack");
  }
  auto text = [&](int r) {
    const auto w = words(r);
    return RowText(static_cast<FieldDtype>(w[1]), w.subspan(3, static_cast<size_t>(w[2])));
  };
  int first = -1;
  for (int r = 0; r < size; ++r) {
    if (words(r)[0] != 1) continue;
    if (first < 0) {
      first = r;
    } else if (!std::ranges::equal(words(r), words(first))) {
      return Status::InvalidArgument(
          "unpack: rank " + Str(world.ranks()[static_cast<size_t>(r)]) + " passed values of " +
          text(r) + ", rank " + Str(world.ranks()[static_cast<size_t>(first)]) + " of " +
          text(first) + " (every rank's values are of one dtype and row shape)");
    }
  }
  if (first < 0) {
    return Status::InvalidArgument(
        "unpack: no rank passed values (the ranks tp = 0 of the last stage pass theirs)");
  }
  const auto w = words(first);
  *dtype = static_cast<FieldDtype>(w[1]);
  row->assign(w.begin() + 3, w.begin() + 3 + w[2]);
  return Status::Ok();
}

}  // namespace

Result<UnpackedValues> UnpackStep(ProcessGroup& world, const Topology& topology,
                                  const StepRunnerOptions& options,
                                  std::span<const UnpackMicrobatch> microbatches,
                                  const UnpackArgs& args) {
  const int size = world.size();
  const int dp = topology.dp_size();
  UnpackedValues result;
  {
    RowWords mine;
    const Status local =
        args.caller_error.ok() ? LocalRow(microbatches, &mine) : args.caller_error;
    THDPACK_RETURN_IF_ERROR(RowOfWorld(world, local, mine, &result.dtype, &result.row_shape));
  }
  int64_t width = 1;
  for (int64_t d : result.row_shape) width *= d;
  const size_t rb = static_cast<size_t>(width) * FieldDtypeSize(result.dtype);
  Status local;
  THDPACK_ASSIGN_OR_RETURN(const Coord me, topology.CoordOf(world.rank()));
  const bool reads = ReadsShare(me, options);
  // The reading ranks of each loader d.
  std::vector<std::vector<int>> readers(static_cast<size_t>(dp));
  for (int r = 0; r < size; ++r) {
    THDPACK_ASSIGN_OR_RETURN(Coord c, topology.CoordOf(r));
    if (ReadsShare(c, options)) readers[static_cast<size_t>(c.dp)].push_back(r);
  }
  std::vector<std::byte> fill;
  if (Result<std::vector<std::byte>> row = ValueRow(result.dtype, width, args.fill); row.ok()) {
    fill = std::move(*row);
  } else {
    local = row.status().WithContext("unpack: fill");
  }
  Result<FedShares> fed = FedShares::Create(args.num_samples, dp);
  if (local.ok() && !fed.ok()) local = fed.status().WithContext("unpack");
  const int64_t my_count = reads && fed.ok() ? fed->Count(me.dp) : 0;
  if (local.ok() && reads && static_cast<int64_t>(args.own_lengths.size()) != my_count) {
    local = Status::InvalidArgument("unpack: this loader (dp=" + Str(me.dp) + ") gave " +
                                    Str(static_cast<int64_t>(args.own_lengths.size())) +
                                    " sample lengths; its share of the step's " +
                                    Str(args.num_samples) + " samples is " + Str(my_count));
  }

  // The runs this rank sends, per destination: the ranks tp = 0 of the last stage send (the
  // other TP ranks hold the same values; other stages none).
  const bool sends = me.tp == 0 && me.pp == topology.pp_size() - 1;
  std::vector<std::vector<std::byte>> send(static_cast<size_t>(size));
  for (size_t m = 0; m < microbatches.size() && local.ok() && sends; ++m) {
    const UnpackMicrobatch& mb = microbatches[m];
    if (mb.shape.empty() || (mb.idle && mb.values.empty())) continue;
    const std::string where = "unpack: values of microbatch " + Str(static_cast<int64_t>(m));
    if (mb.idle) {
      local = Status::InvalidArgument(where + ": the microbatch is idle on this rank");
      break;
    }
    if (args.hf_aligned && mb.cp_size != 1) {
      local = Status::InvalidArgument(where + ": values aligned as label_format 'hf' labels " +
                                      "need a whole microbatch, this one is a shard of CP size " +
                                      Str(mb.cp_size));
      break;
    }
    Result<std::vector<int32_t>> seq =
        ShardSequenceIndex(mb.cu_seqlens, mb.cu_seqlens_padded, mb.cp_size, mb.cp_rank);
    Result<std::vector<int32_t>> pos =
        LocalPositionIds(mb.cu_seqlens_padded, mb.cp_size, mb.cp_rank);
    if (!seq.ok() || !pos.ok()) {
      local = (seq.ok() ? pos.status() : seq.status()).WithContext(where);
      break;
    }
    const size_t n_local = seq->size();
    if (mb.values.size() != n_local * rb ||
        mb.sample_ids.size() + 1 != mb.cu_seqlens.size()) {
      local = Status::InvalidArgument(where + ": " + Str(static_cast<int64_t>(mb.values.size())) +
                                      " bytes, the shard's " + Str(static_cast<int64_t>(n_local)) +
                                      " tokens of " + Str(static_cast<int64_t>(rb)) +
                                      " bytes need " + Str(static_cast<int64_t>(n_local * rb)));
      break;
    }
    for (size_t k = 0; k < n_local;) {
      const int32_t i = (*seq)[k];
      if (i < 0) {
        ++k;
        continue;
      }
      const int64_t length = int64_t{mb.cu_seqlens[i + 1]} - mb.cu_seqlens[i];
      size_t end = k + 1;
      while (end < n_local && (*seq)[end] == i && (*pos)[end] == (*pos)[end - 1] + 1) ++end;
      // Row o predicts token o + 1 (the last real token predicts nothing); aligned as hf
      // labels, row o is token o's own value and row 0 (the first token) is nobody's.
      size_t begin = k;
      int64_t first_token = int64_t{(*pos)[k]} + (args.hf_aligned ? 0 : 1);
      if (first_token == 0) {
        ++begin;
        first_token = 1;
      }
      const int64_t rows =
          std::min<int64_t>(static_cast<int64_t>(end - begin), length - first_token);
      if (rows > 0) {
        const int64_t id = mb.sample_ids[static_cast<size_t>(i)];
        const auto slot = fed->SlotOf(args.first_id, id);
        if (!slot) {
          local = Status::Internal(where + ": sample id " + Str(id) + " is not of the step");
          break;
        }
        const int64_t header[3] = {id, first_token, rows};
        for (int r : readers[static_cast<size_t>(slot->loader)]) {
          std::vector<std::byte>& out = send[static_cast<size_t>(r)];
          const size_t at = out.size();
          out.resize(at + kRunHeader + static_cast<size_t>(rows) * rb);
          std::memcpy(out.data() + at, header, kRunHeader);
          std::memcpy(out.data() + at + kRunHeader, mb.values.data() + begin * rb,
                      static_cast<size_t>(rows) * rb);
        }
      }
      k = end;
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "unpack"));

  // The byte counts of every pair, then the runs.
  std::vector<int64_t> counts(static_cast<size_t>(size)), all(static_cast<size_t>(size) * size);
  for (int r = 0; r < size; ++r) {
    counts[static_cast<size_t>(r)] = static_cast<int64_t>(send[static_cast<size_t>(r)].size());
  }
  THDPACK_RETURN_IF_ERROR(
      world.AllGatherValues(std::span<const int64_t>(counts), std::span<int64_t>(all)));
  std::vector<int64_t> sc(static_cast<size_t>(size)), sd(sc.size()), rc(sc.size()), rd(sc.size());
  int64_t send_total = 0, recv_total = 0;
  for (int r = 0; r < size; ++r) {
    sc[static_cast<size_t>(r)] = counts[static_cast<size_t>(r)];
    sd[static_cast<size_t>(r)] = send_total;
    send_total += sc[static_cast<size_t>(r)];
    rc[static_cast<size_t>(r)] = all[static_cast<size_t>(r) * size + world.rank()];
    rd[static_cast<size_t>(r)] = recv_total;
    recv_total += rc[static_cast<size_t>(r)];
  }
  std::vector<std::byte> sendbuf(static_cast<size_t>(send_total)),
      recvbuf(static_cast<size_t>(recv_total));
  for (int r = 0; r < size; ++r) {
    const auto& s = send[static_cast<size_t>(r)];
    if (!s.empty()) std::memcpy(sendbuf.data() + sd[static_cast<size_t>(r)], s.data(), s.size());
  }
  send.clear();
  THDPACK_RETURN_IF_ERROR(world.AllToAllV(sendbuf, sc, sd, recvbuf, rc, rd));

  // This loader's samples, filled from the runs.
  std::vector<int64_t>& offsets = result.offsets;
  offsets.assign(static_cast<size_t>(my_count) + 1, 0);
  int64_t expected = 0, received = 0;
  for (int64_t k = 0; k < my_count; ++k) {
    const int64_t length = std::max<int64_t>(args.own_lengths[static_cast<size_t>(k)], 0);
    offsets[static_cast<size_t>(k) + 1] = offsets[static_cast<size_t>(k)] + length;
    expected += std::max<int64_t>(length - 1, 0);
  }
  // Every row the fill first (row 0 of each sample keeps it); the runs overwrite the rest.
  std::vector<std::byte>& out = result.values;
  out.resize(static_cast<size_t>(offsets.back()) * rb);
  FillRows(fill, out.data(), offsets.back());
  for (size_t at = 0; at < recvbuf.size() && local.ok();) {
    int64_t header[3];
    if (recvbuf.size() - at < kRunHeader) {
      local = Status::Internal("unpack: a run header cut short");
      break;
    }
    std::memcpy(header, recvbuf.data() + at, kRunHeader);
    at += kRunHeader;
    const int64_t first = header[1], rows = header[2];
    const auto slot = fed->SlotOf(args.first_id, header[0]);
    const int64_t k = slot ? slot->index : 0;
    if (!slot || slot->loader != me.dp || k >= my_count || first < 1 || rows < 1 ||
        first + rows > args.own_lengths[static_cast<size_t>(k)] ||
        static_cast<uint64_t>(rows) * rb > recvbuf.size() - at) {
      local = Status::Internal("unpack: a run of sample id " + Str(header[0]) + " tokens " +
                               Str(first) + "+" + Str(rows) + " does not fit this loader's " +
                               "samples (are the lengths those it gave, in its order?)");
      break;
    }
    std::memcpy(out.data() + static_cast<size_t>(offsets[static_cast<size_t>(k)] + first) * rb,
                recvbuf.data() + at, static_cast<size_t>(rows) * rb);
    at += static_cast<size_t>(rows) * rb;
    received += rows;
  }
  if (local.ok() && received != expected) {
    local = Status::InvalidArgument(
        "unpack: loader dp=" + Str(me.dp) + " received values for " + Str(received) + " of its " +
        Str(expected) + " predicted tokens: every rank of the last stage with tp = 0 must pass " +
        "its values for every microbatch it holds");
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, "unpack"));
  return result;
}

}  // namespace thdpack
