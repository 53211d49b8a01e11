"""Chats into tokens and a loss mask, with a Hugging Face folder's own chat
template (rendered as transformers' apply_chat_template renders it) and its
tokenizer.json.

Which tokens are trained: each assistant turn, from where the conversation
rendered up to and including it departs from the prompt that asks for it
(the conversation before it rendered with ``add_generation_prompt=True``) to
its end: the assistant's content and its end-of-turn token, never the role
headers before it. A token that overlaps such a span is trained (as
transformers' ``return_assistant_tokens_mask``). A template that renders an
earlier turn otherwise once later ones follow (Qwen3 drops the thinking of
earlier turns) leaves that turn untrained: only turns that read the same in
the whole conversation are.
"""
import json
import os
from datetime import datetime
from pathlib import Path

import numpy as np

from ..errors import DataError, TokenizerUnavailableError
from ..io.tokens import token_dtype

CHAT_TEMPLATE_FILE = "chat_template.jinja"   # transformers' own place, before the config's
TOKENIZER_CONFIG = "tokenizer_config.json"
# the special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
# the names a message's reasoning goes by; transformers fills each from the others
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatRecordError(DataError):
    """One chat that cannot be used (the file goes on without it)."""


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:
        raise TokenizerUnavailableError(f"rendering a chat template needs jinja2: pip install "
                                        f'"llmc_py[hf]" ({e})') from None
    return jinja2


def compile_template(source):
    """The template ``source`` compiled in the environment transformers
    renders chat templates in: sandboxed, trim_blocks and lstrip_blocks, loop
    controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
    non-ASCII and HTML characters, and a ``{% generation %}`` block that
    renders its body."""
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"the chat template does not compile: {e.message} (its line "
                        f"{e.lineno})") from None


def _token_text(value):
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    return value.get("content") if isinstance(value, dict) else value


def read_chat_template(folder):
    """(template source, {special token name: text}) of a Hugging Face folder:
    chat_template.jinja, else tokenizer_config.json's ``chat_template`` (one
    string, or a list of named ones of which "default" is taken)."""
    folder = Path(folder)
    config_path = folder / TOKENIZER_CONFIG
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError) as e:
        raise DataError(f"{config_path}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"{config_path}: is not a JSON object")
    template = config.get("chat_template")
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    elif isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise DataError(f"{folder}: no chat template (neither {CHAT_TEMPLATE_FILE} nor a "
                        f"chat_template string in {TOKENIZER_CONFIG})")
    specials = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
    return template, {name: str(text) for name, text in specials.items() if text is not None}


def _as_template_messages(messages):
    """The messages as transformers hands them to a template: keys whose
    value is null dropped, and a reasoning given under one name also under
    the others."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def check_messages(messages):
    """Raises ChatRecordError unless ``messages`` is a non-empty list of
    objects with a string ``role``, one of them the assistant's."""
    if not isinstance(messages, list) or not messages:
        raise ChatRecordError("messages is not a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatRecordError(f"message {i} is not an object with a string role")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatRecordError("no assistant turn to train")


class ChatEncoder:
    """A folder's chat template and tokenizer.json: ``encode(messages)``
    gives a chat's token ids (those of ``apply_chat_template(messages)``)
    and its loss mask."""

    def __init__(self, folder):
        from ..tokenizer import HF_TOKENIZER_FILE, read_tokenizer_json
        folder = Path(folder)
        if not folder.is_dir():
            raise DataError(f"{folder}: not a folder (--chat needs a Hugging Face tokenizer "
                            f"folder with tokenizer.json and a chat template)")
        self._tokenizer = read_tokenizer_json(folder / HF_TOKENIZER_FILE)
        source, self.special_tokens = read_chat_template(folder)
        self._template = compile_template(source)
        # what a template's refusal or a message it cannot render raises
        self._refusals = (_jinja().exceptions.TemplateError, TypeError, ValueError)
        self.n_vocab = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.dtype = token_dtype(self.n_vocab)

    def render(self, messages, add_generation_prompt=False):
        """The chat's text, as ``apply_chat_template(messages, tokenize=False)``."""
        return self._template.render(messages=_as_template_messages(messages), tools=None,
                                     documents=None, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)

    def _try_render(self, messages, add_generation_prompt):
        """The text, or the exception the template raised."""
        try:
            return self.render(messages, add_generation_prompt)
        except self._refusals as e:
            return e

    def assistant_spans(self, messages):
        """(text, spans, untrained): the whole chat's text, the [start, end)
        character spans of the assistant turns trained (the module's rule),
        and how many assistant turns are left untrained because the template
        renders them otherwise in the whole chat."""
        check_messages(messages)
        text = self._try_render(messages, False)
        if isinstance(text, Exception):
            raise ChatRecordError(f"the chat template refuses it: {text}")
        spans, untrained = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._try_render(messages[:i], True)
            turn = self._try_render(messages[:i + 1], False)
            if isinstance(prompt, str) and isinstance(turn, str) and text.startswith(turn):
                start = len(os.path.commonprefix([prompt, turn]))
                if start < len(turn):
                    spans.append((start, len(turn)))
                    continue
            untrained += 1
        if not spans:
            raise ChatRecordError("no assistant turn to train (the template renders none of "
                                  "them as in the whole chat)")
        return text, spans, untrained

    def encode(self, messages):
        """(token ids, loss mask of 0s and 1s, untrained assistant turns)."""
        text, spans, untrained = self.assistant_spans(messages)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        mask = np.zeros(ids.size, dtype=np.uint8)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        for start, end in spans:
            mask[(offsets[:, 1] > start) & (offsets[:, 0] < end)] = 1
        return ids, mask, untrained
