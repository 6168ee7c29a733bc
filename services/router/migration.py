"""Transcript: what one request has streamed so far, so that it can continue elsewhere.

When the decode (or mixed) instance of a stream dies after tokens went out, the router submits
prompt + those tokens again, with `max_tokens` reduced by them and the seed stream continued
(`SamplingParams.output_offset`). The new instance sees the earlier output as prompt: from then
on the router detokenizes itself (primed with the earlier output), so text, stop strings that
span the seam and usage counts are those of an undisturbed run.
"""

from collections.abc import Sequence
from dataclasses import replace

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar import Grammars
from pdserve.engine.request import RequestStatus, SamplingParams
from pdserve.engine.stop import stop_status
from pdserve.model.tokenizer import Tokenizer
from services.router.pd_client import Finished, TokenDelta


class Transcript:
    """Not thread-safe: one request's generator owns it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        grammars: Grammars,
    ) -> None:
        """`eos_token_ids`, `max_model_len` and `grammars` (structured outputs) are the
        model's, for the stop conditions (`stop_status`) a migration applies to the earlier
        output."""
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.grammars = grammars
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
        status = stop_status(
            self.token_ids,
            len(self.prompt),
            self.params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            grammar_ended=self._grammar_ended(),
        )
        if status == RequestStatus.FINISHED_STOPPED:  # as an instance words it: the token
            return self._final("stop", str(self.token_ids[-1]))
        if status == RequestStatus.FINISHED_LENGTH:
            return self._final("length", "")
        return None

    def _grammar_ended(self) -> bool:
        """Whether the structured output's grammar accepted its end within the output so far
        (the prompt's last `output_offset` tokens included: an earlier migration's)."""
        structured = self.params.structured
        if structured is None:
            return False
        earlier = self.prompt[len(self.prompt) - self.params.output_offset :]
        matcher = self.grammars.matcher(*structured, accepted=[*earlier, *self.token_ids])
        return bool(matcher.is_terminated())

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
