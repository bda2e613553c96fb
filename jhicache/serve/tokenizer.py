"""Tokenizer: a checkpoint's tokenizer.json (through `tokenizers`) and its chat template
(tokenizer_config.json or chat_template.jinja, rendered with jinja2). Its calls on a request's
text release the interpreter lock while they work (`tokenizers`' batch calls do, the single
ones do not), and long texts go to a process of their own (`LongTexts`)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from jhicache.serve.long_texts import LONG_TEXT_CHARS, LongTexts, TokenCountError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer Hugging Face checkpoints keep the template apart
GENERATION_CONFIG_FILE = "generation_config.json"


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception`), or there is none."""


def has_tokenizer(path: str | Path) -> bool:
    """True when `path` is a directory holding a tokenizer.json."""
    return (Path(path) / TOKENIZER_FILE).is_file()


class Tokenizer:
    """Text <-> token ids with a checkpoint's own tokenizer, and its chat template.

    `eos_token_ids` are the ids generation stops at unless asked to ignore EOS: the config's
    `eos_token`, and the `eos_token_id`s of generation_config.json when the directory has one
    (instruct models list their end-of-turn token there too)."""

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None,
                 special: Mapping[str, str | None], eos_token_ids: tuple[int, ...],
                 path: str | None = None) -> None:
        self._backend = backend
        self._special = dict(special)
        self._template = _compile(chat_template) if chat_template else None
        self.eos_token_ids = eos_token_ids
        self.path = path
        self._token_texts: dict[int, str] = {}  # tokens decoded one at a time
        # every token's text by id once `decode_vocabulary` has run: a list, as a scored
        # prompt looks up thousands of random ids, which a list finds at an offset where a
        # dict of the whole vocabulary probes a table too large for the CPU's caches
        self._vocabulary: list[str] = []
        self._long_texts = LongTexts(backend)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads tokenizer.json, tokenizer_config.json (optional) and generation_config.json
        (optional) from a checkpoint directory."""
        root = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(root / TOKENIZER_FILE))
        config = _read_json(root / CONFIG_FILE)
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        template = _chat_template(root, config)
        eos = [backend.token_to_id(special["eos_token"])] if special["eos_token"] else []
        eos += _id_list(_read_json(root / GENERATION_CONFIG_FILE).get("eos_token_id"))
        eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))  # ordered, unique
        return cls(backend, template, special, eos_ids, str(root))

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True,
               limit: int | None = None) -> list[int]:
        """Token ids of `text` (blocking: call it off the event loop); ValueError for text that
        is not Unicode a tokenizer can take (a lone surrogate, which JSON's escapes can carry),
        `TokenCountError` (a ValueError) for more than `limit` tokens. Texts over
        `LONG_TEXT_CHARS` characters are tokenized by `LongTexts`' process."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text is not valid Unicode: {e.reason} at character "
                             f"{e.start}") from None
        if len(text) > LONG_TEXT_CHARS:
            return self._long_texts.encode(text, add_special_tokens, limit)
        encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(encoding) > limit:
            raise TokenCountError(len(encoding), limit)
        return encoding.ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def close(self) -> None:
        """Ends the process of long texts, if one runs (the next long text starts another)."""
        self._long_texts.close()

    def token_text(self, token: int) -> str:
        """One token's own decoding, special tokens kept (how log probabilities name tokens).
        Kept once decoded: a scored prompt names a token, and its alternatives, per position."""
        if 0 <= token < len(self._vocabulary):
            return self._vocabulary[token]
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.decode([token], skip_special_tokens=False)
        return text

    def token_texts(self, tokens: list[int]) -> list[str]:
        """`token_text` of each of `tokens`: lookups alone once the vocabulary is decoded."""
        try:
            return list(map(self._vocabulary.__getitem__, tokens))
        except IndexError:  # before `decode_vocabulary`, or an id past the tokenizer's
            return [self.token_text(token) for token in tokens]

    def decode_vocabulary(self) -> None:
        """Keeps every token's `token_text`, decoded in one batch call (a server does this as
        it starts): a scored prompt's tokens and alternatives are then all lookups, from its
        first request on, where each token not met before would be a decode call."""
        texts = self._backend.decode_batch([[i] for i in range(self.vocab_size)],
                                           skip_special_tokens=False)
        self._vocabulary = texts

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` (dicts with role and content), as transformers'
        `apply_chat_template(tokenize=False)` renders it."""
        if self._template is None:
            raise ChatTemplateError("the tokenizer has no chat template: use /v1/completions")
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self._special)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; {} when the file is absent."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    """The template: chat_template.jinja, else tokenizer_config's `chat_template`, which is a
    string or a list of named templates (the one named "default" is the chat one)."""
    if (root / TEMPLATE_FILE).is_file():
        return (root / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, indent: int | None = None, ensure_ascii: bool = False) -> str:
    # jinja2's own tojson escapes HTML; chat templates expect plain JSON, as transformers renders
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    """The template in a sandbox (it comes with a checkpoint), with the whitespace rules and
    helpers that Hugging Face chat templates are written for."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source)
