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
(and holds their arrays). The one-call functions call :meth:`Prepared.bind` and launch without
remembering anything, so no caller's array outlives the call.
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
# Signatures (and plans) one thread keeps for the one-call functions.
ONE_CALL_SIGNATURES = 64

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


def address_terms(same_view: tuple, pairs: tuple, natural: tuple, aligned: tuple = (), align: int = 0,
                  ref=lambda i: f"p[{i}]") -> list[str]:
    """A template's address checks on a call's pointers ``p``, as Python expressions that all
    hold when the call may be bound.

    True when every written argument validated as its input's view still is (``same_view``:
    ``(o, own)`` pairs), no pair of :func:`disjoint_pairs` meets at an offset full validation
    did not accept, every table and index array is on its natural alignment (``natural``:
    ``(argument, mask)``) and, with ``align``, the arguments ``aligned`` are on ``align`` bytes.
    A pair validated apart (its offset outside the extents' meeting range) needs no exception.
    ``ref(i)``: how the expressions name argument ``i``'s pointer."""
    terms = [f"{ref(o)} == {ref(own)}" for o, own in same_view]
    for o, j, lo, hi, v in pairs:
        lo, hi, v = int(lo), int(hi), int(v)
        terms.append(f"not {lo} < {ref(j)} - {ref(o)} < {hi}" if not lo < v < hi else
                     f"not ({lo} < (d := {ref(j)} - {ref(o)}) < {hi} and d != {v})")
    if align and aligned:
        if align & (align - 1):
            raise ValueError(f"align: {align} is not a power of two")
        natural = tuple(natural) + tuple((i, int(align) - 1) for i in aligned)
    term = aligned_term(natural, ref)
    if term:
        terms.append(term)
    return terms


def aligned_term(masks, ref=lambda i: f"p[{i}]") -> str:
    """One expression, true when every ``(argument, mask)`` of ``masks`` has its pointer on that
    alignment (masks are alignments less one: powers of two less one); '' when there is nothing to
    check. One mask per group of arguments, in one term."""
    groups: dict[int, list[int]] = {}
    for i, mask in masks:
        groups.setdefault(int(mask), []).append(i)
    masked = [f"({' | '.join(ref(i) for i in dict.fromkeys(args))}) & {mask}"
              for mask, args in groups.items() if mask]
    return f"not ({' | '.join(masked)})" if masked else ""


def preferred_predicate(masks: tuple):
    """``fits(ptrs) -> bool`` for a template whose build is not the one its signature prefers (its
    first call was off the preferred builds' alignment), or None when no build is preferred to it:
    whether a call's pointers are on every ``(argument, mask)`` of the least demanding preferred
    build (an address on one alignment is on every smaller one). Such a call is declined, so that
    full validation makes the preferred template, which then serves the aligned calls of the
    signature; without it a misaligned first call kept every later aligned one on its build."""
    term = aligned_term(masks)
    return generated("fits", "p", f"    return {term}\n") if term else None


def generated(name: str, params: str, body: str, namespace: dict | None = None):
    """A function compiled from ``body`` (statements, indented by four spaces) over integers and
    the names in ``namespace``: checks written out as straight-line Python once per template, as
    ``dataclasses`` writes its methods. A loop over the same tuples was a tenth of a one-call
    function's host time (docs/design.md)."""
    namespace = dict(namespace or {})
    exec(f"def {name}({params}):\n{body}", namespace)  # noqa: S102 - integers and the given names only
    return namespace[name]


def array_checks(name: str, ref: str, entry: tuple, several: bool, namespace: dict) -> tuple[str, str]:
    """``(condition, statements)`` that a generated repeat path (``generated``) runs on the CuPy
    array argument ``name`` of signature entry ``entry``, ``(shape, strides, dtype, device)``
    (strides None: C-contiguous): the condition holds when the argument is a CuPy array of that
    shape, layout and dtype (the dtype by identity: an equal dtype of another identity takes the
    signature's dictionary instead); the statements set ``ref`` to its data pointer, returning
    None from a device other than ``device`` (only where the process sees ``several``)."""
    shape, strides, dtype, device = entry
    namespace[f"{ref}_dtype"] = dtype
    layout = (f"{name}._c_contiguous" if strides is None else
              f"not {name}._c_contiguous and {name}.strides == {tuple(map(int, strides))!r}")
    condition = (f"type({name}) is nd and {layout} and {name}.shape == {tuple(map(int, shape))!r} "
                 f"and {name}.dtype is {ref}_dtype")
    statements = f"    d = {name}.data\n"
    if several:
        statements += f"    if d.device_id != {int(device)}:\n        return None\n"
    return condition, statements + f"    {ref} = d.ptr\n"


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


def signature_checks(names: tuple, sig: tuple, own_input: dict, several: bool, namespace: dict,
                     special=None) -> tuple[str, str]:
    """``(condition, statements)`` of a generated repeat path (``generated``) for the arguments
    ``names`` of signature ``sig``: each entry None (absent), True (an output that is its own input,
    ``own_input``: output index -> input index) or an array's ``(shape, dtype, device)`` (with its
    strides before the dtype when not C-contiguous: ``array_checks``). The statements set ``p0``,
    ``p1``, ... to the pointers, inputs before the outputs that name them. ``special(i, name,
    entry)``: ``(condition, statement)`` for an entry of the caller's own kind, or None."""
    conds, reads = [], []
    for i, (name, entry) in enumerate(zip(names, sig)):
        own = None if special is None else special(i, name, entry)
        if own is not None:
            cond, read = own
        elif entry is None:
            cond, read = f"{name} is None", f"    p{i} = 0\n"
        elif entry is True:
            cond, read = f"{name} is {names[own_input[i]]}", f"    p{i} = p{own_input[i]}\n"
        else:  # (shape, dtype, device), or (shape, strides, dtype, device) when not C-contiguous
            full = entry if len(entry) == 4 else (entry[0], None, entry[1], entry[2])
            cond, read = array_checks(name, f"p{i}", full, several, namespace)
        conds.append(cond)
        reads.append(read)
    order = [i for i in range(len(names)) if sig[i] is not True] + [i for i in range(len(names)) if sig[i] is True]
    return " and ".join(conds), "".join(reads[i] for i in order)


def address_predicate(same_view: tuple, pairs: tuple, natural: tuple, aligned: tuple = (), align: int = 0):
    """``ok(ptrs) -> bool``: :func:`address_terms` as one expression."""
    terms = address_terms(same_view, pairs, natural, aligned, align)
    return generated("ok", "p", f"    return {' and '.join(terms) or 'True'}\n")


class LastPath:
    """A thread's last generated repeat path of a one-call function (the fused ops'; rope.py keeps
    its own, compared by identity): the template's function (``_RopeTemplate.one_call``), the
    options it serves (plain values whose types the caller checked, compared with ``==``) and
    where it launches: ``go(prefix, handle)``, the plan's ``Launcher.launch`` with a raw stream
    handle, on ``device``. It holds no array."""

    __slots__ = ("one_call", "options", "go", "device")

    def __init__(self, one_call, options: tuple, go, device) -> None:
        self.one_call, self.options, self.go, self.device = one_call, options, go, device


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

    def signature(self, arrays: tuple) -> tuple | None:
        return signature(arrays)

    def validate(self, arrays: tuple, scalar: int):
        """Every check of a call; returns a template, or raises TypeError/ValueError/
        NotImplementedError naming the argument before anything is launched or written."""
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

    def bind(self, arrays: tuple, scalar: int) -> Call:
        """Check and write ``arrays`` into the block, remembering nothing about them.

        A signature keeps the templates validated for it, widest first: a call off the first one's
        alignment adds a narrower template beside it rather than replacing it, so one misaligned
        call never moves later aligned ones to a narrower build (``with_template``)."""
        return self._bind(arrays, scalar)[0]

    def _bind(self, arrays: tuple, scalar: int) -> tuple:
        """``bind``, and the signature it found (None: not every argument is a CuPy array)."""
        sig = self.op.signature(arrays)
        tmpls = self.templates.get(sig, ()) if sig is not None else ()
        for tmpl in tmpls:
            call = tmpl.bind(self, arrays, scalar, tmpl.pointers(arrays))
            if call is not None:
                return call, sig
        tmpl = self.op.validate(arrays, scalar)  # raises on a real problem
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


def bind_once(cache: dict, key, arrays: tuple, scalar: int, ptrs, plan_for, *plan_args):
    """The one-call functions' path: ``(plan, call)`` for ``arrays``, bound without remembering
    them. ``cache`` maps a call's key (its signature and options; None: not cacheable) to the
    plan and template that bound it last: a hit runs only the template's address checks (on
    ``ptrs``, the arrays' data pointers, when the caller has them). On a miss, or when the
    template declines, ``plan_for(*plan_args)`` gives the plan (validating the call) and its core
    binds it (raising on a real problem)."""
    try:
        hit = cache.get(key) if key is not None else None
    except TypeError:  # an unhashable option: full validation names it
        key = hit = None
    if hit is not None:
        plan, tmpl = hit
        call = tmpl.bind(plan._core, arrays, scalar, tmpl.pointers(arrays) if ptrs is None else ptrs)
        if call is not None:
            return plan, call
    # The plan comes from full validation, not from the hit: a declined call (an output that is
    # no longer its input's view, say) may belong to another plan.
    plan = plan_for(*plan_args)
    call = plan._core.bind(arrays, scalar)
    # A call the remembered template declined for its alignment alone (the same plan served it with
    # a narrower one) leaves the entry as it was: aligned calls keep the wider build.
    if key is not None and (hit is None or hit[0] is not plan or not narrower(call.template, hit[1])):
        remember(cache, key, (plan, call.template), ONE_CALL_SIGNATURES)
    return plan, call
