// What every backend shares: argument checks, the status agreement.
#include <algorithm>
#include <string>

#include "thdpack/comm.h"

namespace thdpack {

int ProcessGroup::IndexOf(int g) const {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (ranks_[i] == g) return static_cast<int>(i);
  }
  return -1;
}

std::string ProcessGroup::Describe() const {
  std::string s = std::string(backend()) + " group [";
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(ranks_[i]);
  }
  return s + "]";
}

Status ProcessGroup::CheckRoot(std::string_view op, int root) const {
  if (root < 0 || root >= size()) {
    return Status::InvalidArgument(std::string(op) + " on " + Describe() + ": root " +
                                   std::to_string(root) + " is not a position in the group (size " +
                                   std::to_string(size()) + ")");
  }
  return Status::Ok();
}

Status ProcessGroup::CheckPeer(std::string_view op, int peer, int tag) const {
  if (peer < 0 || peer >= size()) {
    return Status::InvalidArgument(std::string(op) + " on " + Describe() + ": peer " +
                                   std::to_string(peer) + " is not a position in the group (size " +
                                   std::to_string(size()) + ")");
  }
  if (tag < 0 || tag > 32767) {
    return Status::InvalidArgument(std::string(op) + " on " + Describe() + ": tag " +
                                   std::to_string(tag) + " must be in [0, 32767]");
  }
  return Status::Ok();
}

Status ProcessGroup::CheckVector(std::string_view op, std::string_view name,
                                 std::span<const int64_t> counts, std::span<const int64_t> displs,
                                 size_t buffer_size) const {
  const std::string where = std::string(op) + " on " + Describe() + ": ";
  if (counts.size() != static_cast<size_t>(size()) || displs.size() != static_cast<size_t>(size())) {
    return Status::InvalidArgument(where + std::string(name) + " counts and displacements need " +
                                   std::to_string(size()) + " entries, got " +
                                   std::to_string(counts.size()) + " and " +
                                   std::to_string(displs.size()));
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0 || displs[i] < 0 ||
        static_cast<uint64_t>(counts[i]) + static_cast<uint64_t>(displs[i]) > buffer_size) {
      return Status::InvalidArgument(where + std::string(name) + "[" + std::to_string(i) +
                                     "]: count " + std::to_string(counts[i]) + " at displacement " +
                                     std::to_string(displs[i]) + " does not fit the buffer of " +
                                     std::to_string(buffer_size) + " bytes");
    }
  }
  return Status::Ok();
}

Status ProcessGroup::CheckSplit(std::span<const std::vector<int>> groups, int* my_group,
                                int* my_index) const {
  *my_group = -1;
  *my_index = -1;
  std::vector<int> seen(static_cast<size_t>(size()), -1);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (groups[gi].empty()) {
      return Status::InvalidArgument("Split on " + Describe() + ": group " + std::to_string(gi) +
                                     " is empty");
    }
    for (size_t k = 0; k < groups[gi].size(); ++k) {
      const int g = groups[gi][k];
      const int pos = IndexOf(g);
      if (pos < 0) {
        return Status::InvalidArgument("Split on " + Describe() + ": group " +
                                       std::to_string(gi) + " names rank " + std::to_string(g) +
                                       ", which is not a member");
      }
      if (seen[static_cast<size_t>(pos)] >= 0) {
        return Status::InvalidArgument("Split on " + Describe() + ": rank " + std::to_string(g) +
                                       " is in group " +
                                       std::to_string(seen[static_cast<size_t>(pos)]) +
                                       " and in group " + std::to_string(gi) +
                                       ": groups must be disjoint");
      }
      seen[static_cast<size_t>(pos)] = static_cast<int>(gi);
      if (pos == rank()) {
        *my_group = static_cast<int>(gi);
        *my_index = static_cast<int>(k);
      }
    }
  }
  return Status::Ok();
}

std::string ProcessGroup::DescribeMembers(std::span<const int> positions) const {
  std::string pos, global;
  for (size_t i = 0; i < positions.size(); ++i) {
    if (i) {
      pos += ", ";
      global += ", ";
    }
    pos += std::to_string(positions[i]);
    global += std::to_string(ranks_[static_cast<size_t>(positions[i])]);
  }
  const bool one = positions.size() == 1;
  return (one ? "member " : "members ") + pos + (one ? " (global rank " : " (global ranks ") +
         global + ")";
}

Status AgreeOnStatus(ProcessGroup& group, const Status& local, std::string_view context) {
  // The lowest group position that failed, or size() when none did.
  int64_t first_failed = local.ok() ? group.size() : group.rank();
  THDPACK_RETURN_IF_ERROR(
      group.AllReduceInt64(std::span<int64_t>(&first_failed, 1), ReduceOp::kMin));
  if (first_failed == group.size()) return Status::Ok();
  const int root = static_cast<int>(first_failed);
  std::string text;
  if (group.rank() == root) text = local.ToString();
  // The message's length and the failure's origin code travel together.
  int64_t header[2] = {static_cast<int64_t>(text.size()), static_cast<int64_t>(local.origin())};
  THDPACK_RETURN_IF_ERROR(group.BroadcastValues(std::span<int64_t>(header, 2), root));
  text.resize(static_cast<size_t>(header[0]));
  THDPACK_RETURN_IF_ERROR(group.Broadcast(
      std::as_writable_bytes(std::span<char>(text.data(), text.size())), root));
  if (!local.ok()) return local;
  std::string msg = "rank " + std::to_string(group.ranks()[static_cast<size_t>(root)]);
  if (!context.empty()) msg += " (" + std::string(context) + ")";
  return Status::Aborted(msg + " failed: " + text, static_cast<StatusCode>(header[1]));
}

}  // namespace thdpack
