/*
 * The matmul micro-kernel body, private to matmul.c, which includes this file
 * once per instruction set (so there is deliberately no include guard). The
 * includer defines:
 *   MICRO_NAME    the function's name
 *   MICRO_TARGET  its attributes: __attribute__((target("..."))), or nothing
 *                 for the portable build
 *   MICRO_VEC     a GCC vector type of MICRO_W floats
 *   MICRO_W       floats per MICRO_VEC; 2 * MICRO_W must divide NR
 *   MICRO_FMA(acc, a, b)  acc = a * b + acc for a float a and vectors acc, b:
 *                 fused (one rounding) wherever the build can, the same
 *                 operation as in the skinny kernel (see matmul.c)
 * and matmul_skinny.h, included after this file, undefines them again.
 *
 * c[r, 0..NR) += sum_{k < kc} a[r*ars + k*aks] * bp[k, 0..NR)  for r < MR,
 * pass by pass (below) while a pass starts before column nr: an edge panel
 * of nr <= NR columns runs only the passes it needs (on AVX2, a 16-column
 * panel one of its two). a is either A itself (row-major: ars = lda,
 * aks = 1) or a packed micro-panel (ars = 1, aks = MR); bp is a packed B
 * panel (NR floats per k); c has row stride ldc.
 *
 * The tile of C is held in 2 * MR vector registers (two vectors per row),
 * 2 * MICRO_W columns at a time: one pass over the NR columns with 16-float
 * AVX-512 vectors, two with 8-float AVX2 vectors (12 of the 16 ymm
 * registers; a whole 6 x 32 tile would spill), four with 4-float portable
 * vectors. Each pass walks k = 0 .. kc-1 in order, so every instruction set
 * sums an output element in the same order.
 *
 * Only operators, memcpy and MICRO_FMA (an intrinsic of the target, or an
 * operator) appear here, never a helper from common.h: GCC
 * will not inline a function built for more (or other) CPU features than its
 * caller, so the same body could not call them under every target.
 */
MICRO_TARGET
static void MICRO_NAME(int kc, const float* a, size_t ars, size_t aks,
                       const float* bp, float* c, size_t ldc, int nr) {
    for (int j = 0; j < nr; j += 2 * MICRO_W) {
        MICRO_VEC acc[MR][2];
        for (int r = 0; r < MR; r++) {
            memcpy(&acc[r][0], c + r * ldc + j, sizeof(MICRO_VEC));
            memcpy(&acc[r][1], c + r * ldc + j + MICRO_W, sizeof(MICRO_VEC));
        }
        for (int k = 0; k < kc; k++) {
            MICRO_VEC b0, b1;
            memcpy(&b0, bp + (size_t)k * NR + j, sizeof(MICRO_VEC));
            memcpy(&b1, bp + (size_t)k * NR + j + MICRO_W, sizeof(MICRO_VEC));
            const float* a_k = a + k * aks;
            for (int r = 0; r < MR; r++) {
                const float a_rk = a_k[r * ars];
                MICRO_FMA(acc[r][0], a_rk, b0);
                MICRO_FMA(acc[r][1], a_rk, b1);
            }
        }
        for (int r = 0; r < MR; r++) {
            memcpy(c + r * ldc + j, &acc[r][0], sizeof(MICRO_VEC));
            memcpy(c + r * ldc + j + MICRO_W, &acc[r][1], sizeof(MICRO_VEC));
        }
    }
}
