"""A decode step (its inputs built from the persistent block-table rows, the model and the
logits selection) issues no host synchronisation: no `.item()`, no data-dependent shapes
(`nonzero`, boolean masks), no copy to the host. Recorded with a TorchDispatchMode over every
aten op the step runs (also those the C++ kernel calls)."""

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.model.attention import make_backend
from pdserve.model.loader import load_model
from pdserve.model.runner import ModelRunner, SequenceChunk

SYNCING = {
    "aten::_local_scalar_dense",  # .item(), int(tensor), bool(tensor)
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "boolean mask",
}


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.to_host: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        self.names.append(name)
        indices = args[1] if name.startswith("aten::index") else None
        if isinstance(indices, list | tuple) and any(
            i is not None and i.dtype == torch.bool for i in indices
        ):
            self.names.append("boolean mask")  # a data-dependent shape: nonzero inside
        result = func(*args, **(kwargs or {}))
        if name in ("aten::_to_copy", "aten::copy_"):
            source = args[1] if name == "aten::copy_" else args[0]
            target = result if name == "aten::_to_copy" else args[0]
            if source.device.type != "cpu" and target.device.type == "cpu":
                self.to_host.append(name)
        return result


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_decode_step_never_waits_for_the_device(tiny_model_dir: Path, backend: str) -> None:
    loaded = load_model(tiny_model_dir)
    loaded.model.attention = make_backend(backend, torch.device("cpu"))
    runner = ModelRunner.create(loaded.model, 32, 16, loaded.dtype)
    runner.execute([SequenceChunk(list(range(5, 40)), 0, [1, 2, 3], True)])  # the prompt
    decode = [
        SequenceChunk([7], 35, [1, 2, 3], True),
        SequenceChunk([8], 0, [9], True),
        SequenceChunk([9], 3, [10], False),  # a row that needs no logits
    ]
    with Ops() as ops:
        logits = runner.execute(decode)
    assert logits.shape[0] == 2
    assert len(ops.names) > 50  # the whole forward was seen
    assert SYNCING.isdisjoint(ops.names), sorted(SYNCING & set(ops.names))
    assert ops.to_host == []


OPS_PER_LAYER = 43  # aten ops (views included) of one decoder layer in a decode step, at most


def test_a_decode_step_runs_few_ops_per_layer(tiny_model_dir: Path) -> None:
    """Fused q/k/v and gate/up, one rotation for q and k, rotary tables once per step: the
    count is pinned so that a change that adds ops per layer shows up (52 before the fusion)."""
    loaded = load_model(tiny_model_dir)
    loaded.model.attention = make_backend("cpu", torch.device("cpu"))
    runner = ModelRunner.create(loaded.model, 32, 16, loaded.dtype)
    runner.execute([SequenceChunk(list(range(5, 40)), 0, [1, 2, 3], True)])
    decode = [SequenceChunk([7], 35, [1, 2, 3], True), SequenceChunk([8], 0, [9], True)]
    inputs = runner._prepare(decode)
    positions, meta = runner.metadata(inputs)
    with Ops() as ops:
        loaded.model(inputs.token_ids, positions, runner.kv_cache, meta)
    layers = loaded.config.num_layers
    assert len(ops.names) <= OPS_PER_LAYER * layers + 8, len(ops.names) / layers
