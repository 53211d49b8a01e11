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
 * paths of matmul_forward_quant (a lane-sums function per instruction set
 * under one shared loop; the unsuffixed function picks the best this CPU
 * has under llmc_get_isa(), each suffixed one forces its path):
 *   portable    plain C
 *   avx2        AVX2: maddubs + madd (Haswell, Zen)
 *   avxvnni     AVX-VNNI vpdpbusd on 256 bits (Alder Lake, Zen 5)
 *   avx512vnni  AVX512-VNNI: vpdpbusd on 256 bits, the 8 lanes in one zmm
 *               of doubles (Ice Lake, Sapphire Rapids, Zen 4)
 * As llama.cpp does, each input row is first quantized to Q8_0 blocks; then
 * per block an integer dot product, ROWS weight rows a pass. Every path splits a block's dot product
 * into the same 8 int32 lane sums (lane j: elements 4j..4j+3, vpdpbusd's and
 * maddubs+madd's grouping), which are exact. Each lane sum times the float
 * d_w*d_x is exact in double (17 + 24 bits), and each lane accumulates its
 * products in double in block order, so no fusing of multiply and add can
 * change the result: all paths agree bitwise, for any thread count.
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

/* ---- the decoding matmul ------------------------------------------------- */

/* output rows a kernel call computes together, so that each block of the
   quantized input row is loaded once for all of them and their double
   accumulations form independent chains */
#define ROWS 4

/*
 * A path's kernel: for r < nrows (1 or ROWS), lane[r][j] (written) = sum
 * over the nb blocks, in order, of (int32 sum of w[i] * q[i] for
 * i = 4j .. 4j+3 of the block) * (d_w * d_x), each term exact in double, w
 * the weight row at w0 + r * row_bytes; q, d the input row's int8s and
 * scales, qoff its lane sums times minus the weight offset (below).
 */
typedef void (*lane_sums_fn)(double (*lane)[8], const uint8_t* w0, size_t row_bytes,
                             int nrows, const int8_t* q, const int32_t* qoff,
                             const float* d, int nb, int qtype);

/* The offset that makes a block's weights unsigned bytes u = w + offset
   for vpdpbusd and maddubs (unsigned times signed): Q8_0's w ^ 0x80, Q4_0's
   bare nibble. Then sum w*q = sum u*q - offset * sum q exactly in int32, and
   the last term is the input's alone: qoff, computed once per input row. */
static int weight_offset(int qtype) { return qtype == LLMC_QUANT_Q8_0 ? 128 : 8; }

/* the plain twin (w unpacked to signed bytes: no qoff) */
static void lane_sums_portable(double (*lane)[8], const uint8_t* w0, size_t row_bytes,
                               int nrows, const int8_t* q, const int32_t* qoff,
                               const float* d, int nb, int qtype) {
    (void)qoff;
    const size_t bb = block_bytes(qtype);
    for (int r = 0; r < nrows; r++) {
        const uint8_t* wrow = w0 + (size_t)r * row_bytes;
        for (int j = 0; j < 8; j++) { lane[r][j] = 0.0; }
        for (int b = 0; b < nb; b++) {
            int8_t w[QK];
            unpack_block(w, wrow + (size_t)b * bb, qtype);
            const int8_t* qb = q + (size_t)b * QK;
            const float scale = block_scale(wrow + (size_t)b * bb) * d[b];
            for (int j = 0; j < 8; j++) {
                int32_t s = 0;
                for (int i = 4 * j; i < 4 * j + 4; i++) { s += (int32_t)w[i] * qb[i]; }
                lane[r][j] += (double)s * (double)scale;
            }
        }
    }
}

#ifdef LLMC_X86_DISPATCH

/* A block's 32 weights plus weight_offset as unsigned bytes in one ymm. Q4_0:
   the 16 packed bytes in both halves, the upper half shifted by a nibble, so
   the low nibbles are elements 0..15 and the high ones 16..31. */
#define UNSIGNED_WEIGHTS_256(block, qtype)                                                \
    ((qtype) == LLMC_QUANT_Q8_0                                                           \
         ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)((block) + 2)),             \
                            _mm256_set1_epi8((char)0x80))                                 \
         : _mm256_and_si256(_mm256_srlv_epi32(                                             \
               _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)((block) + 2))), \
               _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0f)))

#define SCALE_F16C(block) _cvtsh_ss((unsigned short)((block)[0] | ((block)[1] << 8)))

/*
 * The SIMD paths share this loop: per block, the input's 32 int8s and qoff
 * are loaded once for the ROWS weight rows; per row, DOT4 gives the block's
 * 8 int32 lane sums, which ACCUMULATE adds times the scale to the row's
 * double lanes (a fused multiply-add: the product is exact, so it rounds as
 * the sum alone). ACC is the accumulator type, ZERO / STORE its set and
 * store of 8 doubles. Each row is prefetched 4 groups of ROWS rows ahead
 * (into L2): the hardware prefetchers alone lose ROWS interleaved streams.
 */
#define LANE_SUMS(NAME, TARGET, ACC, ZERO, DOT4, ACCUMULATE, STORE)                        \
TARGET static LLMC_ALWAYS_INLINE void NAME##_rows(                                          \
        double (*lane)[8], const uint8_t* w0, size_t row_bytes, const int R,             \
        const int8_t* q, const int32_t* qoff, const float* d, int nb, int qtype) {       \
    const size_t bb = block_bytes(qtype);                                                 \
    ACC acc[ROWS];                                                                        \
    for (int r = 0; r < R; r++) { ZERO(acc[r]); }                                         \
    for (int b = 0; b < nb; b++) {                                                        \
        const __m256i x = _mm256_loadu_si256((const __m256i*)(q + (size_t)b * QK));       \
        const __m256i off = _mm256_loadu_si256((const __m256i*)(qoff + (size_t)b * 8));   \
        const float dx = d[b];                                                            \
        for (int r = 0; r < R; r++) {                                                     \
            const uint8_t* block = w0 + (size_t)r * row_bytes + (size_t)b * bb;           \
            _mm_prefetch((const char*)block + 4 * ROWS * row_bytes, _MM_HINT_T1);               \
            const __m256i s = DOT4(block, x, off, qtype);                                 \
            ACCUMULATE(acc[r], s, (double)(SCALE_F16C(block) * dx));                      \
        }                                                                                 \
    }                                                                                     \
    for (int r = 0; r < R; r++) { STORE(lane[r], acc[r]); }                               \
}                                                                                         \
TARGET static void NAME(double (*lane)[8], const uint8_t* w0, size_t row_bytes,          \
                        int nrows, const int8_t* q, const int32_t* qoff, const float* d, \
                        int nb, int qtype) {                                              \
    if (nrows == ROWS) { NAME##_rows(lane, w0, row_bytes, ROWS, q, qoff, d, nb, qtype); } \
    else {                                                                                \
        for (int r = 0; r < nrows; r++) {                                                 \
            NAME##_rows(lane + r, w0 + (size_t)r * row_bytes, row_bytes, 1, q, qoff, d,   \
                        nb, qtype);                                                       \
        }                                                                                 \
    }                                                                                     \
}

/* 256 bits: the 8 lanes in two ymm of 4 doubles */
typedef struct { __m256d lo, hi; } acc256;
#define ZERO_256(a) ((a).lo = (a).hi = _mm256_setzero_pd())
#define ACCUMULATE_256(a, s, scale) do {                                                  \
        const __m256d sc = _mm256_set1_pd(scale);                                         \
        (a).lo = _mm256_fmadd_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(s)), sc, (a).lo); \
        (a).hi = _mm256_fmadd_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(s, 1)), sc,   \
                                 (a).hi);                                                 \
    } while (0)
#define STORE_256(p, a) (_mm256_storeu_pd((p), (a).lo), _mm256_storeu_pd((p) + 4, (a).hi))

/* 512 bits: the 8 lanes in one zmm */
#define ZERO_512(a) ((a) = _mm512_setzero_pd())
#define ACCUMULATE_512(a, s, scale) \
    ((a) = _mm512_fmadd_pd(_mm512_cvtepi32_pd(s), _mm512_set1_pd(scale), (a)))
#define STORE_512(p, a) _mm512_storeu_pd((p), (a))

/* AVX2: maddubs sums pairs u*x into int16 and madd with ones pairs those
   into int32. Q4_0's u <= 15 cannot saturate the int16 (2*15*127), Q8_0's
   u <= 255 can, so Q8_0 keeps signed weights: |x| times w with x's sign
   (|x|, |w| <= 127). */
#define DOT4_AVX2(block, x, off, qtype)                                                   \
    ((qtype) == LLMC_QUANT_Q8_0                                                           \
         ? _mm256_madd_epi16(_mm256_maddubs_epi16(                                        \
               _mm256_sign_epi8(x, x),                                                    \
               _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)((block) + 2)), x)),    \
               _mm256_set1_epi16(1))                                                      \
         : _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(                       \
               UNSIGNED_WEIGHTS_256(block, qtype), x), _mm256_set1_epi16(1)), off))
/* vpdpbusd adds the 4 products u*x of a lane to qoff's lane exactly
   (|sum| < 2^31) */
#define DOT4_AVXVNNI(block, x, off, qtype) \
    _mm256_dpbusd_avx_epi32(off, UNSIGNED_WEIGHTS_256(block, qtype), x)
#define DOT4_AVX512VNNI(block, x, off, qtype) \
    _mm256_dpbusd_epi32(off, UNSIGNED_WEIGHTS_256(block, qtype), x)

LANE_SUMS(lane_sums_avx2, TARGET_AVX2, acc256, ZERO_256, DOT4_AVX2, ACCUMULATE_256, STORE_256)
LANE_SUMS(lane_sums_avxvnni, TARGET_AVXVNNI, acc256, ZERO_256, DOT4_AVXVNNI, ACCUMULATE_256,
          STORE_256)
LANE_SUMS(lane_sums_avx512vnni, TARGET_AVX512VNNI, __m512d, ZERO_512, DOT4_AVX512VNNI,
          ACCUMULATE_512, STORE_512)
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

static lane_sums_fn path_function(int path) {
#ifdef LLMC_X86_DISPATCH
    switch (path) {
        case PATH_AVX2: return lane_sums_avx2;
        case PATH_AVXVNNI: return lane_sums_avxvnni;
        case PATH_AVX512VNNI: return lane_sums_avx512vnni;
        default: break;
    }
#endif
    (void)path;
    return lane_sums_portable;
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

static int matmul_quant(int path, float* out, const float* inp, const uint8_t* weight,
                        const float* bias, int N, int IC, int OC, int qtype) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, weight), LLMC_ERR_NULL);
    LLMC_REQUIRE(block_bytes(qtype) != 0, LLMC_ERR_VALUE);
    LLMC_REQUIRE(N > 0 && IC > 0 && OC > 0 && IC % QK == 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits((size_t)N, (size_t)IC, 1, 1)
                 && llmc_count_fits((size_t)OC, (size_t)IC, 1, 1)
                 && llmc_count_fits((size_t)N, (size_t)OC, 1, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(path_supported(path), LLMC_ERR_UNSUPPORTED);
    const lane_sums_fn lane_sums = path_function(path);

    // the input rows as Q8_0 (llama.cpp's vec_dot_type of both formats),
    // unpacked: the int8s contiguous, one float scale a block, and per
    // block the 8 lane sums times minus the weight offset
    const int nb = IC / QK;
    int8_t* xq = malloc((size_t)N * IC);
    float* xd = malloc((size_t)N * nb * sizeof(float));
    int32_t* xoff = malloc((size_t)N * nb * 8 * sizeof(int32_t));
    if (xq == NULL || xd == NULL || xoff == NULL) {
        free(xq); free(xd); free(xoff);
        return LLMC_ERR_NOMEM;
    }
    const int offset = weight_offset(qtype);
    for (int n = 0; n < N; n++) {
        for (int b = 0; b < nb; b++) {
            uint8_t block[2 + QK];
            const size_t at = (size_t)n * IC + (size_t)b * QK;
            quantize_block_q8_0(block, inp + at);
            xd[(size_t)n * nb + b] = block_scale(block);
            memcpy(xq + at, block + 2, QK);
            for (int j = 0; j < 8; j++) {
                const int8_t* q4 = xq + at + 4 * j;
                xoff[at / 4 + j] = -offset * (q4[0] + q4[1] + q4[2] + q4[3]);
            }
        }
    }

    // each thread a contiguous run of groups of ROWS output rows (a weight
    // row is read once from memory, then from cache for the other input
    // rows); every out[n, o] is summed by one thread: the lanes in block
    // order, then the lanes in a fixed tree and the bias, rounded once to
    // float
    const size_t row_bytes = (size_t)nb * block_bytes(qtype);
    const int groups = (OC + ROWS - 1) / ROWS;
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < groups; g++) {
        const int o0 = g * ROWS;
        const int nrows = OC - o0 < ROWS ? OC - o0 : ROWS;
        for (int n = 0; n < N; n++) {
            double lane[ROWS][8];
            lane_sums(lane, weight + (size_t)o0 * row_bytes, row_bytes, nrows,
                      xq + (size_t)n * IC, xoff + (size_t)n * nb * 8, xd + (size_t)n * nb,
                      nb, qtype);
            for (int r = 0; r < nrows; r++) {
                const double* l = lane[r];
                const double sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
                const int o = o0 + r;
                out[(size_t)n * OC + o] = (float)(sum + (bias != NULL ? (double)bias[o] : 0.0));
            }
        }
    }
    free(xq); free(xd); free(xoff);
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
    const size_t bb = block_bytes(qtype), row_bytes = (size_t)(IC / QK) * bb;
    const int nb = ncols / QK;
    #pragma omp parallel for schedule(static)
    for (int64_t rb = 0; rb < (int64_t)nrows * nb; rb++) {
        const int r = (int)(rb / nb), b = (int)(rb % nb);
        const uint8_t* block = weight + (size_t)(o0 + r) * row_bytes + (size_t)(i0 / QK + b) * bb;
        int8_t q[QK];
        unpack_block(q, block, qtype);
        const float d = block_scale(block);
        uint16_t* dst = tile + (size_t)r * ncols + (size_t)b * QK;
        for (int i = 0; i < QK; i++) { dst[i] = llmc_bf16_round((float)q[i] * d); }
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
                                      LLMC_DTYPE_F32);
        for (int n = 0; n < N && result == LLMC_OK; n++) {
            memcpy(dinp + (size_t)n * IC + i0, part + (size_t)n * nc, (size_t)nc * sizeof(float));
        }
    }
    free(tile); free(part);
    return result;
}
