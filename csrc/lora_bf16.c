/*
 * LoRA adapters' up side in bf16 (contracts in llmc_api.h; model/lora.py):
 * the products of one linear layer's adapters with their scaled B's, each
 * adapter over the output columns it adapts only, all of them one batch of
 * the bf16 GEMM (gemm.h), forward beside backward.
 *
 * Why: the adapters' B's of a fused layer (q, k and v of qkv; gate and up
 * of fc) stand side by side in one (n r, W) matrix that is zero outside each
 * adapter's columns. As one GEMM, 2/3 (qkv) or 1/2 (fc) of its products are
 * by those zeros; here each adapter reads its own block.
 *
 * The forward's product is cut into slices of ROW_SLICE rows, slice by
 * slice across the adapters, so that the threads share every adapter's
 * rows evenly and a slice of the output stays in cache while it is read and
 * written; it walks the output in whole rows (walk_rows), not a 48-column
 * panel down all B*T rows (a page each row): about 1.6x faster at
 * Qwen3-0.6B's widths (qkv 4096 columns, MLP 6144; 1 thread, CPU time).
 *
 * Determinism: the bf16 GEMM never splits a sum over threads, so every
 * element is summed in one order whatever the thread count or the slices.
 */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"
#include "gemm.h"

#define ROW_SLICE 128

/* The sizes can be those of arrays, and rows[j] = (start, stop) are n
   ascending, disjoint, non-empty column ranges inside [0, W). */
static int up_status(const int* rows, int B, int T, int W, int n, int r) {
    if (B <= 0 || T <= 0 || W <= 0 || n <= 0 || r <= 0) { return LLMC_ERR_SHAPE; }
    // the forward's jobs, a slice of ROW_SLICE rows per adapter, fit an int
    const int64_t jobs = ((int64_t)B * T / ROW_SLICE + 1) * n;
    if (!llmc_count_fits(B, T, W, 1) || !llmc_count_fits(B, T, n, r)
        || !llmc_count_fits(n, r, W, 1) || (int64_t)B * T > (int64_t)INT32_MAX
        || jobs > (int64_t)INT32_MAX) {
        return LLMC_ERR_SHAPE;
    }
    int end = 0;
    for (int j = 0; j < n; j++) {
        const int start = rows[2 * j], stop = rows[2 * j + 1];
        if (start < end || stop <= start || stop > W) { return LLMC_ERR_RANGE; }
        end = stop;
    }
    return LLMC_OK;
}

int lora_up_forward_bf16(float* out, const float* h, const uint16_t* up_t, const int* rows,
                         int B, int T, int W, int n, int r) {
    LLMC_REQUIRE(LLMC_NONNULL4(out, h, up_t, rows), LLMC_ERR_NULL);
    const int status = up_status(rows, B, T, W, n, r);
    LLMC_REQUIRE(status == LLMC_OK, status);
    const int BT = B * T, slices = (BT + ROW_SLICE - 1) / ROW_SLICE;
    struct bf16_gemm* jobs = malloc((size_t)slices * n * sizeof *jobs);
    LLMC_REQUIRE(jobs != NULL, LLMC_ERR_NOMEM);
    const size_t nr = (size_t)n * r;
    for (int s = 0; s < slices; s++) {
        const int t0 = s * ROW_SLICE, rows_s = BT - t0 < ROW_SLICE ? BT - t0 : ROW_SLICE;
        for (int j = 0; j < n; j++) {
            // out[t0:, start:stop] += h_j[t0:] . up_t[j r : (j+1) r, start:stop]
            const int start = rows[2 * j], stop = rows[2 * j + 1];
            jobs[(size_t)s * n + j] = (struct bf16_gemm){
                .c = out + (size_t)t0 * W + start, .ldc = (size_t)W,
                .a = h + (size_t)t0 * nr + (size_t)j * r, .lda = nr, .a_kind = BF16_A_ROWS,
                .b = up_t + (size_t)j * r * W + start, .ldb = (size_t)W,
                .b_kind = BF16_B_ROWS_W, .walk_rows = 1, .M = rows_s, .N = stop - start, .K = r};
        }
    }
    const int result = llmc_gemm_bf16_many(jobs, slices * n);
    free(jobs);
    return result;
}

int lora_up_backward_bf16(float* dh, float* dup_t, const float* dout, const float* h,
                          const uint16_t* up_t, const int* rows, int B, int T, int W, int n,
                          int r) {
    LLMC_REQUIRE(LLMC_NONNULL4(dh, dup_t, dout, h) && LLMC_NONNULL2(up_t, rows), LLMC_ERR_NULL);
    const int status = up_status(rows, B, T, W, n, r);
    LLMC_REQUIRE(status == LLMC_OK, status);
    struct bf16_gemm* jobs = malloc((size_t)2 * n * sizeof *jobs);
    LLMC_REQUIRE(jobs != NULL, LLMC_ERR_NOMEM);
    const size_t nr = (size_t)n * r;
    for (int j = 0; j < n; j++) {
        const int start = rows[2 * j], stop = rows[2 * j + 1];
        const uint16_t* up_j = up_t + (size_t)j * r * W + start;
        // dh_j = dout[:, start:stop] . up_j^T
        jobs[2 * j] = (struct bf16_gemm){
            .c = dh + (size_t)j * r, .ldc = nr,
            .a = dout + start, .lda = (size_t)W, .a_kind = BF16_A_ROWS,
            .b = up_j, .ldb = (size_t)W, .b_kind = BF16_B_COLS_W,
            .init_zero = 1, .M = B * T, .N = r, .K = stop - start};
        // d(up_j) = h_j^T . dout[:, start:stop]
        jobs[2 * j + 1] = (struct bf16_gemm){
            .c = dup_t + (size_t)j * r * W + start, .ldc = (size_t)W,
            .a = h + (size_t)j * r, .lda = nr, .a_kind = BF16_A_COLS,
            .b = dout + start, .ldb = (size_t)W, .b_kind = BF16_B_ROWS_F32,
            .init_zero = 1, .M = r, .N = stop - start, .K = B * T};
    }
    const int result = llmc_gemm_bf16_many(jobs, 2 * n);
    free(jobs);
    return result;
}
