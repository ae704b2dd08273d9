// Phase 1, read (design.md section 7, step 1), and the run's position: where a run starts
// (StartReading on the readers: the fingerprint and the reader moved to the start step;
// ShareStart: world rank 0's start state to every rank), Restore (a saved state, before the
// first step), each reader's share of a step (ReadShare: from the step reader, or from the
// caller's read_share with its fields checked; oversize 'truncate' cut here, 'error' checked
// here so that the error names the loader), the read phase agreed over the world (ReadPhase:
// a caller-fed source's end counted first), and the position committed after a step
// (CommitPosition).
// Sends: the start state (its size in a size frame, agreed, then the run state's JSON with its
// own checksum, broadcast from world rank 0) and the agreements; the position after the step
// (after_) is sent later, with the lengths (step_lengths.cc) or in the step message
// (step_deliver.cc), as wire/ writes it (thdpack/step_wire.h).
#include <algorithm>
#include <array>
#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "runtime/step_runner_impl.h"
#include "thdpack/step.h"
#include "thdpack/step_wire.h"

namespace thdpack {

using namespace runner_internal;  // NOLINT: the runtime area's own helpers

Status StepRunner::Impl::StartReading() {
  THDPACK_ASSIGN_OR_RETURN(
      state_.data, MakeFingerprint(source_.get(), source_ ? opts_.data : std::string(),
                                   opts_.source, opts_.schedule));
  const int64_t step = std::max<int64_t>(opts_.start_step, 0);
  int64_t consumed = 0;
  if (source_) {
    THDPACK_RETURN_IF_ERROR(steps_->Start(step, -1, std::nullopt));
    state_.cursor = source_->cursor();
    consumed = steps_->consumed();
  } else if (__builtin_mul_overflow(step, opts_.global_batch, &consumed)) {
    return Status::OutOfRange("start step " + std::to_string(step) + " x global batch " +
                              std::to_string(opts_.global_batch) + " overflows int64");
  }
  state_.next_step = step;
  state_.consumed = consumed;
  return Status::Ok();
}

// World rank 0 reads in every mode (a loader, a head): its start is everyone's. Its size first,
// agreed (a rank that cannot read it cannot take part in the broadcast), then the record.
Status StepRunner::Impl::ShareStart() {
  std::string text = world_.rank() == 0 ? RunStateToJson(state_) : std::string();
  std::array<uint8_t, kSizeFrameSize> size_frame =
      EncodeSizeFrame(static_cast<int64_t>(text.size()));
  THDPACK_RETURN_IF_ERROR(world_.BroadcastValues(std::span<uint8_t>(size_frame), 0));
  Result<int64_t> size = DecodeSizeFrame(size_frame, 1, int64_t{1} << 24);
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(
      world_, size.status().WithContext("the start state's size from world rank 0"),
      "the start state"));
  text.resize(static_cast<size_t>(*size));
  THDPACK_RETURN_IF_ERROR(
      world_.Broadcast(std::as_writable_bytes(std::span<char>(text.data(), text.size())), 0));
  Status local;
  auto parsed = ParseRunState(text, "the start state from world rank 0");
  if (parsed.ok()) {
    state_ = std::move(*parsed);
  } else {
    local = parsed.status();
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "the start state"));
  step_ = state_.next_step;
  after_ = StepPosition{state_.consumed, state_.cursor};
  return Status::Ok();
}

Status StepRunner::Impl::Restore(const RunState& saved) {
  if (started_) {
    return Status::InvalidArgument("StepRunner::Restore: the run already ran step " +
                                   std::to_string(step_ - 1) +
                                   " (restore a state before the first step)");
  }
  // Every rank holds the run's fingerprint (ShareStart): the check gives the same answer on
  // all of them without a message.
  THDPACK_RETURN_IF_ERROR(CheckResume(saved.data, state_.data));
  if (saved.cursor.has_value() && state_.data.source == SourceKind::kFed) {
    return Status::InvalidArgument("StepRunner::Restore: the state has a source cursor, but this "
                                   "run's samples are fed by the caller");
  }
  state_.next_step = saved.next_step;
  state_.consumed = saved.consumed;
  state_.cursor = saved.cursor;  // a state without one: the readers compute it (below)
  step_ = saved.next_step;
  after_ = StepPosition{state_.consumed, state_.cursor};
  if (source_) restore_error_ = steps_->Start(saved.next_step, saved.consumed, saved.cursor);
  return Status::Ok();
}

Status StepRunner::Impl::CommitPosition(RankStep& out) {
  state_.next_step = step_;
  state_.consumed = after_.consumed;
  state_.cursor = after_.cursor;
  out.after = state_;
  return Status::Ok();
}

// This loader's share through the step reader `thdpack plan` uses; each of its samples is
// checked here, so that an oversize error names the loader that holds the sample.
Status StepRunner::Impl::ReadShare(RankStep& out) {
  THDPACK_RETURN_IF_ERROR(restore_error_);
  StepShare share;
  if (opts_.read_share) {
    Result<StepShare> fed = opts_.read_share(step_, state_.consumed, coord_.dp);
    if (!fed.ok() && fed.status().code() == StatusCode::kEndOfData) {
      fed_ended_ = true;  // counted over the world by ReadPhase
      return Status::Ok();
    }
    THDPACK_ASSIGN_OR_RETURN(share, std::move(fed));
    after_ = StepPosition{state_.consumed + share.n, std::nullopt};
  } else {
    THDPACK_ASSIGN_OR_RETURN(share, steps_->NextShare(coord_.dp));
    after_ = StepPosition{steps_->consumed(), source_->cursor()};
  }
  own_work_.clear();
  if (opts_.read_share || !opts_.fields.empty()) {  // fed, or fields from a source's columns
    for (const Sample& x : share.samples) {
      const std::string where = "sample id " + std::to_string(x.id) + " (step " +
                                std::to_string(step_) + ", read by loader dp=" +
                                std::to_string(coord_.dp) + ")";
      THDPACK_RETURN_IF_ERROR(CheckSampleFields(opts_.fields, x.fields,
                                                static_cast<int64_t>(x.tokens.size()), where));
      if (!opts_.media.empty()) {  // its items against its tokens, its payload's rows
        THDPACK_RETURN_IF_ERROR(CheckSampleMedia(opts_.media, opts_.spatial_merge_size,
                                                 x.tokens, x.media, where)
                                    .status());
        // Its encoder's work, told with its length (the schedulers' encoder term).
        THDPACK_ASSIGN_OR_RETURN(EncoderWork w, SampleEncoderWork(x.media, where));
        own_work_.push_back(w);
      }
    }
  }
  own_ = std::move(share.samples);
  first_id_ = share.first_id;
  // A caller-fed share may leave id_span 0: its ids are then consecutive (step_runner.h).
  id_span_ = share.id_span > 0 ? share.id_span : share.n;
  out.epoch = share.epoch;
  out.n_empty = share.n_empty;
  out.split = share.split;
  own_cut_ = Truncation{};
  if (opts_.schedule.oversize == ScheduleOptions::OversizePolicy::kTruncate) {
    // Cut here, on the loader, before the lengths are told: every later phase sees the kept
    // tokens only; the counts go out with the lengths.
    THDPACK_ASSIGN_OR_RETURN(const int64_t longest, LongestKept(opts_.schedule));
    for (Sample& x : own_) {
      const int64_t length = static_cast<int64_t>(x.tokens.size());
      if (length <= longest) continue;
      ++own_cut_.samples;
      own_cut_.tokens += length - longest;
      own_cut_.targets += TruncateSample(x, opts_.fields, longest);
    }
  }
  if (opts_.schedule.oversize != ScheduleOptions::OversizePolicy::kError) return Status::Ok();
  // The dynamic scheduler's budget depends on the group it picks: ScheduleDynamic names an
  // oversize sample (its id, length and the largest group's budget) on every head.
  if (dynamic_) return Status::Ok();
  // What fits is the schedule's rule (LongestKept), asked, not worked out again here.
  THDPACK_ASSIGN_OR_RETURN(const int64_t longest, LongestKept(opts_.schedule));
  const ParallelLayout& parallel = opts_.schedule.parallel;
  for (const Sample& x : own_) {
    const int64_t length = static_cast<int64_t>(x.tokens.size());
    if (length <= longest) continue;
    const int64_t padded = parallel.MicrobatchTokens(parallel.PaddedLength(length));
    return Status::InvalidArgument(
        "sample id " + std::to_string(x.id) + " (step " + std::to_string(step_) + ", source " +
        (source_ ? source_->spec() : std::string("fed by the caller")) +
        ", read by loader dp=" + std::to_string(coord_.dp) + "): length " +
        std::to_string(length) + " pads to " + std::to_string(padded) +
        " tokens, over the microbatch budget CP * max_tokens_per_rank = " +
        std::to_string(MicrobatchBudget(opts_.schedule)) + " (the longest sample kept: " +
        std::to_string(longest) + " tokens)");
  }
  return Status::Ok();
}

Status StepRunner::Impl::ReadPhase(RankStep& out) {
  if (!opts_.read_share) {
    return RunPhase(out, Phase::kRead, reader_, "read", [&] { return ReadShare(out); });
  }
  BeginPhase(out, Phase::kRead);
  fed_ended_ = false;
  const Status local = reader_ ? ReadShare(out) : Status::Ok();
  EndPhase(out);
  // A fed source ends where every loader's does, at a step boundary: the loaders that ran out,
  // those that read a share, and the failures, counted over the world (a failure then goes to
  // the agreement, which names it).
  const bool ended = reader_ && local.ok() && fed_ended_;
  std::vector<int64_t> counts = {ended ? 1 : 0, reader_ && local.ok() && !ended ? 1 : 0,
                                 local.ok() ? 0 : 1};
  const auto t0 = Clock::now();
  const int64_t b0 = world_.bytes_sent();
  Status reduced = world_.AllReduceInt64(std::span<int64_t>(counts), ReduceOp::kSum);
  agree_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  agree_bytes_ += world_.bytes_sent() - b0;
  THDPACK_RETURN_IF_ERROR(reduced);
  if (counts[2] == 0 && counts[0] > 0) {
    if (counts[1] == 0) {
      return Status::EndOfData("the source fed by the caller ended before step " +
                               std::to_string(step_) + " on every loader");
    }
    return Status::InvalidArgument(
        "source fed by the caller: " + std::to_string(counts[0]) + " reading rank(s) ran out " +
        "of samples at step " + std::to_string(step_) + " while " + std::to_string(counts[1]) +
        " still had some: every loader must yield its share of every step");
  }
  return Agree(local, "read");
}

}  // namespace thdpack
