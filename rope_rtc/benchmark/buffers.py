"""Device buffers of one case (:class:`SetBuffers`, bfloat16 as bits), the FP32 tables, and the
checks that compare an implementation's first call with the reference (subsampling, host
copies, the peers' tolerance)."""

from __future__ import annotations

import numpy as np

from .cases import CHECK_TOKENS, EPS, PEER_TOL_EPS, TAIL_COLS, Case, Wrong, _pad16


# =============================================================================================
# buffers


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def f32_to_bf16_bits(xp, y):
    """Round float32 to bfloat16 bits (uint16), to nearest even (NaN not special-cased: inputs are finite)."""
    u = xp.ascontiguousarray(y).view(xp.uint32)
    return ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)


def bf16_bits_to_f32(xp, bits):
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def host_tables(rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """FP32 cos/sin [rows, dim/2] (rope_tables when importable, else the same formula in NumPy)."""
    try:
        from ..numerics.tables import rope_tables

        c, s = rope_tables(rows, dim)
        return np.ascontiguousarray(c, np.float32), np.ascontiguousarray(s, np.float32)
    except Exception:
        inv = 10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        ang = np.outer(np.arange(rows, dtype=np.float64), inv)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class SetBuffers:
    """``n`` buffer sets of one case in one physical layout; set ``i`` is index ``i`` of each slab.

    2-byte floats are stored as their bits (``uint16``) so that nothing but our kernels needs
    CuPy arithmetic on bfloat16; ``native`` views give the real dtype to the kernels.
    """

    def __init__(self, cp, case: Case, layout: str, n: int, seed: int) -> None:
        self.cp, self.case, self.layout, self.n = cp, case, layout, n
        rs = cp.random.RandomState(seed)
        self.q_bits = self._random(rs, (n, *case.shape(layout)))
        self.k_bits = self._random(rs, (n, *case.shape(layout, case.Hkv))) if case.Hkv else None
        self.out_bits = self._empty((n, *case.shape(layout))) if case.group == "tail" else None
        if case.group == "tail":
            ang = rs.uniform(-10.0, 10.0, (n, case.T, TAIL_COLS)).astype(cp.float32)
            self.cos_slab, self.sin_slab = cp.cos(ang), cp.sin(ang)
        else:
            c, s = host_tables(case.table_rows, case.D)
            reps = 1 if case.shared_table else n
            self.cos_slab = cp.ascontiguousarray(cp.broadcast_to(cp.asarray(c), (reps, *c.shape)))
            self.sin_slab = cp.ascontiguousarray(cp.broadcast_to(cp.asarray(s), (reps, *s.shape)))
        self.pos_slab = None
        if case.group == "decode":
            width = _pad16(case.T * 4) // 4
            self.pos_slab = rs.randint(0, case.table_rows, size=(n, width), dtype=cp.int32)
        self._native_dtype = None

    def _storage_dtype(self):
        cp = self.cp
        return {"float32": cp.float32, "float16": cp.float16, "bfloat16": cp.uint16}[self.case.dtype]

    def _empty(self, shape):
        return self.cp.empty(shape, dtype=self._storage_dtype())

    def _random(self, rs, shape):
        cp = self.cp
        y = rs.standard_normal(size=shape, dtype=cp.float32)
        if self.case.dtype == "bfloat16":
            return f32_to_bf16_bits(cp, y)
        return y.astype(self._storage_dtype(), copy=False)

    def native(self, bits):
        """The array in its real dtype (a bfloat16 view of the bits)."""
        if self.case.dtype != "bfloat16":
            return bits
        return bits.view(_bf16())

    # one set
    def q(self, i: int, native: bool = True):
        return self.native(self.q_bits[i]) if native else self.q_bits[i]

    def k(self, i: int, native: bool = True):
        return self.native(self.k_bits[i]) if native else self.k_bits[i]

    def out(self, i: int, native: bool = True):
        return self.native(self.out_bits[i]) if native else self.out_bits[i]

    def cos(self, i: int):
        return self.cos_slab[0 if self.case.shared_table else i]

    def sin(self, i: int):
        return self.sin_slab[0 if self.case.shared_table else i]

    def pos(self, i: int):
        return None if self.pos_slab is None else self.pos_slab[i, : self.case.T]


# =============================================================================================
# checks


def _subsample_indices(n: int, limit: int) -> list[int]:
    if n <= limit:
        return list(range(n))
    return sorted({int(v) for v in np.linspace(0, n - 1, limit)})


def to_host(a, dtype: str) -> np.ndarray:
    """A CuPy array (real dtype or bits) or a torch tensor on the host, in the case's dtype."""
    np_dtype = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
    if _is_torch(a):
        import torch

        t = a.detach().contiguous()
        if t.element_size() == 2:
            return t.view(torch.int16).cpu().numpy().view(np_dtype)
        return t.cpu().numpy()
    import cupy as cp

    host = cp.asnumpy(_bits(a))
    return host.view(np_dtype) if host.dtype.itemsize == np_dtype.itemsize else host.astype(np_dtype)


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def _bits(a):
    """A CuPy 2-byte float array as int16 bits (indexing then needs no bfloat16 kernels)."""
    if not _is_torch(a) and a.dtype.itemsize == 2 and a.dtype.kind not in "ui":
        import cupy as cp

        return a.view(cp.int16)
    return a


def _canonical_subsample(a, layout: str, bi, si, hi):
    """Rows (b in bi, s in si, h in hi) of a [B, S, H, D]-permuted view, on the device."""
    from ..core.layouts import to_bshd_index

    is_torch = _is_torch(a)
    a = _bits(a)
    if layout == "thd":
        a = a[None]
        perm = (0, 1, 2, 3)
    else:
        perm = to_bshd_index(layout)
    a = a.permute(*perm) if is_torch else a.transpose(perm)
    return a[bi][:, si][:, :, hi]


def general_sample(case: Case, a, layout: str, heads: int):
    """(host subsample [N, h, D] in the case's dtype, token positions [N]) of q or k in ``layout``."""
    B, S = (1, case.T) if layout == "thd" else (case.B, case.S)
    bi = sorted({0, B - 1})
    si = _subsample_indices(S, CHECK_TOKENS)
    hi = sorted({0, heads - 1})
    sub = to_host(_canonical_subsample(a, layout, bi, si, hi), case.dtype)
    return sub.reshape(len(bi) * len(si), len(hi), case.D), bi, si


def pair_abs_sum(x64: np.ndarray, interleaved: bool) -> np.ndarray:
    """|x0| + |x1| of the pair of every element."""
    a = np.abs(x64)
    if interleaved:
        s = a[..., 0::2] + a[..., 1::2]
        return np.repeat(s, 2, axis=-1)
    h = a.shape[-1] // 2
    s = a[..., :h] + a[..., h:]
    return np.concatenate([s, s], axis=-1)


def tolerance_check(actual: np.ndarray, expected64: np.ndarray, x: np.ndarray, interleaved: bool, dtype: str) -> float:
    """Peers: worst |err| / (2 eps(dtype) (|x0|+|x1|)); raises :class:`Wrong` above 1."""
    act = actual.astype(np.float64)
    bound = PEER_TOL_EPS * EPS[dtype] * pair_abs_sum(x.astype(np.float64), interleaved) + 1e-30
    ratio = np.abs(act - expected64) / bound
    if not np.all(np.isfinite(act)):
        raise Wrong("non-finite output")
    worst = float(ratio.max()) if ratio.size else 0.0
    if worst > 1.0:
        idx = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        raise Wrong(f"error {abs(act[idx] - expected64[idx]):.3g} at {tuple(int(i) for i in idx)} exceeds "
                    f"{PEER_TOL_EPS} eps(dtype) x pair magnitude ({bound[idx]:.3g}); pairing or layout?")
    return worst


