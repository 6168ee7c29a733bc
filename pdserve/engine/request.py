"""Request: one generation, its state machine, sampling parameters and token bookkeeping."""

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from pdserve.errors import InvalidRequestError
from pdserve.kvcache.hashing import BlockHash, BlockHasher


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
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's names: `stop`, `length`, `abort`; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class StorageFetch(IntEnum):
    """Where a waiting request stands with the storage tier's read-ahead."""

    NONE = 0  # not asked yet (or asked again after a preemption)
    PENDING = 1  # a read is in flight: admission waits for it
    DONE = 2  # answered (possibly with nothing)


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

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise InvalidRequestError(f"top_k must be at least 1 (or unset), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


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
    num_cached_tokens: int | None = None  # prefix hit at first admission
    num_preemptions: int = 0
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    block_hashes: list[BlockHash] = field(default_factory=list)
    _all_token_ids: list[int] = field(default_factory=list)
    # Storage tier: verified bytes of blocks [staged_first_block, + len(staged_blocks)) read ahead
    # of admission; consumed when the request gets its blocks.
    storage_fetch: StorageFetch = StorageFetch.NONE
    staged_first_block: int = 0
    staged_blocks: list[bytes] = field(default_factory=list)
    num_storage_tokens: int = 0  # of num_cached_tokens, loaded from the storage tier

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        self.hasher.extend(self.block_hashes, self._all_token_ids)

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
    def is_finished(self) -> bool:
        return self.status.is_finished

    def stage(self, first_block: int, blocks: list[bytes]) -> None:
        """Hold verified block bytes from storage until the request is given its blocks."""
        self.staged_first_block, self.staged_blocks = first_block, blocks
        self.storage_fetch = StorageFetch.DONE

    def num_usable_staged(self, device_blocks: int) -> int:
        """How many staged blocks extend a device prefix hit of `device_blocks` blocks (they must
        continue it without a gap), never covering the last token."""
        max_blocks = (self.num_tokens - 1) // self.hasher.block_size
        end = min(self.staged_first_block + len(self.staged_blocks), max_blocks)
        if not self.staged_first_block <= device_blocks < end:
            return 0
        return end - device_blocks

    def take_staged(self, device_blocks: int) -> list[bytes]:
        """The usable staged blocks (see `num_usable_staged`); the rest are dropped."""
        count = self.num_usable_staged(device_blocks)
        start = device_blocks - self.staged_first_block
        blocks = self.staged_blocks[start : start + count] if count else []
        self.staged_blocks = []
        return blocks

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if len(self._all_token_ids) % self.hasher.block_size == 0:
            self.hasher.extend(self.block_hashes, self._all_token_ids)
