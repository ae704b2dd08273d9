// src/wire/step_meta_test_util.h: helpers shared by the tests of the step metadata, version 1
// (step_meta_test.cc) and version 2 (step_meta_groups_test.cc).
#ifndef THDPACK_SRC_WIRE_STEP_META_TEST_UTIL_H_
#define THDPACK_SRC_WIRE_STEP_META_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "thdpack/wire.h"
#include "wire/coding.h"

namespace thdpack::wire_test {

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline bool Contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// Rewrites total_length to the buffer's size and the trailer to a valid CRC, so the decoder's
// structural checks - not the checksum - must catch what was changed.
inline void Reseal(std::vector<uint8_t>* msg) {
  ASSERT_GE(msg->size(), kStepMetaMinSize);
  wire::EncodeFixed32(msg->data() + 5, static_cast<uint32_t>(msg->size()));
  const size_t body_end = msg->size() - 4;
  wire::EncodeFixed32(msg->data() + body_end,
                      Crc32c(std::span<const uint8_t>(msg->data(), body_end)));
}

// Fills real_tokens, padded_tokens, sum_sq from the microbatches; n_loss_tokens = sum n_valid
// plus `other_replicas`.
inline void FillTotals(StepMeta* meta, int64_t other_replicas = 0) {
  meta->real_tokens = meta->padded_tokens = meta->sum_sq = 0;
  int64_t n_valid = 0;
  for (const auto& mb : meta->microbatches) {
    meta->real_tokens += mb.cu_seqlens.back();
    meta->padded_tokens += mb.cu_seqlens_padded.back();
    for (size_t i = 0; i + 1 < mb.cu_seqlens_padded.size(); ++i) {
      const int64_t p = int64_t{mb.cu_seqlens_padded[i + 1]} - mb.cu_seqlens_padded[i];
      meta->sum_sq += p * p;
    }
    n_valid += mb.n_valid;
  }
  meta->n_loss_tokens = n_valid + other_replicas;
}

}  // namespace thdpack::wire_test

#endif  // THDPACK_SRC_WIRE_STEP_META_TEST_UTIL_H_
