// The benchmark's reference copy kernel (rope_rtc/bench.py), not part of the library's API.
//
// One thread per 16 bytes, the simplest kernel that moves a buffer: at small sizes, where
// launch and memory latency rather than bandwidth set the time, it shows how close any kernel
// can come to a cudaMemcpyAsync node of the same size.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) bench_copy_16b(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                                 i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
