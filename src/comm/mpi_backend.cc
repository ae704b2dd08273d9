// The MPI backend (compiled only with THDPACK_WITH_MPI): every group is an MPI communicator.
//
// Byte counts travel as MPI int counts of MPI_BYTE: a single transfer of more than INT_MAX
// bytes between one pair of ranks is refused with OutOfRange (MPI-3 has no large-count calls).
// Every MPI return code is checked (the communicators use MPI_ERRORS_RETURN) and wrapped with
// the call, the file and the line.
#include <mpi.h>

#include <climits>
#include <mutex>
#include <string>

#include "thdpack/comm.h"

namespace thdpack {
namespace {

// Owns MPI initialisation: finalises MPI when the last group is gone, if it initialised it.
class MpiEnv {
 public:
  static Result<std::shared_ptr<MpiEnv>> Get() {
    static std::mutex mu;
    static std::weak_ptr<MpiEnv> current;
    std::lock_guard<std::mutex> lk(mu);
    if (auto env = current.lock()) return env;
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) {
      return Status::Internal("MpiWorld: MPI has already been finalised in this process");
    }
    bool owns = false;
    if (!initialized) {
      int provided = 0;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      if (rc != MPI_SUCCESS) return Status::Internal("MPI_Init_thread failed with code " +
                                                     std::to_string(rc));
      owns = true;
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

class MpiGroup final : public ProcessGroup {
 public:
  MpiGroup(std::shared_ptr<MpiEnv> env, MPI_Comm comm, std::vector<int> ranks, int rank)
      : ProcessGroup(std::move(ranks), rank), env_(std::move(env)), comm_(comm) {}
  ~MpiGroup() override {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  std::string_view backend() const override { return "mpi"; }

  Status Broadcast(std::span<std::byte> data, int root) override {
    THDPACK_RETURN_IF_ERROR(CheckRoot("Broadcast", root));
    int count = 0;
    THDPACK_RETURN_IF_ERROR(ToInt("Broadcast", data.size(), &count));
    THDPACK_MPI_CALL(MPI_Bcast(data.data(), count, MPI_BYTE, root, comm_));
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
    THDPACK_MPI_CALL(MPI_Allgather(send.data(), count, MPI_BYTE, recv.data(), count, MPI_BYTE,
                                   comm_));
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
    THDPACK_MPI_CALL(MPI_Allgatherv(send.data(), c[static_cast<size_t>(rank())], MPI_BYTE,
                                    recv.data(), c.data(), d.data(), MPI_BYTE, comm_));
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
    THDPACK_MPI_CALL(MPI_Allreduce(MPI_IN_PLACE, data.data(), count, t, o, comm_));
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
    THDPACK_MPI_CALL(MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_BYTE, recv.data(),
                                   rc.data(), rd.data(), MPI_BYTE, comm_));
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
    THDPACK_MPI_CALL(MPI_Send(data.data(), count, MPI_BYTE, dst, tag, comm_));
    AddBytesSent(static_cast<int64_t>(data.size()));
    return Status::Ok();
  }

  Status Recv(std::span<std::byte> data, int src, int tag) override {
    THDPACK_RETURN_IF_ERROR(CheckPeer("Recv", src, tag));
    int count = 0;
    THDPACK_RETURN_IF_ERROR(ToInt("Recv", data.size(), &count));
    MPI_Status st;
    // Probe first so that a message of the wrong size is an error, not a truncation.
    THDPACK_MPI_CALL(MPI_Probe(src, tag, comm_, &st));
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
    THDPACK_MPI_CALL(MPI_Barrier(comm_));
    return Status::Ok();
  }

  Result<std::unique_ptr<ProcessGroup>> Split(std::span<const std::vector<int>> groups) override {
    int my_group = -1, my_index = -1;
    Status local = CheckSplit(groups, &my_group, &my_index);
    // Bad lists on any member fail the split on every member, before any communicator exists.
    THDPACK_RETURN_IF_ERROR(AgreeOnStatus(*this, local, "Split"));
    const int color = my_group >= 0 ? my_group : MPI_UNDEFINED;
    MPI_Comm child = MPI_COMM_NULL;
    THDPACK_MPI_CALL(MPI_Comm_split(comm_, color, my_index, &child));
    if (my_group < 0) return std::unique_ptr<ProcessGroup>();
    THDPACK_MPI_CALL(MPI_Comm_set_errhandler(child, MPI_ERRORS_RETURN));
    return std::unique_ptr<ProcessGroup>(
        new MpiGroup(env_, child, groups[static_cast<size_t>(my_group)], my_index));
  }

 private:
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
};

}  // namespace

bool MpiAvailable() { return true; }

Result<std::unique_ptr<ProcessGroup>> MpiWorld() {
  THDPACK_ASSIGN_OR_RETURN(std::shared_ptr<MpiEnv> env, MpiEnv::Get());
  MPI_Comm comm = MPI_COMM_NULL;
  if (MPI_Comm_dup(MPI_COMM_WORLD, &comm) != MPI_SUCCESS) {
    return Status::Internal("MpiWorld: MPI_Comm_dup(MPI_COMM_WORLD) failed");
  }
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<size_t>(r)] = r;
  return std::unique_ptr<ProcessGroup>(new MpiGroup(std::move(env), comm, std::move(ranks), rank));
}

}  // namespace thdpack
