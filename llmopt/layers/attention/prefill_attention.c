// Causal prefill attention over bf16 K/V on AMX tiles (flash attention: blocks of 32 queries, an online softmax in
// float32 over up to 128 keys a step). Built and loaded by prefill_attention_kernel.py; head_major.py runs it for
// prefill chunks on a CPU with amx_bf16 (a chunk's own K/V, or a cached context gathered before it), where torch's
// flash SDPA was a third of a 2,048-token SmolLM2 prefill (docs/BENCHMARKS.md, "Prefill attention on AMX tiles").
//
// Layout: K and V of each KV head are packed once per call as AMX B tiles, padded to whole blocks of 32 keys with
// zeros: for S = Q K^T a tile row holds 16 keys' pairs of dimensions, kp[block][d / 2][32 keys]; for O = P V a tile
// row holds 16 dimensions' pairs of keys, vp[block][key / 2][D]. A query block is copied to a contiguous buffer (zeros
// past the chunk's end); its scores come from 2 x 2 C tiles per block of keys; the softmax runs in AVX-512 (in log2
// units, exp2_f32x16); P is rounded to bf16 (as torch's CPU flash attention rounds it for its second matmul); O
// accumulates in float32 tiles loaded from and stored to a per-thread buffer once a step, rescaled in place by each
// row's change of maximum.
//
// Work items are (query head, query block), the costly late blocks first; threads take them dynamically. Query head
// h reads KV head h / (H / Hkv) (grouped-query attention). `window` > 0: the query at position p sees keys
// p - window + 1 .. p.
//
// prefill_attention_fma: the same flash attention in AVX-512 float32 FMAs, for CPUs with AVX512-BF16 and no AMX
// tiles, where the chunks ran a torch.compile'd function (docs/BENCHMARKS.md, "Prefill attention in float32
// FMAs"). K and V are widened to float32 once per call (K as kt[block][d][32 keys], V as [key][D]); blocks of 12
// queries take their scores 32 keys at a time in 12 x 2 accumulators, P stays float32 (no bf16 rounding before
// P V), and O accumulates 6 rows x 64 dimensions at a time in registers.
#define _GNU_SOURCE  // syscall() in native_amx.h
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_amx.h"
#include "native_bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_AVX512_PREFILL 1
#define MAX_DIM 256   // head sizes the per-thread buffers are sized for
#define NEG (-1e30f)  // "minus infinity" that -ffast-math may not assume away; masked lanes are zeroed, not exp'd

// 2^x for x <= 0, 16 at a time, to within 1e-5 relative (x = n + f, |f| <= 1/2, 2^f by a degree-4 polynomial
// fitted on [-1/2, 1/2] by least squares, 7e-6 at worst; 2^n by vscalefps, which underflows to 0). P is rounded to
// bf16 (2^-9) before it multiplies V, so exp_f32x16's float32 precision bought nothing here and cost 10-15% of the
// kernel's time (torch's CPU flash attention takes a cheaper exp for the same reason). Scores are kept in log2 units
// (scale x log2 e folded in).
static inline __m512 exp2_f32x16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.67077e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.587557e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022212e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312726e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// Key k0 + 16 j + lane is seen by query t where it is <= t and, with a window, > t - window.
static inline __mmask16 seen(int64_t k0, int j, int64_t t, int64_t window) {
    const __m512i n = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                       _mm512_set1_epi32((int)(k0 + 16 * j)));
    __mmask16 ok = _mm512_cmple_epi32_mask(n, _mm512_set1_epi32((int)t));
    if (window > 0) ok &= _mm512_cmpgt_epi32_mask(n, _mm512_set1_epi32((int)(t - window)));
    return ok;
}

// The largest of a row's `vecs` x 16 raw scores that query t sees (all of them where `whole`; NEG if none).
static inline __attribute__((always_inline)) float row_max(const float *sr, int vecs, const int whole, int64_t k0,
                                                           int64_t t, int64_t window) {
    const __m512 neg = _mm512_set1_ps(NEG);
    __m512 mx = neg;
    for (int j = 0; j < vecs; j++)
        mx = _mm512_max_ps(mx, whole ? _mm512_loadu_ps(sr + 16 * j)
                                     : _mm512_mask_loadu_ps(neg, seen(k0, j, t, window), sr + 16 * j));
    return _mm512_reduce_max_ps(mx);
}

// The first key a block of queries from position p0 reads, at the start of its 32-key block (0 without a window).
static inline int64_t first_key(int64_t p0, int64_t window) {
    return window > 0 && p0 - window + 1 > 0 ? (p0 - window + 1) / 32 * 32 : 0;
}

// Whether no key of a step's `subs` blocks of 32 from k0 (padding included) is masked for any of the queries at
// positions p0 .. last: the softmax step then reads the scores without masks.
static inline int step_whole(int64_t k0, int subs, int64_t p0, int64_t last, int64_t window) {
    return k0 + 32 * subs - 1 <= p0 && (window <= 0 || k0 > last - window);
}

// Rows 0..rows-1 of O (float32, D a row) divided by their sums (16 partial sums a row in l), as bf16 rows of out.
static inline void store_rows(const float *o, const float *l, int64_t rows, int64_t D, uint16_t *out, int64_t os) {
    for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * r)));
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(out + r * os + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv)));
    }
}

#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)
#define BLOCK 32      // queries per query block; keys per packed block and per A tile of P
#define KEYS 128      // keys per softmax step (up to four packed blocks): one rescale and one pass over O for each

// Every tile 16 rows x 64 bytes: C 16 x 16 float32, A 16 x 32 bf16, B 16 pair rows x 16 columns.
static void configure(void) {
    static const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_load_config(rows);
}

// One KV head's keys and values of key block b as B tiles (zeros past the C keys).
static void pack(const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs, int64_t C, int64_t D, int64_t b,
                 uint32_t *kp, uint32_t *vp) {
    for (int64_t n = 0; n < BLOCK; n++) {
        const int64_t t = b * BLOCK + n;
        const uint32_t *row = (const uint32_t *)(k + t * ks);
        for (int64_t p = 0; p < D / 2; p++) kp[p * BLOCK + n] = t < C ? row[p] : 0;
    }
    for (int64_t j = 0; j < BLOCK / 2; j++) {
        const int64_t t = b * BLOCK + 2 * j;
        const uint16_t *lo = v + t * vs, *hi = v + (t + 1) * vs;
        for (int64_t d = 0; d < D; d++)
            vp[j * D + d] = (t < C ? lo[d] : 0) | (uint32_t)(t + 1 < C ? hi[d] : 0) << 16;
    }
}

typedef struct {
    uint16_t q[BLOCK * MAX_DIM], p[BLOCK * KEYS];
    float s[BLOCK * KEYS], o[BLOCK * MAX_DIM], l[BLOCK * 16], m[BLOCK] __attribute__((aligned(64)));
} scratch_t;

// The online-softmax step of rows 0..rows-1 over `vecs` x 16 raw scores each in w->s (log2 units after x c): P as
// bf16 into w->p, each row's maximum and sum, O rescaled. In passes over the rows (every row's maximum; the
// rescales, 16 rows at a time; then the exponentials) so that no row waits on its own reduction, as one pass per row
// did. `whole` (a constant where inlined): no key masked for any row; else seen() says which, row r being at
// position pos + r.
static inline __attribute__((always_inline)) void softmax_step(scratch_t *w, int64_t rows, int64_t D, int vecs,
                                                               const int whole, int64_t pos, int64_t window,
                                                               int64_t k0, float c) {
    float m_new[BLOCK] __attribute__((aligned(64))), alpha[BLOCK] __attribute__((aligned(64)));
    memcpy(m_new, w->m, sizeof m_new);  // rows past the chunk's end keep theirs
    for (int64_t r = 0; r < rows; r++) {
        const float m_blk = row_max(w->s + r * KEYS, vecs, whole, k0, pos + r, window) * c;
        m_new[r] = m_blk > w->m[r] ? m_blk : w->m[r];
    }
    // each row's rescale 2^(m_old - m_new), 16 rows at a time (a first step's is 2^(NEG - m), 0, against sums
    // that are 0), and what the rows have summed so far rescaled by it
    for (int r = 0; r < BLOCK; r += 16) {
        const __m512 mo = _mm512_load_ps(w->m + r), mn = _mm512_load_ps(m_new + r);
        const __m512 a = exp2_f32x16(_mm512_max_ps(_mm512_sub_ps(mo, mn), _mm512_set1_ps(-200.f)));
        _mm512_store_ps(alpha + r, a);
        _mm512_store_ps(w->m + r, mn);
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        _mm512_storeu_ps(w->l + 16 * r, _mm512_mul_ps(_mm512_loadu_ps(w->l + 16 * r), a));
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(w->o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + r * D + d), a));
    }
    const __m512 cv = _mm512_set1_ps(c);
    for (int64_t r = 0; r < rows; r++) {
        const float *sr = w->s + r * KEYS;
        const __m512 mneg = _mm512_set1_ps(-m_new[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < vecs; j += 2) {
            __m512 p0 = exp2_f32x16(_mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * j), cv, mneg));
            __m512 p1 = exp2_f32x16(_mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * j + 16), cv, mneg));
            if (!whole)
                p0 = _mm512_maskz_mov_ps(seen(k0, j, pos + r, window), p0),
                p1 = _mm512_maskz_mov_ps(seen(k0, j + 1, pos + r, window), p1);
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            _mm512_storeu_ps((float *)(w->p + r * KEYS + 16 * j), (__m512)_mm512_cvtne2ps_pbh(p1, p0));
        }
        _mm512_storeu_ps(w->l + 16 * r, _mm512_add_ps(_mm512_loadu_ps(w->l + 16 * r), sum));
    }
}

// Query block qb of one head against its keys; query t is at position offset + t; out rows at stride os.
static void item(const uint16_t *q, int64_t qs, const uint32_t *kp, const uint32_t *vp, int64_t L, int64_t offset,
                 int64_t D, int64_t qb, int64_t window, float scale, uint16_t *out, int64_t os, scratch_t *w) {
    const int64_t t0 = qb * BLOCK, rows = L - t0 < BLOCK ? L - t0 : BLOCK;
    const int64_t p0 = offset + t0, last = p0 + rows - 1;  // the block's first and last positions
    for (int64_t r = 0; r < BLOCK; r++) {
        if (r < rows) memcpy(w->q + r * D, q + (t0 + r) * qs, (size_t)D * 2);
        else memset(w->q + r * D, 0, (size_t)D * 2);
        w->m[r] = NEG;
    }
    memset(w->o, 0, sizeof(float) * BLOCK * D);
    memset(w->l, 0, sizeof w->l);  // each row's sum, 16 partial sums until the end
    memset(w->p, 0, sizeof w->p);  // rows past the chunk's end stay zero
    const float c = scale * 1.44269504088896341f;  // scores in log2 units
    for (int64_t k0 = first_key(p0, window); k0 <= last; k0 += KEYS) {
        const int64_t kend = k0 + KEYS < last + 1 ? k0 + KEYS : last + 1;
        const int subs = (int)((kend - k0 + BLOCK - 1) / BLOCK), vecs = 2 * subs;
        const int whole = step_whole(k0, subs, p0, last, window);
        for (int b = 0; b < subs; b++) {  // S[:, 32 b ..] = Q K^T for packed block k0 / 32 + b
            const uint32_t *kt = kp + (k0 / BLOCK + b) * (D / 2) * BLOCK;
            float *sb = w->s + b * BLOCK;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t d = 0; d < D; d += 32) {
                _tile_loadd(4, w->q + d, D * 2);
                _tile_loadd(5, w->q + 16 * D + d, D * 2);
                _tile_loadd(6, kt + (d / 2) * BLOCK, BLOCK * 4);
                _tile_loadd(7, kt + (d / 2) * BLOCK + 16, BLOCK * 4);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, sb, KEYS * 4); _tile_stored(1, sb + 16, KEYS * 4);
            _tile_stored(2, sb + 16 * KEYS, KEYS * 4); _tile_stored(3, sb + 16 * KEYS + 16, KEYS * 4);
        }
        if (whole) softmax_step(w, rows, D, vecs, 1, p0, 0, k0, c);
        else softmax_step(w, rows, D, vecs, 0, p0, window, k0, c);
        for (int64_t d = 0; d < D; d += 32) {  // O[:, d .. d + 32) += P V
            float *o = w->o + d;
            _tile_loadd(0, o, D * 4); _tile_loadd(1, o + 16, D * 4);
            _tile_loadd(2, o + 16 * D, D * 4); _tile_loadd(3, o + 16 * D + 16, D * 4);
            for (int b = 0; b < subs; b++) {
                const uint32_t *vt = vp + (k0 / BLOCK + b) * (BLOCK / 2) * D;
                _tile_loadd(4, w->p + b * BLOCK, KEYS * 2);
                _tile_loadd(5, w->p + 16 * KEYS + b * BLOCK, KEYS * 2);
                _tile_loadd(6, vt + d, D * 4);
                _tile_loadd(7, vt + d + 16, D * 4);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, o, D * 4); _tile_stored(1, o + 16, D * 4);
            _tile_stored(2, o + 16 * D, D * 4); _tile_stored(3, o + 16 * D + 16, D * 4);
        }
    }
    store_rows(w->o, w->l, rows, D, out + t0 * os, os);
}
#endif

#ifdef HAVE_AVX512_PREFILL
#define FQ 12       // queries per block of the FMA kernel: its scores take 12 x 2 accumulators
#define FKEYS 128   // keys per softmax step (up to four blocks of 32)
#define OROWS 6     // rows of O per pass of P V: 6 x 4 accumulators over 64 dimensions

typedef struct {
    float q[FQ * MAX_DIM], s[FQ * FKEYS], o[FQ * MAX_DIM], l[FQ * 16] __attribute__((aligned(64)));
    float m[16] __attribute__((aligned(64)));
} fscratch_t;

// One KV head's keys of block b (32 keys) as float32 kt[d][32], and its values as float32 rows [32][D] (zeros past
// the C keys).
static void fpack(const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs, int64_t C, int64_t D, int64_t b,
                  float *kt, float *vt) {
    for (int64_t n = 0; n < 32; n++) {
        const int64_t t = b * 32 + n;
        for (int64_t d = 0; d < D; d++) {
            kt[d * 32 + n] = t < C ? bf16_to_f(k[t * ks + d]) : 0.f;
            vt[n * D + d] = t < C ? bf16_to_f(v[t * vs + d]) : 0.f;
        }
    }
}

// S[:, 0..32) (row stride FKEYS) = Q K^T of the block's FQ rows against one block of 32 keys.
static inline void fscores(const float *q, int64_t D, const float *kt, float *s) {
    __m512 acc[FQ][2];
    for (int r = 0; r < FQ; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * 32), k1 = _mm512_loadu_ps(kt + d * 32 + 16);
        for (int r = 0; r < FQ; r++) {
            const __m512 x = _mm512_set1_ps(q[r * D + d]);
            acc[r][0] = _mm512_fmadd_ps(x, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < FQ; r++) {
        _mm512_storeu_ps(s + r * FKEYS, acc[r][0]);
        _mm512_storeu_ps(s + r * FKEYS + 16, acc[r][1]);
    }
}

// The online-softmax step (as the AMX kernel's, with P kept float32 in place of the scores): each row's new
// maximum, O and the sums rescaled by 2^(m_old - m_new), then P = 2^(S c - m_new), masked where `whole` is 0.
static inline __attribute__((always_inline)) void fsoftmax_step(fscratch_t *w, int64_t rows, int64_t D, int vecs,
                                                                const int whole, int64_t pos, int64_t window,
                                                                int64_t k0, float c) {
    float m_new[16] __attribute__((aligned(64))), alpha[16] __attribute__((aligned(64)));
    memcpy(m_new, w->m, sizeof m_new);
    for (int64_t r = 0; r < rows; r++) {
        const float m_blk = row_max(w->s + r * FKEYS, vecs, whole, k0, pos + r, window) * c;
        m_new[r] = m_blk > w->m[r] ? m_blk : w->m[r];
    }
    const __m512 mo = _mm512_load_ps(w->m), mn = _mm512_load_ps(m_new);
    _mm512_store_ps(alpha, exp2_f32x16(_mm512_max_ps(_mm512_sub_ps(mo, mn), _mm512_set1_ps(-200.f))));
    _mm512_store_ps(w->m, mn);
    const __m512 cv = _mm512_set1_ps(c);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(w->o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + r * D + d), a));
        float *sr = w->s + r * FKEYS;
        const __m512 mneg = _mm512_set1_ps(-m_new[r]);
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(w->l + 16 * r), a);
        for (int j = 0; j < vecs; j++) {
            __m512 e = exp2_f32x16(_mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * j), cv, mneg));
            if (!whole) e = _mm512_maskz_mov_ps(seen(k0, j, pos + r, window), e);
            sum = _mm512_add_ps(sum, e);
            _mm512_storeu_ps(sr + 16 * j, e);
        }
        _mm512_storeu_ps(w->l + 16 * r, sum);
    }
}

// O[r0 .. r0 + OROWS, d0 .. d0 + 16 nv) += P V over n keys (P in w->s, V rows from vt).
static inline __attribute__((always_inline)) void fpv(fscratch_t *w, int r0, int64_t d0, const int nv, int64_t n,
                                                      const float *vt, int64_t D) {
    __m512 acc[OROWS][4];
    for (int r = 0; r < OROWS; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_loadu_ps(w->o + (r0 + r) * D + d0 + 16 * v);
    for (int64_t j = 0; j < n; j++) {
        __m512 vv[4];
        for (int v = 0; v < nv; v++) vv[v] = _mm512_loadu_ps(vt + j * D + d0 + 16 * v);
        for (int r = 0; r < OROWS; r++) {
            const __m512 p = _mm512_set1_ps(w->s[(r0 + r) * FKEYS + j]);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_fmadd_ps(p, vv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < OROWS; r++)
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(w->o + (r0 + r) * D + d0 + 16 * v, acc[r][v]);
}

// Query block qb of one head (FQ rows) against its keys; as the AMX kernel's item().
static void fitem(const uint16_t *q, int64_t qs, const float *kt, const float *vt, int64_t L, int64_t offset,
                  int64_t D, int64_t qb, int64_t window, float scale, uint16_t *out, int64_t os, fscratch_t *w) {
    const int64_t t0 = qb * FQ, rows = L - t0 < FQ ? L - t0 : FQ;
    const int64_t p0 = offset + t0, last = p0 + rows - 1;
    for (int64_t r = 0; r < FQ; r++)
        for (int64_t d = 0; d < D; d++) w->q[r * D + d] = r < rows ? bf16_to_f(q[(t0 + r) * qs + d]) : 0.f;
    for (int r = 0; r < 16; r++) w->m[r] = NEG;
    memset(w->o, 0, sizeof(float) * FQ * D);
    memset(w->l, 0, sizeof w->l);
    const float c = scale * 1.44269504088896341f;  // scores in log2 units
    for (int64_t k0 = first_key(p0, window); k0 <= last; k0 += FKEYS) {
        const int64_t kend = k0 + FKEYS < last + 1 ? k0 + FKEYS : last + 1;
        const int subs = (int)((kend - k0 + 31) / 32), vecs = 2 * subs;
        const int whole = step_whole(k0, subs, p0, last, window);
        for (int b = 0; b < subs; b++) fscores(w->q, D, kt + (k0 / 32 + b) * D * 32, w->s + b * 32);
        if (whole) fsoftmax_step(w, rows, D, vecs, 1, p0, 0, k0, c);
        else fsoftmax_step(w, rows, D, vecs, 0, p0, window, k0, c);
        const float *vk = vt + k0 * D;
        for (int r0 = 0; r0 < rows; r0 += OROWS)
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                if (D - d0 >= 64) fpv(w, r0, d0, 4, 32 * subs, vk, D);
                else fpv(w, r0, d0, 2, 32 * subs, vk, D);  // D is a multiple of 32
            }
    }
    store_rows(w->o, w->l, rows, D, out + t0 * os, os);
}
#endif

// Both entry points' arguments, named where a build has neither kernel.
#define UNUSED_ARGS (void)q, (void)qs, (void)k, (void)ks, (void)khs, (void)v, (void)vs, (void)vhs, (void)L, (void)C, \
    (void)H, (void)Hkv, (void)D, (void)window, (void)scale, (void)out, (void)nthreads

#ifdef HAVE_AVX512_PREFILL
// A head size that is not a multiple of 32 up to MAX_DIM, H not a multiple of Hkv, or L past C.
static int bad_shape(int64_t L, int64_t C, int64_t H, int64_t Hkv, int64_t D) {
    return D % 32 || D > MAX_DIM || Hkv <= 0 || H % Hkv || L > C;
}
#endif

// q [L, H, D] at row stride qs (elements; heads contiguous) at positions C - L .. C - 1; k and v [C, Hkv, D] at
// positions 0 .. C - 1, row strides ks and vs, head strides khs and vhs (a chunk's own K/V: rows of the fused
// projection; a cached context: the gathered [Hkv, C, D] blocks); out [L, H * D]. Returns 0; 1 where the CPU,
// compiler or OS lends no AMX; 2 when out of memory; 3 for a head size that is not a multiple of 32 up to 256, H
// not a multiple of Hkv, or L past C.
int prefill_attention(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks, int64_t khs, const uint16_t *v,
                      int64_t vs, int64_t vhs, int64_t L, int64_t C, int64_t H, int64_t Hkv, int64_t D,
                      int64_t window, float scale, uint16_t *out, int nthreads) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)
    if (bad_shape(L, C, H, Hkv, D)) return 3;
    if (!amx_request()) return 1;
    if (L <= 0) return 0;
    const int64_t blocks = (L + BLOCK - 1) / BLOCK, kblocks = (C + BLOCK - 1) / BLOCK;
    const int64_t pairs = kblocks * BLOCK * D / 2;  // a head's K (or V) pairs
    uint32_t *packed = malloc(sizeof(uint32_t) * (size_t)(2 * Hkv * pairs));
    if (!packed) return 2;
    uint32_t *kp = packed, *vp = packed + Hkv * pairs;
    #pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t b = 0; b < kblocks; b++)
            pack(k + g * khs, ks, v + g * vhs, vs, C, D, b, kp + g * pairs + b * BLOCK * D / 2,
                 vp + g * pairs + b * BLOCK * D / 2);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        scratch_t *w = aligned_alloc(64, (sizeof(scratch_t) + 63) / 64 * 64);
        failed = !w;
        if (w) configure();
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < H * blocks; i++) {
            if (!w) continue;
            const int64_t qb = blocks - 1 - i / H, h = i % H, g = h / (H / Hkv);  // the longest items first
            item(q + h * D, qs, kp + g * pairs, vp + g * pairs, L, C - L, D, qb, window, scale, out + h * D, H * D, w);
        }
        if (w) _tile_release();
        free(w);
    }
    free(packed);
    return failed ? 2 : 0;
#else
    UNUSED_ARGS;
    return 1;
#endif
}

// prefill_attention's contract in AVX-512 float32 FMAs (no AMX tiles): returns 0; 1 where this build has no
// AVX512-BF16; 2 when out of memory; 3 for a shape it does not take (as prefill_attention).
int prefill_attention_fma(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks, int64_t khs,
                          const uint16_t *v, int64_t vs, int64_t vhs, int64_t L, int64_t C, int64_t H, int64_t Hkv,
                          int64_t D, int64_t window, float scale, uint16_t *out, int nthreads) {
#ifdef HAVE_AVX512_PREFILL
    if (bad_shape(L, C, H, Hkv, D)) return 3;
    if (L <= 0) return 0;
    const int64_t blocks = (L + FQ - 1) / FQ, kblocks = (C + 31) / 32, per_head = kblocks * 32 * D;
    float *packed = malloc(sizeof(float) * (size_t)(2 * Hkv * per_head));
    if (!packed) return 2;
    float *kt = packed, *vt = packed + Hkv * per_head;
    #pragma omp parallel for collapse(2) num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t b = 0; b < kblocks; b++)
            fpack(k + g * khs, ks, v + g * vhs, vs, C, D, b, kt + g * per_head + b * 32 * D,
                  vt + g * per_head + b * 32 * D);
    int failed = 0;
    #pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        fscratch_t *w = aligned_alloc(64, (sizeof(fscratch_t) + 63) / 64 * 64);
        failed = !w;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < H * blocks; i++) {
            if (!w) continue;
            const int64_t qb = blocks - 1 - i / H, h = i % H, g = h / (H / Hkv);  // the longest items first
            fitem(q + h * D, qs, kt + g * per_head, vt + g * per_head, L, C - L, D, qb, window, scale, out + h * D,
                  H * D, w);
        }
        free(w);
    }
    free(packed);
    return failed ? 2 : 0;
#else
    UNUSED_ARGS;
    return 1;
#endif
}
