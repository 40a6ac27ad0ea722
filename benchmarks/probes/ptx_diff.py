"""Compare the code of every kernel specialisation built from two versions of ``cuda_src/``: no GPU
needed, only NVRTC. For a refactor of the device code that must leave every build's machine code
as it was.

    PYTHONPATH=. python3 benchmarks/probes/ptx_diff.py --base main [--head REV] [--arch 90 ...]
                                                       [--family rope_fixed ...] [--jobs 2] [-v]

``--base`` is a git revision whose ``cuda_src/`` is the reference; ``--head`` another revision, or
(the default) this checkout's ``cuda_src/`` as it is on disk. Both are compiled by this checkout's
``rope_rtc`` (the same options, the same NVRTC), each in a subprocess whose package sits beside that
version's sources, so only the device sources differ. The kernels are the registry's own list
(``registry.all_specs``) and the builds of the op families it leaves to plans (QK-norm, the
KV-cache write, MRoPE, the angle builds) for a spread of geometries.

Each kernel is reported as one of:

- ``identical``: the same PTX once comments are dropped (NVVM's banner, ``// begin inline asm``)
  and the file's hash in internal symbol names is masked;
- ``renumbered``: the same instructions in the same order, virtual registers and labels renamed
  one to one;
- ``reordered``: each basic block holds the same instructions, some in another order;
- ``same cubin``: other PTX, byte-identical CUBIN (the same machine code);
- ``DIFFERENT``: other instructions. ``-v`` prints a unified diff of the normalised PTX;
- ``fails in both``: neither tree compiles it, with the same error.

``renumbered`` and ``reordered`` kernels are compiled to CUBIN too (ptxas may allocate or schedule
such PTX differently), and the line says whether the CUBINs are equal. The exit status is 1 when any
kernel is ``DIFFERENT`` or its CUBIN differs: a change of machine code for someone to look at.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# -- the kernels -----------------------------------------------------------------------------------

def kernel_specs():
    """The registry's list, then the op families' builds for a spread of geometries, unique by name."""
    from rope_rtc.build import registry as r

    specs = list(r.all_specs())
    # The fused QK-norm + RoPE kernel: every pair style, dtype and numerics, whole and partial
    # windows (the register, split and staged builds), float32 and dtype weights.
    for dtype in r.DTYPE_CODES:
        for interleaved in (False, True):
            for numerics in r.NORM_MODES:
                for wf32 in (False, True):
                    for hq, hk, d, ro, rd in ((32, 8, 128, 0, 128), (16, 4, 128, 0, 64), (8, 8, 64, 32, 32)):
                        specs += [g.spec() for g in r.norm_builds(dtype, interleaved, hq, hk, d, ro, rd, wf32,
                                                                  numerics)]
    # RoPE + KV-cache write: every cache kind and vector width; a window shorter than the head.
    for dtype in r.DTYPE_CODES:
        for interleaved in (False, True):
            for kind in r.CACHE_KIND_NAMES:
                for vec in r.cache_vector_widths(dtype, interleaved, kind):
                    if kind == 0 or vec >= 2:  # an FP8 entry store is at least 2 bytes
                        specs.append(r.cache_spec(dtype, interleaved, vec, kind, 32, 8, 128, 128))
                specs.append(r.cache_spec(dtype, interleaved, r.cache_vector_widths(dtype, interleaved, kind)[0],
                                          kind, 8, 2, 128, 64))
    # Multimodal RoPE: contiguous and interleaved sections, both thread orders, strided and dense.
    for dtype in r.DTYPE_CODES:
        for interleaved_sections, sections in ((False, (16, 24, 24)), (True, (24, 20, 20))):
            for denser in (False, True):
                specs += [g.spec() for g in r.both_strides(r.mrope_geometries(
                    dtype, 32, 8, 128, 128, sections, interleaved_sections, denser))]
    # cos/sin from inv_freq: both frequency dtypes, every position scheme, strided and dense.
    for dtype in r.DTYPE_CODES:
        for interleaved in (False, True):
            for freq in r.ANGLE_MODES:
                for denser in (False, True):
                    for mode in r.model_pos_modes(denser):
                        specs += [g.spec() for g in r.both_strides(r.angle_geometries(
                            dtype, interleaved, 32, 8, 128, 0, 128, freq, denser, mode))]
    # A partial rotary window in the specialised build (rotary_offset > 0, GPT-J-style rotary_dim < D).
    for dtype in r.DTYPE_CODES:
        for interleaved in (False, True):
            g = r.fixed_geometry(dtype, interleaved, 16, 0, 256, 64, 64, False, 2)
            specs += [b.spec() for b in r.both_strides([g])]
    # DeepSeek-style MLA: every dtype and pair style, each cache kind with and without an FP8 q.
    from rope_rtc.build.registry_mla import mla_model_specs

    for dtype in r.DTYPE_CODES:
        for interleaved in (False, True):
            specs += mla_model_specs(dtype, interleaved, 128, 128, 64, 512)
    out, seen = [], set()
    for s in specs:
        if s.name not in seen:
            seen.add(s.name)
            out.append(s)
    return out


# -- the two source trees --------------------------------------------------------------------------

def git_sources(rev: str) -> dict[str, bytes]:
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "cuda_src/"],
                           check=True, capture_output=True, text=True).stdout.split()
    if not names:
        raise SystemExit(f"revision {rev!r} has no cuda_src/")
    return {Path(n).name: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"], check=True,
                                         capture_output=True).stdout for n in names}


def disk_sources() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((ROOT / "cuda_src").iterdir()) if p.is_file()}


def make_tree(where: Path, files: dict[str, bytes]) -> Path:
    """This checkout's package beside the given sources (rope_rtc.build.sources finds cuda_src/ beside the package)."""
    shutil.copytree(ROOT / "rope_rtc", where / "rope_rtc", ignore=shutil.ignore_patterns("__pycache__"))
    (where / "cuda_src").mkdir()
    for name, data in files.items():
        (where / "cuda_src" / name).write_bytes(data)
    return where


def compile_tree(tree: Path, specs, archs, kinds, out: Path, jobs: int) -> None:
    """Compile every (spec, arch, kind) with the package in ``tree``, in a subprocess, into ``out``."""
    job = {"specs": [[s.name, s.source, [list(d) for d in s.defines]] for s in specs], "archs": list(archs),
           "kinds": list(kinds), "out": str(out), "jobs": jobs}
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(job), text=True, env=env,
                          capture_output=True)
    if proc.returncode:
        raise SystemExit(f"compiling in {tree} failed:\n{proc.stdout}{proc.stderr}")


def worker() -> None:
    job = json.loads(sys.stdin.read())
    from rope_rtc.build import sources
    from rope_rtc.build.compiler import compile_source
    from rope_rtc.build.toolchain import Target
    from rope_rtc.errors import CompileError

    here = Path(sources.__file__).resolve().parents[2]
    assert sources.source_dir() == here / "cuda_src", f"the worker reads {sources.source_dir()}, not {here}"
    out = Path(job["out"])

    def one(item):
        (name, source, defines), arch, kind, index = item
        try:
            data = compile_source(name, source, tuple(tuple(d) for d in defines), Target(arch, kind)).binary
        except CompileError as e:  # kept, and compared: a build both trees refuse is no difference
            data = FAILED + str(e).encode()
        (out / f"{index}.{arch}.{kind}").write_bytes(data)

    items = [(s, a, k, i) for i, s in enumerate(job["specs"]) for a in job["archs"] for k in job["kinds"]]
    with ThreadPoolExecutor(max_workers=job["jobs"]) as pool:
        list(pool.map(one, items))


# -- comparing -------------------------------------------------------------------------------------

FAILED = b"COMPILE FAILED\n"
_COMMENT = re.compile(r"//.*$")
# NVRTC names a file's internal-linkage symbols after the file and a hash of it.
_INTERNAL = re.compile(r"_INTERNAL_[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}")
# A virtual register (%r12, %rd3, %f7, %p1, ...) or a label ($L__BB0_4).
_NAME = re.compile(r"%(?:rd|rs|fd|hh|r|f|p|h)\d+\b|\$L__\w+")


def normalised(ptx: bytes) -> list[str]:
    lines = []
    for line in ptx.decode().splitlines():
        line = _INTERNAL.sub("_INTERNAL_", _COMMENT.sub("", line)).rstrip()
        if line:
            lines.append(line)
    return lines


def same_up_to_names(a: list[str], b: list[str]) -> bool:
    """Whether a and b are the same instructions in the same order once their virtual registers and
    labels are renamed, one to one (the register declarations' counts left out)."""
    a = [x for x in a if not x.lstrip().startswith(".reg")]
    b = [x for x in b if not x.lstrip().startswith(".reg")]
    if len(a) != len(b):
        return False
    fwd: dict[str, str] = {}
    back: dict[str, str] = {}
    for x, y in zip(a, b):
        nx, ny = _NAME.split(x), _NAME.split(y)
        if nx != ny:  # the text between the names
            return False
        for u, v in zip(_NAME.findall(x), _NAME.findall(y)):
            if fwd.setdefault(u, v) != v or back.setdefault(v, u) != u:
                return False
    return True


def blocks(lines: list[str]) -> list[list[str]]:
    """The lines cut into basic blocks: at each label and after each branch or return."""
    out: list[list[str]] = [[]]
    for x in lines:
        if x.startswith("$L__") or x.startswith("}"):
            out.append([])
        out[-1].append(x)
        if re.search(r"\b(bra|ret|exit)(\.uni)?\b", x):
            out.append([])
    return [b for b in out if b]


def reordered(a: list[str], b: list[str]) -> bool:
    """Whether each basic block of a holds exactly the instructions of b's, in another order."""
    ba, bb = blocks(a), blocks(b)
    return len(ba) == len(bb) and all(sorted(x) == sorted(y) for x, y in zip(ba, bb))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the reference cuda_src/")
    ap.add_argument("--head", help="git revision to compare (default: cuda_src/ on disk)")
    ap.add_argument("--arch", type=int, action="append", help="SM architecture(s) (default: 90)")
    ap.add_argument("--family", action="append", help="only these kernel families (rope, rope_fixed, ...)")
    ap.add_argument("--match", help="only kernels whose name contains this text")
    ap.add_argument("--jobs", type=int, default=2, help="compiles at once per tree (default 2)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the PTX diff of each differing kernel")
    args = ap.parse_args()
    archs = args.arch or [90]

    specs = [s for s in kernel_specs() if (not args.family or s.family in args.family)
             and (not args.match or args.match in s.name)]
    base_files = git_sources(args.base)
    head_files = git_sources(args.head) if args.head else disk_sources()
    label = args.head or "working tree"
    print(f"{len(specs)} kernels x sm_{'/'.join(map(str, archs))}: {args.base} against {label}", flush=True)

    with tempfile.TemporaryDirectory(prefix="ptx_diff_") as tmp:
        tmp = Path(tmp)
        outs = {}
        for side, files in (("base", base_files), ("head", head_files)):
            tree = make_tree(tmp / side, files)
            outs[side] = tmp / f"{side}.out"
            outs[side].mkdir()
            compile_tree(tree, specs, archs, ("ptx",), outs[side], args.jobs)

        status = {}
        need_cubin = []
        for i, spec in enumerate(specs):
            for arch in archs:
                ra, rb = ((outs[side] / f"{i}.{arch}.ptx").read_bytes() for side in ("base", "head"))
                if ra.startswith(FAILED) or rb.startswith(FAILED):
                    status[i, arch] = "fails in both" if ra == rb else "DIFFERENT (compile fails in one)"
                    if args.verbose or ra != rb:
                        print(f"--- {spec.name} sm_{arch}\n{(ra if ra.startswith(FAILED) else rb).decode()}")
                    continue
                a, b = normalised(ra), normalised(rb)
                if a == b:
                    status[i, arch] = "identical"
                    continue
                status[i, arch] = ("renumbered" if same_up_to_names(a, b)
                                   else "reordered" if reordered(a, b) else "DIFFERENT")
                need_cubin.append(i)
                if args.verbose:
                    print(f"--- {spec.name} sm_{arch}")
                    sys.stdout.writelines(d + "\n" for d in difflib.unified_diff(a, b, "base", "head", n=2,
                                                                                lineterm=""))
        need_cubin = sorted(set(need_cubin))
        if need_cubin:
            sub = [specs[i] for i in need_cubin]
            for side in ("base", "head"):
                out = tmp / f"{side}.cubin"
                out.mkdir()
                compile_tree(tmp / side, sub, archs, ("cubin",), out, args.jobs)
            for j, i in enumerate(need_cubin):
                for arch in archs:
                    if status[i, arch] not in ("renumbered", "reordered", "DIFFERENT"):
                        continue
                    same = ((tmp / "base.cubin" / f"{j}.{arch}.cubin").read_bytes()
                            == (tmp / "head.cubin" / f"{j}.{arch}.cubin").read_bytes())
                    if status[i, arch] in ("renumbered", "reordered"):
                        status[i, arch] += ", same cubin" if same else ", CUBIN DIFFERS"
                    elif same:
                        status[i, arch] = "same cubin"

    counts: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for arch in archs:
            s = status[i, arch]
            counts[s] = counts.get(s, 0) + 1
            if s != "identical" or args.verbose:
                print(f"{s:26s} sm_{arch} {spec.name}")
    print("; ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    bad = sum(n for s, n in counts.items() if "DIFFER" in s)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        sys.exit(main())
