/*
 * The bf16 linear layer (contract in llmc_api.h): forward and backward with
 * bf16 x bf16 products summed in float32.
 *
 * variants:
 *   widened   every instruction set without the bf16 dot product (portable,
 *             AVX2, AVX-512F): the float32 operands are rounded to bf16 and
 *             the bf16 weight widened, both into float32 scratch, and
 *             matmul.c's float32 kernels run on them (GEMM, or the skinny
 *             kernel for decoding). A product of two bf16 numbers is exact
 *             in float32, so each fused multiply-add rounds once, as a plain
 *             add of the product would: the result is bitwise the naive
 *             loops' (k = 0, 1, ..., K-1).
 *   naive     plain loops: the reference the tests check against.
 */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"
#include "isa.h"

/* A float32 array holding bf16(x[i]) (rounded), or NULL if out of memory. */
static float* rounded_copy(const float* x, int64_t n) {
    float* out = malloc((size_t)n * sizeof(float));
    if (out == NULL) { return NULL; }
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(n, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) { out[i] = llmc_bf16_widen(llmc_bf16_round(x[i])); }
    }
    return out;
}

/* x widened to a float32 array, or NULL if out of memory. */
static float* widened_copy(const uint16_t* x, int64_t n) {
    float* out = malloc((size_t)n * sizeof(float));
    if (out == NULL) { return NULL; }
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(n, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) { out[i] = llmc_bf16_widen(x[i]); }
    }
    return out;
}

/* matmul_backward's pointers: dout always; weight for dinp, inp for dweight. */
static int backward_pointers_ok(const float* dinp, const float* dweight, const float* dout,
                                const float* inp, const uint16_t* weight) {
    return dout != NULL && (dinp == NULL || weight != NULL) && (dweight == NULL || inp != NULL);
}

/* The three arrays of a linear layer, [B,T,C], [B,T,OC] and [OC,C], can
   exist, and B*T fits an int. */
static int sizes_ok(int B, int T, int C, int OC) {
    return B > 0 && T > 0 && C > 0 && OC > 0 && llmc_count_fits(B, T, C, 1)
           && llmc_count_fits(B, T, OC, 1) && llmc_count_fits(OC, C, 1, 1)
           && (int64_t)B * T <= (int64_t)INT32_MAX;
}

int matmul_forward_bf16(float* out, const float* inp, const uint16_t* weight,
                        const float* bias, int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp) && weight != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    float* inp_rounded = rounded_copy(inp, BT * C);
    float* weight_wide = widened_copy(weight, (int64_t)OC * C);
    int status = LLMC_ERR_NOMEM;
    if (inp_rounded != NULL && weight_wide != NULL) {
        status = matmul_forward(out, inp_rounded, weight_wide, bias, B, T, C, OC);
    }
    free(inp_rounded);
    free(weight_wide);
    return status;
}

int matmul_backward_bf16(float* dinp, float* dweight, float* dbias,
                         const float* dout, const float* inp, const uint16_t* weight,
                         int B, int T, int C, int OC) {
    LLMC_REQUIRE(backward_pointers_ok(dinp, dweight, dout, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    float* dout_rounded = dinp != NULL || dweight != NULL ? rounded_copy(dout, BT * OC) : NULL;
    float* inp_rounded = dweight != NULL ? rounded_copy(inp, BT * C) : NULL;
    float* weight_wide = dinp != NULL ? widened_copy(weight, (int64_t)OC * C) : NULL;
    int status = LLMC_OK;
    if ((dinp != NULL || dweight != NULL) && dout_rounded == NULL) { status = LLMC_ERR_NOMEM; }
    if ((dweight != NULL && inp_rounded == NULL) || (dinp != NULL && weight_wide == NULL)) {
        status = LLMC_ERR_NOMEM;
    }
    if (status == LLMC_OK && (dinp != NULL || dweight != NULL)) {
        status = matmul_backward(dinp, dweight, NULL, dout_rounded, inp_rounded, weight_wide,
                                 B, T, C, OC);
    }
    free(dout_rounded);
    free(inp_rounded);
    free(weight_wide);
    // dbias sums dout itself, unrounded, as the float32 layer does
    if (status == LLMC_OK && dbias != NULL) {
        status = llmc_column_sums(NULL, dbias, dout, NULL, NULL, NULL, BT, OC);
    }
    return status;
}

int matmul_forward_bf16_naive(float* out, const float* inp, const uint16_t* weight,
                              const float* bias, int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp) && weight != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        const float* x = inp + (size_t)bt * C;
        for (int o = 0; o < OC; o++) {
            const uint16_t* w = weight + (size_t)o * C;
            float val = bias != NULL ? bias[o] : 0.0f;
            for (int i = 0; i < C; i++) {
                val += llmc_bf16_widen(llmc_bf16_round(x[i])) * llmc_bf16_widen(w[i]);
            }
            out[(size_t)bt * OC + o] = val;
        }
    }
    return LLMC_OK;
}

int matmul_backward_bf16_naive(float* dinp, float* dweight, float* dbias,
                               const float* dout, const float* inp, const uint16_t* weight,
                               int B, int T, int C, int OC) {
    LLMC_REQUIRE(backward_pointers_ok(dinp, dweight, dout, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    // dinp: rows are independent
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < (dinp != NULL ? BT : 0); bt++) {
        const float* dy = dout + (size_t)bt * OC;
        float* dx = dinp + (size_t)bt * C;
        for (int o = 0; o < OC; o++) {
            const float d = llmc_bf16_widen(llmc_bf16_round(dy[o]));
            const uint16_t* w = weight + (size_t)o * C;
            for (int i = 0; i < C; i++) { dx[i] += d * llmc_bf16_widen(w[i]); }
        }
    }
    // dweight and dbias: one output channel per iteration, rows in order
    #pragma omp parallel for schedule(static)
    for (int o = 0; o < OC; o++) {
        float db = 0.0f;
        for (int64_t bt = 0; bt < BT; bt++) {
            const float d = dout[(size_t)bt * OC + o];
            if (dweight != NULL) {
                const float d_rounded = llmc_bf16_widen(llmc_bf16_round(d));
                float* dw = dweight + (size_t)o * C;
                const float* x = inp + (size_t)bt * C;
                for (int i = 0; i < C; i++) {
                    dw[i] += d_rounded * llmc_bf16_widen(llmc_bf16_round(x[i]));
                }
            }
            db += d;
        }
        if (dbias != NULL) { dbias[o] += db; }
    }
    return LLMC_OK;
}
