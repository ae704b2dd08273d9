// Phase 5, pack (design.md section 7, step 4): each loader packs its replica's microbatches
// (PackReplica: every CP rank's shards with tp0, only its own with --data-on all) and makes the
// replica's StepMeta (its header and token sums: runner_internal::MetaHeader, AddMicrobatch,
// AddLossSums) and each microbatch's sequences (PackSequences: ids, loss-token counts, sources,
// sample fields, and the per-token fields into the shards - shared with the dynamic step's
// PackDynamic, dynamic_step.cc). Ends by sealing the metadata for delivery (SealMeta,
// step_deliver.cc). Sends nothing.
// Depends on: step_plan.cc (the plan, replica_of_), step_exchange.cc (refs_).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/fields.h"
#include "thdpack/shard.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

// Packs this replica's microbatches: the loader (tp0) every CP rank's shards, a rank with
// DataOn::kAll only its own; and the replica's StepMeta.
Status StepRunner::Impl::PackReplica(RankStep& out) {
  const int me = coord_.dp;
  const int cp = topo_.cp_size();
  const Plan& plan = out.plan;
  PackOptions po;
  po.parallel = opts_.schedule.parallel;
  po.pad_id = opts_.pad_id;
  po.fixed_tokens = FixedMicrobatchTokens(opts_.schedule);
  StepMeta& meta = out.meta;
  meta = MetaHeader(step_, out.epoch, topo_.dp_size(), me, opts_.schedule.parallel, plan.skipped);
  n_loss_sequences_ =
      AddLossSums(out.samples, [&](size_t p) { return replica_of_[p] >= 0; }, meta);
  const bool tp0 = opts_.data_on == DataOn::kTp0;
  const bool first = coord_.pp == 0, last = coord_.pp == topo_.pp_size() - 1;
  shards_.assign(static_cast<size_t>(plan.num_microbatches), {});
  mb_info_.assign(static_cast<size_t>(plan.num_microbatches), {});
  media_shards_.assign(opts_.media.empty() ? 0 : static_cast<size_t>(plan.num_microbatches), {});
  out.media_rank_cost.assign(media_shards_.size(), {});
  out.media_rank_bytes.assign(media_shards_.size(), {});
  std::vector<SampleView> views;
  std::vector<int64_t> lengths, ps;
  for (int m = 0; m < plan.num_microbatches; ++m) {
    views.clear();
    lengths.clear();
    ps.clear();
    for (int64_t id : plan.Microbatch(me, m)) {
      const size_t p = static_cast<size_t>(position_of_offset_[static_cast<size_t>(id - first_id_)]);
      ps.push_back(static_cast<int64_t>(p));
      const SampleRef& r = refs_[p];
      views.emplace_back(id, std::span<const TokenId>(r.tokens, static_cast<size_t>(r.length)),
                         r.mask ? std::span<const uint8_t>(r.mask, static_cast<size_t>(r.length))
                                : std::span<const uint8_t>());
      lengths.push_back(r.length);
    }
    THDPACK_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(lengths, po));
    const size_t local = static_cast<size_t>(layout.total_tokens / cp);
    auto& shards = shards_[static_cast<size_t>(m)];
    std::vector<PackBuffers> bufs;
    const int first_cp = tp0 ? 0 : coord_.cp;
    const int n_cp = tp0 ? cp : 1;
    for (int c = 0; c < n_cp; ++c) {
      PackedShard sh;
      sh.cp_rank = first_cp + c;
      const bool want_first = tp0 || first, want_last = tp0 || last;
      if (want_first) {
        sh.tokens.resize(local);
        sh.position_ids.resize(local);
      }
      if (want_last) {
        sh.labels.resize(local);
        sh.loss_mask.resize(local);
      }
      shards.push_back(std::move(sh));
    }
    for (auto& sh : shards) {
      bufs.push_back(PackBuffers{sh.tokens, sh.position_ids, sh.labels, sh.loss_mask});
    }
    int64_t n_valid = 0;
    if (tp0) {
      THDPACK_ASSIGN_OR_RETURN(n_valid, PackShardAllInto(views, layout, po, bufs));
    } else {
      THDPACK_ASSIGN_OR_RETURN(n_valid, PackShardInto(views, layout, po, coord_.cp, bufs[0]));
    }
    THDPACK_RETURN_IF_ERROR(PackSequences(out, static_cast<size_t>(m), ps, layout, cp, shards));
    if (!opts_.media.empty()) {  // step_media.cc
      THDPACK_RETURN_IF_ERROR(PackMedia(out, static_cast<size_t>(m), ps, layout, topo_.cp_size()));
    }
    AddMicrobatch(meta, std::move(layout), n_valid);
  }
  return SealMeta(meta);
}

Status StepRunner::Impl::PackSequences(RankStep& out, size_t m, std::span<const int64_t> ps,
                                       const Layout& layout, int cp_size,
                                       std::vector<PackedShard>& shards) {
  MicrobatchSequences& info = mb_info_[m];
  for (int64_t p : ps) {
    const SampleLength& x = out.samples[static_cast<size_t>(p)];
    info.ids.push_back(x.id);
    info.n_targets.push_back(x.n_targets);
    if (blend_) info.sources.push_back(x.source);
  }
  const std::vector<FieldSpec>& fields = opts_.fields;
  if (fields.empty()) return Status::Ok();
  // Field f of the sample at position p: its own buffer, or its place in the exchange buffer.
  auto field_of = [&](int64_t p, size_t f) {
    const SampleRef& r = refs_[static_cast<size_t>(p)];
    if (r.own_fields != nullptr) return std::span<const std::byte>((*r.own_fields)[f]);
    size_t at = 0;
    for (size_t g = 0; g < f; ++g) at += fields[g].bytes_for(r.length);
    return std::span<const std::byte>(r.fields + at, fields[f].bytes_for(r.length));
  };
  std::vector<std::span<const std::byte>> values(ps.size());
  info.sample_fields.assign(sample_fields_.size(), {});
  for (size_t f = 0, sf = 0; f < fields.size(); ++f) {
    const FieldSpec& spec = fields[f];
    for (size_t k = 0; k < ps.size(); ++k) values[k] = field_of(ps[k], f);
    if (!spec.per_token()) {
      std::vector<std::byte>& rows = info.sample_fields[sf++];
      for (const auto& v : values) rows.insert(rows.end(), v.begin(), v.end());
      continue;
    }
    const size_t bytes = static_cast<size_t>(layout.total_tokens / cp_size) * spec.row_bytes();
    for (PackedShard& sh : shards) {
      sh.fields.resize(fields.size());
      if (!spec.HeldWith(!sh.tokens.empty(), !sh.labels.empty())) continue;
      sh.fields[f].resize(bytes);
      THDPACK_RETURN_IF_ERROR(
          PackFieldShardInto(spec, values, layout, cp_size, sh.cp_rank, sh.fields[f]));
    }
  }
  return Status::Ok();
}

}  // namespace thdpack
