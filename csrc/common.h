/* Private helpers shared by the kernel files; not part of the API. */
#ifndef LLMC_COMMON_H
#define LLMC_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

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

#endif
