// src/runtime/step_words.h: private to the runtime area - the step runner's word codec: what
// travels beside the encoded StepMeta as int64 words, outside wire/'s format. The run's
// position after a step (the samples consumed and the source cursor: readers send it with the
// lengths, step_lengths.cc, and the packer with the metadata, step_deliver.cc), and what each
// microbatch's sequences are (SequenceInfo: made by the packer, step_pack.cc, sent after the
// position with the metadata). No checksum covers these words; a word that does not decode is
// an Internal error. Not thread-safe beyond what its arguments are.
#ifndef THDPACK_RUNTIME_STEP_WORDS_H_
#define THDPACK_RUNTIME_STEP_WORDS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "thdpack/fields.h"
#include "thdpack/run_state.h"
#include "thdpack/status.h"

namespace thdpack {
namespace runner_internal {

// The run's position after a step, as readers send it to the other ranks with the lengths
// and the metadata, as int64 words: the samples consumed, whether there is a cursor (file
// sources), and the cursor - its seven fields, then its parts and counts (a blend), each part
// the same way; a splitting source's cursor has -1 - (its split words) in place of the parts'
// count, then those words and its one part.
using PositionWords = std::vector<int64_t>;
PositionWords PackPosition(int64_t consumed, const std::optional<SourceCursor>& c);
// The cursor at word *at of `w` (a part of a blend at depth 1), *at moved past it. False when
// the words are not a cursor (a bug or corrupt transport).
bool ReadCursor(const PositionWords& w, size_t* at, int depth, SourceCursor* c);
// The position of `w` into state->consumed and state->cursor; Internal when it does not decode.
Status UnpackPosition(const PositionWords& w, RunState* state);

// What every rank of a microbatch learns of its sequences, in packed order (made by the packer,
// sent with the metadata): the samples' ids and loss-token counts, a blend's sources, and the
// rows of the sample fields (one buffer per sample field of the schema, n rows each).
struct SequenceInfo {
  std::vector<int64_t> ids;
  std::vector<int64_t> n_targets;
  std::vector<int32_t> sources;  // a blend only
  std::vector<std::vector<std::byte>> sample_fields;
};

// The step's count of sequences with a loss token and what each microbatch's sequences are
// (mb_info) as words after the position in the metadata broadcast (AppendSequences), and back
// from word `at` (ReadSequences: every word of `w` must be used). `blend`: the sequences carry
// their sources; `fields` the run's schema, `sample_fields` the sample fields' positions in it.
void AppendSequences(int64_t n_loss_sequences, std::span<const SequenceInfo> mb_info, bool blend,
                     PositionWords* w);
Status ReadSequences(const PositionWords& w, size_t at, bool blend,
                     std::span<const FieldSpec> fields, std::span<const size_t> sample_fields,
                     int64_t* n_loss_sequences, std::vector<SequenceInfo>* mb_info);

}  // namespace runner_internal
}  // namespace thdpack

#endif  // THDPACK_RUNTIME_STEP_WORDS_H_
