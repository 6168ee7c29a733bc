"""Prompt validation and the context window: one owner for the router's edge and the engine."""

import re
from pathlib import Path

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import SamplingParams
from pdserve.engine.validation import validate_prompt, validate_request
from pdserve.errors import InvalidRequestError, PromptTooLongError
from pdserve.model.config import ModelConfig

VOCAB = 100


@pytest.mark.parametrize(
    ("token_ids", "params", "error", "message"),
    [
        ([], SamplingParams(), InvalidRequestError, "the prompt is empty"),
        ([1, 100], SamplingParams(), InvalidRequestError, "prompt token ids must be in [0, 100)"),
        ([1, -1], SamplingParams(), InvalidRequestError, "-1 is outside the vocabulary"),
        ([1], SamplingParams(logit_bias=((100, 1.0),)), InvalidRequestError, "logit_bias"),
        ([1] * 10, SamplingParams(), PromptTooLongError, "context window is 10 tokens"),
        ([1] * 11, SamplingParams(), PromptTooLongError, "maximum context length"),
    ],
)
def test_a_bad_prompt_is_refused_with_what_to_change(
    token_ids: list[int], params: SamplingParams, error: type[Exception], message: str
) -> None:
    for validate in (validate_prompt, validate_request):
        with pytest.raises(error, match=re.escape(message)):
            validate(token_ids, params, vocab_size=VOCAB, max_model_len=10)


def test_only_the_edge_refuses_a_prompt_and_max_tokens_beyond_the_window() -> None:
    params = SamplingParams(max_tokens=5)
    validate_prompt([1] * 6, params, vocab_size=VOCAB, max_model_len=10)  # ends at the window
    validate_request([1] * 5, params, vocab_size=VOCAB, max_model_len=10)
    with pytest.raises(PromptTooLongError, match="lower max_tokens to at most 4"):
        validate_request([1] * 6, params, vocab_size=VOCAB, max_model_len=10)


def test_the_context_window_is_the_setting_capped_by_the_model_and_the_kv_cache(
    tiny_model_dir: Path,
) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)
    model = config.max_position_embeddings
    assert config.context_window() == model
    assert config.context_window(128) == 128
    assert config.context_window(model + 1) == model
    assert config.context_window(None, kv_cache_tokens=64) == 64
    assert config.context_window(128, kv_cache_tokens=512) == 128


def test_the_engine_refuses_a_logit_bias_outside_the_vocabulary(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8))
    vocab = engine.loaded.config.vocab_size
    assert engine.max_model_len == 8 * engine.block_size  # its KV cache holds no more
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias=((vocab, 5.0),)))
    assert not engine.has_unfinished_requests()
