/*
 * Paged attention for the CPU: keys and values read in place from the paged cache (no gather
 * copy, no padding to the longest context), for decode rows and prefill chunks alike.
 *
 * Why C: on CPU the PyTorch reference has to copy every sequence's pages into one padded
 * block before it can call SDPA; at 64 sequences that copy plus the padded attention was ~45%
 * of a decode step. In a 4,096-token prefill step the copies, the padding and the index
 * bookkeeping around SDPA took as long as SDPA itself.
 *
 * Semantics are those of tokenfab.kernels.attention.paged_attention_ref: sequence b has ctx[b]
 * keys; its q_len[b] queries sit at positions ctx[b] - q_len[b] .. ctx[b] - 1 and see the keys
 * at or before their own position; window > 0 keeps the last `window` of those; softcap > 0 maps
 * logits through softcap * tanh(x / softcap); sinks (one float per query head, or NULL) join
 * the softmax denominator without a value.
 *
 * Layouts (strides in elements; the last dimension of every tensor is contiguous):
 *   q     [T, Hq, D]            strides q_st, q_sh
 *   k     [NB, BS, Hkv, D]      strides k_sblk, k_sslot, k_sh
 *   v     [NB, BS, Hkv, Dv]     strides v_sblk, v_sslot, v_sh
 *   table [B, max_blocks] int32 row stride bt_s
 *   cu    [B + 1] int32         query rows of sequence b are cu[b] .. cu[b+1]-1; NULL: T = B, one each
 *   out   [T, Hq, Dv]           contiguous
 *
 * Decode rows (one query) run `attend`: one task per sequence (and per kv-head range when there
 * are few sequences) reads each token's key row (all its heads, contiguous) once and computes
 * every query head of the GQA groups that share it. Keys are taken 16 at a time: 16 dot
 * products accumulate in 16 vector registers and are reduced together by a transpose-add tree
 * (AVX-512), instead of one horizontal sum per dot product. Softmax is exact (two passes over
 * the scores, which stay in a per-task buffer).
 *
 * Code paths (common.h): AVX-512, AVX2 + FMA, portable C. The AVX2 path holds each 16-lane
 * accumulator as two 8-lane halves and reduces them in the AVX-512 tree's order, and its value sums
 * take the same per-column FMAs: with float32 or e4m3 caches its output equals the AVX-512 path's bit
 * for bit. bfloat16 keys on AVX512-BF16 are dotted by vdpbf16ps (another pairing of the products):
 * there the paths agree to bfloat16 tolerance only.
 *
 * Batch invariance: a sequence with up to EXTEND_AS_DECODE query rows (a speculative verify: k + 1
 * rows) also runs `attend`, each row over its own causal prefix, so every row is bit for bit the
 * decode row at its position (speculation's greedy output then equals plain decoding's). A row's
 * result never depends on the other rows or sequences of the batch, nor on the kv-head split.
 *
 * FP8 caches (float8 e4m3, `paged_attention_{f32,bf16}_fp8kv`): a stored byte is decoded to float by bit
 * arithmetic (AVX-512: 16 at a time, AVX2: 8; no table, no float subnormals involved) into the same row buffers
 * the bfloat16 path widens into; the key scale is folded into the query scale and the value scale
 * into the final 1 / denominator, so no per-element multiply is added.
 *
 * Longer prefill chunks run `attend_block`: a task is a block of up to 16 query tokens of one kv head's
 * GQA group, so each 16-key tile read from the cache serves up to 64 query rows; one pass with
 * an online softmax, causal (and window) masks per row. Both kinds of task go into one list,
 * ordered by cost, longest first, and are taken dynamically by the threads.
 */
#define _POSIX_C_SOURCE 200112L /* posix_memalign */
#include "paged_attention.h"
#include "paged_attention_vec.h"

/* Decode-structured rows: the nq query tokens row0 .. row0 + nq - 1 of sequence b, at positions
 * pos0 .. pos0 + nq - 1 (query i sees keys start .. pos0 + i), with the query heads of kv heads
 * [h0, h1). A decode row is nq = 1; a short extend (a speculative verify) runs here too, so that
 * its rows are computed exactly as decode rows: each row's scores, softmax and value sum take the
 * same steps (same 16-key tiles from `start`, same two-pass softmax over its own keys, same value
 * tiles) whatever nq is, while each key and value tile is read once for all the rows. Rows must
 * share `start` (no window, or nq = 1). buf (64-byte aligned) holds qf, acc, scores, a row buffer. */
static void attend(const Args *a, int64_t b, int64_t row0, int64_t pos0, int64_t nq, int64_t h0, int64_t h1,
                   float *buf) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, Dv = a->Dv, BS = a->BS, nh = h1 - h0, Rh = nh * G, R = nq * Rh;
    const int64_t L = pos0 + nq; /* keys of the last query */
    const int64_t start = (a->window > 0 && pos0 + 1 > a->window) ? pos0 + 1 - a->window : 0;
    const int64_t n_pad = lines(L - start);
    const int32_t *bt = a->table + b * a->bt_s;
    const int64_t esz = kv_esz(a); /* cache element bytes */
    /* bytes of one token's rows for heads h0..h1-1 */
    const int64_t k_span = ((nh - 1) * a->k_sh + D) * esz, v_span = ((nh - 1) * a->v_sh + Dv) * esz;

    /* rows r = i * Rh + (h - h0) * G + g */
    float *qf = buf, *acc = qf + lines(R * D), *s = acc + lines(R * Dv), *rowbuf = s + R * n_pad;
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < Rh; j++) {
            const int64_t r = i * Rh + j, off = (row0 + i) * a->q_st + (h0 * G + j) * a->q_sh;
            if (a->bf16)
                widen_bf16((const uint16_t *)a->q + off, qf + r * D, D);
            else
                memcpy(qf + r * D, (const float *)a->q + off, sizeof(float) * D);
            for (int64_t d = 0; d < D; d++) qf[r * D + d] *= a->scale;
        }
    /* bfloat16 keys: dot products straight from the cache with AVX512-BF16 where available */
    const int bf16_dot = HAVE_DOT16_BF16 && a->kv == KV_BF16 && D % 32 == 0;
    (void)bf16_dot;
    /* scores s[r][t - start], 16 keys at a time; a token's heads are adjacent in memory. Query i
     * takes the tiles that start before its own end (pos0 + i + 1), as a decode row of it would. */
    for (int64_t t0 = start; t0 < L; t0 += TILE) {
        const char *tok[TILE];
        for (int i = 0; i < TILE; i++) {
            const int64_t t = t0 + i < L ? t0 + i : L - 1; /* the tail repeats a valid row */
            tok[i] = (const char *)a->k + ((int64_t)bt[t / BS] * a->k_sblk + (t % BS) * a->k_sslot) * esz;
        }
        const int64_t i_lo = t0 > pos0 ? t0 - pos0 : 0; /* the first query that sees key t0 */
        SpreadPrefetch pf;
        spread_prefetch_init(&pf, (const char *)a->k, bt, t0 + PF_TILES * TILE, L, BS, a->k_sblk, a->k_sslot,
                             h0 * a->k_sh, esz, k_span, (nq - i_lo) * Rh);
#if HAVE_DOT16_BF16
        if (bf16_dot) {
            for (int64_t h = h0; h < h1; h++) {
                const uint16_t *rows[TILE];
                for (int i = 0; i < TILE; i++) rows[i] = (const uint16_t *)(tok[i] + h * a->k_sh * esz);
                for (int64_t i = i_lo; i < nq; i++)
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t j = (h - h0) * G + g, r = i * Rh + j;
                        const uint16_t *qr = (const uint16_t *)a->q + (row0 + i) * a->q_st + (h0 * G + j) * a->q_sh;
                        dot16_bf16(qr, rows, D, a->scale, s + r * n_pad + (t0 - start));
                        spread_prefetch_step(&pf);
                    }
            }
            continue;
        }
#endif
        for (int64_t h = h0; h < h1; h++) {
            const float *rows[TILE];
            tile_rows(tok, TILE, h * a->k_sh * esz, D, a->kv, rowbuf, rows);
            for (int64_t i = i_lo; i < nq; i++)
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = i * Rh + (h - h0) * G + g;
                    dot16(qf + r * D, rows, D, s + r * n_pad + (t0 - start));
                    spread_prefetch_step(&pf);
                }
        }
    }
    float inv[R];
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = pos0 + r / Rh + 1 - start;
        float *sr = s + r * n_pad;
        if (a->softcap > 0.0f)
            for (int64_t i = 0; i < n; i++) sr[i] = a->softcap * tanhf(sr[i] / a->softcap);
        inv[r] = softmax_inplace(sr, n, a->sinks != NULL, a->sinks ? a->sinks[h0 * G + r % Rh] : 0.0f) * a->vscale;
    }
    /* acc[r] = sum_t p[r][t] * v[t], 16 values at a time: acc[r] is loaded and stored once per tile */
    memset(acc, 0, sizeof(float) * R * Dv);
    for (int64_t t0 = start; t0 < L; t0 += TILE) {
        const int cnt = L - t0 < TILE ? (int)(L - t0) : TILE;
        const char *tok[TILE];
        for (int i = 0; i < cnt; i++) {
            const int64_t t = t0 + i;
            tok[i] = (const char *)a->v + ((int64_t)bt[t / BS] * a->v_sblk + (t % BS) * a->v_sslot) * esz;
        }
        const int64_t i_lo = t0 > pos0 ? t0 - pos0 : 0;
        SpreadPrefetch pf;
        spread_prefetch_init(&pf, (const char *)a->v, bt, t0 + PF_TILES * TILE, L, BS, a->v_sblk, a->v_sslot,
                             h0 * a->v_sh, esz, v_span, (nq - i_lo) * Rh);
        for (int64_t h = h0; h < h1; h++) {
            const float *rows[TILE];
            tile_rows(tok, cnt, h * a->v_sh * esz, Dv, a->kv, rowbuf, rows);
            for (int64_t i = i_lo; i < nq; i++) {
                /* query i's keys in this tile: up to its own position, as in its decode row */
                const int64_t end = pos0 + i + 1 - t0;
                const int cnt_i = end < cnt ? (int)end : cnt;
                for (int64_t g = 0; g < G; g++) {
                    const int64_t r = i * Rh + (h - h0) * G + g;
                    axpy_tile(acc + r * Dv, s + r * n_pad + (t0 - start), rows, cnt_i, Dv);
                    spread_prefetch_step(&pf);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t o_off = ((row0 + r / Rh) * a->Hq + h0 * G + r % Rh) * Dv;
        for (int64_t d = 0; d < Dv; d++) {
            const float x = acc[r * Dv + d] * inv[r];
            if (a->bf16)
                ((uint16_t *)a->out)[o_off + d] = f32_to_bf16(x);
            else
                ((float *)a->out)[o_off + d] = x;
        }
    }
}

#include "paged_attention_prefill.h"

/* grow a task's float buffer (64-byte aligned) to at least `need` elements; NULL (and *cap = 0)
 * when the allocation fails */
static float *reserve(float *buf, int64_t *cap, int64_t need) {
    if (need <= *cap) return buf;
    free(buf);
    void *p = NULL;
    if (posix_memalign(&p, 64, sizeof(float) * need)) p = NULL;
    *cap = p ? need : 0;
    return p;
}

static void zero_rows(const Args *a, int64_t tok, int64_t head0, int64_t n_heads) {
    const int64_t o = (tok * a->Hq + head0) * a->Dv, n = n_heads * a->Dv;
    if (a->bf16)
        memset((uint16_t *)a->out + o, 0, sizeof(uint16_t) * n);
    else
        memset((float *)a->out + o, 0, sizeof(float) * n);
}

/* A unit of work of a mixed batch: decode-structured rows (queries i0 .. i0 + nt - 1 of a sequence,
 * kv heads [h0, h1); a decode row is nt = 1) or a block of prefill rows (`block`). */
typedef struct {
    int64_t cost;
    int32_t b, h0, h1, i0, nt, block;
} Task;

static int by_cost_desc(const void *x, const void *y) {
    const int64_t cx = ((const Task *)x)->cost, cy = ((const Task *)y)->cost;
    return (cx < cy) - (cx > cy);
}

/* sequence b's query rows: cu[b] .. cu[b + 1] - 1, or row b alone when cu is NULL (decode only) */
static inline int64_t first_row(const Args *a, int64_t b) { return a->cu ? a->cu[b] : b; }
static inline int64_t n_rows(const Args *a, int64_t b) { return a->cu ? a->cu[b + 1] - a->cu[b] : 1; }

/* Any mix of decode rows and prefill chunks: one task list, most expensive first. A sequence with
 * at most EXTEND_AS_DECODE queries (a speculative verify of up to 31 proposed tokens, a short chunk)
 * runs decode-structured (`attend`): each of its rows is bit for bit what a decode step at that
 * position gives (batch invariance, tests/kernels/test_batch_invariance.py). Longer chunks run
 * `attend_block` (online softmax over 64-key steps). Returns TF_OK, or TF_ENOMEM when a buffer
 * could not be allocated (the tasks without one are skipped). */
static int run(const Args *a) {
    const int64_t G = a->Hq / a->Hkv;
    /* query tokens per block: enough rows (tokens x G heads) to reuse each key tile ~64 times */
    const int64_t nt_max = G >= 64 ? 1 : (64 / G < TILE ? 64 / G : TILE);
    int64_t n_dec = 0, n_blk = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t n = n_rows(a, b);
        if (n == 1 || (n > 1 && n <= EXTEND_AS_DECODE))
            n_dec += a->window > 0 ? n : 1; /* windowed rows start at different keys: one task each */
        else if (n > 1)
            n_blk += a->Hkv * ((n + nt_max - 1) / nt_max);
    }
    int64_t splits = 1;
    const int64_t want = 4 * (int64_t)omp_get_max_threads();
    /* a decode task reads each token's heads as one contiguous row; with few tasks the kv heads
     * of the decode rows are split so every thread has work */
    while (splits < a->Hkv && n_dec * splits + n_blk < want) splits++;
    const int64_t per = (a->Hkv + splits - 1) / splits;
    Task *tasks = malloc(sizeof(Task) * (n_dec * splits + n_blk + 1));
    if (!tasks) return TF_ENOMEM;
    int64_t n_tasks = 0;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t n = n_rows(a, b), L = a->ctx[b];
        if (n == 1 || (n > 1 && n <= EXTEND_AS_DECODE)) {
            const int64_t step = a->window > 0 ? 1 : n;
            for (int64_t i0 = 0; i0 < n; i0 += step)
                for (int64_t h0 = 0; h0 < a->Hkv; h0 += per) {
                    const int64_t h1 = h0 + per < a->Hkv ? h0 + per : a->Hkv;
                    const int64_t last = L - n + i0 + step; /* keys of the task's last query */
                    const int64_t keys = a->window > 0 && last > a->window ? a->window : last;
                    tasks[n_tasks++] = (Task){keys * (h1 - h0) * G * step, (int32_t)b, (int32_t)h0, (int32_t)h1,
                                              (int32_t)i0, (int32_t)step, 0};
                }
        } else if (n > 1) {
            for (int64_t i0 = 0; i0 < n; i0 += nt_max) {
                const int64_t nt = n - i0 < nt_max ? n - i0 : nt_max, last = L - n + i0 + nt - 1;
                const int64_t keys = a->window > 0 && last + 1 > a->window + nt ? a->window + nt : last + 1;
                for (int64_t h = 0; h < a->Hkv; h++)
                    tasks[n_tasks++] = (Task){keys * nt * G, (int32_t)b, (int32_t)h, (int32_t)h + 1, (int32_t)i0,
                                              (int32_t)nt, 1};
            }
        }
    }
    qsort(tasks, n_tasks, sizeof(Task), by_cost_desc);
    const int64_t rowbuf = TILE * (a->D > a->Dv ? a->D : a->Dv);
    int failed = 0;
    /* small work (a few decode rows over short contexts) runs on this thread: waking the team costs
     * more than it saves, and on a busy machine a preempted thread holds the barrier for a time slice */
    int64_t work = 0;
    for (int64_t i = 0; i < n_tasks; i++) work += tasks[i].cost * (a->D + a->Dv);
#pragma omp parallel num_threads(tf_nthreads()) if (work >= ((int64_t)1 << 20))
    {
        float *buf = NULL;
        int64_t cap = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_tasks; i++) {
            const Task *t = &tasks[i];
            const int64_t n = n_rows(a, t->b), tok = first_row(a, t->b) + t->i0, L = a->ctx[t->b];
            const int64_t pos0 = L - n + t->i0;
            if (!t->block) {
                const int64_t R = (int64_t)t->nt * (t->h1 - t->h0) * G, keys = pos0 + t->nt;
                if (keys <= 0) { /* a decode row over an empty context (wrapper checks keep extends >= 1) */
                    zero_rows(a, tok, t->h0 * G, R);
                    continue;
                }
                buf = reserve(buf, &cap, lines(R * a->D) + lines(R * a->Dv) + R * lines(keys) + rowbuf);
                if (!buf) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                attend(a, t->b, tok, pos0, t->nt, t->h0, t->h1, buf);
            } else {
                const int64_t rows = t->nt * G;
                buf = reserve(buf, &cap, rows * (a->D + a->Dv + KSTEP + 2) + KSTEP * (a->D + a->Dv));
                if (!buf) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
                attend_block(a, t->b, tok, pos0, t->nt, t->h0, buf);
            }
        }
        free(buf);
    }
    free(tasks);
    return failed ? TF_ENOMEM : TF_OK;
}

#define ENTRY(NAME, IS_BF16)                                                                                  \
    int NAME(const void *q, const void *k, const void *v, const int32_t *table, const int32_t *cu,           \
              const int32_t *ctx, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,       \
              int64_t BS, int64_t q_st, int64_t q_sh, int64_t k_sblk, int64_t k_sslot, int64_t k_sh,          \
              int64_t v_sblk, int64_t v_sslot, int64_t v_sh, int64_t bt_s, float scale, int64_t window,       \
              float softcap, const float *sinks) {                                                            \
        Args a = {q,    k,      v,       table, cu,      ctx,  out,    B,      Hq,      Hkv,  D,  Dv,  BS,     \
                  q_st, q_sh,   k_sblk,  k_sslot, k_sh,  v_sblk, v_sslot, v_sh, bt_s,    scale, softcap,      \
                  window, sinks, IS_BF16, IS_BF16 ? KV_BF16 : KV_F32, 1.0f};                                  \
        return run(&a);                                                                                       \
    }

ENTRY(paged_attention_f32, 0)
ENTRY(paged_attention_bf16, 1)

/* The same over float8 e4m3 caches: k_scale / v_scale point to the float32 scales (a read is
 * e4m3 * scale); k_scale is folded into the softmax scale, v_scale into the output. */
#define ENTRY_FP8(NAME, IS_BF16)                                                                              \
    int NAME(const void *q, const void *k, const void *v, const int32_t *table, const int32_t *cu,           \
              const int32_t *ctx, void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv,       \
              int64_t BS, int64_t q_st, int64_t q_sh, int64_t k_sblk, int64_t k_sslot, int64_t k_sh,          \
              int64_t v_sblk, int64_t v_sslot, int64_t v_sh, int64_t bt_s, float scale, int64_t window,       \
              float softcap, const float *sinks, const float *k_scale, const float *v_scale) {                \
        Args a = {q,    k,      v,       table, cu,      ctx,  out,    B,      Hq,      Hkv,  D,  Dv,  BS,     \
                  q_st, q_sh,   k_sblk,  k_sslot, k_sh,  v_sblk, v_sslot, v_sh, bt_s,    scale * *k_scale,    \
                  softcap, window, sinks, IS_BF16, KV_E4M3, *v_scale};                                        \
        return run(&a);                                                                                       \
    }

ENTRY_FP8(paged_attention_f32_fp8kv, 0)
ENTRY_FP8(paged_attention_bf16_fp8kv, 1)
