// thdpack/step_runner.h: the distributed step (docs/design.md section 7) - every rank ends a step with
// its own microbatches (CP-local tensors, global metadata) and the step figures.
//
// One step, with the default `--data-on tp0` (loaders are the ranks tp=0, cp=0, pp=0 of each
// replica; phases in order, each named as in RankStep::phases):
//   read      each loader reads its share of the global batch: sample i of the step, in source
//             order, belongs to loader i % DP. Samples are checked as they are read (the oversize
//             rule of section 4 with policy `error`), so a bad sample fails on its own loader.
//   lengths   (id, L, n_targets) all-gathered among the loaders: 12 bytes a sample (three int32:
//             the id as an offset from the step's first id, L, n_targets).
//   plan      every loader computes the same Plan (Schedule of thdpack/schedule.h) from the same
//             samples in the same order (loader 0's first); debug builds compare a hash of the
//             plan across loaders.
//   exchange  all-to-all-v among the loaders: each sample's tokens (int32) - and its target mask
//             (one byte a token) when it is not all ones - go to the replica the plan chose; a
//             sample that stays is not sent. Each loader-to-loader block is padded to a
//             multiple of 4 bytes (token arrays stay aligned in the receive buffer).
//   pack      each loader packs its replica's microbatches and CP-shards them in one pass
//             (PackShardAllInto), and encodes the replica's StepMeta (thdpack/wire.h).
//   deliver   the loader broadcasts the encoded metadata to every other rank of its replica
//             (every stage, every TP rank) and sends each CP shard to the TP ranks that use it:
//             tokens and position ids to the first stage, labels and loss_mask to the last.
// With `--data-on all` every rank reads its replica's share itself and builds its own tensors:
// read, lengths, plan, exchange and pack run on every rank (within its DP group); no deliver.
//
// With the dynamic scheduler (schedule.scheduler kDynamic) the DP x CP ranks are one domain
// (index dp*CP + cp) and its heads, the ranks tp = 0, pp = 0, do the planning:
//   lengths   all-gathered among the heads (loaders contribute their samples);
//   plan      every head computes the same DynamicPlan (ScheduleDynamic);
//   exchange  all-to-all-v among the heads: each sample goes from its loader to the head of
//             every domain rank of its group;
//   pack      each head packs its group's sequences with the group's layout (GroupLayout) and
//             keeps its own zigzag shard, and encodes its step message (thdpack/step_wire.h);
//   deliver   the metadata and the shard go down the head's column (every tp and pp of its
//             domain index), then the CP groups of the step are split from the world (those
//             not made in an earlier step; RankStep::groups_made / groups_reused).
// Each LocalMicrobatch then carries its group (cp_size, cp_rank, first_rank, cp_group) or is
// flagged idle (thdpack/rank_step.h). With `--data-on all` every (tp, pp) slice of the world is
// a domain of its own heads: its ranks cp = 0 read their replica's share, and every rank plans,
// receives its group's samples and packs its own shard (the arrays of its stage); nothing is
// delivered. The CP groups are cached across steps, at most max_cp_groups of them: when a step
// leaves more, those unused longest are dropped (the same ones on every rank, which all see the
// same plans), never one the step uses.
//
// Failures: every phase ends with AgreeOnStatus over the world before any rank waits for data a
// failed rank would send, so an error on one rank (bad sample, budget overflow, a schedule
// error, corrupt metadata) returns as an error on every rank - its own status on the failed
// rank, kAborted naming it elsewhere - and no rank hangs.
//
// After Next() returns an error the runner is mid-step: destroy it (on every rank).
//
// Thread-safety: a StepRunner belongs to one rank; use it from one thread at a time (a
// StepSource's thread, or the rank's own).
#ifndef THDPACK_STEP_RUNNER_H_
#define THDPACK_STEP_RUNNER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/comm.h"
#include "thdpack/data.h"
#include "thdpack/fields.h"
#include "thdpack/media.h"
#include "thdpack/pack.h"
#include "thdpack/rank_step.h"
#include "thdpack/run_state.h"
#include "thdpack/schedule.h"
#include "thdpack/status.h"
#include "thdpack/step.h"
#include "thdpack/step_wire.h"
#include "thdpack/topology.h"
#include "thdpack/wire.h"

namespace thdpack {

enum class DataOn {
  kTp0,  // one loader per replica, at (tp=0, cp=0, pp=0); the default
  kAll,  // every rank reads and builds its own tensors (NeMo-RL / verl style)
};
// "tp0" / "all", and the inverse (InvalidArgument naming the text).
std::string_view DataOnName(DataOn mode);
[[nodiscard]] Result<DataOn> ParseDataOn(std::string_view text);

// Whether loaders compare a hash of the plan unless told: in debug builds (NDEBUG unset) only.
inline constexpr bool kCheckPlanHashByDefault =
#ifdef NDEBUG
    false;
#else
    true;
#endif

// The CP groups a dynamic step keeps by default: every group of --cp-sizes pow2 at a domain
// of up to 16 ranks (31 aligned groups), every contiguous group of --cp-sizes any up to 7
// (28). A group costs a communicator per member (an NCCL one holds device buffers), so the
// bound is a memory bound; raise it where a step's plans use more groups than it holds.
inline constexpr int kDefaultMaxCpGroups = 32;

namespace runner_internal {
struct TestHooks;  // src/runtime/step_runner_impl.h
}  // namespace runner_internal

struct StepRunnerOptions {
  // The source spec (thdpack/data.h) and its options; every reading rank opens its own copy.
  std::string data = "mock";
  SourceOptions source;
  // Samples per step over all replicas; 0 = the whole source (one epoch) per step.
  int64_t global_batch = 0;
  // > 0: steps counted in tokens instead (thdpack/step.h, StepReader); global_batch is then
  // ignored. A caller-fed source (read_share) is refused with it: its loaders see their own
  // shares only, and a token step's size needs every sample's length in stream order.
  int64_t global_batch_tokens = 0;
  // As documented in thdpack/schedule.h (max_tokens_per_rank is required). dp_size and
  // the parallel layout's CP and TP must be the topology's (checked by Create); thdpack/job.h
  // fills them.
  ScheduleOptions schedule;
  TokenId pad_id = 0;
  DataOn data_on = DataOn::kTp0;
  // Compare a hash of the plan across loaders (an extra 16-byte all-reduce). Default: on in
  // debug builds (NDEBUG unset).
  bool check_plan_hash = kCheckPlanHashByDefault;
  // A source fed by the caller instead of `data` (e.g. one Python iterable per loader): when
  // set, reading ranks open no source and take each step's share from
  // read_share(step, first_position, dp), called once per step on the rank's own thread:
  // first_position is the stream position of the step's first sample (the samples consumed
  // before it), and the share the loader's own samples in source order, with first_id =
  // first_position, n the step's sample count and ids first_id + k * DP + dp (FedShares,
  // step.h), so the lengths phase can place them; id_span 0 means n (consecutive ids). An
  // error it returns fails the read phase on that rank (agreed as any other), except
  // kEndOfData: this loader's source ended at the step boundary. Where every loader's ended,
  // Next() returns kEndOfData on every rank; where only some did, InvalidArgument on every rank
  // naming how many ran out and how many still had samples. Default: unset.
  std::function<Result<StepShare>(int64_t step, int64_t first_position, int loader)> read_share;
  // The step the run starts at (>= 0): step k of a run that read global_batch samples a step
  // from the beginning (k epochs with "all"), its stream position computed (StepReader::Start:
  // O(1) of the steps before it for every source but jsonl). A saved state is given to
  // StepRunner::Restore instead. Default 0.
  int64_t start_step = 0;
  // The dynamic scheduler: the most CP process groups kept across steps (>= 1). Default
  // kDefaultMaxCpGroups.
  int max_cp_groups = kDefaultMaxCpGroups;
  // The fields each sample carries (thdpack/fields.h), packed, CP-sharded and delivered with
  // the tokens (input), the labels (target) or the metadata (sample): every sample's
  // Sample::fields holds one buffer per entry. Checked by Create (ValidateFieldSpecs); each
  // sample's buffers are checked as it is read (CheckSampleFields: an error naming the sample,
  // the field and both sizes). Needs a caller-fed source (read_share): the file sources carry
  // no fields. Default: none.
  std::vector<FieldSpec> fields;
  // Groups kept together (schedule.keep_groups, thdpack/schedule.h): the name of the `sample`
  // field of `fields` (int32 or int64, shape []) that holds each sample's group id, e.g. a
  // DPO pair id or a GRPO prompt uid. The ids travel with the lengths (8 bytes a sample) and
  // every scheduler call gets them. Required with keep_groups, refused without (Create names
  // the rule broken). Default: none.
  std::string group_field;
  // Images and video (thdpack/media.h, docs/media.md): the declared modalities, in order; each
  // sample's Sample::media holds one part per modality. Each microbatch's items are placed
  // whole on its CP ranks (PlaceMicrobatchMedia, by media_cost) and each first-stage rank gets
  // its MediaShard (LocalMicrobatch::media): the payload rows it encodes, the route of their
  // output rows and, with mrope, its shard's mRoPE positions. Needs a caller-fed source, data
  // on tp0 (Create names the rule broken); under the dynamic scheduler each group's head places
  // its group's items (docs/media.md "Under the dynamic scheduler"). Default: none.
  std::vector<MediaSpec> media;
  int64_t spatial_merge_size = 2;
  Mrope mrope = Mrope::kNone;          // needs media
  double mrope_tokens_per_second = 2;  // Qwen2.5-VL's vision_config.tokens_per_second
  // The encoder's cost of an item (thdpack/cost.h EncoderCost), in the unit of
  // schedule.cost: where a microbatch's items are encoded (PlaceMicrobatchMedia) and, as
  // schedule.encoder_cost (set by Create), the encoder's term that the static schedulers
  // balance over the replicas with the language model's cost. Default (nullopt): a measured
  // profile's encoder term (schedule.cost.encoder, profile.h EncoderProfile), else Qwen2-VL's
  // vision tower (DefaultEncoderCost) when the cost is in training FLOPs (a model preset or
  // dimensions); with a cost in another unit ('tokens', 'A,B', a profile without the term) it
  // must be given (Create names the rule). Terms >= 0, finite, not both 0.
  std::optional<EncoderCost> media_cost;
  // The dynamic scheduler: leave the step's CP groups to the caller. Next() then splits no
  // group: each RankStep lists the groups its microbatches use (RankStep::cp_groups) with
  // every LocalMicrobatch's cp_group null, and the caller attaches them (AttachCpGroups) from
  // the world it wants them in, on its own thread - what a runner preparing steps in the
  // background needs (a torch job makes groups on the training thread only). Default false.
  bool defer_cp_groups = false;
  // The options the caller did not give (JobOptions::given; thdpack/job.h), by name: an error
  // naming one says it was defaulted (SayDefaulted). Not part of the job agreed over the world.
  // Default: none.
  std::vector<std::string> defaulted;
};

// The dynamic scheduler's CP process groups, made from a world and kept across steps: at most
// max_groups of them, those unused longest dropped first (the same ones on every rank, which
// all see the same plans), never one of the current step's. The step runner keeps one; a caller
// of a runner with defer_cp_groups keeps its own. Thread-safety: one thread at a time.
class CpGroupCache {
 public:
  CpGroupCache(Topology topology, int max_groups)
      : topo_(std::move(topology)), max_(max_groups) {}

  // Collective over `world` (its ranks the topology's): makes the groups of step.cp_groups
  // that it does not hold (one Split each, at every (tp, pp) the ranks of the group's domain
  // indices), drops those over the bound, counts into step.groups_made / reused / evicted /
  // cached, and sets each of the step's microbatches' cp_group (checking that it holds this
  // rank at its cp_rank). Errors: the Split's, Internal for a group outside the domain or a
  // microbatch whose group is not among the step's.
  [[nodiscard]] Status Attach(ProcessGroup& world, RankStep& step);

  // The groups of step.cp_groups this cache does not hold. The same on every rank (each holds
  // the groups of the same lists), so a caller knows without communicating whether Attach will
  // split, i.e. communicate: a caller that agrees on Attach's status (AgreeOnStatus) does so only
  // then, and a step whose groups are all held costs no collective at all.
  int Missing(const RankStep& step) const;

  // Attach for a caller outside the step runner's agreed phases (the hand-over of a runner's
  // deferred groups): where some groups are Missing, Attach's status is agreed over `world`
  // (AgreeOnStatus), so that a rank whose split failed leaves no other waiting; where all are
  // held, the same answer on every rank, nothing is communicated.
  [[nodiscard]] Status AttachAgreed(ProcessGroup& world, RankStep& step);

 private:
  struct Entry {
    std::shared_ptr<ProcessGroup> group;
    int64_t last_step = 0;
  };
  Topology topo_;
  int max_;
  std::map<std::pair<int, int>, Entry> groups_;
};


// Per phase: the bytes each rank of the world sent and the slowest rank's seconds, gathered
// from every rank (GatherPhases). Row k is Phase k. A rank's phases run one after another and
// cover its StepRunner::Next from start to end, so the sum of one rank's phase seconds is its
// wall time of the step. The slowest rank of one phase is often not the slowest of another:
// the sum of `seconds` overstates the step (it is no one's time), so the step's time is
// step_seconds, the slowest rank's own sum.
struct PhaseTable {
  std::vector<std::vector<int64_t>> bytes;  // [kNumPhases][world size]
  std::vector<double> seconds;              // [kNumPhases]: the largest over ranks
  std::vector<double> rank_seconds;         // [world size]: each rank's wall time of the step
  double step_seconds = 0;                  // the largest of rank_seconds
  int64_t max_rank_bytes() const;           // the most bytes one rank sent over all phases
};

// Collective over `world`: every rank passes the RankStep its runner returned and gets the
// table (the same on every rank). Two all-gathers of kNumPhases values.
[[nodiscard]] Result<PhaseTable> GatherPhases(ProcessGroup& world, const RankStep& step);

// The job as the world agrees on it (src/runtime/step_job.cc): every option of `options` that
// shapes a step - named as thdpack's keyword arguments and the command line name them
// (max_tokens_per_rank, scheduler, cost, ...) - and the field schema (fields, fields[k]), as
// (name, value) text, in a fixed order. The source is its kind ("jsonl", "fed by the caller"),
// not its path or callable: ranks may read copies of the data at paths of their own.
std::vector<JobEntry> StepJobEntries(const StepRunnerOptions& options, const Topology& topology);

// Collective over `world`: OK when every rank's `mine` is the same; otherwise InvalidArgument
// on every rank (AgreeOnStatus) naming the first entry that differs between the lowest rank that
// differs from world rank 0 and rank 0, with both values ("the job differs over the world:
// scheduler is \"sequential\" on world rank 1 and \"balanced\" on world rank 0 ..."). Costs one
// 16-byte all-reduce when all agree. StepRunner::Create calls it before any other collective.
[[nodiscard]] Status AgreeOnJob(ProcessGroup& world, std::span<const JobEntry> mine);
// The same for any entries every member must give alike, `what` naming them in the error
// ("<what> differs over the world: ..."). AgreeOnJob is AgreeOnEntries(world, mine, "the job").
[[nodiscard]] Status AgreeOnEntries(ProcessGroup& world, std::span<const JobEntry> mine,
                                    std::string_view what);

// The command line's flag of an option (thdpack/job.h, kJobOptionNames): "--" and the name with
// '-' for '_' ("--max-tokens-per-rank"), but max_seqs, whose flag is --max-seqs-per-microbatch.
// The one rule, for the command line's parser and SayDefaulted.
std::string JobOptionFlag(std::string_view name);

// An error naming an option the job defaulted says so: "<message> (max_tokens_per_rank
// defaulted)", for every name of `defaulted` found in the message as a word - as thdpack's
// keyword arguments spell it, or as the command line's flag (JobOptionFlag). OK stays
// OK. StepRunner::Create and Next, and ResolveJob, return their errors through it.
[[nodiscard]] Status SayDefaulted(const Status& s, std::span<const std::string> defaulted);

// One rank's step loop. Collective: every rank of `world` creates its runner, and calls Next()
// the same number of times.
class StepRunner {
 public:
  // Splits the groups it needs from `world` (which must outlive the runner) and opens the source
  // on reading ranks. REQUIRES: world.size() == topology.world_size(),
  // options.schedule.max_tokens_per_rank > 0, options.schedule's dp_size and parallel CP and TP
  // equal to the topology's. Errors (agreed over the world) name the option.
  [[nodiscard]] static Result<std::unique_ptr<StepRunner>> Create(
      ProcessGroup& world, const Topology& topology, const StepRunnerOptions& options);
  ~StepRunner();

  // Runs the next step. Every rank gets either its RankStep or an error (see the top), or
  // kEndOfData on every rank where a caller-fed source ended (read_share).
  [[nodiscard]] Result<RankStep> Next();

  // Whether this rank reads its replica's share (a loader; with the dynamic scheduler a rank
  // cp = 0 of the heads): the ranks a caller-fed source's read_share is called on.
  bool reads() const;

  // The run's state after the last step Next() returned (RankStep::after), or where it starts
  // before the first: the same on every rank.
  const RunState& state() const;

  // Continues a run from a saved state (thdpack/run_state.h) instead of options.start_step:
  // the next step is state.next_step, read from the saved stream position (the cursor makes the
  // seek O(1)). Call it on every rank, with the same state, before the first Next(); it does
  // not communicate. Errors, the same on every rank: InvalidArgument when the state does not
  // fit this run (CheckResume: another data set, seed, shuffle, ..., naming the field and both
  // values), or when called after a step. A reading rank that cannot seek (a cursor its file
  // refuses) fails the next step's read phase, agreed over the world as any failure.
  [[nodiscard]] Status Restore(const RunState& state);

 private:
  class Impl;
  friend struct runner_internal::TestHooks;  // the failure-path tests' way in (private header)
  explicit StepRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether the rank at `coord` reads its replica's share of each step (StepRunner::reads): with
// the static schedulers the loaders (tp = cp = pp = 0; with DataOn::kAll every rank), with the
// dynamic one the ranks cp = 0 of the heads (tp = pp = 0; with kAll every (tp, pp)).
bool ReadsShare(const Coord& coord, const StepRunnerOptions& options);

// ---- Back to sample order: the inverse of a step for the model's per-token outputs. ----

// One microbatch as a rank holds it, for UnpackStep: its layout and group (LocalMicrobatch's),
// the samples of its sequences, and this rank's values: the bytes of a [T/CP] or
// [T/CP, *row] array of `dtype` and `shape` (at most kUnpackMaxRowDims row dimensions, each
// >= 1), label-aligned as the loss sees them (row o of a sequence: the prediction of its token
// o + 1); `shape` empty where the rank passes none (only the ranks tp = 0 of the last stage send
// theirs).
inline constexpr int kUnpackMaxRowDims = 4;
struct UnpackMicrobatch {
  std::span<const int32_t> cu_seqlens;
  std::span<const int32_t> cu_seqlens_padded;
  int cp_size = 1;
  int cp_rank = 0;
  bool idle = false;
  std::span<const int64_t> sample_ids;
  std::span<const std::byte> values;
  FieldDtype dtype = FieldDtype::kFloat32;
  std::span<const int64_t> shape;
};

struct UnpackArgs {
  // The step's first sample id and sample count: with a caller-fed source (the only kind
  // UnpackStep serves) the samples are those of FedShares (step.h): the k-th sample of loader d
  // has id first_id + k * DP + d.
  int64_t first_id = 0;
  int64_t num_samples = 0;
  // A reading rank: its samples' lengths, in the order it gave them; empty elsewhere.
  std::span<const int64_t> own_lengths;
  // The value written where no prediction produces one (token 0), in the values' dtype
  // (exactly representable there: ValueRow of fields.h).
  double fill = 0;
  // How the values are aligned: false, as thdpack's (Megatron's) labels - row o of a sequence
  // is the prediction of its token o + 1; true, as Hugging Face's unshifted labels
  // (label_format 'hf', ToHfLabels) - row o is token o's own value, row 0 (the first token,
  // which nothing predicts) ignored. The hf alignment needs whole microbatches (CP size 1):
  // InvalidArgument otherwise.
  bool hf_aligned = false;
  // An error the caller found in this rank's own inputs before the call (a value it could not
  // read): UnpackStep returns it on this rank, and its peers name it, as an error of its own
  // (agreed over the world), so that no rank waits in a collective another never joins.
  Status caller_error;
};

// What a reading rank gets back: the values' dtype and row shape (agreed over the world, so
// also on a rank that passed none) and, in the order it gave its samples, their rows one after
// another (one allocation however many samples): sample k is rows [offsets[k], offsets[k+1]),
// its L rows. Another rank: no rows, offsets {0}.
struct UnpackedValues {
  FieldDtype dtype = FieldDtype::kFloat32;
  std::vector<int64_t> row_shape;
  std::vector<std::byte> values;  // [sum of L, *row_shape] of dtype
  std::vector<int64_t> offsets;   // [samples + 1], in rows
  size_t num_samples() const { return offsets.empty() ? 0 : offsets.size() - 1; }
  // Sample k's bytes.
  std::span<const std::byte> Sample(size_t k) const {
    const size_t rb = values.empty() ? 0 : values.size() / static_cast<size_t>(offsets.back());
    return std::span<const std::byte>(values).subspan(static_cast<size_t>(offsets[k]) * rb,
                                                      static_cast<size_t>(offsets[k + 1] -
                                                                          offsets[k]) * rb);
  }
};

// Collective over `world` (the step's world, topology order). First the values' dtype and row
// shape are agreed: one all-gather of every rank's (none, or its values' dtype and row shape);
// ranks that send values of different dtypes or row shapes, or no rank sending any, are the
// same InvalidArgument on every rank, naming the ranks and both dtypes and shapes. Then every
// rank of the last stage with tp = 0 sends each run of its values (a zigzag chunk of a
// sequence) to every reading rank of the sample's loader (ReadsShare; FedShares::SlotOf), in
// one all-to-all-v of 24 bytes a run plus the rows. Each reading rank returns, in the order it
// gave its samples, their L rows each (UnpackedValues), token-aligned like a target field: row j
// (1 <= j < L) the value that predicted token j, row 0 the fill; other ranks no samples.
// Packing a target field and unpacking its packed values returns it, row 0 replaced by the
// fill; so does unpacking, with hf_aligned, the values ToHfField made of them.
// Errors, agreed over the world (every rank returns one): a rank's microbatches of different
// dtypes or row shapes, more than kUnpackMaxRowDims row dimensions, a fill the dtype cannot
// hold, values of the wrong size or where a microbatch is idle, a run naming a sample or token
// outside the step (Internal), and, on a reading rank, a sample whose values did not all arrive
// (a last-stage rank passed none).
[[nodiscard]] Result<UnpackedValues> UnpackStep(ProcessGroup& world, const Topology& topology,
                                                const StepRunnerOptions& options,
                                                std::span<const UnpackMicrobatch> microbatches,
                                                const UnpackArgs& args);

// The steps of a run as a training loop takes them (`thdpack run`, the torch iterator, a C++ or
// MPI loop): one interface whatever the depth. At depth 0 each Next() runs the step runner on
// the caller's thread over the world. At depth K >= 1 a thread of this rank runs it up to K
// steps ahead of the caller, over a communicator of its own (StepSourceOptions::data_world, or
// one split from the world), so that the caller's collectives and the thread's never share one;
// the caller's Next() takes the steps in order - the same steps, figures and errors as at depth
// 0, each error at the step where it would have been returned, never earlier - and, for the
// dynamic scheduler, makes the step's CP groups from the world on the caller's thread
// (CpGroupCache), so that every group the caller is handed belongs to the caller's thread.
//
// The world's backend must allow two threads to communicate at once on different
// communicators: the threads backend does; under MPI, MpiWorld(/*thread_multiple=*/true).
//
// Stopping: Close() (and the destructor) stops the thread once it has made K steps beyond
// those taken. Every rank took as many (errors and the end are agreed), so every rank's thread
// makes the same steps and none is left in a collective its peers never join. Close on every
// rank, after the same number of Next(); from any thread, the source's own included (a hook's
// caller that drops the source: the thread then ends on its own, holding what it uses).
class StepSource;

struct StepSourceOptions {
  // The most steps a source makes ahead (the depth's bound; thdpack.torch's prefetch).
  static constexpr int kMaxDepth = 64;
  // Steps made ahead of the caller, in [0, kMaxDepth]; 0: each step made inside Next().
  int depth = 0;
  // The most steps made (-1: no bound, >= 0 otherwise); Next() after them returns kEndOfData,
  // and the thread makes none beyond them.
  int64_t steps = -1;
  // Run after each step on the thread that made it (the caller's at depth 0), with the
  // communicator the step was made over: what a caller adds to a step where it is made (step
  // figures gathered over that communicator, its own objects in RankStep::prepared). Every
  // rank runs it for every step; its status is agreed over the communicator and is the step's.
  // Default: none.
  std::function<Status(ProcessGroup& comm, RankStep& step)> on_step;
  // Depth >= 1: the thread's communicator, its ranks the world's in the same order (a gloo
  // group beside an NCCL world, say); null: split from the world. The source owns it.
  std::shared_ptr<ProcessGroup> data_world;

  // OK when depth and steps are in range (Create's own check; a caller that does collective
  // work before Create, such as making a data world, asks first). InvalidArgument naming the
  // value and the range otherwise.
  [[nodiscard]] Status Check() const;
};

class StepSource {
 public:
  // Collective over `world` (outlives the source): at depth >= 1 the data plane's communicator
  // (one Split unless given), then the runner over it (StepRunner::Create, with
  // defer_cp_groups at depth >= 1). Errors: the Split's and Create's; InvalidArgument naming
  // depth or steps.
  [[nodiscard]] static Result<std::unique_ptr<StepSource>> Create(
      ProcessGroup& world, const Topology& topology, const StepRunnerOptions& options,
      StepSourceOptions source_options);
  ~StepSource();  // Close()

  // As StepRunner::Restore: before the first Next() (the thread starts at the first Next()).
  [[nodiscard]] Status Restore(const RunState& state);

  // The next step, in order; *waited (if given): the seconds this call waited for it (at
  // depth 0 the whole step). A dynamic step's groups are attached here, collectively over the
  // world. kEndOfData after `steps` steps or where a fed source ended (again on every later
  // call); after an error the source is done: every later call returns InvalidArgument.
  [[nodiscard]] Result<RankStep> Next(double* waited = nullptr);

  // The run's state after the last step Next() returned (not the last one prepared), or where
  // the run starts before the first.
  const RunState& state() const;
  // Whether Next() would take a step (or the end, or an error) without waiting for the thread:
  // depth >= 1 and one is ready. A caller that must give up a lock to wait (the GIL) keeps it
  // when it need not: the thread then cannot take it from the caller mid-hand-over.
  bool ready() const;
  // StepRunner::reads: whether this rank's read_share is called.
  bool reads() const;
  int depth() const;

  // Stops making steps (see the top) and waits for the thread up to timeout_seconds (< 0: no
  // bound). Aborted when it did not end in time (a peer's thread that stopped first leaves this
  // one in a collective until the communicator's timeout): the thread then ends on its own.
  // Idempotent; Next() after it returns InvalidArgument. Called on the source's own thread, it
  // returns at once and the thread ends after its steps.
  Status Close(double timeout_seconds = -1);

 private:
  class Impl;
  explicit StepSource(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace thdpack

#endif  // THDPACK_STEP_RUNNER_H_
