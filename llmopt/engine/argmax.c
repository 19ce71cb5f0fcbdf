// Row-wise argmax of float32 logits for the sampler: one call instead of the ~8 small torch ops that the
// block-wise argmax in argmax.py runs (greedy sampling 150-160 -> 72-75 us a token on an Intel Xeon VM,
// docs/BENCHMARKS.md "#31's targets by CPU"). Built and loaded by argmax.py.
//
// torch.argmax's rule: the first index of the row's maximum, a NaN counting as the maximum (the first NaN
// wins), -0.0 equal to 0.0. Values are compared as integers (the float's sign and magnitude as a signed
// key), so -ffast-math's assumption of no NaN or infinity cannot change the result; both loops vectorize.
#include <stdint.h>
#include <string.h>

#define PAR_MIN (1 << 20)  // values below which a call stays on one thread

static inline uint32_t bits_at(const float *x, int64_t i) {
    uint32_t b;
    memcpy(&b, x + i, sizeof b);
    return b;
}

// the order of non-NaN floats as signed integers, -0.0 and 0.0 alike
static inline int32_t key(uint32_t b) {
    const int32_t mag = (int32_t)(b & 0x7fffffffu);
    return (b >> 31) ? -mag : mag;
}

static inline int is_nan(uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; }

#define CHUNK 256  // the second pass finds the first chunk holding the maximum, then the index inside it

static inline int32_t chunk_max(const float *x, int64_t n) {
    int32_t best = INT32_MIN;
    for (int64_t i = 0; i < n; i++) {
        const int32_t k = key(bits_at(x, i));
        best = k > best ? k : best;
    }
    return best;
}

static int64_t argmax_row(const float *x, int64_t v) {
    int32_t best = INT32_MIN;
    int nan = 0;
    for (int64_t i = 0; i < v; i++) {
        const uint32_t b = bits_at(x, i);
        const int32_t k = key(b);
        best = k > best ? k : best;
        nan |= is_nan(b);
    }
    if (nan) {
        for (int64_t i = 0; i < v; i++)
            if (is_nan(bits_at(x, i))) return i;
    }
    for (int64_t c = 0; c < v; c += CHUNK) {  // vectorized per chunk; a scalar search only inside the one found
        const int64_t n = v - c < CHUNK ? v - c : CHUNK;
        if (chunk_max(x + c, n) != best) continue;
        for (int64_t i = c; i < c + n; i++)
            if (key(bits_at(x, i)) == best) return i;
    }
    return 0;  // not reached for v > 0
}

// out[r] = argmax of row r of x [rows, v] (rows `stride` floats apart)
void argmax_f32(const float *x, int64_t rows, int64_t v, int64_t stride, int64_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * v >= PAR_MIN) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, v);
}
