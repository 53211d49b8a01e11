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
 * The backward on avx512bf16 reads dout once (up_backward_unit): a unit
 * of work is a chunk of one adapter's columns (unit_cols: a quarter of
 * them, 256 to CHUNK_COLS), walked down every row in blocks of BLOCK_ROWS,
 * each block rounded to bf16 once, into cache, and read there by both
 * products: d(up) over the chunk's columns (its sums run down the rows,
 * carried in dup_t from block to block: the GEMM's order, bitwise its
 * result) and the chunk's part of dh (a sum over the chunk's columns). The
 * parts of dh are added in chunk order after all units, so dh is bitwise
 * the GEMM's where an adapter is one chunk, and within its bound of the
 * float64 sum otherwise. As two GEMM jobs per adapter it read dout twice
 * and took 1.3-1.6x the CPU time (1 thread, Qwen3-0.6B's widths: MLP 6144,
 * qkv 4096, 1024). While a block is multiplied, the next block's rows of
 * dout are asked of the cache, and the scratch (each thread's, dh's parts)
 * is the kernels' arena (scratch.h): allocated per call, ~1 MiB came back
 * as fresh pages each time at qkv's widths (the trainer's malloc returns
 * freed memory), and the unit's products waited on dout's rows; together
 * ~1.25x less CPU time (1 thread, the four layers' calls).
 *
 * Determinism: the bf16 GEMM never splits a sum over threads, so every
 * element is summed in one order whatever the thread count or the slices;
 * the backward's units are fixed by the shapes alone, their parts of dh
 * added in one order.
 */
#include <stdlib.h>
#include <string.h>
#include "llmc.h"
#include "common.h"
#include "gemm.h"
#include "isa.h"
#include "scratch.h"

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

#ifdef LLMC_X86_DISPATCH
#include "bf16_round.h"

/* The first n lanes of 16 (n clamped to 0 .. 16). */
static inline __mmask16 first16(int n) {
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}

#define CHUNK_COLS 1024  /* the most columns of a backward unit: rows of 4 KiB
                            of dout read at a time (256: ~1.4x slower) */
#define BLOCK_ROWS 64    /* rows rounded at a time (a multiple of 16: whole
                            pairs, whole groups of dh's rows)                  */

/* One call's backward (lora_up_backward_bf16's arguments) and its units:
   unit u is adapter unit_j[u]'s columns [unit_c0[u], unit_c1[u]); parts[u] its part of dh, [part_rows][lanes]: BT rows rounded up
   to 16, lanes = r rounded up to 16. */
struct up_backward {
    float* dh;
    float* dup_t;
    const float* dout;
    const float* h;
    const uint16_t* up_t;
    const int* rows;
    int BT, W, n, r, lanes, units, part_rows;
    int* unit_j;
    int* unit_c0;
    int* unit_c1;
    float* parts;
};

/* Each thread's scratch for a unit (floats' worth, 64-byte multiples):
   the block rounded, [BLOCK_ROWS][CHUNK_COLS] bf16; up's pairs of the
   chunk, [CHUNK_COLS / 2][lanes]; h's pairs of the block's rows,
   [BLOCK_ROWS / 2][lanes]. */
static size_t unit_scratch_words(int lanes) {
    const size_t words = (size_t)BLOCK_ROWS * CHUNK_COLS / 2 + (size_t)CHUNK_COLS / 2 * lanes
                         + (size_t)BLOCK_ROWS / 2 * lanes;
    return (words + 15) / 16 * 16;
}

/*
 * Unit u: dup_t[j, :, its columns] and parts[u]. Shapes: the chunk's
 * width <= CHUNK_COLS columns, r ranks in groups of 16 lanes (a rank past r
 * is a zero lane), the block's rows <= BLOCK_ROWS.
 *   up's pairs    upp[p][lane] = (up_t[j, lane, c0 + 2p], ... + 1)
 *   h's pairs     hp[p][lane]  = (h[t0 + 2p, j, lane], h[t0 + 2p + 1, j, lane])
 *   dh's part     parts[u][t][lane] = sum over the chunk's pairs p of
 *                 block[t][p] . upp[p][lane]   (16 rows at a time)
 *   d(up)         dup_t[j, lane, c] (+)= sum over the block's pairs p of
 *                 hp[p][lane] . (block[2p][c], block[2p + 1][c])
 *                 (16 columns at a time, every lane a vector of its own)
 * A pair past the rows or columns is zero, as the GEMM pads an odd K.
 */
LLMC_TARGET_AVX512BF16 static void up_backward_unit(const struct up_backward* w, int u,
                                                    uint32_t* scratch) {
    const int j = w->unit_j[u], c0 = w->unit_c0[u], stop = w->unit_c1[u];
    const int r = w->r, lanes = w->lanes, W = w->W, width = stop - c0, pairs = (width + 1) / 2;
    const size_t nr = (size_t)w->n * r;
    uint16_t* block = (uint16_t*)scratch;
    uint32_t* upp = scratch + (size_t)BLOCK_ROWS * CHUNK_COLS / 2;
    uint32_t* hp = upp + (size_t)CHUNK_COLS / 2 * lanes;
    const uint32_t* block_pairs = (const uint32_t*)block;
    const uint16_t* up_j = w->up_t + (size_t)j * r * W;
    for (int p = 0; p < pairs; p++) {
        for (int lane = 0; lane < lanes; lane++) {
            uint32_t pair = 0;
            for (int half = 0; half < 2 && lane < r; half++) {
                const int c = c0 + 2 * p + half;
                if (c < stop) { pair |= (uint32_t)up_j[(size_t)lane * W + c] << (16 * half); }
            }
            upp[(size_t)p * lanes + lane] = pair;
        }
    }
    // x[i] and y[i] of 16 bf16s each (the low halves) as the pairs (x[i], y[i])
    const __m512i zip = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,
                                         41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                                         35, 3, 34, 2, 33, 1, 32, 0);
    float* part = w->parts + (size_t)u * w->part_rows * lanes;
    for (int t0 = 0; t0 < w->BT; t0 += BLOCK_ROWS) {
        const int rows = w->BT - t0 < BLOCK_ROWS ? w->BT - t0 : BLOCK_ROWS;
        const int row_pairs = (rows + 1) / 2;
        // the block rounded, zero past the rows up to the 16 that dh's groups read
        for (int i = 0; i < (rows + 15) / 16 * 16; i++) {
            const float* src = w->dout + (size_t)(t0 + i) * W + c0;
            for (int c = 0; c < width; c += 32) {
                const int count = i < rows ? width - c : 0;
                const __m512i rounded = bf_round_pairs(
                    _mm512_maskz_loadu_ps(first16(count), src + c),
                    _mm512_maskz_loadu_ps(first16(count - 16), src + c + 16));
                _mm512_storeu_si512(block + (size_t)i * CHUNK_COLS + c, rounded);
            }
        }
        for (int p = 0; p < row_pairs; p++) {
            const float* x = w->h + (size_t)(t0 + 2 * p) * nr + (size_t)j * r;
            const int y_rows = 2 * p + 1 < rows;
            for (int g = 0; g < lanes; g += 16) {
                const __mmask16 m = first16(r - g);
                _mm512_storeu_si512(hp + (size_t)p * lanes + g,
                                    bf_round_zip(_mm512_maskz_loadu_ps(m, x + g),
                                                 _mm512_maskz_loadu_ps(y_rows ? m : 0,
                                                                       x + nr + g)));
            }
        }
        for (int i = 0; i < rows; i += 16) {   // dh's part (rows past the block unused)
            for (int g = 0; g < lanes; g += 16) {
                __m512 acc[16];
                for (int a = 0; a < 16; a++) { acc[a] = _mm512_setzero_ps(); }
                const uint32_t* col = block_pairs + (size_t)i * (CHUNK_COLS / 2);
                for (int p = 0; p < pairs; p++, col++) {
                    __m512bh up;
                    memcpy(&up, upp + (size_t)p * lanes + g, sizeof up);
                    for (int a = 0; a < 16; a++) {   // a row's pair, broadcast from memory
                        acc[a] = _mm512_dpbf16_ps(
                            acc[a], up,
                            (__m512bh)_mm512_set1_epi32((int)col[a * (CHUNK_COLS / 2)]));
                    }
                }
                for (int a = 0; a < 16; a++) {   // rows past BT into parts' padding
                    _mm512_storeu_ps(part + (size_t)(t0 + i + a) * lanes + g, acc[a]);
                }
            }
        }
        const int ahead = w->BT - t0 - BLOCK_ROWS < BLOCK_ROWS ? w->BT - t0 - BLOCK_ROWS
                                                               : BLOCK_ROWS;
        for (int q = 0; q < width; q += 16) {   // d(up), carried on from the last block
            const __mmask16 cols = first16(width - q);
            // the next block's line of dout at these columns, row by row: its
            // rows lie W floats apart, which no hardware prefetcher follows
            const float* next = w->dout + (size_t)(t0 + BLOCK_ROWS) * W + c0 + q;
            for (int i = 0; i < ahead; i++) { __builtin_prefetch(next + (size_t)i * W, 0, 2); }
            for (int g = 0; g < lanes; g += 16) {
                const int ranks = r - g < 16 ? r - g : 16;
                float* out = w->dup_t + (size_t)(j * r + g) * W + c0 + q;
                __m512 acc[16];
                for (int k = 0; k < 16; k++) {
                    acc[k] = t0 > 0 && k < ranks ? _mm512_maskz_loadu_ps(cols, out + (size_t)k * W)
                                                 : _mm512_setzero_ps();
                }
                for (int p = 0; p < row_pairs; p++) {
                    const uint16_t* x = block + (size_t)2 * p * CHUNK_COLS + q;
                    const __m512i b = _mm512_permutex2var_epi16(
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)x)), zip,
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(x + CHUNK_COLS))));
                    const uint32_t* h_p = hp + (size_t)p * lanes + g;
                    for (int k = 0; k < 16; k++) {
                        acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)b,
                                                  (__m512bh)_mm512_set1_epi32((int)h_p[k]));
                    }
                }
                for (int k = 0; k < ranks; k++) {
                    _mm512_mask_storeu_ps(out + (size_t)k * W, cols, acc[k]);
                }
            }
        }
    }
}

/* dh[t, j, :] = the parts of adapter j's units, added in column order. */
static void up_backward_sum_parts(const struct up_backward* w) {
    const size_t nr = (size_t)w->n * w->r, part_floats = (size_t)w->part_rows * w->lanes;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < w->BT; t++) {
        for (int u = 0; u < w->units; u++) {
            const int j = w->unit_j[u], first = u == 0 || w->unit_j[u - 1] != j;
            const float* part = w->parts + u * part_floats + (size_t)t * w->lanes;
            float* dh = w->dh + (size_t)t * nr + (size_t)j * w->r;
            for (int k = 0; k < w->r; k++) { dh[k] = first ? part[k] : dh[k] + part[k]; }
        }
    }
}

/* The columns of adapter j's units: a quarter of its own (so that a
   1024-column adapter still feeds 4 threads), in whole 32s, 256 to
   CHUNK_COLS. The shapes alone fix the units, so the thread count does not
   change how dh's parts are added. */
static int unit_cols(const int* rows, int j) {
    const int quarter = (rows[2 * j + 1] - rows[2 * j] + 127) / 128 * 32;
    return quarter < 256 ? 256 : quarter > CHUNK_COLS ? CHUNK_COLS : quarter;
}

/* lora_up_backward_bf16 on avx512bf16, its arguments checked. */
static int up_backward_avx512bf16(float* dh, float* dup_t, const float* dout, const float* h,
                                  const uint16_t* up_t, const int* rows, int BT, int W, int n,
                                  int r) {
    struct up_backward w = {.dh = dh, .dup_t = dup_t, .dout = dout, .h = h, .up_t = up_t,
                            .rows = rows, .BT = BT, .W = W, .n = n, .r = r,
                            .lanes = (r + 15) / 16 * 16, .part_rows = (BT + 15) / 16 * 16};
    for (int j = 0; j < n; j++) {
        w.units += (rows[2 * j + 1] - rows[2 * j] + unit_cols(rows, j) - 1) / unit_cols(rows, j);
    }
    // the arena's panels (kept between calls: this call's fresh pages cost
    // about as much as its products): each thread's scratch, the parts of
    // dh, the units
    const int nthreads = omp_get_max_threads();
    const size_t words = unit_scratch_words(w.lanes);
    const size_t part_floats = (size_t)w.units * w.part_rows * w.lanes;
    uint32_t* scratch = llmc_scratch_acquire(
        LLMC_SCRATCH_PANELS, ((size_t)nthreads * words + part_floats + 3 * (size_t)w.units) * 4);
    LLMC_REQUIRE(scratch != NULL, LLMC_ERR_NOMEM);
    w.parts = (float*)(scratch + (size_t)nthreads * words);
    w.unit_j = (int*)(w.parts + part_floats);
    w.unit_c0 = w.unit_j + w.units;
    w.unit_c1 = w.unit_c0 + w.units;
    for (int j = 0, u = 0; j < n; j++) {
        const int stop = rows[2 * j + 1], cols = unit_cols(rows, j);
        for (int c0 = rows[2 * j]; c0 < stop; c0 += cols, u++) {
            w.unit_j[u] = j;
            w.unit_c0[u] = c0;
            w.unit_c1[u] = stop - c0 < cols ? stop : c0 + cols;
        }
    }
    #pragma omp parallel num_threads(nthreads)
    {
        uint32_t* mine = scratch + (size_t)omp_get_thread_num() * words;
        // units taken as they come: q's are twice k's and v's width, and
        // a unit's results do not depend on the thread that runs it
        #pragma omp for schedule(dynamic)
        for (int u = 0; u < w.units; u++) { up_backward_unit(&w, u, mine); }
    }
    up_backward_sum_parts(&w);
    llmc_scratch_done();
    return LLMC_OK;
}
#endif

int lora_up_backward_bf16(float* dh, float* dup_t, const float* dout, const float* h,
                          const uint16_t* up_t, const int* rows, int B, int T, int W, int n,
                          int r) {
    LLMC_REQUIRE(LLMC_NONNULL4(dh, dup_t, dout, h) && LLMC_NONNULL2(up_t, rows), LLMC_ERR_NULL);
    const int status = up_status(rows, B, T, W, n, r);
    LLMC_REQUIRE(status == LLMC_OK, status);
#ifdef LLMC_X86_DISPATCH
    if (llmc_get_isa() == LLMC_ISA_AVX512BF16) {
        return up_backward_avx512bf16(dh, dup_t, dout, h, up_t, rows, B * T, W, n, r);
    }
#endif
    // elsewhere two products per adapter, one batch of the bf16 GEMM
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
