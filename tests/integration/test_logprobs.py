"""Output logprobs equal `log_softmax` of transformers' logits (fp32 tiny model), in one engine
and across prefill + decode through the router (the first token's from prefill, the rest from
decode), and in the router's OpenAI shapes."""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from reference import hf_model
from stacks import Stack, pd_stack

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine, SamplingParams
from services.router.pd_client import TokenDelta

PROMPT = [5, 17, 99, 42, 7, 7, 7, 250, 31, 8]
STEPS = 8


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path) -> Iterator[Stack]:
    with pd_stack(tiny_model_dir, engine={"num_kv_blocks": 64}) as stack:
        yield stack


@torch.no_grad()
def reference(model: torch.nn.Module, tokens: list[int]) -> list[torch.Tensor]:
    """log_softmax at each output position of PROMPT + tokens."""
    logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()
    return [torch.log_softmax(logits[len(PROMPT) - 1 + i], -1) for i in range(len(tokens))]


def check(
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]], ref: list[torch.Tensor]
) -> None:
    assert len(logprobs) == len(ref)
    for (token, value, top), table in zip(logprobs, ref, strict=True):
        assert abs(value - float(table[token])) < 1e-4
        best = torch.topk(table, len(top))
        assert [t for t, _ in top] == best.indices.tolist()
        assert all(abs(v - float(table[t])) < 1e-4 for t, v in top)


def test_output_logprobs_equal_transformers_in_one_engine_and_across_pd(
    pd: Stack, tiny_model_dir: Path
) -> None:
    model = hf_model(tiny_model_dir)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=5)
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    request_id = engine.add_request(PROMPT, params)
    single = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                single += [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
    tokens = [t for t, _, _ in single]
    check(single, reference(model, tokens))
    split = [(lp.token_id, lp.logprob, lp.top)
             for e in pd.generate(list(PROMPT), params).events
             if isinstance(e, TokenDelta) for lp in e.logprobs]  # fmt: skip
    assert [t for t, _, _ in split] == tokens
    check(split, reference(model, tokens))


def test_openai_shapes_for_completions_and_chat_streaming_or_not(pd: Stack) -> None:
    api = openai.OpenAI(base_url=f"{pd.url}/v1", api_key="unused", max_retries=0)
    done = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=STEPS, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens and len(lp.token_logprobs or []) == STEPS
    assert lp.top_logprobs is not None and all(len(t) == 3 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=STEPS,
                                      temperature=0, logprobs=3, stream=True,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    values = [v for c in streamed if c.choices and c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs or []]  # fmt: skip
    assert values == lp.token_logprobs
    messages = [{"role": "user", "content": "hi"}]
    chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                       temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert chat.usage is not None and content is not None
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.bytes is not None for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    api.close()


def test_echo_returns_the_prompt_logprobs_computed_on_prefill(
    pd: Stack, tiny_model_dir: Path
) -> None:
    """`echo` + `logprobs` + `max_tokens: 0` (how lm-eval scores log-likelihoods): the prompt's
    per-token logprobs (the first token's null), equal to transformers' log_softmax, nothing
    generated; the prompt is computed in full even when it is cached."""
    api = openai.OpenAI(base_url=f"{pd.url}/v1", api_key="unused", max_retries=0)
    model = hf_model(tiny_model_dir)
    with torch.no_grad():
        table = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1)
    expected = [None] + [float(table[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    for _ in range(2):  # the second time the prompt is in the prefix cache
        done = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                      logprobs=2, temperature=0)  # fmt: skip
        lp = done.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1:], expected[1:],
                                                      strict=True))  # fmt: skip
        assert all(len(t) == 2 for t in lp.top_logprobs[1:])
        assert done.usage is not None and done.usage.completion_tokens == 0
        assert done.choices[0].finish_reason == "length"
    text = api.completions.create(model="tiny", prompt="Hello there", max_tokens=3, echo=True,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert text.choices[0].text.startswith("Hello there") and len(text.choices[0].text) > 11
    chunks = list(api.completions.create(model="tiny", prompt="Hello there", max_tokens=3,
                                         echo=True, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text
    api.close()
