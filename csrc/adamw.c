/* The AdamW update over the flat parameter buffer, and the gradient buffer's
   helpers (its norm, scale and zeroing). The loops are built per instruction
   set (isa.h). */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"
#include "isa.h"

/* The update of elements [i0, i1); c1, c2 are the bias corrections. */
static LLMC_ALWAYS_INLINE void adamw_range_body(float* params, uint16_t* params_bf16,
                                                float* m, float* v,
                                                const float* grads, int64_t i0, int64_t i1,
                                                float learning_rate, float beta1, float beta2,
                                                float eps, float weight_decay, float c1,
                                                float c2) {
    for (int64_t i = i0; i < i1; i++) {
        const float g = grads[i];
        const float m_i = beta1 * m[i] + (1.0f - beta1) * g;
        const float v_i = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = m_i;
        v[i] = v_i;
        const float m_hat = m_i / c1;
        const float v_hat = v_i / c2;
        const float p = params[i]
                        - learning_rate * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * params[i]);
        params[i] = p;
        if (params_bf16 != NULL) { params_bf16[i] = llmc_bf16_round(p); }
    }
}
LLMC_ISA_VARIANTS(adamw_range, (float* params, uint16_t* params_bf16, float* m, float* v,
                                const float* grads, int64_t i0, int64_t i1, float learning_rate,
                                float beta1, float beta2, float eps, float weight_decay, float c1,
                                float c2),
                  params, params_bf16, m, v, grads, i0, i1, learning_rate, beta1, beta2, eps,
                  weight_decay, c1, c2)

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

    void (*const range)(float*, uint16_t*, float*, float*, const float*, int64_t, int64_t, float,
                        float, float, float, float, float, float) =
        LLMC_ISA_SELECT(llmc_get_isa(), adamw_range);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        if (i0 < i1) {
            range(params, params_bf16, m, v, grads, i0, i1, learning_rate, beta1, beta2, eps, weight_decay,
                  c1, c2);
        }
    }
    return LLMC_OK;
}

/* From this many floats (16 MiB) on, fill_zero stores with streaming
   (non-temporal) stores on AVX2 and AVX-512: far larger than the caches, the
   array gains nothing from keeping the lines written, and is then not read
   for ownership first. */
#define STREAM_MIN ((int64_t)1 << 22)

#ifdef LLMC_X86_DISPATCH
#include <immintrin.h>

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

static void zero_plain(float* x, int64_t n) { memset(x, 0, (size_t)n * sizeof(float)); }

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
