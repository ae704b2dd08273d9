// Internal helpers shared by the cross-entropy paths: argument checks and the per-token label
// table every kernel reads.
#ifndef THDPACK_LOSS_LOSS_INTERNAL_H_
#define THDPACK_LOSS_LOSS_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
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

}  // namespace thdpack::loss_internal

#endif  // THDPACK_LOSS_LOSS_INTERNAL_H_
