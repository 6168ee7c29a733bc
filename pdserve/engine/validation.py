"""What a prompt must satisfy before it is generated from: one owner for the router's HTTP edge
and the engine (every instance checks again: its context window may be smaller, its KV cache
holding fewer tokens than the model's window). The context window itself is
`ModelConfig.context_window`.
"""

from collections.abc import Sequence

from pdserve.engine.request import SamplingParams
from pdserve.errors import InvalidRequestError, PromptTooLongError


def validate_prompt(
    token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int, max_model_len: int
) -> None:
    """Raise InvalidRequestError for an empty prompt or a prompt or `logit_bias` token id
    outside the vocabulary, PromptTooLongError when the prompt leaves no room for one output
    token in the context window (`max_model_len`). A generation that reaches the window ends
    there (`stop_status`: `length`)."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty: send at least one token")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab_size}): {bad} is outside the vocabulary"
        )
    bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"logit_bias token ids must be in [0, {vocab_size}): {bad} is outside the vocabulary"
        )
    if len(token_ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(token_ids)} tokens but the context window is {max_model_len} "
            "tokens (this model's maximum context length) and at least one is needed for "
            "output: shorten the prompt"
        )


def validate_request(
    token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int, max_model_len: int
) -> None:
    """`validate_prompt`, and PromptTooLongError when the prompt and `max_tokens` together
    exceed the context window (OpenAI's rule, for the HTTP edge: an instance given such a
    request ends it at the window instead)."""
    validate_prompt(token_ids, params, vocab_size=vocab_size, max_model_len=max_model_len)
    wanted = len(token_ids) + params.max_tokens
    if wanted > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{wanted} ({len(token_ids)} in the prompt, {params.max_tokens} to generate): "
            f"lower max_tokens to at most {max_model_len - len(token_ids)}"
        )
