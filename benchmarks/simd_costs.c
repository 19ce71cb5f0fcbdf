// What one 512-bit vector instruction costs on this CPU, in ns per instruction at full throughput (independent
// chains, registers only): why bf16_linear.c's int8 and int4 passes multiply in float32 FMAs on Intel cores
// (Bf16LinearKernel.fma) and keep vdpbf16ps elsewhere. Needs AVX512-BF16 and VBMI.
//
//     cc -O2 -march=native benchmarks/simd_costs.c -o /tmp/simd_costs && /tmp/simd_costs
//
// A pair line runs the two instructions interleaved: if they share no port, it costs about the slower one.
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define N 50000000L
#define X8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
#define X16(op) X8(op) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15)
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", \
                "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31"
#define RUN(name, per_loop, body)                                                                  \
    do {                                                                                           \
        long n = N;                                                                                \
        double t = now();                                                                          \
        __asm__ volatile("movl $0x3f803f80, %%eax\n\t" "vpbroadcastd %%eax, %%zmm24\n\t"            \
                         "vmovdqa64 %%zmm24, %%zmm25\n\t" "1:\n\t" body "dec %0\n\t" "jnz 1b"          \
                         : "+r"(n) : : "eax", CLOBBER);                                            \
        t = now() - t;                                                                             \
        printf("%-34s %.3f ns\n", name, t / N / (per_loop) * 1e9);                                 \
    } while (0)

// sixteen independent destinations zmm0..zmm15 (a chain each: more than any latency here needs), sources zmm24
// and zmm25 (each 32-bit lane 0x3f803f80: bf16 pairs of 1, about 1 as float32); a pair's second instruction
// writes zmm10..zmm17
#define DPBF16(i) "vdpbf16ps %%zmm24, %%zmm25, %%zmm" #i "\n\t"
#define FMA(i) "vfmadd231ps %%zmm24, %%zmm25, %%zmm" #i "\n\t"
#define PERMW(i) "vpermw %%zmm24, %%zmm25, %%zmm" #i "\n\t"
#define PERMPS(i) "vpermps %%zmm24, %%zmm25, %%zmm" #i "\n\t"
#define PSHUFB(i) "vpshufb %%zmm24, %%zmm25, %%zmm" #i "\n\t"
#define SRLVW(i) "vpsrlvw %%zmm24, %%zmm25, %%zmm" #i "\n\t"
#define MOVZX(i) "vpmovzxbd %%xmm24, %%zmm" #i "\n\t"
#define CVT(i) "vcvtdq2ps %%zmm24, %%zmm" #i "\n\t"
#define DP_PERMW(i) "vdpbf16ps %%zmm24, %%zmm25, %%zmm" #i "\n\t" "vpermw %%zmm24, %%zmm25, %%zmm1" #i "\n\t"
#define FMA_PERMPS(i) "vfmadd231ps %%zmm24, %%zmm25, %%zmm" #i "\n\t" "vpermps %%zmm24, %%zmm25, %%zmm1" #i "\n\t"

int main(void) {
    RUN("vdpbf16ps (32 products)", 16, X16(DPBF16));
    RUN("vfmadd231ps (16 products)", 16, X16(FMA));
    RUN("vpermw", 16, X16(PERMW));
    RUN("vpermps", 16, X16(PERMPS));
    RUN("vpshufb", 16, X16(PSHUFB));
    RUN("vpsrlvw", 16, X16(SRLVW));
    RUN("vpmovzxbd", 16, X16(MOVZX));
    RUN("vcvtdq2ps", 16, X16(CVT));
    RUN("vdpbf16ps + vpermw (a pair)", 8, X8(DP_PERMW));
    RUN("vfmadd231ps + vpermps (a pair)", 8, X8(FMA_PERMPS));
    return 0;
}
