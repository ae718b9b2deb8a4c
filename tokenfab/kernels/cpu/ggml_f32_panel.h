/* The f32-activation GGML kernel for many activation rows (prefill chunks, large decode batches), and
 * the row-invariant float32 product, included by ggml_matmul.c after ggml_f32_gemv.h.
 *
 * A thread dequantizes PNC weight rows at a time into a float panel (deq_block: the values the GEMV
 * tiles compute in registers), then register tiles of PM activation rows x PN weight rows run over the
 * panel: per VW-wide slice of K, PM + PN vector loads feed PM * PN FMAs (AVX-512: 4 x 6, 10 loads per
 * 24 FMAs; AVX2: 3 x 4). The activation rows run in passes that fit L2 (panel_pass_rows), each weight
 * chunk dequantized once a pass. Float32 weights (matmul_f32_rowinv) are their own panel.
 *
 * Same bits as the GEMV tiles: each output is one accumulator summed in THE ORDER (ggml_f32_vec.h),
 * so a row's result does not depend on the kernel its batch size picked (batch invariance, and the C
 * step's equality with the Python layers, hold across the crossover). Vector builds only: the
 * portable build has gemv_row alone. */

#if GG_AVX512
#define PM 4 /* 4 x 6 accumulators + 4 activation vectors + 1 weight vector in 32 registers */
#define PN 6
#elif GG_AVX2
#define PM 3 /* 3 x 4 accumulators + 3 + 1 in 16 registers */
#define PN 4
#endif

#if GG_AVX512 || GG_AVX2
#define PANEL 1
#define PNC (4 * PN) /* weight rows a thread dequantizes into its panel at a time */
/* activation rows from which ggml_matmul_f32 takes the panel kernel (the bits are the same either way) */
#define PANEL_MIN_ROWS 6

/* out[m * N + n] = dot(x row m, w row n) for m < mt, n < nt: x rows at stride ldx, w rows (floats) at
 * stride ldw, K any size (a last partial slice zero-padded). Rows n >= nt repeat row nt - 1 (read, not
 * stored). */
AI void mk_tile(int mt, int nt, const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t K, float *out,
                int64_t N) {
    const float *wr[PN], *xr[PM];
    for (int n = 0; n < PN; n++) wr[n] = w + (n < nt ? n : nt - 1) * ldw;
    for (int m = 0; m < mt; m++) xr[m] = x + m * ldx;
    vf acc[PM][PN];
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < PN; n++) acc[m][n] = v_zero();
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        vf xv[PM];
        for (int m = 0; m < mt; m++) xv[m] = v_load(xr[m] + k);
        for (int n = 0; n < PN; n++) {
            vf wv = v_load(wr[n] + k);
            PIN(wv); /* one load, in a register: else GCC folds it into each of the mt FMAs */
            for (int m = 0; m < mt; m++) acc[m][n] = v_fma(wv, xv[m], acc[m][n]);
        }
    }
    if (k < K) { /* float32 weights only: the last K % VW columns, zero-padded */
        const int kt = (int)(K - k);
        vf xv[PM];
        for (int m = 0; m < mt; m++) xv[m] = v_load_part(xr[m] + k, kt);
        for (int n = 0; n < PN; n++) {
            const vf wv = v_load_part(wr[n] + k, kt);
            for (int m = 0; m < mt; m++) acc[m][n] = v_fma(wv, xv[m], acc[m][n]);
        }
    }
#if GG_AVX512
    /* weight rows 0..3, then 4..5, sixteen sums a tree: lane 4m + j holds output (m, n0 + j) */
    for (int n0 = 0; n0 < PN; n0 += 4) {
        vf a[16];
        for (int j = 0; j < 4; j++)
            for (int m = 0; m < 4; m++) a[4 * j + m] = (m < mt && n0 + j < PN) ? acc[m][n0 + j] : v_zero();
        float t[16];
        _mm512_storeu_ps(t, tree16(a));
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < 4 && n0 + j < nt; j++) out[m * N + n0 + j] = t[4 * m + j];
    }
#else
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++) out[m * N + n] = v_sum_pinned(acc[m][n]);
#endif
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

#define MK_TILE(MT) mk_tile(MT, nt, pw + (n - n0) * K, K, xm, K, K, res, N)

/* Activation rows a pass of the panel kernel takes (a multiple of PM): their MB x K floats stay in L2
 * (PANEL_X_BYTES of it) while every weight chunk of the thread passes over them, where one pass over
 * all M rows of a prefill chunk (2048 x 576 floats: 4.7 MB) re-read x from L3 for every chunk of PNC
 * weight rows. A chunk is dequantized once a pass: at least 64 rows keep that a few percent. */
#ifndef PANEL_X_BYTES
#define PANEL_X_BYTES (256 * 1024)
#endif
static int64_t panel_pass_rows(int64_t K) {
    int64_t mb = PANEL_X_BYTES / (4 * K);
    mb = mb < 64 ? 64 : mb;
    return mb / PM * PM;
}

/* x [M, K] @ dequant(w).T, or x @ w.T for float32 weights (qt GF32, K any size); TF_ENOMEM without a panel */
static int panel_f32(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    const int64_t rb = qt == GF32 ? K * 4 : K / 32 * BLOCK_BYTES[qt], chunks = (N + PNC - 1) / PNC;
    const int64_t mb = panel_pass_rows(K);
    int failed = 0;
#pragma omp parallel num_threads(tf_nthreads()) if (N * K * M >= PAR_MIN_WORK)
    {
        float *panel = qt == GF32 ? NULL : malloc(sizeof(float) * (size_t)(PNC * K));
        if (qt != GF32 && !panel) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t p0 = 0; p0 < M; p0 += mb) {
            const int64_t p1 = p0 + mb < M ? p0 + mb : M;
#pragma omp for schedule(static)
            for (int64_t c = 0; c < chunks; c++) {
                if (qt != GF32 && !panel) continue;
                const int64_t n0 = c * PNC, n1 = n0 + PNC < N ? n0 + PNC : N;
                const float *pw = panel;
                if (qt == GF32) pw = (const float *)(w + n0 * rb);
                else if (qt == GQ8_0) fill_panel(GQ8_0, w, rb, n0, n1, K, panel);
                else if (qt == GQ4_0) fill_panel(GQ4_0, w, rb, n0, n1, K, panel);
                else fill_panel(GQ4_1, w, rb, n0, n1, K, panel);
                for (int64_t m0 = p0; m0 < p1; m0 += PM) {
                    const int mt = p1 - m0 < PM ? (int)(p1 - m0) : PM;
                    const float *xm = x + m0 * K;
                    for (int64_t n = n0; n < n1; n += PN) {
                        const int nt = n1 - n < PN ? (int)(n1 - n) : PN;
                        float *res = out + m0 * N + n;
                        if (mt == PM) MK_TILE(PM);
#if PM > 3
                        else if (mt == 3) MK_TILE(3);
#endif
                        else if (mt == 2) MK_TILE(2);
                        else MK_TILE(1);
                    }
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
