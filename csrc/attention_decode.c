/*
 * attention_decode: one forward row per (b, h) against a KV cache, bitwise
 * that position's row of attention_gqa_forward (attention.c).
 *
 * Parallel over (b, kv head, chunk of up to DECODE_HEADS of its query
 * heads). It transposes 16 x 16 blocks of cached keys on the fly, once for
 * the chunk's heads, instead of building a panel (no allocation per call,
 * one pass over the cache); key_block gives the panel's values, so its
 * scores are the forward's, lane by lane. It then runs the forward's
 * softmax_row and rows_tile's sums (one row's, each row of values loaded
 * once for the chunk's heads), so a decoded position equals that position
 * of a full forward bitwise. The scores need a row of up to maxT
 * floats per (b, h): the caller's att buffer holds them, since a stack
 * buffer of maxT floats could overflow a worker thread's stack for long
 * contexts.
 *
 * variants: built per instruction set (isa.h) and chosen at run time; its
 * plain twin is a full attention_forward_naive, whose last row it is.
 */
#include "llmc.h"
#include "common.h"
#include "isa.h"
#include "attention.h"
#include "attention_tiles.h"

#define DECODE_HEADS 4  /* query heads of a kv head the decode scores at once */

LLMC_ISA_VARIANTS_ISA(softmax_row, (float* p, int n, float* stats), p, n, stats)

/* positions the scores prefetch a kv head's keys ahead of the block they reach */
#define PREFETCH_KEYS 32

/* Prefetches rows [r0, min(r1, n)) of x (stride floats apart), hs floats
   each: into L1 (keys, read next) or L2 (values, read after the softmax).
   A kv head's row of one cached position lies a whole cache row (NKV hs
   floats) from the next, in another page at the usual sizes: the hardware
   prefetchers do not follow such a walk. */
static ALWAYS_INLINE void prefetch_cache_rows(const float* x, size_t stride, int r0, int r1,
                                              int n, int hs, int to_l1) {
    for (int r = r0; r < (r1 < n ? r1 : n); r++) {
        for (int i = 0; i < hs; i += 16) {
            if (to_l1) { __builtin_prefetch(x + (size_t)r * stride + i, 0, 3); }
            else { __builtin_prefetch(x + (size_t)r * stride + i, 0, 2); }
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
                                        const float* slopes, const float* k, const float* v,
                                        size_t stride, int n, int dist0, int hs, float scale,
                                        int R) {
    prefetch_cache_rows(k, stride, 0, PREFETCH_KEYS, n, hs, 1);
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        prefetch_cache_rows(k, stride, k0 + PREFETCH_KEYS, k0 + PREFETCH_KEYS + 16, n, hs, 1);
        prefetch_cache_rows(v, stride, k0, k0 + 16, n, hs, 0);
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

/* decode_scores with R (1 .. DECODE_HEADS) a constant in each case. Built
   per instruction set, out of the decode's body, as is decode_values: with
   both inlined twice into it, gcc 12 took 297 s over this file (Zen 1),
   nearly all in passes whose time grows faster than a function's size (PRE,
   load CSE after reload); 58 s so. */
static ALWAYS_INLINE void decode_scores_any_body(float* s, size_t lds, const float* q,
                                                 size_t ldq, const float* slopes, const float* k,
                                                 const float* v, size_t stride, int n, int dist0,
                                                 int hs, float scale, int R) {
    switch (R) {
    case 4: decode_scores(s, lds, q, ldq, slopes, k, v, stride, n, dist0, hs, scale, 4); break;
    case 3: decode_scores(s, lds, q, ldq, slopes, k, v, stride, n, dist0, hs, scale, 3); break;
    case 2: decode_scores(s, lds, q, ldq, slopes, k, v, stride, n, dist0, hs, scale, 2); break;
    default: decode_scores(s, lds, q, ldq, slopes, k, v, stride, n, dist0, hs, scale, 1); break;
    }
}
LLMC_ISA_VARIANTS(decode_scores_any, (float* s, size_t lds, const float* q, size_t ldq,
                                      const float* slopes, const float* k, const float* v,
                                      size_t stride, int n, int dist0, int hs, float scale, int R),
                  s, lds, q, ldq, slopes, k, v, stride, n, dist0, hs, scale, R)

/* rows_tile's chunk (attention_tiles.h) for R heads that all have n value
   rows: each loaded row of values serves the R heads (rows_tile's rows
   differ by a key, a decode's heads do not). A head's sum takes the same
   FMAs in the same order as rows_tile of its one row: bitwise equal. */
static ALWAYS_INLINE void decode_values_chunk(float* o, size_t ldo, int accumulate,
                                              const float* a, size_t lda, const float* x,
                                              size_t ldx, int R, int n, int NV, int mlast) {
    vec16f acc[DECODE_HEADS][TILE_CH / 16], xv[TILE_CH / 16];
    UNROLL for (int r = 0; r < R; r++) {
        if (accumulate) {
            load_chunk(acc[r], o + (size_t)r * ldo, NV, mlast);
        } else {
            UNROLL for (int v = 0; v < NV; v++) { acc[r][v] = (vec16f){0}; }
        }
    }
    for (int t2 = 0; t2 < n; t2++) {
        load_shared_chunk(xv, x + (size_t)t2 * ldx, NV, mlast);
        UNROLL for (int r = 0; r < R; r++) { fma_chunk(acc[r], a[(size_t)r * lda + t2], xv, NV); }
    }
    UNROLL for (int r = 0; r < R; r++) { store_chunk(o + (size_t)r * ldo, acc[r], NV, mlast); }
}

/* decode_values_chunk for a chunk of one vector (m <= 16 channels), its
   sums in halves (AVX2 and the portable build; see half16f in
   attention_tiles.h), as rows_tile's chunks there: bitwise equal still. */
static ALWAYS_INLINE void decode_values_halves(float* o, size_t ldo, int accumulate,
                                               const float* a, size_t lda, const float* x,
                                               size_t ldx, int R, int n, int m) {
    half16f lo[DECODE_HEADS], hi[DECODE_HEADS];
    start_halves(lo, hi, o, ldo, accumulate, R, m);
    for (int t2 = 0; t2 < n; t2++) {
        add_row_halves(lo, hi, a + t2, lda, x + (size_t)t2 * ldx, 0, R, m);
    }
    store_halves(o, ldo, lo, hi, R, m);
}

/* o[r][c] = (accumulate ? o[r][c] : 0) + sum_{t2 < n} a[r][t2] * x[t2][c]
   for R heads (1 .. DECODE_HEADS, a constant in each case), c < hs. */
static ALWAYS_INLINE void decode_values_body(int isa, float* o, size_t ldo, int accumulate,
                                             const float* a, size_t lda, const float* x,
                                             size_t ldx, int R, int n, int hs) {
    if (isa < LLMC_ISA_AVX512) {   // chunks of one vector
        for (int c0 = 0; c0 < hs; c0 += 16) {
            const int m = hs - c0 < 16 ? hs - c0 : 16;
#define VALUES_HALVES(R_) \
            decode_values_halves(o + c0, ldo, accumulate, a, lda, x + c0, ldx, R_, n, m)
            switch (R) {
            case 4: VALUES_HALVES(4); break;
            case 3: VALUES_HALVES(3); break;
            case 2: VALUES_HALVES(2); break;
            default: VALUES_HALVES(1); break;
            }
#undef VALUES_HALVES
        }
        return;
    }
    for (int c0 = 0; c0 < hs; c0 += TILE_CH) {
        const int nc = hs - c0 < TILE_CH ? hs - c0 : TILE_CH;
#define VALUES_CHUNK(NV, mlast)                                                            \
        switch (R) {                                                                      \
        case 4: decode_values_chunk(o + c0, ldo, accumulate, a, lda, x + c0, ldx, 4, n,   \
                                    NV, mlast); break;                                    \
        case 3: decode_values_chunk(o + c0, ldo, accumulate, a, lda, x + c0, ldx, 3, n,   \
                                    NV, mlast); break;                                    \
        case 2: decode_values_chunk(o + c0, ldo, accumulate, a, lda, x + c0, ldx, 2, n,   \
                                    NV, mlast); break;                                    \
        default: decode_values_chunk(o + c0, ldo, accumulate, a, lda, x + c0, ldx, 1, n,  \
                                     NV, mlast); break;                                   \
        }
        DISPATCH_CHUNK(nc, VALUES_CHUNK);
#undef VALUES_CHUNK
    }
}
LLMC_ISA_VARIANTS_ISA(decode_values, (float* o, size_t ldo, int accumulate, const float* a,
                                      size_t lda, const float* x, size_t ldx, int R, int n,
                                      int hs),
                      o, ldo, accumulate, a, lda, x, ldx, R, n, hs)

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
    LLMC_ISA_SELECT(isa, decode_scores_any)(att_h0, maxT, q_h0, hs, slopes_h0, k + at, v + at,
                                            kv_row, n1, n - 1, hs, scale, R);
    if (n1 < n) {
        LLMC_ISA_SELECT(isa, decode_scores_any)(att_h0 + n1, maxT, q_h0, hs, slopes_h0, k, v,
                                                kv_row, n - n1, n - 1 - n1, hs, scale, R);
    }
    for (int r = 0; r < R; r++) {
        LLMC_ISA_SELECT(isa, softmax_row)(att_h0 + (size_t)r * maxT, n, NULL);
    }
    LLMC_ISA_SELECT(isa, decode_values)(out_h0, hs, 0, att_h0, maxT, v + at, kv_row, R, n1, hs);
    if (n1 < n) {
        LLMC_ISA_SELECT(isa, decode_values)(out_h0, hs, 1, att_h0 + n1, maxT, v, kv_row, R,
                                            n - n1, hs);
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
