"""Decode tuning probe: GPU µs per call under graph replay, with a positions array and with a
pre-gathered table (what Liger's API takes), beside a same-size copy, per variant
(perf_probe.configure_general). On a GPU, from the repository root:
    PYTHONPATH=. python3 scripts/decode_variants.py default hb=1 hb=2
"""

import sys

from perf_probe import configure_general, decode_probe

for variant in sys.argv[1:] or ["default", "hb=1", "hb=2", "hb=4"]:
    configure_general(variant)
    line = [variant]
    for T in (1, 4, 64):
        tp, tg, tc = decode_probe(T)
        line.append(f"T={T}: positions {tp:.2f} gathered {tg:.2f} copy {tc:.2f} us")
    print("  ".join(line), flush=True)
