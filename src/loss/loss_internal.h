// Internal helpers shared by the cross-entropy paths: argument checks and the per-token label
// table every kernel reads.
#ifndef THDPACK_LOSS_LOSS_INTERNAL_H_
#define THDPACK_LOSS_LOSS_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "thdpack/loss.h"
#include "thdpack/status.h"

namespace thdpack::loss_internal {

// What a kernel needs once the arguments are checked.
struct Prepared {
  int64_t num_tokens = 0;   // T
  int64_t vocab_size = 0;   // V (local columns)
  int64_t vocab_start = 0;  // first column's vocabulary id
  int64_t vocab_total = 0;  // full V
  int64_t elem_size = 0;    // bytes per logit
  // [T] global label of each counted token, -1 for an uncounted one.
  std::vector<int64_t> labels;
  int64_t n_valid = 0;
};

enum class Mode {
  kFull,           // CrossEntropy / CrossEntropyReference: vocab_start 0, not split
  kVocabParallel,  // phases 1 and 3
};

// Checks logits, targets, options (and grad when need_grad) and builds Prepared. fn names the
// public function in messages.
[[nodiscard]] Result<Prepared> Prepare(const char* fn, const LogitsView& logits,
                                       const TokenTargets& targets,
                                       const CrossEntropyOptions& options, Mode mode,
                                       bool need_grad, std::span<const std::byte> grad);

// Resolves num_threads (0 = hardware) and caps it by the number of rows.
int ResolveThreads(int requested, int64_t rows);

// Runs body(begin, end) over [0, rows) split into contiguous ranges, one per thread; the
// calling thread runs the first range.
void ParallelRows(int64_t rows, int threads, const std::function<void(int64_t, int64_t)>& body);

// Fills result's per-token arrays from per-token (logprob, entropy) and sums in token order.
void Summarise(const Prepared& p, CrossEntropyResult* result);

// The bf16 gradient store of the fast path: on CPUs with AVX512-BF16 it rounds with
// vcvtneps2bf16 (round to nearest even, as the portable integer rounding does, except that
// values below 2^-126 become 0). True when that store is in use.
bool NativeBf16Store();
// For tests and benchmarks: force the portable store (true), or allow the native one again.
void ForcePortableBf16Store(bool portable);

// The instruction sets the fast kernel (fp32 and bf16 logits) is compiled for, each with its
// vector width, one register: the x86-64 baseline (SSE2; also every non-x86 or non-GCC build)
// 4 floats, x86-64-v3 (AVX2, FMA) 8, x86-64-v4 (AVX-512) 16. The kernel runs the widest this
// CPU supports, chosen once at first use. Results are bit-identical for any thread count on one
// ISA; between ISAs they differ in the last bits (the lane sums are grouped differently).
enum class Isa { kBaseline = 0, kX86_64V3 = 1, kX86_64V4 = 2 };
const char* IsaName(Isa isa);  // "baseline", "x86-64-v3", "x86-64-v4"
int IsaLanes(Isa isa);         // floats per vector: 4, 8, 16
// The ISAs this CPU and build can run, narrowest first (always starts with kBaseline).
std::vector<Isa> SupportedIsas();
// The ISA the kernel runs now: the forced one, or else the widest supported.
Isa ActiveIsa();
// For tests and benchmarks (process-wide, not for concurrent use with the kernel): run the
// kernel with isa from now on, or with the widest again when nullopt. An error names the ISA
// when this CPU or build cannot run it (nothing changes then).
[[nodiscard]] Status ForceIsa(std::optional<Isa> isa);

}  // namespace thdpack::loss_internal

#endif  // THDPACK_LOSS_LOSS_INTERNAL_H_
