/*
 * Rotary position embedding (Llama), forward and backward, on packed
 * [q heads | k heads | v heads] rows in either pair layout stated in
 * llmc_api.h: half-split (Hugging Face's) or interleaved (Meta's original).
 *
 * Each pair (x[i], x[i + hs/2]), or (x[2i], x[2i + 1]) interleaved, turns by
 * the angle a = p * f_i, with the
 * frequency f_i = theta^(-2i/hs), or inv_freq[i] when the caller gives them
 * (a scaled RoPE: linear interpolation, NTK, Llama 3's rule; see config.py):
 *   forward   R(a)  = [cos a, -sin a; sin a, cos a]
 *   backward  R(a)^T = R(-a), since a rotation's Jacobian is itself and its
 *             transpose is its inverse; the angle does not depend on x, so
 *             nothing else flows back.
 * The angle is formed in double (p * theta^(-2i/hs) with p in the thousands
 * loses the low bits of a float angle), and its cos and sin are rounded to
 * float once per (b, t, i), then used for all NH + NKV rotated heads.
 *
 * Parallel over the (b, t) rows: a row reads and writes only its own
 * elements, so any thread count gives bitwise the same result. Within a row
 * the pair index runs in chunks of ROPE_CHUNK, with that chunk's cos and sin
 * on the stack, so no scratch memory is needed whatever hs is. Without pos
 * (training, evaluation) the B rows of a t share their angles, so their cos
 * and sin are computed once per t into a [T, hs/2] table first (the same
 * floats; if that memory cannot be had, each row computes its own). A row
 * is one call of its per-ISA function (isa.h).
 *
 * KV-cache decoding turns one position per row at every layer: rope_table
 * computes the cos and sin of each position up to the cache's length once
 * (the same floats as above), and kv_cache_write turns a row's q and k with
 * that table's row through the same per-ISA row function, writing q for
 * attention_decode and k and v straight into the cache slot, so a decoded
 * position's keys are the forward's bitwise. Without a table (a model
 * without RoPE) it copies.
 */
#include "llmc.h"
#include "common.h"
#include "isa.h"

#define ROPE_CHUNK 64

/* Checks shared by forward and backward; returns LLMC_OK or a status. */
static int rope_check(const float* out, const float* inp, const int* pos, const double* inv_freq,
                      int B, int T, int NH, int NKV, int hs, float theta) {
    LLMC_REQUIRE(LLMC_NONNULL2(out, inp), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && T > 0 && NH > 0 && NKV > 0 && hs > 0 && hs % 2 == 0,
                 LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, T, (size_t)NH + 2 * (size_t)NKV, hs), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(theta > 0.0f && isfinite(theta), LLMC_ERR_VALUE);   // NaN fails too
    if (pos != NULL) {
        for (int b = 0; b < B; b++) { LLMC_REQUIRE(pos[b] >= 0, LLMC_ERR_RANGE); }
    }
    if (inv_freq != NULL) {   // finite and positive (NaN fails too)
        for (int i = 0; i < hs / 2; i++) {
            LLMC_REQUIRE(inv_freq[i] > 0.0 && isfinite(inv_freq[i]), LLMC_ERR_VALUE);
        }
    }
    return LLMC_OK;
}

/* cos and sin of the angles of pairs [i0, i0 + n) at position p. */
static LLMC_ALWAYS_INLINE void rope_angles(float* c, float* s, int64_t p, int i0, int n, int hs,
                                           double theta, const double* inv_freq) {
    for (int j = 0; j < n; j++) {
        const double freq = inv_freq != NULL ? inv_freq[i0 + j]
                                             : pow(theta, -2.0 * (double)(i0 + j) / (double)hs);
        const double a = (double)p * freq;
        c[j] = (float)cos(a);
        s[j] = (float)sin(a);
    }
}

/*
 * Turns n pairs: pair j is (x[j step], x[j step + partner]), step 1 and
 * partner hs/2 half-split, step 2 and partner 1 interleaved; forward writes
 * the rotation by +a, backward adds the rotation by -a (written: adds it to
 * 0, llmc_grad_start).
 */
static LLMC_ALWAYS_INLINE void turn_pairs(float* y, const float* x, const float* c,
                                          const float* s, int n, int step, int partner,
                                          int backward, int written) {
    if (backward) {
        for (int j = 0; j < n; j++) {
            const float a1 = x[j * step], a2 = x[j * step + partner];
            y[j * step] = llmc_grad_start(y + j * step, written) + (a1 * c[j] + a2 * s[j]);
            y[j * step + partner] = llmc_grad_start(y + j * step + partner, written)
                                    + (a2 * c[j] - a1 * s[j]);
        }
    } else {
        for (int j = 0; j < n; j++) {
            const float a1 = x[j * step], a2 = x[j * step + partner];
            y[j * step] = a1 * c[j] - a2 * s[j];
            y[j * step + partner] = a2 * c[j] + a1 * s[j];
        }
    }
}

/*
 * One row at position p, the one loop behind every direction: the forward
 * rotates by +a and writes, the backward rotates by -a and accumulates (or
 * with written, writes the sum into zeros). The
 * row's NH rotated q heads go to yq, its NKV k heads to yk and its NKV v
 * heads (copied or accumulated unchanged) to yv: a packed row's three parts
 * (rope_apply), or KV-cache decoding's q and cache slots (kv_cache_write).
 * The angles' cos and sin are computed (rope_angles), or read from a row of
 * rope_table's when tab_cos, tab_sin are given: the same floats.
 */
static LLMC_ALWAYS_INLINE void rope_row_body(float* yq, float* yk, float* yv, const float* x,
                                             int64_t p, const float* tab_cos,
                                             const float* tab_sin, int NH, int NKV, int hs,
                                             float theta, const double* inv_freq,
                                             int interleaved, int backward, int written) {
    const int half = hs / 2;
    const int nrot = NH + NKV;                          // heads that turn
    float angle_cos[ROPE_CHUNK], angle_sin[ROPE_CHUNK];
    for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
        const int n = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
        const float* c = angle_cos;
        const float* s = angle_sin;
        if (tab_cos != NULL) {
            c = tab_cos + i0;
            s = tab_sin + i0;
        } else {
            rope_angles(angle_cos, angle_sin, p, i0, n, hs, (double)theta, inv_freq);
        }
        const size_t first = (size_t)(interleaved ? 2 * i0 : i0);
        for (int h = 0; h < nrot; h++) {
            float* y = (h < NH ? yq + (size_t)h * hs : yk + (size_t)(h - NH) * hs) + first;
            const float* x_h = x + (size_t)h * hs + first;
            if (interleaved) {   // constant strides in each branch: two specialised loops
                turn_pairs(y, x_h, c, s, n, 2, 1, backward, written);
            } else {
                turn_pairs(y, x_h, c, s, n, 1, half, backward, written);
            }
        }
    }
    const float* xv = x + (size_t)nrot * hs;
    const size_t nv = (size_t)NKV * hs;
    if (backward) {
        for (size_t i = 0; i < nv; i++) { yv[i] = llmc_grad_start(yv + i, written) + xv[i]; }
    } else {
        for (size_t i = 0; i < nv; i++) { yv[i] = xv[i]; }
    }
}
LLMC_ISA_VARIANTS(rope_row, (float* yq, float* yk, float* yv, const float* x, int64_t p,
                             const float* tab_cos, const float* tab_sin, int NH, int NKV, int hs,
                             float theta, const double* inv_freq, int interleaved, int backward,
                             int written),
                  yq, yk, yv, x, p, tab_cos, tab_sin, NH, NKV, hs, theta, inv_freq, interleaved,
                  backward, written)

typedef void (*rope_row_fn)(float*, float*, float*, const float*, int64_t, const float*,
                            const float*, int, int, int, float, const double*, int, int, int);

/* cos_table, sin_table [P, hs/2] = the angles' cos and sin at positions
   0 .. P-1: rope_angles one chunk at a time, as rope_row_body calls it (the
   same floats). */
static void fill_table(float* cos_table, float* sin_table, const double* inv_freq, int64_t P,
                       int hs, float theta) {
    const int half = hs / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            const int n = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            const size_t at = (size_t)p * half + (size_t)i0;
            rope_angles(cos_table + at, sin_table + at, p, i0, n, hs, (double)theta, inv_freq);
        }
    }
}

/* Both directions over all rows, in parallel. */
static void rope_apply(float* out, const float* inp, const int* pos, const double* inv_freq,
                       int B, int T, int NH, int NKV, int hs, float theta, int interleaved,
                       int backward, int written) {
    const size_t row = (size_t)(NH + 2 * NKV) * hs;     // floats per (b, t)
    const int64_t BT = (int64_t)B * T;
    const rope_row_fn row_fn = LLMC_ISA_SELECT(llmc_get_isa(), rope_row);
    const size_t k0 = (size_t)NH * hs, v0 = (size_t)(NH + NKV) * hs;   // in a packed row
    const size_t half = (size_t)hs / 2;
    // without pos, every row b turns its token t by the same angles: their
    // cos and sin once per t, not once per (b, t) (if the table cannot be
    // had, each row computes its own: the same floats either way)
    float* table = NULL;
    if (pos == NULL && B > 1) {
        table = malloc(2 * (size_t)T * half * sizeof(float));
        if (table != NULL) { fill_table(table, table + (size_t)T * half, inv_freq, T, hs, theta); }
    }

    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        const int64_t p = (pos != NULL ? (int64_t)pos[bt / T] : 0) + bt % T;
        const float* tab_cos = table != NULL ? table + (size_t)p * half : NULL;
        const float* tab_sin = table != NULL ? table + ((size_t)T + (size_t)p) * half : NULL;
        float* y = out + (size_t)bt * row;
        row_fn(y, y + k0, y + v0, inp + (size_t)bt * row, p, tab_cos, tab_sin, NH, NKV, hs,
               theta, inv_freq, interleaved, backward, written);
    }
    free(table);
}

int rope_forward(float* out, const float* inp, const int* pos, const double* inv_freq,
                 int B, int T, int NH, int NKV, int hs, float theta, int interleaved) {
    const int status = rope_check(out, inp, pos, inv_freq, B, T, NH, NKV, hs, theta);
    LLMC_REQUIRE(status == LLMC_OK, status);
    LLMC_REQUIRE(interleaved == 0 || interleaved == 1, LLMC_ERR_VALUE);
    rope_apply(out, inp, pos, inv_freq, B, T, NH, NKV, hs, theta, interleaved, 0, 0);
    return LLMC_OK;
}

int rope_backward(float* dinp, const float* dout, const int* pos, const double* inv_freq,
                  int B, int T, int NH, int NKV, int hs, float theta, int interleaved,
                  int written) {
    const int status = rope_check(dinp, dout, pos, inv_freq, B, T, NH, NKV, hs, theta);
    LLMC_REQUIRE(status == LLMC_OK, status);
    LLMC_REQUIRE(interleaved == 0 || interleaved == 1, LLMC_ERR_VALUE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    rope_apply(dinp, dout, pos, inv_freq, B, T, NH, NKV, hs, theta, interleaved, 1, written);
    return LLMC_OK;
}

int rope_table(float* cos_table, float* sin_table, const double* inv_freq, int P, int hs,
               float theta) {
    LLMC_REQUIRE(LLMC_NONNULL2(cos_table, sin_table), LLMC_ERR_NULL);
    LLMC_REQUIRE(P > 0 && hs > 0 && hs % 2 == 0 && llmc_count_fits(P, hs / 2, 1, 1),
                 LLMC_ERR_SHAPE);
    LLMC_REQUIRE(theta > 0.0f && isfinite(theta), LLMC_ERR_VALUE);
    if (inv_freq != NULL) {
        for (int i = 0; i < hs / 2; i++) {
            LLMC_REQUIRE(inv_freq[i] > 0.0 && isfinite(inv_freq[i]), LLMC_ERR_VALUE);
        }
    }
    fill_table(cos_table, sin_table, inv_freq, P, hs, theta);
    return LLMC_OK;
}

int kv_cache_write(float* q, float* k_cache, float* v_cache, const float* qkv, const int* pos,
                   const float* cos_table, const float* sin_table, int B, int NH, int NKV,
                   int hs, int slots, int P, int interleaved) {
    LLMC_REQUIRE(LLMC_NONNULL3(q, k_cache, v_cache) && LLMC_NONNULL2(qkv, pos), LLMC_ERR_NULL);
    const int rotate = cos_table != NULL;
    LLMC_REQUIRE(rotate == (sin_table != NULL), LLMC_ERR_NULL);
    LLMC_REQUIRE(B > 0 && NH > 0 && NKV > 0 && hs > 0 && slots > 0, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(B, 1, (size_t)NH + 2 * (size_t)NKV, hs)
                 && llmc_count_fits(B, slots, NKV, hs), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(!rotate || (P > 0 && hs % 2 == 0 && llmc_count_fits(P, hs / 2, 1, 1)),
                 LLMC_ERR_SHAPE);
    LLMC_REQUIRE(interleaved == 0 || interleaved == 1, LLMC_ERR_VALUE);
    for (int b = 0; b < B; b++) {
        LLMC_REQUIRE(pos[b] >= 0 && (!rotate || pos[b] < P), LLMC_ERR_RANGE);
    }
    const size_t q_row = (size_t)NH * hs, kv_row = (size_t)NKV * hs;
    const size_t row = q_row + 2 * kv_row;
    const rope_row_fn row_fn = LLMC_ISA_SELECT(llmc_get_isa(), rope_row);
    // a few floats per row: threads would cost more than they save
    for (int b = 0; b < B; b++) {
        const int p = pos[b];
        const float* x = qkv + (size_t)b * row;
        float* q_b = q + (size_t)b * q_row;
        const size_t at = ((size_t)b * slots + (size_t)(p % slots)) * kv_row;
        if (rotate) {
            const size_t t = (size_t)p * (size_t)(hs / 2);
            row_fn(q_b, k_cache + at, v_cache + at, x, p, cos_table + t, sin_table + t, NH,
                   NKV, hs, 1.0f, NULL, interleaved, 0, 0);
        } else {
            memcpy(q_b, x, q_row * sizeof(float));
            memcpy(k_cache + at, x + q_row, kv_row * sizeof(float));
            memcpy(v_cache + at, x + q_row + kv_row, kv_row * sizeof(float));
        }
    }
    return LLMC_OK;
}
