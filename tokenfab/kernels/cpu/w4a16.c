/* W4A16 on CPU: activations (float32 or bfloat16) times 4-bit packed weights that stay packed.
 *
 * The weight is kernels/w4a16.py's byte layout: q uint8 [N, ceil(K/2)] (element 2j in the low
 * nibble of byte j, 2j+1 in the high one), one scale per group of G elements along K, and for
 * NVFP4 an optional float32 global scale per output row; an optional float32 bias. Codecs: 0 int4 (nibble - 8), 1 MXFP4
 * (E2M1 codes, E8M0 scales 2^(s-127)), 2 NVFP4 (E2M1 codes, E4M3 scales). Scale storage kinds:
 * 0 float32, 1 bfloat16, 2 float16, 3 E8M0 byte, 4 E4M3 byte.
 *
 * A thread decodes one weight row at a time into float rows of its low and high nibbles (value *
 * scale, rounded to bfloat16 when the activations are bfloat16, as the reference rounds the
 * dequantized weight to the activation dtype), then takes their dot product with every activation
 * row (split once into even and odd elements): each packed byte is read once per call and the
 * full-precision copy is one row per thread. Sums are float32 in the compiler's vectorized order
 * (the reference differs by summation order only).
 *
 * Code paths (common.h): the decode is a table lookup per nibble, AVX-512 (one 16-entry vpermps) or
 * AVX2 (two 8-entry vpermps and a blend), else C; each value is the same product code * scale on
 * every path, and the dot products are the same compiled loop (GCC vectorizes it 8 wide for both
 * targets), so the AVX2 and AVX-512 builds agree bit for bit. F16C converts float16 scales (exact).
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h); /* exact, as the bit arithmetic below */
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    if (exp == 31) {
        uint32_t u = sign | 0x7f800000u | (man << 13);
        memcpy(&f, &u, sizeof f);
        return f;
    }
    uint32_t u = sign | ((exp + 112) << 23) | (man << 13);
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

static inline float e4m3_to_f32(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
    return (b & 128) ? -mag : mag;
}

static inline float scale_at(const void *s, int kind, int64_t i) {
    switch (kind) {
    case 0: return ((const float *)s)[i];
    case 1: return bf16_to_f32(((const uint16_t *)s)[i]);
    case 2: return f16_to_f32(((const uint16_t *)s)[i]);
    case 3: return ldexpf(1.0f, (int)((const uint8_t *)s)[i] - 127);
    default: return e4m3_to_f32(((const uint8_t *)s)[i]);
    }
}

static inline size_t scale_bytes(int kind) { return kind == 0 ? 4 : (kind <= 2 ? 2 : 1); }

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* nb bytes (a compile-time 16 or 8 after inlining: one vector each) -> their low and high values x s */
static inline void decode_bytes(const uint8_t *restrict b, float *restrict lo, float *restrict hi, float s,
                                int int4, int64_t nb) {
#if TF_AVX512
    if (nb == 16) { /* 16 bytes: a 16-entry table lookup per nibble in one vpermps */
        static const float INT4[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
        __m512 table = _mm512_mul_ps(_mm512_loadu_ps(int4 ? INT4 : E2M1), _mm512_set1_ps(s));
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        _mm512_storeu_ps(lo, _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table));
        _mm512_storeu_ps(hi, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table));
        return;
    }
#elif TF_AVX2
    if (nb == 16 || nb == 8) { /* the 16-entry table as two 8-entry halves; bit 3 of the code picks the half */
        static const float INT4[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
        const float *t = int4 ? INT4 : E2M1;
        const __m256 sv = _mm256_set1_ps(s);
        const __m256 t0 = _mm256_mul_ps(_mm256_loadu_ps(t), sv), t1 = _mm256_mul_ps(_mm256_loadu_ps(t + 8), sv);
        for (int64_t i = 0; i < nb; i += 8) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + i)));
            const __m256i l = _mm256_and_si256(v, _mm256_set1_epi32(15)), h = _mm256_srli_epi32(v, 4);
            _mm256_storeu_ps(lo + i, _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, l), _mm256_permutevar8x32_ps(t1, l),
                                                      _mm256_castsi256_ps(_mm256_slli_epi32(l, 28))));
            _mm256_storeu_ps(hi + i, _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, h), _mm256_permutevar8x32_ps(t1, h),
                                                      _mm256_castsi256_ps(_mm256_slli_epi32(h, 28))));
        }
        return;
    }
#endif
    if (int4) {
        for (int64_t i = 0; i < nb; i++) {
            lo[i] = (float)((int)(b[i] & 15) - 8) * s;
            hi[i] = (float)((int)(b[i] >> 4) - 8) * s;
        }
    } else {
        for (int64_t i = 0; i < nb; i++) {
            lo[i] = E2M1[b[i] & 15] * s;
            hi[i] = E2M1[b[i] >> 4] * s;
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* NVFP4: 16 bytes = two groups of 8 bytes (16 values each), scales s0 then s1, one vpermps per nibble */
static inline void decode_bytes_2x8(const uint8_t *restrict b, float *restrict lo, float *restrict hi, float s0,
                                    float s1) {
    __m512 table = _mm512_loadu_ps(E2M1);
    __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    _mm512_storeu_ps(lo, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table), sv));
    _mm512_storeu_ps(hi, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), sv));
}
#endif

/* One packed row -> lo[j] = value(low nibble of byte j) * scale, hi[j] likewise (K2 bytes). */
static void decode_row(const uint8_t *restrict qr, const char *sr, int scale_kind, int int4, int64_t k2,
                       int64_t half_group, float *restrict lo, float *restrict hi) {
    int64_t full = k2 / half_group, g = 0;
    if (half_group == 16)
        for (; g < full; g++) decode_bytes(qr + g * 16, lo + g * 16, hi + g * 16, scale_at(sr, scale_kind, g), int4, 16);
    else if (half_group == 8) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
        if (!int4)
            for (; g + 1 < full; g += 2)
                decode_bytes_2x8(qr + g * 8, lo + g * 8, hi + g * 8, scale_at(sr, scale_kind, g),
                                 scale_at(sr, scale_kind, g + 1));
#endif
        for (; g < full; g++) decode_bytes(qr + g * 8, lo + g * 8, hi + g * 8, scale_at(sr, scale_kind, g), int4, 8);
    }
    for (; g * half_group < k2; g++) { /* other group sizes, and a ragged last group */
        int64_t j0 = g * half_group, nb = k2 - j0 < half_group ? k2 - j0 : half_group;
        decode_bytes(qr + j0, lo + j0, hi + j0, scale_at(sr, scale_kind, g), int4, nb);
    }
}

int w4a16_matmul(const void *x, int x_bf16, int64_t sx, const uint8_t *q, int64_t sq, const void *scales,
                 int scale_kind, int64_t ss, const float *gscale, const float *bias, int codec, int64_t group,
                 int64_t m_rows, int64_t n, int64_t k, void *out, int out_bf16, int64_t so) {
    /* The activations split once into even and odd elements ([M, 2, K2], K2 = ceil(K / 2), an odd
     * K's missing element 0): byte j's low nibble meets x[2j], its high nibble x[2j + 1], so the
     * decode and the dot run over contiguous arrays (no interleaving shuffles). */
    const int64_t k2 = (k + 1) / 2, half_group = group / 2;
    float *xs = malloc(sizeof(float) * (size_t)(m_rows * 2 * k2 > 0 ? m_rows * 2 * k2 : 1));
    if (!xs) return TF_ENOMEM;
    for (int64_t r = 0; r < m_rows; r++) {
        float *ev = xs + r * 2 * k2, *od = ev + k2;
        for (int64_t j = 0; j < k2; j++) {
            int64_t i0 = 2 * j, i1 = 2 * j + 1;
            ev[j] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * sx + i0]) : ((const float *)x)[r * sx + i0];
            od[j] = i1 >= k ? 0.0f
                            : (x_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * sx + i1]) : ((const float *)x)[r * sx + i1]);
        }
    }
    int failed = 0;
    const size_t sb = scale_bytes(scale_kind);
#pragma omp parallel num_threads(tf_nthreads())
    {
        float *restrict lo = malloc(sizeof(float) * (size_t)(2 * k2 > 0 ? 2 * k2 : 1));
        float *restrict hi = lo ? lo + k2 : NULL;
        if (!lo) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < n; row++) {
            if (!lo) continue;
            decode_row(q + row * sq, (const char *)scales + (size_t)(row * ss) * sb, scale_kind, codec == 0, k2,
                       half_group, lo, hi);
            if (x_bf16) /* the reference rounds the dequantized weight to the activation dtype */
                for (int64_t j = 0; j < 2 * k2; j++) lo[j] = round_bf16(lo[j]);
            float gs = gscale ? gscale[row] : 1.0f;
            for (int64_t r = 0; r < m_rows; r++) {
                const float *restrict ev = xs + r * 2 * k2, *restrict od = ev + k2;
                float acc = 0.0f;
                for (int64_t j = 0; j < k2; j++) acc += ev[j] * lo[j] + od[j] * hi[j];
                acc *= gs;
                if (bias) acc += bias[row];
                if (out_bf16)
                    ((uint16_t *)out)[r * so + row] = f32_to_bf16(acc);
                else
                    ((float *)out)[r * so + row] = acc;
            }
        }
        free(lo);
    }
    free(xs);
    return failed ? TF_ENOMEM : TF_OK;
}

/* Rows [0, n) of a packed weight dequantized to float32 [n, k] (value * scale, rounded to bfloat16
 * precision when to_bf16): the tiles of the prefill path, which multiplies them with torch's GEMM. */
int w4a16_dequant(const uint8_t *q, int64_t sq, const void *scales, int scale_kind, int64_t ss, int codec,
                  int64_t group, int64_t n, int64_t k, float *out, int to_bf16) {
    const int64_t k2 = (k + 1) / 2;
    int failed = 0;
    const size_t sb = scale_bytes(scale_kind);
#pragma omp parallel num_threads(tf_nthreads())
    {
        float *restrict lo = malloc(sizeof(float) * (size_t)(2 * k2 > 0 ? 2 * k2 : 1));
        float *restrict hi = lo ? lo + k2 : NULL;
        if (!lo) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < n; row++) {
            if (!lo) continue;
            decode_row(q + row * sq, (const char *)scales + (size_t)(row * ss) * sb, scale_kind, codec == 0, k2,
                       group / 2, lo, hi);
            float *restrict o = out + row * k;
            for (int64_t j = 0; j < k / 2; j++) {
                o[2 * j] = lo[j];
                o[2 * j + 1] = hi[j];
            }
            if (k & 1) o[k - 1] = lo[k2 - 1];
            if (to_bf16)
                for (int64_t i = 0; i < k; i++) o[i] = round_bf16(o[i]);
        }
        free(lo);
    }
    return failed ? TF_ENOMEM : TF_OK;
}
