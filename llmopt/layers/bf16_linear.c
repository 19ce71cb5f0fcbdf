// bf16 matmul over a weight packed once in VNNI pairs: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), bf16 in and
// out, products summed in float32 and rounded once. Built and loaded by packed_linear.py.
//
// Why this layout: with the weight row-major, each output is a dot product along K that ends in a horizontal
// sum, and at decode sizes those sums cost as much as the products. Packed as pairs of K for 16 outputs at a
// time, one vdpbf16ps multiplies a broadcast pair of x by 16 outputs' weights and adds into 16 float32 lanes,
// so an output never needs a horizontal sum, one load of weights serves every activation row of the pass,
// and the weight streams from memory once per call in order: at one row it reads at memory speed, and past
// a few rows it is bound by vdpbf16ps.
//
// The packed weight (see pack_vnni in packed_linear.py): N rounded up to 16 with zero rows, cut into panels of
// PANEL outputs (the last one may be narrower, a multiple of 16); panel p starts at wp + PANEL * p * K and is
// laid out [K / 2][width][2]. K is even.
#include <stdint.h>
#include <string.h>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define PANEL 64   // outputs per panel: 4 vectors of 16 float32 sums
#define NV (PANEL / 16)
#define MT 6       // activation rows per pass over a panel: MT * NV accumulators, NV weight vectors, 1 broadcast
#define M_CHUNK 48 // activation rows per work item: a big batch is split over rows as well as panels

int bf16_linear_available(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
// rows x[0..mt) against one panel of nv vectors; `valid` of its outputs are written (the rest is padding).
// Inlined with constant mt and nv (see panel) so the accumulators stay in registers.
static inline __attribute__((always_inline)) void panel_mt_nv(const uint16_t *x, const int mt, int64_t K,
                                                              const uint16_t *wp, const int nv, const uint16_t *bias,
                                                              uint16_t *y, int64_t N, int64_t valid) {
    __m512 acc[MT][NV];
    for (int m = 0; m < MT; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t *wk = wp + k * nv * 16;  // the pair row k / 2 of this panel: nv * 16 outputs x 2
        __m512bh w[NV];
        for (int v = 0; v < nv; v++) w[v] = (__m512bh)_mm512_loadu_si512((const void *)(wk + v * 32));
        for (int m = 0; m < mt; m++) {
            int32_t pair;
            memcpy(&pair, x + m * K + k, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < nv; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
        }
    }
    for (int v = 0; v < nv; v++) {
        const int64_t left = valid - v * 16;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        __m512 b = _mm512_setzero_ps();
        if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + v * 16)), 16));
        for (int m = 0; m < mt; m++)
            _mm256_mask_storeu_epi16(y + m * N + v * 16, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], b)));
    }
}

#define CASE(mt, nv) case (mt) * 8 + (nv): panel_mt_nv(x, mt, K, wp, nv, bias, y, N, valid); break;
#define CASES(mt) CASE(mt, 1) CASE(mt, 2) CASE(mt, 3) CASE(mt, 4)

static void panel(const uint16_t *x, int mt, int64_t K, const uint16_t *wp, int nv, const uint16_t *bias,
                  uint16_t *y, int64_t N, int64_t valid) {
    switch (mt * 8 + nv) {
        CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6)
        default: break;
    }
}
#endif

// Returns 0, or 1 where this build has no AVX512-BF16 (the caller keeps its other path).
int bf16_linear(const uint16_t *x, int64_t M, int64_t K, const uint16_t *wp, const uint16_t *bias, int64_t N,
                uint16_t *y, int nthreads) {
#ifdef __AVX512BF16__
    const int64_t n16 = (N + 15) / 16 * 16, panels = (n16 + PANEL - 1) / PANEL, chunks = (M + M_CHUNK - 1) / M_CHUNK;
    #pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = p * PANEL, width = n16 - n0 < PANEL ? n16 - n0 : PANEL;
            const int64_t valid = N - n0 < width ? N - n0 : width;
            const int64_t m_end = (c + 1) * M_CHUNK < M ? (c + 1) * M_CHUNK : M;
            for (int64_t m0 = c * M_CHUNK; m0 < m_end; m0 += MT) {
                const int64_t mt = m_end - m0 < MT ? m_end - m0 : MT;
                panel(x + m0 * K, (int)mt, K, wp + n0 * K, (int)(width / 16), bias ? bias + n0 : NULL,
                      y + m0 * N + n0, N, valid);
            }
        }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)wp; (void)bias; (void)N; (void)y; (void)nthreads;
    return 1;
#endif
}
