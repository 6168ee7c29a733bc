"""Logits adjustments a request asks for, applied before sampling (greedy or not), batched over
the rows that ask for any: `min_tokens` (EOS and stop token ids banned until then),
`logit_bias`, `repetition_penalty` (vLLM/transformers: over prompt and output tokens, a positive
logit divided by it, a negative one multiplied), `frequency_penalty` and `presence_penalty`
(OpenAI: over output tokens, `logit -= frequency * count + presence * (count > 0)`). Logprobs,
when they come, are computed from the adjusted logits, as vLLM documents.

A migrated request (`SamplingParams.output_offset`) has its earlier output at the end of its
prompt: it counts as output here.
"""

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pdserve.engine.request import SamplingParams


class SamplingRow(Protocol):
    """What the adjustments read of a request (`Request` has it)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    @property
    def grammar(self) -> Any: ...


@torch.inference_mode()
def adjust_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` `[len(rows), vocab]` fp32, adjusted in place for the rows that ask; returned."""
    adjusted = [i for i, row in enumerate(rows) if row.sampling_params.adjusts_logits]
    if not adjusted:
        return logits
    vocab = logits.shape[-1]
    for i in adjusted:
        row, params = rows[i], rows[i].sampling_params
        offset = params.output_offset
        prompt = row.prompt_token_ids[: len(row.prompt_token_ids) - offset]
        output = [*row.prompt_token_ids[len(prompt) :], *row.output_token_ids]
        scores = logits[i]
        if params.min_tokens and len(output) < params.min_tokens:
            banned = [t for t in (*row.eos_token_ids, *params.stop_token_ids) if t < vocab]
            if banned:
                scores[banned] = float("-inf")
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=scores.device)
            bias = torch.tensor([b for _, b in params.logit_bias], device=scores.device)
            scores.index_add_(0, ids, bias.to(scores.dtype))
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=scores.device)
            if seen.numel():
                picked = scores[seen]
                penalty = params.repetition_penalty
                scores[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
        if output and (params.frequency_penalty or params.presence_penalty):
            counts = torch.bincount(
                torch.tensor(output, dtype=torch.long, device=scores.device), minlength=vocab
            )[:vocab].to(scores.dtype)
            scores -= params.frequency_penalty * counts
            scores -= params.presence_penalty * (counts > 0).to(scores.dtype)
    return logits
