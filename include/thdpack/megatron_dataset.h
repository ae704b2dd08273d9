// thdpack/megatron_dataset.h: Megatron-LM's indexed dataset format (MMIDIDX version 1) and a
// writer for it. The reader is OpenMegatronSource in thdpack/data.h.
//
// Format (all integers little-endian), as megatron/core/datasets/indexed_dataset.py writes it:
//   PREFIX.idx
//     offset 0   9 bytes   magic "MMIDIDX\0\0"
//     offset 9   uint64    version = 1
//     offset 17  uint8     dtype code of the tokens in .bin (MegatronDType)
//     offset 18  uint64    sequence_count S
//     offset 26  uint64    document_count D (the length of document_indices: documents + 1)
//     offset 34  int32     sequence_lengths[S]   (tokens per sequence)
//                int64     sequence_pointers[S]  (byte offset of each sequence in .bin)
//                int64     document_indices[D]   (0, ..., S: document k is sequences
//                                                 [document_indices[k], document_indices[k+1]))
//                int8      sequence_modes[S]     (multimodal datasets only; ignored here)
//   PREFIX.bin: the tokens of every sequence, back to back, in the dtype of the index.
//
// Thread-safety: a MegatronWriter is not thread-safe; distinct writers are independent.
#ifndef THDPACK_MEGATRON_DATASET_H_
#define THDPACK_MEGATRON_DATASET_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "thdpack/status.h"

namespace thdpack {

inline constexpr char kMegatronIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kMegatronIndexVersion = 1;
inline constexpr int64_t kMegatronIndexHeaderSize = 34;

enum class MegatronDType : uint8_t {
  kUint8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUint16 = 8,
};

// Bytes per token of a dtype code; 0 for a code that is not one of the eight above.
int64_t MegatronDTypeSize(uint8_t code);
// "uint16", "int32", ... ("unknown" for a bad code).
std::string_view MegatronDTypeName(uint8_t code);
// Megatron's choice for a vocabulary: uint16 below 65500 tokens, int32 otherwise.
MegatronDType MegatronBestDType(int64_t vocab_size);

// Writes PREFIX.bin as tokens come and PREFIX.idx at Finish(). Produces exactly what Megatron's
// IndexedDatasetBuilder writes for the same documents (contiguous pointers from 0).
//
//   auto w = MegatronWriter::Create("/tmp/ds", MegatronDType::kUint16);
//   (*w)->AddDocument(tokens); ...; (*w)->Finish();
class MegatronWriter {
 public:
  // Creates (truncates) PREFIX.bin. PREFIX.idx is written by Finish().
  [[nodiscard]] static Result<std::unique_ptr<MegatronWriter>> Create(std::string prefix,
                                                                      MegatronDType dtype);
  ~MegatronWriter();
  MegatronWriter(const MegatronWriter&) = delete;
  MegatronWriter& operator=(const MegatronWriter&) = delete;

  // Appends one sequence to the current document. Every value must be representable in the
  // dtype (an error names the sequence and position); length <= 2^31 - 1. Empty sequences are
  // allowed by the format (a document of them is empty: the reader passes over it).
  [[nodiscard]] Status AddSequence(std::span<const int64_t> tokens);
  // Closes the current document (its sequences since the last EndDocument). Without a sequence
  // since then it writes an empty document as Megatron's add_document([], []) does: a repeated
  // value in document_indices.
  [[nodiscard]] Status EndDocument();
  // AddSequence(tokens) then EndDocument().
  [[nodiscard]] Status AddDocument(std::span<const int64_t> tokens);
  // Writes PREFIX.idx and closes both files. REQUIRES: no sequence added since the last
  // EndDocument (an error otherwise). After Finish the writer accepts nothing more.
  [[nodiscard]] Status Finish();

 private:
  MegatronWriter() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace thdpack

#endif  // THDPACK_MEGATRON_DATASET_H_
