// Loss statistics (docs/design.md section 8): per-shard accumulation with sequence attribution
// through the CP zigzag, merging, and the reported figures.
#include <algorithm>
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

void LossTotals::Add(const LossStats& whole) {
  n_tokens += whole.n_tokens;
  n_loss_tokens += whole.n_loss_tokens;
  loss_sum += whole.loss_sum;
  entropy_sum += whole.entropy_sum;
  for (const auto& [key, seq] : whole.sequences) {  // key order: deterministic
    if (seq.n_loss_tokens <= 0) continue;
    ppl_sum += std::exp(-seq.logprob_sum / static_cast<double>(seq.n_loss_tokens));
    ++n_ppl;
  }
}

void LossTotals::Add(const LossTotals& other) {
  n_tokens += other.n_tokens;
  n_loss_tokens += other.n_loss_tokens;
  loss_sum += other.loss_sum;
  entropy_sum += other.entropy_sum;
  ppl_sum += other.ppl_sum;
  n_ppl += other.n_ppl;
}

namespace {

// A summed count back from a double: an error unless it is a non-negative integer.
constexpr const char* kRanksAgree = " (do the ranks of the group agree on what they reduce?)";

Result<int64_t> CountOf(double v, const char* fn, const std::string& what,
                        const char* hint = "") {
  if (!(v >= 0) || v > 9007199254740992.0 || v != std::floor(v)) {
    return Status::InvalidArgument(std::string(fn) + ": the summed " + what + " is " +
                                   std::to_string(v) +
                                   ": a count must be a non-negative integer below 2^53" + hint);
  }
  return static_cast<int64_t>(v);
}

}  // namespace

Result<LossTotals> LossTotals::FromSums(std::span<const double> sums) {
  const char* f = "LossTotals::FromSums";
  if (sums.size() != 6) {
    return Status::InvalidArgument(std::string(f) + ": " + std::to_string(sums.size()) +
                                   " sums given: it takes 6 (n_tokens, n_loss_tokens, loss_sum, "
                                   "entropy_sum, ppl_sum, n_ppl)");
  }
  LossTotals t;
  THDPACK_ASSIGN_OR_RETURN(t.n_tokens, CountOf(sums[0], f, "n_tokens"));
  THDPACK_ASSIGN_OR_RETURN(t.n_loss_tokens, CountOf(sums[1], f, "n_loss_tokens"));
  THDPACK_ASSIGN_OR_RETURN(t.n_ppl, CountOf(sums[5], f, "sequence count"));
  t.loss_sum = sums[2];
  t.entropy_sum = sums[3];
  t.ppl_sum = sums[4];
  return t;
}

Status LossTotals::AllReduce(const AllReduceSum& all_reduce_sum) {
  double v[6] = {static_cast<double>(n_tokens), static_cast<double>(n_loss_tokens), loss_sum,
                 entropy_sum, ppl_sum, static_cast<double>(n_ppl)};
  THDPACK_RETURN_IF_ERROR(all_reduce_sum(std::span<double>(v)));
  Result<LossTotals> reduced = FromSums(v);
  if (!reduced.ok()) {
    return Status::InvalidArgument("LossTotals::AllReduce: " + reduced.status().message() +
                                   kRanksAgree);
  }
  *this = *reduced;
  return Status::Ok();
}

LossSummary Finalize(const LossTotals& totals) {
  LossSummary s;
  s.n_tokens = totals.n_tokens;
  s.n_loss_tokens = totals.n_loss_tokens;
  if (totals.n_loss_tokens > 0) {
    const double n = static_cast<double>(totals.n_loss_tokens);
    s.loss = totals.loss_sum / n;
    s.entropy = totals.entropy_sum / n;
  }
  if (totals.n_ppl > 0) s.ppl = totals.ppl_sum / static_cast<double>(totals.n_ppl);
  return s;
}

LossSummary Finalize(const LossStats& stats) {
  LossTotals totals;
  totals.Add(stats);
  return Finalize(totals);
}

Status ReduceSequencesOverCp(const AllReduceSum& all_reduce_sum, int cp_rank, LossStats* stats) {
  const char* f = "ReduceSequencesOverCp";
  if (stats == nullptr) return Status::InvalidArgument(std::string(f) + ": stats is null");
  if (cp_rank < 0) {
    return Status::InvalidArgument(std::string(f) + ": cp_rank = " + std::to_string(cp_rank) +
                                   " must be >= 0");
  }
  const size_t n = stats->sequences.size();
  std::vector<double> v(2 * n);
  size_t i = 0;
  for (const auto& [key, seq] : stats->sequences) {  // key order: the same on every CP rank
    v[i] = seq.logprob_sum;
    v[n + i] = static_cast<double>(seq.n_loss_tokens);
    ++i;
  }
  THDPACK_RETURN_IF_ERROR(all_reduce_sum(std::span<double>(v)));
  if (!CountsWholeSequences(cp_rank)) {
    stats->sequences.clear();
    return Status::Ok();
  }
  i = 0;
  for (auto& [key, seq] : stats->sequences) {
    seq.logprob_sum = v[i];
    THDPACK_ASSIGN_OR_RETURN(seq.n_loss_tokens,
                             CountOf(v[n + i], f,
                                     "loss-token count of sequence " + std::to_string(key),
                                     kRanksAgree));
    ++i;
  }
  return Status::Ok();
}

namespace {

// The offsets' checks and the sequences of one shard, for AccumulateShardLoss and
// ShardSequenceLayout; errors start with f.
Result<ShardSequences> LayoutOf(std::span<const int32_t> cu_seqlens,
                                std::span<const int32_t> cu_seqlens_padded, int cp_size,
                                int cp_rank, const std::string& f) {
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
  // A local token is real when its global position inside its padded sequence is below L_i.
  THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> pos,
                           LocalPositionIds(cu_seqlens_padded, cp_size, cp_rank));
  ShardSequences layout;
  layout.local_cu.resize(n + 1);
  layout.real_tokens.assign(n, 0);
  for (size_t i = 0; i <= n; ++i) layout.local_cu[i] = cu_seqlens_padded[i] / cp_size;
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = int64_t{cu_seqlens[i + 1]} - cu_seqlens[i];
    for (int64_t k = layout.local_cu[i]; k < layout.local_cu[i + 1]; ++k) {
      if (pos[static_cast<size_t>(k)] < len) ++layout.real_tokens[i];
    }
  }
  return layout;
}

}  // namespace

Result<ShardSequences> ShardSequenceLayout(std::span<const int32_t> cu_seqlens,
                                           std::span<const int32_t> cu_seqlens_padded,
                                           int cp_size, int cp_rank) {
  return LayoutOf(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, "ShardSequenceLayout");
}

Status AddShardBySource(const CrossEntropyResult& result, std::span<const int32_t> cu_seqlens,
                        std::span<const int32_t> cu_seqlens_padded, int cp_size, int cp_rank,
                        std::span<const int32_t> sources, const AllReduceSum* all_reduce_sum,
                        std::vector<LossTotals>* by_source) {
  const std::string f = "AddShardBySource";
  if (by_source == nullptr) return Status::InvalidArgument(f + ": by_source is null");
  if (cp_size > 1 && all_reduce_sum == nullptr) {
    return Status::InvalidArgument(f + ": cp_size " + std::to_string(cp_size) +
                                   " needs an all-reduce over the CP group");
  }
  THDPACK_ASSIGN_OR_RETURN(ShardSequences layout,
                           LayoutOf(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, f));
  const size_t n = layout.real_tokens.size();
  if (sources.size() != n) {
    return Status::InvalidArgument(f + ": sources has " + std::to_string(sources.size()) +
                                   " entries, the microbatch " + std::to_string(n) +
                                   " sequences");
  }
  int32_t top = -1;
  for (size_t i = 0; i < n; ++i) {
    if (sources[i] < 0) {
      return Status::InvalidArgument(f + ": sources[" + std::to_string(i) + "] = " +
                                     std::to_string(sources[i]) + " is negative");
    }
    top = std::max(top, sources[i]);
  }
  const size_t local = static_cast<size_t>(layout.local_cu[n]);
  if (result.logprobs.size() != local || result.entropy.size() != local ||
      result.counted.size() != local) {
    return Status::InvalidArgument(f + ": result arrays must have T/CP = " +
                                   std::to_string(local) + " entries");
  }
  std::vector<LossTotals> add(static_cast<size_t>(top + 1));
  std::vector<double> seq(2 * n, 0.0);  // per sequence: log-prob sum, then loss-token count
  for (size_t i = 0; i < n; ++i) {
    LossTotals& t = add[static_cast<size_t>(sources[i])];
    t.n_tokens += layout.real_tokens[i];
    for (size_t k = static_cast<size_t>(layout.local_cu[i]);
         k < static_cast<size_t>(layout.local_cu[i + 1]); ++k) {
      if (!result.counted[k]) continue;
      seq[i] += result.logprobs[k];
      seq[n + i] += 1;
      t.loss_sum -= result.logprobs[k];
      t.entropy_sum += result.entropy[k];
      ++t.n_loss_tokens;
    }
  }
  if (cp_size > 1) THDPACK_RETURN_IF_ERROR((*all_reduce_sum)(std::span<double>(seq)));
  if (CountsWholeSequences(cp_rank)) {
    for (size_t i = 0; i < n; ++i) {
      THDPACK_ASSIGN_OR_RETURN(const int64_t count,
                               CountOf(seq[n + i], f.c_str(),
                                       "loss-token count of sequence " + std::to_string(i),
                                       kRanksAgree));
      if (count <= 0) continue;
      LossTotals& t = add[static_cast<size_t>(sources[i])];
      t.ppl_sum += std::exp(-seq[i] / static_cast<double>(count));
      ++t.n_ppl;
    }
  }
  if (by_source->size() < add.size()) by_source->resize(add.size());
  for (size_t s = 0; s < add.size(); ++s) (*by_source)[s].Add(add[s]);
  return Status::Ok();
}

Status AccumulateShardLoss(const CrossEntropyResult& result, std::span<const int32_t> cu_seqlens,
                           std::span<const int32_t> cu_seqlens_padded, int cp_size, int cp_rank,
                           std::span<const int64_t> sequence_keys, LossStats* stats) {
  const std::string f = "AccumulateShardLoss";
  if (stats == nullptr) return Status::InvalidArgument(f + ": stats is null");
  THDPACK_ASSIGN_OR_RETURN(ShardSequences layout,
                           LayoutOf(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, f));
  const size_t n = layout.real_tokens.size();
  if (!sequence_keys.empty() && sequence_keys.size() != n) {
    return Status::InvalidArgument(f + ": sequence_keys has " +
                                   std::to_string(sequence_keys.size()) +
                                   " entries: it must be empty or have one per sequence, n = " +
                                   std::to_string(n));
  }
  const size_t local = static_cast<size_t>(layout.local_cu[n]);
  if (result.logprobs.size() != local || result.entropy.size() != local ||
      result.counted.size() != local) {
    return Status::InvalidArgument(
        f + ": result holds " + std::to_string(result.logprobs.size()) + " logprobs, " +
        std::to_string(result.entropy.size()) + " entropies and " +
        std::to_string(result.counted.size()) + " counted flags: each must have T/CP = " +
        std::to_string(local));
  }
  LossStats add;
  for (size_t i = 0; i < n; ++i) {
    const int64_t key = sequence_keys.empty() ? static_cast<int64_t>(i) : sequence_keys[i];
    SequenceLoss seq;
    add.n_tokens += layout.real_tokens[i];
    const size_t begin = static_cast<size_t>(layout.local_cu[i]);
    const size_t end = static_cast<size_t>(layout.local_cu[i + 1]);
    for (size_t k = begin; k < end; ++k) {
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
