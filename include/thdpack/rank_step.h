// thdpack/rank_step.h: what one rank holds after a distributed step (thdpack/step_runner.h
// makes it; thdpack/probe.h and thdpack/memory_report.h read it), and the phases a step is timed
// by.
//
// Thread-safety: plain values.
#ifndef THDPACK_RANK_STEP_H_
#define THDPACK_RANK_STEP_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/data.h"
#include "thdpack/run_state.h"
#include "thdpack/sample.h"
#include "thdpack/schedule.h"
#include "thdpack/step_wire.h"
#include "thdpack/topology.h"
#include "thdpack/wire.h"

namespace thdpack {

// The phases of one step, in the order they run (thdpack/step_runner.h describes each);
// kAgree collects the status agreements between phases.
enum class Phase { kRead, kLengths, kPlan, kExchange, kPack, kDeliver, kAgree };
inline constexpr int kNumPhases = 7;
// "read", "lengths", "plan", "exchange", "pack", "deliver", "agree": the names `thdpack run
// --json` prints (bytes_sent.<name>, time_<name>).
std::string_view PhaseName(Phase phase);

// One microbatch as one rank holds it. Shapes: T padded tokens of the microbatch, n sequences.
struct LocalMicrobatch {
  // Every rank of every stage: the GLOBAL layout (TransformerEngine's THD attention takes it).
  std::vector<int32_t> cu_seqlens;         // [n+1]
  std::vector<int32_t> cu_seqlens_padded;  // [n+1]
  int32_t max_seqlen = 0;                  // largest padded length
  int64_t n_valid = 0;                     // loss tokens of the whole microbatch
  int64_t total_tokens = 0;                // T
  int64_t local_tokens = 0;                // T/CP
  // The first stage only (empty elsewhere): this CP rank's zigzag shard, [T/CP].
  std::vector<TokenId> tokens;
  std::vector<int32_t> position_ids;
  // The last stage only (empty elsewhere): [T/CP], CP-sharded, not SP-split.
  std::vector<TokenId> labels;
  std::vector<uint8_t> loss_mask;
  // A blend (thdpack/blend.h): [n], the index of each sequence's source in the blend's list,
  // on every rank; empty for other data.
  std::vector<int32_t> sources;
  // Every rank: [n], each packed sequence's sample id (a caller-fed source's: its stream
  // position) and its loss-token count over the whole sequence (not this rank's shard).
  std::vector<int64_t> sample_ids;
  std::vector<int64_t> seq_n_targets;
  // One buffer per field of the run's schema (StepRunnerOptions::fields, thdpack/fields.h), as
  // bytes: an input field's [T/CP, w] on the first stage, a target field's [T/CP, w] on the last
  // (CP-sharded like the tokens and the labels, not SP-split), a sample field's [n, w] on every
  // rank; empty where the stage does not hold it.
  std::vector<std::vector<std::byte>> fields;
  // The first stage only, with media declared (StepRunnerOptions::media): what this rank
  // encodes of the microbatch's media and where the rows go (thdpack/step_wire.h MediaShard);
  // empty parts elsewhere.
  MediaShard media;
  // This TP rank's part of the [T/CP] activations under SP: (offset, count). Without SP the
  // whole range (0, T/CP).
  std::pair<int64_t, int64_t> sp_range{0, 0};
  // The CP group that shares this microbatch. CP in the comments above is cp_size. Static
  // schedulers: the topology's CP group (cp_size = CP, cp_rank = the rank's cp, first_rank =
  // dp*CP, cp_group null: the topology's CP group is meant). Dynamic (thdpack/schedule.h): the
  // plan's group of this microbatch, domain ranks first_rank .. first_rank + cp_size - 1 (domain
  // index dp*CP + cp), cp_rank this rank's position in it, cp_group its ProcessGroup at this
  // rank's (tp, pp) (shared with the runner's cache of groups). idle: the rank is in no group of
  // this microbatch - cu_seqlens = cu_seqlens_padded = {0}, no tokens, cp_size 1, cp_group null.
  int cp_size = 1;
  int cp_rank = 0;
  int first_rank = 0;
  bool idle = false;
  std::shared_ptr<ProcessGroup> cp_group;
};

// Time and bytes of one phase on one rank.
struct PhaseStats {
  Phase phase = Phase::kRead;
  double seconds = 0;
  int64_t bytes_sent = 0;  // ProcessGroup::bytes_sent rule (thdpack/comm.h)
};

// What one rank holds after a step.
struct RankStep {
  int64_t step = 0;   // 0, 1, ...
  int64_t epoch = 0;  // the source's epoch when the step's first sample was read
  Coord coord;
  // Planned the step: the loaders (every rank with DataOn::kAll); with the dynamic scheduler the
  // heads (every rank with DataOn::kAll).
  bool is_loader = false;
  bool first_stage = false;   // pp == 0
  bool last_stage = false;    // pp == PP-1
  // This replica's metadata as every rank of the replica holds it (decoded from the wire on
  // non-loaders): microbatch layouts, the replica's token sums, the GLOBAL loss-token count N
  // (n_loss_tokens), skipped ids, epoch.
  StepMeta meta;
  std::vector<LocalMicrobatch> microbatches;  // [M]
  // Loaders only (empty elsewhere): the step's samples in scheduling order (loader 0's first)
  // and the plan every loader computed from them - what the step figures are made of.
  std::vector<SampleLength> samples;
  Plan plan;
  // With media (loaders only, as samples): each sample's encoder work, and the encoder's term
  // the plan was balanced with (ScheduleOptions::encoder_cost) - what the figures charge.
  std::vector<EncoderWork> encoder_work;
  EncoderCost encoder_cost;
  // With media, on the loader: for each microbatch of its replica, each CP rank's share - the
  // encoder's cost of the items it encodes (encoder_cost's unit) and their payload bytes.
  std::vector<std::vector<double>> media_rank_cost;    // [M][CP]
  std::vector<std::vector<int64_t>> media_rank_bytes;  // [M][CP]
  // With media, on every rank: the encoder's term that places items (StepRunnerOptions::
  // media_cost as the runner resolved it) - what places them over encoder ranks of their own.
  std::optional<EncoderCost> media_cost;
  // The dynamic scheduler: dynamic is true on every rank; dynamic_plan is set, with samples, on
  // the heads that plan (tp = 0, pp = 0 of every domain index), and `plan` stays empty.
  // groups_made / groups_reused: the CP process groups this step split from the world and took
  // from the runner's cache (keyed by first rank and size, kept across steps); groups_evicted:
  // those the cache dropped after this step (StepRunnerOptions::max_cp_groups); groups_cached:
  // those it holds now. The same on every rank.
  bool dynamic = false;
  DynamicPlan dynamic_plan;
  // The dynamic scheduler: the CP groups of the step's microbatches, (first domain rank, size)
  // sorted and unique, on every rank (what CpGroupCache::Attach makes).
  std::vector<std::pair<int, int>> cp_groups;
  int64_t groups_made = 0;
  int64_t groups_reused = 0;
  int64_t groups_evicted = 0;
  int64_t groups_cached = 0;
  // Loaders only: empty documents the source passed over in this step (StepShare::n_empty).
  int64_t n_empty = 0;
  // Loaders only: what a splitting source cut in this step (StepShare::split).
  SplitCounts split;
  // Loaders only, oversize policy 'truncate': the samples of the step cut to the longest kept
  // length (thdpack/schedule.h), their tokens and loss tokens cut - every loader's together.
  Truncation truncated;
  // Every rank: the step's sequences with at least one loss token, over all replicas (the
  // denominator of a per-sequence mean, as meta.n_loss_tokens is of a per-token one).
  int64_t n_loss_sequences = 0;
  // One entry per phase that ran, in Phase order (kAgree last).
  std::vector<PhaseStats> phases;
  int64_t bytes_sent() const;
  // The run's state once this step is done (thdpack/run_state.h): next_step = step + 1, the
  // samples consumed through this step and the source's cursor there, and the run's
  // fingerprint. The same on every rank (readers send it with the lengths and the metadata).
  RunState after;
  // What a StepSource's on_step hook made of the step where it was made (the torch iterator's
  // arrays and dicts): the caller's own, opaque to thdpack; null otherwise.
  std::shared_ptr<void> prepared;
};

}  // namespace thdpack

#endif  // THDPACK_RANK_STEP_H_
