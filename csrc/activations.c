/* Element-wise layers: GELU (tanh approximation) and the residual add.
   GELU runs on 16-lane vectors with llmc_tanh16 (common.h) in place of libm's tanhf. */
#include "llmc.h"
#include "common.h"

#define GELU_SCALE 0.7978845608028654f   /* sqrt(2 / pi) */
#define GELU_CUBIC 0.044715f

int gelu_forward(float* out, const float* inp, long N) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    const long nblocks = (N + 15) / 16;
    // 16 elements per iteration in vector registers; the last block may be partial
    #pragma omp parallel for schedule(static)
    for (long blk = 0; blk < nblocks; blk++) {
        const long i = blk * 16;
        const int n = N - i < 16 ? (int)(N - i) : 16;
        const vec16f x = llmc_load16(inp + i, n);
        const vec16f u = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
        llmc_store16(out + i, 0.5f * x * (1.0f + llmc_tanh16(u)), n);
    }
    return LLMC_OK;
}

int gelu_backward(float* dinp, const float* dout, const float* inp, long N) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dout, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    const long nblocks = (N + 15) / 16;
    // d/dx [0.5 x (1 + tanh u)] = 0.5 (1 + tanh u) + 0.5 x sech^2(u) du/dx,
    // with du/dx = GELU_SCALE (1 + 3 GELU_CUBIC x^2)
    #pragma omp parallel for schedule(static)
    for (long blk = 0; blk < nblocks; blk++) {
        const long i = blk * 16;
        const int n = N - i < 16 ? (int)(N - i) : 16;
        const vec16f x = llmc_load16(inp + i, n);
        const vec16f u = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
        const vec16f th = llmc_tanh16(u);
        const vec16f sech2 = 1.0f - th * th;
        const vec16f du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * x * x);
        const vec16f grad = 0.5f * (1.0f + th) + 0.5f * x * sech2 * du;
        llmc_store16(dinp + i, llmc_load16(dinp + i, n) + grad * llmc_load16(dout + i, n), n);
    }
    return LLMC_OK;
}

int residual_forward(float* out, const float* inp1, const float* inp2, long N) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp1, inp2), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) { out[i] = inp1[i] + inp2[i]; }
    return LLMC_OK;
}

int residual_backward(float* dinp1, float* dinp2, const float* dout, long N) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp1, dinp2, dout), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) {
        dinp1[i] += dout[i];
        dinp2[i] += dout[i];
    }
    return LLMC_OK;
}
