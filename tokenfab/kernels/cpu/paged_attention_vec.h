/* Paged attention (paged_attention.c): the vector building blocks of both task kinds: 16-key dot
 * products and their reduction trees, prefetching, cache rows widened to float, value updates,
 * the exact softmax. Included once, by paged_attention.c (one translation unit: the same code as one file). */
#ifndef TOKENFAB_PAGED_ATTENTION_VEC_H
#define TOKENFAB_PAGED_ATTENTION_VEC_H
#include "paged_attention.h"

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

#endif
