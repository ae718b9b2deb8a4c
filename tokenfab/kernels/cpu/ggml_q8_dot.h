/* The integer dot-product pieces of ggml_q8.c's vector paths (AVX-512/AVX2, VNNI where present): byte
 * dot products into int32 lanes, the Q4 pair kernel and the in-order horizontal sums. Included by ggml_q8.c
 * only (after ggml_common.h); integer sums, so exact in any order. */
#ifndef TOKENFAB_GGML_Q8_DOT_H
#define TOKENFAB_GGML_Q8_DOT_H
#if GG_AVX512 || GG_AVX2
/* 8 int32 lanes summing to dot(u, s) of 32 unsigned (u) and signed (s) bytes */
AI __m256i dot_us(__m256i u, __m256i s) {
#if GG_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#endif
#else
    /* u <= 128, |s| <= 127 here: the pairwise int16 sums cannot saturate */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* acc + the 8 int32 lane sums of dot(u, s) (u <= 15 here: the AVX2 pairwise int16 sums cannot saturate) */
AI __m256i dot_us_acc(__m256i acc, __m256i u, __m256i s) {
#if GG_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Q4 blocks in pairs: the nibbles of blocks 2p and 2p + 1 in one vector (lo: elements 0..15 of
 * both, hi: 16..31), against activations laid out to match (pair_activations): no per-block
 * shuffle. A lane holds 4 products of one block (lanes 0-3 block 2p, 4-7 block 2p + 1). Q4_0's
 * dot is then dot(q, x) - 8 * sum(x): exact integers either way. */
AI __m256i pair_dot_q4(int qt, const uint8_t *b0, int64_t bb, const int8_t *xp) {
    const int off = qt == GQ4_1 ? 4 : 2;
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + off))),
                                              _mm_loadu_si128((const __m128i *)(b0 + bb + off)), 1);
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m256i acc = dot_us_acc(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)xp));
    return dot_us_acc(acc, hi, _mm256_loadu_si256((const __m256i *)(xp + 32)));
}

/* the four pair vectors of a group of 8 blocks -> the 8 block sums, in block order */
AI __m256i hsum_pairs(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
    /* per 128-bit half, after two hadds: low half blocks 0, 2, 4, 6; high half 1, 3, 5, 7 */
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* the 32 weights of a block as bytes (Q4_1: unsigned nibbles; Q4_0: q - 8; Q8_0: q) */
AI __m256i wbytes(int qt, const uint8_t *b) {
    if (qt == GQ8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (qt == GQ4_1 ? 4 : 2)));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
    const __m256i v = _mm256_set_m128i(hi, lo);
    return qt == GQ4_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(8)) : v;
}

/* 8 vectors of 8 int32 lanes -> their 8 sums, in order (integer: exact in any order) */
AI __m256i hsum8x8(const __m256i v[8]) {
    const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}
#endif
#endif
