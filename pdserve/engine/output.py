"""OutputProcessor: the text of the engine's outputs, and their stop strings.

The engine's step produces token outputs (ids, logprobs, finish by stop token, EOS, grammar or
length). The processor turns each request's growing token ids into text deltas
(`IncrementalDetokenizer`: text that could begin a stop string and incomplete UTF-8 are held
back) and ends a request whose text reaches a stop string. It runs on the engine thread when the
engine is driven directly (`LLMEngine.step` with `inline_text`), or on the engine loop's output
thread (`EngineLoop`), so that the engine thread only schedules, runs and updates.

A request ended by a stop string is returned in `stopped`: its final output has gone out, the
engine must finish it (`LLMEngine.stop_requests`), and the outputs it produces until then are
dropped. The engine tells the processor of every request it finished without a final output
(aborted, failed, released, stopped) through `ended`, in order with the outputs.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import RequestOutput
from pdserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class _Text:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    """`register` may be called from any thread; `process` from one thread at a time."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._texts: dict[str, _Text] = {}
        self._stopped: set[str] = set()  # ended by a stop string, not yet finished by the engine

    def __len__(self) -> int:
        """Requests whose text is being followed."""
        with self._lock:
            return len(self._texts)

    def register(self, request_id: str, stop: tuple[str, ...]) -> None:
        """Follow a request's text (before the engine produces its first output)."""
        text = _Text(IncrementalDetokenizer(self._tokenizer, stop))
        with self._lock:
            self._texts[request_id] = text

    def process(
        self, outputs: Sequence[RequestOutput], ended: Sequence[str] = ()
    ) -> tuple[list[RequestOutput], list[str]]:
        """Forget the `ended` requests, then add text to `outputs` (in order). Returns the
        outputs to deliver and the requests that a stop string ended. KV-ready and error
        outputs, and those of requests not followed, pass through unchanged."""
        with self._lock:
            for request_id in ended:
                self._texts.pop(request_id, None)
                self._stopped.discard(request_id)
        delivered: list[RequestOutput] = []
        stopped: list[str] = []
        for output in outputs:
            request_id = output.request_id
            if request_id in self._stopped:
                continue
            with self._lock:
                text = self._texts.get(request_id)
            if text is None or output.kv_ready or output.error is not None:
                delivered.append(output)
                continue
            result = _with_text(output, text)
            if result.finished:
                with self._lock:
                    self._texts.pop(request_id, None)
                if not output.finished:
                    stopped.append(request_id)
                    self._stopped.add(request_id)
            delivered.append(result)
        return delivered, stopped


def _with_text(output: RequestOutput, text: _Text) -> RequestOutput:
    """The output with its text delta; finished by a stop string if its text reaches one. A
    stop token (an int `stop_reason`: EOS, a stop token id, a grammar's end) is not shown."""
    text.token_ids.extend(output.new_token_ids)
    token_ids: Sequence[int] = text.token_ids
    if output.finish_reason == "stop" and isinstance(output.stop_reason, int):
        token_ids = token_ids[:-1]
    detokenizer = text.detokenizer
    delta = detokenizer.update(token_ids, finished=output.finished)
    return output.with_text(delta, detokenizer.stop_reason)
