// bf16 matmul over a weight packed once in VNNI pairs: y[M, N] = (x[M, K] @ w[N, K]^T) * scale[N] + bias[N],
// x and y bf16; w bf16, or int8 with per-output scales (W8A16: each weight converted to bf16 exactly once per
// pass, shared by the pass's rows); products summed in float32, scaled, biased and rounded once. Built and
// loaded by packed_linear.py.
//
// Why this layout: with the weight row-major, each output is a dot product along K that ends in a horizontal
// sum, and at decode sizes those sums cost as much as the products. Packed as pairs of K for 16 outputs at a
// time, one vdpbf16ps multiplies a broadcast pair of x by 16 outputs' weights and adds into 16 float32 lanes,
// so an output never needs a horizontal sum, one load of weights serves every activation row of the pass,
// and the weight streams from memory once per call in order: at one row it reads at memory speed, and past
// a few rows it is bound by vdpbf16ps.
//
// The packed weight (see pack_vnni in packed_linear.py): N rounded up to 16 with zero rows, cut into panels of
// PANEL outputs (the last one may be narrower, a multiple of 16); panel p starts PANEL * p * K elements in
// and is laid out [K / 2][width][2]. K is even.
//
// int4 (W4A16, symmetric groups; bf16_linear_int4): the same panels with one byte per output and pair of k,
// the low nibble k and the high one k + 1, codes q in 0..15 for the weight (q - 8) * s; s is a bf16 scale per
// group of G inputs and output, laid out panel by panel, each [K / G][width] (so a pass reads them in order, as
// it reads the panel: rows of all N outputs put each group's scales a page or more apart, a demand miss per
// group that cost 1.18x at one row on the Intel VM, docs/BENCHMARKS.md "group scales"). Up to WIDEN_ROWS_INT4
// rows, a pass sums each group's products in its own float32 lanes and folds them into the output's with one
// multiply-add by the 16 outputs' scales, so no weight is ever scaled (exact products); the nibbles become bf16
// by one table lookup (vpermw) per 32 weights (or, with bf16_linear_set_fma on, as on Intel cores where
// vdpbf16ps is slow, float32 for FMAs; the int8 passes too, and bf16's from 2 rows in vdpbf16ps's own order).
// Past that (prefill; past WIDEN_ROWS_INT4_F32 with the FMAs), each panel is dequantized once per work item to bf16
// (q - 8) * s, rounded as torch rounds it (what transformers and vLLM compute), and the passes are bf16's: the folds
// cost a fifth of the compute-bound passes' speed. On AMX tiles (bf16_linear_int4_amx, which packed_linear.py
// picks from 6 rows) the panels are dequantized the same way at every row count.
#define _GNU_SOURCE  // syscall() for the AMX permission request
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "native_bf16.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define PANEL 64   // outputs per panel: 4 vectors of 16 float32 sums
#define NV (PANEL / 16)
#define MT 6       // activation rows per pass over a panel: MT * NV accumulators, NV weight vectors, 1 broadcast
#define M_CHUNK 48 // activation rows per work item: a big batch is split over rows as well as panels
#define WIDEN_ROWS 16 // int8: past this many rows, panels are widened to bf16 once per work item
#define MT_GROUPED 8  // int4 passes of up to 8 rows; past 3 rows over NV_GROUPED vectors of the panel at a time:
#define NV_GROUPED 2  // the 2 * 8 * 2 accumulators spill a few, and still beat more passes decoding nibbles again
#define MT_MAX 8      // the most rows of any vdpbf16ps pass
#define MT_INT4_F32 5 // int4 float32 passes: up to 5 rows over the whole panel (as passes of up to 8 over a quarter
                      // did past 5: 1.0-1.44x at 6-16 rows, the same bits; docs/BENCHMARKS.md "int4 passes of 5 rows")
#define MT_F32 12     // the most rows of a float32 pass (over one vector: 2 x 12 accumulators)
#ifndef F32_BF16_ROWS
#define F32_BF16_ROWS 2  // bf16 in float32 passes from this many rows (where set: Intel cores, off AMX)
#endif
#define X_ROWS_F32 256   // float32 passes: x converted to float32 this many rows at a time
#define WIDEN_ROWS_INT4 64  // int4: past this many rows, panels are dequantized to bf16 once per item (measured)
// the same where the passes run float32 FMAs (bf16_linear_set_fma): the dequantized panels then run bf16's float32
// passes: 1.2-1.4x the int4 passes' group folds at 32-64 rows, parity at 13-24 (Intel Xeon VM without AMX)
#define WIDEN_ROWS_INT4_F32 16
enum { W_BF16 = 0, W_INT8 = 1, W_INT4 = 2 };
#define AMX_ITEM 32   // AMX: activation rows per work item, one block of two A tiles
// Software prefetch distances (bytes) for the weight streams: a decode-size call is bound by how fast the weight
// arrives from memory, and the hardware prefetchers alone left the int8 and int4 passes reading 3.5-7 GB/s on an
// Intel Xeon VM that reads 21-28 GB/s (docs/BENCHMARKS.md, "On the Intel Xeon VM")
#define PF_PACKED 2048  // int8 and int4 panels and the panels being widened
#define PF_BF16 1024    // bf16 panels
#define PF_AMX 4096     // AMX over a whole panel: one k step (16 pair rows of 256 bytes) ahead
// The float32 passes (Intel cores) prefetch into L2, further ahead: on a model's worth of 1.2B int4 layers read
// from DRAM (545 MB, past what the VM's share of the L3 holds), 1.07-1.14x at one row over prefetcht0 2 KB ahead,
// 1.03-1.06x at two (any of 4-32 KB ahead; docs/BENCHMARKS.md, "prefetching into L2")
#define PF_L2 8192
#define PF_F32 16384  // float32 passes over a vector or two of a panel (int8's past 4 rows, bf16's)

// Bytes of one 16-output block's pair row (two k of 16 outputs) in a panel of each storage
static inline int64_t block_bytes(int storage) { return storage == W_BF16 ? 64 : storage == W_INT8 ? 32 : 16; }

// The panel whose first output is n0: panels are laid out one after another, each n0 * K weights in
static inline const void *panel_at(const void *wp, int storage, int64_t n0, int64_t K) {
    return (const char *)wp + n0 * K * (storage == W_BF16 ? 2 : 1) / (storage == W_INT4 ? 2 : 1);
}

// Work units of 16 outputs x a chunk of rows, panel by panel (each panel's chunks in turn, so a panel stays in cache
// over its chunks), an equal run of them per thread: whole panels as items left a thread idle at the end wherever
// the panels did not divide evenly (SmolLM2's 576 outputs are 9 panels, 5 against 4). unit_item: the item that
// unit u starts in a run ending at `end` (panel p, chunk c, its blocks [vb, ve)), over nblk blocks in all.
struct unit_item { int64_t p, c, vb, ve; };
static inline struct unit_item unit_item(int64_t u, int64_t end, int64_t nblk, int64_t chunks) {
    const int64_t per_panel = PANEL / 16, full = nblk / per_panel, in_full = full * chunks * per_panel;
    const int64_t nv = u < in_full ? per_panel : nblk - full * per_panel;  // blocks of this unit's panel
    const int64_t p = u < in_full ? u / (chunks * per_panel) : full;
    const int64_t r = u < in_full ? u - p * chunks * per_panel : u - in_full, c = r / nv, vb = r - c * nv;
    return (struct unit_item){p, c, vb, vb + (end - u) < nv ? vb + (end - u) : nv};
}

// A thread's scratch, kept for its next call: a fresh buffer of a panel's size would be mapped per call, and its
// page faults cost more than the conversion it holds. NULL when out of memory.
struct scratch { void *buf; size_t cap; };

static inline void *scratch_at_least(struct scratch *s, size_t bytes) {
    if (bytes > s->cap) {
        void *grown = realloc(s->buf, bytes);
        if (!grown) return NULL;
        s->buf = grown, s->cap = bytes;
    }
    return s->buf;
}

// n float32 values: x for the float32 passes (AVX-512's where set, and AVX2's), apart from thread_buffer
static inline float *x_float_buffer(size_t n) {
    static _Thread_local struct scratch s;
    return (float *)scratch_at_least(&s, n * sizeof(float));
}

// Which passes this build runs: 2 AVX512-BF16 (vdpbf16ps, or float32 FMAs where set), 1 AVX2 (float32 FMAs, below),
// 0 none (the callers keep their other paths).
int bf16_linear_isa(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int bf16_linear_available(void) { return bf16_linear_isa() > 0; }

// Whether the passes off AMX (int8 and int4, bf16 from F32_BF16_ROWS) multiply in float32 FMAs instead of
// vdpbf16ps: packed_linear.py turns it on where that is faster (Intel cores). Process-wide: the decode step and the
// MoE block call these same functions.
static int fma_passes;
void bf16_linear_set_fma(int on) { fma_passes = on != 0; }
int bf16_linear_fma(void) { return fma_passes; }

// The rows past which int4 panels are dequantized to bf16 once per work item (off AMX), so a call's products
// are those of torch's rounded (q - 8) * s and no longer exact: the tests' threshold (it follows the fma switch).
int bf16_linear_int4_widen_rows(void) {
#if defined(__AVX512BF16__)
    return fma_passes ? WIDEN_ROWS_INT4_F32 : WIDEN_ROWS_INT4;
#else
    return 0x7fffffff;  // the AVX2 passes never dequantize
#endif
}

#ifdef __AVX512BF16__
static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 mask) {  // 16 bf16 as float32, masked
    return bf16x16_widen(_mm256_maskz_loadu_epi16(mask, p));
}

static uint16_t I4_TABLE[32];  // bf16 of q - 8 at index q and q + 16 (vpermw reads 5 bits of an index word)
static int i4_table_ready;

static void i4_table_init(void) {
    if (i4_table_ready) return;
    for (int q = 0; q < 32; q++) I4_TABLE[q] = f_to_bf16((float)((q & 15) - 8));
    i4_table_ready = 1;
}

// 16 bytes of one int4 pair row (16 outputs x k, k + 1) as 32 bf16 (q - 8) in the VNNI pair order, exact.
// The 16 bytes go to every 128-bit lane (a broadcast load: no shuffle port), one in-lane vpshufb puts byte j
// in the low byte of both words of dword j (lane j / 4), one vpsrlvw shifts the high word's right by 4 (the
// k + 1 nibble), and one vpermw looks both up: the low word's index keeps the k + 1 nibble's low bit in bit 4,
// which the table's second half ignores. Three vector ops per 32 weights where widening each byte to a dword
// and masking took five (1.13-1.16x at 1-2 rows on an Intel Xeon; not measured on AMD).
static inline __m512bh int4x32_to_bf16(const uint8_t *p, const __m512i table, const __m512i spread,
                                       const __m512i shifts) {
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
    const __m512i idx = _mm512_srlv_epi16(_mm512_shuffle_epi8(b, spread), shifts);
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
}

// vpshufb control for int4x32_to_bf16: in lane L, dword i reads byte 4L + i into bytes 0 and 2 (bit 7: zero)
static inline __m512i int4_spread(void) {
    return _mm512_set_epi32(0x800f800f, 0x800e800e, 0x800d800d, 0x800c800c, 0x800b800b, 0x800a800a, 0x80098009,
                            0x80088008, 0x80078007, 0x80068006, 0x80058005, 0x80048004, 0x80038003, 0x80028002,
                            0x80018001, 0x80008000);
}

// The end of a pass: each row's sums of nv vectors (acc[m * stride + v]) times the outputs' scales (or 1), plus
// their bias (or 0), rounded to bf16 once, and the outputs past `valid` left unwritten
static inline __attribute__((always_inline)) void store_sums(const __m512 *acc, const int stride, const int mt,
                                                             const int nv, const uint16_t *scale,
                                                             const uint16_t *bias, uint16_t *y, int64_t N,
                                                             int64_t valid) {
    for (int v = 0; v < nv; v++) {
        const int64_t left = valid - v * 16;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const __m512 s = scale ? load_bf16x16(scale + v * 16, mask) : _mm512_set1_ps(1.f);
        const __m512 b = bias ? load_bf16x16(bias + v * 16, mask) : _mm512_setzero_ps();
        for (int m = 0; m < mt; m++)
            _mm256_mask_storeu_epi16(y + m * N + v * 16, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[m * stride + v], s, b)));
    }
}

// rows x[0..mt) against nv vectors of a panel whose pair rows hold vstride vectors (nv < vstride: a part of
// the panel, wp at its first vector); `valid` of its outputs are written (the rest is padding).
// `group` > 0: each group of that many inputs is summed apart and folded in by gscale (the group scales of this
// panel's outputs, gstride bf16 apart from one group to the next); the weights are then unscaled codes.
// Inlined with constant mt, nv and int8 (see panel) so the accumulators stay in registers.
static inline __attribute__((always_inline)) void panel_mt_nv(const uint16_t *x, const int mt, int64_t K,
                                                              const void *wp, const int storage, const int nv,
                                                              const int vstride,
                                                              const uint16_t *scale, const uint16_t *bias,
                                                              uint16_t *y, int64_t N, int64_t valid,
                                                              const int grouped, int64_t group,
                                                              const uint16_t *gscale, int64_t gstride) {
    __m512 acc[MT_MAX][NV], gacc[MT_MAX][NV];
    for (int m = 0; m < MT_MAX; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    const __m512i table = storage == W_INT4 ? _mm512_loadu_si512((const void *)I4_TABLE) : _mm512_setzero_si512();
    const __m512i spread = int4_spread(), shifts = _mm512_set1_epi32(4 << 16);
    if (grouped)
        for (int m = 0; m < MT_MAX; m++)
            for (int v = 0; v < NV; v++) gacc[m][v] = _mm512_setzero_ps();
    // Grouped: a loop over each group's k, then its fold (no `k % group` per pair row)
    const int64_t span = grouped ? group : K;
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += span, g++) {
        for (int64_t k = k0; k < k0 + span; k += 2) {
            __m512bh w[NV];  // the pair row k / 2 of this panel: nv * 16 outputs x 2, as bf16
            if (storage == W_INT8) {
                const int8_t *wk = (const int8_t *)wp + k * vstride * 16;
                for (int v = 0; v < nv; v += 2) _mm_prefetch((const char *)(wk + v * 32 + PF_PACKED), _MM_HINT_T0);
                for (int v = 0; v < nv; v++) w[v] = int8x32_to_bf16(wk + v * 32);
            } else if (storage == W_INT4) {
                const uint8_t *wk = (const uint8_t *)wp + (k / 2) * vstride * 16;
                _mm_prefetch((const char *)(wk + PF_PACKED), _MM_HINT_T0);
                for (int v = 0; v < nv; v++) w[v] = int4x32_to_bf16(wk + v * 16, table, spread, shifts);
            } else {
                const uint16_t *wk = (const uint16_t *)wp + k * vstride * 16;
                for (int v = 0; v < nv; v++) _mm_prefetch((const char *)(wk + v * 32) + PF_BF16, _MM_HINT_T0);
                for (int v = 0; v < nv; v++) w[v] = (__m512bh)_mm512_loadu_si512((const void *)(wk + v * 32));
            }
            for (int m = 0; m < mt; m++) {
                int32_t pair;
                memcpy(&pair, x + m * K + k, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                if (grouped)
                    for (int v = 0; v < nv; v++) gacc[m][v] = _mm512_dpbf16_ps(gacc[m][v], xv, w[v]);
                else
                    for (int v = 0; v < nv; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
            }
        }
        if (grouped) {  // the end of a group: fold its sums in by its scales
            const uint16_t *gs = gscale + g * gstride;
            for (int v = 0; v < nv; v++) {
                const __m512 sv = load_bf16x16(gs + v * 16, (__mmask16)0xffff);
                for (int m = 0; m < mt; m++) {
                    acc[m][v] = _mm512_fmadd_ps(gacc[m][v], sv, acc[m][v]);
                    gacc[m][v] = _mm512_setzero_ps();
                }
            }
        }
    }
    store_sums(&acc[0][0], (int)(sizeof acc[0] / sizeof acc[0][0]), mt, nv, scale, bias, y, N, valid);
}

#define CASE(mt, nv) case (mt) * 8 + (nv): \
    if (storage == W_INT8) panel_mt_nv(x, mt, K, wp, W_INT8, nv, vstride, scale, bias, y, N, valid, 0, 0, NULL, 0); \
    else panel_mt_nv(x, mt, K, wp, W_BF16, nv, vstride, scale, bias, y, N, valid, 0, 0, NULL, 0); \
    break;
#define CASES(mt) CASE(mt, 1) CASE(mt, 2) CASE(mt, 3) CASE(mt, 4)
#define GCASE(mt, nv) case (mt) * 8 + (nv): \
    panel_mt_nv(x, mt, K, wv, W_INT4, nv, vstride, NULL, bv, yv, N, vv, 1, group, gv, gstride); \
    break;

// The int4 passes in float32 FMAs (bf16_linear_set_fma): each 16 bytes of a pair row become the float32 codes
// q - 8 of k and of k + 1 by one vpmovzxbd, one shift and two vpermps (whose index reads the low 4 bits of each
// dword: the nibble), multiplied by x in float32 (x converted once per call; every product exact) and summed per
// group as the vdpbf16ps passes do. Where vdpbf16ps is slow (Intel cores: about two cycles on both 512-bit
// ports, where an FMA takes half of one), two FMAs do its 32 products in less time, and the one-row pass turns
// 32 nibbles into weights with 3 vector ops where the bf16 pass needs 3 plus its vdpbf16ps.
static inline __attribute__((always_inline)) void panel_int4_f32_nv(const float *x, const int mt, int64_t K,
                                                                    const uint8_t *wp, const int nv, const int vstride,
                                                                    const uint16_t *bias, uint16_t *y, int64_t N,
                                                                    int64_t valid, int64_t group,
                                                                    const uint16_t *gscale, int64_t gstride) {
    __m512 acc[MT_MAX][NV], gacc[MT_MAX][NV];
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int m = 0; m < mt; m++)
        for (int v = 0; v < nv; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < nv; v++) gacc[m][v] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k0 + group; k += 2) {
            const uint8_t *wk = wp + (k / 2) * vstride * 16;
            _mm_prefetch((const char *)(wk + PF_L2), _MM_HINT_T1);
            __m512 wa[NV], wb[NV];  // float32 codes of k and of k + 1, 16 outputs each
            for (int v = 0; v < nv; v++) {
                const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wk + v * 16)));
                wa[v] = _mm512_permutexvar_ps(d, codes);
                wb[v] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), codes);
            }
            for (int m = 0; m < mt; m++) {
                const __m512 xa = _mm512_set1_ps(x[m * K + k]), xb = _mm512_set1_ps(x[m * K + k + 1]);
                for (int v = 0; v < nv; v++)
                    gacc[m][v] = _mm512_fmadd_ps(wb[v], xb, _mm512_fmadd_ps(wa[v], xa, gacc[m][v]));
            }
        }
        const uint16_t *gs = gscale + g * gstride;
        for (int v = 0; v < nv; v++) {
            const __m512 sv = load_bf16x16(gs + v * 16, (__mmask16)0xffff);
            for (int m = 0; m < mt; m++) acc[m][v] = _mm512_fmadd_ps(gacc[m][v], sv, acc[m][v]);
        }
    }
    for (int v = 0; v < nv; v++) {
        const int64_t left = valid - v * 16;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const __m512 b = bias ? load_bf16x16(bias + v * 16, mask) : _mm512_setzero_ps();
        for (int m = 0; m < mt; m++)
            _mm256_mask_storeu_epi16(y + m * N + v * 16, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][v], b)));
    }
}

#define FCASE(mt, nv) case (mt) * 8 + (nv): \
    panel_int4_f32_nv(xf, mt, K, wv, nv, vstride, bv, yv, N, vv, group, gv, gstride); \
    break;

// The int8 passes in float32 FMAs, of mt rows over nv vectors: 16 bytes of a pair row (8 outputs x k, k + 1, in
// pair order) become 16 float32 weights by one vpmovsxbd and one vcvtdq2ps, multiplied by the row's x pair (x[k],
// x[k + 1]) broadcast to every pair of lanes: a vector's lanes 2j and 2j + 1 hold output j's sums over even and odd
// k, added at the end (two permutes per 16 outputs) and scaled. Three vector ops per 16 weights where the vdpbf16ps
// pass converts to bf16 and pays for its vdpbf16ps (why, and where: the int4 passes above).
static inline __attribute__((always_inline)) void panel_int8_f32_nv(const float *x, const int mt, int64_t K,
                                                                    const int8_t *wp, const int nv, const int vstride,
                                                                    const uint16_t *scale, const uint16_t *bias,
                                                                    uint16_t *y, int64_t N, int64_t valid) {
    __m512 acc[MT_F32][2 * NV];  // [m][2v]: outputs 16v..16v+7 (even and odd k), [m][2v + 1]: 16v+8..16v+15
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 2 * nv; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        const int8_t *wk = wp + k * vstride * 16;
        // a line in 64 bytes of the pair row's vectors: one row into L2, further ahead (PF_L2; two rows lost 3-4%
        // that way); 2-4 rows over the whole panel PF_PACKED ahead; more over one vector, whose lines are a panel's
        // width apart, PF_F32 ahead into L2
        for (int b = 0; b < nv * 32; b += 64) {
            if (mt == 1) _mm_prefetch((const char *)(wk + b + PF_L2), _MM_HINT_T1);
            else if (mt > 4) _mm_prefetch((const char *)(wk + b + PF_F32), _MM_HINT_T1);
            else _mm_prefetch((const char *)(wk + b + PF_PACKED), _MM_HINT_T0);
        }
        __m512 w[2 * NV];
        for (int j = 0; j < 2 * nv; j++)
            w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wk + j * 16))));
        for (int m = 0; m < mt; m++) {
            double pair;  // x[k], x[k + 1] as float32, broadcast whole
            memcpy(&pair, x + m * K + k, sizeof pair);
            const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
            for (int j = 0; j < 2 * nv; j++) acc[m][j] = _mm512_fmadd_ps(w[j], xp, acc[m][j]);
        }
    }
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int v = 0; v < nv; v++) {
        const int64_t left = valid - v * 16;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const __m512 s = load_bf16x16(scale + v * 16, mask);
        const __m512 b = bias ? load_bf16x16(bias + v * 16, mask) : _mm512_setzero_ps();
        for (int m = 0; m < mt; m++) {
            const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(acc[m][2 * v], even, acc[m][2 * v + 1]),
                                             _mm512_permutex2var_ps(acc[m][2 * v], odd, acc[m][2 * v + 1]));
            _mm256_mask_storeu_epi16(y + m * N + v * 16, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(sum, s, b)));
        }
    }
}

// The bf16 passes in float32 FMAs, of mt rows over nv (1 or 2) vectors of 16 outputs: each dword of a pair row,
// (w[k], w[k + 1]) of one output, becomes w[k] by a shift and w[k + 1] by a mask, and each row adds x[k + 1]
// w[k + 1], then x[k] w[k], as two FMAs: the order and roundings of vdpbf16ps (odd product, then even; each exact,
// each sum rounded), so a row's result is the same bits as the vdpbf16ps passes give it (but where a product or
// sum is subnormal, which vdpbf16ps flushes to zero) and a batch stays invariant whichever passes run. Where
// vdpbf16ps is slow and more than one row reads the panel (Intel cores: one vdpbf16ps every two cycles, two FMAs a
// cycle, half the products per cycle; 1.03-1.46x at 2-512 rows on the Intel Xeon VM without AMX, docs/BENCHMARKS.md
// "An Intel Xeon without AMX").
static inline __attribute__((always_inline)) void panel_bf16_f32_nv(const float *x, const int mt, int64_t K,
                                                                    const uint16_t *wp, const int nv,
                                                                    const int vstride, const uint16_t *scale,
                                                                    const uint16_t *bias, uint16_t *y, int64_t N,
                                                                    int64_t valid) {
    __m512 acc[MT_F32][2];
    for (int m = 0; m < mt; m++)
        for (int v = 0; v < nv; v++) acc[m][v] = _mm512_setzero_ps();
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t *wk = wp + k * vstride * 16;
        __m512 even[2], odd[2];
        for (int v = 0; v < nv; v++) {
            _mm_prefetch((const char *)(wk + v * 32) + PF_F32, _MM_HINT_T1);
            const __m512i pairs = _mm512_loadu_si512((const void *)(wk + v * 32));
            even[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            odd[v] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
        }
        for (int m = 0; m < mt; m++) {
            const __m512 xe = _mm512_set1_ps(x[m * K + k]), xo = _mm512_set1_ps(x[m * K + k + 1]);
            for (int v = 0; v < nv; v++)
                acc[m][v] = _mm512_fmadd_ps(even[v], xe, _mm512_fmadd_ps(odd[v], xo, acc[m][v]));
        }
    }
    store_sums(&acc[0][0], (int)(sizeof acc[0] / sizeof acc[0][0]), mt, nv, scale, bias, y, N, valid);
}

#define ICASE(mt, nv) case (mt) * 8 + (nv): \
    panel_int8_f32_nv(x, mt, K, (const int8_t *)wp, nv, vstride, scale, bias, y, N, valid); \
    break;
#define RCASE(r) case (r) * 4 + 1: \
    if (storage == W_INT8) panel_int8_f32_nv(xm, r, K, (const int8_t *)wv, 1, vstride, sv, bv, ym, N, vv); \
    else panel_bf16_f32_nv(xm, r, K, (const uint16_t *)wv, 1, vstride, sv, bv, ym, N, vv); \
    break;
#define PCASE(r) case (r) * 4 + 2: \
    panel_bf16_f32_nv(xm, r, K, (const uint16_t *)wv, 2, vstride, sv, bv, ym, N, vv); \
    break;

// The float32 passes over an int8 or bf16 panel (x in float32). int8 up to 4 rows over the whole panel: past 2 rows
// some of the 16 accumulators per row spill to the stack, which costs less than reading the panel again in passes
// of 2 rows (1.30-1.33x at 3 rows, 1.29x at 4, a 1.2B model's worth from DRAM; docs/BENCHMARKS.md "group scales").
// Past 4 rows passes of up to MT_F32 rows over one vector at a time, the weights converted once per pass (where
// the int8 passes of 2 rows over the whole panel converted them once per 2 rows); bf16 at every row count over
// two vectors at a time (below).
static void panel_f32(const float *x, int mt, int64_t K, const void *wp, int storage, int nv, int vstride,
                      const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N, int64_t valid) {
    if (storage == W_INT8 && mt <= 4) {
        switch (mt * 8 + nv) {
            ICASE(1, 1) ICASE(1, 2) ICASE(1, 3) ICASE(1, 4) ICASE(2, 1) ICASE(2, 2) ICASE(2, 3) ICASE(2, 4)
            ICASE(3, 1) ICASE(3, 2) ICASE(3, 3) ICASE(3, 4) ICASE(4, 1) ICASE(4, 2) ICASE(4, 3) ICASE(4, 4)
            default: break;
        }
        return;
    }
    // Past that, a vector at a time in passes of up to MT_F32 rows; bf16 two vectors at a time, in passes of up to
    // MT_F32 rows too: two loads and 24 broadcasts to 48 FMAs, where one vector and 12 rows take 26 loads to 24 FMAs
    // (1.19-1.24x at 32-512 rows for two vectors of 6 rows), and the 4 shifts and masks of a pair row's vectors
    // serve 12 rows where they served 6 (1.04-1.25x at 8-512 rows, the same bits; docs/BENCHMARKS.md "bf16 passes
    // of 12 rows"); the odd vector out alone; passes of even size
    for (int v = 0, n; v < nv; v += n) {
        n = storage == W_BF16 && nv - v >= 2 ? 2 : 1;
        const int count = (mt + MT_F32 - 1) / MT_F32, step = (mt + count - 1) / count;
        const char *wv = (const char *)wp + v * block_bytes(storage);
        const uint16_t *sv = scale ? scale + v * 16 : NULL, *bv = bias ? bias + v * 16 : NULL;
        const int64_t vv = valid - v * 16;
        for (int m0 = 0; m0 < mt; m0 += step) {
            const float *xm = x + m0 * K;
            uint16_t *ym = y + m0 * N + v * 16;
            switch ((mt - m0 < step ? mt - m0 : step) * 4 + n) {
                RCASE(1) RCASE(2) RCASE(3) RCASE(4) RCASE(5) RCASE(6) RCASE(7) RCASE(8) RCASE(9) RCASE(10)
                RCASE(11) RCASE(12) PCASE(1) PCASE(2) PCASE(3) PCASE(4) PCASE(5) PCASE(6) PCASE(7) PCASE(8)
                PCASE(9) PCASE(10) PCASE(11) PCASE(12)
                default: break;
            }
        }
    }
}

// Passes over an int4 panel with group folds, in vdpbf16ps on x, or in float32 FMAs on xf (x in float32, where
// bf16_linear_set_fma is on; else NULL). vdpbf16ps: up to 3 rows over the whole panel (four chains of sums), more
// over NV_GROUPED of its vectors at a time; float32: over the whole panel, in passes of up to MT_INT4_F32 rows. At
// 3-5 rows some of the 2 x mt x 4 accumulators spill to the stack, which costs less than a pass over half the
// panel reading each cache line of it twice (1.2x at 3-5 rows from DRAM, docs/BENCHMARKS.md "group scales"), and
// less than passes of more rows over a quarter of it (1.0-1.44x at 6-16 rows, "int4 passes of 5 rows").
static void panel_int4(const uint16_t *x, const float *xf, int mt, int64_t K, const uint8_t *wp, int nv,
                       int vstride, const uint16_t *bias, uint16_t *y, int64_t N, int64_t valid, int64_t group,
                       const uint16_t *gscale, int64_t gstride) {
    const int step = xf || mt <= 3 ? nv : NV_GROUPED;  // xf: mt <= MT_INT4_F32
    for (int v0 = 0; v0 < nv; v0 += step) {
        const int sub = nv - v0 < step ? nv - v0 : step;
        const uint8_t *wv = wp + v0 * 16;
        const uint16_t *bv = bias ? bias + v0 * 16 : NULL, *gv = gscale + v0 * 16;
        uint16_t *yv = y + v0 * 16;
        const int64_t vv = valid - v0 * 16;
        if (xf)
            switch (mt * 8 + sub) {
                FCASE(1, 1) FCASE(1, 2) FCASE(1, 3) FCASE(1, 4) FCASE(2, 1) FCASE(2, 2) FCASE(2, 3) FCASE(2, 4)
                FCASE(3, 1) FCASE(3, 2) FCASE(3, 3) FCASE(3, 4) FCASE(4, 1) FCASE(4, 2) FCASE(4, 3) FCASE(4, 4)
                FCASE(5, 1) FCASE(5, 2) FCASE(5, 3) FCASE(5, 4)
                default: break;
            }
        else switch (mt * 8 + sub) {
            GCASE(1, 1) GCASE(1, 2) GCASE(1, 3) GCASE(1, 4) GCASE(2, 1) GCASE(2, 2) GCASE(2, 3) GCASE(2, 4)
            GCASE(3, 1) GCASE(3, 2) GCASE(3, 3) GCASE(3, 4)
            GCASE(4, 1) GCASE(4, 2) GCASE(5, 1) GCASE(5, 2) GCASE(6, 1) GCASE(6, 2)
            GCASE(7, 1) GCASE(7, 2) GCASE(8, 1) GCASE(8, 2)
            default: break;
        }
    }
}

static void panel(const uint16_t *x, int mt, int64_t K, const void *wp, int storage, int nv, int vstride,
                  const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N, int64_t valid) {
    switch (mt * 8 + nv) {
        CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6)
        default: break;
    }
}

static uint16_t *thread_buffer(size_t n) {  // n bf16 values (a widened panel)
    static _Thread_local struct scratch s;
    return (uint16_t *)scratch_at_least(&s, n * sizeof(uint16_t));
}

// An int8 panel converted to bf16 in the same layout (exact: |w| <= 128); n is a multiple of 32.
static void widen_panel(const int8_t *w, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i += 32) {
        if (!(i & 63)) _mm_prefetch((const char *)(w + i + PF_PACKED), _MM_HINT_T0);
        _mm512_storeu_si512((void *)(out + i), (__m512i)int8x32_to_bf16(w + i));
    }
}

// An int4 panel (`width` outputs, K inputs) dequantized: bf16 of (q - 8) * s in the VNNI layout, each weight
// rounded once to nearest even as torch's bf16 (q - 8) * s rounds it, so the panel is what transformers and
// vLLM dequantize and the passes over it need no group folds. gscale: this panel's scales, gstride apart.
static void widen_panel_int4(const uint8_t *w, int64_t width, int64_t K, const uint16_t *gscale,
                             int64_t gstride, int64_t group, uint16_t *out) {
    // q - 8 as float32 by a permute on the nibble (vpermps reads an index's low 4 bits), the products exact in
    // float32 (a bf16 scale times |q - 8| <= 8), both halves rounded by one cvtne2ps and put back in pairs
    const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // element 2i: i, 2i + 1: 16 + i
    const int nv = (int)(width / 16);
    for (int64_t g0 = 0; g0 < K / 2; g0 += group / 2) {
        __m512 s[NV];
        const uint16_t *gs = gscale + (2 * g0 / group) * gstride;  // the group's scales, constant over its k
        for (int v = 0; v < nv; v++) s[v] = load_bf16x16(gs + v * 16, (__mmask16)0xffff);
        for (int64_t kp = g0; kp < g0 + group / 2; kp++) {
            _mm_prefetch((const char *)(w + kp * width + PF_PACKED), _MM_HINT_T0);
            for (int v = 0; v < nv; v++) {
                const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + (kp * width + v * 16))));
                const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(d, codes), s[v]);
                const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), codes), s[v]);
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in elements 0-15, hi in 16-31
                _mm512_storeu_si512((void *)(out + (kp * width + v * 16) * 2), _mm512_permutexvar_epi16(pairs, both));
            }
        }
    }
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_PASSES
#include <immintrin.h>
// The AVX2 passes, for CPUs without AVX512-BF16 (AMD's Zen 2 and 3, Intel cores before Cooper Lake; oneDNN has no
// bf16 kernels there either): the same panels, every storage multiplied in float32 FMAs on x converted once per
// call. A pair row of 8 outputs becomes two vectors of 8 float32 weights, those of k and of k + 1, each multiplied
// by its x broadcast, so a lane is one output and no horizontal sums are needed:
// bf16: one 32-byte load, a shift (k) and a mask (k + 1), exact; int8: one vpmovsxbw of 16 bytes, then the two
// halves of each dword sign-extended (k by a vpmaddwd with 1, k + 1 by a shift) and converted; int4: 8 bytes by
// vpmovzxbd, each nibble masked or shifted and converted: the code q (0..15), not q - 8, so each group sums q x, and 8
// times the group's sum of x (once per row and group, group_sum) is taken off when the group is folded in by its
// scales, as the AVX-512 passes fold theirs. 7
// vector ops per 16 int4 weights instead of the 9 of making q - 8 exact (2^23's mantissa and a subtraction): one
// row 16.4 -> 20.2 GB/s on the Zen 3 VM, whose 4 vector pipes the decode kept busy. Every product is exact at every
// row count (no panel is dequantized first); int4 sums meet the float32 bound of the terms summed (q x and 8 x),
// which exceeds that of (q - 8) x where codes sit near 8 (cancellation); on the tests' random data they meet q - 8's.
#define MT_AVX2 6     // the most rows of a pass: 6 x 2 accumulators over one block of 16 outputs
// Prefetch distances of the AVX2 passes (bytes; -D overrides them, for tuning): on the Zen 3 VM, prefetching every
// line of a pass's pair rows took one row from 22.0 to 28.0 GB/s in bf16 and 17.5 to 27.5 in int8 (only the first
// line of each was prefetched before); 2 and 4 KB ahead: as fast as 1 and 2 KB at one row, 1.04-1.06x faster at two
// (docs/BENCHMARKS.md, "The AVX2 passes: the whole pair row prefetched")
#ifndef PF_AVX2_BF16
#define PF_AVX2_BF16 2048
#endif
#ifndef PF_AVX2_PACKED
#define PF_AVX2_PACKED 4096
#endif
#define X_ROWS_AVX2 192  // rows of x converted to float32 per round (4 work items of M_CHUNK rows)

static inline __m256 bf16x8_to_ps_n(const uint16_t *p, int64_t n) {  // the first n of 8 (zeros past them)
    if (n >= 8) return bf16x8_to_ps(p);
    uint16_t t[8] = {0};
    memcpy(t, p, (size_t)n * sizeof *p);
    return bf16x8_to_ps(t);
}

// 8 float32 rounded to bf16 as torch rounds them (to nearest even; a NaN stays NaN), the first n stored at p
static inline void ps_to_bf16x8_n(uint16_t *p, __m256 v, int64_t n) {
    const __m256i u = _mm256_castps_si256(v), top = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(top, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));  // integer compare: -ffast-math keeps it
    r = _mm256_blendv_epi8(r, _mm256_or_si256(top, _mm256_set1_epi32(64)), nan);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    if (n >= 8) {
        _mm_storeu_si128((__m128i *)p, w);
    } else {
        uint16_t t[8];
        _mm_storeu_si128((__m128i *)t, w);
        memcpy(p, t, (size_t)n * sizeof *p);
    }
}

// The sum of x[0..n) in a fixed order whatever the compiler: 8 lanes over k, then ((0 + 4) + (2 + 6)) + ((1 + 5) +
// (3 + 7)), then the tail in k order. A row's sums, so its result does not depend on its batch.
static inline float group_sum(const float *x, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + k));
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    float s = _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
    for (; k < n; k++) s += x[k];
    return s;
}

// Half j of a pair row (8 outputs, at k and k + 1) as float32 weights: bf16 exactly; int8 and int4 as their codes
// (int4: q, not q - 8), which the passes and the GEMM multiply and scale the same way.
static inline __attribute__((always_inline)) void pair_row_ps(const char *row, const int j, const int storage,
                                                              __m256 *lo, __m256 *hi) {
    if (storage == W_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + j * 32));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else if (storage == W_INT8) {
        const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + j * 16)));
        // k's code sign-extended by one vpmaddwd (k x 1 + (k + 1) x 0) where a shift pair took two: int8 passes of 1
        // row 1.15-1.25x faster, 8 rows 1.05-1.07x on the Zen 3 VM (the same exact codes)
        *lo = _mm256_cvtepi32_ps(_mm256_madd_epi16(v, _mm256_set1_epi32(1)));
        *hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
    } else {
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + j * 8)));
        *lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15)));  // q, not q - 8
        *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
    }
}

// rows x[0..mt) (float32) against nb blocks of 16 outputs of a panel whose pair rows hold vstride blocks (wp at the
// first block of the pass); `valid` of the pass's outputs are written. int4: groups of `group` inputs folded in by
// gscale (this pass's first output's scales, gstride bf16 from one group to the next). Inlined with constant mt,
// nb and storage so the accumulators stay in registers.
static inline __attribute__((always_inline)) void pass_avx2(const float *x, const int mt, int64_t K, const void *wp,
                                                            const int storage, const int nb, const int vstride,
                                                            const uint16_t *scale, const uint16_t *bias, uint16_t *y,
                                                            int64_t N, int64_t valid, int64_t group,
                                                            const uint16_t *gscale, int64_t gstride,
                                                            const float *xsum) {
    __m256 acc[MT_AVX2][8], gacc[MT_AVX2][8];  // [row][2 * block + half]: outputs 16 block + 8 half .. + 8
    const int grouped = storage == W_INT4;
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 2 * nb; j++) acc[m][j] = _mm256_setzero_ps();
    // bf16 passes over one block of the panel (3-6 rows) prefetch vstride times further, the bytes one row's pass
    // over the whole panel keeps in flight: 6 and 8 rows 1.22-1.26x, 4 rows 1.07x on the Zen 3 VM (int8 and int4
    // are bound by their conversions there, and 2-row passes gained nothing)
    const int64_t pf = storage == W_BF16 ? PF_AVX2_BF16 * (nb == 1 ? vstride : 1) : PF_AVX2_PACKED;
    const int64_t span = grouped ? group : K;
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += span, g++) {
        if (grouped)
            for (int m = 0; m < mt; m++)
                for (int j = 0; j < 2 * nb; j++) gacc[m][j] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k0 + span; k += 2) {
            const char *row = storage == W_BF16 ? (const char *)wp + k * vstride * 32
                            : storage == W_INT8 ? (const char *)wp + k * vstride * 16
                                                : (const char *)wp + (k / 2) * vstride * 16;
            // every cache line of this pass's part of the pair row (nb blocks: 64 bytes each in bf16, 32 in int8,
            // 16 in int4), not only the first
            const int line_blocks = storage == W_BF16 ? 1 : storage == W_INT8 ? 2 : 4;
            for (int b = 0; b < nb; b += line_blocks)
                _mm_prefetch(row + b * (64 / line_blocks) + pf, _MM_HINT_T0);
            for (int j = 0; j < 2 * nb; j++) {
                __m256 lo, hi;  // the 8 outputs' weights at k and at k + 1
                pair_row_ps(row, j, storage, &lo, &hi);
                for (int m = 0; m < mt; m++) {
                    const __m256 xa = _mm256_broadcast_ss(x + m * K + k), xb = _mm256_broadcast_ss(x + m * K + k + 1);
                    if (grouped) gacc[m][j] = _mm256_fmadd_ps(hi, xb, _mm256_fmadd_ps(lo, xa, gacc[m][j]));
                    else acc[m][j] = _mm256_fmadd_ps(hi, xb, _mm256_fmadd_ps(lo, xa, acc[m][j]));
                }
            }
        }
        if (grouped) {  // the end of a group: fold its sums in by its scales
            const uint16_t *gs = gscale + g * gstride;
            for (int j = 0; j < 2 * nb; j++) {
                const __m256 sv = bf16x8_to_ps(gs + j * 8);
                for (int m = 0; m < mt; m++)  // sum(q x) - 8 sum(x) = sum((q - 8) x)
                    acc[m][j] = _mm256_fmadd_ps(_mm256_sub_ps(gacc[m][j], _mm256_set1_ps(8.f * xsum[m * (K / group) + g])),
                                                sv, acc[m][j]);
            }
        }
    }
    for (int j = 0; j < 2 * nb; j++) {
        const int64_t left = valid - j * 8;
        if (left <= 0) break;
        const __m256 s = scale ? bf16x8_to_ps_n(scale + j * 8, left) : _mm256_set1_ps(1.f);
        const __m256 b = bias ? bf16x8_to_ps_n(bias + j * 8, left) : _mm256_setzero_ps();
        for (int m = 0; m < mt; m++) ps_to_bf16x8_n(y + m * N + j * 8, _mm256_fmadd_ps(acc[m][j], s, b), left);
    }
}

// The AVX2 GEMM, for items of GEMM_ROWS_AVX2 rows or more (prefill): each 16-output block of the panel widened to
// float32 once per item ([K][16], pair_row_ps's values), then up to 6 rows at a time over it, as BLIS's 6 x 16
// kernel runs: per k two loads of the block, one broadcast of x per row, 12 FMAs, where the passes convert the
// weights once per pass and broadcast each x twice (once per 8 outputs). Every sum is the passes' own, term by
// term in the same order (int4: q x per group, its fold by the same operations), so the results equal theirs
// bit for bit, at any row count. int4's running sums stay in memory (the group's take the registers), touched once
// per group. On the Zen 3 VM (SmolLM2's layers, 2 threads): 159-169 GFLOP/s from 64 rows against the passes'
// 113-125 (torch's float32 sgemm: 150-167), 1.3-1.4x at 32 rows, 1.1-1.3x at 12; at 4-8 rows the passes are as
// fast or faster (docs/BENCHMARKS.md, "An AVX2 GEMM for prefill, and SDPA for prefill attention").
#ifndef GEMM_ROWS_AVX2
#define GEMM_ROWS_AVX2 12
#endif

static float *gemm_buffer(size_t n) {  // n float32 (a widened block)
    static _Thread_local struct scratch s;
    return (float *)scratch_at_least(&s, n * sizeof(float));
}

// the block at wp (pair rows vstride blocks apart) as float32 [K][16]
static void widen_block_avx2(const char *wp, const int storage, const int vstride, int64_t K, float *out) {
    const int64_t pair_row = block_bytes(storage) * vstride;
    for (int64_t k = 0; k < K; k += 2) {
        const char *row = wp + (k / 2) * pair_row;
        _mm_prefetch(row + 8 * pair_row, _MM_HINT_T0);
        for (int j = 0; j < 2; j++) {
            __m256 lo, hi;
            pair_row_ps(row, j, storage, &lo, &hi);
            _mm256_storeu_ps(out + k * 16 + j * 8, lo);
            _mm256_storeu_ps(out + (k + 1) * 16 + j * 8, hi);
        }
    }
}

// rows x[0..mt) against one widened block wb ([K][16] float32); y, scale, bias, gscale at the block's first output
static inline __attribute__((always_inline)) void gemm_avx2(const float *x, const int mt, int64_t K, const float *wb,
                                                            const int grouped, const uint16_t *scale,
                                                            const uint16_t *bias, uint16_t *y, int64_t N,
                                                            int64_t valid, int64_t group, const uint16_t *gscale,
                                                            int64_t gstride, const float *xsum) {
    __m256 acc[6][2];
    float sums[6][16];  // int4: the running sums, per group folded in
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < 2; j++) acc[m][j] = _mm256_setzero_ps();
    if (grouped)
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < 2; j++) _mm256_storeu_ps(sums[m] + j * 8, _mm256_setzero_ps());
    const int64_t span = grouped ? group : K;
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += span, g++) {
        if (grouped)
            for (int m = 0; m < mt; m++)
                for (int j = 0; j < 2; j++) acc[m][j] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k0 + span; k++) {
            const __m256 w0 = _mm256_loadu_ps(wb + k * 16), w1 = _mm256_loadu_ps(wb + k * 16 + 8);
            for (int m = 0; m < mt; m++) {
                const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
                acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
            }
        }
        if (grouped) {  // the end of a group: fold its sums in by its scales, as the passes do
            const uint16_t *gs = gscale + g * gstride;
            for (int j = 0; j < 2; j++) {
                const __m256 sv = bf16x8_to_ps(gs + j * 8);
                for (int m = 0; m < mt; m++) {
                    const __m256 q8x = _mm256_set1_ps(8.f * xsum[m * (K / group) + g]);
                    _mm256_storeu_ps(sums[m] + j * 8, _mm256_fmadd_ps(_mm256_sub_ps(acc[m][j], q8x), sv,
                                                                      _mm256_loadu_ps(sums[m] + j * 8)));
                }
            }
        }
    }
    if (grouped)
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < 2; j++) acc[m][j] = _mm256_loadu_ps(sums[m] + j * 8);
    #pragma GCC unroll 2
    for (int j = 0; j < 2; j++) {  // no `break`: a loop left early keeps acc in memory, and the k loop storing it
        const int64_t left = valid - j * 8;
        if (left > 0) {
            const __m256 s = scale ? bf16x8_to_ps_n(scale + j * 8, left) : _mm256_set1_ps(1.f);
            const __m256 b = bias ? bf16x8_to_ps_n(bias + j * 8, left) : _mm256_setzero_ps();
            for (int m = 0; m < mt; m++) ps_to_bf16x8_n(y + m * N + j * 8, _mm256_fmadd_ps(acc[m][j], s, b), left);
        }
    }
}

#define GCASE_AVX2(mt, gr) case mt: \
    gemm_avx2(x + m0 * K, mt, K, wb, gr, sc, bi, y + m0 * N + v * 16, N, vv, group, gs, gstride, \
              xsum ? xsum + m0 * (K / group) : NULL); break;
#define GCASES_AVX2(gr) switch (M - m0 < 6 ? M - m0 : 6) { \
    GCASE_AVX2(1, gr) GCASE_AVX2(2, gr) GCASE_AVX2(3, gr) GCASE_AVX2(4, gr) GCASE_AVX2(5, gr) GCASE_AVX2(6, gr) \
    default: break; }

// Rows x[0..M) against blocks [vb, ve) of a panel of nv blocks, block by block, each widened into wb (see
// gemm_avx2).
static void gemm_panel_avx2(const float *x, int64_t M, int64_t K, const void *wp, int storage, int nv, int vb, int ve,
                            const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N, int64_t valid,
                            int64_t group, const uint16_t *gscale, int64_t gstride, const float *xsum, float *wb) {
    const int grouped = storage == W_INT4;
    for (int v = vb; v < ve; v++) {
        const int64_t vv = valid - v * 16;
        if (vv <= 0) break;
        widen_block_avx2((const char *)wp + v * block_bytes(storage), storage, nv, K, wb);
        const uint16_t *sc = scale ? scale + v * 16 : NULL, *bi = bias ? bias + v * 16 : NULL;
        const uint16_t *gs = gscale ? gscale + v * 16 : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            if (grouped) GCASES_AVX2(1)
            else GCASES_AVX2(0)
        }
    }
}

#define ACASE(mt, nb, st) case (mt) * 8 + (nb): \
    pass_avx2(x, mt, K, wp, st, nb, vstride, scale, bias, y, N, valid, group, gscale, gstride, xsum); break;
#define ACASES(st) switch (mt * 8 + nb) { \
    ACASE(1, 4, st) ACASE(1, 3, st) ACASE(1, 2, st) ACASE(1, 1, st) ACASE(2, 2, st) ACASE(2, 1, st) ACASE(3, 1, st) \
    ACASE(4, 1, st) ACASE(5, 1, st) ACASE(6, 1, st) default: break; }

static void pass_avx2_any(const float *x, int mt, int64_t K, const void *wp, int storage, int nb, int vstride,
                          const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N, int64_t valid,
                          int64_t group, const uint16_t *gscale, int64_t gstride, const float *xsum) {
    if (storage == W_BF16) ACASES(W_BF16)
    else if (storage == W_INT8) ACASES(W_INT8)
    else ACASES(W_INT4)
}

// Rows x[0..M) against blocks [vb, ve) of a panel of nv blocks (the whole panel, or a thread's share of it): one row
// over up to the whole panel (one stream, in order; int4's group sums then spill a few of the 16 accumulators, which
// ran 1.07x faster than two passes over half the panel); two rows over 2 blocks at a time; more over one block at a
// time, up to max_rows per pass (bf16 5, int8 MT_AVX2, int4 3: its group sums double the accumulators).
static void panel_avx2(const float *x, int64_t M, int64_t K, const void *wp, int storage, int nv, int vb, int ve,
                       const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N, int64_t valid,
                       int64_t group, const uint16_t *gscale, int64_t gstride, const float *xsum) {
    float *wb = M >= GEMM_ROWS_AVX2 ? gemm_buffer((size_t)(K * 16)) : NULL;
    if (wb) {  // (without its buffer, the passes: the same bits)
        gemm_panel_avx2(x, M, K, wp, storage, nv, vb, ve, scale, bias, y, N, valid, group, gscale, gstride, xsum, wb);
        return;
    }
    // bf16 up to 5 rows a pass (6 rows as 3 + 3, 11 as 4 + 4 + 3: 4-9% faster than 6 and 6 + 5 on the Zen 3 VM; int8,
    // bound by its conversions, ran 12-17% slower at 6 rows as 3 + 3 than as one pass)
    const int grouped = storage == W_INT4, max_rows = grouped ? 3 : storage == W_BF16 ? 5 : MT_AVX2;
    for (int64_t m0 = 0; m0 < M;) {
        // as few passes as max_rows allows, of even size: 8 rows as 4 + 4, not 5 + 3 or 6 + 2 (bf16 7-11% faster at
        // 7-9 rows than 6 + 1 .. 6 + 3, int8 1-3%: each pass decodes the weights once, and a short one keeps too few
        // FMAs busy)
        const int64_t left = M - m0, passes = (left + max_rows - 1) / max_rows;
        const int mt = (int)((left + passes - 1) / passes);
        const int want = mt == 1 ? 4 : mt == 2 && !grouped ? 2 : 1;
        for (int v0 = vb; v0 < ve; v0 += want) {
            const int nb = ve - v0 < want ? ve - v0 : want;
            const int64_t vv = valid - v0 * 16;
            if (vv <= 0) break;
            pass_avx2_any(x + m0 * K, mt, K, (const char *)wp + v0 * block_bytes(storage), storage, nb, nv,
                          scale ? scale + v0 * 16 : NULL, bias ? bias + v0 * 16 : NULL, y + m0 * N + v0 * 16, N,
                          vv, group, gscale ? gscale + v0 * 16 : NULL, gstride,
                          xsum ? xsum + m0 * (K / group) : NULL);
        }
        m0 += mt;
    }
}

// Rows [m0, m0 + rows) of x (float32) against blocks [vb, ve) of panel p
static void item_avx2(const float *xf, int64_t m0, int64_t rows, int64_t K, const void *wp, int storage, int64_t n16,
                      int64_t p, int vb, int ve, const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N,
                      int64_t group, const uint16_t *gscale, const float *xsum) {
    const int64_t n0 = p * PANEL, width = n16 - n0 < PANEL ? n16 - n0 : PANEL;
    const int64_t valid = N - n0 < width ? N - n0 : width, ng = storage == W_INT4 ? K / group : 0;
    panel_avx2(xf + m0 * K, rows, K, panel_at(wp, storage, n0, K), storage, (int)(width / 16), vb, ve,
               scale ? scale + n0 : NULL, bias ? bias + n0 : NULL, y + m0 * N + n0, N, valid, group,
               storage == W_INT4 ? gscale + n0 * ng : NULL, width, xsum ? xsum + m0 * ng : NULL);
}

// bf16_linear's and bf16_linear_int4's work on AVX2: 16-output blocks x chunks of M_CHUNK rows, an equal run of them
// per thread. Chunks of up to GEMM_ROWS_AVX2 rows run the passes, which decode each weight once per pass of up to 5
// (int8: 6, int4: 3) rows; bigger ones the GEMM over float32 blocks. Both give the same bits.
static int run_avx2(const uint16_t *x, int64_t M, int64_t K, const void *wp, int storage, const uint16_t *scale,
                    const uint16_t *bias, int64_t N, uint16_t *y, int nthreads, int64_t group, const uint16_t *gscale) {
    if (M > X_ROWS_AVX2) {  // x in float32 a block of rows at a time: the buffer kept stays small at prefill sizes
        for (int64_t m0 = 0; m0 < M; m0 += X_ROWS_AVX2) {
            const int rc = run_avx2(x + m0 * K, M - m0 < X_ROWS_AVX2 ? M - m0 : X_ROWS_AVX2, K, wp, storage, scale,
                                    bias, N, y + m0 * N, nthreads, group, gscale);
            if (rc) return rc;
        }
        return 0;
    }
    const int64_t n16 = (N + 15) / 16 * 16, chunks = (M + M_CHUNK - 1) / M_CHUNK;
    const int64_t ng = storage == W_INT4 ? K / group : 0;
    float *xf = x_float_buffer((size_t)(M * K + M * ng));
    if (!xf) return 2;
    int64_t e = 0;
    for (; e + 8 <= M * K; e += 8) _mm256_storeu_ps(xf + e, bf16x8_to_ps(x + e));  // (a scalar loop was ~10% of
    for (; e < M * K; e++) xf[e] = bf16_to_f(x[e]);                               // a 192-row GEMM call)
    float *xsum = ng ? xf + M * K : NULL;
    for (int64_t i = 0; i < M * ng; i++) xsum[i] = group_sum(xf + i * group, group);
    // Units of 16 outputs (unit_item; at 8 rows SmolLM2's 576-output layers ran 1.63-1.77x faster on two threads
    // than on one as whole panels, 1.84-1.94x as units)
    const int64_t nblk = n16 / 16, units = chunks * nblk;
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num(), end = units * (t + 1) / T;
        for (int64_t u = units * t / T; u < end;) {
            const struct unit_item it = unit_item(u, end, nblk, chunks);
            const int64_t m0 = it.c * M_CHUNK, rows = (m0 + M_CHUNK < M ? m0 + M_CHUNK : M) - m0;
            item_avx2(xf, m0, rows, K, wp, storage, n16, it.p, (int)it.vb, (int)it.ve, scale, bias, y, N, group,
                      gscale, xsum);
            u += it.ve - it.vb;
        }
    }
    return 0;
}
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX: the same VNNI-pair panels are already the layout of an AMX B tile. A tile of 16 pair rows x 16 outputs
// x 2 starts at panel + (k / 2) * width * 2 + v * 32 with a row stride of width * 4 bytes, so the weight is packed
// once for both kernels. Each thread multiplies blocks of 32 rows x 32 outputs: two A tiles (16 rows x 32 k of
// x) by two B tiles into four float32 C tiles, and one tdpbf16ps does 16 x 16 x 32 products where vdpbf16ps
// does 16 x 2. packed_linear.py's AMX_MIN_ROWS picks it by rows: bf16 from one row (at one row both kernels read
// the weight at the same speed, past that the VNNI kernel is bound by vdpbf16ps), int8 from 5 rows (its
// panels are widened to bf16 first), int4 from 6 rows (its panels dequantized to bf16 first, as past
// WIDEN_ROWS_INT4 rows; below 6 rows the int4 passes' exact products are faster than the dequantizing; both
// measured against the float32 passes, which every CPU with AMX runs, being Intel's). Past ~512 rows oneDNN's
// own AMX kernels are 1.3-1.5x faster per call (docs/BENCHMARKS.md, "AMX"); a contiguous copy of x's tiles, k
// blocking for L1 and row blocks for L2 were tried and did not pay.
#include "native_amx.h"

#define AMX_ROWS 16  // rows of an A and a C tile
#define AMX_K 32     // bf16 of k per A tile row (64 bytes)

int bf16_linear_amx_available(void) { return amx_request(); }

// Tiles 0-3: C (rows a0, a0, a1, a1 x 16 float32); 4, 5: A (a0 and a1 rows x 32 bf16); 6, 7: B (16 pair rows x 32
// bf16). a1 == 0 leaves the second row tile unused.
static void amx_configure(int a0, int a1) {
    int rows[8] = {a0, a0, a1, a1, a0, a1, AMX_K / 2, AMX_K / 2};
    if (a1 < 0) rows[2] = rows[3] = a0, rows[5] = AMX_K / 2;  // amx_block4: four C tiles of a0 rows, three B tiles
    amx_load_config(rows);
}

// C tile t (rows x 16 float32, in c) * scale + bias -> y rows, `valid` of the 16 outputs.
static void amx_store(const float *c, int rows, const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N,
                      int64_t valid) {
    const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
    const __m512 s = scale ? load_bf16x16(scale, mask) : _mm512_set1_ps(1.f);
    const __m512 b = bias ? load_bf16x16(bias, mask) : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++)
        _mm256_mask_storeu_epi16(y + m * N, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_loadu_ps(c + 16 * m), s, b)));
}

// Rows x[0..a0 + a1) against outputs v and v + 1 (two == 0: v only) of one bf16 panel of `width` outputs.
// Inlined with constant `two` and `pair` (a1 > 0) so the tile numbers are immediates.
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, int a0, int a1, const int pair,
                                                            int64_t K, const uint16_t *w, int64_t width, int v,
                                                            const int two, const uint16_t *scale,
                                                            const uint16_t *bias, uint16_t *y, int64_t N,
                                                            int64_t valid) {
    _tile_zero(0); _tile_zero(1);
    if (pair) { _tile_zero(2); _tile_zero(3); }
    const int64_t xs = K * 2, ws = width * 4;
    for (int64_t k = 0; k < K; k += AMX_K) {
        _tile_loadd(4, x + k, xs);
        if (pair) _tile_loadd(5, x + AMX_ROWS * K + k, xs);
        const uint16_t *wk = w + (k / 2) * width * 2 + v * 32;
        _tile_loadd(6, wk, ws);
        _tile_dpbf16ps(0, 4, 6);
        if (pair) _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, wk + 32, ws);
            _tile_dpbf16ps(1, 4, 7);
            if (pair) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float c[AMX_ROWS * 16] __attribute__((aligned(64)));
    for (int t = 0; t < (two ? 2 : 1); t++) {
        const int64_t left = valid - (v + t) * 16;
        if (left <= 0) break;
        const uint16_t *st = scale ? scale + (v + t) * 16 : NULL, *bt = bias ? bias + (v + t) * 16 : NULL;
        if (t == 0) _tile_stored(0, c, 64); else _tile_stored(1, c, 64);
        amx_store(c, a0, st, bt, y + (v + t) * 16, N, left);
        if (pair) {
            if (t == 0) _tile_stored(2, c, 64); else _tile_stored(3, c, 64);
            amx_store(c, a1, st, bt, y + AMX_ROWS * N + (v + t) * 16, N, left);
        }
    }
}

// Rows x[0..a0) (a0 <= 16) against a whole 64-output panel: four C tiles, so each k step reads its 16 pair rows
// of 256 bytes whole and in order (amx_block's two passes over a panel each read half of every row).
static void amx_block4(const uint16_t *x, int a0, int64_t K, const uint16_t *w, const uint16_t *scale,
                       const uint16_t *bias, uint16_t *y, int64_t N, int64_t valid) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const int64_t ws = PANEL * 4;
    for (int64_t k = 0; k < K; k += AMX_K) {
        _tile_loadd(4, x + k, K * 2);
        const uint16_t *wk = w + (k / 2) * PANEL * 2;
        for (int r = 0; r < 64; r++) _mm_prefetch((const char *)wk + PF_AMX + r * 64, _MM_HINT_T0);  // a k step ahead
        _tile_loadd(5, wk, ws);
        _tile_loadd(6, wk + 32, ws);
        _tile_loadd(7, wk + 64, ws);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, wk + 96, ws);
        _tile_dpbf16ps(3, 4, 5);
    }
    float c[AMX_ROWS * 16] __attribute__((aligned(64)));
    for (int t = 0; t < NV; t++) {
        const int64_t left = valid - t * 16;
        if (left <= 0) break;
        if (t == 0) _tile_stored(0, c, 64);
        else if (t == 1) _tile_stored(1, c, 64);
        else if (t == 2) _tile_stored(2, c, 64);
        else _tile_stored(3, c, 64);
        amx_store(c, a0, scale ? scale + t * 16 : NULL, bias ? bias + t * 16 : NULL, y + t * 16, N, left);
    }
}

// One work item on AMX tiles: rows x[m0..m_end) against one bf16 panel, in blocks of 32 rows x 32 outputs, or, for
// up to 16 rows of a whole panel, one block of all 64 outputs (amx_block4: decode reads the panel once, in order).
// conf holds the rows this thread's tiles are configured for ({-1, -1} before its first item; a1 -1: amx_block4's).
static void amx_item(const uint16_t *x, int64_t m0, int64_t m_end, int64_t K, const uint16_t *w, int64_t width,
                     int64_t valid, const uint16_t *scale, const uint16_t *bias, uint16_t *y, int64_t N, int conf[2]) {
    for (; m0 < m_end; m0 += 2 * AMX_ROWS) {
        const int64_t rows = m_end - m0 < 2 * AMX_ROWS ? m_end - m0 : 2 * AMX_ROWS;
        const int a0 = rows < AMX_ROWS ? (int)rows : AMX_ROWS, a1 = (int)rows - a0;
        if (!a1 && width == PANEL) {
            if (a0 != conf[0] || conf[1] != -1) amx_configure(a0, -1), conf[0] = a0, conf[1] = -1;
            amx_block4(x + m0 * K, a0, K, w, scale, bias, y + m0 * N, N, valid);
            continue;
        }
        if (a0 != conf[0] || a1 != conf[1]) amx_configure(a0, a1), conf[0] = a0, conf[1] = a1;
        const uint16_t *xm = x + m0 * K;
        uint16_t *ym = y + m0 * N;
        for (int v = 0; v < width / 16; v += 2) {
            const int two = v + 1 < width / 16;
            if (a1 && two) amx_block(xm, a0, a1, 1, K, w, width, v, 1, scale, bias, ym, N, valid);
            else if (a1) amx_block(xm, a0, a1, 1, K, w, width, v, 0, scale, bias, ym, N, valid);
            else if (two) amx_block(xm, a0, 0, 0, K, w, width, v, 1, scale, bias, ym, N, valid);
            else amx_block(xm, a0, 0, 0, K, w, width, v, 0, scale, bias, ym, N, valid);
        }
    }
}
#define HAVE_AMX 1
#else
int bf16_linear_amx_available(void) { return 0; }
#endif

#ifdef __AVX512BF16__
// Rows [m0, m_end) against blocks [vb, ve) of one panel (w: its weights in storage ws, `width` outputs; sp, bp, yp,
// gs: its scales, bias, outputs at row 0 and group scales) in VNNI passes of up to `step` rows (int4 with group
// folds: passes of even size, as few as step allows), or in float32 passes on xf (int8, and bf16 from
// F32_BF16_ROWS, where bf16_linear_set_fma is on; passes of even size too).
static void passes(const uint16_t *x, const float *xf, int64_t m0, int64_t m_end, int64_t K, const void *w, int ws,
                   int64_t width, int64_t vb, int64_t ve, const uint16_t *sp, const uint16_t *bp, uint16_t *yp,
                   int64_t N, int64_t valid, int grouped, int step, int64_t group, const uint16_t *gs) {
    const int64_t off = vb * 16;
    const int nv = (int)(ve - vb), vstride = (int)(width / 16);
    w = (const char *)w + vb * block_bytes(ws), yp += off, valid -= off;
    sp = sp ? sp + off : NULL, bp = bp ? bp + off : NULL, gs = gs ? gs + off : NULL;
    for (int64_t m = m0, mt; m < m_end; m += mt) {
        const int64_t left = m_end - m, count = (left + step - 1) / step;
        mt = grouped || xf ? (left + count - 1) / count : (left < step ? left : step);
        if (grouped)
            panel_int4(x + m * K, xf ? xf + m * K : NULL, (int)mt, K, (const uint8_t *)w, nv, vstride, bp,
                       yp + m * N, N, valid, group, gs, width);
        else if (xf)
            panel_f32(xf + m * K, (int)mt, K, w, ws, nv, vstride, sp, bp, yp + m * N, N, valid);
        else
            panel(x + m * K, (int)mt, K, w, ws, nv, vstride, sp, bp, yp + m * N, N, valid);
    }
}

// The work both paths share. Where the weights are read as they are (the passes: bf16 off AMX, int8 up to
// WIDEN_ROWS rows or at any in float32 passes, int4 up to bf16_linear_int4_widen_rows), units of 16 outputs x
// M_CHUNK rows, an equal run per thread (unit_item). Where each int8 or int4 panel is widened to bf16 once per item
// (`widen`), or multiplied on AMX tiles (`amx`), items of a whole panel x `chunk` rows over the threads, so a panel
// is widened once and its tiles are whole.
static int run(const uint16_t *x, int64_t M, int64_t K, const void *wp, int storage, const uint16_t *scale,
               const uint16_t *bias, int64_t N, uint16_t *y, int nthreads, int amx, int64_t group,
               const uint16_t *gscale) {
    // float32 passes (bf16_linear_set_fma, off AMX): int8 and int4 at every row count, bf16 from F32_BF16_ROWS;
    // x in float32 X_ROWS_F32 rows at a time, so that the buffer kept stays small at prefill sizes
    const int f32 = fma_passes && !amx && (storage != W_BF16 || M >= F32_BF16_ROWS);
    if (f32 && M > X_ROWS_F32) {
        for (int64_t m0 = 0; m0 < M; m0 += X_ROWS_F32) {
            const int rc = run(x + m0 * K, M - m0 < X_ROWS_F32 ? M - m0 : X_ROWS_F32, K, wp, storage, scale, bias, N,
                               y + m0 * N, nthreads, amx, group, gscale);
            if (rc) return rc;
        }
        return 0;
    }
    const int64_t chunk = amx ? AMX_ITEM : M_CHUNK;
    const int64_t n16 = (N + 15) / 16 * 16, panels = (n16 + PANEL - 1) / PANEL, chunks = (M + chunk - 1) / chunk;
    // int8 and int4 panels widened to bf16 once per item: on AMX tiles, and past a number of rows (int8 not in
    // float32 passes, whose conversion costs what a widened panel's does)
    const int widen = storage != W_BF16 && (amx || (storage == W_INT4 ? M > bf16_linear_int4_widen_rows()
                                                                        : !f32 && M > WIDEN_ROWS));
    const int grouped = storage == W_INT4 && !widen;  // a dequantized int4 panel needs no group folds
    const int step = grouped ? (f32 ? MT_INT4_F32 : MT_GROUPED) : f32 ? MT_F32 : MT;
    const int64_t ng = storage == W_INT4 ? K / group : 0;
    if (storage == W_INT4) i4_table_init();
    const float *xf = NULL;  // x in float32 for the float32 passes
    if (f32) {
        float *buf = x_float_buffer((size_t)(M * K));
        if (!buf) return 2;
        for (int64_t i = 0; i < M * K; i++) buf[i] = bf16_to_f(x[i]);
        xf = buf;
    }
    if (!widen && !amx) {
        const int64_t nblk = n16 / 16, units = chunks * nblk;
        #pragma omp parallel num_threads(nthreads)
        {
            const int64_t T = omp_get_num_threads(), t = omp_get_thread_num(), end = units * (t + 1) / T;
            for (int64_t u = units * t / T; u < end;) {
                const struct unit_item it = unit_item(u, end, nblk, chunks);
                const int64_t n0 = it.p * PANEL, width = n16 - n0 < PANEL ? n16 - n0 : PANEL;
                const int64_t m0 = it.c * chunk, m_end = m0 + chunk < M ? m0 + chunk : M;
                passes(x, xf, m0, m_end, K, panel_at(wp, storage, n0, K), storage, width, it.vb, it.ve,
                       scale ? scale + n0 : NULL, bias ? bias + n0 : NULL, y + n0, N,
                       N - n0 < width ? N - n0 : width, grouped, step, group, grouped ? gscale + n0 * ng : NULL);
                u += it.ve - it.vb;
            }
        }
        return 0;
    }
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        uint16_t *buf = widen ? thread_buffer((size_t)(PANEL * K)) : NULL;
        int64_t held = -1;  // the panel in buf
#ifdef HAVE_AMX
        int conf[2] = {-1, -1};  // the rows this thread's tiles are configured for
#endif
        failed = widen && !buf;
        #pragma omp for collapse(2) schedule(static)
        for (int64_t p = 0; p < panels; p++)
            for (int64_t c = 0; c < chunks; c++) {
                if (failed) continue;
                const int64_t n0 = p * PANEL, width = n16 - n0 < PANEL ? n16 - n0 : PANEL;
                const int64_t valid = N - n0 < width ? N - n0 : width;
                const int64_t m_end = (c + 1) * chunk < M ? (c + 1) * chunk : M;
                const void *w = panel_at(wp, storage, n0, K);
                int ws = storage;
                if (widen) {
                    if (held != p) {
                        if (storage == W_INT4)
                            widen_panel_int4((const uint8_t *)w, width, K, gscale + n0 * ng, width, group, buf);
                        else widen_panel((const int8_t *)w, width * K, buf);
                    }
                    held = p, w = buf, ws = W_BF16;
                }
                const uint16_t *sp = scale ? scale + n0 : NULL, *bp = bias ? bias + n0 : NULL;
#ifdef HAVE_AMX
                if (amx) {
                    amx_item(x, c * chunk, m_end, K, (const uint16_t *)w, width, valid, sp, bp, y + n0, N, conf);
                    continue;
                }
#endif
                passes(x, xf, c * chunk, m_end, K, w, ws, width, 0, width / 16, sp, bp, y + n0, N, valid, 0, step, 0,
                       NULL);
            }
#ifdef HAVE_AMX
        if (conf[0] >= 0) _tile_release();
#endif
    }
    return failed ? 2 : 0;
}
#endif

// `int8`: wp holds int8 weights (scale required), else bf16 (scale optional). An int8 weight is converted to
// bf16 per pass over a panel (MT rows). Past WIDEN_ROWS rows, each thread converts an int8 panel once into its
// own buffer and runs the passes in bf16 instead (measured: slower than converting per pass up to 16 rows,
// faster past that).
// Returns 0; 1 where this build has no AVX512-BF16 (the caller keeps its other path); 2 when out of memory.
int bf16_linear(const uint16_t *x, int64_t M, int64_t K, const void *wp, int int8, const uint16_t *scale,
                const uint16_t *bias, int64_t N, uint16_t *y, int nthreads) {
#ifdef __AVX512BF16__
    return run(x, M, K, wp, int8 ? W_INT8 : W_BF16, scale, bias, N, y, nthreads, 0, 0, NULL);
#elif defined(HAVE_AVX2_PASSES)
    return run_avx2(x, M, K, wp, int8 ? W_INT8 : W_BF16, scale, bias, N, y, nthreads, 0, NULL);
#else
    (void)x; (void)M; (void)K; (void)wp; (void)int8; (void)scale; (void)bias; (void)N; (void)y; (void)nthreads;
    return 1;
#endif
}

// bf16_linear's contract on AMX tiles; K a multiple of 32 (the caller checks). int8 panels are widened to bf16
// once per work item. Returns 1 where the CPU, compiler or OS lends no AMX.
int bf16_linear_amx(const uint16_t *x, int64_t M, int64_t K, const void *wp, int int8, const uint16_t *scale,
                    const uint16_t *bias, int64_t N, uint16_t *y, int nthreads) {
#ifdef HAVE_AMX
    if (bf16_linear_amx_available() && K % AMX_K == 0)
        return run(x, M, K, wp, int8 ? W_INT8 : W_BF16, scale, bias, N, y, nthreads, 1, 0, NULL);
#else
    (void)x; (void)M; (void)K; (void)wp; (void)int8; (void)scale; (void)bias; (void)N; (void)y; (void)nthreads;
#endif
    return 1;
}

// W4A16: y[M, N] = x[M, K] @ ((q - 8) * s)^T + bias, the int4 panels and group scales of the header comment;
// group even, dividing K. Past WIDEN_ROWS_INT4 rows each panel is dequantized to bf16 once per work item.
// Returns as bf16_linear, and 3 where the group does not fit K.
int bf16_linear_int4(const uint16_t *x, int64_t M, int64_t K, const uint8_t *wp, const uint16_t *gscale, int64_t group,
                     const uint16_t *bias, int64_t N, uint16_t *y, int nthreads) {
#if defined(__AVX512BF16__) || defined(HAVE_AVX2_PASSES)
    if (group <= 0 || group % 2 || K % group) return 3;
#ifdef __AVX512BF16__
    return run(x, M, K, wp, W_INT4, NULL, bias, N, y, nthreads, 0, group, gscale);
#else
    return run_avx2(x, M, K, wp, W_INT4, NULL, bias, N, y, nthreads, group, gscale);
#endif
#else
    (void)x; (void)M; (void)K; (void)wp; (void)gscale; (void)group; (void)bias; (void)N; (void)y; (void)nthreads;
    return 1;
#endif
}

// bf16_linear_int4's contract on AMX tiles: each panel dequantized to bf16 once per work item (as past
// WIDEN_ROWS_INT4 rows), then AMX tiles; K a multiple of 32. Returns 1 where the CPU, compiler or OS lends no AMX.
int bf16_linear_int4_amx(const uint16_t *x, int64_t M, int64_t K, const uint8_t *wp, const uint16_t *gscale,
                         int64_t group, const uint16_t *bias, int64_t N, uint16_t *y, int nthreads) {
#ifdef HAVE_AMX
    if (group <= 0 || group % 2 || K % group) return 3;
    if (bf16_linear_amx_available() && K % AMX_K == 0)
        return run(x, M, K, wp, W_INT4, NULL, bias, N, y, nthreads, 1, group, gscale);
#else
    (void)x; (void)M; (void)K; (void)wp; (void)gscale; (void)group; (void)bias; (void)N; (void)y; (void)nthreads;
#endif
    return 1;
}
