"""rope_rtc.onnx.rotary_embedding on the GPU: every attribute combination, float32 and float16,
3-d and 4-d X, with and without position_ids, into a NaN-poisoned output, against the ``onnx``
reference evaluator (or, where the package is absent, the NumPy backend the CPU suite holds to
it) and within the general API's bound of the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_cases import CASES, case_inputs, canonical, float64_reference, onnx_reference
from rope_rtc.onnx import rotary_embedding
from rope_rtc.reference import assert_rope_close
from test_onnx import _tolerance

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,rank,interleaved,rotary_dim,with_ids", CASES)
def test_rotary_embedding_on_the_gpu(dtype, rank, interleaved, rotary_dim, with_ids):
    import cupy as cp

    inputs = case_inputs(dtype, rank, rotary_dim, with_ids, seed=7)
    dev = {n: (None if a is None else cp.asarray(a)) for n, a in inputs.items()}
    out = cp.full(inputs["X"].shape, np.nan, dtype=inputs["X"].dtype)
    attrs = dict(interleaved=interleaved, rotary_embedding_dim=rotary_dim, num_heads=3 if rank == 3 else 0)
    assert rotary_embedding(dev["X"], dev["cos"], dev["sin"], dev["ids"], out=out, **attrs) is out
    y = cp.asnumpy(out)
    try:
        want = onnx_reference(inputs, interleaved, rotary_dim, rank)
    except ImportError:
        want = rotary_embedding(inputs["X"], inputs["cos"], inputs["sin"], inputs["ids"], backend="numpy", **attrs)
    np.testing.assert_allclose(y.astype(np.float64), want.astype(np.float64), rtol=0, atol=_tolerance(dtype))
    ref, xc = float64_reference(inputs, interleaved, rotary_dim, rank)
    assert_rope_close(canonical(y, rank), ref, xc, interleaved=bool(interleaved), rotary_dim=rotary_dim or None,
                      dtype=np.dtype(dtype))
    np.testing.assert_array_equal(cp.asnumpy(dev["X"]), inputs["X"])
