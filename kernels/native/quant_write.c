/* Quantize-on-write of new tokens into a split-format layer (kernels/split.py: write_split is the
 * reference, and these codes are bit-identical to it): per token and KV head, the value row's
 * codebook codes and fp16 group scales (or the exact value row), the exact key row (fp16/fp32
 * sides), and the staging rows of K (and V with a sink or window): fp16, or with @krows<b> /
 * @vrows<b> b-bit codes and an fp16 scale per row (row_quantize). One pass over the new
 * rows; nothing else of the block is read or rewritten.
 *
 * The fast path covers the tokens whose write changes no staging bookkeeping: at an offset other
 * than 0 (a new life) and BS-1 (a seal), in a block that is already staged (when the layer
 * stages), at a position past the sink. split_write_f32 writes the tokens of the blocks that
 * hold only such tokens, marks the others in slow[] (nothing of their blocks written) and returns
 * their count: the caller writes those with the reference (blocks are independent: a block's
 * write reads only that block's rows and the pool's free slots, which fast blocks do not touch). Built with exact float rules (no fast-math, no contraction): the
 * divisions and fp16 roundings are torch's (IEEE round-to-nearest-even).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {
    int64_t bs, hkv, d, sink;
    int64_t k_dtype;                  /* exact K side: 0 fp32, 1 fp16; -1 K is a code side (sealed later) */
    int64_t v_dtype;                  /* exact V side: 0 fp32, 1 fp16; -1 codebook codes */
    int64_t v_bits, v_group, v_row_bytes, n_levels;
    const float *bounds;              /* codebook midpoints [n_levels - 1] (float32, ascending) */
    float max_level;                  /* max |level| */
    void *k, *v;                      /* the layer's K and V rows [slots, hkv, row] */
    uint16_t *v_scale;                /* fp16 [slots, hkv, d / v_group] */
    const int32_t *map;               /* staging host map [num_blocks] (NULL: the layer stages nothing) */
    uint16_t *sk, *sv;                /* staging rows fp16 [stage slots, bs, hkv, d]; sv NULL: K only */
    int64_t sk_bits, sv_bits;         /* 2..8 (@krows<b> / @vrows<b>): that side's staging rows are codes */
    uint16_t *sk_scale, *sv_scale;    /* ... uint8 [stage slots, bs, hkv, b * d / 8], fp16 scales [.., hkv] */
} wspec_t;

static inline uint16_t f2h(float f) {
#if defined(__FLT16_MAX__)
    _Float16 h = (_Float16)f;  /* IEEE round to nearest even */
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);  /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds to inf */
    if (ax < 0x38800000u) {  /* below 2^-14: a subnormal half, m = round_even(|f| * 2^24) */
        if (ax < 0x33000000u) return (uint16_t)sign;  /* <= 2^-25: zero (a tie rounds to even 0) */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;  /* |f| = m * 2^(e - 150) */
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t q = ax - 0x38000000u;  /* rebias 127 -> 15 */
    uint32_t rem = q & 0x1fffu, h = q >> 13;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
#endif
}

static inline float h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, b;
    if (e == 0x1f) b = s | 0x7f800000u | (m << 13);
    else if (e) b = s | ((e + 112u) << 23) | (m << 13);
    else {
        float f = (float)m * 5.9604644775390625e-8f;
        return s ? -f : f;
    }
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static void store_row(int64_t dtype, void *base, int64_t idx, int64_t d, const float *x) {
    if (dtype == 0) { memcpy((float *)base + idx * d, x, sizeof(float) * (size_t)d); return; }
    uint16_t *r = (uint16_t *)base + idx * d;
    for (int64_t c = 0; c < d; c++) r[c] = f2h(x[c]);
}

/* every token written into the block of a slow token (slow[t] == 1) is left to the reference too
 * (slow[u] = 2), so a block is either written here or by the reference, never by both */
static inline void widen_to_blocks(const int64_t *slots, int64_t n, int64_t bs, uint8_t *slow) {
    for (int64_t t = 0; t < n; t++) {
        if (slow[t] != 1) continue;
        for (int64_t u = 0; u < n; u++)
            if (!slow[u] && slots[u] >= 0 && slots[u] / bs == slots[t] / bs) slow[u] = 2;
    }
}

/* codebook codes of one value row (cb_quantize + pack_bits of kernels/split_codec.py) */
static void cb_row(const wspec_t *w, const float *x, uint8_t *dst, uint16_t *scale) {
    int64_t d = w->d, gs = w->v_group, nb = w->n_levels - 1;
    uint64_t acc = 0;
    int nacc = 0;
    int64_t out = 0;
    for (int64_t g = 0; g < d / gs; g++) {
        const float *xg = x + g * gs;
        float amax = 0.0f;
        for (int64_t c = 0; c < gs; c++) {
            float a = fabsf(xg[c]);
            amax = a > amax ? a : amax;
        }
        uint16_t s = f2h(amax / w->max_level);
        float sf = h2f(s);
        if (sf == 0.0f) sf = 1.0f;
        scale[g] = s;
        for (int64_t c = 0; c < gs; c++) {
            float u = xg[c] / sf;
            uint64_t code = 0;  /* torch.bucketize (right=False): boundaries strictly below u */
            while ((int64_t)code < nb && w->bounds[code] < u) code++;
            acc |= code << nacc;
            nacc += (int)w->v_bits;
            while (nacc >= 8) { dst[out++] = (uint8_t)acc; acc >>= 8; nacc -= 8; }
        }
    }
    if (nacc) dst[out++] = (uint8_t)acc;
    for (; out < w->v_row_bytes; out++) dst[out] = 0;
}

/* fp16(x) as a float (IEEE round to nearest even both ways) */
static inline float round16(float x) {
#if defined(__FLT16_MAX__)
    return (float)(_Float16)x;
#else
    return h2f(f2h(x));
#endif
}

/* one staged row kept as codes (kernels/split_codec.py row_quantize of the fp16 row the reference
 * stages): x rounded to fp16, s = fp16(absmax) (= fp16(max |x|): rounding is monotone), u = x / s
 * (s = 0 divides by 1), code = clamp(round_even((u + 1) * (n - 1) / 2), 0, n - 1) with n = 2^bits,
 * packed at bit c * bits; a NaN (an fp16 overflow to inf in the row) codes 0, as the reference's
 * int64 cast leaves it. Chunks of 64 channels (whole bytes at any width): codes, then packing */
static void row_codes(const float *x, int64_t d, int64_t bits, uint8_t *dst, uint16_t *scale) {
    float amax = 0.0f;
    for (int64_t c = 0; c < d; c++) {
        float a = fabsf(x[c]);
        amax = a > amax ? a : amax;
    }
    uint16_t s = f2h(amax);
    float sf = h2f(s), top = (float)((1 << bits) - 1), half = top * 0.5f;  /* (n - 1) / 2: exact */
    if (sf == 0.0f) sf = 1.0f;
    *scale = s;
    int64_t out = 0;
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        int64_t m = d - c0 < 64 ? d - c0 : 64;
        uint8_t code[64];
        int64_t c = 0;
#if defined(__F16C__) && defined(__AVX2__)
        /* 8 at a time, the same IEEE operations (each correctly rounded); max_ps returns its second
         * operand (0) for a NaN; this also avoids the scalar conversions' false dependency chain */
        __m256 vs = _mm256_set1_ps(sf), one = _mm256_set1_ps(1.0f), vh = _mm256_set1_ps(half);
        __m256 vt = _mm256_set1_ps(top), zero = _mm256_setzero_ps();
        for (; c + 8 <= m; c += 8) {
            __m256 v = _mm256_loadu_ps(x + c0 + c);
            v = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
            v = _mm256_mul_ps(_mm256_add_ps(_mm256_div_ps(v, vs), one), vh);
            v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm256_min_ps(_mm256_max_ps(v, zero), vt);
            int32_t q[8];
            _mm256_storeu_si256((__m256i *)q, _mm256_cvttps_epi32(v));
            for (int j = 0; j < 8; j++) code[c + j] = (uint8_t)q[j];
        }
#endif
        for (; c < m; c++) {
            float q = rintf((round16(x[c0 + c]) / sf + 1.0f) * half);  /* torch.round (default mode) */
            q = q > 0.0f ? q : 0.0f;  /* a NaN fails the test: 0 */
            code[c] = (uint8_t)(q < top ? q : top);
        }
        if (bits == 8) {
            memcpy(dst + out, code, (size_t)m);
            out += m;
            continue;
        }
        uint32_t acc = 0;
        int nacc = 0;
        for (int64_t c = 0; c < m; c++) {
            acc |= (uint32_t)code[c] << nacc;
            nacc += (int)bits;
            while (nacc >= 8) { dst[out++] = (uint8_t)acc; acc >>= 8; nacc -= 8; }
        }
        if (nacc) dst[out++] = (uint8_t)acc;  /* only in a last chunk of m * bits not a multiple of 8 */
    }
}

/* staging row `row` of one side: fp16 (bits 0 / 16) or codes and scale (bits 2..8) */
static void stage_row(int64_t bits, uint16_t *base, uint16_t *scale, int64_t row, int64_t d, const float *x) {
    if (bits >= 2 && bits <= 8) row_codes(x, d, bits, (uint8_t *)base + row * (bits * d / 8), scale + row);
    else store_row(1, base, row, d, x);
}

int64_t split_write_f32(const float *key, const float *val, const float *val_rot, const int64_t *slots,
                        const int64_t *pos, int64_t n, const wspec_t *w, uint8_t *slow) {
    int64_t bs = w->bs, hkv = w->hkv, d = w->d, n_slow = 0;
    for (int64_t t = 0; t < n; t++) {  /* 1. the tokens outside the fast path, and every token of their block */
        int64_t off = slots[t] % bs, blk = slots[t] / bs;
        slow[t] = slots[t] >= 0 && ((w->sink && pos[t] < w->sink) ||
                                    (w->map && (off == 0 || off == bs - 1 || w->map[blk] < 0)));
    }
    widen_to_blocks(slots, n, bs, slow);
    for (int64_t t = 0; t < n; t++) {
        if (slow[t]) { n_slow++; continue; }
        if (slots[t] < 0) continue;
        int64_t slot = slots[t], off = slot % bs, blk = slot / bs;
        for (int64_t h = 0; h < hkv; h++) {
            const float *kx = key + (t * hkv + h) * d, *vx = val + (t * hkv + h) * d;
            int64_t r = slot * hkv + h;
            if (w->v_dtype < 0)
                cb_row(w, val_rot + (t * hkv + h) * d, (uint8_t *)w->v + r * w->v_row_bytes,
                       w->v_scale + r * (d / w->v_group));
            else store_row(w->v_dtype, w->v, r, d, vx);
            if (w->k_dtype >= 0) store_row(w->k_dtype, w->k, r, d, kx);
            if (w->map) {
                int64_t row = ((int64_t)w->map[blk] * bs + off) * hkv + h;
                stage_row(w->sk_bits, w->sk, w->sk_scale, row, d, kx);
                if (w->sv) stage_row(w->sv_bits, w->sv, w->sv_scale, row, d, vx);
            }
        }
    }
    return n_slow;
}

/* ---- plain int8 / int4 layers and int4_kivi (kernels/quant.py quantize_kv, kernels/kivi_cache.py) ---- */

typedef struct {
    int64_t bs, hkv, d, groups;       /* groups: int4 scale groups per row */
    int64_t k_code, v_code;           /* 4 int8, 5 int4; k_code 6: int4_kivi K, staged rows only */
    void *k, *v;
    uint16_t *k_scale, *v_scale, *k_zero, *v_zero;
    const int32_t *map;               /* int4_kivi staging host map; NULL otherwise */
    void *sk;                         /* staging K rows [slots, bs, hkv, d] in stage_dtype (0 fp32, 1 fp16) */
    int64_t stage_dtype;
} pspec_t;

static inline float safe(float s) { return s == 0.0f ? 1.0f : s; }

static void int8_row(const float *x, int64_t d, int8_t *dst, uint16_t *scale) {
    float amax = 0.0f;
    for (int64_t c = 0; c < d; c++) { float a = fabsf(x[c]); amax = a > amax ? a : amax; }
    uint16_t s = f2h(amax / 127.0f);
    float sf = safe(h2f(s));
    *scale = s;
    for (int64_t c = 0; c < d; c++) {
        float q = nearbyintf(x[c] / sf);  /* torch.round: half to even */
        dst[c] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
    }
}

static void int4_row(const float *x, int64_t d, int64_t groups, uint8_t *dst, uint16_t *scale, uint16_t *zero) {
    int64_t gs = d / groups;
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * gs;
        float mn = xg[0], mx = xg[0];
        for (int64_t c = 1; c < gs; c++) { mn = xg[c] < mn ? xg[c] : mn; mx = xg[c] > mx ? xg[c] : mx; }
        uint16_t s = f2h((mx - mn) / 15.0f), z = f2h(mn);
        float sf = safe(h2f(s)), zf = h2f(z);
        scale[g] = s;
        zero[g] = z;
        for (int64_t c = 0; c < gs; c += 2) {
            float a = nearbyintf((xg[c] - zf) / sf), b = nearbyintf((xg[c + 1] - zf) / sf);
            a = a < 0.0f ? 0.0f : a > 15.0f ? 15.0f : a;
            b = b < 0.0f ? 0.0f : b > 15.0f ? 15.0f : b;
            dst[(g * gs + c) / 2] = (uint8_t)((uint8_t)a | ((uint8_t)b << 4));  /* element 2j: low nibble */
        }
    }
}

static void plain_side(int64_t code, const float *x, int64_t r, const pspec_t *w, void *data, uint16_t *scale,
                       uint16_t *zero) {
    int64_t d = w->d;
    if (code == 4) int8_row(x, d, (int8_t *)data + r * d, scale + r);
    else int4_row(x, d, w->groups, (uint8_t *)data + r * (d / 2), scale + r * w->groups, zero + r * w->groups);
}

/* int4_kivi: tokens of a block at offset 0 or BS-1, or of an unstaged block, are marked in slow[]
 * (with every token of their block) and left to the reference; returns their count */
int64_t plain_write_f32(const float *key, const float *val, const int64_t *slots, int64_t n, const pspec_t *w,
                        uint8_t *slow) {
    int64_t bs = w->bs, hkv = w->hkv, d = w->d, n_slow = 0;
    for (int64_t t = 0; t < n; t++) {
        int64_t off = slots[t] % bs;
        slow[t] = slots[t] >= 0 && w->map && (off == 0 || off == bs - 1 || w->map[slots[t] / bs] < 0);
    }
    widen_to_blocks(slots, n, bs, slow);
    for (int64_t t = 0; t < n; t++) {
        if (slow[t]) { n_slow++; continue; }
        if (slots[t] < 0) continue;
        int64_t slot = slots[t];
        for (int64_t h = 0; h < hkv; h++) {
            const float *kx = key + (t * hkv + h) * d, *vx = val + (t * hkv + h) * d;
            int64_t r = slot * hkv + h;
            plain_side(w->v_code, vx, r, w, w->v, w->v_scale, w->v_zero);
            if (w->k_code == 6) {
                int64_t row = ((int64_t)w->map[slot / bs] * bs + slot % bs) * hkv + h;
                store_row(w->stage_dtype, w->sk, row, d, kx);
            } else plain_side(w->k_code, kx, r, w, w->k, w->k_scale, w->k_zero);
        }
    }
    return n_slow;
}
