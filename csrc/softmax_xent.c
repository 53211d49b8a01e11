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
 * llmc_exp_nonpositive16, times inv), so the losses and gradients are
 * bitwise those of softmax, then -log p[target], then (p - onehot) * dloss.
 *
 * A row whose target is LLMC_IGNORE_INDEX has loss 0 and gradient 0 (its
 * statistics are still computed, so that every row's stats are defined).
 */
#include "llmc.h"
#include "common.h"
#include "isa.h"

typedef double vec16d __attribute__((vector_size(128)));

/* The max of x[0 .. V) (a NaN is skipped, as by a scalar max, and poisons
   the sum after it), on four vectors of 16 lanes so that the compares do
   not wait on each other. Which of equal maxima wins (the sign of a zero
   max) never changes a result: exp(x - max) is then the same for x = +-0. */
static LLMC_ALWAYS_INLINE float row_max(const float* x, int V) {
    vec16f m0 = {0};
    m0 += -INFINITY;
    vec16f m1 = m0, m2 = m0, m3 = m0;
    int i = 0;
    for (; i + 64 <= V; i += 64) {
        const vec16f v0 = llmc_load16(x + i, 16), v1 = llmc_load16(x + i + 16, 16);
        const vec16f v2 = llmc_load16(x + i + 32, 16), v3 = llmc_load16(x + i + 48, 16);
        m0 = llmc_select16(LLMC_CMP16(v0, >, m0), v0, m0);
        m1 = llmc_select16(LLMC_CMP16(v1, >, m1), v1, m1);
        m2 = llmc_select16(LLMC_CMP16(v2, >, m2), v2, m2);
        m3 = llmc_select16(LLMC_CMP16(v3, >, m3), v3, m3);
    }
    for (; i < V; i += 16) {
        const vec16f v = llmc_select16(llmc_lanes_below(V - i), llmc_load16(x + i, V - i), m0);
        m0 = llmc_select16(LLMC_CMP16(v, >, m0), v, m0);
    }
    m0 = llmc_select16(LLMC_CMP16(m1, >, m0), m1, m0);
    m0 = llmc_select16(LLMC_CMP16(m2, >, m0), m2, m0);
    m0 = llmc_select16(LLMC_CMP16(m3, >, m0), m3, m0);
    float maxval = -INFINITY;
    for (int l = 0; l < 16; l++) { if (m0[l] > maxval) { maxval = m0[l]; } }
    return maxval;
}

/* The statistics of one row's softmax over x[0 .. V): its max, and inv = 1 /
   sum_i exp(x[i] - max), the sum kept in 16 double lanes (up to ~50k terms)
   and added in order at the end. With p != NULL the exponentials are also
   stored in p[0 .. V). Whole vectors and the tail run as loops of their own,
   so that the whole ones load and store straight from and to memory. While
   its exponentials are computed (bound by arithmetic), the row reads next
   (the next row, or NULL) into the cache for its max (bound by memory). */
static LLMC_ALWAYS_INLINE void row_stats(const int isa, float* p, const float* x,
                                         const float* next, int V, float* max_out,
                                         float* inv_out) {
    const float maxval = row_max(x, V);
    vec16d sum16 = {0};
    const int whole = V & ~15;
    for (int i = 0; i < whole; i += 16) {
        if (next != NULL) { __builtin_prefetch(next + i, 0, 2); }
        const vec16f ex = llmc_exp_nonpositive16_isa(isa, llmc_load16(x + i, 16) - maxval);
        if (p != NULL) { llmc_store16(p + i, ex, 16); }
        sum16 += __builtin_convertvector(ex, vec16d);
    }
    if (whole < V) {
        const int n = V - whole;
        const vec16f e = llmc_load16(x + whole, n) - maxval;
        const vec16f ex = llmc_select16(llmc_lanes_below(n), llmc_exp_nonpositive16_isa(isa, e),
                                        (vec16f){0});
        if (p != NULL) { llmc_store16(p + whole, ex, n); }
        sum16 += __builtin_convertvector(ex, vec16d);
    }
    double sum = 0.0;
    for (int l = 0; l < 16; l++) { sum += sum16[l]; }
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
static LLMC_ALWAYS_INLINE void softmax_row_body(const int isa, float* p, const float* x,
                                                const float* next, int V, int Vp) {
    float maxval, inv;
    row_stats(isa, p, x, next, V, &maxval, &inv);
    for (int i = 0; i < V; i++) { p[i] *= inv; }
    for (int i = V; i < Vp; i++) { p[i] = 0.0f; }
}
LLMC_ISA_VARIANTS_ISA(softmax_row, (float* p, const float* x, const float* next, int V, int Vp),
                      p, x, next, V, Vp)

int softmax_forward(float* probs, const float* logits, int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL2(probs, logits), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;

    void (*const row)(float*, const float*, const float*, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), softmax_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        const float* x = logits + (size_t)bt * Vp;
        row(probs + (size_t)bt * Vp, x, bt + 1 < BT ? x + Vp : NULL, V, Vp);
    }
    return LLMC_OK;
}

/* One row of the fused forward: the statistics, and the loss from them. */
static LLMC_ALWAYS_INLINE void xent_forward_row_body(const int isa, float* loss, float* stats,
                                                     const float* x, const float* next,
                                                     int target, int V) {
    row_stats(isa, NULL, x, next, V, &stats[0], &stats[1]);
    *loss = target == LLMC_IGNORE_INDEX ? 0.0f : -logf(row_prob(x, target, stats[0], stats[1]));
}
LLMC_ISA_VARIANTS_ISA(xent_forward_row, (float* loss, float* stats, const float* x,
                                         const float* next, int target, int V),
                      loss, stats, x, next, target, V)

int softmax_crossentropy_forward(float* losses, float* stats, const float* logits,
                                 const int* targets, int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL4(losses, stats, logits, targets), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_first_bad_target(targets, BT, V) < 0, LLMC_ERR_RANGE);

    void (*const row)(float*, float*, const float*, const float*, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), xent_forward_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        const float* x = logits + (size_t)bt * Vp;
        row(losses + bt, stats + 2 * bt, x, bt + 1 < BT ? x + Vp : NULL, targets[bt], V);
    }
    return LLMC_OK;
}

/* One row of the fused backward: dx[i] = (p[i] - [i == target]) * dloss for
   i < V, 0 past V (0 everywhere for an ignored target); dx may be x (each
   element is read before it is written). */
static LLMC_ALWAYS_INLINE void xent_backward_row_body(const int isa, float* dx, const float* x,
                                                      const float* stats, int target,
                                                      float dloss, int V, int Vp) {
    if (target == LLMC_IGNORE_INDEX) {
        memset(dx, 0, (size_t)Vp * sizeof *dx);
        return;
    }
    const float maxval = stats[0], inv = stats[1];
    for (int i = 0; i < V; i += 16) {
        const int n = V - i < 16 ? V - i : 16;
        const vec16f p = llmc_exp_nonpositive16_isa(isa, llmc_load16(x + i, n) - maxval) * inv;
        llmc_store16(dx + i, p * dloss, n);
    }
    dx[target] -= dloss;
    for (int i = V; i < Vp; i++) { dx[i] = 0.0f; }
}
LLMC_ISA_VARIANTS_ISA(xent_backward_row, (float* dx, const float* x, const float* stats,
                                          int target, float dloss, int V, int Vp),
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
