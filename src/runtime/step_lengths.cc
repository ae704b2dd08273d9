// Phase 2, lengths (design.md section 7, step 2): every planner learns every sample of the step.
// Over the loaders (static step) or the heads (dynamic step, every CP-th of which is a loader),
// each member sends a lengths header (thdpack/step_wire.h: its sample count, the step's first
// id, id span and epoch, the size of the run's position after the step, its truncation counts)
// in one all-gather, agreed over the group before anything is sized by it; with members that
// read nothing (loader_stride > 1) member 0 then broadcasts the position frame; then each
// member's lengths frame - the (id offset, L, n_targets) of its samples, plus a blend's source
// and keep_groups' group id - all-gathered in loader order. Every frame is checked (checksum,
// ranges) after its collective. Receives into out.samples, loader_offset_, position_of_offset_,
// step_groups_, out.truncated and (members that read nothing) after_.
// Depends on: step_read.cc (own_, the share, and after_), step_keep_groups.cc (GroupOf).
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/step.h"
#include "thdpack/step_wire.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::ExchangeLengths(ProcessGroup& g, int loader_stride, RankStep& out) {
  const int dp = topo_.dp_size();
  const size_t gs = static_cast<size_t>(g.size());
  const bool sends_position = loader_stride > 1 && g.rank() == 0;
  const std::vector<uint8_t> position =
      sends_position ? EncodePositionFrame(after_) : std::vector<uint8_t>();
  LengthsHeader mine;
  mine.count = static_cast<int64_t>(own_.size());
  mine.first_id = first_id_;
  mine.id_span = id_span_;
  mine.epoch = out.epoch;
  mine.position_bytes = static_cast<int64_t>(position.size());
  mine.truncated_samples = own_cut_.samples;
  mine.truncated_tokens = own_cut_.tokens;
  mine.truncated_targets = own_cut_.targets;
  const std::array<uint8_t, kLengthsHeaderFrameSize> header = EncodeLengthsHeader(mine);
  std::vector<uint8_t> all(kLengthsHeaderFrameSize * gs);
  THDPACK_RETURN_IF_ERROR(
      g.AllGatherValues(std::span<const uint8_t>(header), std::span<uint8_t>(all)));
  auto from = [&](size_t j) {
    return "step " + std::to_string(step_) + ": received from " +
           Sender(g, static_cast<int>(j), j % static_cast<size_t>(loader_stride) == 0
                                              ? "loader"
                                              : "head");
  };
  // Every header, checked before any is used to size the next collectives.
  std::vector<LengthsHeader> headers(gs);
  Status local;
  for (size_t j = 0; j < gs && local.ok(); ++j) {
    auto h = DecodeLengthsHeader(std::span<const uint8_t>(all).subspan(
        j * kLengthsHeaderFrameSize, kLengthsHeaderFrameSize));
    if (!h.ok()) {
      local = h.status().WithContext(from(j));
      break;
    }
    headers[j] = *h;
    const bool loader = j % static_cast<size_t>(loader_stride) == 0;
    if (!loader && h->count != 0) {
      local = Status::Internal("length exchange: member " + std::to_string(j) + " reads nothing "
                               "but counts " + std::to_string(h->count) + " samples");
    }
  }
  THDPACK_RETURN_IF_ERROR(AgreeIn(g, local, "lengths header"));
  if (!reader_) {
    first_id_ = headers[0].first_id;
    id_span_ = headers[0].id_span;
    out.epoch = headers[0].epoch;
  }
  out.truncated = Truncation{};
  for (const LengthsHeader& h : headers) {
    out.truncated.samples += h.truncated_samples;
    out.truncated.tokens += h.truncated_tokens;
    out.truncated.targets += h.truncated_targets;
  }
  // The position, to members that read nothing (a dynamic step's heads with cp > 0); checked
  // after the lengths' collective, so that a damaged one keeps no member from it.
  std::vector<uint8_t> position_in;
  if (loader_stride > 1) {
    position_in = sends_position ? position
                                 : std::vector<uint8_t>(static_cast<size_t>(
                                       headers[0].position_bytes));
    THDPACK_RETURN_IF_ERROR(g.BroadcastValues(std::span<uint8_t>(position_in), 0));
  }
  // Each member's lengths frame, gathered in loader order.
  const RecordColumns columns{blend_, group_field_ >= 0, !opts_.media.empty()};
  std::vector<int64_t> c(gs, 0), dsp(gs, 0);
  loader_offset_.assign(static_cast<size_t>(dp) + 1, 0);
  for (size_t j = 0; j < gs; ++j) {
    if (j % static_cast<size_t>(loader_stride) == 0) {
      const size_t d = j / static_cast<size_t>(loader_stride);
      loader_offset_[d + 1] = loader_offset_[d] + headers[j].count;
    }
    c[j] = static_cast<int64_t>(LengthsFrameSize(headers[j].count, columns));
    if (j > 0) dsp[j] = dsp[j - 1] + c[j - 1];
  }
  std::vector<SampleRecord> records;
  records.reserve(own_.size());
  for (const Sample& x : own_) {
    SampleRecord r;
    r.offset = x.id - first_id_;
    r.length = static_cast<int64_t>(x.tokens.size());
    r.n_targets = NumTargets(x);
    r.source = x.source;
    if (group_field_ >= 0) r.group = GroupOf(x);
    if (columns.media) r.encoder = own_work_[records.size()];
    records.push_back(r);
  }
  std::vector<uint8_t> send;
  EncodeLengths(records, columns, &send);
  std::vector<uint8_t> recv(static_cast<size_t>(dsp[gs - 1] + c[gs - 1]));
  THDPACK_RETURN_IF_ERROR(g.AllGatherV(std::as_bytes(std::span<const uint8_t>(send)),
                                       std::as_writable_bytes(std::span<uint8_t>(recv)), c, dsp));
  if (loader_stride > 1 && !sends_position) {
    auto p = DecodePositionFrame(position_in);
    if (!p.ok()) return p.status().WithContext(from(0));
    if (!reader_) after_ = std::move(*p);
  }
  const int64_t n = loader_offset_.back();
  records.clear();
  records.reserve(static_cast<size_t>(n));
  for (size_t j = 0; j < gs; ++j) {
    const std::span<const uint8_t> frame = std::span<const uint8_t>(recv).subspan(
        static_cast<size_t>(dsp[j]), static_cast<size_t>(c[j]));
    THDPACK_RETURN_IF_ERROR(DecodeLengths(frame, columns, id_span_, &records).WithContext(from(j)));
  }
  out.samples.resize(static_cast<size_t>(n));
  step_groups_.assign(group_field_ >= 0 ? static_cast<size_t>(n) : 0, 0);
  out.encoder_work.assign(columns.media ? static_cast<size_t>(n) : 0, EncoderWork{});
  out.encoder_cost = opts_.schedule.encoder_cost;
  position_of_offset_.assign(static_cast<size_t>(id_span_), -1);
  for (int64_t p = 0; p < n; ++p) {
    const SampleRecord& x = records[static_cast<size_t>(p)];
    if (position_of_offset_[static_cast<size_t>(x.offset)] != -1) {
      return Status::Internal("length exchange: sample offset " + std::to_string(x.offset) +
                              " repeated");
    }
    position_of_offset_[static_cast<size_t>(x.offset)] = p;
    out.samples[static_cast<size_t>(p)] =
        SampleLength{first_id_ + x.offset, x.length, x.n_targets, blend_ ? x.source : 0};
    if (group_field_ >= 0) step_groups_[static_cast<size_t>(p)] = x.group;
    if (columns.media) out.encoder_work[static_cast<size_t>(p)] = x.encoder;
  }
  return Status::Ok();
}

}  // namespace thdpack
