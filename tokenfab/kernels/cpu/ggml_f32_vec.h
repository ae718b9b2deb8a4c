/* The vector layer of the float32-activation GGML kernels (ggml_matmul.c, ggml_f32_gemv.h,
 * ggml_f32_panel.h): vf (VW float lanes) and its operations per ISA, the in-register block
 * dequantization (deq_block), the scale conversion (row_scales), and the one summation order.
 *
 * THE ORDER (row invariance). Every (activation row m, weight row n) dot product of the vector builds
 * is summed the same way, whichever kernel and batch size computes it:
 *   acc = 0 (VW lanes); for each VW-wide slice j = 0, 1, ... of K in order: acc = fma(w[n, j], x[m, j], acc);
 *   out[m, n] = the VW lanes of acc summed by the halving tree (lane i + lane i + VW/2, then i + VW/4, ...;
 *   v_sum_pinned for one output, tree16 for sixteen at a time: the same pairs, so the same bits).
 * A float32 weight row whose K is not a multiple of VW ends in one zero-padded slice (w and x both 0).
 * One accumulator per output is what lets a register tile hold many outputs (4 x 6 on AVX-512, 3 x 4
 * on AVX2) and keeps the loads per FMA low; the GEMV tiles get their FMA-latency cover from several
 * weight rows at once instead. Different ISAs (VW 16 / 8) give different bits (float32 tolerance);
 * the portable C build keeps its own order (32 scalar lanes per output, ggml_f32_gemv.h), in one kernel.
 */
#ifndef TOKENFAB_GGML_F32_VEC_H
#define TOKENFAB_GGML_F32_VEC_H
#include "ggml_common.h"

#if GG_AVX512
#define VW 16
#define NV (32 / VW)
typedef __m512 vf;
AI vf v_zero(void) { return _mm512_setzero_ps(); }
AI vf v_load(const float *p) { return _mm512_loadu_ps(p); }
AI vf v_load_part(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); } /* n < 16, rest 0 */
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
AI vf v_load_part(const float *p, int n) { /* n < 8, rest 0 */
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
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


#if GG_AVX512
/* sixteen outputs at once: a[i] for i = 4 * j + q (j, q in 0..3) summed by the halving tree, lane
 * 4 * q + j of the result. Each level pairs the same lanes as v_sum_pinned (i + 8, i + 4, i + 2,
 * i + 1), two accumulators per add, so the result is bit for bit sixteen v_sum_pinned calls. */
AI __m512 tree16(const vf *a) {
    vf s[8], r[4], v[2];
    for (int i = 0; i < 8; i++) /* lanes 0..7: a[2i]'s i + (i + 8); lanes 8..15: a[2i + 1]'s */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* quad q: a[4i + q]'s eight sums folded to four */
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* quad q: [a[8i + q] (2 lanes), a[8i + 4 + q] (2 lanes)] */
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#endif
