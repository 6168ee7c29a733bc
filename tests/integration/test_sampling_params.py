"""Sampling parameters change greedy output the way their definitions say, identically in one
engine (mixed mode) and across prefill + decode instances behind the router (carried through the
proto), and equal
transformers' generation with the matching logits processors."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from reference import hf_model
from stacks import Stack, pd_stack
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine, SamplingParams
from services.router.pd_client import Finished, TokenDelta

PROMPT = [5, 17, 99, 42, 7, 7, 7, 250, 31, 8]
STEPS = 16


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path) -> Iterator[Stack]:
    with pd_stack(tiny_model_dir, engine={"num_kv_blocks": 64}) as stack:
        yield stack


@torch.no_grad()
def hf_generate(model: torch.nn.Module, params: SamplingParams, eos: int | None) -> list[int]:
    processors = LogitsProcessorList()
    stops = [*params.stop_token_ids, *([eos] if eos is not None else [])]
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(PROMPT), params.min_tokens, stops))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    ids = list(PROMPT)
    while len(ids) - len(PROMPT) < params.max_tokens:
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        scores = processors(torch.tensor([ids]), logits[None])[0]
        output = torch.tensor(ids[len(PROMPT) :], dtype=torch.long)
        counts = torch.bincount(output, minlength=scores.shape[-1])[: scores.shape[-1]].float()
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        token = int(scores.argmax())
        ids.append(token)
        if token in stops:
            break
    return ids[len(PROMPT) :]


def pd_generate(pd: Stack, params: SamplingParams) -> list[int]:
    generation = pd.generate(list(PROMPT), params)
    assert all(isinstance(event, TokenDelta | Finished) for event in generation.events)
    return generation.tokens


def run(engine: LLMEngine, params: SamplingParams) -> list[int]:
    [completion] = engine.generate([PROMPT], params)
    return list(completion.token_ids)


def test_each_parameter_matches_transformers_in_one_engine_and_across_pd(
    engine: LLMEngine, pd: Stack, tiny_model_dir: Path
) -> None:
    model = hf_model(tiny_model_dir)
    plain = run(engine, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    first, second = plain[0], plain[1]
    cases = {
        "forced": SamplingParams(max_tokens=STEPS, ignore_eos=True, logit_bias=((77, 100.0),)),
        "banned": SamplingParams(max_tokens=STEPS, ignore_eos=True, logit_bias=((first, -100.0),)),
        "repetition": SamplingParams(max_tokens=STEPS, ignore_eos=True, repetition_penalty=2.0),
        "presence": SamplingParams(max_tokens=STEPS, ignore_eos=True, presence_penalty=2.0),
        "frequency": SamplingParams(max_tokens=STEPS, ignore_eos=True, frequency_penalty=1.5),
        "stop": SamplingParams(max_tokens=STEPS, ignore_eos=True, stop_token_ids=(second,)),
        "min_tokens": SamplingParams(
            max_tokens=STEPS, ignore_eos=True, stop_token_ids=(second,), min_tokens=6
        ),
    }
    results = {}
    for name, params in cases.items():
        tokens = run(engine, params)
        assert tokens == hf_generate(model, params, None), name
        assert pd_generate(pd, params) == tokens, name
        results[name] = tokens
    assert results["forced"] == [77] * STEPS  # +100 forces the token
    assert first not in results["banned"]  # -100 bans it
    assert results["repetition"] != plain  # (presence/frequency: equal to the formula above;
    # the tiny model's logit margins are often wider than their 2.0 at most)
    assert len(set(results["presence"])) >= len(set(plain))  # no more repeats than before
    assert results["stop"] == plain[:2]  # the stop token ends it at once ...
    assert len(results["min_tokens"]) >= 6  # ... but not before min_tokens
