/* Private helpers shared by the kernel files; not part of the API. */
#ifndef LLMC_COMMON_H
#define LLMC_COMMON_H

#include <math.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline void omp_set_num_threads(int n) { (void)n; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

/* Inlined wherever called, also into a function built for another
   instruction set (isa.h): the vector helpers below are all of this kind. */
#define LLMC_ALWAYS_INLINE inline __attribute__((always_inline))

/* Early return with a status; use before any OpenMP region (a parallel
   region cannot be left with return). */
#define LLMC_REQUIRE(cond, status) \
    do { if (!(cond)) { return (status); } } while (0)

/* True when every listed pointer is non-NULL. */
#define LLMC_NONNULL2(a, b) ((a) != NULL && (b) != NULL)
#define LLMC_NONNULL3(a, b, c) (LLMC_NONNULL2(a, b) && (c) != NULL)
#define LLMC_NONNULL4(a, b, c, d) (LLMC_NONNULL2(a, b) && LLMC_NONNULL2(c, d))

/* The most floats one array can hold: its size in bytes must fit a ptrdiff_t. */
#define LLMC_MAX_COUNT ((size_t)PTRDIFF_MAX / sizeof(float))

/* True if an array of a*b*c*d floats can exist: the product neither wraps in
   size_t nor exceeds LLMC_MAX_COUNT. Takes sizes already checked positive;
   pass 1 for unused factors. Sizes that fail this cannot describe real
   arrays, so the kernels return LLMC_ERR_SHAPE before touching memory. */
static inline int llmc_count_fits(size_t a, size_t b, size_t c, size_t d) {
    size_t ab, abc, abcd;
    return !__builtin_mul_overflow(a, b, &ab) && !__builtin_mul_overflow(ab, c, &abc)
           && !__builtin_mul_overflow(abc, d, &abcd) && abcd <= LLMC_MAX_COUNT;
}

/* Elements (or rows times their length) below which a forward kernel runs
   on the calling thread alone (LLMC_SHARES): a parallel region's fork and
   join (about a microsecond on 2 threads, a scheduler's time slice on a
   loaded machine) cost more than a share of so little work saves. One
   decoding position's rows (C, FF, the heads of a few rows) stay below it.
   Results do not depend on it: each row or element is computed alike on
   any thread. */
#define LLMC_PARALLEL_MIN 16384

/* Inside a parallel region: the calling thread's contiguous share
   [*lo, *hi) of n items, as schedule(static) would hand them out. For
   element-wise kernels, which call their per-ISA function once per thread. */
static inline void llmc_thread_share(int64_t n, int64_t* lo, int64_t* hi) {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t q = n / nt, r = n % nt;
    *lo = id * q + (id < r ? id : r);
    *hi = *lo + q + (id < r ? 1 : 0);
}

/* Runs the statements `...` on [lo, hi) shares of n items: each thread of
   a parallel region its share (llmc_thread_share), or, when `work`
   (elements) is below LLMC_PARALLEL_MIN, the calling thread all of [0, n)
   without opening a region (even a one-thread region costs libgomp a team
   and a futex call: about half a microsecond). */
#define LLMC_SHARES(n, work, lo, hi, ...)                                   \
    do {                                                                    \
        if ((work) < LLMC_PARALLEL_MIN) {                                   \
            const int64_t lo = 0, hi = (n);                                 \
            __VA_ARGS__                                                     \
        } else {                                                            \
            _Pragma("omp parallel")                                         \
            {                                                               \
                int64_t lo, hi;                                             \
                llmc_thread_share((n), &lo, &hi);                           \
                __VA_ARGS__                                                 \
            }                                                               \
        }                                                                   \
    } while (0)

/* x rounded to the nearest bf16 (the upper half of a float32), ties to
   even; a NaN stays a quiet NaN. Branch-free, so loops over it vectorise. */
static LLMC_ALWAYS_INLINE uint16_t llmc_bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* The float32 of a bf16 number (exact). */
static LLMC_ALWAYS_INLINE float llmc_bf16_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* What a backward adds its gradient onto: *dinp (+=), or 0 when dinp is
   written (the sum 0 + g, so bitwise a zeroed dinp's result, -0 turned +0);
   written is loop-invariant, so the compiler keeps a loop per case. */
static LLMC_ALWAYS_INLINE float llmc_grad_start(const float* dinp, int written) {
    return written ? 0.0f : *dinp;
}

/* Index of the first id outside [0, V) of ids[0 .. n), or -1 if all are in
   range (token ids and targets). */
static inline int64_t llmc_first_bad_index(const int* ids, int64_t n, int V) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= V) { return i; }
    }
    return -1;
}

/* As llmc_first_bad_index, for targets: LLMC_IGNORE_INDEX is allowed too. */
static inline int64_t llmc_first_bad_target(const int* ids, int64_t n, int V) {
    for (int64_t i = 0; i < n; i++) {
        if ((ids[i] < 0 || ids[i] >= V) && ids[i] != LLMC_IGNORE_INDEX) { return i; }
    }
    return -1;
}

/* Elements per chunk of a chunked reduction. Fixed, so a sum is split the
   same way whatever the thread count, and its result never changes. */
#define LLMC_REDUCE_CHUNK 16384

/*
 * Column sums over many rows (colsum.c), for matmul_backward's dbias and the
 * norms' dweight and dbias:
 *   dweight[i] += sum_bt dout[bt,i] * ((inp[bt,i] - mean[bt]) * rstd[bt])
 *   dbias[i]   += sum_bt dout[bt,i]
 *
 *   dweight [C]      (+=) or NULL: not wanted (then inp, mean, rstd are not read)
 *   dbias   [C]      (+=) or NULL: not wanted
 *   dout    [BT, C]
 *   inp     [BT, C]
 *   mean    [BT] or NULL: 0 (RMSNorm)
 *   rstd    [BT]
 * Summed in chunks of rows fixed by BT alone, each chunk's rows in order
 * into a partial row, then the chunks in order: the result never depends on
 * the thread count. Returns LLMC_OK or LLMC_ERR_NOMEM.
 */
int llmc_column_sums(float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* mean, const float* rstd, int64_t BT, int C);

/* 16 floats / 16 int32s: one zmm register with -march=native on AVX-512;
   GCC and clang lower them to narrower vectors elsewhere. */
typedef float vec16f __attribute__((vector_size(64)));
typedef int32_t vec16i __attribute__((vector_size(64)));

/* (a op b) lane by lane as a vec16i mask (lanes -1 or 0), for a and b
   64-byte vectors of one type (vec16f, vec16i, llmc_vec16u, vec16u). Unless
   the build's flags have AVX-512, GCC 12 compiles a comparison of two
   64-byte vectors one lane at a time in scalar code (a compare, a set and
   a move each), which made llmc_exp_nonpositive16 about 10x slower on AVX2
   (Zen 1: the classifier's softmax, the MLP's gates, attention's softmax);
   compared in 32-byte halves, each half is one vector compare on AVX2. */
typedef int32_t llmc_vec8i __attribute__((vector_size(32)));
#ifdef __AVX512F__
#define LLMC_CMP16(a, op, b) ((vec16i)((a) op (b)))
#else
#define LLMC_CMP16(a, op, b) __extension__({                                           \
    const __typeof__(a) llmc_a_ = (a), llmc_b_ = (b);                                 \
    typedef __typeof__(llmc_a_[0] + 0) llmc_half_ __attribute__((vector_size(32)));   \
    llmc_half_ llmc_a0_, llmc_a1_, llmc_b0_, llmc_b1_;                                \
    memcpy(&llmc_a0_, &llmc_a_, 32);                                                  \
    memcpy(&llmc_a1_, (const char*)&llmc_a_ + 32, 32);                                \
    memcpy(&llmc_b0_, &llmc_b_, 32);                                                  \
    memcpy(&llmc_b1_, (const char*)&llmc_b_ + 32, 32);                                \
    const llmc_vec8i llmc_m0_ = (llmc_vec8i)(llmc_a0_ op llmc_b0_);                   \
    const llmc_vec8i llmc_m1_ = (llmc_vec8i)(llmc_a1_ op llmc_b1_);                   \
    vec16i llmc_mask_;                                                                \
    memcpy(&llmc_mask_, &llmc_m0_, 32);                                               \
    memcpy((char*)&llmc_mask_ + 32, &llmc_m1_, 32);                                   \
    llmc_mask_;                                                                       \
})
#endif

/* mask ? a : b, lane by lane (mask lanes are -1 or 0, as comparisons give). */
static LLMC_ALWAYS_INLINE vec16f llmc_select16(vec16i mask, vec16f a, vec16f b) {
    return (vec16f)(((vec16i)a & mask) | ((vec16i)b & ~mask));
}

/* e^(x - n ln2) for x within ln2/2 of n ln2 (n a whole number, as a float):
   the reduction in two parts (0.693359375 is exact in few bits), then
   Cephes' degree-6 polynomial for e^r, |r| <= ln2/2; x and nf vectors of
   type T (llmc_exp_reduced16's and the exponentials' parts below). */
#define LLMC_EXP_REDUCED(T, x, nf) __extension__({                          \
    T llmc_r_ = (x) - (nf) * 0.693359375f;                                    \
    llmc_r_ = llmc_r_ + (nf) * 2.12194440e-4f;                                \
    T llmc_p_ = (T){0} + 1.9875691500e-4f;                                    \
    llmc_p_ = llmc_p_ * llmc_r_ + 1.3981999507e-3f;                           \
    llmc_p_ = llmc_p_ * llmc_r_ + 8.3334519073e-3f;                           \
    llmc_p_ = llmc_p_ * llmc_r_ + 4.1665795894e-2f;                           \
    llmc_p_ = llmc_p_ * llmc_r_ + 1.6666665459e-1f;                           \
    llmc_p_ = llmc_p_ * llmc_r_ + 5.0000001201e-1f;                           \
    llmc_p_ * llmc_r_ * llmc_r_ + llmc_r_ + 1.0f;                             \
})
static LLMC_ALWAYS_INLINE vec16f llmc_exp_reduced16(vec16f x, vec16f nf) {
    return LLMC_EXP_REDUCED(vec16f, x, nf);
}

/* llmc_exp_reduced16 through pointers, for a caller built for another
   instruction set (isa.h): a vector passed by value across that boundary
   changes the ABI, which clang refuses */
static LLMC_ALWAYS_INLINE void llmc_exp_reduced16_at(vec16f* p, const vec16f* x,
                                                    const vec16f* nf) {
    *p = llmc_exp_reduced16(*x, *nf);
}

/* The exponentials below work on parts of their 16 lanes: all of them with
   AVX-512 in the build's flags, else halves of 8 (one ymm register on
   AVX2), one after the other. On whole 16-lane vectors GCC 12 kept the
   steps' values on the stack and moved them through general registers
   (the classifier's softmax 2x slower on Zen 1); per lane the operations
   are the same. */
#ifdef __AVX512F__
typedef vec16f llmc_exp_part;
typedef vec16i llmc_exp_ipart;
#else
typedef float llmc_exp_part __attribute__((vector_size(32)));
typedef int32_t llmc_exp_ipart __attribute__((vector_size(32)));
#endif
#define LLMC_EXP_PARTS (sizeof(vec16f) / sizeof(llmc_exp_part))

/* mask ? a : b, lane by lane, on parts. */
static LLMC_ALWAYS_INLINE llmc_exp_part llmc_exp_select(llmc_exp_ipart mask, llmc_exp_part a,
                                                        llmc_exp_part b) {
    return (llmc_exp_part)(((llmc_exp_ipart)a & mask) | ((llmc_exp_ipart)b & ~mask));
}

/* llmc_exp16 on one part. */
static LLMC_ALWAYS_INLINE llmc_exp_part llmc_exp_of_part(llmc_exp_part x) {
    const llmc_exp_part zero = {0};
    const float hi = 88.72283f, lo = -87.3365478515625f;
    const llmc_exp_ipart too_big = (llmc_exp_ipart)(x > zero + hi);
    const llmc_exp_ipart too_small = (llmc_exp_ipart)(x < zero + lo);
    const llmc_exp_ipart nan = (llmc_exp_ipart)(x != x);
    llmc_exp_part xc = llmc_exp_select(too_big, zero + hi, x);
    xc = llmc_exp_select(too_small, zero + lo, xc);
    xc = llmc_exp_select(nan, zero, xc);
    // n = floor(x / ln2 + 0.5): truncate, then step down where that rounded up
    const llmc_exp_part t = xc * 1.44269504088896341f + 0.5f;
    llmc_exp_ipart n = __builtin_convertvector(t, llmc_exp_ipart);
    n += (llmc_exp_ipart)(__builtin_convertvector(n, llmc_exp_part) > t);   // true lanes are -1
    const llmc_exp_part nf = __builtin_convertvector(n, llmc_exp_part);
    const llmc_exp_part p = LLMC_EXP_REDUCED(llmc_exp_part, xc, nf);
    // times 2^n, in two halves so that n = 128 (x near hi) still fits
    const llmc_exp_ipart half1 = ((n >> 1) + 127) << 23;
    const llmc_exp_ipart half2 = ((n - (n >> 1)) + 127) << 23;
    llmc_exp_part result = p * (llmc_exp_part)half1 * (llmc_exp_part)half2;
    result = llmc_exp_select(too_big, zero + INFINITY, result);
    result = llmc_exp_select(too_small, zero, result);
    return llmc_exp_select(nan, x, result);
}

/* llmc_exp_nonpositive16 on one part. */
static LLMC_ALWAYS_INLINE llmc_exp_part llmc_exp_nonpositive_of_part(llmc_exp_part x) {
    const llmc_exp_part zero = {0};
    const float lo = -87.3365478515625f;
    const llmc_exp_ipart too_small = (llmc_exp_ipart)(x < zero + lo);
    const llmc_exp_ipart nan = (llmc_exp_ipart)(x != x);
    const llmc_exp_part xc = llmc_exp_select(too_small | nan, zero, x);
    // n = floor(x / ln2 + 0.5), as llmc_exp16 takes it
    const llmc_exp_part t = xc * 1.44269504088896341f + 0.5f;
    llmc_exp_ipart n = __builtin_convertvector(t, llmc_exp_ipart);
    n += (llmc_exp_ipart)(__builtin_convertvector(n, llmc_exp_part) > t);   // true lanes are -1
    const llmc_exp_part p = LLMC_EXP_REDUCED(llmc_exp_part, xc,
                                             __builtin_convertvector(n, llmc_exp_part));
    const llmc_exp_part result = p * (llmc_exp_part)((n + 127) << 23);
    return llmc_exp_select(nan, x, llmc_exp_select(too_small, zero, result));
}

/*
 * exp(x) on 16 lanes in plain vector arithmetic (libm's expf does not
 * vectorise without -ffast-math). Cody-Waite range reduction x = n ln2 + r,
 * |r| <= ln2/2, then Cephes' degree-6 polynomial for e^r. Within 2 ulp of
 * exp on [-87.3, 88.7]; below that 0, above +inf; NaN stays NaN.
 */
static LLMC_ALWAYS_INLINE vec16f llmc_exp16(vec16f x) {
    llmc_exp_part part[LLMC_EXP_PARTS];
    memcpy(part, &x, sizeof part);
    for (size_t i = 0; i < LLMC_EXP_PARTS; i++) { part[i] = llmc_exp_of_part(part[i]); }
    memcpy(&x, part, sizeof x);
    return x;
}

/* exp(x) for x <= 0, -inf or NaN, as a softmax takes it (a score minus its
   row's max): bitwise llmc_exp16 there, with the steps only x > 0 needs left
   out (a lane with x > 0 gets garbage: callers drop such lanes). Below
   -87.34 (lo) llmc_exp16 gives 0, so n >= -126 and 2^n is one normal
   float: p * 2^n rounds once, as llmc_exp16's two exact halves do. */
static LLMC_ALWAYS_INLINE vec16f llmc_exp_nonpositive16(vec16f x) {
    llmc_exp_part part[LLMC_EXP_PARTS];
    memcpy(part, &x, sizeof part);
    for (size_t i = 0; i < LLMC_EXP_PARTS; i++) { part[i] = llmc_exp_nonpositive_of_part(part[i]); }
    memcpy(&x, part, sizeof x);
    return x;
}

/* Loads min(n, 16) floats into a vector, zero-filling the rest; stores
   min(n, 16) back. A whole vector is a constant-size copy, which compiles to
   one vector load or store; only a partial one (a tail) calls memcpy. */
static LLMC_ALWAYS_INLINE vec16f llmc_load16(const float* p, int n) {
    vec16f v = {0};
    if (n >= 16) { memcpy(&v, p, sizeof v); }
    else { memcpy(&v, p, (size_t)n * sizeof(float)); }
    return v;
}
static LLMC_ALWAYS_INLINE void llmc_store16(float* p, vec16f v, int n) {
    if (n >= 16) { memcpy(p, &v, sizeof v); }
    else { memcpy(p, &v, (size_t)n * sizeof(float)); }
}

/* llmc_store16 of an output that is float32, or bf16 (out_bf16): the lanes
   rounded as llmc_bf16_round does, into out[i .. i + min(n, 16)). */
typedef uint32_t llmc_vec16u __attribute__((vector_size(64)));
typedef uint16_t llmc_vec16h __attribute__((vector_size(32)));
static LLMC_ALWAYS_INLINE void llmc_store16_as(void* out, int out_bf16, int64_t i, vec16f v,
                                               int n) {
    if (!out_bf16) {
        llmc_store16((float*)out + i, v, n);
        return;
    }
    const llmc_vec16u u = (llmc_vec16u)v;
    const llmc_vec16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const llmc_vec16u quiet_nan = (u >> 16) | 0x40u;
    const llmc_vec16u is_nan = (llmc_vec16u)LLMC_CMP16(u & 0x7fffffffu, >,
                                                      (llmc_vec16u){0} + 0x7f800000u);
    const llmc_vec16h h = __builtin_convertvector((rounded & ~is_nan) | (quiet_nan & is_nan),
                                                  llmc_vec16h);
    if (n >= 16) {   // a constant size: one vector store, not a call
        memcpy((uint16_t*)out + i, &h, sizeof h);
    } else {
        memcpy((uint16_t*)out + i, &h, (size_t)n * sizeof(uint16_t));
    }
}

/* A mask whose first n lanes are set. */
static LLMC_ALWAYS_INLINE vec16i llmc_lanes_below(int n) {
    const vec16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return LLMC_CMP16(lane, <, (vec16i){0} + n);
}

/* The sum of a vector's 16 lanes, added in a fixed order. */
static LLMC_ALWAYS_INLINE float llmc_hsum16(vec16f v) {
    float sum = 0.0f;
    for (int i = 0; i < 16; i++) { sum += v[i]; }
    return sum;
}

/* sum_i a[i] * b[i] over n floats: 16 lanes at a time, then the lanes in
   order. The order is fixed by n alone, so the result is reproducible. */
static LLMC_ALWAYS_INLINE float llmc_dot(const float* a, const float* b, int n) {
    vec16f acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) { acc += llmc_load16(a + i, 16) * llmc_load16(b + i, 16); }
    if (i < n) { acc += llmc_load16(a + i, n - i) * llmc_load16(b + i, n - i); }
    return llmc_hsum16(acc);
}

/* Two-source shuffle of vec16f: lane i of the result is lane idx[i] of a
   then b (0..31). GCC 12+ and clang have __builtin_shufflevector; older GCC
   only __builtin_shuffle, with the indices as a vector. LLMC_SHUF_T is the
   same for any vector type, with itype the int vector type of its width
   (what older GCC needs for the indices). */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LLMC_SHUF_T(itype, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef LLMC_SHUF_T
#define LLMC_SHUF_T(itype, a, b, ...) __builtin_shuffle(a, b, (itype){__VA_ARGS__})
#endif
#define LLMC_SHUF(a, b, ...) LLMC_SHUF_T(vec16i, a, b, __VA_ARGS__)

/* Transposes a 16 x 16 block in place: r[c][j] becomes the old r[j][c].
   Two ways, bitwise the same (the bits only move):
   llmc_transpose16_wide: four rounds of two-source shuffles of whole
     vectors (32-bit pairs, 64-bit pairs, then 128-bit quarters twice), for
     code built for AVX-512;
   llmc_transpose16_quarters: 16 transposes of 4 x 4 (16-byte vectors:
     unpcklps, unpckhps, movlhps, shufps on SSE and AVX2 alike), elsewhere:
     there GCC 12 lowers the 64-byte shuffles to one scalar move a lane
     (~500 movss).
   llmc_transpose16 is the one the build's flags suit; a body built per
   instruction set picks by its isa (llmc_transpose16_isa, isa.h). */
typedef float llmc_vec4f __attribute__((vector_size(16)));
typedef int32_t llmc_vec4i __attribute__((vector_size(16)));
#define LLMC_SHUF4(a, b, ...) LLMC_SHUF_T(llmc_vec4i, a, b, __VA_ARGS__)
static LLMC_ALWAYS_INLINE void llmc_transpose16_quarters(vec16f r[16]) {
    llmc_vec4f x[16][4];   // x[j][q]: lanes 4q .. 4q+3 of row j
    memcpy(x, r, sizeof x);
    for (int bi = 0; bi < 4; bi++) {       // rows 4 bi .. 4 bi + 3
        for (int bj = 0; bj < 4; bj++) {   // lanes 4 bj .. 4 bj + 3 -> rows 4 bj .. 4 bj + 3
            const llmc_vec4f a = x[4 * bi][bj], b = x[4 * bi + 1][bj];
            const llmc_vec4f c = x[4 * bi + 2][bj], d = x[4 * bi + 3][bj];
            const llmc_vec4f ab_lo = LLMC_SHUF4(a, b, 0, 4, 1, 5);
            const llmc_vec4f ab_hi = LLMC_SHUF4(a, b, 2, 6, 3, 7);
            const llmc_vec4f cd_lo = LLMC_SHUF4(c, d, 0, 4, 1, 5);
            const llmc_vec4f cd_hi = LLMC_SHUF4(c, d, 2, 6, 3, 7);
            const llmc_vec4f column[4] = {
                LLMC_SHUF4(ab_lo, cd_lo, 0, 1, 4, 5), LLMC_SHUF4(ab_lo, cd_lo, 2, 3, 6, 7),
                LLMC_SHUF4(ab_hi, cd_hi, 0, 1, 4, 5), LLMC_SHUF4(ab_hi, cd_hi, 2, 3, 6, 7)};
            for (int k = 0; k < 4; k++) {
                memcpy((char*)&r[4 * bj + k] + sizeof column[k] * bi, &column[k], sizeof column[k]);
            }
        }
    }
}
static LLMC_ALWAYS_INLINE void llmc_transpose16_wide(vec16f r[16]) {
    vec16f t[16], u[16];
    for (int k = 0; k < 8; k++) {   // pairs of rows, 32 bits at a time
        t[2 * k] = LLMC_SHUF(r[2 * k], r[2 * k + 1],
                        0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29);
        t[2 * k + 1] = LLMC_SHUF(r[2 * k], r[2 * k + 1],
                            2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
    }
    for (int k = 0; k < 4; k++) {   // quads of rows, 64 bits at a time
        for (int h = 0; h < 2; h++) {
            u[4 * k + 2 * h] = LLMC_SHUF(t[4 * k + h], t[4 * k + h + 2],
                                    0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
            u[4 * k + 2 * h + 1] = LLMC_SHUF(t[4 * k + h], t[4 * k + h + 2],
                                        2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15,
                                        30, 31);
        }
    }
    // u[4k + m], quarter l, element e, is the old r[4k + e][4l + m]: transpose
    // the 4 x 4 quarters of u[m], u[4 + m], u[8 + m], u[12 + m]
    for (int m = 0; m < 4; m++) {
        const vec16f x0 = LLMC_SHUF(u[m], u[4 + m], 0, 1, 2, 3, 8, 9, 10, 11,
                               16, 17, 18, 19, 24, 25, 26, 27);
        const vec16f x1 = LLMC_SHUF(u[m], u[4 + m], 4, 5, 6, 7, 12, 13, 14, 15,
                               20, 21, 22, 23, 28, 29, 30, 31);
        const vec16f y0 = LLMC_SHUF(u[8 + m], u[12 + m], 0, 1, 2, 3, 8, 9, 10, 11,
                               16, 17, 18, 19, 24, 25, 26, 27);
        const vec16f y1 = LLMC_SHUF(u[8 + m], u[12 + m], 4, 5, 6, 7, 12, 13, 14, 15,
                               20, 21, 22, 23, 28, 29, 30, 31);
        r[m] = LLMC_SHUF(x0, y0, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
        r[4 + m] = LLMC_SHUF(x1, y1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
        r[8 + m] = LLMC_SHUF(x0, y0, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
        r[12 + m] = LLMC_SHUF(x1, y1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
}
static LLMC_ALWAYS_INLINE void llmc_transpose16(vec16f r[16]) {
#ifdef __AVX512F__
    llmc_transpose16_wide(r);
#else
    llmc_transpose16_quarters(r);
#endif
}

#endif
