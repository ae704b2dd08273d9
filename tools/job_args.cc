#include "job_args.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace thdpack::tools {

void AddJobOptions(CLI::App* cmd, JobArgs* a) {
  JobOptions& o = a->options;
  a->app = cmd;
  cmd->add_option("--data", o.data,
                  "Data source: mock | mock:FILE.json | lengths:FILE | histogram:FILE | "
                  "jsonl:FILE | megatron:PREFIX | blend:FILE.json | parquet:PATH | arrow:PATH "
                  "(PATH a file, a folder or a glob; Parquet and Arrow need a build with "
                  "Arrow C++)")
      ->capture_default_str();
  cmd->add_option("--dp", o.dp, "Data-parallel size (replicas)")->capture_default_str();
  cmd->add_option("--cp", o.cp, "Context-parallel size")->capture_default_str();
  cmd->add_option("--tp", o.tp, "Tensor-parallel size (matters with --sp)")
      ->capture_default_str();
  cmd->add_option("--pp", o.pp, "Pipeline-parallel size (use --microbatch-multiple for "
                                "pipeline groups)")
      ->capture_default_str();
  cmd->add_option("--rank-order", o.rank_order,
                  "How world ranks map to coordinates: a '-'-separated permutation of tp, cp, "
                  "dp, pp, fastest first (Megatron's default tp-cp-dp-pp)")
      ->capture_default_str();
  cmd->add_flag("--sp", o.sp, "Sequence parallelism: T/CP must be a multiple of TP");
  cmd->add_option("--align", o.align,
                  "Extra per-sequence alignment, multiplying the 2*CP padding multiple")
      ->capture_default_str();
  cmd->add_option("--rank-multiple", a->rank_multiple,
                  "Each rank's tokens of a microbatch (T/CP; T/(CP*TP) with --sp) a multiple of "
                  "this, the tail on the last sequence: fp8 (16) | mxfp8 (32) | blockwise (128) "
                  "| N")
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", o.max_tokens_per_rank,
                  "Padded tokens one CP rank may hold in one microbatch")
      ->capture_default_str();
  a->global_batch_option =
      cmd->add_option("--global-batch", a->global_batch,
                      "Samples per step over all replicas, or \"all\" (one whole epoch per step)")
          ->capture_default_str();
  cmd->add_option("--global-batch-tokens", o.global_batch_tokens,
                  "Count each step in tokens instead: samples in stream order while their real "
                  "tokens stay within this (a sample alone over it forms its own step, and a "
                  "step holds at least one sample for each microbatch); replaces --global-batch");
  a->steps_option = cmd->add_option(
      "--steps", a->steps,
      "Steps (default 3, or 1 with --global-batch all; the source wraps into the next epoch)");
  cmd->add_option("--scheduler", o.scheduler,
                  "balanced | sequential | dynamic (a CP group per microbatch and sequence; "
                  "needs a model --cost)")
      ->capture_default_str();
  cmd->add_option("--cp-sizes", o.cp_sizes,
                  "Group sizes of --scheduler dynamic: any (1 to DP*CP) | pow2")
      ->capture_default_str();
  cmd->add_option("--max-cp-groups", o.max_cp_groups,
                  "CP process groups a dynamic run keeps across steps (those unused longest "
                  "are dropped)")
      ->capture_default_str();
  cmd->add_option("--hw", o.hw,
                  "Hardware of the step-time model (sim_step_time): h100-ib (R=400e12 FLOP/s, "
                  "B=25e9 B/s) | h100-nvlink (B=200e9) | R,B")
      ->capture_default_str();
  cmd->add_option("--cost", o.cost,
                  "Cost model: tokens | llama2-7b | llama3-8b | A,B | "
                  "l=..,h=..,nh=..,nkv=..,f=..,v=.. (FLOPs are shown for models)")
      ->capture_default_str();
  cmd->add_option("--microbatch-multiple", o.microbatch_multiple,
                  "The number of microbatches is a multiple of this (pipeline/VPP groups)")
      ->capture_default_str();
  cmd->add_option("--num-microbatches", o.num_microbatches,
                  "Fix the number of microbatches (0: the scheduler chooses)")
      ->capture_default_str();
  cmd->add_option("--oversize", o.oversize,
                  "A sample longer than CP * max tokens per rank: error | skip (reported) | "
                  "truncate (keeps the first tokens that fit; the tokens and targets cut are "
                  "reported) | split (pieces that fit, each a sample; the targets lost at the "
                  "cuts are reported)")
      ->capture_default_str();
  cmd->add_flag("--pad-to-max-tokens", o.pad_to_max_tokens,
                "Static shapes: every microbatch holds exactly CP * max tokens per rank tokens "
                "(the last sequence takes the padding)");
  cmd->add_option("--max-seqs-per-microbatch", o.max_seqs,
                  "Static shapes: at most this many sequences in a microbatch, cu_seqlens "
                  "always this + 1 long (0: no cap)")
      ->capture_default_str();
  cmd->add_option("--seed", o.source.seed, "Seed of mock lengths and tokens and of --shuffle")
      ->capture_default_str();
  cmd->add_flag("--shuffle", o.source.shuffle, "Visit each epoch in a seeded random order");
  cmd->add_option("--vocab", o.source.vocab_size,
                  "Vocabulary of the data: token ids are checked to be below it (0: unknown)")
      ->capture_default_str();
  a->mock_samples_option =
      cmd->add_option("--mock-samples", o.source.mock_num_samples,
                      "Samples per epoch of a lognormal mock (0: default)")
          ->capture_default_str();
  cmd->add_option("--vocab-size", o.vocab_size,
                  "The model's vocabulary V for the logits memory figures (0: the --cost "
                  "model's V; none for tokens and A,B)")
      ->capture_default_str();
  a->logits_dtype_option =
      cmd->add_option("--logits-dtype", o.logits_dtype,
                      "dtype of the logits in the memory figures: bf16, fp32 or fp64")
          ->capture_default_str();
  a->fused_grad_option = cmd->add_flag("--fused-grad", o.fused_grad,
                "Count the logits gradient fused with the loss (a second buffer of the logits' "
                "shape) in the memory figures");
  cmd->add_option("--start-step", o.start_step,
                  "First step (its samples are those of the same step of a run from 0 with "
                  "this --global-batch; reached without replaying the steps before it)")
      ->capture_default_str();
  cmd->add_option("--resume", o.resume,
                  "Continue from a run state saved by --save-state: its step and stream "
                  "position, on any topology and global batch (a state of other data, seed or "
                  "shuffle is refused)");
  cmd->add_option("--save-state", o.save_state,
                  "Write the run state to FILE atomically (run: after every step, by rank 0; "
                  "plan: after the last step), for --resume");
  cmd->add_option("--memory-limit", a->memory_limit,
                  "Bytes one step may need (K, M, G, T suffixes: KiB..TiB); a step needing more "
                  "is an error before anything is allocated (0: the physical memory)")
      ->capture_default_str();
}

namespace {

bool Given(const CLI::Option* option) { return option != nullptr && option->count() > 0; }

bool EndsWith(const std::string& s, std::string_view end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

}  // namespace

Result<Job> ResolveJobArgs(const JobArgs& args, const char* verb) {
  JobOptions options = args.options;
  if (args.app != nullptr) {
    options.given.emplace();
    for (std::string_view name : kJobOptionNames) {
      if (Given(args.app->get_option_no_throw(JobOptionFlag(name)))) {
        options.given->emplace_back(name);
      }
    }
  }
  THDPACK_ASSIGN_OR_RETURN(options.global_batch, ParseGlobalBatch(args.global_batch));
  if (options.global_batch_tokens != 0 && Given(args.global_batch_option)) {
    return Status::InvalidArgument("--global-batch-tokens and --global-batch both say how large "
                                   "a step is: give one");
  }
  THDPACK_ASSIGN_OR_RETURN(options.memory_limit, ParseMemoryLimit(args.memory_limit));
  Result<int64_t> rank_multiple = ParseRankMultiple(args.rank_multiple);
  if (!rank_multiple.ok()) return rank_multiple.status().WithContext("--rank-multiple");
  options.rank_multiple = *rank_multiple;
  if (Given(args.steps_option)) options.steps = args.steps;
  // Megatron's files are PREFIX.idx and PREFIX.bin; a user often names one of them.
  const Result<SourceKind> kind = SourceKindOf(options.data);
  if (kind.ok() && *kind == SourceKind::kMegatron &&
      (EndsWith(options.data, ".idx") || EndsWith(options.data, ".bin"))) {
    const std::string given = options.data;
    options.data.resize(options.data.size() - 4);
    std::fprintf(stderr,
                 "thdpack %s: note: --data %s: taking %s as the prefix (megatron:PREFIX reads "
                 "PREFIX.idx and PREFIX.bin)\n",
                 verb, given.c_str(), options.data.c_str());
  }
  if (Given(args.mock_samples_option) && !(kind.ok() && *kind == SourceKind::kMock)) {
    return Status::InvalidArgument("--mock-samples: only a mock source has it, and --data is " +
                                   options.data);
  }
  THDPACK_ASSIGN_OR_RETURN(Job job, ResolveJob(options));
  if (job.memory.vocab_size == 0) {
    for (const CLI::Option* option : {args.logits_dtype_option, args.fused_grad_option}) {
      if (Given(option)) {
        return Status::InvalidArgument(
            option->get_name() + ": there are no logits figures without a vocabulary (pass "
            "--vocab-size, or a model --cost; --cost " + options.cost + " has none)");
      }
    }
  }
  return job;
}

ProgressBar::ProgressBar(int64_t total)
    : total_(total), on_(isatty(STDERR_FILENO) != 0 && total > 1) {}

void ProgressBar::Clear() {
  if (on_) std::fputs("\r\033[K", stderr);
}

void ProgressBar::Update(int64_t done) {
  if (!on_) return;
  const int width = 30;
  const int filled = static_cast<int>(width * done / total_);
  std::fprintf(stderr, "\r[%s%s] step %lld/%lld",
               std::string(static_cast<size_t>(filled), '#').c_str(),
               std::string(static_cast<size_t>(width - filled), '.').c_str(),
               static_cast<long long>(done), static_cast<long long>(total_));
  if (done == total_) std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
}

}  // namespace thdpack::tools
