/* FP8 (e4m3) weights on CPU, kept float8 in memory: float32 activations times float8 weights with
 * their scales (kernels/quant.py's layout: w uint8 [N, K] e4m3 codes, scales float32 indexed
 * s[(n / group_n) * ss0 + (k / 128) * ss1], ss1 = 0 for one scale column).
 *
 * e4m3 -> float without a table (common.h, widen_e4m3: AVX-512 16 and AVX2 8 bytes at a time): a normal
 * code s eeee mmm is float bits (eeee mmm) << 20 with the exponent rebiased by 120 (7 -> 127); a subnormal
 * one (eeee = 0) is mmm * 2^-9. No float32 denormal is formed (flush-to-zero cannot touch them). The dot
 * products are one compiled loop, vectorized 8 wide for AVX2 and AVX-512 targets alike: the builds agree
 * bit for bit.
 *
 * fp8_matmul_f32 (decode, few rows): a thread decodes one weight row (times its scales) into a float
 * row and takes its dot product with every activation row: each weight byte is read once a call and
 * the full-precision copy is one row per thread. fp8_dequant_rows: rows of the weight to float32 (the
 * prefill path multiplies them with torch's GEMM one layer at a time). Sums are float32 in the
 * compiler's vectorized order (the reference differs by summation order only).
 */
#include <stdlib.h>

#include "common.h"

/* a weight row, decoded (common.h's widen_e4m3: AVX-512, AVX2 or C, all exact) then scaled per
 * 128-column block: one rounding per element, the same on every path */
static void decode_row(const uint8_t *w, const float *s, int64_t ss1, int64_t k, float *dst) {
    widen_e4m3(w, dst, k);
    for (int64_t k0 = 0; k0 < k; k0 += 128) {
        int64_t k1 = k0 + 128 < k ? k0 + 128 : k;
        float sc = s[(k0 / 128) * ss1];
        for (int64_t j = k0; j < k1; j++) dst[j] *= sc;
    }
}

int fp8_dequant_rows(const uint8_t *w, int64_t sw, int64_t n, int64_t k, const float *s, int64_t ss0,
                     int64_t ss1, int64_t group_n, float *out) {
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static)
    for (int64_t r = 0; r < n; r++) decode_row(w + r * sw, s + (r / group_n) * ss0, ss1, k, out + r * k);
    return TF_OK;
}

int fp8_matmul_f32(const float *x, int64_t sx, int64_t m, int64_t k, const uint8_t *w, int64_t sw, int64_t n,
                   const float *s, int64_t ss0, int64_t ss1, int64_t group_n, float *out, int64_t so) {
    int failed = 0;
#pragma omp parallel num_threads(tf_nthreads())
    {
        float *row = (float *)malloc(sizeof(float) * (size_t)(k > 0 ? k : 1));
        if (row == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            if (row == NULL) continue;
            decode_row(w + r * sw, s + (r / group_n) * ss0, ss1, k, row);
            for (int64_t i = 0; i < m; i++) {
                const float *xi = x + i * sx;
                float acc = 0.0f;
                for (int64_t j = 0; j < k; j++) acc += xi[j] * row[j];
                out[i * so + r] = acc;
            }
        }
        free(row);
    }
    return failed ? TF_ENOMEM : TF_OK;
}
