"""The dtypes the kernels take, by name: bfloat16 through ml_dtypes, the rest through NumPy.

Below both ``arrays`` (which checks arrays' dtypes) and ``descriptors`` (which names a declared
array's dtype), so that neither imports the other for a name.
"""

from __future__ import annotations

import numpy as np

try:  # a base dependency; bfloat16 on the host and in CuPy
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BFLOAT16 = None

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of one of the names :func:`dtype_name` gives."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def dtype_name(dtype) -> str:
    """The name the library uses for ``dtype`` (``"bfloat16"``, ``"float32"``, ...)."""
    dt = np.dtype(dtype)
    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bfloat16"
    return dt.name
