// bf16 decode attention read straight from the head-major paged KV pool (paged_kv_cache.py's layout):
// no gather of the context into a copy, one pass over K and one over V, softmax in float32. Head sizes
// 64, 128 and 256 run vectorized with AVX512-BF16 where the CPU has it (attend_vec), others portably.
// Built and loaded by paged_decode_kernel.py; head_major.py calls it for bf16 decode groups on a CPU.
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

static inline void prefetch(const uint16_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) __builtin_prefetch(p + i, 0, 3);
}

// The block holding position p (blocks counted from position `first`): its rows, and in *r0..*r1 the rows
// of it that positions p..hi-1 use. Prefetches the next block of the run.
static inline const uint16_t *block_run(const uint16_t *pool, const int64_t *table, int64_t p, int64_t hi,
                                        int64_t first, int64_t bs, int64_t D, int64_t *r0, int64_t *r1) {
    const int64_t j = (p - first) / bs;
    *r0 = p - first - j * bs;
    *r1 = *r0 + hi - p < bs ? *r0 + hi - p : bs;
    if (p + *r1 - *r0 < hi) prefetch(pool + table[j + 1] * bs * D, bs * D);
    return pool + table[j] * bs * D;
}

// One sequence and KV head: its G query heads attend over positions lo..hi-1. `table` maps a block
// index (counted from position `first`) to a pool block. `buf`: scratch for 2*G*D + D + G*(hi-lo) floats.
static inline __attribute__((always_inline)) void attend(
        const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table, int64_t lo, int64_t hi,
        int64_t first, int64_t G, const int64_t D, int64_t bs, float scale, uint16_t *out, float *buf) {
    float *qf = buf, *acc = qf + G * D, *row = acc + G * D, *sc = row + D;
    const int64_t span = hi - lo;
    float mx[64], sum[64];
    for (int64_t i = 0; i < G * D; i++) { qf[i] = bf16_to_f(q[i]) * scale; acc[i] = 0.f; }
    for (int64_t g = 0; g < G; g++) { mx[g] = -3.0e38f; sum[g] = 0.f; }
    for (int64_t p = lo, r0, r1; p < hi;) {  // block by block: one division per block, not per position
        const uint16_t *blk = block_run(k, table, p, hi, first, bs, D, &r0, &r1);
        for (int64_t r = r0; r < r1; r++, p++) {
            const uint16_t *kr = blk + r * D;
            for (int64_t d = 0; d < D; d++) row[d] = bf16_to_f(kr[d]);
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qf + g * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qg[d] * row[d];
                sc[g * span + p - lo] = s;
                if (s > mx[g]) mx[g] = s;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = sc + g * span, m = mx[g], t = 0.f;
        for (int64_t i = 0; i < span; i++) { sg[i] = expf(sg[i] - m); t += sg[i]; }
        sum[g] = t;
    }
    for (int64_t p = lo, r0, r1; p < hi;) {
        const uint16_t *blk = block_run(v, table, p, hi, first, bs, D, &r0, &r1);
        for (int64_t r = r0; r < r1; r++, p++) {
            const uint16_t *vr = blk + r * D;
            for (int64_t d = 0; d < D; d++) row[d] = bf16_to_f(vr[d]);
            for (int64_t g = 0; g < G; g++) {
                const float w = sc[g * span + p - lo];
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

#if defined(__AVX512BF16__)
// The same attention with AVX512-BF16, for head sizes that are multiples of 32 (DV = D / 32 vectors of
// 32 bf16 per row). The scalar loop above sums each q.k product with a horizontal reduction and keeps
// its output in memory (a store-to-load chain per position): ~170 cycles per position and KV head. Here:
// - q.k: vdpbf16ps on the bf16 values as stored (products exact, sums in float32), 16 positions at a
//   time, their 16 reductions done together (hsum16);
// - p.v: the output of up to 16 / (D / 16) query heads kept in registers over the whole context.

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

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __attribute__((always_inline)) void attend_vec(
        const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table, int64_t lo, int64_t hi,
        int64_t first, int64_t G, const int64_t D, int64_t bs, float scale, uint16_t *out, float *buf) {
    enum { MAXDV = 8, ACC = 16 };  // D <= 256; output registers per pass over V
    const int64_t DV = D / 32, DF = D / 16, GB = ACC / DF;  // D <= 256: at least one head per pass
    const int64_t span = hi - lo;
    float *sc = buf, sum[64];
    __m512 vmx[64];
    for (int64_t g = 0; g < G; g++) vmx[g] = _mm512_set1_ps(-3.0e38f);
    for (int64_t p = lo, r0, r1; p < hi;) {  // scores, 16 positions of a block at a time
        const uint16_t *blk = block_run(k, table, p, hi, first, bs, D, &r0, &r1);
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
                const __m512 s16 = _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(sc + g * span + p - lo, live, s16);
                vmx[g] = _mm512_mask_max_ps(vmx[g], live, vmx[g], s16);
            }
            p += n;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = sc + g * span, m = _mm512_reduce_max_ps(vmx[g]), t = 0.f;
        for (int64_t i = 0; i < span; i++) { sg[i] = expf(sg[i] - m); t += sg[i]; }
        sum[g] = t;
    }
    for (int64_t g0 = 0; g0 < G; g0 += GB) {  // weighted sum of V, GB query heads per pass
        __m512 acc[ACC];
        for (int64_t i = 0; i < ACC; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t p = lo, r0, r1; p < hi;) {
            const uint16_t *blk = block_run(v, table, p, hi, first, bs, D, &r0, &r1);
            for (int64_t r = r0; r < r1; r++, p++) {
                __m512 row[16];
                for (int64_t t = 0; t < DF; t++) row[t] = bf16x16_to_f32(blk + r * D + 16 * t);
                for (int64_t gi = 0; gi < GB; gi++) {
                    const __m512 w = _mm512_set1_ps(g0 + gi < G ? sc[(g0 + gi) * span + p - lo] : 0.f);
                    for (int64_t t = 0; t < DF; t++) acc[gi * DF + t] = _mm512_fmadd_ps(w, row[t], acc[gi * DF + t]);
                }
            }
        }
        for (int64_t gi = 0; gi < GB && g0 + gi < G; gi++) {
            const __m512 inv = _mm512_set1_ps(sum[g0 + gi] > 0.f ? 1.f / sum[g0 + gi] : 0.f);
            for (int64_t t = 0; t < DF; t++) {
                const __m512 o = _mm512_mul_ps(acc[gi * DF + t], inv);
                float tmp[16];
                _mm512_storeu_ps(tmp, o);
                for (int64_t i = 0; i < 16; i++) out[(g0 + gi) * D + 16 * t + i] = f_to_bf16(tmp[i]);
            }
        }
    }
}
#endif

typedef void (*attend_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, uint16_t *, float *);
#if defined(__AVX512BF16__)
#define ATTEND_IMPL attend_vec
#else
#define ATTEND_IMPL attend
#endif
#define ATTEND_FIXED(DD)                                                                                        \
    static void attend_##DD(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *t, int64_t lo, \
                            int64_t hi, int64_t first, int64_t G, int64_t D, int64_t bs, float scale,            \
                            uint16_t *out, float *buf) {                                                         \
        (void)D;                                                                                                \
        ATTEND_IMPL(q, k, v, t, lo, hi, first, G, DD, bs, scale, out, buf);                                     \
    }
ATTEND_FIXED(64)
ATTEND_FIXED(128)
ATTEND_FIXED(256)
static void attend_any(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *t, int64_t lo,
                       int64_t hi, int64_t first, int64_t G, int64_t D, int64_t bs, float scale, uint16_t *out,
                       float *buf) {
    attend(q, k, v, t, lo, hi, first, G, D, bs, scale, out, buf);
}

// q, out: [B, H, D] bf16; k, v: [Hkv, S, D] bf16 (one layer's pool); tables: [B, n] pool blocks, the first
// holding positions from start_block * bs; lens: [B] context lengths; window > 0: attend to the last
// `window` positions only. Returns 0, or 1 when a shape is unsupported or scratch could not be allocated.
int paged_decode_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *tables, int64_t n,
                      const int64_t *lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S, int64_t bs,
                      int64_t start_block, int64_t window, float scale, uint16_t *out, int nthreads) {
    if (Hkv <= 0 || H % Hkv || H / Hkv > 64) return 1;
    const int64_t G = H / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    attend_fn fn = D == 64 ? attend_64 : D == 128 ? attend_128 : D == 256 ? attend_256 : attend_any;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = malloc(sizeof(float) * (2 * G * D + D + G * (max_len + 1)));
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
                fn(q + (b * H + h * G) * D, k + h * S * D, v + h * S * D, tables + b * n, lo, hi, first, G, D, bs,
                   scale, out + (b * H + h * G) * D, buf);
            }
        free(buf);
    }
    return failed;
}
