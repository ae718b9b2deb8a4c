/* The f32-activation GGML kernel for few activation rows (decode), included by ggml_matmul.c: each
 * weight block is dequantized in registers (deq_block) once per tile of activation rows, so at one
 * tile each weight byte is read once, as one stream per weight row.
 *
 * Vector builds: a tile is GR weight rows x up to MT_MAX activation rows, one accumulator per output
 * in THE ORDER of ggml_f32_vec.h (the panel kernel's, so a row's bits do not depend on which kernel
 * its batch size picked). One chain per output has the FMA's latency between its steps; the GR
 * weight rows (and the tile's activation rows) are the independent chains that hide it.
 * Portable build: gemv_row, one weight row at a time, 32 scalar lanes per output (the compiler
 * vectorizes across the lanes, never along a lane's chain), summed 0..31 in order. */

#if GG_AVX512
#define MT_MAX 4 /* activation rows per tile: 4 x 4 accumulators + 2 weight vectors + activations */
#define GR 4     /* weight rows per tile */
#define GR1 8    /* weight rows per tile of one activation row (decode at batch 1) */
#elif GG_AVX2
#define MT_MAX 2 /* 2 x 2 accumulators + 4 weight vectors + activations in 16 registers */
#define GR 2
#define GR1 4
#else
#define MT_MAX 4 /* activation rows per tile (portable: 4 x 32 scalar lanes) */
#endif
#define GEMV_SCALES 64 /* blocks of a row whose scales a GEMV tile converts at a time */

#if GG_AVX512 || GG_AVX2
/* res[m * N + r] = dot(x row m, dequant(weight row r)) for r < rt, m < mt (weight row r at w + r * rb),
 * over gr weight rows (GR; GR1 at one activation row, where the weight rows alone keep the FMA and
 * shuffle ports busy: 8 rows took 17% less time a block than 4 on AMD Zen 4). Rows r >= rt repeat
 * row rt - 1 (read, not stored): the tile's shape never changes with rt. */
AI void gemv_tile(int qt, int mt, int gr, const uint8_t *w, int64_t rb, int rt, const float *x, int64_t K,
                  float *res, int64_t N, int prefetch, const uint8_t *w_end) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt];
    const uint8_t *wr[GR1];
    for (int r = 0; r < gr; r++) {
        wr[r] = w + (r < rt ? r : rt - 1) * rb;
        if (prefetch && r < rt) prefetch_ahead(wr[r], rb, w_end);
    }
    vf acc[GR1][MT_MAX];
    for (int r = 0; r < gr; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = v_zero();
    float sd[GR1][GEMV_SCALES], sm[GR1][GEMV_SCALES]; /* sm: Q4_1 only */
    for (int64_t c0 = 0; c0 < nb; c0 += GEMV_SCALES) {
        const int64_t c1 = c0 + GEMV_SCALES < nb ? c0 + GEMV_SCALES : nb;
        for (int r = 0; r < gr; r++) row_scales(qt, wr[r] + c0 * bb, c1 - c0, sd[r], sm[r]);
        for (int64_t b = c0; b < c1; b++) {
#if GG_AVX512 /* the block's activations in registers, loaded once for the GR rows (PIN: else GCC
               * folds a load into every FMA); AVX2's 16 registers cannot hold them */
            vf xv[MT_MAX][NV];
            for (int m = 0; m < mt; m++)
                for (int v = 0; v < NV; v++) {
                    xv[m][v] = v_load(x + m * K + b * 32 + v * VW);
                    PIN(xv[m][v]);
                }
#define XV(m, v) xv[m][v]
#else
#define XV(m, v) v_load(x + (m) * K + b * 32 + (v) * VW)
#endif
            for (int r = 0; r < gr; r++) {
                vf wv[NV];
                deq_block(qt, wr[r] + b * bb, sd[r][b - c0], qt == GQ4_1 ? sm[r][b - c0] : 0.0f, wv);
                for (int v = 0; v < NV; v++) /* slice b * NV + v of K: one chain per output */
                    for (int m = 0; m < mt; m++) acc[r][m] = v_fma(wv[v], XV(m, v), acc[r][m]);
            }
#undef XV
        }
    }
#if GG_AVX512
    if (mt >= 2) { /* the GR x mt sums by the tree: lane 4m + r holds output (m, r) */
        vf a[16];
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < 4; m++) a[4 * r + m] = m < mt ? acc[r][m] : v_zero();
        float t[16];
        _mm512_storeu_ps(t, tree16(a));
        for (int m = 0; m < mt; m++)
            for (int r = 0; r < rt; r++) res[m * N + r] = t[4 * m + r];
        return;
    }
#endif
    for (int m = 0; m < mt; m++)
        for (int r = 0; r < rt; r++) res[m * N + r] = v_sum_pinned(acc[r][m]);
}
#else
/* res[m * N] = dot(x row m, dequant(weight row)) for the mt rows of one tile (portable C) */
AI void gemv_row(int qt, int mt, const uint8_t *wr, const float *x, int64_t K, float *res, int64_t N) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt];
    vf acc[MT_MAX][NV];
    for (int m = 0; m < mt; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = v_zero();
    float sd[SCALE_CHUNK], sm[SCALE_CHUNK]; /* sm: Q4_1 only (read only for it) */
    for (int64_t c0 = 0; c0 < nb; c0 += SCALE_CHUNK) {
        const int64_t c1 = c0 + SCALE_CHUNK < nb ? c0 + SCALE_CHUNK : nb;
        if (qt != GF32) row_scales(qt, wr + c0 * bb, c1 - c0, sd, sm);
        for (int64_t b = c0; b < c1; b++) {
            vf wv[NV];
            deq_block(qt, wr + b * bb, sd[b - c0], qt == GQ4_1 ? sm[b - c0] : 0.0f, wv);
            for (int m = 0; m < mt; m++)
                for (int v = 0; v < NV; v++) acc[m][v] = v_fma(wv[v], v_load(x + m * K + b * 32 + v), acc[m][v]);
        }
    }
    if (qt == GF32 && K % 32) { /* float32 rows of any K: the last columns as one zero-padded block */
        const int kt = (int)(K % 32);
        float wt[32] = {0}, xt[32] = {0};
        memcpy(wt, (const float *)wr + nb * 32, sizeof(float) * kt);
        for (int m = 0; m < mt; m++) {
            memcpy(xt, x + m * K + nb * 32, sizeof(float) * kt);
            for (int v = 0; v < NV; v++) acc[m][v] = v_fma(wt[v], xt[v], acc[m][v]);
        }
    }
    for (int m = 0; m < mt; m++) { /* the 32 lanes in order; PIN: -ffast-math may not reassociate */
        vf s = acc[m][0];
        for (int v = 1; v < NV; v++) {
            s = v_add(s, acc[m][v]);
            PIN(s);
        }
        res[m * N] = s;
    }
}
#endif
