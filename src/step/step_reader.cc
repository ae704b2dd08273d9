// StepReader: N samples per step from a streaming source, wrapping around at its end.
#include <optional>
#include <string>
#include <utility>

#include "thdpack/step.h"

namespace thdpack {

Result<StepReader> StepReader::Create(SampleSource* source, int64_t global_batch, int dp_size) {
  if (source == nullptr) return Status::InvalidArgument("StepReader: source is null");
  if (global_batch < 0) {
    return Status::InvalidArgument("global batch must be >= 1 samples, or \"all\" (0); got " +
                                   std::to_string(global_batch));
  }
  if (dp_size < 1) {
    return Status::InvalidArgument("DP size must be >= 1; got " + std::to_string(dp_size));
  }
  return StepReader(source, global_batch, dp_size);
}

Result<StepSamples> StepReader::Next() {
  StepSamples out;
  out.step = next_step_;
  std::vector<SampleLength> read;
  const std::string empty_message =
      "data source \"" + source_->spec() + "\" holds no samples (a step needs at least one)";
  if (global_batch_ == 0) {
    // One whole epoch. The previous "all" step ended with a Reset, so this starts an epoch.
    if (std::optional<int64_t> hint = source_->size_hint(); hint.has_value() && *hint > 0) {
      read.reserve(static_cast<size_t>(*hint));
    }
    out.epoch = source_->epoch();
    while (true) {
      THDPACK_ASSIGN_OR_RETURN(std::optional<SampleLength> s, source_->NextLength());
      if (!s.has_value()) break;
      read.push_back(*s);
    }
    if (read.empty()) return Status::InvalidArgument(empty_message);
    THDPACK_RETURN_IF_ERROR(source_->Reset());
  } else {
    read.reserve(static_cast<size_t>(global_batch_));
    while (static_cast<int64_t>(read.size()) < global_batch_) {
      THDPACK_ASSIGN_OR_RETURN(std::optional<SampleLength> s, source_->NextLength());
      if (!s.has_value()) {
        // End of the epoch: wrap around. Two ends in a row with nothing between = empty source.
        THDPACK_RETURN_IF_ERROR(source_->Reset());
        THDPACK_ASSIGN_OR_RETURN(s, source_->NextLength());
        if (!s.has_value()) return Status::InvalidArgument(empty_message);
      }
      if (read.empty()) out.epoch = source_->epoch();
      read.push_back(*s);
    }
  }
  out.samples = ToSchedulingOrder(read, dp_size_);
  ++next_step_;
  return out;
}

std::vector<int64_t> LoaderIndices(int64_t n, int dp_size, int loader) {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(LoaderCount(n, dp_size, loader)));
  for (int64_t i = loader; i < n; i += dp_size) out.push_back(i);
  return out;
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
