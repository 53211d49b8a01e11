/* Element-wise layers: the MLP activations (GELU in its tanh approximation
   and exact with erf, ReLU) and the gated MLPs (SwiGLU, GeGLU, ReGLU), and
   the residual add. GELU and the gated kernels run on 16-lane vectors with
   exponentials of their own (gelu_sigmoid16) or llmc_exp16's (common.h,
   through llmc_exp_nonpositive16_isa) in place of libm's expf; exact GELU calls libm's erfcf per element (no vector
   erf of our own). Each vector kernel's loop is built per instruction set
   (isa.h); a thread runs its contiguous share of the blocks through one call.
   Each MLP activation's forward writes float32 or bf16 (llmc_store16_as:
   the float32 result rounded), the latter for the bf16 matmul that reads it. */
#include <math.h>

#include "llmc.h"
#include "common.h"
#include "isa.h"
#include "gemm.h"

/* The MLP activations' bf16 stores. The avx512bf16 build of every MLP
   activation's forward (LLMC_ISA_VARIANTS_BF16) stores whole vectors with
   vcvtneps2bf16, which rounds to nearest even as llmc_bf16_round does, NaNs
   too, but reads float32 denormals as 0. So it also gathers which lanes held
   a denormal (vfpclassps, AVX512DQ: part of isa.h's avx512bf16); if any
   did, the caller stores that run of vectors again through llmc_store16_as.
   Not always-inline, and v by pointer (a vector argument's passing would
   change with the caller's instruction set): the other builds hold a call
   to it that their constant isa removes; the avx512bf16 build inlines it. */
#ifdef LLMC_X86_DISPATCH
#include <immintrin.h>
LLMC_TARGET_AVX512BF16 static inline void store16_bf16_converted(uint16_t* out, const vec16f* v,
                                                                 unsigned* denormal_lanes) {
    *denormal_lanes |= _mm512_fpclass_ps_mask((__m512)*v, 0x20);   // 0x20: denormal
    _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh((__m512)*v));
}
#endif

/* The element-wise kernels' one calling pattern: checks, then each thread
   runs its share of the N / 16 blocks of 16 elements with the kernel's
   blocks function for this instruction set. */
typedef void (*elementwise_forward_fn)(void*, int, const float*, int64_t, int64_t, int64_t);
typedef void (*elementwise_backward_fn)(float*, const float*, const float*, int64_t, int64_t,
                                        int64_t, int);

static int elementwise_forward(elementwise_forward_fn blocks, void* out, const float* inp,
                               int64_t N, int out_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(out_dtype == LLMC_DTYPE_F32 || out_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    const int out_bf16 = out_dtype == LLMC_DTYPE_BF16;
    LLMC_SHARES((N + 15) / 16, N, blk0, blk1,
                if (blk0 < blk1) { blocks(out, out_bf16, inp, N, blk0, blk1); });
    return LLMC_OK;
}

static int elementwise_backward(elementwise_backward_fn blocks, float* dinp, const float* dout,
                                const float* inp, int64_t N, int written) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dout, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    #pragma omp parallel
    {
        int64_t blk0, blk1;
        llmc_thread_share((N + 15) / 16, &blk0, &blk1);
        if (blk0 < blk1) { blocks(dinp, dout, inp, N, blk0, blk1, written); }
    }
    return LLMC_OK;
}

/* What a backward adds its gradient onto: dinp's n values (+=), or 0 when
   dinp is written (the sum 0 + g, so bitwise a zeroed dinp's result). */
static LLMC_ALWAYS_INLINE vec16f dinp_start(const float* dinp, int n, int written) {
    const vec16f zero = {0};
    return written ? zero : llmc_load16(dinp, n);
}

#define GELU_SCALE 0.7978845608028654f   /* sqrt(2 / pi) */
#define GELU_CUBIC 0.044715f
#define GELU_EXP_BOUND 80.0f   /* |t| of e^t in the sigmoid; see gelu_sigmoid16 */

/*
 * GELU in its sigmoid form: 0.5 x (1 + tanh u) = x s, s = 1 / (1 + e),
 * e = e^(-2u), u = GELU_SCALE (x + GELU_CUBIC x^3); and 1 - s = e s. The
 * exponent t = -2u is clamped to [-80, 80] first, and s set to exactly 0
 * where t > 80 (true s below 2e-35; at t < -80, s is 1 in float anyway):
 * e stays a normal float, so no overflow, subnormal or infinity handling
 * is needed, and e s stays finite in the backward. This
 * makes it about half the work of a full-range exp and tanh. NaN stays
 * NaN (the clamps compare false). Exp: e^t = 2^n e^r, n = round(t / ln2)
 * by adding 1.5 * 2^23 (one rounding, to the nearest integer), r = t - n ln2
 * in two parts and e^r by llmc_exp_reduced16 (common.h), 2^n from n's bits.
 */
static LLMC_ALWAYS_INLINE void gelu_sigmoid16(vec16f x, vec16f* s, vec16f* e) {
    const vec16f zero = {0};
    const vec16f shifter = zero + 12582912.0f;   // 1.5 * 2^23
    vec16f t = -2.0f * GELU_SCALE * (x + GELU_CUBIC * x * x * x);
    const vec16i vanishes = LLMC_CMP16(t, >, zero + GELU_EXP_BOUND);
    t = llmc_select16(LLMC_CMP16(t, <, zero - GELU_EXP_BOUND), zero - GELU_EXP_BOUND, t);
    t = llmc_select16(vanishes, zero + GELU_EXP_BOUND, t);
    const vec16f shifted = t * 1.44269504088896341f + shifter;
    const vec16i n = (vec16i)shifted - (vec16i)shifter;
    const vec16f nf = shifted - shifter;
    *e = llmc_exp_reduced16(t, nf) * (vec16f)((n + 127) << 23);
    // s = 0 where vanishes: a mask, not llmc_select16, after which GCC divides twice
    *s = (vec16f)((vec16i)(1.0f / (1.0f + *e)) & ~vanishes);
}

/* What a forward computes: an element-wise MLP activation (gelu_forward,
   relu_forward), or a gated MLP's gate (gate16) times its up half. */
enum { ACT_GELU, ACT_RELU, GATE_SILU, GATE_GELU, GATE_RELU };

/*
 * The logistic sigmoid and its complement on 16 lanes, from e = exp(-|x|),
 * which never overflows:
 *   x >= 0: sig = 1 / (1 + e),  1 - sig = e / (1 + e)
 *   x <  0: sig = e / (1 + e),  1 - sig = 1 / (1 + e)
 * Both are then within a few ulp, also in the tails where 1 - sig or sig
 * alone would cancel or overflow. For x < -87.3, e flushes to 0 (llmc_exp16
 * gives no subnormals), so sig and silu are 0 where their true values are
 * below 1e-36. NaN stays NaN. e is llmc_exp16's, from the exponential for
 * x <= 0 that is bitwise it there and cheaper (llmc_exp_nonpositive16_isa).
 */
static LLMC_ALWAYS_INLINE void sigmoid16(const int isa, vec16f x, vec16f* sig, vec16f* sig_c) {
    const vec16i sign_bit = (vec16i){0} + (int32_t)0x80000000;
    const vec16f e = llmc_exp_nonpositive16_isa(isa, (vec16f)((vec16i)x | sign_bit));   // exp(-|x|)
    const vec16f r = 1.0f / (1.0f + e);
    const vec16f er = e * r;
    const vec16i positive = LLMC_CMP16(x, >=, (vec16f){0});
    *sig = llmc_select16(positive, r, er);
    *sig_c = llmc_select16(positive, er, r);
}

/* The gate of a gated MLP (Shazeer's GLU variants): out = act(gate) * up,
   act silu (SwiGLU), GELU's tanh form (GeGLU, as gelu_forward) or ReLU (ReGLU).
   gate16 gives act(g) and act'(g); a caller that needs only act(g) lets the
   compiler drop the derivative (everything here is inlined). */
static LLMC_ALWAYS_INLINE void gate16(const int isa, const int act, vec16f g, vec16f* a,
                                      vec16f* da) {
    const vec16f zero = {0};
    if (act == GATE_SILU) {
        // silu(g) = g s, and since s' = s (1 - s), silu'(g) = s (1 + g (1 - s))
        vec16f sig, sig_c;
        sigmoid16(isa, g, &sig, &sig_c);
        *a = g * sig;
        *da = sig * (1.0f + g * sig_c);
    } else if (act == GATE_GELU) {
        // as gelu_forward and gelu_backward
        vec16f s, e;
        gelu_sigmoid16(g, &s, &e);
        const vec16f du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * g * g);
        *a = g * s;
        *da = s * (1.0f + 2.0f * g * (e * s) * du);
    } else {
        // relu(g) = g for g >= 0, else 0 (NaN stays NaN); relu'(g) = 1 for g > 0, else 0
        *a = llmc_select16(LLMC_CMP16(g, <, zero), zero, g);
        *da = llmc_select16(LLMC_CMP16(g, >, zero), zero + 1.0f, zero);
    }
}

static LLMC_ALWAYS_INLINE vec16f activation16(const int act, vec16f x) {
    if (act == ACT_GELU) {
        vec16f s, e;
        gelu_sigmoid16(x, &s, &e);
        return x * s;
    }
    // relu(x) = x for x >= 0, else 0 (NaN stays NaN), as gate16's
    return llmc_select16(LLMC_CMP16(x, <, (vec16f){0}), (vec16f){0}, x);
}

/* The n (<= 16) outputs of kind from x: act(x[j]), or a gate's act(x[j]) *
   x[j + up] (up: where a row's up half starts, FF). */
static LLMC_ALWAYS_INLINE vec16f forward16(const int isa, const int kind, const float* x,
                                           int64_t up, int n) {
    if (kind < GATE_SILU) { return activation16(kind, llmc_load16(x, n)); }
    vec16f a, da;
    gate16(isa, kind, llmc_load16(x, n), &a, &da);
    return a * llmc_load16(x + up, n);
}

/* Vectors a bf16 store converts before it checks for denormals (a run
   holding one is stored again, rounded in integers). */
#define CONVERTED_RUN 64

/* out[out0 + j] = forward16 of x + j, for j in [j0, j1) in whole vectors
   (j1 - j0 a multiple of 16), float32 or bf16 (out_bf16): one loop per
   output type, so that no vector tests its type or its size. */
static LLMC_ALWAYS_INLINE void forward_vectors(const int isa, const int kind, void* out,
                                               int out_bf16, int64_t out0, const float* x,
                                               int64_t up, int64_t j0, int64_t j1) {
    for (int64_t j = j0; !out_bf16 && j < j1; j += 16) {
        llmc_store16((float*)out + out0 + j, forward16(isa, kind, x + j, up, 16), 16);
    }
    for (int64_t run = j0; out_bf16 && run < j1; run += 16 * CONVERTED_RUN) {
        const int64_t end = j1 - run < 16 * CONVERTED_RUN ? j1 : run + 16 * CONVERTED_RUN;
#ifdef LLMC_X86_DISPATCH
        if (isa == LLMC_ISA_AVX512BF16) {
            unsigned denormal_lanes = 0;
            for (int64_t j = run; j < end; j += 16) {
                const vec16f y = forward16(isa, kind, x + j, up, 16);
                store16_bf16_converted((uint16_t*)out + out0 + j, &y, &denormal_lanes);
            }
            if (denormal_lanes == 0) { continue; }
        }
#endif
        for (int64_t j = run; j < end; j += 16) {
            llmc_store16_as(out, 1, out0 + j, forward16(isa, kind, x + j, up, 16), 16);
        }
    }
}

/* Blocks [blk0, blk1) of 16 elements of an activation's forward; the last
   block of N may be partial. */
static LLMC_ALWAYS_INLINE void activation_forward_blocks(const int isa, const int act, void* out,
                                                         int out_bf16, const float* inp,
                                                         int64_t N, int64_t blk0,
                                                         int64_t blk1) {
    const int64_t whole = blk1 < N / 16 ? blk1 : N / 16;
    if (blk0 < whole) {
        forward_vectors(isa, act, out, out_bf16, 0, inp, 0, blk0 * 16, whole * 16);
    }
    for (int64_t blk = whole > blk0 ? whole : blk0; blk < blk1; blk++) {
        const int64_t i = blk * 16;
        const int n = N - i < 16 ? (int)(N - i) : 16;
        llmc_store16_as(out, out_bf16, i, forward16(isa, act, inp + i, 0, n), n);
    }
}

/* name_forward: its blocks' variants (the avx512bf16 one's bf16 stores
   converted) and the kernel itself, for activation act. */
#define ACTIVATION_FORWARD(name, act)                                                      \
    static LLMC_ALWAYS_INLINE void name##_forward_blocks_body(                             \
            const int isa, void* out, int out_bf16, const float* inp, int64_t N,          \
            int64_t blk0, int64_t blk1) {                                                  \
        activation_forward_blocks(isa, act, out, out_bf16, inp, N, blk0, blk1);            \
    }                                                                                      \
    LLMC_ISA_VARIANTS_BF16(name##_forward_blocks,                                         \
                           (void* out, int out_bf16, const float* inp, int64_t N,         \
                            int64_t blk0, int64_t blk1),                                   \
                           out, out_bf16, inp, N, blk0, blk1)                              \
    int name##_forward(void* out, const float* inp, int64_t N, int out_dtype) {           \
        return elementwise_forward(LLMC_ISA_SELECT_BF16(llmc_get_isa(),                    \
                                                        name##_forward_blocks),            \
                                   out, inp, N, out_dtype);                                \
    }

ACTIVATION_FORWARD(gelu, ACT_GELU)

llmc_forward_blocks_fn llmc_gelu_forward_blocks(int isa) {
    return LLMC_ISA_SELECT_BF16(isa, gelu_forward_blocks);
}

/* Blocks [blk0, blk1) of the backward. d/dx [x s(2u)] = s + x * 2 s (1 - s) du/dx
   = s (1 + 2 x (e s) du/dx), with du/dx = GELU_SCALE (1 + 3 GELU_CUBIC x^2) */
static LLMC_ALWAYS_INLINE void gelu_backward_blocks_body(float* dinp, const float* dout,
                                                         const float* inp, int64_t N, int64_t blk0,
                                                         int64_t blk1, int written) {
    for (int64_t blk = blk0; blk < blk1; blk++) {
        const int64_t i = blk * 16;
        const int n = N - i < 16 ? (int)(N - i) : 16;
        const vec16f x = llmc_load16(inp + i, n);
        vec16f s, e;
        gelu_sigmoid16(x, &s, &e);
        const vec16f du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * x * x);
        const vec16f grad = s * (1.0f + 2.0f * x * (e * s) * du);
        llmc_store16(dinp + i, dinp_start(dinp + i, n, written) + grad * llmc_load16(dout + i, n),
                     n);
    }
}
LLMC_ISA_VARIANTS(gelu_backward_blocks,
                  (float* dinp, const float* dout, const float* inp, int64_t N, int64_t blk0,
                   int64_t blk1, int written),
                  dinp, dout, inp, N, blk0, blk1, written)

int gelu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int written) {
    return elementwise_backward(LLMC_ISA_SELECT(llmc_get_isa(), gelu_backward_blocks), dinp,
                                dout, inp, N, written);
}

/* The gated kernels work on blocks of 16 columns of one row, the last block
   of each row possibly partial; rows and blocks are flattened (block k is
   block k % row_blocks of row k / row_blocks), so that one row (N == 1, as
   in decoding) still spreads over the threads. A thread's blocks [k0, k1)
   run row by row: row r's columns [*c0, *c1) hold its whole vectors
   [*c0, *whole) and, if *c1 > *whole, the row's partial last block. */
static LLMC_ALWAYS_INLINE void row_columns(int64_t r, int FF, int64_t k0, int64_t k1,
                                           int64_t* c0, int64_t* whole, int64_t* c1) {
    const int64_t row_blocks = (FF + 15) / 16, first = r * row_blocks;
    *c0 = (k0 > first ? k0 - first : 0) * 16;
    *c1 = k1 - first < row_blocks ? (k1 - first) * 16 : FF;
    *whole = *c1 < (FF & ~15) ? *c1 : (FF & ~15);
}

static LLMC_ALWAYS_INLINE void gated_forward_blocks(const int isa, const int act, void* out,
                                                    int out_bf16, const float* inp, int FF,
                                                    int64_t k0, int64_t k1) {
    const int64_t row_blocks = (FF + 15) / 16;
    for (int64_t r = k0 / row_blocks; r * row_blocks < k1; r++) {
        int64_t c0, whole, c1;
        row_columns(r, FF, k0, k1, &c0, &whole, &c1);
        const float* x = inp + (size_t)r * 2 * FF;
        forward_vectors(isa, act, out, out_bf16, r * FF, x, FF, c0, whole);
        if (c1 > whole) {
            llmc_store16_as(out, out_bf16, r * FF + whole,
                            forward16(isa, act, x + whole, FF, (int)(c1 - whole)),
                            (int)(c1 - whole));
        }
    }
}

/* dgate += dout * up * act'(gate),  dup += dout * act(gate) (or = when
   written), for the n (<= 16) columns of one row at x (its gate), dx, dy */
static LLMC_ALWAYS_INLINE void gated_backward16(const int isa, const int act, float* dx,
                                                const float* dy, const float* x, int FF, int n,
                                                int written) {
    const vec16f g = llmc_load16(x, n), u = llmc_load16(x + FF, n);
    const vec16f d = llmc_load16(dy, n);
    vec16f a, da;
    gate16(isa, act, g, &a, &da);
    llmc_store16(dx, dinp_start(dx, n, written) + d * u * da, n);
    llmc_store16(dx + FF, dinp_start(dx + FF, n, written) + d * a, n);
}

static LLMC_ALWAYS_INLINE void gated_backward_blocks(const int isa, const int act, float* dinp,
                                                     const float* dout, const float* inp,
                                                     int FF, int64_t k0, int64_t k1,
                                                     int written) {
    const int64_t row_blocks = (FF + 15) / 16;
    for (int64_t r = k0 / row_blocks; r * row_blocks < k1; r++) {
        int64_t c0, whole, c1;
        row_columns(r, FF, k0, k1, &c0, &whole, &c1);
        const size_t x0 = (size_t)r * 2 * FF, y0 = (size_t)r * FF;
        for (int64_t j = c0; j < whole; j += 16) {
            gated_backward16(isa, act, dinp + x0 + j, dout + y0 + j, inp + x0 + j, FF, 16,
                             written);
        }
        if (c1 > whole) {
            gated_backward16(isa, act, dinp + x0 + whole, dout + y0 + whole, inp + x0 + whole,
                             FF, (int)(c1 - whole), written);
        }
    }
}

/* one forward and one backward variant set per gate */
#define GATED_VARIANTS(name, act)                                                          \
    static LLMC_ALWAYS_INLINE void name##_forward_blocks_body(                             \
            const int isa, void* out, int out_bf16, const float* inp, int FF, int64_t k0, \
            int64_t k1) {                                                                  \
        gated_forward_blocks(isa, act, out, out_bf16, inp, FF, k0, k1);                    \
    }                                                                                      \
    LLMC_ISA_VARIANTS_BF16(name##_forward_blocks, (void* out, int out_bf16,               \
                                                   const float* inp, int FF, int64_t k0,  \
                                                   int64_t k1),                            \
                           out, out_bf16, inp, FF, k0, k1)                                 \
    static LLMC_ALWAYS_INLINE void name##_backward_blocks_body(                            \
            const int isa, float* dinp, const float* dout, const float* inp, int FF,      \
            int64_t k0, int64_t k1, int written) {                                         \
        gated_backward_blocks(isa, act, dinp, dout, inp, FF, k0, k1, written);             \
    }                                                                                      \
    LLMC_ISA_VARIANTS_ISA(name##_backward_blocks, (float* dinp, const float* dout,        \
                                                   const float* inp, int FF, int64_t k0,  \
                                                   int64_t k1, int written),               \
                          dinp, dout, inp, FF, k0, k1, written)

GATED_VARIANTS(swiglu, GATE_SILU)
GATED_VARIANTS(geglu, GATE_GELU)
GATED_VARIANTS(reglu, GATE_RELU)

typedef void (*gated_forward_fn)(void*, int, const float*, int, int64_t, int64_t);
typedef void (*gated_backward_fn)(float*, const float*, const float*, int, int64_t, int64_t,
                                  int);

static int gated_forward(gated_forward_fn blocks, void* out, const float* inp, int64_t N,
                         int FF, int out_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && FF > 0 && llmc_count_fits(N, FF, 2, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(out_dtype == LLMC_DTYPE_F32 || out_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    const int out_bf16 = out_dtype == LLMC_DTYPE_BF16;
    LLMC_SHARES(N * ((FF + 15) / 16), N * FF, k0, k1,
                if (k0 < k1) { blocks(out, out_bf16, inp, FF, k0, k1); });
    return LLMC_OK;
}

static int gated_backward(gated_backward_fn blocks, float* dinp, const float* dout,
                          const float* inp, int64_t N, int FF, int written) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dout, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && FF > 0 && llmc_count_fits(N, FF, 2, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    #pragma omp parallel
    {
        int64_t k0, k1;
        llmc_thread_share(N * ((FF + 15) / 16), &k0, &k1);
        if (k0 < k1) { blocks(dinp, dout, inp, FF, k0, k1, written); }
    }
    return LLMC_OK;
}

int swiglu_forward(void* out, const float* inp, int64_t N, int FF, int out_dtype) {
    return gated_forward(LLMC_ISA_SELECT_BF16(llmc_get_isa(), swiglu_forward_blocks), out, inp, N,
                         FF, out_dtype);
}

int swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int FF,
                    int written) {
    return gated_backward(LLMC_ISA_SELECT(llmc_get_isa(), swiglu_backward_blocks), dinp, dout,
                          inp, N, FF, written);
}

int geglu_forward(void* out, const float* inp, int64_t N, int FF, int out_dtype) {
    return gated_forward(LLMC_ISA_SELECT_BF16(llmc_get_isa(), geglu_forward_blocks), out, inp, N,
                         FF, out_dtype);
}

int geglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int FF,
                    int written) {
    return gated_backward(LLMC_ISA_SELECT(llmc_get_isa(), geglu_backward_blocks), dinp, dout,
                          inp, N, FF, written);
}

int reglu_forward(void* out, const float* inp, int64_t N, int FF, int out_dtype) {
    return gated_forward(LLMC_ISA_SELECT_BF16(llmc_get_isa(), reglu_forward_blocks), out, inp, N,
                         FF, out_dtype);
}

int reglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int FF,
                    int written) {
    return gated_backward(LLMC_ISA_SELECT(llmc_get_isa(), reglu_backward_blocks), dinp, dout,
                          inp, N, FF, written);
}

ACTIVATION_FORWARD(relu, ACT_RELU)

static LLMC_ALWAYS_INLINE void relu_backward_blocks_body(const int isa, float* dinp,
                                                         const float* dout, const float* inp,
                                                         int64_t N, int64_t blk0, int64_t blk1,
                                                         int written) {
    for (int64_t blk = blk0; blk < blk1; blk++) {
        const int64_t i = blk * 16;
        const int n = N - i < 16 ? (int)(N - i) : 16;
        vec16f a, da;
        gate16(isa, GATE_RELU, llmc_load16(inp + i, n), &a, &da);
        llmc_store16(dinp + i, dinp_start(dinp + i, n, written) + da * llmc_load16(dout + i, n),
                     n);
    }
}
LLMC_ISA_VARIANTS_ISA(relu_backward_blocks,
                      (float* dinp, const float* dout, const float* inp, int64_t N, int64_t blk0,
                       int64_t blk1, int written),
                      dinp, dout, inp, N, blk0, blk1, written)

int relu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int written) {
    return elementwise_backward(LLMC_ISA_SELECT(llmc_get_isa(), relu_backward_blocks), dinp,
                                dout, inp, N, written);
}

/* Exact GELU, x Phi(x), with Phi(x) = erfc(-x / sqrt 2) / 2: erfc keeps the
   left tail (where 1 + erf(x / sqrt 2) would cancel) accurate. Scalar libm,
   elements [i0, i1) per thread. */
#define INV_SQRT2 0.7071067811865476f
#define INV_SQRT_2PI 0.3989422804014327f

int gelu_erf_forward(void* out, const float* inp, int64_t N, int out_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(out_dtype == LLMC_DTYPE_F32 || out_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) {
            const float x = inp[i];
            const float y = x * (0.5f * erfcf(-x * INV_SQRT2));
            if (out_dtype == LLMC_DTYPE_BF16) { ((uint16_t*)out)[i] = llmc_bf16_round(y); }
            else { ((float*)out)[i] = y; }
        }
    }
    return LLMC_OK;
}

/* d/dx [x Phi(x)] = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) */
int gelu_erf_backward(float* dinp, const float* dout, const float* inp, int64_t N, int written) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dout, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        for (int64_t i = i0; i < i1; i++) {
            const float x = inp[i];
            const float grad = 0.5f * erfcf(-x * INV_SQRT2)
                               + x * (INV_SQRT_2PI * expf(-0.5f * x * x));
            dinp[i] = (written ? 0.0f : dinp[i]) + grad * dout[i];
        }
    }
    return LLMC_OK;
}

/* The residual add, elements [i0, i1). */
static LLMC_ALWAYS_INLINE void residual_forward_range_body(float* out, const float* inp1,
                                                           const float* inp2, int64_t i0,
                                                           int64_t i1) {
    for (int64_t i = i0; i < i1; i++) { out[i] = inp1[i] + inp2[i]; }
}
LLMC_ISA_VARIANTS(residual_forward_range, (float* out, const float* inp1, const float* inp2,
                                           int64_t i0, int64_t i1),
                  out, inp1, inp2, i0, i1)

int residual_forward(float* out, const float* inp1, const float* inp2, int64_t N) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp1, inp2), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    void (*const range)(float*, const float*, const float*, int64_t, int64_t) =
        LLMC_ISA_SELECT(llmc_get_isa(), residual_forward_range);
    LLMC_SHARES(N, N, i0, i1, if (i0 < i1) { range(out, inp1, inp2, i0, i1); });
    return LLMC_OK;
}

static LLMC_ALWAYS_INLINE void residual_backward_range_body(float* dinp1, float* dinp2,
                                                            const float* dout, int64_t i0,
                                                            int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        dinp1[i] += dout[i];
        dinp2[i] += dout[i];
    }
}
LLMC_ISA_VARIANTS(residual_backward_range, (float* dinp1, float* dinp2, const float* dout,
                                            int64_t i0, int64_t i1),
                  dinp1, dinp2, dout, i0, i1)

int residual_backward(float* dinp1, float* dinp2, const float* dout, int64_t N) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp1, dinp2, dout), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && (size_t)N <= LLMC_MAX_COUNT, LLMC_ERR_SHAPE);
    void (*const range)(float*, float*, const float*, int64_t, int64_t) =
        LLMC_ISA_SELECT(llmc_get_isa(), residual_backward_range);
    #pragma omp parallel
    {
        int64_t i0, i1;
        llmc_thread_share(N, &i0, &i1);
        if (i0 < i1) { range(dinp1, dinp2, dout, i0, i1); }
    }
    return LLMC_OK;
}
