"""Config loading: per-role engine settings, unknown PDSERVE_* variables, invalid choices."""

import dataclasses
from pathlib import Path

import pytest

from pdserve.choices import PrefillPolicyName, ToolParserName, TransportName, registry
from pdserve.config import (
    EVICTION_POLICIES,
    PREFILL_POLICIES,
    TOOL_PARSERS,
    ClusterConfig,
    EngineConfig,
    RouterConfig,
    SentinelURL,
    StorageConfig,
    TransferConfig,
    check_environment,
    choices_of,
    known_variables,
    load_cluster_config,
    load_engine_config,
    variable_name,
)
from pdserve.errors import ConfigError
from pdserve.kvcache import eviction
from services.router.policies import POLICIES
from services.router.tool_calls import PARSERS


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pdserve.yaml"
    path.write_text(text)
    return path


def test_role_yaml_engine_override_applies_to_that_role_only(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "engine:\n  num_kv_blocks: 100\n  max_num_seqs: 8\n"
        "decode:\n  replicas: 2\n  engine:\n    num_kv_blocks: 40\n    torch_threads: 2\n",
    )
    config = load_cluster_config(path, env={})
    decode = config.engine_for("decode")
    assert (decode.num_kv_blocks, decode.torch_threads, decode.max_num_seqs) == (40, 2, 8)
    assert config.decode.replicas == 2
    assert (
        config.engine_for("prefill")
        == config.engine
        == EngineConfig(num_kv_blocks=100, max_num_seqs=8)
    )
    assert config.engine_for("mixed") is config.engine


def test_role_environment_override_wins_over_role_yaml(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "decode:\n  engine:\n    num_kv_blocks: 40\n")
    env = {
        "PDSERVE_NUM_KV_BLOCKS": "10",
        "PDSERVE_DECODE_ENGINE_NUM_KV_BLOCKS": "64",
        "PDSERVE_PREFILL_ENGINE_MAX_NUM_BATCHED_TOKENS": "2048",
    }
    config = load_cluster_config(path, env=env)
    assert config.engine_for("decode").num_kv_blocks == 64
    assert config.engine_for("prefill") == EngineConfig(
        num_kv_blocks=10, max_num_batched_tokens=2048
    )
    assert config.engine.num_kv_blocks == 10


def test_role_engine_is_none_without_overrides(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "engine:\n  max_num_seqs: 4\nprefill:\n  engine: {}\n")
    config = load_cluster_config(path, env={})
    assert (config.prefill.engine, config.decode.engine, config.mixed.engine) == (None, None, None)
    for role in ("prefill", "decode", "mixed"):
        assert config.engine_for(role) is config.engine


def test_engine_for_rejects_an_unknown_role() -> None:
    with pytest.raises(ConfigError, match=r"unknown role 'router'.*prefill, decode, mixed"):
        ClusterConfig().engine_for("router")


def test_old_role_variable_is_rejected_with_the_engine_spelling() -> None:
    with pytest.raises(ConfigError, match="PDSERVE_DECODE_NUM_KV_BLOCKS") as info:
        load_cluster_config(env={"PDSERVE_DECODE_NUM_KV_BLOCKS": "40"})
    assert "did you mean PDSERVE_DECODE_ENGINE_NUM_KV_BLOCKS?" in str(info.value)


def test_unknown_variable_is_rejected_by_the_engine_loader_too() -> None:
    with pytest.raises(ConfigError, match=r"PDSERVE_BLOK_SIZE \(did you mean PDSERVE_BLOCK_SIZE"):
        load_engine_config(env={"PDSERVE_BLOK_SIZE": "32"})


def test_known_variables_pass_the_environment_check() -> None:
    env = {name: "x" for name in known_variables()} | {"HOME": "/root", "PDSERVEX": "1"}
    check_environment(env)
    assert {
        "PDSERVE_BLOCK_SIZE",
        "PDSERVE_PLACEMENT_STRATEGY",
        "PDSERVE_DECODE_REPLICAS",
        "PDSERVE_MIXED_ENGINE_DEVICE",
        "PDSERVE_ADMIN_TOKEN",
    } <= known_variables()
    assert "PDSERVE_DECODE_ENGINE" not in known_variables()


def test_unknown_key_in_role_engine_section_is_named(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "decode:\n  engine:\n    num_kv_blokcs: 40\n")
    with pytest.raises(ConfigError, match=r"decode\.engine\.num_kv_blokcs") as info:
        load_cluster_config(path, env={})
    assert "did you mean decode.engine.num_kv_blocks?" in str(info.value)


def test_engine_setting_directly_in_role_section_is_rejected(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "decode:\n  num_kv_blocks: 40\n")
    with pytest.raises(ConfigError, match=r"unknown decode setting\(s\): decode\.num_kv_blocks"):
        load_cluster_config(path, env={})


def test_role_engine_section_must_be_a_mapping(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "prefill:\n  engine: 40\n")
    with pytest.raises(ConfigError, match=r"prefill\.engine .* must be a mapping"):
        load_cluster_config(path, env={})


def test_merged_role_engine_is_validated(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "mixed:\n  engine:\n    max_num_seqs: 0\n")
    with pytest.raises(ConfigError, match=r"mixed\.engine.*max_num_seqs must be positive"):
        load_cluster_config(path, env={})
    with pytest.raises(ConfigError, match=r"\$PDSERVE_DECODE_ENGINE_NUM_KV_BLOCKS must be int"):
        load_cluster_config(env={"PDSERVE_DECODE_ENGINE_NUM_KV_BLOCKS": "lots"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("block_size", "32"),
        ("dtype", "float32"),
        ("model", "/models/other"),
        ("tensor_parallel_size", "2"),  # prefill and decode of different TP sizes: refused
        ("kv_cache_dtype", "fp8_e4m3"),  # a decode whose KV layout differs: refused
    ],
)
def test_role_may_not_change_a_shared_engine_setting(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"decode\.engine\.{name} .* differs from engine\."):
        load_cluster_config(env={f"PDSERVE_DECODE_ENGINE_{name.upper()}": value})


def test_role_engine_device_may_differ() -> None:
    env = {"PDSERVE_DECODE_ENGINE_DEVICE": "cuda", "PDSERVE_DECODE_NUM_GPUS": "1"}
    config = load_cluster_config(env=env)
    assert (config.engine_for("decode").device, config.engine.device) == ("cuda", "cpu")


def test_bad_prefill_policy_is_rejected_with_the_choices(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "router:\n  prefill_policy: cache-aware\n")
    expected = r"router\.prefill_policy must be one of round_robin, least_load, cache_aware"
    with pytest.raises(ConfigError, match=expected):
        load_cluster_config(path, env={})
    with pytest.raises(ConfigError, match="'random'"):
        RouterConfig(prefill_policy="random")


def test_choice_lists_are_their_registries() -> None:
    """Each list config.py checks is the enum its registry is keyed by, and `registry` refuses
    a registry that misses or adds a name."""
    assert PREFILL_POLICIES == tuple(POLICIES) == tuple(PrefillPolicyName)
    assert TOOL_PARSERS == tuple(PARSERS) == tuple(ToolParserName)
    assert tuple(eviction.EVICTION_POLICIES) == EVICTION_POLICIES
    with pytest.raises(TypeError, match=r"missing \['llama3_json'\]"):
        registry(ToolParserName, {ToolParserName.HERMES: object})


def test_choice_settings_list_their_choices() -> None:
    """Every choice setting carries its list (the configuration reference prints it) and is
    checked against it."""
    choices = {
        f"{cls.__name__}.{field.name}": choices_of(field)
        for cls in (EngineConfig, RouterConfig, TransferConfig, StorageConfig, ClusterConfig)
        for field in dataclasses.fields(cls)
        if choices_of(field)
    }
    assert choices["EngineConfig.attention_backend"] == ("auto", "reference", "cpu", "triton")
    assert choices["TransferConfig.transport"] == tuple(TransportName)
    assert choices["EngineConfig.kv_cache_dtype"] == ("auto", "fp8_e4m3")
    assert choices["RouterConfig.disaggregation"] == ("always", "never", "auto")
    assert len(choices) == 12
    with pytest.raises(ConfigError, match=r"engine\.attention_backend must be one of auto, "):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match=r"storage\.device_write_policy must be one of"):
        StorageConfig(device_write_policy="always")
    with pytest.raises(ConfigError, match=r"router\.disaggregation must be one of"):
        RouterConfig(disaggregation="sometimes")
    with pytest.raises(ConfigError, match=r"router\.kv_transfer_gbps must be positive"):
        RouterConfig(kv_transfer_gbps=0)
    assert RouterConfig(tool_parser=None).tool_parser is None


def test_variable_names() -> None:
    assert variable_name("engine", "num_kv_blocks") == "PDSERVE_NUM_KV_BLOCKS"
    assert variable_name("cluster", "state_dir") == "PDSERVE_STATE_DIR"
    assert variable_name("decode", "replicas") == "PDSERVE_DECODE_REPLICAS"
    assert variable_name("decode.engine", "seed") == "PDSERVE_DECODE_ENGINE_SEED"
    assert {"PDSERVE_DECODE_ENGINE_SEED", "PDSERVE_ADMIN_TOKEN"} <= known_variables()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PDSERVE_PLACEMENT_STRATEGY": "pack"}, r"cluster\.placement_strategy must be one of"),
        ({"PDSERVE_DEVICE": "gpu"}, r"engine\.device must be cpu, cuda or cuda:N, got 'gpu'"),
        ({"PDSERVE_DTYPE": "int8"}, r"engine\.dtype must be one of auto, float32"),
        ({"PDSERVE_TRANSFER_TRANSPORT": "rdma"}, r"transfer\.transport must be one of"),
        ({"PDSERVE_TRANSFER_MOONCAKE_PROTOCOL": "udp"}, r"transfer\.mooncake_protocol"),
        ({"PDSERVE_STORAGE_STORE": "s3"}, r"storage\.store must be one of directory, memory"),
        ({"PDSERVE_STORAGE_DEVICE_WRITE_POLICY": "always"}, r"storage\.device_write_policy"),
        ({"PDSERVE_STORAGE_REDIS_URL": "localhost:6379"}, r"storage\.redis_url must start with"),
        ({"PDSERVE_STORAGE_REDIS_URL": "redis+sentinel://:pw@/main"}, r"names no Sentinel"),
        ({"PDSERVE_STORAGE_REDIS_URL": "redis+sentinel://s1:26379"}, r"/primary-name or"),
        ({"PDSERVE_STORAGE_REDIS_URL": "redis+sentinel://s1/main"}, r"a Sentinel is host:port"),
        ({"PDSERVE_STORAGE_REDIS_URL": "redis+sentinel://s:1/m?db=2"}, r"unknown Sentinel URL"),
    ],
)
def test_invalid_choice_is_rejected_naming_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_cluster_config(env=env)


def test_valid_choices_load(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "engine:\n  device: cuda:0\nrouter:\n  prefill_policy: least_load\n"
        "prefill:\n  num_gpus: 1\ndecode:\n  num_gpus: 1\n"
        "storage:\n  redis_url: rediss://redis.example:6380/0\n"
        "cluster:\n  placement_strategy: STRICT_SPREAD\n",
    )
    config = load_cluster_config(path, env={})
    assert (config.engine.device, config.router.prefill_policy) == ("cuda:0", "least_load")
    assert config.placement_strategy == "STRICT_SPREAD"


def test_a_sentinel_url_names_the_sentinels_the_primary_and_both_logins() -> None:
    url = SentinelURL.parse(
        "rediss+sentinel://app:p%40ss@s1:26379,[::1]:26380/main/2"
        "?sentinel_password=t0p&ssl_ca_certs=/etc/ca.pem"
    )
    assert url.sentinels == (("s1", 26379), ("::1", 26380))
    assert (url.primary, url.db, url.username, url.password) == ("main", 2, "app", "p@ss")
    assert url.tls and url.tls_options == (("ssl_ca_certs", "/etc/ca.pem"),)
    assert (url.sentinel_username, url.sentinel_password) == (None, "t0p")
    plain = SentinelURL.parse("redis+sentinel://s1:26379/main")
    assert (plain.db, plain.username, plain.password, plain.tls) == (0, None, None, False)


def test_a_malformed_sentinel_url_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as error:
        StorageConfig(redis_url="redis+sentinel://app:s3cret@s1:26379")
    assert "s3cret" not in str(error.value)


def test_section_name_under_cluster_is_an_unknown_key(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "cluster:\n  decode:\n    replicas: 2\n")
    with pytest.raises(ConfigError, match=r"unknown cluster setting\(s\): cluster\.decode"):
        load_cluster_config(path, env={})


@pytest.mark.parametrize(
    ("yaml_text", "fragment"),
    [
        ("engine: {device: cuda}\n", "prefill.num_gpus is 0"),
        ("engine: {device: cpu}\ndecode: {num_gpus: 1}\n", "GPUs would sit unused"),
        ("engine: {device: 'cuda:1'}\nprefill: {num_gpus: 1}\ndecode: {num_gpus: 1}\n",
         "first visible one"),
        ("engine: {device: cuda}\nprefill: {num_gpus: 2}\ndecode: {num_gpus: 1}\n",
         "tensor_parallel_size"),
    ],
)  # fmt: skip
def test_devices_must_match_the_gpus_ray_gives_each_role(
    tmp_path: Path, yaml_text: str, fragment: str
) -> None:
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=fragment):
        load_cluster_config(path, env={})


def test_a_fraction_of_a_gpu_and_roles_without_replicas_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "pdserve.yaml"
    path.write_text(
        "engine: {device: cuda}\nprefill: {num_gpus: 0.5}\ndecode: {num_gpus: 0.5}\n"
        "mixed: {replicas: 0, num_gpus: 0}\n"
    )
    config = load_cluster_config(path, env={})
    assert (config.prefill.num_gpus, config.engine.device) == (0.5, "cuda")


def test_onednn_cache_entries_may_be_zero_not_negative(tmp_path: Path) -> None:
    assert load_cluster_config(_yaml(tmp_path, "engine:\n  onednn_cache_entries: 0\n"), env={})
    path = _yaml(tmp_path, "engine:\n  onednn_cache_entries: -1\n")
    with pytest.raises(ConfigError, match=r"engine\.onednn_cache_entries must be >= 0, got -1"):
        load_cluster_config(path, env={})
