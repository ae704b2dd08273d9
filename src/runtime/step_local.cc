// The end of a step (design.md section 7, step 6): each rank's LocalMicrobatch list, from the
// metadata it holds and its shards - the global layout, its place in its CP group, the arrays
// of its stage, the microbatch's sequences (ids, loss-token counts, sources, sample fields) and
// its SP range. MakeLocal serves both kinds of step (FinishLocalDynamic, dynamic_step.cc).
// Sends nothing. Depends on: step_deliver.cc (out.meta, shards_), step_pack.cc or the delivered
// step message (mb_info_, n_loss_sequences_).
#include <cstddef>
#include <utility>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/shard.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

// Microbatch m of this rank: the metadata's arrays, its place in its CP group of cp_size ranks,
// and its shard (moved out of shards_) where its stage holds one.
LocalMicrobatch StepRunner::Impl::MakeLocal(RankStep& out, size_t m, int cp_size, int cp_rank) {
  const MicrobatchMeta& mm = out.meta.microbatches[m];
  LocalMicrobatch lm;
  lm.cu_seqlens = mm.cu_seqlens;
  lm.cu_seqlens_padded = mm.cu_seqlens_padded;
  lm.max_seqlen = mm.max_seqlen;
  lm.n_valid = mm.n_valid;
  lm.total_tokens = mm.cu_seqlens_padded.back();
  lm.cp_size = cp_size;
  lm.cp_rank = cp_rank;
  lm.local_tokens = lm.total_tokens / cp_size;
  if (m < shards_.size() && !shards_[m].empty()) {
    PackedShard& sh = shards_[m][0];
    if (out.first_stage) {
      lm.tokens = std::move(sh.tokens);
      lm.position_ids = std::move(sh.position_ids);
    }
    if (out.last_stage) {
      lm.labels = std::move(sh.labels);
      lm.loss_mask = std::move(sh.loss_mask);
    }
  }
  lm.fields.assign(opts_.fields.size(), {});
  if (m < shards_.size() && !shards_[m].empty()) {
    PackedShard& sh = shards_[m][0];
    for (size_t f = 0; f < sh.fields.size() && f < lm.fields.size(); ++f) {
      const FieldSpec& spec = opts_.fields[f];
      if (spec.per_token() && spec.HeldWith(out.first_stage, out.last_stage)) {
        lm.fields[f] = std::move(sh.fields[f]);
      }
    }
  }
  if (m < mb_info_.size()) {
    MicrobatchSequences& info = mb_info_[m];  // this step's: each microbatch is made once
    lm.sources = std::move(info.sources);
    lm.sample_ids = std::move(info.ids);
    lm.seq_n_targets = std::move(info.n_targets);
    for (size_t k = 0; k < sample_fields_.size() && k < info.sample_fields.size(); ++k) {
      lm.fields[sample_fields_[k]] = std::move(info.sample_fields[k]);
    }
  }
  if (out.first_stage && m < media_local_.size()) lm.media = std::move(media_local_[m]);
  lm.sp_range = {0, lm.local_tokens};
  if (opts_.schedule.parallel.sp()) {
    // The microbatch's layout (the group's, in a dynamic step) makes T/c a multiple of TP.
    auto r = SpRange(lm.local_tokens, topo_.tp_size(), coord_.tp);
    if (r.ok()) lm.sp_range = *r;
  }
  return lm;
}

// Every rank: its LocalMicrobatch list from the metadata and its shards.
void StepRunner::Impl::FinishLocal(RankStep& out) {
  const int cp = topo_.cp_size();
  out.n_loss_sequences = n_loss_sequences_;
  out.microbatches.clear();
  for (size_t m = 0; m < out.meta.microbatches.size(); ++m) {
    LocalMicrobatch lm = MakeLocal(out, m, cp, coord_.cp);
    lm.first_rank = coord_.dp * cp;
    out.microbatches.push_back(std::move(lm));
  }
}

}  // namespace thdpack
