"""thdpack.arrow: columnar data as a source - Parquet and Arrow files, Hugging Face datasets and
any Arrow producer (docs/data_sources.md, "Columnar sources").

The C++ reads the rows (thdpack/arrow.h): through the Arrow C stream interface, zero-copy, with
every rule of the columns (``input_ids``, optional ``loss_mask`` or ``labels``) and every sample
read, shuffled and sought there, as from any other source. This module only opens what the C++
cannot: files, with Apache Arrow's own readers (pyarrow), and Python objects.

- ``arrow_source(obj, name=None)``: an Arrow producer (a pyarrow Table or RecordBatchReader, a
  ``datasets.Dataset``, a polars or DuckDB result - anything with ``__arrow_c_stream__``) as the
  source ``arrow:@NAME`` of this process, returned; give it as ``source=`` (or in a blend) on
  every rank that reads.
- ``parquet:PATH`` and ``arrow:PATH`` specs (a file, a folder, or a glob; files in
  lexicographic order) open through ``_open`` when the C++ first meets them in this process
  (``import thdpack`` sets it as the opener): Parquet row group by row group, Arrow IPC files
  and streams memory-mapped (``datasets.Dataset.save_to_disk`` writes streams), a saved
  dataset's folder by its ``data-*.arrow`` files.
"""
from __future__ import annotations

import glob as _glob
import hashlib
import os

from . import _thdpack

_PYARROW_HINT = ("reading Parquet and Arrow files needs pyarrow (pip install pyarrow; any "
                 "version with the Arrow PyCapsule interface, 14 or newer)")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_PYARROW_HINT}: {e}") from None
    if not hasattr(pyarrow.Table, "__arrow_c_stream__"):
        raise ImportError(f"{_PYARROW_HINT}: pyarrow {pyarrow.__version__} has no "
                          f"__arrow_c_stream__")
    return pyarrow


def _files(kind, path):
    """The files of a spec's PATH, sorted: the file itself, a folder's files of the kind (a
    saved dataset's data-*.arrow), or a glob's matches."""
    ext = {"parquet": (".parquet", ".pq"), "arrow": (".arrow", ".feather", ".ipc")}[kind]
    if any(ch in path for ch in "*?["):
        files = sorted(f for f in _glob.glob(path) if os.path.isfile(f))
    elif os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(ext) and os.path.isfile(os.path.join(path, f)))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no such file or folder")
    if not files:
        raise FileNotFoundError(f"{path}: no {' or '.join(ext)} files in it")
    return files


def _wanted(schema, columns):
    """The columns to read: those asked for (the C++'s rules' and the declared fields') that the
    file has; None (all) when input_ids is missing, so that the C++ names the columns."""
    names = schema.names
    if "input_ids" not in names:
        return None
    return [c for c in names if c in columns]


def _select(table, columns):
    want = _wanted(table.schema, columns)
    return table if want is None else table.select(want)


def _open(spec, columns):
    """The rows of a ``parquet:`` or ``arrow:`` spec, with at least ``columns`` (the C++'s
    opener)."""
    pa = _pyarrow()
    kind, path = spec.split(":", 1)
    parts = []
    for f in _files(kind, path):
        if kind == "parquet":
            pf = pa.parquet.ParquetFile(f, memory_map=True)
            cols = _wanted(pf.schema_arrow, columns)
            for g in range(pf.num_row_groups):
                t = pf.read_row_group(g, columns=cols, use_threads=False)
                parts.append(_thdpack._import_arrow(t, f"{f}, row group {g}"))
        else:
            source = pa.memory_map(f)
            try:
                table = pa.ipc.open_file(source).read_all()  # zero-copy: mapped
            except pa.ArrowInvalid:
                table = pa.ipc.open_stream(pa.memory_map(f)).read_all()
            parts.append(_thdpack._import_arrow(_select(table, columns), f))
    return _thdpack._concat_arrow(parts, spec)


def _table_of(obj):
    """A datasets.Dataset's Arrow table (its rows in order, its indices mapping applied);
    anything else as given."""
    try:
        import datasets
    except ImportError:
        return obj
    if isinstance(obj, datasets.Dataset):
        if obj._indices is not None:
            obj = obj.flatten_indices()
        return obj.data.table
    return obj


def arrow_source(obj, name=None):
    """``obj``'s rows as the source ``arrow:@NAME`` of this process (returned). ``obj``: a pyarrow
    Table or RecordBatchReader, a ``datasets.Dataset``, or any object with
    ``__arrow_c_stream__``; its record batches are imported zero-copy (a reader or a stream is
    read to its end, once). ``name``: the source's name on every rank (the job agrees the spec
    over them); default a hash of its rows', tokens' and batches' counts. Columns and errors:
    thdpack/arrow.h. Every column is kept (zero-copy), for declared fields to come from."""
    obj = _table_of(obj)  # any producer works through its capsule, pyarrow or not
    rows = _thdpack._import_arrow(obj, "arrow_source" if name is None else f"arrow:@{name}")
    if name is None:
        name = hashlib.sha1(f"{rows.rows} {rows.tokens} {rows.batches}".encode()).hexdigest()[:12]
    if not isinstance(name, str) or not name or any(c in name for c in ":, \n"):
        raise ValueError(f"name {name!r}: expected a non-empty str without ':', ',' or spaces")
    spec = f"arrow:@{name}"
    _thdpack._register_arrow(spec, rows)
    return spec


__all__ = ["arrow_source"]
