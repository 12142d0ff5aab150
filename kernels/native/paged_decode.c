/* Paged decode attention on CPU, float32: one query token per sequence over its cached context,
 * read straight from the block-layout cache (no gathered copy of K/V).
 *
 * Cache rows: slot = tables[s * width + t / bs] * bs + t % bs holds K (and V) of position t of
 * sequence s as [hkv][d] floats: the row of KV head h is kc + (slot * hkv + h) * d. Query head
 * i reads KV head i / g (g = hq / hkv).
 *   scores[i][t] = scale * q[i] . k[t][i / g];  p = softmax over t < lens[s];  out[i] = sum_t p[i][t] v[t][i / g]
 * A sequence with lens[s] == 0 gets zeros. The caller checks every index (kernels/native/__init__.py);
 * this file trusts its inputs.
 *
 * Memory order: one pass over a sequence's K slots and one over its V slots, each slot's hkv * d
 * floats read once and contiguously (a block's slots are adjacent), for all query heads at once.
 * Speed: GCC/Clang vector extensions (8 floats: AVX2 registers under -march=native, two NEON
 * registers on ARM); d a multiple of 8 and g <= 4 or a multiple of 4 take that path, other shapes
 * a scalar loop with the same math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void st(float *p, v8 a) { memcpy(p, &a, sizeof a); }
static inline float hsum(v8 a) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += a[i];
    return s;
}

/* scores of every query head against the K rows kc + off[t]; GJ heads share each K row load */
static inline __attribute__((always_inline)) void scores_vec(
        const float *q, int64_t qhs, const float *kc, const int64_t *off, int64_t len, int64_t hkv,
        int64_t g, int64_t d, float scale, float *sc, int64_t t_max, const int GJ) {
    for (int64_t t = 0; t < len; t++) {
        for (int64_t h = 0; h < hkv; h++) {
            const float *k = kc + off[t] + h * d;
            for (int64_t j0 = 0; j0 < g; j0 += GJ) {
                const float *qh = q + (h * g + j0) * qhs;
                v8 a[4] = {0};
                for (int64_t x = 0; x < d; x += 8) {
                    v8 kv = ld(k + x);
                    for (int j = 0; j < GJ; j++) a[j] += ld(qh + j * qhs + x) * kv;
                }
                for (int j = 0; j < GJ; j++) sc[(h * g + j0 + j) * t_max + t] = hsum(a[j]) * scale;
            }
        }
    }
}

/* out[i] += p[i][t] * v[t][i / g] over t, accumulated in out (zeroed by the caller) */
static void values_vec(const float *vc, const int64_t *off, int64_t len, int64_t hkv, int64_t g, int64_t d,
                       const float *p, int64_t t_max, float *out) {
    for (int64_t t = 0; t < len; t++) {
        for (int64_t h = 0; h < hkv; h++) {
            const float *v = vc + off[t] + h * d;
            for (int64_t j = 0; j < g; j++) {
                float w = p[(h * g + j) * t_max + t], *o = out + (h * g + j) * d;
                for (int64_t x = 0; x < d; x += 8) st(o + x, ld(o + x) + w * ld(v + x));
            }
        }
    }
}

static void scores_scalar(const float *q, int64_t qhs, const float *kc, const int64_t *off, int64_t len,
                          int64_t hkv, int64_t g, int64_t d, float scale, float *sc, int64_t t_max) {
    for (int64_t t = 0; t < len; t++)
        for (int64_t i = 0; i < hkv * g; i++) {
            const float *k = kc + off[t] + (i / g) * d, *qi = q + i * qhs;
            float acc = 0.0f;
            for (int64_t x = 0; x < d; x++) acc += qi[x] * k[x];
            sc[i * t_max + t] = acc * scale;
        }
}

static void values_scalar(const float *vc, const int64_t *off, int64_t len, int64_t hkv, int64_t g, int64_t d,
                          const float *p, int64_t t_max, float *out) {
    for (int64_t t = 0; t < len; t++)
        for (int64_t i = 0; i < hkv * g; i++) {
            const float *v = vc + off[t] + (i / g) * d;
            for (int64_t x = 0; x < d; x++) out[i * d + x] += p[i * t_max + t] * v[x];
        }
}

/* each row of sc (hq rows of len) -> its softmax numerators; norm[i] = 1 / their sum */
static void softmax_rows(float *sc, int64_t len, int64_t t_max, int64_t hq, float *norm) {
    for (int64_t i = 0; i < hq; i++) {
        float *s = sc + i * t_max, m = s[0], sum = 0.0f;
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) s[t] = expf(s[t] - m);
        for (int64_t t = 0; t < len; t++) sum += s[t];
        norm[i] = 1.0f / sum;
    }
}

/* q: [n_seqs] tokens of [hq][d] (token stride q_tok_stride, head stride q_head_stride, unit
 * stride within a head); out: contiguous [n_seqs][hq][d]; scratch: scores n_seqs * hq * t_max
 * floats, norms n_seqs * hq floats, offsets n_seqs * t_max int64; tables [n_seqs][width];
 * t_max >= every lens[s]. */
void paged_decode_f32(const float *q, int64_t q_tok_stride, int64_t q_head_stride, const float *kc,
                      const float *vc, const int64_t *tables, int64_t width, const int64_t *lens,
                      int64_t n_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale,
                      float *scores, float *norms, int64_t *offsets, int64_t t_max, float *out,
                      int64_t n_threads) {
    int64_t g = hq / hkv;
    int vec = d % 8 == 0, gj = g <= 4 ? (int)g : (g % 4 == 0 ? 4 : 0);
    (void)n_threads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) if (n_threads > 1)
    for (int64_t s = 0; s < n_seqs; s++) {
        int64_t len = lens[s], *off = offsets + s * t_max;
        const int64_t *table = tables + s * width;
        const float *qs = q + s * q_tok_stride;
        float *o = out + s * hq * d, *sc = scores + s * hq * t_max, *norm = norms + s * hq;
        memset(o, 0, sizeof(float) * hq * d);
        if (len == 0) continue;
        for (int64_t t = 0; t < len; t++) off[t] = (table[t / bs] * bs + t % bs) * hkv * d;
        switch (vec ? gj : 0) {
            case 1: scores_vec(qs, q_head_stride, kc, off, len, hkv, g, d, scale, sc, t_max, 1); break;
            case 2: scores_vec(qs, q_head_stride, kc, off, len, hkv, g, d, scale, sc, t_max, 2); break;
            case 3: scores_vec(qs, q_head_stride, kc, off, len, hkv, g, d, scale, sc, t_max, 3); break;
            case 4: scores_vec(qs, q_head_stride, kc, off, len, hkv, g, d, scale, sc, t_max, 4); break;
            default: scores_scalar(qs, q_head_stride, kc, off, len, hkv, g, d, scale, sc, t_max);
        }
        softmax_rows(sc, len, t_max, hq, norm);
        if (vec) values_vec(vc, off, len, hkv, g, d, sc, t_max, o);
        else values_scalar(vc, off, len, hkv, g, d, sc, t_max, o);
        for (int64_t i = 0; i < hq; i++)
            for (int64_t x = 0; x < d; x++) o[i * d + x] *= norm[i];
    }
}
