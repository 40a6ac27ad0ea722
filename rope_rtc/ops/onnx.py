"""ONNX ``RotaryEmbedding`` (opset 23) on the general kernel, for stacks that export to ONNX and
want the operator's numbers from a GPU kernel.

The operator's inputs map onto :func:`rope_rtc.apply_rope` without copying ``X``:

- 4-D ``X`` ``[batch, num_heads, seq, head_size]`` is the ``bhsd`` layout; 3-D ``X``
  ``[batch, seq, hidden]`` with ``num_heads`` is a ``[batch, seq, num_heads, head_size]`` view
  (``bshd``);
- with ``position_ids`` ``[batch, seq]`` the caches are tables ``[max_position, rotary_dim / 2]``
  indexed by them; without, the caches are already per token, ``[batch, seq, rotary_dim / 2]``
  (or ``[1, seq, rotary_dim / 2]``, shared by the batch, as the reference broadcasts it), and
  are read as a table of ``batch * seq`` (or ``seq``) rows;
- ``interleaved=1`` rotates adjacent pairs, ``0`` the two halves; ``rotary_embedding_dim=0``
  rotates the whole head, otherwise its first ``rotary_embedding_dim`` channels (the rest is
  copied).

The caches and ``position_ids`` live where ``X`` does (host arrays with a host ``X``, arrays of
``X``'s device with a device ``X``): anything else is refused, never copied behind the caller's
back. The caches come in ``X``'s dtype; the kernel reads float32 tables, so float16/bfloat16 caches
are widened to float32 first, on ``X``'s side (exactly: every value is representable). Errors name
the operator's inputs (``X``, ``cos_cache``, ``sin_cache``, ``position_ids``), also those of the
general API's checks, which run for it. Each rotation is then
computed in float32 and rounded once to ``X``'s dtype, where the ONNX reference evaluator
rounds after each multiply and add in ``X``'s dtype: float16 results agree within a few float16
ulps of the rotated value, float32 within a few float32 ulps.
"""

from __future__ import annotations


import numpy as np

from ..core import arrays as A, prepared
from ..core.backends import BACKENDS
from ..errors import UnsupportedLayoutError, rename_arguments


def _int_attr(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int (an ONNX int attribute), got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: must not be negative, got {value}")
    return int(value)


_TYPES_T = ("float32", "float16", "bfloat16")  # the operator's type T that the kernels take


def _check_inputs(X, cos_cache, sin_cache, position_ids, out, batch_seq: tuple[int, int]) -> None:
    """The operator's own rules, named as the operator names its inputs, before the general API
    (which names its arguments x and positions) sees them: ``X`` and both caches of one type T,
    ``X``'s last axis contiguous, ``out`` of ``X``'s type, integer ``position_ids`` of shape
    [batch, seq], and every input where ``X`` is."""
    xi = A.describe(X, "X")
    A.check_dtype(xi, _TYPES_T)
    A.check_last_dim_contiguous(xi)
    for cache, name in ((cos_cache, "cos_cache"), (sin_cache, "sin_cache")):
        ci = A.describe(cache, name)
        if ci.dtype != xi.dtype:
            raise TypeError(f"{name}: dtype {ci.dtype} differs from X's {xi.dtype} (the operator takes X and both "
                            "caches in one type T)")
        _where_X_is(ci, xi)
    if out is not None:
        oi = A.describe(out, "out")
        if oi.dtype != xi.dtype:
            raise TypeError(f"out: dtype {oi.dtype} differs from X's {xi.dtype} (Y keeps X's type)")
        _where_X_is(oi, xi)
    if position_ids is not None:
        pi = A.describe(position_ids, "position_ids")
        A.check_dtype(pi, ("int32", "int64"))
        if pi.shape != batch_seq:
            raise ValueError(f"position_ids: expected shape [batch, seq] = {list(batch_seq)}, got {pi.shape}")
        _where_X_is(pi, xi)


def _where_X_is(info: A.ArrayInfo, xi: A.ArrayInfo) -> None:
    """An input on the host with a device ``X``, on the device with a host ``X``, or on another
    device than ``X``'s is refused rather than moved. The operator runs once per layer and step:
    a host cache moved to the device on every call is a synchronous copy of the whole table, which
    costs more than the rotation, stalls the host, and cannot be captured in a CUDA graph, and it
    would be invisible in the caller's code. The caller moves a cache once (``cupy.asarray``);
    the general API refuses mixed inputs alike."""
    if (info.device is None) != (xi.device is None):
        if xi.device is None:
            raise TypeError(f"{info.name}: X is a host (NumPy) array; pass {info.name} as a host array too")
        raise TypeError(f"{info.name}: X is a device array (device {xi.device}); pass {info.name} on that device too, "
                        f"moved there once (cupy.asarray) rather than on every call")
    if info.device != xi.device:
        raise ValueError(f"{info.name}: on device {info.device}, but X is on device {xi.device}; move it with "
                         f"cupy.asarray under cupy.cuda.Device({xi.device})")


# The general API (rope_rtc.ops.rope_request) runs its own checks for the operator and names the arrays
# as its arguments are named; the operator's caller passed them as these inputs. Its checks stay
# where they are, called rather than copied here, and their messages are renamed on the way out.
_ONNX_NAMES = {"x": "X", "q": "X", "cos": "cos_cache", "sin": "sin_cache", "positions": "position_ids"}


def _in_onnx_names(exc: Exception) -> None:
    """Rename, in place, the general API's argument names in ``exc``'s message to the operator's."""
    rename_arguments(exc, _ONNX_NAMES)


def _empty_like(X, shape: tuple):
    """An empty array of X's dtype and ``shape`` where X is (NumPy, or CuPy on X's device)."""
    info = A.describe(X, "X")
    dtype = A.numpy_dtype(info.dtype)
    if info.device is None:
        return np.empty(shape, dtype)
    cp = _module_of(None)
    with cp.cuda.Device(info.device):
        return cp.empty(shape, dtype)


def _host_view(a, name: str):
    """``a`` as a NumPy view when it is a host array of another library (DLPack on the CPU), else ``a``."""
    if a is None or isinstance(a, np.ndarray) or type(a).__module__.startswith("cupy"):
        return a
    return A.describe(a, name).array if A.dlpack_device_type(a) == A.KDL_CPU else a


def _module_of(x):
    """numpy for host arrays, cupy for device ones (the module that makes their helper arrays)."""
    if isinstance(x, np.ndarray):
        return np
    from ..core.driver import device_cupy

    return device_cupy()


def _as_table(cache, name: str, xp, per_token: tuple[int, int] | None, half: int):
    """``cache`` as a float32 table ``[rows, half]``. ``per_token=(B, S)``: the cache is
    ``[B, S, half]`` (or ``[1, S, half]``, one row per position shared by the batch)."""
    shape = getattr(cache, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected an array, got {type(cache).__name__}")
    if per_token is None:  # a table indexed by position_ids
        if len(shape) != 2 or shape[-1] != half:
            raise ValueError(f"{name}: with position_ids, expected [max_position, {half}] (rotary_embedding_dim / 2 "
                             f"columns), got shape {tuple(shape)}")
        table = cache
    else:
        B, S = per_token
        if tuple(shape) not in ((B, S, half), (1, S, half)):
            raise ValueError(f"{name}: without position_ids, expected [batch, seq, rotary_embedding_dim / 2] = "
                             f"{[B, S, half]} (or [1, {S}, {half}], shared by the batch), got shape {tuple(shape)}")
        table = cache.reshape(shape[0] * S, half)
    if np.dtype(table.dtype) != np.float32:
        table = xp.asarray(table, dtype=np.float32)  # float16/bfloat16 widened exactly
    return table


def rotary_embedding(X, cos_cache, sin_cache, position_ids=None, *, interleaved: int = 0,
                     rotary_embedding_dim: int = 0, num_heads: int = 0, out=None, stream=None,
                     backend: str = "auto"):
    """``Y = RotaryEmbedding(X, cos_cache, sin_cache, position_ids)`` as ONNX opset 23 specifies.

    Parameters
    ----------
    X : array
        ``[batch, num_heads, seq, head_size]``, or ``[batch, seq, hidden]`` with ``num_heads``;
        float32, float16 or bfloat16; NumPy or CuPy, or any array the general API accepts
        (DLPack, on the host or a GPU).
    cos_cache, sin_cache : array
        ``[max_position, rotary_embedding_dim / 2]`` with ``position_ids``, else
        ``[batch, seq, rotary_embedding_dim / 2]``.
    position_ids : int array ``[batch, seq]``, optional
    interleaved, rotary_embedding_dim, num_heads : int
        The operator's attributes (``rotary_embedding_dim=0``: the whole head).
    out : array, optional
        Where to write ``Y`` (``X``'s shape); ``out=X`` rotates in place. Default: a new array.
    stream, backend
        As for :func:`rope_rtc.apply_rope`.

    Returns
    -------
    Y, shaped like ``X``.
    """
    from .rope import apply_rope

    given_out = out
    # Host arrays of other libraries (a torch or JAX CPU tensor) as the NumPy views of their memory,
    # as the general API reads them: the helper arrays below are then made by NumPy, on the host.
    if type(X) is not prepared._NDARRAY:  # (a CuPy X needs none: every input must be where X is)
        X, cos_cache, sin_cache, position_ids, out = (
            _host_view(a, name) for a, name in ((X, "X"), (cos_cache, "cos_cache"), (sin_cache, "sin_cache"),
                                                (position_ids, "position_ids"), (out, "out")))
    interleaved = _int_attr("interleaved", interleaved)
    if interleaved > 1:
        raise ValueError(f"interleaved: 0 or 1, got {interleaved}")
    rd = _int_attr("rotary_embedding_dim", rotary_embedding_dim)
    num_heads = _int_attr("num_heads", num_heads)
    shape = getattr(X, "shape", None)
    if shape is None:
        raise TypeError(f"X: expected an array, got {type(X).__name__}")
    if out is not None and tuple(getattr(out, "shape", ())) != tuple(shape):
        raise ValueError(f"out: expected X's shape {tuple(shape)}, got {tuple(getattr(out, 'shape', ()))}")
    if len(shape) == 4:
        B, H, S, D = (int(d) for d in shape)
        if num_heads and num_heads != H:
            raise ValueError(f"num_heads: {num_heads}, but 4-d X [batch, num_heads, seq, head_size] has {H} heads")
        layout, x, y = "bhsd", X, out
    elif len(shape) == 3:
        if not num_heads:
            raise ValueError("num_heads: a 3-d X [batch, seq, hidden] needs num_heads (the operator's attribute)")
        B, S, hidden = (int(d) for d in shape)
        if hidden % num_heads:
            raise ValueError(f"num_heads: hidden size {hidden} is not a multiple of num_heads={num_heads}")
        H, D = num_heads, hidden // num_heads
        layout = "bshd"
        x = _heads_view(X, (B, S, H, D), "X")
        y = None if out is None else _heads_view(out, (B, S, H, D), "out")
    else:
        raise ValueError(f"X: expected a 4-d [batch, num_heads, seq, head_size] or 3-d [batch, seq, hidden] array, "
                         f"got shape {tuple(shape)}")
    _check_inputs(X, cos_cache, sin_cache, position_ids, out, (B, S))
    if rd == 0 and D % 2:
        raise ValueError(f"X: head_size {D} is odd; rotate an even number of channels (rotary_embedding_dim)")
    rd = rd or D
    if rd % 2 or rd > D:
        raise ValueError(f"rotary_embedding_dim: {rd} must be even and at most head_size {D}")
    xp = _module_of(X)
    with _launch_order(xp, X, stream) as stream:
        # Helper arrays (positions, widened tables) made in the launch stream's order: the memory
        # pool reuses them only after the kernel that reads them.
        if position_ids is None:
            shared = getattr(cos_cache, "shape", (None,))[0] == 1 and B > 1
            positions = (xp.arange(S, dtype=np.int32)[None, :].repeat(B, axis=0) if shared
                         else xp.arange(B * S, dtype=np.int32).reshape(B, S))
            per_token = (B, S)
        else:
            positions, per_token = position_ids, None
        cos = _as_table(cos_cache, "cos_cache", xp, per_token, rd // 2)
        sin = _as_table(sin_cache, "sin_cache", xp, per_token, rd // 2)
        if cos.shape[0] != sin.shape[0]:
            raise ValueError(f"sin_cache: {sin.shape[0]} rows, cos_cache {cos.shape[0]}")
        if D == 0:  # no channels: Y is as empty as X, as the operator's reference gives it
            if not isinstance(backend, str) or backend not in BACKENDS:
                raise ValueError(f"backend: {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
            return given_out if given_out is not None else _empty_like(X, shape)
        try:
            result = apply_rope(x, cos, sin, positions=positions, layout=layout, interleaved=bool(interleaved),
                                rotary_dim=rd, out=y, stream=stream, backend=backend)
        except (TypeError, ValueError) as exc:  # raised before anything is launched or written
            _in_onnx_names(exc)
            raise
    if given_out is not None:
        return given_out
    return result.reshape(shape) if len(shape) == 3 else result


class _launch_order:
    """``with _launch_order(xp, X, stream) as s``: CuPy's work inside runs in the order of the
    stream the kernel will use (``s``: its raw handle); a no-op for host arrays."""

    def __init__(self, xp, X, stream) -> None:
        self.xp, self.X, self.stream = xp, X, stream
        self._ctx = None

    def __enter__(self):
        if self.xp is np:
            return self.stream
        from ..core import arrays as arr
        from ..core.launcher import cupy_stream, stream_handle

        device = arr.describe(self.X, "X").device
        handle = stream_handle(self.stream, device)
        self._ctx = cupy_stream(handle)
        self._ctx.__enter__()
        return handle

    def __exit__(self, *exc) -> bool:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False


def _heads_view(a, shape4: tuple, name: str):
    """``a`` ``[B, S, hidden]`` as a ``[B, S, H, D]`` view of the same memory."""
    before = A.describe(a, name)
    # An empty array has no layout (its strides are all 0); else a layout, as for 4-d X:
    # UnsupportedLayoutError (a ValueError).
    if before.size and before.strides[-1] != 1:
        raise UnsupportedLayoutError(f"{name}: the hidden axis must be contiguous (stride 1), got element strides "
                                     f"{before.strides}")
    v = a.reshape(shape4)
    if A.describe(v, name).ptr != before.ptr:
        raise ValueError(f"{name}: could not view [batch, seq, hidden] as [batch, seq, num_heads, head_size] without a "
                         "copy")
    return v
