/* LayerNorm (GPT-2) and RMSNorm (Llama), each forward (alone, or after the
   residual add: residual_*norm_forward) and backward. Rows are
   parallel, each row one call of its per-ISA row function (isa.h); the
   parameter gradients, sums over rows, are llmc_column_sums (colsum.c). */
#include "llmc.h"
#include "common.h"
#include "isa.h"

/* sum_i a[i] over n floats: 16 lanes at a time, then the lanes in order. */
static LLMC_ALWAYS_INLINE float sum16(const float* a, int n) {
    vec16f acc = {0};
    for (int i = 0; i < n; i += 16) { acc += llmc_load16(a + i, n - i < 16 ? n - i : 16); }
    return llmc_hsum16(acc);
}

/* The forward's output element i of a row: float32, or rounded to bf16.
   Both stores take the same float32 value, so the bf16 one is bitwise the
   float32 one rounded. */
static LLMC_ALWAYS_INLINE void store_out(void* y, int y_bf16, int i, float v) {
    if (y_bf16) { ((uint16_t*)y)[i] = llmc_bf16_round(v); }
    else { ((float*)y)[i] = v; }
}

/* x, or with add (the fused residual): r = x + add, written, and then r. */
static LLMC_ALWAYS_INLINE const float* residual_row(float* r, const float* x, const float* add,
                                                    int C) {
    if (add == NULL) { return x; }
    for (int i = 0; i < C; i++) { r[i] = x[i] + add[i]; }
    return r;
}

/* One row of the forward (of x + add, into r, with add). The variance is
   taken about the mean (two passes), which stays accurate when |mean| is
   large against the spread; both sums run on 16 lanes. */
static LLMC_ALWAYS_INLINE void layernorm_forward_row_body(void* y, int y_bf16, float* mean,
                                                          float* rstd, float* r, const float* x,
                                                          const float* add, const float* weight,
                                                          const float* bias, int C, float eps) {
    x = residual_row(r, x, add, C);
    const float m = sum16(x, C) / C;
    vec16f sumsq = {0};
    for (int i = 0; i < C; i += 16) {
        const int n = C - i < 16 ? C - i : 16;
        const vec16f d = llmc_load16(x + i, n) - m;
        sumsq += llmc_select16(llmc_lanes_below(n), d * d, (vec16f){0});
    }
    const float s = 1.0f / sqrtf(llmc_hsum16(sumsq) / C + eps);
    // one loop per output type, so that each vectorises
    if (y_bf16) {
        for (int i = 0; i < C; i++) { store_out(y, 1, i, (x[i] - m) * s * weight[i] + bias[i]); }
    } else {
        for (int i = 0; i < C; i++) { store_out(y, 0, i, (x[i] - m) * s * weight[i] + bias[i]); }
    }
    *mean = m;
    *rstd = s;
}
LLMC_ISA_VARIANTS(layernorm_forward_row, (void* y, int y_bf16, float* mean, float* rstd,
                                          float* r, const float* x, const float* add,
                                          const float* weight, const float* bias, int C,
                                          float eps),
                  y, y_bf16, mean, rstd, r, x, add, weight, bias, C, eps)

/* Element size of an out_dtype, or 0 if it is none. */
static size_t out_elem(int out_dtype) {
    return out_dtype == LLMC_DTYPE_F32 ? sizeof(float)
           : out_dtype == LLMC_DTYPE_BF16 ? sizeof(uint16_t) : 0;
}

/* layernorm_forward, and with add (not NULL) residual_layernorm_forward. */
static int layernorm_rows(float* residual, void* out, float* mean, float* rstd,
                          const float* inp, const float* add, const float* weight,
                          const float* bias, int B, int T, int C, float eps, int out_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, mean, rstd) && LLMC_NONNULL3(inp, weight, bias),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(eps >= 0.0f, LLMC_ERR_VALUE);   // NaN fails too
    const size_t elem = out_elem(out_dtype);
    LLMC_REQUIRE(elem > 0, LLMC_ERR_VALUE);
    const int64_t BT = (int64_t)B * T;

    // rows are independent
    const int isa = llmc_get_isa();
    void (*const row)(void*, int, float*, float*, float*, const float*, const float*,
                      const float*, const float*, int, float) =
        LLMC_ISA_SELECT(isa, layernorm_forward_row);
    LLMC_SHARES(BT, BT * C, bt0, bt1, for (int64_t bt = bt0; bt < bt1; bt++) {
        row((char*)out + (size_t)bt * C * elem, out_dtype == LLMC_DTYPE_BF16, mean + bt,
            rstd + bt, add != NULL ? residual + (size_t)bt * C : NULL, inp + (size_t)bt * C,
            add != NULL ? add + (size_t)bt * C : NULL, weight, bias, C, eps);
    });
    return LLMC_OK;
}

int layernorm_forward(void* out, float* mean, float* rstd,
                      const float* inp, const float* weight, const float* bias,
                      int B, int T, int C, float eps, int out_dtype) {
    return layernorm_rows(NULL, out, mean, rstd, inp, NULL, weight, bias, B, T, C, eps,
                          out_dtype);
}

int residual_layernorm_forward(float* residual, void* out, float* mean, float* rstd,
                               const float* inp1, const float* inp2, const float* weight,
                               const float* bias, int B, int T, int C, float eps,
                               int out_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL2(residual, inp2), LLMC_ERR_NULL);
    return layernorm_rows(residual, out, mean, rstd, inp1, inp2, weight, bias, B, T, C, eps,
                          out_dtype);
}

/* One row of pass 1 of the backward, dinp, added into dx (written: onto 0,
   llmc_grad_start). With n = (x - mean) * rstd and g = dout * weight:
   dx = rstd * (g - mean(g) - n * mean(g * n)) */
static LLMC_ALWAYS_INLINE void layernorm_backward_row_body(float* dx, const float* dy,
                                                           const float* x, const float* weight,
                                                           float m, float s, int C,
                                                           int written) {
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
        dx[i] = llmc_grad_start(dx + i, written) + s * (dy[i] * weight[i] - g_mean - n * gn_mean);
    }
}
LLMC_ISA_VARIANTS(layernorm_backward_row, (float* dx, const float* dy, const float* x,
                                           const float* weight, float m, float s, int C,
                                           int written),
                  dx, dy, x, weight, m, s, C, written)

int layernorm_backward(float* dinp, float* dweight, float* dbias,
                       const float* dout, const float* inp, const float* weight,
                       const float* mean, const float* rstd,
                       int B, int T, int C, int written) {
    LLMC_REQUIRE(LLMC_NONNULL2(dinp, dout) && LLMC_NONNULL2(inp, weight)
                 && LLMC_NONNULL2(mean, rstd), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    const int64_t BT = (int64_t)B * T;

    // pass 1, dinp: rows are independent
    void (*const row)(float*, const float*, const float*, const float*, float, float, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), layernorm_backward_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        row(dinp + (size_t)bt * C, dout + (size_t)bt * C, inp + (size_t)bt * C, weight,
            mean[bt], rstd[bt], C, written);
    }

    // pass 2, the parameter gradients (those asked for): sums over rows
    return llmc_column_sums(dweight, dbias, dout, inp, mean, rstd, BT, C);
}

/* A vector dot product of three arrays: sum_i a[i] * b[i] * c[i], with the
   same fixed order as llmc_dot (16 lanes, then the lanes in order). */
static LLMC_ALWAYS_INLINE float dot3(const float* a, const float* b, const float* c, int n) {
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

/* One row of the forward (of x + add, into r, with add). The sum of
   squares runs on 16 lanes (llmc_dot), whose partial sums also round less
   than one serial sum. */
static LLMC_ALWAYS_INLINE void rmsnorm_forward_row_body(void* y, int y_bf16, float* rstd,
                                                        float* r, const float* x,
                                                        const float* add, const float* weight,
                                                        int C, float eps) {
    x = residual_row(r, x, add, C);
    const float s = 1.0f / sqrtf(llmc_dot(x, x, C) / C + eps);
    if (y_bf16) {
        for (int i = 0; i < C; i++) { store_out(y, 1, i, x[i] * s * weight[i]); }
    } else {
        for (int i = 0; i < C; i++) { store_out(y, 0, i, x[i] * s * weight[i]); }
    }
    *rstd = s;
}
LLMC_ISA_VARIANTS(rmsnorm_forward_row, (void* y, int y_bf16, float* rstd, float* r,
                                        const float* x, const float* add, const float* weight,
                                        int C, float eps),
                  y, y_bf16, rstd, r, x, add, weight, C, eps)

/* rmsnorm_forward, and with add (not NULL) residual_rmsnorm_forward. */
static int rmsnorm_rows(float* residual, void* out, float* rstd, const float* inp,
                        const float* add, const float* weight, int B, int T, int C, float eps,
                        int out_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL4(out, rstd, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(eps >= 0.0f, LLMC_ERR_VALUE);   // NaN fails too
    const size_t elem = out_elem(out_dtype);
    LLMC_REQUIRE(elem > 0, LLMC_ERR_VALUE);
    const int64_t BT = (int64_t)B * T;

    // rows are independent
    void (*const row)(void*, int, float*, float*, const float*, const float*, const float*, int,
                      float) = LLMC_ISA_SELECT(llmc_get_isa(), rmsnorm_forward_row);
    LLMC_SHARES(BT, BT * C, bt0, bt1, for (int64_t bt = bt0; bt < bt1; bt++) {
        row((char*)out + (size_t)bt * C * elem, out_dtype == LLMC_DTYPE_BF16, rstd + bt,
            add != NULL ? residual + (size_t)bt * C : NULL, inp + (size_t)bt * C,
            add != NULL ? add + (size_t)bt * C : NULL, weight, C, eps);
    });
    return LLMC_OK;
}

int rmsnorm_forward(void* out, float* rstd, const float* inp, const float* weight,
                    int B, int T, int C, float eps, int out_dtype) {
    return rmsnorm_rows(NULL, out, rstd, inp, NULL, weight, B, T, C, eps, out_dtype);
}

int residual_rmsnorm_forward(float* residual, void* out, float* rstd, const float* inp1,
                             const float* inp2, const float* weight, int B, int T, int C,
                             float eps, int out_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL2(residual, inp2), LLMC_ERR_NULL);
    return rmsnorm_rows(residual, out, rstd, inp1, inp2, weight, B, T, C, eps, out_dtype);
}

/* One row of pass 1 of the backward, dinp, added into dx (written: onto 0,
   llmc_grad_start). With s = rstd, n = x * s and g = dout * weight, and
   ds/dx_j = -s^3 x_j / C:
     dx_j = s g_j - s^3 x_j mean(g x) = s (g_j - n_j mean(g n)) */
static LLMC_ALWAYS_INLINE void rmsnorm_backward_row_body(float* dx, const float* dy,
                                                         const float* x, const float* weight,
                                                         float s, int C, int written) {
    const float gn_mean = dot3(dy, weight, x, C) * s / C;
    for (int i = 0; i < C; i++) {
        dx[i] = llmc_grad_start(dx + i, written) + s * (dy[i] * weight[i] - x[i] * s * gn_mean);
    }
}
LLMC_ISA_VARIANTS(rmsnorm_backward_row, (float* dx, const float* dy, const float* x,
                                         const float* weight, float s, int C, int written),
                  dx, dy, x, weight, s, C, written)

int rmsnorm_backward(float* dinp, float* dweight,
                     const float* dout, const float* inp, const float* weight,
                     const float* rstd, int B, int T, int C, int written) {
    LLMC_REQUIRE(LLMC_NONNULL2(dinp, dout) && LLMC_NONNULL3(inp, weight, rstd), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    const int64_t BT = (int64_t)B * T;

    // pass 1, dinp: rows are independent
    void (*const row)(float*, const float*, const float*, const float*, float, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), rmsnorm_backward_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        row(dinp + (size_t)bt * C, dout + (size_t)bt * C, inp + (size_t)bt * C, weight,
            rstd[bt], C, written);
    }

    // pass 2, dweight (unless frozen): sums over rows
    return llmc_column_sums(dweight, NULL, dout, inp, NULL, rstd, BT, C);
}

/* ---- per-head RMSNorm on packed q, k, v rows (Qwen3's q_norm, k_norm) ---- */

static int head_rmsnorm_check(const float* out, const float* rstd, const float* inp,
                              const float* qweight, const float* kweight,
                              int B, int T, int NH, int NKV, int hs) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, rstd, inp) && LLMC_NONNULL2(qweight, kweight),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && NH > 0 && NKV > 0 && hs > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, (size_t)NH + 2 * (size_t)NKV, hs), LLMC_ERR_SHAPE);
    return LLMC_OK;
}

int head_rmsnorm_forward(float* out, float* rstd, const float* inp, const float* qweight,
                         const float* kweight, int B, int T, int NH, int NKV, int hs,
                         float eps) {
    const int status = head_rmsnorm_check(out, rstd, inp, qweight, kweight, B, T, NH, NKV, hs);
    LLMC_REQUIRE(status == LLMC_OK, status);
    LLMC_REQUIRE(eps >= 0.0f, LLMC_ERR_VALUE);   // NaN fails too
    const int nnorm = NH + NKV;                  // normed heads per (b, t)
    const size_t row = (size_t)(NH + 2 * NKV) * hs;
    const int64_t rows = (int64_t)B * T * nnorm;

    // each (b, t, head) is one row of rmsnorm; v heads are copied
    void (*const norm_row)(void*, int, float*, float*, const float*, const float*,
                           const float*, int, float) =
        LLMC_ISA_SELECT(llmc_get_isa(), rmsnorm_forward_row);
    LLMC_SHARES(rows, rows * hs, r0, r1, for (int64_t r = r0; r < r1; r++) {
        const int64_t bt = r / nnorm;
        const int h = (int)(r % nnorm);
        const size_t at = (size_t)bt * row + (size_t)h * hs;
        norm_row(out + at, 0, rstd + r, NULL, inp + at, NULL, h < NH ? qweight : kweight, hs,
                 eps);
        if (h == nnorm - 1 && out != inp) {
            const size_t v0 = (size_t)bt * row + (size_t)nnorm * hs;
            for (size_t i = 0; i < (size_t)NKV * hs; i++) { out[v0 + i] = inp[v0 + i]; }
        }
    });
    return LLMC_OK;
}

/* dweight[i] += sum over rows of dout * x * rstd, for the rows of the heads
   [h0, h0 + nheads) of every (b, t): 16 columns per task, each column summed
   over the rows in order, so any thread count gives the same bits. */
static void head_weight_grads(float* dweight, const float* dout, const float* inp,
                              const float* rstd, int64_t BT, int nnorm, size_t row, int h0,
                              int nheads, int hs) {
    const int blocks = (hs + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int blk = 0; blk < blocks; blk++) {
        const int i0 = blk * 16;
        const int n = hs - i0 < 16 ? hs - i0 : 16;
        vec16f acc = {0};
        for (int64_t bt = 0; bt < BT; bt++) {
            for (int h = h0; h < h0 + nheads; h++) {
                const size_t at = (size_t)bt * row + (size_t)h * hs + i0;
                acc += llmc_load16(dout + at, n) * llmc_load16(inp + at, n)
                       * rstd[bt * nnorm + h];
            }
        }
        for (int j = 0; j < n; j++) { dweight[i0 + j] += acc[j]; }
    }
}

int head_rmsnorm_backward(float* dinp, float* dqweight, float* dkweight, const float* dout,
                          const float* inp, const float* qweight, const float* kweight,
                          const float* rstd, int B, int T, int NH, int NKV, int hs,
                          int written) {
    const int status = head_rmsnorm_check(dinp, rstd, inp, qweight, kweight, B, T, NH, NKV, hs);
    LLMC_REQUIRE(status == LLMC_OK, status);
    LLMC_REQUIRE(dout != NULL && (dqweight == NULL) == (dkweight == NULL), LLMC_ERR_NULL);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    const int nnorm = NH + NKV;
    const size_t row = (size_t)(NH + 2 * NKV) * hs;
    const int64_t BT = (int64_t)B * T;
    const int64_t rows = BT * nnorm;

    // pass 1, dinp: every (b, t, head) row is independent; v heads pass through
    void (*const norm_row)(float*, const float*, const float*, const float*, float, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), rmsnorm_backward_row);
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t bt = r / nnorm;
        const int h = (int)(r % nnorm);
        const size_t at = (size_t)bt * row + (size_t)h * hs;
        norm_row(dinp + at, dout + at, inp + at, h < NH ? qweight : kweight, rstd[r], hs,
                 written);
        if (h == nnorm - 1) {
            const size_t v0 = (size_t)bt * row + (size_t)nnorm * hs;
            for (size_t i = 0; i < (size_t)NKV * hs; i++) {
                dinp[v0 + i] = llmc_grad_start(dinp + v0 + i, written) + dout[v0 + i];
            }
        }
    }

    // pass 2, the weights' gradients (unless frozen): the q heads' rows, then the k heads'
    if (dqweight == NULL) { return LLMC_OK; }
    head_weight_grads(dqweight, dout, inp, rstd, BT, nnorm, row, 0, NH, hs);
    head_weight_grads(dkweight, dout, inp, rstd, BT, nnorm, row, NH, NKV, hs);
    return LLMC_OK;
}
