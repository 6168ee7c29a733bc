"""Request: one generation, its state machine, sampling parameters and token bookkeeping."""

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.kvcache.hashing import BlockHash, BlockHasher, PromptHashes


class RequestStatus(IntEnum):
    """WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED -> RUNNING when blocks run out.

    A prefill-only request (PD prefill role) goes RUNNING -> TRANSFERRING once its first token is
    sampled: its blocks stay pinned until its KV has been handed to a decode instance.
    """

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    TRANSFERRING = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's names: `stop`, `length`, `abort`; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


GRAMMAR_KINDS = ("json", "json_schema", "regex", "choice")  # pdserve.engine.grammar


@dataclass(frozen=True, slots=True)
class Range:
    """The finite values in [low, high], or (low, high] when `low_open`."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low < value if self.low_open else self.low <= value
        return math.isfinite(value) and above and value <= self.high

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


# The one definition of each sampling limit: SamplingParams checks them, the router's OpenAI
# schema derives its fields' ranges from them. OpenAI's where it has one.
TEMPERATURE = Range(0.0, 2.0)
TOP_P = Range(0.0, 1.0, low_open=True)
MIN_P = Range(0.0, 1.0)
PENALTY = Range(-2.0, 2.0)  # presence_penalty, frequency_penalty
REPETITION_PENALTY = Range(0.0, 10.0, low_open=True)  # vLLM's: 1 is neutral
LOGIT_BIAS = Range(-100.0, 100.0)
MAX_LOGIT_BIAS_TOKENS = 300
LOGPROBS = Range(0, 20)  # logprobs, prompt_logprobs: the top tokens reported per position


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (InvalidRequestError)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # None = no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The last `output_offset` prompt tokens are this generation's own earlier output (a request
    # the router migrated): a seeded request's seed stream continues from there.
    output_offset: int = 0
    # adjustments of the logits (pdserve.engine.logits); the neutral values change nothing
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens exist
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    presence_penalty: float = 0.0  # OpenAI, [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI, [-2, 2]
    repetition_penalty: float = 1.0  # vLLM / transformers, > 0
    min_p: float = 0.0  # sampling: drop tokens below min_p x the top token's probability
    logprobs: int | None = None  # report each output token's logprob and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (the
    # prompt is then computed in full: no prefix-cache or storage hit stands in for it)
    structured: tuple[str, str] | None = None  # (kind, spec): output follows this grammar
    # (pdserve.engine.grammar: json, json_schema, regex, choice)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_range("temperature", self.temperature, TEMPERATURE)
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be at least 1 (or unset), got {self.top_k}")
        _check_range("top_p", self.top_p, TOP_P)
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        _check_range("presence_penalty", self.presence_penalty, PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, PENALTY)
        _check_range("repetition_penalty", self.repetition_penalty, REPETITION_PENALTY)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_range(name, value, LOGPROBS)
        if self.structured is not None and self.structured[0] not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {GRAMMAR_KINDS}, got {self.structured[0]!r}"
            )
        _check_range("min_p", self.min_p, MIN_P)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequestError(f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens")
        for token, bias in self.logit_bias:
            if token < 0 or bias not in LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias needs token ids >= 0 and biases in {LOGIT_BIAS}, got {token}: "
                    f"{bias}"
                )
        if self.output_offset < 0:
            raise InvalidRequestError(f"output_offset must be >= 0, got {self.output_offset}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _check_range(name: str, value: float, allowed: Range) -> None:
    if value not in allowed:
        raise InvalidRequestError(f"{name} must be in {allowed}, got {value}")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability (fp32, from the logits the sampler used: after bias
    and penalties, before temperature) and the `logprobs` most likely tokens with theirs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StageTimes:
    """Where a request's time went on one instance, in seconds: `wait_s` until its first step
    (when its KV came from prefill: its reservation until the first-token handoff, the KV
    arriving), `prefill_s` its prompt's steps up to the first token (exactly 0 when its KV came
    from prefill), `admission_s` from then until the step that
    makes its next token starts, `first_step_s` that step; and its prompt's cache hits."""

    wait_s: float
    prefill_s: float
    admission_s: float
    first_step_s: float
    device_hit_tokens: int
    storage_hit_tokens: int


_arrival_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Request:
    """A generation in flight. `prompt_token_ids` is immutable; generated tokens are appended.

    `num_computed_tokens` counts tokens whose KV is in this instance's cache; `block_hashes` is
    the hash chain of every full block of prompt + output, extended as tokens are appended.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    hasher: BlockHasher
    eos_token_ids: tuple[int, ...] = ()
    prefill_only: bool = False  # stop after the first token and hold the KV for transfer
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # hits at first admission (prompt tokens not computed here); None until admitted
    device_hit_tokens: int | None = None
    storage_hit_tokens: int = 0
    peer_hit_tokens: int = 0  # pulled from a decode instance
    # when it reached each stage here (time.perf_counter()): `stage_times` reports them
    arrived_at: float = field(default_factory=time.perf_counter)
    first_scheduled_at: float | None = None  # its first step (decode: the first-token handoff)
    first_token_at: float | None = None  # its first output token (decode: handed over)
    second_token_step: tuple[float, float] | None = None  # the step that made its next token
    num_preemptions: int = 0
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    block_hashes: list[BlockHash] = field(default_factory=list)
    last_logprob: "TokenLogprob | None" = None  # of the newest output token, when asked for
    grammar: Any = None  # an xgrammar matcher when the request has `structured`
    prompt_logprobs: list["TokenLogprob"] = field(default_factory=list)  # tokens 1.. of the prompt
    _all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        self.hasher.extend(self.block_hashes, self._all_token_ids)

    def prompt_hashes(self) -> PromptHashes:
        """The prompt's block hash chain, to send with the request to another instance."""
        full = self.num_prompt_tokens // self.hasher.block_size
        chain = tuple(self.block_hashes[:full])
        return PromptHashes(self.hasher.root, self.hasher.block_size, chain)

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by generated tokens (a read-only view by contract)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found cached at first admission (device, peer and storage hits)."""
        return (self.device_hit_tokens or 0) + self.peer_hit_tokens + self.storage_hit_tokens

    def stage_times(self) -> "StageTimes":
        """Where its time went here so far (stages not reached count 0)."""
        scheduled = self.first_scheduled_at or self.arrived_at
        first_token = self.first_token_at or scheduled
        step_start, step_end = self.second_token_step or (first_token, first_token)
        return StageTimes(
            wait_s=scheduled - self.arrived_at,
            prefill_s=max(0.0, first_token - scheduled),
            admission_s=max(0.0, step_start - first_token),
            first_step_s=step_end - step_start,
            device_hit_tokens=self.device_hit_tokens or 0,
            storage_hit_tokens=self.storage_hit_tokens,
        )

    def record_first_admission(
        self, device_hit_tokens: int, storage_hit_tokens: int, peer_hit_tokens: int = 0
    ) -> bool:
        """Remember the hits of the request's first admission; False (changing nothing) when
        it was admitted before (a re-admission after preemption)."""
        if self.device_hit_tokens is not None:
            return False
        self.device_hit_tokens, self.storage_hit_tokens = device_hit_tokens, storage_hit_tokens
        self.peer_hit_tokens = peer_hit_tokens
        return True

    def append_output_token(self, token_id: int, logprob: "TokenLogprob | None" = None) -> None:
        if self.grammar is not None and not self.grammar.is_terminated():
            self.grammar.accept_token(token_id)  # every output token, wherever it was sampled
        self.last_logprob = logprob
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if len(self._all_token_ids) % self.hasher.block_size == 0:
            self.hasher.extend(self.block_hashes, self._all_token_ids)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (deltas), plus totals for usage reporting."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    kv_ready: bool  # prefill-only request: KV computed and pinned, first token sampled
    finish_reason: str | None  # stop | length | abort
    stop_reason: str | int | None  # the stop string or stop token that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens not computed here: device + storage hits
    error: str | None = None  # set on the final output of a request its engine step failed
    new_logprobs: tuple[TokenLogprob, ...] = ()  # of new_token_ids, when the request asks
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.., on the first output
    block_ids: tuple[int, ...] = ()  # kv_ready: the blocks holding the prompt's KV (to send)
    stage_times: StageTimes | None = None  # on a final output

    def with_text(self, text: str, stop_string: str | None = None) -> "RequestOutput":
        """This output with its text delta; with `stop_string`, finished by it. (Spelled out:
        `dataclasses.replace` costs ~5x more, once per token.)"""
        stopped = stop_string is not None
        return RequestOutput(
            self.request_id,
            self.new_token_ids,
            text,
            self.finished or stopped,
            self.kv_ready,
            "stop" if stopped else self.finish_reason,
            stop_string if stopped else self.stop_reason,
            self.num_prompt_tokens,
            self.num_output_tokens,
            self.num_cached_tokens,
            self.error,
            self.new_logprobs,
            self.prompt_logprobs,
            self.block_ids,
            self.stage_times,
        )
