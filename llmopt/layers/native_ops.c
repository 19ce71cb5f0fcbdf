// The element-wise layer functions of llmopt.layers (norm.py, rotary.py, activation.py) for bf16 rows on a
// CPU, one call each instead of 3-11 small torch ops. Each rounds where the eager function rounds (the eager
// one is the definition and the tests compare the two): float32 arithmetic inside, bf16 at every point where
// eager torch would hold a bf16 tensor. Built and loaded by native_ops.py; compiled with -ffast-math (the
// reductions vectorize, so sums may differ from torch's in the last float32 bit) but linked without it.
#include <math.h>
#include <stdint.h>

#include "native_bf16.h"

#define PAR_MIN 65536  // elements below which a call stays on one thread (an OpenMP fork costs more)

static inline float round_bf16(float f) { return bf16_to_f(f_to_bf16(f)); }

// out[r] = norm(x[r]) for r < rows, x rows `x_stride` apart, `dim` long. With `res`: x[r] + res[r] is
// rounded to bf16, written to res_out[r] and normalized instead (the residual add fused into the norm).
// offset = 0 (llama): bf16(w * bf16(h * rsqrt(mean(h^2) + eps))); offset = 1 (Gemma):
// bf16(h * rsqrt(...) * (1 + w)) in float32, rounded once.
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *res, uint16_t *res_out,
                   const uint16_t *w, float eps, int offset, uint16_t *out, int64_t rows, int64_t dim, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * dim >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        float ss = 0.f;
        if (res) {  // the sum, in bf16 as eager torch holds it, becomes the row to normalize
            uint16_t *s = res_out + r * dim;
            for (int64_t i = 0; i < dim; i++) {
                s[i] = f_to_bf16(bf16_to_f(xr[i]) + bf16_to_f(res[r * dim + i]));
                const float v = bf16_to_f(s[i]);
                ss += v * v;
            }
            xr = s;
        } else {
            for (int64_t i = 0; i < dim; i++) {
                const float v = bf16_to_f(xr[i]);
                ss += v * v;
            }
        }
        const float scale = 1.f / sqrtf(ss / (float)dim + eps);
        uint16_t *o = out + r * dim;
        if (offset) {
            for (int64_t i = 0; i < dim; i++) o[i] = f_to_bf16(bf16_to_f(xr[i]) * scale * (1.f + bf16_to_f(w[i])));
        } else {
            for (int64_t i = 0; i < dim; i++) o[i] = f_to_bf16(bf16_to_f(w[i]) * round_bf16(bf16_to_f(xr[i]) * scale));
        }
    }
}

// Rotate-half RoPE over x [rows, heads, dim] (rows `row_stride` apart, heads contiguous), cos/sin float32
// [rows, dim]: out [rows, heads, dim] = bf16(x * cos + rotate_half(x) * sin), computed in float32.
void rotary_bf16(const uint16_t *x, int64_t row_stride, int64_t heads, int64_t dim, const float *cos,
                 const float *sin, uint16_t *out, int64_t rows, int nthreads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for num_threads(nthreads) if (rows * heads * dim >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + r * row_stride + h * dim;
            uint16_t *o = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = bf16_to_f(xh[i]), b = bf16_to_f(xh[i + half]);
                o[i] = f_to_bf16(a * c[i] - b * s[i]);
                o[i + half] = f_to_bf16(b * c[i + half] + a * s[i + half]);
            }
        }
    }
}

// out [rows, inter] = bf16(bf16(act(gate)) * up) over x [rows, 2 * inter] = gate | up, as eager torch rounds
// the activation to bf16 before the multiply. act: SiLU (gelu = 0) or tanh-approximated GELU (gelu = 1).
void gated_act_bf16(const uint16_t *x, int64_t rows, int64_t inter, int gelu, uint16_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * inter >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        if (gelu) {
            for (int64_t i = 0; i < inter; i++) {
                const float v = bf16_to_f(g[i]);
                const float a = 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
                o[i] = f_to_bf16(round_bf16(a) * bf16_to_f(u[i]));
            }
        } else {
            for (int64_t i = 0; i < inter; i++) {
                const float v = bf16_to_f(g[i]);
                o[i] = f_to_bf16(round_bf16(v / (1.f + expf(-v))) * bf16_to_f(u[i]));
            }
        }
    }
}
