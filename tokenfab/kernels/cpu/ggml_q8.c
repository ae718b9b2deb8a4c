/* Packed GGML matmul with the activations quantized per 32-block to int8 (act="q8"): integer block
 * dot products (VNNI vpdpbusd, AVX2 vpmaddubsw, or plain C), then the block terms summed in float32
 * in block order. Formats and the quantization rule: ggml_common.h.
 *
 * The arithmetic, the same on every path (row tiles here, the many-row tiles of ggml_q8_tile.h, the
 * AMX tiles of ggml_amx.c, the torch reference in ggml_matmul.py), for one output (m, n):
 *   acc = 0; for each block b in order:
 *     t = (float)dot_b * (d_w * d_x)                  dot_b: the exact integer dot product
 *     Q4_1: t = t + m_w * (d_x * (float)sum(q_x))
 *     acc = acc + t
 * each * and + one float32 rounding, no FMA contraction, no reassociation (Q8_EXACT). int8
 * activation rounding is chaotic (a 1-ulp change upstream flips some round(x / d)), so the paths
 * and the reference must agree bit for bit, not merely to float32 summation order, or greedy paths
 * part within a few tokens; and a row's result must not depend on M or on the path M picked. (Until
 * issue 26 the terms were summed in float64 over 8 lanes: exact-er, but at many rows the float64
 * epilogue cost more than the integer dots; the float32 order's drift: docs/cpu.md.) */
#include "ggml_common.h"
#include "ggml_q8_tile.h"

#define MQ 4 /* activation rows per tile of the q8 kernel */
#define Q8_EXACT __attribute__((optimize("no-fast-math", "fp-contract=off")))

/* ---------- q8 activations ---------- */

/* x [M, K] -> int8 q [M, K], per 32-block scale d [M, K/32] and integer sum(q) sq [M, K/32] */
/* exact IEEE division and rounding here: the reference (ggml_matmul.py) must reproduce every q */
__attribute__((optimize("no-fast-math"))) void ggml_quantize_rows_q8(const float *x, int64_t M, int64_t K, int8_t *q,
                                                                    float *d, int32_t *sq) {
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (M * K >= PAR_MIN_WORK)
    for (int64_t i = 0; i < M * (K / 32); i++) {
        const float *xb = x + i * 32;
#if GG_AVX512 && defined(__AVX512BW__)
        /* the scalar steps below, 16 lanes at a time: max, IEEE division, round-to-nearest-even */
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        const __m512 vid = _mm512_set1_ps(id), lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x0, vid), rnd), nlim), lim);
        const __m512 r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x1, vid), rnd), nlim), lim);
        const __m512i i0 = _mm512_cvtps_epi32(r0), i1 = _mm512_cvtps_epi32(r1);
        _mm_storeu_si128((__m128i *)(q + i * 32), _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + i * 32 + 16), _mm512_cvtepi32_epi8(i1));
        d[i] = db;
        sq[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            float r = nearbyintf(xb[j] * id); /* to nearest, ties to even (as torch.round) */
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            q[i * 32 + j] = (int8_t)r;
            sum += (int)r;
        }
        d[i] = db;
        sq[i] = sum;
#endif
    }
}

int q8_acts_quantize(const float *x, int64_t M, int64_t K, int64_t q_bytes, q8_acts *a) {
    const int64_t nb = K / 32, qb = (q_bytes + 64) / 64 * 64; /* d and sq start 64-byte aligned */
    uint8_t *mem = malloc((size_t)(qb + 2 * 4 * M * nb) + 4);
    if (!mem) return TF_ENOMEM;
    a->q = (int8_t *)mem, a->d = (float *)(mem + qb), a->sq = (int32_t *)(mem + qb + 4 * M * nb);
    memset(mem + M * K, 0, (size_t)(qb - M * K));
    ggml_quantize_rows_q8(x, M, K, a->q, a->d, a->sq);
    return TF_OK;
}

#include "ggml_q8_dot.h"

/* is[m][j] = integer dot product of weight block g + j (j < gl; 0 beyond) with activation row m;
 * pg: the same activations paired (pair_activations), used for whole groups of Q4 blocks; sg: sum(q)
 * of each block (Q4_0's -8 * sum) */
AI void block_dots(int qt, int mt, const uint8_t *wg, int gl, const int8_t *qg, const int8_t *pg, const int32_t *sg,
                   int64_t nb, int64_t K, int32_t is[MQ][8]) {
    const int64_t bb = BLOCK_BYTES[qt];
#if GG_AVX512 || GG_AVX2
    if (gl == 8 && qt != GQ8_0) {
        for (int m = 0; m < mt; m++) {
            const int8_t *xp = pg + m * K;
            __m256i h = hsum_pairs(pair_dot_q4(qt, wg, bb, xp), pair_dot_q4(qt, wg + 2 * bb, bb, xp + 64),
                                   pair_dot_q4(qt, wg + 4 * bb, bb, xp + 128), pair_dot_q4(qt, wg + 6 * bb, bb, xp + 192));
            if (qt == GQ4_0)
                h = _mm256_sub_epi32(h, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(sg + m * nb)), 3));
            _mm256_storeu_si256((__m256i *)is[m], h);
        }
        return;
    }
    __m256i dots[MQ][8];
    for (int j = 0; j < 8; j++) {
        if (j >= gl) {
            for (int m = 0; m < mt; m++) dots[m][j] = _mm256_setzero_si256();
            continue;
        }
        const __m256i wv = wbytes(qt, wg + j * bb);
        const __m256i wu = qt == GQ4_1 ? wv : _mm256_sign_epi8(wv, wv); /* |w| */
        for (int m = 0; m < mt; m++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(qg + m * K + j * 32));
            if (qt != GQ4_1) a = _mm256_sign_epi8(a, wv); /* sign(w) * a: |w| * (sign(w) * a) = w * a */
            dots[m][j] = dot_us(wu, a);
        }
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_si256((__m256i *)is[m], hsum8x8(dots[m]));
#else
    for (int j = 0; j < 8; j++) {
        if (j >= gl) {
            for (int m = 0; m < mt; m++) is[m][j] = 0;
            continue;
        }
        const uint8_t *blk = wg + j * bb;
        int8_t wq[32];
        if (qt == GQ8_0) {
            memcpy(wq, blk + 2, 32);
        } else {
            const uint8_t *p = blk + (qt == GQ4_1 ? 4 : 2);
            const int off = qt == GQ4_0 ? 8 : 0;
            for (int i = 0; i < 16; i++) {
                wq[i] = (int8_t)((p[i] & 15) - off);
                wq[i + 16] = (int8_t)((p[i] >> 4) - off);
            }
        }
        for (int m = 0; m < mt; m++) {
            const int8_t *a = qg + m * K + j * 32;
            int32_t dot = 0;
            for (int i = 0; i < 32; i++) dot += (int32_t)wq[i] * a[i];
            is[m][j] = dot;
        }
    }
#endif
}

#if GG_AVX512 || GG_AVX2
/* the float16 scales at byte offset off of blocks g .. g + gl - 1 (0 beyond) as 8 floats (a partial
 * group, or no F16C; whole groups: scales8_gather) */
AI __m256 scales8(const uint8_t *wg, int64_t bb, int off, int gl) {
    float f[8] = {0};
    for (int j = 0; j < gl; j++) f[j] = half_to_float(wg + j * bb + off);
    return _mm256_loadu_ps(f);
}

/* all-ones in lanes 0 .. gl - 1 (a masked load's or gather's mask) */
AI __m256i lanes_below(int gl) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(gl), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#if defined(__F16C__)
/* the float16 words at byte offsets 0 and 2 of gl <= 8 blocks (0 beyond) (d, and Q4_1's m) as 8 floats each: one
 * gather of each block's first 4 bytes, where scales8 inserts 16 words one by one */
AI void scales8_gather(const uint8_t *wg, int64_t bb, int gl, __m256 *d, __m256 *m) {
    const int b = (int)bb;
    const __m256i idx = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b);
    const __m256i g = gl == 8 ? _mm256_i32gather_epi32((const int *)wg, idx, 1)
                              : _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)wg, idx,
                                                            lanes_below(gl), 1);
    /* per 128-bit half: the low words, then the high words; then the halves' d and m gathered */
    const __m256i sel = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i u = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(g, sel), 0xD8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(u));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(u, 1));
}
#endif

/* the terms of blocks g .. g + gl - 1 (gl <= 8; wg, qg, dg, sg start at block g) against each
 * activation row, in block order in the lanes of t[m] (0 past gl): each lane the scalar steps */
Q8_EXACT AI void group_terms(int qt, int mt, const uint8_t *wg, int gl, const int8_t *qg, const int8_t *pg,
                             const float *dg, const int32_t *sg, int64_t nb, int64_t K, __m256 t[MQ]) {
    const int64_t bb = BLOCK_BYTES[qt];
    __m256 dw, mw = _mm256_setzero_ps();
#if defined(__F16C__)
    scales8_gather(wg, bb, gl, &dw, &mw);
#else
    dw = scales8(wg, bb, 0, gl);
    if (qt == GQ4_1) mw = scales8(wg, bb, 2, gl);
#endif
    int32_t is[MQ][8];
    block_dots(qt, mt, wg, gl, qg, pg, sg, nb, K, is);
    const __m256i lanes = lanes_below(gl); /* masked loads: no store-to-load stall at a partial group */
    for (int m = 0; m < mt; m++) {
        const __m256 dx = gl == 8 ? _mm256_loadu_ps(dg + m * nb) : _mm256_maskload_ps(dg + m * nb, lanes);
        __m256i sx = _mm256_setzero_si256();
        if (qt == GQ4_1)
            sx = gl == 8 ? _mm256_loadu_si256((const __m256i *)(sg + m * nb))
                         : _mm256_maskload_epi32((const int *)(sg + m * nb), lanes);
        t[m] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)is[m])), _mm256_mul_ps(dw, dx));
        if (qt == GQ4_1) t[m] = _mm256_add_ps(t[m], _mm256_mul_ps(mw, _mm256_mul_ps(dx, _mm256_cvtepi32_ps(sx))));
    }
}

/* r[i] lane j -> r[j] lane i (8 x 8 floats) */
AI void transpose8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* 8 weight rows (wr, wr + rb, ...) against mt activation rows: each group's terms transposed so
 * that a vector holds one block's terms of the 8 rows, added in block order (no scalar chain) */
Q8_EXACT AI void gemv_rows8_q8(int qt, int mt, const uint8_t *wr, int64_t rb, const int8_t *q, const int8_t *qp,
                               const float *d, const int32_t *sq, int64_t K, float *res, int64_t N) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt];
    __m256 acc[MQ];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g += 8) {
        const int gl = nb - g < 8 ? (int)(nb - g) : 8;
        __m256 t[MQ][8];
        for (int r = 0; r < 8; r++) {
            __m256 tr[MQ];
            group_terms(qt, mt, wr + r * rb + g * bb, gl, q + g * 32, qp + g * 32, d + g, sq + g, nb, K, tr);
            for (int m = 0; m < mt; m++) t[m][r] = tr[m];
        }
        for (int m = 0; m < mt; m++) {
            transpose8x8(t[m]);
            for (int j = 0; j < gl; j++) acc[m] = _mm256_add_ps(acc[m], t[m][j]);
        }
    }
    for (int m = 0; m < mt; m++) _mm256_storeu_ps(res + m * N, acc[m]);
}
#endif

/* one weight row against mt activation rows: the block terms added in block order (top of file) */
Q8_EXACT AI void gemv_row_q8(int qt, int mt, const uint8_t *wr, const int8_t *q, const int8_t *qp, const float *d,
                             const int32_t *sq, int64_t K, float *res, int64_t N) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt];
    float acc[MQ] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t g = 0; g < nb; g += 8) {
        const int gl = nb - g < 8 ? (int)(nb - g) : 8;
#if GG_AVX512 || GG_AVX2
        __m256 t[MQ];
        group_terms(qt, mt, wr + g * bb, gl, q + g * 32, qp + g * 32, d + g, sq + g, nb, K, t);
        for (int m = 0; m < mt; m++) {
            float tf[8];
            _mm256_storeu_ps(tf, t[m]);
            for (int j = 0; j < gl; j++) acc[m] = acc[m] + tf[j];
        }
#else
        float dw[8] = {0}, mw[8] = {0};
        for (int j = 0; j < gl; j++) {
            dw[j] = half_to_float(wr + (g + j) * bb);
            if (qt == GQ4_1) mw[j] = half_to_float(wr + (g + j) * bb + 2);
        }
        int32_t is[MQ][8];
        block_dots(qt, mt, wr + g * bb, gl, q + g * 32, NULL, NULL, nb, K, is);
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < gl; j++) {
                const float dx = d[m * nb + g + j];
                float t = (float)is[m][j] * (dw[j] * dx);
                if (qt == GQ4_1) t = t + mw[j] * (dx * (float)sq[m * nb + g + j]);
                acc[m] = acc[m] + t;
            }
#endif
    }
    for (int m = 0; m < mt; m++) res[m * N] = acc[m];
}

#define GEMV_Q8_CASE(FN, QT)                                 \
    switch (mt) {                                            \
    case 1: FN(QT, 1, wr, ARGS); break;                      \
    case 2: FN(QT, 2, wr, ARGS); break;                      \
    case 3: FN(QT, 3, wr, ARGS); break;                      \
    default: FN(QT, 4, wr, ARGS); break;                     \
    }
#define GEMV_Q8_TYPES(FN)            \
    if (qt == GQ8_0) {               \
        GEMV_Q8_CASE(FN, GQ8_0)      \
    } else if (qt == GQ4_0) {        \
        GEMV_Q8_CASE(FN, GQ4_0)      \
    } else {                         \
        GEMV_Q8_CASE(FN, GQ4_1)      \
    }

/* weight rows [n0, n1) against activation rows [m0, m0 + mt): a function of its own so that the
 * OpenMP body below calls code built with Q8_EXACT's options */
Q8_EXACT __attribute__((noinline)) static void gemv_rows_q8(int qt, int mt, const uint8_t *w, int64_t rb,
                                                            int64_t n0, int64_t n1, const int8_t *qm,
                                                            const int8_t *pm, const float *dm, const int32_t *sm,
                                                            int64_t K, float *out, int64_t N, const uint8_t *w_end) {
    int64_t n = n0;
#if GG_AVX512 || GG_AVX2
    for (; n + 8 <= n1; n += 8) {
        const uint8_t *wr = w + n * rb;
        float *res = out + n;
        if (w_end)
            for (int r = 0; r < 8; r++) prefetch_ahead(wr + r * rb, rb, w_end);
#define ARGS rb, qm, pm, dm, sm, K, res, N
        GEMV_Q8_TYPES(gemv_rows8_q8)
#undef ARGS
    }
#endif
    for (; n < n1; n++) {
        const uint8_t *wr = w + n * rb;
        float *res = out + n;
        if (w_end) prefetch_ahead(wr, rb, w_end);
#define ARGS qm, pm, dm, sm, K, res, N
        GEMV_Q8_TYPES(gemv_row_q8)
#undef ARGS
    }
}

/* p = q with each pair of blocks (2i, 2i + 1) laid out as the Q4 pair kernel reads it: elements
 * 0..15 of both blocks, then 16..31 of both (a last odd block is copied as it is) */
static void pair_activations(const int8_t *q, int64_t M, int64_t K, int8_t *p) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const int8_t *src = q + m * K;
        int8_t *dst = p + m * K;
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            memcpy(dst + b * 32, src + b * 32, 16);
            memcpy(dst + b * 32 + 16, src + b * 32 + 32, 16);
            memcpy(dst + b * 32 + 32, src + b * 32 + 16, 16);
            memcpy(dst + b * 32 + 48, src + b * 32 + 48, 16);
        }
        if (b < nb) memcpy(dst + b * 32, src + b * 32, 32);
    }
}

/* activation rows from which the many-row tiles run (ggml_q8_tile.h; same bits either way, so a
 * matter of speed). On the issue-26 machine (Zen 4, one thread, weights in cache) the tiles were
 * 1.2-1.6x the row tiles at 5 rows and ~1.0x at 2-3; up to MQ rows the row tiles prefetch the
 * weight stream, which decode from memory needs. Tests move it (ggml_q8_set_tile_min_rows). */
#ifndef Q8_TILE_MIN_ROWS
#define Q8_TILE_MIN_ROWS 5
#endif
static int q8_tile_min_rows = Q8_TILE_MIN_ROWS;
/* 0: this build has no many-row tiles (ggml_q8_tile.h: AVX-512 + AVX512-VNNI only) */
int ggml_q8_tile_min_rows(void) { return Q8T_BUILT ? q8_tile_min_rows : 0; }
void ggml_q8_set_tile_min_rows(int rows) { q8_tile_min_rows = rows > 0 ? rows : 1; }

/* x [M, K] quantized per 32-block to int8, then integer block dot products with w */
int ggml_matmul_q8(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    const int64_t nb = K / 32, rb = nb * BLOCK_BYTES[qt];
    const int tiles = Q8T_BUILT && M >= q8_tile_min_rows;
    q8_acts a;
    if (q8_acts_quantize(x, M, K, (tiles ? 1 : 2) * M * K, &a) != TF_OK) /* q, then (row tiles) q paired */
        return TF_ENOMEM;
    int8_t *q = a.q;
    float *d = a.d;
    int32_t *sq = a.sq;
    int rc = TF_OK;
#if Q8T_BUILT
    if (tiles) {
        rc = q8t_matmul(qt, w, rb, M, N, K, q, d, sq, out);
        free(q);
        return rc;
    }
#endif
    int8_t *qp = q + M * K;
    if (qt != GQ8_0) pair_activations(q, M, K, qp);
    const int64_t chunks = (N + NC - 1) / NC;
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n1 = (c + 1) * NC < N ? (c + 1) * NC : N;
        for (int64_t m0 = 0; m0 < M; m0 += MQ) {
            const int mt = M - m0 < MQ ? (int)(M - m0) : MQ;
            gemv_rows_q8(qt, mt, w, rb, c * NC, n1, q + m0 * K, qp + m0 * K, d + m0 * nb, sq + m0 * nb, K,
                         out + m0 * N, N, M <= MQ ? w + N * rb : NULL); /* one tile (memory-bound): prefetch */
        }
    }
    free(q);
    return rc;
}
