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
- ``parquet:PATH`` and ``arrow:PATH`` specs (a file, a folder, or a glob) are opened by the C++
  (which files, their order, the columns, the cache of decoded Parquet: thdpack/arrow.h) with
  the three readers here (``import thdpack`` sets them): a Parquet file's columns, a Parquet
  file decoded row group by row group into an Arrow IPC file, an Arrow IPC file or stream
  memory-mapped (``datasets.Dataset.save_to_disk`` writes streams).
"""
from __future__ import annotations

import hashlib

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


def _parquet_columns(path):
    """The names of the Parquet file's top-level columns (ArrowReaders.parquet_columns)."""
    return _pyarrow().parquet.ParquetFile(path, memory_map=True).schema_arrow.names


def _parquet_to_ipc(path, columns, out):
    """``columns`` of the Parquet file at ``path`` decoded into a new Arrow IPC file ``out``,
    record batch g = row group g (ArrowReaders.parquet_to_ipc); a row group in memory at a
    time."""
    pa = _pyarrow()
    pf = pa.parquet.ParquetFile(path, memory_map=True)
    schema = pa.schema([pf.schema_arrow.field(c) for c in columns])
    with pa.OSFile(out, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for g in range(pf.num_row_groups):
            t = pf.read_row_group(g, columns=list(columns))
            writer.write_batch(pa.RecordBatch.from_arrays(
                [t.column(c).combine_chunks() for c in columns], schema=schema))
            del t
    pa.default_memory_pool().release_unused()


def _read_ipc(path):
    """The record batches of the Arrow IPC file or stream at ``path``, memory-mapped
    (ArrowReaders.read_ipc): every batch as written, an empty one too."""
    pa = _pyarrow()
    try:
        f = pa.ipc.open_file(pa.memory_map(path))
    except pa.ArrowInvalid:  # not a file: a stream (datasets' save_to_disk)
        return pa.ipc.open_stream(pa.memory_map(path))
    return pa.RecordBatchReader.from_batches(
        f.schema, (f.get_batch(i) for i in range(f.num_record_batches)))


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
