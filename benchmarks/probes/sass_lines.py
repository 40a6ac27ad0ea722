"""No GPU needed: which constant-cache lines a decode build reads before its first global load.

A launch's argument block reaches each SM through the constant cache cold, one miss per 64-byte
line, and a small launch waits on the misses its first loads depend on (cuda_src/fixed_params.cuh).
This compiles the specialised builds of the decode case (bf16 `thd`, Hq=32, Hkv=8, dense; one per
position scheme) to CUBIN with NVRTC, disassembles them with cuobjdump, and lists in program order
every constant-bank read up to the first global load, with the FixedParams field it reads and
its line; then the rest of the kernel's lines. For weighing a change to the block's layout or to
what a build reads before its loads, on any machine.

    PYTHONPATH=. python3 benchmarks/probes/sass_lines.py [--arch 90] [--pos 2 0 1] [--cuobjdump PATH]

cuobjdump comes with the CUDA toolkit, or from the `nvidia-cuda-cuobjdump` wheel
(`pip download --no-deps nvidia-cuda-cuobjdump`, then unzip it: nvidia/cu13/bin/cuobjdump).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace

LINE = 64
SCHEMES = {0: "offset (the step's tables)", 1: "offsets", 2: "positions", 3: "cu_seqlens"}
_CONST = re.compile(r"c\[0x0\]\[(?:(R\w+)\+)?(0x[0-9a-f]+)\]")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def param_base(arch: int) -> int:
    """Where the kernel's parameters start in constant bank 0."""
    return 0x210 if arch >= 90 else 0x160


def descriptor_at(arch: int) -> int:
    """Where the global-memory descriptor every global access reads lies in constant bank 0."""
    return 0x208 if arch >= 90 else 0x118


def field_at(offset: int) -> str:
    """The FixedParams field holding byte ``offset`` of the block."""
    from rope_rtc.ops.rope_params import FixedParams

    for name, ctype in FixedParams._fields_:
        f = getattr(FixedParams, name)
        if f.offset <= offset < f.offset + f.size:
            length = getattr(ctype, "_length_", 0)
            if length:
                return f"{name}[{(offset - f.offset) // (f.size // length)}]"
            return name
    return "past the block"


def describe(offset: int, arch: int) -> str:
    if offset >= param_base(arch):
        return field_at(offset - param_base(arch))
    if descriptor_at(arch) <= offset < descriptor_at(arch) + 8:
        return "global-memory descriptor"
    return "launch constants (block size, stack)"


def sass(cubin: bytes, cuobjdump: str) -> list[tuple[str, str]]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [m.groups() for m in _INSN.finditer(out)]


def report(geometry, arch: int, cuobjdump: str) -> None:
    from rope_rtc.build.compiler import compile_source
    from rope_rtc.build.toolchain import Target

    spec = geometry.spec()
    insns = sass(compile_source(spec.family, spec.source, spec.defines, Target(arch)).binary, cuobjdump)
    print(f"{spec.name}: {SCHEMES.get(geometry.pos_mode, geometry.pos_mode)}, {len(insns)} instructions")
    first_load = next((i for i, (_, text) in enumerate(insns) if re.match(r"(@!?P\d+ )?LDG", text)), len(insns))
    before: list[int] = []  # lines first read before the first load, in that order
    after: list[int] = []
    for i, (at, text) in enumerate(insns):
        for reg, off in _CONST.findall(text):
            o = int(off, 16)
            if o == 0x28:  # the stack pointer every kernel loads first
                continue
            line = o - o % LINE
            new = line not in before and line not in after
            if new:
                (before if i < first_load else after).append(line)
            if i < first_load:
                where = f"{describe(o, arch)}{' (indexed)' if reg else ''}"
                print(f"  {at}  c[0x{o:03x}]  line 0x{line:03x}{' new' if new else '    '}  {where}")
        if i == first_load:
            print(f"  {at}  first global load: {text.split()[1 if text.startswith('@') else 0]}")
    lines = lambda xs: ", ".join(f"0x{x:03x}" for x in xs if x) or "none"  # line 0: launch constants
    print(f"  lines before the first load: {lines(before)}; after it: {lines(after)}\n")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--pos", type=int, nargs="+", default=[2, 0, 1], help="position schemes (rope_params.POS_MODES)")
    ap.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump"))
    args = ap.parse_args(argv)
    if not args.cuobjdump:
        print("cuobjdump not found: pass --cuobjdump PATH (see this script's docstring)", file=sys.stderr)
        return 2
    from rope_rtc.build.registry import fixed_geometry

    for pos in args.pos:
        g = fixed_geometry("bfloat16", False, 32, 8, 128, 0, 128, False, pos)
        report(replace(g, dense=True), args.arch, args.cuobjdump)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
