"""Tensor-parallel parts without processes: what each rank reads of a checkpoint (slices only,
which together are the whole tensor), the sizes that split, and the step inputs' wire form."""

import os
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from pdserve.errors import ConfigError
from pdserve.model.config import ModelConfig
from pdserve.model.llama import CausalLM
from pdserve.model.loader import _ExpertWeights, _read
from pdserve.model.parallel import (
    ExpertPart,
    Shard,
    StepInputs,
    check_divides,
    expert_part,
    pack,
    payload_size,
    unpack,
)
from pdserve.model.shm_collectives import PeerGone, ShmCollectives
from pdserve.model.tiny import write_tiny_model

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


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "whole"])
def test_each_rank_reads_only_its_experts_or_its_columns_of_each(
    tmp_path: Path, expert_parallel: bool
) -> None:
    """Two ranks of a Qwen3-MoE (8 experts of width 128): expert parallel, rank r reads experts
    4r..4r+3 whole and never looks at the others; else every rank reads its 64 columns of
    every expert. Together they hold the checkpoint's experts exactly."""
    path = write_tiny_model(tmp_path / "moe", seed=0, architecture="Qwen3MoeForCausalLM")
    config = ModelConfig.from_dir(path)
    projections = ("gate_proj", "up_proj", "down_proj")
    with safe_open(str(path / "model.safetensors"), framework="pt") as file:
        names = [name for name in file.keys() if ".experts." in name]  # noqa: SIM118
        ranks = []
        for rank in range(2):
            with torch.device("meta"):
                model = CausalLM(config, 16, Shard(rank, 2, expert_parallel))
            proxy = SlicesOnly(file)
            weights = _ExpertWeights(model, projections, torch.float32, torch.device("cpu"))
            assert all(weights.take(proxy, name, name) for name in names)
            stacked = {n for n, _ in model.named_parameters() if n.endswith(("gate_up", "down"))}
            assert weights.complete() == stacked
            ranks.append((model.get_submodule("model.layers.2.mlp.experts"), proxy.sliced))
        gate, up, down = (
            file.get_tensor(f"model.layers.2.mlp.experts.5.{p}.weight") for p in projections
        )
    (first, read_first), (second, read_second) = ranks
    if expert_parallel:
        assert not any(".experts.5." in name for name in read_first)  # rank 0: experts 0-3
        assert len(read_first) == len(read_second) == len(names) // 2
        assert torch.equal(second.gate_up[1], torch.cat([gate, up]))
        assert torch.equal(second.down[1], down)
    else:
        assert sorted(read_first) == sorted(read_second) == sorted(names)
        assert torch.equal(torch.cat([first.gate_up[5, :64], second.gate_up[5, :64]]), gate)
        assert torch.equal(torch.cat([first.gate_up[5, 64:], second.gate_up[5, 64:]]), up)
        assert torch.equal(torch.cat([first.down[5], second.down[5]], dim=1), down)


def model_config(architecture: str = "LlamaForCausalLM", **extra: object) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        {
            "architectures": [architecture],
            "vocab_size": VOCAB,
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            **extra,
        }
    )


def test_a_size_must_split_heads_kv_heads_and_the_mlp() -> None:
    check_divides(Shard(0, 4), model_config())
    with pytest.raises(ConfigError, match="does not divide the model's KV heads"):
        check_divides(Shard(0, 8), model_config())  # KV heads are split, never replicated
    with pytest.raises(ConfigError, match="attention heads"):
        check_divides(Shard(0, 3), model_config())
    assert Shard(3, 4).vocab_rows(VOCAB) == (198, 66)


def test_experts_split_by_width_or_whole_and_a_size_must_divide_them() -> None:
    moe = model_config(
        "Qwen3MoeForCausalLM",
        num_attention_heads=16,
        num_key_value_heads=8,
        num_experts=12,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        mlp_only_layers=[1],
    )
    assert moe.moe is not None
    check_divides(Shard(0, 4), moe)  # 96 / 4 columns of every expert
    assert expert_part(Shard(1, 4), moe.moe) == ExpertPart(12, 0, 12, 24, 24)
    assert expert_part(Shard(1, 4, expert_parallel=True), moe.moe) == ExpertPart(12, 3, 3, 0, 96)
    with pytest.raises(ConfigError, match=r"engine\.expert_parallel_size 8 does not divide .* 12"):
        check_divides(Shard(0, 8, expert_parallel=True), moe)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 4 does not divide .*moe_inter"):
        check_divides(
            Shard(0, 4),
            model_config(
                "MixtralForCausalLM",
                num_local_experts=4,
                num_experts_per_tok=2,
                intermediate_size=90,
            ),
        )


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


def _ranks(size: int) -> list[ShmCollectives]:
    first = ShmCollectives.create(size)
    others = [ShmCollectives(first.path, r, size, owner=False) for r in range(1, size)]
    return [first, *others]


def test_shared_memory_collectives_sum_gather_and_broadcast_alike_on_every_rank() -> None:
    """Three ranks (threads standing in for processes), ops back to back: the two slot sets
    alternate and no rank overwrites a slot another still reads."""
    ranks = _ranks(3)
    inputs = [torch.randn(64, 32, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    results: dict[int, list[torch.Tensor | None]] = {}

    def run(rank: int) -> None:
        shm, out = ranks[rank], []
        for step in range(20):
            x = inputs[rank] * (step + 1)
            shm.all_reduce(x, timeout_s=30)
            out.append(x)
            out.append(shm.gather_columns(inputs[rank][:, :4] + step, timeout_s=30))
            payload = torch.full((5,), float(step)) if rank == 0 else torch.zeros(5)
            shm.broadcast(payload, timeout_s=30)
            out.append(payload)
        results[rank] = out

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        for step in range(20):
            total = inputs[0] * (step + 1) + inputs[1] * (step + 1) + inputs[2] * (step + 1)
            summed = [results[r][3 * step] for r in range(3)]
            assert all(torch.equal(s, summed[0]) for s in summed)  # the same bits everywhere
            torch.testing.assert_close(summed[0], total)
            gathered = results[0][3 * step + 1]
            expected = torch.cat([inputs[r][:, :4] + step for r in range(3)], dim=-1)
            assert gathered is not None and torch.equal(gathered, expected)
            assert results[1][3 * step + 1] is None
            assert all(
                torch.equal(results[r][3 * step + 2], torch.full((5,), float(step)))
                for r in range(3)
            )
    finally:
        for shm in ranks:
            shm.close()
    assert not ranks[0].path.exists()  # rank 0 removed the segment


def test_a_rank_that_never_arrives_or_died_fails_the_wait() -> None:
    ranks = _ranks(2)
    try:
        with pytest.raises(PeerGone, match=r"did not arrive within 0\.3 s"):
            ranks[0].all_reduce(torch.ones(4), timeout_s=0.3)
        dead = subprocess.Popen(["true"])
        dead.wait()
        ranks[0].register([os.getpid(), dead.pid])
        with pytest.raises(PeerGone, match="rank 1's process is gone"):
            ranks[0].all_reduce(torch.ones(4), timeout_s=30)
    finally:
        for shm in ranks:
            shm.close()
