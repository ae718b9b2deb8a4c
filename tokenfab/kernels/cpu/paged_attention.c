/*
 * Paged attention for the CPU: keys and values read in place from the paged cache (no gather
 * copy, no padding to the longest context), for decode rows and prefill chunks alike.
 *
 * Why C: on CPU the PyTorch reference has to copy every sequence's pages into one padded
 * block before it can call SDPA; at 64 sequences that copy plus the padded attention was ~45%
 * of a decode step. In a 4,096-token prefill step the copies, the padding and the index
 * bookkeeping around SDPA took as long as SDPA itself.
 *
 * Semantics are those of tokenfab.kernels.attention.paged_attention_ref: sequence b has ctx[b]
 * keys; its q_len[b] queries sit at positions ctx[b] - q_len[b] .. ctx[b] - 1 and see the keys
 * at or before their own position; window > 0 keeps the last `window` of those; softcap > 0 maps
 * logits through softcap * tanh(x / softcap); sinks (one float per query head, or NULL) join
 * the softmax denominator without a value.
 *
 * Layouts (strides in elements; the last dimension of every tensor is contiguous):
 *   q     [T, Hq, D]            strides q_st, q_sh
 *   k     [NB, BS, Hkv, D]      strides k_sblk, k_sslot, k_sh
 *   v     [NB, BS, Hkv, Dv]     strides v_sblk, v_sslot, v_sh
 *   table [B, max_blocks] int32 row stride bt_s
 *   cu    [B + 1] int32         query rows of sequence b are cu[b] .. cu[b+1]-1; NULL: T = B, one each
 *   out   [T, Hq, Dv]           contiguous
 *
 * Decode rows (one query) run `attend`: one task per sequence (and per kv-head range when there
 * are few sequences) reads each token's key row (all its heads, contiguous) once and computes
 * every query head of the GQA groups that share it. Keys are taken 16 at a time: 16 dot
 * products accumulate in 16 vector registers and are reduced together by a transpose-add tree
 * (AVX-512), instead of one horizontal sum per dot product. Softmax is exact (two passes over
 * the scores, which stay in a per-task buffer).
 *
 * Code paths (common.h): AVX-512, AVX2 + FMA, portable C. The AVX2 path holds each 16-lane
 * accumulator as two 8-lane halves and reduces them in the AVX-512 tree's order, and its value sums
 * take the same per-column FMAs: with float32 or e4m3 caches its output equals the AVX-512 path's bit
 * for bit. bfloat16 keys on AVX512-BF16 are dotted by vdpbf16ps (another pairing of the products):
 * there the paths agree to bfloat16 tolerance only.
 *
 * Batch invariance: a sequence with up to EXTEND_AS_DECODE query rows (a speculative verify: k + 1
 * rows) also runs `attend`, each row over its own causal prefix, so every row is bit for bit the
 * decode row at its position (speculation's greedy output then equals plain decoding's). A row's
 * result never depends on the other rows or sequences of the batch, nor on the kv-head split.
 *
 * FP8 caches (float8 e4m3, `paged_attention_{f32,bf16}_fp8kv`): a stored byte is decoded to float by bit
 * arithmetic (AVX-512: 16 at a time, AVX2: 8; no table, no float subnormals involved) into the same row buffers
 * the bfloat16 path widens into; the key scale is folded into the query scale and the value scale
 * into the final 1 / denominator, so no per-element multiply is added.
 *
 * Longer prefill chunks run `attend_block`: a task is a block of up to 16 query tokens of one kv head's
 * GQA group, so each 16-key tile read from the cache serves up to 64 query rows; one pass with
 * an online softmax, causal (and window) masks per row. Both kinds of task go into one list,
 * ordered by cost, longest first, and are taken dynamically by the threads.
 */
#define _POSIX_C_SOURCE 200112L /* posix_memalign */
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
/* keys per step of a prefill block: one softmax update (max, exp, rescale) per 64 keys */
enum { KSTEP = 4 * TILE };
/* the most queries of one sequence that run decode-structured (see run) */
enum { EXTEND_AS_DECODE = 32 };

typedef struct {
    const void *q, *k, *v;
    const int32_t *table, *cu, *ctx;
    void *out;
    int64_t B, Hq, Hkv, D, Dv, BS;
    int64_t q_st, q_sh, k_sblk, k_sslot, k_sh, v_sblk, v_sslot, v_sh, bt_s;
    float scale, softcap;
    int64_t window;
    const float *sinks;
    int bf16;   /* q and out are bfloat16 (else float32) */
    int kv;     /* cache element kind: KV_F32, KV_BF16 or KV_E4M3 */
    float vscale; /* the value cache's scale (1 unless fp8) */
} Args;

enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2 };

/* bytes of one cache element */
static inline int64_t kv_esz(const Args *a) { return a->kv == KV_E4M3 ? 1 : a->kv == KV_BF16 ? 2 : 4; }

/* (e4m3 bytes are widened by common.h's widen_e4m3) */

#if TF_AVX512
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
#elif TF_AVX2
/* reduce16's sums for 4 dot products, each held as two 8-lane halves (lo: lanes 0-7, hi: 8-15), in
 * reduce16's order: with Lk = (e0 + e2) + (e1 + e3) over 128-bit lane k, the sum is (L0 + L1) + (L2 + L3),
 * so the AVX2 path's scores are the AVX-512 path's bit for bit. quad(a)'s 128-bit lane k holds Lk of
 * a[0..3]. */
static inline __m256 quad(const __m256 *a) {
    const __m256 u01 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
    const __m256 u23 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
    return _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
}

static inline __m128 reduce4x16(const __m256 *lo, const __m256 *hi) {
    const __m256 a = quad(lo), b = quad(hi);
    const __m128 s01 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s23 = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    return _mm_add_ps(s01, s23);
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

/* out[i] = dot(q, rows[i]) for i < TILE; rows are D floats each. Lane j of a 16-lane accumulator
 * takes columns j, j + 16, ...; a D that is not a multiple of 16 ends with a masked (zero-filled)
 * load, so any D sums in the same order on the AVX-512 and AVX2 paths. */
static inline void dot16(const float *q, const float *const *rows, int64_t D, float *out) {
#if TF_AVX512
    const int64_t full = D - D % 16;
    const __mmask16 tail = (__mmask16)((1u << (D % 16)) - 1u);
    __m512 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; c += 16) {
        __m512 qv = _mm512_loadu_ps(q + c);
        for (int i = 0; i < TILE; i++) acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[i] + c), acc[i]);
    }
    if (tail) {
        __m512 qv = _mm512_maskz_loadu_ps(tail, q + full);
        for (int i = 0; i < TILE; i++) acc[i] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, rows[i] + full), acc[i]);
    }
    _mm512_storeu_ps(out, reduce16(acc)); /* lane i of the sum is dot(q, rows[i]) */
#elif TF_AVX2
    /* the AVX-512 lanes as halves, 4 keys at a time (8 accumulators of 16 registers) */
    const int64_t full = D - D % 16, r = D % 16;
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r), iota);
    const __m256i m_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r - 8), iota);
    for (int k0 = 0; k0 < TILE; k0 += 4) {
        __m256 lo[4], hi[4];
        for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < full; c += 16) {
            const __m256 ql = _mm256_loadu_ps(q + c), qh = _mm256_loadu_ps(q + c + 8);
            for (int i = 0; i < 4; i++) {
                lo[i] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(rows[k0 + i] + c), lo[i]);
                hi[i] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(rows[k0 + i] + c + 8), hi[i]);
            }
        }
        if (r) {
            const __m256 ql = _mm256_maskload_ps(q + full, m_lo), qh = _mm256_maskload_ps(q + full + 8, m_hi);
            for (int i = 0; i < 4; i++) {
                lo[i] = _mm256_fmadd_ps(ql, _mm256_maskload_ps(rows[k0 + i] + full, m_lo), lo[i]);
                hi[i] = _mm256_fmadd_ps(qh, _mm256_maskload_ps(rows[k0 + i] + full + 8, m_hi), hi[i]);
            }
        }
        _mm_storeu_ps(out + k0, reduce4x16(lo, hi));
    }
#else
    for (int i = 0; i < TILE; i++) {
        float s = 0.0f;
        for (int64_t d = 0; d < D; d++) s += q[d] * rows[i][d];
        out[i] = s;
    }
#endif
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

/* rows[i] (i < cnt) = the n-element cache row at byte address tok[i] + off, as floats: in place
 * for float32, widened into rowbuf (cnt x n) for bfloat16 and e4m3 (kind: KV_*) */
static inline void tile_rows(const char *const *tok, int cnt, int64_t off, int64_t n, int kind, float *rowbuf,
                             const float **rows) {
    for (int i = 0; i < cnt; i++) {
        const char *p = tok[i] + off;
        if (kind == KV_BF16) {
            widen_bf16((const uint16_t *)p, rowbuf + i * n, n);
            rows[i] = rowbuf + i * n;
        } else if (kind == KV_E4M3) {
            widen_e4m3((const uint8_t *)p, rowbuf + i * n, n);
            rows[i] = rowbuf + i * n;
        } else {
            rows[i] = (const float *)p;
        }
    }
}

/* acc[d] += sum_i p[i] * rows[i][d] over cnt rows of Dv floats. 64 columns at a time in four
 * accumulators: one accumulator would chain cnt dependent FMAs (4 cycles each). */
static inline void axpy_tile(float *acc, const float *p, const float *const *rows, int cnt, int64_t Dv) {
    int64_t c = 0;
#if TF_AVX512
    for (; c + 64 <= Dv; c += 64) {
        __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);
        __m512 a2 = _mm512_loadu_ps(acc + c + 32), a3 = _mm512_loadu_ps(acc + c + 48);
        for (int i = 0; i < cnt; i++) {
            const __m512 pi = _mm512_set1_ps(p[i]);
            const float *row = rows[i] + c;
            a0 = _mm512_fmadd_ps(pi, _mm512_loadu_ps(row), a0);
            a1 = _mm512_fmadd_ps(pi, _mm512_loadu_ps(row + 16), a1);
            a2 = _mm512_fmadd_ps(pi, _mm512_loadu_ps(row + 32), a2);
            a3 = _mm512_fmadd_ps(pi, _mm512_loadu_ps(row + 48), a3);
        }
        _mm512_storeu_ps(acc + c, a0);
        _mm512_storeu_ps(acc + c + 16, a1);
        _mm512_storeu_ps(acc + c + 32, a2);
        _mm512_storeu_ps(acc + c + 48, a3);
    }
    for (; c + 16 <= Dv; c += 16) {
        __m512 av = _mm512_loadu_ps(acc + c);
        for (int i = 0; i < cnt; i++) av = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), _mm512_loadu_ps(rows[i] + c), av);
        _mm512_storeu_ps(acc + c, av);
    }
    if (c < Dv) { /* the last Dv % 16 columns, masked: the same FMAs per column as the AVX2 path's */
        const __mmask16 mk = (__mmask16)((1u << (Dv - c)) - 1u);
        __m512 av = _mm512_maskz_loadu_ps(mk, acc + c);
        for (int i = 0; i < cnt; i++)
            av = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), _mm512_maskz_loadu_ps(mk, rows[i] + c), av);
        _mm512_mask_storeu_ps(acc + c, mk, av);
        return;
    }
#elif TF_AVX2
    /* each column takes the same fused multiply-adds in the same order as above; 32 columns a step
     * (4 accumulators), then 16, so the scalar tail starts at the same column */
    for (; c + 32 <= Dv; c += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
        __m256 a2 = _mm256_loadu_ps(acc + c + 16), a3 = _mm256_loadu_ps(acc + c + 24);
        for (int i = 0; i < cnt; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            const float *row = rows[i] + c;
            a0 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(row), a0);
            a1 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(row + 8), a1);
            a2 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(row + 16), a2);
            a3 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(row + 24), a3);
        }
        _mm256_storeu_ps(acc + c, a0);
        _mm256_storeu_ps(acc + c + 8, a1);
        _mm256_storeu_ps(acc + c + 16, a2);
        _mm256_storeu_ps(acc + c + 24, a3);
    }
    for (; c + 16 <= Dv; c += 16) {
        __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
        for (int i = 0; i < cnt; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            a0 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(rows[i] + c), a0);
            a1 = _mm256_fmadd_ps(pi, _mm256_loadu_ps(rows[i] + c + 8), a1);
        }
        _mm256_storeu_ps(acc + c, a0);
        _mm256_storeu_ps(acc + c + 8, a1);
    }
    if (c < Dv) { /* the last Dv % 16 columns, masked (a compiled loop would reassociate over i) */
        const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), r = _mm256_set1_epi32((int)(Dv - c));
        const __m256i m0 = _mm256_cmpgt_epi32(r, iota), m1 = _mm256_cmpgt_epi32(_mm256_sub_epi32(r, _mm256_set1_epi32(8)), iota);
        __m256 a0 = _mm256_maskload_ps(acc + c, m0), a1 = _mm256_maskload_ps(acc + c + 8, m1);
        for (int i = 0; i < cnt; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            a0 = _mm256_fmadd_ps(pi, _mm256_maskload_ps(rows[i] + c, m0), a0);
            a1 = _mm256_fmadd_ps(pi, _mm256_maskload_ps(rows[i] + c + 8, m1), a1);
        }
        _mm256_maskstore_ps(acc + c, m0, a0);
        _mm256_maskstore_ps(acc + c + 8, m1, a1);
        return;
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

/* floats, rounded up to a whole 64-byte line: every buffer region (and every score row) starts
 * 64-byte aligned, so the compiler-vectorized loops over a row (softmax sum, expf, tanhf: vector
 * and scalar variants may round differently) split a row the same way whatever the task */
static inline int64_t lines(int64_t n) { return (n + TILE - 1) / TILE * TILE; }

/* Decode-structured rows: the nq query tokens row0 .. row0 + nq - 1 of sequence b, at positions
 * pos0 .. pos0 + nq - 1 (query i sees keys start .. pos0 + i), with the query heads of kv heads
 * [h0, h1). A decode row is nq = 1; a short extend (a speculative verify) runs here too, so that
 * its rows are computed exactly as decode rows: each row's scores, softmax and value sum take the
 * same steps (same 16-key tiles from `start`, same two-pass softmax over its own keys, same value
 * tiles) whatever nq is, while each key and value tile is read once for all the rows. Rows must
 * share `start` (no window, or nq = 1). buf (64-byte aligned) holds qf, acc, scores, a row buffer. */
static void attend(const Args *a, int64_t b, int64_t row0, int64_t pos0, int64_t nq, int64_t h0, int64_t h1,
                   float *buf) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, Dv = a->Dv, BS = a->BS, nh = h1 - h0, Rh = nh * G, R = nq * Rh;
    const int64_t L = pos0 + nq; /* keys of the last query */
    const int64_t start = (a->window > 0 && pos0 + 1 > a->window) ? pos0 + 1 - a->window : 0;
    const int64_t n_pad = lines(L - start);
    const int32_t *bt = a->table + b * a->bt_s;
    const int64_t esz = kv_esz(a); /* cache element bytes */
    /* bytes of one token's rows for heads h0..h1-1 */
    const int64_t k_span = ((nh - 1) * a->k_sh + D) * esz, v_span = ((nh - 1) * a->v_sh + Dv) * esz;

    /* rows r = i * Rh + (h - h0) * G + g */
    float *qf = buf, *acc = qf + lines(R * D), *s = acc + lines(R * Dv), *rowbuf = s + R * n_pad;
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < Rh; j++) {
            const int64_t r = i * Rh + j, off = (row0 + i) * a->q_st + (h0 * G + j) * a->q_sh;
            if (a->bf16)
                widen_bf16((const uint16_t *)a->q + off, qf + r * D, D);
            else
                memcpy(qf + r * D, (const float *)a->q + off, sizeof(float) * D);
            for (int64_t d = 0; d < D; d++) qf[r * D + d] *= a->scale;
        }
    /* bfloat16 keys: dot products straight from the cache with AVX512-BF16 where available */
    const int bf16_dot = HAVE_DOT16_BF16 && a->kv == KV_BF16 && D % 32 == 0;
    (void)bf16_dot;
    /* scores s[r][t - start], 16 keys at a time; a token's heads are adjacent in memory. Query i
     * takes the tiles that start before its own end (pos0 + i + 1), as a decode row of it would. */
    for (int64_t t0 = start; t0 < L; t0 += TILE) {
        const char *tok[TILE];
        for (int i = 0; i < TILE; i++) {
            const int64_t t = t0 + i < L ? t0 + i : L - 1; /* the tail repeats a valid row */
            tok[i] = (const char *)a->k + ((int64_t)bt[t / BS] * a->k_sblk + (t % BS) * a->k_sslot) * esz;
        }
        const int64_t i_lo = t0 > pos0 ? t0 - pos0 : 0; /* the first query that sees key t0 */
        SpreadPrefetch pf;
        spread_prefetch_init(&pf, (const char *)a->k, bt, t0 + PF_TILES * TILE, L, BS, a->k_sblk, a->k_sslot,
                             h0 * a->k_sh, esz, k_span, (nq - i_lo) * Rh);
#if HAVE_DOT16_BF16
        if (bf16_dot) {
            for (int64_t h = h0; h < h1; h++) {
                const uint16_t *rows[TILE];
                for (int i = 0; i < TILE; i++) rows[i] = (const uint16_t *)(tok[i] + h * a->k_sh * esz);
                for (int64_t i = i_lo; i < nq; i++)
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t j = (h - h0) * G + g, r = i * Rh + j;
                        const uint16_t *qr = (const uint16_t *)a->q + (row0 + i) * a->q_st + (h0 * G + j) * a->q_sh;
                        dot16_bf16(qr, rows, D, a->scale, s + r * n_pad + (t0 - start));
                        spread_prefetch_step(&pf);
                    }
            }
            continue;
        }
#endif
        for (int64_t h = h0; h < h1; h++) {
            const float *rows[TILE];
            tile_rows(tok, TILE, h * a->k_sh * esz, D, a->kv, rowbuf, rows);
            for (int64_t i = i_lo; i < nq; i++)
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = i * Rh + (h - h0) * G + g;
                    dot16(qf + r * D, rows, D, s + r * n_pad + (t0 - start));
                    spread_prefetch_step(&pf);
                }
        }
    }
    float inv[R];
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = pos0 + r / Rh + 1 - start;
        float *sr = s + r * n_pad;
        if (a->softcap > 0.0f)
            for (int64_t i = 0; i < n; i++) sr[i] = a->softcap * tanhf(sr[i] / a->softcap);
        inv[r] = softmax_inplace(sr, n, a->sinks != NULL, a->sinks ? a->sinks[h0 * G + r % Rh] : 0.0f) * a->vscale;
    }
    /* acc[r] = sum_t p[r][t] * v[t], 16 values at a time: acc[r] is loaded and stored once per tile */
    memset(acc, 0, sizeof(float) * R * Dv);
    for (int64_t t0 = start; t0 < L; t0 += TILE) {
        const int cnt = L - t0 < TILE ? (int)(L - t0) : TILE;
        const char *tok[TILE];
        for (int i = 0; i < cnt; i++) {
            const int64_t t = t0 + i;
            tok[i] = (const char *)a->v + ((int64_t)bt[t / BS] * a->v_sblk + (t % BS) * a->v_sslot) * esz;
        }
        const int64_t i_lo = t0 > pos0 ? t0 - pos0 : 0;
        SpreadPrefetch pf;
        spread_prefetch_init(&pf, (const char *)a->v, bt, t0 + PF_TILES * TILE, L, BS, a->v_sblk, a->v_sslot,
                             h0 * a->v_sh, esz, v_span, (nq - i_lo) * Rh);
        for (int64_t h = h0; h < h1; h++) {
            const float *rows[TILE];
            tile_rows(tok, cnt, h * a->v_sh * esz, Dv, a->kv, rowbuf, rows);
            for (int64_t i = i_lo; i < nq; i++) {
                /* query i's keys in this tile: up to its own position, as in its decode row */
                const int64_t end = pos0 + i + 1 - t0;
                const int cnt_i = end < cnt ? (int)end : cnt;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = i * Rh + (h - h0) * G + g;
                    axpy_tile(acc + r * Dv, s + r * n_pad + (t0 - start), rows, cnt_i, Dv);
                    spread_prefetch_step(&pf);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t o_off = ((row0 + r / Rh) * a->Hq + h0 * G + r % Rh) * Dv;
        for (int64_t d = 0; d < Dv; d++) {
            const float x = acc[r * Dv + d] * inv[r];
            if (a->bf16)
                ((uint16_t *)a->out)[o_off + d] = f32_to_bf16(x);
            else
                ((float *)a->out)[o_off + d] = x;
        }
    }
}

/* One row's scores sr[0..KSTEP) of a key step, valid for j in [j_lo, j_hi): softcapped, turned into
 * numerators under the row's running maximum *m (0 outside the valid range); *l and the
 * row's value accumulator acc are rescaled when the maximum grows. */
static inline void online_softmax_step(float *sr, int j_lo, int j_hi, float softcap, float *m, float *l, float *acc,
                                       int64_t Dv) {
    if (softcap > 0.0f)
        for (int j = j_lo; j < j_hi; j++) sr[j] = softcap * tanhf(sr[j] / softcap);
    float mt = *m;
#pragma omp simd reduction(max : mt)
    for (int j = 0; j < KSTEP; j++) {
        const float x = (j >= j_lo && j < j_hi) ? sr[j] : -FLT_MAX;
        mt = x > mt ? x : mt;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < KSTEP; j++) {
        const float p = (j >= j_lo && j < j_hi) ? expf(sr[j] - mt) : 0.0f;
        sr[j] = p;
        sum += p;
    }
    if (mt > *m) {
        const float alpha = expf(*m - mt);
        *l *= alpha;
        for (int64_t d = 0; d < Dv; d++) acc[d] *= alpha;
        *m = mt;
    }
    *l += sum;
}

/* axpy_tile for two rows at once (any cnt up to KSTEP) (acc0 with p0, acc1 with p1): each value row is loaded once
 * for both, and eight accumulators keep both FMA pipes busy. */
static inline void axpy_rows2(float *acc0, float *acc1, const float *p0, const float *p1, const float *const *rows,
                              int cnt, int64_t Dv) {
    if (cnt <= 0) return;
    int64_t c = 0;
#if TF_AVX512
    for (; c + 64 <= Dv; c += 64) {
        __m512 a0 = _mm512_loadu_ps(acc0 + c), a1 = _mm512_loadu_ps(acc0 + c + 16);
        __m512 a2 = _mm512_loadu_ps(acc0 + c + 32), a3 = _mm512_loadu_ps(acc0 + c + 48);
        __m512 b0 = _mm512_loadu_ps(acc1 + c), b1 = _mm512_loadu_ps(acc1 + c + 16);
        __m512 b2 = _mm512_loadu_ps(acc1 + c + 32), b3 = _mm512_loadu_ps(acc1 + c + 48);
        for (int i = 0; i < cnt; i++) {
            const __m512 pa = _mm512_set1_ps(p0[i]), pb = _mm512_set1_ps(p1[i]);
            const float *row = rows[i] + c;
            const __m512 v0 = _mm512_loadu_ps(row), v1 = _mm512_loadu_ps(row + 16);
            const __m512 v2 = _mm512_loadu_ps(row + 32), v3 = _mm512_loadu_ps(row + 48);
            a0 = _mm512_fmadd_ps(pa, v0, a0);
            a1 = _mm512_fmadd_ps(pa, v1, a1);
            a2 = _mm512_fmadd_ps(pa, v2, a2);
            a3 = _mm512_fmadd_ps(pa, v3, a3);
            b0 = _mm512_fmadd_ps(pb, v0, b0);
            b1 = _mm512_fmadd_ps(pb, v1, b1);
            b2 = _mm512_fmadd_ps(pb, v2, b2);
            b3 = _mm512_fmadd_ps(pb, v3, b3);
        }
        _mm512_storeu_ps(acc0 + c, a0);
        _mm512_storeu_ps(acc0 + c + 16, a1);
        _mm512_storeu_ps(acc0 + c + 32, a2);
        _mm512_storeu_ps(acc0 + c + 48, a3);
        _mm512_storeu_ps(acc1 + c, b0);
        _mm512_storeu_ps(acc1 + c + 16, b1);
        _mm512_storeu_ps(acc1 + c + 32, b2);
        _mm512_storeu_ps(acc1 + c + 48, b3);
    }
#elif TF_AVX2
    for (; c + 32 <= Dv; c += 32) { /* 8 accumulators: 4 per row */
        __m256 a0 = _mm256_loadu_ps(acc0 + c), a1 = _mm256_loadu_ps(acc0 + c + 8);
        __m256 a2 = _mm256_loadu_ps(acc0 + c + 16), a3 = _mm256_loadu_ps(acc0 + c + 24);
        __m256 b0 = _mm256_loadu_ps(acc1 + c), b1 = _mm256_loadu_ps(acc1 + c + 8);
        __m256 b2 = _mm256_loadu_ps(acc1 + c + 16), b3 = _mm256_loadu_ps(acc1 + c + 24);
        for (int i = 0; i < cnt; i++) {
            const __m256 pa = _mm256_set1_ps(p0[i]), pb = _mm256_set1_ps(p1[i]);
            const float *row = rows[i] + c;
            const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
            const __m256 v2 = _mm256_loadu_ps(row + 16), v3 = _mm256_loadu_ps(row + 24);
            a0 = _mm256_fmadd_ps(pa, v0, a0);
            a1 = _mm256_fmadd_ps(pa, v1, a1);
            a2 = _mm256_fmadd_ps(pa, v2, a2);
            a3 = _mm256_fmadd_ps(pa, v3, a3);
            b0 = _mm256_fmadd_ps(pb, v0, b0);
            b1 = _mm256_fmadd_ps(pb, v1, b1);
            b2 = _mm256_fmadd_ps(pb, v2, b2);
            b3 = _mm256_fmadd_ps(pb, v3, b3);
        }
        _mm256_storeu_ps(acc0 + c, a0);
        _mm256_storeu_ps(acc0 + c + 8, a1);
        _mm256_storeu_ps(acc0 + c + 16, a2);
        _mm256_storeu_ps(acc0 + c + 24, a3);
        _mm256_storeu_ps(acc1 + c, b0);
        _mm256_storeu_ps(acc1 + c + 8, b1);
        _mm256_storeu_ps(acc1 + c + 16, b2);
        _mm256_storeu_ps(acc1 + c + 24, b3);
    }
#endif
    if (c < Dv) {
        const float *tail[KSTEP];
        for (int i = 0; i < cnt; i++) tail[i] = rows[i] + c;
        axpy_tile(acc0 + c, p0, tail, cnt, Dv - c);
        axpy_tile(acc1 + c, p1, tail, cnt, Dv - c);
    }
}

/* Query tokens tok0 .. tok0 + nt - 1 of sequence b, at positions pos0 .. pos0 + nt - 1, with
 * the G query heads of kv head h: rows r = i * G + g. Each 16-key tile of the cache is read once
 * (widened once if bf16) and serves all R rows; an online softmax keeps one running maximum and
 * denominator per row. buf: qf [R][D], acc [R][Dv], s [R][TILE], m [R], l [R], kbuf, vbuf. */
static void attend_block(const Args *a, int64_t b, int64_t tok0, int64_t pos0, int64_t nt, int64_t h, float *buf) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, Dv = a->Dv, BS = a->BS, R = nt * G;
    const int32_t *bt = a->table + b * a->bt_s;
    const int64_t esz = a->bf16 ? 2 : 4, cesz = kv_esz(a), last = pos0 + nt - 1;
    float *qf = buf, *acc = qf + R * D, *s = acc + R * Dv, *m = s + R * KSTEP, *l = m + R;
    float *kbuf = l + R, *vbuf = kbuf + KSTEP * D;
    for (int64_t i = 0; i < nt; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g, head = h * G + g;
            load_row((const char *)a->q + ((tok0 + i) * a->q_st + head * a->q_sh) * esz, a->bf16, qf + r * D, D);
            for (int64_t d = 0; d < D; d++) qf[r * D + d] *= a->scale;
            m[r] = a->sinks ? a->sinks[head] : -FLT_MAX;
            l[r] = a->sinks ? 1.0f : 0.0f; /* the sink's exp(sink - m) with m = sink */
        }
    memset(acc, 0, sizeof(float) * R * Dv);
    const int64_t lo = (a->window > 0 && pos0 - a->window + 1 > 0) ? pos0 - a->window + 1 : 0;
    for (int64_t t0 = lo / TILE * TILE; t0 <= last; t0 += KSTEP) {
        const int cnt = last + 1 - t0 < KSTEP ? (int)(last + 1 - t0) : KSTEP;
        const int n16 = (cnt + TILE - 1) / TILE * TILE;
        const char *ktok[KSTEP], *vtok[KSTEP];
        for (int i = 0; i < n16; i++) {
            const int64_t t = i < cnt ? t0 + i : last; /* the tail repeats a valid row */
            const int64_t blk = bt[t / BS], slot = t % BS;
            ktok[i] = (const char *)a->k + (blk * a->k_sblk + slot * a->k_sslot + h * a->k_sh) * cesz;
            vtok[i] = (const char *)a->v + (blk * a->v_sblk + slot * a->v_sslot + h * a->v_sh) * cesz;
        }
        const float *krows[KSTEP], *vrows[KSTEP];
        tile_rows(ktok, n16, 0, D, a->kv, kbuf, krows);
        tile_rows(vtok, cnt, 0, Dv, a->kv, vbuf, vrows); /* value rows past cnt are never read */
        int j_end[2] = {0, 0};
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * KSTEP;
            const int64_t pos = pos0 + r / G;
            const int64_t first = a->window > 0 ? pos - a->window + 1 : 0;
            /* keys t0 + j with first <= t0 + j <= pos (j < cnt follows: t0 + cnt - 1 = min(last, ...)) */
            const int j_lo = first > t0 ? (int)(first - t0) : 0;
            const int j_hi = pos - t0 + 1 < cnt ? (int)(pos - t0 + 1) : cnt;
            for (int j = 0; j < j_hi; j += TILE) dot16(qf + r * D, krows + j, D, sr + j);
            j_end[r & 1] = j_hi > j_lo ? j_hi : 0;
            online_softmax_step(sr, j_lo, j_hi, a->softcap, &m[r], &l[r], acc + r * Dv, Dv);
            /* values: rows in pairs share each value load */
            if (r & 1)
                axpy_rows2(acc + (r - 1) * Dv, acc + r * Dv, sr - KSTEP, sr, vrows,
                           j_end[0] > j_end[1] ? j_end[0] : j_end[1], Dv);
            else if (r == R - 1 && j_end[0])
                axpy_tile(acc + r * Dv, sr, vrows, j_end[0], Dv);
        }
    }
    for (int64_t i = 0; i < nt; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g;
            const float inv = a->vscale / l[r];
            for (int64_t d = 0; d < Dv; d++) acc[r * Dv + d] *= inv;
            store_row(acc + r * Dv, a->bf16, (char *)a->out + (((tok0 + i) * a->Hq + h * G + g) * Dv) * esz, Dv);
        }
}

/* grow a task's float buffer (64-byte aligned) to at least `need` elements; NULL (and *cap = 0)
 * when the allocation fails */
static float *reserve(float *buf, int64_t *cap, int64_t need) {
    if (need <= *cap) return buf;
    free(buf);
    void *p = NULL;
    if (posix_memalign(&p, 64, sizeof(float) * need)) p = NULL;
    *cap = p ? need : 0;
    return p;
}

static void zero_rows(const Args *a, int64_t tok, int64_t head0, int64_t n_heads) {
    const int64_t o = (tok * a->Hq + head0) * a->Dv, n = n_heads * a->Dv;
    if (a->bf16)
        memset((uint16_t *)a->out + o, 0, sizeof(uint16_t) * n);
    else
        memset((float *)a->out + o, 0, sizeof(float) * n);
}

/* A unit of work of a mixed batch: decode-structured rows (queries i0 .. i0 + nt - 1 of a sequence,
 * kv heads [h0, h1); a decode row is nt = 1) or a block of prefill rows (`block`). */
typedef struct {
    int64_t cost;
    int32_t b, h0, h1, i0, nt, block;
} Task;

static int by_cost_desc(const void *x, const void *y) {
    const int64_t cx = ((const Task *)x)->cost, cy = ((const Task *)y)->cost;
    return (cx < cy) - (cx > cy);
}

/* sequence b's query rows: cu[b] .. cu[b + 1] - 1, or row b alone when cu is NULL (decode only) */
static inline int64_t first_row(const Args *a, int64_t b) { return a->cu ? a->cu[b] : b; }
static inline int64_t n_rows(const Args *a, int64_t b) { return a->cu ? a->cu[b + 1] - a->cu[b] : 1; }

/* Any mix of decode rows and prefill chunks: one task list, most expensive first. A sequence with
 * at most EXTEND_AS_DECODE queries (a speculative verify of up to 31 proposed tokens, a short chunk)
 * runs decode-structured (`attend`): each of its rows is bit for bit what a decode step at that
 * position gives (batch invariance, tests/kernels/test_batch_invariance.py). Longer chunks run
 * `attend_block` (online softmax over 64-key steps). Returns TF_OK, or TF_ENOMEM when a buffer
 * could not be allocated (the tasks without one are skipped). */
static int run(const Args *a) {
    const int64_t G = a->Hq / a->Hkv;
    /* query tokens per block: enough rows (tokens x G heads) to reuse each key tile ~64 times */
    const int64_t nt_max = G >= 64 ? 1 : (64 / G < TILE ? 64 / G : TILE);
    int64_t n_dec = 0, n_blk = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t n = n_rows(a, b);
        if (n == 1 || (n > 1 && n <= EXTEND_AS_DECODE))
            n_dec += a->window > 0 ? n : 1; /* windowed rows start at different keys: one task each */
        else if (n > 1)
            n_blk += a->Hkv * ((n + nt_max - 1) / nt_max);
    }
    int64_t splits = 1;
    const int64_t want = 4 * (int64_t)omp_get_max_threads();
    /* a decode task reads each token's heads as one contiguous row; with few tasks the kv heads
     * of the decode rows are split so every thread has work */
    while (splits < a->Hkv && n_dec * splits + n_blk < want) splits++;
    const int64_t per = (a->Hkv + splits - 1) / splits;
    Task *tasks = malloc(sizeof(Task) * (n_dec * splits + n_blk + 1));
    if (!tasks) return TF_ENOMEM;
    int64_t n_tasks = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t n = n_rows(a, b), L = a->ctx[b];
        if (n == 1 || (n > 1 && n <= EXTEND_AS_DECODE)) {
            const int64_t step = a->window > 0 ? 1 : n;
            for (int64_t i0 = 0; i0 < n; i0 += step)
                for (int64_t h0 = 0; h0 < a->Hkv; h0 += per) {
                    const int64_t h1 = h0 + per < a->Hkv ? h0 + per : a->Hkv;
                    const int64_t last = L - n + i0 + step; /* keys of the task's last query */
                    const int64_t keys = a->window > 0 && last > a->window ? a->window : last;
                    tasks[n_tasks++] = (Task){keys * (h1 - h0) * G * step, (int32_t)b, (int32_t)h0, (int32_t)h1,
                                              (int32_t)i0, (int32_t)step, 0};
                }
        } else if (n > 1) {
            for (int64_t i0 = 0; i0 < n; i0 += nt_max) {
                const int64_t nt = n - i0 < nt_max ? n - i0 : nt_max, last = L - n + i0 + nt - 1;
                const int64_t keys = a->window > 0 && last + 1 > a->window + nt ? a->window + nt : last + 1;
                for (int64_t h = 0; h < a->Hkv; h++)
                    tasks[n_tasks++] = (Task){keys * nt * G, (int32_t)b, (int32_t)h, (int32_t)h + 1, (int32_t)i0,
                                              (int32_t)nt, 1};
            }
        }
    }
    qsort(tasks, n_tasks, sizeof(Task), by_cost_desc);
    const int64_t rowbuf = TILE * (a->D > a->Dv ? a->D : a->Dv);
    int failed = 0;
    /* small work (a few decode rows over short contexts) runs on this thread: waking the team costs
     * more than it saves, and on a busy machine a preempted thread holds the barrier for a time slice */
    int64_t work = 0;
    for (int64_t i = 0; i < n_tasks; i++) work += tasks[i].cost * (a->D + a->Dv);
#pragma omp parallel num_threads(tf_nthreads()) if (work >= ((int64_t)1 << 20))
    {
        float *buf = NULL;
        int64_t cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_tasks; i++) {
            const Task *t = &tasks[i];
            const int64_t n = n_rows(a, t->b), tok = first_row(a, t->b) + t->i0, L = a->ctx[t->b];
            const int64_t pos0 = L - n + t->i0;
            if (!t->block) {
                const int64_t R = (int64_t)t->nt * (t->h1 - t->h0) * G, keys = pos0 + t->nt;
                if (keys <= 0) { /* a decode row over an empty context (wrapper checks keep extends >= 1) */
                    zero_rows(a, tok, t->h0 * G, R);
                    continue;
                }
                buf = reserve(buf, &cap, lines(R * a->D) + lines(R * a->Dv) + R * lines(keys) + rowbuf);
                if (!buf) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                attend(a, t->b, tok, pos0, t->nt, t->h0, t->h1, buf);
            } else {
                const int64_t rows = t->nt * G;
                buf = reserve(buf, &cap, rows * (a->D + a->Dv + KSTEP + 2) + KSTEP * (a->D + a->Dv));
                if (!buf) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                attend_block(a, t->b, tok, pos0, t->nt, t->h0, buf);
            }
        }
        free(buf);
    }
    free(tasks);
    return failed ? TF_ENOMEM : TF_OK;
}

#define ENTRY(NAME, IS_BF16)                                                                                  \
    int NAME(const void *q, const void *k, const void *v, const int32_t *table, const int32_t *cu,           \
              const int32_t *ctx, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,       \
              int64_t BS, int64_t q_st, int64_t q_sh, int64_t k_sblk, int64_t k_sslot, int64_t k_sh,          \
              int64_t v_sblk, int64_t v_sslot, int64_t v_sh, int64_t bt_s, float scale, int64_t window,       \
              float softcap, const float *sinks) {                                                            \
        Args a = {q,    k,      v,       table, cu,      ctx,  out,    B,      Hq,      Hkv,  D,  Dv,  BS,     \
                  q_st, q_sh,   k_sblk,  k_sslot, k_sh,  v_sblk, v_sslot, v_sh, bt_s,    scale, softcap,      \
                  window, sinks, IS_BF16, IS_BF16 ? KV_BF16 : KV_F32, 1.0f};                                  \
        return run(&a);                                                                                       \
    }

ENTRY(paged_attention_f32, 0)
ENTRY(paged_attention_bf16, 1)

/* The same over float8 e4m3 caches: k_scale / v_scale point to the float32 scales (a read is
 * e4m3 * scale); k_scale is folded into the softmax scale, v_scale into the output. */
#define ENTRY_FP8(NAME, IS_BF16)                                                                              \
    int NAME(const void *q, const void *k, const void *v, const int32_t *table, const int32_t *cu,           \
              const int32_t *ctx, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,       \
              int64_t BS, int64_t q_st, int64_t q_sh, int64_t k_sblk, int64_t k_sslot, int64_t k_sh,          \
              int64_t v_sblk, int64_t v_sslot, int64_t v_sh, int64_t bt_s, float scale, int64_t window,       \
              float softcap, const float *sinks, const float *k_scale, const float *v_scale) {                \
        Args a = {q,    k,      v,       table, cu,      ctx,  out,    B,      Hq,      Hkv,  D,  Dv,  BS,     \
                  q_st, q_sh,   k_sblk,  k_sslot, k_sh,  v_sblk, v_sslot, v_sh, bt_s,    scale * *k_scale,    \
                  softcap, window, sinks, IS_BF16, KV_E4M3, *v_scale};                                        \
        return run(&a);                                                                                       \
    }

ENTRY_FP8(paged_attention_f32_fp8kv, 0)
ENTRY_FP8(paged_attention_bf16_fp8kv, 1)
