/* Packed GGML matmul, float32 activations (W4A32 / W8A32), the dequantized-row lookup, and what the
 * build and the CPU support. Formats, modes and paths: ggml_common.h. */
#include "ggml_common.h"

#include "ggml_f32_vec.h"
#include "ggml_f32_gemv.h"

/* ---------- f32 activations, few rows: stream each weight row once per tile ---------- */

#if GG_AVX512 || GG_AVX2
/* the (qtype, tile rows) pairs as constants, so each inlined copy keeps its accumulators in registers */
#define GEMV_CASE(QT)                                                                 \
    switch (mt) {                                                                     \
    case 1: gemv_tile(QT, 1, GR1, wr, rb, rt, xm, K, res, N, pf, w_end); break;       \
    GEMV_MT23(QT)                                                                     \
    default: gemv_tile(QT, MT_MAX, GR, wr, rb, rt, xm, K, res, N, pf, w_end); break;  \
    }
#if MT_MAX > 2
#define GEMV_MT23(QT)                                                                 \
    case 2: gemv_tile(QT, 2, GR, wr, rb, rt, xm, K, res, N, pf, w_end); break;        \
    case 3: gemv_tile(QT, 3, GR, wr, rb, rt, xm, K, res, N, pf, w_end); break;
#else
#define GEMV_MT23(QT)
#endif
#define GEMV_STEP(mt) ((mt) == 1 ? GR1 : GR)
#else
#define GEMV_CASE(QT)                                                                 \
    switch (mt) {                                                                     \
    case 1: gemv_row(QT, 1, wr, xm, K, res, N); break;                                \
    case 2: gemv_row(QT, 2, wr, xm, K, res, N); break;                                \
    case 3: gemv_row(QT, 3, wr, xm, K, res, N); break;                                \
    default: gemv_row(QT, 4, wr, xm, K, res, N); break;                               \
    }
#define GEMV_STEP(mt) 1
#endif

static void gemv_f32(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    const int64_t rb = qt == GF32 ? K * 4 : K / 32 * BLOCK_BYTES[qt], chunks = (N + NC - 1) / NC;
    const uint8_t *w_end = w + N * rb;
    const int pf = M <= MT_MAX; /* one tile: the memory-bound case, prefetch the weight stream */
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n1 = (c + 1) * NC < N ? (c + 1) * NC : N;
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
            const int mt = M - m0 < MT_MAX ? (int)(M - m0) : MT_MAX;
            const float *xm = x + m0 * K;
            const int step = GEMV_STEP(mt);
            for (int64_t n = c * NC; n < n1; n += step) {
                const int rt = n1 - n < step ? (int)(n1 - n) : step;
                const uint8_t *wr = w + n * rb;
                float *res = out + m0 * N + n;
#if !(GG_AVX512 || GG_AVX2)
                (void)rt;
                if (pf) prefetch_ahead(wr, rb, w_end);
#endif
                if (qt == GQ8_0) {
                    GEMV_CASE(GQ8_0)
                } else if (qt == GQ4_0) {
                    GEMV_CASE(GQ4_0)
                } else if (qt == GQ4_1) {
                    GEMV_CASE(GQ4_1)
                }
#if !(GG_AVX512 || GG_AVX2)
                else {
                    GEMV_CASE(GF32)
                }
#endif
            }
        }
    }
}

#include "ggml_f32_panel.h"

#if PANEL
static int panel_min_rows = PANEL_MIN_ROWS; /* kernels/cpu/crossover.py sets it from a measurement */
#endif
/* the activation rows from which the panel kernel runs (0: this build has none) */
void ggml_set_panel_min_rows(int n) {
#if PANEL
    panel_min_rows = n > 0 ? n : 1;
#else
    (void)n;
#endif
}
int ggml_panel_min_rows(void) {
#if PANEL
    return panel_min_rows;
#else
    return 0;
#endif
}

/* x [M, K] float32 (contiguous) @ dequant(w [N, K/32 blocks]).T -> out [M, N] float32: the panel
 * kernel for many rows, the row tiles for few (the same bits) */
int ggml_matmul_f32(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
#if PANEL
    if (M >= panel_min_rows || qt == GF32) return panel_f32(x, w, M, N, K, qt, out);
#endif
    gemv_f32(x, w, M, N, K, qt, out);
    return TF_OK;
}

/* x [M, K] float32 @ w [N, K] float32 .T -> out [M, N]: the tiles above with plain float32 weights.
 * Row m of out is computed in the same order whatever M is and wherever row m sits in its tile
 * (batch invariance: speculative verify rows equal decode rows bit for bit), where MKL's sgemm
 * picks other kernels for a few rows than for many. */
int matmul_f32_rowinv(const float *x, const float *w, int64_t M, int64_t N, int64_t K, float *out) {
#if PANEL
    return panel_f32(x, (const uint8_t *)w, M, N, K, GF32, out); /* one kernel for every M */
#else
    gemv_f32(x, (const uint8_t *)w, M, N, K, GF32, out);
    return TF_OK;
#endif
}

/* ---------- embedding rows ---------- */

/* out [R, K] = dequant(w rows rows[0..R)) (rows already checked to be in range) */
void ggml_dequant_rows(const uint8_t *w, int64_t K, int qt, const int64_t *rows, int64_t R, float *out) {
    const int64_t nb = K / 32, rb = nb * BLOCK_BYTES[qt];
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (R * K >= PAR_MIN_WORK)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *wr = w + rows[r] * rb;
        for (int64_t b = 0; b < nb; b++) {
            vf v[NV];
            const uint8_t *blk = wr + b * BLOCK_BYTES[qt];
            deq_block(qt, blk, half_to_float(blk), qt == GQ4_1 ? half_to_float(blk + 2) : 0.0f, v);
            for (int i = 0; i < NV; i++) v_store(out + r * K + b * 32 + i * VW, v[i]);
        }
    }
}

/* ---------- what was built ---------- */

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

/* (the AMX probe and kernel: ggml_amx.c) */
