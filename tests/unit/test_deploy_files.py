"""The deployment files under deploy/ are valid for the tools that read them."""

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import validate_config

from pdserve import config as pdserve_config
from pdserve.config import ClusterConfig, load_cluster_config

DEPLOY = Path(__file__).parents[2] / "deploy"


def test_ray_cluster_yaml_satisfies_rays_own_schema() -> None:
    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    validate_config(config)  # raises on any schema violation
    assert config["head_node_type"] in config["available_node_types"]
    assert any("pdserve" in command for command in config["setup_commands"])


def test_ray_schema_check_is_not_vacuous() -> None:
    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    config["available_node_types"]["gpu_worker"]["min_workers"] = "two"
    with pytest.raises(Exception, match="two"):
        validate_config(config)


@pytest.mark.parametrize("name", sorted(p.name for p in (DEPLOY / "config").glob("*.yaml")))
def test_every_example_config_loads(name: str) -> None:
    config = load_cluster_config(DEPLOY / "config" / name, env={})
    assert config.prefill.replicas + config.decode.replicas + config.mixed.replicas > 0
    if "8b" in name:
        assert config.engine.device == "cuda" and config.prefill.num_gpus == 1


def test_local_yaml_is_the_full_example() -> None:
    """deploy/config/local.yaml sets every setting of every section, each to its default."""
    document = yaml.safe_load((DEPLOY / "config" / "local.yaml").read_text())
    sections = {
        "engine": pdserve_config.EngineConfig,
        **pdserve_config.SECTIONS,
        "cluster": ClusterConfig,
    }
    assert list(document) == list(sections)
    for name, cls in sections.items():
        assert list(document[name]) == list(pdserve_config.settings_of(cls)), name
    assert load_cluster_config(DEPLOY / "config" / "local.yaml", env={}) == ClusterConfig()
