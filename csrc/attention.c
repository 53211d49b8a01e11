/*
 * Causal multi-head self-attention (GPT-2), forward and backward.
 *
 * The forward keeps only the softmax probabilities (att): the backward needs
 * nothing else, and the pre-softmax scores are rebuilt per row when needed.
 * The forward is parallel over (b, t, h) rows; the backward over (b, h),
 * since each (b, h) pair writes only its own head's slices of dq, dk and dv,
 * and walks t in order, so no two threads touch the same element.
 */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"

int attention_forward(float* out, float* att, const float* inp,
                      int B, int T, int C, int NH) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, att, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, T), LLMC_ERR_SHAPE);
    const int hs = C / NH;
    const size_t C3 = (size_t)3 * C;
    const float scale = 1.0f / sqrtf((float)hs);

    #pragma omp parallel for collapse(3) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < NH; h++) {
                const float* inp_b = inp + (size_t)b * T * C3;
                const float* q = inp_b + (size_t)t * C3 + (size_t)h * hs;
                float* att_bth = att + (((size_t)b * NH + h) * T + t) * T;

                // scores and their max
                float maxval = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* k = inp_b + (size_t)t2 * C3 + C + (size_t)h * hs;
                    const float dot = llmc_dot(q, k, hs) * scale;
                    att_bth[t2] = dot;
                    if (dot > maxval) { maxval = dot; }
                }
                // softmax over t2 <= t; the masked future is exactly 0
                vec16f expsum16 = {0};
                for (int t2 = 0; t2 <= t; t2 += 16) {
                    const int n = t + 1 - t2 < 16 ? t + 1 - t2 : 16;
                    const vec16f e = llmc_exp16(llmc_load16(att_bth + t2, n) - maxval);
                    llmc_store16(att_bth + t2, e, n);
                    expsum16 += llmc_select16(llmc_lanes_below(n), e, (vec16f){0});
                }
                const float expsum = llmc_hsum16(expsum16);
                const float inv = 1.0f / expsum;
                for (int t2 = 0; t2 <= t; t2++) { att_bth[t2] *= inv; }
                for (int t2 = t + 1; t2 < T; t2++) { att_bth[t2] = 0.0f; }

                // weighted sum of the values
                float* out_bth = out + ((size_t)b * T + t) * C + (size_t)h * hs;
                for (int i = 0; i < hs; i++) { out_bth[i] = 0.0f; }
                for (int t2 = 0; t2 <= t; t2++) {
                    const float* v = inp_b + (size_t)t2 * C3 + 2 * (size_t)C + (size_t)h * hs;
                    const float a = att_bth[t2];
                    for (int i = 0; i < hs; i++) { out_bth[i] += a * v[i]; }
                }
            }
        }
    }
    return LLMC_OK;
}

int attention_backward(float* dinp, const float* dout, const float* inp, const float* att,
                       int B, int T, int C, int NH) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, att), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && NH > 0 && C % NH == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, 3, C) && llmc_count_fits(B, NH, T, T), LLMC_ERR_SHAPE);
    const int hs = C / NH;
    const size_t C3 = (size_t)3 * C;
    const float scale = 1.0f / sqrtf((float)hs);
    // one row of d(att) per thread
    const int nthreads = omp_get_max_threads();
    float* scratch = malloc((size_t)nthreads * T * sizeof(float));
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            float* datt = scratch + (size_t)omp_get_thread_num() * T;
            const float* inp_b = inp + (size_t)b * T * C3;
            float* dinp_b = dinp + (size_t)b * T * C3;
            for (int t = 0; t < T; t++) {
                const float* att_bth = att + (((size_t)b * NH + h) * T + t) * T;
                const float* dout_bth = dout + ((size_t)b * T + t) * C + (size_t)h * hs;
                const float* q = inp_b + (size_t)t * C3 + (size_t)h * hs;
                float* dq = dinp_b + (size_t)t * C3 + (size_t)h * hs;

                // through the weighted sum: d(att) and dv
                float att_datt = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const size_t v_off = (size_t)t2 * C3 + 2 * (size_t)C + (size_t)h * hs;
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
                    const size_t k_off = (size_t)t2 * C3 + C + (size_t)h * hs;
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
    free(scratch);
    return LLMC_OK;
}
