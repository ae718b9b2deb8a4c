/* The f32-activation kernel for many activation rows (prefill chunks, large decode batches), included
 * by ggml_matmul.c after gemv_row (it uses its vector layer, deq_block, row_scales and row_total).
 *
 * gemv_row dequantizes each weight block once per tile of MT_MAX activation rows, and at 4 rows a
 * tile about half of its instructions are that dequantization. Here a thread dequantizes its NC
 * weight rows once into a float panel (deq_block: the same values), then register tiles of PM
 * activation rows x PN weight rows run FMAs over the panel and the activation rows, both in cache.
 *
 * Same bits as gemv_row: every (activation row, weight row) sum runs in gemv_row's order -- block b
 * into accumulator set b % U, vector v of the block into accumulator v, then row_total -- so a row's
 * result does not depend on which kernel its batch size picked (batch invariance, and the C step's
 * equality with the Python layers, hold across PANEL_MIN_ROWS). Only the vector builds use it: the
 * portable build's scalar loops are left to the compiler, whose -ffast-math vectorization could
 * order the two kernels' sums differently. */

#if GG_AVX512
#define PM 3 /* 2 sets x 2 vectors x 3 x 2 = 24 accumulators + 5 operands in 32 registers */
#define PN 2
#define PU 2
#elif GG_AVX2
#define PM 3 /* 4 vectors x 3 x 1 = 12 accumulators + 4 operands in 16 registers */
#define PN 1
#define PU 1
#endif

#if GG_AVX512 || GG_AVX2
#define PANEL 1
/* activation rows from which ggml_matmul_f32 takes the panel kernel (the bits are the same either way) */
#define PANEL_MIN_ROWS 6

/* out[m * N + n] for the mt x nt tile: activation rows x (row stride K), weight rows panel (stride K) */
AI void panel_tile(int mt, int nt, const float *panel, const float *x, int64_t K, float *out, int64_t N) {
    const int64_t nb = K / 32;
    vf acc[PU][NV][PM][PN];
    for (int u = 0; u < PU; u++)
        for (int v = 0; v < NV; v++)
            for (int m = 0; m < mt; m++)
                for (int n = 0; n < nt; n++) acc[u][v][m][n] = v_zero();
    /* blocks b, b + 1 into sets 0, 1 (compile-time indices: the accumulators stay in registers) */
    int64_t b = 0;
    for (; b + PU <= nb; b += PU)
        for (int u = 0; u < PU; u++)
            for (int v = 0; v < NV; v++) {
                vf wv[PN], xv[PM];
                const int64_t off = (b + u) * 32 + v * VW;
                for (int n = 0; n < nt; n++) wv[n] = v_load(panel + n * K + off);
                for (int m = 0; m < mt; m++) xv[m] = v_load(x + m * K + off);
                for (int m = 0; m < mt; m++)
                    for (int n = 0; n < nt; n++) acc[u][v][m][n] = v_fma(wv[n], xv[m], acc[u][v][m][n]);
            }
    for (; b < nb; b++) /* an odd last block: set 0, as in gemv_row */
        for (int v = 0; v < NV; v++) {
            vf wv[PN], xv[PM];
            const int64_t off = b * 32 + v * VW;
            for (int n = 0; n < nt; n++) wv[n] = v_load(panel + n * K + off);
            for (int m = 0; m < mt; m++) xv[m] = v_load(x + m * K + off);
            for (int m = 0; m < mt; m++)
                for (int n = 0; n < nt; n++) acc[0][v][m][n] = v_fma(wv[n], xv[m], acc[0][v][m][n]);
        }
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++) {
            vf a[NV], c[NV];
            for (int v = 0; v < NV; v++) {
                a[v] = acc[0][v][m][n];
                c[v] = acc[PU - 1][v][m][n];
            }
            out[m * N + n] = row_total(a, PU == 2 ? c : NULL);
        }
}

/* rows [n0, n1) of the packed weight, dequantized into panel [n1 - n0, K] */
AI void fill_panel(int qt, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t K, float *panel) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt];
    float sd[SCALE_CHUNK], sm[SCALE_CHUNK];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * rb;
        float *dst = panel + (n - n0) * K;
        for (int64_t c0 = 0; c0 < nb; c0 += SCALE_CHUNK) {
            const int64_t c1 = c0 + SCALE_CHUNK < nb ? c0 + SCALE_CHUNK : nb;
            row_scales(qt, wr + c0 * bb, c1 - c0, sd, sm);
            for (int64_t b = c0; b < c1; b++) {
                vf v[NV];
                deq_block(qt, wr + b * bb, sd[b - c0], qt == GQ4_1 ? sm[b - c0] : 0.0f, v);
                for (int i = 0; i < NV; i++) v_store(dst + b * 32 + i * VW, v[i]);
            }
        }
    }
}

#define PANEL_TILE(MT)                                                                       \
    do {                                                                                     \
        if (nt == PN) panel_tile(MT, PN, pn, xm, K, res, N);                                \
        else panel_tile(MT, 1, pn, xm, K, res, N);                                          \
    } while (0)

/* x [M, K] @ dequant(w).T for quantized weights (K a multiple of 32); TF_ENOMEM without a panel */
static int panel_f32(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    const int64_t rb = K / 32 * BLOCK_BYTES[qt], chunks = (N + NC - 1) / NC;
    int failed = 0;
#pragma omp parallel num_threads(tf_nthreads()) if (N * K * M >= PAR_MIN_WORK)
    {
        float *panel = malloc(sizeof(float) * (size_t)(NC * K));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (!panel) continue;
            const int64_t n0 = c * NC, n1 = n0 + NC < N ? n0 + NC : N;
            if (qt == GQ8_0) fill_panel(GQ8_0, w, rb, n0, n1, K, panel);
            else if (qt == GQ4_0) fill_panel(GQ4_0, w, rb, n0, n1, K, panel);
            else fill_panel(GQ4_1, w, rb, n0, n1, K, panel);
            for (int64_t m0 = 0; m0 < M; m0 += PM) {
                const int mt = M - m0 < PM ? (int)(M - m0) : PM;
                const float *xm = x + m0 * K;
                for (int64_t n = n0; n < n1; n += PN) {
                    const int nt = n1 - n < PN ? (int)(n1 - n) : PN;
                    const float *pn = panel + (n - n0) * K;
                    float *res = out + m0 * N + n;
                    if (mt == PM) PANEL_TILE(PM);
                    else if (mt == 2) PANEL_TILE(2);
                    else PANEL_TILE(1);
                }
            }
        }
        free(panel);
    }
    return failed ? TF_ENOMEM : TF_OK;
}
#else
#define PANEL 0
#endif
