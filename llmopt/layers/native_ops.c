// The element-wise layer functions of llmopt.layers (norm.py, rotary.py, activation.py) for bf16 rows on a
// CPU, one call each instead of 3-11 small torch ops. Each rounds where the eager function rounds (the eager
// one is the definition and the tests compare the two): float32 arithmetic inside, bf16 at every point where
// eager torch would hold a bf16 tensor. Built and loaded by native_ops.py; compiled with -ffast-math (the
// reductions vectorize, so sums may differ from torch's in the last float32 bit) but linked without it.
#include <math.h>
#include <stdint.h>

#include "native_bf16.h"

#define PAR_MIN 65536  // elements below which a call stays on one thread (an OpenMP fork costs more)

static inline float round_bf16(float f) { return bf16_to_f(f_to_bf16(f)); }

// out[r] = norm(x[r]) for r < rows, x rows `x_stride` apart, `dim` long. With `res`: x[r] + res[r] is
// rounded to bf16, written to res_out[r] and normalized instead (the residual add fused into the norm).
// offset = 0 (llama): bf16(w * bf16(h * rsqrt(mean(h^2) + eps))); offset = 1 (Gemma):
// bf16(h * rsqrt(...) * (1 + w)) in float32, rounded once.
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *res, uint16_t *res_out,
                   const uint16_t *w, float eps, int offset, uint16_t *out, int64_t rows, int64_t dim, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * dim >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        float ss = 0.f;
        if (res) {  // the sum, in bf16 as eager torch holds it, becomes the row to normalize
            uint16_t *s = res_out + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                s[i] = f_to_bf16(bf16_to_f(xr[i]) + bf16_to_f(res[r * dim + i]));
                const float v = bf16_to_f(s[i]);
                ss += v * v;
            }
            xr = s;
        } else {
            for (int64_t i = 0; i < dim; i++) {
                const float v = bf16_to_f(xr[i]);
                ss += v * v;
            }
        }
        const float scale = 1.f / sqrtf(ss / (float)dim + eps);
        uint16_t *o = out + r * dim;
        if (offset) {
            for (int64_t i = 0; i < dim; i++) o[i] = f_to_bf16(bf16_to_f(xr[i]) * scale * (1.f + bf16_to_f(w[i])));
        } else {
            for (int64_t i = 0; i < dim; i++) o[i] = f_to_bf16(bf16_to_f(w[i]) * round_bf16(bf16_to_f(xr[i]) * scale));
        }
    }
}

// Rotate-half RoPE over x [rows, heads, dim] (rows `row_stride` apart, heads contiguous), cos/sin float32
// [rows, dim]: out [rows, heads, dim] = bf16(x * cos + rotate_half(x) * sin), computed in float32.
void rotary_bf16(const uint16_t *x, int64_t row_stride, int64_t heads, int64_t dim, const float *cos,
                 const float *sin, uint16_t *out, int64_t rows, int nthreads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for num_threads(nthreads) if (rows * heads * dim >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + r * row_stride + h * dim;
            uint16_t *o = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f(xh[i]), b = bf16_to_f(xh[i + half]);
                o[i] = f_to_bf16(a * c[i] - b * s[i]);
                o[i + half] = f_to_bf16(b * c[i + half] + a * s[i + half]);
            }
        }
    }
}

// The tanh-approximated GELU of one gate value times its up value, as eager torch computes and rounds it.
static inline uint16_t gelu_mul(uint16_t g, uint16_t u) {
    const float v = bf16_to_f(g);
    const float a = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    return f_to_bf16(round_bf16(a) * bf16_to_f(u));
}

// SiLU of a bf16 gate as eager torch computes it, g / (1 + e^-g), for the loops without AVX-512. Under -ffast-math GCC
// divides vectors by a reciprocal estimate, which gives 0 for a divisor past 2^126 and NaN for an infinite one,
// where eager's division gives tiny values and zeros of g's sign. So far out on the negative side the quotient is
// not divided: g e^g where e^-g is finite (the same float: 1 / (1 + e^-g) = e^g (1 - e^g + ...)), and a zero of
// g's sign, from its bits, where e^-g overflows (g below -88.72; -inf keeps eager's NaN, inf * 0).
static inline float silu(uint16_t g) {
    const float v = bf16_to_f(g);
    const float near = v / (1.f + expf(-v)), far = v * expf(v);
    const uint32_t zero_bits = (uint32_t)(g & 0x8000u) << 16;
    float zero;
    memcpy(&zero, &zero_bits, sizeof zero);
    const int overflows = (g & 0x8000u) && (g & 0x7fffu) >= 0x42b2u && (g & 0x7fffu) < 0x7f80u;  // -inf < g <= -89
    return overflows ? zero : v < -64.f ? far : near;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)  // DQ: vfpclassps
#define GATED_X16 1
static inline __mmask16 first_n(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

// 16 float32 -> bf16, rounded to nearest even as f_to_bf16 (NaN kept quiet; vcvtneps2bf16 would flush subnormals).
static inline __m256i f32x16_to_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(64));
    return _mm512_cvtepi32_epi16(r);
}

// e^x, 16 at a time, within about an ulp of expf (Cephes' expf: x = n ln2 + r in two parts, |r| <= ln2 / 2, a
// degree-7 polynomial for e^r, then 2^n by vscalefps, which overflows to inf and underflows through the
// subnormals to 0 as expf does): libmvec's vector expf is a call per 16 and made SiLU the slowest native op.
static inline __m512 exp_f32x16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

// SiLU(gate) * up for n <= 16 columns, rounding where the scalar loop rounds.
static inline void silu_mul_x16(const uint16_t *g, const uint16_t *u, uint16_t *o, int n) {
    const __mmask16 mask = first_n(n);
    const __m512 v = bf16x16_widen(_mm256_maskz_loadu_epi16(mask, g));
    const __m512 up = bf16x16_widen(_mm256_maskz_loadu_epi16(mask, u));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp_f32x16(_mm512_sub_ps(_mm512_setzero_ps(), v)));
    // where e^-v overflowed, v / inf is a zero of v's sign (the division, built with -ffast-math, may become a
    // reciprocal and a Newton step, which turn an infinite divisor into NaN)
    const __mmask16 inf = _mm512_cmp_ps_mask(d, _mm512_set1_ps(3.402823466e38f), _CMP_GT_OQ)
                          & (__mmask16)~_mm512_fpclass_ps_mask(v, 0x10);  // gate -inf: NaN, as -inf / inf is
    const __m512 a = _mm512_mask_blend_ps(inf, _mm512_div_ps(v, d),
                                          _mm512_and_ps(v, _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u))));
    const __m512 ar = bf16x16_widen(f32x16_to_bf16(a));
    _mm256_mask_storeu_epi16(o, mask, f32x16_to_bf16(_mm512_mul_ps(ar, up)));
}

// tanh(y) = sign(y) (1 - 2 / (e^(2|y|) + 1)): near +-1 the small term keeps its relative precision, so tanh is within
// about an ulp there too, where eager's 1 + tanh(y) cancels. |y| is clamped to 10, past which tanh is +-1 in float32
// (and e^(2|y|) stays finite, so the division never meets an infinite divisor).
static inline __m512 tanh_f32x16(__m512 y) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    const __m512 s = _mm512_min_ps(_mm512_andnot_ps(sign, y), _mm512_set1_ps(10.f));
    const __m512 e = exp_f32x16(_mm512_add_ps(s, s));
    const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.f),
                                   _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
    return _mm512_or_ps(t, _mm512_and_ps(y, sign));
}

// gelu_mul for n <= 16 columns: 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))) in the same order; a vector with
// an infinite or NaN gate goes through gelu_mul (the clamp would turn a NaN into a number).
static inline void gelu_mul_x16(const uint16_t *g, const uint16_t *u, uint16_t *o, int n) {
    const __mmask16 mask = first_n(n);
    const __m512 v = bf16x16_widen(_mm256_maskz_loadu_epi16(mask, g));
    if (_mm512_mask_fpclass_ps_mask(mask, v, 0x99)) {  // quiet or signalling NaN, +inf, -inf
        for (int i = 0; i < n; i++) o[i] = gelu_mul(g[i], u[i]);
        return;
    }
    const __m512 up = bf16x16_widen(_mm256_maskz_loadu_epi16(mask, u));
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, v));
    const __m512 a = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v),
                                   _mm512_add_ps(_mm512_set1_ps(1.f), tanh_f32x16(y)));
    const __m512 ar = bf16x16_widen(f32x16_to_bf16(a));
    _mm256_mask_storeu_epi16(o, mask, f32x16_to_bf16(_mm512_mul_ps(ar, up)));
}
#endif

// out [rows, inter] = bf16(bf16(act(gate)) * up) over x [rows, 2 * inter] = gate | up, as eager torch rounds
// the activation to bf16 before the multiply. act: SiLU (gelu = 0) or tanh-approximated GELU (gelu = 1).
void gated_act_bf16(const uint16_t *x, int64_t rows, int64_t inter, int gelu, uint16_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * inter >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
#ifdef GATED_X16
        for (int64_t i = 0; i < inter; i += 16) {
            const int n = inter - i < 16 ? (int)(inter - i) : 16;
            if (gelu) gelu_mul_x16(g + i, u + i, o + i, n);
            else silu_mul_x16(g + i, u + i, o + i, n);
        }
        continue;
#endif
        if (gelu) {
            for (int64_t i = 0; i < inter; i++) o[i] = gelu_mul(g[i], u[i]);
        } else {
            for (int64_t i = 0; i < inter; i++) o[i] = f_to_bf16(round_bf16(silu(g[i])) * bf16_to_f(u[i]));
        }
    }
}
