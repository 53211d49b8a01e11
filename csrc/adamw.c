/* The AdamW update over the flat parameter buffer, and the gradient buffer's
   helpers (its norm, scale and zeroing). The loops are built per instruction
   set (isa.h). */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"
#include "isa.h"

/* The update of elements [0, n): reads params_in, m_in, v_in and grads,
   writes params_out, params_bf16 (unless NULL), m_out and v_out: the inputs
   themselves (in place), or adamw_streamed's chunk of scratch. c1, c2 are
   the bias corrections. */
static LLMC_ALWAYS_INLINE void adamw_range_body(float* params_out, uint16_t* params_bf16,
                                                float* m_out, float* v_out,
                                                const float* params_in, const float* m_in,
                                                const float* v_in, const float* grads, int64_t n,
                                                float learning_rate, float beta1, float beta2,
                                                float eps, float weight_decay, float c1,
                                                float c2) {
    for (int64_t i = 0; i < n; i++) {
        const float g = grads[i];
        const float m_i = beta1 * m_in[i] + (1.0f - beta1) * g;
        const float v_i = beta2 * v_in[i] + (1.0f - beta2) * g * g;
        m_out[i] = m_i;
        v_out[i] = v_i;
        const float m_hat = m_i / c1;
        const float v_hat = v_i / c2;
        const float p = params_in[i]
                        - learning_rate * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * params_in[i]);
        params_out[i] = p;
        if (params_bf16 != NULL) { params_bf16[i] = llmc_bf16_round(p); }
    }
}
LLMC_ISA_VARIANTS(adamw_range, (float* params, uint16_t* params_bf16, float* m, float* v,
                                const float* grads, int64_t n, float learning_rate, float beta1,
                                float beta2, float eps, float weight_decay, float c1, float c2),
                  params, params_bf16, m, v, params, m, v, grads, n, learning_rate, beta1, beta2,
                  eps, weight_decay, c1, c2)

typedef void (*adamw_range_fn)(float*, uint16_t*, float*, float*, const float*, int64_t, float,
                               float, float, float, float, float, float);

/* From this many floats (16 MiB) on, an array the update or fill_zero writes
   is stored with streaming (non-temporal) stores on AVX2 and AVX-512: far
   larger than the caches, it gains nothing from keeping the lines written,
   and an array only written is then not read for ownership first. Below it,
   the arrays may still be in the caches, where the next step reads them. */
#define STREAM_MIN ((int64_t)1 << 22)

#ifdef LLMC_X86_DISPATCH
#include <immintrin.h>

/* Elements per chunk of adamw_streamed: its scratch stays in L1. */
#define ADAMW_CHUNK 512

/*
 * adamw_range with streaming stores (STREAM_MIN): each chunk is computed by
 * the same loop into scratch, then stored 32 bytes at a time, from the first
 * element where params is 64-byte aligned (the elements before it, and every
 * element when m, v or the copy do not share that alignment, in place). The
 * sfence orders the streamed stores before whatever follows.
 */
LLMC_TARGET_AVX2 static LLMC_ALWAYS_INLINE void adamw_streamed_body(
        float* params, uint16_t* params_bf16, float* m, float* v, const float* grads, int64_t n,
        float learning_rate, float beta1, float beta2, float eps, float weight_decay, float c1,
        float c2) {
    int64_t head = (int64_t)(((64 - (uintptr_t)params % 64) % 64) / sizeof(float));
    const int aligned = (uintptr_t)params % sizeof(float) == 0
                        && ((uintptr_t)m - (uintptr_t)params) % 64 == 0
                        && ((uintptr_t)v - (uintptr_t)params) % 64 == 0
                        && (params_bf16 == NULL
                            || (uintptr_t)(params_bf16 + head) % 32 == 0);
    if (!aligned || head > n) { head = n; }
    adamw_range_body(params, params_bf16, m, v, params, m, v, grads, head, learning_rate, beta1,
                     beta2, eps, weight_decay, c1, c2);
    float p_chunk[ADAMW_CHUNK] __attribute__((aligned(64)));
    float m_chunk[ADAMW_CHUNK] __attribute__((aligned(64)));
    float v_chunk[ADAMW_CHUNK] __attribute__((aligned(64)));
    uint16_t bf16_chunk[ADAMW_CHUNK] __attribute__((aligned(64)));
    int64_t i = head;
    for (; i + ADAMW_CHUNK <= n; i += ADAMW_CHUNK) {
        adamw_range_body(p_chunk, params_bf16 != NULL ? bf16_chunk : NULL, m_chunk, v_chunk,
                         params + i, m + i, v + i, grads + i, ADAMW_CHUNK, learning_rate, beta1,
                         beta2, eps, weight_decay, c1, c2);
        for (int j = 0; j < ADAMW_CHUNK; j += 8) {
            _mm256_stream_ps(params + i + j, _mm256_load_ps(p_chunk + j));
            _mm256_stream_ps(m + i + j, _mm256_load_ps(m_chunk + j));
            _mm256_stream_ps(v + i + j, _mm256_load_ps(v_chunk + j));
        }
        if (params_bf16 != NULL) {
            for (int j = 0; j < ADAMW_CHUNK; j += 16) {
                _mm256_stream_si256((__m256i*)(params_bf16 + i + j),
                                    _mm256_load_si256((const __m256i*)(bf16_chunk + j)));
            }
        }
    }
    adamw_range_body(params + i, params_bf16 != NULL ? params_bf16 + i : NULL, m + i, v + i,
                     params + i, m + i, v + i, grads + i, n - i, learning_rate, beta1, beta2,
                     eps, weight_decay, c1, c2);
    _mm_sfence();
}
/* adamw_streamed_avx2 and adamw_streamed_avx512 (isa.h's variants) */
#define ADAMW_STREAMED(attr, name)                                                          \
    LLMC_ISA_VARIANT_(attr, name,                                                           \
                      (float* params, uint16_t* params_bf16, float* m, float* v,            \
                       const float* grads, int64_t n, float learning_rate, float beta1,     \
                       float beta2, float eps, float weight_decay, float c1, float c2),     \
                      adamw_streamed_body(params, params_bf16, m, v, grads, n,              \
                                          learning_rate, beta1, beta2, eps, weight_decay,   \
                                          c1, c2))
ADAMW_STREAMED(LLMC_TARGET_AVX2, adamw_streamed_avx2)
ADAMW_STREAMED(LLMC_TARGET_AVX512, adamw_streamed_avx512)

/* x[0 .. n) = 0 with streaming stores from the first 32-byte aligned element. */
LLMC_TARGET_AVX2 __attribute__((noinline)) static void zero_streamed(float* x, int64_t n) {
    int64_t head = (int64_t)(((32 - (uintptr_t)x % 32) % 32) / sizeof(float));
    head = head < n ? head : n;
    memset(x, 0, (size_t)head * sizeof(float));
    int64_t i = head;
    for (; i + 8 <= n; i += 8) { _mm256_stream_ps(x + i, _mm256_setzero_ps()); }
    memset(x + i, 0, (size_t)(n - i) * sizeof(float));
    _mm_sfence();
}
#endif

/* The update's per-thread function: adamw_range, or for N >= STREAM_MIN on
   AVX2 and AVX-512 adamw_streamed (the same bits). */
static adamw_range_fn adamw_choice(int isa, int64_t N) {
#ifdef LLMC_X86_DISPATCH
    if (N >= STREAM_MIN && isa >= LLMC_ISA_AVX2) {
        return isa >= LLMC_ISA_AVX512 ? adamw_streamed_avx512 : adamw_streamed_avx2;
    }
#endif
    (void)N;
    return LLMC_ISA_SELECT(isa, adamw_range);
}

static void zero_plain(float* x, int64_t n) { memset(x, 0, (size_t)n * sizeof(float)); }

/* *out = the sum of squares of x[i0 .. i1), in double, in order. */
static LLMC_ALWAYS_INLINE void chunk_norm_body(double* out, const float* x, int64_t i0,
                                               int64_t i1) {
    double acc = 0.0;
    for (int64_t i = i0; i < i1; i++) { acc += (double)x[i] * x[i]; }
    *out = acc;
}
LLMC_ISA_VARIANTS(chunk_norm, (double* out, const float* x, int64_t i0, int64_t i1), out, x, i0, i1)

static LLMC_ALWAYS_INLINE void scale_range_body(float* x, int64_t i0, int64_t i1, float scale) {
    for (int64_t i = i0; i < i1; i++) { x[i] *= scale; }
}
LLMC_ISA_VARIANTS(scale_range, (float* x, int64_t i0, int64_t i1, float scale), x, i0, i1, scale)

int adamw_update(float* params, uint16_t* params_bf16, float* m, float* v, const float* grads,
                 int64_t N, float learning_rate, float beta1, float beta2, float eps,
                 float weight_decay, int t) {
    LLMC_REQUIRE(LLMC_NONNULL4(params, m, v, grads), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(t >= 1, LLMC_ERR_VALUE);
    const float c1 = 1.0f - powf(beta1, (float)t);
    const float c2 = 1.0f - powf(beta2, (float)t);

    const adamw_range_fn range = adamw_choice(llmc_get_isa(), N);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        if (i0 < i1) {
            range(params + i0, params_bf16 != NULL ? params_bf16 + i0 : NULL, m + i0, v + i0,
                  grads + i0, i1 - i0, learning_rate, beta1, beta2, eps, weight_decay, c1, c2);
        }
    }
    return LLMC_OK;
}

int global_norm_squared(double* out, const float* x, int64_t N) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, x), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    const int64_t nchunks = (N + LLMC_REDUCE_CHUNK - 1) / LLMC_REDUCE_CHUNK;
    double* partial = malloc((size_t)nchunks * sizeof(double));
    LLMC_REQUIRE(partial != NULL, LLMC_ERR_NOMEM);

    // fixed chunks, each summed by one thread, then added in chunk order
    void (*const chunk)(double*, const float*, int64_t, int64_t) =
        LLMC_ISA_SELECT(llmc_get_isa(), chunk_norm);
    #pragma omp parallel for schedule(static)
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int64_t i0 = ch * LLMC_REDUCE_CHUNK;
        const int64_t i1 = i0 + LLMC_REDUCE_CHUNK < N ? i0 + LLMC_REDUCE_CHUNK : N;
        chunk(partial + ch, x, i0, i1);
    }
    double total = 0.0;
    for (int64_t ch = 0; ch < nchunks; ch++) { total += partial[ch]; }
    free(partial);
    *out = total;
    return LLMC_OK;
}

int scale_inplace(float* x, int64_t N, float scale) {
    LLMC_REQUIRE(x != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    void (*const range)(float*, int64_t, int64_t, float) =
        LLMC_ISA_SELECT(llmc_get_isa(), scale_range);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        if (i0 < i1) { range(x, i0, i1, scale); }
    }
    return LLMC_OK;
}

int fill_zero(float* x, int64_t N) {
    LLMC_REQUIRE(x != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    void (*range)(float*, int64_t) = zero_plain;
#ifdef LLMC_X86_DISPATCH
    if (N >= STREAM_MIN && llmc_get_isa() >= LLMC_ISA_AVX2) { range = zero_streamed; }
#endif
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        if (i0 < i1) { range(x + i0, i1 - i0); }
    }
    return LLMC_OK;
}
