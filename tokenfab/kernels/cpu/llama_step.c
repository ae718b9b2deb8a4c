/*
 * One forward step of a Llama-family decoder whose linear layers hold packed GGML weights
 * (models/llama.py over layers/ggml_linear.py), driven from C.
 *
 * Why: on CPU a decode step at batch 1 is ~300 small kernel calls; driving them from Python costs
 * about as much as the kernels themselves (module calls, ctypes argument conversion, tensor
 * allocations: ~5 ms a token on the bundled model, against ~6 ms of matmuls). This driver calls the
 * same kernels, in the same order, with the same arguments and the same intermediate layouts as the
 * Python layers do, so its hidden states are theirs bit for bit (tests/kernels/test_cpu_llama_step.py
 * compares with torch.equal); only the interpreter between them is gone.
 *
 * The model is described by two int64 tables that the Python side fills once (kernels/cpu/llama_step.py):
 *   cfg[CFG_N]: sizes, the embedding, the final norm, the rotary layout, the cache's block size;
 *   layers[n_layers][LY_N]: per layer the two norm weights, the KV-cache slices, the rotary cache,
 *     the sliding window (0: none), Qwen3's q/k norm weights (cfg says whether) and four linear layers (qkv, o, gate_up, down), each as {packed weight, GGML type, activation mode, bias, rows, row16 copy}.
 * Pointers travel as int64. Floats (eps, scale) are separate arguments.
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

/* the kernels this driver calls (elementwise.c, paged_attention.c, ggml_matmul.c, ggml_q8.c) */
int rms_norm(const void *x, int64_t x_s, int64_t x_n, int64_t x_si, void *residual, int64_t r_s, const void *w,
             void *out, int64_t o_s, int64_t rows, int64_t H, float eps, int bf16);
int silu_and_mul(const void *x, int64_t x_s, void *out, int64_t o_s, int64_t rows, int64_t I, int bf16);
int rotary_qk(const int64_t *positions, const void *q, int64_t q_st, int64_t q_sh, int64_t Hq, void *q_out,
              const void *k, int64_t k_st, int64_t k_sh, int64_t Hk, void *k_out, const float *cos_sin, int64_t T,
              int64_t D, int64_t rot, int neox, int bf16);
void store_kv(const void *k, int64_t k_st, int64_t k_sh, const void *v, int64_t v_st, int64_t v_sh, void *k_cache,
              void *v_cache, const int64_t *slots, int64_t T, int64_t H, int64_t D, int64_t Dv, int bf16);
int paged_attention_f32(const void *q, const void *k, const void *v, const int32_t *table, const int32_t *cu,
                        const int32_t *ctx, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,
                        int64_t BS, int64_t q_st, int64_t q_sh, int64_t k_sblk, int64_t k_sslot, int64_t k_sh,
                        int64_t v_sblk, int64_t v_sslot, int64_t v_sh, int64_t bt_s, float scale, int64_t window,
                        float softcap, const float *sinks);
int ggml_matmul_f32(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out);
int ggml_matmul_q8(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out);
int ggml_matmul_q8_row16(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out);
int ggml_q8_tile_min_rows(void);
void ggml_dequant_rows(const uint8_t *w, int64_t K, int qt, const int64_t *rows, int64_t R, float *out);

/* cfg[] */
enum {
    CFG_LAYERS, CFG_HIDDEN, CFG_HEADS, CFG_KV_HEADS, CFG_HEAD_DIM, CFG_INTER, CFG_EMBED, CFG_EMBED_QT,
    CFG_FINAL_NORM, CFG_ROT_DIM, CFG_NEOX, CFG_BLOCK_SIZE, CFG_QK_NORM, CFG_N
};
/* a linear layer's six entries (row16: the weight in ggml_q8_decode.c's layout, 0 when none), and a
 * layer's row of the layer table */
enum { LIN_W, LIN_QT, LIN_ACT, LIN_BIAS, LIN_ROWS, LIN_ROW16, LIN_N };
enum { LY_IN_NORM, LY_POST_NORM, LY_K_CACHE, LY_V_CACHE, LY_COS_SIN, LY_WINDOW, LY_Q_NORM, LY_K_NORM, LY_QKV,
       LY_O = LY_QKV + LIN_N,
       LY_GATE_UP = LY_O + LIN_N, LY_DOWN = LY_GATE_UP + LIN_N, LY_N = LY_DOWN + LIN_N };

#define PTR(T, v) ((T)(intptr_t)(v))

/* out [M, N] = x [M, K] @ dequant(w).T (+ bias): GGMLLinear.forward's native branch */
static int linear(const int64_t *lin, const float *x, int64_t M, int64_t K, float *out) {
    const int64_t N = lin[LIN_ROWS];
    const uint8_t *w = PTR(const uint8_t *, lin[LIN_W]);
    /* int8 activations: the row16 copy below the many-row tiles' switch, or at any M in a build
     * without the tiles (GGMLLinear.forward's rule) */
    const int tiles_from = lin[LIN_ACT] && lin[LIN_ROW16] ? ggml_q8_tile_min_rows() : 0;
    const int row16 = lin[LIN_ACT] && lin[LIN_ROW16] && (tiles_from == 0 || M < tiles_from);
    int rc = row16 ? ggml_matmul_q8_row16(x, PTR(const uint8_t *, lin[LIN_ROW16]), M, N, K, (int)lin[LIN_QT], out)
             : lin[LIN_ACT] ? ggml_matmul_q8(x, w, M, N, K, (int)lin[LIN_QT], out)
                            : ggml_matmul_f32(x, w, M, N, K, (int)lin[LIN_QT], out);
    const float *bias = PTR(const float *, lin[LIN_BIAS]);
    if (rc == TF_OK && bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) out[m * N + n] += bias[n];
    return rc;
}

/*
 * hidden [T, H] = the final-norm hidden states of the T tokens of one flat batch (ForwardBatch):
 * tokens, positions, slots [T] int64; B sequences with block tables [B, bt_s] int32, context
 * lengths [B] int32 and cu [B + 1] int32 (NULL when every sequence has one token: decode).
 * The index tensors were checked by the caller. Returns TF_OK or TF_ENOMEM.
 */
int llama_step_f32(const int64_t *cfg, const int64_t *layers, float eps, float scale, const int64_t *tokens,
                   const int64_t *positions, const int64_t *slots, int64_t T, const int32_t *tables, int64_t bt_s,
                   const int32_t *cu, const int32_t *ctx, int64_t B, float *hidden) {
    const int64_t H = cfg[CFG_HIDDEN], Hq = cfg[CFG_HEADS], Hkv = cfg[CFG_KV_HEADS], D = cfg[CFG_HEAD_DIM];
    const int64_t I = cfg[CFG_INTER], BS = cfg[CFG_BLOCK_SIZE], W = (Hq + 2 * Hkv) * D;
    if (T == 0) return TF_OK;
    /* the step's activations, as the Python layers hold them */
    const int qk_norm = (int)cfg[CFG_QK_NORM];
    const int64_t sizes[] = {T * H, T * H, T * H, T * W, T * Hq * D, T * Hkv * D, T * Hq * D, T * 2 * I, T * I,
                             qk_norm ? T * Hq * D : 0, qk_norm ? T * Hkv * D : 0};
    enum { X, RES, NORMED, QKV, QROT, KROT, ATTN, GATE_UP, ACT, QN, KN, NBUF };
    float *buf[NBUF];
    int64_t total = 0;
    for (int i = 0; i < NBUF; i++) total += sizes[i];
    float *arena = malloc(sizeof(float) * total);
    if (!arena) return TF_ENOMEM;
    for (int i = 0, off = 0; i < NBUF; off += sizes[i], i++) buf[i] = arena + off;

    int rc = TF_OK;
    ggml_dequant_rows(PTR(const uint8_t *, cfg[CFG_EMBED]), H, (int)cfg[CFG_EMBED_QT], tokens, T, buf[X]);
    memcpy(buf[RES], buf[X], sizeof(float) * T * H); /* the first layer's residual: x itself */
    for (int64_t l = 0; l < cfg[CFG_LAYERS] && rc == TF_OK; l++) {
        const int64_t *ly = layers + l * LY_N;
        const float *in_norm = PTR(const float *, ly[LY_IN_NORM]), *post_norm = PTR(const float *, ly[LY_POST_NORM]);
        float *kc = PTR(float *, ly[LY_K_CACHE]), *vc = PTR(float *, ly[LY_V_CACHE]);
        const float *cos_sin = PTR(const float *, ly[LY_COS_SIN]);
        /* h = input_layernorm(x) (+ residual after the first layer) */
        rc = rms_norm(buf[X], H, 1, 0, l ? buf[RES] : NULL, H, in_norm, buf[NORMED], H, T, H, eps, 0);
        if (rc == TF_OK) rc = linear(ly + LY_QKV, buf[NORMED], T, H, buf[QKV]);
        /* q, k, v: views of qkv; q and k rotated into contiguous rows, v stored from its view. Qwen3
         * first normalizes each head of q and k (the [T, heads, D] views, into contiguous rows) */
        const float *q = buf[QKV], *k = buf[QKV] + Hq * D;
        int64_t q_st = W, k_st = W;
        if (rc == TF_OK && qk_norm) {
            rc = rms_norm(q, W, Hq, D, NULL, 0, PTR(const float *, ly[LY_Q_NORM]), buf[QN], D, T * Hq, D, eps, 0);
            if (rc == TF_OK)
                rc = rms_norm(k, W, Hkv, D, NULL, 0, PTR(const float *, ly[LY_K_NORM]), buf[KN], D, T * Hkv, D, eps, 0);
            q = buf[QN], k = buf[KN], q_st = Hq * D, k_st = Hkv * D;
        }
        if (rc == TF_OK)
            rc = rotary_qk(positions, q, q_st, D, Hq, buf[QROT], k, k_st, D, Hkv, buf[KROT], cos_sin, T, D,
                           cfg[CFG_ROT_DIM], (int)cfg[CFG_NEOX], 0);
        if (rc != TF_OK) break;
        store_kv(buf[KROT], Hkv * D, D, buf[QKV] + (Hq + Hkv) * D, W, D, kc, vc, slots, T, Hkv, D, D, 0);
        rc = paged_attention_f32(buf[QROT], kc, vc, tables, cu, ctx, buf[ATTN], B, Hq, Hkv, D, D, BS, Hq * D, D,
                                 BS * Hkv * D, Hkv * D, D, BS * Hkv * D, Hkv * D, D, bt_s, scale, ly[LY_WINDOW],
                                 0.0f, NULL);
        /* o_proj, then post_attention_layernorm(o + residual) */
        if (rc == TF_OK) rc = linear(ly + LY_O, buf[ATTN], T, Hq * D, buf[X]);
        if (rc == TF_OK) rc = rms_norm(buf[X], H, 1, 0, buf[RES], H, post_norm, buf[NORMED], H, T, H, eps, 0);
        if (rc == TF_OK) rc = linear(ly + LY_GATE_UP, buf[NORMED], T, H, buf[GATE_UP]);
        if (rc == TF_OK) rc = silu_and_mul(buf[GATE_UP], 2 * I, buf[ACT], I, T, I, 0);
        if (rc == TF_OK) rc = linear(ly + LY_DOWN, buf[ACT], T, I, buf[X]);
    }
    /* the final norm of x + residual */
    if (rc == TF_OK)
        rc = rms_norm(buf[X], H, 1, 0, buf[RES], H, PTR(const float *, cfg[CFG_FINAL_NORM]), hidden, H, T, H, eps, 0);
    free(arena);
    return rc;
}
