/* Element-wise layers: GELU (tanh approximation), SwiGLU and the residual add.
   GELU and SwiGLU run on 16-lane vectors with llmc_tanh16 / llmc_exp16
   (common.h) in place of libm's tanhf / expf. */
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

/*
 * The logistic sigmoid and its complement on 16 lanes, from e = exp(-|x|),
 * which never overflows:
 *   x >= 0: sig = 1 / (1 + e),  1 - sig = e / (1 + e)
 *   x <  0: sig = e / (1 + e),  1 - sig = 1 / (1 + e)
 * Both are then within a few ulp, also in the tails where 1 - sig or sig
 * alone would cancel or overflow. For x < -87.3, e flushes to 0 (llmc_exp16
 * gives no subnormals), so sig and silu are 0 where their true values are
 * below 1e-36. NaN stays NaN.
 */
static inline void sigmoid16(vec16f x, vec16f* sig, vec16f* sig_c) {
    const vec16i sign_bit = (vec16i){0} + (int32_t)0x80000000;
    const vec16f e = llmc_exp16((vec16f)((vec16i)x | sign_bit));   // exp(-|x|)
    const vec16f r = 1.0f / (1.0f + e);
    const vec16f er = e * r;
    const vec16i positive = x >= (vec16f){0};
    *sig = llmc_select16(positive, r, er);
    *sig_c = llmc_select16(positive, er, r);
}

int swiglu_forward(float* out, const float* inp, long N, int FF) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && FF > 0 && llmc_count_fits(N, FF, 2, 1), LLMC_ERR_SHAPE);
    // 16 columns of one row per iteration, the last block of each row
    // possibly partial; rows and blocks flattened, so that one long row
    // (N == 1, as in decoding) still spreads over the threads
    const long row_blocks = (FF + 15) / 16;
    const long nblocks = N * row_blocks;
    #pragma omp parallel for schedule(static)
    for (long k = 0; k < nblocks; k++) {
        const long r = k / row_blocks;
        const int i = (int)(k % row_blocks) * 16;
        const int n = FF - i < 16 ? FF - i : 16;
        const float* gate = inp + (size_t)r * 2 * FF + i;
        const vec16f g = llmc_load16(gate, n), u = llmc_load16(gate + FF, n);
        vec16f sig, sig_c;
        sigmoid16(g, &sig, &sig_c);
        llmc_store16(out + (size_t)r * FF + i, g * sig * u, n);
    }
    return LLMC_OK;
}

int swiglu_backward(float* dinp, const float* dout, const float* inp, long N, int FF) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dout, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && FF > 0 && llmc_count_fits(N, FF, 2, 1), LLMC_ERR_SHAPE);
    // with s = sigmoid(g): silu(g) = g s, and since s' = s (1 - s),
    //   silu'(g) = s + g s (1 - s) = s (1 + g (1 - s))
    //   dgate += dout * up * silu'(g),  dup += dout * silu(g)
    const long row_blocks = (FF + 15) / 16;
    const long nblocks = N * row_blocks;
    #pragma omp parallel for schedule(static)
    for (long k = 0; k < nblocks; k++) {
        const long r = k / row_blocks;
        const int i = (int)(k % row_blocks) * 16;
        const int n = FF - i < 16 ? FF - i : 16;
        const float* gate = inp + (size_t)r * 2 * FF + i;
        float* dgate = dinp + (size_t)r * 2 * FF + i;
        const vec16f g = llmc_load16(gate, n), u = llmc_load16(gate + FF, n);
        const vec16f dy = llmc_load16(dout + (size_t)r * FF + i, n);
        vec16f sig, sig_c;
        sigmoid16(g, &sig, &sig_c);
        const vec16f dsilu = sig * (1.0f + g * sig_c);
        llmc_store16(dgate, llmc_load16(dgate, n) + dy * u * dsilu, n);
        llmc_store16(dgate + FF, llmc_load16(dgate + FF, n) + dy * (g * sig), n);
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
