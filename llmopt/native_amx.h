// AMX tile state for our C kernels (bf16_linear.c, prefill_attention.c): the tile configuration and the one
// request Linux wants before a process may use the tiles (define _GNU_SOURCE before any include, for syscall()).
// llmopt/native.py hashes this file into each build's key.
#ifndef LLMOPT_NATIVE_AMX_H
#define LLMOPT_NATIVE_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Configure tiles 0-7 with rows[t] rows of 64 bytes each (0: tile t unused), palette 1.
static inline void amx_load_config(const int rows[8]) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = (uint8_t)rows[t], c.colsb[t] = rows[t] ? 64 : 0;
    _tile_loadconfig(&c);
}

// Linux lends the AMX tile state only to a process that asks once; 1 when granted (or granted before).
static inline int amx_request(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}
#endif
#endif
