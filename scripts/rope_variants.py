"""General-kernel tuning probe: heads per thread (ROPE_HEAD_BATCH), cold L2, vs same-size copy."""
import cupy as cp
import ml_dtypes
import numpy as np

import rope_rtc
from rope_rtc import registry, rope
from perf_probe import copy_time, timed, L2

base_spec = registry.rope_spec
CASES = [("fp32", "bhsd", True, 4, 4096, 32, 32, 128), ("bf16", "bshd", False, 4, 4096, 32, 32, 128),
         ("bf16", "bhsd", False, 4, 4096, 32, 32, 128), ("fp32", "bshd", False, 4, 16384, 32, 32, 128),
         ("fp16", "bshd", True, 4, 16384, 32, 32, 128)]
copies = {}
for hb in (1, 2, 4, 8):
    registry.rope_spec = lambda d, i, v, hb=hb: registry.KernelSpec(
        "rope", "rope.cu", ("rope_apply",), base_spec(d, i, v).defines[:3] + (("ROPE_HEAD_BATCH", str(hb)),))
    rope.rope_spec = registry.rope_spec
    rope.rope_head_batch = lambda interleaved, hb=hb: hb
    line = [f"HB={hb}"]
    for dtype, layout, il, B, S, Hq, Hk, D in CASES:
        dt = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32, "fp16": np.float16}[dtype]
        shp = (lambda H: (B, S, H, D)) if layout == "bshd" else (lambda H: (B, H, S, D))
        esz = np.dtype(dt).itemsize
        moved = 2 * B * S * (Hq + Hk) * D * esz + 2 * B * S * (D // 2) * 4
        sets = max(1, int(np.ceil(4 * L2 / moved)) + 1)
        rng = cp.random.default_rng(1)
        qs = [rng.standard_normal(shp(Hq), dtype=cp.float32).astype(dt) for _ in range(sets)]
        ks = [rng.standard_normal(shp(Hk), dtype=cp.float32).astype(dt) for _ in range(sets)]
        cos, sin = rope_rtc.rope_tables(S, D, xp=cp)
        plan = rope_rtc.RopePlan(qs[0], ks[0], cos, sin, layout=layout, interleaved=il).compile()
        t = timed(lambda i: plan.execute(qs[i], ks[i], cos, sin), sets)
        key = (dtype, layout, S)
        if key not in copies:
            copies[key] = copy_time(moved)
        line.append(f"{dtype}/{layout}/il{int(il)}/S{S} {100 * copies[key] / t:5.1f}%")
        del qs, ks
    print("  ".join(line), flush=True)
