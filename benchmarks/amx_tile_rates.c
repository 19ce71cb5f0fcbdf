// How fast AMX tile products run on this CPU when their operands stream from L2 rather than sit in L1, in the
// loop orders bf16_linear.c's AMX path could take (docs/BENCHMARKS.md, "The AMX GEMM's main loop"). One thread,
// the kernel's own blocks: 2 A tiles (32 rows x 32 k of x, row-major) x 2 B tiles (16 pair rows x 32 outputs of
// a VNNI panel [K / 2][64][2]) into 4 float32 C tiles, stored as float32; no rounding epilogue.
//
//     cc -O3 -march=native -Illmopt benchmarks/amx_tile_rates.c -o /tmp/amx_tile_rates && /tmp/amx_tile_rates [M K N rounds]
//
// Each round times every order once, in turn; a line gives each order's best round and its rate over the
// L1-resident one's best. The ratio is the result: on a VM, a core's tile rate can move by 2x between rounds.
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "native_amx.h"

#if !(defined(__AMX_TILE__) && defined(__AMX_BF16__))
int main(void) { puts("no AMX in this build (cc -march=native on a CPU with amx_bf16)"); return 0; }
#else
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { L1, KERNEL, ROWS_OUTER, PREFETCH, STREAM_A, ORDERS };
static const char *NAMES[ORDERS] = {
    "L1-resident operands (the tile unit's rate)",
    "kernel order: panel, 32 rows, 32 outputs",
    "rows outer: 32 rows against every panel",
    "kernel order + prefetch one k step ahead",
    "kernel order, A by TILELOADDT1 (no L1 fill)",
};

// One 32 x 32 block over k in [0, K) (a k step: 2 A + 2 B tile loads, 4 tile products).
static inline __attribute__((always_inline)) void block(const uint16_t *xm, const uint16_t *wv, int K, float *y,
                                                        int N, int order) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        const uint16_t *wk = wv + (size_t)(k / 2) * 128;
        if (order == PREFETCH && k + 32 < K)
            for (int r = 0; r < 16; r++) {
                _mm_prefetch((const char *)(xm + (size_t)r * K + k + 32), _MM_HINT_T0);
                _mm_prefetch((const char *)(xm + (size_t)(r + 16) * K + k + 32), _MM_HINT_T0);
                _mm_prefetch((const char *)(wk + 16 * 128) + r * 256, _MM_HINT_T0);
                _mm_prefetch((const char *)(wk + 16 * 128) + r * 256 + 64, _MM_HINT_T0);
            }
        if (order == STREAM_A) {
            _tile_stream_loadd(4, xm + k, K * 2);
            _tile_stream_loadd(5, xm + (size_t)16 * K + k, K * 2);
        } else {
            _tile_loadd(4, xm + k, K * 2);
            _tile_loadd(5, xm + (size_t)16 * K + k, K * 2);
        }
        _tile_loadd(6, wk, 256);
        _tile_loadd(7, wk + 32, 256);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, y, N * 4);
    _tile_stored(1, y + 16, N * 4);
    _tile_stored(2, y + (size_t)16 * N, N * 4);
    _tile_stored(3, y + (size_t)16 * N + 16, N * 4);
}

static double run(int order, int M, int K, int N, const uint16_t *x, const uint16_t *w, float *y) {
    const double t = now();
    const int panels = N / 64;
    if (order == L1) {  // the same 8 k steps over and over: 16 KB of x and 32 KB of panel, L1-resident
        for (long s = 0, steps = (long)M / 32 * (N / 32) * (K / 32); s < steps; s++) {
            const int k = (int)(s & 7) * 32;
            _tile_loadd(4, x + k, K * 2);
            _tile_loadd(5, x + (size_t)16 * K + k, K * 2);
            _tile_loadd(6, w + (size_t)k * 64, 256);
            _tile_loadd(7, w + (size_t)k * 64 + 32, 256);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, y, 64);
    } else if (order == ROWS_OUTER) {
        for (int m = 0; m < M; m += 32)
            for (int p = 0; p < panels; p++)
                for (int v = 0; v < 4; v += 2)
                    block(x + (size_t)m * K, w + (size_t)p * 64 * K + v * 32, K, y + (size_t)m * N + p * 64 + v * 16,
                          N, order);
    } else {
        for (int p = 0; p < panels; p++)
            for (int m = 0; m < M; m += 32)
                for (int v = 0; v < 4; v += 2)
                    block(x + (size_t)m * K, w + (size_t)p * 64 * K + v * 32, K, y + (size_t)m * N + p * 64 + v * 16,
                          N, order);
    }
    return now() - t;
}

int main(int argc, char **argv) {
    const int M = argc > 1 ? atoi(argv[1]) : 1024, K = argc > 2 ? atoi(argv[2]) : 576, N = argc > 3 ? atoi(argv[3]) : 960;
    const int rounds = argc > 4 ? atoi(argv[4]) : 7;
    if (M % 32 || K % 32 || K < 256 || N % 64) {
        fprintf(stderr, "M a multiple of 32, K of 32 and at least 256, N of 64\n");
        return 2;
    }
    if (!amx_request()) {
        puts("the OS lends no AMX tile state here");
        return 0;
    }
    static const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_load_config(rows);
    uint16_t *x = aligned_alloc(64, (size_t)M * K * 2), *w = aligned_alloc(64, (size_t)N * K * 2);
    float *y = aligned_alloc(64, (size_t)M * N * 4);
    for (size_t i = 0; i < (size_t)M * K; i++) x[i] = 0x3f80;  // 1.0
    for (size_t i = 0; i < (size_t)N * K; i++) w[i] = 0x3c00;  // 2^-7
    double best[ORDERS];
    for (int o = 0; o < ORDERS; o++) best[o] = 1e30;
    for (int r = 0; r < rounds; r++)
        for (int o = 0; o < ORDERS; o++) {
            const double t = run(o, M, K, N, x, w, y);
            if (t < best[o]) best[o] = t;
        }
    _tile_release();
    printf("M %d, K %d, N %d: best of %d rounds\n", M, K, N, rounds);
    for (int o = 0; o < ORDERS; o++)
        printf("  %-46s %7.0f GFLOP/s  %.2f of L1-resident\n", NAMES[o], 2.0 * M * N * K / best[o] / 1e9,
               best[L1] / best[o]);
    free(x), free(w), free(y);
    return 0;
}
#endif
