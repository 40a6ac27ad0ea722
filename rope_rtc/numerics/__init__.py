"""Frequencies, cos/sin tables, model configs and the NumPy references (the CPU backend)."""
