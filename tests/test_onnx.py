"""rope_rtc.onnx.rotary_embedding on the CPU (NumPy backend): every attribute combination, float32
and float16, 3-d and 4-d X, with and without position_ids, against the ``onnx`` package's
reference evaluator and within the general API's bound of the float64 reference; and its
errors."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fakes import HostTensor
from onnx_cases import CASES, case_inputs, canonical, float64_reference, onnx_reference
from rope_rtc.errors import UnsupportedLayoutError
from rope_rtc.onnx import rotary_embedding
from rope_rtc.reference import assert_rope_close


def _tolerance(dtype) -> float:
    return {np.dtype(np.float32): 4e-6, np.dtype(np.float16): 8e-3}[np.dtype(dtype)]


@pytest.mark.parametrize("dtype,rank,interleaved,rotary_dim,with_ids", CASES)
def test_matches_the_onnx_reference_evaluator(dtype, rank, interleaved, rotary_dim, with_ids):
    pytest.importorskip("onnx")
    inputs = case_inputs(dtype, rank, rotary_dim, with_ids)
    before = inputs["X"].copy()
    y = rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"], interleaved=interleaved,
                         rotary_embedding_dim=rotary_dim, num_heads=3 if rank == 3 else 0, backend="numpy")
    assert y.shape == inputs["X"].shape and y.dtype == inputs["X"].dtype
    np.testing.assert_array_equal(inputs["X"], before)  # out of place: X untouched
    want = onnx_reference(inputs, interleaved, rotary_dim, rank)
    # ONNX's reference rounds after each multiply and add in X's dtype; ours once: a few ulps apart.
    np.testing.assert_allclose(y.astype(np.float64), want.astype(np.float64), rtol=0, atol=_tolerance(dtype))
    ref, xc = float64_reference(inputs, interleaved, rotary_dim, rank)
    assert_rope_close(canonical(y, rank), ref, xc, interleaved=bool(interleaved), rotary_dim=rotary_dim or None,
                      dtype=np.dtype(dtype))


def test_in_place_and_given_output():
    inputs = case_inputs("float32", 3, 0, True, seed=3)
    want = rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"], num_heads=3, backend="numpy")
    out = np.full_like(inputs["X"], np.nan)
    assert rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"], num_heads=3, out=out,
                            backend="numpy") is out
    np.testing.assert_array_equal(out, want)
    x = inputs["X"].copy()
    rotary_embedding(x, inputs["cos"], inputs["sin"], inputs["ids"], num_heads=3, out=x, backend="numpy")
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("shape", [(0, 3, 4, 16), (2, 0, 48), (0, 5, 48)])
def test_an_input_with_no_tokens_gives_an_empty_output(shape):
    # A 3-d X with no tokens was refused: its zero strides read as a hidden axis that is not contiguous.
    rank, (B, S) = len(shape), ((shape[0], shape[2]) if len(shape) == 4 else shape[:2])
    cos, sin = np.ones((10, 8), np.float32), np.zeros((10, 8), np.float32)
    X = np.zeros(shape, np.float32)
    y = rotary_embedding(X, cos, sin, np.zeros((B, S), np.int64), num_heads=3 if rank == 3 else 0, backend="numpy")
    assert y.shape == shape and y.dtype == X.dtype


@pytest.mark.parametrize("shape, num_heads", [((1, 2, 3, 0), 0), ((2, 3, 0), 4)])
def test_an_input_with_no_channels_gives_an_empty_output(shape, num_heads):
    # head_size 0 was refused with "rotary_dim: must be a positive even number", the general API's
    # name; the operator's reference gives an empty Y, as for no tokens.
    X = np.zeros(shape, np.float32)
    cache = np.zeros((4, 0), np.float32)
    B, S = shape[0], shape[2] if len(shape) == 4 else shape[1]
    y = rotary_embedding(X, cache, cache, np.zeros((B, S), np.int64), num_heads=num_heads, backend="numpy")
    assert y.shape == shape and y.dtype == X.dtype and y is not X
    out = np.zeros(shape, np.float32)
    assert rotary_embedding(X, cache, cache, np.zeros((B, S), np.int64), num_heads=num_heads, out=out,
                            backend="numpy") is out


def test_an_input_with_no_channels_is_still_checked():
    X = np.zeros((1, 2, 3, 0), np.float32)
    ids = np.zeros((1, 3), np.int64)
    with pytest.raises(ValueError, match="^backend: 'bogus'"):
        rotary_embedding(X, np.zeros((4, 0), np.float32), np.zeros((4, 0), np.float32), ids, backend="bogus")
    with pytest.raises(ValueError, match=r"^cos_cache: with position_ids, expected \[max_position, 0\]"):
        rotary_embedding(X, np.zeros((4, 7), np.float32), np.zeros((4, 7), np.float32), ids, backend="numpy")


@pytest.mark.parametrize("rank, with_ids", [(4, True), (4, False), (3, True)])
def test_host_arrays_of_other_libraries_run_on_the_numpy_backend(rank, with_ids):
    # X was taken for a device array unless it was a NumPy one: NoDeviceError, naming backend='numpy'.
    inputs = case_inputs("float32", rank, 0, with_ids, seed=5)
    heads = 3 if rank == 3 else 0
    want = rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"], num_heads=heads,
                            backend="numpy")
    wrapped = {k: None if v is None else HostTensor(v) for k, v in inputs.items()}
    got = rotary_embedding(wrapped["X"], wrapped["cos"], wrapped["sin"], wrapped["ids"], num_heads=heads,
                           backend="numpy")
    np.testing.assert_array_equal(np.asarray(got), want)
    # in place: out=X writes through to the other library's memory and returns its object
    x = inputs["X"].copy()
    box = HostTensor(x)
    assert rotary_embedding(box, wrapped["cos"], wrapped["sin"], wrapped["ids"], num_heads=heads, out=box,
                            backend="numpy") is box
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("change,exc,match", [
    (dict(num_heads=0, rank=3), ValueError, "needs num_heads"),
    (dict(num_heads=5, rank=3), ValueError, "not a multiple of num_heads"),
    (dict(num_heads=4, rank=4), ValueError, "has 3 heads"),
    (dict(rotary_embedding_dim=6), ValueError, r"cos_cache: with position_ids, expected \[max_position, 3\]"),
    (dict(rotary_embedding_dim=7), ValueError, "must be even"),
    (dict(interleaved=2), ValueError, "0 or 1"),
    (dict(interleaved=True), TypeError, "interleaved"),
    (dict(rotary_embedding_dim=-2), ValueError, "rotary_embedding_dim: must not be negative"),
    (dict(num_heads=2.0), TypeError, "num_heads: expected an int"),
    (dict(flat_cache=True), ValueError, "without position_ids"),
    (dict(ids_out_of_cache=True), ValueError, "position"),
])
def test_errors_name_the_argument_and_write_nothing(change, exc, match):
    rank = change.pop("rank", 4)
    inputs = case_inputs("float32", rank, 0, not change.get("flat_cache"), seed=4)
    if change.pop("flat_cache", False):
        inputs["cos"], inputs["sin"] = inputs["cos"].reshape(-1, 8), inputs["sin"].reshape(-1, 8)
    if change.pop("ids_out_of_cache", False):
        inputs["ids"][0, 0] = 40
    kw = {"num_heads": 3 if rank == 3 else 0, **change}
    x = inputs["X"].copy()
    with pytest.raises(exc, match=match):
        rotary_embedding(x, inputs["cos"], inputs["sin"], inputs["ids"], out=x, backend="numpy", **kw)
    np.testing.assert_array_equal(x, inputs["X"])


@pytest.mark.parametrize("change,exc,match", [
    (lambda i: {"ids": i["ids"].reshape(-1)}, ValueError, r"position_ids: expected shape \[batch, seq\] = \[2, 5\]"),
    (lambda i: {"ids": i["ids"].astype(np.float32)}, TypeError, "position_ids: dtype float32 is not supported"),
    (lambda i: {"cos": i["cos"].astype(np.float64)}, TypeError, "cos_cache: dtype float64 differs from X's float32"),
    (lambda i: {"sin": i["sin"].astype(np.int64)}, TypeError, "sin_cache: dtype int64 differs from X's"),
    (lambda i: {"X": i["X"].astype(np.int32)}, TypeError, "X: dtype int32 is not supported"),
    (lambda i: {"out": np.empty(i["X"].shape, np.float16)}, TypeError, "out: dtype float16 differs from X's"),
    (lambda i: {"X": np.zeros((2, 3, 5, 32), np.float32)[..., ::2]}, UnsupportedLayoutError,
     "X: the last dimension must be contiguous"),
])
def test_the_operators_inputs_are_checked_under_the_operators_names(change, exc, match):
    inputs = case_inputs("float32", 4, 0, True, seed=5)
    inputs.update(change(inputs))
    before = inputs["X"].copy()
    with pytest.raises(exc, match=match):
        rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"], out=inputs.get("out"),
                         backend="numpy")
    np.testing.assert_array_equal(inputs["X"], before)


def test_a_per_token_cache_shared_by_the_batch_matches_the_reference():
    pytest.importorskip("onnx")
    inputs = case_inputs("float32", 4, 0, False, seed=5)
    inputs["cos"], inputs["sin"] = inputs["cos"][:1].copy(), inputs["sin"][:1].copy()  # [1, S, half]
    y = rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], None, backend="numpy")
    want = onnx_reference(inputs, 0, 0, 4)
    np.testing.assert_allclose(y, want, rtol=0, atol=_tolerance("float32"))


@pytest.mark.parametrize("case,exc,match", [
    ("transposed_per_token_cache", ValueError, r"cos_cache: without position_ids, expected \[batch, seq"),
    ("odd_head_size", ValueError, "X: head_size 5 is odd"),
    ("wrong_out", ValueError, "out: expected X's shape"),
    ("strided_hidden_axis", UnsupportedLayoutError, "X: the hidden axis must be contiguous"),
])
def test_shapes_the_operator_does_not_take(case, exc, match):
    inputs = case_inputs("float32", 3, 0, False, seed=6)
    X, cos, sin, kw = inputs["X"], inputs["cos"], inputs["sin"], {"num_heads": 3}
    if case == "transposed_per_token_cache":  # [S, B, half] has the right size, not the right shape
        cos, sin = cos.transpose(1, 0, 2).copy(), sin.transpose(1, 0, 2).copy()
    elif case == "odd_head_size":
        X = np.ones((2, 5, 15), np.float32)
    elif case == "strided_hidden_axis":  # a layout, as for a 4-d X: the same exception type
        X = np.ones((2, 5, 48, 2), np.float32)[..., 0]
    else:
        kw["out"] = np.zeros((2, 5, 47), np.float32)
    before = X.copy()
    with pytest.raises(exc, match=match):
        rotary_embedding(X, cos, sin, None, backend="numpy", **kw)
    np.testing.assert_array_equal(X, before)


def _device_inputs(dtype: str, with_ids: bool, **devices):
    """The inputs of one 4-d case as fake CuPy arrays (no GPU: only described, never read), each
    on the device ``devices`` names (default 0), or a NumPy array where it names ``"host"``."""
    from fakes import fake_cupy

    inputs = case_inputs(dtype, 4, 0, with_ids, seed=8)
    out = {}
    for name, a in inputs.items():
        where = devices.get(name, 0)
        out[name] = a if a is None or where == "host" else fake_cupy(a.shape, a.dtype, device=where)
    return out


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("devices,exc,match", [
    # A host cache with a device X was copied to the device on every call (float16: silently).
    ({"cos": "host"}, TypeError, r"^cos_cache: X is a device array \(device 0\); pass cos_cache on that device too"),
    ({"sin": "host"}, TypeError, r"^sin_cache: X is a device array \(device 0\); pass sin_cache on that device"),
    ({"X": "host", "ids": "host"}, TypeError, r"^cos_cache: X is a host \(NumPy\) array; pass cos_cache as a host"),
    ({"cos": 1, "sin": 1}, ValueError, r"^cos_cache: on device 1, but X is on device 0"),
    ({"ids": 1}, ValueError, r"^position_ids: on device 1, but X is on device 0"),
])
def test_inputs_on_another_device_than_X_are_refused_before_any_copy(dtype, devices, exc, match):
    pytest.importorskip("cupy")
    for with_ids in (True,) if devices.get("ids", "host") != "host" else (True, False):
        inputs = _device_inputs(dtype, with_ids, **devices)
        with pytest.raises(exc, match=match):
            rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"])


@pytest.mark.parametrize("case,exc,match", [
    ("ids_past_the_cache", ValueError, r"^position_ids: entry 0 is 40, outside the table's 40 rows"),
    ("negative_ids", ValueError, r"^position_ids: entry 0 is -1, outside"),
    ("strided_cache_columns", UnsupportedLayoutError, r"^cos_cache: the last dimension must be contiguous"),
    ("caches_of_different_row_strides", ValueError, r"^sin_cache: row stride 16 differs from cos_cache's 8"),
    ("out_overlapping_X", ValueError, r"^out overlaps X \("),
])
def test_errors_of_the_general_checks_name_the_operators_inputs(case, exc, match):
    """The checks the general API runs for the operator speak of X, cos_cache, sin_cache and
    position_ids (before: x, cos, sin and positions, names the ONNX caller never used)."""
    inputs = case_inputs("float32", 4, 0, True, seed=9)
    X, cos, sin, ids, kw = inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"], {}
    if case == "ids_past_the_cache":
        ids[0, 0] = 40
    elif case == "negative_ids":
        ids[0, 0] = -1
    elif case == "strided_cache_columns":
        cos = np.repeat(cos, 2, axis=1)[:, ::2]
    elif case == "caches_of_different_row_strides":
        sin = np.pad(sin, ((0, 0), (0, 8)))[:, :8]
    else:
        wide = np.zeros(X.shape[:-1] + (2 * X.shape[-1],), X.dtype)
        wide[..., :16] = X
        X, kw["out"] = wide[..., :16], wide[..., 8:24]
    before = X.copy()
    with pytest.raises(exc, match=match) as info:
        rotary_embedding(X, cos, sin, ids, backend="numpy", **kw)
    assert not re.search(r"\b(x|q|cos|sin|positions)\b(?=[:,']| \()", str(info.value)), info.value
    np.testing.assert_array_equal(X, before)
