// The MPI backend (compiled only with THDPACK_WITH_MPI): every group is an MPI communicator.
//
// Byte counts travel as MPI int counts of MPI_BYTE: a single transfer of more than INT_MAX
// bytes between one pair of ranks is refused with OutOfRange (MPI-3 has no large-count calls).
// Every MPI return code is checked (the communicators use MPI_ERRORS_RETURN) and wrapped with
// the call, the file and the line.
//
// Timeouts. Every collective is started non-blocking (MPI_Ibcast, MPI_Iallgather(v),
// MPI_Iallreduce, MPI_Ialltoallv, MPI_Ibarrier) and polled with MPI_Test against the group's
// timeout(); sends are MPI_Isend, receives wait on MPI_Iprobe. To name the members that did not
// arrive, each group has a shadow communicator (a duplicate): a rank whose collective times out
// asks every other member, on the shadow, which collective of the group it is in; a member that
// is itself polling a collective of this group answers with its collective count. Members that
// answer with the same count have arrived; the others (no answer within a grace of at most 2 s,
// or another count) are named. The rank then prints the error on stderr and calls MPI_Abort: a
// started MPI collective cannot be cancelled, so returning would leave MPI writing into buffers
// the caller frees.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "thdpack/comm.h"

namespace thdpack {
namespace {

// Owns MPI initialisation: finalises MPI when the last group is gone, if it initialised it.
class MpiEnv {
 public:
  static Result<std::shared_ptr<MpiEnv>> Get(bool thread_multiple) {
    static std::mutex mu;
    static std::weak_ptr<MpiEnv> current;
    std::lock_guard<std::mutex> lk(mu);
    if (auto env = current.lock()) {
      int level = 0;
      MPI_Query_thread(&level);
      if (thread_multiple && level < MPI_THREAD_MULTIPLE) {
        return Status::Unimplemented("MpiWorld: MPI was initialised at thread level " +
                                     std::to_string(level) + ", below MPI_THREAD_MULTIPLE, "
                                     "which groups used from two threads need (--prefetch)");
      }
      return env;
    }
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) {
      return Status::Internal("MpiWorld: MPI has already been finalised in this process");
    }
    bool owns = false;
    if (!initialized) {
      int provided = 0;
      const int rc = MPI_Init_thread(
          nullptr, nullptr, thread_multiple ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED,
          &provided);
      if (rc != MPI_SUCCESS) return Status::Internal("MPI_Init_thread failed with code " +
                                                     std::to_string(rc));
      owns = true;
    }
    if (thread_multiple) {
      int level = 0;
      MPI_Query_thread(&level);
      if (level < MPI_THREAD_MULTIPLE) {
        if (owns) MPI_Finalize();
        return Status::Unimplemented(
            "MpiWorld: MPI gives thread level " + std::to_string(level) +
            ", below MPI_THREAD_MULTIPLE (" + std::to_string(MPI_THREAD_MULTIPLE) +
            "), which groups used from two threads need (--prefetch)");
      }
    }
    auto env = std::shared_ptr<MpiEnv>(new MpiEnv(owns));
    current = env;
    return env;
  }
  ~MpiEnv() {
    if (owns_) MPI_Finalize();
  }

 private:
  explicit MpiEnv(bool owns) : owns_(owns) {}
  bool owns_;
};

std::string MpiErrorText(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(len));
}

#define THDPACK_MPI_CALL(call)                                                                \
  do {                                                                                        \
    const int thdpack_mpi_rc_ = (call);                                                       \
    if (thdpack_mpi_rc_ != MPI_SUCCESS) {                                                     \
      return Status::Internal(std::string(#call) + " failed on " + Describe() + " (" +       \
                              __FILE__ + ":" + std::to_string(__LINE__) +                     \
                              "): " + MpiErrorText(thdpack_mpi_rc_));                         \
    }                                                                                         \
  } while (0)

using Clock = std::chrono::steady_clock;

// Tags on a group's shadow communicator.
constexpr int kQueryTag = 1;  // "which collective are you in?" (int64: the asker's count)
constexpr int kReplyTag = 2;  // int64[2]: the member's collective count, 1 if polling one

class MpiGroup final : public ProcessGroup {
 public:
  // Takes ownership of comm and shadow.
  MpiGroup(std::shared_ptr<MpiEnv> env, MPI_Comm comm, MPI_Comm shadow, std::vector<int> ranks,
           int rank)
      : ProcessGroup(std::move(ranks), rank), env_(std::move(env)), comm_(comm), shadow_(shadow) {}
  ~MpiGroup() override {
    if (shadow_ != MPI_COMM_NULL) MPI_Comm_free(&shadow_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  std::string_view backend() const override { return "mpi"; }

  Status Broadcast(std::span<std::byte> data, int root) override {
    THDPACK_RETURN_IF_ERROR(CheckRoot("Broadcast", root));
    int count = 0;
    THDPACK_RETURN_IF_ERROR(ToInt("Broadcast", data.size(), &count));
    MPI_Request req;
    THDPACK_MPI_CALL(MPI_Ibcast(data.data(), count, MPI_BYTE, root, comm_, &req));
    THDPACK_RETURN_IF_ERROR(WaitCollective(req, "Broadcast"));
    if (rank() == root) AddBytesSent(static_cast<int64_t>(data.size()) * (size() - 1));
    return Status::Ok();
  }

  Status AllGather(std::span<const std::byte> send, std::span<std::byte> recv) override {
    if (recv.size() != send.size() * static_cast<size_t>(size())) {
      return Status::InvalidArgument("AllGather on " + Describe() + ": recv holds " +
                                     std::to_string(recv.size()) + " bytes, expected size() * " +
                                     std::to_string(send.size()));
    }
    int count = 0;
    THDPACK_RETURN_IF_ERROR(ToInt("AllGather", send.size(), &count));
    MPI_Request req;
    THDPACK_MPI_CALL(MPI_Iallgather(send.data(), count, MPI_BYTE, recv.data(), count, MPI_BYTE,
                                    comm_, &req));
    THDPACK_RETURN_IF_ERROR(WaitCollective(req, "AllGather"));
    AddBytesSent(static_cast<int64_t>(send.size()) * (size() - 1));
    return Status::Ok();
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
    std::vector<int> c, d;
    THDPACK_RETURN_IF_ERROR(ToInts("AllGatherV", counts, &c));
    THDPACK_RETURN_IF_ERROR(ToInts("AllGatherV", displs, &d));
    MPI_Request req;
    THDPACK_MPI_CALL(MPI_Iallgatherv(send.data(), c[static_cast<size_t>(rank())], MPI_BYTE,
                                     recv.data(), c.data(), d.data(), MPI_BYTE, comm_, &req));
    THDPACK_RETURN_IF_ERROR(WaitCollective(req, "AllGatherV"));
    AddBytesSent(static_cast<int64_t>(send.size()) * (size() - 1));
    return Status::Ok();
  }

  Status AllReduce(std::span<std::byte> data, ReduceType type, ReduceOp op) override {
    if (data.size() % 8 != 0) {
      return Status::InvalidArgument("AllReduce on " + Describe() + ": " +
                                     std::to_string(data.size()) +
                                     " bytes is not a whole number of 8-byte elements");
    }
    int count = 0;
    THDPACK_RETURN_IF_ERROR(ToInt("AllReduce", data.size() / 8, &count));
    const MPI_Datatype t = type == ReduceType::kInt64 ? MPI_INT64_T : MPI_DOUBLE;
    const MPI_Op o = op == ReduceOp::kSum ? MPI_SUM : op == ReduceOp::kMin ? MPI_MIN : MPI_MAX;
    MPI_Request req;
    THDPACK_MPI_CALL(MPI_Iallreduce(MPI_IN_PLACE, data.data(), count, t, o, comm_, &req));
    THDPACK_RETURN_IF_ERROR(WaitCollective(req, "AllReduce"));
    AddBytesSent(static_cast<int64_t>(data.size()) * (size() - 1));
    return Status::Ok();
  }

  Status AllToAllV(std::span<const std::byte> send, std::span<const int64_t> send_counts,
                   std::span<const int64_t> send_displs, std::span<std::byte> recv,
                   std::span<const int64_t> recv_counts,
                   std::span<const int64_t> recv_displs) override {
    THDPACK_RETURN_IF_ERROR(CheckVector("AllToAllV", "send", send_counts, send_displs, send.size()));
    THDPACK_RETURN_IF_ERROR(CheckVector("AllToAllV", "recv", recv_counts, recv_displs, recv.size()));
    std::vector<int> sc, sd, rc, rd;
    THDPACK_RETURN_IF_ERROR(ToInts("AllToAllV", send_counts, &sc));
    THDPACK_RETURN_IF_ERROR(ToInts("AllToAllV", send_displs, &sd));
    THDPACK_RETURN_IF_ERROR(ToInts("AllToAllV", recv_counts, &rc));
    THDPACK_RETURN_IF_ERROR(ToInts("AllToAllV", recv_displs, &rd));
    MPI_Request req;
    THDPACK_MPI_CALL(MPI_Ialltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(),
                                    rc.data(), rd.data(), MPI_BYTE, comm_, &req));
    THDPACK_RETURN_IF_ERROR(WaitCollective(req, "AllToAllV"));
    int64_t sent = 0;
    for (size_t j = 0; j < send_counts.size(); ++j) {
      if (static_cast<int>(j) != rank()) sent += send_counts[j];
    }
    AddBytesSent(sent);
    return Status::Ok();
  }

  Status Send(std::span<const std::byte> data, int dst, int tag) override {
    THDPACK_RETURN_IF_ERROR(CheckPeer("Send", dst, tag));
    int count = 0;
    THDPACK_RETURN_IF_ERROR(ToInt("Send", data.size(), &count));
    MPI_Request req;
    THDPACK_MPI_CALL(MPI_Isend(data.data(), count, MPI_BYTE, dst, tag, comm_, &req));
    THDPACK_RETURN_IF_ERROR(WaitPeer(req, "Send to member " + std::to_string(dst) + " (tag " +
                                              std::to_string(tag) + ")", dst));
    AddBytesSent(static_cast<int64_t>(data.size()));
    return Status::Ok();
  }

  Status Recv(std::span<std::byte> data, int src, int tag) override {
    THDPACK_RETURN_IF_ERROR(CheckPeer("Recv", src, tag));
    int count = 0;
    THDPACK_RETURN_IF_ERROR(ToInt("Recv", data.size(), &count));
    MPI_Status st;
    // Probe first so that a message of the wrong size is an error, not a truncation.
    THDPACK_RETURN_IF_ERROR(ProbePeer(src, tag, &st));
    int got = 0;
    THDPACK_MPI_CALL(MPI_Get_count(&st, MPI_BYTE, &got));
    if (got != count) {
      std::vector<std::byte> drain(static_cast<size_t>(got));
      THDPACK_MPI_CALL(MPI_Recv(drain.data(), got, MPI_BYTE, src, tag, comm_, MPI_STATUS_IGNORE));
      return Status::InvalidArgument("Recv on " + Describe() + " from member " +
                                     std::to_string(src) + " (tag " + std::to_string(tag) +
                                     "): the message holds " + std::to_string(got) +
                                     " bytes, the receiver expects " + std::to_string(count));
    }
    THDPACK_MPI_CALL(MPI_Recv(data.data(), count, MPI_BYTE, src, tag, comm_, MPI_STATUS_IGNORE));
    return Status::Ok();
  }

  Status Barrier() override {
    MPI_Request req;
    THDPACK_MPI_CALL(MPI_Ibarrier(comm_, &req));
    return WaitCollective(req, "Barrier");
  }

  Result<std::unique_ptr<ProcessGroup>> Split(std::span<const std::vector<int>> groups) override {
    int my_group = -1, my_index = -1;
    Status local = CheckSplit(groups, &my_group, &my_index);
    // Bad lists on any member fail the split on every member, before any communicator exists.
    THDPACK_RETURN_IF_ERROR(AgreeOnStatus(*this, local, "Split"));
    // Blocking: every member has just taken part in the agreement above.
    const int color = my_group >= 0 ? my_group : MPI_UNDEFINED;
    MPI_Comm child = MPI_COMM_NULL;
    THDPACK_MPI_CALL(MPI_Comm_split(comm_, color, my_index, &child));
    if (my_group < 0) return std::unique_ptr<ProcessGroup>();
    MPI_Comm shadow = MPI_COMM_NULL;
    if (MPI_Comm_dup(child, &shadow) != MPI_SUCCESS) {
      MPI_Comm_free(&child);
      return Status::Internal("MPI_Comm_dup of a split of " + Describe() + " failed");
    }
    MPI_Comm_set_errhandler(child, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(shadow, MPI_ERRORS_RETURN);
    auto group = std::make_unique<MpiGroup>(env_, child, shadow,
                                            groups[static_cast<size_t>(my_group)], my_index);
    group->set_timeout(timeout());
    return std::unique_ptr<ProcessGroup>(std::move(group));
  }

 private:
  // Between polls: spin (yielding the core) for the first 10 ms of a wait, then sleep 100 us, so
  // that oversubscribed ranks leave the cores to their peers.
  static void Pause(Clock::time_point start) {
    if (Clock::now() - start < std::chrono::milliseconds(10)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // Answers every pending query of a member whose collective of this group timed out.
  void AnswerQueries(bool polling) {
    while (true) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, shadow_, &flag, &st) != MPI_SUCCESS || !flag) {
        return;
      }
      int64_t asked = 0;
      MPI_Recv(&asked, 1, MPI_INT64_T, st.MPI_SOURCE, kQueryTag, shadow_, MPI_STATUS_IGNORE);
      int64_t reply[2] = {collectives_, polling ? 1 : 0};
      MPI_Send(reply, 2, MPI_INT64_T, st.MPI_SOURCE, kReplyTag, shadow_);
    }
  }

  // The one polling loop: calls test(&ready) until it sets ready, answering meanwhile the
  // queries of members whose collective timed out (in_collective: whether this rank waits in a
  // collective of this group), pausing between polls; past the group's timeout, timed_out()
  // ends the job (TimedOut does not return).
  template <typename Test, typename OnTimeout>
  Status PollUntil(bool in_collective, Test&& test, OnTimeout&& timed_out) {
    const Clock::time_point start = Clock::now();
    const Clock::time_point deadline = start + timeout();
    while (true) {
      int ready = 0;
      THDPACK_RETURN_IF_ERROR(test(&ready));
      if (ready) return Status::Ok();
      AnswerQueries(in_collective);
      if (Clock::now() >= deadline) timed_out();
      Pause(start);
    }
  }

  // Polls a started collective until it completes or the timeout passes (then TimedOut).
  Status WaitCollective(MPI_Request& req, std::string_view op) {
    ++collectives_;
    return PollUntil(
        true,
        [&](int* done) -> Status {
          THDPACK_MPI_CALL(MPI_Test(&req, done, MPI_STATUS_IGNORE));
          return Status::Ok();
        },
        [&] { TimedOut(op, MissingMembers()); });
  }

  // Polls a started send to member `peer`.
  Status WaitPeer(MPI_Request& req, const std::string& op, int peer) {
    return PollUntil(
        false,
        [&](int* done) -> Status {
          THDPACK_MPI_CALL(MPI_Test(&req, done, MPI_STATUS_IGNORE));
          return Status::Ok();
        },
        [&] { TimedOut(op, DescribeMembers(std::vector<int>{peer}) + " did not receive"); });
  }

  // Waits until a message from `src` with `tag` can be received.
  Status ProbePeer(int src, int tag, MPI_Status* st) {
    return PollUntil(
        false,
        [&](int* flag) -> Status {
          THDPACK_MPI_CALL(MPI_Iprobe(src, tag, comm_, flag, st));
          return Status::Ok();
        },
        [&] {
          TimedOut("Recv from member " + std::to_string(src) + " (tag " + std::to_string(tag) +
                       ")",
                   DescribeMembers(std::vector<int>{src}) + " did not send");
        });
  }

  // After a collective timed out: asks every other member which collective of this group it
  // is in, and describes those that are not in this one ("member 3 (global rank 7) did not
  // arrive (...)").
  std::string MissingMembers() {
    const int n = size();
    const int64_t mine = collectives_;
    std::vector<MPI_Request> sends;
    for (int j = 0; j < n; ++j) {
      if (j == rank()) continue;
      MPI_Request r;
      if (MPI_Isend(&mine, 1, MPI_INT64_T, j, kQueryTag, shadow_, &r) == MPI_SUCCESS) {
        sends.push_back(r);
      }
    }
    std::vector<int64_t> answer(static_cast<size_t>(n), -1);  // their count; -1: no answer
    std::vector<int64_t> polling(static_cast<size_t>(n), 0);
    answer[static_cast<size_t>(rank())] = mine;
    polling[static_cast<size_t>(rank())] = 1;
    int pending = n - 1;
    const Clock::time_point start = Clock::now();
    const auto grace = std::min<std::chrono::milliseconds>(timeout(), std::chrono::seconds(2));
    while (pending > 0 && Clock::now() - start < grace) {
      AnswerQueries(true);
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kReplyTag, shadow_, &flag, &st) == MPI_SUCCESS && flag) {
        int64_t reply[2] = {0, 0};
        MPI_Recv(reply, 2, MPI_INT64_T, st.MPI_SOURCE, kReplyTag, shadow_, MPI_STATUS_IGNORE);
        const size_t j = static_cast<size_t>(st.MPI_SOURCE);
        if (answer[j] < 0) --pending;
        answer[j] = reply[0];
        polling[j] = reply[1];
        continue;
      }
      Pause(start);
    }
    std::vector<int> silent, elsewhere;
    std::string where;
    for (int j = 0; j < n; ++j) {
      const size_t jj = static_cast<size_t>(j);
      if (answer[jj] < 0) {
        silent.push_back(j);
      } else if (answer[jj] != mine || !polling[jj]) {
        elsewhere.push_back(j);
        where += "; member " + std::to_string(j) + " is " +
                 (polling[jj] ? "in collective " + std::to_string(answer[jj])
                              : "past collective " + std::to_string(answer[jj]) +
                                    " (in a send or receive)") +
                 " of this group, this rank in collective " + std::to_string(mine);
      }
    }
    std::vector<int> missing = silent;
    missing.insert(missing.end(), elsewhere.begin(), elsewhere.end());
    std::sort(missing.begin(), missing.end());
    if (missing.empty()) {
      return "every member answered from this collective, yet it did not complete (an MPI "
             "fault?)";
    }
    std::string text = DescribeMembers(missing) + " did not arrive";
    if (!silent.empty()) {
      text += " (" + std::to_string(silent.size()) + " gave no answer within " +
              std::to_string(grace.count()) + " ms: not in a collective of this group" + where +
              ")";
    } else {
      text += " (" + where.substr(2) + ")";
    }
    return text;
  }

  // Reports the timeout on stderr ("<op> on <group>: not complete after N ms (the timeout):
  // <missing>") and ends the job (see the top of this file).
  [[noreturn]] void TimedOut(std::string_view op, const std::string& missing) {
    const std::string msg = std::string(op) + " on " + Describe() + ": not complete after " +
                            std::to_string(timeout().count()) + " ms (the timeout): " + missing;
    std::fprintf(stderr, "thdpack: rank %d: Aborted: %s; ending the job with MPI_Abort\n",
                 global_rank(), msg.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::abort();  // MPI_Abort does not return
  }

  Status ToInt(std::string_view op, size_t n, int* out) const {
    if (n > static_cast<size_t>(INT_MAX)) {
      return Status::OutOfRange(std::string(op) + " on " + Describe() + ": " +
                                std::to_string(n) + " exceeds the MPI count limit " +
                                std::to_string(INT_MAX));
    }
    *out = static_cast<int>(n);
    return Status::Ok();
  }
  Status ToInts(std::string_view op, std::span<const int64_t> v, std::vector<int>* out) const {
    out->resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] < 0 || v[i] > INT_MAX) {
        return Status::OutOfRange(std::string(op) + " on " + Describe() + ": count or offset " +
                                  std::to_string(v[i]) + " exceeds the MPI count limit " +
                                  std::to_string(INT_MAX));
      }
      (*out)[i] = static_cast<int>(v[i]);
    }
    return Status::Ok();
  }

  std::shared_ptr<MpiEnv> env_;  // keeps MPI initialised while this group exists
  MPI_Comm comm_;
  MPI_Comm shadow_;          // a duplicate of comm_: timeout queries and answers
  int64_t collectives_ = 0;  // collectives this rank has started on this group
};

}  // namespace

bool MpiAvailable() { return true; }

Result<std::unique_ptr<ProcessGroup>> MpiWorld(bool thread_multiple) {
  THDPACK_ASSIGN_OR_RETURN(std::shared_ptr<MpiEnv> env, MpiEnv::Get(thread_multiple));
  MPI_Comm comm = MPI_COMM_NULL;
  if (MPI_Comm_dup(MPI_COMM_WORLD, &comm) != MPI_SUCCESS) {
    return Status::Internal("MpiWorld: MPI_Comm_dup(MPI_COMM_WORLD) failed");
  }
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm shadow = MPI_COMM_NULL;
  if (MPI_Comm_dup(comm, &shadow) != MPI_SUCCESS) {
    MPI_Comm_free(&comm);
    return Status::Internal("MpiWorld: MPI_Comm_dup of the world failed");
  }
  MPI_Comm_set_errhandler(shadow, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<size_t>(r)] = r;
  return std::unique_ptr<ProcessGroup>(new MpiGroup(std::move(env), comm, shadow, std::move(ranks), rank));
}

}  // namespace thdpack
