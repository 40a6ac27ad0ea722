"""The engine-interface section of the benchmark: RoPE fused with the paged KV-cache write
(``RopeCachePlan``, the input dtype and FP8) against the two-step sequence an engine would
otherwise run (our ``RopePlan``, then one scatter per cache) and a copy of the same bytes; and
ONNX ``RotaryEmbedding`` (``rope_rtc.onnx.rotary_embedding``) beside ``apply_rope`` on the same
tensor and a copy; multimodal RoPE (three streams) and a vision tower's axial RoPE (two streams,
Qwen2.5-VL's patches) beside a copy; DeepSeek-style MLA (``MlaRopeCachePlan``: RoPE on q's rotary
channels and on k_pe, the ``[kv_c | k_pe]`` cache row, model dtype and FP8) beside its two-step
sequence and a copy.

Each record is checked before it is timed: the fused launch's q, k and cache entries must equal,
bit for bit, what the two-step sequence writes (the kernels share their arithmetic), and ONNX's
output must equal ``apply_rope``'s on the same tables.
"""

from __future__ import annotations

import contextlib
import fnmatch
from functools import partial

from ..cases import selected
# Every record function the job list names, imported here because run_engine_section looks each
# one up by its name in this module's namespace (where a test also stands in for one).
# engine_jax stays outside this package: it is also the child process's `python -m` entry, which a
# module this package imports could not be without runpy running it a second time.
from ..engine_jax import jax_records
from .angles import ANGLES_DECODE_T, ANGLES_PREFILL_T, _angles_record, angles_ident
from .kv_cache import KV_DECODE_T, KV_PREFILL_T, _kv_record, kv_ident
from .mla import MLA_DECODE_T, MLA_DECODE_T_QUICK, MLA_PREFILL_T, _mla_record, mla_ident
from .mrope import MROPE_DECODE_T, MROPE_PREFILL_T, _mrope_record, mrope_ident
from .onnx import ONNX_IDENT, _onnx_record
from .qk_norm import QKNORM_DECODE_T, QKNORM_PREFILL_T, _qk_norm_record, qk_norm_ident
from .vision import VISION_GRID, _vision_record, vision_ident


def engine_jobs(quick: bool = False) -> list[tuple[str, str, tuple]]:
    """Every engine job: ``(name, record function of this module, its arguments after ctx,
    measure and copy_runner)``. ``engine/<name>`` is the id of the record the job writes (of a job
    that fails too, so that the targets judging it see the failure), and what ``--cases`` and
    ``--list`` match; the quick run measures fewer MLA decode sizes."""
    def name(ident: str) -> str:
        return ident.removeprefix("engine/")

    jobs = [(name(kv_ident(*args)), "_kv_record", args)
            for args in (("decode", KV_DECODE_T, "bfloat16", False), ("prefill", KV_PREFILL_T, "bfloat16", False),
                         ("prefill", KV_PREFILL_T, "bfloat16", True), ("prefill", KV_PREFILL_T, "float32", False))]
    jobs.append((name(ONNX_IDENT), "_onnx_record", ()))
    jobs += [(name(mrope_ident(T, interleaved)), "_mrope_record", (T, interleaved))
             for interleaved in (False, True) for T in (MROPE_DECODE_T, MROPE_PREFILL_T)]
    jobs.append((name(vision_ident(VISION_GRID[1] * VISION_GRID[2])), "_vision_record", ()))
    jobs += [(name(qk_norm_ident(T)), "_qk_norm_record", (T,)) for T in (QKNORM_DECODE_T, QKNORM_PREFILL_T)]
    jobs += [(name(angles_ident(T)), "_angles_record", (T,)) for T in (ANGLES_DECODE_T, ANGLES_PREFILL_T)]
    jobs += [(name(mla_ident(T)), "_mla_record", (T,))
             for T in (MLA_PREFILL_T,) + (MLA_DECODE_T_QUICK if quick else MLA_DECODE_T)]
    jobs.append(("jax", "jax_records", ()))  # several records, from a child process (engine_jax)
    return jobs


# A job that writes several records of different prefixes: what they start with. When it fails,
# each prefix gets an error record, so the targets that judge its records see the failure.
RECORD_PREFIXES = {"jax": ("jax-prefill", "jax-decode")}


def _idents(name: str) -> list[str]:
    """The record ids (or prefixes of them) of job ``name``, with ``engine/``."""
    return [f"engine/{p}" for p in RECORD_PREFIXES.get(name, (name,))]


def engine_job_selected(name: str, tokens: list[str] | None) -> bool:
    """``--cases``: ``engine`` (or a glob over it) selects every job; ``engine/<prefix>`` the jobs
    whose ``engine/<name>`` starts with it (``engine/angles``, ``engine/kv-cache-prefill/bf16``,
    ``engine/mla``, a record id as the page prints it), and a glob from ``engine/`` the jobs it
    matches (``engine/*/T=8``). A job of several records (JAX) is matched by their prefixes too."""
    if selected("engine", "engine", tokens):
        return True
    idents = _idents(name) + [f"engine/{name}"]
    return any(t.startswith("engine/") and (i.startswith(t) or t.startswith(i + "/") or fnmatch.fnmatchcase(i, t))
               for t in tokens for i in idents)


def _failure_records(name: str, line: str) -> list[dict]:
    """The records of job ``name`` that failed: one per kind of record it writes, named by its id
    (the report's targets miss on each, naming ``line``)."""
    return [{"id": ident, "group": "engine", "params": {}, "bytes_moved": 0, "error": line, "rows": []}
            for ident in _idents(name)]


def engine_failures(line: str, tokens: list[str] | None, quick: bool) -> list[dict]:
    """Failure records of every selected job, for a section that failed as a whole."""
    return [rec for name, _, _ in engine_jobs(quick) if engine_job_selected(name, tokens)
            for rec in _failure_records(name, line)]


def run_engine_section(ctx, measure, copy_runner, tokens: list[str] | None = None) -> list[dict]:
    """Every selected engine record (``measure``/``copy_runner``: the runner's, passed in to keep
    imports one way; ``tokens``: ``--cases``, see :func:`engine_job_selected`)."""
    jobs = [(name, partial(globals()[fn], ctx, measure, copy_runner, *args))
            for name, fn, args in engine_jobs(bool(getattr(ctx, "quick", False))) if engine_job_selected(name, tokens)]
    recs = []
    for name, job in jobs:  # one failing record costs only itself
        try:
            got = job()
            recs.extend(got if isinstance(got, list) else [got])
        except Exception as exc:
            line = f"engine/{name} failed: {type(exc).__name__}: {exc}"[:400]
            print(line, flush=True)
            recs += _failure_records(name, line)
            with contextlib.suppress(Exception):
                ctx.stream.synchronize()
        ctx.free()
    return recs
