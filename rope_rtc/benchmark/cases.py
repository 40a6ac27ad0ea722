"""Shared constants, the product's performance targets, the Skip/Wrong exceptions, the
benchmark cases (:class:`Case` and the per-group builders), the ``--cases`` filter and the
cold-L2 set count. The lowest module of the package: it imports nothing from the others."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass


SCHEMA = 1
GROUPS = ("coldstart", "host", "engine", "blog", "general", "decode", "tail")
PEERS = ("cupy", "torch", "torch.compile", "liger")
OURS = "rope_rtc"
ONE_CALL = "rope_rtc apply_rope_qk"  # the one-call function on the same buffers as OURS (a plan)
ENGINE = "rope_rtc cos_sin_cache"  # decode in the engines' convention: flat q/k, one cos|sin table
# decode on the inputs the peers get: cos and sin gathered at the step's positions once (Hugging
# Face computes them once per step for every layer), no positions array
STEP_TABLES = "rope_rtc, step tables"
COPY = "copy"
KV_FUSED = "rope_and_cache (RopeCachePlan)"        # engine section: the fused RoPE + KV-cache write
KV_FUSED_FP8 = "rope_and_cache, FP8 e4m3 entries"
COPY_FP8 = "copy of the FP8 launch's bytes"  # the FP8 row's same-size copy (it moves fewer bytes)
KV_TWO_STEP = "RopePlan, then a CuPy scatter per cache"
ONNX_OP = "onnx.rotary_embedding"
MROPE_OP = "apply_mrope_qk (MRopePlan)"
MROPE_PLAIN = "plain RoPE, same arrays (RopePlan)"
VISION_COMPILE = "torch.compile (transformers' vision rotary path)"  # the vision row's peer
ONNX_APPLY = "apply_rope (same X, float32 tables)"
QKNORM_OP = "apply_qk_norm_rope (QKNormRopePlan)"
QKNORM_HF_NUMERICS = "apply_qk_norm_rope, numerics='transformers'"
QKNORM_TWO_STEP = "torch rms_norm, then our RopePlan (two steps)"
ANGLES_OP = "RopePlan, inv_freq (angles in the kernel)"
ANGLES_TABLE = "RopePlan, cos/sin tables"
MLA_FUSED = "mla_rope_and_cache (MlaRopeCachePlan)"        # engine section: DeepSeek MLA's RoPE + latent cache write
MLA_FUSED_FP8 = "mla_rope_and_cache, FP8 e4m3 cache"
MLA_TWO_STEP = "RopePlan on the rotary parts, then a CuPy cache write"
MLA_TWO_STEP_FP8 = "RopePlan on the rotary parts, then a CuPy FP8 cache write"
JAX_OURS = "rope_rtc.jax under jax.jit"                   # engine section: rope_rtc.jax inside jit
JAX_XLA = "the same RoPE in jnp, fused by XLA"
OWN_COPY_FP8 = (KV_FUSED_FP8, MLA_FUSED_FP8, MLA_TWO_STEP_FP8)  # rows judged against COPY_FP8 where measured
COPY_KERNEL = "copy kernel"   # tail cases: the naive 16-byte copy kernel, a reference beside the memcpy
BLOG_VARIANTS = ("baseline", "vectorized", "fused")
REGIMES = ("hot", "cold", "graph", "graph_cold", "host", "cold_paired")

MiB = 1 << 20
COLD_FACTOR = 4              # cold L2: buffer sets totalling more than 4x the L2
MAX_COLD_SETS = 32768        # beyond this the cold footprint is reported as partial
SMALL_BYTES = 64 * MiB       # cases moving at most this also get graph-replay and host figures
GRAPH_HOT_CALLS = 64         # calls captured per graph, same buffers
# A peer whose hot graph replay takes over this many times the slowest cold one of the rows before
# it (the copy's and ours) is not replayed cold: its cold replay, never faster than its hot one,
# cannot be faster than ours, and a graph of a call per cold set of a many-kernel peer costs the
# run seconds a case.
PEER_COLD_GRAPH_FACTOR = 2.0
BIG_COPY_MOVED = 4 << 30     # the reference copy: 4 GiB moved (2 GiB read + 2 GiB written)
DECODE_POSITIONS = 8192      # rows of the decode table; positions are drawn below it
TAIL_COLS = 32               # tail RoPE table columns (64 rotated channels)
CHECK_TOKENS = 256           # tokens per (batch, head) compared with the reference
TAIL_CHECK_TOKENS = 16
PEER_TOL_EPS = 2             # peers: |err| <= 2 eps(dtype) (|x0| + |x1|): catches pairing/layout bugs
NOISE = 1.01                 # "never slower than the fastest peer" allows 1 % of timing noise
DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}

# The product's performance targets (report.evaluate_targets judges each run against them).
PREFILL_RULES = ((32 * MiB, 97.0),)   # (bytes moved at least, % of copy): every general row of 32 MB or more
BLOG_FUSED_RATIO = 1.01       # the production kernel's time on the blog's configuration, at most the fused kernel's times this
DECODE_GPU_US = 1.4
DECODE_COPY_RATIO = 1.1       # decode GPU time under graph replay, at most this many times the same-size copy node
PLAN_HOST_US = 5.0
TAIL_COPY_PCT = 97.0
TAIL_GPU_US = 1.6
TAIL_HOST_US = 5.0
ONE_CALL_HOST_US = 5.0          # apply_rope_qk in place (tables; engines' convention), new arrays of a seen signature
ONE_CALL_ALLOC_HOST_US = 8.0    # apply_rope allocating its output, new arrays of a seen signature
ONE_CALL_PLAN_RATIO = 2.0       # ... and at most this many times RopePlan.execute (same arrays)
TAIL_ONE_CALL_HOST_US = 10.0    # tail_rope, output allocation included
ONE_CALL_PREFILL_POINTS = 1.0   # one-call prefill within this many points of the plan's % of copy
ONE_CALL_POOL = 64              # distinct array sets cycled for the one-call host rows
HOST_PROCESSES = 3              # fresh processes that each measure the host-cost section (median per row)
KV_FUSED_PREFILL_PCT = 95.0     # RoPE fused with the KV-cache write, prefill, % of a copy of its bytes
MROPE_PREFILL_PCT = 95.0        # multimodal RoPE, prefill, % of a copy of its bytes
MROPE_DECODE_EXTRA_US = 0.1     # multimodal RoPE decode GPU time, at most plain RoPE's plus this
VISION_COPY_PCT = 97.0          # a vision tower's axial RoPE (two streams), % of a copy of its bytes
VISION_COMPILE_SPEEDUP = 1.5    # ... and at least this many times faster than torch.compile of transformers' path
QKNORM_PREFILL_PCT = 95.0       # QK-norm fused with RoPE, prefill, % of a copy of its bytes
QKNORM_TWO_STEP_RATIO = 0.5     # ... and at most this fraction of the two-step sequence's GPU time
JAX_PREFILL_PCT = 95.0          # rope_rtc.jax inside jit, prefill, % of a copy of its bytes
MLA_PREFILL_PCT = 95.0          # MLA RoPE + latent-cache write, prefill, % of a copy of its bytes
MLA_DECODE_COPY_RATIO = 1.2     # ... decode GPU time under graph replay, at most this many times the same-size copy node
ANGLES_PREFILL_POINTS = 1.0     # inv_freq (angles in the kernel), prefill: within this many points of the table kernel
WARM_FIRST_S = 0.050
COMPILE_ONE_S = 1.0


class Skip(Exception):
    """An implementation that cannot run here; the message says why."""


class Wrong(Exception):
    """An implementation whose output fails the check; it is reported and not timed."""


# =============================================================================================
# cases


@dataclass(frozen=True)
class Case:
    """One benchmark shape. Decode and tail use ``thd`` ([T, H, D], B = 1, S = T)."""

    group: str          # blog | general | decode | tail
    dtype: str          # float32 | float16 | bfloat16
    layout: str         # bshd | bhsd | thd
    interleaved: bool
    B: int
    S: int
    H: int
    Hkv: int            # k's heads; 0: no k (tail)
    D: int

    @property
    def T(self) -> int:
        return self.B * self.S

    @property
    def id(self) -> str:
        if self.group == "blog":
            return f"blog/S={self.S}"
        if self.group == "general":
            pairing = "inter" if self.interleaved else "half"
            return f"general/{DTYPE_SHORT[self.dtype]}/{pairing}/{self.layout}/S={self.S}"
        if self.group == "decode":
            return f"decode/{DTYPE_SHORT[self.dtype]}/T={self.T}"
        return f"tail/T={self.T}/H={self.H}/D={self.D}"

    def shape(self, layout: str | None = None, heads: int | None = None) -> tuple[int, ...]:
        """The physical shape of q (or k with ``heads=Hkv``) in ``layout``."""
        layout = layout or self.layout
        h = self.H if heads is None else heads
        return {"bshd": (self.B, self.S, h, self.D), "bhsd": (self.B, h, self.S, self.D),
                "thd": (self.T, h, self.D)}[layout]

    @property
    def table_rows(self) -> int:
        """Rows of one cos (or sin) table: positions 0..S-1, the decode table, or one per tail token."""
        return {"decode": DECODE_POSITIONS, "tail": self.T}.get(self.group, self.S)

    @property
    def table_cols(self) -> int:
        return TAIL_COLS if self.group == "tail" else self.D // 2

    @property
    def shared_table(self) -> bool:
        """Decode reads T random rows of one big table, shared by every buffer set."""
        return self.group == "decode"

    def elements(self, heads: int) -> int:
        return self.T * heads * self.D

    def bytes_moved(self) -> int:
        """Input read + output written + table rows read (+ position indices)."""
        item = ITEMSIZE[self.dtype]
        x = self.elements(self.H) * item
        if self.group == "tail":
            return 2 * x + self.T * TAIL_COLS * 4 * 2
        kv = self.elements(self.Hkv) * item
        rows_used = self.T if self.group == "decode" else self.S   # shared by the batch
        tables = rows_used * (self.D // 2) * 4 * 2
        positions = self.T * 4 if self.group == "decode" else 0
        return 2 * (x + kv) + tables + positions

    def footprint(self) -> int:
        """Bytes one buffer set occupies (what cold-L2 rotation must multiply past the L2)."""
        item = ITEMSIZE[self.dtype]
        x = self.elements(self.H) * item
        if self.group == "tail":
            return 2 * x + 2 * self.T * TAIL_COLS * 4
        kv = self.elements(self.Hkv) * item
        tables = 0 if self.shared_table else 2 * self.table_rows * self.table_cols * 4
        positions = _pad16(self.T * 4) if self.group == "decode" else 0
        return x + kv + tables + positions

    def params(self) -> dict:
        return {"dtype": self.dtype, "layout": self.layout, "interleaved": self.interleaved, "B": self.B,
                "S": self.S, "H": self.H, "Hkv": self.Hkv, "D": self.D, "T": self.T}


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def blog_cases(quick: bool) -> list[Case]:
    seqs = (16, 4096) if quick else (1, 16, 512, 4096, 16384)
    return [Case("blog", "float32", "bhsd", True, 4, s, 32, 32, 128) for s in seqs]


def general_cases(quick: bool) -> list[Case]:
    seqs = (4096,) if quick else (512, 4096, 16384)
    dtypes = ("bfloat16", "float32") if quick else ("bfloat16", "float16", "float32")
    return [Case("general", dt, lay, il, 4, s, 32, 32, 128)
            for s in seqs for dt in dtypes for il in (False, True) for lay in ("bshd", "bhsd")]


def decode_cases(quick: bool) -> list[Case]:
    tokens = (1, 64) if quick else (1, 4, 64)
    return [Case("decode", dt, "thd", False, 1, t, 32, 8, 128) for dt in ("bfloat16", "float16") for t in tokens]


TAIL_T = (1, 4, 4096, 16384)
TAIL_HD = ((64, 512), (32, 128), (8, 512), (4, 128), (1, 512), (1, 128))


def tail_cases(quick: bool) -> list[Case]:
    tokens = (1, 4, 16384) if quick else TAIL_T
    geoms = ((64, 512), (1, 128)) if quick else TAIL_HD
    return [Case("tail", "bfloat16", "thd", True, 1, t, h, 0, d) for t in tokens for h, d in geoms]


CASE_BUILDERS = {"blog": blog_cases, "general": general_cases, "decode": decode_cases, "tail": tail_cases}


def all_cases(quick: bool) -> list[Case]:
    return [c for g in ("blog", "general", "decode", "tail") for c in CASE_BUILDERS[g](quick)]


def parse_filter(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def selected(ident: str, group: str, tokens: list[str] | None) -> bool:
    """``--cases``: a group name, a substring of a case id, or a glob over case ids."""
    if tokens is None:
        return True
    for tok in tokens:
        if tok == group or (any(ch in tok for ch in "*?[") and fnmatch.fnmatch(ident, tok)) or tok in ident:
            return True
    return False


def cold_sets(footprint: int, l2_bytes: int) -> int:
    return max(1, min(MAX_COLD_SETS, -(-COLD_FACTOR * l2_bytes // max(footprint, 1))))


