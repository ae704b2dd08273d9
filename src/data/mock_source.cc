// The `mock` sources: Megatron's mock SFT config (lognormal draw or lengths file) with
// pseudo-random tokens that any rank can regenerate from (seed, id).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/hash64.h"
#include "data/data_internal.h"
#include "thdpack/data.h"

namespace thdpack {

using data_internal::IndexedSource;
using data_internal::Mix64;
using data_internal::SplitMix64;

namespace {

// Stream constants: lengths and tokens of the same (seed, index) must not be correlated.
constexpr uint64_t kTokenStream = 0x544F4B454E53ULL;   // "TOKENS"
constexpr uint64_t kLengthStream = 0x4C454E475448ULL;  // "LENGTH"

class MockDistributionSource final : public IndexedSource<SampleSource> {
 public:
  MockDistributionSource(std::string spec, int64_t size, const MockConfig& config,
                         const SourceOptions& options)
      : IndexedSource(std::move(spec), size, options), config_(config) {}

 protected:
  Result<SampleLength> LengthAt(int64_t index) const override {
    const int64_t length = MockLength(config_, options().seed, index);
    return SampleLength{0, length, length - 1};
  }
  Status LengthsAt(int64_t first, std::span<SampleLength> out) const override {
    for (size_t k = 0; k < out.size(); ++k) {
      const int64_t length = MockLength(config_, options().seed, first + static_cast<int64_t>(k));
      out[k] = SampleLength{0, length, length - 1};
    }
    return Status::Ok();
  }
  Status FillAt(int64_t index, int64_t id, Sample* out) const override {
    FillMock(id, MockLength(config_, options().seed, index), out);
    return Status::Ok();
  }
  // Drawn from the options: the epoch size is theirs (SourceOptions::mock_num_samples).
  std::optional<int64_t> drawn_samples() const override { return size_hint(); }
  // The draw's parameters, doubles in shortest round-trip form (the seed and the epoch size
  // are fingerprinted beside it).
  Result<std::string> ComputeIdentity() const override {
    return "mock lognormal min_seq_len " + std::to_string(config_.min_seq_len) +
           " max_seq_len " + std::to_string(config_.max_seq_len) + " mean_seq_len " +
           nlohmann::json(config_.mean_seq_len).dump() + " lognormal_sigma " +
           nlohmann::json(config_.lognormal_sigma).dump();
  }

 private:
  MockConfig config_;
};

class LengthsVectorSource final : public IndexedSource<SampleSource> {
 public:
  LengthsVectorSource(std::string spec, std::vector<int32_t> lengths, const SourceOptions& options)
      : IndexedSource(std::move(spec), static_cast<int64_t>(lengths.size()), options),
        lengths_(std::move(lengths)) {}

 protected:
  Result<SampleLength> LengthAt(int64_t index) const override {
    const int64_t length = lengths_[static_cast<size_t>(index)];
    return SampleLength{0, length, length - 1};
  }
  Status LengthsAt(int64_t first, std::span<SampleLength> out) const override {
    const int32_t* lengths = lengths_.data() + first;
    for (size_t k = 0; k < out.size(); ++k) {
      const int64_t length = lengths[k];
      out[k] = SampleLength{0, length, length - 1};
    }
    return Status::Ok();
  }
  Status FillAt(int64_t index, int64_t id, Sample* out) const override {
    FillMock(id, lengths_[static_cast<size_t>(index)], out);
    return Status::Ok();
  }
  Result<std::string> ComputeIdentity() const override {
    const auto bytes = std::as_bytes(std::span<const int32_t>(lengths_));
    return "lengths " + std::to_string(lengths_.size()) + " hash " +
           internal::Hex64(internal::Hash64(std::span<const uint8_t>(
               reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size())));
  }

 private:
  std::vector<int32_t> lengths_;
};

std::string FieldError(std::string_view name, std::string_view field, std::string_view rule) {
  std::string out(name);
  out += ": field \"";
  out += field;
  out += "\" ";
  out += rule;
  return out;
}

// A required integer field (JSON integer, or a float with an integral value).
Result<int64_t> IntField(const nlohmann::json& j, std::string_view name, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return Status::InvalidArgument(FieldError(name, field, "is missing"));
  if (it->is_number_integer()) {
    if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Status::InvalidArgument(FieldError(name, field, "is too large"));
    }
    return it->get<int64_t>();
  }
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.0e15) {
      return static_cast<int64_t>(v);
    }
    return Status::InvalidArgument(FieldError(name, field, "must be an integer, got " + it->dump()));
  }
  return Status::InvalidArgument(
      FieldError(name, field, std::string("must be an integer, got ") + it->type_name()));
}

Result<double> NumberField(const nlohmann::json& j, std::string_view name, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return Status::InvalidArgument(FieldError(name, field, "is missing"));
  if (!it->is_number()) {
    return Status::InvalidArgument(
        FieldError(name, field, std::string("must be a number, got ") + it->type_name()));
  }
  const double v = it->get<double>();
  if (!std::isfinite(v)) return Status::InvalidArgument(FieldError(name, field, "must be finite"));
  return v;
}

Result<std::string> StringField(const nlohmann::json& j, std::string_view name, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return Status::InvalidArgument(FieldError(name, field, "is missing"));
  if (!it->is_string()) {
    return Status::InvalidArgument(
        FieldError(name, field, std::string("must be a string, got ") + it->type_name()));
  }
  return it->get<std::string>();
}

Result<MockConfig> ParseMockConfigJson(const nlohmann::json& j, std::string_view name,
                                       std::string_view base_dir) {
  if (!j.is_object()) {
    return Status::InvalidArgument(std::string(name) + ": a mock config must be a JSON object, got " +
                                   j.type_name());
  }
  MockConfig c;
  THDPACK_ASSIGN_OR_RETURN(std::string mode, StringField(j, name, "mode"));
  if (mode == "file") {
    c.mode = MockConfig::Mode::kFile;
    THDPACK_ASSIGN_OR_RETURN(std::string path, StringField(j, name, "path"));
    if (path.empty()) return Status::InvalidArgument(FieldError(name, "path", "is empty"));
    std::filesystem::path p(path);
    if (p.is_relative() && !base_dir.empty()) p = std::filesystem::path(base_dir) / p;
    c.path = p.string();
    return c;
  }
  if (mode != "distribution") {
    return Status::InvalidArgument(
        FieldError(name, "mode", "must be \"distribution\" or \"file\", got \"" + mode + "\""));
  }
  c.mode = MockConfig::Mode::kDistribution;
  THDPACK_ASSIGN_OR_RETURN(std::string type, StringField(j, name, "type"));
  if (type != "lognormal") {
    return Status::InvalidArgument(
        FieldError(name, "type", "must be \"lognormal\" (the only distribution), got \"" + type + "\""));
  }
  THDPACK_ASSIGN_OR_RETURN(c.min_seq_len, IntField(j, name, "min_seq_len"));
  THDPACK_ASSIGN_OR_RETURN(c.max_seq_len, IntField(j, name, "max_seq_len"));
  THDPACK_ASSIGN_OR_RETURN(c.mean_seq_len, NumberField(j, name, "mean_seq_len"));
  THDPACK_ASSIGN_OR_RETURN(c.lognormal_sigma, NumberField(j, name, "lognormal_sigma"));
  if (c.min_seq_len < 1) {
    return Status::InvalidArgument(
        FieldError(name, "min_seq_len", "must be >= 1, got " + std::to_string(c.min_seq_len)));
  }
  if (c.max_seq_len > kMaxSampleLength) {
    return Status::InvalidArgument(FieldError(
        name, "max_seq_len", "must be <= 2147483647, got " + std::to_string(c.max_seq_len)));
  }
  if (c.min_seq_len > c.max_seq_len) {
    return Status::InvalidArgument(
        FieldError(name, "min_seq_len", "must be <= max_seq_len (" + std::to_string(c.min_seq_len) +
                                            " > " + std::to_string(c.max_seq_len) + ")"));
  }
  if (!(c.mean_seq_len > 0)) {
    return Status::InvalidArgument(FieldError(name, "mean_seq_len", "must be > 0"));
  }
  if (c.lognormal_sigma < 0) {
    return Status::InvalidArgument(FieldError(name, "lognormal_sigma", "must be >= 0"));
  }
  return c;
}

}  // namespace

Result<MockConfig> ParseMockConfig(std::string_view json_text, std::string_view name,
                                   std::string_view base_dir) {
  data_internal::StripBom(&json_text);
  THDPACK_RETURN_IF_ERROR(data_internal::CheckJsonText(json_text, name, "file"));
  try {
    const nlohmann::json j = nlohmann::json::parse(json_text.begin(), json_text.end());
    return ParseMockConfigJson(j, name, base_dir);
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(std::string(name) + ": not valid JSON: " + e.what());
  }
}

Result<MockConfig> ReadMockConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError(data_internal::ErrnoText("cannot open", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::IOError(data_internal::ErrnoText("cannot read", path));
  const std::string base_dir = std::filesystem::path(path).parent_path().string();
  return ParseMockConfig(text.str(), path, base_dir);
}

int64_t MockLength(const MockConfig& config, uint64_t seed, int64_t index) {
  SplitMix64 rng(Mix64(seed ^ kLengthStream) ^ Mix64(static_cast<uint64_t>(index)));
  // Box-Muller: one standard normal from two uniforms (u1 in (0,1] keeps log finite).
  const double u1 = rng.NextUnitOpenZero();
  const double u2 = rng.NextUnitOpenZero();
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
  const double s = config.lognormal_sigma;
  const double mu = std::log(config.mean_seq_len) - 0.5 * s * s;
  double x = std::exp(mu + s * z);
  const double lo = static_cast<double>(config.min_seq_len);
  const double hi = static_cast<double>(config.max_seq_len);
  if (!(x >= lo)) x = lo;  // also catches NaN
  if (x > hi) x = hi;
  return static_cast<int64_t>(x);
}

void FillMockTokens(uint64_t seed, int64_t id, int64_t vocab, std::span<TokenId> out) {
  SplitMix64 rng(Mix64(seed ^ kTokenStream) ^ Mix64(static_cast<uint64_t>(id)));
  const uint64_t v = static_cast<uint64_t>(vocab);
  for (TokenId& t : out) {
    // Multiply-shift maps 32 random bits onto [0, vocab) (bias below 2^-32 * vocab).
    t = static_cast<TokenId>(((rng.Next() >> 32) * v) >> 32);
  }
}

std::vector<TokenId> MockTokens(uint64_t seed, int64_t id, int64_t length, int64_t vocab) {
  std::vector<TokenId> out(static_cast<size_t>(length));
  FillMockTokens(seed, id, vocab, out);
  return out;
}

namespace data_internal {

Result<std::unique_ptr<SampleSource>> MakeLengthsVectorSource(std::string spec,
                                                              std::vector<int32_t> lengths,
                                                              const SourceOptions& options) {
  if (lengths.empty()) {
    return Status::InvalidArgument(spec + ": holds no lengths (a source needs at least one sample)");
  }
  return std::unique_ptr<SampleSource>(
      new LengthsVectorSource(std::move(spec), std::move(lengths), options));
}

}  // namespace data_internal

Result<std::unique_ptr<SampleSource>> OpenMockSource(const MockConfig& config,
                                                     const SourceOptions& options,
                                                     std::string spec) {
  THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec, options));
  if (config.mode == MockConfig::Mode::kFile) {
    THDPACK_ASSIGN_OR_RETURN(std::vector<int32_t> lengths,
                             ReadLengthsFile(config.path, /*allow_header=*/true));
    return data_internal::MakeLengthsVectorSource(std::move(spec), std::move(lengths), options);
  }
  if (config.min_seq_len < 1 || config.min_seq_len > config.max_seq_len ||
      config.max_seq_len > kMaxSampleLength || !(config.mean_seq_len > 0) ||
      !std::isfinite(config.mean_seq_len) || !(config.lognormal_sigma >= 0) ||
      !std::isfinite(config.lognormal_sigma)) {
    return Status::InvalidArgument(spec +
                                   ": invalid mock config (need 1 <= min_seq_len <= max_seq_len "
                                   "<= 2^31-1, mean_seq_len > 0, lognormal_sigma >= 0)");
  }
  const int64_t size =
      options.mock_num_samples == 0 ? kDefaultMockNumSamples : options.mock_num_samples;
  return std::unique_ptr<SampleSource>(
      new MockDistributionSource(std::move(spec), size, config, options));
}

}  // namespace thdpack
