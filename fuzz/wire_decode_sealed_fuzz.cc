// Fuzz target: DecodeStepMeta past the checksum. The input is a message whose magic,
// total_length and CRC-32C trailer are rewritten before decoding (the version byte is kept), so
// every mutation reaches the body decoder (docs/wire_format.md, "What the reader checks", 3-7).
// Inputs shorter than the smallest message are decoded as they are.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "thdpack/wire.h"
#include "wire/coding.h"
#include "wire_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> msg(data, data + size);
  if (size >= thdpack::kStepMetaMinSize && size <= UINT32_MAX) {
    for (int i = 0; i < 4; ++i) msg[i] = thdpack::kStepMetaMagic[i];
    thdpack::wire::EncodeFixed32(msg.data() + 5, static_cast<uint32_t>(size));
    const size_t body_end = size - 4;
    thdpack::wire::EncodeFixed32(
        msg.data() + body_end, thdpack::Crc32c(std::span<const uint8_t>(msg.data(), body_end)));
  }
  thdpack::fuzz::CheckStepMetaDecoder(msg);
  return 0;
}
