// The `blend:` source (thdpack/blend.h): its config, and the stream of its sources' samples in
// the order Megatron's rule gives.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <utility>

#include "data/data_internal.h"
#include "thdpack/blend.h"

namespace thdpack {

std::string_view BlendWeightByName(BlendWeightBy by) {
  return by == BlendWeightBy::kTokens ? "tokens" : "samples";
}

namespace {

bool IsBlendSpec(std::string_view spec) {
  const Result<SourceKind> kind = SourceKindOf(spec);
  return kind.ok() && *kind == SourceKind::kBlend;
}

}  // namespace

namespace {

constexpr size_t kMaxBlendSources = size_t{1} << 20;

std::string Field(std::string_view name, size_t i, std::string_view field) {
  return std::string(name) + ": sources[" + std::to_string(i) + "]" +
         (field.empty() ? std::string() : "." + std::string(field));
}

// "kind:path" with a relative path, resolved against base_dir.
std::string Resolve(const std::string& spec, std::string_view base_dir) {
  const size_t colon = spec.find(':');
  if (colon == std::string::npos || base_dir.empty()) return spec;
  const std::filesystem::path path(spec.substr(colon + 1));
  if (path.empty() || path.is_absolute()) return spec;
  return spec.substr(0, colon + 1) + (std::filesystem::path(base_dir) / path).string();
}

class BlendSource final : public SampleSource {
 public:
  BlendSource(std::string spec, BlendConfig config, std::vector<SourceOptions> options,
              std::vector<std::unique_ptr<SampleSource>> sources, LargestErrorRule rule)
      : spec_(std::move(spec)),
        config_(std::move(config)),
        options_(std::move(options)),
        sources_(std::move(sources)),
        rule_(std::move(rule)) {}

  Result<std::optional<Sample>> Next() override {
    if (!error_.ok()) return error_;
    const int d = rule_.Next();
    Sample sample;
    Result<SampleLength> got = Pull(*sources_[static_cast<size_t>(d)], d, &sample);
    if (!got.ok()) return error_ = got.status();
    Take(d, got->length);
    sample.id = next_id_++;
    sample.source = d;
    return std::optional<Sample>(std::move(sample));
  }

  Result<std::optional<SampleLength>> NextLength() override {
    if (!error_.ok()) return error_;
    const int d = rule_.Next();
    Result<SampleLength> got = Pull(*sources_[static_cast<size_t>(d)], d, nullptr);
    if (!got.ok()) return error_ = got.status();
    Take(d, got->length);
    SampleLength out = *got;
    out.id = next_id_++;
    out.source = d;
    return std::optional<SampleLength>(out);
  }

  // A blend has no end: nothing to rewind.
  Status Reset() override { return error_; }
  std::optional<int64_t> size_hint() const override { return std::nullopt; }
  int64_t epoch() const override { return 0; }
  const std::string& spec() const override { return spec_; }
  bool endless() const override { return true; }
  int64_t skipped_empty() const override {
    int64_t n = 0;
    for (const auto& s : sources_) n += s->skipped_empty();
    return n;
  }

  SourceCursor cursor() const override {
    SourceCursor c;
    c.position = next_id_;
    c.next_id = next_id_;
    for (const auto& s : sources_) c.parts.push_back(s->cursor());
    c.taken = rule_.counts();
    return c;
  }

  Status Seek(const SourceCursor& c) override {
    if (!error_.ok()) return error_;
    auto bad = [&](const std::string& field, const std::string& rule) {
      return Status::Corruption(spec_ + ": cursor field \"" + field + "\" " + rule);
    };
    const size_t n = sources_.size();
    if (c.parts.size() != n || c.taken.size() != n) {
      return bad("parts", "holds " + std::to_string(c.parts.size()) + " cursors and " +
                              std::to_string(c.taken.size()) + " counts, the blend has " +
                              std::to_string(n) + " sources");
    }
    if (c.epoch != 0 || c.skipped_empty != 0 || c.byte_offset != 0 || c.line != 0 ||
        c.epoch_size != -1) {
      return bad("epoch", "= " + std::to_string(c.epoch) +
                              " (a blend's own cursor has epoch 0, no empty documents, no "
                              "byte offset and no epoch size)");
    }
    int64_t samples = 0;
    int64_t units = 0;
    for (size_t d = 0; d < n; ++d) {
      const int64_t part = c.parts[d].samples();
      if (config_.weight_by == BlendWeightBy::kSamples && c.taken[d] != part) {
        return bad("taken", "[" + std::to_string(d) + "] = " + std::to_string(c.taken[d]) +
                                ", but parts[" + std::to_string(d) + "] has " +
                                std::to_string(part) + " samples behind it (by samples the two "
                                "are equal)");
      }
      if (c.taken[d] < part) {
        return bad("taken", "[" + std::to_string(d) + "] = " + std::to_string(c.taken[d]) +
                                " tokens for " + std::to_string(part) + " samples");
      }
      samples += part;
      units += c.taken[d];
    }
    if (c.position != samples || c.next_id != samples) {
      return bad("position", "= " + std::to_string(c.position) + " (next_id " +
                                 std::to_string(c.next_id) + "), but the sources' cursors hold " +
                                 std::to_string(samples) + " samples");
    }
    auto rule = LargestErrorRule::Create(rule_.weights(), c.taken, units);
    if (!rule.ok()) return bad("taken", rule.status().message());
    for (size_t d = 0; d < n; ++d) {
      Status s = sources_[d]->Seek(c.parts[d]);
      if (!s.ok()) return error_ = s.WithContext(Field(spec_, d, "") + " (parts[" +
                                                 std::to_string(d) + "])");
    }
    rule_ = std::move(*rule);
    next_id_ = samples;
    return Status::Ok();
  }

  // By samples the rule alone gives the counts, and each source computes its own cursor after
  // them (O(1) each); by tokens the lengths decide, so fresh copies of the sources are read.
  Result<SourceCursor> CursorAfter(int64_t samples) override {
    if (!error_.ok()) return error_;
    if (samples < 0) {
      return Status::OutOfRange(spec_ + ": a cursor after " + std::to_string(samples) +
                                " samples (must be >= 0)");
    }
    THDPACK_ASSIGN_OR_RETURN(LargestErrorRule rule, LargestErrorRule::Create(rule_.weights()));
    const size_t n = sources_.size();
    SourceCursor c;
    c.position = samples;
    c.next_id = samples;
    if (config_.weight_by == BlendWeightBy::kSamples) {
      for (int64_t i = 0; i < samples; ++i) rule.Take(rule.Next(), 1);
      for (size_t d = 0; d < n; ++d) {
        Result<SourceCursor> part = sources_[d]->CursorAfter(rule.counts()[d]);
        if (!part.ok()) return part.status().WithContext(Field(spec_, d, ""));
        c.parts.push_back(std::move(*part));
      }
    } else {
      std::vector<std::unique_ptr<SampleSource>> fresh(n);
      for (size_t d = 0; d < n; ++d) {
        Result<std::unique_ptr<SampleSource>> s =
            OpenSource(config_.sources[d].data, options_[d]);
        if (!s.ok()) return s.status().WithContext(Field(spec_, d, ""));
        fresh[d] = std::move(*s);
      }
      for (int64_t i = 0; i < samples; ++i) {
        const int d = rule.Next();
        THDPACK_ASSIGN_OR_RETURN(SampleLength got,
                                 Pull(*fresh[static_cast<size_t>(d)], d, nullptr));
        rule.Take(d, got.length);
      }
      for (size_t d = 0; d < n; ++d) c.parts.push_back(fresh[d]->cursor());
    }
    c.taken = rule.counts();
    return c;
  }

  Result<SourceCursor> CursorAtEpoch(int64_t epoch) override {
    if (epoch != 0) {
      return Status::Unimplemented(spec_ + ": a blend has no epochs (its sources have theirs); "
                                   "epoch " + std::to_string(epoch) + " does not exist");
    }
    return CursorAfter(0);
  }

  // Per source: its weight as given, its options and its own identity.
  Result<std::string> Identity() override {
    if (!identity_.empty()) return identity_;
    std::string text = "blend by " + std::string(BlendWeightByName(config_.weight_by)) + " of " +
                       std::to_string(sources_.size()) + " sources: ";
    for (size_t d = 0; d < sources_.size(); ++d) {
      Result<std::string> id = sources_[d]->Identity();
      if (!id.ok()) return id.status().WithContext(Field(spec_, d, ""));
      const SourceOptions& o = options_[d];
      text += (d ? "; " : "") + std::string("[") + std::to_string(d) + "] weight " +
              nlohmann::json(config_.sources[d].weight).dump() + " shuffle " +
              (o.shuffle ? "on" : "off") + " seed " + std::to_string(o.seed) + " vocab " +
              std::to_string(o.vocab_size) + " mock_samples " +
              std::to_string(o.mock_num_samples) + ": " + *id;
    }
    identity_ = std::move(text);
    return identity_;
  }

 private:
  // The next sample (whole when `full`) of source d, which starts its next epoch when it runs
  // out.
  Result<SampleLength> Pull(SampleSource& source, int d, Sample* full) {
    for (int pass = 0; pass < 2; ++pass) {
      if (full != nullptr) {
        Result<std::optional<Sample>> s = source.Next();
        if (!s.ok()) return s.status().WithContext(Field(spec_, static_cast<size_t>(d), ""));
        if (s->has_value()) {
          *full = std::move(**s);
          return SampleLength{full->id, static_cast<int64_t>(full->tokens.size()),
                              NumTargets(*full), 0};
        }
      } else {
        Result<std::optional<SampleLength>> s = source.NextLength();
        if (!s.ok()) return s.status().WithContext(Field(spec_, static_cast<size_t>(d), ""));
        if (s->has_value()) return **s;
      }
      Status reset = source.Reset();
      if (!reset.ok()) return reset.WithContext(Field(spec_, static_cast<size_t>(d), ""));
    }
    return Status::InvalidArgument(Field(spec_, static_cast<size_t>(d), "") + " (" +
                                   source.spec() + ") holds no samples");
  }

  void Take(int d, int64_t length) {
    rule_.Take(d, config_.weight_by == BlendWeightBy::kTokens ? length : 1);
  }

  std::string spec_;
  BlendConfig config_;
  std::vector<SourceOptions> options_;  // [D]: each source's
  std::vector<std::unique_ptr<SampleSource>> sources_;
  LargestErrorRule rule_;
  int64_t next_id_ = 0;
  Status error_;
  std::string identity_;
};

}  // namespace

Result<BlendConfig> ParseBlendConfig(std::string_view json, std::string_view name,
                                     std::string_view base_dir) {
  const std::string where(name);
  THDPACK_RETURN_IF_ERROR(data_internal::CheckJsonText(json, where, "blend"));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json.begin(), json.end());
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(where + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) return Status::InvalidArgument(where + ": expected a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key != "sources" && key != "weight_by") {
      return Status::InvalidArgument(where + ": unknown field \"" + key +
                                     "\" (a blend has \"sources\" and \"weight_by\")");
    }
  }
  BlendConfig config;
  if (const auto by = j.find("weight_by"); by != j.end()) {
    if (!by->is_string() || (*by != "samples" && *by != "tokens")) {
      return Status::InvalidArgument(where + ": field \"weight_by\" = " + by->dump() +
                                     " is not \"samples\" or \"tokens\"");
    }
    config.weight_by = *by == "tokens" ? BlendWeightBy::kTokens : BlendWeightBy::kSamples;
  }
  const auto sources = j.find("sources");
  if (sources == j.end() || !sources->is_array() || sources->empty()) {
    return Status::InvalidArgument(where + ": field \"sources\" must be a non-empty list of "
                                   "{\"data\": ..., \"weight\": ...}");
  }
  if (sources->size() > kMaxBlendSources) {
    return Status::InvalidArgument(where + ": " + std::to_string(sources->size()) +
                                   " sources (at most 2^20)");
  }
  for (size_t i = 0; i < sources->size(); ++i) {
    const nlohmann::json& e = (*sources)[i];
    if (!e.is_object()) {
      return Status::InvalidArgument(Field(where, i, "") + " must be an object with \"data\" "
                                     "and \"weight\"");
    }
    for (const auto& [key, value] : e.items()) {
      if (key != "data" && key != "weight" && key != "shuffle" && key != "seed") {
        return Status::InvalidArgument(Field(where, i, key) + ": unknown field (a source has "
                                       "data, weight, shuffle and seed)");
      }
    }
    BlendEntry entry;
    const auto data = e.find("data");
    if (data == e.end() || !data->is_string() || data->get<std::string>().empty()) {
      return Status::InvalidArgument(Field(where, i, "data") + " must be a source spec (a "
                                     "non-empty string)");
    }
    entry.data = data->get<std::string>();
    if (IsBlendSpec(entry.data)) {
      return Status::InvalidArgument(Field(where, i, "data") + " = \"" + data_internal::Excerpt(entry.data) +
                                     "\": a blend inside a blend is not supported (list its "
                                     "sources here, with their weights multiplied)");
    }
    entry.data = Resolve(entry.data, base_dir);
    const auto weight = e.find("weight");
    if (weight == e.end() || !weight->is_number()) {
      return Status::InvalidArgument(Field(where, i, "weight") + " must be a number > 0");
    }
    entry.weight = weight->get<double>();
    if (!(entry.weight > 0) || !std::isfinite(entry.weight)) {
      return Status::InvalidArgument(Field(where, i, "weight") + " = " + weight->dump() +
                                     ": a weight is a finite number > 0");
    }
    if (const auto sh = e.find("shuffle"); sh != e.end()) {
      if (!sh->is_boolean()) {
        return Status::InvalidArgument(Field(where, i, "shuffle") + " must be true or false");
      }
      entry.shuffle = sh->get<bool>();
    }
    if (const auto seed = e.find("seed"); seed != e.end()) {
      if (!seed->is_number_unsigned() && !(seed->is_number_integer() && seed->get<int64_t>() >= 0)) {
        return Status::InvalidArgument(Field(where, i, "seed") + " = " + seed->dump() +
                                       " must be an unsigned integer");
      }
      entry.seed = seed->get<uint64_t>();
    }
    config.sources.push_back(std::move(entry));
  }
  return config;
}

Result<BlendConfig> ReadBlendSpec(std::string_view text) {
  if (!text.empty() && text.front() == '{') return ParseBlendConfig(text, "inline blend", "");
  const std::string path(text);
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError(data_internal::ErrnoText("cannot open", path));
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::IOError(data_internal::ErrnoText("cannot read", path));
  std::string_view body = json;
  data_internal::StripBom(&body);
  return ParseBlendConfig(body, path, std::filesystem::path(path).parent_path().string());
}

Result<std::unique_ptr<SampleSource>> OpenBlendSource(const BlendConfig& config,
                                                      const SourceOptions& options,
                                                      std::string spec) {
  if (config.sources.empty()) return Status::InvalidArgument(spec + ": no sources");
  std::vector<SourceOptions> per(config.sources.size(), options);
  std::vector<std::unique_ptr<SampleSource>> sources;
  std::vector<double> weights;
  for (size_t d = 0; d < config.sources.size(); ++d) {
    const BlendEntry& e = config.sources[d];
    if (e.shuffle) per[d].shuffle = *e.shuffle;
    if (e.seed) per[d].seed = *e.seed;
    if (IsBlendSpec(e.data)) {
      return Status::InvalidArgument(Field(spec, d, "data") + ": a blend inside a blend is not "
                                     "supported");
    }
    Result<std::unique_ptr<SampleSource>> s = OpenSource(e.data, per[d]);
    if (!s.ok()) return s.status().WithContext(Field(spec, d, "") + " (" + e.data + ")");
    sources.push_back(std::move(*s));
    weights.push_back(e.weight);
  }
  THDPACK_ASSIGN_OR_RETURN(LargestErrorRule rule,
                           LargestErrorRule::Create(NormalizeWeights(weights)));
  return std::unique_ptr<SampleSource>(new BlendSource(std::move(spec), config, std::move(per),
                                                       std::move(sources), std::move(rule)));
}

}  // namespace thdpack
