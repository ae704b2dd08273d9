// The dynamic scheduler's step (thdpack/step_runner.h; docs/scheduling.md "Dynamic CP",
// docs/design.md section 7): the heads learn every sample's length and plan; each loader sends
// each sample it read to the head of every domain rank of the sample's group; each head packs
// its group's sequences with the group's layout and keeps its own zigzag shard, encodes its
// step message (thdpack/step_wire.h: the metadata with groups) and delivers both down its
// column (every tp and pp of its domain index) - with --data-on all every rank is a head of
// its (tp, pp) slice and nothing is delivered; the CP process groups the plan uses are split
// from the world (a bounded cache across steps), their list broadcast by head 0 as a groups
// frame. The phases both kinds of step share are in the step's phase files
// (step_runner.cc lists them): the read phase, the lengths exchange, MoveSamples, PackSequences,
// SealMeta and Deliver, MakeLocal.
#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#include "runtime/step_runner_impl.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::InitDynamic() {
  const int cp = topo_.cp_size(), domain = topo_.dp_size() * cp;
  const bool all = opts_.data_on == DataOn::kAll;
  // Heads: one domain per (tp, pp) slice with all, the slice tp = pp = 0 alone with tp0.
  std::vector<std::vector<int>> heads;
  for (int pp = 0; pp < (all ? topo_.pp_size() : 1); ++pp) {
    for (int tp = 0; tp < (all ? topo_.tp_size() : 1); ++tp) {
      THDPACK_ASSIGN_OR_RETURN(std::vector<int> list, topo_.DomainRanks(0, domain, tp, pp));
      heads.push_back(std::move(list));
    }
  }
  THDPACK_ASSIGN_OR_RETURN(heads_, world_.Split(heads));
  if (head_ && (!heads_ || heads_->rank() != DomainIndex())) {
    return Status::Internal("StepRunner: head group position differs from the domain index");
  }
  if (all) return Status::Ok();
  std::vector<std::vector<int>> columns(static_cast<size_t>(domain));
  for (int d = 0; d < domain; ++d) {
    columns[static_cast<size_t>(d)].push_back(heads[0][static_cast<size_t>(d)]);
  }
  for (int r = 0; r < topo_.world_size(); ++r) {
    THDPACK_ASSIGN_OR_RETURN(Coord c, topo_.CoordOf(r));
    if (c.tp == 0 && c.pp == 0) continue;
    columns[static_cast<size_t>(c.dp * cp + c.cp)].push_back(r);
  }
  THDPACK_ASSIGN_OR_RETURN(column_, world_.Split(columns));
  if (!column_) return Status::Internal("StepRunner: no column group");
  return Status::Ok();
}

Status StepRunner::Impl::MakeDynamicPlan(RankStep& out) {
  THDPACK_ASSIGN_OR_RETURN(out.dynamic_plan,
                           ScheduleDynamic(out.samples, opts_.schedule, step_groups_,
                                           out.encoder_work));
  if (opts_.check_plan_hash) {
    THDPACK_RETURN_IF_ERROR(
        AgreeOnPlanHash(*heads_, HashPlan(out.dynamic_plan), "dynamic plan", step_));
  }
  group_of_.assign(out.samples.size(), {-1, 0});
  for (const auto& groups : out.dynamic_plan.microbatches) {
    for (const CpGroup& g : groups) {
      for (int64_t id : g.sample_ids) {
        const int64_t off = id - first_id_;
        if (off < 0 || off >= id_span_ || position_of_offset_[static_cast<size_t>(off)] < 0) {
          return Status::Internal("dynamic plan: sample id " + std::to_string(id) +
                                  " is not one of the step's");
        }
        group_of_[static_cast<size_t>(position_of_offset_[static_cast<size_t>(off)])] = {
            g.first_rank, g.num_ranks};
      }
    }
  }
  return Status::Ok();
}

// All-to-all-v among the heads: the block from loader s (head s*CP) to head e holds the samples
// s read whose group contains e (scheduling order): their tokens, then the masks of those that
// send one, padded to a multiple of 4 bytes. A loader keeps what its own head holds.
void StepRunner::Impl::HeadBlocks(std::vector<std::vector<int64_t>>* send_ps,
                                   std::vector<std::vector<int64_t>>* recv_ps) const {
  const int cp = topo_.cp_size();
  const int me = DomainIndex();
  const size_t gs = static_cast<size_t>(heads_->size());
  auto positions = [&](int s, int e) {  // loader s -> head e
    std::vector<int64_t> ps;
    for (int64_t p = loader_offset_[static_cast<size_t>(s)];
         p < loader_offset_[static_cast<size_t>(s) + 1]; ++p) {
      if (HeadHolds(p, e)) ps.push_back(p);
    }
    return ps;
  };
  send_ps->assign(gs, {});
  recv_ps->assign(gs, {});
  for (int e = 0; e < static_cast<int>(gs); ++e) {
    if (e == me) continue;
    if (reader_) (*send_ps)[static_cast<size_t>(e)] = positions(coord_.dp, e);
    if (e % cp == 0) (*recv_ps)[static_cast<size_t>(e)] = positions(e / cp, me);  // a loader
  }
}

bool StepRunner::Impl::HeadHolds(int64_t p, int e) const {
  const auto [first, c] = group_of_[static_cast<size_t>(p)];
  return c > 0 && e >= first && e < first + c;
}

Status StepRunner::Impl::ExchangeTokensDynamic(RankStep& out) {
  const int me = DomainIndex();
  std::vector<std::vector<int64_t>> send_ps, recv_ps;
  HeadBlocks(&send_ps, &recv_ps);
  const bool loader = reader_;
  const int64_t my_begin = loader ? loader_offset_[static_cast<size_t>(coord_.dp)] : 0;
  return MoveSamples(*heads_, out.samples, send_ps, recv_ps, my_begin,
                     [&](int64_t p) { return loader && HeadHolds(p, me); });
}

// Each head: per microbatch, its group's sequences packed with the group's layout and its own
// zigzag shard (every array: the column's first and last stages take theirs), and the
// metadata of its domain index (with groups), sealed into its step message (SealMeta).
Status StepRunner::Impl::PackDynamic(RankStep& out) {
  const int me = DomainIndex();
  const DynamicPlan& plan = out.dynamic_plan;
  StepMeta& meta = out.meta;
  meta = MetaHeader(step_, out.epoch, topo_.dp_size(), coord_.dp, opts_.schedule.parallel,
                    plan.skipped);
  meta.domain_rank = me;
  n_loss_sequences_ =
      AddLossSums(out.samples, [&](size_t p) { return group_of_[p].second != 0; }, meta);
  PackOptions po;
  po.pad_id = opts_.pad_id;
  const bool tp0 = opts_.data_on == DataOn::kTp0;
  const bool first = coord_.pp == 0, last = coord_.pp == topo_.pp_size() - 1;
  shards_.assign(static_cast<size_t>(plan.num_microbatches), {});
  mb_info_.assign(static_cast<size_t>(plan.num_microbatches), {});
  const bool media = !opts_.media.empty();
  media_shards_.assign(media ? static_cast<size_t>(plan.num_microbatches) : 0, {});
  std::vector<SampleView> views;
  std::vector<int64_t> lengths, ps;
  for (int m = 0; m < plan.num_microbatches; ++m) {
    const CpGroup* mine = nullptr;
    for (const CpGroup& g : plan.microbatches[static_cast<size_t>(m)]) {
      if (me >= g.first_rank && me < g.first_rank + g.num_ranks) mine = &g;
    }
    auto& shards = shards_[static_cast<size_t>(m)];
    shards.emplace_back();
    if (mine == nullptr) {  // idle in this microbatch
      meta.groups.push_back(MicrobatchGroup{0, 0});
      meta.microbatches.push_back(MicrobatchMeta{{0}, {0}, 0, 0});
      continue;
    }
    THDPACK_ASSIGN_OR_RETURN(po.parallel, GroupLayout(opts_.schedule, mine->num_ranks));
    views.clear();
    lengths.clear();
    ps.clear();
    for (int64_t id : mine->sample_ids) {
      const size_t p = static_cast<size_t>(position_of_offset_[static_cast<size_t>(id - first_id_)]);
      ps.push_back(static_cast<int64_t>(p));
      const SampleRef& r = refs_[p];
      if (r.tokens == nullptr && r.length == 0) {
        return Status::Internal("dynamic step: sample id " + std::to_string(id) +
                                " of this head's group was not received");
      }
      views.emplace_back(id, std::span<const TokenId>(r.tokens, static_cast<size_t>(r.length)),
                         r.mask ? std::span<const uint8_t>(r.mask, static_cast<size_t>(r.length))
                                : std::span<const uint8_t>());
      lengths.push_back(r.length);
    }
    THDPACK_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(lengths, po));
    const size_t local = static_cast<size_t>(layout.total_tokens / mine->num_ranks);
    PackedShard& sh = shards.back();
    sh.cp_rank = me - mine->first_rank;
    // A head of tp0 packs every array for its column; with all, the arrays of its stage.
    if (tp0 || first) {
      sh.tokens.resize(local);
      sh.position_ids.resize(local);
    }
    if (tp0 || last) {
      sh.labels.resize(local);
      sh.loss_mask.resize(local);
    }
    THDPACK_ASSIGN_OR_RETURN(
        int64_t n_valid,
        PackShardInto(views, layout, po, sh.cp_rank,
                      PackBuffers{sh.tokens, sh.position_ids, sh.labels, sh.loss_mask}));
    THDPACK_RETURN_IF_ERROR(PackSequences(out, static_cast<size_t>(m), ps, layout,
                                          mine->num_ranks, shards));
    if (media) {  // this head's CP rank of the group: its items, route and mRoPE shard
      THDPACK_RETURN_IF_ERROR(PackMedia(out, static_cast<size_t>(m), ps, layout,
                                        mine->num_ranks, sh.cp_rank));
    }
    meta.groups.push_back(MicrobatchGroup{mine->first_rank, mine->num_ranks});
    AddMicrobatch(meta, std::move(layout), n_valid);
  }
  return SealMeta(meta);
}

// The head sends each member of its column, microbatch by microbatch, what its stage needs;
// idle microbatches carry nothing.
Status StepRunner::Impl::ReceiveShardsDynamic(RankStep& out) {
  ProcessGroup& col = *column_;
  if (col.rank() == 0) {
    for (size_t m = 0; m < shards_.size(); ++m) {
      const PackedShard& sh = shards_[m][0];
      if (sh.tokens.empty()) continue;
      for (int j = 1; j < col.size(); ++j) {
        THDPACK_ASSIGN_OR_RETURN(Coord c, topo_.CoordOf(col.ranks()[static_cast<size_t>(j)]));
        THDPACK_RETURN_IF_ERROR(SendShard(col, j, c.pp, sh));
      }
    }
    return Status::Ok();
  }
  shards_.assign(out.meta.microbatches.size(), {});
  for (size_t m = 0; m < shards_.size(); ++m) {
    PackedShard sh;
    const MicrobatchGroup& g = out.meta.groups[m];
    if (g.num_ranks > 0) {
      const size_t local =
          static_cast<size_t>(out.meta.microbatches[m].cu_seqlens_padded.back() / g.num_ranks);
      sh.cp_rank = out.meta.domain_rank - g.first_rank;
      THDPACK_RETURN_IF_ERROR(RecvShard(col, local, sh));
    }
    shards_[m].push_back(std::move(sh));
  }
  // Every array has arrived: each checked against the step message's checksum.
  const std::string sender = Sender(col, 0, "head");
  for (size_t m = 0; m < shards_.size(); ++m) {
    if (out.meta.groups[m].num_ranks == 0) continue;
    THDPACK_RETURN_IF_ERROR(CheckShard(shards_[m][0], m, 0, sender));
  }
  return Status::Ok();
}

// The CP groups of this step's plan, (first rank, size) in increasing order, broadcast over the
// world by head 0 (world rank 0) as a groups frame after a size frame (the size agreed, so that
// a rank that cannot read it does not leave the others waiting in the broadcast; the list
// agreed too, before the splits); every rank splits, in that order, those not made before (one
// Split each: at every (tp, pp) the ranks of the group's domain indices), and keeps them for
// later steps.
Status StepRunner::Impl::MakeGroups(RankStep& out) {
  std::vector<uint8_t> frame;
  if (head_) {
    std::vector<std::pair<int, int>> used;
    for (const auto& groups : out.dynamic_plan.microbatches) {
      for (const CpGroup& g : groups) used.emplace_back(g.first_rank, g.num_ranks);
    }
    std::sort(used.begin(), used.end());
    used.erase(std::unique(used.begin(), used.end()), used.end());
    frame = EncodeGroupsFrame(used);
  }
  THDPACK_ASSIGN_OR_RETURN(const int root, topo_.RankOf(Coord{0, 0, 0, 0}));
  const int64_t b0 = world_.bytes_sent();
  const int64_t a0 = agree_bytes_;
  const int cp = topo_.cp_size(), domain = topo_.dp_size() * cp;
  const std::string from = "step " + std::to_string(step_) + ": received from " +
                           Sender(world_, root, "head");
  std::array<uint8_t, kSizeFrameSize> size_frame =
      EncodeSizeFrame(static_cast<int64_t>(frame.size()));
  THDPACK_RETURN_IF_ERROR(world_.BroadcastValues(std::span<uint8_t>(size_frame), root));
  // At most every (first, size) pair of the domain, 2 varints of up to 5 bytes each.
  Result<int64_t> size = DecodeSizeFrame(size_frame, static_cast<int64_t>(kFrameTrailerSize) + 1,
                                         10 * int64_t{domain} * domain + 64);
  THDPACK_RETURN_IF_ERROR(Agree(size.status().WithContext(from), "groups size"));
  frame.resize(static_cast<size_t>(*size));
  THDPACK_RETURN_IF_ERROR(world_.BroadcastValues(std::span<uint8_t>(frame), root));
  auto groups = DecodeGroupsFrame(frame, domain);
  // Attach splits groups, a collective: agreed first, so that a rank that received the list
  // damaged is not missing from it.
  const Status got = opts_.defer_cp_groups ? groups.status().WithContext(from)
                                           : Agree(groups.status().WithContext(from), "groups");
  // The data bytes of the groups (the agreements are counted as agreement).
  groups_bytes_ += world_.bytes_sent() - b0 - (agree_bytes_ - a0);
  THDPACK_RETURN_IF_ERROR(got);
  out.cp_groups = std::move(*groups);
  if (opts_.defer_cp_groups) return Status::Ok();
  const int64_t b1 = world_.bytes_sent();
  Status attached = groups_.Attach(world_, out);
  groups_bytes_ += world_.bytes_sent() - b1;
  return attached;
}

int CpGroupCache::Missing(const RankStep& step) const {
  int missing = 0;
  for (const auto& key : step.cp_groups) missing += groups_.count(key) == 0 ? 1 : 0;
  return missing;
}

Status CpGroupCache::AttachAgreed(ProcessGroup& world, RankStep& step) {
  const bool splits = Missing(step) > 0;
  Status s = Attach(world, step);
  return splits ? AgreeOnStatus(world, s, "groups") : s;
}

Status CpGroupCache::Attach(ProcessGroup& world, RankStep& out) {
  const int domain = topo_.dp_size() * topo_.cp_size();
  out.groups_made = out.groups_reused = out.groups_evicted = 0;
  for (const auto& [first, c] : out.cp_groups) {
    if (first < 0 || c < 1 || first + c > domain) {
      return Status::Internal("dynamic step: group [" + std::to_string(first) + ", +" +
                              std::to_string(c) + ") outside the domain");
    }
    const std::pair<int, int> key{first, c};
    if (auto it = groups_.find(key); it != groups_.end()) {
      it->second.last_step = out.step;
      ++out.groups_reused;
      continue;
    }
    std::vector<std::vector<int>> lists;
    for (int pp = 0; pp < topo_.pp_size(); ++pp) {
      for (int tp = 0; tp < topo_.tp_size(); ++tp) {
        THDPACK_ASSIGN_OR_RETURN(std::vector<int> list, topo_.DomainRanks(first, c, tp, pp));
        lists.push_back(std::move(list));
      }
    }
    THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> g, world.Split(lists));
    groups_[key] = Entry{std::shared_ptr<ProcessGroup>(std::move(g)), out.step};
    ++out.groups_made;
  }
  // Over the bound: drop the groups unused longest (earliest last step, then the smallest key),
  // never one of this step's; every rank drops the same ones. A microbatch of an earlier step
  // still holding a dropped group keeps it alive until it is freed.
  while (static_cast<int64_t>(groups_.size()) > max_) {
    auto oldest = groups_.end();
    for (auto it = groups_.begin(); it != groups_.end(); ++it) {
      if (it->second.last_step == out.step) continue;
      if (oldest == groups_.end() || it->second.last_step < oldest->second.last_step) oldest = it;
    }
    if (oldest == groups_.end()) break;  // this step alone uses more than the bound
    groups_.erase(oldest);
    ++out.groups_evicted;
  }
  out.groups_cached = static_cast<int64_t>(groups_.size());
  // Every group this rank's metadata names is split, and holds it at its position.
  for (size_t m = 0; m < out.meta.groups.size(); ++m) {
    const MicrobatchGroup& g = out.meta.groups[m];
    if (g.num_ranks == 0) continue;
    auto it = groups_.find({g.first_rank, g.num_ranks});
    const ProcessGroup* group = it == groups_.end() ? nullptr : it->second.group.get();
    if (group == nullptr || group->size() != g.num_ranks ||
        group->rank() != out.meta.domain_rank - g.first_rank) {
      return Status::Internal("dynamic step " + std::to_string(out.step) + ": microbatch " +
                              std::to_string(m) + "'s group [" + std::to_string(g.first_rank) +
                              ", +" + std::to_string(g.num_ranks) +
                              ") is not among the groups of the plan, or not at position " +
                              std::to_string(out.meta.domain_rank - g.first_rank));
    }
    if (m < out.microbatches.size()) out.microbatches[m].cp_group = it->second.group;
  }
  return Status::Ok();
}

void StepRunner::Impl::FinishLocalDynamic(RankStep& out) {
  out.microbatches.clear();
  out.n_loss_sequences = n_loss_sequences_;
  for (size_t m = 0; m < out.meta.microbatches.size(); ++m) {
    const MicrobatchGroup& g = out.meta.groups[m];
    const bool idle = g.num_ranks == 0;
    LocalMicrobatch lm = MakeLocal(out, m, idle ? 1 : g.num_ranks,
                                   idle ? 0 : out.meta.domain_rank - g.first_rank);
    lm.idle = idle;
    lm.first_rank = g.first_rank;
    out.microbatches.push_back(std::move(lm));
  }
}

Result<RankStep> StepRunner::Impl::NextDynamic() {
  RankStep out = StartStep(head_);
  const int cp = topo_.cp_size();

  THDPACK_RETURN_IF_ERROR(ReadPhase(out));
  THDPACK_RETURN_IF_ERROR(RunPhase(out, Phase::kLengths, head_, "lengths",
                                   [&] { return ExchangeLengths(*heads_, cp, out); }));
  THDPACK_RETURN_IF_ERROR(
      RunPhase(out, Phase::kPlan, head_, "plan", [&] { return MakeDynamicPlan(out); }));
  const bool media = !opts_.media.empty();
  THDPACK_RETURN_IF_ERROR(RunPhase(out, Phase::kExchange, head_, "exchange", [&] {
    const Status tokens = ExchangeTokensDynamic(out);
    if (!media) return tokens;
    // The media follow only where every head's tokens arrived whole.
    THDPACK_RETURN_IF_ERROR(AgreeIn(*heads_, tokens, "exchange"));
    return ExchangeMediaDynamic(out);
  }));
  const Status packed =
      RunPhase(out, Phase::kPack, head_, "pack", [&] { return PackDynamic(out); });
  own_.clear();
  recv_buffer_.clear();
  refs_.clear();
  media_recv_.clear();
  item_head_.clear();
  own_items_.clear();
  media_of_.clear();
  THDPACK_RETURN_IF_ERROR(packed);

  THDPACK_RETURN_IF_ERROR(Deliver(out, column_.get(),
                                  "the head of domain rank " + std::to_string(DomainIndex()),
                                  [&] { return ReceiveShardsDynamic(out); },
                                  [&] {
                                    // Agreed over the world before MakeGroups' collectives:
                                    // a column whose media failed must not leave the others
                                    // waiting in them.
                                    if (media) {
                                      THDPACK_RETURN_IF_ERROR(
                                          Agree(DeliverMedia(out, *column_, true), "media"));
                                    }
                                    FinishLocalDynamic(out);
                                    return MakeGroups(out);
                                  }));
  out.phases.push_back(PhaseStats{Phase::kAgree, agree_seconds_, agree_bytes_});
  ++step_;
  THDPACK_RETURN_IF_ERROR(CommitPosition(out));
  return out;
}

}  // namespace thdpack
