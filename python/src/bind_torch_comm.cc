// python/src/bind_torch_comm.cc: the ProcessGroup over torch.distributed (torch_comm.h), the
// options a torch world is made with (CommOptions), and two bindings over a torch group:
//   thdpack._thdpack._agree_checks(group, error, entries, what): a collective entry point's
//       local checks and alike-values agreed over the group before its collective;
//   thdpack._thdpack._check_process_group(group): the checks every backend passes
//       (thdpack/comm_checks.h) on this one.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "thdpack/comm_checks.h"
#include "thdpack/job.h"
#include "torch_comm.h"

namespace thdpack::python {
namespace {

// The largest message Send buffers (returns before its receiver takes it): MPI's usual eager
// limit.
constexpr int64_t kEagerSendBytes = 64 * 1024;

// A non-empty address for empty spans (NumPy wants a pointer even for zero elements).
std::byte g_empty[8];

// The Python objects handed to torch collectives, released a while after their call. A tensor
// made in Python and dropped by Python while a gloo (or NCCL) worker thread still holds the
// finished work is freed by that thread when it lets go of the work, and freeing its Python
// object takes the GIL there; during the interpreter's finalisation Python ends such a thread
// with pthread_exit, whose forced unwind through the worker's noexcept loop aborts the process
// ("terminate called without an active exception" at the end of about 1 run in 5 of 4 gloo
// ranks). Held here, the last reference goes at a later call (the caller's thread or a data
// plane's, which the interpreter's exit joins first), once the workers have long let go
// (kReleaseDelay); what is still held at the process's end is never freed. Every access holds
// the GIL.
constexpr double kReleaseDelaySeconds = 2.0;
struct Deferred {
  std::chrono::steady_clock::time_point at;
  std::vector<py::object> objects;
};
std::deque<Deferred>& DeferredObjects() {
  static auto* q = new std::deque<Deferred>();  // never destroyed: after finalisation, no GIL
  return *q;
}

}  // namespace

void KeepThreadState() {
  // Called with the GIL held. One extra count on this thread's state keeps it: pybind11's
  // gil_scoped_acquire makes a thread state for a thread Python did not start and frees it
  // when its count falls to 0, i.e. at the end of every call.
  struct Keeper {
    PyThreadState* tstate = nullptr;
    ~Keeper() {
      // The thread ends: its state goes, under the GIL, while the interpreter is alive.
#if PY_VERSION_HEX >= 0x030D0000
      const bool finalizing = Py_IsFinalizing();
#else
      const bool finalizing = _Py_IsFinalizing();
#endif
      if (tstate == nullptr || !Py_IsInitialized() || finalizing) return;
      PyEval_RestoreThread(tstate);
      PyGILState_Release(PyGILState_LOCKED);  // count 1 -> 0: cleared, deleted, GIL released
    }
  };
  thread_local Keeper keeper;
  if (keeper.tstate != nullptr || PyGILState_Check() == 0) return;
  (void)PyGILState_Ensure();  // never released but by the keeper: the count stays >= 1
  keeper.tstate = PyGILState_GetThisThreadState();
}

void ReleaseLater(std::vector<py::object> objects) {
  if (objects.empty()) return;
  DeferredObjects().push_back(Deferred{std::chrono::steady_clock::now(), std::move(objects)});
}

void ReleaseDue() {
  auto& q = DeferredObjects();
  const auto now = std::chrono::steady_clock::now();
  // Taken out of the queue first, freed after: freeing a Python object runs Python code (a
  // finaliser, the collector) that may come back here or to ReleaseLater.
  std::vector<Deferred> due;
  while (!q.empty() && std::chrono::duration<double>(now - q.front().at).count() >
                           kReleaseDelaySeconds) {
    due.push_back(std::move(q.front()));
    q.pop_front();
  }
}

namespace {

class TorchProcessGroup final : public ProcessGroup {
 public:
  TorchProcessGroup(std::vector<int> ranks, int rank, py::object group,
                    std::shared_ptr<const TorchCommOptions> options)
      : ProcessGroup(std::move(ranks), rank),
        group_(std::move(group)),
        options_(std::move(options)) {
    dist_ = py::module_::import("torch.distributed");
    torch_ = py::module_::import("torch");
    // CUDA tensors on a pure NCCL group only (TorchCommOptions::cuda_device).
    const std::string backend = py::str(dist_.attr("get_backend")(group_));
    device_ = backend == "nccl" ? options_->cuda_device : py::none();
    // Member i (this group's order, which the step's rules choose) is some group rank t of
    // torch's: torch orders a group's ranks by global rank (new_group sorts them), so under a
    // rank order other than Megatron's the two differ. all_gather's parts and
    // all_to_all_single's splits are in torch's order, and are permuted here (member_at_).
    const int n = size();
    member_at_.assign(static_cast<size_t>(n), -1);
    for (int i = 0; i < n; ++i) {
      const int t = dist_.attr("get_group_rank")(group_, TorchRank(i)).cast<int>();
      if (t < 0 || t >= n || member_at_[static_cast<size_t>(t)] != -1) {
        throw std::runtime_error("torch group: member " + std::to_string(i) + " is group rank " +
                                 std::to_string(t) + " of a group of " + std::to_string(n));
      }
      member_at_[static_cast<size_t>(t)] = i;
    }
  }
  ~TorchProcessGroup() override {
    py::gil_scoped_acquire gil;
    if (owned_) {
      // A group Split made is destroyed with it (the dynamic step's cache drops groups, the
      // iterator's close drops them all), unless torch.distributed is already shut down. A
      // failure here has no one to report to: the group is then left to torch.
      try {
        if (dist_.attr("is_initialized")().cast<bool>()) {
          dist_.attr("destroy_process_group")(group_);
        }
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("thdpack: destroying a torch process group");
      }
    }
    ReleaseLater(std::move(held_));
    held_.clear();
    // Sends never waited for (a failed step): let go of, not waited on (a dead peer would hold
    // the wait until torch's timeout).
    ReleaseLater(std::move(sending_));
    sending_.clear();
    group_ = py::object();
    device_ = py::object();
    dist_ = py::object();
    torch_ = py::object();
    options_.reset();
  }

  std::string_view backend() const override { return "torch"; }

  const py::object& group() const { return group_; }
  // Split made the torch group (not one of the caller's): the destructor destroys it.
  void set_owned() { owned_ = true; }

  Status Broadcast(std::span<std::byte> data, int root) override {
    THDPACK_RETURN_IF_ERROR(CheckRoot("Broadcast", root));
    if (size() == 1) return Status::Ok();  // a group of one: nothing to move (no torch call)
    return Call("broadcast", [&] {
      py::object t = ToDevice(Bytes(data));
      dist_.attr("broadcast")(t, py::arg("src") = TorchRank(root), py::arg("group") = group_);
      FromDevice(t, data);
      if (rank() == root) AddBytesSent(static_cast<int64_t>(data.size()) * (size() - 1));
    });
  }

  Status AllGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<size_t>(size())) {
      return Status::InvalidArgument("AllGather on " + Describe() + ": recv has " +
                                     std::to_string(recv.size()) + " bytes, expected size() * " +
                                     std::to_string(send.size()));
    }
    if (size() == 1) {
      if (!send.empty()) std::memcpy(recv.data(), send.data(), send.size());
      return Status::Ok();
    }
    return Call("all_gather", [&] {
      py::object out = ToDevice(Bytes(recv));
      py::list parts;  // torch's group rank t fills member member_at_[t]'s slot
      const int64_t n = static_cast<int64_t>(send.size());
      for (int t = 0; t < size(); ++t) parts.append(out.attr("narrow")(0, MemberAt(t) * n, n));
      Hold(parts);
      dist_.attr("all_gather")(parts, ToDevice(Bytes(send)), py::arg("group") = group_);
      FromDevice(out, recv);
      AddBytesSent(n * (size() - 1));
    });
  }

  // An all_gather of every member's send padded to the largest count, then each member's part
  // copied to its displacement: (size - 1) * max(counts) bytes on the wire instead of the sum.
  Status AllGatherV(std::span<const std::byte> send, std::span<std::byte> recv,
                    std::span<const int64_t> counts, std::span<const int64_t> displs) override {
    THDPACK_RETURN_IF_ERROR(CheckVector("AllGatherV", "recv", counts, displs, recv.size()));
    if (counts[static_cast<size_t>(rank())] != static_cast<int64_t>(send.size())) {
      return Status::InvalidArgument("AllGatherV on " + Describe() + ": counts[" +
                                     std::to_string(rank()) +
                                     "] = " + std::to_string(counts[static_cast<size_t>(rank())]) +
                                     " but send has " + std::to_string(send.size()) + " bytes");
    }
    if (size() == 1) {
      if (!send.empty()) std::memcpy(recv.data() + displs[0], send.data(), send.size());
      return Status::Ok();
    }
    const int64_t most = std::max<int64_t>(1, *std::max_element(counts.begin(), counts.end()));
    std::vector<std::byte> padded(static_cast<size_t>(most), std::byte{0});
    if (!send.empty()) std::memcpy(padded.data(), send.data(), send.size());
    std::vector<std::byte> all(static_cast<size_t>(most * size()));
    return Call("all_gather (v)", [&] {
      py::object out = ToDevice(Bytes(std::span<std::byte>(all)));
      py::list parts;  // torch's group rank t fills member member_at_[t]'s slot
      for (int t = 0; t < size(); ++t) {
        parts.append(out.attr("narrow")(0, MemberAt(t) * most, most));
      }
      Hold(parts);
      dist_.attr("all_gather")(parts, ToDevice(Bytes(std::span<std::byte>(padded))),
                               py::arg("group") = group_);
      FromDevice(out, std::span<std::byte>(all));
      for (int i = 0; i < size(); ++i) {
        const size_t c = static_cast<size_t>(counts[static_cast<size_t>(i)]);
        if (c) std::memcpy(recv.data() + displs[static_cast<size_t>(i)], all.data() + i * most, c);
      }
      AddBytesSent(static_cast<int64_t>(send.size()) * (size() - 1));
    });
  }

  Status AllReduce(std::span<std::byte> data, ReduceType type, ReduceOp op) override {
    if (size() == 1) return Status::Ok();
    return Call("all_reduce", [&] {
      py::object t = ToDevice(Typed(data, type));
      py::object ops = dist_.attr("ReduceOp");
      py::object o = op == ReduceOp::kSum   ? ops.attr("SUM")
                     : op == ReduceOp::kMin ? ops.attr("MIN")
                                            : ops.attr("MAX");
      dist_.attr("all_reduce")(t, py::arg("op") = o, py::arg("group") = group_);
      FromDevice(t, data);
      AddBytesSent(static_cast<int64_t>(data.size()) * (size() - 1));
    });
  }

  // all_to_all_single with uneven splits. It takes packed buffers (block j at the sum of the
  // counts before it), so blocks are packed and unpacked when the displacements leave gaps.
  Status AllToAllV(std::span<const std::byte> send, std::span<const int64_t> send_counts,
                   std::span<const int64_t> send_displs, std::span<std::byte> recv,
                   std::span<const int64_t> recv_counts,
                   std::span<const int64_t> recv_displs) override {
    THDPACK_RETURN_IF_ERROR(
        CheckVector("AllToAllV", "send", send_counts, send_displs, send.size()));
    THDPACK_RETURN_IF_ERROR(
        CheckVector("AllToAllV", "recv", recv_counts, recv_displs, recv.size()));
    if (size() == 1) {
      if (send_counts[0] != recv_counts[0]) {
        return Status::InvalidArgument("AllToAllV on " + Describe() + ": a group of one sends " +
                                       std::to_string(send_counts[0]) + " bytes to itself but " +
                                       "receives " + std::to_string(recv_counts[0]));
      }
      if (send_counts[0]) {
        std::memcpy(recv.data() + recv_displs[0], send.data() + send_displs[0], send_counts[0]);
      }
      return Status::Ok();
    }
    const size_t n = static_cast<size_t>(size());
    // Torch takes blocks packed in its group-rank order. Where the caller's blocks already are
    // (member order is torch's, each block right after the one before it: every step's
    // exchange), the caller's buffers go to torch as they are; otherwise they are packed into
    // copies and unpacked after.
    auto in_order = [&](std::span<const int64_t> counts, std::span<const int64_t> displs) {
      int64_t at = 0;
      for (size_t t = 0; t < n; ++t) {
        const size_t j = static_cast<size_t>(MemberAt(static_cast<int>(t)));
        if (counts[j] != 0 && displs[j] != at) return false;
        at += counts[j];
      }
      return true;
    };
    auto packed_size = [&](std::span<const int64_t> c) {
      int64_t t = 0;
      for (int64_t v : c) t += v;
      return t;
    };
    const bool send_direct = in_order(send_counts, send_displs);
    const bool recv_direct = in_order(recv_counts, recv_displs);
    const size_t send_total = static_cast<size_t>(packed_size(send_counts));
    const size_t recv_total = static_cast<size_t>(packed_size(recv_counts));
    std::vector<std::byte> in(send_direct ? 0 : send_total);
    std::vector<std::byte> out(recv_direct ? 0 : recv_total);
    int64_t sent = 0;
    for (size_t j = 0; j < n; ++j) {
      if (static_cast<int>(j) != rank()) sent += send_counts[j];
    }
    if (!send_direct) {  // packed in torch's group-rank order: block t is member member_at_[t]'s
      int64_t at = 0;
      for (size_t t = 0; t < n; ++t) {
        const size_t j = static_cast<size_t>(MemberAt(static_cast<int>(t)));
        if (send_counts[j]) std::memcpy(in.data() + at, send.data() + send_displs[j], send_counts[j]);
        at += send_counts[j];
      }
    }
    const std::span<const std::byte> in_bytes =
        send_direct ? send.first(send_total) : std::span<const std::byte>(in);
    const std::span<std::byte> out_bytes =
        recv_direct ? recv.first(recv_total) : std::span<std::byte>(out);
    return Call("all_to_all_single", [&] {
      py::list in_splits, out_splits;
      for (size_t t = 0; t < n; ++t) {
        const size_t j = static_cast<size_t>(MemberAt(static_cast<int>(t)));
        in_splits.append(send_counts[j]);
        out_splits.append(recv_counts[j]);
      }
      py::object o = ToDevice(Bytes(out_bytes));
      dist_.attr("all_to_all_single")(o, ToDevice(Bytes(in_bytes)), out_splits, in_splits,
                                      py::arg("group") = group_);
      FromDevice(o, out_bytes);
      if (!recv_direct) {
        int64_t from = 0;
        for (size_t t = 0; t < n; ++t) {
          const size_t i = static_cast<size_t>(MemberAt(static_cast<int>(t)));
          if (recv_counts[i])
            std::memcpy(recv.data() + recv_displs[i], out.data() + from, recv_counts[i]);
          from += recv_counts[i];
        }
      }
      AddBytesSent(sent);
    });
  }

  Status Send(std::span<const std::byte> data, int dst, int tag) override {
    THDPACK_RETURN_IF_ERROR(CheckPeer("Send", dst, tag));
    if (dst == rank()) {  // to itself: kept here for its Recv (torch's gloo send to self crashes)
      to_self_.emplace_back(tag, std::vector<std::byte>(data.begin(), data.end()));
      return Status::Ok();
    }
    // A small message is buffered, as MPI's eager sends are (comm.h: Send may return before
    // the message is received): torch's gloo send waits for the receiver, so a ring whose
    // members receive in another order than they sent would hang. It goes as an isend of a copy
    // (the caller's bytes may go once Send returns), waited for before this group's next
    // collective (FinishSends). A large one waits for its receiver, as MPI's do: a copy of a
    // step's payload would cost more than the wait.
    const bool eager = static_cast<int64_t>(data.size()) <= kEagerSendBytes;
    return Call("send", [&] {
      py::object t = ToDevice(Bytes(data));
      if (!eager) {
        dist_.attr("send")(t, py::arg("dst") = TorchRank(dst), py::arg("group") = group_,
                           py::arg("tag") = tag);
      } else {
        if (device_.is_none()) t = t.attr("clone")();
        py::object work = dist_.attr("isend")(t, py::arg("dst") = TorchRank(dst),
                                              py::arg("group") = group_, py::arg("tag") = tag);
        sending_.push_back(std::move(work));
        sending_.push_back(std::move(t));
      }
      AddBytesSent(static_cast<int64_t>(data.size()));
    });
  }

  Status Recv(std::span<std::byte> data, int src, int tag) override {
    THDPACK_RETURN_IF_ERROR(CheckPeer("Recv", src, tag));
    if (src == rank()) {  // the first message this rank sent itself under `tag`
      auto it = std::find_if(to_self_.begin(), to_self_.end(),
                             [&](const auto& m) { return m.first == tag; });
      if (it == to_self_.end()) {
        return Status::InvalidArgument("Recv on " + Describe() + ": from itself with tag " +
                                       std::to_string(tag) + ", but it sent itself none");
      }
      if (it->second.size() != data.size()) {
        return Status::InvalidArgument(
            "Recv on " + Describe() + ": from itself with tag " + std::to_string(tag) + ": " +
            std::to_string(data.size()) + " bytes expected, " +
            std::to_string(it->second.size()) + " sent");
      }
      if (!data.empty()) std::memcpy(data.data(), it->second.data(), data.size());
      to_self_.erase(it);
      return Status::Ok();
    }
    return Call("recv", [&] {
      py::object t = ToDevice(Bytes(data));
      dist_.attr("recv")(t, py::arg("src") = TorchRank(src), py::arg("group") = group_,
                         py::arg("tag") = tag);
      FromDevice(t, data);
    });
  }

  Status Barrier() override {
    if (size() == 1) return Status::Ok();
    return Call("barrier", [&] {
      const bool gloo = py::str(dist_.attr("get_backend")(group_)).cast<std::string>() == "gloo";
      if (gloo && options_->monitored_barrier_seconds > 0) {
        py::object timedelta = py::module_::import("datetime").attr("timedelta");
        dist_.attr("monitored_barrier")(
            py::arg("group") = group_,
            py::arg("timeout") =
                timedelta(py::arg("seconds") = options_->monitored_barrier_seconds));
      } else {
        dist_.attr("barrier")(py::arg("group") = group_);
      }
    });
  }

  // The caller's groups when every list is one of them (agreed over this group: one 8-byte
  // all-reduce), else one dist.new_group per list, in list order on every member (torch
  // requires every rank of the default group to make every group, in one order), with the
  // world's backend.
  Result<std::unique_ptr<ProcessGroup>> Split(std::span<const std::vector<int>> groups) override {
    int my_group = -1, my_index = -1;
    THDPACK_RETURN_IF_ERROR(CheckSplit(groups, &my_group, &my_index));
    const KnownGroup* match = nullptr;
    if (my_group >= 0) {
      for (const KnownGroup& k : options_->known) {
        if (k.ranks == groups[static_cast<size_t>(my_group)]) match = &k;
      }
    }
    int64_t all_known = (my_group < 0 || match) ? 1 : 0;
    THDPACK_RETURN_IF_ERROR(AllReduceInt64(std::span<int64_t>(&all_known, 1), ReduceOp::kMin));
    if (all_known == 1) {
      if (my_group < 0) return std::unique_ptr<ProcessGroup>();
      py::gil_scoped_acquire gil;
      return std::unique_ptr<ProcessGroup>(new TorchProcessGroup(
          groups[static_cast<size_t>(my_group)], my_index, match->group, options_));
    }
    std::unique_ptr<ProcessGroup> mine;
    Status s = Call("new_group", [&] {
      // Groups kept from an earlier Split of the same lists (TorchCommOptions::kept_groups):
      // the same answer on every rank, which keeps the same dict through the same Splits.
      const bool keep = !options_->kept_groups.is_none();
      std::string key = options_->backend;
      for (const std::vector<int>& list : groups) {
        key += "|";
        for (int r : list) {
          key += std::to_string(options_->torch_ranks[static_cast<size_t>(r)]) + ",";
        }
      }
      py::list made_all;
      if (keep && options_->kept_groups.contains(py::str(key))) {
        made_all = options_->kept_groups[py::str(key)].cast<py::list>();
      } else {
        for (size_t g = 0; g < groups.size(); ++g) {
          py::list torch_ranks;
          for (int r : groups[g]) {
            torch_ranks.append(options_->torch_ranks[static_cast<size_t>(r)]);
          }
          if (options_->local_sync) {
            // Among the world's members alone, where it is part of the default group
            // (thdpack.torch.groups.local_new_group: torch's group names stay in step).
            made_all.append(py::module_::import("thdpack.torch.groups")
                                .attr("local_new_group")(torch_ranks, options_->backend));
          } else {
            made_all.append(dist_.attr("new_group")(py::arg("ranks") = torch_ranks,
                                                    py::arg("backend") = options_->backend));
          }
        }
        if (keep) options_->kept_groups[py::str(key)] = made_all;
      }
      if (my_group >= 0) {
        auto* group = new TorchProcessGroup(groups[static_cast<size_t>(my_group)], my_index,
                                            made_all[static_cast<size_t>(my_group)], options_);
        if (!keep) group->set_owned();
        mine.reset(group);
      }
    });
    // Every rank waits until every member has made (or taken) its groups: torch's new_group
    // returns on one member of a gloo group while a peer is still connecting to it (torch 2's
    // new_group has no barrier after it), and a member that destroyed the group right away - an
    // iterator made and closed at once, as a resume that reads a state does - closed the
    // connection under its peer ("Connection closed by peer" there, then a hang in the next
    // group). The same 8 bytes tell every rank whether one of them failed.
    int64_t made_all = s.ok() ? 1 : 0;
    Status agreed = AllReduceInt64(std::span<int64_t>(&made_all, 1), ReduceOp::kMin);
    if (!s.ok()) return s;
    if (!agreed.ok()) return agreed;
    if (made_all == 0) {
      return Status::Aborted("torch.distributed.new_group: another rank of torch group " +
                             Describe() + " failed to make its groups");
    }
    return mine;
  }

 private:
  int TorchRank(int position) const {
    return options_->torch_ranks[static_cast<size_t>(ranks()[static_cast<size_t>(position)])];
  }
  // The member (position in this group's order) that torch calls group rank t.
  int64_t MemberAt(int t) const { return member_at_[static_cast<size_t>(t)]; }

  // Runs fn with the GIL; a Python exception becomes kAborted naming the call and the group.
  // Every tensor a call hands torch is released later (ReleaseLater, after the call), never
  // here: see ReleaseLater.
  template <typename F>
  Status Call(std::string_view op, F&& fn) {
    py::gil_scoped_acquire gil;
    ReleaseDue();
    if (op != "send" && op != "recv") THDPACK_RETURN_IF_ERROR(FinishSends());
    struct Retire {
      TorchProcessGroup* self;
      ~Retire() { ReleaseLater(std::move(self->held_)); self->held_.clear(); }
    } retire{this};
    try {
      fn();
      return Status::Ok();
    } catch (py::error_already_set& e) {
      return Status::Aborted("torch.distributed." + std::string(op) + " on " + Describe() +
                             " (rank " + std::to_string(global_rank()) + "): " +
                             PyErrorText(e));
    } catch (const std::exception& e) {
      return Status::Internal("torch.distributed." + std::string(op) + " on " + Describe() +
                              " (rank " + std::to_string(global_rank()) + "): " + e.what());
    }
  }

  // A uint8 CPU tensor over the span (no copy; the span outlives the call).
  py::object Bytes(std::span<const std::byte> s) {
    void* p = s.empty() ? static_cast<void*>(g_empty) : const_cast<std::byte*>(s.data());
    py::array a(py::dtype::of<uint8_t>(), {static_cast<py::ssize_t>(s.size())}, {1}, p, py::none());
    return Hold(torch_.attr("from_numpy")(a));
  }
  py::object Hold(py::object o) {
    held_.push_back(o);
    return o;
  }
  py::object Typed(std::span<std::byte> s, ReduceType type) {
    const bool i64 = type == ReduceType::kInt64;
    const py::ssize_t n = static_cast<py::ssize_t>(s.size() / 8);
    py::array a(i64 ? py::dtype::of<int64_t>() : py::dtype::of<double>(), {n}, {8},
                s.empty() ? static_cast<void*>(g_empty) : s.data(), py::none());
    return Hold(torch_.attr("from_numpy")(a));
  }
  py::object ToDevice(py::object t) {
    if (device_.is_none()) return t;
    return Hold(t.attr("to")(device_));
  }
  // Copies a device tensor back into the span (no-op on CPU, where t is the span itself).
  void FromDevice(const py::object& t, std::span<std::byte> out) const {
    if (device_.is_none() || out.empty()) return;
    py::object cpu = t.attr("cpu")().attr("contiguous")();
    py::object view = torch_.attr("from_numpy")(py::array(py::dtype::of<uint8_t>(),
                                                          {static_cast<py::ssize_t>(out.size())},
                                                          {1}, out.data(), py::none()));
    view.attr("copy_")(cpu.attr("view")(torch_.attr("uint8")).attr("reshape")(-1));
  }

  py::object group_;
  std::vector<int> member_at_;  // torch group rank -> member (this group's position)
  std::vector<py::object> held_;  // the tensors of the call running (Call)
  std::deque<std::pair<int, std::vector<std::byte>>> to_self_;  // (tag, bytes) sent to itself
  std::vector<py::object> sending_;  // the isends not yet waited for: (work, tensor) pairs

  // Waits for this group's isends (Send), under the GIL: the next collective starts after them,
  // so that a failed send is reported there, naming it.
  Status FinishSends() {
    if (sending_.empty()) return Status::Ok();
    std::vector<py::object> pending = std::move(sending_);
    sending_.clear();
    Status s = Status::Ok();
    for (size_t i = 0; i < pending.size(); i += 2) {
      try {
        pending[i].attr("wait")();
      } catch (py::error_already_set& e) {
        if (s.ok()) {
          s = Status::Aborted("torch.distributed.isend on " + Describe() + " (rank " +
                              std::to_string(global_rank()) + "): " + PyErrorText(e));
        }
      }
    }
    ReleaseLater(std::move(pending));
    return s;
  }
  bool owned_ = false;
  std::shared_ptr<const TorchCommOptions> options_;
  py::object device_;  // None: CPU tensors
  py::object dist_;
  py::object torch_;
};

}  // namespace

py::object TorchGroupOf(const ProcessGroup* group) {
  const auto* t = dynamic_cast<const TorchProcessGroup*>(group);
  return t == nullptr ? py::none() : t->group();
}

std::unique_ptr<ProcessGroup> MakeTorchWorld(py::object group,
                                             std::shared_ptr<const TorchCommOptions> options,
                                             bool owned) {
  py::module_ dist = py::module_::import("torch.distributed");
  const int size = dist.attr("get_world_size")(group).cast<int>();
  const int rank = dist.attr("get_rank")(group).cast<int>();
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
  auto world = std::make_unique<TorchProcessGroup>(std::move(ranks), rank, std::move(group),
                                                   std::move(options));
  if (owned) world->set_owned();
  return world;
}


// How a torch world communicates (torch_comm.h): its ranks, the caller's known groups, the CUDA
// device of its NCCL groups and the world's own backend.
std::shared_ptr<TorchCommOptions> CommOptions(const py::object& world_group,
                                              std::vector<int> torch_ranks, const py::list& known,
                                              py::object device) {
  auto comm = std::make_shared<TorchCommOptions>();
  comm->torch_ranks = std::move(torch_ranks);
  for (const py::handle& k : known) {
    auto t = k.cast<py::tuple>();
    comm->known.push_back(
        KnownGroup{t[0].cast<std::string>(), t[1].cast<std::vector<int>>(), t[2]});
  }
  comm->cuda_device = std::move(device);
  py::module_ dist = py::module_::import("torch.distributed");
  comm->backend = py::str(dist.attr("get_backend")(world_group)).cast<std::string>();
  // A world smaller than the default group makes its groups among its members alone, where
  // torch can (TorchCommOptions::local_sync; the iterator refuses encoder ranks where not).
  if (dist.attr("get_world_size")().cast<int>() > static_cast<int>(comm->torch_ranks.size())) {
    comm->local_sync = py::module_::import("inspect")
                           .attr("signature")(dist.attr("new_group"))
                           .attr("parameters")
                           .attr("__contains__")("use_local_synchronization")
                           .cast<bool>();
  }
  return comm;
}

namespace {

// A torch group as the step's ProcessGroup (its members in torch's order, NCCL's on the current
// CUDA device).
std::unique_ptr<ProcessGroup> TorchWorldOf(const py::object& group) {
  auto dist = py::module_::import("torch.distributed");
  auto ranks = dist.attr("get_process_group_ranks")(group).cast<std::vector<int>>();
  py::object cuda = py::none();
  if (dist.attr("get_backend")(group).cast<std::string>() == "nccl") {
    auto cuda_mod = py::module_::import("torch").attr("cuda");
    cuda = py::module_::import("torch").attr("device")("cuda", cuda_mod.attr("current_device")());
  }
  return MakeTorchWorld(group, CommOptions(group, std::move(ranks), py::list(), cuda));
}

void AgreeChecks(py::object group, py::object error, std::optional<std::vector<JobEntry>> entries,
                 const std::string& what) {
  std::unique_ptr<ProcessGroup> world = TorchWorldOf(group);
  const Status local =
      error.is_none() ? Status::Ok() : Status::InvalidArgument(error.cast<std::string>());
  ThrowIfError(AgreeOnStatus(*world, local, what));
  if (entries) ThrowIfError(AgreeOnEntries(*world, *entries, what));
}

}  // namespace

void BindTorchComm(py::module_& m) {
  m.def("_agree_checks", &AgreeChecks, py::arg("group"), py::arg("error"), py::arg("entries"),
        py::arg("what"),
        "A collective entry point's local checks and the values every member must give alike, "
        "agreed over a torch group before its collective: ValueError (the failing member) or "
        "RuntimeError (the others) naming the member and the rule, on every member.");
  m.def(
      "_check_process_group",
      [](py::object group) {
        std::unique_ptr<ProcessGroup> world = TorchWorldOf(group);
        ThrowIfError(testing::CheckProcessGroup(*world));
        ThrowIfError(testing::CheckAgreement(*world));
      },
      py::arg("group"),
      "The process-group checks every backend passes (thdpack/comm_checks.h: each collective "
      "with uneven sizes, gaps and groups listed out of rank order, Split, bytes_sent, the "
      "status agreement) on the torch backend over `group`, collective over it; RuntimeError "
      "naming the rank, the operation and the first wrong value.");
}

}  // namespace thdpack::python
