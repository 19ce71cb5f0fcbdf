// The decode step's layer loop: one call runs every decoder layer of a bf16 decode step on a CPU, as a flat
// list of ops over persistent buffers, so no Python runs per layer. Built and loaded by decode_step.py.
//
// Why: a decode token of a small model spent ~230 us of Python per layer around ~10 kernel calls
// (docs/BENCHMARKS.md, "Where a token goes"); the kernels were already ours. This file holds no arithmetic of
// its own: each op calls the same kernel the eager path calls (passed in as function pointers from their own
// libraries), on the same inputs, so its output is bit for bit the eager step's. What the step reads per call
// (`step_t`): the rows, the RoPE tables of this step's positions, each KV group's slots and the decode groups'
// block tables. The ops' pointers (weights, pools, buffers) are fixed when the program is built.
#define _POSIX_C_SOURCE 199309L  // clock_gettime
#include <stdint.h>
#include <string.h>
#include <time.h>

#define MAX_KV_GROUPS 4   // KV groups (full + sliding pools) a model may have
#define MAX_ROPE_SETS 2   // RoPE tables per step (Gemma 3: full and sliding layers)
#define DG_FIELDS (2 + 3 * MAX_KV_GROUPS)  // per decode group: rows, lens, then per KV group (table, width, start)

typedef void (*norm_fn)(const uint16_t *, int64_t, const uint16_t *, uint16_t *, const uint16_t *, float, int,
                        uint16_t *, int64_t, int64_t, int);
typedef void (*rotary_fn)(const uint16_t *, int64_t, int64_t, int64_t, const float *, const float *, uint16_t *,
                          int64_t, int);
typedef void (*act_fn)(const uint16_t *, int64_t, int64_t, int, uint16_t *, int);
typedef int (*linear_fn)(const uint16_t *, int64_t, int64_t, const void *, int, const uint16_t *, const uint16_t *,
                         int64_t, uint16_t *, int);
typedef int (*linear4_fn)(const uint16_t *, int64_t, int64_t, const uint8_t *, const uint16_t *, int64_t,
                          const uint16_t *, int64_t, uint16_t *, int);
typedef int (*attend_fn)(const uint16_t *, const void *, const void *, const float *, const float *, int,
                         const int64_t *, int64_t, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, float, uint16_t *, int);
typedef int (*kv_quantize_fn)(const uint16_t *, int64_t, int64_t, int64_t, int64_t, const int64_t *, int,
                              const float *, void *, float *, int64_t);

typedef int (*moe_fn)(const void *, const uint16_t *, int64_t, uint16_t *, int64_t *, int);

typedef struct {  // the kernels, from native_ops.c, bf16_linear.c, paged_decode.c and moe_block.c (moe: NULL where
                  // it cannot be built; then no program holds a MOE op)
    void *norm, *rotary, *act, *linear, *linear_amx, *linear_int4, *linear_int4_amx, *attend, *kv_quantize, *moe;
} kernels_t;

enum { OP_NORM = 0, OP_HEAD_NORM = 1, OP_LINEAR = 2, OP_GATHER_COLS = 3, OP_ROTARY = 4, OP_KV_WRITE = 5,
       OP_ATTEND = 6, OP_ACT = 7, OP_COPY_COLS = 8, OP_MOE = 9 };
#define NUM_OP_KINDS 10

// One op. `a` and `b` are row-major [rows, width] buffers (bf16 unless said); widths and strides in elements.
//   NORM       out = norm(a) over rows of n[1], a's rows n[0] apart; with b: a + b is rounded, written to b
//              (the residual stream, in place) and normalized instead. w = p[0], eps f[0], offset i[0].
//   HEAD_NORM  per row t: n[5] heads of n[1] at a + t * n[0] + n[2] -> out + t * n[3] + n[4] (q/k norms).
//   LINEAR     out [rows, n[1]] = a [rows, n[0]] @ W^T: i[0] 0 bf16 / 1 int8 (p[1] scales) / 2 int4 (p[1] group
//              scales, group n[2]); W = p[0], bias p[2]; AMX from n[3] rows (-1: never).
//   GATHER_COLS out[t][j] = a[t][perm[j]], perm = p[0] (int32), n[0] columns.
//   ROTARY     out [rows, n[1], n[2]] = RoPE(a, rows n[0] apart), with the step's table set i[0].
//   KV_WRITE   K rows of a (n[0] apart) and V rows of b (n[1] apart) into the pools p[0], p[1] ([n[2] heads,
//              n[4] slots, n[3]]) at the slots of KV group i[0]; i[1] 1 / 2: as int8 / fp8 codes, their
//              scales into p[2], p[3] ([n[2], n[4]] float), from the static per-head scales p[4], p[5] if set.
//   ATTEND     out [rows, n[1] * n[3]] = paged decode attention of q = a (rows n[0] apart, copied to the
//              scratch p[2] when not contiguous) over pools p[0], p[1] ([n[2], n[4], n[3]], block size n[5];
//              i[2] 1 / 2: int8 / fp8 codes with scales p[3], p[4]), KV group i[0], window i[1], scale f[0],
//              per decode group of the step.
//   ACT        out [rows, n[0]] = act(gate) * up over a [rows, 2 * n[0]]; i[0] 1: GELU-tanh, 0: SiLU.
//   COPY_COLS  out[t][n[2] + j] = a[t][j] for j < n[0], out's rows n[1] wide (a part of a fused projection
//              into its columns: a ConcatLinear's parts run one by one, as torch.cat joins them).
//   MOE        out [rows, hidden] = the sparse MoE block p[0] (moe_block.c's moe_t) over a [rows, hidden] (its
//              tokens-per-expert output is not asked for).
typedef struct {
    int32_t kind, i[3];
    int64_t n[6];
    float f[2];
    const void *p[6];
    const uint16_t *a, *b;
    uint16_t *out;
} op_t;

typedef struct {
    int64_t rows;
    const float *cos[MAX_ROPE_SETS], *sin[MAX_ROPE_SETS];  // [rows, head_dim] float32
    const int64_t *slots[MAX_KV_GROUPS];                  // [rows] pool slot of each row's new K/V
    int64_t num_decode_groups;
    const int64_t *decode_groups;  // [num_decode_groups][DG_FIELDS]; pointers stored as int64
    int nthreads;
    double *seconds;  // NULL, or [NUM_OP_KINDS]: seconds spent per op kind are added here (the step's profile)
} step_t;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int run_op(const kernels_t *k, const op_t *o, const step_t *s) {
    const int64_t T = s->rows;
    const int nt = s->nthreads;
    switch (o->kind) {
    case OP_NORM:
        ((norm_fn)k->norm)(o->a, o->n[0], o->b, (uint16_t *)o->b, (const uint16_t *)o->p[0], o->f[0], o->i[0],
                           o->out, T, o->n[1], nt);
        return 0;
    case OP_HEAD_NORM:
        for (int64_t t = 0; t < T; t++)
            ((norm_fn)k->norm)(o->a + t * o->n[0] + o->n[2], o->n[1], NULL, NULL, (const uint16_t *)o->p[0], o->f[0],
                               o->i[0], o->out + t * o->n[3] + o->n[4], o->n[5], o->n[1], nt);
        return 0;
    case OP_LINEAR: {
        const int amx = o->n[3] >= 0 && T >= o->n[3];
        if (o->i[0] == 2)
            return ((linear4_fn)(amx ? k->linear_int4_amx : k->linear_int4))(
                o->a, T, o->n[0], (const uint8_t *)o->p[0], (const uint16_t *)o->p[1], o->n[2],
                (const uint16_t *)o->p[2], o->n[1], o->out, nt);
        return ((linear_fn)(amx ? k->linear_amx : k->linear))(
            o->a, T, o->n[0], o->p[0], o->i[0], (const uint16_t *)o->p[1], (const uint16_t *)o->p[2], o->n[1], o->out,
            nt);
    }
    case OP_GATHER_COLS: {
        const int32_t *perm = (const int32_t *)o->p[0];
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < o->n[0]; j++) o->out[t * o->n[0] + j] = o->a[t * o->n[0] + perm[j]];
        return 0;
    }
    case OP_ROTARY:
        ((rotary_fn)k->rotary)(o->a, o->n[0], o->n[1], o->n[2], s->cos[o->i[0]], s->sin[o->i[0]], o->out, T, nt);
        return 0;
    case OP_KV_WRITE: {
        const int64_t hkv = o->n[2], d = o->n[3], slots = o->n[4];
        const int64_t *slot = s->slots[o->i[0]];
        if (o->i[1]) {
            const kv_quantize_fn quantize = (kv_quantize_fn)k->kv_quantize;
            return quantize(o->a, o->n[0], T, hkv, d, slot, o->i[1], (const float *)o->p[4], (void *)o->p[0],
                            (float *)o->p[2], slots) ||
                   quantize(o->b, o->n[1], T, hkv, d, slot, o->i[1], (const float *)o->p[5], (void *)o->p[1],
                            (float *)o->p[3], slots);
        }
        uint16_t *kp = (uint16_t *)o->p[0], *vp = (uint16_t *)o->p[1];
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < hkv; h++) {
                memcpy(kp + (h * slots + slot[t]) * d, o->a + t * o->n[0] + h * d, (size_t)d * 2);
                memcpy(vp + (h * slots + slot[t]) * d, o->b + t * o->n[1] + h * d, (size_t)d * 2);
            }
        return 0;
    }
    case OP_ATTEND: {
        const int64_t h = o->n[1], hkv = o->n[2], d = o->n[3];
        const uint16_t *q = o->a;
        if (o->n[0] != h * d) {  // q heads are the first of each row's rotated q|k heads: make them contiguous
            uint16_t *c = (uint16_t *)o->p[2];
            for (int64_t t = 0; t < T; t++) memcpy(c + t * h * d, o->a + t * o->n[0], (size_t)(h * d) * 2);
            q = c;
        }
        int64_t row = 0;
        for (int64_t g = 0; g < s->num_decode_groups; g++) {
            const int64_t *dg = s->decode_groups + g * DG_FIELDS, *kv = dg + 2 + 3 * o->i[0];
            const int rc = ((attend_fn)k->attend)(q + row * h * d, o->p[0], o->p[1], (const float *)o->p[3],
                                                  (const float *)o->p[4], o->i[2], (const int64_t *)(intptr_t)kv[0],
                                                  kv[1],
                                                  (const int64_t *)(intptr_t)dg[1], dg[0], h, hkv, d, o->n[4], o->n[5],
                                                  kv[2], o->i[1], o->f[0], o->out + row * h * d, nt);
            if (rc) return rc;
            row += dg[0];
        }
        return 0;
    }
    case OP_ACT:
        ((act_fn)k->act)(o->a, T, o->n[0], o->i[0], o->out, nt);
        return 0;
    case OP_COPY_COLS:
        for (int64_t t = 0; t < T; t++) memcpy(o->out + t * o->n[1] + o->n[2], o->a + t * o->n[0], (size_t)o->n[0] * 2);
        return 0;
    case OP_MOE:
        return k->moe ? ((moe_fn)k->moe)(o->p[0], o->a, T, o->out, NULL, nt) : 10;
    default:
        return 9;
    }
}

// Runs ops[0..n) then tail[0..n_tail) (the final norm: a layer-skip draft runs fewer layers, then the tail).
// Returns 0, or the failing op's index + 1 in the low 16 bits and the kernel's code above them.
int64_t decode_step(const kernels_t *k, const op_t *ops, int64_t n, const op_t *tail, int64_t n_tail,
                    const step_t *s) {
    for (int64_t i = 0; i < n + n_tail; i++) {
        const op_t *o = i < n ? ops + i : tail + (i - n);
        const double t0 = s->seconds ? now() : 0.;
        const int rc = run_op(k, o, s);
        if (rc) return ((int64_t)rc << 16) | (i + 1);
        if (s->seconds && o->kind >= 0 && o->kind < NUM_OP_KINDS) s->seconds[o->kind] += now() - t0;
    }
    return 0;
}

int decode_step_limits(int which) {  // the limits above, so the Python side never disagrees with them
    return which == 0 ? MAX_KV_GROUPS : which == 1 ? MAX_ROPE_SETS : which == 2 ? DG_FIELDS : NUM_OP_KINDS;
}
