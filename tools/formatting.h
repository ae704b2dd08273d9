// The readable numbers and lines `thdpack plan` and `thdpack run` both print.
#ifndef THDPACK_TOOLS_FORMATTING_H_
#define THDPACK_TOOLS_FORMATTING_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "thdpack/memory_report.h"

namespace thdpack::tools {

// 1234567 -> "1,234,567".
std::string Thousands(int64_t v);

// "12 B", "1.50 KiB" (binary: powers of 1024) or "1.50 KB" (decimal: powers of 1000).
std::string FormatBytes(double bytes, bool binary);
// Bytes in binary units: "512 B", "1.50 KiB", "1.88 MiB", "37.09 GiB".
std::string BinaryBytes(int64_t bytes);

// "bf16", "fp32", "fp64".
std::string_view ShortDtypeName(LogitsDtype dtype);

// "37.09 GiB gathered over CP, 18.55 GiB CP-local (largest microbatch T=131072, V=151936,
// bf16)", with ", fused gradient included" inside the brackets when it is counted.
std::string LogitsLine(const LogitsFigures& logits);

}  // namespace thdpack::tools

#endif  // THDPACK_TOOLS_FORMATTING_H_
