"""``rope_rtc.jax``'s functions: the CuPy API's arguments and numerics, on JAX arrays, inside
``jax.jit``, differentiable.

Each function checks its arguments at trace time (``checks``), then stages out the kernel
(``kernel_call``) for CUDA and the jnp reference (``jnp_rope``) for every other platform, chosen
when XLA lowers the program for its platform (``jax.lax.platform_dependent``): one program runs
on a GPU machine and on a machine without one. Where a kernel may run, gradients are
``jax.custom_vjp`` rules: the VJP of a rotation is the inverse rotation, so the backward of RoPE
is the same kernel (or reference) with ``inverse`` flipped, q and k in one launch; reverse mode
to any order (a custom rule, because JAX has no derivative of a buffer callback), not forward
mode, which JAX refuses for a custom VJP. "Where a kernel may run" is decided in the process (a
GPU and CuPy present), not by the device a program runs on. Where none can (``backend="jnp"``,
or no usable GPU) the jnp version runs alone and JAX differentiates it in every mode.
"""

from __future__ import annotations

from functools import partial
import jax

from . import jnp_rope, kernel_call
from .backward import cache_cotangents
from .checks import CacheCall, RopeCall, check_cache, check_rope


def _jnp_only(backend: str) -> bool:
    """Whether a call runs the jnp version alone: ``backend="jnp"``, or "auto" where rope_rtc
    cannot launch kernels. JAX then differentiates it itself, in every mode (jvp, hessian), and
    the custom VJP below, which a kernel needs, is left out."""
    if backend == "jnp":
        return True
    reason = kernel_call.unusable_reason()
    if backend == "auto" and reason is not None:
        kernel_call.warn_reference_once(reason)
        return True
    return False


def _staged(backend: str, kernel, reference, *args):
    """``kernel(*args)`` where XLA runs the program on CUDA, ``reference(*args)`` elsewhere (a
    call that may stage a kernel: ``_jnp_only`` is False); ``backend="nvrtc"`` stages the
    kernel alone (docs/jax.md)."""
    if backend == "nvrtc":
        if kernel_call.unusable_reason() is not None:
            kernel_call.require_kernels()  # as the CuPy API's backend="nvrtc": the library's error, and the way out
        return jax.lax.platform_dependent(*args, cuda=kernel)
    return jax.lax.platform_dependent(*args, cuda=kernel, default=reference)


# -- RoPE of q and k (apply_rope, apply_rope_qk) -------------------------------------------------

def _rope_forward(call: RopeCall, q, k, tables: tuple, index: tuple):
    return _staged(call.backend, partial(kernel_call.rope, call), partial(jnp_rope.rope, call), q, k, tables, index)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope(call: RopeCall, q, k, tables: tuple, index: tuple):
    return _rope_forward(call, q, k, tables, index)


def _rope_fwd(call: RopeCall, q, k, tables: tuple, index: tuple):
    # The backward needs no primal value: only the tables and positions. Both rules call the op
    # itself, not its kernel, so a gradient of a gradient (reverse over reverse) finds this rule
    # again where it would need the JVP of a buffer callback, which JAX has none of.
    return _rope(call, q, k, tables, index), (tables, index)


def _any_rope(call: RopeCall, q, k, tables: tuple, index: tuple):
    """The op as staged for its backend: the jnp version alone, or the op with its VJP."""
    if _jnp_only(call.backend):
        return jnp_rope.rope(call, q, k, tables, index)
    return _rope(call, q, k, tables, index)


def _rope_bwd(call: RopeCall, residuals: tuple, cotangents: tuple):
    tables, index = residuals
    gq, gk = cotangents
    dq, dk = _rope(call.inverted(), gq, gk, tables, index)
    return dq, dk, None, None  # no gradient for the tables (constants of every model) or positions


_rope.defvjp(_rope_fwd, _rope_bwd)


def _flat(result, shape):
    return result if shape is None else result.reshape(shape)


def apply_rope_qk(q, k, cos=None, sin=None, *, positions=None, offset=0, cu_seqlens=None, layout: str | None = None,
                  interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0,
                  inverse: bool = False, cos_sin_cache=None, head_dim: int | None = None, backend: str = "auto",
                  in_place: bool = True) -> tuple[jax.Array, jax.Array]:
    """Rotate q and k, inside ``jax.jit`` or not, differentiably: :func:`rope_rtc.apply_rope_qk`
    on JAX arrays.

    Parameters
    ----------
    q, k : jax.Array
        float32, float16 or bfloat16 in ``layout`` (``"bshd"``, ``"bhsd"``, ``"sbhd"`` or ``"thd"``;
        a 4-d array needs it named), or flat ``[T, H * head_dim]`` with ``head_dim``. k may have
        fewer heads (GQA/MQA).
    cos, sin : array
        float32 ``[max_positions, rotary_dim // 2]`` (:func:`rope_rtc.rope_tables`, either
        numerics); NumPy arrays become constants of the program.
    cos_sin_cache : array, optional
        Instead of cos and sin: the engines' float32 ``[max_positions, rotary_dim]`` table (cos,
        then sin, in each row), read as it is.
    positions : int array, optional
        One position per token: ``[B, S]``, or ``[T]`` for ``"thd"``.
    offset : int or int array
        Positions ``offset + s``. A Python int is part of the program (one compilation per value);
        an array (0-d: every sequence; ``[B]`` or ``[num_seqs]``: one start each) is an input, as a
        decode step's cache length should be.
    cu_seqlens : int array ``[num_seqs + 1]``, optional
        ``"thd"`` only: packed sequences, positions restarting at each.
    interleaved, rotary_dim, rotary_offset, inverse, head_dim
        As :func:`rope_rtc.apply_rope_qk`.
    backend : {"auto", "nvrtc", "jnp"}
        ``"auto"``: the kernel where XLA runs the program on CUDA and rope_rtc can launch kernels,
        the jnp reference elsewhere (where rope_rtc cannot launch kernels at all, with a one-time
        warning). ``"nvrtc"``: the kernel only (``NoDeviceError`` where rope_rtc cannot launch
        kernels; lowering for another platform fails). ``"jnp"``: the reference everywhere, fused
        by XLA like any jnp code.
    in_place : bool
        True: the results take q's and k's buffers (``input_output_aliases``). Free when the
        inputs are donated (``jax.jit(..., donate_argnums=...)``) or no longer needed (q and k in a
        model); XLA copies an input first where it is still needed. False: the results get new
        buffers (never a copy; one more buffer of each live at a time).

    Returns
    -------
    (q, k) : jax.Array
        Rotated, in the inputs' shapes and dtypes.

    Raises
    ------
    TypeError, ValueError
        At trace time, naming the argument, as the CuPy API raises them.
    rope_rtc.errors.NoDeviceError
        ``backend="nvrtc"`` where rope_rtc cannot launch kernels.

    Notes
    -----
    ``jax.grad`` works: the backward is the inverse rotation of the cotangents (q and k in one
    launch on the GPU). No gradient flows to the tables or positions. Device positions are not
    read back: one outside the table gives NaN for its token. Under ``jax.vmap`` the kernel runs
    once per element of the mapped axis.
    """
    call, q, k, tables, index, flat = check_rope(("q", "k"), q, k, cos, sin, cos_sin_cache, positions, offset,
                                                 cu_seqlens, layout, interleaved, rotary_dim, rotary_offset, inverse,
                                                 head_dim, backend, in_place)
    if k is None:
        raise TypeError("k: expected an array (use rope_rtc.jax.apply_rope for a single tensor)")
    q_rot, k_rot = _any_rope(call, q, k, tables, index)
    return _flat(q_rot, flat[0]), _flat(k_rot, flat[1])


def apply_rope(x, cos=None, sin=None, *, positions=None, offset=0, cu_seqlens=None, layout: str | None = None,
               interleaved: bool = False, rotary_dim: int | None = None, rotary_offset: int = 0, inverse: bool = False,
               cos_sin_cache=None, head_dim: int | None = None, backend: str = "auto",
               in_place: bool = True) -> jax.Array:
    """Rotate one tensor: :func:`apply_rope_qk`'s arguments with ``x`` for ``q``. Returns the
    rotated array."""
    call, x, _, tables, index, flat = check_rope(("x", "k"), x, None, cos, sin, cos_sin_cache, positions, offset,
                                                 cu_seqlens, layout, interleaved, rotary_dim, rotary_offset, inverse,
                                                 head_dim, backend, in_place)
    x_rot, _ = _any_rope(call, x, None, tables, index)
    return _flat(x_rot, flat[0])


# -- RoPE fused with the paged KV-cache write ----------------------------------------------------

def _cache_forward(call: CacheCall, q, k, v, tables, index, slots, caches, scales):
    return _staged(call.rope.backend, partial(kernel_call.rope_and_cache, call),
                   partial(jnp_rope.rope_and_cache, call), q, k, v, tables, index, slots, caches, scales)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rope_cache(call: CacheCall, q, k, v, tables, index, slots, caches, scales):
    return _cache_forward(call, q, k, v, tables, index, slots, caches, scales)


def _rope_cache_fwd(call: CacheCall, q, k, v, tables, index, slots, caches, scales):
    return _rope_cache(call, q, k, v, tables, index, slots, caches, scales), (tables, index, slots)


def _rope_cache_bwd(call: CacheCall, residuals: tuple, cotangents: tuple):
    tables, index, slots = residuals
    gq, gk, gk_cache, gv_cache = cotangents
    gk, gv, caches = cache_cotangents(call, gk, gk_cache, gv_cache, slots)
    dq, dk = _rope(call.rope.inverted(), gq, gk, tables, index)
    return dq, dk, gv, None, None, None, caches, None


_rope_cache.defvjp(_rope_cache_fwd, _rope_cache_bwd)


def rope_and_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, *, kv_layout: str = "nhd",
                   kv_cache_dtype: str = "auto", k_scale=None, v_scale=None, offset=0, cu_seqlens=None,
                   interleaved: bool = False, rotary_dim: int | None = None, backend: str = "auto",
                   in_place: bool = True) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Rotate q and k and write the rotated k and v into a paged KV cache:
    :func:`rope_rtc.rope_and_cache` on JAX arrays, inside ``jax.jit`` or not.

    Parameters
    ----------
    q, k, v, cos, sin, positions, slot_mapping, kv_layout, kv_cache_dtype, interleaved, rotary_dim
        As :func:`rope_rtc.rope_and_cache` (``positions`` may be None with ``offset`` /
        ``cu_seqlens``, as in :func:`apply_rope_qk`). Slots are not read back: a negative slot, or
        one past the cache, writes nothing.
    k_cache, v_cache : jax.Array
        The caches; the returned caches take their buffers (``input_output_aliases``). Donate
        them (``jax.jit(..., donate_argnums=...)``, or keep them in a donated state): XLA then
        writes the new entries where the caches lie, and copies nothing. A cache the caller still
        holds is copied by XLA first, as for any functional update.
    k_scale, v_scale : float or float32 array of one element
        FP8 caches only (``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``, caches of uint8).
    offset, cu_seqlens, backend, in_place
        As :func:`apply_rope_qk` (``in_place`` for q and k; the caches are always aliased).

    Returns
    -------
    (q, k, k_cache, v_cache) : jax.Array

    Notes
    -----
    ``jax.grad`` works: q's and k's cotangents go back through the inverse rotation (k's gathers
    its cache entries' cotangents first), v's are its entries' cotangents, and the caches'
    are theirs with the written entries zeroed. An FP8 cache holds integers: nothing flows back
    through its entries.
    """
    call, arrays = check_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, kv_layout,
                               kv_cache_dtype, k_scale, v_scale, offset, cu_seqlens, interleaved, rotary_dim, backend,
                               in_place)
    if _jnp_only(call.rope.backend):
        return jnp_rope.rope_and_cache(call, *arrays)
    return _rope_cache(call, *arrays)
