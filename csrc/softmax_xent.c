/*
 * Softmax over the real vocabulary, cross-entropy, and their fused backward.
 * Logits span the padded vocabulary Vp; only the first V columns are real.
 * Every (b, t) row is independent, so all loops are parallel over rows; a
 * row of the softmax and of the backward is one call of its per-ISA
 * function (isa.h).
 */
#include "llmc.h"
#include "common.h"
#include "isa.h"

typedef float vec8f __attribute__((vector_size(32)));
typedef double vec8d __attribute__((vector_size(64)));

/* One row: p[0 .. Vp) = softmax of x[0 .. V), zero past V. */
static LLMC_ALWAYS_INLINE void softmax_row_body(float* p, const float* x, int V, int Vp) {
    // the max on 16 lanes (a NaN logit is skipped here, as by a scalar
    // max, and poisons the sum below)
    vec16f max16 = {0};
    max16 += -INFINITY;
    for (int i = 0; i < V; i += 16) {
        const int n = V - i < 16 ? V - i : 16;
        const vec16f v = llmc_select16(llmc_lanes_below(n), llmc_load16(x + i, n), max16);
        max16 = llmc_select16(v > max16, v, max16);
    }
    float maxval = -INFINITY;
    for (int l = 0; l < 16; l++) { if (max16[l] > maxval) { maxval = max16[l]; } }
    // exponentials 16 lanes at a time; the normaliser sums up to ~50k
    // terms, so it is kept in 16 double lanes, added in order at the end
    vec8d sum_lo = {0}, sum_hi = {0};
    for (int i = 0; i < V; i += 16) {
        const int n = V - i < 16 ? V - i : 16;
        const vec16f e = llmc_load16(x + i, n) - maxval;
        const vec16f ex = llmc_select16(llmc_lanes_below(n), llmc_exp16(e), (vec16f){0});
        llmc_store16(p + i, ex, n);
        vec8f lo, hi;
        memcpy(&lo, &ex, sizeof lo);
        memcpy(&hi, (const float*)&ex + 8, sizeof hi);
        sum_lo += __builtin_convertvector(lo, vec8d);
        sum_hi += __builtin_convertvector(hi, vec8d);
    }
    double sum = 0.0;
    for (int l = 0; l < 8; l++) { sum += sum_lo[l]; }
    for (int l = 0; l < 8; l++) { sum += sum_hi[l]; }
    const float inv = (float)(1.0 / sum);
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

int crossentropy_forward(float* losses, const float* probs, const int* targets,
                         int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL3(losses, probs, targets), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_first_bad_index(targets, BT, V) < 0, LLMC_ERR_RANGE);

    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        losses[bt] = -logf(probs[(size_t)bt * Vp + targets[bt]]);
    }
    return LLMC_OK;
}

/* One row of the backward: dx[i] += (p[i] - [i == target]) * dloss, i < V. */
static LLMC_ALWAYS_INLINE void xent_backward_row_body(float* dx, const float* p, int target,
                                                      float dloss, int V) {
    for (int i = 0; i < V; i++) { dx[i] += p[i] * dloss; }
    dx[target] -= dloss;
}
LLMC_ISA_VARIANTS(xent_backward_row, (float* dx, const float* p, int target, float dloss, int V),
                  dx, p, target, dloss, V)

int crossentropy_softmax_backward(float* dlogits, const float* dlosses,
                                  const float* probs, const int* targets,
                                  int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL4(dlogits, dlosses, probs, targets), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_first_bad_index(targets, BT, V) < 0, LLMC_ERR_RANGE);

    void (*const row)(float*, const float*, int, float, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), xent_backward_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        row(dlogits + (size_t)bt * Vp, probs + (size_t)bt * Vp, targets[bt], dlosses[bt], V);
    }
    return LLMC_OK;
}
