"""What a model fixes about its RoPE, read from a Hugging Face ``config.json`` (or given field by
field), and the kernel specialisations it needs: what ``rope-rtc warm --model`` compiles.

Only the fields that decide a kernel are read: the head dim, the q and kv head counts, the
rotary window (``partial_rotary_factor``), the dtype and the pair style. Most Hugging Face models
rotate half-split pairs (``rotate_half``); the model types of ``ADJACENT_PAIR_MODEL_TYPES`` rotate
adjacent ones, and ``interleaved=True`` asks for those for any other model.

Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2) is read by its own fields (model_mla):
its builds are those of its rotary part and the MLA kernel's (rope_rtc.ops.mla). A config whose
rotary geometry these fields would misread is refused, never guessed at: ChatGLM, kv heads under
another field's name, a model with no rotary embedding. Its geometry can always be given field by
field instead.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..build.registry import (ANGLE_MODES, NORM_MODES, KernelSpec, angle_geometries, both_strides, cache_spec,
                              cache_vector_widths, model_fixed_specs, model_pos_modes, mrope_geometries, norm_builds,
                              rope_head_batches, rope_spec, rope_vector_widths)
from ..build.registry_mla import mla_model_specs
from ..errors import shown
from .model_mla import MLA_FIELDS, mla_geometry, uses_mla  # noqa: F401

# Models that RMS-normalise each q and k head before RoPE (their q_norm / k_norm weights have
# head_dim entries): ``warm --model`` adds the fused QK-norm builds for them (rope_rtc.ops.qk_norm).
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text",
                       "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                       "gemma3", "gemma3_text")

# Model types whose configs name the geometry as GPT-2's do (transformers' attribute_map:
# num_attention_heads is n_head, hidden_size is n_embd) and give the rotated width of each head as
# rotary_dim, GPT2_NAMED_ROTARY_DIM when the key is absent (transformers' default for both).
GPT2_NAMED_MODEL_TYPES = ("gptj", "codegen")
_GPT2_NAMES = {"num_attention_heads": "n_head", "hidden_size": "n_embd"}
GPT2_NAMED_ROTARY_DIM = 64

# Models whose attention rotates adjacent pairs (x[2i], x[2i + 1]), as transformers implements
# them: rotate_half takes x[..., 0::2] and x[..., 1::2] (GLM and GLM-4 with GLM-4V's and GLM-OCR's
# text models, Cohere, ERNIE 4.5, Helium), Llama 4 multiplies complex numbers made of adjacent
# channels, GPT-J and CodeGen rotate_every_two; ChatGLM's own code (not in transformers) pairs
# x[..., 2i] with x[..., 2i + 1]. Their kernels are the interleaved builds.
ADJACENT_PAIR_MODEL_TYPES = ("glm", "glm4", "glm4v", "glm4v_text", "glm_ocr", "glm_ocr_text", "cohere", "cohere2",
                             "cohere2_moe", "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text",
                             "helium", "llama4", "llama4_text", "gptj", "codegen", "chatglm")

# Vision towers that rotate their patches with axial RoPE (rope_rtc.numerics.axial: two position
# streams, contiguous sections [D/4, D/4] over the whole head), by the model_type of the model or of
# its vision_config: Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's towers, Pixtral's. Other towers (CLIP,
# SigLIP: Gemma 3, LLaVA) add learned position embeddings and launch no RoPE kernel.
AXIAL_VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "pixtral")

# Fields that name the kv head count where this reader looks for num_key_value_heads (Falcon's).
OTHER_KV_HEAD_FIELDS = ("num_kv_heads", "n_head_kv")

#: The most of a config file that is read: real ones are kilobytes, and a far larger file is
#: another one given by mistake (the weights), which reading whole would fill the memory with.
MAX_CONFIG_BYTES = 64 << 20

# The largest geometry a model's builds are made for. Each value is a compile-time define that
# the kernels compute with in 32-bit ints (heads x head_dim stays under 2**28 within these), and
# released models have at most a few hundred heads of at most a few hundred channels (DeepSeek's
# MLA caches 512): a larger value is a mistaken field, whose builds would fill the cache and serve
# nothing. The head dim's is tables.MAX_ROTARY_DIM, the widest window a cos/sin table is made for.
MAX_HEADS = 2**12
MAX_HEAD_DIM = 2**16

# ModelRope's fields, the bound of each and the ``rope-rtc warm`` flag that gives it.
_GEOMETRY = {"head_dim": (MAX_HEAD_DIM, "--head-dim"), "q_heads": (MAX_HEADS, "--heads"),
             "kv_heads": (MAX_HEADS, "--kv-heads"), "rotary_dim": (MAX_HEAD_DIM, "--rotary-dim")}

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
          "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


@dataclass(frozen=True)
class ModelRope:
    """A model's RoPE geometry."""

    head_dim: int
    q_heads: int
    kv_heads: int
    rotary_dim: int
    dtype: str
    interleaved: bool = False
    # Multimodal RoPE (Qwen2-VL, Qwen3-VL): [t, h, w] frequencies per position stream, () for none,
    # and whether the sections interleave (T, H, W, T, ...) as Qwen3-VL's do.
    mrope_section: tuple = ()
    mrope_interleaved: bool = False
    # Per-head RMSNorm before RoPE (Qwen3, Gemma 3): the fused QK-norm builds are warmed too.
    qk_norm: bool = False
    # inv_freq dtypes ("float64", "float32") whose builds (cos/sin computed in the kernel) to warm.
    inv_freq: tuple = ()
    # The vision tower's axial RoPE (AXIAL_VISION_MODEL_TYPES): (head_dim, heads), () for none.
    vision: tuple = ()
    # Multi-head latent attention: (kv_lora_rank, qk_nope_head_dim), () for none; head_dim and
    # rotary_dim are then qk_rope_head_dim, and kv_heads 1 (k_pe).
    mla: tuple = ()

    def __post_init__(self) -> None:
        for name in _GEOMETRY:
            _geometry_arg(name, getattr(self, name))
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim: {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.q_heads % self.kv_heads:
            # Grouped-query attention shares each kv head among q_heads / kv_heads q heads: no model
            # has another ratio, so the builds specialised on it would serve nothing.
            raise ValueError(f"kv_heads: {self.kv_heads} does not divide q_heads {self.q_heads} (each kv head serves "
                             f"q_heads / kv_heads q heads); check the config's num_key_value_heads and "
                             f"num_attention_heads, or --kv-heads and --heads")
        if self.mrope_section and self.interleaved:
            raise ValueError("mrope_section: the multimodal RoPE builds rotate half-split pairs only "
                             "(rope_rtc.ops.mrope), and this model rotates adjacent pairs (interleaved): no build "
                             "serves it; warm its plain builds with --head-dim, --heads, --kv-heads, --rotary-dim "
                             "and --interleaved instead of --model")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype: {shown(self.dtype)} is not one of {sorted(set(DTYPES.values()))}")
        for d in self.inv_freq:
            if d not in ANGLE_MODES:
                raise ValueError(f"inv_freq: {shown(d)} is not one of {', '.join(ANGLE_MODES)}")
        if self.vision:
            head_dim, heads = self.vision
            _bounded(head_dim, "vision head_dim", MAX_HEAD_DIM)
            _bounded(heads, "vision heads", MAX_HEADS)
            if head_dim % 4:
                raise ValueError(f"vision head_dim: {head_dim} is not a multiple of 4; axial RoPE gives each axis a "
                                 "quarter of the head's channels")

    def specs(self) -> list[KernelSpec]:
        """Every build a plan for this model can launch: the generic builds of its dtype and pair
        style (each vector width and head batch), the builds specialised on its geometry for q with
        k, q alone and k alone, in both thread orders (``RopePlan.compile`` loads the generic ones
        and its own specialised one), and the fused RoPE + KV-cache-write builds. Each build once:
        with as many kv heads as q heads, "q alone" and "k alone" are one build."""
        generic = [rope_spec(self.dtype, self.interleaved, vec, hb)
                   for vec in rope_vector_widths(self.dtype, self.interleaved)
                   for hb in rope_head_batches(self.interleaved)]
        fixed = model_fixed_specs(self.dtype, self.interleaved, self.q_heads, self.kv_heads, self.head_dim,
                                  self.rotary_dim)
        every = (generic + fixed + self.cache_specs() + self.mrope_specs() + self.qk_norm_specs() + self.angle_specs()
                 + self.vision_specs())
        return list(dict.fromkeys(every))

    def angle_specs(self) -> list[KernelSpec]:
        """The builds that compute cos and sin from ``inv_freq`` (``apply_rope(..., inv_freq=)``)
        for each dtype in ``inv_freq``: q with k, q alone and k alone, both thread orders, small
        and large launches (the small launches' build for each position scheme: it compiles the
        scheme in)."""
        return list(dict.fromkeys(
            g.spec() for dt in self.inv_freq
            for hq, hk in ((self.q_heads, self.kv_heads), (self.q_heads, 0), (self.kv_heads, 0))
            for denser in (False, True)
            for mode in model_pos_modes(denser)
            for g in both_strides(angle_geometries(self.dtype, self.interleaved, hq, hk, self.head_dim, 0,
                                                   self.rotary_dim, dt, denser, mode))))

    def qk_norm_specs(self) -> list[KernelSpec]:
        """The fused QK-norm + RoPE builds (rope_rtc.ops.qk_norm) a ``QKNormRopePlan.compile`` loads:
        every vector width the geometry allows and the staged twins (large launches), for weights
        of the model's dtype in both numerics and for float32 weights in the exact one (Gemma 3's
        ``1 + weight``)."""
        if not self.qk_norm:
            return []
        kinds = [(numerics, False) for numerics in NORM_MODES]
        if self.dtype != "float32":
            kinds.append(("exact", True))
        return [g.spec() for numerics, f32 in kinds
                for g in norm_builds(self.dtype, self.interleaved, self.q_heads, self.kv_heads, self.head_dim, 0,
                                     self.rotary_dim, f32, numerics)]

    def mrope_specs(self) -> list[KernelSpec]:
        """The multimodal RoPE builds (rope_rtc.ops.mrope) of a model with ``mrope_section``: q with k,
        q alone and k alone, both thread orders, for small and large launches."""
        if not self.mrope_section:
            return []
        return [g.spec() for hq, hk in ((self.q_heads, self.kv_heads), (self.q_heads, 0), (self.kv_heads, 0))
                for denser in (False, True)
                for g in both_strides(mrope_geometries(self.dtype, hq, hk, self.head_dim, self.rotary_dim,
                                                       self.mrope_section, self.mrope_interleaved, denser))]

    def vision_specs(self) -> list[KernelSpec]:
        """The vision tower's axial RoPE builds: multimodal RoPE with two streams and contiguous
        sections ``[D/4, D/4]`` over the whole head (``apply_mrope_qk`` with
        :func:`rope_rtc.axial_tables`), q with k and q alone, both thread orders (Qwen's towers
        rotate ``[N, H, D]``, Pixtral's ``[B, H, N, D]``), for small and large launches."""
        if not self.vision:
            return []
        head_dim, heads = self.vision
        section = (head_dim // 4, head_dim // 4)
        return list(dict.fromkeys(
            g.spec() for hk in (heads, 0) for denser in (False, True)
            for g in both_strides(mrope_geometries(self.dtype, heads, hk, head_dim, head_dim, section, False,
                                                   denser))))

    def cache_specs(self) -> list[KernelSpec]:
        """The fused RoPE + KV-cache-write builds for aligned arrays: the cache in the model's dtype, FP8
        e4m3 and FP8 e5m2; of rope_rtc.ops.mla for an MLA model (its cache is the latent row), else of
        rope_rtc.ops.kv_cache."""
        if self.mla:
            lora, nope = self.mla
            return mla_model_specs(self.dtype, self.interleaved, self.q_heads, nope, self.rotary_dim, lora)
        span = self.rotary_dim if self.interleaved else self.rotary_dim // 2
        out = []
        for kind in (0, 1, 2):  # the first width the geometry allows (FP8 entries: 2 bytes at least)
            vec = next((v for v in cache_vector_widths(self.dtype, self.interleaved, kind)
                        if span % v == 0 and (self.head_dim - self.rotary_dim) % v == 0 and (not kind or v >= 2)), None)
            if vec is not None:
                out.append(cache_spec(self.dtype, self.interleaved, vec, kind, self.q_heads, self.kv_heads,
                                      self.head_dim, self.rotary_dim))
        return out


def _dtype(value, where: str) -> str:
    name = value.removeprefix("torch.").lower() if isinstance(value, str) else None
    if name not in DTYPES:
        raise ValueError(f"{where}: {shown(value)} is not a RoPE dtype; expected one of bfloat16, float16, float32")
    return DTYPES[name]


def _bounded(value, what: str, limit: int | None = None) -> int:
    """``value`` if it is an int in 1..``limit``; else ``ValueError`` naming ``what`` and the range.
    A float (``32.0``) is refused as every count of a config is: JSON writes counts as ints."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {shown(value)}")
    if limit is not None and value > limit:
        raise ValueError(f"{what} must be in 1..{limit}, got {shown(value)}: no model is that large; is it the "
                         "right field?")
    return value


def _geometry_arg(name: str, value) -> int:
    """A geometry field given as such (``ModelRope``, a keyword of ``from_config``, a flag)."""
    limit, flag = _GEOMETRY[name]
    return _bounded(value, f"{name} ({flag})", limit)


def _int_field(config: dict, name: str, where: str, limit: int | None = None) -> int:
    return _bounded(config.get(name), f"{where}: {name}", limit)


def from_config(config: dict | str | os.PathLike, *, dtype: str | None = None, head_dim: int | None = None,
                q_heads: int | None = None, kv_heads: int | None = None, rotary_dim: int | None = None,
                interleaved: bool | None = None, qk_norm: bool | None = None, inv_freq: tuple = ()) -> ModelRope:
    """The RoPE geometry of a Hugging Face config (a dict or the path of a ``config.json``, which
    must be a regular file); a keyword given here overrides the config's field. A model whose text
    settings sit under ``text_config`` (vision-language models) is read from there.
    ``interleaved``: adjacent pairs (default: the model's ``model_type`` is one of
    ``ADJACENT_PAIR_MODEL_TYPES``; False for such a model raises, as it asks for kernels the model
    never launches). ``qk_norm``: whether the model normalises each q and k head before RoPE
    (default: its ``model_type`` is one of ``QK_NORM_MODEL_TYPES``). ``inv_freq``: the dtypes
    (``"float64"``, ``"float32"``) of inverse frequencies the model's calls pass instead of tables,
    whose builds to warm too.

    A multi-head latent attention config (DeepSeek-V2/V3, Kimi K2) is read as its rotary part
    (``model_mla``). GPT-J's and CodeGen's are read by their own names (``n_head``, ``n_embd``,
    and ``rotary_dim`` the rotated width of each head, 64 when absent, as transformers reads them).

    Raises ``ValueError`` for a config whose rotary geometry these fields would misread (ChatGLM,
    kv heads under another name, no rotary embedding, a ``rotary_dim`` that disagrees with
    ``partial_rotary_factor``, an MLA config that does not say its pair style), naming the field and
    the geometry to give
    instead: with ``head_dim``, ``q_heads``, ``kv_heads`` and ``rotary_dim`` all given, the
    config supplies only the dtype and such a config is read. Raises ``ValueError`` too for head
    counts above ``MAX_HEADS`` and head dims above ``MAX_HEAD_DIM``, and for a file that is not a
    regular file of UTF-8 JSON of at most ``MAX_CONFIG_BYTES`` (nested no deeper than the JSON
    parser goes)."""
    where = "config"
    given = {"head_dim": head_dim, "q_heads": q_heads, "kv_heads": kv_heads, "rotary_dim": rotary_dim}
    for name, value in given.items():
        if value is not None:
            _geometry_arg(name, value)  # before any arithmetic on it (head_dim x a float factor)
    if not isinstance(config, dict):
        path = Path(config)
        where = str(path)
        config = _parse_config(_read_config(path), path)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"{where}: text_config must be a JSON object, got {type(text).__name__}")
    # The outer model_type and the text model's (a vision-language model's text_config has its own).
    types = tuple(t for t in (config.get("model_type"), (text or {}).get("model_type")) if isinstance(t, str))
    vision = _vision(config, where, types)
    if qk_norm is None:
        qk_norm = any(t in QK_NORM_MODEL_TYPES for t in types)
    if text:
        # The text model's fields win, but a null there (a field it leaves to the outer config)
        # does not erase the outer value.
        config = {**config, **{k: v for k, v in text.items() if v is not None}}
    gpt2_named = any(t in GPT2_NAMED_MODEL_TYPES for t in types)
    if gpt2_named:
        config = {**config, **{name: config[own] for name, own in _GPT2_NAMES.items()
                               if config.get(name) is None and config.get(own) is not None}}
    mla = ()
    if None in (head_dim, q_heads, kv_heads, rotary_dim) and uses_mla(config):
        given = {"head_dim": head_dim, "q_heads": q_heads, "kv_heads": kv_heads, "rotary_dim": rotary_dim}
        geometry = mla_geometry(config, where, types, interleaved, _bounded, MAX_HEADS, MAX_HEAD_DIM)
        for name, value in given.items():
            if value is not None and value != geometry[name]:
                raise ValueError(f"{where}: {name} {value} disagrees with the config's multi-head latent attention "
                                 f"({name} {geometry[name]}); leave it unset, or give all four geometry fields")
        head_dim, q_heads, kv_heads, rotary_dim = (geometry[n] for n in given)
        interleaved, mla = geometry["interleaved"], geometry["mla"]
    elif None in (head_dim, q_heads, kv_heads, rotary_dim):  # else the config gives only the dtype
        _refuse_misread_geometry(config, where, types, kv_given=kv_heads is not None)
    adjacent = next((t for t in types if t in ADJACENT_PAIR_MODEL_TYPES), None)
    if interleaved is None:
        interleaved = adjacent is not None
    elif adjacent is not None and not interleaved:
        raise ValueError(f"{where}: model_type {shown(adjacent)} rotates adjacent pairs (x[2i], x[2i + 1]), but "
                         "interleaved=False asks for the half-split builds, which it never launches; pass "
                         "--interleaved (interleaved=True), or leave interleaved unset")
    if q_heads is None:
        q_heads = _int_field(config, "num_attention_heads", where, MAX_HEADS)
    if kv_heads is None:
        # Absent: multi-head attention; 0 is an error.
        kv_heads = q_heads if config.get("num_key_value_heads") is None else \
            _int_field(config, "num_key_value_heads", where, MAX_HEADS)
    if head_dim is None:
        if config.get("head_dim") is None:
            hidden = _int_field(config, "hidden_size", where)
            if hidden % q_heads:
                raise ValueError(f"{where}: hidden_size {shown(hidden)} is not a multiple of num_attention_heads "
                                 f"{q_heads}; give head_dim")
            head_dim = _bounded(hidden // q_heads, f"{where}: hidden_size / num_attention_heads (the head dim)",
                                MAX_HEAD_DIM)
        else:
            head_dim = _int_field(config, "head_dim", where, MAX_HEAD_DIM)
    if rotary_dim is None and gpt2_named:
        stated = config.get("rotary_dim", GPT2_NAMED_ROTARY_DIM)
        if stated is None:
            # transformers then builds tables n_embd wide, which fit the heads only when there is one.
            if q_heads != 1:
                raise ValueError(f"{where}: rotary_dim is null, which rotates n_embd channels of each head and fits "
                                 f"only one head, not {q_heads}; give the rotated width as --rotary-dim (rotary_dim=)")
            stated = head_dim
        rotary_dim = _bounded(stated, f"{where}: rotary_dim")
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"{where}: rotary_dim {rotary_dim} must be even and at most head_dim {head_dim} (the "
                             "rotated channels are whole pairs of one head)")
    if rotary_dim is None:
        field, factor = _partial_rotary_factor(config)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"{where}: {field} must be in (0, 1], got {shown(factor)}")
        rotary_dim = int(head_dim * factor)
        rotary_dim -= rotary_dim % 2  # as transformers does: int(head_dim * factor), pairs whole
        if rotary_dim == 0:
            raise ValueError(f"{where}: {field} {shown(factor)} of head_dim {head_dim} rotates no channel pair")
        stated = config.get("rotary_dim")  # GPT-J's and some others' own word for the rotated width
        if stated is not None and stated != rotary_dim:
            raise ValueError(f"{where}: rotary_dim {shown(stated)} disagrees with head_dim {head_dim} x {field} "
                             f"{shown(factor)} = {rotary_dim}; pass the rotated width as --rotary-dim (rotary_dim=)")
    if dtype is None:
        value = config.get("torch_dtype", config.get("dtype"))
        if value is None:
            raise ValueError(f"{where}: no torch_dtype (or dtype); give the dtype the model runs in")
        dtype = _dtype(value, f"{where}: torch_dtype")
    else:
        dtype = _dtype(dtype, "dtype")
    section, style = _mrope(config, where, rotary_dim)
    return ModelRope(head_dim, q_heads, kv_heads, rotary_dim, dtype, bool(interleaved), section, style, bool(qk_norm),
                     tuple(dict.fromkeys(inv_freq)), vision, mla)


def _parse_config(data: bytes, path: Path):
    """The JSON value of a config file's bytes; ``ValueError`` naming ``path`` when they are not
    UTF-8 JSON, or JSON nested deeper than the parser's recursion limit (no config is: a few levels)."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"--model: {path} is JSON nested too deeply to be a config (a config's objects nest a "
                         "few levels); give the path of the model's config.json") from None
    except ValueError as exc:  # not UTF-8, not JSON, or an int longer than Python converts (sys.get_int_max_str_digits)
        raise ValueError(f"--model: {path} is not JSON ({exc})") from None  # never the text itself


def _read_config(path: Path) -> bytes:
    """The bytes of the config file ``path``; ``ValueError`` unless it is a regular file of at most
    ``MAX_CONFIG_BYTES``: reading a FIFO waits for a writer that may never come, a device may
    never end."""
    try:
        # O_NONBLOCK: opening a FIFO for reading then returns at once instead of waiting for a
        # writer; what was opened is checked next, on the descriptor itself.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"--model: cannot read {path}: {exc.strerror or exc}") from None
    try:
        _regular_file(path, os.fstat(fd))
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ValueError(f"--model: cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"--model: {path} holds more than {MAX_CONFIG_BYTES} bytes, which no config.json does (the "
                         "weights?); give the path of the model's config.json")
    return b"".join(chunks)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _regular_file(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a file")
        raise ValueError(f"--model: {path} is {kind}, not a regular file; give the path of the model's config.json")


def _flags(head_dim, heads, kv_heads, rotary_dim, interleaved: bool) -> str:
    """The ``rope-rtc warm`` flags of a geometry; a value the config does not give (or gives out of
    bounds) reads ``N``."""
    def value(v, limit: int):
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= limit else "N"

    return (f"--head-dim {value(head_dim, MAX_HEAD_DIM)} --heads {value(heads, MAX_HEADS)} "
            f"--kv-heads {value(kv_heads, MAX_HEADS)} --rotary-dim {value(rotary_dim, MAX_HEAD_DIM)}"
            + (" --interleaved" if interleaved else ""))


def _refuse_misread_geometry(config: dict, where: str, types: tuple, *, kv_given: bool) -> None:
    """``ValueError`` for a config whose rotary geometry the fields :func:`from_config` reads would
    get wrong, naming the field and the flags that give the geometry instead."""
    model = f"model_type {shown(types[-1])}" if types else "the model"
    heads = config.get("num_attention_heads")
    given_instead = "(with or without --model: the config then gives only the dtype)"
    if "chatglm" in types or config.get("multi_query_group_num") is not None:
        what = model if "chatglm" in types else "multi_query_group_num is set: the model (ChatGLM's field)"
        hidden = config.get("hidden_size")
        head_dim = config.get("kv_channels") or (
            hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None)
        kv = config.get("multi_query_group_num") if config.get("multi_query_attention", True) else heads
        half = head_dim // 2 if isinstance(head_dim, int) else None
        raise ValueError(
            f"{where}: {what} keeps its kv heads in multi_query_group_num and rotates adjacent pairs in the first "
            f"kv_channels / 2 channels of each head, which the fields this reader reads do not say. Give that "
            f"geometry: {_flags(head_dim, heads, kv, half, True)} {given_instead}")
    if config.get("alibi") is True:
        raise ValueError(f"{where}: alibi is true: {model} adds ALiBi biases and has no rotary embedding to warm "
                         "kernels for")
    kind = config.get("position_embedding_type")
    if kind is not None and kind not in ("rotary", "rope"):
        raise ValueError(f"{where}: position_embedding_type {shown(kind)}: {model} has no rotary embedding to warm "
                         "kernels for (only 'rotary' has)")
    if not kv_given and config.get("num_key_value_heads") is None:
        other = next((f for f in OTHER_KV_HEAD_FIELDS if config.get(f) is not None), None)
        if other is None and config.get("multi_query") is True:
            other = "multi_query"
        if other is not None:
            raise ValueError(f"{where}: {other} {shown(config[other])} gives the kv heads, not num_key_value_heads, "
                             "the field this reader reads; pass the kv head count as --kv-heads (kv_heads=)")


def _partial_rotary_factor(config: dict) -> tuple[str, object]:
    """``(field, value)`` of the config's rotary fraction: the top-level ``partial_rotary_factor``
    (transformers 4), else the one inside ``rope_parameters`` (transformers 5 moves it there) or
    ``rope_scaling``; ``("partial_rotary_factor", 1.0)`` when none is given."""
    if config.get("partial_rotary_factor") is not None:
        return "partial_rotary_factor", config["partial_rotary_factor"]
    if config.get("rotary_pct") is not None:  # GPT-NeoX and Pythia's name for it
        return "rotary_pct", config["rotary_pct"]
    for field in ("rope_parameters", "rope_scaling"):
        rope = config.get(field)
        if isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None:
            return f"{field}.partial_rotary_factor", rope["partial_rotary_factor"]
    return "partial_rotary_factor", 1.0


def _vision(config: dict, where: str, types: tuple) -> tuple:
    """``(head_dim, heads)`` of the vision tower of a model whose tower rotates with axial RoPE
    (``AXIAL_VISION_MODEL_TYPES``, by the model's or its ``vision_config``'s model_type), else
    ``()``. The heads are ``num_heads`` (Qwen) or ``num_attention_heads`` (Pixtral); the head dim
    ``head_dim``, else the width over the heads: ``embed_dim`` (Qwen2-VL, whose ``hidden_size`` is
    the text model's) or ``hidden_size``."""
    vision = config.get("vision_config")
    if vision is None:
        return ()
    if not isinstance(vision, dict):
        raise ValueError(f"{where}: vision_config must be a JSON object, got {type(vision).__name__}")
    kind = vision.get("model_type")
    if not any(t in AXIAL_VISION_MODEL_TYPES for t in types + ((kind,) if isinstance(kind, str) else ())):
        return ()
    at = f"{where}: vision_config"
    field = "num_heads" if vision.get("num_heads") is not None else "num_attention_heads"
    heads = _int_field(vision, field, at, MAX_HEADS)
    if vision.get("head_dim") is not None:
        head_dim = _int_field(vision, "head_dim", at, MAX_HEAD_DIM)
    else:
        width = "embed_dim" if vision.get("embed_dim") is not None else "hidden_size"
        size = _int_field(vision, width, at)
        if size % heads:
            raise ValueError(f"{at}: {width} {shown(size)} is not a multiple of {field} {heads}; give head_dim")
        head_dim = _bounded(size // heads, f"{at}: {width} / {field} (the head dim)", MAX_HEAD_DIM)
    return head_dim, heads


def _mrope(config: dict, where: str, rotary_dim: int) -> tuple[tuple, bool]:
    """``(mrope_section, interleaved)`` from the config's ``rope_scaling`` or ``rope_parameters``
    (Qwen2-VL and Qwen3-VL keep them there), or ``((), False)``."""
    for field in ("rope_scaling", "rope_parameters"):
        rope = config.get(field)
        if isinstance(rope, dict) and rope.get("mrope_section") is not None:
            section = rope["mrope_section"]
            if (not isinstance(section, list) or len(section) != 3
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in section)):
                raise ValueError(f"{where}: {field}.mrope_section must be three non-negative ints, "
                                 f"got {shown(section)}")
            if sum(section) != rotary_dim // 2:
                raise ValueError(f"{where}: {field}.mrope_section {shown(section)} sums to {shown(sum(section))}, "
                                 f"not rotary_dim / 2 = {rotary_dim // 2}")
            interleaved = rope.get("mrope_interleaved", False)
            if not isinstance(interleaved, bool):  # bool("false") is True
                raise ValueError(f"{where}: {field}.mrope_interleaved must be true or false, "
                                 f"got {shown(interleaved)}")
            return tuple(section), interleaved
    return (), False
