// python/src/bind_schedule.cc: thdpack.schedule (schedule.h) and the plan with its figures
// (docs/design.md section 10).
#include <cmath>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "thdpack/cost.h"
#include "thdpack/job.h"
#include "thdpack/profile.h"
#include "thdpack/schedule.h"

namespace thdpack::python {
namespace {

// An integer array argument: int32 viewed in place (when readable), any other integer dtype
// (or a tensor or list, common.h: AsArray) as int64 through IntView1D (in place when it is
// readable int64).
class IntArrayView {
 public:
  IntArrayView(const py::handle& obj, const std::string& name) {
    py::array a = AsArray(obj, name);
    if (HoldsType<int32_t>(a)) {
      narrow_.emplace(View1D<int32_t>(a, name));
      size_ = narrow_->size();
    } else {
      wide_.emplace(IntView1D<int64_t>(a, name));
      size_ = wide_->size();
    }
  }
  size_t size() const { return size_; }
  int64_t operator[](size_t i) const { return wide_ ? (*wide_)[i] : (*narrow_)[i]; }
  // Calls fn(span) with the elements as they are stored (int64 or int32): one loop per dtype,
  // not a dtype test per element.
  template <typename Fn>
  void Visit(Fn&& fn) const {
    if (wide_) {
      fn(std::span<const int64_t>(*wide_));
    } else {
      fn(std::span<const int32_t>(*narrow_));
    }
  }

 private:
  std::optional<HeldSpan<int64_t>> wide_;  // each keeps its buffer alive
  std::optional<HeldSpan<int32_t>> narrow_;
  size_t size_ = 0;
};

// The step totals every plan's figures dictionary starts with (static and dynamic plans).
void PutTotals(py::dict& d, const PlanFigures& f) {
  d["num_microbatches"] = f.num_microbatches;
  d["n_samples"] = f.n_samples;
  d["n_skipped"] = f.n_skipped;
  d["real_tokens"] = f.real_tokens;
  d["padded_tokens"] = f.padded_tokens;
  d["sum_sq"] = f.sum_sq;
  d["n_loss_tokens"] = f.n_loss_tokens;
  d["total_cost"] = f.total_cost;
  d["encoder_cost"] = f.encoder_cost;
  d["max_replica_cost"] = f.max_replica_cost;
  d["lower_bound"] = f.lower_bound;
  d["imbalance"] = f.imbalance;
  d["pad_fraction"] = f.pad_fraction;
  d["fill"] = f.fill;
}

py::dict FiguresToDict(const PlanFigures& f, const Plan& plan, std::optional<double> flops) {
  py::dict d;
  PutTotals(d, f);
  d["max_microbatch_spread"] = f.max_microbatch_spread;
  d["flops"] = flops ? py::cast(*flops) : py::none();
  py::list replicas;
  for (size_t r = 0; r < f.replicas.size(); ++r) {
    py::dict rd;
    rd["cost"] = f.replicas[r].cost;
    rd["encoder_cost"] = f.replicas[r].encoder_cost;
    py::list mbs;
    for (size_t m = 0; m < f.replicas[r].microbatches.size(); ++m) {
      const MicrobatchFigures& mf = f.replicas[r].microbatches[m];
      py::dict md;
      auto ids = plan.Microbatch(static_cast<int>(r), static_cast<int>(m));
      md["samples"] = ToNumpy(std::vector<int64_t>(ids.begin(), ids.end()));
      md["n_samples"] = mf.n_samples;
      md["real_tokens"] = mf.real_tokens;
      md["padded_tokens"] = mf.padded_tokens;
      md["sum_sq"] = mf.sum_sq;
      md["n_loss_tokens"] = mf.n_loss_tokens;
      md["cost"] = mf.cost;
      md["encoder_cost"] = mf.encoder_cost;
      mbs.append(md);
    }
    rd["microbatches"] = mbs;
    replicas.append(rd);
  }
  d["replicas"] = replicas;
  return d;
}

// What thdpack.schedule returns: the Plan and its figures. The figures' dictionary (one dict
// and one id array per microbatch) is built when `figures` is first read, then kept: a caller
// that only needs the assignment does not pay for it.
struct PyPlan {
  Plan plan;
  PlanFigures figures;
  std::optional<double> flops;
  std::optional<double> sim_step_time;  // with a model cost (ScheduledPlan::sim_step_time)
  std::optional<py::dict> figures_dict;

  const py::dict& Figures() {
    if (!figures_dict) figures_dict = FiguresToDict(figures, plan, flops);
    return *figures_dict;
  }
};

// What thdpack.schedule returns for scheduler="dynamic": the groups of every microbatch.
struct PyDynamicPlan {
  DynamicPlan plan;
  PlanFigures figures;
  std::optional<double> flops;

  py::list Groups() const {
    py::list out;
    for (const auto& groups : plan.microbatches) {
      py::list mb;
      for (const CpGroup& g : groups) {
        py::dict gd;
        std::vector<int64_t> ranks;
        for (int r = g.first_rank; r < g.first_rank + g.num_ranks; ++r) ranks.push_back(r);
        gd["ranks"] = ToNumpy(std::move(ranks));
        gd["samples"] = ToNumpy(std::vector<int64_t>(g.sample_ids));
        mb.append(gd);
      }
      out.append(mb);
    }
    return out;
  }
};

py::dict DynamicFiguresToDict(const PlanFigures& f, std::optional<double> flops) {
  py::dict d;
  PutTotals(d, f);
  d["flops"] = flops ? py::cast(*flops) : py::none();
  py::list ranks;
  for (const ReplicaFigures& r : f.replicas) ranks.append(r.cost);
  d["rank_costs"] = ranks;
  return d;
}

}  // namespace

void BindSchedule(py::module_& m) {
  py::class_<PyDynamicPlan>(m, "DynamicPlan",
                            "The dynamic scheduler's plan: CP groups of contiguous ranks of the "
                            "DP x CP domain per microbatch, each with its sequences.")
      .def_property_readonly("num_microbatches", [](const PyDynamicPlan& p) { return p.plan.num_microbatches; })
      .def_property_readonly("domain_size", [](const PyDynamicPlan& p) { return p.plan.domain_size; })
      .def_property_readonly("scheduler", [](const PyDynamicPlan&) { return std::string("dynamic"); })
      .def_property_readonly("groups", &PyDynamicPlan::Groups,
                             "[M] lists of {'ranks': int64 domain indices (dp*CP + cp), "
                             "'samples': int64 ids in arrival order}.")
      .def_property_readonly("skipped", [](const PyDynamicPlan& p) {
        return ToNumpy(std::vector<int64_t>(p.plan.skipped));
      }, "Oversize ids left out (oversize='skip'), in input order (int64).")
      .def_property_readonly("sim_step_time", [](const PyDynamicPlan& p) { return p.plan.step_time; },
                             "The modelled step time in seconds (cost.h's step-time model).")
      .def_property_readonly("method", [](const PyDynamicPlan& p) { return p.plan.method; },
                             "'groups' (list scheduling) or 'static CP=c' (the fastest candidate).")
      .def_property_readonly("figures", [](const PyDynamicPlan& p) {
        return DynamicFiguresToDict(p.figures, p.flops);
      }, "Totals (each sequence once) and rank_costs: per-rank cost of every domain rank.")
      .def("__repr__", [](const PyDynamicPlan& p) {
        return "<thdpack.DynamicPlan domain_size=" + std::to_string(p.plan.domain_size) +
               " num_microbatches=" + std::to_string(p.plan.num_microbatches) + " method='" +
               p.plan.method + "' skipped=" + std::to_string(p.plan.skipped.size()) + ">";
      });

  py::class_<PyPlan>(m, "Plan",
                     "Assignment of sample ids to (replica, microbatch), and its figures.")
      .def_property_readonly("num_microbatches", [](const PyPlan& p) { return p.plan.num_microbatches; })
      .def_property_readonly("dp_size", [](const PyPlan& p) { return p.plan.dp_size; })
      .def_property_readonly("scheduler", [](const PyPlan& p) { return std::string(SchedulerName(p.plan.scheduler)); })
      .def_property_readonly("sample_ids", [](const PyPlan& p) {
        return ToNumpy(std::vector<int64_t>(p.plan.sample_ids));
      }, "Every scheduled id once, replica-major then microbatch (int64).")
      .def_property_readonly("offsets", [](const PyPlan& p) {
        return ToNumpy(std::vector<int64_t>(p.plan.offsets));
      }, "[DP*M + 1]: microbatch (d, m) is sample_ids[offsets[d*M+m]:offsets[d*M+m+1]].")
      .def_property_readonly("skipped", [](const PyPlan& p) {
        return ToNumpy(std::vector<int64_t>(p.plan.skipped));
      }, "Oversize ids left out (oversize='skip'), in input order (int64).")
      .def_property_readonly("figures", [](PyPlan& p) { return p.Figures(); },
                             "The figures of docs/design.md section 10 (costs per rank).")
      .def_property_readonly("sim_step_time", [](const PyPlan& p) { return p.sim_step_time; },
                             "The modelled step time in seconds, None without model dimensions.")
      .def("microbatch", [](const PyPlan& p, int replica, int microbatch) {
        if (replica < 0 || replica >= p.plan.dp_size) {
          throw py::value_error("microbatch: replica " + std::to_string(replica) +
                                " outside [0, " + std::to_string(p.plan.dp_size) + ")");
        }
        if (microbatch < 0 || microbatch >= p.plan.num_microbatches) {
          throw py::value_error("microbatch: microbatch " + std::to_string(microbatch) +
                                " outside [0, " + std::to_string(p.plan.num_microbatches) + ")");
        }
        auto ids = p.plan.Microbatch(replica, microbatch);
        return ToNumpy(std::vector<int64_t>(ids.begin(), ids.end()));
      }, py::arg("replica"), py::arg("microbatch"),
         "The ordered sample ids of microbatch `microbatch` on replica `replica` (int64).")
      .def("__repr__", [](const PyPlan& p) {
        return "<thdpack.Plan dp_size=" + std::to_string(p.plan.dp_size) +
               " num_microbatches=" + std::to_string(p.plan.num_microbatches) + " samples=" +
               std::to_string(p.plan.sample_ids.size()) + " skipped=" +
               std::to_string(p.plan.skipped.size()) + ">";
      });

  static const JobOptions kJob;  // the defaults of every option (thdpack/job.h)
  m.def(
      "schedule",
      [](const py::handle& lengths_obj, const py::handle& n_targets_obj, const py::handle& ids_obj,
         int dp_size, py::object layout, py::object cp_size, py::object tp_size,
         py::object sp, py::object extra_alignment, py::object rank_multiple,
         int64_t max_tokens_per_rank, const std::string& scheduler, const std::string& cost,
         int microbatch_multiple, int num_microbatches, const std::string& oversize,
         const std::string& hw, const std::string& cp_sizes, const py::handle& groups_obj,
         const std::string& keep_groups, int max_seqs, bool pad_to_max_tokens,
         const py::handle& encoder_work_obj, const py::handle& encoder_cost_obj) -> py::object {
        const IntArrayView lengths(lengths_obj, "lengths");
        // Encoder work: [n, 2] integers (sum of t*h*w, sum of t*(h*w)^2 of each sample's items).
        std::vector<EncoderWork> encoder;
        if (!encoder_work_obj.is_none()) {
          py::array a = AsArray(encoder_work_obj, "encoder_work", false, true);
          const char kind = a.dtype().kind();
          if ((kind != 'i' && kind != 'u') || a.ndim() != 2 || a.shape(1) != 2 ||
              static_cast<size_t>(a.shape(0)) != lengths.size()) {
            throw py::value_error(
                "encoder_work: expected an integer array [n, 2] (per sample: sum of t*h*w, sum "
                "of t*(h*w)^2 of its media items) with n = " + std::to_string(lengths.size()) +
                " (the lengths'); got dtype " + py::str(a.dtype()).cast<std::string>() +
                ", " + std::to_string(a.ndim()) + " dims");
          }
          const auto w = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
          const int64_t* p = w.data();
          encoder.resize(lengths.size());
          for (size_t i = 0; i < encoder.size(); ++i) encoder[i] = {p[2 * i], p[2 * i + 1]};
        }
        std::optional<IntArrayView> n_targets;
        if (!n_targets_obj.is_none()) {
          n_targets.emplace(n_targets_obj, "n_targets");
          if (n_targets->size() != lengths.size()) {
            throw py::value_error("n_targets: has " + std::to_string(n_targets->size()) +
                                  " entries, lengths has " + std::to_string(lengths.size()) +
                                  ": one per sample expected");
          }
        }
        std::optional<IntArrayView> ids;
        if (!ids_obj.is_none()) {
          ids.emplace(ids_obj, "ids");
          if (ids->size() != lengths.size()) {
            throw py::value_error("ids: has " + std::to_string(ids->size()) +
                                  " entries, lengths has " + std::to_string(lengths.size()) +
                                  ": one per sample expected");
          }
        }
        std::vector<int64_t> groups;
        if (!groups_obj.is_none()) {
          const IntArrayView view(groups_obj, "groups");
          if (view.size() != lengths.size()) {
            throw py::value_error("groups: has " + std::to_string(view.size()) +
                                  " entries, lengths has " + std::to_string(lengths.size()) +
                                  ": one group id per sample expected");
          }
          groups.resize(view.size());
          for (size_t i = 0; i < groups.size(); ++i) groups[i] = view[i];
        }
        ScheduleOptions o;
        o.keep_groups = ValueOrThrow(ParseKeepGroups(keep_groups));
        o.max_seqs_per_microbatch = max_seqs;
        o.pad_to_max_tokens = pad_to_max_tokens;
        o.dp_size = dp_size;
        o.parallel = LayoutOf(LayoutArgs{std::move(layout), std::move(cp_size),
                                         std::move(tp_size), std::move(sp),
                                         std::move(extra_alignment), std::move(rank_multiple)},
                              "schedule");
        o.max_tokens_per_rank = max_tokens_per_rank;
        o.scheduler = ValueOrThrow(ParseSchedulerName(scheduler));
        o.microbatch_multiple = microbatch_multiple;
        o.num_microbatches = num_microbatches;
        o.oversize = ValueOrThrow(ParseOversizePolicy(oversize));
        o.cp_sizes = ValueOrThrow(ParseCpSizes(cp_sizes));
        if (!encoder_cost_obj.is_none()) {
          const auto c = encoder_cost_obj.cast<std::pair<double, double>>();
          o.encoder_cost = EncoderCost{c.first, c.second};
        } else if (!encoder.empty()) {
          throw py::value_error("encoder_work without encoder_cost: give the encoder's terms "
                                "(per patch, per frame^2) in the cost's unit");
        }
        // The one resolution of cost and hardware (profile.h), as plan and run do.
        ResolvedCost resolved = ValueOrThrow(ResolveCost(cost, hw));
        o.cost = std::move(resolved.cost);
        o.step_time = std::move(resolved.step_time);
        const std::optional<FlopsCoefficients> coef = resolved.flops;
        std::vector<SampleLength> samples;
        samples.reserve(lengths.size());  // each written once, not zeroed first
        // The usual call (lengths only): one tight loop per dtype.
        lengths.Visit([&](auto view) {
          for (size_t i = 0; i < view.size(); ++i) {
            const int64_t length = view[i];
            samples.push_back({static_cast<int64_t>(i), length, length - 1});
          }
        });
        if (ids) {
          for (size_t i = 0; i < samples.size(); ++i) samples[i].id = (*ids)[i];
        }
        if (n_targets) {
          for (size_t i = 0; i < samples.size(); ++i) samples[i].n_targets = (*n_targets)[i];
        }
        // The static plans' sim_step_time charges the encoder too, where its term converts
        // to seconds (as the step's does).
        if (o.scheduler != ScheduleOptions::Scheduler::kDynamic && !o.encoder_cost.empty() &&
            o.step_time.has_value()) {
          const std::optional<EncoderCost> seconds =
              EncoderTermSeconds(o.cost, *o.step_time, o.encoder_cost);
          if (seconds) o.step_time = o.step_time->WithEncoder(*seconds);
        }
        if (o.scheduler == ScheduleOptions::Scheduler::kDynamic) {
          // The encoder's term in seconds, the step-time model's (as the step makes it): a
          // profile's as given, a model cost's FLOPs at the hardware's R.
          if (!o.encoder_cost.empty()) {
            const EncoderCost& c = o.encoder_cost;
            if (!std::isfinite(c.per_patch) || !std::isfinite(c.per_frame_sq) ||
                c.per_patch < 0 || c.per_frame_sq < 0) {
              throw py::value_error("encoder_cost: (" + std::to_string(c.per_patch) + ", " +
                                    std::to_string(c.per_frame_sq) +
                                    ") must be finite and >= 0");
            }
            const std::optional<EncoderCost> seconds =
                o.step_time ? EncoderTermSeconds(o.cost, *o.step_time, o.encoder_cost)
                            : std::nullopt;
            if (!seconds) {
              throw py::value_error("encoder_cost under the dynamic scheduler: the cost '" +
                                    o.cost.name + "' has no known seconds (a model cost in "
                                    "FLOPs at the hardware's R, or a measured profile)");
            }
            o.step_time = o.step_time->WithEncoder(*seconds);
            o.encoder_cost = EncoderCost{};
          }
          PyDynamicPlan out;
          Status status;
          {
            py::gil_scoped_release release;
            Result<DynamicPlan> plan = ScheduleDynamic(samples, o, groups, encoder);
            status = plan.status();
            if (plan.ok()) {
              out.plan = std::move(*plan);
              Result<PlanFigures> figures = ComputeDynamicPlanFigures(samples, o, out.plan);
              status = figures.status();
              if (figures.ok()) out.figures = std::move(*figures);
            }
          }
          ThrowIfError(status);
          if (coef) {
            out.flops = TrainingFlops(*coef, out.figures.padded_tokens,
                                      static_cast<double>(out.figures.sum_sq));
          }
          return py::cast(std::move(out));
        }
        Result<ScheduledPlan> scheduled = Status::Internal("not scheduled");
        {
          py::gil_scoped_release release;
          scheduled = ScheduleWithFigures(samples, o, groups, encoder);
        }
        ThrowIfError(scheduled.status());
        PyPlan out;
        out.plan = std::move(scheduled->plan);
        out.figures = std::move(scheduled->figures);
        out.sim_step_time = scheduled->sim_step_time;
        if (coef) {
          out.flops = TrainingFlops(*coef, out.figures.padded_tokens,
                                    static_cast<double>(out.figures.sum_sq));
        }
        return py::cast(std::move(out));
      },
      py::arg("lengths"), py::arg("n_targets") = py::none(), py::arg("ids") = py::none(),
      // The defaults are the job's (JobOptions, thdpack/job.h), said there only.
      py::kw_only(), py::arg("dp_size"), THDPACK_LAYOUT_ARGS,
      py::arg("max_tokens_per_rank") = kJob.max_tokens_per_rank,
      py::arg("scheduler") = kJob.scheduler, py::arg("cost") = kJob.cost,
      py::arg("microbatch_multiple") = kJob.microbatch_multiple,
      py::arg("num_microbatches") = kJob.num_microbatches, py::arg("oversize") = kJob.oversize,
      py::arg("hw") = kJob.hw, py::arg("cp_sizes") = kJob.cp_sizes,
      py::arg("groups") = py::none(), py::arg("keep_groups") = kJob.keep_groups,
      py::arg("max_seqs") = kJob.max_seqs, py::arg("pad_to_max_tokens") = kJob.pad_to_max_tokens,
      py::arg("encoder_work") = py::none(), py::arg("encoder_cost") = py::none(),
      R"doc(Schedules one step: which sample goes to which DP replica and microbatch.

lengths: [n] of any integer dtype (a NumPy array, CPU torch tensor or list), the real length
L of every sample (L >= 1).
n_targets: loss tokens per sample (default L - 1). ids: sample ids (default 0..n-1).
Options as ScheduleOptions in thdpack/schedule.h; scheduler "balanced", "sequential" or
"dynamic" (needs a model cost; returns a DynamicPlan whose `groups` give, per microbatch, the
CP groups {'ranks', 'samples'} of the dp_size*cp_size ranks; cp_sizes "any" or "pow2");
hw the step-time model's hardware ("h100-ib", "h100-nvlink" or "R,B", for sim_step_time),
cost a cost spec ("tokens", "llama3-8b", "A,B", "l=..,h=..,nh=..,nkv=..,f=..,v=..", or
"profile:FILE", a measured profile (thdpack.torch.calibrate, thdpack calibrate); default the
job's, "llama2-7b"), max_tokens_per_rank default the job's (16384),
oversize "error" or "skip" (the step's "truncate" and "split" act as samples are read, before a
schedule: the scheduler takes them as "error"), num_microbatches 0 to let the scheduler choose, rank_multiple every
rank's tokens of a microbatch a multiple of it (an int, or "fp8" 16, "mxfp8" 32, "blockwise" 128;
the dynamic scheduler applies it to each group). The layout: layout= (a thdpack.ParallelLayout)
or its scalars (cp_size, tp_size, sp, extra_alignment, rank_multiple), not both.
groups: [n] group ids (any integers) with keep_groups "microbatch" (a group in one microbatch,
its samples adjacent in input order: DPO pairs) or "replica" (a group on one replica: GRPO);
under the dynamic scheduler both keep a group in one CP group of one microbatch. A group too
large for its place is an error naming it, or skipped whole with oversize="skip".
Static shapes (static schedulers): max_seqs at most that many sequences a microbatch (0: no
cap), pad_to_max_tokens every microbatch's T = cp_size * max_tokens_per_rank (figures count it).
Media: encoder_work [n, 2] integers, each sample's sum of t*h*w and of
t*(h*w)^2 over its items, with encoder_cost (per_patch, per_frame_sq) in the cost's unit
(the step's default, Qwen2-VL's tower in FLOPs: docs/media.md): each sample costs its
language model's cost plus its encoder's, and the figures give the encoder's part
(encoder_cost) of every total. Under the dynamic scheduler the same term goes into its
step-time model in seconds (FLOPs at the hardware's R, a profile's as given): a sequence costs
each rank of its CP group t(P, c) + its encoder seconds / c, and plan.step_time charges it.
Returns a Plan (num_microbatches, microbatch(replica, m), figures). ValueError on bad input.)doc");
}

}  // namespace thdpack::python
