/*
 * The AVX512_BF16 kernels of the bf16 matmul, private to matmul_bf16.c
 * (which says what they compute and why; this file is the how). Every
 * function is built with LLMC_TARGET_AVX512BF16 and runs only when
 * llmc_get_isa() chose that instruction set.
 *
 * Packed operands. vdpbf16ps multiplies the two bf16 halves of each 32-bit
 * lane, so both operands travel as k pairs: one uint32 holds (k = 2p, low
 * half; k = 2p + 1, high half), and an odd K is padded with a zero half.
 *   A panel  [kp][BF_MR]  the pairs of BF_MR rows, pair by pair (a row of
 *                         the panel is broadcast, one pair per row)
 *   B panel  [kp][BF_NR]  the pairs of BF_NR columns, pair by pair (a row
 *                         of the panel is three full vectors)
 * Rows past M and columns past N are zero. Every float32 source is rounded
 * to bf16 as llmc_bf16_round does (bf_round_pairs below); bf16 sources (the
 * weight, a bf16 inp) are copied.
 */
#ifndef LLMC_MATMUL_BF16_MICRO_H
#define LLMC_MATMUL_BF16_MICRO_H

#include <immintrin.h>
#include "common.h"
#include "isa.h"
#include "gemm.h"
#include "bf16_round.h"

#define BF_MR 8                  /* rows of C per micro-kernel call            */
#define BF_NV 3                  /* vectors of 16 columns per row of the tile  */
#define BF_NR (16 * BF_NV)       /* columns of C per micro-kernel call: 48     */

/* Lanes of a 16-lane mask: the first n (n clamped to 0 .. 16). */
static inline __mmask16 bf_first16(int n) {
    return n <= 0 ? 0 : n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
}
static inline __mmask32 bf_first32(int n) {
    return n <= 0 ? 0 : n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1);
}

/* 8 rows of 16 pairs each (r[i] = row i, pairs 0..15) to 8 vectors of 2
   pairs x 8 rows each (out[j] = pair 2j for rows 0..7, then pair 2j+1). */
LLMC_TARGET_AVX512BF16 static LLMC_ALWAYS_INLINE void bf_transpose8x16(const __m512i r[8],
                                                                       __m512i out[8]) {
    // within each 128-bit lane l: t[2h] holds rows 2h, 2h+1 at pairs 4l, 4l+1 ...
    __m512i t[8], u[8];
    for (int h = 0; h < 4; h++) {
        t[2 * h] = _mm512_unpacklo_epi32(r[2 * h], r[2 * h + 1]);
        t[2 * h + 1] = _mm512_unpackhi_epi32(r[2 * h], r[2 * h + 1]);
    }
    // ... then u[4g + c] holds rows 4g .. 4g+3 at pair 4l + c (lane l)
    for (int g = 0; g < 2; g++) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    // out[j]: lanes (rows 0-3, rows 4-7) of pair 2j, then of pair 2j+1; pair
    // 2j sits in lane j/2 of u[c] and u[4 + c] with c = 2 (j % 2)
    for (int c = 0; c < 4; c += 2) {
        const __m512i a01 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);       // lanes 0,1 | 0,1
        const __m512i a23 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);       // lanes 2,3 | 2,3
        const __m512i b01 = _mm512_shuffle_i32x4(u[c + 1], u[5 + c], 0x44);
        const __m512i b23 = _mm512_shuffle_i32x4(u[c + 1], u[5 + c], 0xee);
        const int j = c / 2;
        out[j] = _mm512_shuffle_i32x4(a01, b01, 0x88);       // lane 0 of each
        out[j + 2] = _mm512_shuffle_i32x4(a01, b01, 0xdd);   // lane 1
        out[j + 4] = _mm512_shuffle_i32x4(a23, b23, 0x88);   // lane 2
        out[j + 6] = _mm512_shuffle_i32x4(a23, b23, 0xdd);   // lane 3
    }
}

/* A 16 x 16 block of 32-bit lanes transposed in registers (common.h's
   whole-vector shuffles). */
LLMC_TARGET_AVX512BF16 static LLMC_ALWAYS_INLINE void bf_transpose16(__m512i v[16]) {
    vec16f r[16];
    memcpy(r, v, sizeof r);
    llmc_transpose16_wide(r);
    memcpy(v, r, sizeof r);
}

/* The pair (A(m, 2p), A(m, 2p+1)) of one element, rounded; the slow path of
   partial blocks (a zero half past K, a zero pair past M). */
static inline uint32_t bf_pair_a(const struct bf16_gemm* g, int m, int p) {
    const float* a = g->a;
    uint32_t pair = 0;
    for (int h = 0; h < 2; h++) {
        const int k = 2 * p + h;
        if (m >= g->M || k >= g->K) { continue; }
        const uint16_t v = g->a_kind == BF16_A_ROWS_BF16
                           ? ((const uint16_t*)g->a)[(size_t)m * g->lda + k]
                           : llmc_bf16_round(g->a_kind == BF16_A_ROWS ? a[(size_t)m * g->lda + k]
                                                                      : a[(size_t)k * g->lda + m]);
        pair |= (uint32_t)v << (16 * h);
    }
    return pair;
}

/*
 * Packs rows m0 .. m0+mc of A, pairs p0 .. p0+kp, as ceil(mc / BF_MR)
 * panels of kp x BF_MR pairs.
 *   rows of A in memory (A_ROWS, A_ROWS_BF16): per row, 16 pairs are 32
 *     neighbouring floats (rounded) or bf16s (already the pairs); 8 rows are
 *     then transposed in registers.
 *   columns (A_COLS): the 8 rows of a panel are 8 neighbouring floats of
 *     source rows 2p and 2p+1; two pairs (four source rows) at a time are
 *     rounded and zipped, walking the source rows in order.
 * Partial blocks (rows past M, the last pair of an odd K) take bf_pair_a.
 */
LLMC_TARGET_AVX512BF16 static void bf_pack_a(uint32_t* ap, const struct bf16_gemm* g,
                                             int m0, int mc, int p0, int kp) {
    const float* a = g->a;
    const size_t lda = g->lda;
    const int K = g->K;
    const int full_mc = (g->M - m0 < mc ? g->M - m0 : mc) / BF_MR * BF_MR;   // whole panels
    int p_done = 0;   // pairs packed for the whole panels
    if (g->a_kind == BF16_A_ROWS || g->a_kind == BF16_A_ROWS_BF16) {
        const int a_bf16 = g->a_kind == BF16_A_ROWS_BF16;
        for (int i = 0; i < full_mc; i += BF_MR) {
            uint32_t* panel = ap + (size_t)i * kp;
            for (int p = 0; p < kp; p += 16) {
                const int np = kp - p < 16 ? kp - p : 16;
                const int k0 = 2 * (p0 + p);
                const int nk = K - k0 < 32 ? K - k0 : 32;   // elements of this block
                const __mmask16 lo = bf_first16(nk), hi = bf_first16(nk - 16);
                __m512i rows[BF_MR], out[BF_MR];
                for (int r = 0; r < BF_MR; r++) {
                    const size_t at = (size_t)(m0 + i + r) * lda + k0;
                    if (a_bf16) {
                        rows[r] = _mm512_maskz_loadu_epi16(bf_first32(nk),
                                                           (const uint16_t*)g->a + at);
                    } else {
                        rows[r] = bf_round_pairs(_mm512_maskz_loadu_ps(lo, a + at),
                                                 _mm512_maskz_loadu_ps(hi, a + at + 16));
                    }
                }
                bf_transpose8x16(rows, out);
                uint32_t* dst = panel + (size_t)p * BF_MR;
                for (int j = 0; 2 * j < np; j++) {
                    _mm512_mask_storeu_epi32(dst + 16 * j, bf_first16(8 * (np - 2 * j)), out[j]);
                }
            }
        }
        p_done = kp;
    } else {
        for (; p_done + 2 <= kp && 2 * (p0 + p_done) + 4 <= K; p_done += 2) {
            const float* x = a + (size_t)(2 * (p0 + p_done)) * lda + m0;
            for (int i = 0; i < full_mc; i += BF_MR) {
                // source rows 2p, 2p+2 (even k) and 2p+1, 2p+3 (odd k), 8 floats each
                const __m512 even = _mm512_castpd_ps(_mm512_insertf64x4(
                    _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(x + i))),
                    _mm256_castps_pd(_mm256_loadu_ps(x + 2 * lda + i)), 1));
                const __m512 odd = _mm512_castpd_ps(_mm512_insertf64x4(
                    _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(x + lda + i))),
                    _mm256_castps_pd(_mm256_loadu_ps(x + 3 * lda + i)), 1));
                // pair p of the panel's 8 rows, then pair p+1
                _mm512_storeu_si512(ap + (size_t)i * kp + (size_t)p_done * BF_MR,
                                    bf_round_zip(even, odd));
            }
        }
    }
    for (int i = 0; i < mc; i += BF_MR) {
        uint32_t* panel = ap + (size_t)i * kp;
        for (int p = i < full_mc ? p_done : 0; p < kp; p++) {
            for (int r = 0; r < BF_MR; r++) {
                panel[(size_t)p * BF_MR + r] = bf_pair_a(g, m0 + i + r, p0 + p);
            }
        }
    }
}

/* The pair (B(2p, n), B(2p+1, n)), rounded if float32; 0 past N or K. */
static inline uint32_t bf_pair_b(const struct bf16_gemm* g, int n, int p) {
    uint32_t pair = 0;
    for (int h = 0; h < 2; h++) {
        const int k = 2 * p + h;
        if (n >= g->N || k >= g->K) { continue; }
        uint16_t v;
        if (g->b_kind == BF16_B_COLS_W) {
            v = ((const uint16_t*)g->b)[(size_t)n * g->ldb + k];
        } else if (g->b_kind == BF16_B_ROWS_W) {
            v = ((const uint16_t*)g->b)[(size_t)k * g->ldb + n];
        } else {
            v = llmc_bf16_round(((const float*)g->b)[(size_t)k * g->ldb + n]);
        }
        pair |= (uint32_t)v << (16 * h);
    }
    return pair;
}

/*
 * Packs columns n0 .. n0+nr (nr <= BF_NR) of B, pairs p0 .. p0+kp, as one
 * panel of kp x BF_NR pairs.
 *   the weight as weight^T (B_COLS_W): a column of B is a weight row, whose
 *     pairs are already neighbours; 16 rows x 16 pairs are transposed in
 *     registers.
 *   rows (B_ROWS_W, B_ROWS_F32): pair p of column n joins source rows 2p
 *     and 2p+1 at n: for bf16, 32 columns of both rows zipped by one
 *     shuffle per 16 (a third fewer instructions than widening, shifting
 *     and or-ing 16 at a time: 5% of the head's dinp at 256x512x32000);
 *     for float32, 16 columns rounded and zipped.
 * Masked loads zero the columns past N and the high half past an odd K.
 */
LLMC_TARGET_AVX512BF16 static void bf_pack_b(uint32_t* bp, const struct bf16_gemm* g,
                                             int n0, int nr, int p0, int kp) {
    const size_t ldb = g->ldb;
    const int K = g->K;
    if (g->b_kind == BF16_B_COLS_W) {
        const uint16_t* w = g->b;
        for (int v = 0; v < BF_NV; v++) {
            const uint16_t* w_v = w + (size_t)(n0 + 16 * v) * ldb;
            const int rows = nr - 16 * v;   // valid rows of this group of 16
            for (int p = 0; p < kp; p += 16) {
                const int np = kp - p < 16 ? kp - p : 16;
                const int k0 = 2 * (p0 + p);
                // one path for whole and partial blocks (a row past nr reads
                // nothing, from a row that exists), so the block stays in
                // registers
                const __mmask32 valid = bf_first32(K - k0);
                __m512i block[16];
                for (int i = 0; i < 16; i++) {
                    const int in = i < rows;
                    block[i] = _mm512_maskz_loadu_epi16(in ? valid : 0,
                                                        w_v + (size_t)(in ? i : 0) * ldb + k0);
                }
                bf_transpose16(block);
                for (int j = 0; j < np; j++) {
                    _mm512_storeu_si512(bp + (size_t)(p + j) * BF_NR + 16 * v, block[j]);
                }
            }
        }
        return;
    }
    if (g->b_kind == BF16_B_ROWS_W) {
        // pair p of 32 columns: a 64-byte load from each of source rows 2p
        // and 2p+1, zipped by a two-source shuffle per 16 columns (the last
        // 16 columns alike from loads of 16)
        // lane 32 + i: the odd row's column i
        static const uint16_t zip[2][32] = {
            {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
             8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
            {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
             24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
        const __m512i zip_lo = _mm512_loadu_si512(zip[0]), zip_hi = _mm512_loadu_si512(zip[1]);
        const __mmask32 first = bf_first32(nr), last = bf_first32(nr - 32) & 0xffff;
        for (int p = 0; p < kp; p++) {
            const int k0 = 2 * (p0 + p);
            const int has_odd = k0 + 1 < K;
            const uint16_t* w = (const uint16_t*)g->b + (size_t)k0 * ldb + n0;
            uint32_t* dst = bp + (size_t)p * BF_NR;
            const __m512i even = _mm512_maskz_loadu_epi16(first, w);
            const __m512i odd = _mm512_maskz_loadu_epi16(has_odd ? first : 0, w + ldb);
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(even, zip_lo, odd));
            _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(even, zip_hi, odd));
            const __m512i even_last = _mm512_maskz_loadu_epi16(last, w + 32);
            const __m512i odd_last = _mm512_maskz_loadu_epi16(has_odd ? last : 0, w + ldb + 32);
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(even_last, zip_lo, odd_last));
        }
        return;
    }
    for (int p = 0; p < kp; p++) {
        const int k0 = 2 * (p0 + p);
        const int has_odd = k0 + 1 < K;
        uint32_t* dst = bp + (size_t)p * BF_NR;
        for (int v = 0; v < BF_NV; v++) {
            const __mmask16 cols = bf_first16(nr - 16 * v);
            const float* x = (const float*)g->b + (size_t)k0 * ldb + n0 + 16 * v;
            const __m512 even = _mm512_maskz_loadu_ps(cols, x);
            const __m512 odd = has_odd ? _mm512_maskz_loadu_ps(cols, x + ldb)
                                       : _mm512_setzero_ps();
            _mm512_storeu_si512(dst + 16 * v, bf_round_zip(even, odd));
        }
    }
}

/* A walk over cache lines to prefetch: count lines, per_row of them in
   each source row (at row + 64 line), rows stride bytes apart. */
struct bf_lines {
    const char* row;
    size_t stride;
    int per_row;
    int line;
    int64_t count;
};

/* The lines bf_pack_b(g, n0, nr, p0, kp) will read: whole source rows
   segments (a weight row's pairs for weight^T; nr columns of rows 2p0 ..
   2(p0+kp) otherwise), one spare line per row for misalignment. */
static inline struct bf_lines bf_panel_lines(const struct bf16_gemm* g, int n0, int nr,
                                             int p0, int kp) {
    const int k0 = 2 * p0, k1 = g->K < 2 * (p0 + kp) ? g->K : 2 * (p0 + kp);
    const size_t elem = g->b_kind == BF16_B_ROWS_F32 ? sizeof(float) : sizeof(uint16_t);
    struct bf_lines w;
    size_t len;
    int64_t rows;
    if (g->b_kind == BF16_B_COLS_W) {
        w.row = (const char*)g->b + ((size_t)n0 * g->ldb + (size_t)k0) * elem;
        len = (size_t)(k1 - k0) * elem;
        rows = nr;
    } else {
        w.row = (const char*)g->b + ((size_t)k0 * g->ldb + (size_t)n0) * elem;
        len = (size_t)nr * elem;
        rows = k1 - k0;
    }
    w.stride = g->ldb * elem;
    w.per_row = (int)((len + 63) / 64) + 1;
    w.line = 0;
    w.count = rows * w.per_row;
    return w;
}

/* The lines bf_pack_a(g, m0, mc, p0, kp) will read: mc rows of A, the
   floats of pairs p0 .. p0+kp each (A_ROWS), or the mc floats of each
   source row 2p0 .. 2(p0+kp) (A_COLS). */
static inline struct bf_lines bf_block_lines(const struct bf16_gemm* g, int m0, int mc,
                                             int p0, int kp) {
    const int k0 = 2 * p0, k1 = g->K < 2 * (p0 + kp) ? g->K : 2 * (p0 + kp);
    const int rows_m = g->M - m0 < mc ? g->M - m0 : mc;
    struct bf_lines w;
    size_t len;
    int64_t rows;
    const size_t elem = g->a_kind == BF16_A_ROWS_BF16 ? sizeof(uint16_t) : sizeof(float);
    if (g->a_kind != BF16_A_COLS) {
        w.row = (const char*)g->a + ((size_t)m0 * g->lda + (size_t)k0) * elem;
        len = (size_t)(k1 - k0) * elem;
        rows = rows_m;
    } else {
        w.row = (const char*)g->a + ((size_t)k0 * g->lda + (size_t)m0) * elem;
        len = (size_t)rows_m * elem;
        rows = k1 - k0;
    }
    w.stride = g->lda * elem;
    w.per_row = (int)((len + 63) / 64) + 1;
    w.line = 0;
    w.count = rows * w.per_row;
    return w;
}

/* Lines [first, first + count) of walk w. */
static inline struct bf_lines bf_lines_part(struct bf_lines w, int64_t first, int64_t count) {
    if (count <= 0) { w.count = 0; return w; }
    w.row += (size_t)(first / w.per_row) * w.stride;
    w.line = (int)(first % w.per_row);
    w.count = count;
    return w;
}

/*
 * The micro-kernel: c[r, 0..16 nv) (+)= sum_{p < kp} ap[p][r] . bp[p][..]
 * for r < BF_MR, the tile in 8 nv accumulators (nv <= BF_NV vectors of 16
 * columns; of the last one only the lanes `last` are read and written).
 * init: NULL starts from c, else every row starts from init[..]. Each
 * lane's sum runs p = 0, 1, ..., kp-1, one vdpbf16ps per pair. On the way it
 * prefetches into L2 the lines of pf (up to two per pair) and of pf_a (one
 * per pair), and the tile of C at pf_c for writing (NULL: none). Inlined
 * with nv a constant, so that the accumulators stay in registers.
 */
LLMC_TARGET_AVX512BF16 static LLMC_ALWAYS_INLINE void bf_micro_nv(
        int nv, __mmask16 last, int kp, const uint32_t* ap, const uint32_t* bp, float* c,
        size_t ldc, const float* init, struct bf_lines pf, struct bf_lines pf_a,
        const float* pf_c) {
    __m512 acc[BF_MR][BF_NV];
    for (int r = 0; r < BF_MR; r++) {
        const float* start = init != NULL ? init : c + r * ldc;
        for (int v = 0; v < nv; v++) {
            acc[r][v] = _mm512_maskz_loadu_ps(v + 1 < nv ? (__mmask16)0xffff : last,
                                              start + 16 * v);
        }
    }
    for (int p = 0; p < kp; p++) {
        // up to two lines of the next panel's source per pair (a few rows
        // share a panel when M is small), and of the next A block's
        for (int q = 0; q < 2 && pf.count > 0; q++) {
            _mm_prefetch(pf.row + 64 * pf.line, _MM_HINT_T1);
            pf.count--;
            if (++pf.line == pf.per_row) { pf.line = 0; pf.row += pf.stride; }
        }
        if (pf_a.count > 0) {
            _mm_prefetch(pf_a.row + 64 * pf_a.line, _MM_HINT_T1);
            pf_a.count--;
            if (++pf_a.line == pf_a.per_row) { pf_a.line = 0; pf_a.row += pf_a.stride; }
        }
        if (p < BF_MR && pf_c != NULL) {
            for (int v = 0; v < nv; v++) { __builtin_prefetch(pf_c + p * ldc + 16 * v, 1, 3); }
        }
        __m512bh b[BF_NV];
        for (int v = 0; v < nv; v++) {
            b[v] = (__m512bh)_mm512_loadu_si512(bp + (size_t)p * BF_NR + 16 * v);
        }
        for (int r = 0; r < BF_MR; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)ap[(size_t)p * BF_MR + r]);
            for (int v = 0; v < nv; v++) { acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[v], a); }
        }
    }
    for (int r = 0; r < BF_MR; r++) {
        for (int v = 0; v < nv; v++) {
            _mm512_mask_storeu_ps(c + r * ldc + 16 * v, v + 1 < nv ? (__mmask16)0xffff : last,
                                  acc[r][v]);
        }
    }
}

/* The micro-kernel on a whole tile, BF_MR x BF_NR. */
LLMC_TARGET_AVX512BF16 __attribute__((noinline))
static void bf_micro(int kp, const uint32_t* ap, const uint32_t* bp, float* c, size_t ldc,
                     const float* init, struct bf_lines pf, struct bf_lines pf_a,
                     const float* pf_c) {
    bf_micro_nv(BF_NV, 0xffff, kp, ap, bp, c, ldc, init, pf, pf_a, pf_c);
}

/* The micro-kernel on BF_MR whole rows of nr < BF_NR columns (N's last),
   in place: only the vectors that hold columns are multiplied, so a tile
   of 16 or 32 columns costs a third or two of a whole one, not all of it
   plus a copy (bf_micro_edge). Each lane's sum is bf_micro's. */
LLMC_TARGET_AVX512BF16 __attribute__((noinline))
static void bf_micro_narrow(int kp, int nr, const uint32_t* ap, const uint32_t* bp, float* c,
                            size_t ldc, const float* init, struct bf_lines pf,
                            struct bf_lines pf_a, const float* pf_c) {
    const __mmask16 last = bf_first16(nr - (nr - 1) / 16 * 16);
    if (nr <= 16) {
        bf_micro_nv(1, last, kp, ap, bp, c, ldc, init, pf, pf_a, pf_c);
    } else if (nr <= 32) {
        bf_micro_nv(2, last, kp, ap, bp, c, ldc, init, pf, pf_a, pf_c);
    } else {
        bf_micro_nv(3, last, kp, ap, bp, c, ldc, init, pf, pf_a, pf_c);
    }
}

/* The micro-kernel on a partial tile (mr rows x nr columns) through a local
   copy; init and the prefetches as in bf_micro (only init's first nr
   entries are read). */
LLMC_TARGET_AVX512BF16 static void bf_micro_edge(int kp, int mr, int nr, const uint32_t* ap,
                                                 const uint32_t* bp, float* c, size_t ldc,
                                                 const float* init, struct bf_lines pf,
                                                 struct bf_lines pf_a) {
    float tile[BF_MR * BF_NR];
    memset(tile, 0, sizeof tile);
    for (int r = 0; r < mr; r++) {
        memcpy(tile + r * BF_NR, init != NULL ? init : c + r * ldc, (size_t)nr * sizeof(float));
    }
    bf_micro(kp, ap, bp, tile, BF_NR, NULL, pf, pf_a, NULL);
    for (int r = 0; r < mr; r++) {
        memcpy(c + r * ldc, tile + r * BF_NR, (size_t)nr * sizeof(float));
    }
}

/*
 * The skinny kernel (few rows: decoding): out[m, o] = start + sum_p
 * xp[m][p] . (weight[o, 2p], weight[o, 2p+1]) for m < M and o0 <= o < o1
 * (o1 - o0 <= 16), start = bias[o] or 0. xp holds the rounded pairs of the
 * M rows of inp, kp = ceil(K / 2) per row. A block of 16 weight rows x 16
 * pairs is read in place once (masked past K, zero rows past o1) and
 * transposed in registers, after which vector j holds pair j of the 16
 * columns: the very vector the GEMM's packed B panel holds, so each lane
 * runs the GEMM's chain for its element (same start, same pairs, same
 * order) and the two paths agree bitwise. Only the valid pairs enter the
 * sums. Rows go BF_SKINNY_ROWS at a time.
 */
#define BF_SKINNY_ROWS 8

LLMC_TARGET_AVX512BF16 static LLMC_ALWAYS_INLINE void bf_skinny_tile(
        int mr, int no, float* out, size_t ldo, const uint32_t* xp, int kp,
        const uint16_t* w, size_t ldw, int K, const float* bias, int prefetch) {
    const __mmask16 cols = bf_first16(no);
    const __m512 start = bias != NULL ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
    __m512 acc[BF_SKINNY_ROWS];
    for (int r = 0; r < mr; r++) { acc[r] = start; }
    // the next group of 16 weight rows follows this one in memory: fetch it
    // in order, an equal share per block, to stay one group ahead
    const char* next = (const char*)(w + 16 * ldw);
    const int blocks = (kp + 15) / 16;
    const size_t share = (16 * ldw * sizeof(uint16_t) / (size_t)blocks + 63) / 64 * 64;
    for (int p = 0; p < kp; p += 16) {
        const int np = kp - p < 16 ? kp - p : 16;
        // one load path for whole and partial blocks (as in bf_pack_b)
        const __mmask32 valid = bf_first32(K - 2 * p);
        __m512i v[16];
        for (int i = 0; i < 16; i++) {
            const int in = i < no;
            v[i] = _mm512_maskz_loadu_epi16(in ? valid : 0, w + (size_t)(in ? i : 0) * ldw + 2 * p);
        }
        if (prefetch) {
            const char* pf = next + (size_t)(p / 16) * share;
            for (size_t off = 0; off < share; off += 64) { _mm_prefetch(pf + off, _MM_HINT_T1); }
        }
        bf_transpose16(v);
        for (int j = 0; j < np; j++) {
            for (int r = 0; r < mr; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xp[(size_t)r * kp + p + j]);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)v[j], x);
            }
        }
    }
    for (int r = 0; r < mr; r++) { _mm512_mask_storeu_ps(out + (size_t)r * ldo, cols, acc[r]); }
}

LLMC_TARGET_AVX512BF16 static void bf_skinny(float* out, size_t ldo, const uint32_t* xp,
                                             const uint16_t* weight, const float* bias,
                                             int M, int K, int o0, int o1) {
    const int kp = (K + 1) / 2;
    const int no = o1 - o0;
    const uint16_t* w = weight + (size_t)o0 * K;
    const float* b = bias != NULL ? bias + o0 : NULL;
    for (int m = 0; m < M; m += BF_SKINNY_ROWS) {
        float* out_m = out + (size_t)m * ldo + o0;
        const uint32_t* x = xp + (size_t)m * kp;
        const int pf = m == 0 && no == 16;   // the first pass brings the weight
        switch (M - m) {
            case 1: bf_skinny_tile(1, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf); break;
            case 2: bf_skinny_tile(2, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf); break;
            case 3: bf_skinny_tile(3, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf); break;
            case 4: bf_skinny_tile(4, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf); break;
            case 5: bf_skinny_tile(5, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf); break;
            case 6: bf_skinny_tile(6, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf); break;
            case 7: bf_skinny_tile(7, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf); break;
            default: bf_skinny_tile(BF_SKINNY_ROWS, no, out_m, ldo, x, kp, w, (size_t)K, K, b, pf);
        }
    }
}

/* The pairs of the M rows of a row-major x [M, K], float32 (rounded) or
   bf16 (x_bf16: copied), into xp [M, kp] with kp = ceil(K / 2) (the skinny
   kernel's inp). */
LLMC_TARGET_AVX512BF16 static void bf_round_rows(uint32_t* xp, const void* x, int x_bf16, int K,
                                                 int64_t M) {
    const int kp = (K + 1) / 2;
    for (int64_t m = 0; m < M; m++) {
        uint32_t* xp_m = xp + (size_t)m * kp;
        for (int p = 0; p < kp; p += 16) {
            const int nk = K - 2 * p;
            const size_t at = (size_t)m * K + 2 * (size_t)p;
            const __m512i pairs =
                x_bf16 ? _mm512_maskz_loadu_epi16(bf_first32(nk), (const uint16_t*)x + at)
                       : bf_round_pairs(_mm512_maskz_loadu_ps(bf_first16(nk), (const float*)x + at),
                                        _mm512_maskz_loadu_ps(bf_first16(nk - 16),
                                                              (const float*)x + at + 16));
            _mm512_mask_storeu_epi32(xp_m + p, bf_first16(kp - p), pairs);
        }
    }
}

#endif
