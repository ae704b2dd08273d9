"""Columnar sources (thdpack/arrow.h, thdpack.arrow): the same tokens read from Parquet (several
files, several row groups each), an Arrow IPC file, an Arrow IPC stream, a saved Hugging Face
dataset (its folder of stream shards), an in-memory pyarrow Table, datasets.Dataset, polars
frame and DuckDB relation, with
targets as a loss_mask or as Hugging Face labels, give the same steps, byte for byte, as JSONL
and Megatron files of those tokens - at several topologies, shuffled or not, resumed from a
state or run whole - and bad files are named with the file, the row group, the row and the
column. Without pyarrow (Debian's python3) a columnar spec is a named error saying how to get
it.
"""
import json

import numpy as np
import pytest

import thdpack
from thdpack import _thdpack

N = 70
VOCAB = 1000
GLOBAL_BATCH = 8


def samples(seed=11):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(N):
        L = int(rng.integers(1, 40))
        out.append((rng.integers(0, VOCAB, L).tolist(), rng.integers(0, 2, L).tolist()))
    return out


def write_megatron(prefix, docs):
    """Megatron-LM's MMIDIDX v1 files (.bin int32 tokens, .idx), one sequence a document."""
    import struct
    lengths = np.array([len(d) for d in docs], np.int32)
    with open(prefix + ".bin", "wb") as f:
        f.write(np.concatenate([np.array(d, np.int32) for d in docs]).tobytes())
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * 4)[:-1]])
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4))
        f.write(struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes())
        f.write(np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def write_all(tmp, rows, masks=True):
    """Every format of `rows`; returns {name: spec}."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    specs = {}
    jsonl = tmp / "d.jsonl"
    with open(jsonl, "w") as f:
        for ids, mask in rows:
            f.write(json.dumps({"input_ids": ids, **({"loss_mask": mask} if masks else {})})
                    + "\n")
    specs["jsonl"] = f"jsonl:{jsonl}"
    if not masks:  # Megatron's indexed dataset holds no mask
        write_megatron(str(tmp / "meg"), [ids for ids, _ in rows])
        specs["megatron"] = f"megatron:{tmp / 'meg'}"
    cols = {"input_ids": pa.array([ids for ids, _ in rows], pa.list_(pa.int32())),
            "text": pa.array([str(k) for k in range(len(rows))])}  # ignored
    if masks:
        cols["loss_mask"] = pa.array([[bool(v) for v in m] for _, m in rows],
                                     pa.list_(pa.bool_()))
    table = pa.table(cols)
    # Parquet: two files (lexicographic order), row groups of 9 rows.
    (tmp / "pq").mkdir()
    pq.write_table(table.slice(0, 40), tmp / "pq" / "part-0.parquet", row_group_size=9)
    pq.write_table(table.slice(40), tmp / "pq" / "part-1.parquet", row_group_size=9)
    specs["parquet-folder"] = f"parquet:{tmp / 'pq'}"
    specs["parquet-glob"] = f"parquet:{tmp / 'pq'}/part-*.parquet"
    # Arrow IPC: a file (batches of 16) and a stream, int64 large lists this time.
    wide = pa.table({"input_ids": pa.array([ids for ids, _ in rows], pa.large_list(pa.int64())),
                     **({"loss_mask": pa.array([m for _, m in rows], pa.list_(pa.uint8()))}
                        if masks else {})})
    with pa.ipc.new_file(str(tmp / "d.arrow"), wide.schema) as w:
        for b in wide.to_batches(max_chunksize=16):
            w.write_batch(b)
    specs["arrow-file"] = f"arrow:{tmp / 'd.arrow'}"
    with pa.ipc.new_stream(str(tmp / "s.arrow"), wide.schema) as w:
        for b in wide.to_batches(max_chunksize=7):
            w.write_batch(b)
    specs["arrow-stream"] = f"arrow:{tmp / 's.arrow'}"
    if masks:  # the same targets as Hugging Face's labels: -100 where no target
        labels = pa.array([[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in rows],
                          pa.list_(pa.int64()))
        pq.write_table(pa.table({"input_ids": table["input_ids"], "labels": labels}),
                       tmp / "labels.parquet", row_group_size=20)
        specs["parquet-labels"] = f"parquet:{tmp / 'labels.parquet'}"
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        ds = datasets.Dataset(table)
        ds.save_to_disk(str(tmp / "hf"), num_shards=3)
        specs["hf-saved"] = f"arrow:{tmp / 'hf'}"
        specs["hf-memory"] = thdpack.arrow_source(ds, name=f"hf{masks}")
    specs["table-memory"] = thdpack.arrow_source(table, name=f"table{masks}")
    # Producers other than pyarrow, through their own __arrow_c_stream__: a polars frame (large
    # lists, string views) and a DuckDB relation (read once, in order).
    try:
        import polars
        specs["polars"] = thdpack.arrow_source(polars.from_arrow(table), name=f"polars{masks}")
    except ImportError:
        pass
    try:
        import duckdb
        specs["duckdb"] = thdpack.arrow_source(duckdb.from_arrow(table), name=f"duckdb{masks}")
    except ImportError:
        pass
    return specs


TOPOLOGIES = [dict(dp=2), dict(cp=2, dp=2), dict(tp=2, sp=True, pp=2, dp=1),
              dict(dp=2, scheduler="dynamic", cp=2)]


def steps_of(spec, topo, steps=4, state=None, **more):
    opts = dict(dict(global_batch=GLOBAL_BATCH, max_tokens_per_rank=48, cost="llama2-7b"),
                **topo, **more)
    return _thdpack._run_steps_on_threads(opts, steps, spec, None, state)


def same(a, b, where):
    """Every rank's every step and microbatch ([rank][step]): the same arrays."""
    assert len(a) == len(b), where
    for r, (x, y) in enumerate(zip(a, b)):
        assert len(x) == len(y), where
        for s, (p, q) in enumerate(zip(x, y)):
            assert p["step"] == q["step"] and p["epoch"] == q["epoch"], (where, r, s)
            assert len(p["microbatches"]) == len(q["microbatches"]), (where, r, s)
            assert p["microbatches"], (where, r, s)
            for m, (u, v) in enumerate(zip(p["microbatches"], q["microbatches"])):
                for k in u:
                    if isinstance(u[k], np.ndarray):
                        assert np.array_equal(u[k], v[k]), (where, r, s, m, k)


def test_every_format_gives_the_steps_of_jsonl(tmp_path):
    specs = write_all(tmp_path, samples())
    assert {"parquet-folder", "arrow-file", "arrow-stream", "parquet-labels", "table-memory",
            "polars", "duckdb"} <= set(specs)  # the current stack has them all
    for topo in TOPOLOGIES:
        want = steps_of(specs["jsonl"], topo)
        for name, spec in specs.items():
            if name != "jsonl":
                same(steps_of(spec, topo), want, f"{name} at {topo}")


def test_shuffled_and_resumed_columnar_runs_agree(tmp_path):
    specs = write_all(tmp_path, samples(5), masks=False)
    topo = dict(dp=2, cp=2)
    # Shuffled: every columnar format alike (and Megatron's file of the same tokens), epochs
    # crossed (70 samples, 8 a step).
    want = steps_of(specs["parquet-folder"], topo, steps=12, shuffle=True, seed=3)
    for name, spec in specs.items():
        if name != "jsonl":
            same(steps_of(spec, topo, steps=12, shuffle=True, seed=3), want, name)
    # Resumed from the state after step 5 (O(1) seek): the rest of the run, unchanged.
    state = json.loads(want[0][5]["state"])  # [rank][step]
    rest = steps_of(specs["parquet-folder"], topo, steps=6, state=state, shuffle=True, seed=3)
    same(rest, [w[6:] for w in want], "resumed")
    # At another topology the same samples follow (elastic resume): the same sample ids a step.
    other = steps_of(specs["parquet-folder"], dict(dp=4), steps=6, state=state, shuffle=True,
                     seed=3)
    for s in range(6):
        ids = sorted(i for rank in other for mb in rank[s]["microbatches"]
                     if mb["cp_rank"] == 0 for i in mb["sample_ids"])
        want_ids = sorted(i for rank in want for mb in rank[6 + s]["microbatches"]
                          if mb["cp_rank"] == 0 for i in mb["sample_ids"])
        assert ids == want_ids, s
    # A state of one data set is refused by another, by name.
    with pytest.raises(ValueError, match=r'saved with a source of kind "parquet"'):
        steps_of(specs["arrow-stream"], topo, steps=1, state=state, shuffle=True, seed=3)


def test_token_batches_split_samples_and_blends_read_columns_as_files(tmp_path):
    """Steps counted in tokens, long samples split into pieces, and a blend of a Parquet and a
    JSONL source: the columnar source gives what the JSONL file of the same rows gives."""
    specs = write_all(tmp_path, samples(8))
    for more in (dict(global_batch_tokens=400), dict(oversize="split")):
        opts = dict(max_tokens_per_rank=16, **more) if "oversize" in more else more
        want = steps_of(specs["jsonl"], dict(dp=2), steps=3, **opts)
        for name in ("parquet-folder", "arrow-stream", "table-memory"):
            same(steps_of(specs[name], dict(dp=2), steps=3, **opts), want, f"{name} {more}")
    blend = {"sources": [{"data": specs["parquet-glob"], "weight": 0.7},
                         {"data": specs["jsonl"], "weight": 0.3}]}
    other = {"sources": [{"data": specs["jsonl"], "weight": 0.7},
                         {"data": specs["jsonl"], "weight": 0.3}]}
    same(steps_of("blend:" + json.dumps(blend), dict(dp=2), steps=5),
         steps_of("blend:" + json.dumps(other), dict(dp=2), steps=5), "blend")


def test_declared_fields_come_from_their_columns(tmp_path):
    """Fields read from columns (a per-token float32 list, a per-token pair of float64 - a list
    of fixed-size lists -, an int64 and a fixed-size list of two bools a sample) give the steps of the same samples fed with those fields, at DP 2 x CP 2
    and TP 2 x PP 2; a column of another type, or a field no column holds, is named."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from thdpack.torch.fed import _to_sample, field_specs
    rows = samples(4)
    rng = np.random.default_rng(4)
    adv = [rng.standard_normal(len(ids)).astype(np.float32) for ids, _ in rows]
    topk = [rng.standard_normal((len(ids), 2)) for ids, _ in rows]
    uid = np.arange(len(rows), dtype=np.int64) // 2
    pair = [[bool(k % 2), bool(k % 3)] for k in range(len(rows))]
    table = pa.table({
        "input_ids": pa.array([ids for ids, _ in rows], pa.list_(pa.int64())),
        "loss_mask": pa.array([m for _, m in rows], pa.list_(pa.int8())),
        "adv": pa.array([a.tolist() for a in adv], pa.list_(pa.float32())),
        "topk": pa.array([t.tolist() for t in topk], pa.list_(pa.list_(pa.float64(), 2))),
        "uid": pa.array(uid), "pair": pa.array(pair, pa.list_(pa.bool_(), 2)),
        "note": pa.array(["text"] * len(rows))})
    pq.write_table(table.slice(0, 30), tmp_path / "f0.parquet", row_group_size=7)
    pq.write_table(table.slice(30), tmp_path / "f1.parquet", row_group_size=7)
    fields = {"adv": "target", "uid": {"kind": "sample", "dtype": "int64"},
              "topk": {"kind": "target", "dtype": "float64", "shape": (2,)},
              "pair": {"kind": "sample", "dtype": "bool", "shape": (2,)}}
    specs = field_specs(fields)
    # Opened first without fields (its files read for the rules' columns only), then with them:
    # read again with the fields' columns.
    assert len(thdpack.read_lengths(f"parquet:{tmp_path}")["lengths"]) == len(rows)
    items = [{"input_ids": np.array(ids), "loss_mask": np.array(m, np.uint8), "adv": adv[k],
              "topk": topk[k],
              "uid": uid[k], "pair": np.array(pair[k])} for k, (ids, m) in enumerate(rows)]
    steps = 4
    for topo in (dict(dp=2, cp=2), dict(tp=2, pp=2, dp=1)):
        dp = topo["dp"]
        shares = [[_to_sample(items[s * GLOBAL_BATCH + i], "x", specs) for s in range(steps)
                   for i in range(d, GLOBAL_BATCH, dp)] for d in range(dp)]
        opts = dict(global_batch=GLOBAL_BATCH, max_tokens_per_rank=48, cost="llama2-7b", **topo)
        fed = _thdpack._run_steps_on_threads(opts, steps, None, shares, None, specs)
        # Parquet files, the table, and the table as two slices (arrays with offsets).
        sliced = pa.concat_tables([table.slice(0, 21), table.slice(21)])
        for spec in (f"parquet:{tmp_path}", thdpack.arrow_source(table, name="fields"),
                     thdpack.arrow_source(sliced, name="fields-sliced")):
            got = _thdpack._run_steps_on_threads(opts, steps, spec, None, None, specs)
            same(got, fed, f"{spec} {topo}")
            # The fields themselves, not only the arrays same() compares.
            for rank_f, rank_g in zip(fed, got):
                for a, b in zip(rank_f, rank_g):
                    for u, v in zip(a["microbatches"], b["microbatches"]):
                        for name in fields:
                            x, y = u["fields"][name], v["fields"][name]
                            assert (x is None) == (y is None) and (
                                x is None or np.array_equal(x, y)), name
    wrong = dict(fields, adv={"kind": "target", "dtype": "float64"})
    with pytest.raises(ValueError, match=r"field 'adv': the column has Arrow type '\+l<f>', the "
                                         r"field needs a list or large_list of 'g'"):
        _thdpack._run_steps_on_threads(dict(global_batch=8, max_tokens_per_rank=48, dp=1), 1,
                                       f"parquet:{tmp_path}", None, None, field_specs(wrong))
    with pytest.raises(ValueError, match=r"field 'score' has no column of that name"):
        _thdpack._run_steps_on_threads(dict(global_batch=8, max_tokens_per_rank=48, dp=1), 1,
                                       f"parquet:{tmp_path}", None, None,
                                       field_specs({"score": "sample"}))
    with pytest.raises(ValueError, match=r"only a source fed by the caller or a columnar source"):
        specs_j = write_all(tmp_path / "j" if (tmp_path / "j").mkdir() is None else None,
                            samples(1))
        _thdpack._run_steps_on_threads(dict(global_batch=8, max_tokens_per_rank=48, dp=1), 1,
                                       specs_j["jsonl"], None, None, field_specs(fields))


def test_read_lengths_and_the_identity_name_the_rows(tmp_path):
    rows = samples(2)
    specs = write_all(tmp_path, rows)
    got = thdpack.read_lengths(specs["parquet-glob"])
    assert got["lengths"].tolist() == [len(ids) for ids, _ in rows]
    assert got["n_targets"].tolist() == [sum(m[1:]) for _, m in rows]


def test_bad_files_are_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"tokens": pa.array([[1, 2]])}), tmp_path / "no_ids.parquet")
    with pytest.raises(ValueError, match=r"no_ids.parquet: no column 'input_ids' "
                                         r"\(the columns: 'tokens'\)"):
        thdpack.read_lengths(f"parquet:{tmp_path / 'no_ids.parquet'}")
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], None, [3]])}),
                   tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null.parquet, row group 0, row 1: "
                                         r"column 'input_ids' is null"):
        thdpack.read_lengths(f"parquet:{tmp_path / 'null.parquet'}")
    pq.write_table(pa.table({"input_ids": pa.array([[1.5, 2.0]])}), tmp_path / "float.parquet")
    with pytest.raises(ValueError, match=r"float.parquet: column 'input_ids' "
                       r"holds values of Arrow type 'g' \(float64\); expected an integer type"):
        thdpack.read_lengths(f"parquet:{tmp_path / 'float.parquet'}")
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3, 4, 5]]),
                             "loss_mask": pa.array([[0, 1], [1, 1]])}),
                   tmp_path / "short_mask.parquet")
    with pytest.raises(ValueError, match=r"row 1: column 'loss_mask' has 2 values, input_ids 3"):
        thdpack.read_lengths(f"parquet:{tmp_path / 'short_mask.parquet'}")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "null.parquet").read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"data source parquet:.*cut.parquet: ArrowInvalid"):
        thdpack.read_lengths(f"parquet:{tmp_path / 'cut.parquet'}")
    with pytest.raises(ValueError, match=r"no such file or folder"):
        thdpack.read_lengths(f"parquet:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match=r"arrow:@nobody: no Arrow data of that name"):
        thdpack.read_lengths("arrow:@nobody")
    with pytest.raises(TypeError, match=r"expected an Arrow producer"):
        thdpack.arrow_source([1, 2, 3])


def test_without_pyarrow_a_columnar_spec_says_how_to_get_it(tmp_path):
    try:
        import pyarrow  # noqa: F401
        pytest.skip("pyarrow is installed: the other tests read the files")
    except ImportError:
        pass
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"needs pyarrow \(pip install pyarrow"):
        thdpack.read_lengths(f"parquet:{tmp_path / 'x.parquet'}")


def _lengths_in_a_process(spec, env, pre=""):
    """read_lengths of `spec` in a fresh interpreter (the registry of this one keeps the rows of
    every spec it opened); `pre` runs first. Returns (returncode, lengths or stderr)."""
    import subprocess
    import sys
    code = (f"import thdpack, json\n{pre}\n"
            f"print(json.dumps(thdpack.read_lengths({spec!r})['lengths'].tolist()))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    return p.returncode, (json.loads(p.stdout) if p.returncode == 0 else p.stderr)


def test_parquet_is_decoded_once_into_the_cache_and_again_when_it_changes(tmp_path):
    import os
    import subprocess
    import sys
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    env = dict(os.environ, THDPACK_CACHE=str(tmp_path / "cache"))
    rows = samples(seed=3)
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": [ids for ids, _ in rows],
                             "attention_mask": [[1] * len(ids) for ids, _ in rows]}), f,
                   row_group_size=16)
    spec = f"parquet:{f}"
    # Four processes at once: one decodes, the others wait for it and map what it wrote.
    code = (f"import thdpack, json; "
            f"print(json.dumps(thdpack.read_lengths({spec!r})['lengths'].tolist()))")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and json.loads(out) == [len(ids) for ids, _ in rows]
    cache = tmp_path / "cache" / "parquet"
    arrows = sorted(cache.glob("*.arrow"))
    assert [a.name.split("-")[0] for a in arrows] == ["d"], os.listdir(cache)
    assert not list(cache.glob("*.tmp"))
    # The cache file holds the columns read (not attention_mask), a row group a record batch.
    with pa.ipc.open_file(pa.memory_map(str(arrows[0]))) as r:
        assert r.schema.names == ["input_ids"] and r.num_record_batches == 5
    before = arrows[0].stat()
    assert _lengths_in_a_process(spec, env)[1] == [len(ids) for ids, _ in rows]
    after = arrows[0].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # The file changed: decoded again, its new rows read.
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4]]}), f)
    assert _lengths_in_a_process(spec, env)[1] == [3, 1]
    assert len(list(cache.glob("*.arrow"))) == 2


def test_a_killed_decode_leaves_no_cache_file_and_the_next_open_decodes_whole(tmp_path):
    import os
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    env = dict(os.environ, THDPACK_CACHE=str(tmp_path / "cache"))
    rows = samples(seed=5)
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": [ids for ids, _ in rows]}), f, row_group_size=8)
    # A decode killed (SIGKILL) after writing part of its file.
    killed = """
import os, signal
from thdpack import _thdpack, arrow
def half(path, columns, out):
    arrow._parquet_to_ipc(path, columns, out)
    size = os.path.getsize(out)
    os.truncate(out, size // 2)
    os.kill(os.getpid(), signal.SIGKILL)
_thdpack._set_arrow_readers(arrow._parquet_columns, half, arrow._read_ipc)
"""
    rc, _ = _lengths_in_a_process(f"parquet:{f}", env, pre=killed)
    assert rc == -9
    cache = tmp_path / "cache" / "parquet"
    assert not list(cache.glob("*.arrow")) and len(list(cache.glob("*.tmp"))) == 1
    rc, got = _lengths_in_a_process(f"parquet:{f}", env)
    assert rc == 0 and got == [len(ids) for ids, _ in rows]
    assert len(list(cache.glob("*.arrow"))) == 1 and not list(cache.glob("*.tmp"))


def test_an_unwritable_cache_is_named(tmp_path):
    import os
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), f)
    (tmp_path / "file").write_text("")
    env = dict(os.environ, THDPACK_CACHE=str(tmp_path / "file" / "sub"))
    rc, err = _lengths_in_a_process(f"parquet:{f}", env)
    assert rc != 0 and "cannot create it" in err and "set THDPACK_CACHE" in err, err
