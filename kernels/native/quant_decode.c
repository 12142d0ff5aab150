/* Fused paged decode attention over quantized KV on CPU: one query token per sequence, the codes
 * read from the block-layout cache and dequantized row by row inside the attention loop (no
 * float32 copy of K or V is ever made). The torch references that define the math:
 * kernels/reference.py (int8, int4, fp8, fp16/bf16, int4_kivi) and kernels/split_read.py
 * (split formats: KIVI keys, codebook values, +pre, +rot, @sink, @win).
 *
 * A side (K or V) is described by side_t; the exact rows (staging and sink pools) by exact_t.
 * Row of (slot, kv head h): data + (slot * hkv + h) * row_bytes. Per sequence s, position t:
 *   blk = tables[s][t / bs], slot = blk * bs + t % bs;
 *   exact(t) = windowed ? (t < sink || len - 1 - t < window) : staging map[blk] >= 0 (keys only);
 *   key(t)  = exact ? staging/sink row : decode(K side), RoPE at t when pre_rope;
 *   an exact row is plain (fp16) or, with @krows<b> / @vrows<b>, b-bit symmetric codes (exact_t);
 *   p = softmax(scale * q . key);  out = H^T-rotated(sum_{not exact} p v_codes) + sum_{exact} p v_exact.
 * The caller (kernels/native/quant.py) checks every index; this file trusts its inputs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { S_F32 = 0, S_F16 = 1, S_BF16 = 2, S_LUT8 = 3, S_INT8 = 4, S_INT4 = 5, S_KIVI = 6, S_CB = 7 };
#define MAXD 256
#define MAXHD 8192
#define TILE 16  /* V rows decoded together, then accumulated into each query head's output */
#define IN_WINDOW(e, t, len) ((t) < (e)->sink || (len) - 1 - (t) < (e)->window)  /* a sink or window row */

typedef struct {
    int64_t code, row_bytes, groups, bits, compact, n_pos, safe_rows;  /* rows < safe_rows: 16 bytes follow */
    const uint8_t *data;
    const uint16_t *scale, *zero;     /* per token-head fp16: INT8 [.,1], INT4 / CB [., groups]; INT4 zero */
    const float *lut;                 /* LUT8: [hkv][256] (code value x head scale); CB: levels [2^bits] */
    const void *bstep, *bzero;        /* KIVI per (block, head, channel): fp16, or uint8 / int8 codes ... */
    const uint16_t *bsuper;           /* ... under fp16 super-scales [nb, hkv, 2] (zero unit, step unit) */
    const int32_t *width, *offset;    /* KIVI [hkv, d] bits and bit offset per channel */
    const float *cos, *sin;           /* +pre: RoPE rows [n_pos, d] (sin signed) */
    const float *hadamard;            /* CB +rot: [d, d]; the code part of the output is multiplied by H^T */
} side_t;

typedef struct {
    int64_t dtype, sink, window, windowed;  /* dtype of the plain staging rows: S_F32 / S_F16 / S_BF16 */
    const void *k, *v;                      /* staging rows [slots, bs, hkv, d]; v NULL: keys only */
    const int32_t *map;                     /* block -> staging slot or -1 [nb]; NULL: no staging */
    const void *sk, *sv;                    /* sink rows [slots, sink, hkv, d] (fp16 when plain) */
    const int32_t *smap;                    /* first block -> sink slot or -1 */
    /* @krows<b> / @vrows<b>: a side whose bits lie in 2..8 keeps its rows (both pools) as uint8 codes
     * [slots, rows, hkv, row_bytes = b * d / 8] with fp16 scales [slots, rows, hkv] (row r: scale[r]);
     * value = (2 * code - (n - 1)) * (scale / (n - 1)), n = 2^b (split_codec.row_dequantize); 0 or 16:
     * plain rows as above */
    int64_t k_bits, v_bits, k_row_bytes, v_row_bytes;
    const uint16_t *k_scale, *v_scale;      /* staging scales */
    const uint16_t *sk_scale, *sv_scale;    /* sink scales */
} exact_t;

static inline float h2f(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);  /* fp16 -> fp32 is exact: the same value as the portable path */
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, b;
    if (e == 0x1f) b = s | 0x7f800000u | (m << 13);
    else if (e) b = s | ((e + 112u) << 23) | (m << 13);
    else {
        float f = (float)m * 5.9604644775390625e-8f; /* subnormal: m * 2^-24, exact */
        return s ? -f : f;
    }
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}

static inline float bf2f(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static void load_row(int64_t dtype, const void *base, int64_t idx, int64_t d, float *out) {
    if (dtype == S_F32) { memcpy(out, (const float *)base + idx * d, sizeof(float) * d); return; }
    const uint16_t *r = (const uint16_t *)base + idx * d;
#ifdef __F16C__
    if (dtype == S_F16 && d % 8 == 0) {  /* exact conversions, 8 at a time */
        for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + c))));
        return;
    }
#endif
    if (dtype == S_F16) for (int64_t c = 0; c < d; c++) out[c] = h2f(r[c]);
    else for (int64_t c = 0; c < d; c++) out[c] = bf2f(r[c]);
}

/* where each channel's code lies in a row: byte index, shift, mask (0 for a 0-bit channel); uniform
 * b-bit codes sit at bit c * b, KIVI +alloc widths at their offsets (little-endian, a code may
 * straddle two bytes) */
typedef struct {
    int32_t idx[MAXD], sh[MAXD], mask[MAXD], ubits;  /* ubits: uniform width or 0 */
    int32_t row_bytes;                                /* > 0: the row fits one 64-byte register (pidx) */
    int32_t shuf_ok;                                  /* every 8 channels' bytes lie in 16 from base[] */
    int32_t gs;                                       /* channels per scale group (INT4, CB) */
    float lv[16];                                     /* CB <= 4 bits: the levels, zero-padded to 16 (one
                                                         copy per call, not per row) */
    int32_t base[MAXD / 8];                           /* first byte of channels 8k .. 8k + 7 */
    uint8_t pidx[4 * MAXD];                           /* bytes idx[c] .. idx[c] + 3 of channel c, in order */
    uint8_t shuf[4 * MAXD];                           /* the same bytes, counted from base[c / 8] */
} layout_t;

static void make_layout(const int32_t *wd, const int32_t *of, int64_t bits, int64_t d, int64_t row_bytes,
                        int64_t groups, layout_t *l) {
    l->ubits = of ? 0 : (int32_t)bits;
    l->gs = (int32_t)(groups > 0 ? d / groups : d);
    l->row_bytes = 0;
    l->shuf_ok = 1;
    for (int64_t c = 0; c < d; c++) {
        int32_t w = wd ? wd[c] : (int32_t)bits, o = of ? of[c] : (int32_t)(c * bits);
        l->idx[c] = w ? o >> 3 : 0;
        l->sh[c] = o & 7;
        l->mask[c] = (int32_t)((1u << w) - 1u);
        for (int j = 0; j < 4; j++) l->pidx[4 * c + j] = (uint8_t)((l->idx[c] + j) & 63);
    }
    for (int64_t k = 0; k < d / 8; k++) {  /* 0-bit channels read byte base (masked off) */
        int32_t lo = -1;
        for (int64_t c = 8 * k; c < 8 * k + 8; c++)
            if (l->mask[c] && (lo < 0 || l->idx[c] < lo)) lo = l->idx[c];
        l->base[k] = lo < 0 ? 0 : lo;
        for (int64_t c = 8 * k; c < 8 * k + 8; c++) {
            int32_t rel = l->mask[c] ? l->idx[c] - l->base[k] : 0;
            if (rel + 3 > 15) l->shuf_ok = 0;
            for (int j = 0; j < 4; j++) l->shuf[4 * c + j] = (uint8_t)((rel + j) & 15);
        }
    }
    if (row_bytes <= 64) l->row_bytes = (int32_t)row_bytes;
    memset(l->lv, 0, sizeof l->lv);
}

#ifdef __AVX512F__
/* codes 16k .. 16k + 15 of a row of uniform b-bit codes (b <= 4): two 32-bit words of 8 codes each,
 * one per 256-bit half, shifted per lane (sh: 0, b, .., 7b twice) and masked (m); reads 4 bytes
 * from byte 2kb and from (2k + 1)b */
static inline __m512i codes16(const uint8_t *row, int64_t k, int32_t b, __m512i sh, __m512i m) {
    uint32_t w0, w1;
    memcpy(&w0, row + 2 * k * b, 4);
    memcpy(&w1, row + (2 * k + 1) * b, 4);
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32((int)w0)), _mm256_set1_epi32((int)w1), 1);
    return _mm512_and_si512(_mm512_srlv_epi32(v, sh), m);
}

/* codes16's shift pattern and mask for b-bit codes */
static inline __m512i codes16_shifts(int32_t b) {
    return _mm512_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b, 0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
}
#endif

/* codes of a row; reads up to 4 bytes from each channel's byte and 16 from each base (the row is
 * padded: 16 readable bytes follow it) */
static inline void unpack(const uint8_t *row, const layout_t *l, int64_t d, int32_t *codes) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
    if (l->row_bytes && !(l->ubits && l->ubits <= 4)) {  /* the row in one register: a byte permute per 16 codes */
        __m512i rv = _mm512_maskz_loadu_epi8(l->row_bytes == 64 ? ~0ULL : (1ULL << l->row_bytes) - 1, row);
        for (int64_t c = 0; c < d; c += 16) {  /* bytes past the row read 0: they only fill masked-off bits */
            __m512i w = _mm512_permutexvar_epi8(_mm512_loadu_si512((const void *)(l->pidx + 4 * c)), rv);
            w = _mm512_srlv_epi32(w, _mm512_loadu_si512((const void *)(l->sh + c)));
            w = _mm512_and_si512(w, _mm512_loadu_si512((const void *)(l->mask + c)));
            _mm512_storeu_si512((void *)(codes + c), w);
        }
        return;
    }
#endif
#ifdef __AVX512F__
    if (l->ubits && l->ubits <= 4 && d % 16 == 0) {  /* 16 codes from two 32-bit words, stored as one register
                                                        (the 16-lane readers load them whole) */
        int32_t b = l->ubits;
        __m512i sh = codes16_shifts(b), m = _mm512_set1_epi32((1 << b) - 1);
        for (int64_t k = 0; k < d / 16; k++) _mm512_storeu_si512((void *)(codes + 16 * k), codes16(row, k, b, sh, m));
        return;
    }
#endif
#ifdef __AVX2__
    if (l->ubits && l->ubits <= 4) {  /* 8 codes in one 32-bit word: broadcast, shift per lane, mask */
        int32_t b = l->ubits;
        __m256i sh = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
        __m256i m = _mm256_set1_epi32((1 << b) - 1);
        for (int64_t c = 0; c < d; c += 8) {
            uint32_t w;
            memcpy(&w, row + (c / 8) * b, 4);
            __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh), m);
            _mm256_storeu_si256((__m256i *)(codes + c), v);
        }
        return;
    }
    if (l->shuf_ok) {  /* 8 codes within 16 bytes: one load, a byte shuffle, shift and mask per lane */
        for (int64_t c = 0; c < d; c += 8) {
            __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + l->base[c / 8])));
            __m256i w = _mm256_shuffle_epi8(v, _mm256_loadu_si256((const __m256i *)(l->shuf + 4 * c)));
            w = _mm256_srlv_epi32(w, _mm256_loadu_si256((const __m256i *)(l->sh + c)));
            w = _mm256_and_si256(w, _mm256_loadu_si256((const __m256i *)(l->mask + c)));
            _mm256_storeu_si256((__m256i *)(codes + c), w);
        }
        return;
    }
    for (int64_t c = 0; c < d; c += 8) {
        __m256i ix = _mm256_loadu_si256((const __m256i *)(l->idx + c));
        __m256i w = _mm256_i32gather_epi32((const int *)row, ix, 1);
        w = _mm256_srlv_epi32(w, _mm256_loadu_si256((const __m256i *)(l->sh + c)));
        w = _mm256_and_si256(w, _mm256_loadu_si256((const __m256i *)(l->mask + c)));
        _mm256_storeu_si256((__m256i *)(codes + c), w);
    }
#else
    for (int64_t c = 0; c < d; c++) {
        uint32_t w;
        memcpy(&w, row + l->idx[c], 4);
        codes[c] = (int32_t)((w >> l->sh[c]) & (uint32_t)l->mask[c]);
    }
#endif
}

/* float step and zero of block blk for every head (0-bit channels read 0.5 * step + zero) */
static void kivi_block(const side_t *s, int64_t blk, int64_t hkv, int64_t d, float *st, float *zr) {
    for (int64_t h = 0; h < hkv; h++) {
        int64_t base = (blk * hkv + h) * d;
        float zu = 1.0f, su = 1.0f;
        if (s->compact) {
            zu = h2f(s->bsuper[(blk * hkv + h) * 2]);
            su = h2f(s->bsuper[(blk * hkv + h) * 2 + 1]);
        }
        for (int64_t c = 0; c < d; c++) {
            float a, z;
            if (s->compact) {
                a = (float)((const uint8_t *)s->bstep)[base + c] * su;
                z = (float)((const int8_t *)s->bzero)[base + c] * zu;
            } else {
                a = h2f(((const uint16_t *)s->bstep)[base + c]);
                z = h2f(((const uint16_t *)s->bzero)[base + c]);
            }
            if (s->width[h * d + c] == 0) z = 0.5f * a + z;
            st[h * d + c] = a;
            zr[h * d + c] = z;
        }
    }
}

/* the unpackers read up to 16 bytes past a row: a copy of the row in buf, zero-padded, for rows
 * that nothing follows (r >= safe_rows) */
static inline const uint8_t *padded_row(const uint8_t *src, int64_t row_bytes, uint8_t *buf) {
    memcpy(buf, src, (size_t)row_bytes);
    memset(buf + row_bytes, 0, 16);
    return buf;
}

/* row (slot, h) of side s as floats; KIVI uses the block's st/zr (kivi_block); lay: head h's layout */
static inline __attribute__((always_inline)) void decode_row(const side_t *s, int64_t slot, int64_t h, int64_t hkv, int64_t d, const float *st,
                              const float *zr, const layout_t *lay, float *out) {
    int64_t r = slot * hkv + h;
    const uint8_t *src = s->data + r * s->row_bytes;
    uint8_t row[MAXD + 16];
    int32_t codes[MAXD];
    switch (s->code) {
        case S_F32: memcpy(out, src, sizeof(float) * d); return;
        case S_F16: load_row(S_F16, src, 0, d, out); return;
        case S_BF16: for (int64_t c = 0; c < d; c++) out[c] = bf2f(((const uint16_t *)src)[c]); return;
        case S_LUT8: {
            const float *lut = s->lut + h * 256;
            for (int64_t c = 0; c < d; c++) out[c] = lut[src[c]];
            return;
        }
        case S_INT8: {
            float a = h2f(s->scale[r]);
            for (int64_t c = 0; c < d; c++) out[c] = (float)((const int8_t *)src)[c] * a;
            return;
        }
    }
    const uint8_t *rp = r < s->safe_rows ? src : padded_row(src, s->row_bytes, row);
    switch (s->code) {
        case S_INT4: {
            int64_t gs = lay->gs;
            unpack(rp, lay, d, codes);
            for (int64_t g = 0; g < s->groups; g++) {
                float a = h2f(s->scale[r * s->groups + g]), z = h2f(s->zero[r * s->groups + g]);
                for (int64_t c = g * gs; c < (g + 1) * gs; c++) out[c] = (float)codes[c] * a + z;
            }
            return;
        }
        case S_KIVI: {
            unpack(rp, lay, d, codes);
            const float *a = st + h * d, *z = zr + h * d;
            for (int64_t c = 0; c < d; c++) out[c] = (float)codes[c] * a[c] + z[c];
            return;
        }
        case S_CB: {
            int64_t gs = lay->gs;
            unpack(rp, lay, d, codes);
#ifdef __AVX512F__
            if (s->bits <= 4 && gs % 16 == 0) {  /* <= 16 levels in one register: a lane permute per 16 codes */
                __m512 levels = _mm512_loadu_ps(lay->lv);
                for (int64_t g = 0; g < s->groups; g++) {
                    __m512 a = _mm512_set1_ps(h2f(s->scale[r * s->groups + g]));
                    for (int64_t c = g * gs; c < (g + 1) * gs; c += 16) {
                        __m512i ix = _mm512_loadu_si512((const void *)(codes + c));
                        _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_permutexvar_ps(ix, levels), a));
                    }
                }
                return;
            }
#endif
#ifdef __AVX2__
            if (s->bits <= 4 && gs % 8 == 0) {  /* <= 16 levels in two registers: lane permutes and a blend */
                __m256 lo = _mm256_loadu_ps(lay->lv), hi = _mm256_loadu_ps(lay->lv + 8);
                for (int64_t g = 0; g < s->groups; g++) {
                    __m256 a = _mm256_set1_ps(h2f(s->scale[r * s->groups + g]));
                    for (int64_t c = g * gs; c < (g + 1) * gs; c += 8) {
                        __m256i ix = _mm256_loadu_si256((const __m256i *)(codes + c));
                        __m256 v = _mm256_permutevar8x32_ps(lo, ix);  /* index bits 0-2; bit 3 picks hi */
                        if (s->bits == 4)
                            v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, ix),
                                                 _mm256_castsi256_ps(_mm256_slli_epi32(ix, 28)));
                        _mm256_storeu_ps(out + c, _mm256_mul_ps(v, a));
                    }
                }
                return;
            }
#endif
            for (int64_t g = 0; g < s->groups; g++) {
                float a = h2f(s->scale[r * s->groups + g]);
                for (int64_t c = g * gs; c < (g + 1) * gs; c++) out[c] = s->lut[codes[c]] * a;
            }
            return;
        }
    }
}

/* y = RoPE(x) at the position of the cos/sin rows */
static inline void rope_row(const float *restrict x, const float *cos, const float *sin, int64_t d, float *restrict y) {
    int64_t half = d / 2;
    for (int64_t c = 0; c < half; c++) y[c] = x[c] * cos[c] + x[c + half] * sin[c];
    for (int64_t c = half; c < d; c++) y[c] = x[c] * cos[c] + x[c - half] * sin[c];
}

static inline int coded_rows(int64_t bits) { return bits >= 2 && bits <= 8; }

/* row r of a coded exact pool (row_bytes = b * d / 8, scale fp16 per row) as floats: n = 2^b,
 * value[c] = (2 * code_c - (n - 1)) * (scale / (n - 1)), the scale factor rounded to float once
 * (row_dequantize's order); lay: the uniform b-bit layout (make_layout without widths) */
static void coded_row(const uint8_t *data, const uint16_t *scale, int64_t r, int64_t bits, int64_t row_bytes,
                      const layout_t *lay, int64_t d, float *out) {
    const uint8_t *src = data + r * row_bytes;
    float nm1 = (float)((1 << bits) - 1), a = h2f(scale[r]) / nm1;
    if (bits == 8) {  /* the byte is the code */
        for (int64_t c = 0; c < d; c++) out[c] = ((float)(2 * (int32_t)src[c]) - nm1) * a;
        return;
    }
    uint8_t row[MAXD + 16];
    int32_t codes[MAXD];
    unpack(padded_row(src, row_bytes, row), lay, d, codes);
    for (int64_t c = 0; c < d; c++) out[c] = ((float)(2 * codes[c]) - nm1) * a;
}

/* exact_row of a coded side (kept out of line: the plain path stays as it was) */
static __attribute__((noinline)) void exact_coded(const exact_t *e, int kv, const layout_t *lay,
                                                  const int64_t *table, int64_t t, int64_t bs, int64_t h,
                                                  int64_t hkv, int64_t d, float *out) {
    int64_t bits = kv ? e->v_bits : e->k_bits, rb = kv ? e->v_row_bytes : e->k_row_bytes;
    if (e->sink && t < e->sink) {
        int32_t ss = e->smap[table[0]];
        if (ss < 0) { memset(out, 0, sizeof(float) * d); return; }
        coded_row(kv ? e->sv : e->sk, kv ? e->sv_scale : e->sk_scale, (ss * e->sink + t) * hkv + h, bits, rb, lay,
                  d, out);
        return;
    }
    int32_t st = e->map[table[t / bs]];
    if (st < 0) st = 0;  /* the reference's clamp, as in exact_row */
    coded_row(kv ? e->v : e->k, kv ? e->v_scale : e->k_scale, (st * bs + t % bs) * hkv + h, bits, rb, lay, d, out);
}

/* exact K (kv = 0) or V (kv = 1) row of position t, head h; lay: that side's coded-row layout */
static void exact_row(const exact_t *e, int kv, const layout_t *lay, const int64_t *table, int64_t t,
                      int64_t bs, int64_t h, int64_t hkv, int64_t d, float *out) {
    if (coded_rows(kv ? e->v_bits : e->k_bits)) {
        exact_coded(e, kv, lay, table, t, bs, h, hkv, d, out);
        return;
    }
    if (e->sink && t < e->sink) {
        int32_t ss = e->smap[table[0]];
        if (ss < 0) { memset(out, 0, sizeof(float) * d); return; }
        load_row(S_F16, kv ? e->sv : e->sk, (ss * e->sink + t) * hkv + h, d, out);
        return;
    }
    int32_t st = e->map[table[t / bs]];
    if (st < 0) st = 0;  /* the reference's clamp: rows of a block no query reads exactly */
    load_row(e->dtype, kv ? e->v : e->k, (st * bs + t % bs) * hkv + h, d, out);
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
    for (int64_t c = 0; c < d; c++) acc += a[c] * b[c];
    return acc;
}

/* 8 floats (GCC/Clang vector extension: an AVX2 register, two NEON ones); d is a multiple of 8 */
typedef float v8 __attribute__((vector_size(32)));
static inline v8 ld8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline float hsum8(v8 a) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += a[i];
    return s;
}

/* sc[j * t_max] = scale * (the sum of a_j's lanes), j < n */
static inline __attribute__((always_inline)) void store_sums(v8 a0, v8 a1, v8 a2, v8 a3, float scale, float *sc,
                                                             int64_t t_max, const int n) {
#ifdef __AVX__
    if (n > 1) {  /* the four sums at once: pairwise adds, then the two 128-bit halves */
        __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
        float r[4];
        _mm_storeu_ps(r, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
                                    _mm_set1_ps(scale)));
        for (int j = 0; j < n; j++) sc[j * t_max] = r[j];
        return;
    }
#endif
    sc[0] = hsum8(a0) * scale;
    if (n > 1) sc[t_max] = hsum8(a1) * scale;
    if (n > 2) sc[2 * t_max] = hsum8(a2) * scale;
    if (n > 3) sc[3 * t_max] = hsum8(a3) * scale;
}

#ifdef __AVX512F__
/* 16 floats: one AVX-512 register */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
static inline v16 ld16(const float *p) { v16 r; memcpy(&r, p, sizeof r); return r; }
static inline vi16 ldi16(const int32_t *p) { vi16 r; memcpy(&r, p, sizeof r); return r; }
/* the low and high 8 lanes added: a 16-lane sum as an 8-lane one */
static inline v8 fold16(v16 a) {
    __m512 z = (__m512)a;
    return (v8)_mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
}
#endif

/* sc[j * t_max] = scale * q_j . row for n (a constant after inlining) query heads sharing each load */
static inline __attribute__((always_inline)) void scores_n(const float *q, int64_t qhs, const float *row, int64_t d,
                                                           float scale, float *sc, int64_t t_max, const int n) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t x = 0; x < d; x += 8) {
        v8 kv = ld8(row + x);
        a0 += ld8(q + x) * kv;
        if (n > 1) a1 += ld8(q + qhs + x) * kv;
        if (n > 2) a2 += ld8(q + 2 * qhs + x) * kv;
        if (n > 3) a3 += ld8(q + 3 * qhs + x) * kv;
    }
    store_sums(a0, a1, a2, a3, scale, sc, t_max, n);
}

/* the g query heads of one KV head against one K row, 4 at a time */
static inline void scores_row(const float *q, int64_t qhs, const float *row, int64_t g, int64_t d, float scale,
                              float *sc, int64_t t_max) {
    for (int64_t j = 0; j < g; j += 4) {
        const float *qj = q + j * qhs;
        float *sj = sc + j * t_max;
        switch (g - j) {
            case 1: scores_n(qj, qhs, row, d, scale, sj, t_max, 1); break;
            case 2: scores_n(qj, qhs, row, d, scale, sj, t_max, 2); break;
            case 3: scores_n(qj, qhs, row, d, scale, sj, t_max, 3); break;
            default: scores_n(qj, qhs, row, d, scale, sj, t_max, 4);
        }
    }
}

/* scale * (n query heads) . key for one KIVI key row, the key never stored: per 8 channels
 * k = codes * step + zero in registers, with RoPE (rope: +pre keys at the cos/sin row) channels c
 * and c + d/2 together, y_lo = k_lo cos_lo + k_hi sin_lo, y_hi = k_hi cos_hi + k_lo sin_hi (what
 * rope_row computes), then dotted with each head's q; d a multiple of 16 */
typedef int32_t vi8 __attribute__((vector_size(32)));
static inline vi8 ldi8(const int32_t *p) { vi8 r; memcpy(&r, p, sizeof r); return r; }
/* kivi_scores_n's loop for a vector type V of W floats (LD, LDI its float and int loads): the
 * sums of each head j < n in acc[j] (one body for the 8- and 16-lane paths) */
#define KIVI_SCORES_LOOP(V, W, LD, LDI, acc)                                                        \
    for (int64_t x = 0; x < half; x += W) {                                                         \
        int64_t y = x + half;                                                                       \
        V lo = __builtin_convertvector(LDI(codes + x), V) * LD(a + x) + LD(z + x);                  \
        V hi = __builtin_convertvector(LDI(codes + y), V) * LD(a + y) + LD(z + y);                  \
        if (rope) {                                                                                 \
            V rl = lo * LD(cos + x) + hi * LD(sin + x);                                             \
            hi = hi * LD(cos + y) + lo * LD(sin + y);                                               \
            lo = rl;                                                                                \
        }                                                                                           \
        for (int j = 0; j < n; j++) acc[j] += LD(q + j * qhs + x) * lo + LD(q + j * qhs + y) * hi; \
    }
static inline __attribute__((always_inline)) void kivi_scores_n(
        const int32_t *codes, const float *a, const float *z, const float *cos, const float *sin, const float *q,
        int64_t qhs, int64_t d, float scale, float *sc, int64_t t_max, const int n, const int rope) {
    int64_t half = d / 2;
#ifdef __AVX512F__
    if (half % 16 == 0) {  /* the same sums over 16 channels at a time */
        v16 b[4] = {{0}, {0}, {0}, {0}};
        KIVI_SCORES_LOOP(v16, 16, ld16, ldi16, b)
        store_sums(fold16(b[0]), fold16(b[1]), fold16(b[2]), fold16(b[3]), scale, sc, t_max, n);
        return;
    }
#endif
    v8 acc[4] = {{0}, {0}, {0}, {0}};
    KIVI_SCORES_LOOP(v8, 8, ld8, ldi8, acc)
    store_sums(acc[0], acc[1], acc[2], acc[3], scale, sc, t_max, n);
}
#undef KIVI_SCORES_LOOP

/* the g query heads of one KV head against one KIVI key row (codes unpacked), 4 at a time */
static inline void kivi_scores_row(const int32_t *codes, const float *a, const float *z, const float *cos,
                                   const float *sin, const float *q, int64_t qhs, int64_t g, int64_t d, float scale,
                                   float *sc, int64_t t_max) {
    for (int64_t j = 0; j < g; j += 4) {
        const float *qj = q + j * qhs;
        float *sj = sc + j * t_max;
        int64_t n = g - j < 4 ? g - j : 4;
        if (cos) {
            if (n == 3) kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 3, 1);
            else if (n == 4) kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 4, 1);
            else if (n == 2) kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 2, 1);
            else kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 1, 1);
        } else {
            if (n == 3) kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 3, 0);
            else if (n == 4) kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 4, 0);
            else if (n == 2) kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 2, 0);
            else kivi_scores_n(codes, a, z, cos, sin, qj, qhs, d, scale, sj, t_max, 1, 0);
        }
    }
}

#ifdef __AVX512F__
/* lane i: the sum of r[i]'s 16 lanes. A transposing tree of adds (halves, quarters, pairs, lanes)
 * leaves lane L holding r[P(L)], P = (0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15), an involution that
 * one permute undoes */
static inline __m512 sums16(const __m512 *r) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[i], r[i + 8], 0x44), _mm512_shuffle_f32x4(r[i], r[i + 8], 0xEE));
    for (int i = 0; i < 4; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88), _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[i], y[i + 2], 0x44), _mm512_shuffle_ps(y[i], y[i + 2], 0xEE));
    __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), w);
}

/* sc[j * t_max + t] = scale * q_j . key(t) for G (<= 4) query heads j and the KIVI key rows
 * t0 <= t < t1 of one block (slot slot0 + t - t0, KV head h), D channels (a constant): per token the
 * key in registers as kivi_scores_n makes it (codes * step + zero, RoPE'd at min(t, n_pos - 1) when
 * rope), dotted with each head's q in 16-lane partial sums, which sums16 reduces 16 tokens at a
 * time (one reduction per 16 scores instead of one per score) */
static inline __attribute__((always_inline)) void kivi_span_n(const side_t *ks, const layout_t *lay, int64_t slot0,
                                                              int64_t t0, int64_t t1, int64_t h, int64_t hkv,
                                                              const float *a, const float *z, const float *q,
                                                              int64_t qhs, float scale, float *sc, int64_t t_max,
                                                              const int G, const int rope, const int D,
                                                              const int REG) {
    const int H = D / 2;
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
    __m512i P[MAXD / 16], SH[MAXD / 16], M[MAXD / 16];  /* REG: the layout's permute, shifts and masks */
    __mmask64 rmask = 0;
    if (REG) {
        rmask = lay->row_bytes == 64 ? ~0ULL : (1ULL << lay->row_bytes) - 1;
        for (int x = 0; x < D; x += 16) {
            P[x / 16] = _mm512_loadu_si512((const void *)(lay->pidx + 4 * x));
            SH[x / 16] = _mm512_loadu_si512((const void *)(lay->sh + x));
            M[x / 16] = _mm512_loadu_si512((const void *)(lay->mask + x));
        }
    }
#endif
    for (int64_t c0 = t0; c0 < t1; c0 += 16) {
        int64_t m = t1 - c0 < 16 ? t1 - c0 : 16;
        __m512 part[4][16];
        for (int64_t u = 0; u < m; u++) {
            int64_t t = c0 + u, r = (slot0 + t - t0) * hkv + h;
            const uint8_t *src = ks->data + r * ks->row_bytes;
            __m512i C[MAXD / 16];  /* the codes, 16 per register */
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
            if (REG) {  /* the row in one masked load (nothing read past it), a byte permute per 16 codes */
                __m512i rv = _mm512_maskz_loadu_epi8(rmask, src);
                for (int x = 0; x < D; x += 16) C[x / 16] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(P[x / 16], rv), SH[x / 16]), M[x / 16]);
            } else
#endif
            {
                uint8_t cp[MAXD + 16];
                int32_t codes[MAXD];
                if (r >= ks->safe_rows) src = padded_row(src, ks->row_bytes, cp);
                unpack(src, lay, D, codes);
                for (int x = 0; x < D; x += 16) C[x / 16] = _mm512_loadu_si512((const void *)(codes + x));
            }
            const float *cs = 0, *sn = 0;
            if (rope) {
                int64_t p = t < ks->n_pos ? t : ks->n_pos - 1;
                cs = ks->cos + p * D;
                sn = ks->sin + p * D;
            }
            __m512 v[4];
            for (int j = 0; j < G; j++) v[j] = _mm512_setzero_ps();
            for (int x = 0; x < H; x += 16) {
                int y = x + H;
                __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(C[x / 16]),
                                            _mm512_loadu_ps(a + x), _mm512_loadu_ps(z + x));
                __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(C[y / 16]),
                                            _mm512_loadu_ps(a + y), _mm512_loadu_ps(z + y));
                if (rope) {
                    __m512 rl = _mm512_fmadd_ps(lo, _mm512_loadu_ps(cs + x), _mm512_mul_ps(hi, _mm512_loadu_ps(sn + x)));
                    hi = _mm512_fmadd_ps(hi, _mm512_loadu_ps(cs + y), _mm512_mul_ps(lo, _mm512_loadu_ps(sn + y)));
                    lo = rl;
                }
                for (int j = 0; j < G; j++)
                    v[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * qhs + x), lo,
                                           _mm512_fmadd_ps(_mm512_loadu_ps(q + j * qhs + y), hi, v[j]));
            }
            for (int j = 0; j < G; j++) part[j][u] = v[j];
        }
        for (int64_t u = m; u < 16; u++)
            for (int j = 0; j < G; j++) part[j][u] = _mm512_setzero_ps();
        __mmask16 mk = (__mmask16)((1u << m) - 1u);
        for (int j = 0; j < G; j++)
            _mm512_mask_storeu_ps(sc + j * t_max + c0, mk, _mm512_mul_ps(sums16(part[j]), _mm512_set1_ps(scale)));
    }
}

/* kivi_span_n for the g query heads of KV head h, 4 at a time (d: 64 or 128) */
static void kivi_span(const side_t *ks, const layout_t *lay, int64_t slot0, int64_t t0, int64_t t1, int64_t h,
                      int64_t hkv, const float *a, const float *z, const float *q, int64_t qhs, int64_t g, int64_t d,
                      float scale, float *sc, int64_t t_max) {
    for (int64_t j = 0; j < g; j += 4) {
        const float *qj = q + j * qhs;
        float *sj = sc + j * t_max;
        int n = g - j < 4 ? (int)(g - j) : 4, rope = ks->cos != 0;
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define KIVI_SPAN(N, R, D) if (lay->row_bytes) kivi_span_n(ks, lay, slot0, t0, t1, h, hkv, a, z, qj, qhs, scale, sj, t_max, N, R, D, 1); \
                           else kivi_span_n(ks, lay, slot0, t0, t1, h, hkv, a, z, qj, qhs, scale, sj, t_max, N, R, D, 0)
#else
#define KIVI_SPAN(N, R, D) kivi_span_n(ks, lay, slot0, t0, t1, h, hkv, a, z, qj, qhs, scale, sj, t_max, N, R, D, 0)
#endif
#define KIVI_SPAN_D(N, R) if (d == 64) { KIVI_SPAN(N, R, 64); } else { KIVI_SPAN(N, R, 128); }
#define KIVI_SPAN_R(N) if (rope) { KIVI_SPAN_D(N, 1); } else { KIVI_SPAN_D(N, 0); }
        switch (n) {
            case 1: KIVI_SPAN_R(1) break;
            case 2: KIVI_SPAN_R(2) break;
            case 3: KIVI_SPAN_R(3) break;
            default: KIVI_SPAN_R(4)
        }
#undef KIVI_SPAN_R
#undef KIVI_SPAN_D
#undef KIVI_SPAN
    }
}
#endif

/* axpy_tile's 4-register block for a vector type V of W floats (LD its load): outputs x .. x + 4W,
 * four named accumulators (an array of them measured 3-4% slower) */
#define AXPY_BLOCK(V, W, LD)                                                                        \
    for (; x + 4 * W <= d; x += 4 * W) {                                                            \
        V a0 = LD(a + x), a1 = LD(a + x + W), a2 = LD(a + x + 2 * W), a3 = LD(a + x + 3 * W);       \
        for (int64_t i = 0; i < n; i++) {                                                           \
            const float *r = tile + i * d + x;                                                      \
            float wi = w[i];                                                                        \
            a0 += wi * LD(r);                                                                       \
            a1 += wi * LD(r + W);                                                                   \
            a2 += wi * LD(r + 2 * W);                                                               \
            a3 += wi * LD(r + 3 * W);                                                               \
        }                                                                                           \
        memcpy(a + x, &a0, sizeof a0);                                                              \
        memcpy(a + x + W, &a1, sizeof a1);                                                          \
        memcpy(a + x + 2 * W, &a2, sizeof a2);                                                      \
        memcpy(a + x + 3 * W, &a3, sizeof a3);                                                      \
    }
/* a[x] += sum_i w[i] * tile[i][x] over n rows of d, the sum over rows in order, 4 registers of
 * outputs at a time (64 with AVX-512, then 32) */
static inline void axpy_tile(const float *tile, int64_t n, int64_t d, const float *w, float *a) {
    int64_t x = 0;
#ifdef __AVX512F__
    AXPY_BLOCK(v16, 16, ld16)
#endif
    AXPY_BLOCK(v8, 8, ld8)
#undef AXPY_BLOCK
    for (; x < d; x += 8) {
        v8 a0 = ld8(a + x);
        for (int64_t i = 0; i < n; i++) a0 += w[i] * ld8(tile + i * d + x);
        memcpy(a + x, &a0, 32);
    }
}

#ifdef __AVX512F__
/* acc[j * 64 ..] += sum_{i < n} w[j * t_max + i] * value(row slot0 + i) for the G query heads of KV
 * head h: codebook values of <= 4 uniform bits, head_dim 64, decoded in registers and accumulated
 * at once (decode_row's S_CB path and axpy_tile in one pass: the same products, summed over the rows
 * in the same order, without the tile in memory) */
static inline __attribute__((always_inline)) void cb_accumulate_n(const side_t *s, int64_t slot0, int64_t n,
                                                                  int64_t h, int64_t hkv, const layout_t *lay,
                                                                  const float *w, int64_t t_max, float *acc,
                                                                  const int G) {
    const int64_t d = 64;
    int32_t b = lay->ubits;
    __m512i sh = codes16_shifts(b), m = _mm512_set1_epi32((1 << b) - 1);
    __m512 levels = _mm512_loadu_ps(lay->lv);
    __m512 A[4][4];
    for (int j = 0; j < G; j++)
        for (int k = 0; k < 4; k++) A[j][k] = _mm512_loadu_ps(acc + j * d + 16 * k);
    /* rows below safe_rows are read in place, the tensor's last rows from a padded copy (the words
     * read up to 3 bytes past a row): two loops, so that no copy (a call, which would push the
     * accumulators out of registers) sits in the first */
    int64_t fast = s->safe_rows - h <= 0 ? 0 : (s->safe_rows - h + hkv - 1) / hkv - slot0;
    fast = fast < 0 ? 0 : fast > n ? n : fast;
#define CB_ROW(ROW, R, I)                                                                               \
    do {                                                                                                \
        __m512 v[4];                                                                                    \
        for (int k = 0; k < 4; k++)                                                                     \
            v[k] = _mm512_mul_ps(_mm512_permutexvar_ps(codes16(ROW, k, b, sh, m), levels),              \
                                 _mm512_set1_ps(h2f(s->scale[(R) * s->groups + 16 * k / lay->gs])));    \
        for (int j = 0; j < G; j++) {                                                                   \
            __m512 wj = _mm512_set1_ps(w[j * t_max + (I)]);                                             \
            for (int k = 0; k < 4; k++) A[j][k] = _mm512_fmadd_ps(wj, v[k], A[j][k]);                   \
        }                                                                                               \
    } while (0)
    for (int64_t i = 0; i < fast; i++) {
        int64_t r = (slot0 + i) * hkv + h;
        CB_ROW(s->data + r * s->row_bytes, r, i);
    }
    for (int64_t i = fast; i < n; i++) {
        int64_t r = (slot0 + i) * hkv + h;
        uint8_t cp[MAXD + 16];
        const uint8_t *row = padded_row(s->data + r * s->row_bytes, s->row_bytes, cp);
        CB_ROW(row, r, i);
    }
#undef CB_ROW
    for (int j = 0; j < G; j++)
        for (int k = 0; k < 4; k++) _mm512_storeu_ps(acc + j * d + 16 * k, A[j][k]);
}

/* cb_accumulate_n for g query heads (a constant per call, so the accumulators stay in registers) */
static void cb_accumulate(const side_t *s, int64_t slot0, int64_t n, int64_t h, int64_t hkv, int64_t g,
                          const layout_t *lay, const float *w, int64_t t_max, float *acc) {
    switch (g) {
        case 1: cb_accumulate_n(s, slot0, n, h, hkv, lay, w, t_max, acc, 1); return;
        case 2: cb_accumulate_n(s, slot0, n, h, hkv, lay, w, t_max, acc, 2); return;
        case 3: cb_accumulate_n(s, slot0, n, h, hkv, lay, w, t_max, acc, 3); return;
        default: cb_accumulate_n(s, slot0, n, h, hkv, lay, w, t_max, acc, 4);
    }
}
#endif

void quant_decode_f32(const float *q, int64_t q_tok_stride, int64_t q_head_stride, const side_t *ks,
                      const side_t *vs, const exact_t *ex, const int64_t *tables, int64_t width,
                      const int64_t *lens, int64_t n_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                      float scale, float *scores, int64_t t_max, float *out, int64_t n_threads) {
    int64_t g = hq / hkv;
    layout_t klay[32], vlay[32];  /* per KV head (hkv <= 32): read by every thread */
    layout_t kxl, vxl;            /* coded exact rows (uniform widths, every head alike) */
    (void)n_threads;
    if (coded_rows(ex->k_bits)) make_layout(0, 0, ex->k_bits, d, ex->k_row_bytes, 0, &kxl);
    if (coded_rows(ex->v_bits)) make_layout(0, 0, ex->v_bits, d, ex->v_row_bytes, 0, &vxl);
    for (int64_t h = 0; h < hkv; h++) {
        make_layout(ks->width ? ks->width + h * d : 0, ks->offset ? ks->offset + h * d : 0,
                    ks->code == S_INT4 ? 4 : ks->bits, d, ks->row_bytes, ks->groups, klay + h);
        make_layout(vs->width ? vs->width + h * d : 0, vs->offset ? vs->offset + h * d : 0,
                    vs->code == S_INT4 ? 4 : vs->bits, d, vs->row_bytes, vs->groups, vlay + h);
        if (vs->code == S_CB && vs->bits <= 4) memcpy(vlay[h].lv, vs->lut, sizeof(float) << vs->bits);
    }
#ifdef __AVX512F__
    /* codebook values of <= 4 uniform bits at head_dim 64, <= 4 query heads per KV head: decoded and
     * accumulated in registers (cb_accumulate) */
    int cb_fused = vs->code == S_CB && vs->bits <= 4 && vlay[0].ubits && d == 64 && vlay[0].gs % 16 == 0 && g <= 4;
    int kivi_spans = ks->code == S_KIVI && (d == 64 || d == 128);  /* KIVI keys scored 16 tokens at a time */
#endif
    int fused = ks->code == S_KIVI && d % 16 == 0;  /* KIVI keys dequantized in registers, row by row */
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) if (n_threads > 1)
    for (int64_t s = 0; s < n_seqs; s++) {
        int64_t len = lens[s];
        const int64_t *table = tables + s * width;
        const float *qs = q + s * q_tok_stride;
        float *o = out + s * hq * d, *sc = scores + s * hq * t_max;
        float kst[MAXHD], kzr[MAXHD], vst[MAXHD], vzr[MAXHD], row[MAXD];
        float oc[MAXHD], oe[MAXHD];  /* value accumulators: from codes (rotated frame), from exact rows */
        float tile[TILE * MAXD];     /* decoded V rows of one tile */
        float roped[MAXD];
        int64_t kblk = -1, vblk = -1;
        memset(o, 0, sizeof(float) * hq * d);
        if (len == 0) continue;
        /* 1. scores */
        for (int64_t t = 0, bi = 0; t < len; t++) {
            if (t == (bi + 1) * bs) bi++;
            int64_t blk = table[bi], slot = blk * bs + t - bi * bs;
            int exact = ex->windowed ? IN_WINDOW(ex, t, len) : (ex->map != 0 && ex->map[blk] >= 0);
            if (!exact && ks->code == S_KIVI && blk != kblk) { kivi_block(ks, blk, hkv, d, kst, kzr); kblk = blk; }
#ifdef __AVX512F__
            if (!exact && kivi_spans) {  /* the run of coded rows from t to the block's end or the next exact row */
                int64_t lim = (bi + 1) * bs < len ? (bi + 1) * bs : len, t1 = t + 1;
                if (ex->windowed) while (t1 < lim && !IN_WINDOW(ex, t1, len)) t1++;
                else t1 = lim;  /* staging is per block */
                for (int64_t h = 0; h < hkv; h++)
                    kivi_span(ks, klay + h, slot, t, t1, h, hkv, kst + h * d, kzr + h * d, qs + h * g * q_head_stride,
                              q_head_stride, g, d, scale, sc + h * g * t_max, t_max);
                t = t1 - 1;
                continue;
            }
#endif
            for (int64_t h = 0; h < hkv; h++) {
                const float *key = row;
                if (exact) exact_row(ex, 0, &kxl, table, t, bs, h, hkv, d, row);
                else if (fused) {  /* KIVI keys: dequantized (and RoPE'd) in registers, scored at once */
                    int64_t r = slot * hkv + h;
                    const uint8_t *src = ks->data + r * ks->row_bytes;
                    uint8_t cp[MAXD + 16];
                    if (r >= ks->safe_rows) src = padded_row(src, ks->row_bytes, cp);
                    int32_t codes[MAXD];
                    unpack(src, klay + h, d, codes);
                    int64_t p = ks->cos ? (t < ks->n_pos ? t : ks->n_pos - 1) : 0;
                    kivi_scores_row(codes, kst + h * d, kzr + h * d, ks->cos ? ks->cos + p * d : 0,
                                    ks->cos ? ks->sin + p * d : 0, qs + h * g * q_head_stride, q_head_stride, g, d,
                                    scale, sc + h * g * t_max + t, t_max);
                    continue;
                } else {
                    decode_row(ks, slot, h, hkv, d, kst, kzr, klay + h, row);
                    if (ks->cos) {
                        int64_t p = t < ks->n_pos ? t : ks->n_pos - 1;
                        rope_row(row, ks->cos + p * d, ks->sin + p * d, d, roped);
                        key = roped;
                    }
                }
                scores_row(qs + h * g * q_head_stride, q_head_stride, key, g, d, scale, sc + h * g * t_max + t, t_max);
            }
        }
        /* 2. softmax numerators; norm = 1 / sum */
        float norm[1024];
        for (int64_t i = 0; i < hq; i++) {
            float *x = sc + i * t_max, m = x[0], sum = 0.0f;
            for (int64_t t = 1; t < len; t++) m = x[t] > m ? x[t] : m;
            for (int64_t t = 0; t < len; t++) { x[t] = expf(x[t] - m); sum += x[t]; }
            norm[i] = 1.0f / sum;
        }
        /* 3. values */
        int vex = ex->windowed && ex->v != 0;  /* V rows of the sink and window are read exactly */
#define V_EXACT(t) (vex && IN_WINDOW(ex, t, len))
        memset(oc, 0, sizeof(float) * hq * d);
        memset(oe, 0, sizeof(float) * hq * d);
        for (int64_t t0 = 0, t1; t0 < len; t0 = t1) {  /* tiles of <= TILE rows: one block, one kind */
            int64_t bi = t0 / bs, blk = table[bi], lim = (bi + 1) * bs < len ? (bi + 1) * bs : len;
            int exact = V_EXACT(t0);
            if (lim > t0 + TILE) lim = t0 + TILE;
            for (t1 = t0 + 1; t1 < lim && V_EXACT(t1) == exact; t1++) {}
            if (!exact && vs->code == S_KIVI && blk != vblk) { kivi_block(vs, blk, hkv, d, vst, vzr); vblk = blk; }
            for (int64_t h = 0; h < hkv; h++) {
                float *acc = exact ? oe : oc;
#ifdef __AVX512F__
                if (!exact && cb_fused) {
                    cb_accumulate(vs, blk * bs + t0 - bi * bs, t1 - t0, h, hkv, g, vlay + h, sc + h * g * t_max + t0,
                                  t_max, acc + h * g * d);
                    continue;
                }
#endif
                for (int64_t t = t0; t < t1; t++) {
                    if (exact) exact_row(ex, 1, &vxl, table, t, bs, h, hkv, d, tile + (t - t0) * d);
                    else decode_row(vs, blk * bs + t - bi * bs, h, hkv, d, vst, vzr, vlay + h, tile + (t - t0) * d);
                }
                for (int64_t j = 0; j < g; j++)
                    axpy_tile(tile, t1 - t0, d, sc + (h * g + j) * t_max + t0, acc + (h * g + j) * d);
            }
        }
#undef V_EXACT
        /* 4. rotate the code part back (out = oc @ H^T), add the exact part, normalise */
        for (int64_t i = 0; i < hq; i++) {
            float *a = oc + i * d, *b = oe + i * d, *y = o + i * d;
            if (vs->hadamard)
                for (int64_t c = 0; c < d; c++) y[c] = dot(a, vs->hadamard + c * d, d);
            else memcpy(y, a, sizeof(float) * d);
            for (int64_t c = 0; c < d; c++) y[c] = (y[c] + b[c]) * norm[i];
        }
    }
}
