// A sparse Mixture-of-Experts block (SparseMoeBlock, llmopt/layers/moe.py) in one call, over our matmul kernels:
// route each token (router matmul, softmax, top-k, optional renormalization), run each expert that got tokens
// over its tokens' rows (gate|up, act, down), add the routed outputs weighted, then the gated shared expert.
// Built and loaded by moe_native.py.
//
// Why here: the eager block and the decode step (llmopt/step/decode_step.c, its MOE op) both call this one
// function, so their outputs are bit for bit the same, and a decode token runs no Python per expert. The matmul
// and activation kernels are not ours to copy: their addresses come in `moe_t` from their own libraries
// (bf16_linear.c, native_ops.c). Every expert sees only its own tokens, whatever the batch, so prefill runs
// here as well.
//
// Arithmetic: logits are the router kernel's bf16; softmax, top-k and the routing weights are float32 (ties go
// to the lower expert id); each token's expert outputs (bf16, as the kernels give them) are summed in float32
// in ascending expert order, then the shared expert's, and the sum is rounded to bf16 once.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_bf16.h"

typedef int (*linear_fn)(const uint16_t *, int64_t, int64_t, const void *, int, const uint16_t *, const uint16_t *,
                         int64_t, uint16_t *, int);
typedef int (*linear4_fn)(const uint16_t *, int64_t, int64_t, const uint8_t *, const uint16_t *, int64_t,
                          const uint16_t *, int64_t, uint16_t *, int);
typedef void (*act_fn)(const uint16_t *, int64_t, int64_t, int, uint16_t *, int);

// One projection (KernelLinear in kernel_linear.py): storage 0 bf16, 1 int8 (scale per output), 2 int4 (scale per
// group and output, group `group`); AMX from `amx_min_rows` rows (-1: never); `perm`: x's columns in the kernel's
// order (int4 act-order), or NULL. `storage` -1: absent.
typedef struct {
    int32_t storage;
    int64_t in, out, group, amx_min_rows;
    const void *packed;
    const uint16_t *scale, *bias;
    const int32_t *perm;
} klinear_t;

typedef struct {
    const void *linear, *linear_amx, *linear_int4, *linear_int4_amx, *act;  // kernel addresses
    int64_t hidden, num_experts, top_k, inter, shared_inter;
    int32_t norm_topk, gelu;
    klinear_t router;                                 // [num_experts, hidden]
    const klinear_t *experts;                         // [num_experts][2]: gate|up, down
    klinear_t shared_gate_up, shared_down, shared_gate;  // storage -1 when the block has no shared expert
} moe_t;

static int run_linear(const moe_t *m, const klinear_t *l, const uint16_t *x, int64_t rows, uint16_t *y,
                      uint16_t *gathered, int nt) {
    if (l->perm) {
        for (int64_t t = 0; t < rows; t++)
            for (int64_t j = 0; j < l->in; j++) gathered[t * l->in + j] = x[t * l->in + l->perm[j]];
        x = gathered;
    }
    const int amx = l->amx_min_rows >= 0 && rows >= l->amx_min_rows;
    if (l->storage == 2)
        return ((linear4_fn)(amx ? m->linear_int4_amx : m->linear_int4))(
            x, rows, l->in, (const uint8_t *)l->packed, l->scale, l->group, l->bias, l->out, y, nt);
    const linear_fn fn = (linear_fn)(amx ? m->linear_amx : m->linear);
    return fn(x, rows, l->in, l->packed, l->storage == 1, l->scale, l->bias, l->out, y, nt);
}

// x [rows, hidden] -> y [rows, hidden] through one gated MLP (gate|up -> act -> down); h, a: scratch.
static int run_mlp(const moe_t *m, const klinear_t *gate_up, const klinear_t *down, int64_t inter,
                   const uint16_t *x, int64_t rows, uint16_t *h, uint16_t *a, uint16_t *y, uint16_t *gathered,
                   int nt) {
    int rc = run_linear(m, gate_up, x, rows, h, gathered, nt);
    if (rc) return rc;
    ((act_fn)m->act)(h, rows, inter, m->gelu, a, nt);
    return run_linear(m, down, a, rows, y, gathered, nt);
}

// out [T, hidden] (bf16) = the block over x [T, hidden]; counts [num_experts] (optional): tokens per expert.
// Returns 0; a kernel's nonzero code; or 12 when out of memory.
int moe_block(const moe_t *m, const uint16_t *x, int64_t T, uint16_t *out, int64_t *counts, int nt) {
    const int64_t H = m->hidden, E = m->num_experts, K = m->top_k;
    const int64_t inter = m->inter > m->shared_inter ? m->inter : m->shared_inter;
    const int64_t widest = H > inter ? H : inter;
    uint16_t *logits = malloc((size_t)(T * E) * 2), *xs = malloc((size_t)(T * H) * 2),
             *h = malloc((size_t)(T * 2 * inter) * 2), *a = malloc((size_t)(T * inter) * 2),
             *y = malloc((size_t)(T * H) * 2), *gathered = malloc((size_t)(T * widest) * 2);
    int32_t *chosen = malloc((size_t)(T * K) * 4), *tokens = malloc((size_t)(T * K) * 4);
    float *weight = malloc((size_t)(T * K) * 4), *slot_w = malloc((size_t)(T * K) * 4),
          *probs = malloc((size_t)E * 4), *acc = calloc((size_t)(T * H), 4);
    int64_t *start = calloc((size_t)(E + 1), 8), *fill = calloc((size_t)E, 8);
    int rc = 0;
    if (!(logits && xs && h && a && y && gathered && chosen && tokens && weight && slot_w && probs && acc && start
          && fill)) {
        rc = 12;
        goto done;
    }
    if ((rc = run_linear(m, &m->router, x, T, logits, gathered, nt))) goto done;
    for (int64_t t = 0; t < T; t++) {  // softmax in float32, then the top k (ties: lower id first)
        const uint16_t *l = logits + t * E;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < E; e++) mx = fmaxf(mx, bf16_to_f(l[e]));
        for (int64_t e = 0; e < E; e++) sum += probs[e] = expf(bf16_to_f(l[e]) - mx);
        for (int64_t e = 0; e < E; e++) probs[e] /= sum;
        float kept = 0.f;
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
            chosen[t * K + k] = (int32_t)best;
            kept += weight[t * K + k] = probs[best];
            probs[best] = -1.f;  // taken
        }
        if (m->norm_topk)
            for (int64_t k = 0; k < K; k++) weight[t * K + k] /= kept;
    }
    for (int64_t i = 0; i < T * K; i++) start[chosen[i] + 1]++;  // slots grouped by expert, tokens ascending
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < T * K; i++) {
        const int64_t e = chosen[i], at = start[e] + fill[e]++;
        tokens[at] = (int32_t)(i / K), slot_w[at] = weight[i];
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e];
        if (counts) counts[e] = n;
        if (!n) continue;
        const int32_t *tok = tokens + start[e];
        for (int64_t j = 0; j < n; j++) memcpy(xs + j * H, x + (int64_t)tok[j] * H, (size_t)H * 2);
        if ((rc = run_mlp(m, m->experts + 2 * e, m->experts + 2 * e + 1, m->inter, xs, n, h, a, y, gathered, nt)))
            goto done;
        const float *w = slot_w + start[e];
        #pragma omp parallel for num_threads(nt) if (n * H >= 65536) schedule(static)
        for (int64_t j = 0; j < n; j++) {  // one token per row: no two rows add into the same sum
            float *dst = acc + (int64_t)tok[j] * H;
            const uint16_t *src = y + j * H;
            for (int64_t i = 0; i < H; i++) dst[i] += w[j] * bf16_to_f(src[i]);
        }
    }
    if (m->shared_gate_up.storage >= 0) {
        if ((rc = run_linear(m, &m->shared_gate, x, T, xs, gathered, nt))) goto done;  // [T, 1] gate logits
        if ((rc = run_mlp(m, &m->shared_gate_up, &m->shared_down, m->shared_inter, x, T, h, a, y, gathered, nt)))
            goto done;
        #pragma omp parallel for num_threads(nt) if (T * H >= 65536) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const float g = 1.f / (1.f + expf(-bf16_to_f(xs[t])));
            for (int64_t i = 0; i < H; i++) acc[t * H + i] += g * bf16_to_f(y[t * H + i]);
        }
    }
    #pragma omp parallel for num_threads(nt) if (T * H >= 65536) schedule(static)
    for (int64_t i = 0; i < T * H; i++) out[i] = f_to_bf16(acc[i]);
done:
    free(logits), free(xs), free(h), free(a), free(y), free(gathered), free(chosen), free(tokens);
    free(weight), free(slot_w), free(probs), free(acc), free(start), free(fill);
    return rc;
}
