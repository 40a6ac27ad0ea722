#!/usr/bin/env python3
"""Warm rope_rtc's kernel cache offline: the same code as ``rope-rtc warm``, reached as a script.

    python scripts/warm_cache.py --arch sm_90 --arch sm_80 --cache-dir /opt/rope_rtc_cache

No GPU is needed. Ship the directory with the servers and point ``ROPE_RTC_CACHE_DIR`` at it
(add ``ROPE_RTC_NO_COMPILE=1`` to make a miss an error instead of a compile). Runs from a
checkout without installing the package.
"""

import sys
from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "rope_rtc" / "__init__.py").is_file() and str(_checkout) not in sys.path:
    sys.path.insert(0, str(_checkout))

from rope_rtc.cli import warm_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(warm_main(sys.argv[1:], prog=Path(__file__).name))
