/* LayerNorm (GPT-2) and RMSNorm (Llama), each forward and backward. Rows are
   parallel; the parameter gradients, sums over rows, are summed in fixed
   chunks of rows, then the chunks in order (common.h). */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"

/*
 * Pass 2 of both norms' backward, the parameter gradients, sums over rows:
 *   dweight[i] += sum_bt dout[bt,i] * n[bt,i],  n = (x - mean) * rstd
 *   dbias[i]   += sum_bt dout[bt,i]
 * mean NULL means 0 (RMSNorm); dbias NULL means no bias. In fixed chunks of
 * rows (common.h): each chunk's partial rows, then the chunks in order.
 */
static int norm_param_grads(float* dweight, float* dbias, const float* dout,
                            const float* inp, const float* mean, const float* rstd,
                            long BT, int C) {
    const long chunk = llmc_row_chunk(BT), nchunks = (BT + chunk - 1) / chunk;
    float* partial = malloc((size_t)nchunks * 2 * C * sizeof(float));   // dweight's, dbias's
    LLMC_REQUIRE(partial != NULL, LLMC_ERR_NOMEM);
    float* partial_db = partial + (size_t)nchunks * C;
    #pragma omp parallel for schedule(static)
    for (long ch = 0; ch < nchunks; ch++) {
        float* pw = partial + (size_t)ch * C;
        float* pb = partial_db + (size_t)ch * C;
        memset(pw, 0, (size_t)C * sizeof(float));
        memset(pb, 0, (size_t)C * sizeof(float));
        const long bt1 = (ch + 1) * chunk < BT ? (ch + 1) * chunk : BT;
        for (long bt = ch * chunk; bt < bt1; bt++) {
            const float* x = inp + (size_t)bt * C;
            const float* dy = dout + (size_t)bt * C;
            const float m = mean != NULL ? mean[bt] : 0.0f, s = rstd[bt];
            for (int i = 0; i < C; i++) { pw[i] += dy[i] * ((x[i] - m) * s); }
            if (dbias != NULL) {
                for (int i = 0; i < C; i++) { pb[i] += dy[i]; }
            }
        }
    }
    llmc_add_chunk_sums(dweight, partial, nchunks, C);
    if (dbias != NULL) { llmc_add_chunk_sums(dbias, partial_db, nchunks, C); }
    free(partial);
    return LLMC_OK;
}

/* sum_i a[i] over n floats: 16 lanes at a time, then the lanes in order. */
static float sum16(const float* a, int n) {
    vec16f acc = {0};
    for (int i = 0; i < n; i += 16) { acc += llmc_load16(a + i, n - i < 16 ? n - i : 16); }
    return llmc_hsum16(acc);
}

int layernorm_forward(float* out, float* mean, float* rstd,
                      const float* inp, const float* weight, const float* bias,
                      int B, int T, int C, float eps) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, mean, rstd) && LLMC_NONNULL3(inp, weight, bias),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && eps >= 0.0f, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;

    // rows are independent; the variance is taken about the mean (two passes),
    // which stays accurate when |mean| is large against the spread; both sums
    // run on 16 lanes
    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const float* x = inp + (size_t)bt * C;
        float* y = out + (size_t)bt * C;
        const float m = sum16(x, C) / C;
        vec16f sumsq = {0};
        for (int i = 0; i < C; i += 16) {
            const int n = C - i < 16 ? C - i : 16;
            const vec16f d = llmc_load16(x + i, n) - m;
            sumsq += llmc_select16(llmc_lanes_below(n), d * d, (vec16f){0});
        }
        const float s = 1.0f / sqrtf(llmc_hsum16(sumsq) / C + eps);
        for (int i = 0; i < C; i++) { y[i] = (x[i] - m) * s * weight[i] + bias[i]; }
        mean[bt] = m;
        rstd[bt] = s;
    }
    return LLMC_OK;
}

int layernorm_backward(float* dinp, float* dweight, float* dbias,
                       const float* dout, const float* inp, const float* weight,
                       const float* mean, const float* rstd,
                       int B, int T, int C) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dweight, dbias) && LLMC_NONNULL3(dout, inp, weight)
                 && LLMC_NONNULL2(mean, rstd), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;

    // pass 1, dinp. With n = (x - mean) * rstd and g = dout * weight:
    //   dx = rstd * (g - mean(g) - n * mean(g * n))
    // rows are independent
    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const float* x = inp + (size_t)bt * C;
        const float* dy = dout + (size_t)bt * C;
        float* dx = dinp + (size_t)bt * C;
        const float m = mean[bt], s = rstd[bt];
        // 16 lanes each; the zero-filled lanes past C give g = 0
        vec16f g_sum = {0}, gn_sum = {0};
        for (int i = 0; i < C; i += 16) {
            const int n = C - i < 16 ? C - i : 16;
            const vec16f g = llmc_load16(dy + i, n) * llmc_load16(weight + i, n);
            g_sum += g;
            gn_sum += g * ((llmc_load16(x + i, n) - m) * s);
        }
        const float g_mean = llmc_hsum16(g_sum) / C, gn_mean = llmc_hsum16(gn_sum) / C;
        for (int i = 0; i < C; i++) {
            const float n = (x[i] - m) * s;
            dx[i] += s * (dy[i] * weight[i] - g_mean - n * gn_mean);
        }
    }

    return norm_param_grads(dweight, dbias, dout, inp, mean, rstd, BT, C);
}

/* A vector dot product of three arrays: sum_i a[i] * b[i] * c[i], with the
   same fixed order as llmc_dot (16 lanes, then the lanes in order). */
static float dot3(const float* a, const float* b, const float* c, int n) {
    vec16f acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc += llmc_load16(a + i, 16) * llmc_load16(b + i, 16) * llmc_load16(c + i, 16);
    }
    if (i < n) {
        acc += llmc_load16(a + i, n - i) * llmc_load16(b + i, n - i)
               * llmc_load16(c + i, n - i);
    }
    return llmc_hsum16(acc);
}

int rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight,
                    int B, int T, int C, float eps) {
    LLMC_REQUIRE(LLMC_NONNULL4(out, rstd, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && eps >= 0.0f, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;

    // rows are independent; the sum of squares runs on 16 lanes (llmc_dot),
    // whose partial sums also round less than one long serial sum
    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const float* x = inp + (size_t)bt * C;
        float* y = out + (size_t)bt * C;
        const float s = 1.0f / sqrtf(llmc_dot(x, x, C) / C + eps);
        for (int i = 0; i < C; i++) { y[i] = x[i] * s * weight[i]; }
        rstd[bt] = s;
    }
    return LLMC_OK;
}

int rmsnorm_backward(float* dinp, float* dweight,
                     const float* dout, const float* inp, const float* weight,
                     const float* rstd, int B, int T, int C) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dweight, dout) && LLMC_NONNULL3(inp, weight, rstd),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;

    // pass 1, dinp. With s = rstd, n = x * s and g = dout * weight, and
    // ds/dx_j = -s^3 x_j / C:
    //   dx_j = s g_j - s^3 x_j mean(g x) = s (g_j - n_j mean(g n))
    // rows are independent
    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const float* x = inp + (size_t)bt * C;
        const float* dy = dout + (size_t)bt * C;
        float* dx = dinp + (size_t)bt * C;
        const float s = rstd[bt];
        const float gn_mean = dot3(dy, weight, x, C) * s / C;
        for (int i = 0; i < C; i++) {
            dx[i] += s * (dy[i] * weight[i] - x[i] * s * gn_mean);
        }
    }

    return norm_param_grads(dweight, NULL, dout, inp, NULL, rstd, BT, C);
}
