// Loss statistics (docs/design.md section 8): per-shard accumulation with sequence attribution
// through the CP zigzag, merging, and the reported figures.
#include <cmath>
#include <string>
#include <vector>

#include "thdpack/loss.h"
#include "thdpack/shard.h"

namespace thdpack {

void LossStats::Merge(const LossStats& other) {
  n_tokens += other.n_tokens;
  n_loss_tokens += other.n_loss_tokens;
  loss_sum += other.loss_sum;
  entropy_sum += other.entropy_sum;
  for (const auto& [key, seq] : other.sequences) {
    SequenceLoss& mine = sequences[key];
    mine.logprob_sum += seq.logprob_sum;
    mine.n_loss_tokens += seq.n_loss_tokens;
  }
}

LossSummary Finalize(const LossStats& stats) {
  LossSummary s;
  s.n_tokens = stats.n_tokens;
  s.n_loss_tokens = stats.n_loss_tokens;
  if (stats.n_loss_tokens > 0) {
    const double n = static_cast<double>(stats.n_loss_tokens);
    s.loss = stats.loss_sum / n;
    s.entropy = stats.entropy_sum / n;
  }
  double ppl_sum = 0;
  int64_t n_seq = 0;
  for (const auto& [key, seq] : stats.sequences) {  // key order: deterministic
    if (seq.n_loss_tokens <= 0) continue;
    ppl_sum += std::exp(-seq.logprob_sum / static_cast<double>(seq.n_loss_tokens));
    ++n_seq;
  }
  if (n_seq > 0) s.ppl = ppl_sum / static_cast<double>(n_seq);
  return s;
}

Status AccumulateShardLoss(const CrossEntropyResult& result, std::span<const int32_t> cu_seqlens,
                           std::span<const int32_t> cu_seqlens_padded, int cp_size, int cp_rank,
                           std::span<const int64_t> sequence_keys, LossStats* stats) {
  const std::string f = "AccumulateShardLoss";
  if (stats == nullptr) return Status::InvalidArgument(f + ": stats is null");
  if (Status st = ValidateCuSeqlensPadded(cu_seqlens_padded, cp_size); !st.ok()) {
    return st.WithContext(f + ": cu_seqlens_padded");
  }
  if (cp_rank < 0 || cp_rank >= cp_size) {
    return Status::InvalidArgument(f + ": cp_rank = " + std::to_string(cp_rank) +
                                   " must lie in [0, cp_size = " + std::to_string(cp_size) + ")");
  }
  const size_t n = cu_seqlens_padded.size() - 1;
  if (cu_seqlens.size() != n + 1) {
    return Status::InvalidArgument(f + ": cu_seqlens has " + std::to_string(cu_seqlens.size()) +
                                   " entries: it must have n+1 = " + std::to_string(n + 1) +
                                   " like cu_seqlens_padded");
  }
  if (cu_seqlens[0] != 0) {
    return Status::InvalidArgument(f + ": cu_seqlens[0] = " + std::to_string(cu_seqlens[0]) +
                                   " must be 0");
  }
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = int64_t{cu_seqlens[i + 1]} - cu_seqlens[i];
    const int64_t padded = int64_t{cu_seqlens_padded[i + 1]} - cu_seqlens_padded[i];
    if (len < 0 || len > padded) {
      return Status::InvalidArgument(
          f + ": sequence " + std::to_string(i) + " has real length " + std::to_string(len) +
          " (cu_seqlens) and padded length " + std::to_string(padded) +
          " (cu_seqlens_padded): it needs 0 <= real <= padded");
    }
  }
  if (!sequence_keys.empty() && sequence_keys.size() != n) {
    return Status::InvalidArgument(f + ": sequence_keys has " +
                                   std::to_string(sequence_keys.size()) +
                                   " entries: it must be empty or have one per sequence, n = " +
                                   std::to_string(n));
  }
  const size_t local = static_cast<size_t>(cu_seqlens_padded[n] / cp_size);
  if (result.logprobs.size() != local || result.entropy.size() != local ||
      result.counted.size() != local) {
    return Status::InvalidArgument(
        f + ": result holds " + std::to_string(result.logprobs.size()) + " logprobs, " +
        std::to_string(result.entropy.size()) + " entropies and " +
        std::to_string(result.counted.size()) + " counted flags: each must have T/CP = " +
        std::to_string(local));
  }
  THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> pos,
                           LocalPositionIds(cu_seqlens_padded, cp_size, cp_rank));
  LossStats add;
  for (size_t i = 0; i < n; ++i) {
    const int64_t key = sequence_keys.empty() ? static_cast<int64_t>(i) : sequence_keys[i];
    const int64_t len = int64_t{cu_seqlens[i + 1]} - cu_seqlens[i];
    SequenceLoss seq;
    const size_t begin = static_cast<size_t>(cu_seqlens_padded[i] / cp_size);
    const size_t end = static_cast<size_t>(cu_seqlens_padded[i + 1] / cp_size);
    for (size_t k = begin; k < end; ++k) {
      if (pos[k] < len) ++add.n_tokens;
      if (!result.counted[k]) continue;
      seq.logprob_sum += result.logprobs[k];
      seq.n_loss_tokens += 1;
      add.loss_sum -= result.logprobs[k];
      add.entropy_sum += result.entropy[k];
      ++add.n_loss_tokens;
    }
    SequenceLoss& slot = add.sequences[key];
    if (slot.n_loss_tokens != 0 || slot.logprob_sum != 0) {
      return Status::InvalidArgument(f + ": sequence_keys[" + std::to_string(i) + "] = " +
                                     std::to_string(key) +
                                     " repeats an earlier key of this microbatch: keys must be "
                                     "unique per sequence");
    }
    slot = seq;
  }
  stats->Merge(add);
  return Status::Ok();
}

}  // namespace thdpack
