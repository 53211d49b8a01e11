/*
 * The plain twins of the attention kernels: loops as in llm.c (one dot
 * product per score, scalar softmax with libm's expf) that keep the whole of
 * att [B, NH, T, T] where the tiled kernels keep stats. They are the
 * reference the tests and the benchmark check attention.c's and
 * attention_probs.c's kernels against, so they share no code with them but
 * the window's first key and the size checks (attention.h).
 *
 * variants: attention_forward_naive / _backward_naive twin
 * attention_gqa_forward / _backward; attention_entropy_naive, the row
 * entropies from a whole att by libm's logf, twins attention_gqa_entropy.
 * All are the same everywhere (no per-ISA build).
 */
#include <string.h>
#include "llmc.h"
#include "common.h"
#include "dropout.h"
#include "attention.h"

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
                             uint64_t seed, int written) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, att), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_att_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
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
            if (written) {   // this (b, g)'s dq, dk and dv, summed into from 0
                for (int t = 0; t < T; t++) {
                    float* drow = dinp_b + (size_t)t * row;
                    memset(drow + (size_t)g * kv_mul * hs, 0, (size_t)kv_mul * hs * sizeof(float));
                    memset(drow + k_off, 0, (size_t)hs * sizeof(float));
                    memset(drow + v_off, 0, (size_t)hs * sizeof(float));
                }
            }
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
