"""Load a Hugging Face model directory: config, safetensors weights, tokenizer, chat template."""

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.errors import ModelLoadError
from pdserve.model.config import ARCHITECTURES, ModelConfig, parse_dtype
from pdserve.model.kv_quant import KVScales, checkpoint_scales
from pdserve.model.layers import RotaryEmbedding
from pdserve.model.linear import can_pack
from pdserve.model.llama import CausalLM
from pdserve.model.moe import Experts
from pdserve.model.parallel import Shard, TPGroup, check_divides
from pdserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    model_tag: str
    """Identifies weights + dtype; the root of block hashes, so different models never share KV."""
    kv_scales: KVScales | None = None
    """The checkpoint's FP8 KV cache scales (`k_scale`/`v_scale`/`kv_scale`), if it has any."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.config, self.tokenizer)


def eos_token_ids(config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens that end a generation: the model config's (`eos_token_id`, one or a list),
    else the tokenizer's EOS token."""
    if config.eos_token_ids:
        return config.eos_token_ids
    eos = tokenizer.eos_token_id
    return () if eos is None else (eos,)


def load_model(
    path: str | Path,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    group: TPGroup | None = None,
) -> LoadedModel:
    """Load `path` (with a tensor-parallel `group`: this rank's part of every weight, read as
    slices of the checkpoint's tensors); raises ModelLoadError with a one-line reason when it
    cannot, ConfigError when the group's size does not split the model."""
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    config = ModelConfig.from_dir(model_dir)
    torch_dtype = config.dtype if dtype == "auto" else parse_dtype(dtype)
    context = config.context_window(max_model_len)
    torch_device = torch.device(device)
    shard = group.shard if group is not None else Shard()
    check_divides(shard, config)
    with torch.device("meta"):  # no memory: each parameter is materialised by its weight
        model = CausalLM(config, context, shard)
    found_scales = _load_weights(model, model_dir, torch_dtype, torch_device)
    model.tie_weights()
    if group is not None:
        model.set_group(group)
    model.fuse()
    if can_pack(torch_device, torch_dtype):
        model.pack()
    model.rotary = RotaryEmbedding(config, context).to(torch_device)  # meta buffers, rebuilt
    model.eval()
    tag = _model_tag(model_dir, torch_dtype)
    logger.info(
        "loaded %s from %s (%s, %s, context %d)",
        config.architecture,
        model_dir,
        torch_dtype,
        device,
        context,
    )
    return LoadedModel(
        model_dir,
        config,
        model,
        Tokenizer.from_dir(model_dir),
        torch_dtype,
        torch_device,
        context,
        tag,
        _checkpoint_scales(found_scales, model),
    )


def _checkpoint_scales(found: dict[tuple[int, str], float], model: CausalLM) -> KVScales | None:
    planes = 1 if model.config.mla is not None else 2
    try:
        return checkpoint_scales(found, model.config.num_layers, planes)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"no model.safetensors (or sharded index) in {model_dir}")


def _load_weights(
    model: CausalLM, model_dir: Path, dtype: torch.dtype, device: torch.device
) -> dict[tuple[int, str], float]:
    """Replace each (meta) parameter by its checkpoint tensor, read onto `device` (safetensors
    reads a CUDA target's shards straight to the GPU) and cast there one tensor at a time: no
    fp32 copy of the model, no full host copy for a GPU. Experts are copied into their layer's
    stacked weights (`_ExpertWeights`). Returns the KV cache scales the checkpoint holds, by
    (layer, name)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    traits = ARCHITECTURES[model.config.architecture]
    layout = traits.moe
    experts = _ExpertWeights(model, layout.projections if layout else (), dtype, device)
    loaded: set[str] = set()
    scales: dict[tuple[int, str], float] = {}
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device=str(device)) as shard:
            for stored in shard.keys():  # noqa: SIM118  (safe_open is not a dict)
                name = stored
                if layout is not None and layout.block != "mlp":
                    name = stored.replace(f".{layout.block}.", ".mlp.")
                if traits.extra_layers and _layer(name) >= model.config.num_layers:
                    continue  # a multi-token-prediction module: not served
                if experts.take(shard, stored, name):
                    continue
                scale = _KV_SCALE.fullmatch(name)
                if scale is not None:
                    value = shard.get_tensor(stored).float().reshape(-1)
                    scales[int(scale.group(1)), scale.group(2)] = float(value.max())
                    continue
                if name not in params or (
                    name == "lm_head.weight" and model.config.tie_word_embeddings
                ):
                    if "rotary_emb" in name or name == "lm_head.weight":
                        continue
                    raise ModelLoadError(f"unexpected weight {stored!r} in {file.name}")
                tensor = _read(shard, stored, model.shard, model.config.vocab_size)
                if tensor.shape != params[name].shape:
                    raise ModelLoadError(
                        f"weight {stored!r} has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(params[name].shape)}"
                    )
                owner, _, leaf = name.rpartition(".")
                module = model.get_submodule(owner)
                target = torch.float32 if getattr(module, "keep_float32", False) else dtype
                if getattr(module, "keep_stored_dtype", False) and leaf != "bias":
                    target = tensor.dtype  # FP8 weights and their scales, as stored
                weight = torch.nn.Parameter(tensor.to(dtype=target), requires_grad=False)
                setattr(module, leaf, weight)
                loaded.add(name)
    loaded |= experts.complete()
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")  # the same Parameter as the embedding
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]!r}")
    return scales


def _layer(name: str) -> int:
    """The decoder layer a weight belongs to (-1: none)."""
    match = _LAYER.match(name)
    return -1 if match is None else int(match.group(1))


_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale_inv)")


class _ExpertWeights:
    """Fills every layer's stacked expert weights (`Experts`) from the checkpoint's per-expert
    tensors (`projections`: the family's gate, up and down names): only this rank's experts are
    read, and of each only the width this rank holds."""

    def __init__(
        self,
        model: CausalLM,
        projections: tuple[str, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.projections = projections
        self.dtype = dtype
        self.device = device
        self.copied: dict[str, int] = {}  # layer's Experts path -> expert tensors copied

    def take(self, file: Any, stored: str, name: str) -> bool:
        """Copy `stored` (module name `name`) if it is an expert's weight; False if it is not."""
        match = _EXPERT.fullmatch(name)
        if match is None:
            return False
        path, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        scale = match.group(4) == "weight_scale_inv"
        try:
            experts = self.model.get_submodule(path)
        except AttributeError:
            experts = None
        if (
            not isinstance(experts, Experts)
            or projection not in self.projections
            or (scale and experts.block is None)
        ):
            raise ModelLoadError(f"unexpected weight {stored!r}: config.json implies none")
        part = experts.part
        if not part.owns(expert):
            return True  # another rank's: never read
        which = self.projections.index(projection)
        # an FP8 scale covers blocks: its rows / columns of this rank's width are as many blocks
        unit = 1 if not scale or experts.block is None else experts.block[0 if which < 2 else 1]
        columns = slice(part.width_start // unit, (part.width_start + part.width) // unit)
        source = file.get_slice(stored)
        tensor = source[columns] if which < 2 else source[:, columns]
        if experts.gate_up.is_meta:
            self._materialize(experts)
        target = self._target(experts, expert - part.first, which, scale)
        if tensor.shape != target.shape:
            raise ModelLoadError(
                f"weight {stored!r} has shape {tuple(source.get_shape())}, config.json implies "
                f"{'a width' if which < 2 else 'a hidden size'} that does not match"
            )
        with torch.no_grad():
            target.copy_(tensor)
        self.copied[path] = self.copied.get(path, 0) + 1
        return True

    @staticmethod
    def _target(experts: Experts, local: int, which: int, scale: bool) -> torch.Tensor:
        """Where expert `local`'s projection `which` (gate, up, down) or its FP8 scale goes."""
        gate_up = experts.gate_up_scale if scale else experts.gate_up
        down = experts.down_scale if scale else experts.down
        assert gate_up is not None and down is not None
        if which == 2:
            return down[local]
        rows = gate_up.shape[1] // 2
        return gate_up[local, which * rows : (which + 1) * rows]

    def _materialize(self, experts: Experts) -> None:
        """Allocate the stacked weights (the model's dtype, or FP8 with float32 scales)."""
        fp8 = experts.block is not None
        for leaf in ("gate_up", "down", "gate_up_scale", "down_scale"):
            held = getattr(experts, leaf)
            if held is None:
                continue
            dtype = torch.float32 if leaf.endswith("scale") else held.dtype if fp8 else self.dtype
            empty = torch.empty(held.shape, dtype=dtype, device=self.device)
            setattr(experts, leaf, torch.nn.Parameter(empty, requires_grad=False))

    def complete(self) -> set[str]:
        """The stacked weights (and scales) every expert of which was copied."""
        done = set()
        for path, module in self.model.named_modules():
            if not isinstance(module, Experts):
                continue
            leaves = (
                ("gate_up", "down")
                if module.block is None
                else ("gate_up", "down", "gate_up_scale", "down_scale")
            )
            if self.copied.get(path, 0) == 3 * len(leaves) // 2 * module.part.count:
                done |= {f"{path}.{leaf}" for leaf in leaves}
        return done


# split by rows (MLA: q_b_proj and kv_b_proj by heads; q_a_proj and kv_a_proj_with_mqa, the
# latent's, are whole on every rank)
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")  # weights split by columns
_VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def _read(file: Any, name: str, part: Shard, vocab: int) -> torch.Tensor:
    """The checkpoint tensor `name`, or only this rank's part of it (`pdserve.model.parallel`):
    a slice read straight from the file, never the whole tensor."""
    if part.size == 1:
        return file.get_tensor(name)  # type: ignore[no-any-return]
    module, leaf = name.split(".")[-2:]
    source = file.get_slice(name)
    if module in _VOCAB_PARALLEL:
        first, rows = part.vocab_rows(vocab)
        held = source[first : min(first + rows, vocab)]
        missing = rows - held.shape[0]  # the last rank's padding rows
        return torch.cat([held, held.new_zeros(missing, *held.shape[1:])]) if missing else held
    if module in _COLUMN_PARALLEL:
        start, length = part.split(source.get_shape()[0], f"{module} rows")
        return source[start : start + length]  # type: ignore[no-any-return]
    if module in _ROW_PARALLEL and leaf in ("weight", "weight_scale_inv"):
        start, length = part.split(source.get_shape()[1], f"{module} columns")
        return source[:, start : start + length]  # type: ignore[no-any-return]
    tensor: torch.Tensor = source[:]
    if module in _ROW_PARALLEL and part.rank > 0:  # a bias: added once, by rank 0's partial sum
        return torch.zeros_like(tensor)
    return tensor


def model_tag(path: str | Path, dtype: str = "auto") -> str:
    """The tag `load_model(path, dtype=dtype)` gives, without loading weights (for the router)."""
    model_dir = Path(path).expanduser()
    config = ModelConfig.from_dir(model_dir)
    return _model_tag(model_dir, config.dtype if dtype == "auto" else parse_dtype(dtype))


def _model_tag(model_dir: Path, dtype: torch.dtype) -> str:
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in _weight_files(model_dir):
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    digest.update(str(dtype).encode())
    return digest.hexdigest()[:16]
