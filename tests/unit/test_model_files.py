"""Tiny model writer, loader errors, tokenizer and chat template, configuration sources."""

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.config import ClusterConfig, EngineConfig, load_cluster_config, load_engine_config
from pdserve.errors import ConfigError, InvalidRequestError, ModelLoadError
from pdserve.model.config import ModelConfig
from pdserve.model.loader import load_model
from pdserve.model.tiny import write_tiny_model
from pdserve.model.tokenizer import Tokenizer


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_per_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = write_tiny_model(tmp_path / "again", seed=0)
    other = write_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert digest(again / name) == digest(tiny_model_dir / name)
    assert digest(other / "model.safetensors") != digest(again / "model.safetensors")


def test_tiny_model_has_the_documented_shape(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        4,
        256,
        8,
        4,
    )
    assert config.vocab_size == Tokenizer.from_dir(tiny_model_dir).vocab_size


def test_loader_reads_bfloat16_weights(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.model_tag != load_model(tiny_model_dir).model_tag


def test_loader_rejects_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_loader_rejects_unsupported_architecture(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_loader_refuses_sliding_window_attention_when_enabled(
    tmp_path: Path, tiny_model_dir: Path, architecture: str
) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(architectures=[architecture], use_sliding_window=True, sliding_window=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{architecture} with sliding-window attention"):
        load_model(tmp_path)


def test_loader_rejects_weights_that_do_not_fit_the_config(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["intermediate_size"] = 512
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(tmp_path)


def test_chat_template_renders_roles_and_generation_prompt(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<s><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.token_id("<s>")
    assert ids.count(tokenizer.token_id("<s>")) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_tools_and_earlier_calls_as_transformers_would(
    tiny_model_dir: Path,
) -> None:
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    tool = {"type": "function", "function": {"name": "f", "description": "a <b> & c"}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": {"q": "é"}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[tool])
    # transformers' tojson: no HTML escapes, non-ASCII kept
    assert '{"type": "function", "function": {"name": "f", "description": "a <b> & c"}}' in text
    assert (
        '<|assistant|><tool_call>{"name": "f", "arguments": {"q": "é"}}</tool_call><|end|>' in text
    )
    assert text.endswith("<|tool|>42<|end|><|assistant|>")
    assert tokenizer.apply_chat_template(messages[:1]) == "<s><|user|>x<|end|><|assistant|>"


def test_named_templates_and_a_separate_template_file_are_read(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert (
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "a!"
    )
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.apply_chat_template([]) == "plain"
    assert tokenizer.apply_chat_template([], tools=[{"type": "function"}]) == "tools"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ raise_exception('no system role') }}"})
    )
    with pytest.raises(InvalidRequestError, match="no system role"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])


def test_missing_chat_template_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_config_layers_yaml_then_env_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "pdserve.yaml"
    path.write_text("engine:\n  block_size: 32\n  max_num_seqs: 8\n  dtype: bfloat16\n")
    env = {"PDSERVE_MAX_NUM_SEQS": "16", "PDSERVE_ENABLE_PREFIX_CACHING": "false"}
    config = load_engine_config(path, env=env, overrides={"dtype": "float32", "model": None})
    assert config == EngineConfig(
        block_size=32, max_num_seqs=16, dtype="float32", enable_prefix_caching=False
    )


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("engine:\n  blok_size: 4\n", "unknown engine setting"),
        ("engine:\n  block_size: many\n", "engine.block_size must be int"),
        ("engine:\n  block_size: -4\n", "must be positive"),
        ("engine:\n  dtype: int8\n", "engine.dtype"),
        ("- a list\n", "mapping"),
    ],
)
def test_config_errors_name_the_setting(tmp_path: Path, yaml_text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message):
        load_engine_config(path, env={})


def test_config_error_for_a_bad_environment_value() -> None:
    with pytest.raises(ConfigError, match=r"\$PDSERVE_NUM_KV_BLOCKS"):
        load_engine_config(env={"PDSERVE_NUM_KV_BLOCKS": "lots"})


def test_shipped_local_config_loads_with_defaults() -> None:
    path = Path(__file__).parents[2] / "deploy" / "config" / "local.yaml"
    assert load_engine_config(path, env={}) == EngineConfig()
    assert load_cluster_config(path, env={}) == ClusterConfig()


def test_cluster_config_sections_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  block_size: 8\ndecode:\n  replicas: 2\ncluster:\n  host: 0.0.0.0\n")
    env = {
        "PDSERVE_PREFILL_NUM_CPUS": "0.5",
        "PDSERVE_DECODE_REPLICAS": "3",
        "PDSERVE_ROUTER_BALANCE_ABS_THRESHOLD": "8",
    }
    config = load_cluster_config(path, env=env, overrides={"ray_address": "auto"})
    assert config.router.balance_abs_threshold == 8
    assert (config.engine.block_size, config.decode.replicas, config.prefill.num_cpus) == (
        8,
        3,
        0.5,
    )
    assert (config.host, config.ray_address) == ("0.0.0.0", "auto")
    path.write_text("routing: {}\n")
    with pytest.raises(ConfigError, match="unknown config section"):
        load_cluster_config(path, env={})


class _Allocations(TorchDispatchMode):
    """Every tensor a torch op returns during loading (dtype, device, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, torch.device, int, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                made = (tensor.dtype, tensor.device, tensor.nbytes, tuple(tensor.shape))
                self.made.append(made)
        return out


def test_weights_load_straight_into_the_target_dtype(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A bfloat16 checkpoint loads with no tensor the size of a weight in another dtype (the
    old loader first allocated the whole model in fp32, then cast). safetensors reads bytes and
    views them as the stored dtype: its uint8 buffers are that read, not a copy; the rotary
    tables (one row per position of the context) are fp32 on purpose."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in weights.items()}, str(tmp_path / "model.safetensors")
    )
    with _Allocations() as allocations:
        loaded = load_model(tmp_path)
    rotary = tuple(loaded.model.rotary.cos.shape)
    large = [a for a in allocations.made if a[2] >= 64 * 1024 and a[0] != torch.uint8]
    weights = [a for a in large if a[3][:1] != rotary[:1]]  # rotary: context-long tables
    assert weights and all(a[:2] == (torch.bfloat16, torch.device("cpu")) for a in weights)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_yarn_rope_without_its_pretraining_context_is_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="yarn needs original_max_position_embeddings"):
        load_model(tmp_path)
