"""Tokenizers: a SentencePiece `.model` file or a Hugging Face tokenizer folder, and chat templates.

Both give `encode(text, bos, eos)`, `encode_plain(text)` (the special tokens the tokenizer itself
adds, as transformers' `tokenizer(text)`), `decode(ids)`, `vocab_size`, `bos_id` and `eos_id`;
`load_tokenizer(path)` picks `Tokenizer` for a file and `HFTokenizer` (`tokenizer.json` +
`tokenizer_config.json`: BOS, EOS, pad and chat template) for a folder. `render_chat` renders a
Jinja chat template as transformers' `apply_chat_template` does, so `encode_chat` returns its ids.
`tokenizers` and `jinja2` (weft[hf]) are imported only when a folder is loaded; their absence is a
one-line `DataError`.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import sentencepiece as spm

from weft.components.data.errors import DataError

__all__ = ["HFTokenizer", "Tokenizer", "load_tokenizer"]

_INSTALL_HINT = 'pip install "weft[hf]" (the tokenizers and jinja2 packages)'


def load_tokenizer(path: str | Path) -> Tokenizer | HFTokenizer:
    """A Hugging Face tokenizer if `path` is a folder, else a SentencePiece model file."""
    return HFTokenizer(path) if Path(path).is_dir() else Tokenizer(path)


class Tokenizer:
    """A SentencePiece model with BOS/EOS handling."""

    def __init__(self, path: str | os.PathLike) -> None:
        if not Path(path).is_file():
            raise DataError(f"model.tokenizer_path: no tokenizer file at '{path}'")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=os.fspath(path))
        except (OSError, RuntimeError) as err:
            raise DataError(f"model.tokenizer_path: '{path}' is not a SentencePiece model") from err
        self.vocab_size: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise DataError(f"model.tokenizer_path: '{path}' defines no BOS or no EOS token")

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids: list[int] = self._sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` after BOS, as a Llama SentencePiece tokenizer in transformers adds them."""
        return self.encode(text, bos=True, eos=False)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face `tokenizer.json` folder, with the same interface as the SentencePiece `Tokenizer`
    plus chat rendering.

    `encode(text, bos, eos)` tokenizes without the folder's post-processor and adds BOS/EOS itself,
    so documents are framed exactly like SentencePiece ones (a folder without a BOS token, as
    Qwen's, frames them with EOS alone: `bos_id` is None); `encode_chat(messages)` and
    `render_chat` follow the folder's chat template.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        where = f"model.tokenizer_path: '{self.folder}'"
        if not (self.folder / "tokenizer.json").is_file():
            raise DataError(f"{where} is a folder without tokenizer.json (a Hugging Face tokenizer folder has one)")
        try:
            import tokenizers
        except ImportError:
            raise DataError(f"{where}: reading a Hugging Face tokenizer needs {_INSTALL_HINT}") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        except Exception as err:  # the Rust library raises a plain Exception on malformed files
            raise DataError(f"{where}: tokenizer.json is not a tokenizers file ({err})") from None
        config = self._read_config()
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.bos_id = self._special_id(self.bos_token, "bos_token")
        self.eos_id = self._special_id(self.eos_token, "eos_token")
        if self.eos_id is None:  # BOS may be absent (Qwen's "bos_token": null): documents then end with EOS alone
            raise DataError(f"{where}: tokenizer_config.json defines no eos_token")
        self.pad_id = self._special_id(self.pad_token, "pad_token")
        self.chat_template = self._pick_template(config.get("chat_template"))
        # Tokens that end an assistant turn: Llama 3's <|eot_id|> (and <|eom_id|>), else EOS.
        self.stop_ids = sorted(
            {self.eos_id} | {i for t in ("<|eot_id|>", "<|eom_id|>", "<|im_end|>") if (i := self._tok.token_to_id(t)) is not None}
        )
        self._config = config

    def _read_config(self) -> dict[str, Any]:
        path = self.folder / "tokenizer_config.json"
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise DataError(f"{path}: expected JSON ({err})") from None
        if not isinstance(config, dict):
            raise DataError(f"{path}: expected a JSON object")
        return config

    def _special_id(self, token: str | None, key: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise DataError(f"{self.folder / 'tokenizer_config.json'}: {key} {token!r} is not in tokenizer.json")
        return token_id

    @staticmethod
    def _pick_template(template: Any) -> str | None:
        """The template string; a list of named templates (as some folders ship) gives 'default'."""
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    # -- the Tokenizer interface --------------------------------------------------------------

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        """Ids of `text`, after BOS if asked and the tokenizer has one, and before EOS if asked."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + ([self.eos_id] if eos else [])

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with the special tokens transformers' `tokenizer(text)` adds: those of
        tokenizer.json's post-processor (Llama 3's BOS; none where it has none, as Qwen's), which
        transformers 5 follows whatever tokenizer_config.json's `add_bos_token` says."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` (special tokens in the text are recognised, none added) and each token's
        character span, which lets chat masking map rendered turns to tokens."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    # -- chat ---------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The folder's chat template applied to `messages`, as transformers renders it."""
        if self.chat_template is None:
            raise DataError(
                f"model.tokenizer_path: '{self.folder}' has no chat_template in tokenizer_config.json; "
                "use data.format = 'prompt_completion' or a tokenizer with a chat template"
            )
        special = {key: _token_content(value) for key, value in self._config.items()
                   if key.endswith("_token") and _token_content(value) is not None}
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special
        )

    def encode_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> list[int]:
        """Ids of the rendered chat; the template itself writes BOS, as in apply_chat_template."""
        return self._tok.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                                add_special_tokens=False).ids


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """The Jinja template compiled once, in a sandbox configured like transformers' chat rendering."""
    if source in _TEMPLATES:
        return _TEMPLATES[source]
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError(f"rendering a chat template needs {_INSTALL_HINT}") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = _TEMPLATES[source] = env.from_string(source)
    except TemplateError as err:
        raise DataError(f"chat_template: not a valid Jinja template ({err})") from None
    return template
