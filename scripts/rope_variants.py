"""General-kernel tuning probe, prefill: % of a same-size copy with cold L2, per variant
(perf_probe.configure_general: 'default' or 'hb=N[,minb=N][,nc=0|1][,vecbytes=N]').
On a GPU, from the repository root:
    PYTHONPATH=. python3 scripts/rope_variants.py default hb=1 hb=2 hb=4
"""

import sys

from perf_probe import blog_time, configure_general, copy_time, general_time

CASES = [("fp32", "bhsd", True, 4, 4096, 32, 32, 128), ("fp32", "bhsd", False, 4, 4096, 32, 32, 128),
         ("bf16", "bshd", False, 4, 4096, 32, 32, 128), ("bf16", "bhsd", False, 4, 4096, 32, 32, 128),
         ("bf16", "bhsd", True, 4, 4096, 32, 32, 128), ("fp32", "bshd", False, 4, 16384, 32, 32, 128),
         ("fp16", "bshd", True, 4, 16384, 32, 32, 128), ("bf16", "bshd", True, 4, 16384, 32, 32, 128),
         ("fp32", "bhsd", True, 4, 16384, 32, 32, 128), ("fp32", "bhsd", False, 4, 16384, 32, 32, 128),
         ("bf16", "bhsd", False, 4, 16384, 32, 32, 128)]
copies = {}
# Calibration: the blog's fused kernel (98-99% of copy in the benchmark) on its own shape.
t, moved = blog_time("fused", 4, 4096, 32, 128)
copies[("fp32", "bhsd", 4096)] = copy_time(moved)
print(f"blog fused fp32/bhsd/il1/S4096 {100 * copies[('fp32', 'bhsd', 4096)] / t:5.1f}%", flush=True)
for variant in sys.argv[1:] or ["default", "hb=1", "hb=2", "hb=4"]:
    configure_general(variant)
    line = [variant]
    for dtype, layout, il, B, S, Hq, Hk, D in CASES:
        t, moved = general_time(dtype, layout, il, B, S, Hq, Hk, D)
        key = (dtype, layout, S)
        if key not in copies:
            copies[key] = copy_time(moved)
        line.append(f"{dtype}/{layout}/il{int(il)}/S{S} {100 * copies[key] / t:5.1f}%")
    print("  ".join(line), flush=True)
