"""Sampler: greedy, temperature, min-p, top-k and top-p for a whole batch in one pass, with a
reproducible per-request seed."""

from collections.abc import Sequence

import torch

from pdserve.engine.grammar import apply_masks
from pdserve.engine.logits import SamplingRow, adjust_logits
from pdserve.engine.request import SamplingParams, TokenLogprob


class Sampler:
    """Pick one token per row of logits: greedy rows by one argmax, the others by one filtering
    pass (`filtered_probs`) and the exponential race (`argmax(p / noise)`, noise Exponential(1)),
    which draws from `p` with no sort-and-cumsum per row.

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
        i's request has generated so far. Returns the chosen token id per row (one copy)."""
        tokens = torch.argmax(logits, dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            chosen = [params[i] for i in rows]
            probs = filtered_probs(logits[index], chosen)
            noise = self._noise(probs, chosen, [output_indices[i] for i in rows])
            tokens[index] = (probs / noise).argmax(dim=-1)  # the exponential race
        return [int(t) for t in tokens.tolist()]

    def _noise(
        self, probs: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
    ) -> torch.Tensor:
        """Exponential(1) noise per row: `argmax(p / noise)` draws from `p`. Unseeded rows in
        one draw from the engine's generator; a seeded row from its own (seed, index)
        generator, so its token depends on nothing else in the batch."""
        noise = torch.empty_like(probs)
        unseeded = [r for r, p in enumerate(params) if p.seed is None]
        if unseeded:
            draw = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            draw.exponential_(generator=self._default_generator)
            noise[torch.tensor(unseeded, device=probs.device)] = draw
        for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
            if p.seed is not None:
                noise[row].exponential_(generator=self._seeded(p.seed, p.output_offset, index))
        return noise

    def _seeded(self, seed: int, output_offset: int, output_index: int) -> torch.Generator:
        """The generator of a seeded request's token number `output_offset + output_index`."""
        seed = (seed * 1_000_003 + output_offset + output_index) % 2**63
        return torch.Generator(device=self.device).manual_seed(seed)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities of the rows after temperature, min-p, top-k and top-p, for every row in
    one pass (one sort, only when a row needs it)."""
    vocab = logits.shape[-1]
    column = torch.tensor
    scores = logits / column([p.temperature for p in params], device=logits.device)[:, None]
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(scores, dim=-1)
        floor = column([p.min_p for p in params], device=logits.device)[:, None]
        scores = scores.masked_fill(probs < floor * probs.amax(-1, keepdim=True), float("-inf"))
    top_k = [p.top_k if p.top_k is not None and p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params):
        ranked, order = torch.sort(scores, dim=-1, descending=True)
        ks = column(top_k, device=logits.device)[:, None]
        ranked = ranked.masked_fill(torch.arange(vocab, device=logits.device) >= ks, float("-inf"))
        ranked_probs = torch.softmax(ranked, dim=-1)
        mass_before = torch.cumsum(ranked_probs, dim=-1) - ranked_probs
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        limit = column(top_p, device=logits.device)[:, None]
        ranked = ranked.masked_fill(mass_before >= limit, float("-inf"))
        scores = torch.empty_like(scores).scatter_(-1, order, ranked)
    return torch.softmax(scores, dim=-1)


def token_logprob(table: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s entry of one row of log-probabilities, with the `top` most likely tokens."""
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(table, top)
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(table[token]), best)
