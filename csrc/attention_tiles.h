/*
 * The tile primitives of the attention kernels (private): attention.c's
 * forward and backward, attention_probs.c's probabilities and entropy and
 * attention_decode.c's decode are built from these, so that each computes
 * a score, a probability and a sum in the same operations, in the same
 * order.
 *
 * Each (b, h) is a handful of small matrix products, computed by three
 * register-tiled kernels on 16-lane vectors (vec16f). In each, one lane
 * owns one output element and sums its terms one fused multiply-add at a
 * time, in ascending order of the summed index, starting from a fixed
 * value. So an element's arithmetic depends on the shapes alone: not on the
 * tile it falls in, the tile size, or the thread that runs it.
 *
 *   score_tile  S[t, t2] = bias + sum_i  A[t, i] * Kt[i, t2]    (i ascending)
 *               keys in the lanes, 8 query rows x 32 keys a tile; Kt is a
 *               "key panel": the key rows transposed into blocks of 16
 *               keys, [hs][16] each, zero past the last key
 *   rows_tile   O[t, c] (+)= sum_t2 A[t, t2] * X[t2, c]    (t2 ascending,
 *               t2 <= t); channels in the lanes, 4 rows x 64 channels a tile
 *   cols_tile   O[t2, c] += sum_t A[t, t2] * X[t, c]       (t ascending,
 *               t >= t2); channels in the lanes, 4 keys x 64 channels a tile
 *
 * (Those are AVX-512's tiles, which its 32 registers hold; AVX2's 16 run
 * them in smaller blocks and chunks: score_block_rows, tile_channels.)
 *
 * The causal triangle is kept exact: a tile runs the terms all its rows
 * share, then the few that only its later rows (or earlier keys) have, so no
 * masked entry is ever read or added.
 *
 * Beside them, the row primitives softmax_row_body and probs_row_body: P =
 * exp(s - max) * inv by the same vector operations in both, so the
 * probabilities recomputed from a row's saved max and inv are bitwise the
 * forward's; and dscore_tile, the backward through the softmax. The
 * softmax primitives take the variant's isa for llmc_exp_nonpositive16_isa
 * (isa.h): bitwise llmc_exp_nonpositive16 on every instruction set, in about
 * half the instructions on AVX-512.
 * Bodies only: a file builds the per-ISA variants of those it calls
 * (LLMC_ISA_VARIANTS / _ISA, isa.h) from these, with the same flags, so every
 * file runs the same code.
 */
#ifndef LLMC_ATTENTION_TILES_H
#define LLMC_ATTENTION_TILES_H

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "llmc.h"
#include "common.h"
#include "isa.h"

#define SCORE_ROWS 8    /* query rows of a score_tile, and of the forward's and
                           backward's row tiles: a multiple of TILE_ROWS */
#define TILE_ROWS 4     /* query rows of a rows_tile */
#define TILE_KEYS 4     /* key rows of a cols_tile */
#define TILE_CH 64      /* channels of a rows_tile / cols_tile: 4 vectors */

#define ALWAYS_INLINE LLMC_ALWAYS_INLINE

/* Fully unrolls a loop over a tile's rows or vectors, so that the tile's
   accumulators can live in registers. */
#define UNROLL _Pragma("GCC unroll 16")

/* Loads / stores the first m lanes (all 16 when m >= 16; the rest load as
   0): a masked load or store when the build's flags have AVX-512 (then
   every per-ISA variant has it), else a copy through memory. A body built
   per instruction set cannot call an AVX-512 intrinsic only in its AVX-512
   variant, so a portable build's AVX-512 variant copies too. */
#ifdef __AVX512F__
static ALWAYS_INLINE __mmask16 first_lanes(int m) {
    return m >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1u);
}
static ALWAYS_INLINE vec16f load_part(const float* p, int m) {
    return (vec16f)_mm512_maskz_loadu_ps(first_lanes(m), p);
}
static ALWAYS_INLINE void store_part(float* p, vec16f v, int m) {
    _mm512_mask_storeu_ps(p, first_lanes(m), (__m512)v);
}
#else
static ALWAYS_INLINE vec16f load_part(const float* p, int m) {
    return m >= 16 ? llmc_load16(p, 16) : llmc_load16(p, m);
}
static ALWAYS_INLINE void store_part(float* p, vec16f v, int m) {
    if (m >= 16) { llmc_store16(p, v, 16); } else { llmc_store16(p, v, m); }
}
#endif

/* A vector loaded once and used by a whole row of a tile: kept in a
   register. Left alone, GCC folds the load into every FMA that uses it, and
   the repeated loads, not the FMAs, then bound the loop. (Only with AVX-512
   in the build's flags, as above: a 16-float vector is one register only
   there.) */
#if defined(__GNUC__) && defined(__AVX512F__)
#define KEEP_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define KEEP_IN_REGISTER(x) ((void)0)
#endif

/* Half a vec16f: 8 lanes, one ymm register on AVX2 (two xmm on SSE).
   Without AVX-512 in the build's flags, GCC 12 keeps no vec16f sum of a
   tile in registers across its loop of FMAs: it stores every sum to the
   stack after each FMA and moves it back through 64-bit general registers.
   The sub-tiles of AVX2 and the portable build hold their sums as halves
   instead (1.7-2.5x faster on Zen 1); each lane's operations and their
   order are the same. */
typedef float half16f __attribute__((vector_size(32)));
typedef uint32_t half16u __attribute__((vector_size(32)));

static ALWAYS_INLINE void split16(vec16f v, half16f* lo, half16f* hi) {
    memcpy(lo, &v, sizeof *lo);
    memcpy(hi, (const char*)&v + sizeof *lo, sizeof *hi);
}
static ALWAYS_INLINE vec16f join16(half16f lo, half16f hi) {
    vec16f v;
    memcpy(&v, &lo, sizeof lo);
    memcpy((char*)&v + sizeof lo, &hi, sizeof hi);
    return v;
}
/* load_part's lanes as halves. */
static ALWAYS_INLINE void load_halves(const float* p, int m, half16f* lo, half16f* hi) {
    if (m >= 16) {
        memcpy(lo, p, sizeof *lo);
        memcpy(hi, p + 8, sizeof *hi);
    } else {
        split16(load_part(p, m), lo, hi);
    }
}

/* The sums of R rows of m (<= 16) channels, as halves: started from o's
   rows (ldo floats apart) or 0, added to, stored back. */
static ALWAYS_INLINE void start_halves(half16f* lo, half16f* hi, const float* o, size_t ldo,
                                       int accumulate, int R, int m) {
    UNROLL for (int r = 0; r < R; r++) {
        if (accumulate) {
            load_halves(o + (size_t)r * ldo, m, &lo[r], &hi[r]);
        } else {
            lo[r] = hi[r] = (half16f){0};
        }
    }
}
/* rows first .. end-1: sum[r] += a[r * lda] * the row x (m channels), one FMA a half */
static ALWAYS_INLINE void add_row_halves(half16f* lo, half16f* hi, const float* a, size_t lda,
                                         const float* x, int first, int end, int m) {
    half16f x_lo, x_hi;
    load_halves(x, m, &x_lo, &x_hi);
    UNROLL for (int r = first; r < end; r++) {
        const float a_r = a[(size_t)r * lda];
        lo[r] += a_r * x_lo;
        hi[r] += a_r * x_hi;
    }
}
static ALWAYS_INLINE void store_halves(float* o, size_t ldo, const half16f* lo,
                                       const half16f* hi, int R, int m) {
    UNROLL for (int r = 0; r < R; r++) {
        store_part(o + (size_t)r * ldo, join16(lo[r], hi[r]), m);
    }
}

/* The 16 x 16 block of keys k0 .. k0+15 (m of them real, the rest 0) and
   channels i0 .. i0+15 (ci real), transposed: r[ii] lane j = k[k0 + j][i0 + ii],
   times scale. The key panel and the decode's on-the-fly keys both come from
   here, so they hold the same values. */
static ALWAYS_INLINE void key_block(vec16f r[16], const float* k, size_t stride,
                                    int k0, int m, int i0, int ci, float scale) {
    for (int j = 0; j < 16; j++) {
        r[j] = j < m ? load_part(k + (size_t)(k0 + j) * stride + i0, ci) : (vec16f){0};
    }
    llmc_transpose16(r);
    for (int ii = 0; ii < 16; ii++) { r[ii] *= scale; }
}

/* The key panel of n key rows (stride floats apart) of hs channels: block kb
   holds keys 16 kb .. 16 kb + 15 as [hs][16] at panel + kb * 16 hs, each
   times scale, keys past n as 0. */
static ALWAYS_INLINE void build_panel_body(float* panel, const float* k, size_t stride, int n,
                                           int hs, float scale) {
    for (int k0 = 0; k0 < n; k0 += 16) {
        float* block = panel + (size_t)k0 * hs;
        for (int i0 = 0; i0 < hs; i0 += 16) {
            const int ci = hs - i0 < 16 ? hs - i0 : 16;
            vec16f r[16];
            key_block(r, k, stride, k0, n - k0 < 16 ? n - k0 : 16, i0, ci, scale);
            for (int ii = 0; ii < ci; ii++) {
                llmc_store16(block + (size_t)(i0 + ii) * 16, r[ii], 16);
            }
        }
    }
}

/* The starting value of the scores of keys t2 .. t2+15 for a query row with
   n keys: the ALiBi bias -slope * (n - 1 - t2 - lane), one product. */
static ALWAYS_INLINE vec16f score_init(int n, int t2, float slope) {
    const vec16f lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return ((float)(n - 1 - t2) - lane) * -slope;
}

/* score_tile's sums for its rows r0 .. r0+RS-1 and NV (1 or 2) vectors of
   keys from k0 (RS and NV constants): one FMA per i, i ascending, and the
   keys before each row's last stored. */
static ALWAYS_INLINE void score_block(float* s, size_t lds, const float* a, size_t lda,
                                      const float* panel, int hs, int r0, int RS, int NV, int n0,
                                      float slope, int k0) {
    const float* p0 = panel + (size_t)k0 * hs;    // keys k0 .. k0+15
    const float* p1 = p0 + (size_t)16 * hs;       // keys k0+16 .. k0+31 (read when NV = 2)
    vec16f acc[SCORE_ROWS][2];
    UNROLL for (int r = 0; r < RS; r++) {
        UNROLL for (int v = 0; v < NV; v++) {
            acc[r][v] = score_init(n0 + r0 + r, k0 + 16 * v, slope);
        }
    }
    for (int i = 0; i < hs; i++) {
        vec16f k_v[2];
        UNROLL for (int v = 0; v < NV; v++) {
            k_v[v] = llmc_load16((v == 0 ? p0 : p1) + (size_t)i * 16, 16);
            KEEP_IN_REGISTER(k_v[v]);
        }
        UNROLL for (int r = 0; r < RS; r++) {
            const float a_ri = a[(size_t)(r0 + r) * lda + i];
            UNROLL for (int v = 0; v < NV; v++) { acc[r][v] += a_ri * k_v[v]; }
        }
    }
    UNROLL for (int r = 0; r < RS; r++) {
        UNROLL for (int v = 0; v < NV; v++) {
            const int m = n0 + r0 + r - (k0 + 16 * v);
            if (m > 0) { store_part(s + (size_t)(r0 + r) * lds + k0 + 16 * v, acc[r][v], m); }
        }
    }
}

/* score_block for RS <= 4 rows and one vector of keys, its sums in halves
   (AVX2 and the portable build; see half16f). */
static ALWAYS_INLINE void score_block_halves(float* s, size_t lds, const float* a, size_t lda,
                                             const float* panel, int hs, int r0, int RS, int n0,
                                             float slope, int k0) {
    const float* p0 = panel + (size_t)k0 * hs;    // keys k0 .. k0+15
    half16f lo[4], hi[4];
    UNROLL for (int r = 0; r < RS; r++) {
        split16(score_init(n0 + r0 + r, k0, slope), &lo[r], &hi[r]);
    }
    for (int i = 0; i < hs; i++) {
        half16f k_lo, k_hi;
        load_halves(p0 + (size_t)i * 16, 16, &k_lo, &k_hi);
        UNROLL for (int r = 0; r < RS; r++) {
            const float a_ri = a[(size_t)(r0 + r) * lda + i];
            lo[r] += a_ri * k_lo;
            hi[r] += a_ri * k_hi;
        }
    }
    UNROLL for (int r = 0; r < RS; r++) {
        const int m = n0 + r0 + r - k0;
        if (m > 0) { store_part(s + (size_t)(r0 + r) * lds + k0, join16(lo[r], hi[r]), m); }
    }
}

/* The query rows of score_tile's blocks and the channels of rows_tile's
   and cols_tile's chunks in a variant for isa (a constant). A whole tile,
   SCORE_ROWS x 32 keys or TILE_ROWS (TILE_KEYS) x TILE_CH channels, is 16
   vectors of accumulators: AVX-512's 32 registers hold it, but on AVX2 it
   is 32 ymm registers of 16, and the spilled loops ran the forward at 5
   GFLOP/s beside the GEMM's 65 (Zen 1, 2 threads). There a block is 4
   rows of 16 keys and a chunk 16 channels: 8 ymm accumulators. (The
   portable build's SSE: 2 rows.) An element's sum is the same chain in any
   block or chunk. */
static ALWAYS_INLINE int score_block_rows(int isa) {
    return isa >= LLMC_ISA_AVX512 ? SCORE_ROWS : isa == LLMC_ISA_AVX2 ? 4 : 2;
}
static ALWAYS_INLINE int tile_channels(int isa) { return isa >= LLMC_ISA_AVX512 ? TILE_CH : 16; }

/*
 * score_tile: R query rows (R <= SCORE_ROWS) against the keys of a panel,
 * from key k_first on (a multiple of 16: a panel block). Row r has n0 + r
 * keys; for k_first <= t2 < n0 + r,
 *   s[r][t2] = score_init(n0 + r, t2) + sum_i a[r][i] * panel(i, t2)
 * one FMA per i, i ascending. a's rows lie lda floats apart, s's lds apart.
 * Keys past a row's last are computed in their lanes but never stored. On
 * AVX-512 a block is all R rows and 32 keys (16 for the last keys: the
 * next block may lie past the panel); see score_block_rows.
 */
static ALWAYS_INLINE void score_tile(int isa, float* s, size_t lds, const float* a, size_t lda,
                                     const float* panel, int hs, int R, int n0, float slope,
                                     int k_first) {
    const int nmax = n0 + R - 1;
    if (isa >= LLMC_ISA_AVX512) {
        for (int k0 = k_first; k0 < nmax; k0 += 32) {
            if (nmax - k0 > 16) {
                score_block(s, lds, a, lda, panel, hs, 0, R, 2, n0, slope, k0);
            } else {
                score_block(s, lds, a, lda, panel, hs, 0, R, 1, n0, slope, k0);
            }
        }
        return;
    }
    const int RS = score_block_rows(isa);
    for (int k0 = k_first; k0 < nmax; k0 += 16) {
        UNROLL for (int r0 = 0; r0 < R; r0 += RS) {
            // rows whose last key is before k0 have nothing to store here
            if (n0 + r0 + (R - r0 < RS ? R - r0 : RS) - 1 <= k0) { continue; }
            score_block_halves(s, lds, a, lda, panel, hs, r0, R - r0 < RS ? R - r0 : RS, n0,
                               slope, k0);
        }
    }
}

/* The lane-wise max of p[0 .. n): whole vectors in a loop of their own, then
   the tail, whose lanes past n take no part (the same max as a masked loop
   over all). A lane holds -inf, never a NaN. */
static ALWAYS_INLINE vec16f row_max16(const float* p, int n) {
    const int whole = n & ~15, m = n - whole;
    vec16f max16 = (vec16f){0} - INFINITY;
    for (int k0 = 0; k0 < whole; k0 += 16) {
        const vec16f x = load_part(p + k0, 16);
        max16 = llmc_select16(LLMC_CMP16(x, >, max16), x, max16);
    }
    if (m > 0) {
        const vec16f x = llmc_select16(llmc_lanes_below(m), load_part(p + whole, m), max16);
        max16 = llmc_select16(LLMC_CMP16(x, >, max16), x, max16);
    }
    return max16;
}

/* p[0 .. n) becomes exp(p - maxval); returns their lane-wise sum (lanes past
   n take no part). */
static ALWAYS_INLINE vec16f row_exps16(int isa, float* p, int n, float maxval) {
    const int whole = n & ~15, m = n - whole;
    vec16f expsum16 = {0};
    for (int k0 = 0; k0 < whole; k0 += 16) {
        const vec16f e = llmc_exp_nonpositive16_isa(isa, load_part(p + k0, 16) - maxval);
        store_part(p + k0, e, 16);
        expsum16 += e;
    }
    if (m > 0) {
        const vec16f e = llmc_exp_nonpositive16_isa(isa, load_part(p + whole, m) - maxval);
        store_part(p + whole, e, m);
        expsum16 += llmc_select16(llmc_lanes_below(m), e, (vec16f){0});
    }
    return expsum16;
}

/* The first two passes of softmax_row_body below: p[0 .. n) becomes
   exp(s - max), its max the lanes' in order; returns inv, the inverse of
   the lanes' sum in order, and the max in *max_out. */
static ALWAYS_INLINE float softmax_exps(int isa, float* p, int n, float* max_out) {
    const vec16f max16 = row_max16(p, n);
    float maxval = -INFINITY;
    for (int j = 0; j < 16; j++) { maxval = max16[j] > maxval ? max16[j] : maxval; }
    *max_out = maxval;
    return 1.0f / llmc_hsum16(row_exps16(isa, p, n, maxval));
}

/* softmax_exps of the R rows of a tile (R <= 16) at once, bitwise the same:
   row r is n[r] floats at s + r lds + lo[r]; its max goes to max_out[r], its
   inv to inv_out[r]. One row's reductions over its 16 lanes are serial
   chains; here the rows' lanes are transposed so that one vector operation
   takes the same step, in the same order, of every row's chain. */
static ALWAYS_INLINE void softmax_tile_exps(int isa, float* s, size_t lds, const int* lo,
                                            const int* n, int R, float* max_out,
                                            float* inv_out) {
    vec16f lanes[16];
    for (int r = 0; r < 16; r++) {
        lanes[r] = r < R ? row_max16(s + (size_t)r * lds + lo[r], n[r]) : (vec16f){0};
    }
    llmc_transpose16_isa(isa, lanes);   // lanes[j] lane r: row r's lane j
    vec16f maxv = (vec16f){0} - INFINITY;
    for (int j = 0; j < 16; j++) {
        maxv = llmc_select16(LLMC_CMP16(lanes[j], >, maxv), lanes[j], maxv);
    }
    for (int r = 0; r < 16; r++) {
        lanes[r] = r < R ? row_exps16(isa, s + (size_t)r * lds + lo[r], n[r], maxv[r])
                         : (vec16f){0};
    }
    llmc_transpose16_isa(isa, lanes);
    vec16f sum = {0};
    for (int j = 0; j < 16; j++) { sum += lanes[j]; }
    const vec16f inv = 1.0f / sum;   // rows past R: inf, dropped
    for (int r = 0; r < R; r++) {
        max_out[r] = maxv[r];
        inv_out[r] = inv[r];
    }
}

/* p[0 .. n) *= inv: the last pass of softmax_row_body. */
static ALWAYS_INLINE void scale_row(float* p, int n, float inv) {
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        store_part(p + k0, load_part(p + k0, m) * inv, m);
    }
}

/* Softmax of p[0 .. n) in place: the max is subtracted, exponentials are
   taken 16 lanes at a time and summed lane by lane, then the lanes in order.
   Unless stats is NULL, stats[0] = the max and stats[1] = inv, the inverse of
   the sum. The forward's rows and the decode's both run its variants. */
static ALWAYS_INLINE void softmax_row_body(int isa, float* p, int n, float* stats) {
    float maxval;
    const float inv = softmax_exps(isa, p, n, &maxval);
    scale_row(p, n, inv);
    if (stats != NULL) {
        stats[0] = maxval;
        stats[1] = inv;
    }
}

/* softmax_row_body again from its saved max and inv: p[0 .. n) holds the row's
   scores on entry and its probabilities on return, each exp(s - max) * inv
   by the same vector operations as softmax_row_body, so bitwise the same. */
static ALWAYS_INLINE void probs_row_body(int isa, float* p, int n, const float* stats) {
    const float maxval = stats[0], inv = stats[1];
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        const vec16f e = llmc_exp_nonpositive16_isa(isa, load_part(p + k0, m) - maxval);
        store_part(p + k0, e * inv, m);
    }
}

/* The backward through the softmax and the scale, for the R rows (R <= 16)
   of a tile: row r is n[r] keys from lo[r] on of ds, which holds dP = dO . v
   on entry, and of p (rows of both ld floats apart); on return
   dS = p * (dP - sum(p * dP)) * scale. A row's sum runs 16 lanes at a time,
   then its lanes in order, one chain a row: transposed, as in
   softmax_tile_exps, one vector add takes the same step of every row's. */
static ALWAYS_INLINE void dscore_tile(float* ds, const float* p, size_t ld, const int* lo,
                                      const int* n, int R, float scale) {
    vec16f lanes[16];
    for (int r = 0; r < 16; r++) {
        vec16f acc = {0};
        const float* p_r = p + (size_t)r * ld + (r < R ? lo[r] : 0);
        const float* ds_r = ds + (size_t)r * ld + (r < R ? lo[r] : 0);
        for (int k0 = 0; r < R && k0 < n[r]; k0 += 16) {
            const int m = n[r] - k0 < 16 ? n[r] - k0 : 16;
            acc += load_part(p_r + k0, m) * load_part(ds_r + k0, m);   // lanes past m: 0 * 0
        }
        lanes[r] = acc;
    }
    llmc_transpose16(lanes);   // lanes[j] lane r: row r's lane j
    vec16f p_dp = {0};
    for (int j = 0; j < 16; j++) { p_dp += lanes[j]; }
    for (int r = 0; r < R; r++) {
        const float* p_r = p + (size_t)r * ld + lo[r];
        float* ds_r = ds + (size_t)r * ld + lo[r];
        for (int k0 = 0; k0 < n[r]; k0 += 16) {
            const int m = n[r] - k0 < 16 ? n[r] - k0 : 16;
            store_part(ds_r + k0, load_part(p_r + k0, m) * (load_part(ds_r + k0, m) - p_dp[r])
                                      * scale, m);
        }
    }
}

/* A chunk of channels is NV vectors (NV <= TILE_CH / 16), the last with mlast
   lanes (16 when whole). These load / store one row of such a chunk. */
static ALWAYS_INLINE void load_chunk(vec16f* xv, const float* p, int NV, int mlast) {
    UNROLL for (int v = 0; v < NV; v++) {
        xv[v] = load_part(p + 16 * v, v == NV - 1 ? mlast : 16);
    }
}
static ALWAYS_INLINE void store_chunk(float* p, const vec16f* xv, int NV, int mlast) {
    UNROLL for (int v = 0; v < NV; v++) { store_part(p + 16 * v, xv[v], v == NV - 1 ? mlast : 16); }
}
/* acc[v] += a * xv[v] over a chunk */
static ALWAYS_INLINE void fma_chunk(vec16f* acc, float a, const vec16f* xv, int NV) {
    UNROLL for (int v = 0; v < NV; v++) { acc[v] += a * xv[v]; }
}
/* A row of x used by every row of a tile: loaded once, kept in registers. */
static ALWAYS_INLINE void load_shared_chunk(vec16f* xv, const float* p, int NV, int mlast) {
    load_chunk(xv, p, NV, mlast);
    UNROLL for (int v = 0; v < NV; v++) { KEEP_IN_REGISTER(xv[v]); }
}

/* rows_tile on one chunk of channels. */
static ALWAYS_INLINE void rows_chunk(float* o, size_t ldo, int accumulate,
                                     const float* a, size_t lda, const float* x, size_t ldx,
                                     int R, int n0, int NV, int mlast) {
    vec16f acc[TILE_ROWS][TILE_CH / 16], xv[TILE_CH / 16];
    UNROLL for (int r = 0; r < R; r++) {
        if (accumulate) {
            load_chunk(acc[r], o + (size_t)r * ldo, NV, mlast);
        } else {
            UNROLL for (int v = 0; v < NV; v++) { acc[r][v] = (vec16f){0}; }
        }
    }
    for (int t2 = 0; t2 < n0; t2++) {           // the terms all R rows have
        load_shared_chunk(xv, x + (size_t)t2 * ldx, NV, mlast);
        UNROLL for (int r = 0; r < R; r++) { fma_chunk(acc[r], a[(size_t)r * lda + t2], xv, NV); }
    }
    UNROLL for (int d = 1; d < R; d++) {        // then those only rows d .. R-1 have
        const int t2 = n0 - 1 + d;
        load_shared_chunk(xv, x + (size_t)t2 * ldx, NV, mlast);
        UNROLL for (int r = 0; r < R; r++) {
            if (r >= d) { fma_chunk(acc[r], a[(size_t)r * lda + t2], xv, NV); }
        }
    }
    UNROLL for (int r = 0; r < R; r++) { store_chunk(o + (size_t)r * ldo, acc[r], NV, mlast); }
}

/* rows_chunk for a chunk of one vector (m <= 16 channels), its sums in
   halves (AVX2 and the portable build; see half16f). */
static ALWAYS_INLINE void rows_chunk_halves(float* o, size_t ldo, int accumulate,
                                            const float* a, size_t lda, const float* x,
                                            size_t ldx, int R, int n0, int m) {
    half16f lo[TILE_ROWS], hi[TILE_ROWS];
    start_halves(lo, hi, o, ldo, accumulate, R, m);
    for (int t2 = 0; t2 < n0; t2++) {           // the terms all R rows have
        add_row_halves(lo, hi, a + t2, lda, x + (size_t)t2 * ldx, 0, R, m);
    }
    UNROLL for (int d = 1; d < R; d++) {        // then those only rows d .. R-1 have
        const int t2 = n0 - 1 + d;
        add_row_halves(lo, hi, a + t2, lda, x + (size_t)t2 * ldx, d, R, m);
    }
    store_halves(o, ldo, lo, hi, R, m);
}

/* Runs CHUNK(NV, mlast) for the chunk of nc channels (1 <= nc <= TILE_CH) with
   NV and, when the chunk is whole vectors, mlast as constants: no lane masks
   in the loops of the common head sizes. */
#define DISPATCH_CHUNK(nc, CHUNK)                                                   \
    do {                                                                            \
        const int mlast_ = (nc) - 16 * (((nc) - 1) / 16);                           \
        switch ((mlast_ == 16 ? 0 : 4) + ((nc) + 15) / 16) {                        \
        case 4: CHUNK(4, 16); break;                                                \
        case 3: CHUNK(3, 16); break;                                                \
        case 2: CHUNK(2, 16); break;                                                \
        case 1: CHUNK(1, 16); break;                                                \
        case 8: CHUNK(4, mlast_); break;                                            \
        case 7: CHUNK(3, mlast_); break;                                            \
        case 6: CHUNK(2, mlast_); break;                                            \
        default: CHUNK(1, mlast_); break;                                           \
        }                                                                           \
    } while (0)

/*
 * rows_tile: R rows (R <= TILE_ROWS), row r with n0 + r terms; for c < hs,
 *   o[r][c] = (accumulate ? o[r][c] : 0) + sum_{t2 < n0 + r} a[r][t2] * x[t2][c]
 * one FMA per t2, t2 ascending. Rows of a, x and o lie lda, ldx, ldo apart.
 */
static ALWAYS_INLINE void rows_tile(int isa, float* o, size_t ldo, int accumulate,
                                    const float* a, size_t lda, const float* x, size_t ldx,
                                    int R, int n0, int hs) {
    const int chunk = tile_channels(isa);
    for (int c0 = 0; c0 < hs; c0 += chunk) {
        const int nc = hs - c0 < chunk ? hs - c0 : chunk;
        if (isa < LLMC_ISA_AVX512) {   // chunks of one vector
            rows_chunk_halves(o + c0, ldo, accumulate, a, lda, x + c0, ldx, R, n0, nc);
            continue;
        }
#define ROWS_CHUNK(NV, mlast) \
        rows_chunk(o + c0, ldo, accumulate, a, lda, x + c0, ldx, R, n0, NV, mlast)
        DISPATCH_CHUNK(nc, ROWS_CHUNK);
#undef ROWS_CHUNK
    }
}

/* cols_tile on one chunk of channels. */
static ALWAYS_INLINE void cols_chunk(float* o, size_t ldo, const float* a, size_t lda,
                                     const float* x, size_t ldx, int KT, int t2a, int ta,
                                     int tb, int NV, int mlast) {
    vec16f acc[TILE_KEYS][TILE_CH / 16], xv[TILE_CH / 16];
    UNROLL for (int j = 0; j < KT; j++) { load_chunk(acc[j], o + (size_t)j * ldo, NV, mlast); }
    int t = ta;
    if (t2a >= ta) {                            // the keys lie on the rows' diagonal:
        UNROLL for (int d = 0; d < KT - 1; d++) {   // the terms only keys 0 .. d have
            t = t2a + d;
            load_shared_chunk(xv, x + (size_t)t * ldx, NV, mlast);
            UNROLL for (int j = 0; j < KT; j++) {
                if (j <= d) { fma_chunk(acc[j], a[(size_t)(t - ta) * lda + t2a + j], xv, NV); }
            }
        }
        t = t2a + KT - 1;
    }
    for (; t < tb; t++) {                       // then those all KT keys have
        load_shared_chunk(xv, x + (size_t)t * ldx, NV, mlast);
        const float* a_t = a + (size_t)(t - ta) * lda + t2a;
        UNROLL for (int j = 0; j < KT; j++) { fma_chunk(acc[j], a_t[j], xv, NV); }
    }
    UNROLL for (int j = 0; j < KT; j++) { store_chunk(o + (size_t)j * ldo, acc[j], NV, mlast); }
}

/* cols_chunk for a chunk of one vector (m <= 16 channels), its sums in
   halves (AVX2 and the portable build; see half16f). */
static ALWAYS_INLINE void cols_chunk_halves(float* o, size_t ldo, const float* a, size_t lda,
                                            const float* x, size_t ldx, int KT, int t2a, int ta,
                                            int tb, int m) {
    half16f lo[TILE_KEYS], hi[TILE_KEYS];
    start_halves(lo, hi, o, ldo, 1, KT, m);
    int t = ta;
    if (t2a >= ta) {                            // the keys lie on the rows' diagonal:
        UNROLL for (int d = 0; d < KT - 1; d++) {   // the terms only keys 0 .. d have
            t = t2a + d;
            add_row_halves(lo, hi, a + (size_t)(t - ta) * lda + t2a, 1, x + (size_t)t * ldx, 0,
                           d + 1, m);
        }
        t = t2a + KT - 1;
    }
    for (; t < tb; t++) {                       // then those all KT keys have
        add_row_halves(lo, hi, a + (size_t)(t - ta) * lda + t2a, 1, x + (size_t)t * ldx, 0, KT,
                       m);
    }
    store_halves(o, ldo, lo, hi, KT, m);
}

/*
 * cols_tile: KT keys (KT <= TILE_KEYS), key j at t2a + j, and the rows
 * ta .. tb-1 of a (row t at a + (t - ta) lda); for c < hs,
 *   o[j][c] += sum_{t = max(ta, t2a + j)}^{tb - 1} a[t][t2a + j] * x[t][c]
 * one FMA per t, t ascending. The keys lie either all before the rows
 * (t2a + KT <= ta: the full rectangle) or among them (t2a >= ta: the
 * triangle, then the rest). Rows of x (by t) and o lie ldx, ldo apart.
 */
static ALWAYS_INLINE void cols_tile(int isa, float* o, size_t ldo, const float* a, size_t lda,
                                    const float* x, size_t ldx, int KT, int t2a, int ta, int tb,
                                    int hs) {
    const int chunk = tile_channels(isa);
    for (int c0 = 0; c0 < hs; c0 += chunk) {
        const int nc = hs - c0 < chunk ? hs - c0 : chunk;
        if (isa < LLMC_ISA_AVX512) {   // chunks of one vector
            cols_chunk_halves(o + c0, ldo, a, lda, x + c0, ldx, KT, t2a, ta, tb, nc);
            continue;
        }
#define COLS_CHUNK(NV, mlast) \
        cols_chunk(o + c0, ldo, a, lda, x + c0, ldx, KT, t2a, ta, tb, NV, mlast)
        DISPATCH_CHUNK(nc, COLS_CHUNK);
#undef COLS_CHUNK
    }
}

/* The scratch floats of a key panel of T keys. */
static inline size_t panel_count(int T, int hs) {
    return (size_t)((T + 15) / 16) * 16 * (size_t)hs;
}

#endif
