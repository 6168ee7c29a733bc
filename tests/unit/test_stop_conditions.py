"""The stop conditions are one rule (`stop_status`) for the engine and the router's migration: a
request whose instance dies after any of its tokens ends exactly as the undisturbed one does,
at the context window and at the end of its grammar too (the real tiny engine plays every
instance; the router's side is its `Transcript`, then the whole `Router`)."""

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from streams import collect

from pdserve.config import EngineConfig, RouterConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.grammar import Grammars
from pdserve.engine.request import RequestStatus, SamplingParams
from pdserve.engine.stop import stop_status
from pdserve.errors import DecodeUnavailableError
from services.router.membership import Membership
from services.router.migration import Transcript
from services.router.model_info import model_info
from services.router.pd_client import Finished, TokenDelta
from services.router.router import Router

MAX_MODEL_LEN = 64
PROMPT = [(7 * i + 3) % 200 + 20 for i in range(40)]
EOS = (2,)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    return LLMEngine.from_config(config)


def run(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> Iterator[TokenDelta | Finished]:
    """One instance's replies for a request, as the router's client turns them into events."""
    for out in engine.stream(prompt, params):
        yield TokenDelta(out.new_token_ids, out.new_text)
        if out.finished:
            stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
            assert out.finish_reason is not None
            yield Finished(
                out.finish_reason, stop_reason, out.num_prompt_tokens, out.num_output_tokens, None
            )


def transcript(engine: LLMEngine, params: SamplingParams) -> Transcript:
    """What the router keeps of a request (its own grammar compiler, as a router has)."""
    loaded = engine.loaded
    return Transcript(
        engine.tokenizer,
        list(PROMPT),
        params,
        eos_token_ids=loaded.eos_token_ids,
        max_model_len=engine.max_model_len,
        grammars=Grammars(engine.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids),
    )


def migrated_after(
    engine: LLMEngine, params: SamplingParams, reference: list[TokenDelta | Finished], k: int
) -> list[TokenDelta | Finished]:
    """The client's events when the instance dies after sending the first `k` tokens (before
    any final reply) and the router continues the request on another instance."""
    record = transcript(engine, params)
    events: list[TokenDelta | Finished] = []
    for event in reference[:k]:
        events.extend(record.relay(event))
    final = record.begin_migration()
    if final is not None:
        return [*events, final]
    prompt, resumed = record.submission()
    for event in run(engine, prompt, resumed):
        events.extend(record.relay(event))
        if record.finished:
            break
    return events


def outcome(events: list[TokenDelta | Finished]) -> tuple[list[int], str, str, str]:
    final = events[-1]
    assert isinstance(final, Finished)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    tokens = [t for d in deltas for t in d.token_ids]
    assert final.num_output_tokens == len(tokens)
    return tokens, "".join(d.text for d in deltas), final.finish_reason, final.stop_reason


def check_every_migration_point(engine: LLMEngine, params: SamplingParams) -> str:
    """Migrate after each token in turn; returns the undisturbed run's finish reason."""
    reference = list(run(engine, PROMPT, params))
    expected = outcome(reference)
    for k in range(1, len(expected[0]) + 1):
        assert outcome(migrated_after(engine, params, reference, k)) == expected, k
    engine.check_integrity()
    return expected[2]


def test_a_migrated_request_stops_at_the_context_window_as_an_unmigrated_one(
    engine: LLMEngine,
) -> None:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    assert check_every_migration_point(engine, params) == "length"
    reference = list(run(engine, PROMPT, params))
    assert len(outcome(reference)[0]) == MAX_MODEL_LEN - len(PROMPT)


@pytest.mark.parametrize(
    "structured", [("choice", '["red", "green", "blue"]'), ("regex", "[a-c]{2}-[0-9]")]
)
def test_a_migrated_request_stops_at_its_grammar_end_as_an_unmigrated_one(
    engine: LLMEngine, structured: tuple[str, str]
) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True, structured=structured)
    assert check_every_migration_point(engine, params) == "stop"


def test_a_seeded_migrated_request_stops_where_an_unmigrated_one_does(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5)
    check_every_migration_point(engine, params)


class EngineInstances:
    """A PD client whose every instance is the one real engine; its k-th call's instance dies
    after sending `deaths[k]` tokens (None: it lives), before anything else it would send."""

    outputs = SimpleNamespace(subscriber="router")  # the id its load reports would name

    def __init__(self, engine: LLMEngine, deaths: list[int | None]) -> None:
        self.engine = engine
        self.deaths = list(deaths)
        self.calls = 0

    async def generate(
        self, prefill: str, decode: str, ids: list[int], params: SamplingParams, request_id: str,
        hashes: object = None, metadata: object = (), route_seq: int = 0, source: object = None,
    ) -> AsyncIterator[TokenDelta | Finished]:  # fmt: skip
        self.calls += 1
        dies_after = self.deaths.pop(0) if self.deaths else None
        sent = 0
        for event in run(self.engine, ids, params):
            if sent == dies_after:
                raise DecodeUnavailableError("decode is gone")
            yield event
            sent += isinstance(event, TokenDelta)

    def abort(self, prefill: str, decode: str | None, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def through_router(
    engine: LLMEngine, tiny_model_dir: Path, params: SamplingParams, deaths: list[int | None]
) -> tuple[list[TokenDelta | Finished], int]:
    """The client's events of one request through the router, and how many calls it made."""
    model = model_info(EngineConfig(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN), "m")
    client = EngineInstances(engine, deaths)
    router = Router(
        RouterConfig(retry_backoff_s=0.0),
        model,
        Membership(["p0"], ["d0", "d1"]),
        client,  # type: ignore[arg-type]
    )
    return collect(router.generate("r", list(PROMPT), params)), client.calls


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=100, ignore_eos=True),  # ends at the context window
        SamplingParams(max_tokens=20, ignore_eos=True, structured=("choice", '["red", "blue"]')),
    ],
)
def test_the_router_ends_a_request_whose_last_reply_was_lost_as_the_instance_would_have(
    engine: LLMEngine, tiny_model_dir: Path, params: SamplingParams
) -> None:
    reference, calls = through_router(engine, tiny_model_dir, params, [])
    tokens = outcome(reference)[0]
    assert calls == 1
    for k in (len(tokens) // 2, len(tokens)):
        migrated, calls = through_router(engine, tiny_model_dir, params, [k])
        assert outcome(migrated) == outcome(reference)
        assert calls == (2 if k < len(tokens) else 1)  # the whole output: nothing to resume
    engine.check_integrity()


@pytest.mark.parametrize(
    ("output", "params", "grammar_ended", "expected"),
    [
        ([5, 6], SamplingParams(max_tokens=4), False, None),
        ([5, 2], SamplingParams(max_tokens=4), False, RequestStatus.FINISHED_STOPPED),
        ([5, 2], SamplingParams(max_tokens=4, ignore_eos=True), False, None),
        ([5, 9], SamplingParams(max_tokens=4, stop_token_ids=(9,)), False,
         RequestStatus.FINISHED_STOPPED),
        ([5, 9], SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(9,)), False,
         RequestStatus.FINISHED_STOPPED),
        ([5, 6], SamplingParams(max_tokens=4), True, RequestStatus.FINISHED_STOPPED),
        ([5, 6, 7, 8], SamplingParams(max_tokens=4), False, RequestStatus.FINISHED_LENGTH),
        ([5, 2, 7, 2], SamplingParams(max_tokens=4), False, RequestStatus.FINISHED_STOPPED),
    ],
)  # fmt: skip
def test_stop_status_applies_stop_tokens_eos_grammar_and_max_tokens(
    output: list[int],
    params: SamplingParams,
    grammar_ended: bool,
    expected: RequestStatus | None,
) -> None:
    status = stop_status(
        output, 10, params, eos_token_ids=EOS, max_model_len=100, grammar_ended=grammar_ended
    )
    assert status == expected


@pytest.mark.parametrize(("num_prompt_tokens", "expected"), [(97, None), (98, "length")])
def test_stop_status_ends_a_generation_that_fills_the_context_window(
    num_prompt_tokens: int, expected: str | None
) -> None:
    status = stop_status(
        [5, 6], num_prompt_tokens, SamplingParams(max_tokens=50), eos_token_ids=EOS,
        max_model_len=100,
    )  # fmt: skip
    assert (status.finish_reason if status is not None else None) == expected
