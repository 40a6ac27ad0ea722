"""The ``backend=`` switch every public op takes, and what the ops share for host (NumPy) arrays.

- ``"numpy"``: the op's NumPy reference on host arrays (NumPy, or host DLPack), returning NumPy
  arrays; no GPU, no CuPy needed.
- ``"nvrtc"``: the CUDA kernel; :class:`~rope_rtc.errors.NoDeviceError` without a usable GPU.
  Host arrays are copied to the current device in the order of the launch's stream, computed
  there and copied back (NumPy in, NumPy out: :func:`on_gpu`).
- ``"auto"`` (the one-call functions' default): ``"nvrtc"`` when a GPU is present, else
  ``"numpy"`` with a one-time warning.

Each op validates host arrays with its own checks (those that do not depend on host addresses,
which no kernel reads), so a call is refused the same way on both backends.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import caller_stacklevel

from . import arrays as A
from .layouts import to_bshd_index

BACKENDS = ("auto", "nvrtc", "numpy")

_fallback_warned = False
_gpu_present = False  # once a GPU has been seen, "auto" means it without asking the driver again


def resolve(backend: str) -> str:
    """What ``backend`` means on this machine.

    Parameters
    ----------
    backend : {"auto", "nvrtc", "numpy"}

    Returns
    -------
    str
        ``"nvrtc"`` or ``"numpy"``. ``"auto"`` is ``"numpy"`` where no GPU is usable, with a
        RuntimeWarning once per process, at the caller's line (the first frame outside rope_rtc).

    Raises
    ------
    ValueError
        Any other value.
    rope_rtc.errors.NoDeviceError
        ``"nvrtc"`` with no usable CUDA driver or GPU.
    rope_rtc.errors.ToolchainError
        A GPU, and no importable CuPy.
    """
    global _fallback_warned
    if _gpu_present and (backend == "auto" or backend == "nvrtc"):
        return "nvrtc"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    from . import driver

    if backend == "nvrtc":
        driver.require_gpu()
        _gpu_seen()
        return backend
    if backend == "numpy":
        return backend
    if driver.available():
        _gpu_seen()
        return "nvrtc"
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(f"rope_rtc: backend='auto' runs the NumPy reference on the CPU, since there is no usable GPU: "
                      f"{driver.unavailable_reason()}", RuntimeWarning, stacklevel=caller_stacklevel())
    return "numpy"


def _gpu_seen() -> None:
    from .driver import import_cupy

    import_cupy()  # a missing CuPy is a ToolchainError naming the extra, before "auto" settles on the GPU
    global _gpu_present
    _gpu_present = True


# ---------------------------------------------------------------------------------------------
# the NumPy backend's pieces

def host_array(info: A.ArrayInfo | None) -> np.ndarray | None:
    """The NumPy array of a host argument (a host DLPack object's NumPy view)."""
    return None if info is None else (info.array if isinstance(info.array, np.ndarray) else np.asarray(info.array))


def auto_without_gpu(requested: str, x, name: str = "x") -> None:
    """``"auto"`` settled on NumPy because no GPU is usable; a device array ``x`` then needs the
    GPU, and :class:`rope_rtc.errors.NoDeviceError` says why there is none (rather than "the NumPy
    backend takes host arrays", which the caller never asked for). ``name``: x's argument name, for
    the TypeError of a non-array. A device array is told by its protocol, without CuPy."""
    if requested == "numpy" or isinstance(x, np.ndarray):
        return
    if (type(x).__module__.startswith("cupy") or hasattr(x, "__cuda_array_interface__")
            or A.dlpack_device_type(x) in A.KDL_DEVICE):
        from . import driver

        driver.require_gpu()
    A.describe(x, name)  # anything else: a host array, or the TypeError naming it


def refuse_device(info: A.ArrayInfo) -> None:
    """TypeError for a device array given to ``backend="numpy"`` (validation has refused a mix)."""
    if info.device is not None:
        raise TypeError(f"{info.name}: backend='numpy' takes host (NumPy) arrays; use backend='nvrtc' for device "
                        "arrays")


def token_positions(req) -> np.ndarray:
    """The position of every token of a validated host request (``rope_request.Request``),
    ``[B*S]`` in (batch, sequence) order."""
    B, S = req.cq.B, req.cq.S
    if req.positions is not None:
        return host_array(req.positions).reshape(-1).astype(np.int64)
    s = np.arange(S, dtype=np.int64)
    if req.cu_seqlens is not None:
        cu = host_array(req.cu_seqlens).astype(np.int64)
        t = np.arange(S, dtype=np.int64)
        seq = np.clip(np.searchsorted(cu, t, side="right") - 1, 0, len(cu) - 2)
        base = host_array(req.offsets).astype(np.int64)[seq] if req.offsets is not None else req.offset
        return t - cu[seq] + base
    if req.offsets is not None:
        return (host_array(req.offsets).astype(np.int64)[:, None] + s[None, :]).reshape(-1)
    return np.broadcast_to(req.offset + s, (B, S)).reshape(-1)


def token_heads(arr: np.ndarray, layout: str) -> tuple[np.ndarray, tuple]:
    """``arr`` (in ``layout``) as ``[tokens, H, D]`` in (batch, sequence) token order, and the
    canonical shape :func:`in_layout` takes back."""
    canon = np.transpose(arr, to_bshd_index(layout))
    shape = canon.shape
    return canon.reshape(int(np.prod(shape[:-2])), shape[-2], shape[-1]), shape  # -1 is ambiguous when empty


def in_layout(res: np.ndarray, shape: tuple, layout: str) -> np.ndarray:
    """A ``[tokens, H, D]`` result of :func:`token_heads` back in ``layout``, C-contiguous."""
    return np.ascontiguousarray(np.transpose(res.reshape(shape), np.argsort(to_bshd_index(layout))))


def as_given(returned, given) -> tuple:
    """A host call's outputs as the caller passed them: each given output (or input rotated in
    place) is returned as that very object, not as the NumPy view of its memory that received the
    values (a host DLPack object's); None in ``given``: the result as it is."""
    return tuple(r if g is None else g for r, g in zip(returned, given))


def write_results(results: list[tuple[np.ndarray, A.ArrayInfo | None]]) -> list:
    """Each result into its output (the caller's array, returned) or returned as it is: after
    every result has been computed, so an error leaves every output untouched."""
    returned = []
    for res, out in results:
        if out is None:
            returned.append(res)
        else:
            host_array(out)[...] = res
            returned.append(out.array)
    return returned


# ---------------------------------------------------------------------------------------------
# host arrays on the GPU

def on_gpu(arrays: tuple, written: tuple[int, ...], stream, call) -> list:
    """NumPy in, NumPy out, computed on the current GPU.

    ``arrays`` (validated host arrays, or None) are copied to the device in the order of the
    launch's stream, one copy per view (an output that is its input stays one array, also where
    the two are separate NumPy views of a DLPack object's memory);
    ``call(copies, handle)`` runs the op on them on that stream (a raw handle) and returns device
    arrays; the stream is synchronised. Then each of ``arrays`` at the indices ``written``
    receives its copy's values, and the call's results come back: a copy of one of ``arrays`` as
    that array, a new device array as a new NumPy array. The caller's arrays are written only
    once everything has succeeded.
    """
    import cupy

    from .launcher import cupy_stream, stream_handle

    handle = stream_handle(stream, cupy.cuda.runtime.getDevice())
    copies: dict[tuple, object] = {}
    staged = []
    with cupy_stream(handle):
        for a in arrays:
            if a is None:
                staged.append(None)
                continue
            view = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
            if view not in copies:
                copies[view] = cupy.asarray(a)
            staged.append(copies[view])
    returned = call(staged, handle)
    cupy.cuda.runtime.streamSynchronize(handle)  # the stream the kernel ran on, not the current one
    origin = {id(c): a for a, c in zip(arrays, staged) if a is not None}
    results = [None if d is None else origin[id(d)] if id(d) in origin else cupy.asnumpy(d) for d in returned]
    values = [(arrays[i], cupy.asnumpy(staged[i])) for i in written if arrays[i] is not None]
    for a, v in values:
        a[...] = v
    return results
