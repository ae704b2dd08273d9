// Checks of the process-group interface (thdpack/comm.h) that every backend must pass: written
// once and run on the thread backend (src/comm/comm_test.cc, world sizes 1..8), under mpirun
// (tests/mpi_check.cc) and on the torch.distributed backend of the bindings
// (thdpack._thdpack._check_process_group, python/tests/test_torch_comm.py) - and on a backend of
// a user's own. Each returns OK or an error naming the rank, the operation and the first wrong
// value. Expected values are closed-form functions of the ranks, worked out here independently
// of the backends.
#ifndef THDPACK_COMM_CHECKS_H_
#define THDPACK_COMM_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "thdpack/comm.h"

namespace thdpack::testing {

inline Status Fail(const ProcessGroup& g, const std::string& what) {
  return Status::Internal("rank " + std::to_string(g.global_rank()) + ": " + what);
}

// Broadcast, all-gather(v), all-reduce, all-to-all-v, send/recv on `g` (any group).
inline Status CheckCollectivesOn(ProcessGroup& g) {
  const int n = g.size();
  const int r = g.rank();
  // Broadcast from every root.
  for (int root = 0; root < n; ++root) {
    std::vector<int64_t> v(5);
    for (int k = 0; k < 5; ++k) v[k] = (g.rank() == root) ? root * 1000 + k : -1;
    THDPACK_RETURN_IF_ERROR(g.BroadcastValues(std::span<int64_t>(v), root));
    for (int k = 0; k < 5; ++k) {
      if (v[k] != root * 1000 + k) return Fail(g, "Broadcast root " + std::to_string(root));
    }
  }
  // AllGather of 3 values per member.
  {
    const std::vector<int64_t> send = {r, int64_t{r} * r, -r};
    std::vector<int64_t> recv(static_cast<size_t>(3 * n), 99);
    THDPACK_RETURN_IF_ERROR(g.AllGatherValues(std::span<const int64_t>(send), std::span<int64_t>(recv)));
    for (int j = 0; j < n; ++j) {
      if (recv[3 * j] != j || recv[3 * j + 1] != int64_t{j} * j || recv[3 * j + 2] != -j) {
        return Fail(g, "AllGather entry of member " + std::to_string(j));
      }
    }
  }
  // AllGatherV: member j sends j+1 bytes; one untouched sentinel byte between blocks.
  {
    std::vector<int64_t> counts(n), displs(n);
    int64_t off = 0;
    for (int j = 0; j < n; ++j) {
      counts[j] = j + 1;
      displs[j] = off;
      off += j + 2;
    }
    std::vector<uint8_t> send(static_cast<size_t>(r + 1));
    for (int k = 0; k <= r; ++k) send[k] = static_cast<uint8_t>(r * 7 + k);
    std::vector<uint8_t> recv(static_cast<size_t>(off), 0xEE);
    THDPACK_RETURN_IF_ERROR(g.AllGatherVValues(std::span<const uint8_t>(send),
                                               std::span<uint8_t>(recv), counts, displs));
    for (int j = 0; j < n; ++j) {
      for (int k = 0; k <= j; ++k) {
        if (recv[displs[j] + k] != static_cast<uint8_t>(j * 7 + k)) {
          return Fail(g, "AllGatherV byte " + std::to_string(k) + " of member " + std::to_string(j));
        }
      }
      if (recv[displs[j] + j + 1] != 0xEE) return Fail(g, "AllGatherV wrote past a block");
    }
  }
  // AllReduce: sum, min, max of int64; sum of doubles.
  {
    const int64_t sum_r = int64_t{n} * (n - 1) / 2;
    std::vector<int64_t> v = {r, -r, int64_t{r} * r};
    THDPACK_RETURN_IF_ERROR(g.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kSum));
    int64_t sum_sq = 0;
    for (int j = 0; j < n; ++j) sum_sq += int64_t{j} * j;
    if (v[0] != sum_r || v[1] != -sum_r || v[2] != sum_sq) return Fail(g, "AllReduce sum");
    v = {r, -r, 7};
    THDPACK_RETURN_IF_ERROR(g.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kMin));
    if (v[0] != 0 || v[1] != -(n - 1) || v[2] != 7) return Fail(g, "AllReduce min");
    v = {r, -r, 7};
    THDPACK_RETURN_IF_ERROR(g.AllReduceInt64(std::span<int64_t>(v), ReduceOp::kMax));
    if (v[0] != n - 1 || v[1] != 0 || v[2] != 7) return Fail(g, "AllReduce max");
    std::vector<double> d = {0.5 * r};
    THDPACK_RETURN_IF_ERROR(g.AllReduceFloat64(std::span<double>(d), ReduceOp::kSum));
    if (d[0] != 0.5 * static_cast<double>(sum_r)) return Fail(g, "AllReduce double sum");
  }
  // AllToAllV: member i sends (i + 2j) % 4 bytes to member j, byte k = i*31 + j*7 + k.
  {
    auto count = [](int i, int j) { return static_cast<int64_t>((i + 2 * j) % 4); };
    std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
    int64_t so = 0, ro = 0;
    for (int j = 0; j < n; ++j) {
      sc[j] = count(r, j);
      sd[j] = so;
      so += sc[j];
      rc[j] = count(j, r);
      rd[j] = ro + 1;  // a gap byte before each block
      ro += rc[j] + 1;
    }
    std::vector<std::byte> send(static_cast<size_t>(so));
    for (int j = 0; j < n; ++j) {
      for (int64_t k = 0; k < sc[j]; ++k) send[sd[j] + k] = std::byte(static_cast<uint8_t>(r * 31 + j * 7 + k));
    }
    std::vector<std::byte> recv(static_cast<size_t>(ro), std::byte{0xEE});
    THDPACK_RETURN_IF_ERROR(g.AllToAllV(send, sc, sd, recv, rc, rd));
    for (int i = 0; i < n; ++i) {
      for (int64_t k = 0; k < rc[i]; ++k) {
        if (recv[rd[i] + k] != std::byte(static_cast<uint8_t>(i * 31 + r * 7 + k))) {
          return Fail(g, "AllToAllV byte " + std::to_string(k) + " from member " + std::to_string(i));
        }
      }
      if (recv[rd[i] - 1] != std::byte{0xEE}) return Fail(g, "AllToAllV wrote into a gap");
    }
  }
  // Send/Recv around a ring, two tags, in both orders of arrival.
  {
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<int32_t> a(static_cast<size_t>(r + 1), r), b(3, 100 + r);
    THDPACK_RETURN_IF_ERROR(g.SendValues(std::span<const int32_t>(a), next, 1));
    THDPACK_RETURN_IF_ERROR(g.SendValues(std::span<const int32_t>(b), next, 2));
    std::vector<int32_t> got_b(3), got_a(static_cast<size_t>(prev + 1));
    THDPACK_RETURN_IF_ERROR(g.RecvValues(std::span<int32_t>(got_b), prev, 2));
    THDPACK_RETURN_IF_ERROR(g.RecvValues(std::span<int32_t>(got_a), prev, 1));
    for (int32_t x : got_a) if (x != prev) return Fail(g, "Recv tag 1 from " + std::to_string(prev));
    for (int32_t x : got_b) if (x != 100 + prev) return Fail(g, "Recv tag 2 from " + std::to_string(prev));
  }
  return g.Barrier();
}

// Everything above on the world, then on groups made by Split (even/odd ranks, a partial list
// that leaves some ranks out), and the bytes_sent rule on a fresh group.
inline Status CheckProcessGroup(ProcessGroup& world) {
  const int n = world.size();
  const int me = world.global_rank();
  THDPACK_RETURN_IF_ERROR(CheckCollectivesOn(world));
  // Even and odd ranks, listed in decreasing order (group order is the list's order).
  std::vector<std::vector<int>> parity(n > 1 ? 2 : 1);
  for (int g = n - 1; g >= 0; --g) parity[static_cast<size_t>(g % 2)].push_back(g);
  THDPACK_ASSIGN_OR_RETURN(auto sub, world.Split(parity));
  if (!sub) return Fail(world, "Split left this rank out of the parity groups");
  const auto& mine = parity[static_cast<size_t>(me % 2)];
  if (sub->size() != static_cast<int>(mine.size()) || sub->global_rank() != me ||
      sub->ranks()[0] != mine[0]) {
    return Fail(world, "Split parity group membership or order");
  }
  THDPACK_RETURN_IF_ERROR(CheckCollectivesOn(*sub));
  std::vector<int64_t> s = {me};
  THDPACK_RETURN_IF_ERROR(sub->AllReduceInt64(std::span<int64_t>(s), ReduceOp::kSum));
  int64_t expect = 0;
  for (int g : mine) expect += g;
  if (s[0] != expect) return Fail(world, "sum of global ranks over the parity group");
  // Only ranks below ceil(n/2) get a group.
  std::vector<std::vector<int>> half(1);
  for (int g = 0; g < (n + 1) / 2; ++g) half[0].push_back(g);
  THDPACK_ASSIGN_OR_RETURN(auto part, world.Split(half));
  if ((me < (n + 1) / 2) != (part != nullptr)) return Fail(world, "partial Split membership");
  if (part) THDPACK_RETURN_IF_ERROR(part->Barrier());
  // bytes_sent on a fresh copy of the world.
  std::vector<std::vector<int>> all(1);
  for (int g = 0; g < n; ++g) all[0].push_back(g);
  THDPACK_ASSIGN_OR_RETURN(auto fresh, world.Split(all));
  if (fresh->bytes_sent() != 0) return Fail(world, "a new group starts with bytes_sent 0");
  std::vector<int64_t> v(4, 1);
  THDPACK_RETURN_IF_ERROR(fresh->BroadcastValues(std::span<int64_t>(v), 0));
  int64_t expect_bytes = me == 0 ? 32 * (n - 1) : 0;
  if (fresh->bytes_sent() != expect_bytes) return Fail(world, "bytes_sent after Broadcast");
  THDPACK_RETURN_IF_ERROR(fresh->AllReduceInt64(std::span<int64_t>(v), ReduceOp::kSum));
  expect_bytes += 32 * (n - 1);
  if (fresh->bytes_sent() != expect_bytes) return Fail(world, "bytes_sent after AllReduce");
  // AllToAllV: 10 bytes to each member, 10 stay here.
  std::vector<std::byte> buf(static_cast<size_t>(10 * n)), out(static_cast<size_t>(10 * n));
  std::vector<int64_t> c(n, 10), d(n);
  for (int j = 0; j < n; ++j) d[j] = 10 * j;
  THDPACK_RETURN_IF_ERROR(fresh->AllToAllV(buf, c, d, out, c, d));
  expect_bytes += 10 * (n - 1);
  if (fresh->bytes_sent() != expect_bytes) return Fail(world, "bytes_sent after AllToAllV");
  return world.Barrier();
}

// AgreeOnStatus: all OK; one rank failing (the last); two failing (the lowest one's message is
// what the others see).
inline Status CheckAgreement(ProcessGroup& world) {
  const int n = world.size();
  const int me = world.global_rank();
  THDPACK_RETURN_IF_ERROR(AgreeOnStatus(world, Status::Ok(), "all well"));
  Status local = me == n - 1 ? Status::OutOfRange("sample 42 over the budget") : Status::Ok();
  Status agreed = AgreeOnStatus(world, local, "phase x");
  if (me == n - 1) {
    if (!(agreed == local)) return Fail(world, "failed rank did not get its own status back");
  } else if (agreed.code() != StatusCode::kAborted ||
             agreed.message() != "rank " + std::to_string(n - 1) +
                                     " (phase x) failed: OutOfRange: sample 42 over the budget") {
    return Fail(world, "peer got: " + agreed.ToString());
  }
  // The failed rank's code travels with the message (the exit code follows from it).
  if (agreed.origin() != StatusCode::kOutOfRange) {
    return Fail(world, "origin lost: " + std::string(StatusCodeName(agreed.origin())));
  }
  // Agreed again (a later phase), the origin stays the first failure's.
  Status again = AgreeOnStatus(world, agreed, "phase y");
  if (again.ok() || again.origin() != StatusCode::kOutOfRange) {
    return Fail(world, "origin lost in a second agreement: " + again.ToString());
  }
  if (n >= 3) {
    local = (me == 1 || me == 2) ? Status::Corruption("bad bytes at " + std::to_string(me))
                                 : Status::Ok();
    agreed = AgreeOnStatus(world, local, "");
    if (me == 1 || me == 2) {
      if (!(agreed == local)) return Fail(world, "failed rank lost its own status");
    } else if (agreed.message() != "rank 1 failed: Corruption: bad bytes at 1" ||
               agreed.origin() != StatusCode::kCorruption) {
      return Fail(world, "peer got: " + agreed.ToString());
    }
  }
  return world.Barrier();
}

}  // namespace thdpack::testing

#endif  // THDPACK_COMM_CHECKS_H_
