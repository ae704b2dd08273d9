// StepReader: N samples per step from a streaming source, wrapping around at its end.
#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/step.h"

namespace thdpack {

Result<std::unique_ptr<SampleSource>> OpenStepSource(std::string_view spec,
                                                     const SourceOptions& options,
                                                     const ScheduleOptions& schedule) {
  THDPACK_ASSIGN_OR_RETURN(std::unique_ptr<SampleSource> source, OpenSource(spec, options));
  if (schedule.oversize != ScheduleOptions::OversizePolicy::kSplit) return source;
  THDPACK_ASSIGN_OR_RETURN(const int64_t longest, LongestKept(schedule));
  return OpenSplitSource(std::move(source), longest);
}

Result<TokenSteps> TokenStepsFor(int64_t tokens, const ScheduleOptions& options) {
  if (tokens < 0) {
    return Status::InvalidArgument("global batch tokens must be >= 1 (0: count samples); got " +
                                   std::to_string(tokens));
  }
  TokenSteps out;
  if (tokens == 0) return out;
  out.tokens = tokens;
  out.min_samples = MinStepSamples(options);
  if (options.oversize == ScheduleOptions::OversizePolicy::kSkip) {
    THDPACK_ASSIGN_OR_RETURN(out.longest_counted, LongestKept(options));
  }
  return out;
}

Result<StepReader> StepReader::Create(SampleSource* source, int64_t global_batch, int dp_size,
                                      TokenSteps tokens) {
  if (source == nullptr) return Status::InvalidArgument("StepReader: source is null");
  if (tokens.tokens < 0) {
    return Status::InvalidArgument("global batch tokens must be >= 1 (0: count samples); got " +
                                   std::to_string(tokens.tokens));
  }
  if (tokens.tokens > 0 && (tokens.min_samples < 1 || tokens.longest_counted < 1)) {
    return Status::InvalidArgument(
        "StepReader: a token step's min_samples (" + std::to_string(tokens.min_samples) +
        ") and longest_counted (" + std::to_string(tokens.longest_counted) + ") must be >= 1");
  }
  if (tokens.tokens > 0) global_batch = 1;  // unused: the step ends by its tokens
  if (global_batch < 0) {
    return Status::InvalidArgument("global batch must be >= 1 samples, or \"all\" (0); got " +
                                   std::to_string(global_batch));
  }
  if (dp_size < 1) {
    return Status::InvalidArgument("DP size must be >= 1; got " + std::to_string(dp_size));
  }
  if (global_batch == 0 && source->endless()) {
    return Status::InvalidArgument("global batch \"all\" reads one epoch a step, but data "
                                   "source " + source->spec() + " has no end (a blend): give "
                                   "the global batch as a number of samples");
  }
  return StepReader(source, global_batch, dp_size, tokens);
}

// The wrap-around lives here only. global_batch 0: one whole epoch, then Reset (the previous
// "all" step ended with a Reset, so this starts an epoch). N >= 1: N samples, with a Reset at
// the end of the source; two ends in a row with nothing between = an empty source. A run of
// positions read as lengths only (all of them for Next, the DP - 1 between a loader's own for
// NextShare) is read with one NextLengths call per kLengthBatch. Tokens (B > 0): positions are
// read one at a time, the source's cursor kept before each; the first that TokenSteps refuses
// (it would take the step over B, and the step already holds min_samples that count) is put
// back (Seek to that cursor) and starts the next step.
template <typename Full, typename Take>
Result<int64_t> StepReader::ReadStep(const Full& full, const Take& take) {
  constexpr int64_t kLengthBatch = 1024;
  const std::string empty_message =
      "data source \"" + source_->spec() + "\" holds no samples (a step needs at least one)";
  int64_t epoch = source_->epoch();
  const int64_t empty_before = source_->skipped_empty();
  const SplitCounts split_before = source_->split_counts();
  std::array<SampleLength, kLengthBatch> batch;
  int64_t i = 0;
  bool wrapped = false;  // the last read hit the end of the source
  const bool by_tokens = tokens_.tokens > 0;
  int64_t tokens = 0;   // by_tokens: real tokens of the samples taken
  int64_t counted = 0;  // by_tokens: samples taken no longer than tokens_.longest_counted
  int64_t counted_at_reset = -1;  // `counted` at the step's last Reset (none yet: -1)
  // by_tokens: the cursor before the position read next - before the Reset when the read
  // follows one, so that a sample put back leaves the source where a sample count would (the
  // end of the epoch, not the start of the next: the same stream point, one representation).
  SourceCursor before;
  while (by_tokens || global_batch_ == 0 || i < global_batch_) {
    int64_t got = 0;
    std::optional<Sample> sample;
    if (by_tokens && !wrapped) before = source_->cursor();
    if (full(i)) {
      THDPACK_ASSIGN_OR_RETURN(sample, source_->Next());
      if (sample) {
        batch[0] = SampleLength{sample->id, static_cast<int64_t>(sample->tokens.size()),
                                NumTargets(*sample)};
        got = 1;
      }
    } else {
      int64_t run = 1;  // positions i .. i + run - 1 are read as lengths
      while (!by_tokens && run < kLengthBatch && (global_batch_ == 0 || i + run < global_batch_) &&
             !full(i + run)) {
        ++run;
      }
      THDPACK_ASSIGN_OR_RETURN(got, source_->NextLengths(std::span(batch).first(
                                        static_cast<size_t>(run))));
    }
    if (got == 0) {
      // "all" ends at the end of the epoch, unless the step starts there (a reader started at
      // a position saved by a run with a numeric batch): it then reads the next epoch whole.
      if (global_batch_ == 0 && (i > 0 || wrapped)) break;
      if (wrapped) return Status::InvalidArgument(empty_message);
      if (by_tokens && counted == counted_at_reset) {  // a whole epoch gave no sample that counts
        return Status::InvalidArgument(
            "data source \"" + source_->spec() + "\" holds no sample of at most " +
            std::to_string(tokens_.longest_counted) + " tokens (the longest a step keeps): a "
            "token step cannot give its " + std::to_string(tokens_.min_samples) +
            " microbatches a sample each");
      }
      counted_at_reset = counted;
      THDPACK_RETURN_IF_ERROR(source_->Reset());
      wrapped = true;
      continue;
    }
    wrapped = false;
    if (by_tokens) {
      const int64_t length = batch[0].length;
      if (i > 0 && counted >= tokens_.min_samples && tokens > tokens_.tokens - length) {
        THDPACK_RETURN_IF_ERROR(source_->Seek(before));  // the next step's first sample
        break;
      }
      tokens += length;
      if (length <= tokens_.longest_counted) ++counted;
    }
    if (i == 0) epoch = source_->epoch();
    for (int64_t k = 0; k < got; ++k) {
      THDPACK_RETURN_IF_ERROR(take(i, batch[static_cast<size_t>(k)], sample ? &*sample : nullptr));
      ++i;
    }
  }
  if (i == 0) return Status::InvalidArgument(empty_message);
  if (global_batch_ == 0) THDPACK_RETURN_IF_ERROR(source_->Reset());
  last_n_empty_ = source_->skipped_empty() - empty_before;
  const SplitCounts split_after = source_->split_counts();
  last_split_ = SplitCounts{split_after.samples - split_before.samples,
                            split_after.pieces - split_before.pieces,
                            split_after.lost_targets - split_before.lost_targets};
  consumed_ += i;
  return epoch;
}

Status StepReader::Start(int64_t next_step, int64_t consumed,
                         const std::optional<SourceCursor>& cursor) {
  if (next_step < 0 || consumed < -1 || (consumed == -1 && cursor.has_value())) {
    return Status::InvalidArgument("StepReader::Start: step " + std::to_string(next_step) +
                                   " after " + std::to_string(consumed) +
                                   " samples (a step >= 0, a count >= 0 or -1 without a cursor)");
  }
  if (consumed == -1 && tokens_.tokens > 0) {
    // Token steps: the first next_step steps of a run from 0, read as lengths.
    THDPACK_ASSIGN_OR_RETURN(SourceCursor zero, source_->CursorAfter(0));
    THDPACK_RETURN_IF_ERROR(source_->Seek(zero));
    consumed_ = 0;
    for (int64_t s = 0; s < next_step; ++s) {
      THDPACK_RETURN_IF_ERROR(ReadStep([](int64_t) { return false; },
                                       [](int64_t, const SampleLength&, Sample*) {
                                         return Status::Ok();
                                       })
                                  .status());
    }
    next_step_ = next_step;
    return Status::Ok();
  }
  if (consumed == -1 && global_batch_ > 0 &&
      __builtin_mul_overflow(next_step, global_batch_, &consumed)) {
    return Status::OutOfRange("StepReader::Start: step " + std::to_string(next_step) + " x " +
                              std::to_string(global_batch_) + " samples overflows int64");
  }
  SourceCursor at;
  if (cursor.has_value()) {
    if (cursor->samples() != consumed) {
      return Status::InvalidArgument(
          "StepReader::Start: the cursor has " + std::to_string(cursor->samples()) +
          " samples behind it, the position says " + std::to_string(consumed) + " consumed");
    }
    at = *cursor;
  } else if (consumed == -1) {  // "all": one epoch a step
    THDPACK_ASSIGN_OR_RETURN(at, source_->CursorAtEpoch(next_step));
  } else {
    THDPACK_ASSIGN_OR_RETURN(at, source_->CursorAfter(consumed));
  }
  THDPACK_RETURN_IF_ERROR(source_->Seek(at));
  next_step_ = next_step;
  consumed_ = at.samples();
  return Status::Ok();
}

// Samples land straight at their place in scheduling order when the step's size is known
// before reading it (N, or the source's size for "all"): no source-order copy. Should the
// source hold another count than it said, the samples are put back in source order and
// reordered by ToSchedulingOrder, the plain reference.
Result<StepSamples> StepReader::Next() {
  StepSamples out;
  out.step = next_step_;
  int64_t expected = tokens_.tokens > 0 ? 0 : global_batch_;
  if (expected == 0 && tokens_.tokens == 0) {
    const std::optional<int64_t> hint = source_->size_hint();
    expected = hint.has_value() && *hint > 0 ? *hint : 0;
  }
  std::vector<int64_t> start(static_cast<size_t>(dp_size_));  // loader d's first place
  for (int d = 1; d < dp_size_; ++d) {
    start[static_cast<size_t>(d)] = start[static_cast<size_t>(d - 1)] +
                                    LoaderCount(expected, dp_size_, d - 1);
  }
  std::vector<SampleLength>& placed = out.samples;
  placed.resize(static_cast<size_t>(expected));
  std::vector<SampleLength> beyond;  // samples past `expected` (a wrong size hint)
  int loader = 0;
  int64_t round = 0;  // sample i = round * DP + loader
  THDPACK_ASSIGN_OR_RETURN(
      out.epoch, ReadStep([](int64_t) { return false; },
                          [&](int64_t i, const SampleLength& s, Sample*) {
                            if (i < expected) {
                              placed[static_cast<size_t>(start[static_cast<size_t>(loader)] +
                                                         round)] = s;
                              if (++loader == dp_size_) {
                                loader = 0;
                                ++round;
                              }
                            } else {
                              beyond.push_back(s);
                            }
                            return Status::Ok();
                          }));
  out.n_empty = last_n_empty_;
  out.split = last_split_;
  const int64_t read = static_cast<int64_t>(beyond.size()) +
                       std::min(expected, round * dp_size_ + loader);
  if (read != expected) {
    std::vector<SampleLength> source_order;
    source_order.reserve(static_cast<size_t>(read));
    for (int64_t i = 0; i < std::min(read, expected); ++i) {
      const int d = static_cast<int>(i % dp_size_);
      source_order.push_back(placed[static_cast<size_t>(start[static_cast<size_t>(d)] + i / dp_size_)]);
    }
    source_order.insert(source_order.end(), beyond.begin(), beyond.end());
    out.samples = ToSchedulingOrder(source_order, dp_size_);
  }
  ++next_step_;
  return out;
}

Result<StepShare> StepReader::NextShare(int loader) {
  if (loader < 0 || loader >= dp_size_) {
    return Status::InvalidArgument("StepReader::NextShare: loader " + std::to_string(loader) +
                                   " is outside [0, DP = " + std::to_string(dp_size_) + ")");
  }
  StepShare out;
  out.step = next_step_;
  auto mine = [this, loader](int64_t i) { return i % dp_size_ == loader; };
  auto take = [&](int64_t i, const SampleLength& s, Sample* sample) {
    if (i == 0) {
      out.first_id = s.id;
    } else if (s.id < out.first_id + out.id_span) {
      return Status::Internal("source " + source_->spec() + ": sample " + std::to_string(i) +
                              " of step " + std::to_string(out.step) + " has id " +
                              std::to_string(s.id) + ", expected increasing ids after " +
                              std::to_string(out.first_id + out.id_span - 1));
    }
    if (i >= INT32_MAX || s.id - out.first_id >= INT32_MAX) {
      return Status::OutOfRange("step " + std::to_string(out.step) +
                                " holds more than 2^31 - 1 samples or ids");
    }
    out.id_span = s.id - out.first_id + 1;
    if (sample != nullptr) out.samples.push_back(std::move(*sample));
    out.n = i + 1;
    return Status::Ok();
  };
  THDPACK_ASSIGN_OR_RETURN(out.epoch, ReadStep(mine, take));
  out.n_empty = last_n_empty_;
  out.split = last_split_;
  ++next_step_;
  return out;
}

std::vector<int64_t> LoaderIndices(int64_t n, int dp_size, int loader) {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(LoaderCount(n, dp_size, loader)));
  for (int64_t i = loader; i < n; i += dp_size) out.push_back(i);
  return out;
}

Result<FedShares> FedShares::Create(int64_t global_batch, int dp_size) {
  if (global_batch < 1) {
    return Status::InvalidArgument("a caller-fed source needs global_batch >= 1, got " +
                                   std::to_string(global_batch));
  }
  if (dp_size < 1) {
    return Status::InvalidArgument("dp_size = " + std::to_string(dp_size) + " must be >= 1");
  }
  return FedShares(global_batch, dp_size);
}

int64_t FedShares::Count(int loader) const { return LoaderCount(global_batch_, dp_size_, loader); }

std::vector<int64_t> FedShares::Positions(int64_t first_position, int loader) const {
  std::vector<int64_t> out = LoaderIndices(global_batch_, dp_size_, loader);
  for (int64_t& p : out) p += first_position;
  return out;
}

std::optional<FedShares::Slot> FedShares::SlotOf(int64_t first_position, int64_t id) const {
  const int64_t offset = id - first_position;
  if (offset < 0 || offset >= global_batch_) return std::nullopt;
  return Slot{static_cast<int>(offset % dp_size_), offset / dp_size_};
}

Result<StepShare> FedShares::Share(int64_t step, int64_t first_position, int loader,
                                   std::vector<Sample> samples,
                                   std::span<const int64_t> given_positions) const {
  const std::string where =
      "source of loader dp=" + std::to_string(loader) + ", step " + std::to_string(step);
  const int64_t want = Count(loader);
  const int64_t got = static_cast<int64_t>(samples.size());
  const std::string rule = " (loader d gives samples d, d + DP, d + 2 DP, ... of each batch)";
  if (got < want) {
    return Status::InvalidArgument(where + ": ended after " + std::to_string(got) + " of the " +
                                   std::to_string(want) + " samples of its share of the batch of " +
                                   std::to_string(global_batch_) + " over DP " +
                                   std::to_string(dp_size_) + rule);
  }
  if (got > want) {
    return Status::InvalidArgument(where + ": holds " + std::to_string(got) +
                                   " samples; its share of the batch of " +
                                   std::to_string(global_batch_) + " over DP " +
                                   std::to_string(dp_size_) + " is " + std::to_string(want) +
                                   rule);
  }
  if (!given_positions.empty() && given_positions.size() != samples.size()) {
    return Status::InvalidArgument(where + ": " + std::to_string(given_positions.size()) +
                                   " positions for " + std::to_string(got) + " samples");
  }
  const std::vector<int64_t> positions = Positions(first_position, loader);
  for (size_t k = 0; k < samples.size(); ++k) {
    const int64_t said = given_positions.empty() ? kNotGiven : given_positions[k];
    if (said != kNotGiven && said != positions[k]) {
      return Status::InvalidArgument(
          where + ", sample " + std::to_string(k) + ": position " + std::to_string(said) +
          ", expected " + std::to_string(positions[k]) +
          " (this loader's iterable must yield loader_positions(state, global_batch, DP, dp) "
          "from the run's state: it resumes after " +
          std::to_string(first_position) + " samples)");
    }
    samples[k].id = positions[k];
  }
  StepShare share;
  share.step = step;
  share.n = global_batch_;
  share.first_id = first_position;
  share.samples = std::move(samples);
  return share;
}

int64_t LoaderCount(int64_t n, int dp_size, int loader) {
  return loader < n ? (n - loader + dp_size - 1) / dp_size : 0;
}

int64_t LoaderOffset(int64_t n, int dp_size, int loader) {
  int64_t offset = 0;
  for (int d = 0; d < loader; ++d) offset += LoaderCount(n, dp_size, d);
  return offset;
}

std::vector<SampleLength> ToSchedulingOrder(const std::vector<SampleLength>& source_order,
                                            int dp_size) {
  const int64_t n = static_cast<int64_t>(source_order.size());
  std::vector<SampleLength> out;
  out.reserve(source_order.size());
  for (int d = 0; d < dp_size; ++d) {
    for (int64_t i = d; i < n; i += dp_size) out.push_back(source_order[static_cast<size_t>(i)]);
  }
  return out;
}

}  // namespace thdpack
