// The job agreed over the world when the step runner opens (StepRunner::Create, before any
// other collective): every option of StepRunnerOptions that shapes a step, and the field
// schema, as (name, value) entries (StepJobEntries), compared over the world. Ranks that were
// given different options would otherwise exchange messages of different sizes (an abort in the
// transport) or, worse, place samples by different plans (one sample on two replicas, another
// on none) and read fields by position under another name.
// Sends: one all-reduce of 16 bytes (the largest and smallest hash of the entries); only when
// they differ, world rank 0's entries (a size frame and a job frame, thdpack/step_wire.h) and
// the agreement of the outcome.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <string>
#include <vector>

#include "common/hash64.h"
#include "runtime/step_runner_impl.h"
#include "thdpack/step_runner.h"
#include "thdpack/step_wire.h"

namespace thdpack {
namespace {

std::string Num(int64_t v) { return std::to_string(v); }
std::string Flag(bool v) { return v ? "true" : "false"; }
// Exact: two doubles that print alike are equal.
std::string Real(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string CostText(const CostModel& c) {
  std::string text = c.name + " (a " + Real(c.a) + ", b " + Real(c.b) + ", c " + Real(c.c);
  if (c.encoder) {
    text += ", encoder " + Real(c.encoder->per_patch) + ", " + Real(c.encoder->per_frame_sq);
  }
  return text + ")";
}

std::string StepTimeText(const std::optional<StepTimeModel>& m) {
  if (!m) return "none";
  const StepTimeCoefficients& k = m->coefficients();
  return k.name + " (" + Real(k.seconds_per_token) + ", " + Real(k.seconds_per_token_sq) + ", " +
         Real(k.seconds_per_sequence) + ", " + Real(k.seconds_per_microbatch) + ", " +
         Real(k.kv_bytes_per_token) + ", " + Real(k.link_bytes_per_second) + ")";
}

std::string Quoted(const std::string& text) {
  constexpr size_t kShown = 200;
  return "\"" + (text.size() > kShown ? text.substr(0, kShown) + "..." : text) + "\"";
}

}  // namespace

std::vector<JobEntry> StepJobEntries(const StepRunnerOptions& o, const Topology& topology) {
  const ScheduleOptions& s = o.schedule;
  const bool fed = static_cast<bool>(o.read_share);
  std::vector<JobEntry> e = {
      {"topology", topology.ToString()},
      // The kind of source, not its path: ranks may read copies of the data at paths of
      // their own (a node's local disk); a resumed state's fingerprint checks what they hold.
      {"source", fed ? "fed by the caller" : o.data.substr(0, o.data.find(':'))},
  };
  if (!fed) {
    e.insert(e.end(), {{"seed", std::to_string(o.source.seed)},
                       {"shuffle", Flag(o.source.shuffle)},
                       {"vocab", Num(o.source.vocab_size)},
                       {"mock_samples", Num(o.source.mock_num_samples)}});
  }
  e.insert(e.end(), {
      {"global_batch", Num(o.global_batch)},
      {"global_batch_tokens", Num(o.global_batch_tokens)},
      {"start_step", Num(o.start_step)},
      {"scheduler", std::string(SchedulerName(s.scheduler))},
      {"max_tokens_per_rank", Num(s.max_tokens_per_rank)},
      {"cost", CostText(s.cost)},
      {"step_time", StepTimeText(s.step_time)},
      {"layout", s.parallel.ToString()},
      {"microbatch_multiple", Num(s.microbatch_multiple)},
      {"num_microbatches", Num(s.num_microbatches)},
      {"oversize", std::string(OversizePolicyName(s.oversize))},
      {"max_microbatch_search", Num(s.max_microbatch_search)},
      {"cp_sizes", std::string(CpSizesName(s.cp_sizes))},
      {"keep_groups", std::string(KeepGroupsName(s.keep_groups))},
      {"group_field", o.group_field},
      {"max_seqs", Num(s.max_seqs_per_microbatch)},
      {"pad_to_max_tokens", Flag(s.pad_to_max_tokens)},
      {"pad_id", Num(o.pad_id)},
      {"data_on", std::string(DataOnName(o.data_on))},
      {"check_plan_hash", Flag(o.check_plan_hash)},
      {"max_cp_groups", Num(o.max_cp_groups)},
      {"defer_cp_groups", Flag(o.defer_cp_groups)},
      {"fields", Num(static_cast<int64_t>(o.fields.size()))},
  });
  for (size_t f = 0; f < o.fields.size(); ++f) {
    e.emplace_back("fields[" + std::to_string(f) + "]", o.fields[f].ToString());
  }
  e.emplace_back("media", Num(static_cast<int64_t>(o.media.size())));
  for (size_t m = 0; m < o.media.size(); ++m) {
    e.emplace_back("media[" + std::to_string(m) + "]",
                   o.media[m].name + " (token " + Num(o.media[m].token_id) +
                       (o.media[m].timed ? ", timed)" : ")"));
  }
  if (!o.media.empty()) {
    e.emplace_back("spatial_merge_size", Num(o.spatial_merge_size));
    e.emplace_back("mrope", std::string(MropeName(o.mrope)));
    e.emplace_back("mrope_tokens_per_second", Real(o.mrope_tokens_per_second));
    e.emplace_back("media_cost", o.media_cost.has_value()
                                     ? Real(o.media_cost->per_patch) + "," +
                                           Real(o.media_cost->per_frame_sq)
                                     : std::string("default"));
  }
  return e;
}

Status AgreeOnJob(ProcessGroup& world, std::span<const JobEntry> mine) {
  return AgreeOnEntries(world, mine, "the job");
}

Status AgreeOnEntries(ProcessGroup& world, std::span<const JobEntry> mine, std::string_view what) {
  const std::string context = "agreeing " + std::string(what);
  const std::vector<uint8_t> frame = EncodeJobFrame(mine);
  // The largest hash and the largest complement (~ the smallest hash), in one all-reduce.
  const auto h = static_cast<int64_t>(internal::Hash64(std::span<const uint8_t>(frame)));
  int64_t bounds[2] = {h, ~h};
  THDPACK_RETURN_IF_ERROR(world.AllReduceInt64(bounds, ReduceOp::kMax));
  if (bounds[0] == ~bounds[1]) return Status::Ok();

  // Some rank differs: world rank 0's entries to every rank, which names what differs.
  auto size = EncodeSizeFrame(static_cast<int64_t>(frame.size()));
  THDPACK_RETURN_IF_ERROR(world.BroadcastValues(std::span<uint8_t>(size), 0));
  Status local;
  std::vector<uint8_t> theirs;
  Result<int64_t> n = DecodeSizeFrame(size, 0, int64_t{1} << 30);
  if (!n.ok()) {
    local = n.status().WithContext(std::string(what) + " of world rank 0");
  }
  // Every rank joins the broadcast with the size it decoded, or agrees the failure first.
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, local, context));
  theirs.resize(static_cast<size_t>(*n));
  if (world.rank() == 0) theirs = frame;
  THDPACK_RETURN_IF_ERROR(world.BroadcastValues(std::span<uint8_t>(theirs), 0));
  Result<std::vector<JobEntry>> zero = DecodeJobFrame(theirs);
  if (!zero.ok()) {
    local = zero.status().WithContext(std::string(what) + " of world rank 0");
  } else {
    const std::string here = "world rank " + std::to_string(world.global_rank());
    const std::string there = "world rank " + std::to_string(world.ranks()[0]);
    for (size_t k = 0; k < std::max(mine.size(), zero->size()) && local.ok(); ++k) {
      const JobEntry* a = k < mine.size() ? &mine[k] : nullptr;
      const JobEntry* b = k < zero->size() ? &(*zero)[k] : nullptr;
      if (a && b && *a == *b) continue;
      if (a && b && a->first == b->first) {
        local = Status::InvalidArgument(
            std::string(what) + " differs over the world: " + a->first + " is " +
            Quoted(a->second) + " on " + here + " and " + Quoted(b->second) + " on " + there +
            " (every rank must give the same)");
      } else {
        const JobEntry& shown = a ? *a : *b;
        local = Status::InvalidArgument(
            std::string(what) + " differs over the world: " + shown.first + " (" +
            Quoted(shown.second) + ") is given on " + (a ? here : there) + " only" +
            " (every rank must give the same)");
      }
    }
  }
  return AgreeOnStatus(world, local, context);
}

namespace {

bool IsWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }

// Whether `word` occurs in `text` with no identifier character on either side.
bool HasWord(std::string_view text, std::string_view word) {
  for (size_t at = text.find(word); at != std::string_view::npos; at = text.find(word, at + 1)) {
    const size_t end = at + word.size();
    if ((at == 0 || !IsWordChar(text[at - 1])) && (end == text.size() || !IsWordChar(text[end]))) {
      return true;
    }
  }
  return false;
}

}  // namespace

std::string JobOptionFlag(std::string_view name) {
  if (name == "max_seqs") return "--max-seqs-per-microbatch";
  std::string flag = "--" + std::string(name);
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

Status SayDefaulted(const Status& s, std::span<const std::string> defaulted) {
  if (s.ok() || defaulted.empty()) return s;
  std::string named;
  for (const std::string& name : defaulted) {
    if (!HasWord(s.message(), name) && !HasWord(s.message(), JobOptionFlag(name))) continue;
    if (s.message().find(name + " defaulted") != std::string::npos) continue;  // said already
    named += (named.empty() ? "" : ", ") + name;
  }
  if (named.empty()) return s;
  return s.WithNote(named + " defaulted");
}

}  // namespace thdpack
