// OpenSplitSource: long samples cut into pieces (thdpack/data.h; `--oversize split`).
//
// The stream of pieces is a function of the wrapped stream and `longest` alone: a sample of L
// tokens over `longest` is replaced by n = ceil(L / longest) pieces, the ids of everything after
// it moved up by n - 1. The state beyond the wrapped source's cursor is small and goes into the
// cursor (SourceCursor::split): the next piece of the sample being cut, the ids added by the
// cuts before it, and the counts of what was cut. A cursor inside a cut sample holds the
// wrapped cursor before that sample, which Seek reads again.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/data.h"

namespace thdpack {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

class SplitSource final : public SampleSource {
 public:
  SplitSource(std::unique_ptr<SampleSource> inner, int64_t longest)
      : inner_(std::move(inner)), longest_(longest) {}

  Result<std::optional<Sample>> Next() override {
    if (!pending_.empty()) return std::optional<Sample>(TakePiece());
    before_ = inner_->cursor();
    THDPACK_ASSIGN_OR_RETURN(std::optional<Sample> s, inner_->Next());
    if (!s) return std::optional<Sample>();
    if (static_cast<int64_t>(s->tokens.size()) <= longest_) {
      s->id += extra_;
      return s;
    }
    Split(std::move(*s), 0);
    return std::optional<Sample>(TakePiece());
  }

  Result<std::optional<SampleLength>> NextLength() override {
    if (pending_.empty()) {
      before_ = inner_->cursor();
      THDPACK_ASSIGN_OR_RETURN(std::optional<SampleLength> l, inner_->NextLength());
      if (!l) return std::optional<SampleLength>();
      if (l->length <= longest_) {
        l->id += extra_;
        return l;
      }
      // A sample to cut: read whole (its pieces' targets need its mask), from before it.
      THDPACK_RETURN_IF_ERROR(inner_->Seek(before_));
      THDPACK_ASSIGN_OR_RETURN(std::optional<Sample> s, inner_->Next());
      if (!s || s->id != l->id) {
        return Status::Internal("data source " + inner_->spec() + ": sample id " + Str(l->id) +
                                " read again after a seek is not there");
      }
      Split(std::move(*s), 0);
    }
    const Sample piece = TakePiece();
    return std::optional<SampleLength>(
        SampleLength{piece.id, static_cast<int64_t>(piece.tokens.size()), NumTargets(piece),
                     piece.source});
  }

  Status Reset() override {
    pending_.clear();
    next_piece_ = 0;
    return inner_->Reset();
  }

  std::optional<int64_t> size_hint() const override { return std::nullopt; }
  int64_t epoch() const override { return inner_->epoch(); }
  const std::string& spec() const override { return inner_->spec(); }
  int64_t skipped_empty() const override { return inner_->skipped_empty(); }
  bool endless() const override { return inner_->endless(); }
  Result<std::string> Identity() override { return inner_->Identity(); }
  std::optional<int64_t> drawn_samples() const override { return inner_->drawn_samples(); }
  SplitCounts split_counts() const override { return counts_; }

  SourceCursor cursor() const override {
    const bool mid = !pending_.empty();
    const SourceCursor in = mid ? before_ : inner_->cursor();
    SourceCursor c;
    c.epoch = inner_->epoch();
    c.position = in.position;
    c.skipped_empty = inner_->skipped_empty();
    c.next_id = mid ? base_ + next_piece_ : in.next_id + extra_;
    const SplitCounts& k = mid ? counts_before_ : counts_;
    c.split = {mid ? next_piece_ : 0, mid ? extra_before_ : extra_, k.samples, k.pieces,
               k.lost_targets};
    c.parts.push_back(in);
    return c;
  }

  Status Seek(const SourceCursor& c) override {
    auto bad = [&](const std::string& why) {
      return Status::Corruption("data source " + inner_->spec() + " split at " + Str(longest_) +
                                " tokens: cursor " + why);
    };
    if (c.split.size() != 5 || c.parts.size() != 1 || !c.taken.empty()) {
      return bad("is not one of a splitting source (split: piece, extra ids, samples, pieces, "
                 "lost targets; one part)");
    }
    for (int64_t v : c.split) {
      if (v < 0) return bad("split field " + Str(v) + " is negative");
    }
    pending_.clear();
    next_piece_ = 0;
    THDPACK_RETURN_IF_ERROR(inner_->Seek(c.parts[0]));
    extra_ = c.split[1];
    counts_ = SplitCounts{c.split[2], c.split[3], c.split[4]};
    if (c.split[0] > 0) {
      before_ = c.parts[0];
      THDPACK_ASSIGN_OR_RETURN(std::optional<Sample> s, inner_->Next());
      const int64_t length = s ? static_cast<int64_t>(s->tokens.size()) : 0;
      if (!s || c.split[0] >= (length + longest_ - 1) / longest_) {
        return bad("piece " + Str(c.split[0]) + " of a sample of " + Str(length) +
                   " tokens: no such piece");
      }
      Split(std::move(*s), c.split[0]);
    }
    if (cursor().next_id != c.next_id) {
      return bad("next id " + Str(c.next_id) + " does not add up (its parts give " +
                 Str(cursor().next_id) + ")");
    }
    return Status::Ok();
  }

  Result<SourceCursor> CursorAfter(int64_t samples) override {
    if (samples < 0) return Status::OutOfRange("CursorAfter: " + Str(samples) + " samples");
    return Scan([&]() -> Status {
      bool empty_epoch = false;
      for (int64_t read = 0; read < samples;) {
        THDPACK_ASSIGN_OR_RETURN(std::optional<SampleLength> l, NextLength());
        if (l) {
          ++read;
          empty_epoch = false;
          continue;
        }
        if (empty_epoch) return Empty();
        THDPACK_RETURN_IF_ERROR(Reset());
        empty_epoch = true;
      }
      return Status::Ok();
    });
  }

  Result<SourceCursor> CursorAtEpoch(int64_t epoch) override {
    if (epoch < 0) return Status::OutOfRange("CursorAtEpoch: epoch " + Str(epoch));
    return Scan([&]() -> Status {
      for (int64_t e = 0; e < epoch; ++e) {
        int64_t read = 0;
        for (;;) {
          THDPACK_ASSIGN_OR_RETURN(std::optional<SampleLength> l, NextLength());
          if (!l) break;
          ++read;
        }
        if (read == 0) return Empty();
        THDPACK_RETURN_IF_ERROR(Reset());
      }
      return Status::Ok();
    });
  }

 private:
  // The sample cut into its pieces from `from` on (the earlier ones were read before a Seek).
  void Split(Sample s, int64_t from) {
    const int64_t length = static_cast<int64_t>(s.tokens.size());
    const int64_t n = (length + longest_ - 1) / longest_;
    base_ = s.id + extra_;
    extra_before_ = extra_;
    extra_ += n - 1;
    counts_before_ = counts_;
    ++counts_.samples;
    counts_.pieces += n;
    for (int64_t k = 1; k < n; ++k) {  // each cut's first token, a target of the one before
      const size_t first = static_cast<size_t>(k * longest_);
      counts_.lost_targets += s.target_mask.empty() ? 1 : s.target_mask[first];
    }
    for (int64_t k = from; k < n; ++k) {
      const auto a = static_cast<std::ptrdiff_t>(k * longest_);
      const auto b = static_cast<std::ptrdiff_t>(std::min(length, (k + 1) * longest_));
      Sample piece;
      piece.id = base_ + k;
      piece.source = s.source;
      piece.tokens.assign(s.tokens.begin() + a, s.tokens.begin() + b);
      if (!s.target_mask.empty()) {
        piece.target_mask.assign(s.target_mask.begin() + a, s.target_mask.begin() + b);
      }
      pending_.push_back(std::move(piece));
    }
    next_piece_ = from;
  }

  Sample TakePiece() {
    Sample piece = std::move(pending_.front());
    pending_.pop_front();
    next_piece_ = pending_.empty() ? 0 : next_piece_ + 1;
    return piece;
  }

  Status Empty() const {
    return Status::InvalidArgument("data source \"" + inner_->spec() +
                                   "\" holds no samples (a step needs at least one)");
  }

  // Runs `read` from the opening of the stream and returns the cursor it ends at; the source's
  // own position is put back either way.
  template <typename Read>
  Result<SourceCursor> Scan(const Read& read) {
    const SourceCursor saved = cursor();
    Status status = [&]() -> Status {
      THDPACK_ASSIGN_OR_RETURN(SourceCursor zero, inner_->CursorAfter(0));
      pending_.clear();
      next_piece_ = 0;
      THDPACK_RETURN_IF_ERROR(inner_->Seek(zero));
      extra_ = 0;
      counts_ = SplitCounts{};
      return read();
    }();
    const SourceCursor end = cursor();
    const Status restored = Seek(saved);
    THDPACK_RETURN_IF_ERROR(status);
    THDPACK_RETURN_IF_ERROR(restored);
    return end;
  }

  std::unique_ptr<SampleSource> inner_;
  int64_t longest_ = 1;
  std::deque<Sample> pending_;  // the pieces of the sample being cut not yet read
  int64_t next_piece_ = 0;      // the index of pending_.front() in its sample (0: none pending)
  int64_t base_ = 0;            // the id of that sample's piece 0
  int64_t extra_ = 0;           // ids the cuts added so far (every piece of every cut sample)
  int64_t extra_before_ = 0;    // extra_ before the sample being cut
  SourceCursor before_;         // the wrapped cursor before the sample read last
  SplitCounts counts_;
  SplitCounts counts_before_;   // counts_ before the sample being cut
};

}  // namespace

Result<std::unique_ptr<SampleSource>> OpenSplitSource(std::unique_ptr<SampleSource> inner,
                                                      int64_t longest) {
  if (inner == nullptr) return Status::InvalidArgument("OpenSplitSource: the source is null");
  if (longest < 1) {
    return Status::InvalidArgument("OpenSplitSource: longest = " + Str(longest) +
                                   " must be >= 1 (the longest piece)");
  }
  return std::unique_ptr<SampleSource>(new SplitSource(std::move(inner), longest));
}

}  // namespace thdpack
