/*
 * Rounding float32 to bf16 pairs with vcvtne2ps2bf16, bitwise as
 * llmc_bf16_round (common.h) for what vdpbf16ps reads: shared by the bf16
 * matmul's packing (matmul_bf16_micro.h) and bf16 attention's pairs
 * (attention_bf16.c). Private; every function is built with
 * LLMC_TARGET_AVX512BF16 and runs only when llmc_get_isa() chose that
 * instruction set.
 */
#ifndef LLMC_BF16_ROUND_H
#define LLMC_BF16_ROUND_H

#include <immintrin.h>
#include "common.h"
#include "isa.h"

/* x ready for vcvtne2ps2bf16, which rounds to nearest even exactly as
   llmc_bf16_round does (NaNs too) except that it reads float32 denormals as
   zero. Of those, only the ones that llmc_bf16_round rounds up to the
   smallest normal bf16, |x| in [0x007f8000, 0x00800000), give a bf16 that
   is not itself flushed later by vdpbf16ps: they become +-2^-126 here. */
LLMC_TARGET_AVX512BF16 static LLMC_ALWAYS_INLINE __m512 bf_fix_denormals(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i twice = _mm512_add_epi32(u, u);   // |x| << 1
    const __mmask16 up = _mm512_cmplt_epu32_mask(
        _mm512_sub_epi32(twice, _mm512_set1_epi32(0x00ff0000)), _mm512_set1_epi32(0x00010000));
    // lanes in up: (u & sign) | 0x00800000 (0xea: (A & B) | C)
    return _mm512_castsi512_ps(_mm512_mask_ternarylogic_epi32(
        u, up, _mm512_set1_epi32((int)0x80000000u), _mm512_set1_epi32(0x00800000), 0xea));
}

/* 32 floats, lo then hi, as 16 bf16 pairs: pair i = (x[2i], x[2i+1]). */
LLMC_TARGET_AVX512BF16 static LLMC_ALWAYS_INLINE __m512i bf_round_pairs(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(bf_fix_denormals(hi), bf_fix_denormals(lo));
}

/* 32 floats, 16 of row x then 16 of row y, as 16 pairs (x[i], y[i]). */
LLMC_TARGET_AVX512BF16 static LLMC_ALWAYS_INLINE __m512i bf_round_zip(__m512 x, __m512 y) {
    const __m512i halves = bf_round_pairs(x, y);   // x[0..16) then y[0..16), as bf16
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                         25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                                         19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(zip, halves);
}

#endif
