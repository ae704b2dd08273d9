// thdpack/memory.h: memory figures of docs/design.md section 9: the analytic logits bytes per rank
// with and without the CP-local loss, the bytes of the buffers thdpack holds for a packed
// microbatch, and the process's peak resident memory.
//
// Legend (docs/design.md): T packed tokens of the microbatch, V vocabulary, CP, TP group sizes.
// Thread-safety: pure functions; ReadProcessMemory reads /proc/self/status.
#ifndef THDPACK_MEMORY_H_
#define THDPACK_MEMORY_H_

#include <cstdint>
#include <span>

#include "thdpack/loss.h"
#include "thdpack/status.h"

namespace thdpack {

// Logits bytes of one rank for one microbatch. Columns per rank: ceil(V / TP) (vocab-parallel
// output layer; TP = 1 keeps all V). "local": the CP-local loss, [T/CP, V/TP]; "gathered":
// the logits gathered over the CP group first, [T, V/TP]. The gradient, when fused, is a
// second buffer of the same shape and dtype.
struct LogitsMemory {
  int64_t local_logits_bytes = 0;     // T/CP * ceil(V/TP) * bytes
  int64_t gathered_logits_bytes = 0;  // T * ceil(V/TP) * bytes
  int64_t local_grad_bytes = 0;       // = local_logits_bytes when with_grad, else 0
  int64_t gathered_grad_bytes = 0;    // = gathered_logits_bytes when with_grad, else 0
  int64_t local_total_bytes = 0;      // logits + grad
  int64_t gathered_total_bytes = 0;
};

// REQUIRES: total_tokens >= 0 and divisible by cp_size (a packed microbatch always is);
// cp_size, tp_size >= 1; vocab_size >= 1; a supported dtype; results fit int64. Errors name
// the argument and the rule.
[[nodiscard]] Result<LogitsMemory> LogitsMemoryBytes(int64_t total_tokens, int cp_size,
                                                     int64_t vocab_size, LogitsDtype dtype,
                                                     int tp_size = 1, bool with_grad = false);

// Bytes of the per-rank buffers thdpack holds for one packed microbatch (T/CP local tokens,
// n sequences): the four token arrays (tokens, position_ids, labels: int32; loss_mask: uint8),
// the metadata (cu_seqlens and cu_seqlens_padded: (n+1) int32 each) and the loss's per-token
// outputs (CrossEntropyResult: logprobs and entropy as double, counted as uint8).
struct MicrobatchBufferBytes {
  int64_t tokens = 0;
  int64_t position_ids = 0;
  int64_t labels = 0;
  int64_t loss_mask = 0;
  int64_t metadata = 0;
  int64_t loss_outputs = 0;
  int64_t total = 0;
};
// REQUIRES: ValidateCuSeqlensPadded(cu_seqlens_padded, cp_size).
[[nodiscard]] Result<MicrobatchBufferBytes> BufferBytes(
    std::span<const int32_t> cu_seqlens_padded, int cp_size);

// The same from the microbatch's shape alone: T = total_tokens (in [0, 2^31 - 1], divisible
// by cp_size) and n_sequences in [1, 2^31 - 1]; errors name the argument and the rule.
[[nodiscard]] Result<MicrobatchBufferBytes> BufferBytesOfShape(int64_t total_tokens,
                                                               int64_t n_sequences, int cp_size);

// Resident memory of this process from /proc/self/status: VmHWM (peak) and VmRSS (now).
struct ProcessMemory {
  int64_t peak_rss_bytes = 0;
  int64_t rss_bytes = 0;
};
// IOError when /proc/self/status cannot be read (not Linux); NotFound when a field is absent.
[[nodiscard]] Result<ProcessMemory> ReadProcessMemory();

}  // namespace thdpack

#endif  // THDPACK_MEMORY_H_
