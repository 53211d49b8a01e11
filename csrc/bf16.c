/* Conversions between float32 and bf16 (contract in llmc_api.h): the
   weight copy of bf16 training, the bf16 model file, the tests. Element-wise
   loops that GCC and clang vectorise as they stand; threads take contiguous
   shares. */
#include "llmc.h"
#include "common.h"

int float_to_bf16(uint16_t* out, const float* inp, int64_t N) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) { out[i] = llmc_bf16_round(inp[i]); }
    }
    return LLMC_OK;
}

int bf16_to_float(float* out, const uint16_t* inp, int64_t N) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) { out[i] = llmc_bf16_widen(inp[i]); }
    }
    return LLMC_OK;
}
