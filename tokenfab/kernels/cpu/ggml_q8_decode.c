/* The int8-activation product at decode sizes (a few activation rows) over weights laid out once,
 * at load, for it: 16 weight rows interleaved per 32-element block ("row16" layout).
 *
 * Why: at one activation row the product is a stream of weight bytes, and the row path of ggml_q8.c
 * (GGML's own row-major blocks) spends ~5 cycles a block on gathering each row's scales, pairing
 * the blocks for the dot product and transposing the terms into row order. In the row16 layout one
 * 512-bit load holds 4 bytes of each of 16 rows, so VNNI's vpdpbusd leaves each row's dot product
 * in its own lane (no horizontal sums), and the 16 rows' float16 scales are one 32-byte load.
 *
 * The arithmetic is ggml_q8.c's, term for term (see the top of that file): per output and block,
 *   t = (float)dot * (d_w * d_x); Q4_1: t = t + m_w * (d_x * (float)sum(q_x)); acc = acc + t,
 * in block order, no FMA contraction: the same bits as the row path, the tiles, AMX and the
 * torch reference. The integer dot is exact; the layout stores Q4 nibbles unsigned (Q4_0's w + 8)
 * and Q8_0 bytes as w + 128, so dot = sum(u * q_x) - offset * sum(q_x).
 *
 * Layout of a weight [N, K] (nb = K / 32 blocks a row) in row16: panels of 16 rows (the last one
 * zero-padded), each nb block records of, in order:
 *   d_w[16] float16, (Q4_1) m_w[16] float16, then the bytes: k-step j of a record is 64 bytes, lane r
 *   (4 bytes) of row r: Q4: bytes 4j .. 4j + 3 of the row's 16 nibble bytes (j < 4: low nibbles are
 *   elements 4j .. 4j + 3, high nibbles 16 + 4j ..); Q8_0: elements 4j .. 4j + 3 (j < 8), xor 0x80.
 * A record is as long as 16 GGML blocks (Q8_0 34, Q4_0 18, Q4_1 20 bytes each): the layout costs no
 * bytes beyond the padding of a last partial panel.
 *
 * Paths: AVX-512 with AVX512-VNNI and BW (16 rows a vector); AVX2 + F16C (8 rows a vector, two per
 * panel), with AVX-VNNI's vpdpbusd where present, else vpmaddubsw (Q8_0 then multiplies |w| by
 * sign(w) * q_x, as the 128-offset form would saturate it). A build without either (no AVX2) has no
 * row16 kernel: ggml_q8_row16_built() says so, and the layer keeps GGML's layout and the row path.
 */
#include "ggml_common.h"

#define R16 16
#define Q8D_EXACT __attribute__((optimize("no-fast-math", "fp-contract=off")))

/* bytes of one 16-row block record */
static int64_t record_bytes(int qt) { return 16 * BLOCK_BYTES[qt]; }

int64_t ggml_q8_row16_bytes(int64_t N, int64_t K, int qt) {
    return (N + R16 - 1) / R16 * (K / 32) * record_bytes(qt);
}

/* w [N, K] in GGML rows -> out (ggml_q8_row16_bytes) in the row16 layout */
void ggml_q8_row16_pack(const uint8_t *w, int64_t N, int64_t K, int qt, uint8_t *out) {
    const int64_t nb = K / 32, bb = BLOCK_BYTES[qt], rec = record_bytes(qt), panels = (N + R16 - 1) / R16;
    const int q4 = qt != GQ8_0, scales = qt == GQ4_1 ? 2 : 1;
    memset(out, 0, (size_t)ggml_q8_row16_bytes(N, K, qt));
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *r = out + (p * nb + b) * rec;
            uint8_t *bytes = r + scales * 32;
            for (int64_t i = 0; i < R16 && p * R16 + i < N; i++) {
                const uint8_t *blk = w + (p * R16 + i) * nb * bb + b * bb;
                memcpy(r + 2 * i, blk, 2);                    /* d */
                if (qt == GQ4_1) memcpy(r + 32 + 2 * i, blk + 2, 2); /* m */
                const uint8_t *qs = blk + (qt == GQ4_1 ? 4 : 2);
                for (int j = 0; j < (q4 ? 4 : 8); j++)
                    for (int e = 0; e < 4; e++)
                        bytes[j * 64 + i * 4 + e] = q4 ? qs[4 * j + e] : (uint8_t)(qs[4 * j + e] ^ 0x80);
            }
        }
}

#if GG_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define R16_BUILT 1
#define MR 4 /* activation rows a panel's weights are loaded for */

/* panels [p0, p1) against activation rows [0, mt): q/d/sq as ggml_quantize_rows_q8 writes them */
Q8D_EXACT __attribute__((noinline)) static void row16_panels(int qt, int mt, const uint8_t *w, int64_t p0, int64_t p1, int64_t N, int64_t K,
                                   const int8_t *q, const float *d, const int32_t *sq, float *out) {
    const int64_t nb = K / 32, rec = record_bytes(qt);
    const int scales = qt == GQ4_1 ? 2 : 1, offset = qt == GQ4_0 ? 8 : (qt == GQ8_0 ? 128 : 0);
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int64_t p = p0; p < p1; p++) {
        __m512 acc[MR];
        for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
        const uint8_t *r = w + p * nb * rec;
        for (int64_t b = 0; b < nb; b++, r += rec) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
            const uint8_t *bytes = r + scales * 32;
            __m512i wv[8];
            if (qt == GQ8_0) {
                for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512(bytes + 64 * j);
            } else {
                for (int j = 0; j < 4; j++) {
                    const __m512i v = _mm512_loadu_si512(bytes + 64 * j);
                    wv[j] = _mm512_and_si512(v, m4);
                    wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                }
            }
            for (int m = 0; m < mt; m++) {
                const int32_t *x4 = (const int32_t *)(q + m * K + b * 32); /* 8 groups of 4 bytes */
                const int64_t i = m * nb + b;
                /* two chains of four, summed: exact integers in any order */
                __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(x4[0]));
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[4], _mm512_set1_epi32(x4[4]));
                for (int j = 1; j < 4; j++) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(x4[j]));
                    s1 = _mm512_dpbusd_epi32(s1, wv[4 + j], _mm512_set1_epi32(x4[4 + j]));
                }
                __m512i dot = _mm512_add_epi32(s0, s1);
                if (offset) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * sq[i]));
                const float dx = d[i];
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(dx)));
                if (qt == GQ4_1) {
                    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 32)));
                    t = _mm512_add_ps(t, _mm512_mul_ps(mw, _mm512_set1_ps(dx * (float)sq[i])));
                }
                acc[m] = _mm512_add_ps(acc[m], t);
            }
        }
        const int64_t n0 = p * R16, rows = N - n0 < R16 ? N - n0 : R16;
        const __mmask16 keep = (__mmask16)((1u << rows) - 1u);
        for (int m = 0; m < mt; m++) _mm512_mask_storeu_ps(out + m * N + n0, keep, acc[m]);
    }
}
#elif (GG_AVX2 || GG_AVX512) && defined(__F16C__)
#define R16_BUILT 1
#define MR 4

/* acc + the 8 int32 lane sums of u (unsigned bytes) times s (signed bytes), 4 products a lane; without
 * VNNI the pairwise int16 sums of vpmaddubsw must not saturate: |u * s| pairs <= 2 * 128 * 127 */
AI __m256i r16_dot(__m256i acc, __m256i u, __m256i s) {
#if GG_VNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* the AVX-512 loop above, 8 rows (half a panel) a vector. Q8_0 without VNNI: u = w + 128 would
 * saturate vpmaddubsw, so it multiplies |w| by sign(w) * q_x instead (offset 0) */
Q8D_EXACT __attribute__((noinline)) static void row16_panels(int qt, int mt, const uint8_t *w, int64_t p0, int64_t p1,
                                                             int64_t N, int64_t K, const int8_t *q, const float *d,
                                                             const int32_t *sq, float *out) {
    const int64_t nb = K / 32, rec = record_bytes(qt);
    const int signed_q8 = qt == GQ8_0 && !GG_VNNI;
    const int scales = qt == GQ4_1 ? 2 : 1;
    const int offset = qt == GQ4_0 ? 8 : (qt == GQ8_0 && !signed_q8 ? 128 : 0);
    const __m256i m4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    for (int64_t p = p0; p < p1; p++)
        for (int h = 0; h < 2; h++) {
            const int64_t n0 = p * R16 + 8 * h;
            if (n0 >= N) break;
            __m256 acc[MR];
            for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
            const uint8_t *r = w + p * nb * rec;
            for (int64_t b = 0; b < nb; b++, r += rec) {
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + 16 * h)));
                const uint8_t *bytes = r + scales * 32 + 32 * h;
                __m256i wv[8];
                if (qt == GQ8_0) {
                    for (int j = 0; j < 8; j++) {
                        wv[j] = _mm256_loadu_si256((const __m256i *)(bytes + 64 * j));
                        if (signed_q8) wv[j] = _mm256_xor_si256(wv[j], flip); /* back to w */
                    }
                } else {
                    for (int j = 0; j < 4; j++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(bytes + 64 * j));
                        wv[j] = _mm256_and_si256(v, m4);
                        wv[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    }
                }
                for (int m = 0; m < mt; m++) {
                    const int32_t *x4 = (const int32_t *)(q + m * K + b * 32);
                    const int64_t i = m * nb + b;
                    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
                    for (int j = 0; j < 4; j++) {
                        __m256i xa = _mm256_set1_epi32(x4[j]), xb = _mm256_set1_epi32(x4[4 + j]);
                        __m256i ua = wv[j], ub = wv[4 + j];
                        if (signed_q8) {
                            xa = _mm256_sign_epi8(xa, ua), xb = _mm256_sign_epi8(xb, ub);
                            ua = _mm256_abs_epi8(ua), ub = _mm256_abs_epi8(ub);
                        }
                        s0 = r16_dot(s0, ua, xa);
                        s1 = r16_dot(s1, ub, xb);
                    }
                    __m256i dot = _mm256_add_epi32(s0, s1);
                    if (offset) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * sq[i]));
                    const float dx = d[i];
                    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(dx)));
                    if (qt == GQ4_1) {
                        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + 32 + 16 * h)));
                        t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(dx * (float)sq[i])));
                    }
                    acc[m] = _mm256_add_ps(acc[m], t);
                }
            }
            const int64_t rows = N - n0 < 8 ? N - n0 : 8;
            const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int m = 0; m < mt; m++) _mm256_maskstore_ps(out + m * N + n0, keep, acc[m]);
        }
}
#else
#define R16_BUILT 0
#endif

int ggml_q8_row16_built(void) { return R16_BUILT; }

/* out [M, N] = q8(x [M, K]) . w (row16 layout of a GGML weight [N, K]): TF_OK or TF_ENOMEM; -1 in
 * a build without the kernel (callers ask ggml_q8_row16_built first) */
int ggml_matmul_q8_row16(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
#if R16_BUILT
    const int64_t nb = K / 32, panels = (N + R16 - 1) / R16;
    q8_acts a;
    if (q8_acts_quantize(x, M, K, M * K, &a) != TF_OK) return TF_ENOMEM;
    const int8_t *q = a.q;
    const float *d = a.d;
    const int32_t *sq = a.sq;
    const int nt = tf_nthreads();
    const int par = N * K * (M < MR ? M : MR) >= PAR_MIN_WORK && nt > 1;
#pragma omp parallel num_threads(nt) if (par)
    {
        const int t = par ? omp_get_thread_num() : 0, n = par ? omp_get_num_threads() : 1;
        const int64_t p0 = panels * t / n, p1 = panels * (t + 1) / n;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mt = M - m0 < MR ? (int)(M - m0) : MR;
            if (p0 < p1) {
                if (qt == GQ8_0)
                    row16_panels(GQ8_0, mt, w, p0, p1, N, K, q + m0 * K, d + m0 * nb, sq + m0 * nb, out + m0 * N);
                else if (qt == GQ4_0)
                    row16_panels(GQ4_0, mt, w, p0, p1, N, K, q + m0 * K, d + m0 * nb, sq + m0 * nb, out + m0 * N);
                else
                    row16_panels(GQ4_1, mt, w, p0, p1, N, K, q + m0 * K, d + m0 * nb, sq + m0 * nb, out + m0 * N);
            }
        }
    }
    free(a.q);
    return TF_OK;
#else
    (void)x, (void)w, (void)M, (void)N, (void)K, (void)qt, (void)out;
    return -1;
#endif
}
