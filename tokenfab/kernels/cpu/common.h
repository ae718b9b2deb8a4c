/* Shared helpers of the CPU kernels: status codes, bfloat16 <-> float conversion. */
#ifndef TOKENFAB_CPU_COMMON_H
#define TOKENFAB_CPU_COMMON_H
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* What every kernel that allocates returns; the Python wrapper turns a non-zero code into an
 * exception (kernels/cpu/__init__.py, check_status). A failed malloc skips the work, frees what
 * was taken and returns TF_ENOMEM: the output is then undefined, but nothing is corrupted. */
enum { TF_OK = 0, TF_ENOMEM = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* float rounded to bfloat16 precision, kept as float (what a bf16 tensor op would store) */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* n bfloat16 values widened to float */
static inline void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* n floats rounded to bfloat16 */
static inline void narrow_bf16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* a row of n elements (float32, or bfloat16 when bf16) read as floats */
static inline void load_row(const void *src, int bf16, float *dst, int64_t n) {
    if (bf16)
        widen_bf16((const uint16_t *)src, dst, n);
    else
        memcpy(dst, src, sizeof(float) * n);
}

static inline void store_row(const float *src, int bf16, void *dst, int64_t n) {
    if (bf16)
        narrow_bf16(src, (uint16_t *)dst, n);
    else
        memcpy(dst, src, sizeof(float) * n);
}

#endif
