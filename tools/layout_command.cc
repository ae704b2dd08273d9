// thdpack layout: the padded THD layout of a list of sequence lengths and which global token
// indices each (cp, tp) rank holds. Users debug context-parallel layouts with it.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "exit_code.h"
#include "thdpack/pack.h"
#include "thdpack/shard.h"

namespace thdpack::tools {
namespace {

struct LayoutArgs {
  std::string lengths;
  int cp = 1;
  int tp = 1;
  bool sp = false;
  int64_t align = 1;
  std::string rank_multiple = "1";  // ParseRankMultiple's text
  bool json = false;
};

// "7,3" -> {7, 3}; errors name the item.
Result<std::vector<int64_t>> ParseLengths(const std::string& text) {
  std::vector<int64_t> out;
  size_t pos = 0;
  int item = 0;
  while (pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string s = text.substr(pos, end - pos);
    size_t used = 0;
    long long v = 0;
    bool good = !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
    if (good) {
      try {
        v = std::stoll(s, &used);
      } catch (...) {
        good = false;
      }
    }
    if (!good || used != s.size() || v < 1) {
      return Status::InvalidArgument("--lengths: item " + std::to_string(item) + " \"" + s +
                                     "\" is not a positive integer");
    }
    out.push_back(v);
    ++item;
    pos = end + 1;
  }
  return out;
}

std::string JoinInts(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

// Global token ranges [begin, end) of a sorted index list, for compact printing.
std::string Ranges(std::span<const int32_t> idx) {
  std::string s;
  size_t i = 0;
  while (i < idx.size()) {
    size_t j = i;
    while (j + 1 < idx.size() && idx[j + 1] == idx[j] + 1) ++j;
    if (!s.empty()) s += " ";
    s += std::to_string(idx[i]);
    if (j > i) s += "-" + std::to_string(idx[j]);
    i = j + 1;
  }
  return s;
}

// Sequences longer than this are drawn as runs ("0x512") instead of one label per token.
constexpr int32_t kMaxStripTokens = 64;

struct RankIndices {
  int cp_rank;
  int tp_rank;
  std::vector<int32_t> indices;
};

int RunLayout(const LayoutArgs& args) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "thdpack layout: %s\n", s.ToString().c_str());
    return ExitCodeOf(s);
  };
  auto lengths = ParseLengths(args.lengths);
  if (!lengths.ok()) return fail(lengths.status());
  if (args.sp && args.tp == 1) {
    return fail(Status::InvalidArgument(
        "--sp: sequence parallelism splits each CP shard over the TP ranks, so it needs --tp > 1, "
        "got --tp 1"));
  }
  auto rank_multiple = ParseRankMultiple(args.rank_multiple);
  if (!rank_multiple.ok()) return fail(rank_multiple.status().WithContext("--rank-multiple"));
  auto parallel =
      ParallelLayout::Create(args.cp, args.tp, args.sp, args.align, *rank_multiple);
  if (!parallel.ok()) {
    return fail(parallel.status().WithContext("--cp/--tp/--sp/--align/--rank-multiple"));
  }
  PackOptions opts;
  opts.parallel = *parallel;
  auto layout = ComputeLayout(*lengths, opts);
  if (!layout.ok()) return fail(layout.status());

  // Which global indices each rank holds: the CP shard, then (with SP) its TP part.
  std::vector<RankIndices> ranks;
  for (int c = 0; c < args.cp; ++c) {
    auto idx = CpPartitionIndices(layout->cu_seqlens_padded, args.cp, c);
    if (!idx.ok()) return fail(idx.status());
    if (!args.sp) {
      ranks.push_back({c, 0, std::move(*idx)});
      continue;
    }
    for (int t = 0; t < args.tp; ++t) {
      auto range = SpRange(static_cast<int64_t>(idx->size()), args.tp, t);
      if (!range.ok()) return fail(range.status());
      const auto [offset, count] = *range;
      ranks.push_back({c, t, std::vector<int32_t>(idx->begin() + offset,
                                                  idx->begin() + offset + count)});
    }
  }

  if (args.json) {
    nlohmann::ordered_json j;
    j["cu_seqlens"] = layout->cu_seqlens;
    j["cu_seqlens_padded"] = layout->cu_seqlens_padded;
    j["max_seqlen"] = layout->max_seqlen;
    j["total_tokens"] = layout->total_tokens;
    j["cp_size"] = args.cp;
    j["tp_size"] = args.tp;
    j["sp"] = args.sp;
    j["rank_multiple"] = parallel->rank_multiple();
    nlohmann::ordered_json rs = nlohmann::ordered_json::array();
    for (const RankIndices& r : ranks) {
      rs.push_back({{"cp_rank", r.cp_rank}, {"tp_rank", r.tp_rank}, {"indices", r.indices}});
    }
    j["ranks"] = std::move(rs);
    std::cout << j.dump() << "\n";
    return 0;
  }

  const auto& cu = layout->cu_seqlens;
  const auto& cup = layout->cu_seqlens_padded;
  const size_t n = cu.size() - 1;
  const std::string rank_text =
      parallel->rank_multiple() > 1
          ? ", rank multiple " + std::to_string(parallel->rank_multiple())
          : std::string();
  std::printf("%zu sequences, %lld padded tokens (T), CP=%d TP=%d%s%s, max_seqlen %d\n", n,
              static_cast<long long>(layout->total_tokens), args.cp, args.tp,
              args.sp ? " with SP" : "", rank_text.c_str(), layout->max_seqlen);
  std::printf("cu_seqlens        %s\ncu_seqlens_padded %s\n\n", JoinInts(cu).c_str(),
              JoinInts(cup).c_str());

  // Owner of every global index, to draw each sequence as a strip of rank labels.
  std::vector<int> owner(static_cast<size_t>(layout->total_tokens), -1);
  for (size_t k = 0; k < ranks.size(); ++k) {
    for (int32_t i : ranks[k].indices) owner[i] = static_cast<int>(k);
  }
  auto label = [&](int k) {
    return args.sp ? std::to_string(ranks[k].cp_rank) + "." + std::to_string(ranks[k].tp_rank)
                   : std::to_string(ranks[k].cp_rank);
  };
  std::printf("owner of each token (%s; '*' marks padding; RxN = N tokens held by R):\n",
              args.sp ? "cp.tp" : "cp rank");
  for (size_t s = 0; s < n; ++s) {
    std::printf("  seq %zu  L=%d P=%d  [%d,%d):", s, cu[s + 1] - cu[s], cup[s + 1] - cup[s],
                cup[s], cup[s + 1]);
    const int32_t real_end = cup[s] + (cu[s + 1] - cu[s]);
    if (cup[s + 1] - cup[s] <= kMaxStripTokens) {
      for (int32_t i = cup[s]; i < cup[s + 1]; ++i) {
        std::printf(" %s%s", label(owner[i]).c_str(), i >= real_end ? "*" : "");
      }
    } else {
      // Long sequences: runs of one owner, "owner x count", padding counted apart.
      int32_t i = cup[s];
      while (i < cup[s + 1]) {
        int32_t j = i;
        const bool pad = i >= real_end;
        while (j < cup[s + 1] && owner[j] == owner[i] && (j >= real_end) == pad) ++j;
        std::printf(" %sx%d%s", label(owner[i]).c_str(), j - i, pad ? "*" : "");
        i = j;
      }
    }
    std::printf("\n");
  }
  std::printf("\nglobal indices held by each rank:\n");
  for (const RankIndices& r : ranks) {
    std::printf("  cp_rank %d tp_rank %d: %zu tokens: %s\n", r.cp_rank, r.tp_rank,
                r.indices.size(), Ranges(r.indices).c_str());
  }
  if (!args.sp && args.tp > 1) {
    std::printf("(no SP: every TP rank of a CP rank holds that rank's whole CP shard)\n");
  }
  return 0;
}

}  // namespace

void AddLayoutCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<LayoutArgs>();
  CLI::App* cmd = app.add_subcommand(
      "layout", "Show the padded THD layout of sequence lengths and each (cp, tp) rank's tokens");
  cmd->add_option("--lengths", args->lengths, "Sequence lengths, comma-separated (e.g. 7,3)")
      ->required();
  cmd->add_option("--cp", args->cp, "Context-parallel size")->capture_default_str();
  cmd->add_option("--tp", args->tp, "Tensor-parallel size")->capture_default_str();
  cmd->add_flag("--sp", args->sp, "Sequence parallelism: split each CP shard over the TP ranks");
  cmd->add_option("--align", args->align,
                  "Extra per-sequence alignment, multiplying the 2*CP padding multiple")
      ->capture_default_str();
  cmd->add_option("--rank-multiple", args->rank_multiple,
                  "Each rank's tokens (T/CP; T/(CP*TP) with --sp) a multiple of this, the tail "
                  "on the last sequence: fp8 (16) | mxfp8 (32) | blockwise (128) | N")
      ->capture_default_str();
  cmd->add_flag("--json", args->json,
                "Print {cu_seqlens, cu_seqlens_padded, ranks:[{cp_rank,tp_rank,indices}]} as JSON");
  cmd->callback([args, exit_code] { *exit_code = RunLayout(*args); });
}

}  // namespace thdpack::tools
