"""Quick GPU smoke: every kernel family once against the NumPy references, plus launch-path costs."""
import sys, time, traceback
import numpy as np
import ml_dtypes
import cupy as cp
import rope_rtc
from rope_rtc import reference as R
from rope_rtc.rope import apply_rope, apply_rope_qk, RopePlan
from rope_rtc.tail import TailRoPEForward

rng = np.random.default_rng(0)
fails = 0

def tables(P, R2):
    ang = rng.uniform(0, 6.28, (P, R2))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

def check(name, fn):
    global fails
    try:
        fn(); print("OK  ", name)
    except Exception:
        fails += 1; print("FAIL", name); traceback.print_exc()

def general(dtype, interleaved, layout, rd=None, ro=0, inplace=False):
    B, S, H, D = 2, 37, 4, 128
    shape = {"bshd": (B, S, H, D), "bhsd": (B, H, S, D), "sbhd": (S, B, H, D)}[layout]
    x = rng.standard_normal(shape).astype(dtype)
    R2 = (rd or D) // 2
    c, s = tables(64, R2)
    xd = cp.asarray(x)
    if inplace:
        out = apply_rope(xd, cp.asarray(c), cp.asarray(s), layout=layout, interleaved=interleaved, rotary_dim=rd,
                         rotary_offset=ro, out=xd, offset=3)
    else:
        out = apply_rope(xd, cp.asarray(c), cp.asarray(s), layout=layout, interleaved=interleaved, rotary_dim=rd,
                         rotary_offset=ro, offset=3)
    got = cp.asnumpy(out)
    perm = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3), "sbhd": (1, 0, 2, 3)}[layout]
    xc = np.transpose(x, perm).reshape(-1, H, D)
    pos = np.tile(np.arange(S) + 3, B)
    ref = R.rope_reference(xc, c, s, pos, interleaved=interleaved, rotary_dim=rd, rotary_offset=ro)
    gc = np.transpose(got, perm).reshape(-1, H, D)
    R.assert_rope_close(gc, ref, xc, interleaved=interleaved, rotary_dim=rd, rotary_offset=ro, dtype=np.dtype(dtype))

for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
    for il in (False, True):
        for lay in ("bshd", "bhsd", "sbhd"):
            check(f"general {np.dtype(dt).name} il={il} {lay}", lambda: general(dt, il, lay))
check("general partial out-of-place", lambda: general(ml_dtypes.bfloat16, False, "bshd", rd=64, ro=32))
check("general partial in-place", lambda: general(np.float32, True, "bshd", rd=32, ro=16, inplace=True))

def tail(T, H, D, neg=False):
    x = rng.standard_normal((T, H, D)).astype(ml_dtypes.bfloat16)
    ang = rng.uniform(-10, 10, (T, 32))
    c = np.cos(ang).astype(np.float32); s = np.sin(ang).astype(np.float32)
    if neg: s = -s
    xd, cd, sd = cp.asarray(x), cp.asarray(c), cp.asarray(s)
    out = cp.full(x.shape, cp.nan, dtype=x.dtype)
    plan = TailRoPEForward(xd, cd, sd, out).check_support().compile()
    plan.execute(xd, cd, sd, out)
    ref = R.tail_rope_reference(x, c, s)
    got = cp.asnumpy(out)
    assert (got.view(np.uint16) == ref.view(np.uint16)).all(), "tail mismatch"

for shp in ((1, 1, 128), (4, 32, 128), (17, 3, 128), (4096, 1, 512), (4096, 64, 512)):
    check(f"tail {shp}", lambda: tail(*shp))
check("tail neg", lambda: tail(17, 3, 512, True))

def blog(variant):
    B, H, S, D = 2, 4, 33, 128
    q = rng.standard_normal((B, H, S, D)).astype(np.float32)
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    c, s = tables(64, D // 2)
    if variant == "fused":
        qo, ko = apply_rope_qk(cp.asarray(q), cp.asarray(k), cp.asarray(c), cp.asarray(s), layout="bhsd", interleaved=True, variant=variant)
    else:
        qo = apply_rope(cp.asarray(q), cp.asarray(c), cp.asarray(s), layout="bhsd", interleaved=True, variant=variant)
    qc = np.transpose(q, (0, 2, 1, 3)).reshape(-1, H, D)
    ref = R.rope_reference(qc, c, s, np.tile(np.arange(S), B), interleaved=True)
    got = np.transpose(cp.asnumpy(qo), (0, 2, 1, 3)).reshape(-1, H, D)
    assert np.abs(got - ref).max() <= 1e-6, np.abs(got - ref).max()
for v in ("baseline", "vectorized", "fused"):
    check(f"blog {v}", lambda: blog(v))

# --- launch path costs ---
from cuda.bindings import driver as drv
import ctypes
x = cp.asarray(rng.standard_normal((1, 64, 512)).astype(ml_dtypes.bfloat16))
c = cp.asarray(np.ones((1, 32), np.float32)); s = cp.asarray(np.zeros((1, 32), np.float32))
out = cp.empty_like(x)
plan = TailRoPEForward(x, c, s, out).check_support().compile()
for _ in range(1000): plan.execute(x, c, s, out)
cp.cuda.runtime.deviceSynchronize()
N = 20000
t = time.perf_counter()
for _ in range(N): plan.execute(x, c, s, out)
dt = (time.perf_counter() - t) / N * 1e6
cp.cuda.runtime.deviceSynchronize()
print(f"tail execute host us/call: {dt:.2f}")
f = plan._f1; args = plan._args.address; st = drv.CUstream(cp.cuda.get_current_stream().ptr)
t = time.perf_counter()
for _ in range(N): drv.cuLaunchKernel(f, 16, 1, 1, 256, 1, 1, 0, st, args, 0)
print(f"raw cuLaunchKernel us/call: {(time.perf_counter() - t) / N * 1e6:.2f}")
t = time.perf_counter()
for _ in range(N): drv.cuLaunchKernel(f, 16, 1, 1, 256, 1, 1, 0, cp.cuda.get_current_stream().ptr, args, 0)
print(f"raw cuLaunchKernel int stream us/call: {(time.perf_counter() - t) / N * 1e6:.2f}")
t = time.perf_counter()
for _ in range(N): cp.cuda.get_current_stream(0).ptr
print(f"get_current_stream us: {(time.perf_counter() - t) / N * 1e6:.2f}")
t = time.perf_counter()
for _ in range(N): cp.cuda.runtime.getDevice()
print(f"getDevice us: {(time.perf_counter() - t) / N * 1e6:.2f}")
libcuda = ctypes.CDLL("libcuda.so.1")
fn = libcuda.cuLaunchKernel
fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
fn.restype = ctypes.c_int
fptr = int(f); sptr = cp.cuda.get_current_stream().ptr
t = time.perf_counter()
for _ in range(N): fn(fptr, 16, 1, 1, 256, 1, 1, 0, sptr, args, None)
print(f"ctypes cuLaunchKernel us/call: {(time.perf_counter() - t) / N * 1e6:.2f}")
cp.cuda.runtime.deviceSynchronize()
# rope plan decode
q = cp.asarray(rng.standard_normal((1, 1, 32, 128)).astype(ml_dtypes.bfloat16))
k = cp.asarray(rng.standard_normal((1, 1, 8, 128)).astype(ml_dtypes.bfloat16))
cc, ss = [cp.asarray(t) for t in tables(4096, 64)]
rp = RopePlan(q, k, cc, ss).compile()
for i in range(1000): rp.execute(q, k, cc, ss, offset=i)
cp.cuda.runtime.deviceSynchronize()
t = time.perf_counter()
for i in range(N): rp.execute(q, k, cc, ss, offset=5 + (i & 1023))
print(f"RopePlan execute (changing offset) us/call: {(time.perf_counter() - t) / N * 1e6:.2f}")
t = time.perf_counter()
for i in range(N): rp.execute(q, k, cc, ss)
print(f"RopePlan execute us/call: {(time.perf_counter() - t) / N * 1e6:.2f}")
cp.cuda.runtime.deviceSynchronize()
print("FAILS", fails)
