// A ProcessGroup that flips one bit of what its rank receives: a wrapper around another group
// (the thread backend's, in tests/wire_fault_test.cc) for the corruption tests of the step's
// messages. Every call that hands this rank bytes from another member - a broadcast it does not
// root, the other members' blocks of an all-gather(-v) or an all-to-all-v, a receive - is one
// "message" of its kind (the operation, and a receive's tag); once armed, the wrapper counts
// them, can record them (Trace), and flips bit `bit` (modulo the bits received) of the
// `target`-th. Reductions (all-reduce) are never touched: their bytes are a result, not a
// sender's data (docs/wire_format.md, "What the checksums cover"). Groups split from a
// wrapped group are wrapped too, sharing one FaultPlan: the count runs over all of one rank's
// groups, in the order its calls are made.
//
// Thread-safety: one FaultPlan and its groups belong to one rank's thread, as the groups do.
#ifndef THDPACK_TESTS_FAULT_GROUP_H_
#define THDPACK_TESTS_FAULT_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/comm.h"

namespace thdpack::testing {

enum class FaultOp { kBroadcast, kAllGather, kAllGatherV, kAllToAllV, kRecv };

inline std::string FaultOpName(FaultOp op, int tag) {
  switch (op) {
    case FaultOp::kBroadcast: return "broadcast";
    case FaultOp::kAllGather: return "all-gather";
    case FaultOp::kAllGatherV: return "all-gather-v";
    case FaultOp::kAllToAllV: return "all-to-all-v";
    case FaultOp::kRecv: return "recv tag " + std::to_string(tag);
  }
  return "?";
}

// One received message: its kind and the bytes it brought from other members.
struct FaultCall {
  FaultOp op;
  int tag = 0;
  int64_t bytes = 0;
};

struct FaultPlan {
  bool armed = false;   // count (and record, and flip) only once armed
  int target = -1;      // the index, among the counted messages, of the one to damage
  uint64_t bit = 0;     // which bit of it (modulo its bits)
  std::vector<FaultCall> trace;  // every counted message, in order
  bool flipped = false;
};

class FaultGroup final : public ProcessGroup {
 public:
  FaultGroup(std::unique_ptr<ProcessGroup> owned, ProcessGroup* inner,
             std::shared_ptr<FaultPlan> plan)
      : ProcessGroup(std::vector<int>(inner->ranks().begin(), inner->ranks().end()),
                     inner->rank()),
        owned_(std::move(owned)),
        inner_(inner),
        plan_(std::move(plan)) {
    set_timeout(inner_->timeout());
  }
  // Wraps `world` (not owned) for this rank.
  static std::unique_ptr<FaultGroup> Wrap(ProcessGroup& world, std::shared_ptr<FaultPlan> plan) {
    return std::make_unique<FaultGroup>(nullptr, &world, std::move(plan));
  }

  std::string_view backend() const override { return inner_->backend(); }

  Status Broadcast(std::span<std::byte> data, int root) override {
    return Count([&] { return inner_->Broadcast(data, root); }, FaultOp::kBroadcast, 0, data,
                 rank() == root ? Ranges{} : Ranges{{0, data.size()}});
  }
  Status AllGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    Ranges others;
    for (int j = 0; j < size(); ++j) {
      if (j != rank()) others.push_back({static_cast<size_t>(j) * send.size(), send.size()});
    }
    return Count([&] { return inner_->AllGather(send, recv); }, FaultOp::kAllGather, 0, recv,
                 others);
  }
  Status AllGatherV(std::span<const std::byte> send, std::span<std::byte> recv,
                    std::span<const int64_t> counts, std::span<const int64_t> displs) override {
    Ranges others;
    for (int j = 0; j < size(); ++j) {
      if (j != rank()) {
        others.push_back({static_cast<size_t>(displs[static_cast<size_t>(j)]),
                          static_cast<size_t>(counts[static_cast<size_t>(j)])});
      }
    }
    return Count([&] { return inner_->AllGatherV(send, recv, counts, displs); },
                 FaultOp::kAllGatherV, 0, recv, others);
  }
  Status AllReduce(std::span<std::byte> data, ReduceType type, ReduceOp op) override {
    return Pass([&] { return inner_->AllReduce(data, type, op); });
  }
  Status AllToAllV(std::span<const std::byte> send, std::span<const int64_t> send_counts,
                   std::span<const int64_t> send_displs, std::span<std::byte> recv,
                   std::span<const int64_t> recv_counts,
                   std::span<const int64_t> recv_displs) override {
    Ranges others;
    for (int j = 0; j < size(); ++j) {
      if (j != rank()) {
        others.push_back({static_cast<size_t>(recv_displs[static_cast<size_t>(j)]),
                          static_cast<size_t>(recv_counts[static_cast<size_t>(j)])});
      }
    }
    return Count([&] {
      return inner_->AllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    }, FaultOp::kAllToAllV, 0, recv, others);
  }
  Status Send(std::span<const std::byte> data, int dst, int tag) override {
    return Pass([&] { return inner_->Send(data, dst, tag); });
  }
  Status Recv(std::span<std::byte> data, int src, int tag) override {
    return Count([&] { return inner_->Recv(data, src, tag); }, FaultOp::kRecv, tag, data,
                 Ranges{{0, data.size()}});
  }
  Status Barrier() override { return Pass([&] { return inner_->Barrier(); }); }
  Result<std::unique_ptr<ProcessGroup>> Split(std::span<const std::vector<int>> groups) override {
    std::unique_ptr<ProcessGroup> child;
    Status s = Pass([&]() -> Status {
      THDPACK_ASSIGN_OR_RETURN(child, inner_->Split(groups));
      return Status::Ok();
    });
    THDPACK_RETURN_IF_ERROR(s);
    if (!child) return std::unique_ptr<ProcessGroup>();
    ProcessGroup* raw = child.get();
    return std::unique_ptr<ProcessGroup>(new FaultGroup(std::move(child), raw, plan_));
  }

 private:
  using Ranges = std::vector<std::pair<size_t, size_t>>;  // (offset, bytes)

  // Runs `op` on the inner group and adds the bytes it counted to this group's.
  template <typename Op>
  Status Pass(Op&& op) {
    const int64_t before = inner_->bytes_sent();
    Status s = op();
    AddBytesSent(inner_->bytes_sent() - before);
    return s;
  }

  // Pass, then - armed - counts a call that received bytes from others, records it, and flips
  // the planned bit when it is the target.
  template <typename Op>
  Status Count(Op&& op, FaultOp kind, int tag, std::span<std::byte> buffer, const Ranges& from) {
    THDPACK_RETURN_IF_ERROR(Pass(op));
    if (!plan_->armed) return Status::Ok();
    uint64_t bits = 0;
    for (const auto& r : from) bits += 8 * static_cast<uint64_t>(r.second);
    if (bits == 0) return Status::Ok();
    const int index = static_cast<int>(plan_->trace.size());
    plan_->trace.push_back(FaultCall{kind, tag, static_cast<int64_t>(bits / 8)});
    if (index != plan_->target) return Status::Ok();
    uint64_t b = plan_->bit % bits;
    for (const auto& r : from) {
      if (b < 8 * r.second) {
        buffer[r.first + b / 8] ^= static_cast<std::byte>(1u << (b % 8));
        plan_->flipped = true;
        break;
      }
      b -= 8 * r.second;
    }
    return Status::Ok();
  }

  std::unique_ptr<ProcessGroup> owned_;
  ProcessGroup* inner_;
  std::shared_ptr<FaultPlan> plan_;
};

}  // namespace thdpack::testing

#endif  // THDPACK_TESTS_FAULT_GROUP_H_
