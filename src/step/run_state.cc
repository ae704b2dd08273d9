// The run state record (thdpack/run_state.h): fingerprint, resume check, JSON with a checksum,
// atomic files.
#include "thdpack/run_state.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/hash64.h"
#include "common/publish_file.h"

namespace thdpack {
namespace {

constexpr std::string_view kFormat = "thdpack run state";

// The kinds whose tokens are drawn from (seed, id).
bool MockTokens(SourceKind source) {
  return source == SourceKind::kMock || source == SourceKind::kLengths ||
         source == SourceKind::kHistogram;
}

// A cursor as the table of its fields (thdpack/data.h) says: each row of the cursor's shape
// under its name.
nlohmann::json CursorJson(const SourceCursor& c) {
  nlohmann::json j = nlohmann::json::object();
  const CursorShape shape = ShapeOf(c);
  for (const CursorField& f : SourceCursorFields()) {
    if (f.shape != CursorShape::kPlain && f.shape != shape) continue;
    nlohmann::json& v = j[std::string(f.name)];
    switch (f.kind) {
      case CursorFieldKind::kInt: v = c.*f.value; break;
      case CursorFieldKind::kInts: v = c.*f.values; break;
      case CursorFieldKind::kCursor: v = CursorJson(c.parts.at(0)); break;
      case CursorFieldKind::kCursors:
        v = nlohmann::json::array();
        for (const SourceCursor& p : c.parts) v.push_back(CursorJson(p));
        break;
    }
  }
  return j;
}

// The record without its checksum: the canonical form (nlohmann's objects keep keys sorted).
nlohmann::json Body(const RunState& s) {
  const DataFingerprint& d = s.data;
  nlohmann::json data = {{"source", SourceKindName(d.source)},     {"spec", d.spec},
                         {"identity", d.identity}, {"seed", d.seed},
                         {"shuffle", d.shuffle},   {"vocab_size", d.vocab_size},
                         {"mock_samples", d.mock_samples}, {"oversize", d.oversize},
                         {"longest_kept", d.longest_kept}};
  nlohmann::json j = {{"format", kFormat},        {"version", kRunStateVersion},
                      {"next_step", s.next_step}, {"consumed", s.consumed},
                      {"data", std::move(data)}};
  j["cursor"] = s.cursor ? CursorJson(*s.cursor) : nlohmann::json(nullptr);
  return j;
}

// One line; a spec that is not UTF-8 (a Latin-1 path) is written with U+FFFD in its place,
// never an exception (the spec is for messages only).
std::string Dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string Checksum(const nlohmann::json& body) {
  return internal::Hex64(internal::Hash64(Dump(body)));
}

// Field readers: each names the field (a dotted path) on error.
class Reader {
 public:
  explicit Reader(std::string where) : where_(std::move(where)) {}

  Status Bad(std::string_view field, std::string_view rule) const {
    return Status::Corruption(where_ + ": field \"" + std::string(field) + "\" " +
                              std::string(rule));
  }
  Result<const nlohmann::json*> Get(const nlohmann::json& obj, std::string_view prefix,
                                    const char* key) const {
    const auto it = obj.find(key);
    if (it == obj.end()) return Bad(Name(prefix, key), "is missing");
    return &*it;
  }
  Result<int64_t> Int(const nlohmann::json& obj, std::string_view prefix, const char* key) const {
    THDPACK_ASSIGN_OR_RETURN(const nlohmann::json* v, Get(obj, prefix, key));
    if (!v->is_number_integer() ||
        (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      return Bad(Name(prefix, key), "must be an integer in int64, got " + Excerpt(*v));
    }
    return v->get<int64_t>();
  }
  Result<uint64_t> Uint(const nlohmann::json& obj, std::string_view prefix,
                        const char* key) const {
    THDPACK_ASSIGN_OR_RETURN(const nlohmann::json* v, Get(obj, prefix, key));
    if (!v->is_number_unsigned() && !(v->is_number_integer() && v->get<int64_t>() == 0)) {
      return Bad(Name(prefix, key), "must be an unsigned integer, got " + Excerpt(*v));
    }
    return v->get<uint64_t>();
  }
  Result<std::string> Str(const nlohmann::json& obj, std::string_view prefix,
                          const char* key) const {
    THDPACK_ASSIGN_OR_RETURN(const nlohmann::json* v, Get(obj, prefix, key));
    if (!v->is_string()) return Bad(Name(prefix, key), "must be a string, got " + Excerpt(*v));
    return v->get<std::string>();
  }
  Result<bool> Bool(const nlohmann::json& obj, std::string_view prefix, const char* key) const {
    THDPACK_ASSIGN_OR_RETURN(const nlohmann::json* v, Get(obj, prefix, key));
    if (!v->is_boolean()) return Bad(Name(prefix, key), "must be true or false, got " + Excerpt(*v));
    return v->get<bool>();
  }
  // Keys beyond `known` are refused: this version writes none.
  Status OnlyKnown(const nlohmann::json& obj, std::string_view prefix,
                   std::initializer_list<const char*> known) const {
    for (const auto& [key, value] : obj.items()) {
      bool found = false;
      for (const char* k : known) found = found || key == k;
      if (!found) return Bad(Name(prefix, key.c_str()), "is not a field of version 1");
    }
    return Status::Ok();
  }
  const std::string& where() const { return where_; }

 private:
  static std::string Name(std::string_view prefix, const char* key) {
    return prefix.empty() ? std::string(key) : std::string(prefix) + "." + key;
  }
  static std::string Excerpt(const nlohmann::json& v) {
    std::string text = v.dump();
    if (text.size() > 40) text = text.substr(0, 40) + "...";
    return text;
  }
  std::string where_;
};

// A cursor object at `path`, walking the table of its fields (thdpack/data.h): its shape from
// the rows present, each row of that shape read by its kind, then every rule between fields
// (CheckSourceCursor).
Result<SourceCursor> ParseCursorFields(const Reader& r, const nlohmann::json& j,
                                       const std::string& path, int nesting) {
  if (!j.is_object()) return r.Bad(path, "must be an object");
  if (nesting > kMaxCursorNesting) return r.Bad(path, "nests deeper than any source's cursor");
  // Every key a row's name; the shape that of the rows present (one shape's rows only).
  const CursorField* shaped = nullptr;
  for (const auto& [key, value] : j.items()) {
    const CursorField* row = nullptr;
    for (const CursorField& f : SourceCursorFields()) {
      if (f.name == key) row = &f;
    }
    if (row == nullptr) return r.Bad(path + "." + key, "is not a field of version 1");
    if (row->shape == CursorShape::kPlain) continue;
    if (shaped != nullptr && shaped->shape != row->shape) {
      return r.Bad(path + "." + std::string(shaped->name),
                   "with \"" + key +
                       "\" (a cursor is a blend's or a splitting source's, not both)");
    }
    shaped = row;
  }
  const CursorShape shape = shaped == nullptr ? CursorShape::kPlain : shaped->shape;
  SourceCursor c;
  for (const CursorField& f : SourceCursorFields()) {
    if (f.shape != CursorShape::kPlain && f.shape != shape) continue;
    const std::string at = path + "." + std::string(f.name);
    const auto it = j.find(std::string(f.name));
    if (it == j.end()) {
      if (f.shape == CursorShape::kPlain) return r.Bad(at, "is missing");
      return r.Bad(at, "is missing: \"" + std::string(shaped->name) + "\" and \"" +
                           std::string(f.name) + "\" go together");
    }
    switch (f.kind) {
      case CursorFieldKind::kInt: {
        THDPACK_ASSIGN_OR_RETURN(c.*f.value, r.Int(j, path, std::string(f.name).c_str()));
        break;
      }
      case CursorFieldKind::kInts: {
        if (!it->is_array()) return r.Bad(at, "must be a list of integers");
        std::vector<int64_t>& out = c.*f.values;
        for (size_t k = 0; k < it->size(); ++k) {
          const nlohmann::json& v = (*it)[k];
          if (!v.is_number_integer() ||
              (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
            return r.Bad(at + "[" + std::to_string(k) + "]", "must be an integer in int64");
          }
          out.push_back(v.get<int64_t>());
        }
        break;
      }
      case CursorFieldKind::kCursor: {
        THDPACK_ASSIGN_OR_RETURN(SourceCursor in, ParseCursorFields(r, *it, at, nesting + 1));
        c.parts.insert(c.parts.begin(), std::move(in));
        break;
      }
      case CursorFieldKind::kCursors: {
        if (!it->is_array()) return r.Bad(at, "must be a list of cursors");
        for (size_t d = 0; d < it->size(); ++d) {
          THDPACK_ASSIGN_OR_RETURN(
              SourceCursor p,
              ParseCursorFields(r, (*it)[d], at + "[" + std::to_string(d) + "]", nesting + 1));
          c.parts.push_back(std::move(p));
        }
        break;
      }
    }
  }
  return c;
}

Result<SourceCursor> ParseCursor(const Reader& r, const nlohmann::json& j,
                                 const std::string& path) {
  THDPACK_ASSIGN_OR_RETURN(SourceCursor c, ParseCursorFields(r, j, path, 1));
  if (Status s = CheckSourceCursor(c, path); !s.ok()) {
    return Status::Corruption(r.where() + ": " + s.message());
  }
  return c;
}

Status Differs(std::string_view what, const std::string& saved, const std::string& now,
               std::string_view why) {
  return Status::InvalidArgument("resume: the state was saved with " + std::string(what) + " " +
                                 saved + ", this run has " + std::string(what) + " " + now + " (" +
                                 std::string(why) + ")");
}

std::string Quote(const std::string& s) { return "\"" + s + "\""; }

}  // namespace

Result<DataFingerprint> MakeFingerprint(SampleSource* source, std::string_view spec,
                                        const SourceOptions& source_options,
                                        const ScheduleOptions& schedule) {
  DataFingerprint f;
  f.spec = std::string(spec);
  if (source != nullptr) {
    THDPACK_ASSIGN_OR_RETURN(f.source, SourceKindOf(spec));
    THDPACK_ASSIGN_OR_RETURN(f.identity, source->Identity());
    f.seed = source_options.seed;
    f.shuffle = source_options.shuffle;
    f.vocab_size = source_options.vocab_size;
    if (f.source == SourceKind::kBlend) {
      // Its sources' options are part of its identity.
      f.seed = 0;
      f.shuffle = false;
      f.vocab_size = 0;
    } else if (const std::optional<int64_t> drawn = source->drawn_samples()) {
      f.mock_samples = *drawn;
    }
  }
  f.oversize = std::string(OversizePolicyName(schedule.oversize));
  if (schedule.oversize != ScheduleOptions::OversizePolicy::kError) {
    THDPACK_ASSIGN_OR_RETURN(f.longest_kept, LongestKept(schedule));
  }
  return f;
}

Result<RunState> RunStateAt(const RunState& run, int64_t next_step, int64_t consumed) {
  if (next_step < 0 || consumed < 0) {
    return Status::InvalidArgument("run state at step " + std::to_string(next_step) + " after " +
                                   std::to_string(consumed) + " samples: both must be >= 0");
  }
  RunState s;
  s.next_step = next_step;
  s.consumed = consumed;
  s.data = run.data;
  return s;
}

static Status CheckOversize(const DataFingerprint& saved, const DataFingerprint& now);

Status CheckResume(const DataFingerprint& saved, const DataFingerprint& now) {
  if (saved.source != now.source) {
    return Differs("a source of kind",
                   Quote(std::string(SourceKindName(saved.source))) + " (" + saved.spec + ")",
                   Quote(std::string(SourceKindName(now.source))) + " (" + now.spec + ")",
                   "another data set gives other samples; resume with the data it was saved with");
  }
  if (saved.identity != now.identity && saved.source == SourceKind::kBlend) {
    // Name the first source of the list that differs (its weight, options or data).
    auto split = [](const std::string& text) {
      std::vector<std::string> parts;
      size_t at = text.find(": ");
      at = at == std::string::npos ? 0 : at + 2;
      while (at <= text.size()) {
        const size_t end = text.find("; [", at);
        parts.push_back(text.substr(at, end == std::string::npos ? std::string::npos : end - at));
        if (end == std::string::npos) break;
        at = end + 2;
      }
      return parts;
    };
    const std::vector<std::string> a = split(saved.identity);
    const std::vector<std::string> b = split(now.identity);
    if (a.size() != b.size()) {
      return Differs("a blend of", std::to_string(a.size()) + " sources",
                     std::to_string(b.size()) + " sources",
                     "the list of sources decides which samples come next: resume with the "
                     "blend it was saved with");
    }
    for (size_t d = 0; d < a.size(); ++d) {
      if (a[d] == b[d]) continue;
      return Differs("blend source", Quote(a[d]), Quote(b[d]),
                     "a source's weight, options or data decide which samples come next "
                     "(changing weights on resume repeats or skips samples): resume with the "
                     "blend it was saved with");
    }
    return Differs("a blend", Quote(saved.identity), Quote(now.identity),
                   "resume with the blend it was saved with");
  }
  if (saved.identity != now.identity) {
    return Differs("data", Quote(saved.identity) + " (" + saved.spec + ")",
                   Quote(now.identity) + " (" + now.spec + ")",
                   "the data changed: its samples and their order are no longer those the run "
                   "consumed; resume with the data it was saved with");
  }
  // A blend's sources carry their shuffle, seed, vocabulary and epoch size in its identity.
  if (saved.source == SourceKind::kBlend) return CheckOversize(saved, now);
  if (saved.shuffle != now.shuffle) {
    return Differs("shuffle", saved.shuffle ? "on" : "off", now.shuffle ? "on" : "off",
                   "the shuffle decides the order of every epoch: resume with the same --shuffle");
  }
  const bool seeded = saved.shuffle || MockTokens(saved.source);
  if (seeded && saved.seed != now.seed) {
    return Differs("seed", std::to_string(saved.seed), std::to_string(now.seed),
                   "the seed decides the shuffled order and the mock lengths and tokens: "
                   "resume with --seed " + std::to_string(saved.seed));
  }
  if (MockTokens(saved.source) && saved.vocab_size != now.vocab_size) {
    return Differs("vocab_size", std::to_string(saved.vocab_size), std::to_string(now.vocab_size),
                   "the vocabulary decides the mock tokens: resume with --vocab " +
                       std::to_string(saved.vocab_size));
  }
  if (saved.mock_samples != now.mock_samples) {
    return Differs("mock_samples", std::to_string(saved.mock_samples),
                   std::to_string(now.mock_samples),
                   "the samples of a mock epoch decide where every epoch ends: resume with "
                   "--mock-samples " + std::to_string(saved.mock_samples));
  }
  return CheckOversize(saved, now);
}

static Status CheckOversize(const DataFingerprint& saved, const DataFingerprint& now) {
  if (saved.oversize != now.oversize) {
    return Differs("oversize policy", Quote(saved.oversize), Quote(now.oversize),
                   "it decides which samples a step leaves out: resume with --oversize " +
                       saved.oversize);
  }
  if (saved.longest_kept != now.longest_kept) {
    return Differs("a longest kept sample (--oversize " + saved.oversize + ") of",
                   std::to_string(saved.longest_kept), std::to_string(now.longest_kept),
                   "under skip or truncate it decides which samples (or tokens) every later "
                   "step leaves out, so the steps would differ from an uninterrupted run; keep "
                   "CP x max tokens per rank (and the alignment) as saved, or use --oversize "
                   "error");
  }
  return Status::Ok();
}

std::string RunStateToJson(const RunState& state) {
  nlohmann::json j = Body(state);
  j["checksum"] = Checksum(j);
  return Dump(j);
}

Result<RunState> ParseRunState(std::string_view text, std::string_view where_text) {
  const Reader r{std::string(where_text)};
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(r.where() + ": not a JSON record (truncated or damaged: " +
                              e.what() + ")");
  }
  if (!j.is_object()) return Status::Corruption(r.where() + ": not a JSON object");
  THDPACK_ASSIGN_OR_RETURN(const std::string format, r.Str(j, "", "format"));
  if (format != kFormat) {
    return r.Bad("format", "= \"" + format + "\", expected \"" + std::string(kFormat) + "\"");
  }
  THDPACK_ASSIGN_OR_RETURN(const int64_t version, r.Int(j, "", "version"));
  if (version > kRunStateVersion) {
    return Status::Unimplemented(r.where() + ": version " + std::to_string(version) +
                                 " is newer than this thdpack reads (" +
                                 std::to_string(kRunStateVersion) + "); upgrade thdpack");
  }
  if (version < 1) return r.Bad("version", "= " + std::to_string(version) + " (versions start at 1)");
  THDPACK_ASSIGN_OR_RETURN(const std::string checksum, r.Str(j, "", "checksum"));
  THDPACK_RETURN_IF_ERROR(r.OnlyKnown(
      j, "", {"format", "version", "checksum", "next_step", "consumed", "cursor", "data"}));
  nlohmann::json body = j;
  body.erase("checksum");
  const std::string expected = Checksum(body);
  if (checksum != expected) {
    return r.Bad("checksum", "= " + checksum + " does not match the record's contents (" +
                                 expected + "): the state was edited or damaged");
  }
  RunState s;
  THDPACK_ASSIGN_OR_RETURN(s.next_step, r.Int(j, "", "next_step"));
  THDPACK_ASSIGN_OR_RETURN(s.consumed, r.Int(j, "", "consumed"));
  if (s.next_step < 0) return r.Bad("next_step", "= " + std::to_string(s.next_step) + " is negative");
  if (s.consumed < 0) return r.Bad("consumed", "= " + std::to_string(s.consumed) + " is negative");
  THDPACK_ASSIGN_OR_RETURN(const nlohmann::json* data, r.Get(j, "", "data"));
  if (!data->is_object()) return r.Bad("data", "must be an object");
  THDPACK_RETURN_IF_ERROR(r.OnlyKnown(*data, "data",
                                      {"source", "spec", "identity", "seed", "shuffle",
                                       "vocab_size", "mock_samples", "oversize", "longest_kept"}));
  DataFingerprint& d = s.data;
  THDPACK_ASSIGN_OR_RETURN(const std::string kind, r.Str(*data, "data", "source"));
  if (Result<SourceKind> k = SourceKindFromName(kind); k.ok()) {
    d.source = *k;
  } else {
    return r.Bad("data.source", "= \"" + kind + "\" is not a source kind (mock, lengths, "
                                "histogram, jsonl, megatron, blend, fed, parquet or arrow)");
  }
  THDPACK_ASSIGN_OR_RETURN(d.spec, r.Str(*data, "data", "spec"));
  THDPACK_ASSIGN_OR_RETURN(d.identity, r.Str(*data, "data", "identity"));
  THDPACK_ASSIGN_OR_RETURN(d.seed, r.Uint(*data, "data", "seed"));
  THDPACK_ASSIGN_OR_RETURN(d.shuffle, r.Bool(*data, "data", "shuffle"));
  THDPACK_ASSIGN_OR_RETURN(d.vocab_size, r.Int(*data, "data", "vocab_size"));
  THDPACK_ASSIGN_OR_RETURN(d.mock_samples, r.Int(*data, "data", "mock_samples"));
  THDPACK_ASSIGN_OR_RETURN(d.oversize, r.Str(*data, "data", "oversize"));
  THDPACK_ASSIGN_OR_RETURN(d.longest_kept, r.Int(*data, "data", "longest_kept"));
  if (!ParseOversizePolicy(d.oversize).ok()) {
    return r.Bad("data.oversize",
                 "= \"" + d.oversize + "\" is not error, skip, truncate or split");
  }
  if ((d.oversize != "error") != (d.longest_kept >= 1) ||
      (d.oversize == "error" && d.longest_kept != -1)) {
    return r.Bad("data.longest_kept", "= " + std::to_string(d.longest_kept) +
                                          " does not go with oversize \"" + d.oversize +
                                          "\" (>= 1 with skip or truncate, -1 with error)");
  }
  THDPACK_ASSIGN_OR_RETURN(const nlohmann::json* cursor, r.Get(j, "", "cursor"));
  if (!cursor->is_null()) {
    if (!cursor->is_object()) return r.Bad("cursor", "must be an object or null");
    if (d.source == SourceKind::kFed) {
      return r.Bad("cursor", "is set, but the data is fed by the caller (it has no cursor)");
    }
    THDPACK_ASSIGN_OR_RETURN(SourceCursor c, ParseCursor(r, *cursor, "cursor"));
    if (c.samples() != s.consumed) {
      return r.Bad("consumed", "= " + std::to_string(s.consumed) + ", but the cursor has " +
                                   std::to_string(c.samples()) + " samples behind it (next_id " +
                                   std::to_string(c.next_id) + " - skipped_empty " +
                                   std::to_string(c.skipped_empty) + ")");
    }
    s.cursor = c;
  }
  return s;
}

Status WriteRunStateFile(const std::string& path, const RunState& state) {
  const std::string text = RunStateToJson(state) + "\n";
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto fail = [&](const char* what) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return Status::IOError("run state " + path + ": cannot " + what + " (" + why + ")");
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail("create its temporary file");
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      return fail("write");
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) return fail("close");
  return internal::PublishFile(tmp, path).WithContext("run state " + path);
}

Result<RunState> ReadRunStateFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::IOError("run state " + path + ": cannot open (" + std::strerror(errno) + ")");
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::IOError("run state " + path + ": cannot read");
  return ParseRunState(text, "run state " + path);
}

}  // namespace thdpack
