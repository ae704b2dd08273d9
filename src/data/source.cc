// OpenSource: the spec-string factory the command line uses; SampleSource's default batched
// read.
#include "data/data_internal.h"
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

Result<std::unique_ptr<SampleSource>> OpenSourceUnguarded(std::string_view spec,
                                                          const SourceOptions& options) {
  const std::string spec_text(spec);
  if (spec == "mock") return OpenMockSource(kDefaultMockConfig, options, spec_text);
  const size_t colon = spec.find(':');
  const std::string_view kind = spec.substr(0, colon);
  const std::string path(colon == std::string_view::npos ? std::string_view() : spec.substr(colon + 1));
  const bool known = kind == "mock" || kind == "lengths" || kind == "histogram" ||
                     kind == "jsonl" || kind == "megatron" || kind == "blend";
  if (!known) {
    return Status::InvalidArgument("unknown data source \"" + spec_text +
                                   "\" (expected mock, mock:FILE.json, lengths:FILE, "
                                   "histogram:FILE, jsonl:FILE, megatron:PREFIX or "
                                   "blend:FILE.json)");
  }
  if (path.empty()) {
    return Status::InvalidArgument("data source \"" + spec_text + "\" needs a path after \"" +
                                   std::string(kind) + ":\"");
  }
  if (kind == "mock") {
    THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec_text, options));
    THDPACK_ASSIGN_OR_RETURN(MockConfig config, ReadMockConfigFile(path));
    return OpenMockSource(config, options, spec_text);
  }
  if (kind == "lengths") return OpenLengthsSource(path, options);
  if (kind == "histogram") {
    THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<HistogramSource> h, OpenHistogramSource(path, options));
    return std::unique_ptr<SampleSource>(std::move(h));
  }
  if (kind == "jsonl") return OpenJsonlSource(path, options);
  if (kind == "blend") {
    THDPACK_RETURN_IF_ERROR(data_internal::ValidateOptions(spec_text, options));
    THDPACK_ASSIGN_OR_RETURN(BlendConfig config, ReadBlendSpec(path));
    return OpenBlendSource(config, options, spec_text);
  }
  return OpenMegatronSource(path, options);
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
