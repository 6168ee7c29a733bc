"""Structured outputs: a grammar (JSON, a JSON schema, a regular expression, a choice) turned
into a token mask for each sampling step, with xgrammar (CPU; chosen over llguidance for its
JSON-schema compiler with `any_whitespace=False`, which keeps a weak model from padding JSON
with whitespace until `max_tokens`, and its in-place bitmask on CPU tensors).

`Grammars` compiles once per (kind, spec) and caches; every output token appended to a request
is accepted by its matcher (`Request.append_output_token`), whichever instance sampled it, so
prefill's first token, decode's continuation and a migrated request's earlier output all
advance the same grammar. When the grammar is complete only the stop tokens are allowed.
"""

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pdserve.engine.request import GRAMMAR_KINDS
from pdserve.errors import InvalidRequestError
from pdserve.model.tokenizer import Tokenizer

CACHE_SIZE = 256


class Grammars:
    """Thread-safe compile cache for one tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, kind: str, spec: str, accepted: Iterable[int] = ()) -> Any:
        """A matcher of the grammar that has accepted `accepted` (a migrated request's earlier
        output; none once the grammar ended, as `Request.append_output_token` does). Raises
        InvalidRequestError when the grammar does not compile."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self._compile(kind, spec))
        for token in accepted:
            if matcher.is_terminated():
                break
            matcher.accept_token(token)
        return matcher

    def _compile(self, kind: str, spec: str) -> Any:
        with self._lock:
            compiled = self._compiled.get((kind, spec))
            if compiled is not None:
                self._compiled.move_to_end((kind, spec))
                return compiled
            compiler = self._compiler or self._make_compiler()
        try:
            compiled = _compile(compiler, kind, spec)
        except (RuntimeError, ValueError) as e:  # xgrammar's errors for a bad schema or regex
            raise InvalidRequestError(f"the {kind} grammar does not compile: {e}") from e
        with self._lock:
            self._compiled[(kind, spec)] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _make_compiler(self) -> Any:
        import xgrammar

        raw = self._tokenizer.backend
        encoded = [""] * raw.get_vocab_size()
        for text, token_id in raw.get_vocab().items():
            encoded[token_id] = text
        byte_level = "ByteLevel" in type(raw.decoder).__name__
        vocab_type = xgrammar.VocabType.BYTE_LEVEL if byte_level else xgrammar.VocabType.RAW
        info = xgrammar.TokenizerInfo(
            encoded, vocab_type, vocab_size=self._vocab_size, stop_token_ids=self._stop
        )
        self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler


# xgrammar (0.2.8 and 0.2.9) writes the characters of a length-bounded string (minLength,
# maxLength) without the exclusion of raw control characters its other strings have, so a
# sampled "JSON" string could hold one and no JSON parser would take it: the rule gets it back.
_BOUNDED_CHARACTERS = r"_characters ::= (([^\"\\\r\n]))"
_JSON_CHARACTERS = r"_characters ::= (([^\0-\x1f\"\\\r\n]))"


def _compile(compiler: Any, kind: str, spec: str) -> Any:
    if kind == "json":  # OpenAI's json_object: an object, not any JSON value
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json_schema":
        import xgrammar

        grammar = str(xgrammar.Grammar.from_json_schema(spec, any_whitespace=False))
        return compiler.compile_grammar(grammar.replace(_BOUNDED_CHARACTERS, _JSON_CHARACTERS))
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        return compiler.compile_regex("|".join(re.escape(str(c)) for c in choices))
    raise InvalidRequestError(f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")


def apply_masks(logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
    """Mask, in place, every row whose request has a grammar to the tokens it allows."""
    rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i, matcher in rows:
        matcher.fill_next_token_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=[i for i, _ in rows])
