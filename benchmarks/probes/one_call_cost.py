"""Where the host time of a one-call ``apply_rope_qk`` goes (decode, bf16, B=8, Hq=32, Hkv=8,
D=128, per-sequence offsets, in place, new arrays each call): the whole call beside the pieces of
its path, each timed alone on the objects the call itself uses:

- the thread's last path, the generated check-and-write of the signature (``core/dispatch.py``);
- the current stream's lookup and ``cudaStreamIsCapturing`` (``Launcher.launch``);
- ``cuGraphExecKernelNodeSetParams`` on the launch's graph node, through cuda.bindings as the
  launcher calls it and through ctypes (the launcher keeps the cheaper), and with cuda-bindings
  13.5 or newer through its experimental integer-handle module ``cuda.bindings._v2`` (with that
  module's capture query, graph launch and ``cuLaunchKernel``);
- ``cudaGraphLaunch`` of that graph, beside ``cuLaunchKernel`` (CuPy's binding), which the node
  and the graph launch replace, and a bare ``cudaMemcpyAsync`` for scale.

    PYTHONPATH=. python3 benchmarks/probes/one_call_cost.py
"""

from __future__ import annotations

import ctypes

import numpy as np
from probe_timing import decode_sets, host_us


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2, what ``cuGraphExecKernelNodeSetParams_v2`` takes."""

    _fields_ = [("func", ctypes.c_void_p), ("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("shared", ctypes.c_uint),
                ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p)]


def main() -> None:
    import cuda.bindings
    import cupy as cp
    from cupy_backends.cuda.api.driver import launchKernel

    import rope_rtc
    from rope_rtc.ops.rope import ONE_CALL

    cos, sin = rope_rtc.rope_tables(4096, 128, xp=cp)
    rng = np.random.default_rng(0)
    sets = decode_sets(cp, rng)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    with stream:
        it = iter(range(10**12))

        def cycled():
            q, k, o = sets[next(it) % 64]
            rope_rtc.apply_rope_qk(q, k, cos, sin, offset=o, q_out=q, k_out=k, layout="bshd")

        for _ in range(3):  # validation, then the signature's last path and its graph node
            cycled()
        q0, k0, o0 = sets[0]
        rows.append(("apply_rope_qk, 64 sets cycled", host_us(cycled)))
        rows.append(("apply_rope_qk, same arrays",
                     host_us(lambda: rope_rtc.apply_rope_qk(q0, k0, cos, sin, offset=o0, q_out=q0, k_out=k0,
                                                            layout="bshd"))))
        plan = rope_rtc.RopePlan(q0, k0, cos, sin, offset=o0, layout="bshd").compile()
        rows.append(("RopePlan.execute, same arrays", host_us(lambda: plan.execute(q0, k0, cos, sin, offset=o0))))

        # The pieces, on the call's own path: its generated function, launcher and graph node.
        last = ONE_CALL.thread().last
        launcher, check_and_write = last.go.__self__, last.one_call
        args = (q0, k0, cos, sin, None, q0, k0, None, o0, 0)
        fn, gx, gy, gz, bx, by, bz, shared = check_and_write(*args)
        graph, h = launcher._last_updated, stream.ptr
        rows.append(("last path: generated check-and-write", host_us(lambda: check_and_write(*args))))
        current = cp.cuda.get_current_stream
        rows.append(("current stream lookup", host_us(lambda: current(0).ptr)))
        capturing = cp.cuda.runtime.streamIsCapturing
        rows.append(("cudaStreamIsCapturing (CuPy's binding)", host_us(lambda: capturing(h))))
        set_node, node_args = launcher._set_node, (graph.handle, graph.node, graph.params)
        rows.append(("cuGraphExecKernelNodeSetParams (cuda.bindings)", host_us(lambda: set_node(*node_args))))
        by_ctypes = ctypes.CDLL("libcuda.so.1").cuGraphExecKernelNodeSetParams_v2
        by_ctypes.argtypes = [ctypes.c_void_p] * 3
        by_ctypes.restype = ctypes.c_int
        params = KernelNodeParams(int(fn), gx, gy, gz, bx, by, bz, shared, launcher.args_address, None, None, None)
        raw = (graph.handle_int, int(graph.node), ctypes.addressof(params))
        status = by_ctypes(*raw)
        rows.append((f"cuGraphExecKernelNodeSetParams (ctypes; status {status})", host_us(lambda: by_ctypes(*raw))))
        try:  # the experimental integer-handle bindings (cuda-bindings 13.5 and newer)
            from cuda.bindings._v2 import driver as drv2
        except ImportError:
            drv2 = None
        if drv2 is not None:
            p2 = drv2.KernelNodeParams_v2()
            p2.func, p2.grid_dim_x, p2.grid_dim_y, p2.grid_dim_z = int(fn), gx, gy, gz
            p2.block_dim_x, p2.block_dim_y, p2.block_dim_z = bx, by, bz
            p2.shared_mem_bytes, p2.kernel_params = shared, launcher.args_address
            set2, raw2 = drv2.graph_exec_kernel_node_set_params_v2, (graph.handle_int, int(graph.node), p2.ptr)
            rows.append(("cuGraphExecKernelNodeSetParams (cuda.bindings._v2)", host_us(lambda: set2(*raw2))))
            cap2 = drv2.stream_is_capturing
            rows.append(("cuStreamIsCapturing (cuda.bindings._v2)", host_us(lambda: cap2(h))))
            launch2, exe2 = drv2.graph_launch, graph.handle_int
            rows.append(("cuGraphLaunch (cuda.bindings._v2)", host_us(lambda: launch2(exe2, h))))
            kl2, fn2 = drv2.launch_kernel, int(fn)
            rows.append(("cuLaunchKernel (cuda.bindings._v2)",
                         host_us(lambda: kl2(fn2, gx, gy, gz, bx, by, bz, shared, h, launcher.args_address, 0))))
        graph_launch, exe = cp.cuda.runtime.graphLaunch, graph.handle_int
        rows.append(("cudaGraphLaunch", host_us(lambda: graph_launch(exe, h))))
        block, fnp = launcher.args_address, int(fn)
        rows.append(("cuLaunchKernel (CuPy's binding)",
                     host_us(lambda: launchKernel(fnp, gx, gy, gz, bx, by, bz, shared, h, block, 0))))
        src, dst = cp.empty(1 << 16, cp.uint8), cp.empty(1 << 16, cp.uint8)
        copy = cp.cuda.runtime.memcpyAsync
        rows.append(("cudaMemcpyAsync of 64 KB (reference)",
                     host_us(lambda: copy(dst.data.ptr, src.data.ptr, 1 << 16, 3, h))))
        rows.append(("empty Python call", host_us(lambda: None)))
    stream.synchronize()
    print(f"cuda-bindings {cuda.bindings.__version__}")
    for name, us in rows:
        print(f"{name:<60} {us:8.2f} µs")


if __name__ == "__main__":
    main()
