/* Paged attention (paged_attention.c): prefill blocks (`attend_block`): up to 16 query tokens of one kv
 * head's GQA group against 16-key tiles, one pass with an online softmax. Included once, by
 * paged_attention.c. */
#ifndef TOKENFAB_PAGED_ATTENTION_PREFILL_H
#define TOKENFAB_PAGED_ATTENTION_PREFILL_H
#include "paged_attention_vec.h"

/* One row's scores sr[0..KSTEP) of a key step, valid for j in [j_lo, j_hi): softcapped, turned into
 * numerators under the row's running maximum *m (0 outside the valid range); *l and the
 * row's value accumulator acc are rescaled when the maximum grows. */
static inline void online_softmax_step(float *sr, int j_lo, int j_hi, float softcap, float *m, float *l, float *acc,
                                       int64_t Dv) {
    if (softcap > 0.0f)
        for (int j = j_lo; j < j_hi; j++) sr[j] = softcap * tanhf(sr[j] / softcap);
    float mt = *m;
#pragma omp simd reduction(max : mt)
    for (int j = 0; j < KSTEP; j++) {
        const float x = (j >= j_lo && j < j_hi) ? sr[j] : -FLT_MAX;
        mt = x > mt ? x : mt;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < KSTEP; j++) {
        const float p = (j >= j_lo && j < j_hi) ? expf(sr[j] - mt) : 0.0f;
        sr[j] = p;
        sum += p;
    }
    if (mt > *m) {
        const float alpha = expf(*m - mt);
        *l *= alpha;
        for (int64_t d = 0; d < Dv; d++) acc[d] *= alpha;
        *m = mt;
    }
    *l += sum;
}

/* axpy_tile for two rows at once (any cnt up to KSTEP) (acc0 with p0, acc1 with p1): each value row is loaded once
 * for both, and eight accumulators keep both FMA pipes busy. */
static inline void axpy_rows2(float *acc0, float *acc1, const float *p0, const float *p1, const float *const *rows,
                              int cnt, int64_t Dv) {
    if (cnt <= 0) return;
    int64_t c = 0;
#if TF_AVX512
    for (; c + 64 <= Dv; c += 64) {
        __m512 a0 = _mm512_loadu_ps(acc0 + c), a1 = _mm512_loadu_ps(acc0 + c + 16);
        __m512 a2 = _mm512_loadu_ps(acc0 + c + 32), a3 = _mm512_loadu_ps(acc0 + c + 48);
        __m512 b0 = _mm512_loadu_ps(acc1 + c), b1 = _mm512_loadu_ps(acc1 + c + 16);
        __m512 b2 = _mm512_loadu_ps(acc1 + c + 32), b3 = _mm512_loadu_ps(acc1 + c + 48);
        for (int i = 0; i < cnt; i++) {
            const __m512 pa = _mm512_set1_ps(p0[i]), pb = _mm512_set1_ps(p1[i]);
            const float *row = rows[i] + c;
            const __m512 v0 = _mm512_loadu_ps(row), v1 = _mm512_loadu_ps(row + 16);
            const __m512 v2 = _mm512_loadu_ps(row + 32), v3 = _mm512_loadu_ps(row + 48);
            a0 = _mm512_fmadd_ps(pa, v0, a0);
            a1 = _mm512_fmadd_ps(pa, v1, a1);
            a2 = _mm512_fmadd_ps(pa, v2, a2);
            a3 = _mm512_fmadd_ps(pa, v3, a3);
            b0 = _mm512_fmadd_ps(pb, v0, b0);
            b1 = _mm512_fmadd_ps(pb, v1, b1);
            b2 = _mm512_fmadd_ps(pb, v2, b2);
            b3 = _mm512_fmadd_ps(pb, v3, b3);
        }
        _mm512_storeu_ps(acc0 + c, a0);
        _mm512_storeu_ps(acc0 + c + 16, a1);
        _mm512_storeu_ps(acc0 + c + 32, a2);
        _mm512_storeu_ps(acc0 + c + 48, a3);
        _mm512_storeu_ps(acc1 + c, b0);
        _mm512_storeu_ps(acc1 + c + 16, b1);
        _mm512_storeu_ps(acc1 + c + 32, b2);
        _mm512_storeu_ps(acc1 + c + 48, b3);
    }
#elif TF_AVX2
    for (; c + 32 <= Dv; c += 32) { /* 8 accumulators: 4 per row */
        __m256 a0 = _mm256_loadu_ps(acc0 + c), a1 = _mm256_loadu_ps(acc0 + c + 8);
        __m256 a2 = _mm256_loadu_ps(acc0 + c + 16), a3 = _mm256_loadu_ps(acc0 + c + 24);
        __m256 b0 = _mm256_loadu_ps(acc1 + c), b1 = _mm256_loadu_ps(acc1 + c + 8);
        __m256 b2 = _mm256_loadu_ps(acc1 + c + 16), b3 = _mm256_loadu_ps(acc1 + c + 24);
        for (int i = 0; i < cnt; i++) {
            const __m256 pa = _mm256_set1_ps(p0[i]), pb = _mm256_set1_ps(p1[i]);
            const float *row = rows[i] + c;
            const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
            const __m256 v2 = _mm256_loadu_ps(row + 16), v3 = _mm256_loadu_ps(row + 24);
            a0 = _mm256_fmadd_ps(pa, v0, a0);
            a1 = _mm256_fmadd_ps(pa, v1, a1);
            a2 = _mm256_fmadd_ps(pa, v2, a2);
            a3 = _mm256_fmadd_ps(pa, v3, a3);
            b0 = _mm256_fmadd_ps(pb, v0, b0);
            b1 = _mm256_fmadd_ps(pb, v1, b1);
            b2 = _mm256_fmadd_ps(pb, v2, b2);
            b3 = _mm256_fmadd_ps(pb, v3, b3);
        }
        _mm256_storeu_ps(acc0 + c, a0);
        _mm256_storeu_ps(acc0 + c + 8, a1);
        _mm256_storeu_ps(acc0 + c + 16, a2);
        _mm256_storeu_ps(acc0 + c + 24, a3);
        _mm256_storeu_ps(acc1 + c, b0);
        _mm256_storeu_ps(acc1 + c + 8, b1);
        _mm256_storeu_ps(acc1 + c + 16, b2);
        _mm256_storeu_ps(acc1 + c + 24, b3);
    }
#endif
    if (c < Dv) {
        const float *tail[KSTEP];
        for (int i = 0; i < cnt; i++) tail[i] = rows[i] + c;
        axpy_tile(acc0 + c, p0, tail, cnt, Dv - c);
        axpy_tile(acc1 + c, p1, tail, cnt, Dv - c);
    }
}

/* Query tokens tok0 .. tok0 + nt - 1 of sequence b, at positions pos0 .. pos0 + nt - 1, with
 * the G query heads of kv head h: rows r = i * G + g. Each 16-key tile of the cache is read once
 * (widened once if bf16) and serves all R rows; an online softmax keeps one running maximum and
 * denominator per row. buf: qf [R][D], acc [R][Dv], s [R][TILE], m [R], l [R], kbuf, vbuf. */
static void attend_block(const Args *a, int64_t b, int64_t tok0, int64_t pos0, int64_t nt, int64_t h, float *buf) {
    const int64_t G = a->Hq / a->Hkv, D = a->D, Dv = a->Dv, BS = a->BS, R = nt * G;
    const int32_t *bt = a->table + b * a->bt_s;
    const int64_t esz = a->bf16 ? 2 : 4, cesz = kv_esz(a), last = pos0 + nt - 1;
    float *qf = buf, *acc = qf + R * D, *s = acc + R * Dv, *m = s + R * KSTEP, *l = m + R;
    float *kbuf = l + R, *vbuf = kbuf + KSTEP * D;
    for (int64_t i = 0; i < nt; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g, head = h * G + g;
            load_row((const char *)a->q + ((tok0 + i) * a->q_st + head * a->q_sh) * esz, a->bf16, qf + r * D, D);
            for (int64_t d = 0; d < D; d++) qf[r * D + d] *= a->scale;
            m[r] = a->sinks ? a->sinks[head] : -FLT_MAX;
            l[r] = a->sinks ? 1.0f : 0.0f; /* the sink's exp(sink - m) with m = sink */
        }
    memset(acc, 0, sizeof(float) * R * Dv);
    const int64_t lo = (a->window > 0 && pos0 - a->window + 1 > 0) ? pos0 - a->window + 1 : 0;
    for (int64_t t0 = lo / TILE * TILE; t0 <= last; t0 += KSTEP) {
        const int cnt = last + 1 - t0 < KSTEP ? (int)(last + 1 - t0) : KSTEP;
        const int n16 = (cnt + TILE - 1) / TILE * TILE;
        const char *ktok[KSTEP], *vtok[KSTEP];
        for (int i = 0; i < n16; i++) {
            const int64_t t = i < cnt ? t0 + i : last; /* the tail repeats a valid row */
            const int64_t blk = bt[t / BS], slot = t % BS;
            ktok[i] = (const char *)a->k + (blk * a->k_sblk + slot * a->k_sslot + h * a->k_sh) * cesz;
            vtok[i] = (const char *)a->v + (blk * a->v_sblk + slot * a->v_sslot + h * a->v_sh) * cesz;
        }
        const float *krows[KSTEP], *vrows[KSTEP];
        tile_rows(ktok, n16, 0, D, a->kv, kbuf, krows);
        tile_rows(vtok, cnt, 0, Dv, a->kv, vbuf, vrows); /* value rows past cnt are never read */
        int j_end[2] = {0, 0};
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * KSTEP;
            const int64_t pos = pos0 + r / G;
            const int64_t first = a->window > 0 ? pos - a->window + 1 : 0;
            /* keys t0 + j with first <= t0 + j <= pos (j < cnt follows: t0 + cnt - 1 = min(last, ...)) */
            const int j_lo = first > t0 ? (int)(first - t0) : 0;
            const int j_hi = pos - t0 + 1 < cnt ? (int)(pos - t0 + 1) : cnt;
            for (int j = 0; j < j_hi; j += TILE) dot16(qf + r * D, krows + j, D, sr + j);
            j_end[r & 1] = j_hi > j_lo ? j_hi : 0;
            online_softmax_step(sr, j_lo, j_hi, a->softcap, &m[r], &l[r], acc + r * Dv, Dv);
            /* values: rows in pairs share each value load */
            if (r & 1)
                axpy_rows2(acc + (r - 1) * Dv, acc + r * Dv, sr - KSTEP, sr, vrows,
                           j_end[0] > j_end[1] ? j_end[0] : j_end[1], Dv);
            else if (r == R - 1 && j_end[0])
                axpy_tile(acc + r * Dv, sr, vrows, j_end[0], Dv);
        }
    }
    for (int64_t i = 0; i < nt; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g;
            const float inv = a->vscale / l[r];
            for (int64_t d = 0; d < Dv; d++) acc[r * Dv + d] *= inv;
            store_row(acc + r * Dv, a->bf16, (char *)a->out + (((tok0 + i) * a->Hq + h * G + g) * Dv) * esz, Dv);
        }
}

#endif
