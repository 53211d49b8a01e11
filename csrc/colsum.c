/* llmc_column_sums (contract in common.h): the sums over rows behind dbias
   and the norms' parameter gradients. */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"
#include "isa.h"

/* Rows per chunk: chunks of at least 64 rows, and at most 256 of them. */
static int64_t row_chunk(int64_t rows) {
    const int64_t chunk = (rows + 255) / 256;
    return chunk < 64 ? 64 : chunk;
}

/* The partial rows of one chunk, rows [bt0, bt1): pw (when dweight is
   wanted) and pb (when dbias is) start from 0 and gather the chunk's rows
   in order, reading whole rows. */
static LLMC_ALWAYS_INLINE void chunk_sums_body(float* pw, float* pb, const float* dout,
                                               const float* inp, const float* mean,
                                               const float* rstd, int64_t bt0, int64_t bt1, int C) {
    if (pw != NULL) { memset(pw, 0, (size_t)C * sizeof(float)); }
    if (pb != NULL) { memset(pb, 0, (size_t)C * sizeof(float)); }
    for (int64_t bt = bt0; bt < bt1; bt++) {
        const float* dy = dout + (size_t)bt * C;
        if (pw != NULL) {
            const float* x = inp + (size_t)bt * C;
            const float m = mean != NULL ? mean[bt] : 0.0f, s = rstd[bt];
            for (int i = 0; i < C; i++) { pw[i] += dy[i] * ((x[i] - m) * s); }
        }
        if (pb != NULL) {
            for (int i = 0; i < C; i++) { pb[i] += dy[i]; }
        }
    }
}
LLMC_ISA_VARIANTS(chunk_sums,
                  (float* pw, float* pb, const float* dout, const float* inp, const float* mean,
                   const float* rstd, int64_t bt0, int64_t bt1, int C),
                  pw, pb, dout, inp, mean, rstd, bt0, bt1, C)

/* dst[i] += partial[0][i] + partial[1][i] + ... (nchunks rows of n, in
   order), parallel over blocks of columns. */
static void add_chunk_sums(float* dst, const float* partial, int64_t nchunks, int n) {
    const int nblocks = (n + 63) / 64;
    #pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int i0 = blk * 64, i1 = i0 + 64 < n ? i0 + 64 : n;
        for (int64_t ch = 0; ch < nchunks; ch++) {
            const float* p = partial + (size_t)ch * n;
            for (int i = i0; i < i1; i++) { dst[i] += p[i]; }
        }
    }
}

int llmc_column_sums(float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* mean, const float* rstd, int64_t BT, int C) {
    if (dweight == NULL && dbias == NULL) { return LLMC_OK; }   // a frozen norm
    const int64_t chunk = row_chunk(BT), nchunks = (BT + chunk - 1) / chunk;
    const size_t rows = (size_t)nchunks * C;   // floats of one set of partial rows
    float* partial = malloc(((dweight != NULL) + (dbias != NULL)) * rows * sizeof(float));
    LLMC_REQUIRE(partial != NULL, LLMC_ERR_NOMEM);
    float* partial_w = dweight != NULL ? partial : NULL;
    float* partial_b = dbias != NULL ? partial + (dweight != NULL ? rows : 0) : NULL;
    void (*const sums)(float*, float*, const float*, const float*, const float*, const float*,
                       int64_t, int64_t, int) = LLMC_ISA_SELECT(llmc_get_isa(), chunk_sums);

    #pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t bt1 = (ch + 1) * chunk < BT ? (ch + 1) * chunk : BT;
        sums(partial_w != NULL ? partial_w + (size_t)ch * C : NULL,
             partial_b != NULL ? partial_b + (size_t)ch * C : NULL,
             dout, inp, mean, rstd, ch * chunk, bt1, C);
    }
    if (dweight != NULL) { add_chunk_sums(dweight, partial_w, nchunks, C); }
    if (dbias != NULL) { add_chunk_sums(dbias, partial_b, nchunks, C); }
    free(partial);
    return LLMC_OK;
}
