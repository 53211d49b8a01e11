/* Dropout on [B, T, C] activations (the embedding's output, the residual
   branches'): each element survives or not by a hash of (seed, b, t, c),
   dropout.h's mask, so the backward regenerates the forward's mask instead of
   storing it. The forward and the backward are the same masking (inverted
   dropout is linear in its input), run in place or not. Parallel over the
   B T rows, a thread's contiguous share through one call of a loop built per
   instruction set (isa.h). */
#include "llmc.h"
#include "common.h"
#include "dropout.h"
#include "isa.h"

/* Rows [bt0, bt1) of [B, T, C]. */
static LLMC_ALWAYS_INLINE void dropout_rows_body(float* out, const float* inp, int64_t bt0,
                                                 int64_t bt1, int T, int C, llmc_dropout d) {
    for (int64_t bt = bt0; bt < bt1; bt++) {
        const llmc_dropout row = llmc_dropout_at(d, bt / T, 0);
        llmc_dropout_row(out + (size_t)bt * C, inp + (size_t)bt * C, 0, C, row, bt % T);
    }
}
LLMC_ISA_VARIANTS(dropout_rows, (float* out, const float* inp, int64_t bt0, int64_t bt1, int T,
                                 int C, llmc_dropout d),
                  out, inp, bt0, bt1, T, C, d)

/* The masking both kernels are; sizes and p not yet checked. */
static int dropout_apply(float* out, const float* inp, int B, int T, int C, float p,
                         uint64_t seed) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(p), LLMC_ERR_VALUE);
    const llmc_dropout d = llmc_dropout_of(p, seed);
    if (!llmc_dropout_on(d) && out == inp) { return LLMC_OK; }   // the identity, in place
    void (*const rows)(float*, const float*, int64_t, int64_t, int, int, llmc_dropout) =
        LLMC_ISA_SELECT(llmc_get_isa(), dropout_rows);
    #pragma omp parallel
    {
        int64_t bt0, bt1;
        llmc_thread_share((int64_t)B * T, &bt0, &bt1);
        if (bt0 < bt1) { rows(out, inp, bt0, bt1, T, C, d); }
    }
    return LLMC_OK;
}

int dropout_forward(float* out, const float* inp, int B, int T, int C, float p, uint64_t seed) {
    return dropout_apply(out, inp, B, T, C, p, seed);
}

int dropout_backward(float* dinp, const float* dout, int B, int T, int C, float p,
                     uint64_t seed) {
    return dropout_apply(dinp, dout, B, T, C, p, seed);
}
