"""Each sampling limit has one definition (`pdserve.engine.request`): the OpenAI schema accepts
a value exactly when SamplingParams does."""

import math

import pydantic
import pytest

from pdserve.engine.request import SamplingParams
from pdserve.errors import InvalidRequestError
from services.router.openai_schema import ChatCompletionRequest, CompletionRequest

EDGES = {
    "temperature": (-0.01, 0.0, 2.0, 2.01, math.nan),
    "top_p": (0.0, 1e-9, 1.0, 1.01),
    "min_p": (-0.01, 0.0, 1.0, 1.01),
    "presence_penalty": (-2.01, -2.0, 2.0, 2.01),
    "frequency_penalty": (-2.01, -2.0, 2.0, 2.01),
    "repetition_penalty": (0.0, 1e-9, 10.0, 10.01),
    "logprobs": (-1, 0, 20, 21),
}


def schema_accepts(name: str, value: float) -> bool:
    try:
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", name: value})
    except pydantic.ValidationError:
        return False
    return True


def params_accept(name: str, value: float) -> bool:
    try:
        SamplingParams(**{name: value})  # type: ignore[arg-type]
    except InvalidRequestError:
        return False
    return True


@pytest.mark.parametrize(
    ("name", "value"), [(name, value) for name, values in EDGES.items() for value in values]
)
def test_the_openai_schema_and_sampling_params_agree_on_each_range(name: str, value: float) -> None:
    assert schema_accepts(name, value) == params_accept(name, value)


def test_top_logprobs_has_the_logprobs_range() -> None:
    messages = [{"role": "user", "content": "hi"}]
    ok = {"model": "m", "messages": messages, "logprobs": True, "top_logprobs": 20}
    ChatCompletionRequest.model_validate(ok)
    with pytest.raises(pydantic.ValidationError, match="top_logprobs"):
        ChatCompletionRequest.model_validate({**ok, "top_logprobs": 21})


def test_a_value_outside_a_range_is_named_with_the_range() -> None:
    with pytest.raises(InvalidRequestError, match=r"temperature must be in \[0, 2\], got 2.5"):
        SamplingParams(temperature=2.5)
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
