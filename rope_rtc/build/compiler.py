"""NVRTC: turn one kernel specialisation into CUBIN (or PTX) bytes.

Every NVRTC status is checked; a rejected program raises :class:`CompileError` whose text
holds the kernel, the options and the whole compile log. No fast-math: the tail contract is
bit-exact, and the general contract promises FP32 arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CompileError, ToolchainError
from . import sources
from .toolchain import Target, _nvrtc, _ok, cuda_headers, headers_digest

# Options every compile gets (the key hashes them; paths are deliberately absent: the include
# folder is keyed by the CUDA version it declares, so a cache warmed elsewhere still hits).
BASE_OPTIONS = ("-std=c++17",)

# A folder named by ROPE_RTC_CUDA_INCLUDE may hold hand-edited headers that still declare the
# wheel's CUDA_VERSION: its compiles get this define, which no source reads, set to the digest
# of the headers they can read (toolchain.headers_digest). Being an option, it is in the key and
# in every compile log.
HEADERS_DIGEST_MACRO = "ROPE_RTC_CUDA_HEADERS_SHA256"

def _headers_options() -> tuple[str, ...]:
    h = cuda_headers()
    if h.origin != "ROPE_RTC_CUDA_INCLUDE":
        return ()
    return (f"-D{HEADERS_DIGEST_MACRO}={headers_digest(h.path, sources.cuda_includes())}",)


@dataclass(frozen=True)
class CompileResult:
    binary: bytes
    kind: str       # "cubin" or "ptx"
    log: str
    options: tuple[str, ...]


def compile_options(defines: tuple[tuple[str, str], ...], target: Target) -> tuple[str, ...]:
    """The options that determine the output, in a fixed order (these go into the cache key)."""
    return (target.option, *BASE_OPTIONS, *_headers_options(), *(f"-D{k}={v}" for k, v in defines))


def compile_source(
    kernel: str, source_name: str, defines: tuple[tuple[str, str], ...], target: Target
) -> CompileResult:
    nvrtc = _nvrtc()
    src = sources.read_source(source_name)
    # Only the headers the key holds (sources.included_sources): nothing else can leak in.
    hdrs = sources.included_headers(source_name)
    options = compile_options(defines, target)
    include = f"-I{cuda_headers().path}"
    argv = [o.encode() for o in (*options, include)]

    prog = _ok(
        nvrtc.nvrtcCreateProgram(src, source_name.encode(), len(hdrs), list(hdrs.values()),
                                 [n.encode() for n in hdrs]),
        "nvrtcCreateProgram",
    )
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(argv), argv)[0]
        log = _program_log(nvrtc, prog)
        if int(status) != 0:
            raise CompileError(
                f"NVRTC failed to compile kernel {kernel} ({source_name}) for {target.name}: "
                f"{getattr(status, 'name', status)}\noptions: {' '.join(o.decode() for o in argv)}\n"
                f"--- compile log ---\n{log.rstrip() or '(empty)'}",
                kernel=kernel, options=[o.decode() for o in argv], log=log,
            )
        if target.kind == "cubin":
            size = _ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            buf = b" " * size
            _ok(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
        else:
            size = _ok(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            buf = b" " * size
            _ok(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        if size == 0:
            raise CompileError(
                f"NVRTC produced an empty {target.kind} for kernel {kernel} ({target.name})",
                kernel=kernel, options=[o.decode() for o in argv], log=log,
            )
        return CompileResult(bytes(buf), target.kind, log, options)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(nvrtc, prog) -> str:
    size = _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    if size <= 1:
        return ""
    buf = b" " * size
    _ok(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.rstrip(b"\x00").decode(errors="replace")


def assembled_source(source_name: str, defines: tuple[tuple[str, str], ...], target: Target) -> str:
    """The source and options as NVRTC saw them, for ROPE_RTC_SAVE_SOURCE debugging dumps."""
    head = "\n".join(f"// option: {o}" for o in compile_options(defines, target))
    return f"{head}\n// source: {source_name}\n{sources.read_source(source_name).decode()}"


__all__ = ["CompileResult", "compile_source", "compile_options", "assembled_source", "ToolchainError"]
