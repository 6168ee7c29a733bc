"""Logits adjustments against transformers' logits processors (and OpenAI's formula for the
presence and frequency penalties, which transformers lacks)."""

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.engine.logits import adjust_logits
from pdserve.engine.request import SamplingParams
from pdserve.errors import InvalidRequestError

VOCAB = 32
EOS = 3


@dataclass
class Row:
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = field(default=(EOS,))


def reference(logits: torch.Tensor, row: Row) -> torch.Tensor:
    p = row.sampling_params
    ids = torch.tensor([[*row.prompt_token_ids, *row.output_token_ids]])
    processors = LogitsProcessorList()
    if p.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(
            len(row.prompt_token_ids), p.min_tokens, [EOS, *p.stop_token_ids]
        ))  # fmt: skip
    if p.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias}))
    if p.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    scores = processors(ids, logits.clone()[None])[0]
    counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=VOCAB)
    return scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@settings(max_examples=80, deadline=None)
@given(
    prompt=tokens.filter(bool),
    output=tokens,
    min_tokens=st.integers(0, 6),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -2.5, 4.0, 100.0])),
    repetition=st.sampled_from([1.0, 0.5, 1.25, 2.0]),
    presence=st.sampled_from([0.0, -1.5, 2.0]),
    frequency=st.sampled_from([0.0, 0.5, -2.0]),
    seed=st.integers(0, 1000),
)
def test_adjustments_equal_transformers_processors(
    prompt: list[int], output: list[int], min_tokens: int, bias: dict[int, float],
    repetition: float, presence: float, frequency: float, seed: int,
) -> None:  # fmt: skip
    params = SamplingParams(
        max_tokens=16, min_tokens=min_tokens, logit_bias=tuple(sorted(bias.items())),
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
        stop_token_ids=(7,),
    )  # fmt: skip
    row = Row(params, prompt, output)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    expected = reference(logits, row)
    adjusted = adjust_logits(logits.clone()[None], [row])[0]
    assert torch.allclose(adjusted, expected, atol=1e-5)


def test_a_migrated_request_counts_its_earlier_output_as_output() -> None:
    """output_offset: the prompt's tail is earlier output (penalties and min_tokens see it)."""
    params = SamplingParams(max_tokens=8, frequency_penalty=1.0, min_tokens=3, output_offset=2)
    row = Row(params, [1, 2, 5, 5], [6])  # 5, 5 were generated before the migration
    scores = adjust_logits(torch.zeros(1, VOCAB), [row])[0]
    assert scores[5] == -2.0 and scores[6] == -1.0 and scores[1] == 0.0
    assert scores[EOS] == 0.0  # 3 outputs already: min_tokens is met


def test_rows_that_ask_nothing_are_left_alone() -> None:
    logits = torch.randn(2, VOCAB)
    rows = [
        Row(SamplingParams(), [1], [2, 2]),
        Row(SamplingParams(logit_bias=((4, 9.0),)), [1], []),
    ]
    adjusted = adjust_logits(logits.clone(), rows)
    assert torch.equal(adjusted[0], logits[0]) and adjusted[1, 4] == logits[1, 4] + 9.0


@pytest.mark.parametrize(
    "bad",
    [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
     {"min_tokens": 20}, {"min_p": 1.5}, {"logit_bias": ((1, 101.0),)}],
)  # fmt: skip
def test_out_of_range_values_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=16, **bad)  # type: ignore[arg-type]
