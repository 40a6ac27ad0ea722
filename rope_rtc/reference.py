"""``rope_rtc.reference``, the public path of the NumPy references: the code is in
rope_rtc/numerics/ (rope_rtc/numerics/reference.py gathers the public names of its one module per
contract). This module replaces itself in sys.modules with that one; a private name, or a
monkeypatch, belongs to the module that defines the name."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("rope_rtc.numerics.reference")
