/*
 * What the attention files share (private): a sliding window's keys, the
 * size checks of a grouped-query call, and the tiled kernels' one call
 * record and per-head driver (llmc_attention_heads, in attention.c), which
 * the forward, backward, probabilities and entropy all run on.
 */
#ifndef LLMC_ATTENTION_H
#define LLMC_ATTENTION_H

#include "llmc.h"
#include "common.h"
#include "dropout.h"

/* The first key of query row t: t - window + 1 in a sliding window of
   window keys (window > 0), else 0. */
static inline int first_key(int t, int window) {
    return window > 0 && t >= window ? t - window + 1 : 0;
}

/* The windows of rows t0 .. t0+R-1: row t0 + r's first key lo[r] and its
   number of keys n[r]. */
static inline void row_windows(int* lo, int* n, int t0, int R, int window) {
    for (int r = 0; r < R; r++) {
        lo[r] = first_key(t0 + r, window);
        n[r] = t0 + r + 1 - lo[r];
    }
}

/* The first key of the panel block (16 keys) that holds row t's first key. */
static inline int first_block_key(int t, int window) { return first_key(t, window) / 16 * 16; }

/* Zeroes x[k0 .. k1): the probabilities (and their gradients) of keys
   outside a row's window that a tile's shared loops still read. */
static inline void zero_keys(float* x, int k0, int k1) {
    for (int t2 = k0; t2 < k1; t2++) { x[t2] = 0.0f; }
}

/* The sizes of a GQA call are positive (the window >= 0), NH % NKV == 0,
   and its arrays (inp, and stats [B, NH, T, 2]) can exist. */
static inline int gqa_sizes_ok(int B, int T, int NH, int NKV, int hs, int window) {
    return B > 0 && T > 0 && NH > 0 && NKV > 0 && hs > 0 && NH % NKV == 0 && window >= 0
           && llmc_count_fits(B, T, (size_t)NH + 2 * (size_t)NKV, hs)
           && llmc_count_fits(B, NH, T, 2);
}

/* As gqa_sizes_ok, for a call with a full att [B, NH, T, T]. */
static inline int gqa_att_sizes_ok(int B, int T, int NH, int NKV, int hs, int window) {
    return gqa_sizes_ok(B, T, NH, NKV, hs, window) && llmc_count_fits(B, NH, T, T);
}

/* One call of a tiled kernel, sizes already checked: its arrays (as in
   llmc_api.h; a kernel leaves the ones it does not take NULL), its sizes,
   and what follows from them. */
typedef struct {
    float* out;            /* what the call writes: out, att or entropy; or
                              the backward's dinp, which it adds to
                              (or writes: written) */
    float* stats_out;      /* the forward's statistics (written) */
    const float* stats;    /* the statistics the others read */
    const float* inp;
    const float* dout;
    const float* slopes;   /* or NULL: no bias */
    int B, T, NH, NKV, hs, window;
    llmc_dropout drop;     /* p = 0 unless the forward or backward drops */
    int written;           /* the backward writes dinp instead of adding to it */
    size_t C;              /* NH hs: a row of q heads, of out and of dout */
    size_t row;            /* (NH + 2 NKV) hs: a row of inp */
    int kv_mul;            /* query heads per kv head */
    float scale;           /* 1 / sqrt(hs), the scores' scale */
} attention_call;

/* A call over inp with no arrays to write yet. */
static inline attention_call attention_call_of(const float* inp, const float* slopes, int B,
                                               int T, int NH, int NKV, int hs, int window,
                                               llmc_dropout drop) {
    const attention_call a = {
        .inp = inp, .slopes = slopes, .B = B, .T = T, .NH = NH, .NKV = NKV, .hs = hs,
        .window = window, .drop = drop, .C = (size_t)NH * hs,
        .row = ((size_t)NH + 2 * (size_t)NKV) * hs, .kv_mul = NH / NKV,
        .scale = 1.0f / sqrtf((float)hs)};
    return a;
}

/* Batch row b's packed rows of inp (a->row floats apart), and the offsets
   in a row of query head h and of the k and v of kv head g. */
static inline const float* inp_of(const attention_call* a, int b) {
    return a->inp + (size_t)b * a->T * a->row;
}
static inline size_t q_offset(const attention_call* a, int h) { return (size_t)h * a->hs; }
static inline size_t k_offset(const attention_call* a, int g) {
    return a->C + (size_t)g * a->hs;
}
static inline size_t v_offset(const attention_call* a, int g) {
    return a->C + ((size_t)a->NKV + g) * a->hs;
}

/* Asks the cache for n rows (ld floats apart) of hs floats from x on. The
   kernels fetch the rows of their next (b, head) this way, a tile's worth
   at a time while they compute the current one: those rows (q, k, v, dout,
   the outputs) lie a whole row of inp apart, far more than any other
   (b, head)'s, so the hardware prefetchers do not bring them in early, and
   each tile would otherwise wait on its first touch of them. A prefetch
   changes no result. */
static inline void prefetch_rows(const float* x, size_t ld, int n, int hs) {
    for (int r = 0; r < n; r++) {
        const float* row = x + (size_t)r * ld;
        for (int c = 0; c < hs; c += 16) { __builtin_prefetch(row + c, 0, 2); }
        __builtin_prefetch(row + hs - 1, 0, 2);   // a row that ends in another line
    }
}

/* Whether the thread that runs query head h of batch row b in a forward ran
   head h - 1 of the same kv head just before it (llmc_attention_heads gives
   each thread llmc_thread_share's contiguous share of the (b, h) in order):
   its scratch then still holds that kv head's panels, which this head would
   build again bit for bit. Inside the driver's parallel region only. */
static inline int follows_its_kv_head(const attention_call* a, int b, int h) {
    int64_t lo, hi;
    llmc_thread_share((int64_t)a->B * a->NH, &lo, &hi);
    return h % a->kv_mul != 0 && (int64_t)b * a->NH + h > lo;
}

/* The forward's rows t0 .. t0+n-1 of (b, h) = (nb, nh) when nb >= 0: q,
   k and v (unless those are cur_g's of cur_b, already in the cache) and
   out. */
static inline void prefetch_forward(const attention_call* a, int cur_b, int cur_g, int nb,
                                    int nh, int t0, int n) {
    if (nb < 0) { return; }
    const int g = nh / a->kv_mul, hs = a->hs;
    const float* rows = a->inp + ((size_t)nb * a->T + t0) * a->row;
    prefetch_rows(rows + q_offset(a, nh), a->row, n, hs);
    if (nb != cur_b || g != cur_g) {
        prefetch_rows(rows + k_offset(a, g), a->row, n, hs);
        prefetch_rows(rows + v_offset(a, g), a->row, n, hs);
    }
    prefetch_rows(a->out + ((size_t)nb * a->T + t0) * a->C + (size_t)nh * hs, a->C, n, hs);
}

/* The backward's rows t0 .. t0+n-1 of kv head ng of batch row nb (when
   nb >= 0): of its query head j (0 .. kv_mul-1) q, dout and dq, and with
   j = 0, k and v and their dk, dv. */
static inline void prefetch_backward(const attention_call* a, int nb, int ng, int j, int t0,
                                     int n) {
    if (nb < 0) { return; }
    const int h = ng * a->kv_mul + j, hs = a->hs;
    const size_t first = (size_t)nb * a->T + t0;
    const float* rows = a->inp + first * a->row;
    const float* drows = a->out + first * a->row;
    prefetch_rows(rows + q_offset(a, h), a->row, n, hs);
    prefetch_rows(a->dout + first * a->C + (size_t)h * hs, a->C, n, hs);
#ifndef NO_DQ
    prefetch_rows(drows + q_offset(a, h), a->row, n, hs);
#endif
    if (j == 0) {
        prefetch_rows(rows + k_offset(a, ng), a->row, n, hs);
        prefetch_rows(rows + v_offset(a, ng), a->row, n, hs);
#ifndef NO_DKV
        prefetch_rows(drows + k_offset(a, ng), a->row, n, hs);
        prefetch_rows(drows + v_offset(a, ng), a->row, n, hs);
#endif
    }
}

/* Query head h's ALiBi slope (0 without slopes). */
static inline float slope_of(const attention_call* a, int h) {
    return a->slopes != NULL ? a->slopes[h] : 0.0f;
}

/* Query head h of batch row b in a backward call: its saved statistics
   [T, 2], its q and dout (rows a->row and a->C floats apart), its dq in
   dinp, its slope, and the dropout of its rows (from h T on). */
typedef struct {
    const float* stats;
    const float* q;
    const float* dout;
    float* dq;
    float slope;
    llmc_dropout drop;
} backward_head;

static inline backward_head backward_head_of(const attention_call* a, int b, int h) {
    const size_t T = (size_t)a->T;
    llmc_dropout drop = llmc_dropout_at(a->drop, b, 0);
    drop.first_row = (int64_t)h * a->T;
    const backward_head head = {
        .stats = a->stats + ((size_t)b * a->NH + h) * T * 2,
        .q = inp_of(a, b) + q_offset(a, h),
        .dout = a->dout + (size_t)b * T * a->C + (size_t)h * a->hs,
        .dq = a->out + (size_t)b * T * a->row + q_offset(a, h),
        .slope = slope_of(a, h),
        .drop = drop};
    return head;
}

/* What runs for one (b, head): a variant chosen by LLMC_ISA_SELECT. nb, nh:
   the (b, head) the same thread runs next (nb = -1: none), whose rows it
   may prefetch while it computes this one. */
typedef void (*attention_head_fn)(const attention_call* a, int b, int h, int nb, int nh,
                                  float* scratch);

/* The per-head driver of the tiled kernels: head(a, b, h, nb, nh, scratch)
   for every batch row b and head h < heads (query heads; for the backward,
   kv heads, each with its group of query heads), in parallel over (b, h),
   each thread a contiguous share of them in order, with its own per_thread
   floats of scratch, one allocation per call. LLMC_ERR_NOMEM if that fails,
   else LLMC_OK. */
int llmc_attention_heads(const attention_call* a, int heads, size_t per_thread,
                         attention_head_fn head);

#endif
