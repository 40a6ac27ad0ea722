"""Prepared BF16 tail RoPE (the contract in docs/design.md, "Numerical contracts"), for CuPy, on every
architecture NVRTC supports (sm_80 and newer).

``x`` is contiguous BF16 ``[T, D]`` or ``[T, H, D]`` with D in {128, 512}; ``cosine`` and ``sine``
are contiguous FP32 ``[T, 32]``. The last 64 channels of each head are rotated in adjacent pairs
with a fixed FP32 multiply/FMA order (bit-exact); the prefix is copied unchanged.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from ..build.registry import TAIL_DIMS, tail_spec
from ..core import arrays as A, prepared
from ..core import driver
from ..core.driver import current_device
from ..core import launcher, outputs
from ..core.backends import BACKENDS, on_gpu, resolve
from ..core.descriptors import TensorDesc, TupleDict
from ..core.codegen import array_checks, arrays_title, generated
from ..core.launcher import ArgPack, launch_prefix, load_kernel, stream_handle
from ..core.dispatch import OneCall
from ..core.prepared import Call, Op, Prepared, cupy_ndarray, made_once, pointers
from ..core.recent import RECENT_SETS  # noqa: F401 - part of this module's interface
from ..numerics.reference import TAIL_TABLE_COLUMNS as TABLE_COLUMNS
from .rope_request import check_kinds

VECTOR_ELEMS = 8              # BF16 elements per 16-byte access
# Threads per block (cuda_src/tail_rope.cu: __launch_bounds__(256)), for every shape: for launches
# of 1 and 4 tokens, blocks of 128, 64 or 32 threads measured no faster, hot or cold.
BLOCK = 256
GRID_LIMIT = 2**31 - 1        # gridDim.x limit


def check_backend(backend) -> None:
    """ValueError for a backend this implementation does not have; the contract's own example names
    "frost" (cuDNN's CuTe DSL kernels), whose place "nvrtc" takes here."""
    if isinstance(backend, str) and backend in BACKENDS:
        return
    hint = "; the contract's 'frost' kernels are rope_rtc's 'nvrtc'" if backend == "frost" else ""
    raise ValueError(f"backend: {backend!r} is not supported; use one of {', '.join(map(repr, BACKENDS))}{hint}")


# The kernel's argument block (cuda_src/tail_rope.cu: tail_rope_bf16_x1).
ARG_FIELDS = [("x", ctypes.c_uint64), ("out", ctypes.c_uint64), ("cos", ctypes.c_uint64),
              ("sin", ctypes.c_uint64), ("n", ctypes.c_int64)]
NAMES = ("x", "cosine", "sine", "out")
_ARGS = struct.Struct("<4Qq")  # ARG_FIELDS packed in one write (the one-call path's host time)
assert _ARGS.size == sum(ctypes.sizeof(t) for _, t in ARG_FIELDS)  # five 8-byte fields, no padding


def load_tail_function(heads: int, dim: int, device: int):
    """The tail kernel specialised on ``heads`` and ``dim``, loaded on ``device``."""
    return load_kernel(tail_spec(heads, dim), device).functions["tail_rope_bf16_x1"]


class TailRoPEForward:
    """A prepared tail-RoPE plan: validate once, then ``execute`` validates cheaply and launches.

    Parameters
    ----------
    x, cosine, sine, out : array or TensorDesc
        Arrays or declarations fixing H, D, rank and the device. ``T`` may change between executes
        (including 0); H, D and the device may not.
    backend : {"nvrtc", "numpy", "auto"}
        ``"nvrtc"``: the CUDA kernel (CuPy/device arrays). ``"numpy"``: the bit-exact NumPy reference
        on host arrays (``ml_dtypes.bfloat16`` and float32), no GPU needed. ``"auto"``: ``"nvrtc"``
        when a GPU is present, else ``"numpy"`` (with a one-time warning), settled by
        ``check_support``.

    ``execute`` allocates no device memory, converts nothing and never synchronises; the caller
    owns array lifetimes and inter-stream ordering. The plan remembers the last 16 argument sets
    of CuPy arrays it saw, so repeating one skips re-validation (it holds references to those
    arrays; other libraries' arrays, which can move their memory under the same object, are
    validated on every call); new arrays of a shape, stride and dtype signature seen before get
    the cheaper address-only checks. From its second launch, a remembered set is launched as a one-node CUDA graph
    instantiated once for it, which costs the host less than ``cuLaunchKernel`` (never into a
    stream that is being captured; ``ROPE_RTC_NO_GRAPH_REPLAY=1`` turns it off). A plan holds
    one argument block: give each thread its own plan.

    A layout the kernel does not serve (any non-contiguous array) raises
    :class:`~rope_rtc.errors.UnsupportedLayoutError`, a ``NotImplementedError`` (and a
    ``ValueError``), at ``check_support`` and at ``execute`` alike.
    """

    _check_positions = False  # the contract's tables are per token: there are no positions to check

    def __init__(self, x, cosine, sine, out, *, backend: str = "nvrtc") -> None:
        self.backend = backend
        self._decl = (x, cosine, sine, out)
        self._supported = False
        self._function = None
        self._core: Prepared | None = None
        self.heads = self.dim = self.rank = self.device = None

    # -- plan lifecycle ------------------------------------------------------------------------
    def check_support(self) -> "TailRoPEForward":
        """Validate the declared arrays; raises TypeError/ValueError/NotImplementedError."""
        check_backend(self.backend)
        if self.backend == "auto":
            self.backend = resolve("auto")
        return self._support(self._describe(self._decl, declarations=True))

    @classmethod
    def _from_infos(cls, infos: list) -> "TailRoPEForward":
        """The plan of a call ``tail_rope`` has described (``infos``), holding none of its arrays:
        its first call is then described once (``_TailOp.validate`` takes the infos)."""
        plan = cls(None, None, None, None)._support(infos)
        plan._decl = None  # a thread's plan must not keep the caller's arrays alive
        return plan

    def _support(self, infos: list) -> "TailRoPEForward":
        """What the plan fixes, from its arguments' infos (check_support's checks)."""
        x, c, s, o = infos
        if len(x.shape) not in (2, 3):
            raise ValueError(f"x: expected [T, D] or [T, H, D], got shape {x.shape}")
        D = x.shape[-1]
        H = x.shape[1] if len(x.shape) == 3 else 1
        if D not in TAIL_DIMS:
            raise ValueError(f"x: channel count D={D} is not supported; expected one of {TAIL_DIMS}")
        if H <= 0:
            raise ValueError(f"x: head count H must be positive, got {H}")
        if H * D >= 2**31:
            raise ValueError(f"x: H*D = {H * D} must be below 2**31")
        for info in infos:
            _check_contiguous(info)
        self.heads, self.dim, self.rank = H, D, len(x.shape)
        self._check_shapes(x, c, s, o)
        if self.backend == "nvrtc":
            self.device = A.check_same_device(infos)
            if self.device is None:
                self.device = current_device()
        self._supported = True
        return self

    def compile(self) -> "TailRoPEForward":
        """Load (compiling on a cache miss) the kernel for this plan's H, D and device."""
        if not self._supported:
            self.check_support()
        if self.backend == "nvrtc" and self._core is None:
            self._function = load_tail_function(self.heads, self.dim, self.device)
            self._core = Prepared(_TailOp(self), ArgPack(ARG_FIELDS), self.device)
        return self

    def scratch_workspace_bytes(self) -> int:
        """The plan needs no workspace."""
        return 0

    # -- execution -----------------------------------------------------------------------------
    def execute(self, x, cosine, sine, out, *, current_stream=None) -> TupleDict:
        """Rotate ``x``'s tail into ``out``. Returns ``TupleDict(out=out)``."""
        core = self._core
        if core is None:
            if self.backend != "numpy":
                self.compile()  # "auto" resolves here, to "numpy" where no GPU is usable
            if self.backend == "numpy":
                return self._execute_numpy(x, cosine, sine, out)
            core = self._core
        return core.execute((x, cosine, sine, out), 0, current_stream)

    def _execute_numpy(self, x, cosine, sine, out) -> TupleDict:
        from ..numerics.reference import tail_rope_reference

        if not self._supported:
            self.check_support()
        infos = self._describe((x, cosine, sine, out), declarations=False)
        _TailOp(self).validate((x, cosine, sine, out), 0, infos)
        if infos[0].size:  # the validated arrays: a host DLPack object's NumPy view, not the object
            out[...] = tail_rope_reference(*(i.array for i in infos[:3]))
        return TupleDict(out=out)

    def _describe(self, arrays, *, declarations: bool) -> list[A.ArrayInfo]:
        """Each argument's info, of the right kind (host for NumPy, device for the kernel) and dtype."""
        host_ok = self.backend == "numpy"
        infos = [A.describe(v, n, allow_host=host_ok) for v, n in zip(arrays, NAMES)]
        for info in infos:
            if isinstance(info.array, TensorDesc) and not declarations:
                raise TypeError(f"{info.name}: execute() needs arrays, not declarations")
            if not host_ok and info.device is None:
                raise TypeError(f"{info.name}: a host array cannot be used with backend='nvrtc'; pass a CuPy "
                                "array or use backend='numpy'")
            # A declaration always names a device; under the NumPy backend its dtype and shape are what count.
            if host_ok and info.device is not None and not isinstance(info.array, TensorDesc):
                raise TypeError(f"{info.name}: backend='numpy' takes host arrays (NumPy, ml_dtypes.bfloat16 and "
                                "float32)")
        x, c, s, o = infos
        A.check_dtype(x, ("bfloat16",), " (tail RoPE is BF16)")
        A.check_dtype(o, ("bfloat16",), " (tail RoPE is BF16)")
        A.check_dtype(c, ("float32",))
        A.check_dtype(s, ("float32",))
        return infos

    def _check_shapes(self, x, c, s, o) -> None:
        self._check_x(x)
        self._check_others(x, c, s, o)

    def _check_x(self, x) -> None:
        """x against the plan (check_support checks x's own shape first too)."""
        if len(x.shape) != self.rank:  # first: the checks below index x.shape by the plan's rank
            raise ValueError(f"x: rank {len(x.shape)} differs from the plan's {self.rank}; reshape x to the "
                             "plan's rank, or make a plan for this one")
        if self.rank == 3 and (x.shape[1], x.shape[2]) != (self.heads, self.dim) or x.shape[-1] != self.dim:
            raise ValueError(f"x: shape {x.shape} does not match the plan's H={self.heads}, D={self.dim}; make a "
                             "plan for this head count and head dim")

    def _check_others(self, x, c, s, o) -> None:
        """The output's and the tables' shapes against x's."""
        T = x.shape[0]
        if o.shape != x.shape:
            raise ValueError(f"out: shape {o.shape} differs from x's {x.shape}")
        for t in (c, s):
            if t.shape != (T, TABLE_COLUMNS):
                raise ValueError(f"{t.name}: expected shape ({T}, {TABLE_COLUMNS}), got {t.shape}")


def _check_contiguous(info: A.ArrayInfo) -> None:
    A.check_contiguous(info, "non-contiguous layouts are not supported (the plan rejects rather than copies)")


class _TailOp(Op):
    """What a TailRoPEForward fixes (H, D, rank, device) and checks on every new call."""

    # A remembered set is launched again only while none of its arrays was reshaped in place (the
    # contract fixes the tables' and the output's shapes as well as x's).
    watched = (0, 1, 2, 3)

    def __init__(self, plan: TailRoPEForward) -> None:
        self.plan = plan

    def quick_path(self, template, arrays: tuple):
        """The plan's path for new arrays of the signature ``template`` was bound for: the repeat
        path ``tail_rope`` generates, with the output checked like the inputs (it is the caller's
        here, not a fresh allocation): new arrays, or new views each call, take those checks and
        the block write instead of a bind and a launcher token never seen before. None where the
        template launches nothing or CuPy does not expose its contiguity flag."""
        if type(template) is not _TailTemplate or template.prefix is None or \
                not hasattr(cupy_ndarray(), "_c_contiguous"):
            return None
        key = tuple([(a.shape, None, a.dtype, a.data.device_id) for a in arrays])
        return template.one_call(key, self.plan._core), _result

    takes_request = True  # tail_rope's first call hands over the infos it described

    def validate(self, arrays: tuple, scalar: int, request: list | None = None) -> "_TailTemplate":
        plan = self.plan
        infos = plan._describe(arrays, declarations=False) if request is None else request
        xi, ci, si, oi = infos
        # In check_support's order (x's shape, then every array's layout, then the other shapes), so
        # that one problem raises one exception type on the first call and on later ones.
        plan._check_x(xi)
        for info in infos:
            _check_contiguous(info)
        plan._check_others(xi, ci, si, oi)
        for info in infos:
            A.check_aligned(info)
        if plan.backend == "nvrtc":
            A.check_same_device(infos, plan.device)
        for inp in (xi, ci, si):
            if A.overlaps(oi, inp):
                raise ValueError(f"out overlaps {inp.name}: the output must be disjoint from every input")
        A.check_writable(oi)
        return _TailTemplate(plan, infos)


class _TailTemplate:
    """A validated signature: the launch (grid from T) and the address checks that remain."""

    def __init__(self, plan: TailRoPEForward, infos: list[A.ArrayInfo]) -> None:
        self.validated_pointers = tuple(i.ptr for i in infos)
        self.nbytes = tuple(i.size * i.itemsize for i in infos)
        self.n_vec = infos[0].size // VECTOR_ELEMS
        self.prefix = None
        self._one_calls: dict = {}  # tail_rope's signature -> its generated repeat path (one_call)
        if self.n_vec and plan.backend == "nvrtc":
            grid = -(-self.n_vec // BLOCK)  # one 16-byte vector per thread
            if grid > GRID_LIMIT:
                raise ValueError(f"x: {infos[0].size} elements need {grid} blocks, above the CUDA grid limit {GRID_LIMIT}")
            self.prefix = launch_prefix(plan._function, (grid, 1, 1), (BLOCK, 1, 1))

    pointers = staticmethod(pointers)

    def check_scalar(self, scalar: int) -> None:
        """The tail kernel takes no scalar."""

    def write_scalar(self, block, scalar: int, call=None) -> None:
        """The tail kernel takes no scalar."""

    def write(self, core: Prepared, ptrs: tuple) -> bool:
        """The address checks (alignment; the output disjoint from every input), then the block;
        False sends the call through full validation."""
        x, c, s, o = ptrs
        nx, nc, ns, no = self.nbytes
        if nx and (x | o) % A.ALIGN_BYTES or nc and (c | s) % A.ALIGN_BYTES:
            return False
        if no:
            for p, n in ((x, nx), (c, nc), (s, ns)):
                if n and p < o + no and o < p + n:
                    return False
        _ARGS.pack_into(core.block_bytes, 0, x, o, c, s, self.n_vec)
        return True

    def bind(self, core: Prepared, arrays: tuple, scalar: int, ptrs: tuple) -> Call | None:
        if not self.write(core, ptrs):
            return None
        return Call(arrays, 0, self, self.prefix, TupleDict(out=arrays[3]))

    def one_call(self, key: tuple, core: Prepared):
        """``tail_rope``'s repeat path for inputs of signature ``key`` (its ``(shape, strides,
        dtype, device)`` of x, cosine and sine), generated once: ``fn(x, cosine, sine, out)``
        checks that the inputs are of the signature, the alignment and that the output (the
        function's own allocation, of x's shape) is disjoint from every input, writes the block
        and returns the launch prefix; None sends the call to the dictionary and full
        validation. None when the template launches nothing.

        A ``key`` of four entries (the output's too: ``_TailOp.quick_path``) gives the plan's
        path for new arrays, ``fn(x, cosine, sine, out, scalar)``, which checks the output's
        signature as well."""
        return made_once(self._one_calls, key,
                         lambda key: self._one_call_function(key, core) if self.prefix is not None else None)

    def _one_call_function(self, key: tuple, core: Prepared):
        names = ("x", "cosine", "sine", "out")[:len(key)]
        several = not launcher.single_device()
        namespace: dict = {"nd": cupy_ndarray(), "pack": _ARGS.pack_into, "block": core.block_bytes,
                           "prefix": self.prefix}
        conds, reads = [], []
        for i, (name, (shape, _, dtype, device)) in enumerate(zip(names, key)):
            # Validated contiguous (the contract): C-contiguous arrays of the shape are the signature's.
            ref = "po" if name == "out" else f"p{i}"
            cond, read = array_checks(name, ref, (shape, None, dtype, device), several, namespace)
            conds.append(cond)
            reads.append(read)
        nx, nc, ns, no = self.nbytes
        align = A.ALIGN_BYTES - 1
        terms = [f"not (p0 | po) & {align}"] if nx else []
        if nc:
            terms.append(f"not (p1 | p2) & {align}")
        if no:
            terms += [f"(p{i} >= po + {no} or po >= p{i} + {n})" for i, n in enumerate((nx, nc, ns)) if n]
        body = (f"    if not ({' and '.join(conds)}):\n"
                "        return None\n" + "".join(reads) +
                ("    po = out.data.ptr\n" if len(key) == 3 else "") +
                f"    if not ({' and '.join(terms) or 'True'}):\n"
                "        return None\n"
                f"    pack(block, 0, p0, po, p1, p2, {int(self.n_vec)})\n"
                "    return prefix\n")
        owner = "TailRoPEForward" if len(key) == 4 else "tail_rope"
        return generated("repeat_path", "x, cosine, sine, out" + (", scalar" if len(key) == 4 else ""), body, namespace,
                         title=f"{owner} repeat path ({arrays_title(names, key)})", qualname=f"{owner}.repeat_path")


def _result(arrays: tuple) -> TupleDict:
    """What a plan's call of ``arrays`` returns."""
    return TupleDict.of_out(arrays[3])




def _validate(arrays: tuple, scalar: int, options: tuple) -> tuple[list, tuple]:
    """The call's infos (each array described once) and its plan's key: H, D, rank and device
    (``OneCall``'s ``validate``; the plan's checks run on the infos)."""
    infos = TailRoPEForward(None, None, None, None)._describe(arrays, declarations=False)
    out = arrays[3]  # tail_rope's own allocation, of x's shape
    return infos, (out.shape[1:], out.data.device_id)


def _new_plan(infos: list, arrays: tuple, scalar: int, options: tuple, device: int) -> "TailRoPEForward":
    return TailRoPEForward._from_infos(infos).compile()


def _signature(arrays: tuple) -> tuple:
    """The inputs' ``(shape, strides, dtype, device)`` (None unless all are CuPy arrays): the output
    is always tail_rope's own C-contiguous allocation of x's shape and dtype, so they fix the
    template."""
    x, cosine, sine, _ = arrays
    nd = cupy_ndarray()
    if type(x) is not nd or type(cosine) is not nd or type(sine) is not nd:
        return None, None
    return tuple([(a.shape, a.strides, a.dtype, a.data.device_id) for a in (x, cosine, sine)]), None


def _repeat_path(plan: "TailRoPEForward", call, arrays: tuple, sig):
    return call.template.one_call(sig, plan._core)


# tail_rope's dispatch (no options: the contract has none).
ONE_CALL = OneCall(_validate, _new_plan, takes_request=True, signature_of=_signature, repeat_path=_repeat_path)
_gpu_present = False  # once a call has resolved the GPU backend: "auto" then means it


def _gpu_seen() -> None:
    global _gpu_present
    _gpu_present = True


def tail_rope(x, cosine, sine, *, backend: str = "auto", stream=None) -> TupleDict:
    """Allocate a disjoint output and run a cached plan. Returns ``TupleDict(out=out)``.

    With ``stream``, the allocation and the launch are ordered on it. Plans are cached per
    thread by (H, D, rank, device) and the arrays' signature, so prewarm the shapes you will
    use before capturing a CUDA graph. The call keeps no reference to its arrays.

    ``backend``: ``"nvrtc"`` the CUDA kernel, ``"numpy"`` the bit-exact reference
    (:func:`rope_rtc.reference.tail_rope_reference`) on host arrays, ``"auto"`` the GPU when one
    is present, else NumPy (with a one-time warning), as :func:`rope_rtc.apply_rope` takes it. Host
    (NumPy) arrays on the GPU are copied there and back: the output is then a NumPy array.
    """
    if backend != "auto" and backend != "nvrtc":
        return _tail_host(x, cosine, sine, backend, stream)
    nd = prepared._NDARRAY  # cupy.ndarray once imported; CuPy is imported only for a CuPy x
    if type(x) is nd or nd is None and type(x).__module__.startswith("cupy") and type(x) is cupy_ndarray():
        device, shape, dtype = x.data.device_id, x.shape, x.dtype
    elif isinstance(x, np.ndarray):
        return _tail_host(x, cosine, sine, backend, stream)
    else:
        # Described before CuPy is imported: a non-array is the TypeError naming x, and a host
        # array takes the host path, on an install without CuPy too.
        xi = A.describe(x, "x")
        if xi.device is None:  # a host array known through DLPack
            return _tail_host(x, cosine, sine, backend, stream)
        device, shape, dtype = xi.device, xi.shape, A.numpy_dtype(xi.dtype)
    if not _gpu_present:  # no GPU backend resolved yet
        if resolve(backend) == "numpy":
            if backend != "numpy":  # "auto" with device arrays and no usable GPU: say that
                driver.require_gpu()
            return _tail_host(x, cosine, sine, "numpy", stream)
        _gpu_seen()
    handle = stream_handle(stream, device)
    out = outputs.allocate(shape, dtype, device, handle, stream is None)
    if not ONE_CALL.launched_on((), handle, x, cosine, sine, out):
        ONE_CALL.run((), True, (x, cosine, sine, out), 0, handle, device)
    return TupleDict.of_out(out)


def _tail_host(x, cosine, sine, backend, stream) -> TupleDict:
    """``tail_rope`` of host arrays, or with ``backend="numpy"``: the NumPy backend's checks, then
    the reference, or the kernel through copies of the arrays (:func:`rope_rtc.core.backends.on_gpu`)."""
    check_backend(backend)  # the contract's name gets its hint
    backend = resolve(backend)
    xi = A.describe(x, "x")  # before any conversion: a device array or a tensor that requires grad is named
    if backend == "numpy" and xi.device is not None:
        raise TypeError("x: backend='numpy' takes host arrays (NumPy, ml_dtypes.bfloat16 and float32)")
    out = np.empty(xi.shape, A.numpy_dtype(xi.dtype))
    if backend == "numpy":
        return TailRoPEForward(x, cosine, sine, out, backend="numpy").execute(x, cosine, sine, out)
    infos = [xi, A.describe(cosine, "cosine"), A.describe(sine, "sine")]
    check_kinds(infos)  # all on the host, as x is: a mix is refused as the general API refuses one
    _TailOp(TailRoPEForward(x, cosine, sine, out, backend="numpy").check_support()).validate((x, cosine, sine, out), 0)
    (result,) = on_gpu(tuple(np.asarray(i.array) for i in infos), (), stream,
                       lambda a, handle: (tail_rope(*a, backend="nvrtc", stream=handle)["out"],))
    return TupleDict(out=result)
