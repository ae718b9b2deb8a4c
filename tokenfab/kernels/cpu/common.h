/* Shared helpers of the CPU kernels: status codes, the code path of this build, bfloat16 and
 * float8 e4m3 -> float conversion. */
#ifndef TOKENFAB_CPU_COMMON_H
#define TOKENFAB_CPU_COMMON_H
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* The vector path of the kernels outside ggml_*.c, chosen at build time from the compiler's target
 * (the library is built with -march=native, so from the CPU's CPUID flags): AVX-512F, else AVX2 with
 * FMA (x86-64-v3), else portable C that the compiler vectorizes as it can. The AVX2 path of each
 * kernel takes the AVX-512 path's steps per lane and in its summation order, so the two give the
 * same bits (tests/kernels/test_cpu_native_isa.py; the exceptions are listed there). */
#if defined(__AVX512F__)
#define TF_AVX512 1
#define TF_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#define TF_AVX512 0
#define TF_AVX2 1
#else
#define TF_AVX512 0
#define TF_AVX2 0
#endif

/* Threads of every parallel region (threads.c): tf_set_num_threads(n) for all calling threads, else
 * OpenMP's default for the caller. Every `#pragma omp parallel` of the kernels says num_threads(tf_nthreads()). */
extern int tf_threads_setting;
static inline int tf_nthreads(void) { return tf_threads_setting > 0 ? tf_threads_setting : omp_get_max_threads(); }

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
#if TF_AVX512
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
    }
#elif TF_AVX2
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(w));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* a float8 e4m3 (fn: no infinities) byte as float: exponent bits 6..3 (bias 7), mantissa bits 2..0;
 * 0x7f / 0xff (NaN) are never stored (writers clamp to +-448) and read as +-480. Exact: no rounding,
 * no float subnormal formed, so every path below gives the same bits. */
static inline float e4m3_to_float(uint8_t b) {
    const uint32_t mag = b & 0x7fu;
    float f;
    if (mag < 8) {
        f = (float)mag * (1.0f / 512.0f); /* subnormal: m * 2^-9 */
    } else {
        const uint32_t u = (mag << 20) + (120u << 23); /* exponent rebased from 7 to 127 */
        memcpy(&f, &u, sizeof f);
    }
    return (b & 0x80u) ? -f : f;
}

/* n e4m3 bytes widened to float (bit arithmetic, 16 or 8 at a time) */
static inline void widen_e4m3(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if TF_AVX512
    const __m512i low7 = _mm512_set1_epi32(0x7f), rebias = _mm512_set1_epi32(120 << 23), eight = _mm512_set1_epi32(8);
    const __m512 sub_step = _mm512_set1_ps(1.0f / 512.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m512i mag = _mm512_and_si512(b, low7);
        const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), rebias));
        const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), sub_step);
        const __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, eight), normal, subnormal);
        const __m512i sign = _mm512_slli_epi32(_mm512_andnot_si512(low7, b), 24); /* bit 7 -> bit 31 */
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign)));
    }
#elif TF_AVX2
    const __m256i low7 = _mm256_set1_epi32(0x7f), rebias = _mm256_set1_epi32(120 << 23), eight = _mm256_set1_epi32(8);
    const __m256 sub_step = _mm256_set1_ps(1.0f / 512.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
        const __m256i mag = _mm256_and_si256(b, low7);
        const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), rebias));
        const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), sub_step);
        const __m256 v = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(eight, mag)));
        const __m256i sign = _mm256_slli_epi32(_mm256_andnot_si256(low7, b), 24); /* bit 7 -> bit 31 */
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign)));
    }
#endif
    for (; i < n; i++) dst[i] = e4m3_to_float(src[i]);
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
