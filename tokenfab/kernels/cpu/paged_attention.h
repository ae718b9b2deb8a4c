/* Paged attention (paged_attention.c): the shared definitions: task arguments, cache element kinds. */
#ifndef TOKENFAB_PAGED_ATTENTION_H
#define TOKENFAB_PAGED_ATTENTION_H
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* PF_TILES: how many 16-token tiles ahead the next rows are prefetched. The prefetches of one
 * tile are spread over the dot products (or value updates) of the current one: issued in one
 * burst, ~200 of them stall the core once its fill buffers are full (perf showed half the
 * kernel's time on the prefetch loop); spread out, the kernel reads ~10% faster. */
enum { TILE = 16, PF_TILES = 2 };
/* keys per step of a prefill block: one softmax update (max, exp, rescale) per 64 keys */
enum { KSTEP = 4 * TILE };
/* the most queries of one sequence that run decode-structured (see run) */
enum { EXTEND_AS_DECODE = 32 };

typedef struct {
    const void *q, *k, *v;
    const int32_t *table, *cu, *ctx;
    void *out;
    int64_t B, Hq, Hkv, D, Dv, BS;
    int64_t q_st, q_sh, k_sblk, k_sslot, k_sh, v_sblk, v_sslot, v_sh, bt_s;
    float scale, softcap;
    int64_t window;
    const float *sinks;
    int bf16;   /* q and out are bfloat16 (else float32) */
    int kv;     /* cache element kind: KV_F32, KV_BF16 or KV_E4M3 */
    float vscale; /* the value cache's scale (1 unless fp8) */
} Args;

enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2 };

/* bytes of one cache element */
static inline int64_t kv_esz(const Args *a) { return a->kv == KV_E4M3 ? 1 : a->kv == KV_BF16 ? 2 : 4; }

#endif
