"""python -m llmc_py.summary: parameters per component and memory per part
from a config alone. Its numbers are what a real model allocates (small
models, built here), and it runs without allocating for a config far too big
to build (Qwen3-8B's)."""
import dataclasses
import json
import re
import tracemalloc

import numpy as np
import pytest

from llmc_py import GPT2, Llama
from llmc_py import summary
from llmc_py.model.kv_cache import KVCache
from llmc_py.io.hf import hf_config
from test_gpt2_step import SMALL
from test_llama_step import BASE, CONFIGS

# Qwen3-8B's config.json, its sizes as published
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "tie_word_embeddings": False, "max_position_embeddings": 40960,
            "rope_theta": 1000000, "rms_norm_eps": 1e-06, "hidden_act": "silu",
            "attention_bias": False}

MODELS = {
    "gpt2": lambda: GPT2(SMALL),
    **{name: (lambda choices=choices: Llama(dataclasses.replace(BASE, **choices)))
       for name, choices in CONFIGS.items()},
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_counts_and_memory_equal_what_a_model_allocates(name, precision):
    model = MODELS[name]()
    model = type(model)(model.config, params=model.params.memory, precision=precision)
    c, (B, T) = model.config, (3, 17)
    counts = summary.parameter_counts(c)
    assert sum(counts.values()) == model.num_parameters == model.params.size
    for part, names in summary.COMPONENTS:
        assert counts[part] == sum(int(np.prod(model.params.shapes[n])) for n in names
                                   if n in model.params.shapes), part
    assert counts["head"] == (0 if c.tied_embeddings else model.params.lm_head.size)

    train, forward = summary.memory_table(c, B, T, precision)
    assert train == model.memory_plan(B, T, training=True)
    # the forward is sample's and eval's: one layer's activations kept, and in
    # bf16 a frozen bf16 base's (they load it so; its forward keeps one layer's)
    frozen = (model if precision == "fp32" else
              type(model)(c, params=model.params.memory, precision="bf16", frozen=True))
    assert forward == frozen.memory_plan(B, T, training=False, keep_logits=True,
                                         keep_activations=False)
    if precision == "bf16":
        assert forward == frozen.memory_plan(B, T, training=False, keep_logits=True)
    # and what a training step really allocates
    model.reserve(B, T, training=True)
    allocated = {"parameters": model.params.memory.nbytes,
                 "parameters (bf16 copy)": (0 if model.params_bf16 is None
                                            else model.params_bf16.memory.nbytes),
                 "parameter gradients": model.grads.memory.nbytes,
                 "AdamW moments": model.m_memory.nbytes + model.v_memory.nbytes,
                 "activations": model.acts.memory.nbytes,
                 "logits": model._logits_buffer.nbytes,
                 "activation gradients": model.grads_acts.memory.nbytes}
    assert allocated == {part: train[part] for part in allocated}
    # a forward that keeps its logits holds all B*T rows of them; one that
    # keeps one layer's activations, those of the plan (in the step's buffer)
    model.forward(np.zeros((B, T), np.int32), keep_activations=False)
    assert model.logits.nbytes == forward["logits"]
    assert model.acts.memory.nbytes == forward["activations"] < train["activations"]
    assert summary.kv_cache_bytes(c, B, T) == KVCache(c, B, T).nbytes
    assert summary.kv_cache_bytes(c) == 4 * 2 * c.L * c.NKV * c.head_size


def test_memory_plan_with_recompute_is_the_models():
    model = MODELS["llama"]()
    model.recompute = True
    from llmc_py.model.transformer import memory_plan
    assert memory_plan(model.config, 2, 9, recompute=True) == model.memory_plan(2, 9)
    assert memory_plan(model.config, 2, 9)["activations"] > model.memory_plan(2, 9)["activations"]
    model.recompute = 2
    assert memory_plan(model.config, 2, 9, recompute=2) == model.memory_plan(2, 9)
    assert memory_plan(model.config, 2, 9, recompute=1)["activations"] > \
        model.memory_plan(2, 9)["activations"]


def test_qwen3_8b_config_without_allocating(tmp_path, capsys):
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    tracemalloc.start()
    try:
        assert summary.main([str(folder / "config.json"), "-b", "2", "-t", "4096",
                             "--precision", "bf16"]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"the summary allocated {peak} bytes"   # 8B params: 30 GiB
    out = capsys.readouterr().out
    config = summary.load_config(folder)   # the folder works as well as its config.json
    counts = summary.parameter_counts(config)
    total = sum(counts.values())
    assert abs(total - 8.19e9) < 0.005e9, total
    assert re.search(rf"^  total +{total:,} +100.0%$", out, re.M)
    # untied: the head is the embedding's size; qk_norm adds 2 hs per layer
    assert counts["head"] == counts["embeddings"] == 151936 * 4096
    assert counts["norms"] == 36 * 2 * 4096 + 4096
    assert counts["attention"] == 36 * (4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 2 * 128)
    assert counts["MLP"] == 36 * 3 * 4096 * 12288
    train, _ = summary.memory_table(config, 2, 4096, "bf16")
    assert train["parameters"] == 4 * total and train["parameters (bf16 copy)"] == 2 * total
    assert train["AdamW moments"] == 8 * total
    assert f"{36 * 2 * 8 * 128 * 4:,} bytes per token" in out
    assert "parameters (bf16 copy)" in out and "30.51 GiB" in out


def test_sources_model_file_hf_folder_and_depth(tmp_path, capsys):
    llama = Llama(dataclasses.replace(BASE, **CONFIGS["mqa-untied-bias"]))
    llama.save_checkpoint(tmp_path / "llama.bin")
    GPT2(SMALL).save_checkpoint(tmp_path / "gpt2.bin")
    assert summary.load_config(tmp_path / "llama.bin") == llama.config
    assert summary.load_config(tmp_path / "gpt2.bin") == SMALL
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config(llama.config)))
    assert sum(summary.parameter_counts(summary.load_config(hf)).values()) == \
        llama.num_parameters
    d12 = summary.load_config("d12")
    assert sum(summary.parameter_counts(d12).values()) == 124475904   # llm.c's GPT-2 124M
    assert summary.main(["d12", "-b", "4", "-t", "64"]) == 0
    out = capsys.readouterr().out
    assert "memory at B=4, T=64, fp32" in out and "tied to wte" in out
    assert "47 padding rows" in out


def test_bad_source_is_one_line(tmp_path, capsys):
    assert summary.main([str(tmp_path / "missing.bin")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.bin" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text("{not json")
    assert summary.main([str(tmp_path / "config.json")]) == 1
    assert "not valid JSON" in capsys.readouterr().err


GPT2_TENSORS = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w",
                "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")   # llm.c's 16


def tensor_rows(out):
    """{name: (shape, parameters, bytes)} of --tensors' output, and its total row."""
    rows = {m[1]: (m[2], int(m[3].replace(",", "")), int(m[4].replace(",", "")))
            for m in re.finditer(r"^  (\w+) +(\([\d, ]*\)) +([\d,]+) +([\d,]+)$", out, re.M)}
    total = re.search(r"^  total +([\d,]+) +([\d,]+)$", out, re.M)
    return rows, tuple(int(x.replace(",", "")) for x in total.groups())


def test_tensors_of_gpt2_124m_are_llm_cs(capsys):
    assert summary.main(["d12", "--tensors"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  qkvw +\(12, 2304, 768\) +21,233,664 +84,934,656$", out, re.M)
    rows, total = tensor_rows(out)
    assert tuple(rows) == GPT2_TENSORS
    assert rows["wte"] == ("(50304, 768)", 50304 * 768, 4 * 50304 * 768)   # the padded vocab
    assert rows["lnfb"] == ("(768,)", 768, 4 * 768)
    assert total == (124475904, 4 * 124475904)   # llm.c's count, with the padded vocab
    assert "47 padding rows" in out and "tied to wte" in out
    # the default view is unchanged: components, not tensors
    assert summary.main(["d12"]) == 0
    assert "qkvw" not in capsys.readouterr().out


def test_tensors_of_a_llama_with_qk_norm_untied_head_and_biases(tmp_path, capsys):
    model = Llama(dataclasses.replace(BASE, qk_norm=True, tied_embeddings=False, bias=True))
    model.save_checkpoint(tmp_path / "llama.bin")
    assert summary.main([str(tmp_path / "llama.bin"), "--tensors", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    rows, total = tensor_rows(out)
    # every tensor the model allocates, in its order, with its shape
    assert {name: shape for name, (shape, _, _) in rows.items()} == \
        {name: str(shape) for name, shape in model.params.shapes.items()}
    assert {"qnormw", "knormw", "lm_head", "qkvb", "fcb"} <= set(rows)
    assert "ln1b" not in rows and "wpe" not in rows   # rmsnorm, rope
    assert all(b == 2 * n for _, n, b in rows.values())   # bf16: 2 bytes a parameter
    assert total == (model.num_parameters, 2 * model.num_parameters)
    assert "tied to wte" not in out and "float32 master weights" in out


def test_tensors_of_qwen3_8b_without_allocating(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    assert summary.main([str(tmp_path / "config.json"), "--tensors"]) == 0
    rows, total = tensor_rows(capsys.readouterr().out)
    assert rows["qnormw"] == rows["knormw"] == ("(36, 128)", 36 * 128, 4 * 36 * 128)
    assert rows["qkvw"][0] == f"(36, {(32 + 2 * 8) * 128}, 4096)"
    assert rows["fcw"][0] == "(36, 24576, 4096)"   # swiglu: the gate's rows, then up's
    assert rows["lm_head"][0] == "(151936, 4096)"
    assert total[0] == sum(summary.parameter_counts(summary.load_config(tmp_path)).values())


def test_qwen3_8b_lora_step_and_bf16_forward_plans(tmp_path, capsys):
    """The issue's floors: a rank-16 LoRA step on all seven projections of a
    frozen bf16 Qwen3-8B at B=1, T=512 with recompute plans at most 20 GiB;
    its bf16 forward holds 2 bytes a matrix parameter, not 6, and one
    layer's activations: at most 16 GiB in all."""
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    assert summary.main([str(folder), "-b", "1", "-t", "512", "--precision", "bf16",
                         "--recompute", "--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    config = summary.load_config(folder)
    lora, forward = summary.memory_table(config, 1, 512, "bf16", True, 16)
    assert sum(lora.values()) <= 20 << 30
    adapters = 36 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))
    assert lora["LoRA adapters"] == lora["parameter gradients"] == 4 * adapters
    assert lora["AdamW moments"] == 8 * adapters
    assert lora["parameters (bf16)"] == forward["parameters (bf16)"] == 2 * (
        8_190_735_360 - 36 * 2 * 4096 - 4096 - 36 * 2 * 128)
    assert lora["parameters"] == 4 * (36 * 2 * 4096 + 4096 + 36 * 2 * 128)   # the norms
    assert "parameters (bf16 copy)" not in forward
    # the forward (sample's, eval's) keeps one layer's activations: about 16 GiB
    assert sum(forward.values()) <= 16 << 30
    assert forward["activations"] < lora["activations"] // 20
    assert "LoRA step, r=16" in out and "15.26 GiB" in out
    full, _ = summary.memory_table(config, 1, 512, "bf16", True)
    assert sum(full.values()) > 7 * sum(lora.values())
    assert summary.main([str(folder), "--lora-rank", "4", "--lora-targets", "c_fc"]) == 1
    assert "--lora-targets c_fc: targets: this model has no module 'c_fc'" in (
        capsys.readouterr().err)
