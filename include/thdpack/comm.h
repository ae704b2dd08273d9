// thdpack/comm.h: the small process-group interface the distributed step runs on
// (docs/design.md sections 1 and 7), and its backends.
//
// A ProcessGroup is one rank's handle onto an ordered list of global ranks (a group of the
// topology: TP, CP, DP, DPxCP, PP, or the world). Every collective is called by every member of
// the group, in the same order; arguments that describe other ranks' data (counts, roots) must
// agree across members, as in MPI. Every function that communicates takes its group explicitly:
// there is no "current group" anywhere.
//
// Backends:
//   threads  one std::thread per rank inside one process (RunOnThreads below); for tests and
//            single-machine runs. Collectives are rendezvous on shared memory: each rank
//            publishes its buffers, every rank copies what it needs straight from its peers.
//   mpi      OpenMPI (or any MPI), for multi-process and multi-node runs started with mpirun.
//            Built only with -DTHDPACK_WITH_MPI=ON; MpiWorld() returns Unimplemented otherwise.
//            Groups are MPI communicators made with MPI_Comm_split from the group lists.
//   (NCCL may follow behind the same interface; nothing here assumes host memory beyond the
//    spans it is given.)
//
// Failures. A backend error (an MPI return code, a peer thread that left, a timeout) comes back
// as a Status naming the operation, the group and, where known, the rank. No wait is unbounded:
// an operation that does not complete within the group's timeout() fails and names the members
// that did not arrive (on MPI, after printing that error, the job ends with MPI_Abort). An error that only
// one rank sees (a bad sample, a budget overflow, corrupt metadata) is made everybody's error by
// AgreeOnStatus: call it before any step in which a peer would wait for data that a failed rank
// will never send. Every rank then returns an error - the failed rank its own, the others
// kAborted naming the failed rank and its message - and no rank hangs.
//
// Bytes sent. Every group counts the payload bytes this rank hands to other ranks, by a rule
// that depends only on the arguments, so both backends count the same (docs/distributed.md):
//   Send: n; Broadcast: n * (size - 1) at the root, 0 elsewhere; AllGather(V): this rank's
//   contribution * (size - 1); AllReduce: n * (size - 1); AllToAllV: the bytes addressed to
//   other ranks (what stays on this rank is not sent); Barrier: 0.
//
// Thread-safety: a ProcessGroup belongs to one rank (one thread, or one process); it is not to be
// used from two threads at once. Distinct groups of one rank may not be used concurrently either
// (collectives of one rank are issued in one order).
#ifndef THDPACK_COMM_H_
#define THDPACK_COMM_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "thdpack/status.h"

namespace thdpack {

enum class ReduceOp : int { kSum, kMin, kMax };

// The default of ProcessGroup::timeout() (and of `thdpack run --timeout`): 300 s.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{300000};
// Element types of AllReduce.
enum class ReduceType : int { kInt64, kFloat64 };

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // The members as global ranks, in group order; rank() is this rank's position in it.
  std::span<const int> ranks() const { return ranks_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int rank() const { return rank_; }
  int global_rank() const { return ranks_[static_cast<size_t>(rank_)]; }
  // Position of global rank g in this group, or -1 when g is not a member.
  int IndexOf(int global_rank) const;
  // "threads" or "mpi".
  virtual std::string_view backend() const = 0;
  // A short description for messages, e.g. "group [0,2,4,6]".
  std::string Describe() const;

  // Payload bytes this rank has handed to other ranks through this group (rule at the top).
  int64_t bytes_sent() const { return bytes_sent_; }

  // The longest one operation of this group (a collective, a Recv) waits for its peers. Past
  // it, the threads backend returns kAborted naming the members that did not arrive (and the
  // group is broken: its other members fail at once too); the MPI backend prints the same error
  // on stderr and ends the job with MPI_Abort, because a started MPI collective cannot be
  // cancelled (its buffers stay in use). Groups made by Split inherit it. Default
  // kDefaultCollectiveTimeout (300 s); RunOnThreads starts from ThreadBackendOptions::timeout.
  // REQUIRES: t > 0. Not for use while an operation of this group is under way.
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  // ---- Collectives (every member calls them, in the same order). ----

  // Root's `data` is copied into every member's `data`. REQUIRES: same size on every member,
  // 0 <= root < size().
  [[nodiscard]] virtual Status Broadcast(std::span<std::byte> data, int root) = 0;

  // recv = the concatenation, in group order, of every member's `send`.
  // REQUIRES: every send has the same size; recv.size() == size() * send.size().
  [[nodiscard]] virtual Status AllGather(std::span<const std::byte> send,
                                         std::span<std::byte> recv) = 0;

  // Member i's `send` lands at recv[displs[i] .. displs[i] + counts[i]). counts and displs (in
  // bytes, [size()]) are the same on every member; counts[rank()] == send.size().
  [[nodiscard]] virtual Status AllGatherV(std::span<const std::byte> send,
                                          std::span<std::byte> recv,
                                          std::span<const int64_t> counts,
                                          std::span<const int64_t> displs) = 0;

  // Element-wise reduction of `data` (count elements of `type`) over the members, in place.
  // REQUIRES: data.size() == count * element size, the same count, type, op everywhere.
  [[nodiscard]] virtual Status AllReduce(std::span<std::byte> data, ReduceType type,
                                         ReduceOp op) = 0;

  // Personalised exchange: the send_counts[j] bytes at send[send_displs[j]] go to member j, and
  // the recv_counts[i] bytes from member i land at recv[recv_displs[i]]. All arrays [size()],
  // in bytes. REQUIRES: send_counts[j] on member i == recv_counts[i] on member j.
  [[nodiscard]] virtual Status AllToAllV(std::span<const std::byte> send,
                                         std::span<const int64_t> send_counts,
                                         std::span<const int64_t> send_displs,
                                         std::span<std::byte> recv,
                                         std::span<const int64_t> recv_counts,
                                         std::span<const int64_t> recv_displs) = 0;

  // Point to point, addressed by position in this group. Messages between one pair with one tag
  // arrive in the order sent; the receiver gives the exact size. Send may return before the
  // message is received (threads: always; MPI and torch: for small messages, torch's up to 64
  // KiB). tag in [0, 32767].
  [[nodiscard]] virtual Status Send(std::span<const std::byte> data, int dst, int tag) = 0;
  [[nodiscard]] virtual Status Recv(std::span<std::byte> data, int src, int tag) = 0;

  [[nodiscard]] virtual Status Barrier() = 0;

  // Collective over this group: `groups` is a list of disjoint lists of global ranks, each a
  // subset of this group, the same list on every member. Returns the group that contains this
  // rank, ordered as listed, or nullptr when no list contains it. Typically called on the world
  // with Topology::AllGroups(kind).
  [[nodiscard]] virtual Result<std::unique_ptr<ProcessGroup>> Split(
      std::span<const std::vector<int>> groups) = 0;

  // ---- Typed helpers over the byte interface. ----
  template <typename T>
  [[nodiscard]] Status BroadcastValues(std::span<T> data, int root) {
    static_assert(std::is_trivially_copyable_v<T>);
    return Broadcast(std::as_writable_bytes(data), root);
  }
  template <typename T>
  [[nodiscard]] Status AllGatherValues(std::span<const T> send, std::span<T> recv) {
    static_assert(std::is_trivially_copyable_v<T>);
    return AllGather(std::as_bytes(send), std::as_writable_bytes(recv));
  }
  // counts/displs in elements of T.
  template <typename T>
  [[nodiscard]] Status AllGatherVValues(std::span<const T> send, std::span<T> recv,
                                        std::span<const int64_t> counts,
                                        std::span<const int64_t> displs) {
    static_assert(std::is_trivially_copyable_v<T>);
    std::vector<int64_t> c(counts.begin(), counts.end()), d(displs.begin(), displs.end());
    for (auto& v : c) v *= static_cast<int64_t>(sizeof(T));
    for (auto& v : d) v *= static_cast<int64_t>(sizeof(T));
    return AllGatherV(std::as_bytes(send), std::as_writable_bytes(recv), c, d);
  }
  [[nodiscard]] Status AllReduceInt64(std::span<int64_t> data, ReduceOp op) {
    return AllReduce(std::as_writable_bytes(data), ReduceType::kInt64, op);
  }
  [[nodiscard]] Status AllReduceFloat64(std::span<double> data, ReduceOp op) {
    return AllReduce(std::as_writable_bytes(data), ReduceType::kFloat64, op);
  }
  template <typename T>
  [[nodiscard]] Status SendValues(std::span<const T> data, int dst, int tag) {
    static_assert(std::is_trivially_copyable_v<T>);
    return Send(std::as_bytes(data), dst, tag);
  }
  template <typename T>
  [[nodiscard]] Status RecvValues(std::span<T> data, int src, int tag) {
    static_assert(std::is_trivially_copyable_v<T>);
    return Recv(std::as_writable_bytes(data), src, tag);
  }

 protected:
  ProcessGroup(std::vector<int> ranks, int rank) : ranks_(std::move(ranks)), rank_(rank) {}
  void AddBytesSent(int64_t n) { bytes_sent_ += n; }
  // Argument checks shared by the backends (InvalidArgument naming the operation and value).
  Status CheckRoot(std::string_view op, int root) const;
  Status CheckPeer(std::string_view op, int peer, int tag) const;
  Status CheckVector(std::string_view op, std::string_view name, std::span<const int64_t> counts,
                     std::span<const int64_t> displs, size_t buffer_size) const;
  Status CheckSplit(std::span<const std::vector<int>> groups, int* my_group,
                    int* my_index) const;
  // "member 2 (global rank 5)", "members 1, 2 (global ranks 3, 5)": for timeout messages.
  std::string DescribeMembers(std::span<const int> positions) const;

 private:
  std::vector<int> ranks_;
  int rank_ = 0;
  int64_t bytes_sent_ = 0;
  std::chrono::milliseconds timeout_ = kDefaultCollectiveTimeout;
};

// Makes `local` everybody's status, over `group`. Collective: every member calls it, OK or not.
// Returns OK when every member's local status is OK. Otherwise, with f the failed member of
// lowest group position: f gets its own status back; every other member (failed or not) gets
// kAborted "rank G (<context>) failed: <code>: <message>" with G f's global rank, whose
// origin() is f's origin() (so every rank exits with the same code) - or, for a member that
// failed itself, its own status. Costs one all-reduce of 8 bytes when all is well,
// plus two broadcasts (length and origin, message) when not. A backend error during the agreement itself
// is returned as is.
[[nodiscard]] Status AgreeOnStatus(ProcessGroup& group, const Status& local,
                                   std::string_view context = "");

// ---- Thread backend. ----

struct ThreadBackendOptions {
  // The world group's timeout() (and so its splits'): the longest any rank waits in one
  // operation for its peers before giving up with kAborted naming those that did not arrive.
  // Default kDefaultCollectiveTimeout (300 s).
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
};

// Runs fn(world) on world_size threads, one per rank, each with its own handle `world` onto the
// world group (ranks 0..world_size-1), and returns each rank's status, in rank order. A rank
// whose fn returned (with any status) or threw (reported as kInternal) has left: a peer that
// later waits on it gets kAborted naming it, instead of hanging. REQUIRES: world_size >= 1.
using RankFunction = std::function<Status(ProcessGroup& world)>;
[[nodiscard]] std::vector<Status> RunOnThreads(int world_size, const RankFunction& fn,
                                               const ThreadBackendOptions& options = {});

// ---- MPI backend. ----

// True when this build has the MPI backend (THDPACK_WITH_MPI).
bool MpiAvailable();

// This process's handle onto MPI_COMM_WORLD. Initialises MPI (MPI_THREAD_FUNNELED, or
// MPI_THREAD_MULTIPLE with thread_multiple: groups of this process used from several threads at
// once, each group by one) on first use unless the caller already did; MPI is finalised when the
// last group made by this backend is destroyed, if thdpack initialised it. MPI errors are
// returned (MPI_ERRORS_RETURN), wrapped with the call, file and line. Unimplemented when built
// without MPI, or when thread_multiple is asked and MPI does not give MPI_THREAD_MULTIPLE (or
// was initialised below it), naming the level it gives.
[[nodiscard]] Result<std::unique_ptr<ProcessGroup>> MpiWorld(bool thread_multiple = false);

}  // namespace thdpack

#endif  // THDPACK_COMM_H_
