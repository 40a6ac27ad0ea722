"""The blog's three kernels on the GPU: float64 reference, max abs error <= 1e-6."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_util import host_random, host_tables, poisoned
from rope_rtc.ops.blog import prepare_blog_variant
from rope_rtc.reference import rope_reference

pytestmark = pytest.mark.gpu


def _ref_bhsd(x, cos, sin, offset=0):
    B, H, S, D = x.shape
    canon = np.transpose(x, (0, 2, 1, 3)).reshape(-1, H, D)
    pos = np.tile(np.arange(S) + offset, B)
    out = rope_reference(canon, cos, sin, pos, interleaved=True)
    return np.transpose(out.reshape(B, S, H, D), (0, 2, 1, 3))


@pytest.mark.parametrize("variant", ["baseline", "vectorized", "fused", "auto"])
@pytest.mark.parametrize("shape,offset", [((4, 32, 64, 128), 0), ((2, 3, 17, 64), 5), ((1, 1, 1, 4), 2)])
def test_blog_kernels_match_float64(cp, variant, shape, offset):
    import rope_rtc

    seed = hash((variant, shape)) % 1000
    q = host_random(shape, np.float32, seed)
    k = host_random(shape, np.float32, seed + 1)
    cos, sin = host_tables(offset + shape[2] + 3, shape[3] // 2, seed + 2)
    qd, kd, cd, sd = (cp.asarray(a) for a in (q, k, cos, sin))
    qo, ko = poisoned(cp, shape, np.float32), poisoned(cp, shape, np.float32)
    if variant == "auto":
        rope_rtc.apply_rope_qk(qd, kd, cd, sd, layout="bhsd", interleaved=True, offset=offset, q_out=qo, k_out=ko)
    else:
        prepare_blog_variant(variant, qd, kd, cd, sd, q_out=qo, k_out=ko, offset=offset)()
    for got, x in ((qo, q), (ko, k)):
        err = np.abs(cp.asnumpy(got).astype(np.float64) - _ref_bhsd(x, cos, sin, offset))
        assert not np.isnan(err).any(), "an output element was never written"
        assert err.max() <= 1e-6, f"{variant}: max abs error {err.max():.3g}"
    # inputs untouched out of place
    assert np.array_equal(cp.asnumpy(qd), q) and np.array_equal(cp.asnumpy(kd), k)


@pytest.mark.parametrize("variant", ["baseline", "vectorized", "auto"])
def test_blog_worked_example(cp, variant):
    """d=4, base=100, m=2, x=[1,2,3,4]; the exact result (the blog rounds cos/sin to 4 digits)."""
    import rope_rtc

    cos, sin = rope_rtc.rope_tables(3, 4, base=100.0, xp=cp)
    x = cp.zeros((1, 1, 3, 4), dtype=cp.float32)
    x[0, 0, 2] = cp.asarray([1.0, 2.0, 3.0, 4.0], dtype=cp.float32)
    x[0, 0, :2] = 1.0
    if variant == "auto":
        out = rope_rtc.apply_rope(x, cos, sin, layout="bhsd", interleaved=True)
    else:
        out = cp.full_like(x, cp.nan)
        prepare_blog_variant(variant, x, None, cos, sin, q_out=out)()
    np.testing.assert_allclose(cp.asnumpy(out)[0, 0, 2], [-2.23474, 0.07700, 2.14552, 4.51627], atol=2e-5)


def test_blog_variants_reject_other_configurations(cp):
    x = cp.ones((1, 2, 4, 8), dtype=cp.float32)
    cos, sin = host_tables(8, 4, 0)
    cd, sd = cp.asarray(cos), cp.asarray(sin)
    with pytest.raises(ValueError, match="variant"):
        prepare_blog_variant("fused", x, None, cd, sd, q_out=cp.empty_like(x))  # fused needs k
    xh = x.astype(cp.float16)
    with pytest.raises(ValueError, match="variant"):
        prepare_blog_variant("baseline", xh, None, cd, sd, q_out=cp.empty_like(xh))
