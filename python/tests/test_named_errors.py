"""What a fuzzer of the Python APIs found accepted where nothing sensible could come out, each
now a named, one-line error (or, where the value has one meaning, taken exactly): a big-endian
field (converted, never reinterpreted), a list value too large for its float dtype, a 2-D
input_ids, a negative pad_id, a field shape given as a string, a fractional position, sums of
bool/int8/complex/meta tensors, RLStatistics values of another shape or named like its own
outputs, a field named like any key of a microbatch (one C++ list, checked against a real
microbatch's keys), a field named by a number, a bfloat16 loss mask (taken: 0/1 exactly), and a
Python error inside a share without its traceback."""
import datetime
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from test_job_agreement import error_of
from worlds import spawn

F = {"f": {"kind": "target", "dtype": "float32"}}


def base(n=4, field=False):
    out = [{"input_ids": np.arange(1, 6 + i)} for i in range(n)]
    if field:
        for x in out:
            x["f"] = np.zeros(len(x["input_ids"]), np.float32)
    return out


def worker(rank, port, out_dir):
    import thdpack._thdpack as _t
    import thdpack.torch as tt
    from test_torch_iterator import make_groups
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    groups = make_groups(1, 1, 1, 1)
    got = {}
    s = base(field=True)
    s[0]["f"] = np.arange(5, dtype=">f4")
    got["big-endian"] = tt.pack_batch(s, groups, fields=F).microbatches[0]["f"][:5].tolist()
    s = base(field=True)
    s[0]["f"] = [1e39] * 5
    got["too large"] = error_of(lambda: tt.pack_batch(s, groups, fields=F))
    s = base()
    s[0]["input_ids"] = np.arange(1, 7).reshape(2, 3)
    got["2-D"] = error_of(lambda: tt.pack_batch(s, groups))
    got["pad_id"] = error_of(lambda: tt.pack_batch(base(), groups, pad_id=-5))
    got["shape"] = error_of(lambda: tt.pack_batch(
        base(), groups, fields={"f": {"kind": "sample", "shape": "12"}}))
    s = base()
    s[0]["position"] = 0.9
    got["position"] = error_of(lambda: tt.pack_batch(s, groups))
    step = tt.pack_batch(base(), groups)
    mb = step.microbatches[0]
    t = mb["tokens"].shape[0]
    got["bool sums"] = error_of(lambda: tt.sequence_sums(torch.ones(t, dtype=torch.bool), mb))
    got["int8 sums"] = error_of(lambda: tt.sequence_sums(torch.ones(t, dtype=torch.int8), mb))
    got["complex"] = error_of(lambda: tt.aggregate_loss(torch.zeros(t, dtype=torch.complex64),
                                                        mb, step))
    got["meta"] = error_of(lambda: tt.aggregate_loss(torch.zeros(t, device="meta"), mb, step))
    got["numpy"] = error_of(lambda: tt.aggregate_loss(np.zeros(t), mb, step))
    got["stats shape"] = error_of(lambda: tt.RLStatistics().add_microbatch(
        mb, ratio=torch.ones(t, 1)))
    got["stats name"] = error_of(lambda: tt.RLStatistics().add_microbatch(
        mb, n_loss_tokens=torch.ones(t)))
    keys = set(_t.microbatch_keys())
    got["keys missing"] = sorted(set(mb) - keys)
    got["field like a key"] = {k: error_of(lambda k=k: tt.pack_batch(
        [dict(x, **{k: 1.0}) for x in base()], groups, fields={k: "sample"}))
        for k in ("idle", "num_seqs", "cu_seqlens_cpu", "packed_seq_params", "media")}
    got["field 7"] = error_of(lambda: tt.pack_batch(base(), groups, fields={7: "sample"}))
    s = base()
    s[0]["loss_mask"] = torch.ones(5, dtype=torch.bfloat16)
    got["bf16 mask"] = error_of(lambda: tt.pack_batch(s, groups))
    torch.save(got, f"{out_dir}/got.pt")
    dist.destroy_process_group()


def test_fuzzer_findings_are_named_errors(tmp_path):
    from test_torch_iterator import free_port
    spawn(worker, args=(free_port(), str(tmp_path)), nprocs=1)
    got = torch.load(f"{tmp_path}/got.pt")
    # Values 0..4 as they are (a target field: position o holds value o + 1, the fill at the end).
    assert got["big-endian"] == [1.0, 2.0, 3.0, 4.0, 0.0]
    expect = {
        "too large": "value 1e+39 does not fit float32 (it would become inf)",
        "2-D": "input_ids has shape (2, 3), expected one sequence [L]",
        "pad_id": "--pad-id: must be >= 0, got -5",
        "shape": "shape '12' is not an int or a tuple of ints",
        "position": "position 0.9 is not an integer stream position",
        "bool sums": "dtype torch.bool, expected a floating dtype or int64",
        "int8 sums": "dtype torch.int8, expected a floating dtype or int64",
        "complex": "dtype torch.complex64, expected a floating dtype",
        "meta": "a meta tensor holds no values",
        "numpy": "expected a torch tensor, got ndarray",
        "stats shape": "ratio has shape (26, 1), expected [T/CP] = (26,)",
        "stats name": "['n_loss_tokens'] would overwrite the summary's own entries",
        "field 7": "a field's name must be a str, got int",
    }
    for case, text in expect.items():
        assert got[case] is not None and text in got[case], (case, got[case])
        assert "\n" not in got[case] and "At:" not in got[case], (case, got[case])
    assert got["keys missing"] == [], got["keys missing"]
    for k, e in got["field like a key"].items():
        assert e is not None and f"'{k}': the name is one of a microbatch's own keys" in e, (k, e)
    assert got["bf16 mask"] is None
