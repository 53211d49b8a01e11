/*
 * llmc_py's C surface: every kernel the Python layer calls, with its contract.
 *
 * This file is read twice: by the C compiler (through llmc.h) and by cffi as
 * its cdef, so it holds declarations only, with no #include, #if or guards.
 *
 * Conventions, stated once for every block below:
 *   - every function returns an llmc_status (LLMC_OK == 0), never exits or
 *     prints; Python turns a non-zero status into an exception;
 *   - arguments come as outputs, inputs, sizes, scalars; backward functions
 *     take the gradients they produce first, then dout, then what the forward
 *     saved;
 *   - shapes use B T C OC V Vp L NH NKV hs FF N (and moe.c's E k R); arrays
 *     are contiguous row-major fp32, token arrays contiguous int32;
 *   - "(written)" outputs are overwritten and never read; "(+=)" outputs are
 *     accumulated into, so the caller zeroes them once per step;
 *   - no output may alias an input unless its block says so;
 *   - results do not depend on the number of threads: every sum over a
 *     reduced dimension runs in one fixed order.
 */

typedef enum {
    LLMC_OK = 0,
    LLMC_ERR_SHAPE = 1,    /* a size is <= 0, sizes disagree (e.g. C % NH), or
                              an array of these sizes could not exist         */
    LLMC_ERR_RANGE = 2,    /* an index such as a token id is out of range       */
    LLMC_ERR_NOMEM = 3,    /* an internal scratch allocation failed             */
    LLMC_ERR_NULL = 4,     /* a required pointer is NULL                        */
    LLMC_ERR_UNSUPPORTED = 5,  /* this CPU or build lacks what was asked for    */
    LLMC_ERR_VALUE = 6     /* a scalar argument is outside its domain (a
                              negative eps, a RoPE theta that is not positive
                              and finite, an AdamW step below 1)            */
} llmc_status;

/*
 * The element type of an activation that a kernel writes or reads either as
 * float32 or as bf16 (a void* with an int *_dtype argument beside the
 * scalars): bf16 numbers are uint16_t, the upper half of a float32, and a
 * kernel writing one rounds its float32 result to nearest even
 * (float_to_bf16). Any other value is LLMC_ERR_VALUE.
 */
typedef enum {
    LLMC_DTYPE_F32 = 0,
    LLMC_DTYPE_BF16 = 1
} llmc_dtype;

/* ---- status.c ----------------------------------------------------------- */

/* A static, human-readable text for a status code (never NULL). */
const char* llmc_status_string(int status);

/* Threads used by the parallel kernels; n <= 0 is LLMC_ERR_SHAPE. */
int llmc_set_num_threads(int n);
/* Returns the thread count itself (not a status). */
int llmc_get_num_threads(void);
/* Returns 1 if the library was built with OpenMP, else 0 (not a status). */
int llmc_has_openmp(void);

/* ---- scratch.c ---------------------------------------------------------- */

/*
 * The matmul kernels (float32, bf16, and the GEMMs of moe.c and quant.c)
 * keep their scratch (packed panels, rounded or widened operand copies) in
 * one arena from call to call, grown to the largest call's need, so that a
 * training step allocates nothing per call. Kernels called from two threads
 * at once take turns on it. llmc_scratch_release frees it (after any kernel
 * using it returns); the next call grows it again.
 */
int llmc_scratch_release(void);
/* Returns the bytes the arena holds now (not a status). */
size_t llmc_scratch_bytes(void);

/* ---- isa.c -------------------------------------------------------------- */

/*
 * The instruction set every kernel family's vector loops run on (each is
 * built for all of them; the naive twins never change). Every choice runs a
 * kernel's operations in the same order; they differ only in how products
 * round into sums (fused multiply-add or not), within a few ulp of one
 * another. The choice is global, like the thread count, and made once at
 * first use: the best the CPU supports, unless llmc_set_isa chose before.
 */
typedef enum {
    LLMC_ISA_AUTO = 0,       /* llmc_set_isa only: the best the CPU supports   */
    LLMC_ISA_PORTABLE = 1,   /* plain C vectors, built with the build's flags  */
    LLMC_ISA_AVX2 = 2,       /* x86 AVX2 + FMA                                 */
    LLMC_ISA_AVX512 = 3,     /* x86 AVX-512F                                   */
    LLMC_ISA_AVX512BF16 = 4  /* x86 AVX-512F + AVX512_BF16: the bf16 matmul's
                                vdpbf16ps; every fp32 kernel as in AVX512   */
} llmc_isa;

/* Chooses the instruction set of every kernel; an isa outside the enum is
   LLMC_ERR_RANGE, one this CPU or build cannot run LLMC_ERR_UNSUPPORTED
   (nothing changes). */
int llmc_set_isa(int isa);
/* Returns the instruction set in use, never LLMC_ISA_AUTO (not a status). */
int llmc_get_isa(void);
/* Returns 1 if llmc_set_isa(isa) would succeed, else 0 (not a status). */
int llmc_isa_supported(int isa);

/* ---- encoder.c ---------------------------------------------------------- */

/*
 * encoder_forward: out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
 *
 *   out [B, T, C]  (written)
 *   inp [B, T]     int32 token ids, each in [0, V); else LLMC_ERR_RANGE
 *   wte [V, C]     (any padded rows past V are never read)
 *   wpe [T, C]     (the first T rows of the position table) or NULL: no
 *                  position embedding (RoPE and ALiBi models), out = wte row
 */
int encoder_forward(float* out, const int* inp, const float* wte, const float* wpe,
                    int B, int T, int C, int V);

/*
 * encoder_backward: gradients of encoder_forward.
 *
 *   dwte [V, C]     (+=) row inp[b,t] gathers dout[b,t,:]
 *   dwpe [T, C]     (+=) or NULL when the forward had no wpe
 *   dout [B, T, C]
 *   inp  [B, T]     int32 token ids in [0, V)
 */
int encoder_backward(float* dwte, float* dwpe, const float* dout, const int* inp,
                     int B, int T, int C, int V);

/*
 * sinusoidal_forward: out[b,t,:] = inp[b,t,:] + PE(pos[b] + t), the original
 * Transformer's fixed positions: PE(p)[2i] = sin(p w_i), PE(p)[2i+1] =
 * cos(p w_i), w_i = 10000^(-2i/C) (an odd C ends with a sin channel). No
 * parameters, so no backward: the gradient passes through unchanged.
 *
 *   out [B, T, C]  (written) may alias inp
 *   inp [B, T, C]
 *   pos [B]        int32 first position of each row, >= 0 (else
 *                  LLMC_ERR_RANGE), or NULL: 0
 */
int sinusoidal_forward(float* out, const float* inp, const int* pos, int B, int T, int C);

/* ---- norms.c ------------------------------------------------------------ */

/*
 * layernorm_forward: out = (inp - mean) * rstd * weight + bias, per row of C,
 * with rstd = 1 / sqrt(var + eps) and var the biased variance.
 *
 *   out    [B, T, C]  (written) float32, or bf16 (out_dtype): the float32
 *                     result rounded
 *   mean   [B, T]     (written) saved for backward
 *   rstd   [B, T]     (written) saved for backward
 *   inp    [B, T, C]
 *   weight [C]
 *   bias   [C]
 * eps >= 0; else (also NaN) LLMC_ERR_VALUE.
 */
int layernorm_forward(void* out, float* mean, float* rstd,
                      const float* inp, const float* weight, const float* bias,
                      int B, int T, int C, float eps, int out_dtype);

/*
 * residual_layernorm_forward: residual = inp1 + inp2, then
 * layernorm_forward of it, in one pass over each row: bitwise
 * residual_forward followed by layernorm_forward.
 *
 *   residual [B, T, C]  (written)
 *   out, mean, rstd     (written) as layernorm_forward's
 *   inp1, inp2 [B, T, C]
 *   weight, bias [C]
 */
int residual_layernorm_forward(float* residual, void* out, float* mean, float* rstd,
                               const float* inp1, const float* inp2, const float* weight,
                               const float* bias, int B, int T, int C, float eps,
                               int out_dtype);

/*
 * layernorm_backward: gradients of layernorm_forward.
 *
 *   dinp    [B, T, C]  (+=)
 *   dweight [C]        (+=) or NULL (a frozen weight)
 *   dbias   [C]        (+=) or NULL (a frozen bias)
 *   dout    [B, T, C]
 *   inp     [B, T, C]  forward input
 *   weight  [C]
 *   mean    [B, T]     saved by layernorm_forward
 *   rstd    [B, T]     saved by layernorm_forward
 *   written 1: dinp is written instead (bitwise the sum into a zeroed dinp,
 *           without reading or zeroing it first); 0: added into
 */
int layernorm_backward(float* dinp, float* dweight, float* dbias,
                       const float* dout, const float* inp, const float* weight,
                       const float* mean, const float* rstd,
                       int B, int T, int C, int written);

/*
 * rmsnorm_forward: out = inp * rstd * weight, per row of C, with
 * rstd = 1 / sqrt(mean(inp^2) + eps) (no mean subtracted, no bias).
 *
 *   out    [B, T, C]  (written) float32, or bf16 (out_dtype): the float32
 *                     result rounded
 *   rstd   [B, T]     (written) saved for backward
 *   inp    [B, T, C]
 *   weight [C]
 * eps >= 0; else (also NaN) LLMC_ERR_VALUE.
 */
int rmsnorm_forward(void* out, float* rstd, const float* inp, const float* weight,
                    int B, int T, int C, float eps, int out_dtype);

/* residual_rmsnorm_forward: residual = inp1 + inp2, then rmsnorm_forward of
   it, in one pass over each row: bitwise residual_forward followed by
   rmsnorm_forward (residual, inp1, inp2 [B, T, C]; the rest as there). */
int residual_rmsnorm_forward(float* residual, void* out, float* rstd, const float* inp1,
                             const float* inp2, const float* weight, int B, int T, int C,
                             float eps, int out_dtype);

/*
 * rmsnorm_backward: gradients of rmsnorm_forward.
 *
 *   dinp    [B, T, C]  (+=)
 *   dweight [C]        (+=) or NULL (a frozen weight)
 *   dout    [B, T, C]
 *   inp     [B, T, C]  forward input
 *   weight  [C]
 *   rstd    [B, T]     saved by rmsnorm_forward
 *   written as layernorm_backward's
 */
int rmsnorm_backward(float* dinp, float* dweight,
                     const float* dout, const float* inp, const float* weight,
                     const float* rstd, int B, int T, int C, int written);

/*
 * head_rmsnorm_forward: RMSNorm of each q head and each k head of packed
 * rows (Qwen3's q_norm and k_norm, before RoPE): per head of hs channels,
 * out = inp * rstd * weight, with qweight for the NH q heads and kweight for
 * the NKV k heads; the NKV v heads are copied.
 *
 *   out     [B, T, (NH + 2 NKV) hs]  (written; may be inp)
 *   rstd    [B, T, NH + NKV]         (written) saved for backward
 *   inp     [B, T, (NH + 2 NKV) hs]
 *   qweight [hs]
 *   kweight [hs]
 * eps >= 0; else (also NaN) LLMC_ERR_VALUE.
 */
int head_rmsnorm_forward(float* out, float* rstd, const float* inp, const float* qweight,
                         const float* kweight, int B, int T, int NH, int NKV, int hs,
                         float eps);

/*
 * head_rmsnorm_backward: gradients of head_rmsnorm_forward.
 *
 *   dinp     [B, T, (NH + 2 NKV) hs]  (+=; the v heads' is dout's)
 *   dqweight [hs]                     (+=) or NULL (frozen: then dkweight too)
 *   dkweight [hs]                     (+=) or NULL
 *   dout     [B, T, (NH + 2 NKV) hs]
 *   inp      [B, T, (NH + 2 NKV) hs]  forward input
 *   qweight, kweight [hs]
 *   rstd     [B, T, NH + NKV]         saved by head_rmsnorm_forward
 *   written  as layernorm_backward's
 */
int head_rmsnorm_backward(float* dinp, float* dqweight, float* dkweight, const float* dout,
                          const float* inp, const float* qweight, const float* kweight,
                          const float* rstd, int B, int T, int NH, int NKV, int hs,
                          int written);

/* ---- matmul.c ----------------------------------------------------------- */

/*
 * matmul_forward: out[b,t,o] = bias[o] + sum_i inp[b,t,i] * weight[o,i]
 *
 *   out    [B, T, OC]  (written)
 *   inp    [B, T, C]
 *   weight [OC, C]
 *   bias   [OC] or NULL (no bias)
 */
int matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                   int B, int T, int C, int OC);

/*
 * matmul_backward: gradients of matmul_forward.
 *
 *   dinp    [B, T, C]  (+=) dout . weight; or NULL (not wanted)
 *   dweight [OC, C]    (+=) dout^T . inp; or NULL (frozen weight)
 *   dbias   [OC]       (+=) sum of dout over B, T; or NULL (no bias)
 *   dout    [B, T, OC]
 *   inp     [B, T, C]  (may be NULL when dweight is)
 *   weight  [OC, C]    (may be NULL when dinp is)
 *   written            LLMC_WRITE_DINP | LLMC_WRITE_DWEIGHT, or 0: those
 *                      outputs are written instead (bitwise the sum into a
 *                      zeroed output, which the caller then need not zero)
 * Each product is computed only when its output is given.
 */
typedef enum { LLMC_WRITE_DINP = 1, LLMC_WRITE_DWEIGHT = 2 } llmc_write;
int matmul_backward(float* dinp, float* dweight, float* dbias,
                    const float* dout, const float* inp, const float* weight,
                    int B, int T, int C, int OC, int written);

/* The plain triple loops, kept as the reference the fast path is checked
   against; same contracts as matmul_forward / matmul_backward. */
int matmul_forward_naive(float* out, const float* inp, const float* weight, const float* bias,
                         int B, int T, int C, int OC);
int matmul_backward_naive(float* dinp, float* dweight, float* dbias,
                          const float* dout, const float* inp, const float* weight,
                          int B, int T, int C, int OC, int written);

/* ---- bf16.c ------------------------------------------------------------- */

/*
 * bf16 numbers travel as uint16_t: the upper 16 bits of a float32 (sign, 8
 * exponent bits, 7 mantissa bits).
 *
 * float_to_bf16: out[i] = inp[i] rounded to the nearest bf16, ties to even
 * (what torch's .to(torch.bfloat16) does); a NaN stays a (quiet) NaN, an
 * infinity stays infinite, a finite value past the largest bf16 rounds to an
 * infinity.
 * bf16_to_float: out[i] = inp[i] exactly.
 *
 *   out [N]  (written)
 *   inp [N]
 */
int float_to_bf16(uint16_t* out, const float* inp, int64_t N);
int bf16_to_float(float* out, const uint16_t* inp, int64_t N);

/* ---- matmul_bf16.c ------------------------------------------------------ */

/*
 * The bf16 linear layer of mixed-precision training: matmul_forward and
 * matmul_backward's contracts, except that the weight is bf16 and every
 * product multiplies bf16 numbers: each float32 operand (inp, dout) is first
 * rounded to bf16 (float_to_bf16), each product of two bf16 numbers is exact
 * in float32, and the products are summed in float32 onto the output's
 * float32 start value (bias, 0, or what a (+=) output holds). The order of
 * that sum depends on the instruction set (pairs of k in vdpbf16ps), never
 * on the thread count.
 *
 *   out     [B, T, OC]  (written)
 *   inp     [B, T, C]   float32, or bf16 (inp_dtype): read as it is, so
 *                       that bf16(x) gives bitwise the results of x
 *   weight  [OC, C]     bf16
 *   bias    [OC] or NULL, float32
 *
 *   dinp    [B, T, C]   (+=) bf16(dout) . weight; or NULL
 *   dweight [OC, C]     (+=) float32: bf16(dout)^T . bf16(inp); or NULL
 *   dbias   [OC]        (+=) sum of dout over B, T in float32; or NULL
 *   written             as matmul_backward's
 */
int matmul_forward_bf16(float* out, const void* inp, const uint16_t* weight,
                        const float* bias, int B, int T, int C, int OC, int inp_dtype);
int matmul_backward_bf16(float* dinp, float* dweight, float* dbias,
                         const float* dout, const void* inp, const uint16_t* weight,
                         int B, int T, int C, int OC, int inp_dtype, int written);

/*
 * matmul_gelu_forward_bf16: matmul_forward_bf16 into out, and gelu_forward
 * of it into act_out, bitwise the two calls; on avx512bf16 each output tile
 * is activated as the GEMM completes it, while it is in cache.
 *
 *   out     [B, T, OC]  (written) float32
 *   act_out [B, T, OC]  (written) float32, or bf16 (act_dtype)
 */
int matmul_gelu_forward_bf16(float* out, void* act_out, const void* inp, const uint16_t* weight,
                             const float* bias, int B, int T, int C, int OC, int inp_dtype,
                             int act_dtype);

/* The plain loops (k = 0, 1, ..., K-1 in float32), kept as the reference the
   fast paths are checked against; same contracts. */
int matmul_forward_bf16_naive(float* out, const void* inp, const uint16_t* weight,
                              const float* bias, int B, int T, int C, int OC, int inp_dtype);
int matmul_backward_bf16_naive(float* dinp, float* dweight, float* dbias,
                               const float* dout, const void* inp, const uint16_t* weight,
                               int B, int T, int C, int OC, int inp_dtype, int written);

/* ---- quant.c ------------------------------------------------------------ */

/*
 * Weights in llama.cpp's quantized blocks of 32 along the input dimension,
 * byte for byte as GGUF stores them (the values are GGML's type numbers):
 *   Q8_0  34 bytes a block: fp16 scale d, 32 int8 q;          w = d*q
 *   Q4_0  18 bytes a block: fp16 scale d, 16 bytes, byte j = q[j] | q[j+16] << 4;
 *                                                             w = d*(q - 8)
 * An unknown qtype is LLMC_ERR_VALUE; IC not a multiple of 32 LLMC_ERR_SHAPE.
 */
typedef enum {
    LLMC_QUANT_Q4_0 = 2,
    LLMC_QUANT_Q8_0 = 8
} llmc_quant_type;

/*
 * quantize_rows: each row of inp in blocks of 32, rounded as llama.cpp's
 * quantize_row_q8_0_ref / quantize_row_q4_0_ref (= gguf.quants.quantize).
 *
 *   out [rows, IC/32 * block bytes]  (written)
 *   inp [rows, IC]
 */
int quantize_rows(uint8_t* out, const float* inp, int rows, int IC, int qtype);

/*
 * dequantize_rows: the inverse, out = d * q (= gguf.quants.dequantize).
 *
 *   out [rows, IC]                   (written)
 *   inp [rows, IC/32 * block bytes]
 */
int dequantize_rows(float* out, const uint8_t* inp, int rows, int IC, int qtype);

/*
 * quant_pack_rows, quant_unpack_rows: quantize_rows' blocks (GGUF's bytes)
 * to the decoding layout the products below read, and back: the same bytes
 * per row, moved within each row (quant.c says where).
 *   out, blocks / packed  [rows, IC/32 * block bytes]
 */
int quant_pack_rows(uint8_t* out, const uint8_t* blocks, int rows, int IC, int qtype);
int quant_unpack_rows(uint8_t* out, const uint8_t* packed, int rows, int IC, int qtype);

/*
 * matmul_forward_quant: out[n,o] = bias[o] + sum_i x[n,i] * w[o,i], for few
 * rows (decoding), with each row x[n] first quantized to Q8_0 blocks (as
 * llama.cpp does) and w dequantized from weight's blocks: per block an
 * exact integer dot product times both scales, added into one of 16 float
 * lanes (lane b mod 16) in block order by a fused multiply-add, then the
 * lanes in a fixed tree in double with the bias, rounded once to float.
 *
 *   out    [N, OC]                        (written)
 *   inp    [N, IC]
 *   weight [OC, IC/32 * block bytes]      quant_pack_rows' layout; Q8_0
 *                                         int8s in [-127, 127]
 *   bias   [OC] or NULL
 * Variants _portable, _avx2, _avxvnni, _avx512vnni force a path
 * (LLMC_ERR_UNSUPPORTED where the CPU or build lacks it); all give the same
 * bits. The unsuffixed one picks the best under llmc_get_isa(). Returns
 * LLMC_ERR_NOMEM if the quantized rows' scratch cannot be allocated.
 */
int matmul_forward_quant(float* out, const float* inp, const uint8_t* weight, const float* bias,
                         int N, int IC, int OC, int qtype);
int matmul_forward_quant_portable(float* out, const float* inp, const uint8_t* weight,
                                  const float* bias, int N, int IC, int OC, int qtype);
int matmul_forward_quant_avx2(float* out, const float* inp, const uint8_t* weight,
                              const float* bias, int N, int IC, int OC, int qtype);
int matmul_forward_quant_avxvnni(float* out, const float* inp, const uint8_t* weight,
                                 const float* bias, int N, int IC, int OC, int qtype);
int matmul_forward_quant_avx512vnni(float* out, const float* inp, const uint8_t* weight,
                                    const float* bias, int N, int IC, int OC, int qtype);

/*
 * matmul_forward_quant_panels, matmul_backward_quant_panels: the many-row
 * products (prefill, LoRA's backward through a frozen quantized base), the
 * weight dequantised to bf16 a tile at a time (d*q rounded to the nearest
 * bf16) and multiplied by the bf16 GEMM: bitwise matmul_forward_bf16 /
 * matmul_backward_bf16's dinp on bf16(dequantize(W)), on its paths.
 *
 *   forward   out  [N, OC] (written) = inp [N, IC] . W^T + bias [OC] (or NULL)
 *   backward  dinp [N, IC] (+=)       = dout [N, OC] . W
 *   weight    [OC, IC/32 * block bytes]   quant_pack_rows' layout
 * Returns LLMC_ERR_NOMEM if a tile (at most 8 MiB of bf16, or 192 columns)
 * and an [N, tile] float part cannot be allocated.
 */
int matmul_forward_quant_panels(float* out, const float* inp, const uint8_t* weight,
                                const float* bias, int N, int IC, int OC, int qtype);
int matmul_backward_quant_panels(float* dinp, const float* dout, const uint8_t* weight,
                                 int N, int IC, int OC, int qtype);

/*
 * moe_grouped_forward_quant: moe_grouped_forward (no bias) on quantized
 * experts, R = N k grouped rows:
 *   out[r, :] = inp[r, :] . W_e^T   for offsets[e] <= r < offsets[e+1]
 * An expert with 1 .. few_rows rows is bitwise matmul_forward_quant on its
 * rows (all such experts' output rows in one parallel loop: decoding), one
 * with more bitwise matmul_forward_quant_panels (prefill).
 *
 *   out      [R, OC]                          (written)
 *   inp      [R, IC]
 *   weight   [E * OC, IC/32 * block bytes]    quant_pack_rows' layout,
 *                                             expert e's rows at e * OC
 *   offsets  [E + 1]   int32 from moe_permute: 0, non-decreasing, R at the
 *                      end (else LLMC_ERR_RANGE)
 * Variants _portable, _avx2, _avxvnni, _avx512vnni force the few-row path,
 * as matmul_forward_quant's.
 */
int moe_grouped_forward_quant(float* out, const float* inp, const uint8_t* weight,
                              const int* offsets, int R, int IC, int OC, int E, int qtype,
                              int few_rows);
int moe_grouped_forward_quant_portable(float* out, const float* inp, const uint8_t* weight,
                                       const int* offsets, int R, int IC, int OC, int E,
                                       int qtype, int few_rows);
int moe_grouped_forward_quant_avx2(float* out, const float* inp, const uint8_t* weight,
                                   const int* offsets, int R, int IC, int OC, int E, int qtype,
                                   int few_rows);
int moe_grouped_forward_quant_avxvnni(float* out, const float* inp, const uint8_t* weight,
                                      const int* offsets, int R, int IC, int OC, int E,
                                      int qtype, int few_rows);
int moe_grouped_forward_quant_avx512vnni(float* out, const float* inp, const uint8_t* weight,
                                         const int* offsets, int R, int IC, int OC, int E,
                                         int qtype, int few_rows);

/* ---- attention.c -------------------------------------------------------- */

/*
 * attention_forward: causal multi-head self-attention over packed q, k, v.
 * For head h (hs = C / NH channels), query t attends to keys t2 <= t:
 *   att[b,h,t,t2] = softmax_t2(q[b,t,h] . k[b,t2,h] / sqrt(hs))
 *   out[b,t,h]    = sum_t2 att[b,h,t,t2] * v[b,t2,h]
 * att itself is not kept: only each row's softmax statistics, from which
 * the backward (and attention_gqa_probs) recompute it bitwise.
 *
 *   out   [B, T, C]       (written)
 *   stats [B, NH, T, 2]   (written) per query row: [0] the max of its
 *                         scores, [1] 1 / sum_t2 exp(score - max); saved
 *                         for backward
 *   inp   [B, T, 3C]      q, k, v side by side in each row
 * C % NH must be 0.
 */
int attention_forward(float* out, float* stats, const float* inp,
                      int B, int T, int C, int NH);

/*
 * attention_backward: gradients of attention_forward.
 *
 *   dinp    [B, T, 3C]      (+=) dq, dk, dv side by side
 *   dout    [B, T, C]
 *   inp     [B, T, 3C]      forward input
 *   stats   [B, NH, T, 2]   saved by attention_forward
 *   written 1: dinp is written instead (bitwise the sum into a zeroed dinp,
 *           the sign of a zero included; its values are never read), 0: +=
 */
int attention_backward(float* dinp, const float* dout, const float* inp, const float* stats,
                       int B, int T, int C, int NH, int written);

/*
 * attention_gqa_forward: causal grouped-query attention over packed q, k, v
 * heads, optionally with ALiBi and a sliding window. Query head h reads kv
 * head h / (NH / NKV) (NKV == NH: multi-head; NKV == 1: multi-query). Query
 * t attends to keys lo(t) <= t2 <= t, where lo(t) = max(0, t - window + 1)
 * with a window of window keys (Mistral's), and lo(t) = 0 for window 0:
 *   score = q[b,t,h] . k[b,t2,h/(NH/NKV)] / sqrt(hs) - slopes[h] * (t - t2)
 *   att[b,h,t,t2] = softmax_t2(score)
 *   out[b,t,h]    = sum_t2 att[b,h,t,t2] * v[b,t2,h/(NH/NKV)]
 * As in attention_forward, only the softmax statistics of att are kept.
 * With a window, time is O(T window), not O(T^2).
 *
 *   out    [B, T, NH hs]            (written)
 *   stats  [B, NH, T, 2]            (written) per query row: [0] the max of
 *                                   its scores, [1] 1 / sum_t2 exp(score -
 *                                   max); saved for backward
 *   inp    [B, T, (NH + 2 NKV) hs]  NH q heads, then NKV k heads, then NKV
 *                                   v heads in each row
 *   slopes [NH] ALiBi slope per head, or NULL (no position bias)
 *   window keys a query attends to, itself included; 0: all before it
 *   dropout probability in [0, 1) (else LLMC_ERR_VALUE) of dropping each
 *          att[b,h,t,t2]: out sums att * M / (1 - dropout) * v, M the mask of
 *          element (b, h T + t, t2) of dropout_forward on [B, NH T, T] with
 *          seed; stats stay those of att. 0: no dropout (seed unused)
 * NH % NKV must be 0.
 */
int attention_gqa_forward(float* out, float* stats, const float* inp, const float* slopes,
                          int B, int T, int NH, int NKV, int hs, int window, float dropout,
                          uint64_t seed);

/*
 * attention_gqa_backward: gradients of attention_gqa_forward. It recomputes
 * the scores, so it takes the forward's slopes and window too.
 *
 *   dinp   [B, T, (NH + 2 NKV) hs]  (+=) dq, dk, dv heads as in inp
 *   dout   [B, T, NH hs]
 *   inp    [B, T, (NH + 2 NKV) hs]  forward input
 *   stats  [B, NH, T, 2]            saved by attention_gqa_forward
 *   slopes [NH] the forward's, or NULL
 *   window, dropout, seed  the forward's
 *   written 1: dinp written, not added into (as attention_backward's), or 0
 */
int attention_gqa_backward(float* dinp, const float* dout, const float* inp, const float* stats,
                           const float* slopes, int B, int T, int NH, int NKV, int hs,
                           int window, float dropout, uint64_t seed, int written);

/* ---- attention_bf16.c --------------------------------------------------- */

/*
 * attention_gqa_forward_bf16: attention_gqa_forward (the same arrays, sizes
 * and statistics) with its two products on bf16 operands summed in float32,
 * softmax and statistics in float32 (bf16 models):
 *   score = bf16(q) . bf16(k) / sqrt(hs) - slopes[h] * (t - t2)
 *   out   = sum_t2 bf16(att (dropped)) * bf16(v)
 * bf16(x): x rounded to nearest even as float_to_bf16 does, a denormal
 * result flushed to 0. The sums' order is stated in attention_bf16.c.
 */
int attention_gqa_forward_bf16(float* out, float* stats, const float* inp, const float* slopes,
                               int B, int T, int NH, int NKV, int hs, int window, float dropout,
                               uint64_t seed);

/*
 * attention_gqa_backward_bf16: gradients of attention_gqa_forward_bf16
 * (attention_gqa_backward's arrays), P recomputed bitwise from stats:
 *   dP = bf16(dout) . bf16(v)    dS = P (dP - sum_t2 P dP) / sqrt(hs)  (float32)
 *   dq += bf16(dS) bf16(k)   dk += bf16(dS)^T bf16(q)   dv += bf16(P)^T bf16(dout)
 * written as attention_gqa_backward's.
 */
int attention_gqa_backward_bf16(float* dinp, const float* dout, const float* inp,
                                const float* stats, const float* slopes, int B, int T, int NH,
                                int NKV, int hs, int window, float dropout, uint64_t seed,
                                int written);

/* ---- attention_probs.c -------------------------------------------------- */

/*
 * attention_gqa_probs: the probabilities att of attention_gqa_forward,
 * recomputed from its input and statistics: bitwise the ones its out was
 * computed from (on the same instruction set, see llmc_set_isa), before any
 * dropout.
 *
 *   att    [B, NH, T, T]            (written) att[b,h,t,t2], 0 where t2 > t
 *                                   or t2 < lo(t)
 *   inp    [B, T, (NH + 2 NKV) hs]  the forward's input
 *   stats  [B, NH, T, 2]            saved by attention_gqa_forward (or
 *                                   attention_forward, with NKV == NH)
 *   slopes [NH] the forward's, or NULL
 */
int attention_gqa_probs(float* att, const float* inp, const float* stats, const float* slopes,
                        int B, int T, int NH, int NKV, int hs, int window);

/*
 * attention_gqa_entropy: the entropy (natural log) of each query row of the
 * probabilities of attention_gqa_forward, from its input and statistics;
 * the scores are recomputed a few rows at a time, att is never held whole:
 *   entropy[b,h,t] = -sum_{lo(t) <= t2 <= t} att[b,h,t,t2] ln att[b,h,t,t2]
 * between 0 (one key takes all the weight) and ln(t + 1 - lo(t)) (uniform).
 *
 *   entropy [B, NH, T]               (written)
 *   inp     [B, T, (NH + 2 NKV) hs]  the forward's input
 *   stats   [B, NH, T, 2]            saved by attention_gqa_forward (or
 *                                    attention_forward, with NKV == NH)
 *   slopes  [NH] the forward's, or NULL
 */
int attention_gqa_entropy(float* entropy, const float* inp, const float* stats,
                          const float* slopes, int B, int T, int NH, int NKV, int hs,
                          int window);

/* ---- attention_naive.c -------------------------------------------------- */

/*
 * The plain loops, llm.c's attention_forward / attention_backward with GQA
 * and ALiBi: the reference the tiled kernels are checked against. They keep
 * the whole of att [B, NH, T, T] (written by the forward, 0 outside the window;
 * read by the backward, which needs no slopes) where the tiled kernels keep
 * stats; otherwise attention_gqa_forward's / _backward's contracts and
 * checks. They differ from the tiled kernels only in rounding. att holds the
 * probabilities before any dropout.
 */
int attention_forward_naive(float* out, float* att, const float* inp, const float* slopes,
                            int B, int T, int NH, int NKV, int hs, int window, float dropout,
                            uint64_t seed);
int attention_backward_naive(float* dinp, const float* dout, const float* inp, const float* att,
                             int B, int T, int NH, int NKV, int hs, int window, float dropout,
                             uint64_t seed, int written);

/*
 * attention_entropy_naive: attention_gqa_entropy's plain twin, from the
 * whole of att (as attention_forward_naive writes it):
 *   entropy[b,h,t] = -sum_{t2 <= t, att > 0} att[b,h,t,t2] ln att[b,h,t,t2]
 *
 *   entropy [B, NH, T]     (written)
 *   att     [B, NH, T, T]  probabilities; entries t2 > t are not read (those
 *                          before a sliding window are 0 and add nothing)
 */
int attention_entropy_naive(float* entropy, const float* att, int B, int NH, int T);

/* ---- attention_decode.c ------------------------------------------------- */

/*
 * attention_decode: one new query position per row, against a KV cache.
 * Row b's query (at position len[b] - 1) attends to its window of cached
 * positions lo <= t2 < len[b] (lo = max(0, len[b] - window) with a window,
 * else 0), with the same scores as attention_gqa_forward (1/sqrt(hs)
 * scale, kv head h / (NH / NKV), ALiBi -slopes[h] * (len[b] - 1 - t2)):
 *   att[b,h,t2] = softmax_t2(score)
 *   out[b,h]    = sum_t2 att[b,h,t2] * v_cache[b,t2 % maxT,h/(NH/NKV)]
 * bitwise equal to row len[b] - 1 of attention_gqa_forward's out.
 *
 * The cache is a ring of maxT slots: position t2 lives in slot t2 % maxT
 * (with no window, positions never reach maxT, so the slot is t2 itself; a
 * rolling cache of a sliding-window model needs only maxT = window slots).
 *
 *   out     [B, NH hs]         (written)
 *   att     [B, NH, maxT]      (written) the probabilities of the window's
 *                              keys in order, from [0]; the rest is not
 *                              written. The caller's buffer for the scores,
 *                              so that no call allocates, whatever maxT
 *   q       [B, NH hs]         the new position's query heads (already
 *                              rotated for RoPE)
 *   k_cache [B, maxT, NKV hs]  keys of the window's positions of row b, in
 *                              their slots (other slots are not read)
 *   v_cache [B, maxT, NKV hs]
 *   len     [B] int32, len[b] >= 1 and len[b] - lo <= maxT (the window fits
 *           in the ring); else LLMC_ERR_RANGE
 *   slopes  [NH] or NULL
 *   window  keys a query attends to (0: every position before it)
 * NH % NKV must be 0.
 */
int attention_decode(float* out, float* att, const float* q, const float* k_cache,
                     const float* v_cache, const int* len, const float* slopes,
                     int B, int NH, int NKV, int hs, int maxT, int window);

/* ---- rope.c ------------------------------------------------------------- */

/*
 * rope_forward: rotary position embedding on the q and k heads of packed
 * rows, in the half-split ("rotate half") layout of Hugging Face's Llama:
 * channel i of a head pairs with channel i + hs/2 (not with i + 1). For the
 * token at position p = pos[b] + t and i < hs/2, with angle
 * a = p * theta^(-2i/hs) (computed in double):
 *   out[i]        = x[i] cos a - x[i + hs/2] sin a
 *   out[i + hs/2] = x[i + hs/2] cos a + x[i] sin a
 * With interleaved = 1, Meta's original layout: pair i is channels 2i and
 * 2i + 1 (out[2i] = x[2i] cos a - x[2i+1] sin a, and so on), same angles.
 * The NKV v heads are copied unchanged.
 *
 *   out [B, T, (NH + 2 NKV) hs]  (written; may be inp) rotated q, rotated k, v
 *   inp [B, T, (NH + 2 NKV) hs]  NH q heads, NKV k heads, NKV v heads
 *   pos [B] int32 position of each row's first token, >= 0; or NULL (all 0)
 *   inv_freq [hs/2] float64 each pair's frequency (a scaled RoPE), positive
 *       and finite, else LLMC_ERR_VALUE; or NULL: theta^(-2i/hs)
 *   interleaved 0 (half-split) or 1 (interleaved pairs), else LLMC_ERR_VALUE
 * hs must be even; theta must be positive and finite, else LLMC_ERR_VALUE.
 */
int rope_forward(float* out, const float* inp, const int* pos, const double* inv_freq,
                 int B, int T, int NH, int NKV, int hs, float theta, int interleaved);

/*
 * rope_backward: gradients of rope_forward (the inverse rotation of dout;
 * v heads pass through).
 *
 *   dinp [B, T, (NH + 2 NKV) hs]  (+=)
 *   dout [B, T, (NH + 2 NKV) hs]
 *   pos  [B] int32 or NULL, inv_freq [hs/2] or NULL, interleaved, as in the
 *        forward
 *   written 1: dinp is written instead (bitwise the sum into a zeroed dinp,
 *        without reading or zeroing it first); 0: added into
 */
int rope_backward(float* dinp, const float* dout, const int* pos, const double* inv_freq,
                  int B, int T, int NH, int NKV, int hs, float theta, int interleaved,
                  int written);

/*
 * rope_table: the cos and sin rope_forward turns pair i by at position p,
 * for every p < P (as floats, the same bits rope_forward computes).
 *
 *   cos_table, sin_table [P, hs/2]  (written)
 *   inv_freq [hs/2] or NULL, theta: as in rope_forward
 */
int rope_table(float* cos_table, float* sin_table, const double* inv_freq, int P, int hs,
               float theta);

/*
 * kv_cache_write: one new position per row of KV-cache decoding. Row b of
 * qkv (its token at position pos[b]) is turned as rope_forward turns it,
 * with the angles' cos and sin read from row pos[b] of a rope_table (bitwise
 * rope_forward's result), or copied when the tables are NULL (a model
 * without RoPE); its q heads are written to q, its k and v heads into slot
 * pos[b] % slots of row b of the caches.
 *
 *   q       [B, NH hs]            (written)
 *   k_cache [B, slots, NKV hs]    (slot pos[b] % slots of row b written)
 *   v_cache [B, slots, NKV hs]    (likewise)
 *   qkv     [B, (NH + 2 NKV) hs]  NH q heads, NKV k heads, NKV v heads
 *   pos     [B] int32 >= 0, and < P with tables; else LLMC_ERR_RANGE
 *   cos_table, sin_table [P, hs/2] (rope_table's), or both NULL
 *   interleaved 0 or 1 (rope_forward's pair layout), else LLMC_ERR_VALUE
 * With tables hs must be even.
 */
int kv_cache_write(float* q, float* k_cache, float* v_cache, const float* qkv, const int* pos,
                   const float* cos_table, const float* sin_table, int B, int NH, int NKV,
                   int hs, int slots, int P, int interleaved);

/* ---- activations.c ------------------------------------------------------ */

/* Every MLP activation's forward writes its out float32, or bf16 (out_dtype):
   the float32 result rounded (the MLP's second matmul reads it). Every
   backward adds into dinp, or with written = 1 writes it (bitwise the sum
   into a zeroed dinp, without reading or zeroing it first). */

/*
 * gelu_forward: out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 *
 *   out [N]  (written)
 *   inp [N]
 */
int gelu_forward(void* out, const float* inp, int64_t N, int out_dtype);

/*
 * gelu_backward: dinp += gelu'(inp) * dout
 *
 *   dinp [N]  (+=)
 *   dout [N]
 *   inp  [N]  forward input
 */
int gelu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int written);

/*
 * swiglu_forward: out = silu(gate) * up with silu(x) = x / (1 + exp(-x)),
 * where each row of inp holds the gate (x W1) and then the up projection
 * (x W3), as one matmul with the two weights stacked makes it.
 *
 *   out [N, FF]     (written)
 *   inp [N, 2 FF]   gate in columns [0, FF), up in columns [FF, 2 FF)
 */
int swiglu_forward(void* out, const float* inp, int64_t N, int FF, int out_dtype);

/*
 * swiglu_backward: gradients of swiglu_forward.
 *
 *   dinp [N, 2 FF]  (+=) dgate, dup
 *   dout [N, FF]
 *   inp  [N, 2 FF]  forward input
 */
int swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int FF,
                    int written);

/*
 * geglu_forward, reglu_forward: as swiglu_forward with another gate:
 * out = gelu(gate) * up (GeGLU; gelu_forward's tanh form) or
 * out = relu(gate) * up (ReGLU).
 *
 *   out [N, FF]     (written)
 *   inp [N, 2 FF]   gate in columns [0, FF), up in columns [FF, 2 FF)
 */
int geglu_forward(void* out, const float* inp, int64_t N, int FF, int out_dtype);
int reglu_forward(void* out, const float* inp, int64_t N, int FF, int out_dtype);

/*
 * geglu_backward, reglu_backward: gradients of geglu_forward, reglu_forward
 * (relu'(0) = 0, as torch has it).
 *
 *   dinp [N, 2 FF]  (+=) dgate, dup
 *   dout [N, FF]
 *   inp  [N, 2 FF]  forward input
 */
int geglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int FF,
                   int written);
int reglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int FF,
                   int written);

/*
 * relu_forward: out = max(inp, 0) (NaN stays NaN)
 * relu_backward: dinp += (inp > 0) * dout
 *
 *   out, dinp [N]  (written), (+=)
 *   dout      [N]
 *   inp       [N]  forward input
 */
int relu_forward(void* out, const float* inp, int64_t N, int out_dtype);
int relu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int written);

/*
 * gelu_erf_forward: out = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the exact GELU
 * gelu_erf_backward: dinp += (Phi(x) + x exp(-x^2 / 2) / sqrt(2 pi)) * dout
 *
 *   out, dinp [N]  (written), (+=)
 *   dout      [N]
 *   inp       [N]  forward input
 */
int gelu_erf_forward(void* out, const float* inp, int64_t N, int out_dtype);
int gelu_erf_backward(float* dinp, const float* dout, const float* inp, int64_t N,
                      int written);

/*
 * residual_forward: out = inp1 + inp2
 *
 *   out  [N]  (written) may alias inp1 or inp2
 *   inp1 [N]
 *   inp2 [N]
 */
int residual_forward(float* out, const float* inp1, const float* inp2, int64_t N);

/*
 * residual_backward: dinp1 += dout; dinp2 += dout
 *
 *   dinp1 [N]  (+=)
 *   dinp2 [N]  (+=)
 *   dout  [N]
 */
int residual_backward(float* dinp1, float* dinp2, const float* dout, int64_t N);

/* ---- dropout.c ---------------------------------------------------------- */

/*
 * dropout_forward: inverted dropout with a mask that is a hash of the
 * element's indices (none is stored; the backward regenerates it):
 *   out[b,t,c] = inp[b,t,c] * M[b,t,c] / (1 - p)
 * M[b,t,c] = 1 with probability 1 - p (to 2^-24), else 0, as a function of
 * (seed, b, t, c) alone: the same for any thread count. Batch row b draws
 * from seed + b * 0x9E3779B97F4A7C15 (mod 2^64), so rows b0 .. b0+B-1 of a
 * larger batch have that batch's masks under seed + b0 * 0x9E3779B97F4A7C15.
 * p == 0 is the identity, bitwise.
 *
 *   out  [B, T, C]  (written) may be inp
 *   inp  [B, T, C]
 *   p    in [0, 1), else LLMC_ERR_VALUE
 *   seed any 64-bit value
 */
int dropout_forward(float* out, const float* inp, int B, int T, int C, float p, uint64_t seed);

/*
 * dropout_backward: gradient of dropout_forward with the same p and seed,
 * the same masking: dinp[b,t,c] = dout[b,t,c] * M[b,t,c] / (1 - p).
 *
 *   dinp [B, T, C]  (written, not +=, so that it can run in place) may be dout
 *   dout [B, T, C]
 */
int dropout_backward(float* dinp, const float* dout, int B, int T, int C, float p,
                     uint64_t seed);

/* ---- softmax_xent.c ----------------------------------------------------- */

/*
 * softmax_forward: probs[b,t,:V] = softmax(logits[b,t,:V]); the padding
 * columns V..Vp-1 are ignored in logits and written as 0 in probs.
 *
 *   probs  [B, T, Vp]  (written)
 *   logits [B, T, Vp]
 */
int softmax_forward(float* probs, const float* logits, int B, int T, int V, int Vp);

/*
 * The target that is ignored: a row whose target is LLMC_IGNORE_INDEX adds
 * nothing to the loss or the gradient (loss 0, dlogits 0), as PyTorch's
 * cross_entropy(..., ignore_index=-1). Only targets may hold it; the caller
 * leaves such rows out of the mean.
 */
typedef enum { LLMC_IGNORE_INDEX = -1 } llmc_target;

/*
 * softmax_crossentropy_forward: the classifier's loss without probabilities:
 * per row, stats[b,t] = (max, inv) of the softmax over logits[b,t,:V]
 * (inv = 1 / sum_i exp(logits[b,t,i] - max)) and
 * losses[b,t] = -log(exp(logits[b,t,target] - max) * inv), bitwise
 * -log(probs[b,t,target]) of softmax_forward's probs; losses[b,t] = 0 where
 * target == LLMC_IGNORE_INDEX (its stats are still written). logits are only
 * read.
 *
 *   losses  [B, T]      (written)
 *   stats   [B, T, 2]   (written)
 *   logits  [B, T, Vp]
 *   targets [B, T]      int32 in [0, V) or LLMC_IGNORE_INDEX; else LLMC_ERR_RANGE
 */
int softmax_crossentropy_forward(float* losses, float* stats, const float* logits,
                                 const int* targets, int B, int T, int V, int Vp);

/*
 * softmax_crossentropy_backward: the gradient through softmax and
 * cross-entropy together, from the forward's stats:
 * dlogits[b,t,i] = (p[b,t,i] - [i == target]) * dlosses[b,t] for i < V, and 0
 * in the padding columns, with p = exp(logits - max) * inv as the forward's;
 * a row whose target is LLMC_IGNORE_INDEX gets 0 in every column, whatever
 * its dlosses. dlogits may be logits itself (the gradient then replaces the
 * logits).
 *
 *   dlogits [B, T, Vp]  (written)
 *   logits  [B, T, Vp]
 *   stats   [B, T, 2]
 *   dlosses [B, T]
 *   targets [B, T]      int32 in [0, V) or LLMC_IGNORE_INDEX; else LLMC_ERR_RANGE
 */
int softmax_crossentropy_backward(float* dlogits, const float* logits, const float* stats,
                                  const float* dlosses, const int* targets,
                                  int B, int T, int V, int Vp);

/* ---- adamw.c ------------------------------------------------------------ */

/*
 * adamw_update: one AdamW step over N flat parameters, as llm.c's
 * gpt2_update: with bias corrections c1 = 1 - beta1^t, c2 = 1 - beta2^t,
 *   m = beta1 m + (1 - beta1) g
 *   v = beta2 v + (1 - beta2) g^2
 *   param -= lr * ((m / c1) / (sqrt(v / c2) + eps) + weight_decay * param)
 *
 *   params      [N]  (updated in place)
 *   params_bf16 [N]  (written) bf16 copy of the updated params, rounded to
 *                    nearest even (float_to_bf16), for the bf16 matmuls; or
 *                    NULL (fp32 training)
 *   m      [N]  (updated in place) first moment, zero before step 1
 *   v      [N]  (updated in place) second moment, zero before step 1
 *   grads  [N]
 * t is the step number, >= 1; else LLMC_ERR_VALUE.
 */
int adamw_update(float* params, uint16_t* params_bf16, float* m, float* v, const float* grads,
                 int64_t N, float learning_rate, float beta1, float beta2, float eps,
                 float weight_decay, int t);

/*
 * global_norm_squared: *out = sum_i x[i]^2, accumulated in double over fixed
 * chunks that are added in order.
 *
 *   out [1]  (written)
 *   x   [N]
 */
int global_norm_squared(double* out, const float* x, int64_t N);

/*
 * scale_inplace: x *= scale (e.g. gradient clipping)
 *
 *   x [N]  (updated in place)
 */
int scale_inplace(float* x, int64_t N, float scale);

/*
 * fill_zero: x = 0 (zero_grad's fill of a flat gradient buffer; a large one
 * with streaming stores, which do not read each line before writing it)
 *
 *   x [N]  (written)
 */
int fill_zero(float* x, int64_t N);

/* ---- moe.c -------------------------------------------------------------- */

/*
 * Mixture of Experts over N = B*T tokens, E experts, k of them per token
 * (1 <= k <= E, else LLMC_ERR_SHAPE). A token's k assignments go to rows of
 * a grouped buffer of R = N k rows in which each expert's rows are
 * contiguous (expert 0's first), each expert's tokens in ascending order:
 * expert e holds rows offsets[e] .. offsets[e+1], and assignment (n, j) is
 * row positions[n, j].
 *
 * moe_route_forward: the router's softmax and top k per token:
 *   probs[n, :] = softmax(logits[n, :]); experts[n, :] = the k largest
 *   probabilities, largest first, ties broken by the lower expert index;
 *   weights[n, j] = probs[n, experts[n, j]], divided by their sum over j
 *   when norm_topk_prob is 1 (Mixtral), else (0) as they are (OLMoE); any
 *   other value is LLMC_ERR_VALUE.
 * aux holds this call's auxiliary losses (their coefficients are the
 * backward's):
 *   aux[0] = E sum_e f_e P_e    load balancing (Switch Transformer), with
 *            f_e = (assignments to e) / (N k) and P_e = mean_n probs[n, e];
 *            1 when balanced. transformers' load_balancing_loss_func counts
 *            f_e per token instead, (assignments to e) / N: k times this.
 *   aux[1] = mean_n logsumexp(logits[n, :])^2    the router z-loss (ST-MoE)
 *
 *   probs   [N, E]  (written) saved for backward
 *   weights [N, k]  (written)
 *   experts [N, k]  (written) int32, saved for backward
 *   aux     [2]     (written)
 *   logits  [N, E]
 */
int moe_route_forward(float* probs, float* weights, int* experts, float* aux, const float* logits,
                      int N, int E, int k, int norm_topk_prob);

/*
 * moe_route_backward: the router's gradient, from the top-k weights (through
 * their renormalisation, when norm_topk_prob, and the softmax) and from
 * aux_coef * aux[0] + z_coef * aux[1] (f_e taken as constant, as usual).
 * Both coefficients finite, else LLMC_ERR_VALUE. With fractions, f_e is
 * fractions[e] (a batch's of which these N tokens are one rank's part: the
 * load-balancing term's gradient is then aux_coef E f_e / N per token, whose
 * mean over equal ranks is that of the whole batch); NULL: these tokens'.
 *
 *   dlogits   [N, E]  (+=)
 *   dweights  [N, k]  or NULL: no gradient reaches the weights
 *   probs     [N, E]  the forward's
 *   logits    [N, E]  the forward's
 *   experts   [N, k]  the forward's, each in [0, E) (else LLMC_ERR_RANGE)
 *   fractions [E]     double, each finite (else LLMC_ERR_VALUE), or NULL
 *   written   1: dlogits is written instead (bitwise the sum into zeros); 0
 */
int moe_route_backward(float* dlogits, const float* dweights, const float* probs,
                       const float* logits, const int* experts, const double* fractions, int N,
                       int E, int k, int norm_topk_prob, float aux_coef, float z_coef,
                       int written);

/*
 * moe_permute: the grouped order of the forward's assignments.
 *
 *   offsets   [E + 1]  (written) int32: expert e's rows start at offsets[e];
 *                      offsets[E] = N k (a count is offsets[e+1] - offsets[e])
 *   positions [N, k]   (written) int32: the row of assignment (n, j)
 *   experts   [N, k]   int32 in [0, E), else LLMC_ERR_RANGE
 */
int moe_permute(int* offsets, int* positions, const int* experts, int N, int E, int k);

/*
 * moe_gather_forward: grouped[positions[n, j], :] = inp[n, :], copied as
 * they are: both float32 or both bf16 (grouped_dtype and inp_dtype equal,
 * else LLMC_ERR_VALUE; a bf16 model's rows for its bf16 grouped GEMM).
 * moe_gather_backward: dinp[n, :] += sum_j dgrouped[positions[n, j], :], in
 * the order j = 0 .. k-1.
 *
 *   grouped, dgrouped [N k, C]  (written), the gradient of grouped
 *   inp, dinp         [N, C]    the tokens, (+=)
 *   positions         [N, k]    int32 from moe_permute, each in [0, N k)
 *                               (else LLMC_ERR_RANGE)
 *   written           1: dinp is written instead (bitwise the sum into zeros); 0
 */
int moe_gather_forward(void* grouped, const void* inp, const int* positions, int N, int C, int k,
                       int grouped_dtype, int inp_dtype);
int moe_gather_backward(float* dinp, const float* dgrouped, const int* positions, int N, int C,
                        int k, int written);

/*
 * moe_combine_forward: out[n, :] = sum_j weights[n, j] expert_out[positions[n, j], :],
 * in the order j = 0 .. k-1.
 * moe_combine_backward: dexpert_out[positions[n, j], :] = weights[n, j] dout[n, :];
 * dweights[n, j] = dout[n, :] . expert_out[positions[n, j], :].
 *
 *   out, dout               [N, C]    (written), its gradient
 *   expert_out, dexpert_out [N k, C]  the experts' outputs, grouped; (written)
 *   weights, dweights       [N, k]    the top-k weights; (written)
 *   positions               [N, k]    int32 from moe_permute, each in [0, N k)
 */
int moe_combine_forward(float* out, const float* expert_out, const float* weights,
                        const int* positions, int N, int C, int k);
int moe_combine_backward(float* dexpert_out, float* dweights, const float* dout,
                         const float* expert_out, const float* weights, const int* positions,
                         int N, int C, int k);

/*
 * moe_grouped_forward: each expert's linear layer (no bias) over its rows of
 * the grouped buffer, R = N k rows in all:
 *   out[r, :] = inp[r, :] . weight[e]^T   for offsets[e] <= r < offsets[e+1]
 * as one parallel loop over the tiles of all experts (bf16: the experts'
 * work cut into equal shares of the threads, an expert split between two
 * threads where a share ends). Each row is bitwise what matmul_forward
 * gives for it with weight[e].
 * moe_grouped_backward: its gradients, each bitwise matmul_backward's:
 *   dinp[r, :] += dout[r, :] . weight[e]; dweight[e] += dout_e^T . inp_e
 *
 *   out, dout    [R, OC]     (written), its gradient
 *   inp, dinp    [R, C]      the grouped rows, (+=) or NULL (not wanted)
 *   weight       [E, OC, C]  (may be NULL when dinp is)
 *   dweight      [E, OC, C]  (+=) or NULL; an expert with no rows keeps its
 *                            gradient (is zeroed if written)
 *   offsets      [E + 1]     int32 from moe_permute: 0, non-decreasing, R at
 *                            the end (else LLMC_ERR_RANGE)
 *   written      LLMC_WRITE_DINP | LLMC_WRITE_DWEIGHT, or 0: those outputs
 *                written instead (bitwise the sum into zeros), as
 *                matmul_backward's
 */
int moe_grouped_forward(float* out, const float* inp, const float* weight, const int* offsets,
                        int R, int C, int OC, int E);
int moe_grouped_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                         const float* weight, const int* offsets, int R, int C, int OC, int E,
                         int written);

/*
 * The same with bf16 weights [E, OC, C] and inp float32 or bf16 (inp_dtype,
 * as matmul_forward_bf16's): each row and each dweight[e] bitwise what
 * matmul_forward_bf16 / matmul_backward_bf16 give for it (the products'
 * roundings and order are theirs, on the same instruction set).
 */
int moe_grouped_forward_bf16(float* out, const void* inp, const uint16_t* weight,
                             const int* offsets, int R, int C, int OC, int E, int inp_dtype);
int moe_grouped_backward_bf16(float* dinp, float* dweight, const float* dout, const void* inp,
                              const uint16_t* weight, const int* offsets, int R, int C, int OC,
                              int E, int inp_dtype, int written);

/* ---- lora_bf16.c -------------------------------------------------------------- */

/*
 * The up side of one linear layer's n LoRA adapters of rank r, in bf16
 * (model/lora.py): adapter j adapts the output columns
 * rows[j][0] <= o < rows[j][1] of a layer of W outputs (ascending, disjoint,
 * non-empty ranges, else LLMC_ERR_RANGE); h holds x A^T of every adapter
 * side by side, up_t their scaled B's transposed, of which adapter j's
 * block up_t[j, :, its columns] alone is read. Each product is the bf16
 * GEMM's (float32 operands rounded to bf16, sums in float32), one batch for
 * all adapters, except that on avx512bf16 the backward reads dout once for
 * both of its products, and dh sums each 256 to 1024 columns of an adapter
 * apart, then adds those parts in column order (lora_bf16.c):
 *   lora_up_forward_bf16:  out[t, o] += sum_i h[t, j, i] up_t[j, i, o]
 *   lora_up_backward_bf16: dh[t, j, i] = sum_o dout[t, o] up_t[j, i, o]
 *                          dup_t[j, i, o] = sum_t h[t, j, i] dout[t, o]
 * (o over adapter j's columns; dup_t's other entries are left as they are).
 *
 *   out, dout    [B, T, W]   (+=), the layer output's gradient
 *   h, dh        [B, T, n, r]      (written)
 *   up_t, dup_t  [n, r, W]   bf16, float32 (written in each adapter's columns)
 *   rows         [n, 2]      int32
 */
int lora_up_forward_bf16(float* out, const float* h, const uint16_t* up_t, const int* rows,
                         int B, int T, int W, int n, int r);
int lora_up_backward_bf16(float* dh, float* dup_t, const float* dout, const float* h,
                          const uint16_t* up_t, const int* rows, int B, int T, int W, int n,
                          int r);
