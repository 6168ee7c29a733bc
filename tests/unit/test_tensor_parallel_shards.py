"""Tensor-parallel parts without processes: what each rank reads of a checkpoint (slices only,
which together are the whole tensor), the sizes that split, and the step inputs' wire form."""

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from pdserve.errors import ConfigError
from pdserve.model.loader import _read
from pdserve.model.parallel import Shard, StepInputs, check_divides, pack, payload_size, unpack

VOCAB = 262  # the tiny model's


class SlicesOnly:
    """A checkpoint file that serves slices and refuses whole tensors."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.sliced: list[str] = []

    def keys(self) -> list[str]:
        return list(self._file.keys())

    def get_slice(self, name: str) -> Any:
        self.sliced.append(name)
        return self._file.get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        raise AssertionError(f"a rank read the whole of {name}")


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_only_slices_which_together_are_the_checkpoint(
    tiny_model_dir: Path, size: int
) -> None:
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as file:
        names = list(file.keys())
        proxy = SlicesOnly(file)
        for name in names:
            parts = [_read(proxy, name, Shard(rank, size), VOCAB) for rank in range(size)]
            whole = file.get_tensor(name)
            module, leaf = name.split(".")[-2:]
            if module in ("embed_tokens", "lm_head"):
                rows = -(-VOCAB // size)
                assert all(p.shape[0] == rows for p in parts)  # the last rank padded
                assert torch.equal(torch.cat(parts)[:VOCAB], whole)
                assert not torch.cat(parts)[VOCAB:].any()
            elif module in ("o_proj", "down_proj") and leaf == "weight":
                assert torch.equal(torch.cat(parts, dim=1), whole)
            elif module.endswith("_proj"):
                assert torch.equal(torch.cat(parts), whole)
            else:  # norms: every rank holds them whole
                assert all(torch.equal(p, whole) for p in parts)
        assert sorted(set(proxy.sliced)) == sorted(names)


def test_a_size_must_split_heads_kv_heads_and_the_mlp() -> None:
    check_divides(Shard(0, 4), 8, 4, 704)
    with pytest.raises(ConfigError, match="does not divide the model's KV heads"):
        check_divides(Shard(0, 8), 8, 4, 704)  # KV heads are split, never replicated
    with pytest.raises(ConfigError, match="attention heads"):
        check_divides(Shard(0, 3), 8, 4, 704)
    assert Shard(3, 4).vocab_rows(VOCAB) == (198, 66)


def test_step_inputs_travel_as_one_payload_and_come_back_equal() -> None:
    step = StepInputs(
        token_ids=torch.tensor([5, 6, 7, 9]),
        per_seq=torch.tensor([[0, 40], [3, 1], [3, 41]]),
        block_tables=torch.tensor([[1, 0, 0], [4, 5, 6]]),
        logit_rows=torch.tensor([2, 3]),
        all_logits=torch.tensor([0]),
        query_lens=[3, 1],
        context_lens=[3, 41],
    )
    header, payload = pack(step)
    fields = struct.unpack("<7q", header)
    assert payload_size(fields) == payload.numel()
    back = unpack(fields, payload)
    for name in ("token_ids", "per_seq", "block_tables", "logit_rows", "all_logits"):
        assert torch.equal(getattr(back, name), getattr(step, name)), name
    assert (back.query_lens, back.context_lens) == ([3, 1], [3, 41])
