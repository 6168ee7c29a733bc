"""Incremental detokenization with stop strings, for streaming text."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text that could still be the start of a stop string is held back until it cannot, so a
    streaming client never sees any part of a stop string. A byte sequence that is not yet
    complete UTF-8 is held back too.
    """

    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    text: str = ""
    stop_reason: str | None = None
    _emitted: int = 0
    _prefix_offset: int = 0
    _read_offset: int = 0
    _holdback: int = field(init=False)

    def __post_init__(self) -> None:
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def update(self, token_ids: Sequence[int], finished: bool) -> str:
        """Consume `token_ids` (all output so far); return the new text that may be shown.

        Sets `stop_reason` (and truncates `text` before it) when a stop string appears.
        """
        self._decode_new(token_ids, finished)
        if self.stop_reason is None:
            self._find_stop()
        end = len(self.text) if finished or self.stop_reason else len(self.text) - self._holdback
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def resume(self, token_ids: Sequence[int], shown: int) -> None:
        """Continue a generation begun elsewhere: `token_ids` is its output so far, of whose
        text `shown` characters were already shown; `update` returns only what follows."""
        self._decode_new(token_ids)
        self._emitted = shown

    def _decode_new(self, token_ids: Sequence[int], finished: bool = False) -> None:
        """Append the text of the tokens not yet read. An incomplete UTF-8 sequence at the end
        waits for the next token, or, once the generation is finished, shows as U+FFFD (as a
        whole-sequence decode does)."""
        if self.stop_reason is not None or len(token_ids) == self._read_offset:
            return
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self._prefix_offset : self._read_offset])
        full = decode(token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(token_ids)

    def _find_stop(self) -> None:
        search_from = max(0, self._emitted - self._holdback)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            self.stop_reason = stop
