// bf16 <-> float32 (with AVX2, 8 at a time; with AVX512F, 16; with AVX512-BF16, int8 -> bf16) for our C kernels
// (llmopt/native.py puts this folder on their include path and hashes this file into each build's cache key).
#ifndef LLMOPT_NATIVE_BF16_H
#define LLMOPT_NATIVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);  // NaN stays NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX2__
#include <immintrin.h>

// 8 bf16 as 8 float32, exact: bf16_linear.c's AVX2 passes (x, scales) and paged_decode.c's AVX2 K/V rows.
static inline __m256 bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#ifdef __AVX512F__
#include <immintrin.h>

// 16 bf16 as 16 float32, exact (a bf16 is a float32's upper half): paged_decode.c's K/V rows whole, bf16_linear.c's
// scales and biases through a masked load (AVX512BW) for the last, partial vector of a panel.
static inline __m512 bf16x16_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 bf16x16_to_f32(const uint16_t *p) { return bf16x16_widen(_mm256_loadu_si256((const __m256i *)p)); }
#endif

#ifdef __AVX512BF16__

// 32 int8 weights as 32 bf16, in order (exact: |w| <= 128). The int8 matmuls share it: converting is what
// bounds them at a few rows.
static inline __m512bh int8x32_to_bf16(const int8_t *p) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif
#endif
