/*
 * Dropout's masks (private), shared by dropout.c's element-wise kernels and
 * the attention kernels' dropout on the probabilities.
 *
 * No mask is ever stored: whether an element survives is a hash of its
 * indices, so the backward regenerates the forward's mask, and the mask is
 * the same for any thread count, tiling or instruction set. A tensor seen as
 * [B, R, N] (batch rows, rows, columns) under a 64-bit seed:
 *   row key of (b, r)  llmc_dropout_key(llmc_dropout_key(seed, b), r)
 *   element (b, r, n)  survives when the top 24 bits of the 32-bit hash of
 *                      (row key, n) are below keep_below = ceil((1 - p) 2^24),
 *                      that is with probability 1 - p (to 2^-24), and is then
 *                      scaled by 1 / (1 - p) (inverted dropout, as PyTorch's)
 * llmc_dropout_key(key, i) is splitmix64's i-th output from state key, so
 * llmc_dropout_key(seed + b0 * LLMC_DROPOUT_STEP, b) equals
 * llmc_dropout_key(seed, b0 + b): a caller holding rows b0 .. of a larger
 * batch passes that seed and gets those rows' masks.
 */
#ifndef LLMC_DROPOUT_H
#define LLMC_DROPOUT_H

#include "common.h"

#define LLMC_DROPOUT_STEP 0x9E3779B97F4A7C15ull   /* splitmix64's increment */

/* One dropout: its test and scale (from p), its seed, and the rows it is at
   (llmc_dropout_at). */
typedef struct {
    uint32_t keep_below;   /* 2^24 when p == 0: every element survives */
    float scale;           /* 1 / (1 - p) */
    uint64_t seed;
    uint64_t key;          /* the key of the batch row being worked on */
    int64_t first_row;     /* the row index of its first row */
} llmc_dropout;

typedef uint32_t vec16u __attribute__((vector_size(64)));

/* p is a dropout probability: in [0, 1) (NaN is not). */
static inline int llmc_dropout_valid(float p) { return p >= 0.0f && p < 1.0f; }

static inline llmc_dropout llmc_dropout_of(float p, uint64_t seed) {
    const llmc_dropout d = {(uint32_t)ceil((1.0 - (double)p) * 16777216.0), 1.0f / (1.0f - p),
                            seed, 0, 0};
    return d;
}

/* Some element can be dropped (p > 0 after rounding to 24 bits). */
static inline int llmc_dropout_on(llmc_dropout d) { return d.keep_below < (1u << 24); }

static LLMC_ALWAYS_INLINE uint64_t llmc_dropout_key(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * LLMC_DROPOUT_STEP;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* d at batch row b, its rows counted from first_row. */
static inline llmc_dropout llmc_dropout_at(llmc_dropout d, int64_t b, int64_t first_row) {
    d.key = llmc_dropout_key(d.seed, (uint64_t)b);
    d.first_row = first_row;
    return d;
}

/* The 32 bits a row key gives every column (lanes of a vector, or one). */
static LLMC_ALWAYS_INLINE uint32_t llmc_dropout_row_bits(llmc_dropout d, int64_t row) {
    const uint64_t key = llmc_dropout_key(d.key, (uint64_t)(d.first_row + row));
    return (uint32_t)key ^ (uint32_t)(key >> 32);
}

/* murmur3's finaliser of (row bits, column): lanes hold columns. */
static LLMC_ALWAYS_INLINE vec16u llmc_dropout_hash16(uint32_t row_bits, vec16u col) {
    vec16u h = row_bits ^ (col * 0x9E3779B9u);
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

/* out[0 .. n) = inp[0 .. n), columns col0 .. col0 + n - 1 of row `row`, with
   the row's mask (out may be inp): each element times scale if it
   survives, else 0. */
static LLMC_ALWAYS_INLINE void llmc_dropout_row(float* out, const float* inp, int col0, int n,
                                                llmc_dropout d, int64_t row) {
    const uint32_t bits = llmc_dropout_row_bits(d, row);
    const vec16u lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int c0 = 0; c0 < n; c0 += 16) {
        const int m = n - c0 < 16 ? n - c0 : 16;
        const vec16u h = llmc_dropout_hash16(bits, lane + (uint32_t)(col0 + c0));
        const vec16i keep = LLMC_CMP16(h >> 8, <, (vec16u){0} + d.keep_below);
        const vec16f x = llmc_load16(inp + c0, m);
        llmc_store16(out + c0, llmc_select16(keep, x * d.scale, (vec16f){0}), m);
    }
}

/* One element of llmc_dropout_row: x at column col of a row whose
   llmc_dropout_row_bits are bits (for the plain loops). */
static inline float llmc_dropout_one(float x, uint32_t bits, int col, llmc_dropout d) {
    const vec16u h = llmc_dropout_hash16(bits, (vec16u){0} + (uint32_t)col);
    return (h[0] >> 8) < d.keep_below ? x * d.scale : 0.0f;
}

#endif
