/*
 * Softmax over the real vocabulary, cross-entropy, and their fused backward.
 * Logits span the padded vocabulary Vp; only the first V columns are real.
 * Every (b, t) row is independent, so all loops are parallel over rows.
 */
#include "llmc.h"
#include "common.h"

/* Index of the first target outside [0, V), or -1 if all are in range. */
static long first_bad_target(const int* targets, long BT, int V) {
    for (long bt = 0; bt < BT; bt++) {
        if (targets[bt] < 0 || targets[bt] >= V) { return bt; }
    }
    return -1;
}

int softmax_forward(float* probs, const float* logits, int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL2(probs, logits), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;

    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const float* x = logits + (size_t)bt * Vp;
        float* p = probs + (size_t)bt * Vp;
        float maxval = -INFINITY;
        for (int i = 0; i < V; i++) { if (x[i] > maxval) { maxval = x[i]; } }
        // exponentials 16 lanes at a time; the normaliser sums up to ~50k
        // terms, so each block's lanes are added into a double, in order
        double sum = 0.0;
        for (int i = 0; i < V; i += 16) {
            const int n = V - i < 16 ? V - i : 16;
            const vec16f e = llmc_exp16(llmc_load16(x + i, n) - maxval);
            llmc_store16(p + i, e, n);
            sum += llmc_hsum16(llmc_select16(llmc_lanes_below(n), e, (vec16f){0}));
        }
        const float inv = (float)(1.0 / sum);
        for (int i = 0; i < V; i++) { p[i] *= inv; }
        for (int i = V; i < Vp; i++) { p[i] = 0.0f; }
    }
    return LLMC_OK;
}

int crossentropy_forward(float* losses, const float* probs, const int* targets,
                         int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL3(losses, probs, targets), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    LLMC_REQUIRE(first_bad_target(targets, BT, V) < 0, LLMC_ERR_RANGE);

    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        losses[bt] = -logf(probs[(size_t)bt * Vp + targets[bt]]);
    }
    return LLMC_OK;
}

int crossentropy_softmax_backward(float* dlogits, const float* dlosses,
                                  const float* probs, const int* targets,
                                  int B, int T, int V, int Vp) {
    LLMC_REQUIRE(LLMC_NONNULL4(dlogits, dlosses, probs, targets), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && V > 0 && Vp >= V, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, Vp, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    LLMC_REQUIRE(first_bad_target(targets, BT, V) < 0, LLMC_ERR_RANGE);

    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        float* dx = dlogits + (size_t)bt * Vp;
        const float* p = probs + (size_t)bt * Vp;
        const float dloss = dlosses[bt];
        for (int i = 0; i < V; i++) { dx[i] += p[i] * dloss; }
        dx[targets[bt]] -= dloss;
    }
    return LLMC_OK;
}
