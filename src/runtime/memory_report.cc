// The memory report (docs/design.md section 9): per-step figures from a plan, per-rank figures from
// what a rank holds, and the per-rank profile files.
#include "thdpack/memory_report.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>
#include <utility>
#include <vector>

#include "thdpack/pack.h"

namespace thdpack {
namespace {

using Json = nlohmann::ordered_json;

Status ValidateOptions(const MemoryReportOptions& m, std::string_view where) {
  if (m.vocab_size < 0) {
    return Status::InvalidArgument(std::string(where) + ": vocab_size = " +
                                   std::to_string(m.vocab_size) + " must be >= 0 (0: unknown)");
  }
  if (Result<int64_t> size = LogitsDtypeSize(m.logits_dtype); !size.ok()) {
    return size.status().WithContext(std::string(where) + ": logits_dtype");
  }
  return Status::Ok();
}

// The logits figures of a microbatch of T tokens, or nullopt when V is unknown.
Result<std::optional<LogitsFigures>> Logits(int64_t total_tokens, int cp_size, int tp_size,
                                            const MemoryReportOptions& m) {
  if (m.vocab_size == 0) return std::optional<LogitsFigures>();
  LogitsFigures f;
  f.total_tokens = total_tokens;
  f.vocab_size = m.vocab_size;
  f.dtype = m.logits_dtype;
  f.cp_size = cp_size;
  f.tp_size = tp_size;
  f.with_grad = m.with_grad;
  THDPACK_ASSIGN_OR_RETURN(f.bytes, LogitsMemoryBytes(total_tokens, cp_size, m.vocab_size,
                                                      m.logits_dtype, tp_size, m.with_grad));
  return std::optional<LogitsFigures>(f);
}

Json LogitsJson(const LogitsFigures& f) {
  Json j;
  j["largest_microbatch_tokens"] = f.total_tokens;
  j["vocab_size"] = f.vocab_size;
  j["dtype"] = std::string(LogitsDtypeName(f.dtype));
  j["cp_size"] = f.cp_size;
  j["tp_size"] = f.tp_size;
  j["with_grad"] = f.with_grad;
  j["local_bytes"] = f.bytes.local_logits_bytes;
  j["gathered_bytes"] = f.bytes.gathered_logits_bytes;
  j["local_grad_bytes"] = f.bytes.local_grad_bytes;
  j["gathered_grad_bytes"] = f.bytes.gathered_grad_bytes;
  j["local_total_bytes"] = f.bytes.local_total_bytes;
  j["gathered_total_bytes"] = f.bytes.gathered_total_bytes;
  return j;
}

Json OptionalLogitsJson(const std::optional<LogitsFigures>& f) {
  return f.has_value() ? LogitsJson(*f) : Json(nullptr);
}

void Add(MicrobatchBufferBytes& sum, const MicrobatchBufferBytes& b) {
  sum.tokens += b.tokens;
  sum.position_ids += b.position_ids;
  sum.labels += b.labels;
  sum.loss_mask += b.loss_mask;
  sum.metadata += b.metadata;
  sum.loss_outputs += b.loss_outputs;
  sum.total += b.total;
}

template <typename T>
int64_t Bytes(const std::vector<T>& v) {
  return static_cast<int64_t>(v.size() * sizeof(T));
}

}  // namespace

Result<StepMemoryFigures> ComputeStepMemory(std::span<const SampleLength> samples,
                                            const ScheduleOptions& options, const Plan& plan,
                                            const MemoryReportOptions& memory) {
  const std::string f = "ComputeStepMemory";
  THDPACK_RETURN_IF_ERROR(ValidateOptions(memory, f));
  const int dp = plan.dp_size;
  const int m_count = plan.num_microbatches;
  if (dp < 1 || m_count < 1 ||
      plan.offsets.size() != static_cast<size_t>(dp) * static_cast<size_t>(m_count) + 1 ||
      plan.offsets.back() != static_cast<int64_t>(plan.sample_ids.size())) {
    return Status::InvalidArgument(f + ": the plan's offsets do not describe DP x M = " +
                                   std::to_string(dp) + " x " + std::to_string(m_count) +
                                   " microbatches of its sample ids");
  }
  const SampleIdIndex index(samples);  // ids are unique within a step
  const int64_t total = static_cast<int64_t>(plan.sample_ids.size());

  PackOptions pack;
  pack.parallel = options.parallel;
  pack.fixed_tokens = FixedMicrobatchTokens(options);

  StepMemoryFigures out;
  out.num_microbatches = m_count;
  int64_t largest_t = 0;
  std::vector<int64_t> lengths;
  for (int d = 0; d < dp; ++d) {
    MicrobatchBufferBytes replica;
    for (int m = 0; m < m_count; ++m) {
      lengths.clear();
      const size_t g = static_cast<size_t>(d) * static_cast<size_t>(m_count) + m;
      for (int64_t k = plan.offsets[g]; k < plan.offsets[g + 1]; ++k) {
        if (k + 16 < total) index.Prefetch(plan.sample_ids[static_cast<size_t>(k + 16)]);
        const int64_t id = plan.sample_ids[static_cast<size_t>(k)];
        const int64_t slot = index.Slot(id);
        if (slot < 0) {
          return Status::InvalidArgument(f + ": the plan's sample id " + std::to_string(id) +
                                         " (replica " + std::to_string(d) + ", microbatch " +
                                         std::to_string(m) + ") is not among the samples");
        }
        lengths.push_back(index.Length(slot));
      }
      Result<Layout> layout = ComputeLayout(lengths, pack);
      if (!layout.ok()) {
        return layout.status().WithContext(f + ": replica " + std::to_string(d) +
                                           ", microbatch " + std::to_string(m));
      }
      THDPACK_ASSIGN_OR_RETURN(MicrobatchBufferBytes b,
                               BufferBytes(layout->cu_seqlens_padded, options.parallel.cp_size()));
      Add(replica, b);
      largest_t = std::max(largest_t, layout->total_tokens);
    }
    if (d == 0 || replica.total > out.buffers.total) {
      out.busiest_replica = d;
      out.buffers = replica;
    }
  }
  THDPACK_ASSIGN_OR_RETURN(out.logits, Logits(largest_t, options.parallel.cp_size(),
                                              options.parallel.tp_size(), memory));
  return out;
}

Result<StepMemoryFigures> ComputeStepMemoryFromFigures(const PlanFigures& figures,
                                                       const ScheduleOptions& options,
                                                       const MemoryReportOptions& memory) {
  const std::string f = "ComputeStepMemoryFromFigures";
  THDPACK_RETURN_IF_ERROR(ValidateOptions(memory, f));
  if (figures.replicas.empty() || figures.num_microbatches < 1) {
    return Status::InvalidArgument(f + ": the figures hold no replica or no microbatch "
                                   "(per-microbatch detail is needed)");
  }
  const int cp = options.parallel.cp_size();
  StepMemoryFigures out;
  out.num_microbatches = figures.num_microbatches;
  int64_t largest_t = 0;
  for (size_t d = 0; d < figures.replicas.size(); ++d) {
    const ReplicaFigures& r = figures.replicas[d];
    MicrobatchBufferBytes replica;
    for (size_t m = 0; m < r.microbatches.size(); ++m) {
      const MicrobatchFigures& mb = r.microbatches[m];
      Result<MicrobatchBufferBytes> b = BufferBytesOfShape(mb.padded_tokens, mb.n_samples, cp);
      if (!b.ok()) {
        return b.status().WithContext(f + ": replica " + std::to_string(d) + ", microbatch " +
                                      std::to_string(m));
      }
      Add(replica, *b);
      largest_t = std::max(largest_t, mb.padded_tokens);
    }
    if (d == 0 || replica.total > out.buffers.total) {
      out.busiest_replica = static_cast<int>(d);
      out.buffers = replica;
    }
  }
  THDPACK_ASSIGN_OR_RETURN(out.logits, Logits(largest_t, cp, options.parallel.tp_size(), memory));
  return out;
}

Result<StepMemoryFigures> ComputeHistogramStepMemory(const HistogramPlan& plan,
                                                     const ScheduleOptions& options,
                                                     const MemoryReportOptions& memory) {
  const std::string f = "ComputeHistogramStepMemory";
  THDPACK_RETURN_IF_ERROR(ValidateOptions(memory, f));
  const int cp = options.parallel.cp_size();
  StepMemoryFigures out;
  out.num_microbatches = plan.figures.num_microbatches;
  int64_t largest_t = 0;
  for (size_t c = 0; c < plan.classes.size(); ++c) {
    const MicrobatchClass& mc = plan.classes[c];
    // The class's T is already in its figures: no layout to compute again.
    const int64_t t = mc.figures.padded_tokens;
    Result<MicrobatchBufferBytes> bytes =
        BufferBytesOfShape(t, static_cast<int64_t>(mc.lengths.size()), cp);
    if (!bytes.ok()) return bytes.status().WithContext(f + ": class " + std::to_string(c));
    MicrobatchBufferBytes b = *bytes;
    for (int64_t* field : {&b.tokens, &b.position_ids, &b.labels, &b.loss_mask, &b.metadata,
                           &b.loss_outputs, &b.total}) {
      if (__builtin_mul_overflow(*field, mc.count, field)) {
        return Status::OutOfRange(f + ": buffer bytes overflow int64");
      }
    }
    Add(out.buffers, b);
    largest_t = std::max(largest_t, t);
  }
  THDPACK_ASSIGN_OR_RETURN(out.logits, Logits(largest_t, cp, options.parallel.tp_size(), memory));
  return out;
}

std::string LogitsFiguresJson(const LogitsFigures& figures) { return LogitsJson(figures).dump(); }

std::string StepMemoryJson(const StepMemoryFigures& figures) {
  Json j;
  j["logits"] = OptionalLogitsJson(figures.logits);
  Json b;
  b["replica"] = figures.busiest_replica;
  b["num_microbatches"] = figures.num_microbatches;
  b["tokens"] = figures.buffers.tokens;
  b["position_ids"] = figures.buffers.position_ids;
  b["labels"] = figures.buffers.labels;
  b["loss_mask"] = figures.buffers.loss_mask;
  b["metadata"] = figures.buffers.metadata;
  b["loss_outputs"] = figures.buffers.loss_outputs;
  b["total"] = figures.buffers.total;
  j["buffers_per_rank"] = std::move(b);
  return j.dump();
}

Result<RankMemoryFigures> ComputeRankMemory(const RankStep& step, const Topology& topology,
                                            const MemoryReportOptions& memory) {
  THDPACK_RETURN_IF_ERROR(ValidateOptions(memory, "ComputeRankMemory"));
  RankMemoryFigures f;
  f.step = step.step;
  f.coord = step.coord;
  Result<int> rank = topology.RankOf(step.coord);
  if (!rank.ok()) return rank.status().WithContext("ComputeRankMemory: step.coord");
  f.rank = *rank;
  f.first_stage = step.first_stage;
  f.last_stage = step.last_stage;
  f.num_microbatches = static_cast<int>(step.microbatches.size());
  int64_t largest_t = 0;
  int64_t largest_local = 0;  // dynamic: group sizes differ, so the largest T/c
  for (const LocalMicrobatch& mb : step.microbatches) {
    largest_local = std::max(largest_local, mb.local_tokens);
    f.held.tokens += Bytes(mb.tokens);
    f.held.position_ids += Bytes(mb.position_ids);
    f.held.labels += Bytes(mb.labels);
    f.held.loss_mask += Bytes(mb.loss_mask);
    f.held.metadata += Bytes(mb.cu_seqlens) + Bytes(mb.cu_seqlens_padded) +
                       Bytes(mb.sample_ids) + Bytes(mb.seq_n_targets);
    for (const auto& field : mb.fields) f.held.fields += Bytes(field);
    largest_t = std::max(largest_t, mb.total_tokens);
  }
  f.held.total = f.held.tokens + f.held.position_ids + f.held.labels + f.held.loss_mask +
                 f.held.metadata + f.held.fields;
  if (step.last_stage && step.dynamic) {
    // A shard of T/c tokens holds what a CP = 1 microbatch of T/c tokens holds (as `plan`).
    THDPACK_ASSIGN_OR_RETURN(f.logits, Logits(largest_local, 1, topology.tp_size(), memory));
  } else if (step.last_stage) {
    THDPACK_ASSIGN_OR_RETURN(
        f.logits, Logits(largest_t, topology.cp_size(), topology.tp_size(), memory));
  }
  return f;
}

std::string MemoryProfileFileName(int64_t step, int rank, const Coord& coord) {
  return "step_" + std::to_string(step) + "/rank" + std::to_string(rank) + "_pp" +
         std::to_string(coord.pp) + "_dp" + std::to_string(coord.dp) + "_cp" +
         std::to_string(coord.cp) + "_tp" + std::to_string(coord.tp) + ".json";
}

std::string RankMemoryJson(const RankMemoryFigures& figures,
                           const std::optional<ProcessMemory>& process, int ranks_in_process) {
  Json j;
  j["step"] = figures.step;
  j["rank"] = figures.rank;
  j["pp"] = figures.coord.pp;
  j["dp"] = figures.coord.dp;
  j["cp"] = figures.coord.cp;
  j["tp"] = figures.coord.tp;
  j["first_stage"] = figures.first_stage;
  j["last_stage"] = figures.last_stage;
  j["num_microbatches"] = figures.num_microbatches;
  Json held;
  held["tokens"] = figures.held.tokens;
  held["position_ids"] = figures.held.position_ids;
  held["labels"] = figures.held.labels;
  held["loss_mask"] = figures.held.loss_mask;
  held["metadata"] = figures.held.metadata;
  held["fields"] = figures.held.fields;
  held["total"] = figures.held.total;
  j["held_bytes"] = std::move(held);
  j["logits"] = OptionalLogitsJson(figures.logits);
  if (process.has_value()) {
    Json p;
    p["peak_rss_bytes"] = process->peak_rss_bytes;
    p["rss_bytes"] = process->rss_bytes;
    p["ranks_in_process"] = ranks_in_process;
    if (ranks_in_process > 1) {
      p["note"] = std::to_string(ranks_in_process) +
                  " ranks share this process (threads backend): peak_rss_bytes and rss_bytes "
                  "are the whole process's, not this rank's";
    }
    j["process"] = std::move(p);
  } else {
    j["process"] = nullptr;
  }
  return j.dump(2) + "\n";
}

Status WriteMemoryProfile(std::string_view dir, const RankMemoryFigures& figures,
                          int ranks_in_process) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(dir) / MemoryProfileFileName(figures.step, figures.rank,
                                                              figures.coord);
  const fs::path folder = path.parent_path();
  std::error_code ec;
  fs::create_directories(folder, ec);
  // Another rank may create the same folder at the same moment: only a folder that is still
  // missing is an error.
  if (ec && !fs::is_directory(folder)) {
    return Status::IOError("WriteMemoryProfile: cannot create the folder \"" + folder.string() +
                           "\": " + ec.message());
  }
  std::optional<ProcessMemory> process;
  if (Result<ProcessMemory> m = ReadProcessMemory(); m.ok()) process = *m;
  const std::string text = RankMemoryJson(figures, process, ranks_in_process);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    return Status::IOError("WriteMemoryProfile: cannot open \"" + path.string() +
                           "\" for writing");
  }
  out << text;
  out.close();
  if (!out) return Status::IOError("WriteMemoryProfile: cannot write \"" + path.string() + "\"");
  return Status::Ok();
}

Status ProfileRankMemory(ProcessGroup& world, const RankStep& step, const Topology& topology,
                         const MemoryReportOptions& memory, std::string_view dir) {
  const int ranks_in_process = world.backend() == "threads" ? world.size() : 1;
  Status local = Status::Ok();
  auto figures = ComputeRankMemory(step, topology, memory);
  if (figures.ok()) {
    local = WriteMemoryProfile(dir, *figures, ranks_in_process).WithContext("--memory-profile-dir");
  } else {
    local = figures.status();
  }
  return AgreeOnStatus(world, local, "memory profile");
}

}  // namespace thdpack
