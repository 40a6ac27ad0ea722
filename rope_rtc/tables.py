"""``rope_rtc.tables``, the public path of the cos/sin tables: the code is in rope_rtc/numerics/tables.py.
This module replaces itself in sys.modules with that one, so private names and monkeypatching reach it."""
import importlib
import sys

sys.modules[__name__] = importlib.import_module("rope_rtc.numerics.tables")
