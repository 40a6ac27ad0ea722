"""The ops, one module each (general RoPE, tail, MRoPE, QK-norm, the cache write, ONNX, the blog's
kernels): its arguments, its validation, its plan class and its one-call function, declared to
the core (``rope_rtc.core``). The public names are ``rope_rtc``'s."""
