/*
 * Softmax over the real vocabulary, and the classifier's fused
 * softmax + cross-entropy. Logits span the padded vocabulary Vp; only the
 * first V columns are real. Every (b, t) row is independent, so all loops
 * are parallel over rows; a row is one call of its per-ISA function (isa.h).
 *
 * The fused pair keeps no probabilities: the forward saves each row's max
 * and inverse normaliser (8 bytes a row) beside its loss, and the backward
 * turns each logit into its gradient from them, in place if asked, so a
 * training step needs one (B, T, Vp) buffer, not three. Each probability is
 * the very product softmax_forward computes (one lane of
 * llmc_exp_nonpositive16, times inv), so the losses and gradients are bitwise those of
 * softmax, then -log p[target], then (p - onehot) * dloss.
 *
 * A row whose target is LLMC_IGNORE_INDEX has loss 0 and gradient 0 (its
 * statistics are still computed, so that every row's stats are defined).
 */
#include "llmc.h"
#include "common.h"
#include "isa.h"

typedef float vec8f __attribute__((vector_size(32)));
typedef double vec8d __attribute__((vector_size(64)));
typedef int32_t vec8i __attribute__((vector_size(32)));

/* The 16 lanes of v widened to double and added into sum_lo (lanes 0-7) and
   sum_hi (8-15). */
static LLMC_ALWAYS_INLINE void add_widened(vec8d* sum_lo, vec8d* sum_hi, vec16f v) {
    const vec8f lo = LLMC_SHUF_T(vec8i, v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const vec8f hi = LLMC_SHUF_T(vec8i, v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    *sum_lo += __builtin_convertvector(lo, vec8d);
    *sum_hi += __builtin_convertvector(hi, vec8d);
}

/* The statistics of one row's softmax over x[0 .. V): its max, and inv = 1 /
   sum_i exp(x[i] - max), the sum kept in 16 double lanes (up to ~50k terms)
   and added in order at the end. With p != NULL the exponentials are also
   stored in p[0 .. V). Whole vectors and the tail run as loops of their own,
   so that the whole ones load and store straight from and to memory. */
static LLMC_ALWAYS_INLINE void row_stats(float* p, const float* x, int V, float* max_out,
                                         float* inv_out) {
    // the max on 16 lanes (a NaN logit is skipped here, as by a scalar
    // max, and poisons the sum below)
    vec16f max16 = {0};
    max16 += -INFINITY;
    const int whole = V & ~15;
    for (int i = 0; i < whole; i += 16) {
        const vec16f v = llmc_load16(x + i, 16);
        max16 = llmc_select16(v > max16, v, max16);
    }
    if (whole < V) {
        const int n = V - whole;
        const vec16f v = llmc_select16(llmc_lanes_below(n), llmc_load16(x + whole, n), max16);
        max16 = llmc_select16(v > max16, v, max16);
    }
    float maxval = -INFINITY;
    for (int l = 0; l < 16; l++) { if (max16[l] > maxval) { maxval = max16[l]; } }
    vec8d sum_lo = {0}, sum_hi = {0};
    for (int i = 0; i < whole; i += 16) {
        const vec16f ex = llmc_exp_nonpositive16(llmc_load16(x + i, 16) - maxval);
        if (p != NULL) { llmc_store16(p + i, ex, 16); }
        add_widened(&sum_lo, &sum_hi, ex);
    }
    if (whole < V) {
        const int n = V - whole;
        const vec16f e = llmc_load16(x + whole, n) - maxval;
        const vec16f ex = llmc_select16(llmc_lanes_below(n), llmc_exp_nonpositive16(e),
                                        (vec16f){0});
        if (p != NULL) { llmc_store16(p + whole, ex, n); }
        add_widened(&sum_lo, &sum_hi, ex);
    }
    double sum = 0.0;
    for (int l = 0; l < 8; l++) { sum += sum_lo[l]; }
    for (int l = 0; l < 8; l++) { sum += sum_hi[l]; }
    *max_out = maxval;
    *inv_out = (float)(1.0 / sum);
}

/* The probability of column i of a row with statistics (max, inv): the
   same exponential (one lane of llmc_exp_nonpositive16) and product as
   softmax_row's. */
static LLMC_ALWAYS_INLINE float row_prob(const float* x, int i, float maxval, float inv) {
    const vec16f e = llmc_exp_nonpositive16(llmc_load16(x + i, 1) - maxval);
    return e[0] * inv;
}

/* One row: p[0 .. Vp) = softmax of x[0 .. V), zero past V. */
static LLMC_ALWAYS_INLINE void softmax_row_body(float* p, const float* x, int V, int Vp) {
    float maxval, inv;
    row_stats(p, x, V, &maxval, &inv);
    for (int i = 0; i < V; i++) { p[i] *= inv; }
    for (int i = V; i < Vp; i++) { p[i] = 0.0f; }
}
LLMC_ISA_VARIANTS(softmax_row, (float* p, const float* x, int V, int Vp), p, x, V, Vp)

int softmax_forward(float* probs, const float* logits, int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL2(probs, logits), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;

    void (*const row)(float*, const float*, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), softmax_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        row(probs + (size_t)bt * Vp, logits + (size_t)bt * Vp, V, Vp);
    }
    return LLMC_OK;
}

/* One row of the fused forward: the statistics, and the loss from them. */
static LLMC_ALWAYS_INLINE void xent_forward_row_body(float* loss, float* stats, const float* x,
                                                     int target, int V) {
    row_stats(NULL, x, V, &stats[0], &stats[1]);
    *loss = target == LLMC_IGNORE_INDEX ? 0.0f : -logf(row_prob(x, target, stats[0], stats[1]));
}
LLMC_ISA_VARIANTS(xent_forward_row, (float* loss, float* stats, const float* x, int target, int V),
                  loss, stats, x, target, V)

int softmax_crossentropy_forward(float* losses, float* stats, const float* logits,
                                 const int* targets, int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL4(losses, stats, logits, targets), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_first_bad_target(targets, BT, V) < 0, LLMC_ERR_RANGE);

    void (*const row)(float*, float*, const float*, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), xent_forward_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        row(losses + bt, stats + 2 * bt, logits + (size_t)bt * Vp, targets[bt], V);
    }
    return LLMC_OK;
}

/* One row of the fused backward: dx[i] = (p[i] - [i == target]) * dloss for
   i < V, 0 past V (0 everywhere for an ignored target); dx may be x (each
   element is read before it is written). */
static LLMC_ALWAYS_INLINE void xent_backward_row_body(float* dx, const float* x,
                                                      const float* stats, int target,
                                                      float dloss, int V, int Vp) {
    if (target == LLMC_IGNORE_INDEX) {
        memset(dx, 0, (size_t)Vp * sizeof *dx);
        return;
    }
    const float maxval = stats[0], inv = stats[1];
    for (int i = 0; i < V; i += 16) {
        const int n = V - i < 16 ? V - i : 16;
        const vec16f p = llmc_exp_nonpositive16(llmc_load16(x + i, n) - maxval) * inv;
        llmc_store16(dx + i, p * dloss, n);
    }
    dx[target] -= dloss;
    for (int i = V; i < Vp; i++) { dx[i] = 0.0f; }
}
LLMC_ISA_VARIANTS(xent_backward_row, (float* dx, const float* x, const float* stats, int target,
                                      float dloss, int V, int Vp),
                  dx, x, stats, target, dloss, V, Vp)

int softmax_crossentropy_backward(float* dlogits, const float* logits, const float* stats,
                                  const float* dlosses, const int* targets,
                                  int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL3(dlogits, logits, stats) && LLMC_NONNULL2(dlosses, targets),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_first_bad_target(targets, BT, V) < 0, LLMC_ERR_RANGE);

    void (*const row)(float*, const float*, const float*, int, float, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), xent_backward_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        row(dlogits + (size_t)bt * Vp, logits + (size_t)bt * Vp, stats + 2 * bt, targets[bt],
            dlosses[bt], V, Vp);
    }
    return LLMC_OK;
}
