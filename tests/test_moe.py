"""csrc/moe.c: the router (softmax, top k, auxiliary losses), the permutation
into expert-grouped rows, the gather and the weighted combine, and the
grouped GEMM in float32 and bf16, against float64 PyTorch references and,
for the grouped GEMM, bitwise against each expert's own linear layer."""
import numpy as np
import pytest
import torch

import llmc_py
from llmc_py import kernels as K
from helpers import TOL, assert_close, assert_thread_invariant, np64, randn, t64
from reference import moe_combine, moe_grouped, moe_positions, moe_route

# E, k: one expert, odd and even counts, top-1, top-2 and every expert
ROUTES = [(E, k) for E in (1, 3, 8) for k in (1, 2, E) if k <= E]
ROUTES = sorted(set(ROUTES))
C_ODD = 37          # not a multiple of the 16-lane vectors
ALL_ISAS = llmc_py.supported_isas()


def router_logits(rng, N, E):
    """Logits on a grid of 1/8 (distinct values differ far beyond float32's
    rounding, so float64 and float32 pick the same experts), with exact ties:
    row 0 all equal, row 1 two pairs."""
    logits = (rng.integers(-16, 17, size=(N, E)) / 8.0).astype(np.float32)
    logits[0] = 0.5
    if E >= 4:
        logits[1] = -2.0
        logits[1, :4] = [1.0, 2.0, 2.0, 1.0]
    return logits


def route(logits, k, norm=True):
    N, E = logits.shape
    probs = np.full((N, E), np.nan, np.float32)
    weights = np.full((N, k), np.nan, np.float32)
    experts = np.full((N, k), -1, np.int32)
    aux = np.full(2, np.nan, np.float32)
    K.moe_route_forward(probs, weights, experts, aux, logits, norm_topk_prob=norm)
    return probs, weights, experts, aux


def permute(experts, E):
    offsets = np.full(E + 1, -1, np.int32)
    positions = np.full(experts.shape, -1, np.int32)
    K.moe_permute(offsets, positions, experts, E)
    return offsets, positions


# ---- routing ------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("E,k", ROUTES)
def test_route_matches_reference(rng, isa, E, k, norm):
    N = 53
    logits = router_logits(rng, N, E)
    dweights = randn(rng, N, k)
    aux_coef, z_coef = 0.3, 0.05
    probs, weights, experts, aux = route(logits, k, norm)
    dlogits = np.full((N, E), 0.25, np.float32)   # (+=): the start is kept
    K.moe_route_backward(dlogits, dweights, probs, logits, experts, norm_topk_prob=norm,
                         aux_coef=aux_coef, z_coef=z_coef)

    x = t64(logits, grad=True)
    rprobs, rexperts, rweights, balance, z = moe_route(x, k, norm)
    loss = (rweights * t64(dweights)).sum() + aux_coef * balance + z_coef * z
    loss.backward()
    assert np.array_equal(experts, rexperts.numpy())
    assert_close("probs", probs, rprobs, TOL["moe"]["fwd"])
    assert_close("weights", weights, rweights, TOL["moe"]["fwd"])
    assert_close("balance", aux[0], balance, TOL["moe"]["fwd"])
    assert_close("z", aux[1], z, TOL["moe"]["fwd"])
    assert_close("dlogits", dlogits, 0.25 + x.grad, TOL["moe"]["bwd"])


def test_route_ties_go_to_the_lower_index(rng):
    logits = router_logits(rng, 6, 8)
    _, weights, experts, _ = route(logits, 3)
    assert experts[0].tolist() == [0, 1, 2]        # all equal
    assert experts[1].tolist() == [1, 2, 0]        # 2.0 at 1 and 2, then 1.0 at 0 and 3
    assert np.all(weights[0] == weights[0, 0])     # equal logits, equal weights, bitwise
    probs, _, experts, _ = route(logits, 8)
    order = np.argsort(-probs, axis=1, kind="stable")   # our own probabilities, ties stable
    assert np.array_equal(experts, order)


def test_route_without_weight_gradient_is_the_aux_losses_alone(rng):
    logits = router_logits(rng, 40, 8)
    probs, _, experts, _ = route(logits, 2)
    dlogits = np.zeros_like(logits)
    K.moe_route_backward(dlogits, None, probs, logits, experts, aux_coef=0.5, z_coef=0.1)
    x = t64(logits, grad=True)
    _, _, _, balance, z = moe_route(x, 2)
    (0.5 * balance + 0.1 * z).backward()
    assert_close("dlogits", dlogits, x.grad, TOL["moe"]["bwd"])


@pytest.mark.parametrize("E,k", [(3, 1), (8, 2)])
def test_route_backward_of_a_rank_with_the_whole_batchs_fractions(rng, isa, E, k):
    """Rows cut in two "ranks": each rank's gradient with the whole batch's
    fractions f_e (and its own N), averaged over the ranks as data-parallel
    training does, is the gradient of the whole batch's balance loss."""
    N = 48
    logits = router_logits(rng, N, E)
    probs, _, experts, _ = route(logits, k)
    fractions = np.bincount(experts.ravel(), minlength=E) / (N * k)
    dlogits = np.zeros_like(logits)
    for rows in (slice(0, N // 2), slice(N // 2, N)):
        part = np.zeros_like(logits[rows])
        K.moe_route_backward(part, None, probs[rows], logits[rows], experts[rows], fractions,
                             aux_coef=0.5, z_coef=0.1)
        dlogits[rows] = part / 2
    x = t64(logits, grad=True)
    _, _, _, balance, z = moe_route(x, k)
    (0.5 * balance + 0.1 * z).backward()
    assert_close("dlogits", dlogits, x.grad, TOL["moe"]["bwd"])


def test_route_backward_rejects_fractions_that_are_not_finite(rng):
    logits = randn(rng, 5, 3)
    probs, weights, experts, _ = route(logits, 2)
    with pytest.raises(llmc_py.InvalidValueError, match="moe_route_backward"):
        K.moe_route_backward(np.zeros_like(logits), weights, probs, logits, experts,
                             np.array([0.5, np.nan, 0.5]), aux_coef=0.1)


@pytest.mark.parametrize("k", [1, 2])
def test_balance_is_transformers_loss_over_k(rng, k):
    """transformers counts f_e per token, (assignments to e) / N: k times ours."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = randn(rng, 64, 8)   # continuous: no ties, which torch.topk may order otherwise
    _, _, _, aux = route(logits, k)
    theirs = mixtral.load_balancing_loss_func((torch.from_numpy(logits),), 8, k)
    assert abs(k * aux[0] - float(theirs)) <= 1e-5 * float(theirs)


def test_balanced_routing_has_balance_one():
    E, k = 4, 2
    logits = np.zeros((8, E), np.float32)   # uniform probs; ties pick experts 0, 1
    logits[4:] = [[0, 0, 1, 1]] * 4        # the other half picks experts 2, 3
    logits[4:] *= 1e-6
    _, _, experts, aux = route(logits, k)
    assert sorted(np.bincount(experts.ravel(), minlength=E)) == [4, 4, 4, 4]
    assert abs(aux[0] - 1.0) < 1e-5


# ---- the permutation, gather and combine --------------------------------------------

def expert_choices(rng, N, E, k, case):
    """experts [N,k], distinct per token: random, or with expert E-1 never chosen
    ("empty"), or expert 0 chosen by every token ("all")."""
    pool = E - 1 if case == "empty" and k < E else E
    experts = np.stack([rng.permutation(pool)[:k] for _ in range(N)]).astype(np.int32)
    if case == "all":
        experts[:, 0] = 0
        for n in range(N):
            rest = [e for e in rng.permutation(E) if e != 0][:k - 1]
            experts[n, 1:] = rest
    return experts


@pytest.mark.parametrize("case", ["random", "empty", "all"])
@pytest.mark.parametrize("E,k", ROUTES)
def test_permute_matches_reference(rng, E, k, case):
    N = 29
    experts = expert_choices(rng, N, E, k, case)
    offsets, positions = permute(experts, E)
    roffsets, rpositions = moe_positions(torch.from_numpy(experts).long(), E)
    assert offsets.tolist() == roffsets.tolist()
    assert np.array_equal(positions, rpositions.numpy())
    counts = np.diff(offsets)
    if case == "empty" and k < E:
        assert counts[E - 1] == 0
    if case == "all":
        assert counts[0] == N


@pytest.mark.parametrize("E,k", ROUTES)
def test_gather_and_combine_match_reference(rng, isa, E, k):
    N, C = 31, C_ODD
    experts = expert_choices(rng, N, E, k, "random")
    offsets, positions = permute(experts, E)
    x, w, eo = randn(rng, N, C), randn(rng, N, k), randn(rng, N * k, C)
    dgrouped, dy = randn(rng, N * k, C), randn(rng, N, C)

    grouped = np.full((N * k, C), np.nan, np.float32)
    K.moe_gather_forward(grouped, x, positions)
    dx = np.ones((N, C), np.float32)   # (+=)
    K.moe_gather_backward(dx, dgrouped, positions)
    y = np.full((N, C), np.nan, np.float32)
    K.moe_combine_forward(y, eo, w, positions)
    deo = np.full((N * k, C), np.nan, np.float32)
    dw = np.full((N, k), np.nan, np.float32)
    K.moe_combine_backward(deo, dw, dy, eo, w, positions)

    pos = torch.from_numpy(positions).long()
    xt, wt, eot = t64(x, grad=True), t64(w, grad=True), t64(eo, grad=True)
    rgrouped = torch.zeros(N * k, C, dtype=torch.float64).index_copy(
        0, pos.reshape(-1), xt.repeat_interleave(k, 0))
    (rgrouped * t64(dgrouped)).sum().backward()
    ry = moe_combine(eot, wt, pos)
    (ry * t64(dy)).sum().backward()
    assert np.array_equal(grouped, np64(rgrouped).astype(np.float32))   # copies, exact
    assert_close("dinp", dx, 1.0 + xt.grad, TOL["moe"]["bwd"])
    assert_close("out", y, ry, TOL["moe"]["fwd"])
    assert_close("dexpert_out", deo, eot.grad, TOL["moe"]["bwd"])
    assert_close("dweights", dw, wt.grad, TOL["moe"]["bwd"])


# ---- the grouped GEMM ---------------------------------------------------------------

GROUPS = [  # R rows split over E experts (counts), C, OC
    ([29], C_ODD, 45),                 # one expert
    ([7, 0, 40], C_ODD, 19),           # an expert without rows
    ([0, 62, 0], 64, 33),              # one expert with every row
    ([3, 17, 1, 9, 30, 2, 5, 11], 100, 70),
    ([2, 3], 1, 1),                    # C = OC = 1
]


def grouped_operands(rng, counts, C, OC, bf16=False):
    E, R = len(counts), sum(counts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x, dout = randn(rng, R, C), randn(rng, R, OC)
    w = randn(rng, E, OC, C, scale=0.2)
    if bf16:
        w16 = np.empty(w.shape, np.uint16)
        K.float_to_bf16(w16, w)
        w = w16
    return offsets, x, dout, w


def grouped(offsets, x, dout, w, bf16=False):
    forward = K.moe_grouped_forward_bf16 if bf16 else K.moe_grouped_forward
    backward = K.moe_grouped_backward_bf16 if bf16 else K.moe_grouped_backward
    out = np.full((x.shape[0], w.shape[1]), np.nan, np.float32)
    forward(out, x, w, offsets)
    dinp = np.full_like(x, 0.5)                           # (+=)
    dweight = np.full(w.shape, -0.25, np.float32)         # (+=)
    backward(dinp, dweight, dout, x, w, offsets)
    return {"out": out, "dinp": dinp, "dweight": dweight}


def per_expert(offsets, x, dout, w, bf16=False):
    """The same products by each expert's own linear layer (matmul.c, matmul_bf16.c)."""
    forward = K.matmul_forward_bf16 if bf16 else K.matmul_forward
    backward = K.matmul_backward_bf16 if bf16 else K.matmul_backward
    out = np.zeros((x.shape[0], w.shape[1]), np.float32)
    dinp = np.full_like(x, 0.5)
    dweight = np.full(w.shape, -0.25, np.float32)
    for e in range(w.shape[0]):
        r0, r1 = offsets[e], offsets[e + 1]
        if r0 == r1:
            continue
        xe, de = x[None, r0:r1], dout[None, r0:r1]
        oe = np.empty(de.shape, np.float32)
        forward(oe, xe, w[e])
        out[r0:r1] = oe[0]
        di = dinp[None, r0:r1].copy()
        backward(di, dweight[e], None, de, xe, w[e])
        dinp[r0:r1] = di[0]
    return {"out": out, "dinp": dinp, "dweight": dweight}


@pytest.mark.parametrize("counts,C,OC", GROUPS)
def test_grouped_matches_reference(rng, isa, counts, C, OC):
    offsets, x, dout, w = grouped_operands(rng, counts, C, OC)
    ours = grouped(offsets, x, dout, w)
    xt, wt = t64(x, grad=True), t64(w, grad=True)
    ref = moe_grouped(xt, wt, offsets.tolist())
    (ref * t64(dout)).sum().backward()
    assert_close("out", ours["out"], ref, TOL["moe"]["fwd"])
    assert_close("dinp", ours["dinp"], 0.5 + xt.grad, TOL["moe"]["bwd"])
    assert_close("dweight", ours["dweight"], -0.25 + wt.grad, TOL["moe"]["bwd"])
    # and bitwise each expert's own linear layer
    for name, value in per_expert(offsets, x, dout, w).items():
        assert np.array_equal(ours[name], value), name


@pytest.mark.parametrize("isa_name", ALL_ISAS)
@pytest.mark.parametrize("counts,C,OC", GROUPS)
def test_grouped_bf16_matches_reference(rng, use_isa, isa_name, counts, C, OC):
    use_isa(isa_name)
    offsets, x, dout, w16 = grouped_operands(rng, counts, C, OC, bf16=True)
    ours = grouped(offsets, x, dout, w16, bf16=True)
    # float64 of the bf16-rounded operands: the products are exact, only the
    # float32 sums round
    rounded = lambda a: torch.from_numpy(a).to(torch.bfloat16).to(torch.float64)
    wt = ((torch.from_numpy(w16.astype(np.int32)) << 16).view(torch.float32)).to(torch.float64)
    xr, dr = rounded(x), rounded(dout)
    ref = moe_grouped(xr, wt, offsets.tolist())
    refs = {"out": ref, "dinp": 0.5 + moe_grouped(dr, wt.transpose(1, 2), offsets.tolist()),
            "dweight": -0.25 + torch.stack([dr[offsets[e]:offsets[e + 1]].T
                                            @ xr[offsets[e]:offsets[e + 1]]
                                            for e in range(len(counts))])}
    for name, value in refs.items():
        assert_close(name, ours[name], value, TOL["moe"]["fwd" if name == "out" else "bwd"])
    for name, value in per_expert(offsets, x, dout, w16, bf16=True).items():
        assert np.array_equal(ours[name], value), name


def written_is_the_sum_into_zeros(offsets, x, dout, w, bf16):
    backward = K.moe_grouped_backward_bf16 if bf16 else K.moe_grouped_backward
    for flags in (K.WRITE_DINP, K.WRITE_DWEIGHT, K.WRITE_DINP | K.WRITE_DWEIGHT):
        into_zeros = {"dinp": np.zeros(x.shape, np.float32),
                      "dweight": np.zeros(w.shape, np.float32)}
        backward(into_zeros["dinp"], into_zeros["dweight"], dout, x, w, offsets)
        # what is written is never read (an expert without rows zeroed), the rest added into
        ours = {name: np.full(a.shape, np.nan if flags & flag else 0.0, np.float32)
                for (name, a), flag in zip(into_zeros.items(), (K.WRITE_DINP, K.WRITE_DWEIGHT))}
        backward(ours["dinp"], ours["dweight"], dout, x, w, offsets, written=flags)
        for name, a in into_zeros.items():
            assert np.array_equal(ours[name].view(np.uint32), a.view(np.uint32)), (name, flags)


@pytest.mark.parametrize("counts,C,OC", GROUPS)
def test_grouped_written(rng, isa, counts, C, OC):
    written_is_the_sum_into_zeros(*grouped_operands(rng, counts, C, OC), bf16=False)


@pytest.mark.parametrize("isa_name", ALL_ISAS)
@pytest.mark.parametrize("counts,C,OC", GROUPS)
def test_grouped_bf16_written(rng, use_isa, isa_name, counts, C, OC):
    use_isa(isa_name)
    written_is_the_sum_into_zeros(*grouped_operands(rng, counts, C, OC, bf16=True),
                                  bf16=True)


@pytest.mark.parametrize("isa_name", ALL_ISAS)
@pytest.mark.parametrize("counts,C,OC", [
    ([700], 40, 30),                   # one job: every thread's share a cut of its rows
    ([13, 0, 300, 41], 33, 150),       # unequal experts, one without rows
    ([0, 90, 0], 70, 800),             # the forward cut along its columns (17 panels of
                                       # 48 against 12 of 8 rows)
])
def test_grouped_bf16_cut_between_threads_is_each_experts_layer(rng, set_threads, use_isa,
                                                                isa_name, counts, C, OC):
    """The bf16 grouped GEMM cuts the experts' work into equal shares of the
    threads, splitting an expert (its rows, or columns) where a share ends:
    on 1, 2, 3, 5 and 7 threads (more cuts than experts) every product is
    bitwise each expert's own linear layer."""
    use_isa(isa_name)
    offsets, x, dout, w16 = grouped_operands(rng, counts, C, OC, bf16=True)
    set_threads(1)
    expected = per_expert(offsets, x, dout, w16, bf16=True)
    for threads in (1, 2, 3, 5, 7):
        set_threads(threads)
        for name, value in grouped(offsets, x, dout, w16, bf16=True).items():
            assert np.array_equal(value, expected[name]), (name, threads)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa_name", ALL_ISAS)
def test_grouped_forward_of_few_rows_is_the_gemms(rng, set_threads, use_isa, isa_name, bf16):
    """Decoding: experts of 1 .. 16 rows (and one of 40) take the few-row
    kernel, whose rows are bitwise the GEMM's: those of a linear layer over
    the expert's rows and 40 more (a row's sum never depends on the others)."""
    use_isa(isa_name)
    counts, C, OC = [1, 0, 2, 40, 16, 3, 12, 1], C_ODD, 70
    offsets, x, _, w = grouped_operands(rng, counts, C, OC, bf16=bf16)
    forward = K.moe_grouped_forward_bf16 if bf16 else K.moe_grouped_forward
    linear = K.matmul_forward_bf16 if bf16 else K.matmul_forward
    extra = randn(rng, 40, C)
    gemm = np.zeros((x.shape[0], OC), np.float32)
    for e in range(len(counts)):
        r0, r1 = offsets[e], offsets[e + 1]
        rows = np.concatenate([x[r0:r1], extra])[None]
        out = np.empty((1, rows.shape[1], OC), np.float32)
        linear(out, rows, w[e])
        gemm[r0:r1] = out[0, :r1 - r0]

    def run():
        out = np.full((x.shape[0], OC), np.nan, np.float32)
        forward(out, x, w, offsets)
        return {"out": out}

    assert_thread_invariant(set_threads, run)
    assert np.array_equal(run()["out"], gemm)


@pytest.mark.parametrize("isa_name", ALL_ISAS)
@pytest.mark.parametrize("counts,C,OC", GROUPS[1:4])
def test_grouped_bf16_reads_bf16_rows_as_their_float32(rng, use_isa, isa_name, counts, C, OC):
    """A bf16 model's gathered rows and expert activations are bf16: the
    grouped bf16 GEMM reads them as the float32 rows it rounds to them, so
    every product is bitwise the same."""
    use_isa(isa_name)
    offsets, x, dout, w16 = grouped_operands(rng, counts, C, OC, bf16=True)
    x16 = np.empty(x.shape, np.uint16)
    K.float_to_bf16(x16, x)
    results = []
    for inp in (x, x16):
        out = np.full((x.shape[0], OC), np.nan, np.float32)
        K.moe_grouped_forward_bf16(out, inp, w16, offsets)
        dinp, dweight = np.full(x.shape, 0.5, np.float32), np.full(w16.shape, -0.25, np.float32)
        K.moe_grouped_backward_bf16(dinp, dweight, dout, inp, w16, offsets)
        results.append((out, dinp, dweight))
    for name, a, b in zip(("out", "dinp", "dweight"), *results):
        assert np.array_equal(a, b), name


def test_gather_copies_bf16_rows_and_refuses_mixed_dtypes(rng):
    N, E, k, C = 23, 4, 2, C_ODD
    _, positions = permute(expert_choices(rng, N, E, k, "random"), E)
    x = randn(rng, N, C)
    x16 = np.empty(x.shape, np.uint16)
    K.float_to_bf16(x16, x)
    grouped, grouped16 = np.empty((N * k, C), np.float32), np.empty((N * k, C), np.uint16)
    K.moe_gather_forward(grouped, x, positions)
    K.moe_gather_forward(grouped16, x16, positions)
    rounded = np.empty_like(grouped16)
    K.float_to_bf16(rounded, grouped)
    assert np.array_equal(grouped16, rounded)
    with pytest.raises(llmc_py.InvalidValueError, match="moe_gather_forward"):
        K.moe_gather_forward(grouped, x16, positions)


def test_grouped_backward_skips_what_is_not_wanted(rng):
    offsets, x, dout, w = grouped_operands(rng, [5, 0, 9], C_ODD, 20)
    full = grouped(offsets, x, dout, w)
    dinp = np.full_like(x, 0.5)
    K.moe_grouped_backward(dinp, None, dout, x, w, offsets)
    assert np.array_equal(dinp, full["dinp"])
    dweight = np.full(w.shape, -0.25, np.float32)
    K.moe_grouped_backward(None, dweight, dout, x, w, offsets)
    assert np.array_equal(dweight, full["dweight"])
    assert np.all(dweight[1] == -0.25)   # the expert without rows keeps its gradient


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("E,k", ROUTES)
def test_written_backwards_are_the_sums_into_zeros_bitwise(rng, isa, set_threads, E, k, norm):
    """moe_route_backward's and moe_gather_backward's written=True ignore what
    the output held (NaN here) and give bitwise the (+=) result on zeros, the
    sign of a zero included (a token whose grouped rows' gradients are -0)."""
    N, C = 53, C_ODD
    logits = router_logits(rng, N, E)
    probs, weights, experts, aux = route(logits, k, norm)
    dweights = randn(rng, N, k)
    _, positions = permute(experts, E)
    dgrouped = randn(rng, N * k, C)
    dgrouped[positions[2]] = -0.0   # 0 + (-0) is +0

    def run(written):
        dlogits = np.zeros_like(logits) if not written else np.full_like(logits, np.nan)
        K.moe_route_backward(dlogits, dweights, probs, logits, experts, norm_topk_prob=norm,
                             aux_coef=0.3, z_coef=0.05, written=written)
        dx = np.zeros((N, C), np.float32) if not written else np.full((N, C), np.nan, np.float32)
        K.moe_gather_backward(dx, dgrouped, positions, written=written)
        return {"dlogits": dlogits, "dx": dx}
    into_zeros = run(False)
    assert not np.signbit(into_zeros["dx"][2]).any()
    for name, value in run(True).items():
        assert np.array_equal(value.view(np.uint32), into_zeros[name].view(np.uint32)), name
    assert_thread_invariant(set_threads, lambda: run(True))


# ---- every kernel: threads, and the whole layer --------------------------------------

@pytest.mark.parametrize("isa_name", ALL_ISAS)
def test_thread_invariant(rng, set_threads, use_isa, isa_name):
    use_isa(isa_name)
    N, E, k, C, OC = 157, 8, 2, C_ODD, 70
    logits = router_logits(rng, N, E)
    x, dy, dweights = randn(rng, N, C), randn(rng, N * k, OC), randn(rng, N, k)
    w = randn(rng, E, OC, C, scale=0.2)
    w16 = np.empty(w.shape, np.uint16)
    K.float_to_bf16(w16, w)

    def run():
        probs, weights, experts, aux = route(logits, k)
        dlogits = np.zeros_like(logits)
        K.moe_route_backward(dlogits, dweights, probs, logits, experts, aux_coef=0.1, z_coef=0.01)
        offsets, positions = permute(experts, E)
        grouped_x = np.empty((N * k, C), np.float32)
        K.moe_gather_forward(grouped_x, x, positions)
        result = {"probs": probs, "weights": weights, "aux": aux, "dlogits": dlogits,
                  "positions": positions}
        for bf16, weight in ((False, w), (True, w16)):
            for name, value in grouped(offsets, grouped_x, dy, weight, bf16).items():
                result[f"{name}{'_bf16' if bf16 else ''}"] = value
        eo = result["out"]
        y = np.empty((N, OC), np.float32)
        K.moe_combine_forward(y, eo, weights, positions)
        deo, dw = np.empty_like(eo), np.empty_like(weights)
        K.moe_combine_backward(deo, dw, y, eo, weights, positions)
        dx = np.zeros_like(x)
        K.moe_gather_backward(dx, result["dinp"], positions)
        result.update(y=y, deo=deo, dw=dw, dx=dx)
        return result
    assert_thread_invariant(set_threads, run)


@pytest.mark.parametrize("E,k", [(3, 1), (8, 2), (4, 4)])
def test_moe_layer_against_autograd(rng, isa, E, k):
    """Router, permutation, gather, one linear layer per expert, combine:
    every gradient of one loss, with both auxiliary losses."""
    N, C, OC = 45, C_ODD, 21
    logits = router_logits(rng, N, E)
    x, w, dy = randn(rng, N, C), randn(rng, E, OC, C, scale=0.2), randn(rng, N, OC)
    aux_coef, z_coef = 0.2, 0.03

    probs, weights, experts, aux = route(logits, k)
    offsets, positions = permute(experts, E)
    gx = np.empty((N * k, C), np.float32)
    K.moe_gather_forward(gx, x, positions)
    eo = np.empty((N * k, OC), np.float32)
    K.moe_grouped_forward(eo, gx, w, offsets)
    y = np.empty((N, OC), np.float32)
    K.moe_combine_forward(y, eo, weights, positions)
    deo, dw = np.empty_like(eo), np.empty_like(weights)
    K.moe_combine_backward(deo, dw, dy, eo, weights, positions)
    dgx, dW = np.zeros_like(gx), np.zeros_like(w)
    K.moe_grouped_backward(dgx, dW, deo, gx, w, offsets)
    dx = np.zeros_like(x)
    K.moe_gather_backward(dx, dgx, positions)
    dlogits = np.zeros_like(logits)
    K.moe_route_backward(dlogits, dw, probs, logits, experts, aux_coef=aux_coef, z_coef=z_coef)

    lt, xt, wt = t64(logits, grad=True), t64(x, grad=True), t64(w, grad=True)
    _, rexperts, rweights, balance, z = moe_route(lt, k)
    roffsets, rpositions = moe_positions(rexperts, E)
    order = torch.argsort(rpositions.reshape(-1))   # the assignment of each grouped row
    rgx = xt[order // k]
    ry = moe_combine(moe_grouped(rgx, wt, roffsets.tolist()), rweights, rpositions)
    ((ry * t64(dy)).sum() + aux_coef * balance + z_coef * z).backward()
    assert_close("y", y, ry, TOL["moe"]["fwd"])
    assert_close("dx", dx, xt.grad, TOL["moe"]["bwd"])
    assert_close("dweight", dW, wt.grad, TOL["moe"]["bwd"])
    assert_close("dlogits", dlogits, lt.grad, TOL["moe"]["bwd"])


# ---- bad input -----------------------------------------------------------------------

def test_route_rejects_bad_sizes(rng):
    logits = randn(rng, 5, 3)
    with pytest.raises(llmc_py.ShapeError, match="moe_route_forward"):
        route(logits, 4)                                  # k > E
    with pytest.raises(llmc_py.ShapeError, match="moe_route_backward"):
        K.moe_route_backward(np.zeros_like(logits), None, logits, logits,
                             np.zeros((5, 4), np.int32))  # k > E
    with pytest.raises(llmc_py.ShapeError, match="moe_route_forward"):
        route(np.zeros((5, 0), np.float32), 0)            # E = 0
    with pytest.raises(llmc_py.ShapeError, match="moe_permute"):
        permute(np.zeros((5, 1), np.int32), 0)            # E = 0


def test_bad_indices_raise(rng):
    logits = randn(rng, 5, 3)
    probs, weights, experts, _ = route(logits, 2)
    bad = experts.copy()
    bad[3, 1] = 3                                         # expert out of range
    with pytest.raises(llmc_py.RangeError, match="moe_permute"):
        permute(bad, 3)
    dlogits = np.zeros_like(logits)
    with pytest.raises(llmc_py.RangeError, match="moe_route_backward"):
        K.moe_route_backward(dlogits, weights, probs, logits, bad)
    assert not dlogits.any()                              # nothing written
    _, positions = permute(experts, 3)
    positions[0, 0] = 10                                  # row out of range
    with pytest.raises(llmc_py.RangeError, match="moe_gather_forward"):
        K.moe_gather_forward(np.empty((10, 4), np.float32), randn(rng, 5, 4), positions)
    with pytest.raises(llmc_py.RangeError, match="moe_combine_forward"):
        K.moe_combine_forward(np.empty((5, 4), np.float32), randn(rng, 10, 4), weights,
                              positions)


@pytest.mark.parametrize("offsets", [[0, 3, 2, 6], [1, 2, 3, 6], [0, 2, 3, 5]])
@pytest.mark.parametrize("bf16", [False, True])
def test_grouped_rejects_bad_offsets(rng, offsets, bf16):
    x, w = randn(rng, 6, 4), randn(rng, 3, 5, 4)
    forward = K.moe_grouped_forward
    if bf16:
        forward, w16 = K.moe_grouped_forward_bf16, np.empty(w.shape, np.uint16)
        K.float_to_bf16(w16, w)
        w = w16
    with pytest.raises(llmc_py.RangeError, match="moe_grouped_forward"):
        forward(np.empty((6, 5), np.float32), x, w, np.array(offsets, np.int32))


@pytest.mark.parametrize("coef", [float("nan"), float("inf")])
def test_route_backward_rejects_a_coefficient_that_is_not_finite(rng, coef):
    logits = randn(rng, 5, 3)
    probs, weights, experts, _ = route(logits, 2)
    with pytest.raises(llmc_py.InvalidValueError, match="moe_route_backward"):
        K.moe_route_backward(np.zeros_like(logits), weights, probs, logits, experts,
                             aux_coef=coef)


def test_route_of_nan_logits_still_picks_distinct_experts():
    logits = np.zeros((3, 8), np.float32)
    logits[0] = np.nan                     # every probability NaN
    logits[1, [2, 5]] = np.nan             # the other six are NaN too (the sum is)
    logits[2, 6] = 1.0                     # a normal row beside them
    _, _, experts, _ = route(logits, 4)
    for row in experts[:2]:
        assert sorted(set(row.tolist())) == sorted(row.tolist()) and row.min() >= 0
    assert experts[2].tolist() == [6, 0, 1, 2]
