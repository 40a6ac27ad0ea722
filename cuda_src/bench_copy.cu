// The benchmark's reference kernels (rope_rtc/benchmark/runner.py), not part of the library's API.
//
// bench_copy_16b: one thread per 16 bytes, the simplest kernel that moves a buffer. At small
// sizes, where launch and memory latency rather than bandwidth set the time, it shows how close
// any kernel can come to a cudaMemcpyAsync node of the same size.
//
// bench_spin: one thread that waits ``ns`` nanoseconds of the GPU's global timer (independent of
// the SM clock). The host timings enqueue their calls behind it, so the GPU cannot hold the host
// back while it is being timed.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) bench_copy_16b(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                                 i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void bench_spin(i64 ns) {
    const u64 start = global_ns();
    while (global_ns() - start < (u64)ns) {
    }
}
