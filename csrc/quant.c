/*
 * Quantized weights in llama.cpp's Q8_0 and Q4_0 blocks, and the decoding
 * matmul on them (few rows: token-by-token generation).
 *
 * A block is 32 consecutive weights along the input dimension IC:
 *   Q8_0  34 bytes: fp16 scale d (little-endian), then 32 int8 q;  x = d*q
 *   Q4_0  18 bytes: fp16 scale d, then 16 bytes; byte j holds q[j] in its
 *         low nibble and q[j+16] in its high one;  x = d*(q - 8)
 * with ggml-quants.c's rounding (quantize_row_q8_0_ref, _q4_0_ref), which
 * gguf.quants reproduces in numpy.
 *
 * paths of matmul_forward_quant (a rows function per instruction set under
 * one shared driver; the unsuffixed function picks the best this CPU has
 * under llmc_get_isa(), each suffixed one forces its path):
 *   portable    plain C
 *   avx2        AVX2: maddubs + madd, 8 blocks a ymm (Haswell, Zen)
 *   avxvnni     AVX-VNNI vpdpbusd, 8 blocks a ymm (Alder Lake, Zen 5)
 *   avx512vnni  AVX512-VNNI vpdpbusd, 16 blocks a zmm (Ice Lake, Zen 4)
 * As llama.cpp does, each input row is first quantized to Q8_0 blocks
 * (once a call; AVX512-VNNI's path with its own vector twin). The weights
 * are read in a packed layout (below: 16 blocks interleaved so that one
 * vpdpbusd lane sums a whole block), each thread one contiguous run of
 * output rows, ROWS rows a pass sharing each group's input chunks, every
 * input row served by one pass over them. A block's int32 dot product S is
 * exact, and exact in float (|S| < 2^24), as is the product of its two fp16
 * scales; each block adds S * d_w * d_x into float lane b mod 16 by one
 * fused multiply-add, in block order, and the 16 lanes are summed in a fixed
 * tree in double: every path rounds the same operations, so all agree
 * bitwise, for any thread count (each output is one thread's).
 */
#include "llmc.h"
#include "common.h"
#include "isa.h"

#ifdef LLMC_X86_DISPATCH
#include <cpuid.h>
#include <immintrin.h>
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVXVNNI __attribute__((target("avxvnni,avx2,fma,f16c")))
#define TARGET_AVX512VNNI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

#define QK 32   /* weights per block */

/* bytes of one block of qtype, or 0 for a type this file does not know */
static size_t block_bytes(int qtype) {
    switch (qtype) {
        case LLMC_QUANT_Q8_0: return 2 + QK;
        case LLMC_QUANT_Q4_0: return 2 + QK / 2;
        default: return 0;
    }
}

/* x rounded to the nearest fp16, ties to even (numpy's astype(float16));
   overflow gives infinity, a NaN stays a NaN. */
static uint16_t fp16_from_float(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) { return sign | 0x7e00u; }
    if (a >= 0x477ff000u) { return sign | 0x7c00u; }   // rounds to >= 65520: inf
    if (a < 0x38800000u) {   // below 2^-14: a subnormal fp16 (or 0)
        // value m * 2^(e - 150), in units of 2^-24: m >> (126 - e), rounded
        const int drop = 126 - (int)(a >> 23);
        if (drop > 24) { return sign; }   // below 2^-25 (or exactly: a tie to 0)
        const uint32_t m = (a & 0x7fffffu) | 0x800000u;
        const uint32_t half = 1u << (drop - 1), rest = m & ((1u << drop) - 1);
        uint32_t h = m >> drop;
        if (rest > half || (rest == half && (h & 1u))) { h++; }
        return sign | (uint16_t)h;
    }
    // normal: rebias the exponent, round the 13 dropped bits to even
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
}

/* The float of an fp16 number (exact). */
static LLMC_ALWAYS_INLINE float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0x1f) { u = sign | 0x7f800000u | (m << 13); }
    else if (e != 0) { u = sign | ((e + 112) << 23) | (m << 13); }
    else if (m == 0) { u = sign; }
    else {   // subnormal: m * 2^-24
        float f = (float)m * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static LLMC_ALWAYS_INLINE float block_scale(const uint8_t* block) {
    return fp16_to_float((uint16_t)(block[0] | (block[1] << 8)));
}

static void store_scale(uint8_t* block, float d) {
    const uint16_t h = fp16_from_float(d);
    block[0] = (uint8_t)(h & 0xff);
    block[1] = (uint8_t)(h >> 8);
}

/* quantize_row_q8_0_ref: d = max|x| / 127, q = round(x / d) (half away from 0) */
static void quantize_block_q8_0(uint8_t* block, const float* x) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) { amax = fmaxf(amax, fabsf(x[i])); }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_scale(block, d);
    for (int i = 0; i < QK; i++) { block[2 + i] = (uint8_t)(int8_t)roundf(x[i] * id); }
}

/* quantize_row_q4_0_ref: d = (the x of largest magnitude) / -8,
   q = min(15, trunc(x / d + 8.5)) */
static void quantize_block_q4_0(uint8_t* block, const float* x) {
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < QK; i++) {
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_scale(block, d);
    for (int j = 0; j < QK / 2; j++) {
        // volatile: the product rounds before the add, as in llama.cpp (a
        // fused multiply-add would round once and could move a tie)
        volatile float p0 = x[j] * id, p1 = x[j + QK / 2] * id;
        int q0 = (int)(p0 + 8.5f), q1 = (int)(p1 + 8.5f);
        q0 = q0 > 15 ? 15 : q0;
        q1 = q1 > 15 ? 15 : q1;
        block[2 + j] = (uint8_t)(q0 | (q1 << 4));
    }
}

/* The 32 int8s of a block, in order (Q4_0's nibbles unpacked, minus 8). */
static LLMC_ALWAYS_INLINE void unpack_block(int8_t w[QK], const uint8_t* block, int qtype) {
    if (qtype == LLMC_QUANT_Q8_0) {
        memcpy(w, block + 2, QK);
    } else {
        for (int j = 0; j < QK / 2; j++) {
            w[j] = (int8_t)((block[2 + j] & 0x0f) - 8);
            w[j + QK / 2] = (int8_t)((block[2 + j] >> 4) - 8);
        }
    }
}

/* the status of quantize_rows' and dequantize_rows' arguments */
static int check_quant(const void* out, const void* inp, int rows, int IC, int qtype) {
    if (!LLMC_NONNULL2(out, inp)) { return LLMC_ERR_NULL; }
    if (block_bytes(qtype) == 0) { return LLMC_ERR_VALUE; }
    if (rows <= 0 || IC <= 0 || IC % QK != 0) { return LLMC_ERR_SHAPE; }
    if (!llmc_count_fits((size_t)rows, (size_t)IC, 1, 1)) { return LLMC_ERR_SHAPE; }
    return LLMC_OK;
}

int quantize_rows(uint8_t* out, const float* inp, int rows, int IC, int qtype) {
    const int status = check_quant(out, inp, rows, IC, qtype);
    LLMC_REQUIRE(status == LLMC_OK, status);
    const int64_t nblocks = (int64_t)rows * (IC / QK);
    const size_t bb = block_bytes(qtype);
    #pragma omp parallel for
    for (int64_t b = 0; b < nblocks; b++) {
        uint8_t* block = out + (size_t)b * bb;
        if (qtype == LLMC_QUANT_Q8_0) { quantize_block_q8_0(block, inp + (size_t)b * QK); }
        else { quantize_block_q4_0(block, inp + (size_t)b * QK); }
    }
    return LLMC_OK;
}

int dequantize_rows(float* out, const uint8_t* inp, int rows, int IC, int qtype) {
    const int status = check_quant(out, inp, rows, IC, qtype);
    LLMC_REQUIRE(status == LLMC_OK, status);
    const int64_t nblocks = (int64_t)rows * (IC / QK);
    #pragma omp parallel for
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t* block = inp + (size_t)b * block_bytes(qtype);
        int8_t q[QK];
        unpack_block(q, block, qtype);
        const float d = block_scale(block);
        for (int i = 0; i < QK; i++) { out[(size_t)b * QK + i] = (float)q[i] * d; }
    }
    return LLMC_OK;
}

/* ---- the decoding layout ------------------------------------------------- */

/*
 * The decoding kernel reads weights in a packed layout, made once at
 * quantize or load time (quant_pack_rows) and undone for GGUF
 * (quant_unpack_rows). A row keeps its bytes (row_bytes = nb blocks *
 * block_bytes) and its place; inside it:
 *   [2 nb bytes]  the blocks' fp16 scales, in block order
 *   [the rest]    the quants, in groups of GROUP blocks (the last group
 *                 holds what is left, g = 1..GROUP blocks): within a group
 *                 of g blocks, bytes 4k..4k+3 of block j's quants (Q8_0:
 *                 int8s 4k..4k+3; Q4_0: the bytes holding q[4k..4k+3] and
 *                 q[16+4k..16+4k+3]) at (k*g + j)*4.
 * So one 64-byte load of a group holds 4 bytes of each of 16 blocks, and
 * vpdpbusd sums a whole block into one int32 lane: no horizontal sums, and
 * the 16 lanes take their 16 scales as one vector.
 */
#define GROUP 16

/* quant bytes of a block (32 or 16) */
static size_t quant_bytes(int qtype) { return block_bytes(qtype) - 2; }

/* the offset, in a packed row (from its quants) or a packed input row, of
   4-byte chunk k of block b's quants, nb blocks a row */
static LLMC_ALWAYS_INLINE size_t chunk_offset(int nb, int b, int k, size_t qbytes) {
    const int b0 = b / GROUP * GROUP, g = nb - b0 < GROUP ? nb - b0 : GROUP;
    return (size_t)b0 * qbytes + ((size_t)k * g + (size_t)(b - b0)) * 4;
}

/* packed[r] <-> blocks[r] for every row: pack = 1 packs, 0 unpacks */
static int permute_rows(uint8_t* out, const uint8_t* inp, int rows, int IC, int qtype, int pack) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(block_bytes(qtype) != 0, LLMC_ERR_VALUE);
    LLMC_REQUIRE(rows > 0 && IC > 0 && IC % QK == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits((size_t)rows, (size_t)IC, 1, 1), LLMC_ERR_SHAPE);
    const int nb = IC / QK;
    const size_t bb = block_bytes(qtype), qbytes = quant_bytes(qtype), row_bytes = nb * bb;
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint8_t* src = inp + (size_t)r * row_bytes;
        uint8_t* dst = out + (size_t)r * row_bytes;
        for (int b = 0; b < nb; b++) {
            uint8_t* block = (uint8_t*)(pack ? src : dst) + (size_t)b * bb;
            uint8_t* scale = (uint8_t*)(pack ? dst : src) + (size_t)b * 2;
            uint8_t* quants = (uint8_t*)(pack ? dst : src) + (size_t)nb * 2;
            for (size_t k = 0; k < qbytes / 4; k++) {
                uint8_t* chunk = quants + chunk_offset(nb, b, (int)k, qbytes);
                if (pack) { memcpy(chunk, block + 2 + 4 * k, 4); }
                else { memcpy(block + 2 + 4 * k, chunk, 4); }
            }
            if (pack) { memcpy(scale, block, 2); }
            else { memcpy(block, scale, 2); }
        }
    }
    return LLMC_OK;
}

int quant_pack_rows(uint8_t* out, const uint8_t* blocks, int rows, int IC, int qtype) {
    return permute_rows(out, blocks, rows, IC, qtype, 1);
}

int quant_unpack_rows(uint8_t* out, const uint8_t* packed, int rows, int IC, int qtype) {
    return permute_rows(out, packed, rows, IC, qtype, 0);
}

/* block b of a packed row as in unpack_block, and its scale */
static LLMC_ALWAYS_INLINE float packed_block(int8_t w[QK], const uint8_t* row, int nb, int b,
                                             int qtype) {
    const size_t qbytes = quant_bytes(qtype);
    uint8_t block[2 + QK];
    memcpy(block, row + (size_t)b * 2, 2);
    for (size_t k = 0; k < qbytes / 4; k++) {
        memcpy(block + 2 + 4 * k, row + (size_t)nb * 2 + chunk_offset(nb, b, (int)k, qbytes), 4);
    }
    unpack_block(w, block, qtype);
    return block_scale(block);
}

/* ---- the decoding matmul ------------------------------------------------- */

/*
 * The input rows, quantized to Q8_0 (llama.cpp's vec_dot_type of both
 * formats) in the packed layout of Q8_0 quants (no scales): q [N, nb*32],
 * d [N, nb] their scales, corr [N, nb] per block minus the weight offset
 * times the sum of the block's q (below).
 */
/* input rows a call of a path's kernel serves at once (their lanes live on
   the stack) */
#define MAX_ROWS 64

typedef struct {
    const int8_t* q;
    const float* d;
    const int32_t* corr;
    int N, nb;
} quant_input;

/*
 * The sum of output row o for input row n is lane_tree of the row's 16
 * float lanes, lane j (from 0) the sum over the row's groups, in order, of
 * fmaf(float(S), d_w * d_x, lane) for block b0 + j of the group (S = the
 * block's exact int32 dot product, d_w and d_x its scales). S < 2^24 is
 * exact in float, and d_w * d_x (two fp16 numbers) too, so every path
 * rounds the same single fused multiply-add, then sums the lanes in the
 * same tree: all paths agree bitwise.
 *
 * A path's kernel for the output rows o0 .. o1 of the packed weight (row o
 * at weight + o * row_bytes): out[n * OC + o] (written) = that sum plus
 * bias[o] (or 0) in double, rounded once to float.
 */
typedef void (*rows_fn)(float* out, int OC, const uint8_t* weight, size_t row_bytes, int o0,
                        int o1, const float* bias, const quant_input* in, int qtype);

/* The plain twin's shape, under rows_of_sums: for nrows (1 .. ROWS)
   consecutive output rows at w0 and at most MAX_ROWS input rows,
   sums[r * N + n] (written) = the sums above. */
typedef void (*sums_fn)(double* sums, const uint8_t* w0, size_t row_bytes, int nrows,
                        const quant_input* in, int qtype);

/* output rows a kernel call computes together (their accumulations are
   independent chains, and the lane trees and call overhead are shared) */
#define ROWS 4

/* The fixed tree every path sums a row's 16 lanes in, in double: lane j
   plus lane j + 8, then + 4, + 2, + 1. */
static LLMC_ALWAYS_INLINE double lane_tree(const float lanes[GROUP]) {
    double l[GROUP];
    for (int j = 0; j < GROUP; j++) { l[j] = lanes[j]; }
    for (int width = GROUP / 2; width > 0; width /= 2) {
        for (int j = 0; j < width; j++) { l[j] += l[j + width]; }
    }
    return l[0];
}

/* The offset that makes a block's weights unsigned bytes u = w + offset
   for vpdpbusd and maddubs (unsigned times signed): Q8_0's w ^ 0x80, Q4_0's
   bare nibble. Then sum w*q = sum u*q - offset * sum q exactly in int32,
   and the last term is the input's alone: corr. */
static int weight_offset(int qtype) { return qtype == LLMC_QUANT_Q8_0 ? 128 : 8; }

/* the plain twin (signed weights: no corr), a row at a time */
static void sums_portable(double* sums, const uint8_t* w0, size_t row_bytes, int nrows,
                          const quant_input* in, int qtype) {
    const int nb = in->nb;
    for (int r = 0; r < nrows; r++) {
        const uint8_t* wrow = w0 + (size_t)r * row_bytes;
        for (int n = 0; n < in->N; n++) {
            float lanes[GROUP] = {0};
            const int8_t* x = in->q + (size_t)n * nb * QK;
            for (int b = 0; b < nb; b++) {
                int8_t w[QK];
                const float dw = packed_block(w, wrow, nb, b, qtype);
                int32_t s = 0;
                for (int i = 0; i < QK; i++) {
                    s += (int32_t)w[i] * x[chunk_offset(nb, b, i / 4, QK) + i % 4];
                }
                float* lane = &lanes[b % GROUP];
                *lane = fmaf((float)s, dw * in->d[(size_t)n * nb + b], *lane);
            }
            sums[r * in->N + n] = lane_tree(lanes);
        }
    }
}

/* A sums_fn's path as a rows_fn: ROWS output rows a call (the last fewer),
   MAX_ROWS input rows a call. */
static void rows_of_sums(sums_fn sums_of, float* out, int OC, const uint8_t* weight,
                         size_t row_bytes, int o0, int o1, const float* bias,
                         const quant_input* in, int qtype) {
    const int nb = in->nb;
    for (int o = o0; o < o1; o += ROWS) {
        const int nrows = o1 - o < ROWS ? o1 - o : ROWS;
        for (int n0 = 0; n0 < in->N; n0 += MAX_ROWS) {
            const quant_input part = {in->q + (size_t)n0 * nb * QK, in->d + (size_t)n0 * nb,
                                      in->corr + (size_t)n0 * nb,
                                      in->N - n0 < MAX_ROWS ? in->N - n0 : MAX_ROWS, nb};
            double sums[ROWS * MAX_ROWS];
            sums_of(sums, weight + (size_t)o * row_bytes, row_bytes, nrows, &part, qtype);
            for (int r = 0; r < nrows; r++) {
                for (int n = 0; n < part.N; n++) {
                    out[(size_t)(n0 + n) * OC + o + r] =
                        (float)(sums[r * part.N + n] + (bias != NULL ? (double)bias[o + r] : 0.0));
                }
            }
        }
    }
}

/* a sums_fn path's rows_fn */
#define ROWS_OF_SUMS(NAME, SUMS)                                                          \
    static void NAME(float* out, int OC, const uint8_t* weight, size_t row_bytes, int o0,   \
                     int o1, const float* bias, const quant_input* in, int qtype) {         \
        rows_of_sums(SUMS, out, OC, weight, row_bytes, o0, o1, bias, in, qtype);            \
    }
ROWS_OF_SUMS(rows_portable, sums_portable)

#ifdef LLMC_X86_DISPATCH

/* the n bytes 8 KiB past p, into L1: one weight stream a thread keeps too
   few misses in flight on the hardware prefetchers alone (timed on Zen 5,
   2 threads: 8 KiB ahead beat 2, 4, 16 and 32, and L2 hints) */
#define PREFETCH_BYTES 8192
static LLMC_ALWAYS_INLINE void prefetch_ahead(const uint8_t* p, size_t n) {
    for (size_t at = 0; at < n; at += 64) {
        _mm_prefetch((const char*)p + PREFETCH_BYTES + at, _MM_HINT_T0);
    }
}

/* 512 bits, a group of g blocks a zmm: 4g bytes at p, zeros beyond (g = 16:
   a whole zmm, 8: a ymm; other g only in a last group, masked, which is
   slow from memory on Zen). */
TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE __m512i load_group(const void* p, int g) {
    if (g == GROUP) { return _mm512_loadu_si512(p); }
    if (g == GROUP / 2) { return _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)p)); }
    return _mm512_maskz_loadu_epi8(((__mmask64)1 << (4 * g)) - 1, p);
}

/* the g fp16 scales at p as floats (zeros beyond g) */
TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE __m512 load_halves(const uint8_t* p, int g) {
    if (g == GROUP) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    if (g == GROUP / 2) {
        return _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)p)));
    }
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << g) - 1), p));
}

/* lane_tree on a zmm of 16 floats */
TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE double lane_tree_512(__m512 lanes) {
    const __m512d s8 = _mm512_add_pd(
        _mm512_cvtps_pd(_mm512_castps512_ps256(lanes)),
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1))));
    const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
}

/* lane_tree of four rows' zmms at once: the same additions, the rows side
   by side (2 by 2, then 4 in one zmm), their sums as 4 doubles */
TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE __m256d lane_trees_4(const __m512 lanes[4]) {
    __m512d s8[4];   // row r: lane j + lane j + 8, j < 8
    for (int r = 0; r < 4; r++) {
        const __m512d high = _mm512_cvtps_pd(
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes[r]), 1)));
        s8[r] = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(lanes[r])), high);
    }
    // rows 0, 1 (then 2, 3): j + (j + 4), j < 4, row 0's in the low half
    const __m512d s4a = _mm512_add_pd(_mm512_shuffle_f64x2(s8[0], s8[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_f64x2(s8[0], s8[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512d s4b = _mm512_add_pd(_mm512_shuffle_f64x2(s8[2], s8[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_f64x2(s8[2], s8[3], _MM_SHUFFLE(3, 2, 3, 2)));
    // 128-bit lane r: row r's j + (j + 2), j < 2; then j 0 + j 1
    const __m512d s2 = _mm512_add_pd(_mm512_shuffle_f64x2(s4a, s4b, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f64x2(s4a, s4b, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512d s1 = _mm512_add_pd(_mm512_unpacklo_pd(s2, s2), _mm512_unpackhi_pd(s2, s2));
    return _mm512_castpd512_pd256(
        _mm512_permutexvar_pd(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), s1));
}

/* S + corr of the g blocks of one group of a weight row (its quants at wq,
   chunks 4g bytes apart) against an input row's chunks x[0 .. 8) */
TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE __m512i group_sums(const uint8_t* wq,
                                                               const __m512i x[8], __m512i corr,
                                                               int g, int qtype) {
    const size_t stride = (size_t)g * 4;
    __m512i s0 = corr, s1 = _mm512_setzero_si512();
    if (qtype == LLMC_QUANT_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int c = 0; c < 8; c += 2) {
            s0 = _mm512_dpbusd_epi32(s0, _mm512_xor_si512(load_group(wq + c * stride, g), flip),
                                     x[c]);
            s1 = _mm512_dpbusd_epi32(
                s1, _mm512_xor_si512(load_group(wq + (c + 1) * stride, g), flip), x[c + 1]);
        }
    } else {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int k = 0; k < 4; k++) {
            const __m512i raw = load_group(wq + k * stride, g);
            s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(raw, low), x[k]);
            s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low),
                                     x[k + 4]);
        }
    }
    return _mm512_add_epi32(s0, s1);
}

/* The group of g blocks from b0 of R rows at w0 (row_bytes apart) into
   their lanes acc[r], for input row n: its chunks, scales and corr loaded
   once for the R rows. pf (or NULL): R shares of `share` bytes to prefetch,
   one a row. */
TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE void group_512(__m512 acc[ROWS], const uint8_t* w0,
                                                           size_t row_bytes, const int R,
                                                           const quant_input* in, int n, int b0,
                                                           int g, int qtype, const uint8_t* pf,
                                                           size_t share) {
    const int nb = in->nb;
    const size_t qbytes = quant_bytes(qtype);
    const int8_t* xg = in->q + ((size_t)n * nb + b0) * QK;
    __m512i x[8];
    for (int c = 0; c < 8; c++) { x[c] = load_group(xg + (size_t)c * g * 4, g); }
    // a block's corr and d are 4 bytes, as its chunks
    const __m512i corr = load_group(in->corr + (size_t)n * nb + b0, g);
    const __m512 dx = _mm512_castsi512_ps(load_group(in->d + (size_t)n * nb + b0, g));
    for (int r = 0; r < R; r++) {
        const uint8_t* wrow = w0 + (size_t)r * row_bytes;
        if (pf != NULL) {
            for (size_t at = 0; at < share; at += 64) {
                _mm_prefetch((const char*)pf + (size_t)r * share + at, _MM_HINT_T0);
            }
        }
        const __m512i s = group_sums(wrow + (size_t)nb * 2 + (size_t)b0 * qbytes, x, corr, g,
                                     qtype);
        const __m512 scale = _mm512_mul_ps(load_halves(wrow + (size_t)b0 * 2, g), dx);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
    }
}

/* R (1 or ROWS) output rows from o of the weight rows at w0, every input
   row in turn (their chunks shared by the R rows; the rows' bytes, read
   from memory for the first, stay in L1 for the others) */
TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE void rows_512(float* out, int OC, const uint8_t* w0,
                                                          size_t row_bytes, int o, const int R,
                                                          const float* bias,
                                                          const quant_input* in, int qtype) {
    const int nb = in->nb, full = nb / GROUP * GROUP, groups = (nb + GROUP - 1) / GROUP;
    // the bytes PREFETCH_BYTES past the R rows, an equal share at each of
    // the first input row's R * groups steps (spread, not in one burst)
    const uint8_t* pf = w0 + PREFETCH_BYTES;
    const size_t share = ((size_t)R * row_bytes / ((size_t)R * groups) + 63) / 64 * 64;
    for (int n = 0; n < in->N; n++) {
        __m512 acc[ROWS];
        for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); }
        for (int b0 = 0; b0 < full; b0 += GROUP) {
            group_512(acc, w0, row_bytes, R, in, n, b0, GROUP, qtype,
                      n == 0 ? pf + (size_t)(b0 / GROUP) * R * share : NULL, share);
        }
        if (full < nb) {
            group_512(acc, w0, row_bytes, R, in, n, full, nb - full, qtype,
                      n == 0 ? pf + (size_t)(groups - 1) * R * share : NULL, share);
        }
        float* dst = out + (size_t)n * OC + o;
        if (R == ROWS) {
            const __m256d b = bias != NULL ? _mm256_cvtps_pd(_mm_loadu_ps(bias + o))
                                           : _mm256_setzero_pd();
            _mm_storeu_ps(dst, _mm256_cvtpd_ps(_mm256_add_pd(lane_trees_4(acc), b)));
        } else {
            for (int r = 0; r < R; r++) {
                dst[r] = (float)(lane_tree_512(acc[r]) + (bias != NULL ? (double)bias[o + r] : 0.0));
            }
        }
    }
}

TARGET_AVX512VNNI static LLMC_ALWAYS_INLINE void range_512(float* out, int OC, const uint8_t* weight,
                                                           size_t row_bytes, int o0, int o1,
                                                           const float* bias,
                                                           const quant_input* in, int qtype) {
    int o = o0;
    for (; o + ROWS <= o1; o += ROWS) {
        rows_512(out, OC, weight + (size_t)o * row_bytes, row_bytes, o, ROWS, bias, in, qtype);
    }
    for (; o < o1; o++) {
        rows_512(out, OC, weight + (size_t)o * row_bytes, row_bytes, o, 1, bias, in, qtype);
    }
}

/* one function a block type, so that each compiles with its type known */
TARGET_AVX512VNNI static void rows_avx512vnni(float* out, int OC, const uint8_t* weight,
                                              size_t row_bytes, int o0, int o1, const float* bias,
                                              const quant_input* in, int qtype) {
    if (qtype == LLMC_QUANT_Q8_0) {
        range_512(out, OC, weight, row_bytes, o0, o1, bias, in, LLMC_QUANT_Q8_0);
    } else {
        range_512(out, OC, weight, row_bytes, o0, o1, bias, in, LLMC_QUANT_Q4_0);
    }
}

/* +1 or -1 with p's sign, in AVX-512F's integer ops (the float and/or are
   AVX512DQ's) */
TARGET_AVX512VNNI static inline __m512 sign_or_one(__m512 p) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u), one = _mm512_set1_epi32(0x3f800000);
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(p), sign), one));
}

/* quantize_input_row (below) with AVX-512, bitwise: the same max (NaNs
   skipped, as fmaxf skips them), scale and products, and roundf's halves
   away from zero as trunc(v) + sign(v) where |v - trunc(v)| >= 1/2 (v -
   trunc(v) is exact) */
TARGET_AVX512VNNI static void quantize_input_row_512(int8_t* q, float* d, int32_t* corr,
                                                     const float* x, int nb, int qtype) {
    const int offset = weight_offset(qtype);
    const __m512 half = _mm512_set1_ps(0.5f);
    for (int b = 0; b < nb; b++) {
        __m512 v[2];
        __m512i i[2];
        for (int h = 0; h < 2; h++) { v[h] = _mm512_loadu_ps(x + (size_t)b * QK + 16 * h); }
        const __m512 a0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v[0], v[0], _CMP_ORD_Q),
                                              _mm512_abs_ps(v[0]));
        const __m512 a1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v[1], v[1], _CMP_ORD_Q),
                                              _mm512_abs_ps(v[1]));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        const float scale = amax / 127.0f;
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        d[b] = fp16_to_float(fp16_from_float(scale));
        for (int h = 0; h < 2; h++) {
            const __m512 p = _mm512_mul_ps(v[h], _mm512_set1_ps(inverse));
            const __m512 t = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __mmask16 away = _mm512_cmp_ps_mask(
                _mm512_abs_ps(_mm512_sub_ps(p, t)), half, _CMP_GE_OQ);
            const __m512 r = _mm512_mask_add_ps(t, away, t,
                                                sign_or_one(p));
            i[h] = _mm512_cvttps_epi32(r);
        }
        // the int8s (a NaN's int32 0x80000000 truncates to 0, as in C's
        // conversion here), summed from their bytes
        uint8_t bytes[QK];
        _mm_storeu_si128((__m128i*)bytes, _mm512_cvtepi32_epi8(i[0]));
        _mm_storeu_si128((__m128i*)(bytes + 16), _mm512_cvtepi32_epi8(i[1]));
        const __m512i wide = _mm512_add_epi32(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)bytes)),
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(bytes + 16))));
        corr[b] = -offset * _mm512_reduce_add_epi32(wide);
        for (int k = 0; k < QK / 4; k++) {
            memcpy(q + chunk_offset(nb, b, k, QK), bytes + 4 * k, 4);
        }
    }
}

/* 256 bits: a group as two halves of 8 lanes, a row at a time; a partial
   half (a last group of g blocks not a multiple of 8) through masked loads
   of 4-byte lanes. 8 int32 at p, the first `count` of them (the rest 0). */
TARGET_AVX2 static LLMC_ALWAYS_INLINE __m256i load_lanes(const void* p, int count) {
    if (count == 8) { return _mm256_loadu_si256((const __m256i*)p); }
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_epi32((const int*)p, mask);
}

/* the 8 fp16 scales at p as floats, the first `count` (the rest 0) */
TARGET_AVX2 static LLMC_ALWAYS_INLINE __m256 load_scales(const uint8_t* p, int count) {
    if (count == 8) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    uint16_t h[8] = {0};
    memcpy(h, p, (size_t)count * 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
}

/* The 256-bit paths' kernel, as rows_512's shape: R (1 or ROWS) output
   rows from o of the weight rows at w0, every input row in turn, a group
   as two halves of 8 lanes; each half's input chunks, scales and corr
   loaded once for the R rows, whose lanes stay in registers. DOT(s, u, x)
   adds the 8 int32 lane sums of one chunk (weights u times the input's
   int8s x) to s, INIT the starting sums (corr, or 0 where DOT takes signed
   weights), WEIGHTS the weights' form DOT wants. */
#define ROWS_256(NAME, TARGET, DOT, INIT, WEIGHTS)                                        \
TARGET static LLMC_ALWAYS_INLINE void NAME##_pass(float* out, int OC, const uint8_t* w0,  \
                                                  size_t row_bytes, int o, const int R,   \
                                                  const float* bias,                      \
                                                  const quant_input* in, int qtype) {     \
    const int nb = in->nb;                                                                \
    const size_t qbytes = quant_bytes(qtype);                                             \
    prefetch_ahead(w0, (size_t)R * row_bytes);                                            \
    for (int n = 0; n < in->N; n++) {                                                     \
        __m256 acc[ROWS][2];                                                              \
        for (int r = 0; r < R; r++) { acc[r][0] = acc[r][1] = _mm256_setzero_ps(); }     \
        for (int b0 = 0; b0 < nb; b0 += GROUP) {                                          \
            const int g = nb - b0 < GROUP ? nb - b0 : GROUP;                              \
            for (int h = 0; h * 8 < g; h++) {                                             \
                const int count = g - 8 * h < 8 ? g - 8 * h : 8;                          \
                const size_t at = (size_t)n * nb + b0 + 8 * h;                            \
                const int8_t* x = in->q + ((size_t)n * nb + b0) * QK + 32 * h;            \
                __m256i xc[8];                                                            \
                for (int c = 0; c < 8; c++) { xc[c] = load_lanes(x + (size_t)c * g * 4, count); } \
                const __m256i init = INIT(in->corr + at, count);                          \
                const __m256 dx = _mm256_castsi256_ps(load_lanes(in->d + at, count));     \
                for (int r = 0; r < R; r++) {                                             \
                    const uint8_t* wrow = w0 + (size_t)r * row_bytes;                     \
                    __m256i u[8];                                                         \
                    WEIGHTS(u, wrow + (size_t)nb * 2 + (size_t)b0 * qbytes + 32 * h,       \
                            (size_t)g * 4, count, qtype);                                 \
                    __m256i s0 = init, s1 = _mm256_setzero_si256();                       \
                    for (int c = 0; c < 8; c += 2) {                                      \
                        s0 = DOT(s0, u[c], xc[c]);                                        \
                        s1 = DOT(s1, u[c + 1], xc[c + 1]);                                \
                    }                                                                     \
                    const __m256 scale = _mm256_mul_ps(                                   \
                        load_scales(wrow + (size_t)(b0 + 8 * h) * 2, count), dx);          \
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), \
                                                scale, acc[r][h]);                        \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) {                                                     \
            float lanes[GROUP];                                                           \
            _mm256_storeu_ps(lanes, acc[r][0]);                                           \
            _mm256_storeu_ps(lanes + 8, acc[r][1]);                                       \
            out[(size_t)n * OC + o + r] =                                                 \
                (float)(lane_tree(lanes) + (bias != NULL ? (double)bias[o + r] : 0.0));   \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
TARGET static LLMC_ALWAYS_INLINE void NAME##_range(float* out, int OC, const uint8_t* weight, \
                                                   size_t row_bytes, int o0, int o1,      \
                                                   const float* bias,                     \
                                                   const quant_input* in, int qtype) {    \
    int o = o0;                                                                           \
    for (; o + ROWS <= o1; o += ROWS) {                                                   \
        NAME##_pass(out, OC, weight + (size_t)o * row_bytes, row_bytes, o, ROWS, bias, in, \
                    qtype);                                                               \
    }                                                                                     \
    for (; o < o1; o++) {                                                                 \
        NAME##_pass(out, OC, weight + (size_t)o * row_bytes, row_bytes, o, 1, bias, in,   \
                    qtype);                                                               \
    }                                                                                     \
}                                                                                         \
/* one function a block type, so that each compiles with its type known */               \
TARGET static void NAME(float* out, int OC, const uint8_t* weight, size_t row_bytes,     \
                        int o0, int o1, const float* bias, const quant_input* in,         \
                        int qtype) {                                                      \
    if (qtype == LLMC_QUANT_Q8_0) {                                                       \
        NAME##_range(out, OC, weight, row_bytes, o0, o1, bias, in, LLMC_QUANT_Q8_0);      \
    } else {                                                                              \
        NAME##_range(out, OC, weight, row_bytes, o0, o1, bias, in, LLMC_QUANT_Q4_0);      \
    }                                                                                     \
}

/* the 8 chunks' weights of a half group (lanes `count`, chunk stride
   `stride` bytes) as unsigned bytes w + offset */
TARGET_AVX2 static LLMC_ALWAYS_INLINE void unsigned_weights(__m256i u[8], const uint8_t* wq,
                                                            size_t stride, int count, int qtype) {
    if (qtype == LLMC_QUANT_Q8_0) {
        for (int c = 0; c < 8; c++) {
            u[c] = _mm256_xor_si256(load_lanes(wq + c * stride, count), _mm256_set1_epi8((char)0x80));
        }
    } else {
        for (int k = 0; k < 4; k++) {
            const __m256i raw = load_lanes(wq + k * stride, count);
            u[k] = _mm256_and_si256(raw, _mm256_set1_epi8(0x0f));
            u[k + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0f));
        }
    }
}

/* AVX2 keeps Q8_0's weights signed (maddubs's u <= 255 times 127 could
   saturate its int16 pairs): |x| times w with x's sign, no corr; Q4_0's
   u <= 15 cannot (2*15*127), so it is unsigned with corr */
TARGET_AVX2 static LLMC_ALWAYS_INLINE void avx2_weights(__m256i u[8], const uint8_t* wq,
                                                        size_t stride, int count, int qtype) {
    if (qtype == LLMC_QUANT_Q8_0) {
        for (int c = 0; c < 8; c++) { u[c] = load_lanes(wq + c * stride, count); }
    } else {
        unsigned_weights(u, wq, stride, count, qtype);
    }
}
/* maddubs sums pairs u*x into int16, madd with ones pairs those into int32.
   For Q8_0 the sign trick: w is signed, and every x and w stay within
   [-127, 127] (quantize_block_q8_0's range) */
#define DOT_AVX2(s, w, x)                                                                 \
    _mm256_add_epi32((s), _mm256_madd_epi16(                                              \
        qtype == LLMC_QUANT_Q8_0                                                          \
            ? _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x))        \
            : _mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#define INIT_AVX2(corr, count) \
    (qtype == LLMC_QUANT_Q8_0 ? _mm256_setzero_si256() : load_lanes(corr, count))
#define DOT_AVXVNNI(s, u, x) _mm256_dpbusd_avx_epi32(s, u, x)
#define INIT_CORR(corr, count) load_lanes(corr, count)

ROWS_256(rows_avx2, TARGET_AVX2, DOT_AVX2, INIT_AVX2, avx2_weights)
ROWS_256(rows_avxvnni, TARGET_AVXVNNI, DOT_AVXVNNI, INIT_CORR, unsigned_weights)
#endif

enum { PATH_PORTABLE, PATH_AVX2, PATH_AVXVNNI, PATH_AVX512VNNI };

#ifdef LLMC_X86_DISPATCH
/* bit of CPUID leaf.subleaf's register (0 eax, 2 ecx); clang 14's
   __builtin_cpu_supports knows neither f16c nor avxvnni */
static int cpuid_bit(unsigned leaf, unsigned subleaf, int reg, int bit) {
    unsigned r[4];
    if (!__get_cpuid_count(leaf, subleaf, &r[0], &r[1], &r[2], &r[3])) { return 0; }
    return (r[reg] >> bit) & 1u;
}
#endif

static int path_supported_uncached(int path) {
    switch (path) {
        case PATH_PORTABLE: return 1;
#ifdef LLMC_X86_DISPATCH
        case PATH_AVX2:
            return llmc_isa_supported(LLMC_ISA_AVX2) && cpuid_bit(1, 0, 2, 29);
        case PATH_AVXVNNI:
            return path_supported_uncached(PATH_AVX2) && cpuid_bit(7, 1, 0, 4);
        case PATH_AVX512VNNI:
            return path_supported_uncached(PATH_AVX2) && llmc_isa_supported(LLMC_ISA_AVX512)
                   && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
                   && __builtin_cpu_supports("avx512vnni");
#endif
        default: return 0;
    }
}

/* path_supported_uncached's answer, asked once per path: CPUID traps to the
   hypervisor in a virtual machine (microseconds each), which every decoding
   call would otherwise pay several times; -1: not asked yet */
static int path_support[PATH_AVX512VNNI + 1] = {-1, -1, -1, -1};

static int path_supported(int path) {
    if (path < 0 || path > PATH_AVX512VNNI) { return 0; }
    int known = __atomic_load_n(&path_support[path], __ATOMIC_RELAXED);
    if (known < 0) {
        known = path_supported_uncached(path);
        __atomic_store_n(&path_support[path], known, __ATOMIC_RELAXED);
    }
    return known;
}

static rows_fn path_function(int path) {
#ifdef LLMC_X86_DISPATCH
    switch (path) {
        case PATH_AVX2: return rows_avx2;
        case PATH_AVXVNNI: return rows_avxvnni;
        case PATH_AVX512VNNI: return rows_avx512vnni;
        default: break;
    }
#endif
    (void)path;
    return rows_portable;
}

/* The best path under the chosen instruction set: AVX-512 may use
   AVX512-VNNI, AVX2 (or AVX-512 without VNNI) AVX-VNNI or else AVX2. */
static int best_path(void) {
    const int isa = llmc_get_isa();
    if (isa >= LLMC_ISA_AVX512 && path_supported(PATH_AVX512VNNI)) { return PATH_AVX512VNNI; }
    if (isa >= LLMC_ISA_AVX2 && path_supported(PATH_AVXVNNI)) { return PATH_AVXVNNI; }
    if (isa >= LLMC_ISA_AVX2 && path_supported(PATH_AVX2)) { return PATH_AVX2; }
    return PATH_PORTABLE;
}


/* Row x [nb * 32] quantized to Q8_0 as matmul_forward_quant's input
   (quant_input): its quants q [nb * 32] in the packed layout, scales d
   [nb] and corr [nb] against qtype's weight offset. */
static void quantize_input_row(int8_t* q, float* d, int32_t* corr, const float* x, int nb,
                               int qtype) {
    const int offset = weight_offset(qtype);
    for (int b = 0; b < nb; b++) {
        uint8_t block[2 + QK];
        quantize_block_q8_0(block, x + (size_t)b * QK);
        d[b] = block_scale(block);
        int32_t sum = 0;
        for (int k = 0; k < QK / 4; k++) {
            memcpy(q + chunk_offset(nb, b, k, QK), block + 2 + 4 * k, 4);
        }
        for (int i = 0; i < QK; i++) { sum += (int8_t)block[2 + i]; }
        corr[b] = -offset * sum;
    }
}

typedef void (*quantize_fn)(int8_t* q, float* d, int32_t* corr, const float* x, int nb,
                            int qtype);

/* the input quantizer a path runs: the vector one on AVX512-VNNI's (so the
   tests that compare paths compare the two quantizers too) */
static quantize_fn path_quantizer(int path) {
#ifdef LLMC_X86_DISPATCH
    if (path == PATH_AVX512VNNI) { return quantize_input_row_512; }
#endif
    (void)path;
    return quantize_input_row;
}

static int matmul_quant(int path, float* out, const float* inp, const uint8_t* weight,
                        const float* bias, int N, int IC, int OC, int qtype) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(block_bytes(qtype) != 0, LLMC_ERR_VALUE);
    LLMC_REQUIRE(N > 0 && IC > 0 && OC > 0 && IC % QK == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits((size_t)N, (size_t)IC, 1, 1)
                 && llmc_count_fits((size_t)OC, (size_t)IC, 1, 1)
                 && llmc_count_fits((size_t)N, (size_t)OC, 1, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(path_supported(path), LLMC_ERR_UNSUPPORTED);
    const rows_fn rows = path_function(path);
    const quantize_fn quantize_input = path_quantizer(path);

    const int nb = IC / QK;
    int8_t* xq = malloc((size_t)N * IC);
    float* xd = malloc((size_t)N * nb * sizeof(float));
    int32_t* corr = malloc((size_t)N * nb * sizeof(int32_t));
    if (xq == NULL || xd == NULL || corr == NULL) {
        free(xq); free(xd); free(corr);
        return LLMC_ERR_NOMEM;
    }
    for (int n = 0; n < N; n++) {
        quantize_input(xq + (size_t)n * IC, xd + (size_t)n * nb, corr + (size_t)n * nb,
                       inp + (size_t)n * IC, nb, qtype);
    }

    // each thread one contiguous run of output rows (whole groups of ROWS),
    // each row's weights read from memory once for all N input rows; every
    // out[n, o] is summed by one thread: its 16 lanes in group order, then
    // the lanes in a fixed tree in double with the bias, rounded once to float
    const size_t row_bytes = (size_t)nb * block_bytes(qtype);
    const quant_input all = {xq, xd, corr, N, nb};
    #pragma omp parallel
    {
        int64_t lo, hi;
        llmc_thread_share((OC + ROWS - 1) / ROWS, &lo, &hi);
        const int o0 = (int)lo * ROWS, o1 = hi * ROWS < OC ? (int)hi * ROWS : OC;
        if (o0 < o1) { rows(out, OC, weight, row_bytes, o0, o1, bias, &all, qtype); }
    }
    free(xq); free(xd); free(corr);
    return LLMC_OK;
}

/* the exported entry points: the best path, then each path forced */
#define MATMUL_QUANT(name, path)                                                         \
    int name(float* out, const float* inp, const uint8_t* weight, const float* bias,     \
             int N, int IC, int OC, int qtype) {                                         \
        return matmul_quant(path, out, inp, weight, bias, N, IC, OC, qtype);             \
    }
MATMUL_QUANT(matmul_forward_quant, best_path())
MATMUL_QUANT(matmul_forward_quant_portable, PATH_PORTABLE)
MATMUL_QUANT(matmul_forward_quant_avx2, PATH_AVX2)
MATMUL_QUANT(matmul_forward_quant_avxvnni, PATH_AVXVNNI)
MATMUL_QUANT(matmul_forward_quant_avx512vnni, PATH_AVX512VNNI)

/* ---- many rows: bf16 tiles for the bf16 GEMM ------------------------------- */

/*
 * For many rows (prefill, LoRA training) the weight is dequantised, a tile
 * of rows or columns at a time, to bf16 and multiplied by the bf16 GEMM
 * (matmul_bf16.c), which packs the tile into its panels: the products are
 * the bf16 GEMM's, plus one dequantising pass over the weight per call and
 * a packing of the input per tile; the tile (about QP_TILE_BYTES of bf16,
 * at least QP_MIN_TILE columns) and an [N, tile] float part are all the
 * extra memory.
 *
 * Rounding: d*q is exact in float32 (11 + 7 significant bits), and is then
 * rounded to the nearest bf16 (ties to even, llmc_bf16_round): 8
 * significant bits, so a weight moves by up to 2^-8 of itself (Q4_0's too:
 * an 11-bit d times |q - 8| <= 8 is not always exact in bf16 either). The
 * result is therefore bitwise matmul_forward_bf16 / matmul_backward_bf16
 * on W' = bf16(dequantize(W)):
 * a forward tile is whole output columns (each output's sum unchanged), a
 * backward tile whole input columns of W over all of K = OC. The GEMM is
 * thread-count invariant, so this is too; its instruction-set paths
 * (vdpbf16ps, or the widened float32 fallback) are matmul_bf16.c's.
 */
#define QP_TILE_BYTES (8 << 20)
#define QP_MIN_TILE 192   /* tile columns at least (a multiple of 32 and 48) */

/* Columns of a tile over `other` values each: a multiple of QP_MIN_TILE,
   about QP_TILE_BYTES of bf16, at most `total` rounded up to 32. */
static int panel_tile(int total, int other) {
    int64_t cols = (int64_t)QP_TILE_BYTES / 2 / other / QP_MIN_TILE * QP_MIN_TILE;
    if (cols < QP_MIN_TILE) { cols = QP_MIN_TILE; }
    const int64_t whole = ((int64_t)total + QK - 1) / QK * QK;
    return (int)(cols < whole ? cols : whole);
}

/* tile[r, i] = bf16(W[o0 + r, i0 + i]) for r < nrows, i < ncols (i0, ncols
   multiples of 32): rows of the weight's blocks, rounded as stated above. */
static void dequantize_tile_bf16(uint16_t* tile, const uint8_t* weight, int IC, int qtype,
                                 int o0, int nrows, int i0, int ncols) {
    const int nb_row = IC / QK, nb = ncols / QK;
    const size_t row_bytes = (size_t)nb_row * block_bytes(qtype), qbytes = quant_bytes(qtype);
    #pragma omp parallel for schedule(static)
    for (int64_t rb = 0; rb < (int64_t)nrows * nb; rb++) {
        const int r = (int)(rb / nb), b = (int)(rb % nb), block = i0 / QK + b;
        const uint8_t* row = weight + (size_t)(o0 + r) * row_bytes;
        // the block's 4-byte chunks, g * 4 bytes apart (the packed layout)
        const int b0 = block / GROUP * GROUP, g = nb_row - b0 < GROUP ? nb_row - b0 : GROUP;
        const uint8_t* chunks = row + (size_t)nb_row * 2 + (size_t)b0 * qbytes
                                + (size_t)(block - b0) * 4;
        const float d = block_scale(row + (size_t)block * 2);
        uint16_t* dst = tile + (size_t)r * ncols + (size_t)b * QK;
        if (qtype == LLMC_QUANT_Q8_0) {
            for (int k = 0; k < QK / 4; k++) {
                const int8_t* q = (const int8_t*)chunks + (size_t)k * g * 4;
                for (int t = 0; t < 4; t++) { dst[4 * k + t] = llmc_bf16_round((float)q[t] * d); }
            }
        } else {
            for (int k = 0; k < QK / 8; k++) {
                const uint8_t* q = chunks + (size_t)k * g * 4;
                for (int t = 0; t < 4; t++) {
                    dst[4 * k + t] = llmc_bf16_round((float)((q[t] & 0x0f) - 8) * d);
                    dst[16 + 4 * k + t] = llmc_bf16_round((float)((q[t] >> 4) - 8) * d);
                }
            }
        }
    }
}

static int check_panels(const void* a, const void* b, const uint8_t* weight, int N, int IC,
                        int OC, int qtype) {
    if (!LLMC_NONNULL3(a, b, weight)) { return LLMC_ERR_NULL; }
    if (block_bytes(qtype) == 0) { return LLMC_ERR_VALUE; }
    if (N <= 0 || IC <= 0 || OC <= 0 || IC % QK != 0) { return LLMC_ERR_SHAPE; }
    if (!llmc_count_fits((size_t)N, (size_t)IC, 1, 1) || !llmc_count_fits((size_t)OC, (size_t)IC, 1, 1)
        || !llmc_count_fits((size_t)N, (size_t)OC, 1, 1)) { return LLMC_ERR_SHAPE; }
    return LLMC_OK;
}

int matmul_forward_quant_panels(float* out, const float* inp, const uint8_t* weight,
                                const float* bias, int N, int IC, int OC, int qtype) {
    const int status = check_panels(out, inp, weight, N, IC, OC, qtype);
    LLMC_REQUIRE(status == LLMC_OK, status);
    // tiles of R output channels: W rows o0 .. o0+R, out columns likewise
    const int R = panel_tile(OC, IC);
    uint16_t* tile = malloc((size_t)R * IC * sizeof(uint16_t));
    float* part = malloc((size_t)N * R * sizeof(float));
    int result = tile != NULL && part != NULL ? LLMC_OK : LLMC_ERR_NOMEM;
    for (int o0 = 0; o0 < OC && result == LLMC_OK; o0 += R) {
        const int nr = OC - o0 < R ? OC - o0 : R;
        dequantize_tile_bf16(tile, weight, IC, qtype, o0, nr, 0, IC);
        result = matmul_forward_bf16(part, inp, tile, bias != NULL ? bias + o0 : NULL,
                                     1, N, IC, nr, LLMC_DTYPE_F32);
        for (int n = 0; n < N && result == LLMC_OK; n++) {
            memcpy(out + (size_t)n * OC + o0, part + (size_t)n * nr, (size_t)nr * sizeof(float));
        }
    }
    free(tile); free(part);
    return result;
}

int matmul_backward_quant_panels(float* dinp, const float* dout, const uint8_t* weight,
                                 int N, int IC, int OC, int qtype) {
    const int status = check_panels(dinp, dout, weight, N, IC, OC, qtype);
    LLMC_REQUIRE(status == LLMC_OK, status);
    // tiles of R input channels: W columns i0 .. i0+R over every row o,
    // dinp's columns likewise (copied out, accumulated onto, copied back)
    const int R = panel_tile(IC, OC);
    uint16_t* tile = malloc((size_t)R * OC * sizeof(uint16_t));
    float* part = malloc((size_t)N * R * sizeof(float));
    int result = tile != NULL && part != NULL ? LLMC_OK : LLMC_ERR_NOMEM;
    for (int i0 = 0; i0 < IC && result == LLMC_OK; i0 += R) {
        const int nc = IC - i0 < R ? IC - i0 : R;
        dequantize_tile_bf16(tile, weight, IC, qtype, 0, OC, i0, nc);
        for (int n = 0; n < N; n++) {
            memcpy(part + (size_t)n * nc, dinp + (size_t)n * IC + i0, (size_t)nc * sizeof(float));
        }
        result = matmul_backward_bf16(part, NULL, NULL, dout, NULL, tile, 1, N, nc, OC,
                                      LLMC_DTYPE_F32, 0);
        for (int n = 0; n < N && result == LLMC_OK; n++) {
            memcpy(dinp + (size_t)n * IC + i0, part + (size_t)n * nc, (size_t)nc * sizeof(float));
        }
    }
    free(tile); free(part);
    return result;
}

/* ---- the experts of a mixture: each one's rows, grouped ------------------- */

/*
 * moe_grouped_forward_quant: moe.c's grouped forward on quantized experts
 * (weight [E * OC] packed rows, expert e's OC rows at e * OC). Experts with
 * 1 .. few_rows rows (decoding) take the few-row arithmetic above, their
 * input rows quantized once and every expert's groups of ROWS output rows
 * in one parallel loop (each weight row read once); experts with more
 * (prefill) the panel path, one expert at a time. Each output is one
 * thread's, so the result is bitwise matmul_forward_quant's (or _panels')
 * on each expert's rows alone, for any thread count.
 */

/* offsets[0 .. E] runs from 0 to R without stepping back. */
static int quant_offsets_ok(const int* offsets, int E, int R) {
    if (offsets[0] != 0 || offsets[E] != R) { return 0; }
    for (int e = 0; e < E; e++) {
        if (offsets[e + 1] < offsets[e]) { return 0; }
    }
    return 1;
}

/* One group of ROWS output rows of one few-row expert. */
typedef struct {
    int expert, o0;
} expert_group;

/* grouped_quant's experts of 1 .. few_rows rows (`few` of them): their
   input rows quantized, then all their groups of output rows in one
   parallel loop. */
static int few_row_experts(rows_fn rows, quantize_fn quantize_input, float* out,
                           const float* inp, const uint8_t* weight, const int* offsets, int R,
                           int IC, int OC, int E, int qtype, int few_rows, int few) {
    const int nb = IC / QK, groups = (OC + ROWS - 1) / ROWS;
    const size_t row_bytes = (size_t)nb * block_bytes(qtype);
    // indexed by the grouped row r (the many-row experts' slots unused)
    int8_t* xq = malloc((size_t)R * IC);
    float* xd = malloc((size_t)R * nb * sizeof(float));
    int32_t* corr = malloc((size_t)R * nb * sizeof(int32_t));
    expert_group* jobs = malloc((size_t)few * groups * sizeof *jobs);
    if (xq == NULL || xd == NULL || corr == NULL || jobs == NULL) {
        free(xq); free(xd); free(corr); free(jobs);
        return LLMC_ERR_NOMEM;
    }
    int count = 0;
    for (int e = 0; e < E; e++) {
        const int r0 = offsets[e], n = offsets[e + 1] - r0;
        if (n == 0 || n > few_rows) { continue; }
        for (int r = r0; r < r0 + n; r++) {
            quantize_input(xq + (size_t)r * IC, xd + (size_t)r * nb, corr + (size_t)r * nb,
                           inp + (size_t)r * IC, nb, qtype);
        }
        for (int grp = 0; grp < groups; grp++) { jobs[count++] = (expert_group){e, grp * ROWS}; }
    }
    #pragma omp parallel for schedule(static)
    for (int j = 0; j < count; j++) {
        const int e = jobs[j].expert, r0 = offsets[e];
        const quant_input mine = {xq + (size_t)r0 * IC, xd + (size_t)r0 * nb,
                                  corr + (size_t)r0 * nb, offsets[e + 1] - r0, nb};
        const int o0 = jobs[j].o0, o1 = OC - o0 < ROWS ? OC : o0 + ROWS;
        rows(out + (size_t)r0 * OC, OC, weight + (size_t)e * OC * row_bytes, row_bytes, o0, o1,
             NULL, &mine, qtype);
    }
    free(xq); free(xd); free(corr); free(jobs);
    return LLMC_OK;
}

static int grouped_quant(int path, float* out, const float* inp, const uint8_t* weight,
                         const int* offsets, int R, int IC, int OC, int E, int qtype,
                         int few_rows) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, weight) && offsets != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(block_bytes(qtype) != 0, LLMC_ERR_VALUE);
    LLMC_REQUIRE(R > 0 && IC > 0 && OC > 0 && E > 0 && IC % QK == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits((size_t)R, (size_t)IC, 1, 1)
                 && llmc_count_fits((size_t)E, (size_t)OC, (size_t)IC, 1)
                 && llmc_count_fits((size_t)R, (size_t)OC, 1, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(quant_offsets_ok(offsets, E, R), LLMC_ERR_RANGE);
    LLMC_REQUIRE(path_supported(path), LLMC_ERR_UNSUPPORTED);
    int few = 0;
    for (int e = 0; e < E; e++) {
        const int n = offsets[e + 1] - offsets[e];
        few += n > 0 && n <= few_rows;
    }
    int status = few > 0 ? few_row_experts(path_function(path), path_quantizer(path), out, inp,
                                           weight, offsets, R, IC, OC, E, qtype, few_rows, few)
                         : LLMC_OK;
    const size_t expert_bytes = (size_t)OC * (IC / QK) * block_bytes(qtype);
    for (int e = 0; e < E && status == LLMC_OK; e++) {
        const int r0 = offsets[e], n = offsets[e + 1] - r0;
        if (n <= few_rows) { continue; }
        status = matmul_forward_quant_panels(out + (size_t)r0 * OC, inp + (size_t)r0 * IC,
                                             weight + (size_t)e * expert_bytes, NULL, n, IC, OC,
                                             qtype);
    }
    return status;
}

/* the exported entry points: the best few-row path, then each forced */
#define GROUPED_QUANT(name, path)                                                          \
    int name(float* out, const float* inp, const uint8_t* weight, const int* offsets,      \
             int R, int IC, int OC, int E, int qtype, int few_rows) {                      \
        return grouped_quant(path, out, inp, weight, offsets, R, IC, OC, E, qtype,         \
                             few_rows);                                                    \
    }
GROUPED_QUANT(moe_grouped_forward_quant, best_path())
GROUPED_QUANT(moe_grouped_forward_quant_portable, PATH_PORTABLE)
GROUPED_QUANT(moe_grouped_forward_quant_avx2, PATH_AVX2)
GROUPED_QUANT(moe_grouped_forward_quant_avxvnni, PATH_AVXVNNI)
GROUPED_QUANT(moe_grouped_forward_quant_avx512vnni, PATH_AVX512VNNI)
