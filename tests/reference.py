"""Hugging Face `transformers` as the reference implementation for equality tests."""

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits at every position of one sequence."""
    return model(torch.tensor([list(token_ids)])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, token_ids: Sequence[int], steps: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, eos ignored."""
    out = model(torch.tensor([list(token_ids)]), use_cache=True)
    generated = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[generated[-1]]]), cache=out.past_key_values, use_cache=True)
        generated.append(int(out.logits[0, -1].argmax()))
    return generated
