/* matmul.c's float32 GEMM, shared with the bf16 matmul (matmul_bf16.c),
   whose fallback widens bf16 operands to float32 and runs it. Private. */
#ifndef LLMC_GEMM_H
#define LLMC_GEMM_H

#include <stddef.h>

/* c[m*ldc + n] += sum_k A(m,k) * B(k,n) for m < M, n < N, in the order
   k = 0, 1, ..., K-1, one fused multiply-add per k where the instruction set
   has them, with A(m,k) = a[m*ars + k*aks] and B(k,n) = b[k*brs + n*bcs].
   Returns LLMC_ERR_NOMEM if its scratch cannot be allocated. */
int llmc_gemm_f32(float* c, size_t ldc, const float* a, size_t ars, size_t aks,
                  const float* b, size_t brs, size_t bcs, int M, int N, int K);

#endif
