/*
 * Matmuls against packed GGML weights (GGUF's Q8_0, Q4_0, Q4_1 blocks, kept as the file stores
 * them): out[M, N] = x[M, K] @ dequant(w[N, K/32 blocks]).T.
 *
 * Block layouts (32 weights each; d, m are float16):
 *   Q8_0: d, 32 x int8                 x_j = d * q_j                  (34 bytes)
 *   Q4_0: d, 16 bytes                  x_j = d * (q_j - 8)            (18 bytes)
 *   Q4_1: d, m, 16 bytes               x_j = d * q_j + m              (20 bytes)
 * In the 16 nibble bytes, element j < 16 is the low nibble of byte j and j + 16 its high nibble.
 *
 * Two activation modes:
 *   f32 (ggml_matmul_f32): each weight block is dequantized in registers and multiplied with the
 *     float32 activations (W4A32 / W8A32): float32 results, only the summation order differs from
 *     x @ dequant(w).T. A thread takes NC weight rows at a time and passes every tile of MT_MAX
 *     activation rows over them, dequantizing each block once per tile: at one tile (decode) each
 *     weight byte is read once; at many (prefill) the NC rows stay in L1. (A panel of weights
 *     dequantized once into a float buffer, then a register-tiled GEMM, measured 25% slower: the
 *     in-register dequantization overlaps the FMAs, the buffer's stores and loads do not.)
 *   q8 (ggml_matmul_q8): the activations are first quantized per 32-block to int8 (d = amax / 127,
 *     q = round-to-nearest-even(x * (1 / d)), d kept in float32), then each block is an integer dot
 *     product (VNNI vpdpbusd, AVX2 vpmaddubsw, or plain C) scaled by d_w * d_x; Q4_1 adds
 *     m_w * d_x * sum(q_x). The result equals quantize-dequantize(x) @ dequant(w).T up to float32
 *     summation order.
 *
 * Code paths, chosen at build time from the compiler's target (the library is built with
 * -march=native): AVX-512F (+ AVX512-VNNI/VL or AVX-VNNI for q8), AVX2 + FMA (+ F16C), and portable
 * C. The f32 kernels are written once over a small vector layer (vf, VW lanes) defined per ISA.
 * Work is split over weight rows with OpenMP (torch's threads: same libgomp). Functions that
 * allocate return TF_OK or TF_ENOMEM (common.h).
 */
#define _GNU_SOURCE /* syscall() for the AMX permission request */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(TF_GGML_SCALAR)
#define GG_AVX512 0
#define GG_AVX2 0
#elif defined(__AVX512F__)
#define GG_AVX512 1
#define GG_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#define GG_AVX512 0
#define GG_AVX2 1
#else
#define GG_AVX512 0
#define GG_AVX2 0
#endif

#if !defined(TF_GGML_SCALAR) && defined(__AVX2__) && \
    ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define GG_VNNI 1
#else
#define GG_VNNI 0
#endif

/* q8 on 512-bit VNNI: two blocks a vpdpbusd (else one block a 256-bit one) */
#if GG_AVX512 && GG_VNNI && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GG_Q8_512 1
#else
#define GG_Q8_512 0
#endif

enum { GQ8_0 = 0, GQ4_0 = 1, GQ4_1 = 2 };
static const int64_t BLOCK_BYTES[3] = {34, 18, 20};

#define AI static inline __attribute__((always_inline))
#define NC 16 /* weight rows a thread takes at a time: they stay in L1 while every row tile passes */
#if GG_AVX2
#define MT_MAX 2 /* activation rows per tile: 2 x 4 accumulators + 4 weight vectors in 16 registers */
#else
#define MT_MAX 4 /* activation rows per tile (AVX-512: 4 x 2 accumulators) */
#endif
#define MQ 4 /* activation rows per tile of the q8 kernel (one 8-lane accumulator each) */
/* parallelize a product of at least this many multiply-adds: a 192 x 576 GEMV ran as fast on one
 * thread as on two, and skips the barrier (which stalls when the other core is busy) */
#define PAR_MIN_WORK 262144

/* ---------- float16 scale ---------- */

AI float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__) && !defined(TF_GGML_SCALAR)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* 2^-24: subnormal halves are exact floats */
        return sign ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ---------- the vector layer of the f32 kernels ---------- */

#if GG_AVX512
#define VW 16
typedef __m512 vf;
AI vf v_zero(void) { return _mm512_setzero_ps(); }
AI vf v_load(const float *p) { return _mm512_loadu_ps(p); }
AI void v_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
AI vf v_set1(float f) { return _mm512_set1_ps(f); }
AI vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
AI vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
AI float v_sum(vf v) { return _mm512_reduce_add_ps(v); }
/* one block -> 32 floats in w[0..1] */
AI void deq_block(int qt, const uint8_t *b, vf *w) {
    const vf d = _mm512_set1_ps(half_to_float(b)); /* unused (and dropped) for Q4_1 */
    if (qt == GQ8_0) {
        w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))));
        w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))));
        return;
    }
    /* the 16 values a nibble can stand for, then a lookup per element (vpermps reads the low
     * 4 bits of each index: the low nibble needs no mask). Same roundings as d * (q - 8) and
     * fma(d, q, m): the table holds exactly those values. */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    if (qt == GQ4_0) {
        table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    } else { /* d and m converted together */
        int32_t dm;
        memcpy(&dm, b, 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        table = _mm512_fmadd_ps(_mm512_broadcastss_ps(f), iota, _mm512_broadcastss_ps(_mm_movehdup_ps(f)));
    }
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (qt == GQ4_1 ? 4 : 2))));
    w[0] = _mm512_permutexvar_ps(v, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
#elif GG_AVX2
#define VW 8
typedef __m256 vf;
AI vf v_zero(void) { return _mm256_setzero_ps(); }
AI vf v_load(const float *p) { return _mm256_loadu_ps(p); }
AI void v_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
AI vf v_set1(float f) { return _mm256_set1_ps(f); }
AI vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
AI vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
AI float v_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
AI vf cvt8(__m128i bytes8, int sgn) { /* the low 8 bytes, widened to floats */
    return _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}
AI void deq_block(int qt, const uint8_t *b, vf *w) {
    const vf d = _mm256_set1_ps(half_to_float(b));
    if (qt == GQ8_0) {
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, cvt8(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)), 1));
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (qt == GQ4_1 ? 4 : 2)));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const vf m = qt == GQ4_1 ? _mm256_set1_ps(half_to_float(b + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(d, cvt8(part[i], 0), m); /* Q4_0: d*q - 8d, exact */
}
#else
#define VW 1
typedef float vf;
AI vf v_zero(void) { return 0.0f; }
AI vf v_load(const float *p) { return *p; }
AI void v_store(float *p, vf v) { *p = v; }
AI vf v_set1(float f) { return f; }
AI vf v_fma(vf a, vf b, vf c) { return a * b + c; }
AI vf v_add(vf a, vf b) { return a + b; }
AI float v_sum(vf v) { return v; }
AI void deq_block(int qt, const uint8_t *b, vf *w) {
    const float d = half_to_float(b);
    if (qt == GQ8_0) {
        for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)b[2 + j];
        return;
    }
    const uint8_t *q = b + (qt == GQ4_1 ? 4 : 2);
    const float m = qt == GQ4_1 ? half_to_float(b + 2) : 0.0f;
    const int off = qt == GQ4_0 ? 8 : 0;
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((q[j] & 15) - off) + m;
        w[j + 16] = d * (float)((q[j] >> 4) - off) + m;
    }
}
#endif
#define NV (32 / VW) /* vectors per block */

/* ---------- f32 activations, few rows: stream each weight row once per tile ---------- */

/* res[m * N] = dot(x row m, dequant(weight row)) for the mt rows of one tile */
AI void gemv_row(int qt, int mt, const uint8_t *wr, const float *x, int64_t K, float *res, int64_t N) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt];
    /* two blocks a step into two sets of accumulators where the registers allow (else one
     * row's FMA latency bounds the loop). U must not depend on mt: a row's sum then runs in the
     * same order whatever tile it is in, so its result does not depend on the batch. */
    const int U = GG_AVX512 ? 2 : 1;
    vf acc[8][NV];
    for (int m = 0; m < U * mt; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = v_zero();
    int64_t b = 0;
    for (; b + U <= nb; b += U)
        for (int u = 0; u < U; u++) {
            vf w[NV];
            deq_block(qt, wr + (b + u) * bb, w);
            for (int m = 0; m < mt; m++)
                for (int v = 0; v < NV; v++)
                    acc[u * mt + m][v] = v_fma(w[v], v_load(x + m * K + (b + u) * 32 + v * VW), acc[u * mt + m][v]);
        }
    for (; b < nb; b++) {
        vf w[NV];
        deq_block(qt, wr + b * bb, w);
        for (int m = 0; m < mt; m++)
            for (int v = 0; v < NV; v++) acc[m][v] = v_fma(w[v], v_load(x + m * K + b * 32 + v * VW), acc[m][v]);
    }
    for (int m = 0; m < mt; m++) {
        vf s = acc[m][0];
        for (int v = 1; v < NV; v++) s = v_add(s, acc[m][v]);
        if (U == 2)
            for (int v = 0; v < NV; v++) s = v_add(s, acc[mt + m][v]);
        res[m * N] = v_sum(s);
    }
}

/* the (qtype, tile rows) pairs as constants, so each inlined copy keeps its accumulators in registers */
#define GEMV_CASE(QT)                                                                 \
    switch (mt) {                                                                     \
    case 1: gemv_row(QT, 1, wr, xm, K, res, N); break;                                \
    case 2: gemv_row(QT, 2, wr, xm, K, res, N); break;                                \
    case 3: gemv_row(QT, 3, wr, xm, K, res, N); break;                                \
    default: gemv_row(QT, 4, wr, xm, K, res, N); break;                               \
    }

static void gemv_f32(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    const int64_t rb = K / 32 * BLOCK_BYTES[qt], chunks = (N + NC - 1) / NC;
#pragma omp parallel for schedule(static) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n1 = (c + 1) * NC < N ? (c + 1) * NC : N;
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
            const int mt = M - m0 < MT_MAX ? (int)(M - m0) : MT_MAX;
            const float *xm = x + m0 * K;
            for (int64_t n = c * NC; n < n1; n++) {
                const uint8_t *wr = w + n * rb;
                float *res = out + m0 * N + n;
                if (qt == GQ8_0) {
                    GEMV_CASE(GQ8_0)
                } else if (qt == GQ4_0) {
                    GEMV_CASE(GQ4_0)
                } else {
                    GEMV_CASE(GQ4_1)
                }
            }
        }
    }
}

/* x [M, K] float32 (contiguous) @ dequant(w [N, K/32 blocks]).T -> out [M, N] float32 */
int ggml_matmul_f32(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    gemv_f32(x, w, M, N, K, qt, out);
    return TF_OK;
}

/* ---------- q8 activations ---------- */

/* x [M, K] -> int8 q [M, K], per 32-block scale d [M, K/32] and d * sum(q) s [M, K/32] */
/* exact IEEE division and rounding here: the reference (ggml_matmul.py) must reproduce every q */
__attribute__((optimize("no-fast-math"))) static void quantize_rows_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
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
            const __m512 dw2 = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(b0)), _mm256_set1_ps(half_to_float(b1)), 1);
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

/* ---------- embedding rows ---------- */

/* out [R, K] = dequant(w rows rows[0..R)) (rows already checked to be in range) */
void ggml_dequant_rows(const uint8_t *w, int64_t K, int qt, const int64_t *rows, int64_t R, float *out) {
    const int64_t nb = K / 32, rb = nb * BLOCK_BYTES[qt];
#pragma omp parallel for schedule(static) if (R * K >= PAR_MIN_WORK)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *wr = w + rows[r] * rb;
        for (int64_t b = 0; b < nb; b++) {
            vf v[NV];
            deq_block(qt, wr + b * BLOCK_BYTES[qt], v);
            for (int i = 0; i < NV; i++) v_store(out + r * K + b * 32 + i * VW, v[i]);
        }
    }
}

/* ---------- what was built, and whether AMX may run ---------- */

/* bit 0: AVX-512 f32 path, 1: AVX2 f32 path, 2: VNNI q8 dots, 3: F16C scale conversion */
int ggml_isa(void) {
    int f = 0;
    if (GG_AVX512) f |= 1;
    if (GG_AVX2) f |= 2;
    if (GG_VNNI) f |= 4;
#if defined(__F16C__) && !defined(TF_GGML_SCALAR)
    f |= 8;
#endif
    return f;
}

#if defined(__x86_64__) && defined(__GNUC__) && (__GNUC__ >= 11)
/* 0: AMX tiles usable (the kernel granted XTILEDATA and a tile instruction ran); 1: the CPU does
 * not report AMX-TILE and AMX-INT8; 2: the OS has not enabled the tile state in XCR0; 3:
 * arch_prctl(ARCH_REQ_XCOMP_PERM) refused. A VM may report the flags and still fault on the first
 * tile instruction (SIGILL): call this in a child process. */
__attribute__((target("amx-tile"))) int ggml_amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 1;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 2; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 2; /* XTILECFG, XTILEDATA */
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 3;
    uint8_t cfg[64] = {0};
    cfg[0] = 1;                  /* palette 1 */
    cfg[16] = 64;                /* tile 0: 64 bytes a row */
    cfg[48] = 16;                /* 16 rows */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
#else
int ggml_amx_probe(void) { return 1; }
#endif
