"""General-kernel tuning probe: heads per thread (ROPE_HEAD_BATCH), cold L2, vs same-size copy."""

from perf_probe import copy_time, general_time
from rope_rtc import registry, rope

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
        t, moved = general_time(dtype, layout, il, B, S, Hq, Hk, D)
        key = (dtype, layout, S)
        if key not in copies:
            copies[key] = copy_time(moved)
        line.append(f"{dtype}/{layout}/il{int(il)}/S{S} {100 * copies[key] / t:5.1f}%")
    print("  ".join(line), flush=True)
