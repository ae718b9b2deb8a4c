/* W4A16 on CPU: activations (float32 or bfloat16) times 4-bit packed weights that stay packed.
 *
 * The weight is kernels/w4a16.py's byte layout: q uint8 [N, ceil(K/2)] (element 2j in the low
 * nibble of byte j, 2j+1 in the high one), one scale per group of G elements along K, and for
 * NVFP4 an optional float32 global scale per output row; an optional float32 bias. Codecs: 0 int4 (nibble - 8), 1 MXFP4
 * (E2M1 codes, E8M0 scales 2^(s-127)), 2 NVFP4 (E2M1 codes, E4M3 scales). Scale storage kinds:
 * 0 float32, 1 bfloat16, 2 float16, 3 E8M0 byte, 4 E4M3 byte.
 *
 * A thread decodes one weight row at a time into a float row (value * scale, rounded to bfloat16
 * when the activations are bfloat16, as the reference rounds the dequantized weight to the
 * activation dtype), then takes its dot product with every activation row: each packed byte is
 * read once per call and the full-precision copy is one row per thread. Sums are float32 in the
 * compiler's vectorized order (the reference differs by summation order only).
 */
#include <math.h>
#include <stdlib.h>

#include "common.h"

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float f16_to_f32(uint16_t h) {
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

int w4a16_matmul(const void *x, int x_bf16, int64_t sx, const uint8_t *q, int64_t sq, const void *scales,
                 int scale_kind, int64_t ss, const float *gscale, const float *bias, int codec, int64_t group, int64_t m_rows,
                 int64_t n, int64_t k, void *out, int out_bf16, int64_t so) {
    float lut[16];
    for (int i = 0; i < 16; i++) lut[i] = codec == 0 ? (float)(i - 8) : E2M1[i];
    const float *xf = (const float *)x;
    float *xw = NULL;
    int64_t sxf = sx;
    if (x_bf16) { /* widen the activations once */
        xw = malloc(sizeof(float) * (size_t)(m_rows * k > 0 ? m_rows * k : 1));
        if (!xw) return TF_ENOMEM;
        for (int64_t r = 0; r < m_rows; r++) widen_bf16((const uint16_t *)x + r * sx, xw + r * k, k);
        xf = xw;
        sxf = k;
    }
    int failed = 0;
    const size_t sb = scale_bytes(scale_kind);
#pragma omp parallel
    {
        float *restrict w = malloc(sizeof(float) * (size_t)(k > 0 ? k : 1));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < n; row++) {
            if (!w) continue;
            const uint8_t *restrict qr = q + row * sq;
            const char *sr = (const char *)scales + (size_t)(row * ss) * sb;
            for (int64_t g0 = 0; g0 < k; g0 += group) {
                float s = scale_at(sr, scale_kind, g0 / group);
                int64_t g1 = g0 + group < k ? g0 + group : k;
                /* groups start at even k: byte j holds elements 2j, 2j + 1 */
                int64_t j1 = g1 >> 1;
                if (codec == 0) {
                    for (int64_t j = g0 >> 1; j < j1; j++) {
                        uint8_t b = qr[j];
                        w[2 * j] = (float)((int)(b & 15) - 8) * s;
                        w[2 * j + 1] = (float)((int)(b >> 4) - 8) * s;
                    }
                } else {
                    for (int64_t j = g0 >> 1; j < j1; j++) {
                        uint8_t b = qr[j];
                        w[2 * j] = lut[b & 15] * s;
                        w[2 * j + 1] = lut[b >> 4] * s;
                    }
                }
                if (g1 & 1) w[g1 - 1] = lut[qr[g1 >> 1] & 15] * s; /* an odd K's last element */
                if (x_bf16)
                    for (int64_t kk = g0; kk < g1; kk++) w[kk] = round_bf16(w[kk]);
            }
            float g = gscale ? gscale[row] : 1.0f;
            for (int64_t r = 0; r < m_rows; r++) {
                const float *restrict xr = xf + r * sxf;
                float acc = 0.0f;
                for (int64_t kk = 0; kk < k; kk++) acc += xr[kk] * w[kk];
                acc *= g;
                if (bias) acc += bias[row];
                if (out_bf16)
                    ((uint16_t *)out)[r * so + row] = f32_to_bf16(acc);
                else
                    ((float *)out)[r * so + row] = acc;
            }
        }
        free(w);
    }
    free(xw);
    return failed ? TF_ENOMEM : TF_OK;
}
