// OpenSource: the spec-string factory the command line uses; SampleSource's default batched
// read.
#include "data/data_internal.h"
#include "thdpack/arrow.h"
#include "thdpack/blend.h"
#include "thdpack/data.h"

#include <new>

namespace thdpack {

Result<int64_t> SampleSource::NextLengths(std::span<SampleLength> out) {
  int64_t n = 0;
  for (SampleLength& slot : out) {
    THDPACK_ASSIGN_OR_RETURN(std::optional<SampleLength> next, NextLength());
    if (!next.has_value()) break;
    slot = *next;
    ++n;
  }
  return n;
}

SourceCursor SampleSource::cursor() const {
  SourceCursor c;
  c.epoch = epoch();
  c.skipped_empty = skipped_empty();
  return c;
}

namespace {
Status CannotSeek(const SampleSource& source) {
  return Status::Unimplemented("data source " + source.spec() + " cannot resume (it has no cursor)");
}
}  // namespace

Status SampleSource::Seek(const SourceCursor&) { return CannotSeek(*this); }
Result<SourceCursor> SampleSource::CursorAfter(int64_t) { return CannotSeek(*this); }
Result<SourceCursor> SampleSource::CursorAtEpoch(int64_t) { return CannotSeek(*this); }
Result<std::string> SampleSource::Identity() { return CannotSeek(*this); }

namespace {
constexpr std::pair<SourceKind, std::string_view> kKindNames[] = {
    {SourceKind::kMock, "mock"},         {SourceKind::kLengths, "lengths"},
    {SourceKind::kHistogram, "histogram"}, {SourceKind::kJsonl, "jsonl"},
    {SourceKind::kMegatron, "megatron"}, {SourceKind::kBlend, "blend"},
    {SourceKind::kFed, "fed"},           {SourceKind::kParquet, "parquet"},
    {SourceKind::kArrow, "arrow"}};
}  // namespace

std::string_view SourceKindName(SourceKind kind) {
  for (const auto& [k, name] : kKindNames) {
    if (k == kind) return name;
  }
  return "unknown";
}

Result<SourceKind> SourceKindFromName(std::string_view name) {
  for (const auto& [k, n] : kKindNames) {
    if (n == name) return k;
  }
  return Status::InvalidArgument("source kind \"" + std::string(name) +
                                 "\": expected mock, lengths, histogram, jsonl, megatron, "
                                 "blend, fed, parquet or arrow");
}

std::string_view SourcePathOf(std::string_view spec) {
  const size_t colon = spec.find(':');
  return colon == std::string_view::npos ? std::string_view() : spec.substr(colon + 1);
}

Result<SourceKind> SourceKindOf(std::string_view spec) {
  if (spec == "mock") return SourceKind::kMock;
  const size_t colon = spec.find(':');
  const std::string_view kind = spec.substr(0, colon);
  Result<SourceKind> k = SourceKindFromName(kind);
  if (!k.ok() || *k == SourceKind::kFed) {
    return Status::InvalidArgument("unknown data source \"" + std::string(spec) +
                                   "\" (expected mock, mock:FILE.json, lengths:FILE, "
                                   "histogram:FILE, jsonl:FILE, megatron:PREFIX, "
                                   "blend:FILE.json, parquet:PATH or arrow:PATH)");
  }
  if (SourcePathOf(spec).empty()) {
    return Status::InvalidArgument("data source \"" + std::string(spec) +
                                   "\" needs a path after \"" + std::string(kind) + ":\"");
  }
  return *k;
}

namespace {

Result<std::unique_ptr<SampleSource>> OpenSourceUnguarded(std::string_view spec,
                                                          const SourceOptions& options) {
  const std::string spec_text(spec);
  THDPACK_ASSIGN_OR_RETURN(const SourceKind kind, SourceKindOf(spec));
  if (!options.fields.empty() && kind != SourceKind::kParquet && kind != SourceKind::kArrow &&
      kind != SourceKind::kBlend) {
    return Status::InvalidArgument(
        "data source " + spec_text + ": field '" + options.fields[0].name + "' declared, but " +
        std::string(SourceKindName(kind)) + " samples carry no fields (columnar sources - " +
        "parquet:, arrow: - read them from their columns; or feed the samples)");
  }
  if (spec == "mock") return OpenMockSource(kDefaultMockConfig, options, spec_text);
  const std::string path(SourcePathOf(spec));
  switch (kind) {
    case SourceKind::kMock: {
      THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec_text, options));
      THDPACK_ASSIGN_OR_RETURN(MockConfig config, ReadMockConfigFile(path));
      return OpenMockSource(config, options, spec_text);
    }
    case SourceKind::kLengths:
      return OpenLengthsSource(path, options);
    case SourceKind::kHistogram: {
      THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<HistogramSource> h,
                               OpenHistogramSource(path, options));
      return std::unique_ptr<SampleSource>(std::move(h));
    }
    case SourceKind::kJsonl:
      return OpenJsonlSource(path, options);
    case SourceKind::kBlend: {
      THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec_text, options));
      THDPACK_ASSIGN_OR_RETURN(BlendConfig config, ReadBlendSpec(path));
      return OpenBlendSource(config, options, spec_text);
    }
    case SourceKind::kMegatron:
      return OpenMegatronSource(path, options);
    case SourceKind::kParquet:
    case SourceKind::kArrow:
      return OpenArrowSource(spec, options);
    case SourceKind::kFed:
      break;
  }
  return Status::Internal("OpenSource: no source of kind " +
                          std::string(SourceKindName(kind)) + " from a spec");
}

}  // namespace

// Opening reads whole lengths and histogram files into memory: a file larger than memory is an
// error, never an exception out of the library.
Result<std::unique_ptr<SampleSource>> OpenSource(std::string_view spec,
                                                 const SourceOptions& options) {
  try {
    return OpenSourceUnguarded(spec, options);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("data source \"" + std::string(spec) +
                                     "\": out of memory while opening it");
  }
}

}  // namespace thdpack
