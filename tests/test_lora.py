"""LoRA (model.lora, io.peft) against peft on tiny random transformers
models (test_hf's: GPT-2 with its Conv1D layout, a Llama with GQA and an
untied head, a Qwen3 with QK-norm), saved by transformers and loaded here:
the same A and B copied into peft's get_peft_model, then logits, loss,
every adapter gradient, three AdamW steps against torch.optim.AdamW, PEFT
folders both ways and merging; the options (rsLoRA, some targets, rank 1,
LoRA dropout, recompute, bf16), thread invariance, and every refusal.

Tolerances (fp32 both sides, summed in different orders): logits within
1e-5 of the largest logit, the loss 1e-6 relative, gradients 2e-5 of their
tensor's largest entry (as test_hf), the adapters after three AdamW steps
1e-5 of the largest (their change is ~3e-3). bf16 base (its linear layers
and the adapters' products round their operands to bf16, the adapters stay
float32): against the fp32 model, the logits within 2e-2 of the largest and
each adapter gradient within 5e-2 of its largest entry (bf16 keeps 8 bits);
the adapters' bf16 products against float64 sums of the same rounded
operands within 1e-4 of the largest entry."""
import copy
import json

import numpy as np
import pytest
import torch

import peft
from safetensors.numpy import load_file, save_file

import llmc_py
from llmc_py import CheckpointError, Dropout, UnsupportedError, load_model
from llmc_py._native import kernels as K
from llmc_py.io.hf import hf_tensors
from llmc_py.io.peft import _key, _tensors
from llmc_py.model.lora import adapter_parameters
from test_hf import V, batch, make_hf, rel_to_max

ALL_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
               "llama-gqa-untied": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]}
ALL_TARGETS["qwen3-qknorm-tied"] = ALL_TARGETS["llama-gqa-untied"]
ADAMW = dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def save_hf(name, tmp_path_factory):
    """(name, test_hf's transformers model ``name``, its save_pretrained folder)."""
    model, folder = make_hf(name), tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return name, model, folder


@pytest.fixture(scope="module", params=list(ALL_TARGETS))
def saved(request, tmp_path_factory):
    return save_hf(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_hf("llama-gqa-untied", tmp_path_factory)


def random_b(model, seed=0):
    """Gives every adapter a non-zero B (peft's, like ours, starts at zero)."""
    rng = np.random.default_rng(seed)
    for t in model.lora.targets:
        view = model.lora.params[t.name + ".B"]
        view[...] = rng.standard_normal(view.shape).astype(np.float32) * np.float32(0.05)


def with_lora(folder, rank=4, alpha=8, targets=None, seed=1, **options):
    model = load_model(folder, precision=options.pop("precision", "fp32"))
    model.add_lora(rank, alpha, targets=targets, seed=seed, **options)
    random_b(model, seed)
    return model


def peft_twin(name, hf, model, targets=None):
    """peft's model of ``hf`` with ``model``'s adapters copied in; and
    {peft's saved name: its parameter}."""
    lora = model.lora
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                             target_modules=targets or ALL_TARGETS[name],
                             use_rslora=lora.rslora, task_type="CAUSAL_LM",
                             fan_in_fan_out=name == "gpt2")
    twin = peft.get_peft_model(copy.deepcopy(hf), config)
    trained = {n.replace(".default", ""): p for n, p in twin.named_parameters()
               if p.requires_grad}
    ours = _tensors(lora)
    assert set(trained) == set(ours)
    with torch.no_grad():
        for n, p in trained.items():
            p.copy_(torch.from_numpy(ours[n]))
    return twin, trained


def torch_loss(twin, x, y):
    logits = twin(torch.tensor(x)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.tensor(y).reshape(-1))
    return logits, loss


def adapter_grads(model):
    """{peft's saved name: our gradient}."""
    lora, out = model.lora, {}
    for t in lora.targets:
        for l in range(model.config.L):
            out[_key(model.config, t, l, "lora_A")] = lora.grads[t.name + ".A"][l]
            out[_key(model.config, t, l, "lora_B")] = lora.grads[t.name + ".B"][l]
    return out


def assert_step_matches(model, twin, trained, dropout=None):
    """Logits, loss and every adapter gradient of ``model`` (a pass with
    ``dropout``) as those of ``twin``, peft's, with its ``trained`` parameters."""
    x, y = batch()
    model.zero_grad()
    loss = model.forward(x, y, dropout=dropout)
    logits = model.logits[..., :V].copy()
    model.backward()
    ref_logits, ref_loss = torch_loss(twin, x, y)
    ref_loss.backward()
    assert rel_to_max(logits, ref_logits.detach().numpy()) < 1e-5
    assert abs(loss - ref_loss.item()) < 1e-6 * ref_loss.item()
    for n, grad in adapter_grads(model).items():
        assert rel_to_max(grad, trained[n].grad.numpy()) < 2e-5, n
    return logits


def assert_matches_peft(name, hf, model, targets=None):
    """A step of ``model`` as peft's with the same adapters; peft's model."""
    twin, trained = peft_twin(name, hf, model, targets)
    assert_step_matches(model, twin, trained)
    return twin


def assert_same_logits(model, twin, x):
    """``model``'s logits of ``x`` as ``twin``'s (a torch model)."""
    model.forward(x)
    with torch.no_grad():
        ref = twin(torch.tensor(x)).logits.numpy()
    assert rel_to_max(model.logits[..., :V], ref) < 1e-5


def test_logits_gradients_and_adamw_match_peft_and_the_base_never_changes(saved):
    name, hf, folder = saved
    model = with_lora(folder)
    base = model.params.memory.copy()
    twin = assert_matches_peft(name, hf, model)
    trained = [p for p in twin.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=ADAMW["learning_rate"],
                                  betas=(ADAMW["beta1"], ADAMW["beta2"]), eps=ADAMW["eps"],
                                  weight_decay=ADAMW["weight_decay"])
    for step in (1, 2, 3):
        x, y = batch(seed=step)
        model.zero_grad()
        model.forward_backward(x, y)
        model.update(t=step, **ADAMW)
        optimizer.zero_grad()
        torch_loss(twin, x, y)[1].backward()
        optimizer.step()
    ref = {n.replace(".default", ""): p.detach().numpy()
           for n, p in twin.named_parameters() if p.requires_grad}
    for n, ours in _tensors(model.lora).items():
        assert rel_to_max(ours, ref[n]) < 1e-5, n
    assert np.array_equal(model.params.memory, base)
    assert model._grads is None   # the base never had gradients


def test_initialisation_is_peft_s(llama):
    """A: torch's kaiming_uniform_(a=sqrt(5)) bounds, drawn from the seed; B: zero."""
    model = load_model(llama[2])
    model.add_lora(8, 16, seed=3)
    for t in model.lora.targets:
        A = model.lora.params[t.name + ".A"]
        gain = torch.nn.init.calculate_gain("leaky_relu", 5 ** 0.5)
        bound = 3 ** 0.5 * gain / t.in_features ** 0.5
        assert 0.9 * bound < np.abs(A).max() <= bound, t.name
        assert not model.lora.params[t.name + ".B"].any()
    again = load_model(llama[2])
    again.add_lora(8, 16, seed=3)
    assert np.array_equal(again.lora.params.memory, model.lora.params.memory)
    other = load_model(llama[2])
    other.add_lora(8, 16, seed=4)
    assert not np.array_equal(other.lora.params.memory, model.lora.params.memory)


def test_the_frozen_base_gets_no_weight_gradient_products(saved):
    model = with_lora(saved[2])
    calls, matmul_backward = [], model._matmul_backward

    def spy(dinp, dweight, dbias, *rest, **written):
        calls.append((dinp is not None, dweight, dbias))
        return matmul_backward(dinp, dweight, dbias, *rest, **written)
    model._matmul_backward = spy   # the base's linear layers and head
    model.forward_backward(*batch())
    # the head's input gradient and each layer's four, but the first layer's
    # qkv: d(its input) would only reach the frozen embedding
    assert len(calls) == 4 * model.config.L
    assert all(dinp and dweight is None and dbias is None for dinp, dweight, dbias in calls)


def test_zero_grad_grad_norm_and_clipping_act_on_the_adapters(llama):
    model = with_lora(llama[2])
    grads = model.lora.grads.memory
    model.zero_grad()
    model.forward_backward(*batch())
    norm = model.grad_norm()
    assert norm == pytest.approx(np.linalg.norm(grads.astype(np.float64)), rel=1e-6)
    before = grads.copy()
    assert model.clip_grad_norm(norm / 4) == norm
    np.testing.assert_allclose(grads, before / 4, rtol=1e-6)
    model.zero_grad()
    assert not grads.any() and model._grads is None
    with pytest.raises(RuntimeError, match="model.grads: the base is frozen"):
        model.grads   # noqa: B018


def test_save_lora_loads_in_peft_with_our_logits(saved, tmp_path):
    _, hf, folder = saved
    model = with_lora(folder)
    model.save_lora(tmp_path / "adapter")
    twin = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter").eval()
    assert_same_logits(model, twin, batch()[0])
    # decoding with a KV cache goes through the adapters too
    prompt = [5, 17, 200, 3, 99]
    ours = model.generate(prompt, 8, temperature=0)
    assert ours == twin.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8,
                                 do_sample=False, min_new_tokens=8)[0, len(prompt):].tolist()


def test_save_lora_then_load_lora_gives_the_same_adapters(llama, tmp_path):
    model = with_lora(llama[2], 2, 3, ["v_proj", "gate_proj"], rslora=True, dropout=0.05)
    model.save_lora(tmp_path)
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {k: raw[k] for k in ("r", "lora_alpha", "lora_dropout", "use_rslora",
                                "target_modules", "task_type")} == dict(
        r=2, lora_alpha=3, lora_dropout=0.05, use_rslora=True,
        target_modules=["v_proj", "gate_proj"], task_type="CAUSAL_LM")
    again = load_model(llama[2])
    again.load_lora(tmp_path)
    lora = again.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.scale) == (2, 3, 0.05, 3 / 2 ** 0.5)
    assert np.array_equal(lora.params.memory, model.lora.params.memory)


def test_peft_adapters_load_with_peft_logits(saved, tmp_path):
    name, hf, folder = saved
    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=ALL_TARGETS[name],
                             task_type="CAUSAL_LM", fan_in_fan_out=name == "gpt2")
    torch.manual_seed(0)
    twin = peft.get_peft_model(copy.deepcopy(hf), config)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    twin.save_pretrained(tmp_path / "adapter")
    model = load_model(folder)
    model.load_lora(tmp_path / "adapter")
    assert model.lora.rank == 3 and model.lora.scale == 5 / 3
    assert_same_logits(model, twin, batch()[0])


def test_merge_lora_equals_peft_merge_and_unload(saved, tmp_path):
    name, hf, folder = saved
    model = with_lora(folder)
    twin, _ = peft_twin(name, hf, model)
    merged = twin.merge_and_unload()
    model.merge_lora()
    assert model.lora is None
    ours = hf_tensors(model.config, model.params.memory)
    ref = {n: p.detach().numpy() for n, p in merged.named_parameters()}
    for n, tensor in ours.items():
        assert rel_to_max(tensor, ref[n]) < 1e-6, n
    # the merged model saves as a plain one
    model.save_pretrained(tmp_path / "merged")
    assert rel_to_max(load_model(tmp_path / "merged").params.memory, model.params.memory) == 0


@pytest.mark.parametrize("rank, alpha, targets, rslora", [
    (1, 2, ["q_proj", "v_proj"], False),                   # rank 1, peft's default targets
    (4, 16, ["k_proj", "o_proj", "down_proj"], True),      # rsLoRA: alpha / sqrt(r)
    (2, 3, ["self_attn.q_proj", "mlp.up_proj"], False),    # dotted suffixes, as peft matches
])
def test_options_match_peft(llama, rank, alpha, targets, rslora):
    name, hf, folder = llama
    model = with_lora(folder, rank, alpha, targets, rslora=rslora)
    assert model.lora.scale == (alpha / rank ** 0.5 if rslora else alpha / rank)
    assert_matches_peft(name, hf, model, targets)


@pytest.mark.parametrize("targets", [["c_proj"], ["attn.c_proj", "c_fc"]])
def test_gpt2_target_subsets_match_peft(tmp_path, targets):
    make_hf("gpt2").save_pretrained(tmp_path)
    model = with_lora(tmp_path, 2, 4, targets)
    expected = {"c_proj": {"attn.c_proj", "mlp.c_proj"}}.get(targets[0], set(targets))
    assert {t.name for t in model.lora.targets} == expected
    assert_matches_peft("gpt2", make_hf("gpt2"), model, targets)


class MaskedDropout(torch.nn.Module):
    """peft's lora_dropout replaced by a fixed mask (already scaled by 1/(1-p))."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return x * self.mask


def test_lora_dropout_drops_each_adapters_input_with_its_own_masks(llama):
    name, hf, folder = llama
    p = 0.25
    model = with_lora(folder, dropout=p)
    twin, trained = peft_twin(name, hf, model)
    x, _ = batch()
    dropout = Dropout(seed=7)
    modules = dict(twin.named_modules())
    prefix = "base_model.model.model.layers.{l}."
    for index, t in enumerate(model.lora.targets):
        for l in range(model.config.L):
            ones = np.ones((*x.shape, t.in_features), np.float32)
            K.dropout_forward(ones, ones, *dropout.adapter_site(p, l, index))
            layer = modules[prefix.format(l=l) + t.module]
            layer.lora_dropout["default"] = MaskedDropout(torch.from_numpy(ones))
    dropped = assert_step_matches(model, twin, trained, dropout)
    # a pass given no Dropout (evaluation) never drops
    for module in modules.values():
        if hasattr(module, "lora_dropout"):
            module.lora_dropout["default"] = torch.nn.Identity()
    assert_same_logits(model, twin, x)
    assert not np.array_equal(model.logits[..., :V], dropped)


def step_results(model, dropout=None, steps=2):
    """Loss, logits, adapter gradients and parameters after ``steps`` steps."""
    results = {}
    for step in range(1, steps + 1):
        x, y = batch(seed=step)
        model.zero_grad()
        results[f"loss{step}"] = np.float64(model.forward(x, y, dropout=dropout))
        results[f"logits{step}"] = model.logits.copy()
        model.backward()
        results[f"grads{step}"] = model.lora.grads.memory.copy()
        model.update(t=step, **ADAMW)
    results["adapters"] = model.lora.params.memory.copy()
    return results


def test_recompute_gives_the_same_bits(saved):
    folder = saved[2]
    runs = []
    for recompute in (False, True):
        model = with_lora(folder, dropout=0.1)
        model.recompute = recompute
        runs.append(step_results(model, Dropout(residual=0.1, attention=0.1, seed=3)))
    for key, value in runs[0].items():
        assert np.array_equal(value, runs[1][key]), key


def test_results_do_not_depend_on_the_thread_count(saved, set_threads):
    folder = saved[2]
    for precision in ("fp32", "bf16"):   # bf16: the adapters' products bf16 too
        runs = []
        for threads in (1, 2, 3):
            set_threads(threads)
            model = with_lora(folder, dropout=0.1, precision=precision)
            runs.append(step_results(model, Dropout(residual=0.1, seed=3)))
        for other in runs[1:]:
            for key, value in runs[0].items():
                assert np.array_equal(value, other[key]), (precision, key)


def test_bf16_base_with_fp32_adapters(saved):
    folder = saved[2]
    # zero adapters add exactly nothing to the bf16 base's outputs
    plain = load_model(folder, precision="bf16")
    model = load_model(folder, precision="bf16")
    model.add_lora(4, 8)
    x, y = batch()
    plain.forward(x)
    model.forward(x)
    assert np.array_equal(plain.logits, model.logits)
    # non-zero adapters: the fp32 model's results within bf16's precision
    fp32, bf16 = with_lora(folder), with_lora(folder, precision="bf16")
    params, copy16 = bf16.params.memory.copy(), bf16.params_bf16.memory.copy()
    logits = []
    for model in (fp32, bf16):
        model.zero_grad()
        model.forward(x, y)
        logits.append(model.logits[..., :V].copy())
        model.backward()
    assert rel_to_max(logits[1], logits[0]) < 2e-2
    for n, grad in adapter_grads(bf16).items():
        assert rel_to_max(grad, adapter_grads(fp32)[n]) < 5e-2, n
    bf16.update(t=1, **ADAMW)
    assert bf16.lora.params.memory.dtype == np.float32
    assert np.array_equal(bf16.params.memory, params)
    assert np.array_equal(bf16.params_bf16.memory, copy16)


def test_bf16_merge_refreshes_the_bf16_copy(llama):
    folder = llama[2]
    model = with_lora(folder, precision="bf16")
    model.merge_lora()
    again = load_model(folder, precision="bf16")
    again.params.memory[...] = model.params.memory
    again.refresh_bf16()
    assert np.array_equal(again.params_bf16.memory, model.params_bf16.memory)


@pytest.mark.parametrize("choices", [dict(block="post"), dict(block="parallel"),
                                     dict(mlp="gelu", bias=True, norm="layernorm")])
def test_adapter_gradients_are_the_merged_models_weight_gradients(choices):
    """Blocks and choices no Hugging Face class has, so no peft: the merged
    model (W' = W + s B A) computes the same function, so dL/dB = s dW'[rows] A^T
    and dL/dA = s B^T dW'[rows], with dW' the merged model's weight gradient."""
    config = llmc_py.LlamaConfig(num_layers=2, channels=32, num_heads=4, num_kv_heads=2,
                                 vocab_size=64, padded_vocab_size=64, max_seq_len=16, **choices)
    model = llmc_py.Llama(config, seed=3)
    model.add_lora(3, 6, seed=4)
    random_b(model)
    merged = llmc_py.Llama(config, params=model.params.memory.copy())
    merged.add_lora(3, 6)
    merged.lora.params.memory[...] = model.lora.params.memory
    merged.merge_lora()
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 64, (2, 11)), rng.integers(0, 64, (2, 11))
    losses = []
    for m in (model, merged):
        m.zero_grad()
        losses.append(m.forward_backward(x, y))
    assert abs(losses[0] - losses[1]) < 1e-6 * losses[1]
    lora, s = model.lora, np.float32(model.lora.scale)
    for t in lora.targets:
        for l in range(config.L):
            dW = merged.grads[t.linear + "w"][l][t.rows]
            A, B = lora.params[t.name + ".A"][l], lora.params[t.name + ".B"][l]
            assert rel_to_max(lora.grads[t.name + ".B"][l], s * dW @ A.T) < 1e-4, t.name
            assert rel_to_max(lora.grads[t.name + ".A"][l], s * B.T @ dW) < 1e-4, t.name


# ---- refusals: one clear error, nothing changed --------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=4, alpha=8, targets=["c_attn"]), "no module 'c_attn'"),
    (dict(rank=4, alpha=8, targets=["lm_head"]), "no module 'lm_head'"),
    (dict(rank=4, alpha=8, targets=[]), "at least one"),
    (dict(rank=0, alpha=8), "rank 0 is outside"),
    (dict(rank=49, alpha=8, targets=["k_proj"]),
     r"rank 49 is outside \[1, 32\]: k_proj is 32 x 64"),
    (dict(rank=2.0, alpha=8), "rank must be an int"),
    (dict(rank=4, alpha=0), "alpha must be a positive number"),
    (dict(rank=4, alpha=float("nan")), "alpha must be a positive number"),
    (dict(rank=4, alpha=8, dropout=1.0), r"dropout is a probability in \[0, 1\)"),
    (dict(rank=4, alpha=8, dropout=-0.1), "dropout is a probability"),
])
def test_bad_add_lora_arguments_are_refused(llama, kwargs, message):
    model = load_model(llama[2])
    before = model.params.memory.copy()
    with pytest.raises(ValueError, match=message):
        model.add_lora(**kwargs)
    assert model.lora is None and np.array_equal(model.params.memory, before)


def test_what_needs_adapters_or_none_is_refused(llama, tmp_path):
    model = load_model(llama[2])
    for call in (model.merge_lora, lambda: model.save_lora(tmp_path / "a")):
        with pytest.raises(RuntimeError, match="no LoRA adapters; add_lora or load_lora first"):
            call()
    model.add_lora(2, 4)
    adapters = model.lora.params.memory.copy()
    for call in (lambda: model.add_lora(2, 4), lambda: model.load_lora(tmp_path),
                 lambda: model.save_checkpoint(tmp_path / "m.bin"),
                 lambda: model.save_pretrained(tmp_path / "hf")):
        with pytest.raises(RuntimeError, match="has LoRA adapters already .rank 2 on q_proj"):
            call()
    assert np.array_equal(model.lora.params.memory, adapters)
    assert not (tmp_path / "m.bin").exists() and not (tmp_path / "hf").exists()


@pytest.fixture
def adapter(llama, tmp_path):
    """A PEFT folder of ours for the llama."""
    model = with_lora(llama[2], 2, 4, ["q_proj", "down_proj"])
    model.save_lora(tmp_path / "adapter")
    return tmp_path / "adapter"


def edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("field, value", [
    ("use_dora", True), ("bias", "all"), ("bias", "lora_only"), ("modules_to_save", ["lm_head"]),
    ("task_type", "SEQ_CLS"), ("layers_to_transform", [0]), ("rank_pattern", {"q_proj": 4}),
    ("alpha_pattern", {"q_proj": 2}), ("lora_bias", True), ("peft_type", "IA3"),
    ("target_modules", ".*q_proj"),
])
def test_unsupported_peft_options_are_named(llama, adapter, field, value):
    edit_config(adapter, **{field: value})
    model = load_model(llama[2])
    with pytest.raises(UnsupportedError, match=f"adapter_config.json: {field} is"):
        model.load_lora(adapter)
    assert model.lora is None


def test_an_adapter_whose_shapes_do_not_match_names_the_tensor(llama, adapter):
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors[name] = np.zeros((2, 95), np.float32)
    save_file(tensors, adapter / "adapter_model.safetensors")
    model = load_model(llama[2])
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \(2, 95\); this "
                                              rf"model's is \(2, 96\)"):
        model.load_lora(adapter)
    assert model.lora is None


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"),
     "tensor base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight is missing"),
    (lambda t: t.update({"base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight":
                         np.zeros((2, 64), np.float32)}),
     "v_proj.lora_A.weight adapts nothing in this model"),
])
def test_missing_and_unknown_tensors_are_named(llama, adapter, edit, message):
    tensors = load_file(adapter / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, adapter / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_model(llama[2]).load_lora(adapter)


@pytest.mark.parametrize("changes, message", [
    (dict(r=0), "rank 0 is outside"),
    (dict(target_modules=["embed_tokens"]), "targets: this model has no module 'embed_tokens'"),
    (dict(lora_alpha="8"), "alpha must be a positive number"),
])
def test_bad_peft_config_values_are_named(llama, adapter, changes, message):
    edit_config(adapter, **changes)
    with pytest.raises(CheckpointError, match=f"adapter_config.json: {message}"):
        load_model(llama[2]).load_lora(adapter)


def test_a_model_no_hugging_face_class_holds_has_no_peft_folder(tmp_path):
    config = llmc_py.LlamaConfig(num_layers=1, channels=32, num_heads=2, num_kv_heads=2,
                                 vocab_size=64, padded_vocab_size=64, max_seq_len=16,
                                 block="post")
    model = llmc_py.Llama(config)
    model.add_lora(2, 4)   # our own layers take adapters all the same
    with pytest.raises(UnsupportedError, match="block='post'"):
        model.save_lora(tmp_path / "a")


def test_the_memory_plan_counts_the_adapters_and_no_base_gradients(llama):
    model = with_lora(llama[2], 4, 8, ["q_proj", "down_proj"])
    count = adapter_parameters(model.config, 4, ["q_proj", "down_proj"])
    assert count == model.lora.params.size == 2 * 4 * ((64 + 64) + (96 + 64))
    B, T = 2, 9
    plan = model.memory_plan(B, T, training=True)
    full = load_model(llama[2]).memory_plan(B, T, training=True)
    assert plan["LoRA adapters"] == plan["parameter gradients"] == 4 * count
    assert plan["AdamW moments"] == 8 * count
    # x A^T of each layer's q and down adapters, kept from forward to backward
    assert plan["LoRA activations"] == 4 * model.config.L * B * T * 2 * 4
    adapters = ("LoRA adapters", "LoRA activations")
    assert {part: n for part, n in plan.items() if part not in adapters} == {
        **full, "parameter gradients": 4 * count, "AdamW moments": 8 * count}
    model.reserve(B, T, training=True)
    lora = model.lora
    assert model._grads is None and model.m_memory is None
    assert (lora.params.memory.nbytes, lora.grads.memory.nbytes,
            lora.m.nbytes + lora.v.nbytes, lora._kept_memory.nbytes) == (
        plan["LoRA adapters"], plan["parameter gradients"], plan["AdamW moments"],
        plan["LoRA activations"])
    # a forward that keeps one layer's activations keeps no x A^T
    assert "LoRA activations" not in model.memory_plan(B, T, training=False,
                                                       keep_activations=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_backward_reads_x_a_t_as_forward_kept_it(llama, monkeypatch, precision, p):
    """A training forward keeps every adapter's x A^T; backward reads it
    instead of multiplying again, with gradients bitwise those of the
    recomputed x A^T (as where none is kept: Lora._kept None)."""
    from llmc_py.model.lora import Lora
    x, y = batch()
    grads = []
    for keep in (True, False):
        model = with_lora(llama[2], 4, 8, dropout=p, precision=precision)
        rng = np.random.default_rng(3)
        model.lora.params.buffer[...] = rng.standard_normal(model.lora.params.size) * 0.1
        dropout = Dropout(seed=5) if p else None
        if not keep:
            monkeypatch.setattr(Lora, "_kept", lambda self, linear, l, inp: None)
        model.zero_grad()
        model.forward(x, y, dropout=dropout)
        downs = []
        monkeypatch.setattr(Lora, "_down", lambda self, *a, _down=Lora._down, **k: (
            downs.append(1), _down(self, *a, **k))[1])
        model.backward()
        monkeypatch.undo()
        assert len(downs) == (0 if keep else model.config.L * 4)
        grads.append(model.lora.grads.buffer.copy())
    assert np.array_equal(grads[0], grads[1])


@pytest.mark.parametrize("isa", llmc_py.supported_isas())
def test_bf16_adapter_products_round_as_the_bf16_layers_do(use_isa, isa):
    """A bf16 model's adapters (Lora.bf16) on every instruction set: each
    product's operands rounded to bf16 (x, A, scale B, x A^T, dout and its
    gradient), summed in float32, against float64 sums of the same rounded
    operands: within 1e-4 of the largest entry (float32 sums; rounding
    x A^T anew may move one of its entries by a bf16 step). The unrounded
    products differ by more than 1e-3: the rounding is there."""
    from llmc_py.config import LlamaConfig
    from llmc_py.io.files import from_bf16, to_bf16
    from llmc_py.model.dropout import NO_DROPOUT
    from llmc_py.model.lora import Lora
    use_isa(isa)
    config = LlamaConfig(vocab_size=64, padded_vocab_size=64, max_seq_len=16, num_layers=2,
                         channels=40, num_heads=4, num_kv_heads=2, ffn_hidden=56)
    lora = Lora(config, 3, 6, None, 0.0, False)
    lora.initialize(0)
    rng = np.random.default_rng(0)
    for t in lora.targets:
        view = lora.params[t.name + ".B"]
        view[...] = rng.standard_normal(view.shape).astype(np.float32)
    lora.bf16 = True
    l = 1

    def rounded(x, bf16):
        x = np.asarray(x, np.float32)
        return (from_bf16(to_bf16(x)) if bf16 else x).astype(np.float64)

    def rows(x, bf16):   # (B, T, n) as (B T, n), rounded as ``bf16`` says
        return rounded(x, bf16).reshape(-1, x.shape[-1])

    for linear, group in lora._by_linear.items():
        x = rng.standard_normal((2, 7, group[0][1].in_features)).astype(np.float32)
        width = lora._width[linear]
        out, dout = rng.standard_normal((2, 2, 7, width)).astype(np.float32)
        ours = dict(out=out.copy(), dinp=np.zeros_like(x))
        lora.forward(ours["out"], x, linear, l, NO_DROPOUT)
        lora.grads.memory[...] = 0.0
        lora.backward(ours["dinp"], dout, x, linear, l, NO_DROPOUT)
        for t in lora.targets:
            ours[t.name + ".A"] = lora.grads[t.name + ".A"][l].copy()
            ours[t.name + ".B"] = lora.grads[t.name + ".B"][l].copy()
        for bf16, check in ((True, lambda e: e < 1e-4), (False, lambda e: e > 1e-3)):
            A, up = rounded(lora._stacked_a(group, l), bf16), rounded(lora._up(group, l), bf16)
            h = (rounded(x, bf16) @ A.T).astype(np.float32)
            dh = (rounded(dout, bf16) @ up).astype(np.float32)
            dup = rows(dout, bf16).T @ rows(h, bf16)
            dA = rows(dh, bf16).T @ rows(x, bf16)
            ref = dict(out=out + rounded(h, bf16) @ up.T, dinp=rounded(dh, bf16) @ A)
            for j, (_, t) in enumerate(group):
                ref[t.name + ".A"] = dA[j * 3:(j + 1) * 3]
                ref[t.name + ".B"] = dup[t.rows, j * 3:(j + 1) * 3] * lora.scale
            errors = {name: rel_to_max(ours[name], ref[name]) for name in ref}
            assert all(check(e) for e in errors.values()), (linear, bf16, errors)
