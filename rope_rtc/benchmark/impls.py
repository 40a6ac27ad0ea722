"""The implementations: rope_rtc (general, blog variants, tail), plain CuPy, PyTorch with Hugging
Face's formula, torch.compile and Liger. Each ``setup`` returns a :class:`Runner`;
:class:`Peers` finds what is importable and :func:`impls_for` says which runs on a case."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from .buffers import SetBuffers, bf16_bits_to_f32, f32_to_bf16_bits
from .cases import BLOG_VARIANTS, ENGINE, ONE_CALL, OURS, STEP_TABLES, TAIL_COLS, Case, Skip
from .timing import capture_cupy, capture_torch


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
    from ..ops.rope import RopePlan

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


def setup_one_call_general(ctx, case: Case, bufs: SetBuffers) -> Runner:
    """``apply_rope_qk`` on the plan's buffers, in place: each buffer set is a new set of arrays
    of one signature, so a call costs the one-call path (address checks and a launch)."""
    from ..ops.rope import apply_rope_qk

    fns = [partial(apply_rope_qk, bufs.q(i), bufs.k(i), bufs.cos(i), bufs.sin(i), layout=case.layout,
                   interleaved=case.interleaved, q_out=bufs.q(i), k_out=bufs.k(i)) for i in range(bufs.n)]
    return Runner(fns, lambda: (fns[0](), (bufs.q(0), bufs.k(0)))[1], case.layout, case.interleaved,
                  f"{case.layout}/{_pairing(case.interleaved)}", True, _cupy_capture(ctx, fns),
                  "apply_rope_qk (one call), in place")


def setup_engine_decode(ctx, case: Case, bufs: SetBuffers) -> Runner:
    """The engines' convention on the decode buffers: flat q/k ``[T, H * D]``, one combined
    ``cos_sin_cache`` (cos then sin in each row, built once like an engine's), int positions;
    a RopePlan in place."""
    import cupy as cp

    from ..ops.rope import RopePlan

    cache = cp.ascontiguousarray(cp.concatenate([bufs.cos(0), bufs.sin(0)], axis=1))
    D = case.D
    flat = [(bufs.q(i), bufs.k(i)) for i in range(bufs.n)]
    flat = [(q, k, q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)) for q, k in flat]
    plan = RopePlan(flat[0][2], flat[0][3], cos_sin_cache=cache, positions=bufs.pos(0), layout="thd",
                    head_dim=D).compile()
    fns = [partial(plan.execute, fq, fk, positions=bufs.pos(i), cos_sin_cache=cache)
           for i, (_, _, fq, fk) in enumerate(flat)]
    run = Runner(fns, lambda: (fns[0](), flat[0][:2])[1], case.layout, case.interleaved,
                 f"{case.layout}/{_pairing(case.interleaved)}", True, _cupy_capture(ctx, fns),
                 "RopePlan.execute with cos_sin_cache and flat [T, H*D] q/k (head_dim=), in place")
    run.keep = cache
    return run


def setup_step_tables_decode(ctx, case: Case, bufs: SetBuffers) -> Runner:
    """Decode on the peers' inputs: each set's cos and sin rows gathered at its positions once
    (float32 ``[T, D/2]``, untimed, as the peers' per-step tables are), token t at row t; a
    RopePlan with no positions, in place. The same bits as the plan with positions."""
    import cupy as cp

    from ..ops.rope import RopePlan

    tables = [(cp.ascontiguousarray(bufs.cos(i)[bufs.pos(i)]), cp.ascontiguousarray(bufs.sin(i)[bufs.pos(i)]))
              for i in range(bufs.n)]
    plan = RopePlan(bufs.q(0), bufs.k(0), *tables[0], layout=case.layout, interleaved=case.interleaved).compile()
    fns = [partial(plan.execute, bufs.q(i), bufs.k(i), *tables[i]) for i in range(bufs.n)]
    return Runner(fns, lambda: (fns[0](), (bufs.q(0), bufs.k(0)))[1], case.layout, case.interleaved,
                 f"{case.layout}/{_pairing(case.interleaved)}", True, _cupy_capture(ctx, fns),
                 "RopePlan.execute on cos/sin gathered once per step (the peers' inputs), in place")


def setup_blog_variant(variant: str, ctx, case: Case, bufs: SetBuffers) -> Runner:
    from ..ops.blog import prepare_blog_variant

    # Validated and packed once (the blog prepares its (cos, sin) table ahead too): the timed
    # calls are the blog's launches alone, capturable like ours.
    fns = [prepare_blog_variant(variant, bufs.q(i), bufs.k(i), bufs.cos(i), bufs.sin(i), q_out=bufs.q(i),
                                k_out=bufs.k(i)) for i in range(bufs.n)]
    return Runner(fns, lambda: (fns[0](), (bufs.q(0), bufs.k(0)))[1], "bhsd", True, "bhsd/inter", True,
                  _cupy_capture(ctx, fns), f"blog {variant} kernel (table packed once), in place")


def setup_ours_tail(ctx, case: Case, bufs: SetBuffers) -> Runner:
    from ..ops.tail import TailRoPEForward

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
    if case.group == "general":
        out.append(Impl(ONE_CALL, None, _same_layout, setup_one_call_general))
    if case.group == "decode":
        out.append(Impl(ENGINE, None, _same_layout, setup_engine_decode))
        out.append(Impl(STEP_TABLES, None, _same_layout, setup_step_tables_decode))
    out.append(Impl("cupy", "cupy", _same_layout, setup_cupy_tail if tail else setup_cupy_general))
    out.append(Impl("torch", "torch", _torch_layout,
                    partial(setup_torch_tail, False) if tail else partial(setup_torch_general, False)))
    out.append(Impl("torch.compile", "torch.compile", _torch_layout,
                    partial(setup_torch_tail, True) if tail else partial(setup_torch_general, True)))
    out.append(Impl("liger", "liger", _liger_layout, setup_liger))
    return out


# --- installed versions (also used by runner.environment) --------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None
