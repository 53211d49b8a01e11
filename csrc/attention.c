/*
 * Causal self-attention, forward and backward: GPT-2's multi-head layout and
 * grouped-query attention (GQA) with optional ALiBi.
 *
 * One core serves both. GPT-2's packed row (q, k, v, each C = NH hs wide) is
 * the grouped layout with NKV == NH, and "no slopes" is a slope of 0, whose
 * bias slope * (t - t2) is exactly 0 and leaves every score unchanged; so
 * attention_forward/backward are the GQA kernels with those arguments, with
 * the same offsets and the same order of every sum.
 *
 * The forward keeps only the softmax probabilities (att): the backward needs
 * nothing else (the ALiBi bias is a constant). It is parallel over (b, t, h)
 * rows; each row is computed by attend_row below.
 *
 * The backward is parallel over (b, kv head). A kv head's dk and dv gather
 * from all NH / NKV query heads of its group, so one thread owns the group:
 * it walks the group's query heads in order, and t and t2 in order within
 * each, writing its own heads' slices of dq, dk and dv. No two threads touch
 * the same element, and every element is summed in one order whatever the
 * thread count.
 *
 * attention_decode is one forward row per (b, h), parallel over (b, h), run
 * by the forward's own attend_row: a decoded position gets the same
 * arithmetic as that position in a full forward. The scores need a row of
 * up to maxT floats per (b, h); the caller's att buffer holds them, since a
 * stack buffer of maxT floats could overflow a worker thread's stack for
 * long contexts, and a malloc per call would be one per layer per token.
 */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"

/*
 * One query row: the query q at position n - 1 against the keys and values at
 * positions 0 .. n-1, whose rows lie kv_stride floats apart from k and v.
 * Writes the n probabilities to att_row and the weighted sum of the values to
 * out_row. The score of the key d = n - 1 - t2 positions back loses
 * slope * d (ALiBi). Softmax: the max is subtracted, exponentials are taken
 * 16 lanes at a time and summed lane by lane, then the lanes in order.
 */
static inline void attend_row(float* out_row, float* att_row, const float* q,
                              const float* k, const float* v, size_t kv_stride,
                              int n, int hs, float scale, float slope) {
    float maxval = -INFINITY;
    for (int t2 = 0; t2 < n; t2++) {
        const float score = llmc_dot(q, k + (size_t)t2 * kv_stride, hs) * scale
                            - slope * (float)(n - 1 - t2);
        att_row[t2] = score;
        if (score > maxval) { maxval = score; }
    }
    vec16f expsum16 = {0};
    for (int t2 = 0; t2 < n; t2 += 16) {
        const int m = n - t2 < 16 ? n - t2 : 16;
        const vec16f e = llmc_exp16(llmc_load16(att_row + t2, m) - maxval);
        llmc_store16(att_row + t2, e, m);
        expsum16 += llmc_select16(llmc_lanes_below(m), e, (vec16f){0});
    }
    const float inv = 1.0f / llmc_hsum16(expsum16);
    for (int t2 = 0; t2 < n; t2++) { att_row[t2] *= inv; }

    for (int i = 0; i < hs; i++) { out_row[i] = 0.0f; }
    for (int t2 = 0; t2 < n; t2++) {
        const float* v_row = v + (size_t)t2 * kv_stride;
        const float a = att_row[t2];
        for (int i = 0; i < hs; i++) { out_row[i] += a * v_row[i]; }
    }
}

/* The forward core; sizes already checked. slopes may be NULL. */
static void gqa_forward(float* out, float* att, const float* inp, const float* slopes,
                        int B, int T, int NH, int NKV, int hs) {
    const size_t C = (size_t)NH * hs;                          // q heads, and out's row
    const size_t row = ((size_t)NH + 2 * (size_t)NKV) * hs;    // packed q, k, v row
    const size_t v_start = C + (size_t)NKV * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);

    #pragma omp parallel for collapse(3) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < NH; h++) {
                const float* inp_b = inp + (size_t)b * T * row;
                const size_t kv = (size_t)(h / kv_mul) * hs;
                float* att_bth = att + (((size_t)b * NH + h) * T + t) * T;
                attend_row(out + ((size_t)b * T + t) * C + (size_t)h * hs, att_bth,
                           inp_b + (size_t)t * row + (size_t)h * hs,
                           inp_b + C + kv, inp_b + v_start + kv, row,
                           t + 1, hs, scale, slopes != NULL ? slopes[h] : 0.0f);
                // the masked future is exactly 0
                for (int t2 = t + 1; t2 < T; t2++) { att_bth[t2] = 0.0f; }
            }
        }
    }
}

/* The backward core; sizes already checked. */
static int gqa_backward(float* dinp, const float* dout, const float* inp, const float* att,
                        int B, int T, int NH, int NKV, int hs) {
    const size_t C = (size_t)NH * hs;
    const size_t row = ((size_t)NH + 2 * (size_t)NKV) * hs;
    const size_t v_start = C + (size_t)NKV * hs;
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);
    // one row of d(att) per thread
    const int nthreads = omp_get_max_threads();
    float* scratch = malloc((size_t)nthreads * T * sizeof(float));
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int g = 0; g < NKV; g++) {
            float* datt = scratch + (size_t)omp_get_thread_num() * T;
            const float* inp_b = inp + (size_t)b * T * row;
            float* dinp_b = dinp + (size_t)b * T * row;
            const size_t k_head = C + (size_t)g * hs, v_head = v_start + (size_t)g * hs;
            for (int h = g * kv_mul; h < (g + 1) * kv_mul; h++) {
                for (int t = 0; t < T; t++) {
                    const float* att_bth = att + (((size_t)b * NH + h) * T + t) * T;
                    const float* dout_bth = dout + ((size_t)b * T + t) * C + (size_t)h * hs;
                    const float* q = inp_b + (size_t)t * row + (size_t)h * hs;
                    float* dq = dinp_b + (size_t)t * row + (size_t)h * hs;

                    // through the weighted sum: d(att) and dv
                    float att_datt = 0.0f;
                    for (int t2 = 0; t2 <= t; t2++) {
                        const size_t v_off = (size_t)t2 * row + v_head;
                        const float* v = inp_b + v_off;
                        float* dv = dinp_b + v_off;
                        const float a = att_bth[t2];
                        for (int i = 0; i < hs; i++) { dv[i] += a * dout_bth[i]; }
                        const float d = llmc_dot(dout_bth, v, hs);
                        datt[t2] = d;
                        att_datt += a * d;
                    }
                    // through the softmax and the scaled dot products: dq and dk
                    for (int t2 = 0; t2 <= t; t2++) {
                        const size_t k_off = (size_t)t2 * row + k_head;
                        const float* k = inp_b + k_off;
                        float* dk = dinp_b + k_off;
                        const float dscore = att_bth[t2] * (datt[t2] - att_datt) * scale;
                        for (int i = 0; i < hs; i++) {
                            dq[i] += dscore * k[i];
                            dk[i] += dscore * q[i];
                        }
                    }
                }
            }
        }
    }
    free(scratch);
    return LLMC_OK;
}

int attention_forward(float* out, float* att, const float* inp,
                      int B, int T, int C, int NH) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, att, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, T), LLMC_ERR_SHAPE);
    gqa_forward(out, att, inp, NULL, B, T, NH, NH, C / NH);
    return LLMC_OK;
}

int attention_backward(float* dinp, const float* dout, const float* inp, const float* att,
                       int B, int T, int C, int NH) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, att), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, T), LLMC_ERR_SHAPE);
    return gqa_backward(dinp, dout, inp, att, B, T, NH, NH, C / NH);
}

int attention_gqa_forward(float* out, float* att, const float* inp, const float* slopes,
                          int B, int T, int NH, int NKV, int hs) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, att, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && NH > 0 && NKV > 0 && hs > 0 && NH % NKV == 0,
                 LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, (size_t)NH + 2 * (size_t)NKV, hs)
                 && llmc_count_fits(B, NH, T, T), LLMC_ERR_SHAPE);
    gqa_forward(out, att, inp, slopes, B, T, NH, NKV, hs);
    return LLMC_OK;
}

int attention_gqa_backward(float* dinp, const float* dout, const float* inp, const float* att,
                           int B, int T, int NH, int NKV, int hs) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, att), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && NH > 0 && NKV > 0 && hs > 0 && NH % NKV == 0,
                 LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, (size_t)NH + 2 * (size_t)NKV, hs)
                 && llmc_count_fits(B, NH, T, T), LLMC_ERR_SHAPE);
    return gqa_backward(dinp, dout, inp, att, B, T, NH, NKV, hs);
}

int attention_decode(float* out, float* att, const float* q, const float* k_cache,
                     const float* v_cache, const int* len, const float* slopes,
                     int B, int NH, int NKV, int hs, int maxT) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, att, q) && LLMC_NONNULL3(k_cache, v_cache, len),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && NH > 0 && NKV > 0 && hs > 0 && maxT > 0 && NH % NKV == 0,
                 LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, maxT, NKV, hs) && llmc_count_fits(B, NH, maxT, 1)
                 && llmc_count_fits(B, NH, hs, 1), LLMC_ERR_SHAPE);
    for (int b = 0; b < B; b++) {
        LLMC_REQUIRE(len[b] >= 1 && len[b] <= maxT, LLMC_ERR_RANGE);
    }
    const size_t C = (size_t)NH * hs;             // q and out rows
    const size_t kv_row = (size_t)NKV * hs;       // one cached position
    const int kv_mul = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hs);

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const size_t kv = (size_t)b * maxT * kv_row + (size_t)(h / kv_mul) * hs;
            attend_row(out + (size_t)b * C + (size_t)h * hs,
                       att + ((size_t)b * NH + h) * maxT,
                       q + (size_t)b * C + (size_t)h * hs,
                       k_cache + kv, v_cache + kv, kv_row,
                       len[b], hs, scale, slopes != NULL ? slopes[h] : 0.0f);
        }
    }
    return LLMC_OK;
}
