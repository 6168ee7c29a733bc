"""The storage connector and the admission path over it, with a fake storage tier (the other
side of the connector's interface: a dict of block bytes by hash, answering reads at once or
when the test says so). Output equality with real storage is tested in
tests/integration/test_storage.py."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, StorageConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import IntegrityError
from pdserve.kvcache.hashing import BlockHash

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@dataclass
class FakeTier:
    """Blocks by hash; `prefetch` answers at once, or with `hold` when `answer()` is called."""

    config: StorageConfig = field(default_factory=StorageConfig)
    blocks: dict[BlockHash, bytes] = field(default_factory=dict)
    answers: list[Callable[[], None]] = field(default_factory=list)
    available: bool = True
    hold: bool = False

    def is_known_stored(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def write(
        self,
        items: Sequence[tuple[BlockHash, bytes | memoryview]],
        ready: Callable[[], None] = lambda: None,
        release: Callable[[], None] = lambda: None,
    ) -> int:
        ready()
        self.blocks.update((h, bytes(d)) for h, d in items)
        release()
        return len(items)

    def read_chain(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        found = []
        for block_hash in hashes:
            if block_hash not in self.blocks:
                break
            found.append(self.blocks[block_hash])
        return found

    def prefetch(self, hashes: Sequence[BlockHash], done: Callable[[list[bytes]], None]) -> None:
        blocks = self.read_chain(hashes)
        self.answers.append(lambda: done(blocks))
        if not self.hold:
            self.answer()

    def answer(self) -> None:
        for reply in self.answers:
            reply()
        self.answers.clear()


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(5 * i + 7 * offset + 3) % 250 for i in range(n)]


@pytest.fixture
def stored(tiny_model_dir: Path) -> tuple[LLMEngine, FakeTier]:
    """An engine whose tier holds every block of `prompt(80)` (written through as computed)."""
    tier = FakeTier(StorageConfig(device_write_policy="write_through"))
    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32), storage_tier=lambda _: tier
    )
    engine.generate([prompt(80)], GREEDY)
    assert len(tier.blocks) == 5
    engine.kv_cache.evict_cached_blocks()  # only storage holds them now
    return engine, tier


def test_staged_bytes_are_dropped_when_a_reservation_is_refused(
    stored: tuple[LLMEngine, FakeTier],
) -> None:
    engine, _ = stored
    assert engine.storage_connector is not None
    request = engine.make_request(prompt(80), GREEDY, "refused")
    engine.storage_connector.read_ahead(request, 0)
    assert (
        engine.admission.staged.usable(request, 0).blocks == 4
    )  # never the block with the last token
    assert engine.preallocate(request, growth_headroom_blocks=10**6) is None  # refused
    with pytest.raises(IntegrityError, match="refused"):
        engine.check_integrity()  # what a refusal that forgot its staged bytes leaves
    engine.release("refused")  # what decode's refusal path does
    engine.check_integrity()


def test_unusable_staged_bytes_are_dropped_at_admission(
    stored: tuple[LLMEngine, FakeTier],
) -> None:
    engine, _ = stored
    assert engine.storage_connector is not None
    request = engine.make_request(prompt(80), GREEDY, "late")
    engine.storage_connector.read_ahead(request, 0)
    engine.generate([prompt(80)], GREEDY)  # the device holds the prefix again: staged is moot
    assert engine.admission.staged.usable(request, 0).blocks == 4
    admission = engine.preallocate(request)
    assert admission is not None and admission.storage_hit_tokens == 0
    assert engine.admission.staged.usable(request, 0).blocks == 0  # not held while it runs
    engine.release("late")
    engine.check_integrity()  # nothing left staged for it


def test_a_stale_prefetch_answer_never_reaches_a_request_that_reuses_the_id(
    stored: tuple[LLMEngine, FakeTier], tiny_model_dir: Path
) -> None:
    engine, tier = stored
    tier.hold = True
    engine.add_request(prompt(80), GREEDY, request_id="x")
    assert engine.step() == []  # the request waits for its storage read
    engine.abort_request("x")
    other = prompt(80, offset=3)  # nothing of it is stored
    engine.add_request(other, GREEDY, request_id="x")
    assert engine.step() == []  # its own read is in flight too, behind the stale one
    assert len(tier.answers) == 2
    outputs = []  # the first request's read (4 blocks of the first prompt) arrives below
    while engine.has_unfinished_requests():
        tier.answer()
        outputs.extend(engine.step())
    request_tokens = [t for o in outputs if o.request_id == "x" for t in o.new_token_ids]
    fresh = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32))
    assert tuple(request_tokens) == fresh.generate([other], GREEDY)[0].token_ids
    assert outputs[-1].num_cached_tokens == 0  # no storage hit was taken from the stale read
    engine.check_integrity()
