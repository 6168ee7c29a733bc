"""Transcript: what one request has streamed so far, so that it can continue elsewhere.

When the decode (or mixed) instance of a stream dies after tokens went out, the router submits
prompt + those tokens again, with `max_tokens` reduced by them and the seed stream continued
(`SamplingParams.output_offset`). The new instance sees the earlier output as prompt: from then
on the router detokenizes itself (primed with the earlier output), so text, stop strings that
span the seam and usage counts are those of an undisturbed run.
"""

from dataclasses import replace

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import SamplingParams
from pdserve.model.tokenizer import Tokenizer
from services.router.pd_client import Finished, TokenDelta


class Transcript:
    """Not thread-safe: one request's generator owns it."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = []
        self.migrations = 0
        self.finished = False
        self.aborted = False  # by the client, between two instances
        self._shown = 0  # characters of text sent to the client
        self._detokenizer: IncrementalDetokenizer | None = None  # set by the first migration

    def submission(self) -> tuple[list[int], SamplingParams]:
        """The prompt and parameters that continue the generation from where it is."""
        done = len(self.token_ids)
        if not done:
            return self.prompt, self.params
        params = replace(
            self.params,
            max_tokens=self.params.max_tokens - done,
            output_offset=self.params.output_offset + done,
            prompt_logprobs=None,  # the client has them (they rode on the first delta)
        )
        return self.prompt + self.token_ids, params

    def begin_migration(self) -> Finished | None:
        """Prepare to continue elsewhere; returns the final event instead when the earlier
        output already ends the generation (its last reply was lost with its instance)."""
        self.migrations += 1
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.params.stop)
        detokenizer.resume(self.token_ids, self._shown)
        self._detokenizer = detokenizer
        last = self.token_ids[-1]
        eos = self.tokenizer.eos_token_id
        if last in self.params.stop_token_ids or (last == eos and not self.params.ignore_eos):
            return self._final("stop", str(last) if last in self.params.stop_token_ids else "")
        if len(self.token_ids) >= self.params.max_tokens:
            return self._final("length", "")
        return None

    def relay(self, event: TokenDelta | Finished) -> list[TokenDelta | Finished]:
        """The events to send the client for one from the instance (after a migration the
        text is recomputed and a stop string across the seam ends the stream here)."""
        detokenizer = self._detokenizer
        if isinstance(event, TokenDelta):
            self.token_ids.extend(event.token_ids)
            if detokenizer is None:
                self._shown += len(event.text)
                return [event]
            text = detokenizer.update(self.token_ids, finished=False)
            self._shown += len(text)
            delta = TokenDelta(event.token_ids, text, event.logprobs)
            if detokenizer.stop_reason is not None:
                return [delta, self._final("stop", detokenizer.stop_reason)]
            return [delta]
        if detokenizer is None:
            self.finished = True
            return [event]
        text = detokenizer.update(self.token_ids, finished=True)
        if detokenizer.stop_reason is not None:
            final = self._final("stop", detokenizer.stop_reason)
        else:
            final = self._final(event.finish_reason, event.stop_reason, event)
        return [TokenDelta((), text), final] if text else [final]

    def _final(self, reason: str, stop_reason: str, last: Finished | None = None) -> Finished:
        self.finished = True
        return Finished(
            reason,
            stop_reason,
            len(self.prompt),
            len(self.token_ids),
            last.prefill if last is not None else None,
        )
