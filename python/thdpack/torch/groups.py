"""thdpack.torch.groups: the caller's torch process groups as a thdpack topology.

``Groups`` checks the TP, CP, DP and PP groups a torch job made against the topology their
sizes and rank order define (``thdpack.Topology``: the C++ rule of ranks and groups);
``PackedDataIterator`` and ``pack_batch`` run their step on it.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import _thdpack


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

