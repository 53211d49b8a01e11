/* Token + position embedding (GPT-2's wte + wpe), forward and backward. With
   wpe NULL (RoPE and ALiBi models) only the token rows are gathered.
   Sinusoidal positions, a fixed function of the position, are added by
   sinusoidal_forward; having no parameters, they need no backward. */
#include <math.h>

#include "llmc.h"
#include "common.h"
#include "isa.h"

/* Channels per block in the backward pass. Each thread owns whole channel
   blocks and walks every (b, t) in order, so the gathers into dwte never
   race and always add up in the same order. */
#define ENCODER_CHANNEL_BLOCK 64
#define SINUSOIDAL_BASE 10000.0

/* One row: out_bt = wte_ix (+ wpe_t unless NULL). */
static LLMC_ALWAYS_INLINE void encoder_row_body(float* out_bt, const float* wte_ix,
                                                const float* wpe_t, int C) {
    if (wpe_t != NULL) {
        for (int i = 0; i < C; i++) { out_bt[i] = wte_ix[i] + wpe_t[i]; }
    } else {
        for (int i = 0; i < C; i++) { out_bt[i] = wte_ix[i]; }
    }
}
LLMC_ISA_VARIANTS(encoder_row, (float* out_bt, const float* wte_ix, const float* wpe_t, int C),
                  out_bt, wte_ix, wpe_t, C)

int encoder_forward(float* out, const int* inp, const float* wte, const float* wpe,
                    int B, int T, int C, int V) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, wte), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && V > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1) && llmc_count_fits(V, C, 1, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_first_bad_index(inp, BT, V) < 0, LLMC_ERR_RANGE);

    void (*const row)(float*, const float*, const float*, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), encoder_row);
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        row(out + (size_t)bt * C, wte + (size_t)inp[bt] * C,
            wpe != NULL ? wpe + (size_t)(bt % T) * C : NULL, C);
    }
    return LLMC_OK;
}

/* Channels [i0, i1) of the backward, every (b, t) in order. */
static LLMC_ALWAYS_INLINE void encoder_backward_block_body(float* dwte, float* dwpe,
                                                           const float* dout, const int* inp,
                                                           int64_t BT, int T, int C, int i0,
                                                           int i1) {
    for (int64_t bt = 0; bt < BT; bt++) {
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
LLMC_ISA_VARIANTS(encoder_backward_block,
                  (float* dwte, float* dwpe, const float* dout, const int* inp, int64_t BT, int T,
                   int C, int i0, int i1),
                  dwte, dwpe, dout, inp, BT, T, C, i0, i1)

int encoder_backward(float* dwte, float* dwpe, const float* dout, const int* inp,
                     int B, int T, int C, int V) {
    LLMC_REQUIRE(LLMC_NONNULL3(dwte, dout, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && V > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, C, 1) && llmc_count_fits(V, C, 1, 1), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_first_bad_index(inp, BT, V) < 0, LLMC_ERR_RANGE);
    const int nblocks = (C + ENCODER_CHANNEL_BLOCK - 1) / ENCODER_CHANNEL_BLOCK;

    void (*const block)(float*, float*, const float*, const int*, int64_t, int, int, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), encoder_backward_block);
    #pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int i0 = blk * ENCODER_CHANNEL_BLOCK;
        const int i1 = i0 + ENCODER_CHANNEL_BLOCK < C ? i0 + ENCODER_CHANNEL_BLOCK : C;
        block(dwte, dwpe, dout, inp, BT, T, C, i0, i1);
    }
    return LLMC_OK;
}

/* Sinusoidal positions (the original Transformer's, no parameters): row
   (b, t) at position p = pos[b] + t gets sin(p w_i) in channel 2i and
   cos(p w_i) in channel 2i + 1, w_i = 10000^(-2i/C). The angle is formed in
   double, as RoPE's (rope.c), and each value rounded to float once; a row
   depends only on p, so a decoded position adds exactly what a full
   forward adds at that position. Parallel over rows. */
int sinusoidal_forward(float* out, const float* inp, const int* pos, int B, int T, int C) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && llmc_count_fits(B, T, C, 1), LLMC_ERR_SHAPE);
    if (pos != NULL) {
        for (int b = 0; b < B; b++) { LLMC_REQUIRE(pos[b] >= 0, LLMC_ERR_RANGE); }
    }
    const int64_t BT = (int64_t)B * T;
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        const int64_t p = (pos != NULL ? (int64_t)pos[bt / T] : 0) + bt % T;
        const float* x = inp + (size_t)bt * C;
        float* y = out + (size_t)bt * C;
        for (int i = 0; i < C; i += 2) {
            const double a = (double)p * pow(SINUSOIDAL_BASE, -(double)i / (double)C);
            y[i] = x[i] + (float)sin(a);
            if (i + 1 < C) { y[i + 1] = x[i + 1] + (float)cos(a); }
        }
    }
    return LLMC_OK;
}
