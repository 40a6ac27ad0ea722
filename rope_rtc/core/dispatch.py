"""The one-call functions' dispatch, one mechanism for every op (docs/design.md).

An op declares a :class:`OneCall`: how a call is validated and keyed to a plan, how a plan is
made, and (where it differs from the default) the call's signature, its positions check and its
repeat path. The one-call function then does two things on device arrays::

    if ONE_CALL.launched(options, stream, *arrays, scalar):   # the thread's last path
        return outputs
    ONE_CALL.run(options, plain, arrays, scalar, handle, device)  # everything else

and the core does the rest, per thread (a plan's argument block is written on every call, so
plans are never shared between threads):

- **the last path**: the repeat path (the template's generated check-and-write,
  ``RopeTemplate.one_call``) of the signature this thread bound last, and the options it serves,
  compared with ``==`` (an op passes options of the types its validation accepts as they are:
  ``plain``). An engine calls one signature layer after layer; new arrays of that signature take
  one generated function and one launch.
- **templates per signature** (:func:`bind_once`): a known signature runs only its template's
  address checks.
- **plans per key**: the op's ``validate`` gives the call's request and the key of the plan that
  serves it (its fixed properties); a plan is made once per key, and binds from the request (a
  cold call is validated once, for an op whose plan ``takes_request``).

None of it holds a caller's array: a one-call function remembers nothing about its arrays.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from .launcher import CURRENT_STREAM, stream_handle
from .prepared import cupy_ndarray, narrower, signature
from .recent import remember

# Signatures (and plans) one thread keeps for a one-call function.
ONE_CALL_SIGNATURES = 64


class LastPath:
    """A thread's last repeat path: the generated function (``fn(*arrays, scalar)`` -> launch prefix,
    or None to decline), the options it serves and where it launches: ``go(prefix, handle)``, the
    plan's ``Launcher.launch``, on ``device``. It holds no array."""

    __slots__ = ("one_call", "options", "go", "device")

    def __init__(self, one_call, options, go, device) -> None:
        self.one_call, self.options, self.go, self.device = one_call, options, go, device


# Before a thread's first repeat path: options equal to no call's.
NO_LAST = LastPath(None, object(), None, None)


class ThreadState(threading.local):
    """One thread's state of one :class:`OneCall`."""

    def __init__(self) -> None:
        self.last = NO_LAST
        self.by_signature: dict = {}  # (options, signature) -> (plan, template) that bound it last
        self.by_key: dict = {}  # plan key -> plan


def signature_with_own(own_input: tuple) -> Callable:
    """The default ``signature_of``: each argument's ``(shape, strides, dtype, device)`` (None when
    not every argument is a CuPy array) and, for each ``(output, input)`` index pair of
    ``own_input``, whether the output is its input; no pointers."""
    def signature_of(arrays: tuple) -> tuple:
        sig = signature(arrays)
        if sig is None:
            return None, None
        return (sig, tuple([arrays[o] is arrays[i] for o, i in own_input])), None
    return signature_of


def split_offset(offset) -> tuple[int, object]:
    """``(int offset, offset array or None)`` of an ``offset`` argument (anything that is not an
    int is left for validation to accept as an array or reject)."""
    if type(offset) is int:
        return offset, None
    if offset is None:
        return 0, None
    if isinstance(offset, np.integer):
        return int(offset), None
    if isinstance(offset, int) and type(offset) is not bool:  # an int subclass (an IntEnum) is its value
        return int(offset), None
    return 0, offset  # an array (or a bool, which validation refuses)


def signature_and_pointers(arrays: tuple, own_input: dict) -> tuple:
    """``(signature, pointers)`` of a call's arguments when all are CuPy arrays (or None), else
    ``(None, None)``: the repeat path's signature (``prepared.repeat_signature``: each argument's
    shape, dtype and device, with its strides when it is not C-contiguous; None when absent;
    True for an output that is its input, ``own_input``: output index -> input index) and the
    data pointers (0 when absent), each array read once."""
    nd = cupy_ndarray()
    if not hasattr(nd, "_c_contiguous"):  # a CuPy without the flag: every call validated in full
        return None, None
    entries, ptrs = [], []
    for i, a in enumerate(arrays):
        if a is None:
            entries.append(None)
            ptrs.append(0)
            continue
        if type(a) is not nd:
            return None, None
        j = own_input.get(i)
        if j is not None and a is arrays[j]:
            entries.append(True)
            ptrs.append(ptrs[j])
            continue
        d = a.data
        entries.append((a.shape, a.dtype, d.device_id) if a._c_contiguous else (a.shape, a.strides, a.dtype,
                                                                                  d.device_id))
        ptrs.append(d.ptr)
    return tuple(entries), tuple(ptrs)


def default_repeat_path(plan, call, arrays: tuple, sig):
    """The plan's quick path for new arrays of the signature its template bound (``Op.quick_path``)."""
    quick = plan._core.op.quick_path(call.template, arrays)
    return None if quick is None else quick[0]


class OneCall:
    """One op's one-call dispatch (see the module's docstring).

    - ``validate(arrays, scalar, options) -> (request, plan_key)``: the call checked (raising
      TypeError/ValueError/NotImplementedError naming the argument) and the key of the plan that
      serves it (None: a plan for this call alone). ``request`` may be None when the plan's core
      validates the call itself.
    - ``new_plan(request, arrays, scalar, options, device)``: a plan ready to launch: its
      ``_core`` the :class:`~rope_rtc.core.prepared.Prepared` that binds and launches, its
      ``_check_positions`` set, and holding none of the call's arrays.
    - ``takes_request``: whether the plan's core binds from ``request`` (validation once).
    - ``signature_of(arrays) -> (signature, pointers)``: what a call's templates are found by
      (None: not cached), and the arrays' data pointers when it reads them anyway (or None).
    - ``check_positions(plan, arrays, scalar, options)``: for plans made with
      ``ROPE_RTC_CHECK_POSITIONS=1`` (``plan._check_positions``), before every launch; such calls
      never take the last path.
    - ``repeat_path(plan, call, arrays, signature)``: the generated function the last path runs.
    """

    def __init__(self, validate: Callable, new_plan: Callable, *, takes_request: bool = False,
                 signature_of: Callable | None = None, own_input: tuple = (), check_positions: Callable | None = None,
                 repeat_path: Callable = default_repeat_path) -> None:
        self._validate, self._new_plan, self._takes_request = validate, new_plan, takes_request
        self._signature_of = signature_of or signature_with_own(own_input)
        self._check_positions = check_positions
        self._repeat_path = repeat_path
        self._local = ThreadState()

    def thread(self) -> ThreadState:
        """This thread's state."""
        return self._local

    def forget(self) -> None:
        """Forget every thread's plans and paths (the next calls are validated and planned anew)."""
        self._local = ThreadState()

    def launched(self, options: tuple, stream, *arrays) -> bool:
        """Launch a call through the thread's last path when it serves ``options`` and the
        generated function accepts ``arrays`` (its signature, alignment and overlap checks; the
        last entry the scalar); False otherwise (the caller goes on to :meth:`run`, whose checks
        say what is wrong). ``options``: plain values only (the op checked their types). The
        stream is resolved once the call is accepted: a bad one raises after a block write that
        the next call redoes."""
        last = self._local.last
        if options != last.options:
            return False
        prefix = last.one_call(*arrays)
        if prefix is None:
            return False
        # The current stream looked up here, not through stream_handle: this is every repeated call's path.
        last.go(prefix, CURRENT_STREAM[0](last.device).ptr if stream is None and CURRENT_STREAM[0] is not None
                else stream_handle(stream, last.device))
        return True

    def launched_on(self, options: tuple, handle: int, *arrays) -> bool:
        """:meth:`launched` on a raw stream ``handle`` the caller has resolved (for an output it
        allocated on that stream)."""
        last = self._local.last
        if options != last.options:
            return False
        prefix = last.one_call(*arrays)
        if prefix is None:
            return False
        last.go(prefix, handle)
        return True

    def run(self, options: tuple, plain: bool, arrays: tuple, scalar: int, handle: int, device: int,
            remember_last: bool = True):
        """Bind and launch a call on the raw stream ``handle`` of ``device``: the signature's
        template, or validation and the plan of the call's key; then the positions check of a plan
        that has it, or the thread's last path for the next calls (``plain`` options only, and
        ``remember_last``). Returns ``(plan, call)``."""
        state = self._local
        sig, ptrs = self._signature_of(arrays)
        key = (options, sig) if plain and sig is not None else None
        plan, call = bind_once(state.by_signature, key, arrays, scalar, ptrs, self.plan_for, arrays, scalar,
                               options, device)
        if plan._check_positions:
            self._check_positions(plan, arrays, scalar, options)
        elif key is not None and remember_last:
            fn = self._repeat_path(plan, call, arrays, sig)
            if fn is not None:
                state.last = LastPath(fn, options, plan._core.launcher.launch, plan.device)
        if call.prefix is not None:
            plan._core.launcher(call.prefix, handle)
        return plan, call

    def remember_last(self, options: tuple, fn, plan) -> None:
        """Make ``fn`` (a generated repeat path of ``plan``'s) the thread's last path for ``options``."""
        self._local.last = LastPath(fn, options, plan._core.launcher.launch, plan.device)

    def plan_for(self, arrays: tuple, scalar: int, options: tuple, device: int) -> tuple:
        """``(plan, request)``: the call validated, and the thread's plan for its key (made once)."""
        request, plan_key = self._validate(arrays, scalar, options)
        by_key = self._local.by_key
        plan = by_key.get(plan_key) if plan_key is not None else None
        if plan is None:
            plan = self._new_plan(request, arrays, scalar, options, device)
            if plan_key is not None:
                remember(by_key, plan_key, plan, ONE_CALL_SIGNATURES)
        return plan, (request if self._takes_request else None)


def bind_once(cache: dict, key, arrays: tuple, scalar: int, ptrs, plan_for, *plan_args):
    """``(plan, call)`` for ``arrays``, bound without remembering them. ``cache`` maps a call's key
    (its options and signature; None: not cacheable) to the plan and template that bound it
    last: a hit runs only the template's address checks (on ``ptrs``, the arrays' data pointers,
    when the caller has them). On a miss, or when the template declines, ``plan_for(*plan_args)``
    gives ``(plan, request)``, validating the call, and the plan's core binds it (raising on a
    real problem) from that request when there is one (not None), so that a cold call is
    validated once."""
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
    plan, request = plan_for(*plan_args)
    call = plan._core.bind(arrays, scalar, request)
    # A call the remembered template declined for its alignment alone (the same plan served it with
    # a narrower one) leaves the entry as it was: aligned calls keep the wider build.
    if key is not None and (hit is None or hit[0] is not plan or not narrower(call.template, hit[1])):
        remember(cache, key, (plan, call.template), ONE_CALL_SIGNATURES)
    return plan, call
