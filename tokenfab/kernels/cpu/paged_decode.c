/*
 * Paged decode attention for the CPU: one query token per sequence, keys and values read in
 * place from the paged cache (no gather copy, no padding to the longest context).
 *
 * Why C: on CPU the PyTorch reference has to copy every sequence's pages into one padded
 * block before it can call SDPA; at 64 sequences that copy plus the padded attention was ~45%
 * of a decode step. Decode attention is a memory-bound scan of the cache, so reading each page
 * once where it lies is the whole win. Prefill keeps the PyTorch path (matrix products).
 *
 * Semantics are those of tokenfab.kernels.attention.paged_attention_ref with max_query_len 1:
 * sequence b has ctx[b] keys; its query sits at position ctx[b] - 1; window > 0 keeps the last
 * `window` keys; softcap > 0 maps logits through softcap * tanh(x / softcap); sinks (one float
 * per query head, or NULL) join the softmax denominator without a value.
 *
 * Layouts (strides in elements; the last dimension of every tensor is contiguous):
 *   q     [B, Hq, D]            strides q_sb, q_sh
 *   k     [NB, BS, Hkv, D]      strides k_sblk, k_sslot, k_sh
 *   v     [NB, BS, Hkv, Dv]     strides v_sblk, v_sslot, v_sh
 *   table [B, max_blocks] int32 row stride bt_s
 *   out   [B, Hq, Dv]           contiguous
 * Work is split over sequences with OpenMP (and over kv heads too when there are few sequences);
 * a task reads each token's key row (all its heads, contiguous) once and computes every query
 * head of the GQA groups that share it. Keys
 * are taken 16 at a time: 16 dot products accumulate in 16 vector registers and are reduced
 * together by a transpose-add tree (AVX-512), instead of one horizontal sum per dot product.
 * Softmax is exact (two passes over the scores, which stay in a per-task buffer).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* PF_TILES: how many 16-token tiles ahead the next rows are prefetched. The prefetches of one
 * tile are spread over the dot products (or value updates) of the current one: issued in one
 * burst, ~200 of them stall the core once its fill buffers are full (perf showed half the
 * kernel's time on the prefetch loop); spread out, the kernel reads ~10% faster. */
enum { TILE = 16, PF_TILES = 2 };

typedef struct {
    const void *q, *k, *v;
    const int32_t *table, *ctx;
    void *out;
    int64_t B, Hq, Hkv, D, Dv, BS;
    int64_t q_sb, q_sh, k_sblk, k_sslot, k_sh, v_sblk, v_sslot, v_sh, bt_s;
    float scale, softcap;
    int64_t window;
    const float *sinks;
    int bf16;
} Args;

#ifdef __AVX512F__
/* lane i of the result is the sum of acc[i]'s 16 lanes: a transpose-add tree, 15 shuffle-add
 * steps for 16 dot products instead of 16 horizontal sums */
static inline __m512 reduce16(const __m512 *acc) {
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++)
        l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                              _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        l2[i] = _mm512_add_ps(_mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        l3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#ifdef __AVX512BF16__
#define HAVE_DOT16_BF16 1
/* out[i] = scale * dot(q, rows[i]) for bfloat16 q and rows of D elements (D % 32 == 0): the
 * bf16 pair products are exact in float and summed in float (vdpbf16ps), with no widening. */
static inline void dot16_bf16(const uint16_t *q, const uint16_t *const *rows, int64_t D, float scale, float *out) {
    __m512 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 32) {
        __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
        for (int i = 0; i < TILE; i++) acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(rows[i] + c));
    }
    _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}
#else
#define HAVE_DOT16_BF16 0
#endif

/* out[i] = dot(q, rows[i]) for i < TILE; rows are D floats each. */
static inline void dot16(const float *q, const float *const *rows, int64_t D, float *out) {
#ifdef __AVX512F__
    if (D % 16 == 0) {
        __m512 acc[TILE];
        for (int i = 0; i < TILE; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            __m512 qv = _mm512_loadu_ps(q + c);
            for (int i = 0; i < TILE; i++) acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[i] + c), acc[i]);
        }
        __m512 r = reduce16(acc);
        _mm512_storeu_ps(out, r); /* lane i of r is dot(q, rows[i]) */
        return;
    }
#endif
    for (int i = 0; i < TILE; i++) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; d++) s += q[d] * rows[i][d];
        out[i] = s;
    }
}

/* ask for the cache lines of [p, p + bytes) ahead of use (random pages defeat the hardware
 * prefetcher at every block boundary); locality 1 (prefetcht2): the rows are read once */
static inline void prefetch_span(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

/* The rows of the tile PF_TILES ahead, to be prefetched a few at a time (spread_prefetch_step)
 * between the current tile's R row computations. */
typedef struct {
    const char *row[TILE];
    int n, next, per_step;
    int64_t span;
} SpreadPrefetch;

/* base: the cache (k or v); rows of tokens [t0, t0 + TILE) of heads from h0, `span` bytes each */
static inline void spread_prefetch_init(SpreadPrefetch *p, const char *base, const int32_t *bt, int64_t t0,
                                        int64_t L, int64_t BS, int64_t s_blk, int64_t s_slot, int64_t head_off,
                                        int64_t esz, int64_t span, int64_t steps) {
    p->n = 0;
    p->next = 0;
    p->span = span;
    for (int64_t t = t0; t < t0 + TILE && t < L; t++)
        p->row[p->n++] = base + ((int64_t)bt[t / BS] * s_blk + (t % BS) * s_slot + head_off) * esz;
    p->per_step = (int)((p->n + steps - 1) / steps);
}

static inline void spread_prefetch_step(SpreadPrefetch *p) {
    for (int j = 0; j < p->per_step && p->next < p->n; j++) prefetch_span(p->row[p->next++], p->span);
}

/* acc[d] += sum_i p[i] * rows[i][d] over cnt rows of Dv floats */
static inline void axpy_tile(float *acc, const float *p, const float *const *rows, int cnt, int64_t Dv) {
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 16 <= Dv; c += 16) {
        __m512 av = _mm512_loadu_ps(acc + c);
        for (int i = 0; i < cnt; i++) av = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), _mm512_loadu_ps(rows[i] + c), av);
        _mm512_storeu_ps(acc + c, av);
    }
#endif
    for (; c < Dv; c++) {
        float x = acc[c];
        for (int i = 0; i < cnt; i++) x += p[i] * rows[i][c];
        acc[c] = x;
    }
}

/* softmax numerators in place over n logits; returns 1 / denominator (sink joins it). */
static float softmax_inplace(float *s, int64_t n, int has_sink, float sink) {
    float m = has_sink ? sink : -FLT_MAX;
    for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
    float sum = has_sink ? expf(sink - m) : 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return 1.0f / sum;
}

/* Query heads of kv heads [h0, h1) of sequence b; buf holds qf, acc, scores and a row buffer. */
static void attend(const Args *a, int64_t b, int64_t h0, int64_t h1, float *buf) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, Dv = a->Dv, BS = a->BS, nh = h1 - h0, R = nh * G;
    const int64_t L = a->ctx[b];
    const int64_t start = (a->window > 0 && L > a->window) ? L - a->window : 0;
    const int64_t n = L - start, n_pad = (n + TILE - 1) / TILE * TILE;
    const int32_t *bt = a->table + b * a->bt_s;
    const int64_t esz = a->bf16 ? 2 : 4;
    const int64_t o_off = (b * a->Hq + h0 * G) * Dv;
    /* bytes of one token's rows for heads h0..h1-1 */
    const int64_t k_span = ((nh - 1) * a->k_sh + D) * esz, v_span = ((nh - 1) * a->v_sh + Dv) * esz;

    /* rows r = (h - h0) * G + g */
    float *qf = buf, *acc = qf + R * D, *s = acc + R * Dv, *rowbuf = s + R * n_pad;
    for (int64_t r = 0; r < R; r++) {
        const int64_t off = b * a->q_sb + (h0 * G + r) * a->q_sh;
        if (a->bf16)
            widen_bf16((const uint16_t *)a->q + off, qf + r * D, D);
        else
            memcpy(qf + r * D, (const float *)a->q + off, sizeof(float) * D);
        for (int64_t d = 0; d < D; d++) qf[r * D + d] *= a->scale;
    }
    /* bfloat16 keys: dot products straight from the cache with AVX512-BF16 where available */
    const int bf16_dot = HAVE_DOT16_BF16 && a->bf16 && D % 32 == 0;
    (void)bf16_dot;
    /* scores s[r][t - start], 16 keys at a time; a token's heads are adjacent in memory */
    for (int64_t t0 = start; t0 < L; t0 += TILE) {
        const char *tok[TILE];
        for (int i = 0; i < TILE; i++) {
            const int64_t t = t0 + i < L ? t0 + i : L - 1; /* the tail repeats a valid row */
            tok[i] = (const char *)a->k + ((int64_t)bt[t / BS] * a->k_sblk + (t % BS) * a->k_sslot) * esz;
        }
        SpreadPrefetch pf;
        spread_prefetch_init(&pf, (const char *)a->k, bt, t0 + PF_TILES * TILE, L, BS, a->k_sblk, a->k_sslot,
                             h0 * a->k_sh, esz, k_span, R);
#if HAVE_DOT16_BF16
        if (bf16_dot) {
            for (int64_t h = h0; h < h1; h++) {
                const uint16_t *rows[TILE];
                for (int i = 0; i < TILE; i++) rows[i] = (const uint16_t *)(tok[i] + h * a->k_sh * esz);
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = (h - h0) * G + g;
                    const uint16_t *qr = (const uint16_t *)a->q + b * a->q_sb + (h0 * G + r) * a->q_sh;
                    dot16_bf16(qr, rows, D, a->scale, s + r * n_pad + (t0 - start));
                    spread_prefetch_step(&pf);
                }
            }
            continue;
        }
#endif
        for (int64_t h = h0; h < h1; h++) {
            const float *rows[TILE];
            for (int i = 0; i < TILE; i++) {
                const char *p = tok[i] + h * a->k_sh * esz;
                if (a->bf16) {
                    widen_bf16((const uint16_t *)p, rowbuf + i * D, D);
                    rows[i] = rowbuf + i * D;
                } else {
                    rows[i] = (const float *)p;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                const int64_t r = (h - h0) * G + g;
                dot16(qf + r * D, rows, D, s + r * n_pad + (t0 - start));
                spread_prefetch_step(&pf);
            }
        }
    }
    if (a->softcap > 0.0f)
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < n; i++) s[r * n_pad + i] = a->softcap * tanhf(s[r * n_pad + i] / a->softcap);
    float inv[R];
    for (int64_t r = 0; r < R; r++)
        inv[r] = softmax_inplace(s + r * n_pad, n, a->sinks != NULL, a->sinks ? a->sinks[h0 * G + r] : 0.0f);
    /* acc[r] = sum_t p[r][t] * v[t], 16 values at a time: acc[r] is loaded and stored once per tile */
    memset(acc, 0, sizeof(float) * R * Dv);
    for (int64_t t0 = start; t0 < L; t0 += TILE) {
        const int cnt = L - t0 < TILE ? (int)(L - t0) : TILE;
        const char *tok[TILE];
        for (int i = 0; i < cnt; i++) {
            const int64_t t = t0 + i;
            tok[i] = (const char *)a->v + ((int64_t)bt[t / BS] * a->v_sblk + (t % BS) * a->v_sslot) * esz;
        }
        SpreadPrefetch pf;
        spread_prefetch_init(&pf, (const char *)a->v, bt, t0 + PF_TILES * TILE, L, BS, a->v_sblk, a->v_sslot,
                             h0 * a->v_sh, esz, v_span, R);
        for (int64_t h = h0; h < h1; h++) {
            const float *rows[TILE];
            for (int i = 0; i < cnt; i++) {
                const char *p = tok[i] + h * a->v_sh * esz;
                if (a->bf16) {
                    widen_bf16((const uint16_t *)p, rowbuf + i * Dv, Dv);
                    rows[i] = rowbuf + i * Dv;
                } else {
                    rows[i] = (const float *)p;
                }
            }
            for (int64_t g = 0; g < G; g++) {
                const int64_t r = (h - h0) * G + g;
                axpy_tile(acc + r * Dv, s + r * n_pad + (t0 - start), rows, cnt, Dv);
                spread_prefetch_step(&pf);
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < Dv; d++) {
            const float x = acc[r * Dv + d] * inv[r];
            if (a->bf16)
                ((uint16_t *)a->out)[o_off + r * Dv + d] = f32_to_bf16(x);
            else
                ((float *)a->out)[o_off + r * Dv + d] = x;
        }
}

static void run(const Args *a) {
    const int64_t G = a->Hq / a->Hkv;
    /* one task per sequence reads each token's heads as one contiguous row; with few sequences
     * the kv heads are split so every thread has work */
    int64_t splits = 1;
    const int64_t want = 4 * (int64_t)omp_get_max_threads();
    while (splits < a->Hkv && a->B * splits < want) splits++;
    const int64_t per = (a->Hkv + splits - 1) / splits;
    const int64_t rowbuf = TILE * (a->D > a->Dv ? a->D : a->Dv);
#pragma omp parallel
    {
        float *buf = NULL;
        int64_t cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < a->B * splits; task++) {
            const int64_t b = task / splits, h0 = (task % splits) * per;
            const int64_t h1 = h0 + per < a->Hkv ? h0 + per : a->Hkv;
            if (h0 >= h1) continue;
            const int64_t R = (h1 - h0) * G;
            if (a->ctx[b] <= 0) {
                for (int64_t i = 0; i < R * a->Dv; i++) {
                    const int64_t o = (b * a->Hq + h0 * G) * a->Dv + i;
                    if (a->bf16)
                        ((uint16_t *)a->out)[o] = 0;
                    else
                        ((float *)a->out)[o] = 0.0f;
                }
                continue;
            }
            const int64_t need = R * (a->D + a->Dv + a->ctx[b] + TILE) + rowbuf;
            if (need > cap) {
                free(buf);
                buf = malloc(sizeof(float) * need);
                cap = need;
            }
            attend(a, b, h0, h1, buf);
        }
        free(buf);
    }
}

#define ENTRY(NAME, IS_BF16)                                                                                  \
    void NAME(const void *q, const void *k, const void *v, const int32_t *table, const int32_t *ctx, void *out, \
              int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, int64_t BS, int64_t q_sb, int64_t q_sh, \
              int64_t k_sblk, int64_t k_sslot, int64_t k_sh, int64_t v_sblk, int64_t v_sslot, int64_t v_sh,      \
              int64_t bt_s, float scale, int64_t window, float softcap, const float *sinks) {                  \
        Args a = {q,     k,      v,       table,   ctx,   out,    B,    Hq,      Hkv,     D,     Dv,          \
                  BS,    q_sb,   q_sh,    k_sblk,  k_sslot, k_sh, v_sblk, v_sslot, v_sh,  bt_s,  scale,       \
                  softcap, window, sinks, IS_BF16};                                                             \
        run(&a);                                                                                                \
    }

ENTRY(paged_decode_f32, 0)
ENTRY(paged_decode_bf16, 1)
