/*
 * Matrix multiply with optional bias (GPT-2's linear layers), forward and
 * backward.
 *
 * variants:
 *   matmul_forward / matmul_backward   one cache-blocked, register-tiled GEMM
 *                                      serves all three products; its
 *                                      micro-kernel comes in AVX-512, AVX2+FMA
 *                                      and portable builds, picked at run time
 *                                      (llmc_set_isa can force one)
 *   matmul_forward with B*T <= SKINNY_MAX_ROWS
 *                                      the skinny kernel instead (decoding one
 *                                      token per row): streams each weight row
 *                                      once, no packing; same three builds,
 *                                      bitwise the GEMM's result
 *   matmul_forward_naive / _backward_naive
 *                                      plain loops: the reference the tests
 *                                      and the benchmark check against
 *
 * The three products of a linear layer are all "C[M,N] += A[M,K] B[K,N]"
 * with different strides:
 *   forward  out   += inp  . weight^T   M = BT, N = OC, K = C
 *   backward dinp  += dout . weight     M = BT, N = C,  K = OC
 *   backward dW    += dout^T . inp      M = OC, N = C,  K = BT
 * llmc_gemm_f32() reads A and B through (row, column) strides, copies a
 * KC x NR panel of B into a contiguous buffer, and runs a MR x NR
 * micro-kernel that keeps its tile of C in vector registers while it walks
 * k. OpenMP splits the output into (MC rows x NR columns) tiles and never the
 * k dimension, so every output element is summed by one thread in the order
 * k = 0, 1, ..., K-1: results do not depend on the thread count.
 *
 * Decoding calls the forward with M = B*T = the batch size (a few rows):
 * there the GEMM would pack (transpose) the whole weight on every call and
 * its 6-row micro-kernel would mostly multiply padding, so the call is bound
 * by the packing, not by memory. The skinny kernel (matmul_skinny.h) instead
 * reads weight [OC, C] once, in place, a group of W = vector width columns
 * o at a time (threads take contiguous runs of groups; never k), and
 * transposes W x W blocks in registers so that a vector lane is one column o.
 * Each out[m, o] is then the same chain as in the GEMM: start from bias[o]
 * (or 0), one fused multiply-add per k = 0, 1, ..., K-1, so a row's result
 * does not depend on the path, the thread count or the other rows.
 *
 * Both kernels write that multiply-add as MICRO_FMA, explicitly fused on
 * the x86 builds: left to -ffp-contract, GCC's tuning for AMD Zen
 * (avoid-fma-max-bits) keeps a lone dependent chain of 128/256-bit
 * multiply-adds unfused, so a 1-row skinny tile and the GEMM's interleaved
 * tile would round differently. The portable build fuses only where the
 * target has FMA (x86 with -mfma, e.g. -march=native); elsewhere it is a
 * multiply and an add, the same in both kernels.
 */
#include <stdlib.h>
#include <string.h>
#include "llmc.h"
#include "common.h"
#include "isa.h"
#include "gemm.h"
#include "scratch.h"

#define MR 6            /* rows of C per micro-kernel call                  */
#define NR 32           /* columns of C per micro-kernel call: 2 vectors    */
#define KC 384          /* depth of a packed block: a 48 KB B panel, read
                           from L2; 384 measured 2-7% faster than 256 or 512
                           at B*T = 2048 (fewer passes over each C tile)    */
#define MC_MAX 480      /* rows of C per tile (a multiple of MR)            */
#define NC_MAX 256      /* columns of C per tile (a multiple of NR)         */
/* ... and at most where A is packed (dweight), which choose_tiles cuts to
   pack the fewest elements: up to GPT-2's 4C columns in one block */
#define NC_MAX_PACKED_A 3072
/* matmul_forward with B*T <= SKINNY_MAX_ROWS takes the skinny kernel. With
   cold weights (as in decoding) it beat the GEMM 2-3x at 16 rows on every
   instruction set (Zen 4, 2 threads) and still 1.1-1.8x at 32 on AVX2 and
   AVX-512, where the portable build broke even; the GEMM keeps training
   shapes (B*T >= 64) and everything above 16. SKINNY_ROWS rows share one
   pass over the weight (8 accumulators + 8 or 16 block vectors fit the
   registers of each build; 8 beat 4 by 10-30% at 8 rows). */
#define SKINNY_MAX_ROWS LLMC_FEW_ROWS_F32
#define SKINNY_ROWS 8

/*
 * The micro-kernel and the skinny kernel, built once per instruction set
 * from csrc/matmul_micro.h and csrc/matmul_skinny.h with isa.h's target
 * attributes, and chosen at run time like every family's (isa.h lists the
 * CPUs). Unlike the other families they are not one body on 16-lane vectors:
 * each build uses its own register width (4, 8 or 16 floats) and explicit
 * fused multiply-adds, so they are included once per instruction set.
 */
typedef void (*micro_kernel_fn)(int kc, const float* a, size_t ars, size_t aks,
                                const float* bp, float* c, size_t ldc, int nr);

typedef void (*skinny_kernel_fn)(float* out, size_t ldo, const float* inp,
                                 const float* weight, const float* bias,
                                 int M, int K, int o0, int o1);

/* F(0, h), ..., F(W-1, h): the lanes of a shuffle index vector (matmul_skinny.h) */
#define LANES4(F, h) F(0, h), F(1, h), F(2, h), F(3, h)
#define LANES8(F, h) LANES4(F, h), F(4, h), F(5, h), F(6, h), F(7, h)
#define LANES16(F, h) LANES8(F, h), F(8, h), F(9, h), F(10, h), F(11, h), \
                      F(12, h), F(13, h), F(14, h), F(15, h)

#ifdef LLMC_X86_DISPATCH
#include <immintrin.h>
#endif

typedef float vec4f __attribute__((vector_size(16)));
typedef int32_t vec4i __attribute__((vector_size(16)));
#define MICRO_NAME micro_kernel_portable
#define SKINNY_NAME skinny_kernel_portable
#define MICRO_TARGET
#define MICRO_VEC vec4f
#define MICRO_IVEC vec4i
#define MICRO_W 4
#define MICRO_LANES LANES4
#if defined(LLMC_X86_DISPATCH) && defined(__FMA__)
#define MICRO_FMA(acc, a, b) ((acc) = _mm_fmadd_ps(_mm_set1_ps(a), (b), (acc)))
#else
#define MICRO_FMA(acc, a, b) ((acc) += (a) * (b))
#endif
#include "matmul_micro.h"
#include "matmul_skinny.h"   /* last: undefines the MICRO_ and SKINNY_ names */

#ifdef LLMC_X86_DISPATCH
typedef float vec8f __attribute__((vector_size(32)));
typedef int32_t vec8i __attribute__((vector_size(32)));

#define MICRO_NAME micro_kernel_avx2
#define SKINNY_NAME skinny_kernel_avx2
#define MICRO_TARGET LLMC_TARGET_AVX2
#define MICRO_VEC vec8f
#define MICRO_IVEC vec8i
#define MICRO_W 8
#define MICRO_LANES LANES8
#define MICRO_FMA(acc, a, b) ((acc) = _mm256_fmadd_ps(_mm256_set1_ps(a), (b), (acc)))
#include "matmul_micro.h"
#include "matmul_skinny.h"   /* last: undefines the MICRO_ and SKINNY_ names */

#define MICRO_NAME micro_kernel_avx512
#define SKINNY_NAME skinny_kernel_avx512
#define MICRO_TARGET LLMC_TARGET_AVX512
#define MICRO_VEC vec16f
#define MICRO_IVEC vec16i
#define MICRO_W 16
#define MICRO_LANES LANES16
#define MICRO_FMA(acc, a, b) ((acc) = _mm512_fmadd_ps(_mm512_set1_ps(a), (b), (acc)))
#include "matmul_micro.h"
#include "matmul_skinny.h"   /* last: undefines the MICRO_ and SKINNY_ names */
#endif

/* The skinny kernel for the active instruction set and its vector width. */
static skinny_kernel_fn active_skinny_kernel(int* width) {
    switch (llmc_get_isa()) {
#ifdef LLMC_X86_DISPATCH
        case LLMC_ISA_AVX512:
        case LLMC_ISA_AVX512BF16: *width = 16; return skinny_kernel_avx512;
        case LLMC_ISA_AVX2: *width = 8; return skinny_kernel_avx2;
#endif
        default: *width = 4; return skinny_kernel_portable;
    }
}

static micro_kernel_fn active_micro_kernel(void) {
    switch (llmc_get_isa()) {
#ifdef LLMC_X86_DISPATCH
        case LLMC_ISA_AVX512:
        case LLMC_ISA_AVX512BF16: return micro_kernel_avx512;
        case LLMC_ISA_AVX2: return micro_kernel_avx2;
#endif
        default: return micro_kernel_portable;
    }
}

/* The micro-kernel for a partial tile (mr <= MR rows, nr <= NR columns):
   runs the passes that reach the nr columns on a local copy of the tile and
   writes back only its valid part. a is a packed, zero-padded A micro-panel
   (ars = 1, aks = MR), or A itself where the tile has all MR rows. */
static void edge_kernel(micro_kernel_fn micro_kernel, int kc, int mr, int nr, const float* a,
                        size_t ars, size_t aks, const float* bp, float* c, size_t ldc) {
    float tile[MR * NR];
    memset(tile, 0, sizeof tile);
    for (int r = 0; r < mr; r++) { memcpy(tile + r * NR, c + r * ldc, nr * sizeof(float)); }
    micro_kernel(kc, a, ars, aks, bp, tile, NR, nr);
    for (int r = 0; r < mr; r++) { memcpy(c + r * ldc, tile + r * NR, nr * sizeof(float)); }
}

/* Packs A[m0 .. m0+mc, k0 .. k0+kc) as ceil(mc/MR) micro-panels of kc x MR
   floats (A(m,k) = a[m*ars + k*aks]); rows past mc are zero. */
static void pack_a_block(float* ap, const float* a, size_t ars, size_t aks,
                         int m0, int mc, int k0, int kc) {
    for (int mp = 0; mp < mc; mp += MR) {
        float* panel = ap + (size_t)mp * kc;
        const int mr = mc - mp < MR ? mc - mp : MR;
        if (mr < MR) { memset(panel, 0, (size_t)kc * MR * sizeof(float)); }
        if (ars == 1) {
            // A is stored transposed (dout^T for dweight): each k reads mr
            // neighbouring floats
            for (int k = 0; k < kc; k++) {
                const float* a_k = a + (size_t)(k0 + k) * aks + (size_t)(m0 + mp);
                for (int r = 0; r < mr; r++) { panel[(size_t)k * MR + r] = a_k[r]; }
            }
        } else {
            for (int r = 0; r < mr; r++) {
                const float* a_r = a + (size_t)(m0 + mp + r) * ars + (size_t)k0 * aks;
                for (int k = 0; k < kc; k++) { panel[(size_t)k * MR + r] = a_r[(size_t)k * aks]; }
            }
        }
    }
}

/* Packs B[k0 .. k0+kc, j0 .. j0+nr) as kc rows of NR floats
   (B(k,n) = b[k*brs + n*bcs]); columns past nr are zero. */
static void pack_b_panel(float* bp, const float* b, size_t brs, size_t bcs,
                         int k0, int kc, int j0, int nr) {
    if (nr < NR) { memset(bp, 0, (size_t)kc * NR * sizeof(float)); }
    if (bcs == 1) {
        for (int k = 0; k < kc; k++) {
            memcpy(bp + (size_t)k * NR, b + (size_t)(k0 + k) * brs + j0, nr * sizeof(float));
        }
        return;
    }
    // B is stored transposed (weight^T in the forward): 16 source rows x 16 k
    // at a time are turned in registers; partial blocks go element by element,
    // walking each source row contiguously
    int k_done = 0;
    if (brs == 1 && nr == NR) {
        for (; k_done + 16 <= kc; k_done += 16) {
            for (int j = 0; j < NR; j += 16) {
                vec16f rows[16];
                for (int i = 0; i < 16; i++) {
                    memcpy(&rows[i], b + (size_t)(j0 + j + i) * bcs + (size_t)(k0 + k_done),
                           sizeof(vec16f));
                }
                llmc_transpose16(rows);
                for (int i = 0; i < 16; i++) {
                    memcpy(bp + (size_t)(k_done + i) * NR + j, &rows[i], sizeof(vec16f));
                }
            }
        }
    }
    for (int j = 0; j < nr; j++) {
        const float* b_j = b + (size_t)(j0 + j) * bcs + (size_t)k0 * brs;
        for (int k = k_done; k < kc; k++) { bp[(size_t)k * NR + j] = b_j[(size_t)k * brs]; }
    }
}

static int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }
static int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

/*
 * A tile shape (MC rows x NC columns) of an M x N product on nthreads
 * threads, from n_blocks column blocks: blocks of (nearly) equal size, at
 * least 4 tiles a thread, and with few tiles a count the threads share
 * evenly, since static scheduling hands out whole tiles (15 tiles on 2
 * threads leave one idle for a fifteenth of the time). The dimension cut
 * finer is N when A is read in place (MC covers a small M, so B is packed
 * once), M when A is packed.
 */
static void cut_tiles(int M, int N, int pack_a, int nthreads, int64_t n_blocks, int* MC, int* NC) {
    int64_t m_blocks = ceil_div(M, MC_MAX);
    int64_t* cut = pack_a ? &m_blocks : &n_blocks;
    const int64_t cut_max = pack_a ? ceil_div(M, MR) : ceil_div(N, NR);   // blocks of one panel
    if (m_blocks * n_blocks < (int64_t)4 * nthreads) {
        *cut = ceil_div(4L * nthreads, pack_a ? n_blocks : m_blocks);
    }
    for (;;) {
        *cut = *cut < cut_max ? *cut : cut_max;
        *MC = round_up((int)ceil_div(M, m_blocks), MR);
        *NC = round_up((int)ceil_div(N, n_blocks), NR);
        const int64_t tiles = ceil_div(M, *MC) * ceil_div(N, *NC);
        if (tiles % nthreads == 0 || tiles >= (int64_t)32 * nthreads || *cut >= cut_max) { return; }
        (*cut)++;
    }
}

/* The tile shape of an M x N product: cut_tiles' from NC_MAX wide column
   blocks when A is read in place; when A is packed (every tile packs its
   rows of A, and every tile its columns of B), the cut among the 16
   coarsest column counts that packs the fewest elements, N per row block
   plus M per column block. */
static void choose_tiles(int M, int N, int pack_a, int nthreads, int* MC, int* NC) {
    cut_tiles(M, N, pack_a, nthreads, ceil_div(N, NC_MAX), MC, NC);
    if (!pack_a) { return; }
    int64_t best = -1;
    for (int64_t n_blocks = ceil_div(N, NC_MAX_PACKED_A), i = 0;
         i < 16 && n_blocks <= ceil_div(N, NR); n_blocks++, i++) {
        int mc, nc;
        cut_tiles(M, N, pack_a, nthreads, n_blocks, &mc, &nc);
        const int64_t packed = ceil_div(M, mc) * (int64_t)N + ceil_div(N, nc) * (int64_t)M;
        if (best < 0 || packed < best) { best = packed; *MC = mc; *NC = nc; }
    }
}

/* One tile of job g: rows [m0, m0+mc), columns [n0, n0+nc), over all of K.
   ap holds the packed A block (MC x KC), bp one packed B panel. */
static void gemm_tile(micro_kernel_fn micro_kernel, const struct llmc_gemm_f32_job* g,
                      float* ap, float* bp, int m0, int mc, int n0, int nc) {
    const float* a = g->a;
    const size_t ars = g->ars, aks = g->aks, ldc = g->ldc;
    const int pack_a = aks != 1;
    for (int k0 = 0; k0 < g->K; k0 += KC) {
        const int kc = g->K - k0 < KC ? g->K - k0 : KC;
        // packed: all of the tile's rows; in place: only a partial last micro-panel
        const int full_rows = pack_a ? 0 : mc / MR * MR;
        if (mc > full_rows) {
            pack_a_block(ap, a, ars, aks, m0 + full_rows, mc - full_rows, k0, kc);
        }
        for (int j0 = n0; j0 < n0 + nc; j0 += NR) {
            const int nr = n0 + nc - j0 < NR ? n0 + nc - j0 : NR;
            pack_b_panel(bp, g->b, g->brs, g->bcs, k0, kc, j0, nr);
            for (int mp = 0; mp < mc; mp += MR) {
                const int mr = mc - mp < MR ? mc - mp : MR;
                float* c_mj = g->c + (size_t)(m0 + mp) * ldc + j0;
                if (mp < full_rows && nr == NR) {
                    micro_kernel(kc, a + (size_t)(m0 + mp) * ars + k0, ars, 1, bp, c_mj, ldc,
                                 NR);
                } else if (mp < full_rows) {   // in place, a partial column panel
                    edge_kernel(micro_kernel, kc, MR, nr, a + (size_t)(m0 + mp) * ars + k0, ars,
                                1, bp, c_mj, ldc);
                } else if (mr == MR && nr == NR) {
                    micro_kernel(kc, ap + (size_t)(mp - full_rows) * kc, 1, MR, bp, c_mj, ldc,
                                 NR);
                } else {
                    edge_kernel(micro_kernel, kc, mr, nr, ap + (size_t)(mp - full_rows) * kc, 1,
                                MR, bp, c_mj, ldc);
                }
            }
        }
    }
}

/*
 * c[m*ldc + n] += sum_k A(m,k) * B(k,n) for each job, with A(m,k) =
 * a[m*ars + k*aks] and B(k,n) = b[k*brs + n*bcs], for m < M, n < N, k < K.
 *
 * Each job's output is cut into tiles of MC rows x NC columns, and the tiles
 * of all jobs are spread over the threads in one loop. Per tile and k
 * block, each KC x NR panel of B is packed once and used by every row of the
 * tile. A is read in place when its rows are contiguous (forward, dinp);
 * when it is stored transposed (dout^T for dweight) the tile's MC x KC block
 * is packed first. The tile shape follows from that: with A in place, MC
 * covers all of a small M so that B is packed once per call, and NC is cut
 * for parallelism; with A packed, NC is wide so that the packing pays off,
 * and MC is cut instead. A batch of jobs shares the threads, so each job is
 * cut for its share of them. The packed blocks live in scratch.c's arena.
 */
int llmc_gemm_f32_many(const struct llmc_gemm_f32_job* jobs, int count) {
    if (count <= 0) { return LLMC_OK; }
    const micro_kernel_fn micro_kernel = active_micro_kernel();
    const int nthreads = omp_get_max_threads();
    const int job_threads = (int)ceil_div(nthreads, count);
    // per job: its tile shape and the index of its first tile
    int* shape = malloc((size_t)count * 2 * sizeof(int));
    int64_t* first_tile = malloc(((size_t)count + 1) * sizeof(int64_t));
    if (shape == NULL || first_tile == NULL) {
        free(shape);
        free(first_tile);
        return LLMC_ERR_NOMEM;
    }
    int max_mc = MR;
    first_tile[0] = 0;
    for (int g = 0; g < count; g++) {
        const struct llmc_gemm_f32_job* job = &jobs[g];
        int64_t tiles = 0;
        if (job->M > 0 && job->N > 0 && job->K > 0) {
            choose_tiles(job->M, job->N, job->aks != 1, job_threads, &shape[2 * g],
                         &shape[2 * g + 1]);
            tiles = ceil_div(job->M, shape[2 * g]) * ceil_div(job->N, shape[2 * g + 1]);
            max_mc = shape[2 * g] > max_mc ? shape[2 * g] : max_mc;
        }
        first_tile[g + 1] = first_tile[g] + tiles;
    }
    const size_t ap_floats = (size_t)max_mc * KC, bp_floats = (size_t)KC * NR;
    float* scratch = llmc_scratch_acquire(LLMC_SCRATCH_PANELS, (size_t)nthreads
                                          * (ap_floats + bp_floats) * sizeof(float));
    if (scratch == NULL) {
        free(shape);
        free(first_tile);
        return LLMC_ERR_NOMEM;
    }
    const int64_t tiles = first_tile[count];

    #pragma omp parallel
    {
        float* ap = scratch + (size_t)omp_get_thread_num() * (ap_floats + bp_floats);
        float* bp = ap + ap_floats;
        int g = 0;
        #pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            // a thread's tiles ascend, so its job index only moves forward
            while (tile >= first_tile[g + 1]) { g++; }
            const struct llmc_gemm_f32_job* job = &jobs[g];
            const int MC = shape[2 * g], NC = shape[2 * g + 1];
            const int64_t n_blocks = ceil_div(job->N, NC), t = tile - first_tile[g];
            const int m0 = (int)(t / n_blocks) * MC;
            const int n0 = (int)(t % n_blocks) * NC;
            const int mc = job->M - m0 < MC ? job->M - m0 : MC;
            const int nc = job->N - n0 < NC ? job->N - n0 : NC;
            gemm_tile(micro_kernel, job, ap, bp, m0, mc, n0, nc);
        }
    }
    llmc_scratch_done();
    free(shape);
    free(first_tile);
    return LLMC_OK;
}

void llmc_forward_few_rows_many(const struct llmc_few_rows_job* jobs, int count, int K, int N) {
    int width;
    const skinny_kernel_fn skinny = active_skinny_kernel(&width);
    const int64_t groups = ceil_div(N, width);
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count * groups; i++) {
        const struct llmc_few_rows_job* job = &jobs[i / groups];
        const int o0 = (int)(i % groups) * width;
        const int o1 = N - o0 < width ? N : o0 + width;
        skinny(job->out, (size_t)N, job->inp, job->weight, job->bias, job->M, K, o0, o1);
    }
}

/* One product: a batch of one job. */
int llmc_gemm_f32(float* c, size_t ldc, const float* a, size_t ars, size_t aks,
                  const float* b, size_t brs, size_t bcs, int M, int N, int K) {
    const struct llmc_gemm_f32_job job = {.c = c, .ldc = ldc, .a = a, .ars = ars, .aks = aks,
                                          .b = b, .brs = brs, .bcs = bcs, .M = M, .N = N, .K = K};
    return llmc_gemm_f32_many(&job, 1);
}

/* matmul_backward's pointers: dout always; weight for dinp, inp for dweight
   (dinp, dweight and dbias may each be NULL, skipping that product). */
static int backward_pointers_ok(const float* dinp, const float* dweight, const float* dout,
                                const float* inp, const float* weight) {
    return dout != NULL && (dinp == NULL || weight != NULL) && (dweight == NULL || inp != NULL);
}

/* The three arrays of a linear layer, [B,T,C], [B,T,OC] and [OC,C], can exist. */
static int matmul_sizes_fit(int B, int T, int C, int OC) {
    return llmc_count_fits(B, T, C, 1) && llmc_count_fits(B, T, OC, 1)
           && llmc_count_fits(OC, C, 1, 1);
}

int matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                   int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(matmul_sizes_fit(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(BT <= (int64_t)INT32_MAX, LLMC_ERR_SHAPE);

    if (BT <= SKINNY_MAX_ROWS) {
        // few rows (decoding): stream the weight once, columns over threads
        const struct llmc_few_rows_job job = {.out = out, .inp = inp, .weight = weight,
                                              .bias = bias, .M = (int)BT};
        llmc_forward_few_rows_many(&job, 1, C, OC);
        return LLMC_OK;
    }

    // start every row from the bias, then accumulate the product onto it
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        float* out_bt = out + (size_t)bt * OC;
        if (bias != NULL) { memcpy(out_bt, bias, (size_t)OC * sizeof(float)); }
        else { memset(out_bt, 0, (size_t)OC * sizeof(float)); }
    }
    return llmc_gemm_f32(out, (size_t)OC, inp, (size_t)C, 1, weight, 1, (size_t)C,
                           (int)BT, OC, C);
}

/* Zeroes the outputs that `written` (matmul_backward's) asks to be written:
   the (+=) products then write them. */
void llmc_zero_written(float* dinp, float* dweight, int written, int64_t BT, int C, int OC) {
    float* outs[2] = {written & LLMC_WRITE_DINP ? dinp : NULL,
                      written & LLMC_WRITE_DWEIGHT ? dweight : NULL};
    const int64_t rows[2] = {BT, OC};
    for (int k = 0; k < 2; k++) {
        if (outs[k] == NULL) { continue; }
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows[k]; r++) {
            memset(outs[k] + (size_t)r * C, 0, (size_t)C * sizeof(float));
        }
    }
}

int matmul_backward(float* dinp, float* dweight, float* dbias,
                    const float* dout, const float* inp, const float* weight,
                    int B, int T, int C, int OC, int written) {
    LLMC_REQUIRE(backward_pointers_ok(dinp, dweight, dout, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(matmul_sizes_fit(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(BT <= (int64_t)INT32_MAX, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_written_ok(written), LLMC_ERR_VALUE);
    llmc_zero_written(dinp, dweight, written, BT, C, OC);

    if (dinp != NULL) {
        const int status = llmc_gemm_f32(dinp, (size_t)C, dout, (size_t)OC, 1,
                                           weight, (size_t)C, 1, (int)BT, C, OC);
        if (status != LLMC_OK) { return status; }
    }
    if (dweight != NULL) {
        const int status = llmc_gemm_f32(dweight, (size_t)C, dout, 1, (size_t)OC,
                                           inp, (size_t)C, 1, OC, C, (int)BT);
        if (status != LLMC_OK) { return status; }
    }
    // dbias[o] += sum_bt dout[bt, o]
    return dbias != NULL ? llmc_column_sums(NULL, dbias, dout, NULL, NULL, NULL, BT, OC)
                         : LLMC_OK;
}

int matmul_forward_naive(float* out, const float* inp, const float* weight, const float* bias,
                         int B, int T, int C, int OC) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(matmul_sizes_fit(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
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
                          int B, int T, int C, int OC, int written) {
    LLMC_REQUIRE(backward_pointers_ok(dinp, dweight, dout, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && C > 0 && OC > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(matmul_sizes_fit(B, T, C, OC), LLMC_ERR_SHAPE);
    const int64_t BT = (int64_t)B * T;
    LLMC_REQUIRE(llmc_written_ok(written), LLMC_ERR_VALUE);
    llmc_zero_written(dinp, dweight, written, BT, C, OC);
    // dinp: rows are independent
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < (dinp != NULL ? BT : 0); bt++) {
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
        float db = 0.0f;
        for (int64_t bt = 0; bt < BT; bt++) {
            const float d = dout[(size_t)bt * OC + o];
            if (dweight != NULL) {
                float* dw = dweight + (size_t)o * C;
                const float* x = inp + (size_t)bt * C;
                for (int i = 0; i < C; i++) { dw[i] += d * x[i]; }
            }
            db += d;
        }
        if (dbias != NULL) { dbias[o] += db; }
    }
    return LLMC_OK;
}
