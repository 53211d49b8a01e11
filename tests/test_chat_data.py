"""JSONL and chat data (data.chat, data.jsonl, prepare_jsonl): chats render
and tokenize as transformers' apply_chat_template does on the same folder (a
tiny tokenizer made here), the loss mask trains exactly the assistant's turns,
the loader turns the rest into IGNORE_INDEX, which adds no loss and no
gradient, and unusable lines are said with their numbers while the rest is
written."""
import json

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import llmc_py.data as D
import llmc_py.data.prepare as P
import llmc_py.tokenizer as tok
import model_reference as ref
from llmc_py import IGNORE_INDEX
from llmc_py.data.chat import ChatEncoder
from llmc_py.errors import DataError
from llmc_py.io.tokens import mask_path, read_mask, write_mask
from data_helpers import no_network, tiny_encoding  # noqa: F401
from test_gpt2_step import SMALL, check_against_reference, make_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
# ChatML over several lines, so that trim_blocks and lstrip_blocks matter
CHATML = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|im_start|>assistant\n' }}
{% endif %}
"""
# Llama 2's own template: bos_token and eos_token, and roles that must alternate
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}"
          "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
          "{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/"
          "assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + "
          "message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
# ChatML with transformers' {% generation %} marks: its assistant mask is ours
CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen3's, without tools: the turns after the last user query carry their
# reasoning (the last one at least an empty block), so an earlier turn reads
# otherwise once later ones follow
THINKING = """{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and ns.last_query_index == messages|length - 1 %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') +
                '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "chatml-marked": CHATML_MARKED,
             "thinking": THINKING}

CHATS = [
    [{"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "how are you?"}],
    [{"role": "system", "content": "you are a lazy dog"},
     {"role": "user", "content": "the quick brown fox"},
     {"role": "assistant", "content": " jumps over the lazy dog "},
     {"role": "user", "content": "and then? é ü 日本"},
     {"role": "assistant", "content": "hello, world", "thinking": "\nhow are you?"}],
    [{"role": "user", "content": "how are you?", "name": None},
     {"role": "assistant", "content": "quick\n\nbrown"}],
]


def make_tokenizer_folder(folder, template, *, config=None):
    """A byte-level BPE tokenizer.json learnt from a few sentences, with
    ChatML's and Llama 2's special tokens, and a tokenizer_config.json
    holding ``template``; with ``config`` a config.json too."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world, how are you?", "user assistant system",
                                   "the quick brown fox jumps over the lazy dog"] * 5, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
        "eos_token": {"content": "</s>", "__type": "AddedToken"}, "chat_template": template}))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: make_tokenizer_folder(root / name, template)
            for name, template in TEMPLATES.items()}


def hf_tokenizer(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return path


# ---- rendering and tokens, against transformers -------------------------------------

@pytest.mark.parametrize("template", ["chatml", "llama2", "chatml-marked", "thinking"])
def test_rendering_and_ids_equal_apply_chat_template(folders, template, monkeypatch):
    hf = hf_tokenizer(folders[template], monkeypatch)
    ours = ChatEncoder(folders[template])
    for chat in CHATS:
        for prompt in (False, True):
            text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert ours.render(chat, add_generation_prompt=prompt) == text
        ids, mask, _ = ours.encode(chat)
        assert ids.tolist() == hf.apply_chat_template(chat, tokenize=True)["input_ids"]
        assert mask.shape == ids.shape


def test_template_from_chat_template_jinja_first(folders, tmp_path, monkeypatch):
    """transformers reads chat_template.jinja before the config's template."""
    folder = make_tokenizer_folder(tmp_path / "f", LLAMA2)
    (folder / "chat_template.jinja").write_text(CHATML)
    hf = hf_tokenizer(folder, monkeypatch)
    assert ChatEncoder(folder).render(CHATS[0]) == hf.apply_chat_template(
        CHATS[0], tokenize=False) == ChatEncoder(folders["chatml"]).render(CHATS[0])


# ---- the loss mask --------------------------------------------------------------------

def trained_text(encoder, chat):
    ids, mask, untrained = encoder.encode(chat)
    runs, current = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [encoder._tokenizer.decode(r, skip_special_tokens=False) for r in runs], untrained


def test_mask_trains_the_assistant_content_and_end_of_turn(folders):
    chat = CHATS[1]
    texts, untrained = trained_text(ChatEncoder(folders["chatml"]), chat)
    # (this template writes a blank line after each message)
    assert texts == [" jumps over the lazy dog <|im_end|>\n\n", "hello, world<|im_end|>\n\n"]
    texts, untrained = trained_text(ChatEncoder(folders["llama2"]), chat)
    assert texts == [" jumps over the lazy dog </s>", " hello, world </s>"]
    assert untrained == 0


@pytest.mark.parametrize("chat", CHATS)
def test_mask_equals_transformers_assistant_mask(folders, chat, monkeypatch):
    """On a template with {% generation %} marks, transformers' own
    return_assistant_tokens_mask is the mask we find without them."""
    hf = hf_tokenizer(folders["chatml-marked"], monkeypatch)
    out = hf.apply_chat_template(chat, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    ids, mask, _ = ChatEncoder(folders["chatml-marked"]).encode(chat)
    assert ids.tolist() == out["input_ids"]
    assert mask.tolist() == out["assistant_masks"]


def test_a_turn_the_template_renders_otherwise_later_is_untrained(folders):
    texts, untrained = trained_text(ChatEncoder(folders["thinking"]), CHATS[1])
    # (the reasoning, given as "thinking", is the template's reasoning_content)
    assert texts == ["<think>\nhow are you?\n</think>\n\nhello, world<|im_end|>\n"]
    assert untrained == 1


def test_the_summary_counts_the_turns_left_untrained(folders, tmp_path, capsys):
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[1]}] * 10)
    P.prepare_jsonl(src, tmp_path / "out", tokenizer=folders["thinking"], chat=True)
    out = capsys.readouterr().out
    assert "10 records, 0 lines skipped" in out
    assert "10 assistant turns the template renders otherwise left untrained" in out


def test_mask_file_round_trip_and_refusals(tmp_path):
    path = tmp_path / "train.mask"
    write_mask(path, np.array([0, 1, 1, 0], dtype=np.uint8))
    assert read_mask(path).tolist() == [0, 1, 1, 0]
    assert mask_path(tmp_path / "train.bin") == path
    raw = bytearray(path.read_bytes())
    raw[-1] = 2
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="entry 3 is 2"):
        read_mask(path)
    path.write_bytes(bytes(raw[:-1]))
    with pytest.raises(DataError, match="ntok=4"):
        read_mask(path)
    with pytest.raises(DataError, match="0s and 1s"):
        write_mask(path, np.array([0, 3]))


# ---- preparing a file -------------------------------------------------------------------

def chat_lines(n):
    """``n`` chats of CHATS, some longer than others."""
    return [{"messages": CHATS[i % len(CHATS)]} for i in range(n)]


def prepared(out, name="chats"):
    train_path, val_path = D.dataset_paths(name, out)
    tokens = np.concatenate([D.read_tokens(val_path), D.read_tokens(train_path)])
    masks = [mask_path(p) for p in (val_path, train_path)]
    mask = np.concatenate([read_mask(p) for p in masks]) if masks[0].exists() else None
    return tokens, mask


def test_prepare_chats_writes_tokens_and_mask(folders, tmp_path, capsys):
    src = write_jsonl(tmp_path / "chats.jsonl", chat_lines(12))
    assert P.main(["--jsonl", str(src), "--tokenizer", str(folders["chatml"]), "--chat",
                   "--out", str(tmp_path / "out")]) == 0
    encoder = ChatEncoder(folders["chatml"])
    parts = [encoder.encode(line["messages"]) for line in chat_lines(12)]
    tokens, mask = prepared(tmp_path / "out")
    assert tokens.tolist() == np.concatenate([p[0] for p in parts]).tolist()
    assert mask.tolist() == np.concatenate([p[1] for p in parts]).tolist()
    out = capsys.readouterr().out
    assert "12 records, 0 lines skipped" in out and f"{int(mask.sum())} of" in out


def test_bad_lines_are_said_with_their_numbers_and_the_rest_is_written(folders, tmp_path,
                                                                       capsys):
    good = chat_lines(3)
    lines = [good[0],
             '{"messages": [ oops',                                                   # 2
             {"messages": [{"role": "user", "content": "hello"}]},                    # 3
             {"messages": [{"role": "robot", "content": "x"},
                           {"role": "assistant", "content": "y"}]},                   # 4
             good[1],
             {"text": "no messages"},                                                 # 6
             "",
             "[1, 2]",                                                                # 8
             {"messages": "hello"},                                                   # 9
             good[2],
             {"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}]  # 11
    src = write_jsonl(tmp_path / "mixed.jsonl", lines)
    with open(src, "ab") as f:
        f.write(b'{"messages": "\xff"}\n')                                              # 12
    out = tmp_path / "out"
    assert P.main(["--jsonl", str(src), "--tokenizer", str(folders["chatml"]), "--chat",
                   "--out", str(out), "--name", "chats"]) == 0
    captured = capsys.readouterr()
    said = captured.err.splitlines()
    assert [line.split(": skipped: ")[0] for line in said] == \
        [f"{src}:{n}" for n in (2, 3, 4, 6, 8, 9, 11, 12)]
    assert "not JSON" in said[0] and "no assistant turn" in said[1]
    assert "Unknown role: robot" in said[2] and 'no "messages" field' in said[3]
    assert "not a JSON object" in said[4] and '"messages" is a str, not a list' in said[5]
    assert "message 0 is not an object with a string role" in said[6]
    assert "not utf-8 (invalid start byte at byte 14)" in said[7]
    assert "3 records, 8 lines skipped" in captured.out
    encoder = ChatEncoder(folders["chatml"])
    tokens, mask = prepared(out)
    assert tokens.tolist() == np.concatenate([encoder.encode(g["messages"])[0]
                                              for g in good]).tolist()


def test_a_role_order_llama2_refuses_is_its_message(folders, tmp_path, capsys):
    lines = chat_lines(2) + [{"messages": [{"role": "assistant", "content": "x"},
                                           {"role": "user", "content": "y"}]}]
    src = write_jsonl(tmp_path / "c.jsonl", lines)
    assert P.main(["--jsonl", str(src), "--tokenizer", str(folders["llama2"]), "--chat",
                   "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err == (f"{src}:3: skipped: the chat template refuses it: "
                                       f"Conversation roles must alternate user/assistant/"
                                       f"user/assistant/...\n")


def test_a_file_with_no_usable_line_is_an_error(folders, tmp_path, capsys):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{", {"messages": []}])
    assert P.main(["--jsonl", str(src), "--tokenizer", str(folders["chatml"]), "--chat",
                   "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and err[-1] == (f"llmc_py.data: error: {src}: no record to prepare "
                                         f"(2 lines skipped)")
    assert not (tmp_path / "out").exists()


def test_plain_text_records_train_every_token_and_clear_an_old_mask(folders, tmp_path):
    folder = make_tokenizer_folder(tmp_path / "tok", CHATML, config={"bos_token_id": 3})
    out = tmp_path / "out"
    chats = write_jsonl(tmp_path / "data.jsonl", chat_lines(12))
    P.main(["--jsonl", str(chats), "--tokenizer", str(folder), "--chat", "--out", str(out)])
    texts = ["hello world", "the quick brown fox\n", "how are you?"] * 10
    src = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    assert P.main(["--jsonl", str(src), "--tokenizer", str(folder), "--out", str(out)]) == 0
    tokens, mask = prepared(out, "data")
    assert mask is None and not list(out.glob("data/*.mask"))
    hf = tok.load_tokenizer(folder)
    assert tokens.tolist() == [i for t in texts for i in [3] + hf.encode(t)]


def test_plain_text_records_with_gpt2s_encoding(tmp_path, monkeypatch):
    monkeypatch.setattr(tok, "get_encoding", tiny_encoding)
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}] * 20)
    assert P.main(["--jsonl", str(src), "--out", str(tmp_path / "out")]) == 0
    tokens, mask = prepared(tmp_path / "out", "t")
    enc = tiny_encoding()
    assert mask is None
    assert tokens.tolist() == ([enc.eot_token] + enc.encode("hello world")) * 20


def test_usage_errors(capsys):
    for argv in (["--jsonl", "x.jsonl", "--chat"], ["--jsonl", "x", "--text", "y"],
                 ["--jsonl", "x", "--split-blank-lines"], ["shakespeare", "--chat"]):
        with pytest.raises(SystemExit) as e:
            P.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_no_template_and_a_broken_one_are_one_line_errors(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", chat_lines(2))
    folder = make_tokenizer_folder(tmp_path / "none", None)
    broken = make_tokenizer_folder(tmp_path / "broken", "{% for m in messages %}")
    for bad, message in ((folder, "no chat template"), (broken, "does not compile")):
        assert P.main(["--jsonl", str(src), "--tokenizer", str(bad), "--chat",
                       "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_interrupted_preparation_leaves_no_temporary_and_no_whole_set(folders, tmp_path,
                                                                      monkeypatch, capsys):
    """Ctrl-C while train.bin's temporary file is written (the fifth rename:
    manifest, two masks, val.bin, train.bin)."""
    import llmc_py.io.files as files
    real, calls = files.os.replace, []

    def replace(*args):
        calls.append(args)
        if len(calls) == 5:
            raise KeyboardInterrupt
        real(*args)
    src = write_jsonl(tmp_path / "chats.jsonl", chat_lines(12))
    monkeypatch.setattr(files.os, "replace", replace)
    assert P.main(["--jsonl", str(src), "--tokenizer", str(folders["chatml"]), "--chat",
                   "--out", str(tmp_path / "out")]) == 130
    monkeypatch.undo()
    assert calls[-1][1].name == "train.bin"
    folder = tmp_path / "out" / "chats"
    assert sorted(p.name for p in folder.iterdir()) == \
        ["manifest.json", "train.mask", "val.bin", "val.mask"]
    with pytest.raises(DataError, match="did not finish"):
        D.DataLoader(str(folder / "val.bin"), 1, 4)
    capsys.readouterr()


# ---- training on it ---------------------------------------------------------------------

@pytest.fixture
def chat_data(folders, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", chat_lines(40))
    P.prepare_jsonl(src, tmp_path / "data", tokenizer=folders["chatml"], chat=True, quiet=True)
    return D.dataset_paths("chats", tmp_path / "data")


def test_the_loader_ignores_the_untrained_targets(chat_data):
    train_path, _ = chat_data
    tokens = D.read_tokens(train_path).astype(np.int32)
    mask = read_mask(mask_path(train_path))
    loader = D.DataLoader(str(train_path), 2, 16)
    for b in range(loader.num_batches):
        x, y = loader.next_batch()
        window = slice(b * 32 + 1, b * 32 + 33)
        expected = np.where(mask[window] == 1, tokens[window], IGNORE_INDEX).reshape(2, 16)
        assert np.array_equal(y, expected)
        assert np.array_equal(x.ravel(), tokens[b * 32:b * 32 + 32])
    assert (mask == 0).any() and (mask == 1).any()


def test_a_mask_of_another_length_is_refused(chat_data):
    train_path, _ = chat_data
    loader = D.DataLoader(str(train_path), 2, 16)
    write_mask(mask_path(train_path), np.ones(5, dtype=np.uint8))
    with pytest.raises(DataError, match="now masks 5 tokens, its token file holds"):
        loader.next_batch()
    with pytest.raises(DataError, match="masks 5 tokens, but its token file holds"):
        D.DataLoader(str(train_path), 2, 16)


def test_masked_targets_add_no_loss_and_no_gradient(chat_data):
    """The model's loss and gradients on a loader's batch are PyTorch's
    cross_entropy(ignore_index) and its gradients (check_against_reference
    compares every parameter's)."""
    train_path, _ = chat_data
    config = SMALL.__class__(**{**SMALL.__dict__, "vocab_size": 400, "padded_vocab_size": 512})
    model = make_model(config, seed=5)
    x, y = D.DataLoader(str(train_path), 2, 16).next_batch()
    assert (y == IGNORE_INDEX).any() and (y != IGNORE_INDEX).any()
    _, p = check_against_reference(model, x, y)
    logits, _ = ref.forward(p, config, x, y)
    torch_loss = torch.nn.functional.cross_entropy(
        logits[..., :config.vocab_size].reshape(-1, config.vocab_size),
        torch.as_tensor(y, dtype=torch.long).reshape(-1), ignore_index=IGNORE_INDEX)
    model.zero_grad()
    loss = model.forward(x, y)
    model.backward()
    assert abs(loss - torch_loss.item()) <= 1e-5 * abs(torch_loss.item())
    # the ignored targets' own tokens would have changed the loss
    unmasked = D.read_tokens(train_path)[1:33].astype(np.int32).reshape(2, 16)
    assert model.forward(x, unmasked) != loss


def test_training_runs_on_chat_data(chat_data, tmp_path, capsys):
    from llmc_py import train as train_mod
    train_path, val_path = chat_data
    assert train_mod.main(["-i", str(train_path), "-j", str(val_path), "-o",
                           str(tmp_path / "run"), "-e", "d1", "-b", "2", "-t", "16", "-v", "2",
                           "-m", "1", "-s", "0", "-x", "3"]) == 0
    capsys.readouterr()
    assert "s:3" in (tmp_path / "run" / "main.log").read_text()
