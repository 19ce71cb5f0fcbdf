// AMX tile state for our C kernels (bf16_linear.c, prefill_attention.c): the tile configuration's layout and the one
// request Linux wants before a process may use the tiles (define _GNU_SOURCE before any include, for syscall()).
// llmopt/native.py hashes this file into each build's key.
#ifndef LLMOPT_NATIVE_AMX_H
#define LLMOPT_NATIVE_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Linux lends the AMX tile state only to a process that asks once; 1 when granted (or granted before).
static inline int amx_request(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}
#endif
#endif
