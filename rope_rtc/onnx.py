"""``rope_rtc.onnx``, the public path of ONNX ``RotaryEmbedding``: the code is in rope_rtc/ops/onnx.py.
This module replaces itself in sys.modules with that one, so private names and monkeypatching reach it."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("rope_rtc.ops.onnx")
