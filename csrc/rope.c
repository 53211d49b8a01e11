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
 * on the stack, so no scratch allocation is needed whatever hs is. A row is
 * one call of its per-ISA function (isa.h).
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
 * the rotation by +a, backward adds the rotation by -a.
 */
static LLMC_ALWAYS_INLINE void turn_pairs(float* y, const float* x, const float* c,
                                          const float* s, int n, int step, int partner,
                                          int backward) {
    if (backward) {
        for (int j = 0; j < n; j++) {
            const float a1 = x[j * step], a2 = x[j * step + partner];
            y[j * step] += a1 * c[j] + a2 * s[j];
            y[j * step + partner] += a2 * c[j] - a1 * s[j];
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
 * One (b, t) row at position p, the one loop behind both directions: the
 * forward rotates by +a and writes, the backward rotates by -a and
 * accumulates. The v heads are copied or accumulated unchanged.
 */
static LLMC_ALWAYS_INLINE void rope_row_body(float* y_bt, const float* x_bt, int64_t p, int NH,
                                             int NKV, int hs, float theta,
                                             const double* inv_freq, int interleaved,
                                             int backward) {
    const int half = hs / 2;
    const int nrot = NH + NKV;                          // heads that turn
    float c[ROPE_CHUNK], s[ROPE_CHUNK];
    for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
        const int n = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
        rope_angles(c, s, p, i0, n, hs, (double)theta, inv_freq);
        for (int h = 0; h < nrot; h++) {
            const size_t at = (size_t)h * hs + (size_t)(interleaved ? 2 * i0 : i0);
            if (interleaved) {   // constant strides in each branch: two specialised loops
                turn_pairs(y_bt + at, x_bt + at, c, s, n, 2, 1, backward);
            } else {
                turn_pairs(y_bt + at, x_bt + at, c, s, n, 1, half, backward);
            }
        }
    }
    const size_t v0 = (size_t)nrot * hs;
    const size_t nv = (size_t)NKV * hs;
    if (backward) {
        for (size_t i = 0; i < nv; i++) { y_bt[v0 + i] += x_bt[v0 + i]; }
    } else {
        for (size_t i = 0; i < nv; i++) { y_bt[v0 + i] = x_bt[v0 + i]; }
    }
}
LLMC_ISA_VARIANTS(rope_row, (float* y_bt, const float* x_bt, int64_t p, int NH, int NKV, int hs,
                             float theta, const double* inv_freq, int interleaved, int backward),
                  y_bt, x_bt, p, NH, NKV, hs, theta, inv_freq, interleaved, backward)

/* Both directions over all rows, in parallel. */
static void rope_apply(float* out, const float* inp, const int* pos, const double* inv_freq,
                       int B, int T, int NH, int NKV, int hs, float theta, int interleaved,
                       int backward) {
    const size_t row = (size_t)(NH + 2 * NKV) * hs;     // floats per (b, t)
    const int64_t BT = (int64_t)B * T;
    void (*const row_fn)(float*, const float*, int64_t, int, int, int, float, const double*,
                         int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), rope_row);

    #pragma omp parallel for schedule(static)
    for (int64_t bt = 0; bt < BT; bt++) {
        const int64_t p = (pos != NULL ? (int64_t)pos[bt / T] : 0) + bt % T;
        row_fn(out + (size_t)bt * row, inp + (size_t)bt * row, p, NH, NKV, hs, theta, inv_freq,
               interleaved, backward);
    }
}

int rope_forward(float* out, const float* inp, const int* pos, const double* inv_freq,
                 int B, int T, int NH, int NKV, int hs, float theta, int interleaved) {
    const int status = rope_check(out, inp, pos, inv_freq, B, T, NH, NKV, hs, theta);
    LLMC_REQUIRE(status == LLMC_OK, status);
    LLMC_REQUIRE(interleaved == 0 || interleaved == 1, LLMC_ERR_VALUE);
    rope_apply(out, inp, pos, inv_freq, B, T, NH, NKV, hs, theta, interleaved, 0);
    return LLMC_OK;
}

int rope_backward(float* dinp, const float* dout, const int* pos, const double* inv_freq,
                  int B, int T, int NH, int NKV, int hs, float theta, int interleaved) {
    const int status = rope_check(dinp, dout, pos, inv_freq, B, T, NH, NKV, hs, theta);
    LLMC_REQUIRE(status == LLMC_OK, status);
    LLMC_REQUIRE(interleaved == 0 || interleaved == 1, LLMC_ERR_VALUE);
    rope_apply(dinp, dout, pos, inv_freq, B, T, NH, NKV, hs, theta, interleaved, 1);
    return LLMC_OK;
}
