"""Sampler, sampling parameter validation and incremental detokenization."""

from pathlib import Path

import pytest
import torch

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import SamplingParams
from pdserve.engine.sampler import Sampler, filtered_probs
from pdserve.errors import InvalidRequestError
from pdserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    sampler = Sampler(torch.device("cpu"))
    assert sampler.sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]


def test_top_k_never_samples_outside_the_k_best() -> None:
    logits = torch.tensor([[5.0, 4.9, 4.8, -1.0, 4.7]])
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=2.0, top_k=2)
    drawn = {sampler.sample(logits, [params], [0])[0] for _ in range(200)}
    assert drawn == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[None].repeat(3, 1)
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.8, 0.81, 1e-9)]
    kept = (filtered_probs(logits, params) > 0).tolist()  # every row in one pass
    assert kept == [
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, False],
    ]


def test_each_row_gets_its_own_filters_in_one_batch() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.0]]).repeat(4, 1)
    params = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9),
    ]
    probs = filtered_probs(logits, params)
    assert (probs > 0).tolist() == [
        [True, True, False, False, False],
        [True, True, False, False, True],
        [True] * 5,
        [True, True, False, False, False],  # top 3 at T=0.5: .49 .44 .07 -> 0.9 keeps two
    ]
    torch.testing.assert_close(probs[2], torch.softmax(logits[2], -1))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_draws_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    sampler = Sampler(torch.device("cpu"), seed=5)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sampler.sample(logits, [params], [0])[0]] += 1
    expected = torch.softmax(logits[0], -1) * 4000
    assert ((counts - expected).abs() < 5 * expected.sqrt()).all()  # within 5 sigma


def test_seeded_request_draws_the_same_tokens_in_any_company() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=7)
    first = Sampler(torch.device("cpu"))
    second = Sampler(torch.device("cpu"), seed=123)
    draws_a = [first.sample(logits[1:2], [seeded], [i])[0] for i in range(20)]
    draws_b = [
        second.sample(logits, [SamplingParams(temperature=1.0), seeded, seeded], [0, i, 5])[1]
        for i in range(20)
    ]
    assert draws_a == draws_b
    assert len(set(draws_a)) > 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": 0},
        {"stop": ("",)},
        {"stop_token_ids": (-1,)},
    ],
)
def test_sampling_params_reject_out_of_range_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_detokenizer_holds_back_incomplete_utf8(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("aé€b", add_special_tokens=False)  # 1 + 2 + 3 + 1 bytes
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.update(ids[: i + 1], finished=False) for i in range(len(ids))]
    assert deltas == ["a", "", "é", "", "", "€", "b"]
    assert detok.text == "aé€b"


def test_detokenizer_finds_a_stop_string_split_across_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello STOP world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    streamed = ""
    for i in range(len(ids)):
        streamed += detok.update(ids[: i + 1], finished=False)
        if detok.stop_reason:
            break
    assert streamed == "hello "
    assert detok.stop_reason == "STOP"
    assert detok.text == "hello "


def test_detokenizer_flushes_held_back_text_when_finished(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("abcST", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    partial = detok.update(ids, finished=False)
    assert partial == "ab"
    assert detok.update(ids, finished=True) == "cST"
    assert detok.stop_reason is None


def test_an_output_offset_continues_the_seed_stream() -> None:
    """A migrated request resumes with its earlier output in the prompt: its n-th new token is
    drawn as the (offset + n)-th of the undisturbed run."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=1.5, seed=11)
    undisturbed = [sampler.sample(logits, [params], [n])[0] for n in range(40)]
    resumed = SamplingParams(temperature=1.5, seed=11, output_offset=25)
    assert [sampler.sample(logits, [resumed], [n])[0] for n in range(15)] == undisturbed[25:]
    assert len(set(undisturbed)) > 5  # the draws do depend on the index


def test_an_incomplete_utf8_tail_is_flushed_as_replacement_at_the_end(
    tokenizer: Tokenizer,
) -> None:
    """Held back while the sequence may still complete; at the end shown as U+FFFD, as a
    whole-sequence decode shows it, so the text agrees with the token count."""
    partial = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "\ufffd")
    tokens = [*tokenizer.encode("ok ", add_special_tokens=False), partial]
    detokenizer = IncrementalDetokenizer(tokenizer)
    shown = detokenizer.update(tokens, finished=False)
    assert not shown.endswith("\ufffd")
    shown += detokenizer.update(tokens, finished=True)
    assert shown == tokenizer.decode(tokens) and shown.endswith("\ufffd")


def test_min_p_never_samples_below_its_share_of_the_top_probability() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, 1.0]])  # probs ~ .39 .35 .05 .02 .14
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=1.0, min_p=0.3)  # keeps >= 0.3 x 0.39 = 0.12
    drawn = {sampler.sample(logits, [params], [n])[0] for n in range(300)}
    assert drawn == {0, 1, 4}
