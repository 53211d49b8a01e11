/*
 * Causal self-attention, forward and backward: GPT-2's multi-head layout and
 * grouped-query attention (GQA) with optional ALiBi and a sliding window,
 * built from the tiles of attention_tiles.h; and the per-head driver that
 * runs them and attention_probs.c's kernels.
 *
 * One core serves both. GPT-2's packed row (q, k, v, each C = NH hs wide) is
 * the grouped layout with NKV == NH, and "no slopes" is a slope of 0, so
 * attention_forward/backward are the GQA kernels with those arguments, with
 * the same offsets and the same order of every sum.
 *
 * Memory grows with T, not T^2 (FlashAttention's idea, in this exact form):
 * the forward keeps only two numbers per query row, the max of its scores
 * and the inverse of its sum of exponentials (stats [B, NH, T, 2]), and the
 * backward recomputes the probabilities from them, block by block. Both
 * recompute the scores with the same score_tile on the same key panel, and
 * P = exp(s - max) * inv by the same vector operations as softmax_row, so
 * the backward's P is bitwise the forward's, and so is every sum built on it.
 *
 * One driver (llmc_attention_heads) runs every tiled kernel but the decode:
 * parallel over (b, head), each thread a contiguous share with its own
 * scratch, a slice of the kernels' arena (scratch.h), kept between calls.
 * The forward, probabilities and entropy take a query head each, the
 * backward a kv head with its group.
 *
 * Forward, per (b, h): the key panel of the head's kv head is built with
 * the 1/sqrt(hs) scale folded in (a product of its own, before the sums),
 * then per tile of SCORE_ROWS query rows, in a per-thread scratch of
 * SCORE_ROWS x T scores,
 *   scores = score_tile(q, panel), starting from the bias -slope * (t - t2)
 *   P      = softmax_row of each row (its reductions for the tile at once:
 *            softmax_tile_exps), which also writes the row's max, inv
 *   out    = rows_tile(P, v)
 * Scratch per thread: the panel (T hs) and the tile (SCORE_ROWS T) floats.
 *
 * Backward, per (b, kv head). A kv head's dk and dv gather from all
 * NH / NKV query heads of its group, so one thread owns the group and
 * walks its query heads in order, each in blocks of BACKWARD_ROWS query
 * rows t0 .. t1-1. With dO = dout of head h, per tile of the block's rows:
 *   P  = exp(score_tile(q, key panel) - max) * inv     probs_row
 *   dP = dO V^T                  score_tile against a panel of v, no scale
 *   dS = P * (dP - rowsum(P * dP)) / sqrt(hs)          dscore_tile
 *   dq += dS K                   rows_tile
 * then, for every key t2 < t1, over the block's rows t >= t2:
 *   dk += dS^T Q                 cols_tile
 *   dv += P^T dO                 cols_tile
 * (a key tile before the block takes the full rectangle of its rows, one on
 * the block's diagonal the triangle, then the rest). dq, dk and dv are
 * summed onto dinp's values in place (written: dq's one sum per row starts
 * from 0, and the group's dk, dv rows are zeroed first, so dinp is never
 * read and the bits are those of a zeroed dinp); an element of dk or dv
 * sums over the group's heads in order, then over t ascending, blocks
 * carrying the partial sum through dinp (a float, so a store and a load
 * change nothing). No two
 * threads touch the same element, and every element is summed in one order
 * whatever the thread count. Scratch per thread: the key panel and the
 * panel of v (T hs each) and the blocks of P and dS (min(T, BACKWARD_ROWS)
 * x T each).
 *
 * A sliding window of W keys (window > 0) bounds every key loop below: row
 * t's keys are lo(t) = max(0, t - W + 1) .. t. A tile's scores start at the
 * panel block of its first row's lo; each row's softmax (and probs_row,
 * dscore_tile, entropy_row) runs over its own window; the sums over keys
 * that a tile's rows share start at the first row's lo, and the later rows'
 * entries before their own lo are set to 0 first (an added 0 * x changes no
 * bit). So time is O(T W), and a row sums the same terms in the same order
 * as attention_decode over a rolling cache of its window. The backward's
 * dk, dv loops start at the block's first key, 16-aligned.
 *
 * Dropout on the probabilities (training): the forward drops each row of P
 * after softmax_row, P M / (1 - p) with M a hash of (b, h T + t, t2)
 * (dropout.h), so stats stay those of P; the backward regenerates the mask
 * row by row: dP goes through it before dscore_tile, and P, once dS is made,
 * takes it for dv. A row's mask covers its window's keys only.
 *
 * variants (the family's files):
 *   attention_forward / _backward, attention_gqa_forward / _backward
 *                      this file: the tiled kernels above, built per
 *                      instruction set (isa.h) and chosen at run time; they
 *                      keep stats
 *   attention_gqa_probs, attention_gqa_entropy
 *                      attention_probs.c: P, or each row's entropy,
 *                      recomputed from stats by the forward's tiles
 *   attention_gqa_forward_bf16 / _backward_bf16
 *                      attention_bf16.c: the same contract with the
 *                      products on bf16 operands (bf16 models)
 *   attention_decode   attention_decode.c: one forward row per (b, h)
 *                      against a KV cache, bitwise the forward's
 *   attention_forward_naive / _backward_naive, attention_entropy_naive
 *                      attention_naive.c: the plain loops that keep the
 *                      whole of att [B, NH, T, T], the reference the tests
 *                      and the benchmark check the tiled kernels against
 */
#include <string.h>
#include "llmc.h"
#include "common.h"
#include "dropout.h"
#include "isa.h"
#include "attention.h"
#include "attention_tiles.h"
#include "scratch.h"

/* Query rows per block of the backward, whose P and dS it recomputes at
   once: a multiple of SCORE_ROWS and of TILE_KEYS (so that no key tile
   straddles a block's first row). Blocks of 32 or 128 rows were no faster. */
#define BACKWARD_ROWS 64

LLMC_ISA_VARIANTS(build_panel, (float* panel, const float* k, size_t stride, int n, int hs,
                                float scale),
                  panel, k, stride, n, hs, scale)
LLMC_ISA_VARIANTS_ISA(probs_row, (float* p, int n, const float* stats), p, n, stats)

/* rows_tile and cols_tile, built per instruction set out of the heads'
   bodies: with their chunk cases inlined at every call, gcc 12 took 214 s
   over this file (Zen 1), nearly all in passes whose time grows faster than
   a function's size (PRE, load CSE after reload); 42 s so, the forward's
   time within 2%. A tile of TILE_ROWS rows (TILE_KEYS keys) runs as one,
   any other count one row (key) at a time: an element's sum does not
   depend on the tile it falls in. */
static ALWAYS_INLINE void rows_tile_any_body(int isa, float* o, size_t ldo, int accumulate,
                                             const float* a, size_t lda, const float* x,
                                             size_t ldx, int R, int n0, int hs) {
    if (R == TILE_ROWS) {
        rows_tile(isa, o, ldo, accumulate, a, lda, x, ldx, TILE_ROWS, n0, hs);
        return;
    }
    for (int r = 0; r < R; r++) {
        rows_tile(isa, o + (size_t)r * ldo, ldo, accumulate, a + (size_t)r * lda, lda, x, ldx,
                  1, n0 + r, hs);
    }
}
LLMC_ISA_VARIANTS_ISA(rows_tile_any, (float* o, size_t ldo, int accumulate, const float* a,
                                  size_t lda, const float* x, size_t ldx, int R, int n0, int hs),
                  o, ldo, accumulate, a, lda, x, ldx, R, n0, hs)

static ALWAYS_INLINE void cols_tile_any_body(int isa, float* o, size_t ldo, const float* a,
                                             size_t lda, const float* x, size_t ldx, int KT,
                                             int t2a, int ta, int tb, int hs) {
    if (KT == TILE_KEYS) {
        cols_tile(isa, o, ldo, a, lda, x, ldx, TILE_KEYS, t2a, ta, tb, hs);
        return;
    }
    for (int j = 0; j < KT; j++) {
        cols_tile(isa, o + (size_t)j * ldo, ldo, a, lda, x, ldx, 1, t2a + j, ta, tb, hs);
    }
}
LLMC_ISA_VARIANTS_ISA(cols_tile_any, (float* o, size_t ldo, const float* a, size_t lda,
                                  const float* x, size_t ldx, int KT, int t2a, int ta, int tb,
                                  int hs),
                  o, ldo, a, lda, x, ldx, KT, t2a, ta, tb, hs)

/* Every thread's per_thread floats of scratch in the kernels' arena (the
   GEMM panels' buffer, already large enough at a model's shapes): a call
   allocates nothing, and touches no fresh pages, once the arena has grown.
   NULL, unlocked, if it fails or its size would not fit; else paired with
   llmc_scratch_done. */
static float* acquire_scratch(size_t per_thread) {
    const size_t threads = (size_t)omp_get_max_threads();
    if (!llmc_count_fits(threads, per_thread, 1, 1)) { return NULL; }
    return llmc_scratch_acquire(LLMC_SCRATCH_PANELS, threads * per_thread * sizeof(float));
}

/* head is a variant already chosen (LLMC_ISA_SELECT): the parallel region
   is outlined into a function of its own, without a target attribute. */
int llmc_attention_heads(const attention_call* a, int heads, size_t per_thread,
                         attention_head_fn head) {
    const int B = a->B;
    float* scratch = acquire_scratch(per_thread);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);

    #pragma omp parallel
    {
        int64_t lo, hi;
        llmc_thread_share((int64_t)B * heads, &lo, &hi);
        float* mine = scratch + (size_t)omp_get_thread_num() * per_thread;
        for (int64_t i = lo; i < hi; i++) {
            const int nb = i + 1 < hi ? (int)((i + 1) / heads) : -1;
            head(a, (int)(i / heads), (int)(i % heads), nb, (int)((i + 1) % heads), mine);
        }
    }
    llmc_scratch_done();
    return LLMC_OK;
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
    score_tile(isa, s, (size_t)T, q + (size_t)t0 * row, row, panel, hs, R, t0 + 1, slope,
               first_block_key(t0, window));
    // each row's softmax_row, its reductions run for the tile's rows at once
    int lo[SCORE_ROWS], n[SCORE_ROWS];
    float maxval[SCORE_ROWS], inv[SCORE_ROWS];
    row_windows(lo, n, t0, R, window);
    softmax_tile_exps(isa, s, (size_t)T, lo, n, R, maxval, inv);
    for (int r = 0; r < R; r++) {
        float* p_row = s + (size_t)r * T + lo[r];
        scale_row(p_row, n[r], inv[r]);
        stats_bh[2 * (size_t)(t0 + r)] = maxval[r];
        stats_bh[2 * (size_t)(t0 + r) + 1] = inv[r];
        if (llmc_dropout_on(drop)) { llmc_dropout_row(p_row, p_row, lo[r], n[r], drop, t0 + r); }
    }
    const int R_pv = R < TILE_ROWS ? R : TILE_ROWS;
    for (int r = 0; r < R; r += R_pv) {
        const int lo = first_key(t0 + r, window);
        for (int d = 1; d < R_pv; d++) {
            zero_keys(s + (size_t)(r + d) * T, lo, first_key(t0 + r + d, window));
        }
        LLMC_ISA_SELECT(isa, rows_tile_any)(out_bh + (size_t)(t0 + r) * C, C, 0,
                                            s + (size_t)r * T + lo, (size_t)T,
                                            v + (size_t)lo * row, row, R_pv, t0 + r + 1 - lo,
                                            hs);
    }
}

/* The forward of one (b, h): its kv head's key panel (unless the thread's
   previous head built it), then the query rows in tiles, their scores in
   s [SCORE_ROWS, T] after the panel in scratch. */
static ALWAYS_INLINE void forward_head_body(int isa, const attention_call* a, int b, int h,
                                            int nb, int nh, float* scratch) {
    const int T = a->T, hs = a->hs, window = a->window, g = h / a->kv_mul;
    const size_t row = a->row, C = a->C;
    const float* inp_b = inp_of(a, b);
    const float* q = inp_b + q_offset(a, h);
    const float* v = inp_b + v_offset(a, g);
    float* out_bh = a->out + (size_t)b * T * C + (size_t)h * hs;
    float* stats_bh = a->stats_out + ((size_t)b * a->NH + h) * T * 2;
    const float slope = slope_of(a, h);
    const llmc_dropout drop = llmc_dropout_at(a->drop, b, (int64_t)h * T);
    float* panel = scratch;
    float* s = panel + panel_count(T, hs);
    if (!follows_its_kv_head(a, b, h)) {
        LLMC_ISA_SELECT(isa, build_panel)(panel, inp_b + k_offset(a, g), row, T, hs, a->scale);
    }
    int t0 = 0;
    for (; t0 + SCORE_ROWS <= T; t0 += SCORE_ROWS) {
        prefetch_forward(a, b, g, nb, nh, t0, SCORE_ROWS);
        forward_rows(isa, out_bh, C, stats_bh, s, q, panel, v, row, T, hs, slope, window, drop,
                     t0, SCORE_ROWS);
    }
    prefetch_forward(a, b, g, nb, nh, t0, T - t0);
    for (; t0 < T; t0++) {
        forward_rows(isa, out_bh, C, stats_bh, s, q, panel, v, row, T, hs, slope, window, drop,
                     t0, 1);
    }
}
LLMC_ISA_VARIANTS_ISA(forward_head,
                      (const attention_call* a, int b, int h, int nb, int nh, float* scratch),
                      a, b, h, nb, nh, scratch)

/* The forward core; sizes already checked. */
static int gqa_forward(float* out, float* stats, attention_call a) {
    a.out = out;
    a.stats_out = stats;
    // per thread: a key panel, then the scores of one tile of rows
    return llmc_attention_heads(&a, a.NH, panel_count(a.T, a.hs) + (size_t)SCORE_ROWS * a.T,
                                LLMC_ISA_SELECT(llmc_get_isa(), forward_head));
}

/* The rows of the backward's blocks of P and dS, for T query rows. */
static int backward_block_rows(int T) { return T < BACKWARD_ROWS ? T : BACKWARD_ROWS; }

/* One tile of R query rows t .. t+R-1 of head h's backward, in the block of
   rows that starts at t0 (p and ds are [BACKWARD_ROWS, T], row t at
   (t - t0) T): P recomputed from the scores and the forward's statistics
   stats_bh [T, 2], dP, dS over each row's window, then dq. The block's
   sums read keys from k_block (the first block key of its first row) on:
   a row's P and dS before its own first key are set to 0. With dropout
   (drop at the (b, h)), dP is d(P M / (1 - p)) through the mask, and p then
   holds P M / (1 - p), what the forward summed v with, for dv. written:
   dq's rows are written (each row's one sum starts from 0, as it would
   from a zeroed dq). */
static ALWAYS_INLINE void backward_rows(int isa, float* dq, float* p, float* ds,
                                        const float* stats_bh, const float* q,
                                        const float* dout_h, size_t C, const float* kpanel,
                                        const float* vpanel, const float* k, size_t row, int T,
                                        int hs, float slope, float scale, int window,
                                        llmc_dropout drop, int written, int k_block, int t0,
                                        int t, int R) {
    float* p_t = p + (size_t)(t - t0) * T;
    float* ds_t = ds + (size_t)(t - t0) * T;
    const int k_first = first_block_key(t, window);
    score_tile(isa, p_t, (size_t)T, q + (size_t)t * row, row, kpanel, hs, R, t + 1, slope,
               k_first);
    score_tile(isa, ds_t, (size_t)T, dout_h + (size_t)t * C, C, vpanel, hs, R, t + 1, 0.0f,
               k_first);
    int lo[SCORE_ROWS], n[SCORE_ROWS];
    row_windows(lo, n, t, R, window);
    for (int r = 0; r < R; r++) {
        float* ds_row = ds_t + (size_t)r * T;
        LLMC_ISA_SELECT(isa, probs_row)(p_t + (size_t)r * T + lo[r], n[r],
                                        stats_bh + 2 * (size_t)(t + r));
        if (llmc_dropout_on(drop)) {
            llmc_dropout_row(ds_row + lo[r], ds_row + lo[r], lo[r], n[r], drop, t + r);
        }
    }
    dscore_tile(ds_t, p_t, (size_t)T, lo, n, R, scale);
    for (int r = 0; r < R; r++) {
        float* p_row = p_t + (size_t)r * T;
        if (llmc_dropout_on(drop)) {
            llmc_dropout_row(p_row + lo[r], p_row + lo[r], lo[r], n[r], drop, t + r);
        }
        zero_keys(p_row, k_block, lo[r]);
        zero_keys(ds_t + (size_t)r * T, k_block, lo[r]);
    }
    const int R_dq = R < TILE_ROWS ? R : TILE_ROWS;
    for (int r = 0; r < R; r += R_dq) {
        const int lo = first_key(t + r, window);
        LLMC_ISA_SELECT(isa, rows_tile_any)(dq + (size_t)(t + r) * row, row, !written,
                                            ds_t + (size_t)r * T + lo, (size_t)T,
                                            k + (size_t)lo * row, row, R_dq, t + r + 1 - lo, hs);
    }
}

/* The backward of one (b, kv head g): its query heads h in order, each in
   blocks of BACKWARD_ROWS query rows. scratch holds a key panel and a panel
   of v (panel_count(T, hs) each), then the blocks of P and dS
   ([min(T, BACKWARD_ROWS), T] each). */
static ALWAYS_INLINE void backward_group_body(int isa, const attention_call* a, int b, int g,
                                              int nb, int ng, float* scratch) {
    const int T = a->T, hs = a->hs, window = a->window, kv_mul = a->kv_mul;
    const size_t row = a->row, C = a->C, k_head = k_offset(a, g), v_head = v_offset(a, g);
    const float scale = a->scale;
    const float* inp_b = inp_of(a, b);
    float* dinp_b = a->out + (size_t)b * T * row;
    const size_t panel_len = panel_count(T, hs);
    float* kpanel = scratch;
    float* vpanel = kpanel + panel_len;
    float* p = vpanel + panel_len;
    float* ds = p + (size_t)backward_block_rows(T) * T;
    const float* k = inp_b + k_head;
    LLMC_ISA_SELECT(isa, build_panel)(kpanel, k, row, T, hs, scale);
    LLMC_ISA_SELECT(isa, build_panel)(vpanel, inp_b + v_head, row, T, hs, 1.0f);
    if (a->written) {   // dk and dv gather over blocks and heads: their sums start from 0
        for (int t = 0; t < T; t++) {
            memset(dinp_b + (size_t)t * row + k_head, 0, (size_t)hs * sizeof(float));
            memset(dinp_b + (size_t)t * row + v_head, 0, (size_t)hs * sizeof(float));
        }
    }
    for (int h = g * kv_mul; h < (g + 1) * kv_mul; h++) {
        const backward_head hd = backward_head_of(a, b, h);
        for (int t0 = 0; t0 < T; t0 += BACKWARD_ROWS) {
            const int t1 = T - t0 < BACKWARD_ROWS ? T : t0 + BACKWARD_ROWS;
            const int k_block = first_block_key(t0, window);
            int t = t0;
            for (; t + SCORE_ROWS <= t1; t += SCORE_ROWS) {
                prefetch_backward(a, nb, ng, h - g * kv_mul, t, SCORE_ROWS);
                backward_rows(isa, hd.dq, p, ds, hd.stats, hd.q, hd.dout, C, kpanel, vpanel, k,
                              row, T, hs, hd.slope, scale, window, hd.drop, a->written, k_block,
                              t0, t, SCORE_ROWS);
            }
            prefetch_backward(a, nb, ng, h - g * kv_mul, t, t1 - t);
            for (; t < t1; t++) {
                backward_rows(isa, hd.dq, p, ds, hd.stats, hd.q, hd.dout, C, kpanel, vpanel, k,
                              row, T, hs, hd.slope, scale, window, hd.drop, a->written, k_block,
                              t0, t, 1);
            }
            // dk += dS^T q and dv += P^T dO over the block's rows, for every
            // key from the block's first (a multiple of 16, so no tile
            // straddles t0) up to its last row, TILE_KEYS keys at a time
            for (int t2 = k_block; t2 < t1; t2 += TILE_KEYS) {
                const int KT = t1 - t2 < TILE_KEYS ? t1 - t2 : TILE_KEYS;
                LLMC_ISA_SELECT(isa, cols_tile_any)(dinp_b + (size_t)t2 * row + k_head, row, ds,
                                                    (size_t)T, hd.q, row, KT, t2, t0, t1, hs);
                LLMC_ISA_SELECT(isa, cols_tile_any)(dinp_b + (size_t)t2 * row + v_head, row, p,
                                                    (size_t)T, hd.dout, C, KT, t2, t0, t1, hs);
            }
        }
    }
}
LLMC_ISA_VARIANTS_ISA(backward_group,
                      (const attention_call* a, int b, int g, int nb, int ng, float* scratch),
                      a, b, g, nb, ng, scratch)

/* The backward core; sizes already checked. */
static int gqa_backward(float* dinp, const float* dout, const float* stats, int written,
                        attention_call a) {
    a.out = dinp;
    a.written = written;
    a.dout = dout;
    a.stats = stats;
    // per thread: a key panel, a panel of v, then a block of P and one of dS
    return llmc_attention_heads(
        &a, a.NKV, 2 * panel_count(a.T, a.hs) + 2 * (size_t)backward_block_rows(a.T) * a.T,
        LLMC_ISA_SELECT(llmc_get_isa(), backward_group));
}

int attention_forward(float* out, float* stats, const float* inp,
                      int B, int T, int C, int NH) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, stats, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, 2), LLMC_ERR_SHAPE);
    return gqa_forward(out, stats, attention_call_of(inp, NULL, B, T, NH, NH, C / NH, 0,
                                                     llmc_dropout_of(0.0f, 0)));
}

int attention_backward(float* dinp, const float* dout, const float* inp, const float* stats,
                       int B, int T, int C, int NH, int written) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, 2), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    return gqa_backward(dinp, dout, stats, written,
                        attention_call_of(inp, NULL, B, T, NH, NH, C / NH, 0,
                                          llmc_dropout_of(0.0f, 0)));
}

int attention_gqa_forward(float* out, float* stats, const float* inp, const float* slopes,
                          int B, int T, int NH, int NKV, int hs, int window, float dropout,
                          uint64_t seed) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, stats, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    return gqa_forward(out, stats, attention_call_of(inp, slopes, B, T, NH, NKV, hs, window,
                                                     llmc_dropout_of(dropout, seed)));
}

int attention_gqa_backward(float* dinp, const float* dout, const float* inp, const float* stats,
                           const float* slopes, int B, int T, int NH, int NKV, int hs,
                           int window, float dropout, uint64_t seed, int written) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    return gqa_backward(dinp, dout, stats, written,
                        attention_call_of(inp, slopes, B, T, NH, NKV, hs, window,
                                          llmc_dropout_of(dropout, seed)));
}
