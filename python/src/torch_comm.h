// python/src/torch_comm.h: a ProcessGroup (thdpack/comm.h) whose collectives call
// torch.distributed with the caller's process groups, so that the C++ step runs inside a torch
// job (gloo on CPU tensors, NCCL on CUDA tensors). Defined in bind_torch_comm.cc.
//
// Every collective takes the GIL for its call (the step may run with the GIL released),
// wraps the byte spans as CPU tensors without a copy (torch.from_numpy over the span), copies
// them to the CUDA device and back when the group runs on NCCL, and turns a Python exception
// into kAborted naming the operation and the group. Torch 1.13 lacks a list all_to_all and an
// uneven all_gather on gloo: AllToAllV is all_to_all_single with uneven splits, AllGatherV an
// all_gather of buffers padded to the largest count.
//
// Ranks. "Global" ranks of this interface are positions in the torch group `world` the
// iterator was built on (the topology's ranks); torch_ranks maps them to torch's global ranks
// (those of the default group), which send/recv/broadcast take.
//
// Thread-safety: as every ProcessGroup, one rank's thread; the GIL serialises the calls.
#ifndef THDPACK_PYTHON_TORCH_COMM_H_
#define THDPACK_PYTHON_TORCH_COMM_H_

#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "thdpack/comm.h"

namespace thdpack::python {

// A group the caller already holds: its ranks as positions in the world and the torch object.
struct KnownGroup {
  std::string name;        // "tp", "cp", "dp", "pp", for messages
  std::vector<int> ranks;  // world positions, in group order
  py::object group;        // torch ProcessGroup
};

struct TorchCommOptions {
  // Torch's global rank of each world position ([world size]).
  std::vector<int> torch_ranks;
  // The groups Split may reuse instead of making new ones.
  std::vector<KnownGroup> known;
  // The CUDA device a group on NCCL copies its buffers to (None where there is no CUDA). Each
  // group decides by its own backend: NCCL moves CUDA tensors, every other backend (gloo, and
  // gloo's part of "cpu:gloo,cuda:nccl") CPU tensors, so a gloo world inside an NCCL job (and
  // a caller's NCCL groups beside it) works.
  py::object cuda_device;
  // The world's backend (dist.get_backend(world)): every group Split makes is made with it,
  // not with the default group's.
  std::string backend;
  // Barrier() uses dist.monitored_barrier (gloo only) with this timeout, so that a rank that
  // stopped answering is named; <= 0: plain dist.barrier.
  double monitored_barrier_seconds = 0;
  // A dict of groups Split keeps across worlds (None: none kept): every group Split makes is
  // stored under its lists and the world's backend, never destroyed by thdpack, and a later
  // Split of the same lists (in any world with these options) takes them instead of calling
  // new_group again. For a caller that makes the same step's groups again and again (pack_batch,
  // one step per call); every rank must keep the same dict through the same Splits.
  py::object kept_groups = py::none();
  // The world is part of the default group (language ranks beside encoder ranks of their own,
  // thdpack.torch.encoders) and torch can make a group among its members alone: every group
  // this world makes is made with new_group(use_local_synchronization=True), which the other
  // ranks of the default group need not call (torch >= 2.2).
  bool local_sync = false;
};

// The world: `group` is the torch group whose positions are the topology's ranks (the default
// group unless the caller says otherwise). owned: the group was made for this world, and is
// destroyed with it (as those Split makes). REQUIRES the GIL.
std::unique_ptr<ProcessGroup> MakeTorchWorld(py::object group,
                                             std::shared_ptr<const TorchCommOptions> options,
                                             bool owned = false);

// How a torch world communicates: its ranks (torch_ranks), the caller's known groups (tuples of
// name, ranks, group), the CUDA device of its NCCL groups (None: CPU) and the world's own
// backend. REQUIRES the GIL.
std::shared_ptr<TorchCommOptions> CommOptions(const py::object& world_group,
                                              std::vector<int> torch_ranks, const py::list& known,
                                              py::object device);

// The torch ProcessGroup behind a group of MakeTorchWorld's (or Split from it); None for any
// other ProcessGroup (threads, MPI) or null. REQUIRES the GIL.
py::object TorchGroupOf(const ProcessGroup* group);

// Python objects handed to a torch collective, released by a later ReleaseDue on a Python
// thread once the collective's worker threads have let go of them (bind_torch_comm.cc says
// why). Both need the GIL.
void ReleaseLater(std::vector<py::object> objects);

// On a thread Python did not start (a StepSource's; never a Python thread, whose state Python
// frees itself), called under the GIL: the thread keeps one Python thread state until it ends,
// instead of one made and freed at every acquisition.
void KeepThreadState();
void ReleaseDue();

}  // namespace thdpack::python

#endif  // THDPACK_PYTHON_TORCH_COMM_H_
