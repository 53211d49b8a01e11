/* Token + position embedding (GPT-2's wte + wpe), forward and backward. With
   wpe NULL (RoPE and ALiBi models) only the token rows are gathered. */
#include "llmc.h"
#include "common.h"

/* Channels per block in the backward pass. Each thread owns whole channel
   blocks and walks every (b, t) in order, so the gathers into dwte never
   race and always add up in the same order. */
#define ENCODER_CHANNEL_BLOCK 64

/* Index of the first token outside [0, V), or -1 if all are in range. */
static long first_bad_token(const int* inp, long BT, int V) {
    for (long bt = 0; bt < BT; bt++) {
        if (inp[bt] < 0 || inp[bt] >= V) { return bt; }
    }
    return -1;
}

int encoder_forward(float* out, const int* inp, const float* wte, const float* wpe,
                    int B, int T, int C, int V) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, wte), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && V > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1) && llmc_count_fits(V, C, 1, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    LLMC_REQUIRE(first_bad_token(inp, BT, V) < 0, LLMC_ERR_RANGE);

    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const int t = (int)(bt % T);
        float* out_bt = out + (size_t)bt * C;
        const float* wte_ix = wte + (size_t)inp[bt] * C;
        if (wpe != NULL) {
            const float* wpe_t = wpe + (size_t)t * C;
            for (int i = 0; i < C; i++) { out_bt[i] = wte_ix[i] + wpe_t[i]; }
        } else {
            for (int i = 0; i < C; i++) { out_bt[i] = wte_ix[i]; }
        }
    }
    return LLMC_OK;
}

int encoder_backward(float* dwte, float* dwpe, const float* dout, const int* inp,
                     int B, int T, int C, int V) {
    LLMC_REQUIRE(LLMC_NONNULL3(dwte, dout, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && V > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1) && llmc_count_fits(V, C, 1, 1), LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    LLMC_REQUIRE(first_bad_token(inp, BT, V) < 0, LLMC_ERR_RANGE);
    const int nblocks = (C + ENCODER_CHANNEL_BLOCK - 1) / ENCODER_CHANNEL_BLOCK;

    #pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int i0 = blk * ENCODER_CHANNEL_BLOCK;
        const int i1 = i0 + ENCODER_CHANNEL_BLOCK < C ? i0 + ENCODER_CHANNEL_BLOCK : C;
        for (long bt = 0; bt < BT; bt++) {
            const int t = (int)(bt % T);
            const float* dout_bt = dout + (size_t)bt * C;
            float* dwte_ix = dwte + (size_t)inp[bt] * C;
            for (int i = i0; i < i1; i++) { dwte_ix[i] += dout_bt[i]; }
            if (dwpe != NULL) {
                float* dwpe_t = dwpe + (size_t)t * C;
                for (int i = i0; i < i1; i++) { dwpe_t[i] += dout_bt[i]; }
            }
        }
    }
    return LLMC_OK;
}
