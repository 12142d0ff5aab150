/* Rotary position embedding of q and k heads side by side, float32:
 *   out[t][h][i] = x[t][h][i] * cos[t][i] + x[t][h][(i + d/2) % d] * sin_signed[t][i]
 * with sin_signed = [-sin[:d/2], sin[d/2:]] (rotate_half's negation carried by the table).
 * Compiled without fast-math and without FMA contraction: each product and the sum are
 * rounded as torch's separate mul, mul, add round them, so the result is bit-identical to
 * paged.models.rope.RotaryEmbedding.rotate's torch ops.
 * x: token stride x_tok, head stride x_head, unit stride in d; cos/sin: [T][d] contiguous;
 * out: contiguous [T][heads][d].
 */
#include <stdint.h>

void rope_f32(const float *x, int64_t x_tok, int64_t x_head, const float *cos, const float *sin,
              int64_t tokens, int64_t heads, int64_t d, float *out) {
    int64_t half = d / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_tok + h * x_head;
            float *o = out + (t * heads + h) * d;
            for (int64_t i = 0; i < half; i++) {
                float a = xh[i] * c[i], b = xh[i + half] * s[i];
                o[i] = a + b;
            }
            for (int64_t i = half; i < d; i++) {
                float a = xh[i] * c[i], b = xh[i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}
