// bf16 <-> float32 for our C kernels (llmopt/native.py puts this folder on their include path and hashes
// this file into each build's cache key).
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
#endif
