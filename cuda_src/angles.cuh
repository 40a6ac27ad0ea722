// cos and sin computed in the kernel from the inverse frequencies instead of read from a table
// (rope_rtc/ops/rope_request.py: inv_freq=; FixedGeometry.angles). The argument block's cos field
// holds inv_freq (rotary_dim / 2 entries), `attention` the factor that multiplies cos and sin.
//
// ANGLES 1, inv_freq float64 (numerics "exact"): the angle is double(pos) * inv_freq[i] rounded
// once in float64, which is the angle of rope_tables(numerics="exact") bit for bit; its cos and
// sin are evaluated in float64 (relative error near 1e-16), multiplied by the factor in float64
// and rounded once to float32. So an entry is the exact table's, except where the true value
// lies within about 1e-16 (relative) of a float32 rounding boundary: then one ulp apart.
// ANGLES 2, inv_freq float32 (numerics "transformers"): the angle is float32(pos) * inv_freq[i]
// rounded to float32, as torch computes it; cos and sin of that float32 angle are rounded to
// float32 and multiplied by float32(factor) in float32 (rope_tables(numerics="transformers")).
//
// Argument reduction: k = the integer nearest x * 2/pi, r = x - k * pi/2 with pi/2 split in two doubles. The
// first FMA is exact (its result needs at most 52 bits for |k| < 2^31), so r carries an absolute
// error near 2^-54 at any position the API accepts (below 2^31, frequencies at most about 1):
// the naive float32 pos * inv_freq loses about 2^(log2(pos) - 24) radians instead, 0.06 at 2^20.
// On |r| <= pi/4 the Taylor series to x^15 (sin) and x^16 (cos) leave about 1e-16 relative (to
// x^11 and x^12 they left 1e-11, and about 4 entries in a million one ulp off the exact table).
#pragma once

#include "common.cuh"

namespace angles {

constexpr double TWO_OVER_PI = 0.63661977236758134308;
constexpr double PIO2_HI = 1.5707963267948966;      // the double nearest pi/2
constexpr double PIO2_LO = 6.123233995736766e-17;   // pi/2 - PIO2_HI, to double
constexpr double S3 = -1.0 / 6.0, S5 = 1.0 / 120.0, S7 = -1.0 / 5040.0, S9 = 1.0 / 362880.0,
                 S11 = -1.0 / 39916800.0, S13 = 1.0 / 6227020800.0, S15 = -1.0 / 1307674368000.0;
constexpr double C2 = -0.5, C4 = 1.0 / 24.0, C6 = -1.0 / 720.0, C8 = 1.0 / 40320.0, C10 = -1.0 / 3628800.0,
                 C12 = 1.0 / 479001600.0, C14 = -1.0 / 87178291200.0, C16 = 1.0 / 20922789888000.0;

// 1.5 * 2^52: adding it rounds a double below 2^51 in magnitude to an integer, which then sits in
// the low bits of the sum (no float-to-int conversion, a slow instruction, per pair).
constexpr double ROUNDER = 6755399441055744.0;

// sin(x) and cos(x) in float64 for |x| < 2^31.
__device__ __forceinline__ void sincos_f64(double x, double& s, double& c) {
    const double kr = fma(x, TWO_OVER_PI, ROUNDER);
    const double k = kr - ROUNDER;  // an integer near x * 2/pi (exact subtraction)
    const double r = fma(-k, PIO2_LO, fma(-k, PIO2_HI, x));
    const double z = r * r;
    const double sr = fma(r * z, fma(z, fma(z, fma(z, fma(z, fma(z, fma(z, S15, S13), S11), S9), S7), S5), S3), r);
    const double cr =
        fma(z, fma(z, fma(z, fma(z, fma(z, fma(z, fma(z, fma(z, C16, C14), C12), C10), C8), C6), C4), C2), 1.0);
    const int q = __double2loint(kr) & 3;  // the quadrant: x = r + q * pi/2 (mod 2 pi)
    const double ss = (q & 1) ? cr : sr, cc = (q & 1) ? sr : cr;
    s = (q & 2) ? -ss : ss;
    c = ((q + 1) & 2) ? -cc : cc;
}

}  // namespace angles

// The inverse frequencies' type: float64 (ANGLES 1) or float32 (ANGLES 2).
template <int ANGLES>
struct AngleFreq {
    typedef double type;
};
template <>
struct AngleFreq<2> {
    typedef float type;
};

// inv_freq[at .. at + NPAIR) from P's cos field. Loaded before the position (angle_values), so
// that the two loads are in flight together: a decode launch waits for one round trip, not two.
template <int NPAIR, int ANGLES, typename P>
__device__ __forceinline__ void angle_freqs(const P& p, unsigned at, typename AngleFreq<ANGLES>::type* f) {
    typedef typename AngleFreq<ANGLES>::type ft;
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) f[j] = __ldg((const ft*)p.cos + at + j);
}

// The cos/sin values of NPAIR pairs at position `pos` from their frequencies f (NaN when pos < 0:
// a position outside the accepted range), sin times `sign`, times P's attention factor.
template <int NPAIR, int ANGLES, typename P>
__device__ __forceinline__ void angle_values(const P& p, i64 pos, const typename AngleFreq<ANGLES>::type* f,
                                             float sign, float* c, float* sn) {
    // pos < 2^31 (token_row checks it against table_rows): the 32-bit conversions are exact for
    // float64 and round to nearest even for float32, as float32(position) does in torch.
    const int ip = pos < 0 ? 0 : (int)pos;
    const double pd = (double)ip;
    const float pf = __int2float_rn(ip);
    const float nan = __int_as_float(0x7fffffff);
#pragma unroll
    for (int j = 0; j < NPAIR; ++j) {
        double s, co;
        if (ANGLES == 1) {
            angles::sincos_f64(__dmul_rn(pd, (double)f[j]), s, co);
            c[j] = __double2float_rn(__dmul_rn(co, p.attention));
            sn[j] = sign * __double2float_rn(__dmul_rn(s, p.attention));
        } else {
            angles::sincos_f64((double)__fmul_rn(pf, (float)f[j]), s, co);
            const float a = __double2float_rn(p.attention);
            c[j] = __fmul_rn(__double2float_rn(co), a);
            sn[j] = sign * __fmul_rn(__double2float_rn(s), a);
        }
        // A selection, not a branch: the position is rarely out of range.
        c[j] = pos < 0 ? nan : c[j];
        sn[j] = pos < 0 ? nan : sn[j];
    }
}
