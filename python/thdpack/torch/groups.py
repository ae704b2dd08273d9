"""thdpack.torch.groups: the caller's torch process groups as a thdpack topology.

``Groups`` checks the TP, CP, DP and PP groups a torch job made against the topology their
sizes and rank order define (``thdpack.Topology``: the C++ rule of ranks and groups);
``PackedDataIterator`` and ``pack_batch`` run their step on it.
"""
from __future__ import annotations

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .. import _thdpack


def local_new_group(ranks, backend):
    """``dist.new_group(ranks, backend=backend, use_local_synchronization=True)`` on a member
    of ``ranks``; on any other rank the group counter torch names groups by is advanced as a
    member's is (torch >= 2.2 returns early there, and the next group's name would differ
    between ranks that made different groups). For a world that is part of the default group
    (language ranks beside encoder ranks of their own: encoders.py), whose ranks all make the
    same groups, in one order; ``sync_group_counter`` brings every rank of the default group
    back in step afterwards."""
    if dist.get_rank() in ranks:
        return dist.new_group(ranks=list(ranks), backend=backend, use_local_synchronization=True)
    c10d.__dict__["_world"].group_count += 1
    return dist.GroupMember.NON_GROUP_MEMBER


def group_counter():
    """torch's count of the groups this process made (what it names the next one by); 0 on a
    torch without local groups (nothing to keep in step there)."""
    world = c10d.__dict__.get("_world")
    return 0 if world is None else world.group_count


def set_group_counter(value):
    world = c10d.__dict__.get("_world")
    if world is not None:
        world.group_count = int(value)


def _group_ranks(group, world_ranks):
    """Positions in the world of the members of a torch group, in group order."""
    position = {r: i for i, r in enumerate(world_ranks)}
    ranks = dist.get_process_group_ranks(group)
    try:
        return [position[r] for r in ranks]
    except KeyError as e:
        raise ValueError(f"Groups: group with ranks {ranks} holds rank {e.args[0]}, "
                         f"which is not in the world {world_ranks}") from None


class Groups:
    """The caller's torch process groups: which ranks form TP, CP, DP and PP.

    ``Groups(tp=..., cp=..., dp=..., pp=..., world=None, order="tp-cp-dp-pp")``: each a torch
    ProcessGroup containing this rank (None: a dimension of size 1). ``world`` (default: the
    default group) holds them all; ``order`` is the rank order of the world, fastest first
    (Megatron's by default; any permutation of tp, cp, dp, pp). The groups are checked against
    the topology they define (``self.topology``, a thdpack.Topology: the C++ rule of ranks and
    groups): each must hold exactly the ranks the order gives this rank (ValueError naming the
    group). The iterator's step runs on the same topology, order included.
    """

    def __init__(self, tp=None, cp=None, dp=None, pp=None, world=None, order="tp-cp-dp-pp"):
        if not dist.is_initialized():
            raise RuntimeError("Groups: torch.distributed is not initialised "
                               "(call dist.init_process_group first)")
        self.world = dist.group.WORLD if world is None else world
        self.tp, self.cp, self.dp, self.pp = tp, cp, dp, pp
        self.order = order
        self.world_ranks = list(dist.get_process_group_ranks(self.world))
        self.rank = dist.get_rank(self.world)
        groups = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        self.sizes = {k: (1 if g is None else dist.get_world_size(g)) for k, g in groups.items()}
        try:
            self.topology = _thdpack.Topology(**self.sizes, order=order)
        except ValueError as e:
            raise ValueError(f"Groups: {e}") from None
        world_size = len(self.world_ranks)
        if self.topology.world_size != world_size:
            raise ValueError(f"Groups: TP*CP*DP*PP = {self.sizes} = {self.topology.world_size} "
                             f"ranks, the world has {world_size}")
        self.order = self.topology.order
        self.coord = self.topology.coord_of(self.rank)
        self.known = []
        for k, g in groups.items():
            if g is None:
                continue
            expected = self.topology.group_of(k, self.rank)
            got = _group_ranks(g, self.world_ranks)
            if got != expected:
                raise ValueError(f"Groups: the {k} group of rank {self.rank} holds world ranks "
                                 f"{got}; order {order} with sizes {self.sizes} puts it at "
                                 f"{expected}")
            self.known.append((k, got, g))

    def __repr__(self):
        return f"Groups({self.sizes}, order={self.order!r}, rank={self.rank}, coord={self.coord})"

