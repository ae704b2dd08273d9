// The thread backend: one std::thread per rank, collectives as rendezvous on shared memory.
//
// Every collective is two phases on the group's shared state. (1) Each member publishes what it
// offers (pointers to its send buffer, its counts) and waits until all members have. (2) Each
// member copies what it needs straight out of its peers' buffers, then waits until all members
// have finished reading, so no buffer is released or overwritten while a peer reads it. Point
// to point messages are copied into a mailbox keyed by (src, dst, tag).
//
// No wait is unbounded: a waiter gives up with kAborted when a member it waits for has left
// (its rank function returned or threw) or when the group's timeout() passes (the error names
// the members that have not arrived); the group is then marked broken so that its other members
// fail at once too.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "thdpack/comm.h"

namespace thdpack {
namespace {

// What one member offers in a collective.
struct Publication {
  const std::byte* data = nullptr;
  size_t size = 0;
  const int64_t* counts = nullptr;  // AllToAllV: send counts [n]
  const int64_t* displs = nullptr;  // AllToAllV: send displacements [n]
  uint64_t tag = 0;                 // operation-specific check value (root, type, hash)
};

struct GroupState {
  explicit GroupState(std::vector<int> r)
      : ranks(std::move(r)), arrived_flag(ranks.size(), 0), pubs(ranks.size()) {}
  std::vector<int> ranks;  // global (world) ranks
  uint64_t generation = 0;
  size_t arrived = 0;
  std::vector<uint8_t> arrived_flag;
  std::vector<Publication> pubs;
  std::string broken;  // non-empty once a member gave up: every later wait fails with it
  std::map<std::tuple<int, int, int>, std::deque<std::vector<std::byte>>> mail;
  struct PendingSplit {
    std::vector<std::shared_ptr<GroupState>> children;
    size_t takers = 0;
  };
  std::map<uint64_t, PendingSplit> splits;
};

struct ThreadWorld {
  explicit ThreadWorld(int n) : exited(static_cast<size_t>(n), 0), exit_status(static_cast<size_t>(n)) {}
  std::mutex mu;
  std::condition_variable cv;  // one for the world: waits are short and ranks few
  std::vector<uint8_t> exited;
  std::vector<Status> exit_status;
};

uint64_t HashGroups(std::span<const std::vector<int>> groups) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the lists and their sizes
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(groups.size());
  for (const auto& g : groups) {
    mix(g.size());
    for (int r : g) mix(static_cast<uint64_t>(static_cast<int64_t>(r)));
  }
  return h;
}

template <typename T>
void Reduce(std::span<const std::byte> src, std::span<std::byte> acc, ReduceOp op) {
  const size_t n = acc.size() / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, acc.data() + i * sizeof(T), sizeof(T));
    std::memcpy(&b, src.data() + i * sizeof(T), sizeof(T));
    switch (op) {
      case ReduceOp::kSum: a = a + b; break;
      case ReduceOp::kMin: a = std::min(a, b); break;
      case ReduceOp::kMax: a = std::max(a, b); break;
    }
    std::memcpy(acc.data() + i * sizeof(T), &a, sizeof(T));
  }
}

class ThreadGroup final : public ProcessGroup {
 public:
  ThreadGroup(std::shared_ptr<ThreadWorld> world, std::shared_ptr<GroupState> state, int rank)
      : ProcessGroup(state->ranks, rank), world_(std::move(world)), state_(std::move(state)) {}

  std::string_view backend() const override { return "threads"; }

  Status Broadcast(std::span<std::byte> data, int root) override {
    THDPACK_RETURN_IF_ERROR(CheckRoot("Broadcast", root));
    Publication pub{data.data(), data.size(), nullptr, nullptr, static_cast<uint64_t>(root)};
    Status read_status;
    THDPACK_RETURN_IF_ERROR(Collective("Broadcast", pub, [&] {
      const Publication& r = state_->pubs[static_cast<size_t>(root)];
      if (r.size != data.size() || r.tag != static_cast<uint64_t>(root)) {
        read_status = Mismatch("Broadcast", "root " + std::to_string(root) + " sends " +
                                                std::to_string(r.size) + " bytes, this rank expects " +
                                                std::to_string(data.size()));
        return;
      }
      if (rank() != root && !data.empty()) std::memcpy(data.data(), r.data, data.size());
    }));
    if (read_status.ok() && rank() == root) {
      AddBytesSent(static_cast<int64_t>(data.size()) * (size() - 1));
    }
    return read_status;
  }

  Status AllGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<size_t>(size())) {
      return Status::InvalidArgument("AllGather on " + Describe() + ": recv holds " +
                                     std::to_string(recv.size()) + " bytes, expected size() * " +
                                     std::to_string(send.size()));
    }
    Publication pub{send.data(), send.size(), nullptr, nullptr, 0};
    Status read_status;
    THDPACK_RETURN_IF_ERROR(Collective("AllGather", pub, [&] {
      for (int j = 0; j < size(); ++j) {
        const Publication& p = state_->pubs[static_cast<size_t>(j)];
        if (p.size != send.size()) {
          read_status = Mismatch("AllGather", "member " + std::to_string(j) + " sends " +
                                                  std::to_string(p.size) + " bytes, this rank " +
                                                  std::to_string(send.size()));
          return;
        }
        if (p.size) std::memcpy(recv.data() + static_cast<size_t>(j) * p.size, p.data, p.size);
      }
    }));
    if (read_status.ok()) AddBytesSent(static_cast<int64_t>(send.size()) * (size() - 1));
    return read_status;
  }

  Status AllGatherV(std::span<const std::byte> send, std::span<std::byte> recv,
                    std::span<const int64_t> counts, std::span<const int64_t> displs) override {
    THDPACK_RETURN_IF_ERROR(CheckVector("AllGatherV", "recv", counts, displs, recv.size()));
    if (counts[static_cast<size_t>(rank())] != static_cast<int64_t>(send.size())) {
      return Status::InvalidArgument("AllGatherV on " + Describe() + ": counts[" +
                                     std::to_string(rank()) + "] = " +
                                     std::to_string(counts[static_cast<size_t>(rank())]) +
                                     " but this rank sends " + std::to_string(send.size()));
    }
    Publication pub{send.data(), send.size(), nullptr, nullptr, 0};
    Status read_status;
    THDPACK_RETURN_IF_ERROR(Collective("AllGatherV", pub, [&] {
      for (int j = 0; j < size(); ++j) {
        const Publication& p = state_->pubs[static_cast<size_t>(j)];
        const size_t jj = static_cast<size_t>(j);
        if (static_cast<int64_t>(p.size) != counts[jj]) {
          read_status = Mismatch("AllGatherV", "member " + std::to_string(j) + " sends " +
                                                   std::to_string(p.size) + " bytes, counts says " +
                                                   std::to_string(counts[jj]));
          return;
        }
        if (p.size) std::memcpy(recv.data() + displs[jj], p.data, p.size);
      }
    }));
    if (read_status.ok()) AddBytesSent(static_cast<int64_t>(send.size()) * (size() - 1));
    return read_status;
  }

  Status AllReduce(std::span<std::byte> data, ReduceType type, ReduceOp op) override {
    const size_t elem = 8;  // both types are 8 bytes
    if (data.size() % elem != 0) {
      return Status::InvalidArgument("AllReduce on " + Describe() + ": " +
                                     std::to_string(data.size()) +
                                     " bytes is not a whole number of 8-byte elements");
    }
    const uint64_t check = static_cast<uint64_t>(type) * 16 + static_cast<uint64_t>(op);
    Publication pub{data.data(), data.size(), nullptr, nullptr, check};
    std::vector<std::byte> acc(data.size());
    Status read_status;
    THDPACK_RETURN_IF_ERROR(Collective("AllReduce", pub, [&] {
      // Group order on every member, so floating-point sums are bitwise identical everywhere.
      for (int j = 0; j < size(); ++j) {
        const Publication& p = state_->pubs[static_cast<size_t>(j)];
        if (p.size != data.size() || p.tag != check) {
          read_status = Mismatch("AllReduce", "member " + std::to_string(j) +
                                                  " reduces a different size, type or operation");
          return;
        }
        std::span<const std::byte> src(p.data, p.size);
        if (j == 0) {
          if (!acc.empty()) std::memcpy(acc.data(), p.data, p.size);
        } else if (type == ReduceType::kInt64) {
          Reduce<int64_t>(src, acc, op);
        } else {
          Reduce<double>(src, acc, op);
        }
      }
    }));
    if (!read_status.ok()) return read_status;
    // Written only after every member has finished reading this rank's input (in place).
    if (!acc.empty()) std::memcpy(data.data(), acc.data(), acc.size());
    AddBytesSent(static_cast<int64_t>(data.size()) * (size() - 1));
    return Status::Ok();
  }

  Status AllToAllV(std::span<const std::byte> send, std::span<const int64_t> send_counts,
                   std::span<const int64_t> send_displs, std::span<std::byte> recv,
                   std::span<const int64_t> recv_counts,
                   std::span<const int64_t> recv_displs) override {
    THDPACK_RETURN_IF_ERROR(CheckVector("AllToAllV", "send", send_counts, send_displs, send.size()));
    THDPACK_RETURN_IF_ERROR(CheckVector("AllToAllV", "recv", recv_counts, recv_displs, recv.size()));
    Publication pub{send.data(), send.size(), send_counts.data(), send_displs.data(), 0};
    Status read_status;
    const size_t me = static_cast<size_t>(rank());
    THDPACK_RETURN_IF_ERROR(Collective("AllToAllV", pub, [&] {
      for (int j = 0; j < size(); ++j) {
        const Publication& p = state_->pubs[static_cast<size_t>(j)];
        const size_t jj = static_cast<size_t>(j);
        if (p.counts[me] != recv_counts[jj]) {
          read_status = Mismatch("AllToAllV", "member " + std::to_string(j) + " sends " +
                                                  std::to_string(p.counts[me]) +
                                                  " bytes here, recv_counts says " +
                                                  std::to_string(recv_counts[jj]));
          return;
        }
        if (recv_counts[jj]) {
          std::memcpy(recv.data() + recv_displs[jj], p.data + p.displs[me],
                      static_cast<size_t>(recv_counts[jj]));
        }
      }
    }));
    if (!read_status.ok()) return read_status;
    int64_t sent = 0;
    for (size_t j = 0; j < send_counts.size(); ++j) {
      if (j != me) sent += send_counts[j];
    }
    AddBytesSent(sent);
    return Status::Ok();
  }

  Status Send(std::span<const std::byte> data, int dst, int tag) override {
    THDPACK_RETURN_IF_ERROR(CheckPeer("Send", dst, tag));
    std::vector<std::byte> copy(data.begin(), data.end());
    {
      std::lock_guard<std::mutex> lk(world_->mu);
      if (!state_->broken.empty()) return Status::Aborted(state_->broken);
      state_->mail[{rank(), dst, tag}].push_back(std::move(copy));
    }
    world_->cv.notify_all();
    AddBytesSent(static_cast<int64_t>(data.size()));
    return Status::Ok();
  }

  Status Recv(std::span<std::byte> data, int src, int tag) override {
    THDPACK_RETURN_IF_ERROR(CheckPeer("Recv", src, tag));
    std::unique_lock<std::mutex> lk(world_->mu);
    auto& queue = state_->mail[{src, rank(), tag}];
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (queue.empty()) {
      if (!state_->broken.empty()) return Status::Aborted(state_->broken);
      const int g = state_->ranks[static_cast<size_t>(src)];
      if (world_->exited[static_cast<size_t>(g)]) {
        return Break("Recv from member " + std::to_string(src) + " (tag " + std::to_string(tag) +
                     ")", g, {});
      }
      if (world_->cv.wait_until(lk, deadline) == std::cv_status::timeout && queue.empty()) {
        return Break("Recv from member " + std::to_string(src) + " (tag " + std::to_string(tag) +
                     ")", -1, {src});
      }
    }
    std::vector<std::byte> msg = std::move(queue.front());
    queue.pop_front();
    lk.unlock();
    if (msg.size() != data.size()) {
      return Status::InvalidArgument("Recv on " + Describe() + " from member " +
                                     std::to_string(src) + " (tag " + std::to_string(tag) +
                                     "): the message holds " + std::to_string(msg.size()) +
                                     " bytes, the receiver expects " + std::to_string(data.size()));
    }
    if (!msg.empty()) std::memcpy(data.data(), msg.data(), msg.size());
    return Status::Ok();
  }

  Status Barrier() override {
    Publication pub{};
    return Collective("Barrier", pub, [] {});
  }

  Result<std::unique_ptr<ProcessGroup>> Split(std::span<const std::vector<int>> groups) override {
    int my_group = -1, my_index = -1;
    Status local = CheckSplit(groups, &my_group, &my_index);
    // Every member takes part even with bad arguments, so no peer waits for it.
    const uint64_t hash = local.ok() ? HashGroups(groups) : 0;
    const uint64_t seq = next_split_++;
    Publication pub{nullptr, 0, nullptr, nullptr, hash};
    Status read_status;
    THDPACK_RETURN_IF_ERROR(Collective("Split", pub, [&] {
      for (int j = 0; j < size(); ++j) {
        if (state_->pubs[static_cast<size_t>(j)].tag != hash) {
          read_status = Mismatch("Split", "member " + std::to_string(j) +
                                              " passed different (or invalid) group lists");
          return;
        }
      }
    }));
    THDPACK_RETURN_IF_ERROR(local);
    THDPACK_RETURN_IF_ERROR(read_status);
    std::shared_ptr<GroupState> child;
    {
      std::lock_guard<std::mutex> lk(world_->mu);
      auto& pending = state_->splits[seq];
      if (pending.children.empty()) {
        for (const auto& g : groups) pending.children.push_back(std::make_shared<GroupState>(g));
      }
      if (my_group >= 0) child = pending.children[static_cast<size_t>(my_group)];
      if (++pending.takers == static_cast<size_t>(size())) state_->splits.erase(seq);
    }
    if (my_group < 0) return std::unique_ptr<ProcessGroup>();
    auto group = std::make_unique<ThreadGroup>(world_, std::move(child), my_index);
    group->set_timeout(timeout());
    return std::unique_ptr<ProcessGroup>(std::move(group));
  }

 private:
  Status Mismatch(std::string_view op, const std::string& what) const {
    return Status::InvalidArgument(std::string(op) + " on " + Describe() +
                                   ": arguments disagree between members: " + what);
  }

  // Marks the group broken and returns the error: `exited_rank` (global) has left, or, when it
  // is -1, the timeout passed with the members `missing` (group positions) not arrived.
  // REQUIRES: world_->mu held.
  Status Break(const std::string& what, int exited_rank, const std::vector<int>& missing) {
    std::string msg;
    if (exited_rank >= 0) {
      const Status& s = world_->exit_status[static_cast<size_t>(exited_rank)];
      msg = what + " on " + Describe() + ": rank " + std::to_string(exited_rank) +
            " has left without taking part (it returned " + s.ToString() + ")";
    } else {
      msg = what + " on " + Describe() + ": not complete after " +
            std::to_string(timeout().count()) + " ms (the timeout): " +
            DescribeMembers(missing) + " did not arrive";
    }
    state_->broken = msg;
    world_->cv.notify_all();
    return Status::Aborted(msg);
  }

  // One generation of the group barrier. REQUIRES: lk holds world_->mu.
  Status Arrive(std::unique_lock<std::mutex>& lk, std::string_view op) {
    GroupState& g = *state_;
    if (!g.broken.empty()) return Status::Aborted(g.broken);
    const uint64_t gen = g.generation;
    g.arrived_flag[static_cast<size_t>(rank())] = 1;
    if (++g.arrived == g.ranks.size()) {
      g.arrived = 0;
      std::fill(g.arrived_flag.begin(), g.arrived_flag.end(), 0);
      ++g.generation;
      world_->cv.notify_all();
      return Status::Ok();
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (g.generation == gen) {
      if (!g.broken.empty()) return Status::Aborted(g.broken);
      for (size_t i = 0; i < g.ranks.size(); ++i) {
        if (!g.arrived_flag[i] && world_->exited[static_cast<size_t>(g.ranks[i])]) {
          return Break(std::string(op), g.ranks[i], {});
        }
      }
      if (world_->cv.wait_until(lk, deadline) == std::cv_status::timeout && g.generation == gen) {
        std::vector<int> missing;
        for (size_t i = 0; i < g.ranks.size(); ++i) {
          if (!g.arrived_flag[i]) missing.push_back(static_cast<int>(i));
        }
        return Break(std::string(op), -1, missing);
      }
    }
    return Status::Ok();
  }

  template <typename ReadFn>
  Status Collective(std::string_view op, const Publication& pub, ReadFn&& read) {
    {
      std::unique_lock<std::mutex> lk(world_->mu);
      state_->pubs[static_cast<size_t>(rank())] = pub;
      THDPACK_RETURN_IF_ERROR(Arrive(lk, op));
    }
    read();
    std::unique_lock<std::mutex> lk(world_->mu);
    return Arrive(lk, op);
  }

  std::shared_ptr<ThreadWorld> world_;
  std::shared_ptr<GroupState> state_;
  uint64_t next_split_ = 0;
};

}  // namespace

std::vector<Status> RunOnThreads(int world_size, const RankFunction& fn,
                                 const ThreadBackendOptions& options) {
  if (world_size < 1) {
    return {Status::InvalidArgument("RunOnThreads: world_size = " + std::to_string(world_size) +
                                    " must be >= 1")};
  }
  auto world = std::make_shared<ThreadWorld>(world_size);
  std::vector<int> all(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) all[static_cast<size_t>(r)] = r;
  auto world_state = std::make_shared<GroupState>(all);
  std::vector<Status> result(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      Status s;
      try {
        ThreadGroup group(world, world_state, r);
        group.set_timeout(options.timeout);
        s = fn(group);
      } catch (const std::exception& e) {
        s = Status::Internal("rank " + std::to_string(r) + " threw: " + e.what());
      } catch (...) {
        s = Status::Internal("rank " + std::to_string(r) + " threw a non-standard exception");
      }
      result[static_cast<size_t>(r)] = s;
      {
        std::lock_guard<std::mutex> lk(world->mu);
        world->exit_status[static_cast<size_t>(r)] = s;
        world->exited[static_cast<size_t>(r)] = 1;
      }
      world->cv.notify_all();
    });
  }
  for (auto& t : threads) t.join();
  return result;
}

}  // namespace thdpack
