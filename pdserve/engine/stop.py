"""When a generation ends: one rule for the engine, which applies it to every sampled token,
and for the router, which applies it to a migrated request's earlier output (the instance that
produced the last token may have died before it sent the final reply).

Stop strings are not here: they need text, which the detokenizer (`OutputProcessor` on an
instance, `Transcript` in the router after a migration) checks.
"""

from collections.abc import Collection, Sequence

from pdserve.engine.request import RequestStatus, SamplingParams


def stop_status(
    output_token_ids: Sequence[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    *,
    eos_token_ids: Collection[int],
    max_model_len: int,
    grammar_ended: bool = False,
) -> RequestStatus | None:
    """How the generation ends with its newest output token; None while it goes on.

    FINISHED_STOPPED: that token is one of `params.stop_token_ids` or, unless
    `params.ignore_eos`, one of the model's `eos_token_ids`; or the grammar of a structured
    output accepted its end (`grammar_ended`). FINISHED_LENGTH: `params.max_tokens` output
    tokens, or prompt and output fill the context window (`max_model_len`). Pure: it reads its
    arguments only. `output_token_ids` holds at least one token.
    """
    token = output_token_ids[-1]
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if grammar_ended:
        return RequestStatus.FINISHED_STOPPED
    num_output_tokens = len(output_token_ids)
    if (
        num_output_tokens >= params.max_tokens
        or num_prompt_tokens + num_output_tokens >= max_model_len
    ):
        return RequestStatus.FINISHED_LENGTH
    return None
