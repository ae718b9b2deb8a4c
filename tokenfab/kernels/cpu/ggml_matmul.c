/* Packed GGML matmul, float32 activations (W4A32 / W8A32), the dequantized-row lookup, and what the
 * build and the CPU support. Formats, modes and paths: ggml_common.h. */
#include "ggml_common.h"

#if GG_AVX2
#define MT_MAX 2 /* activation rows per tile: 2 x 4 accumulators + 4 weight vectors in 16 registers */
#else
#define MT_MAX 4 /* activation rows per tile (AVX-512: 4 x 2 accumulators) */
#endif

/* ---------- the vector layer of the f32 kernels ---------- */
/* (NV: vectors per 32-weight block) */

#if GG_AVX512
#define VW 16
#define NV (32 / VW)
typedef __m512 vf;
AI vf v_zero(void) { return _mm512_setzero_ps(); }
AI vf v_load(const float *p) { return _mm512_loadu_ps(p); }
AI void v_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
AI vf v_set1(float f) { return _mm512_set1_ps(f); }
AI vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
AI vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
AI float v_sum(vf v) { return _mm512_reduce_add_ps(v); }
#define PIN(x) __asm__("" : "+v"(x))
/* the 16 lanes summed as halves, in a fixed order (PIN: no reassociation) */
AI float v_sum_pinned(vf v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    PIN(h);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    PIN(q);
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    PIN(q);
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    PIN(q);
    return _mm_cvtss_f32(q);
}
/* one block -> 32 floats in w[0..1]; d, m: its scales as floats (row_scales; m: Q4_1 only) */
AI void deq_block(int qt, const uint8_t *b, float df, float mf, vf *w) {
    if (qt == GF32) { /* float32 weights: 32 of them, as they are */
        for (int v = 0; v < NV; v++) w[v] = v_load((const float *)b + v * VW);
        return;
    }
    const vf d = _mm512_set1_ps(df);
    if (qt == GQ8_0) {
        w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))));
        w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))));
        return;
    }
    /* the 16 values a nibble can stand for, then a lookup per element (vpermps reads the low
     * 4 bits of each index: the low nibble needs no mask). Same roundings as d * (q - 8) and
     * fma(d, q, m): the table holds exactly those values. */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = qt == GQ4_0 ? _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)))
                                     : _mm512_fmadd_ps(d, iota, _mm512_set1_ps(mf));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (qt == GQ4_1 ? 4 : 2))));
    w[0] = _mm512_permutexvar_ps(v, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}
/* the float16 words at offsets 0 (d) and 2 (Q4_1's m) of blocks [0, n) as floats, 16 blocks a
 * gather: the block loop then broadcasts its scales from memory (loads), where converting them
 * block by block took 4 of the ~12 shuffle-port operations of a block */
AI void row_scales(int qt, const uint8_t *wr, int64_t n, float *sd, float *sm) {
    const int bb = (int)BLOCK_BYTES[qt];
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(bb));
    int64_t b = 0;
    for (; b + 16 <= n; b += 16) {
        const __m512i g = _mm512_i32gather_epi32(idx, wr + b * bb, 1);
        _mm512_storeu_ps(sd + b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
        if (qt == GQ4_1) _mm512_storeu_ps(sm + b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))));
    }
    for (; b < n; b++) {
        sd[b] = half_to_float(wr + b * bb);
        if (qt == GQ4_1) sm[b] = half_to_float(wr + b * bb + 2);
    }
}
#elif GG_AVX2
#define VW 8
#define NV (32 / VW)
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
#define PIN(x) __asm__("" : "+x"(x))
AI float v_sum_pinned(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    PIN(s);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    PIN(s);
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    PIN(s);
    return _mm_cvtss_f32(s);
}
AI vf cvt8(__m128i bytes8, int sgn) { /* the low 8 bytes, widened to floats */
    return _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}
AI void deq_block(int qt, const uint8_t *b, float df, float mf, vf *w) {
    if (qt == GF32) { /* float32 weights: 32 of them, as they are */
        for (int v = 0; v < NV; v++) w[v] = v_load((const float *)b + v * VW);
        return;
    }
    const vf d = _mm256_set1_ps(df);
    if (qt == GQ8_0) {
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(d, cvt8(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)), 1));
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (qt == GQ4_1 ? 4 : 2)));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const vf m = qt == GQ4_1 ? _mm256_set1_ps(mf) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(d, cvt8(part[i], 0), m); /* Q4_0: d*q - 8d, exact */
}
#else
#define VW 1
#define NV (32 / VW)
typedef float vf;
AI vf v_zero(void) { return 0.0f; }
AI vf v_load(const float *p) { return *p; }
AI void v_store(float *p, vf v) { *p = v; }
AI vf v_set1(float f) { return f; }
AI vf v_fma(vf a, vf b, vf c) { return a * b + c; }
AI vf v_add(vf a, vf b) { return a + b; }
AI float v_sum(vf v) { return v; }
#if defined(__x86_64__)
#define PIN(x) __asm__("" : "+x"(x))
#else
#define PIN(x) __asm__("" : "+g"(x))
#endif
AI float v_sum_pinned(vf v) { return v; }
AI void deq_block(int qt, const uint8_t *b, float d, float mf, vf *w) {
    if (qt == GF32) { /* float32 weights: 32 of them, as they are */
        for (int v = 0; v < NV; v++) w[v] = v_load((const float *)b + v * VW);
        return;
    }
    if (qt == GQ8_0) {
        for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)b[2 + j];
        return;
    }
    const uint8_t *q = b + (qt == GQ4_1 ? 4 : 2);
    const float m = qt == GQ4_1 ? mf : 0.0f;
    const int off = qt == GQ4_0 ? 8 : 0;
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((q[j] & 15) - off) + m;
        w[j + 16] = d * (float)((q[j] >> 4) - off) + m;
    }
}
#endif

#if !GG_AVX512
/* the scales of blocks [0, n) of a row as floats (d; Q4_1's m) */
AI void row_scales(int qt, const uint8_t *wr, int64_t n, float *sd, float *sm) {
    for (int64_t b = 0; b < n; b++) {
        sd[b] = half_to_float(wr + b * BLOCK_BYTES[qt]);
        if (qt == GQ4_1) sm[b] = half_to_float(wr + b * BLOCK_BYTES[qt] + 2);
    }
}
#endif

/* ---------- f32 activations, few rows: stream each weight row once per tile ---------- */

/* A row's accumulators (a, and b when two sets) summed in one fixed order. Each partial sum passes
 * an empty asm (PIN), which the compiler must treat as an unknown change of the value, so
 * -ffast-math cannot reassociate the adds: it did, differently in each (qtype, tile rows) copy of
 * gemv_row, and a float32 row rounded differently in a tile of 2 rows than in a tile of 4. */
AI float row_total(const vf *a, const vf *b) {
    vf s = a[0];
    for (int v = 1; v < NV; v++) {
        s = v_add(s, a[v]);
        PIN(s);
    }
    if (b)
        for (int v = 0; v < NV; v++) {
            s = v_add(s, b[v]);
            PIN(s);
        }
    return v_sum_pinned(s);
}

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
    /* the blocks in chunks of SCALE_CHUNK (even: a pair never straddles two), their scales first */
    float sd[SCALE_CHUNK], sm[SCALE_CHUNK]; /* sm: Q4_1 only (read only for it) */
    int64_t b = 0;
    for (int64_t c0 = 0; c0 < nb; c0 += SCALE_CHUNK) {
        const int64_t c1 = c0 + SCALE_CHUNK < nb ? c0 + SCALE_CHUNK : nb;
        if (qt != GF32) row_scales(qt, wr + c0 * bb, c1 - c0, sd, sm);
        for (; b + U <= c1; b += U)
            for (int u = 0; u < U; u++) {
                vf w[NV];
                deq_block(qt, wr + (b + u) * bb, sd[b + u - c0], qt == GQ4_1 ? sm[b + u - c0] : 0.0f, w);
                for (int m = 0; m < mt; m++)
                    for (int v = 0; v < NV; v++)
                        acc[u * mt + m][v] = v_fma(w[v], v_load(x + m * K + (b + u) * 32 + v * VW), acc[u * mt + m][v]);
            }
        for (; b < c1; b++) { /* an odd last block */
            vf w[NV];
            deq_block(qt, wr + b * bb, sd[b - c0], qt == GQ4_1 ? sm[b - c0] : 0.0f, w);
            for (int m = 0; m < mt; m++)
                for (int v = 0; v < NV; v++) acc[m][v] = v_fma(w[v], v_load(x + m * K + b * 32 + v * VW), acc[m][v]);
        }
    }
    if (qt == GF32 && K % 32) { /* float32 rows of any K: the last columns as one zero-padded block */
        const int kt = (int)(K % 32);
        float wt[32] = {0}, xt[32] = {0};
        memcpy(wt, (const float *)wr + nb * 32, sizeof(float) * kt);
        vf w[NV];
        deq_block(GF32, (const uint8_t *)wt, 0.0f, 0.0f, w);
        for (int m = 0; m < mt; m++) {
            memcpy(xt, x + m * K + nb * 32, sizeof(float) * kt);
            for (int v = 0; v < NV; v++) acc[m][v] = v_fma(w[v], v_load(xt + v * VW), acc[m][v]);
        }
    }
    for (int m = 0; m < mt; m++) res[m * N] = row_total(acc[m], U == 2 ? acc[mt + m] : NULL);
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
    const int64_t rb = qt == GF32 ? K * 4 : K / 32 * BLOCK_BYTES[qt], chunks = (N + NC - 1) / NC;
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (N * K * M >= PAR_MIN_WORK)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n1 = (c + 1) * NC < N ? (c + 1) * NC : N;
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
            const int mt = M - m0 < MT_MAX ? (int)(M - m0) : MT_MAX;
            const float *xm = x + m0 * K;
            for (int64_t n = c * NC; n < n1; n++) {
                const uint8_t *wr = w + n * rb;
                float *res = out + m0 * N + n;
                if (M <= MT_MAX) prefetch_ahead(wr, rb, w + N * rb); /* one tile: the memory-bound case */
                if (qt == GQ8_0) {
                    GEMV_CASE(GQ8_0)
                } else if (qt == GQ4_0) {
                    GEMV_CASE(GQ4_0)
                } else if (qt == GQ4_1) {
                    GEMV_CASE(GQ4_1)
                } else {
                    GEMV_CASE(GF32)
                }
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
    if (M >= panel_min_rows && qt != GF32) return panel_f32(x, w, M, N, K, qt, out);
#endif
    gemv_f32(x, w, M, N, K, qt, out);
    return TF_OK;
}

/* x [M, K] float32 @ w [N, K] float32 .T -> out [M, N]: the tiles above with plain float32 weights.
 * Row m of out is computed in the same order whatever M is and wherever row m sits in its tile
 * (batch invariance: speculative verify rows equal decode rows bit for bit), where MKL's sgemm
 * picks other kernels for a few rows than for many. */
int matmul_f32_rowinv(const float *x, const float *w, int64_t M, int64_t N, int64_t K, float *out) {
    gemv_f32(x, (const uint8_t *)w, M, N, K, GF32, out);
    return TF_OK;
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
