/*
 * Matrix multiply with optional bias (GPT-2's linear layers), forward and
 * backward.
 *
 * variants:
 *   matmul_forward / matmul_backward   one cache-blocked, register-tiled GEMM
 *                                      serves all three products
 *   matmul_forward_naive / _backward_naive
 *                                      plain loops: the reference the tests
 *                                      and the benchmark check against
 *
 * The three products of a linear layer are all "C[M,N] += A[M,K] B[K,N]"
 * with different strides:
 *   forward  out   += inp  . weight^T   M = BT, N = OC, K = C
 *   backward dinp  += dout . weight     M = BT, N = C,  K = OC
 *   backward dW    += dout^T . inp      M = OC, N = C,  K = BT
 * gemm_accumulate() reads A and B through (row, column) strides, copies a
 * KC x NR panel of B into a contiguous buffer, and runs a MR x NR
 * micro-kernel that keeps its tile of C in vector registers while it walks
 * k. OpenMP splits the output into (MC rows x NR columns) tiles and never the
 * k dimension, so every output element is summed by one thread in the order
 * k = 0, 1, ..., K-1: results do not depend on the thread count.
 */
#include <stdlib.h>
#include <string.h>
#include "llmc.h"
#include "common.h"

/* 16 floats; with -march=native on an AVX-512 machine, one zmm register. */
typedef float vec16 __attribute__((vector_size(64)));

#define MR 6            /* rows of C per micro-kernel call                */
#define NR 32           /* columns of C per micro-kernel call: 2 vectors  */
#define KC 256          /* depth of a packed B panel                      */
#define MC 96           /* rows of C per parallel tile (a multiple of MR) */

static inline vec16 load16(const float* p) { vec16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, vec16 v) { memcpy(p, &v, sizeof v); }

/*
 * c[r, 0..NR) += sum_{k < kc} a[r*ars + k*aks] * bp[k, 0..NR)  for r < MR.
 * bp is a packed panel, NR floats per k; c has row stride ldc.
 */
static inline void micro_kernel(int kc, const float* a, size_t ars, size_t aks,
                                const float* bp, float* c, size_t ldc) {
    vec16 acc[MR][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = load16(c + r * ldc);
        acc[r][1] = load16(c + r * ldc + 16);
    }
    for (int k = 0; k < kc; k++) {
        const vec16 b0 = load16(bp + (size_t)k * NR);
        const vec16 b1 = load16(bp + (size_t)k * NR + 16);
        const float* a_k = a + k * aks;
        for (int r = 0; r < MR; r++) {
            const float a_rk = a_k[r * ars];
            acc[r][0] += a_rk * b0;
            acc[r][1] += a_rk * b1;
        }
    }
    for (int r = 0; r < MR; r++) {
        store16(c + r * ldc, acc[r][0]);
        store16(c + r * ldc + 16, acc[r][1]);
    }
}

/* The same for a partial tile (mr <= MR rows, nr <= NR columns): works on a
   local copy of the tile and writes back only its valid part. */
static void edge_kernel(int kc, int mr, int nr, const float* a, size_t ars, size_t aks,
                        const float* bp, float* c, size_t ldc) {
    float tile[MR * NR];
    memset(tile, 0, sizeof tile);
    for (int r = 0; r < mr; r++) { memcpy(tile + r * NR, c + r * ldc, nr * sizeof(float)); }
    if (mr == MR) {
        micro_kernel(kc, a, ars, aks, bp, tile, NR);
    } else {
        for (int r = 0; r < mr; r++) {
            float* tile_r = tile + r * NR;
            const float* a_r = a + r * ars;
            for (int k = 0; k < kc; k++) {
                const float a_rk = a_r[k * aks];
                const float* bp_k = bp + (size_t)k * NR;
                for (int j = 0; j < NR; j++) { tile_r[j] += a_rk * bp_k[j]; }
            }
        }
    }
    for (int r = 0; r < mr; r++) { memcpy(c + r * ldc, tile + r * NR, nr * sizeof(float)); }
}

/* Copies B[k0 .. k0+kc, j0 .. j0+nr) into bp as kc rows of NR floats,
   zero-filling columns past nr. */
static void pack_b_panel(float* bp, const float* b, size_t brs, size_t bcs,
                         int k0, int kc, int j0, int nr) {
    if (nr < NR) { memset(bp, 0, (size_t)kc * NR * sizeof(float)); }
    if (bcs == 1) {
        for (int k = 0; k < kc; k++) {
            memcpy(bp + (size_t)k * NR, b + (size_t)(k0 + k) * brs + j0, nr * sizeof(float));
        }
    } else {
        // B is stored transposed (weight^T in the forward): walk each source
        // row contiguously
        for (int j = 0; j < nr; j++) {
            const float* b_j = b + (size_t)(j0 + j) * bcs + (size_t)k0 * brs;
            for (int k = 0; k < kc; k++) { bp[(size_t)k * NR + j] = b_j[(size_t)k * brs]; }
        }
    }
}

/*
 * c[m*ldc + n] += sum_k A(m,k) * B(k,n), with A(m,k) = a[m*ars + k*aks] and
 * B(k,n) = b[k*brs + n*bcs], for m < M, n < N, k < K.
 */
static int gemm_accumulate(float* c, size_t ldc,
                           const float* a, size_t ars, size_t aks,
                           const float* b, size_t brs, size_t bcs,
                           int M, int N, int K) {
    const long n_panels = (N + NR - 1) / NR;
    const long m_blocks = (M + MC - 1) / MC;
    const long tiles = n_panels * m_blocks;
    const int nthreads = omp_get_max_threads();
    float* packs = aligned_alloc(64, (size_t)nthreads * KC * NR * sizeof(float));
    LLMC_REQUIRE(packs != NULL, LLMC_ERR_NOMEM);

    // tiles go row-block major, so the tiles one thread takes in a row share
    // their MC x K block of A, which stays in L2
    #pragma omp parallel
    {
        float* bp = packs + (size_t)omp_get_thread_num() * KC * NR;
        #pragma omp for schedule(static)
        for (long tile = 0; tile < tiles; tile++) {
            const int m0 = (int)(tile / n_panels) * MC;
            const int j0 = (int)(tile % n_panels) * NR;
            const int mc = M - m0 < MC ? M - m0 : MC;
            const int nr = N - j0 < NR ? N - j0 : NR;
            for (int k0 = 0; k0 < K; k0 += KC) {
                const int kc = K - k0 < KC ? K - k0 : KC;
                pack_b_panel(bp, b, brs, bcs, k0, kc, j0, nr);
                for (int m = m0; m < m0 + mc; m += MR) {
                    const int mr = m0 + mc - m < MR ? m0 + mc - m : MR;
                    const float* a_mk = a + (size_t)m * ars + (size_t)k0 * aks;
                    float* c_mj = c + (size_t)m * ldc + j0;
                    if (mr == MR && nr == NR) {
                        micro_kernel(kc, a_mk, ars, aks, bp, c_mj, ldc);
                    } else {
                        edge_kernel(kc, mr, nr, a_mk, ars, aks, bp, c_mj, ldc);
                    }
                }
            }
        }
    }
    free(packs);
    return LLMC_OK;
}

/* Columns per block when summing dout over rows for dbias. */
#define BIAS_BLOCK 64

/* dbias[o] += sum_bt dout[bt, o]: each thread owns whole column blocks and
   walks the rows in order. */
static void bias_backward(float* dbias, const float* dout, long BT, int OC) {
    const int nblocks = (OC + BIAS_BLOCK - 1) / BIAS_BLOCK;
    #pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int o0 = blk * BIAS_BLOCK;
        const int o1 = o0 + BIAS_BLOCK < OC ? o0 + BIAS_BLOCK : OC;
        float acc[BIAS_BLOCK] = {0};
        for (long bt = 0; bt < BT; bt++) {
            const float* dout_bt = dout + (size_t)bt * OC;
            for (int o = o0; o < o1; o++) { acc[o - o0] += dout_bt[o]; }
        }
        for (int o = o0; o < o1; o++) { dbias[o] += acc[o - o0]; }
    }
}

int matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                   int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    LLMC_REQUIRE(BT <= 0x7fffffffL, LLMC_ERR_SHAPE);

    // start every row from the bias, then accumulate the product onto it
    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        float* out_bt = out + (size_t)bt * OC;
        if (bias != NULL) { memcpy(out_bt, bias, (size_t)OC * sizeof(float)); }
        else { memset(out_bt, 0, (size_t)OC * sizeof(float)); }
    }
    return gemm_accumulate(out, (size_t)OC, inp, (size_t)C, 1, weight, 1, (size_t)C,
                           (int)BT, OC, C);
}

int matmul_backward(float* dinp, float* dweight, float* dbias,
                    const float* dout, const float* inp, const float* weight,
                    int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dweight, dout) && LLMC_NONNULL2(inp, weight),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    LLMC_REQUIRE(BT <= 0x7fffffffL, LLMC_ERR_SHAPE);

    int status = gemm_accumulate(dinp, (size_t)C, dout, (size_t)OC, 1, weight, (size_t)C, 1,
                                 (int)BT, C, OC);
    if (status != LLMC_OK) { return status; }
    status = gemm_accumulate(dweight, (size_t)C, dout, 1, (size_t)OC, inp, (size_t)C, 1,
                             OC, C, (int)BT);
    if (status != LLMC_OK) { return status; }
    if (dbias != NULL) { bias_backward(dbias, dout, BT, OC); }
    return LLMC_OK;
}

int matmul_forward_naive(float* out, const float* inp, const float* weight, const float* bias,
                         int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const float* x = inp + (size_t)bt * C;
        for (int o = 0; o < OC; o++) {
            const float* w = weight + (size_t)o * C;
            float val = bias != NULL ? bias[o] : 0.0f;
            for (int i = 0; i < C; i++) { val += x[i] * w[i]; }
            out[(size_t)bt * OC + o] = val;
        }
    }
    return LLMC_OK;
}

int matmul_backward_naive(float* dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp, const float* weight,
                          int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dweight, dout) && LLMC_NONNULL2(inp, weight),
                 LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    const long BT = (long)B * T;
    // dinp: rows are independent
    #pragma omp parallel for schedule(static)
    for (long bt = 0; bt < BT; bt++) {
        const float* dy = dout + (size_t)bt * OC;
        float* dx = dinp + (size_t)bt * C;
        for (int o = 0; o < OC; o++) {
            const float* w = weight + (size_t)o * C;
            for (int i = 0; i < C; i++) { dx[i] += dy[o] * w[i]; }
        }
    }
    // dweight and dbias: one output channel per iteration, rows in order
    #pragma omp parallel for schedule(static)
    for (int o = 0; o < OC; o++) {
        float* dw = dweight + (size_t)o * C;
        float db = 0.0f;
        for (long bt = 0; bt < BT; bt++) {
            const float d = dout[(size_t)bt * OC + o];
            const float* x = inp + (size_t)bt * C;
            for (int i = 0; i < C; i++) { dw[i] += d * x[i]; }
            db += d;
        }
        if (dbias != NULL) { dbias[o] += db; }
    }
    return LLMC_OK;
}
