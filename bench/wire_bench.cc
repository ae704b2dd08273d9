// wire_bench: size and speed of the step-metadata wire format (thdpack/wire.h) on real length
// distributions, next to the naive encoding (two int32 cu_seqlens arrays per microbatch, 8 bytes
// per sequence, as TransformerEngine/Megatron-style code sends them), and CRC-32C speed of the
// reference, table and hardware paths (one stream, and the three-stream form Crc32c uses).
//
// Usage: wire_bench [--data_dir=DIR] [--max_docs=N] [--min_time=SECONDS]
// DIR defaults to data/ of the source tree; a missing length file falls back to a
// lognormal with mean 4096 (said in the output). Prints tables; never fails on a time.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "bench_data.h"
#include "thdpack/wire.h"
#include "wire/crc32c.h"

namespace {

using thdpack::MicrobatchMeta;
using thdpack::StepMeta;
using Clock = std::chrono::steady_clock;

// Lengths one per line; non-numeric lines (a header) are skipped.
std::vector<int64_t> LoadLengths(const std::string& path, size_t max_docs, bool* from_file) {
  std::vector<int64_t> lengths;
  std::ifstream in(path);
  std::string line;
  while (lengths.size() < max_docs && std::getline(in, line)) {
    char* end = nullptr;
    const long long v = std::strtoll(line.c_str(), &end, 10);
    if (end != line.c_str() && v >= 1) lengths.push_back(v);
  }
  *from_file = !lengths.empty();
  if (lengths.empty()) {
    std::mt19937_64 rng(1);
    const double sigma = 1.0;
    std::lognormal_distribution<double> dist(std::log(4096.0) - sigma * sigma / 2, sigma);
    lengths.resize(std::min<size_t>(max_docs, 100000));
    for (auto& l : lengths) l = std::max<int64_t>(1, static_cast<int64_t>(dist(rng)));
  }
  return lengths;
}

struct Config {
  int cp;
  int tp;
  bool sp;
  int64_t capacity;  // padded tokens per microbatch (CP * max_tokens_per_rank)
};

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Cuts the documents, in file order, into steps of `mb_per_step` next-fit microbatches. A
// document longer than the capacity is skipped (oversize policy `skip`) and reported by id.
std::vector<StepMeta> BuildSteps(const std::vector<int64_t>& lengths, const Config& cfg,
                                 int mb_per_step) {
  const int64_t c = cfg.cp > 1 ? 2 * cfg.cp : 1;
  const int64_t unit = cfg.sp ? int64_t{cfg.cp} * cfg.tp : 1;
  std::vector<StepMeta> steps;
  StepMeta step;
  std::vector<int64_t> len;
  int64_t fill = 0;
  auto new_step = [&] {
    step = StepMeta{};
    step.step = steps.size();
    step.dp_size = 8;
    step.replica = 3;
    step.parallel = thdpack::ParallelLayout::Create(cfg.cp, cfg.tp, cfg.sp).value();  // m = c
  };
  auto close_microbatch = [&] {
    if (len.empty()) return;
    MicrobatchMeta mb;
    mb.cu_seqlens.push_back(0);
    mb.cu_seqlens_padded.push_back(0);
    int64_t total = 0;
    std::vector<int64_t> pad(len.size());
    for (size_t i = 0; i < len.size(); ++i) total += pad[i] = RoundUp(len[i], c);
    while (total % unit != 0) pad.back() += c, total += c;  // SP tail on the last sequence
    for (size_t i = 0; i < len.size(); ++i) {
      mb.cu_seqlens.push_back(static_cast<int32_t>(mb.cu_seqlens.back() + len[i]));
      mb.cu_seqlens_padded.push_back(static_cast<int32_t>(mb.cu_seqlens_padded.back() + pad[i]));
      mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(pad[i]));
      step.sum_sq += pad[i] * pad[i];
    }
    mb.n_valid = mb.cu_seqlens.back() - static_cast<int64_t>(len.size());
    step.real_tokens += mb.cu_seqlens.back();
    step.padded_tokens += mb.cu_seqlens_padded.back();
    step.n_loss_tokens += mb.n_valid;
    step.microbatches.push_back(std::move(mb));
    len.clear();
    fill = 0;
    if (static_cast<int>(step.microbatches.size()) == mb_per_step) {
      steps.push_back(std::move(step));
      new_step();
    }
  };
  new_step();
  for (size_t id = 0; id < lengths.size(); ++id) {
    const int64_t p = RoundUp(lengths[id], c);
    if (RoundUp(p, unit) > cfg.capacity) {
      step.skipped_ids.push_back(static_cast<int64_t>(id));
      continue;
    }
    if (fill + p > cfg.capacity || (cfg.sp && RoundUp(fill + p, unit) > cfg.capacity)) {
      close_microbatch();
    }
    len.push_back(lengths[id]);
    fill += p;
  }
  // A partial last step is dropped: every step has the same M, as pipeline schedules need.
  return steps;
}

struct Row {
  double bytes_per_seq = 0, naive_per_seq = 0, seq_per_step = 0;
  // Least-squares fit of message bytes against sequences per message over the steps: the
  // slope is the cost of one more sequence, the intercept the per-message fixed part.
  double marginal_per_seq = 0, fixed_bytes = 0;
  double enc_seq_s = 0, dec_seq_s = 0, msg_s = 0, mb_s = 0;
  size_t steps = 0;
};

// Runs `body` over all steps until `min_time` has passed; returns seconds per pass.
template <typename F>
double TimePasses(double min_time, F&& body) {
  int passes = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    body();
    ++passes;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < min_time);
  return elapsed / passes;
}

Row Measure(const std::vector<StepMeta>& steps, double min_time) {
  Row row;
  row.steps = steps.size();
  std::vector<std::vector<uint8_t>> encoded(steps.size());
  size_t bytes = 0, sequences = 0, naive = 0;
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t s = 0; s < steps.size(); ++s) {
    auto e = thdpack::EncodeStepMeta(steps[s]);
    if (!e.ok()) {
      std::fprintf(stderr, "encode failed: %s\n", e.status().ToString().c_str());
      std::exit(1);
    }
    encoded[s] = std::move(*e);
    auto d = thdpack::DecodeStepMeta(encoded[s]);
    if (!d.ok() || !(*d == steps[s])) {
      std::fprintf(stderr, "round trip failed at step %zu\n", s);
      std::exit(1);
    }
    bytes += encoded[s].size();
    size_t n = 0;
    for (const auto& mb : steps[s].microbatches) {
      n += mb.cu_seqlens.size() - 1;
      naive += 2 * 4 * mb.cu_seqlens.size();
    }
    sequences += n;
    const double x = static_cast<double>(n), y = static_cast<double>(encoded[s].size());
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double k = static_cast<double>(steps.size());
  if (k * sxx - sx * sx > 0) {
    row.marginal_per_seq = (k * sxy - sx * sy) / (k * sxx - sx * sx);
    row.fixed_bytes = (sy - row.marginal_per_seq * sx) / k;
  }
  if (sequences == 0) return row;
  row.bytes_per_seq = static_cast<double>(bytes) / static_cast<double>(sequences);
  row.naive_per_seq = static_cast<double>(naive) / static_cast<double>(sequences);
  row.seq_per_step = static_cast<double>(sequences) / static_cast<double>(steps.size());
  const double enc = TimePasses(min_time, [&] {
    for (const auto& s : steps) {
      auto e = thdpack::EncodeStepMeta(s);
      benchmark::DoNotOptimize(e);
    }
  });
  const double dec = TimePasses(min_time, [&] {
    for (const auto& b : encoded) {
      auto d = thdpack::DecodeStepMeta(b);
      benchmark::DoNotOptimize(d);
    }
  });
  row.enc_seq_s = static_cast<double>(sequences) / enc;
  row.dec_seq_s = static_cast<double>(sequences) / dec;
  row.msg_s = static_cast<double>(steps.size()) / (enc + dec);
  row.mb_s = static_cast<double>(bytes) / (enc + dec) / 1e6;
  return row;
}

void CrcTable(double min_time) {
  std::vector<uint8_t> buf(1 << 20);
  std::mt19937_64 rng(3);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  const uint32_t want = thdpack::crc32c::ExtendReference(~0u, buf.data(), buf.size());
  std::printf("\nCRC-32C over 1 MiB (each path checked against the bitwise reference first)\n");
  std::printf("%-22s %10s %8s\n", "path", "GB/s", "vs ref");
  struct Path {
    const char* name;
    uint32_t (*fn)(uint32_t, const uint8_t*, size_t);
  };
  std::vector<Path> paths = {{"reference (bitwise)", thdpack::crc32c::ExtendReference},
                             {"slicing-by-8", thdpack::crc32c::ExtendPortable}};
  if (thdpack::crc32c::HardwareAvailable()) {
    paths.push_back({"sse4.2 crc32", thdpack::crc32c::ExtendHardware});
    // What thdpack::Crc32c runs on such a CPU: three streams at once.
    paths.push_back({"sse4.2 crc32 x3", thdpack::crc32c::ExtendHardwareInterleaved});
  }
  double ref_gbs = 0;
  for (const auto& p : paths) {
    if (p.fn(~0u, buf.data(), buf.size()) != want) {
      std::printf("%-22s MISMATCH against the reference\n", p.name);
      continue;
    }
    const double t = TimePasses(min_time / 4, [&] {
      uint32_t c = p.fn(~0u, buf.data(), buf.size());
      benchmark::DoNotOptimize(c);
    });
    const double gbs = static_cast<double>(buf.size()) / t / 1e9;
    if (ref_gbs == 0) ref_gbs = gbs;
    std::printf("%-22s %10.2f %7.0fx\n", p.name, gbs, gbs / ref_gbs);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string data_dir = thdpack_bench::DataDir();
  size_t max_docs = 200000;
  double min_time = 0.2;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a.starts_with("--data_dir=")) data_dir = std::string(a.substr(11));
    else if (a.starts_with("--max_docs=")) max_docs = std::strtoull(argv[i] + 11, nullptr, 10);
    else if (a.starts_with("--min_time=")) min_time = std::strtod(argv[i] + 11, nullptr);
    else {
      std::fprintf(stderr, "usage: wire_bench [--data_dir=DIR] [--max_docs=N] [--min_time=S]\n");
      return 2;
    }
  }
  const int kMicrobatchesPerStep = 8;
  std::printf("Step metadata on the wire (thdpack/wire.h v%d): %d microbatches per step, next-fit\n"
              "in file order, documents over the microbatch budget skipped (sent as ids).\n"
              "naive = two int32 cu_seqlens arrays per microbatch (8 bytes/sequence + 8).\n"
              "marg. B/seq and fixed B: least-squares fit of message bytes against sequences per\n"
              "message over the steps (the cost of one more sequence, and of the message itself).\n"
              "Throughput: one thread; msg/s and MB/s are for encode + decode of each message.\n\n",
              thdpack::kStepMetaVersion, kMicrobatchesPerStep);
  std::printf("%-10s %3s %-7s %6s %6s %8s %7s %6s %7s %7s %6s %9s %9s %9s %8s\n", "dataset",
              "CP", "TP/SP", "mb tok", "steps", "seq/step", "B/seq", "marg.", "fixed B", "naive",
              "ratio", "enc Mseq/s", "dec Mseq/s", "rt msg/s", "rt MB/s");
  const char* datasets[] = {"wlbllm", "wikipedia"};
  const Config configs[] = {
      {1, 1, false, 32 << 10}, {1, 1, false, 128 << 10}, {2, 1, false, 32 << 10},
      {2, 1, false, 128 << 10}, {4, 1, false, 32 << 10}, {4, 1, false, 128 << 10},
      {8, 1, false, 32 << 10}, {8, 1, false, 128 << 10}, {4, 8, true, 128 << 10},
  };
  for (const char* name : datasets) {
    bool from_file = false;
    const std::string path = data_dir + "/" + name + "_doc_lengths.txt";
    const std::vector<int64_t> lengths = LoadLengths(path, max_docs, &from_file);
    if (!from_file) {
      std::printf("(%s not found: lognormal mean 4096, sigma 1 instead)\n", path.c_str());
    }
    for (const Config& cfg : configs) {
      const auto steps = BuildSteps(lengths, cfg, kMicrobatchesPerStep);
      const Row r = Measure(steps, min_time);
      char tpsp[16];
      std::snprintf(tpsp, sizeof(tpsp), "%d/%s", cfg.tp, cfg.sp ? "sp" : "-");
      std::printf("%-10s %3d %-7s %5lldK %6zu %8.1f %7.3f %6.3f %7.1f %7.3f %5.2fx %9.2f %9.2f "
                  "%9.0f %8.1f\n",
                  from_file ? name : "lognormal", cfg.cp, tpsp,
                  static_cast<long long>(cfg.capacity >> 10), r.steps, r.seq_per_step,
                  r.bytes_per_seq, r.marginal_per_seq, r.fixed_bytes, r.naive_per_seq, r.naive_per_seq / r.bytes_per_seq,
                  r.enc_seq_s / 1e6, r.dec_seq_s / 1e6, r.msg_s, r.mb_s);
    }
  }
  CrcTable(min_time);
  return 0;
}
