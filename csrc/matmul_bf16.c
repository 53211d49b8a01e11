/*
 * The bf16 linear layer (contract in llmc_api.h): forward and backward with
 * bf16 x bf16 products summed in float32. Its three products are all
 * C[M,N] (+)= A[M,K] . B[K,N]:
 *   forward  out   = bias + bf16(inp) . weight^T     M = BT, N = OC, K = C
 *   backward dinp += bf16(dout) . weight             M = BT, N = C,  K = OC
 *   backward dW   += bf16(dout)^T . bf16(inp)        M = OC, N = C,  K = BT
 * and dbias sums dout itself, unrounded, as matmul.c does (llmc_column_sums).
 * inp may be bf16 already (a norm's or an activation's bf16 output): every
 * variant then reads it as it is where it would have rounded a float32 one,
 * so bf16(x) gives bitwise the results of x.
 *
 * variants:
 *   dot product  avx512bf16 only: vdpbf16ps multiplies bf16 pairs as they
 *                are, twice the multiply-adds of a float32 FMA per
 *                instruction, from half the bytes. Each thread packs the
 *                operands of its tiles of C into k-pair panels (A: 8 rows,
 *                B: 48 columns, K in blocks of up to 768) and an 8 x 48 tile
 *                of C stays in 24 registers over a block (N's last
 *                columns, fewer than 48, in one or two vectors a row when
 *                they fit: no whole tile's work for 16 columns); meanwhile the
 *                source of the next panel and K block is prefetched into L2,
 *                so that packing reads L2 rather than waiting on memory (the
 *                kernels are in matmul_bf16_micro.h). dweight's tiles pack
 *                all their B panels of a K block first and walk C in whole
 *                rows, since its C is read and written on every call. The
 *                packed panels live in scratch.c's arena, kept between calls.
 *                A batch of products (llmc_gemm_bf16_many: moe.c's experts,
 *                lora_bf16.c's adapters) is cut into equal shares of work,
 *                one a thread, a product split where a share ends, and each
 *                part tiled for one thread: experts of unequal rows keep
 *                both threads busy (the tiles dealt out by count left one
 *                thread idle 12% of the time at bench --moe's experts).
 *   dot product, skinny
 *                the forward with B*T <= 12 rows (decoding): the GEMM would
 *                repack the whole weight per call for a few rows, so the
 *                weight rows are read in place, once, and turned into the
 *                GEMM's panel layout in registers; threads take columns.
 *   widened      every other instruction set (portable, AVX2, AVX-512F): the
 *                float32 operands are rounded to bf16 into float32 scratch,
 *                and the bf16 weight widened there a block of about 4 MiB of
 *                rows at a time (never the whole weight), and matmul.c's
 *                float32 kernels run on them (GEMM, or its skinny kernel).
 *   naive        plain loops: the reference the tests check against.
 *
 * Rounding and order. A product of two bf16 numbers (8 significant bits
 * each) is exact in float32, so every variant sums the same exact terms onto
 * the element's start value (bias, 0, or what a (+=) output holds), one
 * float32 rounding (to nearest even) per term, and they differ only in order:
 *   widened, naive   k = 0, 1, ..., K-1 (a fused multiply-add of an exact
 *                    product rounds as the add alone: bitwise the naive loops)
 *   dot product      per pair p = 0, 1, ...: first + a[2p+1] b[2p+1], then
 *                    + a[2p] b[2p], each rounded: Intel's definition of
 *                    vdpbf16ps, which Zen 4 follows bit for bit (2M random
 *                    pairs, and the tests' float32 emulation of whole
 *                    products). It reads denormal inputs (bf16 operands, the
 *                    float32 sum) as 0 and writes denormal results as 0. An
 *                    odd K is padded with a zero half.
 * Each output element is one such chain, summed by one thread, whatever the
 * tiles, the K blocks, the thread count, or whether its row went through
 * the skinny kernel or the GEMM: results never depend on the thread count,
 * and a row's never on the rows beside it. The float32 operands are rounded
 * exactly as float_to_bf16 does (vcvtne2ps2bf16 agrees except that it
 * reads denormals as 0; the few that round up to 2^-126 are fixed first).
 */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"
#include "isa.h"
#include "gemm.h"
#include "scratch.h"

/* inp's element i as the products read it: float32 rounded, or bf16. */
static LLMC_ALWAYS_INLINE float inp_value(const void* inp, int inp_bf16, size_t i) {
    return llmc_bf16_widen(inp_bf16 ? ((const uint16_t*)inp)[i]
                                    : llmc_bf16_round(((const float*)inp)[i]));
}

/* out[i] = x[i] as the products read it, float32, for i < n: a float32 x
   rounded to bf16 (as llmc_bf16_round), a bf16 x (is_bf16) widened; 16 at
   a time (the scalar loop compiled one element at a time). */
static LLMC_ALWAYS_INLINE void as_products_read_body(float* out, const void* x, int is_bf16,
                                                     int64_t n) {
    int64_t i = 0;
    if (is_bf16) {
        const uint16_t* h = x;
        for (; i + 16 <= n; i += 16) {
            llmc_vec16h v;
            memcpy(&v, h + i, sizeof v);
            const llmc_vec16u widened = __builtin_convertvector(v, llmc_vec16u) << 16;
            memcpy(out + i, &widened, sizeof widened);
        }
        for (; i < n; i++) { out[i] = llmc_bf16_widen(h[i]); }
        return;
    }
    const float* f = x;
    for (; i + 16 <= n; i += 16) {
        llmc_vec16u u;
        memcpy(&u, f + i, sizeof u);
        // the upper halves of llmc_bf16_round's results (magnitudes compare as signed)
        const llmc_vec16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        const llmc_vec16u quiet_nan = (u & 0xffff0000u) | 0x400000u;
        const llmc_vec16u is_nan = (llmc_vec16u)LLMC_CMP16((vec16i)(u & 0x7fffffffu), >,
                                                           (vec16i){0} + 0x7f800000);
        const llmc_vec16u result = (rounded & ~is_nan) | (quiet_nan & is_nan);
        memcpy(out + i, &result, sizeof result);
    }
    for (; i < n; i++) { out[i] = llmc_bf16_widen(llmc_bf16_round(f[i])); }
}
LLMC_ISA_VARIANTS(as_products_read, (float* out, const void* x, int is_bf16, int64_t n), out, x,
                  is_bf16, n)

/* The arena's slot (scratch.h) as `floats` floats, or NULL if out of memory
   (also when their bytes would not fit a size_t). */
static float* scratch_floats(int slot, size_t floats) {
    return floats <= LLMC_MAX_COUNT ? llmc_scratch_acquire(slot, floats * sizeof(float)) : NULL;
}

/* out[i] = inp's element i as float32 (a float32 inp rounded to bf16, a
   bf16 one widened), for i < n, shared by the threads. */
static void inp_into(float* out, const void* inp, int inp_bf16, int64_t n) {
    void (*const part)(float*, const void*, int, int64_t) =
        LLMC_ISA_SELECT(llmc_get_isa(), as_products_read);
    const size_t size = inp_bf16 ? sizeof(uint16_t) : sizeof(float);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(n, &i0, &i1);
        part(out + i0, (const char*)inp + (size_t)i0 * size, inp_bf16, i1 - i0);
    }
}

/* matmul_backward's pointers: dout always; weight for dinp, inp for dweight. */
static int backward_pointers_ok(const float* dinp, const float* dweight, const float* dout,
                                const void* inp, const uint16_t* weight) {
    return dout != NULL && (dinp == NULL || weight != NULL) && (dweight == NULL || inp != NULL);
}

/* The three arrays of a linear layer, [B,T,C], [B,T,OC] and [OC,C], can
   exist, and B*T fits an int. */
static int sizes_ok(int B, int T, int C, int OC) {
    return B > 0 && T > 0 && C > 0 && OC > 0 && llmc_count_fits(B, T, C, 1)
           && llmc_count_fits(B, T, OC, 1) && llmc_count_fits(OC, C, 1, 1)
           && (int64_t)B * T <= (int64_t)INT32_MAX;
}

#ifdef LLMC_X86_DISPATCH
#include "matmul_bf16_micro.h"

#define BF_KP 384           /* k pairs per packed block (K = 768 is one block)  */
/* the packed A block of a tile: a micro-kernel call reads its 8 rows at
   ~1.3 bytes a cycle, so the block may live in L3; a larger block packs
   B for fewer tiles (3 MB measured 2-8% faster than 384 KB on dweight) */
#define BF_A_BYTES (3 << 20)
/* dweight's tiles pack a K block's B panels all at once (bf_tile's whole_b)
   up to this size: GPT-2's 768 columns of up to 384 pairs, in L2 */
#define BF_B_BYTES (768 * BF_KP * 4)
/* the forward with B*T <= BF_SKINNY_MAX_ROWS takes the skinny kernel: on a
   GPT-2 124M decoding step (Zen 4, 2 threads) it beat the GEMM up to 11
   rows (by 15% at 9), tied at 12 and 13, and lost by 20-25% at 16, where
   the GEMM's 8 x 48 tiles reuse each broadcast three times */
#define BF_SKINNY_MAX_ROWS LLMC_FEW_ROWS_BF16

static int64_t bf_ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

/* Pairs per K block: as even as possible, at most BF_KP. */
static int bf_block_pairs(int K) {
    const int Kp = (K + 1) / 2;
    return (int)bf_ceil_div(Kp, bf_ceil_div(Kp, BF_KP));
}

/*
 * The tile shape (MC rows x NC columns) of an M x N x K product on nthreads
 * threads, from a small cost model in cycles: the busiest thread's
 * vdpbf16ps (one per 16 columns, row and pair) plus its packing, about one
 * cycle per packed pair. B is packed once per tile; A once per run of tiles
 * with the same rows when K is one block, else once per tile too.
 */
static void bf_choose_tiles(int M, int N, int K, int nthreads, int* MC, int* NC) {
    const int64_t Kp = (K + 1) / 2, kpb = bf_block_pairs(K);
    const int multi_block = Kp > kpb;
    const int64_t mc_max = BF_A_BYTES / (kpb * 4) / BF_MR * BF_MR;
    // the 32 coarsest cuts of each dimension (finer ones only add packing)
    enum { CUTS = 32 };
    const int64_t mb_min = bf_ceil_div(M, mc_max);
    const int64_t mb_end = bf_ceil_div(M, BF_MR) < mb_min + CUTS ? bf_ceil_div(M, BF_MR) + 1
                                                                 : mb_min + CUTS;
    const int64_t nb_end = bf_ceil_div(N, BF_NR) < CUTS ? bf_ceil_div(N, BF_NR) + 1 : CUTS + 1;
    int64_t ncs[CUTS + 1], n_tiles[CUTS + 1];
    for (int64_t nb = 1; nb < nb_end; nb++) {
        ncs[nb] = bf_ceil_div(bf_ceil_div(N, nb), BF_NR) * BF_NR;
        n_tiles[nb] = bf_ceil_div(N, ncs[nb]);
    }
    double best = -1.0;
    for (int64_t mb = mb_min; mb < mb_end; mb++) {
        const int64_t mc = bf_ceil_div(bf_ceil_div(M, mb), BF_MR) * BF_MR;
        const int64_t m_tiles = bf_ceil_div(M, mc);
        for (int64_t nb = 1; nb < nb_end; nb++) {
            const int64_t nc = ncs[nb];
            const int64_t mine = bf_ceil_div(m_tiles * n_tiles[nb], nthreads);
            const int64_t a_packs = multi_block ? mine : bf_ceil_div(mine, n_tiles[nb]) + 1;
            const double cost = (double)mine * (double)(mc * nc / 16 + nc) * (double)Kp
                                + (double)a_packs * (double)(mc * Kp);
            if (best < 0.0 || cost < best) { best = cost; *MC = (int)mc; *NC = (int)nc; }
        }
    }
}

/* g->act of the complete micro-tile of C at rows [i, i+mr), columns [j, j+nr). */
static void bf_tile_act(const struct bf16_gemm* g, int i, int mr, int j, int nr) {
    for (int r = 0; r < mr; r++) {
        const size_t at = (size_t)(i + r) * g->ldc + j;
        void* out = g->act_bf16 ? (void*)((uint16_t*)g->act_out + at)
                                : (void*)((float*)g->act_out + at);
        g->act(out, g->act_bf16, g->c + at, nr, 0, (nr + 15) / 16);
    }
}

/*
 * One tile of C, rows [m0, m0+mc) and columns [n0, n0+nc), over all of K.
 * a_ready: ap already holds these rows' packed A (K is then one block).
 * Per K block the micro-kernel walks the tile's 8 x 48 tiles either
 *   column panel by column panel, packing each B panel into bp on the way,
 *   or (whole_b) row panel by row panel along all nc columns, after packing
 *   every B panel of the block into bp: C then streams in whole rows, which
 *   pays where C is read and written from memory on every call (dweight).
 * Either way each element of C is one micro-kernel call per K block, in K
 * order.
 */
LLMC_TARGET_AVX512BF16 static void bf_tile(const struct bf16_gemm* g, uint32_t* ap, uint32_t* bp,
                                           int m0, int mc, int n0, int nc, int a_ready,
                                           int whole_b) {
    static const float zeros[BF_NR];
    const struct bf_lines none = {0};
    const int Kp = (g->K + 1) / 2, kpb = bf_block_pairs(g->K);
    // micro-kernel calls per column panel, column panels, calls per K block
    const int64_t row_panels = (mc + BF_MR - 1) / BF_MR, col_panels = (nc + BF_NR - 1) / BF_NR;
    const int64_t block_calls = row_panels * col_panels;
    for (int p0 = 0; p0 < Kp; p0 += kpb) {
        const int kp = Kp - p0 < kpb ? Kp - p0 : kpb;
        if (!a_ready) { bf_pack_a(ap, g, m0, mc, p0, kp); }
        if (whole_b) {
            for (int64_t q = 0; q < col_panels; q++) {
                const int j0 = n0 + (int)q * BF_NR;
                bf_pack_b(bp + (size_t)q * kp * BF_NR, g, j0, n0 + nc - j0 < BF_NR ? n0 + nc - j0
                                                                                    : BF_NR, p0, kp);
            }
        }
        // while this block is multiplied, the next block's A arrives (over
        // the block's calls), the next B panel's source (over a panel's
        // calls: this block's next panel, else the next block's first; with
        // whole_b, the next block's B over the block's calls) and each
        // call's next tile of C
        const int next_kp = Kp - (p0 + kp) < kpb ? Kp - (p0 + kp) : kpb;
        const struct bf_lines walk_a = next_kp > 0 ? bf_block_lines(g, m0, mc, p0 + kp, next_kp)
                                                   : none;
        struct bf_lines walk_b = whole_b && next_kp > 0
                                 ? bf_panel_lines(g, n0, nc, p0 + kp, next_kp) : none;
        for (int64_t call = 0; call < block_calls; call++) {
            const int64_t iq = whole_b ? call / col_panels : call % row_panels;
            const int64_t jq = whole_b ? call % col_panels : call / row_panels;
            const int i0 = (int)iq * BF_MR, j0 = n0 + (int)jq * BF_NR;
            const int mr = mc - i0 < BF_MR ? mc - i0 : BF_MR;
            const int nr = n0 + nc - j0 < BF_NR ? n0 + nc - j0 : BF_NR;
            const uint32_t* b = whole_b ? bp + (size_t)jq * kp * BF_NR : bp;
            struct bf_lines pf_b;
            if (whole_b) {
                pf_b = bf_lines_part(walk_b, walk_b.count * call / block_calls,
                                     walk_b.count * (call + 1) / block_calls
                                     - walk_b.count * call / block_calls);
            } else {
                if (iq == 0) {
                    bf_pack_b(bp, g, j0, nr, p0, kp);
                    const int next_j = j0 + BF_NR < n0 + nc;
                    const int next_j0 = next_j ? j0 + BF_NR : n0;
                    const int next_nr = n0 + nc - next_j0 < BF_NR ? n0 + nc - next_j0 : BF_NR;
                    walk_b = next_j ? bf_panel_lines(g, next_j0, next_nr, p0, kp)
                             : next_kp > 0 ? bf_panel_lines(g, next_j0, next_nr, p0 + kp, next_kp)
                             : none;
                }
                pf_b = bf_lines_part(walk_b, walk_b.count * iq / row_panels,
                                     walk_b.count * (iq + 1) / row_panels
                                     - walk_b.count * iq / row_panels);
            }
            const struct bf_lines pf_a = bf_lines_part(
                walk_a, walk_a.count * call / block_calls,
                walk_a.count * (call + 1) / block_calls - walk_a.count * call / block_calls);
            // the first block starts from the bias (or 0) unless C accumulates
            const float* init = NULL;
            if (p0 == 0 && (g->init != NULL || g->init_zero)) {
                init = g->init != NULL ? g->init + j0 : zeros;
            }
            float* c = g->c + (size_t)(m0 + i0) * g->ldc + j0;
            if (mr < BF_MR) {
                bf_micro_edge(kp, mr, nr, ap + (size_t)i0 * kp, b, c, g->ldc, init, pf_b, pf_a);
            } else {
                const float* next_c = NULL;
                if (call + 1 < block_calls) {
                    const int64_t next_i = whole_b ? (call + 1) / col_panels
                                                   : (call + 1) % row_panels;
                    const int64_t next_j = whole_b ? (call + 1) % col_panels
                                                   : (call + 1) / row_panels;
                    next_c = g->c + (size_t)(m0 + next_i * BF_MR) * g->ldc + n0 + next_j * BF_NR;
                }
                if (nr < BF_NR) {
                    bf_micro_narrow(kp, nr, ap + (size_t)i0 * kp, b, c, g->ldc, init, pf_b, pf_a,
                                    next_c);
                } else {
                    bf_micro(kp, ap + (size_t)i0 * kp, b, c, g->ldc, init, pf_b, pf_a, next_c);
                }
            }
            if (g->act != NULL && p0 + kp == Kp) { bf_tile_act(g, m0 + i0, mr, j0, nr); }
        }
    }
}

/* How bf_gemm_run cuts a product: tiles of MC x NC, and each thread's
   scratch (a packed A block, then one packed B panel, or with whole_b the
   tile's B panels of a K block). */
struct bf_plan {
    int MC, NC;
    int whole_b;                   /* bf_tile's order: all B panels of a block first */
    int64_t m_blocks, n_blocks;
    size_t ap_words, per_thread;   /* uint32s; per_thread in 64-byte multiples */
};

static struct bf_plan bf_plan_gemm(const struct bf16_gemm* g, int nthreads) {
    struct bf_plan plan = {.MC = BF_MR, .NC = BF_NR};
    bf_choose_tiles(g->M, g->N, g->K, nthreads, &plan.MC, &plan.NC);
    plan.m_blocks = bf_ceil_div(g->M, plan.MC);
    plan.n_blocks = bf_ceil_div(g->N, plan.NC);
    const size_t kpb = (size_t)bf_block_pairs(g->K);
    const size_t b_words = (size_t)bf_ceil_div(plan.NC, BF_NR) * BF_NR * kpb;
    plan.whole_b = (g->a_kind == BF16_A_COLS || g->walk_rows) && plan.MC > BF_MR
                   && b_words * sizeof(uint32_t) <= BF_B_BYTES;
    plan.ap_words = (size_t)plan.MC * kpb;
    plan.per_thread = (plan.ap_words + (plan.whole_b ? b_words : kpb * BF_NR) + 15) / 16 * 16;
    return plan;
}

/*
 * The GEMMs gs[0 .. count) with their plans: the tiles of all of them over
 * the threads in one loop (static schedule, never a split of K), each
 * thread packing the operands of its tiles into its share of scratch
 * (per_thread uint32s, at least every plan's). first_tile[g] is the index
 * of job g's first tile, first_tile[count] the number of tiles.
 */
static void bf_gemm_run_many(const struct bf16_gemm* gs, const struct bf_plan* plans,
                             const int64_t* first_tile, int count, size_t per_thread,
                             uint32_t* scratch) {
    const int64_t tiles = first_tile[count];
    #pragma omp parallel
    {
        uint32_t* ap = scratch + (size_t)omp_get_thread_num() * per_thread;
        int g = 0;
        int64_t packed_rows = -1;   // the row block ap holds (of job g), when K is one block
        #pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            // a thread's tiles ascend, so its job index only moves forward
            for (; tile >= first_tile[g + 1]; g++) { packed_rows = -1; }
            const struct bf16_gemm* job = &gs[g];
            const struct bf_plan* plan = &plans[g];
            uint32_t* bp = ap + plan->ap_words;
            const int one_block = (job->K + 1) / 2 <= bf_block_pairs(job->K);
            const int64_t t = tile - first_tile[g], mi = t / plan->n_blocks;
            const int m0 = (int)mi * plan->MC, n0 = (int)(t % plan->n_blocks) * plan->NC;
            const int mc = job->M - m0 < plan->MC ? job->M - m0 : plan->MC;
            const int nc = job->N - n0 < plan->NC ? job->N - n0 : plan->NC;
            bf_tile(job, ap, bp, m0, mc, n0, nc, one_block && packed_rows == mi, plan->whole_b);
            packed_rows = mi;
        }
    }
}

/* One GEMM: a batch of one. */
static void bf_gemm_run(const struct bf16_gemm* g, const struct bf_plan* plan, uint32_t* scratch) {
    const int64_t first_tile[2] = {0, plan->m_blocks * plan->n_blocks};
    bf_gemm_run_many(g, plan, first_tile, 1, plan->per_thread, scratch);
}

/* nthreads shares of `words` uint32s each, 64-byte aligned (the arena's
   panels), or NULL. */
static uint32_t* bf_scratch(int nthreads, size_t words) {
    return llmc_scratch_acquire(LLMC_SCRATCH_PANELS, (size_t)nthreads * words * sizeof(uint32_t));
}

int llmc_bf16_forward_few_rows_many(const struct llmc_bf16_few_rows_job* jobs, int count, int K,
                                    int N) {
    // each job's rows as bf16 pairs, one after another
    const int kp = (K + 1) / 2;
    size_t rows = 0;
    for (int j = 0; j < count; j++) { rows += (size_t)jobs[j].M; }
    uint32_t* xp = llmc_scratch_acquire(LLMC_SCRATCH_COPIES,
                                        (rows > 0 ? rows : 1) * kp * sizeof(uint32_t));
    LLMC_REQUIRE(xp != NULL, LLMC_ERR_NOMEM);
    size_t row0 = 0;
    for (int j = 0; j < count; j++) {
        bf_round_rows(xp + row0 * kp, jobs[j].inp, jobs[j].inp_bf16, K, jobs[j].M);
        row0 += (size_t)jobs[j].M;
    }
    const int64_t groups = bf_ceil_div(N, 16);
    #pragma omp parallel
    {
        // a thread's iterations ascend, so its job and first row only move forward
        int j = 0;
        size_t first_row = 0;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < count * groups; i++) {
            for (; j < i / groups; j++) { first_row += (size_t)jobs[j].M; }
            const struct llmc_bf16_few_rows_job* job = &jobs[j];
            const int o0 = (int)(i % groups) * 16;
            const int o1 = N - o0 < 16 ? N : o0 + 16;
            bf_skinny(job->out, (size_t)N, xp + first_row * kp, job->weight, job->bias, job->M, K,
                      o0, o1);
        }
    }
    llmc_scratch_done();
    return LLMC_OK;
}

/* matmul_forward_bf16 on the dot-product path; with act (not on the few-row
   path) its activation into act_out too, as struct bf16_gemm's act. */
static int bf_forward(float* out, const void* inp, int inp_bf16, const uint16_t* weight,
                      const float* bias, int64_t BT, int C, int OC, llmc_forward_blocks_fn act,
                      void* act_out, int act_bf16) {
    if (BT <= BF_SKINNY_MAX_ROWS) {
        // few rows (decoding): the weight streamed once, in place
        const struct llmc_bf16_few_rows_job job = {.out = out, .inp = inp, .inp_bf16 = inp_bf16,
                                                   .weight = weight, .bias = bias, .M = (int)BT};
        return llmc_bf16_forward_few_rows_many(&job, 1, C, OC);
    }
    const struct bf16_gemm g = {
        .c = out, .ldc = (size_t)OC,
        .a = inp, .lda = (size_t)C, .a_kind = inp_bf16 ? BF16_A_ROWS_BF16 : BF16_A_ROWS,
        .b = weight, .ldb = (size_t)C, .b_kind = BF16_B_COLS_W,
        .init = bias, .init_zero = bias == NULL,
        .M = (int)BT, .N = OC, .K = C,
        .act = act, .act_out = act_out, .act_bf16 = act_bf16};
    const int nthreads = omp_get_max_threads();
    const struct bf_plan plan = bf_plan_gemm(&g, nthreads);
    uint32_t* scratch = bf_scratch(nthreads, plan.per_thread);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);
    bf_gemm_run(&g, &plan, scratch);
    llmc_scratch_done();
    return LLMC_OK;
}

/* matmul_backward_bf16's dinp and dweight on the dot-product path; one
   scratch for both, so that running out of memory changes nothing. */
static int bf_backward(float* dinp, float* dweight, const float* dout, const void* inp,
                       int inp_bf16, const uint16_t* weight, int64_t BT, int C, int OC,
                       int written) {
    // a written output starts from 0 in its first K block instead of being read
    const struct bf16_gemm gi = {
        .c = dinp, .ldc = (size_t)C,
        .a = dout, .lda = (size_t)OC, .a_kind = BF16_A_ROWS,
        .b = weight, .ldb = (size_t)C, .b_kind = BF16_B_ROWS_W,
        .init_zero = (written & LLMC_WRITE_DINP) != 0,
        .M = (int)BT, .N = C, .K = OC};
    const struct bf16_gemm gw = {
        .c = dweight, .ldc = (size_t)C,
        .a = dout, .lda = (size_t)OC, .a_kind = BF16_A_COLS,
        .b = inp, .ldb = (size_t)C, .b_kind = inp_bf16 ? BF16_B_ROWS_W : BF16_B_ROWS_F32,
        .init_zero = (written & LLMC_WRITE_DWEIGHT) != 0,
        .M = OC, .N = C, .K = (int)BT};
    const int nthreads = omp_get_max_threads();
    const struct bf_plan pi = bf_plan_gemm(&gi, nthreads), pw = bf_plan_gemm(&gw, nthreads);
    size_t words = dinp != NULL ? pi.per_thread : 0;
    if (dweight != NULL && pw.per_thread > words) { words = pw.per_thread; }
    if (words == 0) { return LLMC_OK; }
    uint32_t* scratch = bf_scratch(nthreads, words);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);
    if (dinp != NULL) { bf_gemm_run(&gi, &pi, scratch); }
    if (dweight != NULL) { bf_gemm_run(&gw, &pw, scratch); }
    llmc_scratch_done();
    return LLMC_OK;
}
/*
 * A thread's share of llmc_gemm_bf16_many's jobs: rows [m0, m1) and columns
 * [n0, n1) of job `job` (all of K), with its tiles planned for one thread.
 */
struct bf_part {
    int job;
    int m0, m1, n0, n1;
    struct bf_plan plan;
};

/* A job's work in the balance: its vdpbf16ps (M N Kp / 16) and its packing
   (each operand about once), in cycles (bf_choose_tiles' model). */
static double bf_job_work(const struct bf16_gemm* g) {
    const double Kp = (double)((g->K + 1) / 2);
    return Kp * ((double)g->M * g->N / 16.0 + g->M + g->N);
}

/* Whether bf_job_cut splits job g along its rows (else its columns): the
   dimension with more panels (8 rows, 48 columns). */
static int bf_splits_rows(const struct bf16_gemm* g) {
    return bf_ceil_div(g->M, BF_MR) > bf_ceil_div(g->N, BF_NR);
}

/* Where a thread boundary `at` (in [0, 1] of the job's work) cuts job g, in
   rows or columns (bf_splits_rows): at a whole panel, computed alike by the
   threads on both sides of the boundary. */
static int bf_job_cut(const struct bf16_gemm* g, double at) {
    const int rows = bf_splits_rows(g);
    const int64_t panels = rows ? bf_ceil_div(g->M, BF_MR) : bf_ceil_div(g->N, BF_NR);
    const int64_t cut = (int64_t)(at * (double)panels + 0.5) * (rows ? BF_MR : BF_NR);
    const int64_t size = rows ? g->M : g->N;
    return (int)(cut < size ? cut : size);
}

/*
 * jobs[0 .. count) cut into parts[]: thread t's parts are parts[first[t] ..
 * first[t+1]), for t < nthreads. The jobs' work, end to end, is cut into
 * nthreads equal shares; a job that a share's boundary crosses is split
 * between the two threads along its rows or columns (bf_job_cut), and every
 * part is planned for one thread. The parts hold at most count + nthreads
 * entries. Returns the largest part's scratch (uint32s a thread).
 */
static size_t bf_balance(const struct bf16_gemm* jobs, int count, int nthreads,
                         struct bf_part* parts, int* first) {
    double total = 0.0;
    for (int g = 0; g < count; g++) { total += bf_job_work(&jobs[g]); }
    size_t words = 16;
    int n = 0;
    for (int t = 0; t < nthreads; t++) {
        first[t] = n;
        const double lo = total * t / nthreads, hi = total * (t + 1) / nthreads;
        double start = 0.0;
        for (int g = 0; g < count; g++) {
            const struct bf16_gemm* job = &jobs[g];
            const double work = bf_job_work(job), end = start + work;
            if (job->M > 0 && job->N > 0 && job->K > 0 && end > lo && start < hi) {
                // this thread's cut of the job: from boundary lo to boundary hi
                const int by_rows = bf_splits_rows(job);
                const int c0 = lo > start ? bf_job_cut(job, (lo - start) / work) : 0;
                const int c1 = hi < end ? bf_job_cut(job, (hi - start) / work)
                                        : by_rows ? job->M : job->N;
                if (c0 < c1) {
                    struct bf_part* p = &parts[n++];
                    *p = (struct bf_part){.job = g, .m0 = 0, .m1 = job->M, .n0 = 0, .n1 = job->N};
                    if (by_rows) { p->m0 = c0, p->m1 = c1; } else { p->n0 = c0, p->n1 = c1; }
                    struct bf16_gemm shape = *job;
                    shape.M = p->m1 - p->m0, shape.N = p->n1 - p->n0;
                    p->plan = bf_plan_gemm(&shape, 1);
                    words = p->plan.per_thread > words ? p->plan.per_thread : words;
                }
            }
            start = end;
        }
    }
    first[nthreads] = n;
    return words;
}

/* The parts of one thread (bf_balance), in order, each tile by tile with
   scratch ap (per_thread uint32s). */
static void bf_run_parts(const struct bf16_gemm* jobs, const struct bf_part* parts, int count,
                         uint32_t* ap) {
    for (int i = 0; i < count; i++) {
        const struct bf_part* p = &parts[i];
        const struct bf16_gemm* job = &jobs[p->job];
        const struct bf_plan* plan = &p->plan;
        const int one_block = (job->K + 1) / 2 <= bf_block_pairs(job->K);
        for (int64_t mi = 0; mi < plan->m_blocks; mi++) {
            const int m0 = p->m0 + (int)mi * plan->MC;
            const int mc = p->m1 - m0 < plan->MC ? p->m1 - m0 : plan->MC;
            for (int64_t ni = 0; ni < plan->n_blocks; ni++) {
                const int n0 = p->n0 + (int)ni * plan->NC;
                const int nc = p->n1 - n0 < plan->NC ? p->n1 - n0 : plan->NC;
                // with K one block, the tiles of a row block share its packed A
                bf_tile(job, ap, ap + plan->ap_words, m0, mc, n0, nc, one_block && ni > 0,
                        plan->whole_b);
            }
        }
    }
}

/* llmc_gemm_bf16_many on the dot-product path: the jobs' work cut into
   equal shares of the threads (bf_balance), so that experts of unequal
   rows, or jobs fewer than the threads, keep every thread busy. */
static int bf_gemm_many(const struct bf16_gemm* jobs, int count) {
    const int nthreads = omp_get_max_threads();
    struct bf_part* parts = malloc(((size_t)count + nthreads) * sizeof *parts);
    int* first = malloc(((size_t)nthreads + 1) * sizeof *first);
    const size_t words = parts != NULL && first != NULL
                         ? bf_balance(jobs, count, nthreads, parts, first) : 0;
    uint32_t* scratch = words > 0 ? bf_scratch(nthreads, words) : NULL;
    if (scratch != NULL) {
        #pragma omp parallel num_threads(nthreads)
        {
            // a smaller team than asked takes the missing threads' shares too
            for (int t = omp_get_thread_num(); t < nthreads; t += omp_get_num_threads()) {
                bf_run_parts(jobs, parts + first[t], first[t + 1] - first[t],
                             scratch + (size_t)omp_get_thread_num() * words);
            }
        }
        llmc_scratch_done();
    }
    free(parts);
    free(first);
    return scratch != NULL ? LLMC_OK : LLMC_ERR_NOMEM;
}
#endif

/* rows x cols floats dst[r*cols + c] from src[r*ld + c]: float32 rounded to
   bf16, or bf16 widened (exact). */
static void bf16_dense_copy(float* dst, const void* src, int is_bf16, size_t ld, int rows,
                            int cols) {
    void (*const row)(float*, const void*, int, int64_t) =
        LLMC_ISA_SELECT(llmc_get_isa(), as_products_read);
    const size_t size = is_bf16 ? sizeof(uint16_t) : sizeof(float);
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        row(dst + (size_t)r * cols, (const char*)src + (size_t)r * ld * size, is_bf16, cols);
    }
}

/* One operand of a job as widened_gemm_many copies it: rows x cols from
   src (row stride ld), bf16 or float32, into copies + offset; shared: an
   earlier operand's copy, made there. */
struct dense_operand {
    const void* src;
    int is_bf16;
    size_t ld;
    int rows, cols;
    size_t offset;
    int shared;
};

/* Job g's operand (A if which is 0, else B) as it is copied: A rows by K, or
   (A_COLS) K rows by M; B K rows by N, or (B_COLS_W) N rows by K. */
static struct dense_operand dense_operand_of(const struct bf16_gemm* j, int which) {
    if (which == 0) {
        const int a_rows = j->a_kind != BF16_A_COLS;
        return (struct dense_operand){.src = j->a, .is_bf16 = j->a_kind == BF16_A_ROWS_BF16,
                                      .ld = j->lda, .rows = a_rows ? j->M : j->K,
                                      .cols = a_rows ? j->K : j->M};
    }
    const int b_cols = j->b_kind == BF16_B_COLS_W;
    return (struct dense_operand){.src = j->b, .is_bf16 = j->b_kind != BF16_B_ROWS_F32,
                                  .ld = j->ldb, .rows = b_cols ? j->N : j->K,
                                  .cols = b_cols ? j->K : j->N};
}

/* llmc_gemm_bf16_many without vdpbf16ps: each job's operands as dense
   float32 copies (A rounded; B rounded or widened), its output started from
   init as asked, then the float32 GEMM on them all; the sums are the naive
   loops' (k = 0, 1, ..., K-1), as matmul_forward_bf16's widened path. An
   operand that an earlier job reads too (the same array, kind and shape:
   lora_up_backward_bf16's dout, read by both of an adapter's products, or
   the up block that each slice of its forward reads) is copied once. */
static int widened_gemm_many(const struct bf16_gemm* jobs, int count) {
    struct dense_operand* operands = malloc((size_t)2 * count * sizeof *operands);
    struct llmc_gemm_f32_job* f32 = malloc((size_t)count * sizeof *f32);
    if (operands == NULL || f32 == NULL) {
        free(operands);
        free(f32);
        return LLMC_ERR_NOMEM;
    }
    // each operand's place: an earlier equal one's, else the next free one
    size_t floats = 0;
    for (int i = 0; i < 2 * count; i++) {
        struct dense_operand* x = &operands[i];
        *x = dense_operand_of(&jobs[i / 2], i % 2);
        x->offset = floats;
        int same = -1;
        for (int e = 0; e < i && same < 0; e++) {
            const struct dense_operand* y = &operands[e];
            if (y->src == x->src && y->is_bf16 == x->is_bf16 && y->ld == x->ld
                && y->rows == x->rows && y->cols == x->cols) {
                same = e;
            }
        }
        x->shared = same >= 0;
        if (x->shared) { x->offset = operands[same].offset; }
        else { floats += (size_t)x->rows * x->cols; }
    }
    float* copies = scratch_floats(LLMC_SCRATCH_COPIES, floats > 0 ? floats : 1);
    if (copies == NULL) {
        free(operands);
        free(f32);
        return LLMC_ERR_NOMEM;
    }
    for (int i = 0; i < 2 * count; i++) {
        const struct dense_operand* x = &operands[i];
        if (!x->shared) {
            bf16_dense_copy(copies + x->offset, x->src, x->is_bf16, x->ld, x->rows, x->cols);
        }
    }
    for (int g = 0; g < count; g++) {
        const struct bf16_gemm* j = &jobs[g];
        const int M = j->M, N = j->N, K = j->K;
        if (j->init != NULL || j->init_zero) {
            for (int m = 0; m < M; m++) {
                float* c_m = j->c + (size_t)m * j->ldc;
                if (j->init != NULL) { memcpy(c_m, j->init, (size_t)N * sizeof(float)); }
                else { memset(c_m, 0, (size_t)N * sizeof(float)); }
            }
        }
        const int a_rows = j->a_kind != BF16_A_COLS, b_cols = j->b_kind == BF16_B_COLS_W;
        f32[g] = (struct llmc_gemm_f32_job){
            .c = j->c, .ldc = j->ldc, .a = copies + operands[2 * g].offset,
            .ars = a_rows ? (size_t)K : 1, .aks = a_rows ? 1 : (size_t)M,
            .b = copies + operands[2 * g + 1].offset, .brs = b_cols ? 1 : (size_t)N,
            .bcs = b_cols ? (size_t)K : 1, .M = M, .N = N, .K = K};
    }
    const int status = llmc_gemm_f32_many(f32, count);
    llmc_scratch_done();
    free(operands);
    free(f32);
    return status;
}

/* The widened layer widens its bf16 weight a block of rows at a time, each
   block's products run before the next is widened: about 4 MiB of float32
   (at least WIDEN_ROWS rows, a multiple of it), not the whole weight (2.3
   GiB for Qwen3-8B's head). A multiple of matmul.c's depth block (KC), so
   that dinp, whose K the blocks cut, takes no extra pass over its output. */
#define WIDEN_ROWS 384
#define WIDEN_FLOATS (1 << 20)

/* Rows of a widened block of a weight [OC, C]: at most OC. */
static int64_t widen_rows(int C, int OC) {
    int64_t rows = ((int64_t)WIDEN_FLOATS / C + WIDEN_ROWS - 1) / WIDEN_ROWS * WIDEN_ROWS;
    rows = rows > WIDEN_ROWS ? rows : WIDEN_ROWS;
    return rows < OC ? rows : OC;
}

/* matmul_forward_bf16 without vdpbf16ps: inp rounded (or widened) once,
   then per block of weight rows [o0, o1): the block widened and
   out[:, o0:o1] = bias + inp . block^T, by matmul.c's kernels (the few-row
   one through a small [BT, o1 - o0] part, copied into out). Each element
   sums k = 0 .. C-1 in order from its bias: the naive loops' bits. */
static int widened_forward(float* out, const void* inp, int inp_bf16, const uint16_t* weight,
                           const float* bias, int64_t BT, int C, int OC) {
    const int64_t rows = widen_rows(C, OC);
    const int few = BT <= LLMC_FEW_ROWS_F32;
    float* inp_rounded = scratch_floats(LLMC_SCRATCH_COPIES, (size_t)BT * C
                                        + (size_t)rows * C + (few ? (size_t)BT * rows : 0));
    LLMC_REQUIRE(inp_rounded != NULL, LLMC_ERR_NOMEM);
    float* block = inp_rounded + (size_t)BT * C;
    float* part = block + (size_t)rows * C;   // few rows' output of one block
    inp_into(inp_rounded, inp, inp_bf16, BT * C);
    int status = LLMC_OK;
    for (int64_t o0 = 0; o0 < OC && status == LLMC_OK; o0 += rows) {
        const int n = (int)(OC - o0 < rows ? OC - o0 : rows);
        inp_into(block, weight + (size_t)o0 * C, 1, (int64_t)n * C);
        const float* init = bias != NULL ? bias + o0 : NULL;
        if (few) {
            const struct llmc_few_rows_job job = {.out = part, .inp = inp_rounded,
                                                  .weight = block, .bias = init, .M = (int)BT};
            llmc_forward_few_rows_many(&job, 1, C, n);
            for (int64_t m = 0; m < BT; m++) {
                memcpy(out + (size_t)m * OC + o0, part + (size_t)m * n, (size_t)n * sizeof(float));
            }
            continue;
        }
        #pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < BT; m++) {
            float* out_m = out + (size_t)m * OC + o0;
            if (init != NULL) { memcpy(out_m, init, (size_t)n * sizeof(float)); }
            else { memset(out_m, 0, (size_t)n * sizeof(float)); }
        }
        status = llmc_gemm_f32(out + o0, (size_t)OC, inp_rounded, (size_t)C, 1, block, 1,
                               (size_t)C, (int)BT, n, C);
    }
    llmc_scratch_done();
    return status;
}

/* matmul_backward_bf16's products without vdpbf16ps: dout rounded (and inp,
   for dweight) once, dweight += dout^T . inp on them, and dinp += dout .
   weight a block of weight rows at a time, each widened, in the order of
   the blocks: K = OC summed o = 0 .. OC-1 as one product sums it. */
static int widened_backward(float* dinp, float* dweight, const float* dout, const void* inp,
                            int inp_bf16, const uint16_t* weight, int64_t BT, int C, int OC,
                            int written) {
    const size_t n_dout = (size_t)BT * OC, n_inp = dweight != NULL ? (size_t)BT * C : 0;
    const int64_t rows = widen_rows(C, OC);
    const size_t n_block = dinp != NULL ? (size_t)rows * C : 0;
    float* dout_rounded = scratch_floats(LLMC_SCRATCH_COPIES, n_dout + n_inp + n_block);
    LLMC_REQUIRE(dout_rounded != NULL, LLMC_ERR_NOMEM);
    float* inp_rounded = dout_rounded + n_dout;
    float* block = inp_rounded + n_inp;
    inp_into(dout_rounded, dout, 0, (int64_t)n_dout);
    llmc_zero_written(dinp, dweight, written, BT, C, OC);
    int status = LLMC_OK;
    if (dweight != NULL) {
        inp_into(inp_rounded, inp, inp_bf16, (int64_t)n_inp);
        status = llmc_gemm_f32(dweight, (size_t)C, dout_rounded, 1, (size_t)OC, inp_rounded,
                               (size_t)C, 1, OC, C, (int)BT);
    }
    for (int64_t o0 = 0; dinp != NULL && o0 < OC && status == LLMC_OK; o0 += rows) {
        const int n = (int)(OC - o0 < rows ? OC - o0 : rows);
        inp_into(block, weight + (size_t)o0 * C, 1, (int64_t)n * C);
        status = llmc_gemm_f32(dinp, (size_t)C, dout_rounded + o0, (size_t)OC, 1, block,
                               (size_t)C, 1, (int)BT, C, n);
    }
    llmc_scratch_done();
    return status;
}

#ifdef LLMC_X86_DISPATCH
int llmc_bf16_few_rows_supported(void) { return llmc_get_isa() == LLMC_ISA_AVX512BF16; }
#else
int llmc_bf16_few_rows_supported(void) { return 0; }

int llmc_bf16_forward_few_rows_many(const struct llmc_bf16_few_rows_job* jobs, int count, int K,
                                    int N) {
    (void)jobs, (void)count, (void)K, (void)N;
    return LLMC_ERR_UNSUPPORTED;
}
#endif

int llmc_gemm_bf16_many(const struct bf16_gemm* jobs, int count) {
    if (count <= 0) { return LLMC_OK; }
#ifdef LLMC_X86_DISPATCH
    if (llmc_get_isa() == LLMC_ISA_AVX512BF16) { return bf_gemm_many(jobs, count); }
#endif
    return widened_gemm_many(jobs, count);
}


int matmul_forward_bf16(float* out, const void* inp, const uint16_t* weight,
                        const float* bias, int B, int T, int C, int OC, int inp_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp) && weight != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    const int inp_bf16 = inp_dtype == LLMC_DTYPE_BF16;
    const int64_t BT = (int64_t)B * T;
#ifdef LLMC_X86_DISPATCH
    // the instruction set is read once, before any parallel region (isa.h)
    if (llmc_get_isa() == LLMC_ISA_AVX512BF16) {
        return bf_forward(out, inp, inp_bf16, weight, bias, BT, C, OC, NULL, NULL, 0);
    }
#endif
    return widened_forward(out, inp, inp_bf16, weight, bias, BT, C, OC);
}

int matmul_gelu_forward_bf16(float* out, void* act_out, const void* inp, const uint16_t* weight,
                             const float* bias, int B, int T, int C, int OC, int inp_dtype,
                             int act_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, act_out, inp) && weight != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    LLMC_REQUIRE(act_dtype == LLMC_DTYPE_F32 || act_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    const int64_t BT = (int64_t)B * T;
#ifdef LLMC_X86_DISPATCH
    if (llmc_get_isa() == LLMC_ISA_AVX512BF16 && BT > BF_SKINNY_MAX_ROWS) {
        return bf_forward(out, inp, inp_dtype == LLMC_DTYPE_BF16, weight, bias, BT, C, OC,
                          llmc_gelu_forward_blocks(LLMC_ISA_AVX512BF16), act_out,
                          act_dtype == LLMC_DTYPE_BF16);
    }
#endif
    // the unfused twin: the product, then the activation reading it back
    const int status = matmul_forward_bf16(out, inp, weight, bias, B, T, C, OC, inp_dtype);
    return status != LLMC_OK ? status : gelu_forward(act_out, out, BT * OC, act_dtype);
}

int matmul_backward_bf16(float* dinp, float* dweight, float* dbias,
                         const float* dout, const void* inp, const uint16_t* weight,
                         int B, int T, int C, int OC, int inp_dtype, int written) {
    LLMC_REQUIRE(backward_pointers_ok(dinp, dweight, dout, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    LLMC_REQUIRE(llmc_written_ok(written), LLMC_ERR_VALUE);
    const int inp_bf16 = inp_dtype == LLMC_DTYPE_BF16;
    const int64_t BT = (int64_t)B * T;
#ifdef LLMC_X86_DISPATCH
    if (llmc_get_isa() == LLMC_ISA_AVX512BF16) {
        const int status = bf_backward(dinp, dweight, dout, inp, inp_bf16, weight, BT, C, OC,
                                       written);
        if (status != LLMC_OK || dbias == NULL) { return status; }
        return llmc_column_sums(NULL, dbias, dout, NULL, NULL, NULL, BT, OC);
    }
#endif
    int status = LLMC_OK;
    if (dinp != NULL || dweight != NULL) {
        status = widened_backward(dinp, dweight, dout, inp, inp_bf16, weight, BT, C, OC, written);
    }
    // dbias sums dout itself, unrounded, as the float32 layer does
    if (status == LLMC_OK && dbias != NULL) {
        status = llmc_column_sums(NULL, dbias, dout, NULL, NULL, NULL, BT, OC);
    }
    return status;
}

int matmul_forward_bf16_naive(float* out, const void* inp, const uint16_t* weight,
                              const float* bias, int B, int T, int C, int OC, int inp_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp) && weight != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    const int inp_bf16 = inp_dtype == LLMC_DTYPE_BF16;
    const int64_t BT = (int64_t)B * T;
    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        for (int o = 0; o < OC; o++) {
            const uint16_t* w = weight + (size_t)o * C;
            float val = bias != NULL ? bias[o] : 0.0f;
            for (int i = 0; i < C; i++) {
                val += inp_value(inp, inp_bf16, (size_t)bt * C + i) * llmc_bf16_widen(w[i]);
            }
            out[(size_t)bt * OC + o] = val;
        }
    }
    return LLMC_OK;
}

int matmul_backward_bf16_naive(float* dinp, float* dweight, float* dbias,
                               const float* dout, const void* inp, const uint16_t* weight,
                               int B, int T, int C, int OC, int inp_dtype, int written) {
    LLMC_REQUIRE(backward_pointers_ok(dinp, dweight, dout, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(sizes_ok(B, T, C, OC), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    const int inp_bf16 = inp_dtype == LLMC_DTYPE_BF16;
    LLMC_REQUIRE(llmc_written_ok(written), LLMC_ERR_VALUE);
    const int64_t BT = (int64_t)B * T;
    llmc_zero_written(dinp, dweight, written, BT, C, OC);
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
                for (int i = 0; i < C; i++) {
                    dw[i] += d_rounded * inp_value(inp, inp_bf16, (size_t)bt * C + i);
                }
            }
            db += d;
        }
        if (dbias != NULL) { dbias[o] += db; }
    }
    return LLMC_OK;
}
