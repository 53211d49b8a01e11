/*
 * Causal grouped-query attention of bf16 models, forward and backward: the
 * contract of attention_gqa_forward / _backward (ALiBi slopes, a sliding
 * window, dropout, stats [B, NH, T, 2] kept instead of att), with every
 * matrix product on bf16 operands summed in float32, and the softmax, its
 * statistics and the softmax's backward in float32:
 *   forward   S  = bf16(q) bf16(k)^T * scale + bias     P = softmax(S)
 *             out = bf16(P) bf16(v)                      (P after dropout)
 *   backward  dP = bf16(dO) bf16(v)^T   dS = P * (dP - rowsum(P dP)) * scale
 *             dq += bf16(dS) bf16(k)    dk += bf16(dS)^T bf16(q)
 *             dv += bf16(P)^T bf16(dO)
 * Rounding is matmul_bf16.c's: float32 to bf16 to nearest even as
 * llmc_bf16_round does, and a bf16 denormal flushed to a signed 0 (what
 * vdpbf16ps reads it as). Products of two bf16 are exact in float32.
 *
 * Layout and order. Like attention.c (which says why), the forward keeps
 * two numbers per query row and the backward recomputes P block by block
 * from them, by the same score tile on the same panels, so the backward's P
 * is bitwise the forward's. Every product is one tile primitive, dp_tile:
 *   acc[r][v] += sum_p  a_r[p] . b[p][v]      p ascending
 * where a_r[p] and each lane of b[p][v] are bf16 pairs (the summed index
 * 2p in the low half, 2p + 1 in the high) and "." is vdpbf16ps's: first
 * + a[2p+1] b[2p+1], then + a[2p] b[2p], each rounded to float32. The
 * operands, packed per head:
 *   scores  S    a = q's rows (pairs of channels), b = the key panel
 *                [hs/2][Tp] (16 keys a vector)                 8 rows x 32 keys
 *   P v     out  a = bf16(P)'s rows (pairs of keys), b = the value panel
 *                [Tp/2][hsv] (16 channels a vector)            4 rows x 64 channels
 *   dP, dq       as scores (dO against v's key panel) and P v (dS against k's
 *                value panel)
 *   dk, dv       transposed, channels as rows: dk^T[c][t2] sums over the
 *                block's row pairs: a = q^T (pairs of rows), b = dS's row pairs
 *                [rows/2][Tp] (16 keys a vector)               8 channels x 32 keys
 * A row's keys outside its window and past its last key are 0 in bf16(P),
 * bf16(dS) and their row pairs, so a tile's rows share their loops: such a
 * term adds exactly 0 (finite operands; a sum from +0 is never -0). dk^T
 * and dv^T leave out the row pairs before a key's first row, which hold
 * only such terms. dk^T and dv^T of a kv head are summed in scratch,
 * over its query heads in order, blocks of rows in order, row pairs in
 * order, and added to dinp at the end. Every element is summed by one
 * thread in an order fixed by the shapes: results never depend on the
 * thread count.
 *
 * variants: the forward and backward are built per instruction set (isa.h):
 *   avx512bf16  one vdpbf16ps per pair
 *   avx512, avx2, portable
 *               the same pair as two float32 multiply-adds of the widened
 *               halves, odd then even: the same exact products added in the
 *               same order, so the same float32 sums, except where a sum or
 *               a product falls below 2^-126, which vdpbf16ps flushes to 0
 *               (summed scores and probabilities never get near)
 * The float32 steps around them (score scale and bias, softmax, dS) are
 * attention.c's vector code, which a build without FMA (portable) rounds
 * differently; with FMA the four variants agree bitwise.
 * The plain twin is the float64 reference the tests compute on the rounded
 * operands (tests/attention_helpers.py).
 */
#include <stdlib.h>
#include <string.h>
#include "llmc.h"
#include "common.h"
#include "dropout.h"
#include "isa.h"
#include "attention.h"
#include "attention_tiles.h"

#define ROWS_CH 64     /* channels of a P v / dq tile: 4 vectors */

typedef uint32_t vec16u __attribute__((vector_size(64)));

static ALWAYS_INLINE vec16u load16u(const uint32_t* p) {
    vec16u v;
    memcpy(&v, p, sizeof v);
    return v;
}
static ALWAYS_INLINE void store16u(uint32_t* p, vec16u v) { memcpy(p, &v, sizeof v); }

/* Each lane rounded to bf16 (llmc_bf16_round's bits), a denormal flushed
   to a signed 0: in the low 16 bits of the lane. */
static ALWAYS_INLINE vec16u bf16_bits(vec16f x) {
    const vec16u u = (vec16u)x;
    const vec16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vec16u quiet_nan = (u >> 16) | 0x40u;
    const vec16i is_nan = LLMC_CMP16(u & 0x7fffffffu, >, (vec16u){0} + 0x7f800000u);
    const vec16u r = (vec16u)llmc_select16(is_nan, (vec16f)quiet_nan, (vec16f)rounded);
    return (vec16u)llmc_select16(LLMC_CMP16(r & 0x7f80u, ==, (vec16u){0}), (vec16f)(r & 0x8000u),
                                 (vec16f)r);
}

/* Pairs (even[i], odd[i]), each rounded, lane by lane. */
static ALWAYS_INLINE vec16u zip_pairs(vec16f even, vec16f odd) {
    return bf16_bits(even) | (bf16_bits(odd) << 16);
}

/* x[k0 .. k0+16) with the lanes outside [lo, hi) 0; nothing outside is read. */
static ALWAYS_INLINE vec16f load_between(const float* x, int k0, int lo, int hi) {
    const int m = hi - k0 < 0 ? 0 : hi - k0;
    const vec16f v = load_part(x + k0, m);
    return lo > k0 ? llmc_select16(llmc_lanes_below(lo - k0), (vec16f){0}, v) : v;
}

#ifdef LLMC_X86_DISPATCH
#include <immintrin.h>
#include "bf16_round.h"

/* The pairs of 32 consecutive floats, lo then hi (pair i = (x[2i],
   x[2i+1])), and the pairs (even[i], odd[i]) of two vectors, rounded by
   vcvtne2ps2bf16 after the matmul's denormal fix: bitwise zip_pairs' (a
   denormal bf16 flushed to a signed 0 either way). Not always-inline,
   taking pointers, for dp_native's reasons below. */
LLMC_TARGET_AVX512BF16 static inline void pairs_native(uint32_t* out, const vec16f* lo,
                                                       const vec16f* hi) {
    _mm512_storeu_si512(out, bf_round_pairs((__m512)*lo, (__m512)*hi));
}
LLMC_TARGET_AVX512BF16 static inline void zip_native(uint32_t* out, const vec16f* even,
                                                     const vec16f* odd) {
    _mm512_storeu_si512(out, bf_round_zip((__m512)*even, (__m512)*odd));
}
#endif

/* out[0 .. 16) = zip_pairs(even, odd), on isa. */
static ALWAYS_INLINE void store_zipped(int isa, uint32_t* out, vec16f even, vec16f odd) {
#ifdef LLMC_X86_DISPATCH
    if (isa == LLMC_ISA_AVX512BF16) {
        zip_native(out, &even, &odd);
        return;
    }
#endif
    (void)isa;
    store16u(out, zip_pairs(even, odd));
}

#ifdef LLMC_X86_DISPATCH
/* *acc += one vdpbf16ps of a (broadcast) and *b: inlined into the
   avx512bf16 variants. The others never call it: it is not always-inline,
   so their builds need not have it, and it takes pointers, not vectors,
   whose passing would change with the caller's instruction set. */
LLMC_TARGET_AVX512BF16 static inline void dp_native(vec16f* acc, uint32_t a, const vec16u* b) {
    *acc = (vec16f)_mm512_dpbf16_ps((__m512)*acc, (__m512bh)_mm512_set1_epi32((int)a),
                                    (__m512bh)*b);
}
#endif

/* out[p] for pairs p in [p0, p1) (p1 - p0 a multiple of 16): the pair of
   x[2p] * scale, x[2p+1] * scale, elements outside [lo, hi) as 0. */
static ALWAYS_INLINE void row_pairs(int isa, uint32_t* out, const float* x, int p0, int p1,
                                    int lo, int hi, float scale) {
    for (int p = p0; p < p1; p += 16) {
        const vec16f a = load_between(x, 2 * p, lo, hi) * scale;
        const vec16f b = load_between(x, 2 * p + 16, lo, hi) * scale;
#ifdef LLMC_X86_DISPATCH
        if (isa == LLMC_ISA_AVX512BF16) {
            pairs_native(out + p, &a, &b);
            continue;
        }
#endif
        (void)isa;
        const vec16f even = LLMC_SHUF(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                      28, 30);
        const vec16f odd = LLMC_SHUF(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                     29, 31);
        store16u(out + p, zip_pairs(even, odd));
    }
}

/* Rows this far ahead of the one a loop over the rows of q, k, v or dO
   reads are asked of the cache (prefetch_rows): those rows lie a whole row
   of inp apart, so no hardware prefetcher brings them in. */
#define ROWS_AHEAD 8

/* Asks for row t of x (ldx floats apart, hs floats) when t < n. */
static ALWAYS_INLINE void prefetch_row(const float* x, size_t ldx, int t, int n, int hs) {
    if (t < n) { prefetch_rows(x + (size_t)t * ldx, ldx, 1, hs); }
}

/* The panel of n rows of x (ldx floats apart) with pairs of rows in the
   lanes' halves: out[j][c] = (x[2j][c], x[2j+1][c]) for c < hs (16 columns
   a vector, ldo pairs a row of out, hs rounded up to 16), rows past n 0. */
static ALWAYS_INLINE void value_panel_body(int isa, uint32_t* out, size_t ldo, const float* x,
                                           size_t ldx, int n, int hs) {
    for (int j = 0; 2 * j < n; j++) {
        const float* x0 = x + (size_t)(2 * j) * ldx;
        const float* x1 = x0 + ldx;
        prefetch_row(x, ldx, 2 * j + ROWS_AHEAD, n, hs);
        prefetch_row(x, ldx, 2 * j + 1 + ROWS_AHEAD, n, hs);
        for (int c0 = 0; c0 < hs; c0 += 16) {
            const int m = hs - c0 < 16 ? hs - c0 : 16;
            const vec16f odd = 2 * j + 1 < n ? load_part(x1 + c0, m) : (vec16f){0};
            store_zipped(isa, out + (size_t)j * ldo + c0, load_part(x0 + c0, m), odd);
        }
    }
}
LLMC_ISA_VARIANTS_BF16(value_panel, (uint32_t* out, size_t ldo, const float* x, size_t ldx,
                                     int n, int hs),
                       out, ldo, x, ldx, n, hs)

/* The transposed panel of n rows of x (ldx floats apart) of hs channels:
   pairs of channels in the lanes' halves, rows in the lanes:
   out[i][t] = (x[t][2i], x[t][2i+1]) (ldo pairs a row of out, t up to n
   rounded up to 16), rows past n and a last odd channel's half 0. The key
   panel of the scores (x = k or v) and q^T, dO^T of dk, dv (x = their
   row pairs, already pairs: then "channel" 2i, 2i+1 are halves) share it. */
static ALWAYS_INLINE void key_panel_body(int isa, uint32_t* out, size_t ldo, const float* x,
                                         size_t ldx, int n, int hs) {
    for (int k0 = 0; k0 < n; k0 += 16) {
        const int m = n - k0 < 16 ? n - k0 : 16;
        for (int j = 16; j < 32; j++) { prefetch_row(x, ldx, k0 + j, n, hs); }   // the next block
        for (int i0 = 0; i0 < hs; i0 += 16) {
            const int ci = hs - i0 < 16 ? hs - i0 : 16;
            vec16f r[16];
            key_block(r, x, ldx, k0, m, i0, ci, 1.0f);   // r[ii] lane j: x[k0 + j][i0 + ii]
            for (int ii = 0; ii < ci; ii += 2) {
                store_zipped(isa, out + (size_t)((i0 + ii) / 2) * ldo + k0, r[ii], r[ii + 1]);
            }
        }
    }
}
LLMC_ISA_VARIANTS_BF16(key_panel, (uint32_t* out, size_t ldo, const float* x, size_t ldx, int n,
                                   int hs),
                       out, ldo, x, ldx, n, hs)

/* transposes a panel of pairs (as 32-bit lanes): out[c][j] = in[j][c] for
   j < nj (16 a block, in's rows past nj read as 0) and c < n_cols. */
static ALWAYS_INLINE void transpose_pairs_body(uint32_t* out, size_t ldo, const uint32_t* in,
                                               size_t ldi, int nj, int n_cols) {
    for (int j0 = 0; j0 < nj; j0 += 16) {
        for (int c0 = 0; c0 < n_cols; c0 += 16) {
            vec16f r[16];
            for (int jj = 0; jj < 16; jj++) {
                r[jj] = j0 + jj < nj ? (vec16f)load16u(in + (size_t)(j0 + jj) * ldi + c0)
                                     : (vec16f){0};
            }
            llmc_transpose16(r);   // shuffles only: the bits move unchanged
            const int nc = n_cols - c0 < 16 ? n_cols - c0 : 16;
            for (int cc = 0; cc < nc; cc++) {
                store16u(out + (size_t)(c0 + cc) * ldo + j0, (vec16u)r[cc]);
            }
        }
    }
}
LLMC_ISA_VARIANTS(transpose_pairs, (uint32_t* out, size_t ldo, const uint32_t* in, size_t ldi,
                                    int nj, int n_cols),
                  out, ldo, in, ldi, nj, n_cols)

/* dp_tile's pairs without vdpbf16ps, for the sub-tile of RS rows from r0
   and VS vectors from v0 (acc's rows NV vectors apart, a_r[r] row r of a):
   each pair as two float32 multiply-adds of the widened halves, odd then
   even. */
static ALWAYS_INLINE void dp_widened(vec16f* acc, int NV, int r0, int RS, int v0, int VS,
                                     const uint32_t* const* a_r, const uint32_t* b, size_t ldb,
                                     int p0, int p1) {
    for (int p = p0; p < p1; p++) {
        vec16f b_odd[4], b_even[4];
        UNROLL for (int v = 0; v < VS; v++) {
            const vec16u bv = load16u(b + (size_t)p * ldb + 16 * (v0 + v));
            b_odd[v] = (vec16f)(bv & 0xffff0000u);
            b_even[v] = (vec16f)(bv << 16);
        }
        UNROLL for (int r = 0; r < RS; r++) {
            const uint32_t a_rp = a_r[r0 + r][p];
            const uint32_t odd_bits = a_rp & 0xffff0000u, even_bits = a_rp << 16;
            float a_odd, a_even;
            memcpy(&a_odd, &odd_bits, sizeof a_odd);
            memcpy(&a_even, &even_bits, sizeof a_even);
            UNROLL for (int v = 0; v < VS; v++) {
                acc[(r0 + r) * NV + v0 + v] += a_odd * b_odd[v];
                acc[(r0 + r) * NV + v0 + v] += a_even * b_even[v];
            }
        }
    }
}

/* Rows of dp_widened's sub-tiles (of one vector) on AVX2 and the portable
   build. A tile of 8 x 2 or 4 x 4 vectors is 32 ymm registers of
   accumulators on AVX2, which has 16: spilled, its loop ran at 5 GFLOP/s
   beside the GEMM's 65 (Zen 1, 2 threads); 4 rows of one vector keep 8
   accumulators and b's 4 halves in registers: forward 210 -> 88 ms,
   backward 608 -> 207 ms (B=4, T=256, 16 q heads, 8 kv heads, hs=128),
   bitwise as before. SSE's 16 xmm: 2 rows. AVX-512's 32 registers hold
   every tile whole. */
#define SUB_ROWS_AVX2 4
#define SUB_ROWS_PORTABLE 2

/* dp_widened's sub-tile of RS <= SUB_ROWS_AVX2 rows from r0 and one vector
   v, its sums in halves (see half16f), each a_r[p] broadcast, then split
   into its halves in vector registers: per lane the same operations in the
   same order as dp_widened's. */
static ALWAYS_INLINE void dp_widened_sub(vec16f* acc, int NV, int r0, int RS, int v,
                                         const uint32_t* const* a_r, const uint32_t* b,
                                         size_t ldb, int p0, int p1) {
    half16f lo[SUB_ROWS_AVX2], hi[SUB_ROWS_AVX2];
    const uint32_t* rows[SUB_ROWS_AVX2];
    UNROLL for (int r = 0; r < RS; r++) {
        memcpy(&lo[r], &acc[(r0 + r) * NV + v], sizeof lo[r]);
        memcpy(&hi[r], (const char*)&acc[(r0 + r) * NV + v] + sizeof lo[r], sizeof hi[r]);
        rows[r] = a_r[r0 + r];
    }
    const uint32_t* b_v = b + 16 * v;
    for (int p = p0; p < p1; p++) {
        half16u b_lo, b_hi;
        memcpy(&b_lo, b_v + (size_t)p * ldb, sizeof b_lo);
        memcpy(&b_hi, b_v + (size_t)p * ldb + 8, sizeof b_hi);
        const half16f odd_lo = (half16f)(b_lo & 0xffff0000u), even_lo = (half16f)(b_lo << 16);
        const half16f odd_hi = (half16f)(b_hi & 0xffff0000u), even_hi = (half16f)(b_hi << 16);
        UNROLL for (int r = 0; r < RS; r++) {
            const half16u a_rp = (half16u){0} + rows[r][p];
            const half16f a_odd = (half16f)(a_rp & 0xffff0000u), a_even = (half16f)(a_rp << 16);
            lo[r] += a_odd * odd_lo;
            lo[r] += a_even * even_lo;
            hi[r] += a_odd * odd_hi;
            hi[r] += a_even * even_hi;
        }
    }
    UNROLL for (int r = 0; r < RS; r++) {
        memcpy(&acc[(r0 + r) * NV + v], &lo[r], sizeof lo[r]);
        memcpy((char*)&acc[(r0 + r) * NV + v] + sizeof lo[r], &hi[r], sizeof hi[r]);
    }
}

/*
 * dp_tile: R rows x NV vectors (compile-time constants at every call),
 *   acc[r][v] += sum_{p0 <= p < p1} a[r][p] . b[p][16 v ..]
 * rows of a lda pairs apart (row r >= nr reads row nr - 1: its sums are
 * computed and dropped; the sub-tiles of AVX2 and the portable build leave
 * them out), rows of b ldb pairs apart. A lane's sum is the same chain in
 * any tile or sub-tile.
 */
static ALWAYS_INLINE void dp_tile(int isa, vec16f* acc, int R, int NV, const uint32_t* a,
                                  size_t lda, int nr, const uint32_t* b, size_t ldb, int p0,
                                  int p1) {
    const uint32_t* a_r[SCORE_ROWS];
    UNROLL for (int r = 0; r < R; r++) { a_r[r] = a + (size_t)(r < nr ? r : nr - 1) * lda; }
#ifdef LLMC_X86_DISPATCH
    if (isa == LLMC_ISA_AVX512BF16) {
        for (int p = p0; p < p1; p++) {
            vec16u bv[4];
            UNROLL for (int v = 0; v < NV; v++) {
                bv[v] = load16u(b + (size_t)p * ldb + 16 * v);
                KEEP_IN_REGISTER(bv[v]);
            }
            UNROLL for (int r = 0; r < R; r++) {
                const uint32_t a_rp = a_r[r][p];
                UNROLL for (int v = 0; v < NV; v++) {
                    dp_native(&acc[r * NV + v], a_rp, &bv[v]);
                }
            }
        }
        return;
    }
#endif
    if (isa >= LLMC_ISA_AVX512) {
        dp_widened(acc, NV, 0, R, 0, NV, a_r, b, ldb, p0, p1);
        return;
    }
    const int RS = isa == LLMC_ISA_AVX2 ? SUB_ROWS_AVX2 : SUB_ROWS_PORTABLE;
    UNROLL for (int r0 = 0; r0 < R; r0 += RS) {
        if (r0 >= nr) { break; }
        UNROLL for (int v = 0; v < NV; v++) {
            dp_widened_sub(acc, NV, r0, R - r0 < RS ? R - r0 : RS, v, a_r, b, ldb, p0, p1);
        }
    }
}

/* Scores of nr rows (<= SCORE_ROWS; row r with n0 + r keys) against keys
   k_first (a multiple of 16) on: a [rows][lda] pairs of the rows, panel
   [hn][ldp] the key panel; s[r][t2] = scale * sum + the ALiBi bias, stored
   for keys before the row's last only (lds floats a row of s). */
static ALWAYS_INLINE void score_rows_body(int isa, float* s, size_t lds, const uint32_t* a,
                                          size_t lda, const uint32_t* panel, size_t ldp, int hn,
                                          int nr, int n0, float scale, float slope,
                                          int k_first) {
    const int nmax = n0 + nr - 1;
    for (int k0 = k_first; k0 < nmax; k0 += 32) {
        vec16f acc[SCORE_ROWS * 2] = {{0}};
        if (nmax - k0 > 16) {
            dp_tile(isa, acc, SCORE_ROWS, 2, a, lda, nr, panel + k0, ldp, 0, hn);
        } else {
            dp_tile(isa, acc, SCORE_ROWS, 1, a, lda, nr, panel + k0, ldp, 0, hn);
        }
        const int NV = nmax - k0 > 16 ? 2 : 1;
        for (int r = 0; r < nr; r++) {
            for (int half = 0; half < NV; half++) {
                const int m = n0 + r - (k0 + 16 * half);
                const vec16f sv = acc[r * NV + half] * scale
                                  + score_init(n0 + r, k0 + 16 * half, slope);
                if (m > 0) { store_part(s + (size_t)r * lds + k0 + 16 * half, sv, m); }
            }
        }
    }
}

/* score_rows, value_rows and transposed_rows, like the panels above, are
   built per instruction set, out of the heads' bodies that call them: with
   all inlined at every call, gcc 12 took 175 s over this file (Zen 1),
   nearly all in passes whose time grows faster than a function's size
   (PRE, load CSE after reload); 34 s so. */
LLMC_ISA_VARIANTS_BF16(score_rows, (float* s, size_t lds, const uint32_t* a, size_t lda,
                                    const uint32_t* panel, size_t ldp, int hn, int nr, int n0,
                                    float scale, float slope, int k_first),
                       s, lds, a, lda, panel, ldp, hn, nr, n0, scale, slope, k_first)

/* o[r][c] (+)= sum_{p0 <= p < p1} a[r][p] . panel[p][c] for nr rows (<= 4)
   and c < hs: a [rows][lda] pairs of keys, panel [pairs][ldp] a value
   panel; rows of o ldo floats apart, accumulate: add to o's values. */
static ALWAYS_INLINE void value_rows_body(int isa, float* o, size_t ldo, int accumulate,
                                          const uint32_t* a, size_t lda, const uint32_t* panel,
                                          size_t ldp, int nr, int p0, int p1, int hs) {
    for (int c0 = 0; c0 < hs; c0 += ROWS_CH) {
        const int nc = hs - c0 < ROWS_CH ? hs - c0 : ROWS_CH;
        vec16f acc[TILE_ROWS * 4];
        for (int r = 0; r < TILE_ROWS; r++) {
            for (int v = 0; v < 4; v++) {
                const int m = nc - 16 * v;
                acc[r * 4 + v] = accumulate && r < nr && m > 0
                                     ? load_part(o + (size_t)r * ldo + c0 + 16 * v, m)
                                     : (vec16f){0};
            }
        }
        switch ((nc + 15) / 16) {
        case 4: dp_tile(isa, acc, TILE_ROWS, 4, a, lda, nr, panel + c0, ldp, p0, p1); break;
        default: {
            // fewer vectors: gather the tile's NV-wide accumulators, then back
            vec16f small[TILE_ROWS * 3];
            const int NV = (nc + 15) / 16;
            for (int r = 0; r < TILE_ROWS; r++) {
                for (int v = 0; v < NV; v++) { small[r * NV + v] = acc[r * 4 + v]; }
            }
            if (NV == 3) {
                dp_tile(isa, small, TILE_ROWS, 3, a, lda, nr, panel + c0, ldp, p0, p1);
            } else if (NV == 2) {
                dp_tile(isa, small, TILE_ROWS, 2, a, lda, nr, panel + c0, ldp, p0, p1);
            } else {
                dp_tile(isa, small, TILE_ROWS, 1, a, lda, nr, panel + c0, ldp, p0, p1);
            }
            for (int r = 0; r < TILE_ROWS; r++) {
                for (int v = 0; v < NV; v++) { acc[r * 4 + v] = small[r * NV + v]; }
            }
        }
        }
        for (int r = 0; r < nr; r++) {
            for (int v = 0; 16 * v < nc; v++) {
                store_part(o + (size_t)r * ldo + c0 + 16 * v, acc[r * 4 + v], nc - 16 * v);
            }
        }
    }
}
LLMC_ISA_VARIANTS_BF16(value_rows, (float* o, size_t ldo, int accumulate, const uint32_t* a,
                                    size_t lda, const uint32_t* panel, size_t ldp, int nr, int p0,
                                    int p1, int hs),
                       o, ldo, accumulate, a, lda, panel, ldp, nr, p0, p1, hs)

LLMC_ISA_VARIANTS_ISA(probs_row, (float* p, int n, const float* stats), p, n, stats)


/* The sizes of one call's panels: hn channel pairs (the last may hold one
   channel), hp pairs a row of q's and dO's row pairs (hn rounded up to 16),
   Tp keys (T rounded up to 32: whole pairs of vectors), hsv channels (hs
   rounded up to 16), and Tq pairs a row of q^T and dO^T (Tp / 2). */
typedef struct {
    int hn, hp, Tp, hsv, Tq;
} bf16_sizes;

static bf16_sizes sizes_of(int T, int hs) {
    const bf16_sizes z = {.hn = (hs + 1) / 2, .hp = (hs + 31) / 32 * 16,
                          .Tp = (T + 31) / 32 * 32, .hsv = (hs + 15) / 16 * 16,
                          .Tq = (T + 31) / 32 * 16};
    return z;
}

/* The first and one-past-last key pairs that rows t .. t_last of a tile sum
   over in P v and dq; the first pair that a tile's rows of bf16(P) and
   bf16(dS) are written from (whole vectors of 16 pairs). */
static int first_pair(int t, int window) { return first_key(t, window) / 2; }
static int first_row_pair(int t, int window) { return first_key(t, window) / 32 * 16; }
static int end_pair(int t_last) { return (t_last + 2) / 2; }

/* The forward of one (b, h). Scratch: the key panel [hp][Tp], the value
   panel [Tp/2][hsv] (kept from the thread's previous head when that one had
   the same kv head) and q's row pairs [T][hp] (uint32), then the scores of a
   tile [SCORE_ROWS][T] (float) and bf16(P)'s rows [SCORE_ROWS][Tp/2]. */
static ALWAYS_INLINE void forward_head_body(int isa, const attention_call* a, int b, int h,
                                            int nb, int nh, float* scratch) {
    const int T = a->T, hs = a->hs, window = a->window, g = h / a->kv_mul;
    const size_t row = a->row, C = a->C;
    const bf16_sizes z = sizes_of(T, hs);
    const float* inp_b = inp_of(a, b);
    const float* q = inp_b + q_offset(a, h);
    float* out_bh = a->out + (size_t)b * T * C + (size_t)h * hs;
    float* stats_bh = a->stats_out + ((size_t)b * a->NH + h) * T * 2;
    const float slope = slope_of(a, h);
    const llmc_dropout drop = llmc_dropout_at(a->drop, b, (int64_t)h * T);
    uint32_t* kpanel = (uint32_t*)scratch;
    uint32_t* vpanel = kpanel + (size_t)z.hp * z.Tp;
    uint32_t* qpairs = vpanel + (size_t)z.Tp / 2 * z.hsv;
    float* s = (float*)(qpairs + (size_t)T * z.hp);
    uint32_t* ppairs = (uint32_t*)(s + (size_t)SCORE_ROWS * T);
    const size_t ldpp = (size_t)z.Tp / 2;
    if (!follows_its_kv_head(a, b, h)) {
        LLMC_ISA_SELECT_BF16(isa, key_panel)(kpanel, (size_t)z.Tp, inp_b + k_offset(a, g), row,
                                             T, hs);
        LLMC_ISA_SELECT_BF16(isa, value_panel)(vpanel, (size_t)z.hsv, inp_b + v_offset(a, g),
                                               row, T, hs);
    }
    for (int t = 0; t < T; t++) {
        prefetch_row(q, row, t + ROWS_AHEAD, T, hs);
        row_pairs(isa, qpairs + (size_t)t * z.hp, q + (size_t)t * row, 0, z.hp, 0, hs, 1.0f);
    }
    for (int t0 = 0; t0 < T; t0 += SCORE_ROWS) {
        const int R = T - t0 < SCORE_ROWS ? T - t0 : SCORE_ROWS;
        prefetch_forward(a, b, g, nb, nh, t0, R);
        LLMC_ISA_SELECT_BF16(isa, score_rows)(s, (size_t)T, qpairs + (size_t)t0 * z.hp,
                                              (size_t)z.hp, kpanel, (size_t)z.Tp, z.hn, R, t0 + 1,
                                              a->scale, slope, first_block_key(t0, window));
        const int p_first = first_row_pair(t0, window);
        const int p_last = (t0 + R + 31) / 32 * 16;   // whole vectors of pairs
        int lo[SCORE_ROWS], n[SCORE_ROWS];
        float maxval[SCORE_ROWS], inv[SCORE_ROWS];
        row_windows(lo, n, t0, R, window);
        softmax_tile_exps(isa, s, (size_t)T, lo, n, R, maxval, inv);
        for (int r = 0; r < R; r++) {
            const int t = t0 + r;
            float* s_row = s + (size_t)r * T;
            stats_bh[2 * (size_t)t] = maxval[r];
            stats_bh[2 * (size_t)t + 1] = inv[r];
            float scale = inv[r];   // P's normaliser, applied as P is rounded without dropout
            if (llmc_dropout_on(drop)) {
                scale_row(s_row + lo[r], n[r], inv[r]);
                llmc_dropout_row(s_row + lo[r], s_row + lo[r], lo[r], n[r], drop, t);
                scale = 1.0f;
            }
            row_pairs(isa, ppairs + (size_t)r * ldpp, s_row, p_first, p_last, lo[r], t + 1,
                      scale);
        }
        for (int r = 0; r < R; r += TILE_ROWS) {
            const int nr = R - r < TILE_ROWS ? R - r : TILE_ROWS;
            LLMC_ISA_SELECT_BF16(isa, value_rows)(out_bh + (size_t)(t0 + r) * C, C, 0,
                                                  ppairs + (size_t)r * ldpp, ldpp, vpanel,
                                                  (size_t)z.hsv, nr, first_pair(t0 + r, window),
                                                  end_pair(t0 + r + nr - 1), hs);
        }
    }
}
LLMC_ISA_VARIANTS_BF16(forward_head,
                       (const attention_call* a, int b, int h, int nb, int nh, float* scratch),
                       a, b, h, nb, nh, scratch)

/* The forward's scratch floats per thread. */
static size_t forward_scratch(int T, int hs) {
    const bf16_sizes z = sizes_of(T, hs);
    return (size_t)z.hp * z.Tp + (size_t)z.Tp / 2 * z.hsv + (size_t)T * z.hp
           + (size_t)SCORE_ROWS * T + (size_t)SCORE_ROWS * z.Tp / 2;
}

/* Query rows per block of the backward (as attention.c's). */
#define BACKWARD_ROWS 64

static int block_rows(int T) { return T < BACKWARD_ROWS ? T : BACKWARD_ROWS; }

/* The backward's scratch, carved per (b, kv head): uint32 panels and float
   blocks, each as in backward_group_body. */
typedef struct {
    uint32_t *kpanel, *vpanel, *kvalues, *qpairs, *dopairs, *qT, *doT, *dspairs, *ppairs,
        *dsrows, *rows_tmp;
    float *dkT, *dvT, *p, *ds;
} bf16_backward_scratch;

static size_t carve(bf16_backward_scratch* w, float* base, int T, int hs) {
    const bf16_sizes z = sizes_of(T, hs);
    const size_t BR = (size_t)block_rows(T), panel = (size_t)z.hp * z.Tp;
    const size_t counts[] = {panel, panel, (size_t)z.Tp / 2 * z.hsv, (size_t)T * z.hp,
                             (size_t)T * z.hp, (size_t)hs * z.Tq, (size_t)hs * z.Tq,
                             (BR + 1) / 2 * z.Tp, (BR + 1) / 2 * z.Tp, BR * z.Tp / 2,
                             (size_t)z.Tp / 2 * z.hsv, (size_t)hs * z.Tp, (size_t)hs * z.Tp,
                             BR * T, BR * T};
    void** slots[] = {(void**)&w->kpanel, (void**)&w->vpanel, (void**)&w->kvalues,
                      (void**)&w->qpairs, (void**)&w->dopairs, (void**)&w->qT, (void**)&w->doT,
                      (void**)&w->dspairs, (void**)&w->ppairs, (void**)&w->dsrows,
                      (void**)&w->rows_tmp, (void**)&w->dkT, (void**)&w->dvT, (void**)&w->p,
                      (void**)&w->ds};
    size_t used = 0;
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        if (base != NULL) { *slots[i] = base + used; }
        used += counts[i];
    }
    return used;
}

/* dk^T or dv^T [hs][ldo] of keys k0 .. k_end (multiples of 16) += over the
   row pairs of the block of rows from t0 (even) on, nj of them: a = x^T's
   [hs][lda] pairs of rows from the block's first pair on, b = [nj][ldb] the
   block's row pairs of dS or P. Keys from k on sum from the first pair with
   a row t >= k: the pairs before it are all 0 there (causal), terms that
   leave the sums unchanged (see the top), so they are left out. */
static ALWAYS_INLINE void transposed_rows_body(int isa, float* o, size_t ldo,
                                               const uint32_t* a, size_t lda, const uint32_t* b,
                                               size_t ldb, int t0, int nj, int k0, int k_end,
                                               int hs) {
    for (int c0 = 0; c0 < hs; c0 += SCORE_ROWS) {
        const int nr = hs - c0 < SCORE_ROWS ? hs - c0 : SCORE_ROWS;
        for (int k = k0; k < k_end; k += 32) {
            const int j0 = k > t0 ? (k - t0) / 2 : 0;   // its rows t0 + 2 j0 + 1 >= k
            if (j0 >= nj) { break; }
            vec16f acc[SCORE_ROWS * 2];
            const int NV = k_end - k > 16 ? 2 : 1;
            for (int r = 0; r < SCORE_ROWS; r++) {
                for (int v = 0; v < NV; v++) {
                    acc[r * NV + v] = r < nr ? load_part(o + (size_t)(c0 + r) * ldo + k + 16 * v,
                                                         16)
                                             : (vec16f){0};
                }
            }
            if (NV == 2) {
                dp_tile(isa, acc, SCORE_ROWS, 2, a + (size_t)c0 * lda, lda, nr, b + k, ldb, j0,
                        nj);
            } else {
                dp_tile(isa, acc, SCORE_ROWS, 1, a + (size_t)c0 * lda, lda, nr, b + k, ldb, j0,
                        nj);
            }
            for (int r = 0; r < nr; r++) {
                for (int v = 0; v < NV; v++) {
                    store_part(o + (size_t)(c0 + r) * ldo + k + 16 * v, acc[r * NV + v], 16);
                }
            }
        }
    }
}
LLMC_ISA_VARIANTS_BF16(transposed_rows, (float* o, size_t ldo, const uint32_t* a, size_t lda,
                                         const uint32_t* b, size_t ldb, int t0, int nj, int k0,
                                         int k_end, int hs),
                       o, ldo, a, lda, b, ldb, t0, nj, k0, k_end, hs)

/* dst[t][c] += src[c][t] for t < n, c < hs (rows of dst ldd floats apart,
   of src lds), 16 x 16 blocks at a time; written: dst[t][c] = 0 + src[c][t]
   (the sign of a zero as in the sum into zeros), dst not read. */
static ALWAYS_INLINE void add_transposed_body(float* dst, size_t ldd, const float* src, size_t lds,
                                              int n, int hs, int written) {
    for (int t0 = 0; t0 < n; t0 += 16) {
        for (int c0 = 0; c0 < hs; c0 += 16) {
            const int nc = hs - c0 < 16 ? hs - c0 : 16, nt = n - t0 < 16 ? n - t0 : 16;
            vec16f r[16];
            for (int cc = 0; cc < 16; cc++) {
                r[cc] = cc < nc ? load_part(src + (size_t)(c0 + cc) * lds + t0, nt) : (vec16f){0};
            }
            llmc_transpose16(r);   // r[j] lane cc: src[c0 + cc][t0 + j]
            for (int j = 0; j < nt; j++) {
                float* d = dst + (size_t)(t0 + j) * ldd + c0;
                const vec16f before = written ? (vec16f){0} : load_part(d, nc);
                store_part(d, before + r[j], nc);
            }
        }
    }
}
LLMC_ISA_VARIANTS(add_transposed, (float* dst, size_t ldd, const float* src, size_t lds, int n,
                                   int hs, int written),
                  dst, ldd, src, lds, n, hs, written)

/* The backward of one (b, kv head g): its query heads in order, each in
   blocks of BACKWARD_ROWS rows; per tile of rows, P (recomputed), dP, dS and
   dq as in attention.c (each row's dq one sum, from 0 when written); per
   block, dk^T and dv^T from its row pairs; at the end, dk and dv added to
   dinp (written into it when written). */
static ALWAYS_INLINE void backward_group_body(int isa, const attention_call* a, int b, int g,
                                              int nb, int ng, float* scratch) {
    const int T = a->T, hs = a->hs, window = a->window, kv_mul = a->kv_mul;
    const size_t row = a->row, C = a->C, k_head = k_offset(a, g), v_head = v_offset(a, g);
    const bf16_sizes z = sizes_of(T, hs);
    const size_t Tp = (size_t)z.Tp, ldrow = Tp / 2;
    const float scale = a->scale;
    const float* inp_b = inp_of(a, b);
    float* dinp_b = a->out + (size_t)b * T * row;
    bf16_backward_scratch w;
    carve(&w, scratch, T, hs);
    LLMC_ISA_SELECT_BF16(isa, key_panel)(w.kpanel, Tp, inp_b + k_head, row, T, hs);
    LLMC_ISA_SELECT_BF16(isa, key_panel)(w.vpanel, Tp, inp_b + v_head, row, T, hs);
    LLMC_ISA_SELECT_BF16(isa, value_panel)(w.kvalues, (size_t)z.hsv, inp_b + k_head, row, T, hs);
    memset(w.dkT, 0, (size_t)hs * Tp * sizeof(float));
    memset(w.dvT, 0, (size_t)hs * Tp * sizeof(float));
    for (int h = g * kv_mul; h < (g + 1) * kv_mul; h++) {
        const backward_head hd = backward_head_of(a, b, h);
        for (int t = 0; t < T; t++) {
            prefetch_row(hd.q, row, t + ROWS_AHEAD, T, hs);
            prefetch_row(hd.dout, C, t + ROWS_AHEAD, T, hs);
            row_pairs(isa, w.qpairs + (size_t)t * z.hp, hd.q + (size_t)t * row, 0, z.hp, 0, hs,
                      1.0f);
            row_pairs(isa, w.dopairs + (size_t)t * z.hp, hd.dout + (size_t)t * C, 0, z.hp, 0,
                      hs, 1.0f);
        }
        // q^T and dO^T by row pairs: the value panels of q and dO, transposed
        LLMC_ISA_SELECT_BF16(isa, value_panel)(w.rows_tmp, (size_t)z.hsv, hd.q, row, T, hs);
        LLMC_ISA_SELECT(isa, transpose_pairs)(w.qT, (size_t)z.Tq, w.rows_tmp, (size_t)z.hsv,
                                              (T + 1) / 2, hs);
        LLMC_ISA_SELECT_BF16(isa, value_panel)(w.rows_tmp, (size_t)z.hsv, hd.dout, C, T, hs);
        LLMC_ISA_SELECT(isa, transpose_pairs)(w.doT, (size_t)z.Tq, w.rows_tmp, (size_t)z.hsv,
                                              (T + 1) / 2, hs);
        for (int t0 = 0; t0 < T; t0 += BACKWARD_ROWS) {
            const int t1 = T - t0 < BACKWARD_ROWS ? T : t0 + BACKWARD_ROWS;
            const int k_block = first_block_key(t0, window);
            const int k_end = (t1 + 15) / 16 * 16;
            for (int t = t0; t < t1; t += SCORE_ROWS) {
                const int R = t1 - t < SCORE_ROWS ? t1 - t : SCORE_ROWS;
                prefetch_backward(a, nb, ng, h - g * kv_mul, t, R);
                float* p_t = w.p + (size_t)(t - t0) * T;
                float* ds_t = w.ds + (size_t)(t - t0) * T;
                const int k_first = first_block_key(t, window);
                LLMC_ISA_SELECT_BF16(isa, score_rows)(p_t, (size_t)T, w.qpairs + (size_t)t * z.hp,
                                                      (size_t)z.hp, w.kpanel, Tp, z.hn, R, t + 1,
                                                      scale, hd.slope, k_first);
                LLMC_ISA_SELECT_BF16(isa, score_rows)(ds_t, (size_t)T,
                                                      w.dopairs + (size_t)t * z.hp, (size_t)z.hp,
                                                      w.vpanel, Tp, z.hn, R, t + 1, 1.0f, 0.0f,
                                                      k_first);
                const int p_first = first_row_pair(t, window), p_last = (t + R + 31) / 32 * 16;
                int lo[SCORE_ROWS], n[SCORE_ROWS];
                row_windows(lo, n, t, R, window);
                for (int r = 0; r < R; r++) {
                    float* ds_row = ds_t + (size_t)r * T;
                    LLMC_ISA_SELECT(isa, probs_row)(p_t + (size_t)r * T + lo[r], n[r],
                                                    hd.stats + 2 * (size_t)(t + r));
                    if (llmc_dropout_on(hd.drop)) {
                        llmc_dropout_row(ds_row + lo[r], ds_row + lo[r], lo[r], n[r], hd.drop,
                                         t + r);
                    }
                }
                dscore_tile(ds_t, p_t, (size_t)T, lo, n, R, scale);
                for (int r = 0; r < R; r++) {
                    float* p_row = p_t + (size_t)r * T;
                    if (llmc_dropout_on(hd.drop)) {
                        llmc_dropout_row(p_row + lo[r], p_row + lo[r], lo[r], n[r], hd.drop, t + r);
                    }
                    row_pairs(isa, w.dsrows + (size_t)(t - t0 + r) * ldrow, ds_t + (size_t)r * T,
                              p_first, p_last, lo[r], t + r + 1, 1.0f);
                }
                for (int r = 0; r < R; r += TILE_ROWS) {
                    const int nr = R - r < TILE_ROWS ? R - r : TILE_ROWS;
                    LLMC_ISA_SELECT_BF16(isa, value_rows)(
                        hd.dq + (size_t)(t + r) * row, row, !a->written,
                        w.dsrows + (size_t)(t - t0 + r) * ldrow, ldrow, w.kvalues, (size_t)z.hsv,
                        nr, first_pair(t + r, window), end_pair(t + r + nr - 1), hs);
                }
            }
            // the block's row pairs of dS and P over its keys, each row's
            // keys outside [lo, t] as 0
            const int nj = (t1 - t0 + 1) / 2;
            for (int j = 0; j < nj; j++) {
                const int ta = t0 + 2 * j, tb = ta + 1;
                const float* pa = w.p + (size_t)(ta - t0) * T;
                const float* dsa = w.ds + (size_t)(ta - t0) * T;
                const int lo_a = first_key(ta, window), lo_b = first_key(tb, window);
                for (int k = k_block; k < k_end; k += 16) {
                    const int hi_b = tb < t1 ? tb + 1 : 0;   // a padding row: all 0
                    vec16f p_b = load_between(pa + T, k, lo_b, hi_b);
                    vec16f ds_b = load_between(dsa + T, k, lo_b, hi_b);
                    store_zipped(isa, w.ppairs + (size_t)j * Tp + k,
                                 load_between(pa, k, lo_a, ta + 1), p_b);
                    store_zipped(isa, w.dspairs + (size_t)j * Tp + k,
                                 load_between(dsa, k, lo_a, ta + 1), ds_b);
                }
            }
            LLMC_ISA_SELECT_BF16(isa, transposed_rows)(w.dkT, Tp, w.qT + t0 / 2, (size_t)z.Tq,
                                                       w.dspairs, Tp, t0, nj, k_block, k_end, hs);
            LLMC_ISA_SELECT_BF16(isa, transposed_rows)(w.dvT, Tp, w.doT + t0 / 2, (size_t)z.Tq,
                                                       w.ppairs, Tp, t0, nj, k_block, k_end, hs);
        }
    }
    LLMC_ISA_SELECT(isa, add_transposed)(dinp_b + k_head, row, w.dkT, Tp, T, hs, a->written);
    LLMC_ISA_SELECT(isa, add_transposed)(dinp_b + v_head, row, w.dvT, Tp, T, hs, a->written);
}
LLMC_ISA_VARIANTS_BF16(backward_group,
                       (const attention_call* a, int b, int g, int nb, int ng, float* scratch),
                       a, b, g, nb, ng, scratch)

int attention_gqa_forward_bf16(float* out, float* stats, const float* inp, const float* slopes,
                               int B, int T, int NH, int NKV, int hs, int window, float dropout,
                               uint64_t seed) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, stats, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    attention_call a = attention_call_of(inp, slopes, B, T, NH, NKV, hs, window,
                                         llmc_dropout_of(dropout, seed));
    a.out = out;
    a.stats_out = stats;
    return llmc_attention_heads(&a, NH, forward_scratch(T, hs),
                                LLMC_ISA_SELECT_BF16(llmc_get_isa(), forward_head));
}

int attention_gqa_backward_bf16(float* dinp, const float* dout, const float* inp,
                                const float* stats, const float* slopes, int B, int T, int NH,
                                int NKV, int hs, int window, float dropout, uint64_t seed,
                                int written) {
    LLMC_REQUIRE(LLMC_NONNULL4(dinp, dout, inp, stats), LLMC_ERR_NULL);
    LLMC_REQUIRE(gqa_sizes_ok(B, T, NH, NKV, hs, window), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_dropout_valid(dropout), LLMC_ERR_VALUE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    attention_call a = attention_call_of(inp, slopes, B, T, NH, NKV, hs, window,
                                         llmc_dropout_of(dropout, seed));
    a.out = dinp;
    a.written = written;
    a.dout = dout;
    a.stats = stats;
    return llmc_attention_heads(&a, NKV, carve(&(bf16_backward_scratch){0}, NULL, T, hs),
                                LLMC_ISA_SELECT_BF16(llmc_get_isa(), backward_group));
}
