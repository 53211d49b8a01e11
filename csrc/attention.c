/*
 * Causal self-attention, forward and backward: GPT-2's multi-head layout and
 * grouped-query attention (GQA) with optional ALiBi.
 *
 * One core serves both. GPT-2's packed row (q, k, v, each C = NH hs wide) is
 * the grouped layout with NKV == NH, and "no slopes" is a slope of 0, so
 * attention_forward/backward are the GQA kernels with those arguments, with
 * the same offsets and the same order of every sum.
 *
 * Design: each (b, h) is a handful of small matrix products, computed by
 * three register-tiled kernels on 16-lane vectors (vec16f). In each, one
 * lane owns one output element and sums its terms one fused multiply-add at
 * a time, in ascending order of the summed index, starting from a fixed
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
 * The causal triangle is kept exact: a tile runs the terms all its rows
 * share, then the few that only its later rows (or earlier keys) have, so no
 * masked entry is ever read or added.
 *
 * Memory grows with T, not T^2 (FlashAttention's idea, in this exact form):
 * the forward keeps only two numbers per query row, the max of its scores
 * and the inverse of its sum of exponentials (stats [B, NH, T, 2]), and the
 * backward recomputes the probabilities from them, block by block. Both
 * recompute the scores with the same score_tile on the same key panel, and
 * P = exp(s - max) * inv by the same vector operations as softmax_row, so
 * the backward's P is bitwise the forward's, and so is every sum built on it.
 *
 * Forward, parallel over (b, h): the key panel of the head's kv head is
 * built with the 1/sqrt(hs) scale folded in (a product of its own, before
 * the sums), then per tile of SCORE_ROWS query rows, in a per-thread scratch
 * of SCORE_ROWS x T scores,
 *   scores = score_tile(q, panel), starting from the bias -slope * (t - t2)
 *   P      = softmax_row of each row, which also writes the row's max, inv
 *   out    = rows_tile(P, v)
 * Scratch per thread: the panel (T hs) and the tile (SCORE_ROWS T) floats.
 *
 * Backward, parallel over (b, kv head). A kv head's dk and dv gather from
 * all NH / NKV query heads of its group, so one thread owns the group and
 * walks its query heads in order, each in blocks of BACKWARD_ROWS query
 * rows t0 .. t1-1. With dO = dout of head h, per tile of the block's rows:
 *   P  = exp(score_tile(q, key panel) - max) * inv     probs_row
 *   dP = dO V^T                  score_tile against a panel of v, no scale
 *   dS = P * (dP - rowsum(P * dP)) / sqrt(hs)          dscore_row
 *   dq += dS K                   rows_tile
 * then, for every key t2 < t1, over the block's rows t >= t2:
 *   dk += dS^T Q                 cols_tile
 *   dv += P^T dO                 cols_tile
 * (a key tile before the block takes the full rectangle of its rows, one on
 * the block's diagonal the triangle, then the rest). dq, dk and dv are
 * summed onto dinp's values in place; an element of dk or dv sums over the
 * group's heads in order, then over t ascending, blocks carrying the partial
 * sum through dinp (a float, so a store and a load change nothing). No two
 * threads touch the same element, and every element is summed in one order
 * whatever the thread count. Scratch per thread: the key panel and the
 * panel of v (T hs each) and the blocks of P and dS (min(T, BACKWARD_ROWS)
 * x T each), one malloc per call.
 *
 * A sliding window of W keys (window > 0) bounds every key loop below: row
 * t's keys are lo(t) = max(0, t - W + 1) .. t. A tile's scores start at the
 * panel block of its first row's lo; each row's softmax (and probs_row,
 * dscore_row, entropy_row) runs over its own window; the sums over keys
 * that a tile's rows share start at the first row's lo, and the later rows'
 * entries before their own lo are set to 0 first (an added 0 * x changes no
 * bit). So time is O(T W), and a row sums the same terms in the same order
 * as attention_decode over a rolling cache of its window. The backward's
 * dk, dv loops start at the block's first key, 16-aligned.
 *
 * Dropout on the probabilities (training): the forward drops each row of P
 * after softmax_row, P M / (1 - p) with M a hash of (b, h T + t, t2)
 * (dropout.h), so stats stay those of P; the backward regenerates the mask
 * row by row: dP goes through it before dscore_row, and P, once dS is made,
 * takes it for dv. A row's mask covers its window's keys only.
 *
 * attention_gqa_probs rebuilds the whole of P [B, NH, T, T] the same way
 * (for tests, the benchmark and viewers): parallel over (b, h), scores by
 * score_tile straight into att, then probs_row; the masked future is 0.
 *
 * attention_gqa_entropy gives each query row's entropy -sum_t2 P ln P (for
 * monitors) the same way without holding P: parallel over (b, h), per tile
 * of SCORE_ROWS rows the scores in a per-thread scratch, then entropy_row
 * from them and the row's saved max and inv.
 *
 * attention_decode is one forward row per (b, h), parallel over (b, kv
 * head, chunk of up to DECODE_HEADS of its query heads). It transposes
 * 16 x 16 blocks of cached keys on the fly, once for the chunk's heads,
 * instead of building a panel (no allocation per call, one pass over the
 * cache); the panel holds the same values, so its scores are the forward's,
 * lane by lane. It then calls the forward's softmax_row and rows_tile (one
 * row), so a decoded position equals that position of a full forward
 * bitwise. The scores need a row of up to maxT floats per (b, h): the
 * caller's att buffer holds them, since a stack buffer of maxT floats could
 * overflow a worker thread's stack for long contexts.
 *
 * variants:
 *   attention_forward / _backward, attention_gqa_forward / _backward,
 *   attention_gqa_probs, attention_gqa_entropy, attention_decode
 *                      the tiled kernels above, built per instruction set
 *                      (isa.h) and chosen at run time; they keep stats
 *   attention_forward_naive / _backward_naive
 *                      plain loops as in llm.c (one dot product per score,
 *                      scalar softmax with libm's expf) that keep the whole
 *                      of att [B, NH, T, T]: the reference the tests and the
 *                      benchmark check the tiled kernels against; the same
 *                      everywhere (no per-ISA build)
 *   attention_entropy_naive
 *                      the row entropies from a whole att by libm's logf:
 *                      attention_gqa_entropy's plain twin
 */
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "llmc.h"
#include "common.h"
#include "dropout.h"
#include "isa.h"

#define SCORE_ROWS 8    /* query rows of a score_tile, and of the forward's and
                           backward's row tiles: a multiple of TILE_ROWS */
#define TILE_ROWS 4     /* query rows of a rows_tile */
#define TILE_KEYS 4     /* key rows of a cols_tile */
#define TILE_CH 64      /* channels of a rows_tile / cols_tile: 4 vectors */
#define DECODE_HEADS 4  /* query heads of a kv head the decode scores at once */

#define ALWAYS_INLINE LLMC_ALWAYS_INLINE

/* The first key of query row t: t - window + 1 in a sliding window of
   window keys (window > 0), else 0. */
static inline int first_key(int t, int window) {
    return window > 0 && t >= window ? t - window + 1 : 0;
}

/* The first key of the panel block (16 keys) that holds row t's first key. */
static inline int first_block_key(int t, int window) { return first_key(t, window) / 16 * 16; }

/* Zeroes x[k0 .. k1): the probabilities (and their gradients) of keys
   outside a row's window that a tile's shared loops still read. */
static inline void zero_keys(float* x, int k0, int k1) {
    for (int t2 = k0; t2 < k1; t2++) { x[t2] = 0.0f; }
}

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

LLMC_ISA_VARIANTS(build_panel, (float* panel, const float* k, size_t stride, int n, int hs,
                                float scale),
                  panel, k, stride, n, hs, scale)

/* The starting value of the scores of keys t2 .. t2+15 for a query row with
   n keys: the ALiBi bias -slope * (n - 1 - t2 - lane), one product. */
static ALWAYS_INLINE vec16f score_init(int n, int t2, float slope) {
    const vec16f lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return ((float)(n - 1 - t2) - lane) * -slope;
}

/*
 * score_tile: R query rows (R <= SCORE_ROWS) against the keys of a panel,
 * from key k_first on (a multiple of 16: a panel block). Row r has n0 + r
 * keys; for k_first <= t2 < n0 + r,
 *   s[r][t2] = score_init(n0 + r, t2) + sum_i a[r][i] * panel(i, t2)
 * one FMA per i, i ascending. a's rows lie lda floats apart, s's lds apart.
 * Keys past a row's last are computed in their lanes but never stored.
 */
static ALWAYS_INLINE void score_tile(float* s, size_t lds, const float* a, size_t lda,
                                     const float* panel, int hs, int R, int n0, float slope,
                                     int k_first) {
    const int nmax = n0 + R - 1;
    for (int k0 = k_first; k0 < nmax; k0 += 32) {
        const float* p0 = panel + (size_t)k0 * hs;    // keys k0 .. k0+15
        const float* p1 = p0 + (size_t)16 * hs;       // keys k0+16 .. k0+31
        vec16f acc[SCORE_ROWS][2];
        UNROLL for (int r = 0; r < R; r++) {
            acc[r][0] = score_init(n0 + r, k0, slope);
            acc[r][1] = score_init(n0 + r, k0 + 16, slope);
        }
        if (nmax - k0 > 16) {
            for (int i = 0; i < hs; i++) {
                vec16f k_a = llmc_load16(p0 + (size_t)i * 16, 16);
                vec16f k_b = llmc_load16(p1 + (size_t)i * 16, 16);
                KEEP_IN_REGISTER(k_a);
                KEEP_IN_REGISTER(k_b);
                UNROLL for (int r = 0; r < R; r++) {
                    const float a_ri = a[(size_t)r * lda + i];
                    acc[r][0] += a_ri * k_a;
                    acc[r][1] += a_ri * k_b;
                }
            }
        } else {   // the last 16 keys (p1 may lie past the panel)
            for (int i = 0; i < hs; i++) {
                vec16f k_a = llmc_load16(p0 + (size_t)i * 16, 16);
                KEEP_IN_REGISTER(k_a);
                UNROLL for (int r = 0; r < R; r++) { acc[r][0] += a[(size_t)r * lda + i] * k_a; }
            }
        }
        UNROLL for (int r = 0; r < R; r++) {
            UNROLL for (int half = 0; half < 2; half++) {
                const int m = n0 + r - (k0 + 16 * half);
                if (m > 0) { store_part(s + (size_t)r * lds + k0 + 16 * half, acc[r][half], m); }
            }
        }
    }
}

/* The decode's scores: R query heads (R <= DECODE_HEADS, rows ldq floats
   apart, their slopes at slopes[0 .. R), or NULL) that share one kv head,
   against n keys (stride floats apart) of which the first lies dist0
   positions before the query, as score_tile computes them against a panel
   of k times scale. The 16 x 16 key blocks are transposed on the fly, once
   for all R heads. Writes row r at s + r lds. */
static ALWAYS_INLINE void decode_scores(float* s, size_t lds, const float* q, size_t ldq,
                                        const float* slopes, const float* k, size_t stride,
                                        int n, int dist0, int hs, float scale, int R) {
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        vec16f acc[DECODE_HEADS];
        UNROLL for (int r = 0; r < R; r++) {
            acc[r] = score_init(dist0 + 1, k0, slopes != NULL ? slopes[r] : 0.0f);
        }
        for (int i0 = 0; i0 < hs; i0 += 16) {
            const int ci = hs - i0 < 16 ? hs - i0 : 16;
            vec16f kt[16];
            key_block(kt, k, stride, k0, m, i0, ci, scale);
            for (int ii = 0; ii < ci; ii++) {
                UNROLL for (int r = 0; r < R; r++) {
                    acc[r] += q[(size_t)r * ldq + i0 + ii] * kt[ii];
                }
            }
        }
        UNROLL for (int r = 0; r < R; r++) { store_part(s + (size_t)r * lds + k0, acc[r], m); }
    }
}

/* Softmax of p[0 .. n) in place: the max is subtracted, exponentials are
   taken 16 lanes at a time and summed lane by lane, then the lanes in order.
   Unless stats is NULL, stats[0] = the max and stats[1] = inv, the inverse of
   the sum. Built per instruction set and never inlined: the forward and the
   decode run this very code. */
static ALWAYS_INLINE void softmax_row_body(float* p, int n, float* stats) {
    const vec16f neg_inf = (vec16f){0} - INFINITY;
    vec16f max16 = neg_inf;
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        const vec16f x = llmc_select16(llmc_lanes_below(m), load_part(p + k0, m), neg_inf);
        max16 = llmc_select16(x > max16, x, max16);
    }
    float maxval = -INFINITY;
    for (int j = 0; j < 16; j++) { maxval = max16[j] > maxval ? max16[j] : maxval; }
    vec16f expsum16 = {0};
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        const vec16f e = llmc_exp16(load_part(p + k0, m) - maxval);
        store_part(p + k0, e, m);
        expsum16 += llmc_select16(llmc_lanes_below(m), e, (vec16f){0});
    }
    const float inv = 1.0f / llmc_hsum16(expsum16);
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        store_part(p + k0, load_part(p + k0, m) * inv, m);
    }
    if (stats != NULL) {
        stats[0] = maxval;
        stats[1] = inv;
    }
}

LLMC_ISA_VARIANTS(softmax_row, (float* p, int n, float* stats), p, n, stats)

/* softmax_row again from its saved max and inv: p[0 .. n) holds the row's
   scores on entry and its probabilities on return, each exp(s - max) * inv
   by the same vector operations as softmax_row, so bitwise the same. */
static ALWAYS_INLINE void probs_row_body(float* p, int n, const float* stats) {
    const float maxval = stats[0], inv = stats[1];
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        store_part(p + k0, llmc_exp16(load_part(p + k0, m) - maxval) * inv, m);
    }
}

LLMC_ISA_VARIANTS(probs_row, (float* p, int n, const float* stats), p, n, stats)

/* The entropy of the probabilities of one row of n keys, from its scores s
   and its saved max and inv. With d = s - max, P = exp(d) inv and
   ln P = d + ln inv, so (as the P sum to 1)
     H = -sum P ln P = -ln inv - inv sum exp(d) d
   Both terms are >= 0 (d <= 0, inv <= 1): nothing cancels, and a P that
   underflows to 0 adds exactly 0, where P ln P would need a guard. */
static ALWAYS_INLINE void entropy_row_body(float* entropy, const float* s, int n,
                                           const float* stats) {
    const float maxval = stats[0], inv = stats[1];
    vec16f acc = {0};
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        const vec16f d = load_part(s + k0, m) - maxval;
        acc += llmc_select16(llmc_lanes_below(m), llmc_exp16(d) * d, (vec16f){0});
    }
    *entropy = -logf(inv) - inv * llmc_hsum16(acc);
}

LLMC_ISA_VARIANTS(entropy_row, (float* entropy, const float* s, int n, const float* stats),
                  entropy, s, n, stats)

/* The backward through the softmax and the scale, one row of n keys: ds
   holds dP = dO . v on entry, and on return
   dS = p * (dP - sum(p * dP)) * scale. */
static ALWAYS_INLINE void dscore_row_body(float* ds, const float* p, int n, float scale) {
    vec16f acc = {0};
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        acc += load_part(p + k0, m) * load_part(ds + k0, m);   // lanes past m: 0 * 0
    }
    const float p_dp = llmc_hsum16(acc);
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        store_part(ds + k0, load_part(p + k0, m) * (load_part(ds + k0, m) - p_dp) * scale, m);
    }
}

LLMC_ISA_VARIANTS(dscore_row, (float* ds, const float* p, int n, float scale), ds, p, n, scale)

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
static ALWAYS_INLINE void rows_tile(float* o, size_t ldo, int accumulate,
                                    const float* a, size_t lda, const float* x, size_t ldx,
                                    int R, int n0, int hs) {
    for (int c0 = 0; c0 < hs; c0 += TILE_CH) {
        const int nc = hs - c0 < TILE_CH ? hs - c0 : TILE_CH;
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

/*
 * cols_tile: KT keys (KT <= TILE_KEYS), key j at t2a + j, and the rows
 * ta .. tb-1 of a (row t at a + (t - ta) lda); for c < hs,
 *   o[j][c] += sum_{t = max(ta, t2a + j)}^{tb - 1} a[t][t2a + j] * x[t][c]
 * one FMA per t, t ascending. The keys lie either all before the rows
 * (t2a + KT <= ta: the full rectangle) or among them (t2a >= ta: the
 * triangle, then the rest). Rows of x (by t) and o lie ldx, ldo apart.
 */
static ALWAYS_INLINE void cols_tile(float* o, size_t ldo, const float* a, size_t lda,
                                    const float* x, size_t ldx, int KT, int t2a, int ta, int tb,
                                    int hs) {
    for (int c0 = 0; c0 < hs; c0 += TILE_CH) {
        const int nc = hs - c0 < TILE_CH ? hs - c0 : TILE_CH;
#define COLS_CHUNK(NV, mlast) \
        cols_chunk(o + c0, ldo, a, lda, x + c0, ldx, KT, t2a, ta, tb, NV, mlast)
        DISPATCH_CHUNK(nc, COLS_CHUNK);
#undef COLS_CHUNK
    }
}
#undef DISPATCH_CHUNK

/* The scratch floats of a key panel of T keys. */
static size_t panel_count(int T, int hs) { return (size_t)((T + 15) / 16) * 16 * (size_t)hs; }

/* One allocation for every thread's per_thread floats of scratch; NULL if it
   fails or its size would not fit. */
static float* alloc_scratch(size_t per_thread) {
    const size_t threads = (size_t)omp_get_max_threads();
    if (!llmc_count_fits(threads, per_thread, 1, 1)) { return NULL; }
    return malloc(threads * per_thread * sizeof(float));
}

/* One tile of R query rows t0 .. t0+R-1 of the forward of a (b, h): their
   scores in s [R, T], the softmax of each row's window (and its statistics
   into stats_bh [T, 2]), then their rows of out. A group of rows sums
   P v from its first row's first key: the later rows' keys before their
   own first key are set to 0, so they add exactly nothing, and each row
   sums the same terms in the same order as the decode of its position.
   With dropout (drop at the (b, h)), each row's P is dropped after its
   softmax. */
static ALWAYS_INLINE void forward_rows(int isa, float* out_bh, size_t C, float* stats_bh,
                                       float* s, const float* q, const float* panel,
                                       const float* v, size_t row, int T, int hs, float slope,
                                       int window, llmc_dropout drop, int t0, int R) {
    score_tile(s, (size_t)T, q + (size_t)t0 * row, row, panel, hs, R, t0 + 1, slope,
               first_block_key(t0, window));
    for (int r = 0; r < R; r++) {
        const int lo = first_key(t0 + r, window);
        LLMC_ISA_SELECT(isa, softmax_row)(s + (size_t)r * T + lo, t0 + r + 1 - lo,
                                          stats_bh + 2 * (size_t)(t0 + r));
        if (llmc_dropout_on(drop)) {
            float* p_row = s + (size_t)r * T + lo;
            llmc_dropout_row(p_row, p_row, lo, t0 + r + 1 - lo, drop, t0 + r);
        }
    }
    const int R_pv = R < TILE_ROWS ? R : TILE_ROWS;
    for (int r = 0; r < R; r += R_pv) {
        const int lo = first_key(t0 + r, window);
        for (int d = 1; d < R_pv; d++) {
            zero_keys(s + (size_t)(r + d) * T, lo, first_key(t0 + r + d, window));
        }
        rows_tile(out_bh + (size_t)(t0 + r) * C, C, 0, s + (size_t)r * T + lo, (size_t)T,
                  v + (size_t)lo * row, row, R_pv, t0 + r + 1 - lo, hs);
    }
}

/* The forward of one (b, h): its kv head's key panel, then the query rows
   in tiles, their scores in s [SCORE_ROWS, T]; stats_bh is stats[b, h]
   [T, 2]. Rows of q, k and v lie row floats apart, of out C apart. */
static ALWAYS_INLINE void forward_head_body(int isa, float* out_bh, float* stats_bh,
                                            const float* q, const float* k, const float* v,
                                            float* panel, float* s, size_t row, size_t C, int T,
                                            int hs, float slope, float scale, int window,
                                            llmc_dropout drop) {
    LLMC_ISA_SELECT(isa, build_panel)(panel, k, row, T, hs, scale);
    int t0 = 0;
    for (; t0 + SCORE_ROWS <= T; t0 += SCORE_ROWS) {
        forward_rows(isa, out_bh, C, stats_bh, s, q, panel, v, row, T, hs, slope, window, drop,
                     t0, SCORE_ROWS);
    }
    for (; t0 < T; t0++) {
        forward_rows(isa, out_bh, C, stats_bh, s, q, panel, v, row, T, hs, slope, window, drop,
                     t0, 1);
    }
}
LLMC_ISA_VARIANTS_ISA(forward_head, (float* out_bh, float* stats_bh, const float* q,
                                     const float* k, const float* v, float* panel, float* s,
                                     size_t row, size_t C, int T, int hs, float slope,
                                     float scale, int window, llmc_dropout drop),
                      out_bh, stats_bh, q, k, v, panel, s, row, C, T, hs, slope, scale, window,
                      drop)

/* The forward core; sizes already checked. slopes may be NULL. */
static int gqa_forward(float* out, float* stats, const float* inp, const float* slopes,
                       int B, int T, int NH, int NKV, int hs, int window, llmc_dropout drop) {
    const size_t C = (size_t)NH * hs;                          // q heads, and out's row
    const size_t row = ((size_t)NH + 2 * (size_t)NKV) * hs;    // packed q, k, v row
    const size_t v_start = C + (size_t)NKV * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    void (*const head)(float*, float*, const float*, const float*, const float*, float*, float*,
                       size_t, size_t, int, int, float, float, int, llmc_dropout) =
        LLMC_ISA_SELECT(llmc_get_isa(), forward_head);
    // per thread: a key panel, then the scores of one tile of rows
    const size_t panel_len = panel_count(T, hs);
    const size_t per_thread = panel_len + (size_t)SCORE_ROWS * T;
    float* scratch = alloc_scratch(per_thread);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            float* panel = scratch + (size_t)omp_get_thread_num() * per_thread;
            const float* inp_b = inp + (size_t)b * T * row;
            const size_t kv = (size_t)(h / kv_mul) * hs;
            head(out + (size_t)b * T * C + (size_t)h * hs, stats + ((size_t)b * NH + h) * T * 2,
                 inp_b + (size_t)h * hs, inp_b + C + kv, inp_b + v_start + kv, panel,
                 panel + panel_len, row, C, T, hs, slopes != NULL ? slopes[h] : 0.0f, scale,
                 window, llmc_dropout_at(drop, b, (int64_t)h * T));
        }
    }
    free(scratch);
    return LLMC_OK;
}

/* The probabilities att_bh [T, T] of one (b, h) from its statistics
   stats_bh [T, 2]: the scores as the forward computes them, written straight
   into att's rows, then probs_row over each row's window; the keys outside
   it (the masked future, and the past before a sliding window) are set to
   exactly 0. */
static ALWAYS_INLINE void probs_head_body(int isa, float* att_bh, const float* stats_bh,
                                          const float* q, const float* k, float* panel,
                                          size_t row, int T, int hs, float slope, float scale,
                                          int window) {
    LLMC_ISA_SELECT(isa, build_panel)(panel, k, row, T, hs, scale);
    for (int t0 = 0; t0 < T;) {
        const int R = T - t0 >= SCORE_ROWS ? SCORE_ROWS : 1;
        float* att_t = att_bh + (size_t)t0 * T;
        const int k_first = first_block_key(t0, window);
        if (R == SCORE_ROWS) {
            score_tile(att_t, (size_t)T, q + (size_t)t0 * row, row, panel, hs, SCORE_ROWS,
                       t0 + 1, slope, k_first);
        } else {
            score_tile(att_t, (size_t)T, q + (size_t)t0 * row, row, panel, hs, 1, t0 + 1, slope,
                       k_first);
        }
        for (int r = 0; r < R; r++) {
            float* att_row = att_t + (size_t)r * T;
            const int lo = first_key(t0 + r, window);
            LLMC_ISA_SELECT(isa, probs_row)(att_row + lo, t0 + r + 1 - lo,
                                            stats_bh + 2 * (size_t)(t0 + r));
            zero_keys(att_row, 0, lo);
            zero_keys(att_row, t0 + r + 1, T);
        }
        t0 += R;
    }
}
LLMC_ISA_VARIANTS_ISA(probs_head, (float* att_bh, const float* stats_bh, const float* q,
                                   const float* k, float* panel, size_t row, int T, int hs,
                                   float slope, float scale, int window),
                      att_bh, stats_bh, q, k, panel, row, T, hs, slope, scale, window)

/* The row entropies entropy_bh [T] of one (b, h) from its statistics
   stats_bh [T, 2]: the scores as the forward computes them, a tile of rows
   at a time in s [SCORE_ROWS, T], then entropy_row of each. */
static ALWAYS_INLINE void entropy_head_body(int isa, float* entropy_bh, const float* stats_bh,
                                            const float* q, const float* k, float* panel,
                                            float* s, size_t row, int T, int hs, float slope,
                                            float scale, int window) {
    LLMC_ISA_SELECT(isa, build_panel)(panel, k, row, T, hs, scale);
    for (int t0 = 0; t0 < T;) {
        const int R = T - t0 >= SCORE_ROWS ? SCORE_ROWS : 1;
        const int k_first = first_block_key(t0, window);
        if (R == SCORE_ROWS) {
            score_tile(s, (size_t)T, q + (size_t)t0 * row, row, panel, hs, SCORE_ROWS, t0 + 1,
                       slope, k_first);
        } else {
            score_tile(s, (size_t)T, q + (size_t)t0 * row, row, panel, hs, 1, t0 + 1, slope,
                       k_first);
        }
        for (int r = 0; r < R; r++) {
            const int lo = first_key(t0 + r, window);
            LLMC_ISA_SELECT(isa, entropy_row)(entropy_bh + t0 + r, s + (size_t)r * T + lo,
                                              t0 + r + 1 - lo, stats_bh + 2 * (size_t)(t0 + r));
        }
        t0 += R;
    }
}
LLMC_ISA_VARIANTS_ISA(entropy_head, (float* entropy_bh, const float* stats_bh, const float* q,
                                     const float* k, float* panel, float* s, size_t row, int T,
                                     int hs, float slope, float scale, int window),
                      entropy_bh, stats_bh, q, k, panel, s, row, T, hs, slope, scale, window)

/* Query rows per block of the backward, whose P and dS it recomputes at
   once: a multiple of SCORE_ROWS and of TILE_KEYS (so that no key tile
   straddles a block's first row). Blocks of 32 or 128 rows were no faster. */
#define BACKWARD_ROWS 64

/* The rows of the backward's blocks of P and dS, for T query rows. */
static int backward_block_rows(int T) { return T < BACKWARD_ROWS ? T : BACKWARD_ROWS; }

/* One tile of R query rows t .. t+R-1 of head h's backward, in the block of
   rows that starts at t0 (p and ds are [BACKWARD_ROWS, T], row t at
   (t - t0) T): P recomputed from the scores and the forward's statistics
   stats_bh [T, 2], dP, dS over each row's window, then dq. The block's
   sums read keys from k_block (the first block key of its first row) on:
   a row's P and dS before its own first key are set to 0. With dropout
   (drop at the (b, h)), dP is d(P M / (1 - p)) through the mask, and p then
   holds P M / (1 - p), what the forward summed v with, for dv. */
static ALWAYS_INLINE void backward_rows(int isa, float* dq, float* p, float* ds,
                                        const float* stats_bh, const float* q,
                                        const float* dout_h, size_t C, const float* kpanel,
                                        const float* vpanel, const float* k, size_t row, int T,
                                        int hs, float slope, float scale, int window,
                                        llmc_dropout drop, int k_block, int t0, int t, int R) {
    float* p_t = p + (size_t)(t - t0) * T;
    float* ds_t = ds + (size_t)(t - t0) * T;
    const int k_first = first_block_key(t, window);
    score_tile(p_t, (size_t)T, q + (size_t)t * row, row, kpanel, hs, R, t + 1, slope, k_first);
    score_tile(ds_t, (size_t)T, dout_h + (size_t)t * C, C, vpanel, hs, R, t + 1, 0.0f,
               k_first);
    for (int r = 0; r < R; r++) {
        float* p_row = p_t + (size_t)r * T;
        float* ds_row = ds_t + (size_t)r * T;
        const int lo = first_key(t + r, window), n = t + r + 1 - lo;
        LLMC_ISA_SELECT(isa, probs_row)(p_row + lo, n, stats_bh + 2 * (size_t)(t + r));
        if (llmc_dropout_on(drop)) { llmc_dropout_row(ds_row + lo, ds_row + lo, lo, n, drop, t + r); }
        LLMC_ISA_SELECT(isa, dscore_row)(ds_row + lo, p_row + lo, n, scale);
        if (llmc_dropout_on(drop)) { llmc_dropout_row(p_row + lo, p_row + lo, lo, n, drop, t + r); }
        zero_keys(p_row, k_block, lo);
        zero_keys(ds_row, k_block, lo);
    }
    const int R_dq = R < TILE_ROWS ? R : TILE_ROWS;
    for (int r = 0; r < R; r += R_dq) {
        const int lo = first_key(t + r, window);
        rows_tile(dq + (size_t)(t + r) * row, row, 1, ds_t + (size_t)r * T + lo, (size_t)T,
                  k + (size_t)lo * row, row, R_dq, t + r + 1 - lo, hs);
    }
}

/* The backward of one (b, kv head g): its query heads h in order, each in
   blocks of BACKWARD_ROWS query rows. Rows of inp_b and dinp_b lie row
   floats apart, of dout_b C apart; stats_b is stats[b] [NH, T, 2]; k_head
   and v_head are the offsets of g's k and v in a row. scratch holds a key
   panel and a panel of v (panel_count(T, hs) each), then the blocks of P
   and dS ([min(T, BACKWARD_ROWS), T] each). drop is at batch row b. */
static ALWAYS_INLINE void backward_group_body(int isa, float* dinp_b, const float* dout_b,
                                              const float* inp_b, const float* stats_b,
                                              const float* slopes, float* scratch, int h0,
                                              int h1, size_t k_head, size_t v_head, size_t row,
                                              size_t C, int T, int hs, float scale, int window,
                                              llmc_dropout drop) {
    const size_t panel_len = panel_count(T, hs);
    float* kpanel = scratch;
    float* vpanel = kpanel + panel_len;
    float* p = vpanel + panel_len;
    float* ds = p + (size_t)backward_block_rows(T) * T;
    const float* k = inp_b + k_head;
    LLMC_ISA_SELECT(isa, build_panel)(kpanel, k, row, T, hs, scale);
    LLMC_ISA_SELECT(isa, build_panel)(vpanel, inp_b + v_head, row, T, hs, 1.0f);
    for (int h = h0; h < h1; h++) {
        const float* stats_bh = stats_b + (size_t)h * T * 2;
        const float* q = inp_b + (size_t)h * hs;
        const float* dout_h = dout_b + (size_t)h * hs;
        float* dq = dinp_b + (size_t)h * hs;
        const float slope = slopes != NULL ? slopes[h] : 0.0f;
        llmc_dropout drop_h = drop;   // head h's rows start at h T
        drop_h.first_row = (int64_t)h * T;
        for (int t0 = 0; t0 < T; t0 += BACKWARD_ROWS) {
            const int t1 = T - t0 < BACKWARD_ROWS ? T : t0 + BACKWARD_ROWS;
            const int k_block = first_block_key(t0, window);
            int t = t0;
            for (; t + SCORE_ROWS <= t1; t += SCORE_ROWS) {
                backward_rows(isa, dq, p, ds, stats_bh, q, dout_h, C, kpanel, vpanel, k, row, T,
                              hs, slope, scale, window, drop_h, k_block, t0, t, SCORE_ROWS);
            }
            for (; t < t1; t++) {
                backward_rows(isa, dq, p, ds, stats_bh, q, dout_h, C, kpanel, vpanel, k, row, T,
                              hs, slope, scale, window, drop_h, k_block, t0, t, 1);
            }
            // dk += dS^T q and dv += P^T dO over the block's rows, for every
            // key from the block's first (a multiple of 16, so no tile
            // straddles t0) up to its last row, TILE_KEYS keys at a time
            int t2 = k_block;
            for (; t2 + TILE_KEYS <= t1; t2 += TILE_KEYS) {
                cols_tile(dinp_b + (size_t)t2 * row + k_head, row, ds, (size_t)T, q, row,
                          TILE_KEYS, t2, t0, t1, hs);
                cols_tile(dinp_b + (size_t)t2 * row + v_head, row, p, (size_t)T, dout_h, C,
                          TILE_KEYS, t2, t0, t1, hs);
            }
            for (; t2 < t1; t2++) {
                cols_tile(dinp_b + (size_t)t2 * row + k_head, row, ds, (size_t)T, q, row,
                          1, t2, t0, t1, hs);
                cols_tile(dinp_b + (size_t)t2 * row + v_head, row, p, (size_t)T, dout_h, C,
                          1, t2, t0, t1, hs);
            }
        }
    }
}
LLMC_ISA_VARIANTS_ISA(backward_group, (float* dinp_b, const float* dout_b, const float* inp_b,
                                       const float* stats_b, const float* slopes, float* scratch,
                                       int h0, int h1, size_t k_head, size_t v_head, size_t row,
                                       size_t C, int T, int hs, float scale, int window,
                                       llmc_dropout drop),
                      dinp_b, dout_b, inp_b, stats_b, slopes, scratch, h0, h1, k_head, v_head,
                      row, C, T, hs, scale, window, drop)

/* The backward core; sizes already checked. slopes may be NULL. */
static int gqa_backward(float* dinp, const float* dout, const float* inp, const float* stats,
                        const float* slopes, int B, int T, int NH, int NKV, int hs, int window,
                        llmc_dropout drop) {
    const size_t C = (size_t)NH * hs;
    const size_t row = ((size_t)NH + 2 * (size_t)NKV) * hs;
    const size_t v_start = C + (size_t)NKV * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    void (*const group)(float*, const float*, const float*, const float*, const float*, float*,
                        int, int, size_t, size_t, size_t, size_t, int, int, float, int,
                        llmc_dropout) =
        LLMC_ISA_SELECT(llmc_get_isa(), backward_group);
    // per thread: a key panel, a panel of v, then a block of P and one of dS
    const size_t per_thread = 2 * panel_count(T, hs) + 2 * (size_t)backward_block_rows(T) * T;
    float* scratch = alloc_scratch(per_thread);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int g = 0; g < NKV; g++) {
            group(dinp + (size_t)b * T * row, dout + (size_t)b * T * C, inp + (size_t)b * T * row,
                  stats + (size_t)b * NH * T * 2, slopes,
                  scratch + (size_t)omp_get_thread_num() * per_thread, g * kv_mul,
                  (g + 1) * kv_mul, C + (size_t)g * hs, v_start + (size_t)g * hs, row, C, T, hs,
                  scale, window, llmc_dropout_at(drop, b, 0));
        }
    }
    free(scratch);
    return LLMC_OK;
}

/* The probabilities core; sizes already checked. slopes may be NULL. */
static int gqa_probs(float* att, const float* inp, const float* stats, const float* slopes,
                     int B, int T, int NH, int NKV, int hs, int window) {
    const size_t C = (size_t)NH * hs;
    const size_t row = ((size_t)NH + 2 * (size_t)NKV) * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    void (*const head)(float*, const float*, const float*, const float*, float*, size_t, int,
                       int, float, float, int) = LLMC_ISA_SELECT(llmc_get_isa(), probs_head);
    const size_t per_thread = panel_count(T, hs);   // a key panel
    float* scratch = alloc_scratch(per_thread);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float* inp_b = inp + (size_t)b * T * row;
            const size_t bh = (size_t)b * NH + h;
            head(att + bh * T * T, stats + bh * T * 2, inp_b + (size_t)h * hs,
                 inp_b + C + (size_t)(h / kv_mul) * hs,
                 scratch + (size_t)omp_get_thread_num() * per_thread, row, T, hs,
                 slopes != NULL ? slopes[h] : 0.0f, scale, window);
        }
    }
    free(scratch);
    return LLMC_OK;
}

/* The entropy core; sizes already checked. slopes may be NULL. */
static int gqa_entropy(float* entropy, const float* inp, const float* stats,
                       const float* slopes, int B, int T, int NH, int NKV, int hs, int window) {
    const size_t C = (size_t)NH * hs;
    const size_t row = ((size_t)NH + 2 * (size_t)NKV) * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    void (*const head)(float*, const float*, const float*, const float*, float*, float*, size_t,
                       int, int, float, float, int) = LLMC_ISA_SELECT(llmc_get_isa(), entropy_head);
    // per thread: a key panel, then the scores of one tile of rows
    const size_t panel_len = panel_count(T, hs);
    const size_t per_thread = panel_len + (size_t)SCORE_ROWS * T;
    float* scratch = alloc_scratch(per_thread);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            float* panel = scratch + (size_t)omp_get_thread_num() * per_thread;
            const float* inp_b = inp + (size_t)b * T * row;
            const size_t bh = (size_t)b * NH + h;
            head(entropy + bh * T, stats + bh * T * 2, inp_b + (size_t)h * hs,
                 inp_b + C + (size_t)(h / kv_mul) * hs, panel, panel + panel_len, row, T, hs,
                 slopes != NULL ? slopes[h] : 0.0f, scale, window);
        }
    }
    free(scratch);
    return LLMC_OK;
}

int attention_forward(float* out, float* stats, const float* inp,
                      int B, int T, int C, int NH) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, stats, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, 2), LLMC_ERR_SHAPE);
    return gqa_forward(out, stats, inp, NULL, B, T, NH, NH, C / NH, 0, llmc_dropout_of(0.0f, 0));
}

int attention_backward(float* dinp, const float* dout, const float* inp, const float* stats,
                       int B, int T, int C, int NH) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, 2), LLMC_ERR_SHAPE);
    return gqa_backward(dinp, dout, inp, stats, NULL, B, T, NH, NH, C / NH, 0,
                        llmc_dropout_of(0.0f, 0));
}

/* The sizes of a GQA call are positive (the window >= 0), NH % NKV == 0,
   and its arrays (inp, and stats [B, NH, T, 2]) can exist. */
static int gqa_sizes_ok(int B, int T, int NH, int NKV, int hs, int window) {
    return B > 0 && T > 0 && NH > 0 && NKV > 0 && hs > 0 && NH % NKV == 0 && window >= 0
           && llmc_count_fits(B, T, (size_t)NH + 2 * (size_t)NKV, hs)
           && llmc_count_fits(B, NH, T, 2);
}

/* As gqa_sizes_ok, for a call with a full att [B, NH, T, T]. */
static int gqa_att_sizes_ok(int B, int T, int NH, int NKV, int hs, int window) {
    return gqa_sizes_ok(B, T, NH, NKV, hs, window) && llmc_count_fits(B, NH, T, T);
}

int attention_gqa_forward(float* out, float* stats, const float* inp, const float* slopes,
                          int B, int T, int NH, int NKV, int hs, int window, float dropout,
                          uint64_t seed) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, stats, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    return gqa_forward(out, stats, inp, slopes, B, T, NH, NKV, hs, window,
                       llmc_dropout_of(dropout, seed));
}

int attention_gqa_backward(float* dinp, const float* dout, const float* inp, const float* stats,
                           const float* slopes, int B, int T, int NH, int NKV, int hs,
                           int window, float dropout, uint64_t seed) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    return gqa_backward(dinp, dout, inp, stats, slopes, B, T, NH, NKV, hs, window,
                        llmc_dropout_of(dropout, seed));
}

int attention_gqa_probs(float* att, const float* inp, const float* stats, const float* slopes,
                        int B, int T, int NH, int NKV, int hs, int window) {
    LLMC_REQUIRE(LLMC_NONNULL3(att, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_att_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    return gqa_probs(att, inp, stats, slopes, B, T, NH, NKV, hs, window);
}

int attention_gqa_entropy(float* entropy, const float* inp, const float* stats,
                          const float* slopes, int B, int T, int NH, int NKV, int hs,
                          int window) {
    LLMC_REQUIRE(LLMC_NONNULL3(entropy, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    return gqa_entropy(entropy, inp, stats, slopes, B, T, NH, NKV, hs, window);
}

int attention_forward_naive(float* out, float* att, const float* inp, const float* slopes,
                            int B, int T, int NH, int NKV, int hs, int window, float dropout,
                            uint64_t seed) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, att, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_att_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    const llmc_dropout drop = llmc_dropout_of(dropout, seed);
    const size_t C = (size_t)NH * hs, row = ((size_t)NH + 2 * (size_t)NKV) * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);

    #pragma omp parallel for collapse(3) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < NH; h++) {
                const float* inp_b = inp + (size_t)b * T * row;
                const float* q = inp_b + (size_t)t * row + (size_t)h * hs;
                const size_t k_off = C + (size_t)(h / kv_mul) * hs;   // v: NKV heads later
                const float slope = slopes != NULL ? slopes[h] : 0.0f;
                float* att_bth = att + (((size_t)b * NH + h) * T + t) * T;
                const int lo = first_key(t, window);   // the row's keys: lo .. t
                // pass 1: the scores and their max
                float maxval = -INFINITY;
                for (int t2 = lo; t2 <= t; t2++) {
                    const float* k = inp_b + (size_t)t2 * row + k_off;
                    float val = 0.0f;
                    for (int i = 0; i < hs; i++) { val += q[i] * k[i]; }
                    val = val * scale - slope * (float)(t - t2);
                    att_bth[t2] = val;
                    if (val > maxval) { maxval = val; }
                }
                // pass 2: the exponentials and their sum
                float expsum = 0.0f;
                for (int t2 = lo; t2 <= t; t2++) {
                    const float e = expf(att_bth[t2] - maxval);
                    expsum += e;
                    att_bth[t2] = e;
                }
                // pass 3: normalise; keys outside the window are exactly 0
                const float expsum_inv = 1.0f / expsum;
                for (int t2 = 0; t2 < T; t2++) {
                    att_bth[t2] = t2 >= lo && t2 <= t ? att_bth[t2] * expsum_inv : 0.0f;
                }
                // pass 4: the weighted sum of the values, each weight
                // through the dropout (the identity without)
                const uint32_t bits = llmc_dropout_row_bits(llmc_dropout_at(drop, b, 0),
                                                            (int64_t)h * T + t);
                float* out_bth = out + ((size_t)b * T + t) * C + (size_t)h * hs;
                for (int i = 0; i < hs; i++) { out_bth[i] = 0.0f; }
                for (int t2 = lo; t2 <= t; t2++) {
                    const float* v = inp_b + (size_t)t2 * row + k_off + (size_t)NKV * hs;
                    const float a = llmc_dropout_one(att_bth[t2], bits, t2, drop);
                    for (int i = 0; i < hs; i++) { out_bth[i] += a * v[i]; }
                }
            }
        }
    }
    return LLMC_OK;
}

int attention_backward_naive(float* dinp, const float* dout, const float* inp, const float* att,
                             int B, int T, int NH, int NKV, int hs, int window, float dropout,
                             uint64_t seed) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, att), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_att_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    const llmc_dropout drop = llmc_dropout_of(dropout, seed);
    const size_t C = (size_t)NH * hs, row = ((size_t)NH + 2 * (size_t)NKV) * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);

    // dk and dv of a kv head gather from its whole group of query heads, so
    // parallelise over (b, kv head), and walk the group's heads in order
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int g = 0; g < NKV; g++) {
            const float* inp_b = inp + (size_t)b * T * row;
            float* dinp_b = dinp + (size_t)b * T * row;
            const size_t k_off = C + (size_t)g * hs, v_off = k_off + (size_t)NKV * hs;
            for (int h = g * kv_mul; h < (g + 1) * kv_mul; h++) {
                for (int t = 0; t < T; t++) {
                    const float* att_bth = att + (((size_t)b * NH + h) * T + t) * T;
                    const float* dout_bth = dout + ((size_t)b * T + t) * C + (size_t)h * hs;
                    const float* q = inp_b + (size_t)t * row + (size_t)h * hs;
                    float* dq = dinp_b + (size_t)t * row + (size_t)h * hs;
                    const int lo = first_key(t, window);
                    const uint32_t bits = llmc_dropout_row_bits(llmc_dropout_at(drop, b, 0),
                                                                (int64_t)h * T + t);
                    // datt[t2] = dout . v[t2], through the dropout; through
                    // the softmax, dpreatt[t2] = att[t2] * (datt[t2] - sum_t3
                    // att[t3] datt[t3])
                    float att_datt = 0.0f;
                    for (int t2 = lo; t2 <= t; t2++) {
                        const float* v = inp_b + (size_t)t2 * row + v_off;
                        float datt = 0.0f;
                        for (int i = 0; i < hs; i++) { datt += dout_bth[i] * v[i]; }
                        att_datt += att_bth[t2] * llmc_dropout_one(datt, bits, t2, drop);
                    }
                    for (int t2 = lo; t2 <= t; t2++) {
                        const float* k = inp_b + (size_t)t2 * row + k_off;
                        const float* v = inp_b + (size_t)t2 * row + v_off;
                        float* dk = dinp_b + (size_t)t2 * row + k_off;
                        float* dv = dinp_b + (size_t)t2 * row + v_off;
                        float datt = 0.0f;
                        for (int i = 0; i < hs; i++) { datt += dout_bth[i] * v[i]; }
                        datt = llmc_dropout_one(datt, bits, t2, drop);
                        const float dpreatt = att_bth[t2] * (datt - att_datt) * scale;
                        const float att_dropped = llmc_dropout_one(att_bth[t2], bits, t2, drop);
                        for (int i = 0; i < hs; i++) {
                            dv[i] += att_dropped * dout_bth[i];
                            dq[i] += dpreatt * k[i];
                            dk[i] += dpreatt * q[i];
                        }
                    }
                }
            }
        }
    }
    return LLMC_OK;
}

int attention_entropy_naive(float* entropy, const float* att, int B, int NH, int T) {
    LLMC_REQUIRE(LLMC_NONNULL2(entropy, att), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && NH > 0 && T > 0 && llmc_count_fits(B, NH, T, T), LLMC_ERR_SHAPE);
    const long rows = (long)B * NH * T;

    // rows are independent; the masked future (t2 > t) is not read
    #pragma omp parallel for schedule(static)
    for (long bht = 0; bht < rows; bht++) {
        const int t = (int)(bht % T);
        const float* att_bht = att + (size_t)bht * T;
        float sum = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) {
            const float p = att_bht[t2];
            if (p > 0.0f) { sum -= p * logf(p); }   // p ln p -> 0 as p -> 0
        }
        entropy[bht] = sum;
    }
    return LLMC_OK;
}

/* decode_scores with R (1 .. DECODE_HEADS) a constant in each case. */
static ALWAYS_INLINE void decode_scores_any(float* s, size_t lds, const float* q, size_t ldq,
                                            const float* slopes, const float* k, size_t stride,
                                            int n, int dist0, int hs, float scale, int R) {
    switch (R) {
    case 4: decode_scores(s, lds, q, ldq, slopes, k, stride, n, dist0, hs, scale, 4); break;
    case 3: decode_scores(s, lds, q, ldq, slopes, k, stride, n, dist0, hs, scale, 3); break;
    case 2: decode_scores(s, lds, q, ldq, slopes, k, stride, n, dist0, hs, scale, 2); break;
    default: decode_scores(s, lds, q, ldq, slopes, k, stride, n, dist0, hs, scale, 1); break;
    }
}

/* The decode of R query heads (R <= DECODE_HEADS) that share one kv head,
   each the forward's last row of a window of n keys: its scores,
   softmax_row and rows_tile. The keys lie in the cache's ring of maxT slots
   from slot first on, wrapping to slot 0: two stretches, each summed in
   order (the second carries the first's sums through out, exactly).
   out_h0, att_h0, q_h0 and slopes_h0 start at the first of the R heads. */
static ALWAYS_INLINE void decode_unit_body(int isa, float* out_h0, float* att_h0,
                                           const float* q_h0, const float* k, const float* v,
                                           const float* slopes_h0, int n, int first,
                                           size_t kv_row, int hs, int maxT, float scale, int R) {
    const int n1 = maxT - first < n ? maxT - first : n;   // keys before the wrap
    const size_t at = (size_t)first * kv_row;
    decode_scores_any(att_h0, maxT, q_h0, hs, slopes_h0, k + at, kv_row, n1, n - 1, hs, scale,
                      R);
    if (n1 < n) {
        decode_scores_any(att_h0 + n1, maxT, q_h0, hs, slopes_h0, k, kv_row, n - n1, n - 1 - n1,
                          hs, scale, R);
    }
    for (int r = 0; r < R; r++) {
        float* att_h = att_h0 + (size_t)r * maxT;
        LLMC_ISA_SELECT(isa, softmax_row)(att_h, n, NULL);
        rows_tile(out_h0 + (size_t)r * hs, hs, 0, att_h, maxT, v + at, kv_row, 1, n1, hs);
        if (n1 < n) {
            rows_tile(out_h0 + (size_t)r * hs, hs, 1, att_h + n1, maxT, v, kv_row, 1, n - n1, hs);
        }
    }
}
LLMC_ISA_VARIANTS_ISA(decode_unit, (float* out_h0, float* att_h0, const float* q_h0,
                                    const float* k, const float* v, const float* slopes_h0, int n,
                                    int first, size_t kv_row, int hs, int maxT, float scale,
                                    int R),
                      out_h0, att_h0, q_h0, k, v, slopes_h0, n, first, kv_row, hs, maxT, scale,
                      R)

int attention_decode(float* out, float* att, const float* q, const float* k_cache,
                     const float* v_cache, const int* len, const float* slopes,
                     int B, int NH, int NKV, int hs, int maxT, int window) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, att, q) && LLMC_NONNULL3(k_cache, v_cache, len),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && NH > 0 && NKV > 0 && hs > 0 && maxT > 0 && NH % NKV == 0
                 && window >= 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, maxT, NKV, hs) && llmc_count_fits(B, NH, maxT, 1)
                 && llmc_count_fits(B, NH, hs, 1), LLMC_ERR_SHAPE);
    for (int b = 0; b < B; b++) {   // the keys a row attends to fit in the cache
        LLMC_REQUIRE(len[b] >= 1 && len[b] - first_key(len[b] - 1, window) <= maxT,
                     LLMC_ERR_RANGE);
    }
    const size_t kv_row = (size_t)NKV * hs;       // one cached position (q, out: NH hs)
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    // units of up to DECODE_HEADS query heads of one kv head
    const int chunks = (kv_mul + DECODE_HEADS - 1) / DECODE_HEADS;
    void (*const unit)(float*, float*, const float*, const float*, const float*, const float*,
                       int, int, size_t, int, int, float, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), decode_unit);

    #pragma omp parallel for collapse(3) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int g = 0; g < NKV; g++) {
            for (int c = 0; c < chunks; c++) {
                const int h0 = g * kv_mul + c * DECODE_HEADS;
                const int R = (g + 1) * kv_mul - h0 < DECODE_HEADS ? (g + 1) * kv_mul - h0
                                                                   : DECODE_HEADS;
                const size_t kv = (size_t)b * maxT * kv_row + (size_t)g * hs;
                const size_t bh0 = (size_t)b * NH + h0;
                const int lo = first_key(len[b] - 1, window);   // position lo is in slot lo % maxT
                unit(out + bh0 * hs, att + bh0 * maxT, q + bh0 * hs, k_cache + kv, v_cache + kv,
                     slopes != NULL ? slopes + h0 : NULL, len[b] - lo, lo % maxT, kv_row, hs,
                     maxT, scale, R);
            }
        }
    }
    return LLMC_OK;
}
