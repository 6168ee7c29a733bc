"""Request migration in the router, against a fake PD client that plays a deterministic model
(the next token is a function of the whole context) and kills its decode instance mid-stream:
the client must see exactly the tokens, text, usage and finish reason of an undisturbed run."""

import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from streams import collect

from pdserve.config import EngineConfig, RouterConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import SamplingParams
from pdserve.errors import (
    DecodeUnavailableError,
    InstanceUnavailableError,
    RequestAbortedError,
    StepFailedError,
)
from pdserve.model.tokenizer import Tokenizer
from services.router.membership import Membership
from services.router.model_info import ModelInfo, model_info
from services.router.pd_client import Finished, TokenDelta
from services.router.router import Router

PROMPT = [40, 41, 42, 43]


def next_token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 90 + 33  # printable single-byte tokens


class DyingDecodes:
    """Each call plays the model from the given context; the k-th call's decode dies after
    `deaths[k]` tokens (None: it lives)."""

    outputs = SimpleNamespace(subscriber="router")  # the id its load reports would name

    def __init__(self, tokenizer: Tokenizer, deaths: list[int | None], error: Exception) -> None:
        self.tokenizer = tokenizer
        self.deaths = list(deaths)
        self.error = error
        self.calls: list[tuple[str, str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.on_death: Callable[[], None] = lambda: None

    async def generate(
        self, prefill: str, decode: str, ids: list[int], params: SamplingParams, request_id: str,
        hashes: object = None, metadata: object = (), route_seq: int = 0, source: object = None,
    ) -> AsyncIterator[TokenDelta | Finished]:  # fmt: skip
        self.calls.append((prefill, decode, list(ids), params))
        dies_after = self.deaths.pop(0) if self.deaths else None
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        context, output = list(ids), []
        while True:
            if dies_after is not None and len(output) == dies_after:
                self.on_death()
                raise self.error
            token = next_token(context)
            context.append(token)
            output.append(token)
            done = len(output) == params.max_tokens
            text = detokenizer.update(output, finished=done)
            yield TokenDelta((token,), text)
            if detokenizer.stop_reason is not None:
                yield Finished("stop", detokenizer.stop_reason, len(ids), len(output), None)
                return
            if done:
                yield Finished("length", "", len(ids), len(output), None)
                return

    def abort(self, prefill: str, decode: str | None, request_id: str) -> None:
        self.aborted.append(request_id)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> ModelInfo:
    return model_info(EngineConfig(model=str(tiny_model_dir)), "tiny")


def make_router(model: ModelInfo, client: DyingDecodes, **config: object) -> Router:
    settings_ = RouterConfig(retry_backoff_s=0.0, **config)  # type: ignore[arg-type]
    membership = Membership(["p0", "p1"], ["d0", "d1", "d2"])
    return Router(settings_, model, membership, client)  # type: ignore[arg-type]


def play(
    model: ModelInfo, deaths: list[int | None], params: SamplingParams, **config: object
) -> tuple[list[TokenDelta | Finished], Router]:
    client = DyingDecodes(model.tokenizer, deaths, DecodeUnavailableError("decode is gone"))
    router = make_router(model, client, **config)
    return collect(router.generate("r", PROMPT, params)), router


def summary(events: list[TokenDelta | Finished]) -> tuple[list[int], str, Finished]:
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    final = events[-1]
    assert isinstance(final, Finished) and all(isinstance(e, TokenDelta) for e in events[:-1])
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), final


@settings(max_examples=40, deadline=None)
@given(
    deaths=st.lists(st.integers(1, 39), min_size=1, max_size=3),
    stop=st.sampled_from([(), ("zz",), ("A",), ("@",)]),
)
def test_a_migrated_stream_is_the_undisturbed_one(
    model: ModelInfo, deaths: list[int], stop: tuple[str, ...]
) -> None:
    params = SamplingParams(max_tokens=40, stop=stop, ignore_eos=True)
    reference, _ = play(model, [], params)
    migrated, router = play(model, list(deaths), params)
    tokens, text, final = summary(migrated)
    ref_tokens, ref_text, ref_final = summary(reference)
    assert text == ref_text and tokens == ref_tokens
    assert (final.finish_reason, final.stop_reason) == (
        ref_final.finish_reason,
        ref_final.stop_reason,
    )
    assert (final.num_prompt_tokens, final.num_output_tokens) == (len(PROMPT), len(tokens))
    calls = router.client.calls  # type: ignore[attr-defined]
    for (_, dead, _, _), (_, next_decode, ids, resumed) in itertools.pairwise(calls):
        assert next_decode != dead  # never back to the instance that just died
        done = len(ids) - len(PROMPT)
        assert ids[len(PROMPT) :] == tokens[:done]
        assert resumed.max_tokens == 40 - done and resumed.output_offset == done
    assert router.attempts.load.snapshot() == {} and router._transcripts == {}


def test_a_seeded_request_continues_its_seed_stream(model: ModelInfo) -> None:
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=7)
    _, router = play(model, [10, 5], params)
    offsets = [p.output_offset for *_, p in router.client.calls]  # type: ignore[attr-defined]
    assert offsets == [0, 10, 15]
    assert router.metrics.migrations.labels("instance_lost")._value.get() == 2


def test_past_the_migration_limit_the_stream_ends_with_an_error(model: ModelInfo) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    client = DyingDecodes(model.tokenizer, [3, 3, 3], DecodeUnavailableError("gone"))
    router = make_router(model, client, migration_limit=2)
    stream = router.generate("r", PROMPT, params)
    received = []
    with pytest.raises(InstanceUnavailableError, match="after 2 migrations"):
        collect(stream, received)
    assert len(received) == 9 and router.attempts.load.snapshot() == {}


def test_a_context_longer_than_migration_max_tokens_does_not_migrate(model: ModelInfo) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with pytest.raises(InstanceUnavailableError, match="migration_max_tokens"):
        play(model, [10], params, migration_max_tokens=len(PROMPT) + 5)


def test_a_failed_step_migrates_too(model: ModelInfo) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    client = DyingDecodes(model.tokenizer, [4], StepFailedError("the step failed"))
    router = make_router(model, client)
    tokens, _, final = summary(collect(router.generate("r", PROMPT, params)))
    assert len(tokens) == 20 and final.finish_reason == "length"
    assert router.metrics.migrations.labels("step_failed")._value.get() == 1


def test_a_request_aborted_as_its_decode_dies_does_not_migrate(model: ModelInfo) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    client = DyingDecodes(model.tokenizer, [4], DecodeUnavailableError("gone"))
    router = make_router(model, client)
    client.on_death = lambda: router.abort("r")  # the client leaves as the stream breaks
    with pytest.raises(RequestAbortedError):
        collect(router.generate("r", PROMPT, params))
    assert len(client.calls) == 1 and client.aborted == ["r"]
    assert router.attempts.load.snapshot() == {} and router._transcripts == {}
