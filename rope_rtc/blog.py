"""``rope_rtc.blog``, the public path of the blog post's three kernels (the demo's and the
benchmark's): the code is in rope_rtc/ops/blog.py. This module replaces itself in sys.modules
with that one, so private names and monkeypatching reach it."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("rope_rtc.ops.blog")
