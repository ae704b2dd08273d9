// Memory figures (docs/design.md section 9).
#include "thdpack/memory.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "thdpack/shard.h"

namespace thdpack {
namespace {

// a * b, or false when it overflows int64 (both >= 0).
bool Mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

}  // namespace

Result<LogitsMemory> LogitsMemoryBytes(int64_t total_tokens, int cp_size, int64_t vocab_size,
                                       LogitsDtype dtype, int tp_size, bool with_grad) {
  const std::string f = "LogitsMemoryBytes";
  auto size = LogitsDtypeSize(dtype);
  if (!size.ok()) return size.status().WithContext(f + ": dtype");
  if (cp_size < 1) {
    return Status::InvalidArgument(f + ": cp_size = " + std::to_string(cp_size) +
                                   " must be >= 1");
  }
  if (tp_size < 1) {
    return Status::InvalidArgument(f + ": tp_size = " + std::to_string(tp_size) +
                                   " must be >= 1");
  }
  if (vocab_size < 1) {
    return Status::InvalidArgument(f + ": vocab_size = " + std::to_string(vocab_size) +
                                   " must be >= 1");
  }
  if (total_tokens < 0 || total_tokens % cp_size != 0) {
    return Status::InvalidArgument(f + ": total_tokens = " + std::to_string(total_tokens) +
                                   " must be >= 0 and divisible by cp_size = " +
                                   std::to_string(cp_size));
  }
  const int64_t cols = (vocab_size + tp_size - 1) / tp_size;
  LogitsMemory m;
  int64_t row = 0;
  if (!Mul(cols, *size, &row) || !Mul(total_tokens, row, &m.gathered_logits_bytes)) {
    return Status::OutOfRange(f + ": T x V/TP x bytes overflows int64");
  }
  m.local_logits_bytes = total_tokens / cp_size * row;
  if (with_grad) {
    m.local_grad_bytes = m.local_logits_bytes;
    m.gathered_grad_bytes = m.gathered_logits_bytes;
  }
  if (__builtin_add_overflow(m.gathered_logits_bytes, m.gathered_grad_bytes,
                             &m.gathered_total_bytes)) {
    return Status::OutOfRange(f + ": logits + grad bytes overflow int64");
  }
  m.local_total_bytes = m.local_logits_bytes + m.local_grad_bytes;
  return m;
}

Result<MicrobatchBufferBytes> BufferBytes(std::span<const int32_t> cu_seqlens_padded,
                                          int cp_size) {
  if (Status st = ValidateCuSeqlensPadded(cu_seqlens_padded, cp_size); !st.ok()) {
    return st.WithContext("BufferBytes: cu_seqlens_padded");
  }
  return BufferBytesOfShape(cu_seqlens_padded.back(),
                            static_cast<int64_t>(cu_seqlens_padded.size()) - 1, cp_size);
}

Result<MicrobatchBufferBytes> BufferBytesOfShape(int64_t total_tokens, int64_t n_sequences,
                                                 int cp_size) {
  const std::string f = "BufferBytesOfShape";
  if (cp_size < 1) {
    return Status::InvalidArgument(f + ": cp_size = " + std::to_string(cp_size) +
                                   " must be >= 1");
  }
  if (total_tokens < 0 || total_tokens > std::numeric_limits<int32_t>::max() ||
      total_tokens % cp_size != 0) {
    return Status::InvalidArgument(f + ": total_tokens = " + std::to_string(total_tokens) +
                                   " must be in [0, 2^31 - 1] and divisible by cp_size = " +
                                   std::to_string(cp_size));
  }
  if (n_sequences < 1 || n_sequences > std::numeric_limits<int32_t>::max()) {
    return Status::InvalidArgument(f + ": n_sequences = " + std::to_string(n_sequences) +
                                   " must be in [1, 2^31 - 1]");
  }
  const int64_t local = total_tokens / cp_size;
  const int64_t n1 = n_sequences + 1;
  MicrobatchBufferBytes b;
  b.tokens = local * 4;
  b.position_ids = local * 4;
  b.labels = local * 4;
  b.loss_mask = local;
  b.metadata = 2 * n1 * 4;
  b.loss_outputs = local * (8 + 8 + 1);
  b.total = b.tokens + b.position_ids + b.labels + b.loss_mask + b.metadata + b.loss_outputs;
  return b;
}

Result<ProcessMemory> ReadProcessMemory() {
  std::ifstream in("/proc/self/status");
  if (!in) return Status::IOError("ReadProcessMemory: cannot open /proc/self/status");
  ProcessMemory m;
  bool hwm = false, rss = false;
  std::string line;
  while (std::getline(in, line)) {
    auto parse = [&](const char* key, int64_t* out) {
      const std::string k = key;
      if (line.compare(0, k.size(), k) != 0) return false;
      std::istringstream fields(line.substr(k.size()));
      int64_t kib = 0;
      std::string unit;
      fields >> kib >> unit;
      *out = kib * 1024;
      return true;
    };
    hwm = parse("VmHWM:", &m.peak_rss_bytes) || hwm;
    rss = parse("VmRSS:", &m.rss_bytes) || rss;
  }
  if (!hwm || !rss) {
    return Status::NotFound("ReadProcessMemory: /proc/self/status has no VmHWM or VmRSS line");
  }
  return m;
}

}  // namespace thdpack
