// python/src/bind_torch_iter.cc: the C++ core of thdpack.torch.PackedDataIterator - the one
// distributed step (StepRunner, thdpack/step_runner.h) over torch.distributed
// (torch_comm.h) - and, for tests, the same step over threads in one process.
//
//   thdpack._thdpack._TorchStepRunner(world, torch_ranks, known, options, source, take_share,
//                                     cuda_device, monitored_barrier_seconds)
//       .next() -> dict: one step as this rank holds it (NumPy arrays)
//   thdpack._thdpack._run_steps_on_threads(options, steps, source, shares)
//       -> [rank][step] dicts of the same form
//
// `options` are the job options of thdpack/job.h by their Python names (tp, cp, dp, pp, sp,
// global_batch, max_tokens_per_rank, scheduler, cost, ...). `source` is a source spec string, or
// None with a caller-fed source: take_share(step) (torch) or shares[dp] (threads) give each
// loader's own samples as (int32 tokens, uint8 mask or None) pairs; ids follow the file rule
// (the k-th sample of loader d in step s has id s * global_batch + k * DP + d).
#include <algorithm>
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
#include "torch_comm.h"

namespace thdpack::python {
namespace {

Job ResolveOptions(const py::dict& options, const py::object& source) {
  JobOptions o;
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

// (int32 tokens, uint8 mask or None) pairs -> samples (ids set by FedStepShare). ValueError-free:
// errors come back as a Status naming the loader, step and sample.
Result<std::vector<Sample>> ToSamples(const py::handle& list, int loader, int64_t step) {
  std::vector<Sample> out;
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
    out.push_back(std::move(s));
  }
  return out;
}

// The world ranks of a dynamic group (domain indices first .. first + c - 1) at this rank's
// (tp, pp): what its ProcessGroup holds, in order.
std::vector<int> DynamicGroupRanks(const Topology& topo, int world_rank, int first, int c) {
  const Coord me = ValueOrThrow(topo.CoordOf(world_rank));
  std::vector<int> out;
  for (int d = first; d < first + c; ++d) {
    out.push_back(ValueOrThrow(
        topo.RankOf(Coord{me.tp, d % topo.cp_size(), d / topo.cp_size(), me.pp})));
  }
  return out;
}

// One rank's step as a dict of NumPy arrays. Each microbatch carries its CP group: cp_size,
// cp_rank, first_rank, idle, cp_ranks (world positions of its members; the topology's CP group
// for a static step, [] when idle) and cp_group (the torch group of a dynamic microbatch with
// a group of more than one rank, else None: the iterator puts the caller's CP group there for a
// static step).
py::dict StepToPython(RankStep step, const Topology& topo, bool sp, const std::string& figures,
                      int world_rank) {
  py::dict d;
  d["step"] = step.step;
  d["epoch"] = step.epoch;
  d["is_loader"] = step.is_loader;
  d["first_stage"] = step.first_stage;
  d["last_stage"] = step.last_stage;
  d["dynamic"] = step.dynamic;
  d["n_loss_tokens"] = step.meta.n_loss_tokens;
  d["num_microbatches"] = static_cast<int64_t>(step.microbatches.size());
  d["replica_real_tokens"] = step.meta.real_tokens;
  d["replica_padded_tokens"] = step.meta.padded_tokens;
  d["replica_sum_sq"] = step.meta.sum_sq;
  d["skipped_ids"] = step.meta.skipped_ids;
  d["figures"] = py::module_::import("json").attr("loads")(figures);
  // The dynamic step's groups, (first domain rank, size), for a caller that makes them itself
  // (a runner with defer_cp_groups: _TorchCpGroups.attach).
  py::list needed;
  for (const auto& [first, c] : step.cp_groups) needed.append(py::make_tuple(first, c));
  d["cp_groups"] = needed;
  // The run's state once this step is done, as JSON text (the iterator parses it only when
  // asked for its state_dict).
  d["state"] = RunStateToJson(step.after);
  std::vector<int> topology_cp = ValueOrThrow(topo.GroupOf(GroupKind::kCp, world_rank));
  py::list mbs;
  for (LocalMicrobatch& mb : step.microbatches) {
    py::dict m;
    // Padding flags of this rank's shard, from the metadata alone (every stage), with the
    // microbatch's own CP group.
    std::vector<uint8_t> pad = ValueOrThrow(
        ShardPaddingMask(mb.cu_seqlens, mb.cu_seqlens_padded, mb.cp_size, mb.cp_rank));
    py::array_t<bool> padding(static_cast<py::ssize_t>(pad.size()));
    std::copy(pad.begin(), pad.end(), padding.mutable_data());
    m["padding_mask"] = padding;
    // A blend: each sequence's source (its index in the blend's list); None for other data.
    m["sources"] = mb.sources.empty() ? py::object(py::none())
                                      : py::object(ToNumpy(std::vector<int32_t>(mb.sources)));
    m["cu_seqlens"] = ToNumpy(std::vector<int32_t>(mb.cu_seqlens));
    m["cu_seqlens_padded"] = ToNumpy(std::vector<int32_t>(mb.cu_seqlens_padded));
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
      m["cp_ranks"] = py::cast(DynamicGroupRanks(topo, world_rank, mb.first_rank, mb.cp_size));
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

// How a torch world communicates (torch_comm.h): its ranks, the caller's known groups, the CUDA
// device of its NCCL groups and the world's own backend.
std::shared_ptr<TorchCommOptions> CommOptions(const py::object& world_group,
                                              std::vector<int> torch_ranks, const py::list& known,
                                              py::object device) {
  auto comm = std::make_shared<TorchCommOptions>();
  comm->torch_ranks = std::move(torch_ranks);
  for (const py::handle& k : known) {
    auto t = k.cast<py::tuple>();
    comm->known.push_back(
        KnownGroup{t[0].cast<std::string>(), t[1].cast<std::vector<int>>(), t[2]});
  }
  comm->cuda_device = std::move(device);
  comm->backend = py::str(py::module_::import("torch.distributed").attr("get_backend")(world_group))
                      .cast<std::string>();
  return comm;
}

class TorchStepRunner {
 public:
  TorchStepRunner(py::object world_group, std::vector<int> torch_ranks, py::list known,
                  py::dict options, py::object source, py::object take_share, py::object device,
                  double monitored_barrier_seconds, bool defer_cp_groups)
      : job_(ResolveOptions(options, source)), take_share_(std::move(take_share)) {
    if (source.is_none() == take_share_.is_none()) {
      throw py::value_error("source: give a source spec or a caller-fed source, not both");
    }
    auto comm = CommOptions(world_group, std::move(torch_ranks), known, std::move(device));
    comm->monitored_barrier_seconds = monitored_barrier_seconds;
    if (static_cast<int>(comm->torch_ranks.size()) != job_.topology.world_size()) {
      throw py::value_error("world: has " + std::to_string(comm->torch_ranks.size()) +
                            " ranks, the groups' topology " + job_.topology.ToString() + " needs " +
                            std::to_string(job_.topology.world_size()));
    }
    world_ = MakeTorchWorld(std::move(world_group), comm);
    StepRunnerOptions ro = RunnerOptions(job_);
    ro.defer_cp_groups = defer_cp_groups;
    if (!take_share_.is_none()) {
      ro.read_share = [this](int64_t step, int64_t first_position,
                             int loader) -> Result<StepShare> {
        std::vector<Sample> samples;
        {
          py::gil_scoped_acquire gil;
          try {
            auto got = ToSamples(take_share_(step), loader, step);
            if (!got.ok()) return got.status();
            samples = std::move(*got);
          } catch (py::error_already_set& e) {
            return Status::InvalidArgument("source of loader dp=" + std::to_string(loader) +
                                           ", step " + std::to_string(step) + ": " + e.what());
          }
        }
        return FedStepShare(job_.options.global_batch, job_.topology.dp_size(), step,
                            first_position, loader, std::move(samples));
      };
    }
    std::optional<Result<std::unique_ptr<StepRunner>>> runner;
    {
      py::gil_scoped_release release;
      runner.emplace(StepRunner::Create(*world_, job_.topology, ro));
    }
    runner_ = ValueOrThrow(std::move(*runner));
  }

  ~TorchStepRunner() {
    runner_.reset();
    world_.reset();
  }

  py::dict Next() {
    std::optional<Result<RankStep>> step;
    std::optional<Result<std::string>> figures;
    {
      py::gil_scoped_release release;
      step.emplace(runner_->Next());
      if (step->ok()) figures.emplace(StepFiguresJsonOnEveryRank(*world_, job_, **step));
    }
    ThrowIfError(step->status());
    ThrowIfError(figures->status());
    return StepToPython(std::move(**step), job_.topology, job_.options.sp, **figures,
                        world_->rank());
  }

  // The run's state after the last step (or where it starts): the record's JSON text.
  std::string State() const { return RunStateToJson(runner_->state()); }
  // Before the first step, on every rank alike (StepRunner::Restore).
  void Restore(const py::handle& state) {
    ThrowIfError(runner_->Restore(RunStateFromPy(state, "load_state_dict: state")));
  }
  // The samples consumed before the next step: its first sample's stream position.
  int64_t Consumed() const { return runner_->state().consumed; }

  py::dict Topology() const {
    py::dict d;
    d["tp"] = job_.topology.tp_size();
    d["cp"] = job_.topology.cp_size();
    d["dp"] = job_.topology.dp_size();
    d["pp"] = job_.topology.pp_size();
    d["global_batch"] = job_.options.global_batch;
    d["data_on"] = std::string(DataOnName(job_.data_on));
    d["scheduler"] = job_.options.scheduler;
    // Whether this rank reads (takes its replica's share from the caller's source): the step
    // runner's rule (thdpack/step_runner.h).
    const Coord c = ValueOrThrow(job_.topology.CoordOf(world_->rank()));
    const bool all = job_.data_on == DataOn::kAll;
    const bool dynamic = job_.schedule.scheduler == ScheduleOptions::Scheduler::kDynamic;
    d["reader"] = dynamic ? (c.cp == 0 && (all || (c.tp == 0 && c.pp == 0)))
                          : (all || (c.tp == 0 && c.cp == 0 && c.pp == 0));
    return d;
  }

 private:
  Job job_;
  py::object take_share_;
  std::unique_ptr<ProcessGroup> world_;
  std::unique_ptr<StepRunner> runner_;
};

// The CP groups of dynamic steps prepared by a runner with defer_cp_groups, made on the
// caller's thread from the caller's world (thdpack.torch's prefetching iterator): one
// CpGroupCache, as the step runner would keep.
class TorchCpGroups {
 public:
  TorchCpGroups(py::object world_group, std::vector<int> torch_ranks, py::list known,
                py::dict options, py::object device)
      : job_(ResolveOptions(options, py::str("mock"))),
        cache_(job_.topology, job_.options.max_cp_groups) {
    auto comm = CommOptions(world_group, std::move(torch_ranks), known, std::move(device));
    world_ = MakeTorchWorld(std::move(world_group), comm);
  }

  // Collective over the world: the groups of `raw` (a dynamic step's dict) made or taken from
  // the cache; each microbatch's "cp_group" set (None for one rank or idle), and the step's
  // figures given the counts (groups_made, groups_reused, groups_evicted, groups_cached).
  void Attach(py::dict raw) {
    RankStep rs;
    rs.step = raw["step"].cast<int64_t>();
    rs.dynamic = true;
    for (const py::handle& g : raw["cp_groups"].cast<py::list>()) {
      auto t = g.cast<py::tuple>();
      rs.cp_groups.emplace_back(t[0].cast<int>(), t[1].cast<int>());
    }
    const Coord me = ValueOrThrow(job_.topology.CoordOf(world_->rank()));
    rs.meta.domain_rank = me.dp * job_.topology.cp_size() + me.cp;
    py::list mbs = raw["microbatches"].cast<py::list>();
    for (const py::handle& h : mbs) {
      py::dict m = h.cast<py::dict>();
      const bool idle = m["idle"].cast<bool>();
      rs.meta.groups.push_back(idle ? MicrobatchGroup{0, 0}
                                    : MicrobatchGroup{m["first_rank"].cast<int32_t>(),
                                                      m["cp_size"].cast<int32_t>()});
    }
    rs.microbatches.resize(rs.meta.groups.size());
    // Agreed only when groups are split: a step whose groups are all held costs the caller's
    // thread no collective.
    Status status;
    {
      py::gil_scoped_release release;
      status = cache_.AttachAgreed(*world_, rs);
    }
    ThrowIfError(status);
    for (size_t k = 0; k < rs.microbatches.size(); ++k) {
      py::dict m = mbs[k].cast<py::dict>();
      const auto& g = rs.microbatches[k].cp_group;
      m["cp_group"] = g && rs.meta.groups[k].num_ranks > 1 ? TorchGroupOf(g.get()) : py::none();
    }
    py::dict figures = raw["figures"].cast<py::dict>();
    figures["groups_made"] = rs.groups_made;
    figures["groups_reused"] = rs.groups_reused;
    figures["groups_evicted"] = rs.groups_evicted;
    figures["groups_cached"] = rs.groups_cached;
  }

 private:
  Job job_;
  std::unique_ptr<ProcessGroup> world_;
  CpGroupCache cache_;
};

// The reference for tests: the same options and inputs, the step on one thread per rank.
py::list RunStepsOnThreads(py::dict options, int64_t steps, py::object source, py::object shares,
                           py::object state) {
  const Job job = ResolveOptions(options, source);
  std::optional<RunState> restore;
  if (!state.is_none()) restore = RunStateFromPy(state, "state");
  StepRunnerOptions ro = RunnerOptions(job);
  std::vector<std::vector<Sample>> fed;  // [DP]: loader d's samples of every step, in order
  if (!shares.is_none()) {
    int d = 0;
    for (const py::handle& list : shares) {
      fed.push_back(ValueOrThrow(ToSamples(list, d, -1)));
      ++d;
    }
    if (static_cast<int>(fed.size()) != job.topology.dp_size()) {
      throw py::value_error("shares: expected one list per loader (DP = " +
                            std::to_string(job.topology.dp_size()) + ")");
    }
    // shares[d] holds loader d's samples of every step from the first one run.
    const int64_t first_step = restore ? restore->next_step : job.first_step();
    ro.read_share = [&job, &fed, first_step](int64_t step, int64_t first_position,
                                             int loader) -> Result<StepShare> {
      const int64_t count = LoaderCount(job.options.global_batch, job.topology.dp_size(), loader);
      const auto& all = fed[static_cast<size_t>(loader)];
      const size_t begin = static_cast<size_t>((step - first_step) * count);
      if (begin + static_cast<size_t>(count) > all.size()) {
        return Status::OutOfRange("shares: loader " + std::to_string(loader) + " has no step " +
                                  std::to_string(step));
      }
      return FedStepShare(job.options.global_batch, job.topology.dp_size(), step, first_position,
                          loader,
                          std::vector<Sample>(all.begin() + static_cast<int64_t>(begin),
                                              all.begin() + static_cast<int64_t>(begin) + count));
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
      per.append(StepToPython(std::move(got[static_cast<size_t>(r)][s]), job.topology,
                              job.options.sp, figures[static_cast<size_t>(r)][s], r));
    }
    out.append(per);
  }
  return out;
}

}  // namespace

void BindTorchIter(py::module_& m) {
  py::class_<TorchStepRunner>(m, "_TorchStepRunner")
      .def(py::init<py::object, std::vector<int>, py::list, py::dict, py::object, py::object,
                    py::object, double, bool>(),
           py::arg("world"), py::arg("torch_ranks"), py::arg("known"), py::arg("options"),
           py::arg("source"), py::arg("take_share"), py::arg("cuda_device"),
           py::arg("monitored_barrier_seconds"), py::arg("defer_cp_groups") = false)
      .def("next", &TorchStepRunner::Next)
      .def("state", &TorchStepRunner::State)
      .def("restore", &TorchStepRunner::Restore, py::arg("state"))
      .def("consumed", &TorchStepRunner::Consumed)
      .def("topology", &TorchStepRunner::Topology);
  py::class_<TorchCpGroups>(m, "_TorchCpGroups")
      .def(py::init<py::object, std::vector<int>, py::list, py::dict, py::object>(),
           py::arg("world"), py::arg("torch_ranks"), py::arg("known"), py::arg("options"),
           py::arg("cuda_device"))
      .def("attach", &TorchCpGroups::Attach, py::arg("raw"));
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
  m.def("_run_steps_on_threads", &RunStepsOnThreads, py::arg("options"), py::arg("steps"),
        py::arg("source"), py::arg("shares"), py::arg("state") = py::none(),
        "Tests: the step of PackedDataIterator on one thread per rank; [rank][step] dicts.");
}

}  // namespace thdpack::python
