"""The prepared-launch core under every entry point (docs/design.md).

One mechanism, which each operation configures::

    signature -> validated template -> argument block -> launcher -> recent argument sets

- An operation (:class:`Op`) says what its calls fix and how they are checked: ``validate``
  runs every check on a call and returns a template; ``signature`` names what a template
  depends on besides addresses (shapes, strides, dtypes, devices of CuPy arrays).
- A template binds a call's addresses into the argument block after the only checks that
  depend on addresses (alignment, overlap), or declines, and then full validation decides
  (and raises on a real problem).
- :class:`Prepared` holds the block, the templates, the launcher and the calls seen last.
  On the very CuPy arrays of the previous call it checks only that the arrays fixing the launch
  (``Op.watched``) were not reshaped in place; on one of the last ``RECENT_SETS`` argument sets
  it restores the block in one copy; on new arrays of a known signature it runs only the
  template's address checks, through the op's quick path where it has one (``Op.quick_path``:
  the one-call functions' generated checks and block write, nothing remembered until the set
  comes back). Calls with other libraries' arrays (no signature: a torch tensor can move its
  memory under the same object) are validated every time.

Plans (``RopePlan``, ``TailRoPEForward``) call :meth:`Prepared.execute`, which remembers calls
(and holds their arrays). The one-call functions (``core/dispatch.py``) call :meth:`Prepared.bind`
and launch without remembering anything, so no caller's array outlives the call.
"""

from __future__ import annotations

import ctypes
import weakref
from operator import is_, itemgetter

from .launcher import Launcher
from .recent import RECENT_SETS, recall, remember

# Signatures a core keeps templates for: engines use a few shapes (prefill lengths, decode).
TEMPLATES = 64
# Templates one signature keeps (prepared.with_template): a wide one and narrower ones beside it.
TEMPLATES_PER_SIGNATURE = 4

_NDARRAY: type | None = None


def cupy_ndarray() -> type:
    """``cupy.ndarray`` (imported on first use: the core never imports CuPy at import time; a
    missing CuPy is a ToolchainError naming the extra to install)."""
    global _NDARRAY
    if _NDARRAY is None:
        from .driver import import_cupy

        _NDARRAY = import_cupy().ndarray
    return _NDARRAY


def signature(arrays: tuple) -> tuple | None:
    """``(shape, strides, dtype, device)`` of each argument when every one is a CuPy array or
    None; None otherwise (other objects are fully validated on every call)."""
    nd = _NDARRAY or cupy_ndarray()
    for a in arrays:
        if a is not None and type(a) is not nd:
            return None
    return tuple([None if a is None else (a.shape, a.strides, a.dtype, a.data.device_id) for a in arrays])


def pointers(arrays: tuple) -> tuple:
    """Data pointers of CuPy arrays (0 for None)."""
    return tuple([0 if a is None else a.data.ptr for a in arrays])


def shapes_of(indices: tuple):
    """A function giving the shapes of a call's arguments at ``indices`` (``Op.watched``) as they
    are now (None for an absent one): CuPy reshapes an array in place, never moving its memory."""
    if indices == (0, 1):  # q and k (x and cosine), written out: this is the identity path's cost
        return _shapes_of_the_first_two
    pick = itemgetter(*indices)
    return lambda arrays: tuple([getattr(a, "shape", None) for a in pick(arrays)])


def _shapes_of_the_first_two(arrays: tuple) -> tuple:
    return getattr(arrays[0], "shape", None), getattr(arrays[1], "shape", None)


def disjoint_pairs(extents: tuple, written: tuple, own: dict, validated_pointers: tuple) -> tuple:
    """The address check of a template, prepared once: ``(o, j, lo, hi, validated)`` for each
    written argument ``o`` and each other argument ``j`` whose bytes it must not meet.

    ``extents``: each argument's byte extent relative to its pointer (None: absent or empty);
    ``own``: written argument -> the input it was validated as a view of (in place), which it may
    meet. Whether two arrays of fixed shapes and strides share a byte depends only on their
    relative offset ``d = ptr[j] - ptr[o]``: their extents meet exactly when ``lo < d < hi``,
    and meeting extents are accepted at the offset full validation accepted (views of one
    buffer, such as q and k of a fused QKV projection, have extents that meet without sharing a
    byte). Each unordered pair is listed once, an in-place output standing for its input (the
    template checks that it still is that input's view before this check)."""
    canon = {o: i for o, i in own.items() if i is not None}
    seen, pairs = set(), []
    vp = validated_pointers
    for o in written:
        if extents[o] is None:
            continue
        olo, ohi = extents[o]
        for j, e in enumerate(extents):
            if e is None or j == o or j == own.get(o):
                continue
            pair = frozenset((canon.get(o, o), canon.get(j, j)))
            if pair in seen:
                continue
            seen.add(pair)
            pairs.append((o, j, olo - e[1], ohi - e[0], vp[j] - vp[o]))
    return tuple(pairs)


def repeat_signature(arrays: tuple, own_input: dict) -> tuple:
    """The signature a generated repeat path checks (``signature_checks``), of a call's CuPy arrays:
    each argument's (shape, dtype, device), with its strides before the dtype when it is not
    C-contiguous (a C-contiguous array's follow from its shape and dtype); None when absent; True
    for an output that is its own input (``own_input``: output index -> input index)."""
    entries = []
    for i, a in enumerate(arrays):
        if a is None:
            entries.append(None)
        elif i in own_input and a is arrays[own_input[i]]:
            entries.append(True)
        else:
            d = a.data
            entries.append((a.shape, a.dtype, d.device_id) if a._c_contiguous
                           else (a.shape, a.strides, a.dtype, d.device_id))
    return tuple(entries)


_NOT_MADE = object()  # a signature whose repeat path is not made yet (None: made, and there is none)


def made_once(functions: dict, sig: tuple, make):
    """``functions[sig]``, made by ``make(sig)`` (which may give None) on first use and remembered
    (``TEMPLATES_PER_SIGNATURE`` at most): a template's generated repeat path per signature."""
    fn = functions.get(sig, _NOT_MADE)
    if fn is _NOT_MADE:
        fn = make(sig)
        remember(functions, sig, fn, TEMPLATES_PER_SIGNATURE)
    return fn


def direct_launcher(args_address: int, device: int) -> Launcher:
    """A launcher of the argument block at ``args_address`` on ``device`` that launches every call
    with ``cuLaunchKernel`` (no graph replay): for callers that time each launch as itself (the
    blog's kernels)."""
    launcher = Launcher(args_address, device)
    launcher.replay = False
    return launcher


class Call:
    """One bound call: its arguments (held, so their identities stay theirs while remembered),
    the scalar argument, the template that bound it, the launch prefix (None: nothing to
    launch) and what the call returns. A new Call whenever the block's values change: the
    launcher replays a graph per Call."""

    __slots__ = ("arrays", "shape", "scalar", "template", "prefix", "result")

    def __init__(self, arrays: tuple, scalar: int, template, prefix, result, shape=None) -> None:
        self.arrays = arrays
        # Set when the call is remembered (Prepared._prepare; a one-call bind never needs it): the
        # shapes of the arguments its op watches (Op.watched) then.
        self.shape = shape
        self.scalar = scalar
        self.template = template
        self.prefix = prefix
        self.result = result

    def with_scalar(self, scalar: int) -> "Call":
        return Call(self.arrays, scalar, self.template, self.prefix, self.result, self.shape)


def present_in(arrays: tuple):
    """A function giving a call's arguments at the positions where ``arrays`` has one (not None):
    one C-level pick, so that ``Prepared._seen_again`` makes its weak references in one ``map``."""
    at = tuple(i for i, a in enumerate(arrays) if a is not None)
    if len(at) == 1:
        i = at[0]
        return lambda a: (a[i],)
    return itemgetter(*at) if at else (lambda a: ())


class Op:
    """What one kind of launch fixes and checks. Subclasses implement ``validate``."""

    #: The arguments whose shapes fix a launch's geometry (q and k; x and cosine): CuPy reshapes
    #: an array in place (``a.shape = ...``), so a remembered call checks their shapes again. An
    #: in-place reshape keeps an array's size and memory, so the launch of any other argument
    #: reads and writes exactly the bytes validated before, whatever its shape now.
    watched: tuple = (0, 1)
    #: Whether ``validate`` takes a request the caller validated (``Prepared.bind``'s ``request``).
    takes_request: bool = False

    def signature(self, arrays: tuple) -> tuple | None:
        return signature(arrays)

    def validate(self, arrays: tuple, scalar: int, request=None):
        """Every check of a call; returns a template, or raises TypeError/ValueError/
        NotImplementedError naming the argument before anything is launched or written.

        ``request``: the call's arguments as the op's own validation gives them, when the caller
        (a one-call function's first call) has validated them already with this op's options; an
        op that takes it runs only its plan's checks on it. Given only to ops that declare
        ``takes_request``."""
        raise NotImplementedError

    def quick_path(self, template, arrays: tuple):
        """``(fn, result)`` for the calls of ``arrays``' signature that ``template`` serves, or None
        (the default: every new argument set is bound and remembered). ``fn(*arrays, scalar)``
        checks a call's arrays against the signature and the template's address checks, writes
        the block and returns the launch prefix, or None to send the call through ``bind``;
        ``result(arrays)`` is what the call returns (``Prepared.execute``)."""
        return None


class Prepared:
    """The block, templates, launcher and recent calls of one operation on one device.

    A template implements ``pointers(arrays)``, ``validated_pointers``, ``bind(core, arrays,
    scalar, ptrs) -> Call | None`` and ``check_scalar(scalar)`` / ``write_scalar(block, scalar, call)``.
    ``filled``/``filled_vec`` name what the block holds beyond addresses (a template re-fills
    when it is not its own). One core per thread: the block is written on every call.
    """

    def __init__(self, op: Op, args, device: int) -> None:
        self.op = op
        self.args = args  # an ArgPack or StructArg: the block and the pointer array the launch reads
        self.block = block = args.values
        self._block_address = ctypes.addressof(block)
        self._block_size = ctypes.sizeof(block)
        self.block_bytes = (ctypes.c_char * self._block_size).from_address(self._block_address)  # for struct.pack_into
        self.device = device
        self.launcher = self._new_launcher(args.address, device)
        self.templates: dict = {}
        self.recent: dict = {}
        self.last: Call | None = None
        self.filled = self.filled_vec = None
        self._shapes = shapes_of(op.watched)  # of a remembered call's watched arguments
        # The op's quick path for the signature bound last (Op.quick_path): new arrays of that
        # signature take it instead of a bind, a remembered set and a token never seen before,
        # on their first call (``_seen_again``).
        self.quick = None
        self._sightings: dict = {}  # identities of the sets the quick path served -> their arrays, weakly
        self._nd = None
        self._present = present_in(())  # the quick path's arguments of a call (those not None)

    @staticmethod
    def _new_launcher(args_address: int, device: int) -> Launcher:
        return Launcher(args_address, device)

    def execute(self, arrays: tuple, scalar: int, stream):
        """Launch ``arrays`` on ``stream``: the last call's arrays again, a remembered set, new
        arrays through the op's quick path (remembered on their second call) or a bind
        (remembering the call); returns the call's result."""
        last = self.last
        if last is None or not all(map(is_, arrays, last.arrays)) or self._shapes(arrays) != last.shape:
            key = tuple(map(id, arrays))
            quick = self.quick
            if quick is not None and key not in self.recent and not self._seen_again(key, arrays):
                prefix = quick[0](*arrays, scalar)
                if prefix is not None:
                    # Written for this call alone, and the launcher gets no token for it: a graph
                    # node takes the block, as for the one-call functions. No call is the last one
                    # now (the block no longer holds the last call's values): the same arrays
                    # again are a set seen again, bound and remembered. No Call is recorded here:
                    # one (and the shapes it keeps) would cost every such call host time.
                    self.last = None
                    self.launcher.launch_on(prefix, stream)
                    return quick[1](arrays)
            last = self._prepare(arrays, scalar, key)
        elif scalar != last.scalar:
            last = self._rescalar(last, scalar)
        if last.prefix is not None:
            # A call that is not remembered (not every argument a CuPy array) is launched without a
            # token: it is bound anew on every call, so a graph of it would never replay, and a
            # remembered token would keep the caller's arrays alive.
            self.launcher(last.prefix, stream, last if last is self.last else None)
        return last.result

    def bind(self, arrays: tuple, scalar: int, request=None) -> Call:
        """Check and write ``arrays`` into the block, remembering nothing about them (``request``:
        the call already validated, for an op that ``takes_request``: see ``Op.validate``).

        A signature keeps the templates validated for it, widest first: a call off the first one's
        alignment adds a narrower template beside it rather than replacing it, so one misaligned
        call never moves later aligned ones to a narrower build (``with_template``)."""
        return self._bind(arrays, scalar, request)[0]

    def _bind(self, arrays: tuple, scalar: int, request=None) -> tuple:
        """``bind``, and the signature it found (None: not every argument is a CuPy array)."""
        sig = self.op.signature(arrays)
        tmpls = self.templates.get(sig, ()) if sig is not None else ()
        for tmpl in tmpls:
            call = tmpl.bind(self, arrays, scalar, tmpl.pointers(arrays))
            if call is not None:
                return call, sig
        op = self.op
        # raises on a real problem
        tmpl = op.validate(arrays, scalar, request) if request is not None and op.takes_request else \
            op.validate(arrays, scalar)
        call = tmpl.bind(self, arrays, scalar, tmpl.validated_pointers)
        if call is None:  # pragma: no cover - a template must accept the call it validated
            raise AssertionError("rope_rtc: a validated call was declined by its own template")
        if sig is not None:
            remember(self.templates, sig, with_template(tmpls, tmpl), TEMPLATES)
        return call, sig

    def _seen_again(self, key: tuple, arrays: tuple) -> bool:
        """Whether the set ``key`` (its arrays' identities) came through the quick path lately:
        its second call is bound and remembered, so that a rotation among a few buffer sets
        replays their graphs. Every argument the quick path's signature has is held weakly, to
        tell a set seen again from new arrays at the identities of freed ones (views, or an
        offsets array, made on every call)."""
        seen = self._sightings
        refs = seen.get(key)
        held = self._present(arrays)  # the arguments the quick path's signature has (not None)
        if refs is not None and all([r() is a for r, a in zip(refs, held)]):
            return True
        if type(arrays[0]) is self._nd:  # the quick path takes CuPy arrays only
            try:
                new = tuple(map(weakref.ref, held))
            except TypeError:  # None where the signature has an array, or an argument that takes no
                return False   # weak reference: the quick path declines such a call anyway
            if refs is None and len(seen) >= RECENT_SETS:
                del seen[next(iter(seen))]  # the oldest sighting
            seen[key] = new
        return False

    def _prepare(self, arrays: tuple, scalar: int, key: tuple) -> Call:
        hit = recall(self.recent, key)
        if hit is not None and hit[1].shape == self._shapes(arrays):
            snapshot, call = hit
            ctypes.memmove(self._block_address, snapshot, self._block_size)
            self.filled = None  # the block no longer holds what a template last wrote
            self.last = call
            return call if scalar == call.scalar else self._rescalar(call, scalar)
        call, sig = self._bind(arrays, scalar)
        if sig is None:  # not every argument is a CuPy array: validated on every call, nothing remembered
            self.last = None
            return call
        quick = self.op.quick_path(call.template, arrays)
        self.quick = None if quick is None else quick + (call.template,)
        if quick is not None:
            self._nd = cupy_ndarray()
            self._present = present_in(arrays)
        call.shape = self._shapes(arrays)
        remember(self.recent, key, (bytes(self.block), call), RECENT_SETS)
        self.last = call
        return call

    def _rescalar(self, call: Call, scalar: int) -> Call:
        call.template.check_scalar(scalar)
        call.template.write_scalar(self.block, scalar, call)
        self.last = call = call.with_scalar(scalar)
        return call


def narrower(new, old) -> bool:
    """Whether template ``new`` needs less alignment than ``old`` (``align``: the bytes of its
    build's widest access; 0 where a template has no such choice): it was validated for arrays
    off ``old``'s alignment, and ``old`` stays the better one for the aligned calls to come."""
    return getattr(new, "align", 0) < getattr(old, "align", 0)


def with_template(tmpls: tuple, tmpl) -> tuple:
    """A signature's templates once ``tmpl`` is validated for it: beside the wider ones when it is
    narrower (they keep serving aligned calls), else in place of them."""
    if tmpls and narrower(tmpl, tmpls[0]):
        return tmpls[:TEMPLATES_PER_SIGNATURE - 1] + (tmpl,)
    return (tmpl,)
