/* matmul.c's float32 GEMM, shared with the bf16 matmul (matmul_bf16.c),
   whose fallback widens bf16 operands to float32 and runs it. Private. */
#ifndef LLMC_GEMM_H
#define LLMC_GEMM_H

#include <stddef.h>
#include <stdint.h>

/* c[m*ldc + n] += sum_k A(m,k) * B(k,n) for m < M, n < N, in the order
   k = 0, 1, ..., K-1, one fused multiply-add per k where the instruction set
   has them, with A(m,k) = a[m*ars + k*aks] and B(k,n) = b[k*brs + n*bcs].
   Returns LLMC_ERR_NOMEM if its scratch cannot be allocated. */
int llmc_gemm_f32(float* c, size_t ldc, const float* a, size_t ars, size_t aks,
                  const float* b, size_t brs, size_t bcs, int M, int N, int K);

/* One product of a batch, as llmc_gemm_f32's arguments. */
struct llmc_gemm_f32_job {
    float* c;
    size_t ldc;
    const float* a;
    size_t ars, aks;
    const float* b;
    size_t brs, bcs;
    int M, N, K;
};

/* llmc_gemm_f32 for jobs[0 .. count), as one parallel loop over the tiles of
   them all (moe.c's experts); every element as llmc_gemm_f32 sums it. The
   jobs' outputs must not overlap. */
int llmc_gemm_f32_many(const struct llmc_gemm_f32_job* jobs, int count);

/* An activation's forward over blocks [blk0, blk1) of 16 of n elements:
   out[i] (float32, or bf16 if out_bf16) = act(inp[i]). */
typedef void (*llmc_forward_blocks_fn)(void* out, int out_bf16, const float* inp, int64_t n,
                                       int64_t blk0, int64_t blk1);

/* activations.c: the blocks gelu_forward runs on instruction set isa (read
   before a parallel region, as isa.h asks). */
llmc_forward_blocks_fn llmc_gelu_forward_blocks(int isa);

/* Zeroes what matmul_backward's `written` asks it to write (matmul.c): the
   paths that only add into dinp [BT, C] and dweight [OC, C]. */
void llmc_zero_written(float* dinp, float* dweight, int written, int64_t BT, int C, int OC);
static inline int llmc_written_ok(int written) {
    return (written & ~(LLMC_WRITE_DINP | LLMC_WRITE_DWEIGHT)) == 0;
}

/* The most rows matmul_forward gives its few-row (skinny) kernel. */
#define LLMC_FEW_ROWS_F32 16

/* One forward product of a few rows, out[m*N + n] = (bias[n] or 0) +
   sum_k inp[m*K + k] weight[n*K + k] for m < M <= LLMC_FEW_ROWS_F32, n < N
   (bias may be NULL). */
struct llmc_few_rows_job {
    float* out;
    const float* inp;
    const float* weight;
    const float* bias;
    int M;
};

/* jobs[0 .. count), each [M, K] . [N, K]^T, by matmul_forward's few-row
   kernel as one parallel loop over the column groups of them all (moe.c's
   experts when decoding): each weight read once, in place, and every
   element bitwise llmc_gemm_f32's from the same start. */
void llmc_forward_few_rows_many(const struct llmc_few_rows_job* jobs, int count, int K, int N);


/* Where the bf16 GEMM reads an operand (struct bf16_gemm). */
enum {
    BF16_A_ROWS,      /* A(m,k) = float a[m*lda + k]     (forward inp, dinp's dout)  */
    BF16_A_COLS,      /* A(m,k) = float a[k*lda + m]     (dweight's dout^T)          */
    BF16_B_COLS_W,    /* B(k,n) = bf16 b[n*ldb + k]      (forward weight^T)          */
    BF16_B_ROWS_W,    /* B(k,n) = bf16 b[k*ldb + n]      (dinp's weight, dweight's
                                                          bf16 inp)                  */
    BF16_B_ROWS_F32,  /* B(k,n) = float b[k*ldb + n]     (dweight's inp)             */
    BF16_A_ROWS_BF16  /* A(m,k) = bf16 a[m*lda + k]      (forward's bf16 inp)        */
};

/* c[m*ldc + n] (+)= sum_k A(m,k) B(k,n) for m < M, n < N, k < K, with A and B
   read as a_kind and b_kind say, float32 operands rounded to bf16. init: NULL
   adds onto c (the (+=) products); else c starts from init[n] (a bias) in
   every row, or from 0 if init_zero. walk_rows: the dot-product path walks
   C in whole rows where a K block's B panels fit (as it does for A_COLS): a
   product whose C is large beside its K (a few-rank update of a wide
   output), which column panel by column panel would stride through C. */
struct bf16_gemm {
    float* c;
    size_t ldc;
    const void* a;
    size_t lda;
    int a_kind;
    const void* b;
    size_t ldb;
    int b_kind;
    const float* init;
    int init_zero;
    int walk_rows;
    int M, N, K;
    /* act, if not NULL: once a tile of c is complete, act(out, out_bf16, c
       row, n, 0, blocks) writes its activation into act_out at the same
       (m, n), ld ldc, bf16 if act_bf16 (the tile still in cache) */
    llmc_forward_blocks_fn act;
    void* act_out;
    int act_bf16;
};

/* The bf16 products jobs[0 .. count), each element summed as matmul_bf16.c's
   layer sums it on the active instruction set: vdpbf16ps pairs on
   avx512bf16, in one parallel region where the jobs' work, end to end, is
   cut into equal shares of the threads (a job split along its rows or
   columns where a share ends); elsewhere the operands rounded and widened
   to float32, then llmc_gemm_f32_many. The jobs' outputs must not overlap. */
int llmc_gemm_bf16_many(const struct bf16_gemm* jobs, int count);

/* The most rows matmul_forward_bf16 gives its few-row kernel (avx512bf16). */
#define LLMC_FEW_ROWS_BF16 12

/* One bf16 forward product of a few rows, as struct llmc_few_rows_job's:
   inp float32 (rounded to bf16) or, if inp_bf16, bf16; weight [N, K] bf16. */
struct llmc_bf16_few_rows_job {
    float* out;
    const void* inp;
    int inp_bf16;
    const uint16_t* weight;
    const float* bias;
    int M;
};

/* On avx512bf16 (1, else 0: call nothing), jobs[0 .. count) (each M at most
   LLMC_FEW_ROWS_BF16) by matmul_forward_bf16's few-row kernel, as one
   parallel loop over the column groups of them all: every element bitwise
   the bf16 GEMM's from the same start. Returns LLMC_ERR_NOMEM if its
   scratch cannot be allocated. */
int llmc_bf16_few_rows_supported(void);
int llmc_bf16_forward_few_rows_many(const struct llmc_bf16_few_rows_job* jobs, int count, int K,
                                    int N);

#endif
