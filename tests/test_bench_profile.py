"""bench --profile (llmc_py/bench/profile.py): every kernel call of a
training step timed and attributed, results unchanged, the GEMM calls
replayed alone; on tiny models, with no assertion on a time."""
import functools
import json
import sys
from collections import Counter

import numpy as np
import pytest

from llmc_py import kernels as K
from llmc_py.bench import cli
from llmc_py.bench.profile import ZERO_GRAD, Profiler, profile_step
from llmc_py.bench.lora import lora_step_job
from llmc_py.bench.step import CONFIGS, own_step_job, step_setup

TINY = dict(max_seq_len=16, vocab_size=64, padded_vocab_size=64, num_heads=2, channels=32)
LLAMA_TINY = dict(TINY, num_kv_heads=1, ffn_hidden=48)
TINY_QWEN3 = dict(LLAMA_TINY, qk_norm=True, tied_embeddings=True)   # k_proj's 16 rows: rank 16
# the peaks' problems shrunk to a test's size
SMALL_PEAKS = dict(peak_gemm=64, peak_copy_mib=1)
B, T = 2, 8


def tiny_step(arch="gpt2", layers=2, precision="fp32", recompute=False, lora=None):
    config = CONFIGS[arch](**dict(TINY if arch == "gpt2" else LLAMA_TINY, num_layers=layers))
    return step_setup(config, B, T, np.random.default_rng(0), precision, recompute, lora)


def kernel_calls(profiler, step):
    """(the profiler's Calls of one step, each kernel wrapper's invocations
    in it as the interpreter saw them: every call, however it was reached)."""
    seen = Counter()

    def count(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith("<kernel "):
            seen[name[len("<kernel "):-1]] += 1
    profiler.take()
    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return profiler.take(), seen


CASES = {"gpt2 fp32": dict(), "gpt2 bf16": dict(precision="bf16"),
         "gpt2 bf16 recompute": dict(precision="bf16", recompute=True),
         "llama fp32": dict(arch="llama"),
         "llama lora": dict(arch="llama", precision="bf16", lora=dict(rank=2, alpha=4))}


def profiled_against_plain(**case):
    """Two models of ``case`` (tiny_step's), one step each, then one more
    step each: one profiled, one not; the profiled one's Calls, the kernel
    invocations the interpreter saw (kernel_calls) and both models."""
    plain_model, plain_step = tiny_step(**case)
    model, step = tiny_step(**case)
    plain_step()
    step()   # both models one step in, so the profiled step is a later one too
    with Profiler(model) as profiler:
        calls, seen = kernel_calls(profiler, step)
    assert plain_step() == model.mean_loss
    return calls, seen, model, plain_model


def assert_same_results(model, plain_model):
    """The two models' parameters, gradients and moments, bitwise."""
    for group in ("params", "params_bf16"):
        if getattr(model, group) is not None:
            assert np.array_equal(getattr(model, group).memory,
                                  getattr(plain_model, group).memory)
    trained, plain_trained = model.trained, plain_model.trained
    for ours, theirs in zip(trained + model.moments(), plain_trained + plain_model.moments()):
        memory = getattr(ours, "memory", ours)
        assert np.array_equal(memory, getattr(theirs, "memory", theirs))


@pytest.mark.parametrize("case", CASES)
def test_profiler_times_every_kernel_call_and_changes_no_result(case):
    calls, seen, model, plain_model = profiled_against_plain(**CASES[case])
    assert Counter(c.kernel for c in calls if c.kind != "numpy") == seen
    assert [c.row for c in calls if c.kind == "numpy"] == [ZERO_GRAD]
    assert_same_results(model, plain_model)
    # uninstalled: the model and the kernels module are as they were
    assert model._matmul_forward is plain_model._matmul_forward
    assert model._block.act_forward is plain_model._block.act_forward
    assert "forward_backward" not in vars(model) and K.matmul_forward.__name__ == "matmul_forward"
    assert "<kernel " in K.matmul_forward.__code__.co_filename


def test_split_matmul_backward_changes_no_result_on_any_isa(isa):
    """Each instruction set's matmul backward (bf16's off avx512bf16 too),
    its products called apart (conftest's isa fixture)."""
    for precision in ("fp32", "bf16"):
        _, _, model, plain_model = profiled_against_plain(precision=precision, layers=1)
        assert_same_results(model, plain_model)


def test_lora_adapters_products_are_rows_of_their_own():
    model, step = tiny_step("llama", precision="bf16", lora=dict(rank=2, alpha=4))
    with Profiler(model) as profiler:
        step()
        rows = Counter((c.phase, c.row) for c in profiler.take())
    # the frozen base: no weight gradient; each adapted layer: its down and up products
    assert ("backward", "qkv dinp") in rows and ("backward", "qkv dW") not in rows
    for linear in ("qkv", "attproj", "fc", "fcproj"):
        assert rows[("forward", f"lora {linear} fwd")] == 2   # x A^T, per layer
        # h (scale B)^T added into out, per adapter over its columns (lora_bf16.c)
        assert rows[("forward", f"lora {linear} up")] == 2
        # x A^T as forward kept it: never multiplied again
        assert ("backward", f"lora {linear} fwd") not in rows
        assert rows[("backward", f"lora {linear} up dh+dB")] == 2   # d h and d B
        assert rows[("backward", f"lora {linear} dW")] == 2   # dA
        assert rows[("backward", f"lora {linear} dinp")] == (1 if linear == "qkv" else 2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_profile_rows_count_gpt2s_kernel_calls(precision):
    model, step = tiny_step(layers=2, precision=precision)
    p = profile_step(model, step, 1, **SMALL_PEAKS)
    calls = {(r["phase"], r["row"]): r["calls"] for r in p["rows"]}
    L = 2
    attention = "attention_gqa_forward" + ("_bf16" if precision == "bf16" else "")
    # each layer's residual2 -> ln2 in one kernel (residual_layernorm_forward)
    expected = {("forward", "encoder_forward"): 1, ("forward", "layernorm_forward"): L + 1,
                ("forward", "residual_layernorm_forward"): L,
                ("forward", attention): L, ("forward", "gelu_forward"): L,
                ("forward", "residual_forward"): L,
                ("forward", "softmax_crossentropy_forward"): 1,
                ("backward", "softmax_crossentropy_backward"): 1,
                ("backward", "layernorm_backward"): 2 * L + 1,
                ("backward", attention.replace("forward", "backward")): L,
                ("backward", "gelu_backward"): L,
                ("backward", "encoder_backward"): 1, ("update", "adamw_update"): 1,
                ("step", ZERO_GRAD): 1,
                # zero_grad's runs of adjacent gradients that no product writes first:
                # wpe to ln1b, qkvb, attprojb to ln2b, fcb, fcprojb to lnfb
                ("update", "fill_zero"): 5,
                ("forward", "head fwd"): 1, ("backward", "head dinp"): 1,
                ("backward", "head dW"): 1}
    for linear in ("qkv", "attproj", "fc", "fcproj"):
        expected[("forward", f"{linear} fwd")] = L
        for product in ("dinp", "dW", "dbias"):
            expected[("backward", f"{linear} {product}")] = L
    assert calls == expected
    shapes = {r["row"]: r["shape"] for r in p["rows"] if r["kind"] == "gemm"}
    BT, C = B * T, TINY["channels"]
    assert shapes["fc fwd"] == f"{BT}x{C}x{4 * C}" and shapes["head dW"] == f"{BT}x{C}x64"
    rates = {r["row"]: r["rate"] for r in p["rows"]}
    # zero_grad besides its fill_zero calls: Python, no bytes left to numpy
    assert all((r["rate"] > 0 or r["row"] == ZERO_GRAD) and r["share"] >= 0 for r in p["rows"])
    kernels = sum(r["ms"] for r in p["rows"] if r["kind"] != "numpy")
    assert kernels == pytest.approx(p["kernels_ms"]) and kernels <= p["step_ms"]
    assert p["between_ms"] >= 0 and rates
    assert p["peaks"]["gemm"] == ("matmul_forward_bf16" if precision == "bf16"
                                  else "matmul_forward")
    assert p["peaks"]["gemm_gflops"] > 0 and p["peaks"]["copy_gbps"] > 0
    # every GEMM row's calls and shapes replayed alone
    alone = p["matmuls_alone"]
    gemm_rows = Counter({(r["row"], r["shape"]): r["calls"] for r in p["rows"]
                         if r["kind"] == "gemm"})
    replayed = Counter()
    for r in alone["rows"]:
        replayed[(r["row"], r["shape"])] += r["calls"]
        assert r["alone_ms"] > 0 and r["in_step_ms"] > 0
    assert replayed == gemm_rows
    assert alone["total_ms"] == pytest.approx(sum(r["alone_step_ms"] for r in alone["rows"]))
    assert alone["step_over_matmuls"] == pytest.approx(p["unprofiled_ms"]["median"]
                                                       / alone["total_ms"])


def test_work_of_attention_gemms_and_memory_bound_calls():
    """The FLOP and byte rules: 2*M*N*K per product, attention's causal
    pairs, each array's bytes (twice for += and updated outputs)."""
    model, step = tiny_step(layers=1)
    with Profiler(model) as profiler:
        step()
        calls = {(c.phase, c.row): c for c in profiler.take()}
    C, hs, NH = TINY["channels"], TINY["channels"] // 2, 2
    assert calls[("forward", "fc fwd")].work == 2 * B * T * C * 4 * C
    pairs = T * (T + 1) // 2
    assert calls[("forward", "attention_gqa_forward")].work == 2 * 2 * hs * B * NH * pairs
    assert calls[("backward", "attention_gqa_backward")].work == 5 * 2 * hs * B * NH * pairs
    N = B * T * 4 * C * 4   # one float32 activation of the MLP, in bytes
    assert calls[("forward", "gelu_forward")].work == 2 * N          # read inp, write out
    assert calls[("backward", "gelu_backward")].work == 4 * N        # dinp +=, dout, inp
    assert calls[("backward", "fc dbias")].work == N + 2 * 4 * C * 4  # dout, dbias +=
    P = model.num_parameters * 4
    assert calls[("update", "adamw_update")].work == 7 * P   # params, m, v updated; grads
    assert K.gelu_backward.roles == {"dinp": "+=", "dout": "", "inp": ""}


def test_profile_job_runs_a_llama_config_in_its_own_process():
    p = own_step_job(1, B, T, 1, "bf16", config=LLAMA_TINY, arch="llama", profile=SMALL_PEAKS)
    rows = {r["row"] for r in p["rows"]}
    assert {"rmsnorm_forward", "rope_forward", "swiglu_forward", "swiglu_backward",
            "fc fwd", "fc dW", "head dW"} <= rows
    assert not any(r.endswith("dbias") for r in rows)   # Llama has no biases
    assert p["peaks"]["gemm"] == "matmul_forward_bf16" and p["step_peak_rss_mib"] > 0


@pytest.fixture
def tiny_cli(monkeypatch):
    """bench --profile's job on a tiny GPT-2 and small peaks."""
    monkeypatch.setattr(cli, "own_step_job", functools.partial(own_step_job, config=TINY))
    monkeypatch.setattr(cli, "PEAK_GEMM", SMALL_PEAKS["peak_gemm"])
    monkeypatch.setattr(cli, "PEAK_COPY_MIB", SMALL_PEAKS["peak_copy_mib"])


def test_bench_profile_flag_prints_json(tiny_cli, capsys):
    cli.main(["--profile", "--layers", "1", "--batch", "2", "8", "--repeats", "1", "--json"])
    p = json.loads(capsys.readouterr().out)
    assert p["layers"] == 1 and (p["B"], p["T"]) == (2, 8) and p["precision"] == "fp32"
    assert p["rows"] and p["matmuls_alone"]["rows"] and p["peak_rss_mib"] > 0


def test_bench_profile_flag_prints_the_tables(tiny_cli, capsys):
    cli.main(["--profile", "--layers", "1", "--batch", "2", "8", "--repeats", "1",
              "--precision", "bf16", "--recompute"])
    out = capsys.readouterr().out
    for text in ("peaks in this run: our GEMM 64^3 (matmul_forward_bf16)", "between the kernels",
                 f"of which {ZERO_GRAD}", "matmuls alone", "over its matmuls alone"):
        assert text in out
    assert "forward  qkv fwd" in out and "backward fc dW" in out and "update   adamw_update" in out


def test_bench_profile_is_a_mode_of_its_own():
    for modes in (["--profile", "--generate"], ["--profile", "--lora", "--moe"]):
        with pytest.raises(SystemExit):
            cli.parse(modes)
    assert cli.parse(["--profile"]).batch == (4, 64)
    assert cli.parse(["--profile", "--moe"]).batch == (4, 256)


def test_bench_profile_of_the_moe_model(tiny_cli, monkeypatch, capsys):
    """--profile --moe: the profile of --moe's model (here a tiny one), its
    router, permutation, gather, grouped GEMMs and combine in rows of their own."""
    monkeypatch.setattr(cli, "moe_config", lambda: dict(
        {k: v for k, v in LLAMA_TINY.items() if k != "ffn_hidden"}, num_experts=4,
        experts_per_token=2, expert_hidden=16, router_aux_loss=0.01))
    cli.main(["--profile", "--moe", "--layers", "1", "--batch", "2", "8", "--repeats", "1",
              "--precision", "bf16"])
    out = capsys.readouterr().out
    assert "Llama with 4 experts, top-2, 1 layers" in out
    for row in ("moe_route_forward", "moe_permute", "moe_gather_forward", "expertfc fwd",
                "expertproj dW", "moe_combine_backward", "moe_route_backward"):
        assert row in out, row


def test_matmuls_alone_count_an_moe_layers_calls_whatever_its_routing():
    """The grouped GEMM's calls are one row per product however the
    offsets change from layer to layer and step to step (replayed with the
    first call's), with their time in every step."""
    config = dict({k: v for k, v in LLAMA_TINY.items() if k != "ffn_hidden"}, num_experts=4,
                  experts_per_token=2, expert_hidden=16)
    p = own_step_job(2, B, T, 3, "fp32", config=config, arch="llama", profile=SMALL_PEAKS)
    rows = {r["row"]: r for r in p["matmuls_alone"]["rows"]
            if r["kernel"].startswith("moe_grouped")}
    assert set(rows) == {"expertfc fwd", "expertproj fwd", "expertfc dinp", "expertfc dW",
                         "expertproj dinp", "expertproj dW"}
    assert all(r["calls"] == 2 and r["in_step_ms"] > 0 for r in rows.values())


def test_bench_profile_lora_profiles_bench_loras_step(monkeypatch, capsys):
    """--profile --lora: --lora's step (its defaults: Qwen3-0.6B's 28 layers,
    B=4 T=256; here a tiny Qwen3), its adapters' products as rows of their own."""
    args = cli.parse(["--profile", "--lora"])
    assert (args.layers, args.batch) == (28, (4, 256))
    monkeypatch.setattr(cli, "lora_step_job", functools.partial(lora_step_job, config=TINY_QWEN3))
    monkeypatch.setattr(cli, "PEAK_GEMM", SMALL_PEAKS["peak_gemm"])
    monkeypatch.setattr(cli, "PEAK_COPY_MIB", SMALL_PEAKS["peak_copy_mib"])
    cli.main(["--profile", "--lora", "--layers", "2", "--batch", "2", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "Qwen3-0.6B-shaped, LoRA rank 16 alpha 32 on q_proj" in out and "2 layers" in out
    for row in ("forward  qkv fwd", "forward  lora qkv", "backward lora fcproj",
                "backward head dinp", "update   adamw_update"):
        assert row in out
    assert "head dW" not in out and "qkv dW" not in out.replace("lora qkv dW", "")
