"""The benchmark suite (issue 5): the blog's table on this GPU, every peer side by side, the
size-matched copy ceiling, and the performance targets of issues 4 and 5, all from one run.

Run from a checkout on a GPU machine::

    PYTHONPATH=. python3 scripts/bench.py --quick        # a few cases of every section, ~3 min (H200)
    PYTHONPATH=. python3 scripts/bench.py                # every case of issue 5, ~8 min
    PYTHONPATH=. python3 scripts/bench.py --cases blog,tail/T=1
    PYTHONPATH=. python3 scripts/bench.py --write-docs   # also regenerate docs/benchmarks.md
    python3 scripts/bench.py --from-json bench.json --write-docs   # re-render a saved run, no GPU
    python3 scripts/bench.py --list                      # the cases, without running anything

Method (DESIGN.md, "Performance"):

* Effective bandwidth = bytes moved / time, where bytes moved is a property of the case, not of
  the implementation: input bytes read + output bytes written + table bytes read (the rows the
  case's positions use, FP32 cos and sin) + position indices. A peer that reads a wider table
  (Hugging Face's duplicated ``[S, D]`` cos/sin) is not credited for it.
* The ceiling of each case is a device-to-device copy (``cudaMemcpyAsync``) moving the same
  number of bytes (half read, half written), measured the same way in the same run; one 4 GiB
  copy is reported for reference.
* Regimes: ``hot`` (CUDA events around back-to-back calls on the same buffers), ``cold``
  (rotating among buffer sets whose total exceeds 4x the L2; identical to hot when one set
  already does), and for small cases ``graph`` / ``graph_cold`` (GPU time per call under CUDA
  graph replay of K captured calls) and ``host`` (wall time of a tight Python loop / N).
  Each figure is the median of repeated samples after a warm-up; call counts adapt so that a
  sample lasts about a millisecond or more.
* Every implementation's output is checked before it is timed (a subsample against the float64
  or bit-exact reference); a wrong answer is reported as WRONG and not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import gc
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

SCHEMA = 1
GROUPS = ("coldstart", "host", "blog", "general", "decode", "tail")
PEERS = ("cupy", "torch", "torch.compile", "liger")
OURS = "rope_rtc"
COPY = "copy"
COPY_KERNEL = "copy kernel"   # tail cases: the naive 16-byte copy kernel, a reference beside the memcpy
BLOG_VARIANTS = ("baseline", "vectorized", "fused")
REGIMES = ("hot", "cold", "graph", "graph_cold", "host")

MiB = 1 << 20
COLD_FACTOR = 4              # cold L2: buffer sets totalling more than 4x the L2
MAX_COLD_SETS = 4096         # beyond this the cold footprint is reported as partial
SMALL_BYTES = 64 * MiB       # cases moving at most this also get graph-replay and host figures
GRAPH_HOT_CALLS = 64         # calls captured per graph, same buffers
GRAPH_COLD_CALLS = 1024      # at most this many calls (one per buffer set) per cold graph
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

# Targets of issues 4 and 5.
PREFILL_RULES = ((256 * MiB, 98.0), (32 * MiB, 95.0))   # (bytes moved at least, % of copy)
DECODE_GPU_US = 1.5
PLAN_HOST_US = 5.0
TAIL_COPY_PCT = 97.0
TAIL_GPU_US = 1.6
TAIL_HOST_US = 5.0
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
    return [Case("decode", "bfloat16", "thd", False, 1, t, 32, 8, 128) for t in tokens]


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


# =============================================================================================
# arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rope-rtc bench", description="RoPE benchmarks: rope_rtc against a size-matched copy and every peer, one run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Groups: " + ", ".join(GROUPS) + ". Peers: " + ", ".join(PEERS) + ".")
    p.add_argument("--quick", action="store_true", help="fewer cases and repetitions (~3 min on an H200 instead of ~8)")
    p.add_argument("--cases", metavar="LIST",
                   help="comma-separated: group names, substrings of case ids or globs (e.g. 'blog,tail/T=1/*')")
    p.add_argument("--peers", metavar="LIST", default=",".join(PEERS),
                   help=f"peers to run (default: all of {','.join(PEERS)}; 'none' for none)")
    p.add_argument("--json", metavar="PATH", help="results file (default: $OUT/bench.json if $OUT is set, else ./bench.json)")
    p.add_argument("--plot", metavar="PATH", help="bandwidth plot (default: beside the JSON, bench.png)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--write-docs", action="store_true",
                   help="regenerate docs/benchmarks.md and docs/benchmarks/<gpu>.json/.png (mirrored under $OUT when set)")
    p.add_argument("--docs-dir", metavar="DIR", help="where --write-docs writes (default: the checkout's docs/)")
    p.add_argument("--from-json", metavar="PATH", help="re-render a saved run (tables, targets, plot, docs); needs no GPU")
    p.add_argument("--merge-json", metavar="PATH",
                   help="with --from-json: replace that run's cases by the same cases of a later run (each case "
                        "keeps its own copy ceiling and peers); the docs list what was replaced")
    p.add_argument("--targets", action="store_true", help="print only the target summary (PASS/MISS) at the end")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--compile-budget", type=float, metavar="S",
                   help="torch.compile: stop compiling new shapes after this many seconds (default 60 quick, 150 full)")
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="skip the remaining cases after this many seconds (default 200 quick, 520 full)")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    args = p.parse_args(argv)
    peers = parse_filter(args.peers) or []
    if peers == ["none"]:
        peers = []
    unknown = [x for x in peers if x not in PEERS]
    if unknown:
        p.error(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)} or 'none'")
    args.peer_list = peers
    args.case_tokens = parse_filter(args.cases)
    if args.compile_budget is None:
        args.compile_budget = 60.0 if args.quick else 150.0
    if args.time_budget is None:
        args.time_budget = 200.0 if args.quick else 520.0
    return args


def default_json_path(args: argparse.Namespace) -> Path:
    if args.json:
        return Path(args.json)
    out = os.environ.get("OUT")
    return Path(out) / "bench.json" if out else Path("bench.json")


def regenerate_command(args: argparse.Namespace) -> str:
    parts = ["PYTHONPATH=.", "python3", "scripts/bench.py"]
    if args.quick:
        parts.append("--quick")
    if args.cases:
        parts += ["--cases", shlex.quote(args.cases)]
    if sorted(args.peer_list) != sorted(PEERS):
        parts += ["--peers", ",".join(args.peer_list) or "none"]
    return " ".join(parts + ["--write-docs"])


# =============================================================================================
# timing


class Rotation:
    """Callables taken round-robin, continuing where the last batch stopped (so a cold rotation
    never restarts on a set that may still be in L2)."""

    def __init__(self, fns: list) -> None:
        self.fns = fns
        self.pos = 0

    def take(self, k: int) -> list:
        n = len(self.fns)
        out = [self.fns[(self.pos + i) % n] for i in range(k)]
        self.pos = (self.pos + k) % n
        return out


@contextlib.contextmanager
def _no_gc():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Clock:
    """CUDA events and host timers on one stream, with adaptive call counts."""

    def __init__(self, cp, stream, quick: bool) -> None:
        self.cp = cp
        self.stream = stream
        self.reps = 7 if quick else 15
        self.warmup = 10 if quick else 50
        self.sample_s = 1e-3 if quick else 2e-3       # aim: each sample lasts at least this
        self.min_total = 50 if quick else 200         # timed calls per figure, when affordable
        self.max_s = 0.15 if quick else 0.4           # cap on one figure's timed calls
        self.max_calls = 5000

    def _gpu_seconds(self, seq: list) -> float:
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(self.stream)
        for f in seq:
            f()
        end.record(self.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1e-3

    def _warm(self, rot: Rotation) -> None:
        t0 = time.perf_counter()
        for f in rot.take(self.warmup):
            f()
            if time.perf_counter() - t0 > 0.25:
                break
        self.stream.synchronize()

    def _calls(self, est: float) -> int:
        est = max(est, 1e-7)
        calls = max(math.ceil(self.sample_s / est), math.ceil(self.min_total / self.reps))
        affordable = max(1, int(self.max_s / (self.reps * est)))
        return max(1, min(calls, affordable, self.max_calls))

    @staticmethod
    def _stats(per_call_s: list[float], calls: int, reps: int, divisor: int, sets: int) -> dict:
        us = [s * 1e6 / divisor for s in per_call_s]
        return {"us": statistics.median(us), "min_us": min(us), "samples_us": [round(x, 4) for x in us],
                "calls": calls, "reps": reps, "divisor": divisor, "sets": sets}

    def events(self, fns: list, divisor: int = 1, sets: int | None = None) -> dict:
        """GPU time per call: CUDA events around ``calls`` back-to-back calls, median of reps."""
        rot = Rotation(fns)
        with _no_gc():
            self._warm(rot)
            est = self._gpu_seconds(rot.take(3)) / 3
            calls = self._calls(est)
            samples = [self._gpu_seconds(rot.take(calls)) / calls for _ in range(self.reps)]
        return self._stats(samples, calls, self.reps, divisor, sets or len(fns))

    # Calls per timed burst of a host measurement: few enough that the launch queue never fills
    # (a full queue makes a call wait for the GPU, which is GPU time, not host cost).
    HOST_BURST = 100

    def host(self, fns: list) -> dict:
        """Host time per call: the wall time of bursts of calls issued from an idle GPU, per call.

        The stream is synchronised before each burst (untimed), so a call never waits for the
        GPU to drain the launch queue; the sample is the sum over the bursts / calls."""
        rot = Rotation(fns)
        sync = self.stream.synchronize
        burst = self.HOST_BURST
        with _no_gc():
            self._warm(rot)
            seq = rot.take(20)
            sync()
            t0 = time.perf_counter()
            for f in seq:
                f()
            est = (time.perf_counter() - t0) / 20
            sync()
            calls = max(burst, -(-self._calls(est) // burst) * burst)
            samples = []
            for _ in range(self.reps):
                total = 0.0
                for _ in range(calls // burst):
                    seq = rot.take(burst)
                    sync()
                    t0 = time.perf_counter()
                    for f in seq:
                        f()
                    total += time.perf_counter() - t0
                samples.append(total / calls)
            sync()
        return self._stats(samples, calls, self.reps, 1, len(fns))


def capture_cupy(stream, seq: list):
    """A CUDA graph of ``seq`` captured on ``stream`` (CuPy stream capture); returns its launcher."""
    stream.begin_capture()
    try:
        for f in seq:
            f()
    except BaseException:
        with contextlib.suppress(Exception):
            stream.end_capture()
        raise
    graph = stream.end_capture()
    return partial(graph.launch, stream), graph


def capture_torch(torch, seq: list):
    """A CUDA graph of ``seq`` captured with ``torch.cuda.graph`` (torch's allocator knows of it)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in seq:
            f()
    return g.replay, g


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
        from .tables import rope_tables

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
    from .layouts import to_bshd_index

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


# =============================================================================================
# implementations: each ``setup`` returns a Runner; the first call is the checked one


@dataclass
class Runner:
    fns: list                    # one callable per buffer set
    run_once: object             # () -> outputs of set 0 (arrays or tensors); the checked first call
    out_layout: str              # layout of those outputs (logical: a torch view may be transposed)
    interleaved: bool            # the pairing it computes
    layout_note: str             # shown in tables: physical layout and pairing
    strict: bool                 # held to our contract (ours) or to the peer tolerance
    capture: object = None       # (seq of set indices) -> (launch callable, keep-alive) or None
    note: str = ""


def _pairing(interleaved: bool) -> str:
    return "inter" if interleaved else "half"


class Peers:
    """What is importable here: torch, Hugging Face's apply_rotary_pos_emb, torch.compile, Liger."""

    def __init__(self, wanted: list[str], compile_budget: float, stream_ptr: int) -> None:
        self.wanted = set(wanted)
        self.skips: list[str] = []
        self.versions: dict[str, str] = {}
        self.torch = None
        self.hf_apply = self.tail_apply = None
        self.hf_source = ""
        self.compiled: dict[str, object] = {}
        self.compile_budget = compile_budget
        self.compile_spent = 0.0
        self.compile_seen: set = set()
        self.compile_log: list[dict] = []
        self.liger = None
        if self.wanted & {"torch", "torch.compile", "liger"}:
            self._import_torch(stream_ptr)
        if self.torch is not None and "liger" in self.wanted:
            self._import_liger()

    def _skip(self, name: str, reason: str) -> None:
        line = f"skip {name}: {reason}"
        self.skips.append(line)
        print(line, flush=True)

    def _import_torch(self, stream_ptr: int) -> None:
        try:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
            torch.set_grad_enabled(False)
            # torch launches on the benchmark's stream, so one set of events times every peer.
            torch.cuda.set_stream(torch.cuda.ExternalStream(stream_ptr))
            self.torch = torch
            self.versions["torch"] = torch.__version__
        except Exception as exc:
            for name in ("torch", "torch.compile", "liger"):
                if name in self.wanted:
                    self._skip(name, f"PyTorch unusable ({type(exc).__name__}: {exc})")
            return
        try:
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            self.hf_source = "transformers.models.llama.modeling_llama.apply_rotary_pos_emb"
        except Exception as exc:
            apply_rotary_pos_emb = partial(hf_formula, torch)
            self.hf_source = f"the same formula inline (transformers not importable: {type(exc).__name__})"
            print(f"note: torch peers use {self.hf_source}", flush=True)

        # Plain functions (not partials), so that torch.compile sees one ordinary code object each.
        def hf_apply(q, k, cos, sin):
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)

        def tail_apply(x, cos, sin):
            return tail_torch(torch, x, cos, sin)

        self.hf_apply, self.tail_apply = hf_apply, tail_apply
        if "torch.compile" in self.wanted:
            try:
                _raise_dynamo_limits(torch)
                self.compiled["general"] = torch.compile(hf_apply, dynamic=False)
                self.compiled["tail"] = torch.compile(tail_apply, dynamic=False)
            except Exception as exc:
                self._skip("torch.compile", f"{type(exc).__name__}: {exc}")

    def _import_liger(self) -> None:
        errors = []
        try:
            from liger_kernel.ops.rope import LigerRopeFunction

            self.liger = LigerRopeFunction.apply
        except Exception as exc:
            errors.append(f"package import: {type(exc).__name__}: {exc}")
            try:   # the module needs only torch and triton: load it alone
                import importlib.util

                spec = importlib.util.find_spec("liger_kernel")
                if spec is None or spec.origin is None:
                    raise ImportError("liger_kernel is not installed")
                path = Path(spec.origin).parent / "ops" / "rope.py"
                mspec = importlib.util.spec_from_file_location("_bench_liger_rope", path)
                mod = importlib.util.module_from_spec(mspec)
                mspec.loader.exec_module(mod)
                self.liger = mod.LigerRopeFunction.apply
                print(f"note: liger loaded from {path} alone ({errors[0]})", flush=True)
            except Exception as exc2:
                errors.append(f"{type(exc2).__name__}: {exc2}")
        if self.liger is None:
            self._skip("liger", "; ".join(errors))
        else:
            self.versions["liger_kernel"] = _dist_version("liger-kernel") or "?"

    def available(self, name: str) -> bool:
        if name not in self.wanted:
            return False
        if name == "cupy":
            return True
        if name == "torch":
            return self.torch is not None
        if name == "torch.compile":
            return self.torch is not None and "general" in self.compiled
        return self.liger is not None

    def first_compiled_call(self, kind: str, fn, args: tuple):
        """Call a torch.compile'd function, compiling a new shape only within the budget."""
        key = (kind,) + tuple((tuple(a.shape), tuple(a.stride()), str(a.dtype)) for a in args)
        if key not in self.compile_seen:
            if self.compile_spent >= self.compile_budget:
                raise Skip(f"torch.compile budget spent ({self.compile_spent:.0f} s on {len(self.compile_seen)} "
                           f"shapes; raise --compile-budget)")
            t0 = time.perf_counter()
            out = fn(*args)
            self.torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.compile_spent += dt
            self.compile_seen.add(key)
            self.compile_log.append({"kind": kind, "shapes": [list(a.shape) for a in args], "seconds": round(dt, 3)})
            return out
        return fn(*args)


def _raise_dynamo_limits(torch) -> None:
    """Every benchmark shape is a guarded specialisation of one code object: allow many."""
    cfg = torch._dynamo.config
    for name, value in (("cache_size_limit", 1024), ("recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 8192), ("accumulated_recompile_limit", 8192)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)


def hf_formula(torch, q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's ``q * cos + rotate_half(q) * sin`` (used only when transformers is absent)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def tail_torch(torch, x, cos, sin):
    """The tail seed's arithmetic in plain torch ops, FP32 math: copy, then rotate the last 64 channels."""
    out = x.clone()
    t = x[..., -2 * TAIL_COLS:].float()
    a, b = t[..., 0::2], t[..., 1::2]
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    real = a * cos - b * sin
    imag = b * cos + a * sin
    out[..., -2 * TAIL_COLS:] = torch.stack((real, imag), dim=-1).flatten(-2).to(x.dtype)
    return out


def to_torch(torch, a, dtype: str):
    """A zero-copy torch view of a CuPy array (2-byte floats travel as int16 bits)."""
    if dtype in ("bfloat16", "float16") and a.dtype.itemsize == 2:
        import cupy as cp

        t = torch.from_dlpack(a.view(cp.int16))
        return t.view(torch.bfloat16 if dtype == "bfloat16" else torch.float16)
    return torch.from_dlpack(a)


# --- rope_rtc ------------------------------------------------------------------------------------


def _cupy_capture(ctx, fns):
    def capture(indices):
        return capture_cupy(ctx.stream, [fns[i] for i in indices])

    return capture


def setup_ours_general(ctx, case: Case, bufs: SetBuffers) -> Runner:
    from .rope import RopePlan

    decode = case.group == "decode"
    plan = RopePlan(bufs.q(0), bufs.k(0), bufs.cos(0), bufs.sin(0), positions=bufs.pos(0) if decode else None,
                    layout=case.layout, interleaved=case.interleaved).compile()
    fns = []
    for i in range(bufs.n):
        args = (bufs.q(i), bufs.k(i), bufs.cos(i), bufs.sin(i)) + ((bufs.pos(i),) if decode else ())
        fns.append(partial(plan.execute, *args))
    return Runner(fns, lambda: (fns[0](), (bufs.q(0), bufs.k(0)))[1], case.layout, case.interleaved,
                  f"{case.layout}/{_pairing(case.interleaved)}", True, _cupy_capture(ctx, fns),
                  "RopePlan.execute, in place")


def setup_blog_variant(variant: str, ctx, case: Case, bufs: SetBuffers) -> Runner:
    from .blog import prepare_blog_variant

    # Validated and packed once (the blog prepares its (cos, sin) table ahead too): the timed
    # calls are the blog's launches alone, capturable like ours.
    fns = [prepare_blog_variant(variant, bufs.q(i), bufs.k(i), bufs.cos(i), bufs.sin(i), q_out=bufs.q(i),
                                k_out=bufs.k(i)) for i in range(bufs.n)]
    return Runner(fns, lambda: (fns[0](), (bufs.q(0), bufs.k(0)))[1], "bhsd", True, "bhsd/inter", True,
                  _cupy_capture(ctx, fns), f"blog {variant} kernel (table packed once), in place")


def setup_ours_tail(ctx, case: Case, bufs: SetBuffers) -> Runner:
    from .tail import TailRoPEForward

    plan = TailRoPEForward(bufs.q(0), bufs.cos(0), bufs.sin(0), bufs.out(0)).check_support().compile()
    fns = [partial(plan.execute, bufs.q(i), bufs.cos(i), bufs.sin(i), bufs.out(i)) for i in range(bufs.n)]
    return Runner(fns, lambda: (fns[0](), (bufs.out(0),))[1], "thd", True, "thd", True, _cupy_capture(ctx, fns),
                  "TailRoPEForward.execute")


# --- plain CuPy ----------------------------------------------------------------------------------


def cupy_rope(cp, x, C, S, interleaved: bool, dtype: str):
    """What a CuPy user writes: ``x*cos + rotate(x)*sin`` with broadcasting, in FP32."""
    if dtype == "bfloat16":
        xf = bf16_bits_to_f32(cp, x)
    else:
        xf = x.astype(cp.float32, copy=False)
    if interleaved:
        rot = cp.stack((-xf[..., 1::2], xf[..., 0::2]), axis=-1).reshape(xf.shape)
    else:
        h = xf.shape[-1] // 2
        rot = cp.concatenate((-xf[..., h:], xf[..., :h]), axis=-1)
    y = xf * C + rot * S
    if dtype == "bfloat16":
        return f32_to_bf16_bits(cp, y)
    return y.astype(x.dtype, copy=False)


def _expand_pairs(cp, t, interleaved: bool):
    """[..., D/2] table -> [..., D] per channel: repeated (interleaved) or duplicated (half-split)."""
    return cp.repeat(t, 2, axis=-1) if interleaved else cp.concatenate((t, t), axis=-1)


def setup_cupy_general(ctx, case: Case, bufs: SetBuffers) -> Runner:
    cp = ctx.cp
    il, dt = case.interleaved, case.dtype
    fns, outs = [], {}
    for i in range(bufs.n):
        c, s = bufs.cos(i), bufs.sin(i)
        if case.group == "decode":
            p = bufs.pos(i)
            c, s = c[p], s[p]                      # HF-style: gathered once per step, outside the call
        C, S_ = _expand_pairs(cp, c, il), _expand_pairs(cp, s, il)
        if case.layout in ("bshd", "thd"):
            C, S_ = C[:, None, :], S_[:, None, :]   # [tokens, 1, D] against [.., tokens, H, D]
        q, k = bufs.q(i, native=False), bufs.k(i, native=False)
        fns.append(partial(_cupy_qk, cp, q, k, C, S_, il, dt, outs if i == 0 else None))
    return Runner(fns, lambda: (fns[0](), (outs["q"], outs["k"]))[1], case.layout, il,
                  f"{case.layout}/{_pairing(il)}", False, None, "FP32 elementwise, out of place")


def _cupy_qk(cp, q, k, C, S, il, dt, keep):
    qo = cupy_rope(cp, q, C, S, il, dt)
    ko = cupy_rope(cp, k, C, S, il, dt)
    if keep is not None:
        keep["q"], keep["k"] = qo, ko


def setup_cupy_tail(ctx, case: Case, bufs: SetBuffers) -> Runner:
    cp = ctx.cp
    keep: dict = {}
    fns = [partial(_cupy_tail_call, cp, bufs.q(i, native=False), bufs.cos(i), bufs.sin(i), keep if i == 0 else None)
           for i in range(bufs.n)]
    return Runner(fns, lambda: (fns[0](), (keep["out"],))[1], "thd", True, "thd", False, None,
                  "FP32 elementwise on the bits, out of place")


def cupy_tail(cp, x_bits, cos, sin):
    out = x_bits.copy()
    t = bf16_bits_to_f32(cp, x_bits[..., -2 * TAIL_COLS:])
    a, b = t[..., 0::2], t[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    rot = cp.empty_like(t)
    rot[..., 0::2] = a * c - b * s
    rot[..., 1::2] = b * c + a * s
    out[..., -2 * TAIL_COLS:] = f32_to_bf16_bits(cp, rot)
    return out


def _cupy_tail_call(cp, x, c, s, keep):
    o = cupy_tail(cp, x, c, s)
    if keep is not None:
        keep["out"] = o


# --- PyTorch: Hugging Face eager, torch.compile, Liger ------------------------------------------


def _torch_tables(ctx, case: Case, bufs: SetBuffers, i: int, dtype):
    """HF's cos/sin for set i in the q dtype: [1, S, D] (positions shared by the batch) or, for
    decode, [T, 1, D] gathered at the set's positions (HF computes them once per step)."""
    torch = ctx.peers.torch
    c = torch.from_dlpack(bufs.cos(i))
    s = torch.from_dlpack(bufs.sin(i))
    if case.group == "decode":
        p = torch.from_dlpack(bufs.pos(i)).long()
        c, s = c[p], s[p]
    c = torch.cat((c, c), dim=-1).to(dtype)
    s = torch.cat((s, s), dim=-1).to(dtype)
    if case.group == "decode":
        return c[:, None, :].contiguous(), s[:, None, :].contiguous()
    return c[None].contiguous(), s[None].contiguous()


def _torch_qk_views(ctx, case: Case, bufs: SetBuffers, i: int, physical: str):
    """q, k as HF sees them: logical [B, H, S, D]; decode: [T, H, 1, D] made as HF makes it,
    ``q_proj(x).view(T, 1, H, D).transpose(1, 2)`` (Liger reads the token stride from it)."""
    torch = ctx.peers.torch
    q = to_torch(torch, bufs.q(i, native=False), case.dtype)
    k = to_torch(torch, bufs.k(i, native=False), case.dtype)
    if case.group == "decode":
        T, D = case.T, case.D
        return q.view(T, 1, case.H, D).transpose(1, 2), k.view(T, 1, case.Hkv, D).transpose(1, 2)
    if physical == "bshd":
        return q.transpose(1, 2), k.transpose(1, 2)
    return q, k


def _torch_runner(ctx, case: Case, bufs: SetBuffers, physical: str, call, in_place: bool, note: str) -> Runner:
    torch = ctx.peers.torch
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[case.dtype]
    sets = []
    for i in range(bufs.n):
        q, k = _torch_qk_views(ctx, case, bufs, i, physical)
        c, s = _torch_tables(ctx, case, bufs, i, tdtype)
        sets.append((q, k, c, s))
    fns = [partial(call, *a) for a in sets]
    decode = case.group == "decode"

    def run_once():
        qo, ko = call(*sets[0], first=True)
        if decode:
            return qo.squeeze(2), ko.squeeze(2)
        return qo, ko

    def capture(indices):
        return capture_torch(torch, [fns[i] for i in indices])

    out_layout = "thd" if decode else "bhsd"
    pairing = "half"
    lay = "thd" if decode else physical
    return Runner(fns, run_once, out_layout, False, f"{lay}/{pairing}", False, capture,
                  note + (", in place" if in_place else ", out of place"))


def setup_torch_general(compiled: bool, ctx, case: Case, bufs: SetBuffers) -> Runner:
    peers = ctx.peers
    fn = peers.compiled["general"] if compiled else peers.hf_apply

    def call(q, k, c, s, first=False):
        if compiled and first:
            return peers.first_compiled_call("general", fn, (q, k, c, s))
        return fn(q, k, c, s)

    note = ("torch.compile(dynamic=False) of " if compiled else "") + peers.hf_source.split(" (")[0]
    return _torch_runner(ctx, case, bufs, bufs.layout, call, False, note)


def setup_liger(ctx, case: Case, bufs: SetBuffers) -> Runner:
    apply = ctx.peers.liger

    def call(q, k, c, s, first=False):
        return apply(q, k, c, s)

    return _torch_runner(ctx, case, bufs, bufs.layout, call, True, "LigerRopeFunction (Triton), HF layout")


def setup_torch_tail(compiled: bool, ctx, case: Case, bufs: SetBuffers) -> Runner:
    peers = ctx.peers
    torch = peers.torch
    fn = peers.compiled["tail"] if compiled else peers.tail_apply
    sets = [(to_torch(torch, bufs.q(i, native=False), "bfloat16"), torch.from_dlpack(bufs.cos(i)),
             torch.from_dlpack(bufs.sin(i))) for i in range(bufs.n)]
    fns = [partial(fn, *a) for a in sets]

    def run_once():
        if compiled:
            return (peers.first_compiled_call("tail", fn, sets[0]),)
        return (fn(*sets[0]),)

    def capture(indices):
        return capture_torch(torch, [fns[i] for i in indices])

    note = ("torch.compile(dynamic=False) of " if compiled else "") + "the seed's expression, FP32 math"
    return Runner(fns, run_once, "thd", True, "thd", False, capture, note)


# --- which implementation runs where -----------------------------------------------------------


@dataclass(frozen=True)
class Impl:
    name: str
    peer: str | None       # the --peers name, None for ours
    layout_for: object     # (case) -> physical layout of its buffers, or None when it does not apply
    setup: object          # (ctx, case, bufs) -> Runner


def _same_layout(case: Case) -> str:
    return case.layout


def _torch_layout(case: Case) -> str | None:
    """HF eager/compile: bhsd (HF's logical layout, contiguous) half-split; on the blog's interleaved
    shape it runs half-split (noted); decode and tail as they come."""
    if case.group == "general":
        return "bhsd" if (case.layout == "bhsd" and not case.interleaved) else None
    return case.layout


def _liger_layout(case: Case) -> str | None:
    """Liger rotates [B, S, H, D] memory seen as [B, H, S, D] (HF's q_proj(...).view().transpose()),
    in place; given contiguous bhsd it would copy first. Half-split only; no tail."""
    if case.group == "tail":
        return None
    if case.group == "general":
        return "bshd" if (case.layout == "bshd" and not case.interleaved) else None
    if case.group == "blog":
        return "bshd"
    return case.layout


def impls_for(case: Case) -> list[Impl]:
    tail = case.group == "tail"
    out = []
    if case.group == "blog":
        out += [Impl(v, None, _same_layout, partial(setup_blog_variant, v)) for v in BLOG_VARIANTS]
    out.append(Impl(OURS, None, _same_layout, setup_ours_tail if tail else setup_ours_general))
    out.append(Impl("cupy", "cupy", _same_layout, setup_cupy_tail if tail else setup_cupy_general))
    out.append(Impl("torch", "torch", _torch_layout,
                    partial(setup_torch_tail, False) if tail else partial(setup_torch_general, False)))
    out.append(Impl("torch.compile", "torch.compile", _torch_layout,
                    partial(setup_torch_tail, True) if tail else partial(setup_torch_general, True)))
    out.append(Impl("liger", "liger", _liger_layout, setup_liger))
    return out


# =============================================================================================
# running one case


def check_runner(ctx, case: Case, bufs: SetBuffers, runner: Runner) -> str:
    """Run the first call of set 0 and compare it with the reference; raises Wrong."""
    if case.group == "tail":
        return _check_tail(ctx, case, bufs, runner)
    from .reference import assert_rope_close, rope_reference

    heads = (case.H, case.Hkv)
    inputs = [general_sample(case, a, bufs.layout, h) for a, h in ((bufs.q(0, False), heads[0]),
                                                                     (bufs.k(0, False), heads[1]))]
    cos, sin = ctx.cp.asnumpy(bufs.cos(0)), ctx.cp.asnumpy(bufs.sin(0))
    pos_all = ctx.cp.asnumpy(bufs.pos(0)).astype(np.int64) if case.group == "decode" else None
    outs = runner.run_once()
    ctx.stream.synchronize()
    worst = 0.0
    for (x, bi, si), out, h in zip(inputs, outs, heads):
        actual, _, _ = general_sample(case, out, runner.out_layout, h)
        spos = np.asarray(si, np.int64) if pos_all is None else pos_all[si]
        positions = np.tile(spos, len(bi))
        ref = rope_reference(x, cos, sin, positions, interleaved=runner.interleaved)
        if runner.strict:
            try:
                assert_rope_close(actual, ref, x, interleaved=runner.interleaved, dtype=np.dtype(actual.dtype))
            except AssertionError as exc:
                raise Wrong(str(exc).splitlines()[0][:300]) from None
        else:
            worst = max(worst, tolerance_check(actual, ref, x, runner.interleaved, case.dtype))
    return "ok" if runner.strict else f"ok ({worst:.2f} of tol)"


def _check_tail(ctx, case: Case, bufs: SetBuffers, runner: Runner) -> str:
    from .reference import tail_rope_reference

    cp = ctx.cp
    ti = _subsample_indices(case.T, TAIL_CHECK_TOKENS)
    x = to_host(bufs.q(0, native=False)[ti], "bfloat16")
    cos, sin = cp.asnumpy(bufs.cos(0)[ti]), cp.asnumpy(bufs.sin(0)[ti])
    (out,) = runner.run_once()
    ctx.stream.synchronize()
    actual = to_host(_bits(out)[ti], "bfloat16")
    ref = tail_rope_reference(x, cos, sin)
    differ = int(np.count_nonzero(actual.view(np.uint16) != ref.view(np.uint16)))
    if runner.strict:
        if differ:
            raise Wrong(f"{differ} of {ref.size} values differ from the bit-exact reference")
        return "bit-exact"
    lo = case.D - 2 * TAIL_COLS
    if not np.array_equal(actual[..., :lo].view(np.uint16), x[..., :lo].view(np.uint16)):
        raise Wrong("the unrotated prefix was changed")
    from .reference import rope_reference

    n, h, d = x.shape
    xt = x[..., lo:].reshape(n, h, 2 * TAIL_COLS)
    ref64 = rope_reference(xt, cos, sin, np.arange(n), interleaved=True)
    tolerance_check(actual[..., lo:], ref64, xt, True, "bfloat16")
    return "ok (bit-exact)" if not differ else f"ok ({differ}/{ref.size} not bit-exact)"


def measure(ctx, runner_fns: list, capture, small: bool, cold_n: int) -> dict:
    """Every regime for one implementation (or the copy)."""
    clock = ctx.clock
    t: dict = {"hot": clock.events(runner_fns[:1])}
    if cold_n > 1:
        t["cold"] = clock.events(runner_fns[:cold_n])
    else:
        t["cold"] = dict(t["hot"], same_as="hot")
    if small and capture is not None:
        for regime, indices in (("graph", [0] * GRAPH_HOT_CALLS), ("graph_cold", list(range(min(cold_n, GRAPH_COLD_CALLS))))):
            if regime == "graph_cold" and cold_n == 1:
                t[regime] = dict(t["graph"], same_as="graph")
                continue
            try:
                launch, keep = capture(indices)
                t[regime] = clock.events([launch], divisor=len(indices), sets=len(set(indices)))
                del launch, keep
            except Exception as exc:
                t[regime] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                with contextlib.suppress(Exception):
                    ctx.stream.synchronize()
    if small:
        t["host"] = clock.host(runner_fns[:1])
    return t


class CopyRunner:
    """Device-to-device copies moving ``moved`` bytes (half read, half written), n buffer sets."""

    def __init__(self, cp, stream, moved: int, n: int) -> None:
        self.half = max(moved // 2, 16)
        stride = -(-self.half // 256) * 256
        self.slab = cp.random.RandomState(1).standard_normal(size=(2 * n * stride) // 4, dtype=cp.float32)
        base = self.slab.data.ptr
        copy = cp.cuda.runtime.memcpyAsync
        kind = cp.cuda.runtime.memcpyDeviceToDevice
        self.pairs = [(base + 2 * i * stride, base + (2 * i + 1) * stride) for i in range(n)]  # (src, dst)
        self.fns = [partial(copy, dst, src, self.half, kind, stream.ptr) for src, dst in self.pairs]


class CopyKernelRunner:
    """The naive copy kernel (one thread per 16 bytes, ``cuda_src/bench_copy.cu``) over a
    :class:`CopyRunner`'s buffers: at small sizes, the floor of any kernel against the memcpy."""

    BLOCK = 256

    def __init__(self, stream, copy: CopyRunner, device: int) -> None:
        import ctypes

        from .launch import ArgPack, Launcher, launch_prefix, load_kernel
        from .registry import KernelSpec

        fn = load_kernel(KernelSpec("bench_copy", "bench_copy.cu", ("bench_copy_16b",)), device).functions["bench_copy_16b"]
        n16 = copy.half // 16
        prefix = launch_prefix(fn, (-(-n16 // self.BLOCK), 1, 1), (self.BLOCK, 1, 1))
        self._keep, self.fns = [], []
        for src, dst in copy.pairs:
            args = ArgPack([("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("n", ctypes.c_int64)])
            args.values.src, args.values.dst, args.values.n = src, dst, n16
            launcher = Launcher(args.address, device)
            launcher.replay = False  # a reference launched plainly, as a caller's kernel would be
            self._keep.append(args)
            self.fns.append(partial(launcher, prefix, stream.ptr))


def run_case(ctx, case: Case) -> dict:
    cp = ctx.cp
    moved, foot = case.bytes_moved(), case.footprint()
    n = cold_sets(foot, ctx.l2)
    small = moved <= SMALL_BYTES
    rec = {"id": case.id, "group": case.group, "params": case.params(), "bytes_moved": moved, "footprint": foot,
           "sets": {"cold": n, "graph_cold": min(n, GRAPH_COLD_CALLS)},
           "cold_exact": n * foot >= COLD_FACTOR * ctx.l2, "small": small, "rows": []}
    print(f"\n[{case.id}] {moved / 1e6:.3f} MB moved, {n} cold set(s) of {foot / 1e6:.3f} MB"
          + ("" if rec["cold_exact"] else f" (partial: {n * foot / 1e6:.0f} MB < {COLD_FACTOR}x L2)"), flush=True)
    print(ROW_HEADER, flush=True)
    copy = CopyRunner(cp, ctx.stream, moved, n)
    row = {"impl": COPY, "layout": "-", "check": "-", "note": f"cudaMemcpyAsync of {copy.half} bytes"}
    row["timings"] = measure(ctx, copy.fns, _cupy_capture(ctx, copy.fns), small, n)
    rec["rows"].append(row)
    print(format_row(rec, row), flush=True)
    if case.group == "tail":
        kern = CopyKernelRunner(ctx.stream, copy, ctx.device)
        row = {"impl": COPY_KERNEL, "layout": "-", "check": "reference", "note": f"one thread per 16 B, {copy.half} bytes"}
        row["timings"] = measure(ctx, kern.fns, _cupy_capture(ctx, kern.fns), small, n)
        rec["rows"].append(row)
        print(format_row(rec, row), flush=True)
        del kern
    del copy
    buffers: dict[str, SetBuffers] = {}
    for impl in impls_for(case):
        row = run_impl(ctx, case, impl, buffers, n, small, rec)
        if row is not None:
            rec["rows"].append(row)
            print(format_row(rec, row), flush=True)
    buffers.clear()
    ctx.free()
    return rec


def run_impl(ctx, case: Case, impl: Impl, buffers: dict, n: int, small: bool, rec: dict) -> dict | None:
    layout = impl.layout_for(case)
    if layout is None or (impl.peer is not None and impl.peer not in ctx.peers.wanted):
        return None
    row = {"impl": impl.name, "layout": layout, "check": "", "note": "", "timings": {}}
    if impl.peer is not None and not ctx.peers.available(impl.peer):
        row["check"] = "skip: unavailable (see the skip lines)"
        return row
    runner = None
    try:
        if layout not in buffers:
            buffers[layout] = SetBuffers(cp=ctx.cp, case=case, layout=layout, n=n, seed=ctx.seed)
        runner = impl.setup(ctx, case, buffers[layout])
        row["layout"], row["note"] = runner.layout_note, runner.note
        row["check"] = check_runner(ctx, case, buffers[layout], runner)
    except Skip as exc:
        row["check"] = f"skip: {exc}"
        return row
    except Wrong as exc:
        row["check"] = f"WRONG: {exc}"
        return row
    except Exception as exc:
        row["check"] = f"error: {type(exc).__name__}: {exc}"[:400]
        _recover(ctx)
        return row
    try:
        row["timings"] = measure(ctx, runner.fns, runner.capture, small, n)
    except Exception as exc:
        row["note"] += f"; timing failed: {type(exc).__name__}: {exc}"[:300]
        _recover(ctx)
    return row


def _recover(ctx) -> None:
    with contextlib.suppress(Exception):
        if ctx.stream.is_capturing():
            ctx.stream.end_capture()
    with contextlib.suppress(Exception):
        ctx.stream.synchronize()


# --- host cost and cold start ------------------------------------------------------------------


def run_host_section(ctx) -> list[dict]:
    """Host µs per call of the prepared plans and the one-call APIs (small shapes, same arrays)."""
    from .rope import RopePlan, apply_rope_qk
    from .tail import TailRoPEForward, tail_rope

    cp = ctx.cp
    recs = []
    dcase = Case("decode", "bfloat16", "thd", False, 1, 1, 32, 8, 128)
    b = SetBuffers(ctx.cp, dcase, "thd", 2, ctx.seed)
    qk = [(b.q(i), b.k(i), b.cos(i), b.sin(i), b.pos(i)) for i in range(2)]
    one = partial(apply_rope_qk, b.q(0), b.k(0), b.cos(0), b.sin(0), positions=b.pos(0), layout="thd",
                  q_out=b.q(0), k_out=b.k(0))
    copy = CopyRunner(cp, ctx.stream, dcase.bytes_moved(), 1)
    recs.append(_host_record(ctx, "host/decode-bf16-T=1", dcase, plan_host_rows(
        "RopePlan.execute", lambda: RopePlan(*qk[0][:4], positions=b.pos(0), layout="thd").compile(), qk) + [
        ("apply_rope_qk (one call, in place)", [one]),
        ("cudaMemcpyAsync (reference)", copy.fns[:1]),
    ]))
    tcase = Case("tail", "bfloat16", "thd", True, 1, 1, 64, 0, 512)
    tb = SetBuffers(ctx.cp, tcase, "thd", 2, ctx.seed)
    tsets = [(tb.q(i), tb.cos(i), tb.sin(i), tb.out(i)) for i in range(2)]
    tone = partial(tail_rope, tb.q(0), tb.cos(0), tb.sin(0))
    recs.append(_host_record(ctx, "host/tail-T=1-H=64-D=512", tcase, plan_host_rows(
        "TailRoPEForward.execute", lambda: TailRoPEForward(*tsets[0]).check_support().compile(), tsets) + [
        ("tail_rope (one call, allocates the output)", [tone]),
    ]))
    ctx.free()
    return recs


def plan_host_rows(label: str, make_plan, sets: list) -> list:
    """The host rows of one prepared plan, from ``make_plan()`` (a compiled plan) and two argument
    sets: the same arrays with graph replay on and off, the two sets alternating, and new views
    of the first set every call (the pointer checks; the slicing is included)."""
    plan, plain = make_plan(), make_plan()
    plain._launch.replay = False  # what ROPE_RTC_NO_GRAPH_REPLAY=1 gives
    same, other = (partial(plan.execute, *args) for args in sets)
    first = sets[0]
    fresh = lambda: plan.execute(*(a[:] for a in first))  # noqa: E731 - new view objects
    return [
        (f"{label} (same arrays)", [same]),
        (f"{label} (same arrays, graph replay off: cuLaunchKernel)", [partial(plain.execute, *first)]),
        (f"{label} (2 remembered array sets alternating)", [same, other]),
        (f"{label} (new views each call: pointer checks; incl. {len(first)} slicings)", [fresh]),
    ]


def _host_record(ctx, ident: str, case: Case, items: list) -> dict:
    rec = {"id": ident, "group": "host", "params": case.params(), "bytes_moved": case.bytes_moved(),
           "footprint": case.footprint(), "sets": {}, "cold_exact": False, "small": True, "rows": []}
    print(f"\n[{ident}]", flush=True)
    for name, fns in items:
        row = {"impl": name, "layout": case.layout, "check": "-", "note": "", "timings": {}}
        try:
            row["timings"]["host"] = ctx.clock.host(fns)
            print(f"  {name:<66} {row['timings']['host']['us']:8.2f} µs/call", flush=True)
        except Exception as exc:
            row["check"] = f"error: {type(exc).__name__}: {exc}"[:300]
            print(f"  {name:<66} {row['check']}", flush=True)
            _recover(ctx)
        rec["rows"].append(row)
    return rec


COLDSTART_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, ml_dtypes, cupy as cp
import rope_rtc, rope_rtc.rope, rope_rtc.tail, rope_rtc.launch, rope_rtc.build
from cuda.bindings import driver as _drv
t1 = time.perf_counter()
cp.cuda.Device(0).use(); cp.empty(1); cp.cuda.runtime.deviceSynchronize()
t2 = time.perf_counter()
rng = np.random.default_rng(0)
bf16 = ml_dtypes.bfloat16
if sys.argv[1] == "general":
    q = cp.asarray(rng.standard_normal((1, 16, 8, 128)).astype(bf16))
    k = cp.asarray(rng.standard_normal((1, 16, 2, 128)).astype(bf16))
    c, s = rope_rtc.rope_tables(16, 128, xp=cp)
else:
    x = cp.asarray(rng.standard_normal((4, 8, 512)).astype(bf16))
    ang = rng.uniform(-3, 3, (4, 32))
    c, s = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
cp.cuda.runtime.deviceSynchronize()
t3 = time.perf_counter()
if sys.argv[1] == "general":
    rope_rtc.apply_rope_qk(q, k, c, s, layout="bshd")
else:
    rope_rtc.tail_rope(x, c, s)
cp.cuda.runtime.deviceSynchronize()
t4 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "context_s": t2 - t1, "first_result_s": t4 - t3}))
"""

_COMPILE_LOG = re.compile(r"compiled (\S+) for (\S+) in ([0-9.]+) s")


def run_coldstart(ctx) -> list[dict]:
    """First result in fresh processes: empty cache, then the same (now warm) cache."""
    rows = []
    repo = str(Path(__file__).resolve().parent.parent)
    print("\n[coldstart] fresh processes, ROPE_RTC_CACHE_DIR = an empty temporary directory", flush=True)
    for scenario in ("general", "tail"):
        with tempfile.TemporaryDirectory(prefix="rope_rtc_bench_cache_") as cache:
            env = dict(os.environ, ROPE_RTC_CACHE_DIR=cache, ROPE_RTC_LOG_COMPILES="1",
                       PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p))
            env.pop("ROPE_RTC_NO_COMPILE", None)
            for state in ("empty", "warm"):
                rows.append(_coldstart_child(scenario, state, env))
                r = rows[-1]
                if r.get("error"):
                    print(f"  {scenario:<8} {state:<6} error: {r['error']}", flush=True)
                else:
                    comp = ", ".join(f"{c['kernel']} {c['seconds']:.3f} s" for c in r["compiles"]) or "none"
                    print(f"  {scenario:<8} {state:<6} import {r['import_s']:.3f} s, context {r['context_s']:.3f} s, "
                          f"first result {r['first_result_s'] * 1e3:.1f} ms; compiles: {comp}", flush=True)
    return rows


def _coldstart_child(scenario: str, state: str, env: dict) -> dict:
    row = {"scenario": scenario, "cache": state, "compiles": []}
    try:
        proc = subprocess.run([sys.executable, "-c", COLDSTART_CHILD, scenario], env=env, capture_output=True,
                              text=True, timeout=180)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            row["error"] = f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}"
            return row
        row.update(json.loads(lines[-1]))
        row["compiles"] = [{"kernel": m.group(1), "arch": m.group(2), "seconds": float(m.group(3))}
                           for m in _COMPILE_LOG.finditer(proc.stderr)]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


# =============================================================================================
# the run


class Context:
    """The GPU, the stream every measurement uses, the clock, the peers."""

    def __init__(self, args: argparse.Namespace) -> None:
        import cupy as cp

        self.cp = cp
        self.device = args.device
        cp.cuda.Device(args.device).use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.l2 = _l2_bytes(cp, args.device)
        self.clock = Clock(cp, self.stream, args.quick)
        self.seed = args.seed
        self.peers: Peers | None = None

    def free(self) -> None:
        gc.collect()
        with contextlib.suppress(Exception):
            self.stream.synchronize()
            self.cp.get_default_memory_pool().free_all_blocks()
        if self.peers is not None and self.peers.torch is not None:
            with contextlib.suppress(Exception):
                self.peers.torch.cuda.empty_cache()


def _l2_bytes(cp, device: int) -> int:
    try:
        return int(cp.cuda.Device(device).attributes["L2CacheSize"])
    except Exception:
        try:
            return int(cp.cuda.runtime.getDeviceProperties(device)["l2CacheSize"])
        except Exception:
            return 60 * MiB


def gpu_unavailable_reason() -> str | None:
    try:
        import cupy as cp
    except Exception as exc:
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        from . import driver

        reason = driver.unavailable_reason()
        if reason:
            return reason
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def environment(ctx) -> dict:
    from ._version import __version__

    cp = ctx.cp
    env: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "rope_rtc": __version__,
                 "cupy": cp.__version__}
    with contextlib.suppress(Exception):
        props = cp.cuda.runtime.getDeviceProperties(ctx.device)
        name = props.get("name", b"")
        env["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
        env["compute_capability"] = f"{props.get('major')}.{props.get('minor')}"
        env["sm_count"] = props.get("multiProcessorCount")
        env["memory_bytes"] = props.get("totalGlobalMem")
        for key in ("clockRate", "memoryClockRate", "memoryBusWidth"):
            if props.get(key) is not None:
                env[key] = props.get(key)
    env["l2_bytes"] = ctx.l2
    with contextlib.suppress(Exception):
        env["cuda_runtime"] = _cuda_version_text(cp.cuda.runtime.runtimeGetVersion())
        env["cuda_driver"] = _cuda_version_text(cp.cuda.runtime.driverGetVersion())
    with contextlib.suppress(Exception):
        from .toolchain import nvrtc_version

        env["nvrtc"] = "%d.%d" % nvrtc_version()
    for dist in ("cuda-bindings", "numpy", "ml_dtypes", "torch", "triton", "transformers", "liger-kernel", "matplotlib"):
        v = _dist_version(dist)
        if v:
            env[dist] = v
    env["nvidia_smi"] = _nvidia_smi()
    return env


def _cuda_version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nvidia_smi() -> dict | str:
    fields = ("name", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "power.limit", "temperature.gpu", "persistence_mode")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        if out.returncode != 0:
            return f"nvidia-smi exit {out.returncode}"
        first = out.stdout.strip().splitlines()[0]
        return dict(zip(fields, (v.strip() for v in first.split(","))))
    except Exception as exc:
        return f"unavailable ({type(exc).__name__})"


def measure_big_copy(ctx) -> dict | None:
    try:
        copy = CopyRunner(ctx.cp, ctx.stream, BIG_COPY_MOVED, 1)
        t = ctx.clock.events(copy.fns)
        del copy
        ctx.free()
        return {"bytes_moved": BIG_COPY_MOVED, "us": t["us"], "gbps": BIG_COPY_MOVED / t["us"] / 1e3, "timing": t}
    except Exception as exc:
        print(f"big copy failed: {type(exc).__name__}: {exc}", flush=True)
        _recover(ctx)
        ctx.free()
        return None


def run_benchmark(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    deadline = started + args.time_budget
    ctx = Context(args)
    json_path = default_json_path(args)
    result: dict = {"schema": SCHEMA, "tool": "rope_rtc.bench",
                    "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "command": regenerate_command(args), "argv": sys.argv[1:], "quick": args.quick,
                    "options": {"peers": args.peer_list, "cases": args.cases, "compile_budget_s": args.compile_budget,
                                "time_budget_s": args.time_budget, "seed": args.seed},
                    "skips": [], "cases": [], "host": [], "coldstart": []}
    with ctx.stream:
        result["env"] = environment(ctx)
        result["l2_bytes"] = ctx.l2
        env = result["env"]
        print(f"{env.get('gpu', '?')}: L2 {ctx.l2 / MiB:.0f} MiB, CUDA driver {env.get('cuda_driver', '?')}, "
              f"NVRTC {env.get('nvrtc', '?')}, CuPy {env.get('cupy')}, torch {env.get('torch', '-')}, "
              f"Liger {env.get('liger-kernel', '-')}", flush=True)
        tokens = args.case_tokens
        if selected("coldstart", "coldstart", tokens):
            result["coldstart"] = run_coldstart(ctx)
        ctx.peers = Peers(args.peer_list, args.compile_budget, ctx.stream.ptr)
        result["skips"] = ctx.peers.skips
        result["env"].update({f"peer_{k}": v for k, v in ctx.peers.versions.items()})
        result["env"]["hf_apply"] = ctx.peers.hf_source
        if selected("host", "host", tokens):
            try:
                result["host"] = run_host_section(ctx)
            except Exception as exc:
                result["skips"].append(f"host section failed: {type(exc).__name__}: {exc}")
                print(result["skips"][-1], flush=True)
                _recover(ctx)
        result["big_copy"] = measure_big_copy(ctx)
        for case in all_cases(args.quick):
            if not selected(case.id, case.group, tokens):
                continue
            if time.monotonic() > deadline:
                line = f"skip {case.id}: time budget of {args.time_budget:.0f} s spent (--time-budget)"
                result["skips"].append(line)
                print(line, flush=True)
                continue
            try:
                result["cases"].append(run_case(ctx, case))
            except Exception as exc:
                line = f"case {case.id} failed: {type(exc).__name__}: {exc}"[:400]
                result["skips"].append(line)
                print(line, flush=True)
                _recover(ctx)
                ctx.free()
            result["compile_log"] = ctx.peers.compile_log
            result["elapsed_s"] = round(time.monotonic() - started, 1)
            write_json(result, json_path)   # partial results survive a kill
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["compile_log"] = ctx.peers.compile_log if ctx.peers else []
    return result


# =============================================================================================
# derived figures


def rows_by_impl(case_rec: dict) -> dict[str, dict]:
    return {r["impl"]: r for r in case_rec["rows"]}


def timing(row: dict | None, regime: str) -> float | None:
    """Median µs per call of ``regime``. ``"cold*"`` is the device time with cold L2: the CUDA
    graph replay figure where one was captured (small cases, where a loop of calls measures the
    host's launch rate rather than the GPU), else the event-timed loop."""
    if not row:
        return None
    if regime == "cold*":
        return timing(row, "graph_cold") or timing(row, "cold")
    t = row.get("timings", {}).get(regime)
    if not t or "us" not in t:
        return None
    return float(t["us"])


def gbps(case_rec: dict, row: dict | None, regime: str) -> float | None:
    us = timing(row, regime)
    return case_rec["bytes_moved"] / us / 1e3 if us else None


def pct_of_copy(case_rec: dict, row: dict | None, regime: str) -> float | None:
    us = timing(row, regime)
    cu = timing(rows_by_impl(case_rec).get(COPY), regime)
    return 100.0 * cu / us if us and cu else None


def ok(row: dict | None) -> bool:
    return bool(row) and str(row.get("check", "")).startswith(("ok", "bit-exact"))


def fastest_peer(case_rec: dict, regime: str) -> tuple[str, float] | None:
    best = None
    for r in case_rec["rows"]:
        if r["impl"] in PEERS and ok(r):
            us = timing(r, regime)
            if us and (best is None or us < best[1]):
                best = (r["impl"], us)
    return best


# =============================================================================================
# reporting: tables


ROW_HEADER = (f"  {'impl':<14}{'layout':<11}{'check':<22}{'hot µs':>10}{'cold µs':>10}{'GB/s':>9}{'%copy':>7}"
              f"{'graph µs':>10}{'gr.cold':>9}{'host µs':>9}")


def _f(v, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"


def format_row(case_rec: dict, row: dict) -> str:
    check = str(row.get("check", ""))
    if len(check) > 21:
        check = check[:20] + "…"
    return (f"  {row['impl']:<14}{row.get('layout', ''):<11}{check:<22}"
            f"{_f(timing(row, 'hot'), '.2f', 10)}{_f(timing(row, 'cold'), '.2f', 10)}"
            f"{_f(gbps(case_rec, row, 'cold'), '.0f', 9)}{_f(pct_of_copy(case_rec, row, 'cold'), '.1f', 7)}"
            f"{_f(timing(row, 'graph'), '.2f', 10)}{_f(timing(row, 'graph_cold'), '.2f', 9)}"
            f"{_f(timing(row, 'host'), '.2f', 9)}")


def _cell(case_rec: dict, row: dict | None, regime: str = "cold*") -> str:
    if row is None:
        return "-"
    if not ok(row):
        chk = str(row.get("check", ""))
        return "WRONG" if chk.startswith("WRONG") else ("skip" if chk.startswith("skip") else "error")
    return _cell_reference(case_rec, row, regime)


def blog_table(result: dict) -> list[list[str]]:
    impls = list(BLOG_VARIANTS) + [OURS] + list(PEERS)
    head = ["S", "MB moved", "copy GB/s"] + [("auto" if i == OURS else i) for i in impls]
    rows = [head]
    for c in result["cases"]:
        if c["group"] != "blog":
            continue
        by = rows_by_impl(c)
        rows.append([str(c["params"]["S"]), f"{c['bytes_moved'] / 1e6:.1f}", _cell_copy(c)]
                    + [_cell(c, by.get(i)) for i in impls])
    return rows


def _short_id(c: dict) -> str:
    """The case id without its group (each table is one group)."""
    return c["id"].split("/", 1)[1] if "/" in c["id"] else c["id"]


def _cell_copy(c: dict) -> str:
    g = gbps(c, rows_by_impl(c).get(COPY), "cold*")
    return "-" if g is None else f"{g:.0f}"


def prefill_table(result: dict, group: str) -> list[list[str]]:
    rows = [["case", "MB moved", "copy GB/s", "rope_rtc GB/s (%copy)", "fastest peer", "cupy"]]
    for c in result["cases"]:
        if c["group"] != group:
            continue
        by = rows_by_impl(c)
        best = fastest_peer(c, "cold*")
        best_txt = "-"
        if best:
            best_txt = f"{best[0]} {_cell(c, by[best[0]])}"
        rows.append([_short_id(c), f"{c['bytes_moved'] / 1e6:.1f}", _cell_copy(c), _cell(c, by.get(OURS)), best_txt,
                     _cell(c, by.get("cupy"))])
    return rows


def latency_table(result: dict, group: str) -> list[list[str]]:
    """Small cases: GPU µs under graph replay (hot / cold) and host µs per call, ours and peers."""
    impls = [COPY, OURS] + list(PEERS)
    rows = [["case"] + impls]
    for c in result["cases"]:
        if c["group"] != group or not c.get("small"):
            continue
        by = rows_by_impl(c)
        cells = [_short_id(c)]
        for i in impls:
            r = by.get(i)
            if r is None:
                cells.append("-")
            elif i != COPY and not ok(r):
                cells.append(_cell(c, r))
            else:
                cells.append("/".join("-" if timing(r, g) is None else f"{timing(r, g):.2f}"
                                      for g in ("graph", "graph_cold", "host")))
        rows.append(cells)
    return rows


def tail_table(result: dict, copy_kernel: bool = True) -> list[list[str]]:
    """The tail cases; ``copy_kernel=False`` leaves out the reference kernel's column (the printed
    summary must fit the device tool's output tail)."""
    rows = [["case", "MB moved", "copy GB/s", "copy kernel GB/s (%copy)", "rope_rtc GB/s (%copy)", "graph µs",
             "host µs", "fastest peer"]]
    for c in result["cases"]:
        if c["group"] != "tail":
            continue
        by = rows_by_impl(c)
        ours = by.get(OURS)
        best = fastest_peer(c, "cold*")
        rows.append([_short_id(c) + ("" if c.get("cold_exact") else " *"), f"{c['bytes_moved'] / 1e6:.3f}", _cell_copy(c),
                     _cell_reference(c, by.get(COPY_KERNEL)), _cell(c, ours),
                     _f(timing(ours, "graph"), ".2f", 0).strip(), _f(timing(ours, "host"), ".2f", 0).strip(),
                     f"{best[0]} {_cell(c, by[best[0]])}" if best else "-"])
    if not copy_kernel:
        rows = [r[:3] + r[4:] for r in rows]
    return rows


def _cell_reference(case_rec: dict, row: dict | None, regime: str = "cold*") -> str:
    """GB/s and % of the copy, with no correctness check to show (the copy kernel's row)."""
    if row is None:
        return "-"
    g, p = gbps(case_rec, row, regime), pct_of_copy(case_rec, row, regime)
    if g is None:
        return "-"
    return f"{g:.0f} ({p:.0f}%)" if p is not None else f"{g:.0f}"


def host_table(result: dict) -> list[list[str]]:
    rows = [["shape", "call", "host µs/call"]]
    for rec in result.get("host", []):
        for r in rec["rows"]:
            us = timing(r, "host")
            rows.append([rec["id"].removeprefix("host/"), r["impl"], "-" if us is None else f"{us:.2f}"])
    return rows


def coldstart_table(result: dict) -> list[list[str]]:
    rows = [["API", "cache", "import s", "context s", "first result ms", "compiles"]]
    for r in result.get("coldstart", []):
        if r.get("error"):
            rows.append([r["scenario"], r["cache"], "error", "", "", r["error"][:60]])
            continue
        comp = "; ".join(f"{c['kernel']} {c['seconds']:.3f} s" for c in r.get("compiles", [])) or "none"
        rows.append([r["scenario"], r["cache"], f"{r['import_s']:.3f}", f"{r['context_s']:.3f}",
                     f"{r['first_result_s'] * 1e3:.1f}", comp])
    return rows


def text_table(rows: list[list[str]]) -> str:
    if not rows:
        return ""
    widths = [max(len(str(r[i])) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    if len(rows) < 2:
        return "_no cases in this run_"
    esc = [[str(v).replace("|", "\\|") for v in r] for r in rows]
    out = ["| " + " | ".join(esc[0]) + " |", "|" + "|".join(" --- " for _ in esc[0]) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(out)


# =============================================================================================
# reporting: targets


def _host_points(result: dict, cases: list, host_row: str) -> list:
    """(µs, where) host times of our rows in ``cases`` plus the host-cost section's ``host_row``."""
    return ([(timing(rows_by_impl(c).get(OURS), "host"), c["id"]) for c in cases]
            + [(timing(r, "host"), rec["id"]) for rec in result.get("host", []) for r in rec["rows"]
               if r["impl"] == host_row])


def evaluate_targets(result: dict) -> list[dict]:
    """Each target of issues 4 and 5: PASS / MISS (with the gap) / N/A (not measured in this run)."""
    cases = result.get("cases", [])
    out: list[dict] = []

    def add(name, status, measured, gap="", where=""):
        out.append({"target": name, "status": status, "measured": measured, "gap": gap, "where": where})

    # prefill fraction of the same-size copy (cold)
    prefill = [c for c in cases if c["group"] in ("general", "blog")]
    for i, (floor, need) in enumerate(PREFILL_RULES):
        ceiling = PREFILL_RULES[i - 1][0] if i else None
        name = (f"prefill >= {need:.0f}% of copy, {floor // MiB} MiB+ moved" if ceiling is None
                else f"prefill >= {need:.0f}% of copy, {floor // MiB}-{ceiling // MiB} MiB moved")
        pts = [(pct_of_copy(c, rows_by_impl(c).get(OURS), "cold*"), c["id"]) for c in prefill
               if c["bytes_moved"] >= floor and (ceiling is None or c["bytes_moved"] < ceiling)]
        _worst_at_least(add, name, pts, need, "%")
    # never slower than the fastest peer
    worst = None
    for c in cases:
        if c["group"] not in ("general", "blog", "decode", "tail"):
            continue
        ours = rows_by_impl(c).get(OURS)
        for regime in ("cold*", "graph"):
            best, us = fastest_peer(c, regime), timing(ours, regime) if ok(ours) else None
            if best and us:
                ratio = us / best[1]
                if worst is None or ratio > worst[0]:
                    worst = (ratio, f"{c['id']} ({regime}) vs {best[0]}")
    if worst is None:
        add("never slower than the fastest peer (within 1%)", "N/A", "no peer measured")
    else:
        st = "PASS" if worst[0] <= NOISE else "MISS"
        add("never slower than the fastest peer (within 1%)", st, f"worst time ratio {worst[0]:.3f}",
            "" if st == "PASS" else f"{(worst[0] - 1) * 100:.1f}% slower", worst[1])
    # decode
    dec = [c for c in cases if c["group"] == "decode"]
    _worst_at_most(add, f"decode GPU time under graph replay <= {DECODE_GPU_US} µs",
                   [(timing(rows_by_impl(c).get(OURS), "graph"), c["id"]) for c in dec], DECODE_GPU_US, " µs")
    _worst_at_most(add, f"RopePlan.execute host time <= {PLAN_HOST_US} µs",
                   _host_points(result, dec, "RopePlan.execute (same arrays)"), PLAN_HOST_US, " µs")
    # tail
    tail = [c for c in cases if c["group"] == "tail"]
    # The issue's condition is a cold L2. Shapes of a few KB cannot be measured cold (4096 sets of
    # them still fit the L2); there latency, not bandwidth, sets the time, even for the naive
    # copy kernel, so they are reported beside the target rather than judged by it.
    cold = [c for c in tail if c.get("cold_exact")]
    warm = [c for c in tail if not c.get("cold_exact")]
    _worst_at_least(add, f"tail >= {TAIL_COPY_PCT:.0f}% of copy, cold L2, every shape measured cold",
                    [(pct_of_copy(c, rows_by_impl(c).get(OURS), "cold*"), c["id"]) for c in cold], TAIL_COPY_PCT, "%")
    _tail_too_small(add, warm)
    key = [c for c in tail if c["params"]["T"] in (1, 4) and (c["params"]["H"], c["params"]["D"]) == (64, 512)]
    _worst_at_most(add, f"tail T=1,4 H=64 D=512 GPU time under graph replay <= {TAIL_GPU_US} µs",
                   [(timing(rows_by_impl(c).get(OURS), "graph"), c["id"]) for c in key], TAIL_GPU_US, " µs")
    _worst_at_most(add, f"TailRoPEForward.execute host time <= {TAIL_HOST_US} µs",
                   _host_points(result, key, "TailRoPEForward.execute (same arrays)"), TAIL_HOST_US, " µs")
    # cold start
    cs = [r for r in result.get("coldstart", []) if not r.get("error")]
    _worst_at_most(add, f"warm cache: first result in a fresh process <= {WARM_FIRST_S * 1e3:.0f} ms beyond imports",
                   [(r["first_result_s"] * 1e3, r["scenario"]) for r in cs if r["cache"] == "warm"],
                   WARM_FIRST_S * 1e3, " ms")
    _worst_at_most(add, f"cold compile of one kernel <= {COMPILE_ONE_S:.0f} s",
                   [(c["seconds"], c["kernel"]) for r in cs for c in r.get("compiles", [])], COMPILE_ONE_S, " s")
    return out


def _tail_too_small(add, cases: list) -> None:
    """INFO: the tail kernel and the naive copy kernel, as % of the memcpy, on shapes too small for a cold L2."""
    pts = [(pct_of_copy(c, rows_by_impl(c).get(OURS), "cold*"), c["id"]) for c in cases]
    pts = [(v, w) for v, w in pts if v is not None]
    if not pts:
        return
    ref = [pct_of_copy(c, rows_by_impl(c).get(COPY_KERNEL), "cold*") for c in cases]
    ref = [v for v in ref if v is not None]
    v, where = min(pts)
    measured = f"worst {v:.1f}%" + (f"; copy kernel worst {min(ref):.1f}%" if ref else "")
    add(f"tail on {len(cases)} shapes too small for a cold L2 (latency-bound), % of copy", "INFO", measured, "", where)


def _worst_at_least(add, name, pts, need, unit):
    pts = [(v, w) for v, w in pts if v is not None]
    if not pts:
        add(name, "N/A", "not measured in this run")
        return
    v, where = min(pts)
    st = "PASS" if v >= need * (1 - 1e-12) else "MISS"
    add(name, st, f"worst {v:.1f}{unit}", "" if st == "PASS" else f"{need - v:.1f}{unit} short", where)


def _worst_at_most(add, name, pts, limit, unit):
    pts = [(v, w) for v, w in pts if v is not None]
    if not pts:
        add(name, "N/A", "not measured in this run")
        return
    v, where = max(pts)
    st = "PASS" if v <= limit * (1 + 1e-12) else "MISS"
    add(name, st, f"worst {v:.2f}{unit}", "" if st == "PASS" else f"{v - limit:.2f}{unit} over", where)


def targets_table(result: dict) -> list[list[str]]:
    rows = [["status", "target", "measured", "gap", "where"]]
    for t in evaluate_targets(result):
        rows.append([t["status"], t["target"], t["measured"], t["gap"], t["where"]])
    return rows


# =============================================================================================
# reporting: stdout, JSON, plot, docs


def summary_text(result: dict, targets_only: bool = False) -> str:
    parts = []
    if not targets_only:
        env = result.get("env", {})
        big = result.get("big_copy") or {}
        parts.append(f"=== summary: {env.get('gpu', '?')}, {result.get('created', '')}, "
                     f"{'quick' if result.get('quick') else 'full'} run, {result.get('elapsed_s', '?')} s; "
                     f"4 GiB copy {big.get('gbps', float('nan')):.0f} GB/s; GB/s and % of the size-matched copy, cold L2")
        for title, rows in (("blog configuration (FP32 interleaved bhsd, fused q+k in place; peers: half-split)", blog_table(result)),
                            ("general kernel (fused q+k in place)", prefill_table(result, "general")),
                            ("decode (bf16 thd, Hq=32 Hkv=8): GPU µs graph / graph cold / host µs", latency_table(result, "decode")),
                            ("tail RoPE (* partial cold footprint)", tail_table(result, copy_kernel=False)),
                            ("host cost", host_table(result)), ("cold start", coldstart_table(result))):
            if len(rows) > 1:
                parts.append(f"--- {title}\n{text_table(rows)}")
        if result.get("skips"):
            parts.append("--- skipped\n" + "\n".join(result["skips"]))
    parts.append("=== targets (issues 4 and 5)\n" + text_table(targets_table(result)))
    return "\n\n".join(parts)


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def plot_series(result: dict) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{panel: {label: [(bytes moved, GB/s cold)]}} for the plot (testable without matplotlib)."""
    panels: dict[str, dict[str, list]] = {"RoPE (blog, general, decode)": {}, "tail RoPE": {}}
    for c in result.get("cases", []):
        panel = "tail RoPE" if c["group"] == "tail" else "RoPE (blog, general, decode)"
        for r in c["rows"]:
            if r["impl"] != COPY and not ok(r):
                continue
            g = gbps(c, r, "cold*")
            if g is None:
                continue
            label = "size-matched copy" if r["impl"] == COPY else (
                f"rope_rtc {c['group']}" if r["impl"] == OURS else r["impl"])
            panels[panel].setdefault(label, []).append((float(c["bytes_moved"]), g))
    for series in panels.values():
        for label in series:
            series[label].sort()
    return panels


def write_plot(result: dict, path: Path) -> str | None:
    """Bandwidth against bytes moved; returns None on success, else why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib unavailable ({type(exc).__name__}: {exc}); pip install 'rope-rtc[plot]'"
    panels = plot_series(result)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    big = (result.get("big_copy") or {}).get("gbps")
    for ax, (title, series) in zip(axes, panels.items()):
        for label, pts in sorted(series.items()):
            xs, ys = zip(*pts)
            if label == "size-matched copy":
                ax.plot(xs, ys, color="black", linewidth=2, label=label, zorder=1)
            else:   # markers only: one implementation's points span dtypes and layouts
                ax.plot(xs, ys, marker="o", markersize=4, linestyle="none", label=label, zorder=2)
        if big:
            ax.axhline(big, color="grey", linestyle="--", linewidth=1, label=f"4 GiB copy ({big:.0f} GB/s)")
        ax.set_xscale("log")
        ax.set_xlabel("bytes moved per call")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("effective bandwidth, GB/s (cold L2)")
    env = result.get("env", {})
    fig.suptitle(f"rope_rtc on {env.get('gpu', '?')} ({result.get('created', '')})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _safe_plot(result: dict, path: Path) -> str | None:
    try:
        return write_plot(result, path)
    except Exception as exc:   # a plot is never worth losing the run's report
        return f"{type(exc).__name__}: {exc}"


def gpu_slug(result: dict) -> str:
    name = str(result.get("env", {}).get("gpu", "gpu"))
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]*)\b", name)
    slug = m.group(1) if m else name
    return re.sub(r"[^a-z0-9]+", "-", slug.lower()).strip("-") or "gpu"


METHOD_MD = """\
- **Bytes moved** (the numerator of every GB/s figure) is a property of the case: input read +
  output written + the cos/sin table rows the positions use (FP32) + position indices. A peer
  that reads a wider table is not credited for it.
- **Ceiling**: a `cudaMemcpyAsync` device-to-device copy moving the same number of bytes (half
  read, half written), measured the same way in the same run; a 4 GiB copy is given for scale.
- **Regimes**: *hot* = CUDA events around back-to-back calls on the same buffers; *cold* =
  rotating among buffer sets totalling more than 4x the L2 (the same as hot when one set
  already does; marked * where the 4096-set cap leaves it partial); *graph* / *graph cold* =
  GPU time per call under CUDA-graph replay of captured calls; *host* = wall time per call of
  Python loops of 100 calls, each started on an idle stream (synchronised, untimed) so that no
  call waits for the GPU to drain a full launch queue. Figures are medians of repeated samples
  after a warm-up, on random data (never zeros).
- **Copy kernel** (tail cases): a one-thread-per-16-bytes copy kernel over the copy's buffers.
  At small sizes launch and memory latency, not bandwidth, set every kernel's time, and this
  column shows how close the simplest kernel comes to the memcpy there.
- **Checks**: every implementation's first call is compared with the reference before timing
  (rope_rtc: the project's contract, bit-exact for tail RoPE; peers: within 2 eps of their dtype
  times the pair magnitude). A wrong answer is reported and not timed.
- **Peers**: plain CuPy (FP32 elementwise, out of place); PyTorch eager with Hugging Face's
  `apply_rotary_pos_emb` (half-split, logical bhsd, out of place, cos/sin in the q dtype, as HF
  computes them once per step) and the tail seed's expression; `torch.compile(dynamic=False)` of
  the same functions; Liger's Triton `LigerRopeFunction` (half-split, in place on bshd memory
  seen as bhsd, its intended layout). On the blog's interleaved case the peers run half-split.
"""


def merge_results(base: dict, later: dict) -> dict:
    """``base`` with each case that ``later`` measured replaced by ``later``'s record of it (which
    holds its own copy ceiling and peers, measured beside it). The replacement is recorded in
    ``merged`` so the rendered page says which rows come from which run."""
    new = {c["id"]: c for c in later.get("cases", [])}
    replaced = [c["id"] for c in base.get("cases", []) if c["id"] in new]
    added = [i for i in new if i not in replaced]
    out = dict(base)
    out["cases"] = [new.get(c["id"], c) for c in base.get("cases", [])] + [new[i] for i in added]
    out["merged"] = list(base.get("merged", [])) + [{
        "created": later.get("created"), "command": later.get("command"), "cases": replaced + added,
        "gpu": later.get("env", {}).get("gpu")}]
    return out


def _merged_note(result: dict) -> list[str]:
    lines = []
    for m in result.get("merged", []):
        lines += [f"Rows of these cases come from a later run, **{m.get('created')}** on {m.get('gpu')} "
                  f"(`{m.get('command')}`), each with its own copy ceiling and peers: "
                  f"{', '.join(m.get('cases', []))}.", ""]
    return lines


def render_markdown(result: dict | None) -> str:
    head = ["# Benchmarks", "",
            "<!-- Generated by rope_rtc/bench.py (render_markdown); edit that, not this file. -->", ""]
    if result is None:
        return "\n".join(head + [
            "No run recorded yet. On the GPU machine, from the repository root:", "",
            "    PYTHONPATH=. python3 scripts/bench.py --write-docs", "",
            "writes this page, `docs/benchmarks/<gpu>.json` (every sample) and `docs/benchmarks/<gpu>.png`.",
            "A saved run re-renders without a GPU: `python3 scripts/bench.py --from-json bench.json --write-docs`.",
            "", "## Method", "", METHOD_MD])
    env = result.get("env", {})
    slug = gpu_slug(result)
    big = result.get("big_copy") or {}
    versions = ", ".join(f"{k} {env[k]}" for k in ("rope_rtc", "nvrtc", "cupy", "cuda-bindings", "torch", "triton",
                                                   "transformers", "liger-kernel") if env.get(k))
    smi = env.get("nvidia_smi") if isinstance(env.get("nvidia_smi"), dict) else {}
    lines = head + [
        f"Latest run: **{result.get('created', '?')}** on **{env.get('gpu', '?')}** "
        f"(driver {smi.get('driver_version', env.get('cuda_driver', '?'))}, CUDA driver API {env.get('cuda_driver', '?')}, "
        f"L2 {int(env.get('l2_bytes', 0)) // MiB} MiB, SM clock {smi.get('clocks.sm', '?')} of {smi.get('clocks.max.sm', '?')}); "
        f"{versions}. {'Quick' if result.get('quick') else 'Full'} run, {result.get('elapsed_s', '?')} s.", "",
        *_merged_note(result),
        "Regenerate on the GPU machine, from the repository root:", "",
        f"    {result.get('command', 'PYTHONPATH=. python3 scripts/bench.py --write-docs')}", "",
        f"Every sample and the environment: [benchmarks/{slug}.json](benchmarks/{slug}.json). "
        f"Reference copy: 4 GiB moved at **{big.get('gbps', float('nan')):.0f} GB/s**.", "",
        f"![bandwidth against bytes moved](benchmarks/{slug}.png)", "",
        "## Targets (issues 4 and 5)", "", markdown_table(targets_table(result)), "",
        "## The blog's configuration", "",
        "B=4, H=32, D=128, FP32, interleaved, bhsd, q and k rotated in place. GB/s (% of the "
        "size-matched copy), cold L2. `auto` is the production kernel (`RopePlan`).", "",
        markdown_table(blog_table(result)), "",
        "## General kernel", "", "Fused q+k in place, B=4, H=32, D=128. GB/s (% of copy), cold L2.", "",
        markdown_table(prefill_table(result, "general")), "",
        "## Decode", "", "bf16, `thd` with positions, Hq=32, Hkv=8, D=128. Per implementation: GPU µs per call "
        "under graph replay, hot / cold, then host µs per call.", "",
        markdown_table(latency_table(result, "decode")), "",
        "## Tail RoPE", "", "BF16, the cuDNN benchmark's geometries, `TailRoPEForward`. GB/s (% of copy), cold L2; "
        "GPU µs under graph replay and host µs for small shapes; the copy kernel is the naive one-thread-per-16-bytes "
        "reference. * partial cold footprint.", "",
        markdown_table(tail_table(result)), "",
        "## Host cost", "", markdown_table(host_table(result)), "",
        "## Cold start", "", "Fresh processes with an empty `ROPE_RTC_CACHE_DIR`, then the same (warm) directory. "
        "First result excludes imports and CUDA context creation, reported separately.", "",
        markdown_table(coldstart_table(result)), "",
    ]
    if result.get("skips"):
        lines += ["## Skipped", ""] + [f"- {s}" for s in result["skips"]] + [""]
    lines += ["## Method", "", METHOD_MD]
    return "\n".join(lines)


def write_docs(result: dict, docs_dir: Path, mirror: Path | None) -> list[Path]:
    slug = gpu_slug(result)
    written = []
    for root in [docs_dir] + ([mirror] if mirror else []):
        md = root / "benchmarks.md"
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(render_markdown(result))
        write_json(result, root / "benchmarks" / f"{slug}.json")
        written += [md, root / "benchmarks" / f"{slug}.json"]
        why = _safe_plot(result, root / "benchmarks" / f"{slug}.png")
        if why:
            print(f"plot skipped: {why}", flush=True)
        else:
            written.append(root / "benchmarks" / f"{slug}.png")
    return written


def report(result: dict, args: argparse.Namespace, json_path: Path | None) -> None:
    if json_path is not None:
        write_json(result, json_path)
        print(f"\nJSON: {json_path}", flush=True)
    if not args.no_plot and (args.plot or json_path is not None):
        plot_path = Path(args.plot) if args.plot else json_path.with_name("bench.png")
        why = _safe_plot(result, plot_path)
        print(f"plot skipped: {why}" if why else f"plot: {plot_path}", flush=True)
    if args.write_docs:
        docs = Path(args.docs_dir) if args.docs_dir else Path(__file__).resolve().parent.parent / "docs"
        out = os.environ.get("OUT")
        for p in write_docs(result, docs, Path(out) / "docs" if out else None):
            print(f"docs: {p}", flush=True)
    print("\n" + summary_text(result, targets_only=args.targets), flush=True)


# =============================================================================================
# entry point


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for c in all_cases(args.quick):
            if selected(c.id, c.group, args.case_tokens):
                print(f"{c.id:<40} {c.bytes_moved() / 1e6:12.3f} MB moved")
        for g in ("host", "coldstart"):
            if selected(g, g, args.case_tokens):
                print(f"{g} (section)")
        return 0
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        if args.merge_json:
            result = merge_results(result, json.loads(Path(args.merge_json).read_text()))
        report(result, args, Path(args.json) if args.json else None)
        return 0
    reason = gpu_unavailable_reason()
    if reason is not None:
        print(f"rope-rtc bench: no GPU found ({reason}); nothing to measure.\n"
              "Run it on a machine with an NVIDIA GPU, or re-render a saved run: --from-json bench.json",
              file=sys.stderr)
        return 2
    json_path = default_json_path(args)
    result = run_benchmark(args)
    report(result, args, json_path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
