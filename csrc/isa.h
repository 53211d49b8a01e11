/*
 * Run-time instruction-set dispatch, shared by every kernel family (private;
 * the choice itself is llmc_set_isa / llmc_get_isa in isa.c).
 *
 * setuptools compiles every file with one set of flags, so the per-ISA
 * builds come from per-function target attributes. A family writes its hot
 * loop once, as an always-inline body on the vector vocabulary of common.h
 * (vec16f and its helpers: GCC and clang lower a 16-lane vector to one zmm,
 * two ymm or four xmm registers), and LLMC_ISA_VARIANTS builds that body
 * into one function per instruction set:
 *   avx512   AVX-512F: Intel Skylake-SP/X (2017) and later Xeons, Ice Lake,
 *            Tiger Lake, Sapphire Rapids; AMD Zen 4 (2022) and later
 *   avx512bf16  AVX-512F + AVX512_BF16 (+ AVX512DQ, which every such CPU
 *            has): AMD Zen 4 and later, Intel Cooper Lake and Sapphire
 *            Rapids; the bf16 matmul, bf16 attention and the MLP
 *            activations' bf16 stores have builds of their own
 *            (LLMC_ISA_VARIANTS_BF16), every other family runs its avx512 build
 *   avx2     AVX2 + FMA: Intel Haswell (2013) and later, AMD Zen (2017) and
 *            later (and Excavator)
 *   portable no attribute: whatever the build's flags allow (SSE2 on a
 *            baseline x86-64 build; any CPU on other architectures)
 * A target attribute adds to the build's flags, never removes: on a
 * -march=native build every variant can use what the build CPU has.
 *
 * The caller reads the choice once, before its parallel region (OpenMP
 * outlines a region into a function of its own, which would not carry the
 * attribute), and calls the variant per row or block inside it:
 *   const row_fn row = LLMC_ISA_SELECT(llmc_get_isa(), layernorm_row);
 * Every variant runs the same operations in the same order; they differ
 * only where a build fuses a multiply and an add (FMA) and another does not.
 *
 * A body calls only always-inline helpers: GCC and clang inline a function
 * built for fewer CPU features into one built for more, but a helper left
 * out of line would run the build's baseline code.
 */
#ifndef LLMC_ISA_H
#define LLMC_ISA_H

#include "llmc.h"
#include "common.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define LLMC_X86_DISPATCH 1
#define LLMC_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define LLMC_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define LLMC_TARGET_AVX512BF16 \
    __attribute__((target("avx512f,avx512bf16,avx512dq,avx2,fma")))
#endif

/*
 * LLMC_ISA_VARIANTS(name, (params), args...): name_portable, name_avx2 and
 * name_avx512 (the latter two on x86 only), static void functions taking
 * params, each of which calls name_body(args...) built for its instruction
 * set. name_body must be static LLMC_ALWAYS_INLINE void. The variants are
 * never inlined, so that every caller of one runs the very same code.
 * LLMC_ISA_VARIANTS_ISA: the same, but name_body gets the variant's
 * instruction set as a constant first argument, to call the variants of
 * other functions through LLMC_ISA_SELECT (a direct call once inlined).
 * LLMC_ISA_SELECT(isa, name): the variant of name for isa (isa is
 * llmc_get_isa()'s, so always one this CPU supports).
 */
#define LLMC_ISA_VARIANT_(attr, name, params, call) \
    attr __attribute__((noinline)) static void name params { call; }
#ifdef LLMC_X86_DISPATCH
#define LLMC_ISA_VARIANTS(name, params, ...)                                              \
    LLMC_ISA_VARIANT_(, name##_portable, params, name##_body(__VA_ARGS__))               \
    LLMC_ISA_VARIANT_(LLMC_TARGET_AVX2, name##_avx2, params, name##_body(__VA_ARGS__))   \
    LLMC_ISA_VARIANT_(LLMC_TARGET_AVX512, name##_avx512, params, name##_body(__VA_ARGS__))
#define LLMC_ISA_VARIANTS_ISA(name, params, ...)                                          \
    LLMC_ISA_VARIANT_(, name##_portable, params,                                         \
                      name##_body(LLMC_ISA_PORTABLE, __VA_ARGS__))                       \
    LLMC_ISA_VARIANT_(LLMC_TARGET_AVX2, name##_avx2, params,                             \
                      name##_body(LLMC_ISA_AVX2, __VA_ARGS__))                           \
    LLMC_ISA_VARIANT_(LLMC_TARGET_AVX512, name##_avx512, params,                         \
                      name##_body(LLMC_ISA_AVX512, __VA_ARGS__))
#define LLMC_ISA_SELECT(isa, name)                                                        \
    ((isa) >= LLMC_ISA_AVX512 ? name##_avx512                                             \
     : (isa) == LLMC_ISA_AVX2 ? name##_avx2 : name##_portable)
#else
#define LLMC_ISA_VARIANTS(name, params, ...) \
    LLMC_ISA_VARIANT_(, name##_portable, params, name##_body(__VA_ARGS__))
#define LLMC_ISA_VARIANTS_ISA(name, params, ...) \
    LLMC_ISA_VARIANT_(, name##_portable, params, name##_body(LLMC_ISA_PORTABLE, __VA_ARGS__))
#define LLMC_ISA_SELECT(isa, name) ((void)(isa), name##_portable)
#endif

/* LLMC_ISA_VARIANTS_BF16(name, (params), args...): LLMC_ISA_VARIANTS_ISA's
   variants and, on x86, name_avx512bf16 (LLMC_TARGET_AVX512BF16), whose
   body gets LLMC_ISA_AVX512BF16; LLMC_ISA_SELECT_BF16 picks among the four. */
#ifdef LLMC_X86_DISPATCH
#define LLMC_ISA_VARIANTS_BF16(name, params, ...)                                         \
    LLMC_ISA_VARIANTS_ISA(name, params, __VA_ARGS__)                                      \
    LLMC_ISA_VARIANT_(LLMC_TARGET_AVX512BF16, name##_avx512bf16, params,                  \
                      name##_body(LLMC_ISA_AVX512BF16, __VA_ARGS__))
#define LLMC_ISA_SELECT_BF16(isa, name) \
    ((isa) == LLMC_ISA_AVX512BF16 ? name##_avx512bf16 : LLMC_ISA_SELECT(isa, name))
#else
#define LLMC_ISA_VARIANTS_BF16 LLMC_ISA_VARIANTS_ISA
#define LLMC_ISA_SELECT_BF16 LLMC_ISA_SELECT
#endif

/* llmc_exp_nonpositive16 (common.h) in a body built for isa: bitwise the
   same lanes (checked over every float x <= 0). The AVX-512 builds take
   n = floor(x / ln2 + 0.5) in one vrndscaleps and p * 2^n in one vscalefps
   (one rounding of the exact product, as the multiply by 2^n's bits), so a
   lane costs about half the instructions. Not always-inline, and x by
   pointer, as activations.c's store16_bf16_converted: the other builds hold
   a call that their constant isa removes. */
#ifdef LLMC_X86_DISPATCH
#include <immintrin.h>
LLMC_TARGET_AVX512 static inline void llmc_exp_nonpositive16_avx512(vec16f* x) {
    const __m512 v = (__m512)*x;
    const __mmask16 too_small = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.3365478515625f),
                                                   _CMP_LT_OQ);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512 t = _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f),
                                     _mm512_set1_ps(0.5f));
    const __m512 nf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    // lanes below lo or NaN compute garbage here, replaced just below
    const vec16f n = (vec16f)nf;
    vec16f p;
    llmc_exp_reduced16_at(&p, x, &n);
    const __m512 result = _mm512_maskz_scalef_ps((__mmask16)~too_small, (__m512)p, nf);
    *x = (vec16f)_mm512_mask_mov_ps(result, nan, v);
}
#endif

/* llmc_transpose16 (common.h) in a body built for isa: whole-vector
   shuffles on the AVX-512 builds, 4 x 4 blocks elsewhere. */
static LLMC_ALWAYS_INLINE void llmc_transpose16_isa(const int isa, vec16f r[16]) {
    if (isa >= LLMC_ISA_AVX512) {
        llmc_transpose16_wide(r);
    } else {
        llmc_transpose16_quarters(r);
    }
}

static LLMC_ALWAYS_INLINE vec16f llmc_exp_nonpositive16_isa(const int isa, vec16f x) {
#ifdef LLMC_X86_DISPATCH
    if (isa >= LLMC_ISA_AVX512) {
        llmc_exp_nonpositive16_avx512(&x);
        return x;
    }
#endif
    (void)isa;
    return llmc_exp_nonpositive16(x);
}

#endif
