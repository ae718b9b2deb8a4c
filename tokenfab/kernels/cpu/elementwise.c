/*
 * Row-wise CPU kernels: RMSNorm (with the residual add fused), SiLU-and-mul, rotary embedding
 * and row argmax. Each reads its input once and writes its output once, where the PyTorch
 * references make several passes with temporaries (RMSNorm: 6 ops; RoPE: 8 plus a concat),
 * and each is one call instead of several, which matters at decode batch sizes where a step
 * is ~300 small ops. Semantics, including the bfloat16 roundings of the references, are those
 * of the references in tokenfab/kernels/{norm,activation,rope}.py; `bf16` selects bfloat16
 * tensors, else float32. Strides are in elements; rows are contiguous. The kernels that take a
 * work buffer return TF_OK or TF_ENOMEM (common.h).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

/* parallelize only when there is enough work to pay for waking the threads */
#define PAR_MIN_ELEMS 16384

/* Row r of x starts at (r / x_n) * x_s + (r % x_n) * x_si: [T, heads, D] views normalized over D
 * (Qwen3's q/k norm on a slice of the fused qkv) have two strides; plain rows have x_n = 1. */
int rms_norm(const void *x, int64_t x_s, int64_t x_n, int64_t x_si, void *residual, int64_t r_s, const void *w,
             void *out, int64_t o_s, int64_t rows, int64_t H, float eps, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(tf_nthreads()) if (rows * H >= PAR_MIN_ELEMS)
    {
        float *buf = malloc(sizeof(float) * 3 * H);
        float *v = buf, *xr = buf + H, *wf = buf + 2 * H;
        if (buf)
            load_row(w, bf16, wf, H);
        else {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!buf) continue;
            load_row((const char *)x + ((r / x_n) * x_s + (r % x_n) * x_si) * esz, bf16, v, H);
            if (residual) {
                char *res = (char *)residual + r * r_s * esz;
                load_row(res, bf16, xr, H);
                for (int64_t i = 0; i < H; i++) v[i] = bf16 ? round_bf16(xr[i] + v[i]) : xr[i] + v[i];
                store_row(v, bf16, res, H);
            }
            float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < H; i++) ss += v[i] * v[i];
            const float inv = 1.0f / sqrtf(ss / (float)H + eps);
            if (bf16)
                for (int64_t i = 0; i < H; i++) v[i] = round_bf16(round_bf16(v[i] * inv) * wf[i]);
            else
#pragma omp simd
                for (int64_t i = 0; i < H; i++) v[i] = (v[i] * inv) * wf[i];
            store_row(v, bf16, (char *)out + r * o_s * esz, H);
        }
        free(buf);
    }
    return failed ? TF_ENOMEM : TF_OK;
}

int silu_and_mul(const void *x, int64_t x_s, void *out, int64_t o_s, int64_t rows, int64_t I, int bf16) {
    if (!bf16) {
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (rows * I >= PAR_MIN_ELEMS)
        for (int64_t r = 0; r < rows; r++) {
            const float *g = (const float *)x + r * x_s, *u = g + I;
            float *o = (float *)out + r * o_s;
#pragma omp simd
            for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        return TF_OK;
    }
    int failed = 0;
#pragma omp parallel num_threads(tf_nthreads()) if (rows * I >= PAR_MIN_ELEMS)
    {
        float *buf = malloc(sizeof(float) * 2 * I);
        float *g = buf, *u = buf + I;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!buf) continue;
            const uint16_t *row = (const uint16_t *)x + r * x_s;
            widen_bf16(row, g, I);
            widen_bf16(row + I, u, I);
#pragma omp simd
            for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i]));
            for (int64_t i = 0; i < I; i++) g[i] = round_bf16(round_bf16(g[i]) * u[i]);
            narrow_bf16(g, (uint16_t *)out + r * o_s, I);
        }
        free(buf);
    }
    return failed ? TF_ENOMEM : TF_OK;
}

/* The H heads of one token (x + h * x_sh, each D elements) rotated into out (contiguous). */
static void rotate_heads(const char *x, int64_t x_sh, int64_t H, char *out, const float *cosv, const float *sinv,
                         int64_t D, int64_t rot, int neox, int bf16, float *v, float *o) {
    const int64_t esz = bf16 ? 2 : 4, half = rot / 2;
    for (int64_t h = 0; h < H; h++) {
        load_row(x + h * x_sh * esz, bf16, v, D);
        if (neox) {
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                o[j] = v[j] * cosv[j] - v[j + half] * sinv[j];
                o[j + half] = v[j + half] * cosv[j] + v[j] * sinv[j];
            }
        } else {
            for (int64_t j = 0; j < half; j++) {
                o[2 * j] = v[2 * j] * cosv[j] - v[2 * j + 1] * sinv[j];
                o[2 * j + 1] = v[2 * j + 1] * cosv[j] + v[2 * j] * sinv[j];
            }
        }
        for (int64_t j = rot; j < D; j++) o[j] = v[j];
        store_row(o, bf16, out + h * D * esz, D);
    }
}

/* q [T, Hq, D] and k [T, Hk, D] (strides q_st, q_sh / k_st, k_sh) -> q_out, k_out contiguous, in
 * one pass over the tokens: the first `rot` channels of each head rotate by the angle of
 * positions[t] (cos_sin [P, rot]: rot/2 cosines then rot/2 sines), NeoX halves or GPT-J
 * interleaved pairs; the other channels are copied. */
int rotary_qk(const int64_t *positions, const void *q, int64_t q_st, int64_t q_sh, int64_t Hq, void *q_out,
              const void *k, int64_t k_st, int64_t k_sh, int64_t Hk, void *k_out, const float *cos_sin, int64_t T,
              int64_t D, int64_t rot, int neox, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(tf_nthreads()) if (T * (Hq + Hk) * D >= PAR_MIN_ELEMS)
    {
        float *v = malloc(sizeof(float) * 2 * D);
        float *o = v + D;
        if (!v) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!v) continue;
            const float *cs = cos_sin + positions[t] * rot;
            rotate_heads((const char *)q + t * q_st * esz, q_sh, Hq, (char *)q_out + t * Hq * D * esz, cs, cs + rot / 2,
                         D, rot, neox, bf16, v, o);
            rotate_heads((const char *)k + t * k_st * esz, k_sh, Hk, (char *)k_out + t * Hk * D * esz, cs, cs + rot / 2,
                         D, rot, neox, bf16, v, o);
        }
        free(v);
    }
    return failed ? TF_ENOMEM : TF_OK;
}

/* out[r] = index of the first maximum of row r of x [R, V] (float32, contiguous); a NaN counts
 * as the maximum, as in torch.argmax. (NaN is tested on the bits: the library is compiled with
 * -ffast-math, under which x != x may fold to false.) */
void argmax_rows(const float *x, int64_t R, int64_t V, int64_t *out) {
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (R * V >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * V;
        const uint32_t *bits = (const uint32_t *)row;
        float m = row[0];
        uint32_t nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < V; i++) {
            m = row[i] > m ? row[i] : m;
            nan |= (bits[i] & 0x7fffffffu) > 0x7f800000u;
        }
        int64_t best = 0;
        if (nan) {
            while ((bits[best] & 0x7fffffffu) <= 0x7f800000u) best++;
        } else {
            /* the reduction starts from -FLT_MAX, so a row of -inf finds no equal: index 0 */
            while (best < V && row[best] != m) best++;
            if (best == V) best = 0;
        }
        out[r] = best;
    }
}

/* k [T, H, D] (strides k_st, k_sh) and v [T, H, Dv] go to the paged caches [NB, BS, H, D|Dv]
 * (contiguous) at slot slots[t] = block * BS + offset; slot -1 is skipped. Same dtype in and out. */
void store_kv(const void *k, int64_t k_st, int64_t k_sh, const void *v, int64_t v_st, int64_t v_sh, void *k_cache,
              void *v_cache, const int64_t *slots, int64_t T, int64_t H, int64_t D, int64_t Dv, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(tf_nthreads()) schedule(static) if (T * H * (D + Dv) >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < H; h++) {
            memcpy((char *)k_cache + ((slot * H + h) * D) * esz, (const char *)k + (t * k_st + h * k_sh) * esz, D * esz);
            memcpy((char *)v_cache + ((slot * H + h) * Dv) * esz, (const char *)v + (t * v_st + h * v_sh) * esz,
                   Dv * esz);
        }
    }
}

/* What this build's kernels outside ggml_*.c run (common.h): bit 0 the AVX-512 paths, 1 the AVX2 + FMA
 * paths (else portable C), 2 AVX512-BF16 key dots in paged attention, 3 F16C, 4 AVX-512DQ (w4a16's
 * NVFP4 two-group decode). kernels/cpu/info.py names them. */
int tf_cpu_isa(void) {
    int f = (TF_AVX512 ? 1 : 0) | (TF_AVX2 ? 2 : 0);
#ifdef __AVX512BF16__
    f |= 4;
#endif
#ifdef __F16C__
    f |= 8;
#endif
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    f |= 16;
#endif
    return f;
}
