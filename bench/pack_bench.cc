// pack_bench: throughput of packing + CP sharding of one 1M-token microbatch, as bytes of
// output written per second, next to memcpy of the same number of bytes in the same run.
//
// Output bytes of one microbatch: tokens, position_ids, labels (4 bytes each) and loss_mask
// (1 byte) of every CP rank's shard, 13 bytes per padded token, plus the metadata
// (cu_seqlens, cu_seqlens_padded, max_seqlen, T). Rows:
//   fused all ranks   PackShardAllInto: every rank's arrays straight from the samples
//   fused one rank    PackShardInto for rank 0 (what one CP rank builds for itself)
//   pack + CpShard    PackInto of the [T] arrays, then CpShard (chunk memcpy) per rank
//   pack + gather     PackInto, then gather by CpPartitionIndices per rank: the reference
//   memcpy            memcpy of as many bytes as "fused all ranks" writes
// Every row includes ComputeLayout. Buffers are allocated and touched before timing; each row
// reports the median of its repetitions. The fast path is checked against the reference before
// it is timed. Lengths come from data/wlbllm_doc_lengths.txt of the source tree (or the file
// given on the command line); if that cannot be read, lognormal lengths of mean 4096.
//
// Usage: pack_bench [--tokens N] [lengths_file]   (N real tokens per microbatch, default 2^20)
// Prints a table; never fails on a time (it exits non-zero only if the fast path is wrong).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_data.h"
#include "thdpack/pack.h"
#include "thdpack/shard.h"

namespace {

using thdpack::PackBuffers;
using thdpack::PackOptions;
using thdpack::ParallelLayout;
using thdpack::SampleView;
using thdpack::TokenId;

constexpr int64_t kDefaultTokens = int64_t{1} << 20;

std::vector<int64_t> ReadLengths(const std::string& path) {
  std::vector<int64_t> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    char* end = nullptr;
    const long long v = std::strtoll(line.c_str(), &end, 10);
    if (end != line.c_str() && v > 0) out.push_back(v);
  }
  return out;
}

// Document lengths until the microbatch holds target_tokens real tokens (the last one trimmed).
std::vector<int64_t> MicrobatchLengths(const std::vector<int64_t>& source, int64_t target_tokens,
                                       std::string* origin) {
  std::vector<int64_t> pool = source;
  if (pool.empty()) {
    *origin = "lognormal, mean 4096, sigma 1.0 (seed 1)";
    std::mt19937_64 rng(1);
    const double sigma = 1.0;
    std::lognormal_distribution<double> dist(std::log(4096.0) - sigma * sigma / 2, sigma);
    for (int i = 0; i < 4096; ++i) pool.push_back(std::max<int64_t>(1, std::llround(dist(rng))));
  }
  std::vector<int64_t> lengths;
  int64_t total = 0;
  for (size_t i = 0; total < target_tokens; i = (i + 1) % pool.size()) {
    const int64_t len = std::min(pool[i], target_tokens - total);
    lengths.push_back(len);
    total += len;
  }
  return lengths;
}

double MedianSeconds(const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<double> times;
  const auto start = std::chrono::steady_clock::now();
  while (times.size() < 7 ||
         (times.size() < 200 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 0.5)) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Arrays {
  std::vector<TokenId> tokens;
  std::vector<int32_t> position_ids;
  std::vector<TokenId> labels;
  std::vector<uint8_t> loss_mask;
  explicit Arrays(int64_t n)
      : tokens(static_cast<size_t>(n), 1),
        position_ids(static_cast<size_t>(n), 1),
        labels(static_cast<size_t>(n), 1),
        loss_mask(static_cast<size_t>(n), 1) {}
  PackBuffers Buffers() { return {tokens, position_ids, labels, loss_mask}; }
};

template <typename T>
void GatherInto(const std::vector<T>& full, const std::vector<int32_t>& idx, std::vector<T>& out) {
  for (size_t k = 0; k < idx.size(); ++k) out[k] = full[static_cast<size_t>(idx[k])];
}

void Fail(const char* what, const thdpack::Status& s) {
  std::fprintf(stderr, "pack_bench: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  std::string path;
  int64_t target_tokens = kDefaultTokens;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--tokens" && i + 1 < argc) {
      target_tokens = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else {
      path = arg;
    }
  }
  std::vector<int64_t> source;
  std::string origin;
  if (path.empty()) path = thdpack_bench::DataDir() + "/wlbllm_doc_lengths.txt";
  source = ReadLengths(path);
  if (!source.empty()) origin = path;
  const std::vector<int64_t> lengths = MicrobatchLengths(source, target_tokens, &origin);

  // Samples: random tokens; SFT masks (a prompt of zeros, then ones) on every sample.
  std::mt19937_64 rng(42);
  std::vector<std::vector<TokenId>> tokens(lengths.size());
  std::vector<std::vector<uint8_t>> masks(lengths.size());
  std::vector<SampleView> samples;
  for (size_t i = 0; i < lengths.size(); ++i) {
    tokens[i].resize(static_cast<size_t>(lengths[i]));
    for (TokenId& t : tokens[i]) t = static_cast<TokenId>(rng() % 128256);
    masks[i].assign(static_cast<size_t>(lengths[i]), 1);
    const size_t prompt = static_cast<size_t>(rng() % static_cast<uint64_t>(lengths[i]));
    std::fill(masks[i].begin(), masks[i].begin() + static_cast<std::ptrdiff_t>(prompt / 4), 0);
    samples.emplace_back(static_cast<int64_t>(i), tokens[i], masks[i]);
  }
  std::printf("pack_bench: %zu sequences, %lld real tokens, lengths from %s\n", lengths.size(),
              static_cast<long long>(target_tokens), origin.c_str());
  std::printf("bytes = tokens+position_ids+labels (4 B) + loss_mask (1 B) of every CP shard + "
              "metadata; median time; one thread\n\n");
  std::printf("%-16s %3s %9s %11s %9s %9s %9s\n", "what", "CP", "T", "bytes", "ms", "GB/s",
              "x memcpy");

  for (int cp : {1, 2, 4, 8}) {
    const PackOptions options{.parallel = ParallelLayout::Create(cp).value()};
    auto layout_or = thdpack::ComputeLayout(lengths, options);
    if (!layout_or.ok()) Fail("ComputeLayout", layout_or.status());
    const thdpack::Layout layout = *layout_or;
    const int64_t t = layout.total_tokens;
    const int64_t local = t / cp;
    const int64_t meta_bytes =
        static_cast<int64_t>(2 * layout.cu_seqlens.size() * sizeof(int32_t)) + 4 + 8;
    const int64_t all_bytes = t * 13 + meta_bytes;
    const int64_t one_bytes = local * 13 + meta_bytes;

    std::vector<Arrays> shards;
    for (int r = 0; r < cp; ++r) shards.emplace_back(local);
    std::vector<PackBuffers> bufs;
    for (Arrays& a : shards) bufs.push_back(a.Buffers());
    Arrays full(t);
    std::vector<std::vector<int32_t>> indices;
    for (int r = 0; r < cp; ++r) {
      indices.push_back(*thdpack::CpPartitionIndices(layout.cu_seqlens_padded, cp, r));
    }
    std::vector<uint8_t> src(static_cast<size_t>(all_bytes), 3), dst(static_cast<size_t>(all_bytes), 4);

    auto fused_all = [&] {
      auto l = thdpack::ComputeLayout(lengths, options);
      auto n = thdpack::PackShardAllInto(samples, *l, options, bufs);
      if (!n.ok()) Fail("PackShardAllInto", n.status());
    };
    auto fused_one = [&] {
      auto l = thdpack::ComputeLayout(lengths, options);
      auto n = thdpack::PackShardInto(samples, *l, options, 0, bufs[0]);
      if (!n.ok()) Fail("PackShardInto", n.status());
    };
    auto pack_shard = [&] {
      auto l = thdpack::ComputeLayout(lengths, options);
      auto n = thdpack::PackInto(samples, *l, options, full.Buffers());
      if (!n.ok()) Fail("PackInto", n.status());
      const auto& cu = l->cu_seqlens_padded;
      for (int r = 0; r < cp; ++r) {
        thdpack::Status s = thdpack::CpShardInto<TokenId>(full.tokens, cu, cp, r, bufs[r].tokens);
        if (s.ok()) s = thdpack::CpShardInto<int32_t>(full.position_ids, cu, cp, r, bufs[r].position_ids);
        if (s.ok()) s = thdpack::CpShardInto<TokenId>(full.labels, cu, cp, r, bufs[r].labels);
        if (s.ok()) s = thdpack::CpShardInto<uint8_t>(full.loss_mask, cu, cp, r, bufs[r].loss_mask);
        if (!s.ok()) Fail("CpShardInto", s);
      }
    };
    auto pack_gather = [&] {
      auto l = thdpack::ComputeLayout(lengths, options);
      auto n = thdpack::PackInto(samples, *l, options, full.Buffers());
      if (!n.ok()) Fail("PackInto", n.status());
      for (int r = 0; r < cp; ++r) {
        GatherInto(full.tokens, indices[r], shards[r].tokens);
        GatherInto(full.position_ids, indices[r], shards[r].position_ids);
        GatherInto(full.labels, indices[r], shards[r].labels);
        GatherInto(full.loss_mask, indices[r], shards[r].loss_mask);
      }
    };
    auto copy = [&] { std::memcpy(dst.data(), src.data(), src.size()); };

    // Check the fast path against the reference before timing it.
    pack_gather();
    std::vector<Arrays> want = shards;
    fused_all();
    for (int r = 0; r < cp; ++r) {
      if (want[r].tokens != shards[r].tokens || want[r].position_ids != shards[r].position_ids ||
          want[r].labels != shards[r].labels || want[r].loss_mask != shards[r].loss_mask) {
        std::fprintf(stderr, "pack_bench: fused shard of rank %d differs from the reference\n", r);
        return 1;
      }
    }

    const double memcpy_s = MedianSeconds(copy);
    const double memcpy_rate = static_cast<double>(all_bytes) / memcpy_s;
    struct Row {
      const char* what;
      std::function<void()> fn;
      int64_t bytes;
    };
    const Row rows[] = {{"fused all ranks", fused_all, all_bytes},
                        {"fused one rank", fused_one, one_bytes},
                        {"pack + CpShard", pack_shard, all_bytes},
                        {"pack + gather", pack_gather, all_bytes}};
    for (const Row& row : rows) {
      const double s = MedianSeconds(row.fn);
      const double rate = static_cast<double>(row.bytes) / s;
      std::printf("%-16s %3d %9lld %11lld %9.3f %9.2f %9.2f\n", row.what, cp,
                  static_cast<long long>(t), static_cast<long long>(row.bytes), s * 1e3,
                  rate / 1e9, rate / memcpy_rate);
    }
    std::printf("%-16s %3d %9lld %11lld %9.3f %9.2f %9.2f\n", "memcpy", cp,
                static_cast<long long>(t), static_cast<long long>(all_bytes), memcpy_s * 1e3,
                memcpy_rate / 1e9, 1.0);
  }
  return 0;
}
