"""Sampler: greedy, temperature, top-k and top-p, with a reproducible per-request seed."""

from collections.abc import Sequence

import torch

from pdserve.engine.grammar import apply_masks
from pdserve.engine.logits import SamplingRow, adjust_logits
from pdserve.engine.request import SamplingParams, TokenLogprob


class Sampler:
    """Pick one token per row of logits. Greedy rows are batched.

    A seeded request draws its n-th output token from a generator seeded by (seed, n): the same
    tokens whatever shares its batch, on whichever instance (prefill samples the first token,
    decode the rest) and after preemption. Unseeded requests share the engine's generator.

    Engine thread only (the engine's owner calls it in `step`).
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._default_generator = torch.Generator(device=device).manual_seed(seed)

    def sample_rows(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """Adjust the logits as each row's request asks (`adjust_logits`), sample, and give
        the logprobs of the rows that ask for them."""
        adjust_logits(logits, rows)
        apply_masks(logits, [r.grammar for r in rows])
        params = [r.sampling_params for r in rows]
        tokens = self.sample(logits, params, [len(r.output_token_ids) for r in rows])
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if wanted:
            table = torch.log_softmax(logits[wanted].float(), dim=-1)
            for row, i in enumerate(wanted):
                logprobs[i] = token_logprob(table[row], tokens[i], params[i].logprobs or 0)
        return list(zip(tokens, logprobs, strict=True))

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
    ) -> list[int]:
        """`logits` is fp32 `[len(params), vocab]`; `output_indices[i]` is how many tokens row
        i's request has generated so far. Returns the chosen token id per row."""
        tokens = torch.argmax(logits, dim=-1)
        for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, self._generator(p, index))
        return [int(t) for t in tokens.tolist()]

    def _generator(self, params: SamplingParams, output_index: int) -> torch.Generator:
        if params.seed is None:
            return self._default_generator
        seed = (params.seed * 1_000_003 + params.output_offset + output_index) % 2**63
        return torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def _sample_row(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> int:
        scores = logits / params.temperature
        if params.min_p > 0.0:
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        if params.top_k is not None and params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            scores = _top_p_filter(scores, params.top_p)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprob(table: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s entry of one row of log-probabilities, with the `top` most likely tokens."""
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(table, top)
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(table[token]), best)


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches `top_p` (at least one)."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
