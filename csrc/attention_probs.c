/*
 * The probabilities of the tiled attention and their entropy, recomputed
 * from the forward's input and statistics (stats [B, NH, T, 2]) by its very
 * tiles: attention_gqa_probs rebuilds the whole of att (for tests, the
 * benchmark and viewers), attention_gqa_entropy each query row's entropy
 * (for monitors) without holding att.
 *
 * Both run on attention.c's per-head driver, parallel over (b, h), and
 * score like the forward: the key panel of the head's kv head with the
 * 1/sqrt(hs) scale folded in, then score_tile per tile of SCORE_ROWS query
 * rows, each row over its own window.
 *   probs    the scores go straight into att's rows, then probs_row (the
 *            forward's P, bitwise); the keys outside a row's window are 0.
 *            Scratch per thread: the panel (T hs floats)
 *   entropy  the scores go into a per-thread tile, then entropy_row from
 *            them and the row's saved max and inv. Scratch per thread: the
 *            panel and the tile (SCORE_ROWS T floats)
 *
 * variants: attention_gqa_probs and attention_gqa_entropy are built per
 * instruction set (isa.h) and chosen at run time;
 * attention_entropy_naive (attention_naive.c) is the entropy's plain twin.
 */
#include "llmc.h"
#include "common.h"
#include "isa.h"
#include "attention.h"
#include "attention_tiles.h"

LLMC_ISA_VARIANTS(build_panel, (float* panel, const float* k, size_t stride, int n, int hs,
                                float scale),
                  panel, k, stride, n, hs, scale)
LLMC_ISA_VARIANTS_ISA(probs_row, (float* p, int n, const float* stats), p, n, stats)

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

/* The probabilities (entropy 0) or the row entropies (entropy 1) of one
   (b, h), from its statistics: the scores as the forward computes them, a
   tile of rows at a time, then each row over its window. The probabilities
   are the scores, written straight into att's rows, through probs_row, with
   the keys outside the window (the masked future, and the past before a
   sliding window) set to exactly 0; an entropy is entropy_row of a row of
   the tile s [SCORE_ROWS, T] after the key panel in scratch. */
static ALWAYS_INLINE void recompute_head(int isa, const attention_call* a, int b, int h,
                                         float* scratch, int entropy) {
    const int T = a->T, hs = a->hs, window = a->window;
    const size_t row = a->row, bh = (size_t)b * a->NH + h;
    const float* inp_b = inp_of(a, b);
    const float* q = inp_b + q_offset(a, h);
    const float* stats_bh = a->stats + bh * T * 2;
    const float slope = slope_of(a, h);
    float* panel = scratch;
    LLMC_ISA_SELECT(isa, build_panel)(panel, inp_b + k_offset(a, h / a->kv_mul), row, T, hs,
                                      a->scale);
    for (int t0 = 0; t0 < T;) {
        const int R = T - t0 >= SCORE_ROWS ? SCORE_ROWS : 1;
        float* s = entropy ? panel + panel_count(T, hs) : a->out + (bh * T + t0) * T;
        const int k_first = first_block_key(t0, window);
        if (R == SCORE_ROWS) {
            score_tile(isa, s, (size_t)T, q + (size_t)t0 * row, row, panel, hs, SCORE_ROWS,
                       t0 + 1, slope, k_first);
        } else {
            score_tile(isa, s, (size_t)T, q + (size_t)t0 * row, row, panel, hs, 1, t0 + 1, slope,
                       k_first);
        }
        for (int r = 0; r < R; r++) {
            const int t = t0 + r, lo = first_key(t, window);
            float* s_row = s + (size_t)r * T;
            if (entropy) {
                LLMC_ISA_SELECT(isa, entropy_row)(a->out + bh * T + t, s_row + lo, t + 1 - lo,
                                                  stats_bh + 2 * (size_t)t);
            } else {
                LLMC_ISA_SELECT(isa, probs_row)(s_row + lo, t + 1 - lo, stats_bh + 2 * (size_t)t);
                zero_keys(s_row, 0, lo);
                zero_keys(s_row, t + 1, T);
            }
        }
        t0 += R;
    }
}

static ALWAYS_INLINE void probs_head_body(int isa, const attention_call* a, int b, int h,
                                          int nb, int nh, float* scratch) {
    (void)nb, (void)nh;   // (prefetching is the training kernels')
    recompute_head(isa, a, b, h, scratch, 0);
}
LLMC_ISA_VARIANTS_ISA(probs_head,
                      (const attention_call* a, int b, int h, int nb, int nh, float* scratch),
                      a, b, h, nb, nh, scratch)

static ALWAYS_INLINE void entropy_head_body(int isa, const attention_call* a, int b, int h,
                                            int nb, int nh, float* scratch) {
    (void)nb, (void)nh;   // (prefetching is the training kernels')
    recompute_head(isa, a, b, h, scratch, 1);
}
LLMC_ISA_VARIANTS_ISA(entropy_head,
                      (const attention_call* a, int b, int h, int nb, int nh, float* scratch),
                      a, b, h, nb, nh, scratch)

int attention_gqa_probs(float* att, const float* inp, const float* stats, const float* slopes,
                        int B, int T, int NH, int NKV, int hs, int window) {
    LLMC_REQUIRE(LLMC_NONNULL3(att, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_att_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    attention_call a = attention_call_of(inp, slopes, B, T, NH, NKV, hs, window,
                                         llmc_dropout_of(0.0f, 0));
    a.out = att;
    a.stats = stats;
    return llmc_attention_heads(&a, NH, panel_count(T, hs),   // a key panel
                                LLMC_ISA_SELECT(llmc_get_isa(), probs_head));
}

int attention_gqa_entropy(float* entropy, const float* inp, const float* stats,
                          const float* slopes, int B, int T, int NH, int NKV, int hs,
                          int window) {
    LLMC_REQUIRE(LLMC_NONNULL3(entropy, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    attention_call a = attention_call_of(inp, slopes, B, T, NH, NKV, hs, window,
                                         llmc_dropout_of(0.0f, 0));
    a.out = entropy;
    a.stats = stats;
    // per thread: a key panel, then the scores of one tile of rows
    return llmc_attention_heads(&a, NH, panel_count(T, hs) + (size_t)SCORE_ROWS * T,
                                LLMC_ISA_SELECT(llmc_get_isa(), entropy_head));
}
