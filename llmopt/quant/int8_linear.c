// int8 weight-only matmul at decode sizes: y[M, N] = (x[M, K] @ w[N, K]^T) * scale[N], x/scale/y in bf16 or
// float32, w int8 row-major (Int8WeightOnlyLinear's own buffer, no repacking). Products are summed in
// float32 and rounded once, as torch's _weight_int8pack_mm does. Each thread takes blocks of R weight rows
// and reads each row once for all M activation rows, so the weights stream from memory once per call.
// int8_dequant writes the weight (q * scale) that batches past the decode sizes multiply by. Built and
// loaded by int8_kernel.py. Compiled with -ffast-math (vectorized reductions in the portable path) but
// linked without it, so loading it does not switch the process into flush-to-zero mode.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_bf16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define R 4   // weight rows per block
#define MB 4  // activation rows per pass over a block (R * MB float32 accumulators)
#define PF_BLOCKS 2  // prefetch the weight rows this many blocks ahead (DRAM latency x read speed ~ 2-4 KiB)

static inline void prefetch_line(const int8_t *p) { if (p) __builtin_prefetch(p, 0, 0); }

// acc[m][r] = dot(row m of x, row r of ws) for m < mb (mb <= MB), r < R; rows are K long. x rows are
// float32 (xf) and, when the input was bf16, also bf16 (xb): with AVX512-BF16 those run on vdpbf16ps,
// 32 products per instruction after one int8 -> bf16 conversion per 32 weights (exact: |w| <= 128), so
// the conversion is shared by the mb rows. `pf`: the block PF_BLOCKS ahead, prefetched as this one is
// read (NULL: none). Inlined with a constant mb (see block_dots) so the accumulators stay in registers.
static inline __attribute__((always_inline)) void block_dots_mb(const float *xf, const uint16_t *xb, const int mb,
                                                                const int8_t *ws, const int8_t *pf, int64_t K,
                                                                float acc[MB][R]) {
    int64_t k = 0;
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = 0.f;
#if defined(__AVX512BF16__)
    if (xb) {
        __m512 a[MB][R];
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) a[m][r] = _mm512_setzero_ps();
        for (; k + 32 <= K; k += 32) {
            prefetch_line(pf ? pf + k * R : NULL);
            prefetch_line(pf ? pf + k * R + 64 : NULL);
            __m512bh wv[R];
            for (int r = 0; r < R; r++) wv[r] = int8x32_to_bf16(ws + r * K + k);  // weights k..k+31 in order
            for (int m = 0; m < mb; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * K + k));
                for (int r = 0; r < R; r++) a[m][r] = _mm512_dpbf16_ps(a[m][r], xv, wv[r]);
            }
        }
        for (int m = 0; m < mb; m++)
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_reduce_add_ps(a[m][r]);
    } else
#endif
    {
#if defined(__AVX512F__)
        __m512 a[MB][R];
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) a[m][r] = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            prefetch_line(pf ? pf + k * R : NULL);
            __m512 wv[R];
            for (int r = 0; r < R; r++)
                wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ws + r * K + k))));
            for (int m = 0; m < mb; m++) {
                const __m512 xv = _mm512_loadu_ps(xf + m * K + k);
                for (int r = 0; r < R; r++) a[m][r] = _mm512_fmadd_ps(xv, wv[r], a[m][r]);
            }
        }
        for (int m = 0; m < mb; m++)
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_reduce_add_ps(a[m][r]);
#endif
    }
    (void)pf;
    for (int m = 0; m < mb; m++) {  // the tail (everything, without AVX-512)
        const float *xr = xf + m * K;
        for (int r = 0; r < R; r++) {
            const int8_t *wr = ws + r * K;
            float s = 0.f;
            for (int64_t j = k; j < K; j++) s += xr[j] * (float)wr[j];
            acc[m][r] += s;
        }
    }
}

static void block_dots(const float *xf, const uint16_t *xb, int64_t mb, const int8_t *ws, const int8_t *pf, int64_t K,
                       float acc[MB][R]) {
    switch (mb) {
        case 1: block_dots_mb(xf, xb, 1, ws, pf, K, acc); break;
        case 2: block_dots_mb(xf, xb, 2, ws, pf, K, acc); break;
        case 3: block_dots_mb(xf, xb, 3, ws, pf, K, acc); break;
        default: block_dots_mb(xf, xb, 4, ws, pf, K, acc); break;
    }
}

// Returns 0, or 1 when there is no memory for its scratch (a float32 copy of bf16 x, the padded last block).
int int8_linear(const void *x, int64_t M, int64_t K, const int8_t *w, const void *scale, int64_t N, void *y,
                int bf16, int nthreads) {
    const int64_t copy = bf16 ? M * K : 0;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(copy + R * K / 4 + 1));
    if (!buf) return 1;
    const float *xf = bf16 ? buf : (const float *)x;
    const uint16_t *xb = bf16 ? (const uint16_t *)x : NULL;
    for (int64_t i = 0; i < copy; i++) buf[i] = bf16_to_f(xb[i]);
    const int64_t nblocks = (N + R - 1) / R, full = N / R;
    int8_t *tail = (int8_t *)(buf + copy);  // the last block's rows, zero-padded to R (when N % R != 0)
    if (N % R) {
        memset(tail, 0, (size_t)(R * K));
        memcpy(tail, w + full * R * K, (size_t)((N % R) * K));
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * R, nr = N - n0 < R ? N - n0 : R;
        const int8_t *ws = b < full ? w + n0 * K : tail;
        const int8_t *pf = b + PF_BLOCKS < full ? ws + PF_BLOCKS * R * K : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mb = M - m0 < MB ? M - m0 : MB;
            float acc[MB][R];
            block_dots(xf + m0 * K, xb ? xb + m0 * K : NULL, mb, ws, m0 == 0 ? pf : NULL, K, acc);
            for (int64_t m = 0; m < mb; m++)
                for (int64_t r = 0; r < nr; r++) {
                    const int64_t n = n0 + r, o = (m0 + m) * N + n;
                    if (bf16) ((uint16_t *)y)[o] = f_to_bf16(acc[m][r] * bf16_to_f(((const uint16_t *)scale)[n]));
                    else ((float *)y)[o] = acc[m][r] * ((const float *)scale)[n];
                }
        }
    }
    free(buf);
    return 0;
}

// w[N, K] = q * scale[n], in x's dtype (bf16 != 0: bf16, rounded once; else float32): what batches past the
// decode sizes multiply by, written at memory speed (torch's int8 * bf16 runs at a fraction of it).
void int8_dequant(const int8_t *q, const void *scale, int64_t N, int64_t K, void *w, int bf16, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qr = q + n * K;
        if (bf16) {
            const float s = bf16_to_f(((const uint16_t *)scale)[n]);
            uint16_t *o = (uint16_t *)w + n * K;
            for (int64_t k = 0; k < K; k++) o[k] = f_to_bf16((float)qr[k] * s);
        } else {
            const float s = ((const float *)scale)[n];
            float *o = (float *)w + n * K;
            for (int64_t k = 0; k < K; k++) o[k] = (float)qr[k] * s;
        }
    }
}
