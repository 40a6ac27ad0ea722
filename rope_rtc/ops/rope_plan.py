"""``RopePlan``: the general API prepared once, as a thin layer over the prepared-launch core
(rope_rtc.core.prepared): what the plan fixes, how a call is validated (rope_request) and how the
argument block is filled (rope_launch). The one-call functions in ``rope`` keep plans of their
own, per thread."""

from __future__ import annotations

import ctypes
import struct
import warnings
from dataclasses import replace
from operator import is_, itemgetter

from ..build.registry import ANGLE_MODES, FIXED_ENTRIES, PDL_MIN_ARCH, ROPE_ENTRIES, FixedGeometry, angle_geometries, \
    both_strides, fixed_geometry, rope_head_batches, rope_spec, rope_vector_widths, waiting_for_producer
from ..core import arrays as A
from ..core.driver import current_device, device_arch
from ..core.codegen import address_predicate, address_terms, aligned_term, arrays_title, generated, signature_checks
from ..core.dispatch import split_offset
from ..core.launcher import StructArg, launch_prefix, load_kernel, single_device
from ..core.prepared import Call, Op, Prepared, cupy_ndarray, disjoint_pairs, made_once, pointers, repeat_signature, \
    signature
from ..errors import KernelNotCachedError
from .conventions import head_dim_of, name_the_cache, split_cos_sin_cache, unflatten_heads
from .rope_launch import allowed_vectors, angle_builds, choose_vector, fill_fixed, fill_params, fixed_build, \
    fixed_launch_shape, index_space, launch_shape
from .rope_params import POS_CU_SEQLENS, POS_OFFSET, FixedParams, RopeParams
from .rope_request import Request, check_positions_of, offset_error, validate

# Argument order of the core's calls: q, k, cos, sin, positions, q_out, k_out, cu_seqlens,
# offset array. The scalar is the int offset.
Q, K, COS, SIN, POSITIONS, Q_OUT, K_OUT, CU_SEQLENS, OFFSETS = range(9)
_TABLES_AND_INDICES = (COS, SIN, POSITIONS, CU_SEQLENS, OFFSETS)


def load_rope_functions(dtype: str, interleaved: bool, vec: int, head_batch: int, device: int,
                        pdl: bool = False) -> tuple:
    """The (32-bit, 64-bit) entries of one build of the general kernel, loaded on ``device``
    (``pdl``: the build that waits for its producer)."""
    spec = rope_spec(dtype, interleaved, vec, head_batch)
    k = load_kernel(waiting_for_producer(spec) if pdl else spec, device)
    return tuple(k.functions[e] for e in ROPE_ENTRIES)


# What a call binds into FixedParams, in memory order (rope_params.FIXED_FIELDS): in[q], in[k],
# out[q], out[k], cos, sin, positions, offsets, cu_seqlens, the int offset and table_vec. One
# pack writes them all (the one-call path's host time).
FIXED_CALL = struct.Struct("<9Q2I")
assert (FixedParams.out.offset, FixedParams.cos.offset, FixedParams.offset.offset,
        FixedParams.table_vec.offset, FIXED_CALL.size) == (16, 32, 72, 76, 80)




def load_fixed_function(g: FixedGeometry, device: int, pdl: bool = False):
    """The entry of the specialised build ``g`` (cuda_src/rope_fixed.cu), loaded on ``device``
    (``pdl``: the build that waits for its producer)."""
    return load_kernel(waiting_for_producer(g.spec()) if pdl else g.spec(), device).functions[FIXED_ENTRIES[0]]


class RopePlan:
    """A prepared :func:`apply_rope_qk` for inference engines.

    Build it from arrays or :class:`~rope_rtc.TensorDesc` declarations with the same keywords as
    ``apply_rope_qk``; ``compile()`` once; then ``execute`` validates and launches with no
    allocation, no synchronisation and no compilation. Fixed by the plan: dtype, layout, pair
    style, rotary window, direction, head counts, head dim, the position scheme and the device.
    Free between executes: the token count (B, S or T, including zero), strides and addresses.

    ``q_out``/``k_out`` at construction decide in place (omitted, or ``q_out=q``) or out of place;
    an out-of-place plan needs ``q_out``/``k_out`` at every ``execute``. ``execute`` remembers the
    last 16 argument sets of CuPy arrays it saw (holding references to them) and skips
    re-validation when one repeats (other libraries' arrays, which can move their memory under
    the same object, are validated on every call); new arrays of a shape, stride and dtype
    signature seen before get the cheaper address-only checks. From its second launch, a remembered set is launched as a one-node
    CUDA graph instantiated once for it, which costs the host less than ``cuLaunchKernel``
    (never into a stream that is being captured; a new scalar ``offset`` is a new set;
    ``ROPE_RTC_NO_GRAPH_REPLAY=1`` turns it off). Capturable in a CUDA graph: capture
    ``execute`` on the capturing stream, then refill the same buffers and replay. A plan holds
    one argument block: give each thread its own plan.

    ``pdl=True``: programmatic dependent launches (see :func:`apply_rope_qk`), on compute
    capability 9.0 and newer; ``programmatic`` says whether they apply on the plan's device.
    """

    def __init__(self, q, k, cos=None, sin=None, *, positions=None, offset=0, cu_seqlens=None,
                 layout: str | None = None, interleaved: bool = False, rotary_dim: int | None = None,
                 rotary_offset: int = 0, inverse: bool = False, q_out=None, k_out=None, device: int | None = None,
                 cos_sin_cache=None, head_dim: int | None = None, inv_freq=None,
                 attention_scaling: float | None = None, pdl: bool = False) -> None:
        check_pdl(pdl)
        self._opts = dict(layout=layout, interleaved=interleaved, rotary_dim=rotary_dim,
                          rotary_offset=rotary_offset, inverse=inverse)
        if inv_freq is not None:
            # cos and sin computed in the kernel: inv_freq rides in the cos slot (rope_request.validate).
            check_no_tables(cos, sin, cos_sin_cache)
            cos = inv_freq
            self._opts["attention_scaling"] = 1.0 if attention_scaling is None else attention_scaling
        elif attention_scaling is not None:
            raise TypeError("attention_scaling: only with inv_freq (a table already holds the factor: rope_tables "
                            "applies it)")
        # Engine conventions (rope_rtc.ops.conventions): a combined cos|sin table, flat [T, H * D] q/k.
        if inv_freq is None:
            cos, sin = split_cos_sin_cache(cos_sin_cache, cos, sin, rotary_dim, head_dim_of(q, head_dim, layout))
        self._flat_head_dim = head_dim
        # (arguments, their shapes, their views, the arguments once each) of the last converted call
        self._converted = None
        self._flat_quick = None  # the generated repeat path of the last converted call's own arrays
        if head_dim is not None:
            q, k = unflatten_heads(q, head_dim, layout, "q"), unflatten_heads(k, head_dim, layout, "k")
            q_out, k_out = unflatten_heads(q_out, head_dim, layout, "q_out"), unflatten_heads(k_out, head_dim, layout, "k_out")
        # Omitted outputs mean in place: checked as the in-place call execute makes, so that what
        # every execute would refuse (a table inside q, say) is refused here.
        omitted = q_out is None and (k is None or k_out is None)
        try:
            req = validate(q, k, cos, sin, positions=positions, offset=offset, cu_seqlens=cu_seqlens,
                           q_out=q if omitted else q_out, k_out=k if omitted else k_out, allow_host=False,
                           allow_desc=True, **self._opts)
        except (TypeError, ValueError) as exc:
            name_the_cache(exc, cos_sin_cache)
            raise
        # Omitted outputs, or q_out=q / k_out=k, mean in place (Request.in_place needs both given).
        in_place = ((q_out is None or A.same_view(req.q_out, req.q))
                    and (k_out is None or k is None or A.same_view(req.k_out, req.k)))
        if not in_place and k is not None and k_out is None:
            raise ValueError("k_out: an out-of-place plan (q_out given) needs k_out too")
        if not in_place and q_out is None:  # execute() would refuse every call
            raise ValueError("q_out: an out-of-place plan (k_out given) needs q_out too")
        self._configure(req, in_place, device, pdl)

    @classmethod
    def _from_request(cls, req: Request, opts: dict, names: tuple[str, str], device: int | None = None,
                      pdl: bool = False) -> "RopePlan":
        """The plan of a call already validated into ``req`` (with both outputs given), by the
        keywords ``opts`` (``validate``'s) and naming q and k ``names`` in its errors: what the
        one-call functions build, so that their first call is validated once."""
        plan = cls.__new__(cls)
        plan._opts = {n: opts[n] for n in ("layout", "interleaved", "rotary_dim", "rotary_offset", "inverse")}
        if req.angles:
            plan._opts["attention_scaling"] = opts["attention_scaling"]
        plan._flat_head_dim = None
        plan._converted = plan._flat_quick = None
        in_place = A.same_view(req.q_out, req.q) and (req.k is None or A.same_view(req.k_out, req.k))
        plan._configure(req, in_place, device, pdl)
        plan._names = names
        return plan

    def _configure(self, req: Request, in_place: bool, device: int | None, pdl: bool = False) -> None:
        """What the plan fixes, from its validated request; ``in_place``: whether it rotates q and k
        in place; ``pdl``: whether it launches programmatically (``RopePlan``'s ``pdl``)."""
        self.in_place = in_place
        interleaved, inverse = req.interleaved, req.inverse
        # layout=None settled by q's rank (3-d: "thd"); every execute is validated against that.
        layout = self._opts["layout"] = req.layout
        self.dtype, self.layout = req.dtype, layout
        self.interleaved, self.inverse = bool(interleaved), bool(inverse)
        self.rotary_dim, self.rotary_offset = req.rotary_dim, req.rotary_offset
        self.q_heads, self.head_dim = req.cq.H, req.cq.D
        self.k_heads = req.ck.H if req.ck is not None else 0
        self.has_k = req.k is not None
        self.pos_mode = req.pos_mode
        self.angles, self.attention = req.angles, req.attention
        if req.angles:  # what no build serves is refused now, not at the first execute
            angle_builds(replace(req, q_out=req.q, k_out=req.k) if self.in_place else req, layout == "bhsd")
        if device is None:
            device = req.device if req.device is not None else current_device()
        self.device = int(device)
        self._kernels: dict[tuple[int, int], tuple] = {}
        self._fixed: dict[FixedGeometry, object] = {}
        self._fixed_block = None
        self._fixed_bytes = None  # the same memory as bytes, for struct.pack_into
        self._core: Prepared | None = None
        self._check_positions = False
        self._names = ("q", "k")  # what errors call q and k (apply_rope's plans: "x")
        self.pdl = pdl
        self._programmatic = None  # whether pdl applies on the plan's device: asked on first use

    def compile(self) -> "RopePlan":
        """Load the kernels this plan can launch (every vector width and head batch of its dtype
        and pair style, and the build specialised on its geometry, strided and dense), compiling
        on a cache miss.
        After this, ``execute`` never compiles."""
        if self.angles:  # the builds that compute cos and sin, for small launches and large ones
            for g in both_strides(angle_geometries(self.dtype, self.interleaved, self.q_heads, self.k_heads,
                                                   self.head_dim, self.rotary_offset, self.rotary_dim,
                                                   self.inv_freq_dtype, self.layout == "bhsd", self.pos_mode)):
                self.fixed_kernel(g)
            self._ensure_core()
            return self
        for vec in rope_vector_widths(self.dtype, self.interleaved):
            for hb in rope_head_batches(self.interleaved):
                self.kernel(vec, hb)
        g = fixed_geometry(self.dtype, self.interleaved, self.q_heads, self.k_heads, self.head_dim,
                           self.rotary_offset, self.rotary_dim, self.layout == "bhsd", self.pos_mode)
        for build in both_strides([g] if g is not None else []):  # the call's arrays pick one
            self.fixed_kernel(build)
        self._ensure_core()
        return self

    def _flat_quick_for(self, views: tuple, given: tuple, positions, offset, cu_seqlens):
        """The template's generated repeat path (``RopeTemplate.one_call``) written for a converted
        call's own arrays: the flat q/k and the cos_sin_cache itself (sin: the second half of its
        rows), from the template that serves its views' signature; None where there is none (no
        bind of that signature yet, another library's arrays, positions checked on the device)."""
        core = self._core
        if core is None or self._check_positions or not hasattr(cupy_ndarray(), "_c_contiguous"):
            return None
        offsets = None if offset is None or type(offset) is int else split_offset(offset)[1]
        vq, vk, vc, vs, vqo, vko = views
        sig = core.op.signature((vq, vk, vc, vs, positions, vqo, vko, cu_seqlens, offsets))
        tmpls = core.templates.get(sig) if sig is not None else None
        if not tmpls or type(tmpls[0]) is not RopeTemplate:
            return None
        q, k, cache, cos, sin, q_out, k_out = given
        c, s = (cos, sin) if cache is None else (cache, None)
        arrays = (q, k, c, s, positions, q_out, k_out, cu_seqlens, offsets)
        nd = cupy_ndarray()
        if any(a is not None and type(a) is not nd for a in arrays):
            return None
        flat = one_call_signature(arrays)
        if cache is not None:
            flat = flat[:SIN] + ((SECOND_HALF, vs.data.ptr - vc.data.ptr),) + flat[SIN + 1:]
        return tmpls[0].one_call(flat)

    def _execute_converted(self, q, k, cos, sin, positions, q_out, k_out, stream, offset, cu_seqlens, cache):
        """``execute`` for engine conventions: a combined cos|sin table, flat q/k (views, no copy).
        The views of the last call are kept and reused while the same CuPy arrays come back with
        their shapes, so that repeated calls keep the core's identity path. Views of another
        library's arrays are made again on every call: such an object can come back with other
        memory or strides under the same shape (torch: ``t.set_``, ``t.data = ...``), as the core
        assumes too (it remembers calls with CuPy arrays only)."""
        if self.in_place:
            q_out = q if q_out is None else q_out
            k_out = k if k_out is None else k_out
        given = (q, k, q_out, k_out, cache, cos, sin)
        last = self._converted
        if last is not None and all(map(is_, given, last[0])) and [a.shape for a in last[3]] == last[1]:
            views = last[2]
        else:
            flat = self._flat_quick
            if flat is not None:  # new arrays of the flat signature seen last: no views, no validation
                if offset is None:
                    scalar, offsets = 0, None
                else:
                    scalar, offsets = (offset, None) if type(offset) is int else split_offset(offset)
                c, s = (cos, sin) if cache is None else (cache, None)
                prefix = flat(q, k, c, s, positions, q_out, k_out, cu_seqlens, offsets, scalar)
                if prefix is not None:
                    core = self._core
                    core.last = None  # as the core's quick path: the block holds this call's values now
                    core.launcher.launch_on(prefix, stream)
                    return q_out, k_out
            hd, layout = self._flat_head_dim, self.layout
            c, s = (cos, sin) if self.angles else split_cos_sin_cache(cache, cos, sin, self._opts["rotary_dim"],
                                                                      head_dim_of(q, hd, layout))
            views = (unflatten_heads(q, hd, layout, "q"), unflatten_heads(k, hd, layout, "k"), c, s,
                     unflatten_heads(q_out, hd, layout, "q_out"), unflatten_heads(k_out, hd, layout, "k_out"))
            nd = cupy_ndarray()
            if all(a is None or type(a) is nd for a in given):
                # Each array once (in place, q_out is q): its shape then, checked on the next call.
                arrays = [a for i, a in enumerate(given) if a is not None and not any(b is a for b in given[:i])]
                self._converted = (given, [a.shape for a in arrays], views, arrays)
            else:
                self._converted = None
        vq, vk, vc, vs, vqo, vko = views
        try:
            self._execute(vq, vk, vc, vs, positions, vqo, vko, stream, offset, cu_seqlens)
        except (TypeError, ValueError) as exc:
            name_the_cache(exc, cache)
            raise
        if last is None or views is not last[2]:
            self._flat_quick = self._flat_quick_for(views, (q, k, cache, cos, sin, q_out, k_out), positions, offset,
                                                    cu_seqlens)
        return q_out, k_out

    def fixed_kernel(self, g: FixedGeometry):
        """The entry of the specialised build ``g`` (cuda_src/rope_fixed.cu), loaded on first use;
        None when ``ROPE_RTC_NO_COMPILE=1`` finds it missing from the cache: the plan then runs the
        strided build of a missing dense one where the cache holds it, else the generic build, and
        a warning says how to add it (KernelNotCachedError's advice)."""
        if g in self._fixed:
            return self._fixed[g]
        if g.angles:  # no generic build computes angles: a missing one raises (KernelNotCachedError)
            fn = self._fixed[g] = load_fixed_function(g, self.device, self.programmatic)
            return fn
        try:
            fn = load_fixed_function(g, self.device, self.programmatic)
        except KernelNotCachedError as exc:
            instead = ("its strided build where the cache holds it, else the generic build" if g.dense else
                       "the generic build")
            warnings.warn(f"{exc}. Until then this plan runs {instead} (slower on large shapes).",
                          RuntimeWarning, stacklevel=3)
            fn = None
        self._fixed[g] = fn
        return fn

    def kernel(self, vec: int, head_batch: int) -> tuple:
        """The (32-bit, 64-bit) entries of one build, loaded on first use."""
        fns = self._kernels.get((vec, head_batch))
        if fns is None:
            fns = self._kernels[(vec, head_batch)] = load_rope_functions(self.dtype, self.interleaved, vec,
                                                                         head_batch, self.device, self.programmatic)
        return fns

    # The specialised build's argument block (a build that extends it names its own).
    _fixed_params = FixedParams

    def _fixed_view(self, core: Prepared) -> FixedParams:
        """The core's block seen as the specialised build's arguments (same memory)."""
        view = self._fixed_block
        if view is None or view[0] is not core:
            address = ctypes.addressof(core.block)
            params = self._fixed_params
            view = self._fixed_block = (core, params.from_address(address))
            self._fixed_bytes = (ctypes.c_char * ctypes.sizeof(params)).from_address(address)
        return view[1]

    def _ensure_core(self) -> Prepared:
        if self._core is None:
            from ..env import settings

            self._check_positions = settings().check_positions
            self._core = Prepared(self._op(), StructArg(RopeParams), self.device)
            if self.programmatic:
                self._core.launcher.launch_programmatically()
        return self._core

    @property
    def programmatic(self) -> bool:
        """Whether this plan's launches are programmatic dependent launches: ``pdl=True`` on a
        device of compute capability 9.0 or newer (elsewhere ``pdl`` changes nothing)."""
        if self._programmatic is None:
            self._programmatic = bool(self.pdl) and device_arch(self.device) >= PDL_MIN_ARCH
        return self._programmatic

    def _op(self) -> Op:
        return _RopeOp(self)

    @property
    def inv_freq_dtype(self) -> str | None:
        """The dtype of the inverse frequencies a plan built with ``inv_freq=`` computes its angles
        from; None for a plan that reads tables."""
        return next((d for d, m in ANGLE_MODES.items() if m == self.angles), None)

    def execute(self, q, k=None, cos=None, sin=None, positions=None, q_out=None, k_out=None, stream=None, *,
                offset=None, cu_seqlens=None, cos_sin_cache=None, inv_freq=None):
        """Validate (cheaply when the arrays repeat) and launch. Returns ``(q_out, k_out)``.

        A plan built with ``cos_sin_cache=`` or ``head_dim=`` takes the same conventions here; one
        built with ``inv_freq=`` takes ``inv_freq=`` (any array of the plan's dtype and length)
        instead of tables."""
        if inv_freq is not None:
            check_no_tables(cos, sin, cos_sin_cache)
            if not self.angles:
                raise TypeError("inv_freq: this plan reads cos/sin tables; pass cos and sin (or build a plan with "
                                "inv_freq=)")
            cos = inv_freq
        if cos_sin_cache is not None or self._flat_head_dim is not None:
            if self.angles and cos_sin_cache is not None:
                raise TypeError("cos_sin_cache: this plan computes cos and sin from inv_freq; pass inv_freq=")
            return self._execute_converted(q, k, cos, sin, positions, q_out, k_out, stream, offset, cu_seqlens,
                                           cos_sin_cache)
        return self._execute(q, k, cos, sin, positions, q_out, k_out, stream, offset, cu_seqlens)

    def _execute(self, q, k, cos, sin, positions, q_out, k_out, stream, offset, cu_seqlens, extra: tuple = ()):
        """The launch of ``execute``; ``extra``: arguments a plan that extends this one appends
        after the general ones (QK-norm's weights)."""
        core = self._core or self.compile()._core
        if offset is None:
            scalar, offsets = 0, None
        else:
            scalar, offsets = (offset, None) if type(offset) is int else split_offset(offset)
        if self.in_place:
            if q_out is None:
                q_out = q
            if k_out is None:
                k_out = k
        arrays = (q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets) + extra
        if self._check_positions:
            check_positions_of(arrays, scalar, self._opts)
        return core.execute(arrays, scalar, stream)


def check_pdl(pdl) -> None:
    """``pdl`` is True or False (a launch option: anything else is a mistake worth naming)."""
    if pdl is not True and pdl is not False:
        raise TypeError(f"pdl: expected True or False, got {type(pdl).__name__} {pdl!r}")


def check_no_tables(cos, sin, cos_sin_cache) -> None:
    """``inv_freq=`` replaces the tables: TypeError when tables come with it."""
    if cos is not None or sin is not None or cos_sin_cache is not None:
        given = "/".join(n for n, v in (("cos", cos), ("sin", sin), ("cos_sin_cache", cos_sin_cache)) if v is not None)
        raise TypeError(f"{given}: pass inv_freq (cos and sin computed in the kernel) or tables, not both")


class _SecondHalf:
    """The marker of sin's signature entry, ``(SECOND_HALF, bytes from a row's start)``, in a repeat
    path whose cos slot holds a combined cos_sin_cache (rope.py: the engines' convention): sin is
    read at that offset into each of the cache's rows."""

    def __repr__(self) -> str:
        return "SECOND_HALF"


SECOND_HALF = _SecondHalf()


def one_call_signature(arrays: tuple) -> tuple:
    """The one-call functions' signature of a call's CuPy arrays (rope.py:
    ``_signature_and_pointers`` writes the same out argument by argument): each argument's
    (shape, dtype, device), with its strides before the dtype when it is not C-contiguous; None
    when absent; True for an output that is its own input."""
    return repeat_signature(arrays, OWN_INPUT)


_RESULT = itemgetter(Q_OUT, K_OUT)  # what a RopePlan call returns: (q_out, k_out)
OWN_INPUT = {Q_OUT: Q, K_OUT: K}  # in place: the output is its input


def generated_quick_path(template, arrays: tuple, kind: type):
    """``Op.quick_path`` for the plans on the general template and its subclasses (multimodal, fused
    norm): ``(fn, result)`` with ``fn`` the template's generated repeat path for ``arrays``'
    signature (``RopeTemplate.one_call``); None for a template that is not exactly ``kind`` (a
    subclass writes more than ``kind``'s path does) or has no such path, or where CuPy does not
    expose its contiguity flag."""
    if type(template) is not kind or not hasattr(cupy_ndarray(), "_c_contiguous"):
        return None
    fn = template.one_call(one_call_signature(arrays))
    return None if fn is None else (fn, _RESULT)


class _RopeOp(Op):
    """What a RopePlan fixes and checks."""

    takes_request = True  # the one-call functions' first call hands its request over (rope._plan_for)

    def __init__(self, plan: RopePlan) -> None:
        self.plan = plan

    def signature(self, arrays: tuple):
        sig = signature(arrays)
        if sig is None:
            return None
        return sig, arrays[Q_OUT] is arrays[Q], arrays[K_OUT] is arrays[K]

    def quick_path(self, template, arrays: tuple):
        """The one-call functions' generated repeat path of ``template`` for ``arrays``' signature
        (``RopeTemplate.one_call``): a plan called with new arrays of a signature it has bound
        takes the same checks and block write as ``apply_rope_qk``, where a bind, a remembered
        set and a token the launcher has never seen cost it more on the host
        (``benchmarks/probes/plan_new_arrays_cost.py``). None where the template has none (no
        specialised build) or CuPy
        does not expose its contiguity flag."""
        return generated_quick_path(template, arrays, RopeTemplate)

    def validate(self, arrays: tuple, scalar: int, request: Request | None = None) -> "RopeTemplate":
        """Every check of a call (``request``: the call already validated by the caller with this
        plan's options, which only the plan's own checks then compare with the plan)."""
        plan = self.plan
        q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets = arrays
        check_plan_arguments(plan, k, q_out, k_out)
        if plan.angles and sin is not None:
            raise TypeError("cos/sin: this plan computes cos and sin from inv_freq; pass inv_freq= to execute()")
        req = request
        if req is None:
            req = validate(q, k, cos, sin, positions=positions, offset=scalar if offsets is None else offsets,
                           cu_seqlens=cu_seqlens, q_out=q_out, k_out=k_out, allow_host=False, names=plan._names,
                           **plan._opts)
        check_request_fits_plan(plan, req)
        if req.num_tokens:
            choose_vector(req)  # raises, naming the misaligned argument
        return RopeTemplate(plan, req)


def check_plan_arguments(plan: RopePlan, k, q_out, k_out) -> None:
    """Before validation: the arguments a plan's calls must give (k or not; outputs out of place)."""
    if plan.has_k != (k is not None):
        raise TypeError("k: this plan was built " + ("with" if plan.has_k else "without") + " k")
    if not plan.in_place and (q_out is None or (plan.has_k and k_out is None)):
        raise TypeError("q_out/k_out: this plan writes to separate outputs; pass them to execute()")


def check_request_fits_plan(plan: RopePlan, req: Request) -> None:
    """After validation: what the plan fixes (in place or not, device, dtype, heads, head dim,
    position scheme) against the validated call; ValueError naming every difference."""
    if plan.in_place:
        for out, own, name in ((req.q_out, req.q, "q"), (req.k_out, req.k, "k")):
            if out is not None and not A.same_view(out, own):
                raise ValueError(f"{name}_out: this plan rotates in place; pass {name}_out=None or {name}_out={name}")
    if req.device is not None and req.device != plan.device:
        A.check_same_device([req.q], plan.device)
    problems = []
    if req.dtype != plan.dtype:
        problems.append(f"dtype {req.dtype} (plan: {plan.dtype})")
    if (req.cq.H, req.cq.D) != (plan.q_heads, plan.head_dim):
        problems.append(f"q heads/dim {(req.cq.H, req.cq.D)} (plan: {(plan.q_heads, plan.head_dim)})")
    if req.ck is not None and req.ck.H != plan.k_heads:
        problems.append(f"k heads {req.ck.H} (plan: {plan.k_heads})")
    if req.pos_mode != plan.pos_mode:
        problems.append("the position scheme (positions / offset array / cu_seqlens) differs from the plan's")
    if req.angles != getattr(plan, "angles", 0):
        problems.append(f"inv_freq dtype {req.cos.dtype} (plan: {plan.inv_freq_dtype})" if req.angles and plan.angles
                        else "tables and inv_freq: the plan " + ("computes cos and sin from inv_freq; pass inv_freq="
                                                                 if plan.angles else "reads cos/sin tables"))
    if problems:
        raise ValueError("execute: " + "; ".join(problems))


class RopeTemplate:
    """What full validation established for one argument signature, minus the addresses (it
    holds no caller's array). Argument order: the core's (Q, K, ... OFFSETS). The base of the
    fused ops' templates (multimodal, QK-norm), which add their builds and arguments to it."""

    OUTPUTS = ((Q_OUT, Q), (K_OUT, K))  # (output, its own input)
    generic = True  # whether a call the specialised build cannot take runs the generic kernel
    #: Arguments a subclass's calls carry after the general nine (QK-norm's weights), which its
    #: generated repeat path takes and writes with ``_extra_writes``. A subclass that declares them
    #: has a generated path although it overrides ``_write_fixed``: its override must write the
    #: general block and these arguments and nothing else, which the path then writes alike.
    EXTRA_ARGS: tuple = ()
    #: ``(argument, mask)`` of a build the signature prefers to this template's (its first call was
    #: off that build's alignment: codegen.preferred_predicate); empty for the preferred one.
    preferred_masks: tuple = ()

    def __init__(self, plan: RopePlan, req: Request) -> None:
        infos = self._infos(req)
        self.validated_pointers = tuple(0 if i is None else i.ptr for i in infos)
        self.req = req = req.without_arrays()
        self.plan = plan
        # Extents relative to each array's pointer.
        self.extents = tuple(None if i is None or i.size == 0 else tuple(e - i.ptr for e in i.byte_extent())
                             for i in infos)
        in_place = tuple(infos[o] is not None and A.same_view(infos[o], infos[i]) for o, i in self.OUTPUTS)
        # Outputs validated as their own input's view: a call binds here only if they still are
        # (the signature fixes shape, strides and dtype, so an equal pointer is the same view).
        self.same_view = tuple(pair for pair, same in zip(self.OUTPUTS, in_place) if same)
        # No output may meet another argument's bytes (prepared.disjoint_pairs).
        self.disjoint = disjoint_pairs(self.extents, tuple(o for o, _ in self.OUTPUTS),
                                       {o: (own if same else None) for (o, own), same in zip(self.OUTPUTS, in_place)},
                                       self.validated_pointers)
        self.allowed = allowed_vectors(req) if req.num_tokens else ()
        self.itemsize = req.q.itemsize
        if req.angles:
            self.generic = False  # only the specialised builds compute angles
        # The specialised build when the call fits it and is at hand (its vector's alignment is
        # checked per call).
        self.fixed = self._geometry(req) if req.num_tokens else None
        if self.fixed is not None and plan.fixed_kernel(self.fixed) is None:
            # Not cached under ROPE_RTC_NO_COMPILE (fixed_kernel warned): a dense build's strided
            # build serves the same call when the cache holds it, else the generic kernel.
            strided = replace(self.fixed, dense=False) if getattr(self.fixed, "dense", False) else None
            self.fixed = strided if strided is not None and plan.fixed_kernel(strided) is not None else None
        self.fixed_align = self.fixed.vec * self.itemsize if self.fixed is not None else 0
        # The widest access of the builds this template serves (prepared.narrower).
        self.align = self.fixed_align or max(self.allowed, default=0) * self.itemsize
        self._fixed_prefix = None
        self._one_calls: dict = {}  # signature -> its generated repeat path (one_call)
        # Tables and index arrays are read as aligned 4/8-byte scalars: (argument, alignment mask).
        # An empty one is never read (validation does not check its alignment either); its shape
        # is in the signature, so every call of this template has it empty.
        self.natural = tuple((i, infos[i].itemsize - 1) for i in _TABLES_AND_INDICES
                             if infos[i] is not None and infos[i].size)
        self.npair_div = 2 if req.interleaved else 1
        self.has_positions = req.positions is not None
        self.table_rows = req.table_rows
        # (tokens from the offset on, table rows): S for the offset scheme; with cu_seqlens every
        # sequence starts at the offset, so a call with tokens reads its row at least.
        self.offset_rows = ((req.cq.S, self.table_rows) if req.pos_mode == POS_OFFSET else
                            (1, self.table_rows) if req.pos_mode == POS_CU_SEQLENS and req.num_tokens else None)
        # offset_error's (tokens, rows, per_sequence), as validation calls it for a new plan; with
        # positions or an offset array the int offset is 0 (a token count may exceed the rows)
        self.offset_check = ((req.cq.S, self.table_rows, req.pos_mode == POS_CU_SEQLENS)
                             if req.pos_mode in (POS_OFFSET, POS_CU_SEQLENS) else (0, self.table_rows, False))
        self.rows_stride = req.cos.strides[0] if req.cos.shape[0] > 1 and not req.angles else 0
        self._prefixes: dict[int, tuple] = {}
        # The specialised build reads table rows NPAIR floats per access when both tables' addresses
        # allow it (-1: the row stride never does).
        npair = self.fixed.vec // self.npair_div if self.fixed is not None else 1
        self._table_mask = 4 * npair - 1 if self.rows_stride % npair == 0 else -1
        # A dense build reads table rows in vectors (rope_fixed.cu: rows_in_vectors): with a row
        # stride that never allows it the strided build serves the template, and a call whose
        # table addresses do not allow it runs the strided build on the same block.
        self._strided = self._strided_prefix = None
        if self.fixed is not None and getattr(self.fixed, "dense", False) and not self.fixed.angles:
            strided = replace(self.fixed, dense=False)
            if plan.fixed_kernel(strided) is None:  # not cached under ROPE_RTC_NO_COMPILE: the generic kernel
                self.fixed, self.fixed_align = None, 0
                self.align = max(self.allowed, default=0) * self.itemsize
            elif self._table_mask < 0:
                self.fixed = strided
            else:
                self._strided = strided
        self.prepare_checks()

    def prepare_checks(self) -> None:
        """The address checks as a predicate on a call's pointers (codegen.address_predicate). A
        subclass that adds checks calls it again. (The one-call path writes the same checks into
        its generated function: one_call.)"""
        self._addresses = address_predicate(self.same_view, self.disjoint, self.natural,
                                            owner=type(self.plan).__name__)

    pointers = staticmethod(pointers)

    def _infos(self, req: Request) -> tuple:
        """The arguments' infos in the core's order (what the address checks cover)."""
        return req.infos()

    def _geometry(self, req: Request) -> FixedGeometry | None:
        """The specialised build for the call, or None (the generic kernel serves it)."""
        return fixed_build(req, self.plan.layout == "bhsd")

    def _fill_fixed(self, p: FixedParams) -> None:
        fill_fixed(p, self.req, self.fixed)

    def check_scalar(self, offset: int) -> None:
        """A new int offset for arguments already validated (ValueError when it cannot be used)."""
        if self.has_positions and offset:
            raise ValueError("positions and offset: pass one of them (positions are absolute)")
        bad = offset_error(offset, *self.offset_check)
        if bad:
            raise ValueError(bad)

    def write_scalar(self, block: RopeParams, offset: int, call: Call) -> None:
        # Both specialised builds (dense, and the strided one a dense template falls back to)
        # read the specialised block, whose offset field is not the generic block's.
        if call.prefix is not None and (call.prefix is self._fixed_prefix or call.prefix is self._strided_prefix):
            FixedParams.from_address(ctypes.addressof(block)).offset = offset
        else:
            block.offset = offset

    def addresses_ok(self, ptrs: tuple, offset: int) -> bool:
        """The checks that depend on addresses and the scalar offset: whether this template may
        bind them (False sends the call through full validation, which decides). Outputs
        validated in place must still be their inputs' views, no output may meet another
        argument at an offset not validated, tables and index arrays must be on their natural
        alignment (prepare_checks), and the offset must be one the template allows."""
        return self._addresses(ptrs) and self.offset_ok(offset)

    def offset_ok(self, offset: int) -> bool:
        if offset and self.has_positions or offset < 0 or offset > self.table_rows:
            return False
        return self.offset_rows is None or offset + self.offset_rows[0] <= self.offset_rows[1]

    def one_call(self, sig: tuple):
        """The one-call functions' repeat path for calls of signature ``sig`` (``repeat_signature``;
        sin may be ``(SECOND_HALF, offset)``), or None when this template has none (no specialised
        build; a subclass that writes more than its block and declares no ``EXTRA_ARGS``).
        ``fn(q, k, cos, sin, positions, q_out, k_out, cu_seqlens, offsets, *EXTRA_ARGS, offset)``
        returns the launch prefix after writing the block, or None when the call's arrays are not
        of ``sig`` or its addresses or offset are not this template's (the caller then takes the
        signature's dictionary and full validation). Builds no Call: nothing is remembered.
        Generated once per signature (:meth:`_one_call_function`)."""
        return made_once(self._one_calls, sig, self._one_call_function)

    def _one_call_function(self, sig: tuple):
        """The specialised build's bind with the signature's checks in front, written out as one
        function over the arguments: each array's type, contiguity, shape, strides, dtype (and
        device, on a machine with several), absent arguments and in-place outputs as ``sig``
        says; then the address checks, the offset's range, the block's refill when another
        template wrote it last, and one pack of the call's fields. What the dictionary, the
        signature's tuples and the pointer tuple cost a repeated call, it does not."""
        if not self.fixed_align or (type(self)._write_fixed is not RopeTemplate._write_fixed and not self.EXTRA_ARGS):
            return None
        core = self.plan._ensure_core()
        names = ("q", "k", "cos", "sin", "positions", "q_out", "k_out", "cu_seqlens", "offsets") + self.EXTRA_ARGS
        namespace: dict = {"nd": cupy_ndarray()}

        def second_half(i, name, entry):  # sin: the second half of the rows of the cos_sin_cache in cos
            if isinstance(entry, tuple) and entry[0] is SECOND_HALF:
                return f"{name} is None", f"    p{i} = p{COS} + {int(entry[1])}\n"
            return None

        conds, reads = signature_checks(names, sig, OWN_INPUT, not single_device(), namespace,
                                        second_half)
        same_view = tuple(pair for pair in self.same_view if sig[pair[0]] is not True)
        terms = address_terms(same_view, self.disjoint, self.natural, (Q, K, Q_OUT, K_OUT), self.fixed_align,
                              ref=lambda i: f"p{i}")
        if self.has_positions:
            terms.append("offset == 0")
        else:
            S = 0 if self.offset_rows is None else self.offset_rows[0]
            terms.append(f"0 <= offset <= {int(self.table_rows - S)}")
        if self.preferred_masks:  # a call the preferred build can take goes back to validation
            terms.append(f"not ({aligned_term(self.preferred_masks, lambda i: f'p{i}')})")
        extra, extra_namespace = self._extra_writes()
        mask = self._table_mask
        flag = f"not (p{COS} | p{SIN}) & {int(mask)}" if mask >= 0 else "0"
        strided = None
        if self._strided is not None:  # rows the dense build cannot read in vectors: the strided build
            strided = self._strided_launch()
        self.plan._fixed_view(core)  # the block's bytes
        if self._fixed_prefix is None:
            self._fixed_prefix = self._launch_fixed()
        body = (f"    if not ({conds}):\n"
                "        return None\n"
                + reads +
                f"    if not ({' and '.join(terms)}):\n"
                "        return None\n"
                "    if core.filled is not tmpl or core.filled_vec != 'fixed':\n"
                "        tmpl.refill_fixed(core)\n"
                f"    tv = {flag}\n"
                f"    pack(block, 0, p{Q}, p{K}, p{Q_OUT}, p{K_OUT}, p{COS}, p{SIN}, p{POSITIONS}, p{OFFSETS}, "
                f"p{CU_SEQLENS}, offset, tv)\n"
                + extra
                + ("    return prefix if tv else strided\n" if strided is not None else "    return prefix\n"))
        namespace.update(core=core, tmpl=self, pack=FIXED_CALL.pack_into, block=self.plan._fixed_bytes,
                         prefix=self._fixed_prefix, strided=strided, **extra_namespace)
        owner = type(self.plan).__name__
        return generated("repeat_path", ", ".join(names) + ", offset", body, namespace,
                         title=f"{owner} repeat path ({arrays_title(names, sig)})", qualname=f"{owner}.repeat_path")

    def _extra_writes(self) -> tuple[str, dict]:
        """Statements of a generated repeat path that write ``EXTRA_ARGS``' pointers (``p9``, ...)
        into the block, and the names they use."""
        return "", {}

    def refill_fixed(self, core: Prepared) -> None:
        """Write what the plan fixes into the specialised build's block (another template, or the
        generic build, wrote it last)."""
        self._fill_fixed(self.plan._fixed_view(core))
        core.filled, core.filled_vec = self, "fixed"

    def bind(self, core: Prepared, arrays: tuple, offset: int, ptrs: tuple) -> Call | None:
        """Address checks, then the block; None sends the call through full validation."""
        if not self.addresses_ok(ptrs, offset):
            return None
        if not self.allowed:  # nothing to launch
            return Call(arrays, offset, self, None, (arrays[Q_OUT], arrays[K_OUT]))
        combined = ptrs[Q] | ptrs[K] | ptrs[Q_OUT] | ptrs[K_OUT]
        if self.fixed_align and combined % self.fixed_align == 0:
            return Call(arrays, offset, self, self._write_fixed(core, ptrs, offset), (arrays[Q_OUT], arrays[K_OUT]))
        if not self.generic:
            return None  # full validation says why the specialised build cannot take the call
        for vec in self.allowed:
            if combined % (vec * self.itemsize) == 0:
                break
        else:
            return None
        p = core.block
        if core.filled is not self or core.filled_vec != vec:
            fill_params(p, self.req, vec)
            core.filled, core.filled_vec = self, vec
        q, k, c, s, pos, qo, ko, cu, offs = ptrs
        p.q_in, p.q_out, p.k_in, p.k_out, p.cos, p.sin = q, qo, k, ko, c, s
        p.positions, p.offsets, p.cu_seqlens, p.offset = pos, offs, cu, offset
        npair = vec // self.npair_div
        p.table_vec = self.rows_stride % npair == 0 and c % (4 * npair) == 0 and s % (4 * npair) == 0
        return Call(arrays, offset, self, self._prefixes.get(vec) or self.prefix(vec), (arrays[Q_OUT], arrays[K_OUT]))

    def _write_fixed(self, core: Prepared, ptrs: tuple, offset: int) -> tuple:
        """Write the specialised build's block (it shares the block's memory: a FixedParams is
        smaller than a RopeParams); returns its launch prefix."""
        plan = self.plan
        if core.filled is not self or core.filled_vec != "fixed":
            self.refill_fixed(core)
        c, s = ptrs[COS], ptrs[SIN]
        mask = self._table_mask
        vectors = mask >= 0 and not (c | s) & mask
        FIXED_CALL.pack_into(plan._fixed_bytes, 0, ptrs[Q], ptrs[K], ptrs[Q_OUT], ptrs[K_OUT], c, s,
                             ptrs[POSITIONS], ptrs[OFFSETS], ptrs[CU_SEQLENS], offset, vectors)
        if not vectors and self._strided is not None:
            return self._strided_launch()
        pre = self._fixed_prefix
        if pre is None:
            pre = self._fixed_prefix = self._launch_fixed()
        return pre

    def _strided_launch(self) -> tuple:
        """The strided build's launch prefix, for a dense template's calls whose table rows the
        dense build cannot read in vectors (the block serves both builds)."""
        pre = self._strided_prefix
        if pre is None:
            pre = self._strided_prefix = launch_prefix(self.plan.fixed_kernel(self._strided),
                                                       *fixed_launch_shape(self.req, self._strided))
        return pre

    def _launch_fixed(self) -> tuple:
        """The specialised build's launch prefix."""
        return launch_prefix(self.plan.fixed_kernel(self.fixed), *fixed_launch_shape(self.req, self.fixed))

    def prefix(self, vec: int) -> tuple:
        pre = self._prefixes.get(vec)
        if pre is None:
            space = index_space(self.req, vec)
            fn = self.plan.kernel(vec, space.head_batch)[0 if space.narrow else 1]
            pre = self._prefixes[vec] = launch_prefix(fn, *launch_shape(self.req, vec))
        return pre


