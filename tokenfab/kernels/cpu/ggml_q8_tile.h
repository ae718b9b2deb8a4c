/* The many-row path of the int8-activation matmul (ggml_q8.c): prefill and batched decode.
 *
 * A thread takes Q8T_NR (32) weight rows at a time and lays their blocks out once (the panel) as
 * vpdpbusd reads them: for block b and k-step kk (0..7), two 64-byte vectors whose 32-bit lane n
 * holds weights 4kk .. 4kk + 3 of weight row n (rows 0-15, then 16-31), as unsigned bytes (Q4:
 * the bare nibbles; Q8_0: q + 128), then the block's 32 scales d_w (and Q4_1's m_w) as floats.
 * Each register tile of Q8T_MR activation rows x 32 weight rows then runs per block 8 k-steps of
 * vpdpbusd with the activation's 4 bytes broadcast from memory (int32 sums, no horizontal adds),
 * takes away the offset's share (Q4_0: 8 * sum(q_x), Q8_0: 128 * sum(q_x): exact integers), and
 * adds the block's float32 term into the row's accumulator -- the same steps, in the same order,
 * as every other path of the mode (ggml_q8.c, top): a row's result does not depend on M or on
 * which path ran it.
 *
 * The nibble unpacking is done once per panel (every activation tile reuses it); the panel of 32
 * rows of K = 1536 (48 blocks x 1280 bytes) stays in L2. AVX-512 with AVX512-VNNI only; other
 * builds run the row path for every M (the same bits).
 */
#ifndef TOKENFAB_GGML_Q8_TILE_H
#define TOKENFAB_GGML_Q8_TILE_H
#include "ggml_common.h"

#if GG_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define Q8T_BUILT 1
#define Q8T_NR 32                  /* weight rows of a panel: two 16-lane vectors */
#ifndef Q8T_MR
#define Q8T_MR 4 /* activation rows of a register tile (<= 8) */
#endif
#define Q8T_WB 1024                /* weight bytes of one block in the panel: 8 k-steps x 2 x 64 */
#define Q8T_PB (Q8T_WB + 2 * 128) /* + 32 float d_w, 32 float m_w */
#define Q8T_EXACT __attribute__((optimize("no-fast-math", "fp-contract=off")))

/* 16 rows of 16 bytes (row r at rows[r]) -> 4 vectors; out[k] lane r = bytes 4k .. 4k + 3 of row r */
AI void q8t_transpose16x4(const uint8_t *const rows[16], __m512i out[4]) {
    __m512i a[4];
    for (int g = 0; g < 4; g++) { /* 128-bit lane L of a[g]: row 4L + g */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)rows[g]));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)rows[4 + g]), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)rows[8 + g]), 2);
        a[g] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)rows[12 + g]), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* weight rows n0 .. n0 + nt - 1 (nt <= 32) -> the panel (rows past nt: zero weights and scales) */
static void q8t_pack(int qt, const uint8_t *w, int64_t rb, int64_t n0, int nt, int64_t nb, uint8_t *panel) {
    static const uint8_t zeros[64] = {0};
    const int64_t bb = BLOCK_BYTES[qt];
    const int off = qt == GQ4_1 ? 4 : 2;
    const __m512i m4 = _mm512_set1_epi8(15), bias = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *pb = panel + b * Q8T_PB;
        float *dw = (float *)(pb + Q8T_WB), *mw = dw + Q8T_NR;
        for (int h = 0; h < 2; h++) {
            const uint8_t *rows[16];
            for (int r = 0; r < 16; r++) {
                const int n = 16 * h + r;
                rows[r] = n < nt ? w + (n0 + n) * rb + b * bb + off : zeros;
            }
            __m512i v[4];
            q8t_transpose16x4(rows, v);
            if (qt == GQ8_0) {
                for (int k = 0; k < 4; k++) _mm512_storeu_si512(pb + k * 128 + h * 64, _mm512_xor_si512(v[k], bias));
                for (int r = 0; r < 16; r++) rows[r] += 16;
                q8t_transpose16x4(rows, v);
                for (int k = 0; k < 4; k++)
                    _mm512_storeu_si512(pb + (k + 4) * 128 + h * 64, _mm512_xor_si512(v[k], bias));
            } else {
                for (int k = 0; k < 4; k++) {
                    _mm512_storeu_si512(pb + k * 128 + h * 64, _mm512_and_si512(v[k], m4));
                    _mm512_storeu_si512(pb + (k + 4) * 128 + h * 64, _mm512_and_si512(_mm512_srli_epi16(v[k], 4), m4));
                }
            }
        }
        for (int n = 0; n < Q8T_NR; n++) {
            const uint8_t *blk = w + (n0 + n) * rb + b * bb;
            dw[n] = n < nt ? half_to_float(blk) : 0.0f;
            mw[n] = n < nt && qt == GQ4_1 ? half_to_float(blk + 2) : 0.0f;
        }
    }
}

/* out rows [0, MT) x columns [0, nt) against a panel; q, d, xs (q8t_block_extras) start at the
 * tile's first row */
Q8T_EXACT AI void q8t_tile(int qt, const int MT, const uint8_t *panel, int64_t nb, const int8_t *q, int64_t K,
                           const float *d, const int32_t *xs, float *out, int64_t N, int nt) {
    __m512 acc[Q8T_MR][2];
    for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pb = panel + b * Q8T_PB;
        __m512i ia[Q8T_MR][2];
        for (int m = 0; m < MT; m++) ia[m][0] = ia[m][1] = _mm512_setzero_si512();
        for (int kk = 0; kk < 8; kk++) {
            const __m512i w0 = _mm512_loadu_si512(pb + kk * 128), w1 = _mm512_loadu_si512(pb + kk * 128 + 64);
            for (int m = 0; m < MT; m++) {
                int32_t x4;
                memcpy(&x4, q + m * K + b * 32 + 4 * kk, 4);
                const __m512i xb = _mm512_set1_epi32(x4);
                ia[m][0] = _mm512_dpbusd_epi32(ia[m][0], w0, xb);
                ia[m][1] = _mm512_dpbusd_epi32(ia[m][1], w1, xb);
            }
        }
        const float *dwp = (const float *)(pb + Q8T_WB);
        const __m512 dw0 = _mm512_loadu_ps(dwp), dw1 = _mm512_loadu_ps(dwp + 16);
        for (int m = 0; m < MT; m++) {
            const __m512 dx = _mm512_set1_ps(d[m * nb + b]);
            __m512i i0 = ia[m][0], i1 = ia[m][1];
            if (qt != GQ4_1) { /* the offset's share: exact integers */
                const __m512i c = _mm512_set1_epi32(xs[m * nb + b]);
                i0 = _mm512_sub_epi32(i0, c);
                i1 = _mm512_sub_epi32(i1, c);
            }
            __m512 t0 = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(dw0, dx));
            __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(dw1, dx));
            if (qt == GQ4_1) {
                float mdxs;
                memcpy(&mdxs, xs + m * nb + b, 4);
                const __m512 mdx = _mm512_set1_ps(mdxs);
                t0 = _mm512_add_ps(t0, _mm512_mul_ps(_mm512_loadu_ps(dwp + 32), mdx));
                t1 = _mm512_add_ps(t1, _mm512_mul_ps(_mm512_loadu_ps(dwp + 48), mdx));
            }
            acc[m][0] = _mm512_add_ps(acc[m][0], t0);
            acc[m][1] = _mm512_add_ps(acc[m][1], t1);
        }
    }
    const __mmask16 k0 = nt >= 16 ? 0xffff : (__mmask16)((1u << nt) - 1);
    const __mmask16 k1 = nt >= 32 ? 0xffff : (nt <= 16 ? 0 : (__mmask16)((1u << (nt - 16)) - 1));
    for (int m = 0; m < MT; m++) {
        _mm512_mask_storeu_ps(out + m * N, k0, acc[m][0]);
        _mm512_mask_storeu_ps(out + m * N + 16, k1, acc[m][1]);
    }
}

/* every activation row against one panel, in tiles of Q8T_MR rows */
Q8T_EXACT __attribute__((noinline)) static void q8t_rows(int qt, const uint8_t *panel, int64_t nb, int64_t M,
                                                         const int8_t *q, int64_t K, const float *d,
                                                         const int32_t *xs, float *out, int64_t N, int nt) {
    int64_t m0 = 0;
    for (; m0 + Q8T_MR <= M; m0 += Q8T_MR)
        q8t_tile(qt, Q8T_MR, panel, nb, q + m0 * K, K, d + m0 * nb, xs + m0 * nb, out + m0 * N, N, nt);
#define Q8T_TAIL(R) \
    case R: q8t_tile(qt, R, panel, nb, q + m0 * K, K, d + m0 * nb, xs + m0 * nb, out + m0 * N, N, nt); break;
    switch (M - m0) { /* the last M % Q8T_MR rows */
        Q8T_TAIL(1)
        Q8T_TAIL(2)
        Q8T_TAIL(3)
#if Q8T_MR > 4
        Q8T_TAIL(4)
        Q8T_TAIL(5)
#endif
#if Q8T_MR > 6
        Q8T_TAIL(6)
        Q8T_TAIL(7)
#endif
    default: break;
    }
#undef Q8T_TAIL
}

/* per activation block, what the tiles add besides the dot: Q4_1 d_x * sum(q_x) as a float (one
 * rounding, as every path), else the weights' offset times sum(q_x) (Q4_0 8, Q8_0 128), in place */
Q8T_EXACT static void q8t_block_extras(int qt, const float *d, int32_t *sq, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (qt == GQ4_1) {
            const float mdx = d[i] * (float)sq[i];
            memcpy(sq + i, &mdx, 4);
        } else {
            sq[i] *= qt == GQ4_0 ? 8 : 128;
        }
    }
}

/* out [M, N] from quantized activations (q, d, sq: ggml_quantize_rows_q8; sq is overwritten) and
 * packed weights w */
static int q8t_matmul(int qt, const uint8_t *w, int64_t rb, int64_t M, int64_t N, int64_t K, const int8_t *q,
                      const float *d, int32_t *sq, float *out) {
    const int64_t nb = K / 32, chunks = (N + Q8T_NR - 1) / Q8T_NR;
    int rc = TF_OK;
    q8t_block_extras(qt, d, sq, M * nb);
#pragma omp parallel num_threads(tf_nthreads()) if (N * K * M >= PAR_MIN_WORK)
    {
        uint8_t *panel = aligned_alloc(64, (size_t)(nb * Q8T_PB));
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (!panel) {
#pragma omp atomic write
                rc = TF_ENOMEM;
                continue;
            }
            const int64_t n0 = c * Q8T_NR;
            const int nt = N - n0 < Q8T_NR ? (int)(N - n0) : Q8T_NR;
            q8t_pack(qt, w, rb, n0, nt, nb, panel);
            q8t_rows(qt, panel, nb, M, q, K, d, sq, out + n0, N, nt);
        }
        free(panel);
    }
    return rc;
}
#else
#define Q8T_BUILT 0
#endif

#endif
