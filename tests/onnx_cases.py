"""ONNX RotaryEmbedding cases shared by the CPU and GPU tests: the inputs of one case, and the
operator's own numbers from the ``onnx`` package's reference evaluator on a one-node model."""

from __future__ import annotations

import itertools

import numpy as np

B, H, S, D, MAX_POS = 2, 3, 5, 16, 40

# (dtype, rank of X, interleaved, rotary_embedding_dim, with position_ids)
CASES = list(itertools.product(["float32", "float16"], [4, 3], [0, 1], [0, 8], [True, False]))


def case_inputs(dtype: str, rank: int, rotary_dim: int, with_ids: bool, seed: int = 0) -> dict:
    """X (rank 4: [B, H, S, D]; rank 3: [B, S, H * D]), the caches in X's dtype, position_ids."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    half = (rotary_dim or D) // 2
    X = rng.standard_normal((B, H, S, D) if rank == 4 else (B, S, H * D)).astype(dt)
    if with_ids:
        ang = rng.uniform(-8.0, 8.0, (MAX_POS, half))
        ids = rng.integers(0, MAX_POS, (B, S)).astype(np.int64)
    else:
        ang = rng.uniform(-8.0, 8.0, (B, S, half))
        ids = None
    return {"X": X, "cos": np.cos(ang).astype(dt), "sin": np.sin(ang).astype(dt), "ids": ids}


def onnx_reference(inputs: dict, interleaved: int, rotary_dim: int, rank: int) -> np.ndarray:
    """Y from ``onnx.reference.ReferenceEvaluator`` running one RotaryEmbedding node (opset 23)."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    elem = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}[inputs["X"].dtype]
    names = ["X", "cos", "sin"] + (["ids"] if inputs["ids"] is not None else [])
    attrs = {"interleaved": interleaved, "rotary_embedding_dim": rotary_dim}
    if rank == 3:
        attrs["num_heads"] = H
    node = helper.make_node("RotaryEmbedding", names, ["Y"], **attrs)
    vi = [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "ids" else elem, list(inputs[n].shape))
          for n in names]
    graph = helper.make_graph([node], "rotary", vi, [helper.make_tensor_value_info("Y", elem, list(inputs["X"].shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(model)
    (y,) = ReferenceEvaluator(model).run(None, {n: inputs[n] for n in names})
    return y


def float64_reference(inputs: dict, interleaved: int, rotary_dim: int, rank: int) -> tuple:
    """(Y from rope_rtc's float64 reference, X canonical [T, H, D], Y canonical) for the contract's bound."""
    from rope_rtc.reference import rope_reference

    X = inputs["X"]
    xb = X.transpose(0, 2, 1, 3) if rank == 4 else X.reshape(B, S, H, D)  # [B, S, H, D]
    xc = xb.reshape(B * S, H, D)
    if inputs["ids"] is not None:
        cos, sin, pos = inputs["cos"], inputs["sin"], inputs["ids"].reshape(-1)
    else:
        cos, sin = inputs["cos"].reshape(B * S, -1), inputs["sin"].reshape(B * S, -1)
        pos = np.arange(B * S)
    ref = rope_reference(xc, cos.astype(np.float32), sin.astype(np.float32), pos, interleaved=bool(interleaved),
                         rotary_dim=rotary_dim or None)
    return ref, xc


def canonical(y: np.ndarray, rank: int) -> np.ndarray:
    yb = y.transpose(0, 2, 1, 3) if rank == 4 else y.reshape(B, S, H, D)
    return yb.reshape(B * S, H, D)
