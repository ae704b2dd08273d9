// Fuzz target: ParseMockConfig (Megatron's mock SFT config, thdpack/data.h) on any text. An
// accepted config must obey the REQUIRES of MockConfig; in distribution mode MockLength must stay
// inside [min_seq_len, max_seq_len] for any seed and index, and a mock source must open on it.
// File mode is parsed only: the path an input names is never opened.
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "thdpack/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using thdpack::MockConfig;
  using thdpack::fuzz::Describe;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  thdpack::Result<MockConfig> parsed = thdpack::ParseMockConfig(text, "fuzz.json", "/base");
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == thdpack::StatusCode::kInvalidArgument,
               "unexpected code: " + Describe(parsed.status()));
    FUZZ_CHECK(parsed.status().message().find("fuzz.json") != std::string::npos,
               "the error does not name the file: " + Describe(parsed.status()));
    return 0;
  }
  const MockConfig& c = *parsed;
  if (c.mode == MockConfig::Mode::kFile) {
    FUZZ_CHECK(!c.path.empty(), "file mode with an empty path");
    return 0;
  }
  FUZZ_CHECK(1 <= c.min_seq_len && c.min_seq_len <= c.max_seq_len &&
                 c.max_seq_len <= thdpack::kMaxSampleLength,
             "accepted lengths " + std::to_string(c.min_seq_len) + ".." + std::to_string(c.max_seq_len));
  FUZZ_CHECK(std::isfinite(c.mean_seq_len) && c.mean_seq_len > 0, "accepted a bad mean");
  FUZZ_CHECK(std::isfinite(c.lognormal_sigma) && c.lognormal_sigma >= 0, "accepted a bad sigma");
  const uint64_t seeds[] = {0, 1234, UINT64_MAX};
  for (const uint64_t seed : seeds) {
    for (int64_t index = 0; index < 8; ++index) {
      const int64_t length = thdpack::MockLength(c, seed, index);
      FUZZ_CHECK(c.min_seq_len <= length && length <= c.max_seq_len,
                 "MockLength " + std::to_string(length) + " outside the config's range");
    }
  }
  thdpack::SourceOptions options;
  options.mock_num_samples = 3;
  auto source = thdpack::OpenMockSource(c, options);
  FUZZ_CHECK(source.ok(), "OpenMockSource refused a parsed config: " + Describe(source.status()));
  for (int64_t i = 0; i < 3; ++i) {
    auto next = (*source)->NextLength();
    FUZZ_CHECK(next.ok() && next->has_value(), "the mock source ended early");
    FUZZ_CHECK((*next)->length >= c.min_seq_len && (*next)->length <= c.max_seq_len,
               "a mock sample outside the config's range");
  }
  return 0;
}
