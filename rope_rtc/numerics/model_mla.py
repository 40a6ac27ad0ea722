"""Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2) read from a Hugging Face config: what
``rope-rtc warm --model`` needs to warm its builds (rope_rtc.numerics.model).

MLA's rotary part is the last ``qk_rope_head_dim`` channels of each of ``num_attention_heads`` q
heads, and one k head (``k_pe``) shared by all of them; the cache row is ``kv_lora_rank`` latent
channels followed by that k head. None of it is ``hidden_size / num_attention_heads`` or
``num_key_value_heads``, which the plain reader reads.
"""

from __future__ import annotations

from ..errors import shown

# The fields of MLA: a config that sets any of them uses it.
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "q_lora_rank")
# Model types whose checkpoints keep their rotary pairs adjacent (DeepSeek's own code multiplies
# complex numbers made of adjacent channels; transformers' DeepSeek-V3 de-interleaves them first,
# its rope_interleave): the same pairs as the interleaved builds.
ADJACENT_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")


def uses_mla(config: dict) -> bool:
    return any(config.get(f) is not None for f in MLA_FIELDS)


def mla_geometry(config: dict, where: str, types: tuple, interleaved: bool | None, bounded, max_heads: int,
                 max_dim: int) -> dict:
    """The keyword arguments of ``ModelRope`` for an MLA config: the rotary geometry (head dim and
    rotary dim ``qk_rope_head_dim``, ``num_attention_heads`` q heads, one k head), the pair style,
    and ``mla`` = ``(kv_lora_rank, qk_nope_head_dim)``. ``bounded(value, what, limit)`` is the
    reader's check of a count. ``ValueError`` naming the field for a config it cannot serve."""
    heads = bounded(config.get("num_attention_heads"), f"{where}: num_attention_heads", max_heads)
    rope = bounded(config.get("qk_rope_head_dim"), f"{where}: qk_rope_head_dim", max_dim)
    nope = bounded(config.get("qk_nope_head_dim"), f"{where}: qk_nope_head_dim", max_dim)
    lora = bounded(config.get("kv_lora_rank"), f"{where}: kv_lora_rank", max_dim)
    if rope % 2:
        raise ValueError(f"{where}: qk_rope_head_dim {rope} is odd; the rotary part is whole channel pairs")
    stated = config.get("rope_interleave")
    if stated is not None and not isinstance(stated, bool):
        raise ValueError(f"{where}: rope_interleave must be true or false, got {shown(stated)}")
    adjacent = stated if stated is not None else (True if any(t in ADJACENT_MLA_TYPES for t in types) else None)
    if interleaved is None:
        if adjacent is None:
            model = f"model_type {shown(types[-1])}" if types else "the model"
            raise ValueError(f"{where}: {model} uses multi-head latent attention and says nothing of its rotary pairs "
                             "(no rope_interleave): pass --interleaved (interleaved=True) if they are adjacent, as "
                             "DeepSeek's are, or interleaved=False for half-split pairs")
        interleaved = adjacent
    elif adjacent is not None and interleaved != adjacent:
        style = "adjacent pairs (x[2i], x[2i + 1])" if adjacent else "half-split pairs (rope_interleave false)"
        raise ValueError(f"{where}: the model rotates {style}, but interleaved={interleaved} asks for builds it never "
                         "launches; leave interleaved unset")
    return dict(head_dim=rope, q_heads=heads, kv_heads=1, rotary_dim=rope, interleaved=bool(interleaved),
                mla=(lora, nope))
