// The step runner's word codec (src/runtime/step_words.h): the run's position after a step and
// the microbatches' sequences as int64 words, and back.
#include "runtime/step_words.h"

#include <cstring>
#include <string>
#include <utility>

namespace thdpack {
namespace runner_internal {

namespace {

void AppendCursor(const SourceCursor& c, PositionWords* w) {
  const bool split = !c.split.empty();
  w->insert(w->end(), {c.epoch, c.position, c.next_id, c.skipped_empty, c.byte_offset, c.line,
                       c.epoch_size,
                       split ? -1 - static_cast<int64_t>(c.split.size())
                             : static_cast<int64_t>(c.parts.size())});
  if (split) {
    w->insert(w->end(), c.split.begin(), c.split.end());
  } else {
    w->insert(w->end(), c.taken.begin(), c.taken.end());
  }
  for (const SourceCursor& p : c.parts) AppendCursor(p, w);
}

}  // namespace

PositionWords PackPosition(int64_t consumed, const std::optional<SourceCursor>& c) {
  PositionWords w = {consumed, c.has_value() ? 1 : 0};
  if (c) AppendCursor(*c, &w);
  return w;
}

bool ReadCursor(const PositionWords& w, size_t* at, int depth, SourceCursor* c) {
  if (*at + 8 > w.size()) return false;
  const int64_t* v = w.data() + *at;
  *c = SourceCursor{};
  c->epoch = v[0];
  c->position = v[1];
  c->next_id = v[2];
  c->skipped_empty = v[3];
  c->byte_offset = v[4];
  c->line = v[5];
  c->epoch_size = v[6];
  const int64_t parts = v[7];
  *at += 8;
  if (parts < 0) {  // a splitting source: its words, then the one cursor it wraps
    const int64_t n = -1 - parts;
    if (n < 1 || n > 16 || static_cast<uint64_t>(n) > (w.size() - *at)) return false;
    c->split.assign(w.begin() + static_cast<std::ptrdiff_t>(*at),
                    w.begin() + static_cast<std::ptrdiff_t>(*at + static_cast<size_t>(n)));
    *at += static_cast<size_t>(n);
    c->parts.resize(1);
    return ReadCursor(w, at, depth, &c->parts[0]) && c->parts[0].split.empty();
  }
  if ((parts > 0 && depth > 0) ||
      static_cast<uint64_t>(parts) > (w.size() - *at)) {
    return false;
  }
  c->taken.assign(w.begin() + static_cast<std::ptrdiff_t>(*at),
                  w.begin() + static_cast<std::ptrdiff_t>(*at + static_cast<size_t>(parts)));
  *at += static_cast<size_t>(parts);
  c->parts.resize(static_cast<size_t>(parts));
  for (SourceCursor& p : c->parts) {
    if (!ReadCursor(w, at, depth + 1, &p)) return false;
  }
  return true;
}

Status UnpackPosition(const PositionWords& w, RunState* state) {
  size_t at = 2;
  SourceCursor c;
  if (w.size() < 2 || (w[1] != 0 && (!ReadCursor(w, &at, 0, &c) || at != w.size())) ||
      (w[1] == 0 && w.size() != 2)) {
    return Status::Internal("step runner: a run position of " + std::to_string(w.size()) +
                            " words does not decode");
  }
  state->consumed = w[0];
  state->cursor.reset();
  if (w[1] != 0) state->cursor = std::move(c);
  return Status::Ok();
}

// After the position: n_loss_sequences, the microbatch count, then per microbatch n, the ids,
// the loss-token counts, a blend's sources, and each sample field's rows as bytes in whole
// words (their size follows from n and the schema).
void AppendSequences(int64_t n_loss_sequences, std::span<const SequenceInfo> mb_info, bool blend,
                     PositionWords* w) {
  w->push_back(n_loss_sequences);
  w->push_back(static_cast<int64_t>(mb_info.size()));
  for (const SequenceInfo& m : mb_info) {
    w->push_back(static_cast<int64_t>(m.ids.size()));
    w->insert(w->end(), m.ids.begin(), m.ids.end());
    w->insert(w->end(), m.n_targets.begin(), m.n_targets.end());
    if (blend) w->insert(w->end(), m.sources.begin(), m.sources.end());
    for (const std::vector<std::byte>& rows : m.sample_fields) {
      const size_t at = w->size();
      w->resize(at + (rows.size() + 7) / 8, 0);
      if (!rows.empty()) std::memcpy(w->data() + at, rows.data(), rows.size());
    }
  }
}

Status ReadSequences(const PositionWords& w, size_t at, bool blend,
                     std::span<const FieldSpec> fields, std::span<const size_t> sample_fields,
                     int64_t* n_loss_sequences, std::vector<SequenceInfo>* mb_info) {
  mb_info->clear();
  auto bad = [] {
    return Status::Internal("step runner: the sequences of the microbatches do not decode");
  };
  auto take = [&](size_t count, auto* out) {
    if (count > w.size() - at) return false;
    out->assign(w.begin() + static_cast<std::ptrdiff_t>(at),
                w.begin() + static_cast<std::ptrdiff_t>(at + count));
    at += count;
    return true;
  };
  if (w.size() - at < 2 || w[at + 1] < 0 || static_cast<uint64_t>(w[at + 1]) > w.size()) {
    return bad();
  }
  *n_loss_sequences = w[at];
  mb_info->resize(static_cast<size_t>(w[at + 1]));
  at += 2;
  for (SequenceInfo& m : *mb_info) {
    if (at >= w.size() || w[at] < 0 || static_cast<uint64_t>(w[at]) > w.size()) return bad();
    const size_t n = static_cast<size_t>(w[at++]);
    if (!take(n, &m.ids) || !take(n, &m.n_targets) || (blend && !take(n, &m.sources))) {
      return bad();
    }
    for (size_t f : sample_fields) {
      const size_t bytes = n * fields[f].row_bytes(), words = (bytes + 7) / 8;
      if (words > w.size() - at) return bad();
      std::vector<std::byte> rows(bytes);
      if (bytes > 0) std::memcpy(rows.data(), w.data() + at, bytes);
      at += words;
      m.sample_fields.push_back(std::move(rows));
    }
  }
  return at == w.size() ? Status::Ok() : bad();
}

}  // namespace runner_internal
}  // namespace thdpack
