/* Packed GGML matmul with the activations quantized per 32-block to int8 (act="q8"): integer block
 * dot products (512-bit VNNI two blocks at a time, 256-bit VNNI, AVX2 maddubs, or plain C). Formats
 * and the quantization rule: ggml_common.h. */
#include "ggml_common.h"

#define MQ 4 /* activation rows per tile of the q8 kernel (one 8-lane accumulator each) */

/* ---------- q8 activations ---------- */

/* x [M, K] -> int8 q [M, K], per 32-block scale d [M, K/32] and d * sum(q) s [M, K/32] */
/* exact IEEE division and rounding here: the reference (ggml_matmul.py) must reproduce every q */
__attribute__((optimize("no-fast-math"))) static void quantize_rows_q8(const float *x, int64_t M, int64_t K,
                                                                       int8_t *q, float *d, float *s) {
#pragma omp parallel for schedule(static) if (M * K >= PAR_MIN_WORK)
    for (int64_t i = 0; i < M * (K / 32); i++) {
        const float *xb = x + i * 32;
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
        s[i] = db * (float)sum;
    }
}

#if GG_AVX512 || GG_AVX2
/* 8 int32 lanes summing to dot(u, s) of 32 unsigned (u) and signed (s) bytes */
AI __m256i dot_us(__m256i u, __m256i s) {
#if GG_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#endif
#else
    /* u <= 128, |s| <= 127 here: the pairwise int16 sums cannot saturate */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* the 32 weights of a block as bytes (Q4_1: unsigned nibbles; Q4_0: q - 8; Q8_0: q) */
AI __m256i wbytes(int qt, const uint8_t *b) {
    if (qt == GQ8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (qt == GQ4_1 ? 4 : 2)));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
    const __m256i v = _mm256_set_m128i(hi, lo);
    return qt == GQ4_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(8)) : v;
}
#endif

#if GG_Q8_512
/* blocks b0, b1 as 64 unsigned bytes: Q4 nibbles as they are (Q4_0's -8 is in the accumulator's
 * start value), Q8_0 offset by 128 (its -128 * sum(a) likewise) */
AI __m512i wbytes2(int qt, const uint8_t *b0, const uint8_t *b1) {
    if (qt == GQ8_0) {
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        return _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80));
    }
    const int off = qt == GQ4_1 ? 4 : 2;
    const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + off))),
                                              _mm_loadu_si128((const __m128i *)(b1 + off)), 1);
    const __m256i lo = _mm256_and_si256(y, _mm256_set1_epi8(15));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(y, 4), _mm256_set1_epi8(15));
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* lo0 lo1 hi0 hi1 */
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));             /* lo0 hi0 lo1 hi1 */
}
#endif

/* da16 [mt][nb/2][16]: the activation scales of block pairs, each over its 8 lanes; ci (Q4_0,
 * Q8_0) the accumulators' start values, -offset * (lane sums of q). Both NULL without GG_Q8_512. */
AI void gemv_row_q8(int qt, int mt, const uint8_t *wr, const int8_t *q, const float *d, const float *s, int64_t K,
                    float *res, int64_t N, const float *da16, const int32_t *ci) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt];
    float accm[MQ] = {0}, acc2[MQ] = {0};
    int64_t b = 0;
#if GG_Q8_512
    {
        const int64_t np = nb / 2;
        __m512 a5[MQ];
        for (int m = 0; m < mt; m++) a5[m] = _mm512_setzero_ps();
        for (int64_t p = 0; p < np; p++) {
            const uint8_t *b0 = wr + 2 * p * bb, *b1 = b0 + bb;
            const __m512i wz = wbytes2(qt, b0, b1);
            const __m512 dw2 =
                _mm512_insertf32x8(_mm512_set1_ps(half_to_float(b0)), _mm256_set1_ps(half_to_float(b1)), 1);
            for (int m = 0; m < mt; m++) {
                const int64_t o = (m * np + p) * 16;
                const __m512i init = qt == GQ4_1 ? _mm512_setzero_si512() : _mm512_loadu_si512(ci + o);
                const __m512i dot = _mm512_dpbusd_epi32(init, wz, _mm512_loadu_si512(q + m * K + p * 64));
                a5[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw2, _mm512_loadu_ps(da16 + o)), a5[m]);
            }
            if (qt == GQ4_1) {
                const float m0 = half_to_float(b0 + 2), m1 = half_to_float(b1 + 2);
                for (int m = 0; m < mt; m++) accm[m] += m0 * s[m * nb + 2 * p] + m1 * s[m * nb + 2 * p + 1];
            }
        }
        for (int m = 0; m < mt; m++) acc2[m] = _mm512_reduce_add_ps(a5[m]);
        b = 2 * np;
    }
#else
    (void)da16;
    (void)ci;
#endif
#if GG_AVX512 || GG_AVX2
    __m256 acc[MQ];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (; b < nb; b++) {
        const uint8_t *blk = wr + b * bb;
        const float dw = half_to_float(blk);
        const __m256i wv = wbytes(qt, blk);
        const __m256i wu = qt == GQ4_1 ? wv : _mm256_sign_epi8(wv, wv); /* |w| */
        for (int m = 0; m < mt; m++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(q + m * K + b * 32));
            if (qt != GQ4_1) a = _mm256_sign_epi8(a, wv); /* sign(w) * a: |w| * (sign(w) * a) = w * a */
            const __m256 dot = _mm256_cvtepi32_ps(dot_us(wu, a));
            acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * d[m * nb + b]), acc[m]);
        }
        if (qt == GQ4_1) {
            const float mw = half_to_float(blk + 2);
            for (int m = 0; m < mt; m++) accm[m] += mw * s[m * nb + b];
        }
    }
    for (int m = 0; m < mt; m++) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        res[m * N] = (_mm_cvtss_f32(v) + acc2[m]) + accm[m];
    }
#else
    float acc[MQ] = {0};
    (void)acc2;
    for (; b < nb; b++) {
        const uint8_t *blk = wr + b * bb;
        const float dw = half_to_float(blk);
        int8_t wq[32];
        if (qt == GQ8_0) {
            memcpy(wq, blk + 2, 32);
        } else {
            const uint8_t *p = blk + (qt == GQ4_1 ? 4 : 2);
            const int off = qt == GQ4_0 ? 8 : 0;
            for (int j = 0; j < 16; j++) {
                wq[j] = (int8_t)((p[j] & 15) - off);
                wq[j + 16] = (int8_t)((p[j] >> 4) - off);
            }
        }
        for (int m = 0; m < mt; m++) {
            const int8_t *a = q + m * K + b * 32;
            int32_t dot = 0;
            for (int j = 0; j < 32; j++) dot += (int32_t)wq[j] * a[j];
            acc[m] += (dw * d[m * nb + b]) * (float)dot;
        }
        if (qt == GQ4_1) {
            const float mw = half_to_float(blk + 2);
            for (int m = 0; m < mt; m++) accm[m] += mw * s[m * nb + b];
        }
    }
    for (int m = 0; m < mt; m++) res[m * N] = acc[m] + accm[m];
#endif
}

#define GEMV_Q8_CASE(QT)                                                    \
    switch (mt) {                                                           \
    case 1: gemv_row_q8(QT, 1, wr, qm, dm, sm, K, res, N, dam, cim); break;           \
    case 2: gemv_row_q8(QT, 2, wr, qm, dm, sm, K, res, N, dam, cim); break;           \
    case 3: gemv_row_q8(QT, 3, wr, qm, dm, sm, K, res, N, dam, cim); break;           \
    default: gemv_row_q8(QT, 4, wr, qm, dm, sm, K, res, N, dam, cim); break;          \
    }

/* x [M, K] quantized per 32-block to int8, then integer block dot products with w */
int ggml_matmul_q8(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    const int64_t nb = K / 32, rb = nb * BLOCK_BYTES[qt];
    int8_t *q = malloc((size_t)(M * K) + 1);
    float *d = malloc(sizeof(float) * (size_t)(M * nb) * 2 + sizeof(float));
    if (!q || !d) {
        free(q);
        free(d);
        return TF_ENOMEM;
    }
    float *s = d + M * nb;
    quantize_rows_q8(x, M, K, q, d, s);
    const int64_t np = nb / 2;
    float *da16 = NULL;
    int32_t *ci = NULL;
#if GG_Q8_512
    da16 = malloc(sizeof(float) * (size_t)(M * np * 16) + 64);
    ci = malloc(sizeof(int32_t) * (size_t)(M * np * 16) + 64);
    if (!da16 || !ci) {
        free(q);
        free(d);
        free(da16);
        free(ci);
        return TF_ENOMEM;
    }
    const int32_t offset = qt == GQ8_0 ? 128 : (qt == GQ4_0 ? 8 : 0);
    for (int64_t i = 0; i < M * np; i++) {
        const int64_t m = i / np, p = i % np;
        _mm512_storeu_ps(da16 + i * 16, _mm512_insertf32x8(_mm512_set1_ps(d[m * nb + 2 * p]),
                                                           _mm256_set1_ps(d[m * nb + 2 * p + 1]), 1));
        const __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1),
                                                  _mm512_loadu_si512(q + m * K + p * 64));
        _mm512_storeu_si512(ci + i * 16, _mm512_mullo_epi32(lanes, _mm512_set1_epi32(-offset)));
    }
#endif
    const int64_t chunks = (N + NC - 1) / NC;
#pragma omp parallel for schedule(static) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n1 = (c + 1) * NC < N ? (c + 1) * NC : N;
        for (int64_t m0 = 0; m0 < M; m0 += MQ) {
            const int mt = M - m0 < MQ ? (int)(M - m0) : MQ;
            const int8_t *qm = q + m0 * K;
            const float *dm = d + m0 * nb, *sm = s + m0 * nb, *dam = da16 ? da16 + m0 * np * 16 : NULL;
            const int32_t *cim = ci ? ci + m0 * np * 16 : NULL;
            for (int64_t n = c * NC; n < n1; n++) {
                const uint8_t *wr = w + n * rb;
                float *res = out + m0 * N + n;
                if (qt == GQ8_0) {
                    GEMV_Q8_CASE(GQ8_0)
                } else if (qt == GQ4_0) {
                    GEMV_Q8_CASE(GQ4_0)
                } else {
                    GEMV_Q8_CASE(GQ4_1)
                }
            }
        }
    }
    free(q);
    free(d);
    free(da16);
    free(ci);
    return TF_OK;
}
