// thdpack/memory_report.h: the memory report of docs/design.md section 9 - per step, what a plan
// implies for one rank (analytic: logits bytes with and without the CP-local loss, the buffers
// thdpack holds); per rank, what it holds after a step (the bytes of its arrays) and the
// process's resident memory, written as one JSON file per rank (`thdpack run
// --memory-profile-steps`). docs/memory.md describes the figures and the files.
//
// Legend (docs/design.md): T padded tokens of a microbatch, n its sequences, V vocabulary, CP, TP.
// Logits live on the last pipeline stage: [T/CP, ceil(V/TP)] per rank with the CP-local loss,
// [T, ceil(V/TP)] when they are gathered over the CP group first (LogitsMemoryBytes).
//
// Thread-safety: pure functions, except WriteMemoryProfile, which reads /proc/self/status and
// writes one file (ranks may write their own files concurrently: distinct names), and
// ProfileRankMemory, a collective of one rank.
#ifndef THDPACK_MEMORY_REPORT_H_
#define THDPACK_MEMORY_REPORT_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "thdpack/comm.h"
#include "thdpack/data.h"
#include "thdpack/loss.h"
#include "thdpack/memory.h"
#include "thdpack/schedule.h"
#include "thdpack/status.h"
#include "thdpack/rank_step.h"
#include "thdpack/topology.h"

namespace thdpack {

struct MemoryReportOptions {
  // V of the model's output layer; 0 (the default): unknown, and no logits figures.
  int64_t vocab_size = 0;
  // dtype of the logits (and of the fused gradient). Default bf16.
  LogitsDtype logits_dtype = LogitsDtype::kBFloat16;
  // Count the gradient w.r.t. the logits, fused with the loss: a second buffer of the logits'
  // shape. Default off.
  bool with_grad = false;
};

// The logits bytes of one last-stage rank for the largest microbatch of a step.
struct LogitsFigures {
  int64_t total_tokens = 0;  // T of the largest microbatch
  int64_t vocab_size = 0;    // V
  LogitsDtype dtype = LogitsDtype::kBFloat16;
  int cp_size = 1;
  int tp_size = 1;           // vocab-parallel columns per rank: ceil(V / TP)
  bool with_grad = false;
  LogitsMemory bytes;        // LogitsMemoryBytes(T, CP, V, dtype, TP, with_grad)
};

// ---- Per step, from the plan (what `thdpack plan` and `thdpack run` print). ----

struct StepMemoryFigures {
  // The replica whose ranks hold the most buffer bytes (the lowest index on ties), and the
  // per-rank bytes of its buffers: BufferBytes (memory.h) summed over its M microbatches.
  int busiest_replica = 0;
  int num_microbatches = 0;
  MicrobatchBufferBytes buffers;
  // For the largest microbatch of the step (over every replica); nullopt when
  // MemoryReportOptions::vocab_size is 0.
  std::optional<LogitsFigures> logits;
};

// The memory figures of a step whose plan is `plan` (made by Schedule from `samples` and
// `options`): microbatch layouts by ComputeLayout (pack.h) with options' parallel layout, as the packing
// code lays them out. Errors: a plan that names an id absent
// from `samples` or whose shape does not match (InvalidArgument), a vocab_size < 0 or a bad
// dtype (naming it), overflow (OutOfRange).
[[nodiscard]] Result<StepMemoryFigures> ComputeStepMemory(std::span<const SampleLength> samples,
                                                          const ScheduleOptions& options,
                                                          const Plan& plan,
                                                          const MemoryReportOptions& memory);

// The same figures from the plan's figures (ComputePlanFigures or ScheduleWithFigures, with
// their per-microbatch detail): a microbatch's buffers depend only on its T and its number of
// sequences, so no id is looked up and no layout is built. Equal to ComputeStepMemory on the
// plan the figures are of (tested on random plans). Errors: figures without replicas or
// microbatches, and those of ComputeStepMemory.
[[nodiscard]] Result<StepMemoryFigures> ComputeStepMemoryFromFigures(
    const PlanFigures& figures, const ScheduleOptions& options, const MemoryReportOptions& memory);

// The same figures for a histogram step planned in bulk (PlanHistogram, DP = 1): each class's
// layout is computed once and counted `count` times. Equal to ComputeStepMemory on the
// expanded plan (tested). Errors: as ComputeStepMemory.
[[nodiscard]] Result<StepMemoryFigures> ComputeHistogramStepMemory(
    const HistogramPlan& plan, const ScheduleOptions& options, const MemoryReportOptions& memory);

// {"logits":<LogitsFiguresJson or null>,"buffers_per_rank":{"replica","num_microbatches",
// "tokens","position_ids","labels","loss_mask","metadata","loss_outputs","total"}} on one line:
// the `memory` field of a step's figures (figures.h), identical in `plan` and `run`.
std::string StepMemoryJson(const StepMemoryFigures& figures);

// {"largest_microbatch_tokens","vocab_size","dtype" ("bfloat16", ...),"cp_size","tp_size",
// "with_grad","local_bytes","gathered_bytes","local_grad_bytes","gathered_grad_bytes",
// "local_total_bytes","gathered_total_bytes"} on one line; every byte count exact.
std::string LogitsFiguresJson(const LogitsFigures& figures);

// ---- Per rank, from what it holds after a step. ----

// Bytes of the arrays a rank holds, summed over its microbatches: each vector's size() times
// its element size (RankStep's LocalMicrobatch: tokens and position_ids on the first stage,
// labels and loss_mask on the last, cu_seqlens, cu_seqlens_padded, the sample ids and
// loss-token counts - "metadata" - on every rank, and the buffers of the run's fields - input
// ones on the first stage, target ones on the last, sample ones everywhere).
struct HeldBufferBytes {
  int64_t tokens = 0;
  int64_t position_ids = 0;
  int64_t labels = 0;
  int64_t loss_mask = 0;
  int64_t metadata = 0;
  int64_t fields = 0;
  int64_t total = 0;
};

struct RankMemoryFigures {
  int64_t step = 0;
  int rank = 0;  // global rank
  Coord coord;
  bool first_stage = false;
  bool last_stage = false;
  int num_microbatches = 0;
  HeldBufferBytes held;
  // The logits of the rank's largest microbatch: on the last stage when the vocabulary is
  // known, nullopt otherwise (other stages hold no logits).
  std::optional<LogitsFigures> logits;
};

// The figures of one rank. REQUIRES: `step` came from a StepRunner on `topology`. Errors:
// step.coord outside the topology; as ComputeStepMemory for the options.
[[nodiscard]] Result<RankMemoryFigures> ComputeRankMemory(const RankStep& step,
                                                          const Topology& topology,
                                                          const MemoryReportOptions& memory);

// "step_<N>/rank<R>_pp<p>_dp<d>_cp<c>_tp<t>.json", e.g. "step_0/rank5_pp0_dp1_cp0_tp1.json".
std::string MemoryProfileFileName(int64_t step, int rank, const Coord& coord);

// The profile of one rank, indented JSON ending in a newline: step, rank, pp, dp, cp, tp,
// first_stage, last_stage, num_microbatches, held_bytes {tokens, position_ids, labels,
// loss_mask, metadata, fields, total}, logits (LogitsFiguresJson or null), process
// {peak_rss_bytes, rss_bytes, ranks_in_process[, note]} or null when `process` is nullopt.
// The note is present when ranks_in_process > 1: the resident figures are then the whole
// process's, shared by that many ranks (the threads backend), not this rank's own.
std::string RankMemoryJson(const RankMemoryFigures& figures,
                           const std::optional<ProcessMemory>& process, int ranks_in_process);

// Writes RankMemoryJson(figures, ReadProcessMemory() now - nullopt if it fails,
// ranks_in_process) to dir/MemoryProfileFileName(...), creating the folders and replacing an
// existing file. REQUIRES: ranks_in_process >= 1. IOError naming the path when a folder cannot
// be made or the file cannot be written.
[[nodiscard]] Status WriteMemoryProfile(std::string_view dir, const RankMemoryFigures& figures,
                                        int ranks_in_process);

// `thdpack run --memory-profile-steps` on one rank: ComputeRankMemory and WriteMemoryProfile
// under `dir` (ranks_in_process: world.size() on the threads backend, whose ranks share one
// process and so its resident memory; 1 otherwise). Collective over `world`: a failure on any
// rank is every rank's (AgreeOnStatus), so call it on every rank at the same steps. Errors: as
// ComputeRankMemory; WriteMemoryProfile's IOError with the context "--memory-profile-dir".
[[nodiscard]] Status ProfileRankMemory(ProcessGroup& world, const RankStep& step,
                                       const Topology& topology,
                                       const MemoryReportOptions& memory, std::string_view dir);

}  // namespace thdpack

#endif  // THDPACK_MEMORY_REPORT_H_
