// The error term of GPTQ's range search (rtn.mse_params): for every row r of w [rows, cols] and every
// candidate c with scale s = scale[c, r] and zero z = zero[c, r],
//     err[c, r] = sum_j wt[r, j] * (s * (clamp(round(w[r, j] / s) + z, 0, maxq) - z) - w[r, j])^2,
// the same arithmetic as rtn.fake_quantize (round half to even), in one pass over a row held in L1 for all
// its candidates. torch runs it as ten element-wise ops, each a pass over a
// [candidates, rows, cols] temporary, and the search took ~80% of a GPTQ call (docs/QUANTIZE.md, "GPTQ's
// cost per call"). `wt_stride` is 0 when one [cols] row of weights serves every row. Errors agree with
// torch's to rounding, not bit for bit: sums run in another order, and -ffast-math may divide by multiplying
// with the scale's reciprocal, which moves a quotient by an ulp (a quotient on a tie has the same error
// either way). Built and loaded by range_search_kernel.py.
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>

static float row_error(const float *wr, const float *tr, int64_t cols, float s, float z, float maxq) {
    const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z), vmax = _mm512_set1_ps(maxq);
    const __m512 v0 = _mm512_setzero_ps();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j += 16) {
        // lanes past the row load 0 with weight 0: clamp(0 + z) = z, so they add nothing
        const __mmask16 m = cols - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - j)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, wr + j), t = _mm512_maskz_loadu_ps(m, tr + j);
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(x, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, vz), v0), vmax);
        const __m512 d = _mm512_sub_ps(_mm512_mul_ps(vs, _mm512_sub_ps(q, vz)), x);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(d, d), t));
    }
    return _mm512_reduce_add_ps(acc);
}
#else
// Portable: __builtin_rintf rounds half to even in the default rounding mode.
static float row_error(const float *wr, const float *tr, int64_t cols, float s, float z, float maxq) {
    float acc = 0.f;
    for (int64_t j = 0; j < cols; j++) {
        float q = __builtin_rintf(wr[j] / s) + z;
        q = q < 0.f ? 0.f : (q > maxq ? maxq : q);
        const float d = s * (q - z) - wr[j];
        acc += d * d * tr[j];
    }
    return acc;
}
#endif

void range_errors(const float *w, const float *wt, int64_t wt_stride, int64_t rows, int64_t cols,
                  const float *scale, const float *zero, int64_t cands, float maxq, float *err, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *wr = w + r * cols, *tr = wt + r * wt_stride;
        for (int64_t c = 0; c < cands; c++)
            err[c * rows + r] = row_error(wr, tr, cols, scale[c * rows + r], zero[c * rows + r], maxq);
    }
}
