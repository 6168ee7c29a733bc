"""The FP8 KV cache: quantisation and its scales (measured, or the checkpoint's), the layout it
gives (bytes per block, the storage tag) and the error it costs against the full-precision
cache."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import LLMEngine
from pdserve.errors import ConfigError, ModelLoadError
from pdserve.model.config import ModelConfig
from pdserve.model.kv_quant import FP8, FP8_MAX, KVScales, dequantize, quantize
from pdserve.model.loader import load_model
from pdserve.model.runner import SequenceChunk
from pdserve.model.tiny import default_model_dir, write_tiny_model


def test_quantize_keeps_three_mantissa_bits_and_saturates() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=generator) * 3
    scale = 0.25
    q = quantize(x, scale)
    assert q.dtype == FP8
    back = dequantize(q, scale, torch.float32)
    normal = x.abs() >= scale * 2**-6  # e4m3's smallest normal, scaled
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max().item() <= 2**-4  # half of e4m3's 2^-3 spacing
    assert relative.mean().item() > 2**-8  # and it does round
    huge = quantize(torch.tensor([1e6, -1e6]), scale)
    assert dequantize(huge, scale, torch.float32).tolist() == [FP8_MAX * scale, -FP8_MAX * scale]


def test_measured_scales_are_powers_of_two_with_headroom() -> None:
    amax = torch.tensor([[448.0, 3.0], [0.0, 1e-3]])  # [layers, planes]
    scales = KVScales.from_amax(amax)
    assert scales.source == "calibrated"
    assert scales.planes == ((2.0, 1.0), (2.0**-6, 2.0**-17))
    for plane, column in zip(scales.planes, amax.T, strict=True):
        for scale, largest in zip(plane, column.tolist(), strict=True):
            if largest:
                assert 2 * largest <= scale * FP8_MAX < 4 * largest
    assert scales.layer(1) == (1.0, 2.0**-17)
    assert scales.digest() != KVScales.from_amax(amax * 4).digest()


def write_with_scales(path: Path, scales: dict[str, float]) -> Path:
    """The tiny model with KV scale tensors added to its checkpoint (as FP8 checkpoints store
    them: one float per layer and name)."""
    model = write_tiny_model(path)
    weights = load_file(model / "model.safetensors")
    for name, value in scales.items():
        weights[name] = torch.tensor(value)
    save_file(weights, str(model / "model.safetensors"))
    return model


def test_the_checkpoints_scales_are_read_and_used(
    tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    scales = {
        f"model.layers.{layer}.self_attn.{name}": 0.5 * (layer + 1) + (name == "v_scale")
        for layer in range(4)
        for name in ("k_scale", "v_scale")
    }
    model = write_with_scales(tmp_path / "scaled", scales)
    loaded = load_model(model)
    assert loaded.kv_scales is not None and loaded.kv_scales.source == "checkpoint"
    assert loaded.kv_scales.planes == ((0.5, 1.0, 1.5, 2.0), (1.5, 2.0, 2.5, 3.0))
    engine = make_engine(model=str(model), kv_cache_dtype="fp8_e4m3", num_kv_blocks=16)
    assert engine.loaded.model.kv_scales == loaded.kv_scales
    attention = engine.loaded.model.model.decoder_layers()[2].self_attn
    assert attention.kv_scales == (1.5, 2.5)


def test_a_checkpoint_with_scales_for_some_layers_only_is_refused(tmp_path: Path) -> None:
    model = write_with_scales(tmp_path / "partial", {"model.layers.0.self_attn.kv_scale": 0.5})
    with pytest.raises(ModelLoadError, match="none for layer 1"):
        load_model(model)


def test_an_fp8_cache_holds_a_quarter_of_float32_bytes_under_its_own_tag(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Tiny model (float32): same blocks, a quarter of the bytes; the storage tag names the
    element type and the scales, and two engines measure the same scales."""
    from pdserve.engine.engine import storage_tag

    full = make_engine(num_kv_blocks=16)
    fp8 = make_engine(num_kv_blocks=16, kv_cache_dtype="fp8_e4m3")
    again = make_engine(num_kv_blocks=16, kv_cache_dtype="fp8_e4m3")
    assert fp8.runner.kv_cache.dtype == FP8
    assert fp8.runner.kv_cache.shape == full.runner.kv_cache.shape
    assert fp8.runner.stager.block_bytes * 4 == full.runner.stager.block_bytes
    tags = [storage_tag(e.loaded, 16) for e in (full, fp8, again)]
    assert tags[1] != tags[0] and "float8_e4m3fn" in tags[1] and tags[1] == tags[2]
    assert fp8.loaded.model.kv_scales == again.loaded.model.kv_scales
    assert fp8.loaded.model.kv_scales is not None
    assert fp8.loaded.model.kv_scales.source == "calibrated"


def test_fp8_logits_stay_close_to_the_full_precision_cache(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Last-position logits after a 60-token prompt and 8 decode steps: within 5 % of their
    scale of the full-precision cache's, and not equal to them (the cache is quantised)."""
    engines = [
        make_engine(num_kv_blocks=16),
        make_engine(num_kv_blocks=16, kv_cache_dtype="fp8_e4m3"),
    ]
    tokens = [(5 * i + 7) % 250 for i in range(60)]
    logits = []
    for engine in engines:
        runner = engine.runner
        runner.execute([SequenceChunk(tokens, 0, range(5), True)])
        for step in range(8):
            out = runner.execute([SequenceChunk([step + 40], 60 + step, range(5), True)])
        logits.append(out[0])
    full, fp8 = logits
    error = (fp8 - full).abs().max().item()
    assert 0 < error <= 0.05 * full.abs().max().item()


FP8_WEIGHTS = {
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
}


def test_fp8_on_a_gpu_the_triton_kernels_cannot_serve_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton reads float8 e4m3 from compute capability 8.9 (Ada, Hopper) on: an A100 (8.0)
    is refused naming the setting; the CPU kernels and the reference read it anywhere. The
    GPU's reported capability is the faked side."""
    from pdserve.engine.engine import check_fp8_backend, check_fp8_weights

    capability = (8, 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"engine\.kv_cache_dtype fp8_e4m3 .* cuda:0 is 8\.0"):
        check_fp8_backend("triton", gpu)
    check_fp8_backend("reference", gpu)
    check_fp8_backend("cpu", torch.device("cpu"))
    fp8_weights = ModelConfig.from_hf_dict(
        {**json.loads((default_model_dir() / "config.json").read_text()), **FP8_WEIGHTS}
    )
    with pytest.raises(ConfigError, match=r"engine\.model's FP8 weights .* cuda:0 is 8\.0"):
        check_fp8_weights(fp8_weights, gpu)
    check_fp8_weights(fp8_weights, torch.device("cpu"))
    capability = (9, 0)
    check_fp8_backend("triton", gpu)
    check_fp8_weights(fp8_weights, gpu)


def test_an_unknown_kv_cache_dtype_is_refused() -> None:
    from pdserve.config import EngineConfig

    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int8")
