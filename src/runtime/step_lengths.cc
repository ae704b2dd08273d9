// Phase 2, lengths (design.md section 7, step 2): every planner learns every sample of the step.
// Over the loaders (static step) or the heads (dynamic step, every CP-th of which is a loader),
// each member sends a header of 8 int64 (its sample count, the step's first id, id span and
// epoch, the size of the run's position after the step, its truncation counts) and each loader
// its samples' (id offset, L, n_targets) as int32 - plus a blend's source and keep_groups' group
// id (two words) - all-gathered in loader order; with members that read nothing (loader_stride
// > 1) member 0 then broadcasts the position words (step_words.h). Receives into out.samples,
// loader_offset_, position_of_offset_, step_groups_ and out.truncated.
// Depends on: step_read.cc (own_, the share, and after_), step_keep_groups.cc (GroupOf).
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/step.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

// Every member sends a header (its sample count, and the step's first id, id span and epoch,
// which members that read nothing take from loader 0), then the loaders' (id offset, L,
// n_targets) triples, 12 bytes a sample (+4 with a blend's source, +8 with keep_groups' group
// id), gathered in loader order.
Status StepRunner::Impl::ExchangeLengths(ProcessGroup& g, int loader_stride, RankStep& out) {
  const int dp = topo_.dp_size();
  const size_t gs = static_cast<size_t>(g.size());
  // The header: count, first id, id span, epoch, and the size of the run's position after the
  // step, which member 0 then sends to members that read nothing (a dynamic step's heads with
  // cp > 0).
  // Then this loader's truncation counts (oversize 'truncate'), summed over the loaders.
  constexpr size_t kHeader = 8;
  const std::array<int64_t, kHeader> header = {static_cast<int64_t>(own_.size()), first_id_,
                                               id_span_, out.epoch,
                                               static_cast<int64_t>(after_.size()),
                                               own_cut_.samples, own_cut_.tokens,
                                               own_cut_.targets};
  std::vector<int64_t> all(kHeader * gs);
  THDPACK_RETURN_IF_ERROR(
      g.AllGatherValues(std::span<const int64_t>(header), std::span<int64_t>(all)));
  if (!reader_) {
    first_id_ = all[1];
    id_span_ = all[2];
    out.epoch = all[3];
  }
  out.truncated = Truncation{};
  for (size_t j = 0; j < gs; ++j) {
    out.truncated.samples += all[kHeader * j + 5];
    out.truncated.tokens += all[kHeader * j + 6];
    out.truncated.targets += all[kHeader * j + 7];
  }
  if (loader_stride > 1) {
    if (all[4] < 2 || all[4] > (int64_t{1} << 26)) {
      return Status::Internal("length exchange: a run position of " + std::to_string(all[4]) +
                              " words");
    }
    if (!reader_) after_.assign(static_cast<size_t>(all[4]), 0);
    THDPACK_RETURN_IF_ERROR(g.BroadcastValues(std::span<int64_t>(after_), 0));
  }
  // id offset, L, n_targets (, source) (, group id as two words)
  const size_t per = (blend_ ? 4 : 3) + (group_field_ >= 0 ? 2 : 0);
  std::vector<int64_t> c(gs, 0), dsp(gs, 0);
  loader_offset_.assign(static_cast<size_t>(dp) + 1, 0);
  for (size_t j = 0; j < gs; ++j) {
    const int64_t n_j = all[kHeader * j];
    const bool loader = j % static_cast<size_t>(loader_stride) == 0;
    if (n_j < 0 || n_j > (int64_t{1} << 40) || (!loader && n_j != 0)) {
      return Status::Internal("length exchange: member " + std::to_string(j) + " count " +
                              std::to_string(n_j) + " out of range");
    }
    if (loader) {
      const size_t d = j / static_cast<size_t>(loader_stride);
      loader_offset_[d + 1] = loader_offset_[d] + n_j;
    }
    c[j] = static_cast<int64_t>(per) * n_j;
    if (j > 0) dsp[j] = dsp[j - 1] + c[j - 1];
  }
  const int64_t n = loader_offset_.back();
  std::vector<int32_t> send;
  send.reserve(per * own_.size());
  for (const Sample& x : own_) {
    send.push_back(static_cast<int32_t>(x.id - first_id_));
    send.push_back(static_cast<int32_t>(x.tokens.size()));
    send.push_back(static_cast<int32_t>(NumTargets(x)));
    if (blend_) send.push_back(x.source);
    if (group_field_ >= 0) {
      const uint64_t g = static_cast<uint64_t>(GroupOf(x));
      send.push_back(static_cast<int32_t>(static_cast<uint32_t>(g)));
      send.push_back(static_cast<int32_t>(static_cast<uint32_t>(g >> 32)));
    }
  }
  std::vector<int32_t> recv(per * static_cast<size_t>(n));
  THDPACK_RETURN_IF_ERROR(
      g.AllGatherVValues(std::span<const int32_t>(send), std::span<int32_t>(recv), c, dsp));
  out.samples.resize(static_cast<size_t>(n));
  step_groups_.assign(group_field_ >= 0 ? static_cast<size_t>(n) : 0, 0);
  position_of_offset_.assign(static_cast<size_t>(id_span_), -1);
  for (int64_t p = 0; p < n; ++p) {
    const int32_t* v = recv.data() + per * static_cast<size_t>(p);
    const int32_t off = v[0];
    if (off < 0 || off >= id_span_ || position_of_offset_[static_cast<size_t>(off)] != -1) {
      return Status::Internal("length exchange: sample offset " + std::to_string(off) +
                              " out of range or repeated");
    }
    position_of_offset_[static_cast<size_t>(off)] = p;
    out.samples[static_cast<size_t>(p)] =
        SampleLength{first_id_ + off, v[1], v[2], blend_ ? v[3] : 0};
    if (group_field_ >= 0) {
      const size_t w = blend_ ? 4 : 3;
      step_groups_[static_cast<size_t>(p)] = static_cast<int64_t>(
          static_cast<uint64_t>(static_cast<uint32_t>(v[w])) |
          (static_cast<uint64_t>(static_cast<uint32_t>(v[w + 1])) << 32));
    }
  }
  return Status::Ok();
}

}  // namespace thdpack
