"""The element types of fields and of ``step.unpack``'s values as torch and NumPy spell them.

The list is the C++'s (``_thdpack.field_dtypes()``: thdpack/fields.h, names and bytes of an
element); this module only maps each name to torch's dtype and, where NumPy has it (all but
bfloat16), to NumPy's, once at import.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import _thdpack

WIDTHS = dict(_thdpack.field_dtypes())                       # name -> bytes of an element
TORCH = {name: getattr(torch, name) for name in WIDTHS}      # name -> torch.dtype
_NAME_OF_TORCH = {dtype: name for name, dtype in TORCH.items()}


def _numpy_names():
    out = {}
    for name in WIDTHS:
        try:
            out[np.dtype(name)] = name
        except TypeError:  # bfloat16: a tensor of it crosses as its bits
            pass
    return out


NUMPY_NAMES = _numpy_names()  # np.dtype -> name (dtype.name is slow on NumPy 1.24)


def torch_name(dtype):
    """The table's name of a torch dtype; torch's own for one the table lacks (the C++ names
    it in its error)."""
    return _NAME_OF_TORCH.get(dtype) or str(dtype).replace("torch.", "")


def dtype_name(dtype, where):
    """A dtype given as a name, a NumPy or a torch dtype, as a name (the C++ checks it)."""
    if isinstance(dtype, torch.dtype):
        return torch_name(dtype)
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"{where}: dtype {dtype!r} is not a dtype name, a NumPy or a torch "
                        f"dtype") from None
