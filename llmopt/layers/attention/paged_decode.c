// bf16 decode attention read straight from the head-major paged KV pool (paged_kv_cache.py's layout):
// no gather of the context into a copy, one pass over K and one over V, softmax in float32.
// Built and loaded by paged_decode_kernel.py; head_major.py calls it for bf16 decode groups on a CPU.
// Compiled with -ffast-math (vectorized expf and reductions) but linked without it, so loading it does
// not switch the process's floating point into flush-to-zero mode.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_bf16.h"

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

typedef void (*attend_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, uint16_t *, float *);
#define ATTEND_FIXED(DD)                                                                                        \
    static void attend_##DD(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *t, int64_t lo, \
                            int64_t hi, int64_t first, int64_t G, int64_t D, int64_t bs, float scale,            \
                            uint16_t *out, float *buf) {                                                         \
        (void)D;                                                                                                \
        attend(q, k, v, t, lo, hi, first, G, DD, bs, scale, out, buf);                                          \
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
