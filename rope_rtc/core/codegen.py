"""The Python the core writes per template: repeat paths and address predicates.

A template's checks are known only once full validation has run (its shapes, strides, dtypes,
extents and alignments are integers then), and a loop over tuples of them cost a repeated call
more than the checks themselves. So each template writes them out once as straight-line Python,
as ``dataclasses`` writes its methods. Everything written that way goes through
:func:`generated`, the one place that compiles Python source in the library: it files each
function's source with :mod:`linecache` under a readable name that is unique per function
(``<rope_rtc generated: RopePlan repeat path (q bfloat16[8,1,32,128], ...) #3>``), so a
traceback through one shows the line that failed, and drops that entry when the function goes.

The other functions here write the pieces such a function is made of: the checks of a call's
arrays against a signature (:func:`signature_checks`), and the address checks of a template
(:func:`address_terms`).
"""

from __future__ import annotations

import itertools
import linecache
import weakref

FILE_PREFIX = "<rope_rtc generated: "

_numbers = itertools.count(1)


def generated(name: str, params: str, body: str, namespace: dict | None = None, *, title: str = "",
              qualname: str = ""):
    """A function compiled from ``body`` over integers and the names in ``namespace``.

    Parameters
    ----------
    name : str
        The function's name (an identifier: what a traceback prints after "in").
    params : str
        Its parameter list, as written between the parentheses.
    body : str
        Its statements, indented by four spaces.
    namespace : dict, optional
        The names the body uses besides its parameters and builtins (copied).
    title : str, optional
        What the function is, for its file name: a traceback through it reads
        ``File "<rope_rtc generated: {title} #n>"``, n numbering the functions of this process.
    qualname : str, optional
        Its ``__qualname__`` (default ``name``), such as ``"RopePlan.repeat_path"``.

    Returns
    -------
    function
        The compiled function, whose source ``linecache`` serves while the function lives.
    """
    source = f"def {name}({params}):\n{body}"
    filename = f"{FILE_PREFIX}{title or name} #{next(_numbers)}>"
    code = compile(source, filename, "exec")
    scope = dict(namespace or {})
    exec(code, scope)  # noqa: S102 - source written here from integers and the names given
    fn = scope[name]
    fn.__qualname__ = qualname or name
    fn.__code__ = fn.__code__.replace(co_qualname=fn.__qualname__)
    # mtime None: linecache.checkcache keeps the entry (there is no file to compare it with).
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    weakref.finalize(fn, linecache.cache.pop, filename, None)
    return fn


def arrays_title(names: tuple, sig: tuple) -> str:
    """A short description of signature ``sig`` (``prepared.repeat_signature``) of the arguments
    ``names``, for a generated function's file name: each present argument's dtype and shape
    (``q bfloat16[8,1,32,128]``), ``k_out=k`` for an output that is its own input."""
    parts = []
    for name, entry in zip(names, sig):
        if entry is None:
            continue
        if entry is True:
            parts.append(f"{name}=in place")
        elif isinstance(entry, tuple) and len(entry) >= 3:
            shape, dtype = entry[0], entry[-2]
            parts.append(f"{name} {getattr(dtype, 'name', dtype)}[{','.join(map(str, shape))}]")
        else:
            parts.append(name)
    return ", ".join(parts)


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


def address_terms(same_view: tuple, pairs: tuple, natural: tuple, aligned: tuple = (), align: int = 0,
                  ref=lambda i: f"p[{i}]") -> list[str]:
    """A template's address checks on a call's pointers ``p``, as Python expressions that all
    hold when the call may be bound.

    True when every written argument validated as its input's view still is (``same_view``:
    ``(o, own)`` pairs), no pair of :func:`prepared.disjoint_pairs` meets at an offset full validation
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


def address_predicate(same_view: tuple, pairs: tuple, natural: tuple, aligned: tuple = (), align: int = 0,
                      *, owner: str = "template"):
    """``addresses_ok(ptrs) -> bool``: :func:`address_terms` as one expression (``owner``: whose
    checks they are, for the function's file name and qualified name)."""
    terms = address_terms(same_view, pairs, natural, aligned, align)
    return generated("addresses_ok", "p", f"    return {' and '.join(terms) or 'True'}\n",
                     title=f"{owner} address checks", qualname=f"{owner}.addresses_ok")


def preferred_predicate(masks: tuple, *, owner: str = "template"):
    """``fits_preferred(ptrs) -> bool`` for a template whose build is not the one its signature prefers (its
    first call was off the preferred builds' alignment), or None when no build is preferred to it:
    whether a call's pointers are on every ``(argument, mask)`` of the least demanding preferred
    build (an address on one alignment is on every smaller one). Such a call is declined, so that
    full validation makes the preferred template, which then serves the aligned calls of the
    signature; without it a misaligned first call kept every later aligned one on its build."""
    term = aligned_term(masks)
    if not term:
        return None
    return generated("fits_preferred", "p", f"    return {term}\n", title=f"{owner} preferred build's alignment",
                     qualname=f"{owner}.fits_preferred")


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
    if not several:
        return condition, f"    {ref} = {name}.data.ptr\n"
    return condition, (f"    d = {name}.data\n    if d.device_id != {int(device)}:\n        return None\n"
                       f"    {ref} = d.ptr\n")


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
