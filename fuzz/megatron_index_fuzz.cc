// Fuzz target: OpenMegatronSource on an index (.idx bytes) and a token file (.bin) taken from the
// input (thdpack/megatron_dataset.h has the format). Layout of an input:
//   byte 0        controls: bit 0 resize .bin to what the index describes (capped at 1 MiB, so
//                 the fuzzer gets past the size check), bit 1 shuffle, bit 2 a vocabulary of
//                 1000 (else none), bit 3 the index carries sequence_modes[S]
//   then          the .idx: as many bytes as its header's counts give when they fit what is
//                 left (34 + 12 S + 8 D, plus S with bit 3), else everything left
//   then          the .bin: the rest
// An index the reader accepts must give a source whose every sample has 1 .. 2^31 - 1 tokens,
// the same length from NextLength and Next, tokens inside the vocabulary, and the size it
// announced; errors must name the file they are about.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "thdpack/data.h"
#include "thdpack/megatron_dataset.h"

namespace {

using thdpack::fuzz::Describe;

constexpr uint64_t kMaxBinBytes = uint64_t{1} << 20;
constexpr int64_t kMaxSamplesRead = 64;

uint64_t Load64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Bytes of .bin the index's sequence lengths describe, or UINT64_MAX when that cannot be
// computed (bad header, a negative length, more than kMaxBinBytes).
uint64_t DescribedBinBytes(const std::vector<uint8_t>& idx) {
  if (idx.size() < static_cast<size_t>(thdpack::kMegatronIndexHeaderSize)) return UINT64_MAX;
  const int64_t dtype_size = thdpack::MegatronDTypeSize(idx[17]);
  const uint64_t seq_count = Load64(idx.data() + 18);
  if (dtype_size == 0 || seq_count > (idx.size() - 34) / 4) return UINT64_MAX;
  uint64_t total = 0;
  for (uint64_t s = 0; s < seq_count; ++s) {
    const uint8_t* p = idx.data() + 34 + 4 * s;
    int32_t length;
    std::memcpy(&length, p, 4);  // little-endian hosts only, as the fuzz build is
    if (length < 0) return UINT64_MAX;
    total += static_cast<uint64_t>(length) * static_cast<uint64_t>(dtype_size);
    if (total > kMaxBinBytes) return UINT64_MAX;
  }
  return total;
}

void CheckSource(thdpack::SampleSource& source, int64_t vocab) {
  const std::optional<int64_t> size = source.size_hint();
  FUZZ_CHECK(size.has_value() && *size >= 1, "an open source without samples");
  const int64_t take = *size < kMaxSamplesRead ? *size : kMaxSamplesRead;
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < take; ++i) {
    auto next = source.NextLength();
    FUZZ_CHECK(next.ok() && next->has_value(), "NextLength failed on an open index: " +
                                                   Describe(next.status()));
    const int64_t length = (*next)->length;
    FUZZ_CHECK(length >= 1 && length <= thdpack::kMaxSampleLength,
               "sample length " + std::to_string(length));
    FUZZ_CHECK((*next)->n_targets == length - 1, "n_targets is not L - 1");
    lengths.push_back(length);
  }
  const thdpack::Status reset = source.Reset();
  FUZZ_CHECK(reset.ok(), "Reset failed: " + Describe(reset));
  const int64_t limit = vocab > 0 ? vocab : thdpack::kMaxSampleLength + 1;
  for (int64_t i = 0; i < take; ++i) {
    auto next = source.Next();
    if (!next.ok()) {  // a token the dtype or the vocabulary refuses: named, and sticky
      FUZZ_CHECK(next.status().message().find(".bin") != std::string::npos,
                 "a token error that does not name the .bin: " + Describe(next.status()));
      auto again = source.Next();
      FUZZ_CHECK(!again.ok() && again.status() == next.status(), "an error that is not sticky");
      return;
    }
    FUZZ_CHECK(next->has_value(), "Next ended before the size");
    const thdpack::Sample& sample = **next;
    FUZZ_CHECK(static_cast<int64_t>(sample.tokens.size()) == lengths[static_cast<size_t>(i)],
               "Next and NextLength disagree on sample " + std::to_string(i));
    for (const auto t : sample.tokens) {
      FUZZ_CHECK(t >= 0 && t < limit, "token " + std::to_string(t) + " outside [0, limit)");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t controls = data[0];
  const uint8_t* rest = data + 1;
  const size_t left = size - 1;
  size_t idx_size = left;
  if (left >= 34) {
    const uint64_t s = Load64(rest + 18);
    const uint64_t d = Load64(rest + 26);
    const uint64_t modes = (controls & 8) ? s : 0;
    if (s <= left && d <= left) {
      const uint64_t need = 34 + 12 * s + 8 * d + modes;
      if (need <= left) idx_size = static_cast<size_t>(need);
    }
  }
  std::vector<uint8_t> idx(rest, rest + idx_size);
  std::vector<uint8_t> bin(rest + idx_size, rest + left);
  if (controls & 1) {
    const uint64_t want = DescribedBinBytes(idx);
    if (want != UINT64_MAX) {
      const size_t had = bin.size();
      bin.resize(static_cast<size_t>(want));
      for (size_t i = had; i < bin.size(); ++i) bin[i] = static_cast<uint8_t>(i * 131 + 7);
    }
  }
  thdpack::fuzz::WriteScratchFile("ds.idx", idx.data(), idx.size());
  thdpack::fuzz::WriteScratchFile("ds.bin", bin.data(), bin.size());
  const std::string prefix = thdpack::fuzz::ScratchDir::Path() + "/ds";

  thdpack::SourceOptions options;
  options.shuffle = (controls & 2) != 0;
  options.vocab_size = (controls & 4) ? 1000 : 0;
  auto source = thdpack::OpenMegatronSource(prefix, options);
  if (!source.ok()) {
    const std::string& message = source.status().message();
    FUZZ_CHECK(message.find(prefix) != std::string::npos,
               "an error that names neither file: " + Describe(source.status()));
    return 0;
  }
  CheckSource(**source, options.vocab_size);
  return 0;
}
