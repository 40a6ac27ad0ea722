"""rope_rtc: rotary positional embeddings for NVIDIA GPUs, compiled at run time with NVRTC.

Public API (imported lazily: ``import rope_rtc`` loads neither CuPy nor the CUDA driver):

- :func:`rope_tables` — cos/sin tables (``numerics="exact"`` or ``"transformers"``);
  :func:`cos_sin_cache` — the same as one combined table, the engines' convention
- :func:`apply_rope`, :func:`apply_rope_qk`, :class:`RopePlan` — the general API
- :func:`rope_and_cache`, :class:`RopeCachePlan` — RoPE fused with the paged KV-cache write (FP8 too)
- :func:`mla_rope_and_cache`, :class:`MlaRopeCachePlan` — DeepSeek-style MLA: RoPE on q's rotary part and
  k_pe with the latent KV-cache write (FP8 too), in one launch
- :func:`apply_mrope`, :func:`apply_mrope_qk`, :class:`MRopePlan` — multimodal RoPE (Qwen2-VL, Qwen3-VL),
  2 to 4 position streams; :func:`axial_tables`, :func:`vision_positions` — a vision tower's
  axial RoPE on it (Qwen2.5-VL, Pixtral)
- :func:`apply_qk_norm_rope`, :class:`QKNormRopePlan` — per-head RMSNorm fused with RoPE (Qwen3, Gemma 3)
- :class:`TailRoPEForward`, :func:`tail_rope` — the prepared BF16 tail RoPE API
- :class:`TensorDesc`, :class:`TupleDict`
- :func:`release_outputs` — drop the small outputs this thread keeps for recycling
"""

from __future__ import annotations

from importlib import import_module

from ._version import __version__

_EXPORTS = {
    "rope_tables": "numerics.tables",
    "inverse_frequencies": "numerics.frequencies",
    "cos_sin_cache": "numerics.tables",
    "apply_rope": "ops.rope",
    "apply_rope_qk": "ops.rope",
    "RopePlan": "ops.rope_plan",
    "rope_and_cache": "ops.kv_cache",
    "RopeCachePlan": "ops.kv_cache",
    "mla_rope_and_cache": "ops.mla",
    "MlaRopeCachePlan": "ops.mla",
    "apply_mrope": "ops.mrope",
    "apply_mrope_qk": "ops.mrope",
    "MRopePlan": "ops.mrope",
    "axial_tables": "numerics.axial",
    "vision_positions": "numerics.axial",
    "apply_qk_norm_rope": "ops.qk_norm",
    "QKNormRopePlan": "ops.qk_norm",
    "TailRoPEForward": "ops.tail",
    "tail_rope": "ops.tail",
    "TensorDesc": "core.descriptors",
    "TupleDict": "core.descriptors",
    "release_outputs": "core.outputs",
    "RopeRtcError": "errors",
    "NoDeviceError": "errors",
    "UnsupportedLayoutError": "errors",
    "CompileError": "errors",
    "CudaError": "errors",
    "KernelNotCachedError": "errors",
    "ToolchainError": "errors",
    "SettingError": "errors",
}

__all__ = ["__version__", *_EXPORTS]

# Modules the docs name by attribute path (rope_rtc.tables.cos_sin_cache, rope_rtc.reference...,
# rope_rtc.onnx.rotary_embedding): imported on first use, so that `import rope_rtc` alone serves them.
_MODULES = ("tables", "reference", "onnx", "blog", "errors")


def __getattr__(name: str):
    if name in _MODULES:
        return import_module(f".{name}", __name__)  # the import binds it here too
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rope_rtc' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, *_MODULES])
