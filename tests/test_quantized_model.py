"""A model whose linear layers run on llama.cpp's Q8_0 / Q4_0 blocks
(model.quantize): its logits against a float64 reference of the same
arithmetic, KV-cache decoding against its own full forward, the float32
weights released, and what it refuses."""
import dataclasses
import io

import gguf
import numpy as np
import pytest

from llmc_py import GPT2, GPT2Config, Llama, LlamaConfig
from llmc_py.io.files import to_bf16
from llmc_py.model.quantized import FEW_ROWS

V = 300   # a tokenizer.json of the 256 bytes and <|endoftext|> fits it, padded
GPT2_SMALL = GPT2Config(max_seq_len=48, vocab_size=V, padded_vocab_size=320, num_layers=2,
                        num_heads=4, channels=64)
LLAMA = LlamaConfig(max_seq_len=24, vocab_size=V, padded_vocab_size=320, num_layers=2,
                    num_heads=4, num_kv_heads=2, channels=64)
MODELS = {
    "gpt2": lambda: GPT2(GPT2_SMALL, seed=1),
    "llama-gqa-untied": lambda: Llama(dataclasses.replace(LLAMA, tied_embeddings=False), seed=2),
    "qwen3-qknorm": lambda: Llama(dataclasses.replace(LLAMA, qk_norm=True, head_dim=32,
                                                      rope_theta=1e6), seed=3),
}
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
LINEARS = ("qkvw", "attprojw", "fcw", "fcprojw")


def tokens(B, T, seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, T))


def write_tokenizer(folder):
    """A byte-level tokenizer.json of the 256 bytes and <|endoftext|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text('{"eos_token_id": 256}')
    return folder / "tokenizer.json"


def round_trip(w, qtype):
    """w as gguf's blocks of qtype would give it back."""
    kind = GGML[qtype]
    return gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind).reshape(w.shape)


def bf16(x):
    """x rounded to the nearest bf16, as float32."""
    return (to_bf16(np.ascontiguousarray(x, np.float32)).astype(np.uint32) << 16).view(np.float32)


def reference(make, qtype, rows=lambda x: round_trip(x, "q8_0"), weights=lambda w: w,
              head=None):
    """The float32 model with each linear weight replaced by its dequantised
    blocks (the embedding's and the head's ``head``, default qtype), whose matmuls take each input row through
    Q8_0 as the few-row kernel does and sum in float64; ``rows`` and
    ``weights`` (bf16 for the panel path) say what the operands go through."""
    model = make()
    p, c = model.params, model.config
    for name in LINEARS:
        p[name][...] = round_trip(p[name].reshape(-1, p[name].shape[-1]),
                                  qtype).reshape(p[name].shape)
    for name in ("wte",) if c.tied_embeddings else ("wte", "lm_head"):
        p[name][...] = round_trip(p[name], head or qtype)

    def matmul(out, inp, weight, bias):
        x = rows(np.ascontiguousarray(inp).reshape(-1, inp.shape[-1]))
        y = x.astype(np.float64) @ weights(weight).astype(np.float64).T
        if bias is not None:
            y += bias
        out[...] = y.reshape(out.shape)

    model._matmul_forward = matmul
    return model


@pytest.mark.parametrize("qtype,head", [("q8_0", None), ("q4_0", None), ("q4_0", "q8_0"),
                                        ("q8_0", "q4_0")])
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_the_reference_of_the_same_arithmetic(name, qtype, head):
    """FEW_ROWS rows: the decoding kernel; the embedding and head in the
    linear layers' type, or in ``head``'s."""
    model = MODELS[name]()
    model.quantize(qtype, head=head)
    x = tokens(2, 4)
    assert x.size == FEW_ROWS
    model.forward(x)
    ref = reference(MODELS[name], qtype, head=head)
    ref.forward(x)
    got, want = model.logits[..., :V], ref.logits[..., :V]
    # float32 sums in another order; an activation on a rounding boundary may
    # move one Q8_0 step (1/127 of its block's largest value)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", MODELS)
def test_many_rows_take_the_panel_path(name, qtype):
    """More than FEW_ROWS rows: inputs and dequantised weights rounded to
    bf16, products summed in float32 (the float64 reference differs by the
    float32 sums' rounding only)."""
    model = MODELS[name]()
    model.quantize(qtype)
    x = tokens(2, 9)
    model.forward(x)
    ref = reference(MODELS[name], qtype, rows=bf16, weights=bf16)
    ref.forward(x)
    got, want = model.logits[..., :V], ref.logits[..., :V]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # and not the few-row arithmetic, whose Q8_0 activations differ by more
    few = reference(MODELS[name], qtype)
    few.forward(x)
    assert np.abs(got - few.logits[..., :V]).max() > 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_decoding_equals_its_own_full_forward(name, qtype):
    model = MODELS[name]()
    model.quantize(qtype)
    prompt = [3, 14, 15, 9, 2]
    new = model.generate(prompt, 10, temperature=0)
    # greedy by full forwards of the quantized model
    seq = list(prompt)
    for _ in range(10):
        model.forward(np.array([seq]))
        seq.append(int(np.argmax(model.logits[0, -1, :V])))
    assert new == seq[len(prompt):]


@pytest.mark.parametrize("head", [None, "q8_0"])
@pytest.mark.parametrize("name", MODELS)
def test_the_float32_weights_are_released(name, head):
    model = MODELS[name]()
    before = model.params.memory.nbytes
    model.quantize("q4_0", head=head)
    for n in LINEARS + ("lm_head", "wte"):
        assert n not in model.params
    c = model.config
    linear_floats = sum(np.prod(s) for n, s in MODELS[name]().params.shapes.items()
                        if n in LINEARS + ("lm_head", "wte"))
    assert model.params.memory.nbytes == before - 4 * linear_floats
    assert model.params_bf16 is None
    # Q4_0: 18 bytes per 32 weights
    assert model._weights["fcw"][0].nbytes * 32 == 18 * np.prod(model._weights["fcw"][0].shape)
    # the embedding (and the head) in Q4_0 too, or in Q8_0 (34 bytes per 32
    # weights) with head="q8_0"; a tied head is the same
    kind = head or "q4_0"
    assert model._weights.wte.qtype == kind and model._weights.wte.shape == (c.Vp, c.C)
    assert model._weights.wte.nbytes == c.Vp * c.C // 32 * {"q4_0": 18, "q8_0": 34}[kind]
    assert model.quantized_head == kind
    table = model._head(model._weights)
    assert (table is model._weights.wte) == c.tied_embeddings and table.qtype == kind


def one_buffer(model):
    """True if the quantized weights' packed blocks lie one after another,
    each on ALIGN_BYTES, in one buffer in the order a step reads them."""
    tables = [model._weights.wte] + ([] if model.config.tied_embeddings
                                     else [model._weights.lm_head])
    parts = [model._weights[n][l] for l in range(model.config.L) for n in LINEARS] + tables
    starts = [w.packed.ctypes.data for w in parts]
    gaps = [b - (a + w.nbytes) for a, b, w in zip(starts, starts[1:], parts)]
    base = parts[0].packed.base
    return (all(0 <= g < 64 and b % 64 == 0 for g, b in zip(gaps, starts[1:]))
            and all(w.packed.base is base for w in parts))


@pytest.mark.parametrize("name", MODELS)
def test_the_quantized_weights_are_one_buffer(name):
    """One buffer a decoding step streams from start to end (numpy asks for
    huge pages for an allocation of 4 MiB or more, not for most single
    weights)."""
    model = MODELS[name]()
    model.quantize("q4_0")
    assert one_buffer(model)


def test_a_quantized_bf16_model_releases_its_bf16_copy():
    model = Llama(LLAMA, seed=2, precision="bf16")
    model.quantize("q8_0")
    assert model.params_bf16 is None
    model.forward(tokens(1, 4))


def test_loss_with_targets(tmp_path):
    model = MODELS["gpt2"]()
    x = tokens(2, 8)
    ref = model.forward(x[:, :-1], x[:, 1:])
    model.quantize("q8_0")
    loss = model.forward(x[:, :-1], x[:, 1:])
    assert abs(loss - ref) < 0.01 * ref
    assert model.forward(x[:, :-1], x[:, 1:], keep_logits=False) == pytest.approx(loss, 1e-6)


@pytest.mark.parametrize("call", ["backward", "forward_backward", "update", "save_checkpoint",
                                  "merge_lora", "quantize", "initialize"])
def test_training_and_saving_are_refused(tmp_path, call):
    model = MODELS["gpt2"]()
    model.quantize("q8_0")
    x = tokens(1, 4)
    model.forward(x, x)
    calls = {"backward": lambda: model.backward(),
             "forward_backward": lambda: model.forward_backward(x, x),
             "update": lambda: model.update(1e-3),
             "save_checkpoint": lambda: model.save_checkpoint(tmp_path / "m.bin"),
             "merge_lora": lambda: model.add_lora(2, 4) or model.merge_lora(),
             "quantize": lambda: model.quantize("q4_0"),
             "initialize": lambda: model.initialize(1)}
    with pytest.raises(RuntimeError, match=f"{call}: this model.* quantized"):
        calls[call]()


def test_unknown_type_and_partial_blocks_are_named():
    with pytest.raises(ValueError, match="'q5_1'"):
        MODELS["gpt2"]().quantize("q5_1")
    odd = GPT2(GPT2Config(max_seq_len=8, vocab_size=67, padded_vocab_size=128, num_layers=1,
                          num_heads=4, channels=60), seed=1)
    with pytest.raises(Exception, match=r"qkvw\[0\].*60.*not a multiple of 32"):
        odd.quantize("q8_0")


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied", "qwen3-qknorm"])
def test_a_gguf_file_keeps_its_blocks(tmp_path, monkeypatch, name, qtype):
    from llmc_py import load_model
    from llmc_py.model.quantized import QuantizedLinear
    path = tmp_path / "m.gguf"
    MODELS[name]().save_gguf(path, dtype=qtype, tokenizer=write_tokenizer(tmp_path))
    want = load_model(path)   # dequantised, then quantized again
    want.quantize(qtype)
    quantized = []
    original = QuantizedLinear.quantize.__func__
    monkeypatch.setattr(QuantizedLinear, "quantize", classmethod(
        lambda cls, w, kind, n="weight", *packed: quantized.append(n) or original(cls, w, kind, n,
                                                                               *packed)))
    model = load_model(path, weights=qtype)
    # only the embedding and the head are re-made
    assert quantized == (["wte", "lm_head"] if "untied" in name else ["wte"])
    for n in LINEARS:
        for got, same in zip(model._weights[n], want._weights[n]):
            assert np.array_equal(got.blocks, same.blocks)
    assert one_buffer(model)   # the file's blocks moved into the model's buffer
    x = tokens(2, 7)
    model.forward(x)
    want.forward(x)
    assert np.array_equal(model.logits, want.logits)


def test_load_model_names_an_unknown_weights_type(tmp_path):
    from llmc_py import load_model
    with pytest.raises(ValueError, match="'q6_k'"):
        load_model(tmp_path / "absent.bin", weights="q6_k")


def test_sample_and_eval_take_weights(tmp_path, capsys):
    from llmc_py import eval as evaluation
    from llmc_py import load_model, sample
    path = tmp_path / "model.bin"
    MODELS["llama-gqa-untied"]().save_checkpoint(path)
    folder = write_tokenizer(tmp_path)
    args = ["-e", str(path), "--tokenizer", str(folder), "--prompt", "ab", "-g", "6",
            "--temperature", "0", "--stop-at-eot", "0", "--weights", "q4_0"]
    model, encoding = sample.load(sample.parse(args))
    assert model.quantized == "q4_0"
    assert sample.main(args) == 0
    text = {weights: io.StringIO() for weights in ("q4_0", None)}
    for weights, out in text.items():
        sample.write_sample(sample.parse(args), load_model(path, weights=weights), encoding, out)
    assert capsys.readouterr().out == text["q4_0"].getvalue() != text[None].getvalue()
    data = tmp_path / "val.bin"
    from llmc_py.io.tokens import write_tokens
    write_tokens(data, tokens(1, 60)[0])
    losses = {}
    for weights in ([], ["--weights", "q8_0"]):
        assert evaluation.main([str(path), str(data), "--lengths", "8"] + weights) == 0
        losses[len(weights)] = float(capsys.readouterr().out.split()[-2])
    assert losses[2] != losses[0] and abs(losses[2] - losses[0]) < 0.01 * losses[0]


def _traced_peak(load):
    """(what load() returns, the peak bytes numpy and Python allocated meanwhile)."""
    import tracemalloc
    tracemalloc.start()
    try:
        out = load()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("source", ["model.bin", "hf", "q8_0.gguf"])
def test_a_quantized_load_streams_tensor_by_tensor(tmp_path, source):
    """load_model(..., weights=) never holds the model in float32: its
    loading peak stays under the float32 parameters' bytes, which building
    the float32 model first (the way before) exceeds, and the logits are
    that way's to the bit."""
    from llmc_py import load_model
    from llmc_py.io.load import read_model_file, read_quantized_blocks
    config = LlamaConfig(max_seq_len=16, vocab_size=V, padded_vocab_size=320, num_layers=6,
                         num_heads=4, num_kv_heads=2, channels=128, ffn_hidden=512,
                         tied_embeddings=False)
    model = Llama(config, seed=4)
    fp32_bytes = model.params.memory.nbytes
    path = tmp_path / source
    if source == "hf":
        model.save_pretrained(path, dtype="bf16")
    elif source.endswith(".gguf"):
        model.save_gguf(path, dtype="q8_0", tokenizer=write_tokenizer(tmp_path))
    else:
        model.save_checkpoint(path)
    x = tokens(2, 7)
    for qtype in ("q8_0", "q4_0"):
        def float32_first(qtype=qtype):
            read_config, params = read_model_file(path)
            whole = Llama(read_config, params=params)
            whole.quantize(qtype, blocks=read_quantized_blocks(path, qtype))
            return whole
        want, peak_before = _traced_peak(float32_first)
        got, peak = _traced_peak(lambda: load_model(path, weights=qtype))
        assert peak < fp32_bytes < peak_before
        assert got.params.memory.nbytes < fp32_bytes / 10
        want.forward(x)
        got.forward(x)
        assert np.array_equal(got.logits, want.logits)


def test_put_quantized_refuses_a_block_of_the_wrong_shape():
    from llmc_py.model.quantized import QuantizedLinear
    model = Llama(LLAMA, weights="q8_0")
    wrong = QuantizedLinear.quantize(np.zeros((64, 64), np.float32), "q8_0", "x.gguf: fcw[1]")
    with pytest.raises(Exception, match=r"x.gguf: fcw\[1\].*\[64, 64\].*fcw\[1\]"):
        model.put_quantized("fcw", 1, wrong)
    with pytest.raises(ValueError, match="weights='q8_0'.*neither params"):
        Llama(LLAMA, params=model.params.memory, weights="q8_0")


def test_eval_tables_several_weights(tmp_path, capsys):
    """eval --weights fp32 bf16 q8_0 q4_0: a row per weights (and length),
    each loss that of eval with those weights alone, each perplexity's
    change from fp32's."""
    import re

    from llmc_py import eval as evaluation
    from llmc_py.io.tokens import write_tokens
    path, data = tmp_path / "model.bin", tmp_path / "val.bin"
    MODELS["qwen3-qknorm"]().save_checkpoint(path)
    write_tokens(data, tokens(1, 60)[0])
    kinds = ["fp32", "bf16", "q8_0", "q4_0"]
    assert evaluation.main([str(path), str(data), "--lengths", "8", "16", "--weights",
                            *kinds]) == 0
    rows = re.findall(r"^(\S+) +(\d+) +\d+ +\d+ +\d+ +(\S+) +(\S+) +(\S+)%$",
                      capsys.readouterr().out, re.M)
    assert [(w, L) for w, L, *_ in rows] == [(w, L) for w in kinds for L in ("8", "16")]
    first = {L: float(ppl) for w, L, _, ppl, _ in rows if w == "fp32"}
    for weights, length, loss, ppl, change in rows:
        alone = ["--precision", "bf16"] if weights == "bf16" else ["--weights", weights]
        assert evaluation.main([str(path), str(data), "--lengths", length] + alone) == 0
        assert float(capsys.readouterr().out.split()[-2]) == float(loss)
        assert abs(float(change) - (float(ppl) / first[length] - 1) * 100) < 0.01
    assert [c for w, _, _, _, c in rows if w == "fp32"] == ["+0.00"] * 2
    assert evaluation.main([str(path), str(data), "--lengths", "8", "--precision", "bf16",
                            "--weights", "q8_0"]) == 1
    assert "--precision bf16 and --weights: give one" in capsys.readouterr().err


def test_the_head_in_a_type_of_its_own(tmp_path, capsys):
    """head_weights / --head-weights / --head-dtype: the embedding and head
    in other blocks than the linear layers'; a GGUF file's head read back
    into its own type keeps its bytes; each refused without a quantized
    model to belong to."""
    from llmc_py import UsageError, load_model
    from llmc_py import convert
    from llmc_py import eval as evaluation
    from llmc_py.io.tokens import write_tokens
    import json
    import re
    model = Llama(dataclasses.replace(LLAMA, tied_embeddings=False), seed=5)   # wte, lm_head
    path = tmp_path / "model.gguf"
    model.save_gguf(path, dtype="q4_0", tokenizer=write_tokenizer(tmp_path), head_dtype="q8_0")
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert stored["output.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert stored["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    for head in ("q8_0", None):
        loaded = load_model(path, weights="q4_0", head_weights=head)
        assert loaded.quantized == "q4_0" and loaded.quantized_head == (head or "q4_0")
        assert loaded._weights.lm_head.qtype == (head or "q4_0")
        assert loaded.memory_plan(1, 4, training=False).keys() >= {
            f"parameters ({head or 'q4_0'})"}
    # a Q8_0 head read into Q8_0: the file's blocks, byte for byte
    blocks = load_model(path, weights="q4_0", head_weights="q8_0")._weights.lm_head.blocks
    assert np.array_equal(blocks[:V].reshape(-1).view(np.uint8),
                          np.asarray(stored["output.weight"].data).reshape(-1).view(np.uint8))
    with pytest.raises(UsageError, match="head_weights='q8_0'.*give weights too"):
        load_model(path, head_weights="q8_0")
    with pytest.raises(ValueError, match="head_weights='q8_0'.*give weights too"):
        Llama(LLAMA, head_weights="q8_0")
    with pytest.raises(ValueError, match="unknown quantisation type 'q6_k'"):
        Llama(LLAMA, seed=5).quantize("q4_0", head="q6_k")
    # the CLIs
    folder, out = tmp_path / "hf", tmp_path / "cli.gguf"
    model.save_pretrained(folder)
    hf_config = json.loads((folder / "config.json").read_text())
    write_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(dict(hf_config, eos_token_id=256)))
    assert convert.main([str(folder), str(out), "--dtype", "q8_0", "--head-dtype", "q4_0"]) in (
        None, 0)
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert kinds["output.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert kinds["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert convert.main([str(path), str(tmp_path / "m.bin"), "--head-dtype", "q8_0"]) == 1
    assert "--head-dtype: only a .gguf DST" in capsys.readouterr().err
    data = tmp_path / "val.bin"
    write_tokens(data, tokens(1, 40)[0])
    assert evaluation.main([str(path), str(data), "--lengths", "8", "--weights", "fp32",
                            "--head-weights", "q8_0"]) == 1
    assert "--head-weights q8_0: the head of quantized --weights" in capsys.readouterr().err
    assert evaluation.main([str(path), str(data), "--lengths", "8", "--weights", "q4_0",
                            "--head-weights", "q8_0"]) == 0
    assert re.search(r"^ +8 +8 +\d+ +\d+ +[0-9.]+ +[0-9.]+$", capsys.readouterr().out, re.M)
