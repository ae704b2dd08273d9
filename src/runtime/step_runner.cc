// The distributed step of thdpack/step_runner.h. Phase by phase as documented there; every
// phase that can fail on one rank ends with AgreeOnStatus over the world before any rank waits
// on data from another.
#include "thdpack/step_runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "runtime/step_runner_impl.h"
#include "thdpack/shard.h"
#include "thdpack/step.h"

namespace thdpack {

std::string_view DataOnName(DataOn mode) { return mode == DataOn::kAll ? "all" : "tp0"; }

Result<DataOn> ParseDataOn(std::string_view text) {
  if (text == "tp0") return DataOn::kTp0;
  if (text == "all") return DataOn::kAll;
  return Status::InvalidArgument("--data-on: \"" + std::string(text) +
                                 "\" is not a mode: expected tp0 or all");
}

std::string_view PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kRead: return "read";
    case Phase::kLengths: return "lengths";
    case Phase::kPlan: return "plan";
    case Phase::kExchange: return "exchange";
    case Phase::kPack: return "pack";
    case Phase::kDeliver: return "deliver";
    case Phase::kAgree: return "agree";
  }
  return "invalid";
}

int64_t RankStep::bytes_sent() const {
  int64_t n = 0;
  for (const PhaseStats& p : phases) n += p.bytes_sent;
  return n;
}

int64_t PhaseTable::max_rank_bytes() const {
  int64_t most = 0;
  const size_t ranks = bytes.empty() ? 0 : bytes[0].size();
  for (size_t r = 0; r < ranks; ++r) {
    int64_t t = 0;
    for (const auto& b : bytes) t += b[r];
    most = std::max(most, t);
  }
  return most;
}

Result<PhaseTable> GatherPhases(ProcessGroup& world, const RankStep& step) {
  constexpr size_t kPhases = kNumPhases;
  std::vector<int64_t> my_bytes(kPhases, 0);
  std::vector<double> my_times(kPhases, 0);
  for (const PhaseStats& p : step.phases) {
    my_bytes[static_cast<size_t>(p.phase)] = p.bytes_sent;
    my_times[static_cast<size_t>(p.phase)] = p.seconds;
  }
  const size_t n = static_cast<size_t>(world.size());
  std::vector<int64_t> bytes(n * kPhases);
  std::vector<double> times(n * kPhases);
  THDPACK_RETURN_IF_ERROR(world.AllGatherValues(std::span<const int64_t>(my_bytes),
                                                std::span<int64_t>(bytes)));
  THDPACK_RETURN_IF_ERROR(world.AllGatherValues(std::span<const double>(my_times),
                                                std::span<double>(times)));
  PhaseTable table;
  table.bytes.assign(kPhases, std::vector<int64_t>(n, 0));
  table.seconds.assign(kPhases, 0);
  table.rank_seconds.assign(n, 0);
  for (size_t k = 0; k < kPhases; ++k) {
    for (size_t r = 0; r < n; ++r) {
      table.bytes[k][r] = bytes[r * kPhases + k];
      table.seconds[k] = std::max(table.seconds[k], times[r * kPhases + k]);
      table.rank_seconds[r] += times[r * kPhases + k];
    }
  }
  for (double t : table.rank_seconds) table.step_seconds = std::max(table.step_seconds, t);
  return table;
}

using namespace runner_internal;  // NOLINT: the runtime area's own helpers


bool ReadsShare(const Coord& c, const StepRunnerOptions& options) {
  const bool all = options.data_on == DataOn::kAll;
  if (options.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic) {
    return c.cp == 0 && (all || (c.tp == 0 && c.pp == 0));
  }
  return all || (c.tp == 0 && c.cp == 0 && c.pp == 0);
}

Status StepRunner::Impl::Init() {
  Status local;
  if (world_.size() != topo_.world_size()) {
    local = Status::InvalidArgument("StepRunner: the world has " + std::to_string(world_.size()) +
                                    " ranks, the topology " + topo_.ToString() + " needs " +
                                    std::to_string(topo_.world_size()));
  } else if (opts_.schedule.max_tokens_per_rank <= 0) {
    local = Status::InvalidArgument("StepRunner: max_tokens_per_rank = " +
                                    std::to_string(opts_.schedule.max_tokens_per_rank) +
                                    " must be > 0");
  } else if (opts_.schedule.dp_size != topo_.dp_size()) {
    local = Status::InvalidArgument("StepRunner: schedule dp_size = " +
                                    std::to_string(opts_.schedule.dp_size) +
                                    " must be the topology's " + topo_.ToString());
  } else if (const ParallelLayout& p = opts_.schedule.parallel;
             p.cp_size() != topo_.cp_size() || p.tp_size() != topo_.tp_size()) {
    local = Status::InvalidArgument("StepRunner: schedule.parallel " + p.ToString() +
                                    " does not match the topology " + topo_.ToString() +
                                    " (CP and TP must be the topology's)");
  } else if (opts_.global_batch < 0) {
    local = Status::InvalidArgument("StepRunner: global_batch = " +
                                    std::to_string(opts_.global_batch) +
                                    " must be >= 0 (0 = the whole source)");
  }
  if (local.ok() && opts_.global_batch_tokens > 0 && opts_.read_share) {
    local = Status::InvalidArgument(
        "StepRunner: global_batch_tokens = " + std::to_string(opts_.global_batch_tokens) +
        " with a caller-fed source: a token step's size needs every sample's length in stream "
        "order, and each loader sees only its own share (count the batch in samples, or pack "
        "each batch you choose with pack_batch)");
  }
  if (local.ok() && opts_.read_share &&
      opts_.schedule.oversize == ScheduleOptions::OversizePolicy::kSplit) {
    local = Status::InvalidArgument(
        "StepRunner: oversize 'split' with a caller-fed source: the pieces of a sample are "
        "samples of the stream, and a caller's batch is its own (split long samples before "
        "handing them over, or use 'truncate' or 'skip')");
  }
  if (local.ok()) local = ValidateFieldSpecs(opts_.fields).WithContext("StepRunner");
  if (local.ok() && !opts_.fields.empty() && !opts_.read_share) {
    local = Status::InvalidArgument("StepRunner: " + std::to_string(opts_.fields.size()) +
                                    " field(s) declared (first " + opts_.fields[0].ToString() +
                                    ") but the samples come from '" + opts_.data +
                                    "': only a source fed by the caller carries fields");
  }
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    if (!opts_.fields[f].per_token()) sample_fields_.push_back(f);
  }
  if (local.ok()) local = FindGroupField();
  dynamic_ = opts_.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic;
  if (!opts_.read_share) {
    const Result<SourceKind> kind = SourceKindOf(opts_.data);
    blend_ = kind.ok() && *kind == SourceKind::kBlend;
  }
  if (local.ok() && dynamic_ && opts_.max_cp_groups < 1) {
    local = Status::InvalidArgument("StepRunner: max_cp_groups = " +
                                    std::to_string(opts_.max_cp_groups) + " must be >= 1");
  }
  const bool all = opts_.data_on == DataOn::kAll;
  if (local.ok()) {
    auto c = topo_.CoordOf(world_.rank());
    if (!c.ok()) {
      local = c.status();
    } else {
      coord_ = *c;
      // Static: the loaders (every rank with all). Dynamic: with all, the ranks cp = 0 of every
      // (tp, pp) slice, which is a domain of its own.
      reader_ = ReadsShare(coord_, opts_);
      head_ = dynamic_ && (all || (coord_.tp == 0 && coord_.pp == 0));
      if (reader_ && !opts_.read_share) {
        auto src = OpenStepSource(opts_.data, opts_.source, opts_.schedule);
        if (src.ok()) {
          source_ = std::move(*src);
          auto tokens = TokenStepsFor(opts_.global_batch_tokens, opts_.schedule);
          auto steps = tokens.ok() ? StepReader::Create(source_.get(), opts_.global_batch,
                                                        topo_.dp_size(), *tokens)
                                   : Result<StepReader>(tokens.status());
          if (steps.ok()) {
            steps_.emplace(std::move(*steps));
          } else {
            local = steps.status();
          }
        } else {
          local = src.status();
        }
      }
      if (local.ok() && reader_) local = StartReading();
    }
  }
  if (local.ok() && opts_.start_step < 0) {
    local = Status::InvalidArgument("StepRunner: start_step = " +
                                    std::to_string(opts_.start_step) + " must be >= 0");
  }
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world_, local, "opening the step runner"));
  THDPACK_RETURN_IF_ERROR(ShareStart());

  if (dynamic_) return InitDynamic();
  // Loaders: with tp0 the DP group at tp = cp = pp = 0; with all, every DP group.
  std::vector<std::vector<int>> loader_groups;
  if (all) {
    loader_groups = topo_.AllGroups(GroupKind::kDp);
  } else {
    THDPACK_ASSIGN_OR_RETURN(auto g, topo_.GroupOf(GroupKind::kDp, 0));
    loader_groups.push_back(std::move(g));
  }
  THDPACK_ASSIGN_OR_RETURN(loaders_, world_.Split(loader_groups));
  if (reader_ && (!loaders_ || loaders_->rank() != coord_.dp)) {
    return Status::Internal("StepRunner: loader group position differs from the dp index");
  }
  if (opts_.data_on == DataOn::kTp0) {
    // Replica d: every rank with that dp, its loader first, then the others by global rank.
    std::vector<std::vector<int>> replicas(static_cast<size_t>(topo_.dp_size()));
    for (int d = 0; d < topo_.dp_size(); ++d) {
      THDPACK_ASSIGN_OR_RETURN(int loader, topo_.RankOf(Coord{0, 0, d, 0}));
      replicas[static_cast<size_t>(d)].push_back(loader);
    }
    for (int r = 0; r < topo_.world_size(); ++r) {
      THDPACK_ASSIGN_OR_RETURN(Coord c, topo_.CoordOf(r));
      if (c.tp == 0 && c.cp == 0 && c.pp == 0) continue;
      replicas[static_cast<size_t>(c.dp)].push_back(r);
    }
    THDPACK_ASSIGN_OR_RETURN(replica_, world_.Split(replicas));
  }
  return Status::Ok();
}

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

// World rank 0 reads in every mode (a loader, a head): its start is everyone's.
Status StepRunner::Impl::ShareStart() {
  std::string text = world_.rank() == 0 ? RunStateToJson(state_) : std::string();
  int64_t size = static_cast<int64_t>(text.size());
  THDPACK_RETURN_IF_ERROR(world_.BroadcastValues(std::span<int64_t>(&size, 1), 0));
  if (size <= 0 || size > (int64_t{1} << 24)) {
    return Status::Corruption("step runner: a start state of " + std::to_string(size) + " bytes");
  }
  text.resize(static_cast<size_t>(size));
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
  after_ = PackPosition(state_.consumed, state_.cursor);
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
  after_ = PackPosition(state_.consumed, state_.cursor);
  if (source_) restore_error_ = steps_->Start(saved.next_step, saved.consumed, saved.cursor);
  return Status::Ok();
}

Status StepRunner::Impl::CommitPosition(RankStep& out) {
  state_.next_step = step_;
  THDPACK_RETURN_IF_ERROR(UnpackPosition(after_, &state_));
  out.after = state_;
  return Status::Ok();
}

// After the position: n_loss_sequences, the microbatch count, then per microbatch n, the ids,
// the loss-token counts, a blend's sources, and each sample field's rows as bytes in whole
// words (their size follows from n and the schema).
void StepRunner::Impl::AppendSequences(PositionWords* w) const {
  w->push_back(n_loss_sequences_);
  w->push_back(static_cast<int64_t>(mb_info_.size()));
  for (const SequenceInfo& m : mb_info_) {
    w->push_back(static_cast<int64_t>(m.ids.size()));
    w->insert(w->end(), m.ids.begin(), m.ids.end());
    w->insert(w->end(), m.n_targets.begin(), m.n_targets.end());
    if (blend_) w->insert(w->end(), m.sources.begin(), m.sources.end());
    for (const std::vector<std::byte>& rows : m.sample_fields) {
      const size_t at = w->size();
      w->resize(at + (rows.size() + 7) / 8, 0);
      if (!rows.empty()) std::memcpy(w->data() + at, rows.data(), rows.size());
    }
  }
}

Status StepRunner::Impl::ReadSequences(const PositionWords& w, size_t at) {
  mb_info_.clear();
  auto bad = [] {
    return Status::Internal("step runner: the sequences of the microbatches do not decode");
  };
  auto take = [&](size_t count, auto* out) {
    if (count > w.size() - at) return false;
    out->assign(w.begin() + static_cast<std::ptrdiff_t>(at),
                w.begin() + static_cast<std::ptrdiff_t>(at + count));
    at += count;
    return true;
  };
  if (w.size() - at < 2 || w[at + 1] < 0 || static_cast<uint64_t>(w[at + 1]) > w.size()) {
    return bad();
  }
  n_loss_sequences_ = w[at];
  mb_info_.resize(static_cast<size_t>(w[at + 1]));
  at += 2;
  for (SequenceInfo& m : mb_info_) {
    if (at >= w.size() || w[at] < 0 || static_cast<uint64_t>(w[at]) > w.size()) return bad();
    const size_t n = static_cast<size_t>(w[at++]);
    if (!take(n, &m.ids) || !take(n, &m.n_targets) || (blend_ && !take(n, &m.sources))) {
      return bad();
    }
    for (size_t f : sample_fields_) {
      const size_t bytes = n * opts_.fields[f].row_bytes(), words = (bytes + 7) / 8;
      if (words > w.size() - at) return bad();
      std::vector<std::byte> rows(bytes);
      if (bytes > 0) std::memcpy(rows.data(), w.data() + at, bytes);
      at += words;
      m.sample_fields.push_back(std::move(rows));
    }
  }
  return at == w.size() ? Status::Ok() : bad();
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
    after_ = PackPosition(state_.consumed + share.n, std::nullopt);
  } else {
    THDPACK_ASSIGN_OR_RETURN(share, steps_->NextShare(coord_.dp));
    after_ = PackPosition(steps_->consumed(), source_->cursor());
  }
  if (opts_.read_share) {
    for (const Sample& x : share.samples) {
      THDPACK_RETURN_IF_ERROR(CheckSampleFields(
          opts_.fields, x.fields, static_cast<int64_t>(x.tokens.size()),
          "sample id " + std::to_string(x.id) + " (step " + std::to_string(step_) +
              ", read by loader dp=" + std::to_string(coord_.dp) + ")"));
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
  const int64_t budget = MicrobatchBudget(opts_.schedule);
  const ParallelLayout& parallel = opts_.schedule.parallel;
  for (const Sample& x : own_) {
    const int64_t length = static_cast<int64_t>(x.tokens.size());
    const int64_t padded = parallel.MicrobatchTokens(parallel.PaddedLength(length));
    if (padded <= budget) continue;
    return Status::InvalidArgument(
        "sample id " + std::to_string(x.id) + " (step " + std::to_string(step_) + ", source " +
        (source_ ? source_->spec() : std::string("fed by the caller")) +
        ", read by loader dp=" + std::to_string(coord_.dp) + "): length " +
        std::to_string(length) + " pads to " + std::to_string(padded) +
        " tokens, over the microbatch budget CP * max_tokens_per_rank = " +
        std::to_string(budget));
  }
  return Status::Ok();
}

Status StepRunner::Impl::FindGroupField() {
  const bool keep = opts_.schedule.keep_groups != ScheduleOptions::KeepGroups::kNone;
  const std::string mode(KeepGroupsName(opts_.schedule.keep_groups));
  if (opts_.group_field.empty()) {
    if (!keep) return Status::Ok();
    return Status::InvalidArgument("StepRunner: keep_groups '" + mode +
                                   "' needs group_field, the sample field holding each "
                                   "sample's group id");
  }
  if (!keep) {
    return Status::InvalidArgument("StepRunner: group_field '" + opts_.group_field +
                                   "' given but keep_groups is 'none' (set 'microbatch' or "
                                   "'replica')");
  }
  if (opts_.schedule.scheduler == ScheduleOptions::Scheduler::kSequential) {
    return Status::InvalidArgument("StepRunner: keep_groups '" + mode +
                                   "' needs the balanced or the dynamic scheduler, not "
                                   "'sequential'");
  }
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    const FieldSpec& spec = opts_.fields[f];
    if (spec.name != opts_.group_field) continue;
    if (spec.kind != FieldKind::kSample || spec.width() != 1 ||
        (spec.dtype != FieldDtype::kInt32 && spec.dtype != FieldDtype::kInt64)) {
      return Status::InvalidArgument("StepRunner: group_field '" + opts_.group_field +
                                     "' is " + spec.ToString() +
                                     "; a group id must be a sample field of int32 or int64, "
                                     "shape []");
    }
    group_field_ = static_cast<int>(f);
    return Status::Ok();
  }
  return Status::InvalidArgument("StepRunner: group_field '" + opts_.group_field +
                                 "' is not one of the " + std::to_string(opts_.fields.size()) +
                                 " declared fields");
}

int64_t StepRunner::Impl::GroupOf(const Sample& x) const {
  const std::vector<std::byte>& b = x.fields[static_cast<size_t>(group_field_)];
  if (opts_.fields[static_cast<size_t>(group_field_)].dtype == FieldDtype::kInt32) {
    int32_t v = 0;
    std::memcpy(&v, b.data(), sizeof v);
    return v;
  }
  int64_t v = 0;
  std::memcpy(&v, b.data(), sizeof v);
  return v;
}

// Every member sends a header (its sample count, and the step's first id, id span and epoch,
// which members that read nothing take from loader 0), then the loaders' (id offset, L,
// n_targets) triples, 12 bytes a sample (+4 with a blend's source, +8 with keep_groups' group
// id), gathered in loader order.
Status StepRunner::Impl::ExchangeLengths(ProcessGroup& g, int loader_stride, RankStep& out) {
  const int dp = topo_.dp_size();
  const size_t gs = static_cast<size_t>(g.size());
  // The header: count, first id, id span, epoch, and the size of the run's position after the
  // step, which member 0 then sends to members that read nothing (a dynamic step's heads with
  // cp > 0).
  // Then this loader's truncation counts (oversize 'truncate'), summed over the loaders.
  constexpr size_t kHeader = 8;
  const std::array<int64_t, kHeader> header = {static_cast<int64_t>(own_.size()), first_id_,
                                               id_span_, out.epoch,
                                               static_cast<int64_t>(after_.size()),
                                               own_cut_.samples, own_cut_.tokens,
                                               own_cut_.targets};
  std::vector<int64_t> all(kHeader * gs);
  THDPACK_RETURN_IF_ERROR(
      g.AllGatherValues(std::span<const int64_t>(header), std::span<int64_t>(all)));
  if (!reader_) {
    first_id_ = all[1];
    id_span_ = all[2];
    out.epoch = all[3];
  }
  out.truncated = Truncation{};
  for (size_t j = 0; j < gs; ++j) {
    out.truncated.samples += all[kHeader * j + 5];
    out.truncated.tokens += all[kHeader * j + 6];
    out.truncated.targets += all[kHeader * j + 7];
  }
  if (loader_stride > 1) {
    if (all[4] < 2 || all[4] > (int64_t{1} << 26)) {
      return Status::Internal("length exchange: a run position of " + std::to_string(all[4]) +
                              " words");
    }
    if (!reader_) after_.assign(static_cast<size_t>(all[4]), 0);
    THDPACK_RETURN_IF_ERROR(g.BroadcastValues(std::span<int64_t>(after_), 0));
  }
  // id offset, L, n_targets (, source) (, group id as two words)
  const size_t per = (blend_ ? 4 : 3) + (group_field_ >= 0 ? 2 : 0);
  std::vector<int64_t> c(gs, 0), dsp(gs, 0);
  loader_offset_.assign(static_cast<size_t>(dp) + 1, 0);
  for (size_t j = 0; j < gs; ++j) {
    const int64_t n_j = all[kHeader * j];
    const bool loader = j % static_cast<size_t>(loader_stride) == 0;
    if (n_j < 0 || n_j > (int64_t{1} << 40) || (!loader && n_j != 0)) {
      return Status::Internal("length exchange: member " + std::to_string(j) + " count " +
                              std::to_string(n_j) + " out of range");
    }
    if (loader) {
      const size_t d = j / static_cast<size_t>(loader_stride);
      loader_offset_[d + 1] = loader_offset_[d] + n_j;
    }
    c[j] = static_cast<int64_t>(per) * n_j;
    if (j > 0) dsp[j] = dsp[j - 1] + c[j - 1];
  }
  const int64_t n = loader_offset_.back();
  std::vector<int32_t> send;
  send.reserve(per * own_.size());
  for (const Sample& x : own_) {
    send.push_back(static_cast<int32_t>(x.id - first_id_));
    send.push_back(static_cast<int32_t>(x.tokens.size()));
    send.push_back(static_cast<int32_t>(NumTargets(x)));
    if (blend_) send.push_back(x.source);
    if (group_field_ >= 0) {
      const uint64_t g = static_cast<uint64_t>(GroupOf(x));
      send.push_back(static_cast<int32_t>(static_cast<uint32_t>(g)));
      send.push_back(static_cast<int32_t>(static_cast<uint32_t>(g >> 32)));
    }
  }
  std::vector<int32_t> recv(per * static_cast<size_t>(n));
  THDPACK_RETURN_IF_ERROR(
      g.AllGatherVValues(std::span<const int32_t>(send), std::span<int32_t>(recv), c, dsp));
  out.samples.resize(static_cast<size_t>(n));
  step_groups_.assign(group_field_ >= 0 ? static_cast<size_t>(n) : 0, 0);
  position_of_offset_.assign(static_cast<size_t>(id_span_), -1);
  for (int64_t p = 0; p < n; ++p) {
    const int32_t* v = recv.data() + per * static_cast<size_t>(p);
    const int32_t off = v[0];
    if (off < 0 || off >= id_span_ || position_of_offset_[static_cast<size_t>(off)] != -1) {
      return Status::Internal("length exchange: sample offset " + std::to_string(off) +
                              " out of range or repeated");
    }
    position_of_offset_[static_cast<size_t>(off)] = p;
    out.samples[static_cast<size_t>(p)] =
        SampleLength{first_id_ + off, v[1], v[2], blend_ ? v[3] : 0};
    if (group_field_ >= 0) {
      const size_t w = blend_ ? 4 : 3;
      step_groups_[static_cast<size_t>(p)] = static_cast<int64_t>(
          static_cast<uint64_t>(static_cast<uint32_t>(v[w])) |
          (static_cast<uint64_t>(static_cast<uint32_t>(v[w + 1])) << 32));
    }
  }
  return Status::Ok();
}

Status StepRunner::Impl::MakePlan(RankStep& out) {
  THDPACK_ASSIGN_OR_RETURN(out.plan, Schedule(out.samples, opts_.schedule, step_groups_));
  if (opts_.check_plan_hash) {
    THDPACK_RETURN_IF_ERROR(AgreeOnPlanHash(*loaders_, HashPlan(out.plan), "plan", step_));
  }
  replica_of_.assign(out.samples.size(), -1);
  for (int d = 0; d < out.plan.dp_size; ++d) {
    for (int m = 0; m < out.plan.num_microbatches; ++m) {
      for (int64_t id : out.plan.Microbatch(d, m)) {
        replica_of_[static_cast<size_t>(position_of_offset_[static_cast<size_t>(id - first_id_)])] = d;
      }
    }
  }
  return Status::Ok();
}

// The all-to-all-v of sample payloads among the loaders. The block from loader s to loader e
// holds, for the samples s read that the plan sends to e (scheduling order), first all their
// int32 tokens, then the masks of those that send one, padded to a multiple of 4 bytes so that
// every block, and so every token array, stays 4-byte aligned in the receive buffer.
// The token exchange of a step over `group`: the samples at the positions send_ps[e] (read by
// this rank: own_ holds positions my_begin, my_begin + 1, ...) go to member e, tokens first
// and then the masks that travel, in blocks padded to 4 bytes; those at recv_ps[e] come from
// member e. refs_ then points at every sample this rank packs: its own where keeps(position),
// the received ones in recv_buffer_.
Status StepRunner::Impl::MoveSamples(ProcessGroup& group, const std::vector<SampleLength>& samples,
                                     const std::vector<std::vector<int64_t>>& send_ps,
                                     const std::vector<std::vector<int64_t>>& recv_ps,
                                     int64_t my_begin, const std::function<bool(int64_t)>& keeps) {
  const size_t n = static_cast<size_t>(group.size());
  auto block_bytes = [&](const std::vector<int64_t>& ps) {
    int64_t b = 0;
    for (int64_t p : ps) b += PayloadBytes(samples[static_cast<size_t>(p)], opts_.fields);
    return (b + 3) / 4 * 4;
  };
  std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  for (size_t e = 0; e < n; ++e) {
    sc[e] = block_bytes(send_ps[e]);
    rc[e] = block_bytes(recv_ps[e]);
  }
  for (size_t j = 1; j < n; ++j) {
    sd[j] = sd[j - 1] + sc[j - 1];
    rd[j] = rd[j - 1] + rc[j - 1];
  }
  std::vector<std::byte> send(static_cast<size_t>(sd[n - 1] + sc[n - 1]), std::byte{0});
  for (size_t e = 0; e < n; ++e) {
    std::byte* dst = send.data() + sd[e];
    for (int64_t p : send_ps[e]) {
      const Sample& x = own_[static_cast<size_t>(p - my_begin)];
      std::memcpy(dst, x.tokens.data(), x.tokens.size() * sizeof(TokenId));
      dst += x.tokens.size() * sizeof(TokenId);
    }
    for (int64_t p : send_ps[e]) {
      if (!SendsMask(samples[static_cast<size_t>(p)])) continue;
      const Sample& x = own_[static_cast<size_t>(p - my_begin)];
      std::memcpy(dst, x.target_mask.data(), x.target_mask.size());
      dst += x.target_mask.size();
    }
    for (int64_t p : send_ps[e]) {
      for (const std::vector<std::byte>& f : own_[static_cast<size_t>(p - my_begin)].fields) {
        if (f.empty()) continue;
        std::memcpy(dst, f.data(), f.size());
        dst += f.size();
      }
    }
  }
  recv_buffer_.assign(static_cast<size_t>(rd[n - 1] + rc[n - 1]), std::byte{0});
  THDPACK_RETURN_IF_ERROR(group.AllToAllV(send, sc, sd, recv_buffer_, rc, rd));

  // Where each sample this rank packs lives now.
  refs_.assign(samples.size(), SampleRef{});
  for (size_t k = 0; k < own_.size(); ++k) {
    if (!keeps(my_begin + static_cast<int64_t>(k))) continue;
    const Sample& x = own_[k];
    SampleRef& r = refs_[static_cast<size_t>(my_begin) + k];
    r = SampleRef{x.tokens.data(), x.target_mask.empty() ? nullptr : x.target_mask.data(),
                  static_cast<int64_t>(x.tokens.size())};
    r.own_fields = &x.fields;
  }
  for (size_t e = 0; e < n; ++e) {
    const std::byte* at = recv_buffer_.data() + rd[e];
    for (int64_t p : recv_ps[e]) {
      const int64_t L = samples[static_cast<size_t>(p)].length;
      refs_[static_cast<size_t>(p)] = SampleRef{reinterpret_cast<const TokenId*>(at), nullptr, L};
      at += L * static_cast<int64_t>(sizeof(TokenId));
    }
    for (int64_t p : recv_ps[e]) {
      const SampleLength& len = samples[static_cast<size_t>(p)];
      if (!SendsMask(len)) continue;
      refs_[static_cast<size_t>(p)].mask = reinterpret_cast<const uint8_t*>(at);
      at += len.length;
    }
    for (int64_t p : recv_ps[e]) {
      refs_[static_cast<size_t>(p)].fields = at;
      at += FieldBytes(opts_.fields, samples[static_cast<size_t>(p)].length);
    }
  }
  return Status::Ok();
}

Status StepRunner::Impl::ExchangeTokens(RankStep& out) {
  const int dp = topo_.dp_size();
  const int me = coord_.dp;
  const auto& samples = out.samples;
  const size_t udp = static_cast<size_t>(dp);
  auto positions = [&](int s, int e) {  // scheduling positions of block s -> e
    std::vector<int64_t> ps;
    for (int64_t p = loader_offset_[static_cast<size_t>(s)]; p < loader_offset_[static_cast<size_t>(s) + 1]; ++p) {
      if (replica_of_[static_cast<size_t>(p)] == e) ps.push_back(p);
    }
    return ps;
  };
  std::vector<std::vector<int64_t>> send_ps(udp), recv_ps(udp);
  for (int e = 0; e < dp; ++e) {
    if (e == me) continue;
    send_ps[static_cast<size_t>(e)] = positions(me, e);
    recv_ps[static_cast<size_t>(e)] = positions(e, me);
  }
  const int64_t my_begin = loader_offset_[static_cast<size_t>(me)];
  return MoveSamples(*loaders_, samples, send_ps, recv_ps, my_begin,
                     [&](int64_t p) { return replica_of_[static_cast<size_t>(p)] == me; });
}

// Packs this replica's microbatches: the loader (tp0) every CP rank's shards, a rank with
// DataOn::kAll only its own; and the replica's StepMeta.
Status StepRunner::Impl::PackReplica(RankStep& out) {
  const int me = coord_.dp;
  const int cp = topo_.cp_size();
  const Plan& plan = out.plan;
  PackOptions po;
  po.parallel = opts_.schedule.parallel;
  po.pad_id = opts_.pad_id;
  po.fixed_tokens = FixedMicrobatchTokens(opts_.schedule);
  StepMeta& meta = out.meta;
  meta = MetaHeader(step_, out.epoch, topo_.dp_size(), me, opts_.schedule.parallel, plan.skipped);
  n_loss_sequences_ = 0;
  for (size_t p = 0; p < out.samples.size(); ++p) {
    if (replica_of_[p] < 0) continue;
    meta.n_loss_tokens += out.samples[p].n_targets;
    n_loss_sequences_ += out.samples[p].n_targets > 0 ? 1 : 0;
  }
  const bool tp0 = opts_.data_on == DataOn::kTp0;
  const bool first = coord_.pp == 0, last = coord_.pp == topo_.pp_size() - 1;
  shards_.assign(static_cast<size_t>(plan.num_microbatches), {});
  mb_info_.assign(static_cast<size_t>(plan.num_microbatches), {});
  std::vector<SampleView> views;
  std::vector<int64_t> lengths, ps;
  for (int m = 0; m < plan.num_microbatches; ++m) {
    views.clear();
    lengths.clear();
    ps.clear();
    for (int64_t id : plan.Microbatch(me, m)) {
      const size_t p = static_cast<size_t>(position_of_offset_[static_cast<size_t>(id - first_id_)]);
      ps.push_back(static_cast<int64_t>(p));
      const SampleRef& r = refs_[p];
      views.emplace_back(id, std::span<const TokenId>(r.tokens, static_cast<size_t>(r.length)),
                         r.mask ? std::span<const uint8_t>(r.mask, static_cast<size_t>(r.length))
                                : std::span<const uint8_t>());
      lengths.push_back(r.length);
    }
    THDPACK_ASSIGN_OR_RETURN(Layout layout, ComputeLayout(lengths, po));
    const size_t local = static_cast<size_t>(layout.total_tokens / cp);
    auto& shards = shards_[static_cast<size_t>(m)];
    std::vector<PackBuffers> bufs;
    const int first_cp = tp0 ? 0 : coord_.cp;
    const int n_cp = tp0 ? cp : 1;
    for (int c = 0; c < n_cp; ++c) {
      PackedShard sh;
      sh.cp_rank = first_cp + c;
      const bool want_first = tp0 || first, want_last = tp0 || last;
      if (want_first) {
        sh.tokens.resize(local);
        sh.position_ids.resize(local);
      }
      if (want_last) {
        sh.labels.resize(local);
        sh.loss_mask.resize(local);
      }
      shards.push_back(std::move(sh));
    }
    for (auto& sh : shards) {
      bufs.push_back(PackBuffers{sh.tokens, sh.position_ids, sh.labels, sh.loss_mask});
    }
    int64_t n_valid = 0;
    if (tp0) {
      THDPACK_ASSIGN_OR_RETURN(n_valid, PackShardAllInto(views, layout, po, bufs));
    } else {
      THDPACK_ASSIGN_OR_RETURN(n_valid, PackShardInto(views, layout, po, coord_.cp, bufs[0]));
    }
    THDPACK_RETURN_IF_ERROR(PackSequences(out, static_cast<size_t>(m), ps, layout, cp, shards));
    AddMicrobatch(meta, std::move(layout), n_valid);
  }
  return SealMeta(meta);
}

Status StepRunner::Impl::PackSequences(RankStep& out, size_t m, std::span<const int64_t> ps,
                                       const Layout& layout, int cp_size,
                                       std::vector<PackedShard>& shards) {
  SequenceInfo& info = mb_info_[m];
  for (int64_t p : ps) {
    const SampleLength& x = out.samples[static_cast<size_t>(p)];
    info.ids.push_back(x.id);
    info.n_targets.push_back(x.n_targets);
    if (blend_) info.sources.push_back(x.source);
  }
  const std::vector<FieldSpec>& fields = opts_.fields;
  if (fields.empty()) return Status::Ok();
  // Field f of the sample at position p: its own buffer, or its place in the exchange buffer.
  auto field_of = [&](int64_t p, size_t f) {
    const SampleRef& r = refs_[static_cast<size_t>(p)];
    if (r.own_fields != nullptr) return std::span<const std::byte>((*r.own_fields)[f]);
    size_t at = 0;
    for (size_t g = 0; g < f; ++g) at += fields[g].bytes_for(r.length);
    return std::span<const std::byte>(r.fields + at, fields[f].bytes_for(r.length));
  };
  std::vector<std::span<const std::byte>> values(ps.size());
  info.sample_fields.assign(sample_fields_.size(), {});
  for (size_t f = 0, sf = 0; f < fields.size(); ++f) {
    const FieldSpec& spec = fields[f];
    for (size_t k = 0; k < ps.size(); ++k) values[k] = field_of(ps[k], f);
    if (!spec.per_token()) {
      std::vector<std::byte>& rows = info.sample_fields[sf++];
      for (const auto& v : values) rows.insert(rows.end(), v.begin(), v.end());
      continue;
    }
    const size_t bytes = static_cast<size_t>(layout.total_tokens / cp_size) * spec.row_bytes();
    for (PackedShard& sh : shards) {
      sh.fields.resize(fields.size());
      if (!spec.HeldWith(!sh.tokens.empty(), !sh.labels.empty())) continue;
      sh.fields[f].resize(bytes);
      THDPACK_RETURN_IF_ERROR(
          PackFieldShardInto(spec, values, layout, cp_size, sh.cp_rank, sh.fields[f]));
    }
  }
  return Status::Ok();
}

Status StepRunner::Impl::SealMeta(const StepMeta& meta) {
  if (opts_.data_on == DataOn::kTp0) {
    THDPACK_ASSIGN_OR_RETURN(meta_bytes_, EncodeStepMeta(meta));
    return Status::Ok();
  }
  return ValidateStepMeta(meta);
}

// The step's metadata from position 0 of `group` (the loader of a replica, the head of a
// column) to every other member.
Status StepRunner::Impl::DeliverMeta(ProcessGroup& group) {
  // One message: the encoded metadata, then as int64 words the run's position after the step
  // and what the microbatches' sequences are (AppendSequences). The sizes go first.
  PositionWords words;
  if (group.rank() == 0) {
    words = after_;
    AppendSequences(&words);
  }
  std::array<int64_t, 2> head = {static_cast<int64_t>(meta_bytes_.size()),
                                 static_cast<int64_t>(words.size())};
  THDPACK_RETURN_IF_ERROR(group.BroadcastValues(std::span<int64_t>(head), 0));
  const int64_t size = head[0];
  if (size < 0 || size > (int64_t{1} << 32) || head[1] < 2 || head[1] > (int64_t{1} << 28)) {
    return Status::Corruption("step metadata size " + std::to_string(size) + " (" +
                              std::to_string(head[1]) + " words) out of range");
  }
  std::vector<uint8_t> wire(static_cast<size_t>(size) + 8 * static_cast<size_t>(head[1]));
  if (group.rank() == 0) {
    std::memcpy(wire.data(), meta_bytes_.data(), meta_bytes_.size());
    std::memcpy(wire.data() + size, words.data(), 8 * words.size());
    if (corrupt_metadata_of_replica_ == coord_.dp && size > 0) {
      wire[static_cast<size_t>(size) / 2] ^= 0x10;  // a test of the failure path flips one bit
    }
    return group.BroadcastValues(std::span<uint8_t>(wire), 0);
  }
  THDPACK_RETURN_IF_ERROR(group.BroadcastValues(std::span<uint8_t>(wire), 0));
  meta_bytes_.assign(wire.begin(), wire.begin() + size);
  words.resize(static_cast<size_t>(head[1]));
  std::memcpy(words.data(), wire.data() + size, 8 * words.size());
  // The position first (its length follows from its words), then the sources.
  size_t at = 2;
  SourceCursor cursor;
  if (words[1] != 0 && !ReadCursor(words, &at, 0, &cursor)) {
    return Status::Internal("step runner: the run position received does not decode");
  }
  after_.assign(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(at));
  return ReadSequences(words, at);
}

// One microbatch's shard from position 0 of `group` to member `member`, whose stage is
// member_pp: tokens and positions to the first stage, labels and the loss mask to the last.
Status StepRunner::Impl::SendShard(ProcessGroup& group, int member, int member_pp,
                                   const PackedShard& sh) {
  if (member_pp == 0) {
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const TokenId>(sh.tokens), member, kTagTokens));
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const int32_t>(sh.position_ids), member, kTagPositions));
  }
  if (member_pp == topo_.pp_size() - 1) {
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const TokenId>(sh.labels), member, kTagLabels));
    THDPACK_RETURN_IF_ERROR(
        group.SendValues(std::span<const uint8_t>(sh.loss_mask), member, kTagMask));
  }
  // The per-token fields the member's stage holds: input fields with the tokens, target fields
  // with the labels.
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    const FieldSpec& spec = opts_.fields[f];
    if (!spec.per_token() || !spec.HeldWith(member_pp == 0, member_pp == topo_.pp_size() - 1)) {
      continue;
    }
    THDPACK_RETURN_IF_ERROR(group.Send(sh.fields[f], member, kTagFields + static_cast<int>(f)));
  }
  return Status::Ok();
}

// This rank's side of SendShard: the arrays of its stage, local_tokens each.
Status StepRunner::Impl::RecvShard(ProcessGroup& group, size_t local_tokens, PackedShard& sh) {
  if (coord_.pp == 0) {
    sh.tokens.resize(local_tokens);
    sh.position_ids.resize(local_tokens);
    THDPACK_RETURN_IF_ERROR(group.RecvValues(std::span<TokenId>(sh.tokens), 0, kTagTokens));
    THDPACK_RETURN_IF_ERROR(
        group.RecvValues(std::span<int32_t>(sh.position_ids), 0, kTagPositions));
  }
  if (coord_.pp == topo_.pp_size() - 1) {
    sh.labels.resize(local_tokens);
    sh.loss_mask.resize(local_tokens);
    THDPACK_RETURN_IF_ERROR(group.RecvValues(std::span<TokenId>(sh.labels), 0, kTagLabels));
    THDPACK_RETURN_IF_ERROR(group.RecvValues(std::span<uint8_t>(sh.loss_mask), 0, kTagMask));
  }
  sh.fields.assign(opts_.fields.size(), {});
  for (size_t f = 0; f < opts_.fields.size(); ++f) {
    const FieldSpec& spec = opts_.fields[f];
    if (!spec.per_token() || !spec.HeldWith(coord_.pp == 0, coord_.pp == topo_.pp_size() - 1)) {
      continue;
    }
    sh.fields[f].resize(local_tokens * spec.row_bytes());
    THDPACK_RETURN_IF_ERROR(group.Recv(sh.fields[f], 0, kTagFields + static_cast<int>(f)));
  }
  return Status::Ok();
}

Status StepRunner::Impl::ReceiveShards(RankStep& out) {
  if (replica_->rank() == 0) {
    // The loader sends, microbatch by microbatch, each member what its stage needs.
    for (size_t m = 0; m < shards_.size(); ++m) {
      for (int j = 1; j < replica_->size(); ++j) {
        THDPACK_ASSIGN_OR_RETURN(Coord c, topo_.CoordOf(replica_->ranks()[static_cast<size_t>(j)]));
        THDPACK_RETURN_IF_ERROR(
            SendShard(*replica_, j, c.pp, shards_[m][static_cast<size_t>(c.cp)]));
      }
    }
    // The loader keeps CP rank 0's shard.
    for (auto& per_m : shards_) {
      PackedShard keep = std::move(per_m[0]);
      per_m.clear();
      per_m.push_back(std::move(keep));
    }
    return Status::Ok();
  }
  shards_.assign(out.meta.microbatches.size(), {});
  for (size_t m = 0; m < shards_.size(); ++m) {
    const size_t local = static_cast<size_t>(out.meta.microbatches[m].cu_seqlens_padded.back() /
                                             topo_.cp_size());
    PackedShard sh;
    sh.cp_rank = coord_.cp;
    THDPACK_RETURN_IF_ERROR(RecvShard(*replica_, local, sh));
    shards_[m].push_back(std::move(sh));
  }
  return Status::Ok();
}

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
    SequenceInfo& info = mb_info_[m];  // this step's: each microbatch is made once
    lm.sources = std::move(info.sources);
    lm.sample_ids = std::move(info.ids);
    lm.seq_n_targets = std::move(info.n_targets);
    for (size_t k = 0; k < sample_fields_.size() && k < info.sample_fields.size(); ++k) {
      lm.fields[sample_fields_[k]] = std::move(info.sample_fields[k]);
    }
  }
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
  agree_seconds_ = 0;
  agree_bytes_ = 0;
  shards_.clear();
  meta_bytes_.clear();
  mb_info_.clear();
  return out;
}

Status StepRunner::Impl::AcceptMeta(RankStep& out, const std::string& sender, bool dynamic) {
  auto meta = DecodeStepMeta(meta_bytes_);
  if (!meta.ok()) {
    return meta.status().WithContext("step " + std::to_string(step_) +
                                     " metadata received from " + sender);
  }
  const bool dynamic_ok = !dynamic || (!meta->groups.empty() && meta->domain_rank == DomainIndex());
  if (meta->dp_size != topo_.dp_size() || meta->replica != coord_.dp ||
      meta->parallel != opts_.schedule.parallel || meta->step != static_cast<uint64_t>(step_) ||
      !dynamic_ok) {
    const std::string where = dynamic ? "domain rank " + std::to_string(meta->domain_rank)
                                      : "replica " + std::to_string(meta->replica);
    return Status::InvalidArgument(
        "step metadata received by rank " + std::to_string(world_.rank()) +
        " does not match its topology " + topo_.ToString() + " (" + where + ", DP " +
        std::to_string(meta->dp_size) + ", " + meta->parallel.ToString() + ", step " +
        std::to_string(meta->step) + (dynamic && meta->groups.empty() ? ", no groups" : "") +
        ")");
  }
  out.meta = std::move(*meta);
  out.epoch = static_cast<int64_t>(out.meta.epoch);
  return Status::Ok();
}

Status StepRunner::Impl::Deliver(RankStep& out, ProcessGroup* group, const std::string& sender,
                                 const std::function<Status()>& receive,
                                 const std::function<Status()>& then) {
  BeginPhase(out, Phase::kDeliver);
  Status local;
  if (group != nullptr) {
    local = DeliverMeta(*group);
    if (local.ok() && group->rank() != 0) local = AcceptMeta(out, sender, dynamic_);
    // Nobody waits for shards until every rank holds good metadata.
    Status agreed = Agree(local, "deliver metadata");
    if (!agreed.ok()) {
      EndPhase(out);
      return agreed;
    }
    local = receive();
  }
  if (then) {
    // Every rank is here with its data: `then` runs on all of them together.
    Status agreed = Agree(local, "deliver");
    if (!agreed.ok()) {
      EndPhase(out);
      return agreed;
    }
    local = then();
    EndPhase(out);
    return Agree(local, "groups");
  }
  EndPhase(out);
  return Agree(local, "deliver");
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

Result<RankStep> StepRunner::Impl::Next() {
  if (dynamic_) return NextDynamic();
  RankStep out = StartStep(reader_);
  const bool tp0 = opts_.data_on == DataOn::kTp0;

  THDPACK_RETURN_IF_ERROR(ReadPhase(out));
  THDPACK_RETURN_IF_ERROR(RunPhase(out, Phase::kLengths, reader_, "lengths",
                                   [&] { return ExchangeLengths(*loaders_, 1, out); }));
  THDPACK_RETURN_IF_ERROR(
      RunPhase(out, Phase::kPlan, reader_, "plan", [&] { return MakePlan(out); }));
  THDPACK_RETURN_IF_ERROR(
      RunPhase(out, Phase::kExchange, reader_, "exchange", [&] { return ExchangeTokens(out); }));
  const Status packed =
      RunPhase(out, Phase::kPack, reader_, "pack", [&] { return PackReplica(out); });
  own_.clear();  // packed: the samples are no longer needed
  THDPACK_RETURN_IF_ERROR(packed);

  THDPACK_RETURN_IF_ERROR(
      Deliver(out, tp0 ? replica_.get() : nullptr,
              "the loader of replica " + std::to_string(coord_.dp),
              [&] { return ReceiveShards(out); }, nullptr));
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
  THDPACK_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<StepRunner>(new StepRunner(std::move(impl)));
}

Result<RankStep> StepRunner::Next() { return impl_->Next(); }

const RunState& StepRunner::state() const { return impl_->state(); }

bool StepRunner::reads() const { return impl_->reads(); }

Status StepRunner::Restore(const RunState& state) { return impl_->Restore(state); }

}  // namespace thdpack
