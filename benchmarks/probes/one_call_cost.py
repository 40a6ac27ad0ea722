"""Where the host time of a one-call ``apply_rope_qk`` goes (decode, bf16, B=8, Hq=32, Hkv=8,
D=128, per-sequence offsets, in place): the whole call with new arrays each call, and the
pieces it is made of, including the launch paths (cuLaunchKernel through CuPy's binding or
ctypes, and a one-node graph whose kernel node gets new arguments before each replay).

    PYTHONPATH=. python3 benchmarks/probes/one_call_cost.py
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
from probe_timing import host_us


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS (v1 ABI, what the unversioned symbol takes)."""

    _fields_ = [("func", ctypes.c_void_p), ("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("shared", ctypes.c_uint),
                ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p)]


def main() -> None:
    import cupy as cp

    import rope_rtc
    from rope_rtc.core import launcher as launch_core
    from rope_rtc.core import prepared

    bf16 = ml_dtypes.bfloat16
    cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
    rng = np.random.default_rng(0)
    sets = [(cp.asarray(rng.standard_normal((8, 1, 32, 128)).astype(bf16)),
             cp.asarray(rng.standard_normal((8, 1, 8, 128)).astype(bf16)),
             cp.asarray(rng.integers(0, 4000, 8).astype(np.int32))) for _ in range(64)]
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        it = iter(range(10**9))

        def cycled():
            q, k, o = sets[next(it) % 64]
            rope_rtc.apply_rope_qk(q, k, cos, sin, offset=o, q_out=q, k_out=k, layout="bshd")

        q0, k0, o0 = sets[0]
        rows.append(("apply_rope_qk, 64 sets cycled", host_us(cycled)))
        rows.append(("apply_rope_qk, same arrays",
                     host_us(lambda: rope_rtc.apply_rope_qk(q0, k0, cos, sin, offset=o0, q_out=q0, k_out=k0,
                                                                 layout="bshd"))))
        plan = rope_rtc.RopePlan(q0, k0, cos, sin, offset=o0, layout="bshd").compile()
        rows.append(("RopePlan.execute, same arrays", host_us(lambda: plan.execute(q0, k0, cos, sin, offset=o0))))
        arrays = (q0, k0, cos, sin, None, q0, k0, None, o0)
        rows.append(("signature of 9 arguments", host_us(lambda: prepared.signature(arrays))))
        rows.append(("pointers of 9 arguments", host_us(lambda: prepared.pointers(arrays))))
        rows.append(("cupy.cuda.get_current_stream().ptr", host_us(lambda: cp.cuda.get_current_stream().ptr)))
        rows.append(("cupy.empty((8,1,32,128), bf16)", host_us(lambda: cp.empty((8, 1, 32, 128), bf16))))
        rows.append(("empty Python call", host_us(lambda: None)))
        # Launch paths of the plan's own kernel and argument block.
        core = plan._core
        call = core.bind(arrays, 0)
        fn, gx, gy, gz, bx, by, bz, shared = call.prefix
        args = core.args.address
        h = stream.ptr
        from cupy_backends.cuda.api.driver import launchKernel

        fnp = int(fn)
        rows.append(("cuLaunchKernel (CuPy's binding)",
                     host_us(lambda: launchKernel(fnp, gx, gy, gz, bx, by, bz, shared, h, args, 0))))
        libcuda = ctypes.CDLL("libcuda.so.1")
        cu_launch = libcuda.cuLaunchKernel
        cu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        cu_launch.restype = ctypes.c_int
        rows.append(("cuLaunchKernel (ctypes)",
                     host_us(lambda: cu_launch(fnp, gx, gy, gz, bx, by, bz, shared, h, args, None))))
        launcher = launch_core.Launcher(args, core.device)
        launcher.replay = False
        rows.append(("Launcher (plain)", host_us(lambda: launcher(call.prefix, h))))
        # One graph, new kernel arguments before each replay.
        from cuda.bindings import driver as drv

        set_params = libcuda.cuGraphExecKernelNodeSetParams
        set_params.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(KernelNodeParams)]
        set_params.restype = ctypes.c_int
        graph = drv.cuGraphCreate(0)[1]
        node_params = drv.CUDA_KERNEL_NODE_PARAMS()
        node_params.func, node_params.sharedMemBytes, node_params.kernelParams = fn, shared, args
        node_params.gridDimX, node_params.gridDimY, node_params.gridDimZ = gx, gy, gz
        node_params.blockDimX, node_params.blockDimY, node_params.blockDimZ = bx, by, bz
        node = drv.cuGraphAddKernelNode(graph, None, 0, node_params)[1]
        gexec = drv.cuGraphInstantiate(graph, 0)[1]
        params = ctypes.byref(KernelNodeParams(fnp, gx, gy, gz, bx, by, bz, shared, args, None))
        node_p, gexec_p, gexec_i = ctypes.c_void_p(int(node)), ctypes.c_void_p(int(gexec)), int(gexec)
        graph_launch = cp.cuda.runtime.graphLaunch
        status = set_params(gexec_p, node_p, params)
        rows.append((f"cuGraphExecKernelNodeSetParams (ctypes; status {status})",
                     host_us(lambda: set_params(gexec_p, node_p, params))))
        rows.append(("cudaGraphLaunch", host_us(lambda: graph_launch(gexec_i, h))))
        rows.append(("set params + graph launch",
                     host_us(lambda: (set_params(gexec_p, node_p, params), graph_launch(gexec_i, h)))))
    stream.synchronize()
    for name, us in rows:
        print(f"{name:<60} {us:8.2f} µs")


if __name__ == "__main__":
    main()
