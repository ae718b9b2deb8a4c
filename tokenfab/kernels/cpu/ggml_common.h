/*
 * What ggml_matmul.c (float32 activations) and ggml_q8.c (int8 activations) share: matmuls against
 * packed GGML weights (GGUF's Q8_0, Q4_0, Q4_1 blocks, kept as the file stores them):
 * out[M, N] = x[M, K] @ dequant(w[N, K/32 blocks]).T.
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
 *     x @ dequant(w).T, and it is one order for every kernel and batch size (ggml_f32_vec.h). Few
 *     rows (decode): GEMV tiles dequantize each block in registers once per tile of MT_MAX
 *     activation rows x GR weight rows, so each weight byte is read once (ggml_f32_gemv.h). Many
 *     rows: a thread's weight rows are dequantized once into a float panel, then 4 x 6 register
 *     tiles (AVX-512) run over it (ggml_f32_panel.h). The switch is measured (crossover.py).
 *   q8 (ggml_matmul_q8, in ggml_q8.c): the activations are first quantized per 32-block to int8
 *     (d = amax / 127, q = round-to-nearest-even(x * (1 / d)), d kept in float32), then each block is an integer dot
 *     product (VNNI vpdpbusd, AVX2 vpmaddubsw, or plain C) scaled by d_w * d_x; Q4_1 adds
 *     m_w * d_x * sum(q_x). The block terms are added in float32 in block order, each step one
 *     rounding, so every path (row tiles, the many-row tiles of ggml_q8_tile.h, AMX) gives the
 *     torch reference's result (ggml_matmul.py) bit for bit (ggml_q8.c, top).
 *
 * Code paths, chosen at build time from the compiler's target (the library is built with
 * -march=native): AVX-512F (+ AVX512-VNNI/VL or AVX-VNNI for q8), AVX2 + FMA (+ F16C), and portable
 * C. The f32 kernels are written once over a small vector layer (vf, VW lanes) defined per ISA.
 * Work is split over weight rows with OpenMP (torch's threads: same libgomp). Functions that
 * allocate return TF_OK or TF_ENOMEM (common.h).
 */
#ifndef TOKENFAB_GGML_COMMON_H
#define TOKENFAB_GGML_COMMON_H
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

/* GF32: plain float32 weights through the same row-invariant tiles (matmul_f32_rowinv); its rows
 * are K floats, K any size (the last K % 32 columns are one zero-padded block) */
enum { GQ8_0 = 0, GQ4_0 = 1, GQ4_1 = 2, GF32 = 3 };
static const int64_t BLOCK_BYTES[4] = {34, 18, 20, 128};

#define AI static inline __attribute__((always_inline))
#define NC 16 /* weight rows a thread takes at a time: they stay in L1 while every row tile passes */
#define SCALE_CHUNK 256 /* blocks of a row whose scales ggml_matmul.c converts at a time (even) */
/* parallelize a product of at least this many multiply-adds: a 192 x 576 GEMV ran as fast on one
 * thread as on two, and skips the barrier (which stalls when the other core is busy) */
#define PAR_MIN_WORK 262144

/* x [M, K] -> int8 q [M, K], per 32-block scale d [M, K/32] and sum(q) sq [M, K/32] (ggml_q8.c):
 * the one activation quantizer of the q8 paths (VNNI and AMX) */
void ggml_quantize_rows_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int32_t *sq);

/* The quantized activations of one q8 product in one allocation (free(a.q) frees them): q holds
 * q_bytes >= M * K bytes, those past M * K zeroed (a path's paired copy, or AMX's whole tiles) */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *sq;
} q8_acts;
int q8_acts_quantize(const float *x, int64_t M, int64_t K, int64_t q_bytes, q8_acts *a); /* TF_OK / TF_ENOMEM */

/* ---------- software prefetch of the weight stream ---------- */

/* Decode reads each weight byte once, as one sequential stream per thread, and on a 2-core VM
 * measured 9.8 GB/s with the hardware prefetchers alone: a core's own demand misses cannot keep
 * enough lines in flight. With one tile of activation rows (decode), each weight row asks for the
 * bytes PF_BYTES ahead of it into L2: the bundled model's decode step took 25% less time at 2-8 KiB
 * ahead (2 threads); at 16 rows, compute-bound, it cost 25%, so more rows do not prefetch.
 * TOKENFAB_CPU_CFLAGS=-DPF_BYTES=0 turns it off. A prefetch changes no result. */
#ifndef PF_BYTES
#define PF_BYTES 4096
#endif
AI void prefetch_ahead(const uint8_t *row, int64_t row_bytes, const uint8_t *end) {
#if defined(__x86_64__) || defined(__i386__)
    if (PF_BYTES <= 0) return;
    const uint8_t *p = row + PF_BYTES;
    for (int64_t o = 0; o < row_bytes && p + o < end; o += 64) _mm_prefetch((const char *)(p + o), _MM_HINT_T1);
#else
    (void)row;
    (void)row_bytes;
    (void)end;
#endif
}

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

#endif
