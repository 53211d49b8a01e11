"""Mixtures of experts on llama.cpp's Q8_0 / Q4_0 blocks: the grouped kernel
(moe_grouped_forward_quant) bitwise the dense quantized kernels on each
expert's rows, on every few-row path and thread count; the quantized MoE
model (model.quantize, load_model(weights=)) against a float64 reference of
the same arithmetic (test_quantized_model's bounds), KV-cache decoding
against its own full forward, GGUF files' expert blocks kept byte for
byte, the memory plan, and what is refused. Tiny random models: a
Mixtral-like one (GQA, untied, 4 experts top-2) and a Qwen3-MoE-like one
(qk_norm, head_dim != C / NH, tied, 8 experts top-2, a dense layer between)."""
import dataclasses

import numpy as np
import pytest

import llmc_py
from llmc_py import Llama, LlamaConfig, load_model
from llmc_py._native import kernels as K
from llmc_py.errors import RangeError, ShapeError, UnsupportedError
from llmc_py.model import blocks as blocks_mod
from llmc_py.model.quantized import FEW_ROWS, QuantizedExperts, QuantizedLinear
from helpers import assert_thread_invariant
from test_quantized_model import V, bf16, round_trip, tokens, write_tokenizer

gguf = pytest.importorskip("gguf")

QTYPES = ("q8_0", "q4_0")
PATHS = ("portable", "avx2", "avxvnni", "avx512vnni")
BASE = LlamaConfig(max_seq_len=24, vocab_size=V, padded_vocab_size=320, num_layers=2,
                   num_heads=4, num_kv_heads=2, channels=64, num_experts=4,
                   experts_per_token=2, expert_hidden=32)
CONFIGS = {
    "mixtral": dataclasses.replace(BASE, tied_embeddings=False),
    "qwen3-moe-dense-between": dataclasses.replace(
        BASE, qk_norm=True, head_dim=32, rope_theta=1e6, num_experts=8, num_layers=3,
        moe_every=2, ffn_hidden=64),
}
LINEARS = ("qkvw", "attprojw", "fcw", "fcprojw")
STACKS = ("expertfcw", "expertprojw")


def make(name, seed=1):
    return Llama(CONFIGS[name], seed=seed)


# ---- the kernel ----------------------------------------------------------------

def offsets_of(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def grouped(x, stack, offsets, variant=""):
    out = np.full((len(x), stack.shape[1]), np.nan, np.float32)   # (written)
    try:
        K.moe_grouped_forward_quant(out, x, stack.packed, offsets, stack._type, FEW_ROWS,
                                    variant=variant)
    except UnsupportedError:
        pytest.skip(f"this CPU or build has no {variant} path")
    return out


def per_expert(x, w, offsets, qtype, variant=""):
    """Each expert's rows through the dense quantized kernels on its own weight."""
    out = np.full((len(x), w.shape[1]), np.nan, np.float32)
    for e in range(len(w)):
        rows = slice(offsets[e], offsets[e + 1])
        n = offsets[e + 1] - offsets[e]
        if n == 0:
            continue
        linear = QuantizedLinear.quantize(w[e], qtype)
        if n <= FEW_ROWS:
            K.matmul_forward_quant(out[rows], x[rows], linear.packed, None, linear._type,
                                   variant=variant)
        else:
            K.matmul_forward_quant_panels(out[rows], x[rows], linear.packed, None,
                                          linear._type)
    return out


# expert row counts: one expert (E = 1), an expert with none, one with all,
# every expert few-row (decoding), few and many mixed (prefill)
COUNTS = [[3], [2, 0, 5], [0, 0, 7], [1, 2, 1, 3, 0, 2, 1, 2], [9, 1, 20], [0, 30, 0]]


@pytest.mark.parametrize("IC,OC", [(96, 37), (32 * 17, 9)])
@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_grouped_kernel_is_each_experts_dense_kernel(rng, path, qtype, counts, IC, OC):
    """Bitwise matmul_forward_quant (the same path forced) on each expert of
    at most FEW_ROWS rows, matmul_forward_quant_panels on one of more;
    OC not a multiple of the kernel's 4 rows, IC of more than 16 blocks."""
    w = rng.standard_normal((len(counts), OC, IC)).astype(np.float32)
    stack = QuantizedExperts.quantize(w, qtype, "w")
    offsets = offsets_of(counts)
    x = rng.standard_normal((offsets[-1], IC)).astype(np.float32)
    got = grouped(x, stack, offsets, path)
    np.testing.assert_array_equal(got, per_expert(x, w, offsets, qtype, path))


@pytest.mark.parametrize("qtype", QTYPES)
def test_grouped_kernel_against_float64(rng, qtype):
    """Against float64 on the dequantised weights and Q8_0 inputs (few
    rows) or bf16-rounded inputs and weights (many): test_quant's and
    test_quant_panels' arithmetic, well within 1e-5 of the output's scale."""
    E, OC, IC = 3, 20, 64
    w = rng.standard_normal((E, OC, IC)).astype(np.float32)
    stack = QuantizedExperts.quantize(w, qtype, "w")
    deq = stack.dequantize().astype(np.float64)
    np.testing.assert_array_equal(stack.dequantize(), round_trip(w.reshape(-1, IC), qtype)
                                  .reshape(w.shape))
    offsets = offsets_of([4, 0, 12])
    x = rng.standard_normal((16, IC)).astype(np.float32)
    got = grouped(x, stack, offsets)
    few = round_trip(x[:4], "q8_0").astype(np.float64) @ deq[0].T
    many = bf16(x[4:]).astype(np.float64) @ bf16(deq[2]).astype(np.float64).T
    scale = np.abs(x).max() * np.abs(deq).sum(axis=2).max()
    assert np.abs(got[:4] - few).max() <= 1e-6 * scale
    assert np.abs(got[4:] - many).max() <= 1e-6 * scale


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_grouped_kernel_thread_invariant(rng, set_threads, path, qtype):
    w = rng.standard_normal((8, 45, 96)).astype(np.float32)
    stack = QuantizedExperts.quantize(w, qtype, "w")
    offsets = offsets_of([1, 2, 0, 1, 2, 1, 0, 12])
    x = rng.standard_normal((offsets[-1], 96)).astype(np.float32)
    grouped(x, stack, offsets, path)   # skips a path this CPU lacks
    assert_thread_invariant(set_threads, lambda: {"out": grouped(x, stack, offsets, path)})


@pytest.mark.parametrize("isa", llmc_py.supported_isas())
def test_grouped_kernel_follows_the_chosen_isa(rng, use_isa, isa):
    """Under every instruction set: the few-row experts give the portable
    path's bits, the many-row one the panel path's on that instruction set
    (the bf16 GEMM's)."""
    w = rng.standard_normal((3, 9, 64)).astype(np.float32)
    stack = QuantizedExperts.quantize(w, "q4_0", "w")
    offsets = offsets_of([2, 3, 11])
    x = rng.standard_normal((16, 64)).astype(np.float32)
    use_isa(isa)
    got = grouped(x, stack, offsets)
    np.testing.assert_array_equal(got[:5], grouped(x, stack, offsets, "portable")[:5])
    np.testing.assert_array_equal(got, per_expert(x, w, offsets, "q4_0"))


def test_grouped_kernel_refuses_bad_offsets_and_shapes(rng):
    w = rng.standard_normal((2, 8, 64)).astype(np.float32)
    stack = QuantizedExperts.quantize(w, "q8_0", "w")
    x = rng.standard_normal((5, 64)).astype(np.float32)
    out = np.empty((5, 8), np.float32)
    q8 = K.QUANT_TYPES["q8_0"]
    for bad in ([0, 3, 4], [0, 4, 2], [1, 2, 5]):   # not ending at R, stepping back, not from 0
        with pytest.raises(RangeError):
            K.moe_grouped_forward_quant(out, x, stack.packed, np.array(bad, np.int32), q8, 8)
    with pytest.raises(ShapeError, match="weight"):   # three experts' offsets, two experts' rows
        K.moe_grouped_forward_quant(out, x, stack.packed, np.array([0, 1, 2, 5], np.int32),
                                    q8, 8)
    with pytest.raises(ShapeError, match="not a multiple of 32"):
        K.moe_grouped_forward_quant(np.empty((5, 8), np.float32),
                                    rng.standard_normal((5, 48)).astype(np.float32),
                                    stack.packed, np.array([0, 2, 5], np.int32), q8, 8)
    with pytest.raises(ValueError, match="unknown quantisation type"):
        K.moe_grouped_forward_quant(out, x, stack.packed, np.array([0, 2, 5], np.int32), 3, 8)


def test_quantized_experts_hold_gguf_blocks(rng):
    """blocks: [E, OC, bytes] as gguf.quants.quantize gives the stack."""
    w = rng.standard_normal((3, 5, 96)).astype(np.float32)
    for qtype in QTYPES:
        stack = QuantizedExperts.quantize(w, qtype, "w")
        kind = gguf.GGMLQuantizationType[qtype.upper()]
        np.testing.assert_array_equal(stack.blocks, gguf.quants.quantize(w, kind))
        assert stack.nbytes == stack.blocks.nbytes == w.size // 32 * (34 if qtype == "q8_0"
                                                                      else 18)
        one = QuantizedExperts.zeros(w.shape, qtype, "w")
        for e in range(3):
            one.put_expert(e, w[e])
        np.testing.assert_array_equal(one.packed, stack.packed)


# ---- the model -------------------------------------------------------------------

def reference(name, qtype, monkeypatch, many=False):
    """The float32 model with every quantized weight replaced by its
    dequantised blocks (qtype, the embedding's and head's too), its products in float64 on the operands
    the kernels see: Q8_0 input rows for few rows, bf16 inputs and weights
    for more (the panel path), per expert by its row count in the grouped
    products; the routers float32 on unquantized inputs, as the quantized
    model keeps them."""
    model = make(name)
    p, c = model.params, model.config
    for n in LINEARS + STACKS:
        if n in p:
            p[n][...] = round_trip(p[n].reshape(-1, p[n].shape[-1]), qtype).reshape(p[n].shape)
    for n in ("wte",) if c.tied_embeddings else ("wte", "lm_head"):
        p[n][...] = round_trip(p[n], qtype)

    def product(x, weight):
        x = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        if len(x) > FEW_ROWS:
            return bf16(x).astype(np.float64) @ bf16(weight).astype(np.float64).T
        return round_trip(x, "q8_0").astype(np.float64) @ weight.astype(np.float64).T

    def matmul(out, inp, weight, bias):
        assert bias is None
        if weight.shape == (c.num_experts, c.C):   # a router
            K.matmul_forward(out, inp, weight, None)
            return
        out[...] = product(inp, weight).reshape(out.shape)

    def experts(out, inp, weight, offsets):
        for e in range(len(weight)):
            rows = slice(offsets[e], offsets[e + 1])
            if offsets[e + 1] > offsets[e]:
                out[rows] = product(inp[rows], weight[e])

    model._matmul_forward = matmul
    monkeypatch.setattr(blocks_mod, "_grouped_forward", lambda weight: experts)
    return model


def logits(model, x):
    model.forward(x)
    return model.logits[..., :V].copy()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("B,T", [(1, 4), (2, 4), (2, 9)], ids=["decode-1", "decode-2", "prefill"])
def test_logits_equal_the_reference_of_the_same_arithmetic(monkeypatch, name, qtype, B, T):
    """Few rows (each expert's few rows by the decoding kernel) within
    test_quantized_model's bound for the decoding kernel (1e-3 of the largest
    logit: an activation on a rounding boundary may move one Q8_0 step);
    prefill's mix of few-row and panel experts within the same."""
    model = make(name)
    model.quantize(qtype)
    x = tokens(B, T)
    got = logits(model, x)
    want = logits(reference(name, qtype, monkeypatch), x)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_the_quantized_model_is_near_its_float32_model(name, qtype):
    """Against the unquantized float32 model: test_gguf's bounds of these
    formats' logits (q8_0 3.5e-2, q4_0 0.43 of the largest)."""
    x = tokens(2, 5)
    want = logits(make(name), x)
    model = make(name)
    model.quantize(qtype)
    bound = {"q8_0": 3.5e-2, "q4_0": 0.43}[qtype]
    assert np.abs(logits(model, x) - want).max() <= bound * np.abs(want).max()


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_kv_cache_decoding_equals_its_own_full_forward(name, qtype):
    model = make(name)
    model.quantize(qtype)
    prompt = [3, 14, 15, 9, 2]
    new = model.generate(prompt, 10, temperature=0)
    seq = list(prompt)
    for _ in range(10):   # greedy by full forwards of the quantized model
        model.forward(np.array([seq]))
        seq.append(int(np.argmax(model.logits[0, -1, :V])))
    assert new == seq[len(prompt):]


@pytest.mark.parametrize("name", CONFIGS)
def test_decoding_does_not_depend_on_thread_count(set_threads, name):
    model = make(name)
    model.quantize("q4_0")

    def run():
        out = model.generate([[3, 14, 15], [9, 2]], 6, temperature=0)
        return {"tokens": np.array(out), "logits": logits(model, tokens(2, 6))}

    assert_thread_invariant(set_threads, run)


def test_a_quantized_bf16_moe_model_releases_its_bf16_copy():
    """Its experts quantized from the float32 master; its attention's
    products stay bf16 (as a dense bf16 model's do when quantized): near
    the fp32 model quantized, within test_gguf_moe's 3e-2 for bf16's
    arithmetic."""
    x = tokens(1, 4)
    want = make("mixtral")
    want.quantize("q8_0")
    model = Llama(CONFIGS["mixtral"], seed=1, precision="bf16")
    model.quantize("q8_0")
    assert model.params_bf16 is None
    for n in STACKS:
        for got, same in zip(model._weights[n], want._weights[n]):
            assert np.array_equal(got.packed, same.packed)
    want = logits(want, x)
    assert np.abs(logits(model, x) - want).max() <= 3e-2 * np.abs(want).max()


@pytest.mark.parametrize("name", CONFIGS)
def test_float32_experts_are_released_and_planned(name):
    model = make(name)
    c = model.config
    shapes = dict(model.params.shapes)
    model.quantize("q4_0", head="q8_0")
    for n in STACKS:
        assert n not in model.params
        for m, stack in enumerate(model._weights[n]):
            assert stack.shape == shapes[n][1:] and stack.qtype == "q4_0"
            assert stack.nbytes * 32 == 18 * np.prod(shapes[n][1:])
    # the routers stay float32
    assert model.params.routerw.shape == shapes["routerw"]
    assert model.params.routerw.dtype == np.float32
    plan = model.memory_plan(1, 8, training=False)
    held = sum(w.nbytes for n in LINEARS + STACKS if n in shapes for w in model._weights[n])
    assert plan["parameters (q4_0)"] == held
    tables = [model._weights.wte] + ([] if c.tied_embeddings else [model._weights.lm_head])
    assert plan["parameters (q8_0)"] == sum(table.nbytes for table in tables)
    assert plan["parameters"] == model.params.memory.nbytes


@pytest.mark.parametrize("qtype", QTYPES)
def test_summary_plans_qwen3_30b_a3b_quantized(tmp_path, capsys, qtype):
    """summary --base-weights: Qwen3-30B-A3B's linear layers and 128 experts
    a layer in qtype's bytes (without allocating them), the routers float32."""
    import math
    from llmc_py import summary
    from llmc_py.model.layout import param_specs
    from test_moe_config import QWEN3_30B_A3B, write_config
    folder = write_config(tmp_path / "hub", **QWEN3_30B_A3B)
    config = summary.load_config(folder)
    shapes = {name: fn(config) for name, fn in param_specs(config)}
    held = sum(math.prod(shapes[n]) for n in LINEARS + STACKS if n in shapes)
    assert held > 29e9   # the experts are most of the 30.5B
    assert summary.main([str(folder), "-b", "1", "-t", "512", "--base-weights", qtype]) == 0
    out = capsys.readouterr().out
    tables = math.prod(shapes["wte"]) + math.prod(shapes["lm_head"])   # in qtype too
    want = {qtype: (held + tables) // 32 * {"q8_0": 34, "q4_0": 18}[qtype]}
    for kind, nbytes in want.items():
        line = next(line for line in out.splitlines() if f"parameters ({kind})" in line)
        assert line.split()[-2:] == summary.format_bytes(nbytes).split()
    floats = sum(math.prod(s) for n, s in shapes.items()
                 if n not in LINEARS + STACKS + ("wte", "lm_head"))
    line = next(line for line in out.splitlines() if line.split()[:2] == ["parameters", "-"])
    assert line.split()[-2:] == summary.format_bytes(4 * floats).split()


def test_bad_experts_are_named():
    model = make("mixtral")
    c = model.config
    with pytest.raises(ShapeError, match=r"blk.0.ffn_gate_exps: quantized experts of shape "
                       r"\[3, 64, 64\] .*expected \[4, 64, 64\] for expertfcw\[0\]"):
        wrong = Llama(c, weights="q8_0")
        wrong.put_quantized("expertfcw", 0, QuantizedExperts.quantize(
            np.ones((3, 2 * c.expert_hidden, c.C), np.float32), "q8_0", "blk.0.ffn_gate_exps"))
    odd = Llama(dataclasses.replace(c, expert_hidden=48), seed=1)
    with pytest.raises(ShapeError, match=r"expertprojw\[0\].*48.*not a multiple of 32"):
        odd.quantize("q8_0")
    with pytest.raises(ShapeError, match=r"expertprojw\[0\].*48.*not a multiple of 32"):
        Llama(odd.config, weights="q4_0")


# ---- GGUF files and the CLI ---------------------------------------------------------

# what llama.cpp's qwen3moe runs: experts in every layer, top-k renormalised
GGUF_READY = {"mixtral": CONFIGS["mixtral"],
              "qwen3-moe": dataclasses.replace(CONFIGS["qwen3-moe-dense-between"], moe_every=1,
                                               num_layers=2)}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("name", GGUF_READY)
def test_a_gguf_file_keeps_its_expert_blocks(tmp_path, monkeypatch, name, qtype):
    """load_model(weights=qtype) of a qtype file: the experts (and the linear
    layers stored in qtype) are the file's bytes, never quantized again;
    the same model as the dequantised file quantized."""
    path = tmp_path / "moe.gguf"
    Llama(GGUF_READY[name], seed=4).save_gguf(path, dtype=qtype,
                                              tokenizer=write_tokenizer(tmp_path))
    want = load_model(path)
    want.quantize(qtype)
    made = []
    original = QuantizedExperts.quantize.__func__
    monkeypatch.setattr(QuantizedExperts, "quantize", classmethod(
        lambda cls, w, kind, n="experts": made.append(n) or original(cls, w, kind, n)))
    monkeypatch.setattr(QuantizedExperts, "put_expert", None)   # never expert by expert
    model = load_model(path, weights=qtype)
    assert made == []
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    for m, l in enumerate(model.config.moe_layers):
        gate_up = np.concatenate([stored[f"blk.{l}.ffn_gate_exps.weight"],
                                  stored[f"blk.{l}.ffn_up_exps.weight"]], axis=1)
        np.testing.assert_array_equal(model._weights["expertfcw"][m].blocks, gate_up)
        np.testing.assert_array_equal(model._weights["expertprojw"][m].blocks,
                                      stored[f"blk.{l}.ffn_down_exps.weight"])
        np.testing.assert_array_equal(model.params.routerw[m],
                                      stored[f"blk.{l}.ffn_gate_inp.weight"])
    for n in STACKS:
        for got, same in zip(model._weights[n], want._weights[n]):
            assert np.array_equal(got.blocks, same.blocks)
    x = tokens(2, 7)
    assert np.array_equal(logits(model, x), logits(want, x))


def test_a_quantized_load_names_a_wrong_expert_stack(tmp_path):
    """A q8_0 file whose ffn_down_exps holds 3 experts of 4."""
    from llmc_py import CheckpointError
    from test_gguf import rewrite
    path = tmp_path / "moe.gguf"
    Llama(GGUF_READY["mixtral"], seed=4).save_gguf(path, dtype="q8_0",
                                                   tokenizer=write_tokenizer(tmp_path))

    def three(name, data, kind):
        return (data[:3], kind, None) if name == "blk.1.ffn_down_exps.weight" else (data, kind,
                                                                                     None)
    bad = rewrite(path, tmp_path / "three.gguf", tensor=three)
    with pytest.raises(CheckpointError, match=r"blk.1.ffn_down_exps.weight has shape "
                                              r"\[3, 64, 32\], expected \[4, 64, 32\]"):
        load_model(bad, weights="q8_0")


def test_sample_takes_weights_on_experts(tmp_path, capsys):
    from llmc_py import sample
    path = tmp_path / "moe.bin"
    make("qwen3-moe-dense-between").save_checkpoint(path)
    folder = write_tokenizer(tmp_path)
    args = ["-e", str(path), "--tokenizer", str(folder), "--prompt", "ab", "-g", "6",
            "--temperature", "0", "--stop-at-eot", "0", "--weights", "q4_0"]
    model, _ = sample.load(sample.parse(args))
    assert model.quantized == "q4_0" and model._weights["expertfcw"][0].qtype == "q4_0"
    assert sample.main(args) == 0
    assert capsys.readouterr().out
