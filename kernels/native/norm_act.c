/* Row-wise float32 helpers of a decoder layer on CPU, one pass over memory each:
 *   rms_norm_f32: out[r] = w * (x[r] * 1 / sqrt(mean(x[r]^2) + eps))
 *   silu_mul_f32: out[r] = silu(gu[r][:n]) * gu[r][n:], silu(g) = g / (1 + exp(-g))
 * Rows are contiguous; the caller (kernels/native/__init__.py) checks shapes and dtypes.
 * Under -ffast-math the sums reassociate (the same value as torch's up to float rounding).
 */
#include <math.h>
#include <stdint.h>

void rms_norm_f32(const float *x, const float *w, float eps, int64_t rows, int64_t dim, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim, ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

void silu_mul_f32(const float *gu, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
