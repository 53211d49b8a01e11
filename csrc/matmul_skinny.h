/*
 * The skinny matmul kernel (few rows: token-by-token decoding), private to
 * matmul.c, which includes this file once per instruction set next to
 * matmul_micro.h (so there is deliberately no include guard). The includer
 * defines, besides matmul_micro.h's MICRO_TARGET, MICRO_VEC, MICRO_W (4, 8
 * or 16) and MICRO_FMA:
 *   SKINNY_NAME   the function's name
 *   MICRO_IVEC    a GCC vector type of MICRO_W int32s (shuffle indices for
 *                 GCC before 12; see LLMC_SHUF_T in common.h)
 *   MICRO_LANES(F, h)  F(0, h), F(1, h), ..., F(MICRO_W - 1, h)
 *   SKINNY_ROWS   rows of inp per pass over a weight block, 1 .. 8 (the
 *                 same for every instruction set)
 * and this file, included last, undefines them all again (SKINNY_ROWS
 * stays).
 *
 * out[m, o] = bias[o] + sum_{k < K} inp[m, k] * weight[o, k]
 *   for m < M and o0 <= o < o1, where o0 is a multiple of MICRO_W
 *   (matmul_forward: M = B*T, K = C, ldo = OC, columns o of OC)
 *   out    [M, ldo]   (written) only columns o0 .. o1-1
 *   inp    [M, K]
 *   weight [*, K]     rows o0 .. o1-1, each read once from memory
 *   bias   [*] or NULL (then the sums start from 0)
 *
 * The lanes of a vector are MICRO_W neighbouring output columns o, and each
 * lane sums its own k = 0, 1, ..., K-1 chain of multiply-adds starting from
 * the bias: exactly the chain the GEMM's micro-kernel builds for the same
 * element (same operands, same order, the same MICRO_FMA), so the two
 * paths agree bitwise. The GEMM gets its columns of weight^T by packing;
 * here a block of MICRO_W weight rows x MICRO_W k's is loaded as MICRO_W
 * vectors (one per row, contiguous in memory) and transposed in registers,
 * after which vector k holds weight[o .. o+W, k]. The transpose is log2(W)
 * rounds of two-source shuffles: round h exchanges, for each pair of rows
 * i and i + h (i & h == 0), the lanes of row i with bit h set and the lanes
 * of row i + h with bit h clear; that swaps bit h of the row index with
 * bit h of the lane index, and all rounds together swap the whole index,
 * i.e. transpose. Partial blocks (the last k's when W does not divide K,
 * the last columns when it does not divide o1 - o0) are zero-padded, and
 * only their valid k's enter the sums: a multiply-add by a padding zero
 * could still turn a -0 sum into +0.
 *
 * Rows of inp go SKINNY_ROWS at a time through one always-inlined tile
 * function with the row count as a constant, so that each count keeps its
 * accumulators in registers. With more rows than that, the weight block of
 * a column group is read again from cache, not memory.
 *
 * Only operators, memcpy and MICRO_FMA appear here (see matmul_micro.h for
 * why).
 */
#ifndef SKINNY_CAT
#define SKINNY_CAT_(a, b) a##b
#define SKINNY_CAT(a, b) SKINNY_CAT_(a, b)
/* shuffle indices of transpose round h: lane l of the new row i (the low
   half of the pair) and of the new row i + h (the high half); an index
   >= MICRO_W picks from the second operand, row i + h */
#define SKINNY_LO(l, h) (((l) & (h)) ? (l) - (h) + MICRO_W : (l))
#define SKINNY_HI(l, h) (((l) & (h)) ? (l) + MICRO_W : (l) + (h))
#endif

#define SKINNY_TILE SKINNY_CAT(SKINNY_NAME, _tile)
#define SKINNY_TRANSPOSE SKINNY_CAT(SKINNY_NAME, _transpose)

#define SKINNY_ROUND(v, h)                                                  \
    do {                                                                    \
        for (int i = 0; i < MICRO_W; i++) {                                 \
            if (i & (h)) { continue; }                                      \
            const MICRO_VEC a = (v)[i], b = (v)[i + (h)];                   \
            (v)[i] = LLMC_SHUF_T(MICRO_IVEC, a, b, MICRO_LANES(SKINNY_LO, h)); \
            (v)[i + (h)] = LLMC_SHUF_T(MICRO_IVEC, a, b, MICRO_LANES(SKINNY_HI, h)); \
        }                                                                   \
    } while (0)

/* v[i][l] <-> v[l][i]: a MICRO_W x MICRO_W block in registers. */
MICRO_TARGET __attribute__((always_inline))
static inline void SKINNY_TRANSPOSE(MICRO_VEC v[MICRO_W]) {
#if MICRO_W >= 16
    SKINNY_ROUND(v, 8);
#endif
#if MICRO_W >= 8
    SKINNY_ROUND(v, 4);
#endif
    SKINNY_ROUND(v, 2);
    SKINNY_ROUND(v, 1);
}

/* out[r, 0..no) = bias[0..no) + sum_k x[r, k] * w[0..no, k] for r < mr
   (mr <= SKINNY_ROWS, a constant after inlining; no <= MICRO_W). */
MICRO_TARGET __attribute__((always_inline))
static inline void SKINNY_TILE(int mr, int no, float* out, size_t ldo, const float* x,
                               const float* w, const float* bias, int K) {
    MICRO_VEC acc[SKINNY_ROWS];
    MICRO_VEC start = {0};
    if (bias != NULL) { memcpy(&start, bias, (size_t)no * sizeof(float)); }
    for (int r = 0; r < mr; r++) { acc[r] = start; }
    int k0 = 0;
    if (no == MICRO_W) {
        for (; k0 + MICRO_W <= K; k0 += MICRO_W) {
            MICRO_VEC v[MICRO_W];
            for (int i = 0; i < MICRO_W; i++) {
                memcpy(&v[i], w + (size_t)i * K + k0, sizeof(MICRO_VEC));
            }
            SKINNY_TRANSPOSE(v);
            #pragma GCC unroll 16
            for (int k = 0; k < MICRO_W; k++) {
                for (int r = 0; r < mr; r++) { MICRO_FMA(acc[r], x[(size_t)r * K + k0 + k], v[k]); }
            }
        }
    }
    // the last columns (no < W) or the last k's (K % W): zero-padded blocks,
    // and only the valid k's enter the sums
    for (; k0 < K; k0 += MICRO_W) {
        const int kr = K - k0 < MICRO_W ? K - k0 : MICRO_W;
        MICRO_VEC v[MICRO_W];
        memset(v, 0, sizeof v);
        for (int i = 0; i < no; i++) {
            memcpy(&v[i], w + (size_t)i * K + k0, (size_t)kr * sizeof(float));
        }
        SKINNY_TRANSPOSE(v);
        for (int k = 0; k < kr; k++) {
            for (int r = 0; r < mr; r++) { MICRO_FMA(acc[r], x[(size_t)r * K + k0 + k], v[k]); }
        }
    }
    for (int r = 0; r < mr; r++) {
        memcpy(out + (size_t)r * ldo, &acc[r], (size_t)no * sizeof(float));
    }
}

MICRO_TARGET
static void SKINNY_NAME(float* out, size_t ldo, const float* inp, const float* weight,
                        const float* bias, int M, int K, int o0, int o1) {
    for (int o = o0; o < o1; o += MICRO_W) {
        const int no = o1 - o < MICRO_W ? o1 - o : MICRO_W;
        const float* w_o = weight + (size_t)o * K;
        const float* bias_o = bias != NULL ? bias + o : NULL;
        for (int m = 0; m < M; m += SKINNY_ROWS) {
            float* out_mo = out + (size_t)m * ldo + o;
            const float* x_m = inp + (size_t)m * K;
            switch (M - m) {
                case 1: SKINNY_TILE(1, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
#if SKINNY_ROWS > 2
                case 2: SKINNY_TILE(2, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
#endif
#if SKINNY_ROWS > 3
                case 3: SKINNY_TILE(3, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
#endif
#if SKINNY_ROWS > 4
                case 4: SKINNY_TILE(4, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
#endif
#if SKINNY_ROWS > 5
                case 5: SKINNY_TILE(5, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
#endif
#if SKINNY_ROWS > 6
                case 6: SKINNY_TILE(6, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
#endif
#if SKINNY_ROWS > 7
                case 7: SKINNY_TILE(7, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
#endif
                default: SKINNY_TILE(SKINNY_ROWS, no, out_mo, ldo, x_m, w_o, bias_o, K); break;
            }
        }
    }
}

#undef SKINNY_ROUND
#undef SKINNY_TILE
#undef SKINNY_TRANSPOSE
/* the includer's, for matmul_micro.h and this file */
#undef MICRO_NAME
#undef SKINNY_NAME
#undef MICRO_TARGET
#undef MICRO_VEC
#undef MICRO_IVEC
#undef MICRO_W
#undef MICRO_LANES
#undef MICRO_FMA
