// Decode attention read straight from the head-major paged KV pool (paged_kv_cache.py's layout): no
// gather of the context into a copy, one pass over K and one over V, softmax in float32. The pool holds
// bf16 values, or int8 / fp8 (e4m3) codes with one float32 scale per slot and head (`--kv-cache-dtype`):
// codes are turned into bf16 a block at a time (exactly: every int8 and e4m3 value is a bf16 value) and
// their scales applied to the scores (K) and to the softmax weights (V), so a quantized pool costs a
// conversion of the codes, not a copy of the context. Head sizes 64, 128 and 256 run vectorized with
// AVX512-BF16 where the CPU has it (attend_vec), or else with AVX2 (attend_avx2), others portably. An fp32
// engine's pool holds float32 values, and its queries and outputs are float32 too (attend_f32). Built and loaded by
// paged_decode_kernel.py; head_major.py calls it for decode groups on a CPU, and so does the native
// decode step (llmopt/step), which also writes quantized K/V rows with `paged_kv_quantize` below.
// Compiled with -ffast-math (vectorized expf and reductions) but linked without it, so loading it does
// not switch the process's floating point into flush-to-zero mode.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { CODES_BF16 = 0, CODES_INT8 = 1, CODES_FP8 = 2, CODES_F32 = 3 };  // F32: float32 q, pools and out

// One layer's K or V pool for one KV head, as the kernel reads it: [S, D] bf16 or float32 rows, or [S, D]
// codes with a float scale per row; `conv`: per-thread room for one block of rows turned into bf16.
typedef struct {
    const void *data;
    const float *scale;  // NULL for bf16
    int codes;
    uint16_t *conv;
} pool_t;

static inline float fp8_to_f(uint8_t b) {  // e4m3fn, exact: the 7 bits placed as a float32's, scaled by 2^120
    uint32_t u = (uint32_t)(b & 0x7F) << 20;
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p120f;
    return b & 0x80 ? -f : f;
}

// n codes -> n bf16 values (exact).
static void codes_to_bf16(const void *src, int codes, int64_t n, uint16_t *dst) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    if (codes == CODES_INT8) {
        for (; i + 32 <= n; i += 32)
            _mm512_storeu_si512((void *)(dst + i), (__m512i)int8x32_to_bf16((const int8_t *)src + i));
    } else {
        const __m512i low7 = _mm512_set1_epi32(0x7F), sign = _mm512_set1_epi32(0x80);
        const __m512 two120 = _mm512_set1_ps(0x1p120f);
        for (; i + 16 <= n; i += 16) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)src + i)));
            __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(b, low7), 20)), two120);
            f = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f),
                                                    _mm512_slli_epi32(_mm512_and_si512(b, sign), 24)));
            _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(f));
        }
    }
#endif
    for (; i < n; i++)
        dst[i] = f_to_bf16(codes == CODES_INT8 ? (float)((const int8_t *)src)[i] : fp8_to_f(((const uint8_t *)src)[i]));
}

// Bytes per stored value of a pool kind.
static inline int64_t pool_esize(int codes) { return codes == CODES_BF16 ? 2 : codes == CODES_F32 ? 4 : 1; }

// The block holding position p (blocks counted from position `first`) as rows of values (bf16 or float32 as
// stored; a quantized pool's rows r0..r1-1 converted to bf16 into pool->conv), its row scales in *rs (NULL
// unless quantized), and in *r0..*r1 the rows of it that positions p..hi-1 use. Prefetches the next block.
static inline const void *block_run(const pool_t *pool, const int64_t *table, int64_t p, int64_t hi,
                                    int64_t first, int64_t bs, int64_t D, int64_t *r0, int64_t *r1,
                                    const float **rs) {
    const int64_t j = (p - first) / bs;
    const int64_t esize = pool_esize(pool->codes);
    *r0 = p - first - j * bs;
    *r1 = *r0 + hi - p < bs ? *r0 + hi - p : bs;
    if (p + *r1 - *r0 < hi) {
        const char *next = (const char *)pool->data + table[j + 1] * bs * D * esize;
        for (int64_t i = 0; i < bs * D * esize; i += 64) __builtin_prefetch(next + i, 0, 3);
    }
    if (pool->codes == CODES_BF16 || pool->codes == CODES_F32) {
        *rs = NULL;
        return (const char *)pool->data + table[j] * bs * D * esize;
    }
    *rs = pool->scale + table[j] * bs;
    codes_to_bf16((const char *)pool->data + (table[j] * bs + *r0) * D, pool->codes, (*r1 - *r0) * D,
                  pool->conv + *r0 * D);
    return pool->conv;
}

// Each query head's scores (G rows of span) -> exp(score - its max), in place; their sums in sum.
static inline void exp_scores(float *sc, int64_t span, int64_t G, const float *mx, float *sum) {
    for (int64_t g = 0; g < G; g++) {
        float *sg = sc + g * span, m = mx[g], t = 0.f;
        for (int64_t i = 0; i < span; i++) { sg[i] = expf(sg[i] - m); t += sg[i]; }
        sum[g] = t;
    }
}

// One sequence and KV head: its G query heads attend over positions lo..hi-1. `table` maps a block
// index (counted from position `first`) to a pool block. `buf`: scratch for 2*G*D + D + G*(hi-lo) floats.
static inline __attribute__((always_inline)) void attend(
        const uint16_t *q, const pool_t *k, const pool_t *v, const int64_t *table, int64_t lo, int64_t hi,
        int64_t first, int64_t G, const int64_t D, int64_t bs, float scale, uint16_t *out, float *buf) {
    float *qf = buf, *acc = qf + G * D, *row = acc + G * D, *sc = row + D;
    const int64_t span = hi - lo;
    float mx[64], sum[64];
    for (int64_t i = 0; i < G * D; i++) { qf[i] = bf16_to_f(q[i]) * scale; acc[i] = 0.f; }
    for (int64_t g = 0; g < G; g++) { mx[g] = -3.0e38f; sum[g] = 0.f; }
    for (int64_t p = lo, r0, r1; p < hi;) {  // block by block: one division per block, not per position
        const float *rs;
        const uint16_t *blk = (const uint16_t *)block_run(k, table, p, hi, first, bs, D, &r0, &r1, &rs);
        for (int64_t r = r0; r < r1; r++, p++) {
            const uint16_t *kr = blk + r * D;
            for (int64_t d = 0; d < D; d++) row[d] = bf16_to_f(kr[d]);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qg[d] * row[d];
                if (rs) s *= rs[r];
                sc[g * span + p - lo] = s;
                if (s > mx[g]) mx[g] = s;
            }
        }
    }
    exp_scores(sc, span, G, mx, sum);
    for (int64_t p = lo, r0, r1; p < hi;) {
        const float *rs;
        const uint16_t *blk = (const uint16_t *)block_run(v, table, p, hi, first, bs, D, &r0, &r1, &rs);
        for (int64_t r = r0; r < r1; r++, p++) {
            const uint16_t *vr = blk + r * D;
            for (int64_t d = 0; d < D; d++) row[d] = bf16_to_f(vr[d]);
            for (int64_t g = 0; g < G; g++) {
                const float w = rs ? sc[g * span + p - lo] * rs[r] : sc[g * span + p - lo];
                float *ag = acc + g * D;
                for (int64_t d = 0; d < D; d++) ag[d] += w * row[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
        for (int64_t d = 0; d < D; d++) out[g * D + d] = f_to_bf16(acc[g * D + d] * inv);
    }
}

#if defined(__AVX512F__)
// lane j = the sum of v[j]'s lanes: four rounds that halve all 16 vectors' lanes together (45
// instructions; 16 separate reductions take ~160). Each round pairs vectors, so the input is taken
// in the 4 x 4 transposed order that puts vector j's sum in lane j.
static inline __m512 hsum16(const __m512 *v) {
    __m512 s[8], u[4], z[2];
    for (int j = 0; j < 8; j++) {
        const __m512 x = v[4 * ((2 * j) % 4) + (2 * j) / 4], y = v[4 * ((2 * j + 1) % 4) + (2 * j + 1) / 4];
        s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int k = 0; k < 4; k++)
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++)
        z[k] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * k], u[2 * k + 1]), _mm512_unpackhi_ps(u[2 * k], u[2 * k + 1]));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))));
}

// p.v for the vectorized paths (D a multiple of 16, at most 256): out[g] = sum over positions of sc[g] * V row /
// sum[g], the output of up to 16 / (D / 16) query heads kept in registers over the whole context. V rows are
// bf16 as block_run returns them (times their row scales where quantized) and out bf16, or, with `f32`, both
// float32. Inlined with constant D and f32.
static inline __attribute__((always_inline)) void weighted_v(const pool_t *v, const int64_t *table, int64_t lo,
                                                             int64_t hi, int64_t first, int64_t G, const int64_t D,
                                                             int64_t bs, const float *sc, const float *sum,
                                                             const int f32, void *out) {
    enum { ACC = 16 };  // output registers per pass over V
    const int64_t DF = D / 16, GB = ACC / DF, span = hi - lo;
    for (int64_t g0 = 0; g0 < G; g0 += GB) {  // weighted sum of V, GB query heads per pass
        __m512 acc[ACC];
        for (int64_t i = 0; i < ACC; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t p = lo, r0, r1; p < hi;) {
            const float *rs;
            const void *blk = block_run(v, table, p, hi, first, bs, D, &r0, &r1, &rs);
            for (int64_t r = r0; r < r1; r++, p++) {
                __m512 row[16];
                for (int64_t t = 0; t < DF; t++)
                    row[t] = f32 ? _mm512_loadu_ps((const float *)blk + r * D + 16 * t)
                                 : bf16x16_to_f32((const uint16_t *)blk + r * D + 16 * t);
                const float vs = rs ? rs[r] : 1.f;
                for (int64_t gi = 0; gi < GB; gi++) {
                    const __m512 w = _mm512_set1_ps(g0 + gi < G ? sc[(g0 + gi) * span + p - lo] * vs : 0.f);
                    for (int64_t t = 0; t < DF; t++) acc[gi * DF + t] = _mm512_fmadd_ps(w, row[t], acc[gi * DF + t]);
                }
            }
        }
        for (int64_t gi = 0; gi < GB && g0 + gi < G; gi++) {
            const __m512 inv = _mm512_set1_ps(sum[g0 + gi] > 0.f ? 1.f / sum[g0 + gi] : 0.f);
            for (int64_t t = 0; t < DF; t++) {
                const __m512 o = _mm512_mul_ps(acc[gi * DF + t], inv);
                const int64_t at = (g0 + gi) * D + 16 * t;
                if (f32) {
                    _mm512_storeu_ps((float *)out + at, o);
                } else {
                    float tmp[16];
                    _mm512_storeu_ps(tmp, o);
                    for (int64_t i = 0; i < 16; i++) ((uint16_t *)out)[at + i] = f_to_bf16(tmp[i]);
                }
            }
        }
    }
}

#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_ATTEND
#include <immintrin.h>
// The same attention on AVX2 (CPUs without AVX512-BF16), for head sizes that are multiples of 64. The portable
// loop sums each q.k product with a horizontal reduction and keeps each head's output in memory, a load and a
// store per 8 values and position; here:
// - q.k: 8 positions at a time, bf16 K rows widened in registers, their 8 reductions done together (hsum8);
// - p.v: 64 output values of one query head in 8 registers over the whole context, one pass per head and 64.
// 1.23-1.46x the portable loop per call on the Zen 3 VM (8 sequences, 300-800 positions, SmolLM2's and Llama-3's
// head layouts; docs/BENCHMARKS.md, "An AVX2 GEMM for prefill, and SDPA for prefill attention").
static inline __m256 hsum8(const __m256 *v) {  // lane j = the sum of v[j]'s lanes
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline __attribute__((always_inline)) void attend_avx2(
        const uint16_t *q, const pool_t *k, const pool_t *v, const int64_t *table, int64_t lo, int64_t hi,
        int64_t first, int64_t G, const int64_t D, int64_t bs, float scale, uint16_t *out, float *buf) {
    const int64_t DV = D / 8, span = hi - lo;
    float *qf = buf, *sc = qf + G * D, sum[64], mx[64];
    for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_to_f(q[i]);
    for (int64_t g = 0; g < G; g++) mx[g] = -3.0e38f;
    for (int64_t p = lo, r0, r1; p < hi;) {  // scores, 8 positions of a block at a time
        const float *rs;
        const uint16_t *blk = (const uint16_t *)block_run(k, table, p, hi, first, bs, D, &r0, &r1, &rs);
        for (int64_t r = r0; r < r1; r += 8) {
            const int64_t n = r1 - r < 8 ? r1 - r : 8;
            for (int64_t g = 0; g < G; g++) {
                __m256 dots[8];
                for (int64_t j = 0; j < 8; j++) {
                    __m256 a = _mm256_setzero_ps();
                    if (j < n)
                        for (int64_t t = 0; t < DV; t++)
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + 8 * t),
                                                bf16x8_to_ps(blk + (r + j) * D + 8 * t), a);
                    dots[j] = a;
                }
                float s8[8];
                _mm256_storeu_ps(s8, _mm256_mul_ps(hsum8(dots), _mm256_set1_ps(scale)));
                float *dst = sc + g * span + p - lo, m = mx[g];
                for (int64_t j = 0; j < n; j++) {
                    const float s = rs ? s8[j] * rs[r + j] : s8[j];
                    dst[j] = s;
                    m = s > m ? s : m;
                }
                mx[g] = m;
            }
            p += n;
        }
    }
    exp_scores(sc, span, G, mx, sum);
    for (int64_t g = 0; g < G; g++)  // weighted sum of V: 64 values of one head per pass
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t p = lo, r0, r1; p < hi;) {
                const float *rs;
                const uint16_t *blk = (const uint16_t *)block_run(v, table, p, hi, first, bs, D, &r0, &r1, &rs);
                for (int64_t r = r0; r < r1; r++, p++) {
                    const float w = rs ? sc[g * span + p - lo] * rs[r] : sc[g * span + p - lo];
                    const __m256 wv = _mm256_set1_ps(w);
                    for (int t = 0; t < 8; t++)
                        acc[t] = _mm256_fmadd_ps(wv, bf16x8_to_ps(blk + r * D + d0 + 8 * t), acc[t]);
                }
            }
            const __m256 inv = _mm256_set1_ps(sum[g] > 0.f ? 1.f / sum[g] : 0.f);
            for (int t = 0; t < 8; t++) {
                float tmp[8];
                _mm256_storeu_ps(tmp, _mm256_mul_ps(acc[t], inv));
                for (int i = 0; i < 8; i++) out[g * D + d0 + 8 * t + i] = f_to_bf16(tmp[i]);
            }
        }
}
#endif

#if defined(__AVX512BF16__)
// The same attention with AVX512-BF16, for head sizes that are multiples of 32 (DV = D / 32 vectors of
// 32 bf16 per row). The scalar loop above sums each q.k product with a horizontal reduction and keeps
// its output in memory (a store-to-load chain per position): ~170 cycles per position and KV head. Here:
// - q.k: vdpbf16ps on the bf16 values as stored (products exact, sums in float32), 16 positions at a
//   time, their 16 reductions done together (hsum16);
// - p.v: the output of up to 16 / (D / 16) query heads kept in registers over the whole context (weighted_v).
static inline __attribute__((always_inline)) void attend_vec(
        const uint16_t *q, const pool_t *k, const pool_t *v, const int64_t *table, int64_t lo, int64_t hi,
        int64_t first, int64_t G, const int64_t D, int64_t bs, float scale, uint16_t *out, float *buf) {
    enum { MAXDV = 8 };  // D <= 256
    const int64_t DV = D / 32;
    const int64_t span = hi - lo;
    float *sc = buf, sum[64];
    __m512 vmx[64];
    for (int64_t g = 0; g < G; g++) vmx[g] = _mm512_set1_ps(-3.0e38f);
    for (int64_t p = lo, r0, r1; p < hi;) {  // scores, 16 positions of a block at a time
        const float *rs;
        const uint16_t *blk = (const uint16_t *)block_run(k, table, p, hi, first, bs, D, &r0, &r1, &rs);
        for (int64_t r = r0; r < r1; r += 16) {
            const int64_t n = r1 - r < 16 ? r1 - r : 16;
            const __mmask16 live = (__mmask16)((1u << n) - 1);
            for (int64_t g = 0; g < G; g++) {
                __m512bh qg[MAXDV];
                for (int64_t t = 0; t < DV; t++) qg[t] = (__m512bh)_mm512_loadu_si512((const void *)(q + g * D + 32 * t));
                __m512 dots[16];
                for (int64_t j = 0; j < 16; j++) {
                    __m512 a = _mm512_setzero_ps();
                    if (j < n)
                        for (int64_t t = 0; t < DV; t++)
                            a = _mm512_dpbf16_ps(a, qg[t], (__m512bh)_mm512_loadu_si512((const void *)(blk + (r + j) * D + 32 * t)));
                    dots[j] = a;
                }
                __m512 s16 = _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale));
                if (rs) s16 = _mm512_mul_ps(s16, _mm512_maskz_loadu_ps(live, rs + r));
                _mm512_mask_storeu_ps(sc + g * span + p - lo, live, s16);
                vmx[g] = _mm512_mask_max_ps(vmx[g], live, vmx[g], s16);
            }
            p += n;
        }
    }
    float mx[64];
    for (int64_t g = 0; g < G; g++) mx[g] = _mm512_reduce_max_ps(vmx[g]);
    exp_scores(sc, span, G, mx, sum);
    weighted_v(v, table, lo, hi, first, G, D, bs, sc, sum, 0, out);
}
#endif

// float32 decode (an fp32 engine; paged_decode with CODES_F32): one sequence and KV head over float32 pools
// [S, D], q and out float32; `sc`: scratch for G * (hi - lo) floats. Products and sums in float32 with FMAs;
// for head sizes that are multiples of 16 with AVX-512, 16 positions' q.k at a time (hsum16) and the output
// of up to 16 / (D / 16) query heads in registers over the context; else portably. Reads the blocks where
// they lie: the gather into a padded copy and SDPA's pass over it were ~30% of an fp32 mixed workload
// (docs/BENCHMARKS.md, "fp32 decodes on the kernel").
static void attend_f32(const float *q, const pool_t *k, const pool_t *v, const int64_t *table, int64_t lo,
                       int64_t hi, int64_t first, int64_t G, int64_t D, int64_t bs, float scale, float *out,
                       float *sc) {
    const int64_t span = hi - lo;
    float mx[64], sum[64];
    for (int64_t g = 0; g < G; g++) mx[g] = -3.0e38f;
#if defined(__AVX512F__)
    const int vec = D % 16 == 0 && D <= 256;
#else
    const int vec = 0;
#endif
    for (int64_t p = lo, r0, r1; p < hi;) {  // scores, a block at a time
        const float *rs;
        const float *blk = (const float *)block_run(k, table, p, hi, first, bs, D, &r0, &r1, &rs);
#if defined(__AVX512F__)
        if (vec) {
            const int64_t DF = D / 16;
            for (int64_t r = r0; r < r1; r += 16) {
                const int64_t n = r1 - r < 16 ? r1 - r : 16;
                const __mmask16 live = (__mmask16)((1u << n) - 1);
                for (int64_t g = 0; g < G; g++) {
                    __m512 qg[16], dots[16];
                    for (int64_t t = 0; t < DF; t++) qg[t] = _mm512_loadu_ps(q + g * D + 16 * t);
                    for (int64_t jj = 0; jj < 16; jj++) {
                        __m512 a = _mm512_setzero_ps();
                        if (jj < n)
                            for (int64_t t = 0; t < DF; t++)
                                a = _mm512_fmadd_ps(qg[t], _mm512_loadu_ps(blk + (r + jj) * D + 16 * t), a);
                        dots[jj] = a;
                    }
                    const __m512 s16 = _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale));
                    _mm512_mask_storeu_ps(sc + g * span + p + (r - r0) - lo, live, s16);
                    const float m = _mm512_mask_reduce_max_ps(live, s16);
                    if (m > mx[g]) mx[g] = m;
                }
            }
            p += r1 - r0;
            continue;
        }
#endif
        for (int64_t r = r0; r < r1; r++, p++)
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + g * D, *kr = blk + r * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qg[d] * kr[d];
                s *= scale;
                sc[g * span + p - lo] = s;
                if (s > mx[g]) mx[g] = s;
            }
    }
    exp_scores(sc, span, G, mx, sum);
#if defined(__AVX512F__)
    if (vec) {
        weighted_v(v, table, lo, hi, first, G, D, bs, sc, sum, 1, out);
        return;
    }
#endif
    for (int64_t i = 0; i < G * D; i++) out[i] = 0.f;
    for (int64_t p = lo, r0, r1; p < hi;) {
        const float *rs;
        const float *blk = (const float *)block_run(v, table, p, hi, first, bs, D, &r0, &r1, &rs);
        for (int64_t r = r0; r < r1; r++, p++)
            for (int64_t g = 0; g < G; g++) {
                const float w = sc[g * span + p - lo], *vr = blk + r * D;
                for (int64_t d = 0; d < D; d++) out[g * D + d] += w * vr[d];
            }
    }
    for (int64_t g = 0; g < G; g++) {
        const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;
        for (int64_t d = 0; d < D; d++) out[g * D + d] *= inv;
    }
}

typedef void (*attend_fn)(const uint16_t *, const pool_t *, const pool_t *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, uint16_t *, float *);
#if defined(__AVX512BF16__)
#define ATTEND_IMPL attend_vec
#elif defined(HAVE_AVX2_ATTEND)
#define ATTEND_IMPL attend_avx2
#else
#define ATTEND_IMPL attend
#endif
#define ATTEND_FIXED(DD)                                                                                        \
    static void attend_##DD(const uint16_t *q, const pool_t *k, const pool_t *v, const int64_t *t, int64_t lo,   \
                            int64_t hi, int64_t first, int64_t G, int64_t D, int64_t bs, float scale,            \
                            uint16_t *out, float *buf) {                                                         \
        (void)D;                                                                                                \
        ATTEND_IMPL(q, k, v, t, lo, hi, first, G, DD, bs, scale, out, buf);                                     \
    }
ATTEND_FIXED(64)
ATTEND_FIXED(128)
ATTEND_FIXED(256)
static void attend_any(const uint16_t *q, const pool_t *k, const pool_t *v, const int64_t *t, int64_t lo,
                       int64_t hi, int64_t first, int64_t G, int64_t D, int64_t bs, float scale, uint16_t *out,
                       float *buf) {
    attend(q, k, v, t, lo, hi, first, G, D, bs, scale, out, buf);
}

// q, out: [B, H, D] bf16; k, v: [Hkv, S, D] (one layer's pool): bf16 (codes 0), or int8 (1) / fp8 e4m3 (2)
// codes with k_scale, v_scale [Hkv, S] float32; or q, out and k, v all float32 (codes 3); tables: [B, n] pool blocks, the first holding positions
// from start_block * bs; lens: [B] context lengths; window > 0: attend to the last `window` positions only.
// Returns 0, or 1 when a shape is unsupported or scratch could not be allocated.
int paged_decode(const void *q, const void *k, const void *v, const float *k_scale, const float *v_scale,
                 int codes, const int64_t *tables, int64_t n, const int64_t *lens, int64_t B, int64_t H, int64_t Hkv,
                 int64_t D, int64_t S, int64_t bs, int64_t start_block, int64_t window, float scale, void *out,
                 int nthreads) {
    if (Hkv <= 0 || H % Hkv || H / Hkv > 64 || codes < 0 || codes > 3) return 1;
    const int quantized = codes == CODES_INT8 || codes == CODES_FP8;
    if (quantized && (!k_scale || !v_scale)) return 1;
    const int64_t G = H / Hkv, esize = pool_esize(codes);
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    attend_fn fn = D == 64 ? attend_64 : D == 128 ? attend_128 : D == 256 ? attend_256 : attend_any;
    const int64_t nfloat = 2 * G * D + D + G * (max_len + 1), nconv = quantized ? bs * D : 0;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = malloc(sizeof(float) * nfloat + 2 * nconv + 64);
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < Hkv; h++) {
                if (!buf) continue;
                const int64_t first = start_block * bs, hi = lens[b];
                const int64_t lo = window > 0 && hi - window > first ? hi - window : first;
                const int64_t at = (b * H + h * G) * D;
                uint16_t *conv = (uint16_t *)(buf + nfloat);
                const pool_t kp = {(const char *)k + h * S * D * esize, k_scale ? k_scale + h * S : NULL, codes, conv};
                const pool_t vp = {(const char *)v + h * S * D * esize, v_scale ? v_scale + h * S : NULL, codes, conv};
                if (codes == CODES_F32)
                    attend_f32((const float *)q + at, &kp, &vp, tables + b * n, lo, hi, first, G, D, bs, scale,
                               (float *)out + at, buf);
                else
                    fn((const uint16_t *)q + at, &kp, &vp, tables + b * n, lo, hi, first, G, D, bs, scale,
                       (uint16_t *)out + at, buf);
            }
        free(buf);
    }
    return failed;
}

// Writing quantized K/V rows: the same codes and scales as paged_kv_cache.py's torch path (kv_codes.encode),
// bit for bit (tests/layers compare them), so a decode step may write its K/V here or there. Division and
// rounding must be IEEE's own here, not -ffast-math's reciprocals.
#if defined(__clang__)
#pragma float_control(precise, on, push)
#else
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
#endif

static uint8_t f_to_fp8(float y) {  // e4m3fn of a finite |y| <= 448, rounded to nearest even (as c10 rounds)
    uint32_t u;
    memcpy(&u, &y, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    float a;
    memcpy(&a, &u, 4);
    if (a < 0x1p-6f) return sign | (uint8_t)rintf(a * 0x1p9f);  // subnormal (8: the smallest normal's code)
    u += 0x7FFFFu + ((u >> 20) & 1u);
    return sign | (uint8_t)((u >> 20) - (120u << 3));
}

// x: T rows (`stride` apart) of Hkv heads of D bf16 values -> codes in `pool` [Hkv, S, D] and scales in
// `scales` [Hkv, S] at each row's slot. Scale: static_scale[h] (calibrated, per head) when given, else the
// row's absmax / 127 (int8) or / 448 (fp8). Returns 0, or 1 for codes it does not know.
int paged_kv_quantize(const uint16_t *x, int64_t stride, int64_t T, int64_t Hkv, int64_t D, const int64_t *slots,
                      int codes, const float *static_scale, void *pool, float *scales, int64_t S) {
    if (codes != CODES_INT8 && codes != CODES_FP8) return 1;
    const float largest = codes == CODES_INT8 ? 127.f : 448.f;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hkv; h++) {
            const uint16_t *xr = x + t * stride + h * D;
            const int64_t at = h * S + slots[t];
            float s;
            if (static_scale) {
                s = static_scale[h];
            } else {
                float m = 0.f;
                for (int64_t d = 0; d < D; d++) m = fmaxf(m, fabsf(bf16_to_f(xr[d])));
                s = fmaxf(m, 1e-8f) / largest;
            }
            scales[at] = s;
            if (codes == CODES_INT8) {
                int8_t *dst = (int8_t *)pool + at * D;
                for (int64_t d = 0; d < D; d++) {
                    const float r = rintf(bf16_to_f(xr[d]) / s);
                    dst[d] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
                }
            } else {
                uint8_t *dst = (uint8_t *)pool + at * D;
                for (int64_t d = 0; d < D; d++) {
                    const float y = bf16_to_f(xr[d]) / s;
                    dst[d] = f_to_fp8(y > 448.f ? 448.f : y < -448.f ? -448.f : y);
                }
            }
        }
    return 0;
}

#if defined(__clang__)
#pragma float_control(pop)
#else
#pragma GCC pop_options
#endif
