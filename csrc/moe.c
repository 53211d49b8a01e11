/*
 * Mixture of Experts (contracts in llmc_api.h): the router's softmax and
 * top-k with the auxiliary losses, the permutation that groups each
 * expert's tokens into contiguous rows, the grouped GEMM of the experts'
 * linear layers, and the weighted combine back into token order; each
 * forward beside its backward.
 *
 * Determinism. Rows of the router and of the gather and combine are
 * independent, one thread each; a token's k terms are summed in the order
 * j = 0 .. k-1. The permutation is a counting sort in token order (one
 * pass, no threads), so an expert's rows hold its tokens in ascending
 * order. The sums over tokens (the mean router probability) run in chunks
 * fixed by N alone (llmc_column_sums). The grouped GEMM sums every element
 * in the order of matmul.c's and matmul_bf16.c's layers: results never
 * depend on the thread count, and each expert's rows are bitwise those of
 * its own linear layer.
 */
#include <stdlib.h>
#include "llmc.h"
#include "common.h"
#include "isa.h"
#include "gemm.h"

/* Each of experts[0 .. n) is in [0, E). */
static int experts_in_range(const int* experts, int64_t n, int E) {
    return llmc_first_bad_index(experts, n, E) < 0;
}

/* offsets[0 .. E] runs from 0 to R without stepping back. */
static int offsets_ok(const int* offsets, int E, int64_t R) {
    if (offsets[0] != 0 || offsets[E] != R) { return 0; }
    for (int e = 0; e < E; e++) {
        if (offsets[e + 1] < offsets[e]) { return 0; }
    }
    return 1;
}

/* Each of x[0 .. n) is finite. */
static int all_finite(const double* x, int n) {
    for (int i = 0; i < n; i++) {
        if (!isfinite(x[i])) { return 0; }
    }
    return 1;
}

/* ---- routing ---------------------------------------------------------------- */

/* max and sum_e exp(x[e] - max) of a row (the sum in double, in order),
   with the exponentials stored in p[0 .. E) when p is not NULL. Forward and
   backward call it, so both see the same log-sum-exp. */
static LLMC_ALWAYS_INLINE void row_exp_sum(float* p, const float* x, int E, float* max_out,
                                           double* sum_out) {
    float maxval = x[0];
    for (int e = 1; e < E; e++) { maxval = x[e] > maxval ? x[e] : maxval; }
    double sum = 0.0;
    for (int e = 0; e < E; e += 16) {
        const int n = E - e < 16 ? E - e : 16;
        const vec16f ex = llmc_exp16(llmc_load16(x + e, n) - maxval);
        if (p != NULL) { llmc_store16(p + e, ex, n); }
        for (int l = 0; l < n; l++) { sum += ex[l]; }
    }
    *max_out = maxval;
    *sum_out = sum;
}

/* The top k of p[0 .. E), largest first, ties to the lower index: expert[j]
   and its probability top[j]. Each pick is the largest of the experts that
   come after the previous pick in that order (smaller, or equal at a higher
   index). A NaN comes after nothing: once only NaNs are left, the lowest
   index not yet taken, so every row still gets k distinct experts. */
static LLMC_ALWAYS_INLINE void row_top_k(int* expert, float* top, const float* p, int E, int k) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            const int after = j == 0 || p[e] < top[j - 1]
                              || (p[e] == top[j - 1] && e > expert[j - 1]);
            if (after && (best < 0 || p[e] > p[best])) { best = e; }
        }
        for (int e = 0; best < 0; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) { taken |= expert[i] == e; }
            best = taken ? -1 : e;
        }
        expert[j] = best;
        top[j] = p[best];
    }
}

/* The sum of a token's k top probabilities, in order j = 0 .. k-1. */
static LLMC_ALWAYS_INLINE float top_sum(const float* top, int k) {
    float s = 0.0f;
    for (int j = 0; j < k; j++) { s += top[j]; }
    return s;
}

/* One token of the forward: p = softmax(x), its top k, their weights, and
   the row's log-sum-exp. */
static LLMC_ALWAYS_INLINE void route_row_body(float* p, float* w, int* expert, float* lse,
                                              const float* x, int E, int k, int norm) {
    float maxval;
    double sum;
    row_exp_sum(p, x, E, &maxval, &sum);
    const float inv = (float)(1.0 / sum);
    for (int e = 0; e < E; e++) { p[e] *= inv; }
    row_top_k(expert, w, p, E, k);
    if (norm) {
        const float s = top_sum(w, k);
        for (int j = 0; j < k; j++) { w[j] /= s; }
    }
    *lse = (float)((double)maxval + log(sum));
}
LLMC_ISA_VARIANTS(route_row, (float* p, float* w, int* expert, float* lse, const float* x, int E,
                              int k, int norm),
                  p, w, expert, lse, x, E, k, norm)

/* Tokens routed to each expert: counts[e] over all N k assignments. */
static void count_assignments(int64_t* counts, const int* experts, int64_t n, int E) {
    memset(counts, 0, (size_t)E * sizeof *counts);
    for (int64_t i = 0; i < n; i++) { counts[experts[i]]++; }
}

int moe_route_forward(float* probs, float* weights, int* experts, float* aux, const float* logits,
                      int N, int E, int k, int norm_topk_prob) {
    LLMC_REQUIRE(LLMC_NONNULL4(probs, weights, experts, aux) && logits != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && E > 0 && k > 0 && k <= E, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(N, E, 1, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(norm_topk_prob == 0 || norm_topk_prob == 1, LLMC_ERR_VALUE);
    // per token its log-sum-exp; then each expert's summed probability
    float* lse = malloc((size_t)N * sizeof(float));
    float* prob_sums = calloc((size_t)E, sizeof(float));
    int64_t* counts = malloc((size_t)E * sizeof(int64_t));
    int status = lse != NULL && prob_sums != NULL && counts != NULL ? LLMC_OK : LLMC_ERR_NOMEM;
    if (status == LLMC_OK) {
        void (*const row)(float*, float*, int*, float*, const float*, int, int, int) =
            LLMC_ISA_SELECT(llmc_get_isa(), route_row);
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            row(probs + (size_t)n * E, weights + (size_t)n * k, experts + (size_t)n * k, lse + n,
                logits + (size_t)n * E, E, k, norm_topk_prob);
        }
        status = llmc_column_sums(NULL, prob_sums, probs, NULL, NULL, NULL, N, E);
    }
    if (status == LLMC_OK) {
        // load balancing: E sum_e f_e P_e, f_e = counts[e] / (N k), P_e = prob_sums[e] / N
        count_assignments(counts, experts, (int64_t)N * k, E);
        double balance = 0.0, z = 0.0;
        for (int e = 0; e < E; e++) { balance += (double)counts[e] * prob_sums[e]; }
        for (int64_t n = 0; n < N; n++) { z += (double)lse[n] * lse[n]; }
        aux[0] = (float)(balance * E / ((double)N * k * N));
        aux[1] = (float)(z / N);
    }
    free(lse);
    free(prob_sums);
    free(counts);
    return status;
}

/*
 * One token of the backward. g[e] = d loss / d p[e] starts from the load
 * balancing term (balance[e], the same for every token), gets the top-k
 * weights' gradient (through w_j = p_j / s when renormalised:
 * dp_j = (dw_j - sum_i dw_i w_i) / s), and goes through the softmax:
 * dx[e] += p[e] (g[e] - sum_i g[i] p[i]) + z_scale lse p[e] (written: onto 0).
 */
static LLMC_ALWAYS_INLINE void route_back_row_body(float* dx, float* g, const float* dw,
                                                   const float* p, const float* x,
                                                   const int* expert, const float* balance,
                                                   int E, int k, int norm, float z_scale,
                                                   int written) {
    memcpy(g, balance, (size_t)E * sizeof(float));
    if (dw != NULL) {
        float s = 1.0f, dot = 0.0f;
        if (norm) {
            s = 0.0f;
            for (int j = 0; j < k; j++) { s += p[expert[j]]; }
            for (int j = 0; j < k; j++) { dot += dw[j] * (p[expert[j]] / s); }
        }
        for (int j = 0; j < k; j++) { g[expert[j]] += norm ? (dw[j] - dot) / s : dw[j]; }
    }
    float gp = 0.0f;
    for (int e = 0; e < E; e++) { gp += g[e] * p[e]; }
    float zterm = 0.0f;
    if (z_scale != 0.0f) {
        float maxval;
        double sum;
        row_exp_sum(NULL, x, E, &maxval, &sum);
        zterm = z_scale * (float)((double)maxval + log(sum));
    }
    for (int e = 0; e < E; e++) {
        dx[e] = llmc_grad_start(dx + e, written) + (p[e] * (g[e] - gp) + zterm * p[e]);
    }
}
LLMC_ISA_VARIANTS(route_back_row, (float* dx, float* g, const float* dw, const float* p,
                                   const float* x, const int* expert, const float* balance,
                                   int E, int k, int norm, float z_scale, int written),
                  dx, g, dw, p, x, expert, balance, E, k, norm, z_scale, written)

int moe_route_backward(float* dlogits, const float* dweights, const float* probs,
                       const float* logits, const int* experts, const double* fractions, int N,
                       int E, int k, int norm_topk_prob, float aux_coef, float z_coef,
                       int written) {
    LLMC_REQUIRE(LLMC_NONNULL4(dlogits, probs, logits, experts), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && E > 0 && k > 0 && k <= E, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(N, E, 1, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE((norm_topk_prob == 0 || norm_topk_prob == 1) && isfinite(aux_coef)
                 && isfinite(z_coef) && (written == 0 || written == 1), LLMC_ERR_VALUE);
    LLMC_REQUIRE(experts_in_range(experts, (int64_t)N * k, E), LLMC_ERR_RANGE);
    LLMC_REQUIRE(fractions == NULL || all_finite(fractions, E), LLMC_ERR_VALUE);
    const int nthreads = omp_get_max_threads();
    // balance[e]: d(aux_coef * load balancing) / d p[n, e] = aux_coef E f_e / N; then
    // each thread's g
    float* scratch = malloc((size_t)(nthreads + 1) * E * sizeof(float));
    int64_t* counts = malloc((size_t)E * sizeof(int64_t));
    if (scratch == NULL || counts == NULL) {
        free(scratch);
        free(counts);
        return LLMC_ERR_NOMEM;
    }
    float* balance = scratch;
    count_assignments(counts, experts, (int64_t)N * k, E);
    for (int e = 0; e < E; e++) {
        balance[e] = fractions != NULL
                     ? (float)((double)aux_coef * E * fractions[e] / N)
                     : (float)((double)aux_coef * E * counts[e] / ((double)N * k * N));
    }
    // d(z_coef * mean lse^2) / d x[n, e] = z_coef (2 lse / N) p[n, e]
    const float z_scale = (float)(2.0 * z_coef / N);
    void (*const row)(float*, float*, const float*, const float*, const float*, const int*,
                      const float*, int, int, int, float, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), route_back_row);
    #pragma omp parallel
    {
        float* g = scratch + (size_t)(omp_get_thread_num() + 1) * E;
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            row(dlogits + (size_t)n * E, g, dweights != NULL ? dweights + (size_t)n * k : NULL,
                probs + (size_t)n * E, logits + (size_t)n * E, experts + (size_t)n * k, balance,
                E, k, norm_topk_prob, z_scale, written);
        }
    }
    free(scratch);
    free(counts);
    return LLMC_OK;
}

/* ---- the permutation: tokens grouped by expert -------------------------------- */

int moe_permute(int* offsets, int* positions, const int* experts, int N, int E, int k) {
    LLMC_REQUIRE(LLMC_NONNULL3(offsets, positions, experts), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && E > 0 && k > 0 && k <= E, LLMC_ERR_SHAPE);
    LLMC_REQUIRE(llmc_count_fits(N, k, 1, 1) && (int64_t)N * k <= INT32_MAX, LLMC_ERR_SHAPE);
    const int64_t R = (int64_t)N * k;
    LLMC_REQUIRE(experts_in_range(experts, R, E), LLMC_ERR_RANGE);
    int64_t* next = malloc((size_t)E * sizeof(int64_t));
    LLMC_REQUIRE(next != NULL, LLMC_ERR_NOMEM);
    // a counting sort in token order: counts, their prefix sums, then each
    // assignment takes its expert's next row
    count_assignments(next, experts, R, E);
    offsets[0] = 0;
    for (int e = 0; e < E; e++) {
        offsets[e + 1] = offsets[e] + (int)next[e];
        next[e] = offsets[e];
    }
    for (int64_t i = 0; i < R; i++) { positions[i] = (int)next[experts[i]]++; }
    free(next);
    return LLMC_OK;
}

/* Each of positions[0 .. n) is a row of the grouped buffer, in [0, n). */
static int positions_in_range(const int* positions, int64_t n) {
    return n <= INT32_MAX && llmc_first_bad_index(positions, n, (int)n) < 0;
}

/* One token of the gather: its row (bytes of them) copied to its k grouped rows. */
static LLMC_ALWAYS_INLINE void gather_row_body(char* grouped, const char* x, const int* pos,
                                               size_t bytes, int k) {
    for (int j = 0; j < k; j++) { memcpy(grouped + (size_t)pos[j] * bytes, x, bytes); }
}

int moe_gather_forward(void* grouped, const void* inp, const int* positions, int N, int C, int k,
                       int grouped_dtype, int inp_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL3(grouped, inp, positions), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && C > 0 && k > 0 && llmc_count_fits(N, k, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE((inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16)
                 && grouped_dtype == inp_dtype, LLMC_ERR_VALUE);
    LLMC_REQUIRE(positions_in_range(positions, (int64_t)N * k), LLMC_ERR_RANGE);
    const size_t bytes = (size_t)C * (inp_dtype == LLMC_DTYPE_BF16 ? 2 : 4);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        gather_row_body(grouped, (const char*)inp + (size_t)n * bytes, positions + (size_t)n * k,
                        bytes, k);
    }
    return LLMC_OK;
}

/* One token of the gather's backward: dx += its k grouped rows, in order j
   (written: onto 0, not dx). */
static LLMC_ALWAYS_INLINE void gather_back_row_body(float* dx, const float* dgrouped,
                                                    const int* pos, int C, int k, int written) {
    for (int i = 0; i < C; i += 16) {
        const int n = C - i < 16 ? C - i : 16;
        vec16f acc = written ? (vec16f){0} : llmc_load16(dx + i, n);
        for (int j = 0; j < k; j++) { acc += llmc_load16(dgrouped + (size_t)pos[j] * C + i, n); }
        llmc_store16(dx + i, acc, n);
    }
}
LLMC_ISA_VARIANTS(gather_back_row, (float* dx, const float* dgrouped, const int* pos, int C, int k,
                                    int written),
                  dx, dgrouped, pos, C, k, written)

int moe_gather_backward(float* dinp, const float* dgrouped, const int* positions, int N, int C,
                        int k, int written) {
    LLMC_REQUIRE(LLMC_NONNULL3(dinp, dgrouped, positions), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && C > 0 && k > 0 && llmc_count_fits(N, k, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(written == 0 || written == 1, LLMC_ERR_VALUE);
    LLMC_REQUIRE(positions_in_range(positions, (int64_t)N * k), LLMC_ERR_RANGE);
    void (*const row)(float*, const float*, const int*, int, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), gather_back_row);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        row(dinp + (size_t)n * C, dgrouped, positions + (size_t)n * k, C, k, written);
    }
    return LLMC_OK;
}

/* ---- the weighted combine ------------------------------------------------------ */

/* One token of the combine: y = sum_j w[j] eo[pos[j]], in order j. */
static LLMC_ALWAYS_INLINE void combine_row_body(float* y, const float* eo, const float* w,
                                                const int* pos, int C, int k) {
    for (int i = 0; i < C; i += 16) {
        const int n = C - i < 16 ? C - i : 16;
        vec16f acc = {0};
        for (int j = 0; j < k; j++) { acc += w[j] * llmc_load16(eo + (size_t)pos[j] * C + i, n); }
        llmc_store16(y + i, acc, n);
    }
}
LLMC_ISA_VARIANTS(combine_row, (float* y, const float* eo, const float* w, const int* pos, int C,
                                int k),
                  y, eo, w, pos, C, k)

int moe_combine_forward(float* out, const float* expert_out, const float* weights,
                        const int* positions, int N, int C, int k) {
    LLMC_REQUIRE(LLMC_NONNULL4(out, expert_out, weights, positions), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && C > 0 && k > 0 && llmc_count_fits(N, k, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(positions_in_range(positions, (int64_t)N * k), LLMC_ERR_RANGE);
    void (*const row)(float*, const float*, const float*, const int*, int, int) =
        LLMC_ISA_SELECT(llmc_get_isa(), combine_row);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        row(out + (size_t)n * C, expert_out, weights + (size_t)n * k, positions + (size_t)n * k,
            C, k);
    }
    return LLMC_OK;
}

/* One token of the combine's backward: its grouped rows get w[j] dy, its
   weights dot(dy, eo[pos[j]]). */
static LLMC_ALWAYS_INLINE void combine_back_row_body(float* deo, float* dw, const float* dy,
                                                     const float* eo, const float* w,
                                                     const int* pos, int C, int k) {
    for (int j = 0; j < k; j++) {
        const float* eo_j = eo + (size_t)pos[j] * C;
        float* deo_j = deo + (size_t)pos[j] * C;
        for (int i = 0; i < C; i += 16) {
            const int n = C - i < 16 ? C - i : 16;
            llmc_store16(deo_j + i, w[j] * llmc_load16(dy + i, n), n);
        }
        dw[j] = llmc_dot(dy, eo_j, C);
    }
}
LLMC_ISA_VARIANTS(combine_back_row, (float* deo, float* dw, const float* dy, const float* eo,
                                     const float* w, const int* pos, int C, int k),
                  deo, dw, dy, eo, w, pos, C, k)

int moe_combine_backward(float* dexpert_out, float* dweights, const float* dout,
                         const float* expert_out, const float* weights, const int* positions,
                         int N, int C, int k) {
    LLMC_REQUIRE(LLMC_NONNULL4(dexpert_out, dweights, dout, expert_out)
                 && LLMC_NONNULL2(weights, positions), LLMC_ERR_NULL);
    LLMC_REQUIRE(N > 0 && C > 0 && k > 0 && llmc_count_fits(N, k, C, 1), LLMC_ERR_SHAPE);
    LLMC_REQUIRE(positions_in_range(positions, (int64_t)N * k), LLMC_ERR_RANGE);
    void (*const row)(float*, float*, const float*, const float*, const float*, const int*, int,
                      int) = LLMC_ISA_SELECT(llmc_get_isa(), combine_back_row);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        row(dexpert_out, dweights + (size_t)n * k, dout + (size_t)n * C, expert_out,
            weights + (size_t)n * k, positions + (size_t)n * k, C, k);
    }
    return LLMC_OK;
}

/* ---- the grouped GEMM: each expert's linear layer over its rows ----------------- */

/* The grouped GEMM's arguments: sizes, and offsets that cover [0, R). */
static int grouped_status(const int* offsets, int R, int C, int OC, int E) {
    if (R <= 0 || C <= 0 || OC <= 0 || E <= 0) { return LLMC_ERR_SHAPE; }
    if (!llmc_count_fits(R, C, 1, 1) || !llmc_count_fits(R, OC, 1, 1)
        || !llmc_count_fits(E, OC, C, 1)) {
        return LLMC_ERR_SHAPE;
    }
    return offsets_ok(offsets, E, R) ? LLMC_OK : LLMC_ERR_RANGE;
}

/*
 * The float32 products of the experts with rows, as llmc_gemm_f32 jobs:
 *   forward  out_e  += inp_e . W_e^T     M = rows, N = OC, K = C
 *   dinp     dinp_e += dout_e . W_e      M = rows, N = C,  K = OC
 *   dweight  dW_e   += dout_e^T . inp_e  M = OC,   N = C,  K = rows
 * (x_e: the rows offsets[e] .. offsets[e+1] of x), but for the forward of
 * an expert with a few rows (few_rows_forward's). Returns the job count.
 */
enum { PRODUCT_FORWARD, PRODUCT_DINP, PRODUCT_DWEIGHT };

static int f32_jobs(struct llmc_gemm_f32_job* jobs, int product, float* c, const float* x,
                    const void* w, const int* offsets, int C, int OC, int E) {
    int count = 0;
    for (int e = 0; e < E; e++) {
        const int m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
        const float* w_e = (const float*)w + (size_t)e * OC * C;
        if (rows == 0 || (product == PRODUCT_FORWARD && rows <= LLMC_FEW_ROWS_F32)) { continue; }
        if (product == PRODUCT_FORWARD) {
            jobs[count++] = (struct llmc_gemm_f32_job){
                .c = c + (size_t)m0 * OC, .ldc = (size_t)OC, .a = x + (size_t)m0 * C,
                .ars = (size_t)C, .aks = 1, .b = w_e, .brs = 1, .bcs = (size_t)C,
                .M = rows, .N = OC, .K = C};
        } else if (product == PRODUCT_DINP) {   // x is dout, w the weight
            jobs[count++] = (struct llmc_gemm_f32_job){
                .c = c + (size_t)m0 * C, .ldc = (size_t)C, .a = x + (size_t)m0 * OC,
                .ars = (size_t)OC, .aks = 1, .b = w_e, .brs = (size_t)C, .bcs = 1,
                .M = rows, .N = C, .K = OC};
        } else {   // x is dout, w the forward's inp
            jobs[count++] = (struct llmc_gemm_f32_job){
                .c = c + (size_t)e * OC * C, .ldc = (size_t)C, .a = x + (size_t)m0 * OC,
                .ars = 1, .aks = (size_t)OC, .b = (const float*)w + (size_t)m0 * C,
                .brs = (size_t)C, .bcs = 1, .M = OC, .N = C, .K = rows};
        }
    }
    return count;
}

/* The forward of each expert with 1 .. LLMC_FEW_ROWS_F32 rows (decoding),
   out_e = inp_e . W_e^T by matmul_forward's few-row kernel: the weight read
   once, not packed, and the GEMM's bits. */
static int few_rows_forward(float* out, const float* inp, const float* weight,
                            const int* offsets, int C, int OC, int E) {
    struct llmc_few_rows_job* jobs = malloc((size_t)E * sizeof *jobs);
    LLMC_REQUIRE(jobs != NULL, LLMC_ERR_NOMEM);
    int count = 0;
    for (int e = 0; e < E; e++) {
        const int m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
        if (rows == 0 || rows > LLMC_FEW_ROWS_F32) { continue; }
        jobs[count++] = (struct llmc_few_rows_job){
            .out = out + (size_t)m0 * OC, .inp = inp + (size_t)m0 * C,
            .weight = weight + (size_t)e * OC * C, .bias = NULL, .M = rows};
    }
    llmc_forward_few_rows_many(jobs, count, C, OC);
    free(jobs);
    return LLMC_OK;
}

/* few_rows_forward with bf16 weights, where matmul_forward_bf16 has its
   few-row kernel (avx512bf16): each expert with 1 .. LLMC_FEW_ROWS_BF16 rows. */
static int bf16_few_rows_forward(float* out, const void* inp, int inp_bf16,
                                 const uint16_t* weight, const int* offsets, int C, int OC,
                                 int E) {
    if (!llmc_bf16_few_rows_supported()) { return LLMC_OK; }
    struct llmc_bf16_few_rows_job* jobs = malloc((size_t)E * sizeof *jobs);
    LLMC_REQUIRE(jobs != NULL, LLMC_ERR_NOMEM);
    int count = 0;
    for (int e = 0; e < E; e++) {
        const int m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
        if (rows == 0 || rows > LLMC_FEW_ROWS_BF16) { continue; }
        jobs[count++] = (struct llmc_bf16_few_rows_job){
            .out = out + (size_t)m0 * OC,
            .inp = (const char*)inp + (size_t)m0 * C * (inp_bf16 ? 2 : 4), .inp_bf16 = inp_bf16,
            .weight = weight + (size_t)e * OC * C, .bias = NULL, .M = rows};
    }
    const int status = count > 0 ? llmc_bf16_forward_few_rows_many(jobs, count, C, OC) : LLMC_OK;
    free(jobs);
    return status;
}

/* f32_jobs' products with bf16 weights, as llmc_gemm_bf16_many jobs (the
   forward starts its rows from 0, dinp and dweight too if write_c), but for the
   forward of an expert with a few rows where bf16_few_rows_forward takes it;
   the forward's inp, dweight's w, bf16 if inp_bf16. */
static int bf16_jobs(struct bf16_gemm* jobs, int product, float* c, const void* x,
                     const void* w, int inp_bf16, int write_c, const int* offsets, int C,
                     int OC, int E) {
    const size_t inp_bytes = inp_bf16 ? 2 : 4;
    const int few_rows = llmc_bf16_few_rows_supported() ? LLMC_FEW_ROWS_BF16 : 0;
    int count = 0;
    for (int e = 0; e < E; e++) {
        const int m0 = offsets[e], rows = offsets[e + 1] - offsets[e];
        const uint16_t* w_e = (const uint16_t*)w + (size_t)e * OC * C;
        if (rows == 0 || (product == PRODUCT_FORWARD && rows <= few_rows)) { continue; }
        if (product == PRODUCT_FORWARD) {
            jobs[count++] = (struct bf16_gemm){
                .c = c + (size_t)m0 * OC, .ldc = (size_t)OC,
                .a = (const char*)x + (size_t)m0 * C * inp_bytes, .lda = (size_t)C,
                .a_kind = inp_bf16 ? BF16_A_ROWS_BF16 : BF16_A_ROWS, .b = w_e, .ldb = (size_t)C,
                .b_kind = BF16_B_COLS_W, .init_zero = 1, .M = rows, .N = OC, .K = C};
        } else if (product == PRODUCT_DINP) {
            jobs[count++] = (struct bf16_gemm){
                .c = c + (size_t)m0 * C, .ldc = (size_t)C, .a = (const float*)x + (size_t)m0 * OC,
                .lda = (size_t)OC, .a_kind = BF16_A_ROWS, .b = w_e, .ldb = (size_t)C,
                .b_kind = BF16_B_ROWS_W, .init_zero = write_c, .M = rows, .N = C, .K = OC};
        } else {   // w is the forward's inp
            jobs[count++] = (struct bf16_gemm){
                .c = c + (size_t)e * OC * C, .ldc = (size_t)C,
                .a = (const float*)x + (size_t)m0 * OC, .lda = (size_t)OC,
                .a_kind = BF16_A_COLS, .b = (const char*)w + (size_t)m0 * C * inp_bytes,
                .ldb = (size_t)C, .b_kind = inp_bf16 ? BF16_B_ROWS_W : BF16_B_ROWS_F32,
                .init_zero = write_c, .M = OC, .N = C, .K = rows};
        }
    }
    return count;
}

/* Zeroes dweight[e] [OC, C] of the experts with no rows, which no bf16 job
   writes. */
static void zero_experts_without_rows(float* dweight, const int* offsets, int C, int OC, int E) {
    for (int e = 0; e < E; e++) {
        if (offsets[e + 1] == offsets[e]) {
            memset(dweight + (size_t)e * OC * C, 0, (size_t)OC * C * sizeof(float));
        }
    }
}

/*
 * The grouped products of the experts with rows as one batch of jobs, with
 * float32 weights (f32_jobs) or bf16 ones (bf16_jobs): the forward into out,
 * or (out NULL) the backward's dinp and dweight, either of which may be NULL
 * (written as matmul_backward's `written` asks, else added into).
 */
static int grouped_products(int bf16, float* out, float* dinp, float* dweight, int written,
                            const void* inp, int inp_bf16, const float* dout, const void* weight,
                            const int* offsets, int R, int C, int OC, int E) {
    const int status = grouped_status(offsets, R, C, OC, E);
    LLMC_REQUIRE(status == LLMC_OK, status);
    if (!bf16) {   // the float32 products add: into zeros where written
        llmc_zero_written(dinp, dweight, written, R, C, E * OC);
    } else if (dweight != NULL && (written & LLMC_WRITE_DWEIGHT)) {
        zero_experts_without_rows(dweight, offsets, C, OC, E);
    }
    struct llmc_gemm_f32_job* f32 = bf16 ? NULL : malloc((size_t)2 * E * sizeof *f32);
    struct bf16_gemm* b16 = bf16 ? malloc((size_t)2 * E * sizeof *b16) : NULL;
    LLMC_REQUIRE(f32 != NULL || b16 != NULL, LLMC_ERR_NOMEM);
    int count = 0;
    if (out != NULL && !bf16) {
        // every row belongs to one expert: start them all from 0, the few-row experts' done
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            memset(out + (size_t)r * OC, 0, (size_t)OC * sizeof(float));
        }
        const int status = few_rows_forward(out, inp, weight, offsets, C, OC, E);
        if (status != LLMC_OK) {
            free(f32);
            return status;
        }
    }
    if (out != NULL && bf16) {
        const int status = bf16_few_rows_forward(out, inp, inp_bf16, weight, offsets, C, OC, E);
        if (status != LLMC_OK) {
            free(b16);
            return status;
        }
    }
    // the backward's dinp and dweight write apart: one batch of jobs for both
    const struct { int product; float* c; const void* x; const void* w; } parts[3] = {
        {PRODUCT_FORWARD, out, inp, weight}, {PRODUCT_DINP, dinp, dout, weight},
        {PRODUCT_DWEIGHT, dweight, dout, inp}};
    for (int i = 0; i < 3; i++) {
        if (parts[i].c == NULL) { continue; }
        const int write_c = (parts[i].product == PRODUCT_DINP && (written & LLMC_WRITE_DINP))
                            || (parts[i].product == PRODUCT_DWEIGHT
                                && (written & LLMC_WRITE_DWEIGHT));
        count += bf16 ? bf16_jobs(b16 + count, parts[i].product, parts[i].c, parts[i].x,
                                  parts[i].w, inp_bf16, write_c, offsets, C, OC, E)
                      : f32_jobs(f32 + count, parts[i].product, parts[i].c, parts[i].x,
                                 parts[i].w, offsets, C, OC, E);
    }
    const int result = bf16 ? llmc_gemm_bf16_many(b16, count) : llmc_gemm_f32_many(f32, count);
    free(f32);
    free(b16);
    return result;
}

int moe_grouped_forward(float* out, const float* inp, const float* weight, const int* offsets,
                        int R, int C, int OC, int E) {
    LLMC_REQUIRE(LLMC_NONNULL4(out, inp, weight, offsets), LLMC_ERR_NULL);
    return grouped_products(0, out, NULL, NULL, 0, inp, 0, NULL, weight, offsets, R, C, OC, E);
}

int moe_grouped_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                         const float* weight, const int* offsets, int R, int C, int OC, int E,
                         int written) {
    LLMC_REQUIRE(dout != NULL && offsets != NULL && (dinp == NULL || weight != NULL)
                 && (dweight == NULL || inp != NULL), LLMC_ERR_NULL);
    LLMC_REQUIRE(llmc_written_ok(written), LLMC_ERR_VALUE);
    return grouped_products(0, NULL, dinp, dweight, written, inp, 0, dout, weight, offsets,
                            R, C, OC, E);
}

int moe_grouped_forward_bf16(float* out, const void* inp, const uint16_t* weight,
                             const int* offsets, int R, int C, int OC, int E, int inp_dtype) {
    LLMC_REQUIRE(LLMC_NONNULL3(out, inp, offsets) && weight != NULL, LLMC_ERR_NULL);
    LLMC_REQUIRE(inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    return grouped_products(1, out, NULL, NULL, 0, inp, inp_dtype == LLMC_DTYPE_BF16, NULL,
                            weight, offsets, R, C, OC, E);
}

int moe_grouped_backward_bf16(float* dinp, float* dweight, const float* dout, const void* inp,
                              const uint16_t* weight, const int* offsets, int R, int C, int OC,
                              int E, int inp_dtype, int written) {
    LLMC_REQUIRE(dout != NULL && offsets != NULL && (dinp == NULL || weight != NULL)
                 && (dweight == NULL || inp != NULL), LLMC_ERR_NULL);
    LLMC_REQUIRE(inp_dtype == LLMC_DTYPE_F32 || inp_dtype == LLMC_DTYPE_BF16, LLMC_ERR_VALUE);
    LLMC_REQUIRE(llmc_written_ok(written), LLMC_ERR_VALUE);
    return grouped_products(1, NULL, dinp, dweight, written, inp,
                            inp_dtype == LLMC_DTYPE_BF16, dout, weight, offsets, R, C, OC, E);
}
