/* The int8-activation mode (act="q8") on AMX-INT8 tiles, and the AMX probe.
 *
 * Bit for bit the VNNI path's result (ggml_q8.c; same for its AVX2 and scalar twins):
 *  - the activations are quantized by the very same function (ggml_quantize_rows_q8);
 *  - each 32-block's integer dot product is one TDPBSSD (signed x signed bytes, exact int32 sums,
 *    as vpdpbusd's): a tile of 16 activation rows x 32 bytes (one block) times a tile of 8 x 64
 *    bytes holding the block's 32 weights of 16 weight rows in the VNNI layout (row kk, bytes
 *    4n .. 4n + 3 = weights 4kk .. 4kk + 3 of weight row n). Q8_0 bytes as stored, Q4_0 nibbles
 *    - 8, Q4_1 bare nibbles (0..15): all fit signed bytes, so no +128 offset (TDPBUSD) and no
 *    compensation term are needed. The tile depth is one block (32 bytes, half of AMX's 64), so
 *    every block's sum stays apart and K need only be a multiple of 32;
 *  - the block terms are formed and summed in float32 exactly as there (ggml_q8.c, top):
 *    t = dot * (d_w * d_x) (Q4_1: t = t + m_w * (d_x * sum(q_x))), added in block order; no FMA
 *    contraction, no reassociation (Q8_EXACT).
 * A thread takes 16 weight rows at a time, expands their blocks once into tiles (the panel), and
 * passes every 16-row activation tile over them.
 *
 * Built with __attribute__((target("amx-tile,amx-int8"))) whatever -march says (GCC >= 11 on
 * x86-64; elsewhere the functions are stubs and ggml_amx_built() is 0). Run only where
 * ggml_matmul.py allows it: the probe (in a child process: some VMs report AMX and then fault),
 * ggml_amx_enable() in this process, then a known-answer self-test against the VNNI path.
 * TF_AMX_EMULATE builds the same kernel with the tile instructions done in plain C, so machines
 * without AMX test its layout and float order (tests/kernels/test_amx.py).
 */
#define _GNU_SOURCE /* syscall() for the AMX permission request */
#include "ggml_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && (__GNUC__ >= 11)
#define TF_AMX_BUILT 1
#else
#define TF_AMX_BUILT 0
#endif

#define Q8_EXACT __attribute__((optimize("no-fast-math", "fp-contract=off")))
#define TM 16      /* activation rows per tile */
#define TN 16      /* weight rows per tile (the result tile's 16 int32 columns) */
#define TILE_B 512 /* bytes of one block's weight tile: 8 rows x 64 */

#if defined(TF_AMX_EMULATE)
/* the tile registers and the four instructions in C, following their definitions */
#define AMX_TARGET
static __thread uint8_t emu_tile[8][16][64];
static __thread uint8_t emu_cfg[64];
AI int emu_rows(int t) { return emu_cfg[48 + t]; }
AI int emu_colsb(int t) { return emu_cfg[16 + 2 * t] | (emu_cfg[17 + 2 * t] << 8); }
static void emu_loadd(int t, const void *p, int64_t stride) {
    for (int r = 0; r < emu_rows(t); r++) memcpy(emu_tile[t][r], (const uint8_t *)p + r * stride, emu_colsb(t));
}
static void emu_stored(int t, void *p, int64_t stride) {
    for (int r = 0; r < emu_rows(t); r++) memcpy((uint8_t *)p + r * stride, emu_tile[t][r], emu_colsb(t));
}
static void emu_dpbssd(int c, int a, int b) {
    for (int m = 0; m < emu_rows(c); m++)
        for (int n = 0; n < emu_colsb(c) / 4; n++) {
            int32_t acc;
            memcpy(&acc, &emu_tile[c][m][4 * n], 4);
            for (int kk = 0; kk < emu_colsb(a) / 4; kk++)
                for (int i = 0; i < 4; i++)
                    acc += (int32_t)(int8_t)emu_tile[a][m][4 * kk + i] * (int8_t)emu_tile[b][kk][4 * n + i];
            memcpy(&emu_tile[c][m][4 * n], &acc, 4);
        }
}
#define TILE_LOADCONFIG(c) memcpy(emu_cfg, (c), 64)
#define TILE_LOADD(t, p, s) emu_loadd(t, p, s)
#define TILE_STORED(t, p, s) emu_stored(t, p, s)
#define TILE_ZERO(t) memset(emu_tile[t], 0, sizeof emu_tile[t])
#define TILE_DPBSSD(c, a, b) emu_dpbssd(c, a, b)
#define TILE_RELEASE() memset(emu_cfg, 0, 64)
#define TF_AMX_KERNEL 1
#elif TF_AMX_BUILT
#define AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#define TILE_LOADCONFIG(c) _tile_loadconfig(c)
#define TILE_LOADD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORED(t, p, s) _tile_stored(t, p, s)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_RELEASE() _tile_release()
#define TF_AMX_KERNEL 1
#else
#define TF_AMX_KERNEL 0
#endif

#define XFEATURE_XTILEDATA 18
#define ARCH_REQ_XCOMP_PERM 0x1023

/* 1: this library holds the AMX kernel (real tile instructions, or emulated: 2) */
int ggml_amx_built(void) {
#if defined(TF_AMX_EMULATE)
    return 2;
#else
    return TF_AMX_KERNEL;
#endif
}

#if TF_AMX_BUILT
/* 0: AMX tiles usable (the kernel granted XTILEDATA and a tile instruction ran); 1: the CPU does
 * not report AMX-TILE and AMX-INT8; 2: the OS has not enabled the tile state in XCR0; 3:
 * arch_prctl(ARCH_REQ_XCOMP_PERM) refused. A VM may report the flags and still fault on the first
 * tile instruction (SIGILL): call this in a child process. */
__attribute__((target("amx-tile"))) int ggml_amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 1;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 2; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 2; /* XTILECFG, XTILEDATA */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 3;
    uint8_t cfg[64] = {0};
    cfg[0] = 1;   /* palette 1 */
    cfg[16] = 64; /* tile 0: 64 bytes a row */
    cfg[48] = 16; /* 16 rows */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}

#else
int ggml_amx_probe(void) { return 1; }
#endif

/* Ask the kernel for the tile data state in this process (all its threads; Linux >= 5.16): 0 when
 * granted, 3 when refused, 1 without AMX in this build. The probe ran in a child process, whose
 * permission this one does not have. */
int ggml_amx_enable(void) {
#if defined(TF_AMX_EMULATE)
    return 0;
#elif TF_AMX_BUILT
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : 3;
#else
    return 1;
#endif
}

#if TF_AMX_KERNEL
/* the 32 weights of a block as signed bytes (Q8_0: q; Q4_0: q - 8; Q4_1: the bare nibbles) */
AI void block_i8(int qt, const uint8_t *blk, int8_t *out) {
    if (qt == GQ8_0) {
        memcpy(out, blk + 2, 32);
        return;
    }
    const uint8_t *p = blk + (qt == GQ4_1 ? 4 : 2);
    const int off = qt == GQ4_0 ? 8 : 0;
    for (int i = 0; i < 16; i++) {
        out[i] = (int8_t)((p[i] & 15) - off);
        out[i + 16] = (int8_t)((p[i] >> 4) - off);
    }
}

/* weight rows n0 .. n0 + nt - 1 (nt <= 16) as nb weight tiles (zero columns past nt) and their
 * scales dw[b * TN + n] (Q4_1 also mw) as floats */
static void pack_panel(int qt, const uint8_t *w, int64_t rb, int64_t n0, int nt, int64_t nb, uint8_t *panel,
                       float *dw, float *mw) {
    const int64_t bb = BLOCK_BYTES[qt];
    if (nt < TN) {
        memset(panel, 0, (size_t)(nb * TILE_B));
        memset(dw, 0, sizeof(float) * (size_t)(nb * TN));
        memset(mw, 0, sizeof(float) * (size_t)(nb * TN));
    }
    for (int n = 0; n < nt; n++) {
        const uint8_t *wr = w + (n0 + n) * rb;
        for (int64_t b = 0; b < nb; b++) {
            int8_t q[32];
            block_i8(qt, wr + b * bb, q);
            uint8_t *t = panel + b * TILE_B;
            for (int kk = 0; kk < 8; kk++) memcpy(t + kk * 64 + n * 4, q + kk * 4, 4);
            dw[b * TN + n] = half_to_float(wr + b * bb);
            mw[b * TN + n] = qt == GQ4_1 ? half_to_float(wr + b * bb + 2) : 0.0f;
        }
    }
}

/* tile 0: activations (16 rows x 32 bytes), 1: weights (8 x 64), 2: the int32 sums (16 x 64) */
AMX_TARGET static void amx_configure(void) {
    uint8_t cfg[64] = {0};
    cfg[0] = 1; /* palette 1 */
    cfg[16] = 32;
    cfg[48] = TM;
    cfg[18] = 64;
    cfg[49] = 8;
    cfg[20] = 64;
    cfg[50] = TM;
    TILE_LOADCONFIG(cfg);
}

AMX_TARGET static void amx_release(void) { TILE_RELEASE(); }

/* out rows [0, mt) x columns [0, nt) of one 16 x 16 tile; qm holds 16 readable activation rows */
Q8_EXACT AMX_TARGET __attribute__((noinline)) static void amx_tile(int qt, int mt, int nt, const int8_t *qm,
                                                                    const float *dm, const int32_t *sm, int64_t K,
                                                                    const uint8_t *panel, const float *dw,
                                                                    const float *mw, float *out, int64_t N) {
    const int64_t nb = K / 32;
    float acc[TM][TN];
    int32_t c[TM][TN];
    memset(acc, 0, sizeof acc); /* +0.0: the VNNI path's zeroed accumulators */
    for (int64_t b = 0; b < nb; b++) {
        TILE_LOADD(0, qm + b * 32, K);
        TILE_LOADD(1, panel + b * TILE_B, 64);
        TILE_ZERO(2);
        TILE_DPBSSD(2, 0, 1);
        TILE_STORED(2, c, 64);
        const float *dwb = dw + b * TN, *mwb = mw + b * TN;
        for (int m = 0; m < mt; m++) {
            const float dx = dm[m * nb + b], mdx = dx * (float)sm[m * nb + b];
            for (int n = 0; n < nt; n++) {
                float t = (float)c[m][n] * (dwb[n] * dx);
                if (qt == GQ4_1) t = t + mwb[n] * mdx;
                acc[m][n] = acc[m][n] + t;
            }
        }
    }
    for (int m = 0; m < mt; m++)
        for (int n = 0; n < nt; n++) out[m * N + n] = acc[m][n];
}

/* x [M, K] quantized per 32-block to int8 (as ggml_matmul_q8), the block products on AMX tiles */
int ggml_matmul_q8_amx(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    const int64_t nb = K / 32, rb = nb * BLOCK_BYTES[qt], mp = (M + TM - 1) / TM * TM;
    q8_acts a;
    if (q8_acts_quantize(x, M, K, mp * K, &a) != TF_OK) /* rows M .. mp - 1 stay 0: whole tiles load */
        return TF_ENOMEM;
    int8_t *q = a.q;
    float *d = a.d;
    int32_t *sq = a.sq;
    const int64_t chunks = (N + TN - 1) / TN;
    int rc = TF_OK;
#pragma omp parallel num_threads(tf_nthreads()) if (N * K * M >= PAR_MIN_WORK)
    {
        uint8_t *panel = malloc((size_t)(nb * TILE_B));
        float *dw = malloc(sizeof(float) * (size_t)(nb * TN)), *mw = malloc(sizeof(float) * (size_t)(nb * TN));
        const int ok = panel && dw && mw;
        if (ok) amx_configure(); /* the tile configuration is per thread */
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (!ok) {
#pragma omp atomic write
                rc = TF_ENOMEM;
                continue;
            }
            const int64_t n0 = c * TN;
            const int nt = N - n0 < TN ? (int)(N - n0) : TN;
            pack_panel(qt, w, rb, n0, nt, nb, panel, dw, mw);
            for (int64_t m0 = 0; m0 < M; m0 += TM) {
                const int mt = M - m0 < TM ? (int)(M - m0) : TM;
                amx_tile(qt, mt, nt, q + m0 * K, d + m0 * nb, sq + m0 * nb, K, panel, dw, mw, out + m0 * N + n0, N);
            }
        }
        if (ok) amx_release();
        free(panel);
        free(dw);
        free(mw);
    }
    free(q); /* (and d, sq: one allocation) */
    return rc;
}
#else
/* no AMX kernel in this build (ggml_amx_built() is 0): never called */
int ggml_matmul_q8_amx(const float *x, const uint8_t *w, int64_t M, int64_t N, int64_t K, int qt, float *out) {
    (void)x, (void)w, (void)M, (void)N, (void)K, (void)qt, (void)out;
    return 2;
}
#endif
