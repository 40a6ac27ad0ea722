"""Run every op family on fixed random inputs with rope_rtc loaded from a given source tree, save
the outputs, and compare two trees bit for bit: the GPU check that a change to the device code (or
to what launches it) left every output as it was.

    PYTHONPATH=. python3 benchmarks/probes/bit_equality.py --trees OLD NEW [--out-dir DIR]
    PYTHONPATH=. python3 benchmarks/probes/bit_equality.py --tree PATH --out FILE.npz
    PYTHONPATH=. python3 benchmarks/probes/bit_equality.py --compare OLD.npz NEW.npz

A tree is a folder holding ``rope_rtc/`` and ``cuda_src/`` (a checkout, or a copy of one). With
``--trees`` each tree runs in its own process, both at once, with its own empty kernel cache (every
build compiled from that tree's sources), and the two result files are compared: one line per case
that differs or failed, then the counts; the exit status is 1 when any output differs or a case
failed in one tree only. The cases (about 120 launches, a few seconds of GPU time; the compiles
take most of the minute):

- general RoPE, fp32/fp16/bf16 x half-split/interleaved: the specialised build (dense bshd, bhsd,
  strided thd views of a fused buffer, cu_seqlens in place, decode-sized), the inverse rotation,
  the generic build (a partial window out of place, rows of an odd stride), cos/sin computed from
  float64 and float32 inverse frequencies (small and large launches);
- the fused QK-norm (register, split and staged builds; exact and transformers numerics; float32
  weights; a partial window);
- RoPE + paged KV-cache write (cache entries in the input dtype, FP8 e4m3 and e5m2; nhd and hnd;
  a partial window; a skipped slot);
- multimodal RoPE (contiguous and interleaved sections, thd and bhsd, small and large launches);
- the BF16 tail RoPE (head dims 128 and 512).

Outputs the API lets the caller pass are poisoned with NaN (0xff bytes for FP8 caches) first, so an
element a kernel fails to write shows as a difference too. Without a GPU the script says so and
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

D = 128


# -- the cases -------------------------------------------------------------------------------------

def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


class Cases:
    """Every case, each a method of (name) returning the output device arrays, in a fixed order."""

    def __init__(self, cp, rope_rtc):
        import ml_dtypes

        self.cp, self.rr = cp, rope_rtc
        self.dtypes = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
        cos, sin = rope_rtc.rope_tables(4096, D)
        self.cos, self.sin = self.dev(cos), self.dev(sin)
        c64, s64 = rope_rtc.rope_tables(4096, 64)  # a window of 64 channels
        self.cos64, self.sin64 = self.dev(c64), self.dev(s64)

    # every device array is made by these
    def dev(self, a: np.ndarray):
        return self.cp.asarray(a)

    def fill(self, shape, dt, value):
        return self.cp.full(shape, value, dtype=dt)

    def x(self, name, shape, dt, scale=4.0):
        return self.dev((_rng(name).standard_normal(shape) * scale).astype(dt))

    def poison(self, shape, dt):
        return self.fill(shape, dt, np.nan)

    def positions(self, name, n, rows=4096, dtype=np.int32):
        return self.dev(_rng(name + "/pos").integers(0, rows, n).astype(dtype))

    def all(self):
        """(name, function) of every case."""
        out = []
        for dn in ("fp32", "fp16", "bf16"):
            for pairs in ("half", "inter"):
                for case in ("fixed-bshd-offset", "fixed-bshd-inverse", "fixed-bhsd-offset", "fixed-sbhd-strided",
                             "fixed-thd-fused-positions", "fixed-thd-cu_seqlens-inplace", "fixed-decode",
                             "generic-partial-window", "generic-partial-bhsd-prefill", "generic-odd-stride",
                             "generic-odd-stride-prefill",
                             "angles-f64-decode", "angles-f32-decode", "angles-f64-prefill"):
                    out.append((f"rope/{dn}/{pairs}/{case}", self._rope_case))
        for case in ("bf16-half-exact", "bf16-half-exact-staged", "bf16-half-exact-f32w", "fp16-inter-transformers",
                     "fp32-half-transformers", "bf16-half-exact-partial", "fp16-half-exact-offset-window"):
            out.append((f"qknorm/{case}", self._qknorm_case))
        for case in ("bf16-half-auto", "fp16-inter-fp8_e4m3", "fp32-half-fp8_e5m2", "bf16-half-auto-hnd-partial",
                     "bf16-inter-fp8_e4m3-skipped", "fp32-inter-auto-prefill"):
            out.append((f"cache/{case}", self._cache_case))
        for dn in ("fp32", "bf16"):
            for sec in ("contiguous", "interleaved"):
                for lay in ("thd", "bhsd"):
                    for size in ("decode", "prefill"):
                        out.append((f"mrope/{dn}/{sec}/{lay}/{size}", self._mrope_case))
        for h, d in ((1, 128), (8, 128), (4, 512)):
            out.append((f"tail/H{h}-D{d}", self._tail_case))
        return out

    # general RoPE
    def _rope_case(self, name):
        cp, rr = self.cp, self.rr
        _, dn, pairs, case = name.split("/")
        dt, inter = self.dtypes[dn], pairs == "inter"
        kw = dict(interleaved=inter)
        hq, hk = 8, 2
        if case.startswith("fixed-bshd") or case == "generic-partial-window":
            q, k = self.x(name + "q", (2, 24, hq, D), dt), self.x(name + "k", (2, 24, hk, D), dt)
            kw.update(layout="bshd", offset=5, inverse=case.endswith("inverse"))
            cos, sin = self.cos, self.sin
            if case == "generic-partial-window":  # out of place with channels to copy: the generic kernel
                kw["rotary_dim"] = 64
                cos, sin = self.cos64, self.sin64
            qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
            return rr.apply_rope_qk(q, k, cos, sin, q_out=qo, k_out=ko, **kw)
        if case in ("fixed-bhsd-offset", "generic-partial-bhsd-prefill"):
            s = 40 if case.startswith("fixed") else 1024  # prefill: the generic kernel's multi-head threads
            q, k = self.x(name + "q", (2, hq, s, D), dt), self.x(name + "k", (2, hk, s, D), dt)
            cos, sin = self.cos, self.sin
            if case.startswith("generic"):
                kw["rotary_dim"] = 64
                cos, sin = self.cos64, self.sin64
            qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
            return rr.apply_rope_qk(q, k, cos, sin, layout="bhsd", offset=7, q_out=qo, k_out=ko, **kw)
        if case == "fixed-sbhd-strided":  # tokens of a batch not one stride apart: the strided build
            q, k = self.x(name + "q", (24, 2, hq, D), dt), self.x(name + "k", (24, 2, hk, D), dt)
            qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
            return rr.apply_rope_qk(q, k, self.cos, self.sin, layout="sbhd", offset=11, q_out=qo, k_out=ko, **kw)
        if case in ("fixed-thd-fused-positions", "fixed-decode"):
            t = 40 if case.startswith("fixed-thd") else 3
            qkv = self.x(name + "qkv", (t, hq + 2 * hk, D), dt)  # q and k are views of a fused buffer
            q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
            qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
            return rr.apply_rope_qk(q, k, self.cos, self.sin, layout="thd", positions=self.positions(name, t),
                                    q_out=qo, k_out=ko, **kw)
        if case == "fixed-thd-cu_seqlens-inplace":
            q, k = self.x(name + "q", (40, hq, D), dt), self.x(name + "k", (40, hk, D), dt)
            cu = self.dev(np.array([0, 10, 25, 40], np.int32))
            rr.apply_rope_qk(q, k, self.cos, self.sin, layout="thd", cu_seqlens=cu, offset=3, q_out=q, k_out=k, **kw)
            return q, k
        if case.startswith("generic-odd-stride"):
            # Rows D + pad elements apart: no access as wide as the specialised build's fits them.
            pad = 2 if inter else 1
            t = 2048 if case.endswith("prefill") else 30  # prefill: two heads a thread (half-split pairs)
            qb, kb = self.x(name + "q", (t, hq, D + pad), dt), self.x(name + "k", (t, hk, D + pad), dt)
            q, k = qb[..., pad:], kb[..., pad:]
            qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
            return rr.apply_rope_qk(q, k, self.cos, self.sin, layout="thd", positions=self.positions(name, t),
                                    q_out=qo, k_out=ko, **kw)
        if case.startswith("angles"):
            numerics = "exact" if "f64" in case else "transformers"
            f, att = rr.inverse_frequencies(D, numerics=numerics)
            t = 4 if case.endswith("decode") else 2048
            q, k = self.x(name + "q", (t, hq, D), dt), self.x(name + "k", (t, hk, D), dt)
            qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
            return rr.apply_rope_qk(q, k, layout="thd", inv_freq=self.dev(f), attention_scaling=0.75,
                                    positions=self.positions(name, t), q_out=qo, k_out=ko, **kw)
        raise AssertionError(name)

    # fused QK-norm + RoPE
    def _qknorm_case(self, name):
        cp, rr = self.cp, self.rr
        parts = name.split("/")[1].split("-")
        dt, inter, numerics = self.dtypes[parts[0]], parts[1] == "inter", parts[2]
        t = 4096 if "staged" in parts else 16
        hq, hk = 32, 8
        q, k = self.x(name + "q", (t, hq, D), dt), self.x(name + "k", (t, hk, D), dt)
        wdt = np.float32 if "f32w" in parts else dt
        qw, kw_ = self.x(name + "qw", (D,), wdt, 0.5), self.x(name + "kw", (D,), wdt, 0.5)
        kw = dict(eps=1e-6, numerics=numerics, layout="thd", interleaved=inter)
        cos, sin = self.cos, self.sin
        if "partial" in parts:
            kw["rotary_dim"] = 64
            cos, sin = self.cos64, self.sin64
        if "window" in parts:
            kw.update(rotary_dim=64, rotary_offset=32)
            cos, sin = self.cos64, self.sin64
        if "offset" in parts:
            kw["offset"] = 9
        else:
            kw["positions"] = self.positions(name, t)
        qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
        return rr.apply_qk_norm_rope(q, k, qw, kw_, cos, sin, q_out=qo, k_out=ko, **kw)

    # RoPE + paged KV-cache write
    def _cache_case(self, name):
        cp, rr = self.cp, self.rr
        parts = name.split("/")[1].split("-")
        dt, inter, kind = self.dtypes[parts[0]], parts[1] == "inter", parts[2]
        t = 4096 if "prefill" in parts else 24
        hq, hk, bs = 8, 2, 16
        nb = -(-t // bs) + 3
        q, k, v = (self.x(name + n, (t, h, D), dt) for n, h in (("q", hq), ("k", hk), ("v", hk)))
        slots = _rng(name + "/slots").permutation(nb * bs)[:t].astype(np.int64)
        if "skipped" in parts:
            slots[::5] = -1
        hnd = "hnd" in parts
        cshape = (nb, hk, bs, D) if hnd else (nb, bs, hk, D)
        kw = dict(kv_layout="hnd" if hnd else "nhd", kv_cache_dtype=kind, interleaved=inter)
        if kind == "auto":
            kc, vc = self.poison(cshape, dt), self.poison(cshape, dt)
        else:
            kc, vc = self.fill(cshape, np.uint8, 0xFF), self.fill(cshape, np.uint8, 0xFF)
            kw.update(k_scale=self.dev(np.array([0.05], np.float32)), v_scale=self.dev(np.array([0.3], np.float32)))
        cos, sin = self.cos, self.sin
        if "partial" in parts:
            kw["rotary_dim"] = 64
            cos, sin = self.cos64, self.sin64
        qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
        rr.rope_and_cache(q, k, v, cos, sin, self.positions(name, t, dtype=np.int64), self.dev(slots), kc, vc,
                          q_out=qo, k_out=ko, **kw)
        return qo, ko, kc, vc

    # multimodal RoPE
    def _mrope_case(self, name):
        cp, rr = self.cp, self.rr
        _, dn, sec, lay, size = name.split("/")
        dt = self.dtypes[dn]
        section = (16, 24, 24) if sec == "contiguous" else (24, 20, 20)
        hq, hk = 8, 2
        t = 8 if size == "decode" else 2048
        if lay == "thd":
            q, k = self.x(name + "q", (t, hq, D), dt), self.x(name + "k", (t, hk, D), dt)
            pos = self.positions(name, 3 * t, dtype=np.int64).reshape(3, t)
        else:
            b, s = 2, t // 2
            q, k = self.x(name + "q", (b, hq, s, D), dt), self.x(name + "k", (b, hk, s, D), dt)
            pos = self.positions(name, 3 * t, dtype=np.int64).reshape(3, b, s)
        qo, ko = self.poison(q.shape, dt), self.poison(k.shape, dt)
        return rr.apply_mrope_qk(q, k, self.cos, self.sin, pos, section, interleaved_sections=sec == "interleaved",
                                 layout=lay, q_out=qo, k_out=ko)

    # BF16 tail RoPE
    def _tail_case(self, name):
        cp, rr = self.cp, self.rr
        h, d = (int(v[1:]) for v in name.split("/")[1].split("-"))
        t = 96
        x = self.x(name + "x", (t, h, d), self.dtypes["bf16"])
        ang = _rng(name + "/ang").uniform(-20.0, 20.0, (t, 32))
        c, s = self.dev(np.cos(ang).astype(np.float32)), self.dev(np.sin(ang).astype(np.float32))
        out = self.poison(x.shape, x.dtype)
        rr.TailRoPEForward(x, c, s, out).execute(x, c, s, out)
        return (out,)


# -- one tree --------------------------------------------------------------------------------------

def run_cases(cases: Cases, jobs: int, to_host) -> tuple[dict, dict]:
    """Every case's outputs as bytes, and each failed case's error. Cases run on ``jobs`` threads:
    the library's one-call caches are per thread, and most of a case's time is its builds'
    compiles, which NVRTC runs without the GIL."""

    def one(item):
        name, fn = item
        try:
            return name, [np.ascontiguousarray(to_host(a)).view(np.uint8).reshape(-1) for a in fn(name)], None
        except Exception as e:
            return name, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"

    arrays, errors = {}, {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for name, outs, err in pool.map(one, cases.all()):
            if err is not None:
                errors[name] = err.splitlines()[0]
                print(f"{name}: {err}", file=sys.stderr)
                continue
            for i, a in enumerate(outs):
                arrays[f"{name}#{i}"] = a
    return arrays, errors


def run_tree(tree: Path, out: Path, jobs: int) -> int:
    sys.path.insert(0, str(tree))
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        cp.cuda.Device(0).use()
    except Exception as e:  # no CuPy, no driver, no device
        print(f"bit_equality: no GPU to run on ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    import rope_rtc

    where = Path(rope_rtc.__file__).resolve().parent.parent
    if where != tree.resolve():
        print(f"bit_equality: imported rope_rtc from {where}, not from {tree}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cases = Cases(cp, rope_rtc)
    arrays, errors = run_cases(cases, jobs, lambda a: cp.asnumpy(a))
    cp.cuda.runtime.deviceSynchronize()
    np.savez_compressed(out, **arrays)
    out.with_suffix(".errors.json").write_text(json.dumps(errors, indent=1))
    print(f"{tree}: {len(arrays)} outputs, {len(errors)} failed cases, {time.perf_counter() - t0:.1f} s")
    return 0


# -- comparing -------------------------------------------------------------------------------------

def compare(a: Path, b: Path) -> int:
    fa, fb = np.load(a), np.load(b)
    ea = json.loads(a.with_suffix(".errors.json").read_text())
    eb = json.loads(b.with_suffix(".errors.json").read_text())
    same = differ = 0
    bad = False
    for key in sorted(set(fa.files) | set(fb.files)):
        if key not in fa.files or key not in fb.files:
            print(f"only in {'the first' if key in fa.files else 'the second'}: {key}")
            bad = True
            continue
        x, y = fa[key], fb[key]
        if x.shape == y.shape and np.array_equal(x, y):
            same += 1
        else:
            differ += 1
            bad = True
            n = "size differs" if x.shape != y.shape else f"{int((x != y).sum())} of {x.size} bytes differ"
            print(f"DIFFERENT {key}: {n}")
    for name in sorted(set(ea) | set(eb)):
        if ea.get(name) != eb.get(name):
            bad = True
        print(f"failed {name}: first: {ea.get(name, '-')}; second: {eb.get(name, '-')}")
    print(f"{same} outputs bit-identical, {differ} different, {len(set(ea) | set(eb))} failed cases")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--tree", type=Path, help="run the cases with rope_rtc from this folder")
    g.add_argument("--trees", type=Path, nargs=2, metavar=("OLD", "NEW"), help="run both, then compare")
    g.add_argument("--compare", type=Path, nargs=2, metavar=("OLD.npz", "NEW.npz"))
    ap.add_argument("--out", type=Path, help="with --tree: the result file (.npz)")
    ap.add_argument("--out-dir", type=Path, help="with --trees: where the result files go (default: a temporary folder)")
    ap.add_argument("--jobs", type=int, default=4, help="cases run at once in each tree (default 4)")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.tree:
        if args.out is None:
            ap.error("--tree needs --out")
        return run_tree(args.tree, args.out, args.jobs)
    for t in args.trees:
        if not (t / "rope_rtc" / "__init__.py").is_file() or not (t / "cuda_src").is_dir():
            ap.error(f"{t} holds no rope_rtc/ and cuda_src/")
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bit_equality_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    procs, outs = [], []
    for i, tree in enumerate(args.trees):
        out = out_dir / f"tree{i}.npz"
        cache = out_dir / f"cache{i}"  # empty: every build compiled from this tree's sources
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "ROPE_RTC_CACHE_DIR": str(cache.resolve())}
        procs.append(subprocess.Popen([sys.executable, __file__, "--tree", str(tree.resolve()), "--out", str(out),
                                       "--jobs", str(args.jobs)], env=env))
        outs.append(out)
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"bit_equality: a tree's run failed (exit status {codes})", file=sys.stderr)
        return max(codes)
    return compare(*outs)


if __name__ == "__main__":
    sys.exit(main())
