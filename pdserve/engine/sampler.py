"""Sampler: greedy, temperature, top-k and top-p, with a reproducible per-request seed."""

from collections.abc import Sequence

import torch

from pdserve.engine.request import SamplingParams


class Sampler:
    """Pick one token per row of logits. Greedy rows are batched; random rows draw from their
    request's generator (seeded when the request gives a seed), so a seeded request samples the
    same tokens whatever else shares its batch."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._default_generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def sample(
        self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> list[int]:
        """`logits` is fp32 `[len(params), vocab]`; returns the chosen token id per row."""
        tokens = torch.argmax(logits, dim=-1)
        for row, (request_id, p) in enumerate(zip(request_ids, params, strict=True)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, self._generator(request_id, p))
        return [int(t) for t in tokens.tolist()]

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default_generator
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self._generators[request_id] = generator
        return generator

    @staticmethod
    def _sample_row(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> int:
        scores = logits / params.temperature
        if params.top_k is not None and params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            scores = _top_p_filter(scores, params.top_p)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator).item())


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches `top_p` (at least one)."""
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
