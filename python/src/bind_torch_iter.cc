// python/src/bind_torch_iter.cc: the C++ core of thdpack.torch.PackedDataIterator - the one
// source of steps (StepSource, thdpack/step_runner.h: the step runner inline or ahead on a
// thread) over torch.distributed (torch_comm.h) - and, for tests, the same step over threads in
// one process.
//
//   thdpack._thdpack._TorchStepSource(world, torch_ranks, known, options, source, take_share,
//                                     prepare, cuda_device, monitored_barrier_seconds, depth,
//                                     steps, fields, kept_groups, media)
//       .next() -> (prepared, cp_groups, group_counts): one step as this rank holds it
//       .unpack(microbatches, values, unpack, fill, label_format): step.unpack (UnpackStep)
//   thdpack._thdpack._run_steps_on_threads(options, steps, source, shares, state, fields)
//       -> [rank][step] dicts of the same form
//   thdpack._thdpack._fed_positions(first_position, global_batch, dp, loader)
//       -> (positions, next first position): FedShares' rule, for loader_positions
//
// `options` are the job options of thdpack/job.h by their Python names (tp, cp, dp, pp, sp,
// global_batch, max_tokens_per_rank, scheduler, cost, ...). `source` is a source spec string, or
// None with a caller-fed source: take_share(count) (torch: up to `count` samples of the loader's
// iterable, fewer where it ended, None where it ended at the step boundary, more where a list
// holds more: pack_batch) or shares[dp] (threads) give each loader's own samples as (int32
// tokens, uint8 mask or None, fields or None, position or None) tuples; FedShares (step.h)
// checks the count and the positions given and sets the ids (the k-th sample of loader d in a
// step at stream position p has id p + k * DP + d). `fields` is the run's schema (fields_py.h;
// None: none). `media` (None: none) is (specs, spatial_merge_size, mrope,
// mrope_tokens_per_second, encoder cost or None), and a fed sample's tuple then has a fifth
// entry: per modality (int64 grid [3k], seconds or None, dtype name, width, uint8 payload).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/job.h"
#include "thdpack/shard.h"
#include "thdpack/step.h"
#include "thdpack/step_runner.h"
#include "job_options.h"
#include "fields_py.h"
#include "media_py.h"
#include "torch_comm.h"

namespace thdpack::python {
namespace {

Job ResolveOptions(const py::dict& options, const py::object& source) {
  JobOptions o;
  o.given.emplace();  // what is not set below is defaulted
  RunOptions unused;
  for (const auto& [key, value] : options) {
    const std::string name = key.cast<std::string>();
    if (!IsJobOption(name, OptionsOf::kIterator)) {
      throw py::type_error("PackedDataIterator() got an unexpected keyword argument '" + name +
                           "'");
    }
    SetJobOption(name, value, o, unused);
  }
  if (!source.is_none()) {
    o.data = source.cast<std::string>();
  } else if (o.global_batch <= 0) {
    throw py::value_error(
        "global_batch: a source fed by the caller needs a positive "
        "global_batch, got " +
        std::to_string(o.global_batch));
  }
  return ValueOrThrow(ResolveJob(o));
}

// (int32 tokens, uint8 mask or None, fields or None, position or None) tuples -> samples (ids
// set by FedShares::Share) and the positions given (FedShares::kNotGiven where none).
// ValueError-free: errors come back as a Status naming the loader, step and sample.
Result<std::vector<Sample>> ToSamples(const py::handle& list, int loader, int64_t step,
                                      const std::vector<FieldSpec>& fields,
                                      std::vector<int64_t>* positions) {
  std::vector<Sample> out;
  positions->clear();
  if (IsPyColumns(list)) {  // a SampleRows' columns: one conversion for every row
    const std::string where =
        "source of loader dp=" + std::to_string(loader) + ", step " + std::to_string(step);
    try {
      Result<std::vector<Sample>> rows =
          SamplesFromPyColumns(fields, list.cast<py::tuple>(), where);
      if (rows.ok()) positions->assign(rows->size(), FedShares::kNotGiven);
      return rows;
    } catch (const std::exception& e) {
      return Status::InvalidArgument(where + ": " + e.what());
    }
  }
  for (const py::handle& item : list) {
    auto pair = item.cast<py::tuple>();
    const std::string where = "source of loader dp=" + std::to_string(loader) + ", step " +
                              std::to_string(step) + ", sample " + std::to_string(out.size());
    Sample s;
    try {
      const py::object t = pair[0], m = pair[1];
      auto tokens = View1D<int32_t>(py::handle(t), where + " input_ids");
      s.tokens.assign(tokens.begin(), tokens.end());
      if (!m.is_none()) {
        auto mask = View1D<uint8_t>(py::handle(m), where + " loss_mask");
        s.target_mask.assign(mask.begin(), mask.end());
      }
    } catch (const std::exception& e) {
      return Status::InvalidArgument(e.what());
    }
    if (s.tokens.empty()) return Status::InvalidArgument(where + ": input_ids is empty");
    if (pair.size() > 4 && !pair[4].is_none()) {  // media (media_py.h)
      THDPACK_RETURN_IF_ERROR(MediaFromPy(pair[4], where, s));
    }
    const py::object given = pair.size() > 2 ? py::object(pair[2]) : py::object(py::none());
    THDPACK_RETURN_IF_ERROR(
        FieldsFromPy(fields, given, static_cast<int64_t>(s.tokens.size()), where, s));
    int64_t position = FedShares::kNotGiven;
    if (pair.size() > 3 && !pair[3].is_none()) {
      try {
        position = pair[3].cast<int64_t>();
      } catch (const std::exception&) {
        return Status::InvalidArgument(where + ": position " +
                                       py::repr(pair[3]).cast<std::string>() +
                                       " is not an integer");
      }
    }
    positions->push_back(position);
    out.push_back(std::move(s));
  }
  return out;
}

// One rank's step as a dict of NumPy arrays. Each microbatch carries its CP group: cp_size,
// cp_rank, first_rank, idle, cp_ranks (world positions of its members; the topology's CP group
// for a static step, [] when idle) and cp_group (the torch group of a dynamic microbatch with
// a group of more than one rank, else None: the iterator puts the caller's CP group there for a
// static step). cu_seqlens and cu_seqlens_padded are [n+1] (num_seqs = n); with max_seqs S > 0
// cu_seqlens_fixed and cu_seqlens_padded_fixed are the same offsets padded to S+1 (PadOffsets),
// else None; with pad_to_max_tokens max_seqlen_fixed is T, else None.
py::dict StepToPython(RankStep& step, const Topology& topo, bool sp,
                      const std::string& figures, int world_rank,
                      const std::vector<FieldSpec>& fields, int64_t global_batch,
                      const ScheduleOptions& schedule) {
  const int max_seqs = schedule.max_seqs_per_microbatch;
  py::dict d;
  d["n_loss_sequences"] = step.n_loss_sequences;
  // This rank's bytes sent per phase of the step (RankStep::phases), and the bytes of the
  // fields it holds (every microbatch's field buffers).
  py::dict sent;
  for (const PhaseStats& p : step.phases) {
    sent[py::str(std::string(PhaseName(p.phase)))] = p.bytes_sent;
  }
  d["bytes_sent"] = sent;
  py::dict seconds;  // this rank's wall time per phase of the step, the same phases
  for (const PhaseStats& p : step.phases) {
    seconds[py::str(std::string(PhaseName(p.phase)))] = p.seconds;
  }
  d["phase_seconds"] = seconds;
  int64_t field_bytes = 0;
  for (const LocalMicrobatch& mb : step.microbatches) {
    for (const auto& f : mb.fields) field_bytes += static_cast<int64_t>(f.size());
  }
  d["field_bytes"] = field_bytes;
  d["step"] = step.step;
  d["epoch"] = step.epoch;
  d["is_loader"] = step.is_loader;
  d["first_stage"] = step.first_stage;
  d["last_stage"] = step.last_stage;
  d["dynamic"] = step.dynamic;
  // The encoder's term that placed the step's items (None without media): what places them over
  // encoder ranks of their own (thdpack.torch.encoders).
  d["media_cost"] = step.media_cost
                        ? py::object(py::make_tuple(step.media_cost->per_patch,
                                                    step.media_cost->per_frame_sq))
                        : py::object(py::none());
  d["n_loss_tokens"] = step.meta.n_loss_tokens;
  d["num_microbatches"] = static_cast<int64_t>(step.microbatches.size());
  d["replica_real_tokens"] = step.meta.real_tokens;
  d["replica_padded_tokens"] = step.meta.padded_tokens;
  d["replica_sum_sq"] = step.meta.sum_sq;
  d["skipped_ids"] = step.meta.skipped_ids;
  d["figures"] = py::module_::import("json").attr("loads")(figures);
  // The dynamic step's groups, (first domain rank, size), for a caller that makes them itself
  // (a source that makes steps ahead: StepSource attaches them on the caller's thread).
  py::list needed;
  for (const auto& [first, c] : step.cp_groups) needed.append(py::make_tuple(first, c));
  d["cp_groups"] = needed;
  // The run's state once this step is done, as JSON text (the iterator parses it only when
  // asked for its state_dict).
  d["state"] = RunStateToJson(step.after);
  // What step.unpack needs of a caller-fed step: its first sample id (stream position) and, on a
  // reading rank, its own samples' lengths in the order it gave them (FedShares::SlotOf).
  if (global_batch > 0) {
    const FedShares fed = ValueOrThrow(FedShares::Create(global_batch, topo.dp_size()));
    const int64_t first = fed.FirstBefore(step.after.consumed);
    std::vector<std::pair<int64_t, int64_t>> mine;  // (index in the share, length)
    for (const SampleLength& x : step.samples) {
      const auto slot = fed.SlotOf(first, x.id);
      if (slot && slot->loader == step.coord.dp) mine.emplace_back(slot->index, x.length);
    }
    std::sort(mine.begin(), mine.end());
    std::vector<int64_t> own;
    for (const auto& [k, length] : mine) own.push_back(length);
    d["unpack"] = py::make_tuple(first, global_batch, ToNumpy(std::move(own)));
  } else {
    d["unpack"] = py::none();
  }
  std::vector<int> topology_cp = ValueOrThrow(topo.GroupOf(GroupKind::kCp, world_rank));
  py::list mbs;
  const Coord me = ValueOrThrow(topo.CoordOf(world_rank));
  for (LocalMicrobatch& mb : step.microbatches) {
    py::dict m;
    // Padding flags of this rank's shard, from the metadata alone (every stage), with the
    // microbatch's own CP group.
    // Written into the arrays themselves (both [T/CP], 0 for an idle microbatch).
    const py::ssize_t local = mb.local_tokens;
    py::array_t<bool> padding(local);
    ThrowIfError(ShardPaddingMaskInto(
        mb.cu_seqlens, mb.cu_seqlens_padded, mb.cp_size, mb.cp_rank,
        std::span<uint8_t>(reinterpret_cast<uint8_t*>(padding.mutable_data()),
                           static_cast<size_t>(local))));
    m["padding_mask"] = padding;
    // Where each local token comes from: its packed sequence (-1 on padding), and each
    // sequence's sample id and loss-token count.
    py::array_t<int32_t> seq_index(local);
    ThrowIfError(ShardSequenceIndexInto(
        mb.cu_seqlens, mb.cu_seqlens_padded, mb.cp_size, mb.cp_rank,
        std::span<int32_t>(seq_index.mutable_data(), static_cast<size_t>(local))));
    m["seq_index"] = seq_index;
    m["sample_ids"] = ToNumpy(std::vector<int64_t>(mb.sample_ids));
    m["seq_n_targets"] = ToNumpy(std::vector<int64_t>(mb.seq_n_targets));
    m["fields"] = FieldsToPy(fields, mb.fields);
    // Media (first stage, media declared) and mRoPE, or None (media_py.h).
    m["media"] = MediaToPy(mb.media);
    m["mrope_position_ids"] = MropeToPy(mb.media);
    // A blend: each sequence's source (its index in the blend's list); None for other data.
    m["sources"] = mb.sources.empty() ? py::object(py::none())
                                      : py::object(ToNumpy(std::vector<int32_t>(mb.sources)));
    m["cu_seqlens"] = ToNumpy(std::vector<int32_t>(mb.cu_seqlens));
    m["cu_seqlens_padded"] = ToNumpy(std::vector<int32_t>(mb.cu_seqlens_padded));
    m["num_seqs"] = static_cast<int64_t>(mb.cu_seqlens.size()) - 1;
    // Static shapes (max_seqs S): the offsets attention reads, S+1 long (PadOffsets).
    if (max_seqs > 0) {
      m["cu_seqlens_fixed"] = ToNumpy(ValueOrThrow(PadOffsets(mb.cu_seqlens, max_seqs)));
      m["cu_seqlens_padded_fixed"] =
          ToNumpy(ValueOrThrow(PadOffsets(mb.cu_seqlens_padded, max_seqs)));
    } else {
      m["cu_seqlens_fixed"] = py::none();
      m["cu_seqlens_padded_fixed"] = py::none();
    }
    // Static shapes (pad_to_max_tokens): T, the same for every microbatch, as the max_seqlen
    // attention is given (a bound it accepts, fixed for graph capture); else None.
    m["max_seqlen_fixed"] = schedule.pad_to_max_tokens ? py::object(py::int_(mb.total_tokens))
                                                       : py::object(py::none());
    m["max_seqlen"] = mb.max_seqlen;
    m["n_valid"] = mb.n_valid;
    m["total_tokens"] = mb.total_tokens;
    m["local_tokens"] = mb.local_tokens;
    m["sp_range"] = py::make_tuple(mb.sp_range.first, mb.sp_range.second);
    m["cp_size"] = mb.cp_size;
    m["cp_rank"] = mb.cp_rank;
    m["first_rank"] = mb.first_rank;
    m["idle"] = mb.idle;
    m["dynamic"] = step.dynamic;
    if (mb.idle) {
      m["cp_ranks"] = py::list();
    } else if (mb.cp_group) {
      const auto ranks = mb.cp_group->ranks();
      m["cp_ranks"] = py::cast(std::vector<int>(ranks.begin(), ranks.end()));
    } else if (step.dynamic) {
      m["cp_ranks"] =
          py::cast(ValueOrThrow(topo.DomainRanks(mb.first_rank, mb.cp_size, me.tp, me.pp)));
    } else {
      m["cp_ranks"] = py::cast(topology_cp);
    }
    m["cp_group"] = mb.cp_group && mb.cp_size > 1 ? TorchGroupOf(mb.cp_group.get()) : py::none();
    if (step.first_stage) {
      m["tokens"] = Widen<int64_t>(std::span<const TokenId>(mb.tokens));
      m["position_ids"] = Widen<int64_t>(std::span<const int32_t>(mb.position_ids));
    } else {
      m["tokens"] = py::none();
      m["position_ids"] = py::none();
    }
    if (step.last_stage) {
      m["labels"] = Widen<int64_t>(std::span<const TokenId>(mb.labels));
      m["loss_mask"] = Widen<float>(std::span<const uint8_t>(mb.loss_mask));
    } else {
      m["labels"] = py::none();
      m["loss_mask"] = py::none();
    }
    mbs.append(m);
  }
  d["microbatches"] = mbs;
  d["sp"] = sp;
  return d;
}


// A Python object that any thread may drop: its reference goes under the GIL, and is leaked
// once the interpreter is gone (a thread that outlived a timed-out close).
class PyRef {
 public:
  explicit PyRef(py::object o) : o_(std::move(o)) {}
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (!o_) return;
    if (!Py_IsInitialized()) {
      o_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    o_ = py::object();
  }
  const py::object& get() const { return o_; }

 private:
  py::object o_;
};

// Steps the caller has finished with, freed by the thread that makes steps, at its next step:
// freeing a step's tensors and dicts on the caller's thread cost the loop 0.2-1.8 ms a step
// (where it drops the previous step). Every access holds the GIL.
class DropList {
 public:
  DropList() = default;
  DropList(const DropList&) = delete;
  DropList& operator=(const DropList&) = delete;
  ~DropList() {
    if (items_.empty()) return;
    if (!Py_IsInitialized()) {
      for (py::object& o : items_) o.release();
      return;
    }
    py::gil_scoped_acquire gil;
    Drain();
  }
  void Add(py::object o) { items_.push_back(std::move(o)); }
  // Taken out first, freed after: freeing runs Python code that may come back here.
  void Drain() {
    std::vector<py::object> due;
    due.swap(items_);
  }

 private:
  std::vector<py::object> items_;
};

// The sources alive in this process, closed by the interpreter's exit (thdpack.torch's atexit
// hook) before it finalises: a data plane's thread still in a torch collective then would be
// ended by pthread_exit, which aborts the process. Every access holds the GIL.
class TorchStepSource;
std::set<TorchStepSource*>& LiveSources() {
  static auto* s = new std::set<TorchStepSource*>();  // never destroyed: used at exit
  return *s;
}

// A caller-fed loader's share of one step: take_share(count) on this rank's own Python
// iterable (count: FedShares::Count), None where it ended at the step boundary (kEndOfData; the
// step runner agrees the end over the world); FedShares::Share checks what it gave.
Result<StepShare> TakeShare(const PyRef& take_share, const FedShares& fed,
                            const std::vector<FieldSpec>& fields, int64_t step,
                            int64_t first_position, int loader) {
  std::vector<Sample> samples;
  std::vector<int64_t> positions;
  {
    py::gil_scoped_acquire gil;
    try {
      py::object got = take_share.get()(fed.Count(loader));
      if (got.is_none()) {
        return Status::EndOfData("the iterable of loader dp=" + std::to_string(loader) +
                                 " ended before step " + std::to_string(step));
      }
      auto list = ToSamples(got, loader, step, fields, &positions);
      if (!list.ok()) return list.status();
      samples = std::move(*list);
    } catch (py::error_already_set& e) {
      return Status::InvalidArgument("source of loader dp=" + std::to_string(loader) +
                                     ", step " + std::to_string(step) + ": " + PyErrorText(e));
    }
  }
  return fed.Share(step, first_position, loader, std::move(samples), positions);
}

// Where a step is made (the caller's thread at depth 0, the data plane's otherwise): its
// figures over the communicator it was made on, its arrays and dicts (StepToPython) and what
// the iterator's prepare(raw) makes of them (a PackedStep, or pinned arrays for a CUDA device),
// kept in RankStep::prepared; the arrays are then dropped from the RankStep.
Status PrepareStep(const std::shared_ptr<const Job>& job,
                   const std::shared_ptr<const std::vector<FieldSpec>>& fields,
                   const PyRef& prepare, DropList& dropped, ProcessGroup& comm, RankStep& step,
                   bool on_data_thread, bool fed) {
  THDPACK_ASSIGN_OR_RETURN(std::string figures, StepFiguresJsonOnEveryRank(comm, *job, step));
  py::gil_scoped_acquire gil;
  if (on_data_thread) KeepThreadState();
  dropped.Drain();
  try {
    py::dict raw = StepToPython(step, job->topology, job->options.sp, figures, comm.rank(),
                                *fields, fed ? job->options.global_batch : 0,
                                job->schedule);
    py::object made = prepare.get()(raw);
    step.prepared = std::make_shared<PyRef>(std::move(made));
  } catch (py::error_already_set& e) {
    return Status::Internal("preparing step " + std::to_string(step.step) + ": " +
                            PyErrorText(e));
  } catch (const std::exception& e) {
    return Status::Internal("preparing step " + std::to_string(step.step) + ": " + e.what());
  }
  for (LocalMicrobatch& mb : step.microbatches) {
    std::vector<TokenId>().swap(mb.tokens);
    std::vector<int32_t>().swap(mb.position_ids);
    std::vector<TokenId>().swap(mb.labels);
    std::vector<uint8_t>().swap(mb.loss_mask);
  }
  return Status::Ok();
}

// One microbatch's values for step.unpack: (dtype name, shape, uint8 bytes) as thdpack.torch
// gives a tensor's, into u (its bytes kept alive by `held`) and shape. A Status naming the
// microbatch for anything else, an unknown dtype or a 0-d array.
Status ValuesOf(const py::handle& value, size_t m, std::vector<py::object>& held,
                UnpackMicrobatch& u, std::vector<int64_t>& shape) {
  const std::string where = "unpack: values of microbatch " + std::to_string(m);
  if (!py::isinstance<py::tuple>(value) || py::len(value) != 3) {
    return Status::InvalidArgument(where + ": expected a tensor, got " +
                                   py::type::of(value).attr("__name__").cast<std::string>());
  }
  const auto t = value.cast<py::tuple>();
  try {
    Result<FieldDtype> dtype = ParseFieldDtype(t[0].cast<std::string>());
    if (!dtype.ok()) return dtype.status().WithContext(where);
    shape = t[1].cast<std::vector<int64_t>>();
    if (shape.empty()) {
      return Status::InvalidArgument(where + ": a 0-d tensor ([T/CP] or [T/CP, *row] needed)");
    }
    const py::object given = t[2];
    auto bytes = View1D<uint8_t>(py::handle(given), where);
    held.push_back(given);
    held.push_back(bytes.owner);
    u.values = std::as_bytes(std::span<const uint8_t>(bytes));
    u.dtype = *dtype;
  } catch (const std::exception& e) {
    return Status::InvalidArgument(where + ": " + e.what());
  }
  return Status::Ok();
}

class TorchStepSource {
 public:
  TorchStepSource(py::object world_group, std::vector<int> torch_ranks, py::list known,
                  py::dict options, py::object source, py::object take_share, py::object prepare,
                  py::object device, double monitored_barrier_seconds, int depth,
                  py::object steps, py::object fields, py::object kept_groups,
                  py::object media) {
    auto comm = CommOptions(world_group, torch_ranks, known, device);
    comm->monitored_barrier_seconds = monitored_barrier_seconds;
    comm->kept_groups = std::move(kept_groups);
    world_ = MakeTorchWorld(std::move(world_group), comm);
    // Every check this rank makes alone (the options, the fields, the world, the prefetch
    // depth) is agreed over the world before the step's first collective, so that a misspelt
    // option on one rank raises on every rank instead of leaving the others waiting: this
    // rank's own error as it was raised, the others' a RuntimeError naming it.
    StepRunnerOptions ro;
    StepSourceOptions so;
    Status local;
    std::exception_ptr mine;
    try {
      job_ = std::make_shared<const Job>(ResolveOptions(options, source));
      fields_ = std::make_shared<const std::vector<FieldSpec>>(FieldSpecsFromPy(fields));
      if (source.is_none() == take_share.is_none()) {
        throw py::value_error("source: give a source spec or a caller-fed source, not both");
      }
      if (static_cast<int>(comm->torch_ranks.size()) != job_->topology.world_size()) {
        throw py::value_error("world: has " + std::to_string(comm->torch_ranks.size()) +
                              " ranks, the groups' topology " + job_->topology.ToString() +
                              " needs " + std::to_string(job_->topology.world_size()));
      }
      ro = RunnerOptions(*job_);
      ro.fields = *fields_;
      if (!media.is_none()) SetMediaOptions(media, ro);
      if (!take_share.is_none()) {
        auto take = std::make_shared<PyRef>(std::move(take_share));
        const FedShares fed = ValueOrThrow(
            FedShares::Create(job_->options.global_batch, job_->topology.dp_size()));
        auto specs = fields_;
        ro.read_share = [take, fed, specs](int64_t step, int64_t first_position,
                                           int loader) -> Result<StepShare> {
          return TakeShare(*take, fed, *specs, step, first_position, loader);
        };
      }
      so.depth = depth;
      so.steps = steps.is_none() ? -1 : steps.cast<int64_t>();
      // Checked before the data plane's group is made (a collective): prefetch is the depth.
      ThrowIfError(so.Check().WithContext("prefetch"));
    } catch (const std::exception& e) {
      mine = std::current_exception();
      local = Status::InvalidArgument(e.what());
    }
    const Status agreed = AgreeOnStatus(*world_, local, "making PackedDataIterator");
    if (mine) std::rethrow_exception(mine);
    ThrowIfError(agreed);
    auto prep = std::make_shared<PyRef>(std::move(prepare));
    std::shared_ptr<const Job> job = job_;
    const bool ahead = depth > 0;  // on_step then runs on the source's own thread
    std::shared_ptr<DropList> dropped = dropped_;
    auto specs = fields_;
    const bool fed = source.is_none();  // a caller-fed step: step.unpack can serve it
    so.on_step = [prep, job, specs, dropped, ahead, fed](ProcessGroup& c,
                                                         RankStep& step) -> Status {
      return PrepareStep(job, specs, *prep, *dropped, c, step, ahead, fed);
    };
    if (depth > 0) {
      // The data plane's own world: a gloo group over the same ranks, made here on the
      // caller's thread (collectively) and destroyed with the source; the caller's groups and
      // every NCCL group stay on the caller's thread.
      auto data = std::make_shared<TorchCommOptions>();
      data->torch_ranks = torch_ranks;
      data->cuda_device = py::none();
      data->backend = "gloo";
      data->monitored_barrier_seconds = monitored_barrier_seconds;
      data->local_sync = comm->local_sync;
      py::object group =
          comm->local_sync
              ? py::module_::import("thdpack.torch.groups")
                    .attr("local_new_group")(torch_ranks, "gloo")
              : py::module_::import("torch.distributed")
                    .attr("new_group")(py::arg("ranks") = torch_ranks,
                                       py::arg("backend") = "gloo");
      data_group_ = group;
      so.data_world = MakeTorchWorld(std::move(group), data, /*owned=*/true);
    }
    std::optional<Result<std::unique_ptr<StepSource>>> made;
    {
      py::gil_scoped_release release;
      made.emplace(StepSource::Create(*world_, job_->topology, ro, std::move(so)));
    }
    source_ = ValueOrThrow(std::move(*made));
    LiveSources().insert(this);
  }

  ~TorchStepSource() {
    LiveSources().erase(this);
    // Nobody to report to: a close that timed out leaves the thread to end on its own.
    (void)CloseNow(kDropSeconds);
  }

  // (prepared, cp_groups, group_counts): what prepare made of the step; each microbatch's torch
  // CP group (None for one rank or idle: the caller's CP group serves a static step); the
  // dynamic step's group counts (None otherwise). StopIteration at the end.
  py::tuple Next() {
    if (!source_) throw std::runtime_error("PackedDataIterator: the iterator is closed");
    std::optional<Result<RankStep>> step;
    double waited = 0;
    if (source_->ready()) {
      // Taken with the GIL held: released here, the data plane's thread (woken by the take)
      // would take it first and the caller would wait for it to give it back.
      step.emplace(source_->Next(&waited));
    } else {
      py::gil_scoped_release release;
      step.emplace(source_->Next(&waited));
    }
    // No ReleaseDue here: freeing the tensors of earlier collectives cost the hand-over 0.1-1.2
    // ms; the thread that issues the next collective (mostly the data plane's) frees them.
    ThrowIfError(step->status());
    RankStep& s = **step;
    py::list groups;
    for (const LocalMicrobatch& mb : s.microbatches) {
      groups.append(mb.cp_group && mb.cp_size > 1 ? TorchGroupOf(mb.cp_group.get())
                                                  : py::object(py::none()));
    }
    py::object counts = py::none();
    if (s.dynamic) {
      py::dict c;
      c["groups_made"] = s.groups_made;
      c["groups_reused"] = s.groups_reused;
      c["groups_evicted"] = s.groups_evicted;
      c["groups_cached"] = s.groups_cached;
      counts = c;
    }
    auto* made = static_cast<const PyRef*>(s.prepared.get());
    if (made == nullptr) throw std::runtime_error("PackedDataIterator: a step was not prepared");
    return py::make_tuple(made->get(), groups, counts, waited);
  }

  std::string State() const {
    if (!source_) throw std::runtime_error("state_dict: the iterator is closed");
    return RunStateToJson(source_->state());
  }
  void Restore(const py::handle& state) {
    if (!source_) throw std::runtime_error("load_state_dict: the iterator is closed");
    ThrowIfError(source_->Restore(RunStateFromPy(state, "load_state_dict: state")));
  }
  bool Reads() const { return source_ && source_->reads(); }
  // (every effective option by name, the names defaulted): step.options (JobOptionsToPy).
  py::tuple Options() const { return JobOptionsToPy(*job_, OptionsOf::kIterator); }

  // step.unpack: collective over the world (UnpackStep, which agrees the values' dtype and row
  // shape). microbatches: the step's microbatch dicts (their CPU offsets, group and sample ids);
  // values: per microbatch this rank's (dtype name, shape, uint8 bytes) of [T/CP, *row], or
  // None; unpack: the step's (first id, samples, own lengths); fill: the number written at each
  // sample's token 0. Returns (dtype name, row shape, the own samples' rows one after another as
  // one uint8 array, int64 offsets [samples + 1] in rows; [0] on a rank that read none). A
  // rank's own error (a value that is no such tuple, an unknown dtype, a 0-d array, a count of
  // values that is not the microbatches') goes to UnpackStep's agreement, so that every rank
  // raises it.
  py::tuple Unpack(const py::list& microbatches, const py::list& values, const py::tuple& unpack,
                   const py::object& fill_obj, const std::string& label_format) {
    if (!world_) throw std::runtime_error("unpack: the iterator is closed");
    if (label_format != "megatron" && label_format != "hf") {
      throw py::value_error("unpack: label_format '" + label_format +
                            "' is not 'megatron' or 'hf'");
    }
    std::vector<py::object> held;
    std::vector<UnpackMicrobatch> mbs;
    std::vector<std::vector<int64_t>> shapes;
    shapes.reserve(microbatches.size());
    Status local;
    if (values.size() != microbatches.size()) {
      local = Status::InvalidArgument("unpack: " + std::to_string(values.size()) +
                                      " value tensors for " +
                                      std::to_string(microbatches.size()) + " microbatches");
    }
    auto hold = [&](py::object o) {
      held.push_back(o);
      return py::handle(held.back());
    };
    for (size_t m = 0; m < microbatches.size(); ++m) {
      const py::dict mb = microbatches[m].cast<py::dict>();
      const std::string where = "unpack: microbatch " + std::to_string(m);
      auto cu = IntView1D<int32_t>(hold(mb["cu_seqlens_cpu"]), where + " cu_seqlens");
      auto cup =
          IntView1D<int32_t>(hold(mb["cu_seqlens_padded_cpu"]), where + " cu_seqlens_padded");
      auto ids = IntView1D<int64_t>(hold(mb["sample_ids"]), where + " sample_ids");
      held.push_back(cu.owner);
      held.push_back(cup.owner);
      held.push_back(ids.owner);
      UnpackMicrobatch u{cu, cup, mb["cp_size"].cast<int>(), mb["cp_rank"].cast<int>(),
                         mb["idle"].cast<bool>(), ids, {}, FieldDtype::kFloat32, {}};
      shapes.emplace_back();
      if (local.ok() && m < values.size() && !values[m].is_none()) {
        local = ValuesOf(values[m], m, held, u, shapes.back());
      }
      u.shape = shapes.back();
      mbs.push_back(u);
    }
    double fill = 0;
    try {
      fill = fill_obj.cast<double>();
    } catch (const std::exception&) {
      if (local.ok()) {
        local = Status::InvalidArgument("unpack: fill " + py::repr(fill_obj).cast<std::string>() +
                                        " is not a number");
      }
    }
    auto own = IntView1D<int64_t>(py::handle(unpack[2]), "unpack: own lengths");
    UnpackArgs args{unpack[0].cast<int64_t>(), unpack[1].cast<int64_t>(), own, fill,
                    label_format == "hf", local};
    std::optional<Result<UnpackedValues>> got;
    {
      py::gil_scoped_release release;
      got.emplace(UnpackStep(*world_, job_->topology, RunnerOptions(*job_), mbs, args));
    }
    ThrowIfError(got->status());
    return py::make_tuple(std::string(FieldDtypeName((*got)->dtype)),
                          py::tuple(py::cast((*got)->row_shape)),
                          BytesToNumpy(std::move((*got)->values)),
                          ToNumpy(std::move((*got)->offsets)));
  }
  // A step the caller has finished with: freed by the thread that makes the next step.
  void DropLater(py::object step) { dropped_->Add(std::move(step)); }
  // The data plane's torch group (depth >= 1; None otherwise), for tests: destroyed with the
  // source.
  py::object DataGroup() const { return data_group_; }

  // Collective (see StepSource::Close); then the source, its groups and the data plane's world
  // are freed. timeout < 0: no bound.
  void Close(double timeout_seconds) {
    LiveSources().erase(this);
    Status s = CloseNow(timeout_seconds);
    ThrowIfError(s);
  }

  // Every source still alive, closed: the interpreter's exit (thdpack.torch's atexit hook).
  static void CloseAll(double timeout_seconds) {
    const std::vector<TorchStepSource*> live(LiveSources().begin(), LiveSources().end());
    LiveSources().clear();
    for (TorchStepSource* s : live) (void)s->CloseNow(timeout_seconds);
  }

 private:
  // How long a dropped iterator's source waits for its thread's last steps.
  static constexpr double kDropSeconds = 60.0;

  Status CloseNow(double timeout_seconds) {
    Status s;
    if (source_) {
      {
        py::gil_scoped_release release;
        s = source_->Close(timeout_seconds);
        source_.reset();  // a thread still running holds what it uses (StepSource::Close)
      }
    }
    world_.reset();
    return s;
  }

  std::shared_ptr<const Job> job_;
  std::shared_ptr<const std::vector<FieldSpec>> fields_;
  std::shared_ptr<DropList> dropped_ = std::make_shared<DropList>();
  py::object data_group_ = py::none();
  std::unique_ptr<ProcessGroup> world_;
  std::unique_ptr<StepSource> source_;  // declared last: freed before the world
};

// The reference for tests: the same options and inputs, the step on one thread per rank.
py::list RunStepsOnThreads(py::dict options, int64_t steps, py::object source, py::object shares,
                           py::object state, py::object fields_obj) {
  const Job job = ResolveOptions(options, source);
  const std::vector<FieldSpec> fields = FieldSpecsFromPy(fields_obj);
  std::optional<RunState> restore;
  if (!state.is_none()) restore = RunStateFromPy(state, "state");
  StepRunnerOptions ro = RunnerOptions(job);
  ro.fields = fields;
  // [DP]: loader d's samples of every step, in order, and the positions they say they have.
  std::vector<std::vector<Sample>> fed;
  std::vector<std::vector<int64_t>> said;
  if (!shares.is_none()) {
    int d = 0;
    for (const py::handle& list : shares) {
      said.emplace_back();
      fed.push_back(ValueOrThrow(ToSamples(list, d, -1, fields, &said.back())));
      ++d;
    }
    if (static_cast<int>(fed.size()) != job.topology.dp_size()) {
      throw py::value_error("shares: expected one list per loader (DP = " +
                            std::to_string(job.topology.dp_size()) + ")");
    }
    // shares[d] holds loader d's samples of every step from the first one run.
    const int64_t first_step = restore ? restore->next_step : job.first_step();
    const FedShares rule =
        ValueOrThrow(FedShares::Create(job.options.global_batch, job.topology.dp_size()));
    ro.read_share = [rule, &fed, &said, first_step](int64_t step, int64_t first_position,
                                                    int loader) -> Result<StepShare> {
      const int64_t count = rule.Count(loader);
      const auto& all = fed[static_cast<size_t>(loader)];
      const auto& positions = said[static_cast<size_t>(loader)];
      const int64_t begin = (step - first_step) * count;
      if (begin + count > static_cast<int64_t>(all.size())) {
        return Status::OutOfRange("shares: loader " + std::to_string(loader) + " has no step " +
                                  std::to_string(step));
      }
      return rule.Share(step, first_position, loader,
                        std::vector<Sample>(all.begin() + begin, all.begin() + begin + count),
                        std::span<const int64_t>(positions).subspan(
                            static_cast<size_t>(begin), static_cast<size_t>(count)));
    };
  }
  const int world = job.topology.world_size();
  std::vector<std::vector<RankStep>> got(static_cast<size_t>(world));
  std::vector<std::vector<std::string>> figures(static_cast<size_t>(world));
  std::vector<Status> statuses;
  {
    py::gil_scoped_release release;
    statuses = RunOnThreads(world, [&](ProcessGroup& w) -> Status {
      THDPACK_ASSIGN_OR_RETURN(auto runner, StepRunner::Create(w, job.topology, ro));
      if (restore) THDPACK_RETURN_IF_ERROR(runner->Restore(*restore));
      for (int64_t s = 0; s < steps; ++s) {
        THDPACK_ASSIGN_OR_RETURN(RankStep step, runner->Next());
        THDPACK_ASSIGN_OR_RETURN(std::string f, StepFiguresJsonOnEveryRank(w, job, step));
        got[static_cast<size_t>(w.rank())].push_back(std::move(step));
        figures[static_cast<size_t>(w.rank())].push_back(std::move(f));
      }
      return Status::Ok();
    });
  }
  for (int r = 0; r < world; ++r)
    ThrowIfError(statuses[static_cast<size_t>(r)].WithContext("rank " + std::to_string(r)));
  py::list out;
  for (int r = 0; r < world; ++r) {
    py::list per;
    for (size_t s = 0; s < got[static_cast<size_t>(r)].size(); ++s) {
      per.append(StepToPython(got[static_cast<size_t>(r)][s], job.topology,
                              job.options.sp, figures[static_cast<size_t>(r)][s], r, fields,
                              shares.is_none() ? 0 : job.options.global_batch,
                              job.schedule));
    }
    out.append(per);
  }
  return out;
}

// thdpack.torch's collective entry points (RLStatistics.summary, ...): this member's local
// check (`error`: its message, None when its checks passed) and what every member must give
// alike (`entries`: (name, value) text, e.g. the statistics' names; None: nothing, on every
// member), agreed over the torch
// group `group` before the entry point's own collective, so that one member's error is raised
// on every member, named, instead of leaving the others waiting in the collective.
// AgreeOnStatus, then AgreeOnEntries (thdpack/step_runner.h): one all-reduce of 8 bytes and one
// of 16 when all is well.

}  // namespace

void BindTorchIter(py::module_& m) {
  py::class_<TorchStepSource>(m, "_TorchStepSource")
      .def(py::init<py::object, std::vector<int>, py::list, py::dict, py::object, py::object,
                    py::object, py::object, double, int, py::object, py::object,
                    py::object, py::object>(),
           py::arg("world"), py::arg("torch_ranks"), py::arg("known"), py::arg("options"),
           py::arg("source"), py::arg("take_share"), py::arg("prepare"), py::arg("cuda_device"),
           py::arg("monitored_barrier_seconds"), py::arg("depth"), py::arg("steps"),
           py::arg("fields") = py::none(), py::arg("kept_groups") = py::none(),
           py::arg("media") = py::none())
      .def("next", &TorchStepSource::Next)
      .def("state", &TorchStepSource::State)
      .def("restore", &TorchStepSource::Restore, py::arg("state"))
      .def_property_readonly("reads", &TorchStepSource::Reads)
      .def_property_readonly("options", &TorchStepSource::Options)
      .def("unpack", &TorchStepSource::Unpack, py::arg("microbatches"), py::arg("values"),
           py::arg("unpack"), py::arg("fill"), py::arg("label_format"))
      .def("drop_later", &TorchStepSource::DropLater, py::arg("step"))
      .def_property_readonly("data_group", &TorchStepSource::DataGroup)
      .def("close", &TorchStepSource::Close, py::arg("timeout") = -1.0);
  m.def("_close_step_sources", &TorchStepSource::CloseAll, py::arg("timeout"),
        "The interpreter's exit: every _TorchStepSource still alive, closed (each waits up to "
        "`timeout` seconds for its thread).");
  m.def(
      "_release_later",
      [](py::object o) {
        ReleaseDue();
        std::vector<py::object> v;
        v.push_back(std::move(o));
        ReleaseLater(std::move(v));
      },
      py::arg("obj"),
      "Holds a tensor handed to a torch collective until its worker threads have let go of it "
      "(thdpack.torch's own collectives; bind_torch_comm.cc says why).");
  m.def(
      "_fed_positions",
      [](int64_t first_position, int64_t global_batch, int dp, int loader) {
        if (first_position < 0 || dp < 1 || loader < 0 || loader >= dp) {
          throw py::value_error("loader_positions: start " + std::to_string(first_position) +
                                " >= 0, dp_size " + std::to_string(dp) + " >= 1 and 0 <= loader " +
                                std::to_string(loader) + " < dp_size required");
        }
        Result<FedShares> fed = FedShares::Create(global_batch, dp);
        ThrowIfError(fed.status().WithContext("loader_positions"));
        return py::make_tuple(py::cast(fed->Positions(first_position, loader)),
                              fed->NextFirst(first_position));
      },
      py::arg("first_position"), py::arg("global_batch"), py::arg("dp"), py::arg("loader"),
      "loader_positions' rule (FedShares of thdpack/step.h): the stream positions loader `loader` "
      "yields in the caller-fed step of `global_batch` samples at first_position, and where the "
      "next step starts.");
  m.def("_run_steps_on_threads", &RunStepsOnThreads, py::arg("options"), py::arg("steps"),
        py::arg("source"), py::arg("shares"), py::arg("state") = py::none(),
        py::arg("fields") = py::none(),
        "Tests: the step of PackedDataIterator on one thread per rank; [rank][step] dicts.");
}

}  // namespace thdpack::python
