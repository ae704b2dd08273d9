// thdpack/probe.h: a small, deterministic probe model that checks the whole data path end to
// end (docs/design.md sections 5, 7 and 8): whatever the topology, a correct data plane gives the
// same loss, perplexity, entropy and token counts as one rank computing each sample alone.
//
// The model (fp64 throughout, weights drawn from a seed, nothing trained):
//   x = E[token mod V]                                       embedding, [rows, H]
//   per layer:  x += Attn(RMSNorm(x)) Wo                      causal, per sequence, RoPE
//               x += tanh(RMSNorm(x) W1) W2                   feed-forward, [H, F] and [F, H]
//   logits = RMSNorm(x) Wout                                  [rows, V]
// Attention: per head (head size d = H / heads), q and k rotated by RoPE at the token's
// position id, scores q.k / sqrt(d), and a token at position p of a sequence attends to the
// tokens at positions 0..p of the same sequence. Labels are taken mod V (so any token ids
// work with a small V); -100 stays the ignore index.
//
// Distributed (ProbeRunner), on what one rank holds after a step (thdpack/rank_step.h):
//   PP   layers split over the stages (stage s holds layers [s*L/PP, (s+1)*L/PP)); the first
//        stage embeds its CP-local tokens, every stage sends its activations to the next
//        (same tp, cp, dp), the last computes logits and the loss.
//   CP   each rank holds its zigzag shard [T/CP]; attention all-gathers K and V over the CP
//        group and masks by GLOBAL position: a local query at global index g of sequence i
//        attends to global indices [cu_seqlens_padded[i], g].
//   SP   (sp on and TP > 1) each TP rank keeps its contiguous part [T/(CP*TP)] of the
//        activations (LocalMicrobatch::sp_range); K and V are all-gathered over the TP group
//        before the CP gather, and the last stage all-gathers the rows before the output layer.
//   TP   the output layer is vocab-parallel: TP rank t computes columns
//        [t*V/TP, (t+1)*V/TP) and the loss comes from VocabParallelPartials, an all-gather of
//        the partials over the TP group and CombineVocabPartials (thdpack/loss.h).
//   Position ids are derived from the metadata on every stage (LocalPositionIds) and checked
//   against the delivered ones on the first stage.
//   Statistics: per-sequence log-prob sums all-reduced over the CP group, then one all-reduce
//   over the world; N comes from the metadata and is checked against the counted tokens.
//   The pipeline runs microbatch by microbatch, stage by stage, with a status agreement over
//   the world after each stage's compute: an error on one rank returns as an error on every
//   rank, and none waits for activations a failed rank would never send.
//
// The reference (ProbeReferenceLoss) runs each sample alone, unpacked and unpadded (positions
// 0..L-1), from its own plain reading of the data; only the model's building blocks (embedding,
// projections, RoPE, norms, the attention of one query row over its keys - a vectorised kernel
// checked against a plain loop - and the output layer) are shared, so a disagreement points at
// the data path (packing, sharding, routing, metadata), not at the model. Each sample's
// reference is computed once: the samples are shared out over the ranks (and, where cores are
// left, over threads), and the totals all-reduced.
//
// Thread-safety: ProbeModel is immutable after Create and may be shared between threads. A
// ProbeRunner belongs to one rank (use it from that rank's thread only).
#ifndef THDPACK_PROBE_H_
#define THDPACK_PROBE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/data.h"
#include "thdpack/loss.h"
#include "thdpack/sample.h"
#include "thdpack/status.h"
#include "thdpack/rank_step.h"
#include "thdpack/step.h"
#include "thdpack/topology.h"

namespace thdpack {

struct StepRunnerOptions;  // thdpack/step_runner.h: StepVerifier::Create takes the runner's

struct ProbeConfig {
  int64_t vocab_size = 256;  // V: token ids and labels are taken mod V; >= TP
  int hidden = 32;           // H: a multiple of 2 * heads (RoPE rotates pairs)
  int heads = 4;
  int layers = 4;            // L >= 1; a stage may hold none when PP > L (it passes through)
  int ffn = 64;              // F
  double rope_base = 10000;
  uint64_t seed = 1;         // every weight is a pure function of (seed, tensor, index)
};

class ProbeModel {
 public:
  // Errors (InvalidArgument naming the field): sizes < 1, hidden not a multiple of 2*heads,
  // rope_base <= 1, vocab_size * hidden over 2^28 weights.
  [[nodiscard]] static Result<ProbeModel> Create(const ProbeConfig& config);

  const ProbeConfig& config() const { return config_; }
  int head_dim() const { return config_.hidden / config_.heads; }

  // Layers [first, second) of pipeline stage pp of pp_size.
  std::pair<int, int> StageLayers(int pp, int pp_size) const;

  // ---- Building blocks on row-major [rows, H] fp64 activations. ----

  // x[r] = E[tokens[r] mod V]. REQUIRES x.size() == tokens.size() * H.
  void Embed(std::span<const TokenId> tokens, std::span<double> x) const;
  // q, k, v of `layer` for the rows of x: RMSNorm, the three projections, RoPE on q and k at
  // positions[r]. REQUIRES every span [rows, H] (positions [rows]).
  void Qkv(int layer, std::span<const double> x, std::span<const int32_t> positions,
           std::span<double> q, std::span<double> k, std::span<double> v) const;
  // x += attn Wo, then x += tanh(RMSNorm(x) W1) W2. REQUIRES attn and x [rows, H].
  void AttnOutAndMlp(int layer, std::span<const double> attn, std::span<double> x) const;
  // logits[r, c - col_begin] = (RMSNorm(x[r]) Wout)[c] for c in [col_begin, col_end).
  // REQUIRES 0 <= col_begin < col_end <= V, logits [rows, col_end - col_begin].
  void Logits(std::span<const double> x, int64_t col_begin, int64_t col_end,
              std::span<double> logits) const;

 private:
  explicit ProbeModel(const ProbeConfig& config) : config_(config) {}
  std::span<const double> Layer(int layer, int tensor) const;

  ProbeConfig config_;
  std::vector<double> embedding_;  // [V, H]
  std::vector<double> layers_;     // per layer: norm1 [H], Wq, Wk, Wv, Wo [H, H], norm2 [H],
                                   // W1 [H, F], W2 [F, H]
  std::vector<double> final_norm_;  // [H]
  std::vector<double> output_;      // [H, V]
  int64_t layer_stride_ = 0;
};

// The single-rank reference: each sample alone (positions 0..L-1, no padding), labels
// tokens[j+1] mod V with target_mask[j+1], the fp64 CrossEntropyReference, statistics keyed by
// sample id (LossStats, Finalize of thdpack/loss.h). REQUIRES unique ids.
[[nodiscard]] Result<LossStats> ProbeReferenceLoss(const ProbeModel& model,
                                                   std::span<const SampleView> samples,
                                                   int num_threads = 1);

// Reads one step's samples (tokens and masks) the plain way, for the reference: N samples in
// source order with Next(), Reset() at the end of an epoch; global_batch 0 = the rest of the
// epoch (then Reset). Samples whose id is in skipped_ids are left out. Separate from
// StepReader (thdpack/step.h) ON PURPOSE: it is the independent reference the verifier
// compares the step runner's reading against, so it must not share that code.
// tokens.tokens B > 0: the step's samples in source order by TokenSteps' rule (within B, the
// first always, at least min_samples no longer than longest_counted); the sample refused is
// kept in state->pending (REQUIRED then) and is the next call's first. split_longest > 0
// (`--oversize split`): every sample longer is cut into pieces of that many tokens the plain
// way (ids and rule of OpenSplitSource, data.h), the pieces not yet taken kept in
// state->pending (REQUIRED then) and the ids they add in state->split_extra.
struct PlainReadState {
  std::deque<Sample> pending;
  int64_t split_extra = 0;
};
[[nodiscard]] Result<std::vector<Sample>> ReadStepSamplesPlain(
    SampleSource& source, int64_t global_batch, std::span<const int64_t> skipped_ids,
    TokenSteps tokens = {}, PlainReadState* state = nullptr, int64_t split_longest = 0);

// The next sample of that plain stream (a pending one first, else the source's, cut when
// split_longest > 0); nullopt at the end of the source's epoch.
[[nodiscard]] Result<std::optional<Sample>> NextSamplePlain(SampleSource& source,
                                                            PlainReadState& state,
                                                            int64_t split_longest);

// One rank's part of the distributed probe. Collective: every rank of the world creates one and
// calls Forward on every step, in the same order.
class ProbeRunner {
 public:
  // Splits the TP, CP and PP groups from `world`. world and model must outlive the runner.
  // REQUIRES world.size() == topology.world_size(), model.config().vocab_size >= TP.
  [[nodiscard]] static Result<std::unique_ptr<ProbeRunner>> Create(ProcessGroup& world,
                                                                   const Topology& topology,
                                                                   const ProbeModel& model,
                                                                   bool sp);
  ~ProbeRunner();

  // Runs the probe on every microbatch of this rank's step and returns the step's statistics,
  // the same on every rank. `step` is what StepRunner::Next returned on this rank. Errors:
  // arrays of the wrong size, position ids that differ from the metadata's, counted tokens
  // that differ from the metadata's N or real tokens (Internal: the data path is wrong), and
  // any rank's failure (agreed over the world).
  [[nodiscard]] Result<LossSummary> Forward(const RankStep& step);

 private:
  class Impl;
  explicit ProbeRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `thdpack run --verify` on one rank: the probe (ProbeRunner) over the microbatches of each
// step, and on world rank 0 the single-rank reference of the same global batch, read the plain
// way (ReadStepSamplesPlain) from a source of its own; the comparison is agreed over the world,
// so a mismatch stops every rank. Collective like ProbeRunner: every rank creates one and calls
// Check on every step, in order. Thread-safety: one rank's, as ProbeRunner.
class StepVerifier {
 public:
  // options: the StepRunner's (thdpack/step_runner.h), passed whole: the verifier reads what
  // the runner reads (options.data and source, global_batch or global_batch_tokens; every rank
  // opens the data again, each computing the reference of a share of the step's samples) and
  // cuts what it cuts (oversize truncate or split, at LongestKept(options.schedule)); SP from
  // options.schedule.parallel. world and model must outlive the verifier. tolerance >= 0: the
  // relative tolerance of CompareLossSummaries. Errors (agreed over the world): as
  // ProbeRunner::Create, the source's own, a negative tolerance (InvalidArgument), a
  // caller-fed source (InvalidArgument: there is no source to read again).
  // start_consumed: the samples the run consumed before its first step (StepRunner::state()
  // after Create: a resumed run's); the verifier's own source reads past them one by one, the
  // plain way, so that it checks the runner's seek instead of sharing it.
  [[nodiscard]] static Result<std::unique_ptr<StepVerifier>> Create(
      ProcessGroup& world, const Topology& topology, const StepRunnerOptions& options,
      const ProbeModel& model, double tolerance, int64_t start_consumed = 0);
  ~StepVerifier();

  // The step's probe figures (the same on every rank), checked against the reference. Errors:
  // those of ProbeRunner::Forward; Internal naming the step and every figure that differs.
  [[nodiscard]] Result<LossSummary> Check(const RankStep& step);

 private:
  StepVerifier(ProcessGroup& world, const ProbeModel& model, int64_t global_batch,
               double tolerance);
  Status CompareWithReference(const RankStep& step, const LossSummary& got);

  ProcessGroup& world_;
  const ProbeModel& model_;
  int64_t global_batch_;
  TokenSteps tokens_;  // tokens > 0: steps counted in tokens
  int64_t truncate_to_ = 0;  // --oversize truncate: samples keep this many tokens at most
  int64_t split_longest_ = 0;  // --oversize split: the longest piece
  // Read already and not yet taken: a token step's refused sample, a split sample's pieces.
  PlainReadState plain_state_;
  double tolerance_;
  std::unique_ptr<ProbeRunner> probe_;
  std::unique_ptr<SampleSource> plain_;  // every rank's own, read the plain way
};

// Relative difference |a - b| / max(|a|, |b|), 0 when both are 0.
double RelativeDifference(double a, double b);

// Compares two summaries: token counts exactly, loss, ppl and entropy to a relative tolerance,
// ppl present in both or neither. Internal (the data path disagrees with the reference) listing
// every figure that differs, e.g. "loss 2.31 vs 2.30 (relative difference 4.3e-03 > 1e-09)".
[[nodiscard]] Status CompareLossSummaries(const LossSummary& got, const LossSummary& want,
                                          double tolerance);

}  // namespace thdpack

#endif  // THDPACK_PROBE_H_
