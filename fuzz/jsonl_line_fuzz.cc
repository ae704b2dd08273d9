// Fuzz target: the JSONL line parser, differential. ParseJsonlLine (the hand-written fast path,
// falling back to the reference on anything unusual) against ParseJsonlLineReference (plain
// nlohmann_json), on the input as one line, without and with a vocabulary: both must accept or
// reject alike, with the same status (code and message), and accept the same tokens and mask.
// What they accept must obey the rules of thdpack/data.h.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "thdpack/data.h"

namespace {

using thdpack::Sample;
using thdpack::Status;
using thdpack::fuzz::Describe;

void Compare(std::string_view line, int64_t vocab) {
  Sample fast, reference;
  const Status f = thdpack::ParseJsonlLine(line, vocab, "fuzz:1", &fast);
  const Status r = thdpack::ParseJsonlLineReference(line, vocab, "fuzz:1", &reference);
  const std::string at = " (vocab " + std::to_string(vocab) + ")";
  FUZZ_CHECK(f == r, "fast " + Describe(f) + " but reference " + Describe(r) + at);
  if (!r.ok()) return;
  FUZZ_CHECK(fast.tokens == reference.tokens, "tokens differ" + at);
  FUZZ_CHECK(fast.target_mask == reference.target_mask, "loss masks differ" + at);
  const int64_t limit = vocab > 0 ? vocab : thdpack::kMaxSampleLength + 1;
  FUZZ_CHECK(!reference.tokens.empty(), "accepted a sample without tokens" + at);
  for (const auto t : reference.tokens) {
    FUZZ_CHECK(t >= 0 && t < limit, "accepted token " + std::to_string(t) + at);
  }
  FUZZ_CHECK(reference.target_mask.empty() || reference.target_mask.size() == reference.tokens.size(),
             "accepted a mask of another length" + at);
  for (const auto m : reference.target_mask) {
    FUZZ_CHECK(m == 0 || m == 1, "accepted mask value " + std::to_string(m) + at);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  Compare(line, 0);
  Compare(line, 1000);
  return 0;
}
