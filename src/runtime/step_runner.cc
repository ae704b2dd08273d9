// The distributed step of thdpack/step_runner.h (docs/design.md section 7), as its driver:
// StepRunner's entry points and the static step, phase by phase. Every phase that can fail on
// one rank ends with AgreeOnStatus over the world before any rank waits on data from another.
// The step's phases (design.md section 7: read, lengths, plan, exchange, pack, deliver), a file
// each, in step order:
//   step_job.cc          before the first step: the job agreed over the world
//   step_open.cc         before the first step: the options checked, who reads, the readers,
//                        the start of the run, the static step's process groups
//   step_read.cc         read: each loader's share; where the run starts, resume, and the
//                        position after each step
//   step_keep_groups.cc  keep_groups: the group field, and the group id each sample carries
//   step_lengths.cc      lengths: (id, L, n_targets) all-gathered among the planners
//   step_plan.cc         plan: the same Plan on every loader, and the plan hash check
//   step_exchange.cc     exchange: sample tokens to the ranks that pack them
//   step_pack.cc         pack: the microbatches packed and CP-sharded, the step's StepMeta
//   step_media.cc        media: images and video with their samples (exchange), placed and
//                        routed (pack), each first-stage rank's part (deliver)
//   step_deliver.cc      deliver: the metadata to every rank, then each stage's shards
//   step_local.cc        every rank's LocalMicrobatch list, the step's end
//   phase_table.cc       the phases' names and the phase table gathered over the world
// The dynamic scheduler's step is NextDynamic (dynamic_step.cc), over the same phases;
// step_runner_impl.h holds the state they share.
#include <memory>
#include <string>
#include <utility>

#include "runtime/step_runner_impl.h"
#include "thdpack/step_runner.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

// A new step of this rank, and the per-step state reset.
RankStep StepRunner::Impl::StartStep(bool is_loader) {
  started_ = true;
  RankStep out;
  out.step = step_;
  out.coord = coord_;
  out.is_loader = is_loader;
  out.dynamic = dynamic_;
  out.first_stage = coord_.pp == 0;
  out.last_stage = coord_.pp == topo_.pp_size() - 1;
  if (!opts_.media.empty()) out.media_cost = opts_.media_cost;
  agree_seconds_ = 0;
  agree_bytes_ = 0;
  shards_.clear();
  meta_bytes_.clear();
  mb_info_.clear();
  return out;
}

Result<RankStep> StepRunner::Impl::Next() {
  if (dynamic_) return NextDynamic();
  RankStep out = StartStep(reader_);
  const bool tp0 = opts_.data_on == DataOn::kTp0;

  // 1. Each loader reads its share.
  THDPACK_RETURN_IF_ERROR(ReadPhase(out));
  // 2. The lengths are all-gathered among the loaders; each computes the same Plan.
  THDPACK_RETURN_IF_ERROR(RunPhase(out, Phase::kLengths, reader_, "lengths",
                                   [&] { return ExchangeLengths(*loaders_, 1, out); }));
  THDPACK_RETURN_IF_ERROR(
      RunPhase(out, Phase::kPlan, reader_, "plan", [&] { return MakePlan(out); }));
  // 3. Sample tokens move to the replica the Plan chose.
  const bool media = !opts_.media.empty();
  THDPACK_RETURN_IF_ERROR(RunPhase(out, Phase::kExchange, reader_, "exchange", [&] {
    const Status tokens = ExchangeTokens(out);
    if (!media) return tokens;
    // The media follow (step_media.cc) only where every loader's tokens arrived whole.
    THDPACK_RETURN_IF_ERROR(AgreeIn(*loaders_, tokens, "exchange"));
    return ExchangeMedia(out);
  }));
  // 4. Each loader packs its microbatches and CP-shards them.
  const Status packed =
      RunPhase(out, Phase::kPack, reader_, "pack", [&] { return PackReplica(out); });
  own_.clear();  // packed: the samples are no longer needed
  media_recv_.clear();
  media_of_.clear();
  THDPACK_RETURN_IF_ERROR(packed);

  // 5. Every rank gets the metadata, and its stage's shards.
  THDPACK_RETURN_IF_ERROR(
      Deliver(out, tp0 ? replica_.get() : nullptr,
              "the loader of replica " + std::to_string(coord_.dp),
              [&] { return ReceiveShards(out); },
              media ? std::function<Status()>([&] { return DeliverMedia(out, *replica_, false); })
                    : nullptr));
  // 6. Each rank's microbatches, the step's figures, and the run's position past the step.
  FinishLocal(out);
  out.phases.push_back(PhaseStats{Phase::kAgree, agree_seconds_, agree_bytes_});
  ++step_;
  THDPACK_RETURN_IF_ERROR(CommitPosition(out));
  return out;
}

StepRunner::StepRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StepRunner::~StepRunner() = default;

Result<std::unique_ptr<StepRunner>> StepRunner::Create(ProcessGroup& world,
                                                       const Topology& topology,
                                                       const StepRunnerOptions& options) {
  auto impl = std::make_unique<Impl>(world, topology, options);
  THDPACK_RETURN_IF_ERROR(SayDefaulted(impl->Init(), options.defaulted));
  return std::unique_ptr<StepRunner>(new StepRunner(std::move(impl)));
}

Result<RankStep> StepRunner::Next() {
  Result<RankStep> step = impl_->Next();
  if (!step.ok()) return SayDefaulted(step.status(), impl_->defaulted());
  return step;
}

const RunState& StepRunner::state() const { return impl_->state(); }

bool StepRunner::reads() const { return impl_->reads(); }

Status StepRunner::Restore(const RunState& state) { return impl_->Restore(state); }

}  // namespace thdpack
