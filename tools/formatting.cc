#include "formatting.h"

#include <cstdio>

namespace thdpack::tools {

std::string Thousands(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string FormatBytes(double bytes, bool binary) {
  static const char* const kBinary[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  static const char* const kDecimal[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  const double base = binary ? 1024 : 1000;
  double v = bytes;
  int u = 0;
  while (v >= base && u < 5) {
    v /= base;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v,
                binary ? kBinary[u] : kDecimal[u]);
  return buf;
}

std::string BinaryBytes(int64_t bytes) { return FormatBytes(static_cast<double>(bytes), true); }

std::string_view ShortDtypeName(LogitsDtype dtype) {
  switch (dtype) {
    case LogitsDtype::kFloat32: return "fp32";
    case LogitsDtype::kBFloat16: return "bf16";
    case LogitsDtype::kFloat64: return "fp64";
  }
  return "invalid";
}

std::string LogitsLine(const LogitsFigures& logits) {
  std::string detail = "largest microbatch T=" + std::to_string(logits.total_tokens) +
                       ", V=" + std::to_string(logits.vocab_size);
  if (logits.tp_size > 1) {
    const int64_t columns = (logits.vocab_size + logits.tp_size - 1) / logits.tp_size;
    detail += " (" + std::to_string(columns) + " columns per TP rank)";
  }
  detail += ", " + std::string(ShortDtypeName(logits.dtype));
  if (logits.with_grad) detail += ", fused gradient included";
  return BinaryBytes(logits.bytes.gathered_total_bytes) + " gathered over CP, " +
         BinaryBytes(logits.bytes.local_total_bytes) + " CP-local (" + detail + ")";
}

}  // namespace thdpack::tools
