"""Tokenizer: a Hugging Face `tokenizer.json` (via `tokenizers`) plus the chat template."""

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.errors import InvalidRequestError, ModelLoadError


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' `tojson` (jinja's own escapes HTML characters, which templates do not want)."""
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise InvalidRequestError(f"the chat template refused the messages: {message}")


def _templates(value: Any) -> dict[str, str]:
    """`chat_template` as HF stores it: one template, or a list of named ones."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {str(t["name"]): str(t["template"]) for t in value if isinstance(t, dict)}
    return {}


class Tokenizer:
    """Encode, decode and render chat messages. Thread-safe for concurrent reads."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | list[dict[str, str]] | None,
        special_tokens: Mapping[str, str | None],
    ) -> None:
        self._tokenizer = tokenizer
        self._chat_templates = _templates(chat_template)
        self._special_tokens = dict(special_tokens)
        self._template_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template_env.filters["tojson"] = _tojson
        self._template_env.globals["raise_exception"] = _raise_exception
        self._template_env.globals["strftime_now"] = lambda f: datetime.now().strftime(f)

    @classmethod
    def from_dir(cls, path: Path) -> "Tokenizer":
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file} not found: the model needs a fast tokenizer")
        try:
            tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises bare Exception subclasses
            raise ModelLoadError(f"cannot read {tokenizer_file}: {e}") from e
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = (
            json.loads(config_file.read_text()) if config_file.is_file() else {}
        )
        special = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "pad_token")
        }
        template_file = path / "chat_template.jinja"  # newer HF directories keep it apart
        template = config.get("chat_template")
        if template is None and template_file.is_file():
            template = template_file.read_text()
        return cls(tokenizer, template, special)

    @property
    def chat_template(self) -> str | None:
        """Every chat template of the model, joined (for telling its tool-call format)."""
        return "\n".join(self._chat_templates.values()) or None

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object underneath (vocabulary and decoder, for grammars)."""
        return self._tokenizer

    @property
    def eos_token_id(self) -> int | None:
        eos = self._special_tokens.get("eos_token")
        return None if eos is None else self.token_id(eos)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render `messages` (dicts with `role` and `content`, and `tool_calls` or
        `tool_call_id` where given) and the `tools` offered with the model's chat template
        (its `tool_use` template when it has one and tools are offered)."""
        source = self._chat_templates.get("tool_use" if tools else "default")
        source = source or self._chat_templates.get("default")
        if source is None:
            raise InvalidRequestError(
                "this model has no chat template; use a completion prompt instead of messages"
            )
        template = self._template_env.from_string(source)
        return template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_tokens.get("bos_token") or "",
            eos_token=self._special_tokens.get("eos_token") or "",
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template already carries any special tokens."""
        text = self.apply_chat_template(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)
