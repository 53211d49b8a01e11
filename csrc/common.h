/* Private helpers shared by the kernel files; not part of the API. */
#ifndef LLMC_COMMON_H
#define LLMC_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
static inline void omp_set_num_threads(int n) { (void)n; }
#endif

/* Early return with a status; use before any OpenMP region (a parallel
   region cannot be left with return). */
#define LLMC_REQUIRE(cond, status) \
    do { if (!(cond)) { return (status); } } while (0)

/* True when every listed pointer is non-NULL. */
#define LLMC_NONNULL2(a, b) ((a) != NULL && (b) != NULL)
#define LLMC_NONNULL3(a, b, c) (LLMC_NONNULL2(a, b) && (c) != NULL)
#define LLMC_NONNULL4(a, b, c, d) (LLMC_NONNULL2(a, b) && LLMC_NONNULL2(c, d))

/* Elements per chunk of a chunked reduction. Fixed, so a sum is split the
   same way whatever the thread count, and its result never changes. */
#define LLMC_REDUCE_CHUNK 16384

/*
 * exp(x) in plain arithmetic, so that loops calling it vectorise (libm's
 * expf does not without -ffast-math). Cody-Waite range reduction
 * x = n ln2 + r, |r| <= ln2/2, then Cephes' degree-6 polynomial for e^r;
 * within 2 ulp of exp over [-87.3, 88.7]; inputs below give 0, above +inf.
 */
static inline float llmc_expf(float x) {
    const float hi = 88.72283f, lo = -87.3365478515625f;
    const int overflow = x > hi, underflow = x < lo;
    x = x > hi ? hi : (x < lo ? lo : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    // scale by 2^n in two halves, so that n = 128 (x near hi) still fits
    const int n_int = (int)n;
    const int32_t half1 = (int32_t)((n_int / 2 + 127) << 23);
    const int32_t half2 = (int32_t)((n_int - n_int / 2 + 127) << 23);
    float s1, s2;
    memcpy(&s1, &half1, sizeof s1);
    memcpy(&s2, &half2, sizeof s2);
    const float result = p * s1 * s2;
    return overflow ? INFINITY : (underflow ? 0.0f : result);
}

/* tanh(x) through llmc_expf: (1 - e^-2|x|) / (1 + e^-2|x|) with the sign of x.
   Absolute error within ~1e-7 (relative error grows as |x| -> 0, where the
   value itself vanishes). */
static inline float llmc_tanhf(float x) {
    const float ax = x < 0 ? -x : x;
    const float e = llmc_expf(-2.0f * ax);
    const float t = (1.0f - e) / (1.0f + e);
    return x < 0 ? -t : t;
}

#endif
