// The rotation of a pair, for every kernel: each pair style's vectors are rotated here and only here.
//
// A pair (x0, x1) turned by the angle whose cosine and sine are (c, s):
//     re = x0 c - x1 s,  im = x1 c + x0 s
// The inverse rotation is the same with s negated: the kernels that offer it multiply the table's
// sine by -1 (exact) before they call these, so an inverse rotation is bit for bit the rotation by
// the negated angle.
#pragma once

#include "common.cuh"

// The FP32 rotation, every kernel's (the tail contract's, and the general kernels' with it): the
// product with s rounded to FP32 first (__fmul_rn, which the compiler never contracts), then one
// correctly rounded FMA with the product with c (__fmaf_rn). Written as `x0 * c - x1 * s`, the
// compiler may contract either product into an FMA, or neither, depending on --fmad and on what
// surrounds the expression, and each choice rounds differently; spelled out, the result is the same
// on every architecture and in every build, so the generic, specialised and fused kernels agree
// bit for bit, and the tail contract (docs/tail-rope.md: real = fma(a, c, -fp32(b * s)), imag =
// fma(b, c, fp32(a * s))) holds whatever the compile options.
__device__ __forceinline__ float rot_re(float x0, float x1, float c, float s) { return __fmaf_rn(x0, c, -__fmul_rn(x1, s)); }
__device__ __forceinline__ float rot_im(float x0, float x1, float c, float s) { return __fmaf_rn(x1, c, __fmul_rn(x0, s)); }

__device__ __forceinline__ void rotate_pair(float x0, float x1, float c, float s, float& re, float& im) {
    re = rot_re(x0, x1, c, s);
    im = rot_im(x0, x1, c, s);
}

// Hugging Face's apply_rotary_pos_emb as torch evaluates it in the input dtype, for the fused
// QK-norm kernel's "transformers" numerics: q * cos + rotate_half(q) * sin, each product rounded
// to the dtype, then their sum; c and s arrive already rounded to it (the table cast to the input
// dtype). Conv is a Scalar<T> of common.cuh; for FP32 it is two products and a sum, each rounded
// to FP32, with no FMA.
template <typename Conv>
__device__ __forceinline__ float round_to(float v) {
    return Conv::to_float(Conv::from_float(v));
}

template <typename Conv>
__device__ __forceinline__ void rotate_pair_rounded(float x0, float x1, float c, float s, float& re, float& im) {
    re = round_to<Conv>(__fadd_rn(round_to<Conv>(__fmul_rn(x0, c)), round_to<Conv>(__fmul_rn(-x1, s))));
    im = round_to<Conv>(__fadd_rn(round_to<Conv>(__fmul_rn(x1, c)), round_to<Conv>(__fmul_rn(x0, s))));
}

// The vectors of each pair style, rotated. Each result is rounded once, to nearest even, to the
// element type (Conv is a Scalar<T> of common.cuh). The output may be the input vector itself (the
// fused cache write rotates in place): each pair is read before its results are written. Outputs
// are parameters, not return values: a union returned by value is rebuilt as one wide integer,
// field by field, in slower code.
//
// Interleaved pairs (x[2j], x[2j + 1]) (RoFormer, GPT-J): the N / 2 pairs of one vector of N
// elements, with c[j], s[j] the angle of pair j, into o.
template <typename Conv, int N>
__device__ __forceinline__ void rotate_interleaved(const Vec<typename Conv::bits_t, N>& x, const float* c,
                                                   const float* s, Vec<typename Conv::bits_t, N>& o) {
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
        const float x0 = Conv::to_float(x.v[2 * j]), x1 = Conv::to_float(x.v[2 * j + 1]);
        o.v[2 * j] = Conv::from_float(rot_re(x0, x1, c[j], s[j]));
        o.v[2 * j + 1] = Conv::from_float(rot_im(x0, x1, c[j], s[j]));
    }
}

// Half-split pairs (x[i], x[i + R/2]) (GPT-NeoX, Hugging Face rotate_half): the N pairs of a
// vector of the window's first half (lo) and the vector half the window further (hi), with c[j],
// s[j] the angle of pair j, into olo and ohi.
template <typename Conv, int N>
__device__ __forceinline__ void rotate_halves(const Vec<typename Conv::bits_t, N>& lo,
                                              const Vec<typename Conv::bits_t, N>& hi, const float* c,
                                              const float* s, Vec<typename Conv::bits_t, N>& olo,
                                              Vec<typename Conv::bits_t, N>& ohi) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const float x0 = Conv::to_float(lo.v[j]), x1 = Conv::to_float(hi.v[j]);
        olo.v[j] = Conv::from_float(rot_re(x0, x1, c[j], s[j]));
        ohi.v[j] = Conv::from_float(rot_im(x0, x1, c[j], s[j]));
    }
}
