"""The torch.distributed backend of the bindings against the process-group checks every backend
passes (thdpack/comm_checks.h, also run on the thread backend and under mpirun): every
collective with uneven sizes, gaps between the receive blocks and groups listed out of rank
order (blocks handed to torch as they are where they follow torch's order, packed into copies
where not), groups of one (no torch call), Split, bytes_sent and the status agreement - in
spawned gloo worlds of 1, 3 and 4 ranks.
"""
import pytest
import torch.distributed as dist

from test_torch_iterator import free_port, join_gloo
from worlds import spawn


def check_world(rank, world, port):
    import thdpack
    join_gloo(rank, world, port, timeout=20)
    try:
        # The checks Split the world into groups listed in decreasing rank order, which torch
        # orders by world rank: blocks through the packed copies there, direct on the world.
        thdpack._thdpack._check_process_group(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 3, 4])
def test_torch_backend_passes_the_process_group_checks(world):
    spawn(check_world, args=(world, free_port()), nprocs=world)
