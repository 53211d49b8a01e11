/* The AdamW update over the flat parameter buffer, and gradient-norm helpers. */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"

int adamw_update(float* params, float* m, float* v, const float* grads, long N,
                 float learning_rate, float beta1, float beta2, float eps,
                 float weight_decay, int t) {
    LLMC_REQUIRE(LLMC_NONNULL4(params, m, v, grads), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT && t >= 1, LLMC_ERR_SHAPE);
    const float c1 = 1.0f - powf(beta1, (float)t);
    const float c2 = 1.0f - powf(beta2, (float)t);

    #pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) {
        const float g = grads[i];
        const float m_i = beta1 * m[i] + (1.0f - beta1) * g;
        const float v_i = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = m_i;
        v[i] = v_i;
        const float m_hat = m_i / c1;
        const float v_hat = v_i / c2;
        params[i] -= learning_rate * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * params[i]);
    }
    return LLMC_OK;
}

int global_norm_squared(double* out, const float* x, long N) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, x), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    const long nchunks = (N + LLMC_REDUCE_CHUNK - 1) / LLMC_REDUCE_CHUNK;
    double* partial = malloc((size_t)nchunks * sizeof(double));
    LLMC_REQUIRE(partial != NULL, LLMC_ERR_NOMEM);

    // fixed chunks, each summed by one thread, then added in chunk order
    #pragma omp parallel for schedule(static)
    for (long ch = 0; ch < nchunks; ch++) {
        const long i0 = ch * LLMC_REDUCE_CHUNK;
        const long i1 = i0 + LLMC_REDUCE_CHUNK < N ? i0 + LLMC_REDUCE_CHUNK : N;
        double acc = 0.0;
        for (long i = i0; i < i1; i++) { acc += (double)x[i] * x[i]; }
        partial[ch] = acc;
    }
    double total = 0.0;
    for (long ch = 0; ch < nchunks; ch++) { total += partial[ch]; }
    free(partial);
    *out = total;
    return LLMC_OK;
}

int scale_inplace(float* x, long N, float scale) {
    LLMC_REQUIRE(x != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < N; i++) { x[i] *= scale; }
    return LLMC_OK;
}
